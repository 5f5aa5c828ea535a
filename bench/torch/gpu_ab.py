#!/usr/bin/env python3
"""An A/B of wheels on a GPU, from `bench/torch/ab.sh` runs (bench_torch.py's JSON, one
per arm, back to back on one warm machine): each arm's run block (record.py), every
training variant's step times, the phases where `--phases` ran, and the arms' learned
steps over the first arm's. Prints the section for the page's "Runs since" list, as
bench/gpu/record.py does:

    python3 bench/torch/gpu_ab.py "TITLE" "COMMAND" NAME=RUN.json [NAME=RUN.json ...] \\
        [--note TEXT] >> bench/RESULTS.md

Every figure comes from the JSON; nothing is typed by hand.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import run_block  # noqa: E402

PHASES = ("forward", "backward", "optimizer")


def phase_rows(name, doc):
    """One row per training variant timed by phase: the phases' medians, and for the
    Spillway variants the optimizer's demand loads and the pages mapped ahead a step."""
    out = []
    for variant, r in doc["train"].items():
        phases = r.get("phase_s") or {}
        if not all(p in phases for p in PHASES):
            continue
        pool = (r.get("phase_pool_stats_per_step") or {}).get("optimizer", {})
        demand = f"{pool['demand_loads']:.0f}" if "demand_loads" in pool else ""
        ahead = r.get("pool_stats_per_step", {}).get("pages_mapped_ahead")
        ahead = f"{ahead:.0f}" if ahead is not None else ""
        out.append(f"| {name} | {variant} | " + " | ".join(f"{phases[p]:.3f}" for p in PHASES)
                   + f" | {demand} | {ahead} |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("title")
    ap.add_argument("command")
    ap.add_argument("arms", nargs="+", metavar="NAME=RUN.json")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    arms = []
    for arm in a.arms:
        name, _, path = arm.partition("=")
        arms.append((name, path, json.load(open(path))))
    lines = [f"### {a.title}", ""]
    for name, path, doc in arms:
        lines += [f"**{name}** (`{os.path.basename(path)}`)", "",
                  *run_block(doc, a.command), ""]
    lines += ["Step times of every training variant, s (the first step learns the order):", "",
              "| arm | variant | steps |", "|---|---|---|"]
    for name, _, doc in arms:
        for variant, r in doc["train"].items():
            if "times" in r:
                lines.append(f"| {name} | {variant} | "
                             + ", ".join(f"{t:.3f}" for t in r["times"]) + " |")
    phase = [row for name, _, doc in arms for row in phase_rows(name, doc)]
    if phase:
        lines += ["", "Phases (median s of the timed steps; `--phases` syncs between them):", "",
                  "| arm | variant | forward | backward | optimizer | optimizer demand pages/step "
                  "| pages mapped ahead/step |", "|---|---|---|---|---|---|---|", *phase]
    first = arms[0][2]["train"]["learned"]["step_s"]
    reading = []
    for name, _, doc in arms:
        tr = doc["train"]
        learned, hand = tr["learned"]["step_s"], tr.get("handwritten", {}).get("step_s")
        text = (f"{name}: learned {learned:.3f} s, {learned / doc['train_floor_s']:.3f}x its floor, "
                f"{learned / first:.3f}x {arms[0][0]}'s learned")
        if hand:
            text += f", hand-written / learned {hand / learned:.2f}"
        reading.append(text)
    lines += ["", "Reading (generated from the JSON): " + "; ".join(reading) + "."]
    if a.note:
        lines += ["", a.note]
    # A blank line first: appended after the page's last section.
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
