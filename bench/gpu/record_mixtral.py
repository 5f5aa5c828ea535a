#!/usr/bin/env python3
"""Records MoE access traces from a Mixtral-style model with random weights, on a GPU.

Usage (from the repository root, on a machine with PyTorch and transformers):

    PYTHONPATH=python python3 bench/gpu/record_mixtral.py OUT_DIR [--steps 12]

Builds ``transformers.MixtralForCausalLM`` from a small ``MixtralConfig`` (8 experts, top 2,
grouped-query attention, as Mixtral; sizes below), randomly initialised from seed 0, trains
it with AdamW on random tokens and records each run with ``spillway_trace.record``
(``sync=True``: each ``compute_us`` is GPU time between accesses). Two runs: batch 1 and
batch 4, ``SEQ`` tokens each, into ``OUT_DIR/mixtral_b1.jsonl`` and ``mixtral_b4.jsonl``,
and a line of counts per trace to ``OUT_DIR/mixtral_stats.json``.

Experts: a transformers that keeps Mixtral's experts as modules of a ``ModuleList`` needs
nothing special (only routed experts run). One that fuses them into ``[E, ...]``
parameters (transformers 5) is recorded through the recorder's ``expert_selector``: the
integer top-k index tensor among the experts module's arguments, else the router's
choice remembered by a forward hook on the router (``gate``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

from spillway_trace import record
from spillway_trace_demos import trace_stats

# A small Mixtral: the architecture's shape (8 experts, top 2, GQA 4:1, SwiGLU experts),
# sizes small enough that replays of the trace fit any test machine (~100 MiB fp32).
VOCAB = 4096
HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 8
HEADS = 8
KV_HEADS = 2
EXPERTS = 8
TOP_K = 2
# Tokens per sequence: few, so that at batch 1 each step routes to a subset of the
# experts that changes from step to step (as a large model's micro-batches do).
SEQ = 4


def build(device: str) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=256,
        output_router_logits=False,
        use_cache=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg).to(device)


class RouterMemory:
    """The experts each MoE block's router chose in its last forward (fallback selector)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.chosen: dict[int, list[int]] = {}  # id(experts module) -> experts
        self.handles = []
        for name, m in model.named_modules():
            experts = getattr(m, "experts", None)
            router = getattr(m, "gate", None)
            if router is None:
                router = getattr(m, "router", None)
            if experts is None or router is None or isinstance(experts, torch.nn.ModuleList):
                continue
            self.handles.append(router.register_forward_hook(self._hook(id(experts))))

    def _hook(self, key: int):
        def hook(module, args, output):
            outs = output if isinstance(output, (tuple, list)) else (output,)
            ints = [t for t in outs if isinstance(t, torch.Tensor) and not t.is_floating_point()]
            if ints:
                self.chosen[key] = ints[0].unique().tolist()
                return
            logits = [t for t in outs if isinstance(t, torch.Tensor) and t.shape[-1] == EXPERTS]
            if logits:
                top = logits[0].reshape(-1, EXPERTS).topk(TOP_K, dim=-1).indices
                self.chosen[key] = top.unique().tolist()

        return hook


def make_selector(memory: RouterMemory):
    used = {"args": 0, "router": 0}

    def select(module, args):
        for a in args:
            if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dim() >= 1:
                used["args"] += 1
                return a.unique().tolist()
        used["router"] += 1
        return memory.chosen.get(id(module), list(range(EXPERTS)))

    return select, used


def run(out_path: str, batch: int, steps: int, device: str) -> dict:
    model = build(device)
    model.train()
    fused = [
        n
        for n, m in model.named_modules()
        if any(p.dim() >= 3 and p.shape[0] == EXPERTS for p in m.parameters(recurse=False))
    ]
    opts = {}
    used = None
    if fused:
        memory = RouterMemory(model)
        select, used = make_selector(memory)
        opts = {"expert_selector": select, "num_experts": EXPERTS}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = torch.Generator().manual_seed(1 + batch)
    t0 = time.time()
    with record(model, out_path, optimizer=optimizer, sync=True, **opts) as rec:
        for _ in range(steps):
            tokens = torch.randint(VOCAB, (batch, SEQ + 1), generator=rng).to(device)
            outp = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:].contiguous())
            outp.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    s = trace_stats(out_path)
    return {
        "trace": os.path.basename(out_path),
        "batch": batch,
        "seq": SEQ,
        "steps": steps,
        "seconds": round(time.time() - t0, 2),
        "accesses": rec.accesses,
        "buffers": len(rec.buffers),
        "buffer_bytes": sum(rec.buffers.values()),
        "fused_expert_modules": fused[:3] + (["..."] if len(fused) > 3 else []),
        "selector_used": used,
        "per_step": [
            {k: st[k] for k in ("accesses", "experts", "new_expert_share")} for st in s["per_step"]
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.device}")
    try:
        print(build("cpu").model.layers[0])
    except Exception as e:  # noqa: BLE001 - only a printout
        print(f"(model structure not printed: {e!r})")
    results = []
    for batch in (1, 4):
        path = os.path.join(args.out, f"mixtral_b{batch}.jsonl")
        try:
            r = run(path, batch, args.steps, args.device)
        except Exception as e:  # noqa: BLE001 - one failed config must not lose the other
            import traceback

            traceback.print_exc()
            r = {"trace": os.path.basename(path), "batch": batch, "error": repr(e)}
        print(json.dumps(r))
        results.append(r)
    with open(os.path.join(args.out, "mixtral_stats.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
