"""Counts of a Spillway trace (``docs/TRACE.md``): ``python -m spillway_trace stats PATH...``.

Plain JSON and the standard library: reading a trace needs no PyTorch, so this module
imports none, and ``python -m spillway_trace stats`` runs where PyTorch is not installed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

_EXPERT = re.compile(r"^(.*?)(?:\.experts\.(\d+)(?:\..*)?|\.expert(\d+))$")


def expert_of(buffer: str) -> tuple[str, int] | None:
    """``(moe module, expert index)`` for an expert's buffer, else None.

    Matches ``....experts.3.fc1`` (an expert module of a ``ModuleList``) and
    ``....experts.expert3`` (a slice of fused experts).
    """
    m = _EXPERT.match(buffer)
    if m is None:
        return None
    return m.group(1), int(m.group(2) if m.group(2) is not None else m.group(3))


def trace_stats(path: str) -> dict[str, Any]:
    """Counts of a trace file (read as plain JSON Lines, not validated)."""
    steps: dict[int, list[dict[str, Any]]] = {}
    buffers: dict[str, int] = {}
    markers = 0
    with open(path, encoding="utf-8") as f:
        for text in f:
            if not text.strip():
                continue
            line = json.loads(text)
            if line["bytes"] == 0:
                markers += 1
                continue
            steps.setdefault(line["step"], []).append(line)
            buffers.setdefault(line["buffer"], line["bytes"])
    per_step = []
    previous_experts: set[tuple[str, int]] | None = None
    for step, accesses in steps.items():
        phases: dict[str, int] = {}
        for a in accesses:
            phases[a["phase"]] = phases.get(a["phase"], 0) + 1
        expert_accesses = [e for a in accesses if (e := expert_of(a["buffer"])) is not None]
        experts = set(expert_accesses)
        new_share = None
        if previous_experts is not None and expert_accesses:
            new = sum(1 for e in expert_accesses if e not in previous_experts)
            new_share = new / len(expert_accesses)
        per_step.append(
            {
                "step": step,
                "accesses": len(accesses),
                "phases": phases,
                "expert_accesses": len(expert_accesses),
                "experts": len(experts),
                "new_expert_share": new_share,
            }
        )
        previous_experts = experts if expert_accesses else previous_experts
    return {
        "accesses": sum(len(a) for a in steps.values()),
        "markers": markers,
        "steps": len(steps),
        "buffers": len(buffers),
        "buffer_bytes": sum(buffers.values()),
        "per_step": per_step,
    }


def print_stats(path: str) -> None:
    """Prints :func:`trace_stats` as a small table."""
    s = trace_stats(path)
    print(
        f"{path}: {s['accesses']} accesses in {s['steps']} steps, {s['markers']} markers, "
        f"{s['buffers']} buffers, {s['buffer_bytes'] / 2**20:.1f} MiB"
    )
    for st in s["per_step"]:
        phases = " ".join(f"{k}={v}" for k, v in st["phases"].items())
        line = f"  step {st['step']}: {st['accesses']} accesses ({phases})"
        if st["expert_accesses"]:
            line += f", {st['expert_accesses']} expert accesses to {st['experts']} experts"
            if st["new_expert_share"] is not None:
                line += f", {st['new_expert_share']:.0%} to experts new this step"
        print(line)


def main(argv: Sequence[str]) -> int:
    """``stats PATH...``: prints each trace's counts."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m spillway_trace stats", description="Print a trace's counts."
    )
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    for path in args.paths:
        print_stats(path)
    return 0
