#!/usr/bin/env python3
"""Turns the folder written by bench/gpu/run.sh into a Markdown section for bench/RESULTS.md.

Usage: python3 bench/gpu/record.py OUT_DIR "the command that ran run.sh" >> bench/RESULTS.md
Only reads the JSON and logs the run wrote; no number is typed by hand.
"""
import json
import os
import sys


def load(path):
    with open(path) as f:
        return f.read()


def main():
    out, command = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bench/gpu/run.sh OUT"
    p = lambda name: os.path.join(out, name)
    print(f"\n### GPU run ({os.path.basename(os.path.normpath(out))})\n")
    print(f"Command: `{command}`, binaries from `bench/gpu/build-dist.sh`.\n")
    print("GPU: " + " / ".join(load(p("nvidia-smi.csv")).strip().splitlines()[1:]) + "\n")
    print("Step status: " + ", ".join(load(p("status.txt")).split("\n")[:-1]) + "\n")

    # Copy path against raw pinned copies, from the GPU test suite's table.
    lines = load(p("gpu-tests.out")).splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith("copy bandwidth on")), None)
    if start is not None:
        print("#### Copy bandwidth: Spillway's copy path (`submit()`) against raw pinned copies, same run\n")
        print(lines[start] + "\n")
        for l in lines[start + 1:]:
            if not l.startswith("|") and not l.startswith("diagnostics"):
                break
            if l.startswith("diagnostics"):
                continue
            print(l)
        print()

    torch = {}
    if os.path.exists(p("torch-offload.out")):
        for l in load(p("torch-offload.out")).splitlines():
            if l.strip():
                d = json.loads(l)
                torch[d["batch"]] = d
    for name in ["gpu-offload-2mib", "gpu-offload-8mib", "gpu-offload-64mib"]:
        if not os.path.exists(p(name + ".out")) or not load(p(name + ".out")).strip():
            continue
        r = json.loads(load(p(name + ".out")))
        print(f"#### Offload: {r['layers']} layers x {r['hidden']}x{r['hidden']} bf16, GPU budget {r['slots']} layers, "
              f"page {r['page_bytes'] >> 20} MiB ({r['device']}; {r['machine']})\n")
        print(f"Pages verified in learned's first step: {r['verified_pages']}, corrupt: {r['corrupt_pages']}.\n")
        print("| batch | variant | step s | ratio to own floor | hit rate | stall s/step | page remaps/step | remap s/step | learned / PyTorch prefetch |")
        print("|---|---|---|---|---|---|---|---|---|")
        for b in r["batches"]:
            t = torch.get(b["batch"])
            for v in b["variants"]:
                vs = ""
                if v["name"] == "learned" and t:
                    vs = f"{v['step_s'] / t['prefetch_s']:.3f}"
                print(f"| {b['batch']} | {v['name']} | {v['step_s']:.4f} | {v.get('ratio_to_own_floor', v.get('ratio_to_floor', 0)):.3f} | "
                      f"{v['hit_rate']:.3f} | {v['stall_s']:.4f} | {v.get('remaps_per_step', 0):.0f} | "
                      f"{v.get('remap_s_per_step', 0):.4f} | {vs} |")
            if t:
                print(f"| {b['batch']} | PyTorch side-stream prefetch (baseline) | {t['prefetch_s']:.4f} | "
                      f"{t['prefetch_ratio_to_floor']:.3f} of its own floor | | | | | |")
                print(f"| {b['batch']} | PyTorch on demand | {t['on_demand_s']:.4f} | | | | | | |")
        print()
    if torch:
        print("PyTorch baseline (`bench/baselines/torch_offload.py`, same run), seconds per step:\n")
        print("| batch | resident | copy only | on demand | side-stream prefetch | prefetch / its floor |")
        print("|---|---|---|---|---|---|")
        for b, t in sorted(torch.items()):
            print(f"| {b} | {t['resident_s']:.4f} | {t['copy_only_s']:.4f} | {t['on_demand_s']:.4f} | "
                  f"{t['prefetch_s']:.4f} | {t['prefetch_ratio_to_floor']:.3f} |")
        print()
    if os.path.exists(p("demo-cuda.out")) and load(p("demo-cuda.out")).strip():
        d = json.loads(load(p("demo-cuda.out")))
        rates = [round(s["hits"] / s["acquires"], 3) for s in d["steps"]]
        print(f"`spillway demo --device cuda`: {d['device_description']}, working set {d['working_set_bytes'] >> 20} MiB "
              f"on {d['gpu_budget_bytes'] >> 20} MiB, verified {d['verified_bytes'] >> 20} MiB, corrupt pages "
              f"{d['corrupt_pages']}, hit rate per step {rates}.\n")
    for name in ["replay-dense-cuda", "replay-moe-cuda"]:
        if not os.path.exists(p(name + ".out")) or not load(p(name + ".out")).strip():
            continue
        d = json.loads(load(p(name + ".out")))
        cells = []
        for r in d["runs"]:
            st = [s for s in r["steps"] if s["step"] >= 2]
            a = sum(s["acquires"] for s in st)
            h = sum(s["hits"] for s in st)
            cells.append(f"{r['policy']}: hit rate {h / a:.3f}, stall {sum(s['stall_s'] for s in st):.4f} s, "
                         f"corrupt {r['corrupt_pages']}")
        print(f"`spillway replay {d['runs'][0]['trace']} --device cuda --compare` (steps 2..): " + "; ".join(cells) + ".\n")


if __name__ == "__main__":
    main()
