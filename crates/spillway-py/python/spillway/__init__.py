"""Spillway for Python: a tiered GPU memory pool with learned prefetch.

    import numpy as np, spillway
    pool = spillway.Pool(gpu_budget="64MiB", host_budget="256MiB", device="sim")
    buf = pool.alloc("weights", 1 << 20)
    pool.write(buf, 0, b"\\x07" * 4096)
    with pool.acquire(buf) as view:          # every page on the GPU while held
        arr = np.from_dlpack(view)           # zero-copy, read-only (acquire_mut: writable)
        assert arr[0] == 7                   # use `arr` only inside the block
    pool.step()                              # one iteration done: the prefetcher learns

The classes come from the Rust extension ``spillway._core`` (crates/spillway-py); the
exceptions from :mod:`spillway._errors`, all subclasses of :class:`SpillwayError`.
"""

from . import _errors
from ._core import Buffer, PageView, Pool, View, __version__
from ._errors import *  # noqa: F401,F403 (the exception classes)

__all__ = ["Pool", "Buffer", "View", "PageView", "__version__", *_errors.__all__]
