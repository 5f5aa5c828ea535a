"""``spillway.torch``: a PyTorch model's parameters streamed through a Spillway pool.

    pool = spillway.Pool(gpu_budget="6GiB", host_budget="96GiB", page_size="8MiB")
    handle = spillway.torch.offload(model, pool)            # weights now live in the pool
    opt = spillway.torch.Optimizer(torch.optim.AdamW, handle, lr=1e-4)
    for batch in data:
        loss = model(batch).loss
        loss.backward()
        opt.step()          # module by module, parameter by parameter; calls pool.step()
        opt.zero_grad()

Design (``docs/DESIGN.md``, "SDK: Python"):

- **One buffer per module's own parameters** (``recurse=False``), in registration order,
  each parameter at an offset aligned to :data:`PARAM_ALIGN_BYTES`. A parameter's
  ``.data`` is an empty placeholder except while its group is acquired; then it is a
  zero-copy slice of the pool's view (DLPack); when the device cannot show a buffer's
  pages as one array (frames scattered on ``sim``), a gathered copy stands in and is
  written back on release if the acquire was exclusive.
- **Hooks**: a forward pre-hook acquires the module's group (shared: clean pages are
  evicted without a write-back) and a forward hook releases it; a hook on the module's
  outputs acquires it again when backward reaches the module, and it is released once
  its parameters' gradients are stored (or at the end of backward). Acquires nest: a
  group is held while anyone needs it (recomputation inside backward keeps it held).
- **Saved tensors**: autograd keeps tensors for backward that may alias the group's
  memory (``weight.t()`` in ``linear``). A ``saved_tensors_hooks`` pair installed for the
  root module's forward packs such a tensor as *(group, offset, shape, strides)* and
  unpacks it against the group's memory as acquired at backward time, so a released
  group's frames may be reused in between. Other tensors go to the hooks that were
  installed before (a checkpoint's), so activation recomputation keeps working. The
  pool's memory is recognised by device type (a CUDA tensor says ``cuda:0``, the handle
  ``cuda``); ``Offloaded.saved_tensors_packed`` counts the tensors packed so.
- **Parts**: a parameter of at least :data:`PART_MIN_PAGES` pages has gradient and
  optimizer state buffers of its own; a group's smaller parameters share one part.
- **Gradients** accumulate into their part's gradient buffer (written back to the host
  tier when evicted); ``.grad`` is ``None`` outside the optimizer. :func:`gradients`
  reads them. The first store after ``zero_grad`` acquires the buffer with
  ``discard=True``: the old gradients are overwritten, so none is copied to the GPU
  (and the ``learned`` policy, having seen the discard in the last step, reserves the
  buffer's frames ahead of it instead of loading its old bytes).
- **Optimizer**: :class:`Optimizer` makes one inner optimizer per part and steps group
  by group with the weights held exclusively and, a part at a time, the part's
  gradients and optimizer state acquired with them; the state (``exp_avg``, ... every
  tensor shaped like its parameter) lives in the part's state buffer after the first
  step. Frames come free a parameter at a time, not a module at a time. An elementwise
  optimizer (:data:`ELEMENTWISE_OPTIMIZERS`) is stepped *chunked*: a piece of each
  parameter per page, over acquires read page by page (``paged=True``), so no buffer of
  the optimizer phase is ever shown as one array (on ``cuda``: nothing remapped).
  Gradients are stored page by page too. ``step()`` ends with ``pool.step()``.
- **Inference**: under ``torch.no_grad()`` only the weights stream; each forward of the
  root module ends with ``pool.step()`` when no :class:`Optimizer` steps the pool.

On CUDA, tensors taken from a view carry PyTorch's current stream into the view's DLPack
export, so the pool reuses no frame before the kernels queued on it have run (the
DLPack stream contract); a release never blocks the host.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

PARAM_ALIGN_BYTES = 256
"""Offset alignment of each parameter inside its group's buffer (any dtype's alignment,
and what CUDA kernels prefer for vector loads); costs at most 255 bytes per parameter."""

PART_MIN_PAGES = 4
"""A parameter of at least this many of the pool's pages has gradient and optimizer
state buffers of its own (a *part*); a group's smaller parameters share one part. The
optimizer holds one part's gradients and state at a time besides its group's weights,
so frames come free a parameter at a time (a module with several large parameters of
its own holds one parameter's gradients and state at a time, not all of them). Such a
part's gradient starts at its weights' offset within a page and rounds up to whole
pages: at most two pages more than its bytes, half a page per page at this size."""

__all__ = ["offload", "Offloaded", "Optimizer", "gradients", "PARAM_ALIGN_BYTES",
           "PART_MIN_PAGES", "ELEMENTWISE_OPTIMIZERS"]


def _acquire(pool, buf, exclusive: bool = False, discard: bool = False, paged: bool = False):
    """``pool.acquire``/``acquire_mut`` of `buf`; while the PyTorch profiler records, the
    wait shows in its trace as ``spillway.acquire`` (host time until the pages are on the
    GPU), so a profile tells the pool's waits from the model's own time. A `paged`
    acquire is read a page at a time (:class:`_Pages`): the device need not show the
    buffer as one array (no remapping on ``cuda``)."""
    if not getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        return _acquire_now(pool, buf, exclusive, discard, paged)
    with torch.profiler.record_function("spillway.acquire"):
        return _acquire_now(pool, buf, exclusive, discard, paged)


def _acquire_now(pool, buf, exclusive: bool, discard: bool, paged: bool):
    if exclusive:
        return pool.acquire_mut(buf, discard=discard, paged=paged)
    return pool.acquire(buf, paged=paged)


class _Opened:
    """A held view's bytes as one uint8 tensor (``.base``): the view itself when it is one
    array (zero-copy), else its pages gathered into a copy, which ``close()`` writes back
    when the view is exclusive. Close before releasing the view."""

    __slots__ = ("base", "_pages")

    def __init__(self, view):
        if view.contiguous:
            self.base = torch.from_dlpack(view)
            self._pages = None
        else:
            pages = [torch.from_dlpack(view.page(i)) for i in range(view.pages)]
            self.base = torch.cat(pages)
            self._pages = pages if view.exclusive else None

    def close(self) -> None:
        if self._pages is not None:
            off = 0
            for p in self._pages:
                p.copy_(self.base[off:off + p.numel()])
                off += p.numel()
            self._pages = None


class _open:
    """``with _open(view) as base:`` for a view held just for the block."""

    def __init__(self, view):
        self.view = view

    def __enter__(self) -> torch.Tensor:
        self.opened = _Opened(self.view)
        return self.opened.base

    def __exit__(self, *exc) -> None:
        try:
            self.opened.close()
        finally:
            self.view.release()


class _Pages:
    """A held view read a page at a time: ``span(offset, nbytes)`` is those bytes as a
    uint8 tensor, zero-copy, for a span inside one page (or anywhere when the view is one
    array). Nothing is gathered and nothing needs writing back: an exclusive view's spans
    are written in place. With `whole`, any span: a scattered view is gathered as
    :class:`_Opened` does (and written back at the end). Releases the view at the end
    (``with _Pages(view, page) as pages:``)."""

    __slots__ = ("view", "page_bytes", "_opened", "_base", "_pages")

    def __init__(self, view, page_bytes: int, whole: bool = False):
        self.view = view
        self.page_bytes = page_bytes
        self._pages: Dict[int, torch.Tensor] = {}
        try:
            self._opened = _Opened(view) if whole else None
            if self._opened is not None:
                self._base = self._opened.base
            else:
                self._base = torch.from_dlpack(view) if view.contiguous else None
        except BaseException:
            view.release()
            raise

    def span(self, offset: int, nbytes: int) -> torch.Tensor:
        if self._base is not None:
            return self._base[offset:offset + nbytes]
        index, at = divmod(offset, self.page_bytes)
        assert at + nbytes <= self.page_bytes, (offset, nbytes, "crosses a page")
        page = self._pages.get(index)
        if page is None:
            page = self._pages[index] = torch.from_dlpack(self.view.page(index))
        return page[at:at + nbytes]

    def __enter__(self) -> "_Pages":
        return self

    def __exit__(self, *exc) -> None:
        self._base = None
        self._pages.clear()
        try:
            if self._opened is not None:
                self._opened.close()
        finally:
            self.view.release()


def _cuts(numel: int, element_bytes: int, offsets: Iterable[int], page_bytes: int) -> List[int]:
    """Element indices, 0 and `numel` included, that split a tensor of `numel` elements
    stored at each of `offsets` (bytes into buffers of `page_bytes` pages) into pieces
    that lie inside one page of every buffer: an elementwise operation over the copies
    can run a piece at a time on each page's own memory."""
    cuts = {0, numel}
    end = numel * element_bytes
    for offset in offsets:
        boundary = (offset // page_bytes + 1) * page_bytes
        while boundary < offset + end:
            at, rest = divmod(boundary - offset, element_bytes)
            assert rest == 0, (offset, element_bytes, page_bytes)
            cuts.add(at)
            boundary += page_bytes
    return sorted(cuts)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the pool's device. A CUDA tensor reports ``cuda:0`` while
    ``torch.device("cuda")`` has no index, and the two do not compare equal: the pool has
    one GPU, so the type and any index given must agree."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _align(n: int) -> int:
    return (n + PARAM_ALIGN_BYTES - 1) // PARAM_ALIGN_BYTES * PARAM_ALIGN_BYTES


class _Slot:
    """One parameter's place in its group's buffers."""

    __slots__ = ("name", "param", "offset", "part_offset", "nbytes", "element_bytes", "shape",
                 "dtype", "grad_valid", "pooled")

    def __init__(self, name: str, param: nn.Parameter, offset: int):
        self.name = name
        self.param = param
        self.offset = offset
        self.part_offset = 0
        """Where its gradient is in its part's gradient buffer."""
        self.element_bytes = param.element_size()
        self.nbytes = param.numel() * self.element_bytes
        self.shape = tuple(param.shape)
        self.dtype = param.dtype
        self.grad_valid = False
        self.pooled: Optional[List[tuple]] = None
        """``(key index, key)`` of its optimizer state kept in its part's state buffer,
        once its first step made state (``None`` before); state of other shapes (a 0-d
        parameter's, a scalar beside it) stays with the inner optimizer."""

    def of(self, base: torch.Tensor) -> torch.Tensor:
        """The slot's tensor inside `base` (a uint8 view of the group's weights buffer)."""
        return self.at(base, self.offset)

    def grad_of(self, gbase: torch.Tensor) -> torch.Tensor:
        """The slot's gradient inside `gbase` (a uint8 view of its part's gradients)."""
        return self.at(gbase, self.part_offset)

    def at(self, base: torch.Tensor, offset: int) -> torch.Tensor:
        return base[offset:offset + self.nbytes].view(self.dtype).view(self.shape)


class _Part:
    """Some of a group's parameters (one large one, or the group's small ones) with a
    gradient buffer and, after the first optimizer step, an optimizer state buffer.

    Layout: a large parameter's gradient starts at the same offset within a page as its
    weights (`lead`), so the two buffers' page boundaries fall at the same elements; the
    state buffer holds one copy of the gradient buffer's layout per state key
    (``exp_avg``, ``exp_avg_sq``, ...), each starting on a page boundary (`state_span`
    bytes apart). So an elementwise optimizer can step a parameter page by page over all
    its buffers at once (:class:`Optimizer`, ``chunked``), never needing a buffer as one
    array; it costs at most a page per buffer."""

    __slots__ = ("name", "slots", "nbytes", "grad_buf", "state_buf", "state_keys",
                 "state_span", "chunks")

    def __init__(self, name: str, slots: List[_Slot], lead: int = 0):
        self.name = name
        self.slots = slots
        offset = lead
        for s in slots:
            s.part_offset = offset
            offset = _align(offset + s.nbytes)
        self.nbytes = max(offset, 1)
        self.grad_buf = None
        self.state_buf = None
        self.state_keys: List[str] = []
        """The optimizer state's keys in the state buffer, in the order of their copies."""
        self.state_span = 0
        """Bytes from one key's copy of the layout to the next (whole pages)."""
        self.chunks: List[tuple] = []
        """``(slot, start, stop, parameter)``: the pieces a chunked optimizer steps."""

    def state_offset(self, key_index: int, slot: _Slot) -> int:
        """Where `slot`'s state of key `key_index` is in the state buffer."""
        return key_index * self.state_span + slot.part_offset


def _parts(group_name: str, slots: List[_Slot], page_bytes: int) -> List["_Part"]:
    """`slots` in parts: each of at least :data:`PART_MIN_PAGES` pages alone, in
    registration order (its gradient at its weights' offset within a page), then the rest
    together."""
    big = [s for s in slots if s.nbytes >= PART_MIN_PAGES * page_bytes]
    small = [s for s in slots if s.nbytes < PART_MIN_PAGES * page_bytes]
    parts = [_Part(f"{group_name}.{s.name.rsplit('.', 1)[-1]}", [s], s.offset % page_bytes)
             for s in big]
    if small:
        parts.append(_Part(group_name if not big else f"{group_name}.rest", small))
    return parts


class _Group:
    """One module's own parameters: a weights buffer, and its parts (see
    :class:`_Part`) with their gradient and optimizer state buffers made on first use."""

    def __init__(self, owner: "Offloaded", name: str, slots: List[_Slot], nbytes: int):
        self.owner = owner
        self.name = name
        self.slots = slots
        self.nbytes = nbytes
        self.buf = None
        self.parts = _parts(name, slots, owner.pool.page_size)
        self.view = None
        self.base: Optional[torch.Tensor] = None
        self.opened: Optional[_Opened] = None
        self.refs = 0
        self.exclusive = False
        self.backward_held = False
        self.grads_pending = 0

    # -- acquiring the weights -------------------------------------------------------
    def acquire(self, exclusive: bool = False) -> None:
        if self.refs == 0:
            pool = self.owner.pool
            self.view = _acquire(pool, self.buf, exclusive)
            self.exclusive = exclusive
            self.opened = _Opened(self.view)
            self.base = self.opened.base
            self.owner._held[self.base.untyped_storage().data_ptr()] = self
            for s in self.slots:
                s.param.data = s.of(self.base)
        elif exclusive and not self.exclusive:
            raise RuntimeError(f"{self.name}: held shared, cannot be written now")
        self.refs += 1

    def release(self) -> None:
        self.refs -= 1
        assert self.refs >= 0, self.name
        if self.refs == 0:
            for s in self.slots:
                s.param.data = self.owner._placeholder(s.dtype)
            self.owner._held.pop(self.base.untyped_storage().data_ptr(), None)
            self.base = None
            try:
                self.opened.close()
            finally:
                self.opened = None
                self.view.release()
                self.view = None

    # -- gradients -------------------------------------------------------------------
    def store_grads(self) -> None:
        """Moves the parameters' ``.grad`` into their parts' gradient buffers (adding to
        what they hold since the last ``zero_grad``), a part at a time."""
        for part in self.parts:
            slots = [s for s in part.slots if s.param.grad is not None]
            if slots:
                self._store_part(part, slots)

    def _store_part(self, part: _Part, slots: List[_Slot]) -> None:
        pool = self.owner.pool
        page = pool.page_size
        if part.grad_buf is None:
            part.grad_buf = pool.alloc(f"{part.name}.grads", part.nbytes)
        # The first store since ``zero_grad`` overwrites: no slot holds a gradient to add
        # to, so the buffer's old bytes are discarded instead of copied in (a slot left
        # unwritten keeps ``grad_valid`` false and is never read). Stored a page at a
        # time: the buffer never has to be one array.
        first = self.owner.discard_overwritten and not any(s.grad_valid for s in part.slots)
        with _Pages(_acquire(pool, part.grad_buf, True, discard=first, paged=True),
                    page) as pages:
            for s in slots:
                grad = s.param.grad.reshape(-1)
                cuts = _cuts(grad.numel(), s.element_bytes, (s.part_offset,), page)
                for a, b in zip(cuts, cuts[1:]):
                    dst = pages.span(s.part_offset + a * s.element_bytes,
                                     (b - a) * s.element_bytes).view(s.dtype)
                    if s.grad_valid:
                        dst.add_(grad[a:b])
                    else:
                        dst.copy_(grad[a:b])
                s.grad_valid = True
                s.param.grad = None


class Offloaded:
    """What :func:`offload` returns: the groups of a model and the hooks that stream them."""

    def __init__(self, model: nn.Module, pool: Any):
        self.model = model
        self.pool = pool
        self.device = torch.device("cpu" if pool.device == "sim" else "cuda")
        self.groups: List[_Group] = []
        self._held: Dict[int, _Group] = {}
        self._placeholders: Dict[torch.dtype, torch.Tensor] = {}
        self._handles: list = []
        self._saved_hooks: list = []
        self._backward_callback_queued = False
        self.optimizer_steps_pool = False
        self.saved_tensors_packed = 0
        """How many tensors autograd saved were recognised as the pool's memory (packed as
        a reference to their group, unpacked against the group as acquired in backward)."""
        self.discard_overwritten = True
        """Whether buffers about to be overwritten entirely (gradients at their first store
        after ``zero_grad``, optimizer state when it moves into the pool) are acquired with
        ``discard=True`` (no copy to the GPU); False copies their old bytes in."""

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._placeholders.get(dtype)
        if t is None:
            t = self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return t

    # -- forward and backward hooks ----------------------------------------------------
    def _pre_forward(self, groups: List[_Group]):
        def hook(module, args):
            done = []
            try:
                for g in groups:
                    g.acquire()
                    done.append(g)
            except BaseException:
                for g in done:
                    g.release()
                raise
        return hook

    def _post_forward(self, groups: List[_Group]):
        def hook(module, args, output):
            training = torch.is_grad_enabled() and any(
                s.param.requires_grad for g in groups for s in g.slots)
            if training:
                outs = [t for t in pytree.tree_leaves(output)
                        if isinstance(t, torch.Tensor) and t.requires_grad]
                if outs:
                    fired = [False]

                    def pre_backward(_grad):
                        if not fired[0]:
                            fired[0] = True
                            self._enter_backward(groups)
                    for t in outs:
                        t.register_hook(pre_backward)
                if torch._C._current_graph_task_id() != -1:
                    # Recomputation inside backward (checkpointing): the tensors it saves
                    # are used at once, so the group stays held until its gradients.
                    self._enter_backward(groups)
            for g in groups:
                if g.refs > 0:  # not when the pre-hook failed (this hook always runs)
                    g.release()
        return hook

    def _enter_backward(self, groups: List[_Group]) -> None:
        for g in groups:
            if not g.backward_held:
                g.acquire()
                g.backward_held = True
                g.grads_pending = sum(1 for s in g.slots if s.param.requires_grad)
        if not self._backward_callback_queued:
            self._backward_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _after_grad(self, group: _Group):
        def hook(param):
            if group.backward_held:
                group.grads_pending -= 1
                if group.grads_pending <= 0:
                    group.store_grads()
                    group.backward_held = False
                    group.release()
            else:
                group.store_grads()
        return hook

    def _end_backward(self) -> None:
        self._backward_callback_queued = False
        for g in self.groups:
            if g.backward_held:
                g.store_grads()
                g.backward_held = False
                g.release()

    # -- saved tensors -----------------------------------------------------------------
    def _pack(self, outer_pack):
        def pack(t: torch.Tensor):
            mine = _same_device(t.device, self.device)
            g = self._held.get(t.untyped_storage().data_ptr()) if mine else None
            if g is not None:
                self.saved_tensors_packed += 1
                return ("spillway", g, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                        t.requires_grad)
            return ("outer", outer_pack(t) if outer_pack is not None else t)
        return pack

    def _unpack(self, outer_unpack):
        def unpack(packed):
            if packed[0] == "outer":
                return outer_unpack(packed[1]) if outer_unpack is not None else packed[1]
            _, g, offset, shape, stride, dtype, _rg = packed
            if g.base is None:  # backward reached it before its output hook
                self._enter_backward([g])
            t = torch.empty(0, dtype=dtype, device=self.device)
            return t.set_(g.base.untyped_storage(), offset, shape, stride)
        return unpack

    def _root_pre(self, module, args):
        outer = None
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is not None:
            outer = top(False)
        outer_pack, outer_unpack = outer if outer else (None, None)
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack(outer_pack),
                                                       self._unpack(outer_unpack))
        ctx.__enter__()
        self._saved_hooks.append(ctx)

    def _root_post(self, module, args, output):
        if self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        if not torch.is_grad_enabled() and not self.optimizer_steps_pool:
            self.pool.step()

    # -- reading back --------------------------------------------------------------------
    def named_groups(self) -> Iterable[tuple]:
        return ((g.name, g) for g in self.groups)

    def remove(self) -> None:
        """Removes the hooks (the parameters stay in the pool)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def offload(model: nn.Module, pool: Any) -> Offloaded:
    """Moves every parameter's storage into `pool` (one buffer per module's own
    parameters, ordered as registered) and registers the hooks that acquire a module's
    parameters just before its forward and its backward and release them right after.
    The parameters may be on any device; afterwards they live in the pool, and a
    parameter's ``.data`` is only valid inside its module's forward and backward (and
    inside :class:`Optimizer` steps). Returns the handle :class:`Optimizer` and
    :func:`gradients` take."""
    handle = Offloaded(model, pool)
    owner: Dict[int, _Group] = {}
    uses: Dict[nn.Module, List[_Group]] = {}
    for mname, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        slots, offset, needed = [], 0, []
        for pname, p in params:
            if id(p) in owner:  # a tied weight: owned by the first module that has it
                if owner[id(p)] not in needed:
                    needed.append(owner[id(p)])
                continue
            slots.append(_Slot(f"{mname}.{pname}" if mname else pname, p, offset))
            offset = _align(offset + slots[-1].nbytes)
        if slots:
            g = _Group(handle, mname or "<root>", slots, max(offset, 1))
            g.buf = pool.alloc(f"{g.name}.params", g.nbytes)
            for s in slots:
                # Into the host tier directly: no GPU page is dirtied by the move.
                data = s.param.detach().reshape(-1).view(torch.uint8).cpu().numpy()
                pool.write(g.buf, s.offset, data)
                owner[id(s.param)] = g
            for s in slots:
                s.param.data = handle._placeholder(s.dtype)
                s.param.grad = None
            handle.groups.append(g)
            needed.insert(0, g)
        uses[module] = needed
    for module, groups in uses.items():
        handle._handles.append(module.register_forward_pre_hook(handle._pre_forward(groups)))
        handle._handles.append(
            module.register_forward_hook(handle._post_forward(groups), always_call=True))
    for g in handle.groups:
        for s in g.slots:
            if s.param.requires_grad:
                handle._handles.append(
                    s.param.register_post_accumulate_grad_hook(handle._after_grad(g)))
    handle._handles.append(model.register_forward_pre_hook(handle._root_pre))
    handle._handles.append(model.register_forward_hook(handle._root_post, always_call=True))
    model._spillway = handle
    return handle


def gradients(handle: Offloaded) -> Dict[str, torch.Tensor]:
    """Copies of the gradients accumulated since the last ``zero_grad``, by parameter
    name (``None`` for a parameter that got none)."""
    out: Dict[str, Optional[torch.Tensor]] = {}
    pool = handle.pool
    for g in handle.groups:
        for part in g.parts:
            if part.grad_buf is None:
                out.update({s.name: None for s in part.slots})
                continue
            with _open(pool.acquire(part.grad_buf)) as gbase:
                for s in part.slots:
                    out[s.name] = s.grad_of(gbase).clone() if s.grad_valid else None
    return {s.name: out[s.name] for g in handle.groups for s in g.slots}


def parameters(handle: Offloaded) -> Dict[str, torch.Tensor]:
    """Copies of the parameters' current values, by name."""
    out = {}
    for g in handle.groups:
        with _open(handle.pool.acquire(g.buf)) as base:
            for s in g.slots:
                out[s.name] = s.of(base).clone()
    return out


ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam",
                                      "RMSprop") if hasattr(torch.optim, n))
"""Optimizers whose update of each element reads only that element of the parameter,
gradient and state (and per-parameter scalars such as the step count): stepped a piece at
a time they give the same bits as stepped whole. :class:`Optimizer` steps them chunked."""


def _param_shaped(v: Any, like: torch.Tensor) -> bool:
    """Whether optimizer state `v` is a tensor shaped and typed like `like` (``exp_avg``),
    not a scalar kept beside it (``step``)."""
    return (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == like.shape
            and v.dtype == like.dtype)


class Optimizer:
    """``Optimizer(torch.optim.AdamW, handle, lr=...)``: steps the parameters of
    :func:`offload` group by group with the group's weights acquired exclusively and, a
    part (see :data:`PART_MIN_PAGES`) at a time, the part's gradients and optimizer state;
    the state lives in the pool from the first step on. ``step()`` ends with
    ``pool.step()``.

    ``chunked`` (default: whether `optimizer_cls` is one of
    :data:`ELEMENTWISE_OPTIMIZERS`): step every parameter a piece at a time, each piece
    inside one page of its weights, gradients and state (:class:`_Part`'s layout), so no
    buffer of the optimizer phase has to be shown as one array (on ``cuda``: no
    remapping, the optimizer phase's main cost when frames are scattered). The inner
    optimizers then see each piece as a parameter of its own; their results are the same
    bits. Otherwise one ``optimizer_cls`` per part, over the part's parameters whole."""

    def __init__(self, optimizer_cls: Callable[..., torch.optim.Optimizer], handle: Offloaded,
                 chunked: Optional[bool] = None, **kwargs: Any):
        self.handle = handle
        handle.optimizer_steps_pool = True
        self.chunked = optimizer_cls in ELEMENTWISE_OPTIMIZERS if chunked is None else chunked
        page = handle.pool.page_size
        self.inner = []
        for g in handle.groups:
            opts = []
            for part in g.parts:
                if self.chunked:
                    part.chunks = [
                        (s, a, b, nn.Parameter(handle._placeholder(s.dtype),
                                               requires_grad=s.param.requires_grad))
                        for s in part.slots
                        for cuts in [_cuts(s.nbytes // s.element_bytes, s.element_bytes,
                                           (s.offset, s.part_offset), page)]
                        for a, b in zip(cuts, cuts[1:])]
                    opts.append(optimizer_cls([c[3] for c in part.chunks], **kwargs))
                else:
                    opts.append(optimizer_cls([s.param for s in part.slots], **kwargs))
                if opts[-1].state:
                    raise TypeError(
                        f"{optimizer_cls.__name__} makes its state when it is constructed "
                        "(torch.optim.Adagrad does), from the parameters' values, which live "
                        "in the pool and are not there then: use an optimizer that makes its "
                        "state at its first step (Adam, AdamW, SGD, RMSprop, ...)")
            self.inner.append(opts)

    # -- the state buffer ------------------------------------------------------------
    def _state_into_pool(self, part: _Part, opt: torch.optim.Optimizer,
                         held: List[tuple]) -> None:
        """After the part's first step: every state tensor shaped like what it belongs to
        (`held`: ``(slot, start, stop, parameter)`` as stepped) goes into the part's new
        state buffer (:class:`_Part`'s layout); the buffer is the part's only once every
        copy is done."""
        keys: List[str] = []
        for _s, _a, _b, p in held:
            for key, v in opt.state.get(p, {}).items():
                if key not in keys and _param_shaped(v, p):
                    keys.append(key)
        if not keys:
            return
        pool = self.handle.pool
        page = pool.page_size
        span = -(-part.nbytes // page) * page
        buf = pool.alloc(f"{part.name}.state", (len(keys) - 1) * span + part.nbytes)
        part.state_keys, part.state_span = keys, span
        try:
            # Every byte the layout names is written here: nothing to copy in.
            with _Pages(_acquire(pool, buf, True, discard=self.handle.discard_overwritten,
                                 paged=self.chunked), page, whole=not self.chunked) as pages:
                new = self._copy_new_state(part, opt, held, pages)
        except BaseException:
            part.state_keys, part.state_span = [], 0
            pool.free(buf)
            raise
        for s, slot_keys in new:
            s.pooled = slot_keys
        part.state_buf = buf
        self._bind_state(part, opt, held, None)

    def _copy_new_state(self, part: _Part, opt: torch.optim.Optimizer, held: List[tuple],
                        pages: _Pages) -> List[tuple]:
        """Copies the state that this step made for slots with none in the pool yet (their
        first step) into the state buffer (`pages`, held exclusively). Returns ``(slot,
        pooled keys)`` of those slots: the caller marks them once the copies are kept, and
        from then on their state lives there."""
        new: Dict[int, tuple] = {}
        for s, a, b, p in held:
            if s.pooled is not None:
                continue
            state = opt.state.get(p, {})
            if not state:
                continue
            keys = [(i, key) for i, key in enumerate(part.state_keys)
                    if _param_shaped(state.get(key), p)]
            for i, key in keys:
                self._state_span(pages, part, i, s, a, b).copy_(state[key].reshape(-1))
            new[id(s)] = (s, keys)
        return list(new.values())

    @staticmethod
    def _state_span(pages: _Pages, part: _Part, i: int, s: _Slot, a: int, b: int):
        """Elements `a`..`b` of `s`'s state of key `i` (a flat tensor)."""
        return pages.span(part.state_offset(i, s) + a * s.element_bytes,
                          (b - a) * s.element_bytes).view(s.dtype)

    def _bind_state(self, part: _Part, opt: torch.optim.Optimizer, held: List[tuple],
                    pages: Optional[_Pages]) -> None:
        """Points the inner optimizer's state of `held` at the state buffer (`pages`), or
        at placeholders (``None``: the buffer is not held)."""
        for s, a, b, p in held:
            if not s.pooled:
                continue
            state = opt.state[p]
            for i, key in s.pooled:
                if pages is None:
                    state[key] = self.handle._placeholder(s.dtype)
                else:
                    state[key] = self._state_span(pages, part, i, s, a, b).view(p.shape)

    # -- stepping --------------------------------------------------------------------
    def _step_part(self, part: _Part, opt: torch.optim.Optimizer, weights) -> None:
        """Steps `part`'s parameters that have gradients; `weights` is the group's
        buffer as held: a tensor of it whole, or :class:`_Pages` when chunked."""
        pool = self.handle.pool
        page = pool.page_size
        if part.grad_buf is None or not any(s.grad_valid for s in part.slots):
            return
        if self.chunked:
            held = [c for c in part.chunks if c[0].grad_valid]
        else:
            held = [(s, 0, s.nbytes // s.element_bytes, s.param)
                    for s in part.slots if s.grad_valid]
        paged = self.chunked
        with _Pages(_acquire(pool, part.grad_buf, paged=paged), page, whole=not paged) as grads:
            states = None
            try:
                if part.state_buf is not None:
                    states = _Pages(_acquire(pool, part.state_buf, True, paged=paged), page,
                                    whole=not paged)
                for s, a, b, p in held:
                    n = (b - a) * s.element_bytes
                    if self.chunked:
                        p.data = weights.span(s.offset + a * s.element_bytes, n).view(s.dtype)
                    p.grad = grads.span(s.part_offset + a * s.element_bytes,
                                        n).view(s.dtype).view(p.shape)
                if states is not None:
                    self._bind_state(part, opt, held, states)
                opt.step()
                if states is None:
                    self._state_into_pool(part, opt, held)
                elif any(h[0].pooled is None for h in held):
                    # A slot's first step after the part's (no gradient until now); the
                    # `finally` below unbinds it with the others.
                    for s, slot_keys in self._copy_new_state(part, opt, held, states):
                        s.pooled = slot_keys
            finally:
                for s, _a, _b, p in held:
                    p.grad = None
                    if self.chunked:
                        p.data = self.handle._placeholder(s.dtype)
                if states is not None:
                    self._bind_state(part, opt, held, None)
                    states.__exit__()

    def step(self) -> None:
        pool = self.handle.pool
        for g, opts in zip(self.handle.groups, self.inner):
            if not any(s.grad_valid for s in g.slots):
                continue
            if self.chunked:
                assert g.refs == 0, f"{g.name} is held: step outside forward and backward"
                with _Pages(_acquire(pool, g.buf, True, paged=True), pool.page_size) as w:
                    for part, opt in zip(g.parts, opts):
                        self._step_part(part, opt, w)
                continue
            g.acquire(exclusive=True)
            try:
                for part, opt in zip(g.parts, opts):
                    self._step_part(part, opt, g.base)
            finally:
                g.release()
        pool.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forgets the accumulated gradients (the buffers are overwritten next time)."""
        for g in self.handle.groups:
            for s in g.slots:
                s.grad_valid = False
                s.param.grad = None
