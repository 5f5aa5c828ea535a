#!/usr/bin/env python3
"""Writes the "A peer's death" section of bench/RESULTS.md from scripts/peer_death.py JSON.

Usage: python3 bench/peer_death_section.py DIR [DIR ...] [--write bench/RESULTS.md]

Each DIR holds the `--json` outputs of `scripts/peer_death.py` (any `*.json` in it, each a
list of scenario results) and a `command.txt` naming the commands, the binary and the
machine. Prints the section; with --write it replaces the section (from its heading to
the next "## ") and the claim's row of the summary table. Every figure comes from those
files.

Goal (issue 14): with replicas 2, a SIGKILLed holder, a killed leader and a peer paused
for 10 s cost nothing (every step finishes, 0 corrupt pages, no lost buffer) and
re-replication completes within 30 s; with replicas 1 only buffers with a page on the
dead peer are lost; without a fault the hit rate from step 2 is >= 0.99 with replicas 2.
"""
import glob
import json
import os
import sys

import results_page  # bench/results_page.py, beside this script

HEADING = "## A peer's death (`scripts/peer_death.py`)"
CLAIM = "A peer's death"
ANCHOR = "(#a-peers-death-scriptspeer_deathpy)"
REPAIR_LIMIT_S = 30.0
STEADY_MIN = 0.99
GOAL = ("replicas 2: a peer killed, the leader killed, a peer paused 10 s cost no step, "
        "page or buffer, repaired within 30 s; replicas 1: only the dead peer's buffers "
        f"lost; hit rate from step 2 >= {STEADY_MIN} without faults")


def load(d):
    results = []
    for path in sorted(glob.glob(os.path.join(d, "*.json"))):
        with open(path) as f:
            results.extend(json.load(f))
    cmd_path = os.path.join(d, "command.txt")
    command = open(cmd_path).read().strip() if os.path.exists(cmd_path) else "?"
    return results, command


def fmt(v, spec=""):
    return "" if v is None else format(v, spec)


def verdict(r):
    """Whether one scenario met its part of the goal (None: the run did not check it),
    and why not."""
    if not r.get("ok"):
        return False, r.get("error", "failed")
    name = r["scenario"]
    if name.startswith("steady"):
        if r["replicas"] == 2 and r["hit_rate_from_step_2"] < STEADY_MIN:
            return False, f"hit rate {r['hit_rate_from_step_2']} < {STEADY_MIN}"
        return True, ""
    if r.get("corrupt_pages") != 0:
        return False, "corrupt pages"
    if name == "replicas-1":
        if "lost_not_on_victim" not in r:
            return None, "which buffers were on the victim (the run predates /placements)"
        if r.get("lost_not_on_victim"):
            return False, "buffers lost without a page on the victim"
        return True, ""
    if r.get("lost_buffers"):
        return False, "buffers lost"
    if (r.get("fault_to_repaired_s") or 0) > REPAIR_LIMIT_S:
        return False, "repair slower than 30 s"
    return True, ""


def section(dirs):
    lines = [HEADING, ""]
    lines.append(
        "`scripts/peer_death.py`: a pool of 4 `spillway node` processes on loopback, "
        "`spillway demo --connect` (8 steps, the demo's default shape, sim device) as a "
        "client of one of them with pages on every peer; after step 2 a fault: `kill-holder` "
        "SIGKILLs the peer holding the most pages, `kill-leader` the Raft leader, `stop-peer` "
        "SIGSTOPs a holder for 10 s, `replicas-1` kills a holder of a pool keeping one copy "
        "(the demo with `--skip-lost`; the buffers with a page on the victim come from the "
        "client's node's `/placements`, read with the demo paused just before the kill). "
        "`steady` and `steady-replicas-1` run without a fault. Repaired: from the fault until "
        "every live node reports 0 under-replicated bytes. "
        f"Goal (issue 14): {GOAL}. Section written by `bench/peer_death_section.py` from "
        "the runs' JSON.")
    met_all = True
    summaries = []
    for d in dirs:
        results, command = load(d)
        lines += ["", f"Run `{d}`:", "", "```", command, "```", ""]
        lines.append("| scenario | replicas | steps | corrupt pages | lost buffers | "
                     "buffers on the victim | lost without a page there | hit rate from step 2 "
                     "(steady) or before the fault | stall s/step, steps 2.. | fault to repaired s "
                     "| verdict |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        met = unchecked = 0
        for r in results:
            ok, why = verdict(r)
            met += ok is True
            unchecked += ok is None
            stalls = r.get("stall_s_per_step")
            stall = f"{sum(stalls[1:]) / len(stalls[1:]):.3f}" if stalls and len(stalls) > 1 else ""
            rate = r.get("hit_rate_from_step_2", r.get("hit_rate_before_fault"))
            lost_elsewhere = r.get("lost_not_on_victim")
            lines.append(
                f"| {r['scenario']} | {r['replicas']} | {fmt(r.get('steps'))} | "
                f"{fmt(r.get('corrupt_pages'))} | {fmt(r.get('lost_buffers'))} | "
                f"{fmt(r.get('buffers_on_victim'))} | "
                f"{'' if lost_elsewhere is None else len(lost_elsewhere)} | {fmt(rate, '.4f')} | "
                f"{stall} | {fmt(r.get('fault_to_repaired_s'), '.2f')} | "
                f"{'met' if ok else ('not checked: ' + why if ok is None else 'missed: ' + why)} |")
        checked = len(results) - unchecked
        met_all &= met == checked
        note = f" ({unchecked} not checked)" if unchecked else ""
        summaries.append(f"{met} of {checked} in `{os.path.basename(d)}`{note}")
    summary = ("met" if met_all else "missed") + ": " + ", ".join(summaries)
    return "\n".join(lines) + "\n", summary


def main():
    args = sys.argv[1:]
    write = None
    if "--write" in args:
        i = args.index("--write")
        write = args[i + 1]
        del args[i:i + 2]
    if not args:
        sys.exit(__doc__)
    text, summary = section(args)
    results_page.emit(write, HEADING, CLAIM, ANCHOR, GOAL, text, summary)


if __name__ == "__main__":
    main()
