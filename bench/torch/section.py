#!/usr/bin/env python3
"""Writes bench/RESULTS.md's spillway.torch section (issue 11) from bench_torch.py runs.

    python3 bench/torch/section.py MAIN.json "MAIN COMMAND" IDENTITY.json "IDENTITY COMMAND" \
        [--write bench/RESULTS.md]

MAIN is a full run (training and inference, every variant); IDENTITY a training run with
eager attention, whose bit-identity to the resident run is the claim (cuDNN's sdpa
backward is non-deterministic, so two resident runs differ there too). Every figure,
the verdict and the summary row come from the JSON; nothing is typed by hand.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from results_page import emit  # noqa: E402
from record import rows, run_block  # noqa: E402

GiB = 1 << 30
HEADING = "## spillway.torch on the GPU (`bench/torch`)"
CLAIM = "spillway.torch, GPU"
ANCHOR = "(#spillwaytorch-on-the-gpu-benchtorch)"
GOAL = ("issue 11: learned <= 1.10x floor, >= 1.5x faster than FSDP2 CPU offload (training), "
        ">= 2x faster than accelerate (inference), at or below hand-written prefetch, bit-identical")
FLOOR_GOAL = 1.10
FSDP2_GOAL = 1.5
ACCELERATE_GOAL = 2.0

INTRO = """Rows below are written by `bench/torch/section.py` from the runs' JSON (in
`bench/torch/runs/`); nothing typed by hand. The "x floor" of each variant divides its
step time by max(resident, copy floor) of the same run; the copy floor moves the bytes
the learned run moved (its pool's counters) over pinned PyTorch copies, both directions
at once. GPU peak of a Spillway variant is `torch.cuda.max_memory_allocated()` plus the
pool's frames (its GPU budget)."""


def met(ok):
    return "met" if ok else "missed"


def verdict(main, ident):
    tr, inf = main["train"], main["infer"]
    tl, il = tr.get("learned", {}), inf.get("learned", {})
    parts = []
    # Each phase: the learned run against the floor, then against its baseline.
    for phase, learned, speedup, baseline, goal in (
            ("training", tl, "train_fsdp2_over_learned", "FSDP2", FSDP2_GOAL),
            ("inference", il, "infer_accelerate_over_learned", "accelerate", ACCELERATE_GOAL)):
        if "ratio_to_floor" in learned:
            r = learned["ratio_to_floor"]
            parts.append(f"{phase} {r:.3f}x floor (goal <= {FLOOR_GOAL}: {met(r <= FLOOR_GOAL)})")
        if speedup in main:
            r = main[speedup]
            parts.append(f"{r:.2f}x faster than {baseline} ({met(r >= goal)})")
    if "train_handwritten_over_learned" in main:
        r = main["train_handwritten_over_learned"]
        parts.append(f"{r:.2f}x the hand-written offload's speed, training ({met(r >= 1.0)})")
    elif "error" in tr.get("handwritten", {}):
        parts.append("hand-written training variant failed: "
                     f"{tr['handwritten']['error'][:120]}")
    else:
        parts.append("no hand-written training variant in this run")
    eq, hw = tr.get("learned_equal_memory", {}), tr.get("handwritten", {})
    if "step_s" in eq and "step_s" in hw and "equal_memory_budget_bytes" in main:
        r = hw["step_s"] / eq["step_s"]
        parts.append(f"{r:.2f}x the hand-written offload's speed with its streaming memory "
                     f"({main['equal_memory_budget_bytes'] / GiB:.2f} GiB) as the budget, "
                     f"training ({met(r >= 1.0)})")
    if "infer_handwritten_over_learned" in main:
        r = main["infer_handwritten_over_learned"]
        parts.append(f"{r:.2f}x the hand-written side-stream prefetch's speed, inference "
                     f"({met(r >= 1.0)})")
    il_eq = ident["train"].get("learned", {})
    same = all(il_eq.get(k) for k in ("losses_equal", "grads_equal", "weights_equal"))
    parts.append(f"bit-identical over {ident['args']['train_steps']} training steps with "
                 f"{ident['args']['attn']} attention: {met(same)}")
    if "logits_equal" in il:
        parts.append(f"inference logits equal: {met(il['logits_equal'])}")
    return "; ".join(parts)


def where_time_goes(main):
    tl = main["train"].get("learned", {})
    if "h2d_bytes_per_step" not in tl:
        return ""
    w = main["weights_bytes"]
    # Least traffic of a step with AdamW (two states shaped like the weights), the
    # weights, gradients and states all off the GPU: weights in for forward, backward
    # and the optimizer; gradients, exp_avg, exp_avg_sq in for the optimizer; gradients
    # out after backward; weights and both states out after the optimizer.
    least_in, least_out = 6 * w, 4 * w
    return (f"Where the time goes: learned training moves {tl['h2d_bytes_per_step'] / 1e9:.1f} GB "
            f"in and {tl['d2h_bytes_per_step'] / 1e9:.1f} GB out per step "
            f"({tl['h2d_bytes_per_step'] / least_in:.2f}x and "
            f"{tl['d2h_bytes_per_step'] / least_out:.2f}x the least a step with AdamW can move: "
            f"{least_in / 1e9:.1f} GB in, {least_out / 1e9:.1f} GB out); it waits "
            f"{tl.get('stall_s_per_step', 0):.3f} s per step for copies (hit rate "
            f"{tl.get('hit_rate', 0):.3f}).")


def memory(runs):
    out = []
    for label, doc in runs:
        tl = doc["train"].get("learned", {})
        res = doc["train"].get("resident", {})
        if "torch_peak_bytes" not in tl or "gpu_peak_bytes" not in res:
            continue
        act = res["gpu_peak_bytes"] - 3 * doc["weights_bytes"]
        out.append(f"{label}: learned {tl['torch_peak_bytes'] / GiB:.2f} GiB of PyTorch memory + "
                   f"{tl['pool_gpu_bytes'] / GiB:.2f} GiB of pool frames, against "
                   f"{act / GiB:.2f} GiB of activations in the resident run (its peak less "
                   f"weights and Adam state): "
                   f"{met(tl['torch_peak_bytes'] <= act * 1.05)}")
    return "GPU memory (goal: the budget plus activations): " + "; ".join(out) + "." if out else ""


def bisect_lines(pairs):
    """One line per identity run of another wheel (which code the bit-identity holds for)."""
    out = []
    for pair in pairs:
        commit, path = pair.split("=", 1)
        tl = json.load(open(path))["train"].get("learned", {})
        same = all(tl.get(k) for k in ("losses_equal", "grads_equal", "weights_equal"))
        first = tl.get("first_loss_differing")
        out.append(f"- wheel of {commit}: {len(tl.get('losses', []))} steps, "
                   + ("bit-identical" if same else
                      "NOT bit-identical" + (f" (losses differ from step {first})" if first else ""))
                   + f" (`{os.path.relpath(path)}`)")
    return ("Bit-identity by wheel (same command, `--train-steps 3 --skip fsdp2 on_demand`):\n"
            + "\n".join(out)) if out else ""


def since_ratio(doc):
    """The later run's (`--since`) learned step over its floor."""
    return doc["train"]["learned"]["step_s"] / doc["train_floor_s"]


def since_lines(path, doc):
    """A later training run (`--since`) whose learned step is timed without the
    bit-identity check's step (`timed_steps`): its figures beside the section's."""
    if not doc:
        return ""
    tr = doc["train"]
    learned, hand = tr["learned"], tr.get("handwritten")
    text = (f"Since (`{os.path.relpath(path)}`, {doc['device']}, training only): the runs "
            "above time and count the last step too, in whose middle the bit-identity check "
            "reads every gradient, so their learned bytes and the copy floor made of them "
            "include that read; timed over steps "
            f"{learned['timed_steps'][0]} to {learned['timed_steps'][-1]} only, learned moves "
            f"{learned['h2d_bytes_per_step'] / 1e9:.2f} GB in and "
            f"{learned['d2h_bytes_per_step'] / 1e9:.2f} GB out per step, its floor is "
            f"{doc['train_floor_s']:.3f} s and its step {learned['step_s']:.3f} s = "
            f"{since_ratio(doc):.3f}x the floor (goal <= {FLOOR_GOAL}: "
            f"{met(since_ratio(doc) <= FLOOR_GOAL)})")
    if hand:
        text += (f"; the hand-written variant {hand['step_s']:.3f} s, "
                 f"{hand['step_s'] / learned['step_s']:.2f}x learned's time")
    return text + "."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("main")
    ap.add_argument("main_command")
    ap.add_argument("identity")
    ap.add_argument("identity_command")
    ap.add_argument("--bisect", nargs="*", default=[], metavar="COMMIT=JSON",
                    help="more identity runs, one per wheel, listed under the identity run")
    ap.add_argument("--note", help="a paragraph after the identity runs (what is known since)")
    ap.add_argument("--since", metavar="JSON",
                    help="a later training run timed without the bit-identity check's step")
    ap.add_argument("--write")
    a = ap.parse_args()
    main_doc, ident = json.load(open(a.main)), json.load(open(a.identity))
    v = verdict(main_doc, ident)
    later = json.load(open(a.since)) if a.since else None
    if later:
        r = since_ratio(later)
        v += (f"; training timed without the bit-identity check's step "
              f"(`{os.path.basename(a.since)}`): {r:.3f}x floor ({met(r <= FLOOR_GOAL)})")
    text = "\n\n".join(x for x in [
        HEADING, INTRO,
        "\n".join(run_block(main_doc, a.main_command)),
        "Bit-identity run (eager attention; with `sdpa` the losses match at step 1 and "
        "differ from step 2 on, as two resident runs do: its cuDNN backward is "
        "non-deterministic):",
        "\n".join(run_block(ident, a.identity_command)),
        bisect_lines(a.bisect),
        a.note or "",
        since_lines(a.since, later),
        f"Verdict: {v}.", where_time_goes(main_doc),
        memory([(main_doc["args"]["attn"], main_doc), (ident["args"]["attn"], ident)]),
    ] if x) + "\n"
    emit(a.write, HEADING, CLAIM, ANCHOR, GOAL, text, v)


if __name__ == "__main__":
    main()
