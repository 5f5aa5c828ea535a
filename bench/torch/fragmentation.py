#!/usr/bin/env python3
"""How scattered a training step's buffers are, on the sim device (no GPU needed).

Trains a small transformers Llama (random weights, bf16) through ``spillway.torch`` on the
``sim`` device with a GPU budget of a fraction of its weights, and counts for each phase of
each step (forward, backward, optimizer) the acquires whose pages were not in consecutive
frames (``View.contiguous`` false: on CUDA such a view goes through the buffer's own range,
where a page whose frame changed since the buffer's last such view is mapped again, 110-220
µs a page on an H100; on sim its pages are gathered into a copy), their pages, and those a
CUDA device would map again (the remaps). With ``--copy-gbps`` the sim device's copy streams are paced
(``SPILLWAY_SIM_COPY_GBPS``) so that the step is copy-bound as on a GPU; then the step time
is reported beside its copy floor (the larger direction's bytes at that pace) and its
compute floor (the same model trained resident).

Prints a table and writes JSON (``--out``). Needs ``torch`` and ``transformers``.

    python3 bench/torch/fragmentation.py --out frag.json
    python3 bench/torch/fragmentation.py --copy-gbps 1 --page-size 1MiB --out frag-paced.json
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

PHASES = ("forward", "backward", "optimizer")
# The pool's counters reported per phase (their change over the phase).
POOL_COUNTERS = ("h2d_bytes", "d2h_bytes", "stalls", "stall_s", "demand_loads",
                 "prefetch_loads", "prefetch_wasted_pages", "reserved_pages",
                 "reserved_pages_missed", "evictions_dirty")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import spillway_size as size  # noqa: E402  (beside this script)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8, help="tokens per step (batch 1)")
    ap.add_argument("--page-size", default="512KiB")
    ap.add_argument("--weights-per-budget", type=float, default=3.26,
                    help="the GPU budget is the weights' bytes over this")
    ap.add_argument("--policy", default="learned")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--copy-gbps", type=float, default=0.0,
                    help="pace the sim device's copies at this many GB/s (0: memcpy speed)")
    ap.add_argument("--whole", action="store_true",
                    help="the optimizer steps each parameter whole (Optimizer(chunked=False)), "
                         "not page by page")
    ap.add_argument("--out", default="fragmentation.json")
    args = ap.parse_args()
    if args.copy_gbps > 0:
        os.environ["SPILLWAY_SIM_COPY_GBPS"] = str(args.copy_gbps)

    import torch
    import spillway
    import spillway.torch as st
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
                         num_hidden_layers=args.layers, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=4096)
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    page = size(args.page_size)
    budget = int(weights / args.weights_per_budget) // page * page
    x = torch.randint(0, 4096, (1, args.tokens))

    # The compute floor: the same steps with everything resident.
    m = copy.deepcopy(base)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False)
    resident = []
    for _ in range(args.steps):
        t = time.perf_counter()
        m(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        resident.append(time.perf_counter() - t)
    del m, opt

    model = copy.deepcopy(base)
    pool = spillway.Pool(gpu_budget=budget, host_budget=weights * 6, page_size=page,
                         device="sim", policy=args.policy)
    handle = st.offload(model, pool)
    opt = st.Optimizer(torch.optim.AdamW, handle, chunked=not args.whole, lr=1e-4, foreach=False)
    phase = ["forward"]
    counts = {}
    acquire = st._acquire
    # What the CUDA device would map: a fragmented view goes through its buffer's range,
    # where each page stays mapped to the frame it was in at the buffer's last such view;
    # a page now in another frame is a remap (the device's `pages_remapped`).
    range_frames = {}

    def counted(pool_, buf, exclusive=False, discard=False, paged=False):
        view = acquire(pool_, buf, exclusive, discard, paged)
        c = counts.setdefault(phase[0], {"acquires": 0, "paged": 0, "fragmented": 0,
                                         "pages": 0, "fragmented_pages": 0, "remaps": 0})
        c["acquires"] += 1
        c["pages"] += view.pages
        # A paged acquire is read page by page: never shown as one array, never remapped.
        c["paged"] += paged
        if not view.contiguous and not paged:
            c["fragmented"] += 1
            c["fragmented_pages"] += view.pages
            mapped = range_frames.setdefault(buf.id, {})
            for i in range(view.pages):
                at = torch.from_dlpack(view.page(i)).data_ptr()
                if mapped.get(i) != at:
                    c["remaps"] += 1
                    mapped[i] = at
        return view

    st._acquire = counted
    steps = []
    try:
        for i in range(args.steps):
            counts.clear()
            s0 = pool.stats()
            t0 = time.perf_counter()
            marks = {}

            def enter(name):
                marks[name] = pool.stats()
                marks[name]["at_s"] = time.perf_counter()
                phase[0] = name
            enter("forward")
            loss = model(x, labels=x).loss
            enter("backward")
            loss.backward()
            enter("optimizer")
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            s1 = pool.stats()
            s1["at_s"] = time.perf_counter()
            moved = {k: s1[k] - s0[k] for k in ("h2d_bytes", "d2h_bytes", "stall_s")}
            ends = [marks["backward"], marks["optimizer"], s1]
            phases = {}
            for p, start, end in zip(PHASES, (marks[q] for q in PHASES), ends):
                phases[p] = dict(counts.get(p, {}))
                phases[p]["pool"] = {k: end[k] - start[k] for k in POOL_COUNTERS}
                phases[p]["pool"]["phase_s"] = end["at_s"] - start["at_s"]
            steps.append({"step": i, "step_s": dt, **moved, "phases": phases})
    finally:
        st._acquire = acquire

    measured = steps[1:] or steps
    rows = []
    print(f"Llama hidden {args.hidden}, {args.layers} layers: {weights / 2**20:.0f} MiB of bf16 "
          f"weights, GPU budget {budget / 2**20:.0f} MiB ({budget // page} frames of "
          f"{page >> 10} KiB), policy {args.policy}, optimizer "
          f"{'whole' if args.whole else 'chunked'}, copies "
          + (f"paced at {args.copy_gbps} GB/s" if args.copy_gbps else "at memcpy speed"))
    print()
    print("| phase | acquires a step | paged | fragmented views | pages in them / pages acquired | share of pages | remaps (CUDA model) |")
    print("|---|---|---|---|---|---|---|")
    for p in PHASES:
        acq = statistics.median(s["phases"][p].get("acquires", 0) for s in measured)
        paged = statistics.median(s["phases"][p].get("paged", 0) for s in measured)
        frag = statistics.median(s["phases"][p].get("fragmented", 0) for s in measured)
        fp = statistics.median(s["phases"][p].get("fragmented_pages", 0) for s in measured)
        pages = statistics.median(s["phases"][p].get("pages", 0) for s in measured)
        share = fp / pages if pages else 0.0
        remaps = statistics.median(s["phases"][p].get("remaps", 0) for s in measured)
        rows.append({"phase": p, "acquires": acq, "paged": paged, "fragmented": frag,
                     "fragmented_pages": fp, "pages": pages, "share": share, "remaps": remaps})
        print(f"| {p} | {acq:.0f} | {paged:.0f} | {frag:.0f} | {fp:.0f} / {pages:.0f} | {share:.2f} "
              f"| {remaps:.0f} |")
    print()
    print("| phase | phase_s | " + " | ".join(POOL_COUNTERS) + " |")
    print("|---|---|" + "---|" * len(POOL_COUNTERS))
    for row, p in zip(rows, PHASES):
        row["pool"] = {k: statistics.median(s["phases"][p]["pool"][k] for s in measured)
                       for k in ("phase_s",) + POOL_COUNTERS}
        cells = [f"{v / 1e6:.1f} MB" if k.endswith("_bytes") else
                 f"{v:.3f}" if k.endswith("_s") else f"{v:.0f}" for k, v in row["pool"].items()]
        print(f"| {p} | " + " | ".join(cells) + " |")
    step_s = statistics.median(s["step_s"] for s in measured)
    compute = statistics.median(resident[1:] or resident)
    out = {"args": vars(args), "weights_bytes": weights, "gpu_budget_bytes": budget,
           "page_bytes": page, "resident_step_s": compute, "step_s": step_s, "phases": rows,
           "steps": steps, "torch": torch.__version__}
    print()
    print(f"step {step_s:.3f} s (median of steps 2..), resident {compute:.3f} s", end="")
    if args.copy_gbps:
        h2d = statistics.median(s["h2d_bytes"] for s in measured)
        d2h = statistics.median(s["d2h_bytes"] for s in measured)
        copy_floor = max(h2d, d2h) / (args.copy_gbps * 1e9)
        floor = max(copy_floor, compute)
        out.update(copy_floor_s=copy_floor, floor_s=floor, ratio_to_floor=step_s / floor)
        print(f", copy floor {copy_floor:.3f} s: {step_s / floor:.2f}x the floor", end="")
    print()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
