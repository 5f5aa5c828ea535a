"""The exceptions of the spillway package: one class per cause the pool reports.

Every exception derives from :class:`SpillwayError`. Each carries the numbers of its
cause as attributes (``PoolFullError.free_pages``, ``BufferTooLargeError.budget_bytes``,
...), named as in the Rust SDK's ``CoreError``/``PoolError``, so a caller can act on them
without parsing the message. ``_core`` raises them (it imports this module by name).
"""

from __future__ import annotations


class SpillwayError(Exception):
    """Base of every error the pool raises."""


class ConfigError(SpillwayError, ValueError):
    """A setting of the pool is invalid (``field`` names it) or missing."""


class EmptyBufferError(SpillwayError, ValueError):
    """A buffer of zero bytes."""


class BufferTooLargeError(SpillwayError, ValueError):
    """A buffer that could never be on the GPU at once (``requested_bytes``, ``pages``,
    ``budget_bytes``)."""


class PoolFullError(SpillwayError, MemoryError):
    """The host tier has no room (``requested_bytes``, ``needed_pages``, ``free_pages``,
    ``total_pages``)."""


class TooManyBuffersError(SpillwayError):
    """Too many live buffers (``limit``)."""


class UnknownBufferError(SpillwayError, LookupError):
    """No such buffer was ever allocated (``buffer``: its id)."""


class BufferFreedError(SpillwayError, LookupError):
    """The buffer was freed (``buffer``); freeing it twice raises this too."""


class BufferHeldError(SpillwayError):
    """``free`` of a buffer still acquired (``buffer``, ``holders``)."""


class BufferBusyError(SpillwayError):
    """An exclusive acquire of a held buffer, or a shared one of a buffer held exclusively
    (``buffer``, ``mode``)."""


class HeldAcquiresExceedBudgetError(SpillwayError):
    """The acquires held at once would exceed the GPU budget (``buffer``, ``held_bytes``,
    ``requested_bytes``, ``budget_bytes``): release something first."""


class OutOfRangeError(SpillwayError, IndexError):
    """A read or write past the end of a buffer (``buffer``, ``offset``, ``len``,
    ``bytes``), or a page index past its last page (``index``, ``pages``)."""


class DeviceError(SpillwayError):
    """The device failed: a driver error, no memory, a failed copy."""


class DeviceUnavailableError(DeviceError):
    """The device asked for cannot be used here (``backend``, ``reason``)."""


class PageLostError(SpillwayError):
    """Every copy of a page in the remote tier is gone (``buffer``: the buffer's id,
    ``page``: the page's index in it, ``reason``). Only that buffer is affected: its
    acquires and host accesses raise this until it is freed; every other buffer goes on."""


class RemoteTierGoneError(SpillwayError, ConnectionError):
    """The link to the pool's node is gone (the node daemon died; ``reason``): every
    later call raises this. Start the node again, then ``Pool.connect`` a new pool."""


class SpillsFailingError(SpillwayError):
    """The remote tier refused spills for a whole deadline (``failing_ms``, ``attempts``,
    ``reason``)."""


class RemoteError(SpillwayError):
    """The remote tier could not be set up."""


class NodeLinkError(SpillwayError, ConnectionError):
    """``Pool.connect`` could not link to the node (``socket``/``reason``; ``bytes`` when
    the shared memory could not be mapped)."""


class NoNodeError(NodeLinkError):
    """No node listens on the socket (``socket``): start one with ``spillway node`` or
    ``spillway cluster up``."""


class NodeRefusedError(NodeLinkError):
    """The node refused the client (``code``: ``PageSizeMismatch``,
    ``HostBytesTooLarge``, ``BadHostBytes``, ``TooManyClients``, ...; ``reason``)."""


class NodeProtocolError(NodeLinkError):
    """The node's answer breaks the local protocol, or it speaks another version
    (``node_version``, ``client_version``)."""


class NotHostVisibleError(SpillwayError):
    """Host access to device memory the host cannot see (the ``cuda`` device)."""


class NotExclusiveError(SpillwayError):
    """Writing through a view that was acquired shared."""


class ViewReleasedError(SpillwayError):
    """A view used after its ``with`` block (or ``release()``) ended."""


__all__ = [name for name, value in globals().items() if isinstance(value, type)]
