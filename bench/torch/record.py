#!/usr/bin/env python3
"""Turns bench_torch.py's JSON into the markdown section of bench/RESULTS.md.

    python3 bench/torch/record.py RUN.json "COMMAND" > section.md

Every figure comes from the JSON; nothing is typed by hand.
"""

import json
import sys

GiB = 1 << 30


def rows(part, doc):
    rs = doc[part]
    floor = doc[f"{part}_floor_s"]
    out = ["| variant | step s | x floor | GPU peak GiB | H2D GB/step | D2H GB/step | hit rate |",
           "|---|---|---|---|---|---|---|"]
    for name, r in rs.items():
        if "error" in r:
            out.append(f"| {name} | error: {r['error'][:80]} | | | | | |")
            continue
        hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else ""
        out.append(
            f"| {name} | {r['step_s']:.3f} | {r['step_s'] / floor:.3f} | "
            f"{r.get('gpu_peak_bytes', 0) / GiB:.2f} | {r.get('h2d_bytes_per_step', 0) / 1e9:.2f} | "
            f"{r.get('d2h_bytes_per_step', 0) / 1e9:.2f} | {hit} |")
    return out


def run_block(doc, command):
    """The lines for one run: what ran, its tables and its checks."""
    a = doc["args"]
    def timing():
        timed = doc["train"].get("learned", {}).get("timed_steps")
        if not timed or len(timed) == a["train_steps"] - 1:
            return "median of the steps after the first"
        return (f"median of the steps after the first; Spillway's variants: of steps "
                f"{timed[0]} to {timed[-1]}, step {a['train_steps']}, which reads every "
                f"gradient for the bit-identity check, not timed")

    def part(name, head):
        return [head, "", *rows(name, doc), ""] if doc[name] else []

    lines = [
        f"Run: `{command}` on {doc['device']} (torch {doc['torch']}, transformers "
        f"{doc.get('transformers', '?')}, spillway {doc['spillway']}). Model: Llama architecture, "
        f"{a['layers']} layers, hidden {a['hidden']}, {doc['weights_bytes'] / GiB:.2f} GiB of bf16 "
        f"weights = {doc['weights_bytes'] / doc['gpu_budget_bytes']:.2f}x the pool's GPU budget "
        f"({a['gpu_budget']}, pages {a['page_size']}). Floor = max(resident, copy floor).",
        "",
        *part("train", f"Training: batch {a['train_batch']} x {a['seq']} tokens, AdamW, "
              f"{a['train_steps']} steps ({timing()}); floor "
              f"{doc['train_floor_s']:.3f} s; attention `{a.get('attn', 'sdpa')}`."),
        *part("infer", f"Inference: batch {a['infer_batch']} x {a['infer_seq']} tokens, forward "
              f"only; floor {doc['infer_floor_s']:.3f} s."),
    ]
    learned = doc["train"].get("learned", {})
    checks = {k: learned.get(k) for k in ("losses_equal", "grads_equal", "weights_equal")}
    if learned:
        lines.append(f"Bit-identical to resident training over {a['train_steps']} steps: {checks}.")
    il = doc["infer"].get("learned", {})
    if "logits_equal" in il:
        lines.append(f"Inference logits equal to resident: {il['logits_equal']}.")
    for k in ("train_fsdp2_over_learned", "train_on_demand_over_learned",
              "infer_accelerate_over_learned", "infer_handwritten_over_learned",
              "infer_on_demand_over_learned"):
        if k in doc:
            lines.append(f"- `{k}`: {doc[k]:.2f}")
    return lines


def main():
    doc = json.load(open(sys.argv[1]))
    command = sys.argv[2] if len(sys.argv) > 2 else "python3 bench/torch/bench_torch.py"
    print("\n".join(run_block(doc, command)))


if __name__ == "__main__":
    main()
