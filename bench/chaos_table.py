#!/usr/bin/env python3
"""Renders `spillway chaos run --json` output (one object per line) as the results table
of docs/CHAOS.md, and the pass count under it.

    python3 bench/chaos_table.py bench/chaos/2026-12-05-chaos-run.jsonl
"""
import json
import sys


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("| scenario | nodes | victim | steps | pages verified | lost | corrupt | recovery |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        recovery = "-" if r.get("recovery_s") is None else f"{r['recovery_s']:.1f} s"
        if r.get("detail"):
            recovery += f" ({r['detail']})"
        victims = ", ".join(str(v) for v in r["victims"])
        print(
            f"| `{r['scenario']}` | {r['nodes']} | {victims} | {r['steps']} | "
            f"{r['pages_verified']:,} | {r['pages_lost']} | {r['pages_corrupt']} | {recovery} |"
        )
    passed = sum(1 for r in rows if r["ok"])
    lost = sum(r["pages_lost"] for r in rows)
    corrupt = sum(r["pages_corrupt"] for r in rows)
    print()
    print(f"{passed} of {len(rows)} passed: {lost} pages lost, {corrupt} corrupt.")


if __name__ == "__main__":
    main(sys.argv[1])
