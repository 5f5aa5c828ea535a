"""Small randomly initialised decoders that record example Spillway traces.

Plain PyTorch, no downloads. Three demos, run by ``python -m spillway_trace DEMO``:

- ``demo-dense``: embedding, N blocks of attention + MLP, final norm, LM head.
- ``demo-checkpoint``: the same with each block under ``torch.utils.checkpoint``
  (non-reentrant unless ``--reentrant``) and gradient accumulation over 2 micro-batches
  per optimizer step.
- ``demo-moe``: every block's MLP is a mixture of experts (a router picks top-k of 8
  experts per token). ``--experts list`` keeps each expert a module of a ``ModuleList``,
  ``fused`` stores all experts in one ``[E, d, f]`` parameter pair (recorded through the
  recorder's ``expert_selector``), ``mixed`` (default) alternates the two by block.
  Few tokens per step (``--batch 1 --seq 2`` by default) keep each step's set of experts
  small, so that random tokens choose different experts from step to step, as a large
  MoE model's micro-batches do.

``python -m spillway_trace stats PATH`` prints a trace's accesses per step, distinct
buffers, total bytes and, for MoE traces, the share of each step's expert accesses that go
to experts the step before did not use.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from spillway_trace import record

# -- models -----------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal self-attention with a fused q/k/v projection."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    """Two linear layers with a GELU between them."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class FusedExperts(nn.Module):
    """All experts' weights in one parameter pair, ``w1: [E, d, f]`` and ``w2: [E, f, d]``.

    Called as ``experts(x, expert_index, expert_weight)`` with ``x: [tokens, d]`` and the
    router's top-k choice per token (``[tokens, k]`` each).
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, d_model, d_ff) * d_model**-0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, d_ff, d_model) * d_ff**-0.5)

    def forward(
        self, x: torch.Tensor, expert_index: torch.Tensor, expert_weight: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in expert_index.unique().tolist():
            token, slot = (expert_index == e).nonzero(as_tuple=True)
            y = F.gelu(x[token] @ self.w1[e]) @ self.w2[e]
            out = out.index_add(0, token, y * expert_weight[token, slot].unsqueeze(-1))
        return out


def select_fused_experts(module: nn.Module, args: tuple) -> list[int]:
    """The recorder's ``expert_selector`` for :class:`FusedExperts`: the routed experts."""
    return args[1].unique().tolist()


class Moe(nn.Module):
    """Top-k routed mixture of experts: a router, then the chosen experts per token."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, fused: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts: nn.Module
        if fused:
            self.experts = FusedExperts(d_model, d_ff, n_experts)
        else:
            self.experts = nn.ModuleList(Mlp(d_model, d_ff) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weight, index = self.router(x).softmax(dim=-1).topk(self.top_k, dim=-1)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        if isinstance(self.experts, FusedExperts):
            out = self.experts(x, index, weight)
        else:
            out = torch.zeros_like(x)
            # Only the experts some token is routed to run.
            for e in index.unique().tolist():
                token, slot = (index == e).nonzero(as_tuple=True)
                y = self.experts[e](x[token]) * weight[token, slot].unsqueeze(-1)
                out = out.index_add(0, token, y)
        return out.reshape(shape)


class Block(nn.Module):
    """Pre-norm decoder block: attention, then the feed-forward part (MLP or MoE)."""

    def __init__(self, d_model: int, n_heads: int, ffn: nn.Module) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class Decoder(nn.Module):
    """Token embedding, blocks, final norm, LM head (untied)."""

    def __init__(
        self,
        vocab: int,
        d_model: int,
        n_heads: int,
        ffns: Sequence[nn.Module],
        checkpointing: str | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, ffn) for ffn in ffns)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        assert checkpointing in (None, "non-reentrant", "reentrant")
        self.checkpointing = checkpointing

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            if self.checkpointing and torch.is_grad_enabled():
                reentrant = self.checkpointing == "reentrant"
                x = checkpoint(layer, x, use_reentrant=reentrant)
            else:
                x = layer(x)
        return self.head(self.ln_f(x))


# -- demos ------------------------------------------------------------------------------------


@dataclass
class DemoConfig:
    """One demo's model and training loop. Defaults give the dense demo."""

    vocab: int = 8192
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 4
    d_ff: int = 2048
    batch: int = 2
    seq: int = 64
    micro_batches: int = 1
    checkpointing: str | None = None
    moe: str | None = None  # None, "list", "fused" or "mixed"
    n_experts: int = 8
    top_k: int = 2


DEMOS: dict[str, DemoConfig] = {
    "demo-dense": DemoConfig(),
    "demo-checkpoint": DemoConfig(checkpointing="non-reentrant", micro_batches=2),
    "demo-moe": DemoConfig(
        vocab=4096, d_model=256, n_heads=4, d_ff=1024, batch=1, seq=2, moe="mixed"
    ),
}


def build_model(cfg: DemoConfig) -> nn.Module:
    """The decoder ``cfg`` describes, randomly initialised from the current torch seed."""
    ffns: list[nn.Module] = []
    for i in range(cfg.n_layers):
        if cfg.moe is None:
            ffns.append(Mlp(cfg.d_model, cfg.d_ff))
        else:
            fused = cfg.moe == "fused" or (cfg.moe == "mixed" and i % 2 == 1)
            ffns.append(Moe(cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.top_k, fused))
    return Decoder(cfg.vocab, cfg.d_model, cfg.n_heads, ffns, cfg.checkpointing)


def run_demo(
    cfg: DemoConfig,
    out: Any,
    *,
    steps: int,
    device: str = "cpu",
    seed: int = 0,
    **record_options: Any,
) -> dict[str, int]:
    """Trains ``cfg``'s model for ``steps`` optimizer steps on random tokens, recording a
    trace to ``out``. Returns the recorder's counts."""
    torch.manual_seed(seed)
    model = build_model(cfg).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if cfg.moe in ("fused", "mixed"):
        record_options.setdefault("expert_selector", select_fused_experts)
        record_options.setdefault("num_experts", cfg.n_experts)
    tokens_rng = torch.Generator().manual_seed(seed + 1)
    with record(model, out, optimizer=optimizer, **record_options) as recorder:
        for _ in range(steps):
            for _ in range(cfg.micro_batches):
                tokens = torch.randint(
                    cfg.vocab, (cfg.batch, cfg.seq + 1), generator=tokens_rng
                ).to(device)
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
                (loss / cfg.micro_batches).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {
        "accesses": recorder.accesses,
        "markers": recorder.markers,
        "buffers": len(recorder.buffers),
        "buffer_bytes": sum(recorder.buffers.values()),
    }


# -- stats ------------------------------------------------------------------------------------

# In a module of their own, which needs no PyTorch (``python -m spillway_trace stats``).
from spillway_trace_stats import expert_of, print_stats, trace_stats  # noqa: E402, F401


# -- command line -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spillway_trace {demo-dense,demo-checkpoint,demo-moe,stats} ...``"""
    parser = argparse.ArgumentParser(
        prog="python -m spillway_trace",
        description="Record example Spillway traces from small random PyTorch models.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cfg in DEMOS.items():
        p = sub.add_parser(name, help=f"train the {name[5:]} demo model and record it")
        p.add_argument("--out", required=True, help="trace file to write (JSON Lines)")
        p.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
        p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--layers", type=int, default=cfg.n_layers)
        p.add_argument("--d-model", type=int, default=cfg.d_model)
        p.add_argument("--d-ff", type=int, default=cfg.d_ff)
        p.add_argument("--vocab", type=int, default=cfg.vocab)
        p.add_argument("--batch", type=int, default=cfg.batch)
        p.add_argument("--seq", type=int, default=cfg.seq)
        p.add_argument("--micro-batches", type=int, default=cfg.micro_batches)
        p.add_argument("--no-compute-time", action="store_true", help="omit compute_us")
        p.add_argument("--sync", action="store_true", help="synchronize CUDA before each timestamp")
        if cfg.checkpointing:
            p.add_argument("--reentrant", action="store_true", help="reentrant checkpoint")
        if cfg.moe:
            p.add_argument("--experts", choices=["list", "fused", "mixed"], default=cfg.moe)
            p.add_argument("--top-k", type=int, default=cfg.top_k)
            p.add_argument("--num-experts", type=int, default=cfg.n_experts)
    p = sub.add_parser("stats", help="print a trace's counts")
    p.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)

    # Expected for the embedding, whose input (token ids) needs no gradient.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")
    if args.command == "stats":
        for path in args.paths:
            print_stats(path)
        return 0

    cfg = DemoConfig(**vars(DEMOS[args.command]))
    cfg.n_layers, cfg.d_model, cfg.d_ff = args.layers, args.d_model, args.d_ff
    cfg.vocab, cfg.batch, cfg.seq = args.vocab, args.batch, args.seq
    cfg.micro_batches = args.micro_batches
    if cfg.checkpointing and args.reentrant:
        cfg.checkpointing = "reentrant"
    if cfg.moe:
        cfg.moe, cfg.top_k, cfg.n_experts = args.experts, args.top_k, args.num_experts
    counts = run_demo(
        cfg,
        args.out,
        steps=args.steps,
        device=args.device,
        seed=args.seed,
        compute_time=not args.no_compute_time,
        sync=args.sync,
    )
    print(
        f"{args.out}: {counts['accesses']} accesses, {counts['markers']} step markers, "
        f"{counts['buffers']} buffers, {counts['buffer_bytes'] / 2**20:.1f} MiB"
    )
    return 0
