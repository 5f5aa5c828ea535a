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
  learned_no_ahead the same as learned with SPILLWAY_CUDA_MAP_AHEAD=0 (--no-ahead-variant):
             scattered buffers mapped into their ranges by the acquiring thread, not
             ahead by the device's thread beside the copies
  learned_one_by_one the same as learned with SPILLWAY_CUDA_COMPLETION_BURSTS=0
             (--one-by-one-variant): each finished copy told to the pool on its own
             (its lock and a pass of its pump each), not in bursts
  learned_equal_memory the same as learned with the GPU memory the hand-written variant
             streams through besides activations as its budget (--equal-memory-variant:
             its ring, staging sets and resident embedding and head with their state)
  learned_in_flight_SIZE the same as learned with SIZE of copies in flight each way
             (--in-flight-variant SIZE; the pool's default is 64 MiB)
  learned_whole the same as learned with the optimizer stepping each parameter whole
             (`Optimizer(chunked=False)`, --whole-variant): its buffers shown as one
             array each (on cuda, remapped when scattered), not stepped page by page
  on_demand  the same, policy on_demand
  fsdp2      FSDP2 fully_shard(..., offload_policy=CPUOffloadPolicy()) on one rank
  handwritten decoder layers' weights, gradients and AdamW state in pinned host memory,
             a ring of 2 GPU slots filled by a side stream (per-layer checkpointing so
             no saved tensor holds a slot), gradients copied out as they come, the
             optimizer streamed layer by layer through two staging sets (what a user
             writes by hand; `train_handwritten`)
inference (forward only under torch.no_grad(), batch --infer-batch x --infer-seq):
  resident, copy_floor, learned, on_demand as above;
  accelerate accelerate.cpu_offload hooks;
  handwritten a side-stream prefetch of decoder layers into a ring of 2 GPU slots, the
             embedding, final norm and head resident (what a user writes by hand).

Bit-identity: the learned and on_demand training runs' losses (every step; the first
step whose loss differs is recorded) and the gradients of the last step and the weights
after it are compared with the resident run's (same seed, same data, AdamW(foreach=False)
in both). `--train-steps 1` tells a wrong gradient from a wrong weight update.

Prints a table and writes JSON (--out). Timing: median of the steps after the first; for a
Spillway variant whose bit-identity is checked, also not the last step (the check reads
every gradient in its middle; the JSON's `timed_steps` names the steps timed).
"""

import argparse
import contextlib
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


def sync_time(fn, phase=None):
    """`fn()` timed between two synchronisations; `phase` names the range in a profile
    (`phase:NAME`, which timeline.py splits the GPU's time by)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.profiler.record_function(f"phase:{phase}") if phase else contextlib.nullcontext():
        out = fn()
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def forward_backward(m, x):
    """One language-model step without the optimizer: the loss on `x` (its own labels),
    backpropagated; returns the loss."""
    loss = m(input_ids=x, labels=x).loss
    loss.backward()
    return loss


def timed_forward_backward(args, m, x, phases, mark=None):
    """forward_backward, timed whole (the step's time), or with --phases, forward and
    backward timed apart (a synchronisation between them: a diagnostic of where a
    variant's time goes, not its step time) into `phases`."""
    if not args.phases:
        return sync_time(lambda: forward_backward(m, x))
    if mark:
        mark("start")
    dtf, loss = sync_time(lambda: m(input_ids=x, labels=x).loss, "forward")
    if mark:
        mark("forward")
    dtb, _ = sync_time(lambda: loss.backward(), "backward")
    if mark:
        mark("backward")
    phases.setdefault("forward", []).append(dtf)
    phases.setdefault("backward", []).append(dtb)
    return dtf + dtb, loss


def profiled(args, variant, last):
    """With --profile DIR and `last` true (the last timed step), a torch profiler over
    the step (forward, backward and optimizer), whose chrome trace goes to
    DIR/VARIANT.json and whose GPU timeline (`timeline.py`) goes into the variant's
    result; else a no-op."""
    if not (args.profile and last):
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(args.profile, exist_ok=True)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False)

    class Ctx:
        def __enter__(self):
            prof.__enter__()

        def __exit__(self, *exc):
            torch.cuda.synchronize()
            prof.__exit__(*exc)
            path = os.path.join(args.profile, f"{variant}.json")
            prof.export_chrome_trace(path)
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import timeline
            PROFILED[variant] = timeline.summarise(path)
    return Ctx()


PROFILED = {}
"""GPU timelines of profiled steps by variant (--profile)."""


def phase_medians(phases):
    return {k: median_after_first(v) for k, v in phases.items()}


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
    times, losses, phases = [], [], {}
    for i, x in enumerate(data):
        dt, loss = timed_forward_backward(args, m, x, phases)
        losses.append(loss.item())
        if i == len(data) - 1:
            grads = {n: p.grad.detach().cpu() for n, p in m.named_parameters()}
        dt2, _ = sync_time(lambda: (opt.step(), opt.zero_grad()))
        phases.setdefault("optimizer", []).append(dt2)
        times.append(dt + dt2)
    final = {n: p.detach().cpu() for n, p in m.named_parameters()}
    peak = torch.cuda.max_memory_allocated()
    del m, opt
    return {"step_s": median_after_first(times), "times": times, "losses": losses,
            "phase_s": phase_medians(phases), "gpu_peak_bytes": peak}, grads, final


def make_pool(args, policy, host_bytes):
    import spillway
    return spillway.Pool(gpu_budget=args.gpu_budget_bytes or args.gpu_budget,
                         copy_bytes_in_flight=args.copy_bytes_in_flight,
                         host_budget=host_bytes,
                         page_size=args.page_size, device="cuda", policy=policy)


def varied(args, **pool_settings):
    """`args` with some of the pool's settings changed (a variant's)."""
    return argparse.Namespace(**{**vars(args), **pool_settings})


def handwritten_memory_bytes(weights):
    """The GPU memory the hand-written variant streams through besides activations: its
    2-slot weight ring and two staging sets (gradients, exp_avg, exp_avg_sq), each the
    size of the largest decoder layer, and the embedding, final norm and head resident
    with their gradients and AdamW state (bf16: 2 bytes an element, 4 copies)."""
    layers, resident = {}, 0
    for name, t in weights.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            layers[parts[2]] = layers.get(parts[2], 0) + t.numel()
        else:
            resident += t.numel()
    slot_n = max(layers.values())
    return 2 * slot_n * 2 + 2 * 3 * slot_n * 2 + 4 * resident * 2


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


def train_offload(args, config, weights, data, policy, ref=None, chunked=None):
    import spillway.torch as st
    reset_gpu()
    m = new_model(config, weights)
    pool = make_pool(args, policy, host_bytes_for(args, m, 4))
    handle = st.offload(m, pool)
    handle.discard_overwritten = not args.no_discard
    reset_gpu()
    opt = st.Optimizer(torch.optim.AdamW, handle, chunked=chunked, lr=1e-4, foreach=False)
    times, losses, grads_equal, phases = [], [], None, {}
    s0 = None
    # With --phases: the pool's counters at each phase's end, per measured step.
    marks = []
    phase_pool = {}

    def mark(name):
        marks.append((name, pool.stats()))

    # The bit-identity check reads every gradient in the middle of the last step, which
    # moves pages a training loop would not and leaves the pool's state off its learned
    # order for that step's optimizer: that step is run and reported (`times`) but not
    # timed into `step_s`, the phases or the per-step counters.
    checked = ref is not None and len(data) > 2
    measured = range(1, len(data) - 1 if checked else len(data))
    s1 = None
    # Each step's own counters (the pool's stats between the ends of two steps), to tell
    # a slow step's cause: the first step that follows a learned order, the checked one.
    by_step, prev = [], pool.stats()
    for i, x in enumerate(data):
        if i == 1 or (checked and i == len(data) - 1):
            torch.cuda.synchronize()
            if i == 1:
                s0 = pool.stats()
            else:
                s1 = pool.stats()
        last = i == len(data) - 1
        # The first step's phases are kept too (the medians leave it out), not the checked one's.
        step_phases = phases if i == 0 or i in measured else {}
        # Profiled: the last timed step (not the checked one, which is off its order).
        with profiled(args, policy, i == (measured[-1] if measured else len(data) - 1)):
            dt, loss = timed_forward_backward(args, m, x, step_phases,
                                              mark if i in measured else None)
            losses.append(loss.item())
            if ref is not None and last:
                got = st.gradients(handle)
                grads_equal = all(torch.equal(got[n].cpu(), g) for n, g in ref["grads"].items())
                del got
            dt2, _ = sync_time(lambda: (opt.step(), opt.zero_grad()), "optimizer")
        step_phases.setdefault("optimizer", []).append(dt2)
        times.append(dt + dt2)
        cur = pool.stats()
        by_step.append({k: cur[k] - prev[k] for k in STEP_COUNTERS})
        prev = cur
        if marks:
            marks.append(("optimizer", pool.stats()))
            for (_, a), (name, b) in zip(marks, marks[1:]):
                acc = phase_pool.setdefault(name, {})
                for k, v in stats_per_step(a, b, len(measured)).items():
                    acc[k] = acc.get(k, 0) + v
            marks.clear()
    if s1 is None:
        s1 = pool.stats()
    steps = len(measured)
    timed = times[:measured.stop]
    out = {"step_s": median_after_first(timed), "times": times, "losses": losses,
           "timed_steps": [i + 1 for i in measured], "pool_stats_by_step": by_step,
           "phase_times": phases,
           "phase_s": phase_medians(phases), "phase_pool_stats_per_step": phase_pool,
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


STEP_COUNTERS = ("h2d_bytes", "d2h_bytes", "stalls", "stall_s", "demand_loads",
                 "prefetch_loads", "prefetch_wasted_pages", "evictions_dirty", "pages_mapped_ahead")
"""The pool's counters recorded for every step of a Spillway variant (`pool_stats_by_step`)."""


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


def layers_to_pinned_host(layers):
    """Moves each layer's parameters into one flat pinned bf16 host buffer per layer (the
    parameters keep empty GPU placeholders); returns the buffers and, per layer, each
    parameter with its offset and shape in its buffer (the hand-written variants)."""
    hosts, metas = [], []
    for layer in layers:
        ps = list(layer.parameters())
        h = torch.empty(sum(p.numel() for p in ps), dtype=torch.bfloat16, pin_memory=True)
        off, meta = 0, []
        for p in ps:
            h[off:off + p.numel()].copy_(p.detach().reshape(-1))
            meta.append((p, off, p.shape))
            off += p.numel()
            p.data = torch.empty(0, dtype=p.dtype, device="cuda")
        hosts.append(h)
        metas.append(meta)
    return hosts, metas


def train_handwritten(args, config, weights, data, ref_losses=None):
    """What a user writes by hand to train a model whose weights, gradients and AdamW
    state do not fit: each decoder layer's weights, gradients and state in flat pinned
    host buffers; the embedding, final norm and head resident (with a GPU AdamW).
    Forward and backward run with per-layer activation checkpointing (transformers'
    non-reentrant checkpointing), so no saved tensor points at a layer's weights; a
    forward pre-hook binds layer i's weights from a ring of 2 GPU slots and a side
    stream copies the next layer in (i+1 forward, i-1 during backward's recomputation).
    Each layer's gradients go to the host on a third stream as soon as they are
    accumulated. The optimizer step streams each layer's weights, gradients and state
    through two staging sets (copy in, AdamW on the GPU, copy out, overlapped), with
    torch's single-tensor AdamW arithmetic."""
    import math
    reset_gpu()
    m = new_model(config, weights)
    m.train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = list(m.model.layers)
    n_layers = len(layers)
    w_host, metas = layers_to_pinned_host(layers)

    def pinned(n):
        return torch.zeros(n, dtype=torch.bfloat16, pin_memory=True)
    g_host = [pinned(h.numel()) for h in w_host]
    m_host = [pinned(h.numel()) for h in w_host]
    v_host = [pinned(h.numel()) for h in w_host]
    moved = {"h2d": 0, "d2h": 0}  # bytes of the step under way
    slot_n = max(h.numel() for h in w_host)
    slots = [torch.empty(slot_n, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    stage = [[torch.empty(slot_n, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
             for _ in range(2)]  # gradients, exp_avg, exp_avg_sq per set
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    ready = [torch.cuda.Event() for _ in layers]
    w_done = [torch.cuda.Event() for _ in layers]
    g_done = [torch.cuda.Event() for _ in layers]
    holds = [None, None]
    # A slot or staging set comes free when the optimizer's copies out of it are done.
    freed = [torch.cuda.Event() for _ in range(2)]
    for e in w_done + freed:
        e.record()

    def load(i):
        s = i % 2
        if holds[s] == i:
            return
        free = torch.cuda.Event()
        free.record(torch.cuda.current_stream())  # kernels using the slot are queued before
        with torch.cuda.stream(h2d):
            h2d.wait_event(free)
            h2d.wait_event(freed[s])
            h2d.wait_event(w_done[i])
            slots[s][:w_host[i].numel()].copy_(w_host[i], non_blocking=True)
            ready[i].record(h2d)
        moved["h2d"] += 2 * w_host[i].numel()
        holds[s] = i

    def pre(i):
        def hook(mod, a):
            load(i)  # no copy when the slot holds it (the first layer, the last in backward)
            torch.cuda.current_stream().wait_event(ready[i])
            for p, off, shape in metas[i]:
                p.data = slots[i % 2][off:off + shape.numel()].view(shape)
            backward = torch._C._current_graph_task_id() != -1
            nxt = i - 1 if backward else i + 1
            if 0 <= nxt < n_layers:
                load(nxt)
        return hook

    pending = [0] * n_layers
    per_layer = [len(meta) for meta in metas]

    def grad_hook(i):
        def hook(p):
            pending[i] += 1
            if pending[i] < per_layer[i]:
                return
            pending[i] = 0
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                d2h.wait_event(done)
                for q, off, shape in metas[i]:
                    g_host[i][off:off + shape.numel()].copy_(q.grad.reshape(-1), non_blocking=True)
                    q.grad.record_stream(d2h)
                g_done[i].record(d2h)
            moved["d2h"] += 2 * g_host[i].numel()
            for q, _, _ in metas[i]:
                q.grad = None
        return hook

    hs = []
    for i, layer in enumerate(layers):
        hs.append(layer.register_forward_pre_hook(pre(i)))
        for p, _, _ in metas[i]:
            hs.append(p.register_post_accumulate_grad_hook(grad_hook(i)))
    layer_params = {id(p) for meta in metas for p, _, _ in meta}
    resident = [p for p in m.parameters() if id(p) not in layer_params]
    opt = torch.optim.AdamW(resident, lr=1e-4, foreach=False)
    lr, (beta1, beta2), eps, wd = 1e-4, (0.9, 0.999), 1e-8, 0.01
    step_no = [0]
    loaded = [torch.cuda.Event() for _ in range(2)]
    computed = [torch.cuda.Event() for _ in range(2)]

    def step():
        opt.step()
        opt.zero_grad()
        step_no[0] += 1
        t = step_no[0]
        step_size = lr / (1 - beta1 ** t)
        bc2_sqrt = math.sqrt(1 - beta2 ** t)
        cur = torch.cuda.current_stream()
        backward_done = torch.cuda.Event()
        backward_done.record(cur)  # the slots' last readers
        for i in range(n_layers):
            s, n = i % 2, w_host[i].numel()
            w, g, ea, eas = slots[s][:n], stage[s][0][:n], stage[s][1][:n], stage[s][2][:n]
            with torch.cuda.stream(h2d):
                h2d.wait_event(backward_done)
                h2d.wait_event(freed[s])
                h2d.wait_event(g_done[i])
                w.copy_(w_host[i], non_blocking=True)
                g.copy_(g_host[i], non_blocking=True)
                ea.copy_(m_host[i], non_blocking=True)
                eas.copy_(v_host[i], non_blocking=True)
                loaded[s].record(h2d)
            cur.wait_event(loaded[s])
            w.mul_(1 - lr * wd)
            ea.lerp_(g, 1 - beta1)
            eas.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            w.addcdiv_(ea, (eas.sqrt() / bc2_sqrt).add_(eps), value=-step_size)
            computed[s].record(cur)
            with torch.cuda.stream(d2h):
                d2h.wait_event(computed[s])
                w_host[i].copy_(w, non_blocking=True)
                m_host[i].copy_(ea, non_blocking=True)
                v_host[i].copy_(eas, non_blocking=True)
                w_done[i].record(d2h)
                freed[s].record(d2h)
            moved["h2d"] += 8 * n
            moved["d2h"] += 6 * n
        holds[0] = holds[1] = None  # the slots held the old weights or staging

    reset_gpu()
    times, losses, phases = [], [], {}
    for i, x in enumerate(data):
        moved["h2d"] = moved["d2h"] = 0
        with profiled(args, "handwritten", i == len(data) - 1):
            dt, loss = timed_forward_backward(args, m, x, phases)
            losses.append(loss.item())
            dt2, _ = sync_time(step, "optimizer")
        phases.setdefault("optimizer", []).append(dt2)
        times.append(dt + dt2)
    out = {"step_s": median_after_first(times), "times": times, "losses": losses,
           "phase_s": phase_medians(phases),
           "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
           "h2d_bytes_per_step": moved["h2d"], "d2h_bytes_per_step": moved["d2h"]}
    if ref_losses:
        out["first_loss_equal"] = losses[0] == ref_losses[0]
        out["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    for h in hs:
        h.remove()
    del m, opt, slots, stage, w_host, g_host, m_host, v_host
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
    host, metas = layers_to_pinned_host(layers)
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


def with_env(name, value, fn):
    """fn() with the environment variable `name` set to `value` (read by the pool's
    device when it is made), restored after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


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
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--infer-batch", type=int, default=1)
    ap.add_argument("--infer-seq", type=int, default=128)
    ap.add_argument("--infer-steps", type=int, default=6)
    ap.add_argument("--attn", default="sdpa", help="transformers attn_implementation")
    ap.add_argument("--gpu-budget", default="2GiB")
    ap.add_argument("--page-size", default="8MiB")
    ap.add_argument("--skip", nargs="*", default=[], help="variants to skip, e.g. fsdp2")
    ap.add_argument("--parts", nargs="*", default=["train", "infer"], help="train, infer")
    ap.add_argument("--phases", action="store_true",
                    help="time forward and backward apart (a sync between them: a diagnostic)")
    ap.add_argument("--no-ahead-variant", action="store_true",
                    help="also train learned with SPILLWAY_CUDA_MAP_AHEAD=0 (variant learned_no_ahead)")
    ap.add_argument("--one-by-one-variant", action="store_true",
                    help="also train learned with SPILLWAY_CUDA_COMPLETION_BURSTS=0 (variant learned_one_by_one)")
    ap.add_argument("--equal-memory-variant", action="store_true",
                    help="also train learned with the hand-written variant's GPU memory as budget "
                         "(variant learned_equal_memory)")
    ap.add_argument("--in-flight-variant", metavar="SIZE",
                    help="also train learned with SIZE of copies in flight each way "
                         "(Pool(copy_bytes_in_flight=SIZE); variant learned_in_flight_SIZE)")
    ap.add_argument("--whole-variant", action="store_true",
                    help="also train learned with the optimizer stepping parameters whole (variant learned_whole)")
    ap.add_argument("--no-discard", action="store_true",
                    help="acquire gradients and new optimizer state without discard (copy their old bytes in)")
    ap.add_argument("--profile", metavar="DIR",
                    help="profile each training variant's last timed step (chrome traces and GPU timelines in DIR)")
    ap.add_argument("--out", default="bench-torch.json")
    # Pool settings a variant changes (`varied`); None: the run's own.
    ap.set_defaults(gpu_budget_bytes=None, copy_bytes_in_flight=None)
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
    if args.no_ahead_variant and "train" in args.parts:
        guarded(tr, "learned_no_ahead", lambda: with_env(
            "SPILLWAY_CUDA_MAP_AHEAD", "0",
            lambda: train_offload(args, config, weights, data, "learned", ref if ref else None)))
    if args.one_by_one_variant and "train" in args.parts:
        guarded(tr, "learned_one_by_one", lambda: with_env(
            "SPILLWAY_CUDA_COMPLETION_BURSTS", "0",
            lambda: train_offload(args, config, weights, data, "learned", ref if ref else None)))
    if args.equal_memory_variant and "train" in args.parts:
        page = spillway_size(args.page_size)
        budget = handwritten_memory_bytes(weights) // page * page
        doc["equal_memory_budget_bytes"] = budget
        log(f"learned_equal_memory: budget {budget / GiB:.2f} GiB")
        guarded(tr, "learned_equal_memory", lambda: train_offload(
            varied(args, gpu_budget_bytes=budget), config, weights, data, "learned",
            ref if ref else None))
    if args.in_flight_variant and "train" in args.parts:
        guarded(tr, f"learned_in_flight_{args.in_flight_variant}", lambda: train_offload(
            varied(args, copy_bytes_in_flight=args.in_flight_variant), config, weights, data,
            "learned", ref if ref else None))
    if args.whole_variant and "train" in args.parts:
        guarded(tr, "learned_whole", lambda: train_offload(
            args, config, weights, data, "learned", ref if ref else None, chunked=False))
    if "on_demand" not in args.skip and "train" in args.parts:
        guarded(tr, "on_demand", lambda: train_offload(args, config, weights, data, "on_demand",
                                                       ref if ref else None))
    if "handwritten" not in args.skip and "train" in args.parts:
        guarded(tr, "handwritten", lambda: train_handwritten(args, config, weights, data,
                                                             ref.get("losses")))
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
        for name, r in rs.items():
            if r.get("phase_s") and args.phases:
                print(f"  {name} phases s: " + ", ".join(f"{k} {v:.3f}" for k, v in r["phase_s"].items()))
            for ph, st in (r.get("phase_pool_stats_per_step") or {}).items():
                print(f"    {name} {ph}: stall {st['stall_s']:.3f} s, {st['stalls']:.0f} of "
                      f"{st['acquires']:.0f} acquires, H2D {st['h2d_bytes'] / 1e9:.2f} GB, "
                      f"D2H {st['d2h_bytes'] / 1e9:.2f} GB, demand {st['demand_loads']:.0f} pages, "
                      f"planning {st.get('planning_s', 0):.3f} s, lock wait {st.get('lock_wait_s', 0):.3f} s, "
                      f"device planning {st.get('device_planning_s', 0):.3f} s, "
                      f"mapping {st.get('mapping_s', 0):.3f} s ({st.get('pages_remapped', 0):.0f} pages), "
                      f"mapped ahead {st.get('pages_mapped_ahead', 0):.0f} pages "
                      f"({st.get('map_ahead_s', 0):.3f} s)")
    for variant in ("learned", "learned_no_ahead", "learned_one_by_one", "learned_equal_memory",
                    "learned_whole", "on_demand"):
        if "losses_equal" in tr.get(variant, {}):
            checks = {k: tr[variant].get(k) for k in ("losses_equal", "grads_equal", "weights_equal",
                                                       "first_loss_differing")}
            print(f"\n{variant}: bit-identical to resident training over", args.train_steps,
                  "steps:", checks)
    for k in ("train_fsdp2_over_learned", "train_handwritten_over_learned",
              "infer_accelerate_over_learned", "infer_handwritten_over_learned"):
        if k in doc:
            print(f"{k}: {doc[k]:.2f}")
    if PROFILED:
        doc["timeline"] = PROFILED
        print("\nGPU timeline of the last (profiled) step, s:")
        keys = ["window_s", "kernel_s", "h2d_s", "d2h_s", "idle_s", "copy_only_s", "kernel_only_s",
                "h2d_idle_s", "host_acquire_s"]
        print(f"{'variant':<12} " + " ".join(f"{k[:-2]:>13}" for k in keys))
        for name, t in PROFILED.items():
            print(f"{name:<12} " + " ".join(f"{t.get(k, 0):>13.3f}" for k in keys))
            for phase, tp in t.get("phases", {}).items():
                print(f"  {phase:<10} " + " ".join(f"{tp.get(k, 0):>13.3f}" for k in keys))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    main()
