"""Type stubs of the Rust extension ``spillway._core`` (crates/spillway-py/src)."""

import os
from types import TracebackType
from typing import Any, Dict, Literal, Optional, Protocol, Tuple, Type, Union

Size = Union[int, str]
"""Bytes as an int, or a string with a unit: ``"8GiB"``, ``"512MiB"``, ``"64MB"``."""

BytesLike = Union[bytes, bytearray, memoryview, Any]

DeviceChoice = Literal["auto", "sim", "cuda"]
"""``Pool``'s ``device`` argument."""

PolicyName = Literal["learned", "clock", "on_demand"]
"""``Pool``'s ``policy`` argument."""

__version__: str

class Buffer:
    """A buffer of a pool: a handle. Free it with ``Pool.free``."""

    @property
    def name(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def id(self) -> int: ...
    def __len__(self) -> int: ...

class _DLPackExporter(Protocol):
    """What ``PageView`` and ``View`` share: the DLPack export protocol (a name of these
    stubs only; at run time each class defines the two methods itself)."""

    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

class PageView(_DLPackExporter):
    """Page ``index`` of a held view, exportable through DLPack."""

    @property
    def index(self) -> int: ...

class View(_DLPackExporter):
    """An acquired buffer: its pages stay on the GPU until ``__exit__``/``release()``.

    ``numpy.from_dlpack(view)`` / ``torch.from_dlpack(view)`` give a zero-copy 1-D uint8
    tensor (CPU on the ``sim`` device, CUDA on ``cuda``; read-only unless ``acquire_mut``)
    when ``contiguous`` (its pages in consecutive frames, or mapped into one range on
    ``cuda``); else export pages with ``view.page(i)``. A tensor may be used only
    while the view is held: afterwards it shows whatever the frames hold next (never a
    crash). Using the view after release raises ``ViewReleasedError``.
    """

    @property
    def held(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def pages(self) -> int: ...
    @property
    def contiguous(self) -> bool: ...
    @property
    def exclusive(self) -> bool: ...
    @property
    def hit(self) -> bool: ...
    @property
    def waited_s(self) -> float: ...
    @property
    def device(self) -> Literal["cpu", "cuda"]: ...
    def page(self, index: int) -> PageView: ...
    def release(self) -> None: ...
    def __enter__(self) -> "View": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class Pool:
    """A tiered pool in this process: GPU frames (``gpu_budget``) over host slots
    (``host_budget``, which must hold every buffer).

    ``device``: ``"auto"`` (a GPU if there is one, else ``"sim"``), ``"sim"`` (host memory
    standing in for a GPU) or ``"cuda"``. ``policy``: ``"learned"`` (default),
    ``"clock"`` or ``"on_demand"``. ``page_size``: a power of two from 64KiB to 64MiB
    (default 2MiB). A bad size, device or policy raises ``ValueError`` naming the argument.
    """

    def __init__(
        self,
        gpu_budget: Size,
        host_budget: Size,
        page_size: Optional[Size] = None,
        device: DeviceChoice = "auto",
        policy: PolicyName = "learned",
        copy_bytes_in_flight: Optional[Size] = None,
    ) -> None:
        """A pool in this process. ``copy_bytes_in_flight``: bytes of copies in flight
        each way between the GPU and the host tier (default 64 MiB; at least a page):
        more keeps a copy engine busier with large pages, less lets a demand load pass
        fewer prefetches."""
        ...
    @staticmethod
    def connect(
        socket: Union[str, "os.PathLike[str]"],
        gpu_budget: Size,
        host_budget: Size,
        page_size: Optional[Size] = None,
        device: DeviceChoice = "auto",
        policy: PolicyName = "learned",
        copy_bytes_in_flight: Optional[Size] = None,
    ) -> "Pool":
        """Daemon mode: a pool whose host tier (``host_budget``, a whole number of pages)
        is memory shared with the node listening on ``socket`` (``spillway node``, or
        ``spillway cluster up``: ``<dir>/node-1/client.sock``), and whose remote tier is
        the node's peers' RAM when the node has room for it. ``page_size`` must be the
        node's (default 2MiB). Raises ``NoNodeError`` when nobody listens,
        ``NodeRefusedError`` (``code``) when the node refuses, other ``NodeLinkError``s
        when the link fails. Later, a page whose every copy on peers is gone raises
        ``PageLostError`` (``buffer``, ``page``) for that buffer only; if the node itself
        dies, every call raises ``RemoteTierGoneError`` at once: start the node again
        and ``connect`` a new pool."""
        ...
    @property
    def socket(self) -> Optional["os.PathLike[str]"]:
        """The node's socket in daemon mode, else ``None``."""
        ...
    @property
    def client_id(self) -> Optional[int]:
        """This client's number on its node in daemon mode, else ``None``."""
        ...
    @property
    def device(self) -> Literal["sim", "cuda"]: ...
    @property
    def page_size(self) -> int: ...
    def alloc(self, name: str, nbytes: Size) -> Buffer: ...
    def free(self, buf: Buffer) -> None: ...
    def write(self, buf: Buffer, offset: int, data: BytesLike) -> None: ...
    def read(self, buf: Buffer, offset: int, n: int) -> bytes: ...
    def acquire(self, buf: Buffer, *, paged: bool = False) -> View:
        """Shared, read-only. Raises ``PageLostError`` if a page of ``buf`` could not be
        brought back from the remote tier (until ``buf`` is freed). ``paged=True``: read
        page by page (``view.page(i)``); the device never shows the buffer as one array
        (on ``cuda``, nothing is mapped into its range)."""
        ...
    def acquire_mut(self, buf: Buffer, *, discard: bool = False, paged: bool = False) -> View:
        """Exclusive, writable. ``discard=True``: the caller overwrites every byte, so
        pages off the GPU get frames without a copy in; their bytes are undefined until
        written (not zeros) and the old contents are gone. ``paged`` as for ``acquire``."""
        ...
    def step(self) -> None: ...
    def stats(self) -> Dict[str, Union[int, float]]:
        """Counters: ``acquires``, ``hits``, ``stalls`` (acquires that waited), ``stall_s``,
        ``steps``, ``h2d_bytes``/``d2h_bytes`` (bytes each way), ``demand_loads``,
        ``prefetch_loads``, ``prefetch_wasted_pages``/``prefetch_wasted_bytes`` (prefetched
        and evicted or discarded unused), ``overwrite_pages`` (pages given frames
        without a copy by ``acquire_mut(discard=True)``), ``reserved_pages`` (frames the
        learned policy took ahead, without a copy, for an access it predicted to discard)
        and ``reserved_pages_missed`` (of those, read instead or evicted unused),
        ``evictions_clean``/``evictions_dirty``, per tier
        ``gpu_bytes``/``gpu_bytes_peak``/``gpu_budget_bytes``,
        ``host_bytes``/``host_budget_bytes``, ``remote_bytes``/``remote_budget_bytes``,
        ``remote_bytes_in``/``remote_bytes_out``/``remote_errors``, ``pages_lost``/``buffers_lost``
        (pages every copy of which was gone, and their buffers: see ``PageLostError``), ``buffers``,
        ``page_bytes``, ``h2d_bytes_per_s``/``d2h_bytes_per_s`` (estimates); the pool's own
        time besides stalls: ``lock_wait_s``, ``planning_s``, ``view_s`` (on the calling
        threads), ``device_lock_wait_s``, ``device_planning_s`` (on the device's threads:
        completions and fenced releases), ``mapping_s``/``pages_remapped`` (buffers shown
        through their range), ``completions_late`` (copies done before their completion
        was delivered)."""
        ...
