#!/usr/bin/env python3
"""An A/B of two builds on the paced sim device, from `fragmentation.py --copy-gbps` runs
(no GPU needed): each arm's runs, interleaved on one machine, as step time, ratio to the
copy floor and each phase's wall time; the arms' medians and B's over A's. Prints the
section for the page's "Runs since" list, as bench/gpu/record.py does:

    python3 bench/torch/proxy_ab.py "TITLE" "COMMAND" A_NAME A1.json,A2.json,... \\
        B_NAME B1.json,B2.json,... [--note TEXT] >> bench/RESULTS.md
"""

import argparse
import json
import statistics

PHASES = ("forward", "backward", "optimizer")


def row(name, path):
    d = json.load(open(path))
    phase_s = {p["phase"]: p["pool"]["phase_s"] for p in d["phases"]}
    return {"arm": name, "run": path.rsplit("/", 1)[-1], "step_s": d["step_s"],
            "ratio": d["ratio_to_floor"], "floor_s": d["floor_s"], **phase_s,
            "compute_over_copy": d["resident_step_s"] / d["copy_floor_s"],
            "args": d["args"], "weights": d["weights_bytes"], "budget": d["gpu_budget_bytes"],
            "page": d["page_bytes"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("title")
    ap.add_argument("command")
    ap.add_argument("a_name")
    ap.add_argument("a_runs")
    ap.add_argument("b_name")
    ap.add_argument("b_runs")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    arms = [(a.a_name, [row(a.a_name, p) for p in a.a_runs.split(",")]),
            (a.b_name, [row(a.b_name, p) for p in a.b_runs.split(",")])]
    first = arms[0][1][0]
    args = first["args"]
    lines = [f"### {a.title}", "",
             f"Command: `{a.command}`; Llama hidden {args['hidden']}, {args['layers']} layers, "
             f"{first['weights'] / 2**20:.0f} MiB of bf16 weights through a GPU budget of "
             f"{first['budget'] / 2**20:.0f} MiB ({first['budget'] // first['page']} frames of "
             f"{first['page'] >> 10} KiB), copies paced at {args['copy_gbps']} GB/s each way; "
             "the arms' runs interleaved on one machine. Step: median of steps 2.. of a run; "
             "the resident step (the CPU's compute) over the copy floor: "
             f"{statistics.median(r['compute_over_copy'] for _, rs in arms for r in rs):.2f}.",
             "", "| arm | run | step s | x copy floor | forward s | backward s | optimizer s |",
             "|---|---|---|---|---|---|---|"]
    for _, runs in arms:
        for r in runs:
            lines.append(f"| {r['arm']} | `{r['run']}` | {r['step_s']:.3f} | {r['ratio']:.3f} | "
                         + " | ".join(f"{r[p]:.3f}" for p in PHASES) + " |")
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("step_s", "ratio") + PHASES}
           for name, runs in arms}
    for name, _ in arms:
        m = med[name]
        lines.append(f"| {name} | median | {m['step_s']:.3f} | {m['ratio']:.3f} | "
                     + " | ".join(f"{m[p]:.3f}" for p in PHASES) + " |")
    ma, mb = med[a.a_name], med[a.b_name]
    lines += ["", f"Reading (generated from the JSON): {a.b_name} over {a.a_name}, medians: step "
              f"{mb['step_s'] / ma['step_s']:.3f}x, "
              + ", ".join(f"{p} {mb[p] / ma[p]:.3f}x" for p in PHASES) + "."]
    if a.note:
        lines += ["", a.note]
    # A blank line first: appended after the page's last section.
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
