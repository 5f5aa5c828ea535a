#!/usr/bin/env python3
"""Where a profiled step's time went on the GPU: reads a PyTorch profiler chrome trace
(`bench_torch.py --profile DIR` writes one per variant) and sums, over the step's
window, the time the GPU ran kernels, copied host to device, device to host, anything
at all, and nothing; and the host's time inside the pool's acquires (`spillway.torch`
annotates them as `spillway.acquire` while a profiler records).

    python3 bench/torch/timeline.py DIR/learned.json [DIR/handwritten.json ...]

The profiler's CUDA activity (CUPTI) covers every copy of the process, the pool's own
driver-API copies included. Overlapping intervals of one kind are merged first, so a
kind's busy time is the wall time at least one of its operations ran.
"""

import gzip
import json
import sys

KINDS = {
    "kernel": lambda e: e.get("cat") == "kernel",
    "h2d": lambda e: e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""),
    "d2h": lambda e: e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", ""),
}


def merged(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def total(intervals):
    return sum(b - a for a, b in intervals)


def intersect(xs, ys):
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append([a, b])
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def clipped(intervals, start, end):
    return [[max(a, start), min(b, end)] for a, b in intervals if a < end and b > start]


def summarise(path):
    """Seconds of each kind of GPU activity in the trace's GPU window, and the host's
    seconds inside the SDK's `spillway.acquire` annotations (the pool's waits); with
    `phases`, the same for each phase the benchmark annotated (`phase:NAME` ranges on
    the host, a synchronisation at each phase's end, so a phase's GPU work lies in its
    range)."""
    events = [e for e in load(path) if e.get("ph") == "X" and "dur" in e]
    busy = {k: merged([(e["ts"], e["ts"] + e["dur"]) for e in events if f(e)])
            for k, f in KINDS.items()}
    out = window(events, busy)
    phases = [e for e in events if str(e.get("name", "")).startswith("phase:")
              and e.get("cat") in ("user_annotation", "cpu_op")]
    if phases:
        out["phases"] = {e["name"][len("phase:"):]: window(events, busy, e["ts"], e["ts"] + e["dur"])
                         for e in phases}
    return out


def window(events, busy, lo=None, hi=None):
    """`summarise` over the events and their merged GPU activity (`busy`, by kind)
    between `lo` and `hi` (microseconds; `None`: all of it)."""
    if lo is not None:
        busy = {k: clipped(v, lo, hi) for k, v in busy.items()}
        events = [e for e in events if lo <= e["ts"] < hi]
    gpu = merged([iv for v in busy.values() for iv in v])
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    start, end = (gpu[0][0], gpu[-1][1]) if lo is None else (lo, hi)
    us = 1e-6
    copies = merged(busy["h2d"] + busy["d2h"])
    out = {
        "window_s": (end - start) * us,
        "kernel_s": total(busy["kernel"]) * us,
        "h2d_s": total(busy["h2d"]) * us,
        "d2h_s": total(busy["d2h"]) * us,
        "any_s": total(gpu) * us,
        "idle_s": ((end - start) - total(gpu)) * us,
        "kernel_and_copy_s": total(intersect(busy["kernel"], copies)) * us,
        "copy_only_s": (total(copies) - total(intersect(busy["kernel"], copies))) * us,
        "kernel_only_s": (total(busy["kernel"]) - total(intersect(busy["kernel"], copies))) * us,
        "h2d_idle_s": ((end - start) - total(busy["h2d"])) * us,
        "h2d_copies": sum(1 for e in events if KINDS["h2d"](e)),
        "d2h_copies": sum(1 for e in events if KINDS["d2h"](e)),
        "h2d_bytes": sum(e.get("args", {}).get("bytes", 0) for e in events if KINDS["h2d"](e)),
    }
    host = [e for e in events if e.get("name") == "spillway.acquire"
            and e.get("cat") in ("user_annotation", "cpu_op")]
    out["host_acquire_s"] = total(merged([(e["ts"], e["ts"] + e["dur"]) for e in host])) * us
    return out


def main():
    for path in sys.argv[1:]:
        s = summarise(path)
        print(path)
        show(s, "  ")
        for name, p in s.get("phases", {}).items():
            print(f"  phase {name}")
            show(p, "    ")


def show(summary, indent):
    for k, v in summary.items():
        if k != "phases":
            print(f"{indent}{k:<18} {v:.4f}" if isinstance(v, float) else f"{indent}{k:<18} {v}")


if __name__ == "__main__":
    main()
