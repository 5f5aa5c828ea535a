#!/usr/bin/env python3
"""Writes the "Offload on the H200" section of bench/RESULTS.md from a bench/gpu/run.sh folder.

Usage: python3 bench/gpu/offload_section.py OUT_DIR "command that ran" [--write bench/RESULTS.md]

Reads gpu-offload-*.out (the JSON of `spillway bench gpu-offload --json`, one per page
size; with its repeats, each step and ratio shows as median (min–max)) and torch-offload.out (bench/baselines/torch_offload.py, JSON lines) of the same
run, and prints the section; with --write it replaces the section in RESULTS.md (from its
heading to the next "## ") and the claim's row of the summary table. Every figure comes
from those files; nothing is typed by hand.

Verdict (issue 12): at every page size and batch, learned's median <= 1.05x its own floor
and <= the hand-written PyTorch prefetch of the same run.
"""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import results_page  # noqa: E402  (bench/results_page.py)

HEADING = "## Offload on the H200 (`bench gpu-offload`)"
ANCHOR = "(#offload-on-the-h200-bench-gpu-offload)"
OWN_FLOOR_MAX = 1.05


def spread(v, key, lo, hi, fmt="{:.3f}"):
    """A figure as `median (min–max)` over the run's repeats; the median alone when the
    JSON has no spread (runs before repeats, or one repeat)."""
    m = v[key]
    if lo in v and hi in v and (v[lo], v[hi]) != (m, m):
        return f"{fmt.format(m)} ({fmt.format(v[lo])}–{fmt.format(v[hi])})"
    return fmt.format(m)


def repeats_line(runs):
    """Repeats and the load of each page size's run (runs that recorded them)."""
    parts = []
    for r in runs:
        if "load_before" not in r:
            continue
        lb, la = r["load_before"], r["load_after"]
        parts.append(f"{r['page_bytes'] >> 20} MiB: {r.get('repeats', 1)} repeats, load "
                     f"{lb['load_1min']:.2f} before / {la['load_1min']:.2f} after on "
                     f"{lb['cores']} cores" + (" (busy)" if r.get("busy") else ""))
    if not parts:
        return "One pass per variant (no repeats recorded in this run's JSON)."
    return ("Each variant ran in interleaved repeats; learned's step and ratios are median "
            "(min–max) over them, the other figures medians. " + "; ".join(parts) + ".")


def read(path):
    with open(path) as f:
        return f.read()


def load_run(out):
    runs = []
    for path in glob.glob(os.path.join(out, "gpu-offload-*.out")):
        text = read(path).strip()
        if text:
            runs.append(json.loads(text.splitlines()[-1]))
    runs.sort(key=lambda r: r["page_bytes"])
    torch = {}
    tpath = os.path.join(out, "torch-offload.out")
    if os.path.exists(tpath):
        for line in read(tpath).splitlines():
            if line.strip().startswith("{"):
                d = json.loads(line)
                torch[d["batch"]] = d
    return runs, torch


def section(out, command):
    runs, torch = load_run(out)
    if not runs:
        sys.exit(f"no gpu-offload-*.out with JSON in {out}")
    r0 = runs[0]
    gpu = " / ".join(read(os.path.join(out, "nvidia-smi.csv")).strip().splitlines()[1:]) \
        if os.path.exists(os.path.join(out, "nvidia-smi.csv")) else r0["device"]
    lines = [HEADING, ""]
    lines.append(
        f"{r0['layers']} layers x {r0['hidden']}x{r0['hidden']} bf16 through a GPU budget of "
        f"{r0['slots']} layers, one GEMM per layer, against a hand-written PyTorch side-stream "
        "prefetch (`bench/baselines/torch_offload.py`) in the same run. Goal (issue 12): at every "
        f"page size and batch, `learned` <= {OWN_FLOOR_MAX}x its own floor and <= that prefetch. "
        "Own floor = max(compute, the variant's own host-to-device bytes at `copy_only`'s "
        "bandwidth at that page size); compute = `resident`'s step. Section written by "
        "`bench/gpu/offload_section.py` from the run's JSON.")
    lines.append("")
    lines.append(f"Run: `{os.path.normpath(out)}`; command: `{command}`, "
                 "binaries from `bench/gpu/build-dist.sh`.")
    lines.append("")
    lines.append(f"Machine: {r0['machine']}. GPU: {gpu}. The pool's default page size: "
                 f"{r0['default_page_bytes'] >> 20} MiB.")
    lines.append("")
    lines.append(repeats_line(runs))
    lines.append("")
    lines.append("| page | batch | learned s, median (min–max) | own floor s | learned / own floor "
                 "| PyTorch prefetch s | learned / PyTorch | GiB moved (learned / PyTorch) | stall | planning | lock wait "
                 "| view (mapping) | remaps | hit rate | corrupt pages |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    met, cells = True, []
    layer_gib = r0["hidden"] * r0["hidden"] * 2 / 2**30
    for r in runs:
        for b in r["batches"]:
            v = next(x for x in b["variants"] if x["name"] == "learned")
            t = torch.get(b["batch"])
            own = v["ratio_to_own_floor"]
            vs = v["step_s"] / t["prefetch_s"] if t else None
            # Against the one PyTorch figure of the run: learned's step spread over it.
            vs_text = "-"
            if t:
                vs_text = spread({"m": vs, "lo": v.get("step_s_min", v["step_s"]) / t["prefetch_s"],
                                  "hi": v.get("step_s_max", v["step_s"]) / t["prefetch_s"]},
                                 "m", "lo", "hi")
            ok = own <= OWN_FLOOR_MAX and (vs is not None and vs <= 1.0)
            met &= ok and r["corrupt_pages"] == 0
            moved = (v["h2d_bytes_per_step"] + v["d2h_bytes_per_step"]) / 2**30
            torch_moved = f"{r0['layers'] * layer_gib:.2f}" if t else "-"
            torch_s = f"{t['prefetch_s']:.4f}" if t else "-"
            lines.append(
                f"| {r['page_bytes'] >> 20} MiB | {b['batch']} | "
                f"{spread(v, 'step_s', 'step_s_min', 'step_s_max', '{:.4f}')} | "
                f"{v['own_floor_s']:.4f} | {spread(v, 'ratio_to_own_floor', 'ratio_min', 'ratio_max')} | "
                f"{torch_s} | {vs_text} | "
                f"{moved:.2f} / {torch_moved} | {v['stall_s']:.4f} | {v['planning_s']:.4f} | "
                f"{v['lock_wait_s']:.4f} | {v['view_s']:.4f} | {v['remaps_per_step']:.0f} | "
                f"{v['hit_rate']:.3f} | {r['corrupt_pages']} |")
            cells.append((r["page_bytes"] >> 20, b["batch"], own, vs))
    lines.append("")
    lines.append("Every variant, with where the time went (seconds per step; `end sync` is the wait "
                 "for GEMMs still queued at the end of the step; the device's threads run beside "
                 "the step):")
    lines.append("")
    lines.append("| page | batch | variant | step s | GiB moved | own floor s | ratio | stall | planning "
                 "| lock wait | view | launch | end sync | device: completions | device: lock wait "
                 "| remaps | views in place / mapped |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        for b in r["batches"]:
            for v in b["variants"]:
                lines.append(
                    f"| {r['page_bytes'] >> 20} MiB | {b['batch']} | {v['name']} | "
                    f"{spread(v, 'step_s', 'step_s_min', 'step_s_max', '{:.4f}')} | "
                    f"{(v['h2d_bytes_per_step'] + v['d2h_bytes_per_step']) / 2**30:.2f} | "
                    f"{v['own_floor_s']:.4f} | {spread(v, 'ratio_to_own_floor', 'ratio_min', 'ratio_max')} | "
                    f"{v['stall_s']:.4f} | "
                    f"{v['planning_s']:.4f} | {v['lock_wait_s']:.4f} | {v['view_s']:.4f} | "
                    f"{v['launch_s']:.4f} | {v['sync_s']:.4f} | {v['device_planning_s']:.4f} | "
                    f"{v['device_lock_wait_s']:.4f} | {v['remaps_per_step']:.0f} | "
                    f"{v['views_in_place_per_step']:.0f} / {v['views_mapped_per_step']:.0f} |")
    if torch:
        lines.append("")
        lines.append("PyTorch baseline, same run, seconds per step (it moves every layer, "
                     f"{r0['layers'] * layer_gib:.2f} GiB):")
        lines.append("")
        lines.append("| batch | resident | copy only | on demand | side-stream prefetch | prefetch / its floor |")
        lines.append("|---|---|---|---|---|---|")
        for b, t in sorted(torch.items()):
            lines.append(f"| {b} | {t['resident_s']:.4f} | {t['copy_only_s']:.4f} | "
                         f"{t['on_demand_s']:.4f} | {t['prefetch_s']:.4f} | "
                         f"{t['prefetch_ratio_to_floor']:.3f} |")
    worst_own = max(c[2] for c in cells)
    worst_vs = max((c[3] for c in cells if c[3] is not None), default=None)
    lines.append("")
    verdict = "met" if met else "missed"
    lines.append(
        f"**Verdict: {verdict}.** Worst `learned` / own floor {worst_own:.3f} "
        f"(goal <= {OWN_FLOOR_MAX}); worst `learned` / PyTorch prefetch "
        + (f"{worst_vs:.3f}" if worst_vs is not None else "not measured") + " (goal <= 1)"
        + "".join(f"; {p} MiB x {bt}: {o:.3f} / " + (f"{s:.3f}" if s is not None else "-")
                  for p, bt, o, s in cells if o > OWN_FLOOR_MAX or (s is not None and s > 1.0))
        + ".")
    summary = (f"{verdict}: learned / own floor <= {worst_own:.3f}, learned / PyTorch prefetch <= "
               + (f"{worst_vs:.3f}" if worst_vs is not None else "n/a")
               + f" at {', '.join(str(r['page_bytes'] >> 20) for r in runs)} MiB pages")
    return "\n".join(lines) + "\n", summary


def main():
    args, write = results_page.split_write(sys.argv[1:])
    out = args[0]
    command = args[1] if len(args) > 1 else "bench/gpu/run.sh OUT"
    text, summary = section(out, command)
    goal = (f"learned <= {OWN_FLOOR_MAX}x its own floor and <= a hand-written "
            "PyTorch prefetch, at 2, 8 and 64 MiB pages")
    results_page.emit(write, HEADING, "Offload, H200", ANCHOR, goal, text, summary)

if __name__ == "__main__":
    main()
