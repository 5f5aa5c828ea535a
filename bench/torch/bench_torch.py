#!/usr/bin/env python3
"""spillway.torch.offload on a real model, against what PyTorch users run today.

A transformers Llama-architecture model with random weights (no download), bf16, whose
weights are at least 3x the GPU budget given to the pool. All variants run in one
process, one after another, so their ratios compare like with like:

training (forward + backward + AdamW step, batch --train-batch x --seq tokens):
  resident   everything on the GPU (the compute floor)
  copy_floor the bytes Spillway moved per step (pool stats of the learned run), copied
             with pinned torch copies, both directions at once (the copy floor)
  learned    spillway.torch.offload + spillway.torch.Optimizer, policy learned
  on_demand  the same, policy on_demand
  fsdp2      FSDP2 fully_shard(..., offload_policy=CPUOffloadPolicy()) on one rank
inference (forward only under torch.no_grad(), batch --infer-batch x --infer-seq):
  resident, copy_floor, learned, on_demand as above;
  accelerate accelerate.cpu_offload hooks;
  handwritten a side-stream prefetch of decoder layers into a ring of 2 GPU slots, the
             embedding, final norm and head resident (what a user writes by hand).

Bit-identity: the learned and on_demand training runs' losses (every step; the first
step whose loss differs is recorded) and the gradients of the last step and the weights
after it are compared with the resident run's (same seed, same data, AdamW(foreach=False)
in both). `--train-steps 1` tells a wrong gradient from a wrong weight update.

Prints a table and writes JSON (--out). Timing: median of the steps after the first.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

GiB = 1 << 30
DEVICE = "cuda"
# Bit-identity needs the same kernels in every run: cuBLAS's fixed workspace, and
# deterministic algorithms where PyTorch has them (warn where it has none).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync_time(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def forward_backward(m, x):
    """One language-model step without the optimizer: the loss on `x` (its own labels),
    backpropagated; returns the loss."""
    loss = m(input_ids=x, labels=x).loss
    loss.backward()
    return loss


def median_after_first(times):
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def make_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128, vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, args.infer_seq), tie_word_embeddings=False,
        torch_dtype="bfloat16", attn_implementation=args.attn)


def new_model(config, weights):
    """A fresh model on the GPU holding `weights` (a CPU state dict)."""
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        m = LlamaForCausalLM(config).to(torch.bfloat16)
    m = m.to_empty(device=DEVICE)
    m.load_state_dict(weights, strict=True)
    with torch.device(DEVICE):  # its buffers are not in the state dict: make them again
        m.model.rotary_emb = type(m.model.rotary_emb)(config)
    return m


def reset_gpu():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def weights_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---- training --------------------------------------------------------------------------

def batches(args, config, n, batch, seq):
    g = torch.Generator(device="cpu").manual_seed(1234)
    return [torch.randint(0, config.vocab_size, (batch, seq), generator=g).cuda() for _ in range(n)]


def train_resident(args, config, weights, data):
    reset_gpu()
    m = new_model(config, weights)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False)
    times, losses = [], []
    for i, x in enumerate(data):
        dt, loss = sync_time(lambda: forward_backward(m, x))
        losses.append(loss.item())
        if i == len(data) - 1:
            grads = {n: p.grad.detach().cpu() for n, p in m.named_parameters()}
        dt2, _ = sync_time(lambda: (opt.step(), opt.zero_grad()))
        times.append(dt + dt2)
    final = {n: p.detach().cpu() for n, p in m.named_parameters()}
    peak = torch.cuda.max_memory_allocated()
    del m, opt
    return {"step_s": median_after_first(times), "times": times, "losses": losses,
            "gpu_peak_bytes": peak}, grads, final


def make_pool(args, policy, host_bytes):
    import spillway
    return spillway.Pool(gpu_budget=args.gpu_budget, host_budget=host_bytes,
                         page_size=args.page_size, device="cuda", policy=policy)


def host_bytes_for(args, model, copies):
    # Every buffer rounded up to pages, plus a page per group for slack.
    page = spillway_size(args.page_size)
    total = 0
    for mod in model.modules():
        n = sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
        if n:
            total += ((n + page - 1) // page + 1) * page
    return total * copies


def spillway_size(s):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, v in units.items():
        if s.endswith(u):
            return int(float(s[:-len(u)]) * v)
    return int(s)


def train_offload(args, config, weights, data, policy, ref=None):
    import spillway.torch as st
    reset_gpu()
    m = new_model(config, weights)
    pool = make_pool(args, policy, host_bytes_for(args, m, 4))
    handle = st.offload(m, pool)
    handle.discard_overwritten = not args.no_discard
    reset_gpu()
    opt = st.Optimizer(torch.optim.AdamW, handle, lr=1e-4, foreach=False)
    times, losses, grads_equal = [], [], None
    s0 = None
    for i, x in enumerate(data):
        if i == 1:
            torch.cuda.synchronize()
            s0 = pool.stats()
        dt, loss = sync_time(lambda: forward_backward(m, x))
        losses.append(loss.item())
        if ref is not None and i == len(data) - 1:
            got = st.gradients(handle)
            grads_equal = all(torch.equal(got[n].cpu(), g) for n, g in ref["grads"].items())
            del got
        dt2, _ = sync_time(lambda: (opt.step(), opt.zero_grad()))
        times.append(dt + dt2)
    s1 = pool.stats()
    steps = len(data) - 1
    out = {"step_s": median_after_first(times), "times": times, "losses": losses,
           "gpu_peak_bytes": torch.cuda.max_memory_allocated() + s1["gpu_budget_bytes"],
           "torch_peak_bytes": torch.cuda.max_memory_allocated(),
           "pool_gpu_bytes": s1["gpu_budget_bytes"],
           "h2d_bytes_per_step": (s1["h2d_bytes"] - s0["h2d_bytes"]) / steps,
           "d2h_bytes_per_step": (s1["d2h_bytes"] - s0["d2h_bytes"]) / steps,
           "stall_s_per_step": (s1["stall_s"] - s0["stall_s"]) / steps,
           "hit_rate": (s1["hits"] - s0["hits"]) / max(1, s1["acquires"] - s0["acquires"]),
           "pool_stats_per_step": stats_per_step(s0, s1, steps)}
    if ref is not None:
        params = st.parameters(handle)
        out["losses_equal"] = losses == ref["losses"]
        out["first_loss_differing"] = next(
            (i + 1 for i, (a, b) in enumerate(zip(losses, ref["losses"])) if a != b), None)
        out["grads_equal"] = grads_equal
        out["weights_equal"] = all(torch.equal(params[n].cpu(), w) for n, w in ref["final"].items())
        del params
    handle.remove()
    del m, opt, handle, pool
    return out


def stats_per_step(s0, s1, steps):
    """Every counter of the pool's stats, per step over the measured steps (where the
    waits and the extra bytes come from: late and wasted prefetch, overwrites, ...)."""
    return {k: (s1[k] - s0[k]) / steps for k in s1
            if isinstance(s1[k], (int, float)) and isinstance(s0.get(k), (int, float))}


def train_fsdp2(args, config, weights, data):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    reset_gpu()
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    m = new_model(config, weights)
    for layer in m.model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(m, offload_policy=CPUOffloadPolicy())
    reset_gpu()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    times = []
    for x in data:
        def step():
            forward_backward(m, x)
            opt.step()
            opt.zero_grad()
        dt, _ = sync_time(step)
        times.append(dt)
    out = {"step_s": median_after_first(times), "times": times,
           "gpu_peak_bytes": torch.cuda.max_memory_allocated()}
    del m, opt
    return out


def copy_floor(h2d_bytes, d2h_bytes, chunk=256 << 20, reps=3):
    """Seconds to move the given bytes over pinned copies, both directions at once."""
    reset_gpu()
    host_a = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()

    def run():
        for s, n, dst, src in ((s_in, h2d_bytes, dev_a, host_a), (s_out, d2h_bytes, host_b, dev_b)):
            with torch.cuda.stream(s):
                left = int(n)
                while left > 0:
                    k = min(left, chunk)
                    dst[:k].copy_(src[:k], non_blocking=True)
                    left -= k
    times = [sync_time(run)[0] for _ in range(reps)]
    del host_a, host_b, dev_a, dev_b
    return median_after_first(times)


# ---- inference ---------------------------------------------------------------------------

def infer_times(m, x, n):
    times = []
    with torch.no_grad():
        for _ in range(n):
            dt, out = sync_time(lambda: m(input_ids=x).logits)
            times.append(dt)
    return times, out


def infer_resident(args, config, weights, x):
    reset_gpu()
    m = new_model(config, weights)
    times, out = infer_times(m, x, args.infer_steps)
    res = {"step_s": median_after_first(times), "times": times,
           "gpu_peak_bytes": torch.cuda.max_memory_allocated()}
    logits = out.float().cpu()
    del m, out
    return res, logits


def infer_offload(args, config, weights, x, policy, ref_logits):
    import spillway.torch as st
    reset_gpu()
    m = new_model(config, weights)
    pool = make_pool(args, policy, host_bytes_for(args, m, 1))
    handle = st.offload(m, pool)
    reset_gpu()
    times, out = infer_times(m, x, 1)
    s0 = pool.stats()
    more, out = infer_times(m, x, args.infer_steps - 1)
    times += more
    s1 = pool.stats()
    n = len(more)
    res = {"step_s": median_after_first(times), "times": times,
           "gpu_peak_bytes": torch.cuda.max_memory_allocated() + s1["gpu_budget_bytes"],
           "pool_gpu_bytes": s1["gpu_budget_bytes"],
           "h2d_bytes_per_step": (s1["h2d_bytes"] - s0["h2d_bytes"]) / n,
           "hit_rate": (s1["hits"] - s0["hits"]) / max(1, s1["acquires"] - s0["acquires"]),
           "pool_stats_per_step": stats_per_step(s0, s1, n),
           "logits_equal": torch.equal(out.float().cpu(), ref_logits)}
    handle.remove()
    del m, handle, pool, out
    return res


def infer_accelerate(args, config, weights, x, ref_logits):
    from accelerate import cpu_offload
    reset_gpu()
    m = new_model(config, weights)
    cpu_offload(m, execution_device=torch.device("cuda:0"))
    reset_gpu()
    times, out = infer_times(m, x, max(2, args.infer_steps // 2))
    res = {"step_s": median_after_first(times), "times": times,
           "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
           "logits_equal": torch.equal(out.float().cpu(), ref_logits)}
    del m, out
    return res


def infer_handwritten(args, config, weights, x, ref_logits):
    """Decoder layers' weights in pinned host memory, flat per layer; a ring of 2 GPU
    slots; a side stream copies layer i+1 while layer i runs."""
    reset_gpu()
    m = new_model(config, weights)
    layers = list(m.model.layers)
    metas = []
    host = []
    for layer in layers:
        ps = list(layer.parameters())
        n = sum(p.numel() for p in ps)
        h = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        off, meta = 0, []
        for p in ps:
            h[off:off + p.numel()].copy_(p.detach().reshape(-1))
            meta.append((p, off, p.shape))
            off += p.numel()
            p.data = torch.empty(0, dtype=p.dtype, device="cuda")
        host.append(h)
        metas.append(meta)
    slot_n = max(h.numel() for h in host)
    slots = [torch.empty(slot_n, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()
    ready = [torch.cuda.Event() for _ in layers]
    free = [torch.cuda.Event() for _ in range(2)]

    def load(i):
        with torch.cuda.stream(side):
            side.wait_event(free[i % 2])
            slots[i % 2][:host[i].numel()].copy_(host[i], non_blocking=True)
            ready[i].record(side)

    def pre(i):
        def hook(mod, a, kw):
            torch.cuda.current_stream().wait_event(ready[i])
            for p, off, shape in metas[i]:
                p.data = slots[i % 2][off:off + shape.numel()].view(shape)
            if i + 1 < len(layers):
                load(i + 1)
        return hook

    def post(i):
        def hook(mod, a, kw, out):
            free[i % 2].record(torch.cuda.current_stream())
        return hook

    def first(mod, a, kw):
        load(0)

    hs = [m.register_forward_pre_hook(first, with_kwargs=True)]
    for i, layer in enumerate(layers):
        hs.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        hs.append(layer.register_forward_hook(post(i), with_kwargs=True))
    for e in free:
        e.record(torch.cuda.current_stream())
    reset_gpu()
    times, out = infer_times(m, x, args.infer_steps)
    res = {"step_s": median_after_first(times), "times": times,
           "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
           "logits_equal": torch.equal(out.float().cpu(), ref_logits)}
    for h in hs:
        h.remove()
    del m, out, host, slots
    return res


# ---- main ----------------------------------------------------------------------------------

def table(rows, floor):
    lines = [f"{'variant':<12} {'step s':>9} {'x floor':>8} {'GPU peak GiB':>13} {'H2D GB/step':>12} {'D2H GB/step':>12}"]
    for name, r in rows:
        if "error" in r:
            lines.append(f"{name:<12} error: {r['error'][:90]}")
            continue
        lines.append(
            f"{name:<12} {r['step_s']:>9.3f} {r['step_s'] / floor:>8.3f} "
            f"{r.get('gpu_peak_bytes', 0) / GiB:>13.2f} "
            f"{r.get('h2d_bytes_per_step', 0) / 1e9:>12.2f} {r.get('d2h_bytes_per_step', 0) / 1e9:>12.2f}")
    return "\n".join(lines)


def guarded(results, key, fn):
    log(f"== {key}")
    try:
        results[key] = fn()
    except Exception as e:  # one failed variant must not lose the others
        import traceback
        traceback.print_exc()
        results[key] = {"error": f"{type(e).__name__}: {e}"}
    return results[key]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=5)
    ap.add_argument("--infer-batch", type=int, default=1)
    ap.add_argument("--infer-seq", type=int, default=128)
    ap.add_argument("--infer-steps", type=int, default=6)
    ap.add_argument("--attn", default="sdpa", help="transformers attn_implementation")
    ap.add_argument("--gpu-budget", default="2GiB")
    ap.add_argument("--page-size", default="8MiB")
    ap.add_argument("--skip", nargs="*", default=[], help="variants to skip, e.g. fsdp2")
    ap.add_argument("--parts", nargs="*", default=["train", "infer"], help="train, infer")
    ap.add_argument("--no-discard", action="store_true",
                    help="acquire gradients and new optimizer state without discard (copy their old bytes in)")
    ap.add_argument("--out", default="bench-torch.json")
    args = ap.parse_args()

    import spillway
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    config = make_config(args)
    from transformers import LlamaForCausalLM
    t0 = time.perf_counter()
    with torch.device("cuda"):
        m = LlamaForCausalLM(config).to(torch.bfloat16)
    weights = {k: v.detach().cpu() for k, v in m.state_dict().items()}
    wbytes = weights_bytes(m)
    del m
    log(f"model: {wbytes / GiB:.2f} GiB of bf16 weights, built in {time.perf_counter() - t0:.1f} s")
    doc = {"args": vars(args), "weights_bytes": wbytes,
           "gpu_budget_bytes": spillway_size(args.gpu_budget),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "spillway": spillway.__version__, "train": {}, "infer": {}}
    import transformers
    doc["transformers"] = transformers.__version__

    tr = doc["train"]
    data = batches(args, config, args.train_steps, args.train_batch, args.seq) if "train" in args.parts else []
    ref = {}

    def resident():
        r, grads, final = train_resident(args, config, weights, data)
        ref.update(losses=r["losses"], grads=grads, final=final)
        return r
    if "train" in args.parts:
        guarded(tr, "resident", resident)
    if "learned" not in args.skip and "train" in args.parts:
        guarded(tr, "learned", lambda: train_offload(args, config, weights, data, "learned",
                                                     ref if ref else None))
    if "on_demand" not in args.skip and "train" in args.parts:
        guarded(tr, "on_demand", lambda: train_offload(args, config, weights, data, "on_demand",
                                                       ref if ref else None))
    ref.clear()
    if "h2d_bytes_per_step" in tr.get("learned", {}):
        guarded(tr, "copy_floor", lambda: {"step_s": copy_floor(tr["learned"]["h2d_bytes_per_step"],
                                                                  tr["learned"]["d2h_bytes_per_step"])})
    if "fsdp2" not in args.skip and "train" in args.parts:
        guarded(tr, "fsdp2", lambda: train_fsdp2(args, config, weights, data[:3]))

    inf = doc["infer"]
    if "infer" not in args.parts:
        args.skip += ["infer"]
    x = batches(args, config, 1, args.infer_batch, args.infer_seq)[0]
    ref_logits = {}

    def iresident():
        r, logits = infer_resident(args, config, weights, x)
        ref_logits["v"] = logits
        return r
    infer = "infer" not in args.skip
    if infer:
        guarded(inf, "resident", iresident)
    rl = ref_logits.get("v")
    if infer:
        guarded(inf, "learned", lambda: infer_offload(args, config, weights, x, "learned", rl))
    if infer and "on_demand" not in args.skip:
        guarded(inf, "on_demand", lambda: infer_offload(args, config, weights, x, "on_demand", rl))
    if "h2d_bytes_per_step" in inf.get("learned", {}):
        guarded(inf, "copy_floor", lambda: {"step_s": copy_floor(inf["learned"]["h2d_bytes_per_step"], 0)})
    if infer:
        guarded(inf, "handwritten", lambda: infer_handwritten(args, config, weights, x, rl))
    if infer and "accelerate" not in args.skip:
        guarded(inf, "accelerate", lambda: infer_accelerate(args, config, weights, x, rl))

    for part in ("train", "infer"):
        rs = doc[part]
        a = rs.get("resident", {}).get("step_s", 0)
        b = rs.get("copy_floor", {}).get("step_s", 0)
        floor = max(a, b) or 1.0
        doc[f"{part}_floor_s"] = floor
        for name, r in rs.items():
            if "step_s" in r:
                r["ratio_to_floor"] = r["step_s"] / floor
        for other in ("fsdp2", "accelerate", "handwritten", "on_demand"):
            if "step_s" in rs.get("learned", {}) and "step_s" in rs.get(other, {}):
                doc[f"{part}_{other}_over_learned"] = rs[other]["step_s"] / rs["learned"]["step_s"]
        print(f"\n{part}: {doc['weights_bytes'] / GiB:.2f} GiB weights, GPU budget "
              f"{args.gpu_budget}, pages {args.page_size}, floor {floor:.3f} s")
        print(table(list(rs.items()), floor))
    for variant in ("learned", "on_demand"):
        if "losses_equal" in tr.get(variant, {}):
            checks = {k: tr[variant].get(k) for k in ("losses_equal", "grads_equal", "weights_equal",
                                                       "first_loss_differing")}
            print(f"\n{variant}: bit-identical to resident training over", args.train_steps,
                  "steps:", checks)
    for k in ("train_fsdp2_over_learned", "infer_accelerate_over_learned", "infer_handwritten_over_learned"):
        if k in doc:
            print(f"{k}: {doc[k]:.2f}")
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    main()
