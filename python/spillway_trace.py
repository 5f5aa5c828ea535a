"""Record the order in which a PyTorch job touches its weights, as a Spillway trace.

The trace format is in ``docs/TRACE.md``: JSON Lines, one access per line,
``{"step": int, "buffer": str, "bytes": int, "phase": str}`` plus an optional
``"compute_us"``. Spillway's replay engine (``bench/src/trace.rs`` parses the file) feeds
such a trace to the pool to measure how well it prefetches.

Usage::

    from spillway_trace import record

    with record(model, "job.jsonl", optimizer=opt):
        for batch in data:
            loss = model(batch).sum()
            loss.backward()
            opt.step()          # writes the step marker and starts the next step
            opt.zero_grad()

What is recorded (plain PyTorch module hooks, nothing else):

- A *buffer* is a module that directly owns parameters (``parameters(recurse=False)``),
  named by its qualified name (``layers.3.attn.qkv``); its size is the sum of those
  parameters' bytes. A parameter shared by several modules (tied weights) belongs to the
  first module that owns it; other modules that use it access that module's buffer.
- A forward pre-hook records ``fwd`` each time the module runs forward; a full backward
  pre-hook records ``bwd`` when its output gradient is ready (just before autograd runs the
  module's backward). A forward that runs while
  autograd is executing a backward pass is activation recomputation (``torch.utils.checkpoint``,
  reentrant or not) and is recorded as ``bwd-recompute``. "Executing a backward pass" is
  ``torch._C._current_graph_task_id() != -1``, the same test PyTorch's own
  ``torch.utils.module_tracker.ModuleTracker`` uses; on a PyTorch without it, a flag set by
  the first backward pre-hook and cleared by an autograd end-of-backward callback.
- A step marker ``{"step": N, "buffer": "", "bytes": 0, "phase": "step"}`` ends step N:
  written by an optimizer step post-hook when ``optimizer`` is given, or by
  ``recorder.step()``. Gradient accumulation (several forward/backward passes per optimizer
  step) therefore stays within one step.
- ``compute_us`` (unless ``compute_time=False``): microseconds from this access to the next
  one, by ``time.perf_counter()``; the last access gets the time until the recorder closes.
  On CUDA this is host time (kernels are asynchronous) unless ``sync=True``, which calls
  ``torch.cuda.synchronize()`` in every hook before reading the clock (slow, but the gaps
  are then GPU compute). The recorder's own work in a hook (a few microseconds) is counted.
- Mixture of experts. Experts that are separate modules (a ``ModuleList``) need nothing
  special: only the experts a batch is routed to run, so only their hooks fire. Experts
  fused into one parameter of shape ``[num_experts, ...]`` need ``expert_selector(module,
  args) -> iterable of int``, called in the module's forward pre-hook with its positional
  arguments, which names the experts this call uses. Such a module is recorded as one buffer
  per chosen expert, ``{name}.expert{i}``, whose size is expert i's slice of the expert
  parameters (plus a buffer ``{name}`` for its other parameters, if any). Its backward is
  recorded for the same experts, through a gradient hook on the call's output. Which modules
  are fused: ``expert_modules`` (qualified names), or, when only ``num_experts`` is given,
  each module that directly owns a parameter with at least 3 dimensions whose first is
  ``num_experts`` (3 dimensions so that a router's ``[num_experts, d]`` weight is not taken
  for experts); its parameters whose first dimension is ``num_experts`` are the experts'.

PyTorch warns once that a "full backward hook is firing when gradients are computed with
respect to module outputs since no inputs require gradients": that is the embedding (its
input is token ids), whose ``bwd`` is recorded correctly all the same.

Limits: a module whose output is modified in place (e.g. ``nn.ReLU(inplace=True)`` right
after a hooked ``Linear``) makes PyTorch's full backward hooks raise; such models need an
out-of-place op there. Parameters only: registered buffers (BatchNorm statistics) are not
counted. If a ``GradScaler`` skips ``optimizer.step()``, no marker is written and that
iteration's accesses join the next step. At most ``max_accesses`` accesses are written (the
parser's limit); past it the recorder stops recording and warns once.

Run ``python -m spillway_trace --help`` for the demo models that record example traces.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from os import PathLike
from typing import IO, Any

import sys

if __name__ == "__main__":
    # `python -m spillway_trace stats` reads JSON only: it runs without PyTorch.
    if sys.argv[1:2] == ["stats"]:
        from spillway_trace_stats import main as _stats_main

        raise SystemExit(_stats_main(sys.argv[2:]))
    try:
        import torch  # noqa: F401
    except ImportError as _e:
        raise SystemExit(
            f"python -m spillway_trace: the demo models need PyTorch (pip install torch): {_e}; "
            "`python -m spillway_trace stats PATH` needs none"
        ) from None

import torch
from torch import nn

__all__ = [
    "ACCESSES_MAX",
    "BUFFER_NAME_BYTES_MAX",
    "Recorder",
    "record",
]

#: Most accesses one trace may hold: the Rust parser's ``ACCESSES_MAX`` (2^24).
ACCESSES_MAX = 1 << 24
#: Longest buffer name the parser accepts (``BUFFER_NAME_BYTES_MAX``).
BUFFER_NAME_BYTES_MAX = 256

ExpertSelector = Callable[[nn.Module, tuple], Iterable[int]]


def _in_backward_by_task_id() -> bool:
    return torch._C._current_graph_task_id() != -1


_HAS_TASK_ID = hasattr(torch._C, "_current_graph_task_id")


def _param_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output that gradients will flow into."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


class _FusedExperts:
    """What the recorder knows of one module whose experts share a parameter."""

    def __init__(self, name: str, module: nn.Module, num_experts: int, shared: list[str]):
        self.name = name
        self.num_experts = num_experts
        expert_bytes = 0
        own_bytes = 0
        for p in module.parameters(recurse=False):
            if p.dim() >= 2 and p.shape[0] == num_experts:
                expert_bytes += _param_bytes(p)
            else:
                own_bytes += _param_bytes(p)
        if expert_bytes == 0:
            raise ValueError(
                f"module {name!r} was named an expert module but owns no parameter whose "
                f"first dimension is num_experts={num_experts}"
            )
        self.expert_slice_bytes = expert_bytes // num_experts
        self.own_bytes = own_bytes
        # Buffers of tied parameters owned by other modules, accessed with this one.
        self.shared = shared
        # Experts chosen by forward calls that have not returned yet (one per nesting level).
        self.calls: list[list[int]] = []


class Recorder:
    """Records a model's accesses to a trace file; see the module doc.

    Use as a context manager (or call :meth:`start` and :meth:`close`). Hooks are added on
    start and removed on close; the file is written as the job runs and is complete once
    :meth:`close` returns.
    """

    def __init__(
        self,
        model: nn.Module,
        path: str | PathLike[str] | IO[str],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        compute_time: bool = True,
        sync: bool = False,
        expert_selector: ExpertSelector | None = None,
        num_experts: int | None = None,
        expert_modules: Sequence[str] | None = None,
        start_step: int = 0,
        max_accesses: int = ACCESSES_MAX,
    ) -> None:
        if (expert_modules or num_experts) and expert_selector is None:
            raise ValueError("expert_modules / num_experts need an expert_selector")
        if expert_selector is not None and num_experts is None:
            raise ValueError("expert_selector needs num_experts")
        if start_step < 0:
            raise ValueError("start_step must be >= 0")
        self.model = model
        self.optimizer = optimizer
        self.compute_time = compute_time
        self.sync = sync
        self.expert_selector = expert_selector
        self.num_experts = num_experts
        self.max_accesses = max_accesses
        self._path = path
        self._file: IO[str] | None = None
        self._owns_file = False
        self._handles: list[Any] = []
        self._lock = threading.RLock()
        self._step = start_step
        # Lines not written yet: an access waiting for the time to the next access, then
        # the markers written after it.
        self._held: list[dict[str, Any]] = []
        self._held_time = 0.0
        self._bw_flag = False
        self._stopped = False
        self.accesses = 0
        self.markers = 0
        #: Buffer name -> bytes, for every buffer the recorder may emit.
        self.buffers: dict[str, int] = {}
        self._plan_buffers(expert_modules)

    # -- public ---------------------------------------------------------------------------

    @property
    def current_step(self) -> int:
        """The step that accesses are recorded in now."""
        return self._step

    def step(self) -> None:
        """Ends the current step: writes its marker; later accesses belong to the next one.

        Called by the optimizer's step post-hook when an optimizer was given; call it by
        hand otherwise (or to mark steps of a job without an optimizer).
        """
        with self._lock:
            if self._file is None:
                raise RuntimeError("the recorder is not started")
            self._emit({"step": self._step, "buffer": "", "bytes": 0, "phase": "step"}, None)
            self.markers += 1
            self._step += 1

    def start(self) -> Recorder:
        """Opens the file and adds the hooks."""
        if self._file is not None:
            raise RuntimeError("the recorder is already started")
        if isinstance(self._path, (str, PathLike)):
            self._file = open(self._path, "w", encoding="utf-8")  # noqa: SIM115
            self._owns_file = True
        else:
            self._file = self._path
        self._add_hooks()
        return self

    def close(self) -> None:
        """Removes the hooks, writes what is held and closes the file (if it opened it)."""
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if self._file is None:
                return
            self._flush(self._now())
            if self._owns_file:
                self._file.close()
            else:
                self._file.flush()
            self._file = None

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- planning ---------------------------------------------------------------------------

    def _plan_buffers(self, expert_modules: Sequence[str] | None) -> None:
        """Decides which buffers each module touches (before any hook is added)."""
        owner: dict[int, str] = {}  # id(parameter) -> buffer that holds it
        # Module -> (own buffer or None, buffers of tied parameters other modules own).
        self._plain: list[tuple[str, nn.Module, list[str]]] = []
        self._fused: list[tuple[nn.Module, _FusedExperts]] = []
        wanted = set(expert_modules or ())
        named = dict(self.model.named_modules())
        missing = wanted - named.keys()
        if missing:
            raise ValueError(f"expert_modules not in the model: {sorted(missing)}")
        for name, module in named.items():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            buffer_name = name or "model"
            if any(b == buffer_name or b.startswith(buffer_name + ".expert") for b in self.buffers):
                raise ValueError(f"two buffers would be named {buffer_name!r}")
            if len(buffer_name.encode()) > BUFFER_NAME_BYTES_MAX - len(".expert") - 10:
                raise ValueError(f"module name longer than the trace allows: {buffer_name!r}")
            own = [p for p in params if id(p) not in owner]
            shared = list(dict.fromkeys(owner[id(p)] for p in params if id(p) in owner))
            for p in own:
                owner[id(p)] = buffer_name
            if self._is_fused(name, module, wanted):
                assert self.num_experts is not None
                fused = _FusedExperts(buffer_name, module, self.num_experts, shared)
                self._fused.append((module, fused))
                if fused.own_bytes:
                    self.buffers[buffer_name] = fused.own_bytes
                for i in range(fused.num_experts):
                    self.buffers[f"{buffer_name}.expert{i}"] = fused.expert_slice_bytes
                continue
            own_bytes = sum(_param_bytes(p) for p in own)
            touched = ([buffer_name] if own_bytes else []) + shared
            if not touched:
                continue
            if own_bytes:
                self.buffers[buffer_name] = own_bytes
            self._plain.append((buffer_name, module, touched))
        # A tied parameter's owner may be a fused module: its buffer is its `own` part.
        for _, _, touched in self._plain:
            touched[:] = [b for b in touched if b in self.buffers]

    def _is_fused(self, name: str, module: nn.Module, wanted: set[str]) -> bool:
        if self.expert_selector is None:
            return False
        if wanted:
            return name in wanted
        return any(
            p.dim() >= 3 and p.shape[0] == self.num_experts
            for p in module.parameters(recurse=False)
        )

    def _add_hooks(self) -> None:
        for _, module, touched in self._plain:
            self._handles.append(module.register_forward_pre_hook(self._fwd_hook(touched)))
            self._handles.append(module.register_full_backward_pre_hook(self._bwd_hook(touched)))
        for module, fused in self._fused:
            self._handles.append(module.register_forward_pre_hook(self._fused_fwd_pre_hook(fused)))
            self._handles.append(
                module.register_forward_hook(self._fused_fwd_hook(fused), always_call=True)
            )
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self.step()))

    # -- hooks -------------------------------------------------------------------------------

    def _in_backward(self) -> bool:
        if _HAS_TASK_ID:
            return _in_backward_by_task_id()
        return self._bw_flag

    def _note_backward(self) -> None:
        """Fallback backward tracking: set until the running backward pass ends."""
        if _HAS_TASK_ID or self._bw_flag:
            return
        self._bw_flag = True

        def clear() -> None:
            self._bw_flag = False

        torch.autograd.Variable._execution_engine.queue_callback(clear)

    def _fwd_hook(self, touched: list[str]) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            phase = "bwd-recompute" if self._in_backward() else "fwd"
            self._access(touched, phase)

        return hook

    def _bwd_hook(self, touched: list[str]) -> Callable[..., None]:
        def hook(module: nn.Module, grad_output: tuple) -> None:
            self._note_backward()
            self._access(touched, "bwd")

        return hook

    def _fused_fwd_pre_hook(self, fused: _FusedExperts) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            assert self.expert_selector is not None
            chosen = sorted({int(i) for i in self.expert_selector(module, args)})
            bad = [i for i in chosen if not 0 <= i < fused.num_experts]
            if bad:
                raise ValueError(
                    f"expert_selector chose experts {bad} of {fused.name!r}, "
                    f"which has {fused.num_experts}"
                )
            fused.calls.append(chosen)
            phase = "bwd-recompute" if self._in_backward() else "fwd"
            self._access(self._fused_buffers(fused, chosen), phase)

        return hook

    def _fused_fwd_hook(self, fused: _FusedExperts) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not fused.calls:
                return  # the pre-hook raised (always_call runs this hook anyway)
            chosen = fused.calls.pop()
            tensors = _output_tensors(output)
            if not tensors:
                return  # no gradient will flow back through this call
            names = self._fused_buffers(fused, chosen)
            fired = [False]

            def on_grad(grad: torch.Tensor) -> None:
                # Once per call, at the first output gradient: when a full backward
                # pre-hook would fire.
                if not fired[0]:
                    fired[0] = True
                    self._note_backward()
                    self._access(names, "bwd")

            for t in tensors:
                t.register_hook(on_grad)

        return hook

    def _fused_buffers(self, fused: _FusedExperts, chosen: list[int]) -> list[str]:
        names = [fused.name] if fused.own_bytes else []
        names += [f"{fused.name}.expert{i}" for i in chosen]
        return names + [b for b in fused.shared if b in self.buffers]

    # -- writing -----------------------------------------------------------------------------

    def _now(self) -> float:
        if self.sync and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _access(self, names: list[str], phase: str) -> None:
        with self._lock:
            if self._file is None or self._stopped:
                return
            now = self._now()
            for name in names:
                if self.accesses >= self.max_accesses:
                    self._stopped = True
                    warnings.warn(
                        f"spillway_trace: {self.max_accesses} accesses recorded, the most a "
                        "trace may hold; recording stops here",
                        stacklevel=3,
                    )
                    return
                line = {
                    "step": self._step,
                    "buffer": name,
                    "bytes": self.buffers[name],
                    "phase": phase,
                }
                self.accesses += 1
                self._emit(line, now)

    def _emit(self, line: dict[str, Any], now: float | None) -> None:
        """Writes `line`, or holds it until the time to the next access is known.

        `now` is the access's time, or None for a marker (markers carry no time: the time
        across a marker belongs to the access before it).
        """
        assert self._file is not None
        if not self.compute_time:
            self._write(line)
            return
        if now is None:
            if self._held:
                self._held.append(line)
            else:
                self._write(line)
            return
        self._flush(now)
        self._held = [line]
        self._held_time = now

    def _flush(self, now: float) -> None:
        if not self._held:
            return
        first = self._held[0]
        first["compute_us"] = round(max(0.0, now - self._held_time) * 1e6, 1)
        for line in self._held:
            self._write(line)
        self._held = []

    def _write(self, line: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(line, allow_nan=False))
        self._file.write("\n")


def record(
    model: nn.Module,
    path: str | PathLike[str] | IO[str],
    **options: Any,
) -> Recorder:
    """A :class:`Recorder` for ``model`` writing to ``path``; use it in a ``with`` block.

    Options are :class:`Recorder`'s keyword arguments: ``optimizer``, ``compute_time``,
    ``sync``, ``expert_selector``, ``num_experts``, ``expert_modules``, ``start_step``,
    ``max_accesses``.
    """
    return Recorder(model, path, **options)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m spillway_trace demo-dense --out PATH --steps N``."""
    from spillway_trace_demos import main as demos_main

    return demos_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
