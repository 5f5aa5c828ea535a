#!/usr/bin/env python3
"""Writes the "Replay of recorded traces" section of bench/RESULTS.md from replay JSON.

Usage: python3 bench/replay_section.py DIR [DIR ...] [--write bench/RESULTS.md]

Each DIR holds `<trace>.json` files, each the stdout of
`spillway replay bench/traces/<trace>.jsonl --compare --repeats N --json --device D`
(one device per DIR), and a `command.txt` with the command that made them. Prints the
section; with --write it replaces the section (from its heading to the next "## ") and
the claim's row of the summary table. Every figure comes from those files.

Goal (issue 12): on every trace, learned's median step time is the lowest of the three
policies and <= 1.05x the trace's compute time (the resident replay's step) where the
copies can be hidden; on the MoE traces at batch 1 (`moe`, `mixtral_b1`) learned is below
clock on both stall and step time.
"""
import glob
import json
import os
import sys

import results_page  # bench/results_page.py, beside this script

HEADING = "## Replay of recorded traces"
ANCHOR = "(#replay-of-recorded-traces)"
FLOOR_MAX = 1.05
BATCH1_MOE = ("moe", "mixtral_b1")


def load(d):
    runs = []
    for path in sorted(glob.glob(os.path.join(d, "*.json"))):
        with open(path) as f:
            text = f.read().strip()
        if not text:
            continue
        r = json.loads(text.splitlines()[-1])
        r["_name"] = os.path.splitext(os.path.basename(path))[0]
        runs.append(r)
    cmd_path = os.path.join(d, "command.txt")
    command = open(cmd_path).read().strip() if os.path.exists(cmd_path) else "?"
    return runs, command


def ms(s):
    return f"{s * 1e3:.1f}"


def section(dirs):
    lines = [HEADING, ""]
    lines.append(
        "`spillway replay TRACE --compare --repeats N`: each recorded trace (`bench/traces/`) "
        "under `resident` (a GPU budget of every page: the trace's compute time as the replay "
        "runs it, the floor) and the three policies at a GPU budget of a third of the trace's "
        "bytes, interleaved over N repeats. Step time = wall time less checksum verification "
        "(its own column) and less the time the loop waited for a core; median over steps 2.. "
        "per repeat, then the median (min-max) over repeats; ratio to the same repeat's floor. "
        f"Goal (issue 12): `learned`'s step the lowest of the three and <= {FLOOR_MAX}x the "
        "floor where the copies can be hidden; on the MoE traces at batch 1 learned below "
        "clock on stall and step. Section written by `bench/replay_section.py` from the runs' "
        "JSON.")
    verdicts = []
    for d in dirs:
        runs, command = load(d)
        if not runs:
            continue
        device = runs[0]["runs"][0]["device"]
        lines += ["", f"### Device `{device}`", ""]
        lines.append(f"Run: `{os.path.normpath(d)}`; command: `{command}`.")
        lines.append("")
        lines.append(f"Machine: {runs[0]['machine']}; device: {runs[0]['runs'][0]['device_description']}.")
        lines.append("")
        lines.append("| trace | load before / cores | policy | step ms (median) | min-max | / floor "
                     "(min-max) | stall ms/step | verify ms/step | planning ms | lock wait ms "
                     "| views ms | device threads ms | hit rate | MiB moved/step | wasted "
                     "prefetch pages | corrupt |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            load_ = r["load_before"]
            busy = " (busy)" if r["busy"] else ""
            for p in [r["resident"]] + r["policies"]:
                o = p["overhead"]
                lines.append(
                    f"| `{r['_name']}` | {load_['load_1min']:.2f} / {load_['cores']}{busy} | "
                    f"{p['policy']} | {ms(p['step_s_median'])} | {ms(p['step_s_min'])}-"
                    f"{ms(p['step_s_max'])} | {p['ratio_to_floor']:.3f} ({p['ratio_min']:.3f}-"
                    f"{p['ratio_max']:.3f}) | {ms(p['stall_s_per_step'])} | "
                    f"{ms(p['verify_s_per_step'])} | {o['planning_s'] * 1e3:.2f} | "
                    f"{o['lock_wait_s'] * 1e3:.2f} | {o['view_s'] * 1e3:.2f} | "
                    f"{(o['device_planning_s'] + o['device_lock_wait_s']) * 1e3:.2f} | "
                    f"{p['hit_rate']:.3f} | "
                    f"{(p['h2d_bytes_per_step'] + p['d2h_bytes_per_step']) / 2**20:.1f} | "
                    f"{p['prefetch_wasted_pages']} | {p['corrupt_pages']} |")
        lines.append("")
        for r in runs:
            pol = {p["policy"]: p for p in r["policies"]}
            le, cl = pol["learned"], pol["clock"]
            lowest = le["step_s_median"] <= min(p["step_s_median"] for p in r["policies"])
            within = le["ratio_to_floor"] <= FLOOR_MAX
            note = (f"`{r['_name']}` on {device}: learned step "
                    f"{'lowest' if lowest else 'not lowest'} "
                    f"({ms(le['step_s_median'])} ms against on_demand "
                    f"{ms(pol['on_demand']['step_s_median'])}, clock {ms(cl['step_s_median'])}), "
                    f"{le['ratio_to_floor']:.3f}x the floor "
                    f"({'within' if within else 'over'} {FLOOR_MAX})")
            ok = lowest and within
            if r["_name"] in BATCH1_MOE:
                below = (le["stall_s_per_step"] < cl["stall_s_per_step"]
                         and le["step_s_median"] < cl["step_s_median"])
                note += (f"; batch-1 MoE: learned stall {ms(le['stall_s_per_step'])} ms vs clock "
                         f"{ms(cl['stall_s_per_step'])} ms, "
                         f"{'below clock on both' if below else 'not below clock on both'}")
                ok &= below
            if any(p["corrupt_pages"] for p in r["policies"] + [r["resident"]]):
                note += "; CORRUPT PAGES"
                ok = False
            verdicts.append((ok, note))
            lines.append(f"- {note}.")
    met = all(ok for ok, _ in verdicts) and verdicts
    lines.append("")
    missed = [n.split(":")[0] for ok, n in verdicts if not ok]
    n_ok = sum(ok for ok, _ in verdicts)
    lines.append(f"**Verdict: {'met' if met else 'missed'}**: met on {n_ok} of {len(verdicts)} "
                 "trace runs" + (f"; missed on {', '.join(missed)}" if missed else "") + ".")
    summary = (f"{'met' if met else 'missed'}: met on {n_ok} of {len(verdicts)} trace runs"
               + (f" (missed: {', '.join(missed)})" if missed else ""))
    return "\n".join(lines) + "\n", summary


def main():
    args, write = results_page.split_write(sys.argv[1:])
    text, summary = section(args)
    goal = (f"learned's step the lowest of the three and <= {FLOOR_MAX}x the "
            "resident floor; batch-1 MoE: learned below clock on stall and step")
    results_page.emit(write, HEADING, "Replay", ANCHOR, goal, text, summary)

if __name__ == "__main__":
    main()
