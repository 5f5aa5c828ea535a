#!/usr/bin/env python3
"""The offload workload written by hand in PyTorch: the baseline Spillway must match.

48 layers of 8192x8192 bf16 weights (128 MiB each, 6 GiB in all) live in pinned host
memory; the GPU has room for K=8 of them. Each layer is one GEMM, activations
[batch, 8192] stay on the GPU. Variants, each timed as the median of --iters steps after
one warm-up step:

- resident:  every layer on the GPU (compute alone);
- copy_only: the 48 host-to-device copies alone, on a side stream;
- on_demand: copy a layer, then run it, on one stream;
- prefetch:  what a skilled user writes: a side stream copies layer i+K-1 into the ring
             slot freed by layer i-1 while layer i computes; events order the streams.

Prints one JSON object per batch size (JSON Lines) on stdout.
"""

import argparse
import json
import statistics
import time

import torch


def timed(fn, iters):
    fn()  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--slots", type=int, default=8, help="layers that fit on the GPU")
    ap.add_argument("--batch", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    L, H, K = args.layers, args.hidden, args.slots
    dev = torch.device("cuda")
    dt = torch.bfloat16

    # Host weights, pinned; filled from one random GPU tensor (fast) with a per-layer scale.
    seed = torch.randn(H, H, dtype=dt, device=dev) * 0.01
    host = []
    for i in range(L):
        h = torch.empty(H, H, dtype=dt, pin_memory=True)
        h.copy_(seed * (1 + i / L))
        host.append(h)
    slots = [torch.empty(H, H, dtype=dt, device=dev) for _ in range(K)]
    copy = torch.cuda.Stream()
    compute = torch.cuda.current_stream()

    def copies_only():
        with torch.cuda.stream(copy):
            for i in range(L):
                slots[i % K].copy_(host[i], non_blocking=True)
        compute.wait_stream(copy)

    for batch in args.batch:
        x0 = torch.randn(batch, H, dtype=dt, device=dev) * 0.01
        bufs = [x0.clone(), torch.empty_like(x0)]

        def resident_step(ws):
            x, y = bufs
            for w in ws:
                torch.mm(x, w, out=y)
                x, y = y, x

        def on_demand():
            x, y = bufs
            for i in range(L):
                slots[0].copy_(host[i], non_blocking=True)
                torch.mm(x, slots[0], out=y)
                x, y = y, x

        ready = [torch.cuda.Event() for _ in range(L)]
        free = [torch.cuda.Event() for _ in range(K)]

        def prefetch():
            x, y = bufs
            with torch.cuda.stream(copy):
                for i in range(min(K, L)):
                    slots[i % K].copy_(host[i], non_blocking=True)
                    ready[i].record(copy)
            for i in range(L):
                compute.wait_event(ready[i])
                torch.mm(x, slots[i % K], out=y)
                x, y = y, x
                free[i % K].record(compute)
                j = i + K
                if j < L:
                    with torch.cuda.stream(copy):
                        copy.wait_event(free[j % K])
                        slots[j % K].copy_(host[j], non_blocking=True)
                        ready[j].record(copy)

        # Resident: all layers on the GPU at once (6 GiB), freed after.
        dev_ws = [h.to(dev, non_blocking=True) for h in host]
        resident_s = timed(lambda: resident_step(dev_ws), args.iters)
        del dev_ws
        torch.cuda.empty_cache()
        copy_only_s = timed(copies_only, args.iters)
        on_demand_s = timed(on_demand, args.iters)
        prefetch_s = timed(prefetch, args.iters)
        floor_s = max(resident_s, copy_only_s)
        print(json.dumps({
            "L": L, "H": H, "K": K, "batch": batch,
            "layer_MiB": H * H * 2 / 2**20,
            "resident_s": resident_s, "copy_only_s": copy_only_s,
            "on_demand_s": on_demand_s, "prefetch_s": prefetch_s,
            "floor_s": floor_s, "prefetch_ratio_to_floor": prefetch_s / floor_s,
            "tflops_resident": 2 * batch * H * H * L / resident_s / 1e12,
            "device": torch.cuda.get_device_name(0),
        }), flush=True)


if __name__ == "__main__":
    main()
