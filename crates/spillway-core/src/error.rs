//! Errors of the pool's state machine. Each names the numbers a user needs to act.
//!
//! [`CoreError`] is what the core refuses or reports; [`DeviceFault`] and [`RemoteError`]
//! are what a driver reports into the core when a copy, a zero fill or a remote op
//! failed.
//!
//! Which failures are whose: a failed fetch is one buffer's ([`CoreError::PageLost`]:
//! that buffer's acquires fail, every other buffer goes on, the pool never fails for
//! it); a failed zero fill is one buffer's too. A failed device copy on the local GPU
//! ([`CoreError::DeviceFailed`]: the device's state is unknown), spills refused for a
//! whole deadline ([`CoreError::SpillsFailing`]) and a remote tier whose link is gone
//! ([`CoreError::RemoteTierGone`]) fail the whole pool: every later acquire reports it.

use spillway_types::{BufferId, HostSlot, PageId};

use crate::pool::AccessMode;

/// A device operation (a copy, a host slot's read or write) that failed. The device's
/// own error type is a layer above the core; its message is kept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct DeviceFault {
    /// The device's message.
    pub message: String,
}

impl DeviceFault {
    /// A fault with `error`'s message.
    pub fn new(error: impl std::fmt::Display) -> DeviceFault {
        DeviceFault {
            message: error.to_string(),
        }
    }
}

/// Why a remote op failed, as the remote tier reports it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RemoteError {
    /// The op's host slot could not be read or written.
    #[error("host slot {}: {fault}", slot.0)]
    Slot {
        /// The slot.
        slot: HostSlot,
        /// What the device said.
        fault: DeviceFault,
    },
    /// The remote tier does not hold the page.
    #[error("the remote tier does not hold page {page}")]
    NotHeld {
        /// The page.
        page: PageId,
    },
    /// The page came back with another length than the op's.
    #[error("page {page} came back with {got_bytes} bytes, {expected_bytes} expected")]
    WrongLength {
        /// The page.
        page: PageId,
        /// Bytes that came back.
        got_bytes: u64,
        /// Bytes of the op.
        expected_bytes: u64,
    },
    /// The pool has no remote tier (a driver bug: the core asked for an op anyway).
    #[error("the pool has no remote tier")]
    NoTier,
    /// Every copy of the page is gone: its holders died (or answered with other bytes),
    /// after the tier's own failover and retries. Only that page's buffer is affected.
    #[error("every copy of page {page} is gone: {message}")]
    Lost {
        /// The page.
        page: PageId,
        /// What the tier said (which holders, why).
        message: String,
    },
    /// The link to the remote tier is gone for good (the node daemon of a daemon-mode
    /// client exited or closed the connection): no op can be sent, and what it held for
    /// this pool went with it. The pool fails with [`CoreError::RemoteTierGone`].
    #[error("the remote tier is gone: {message}")]
    TierGone {
        /// Why the link is gone.
        message: String,
    },
    /// The tier failed the op: the message of a node, or why the link to it is gone.
    #[error("{message}")]
    Tier {
        /// What failed.
        message: String,
    },
}

impl RemoteError {
    /// A failure of the tier with `message`.
    pub fn tier(message: impl std::fmt::Display) -> RemoteError {
        RemoteError::Tier {
            message: message.to_string(),
        }
    }
}

/// An operation the pool refused. The pool's state is unchanged by a refused operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A buffer of zero bytes.
    #[error("a buffer must have at least one byte")]
    EmptyBuffer,
    /// A buffer that could never be resident on the GPU at once.
    #[error(
        "buffer of {requested_bytes} bytes ({pages} pages) is larger than the GPU budget of {budget_bytes} bytes"
    )]
    BufferTooLarge {
        /// Bytes asked for.
        requested_bytes: u64,
        /// Pages it would take.
        pages: u64,
        /// The GPU budget.
        budget_bytes: u64,
    },
    /// The host tier has no room for the buffer's pages.
    #[error(
        "pool full: a buffer of {requested_bytes} bytes needs {needed_pages} pages but the host tier has {free_pages} of {total_pages} free"
    )]
    PoolFull {
        /// Bytes asked for.
        requested_bytes: u64,
        /// Pages it needs.
        needed_pages: u64,
        /// Free host pages.
        free_pages: u64,
        /// All host pages.
        total_pages: u64,
    },
    /// Too many live buffers.
    #[error("too many buffers: the limit is {limit}")]
    TooManyBuffers {
        /// The limit ([`spillway_types::limits::BUFFERS_MAX`]).
        limit: usize,
    },
    /// No such buffer was ever allocated.
    #[error("unknown buffer {0}")]
    UnknownBuffer(BufferId),
    /// The buffer was freed.
    #[error("{0} was freed")]
    Freed(BufferId),
    /// Free of a buffer that is still acquired.
    #[error("{buffer} is still acquired ({holders} holders); release it before freeing")]
    BufferHeld {
        /// The buffer.
        buffer: BufferId,
        /// How many guards hold it.
        holders: u32,
    },
    /// An exclusive acquire of a buffer that is held, or a shared one of a buffer held
    /// exclusively.
    #[error("{buffer} is busy: it is acquired {} elsewhere", mode.as_str())]
    BufferBusy {
        /// The buffer.
        buffer: BufferId,
        /// How it is held now.
        mode: AccessMode,
    },
    /// The acquires held at once would need more GPU memory than the budget: waiting
    /// could never succeed, so it fails at once.
    #[error(
        "acquire of {buffer} needs {requested_bytes} bytes while {held_bytes} are held, over the GPU budget of {budget_bytes} bytes; release something first"
    )]
    HeldAcquiresExceedBudget {
        /// The buffer being acquired.
        buffer: BufferId,
        /// Bytes of pages already pinned by other acquires.
        held_bytes: u64,
        /// Bytes of the new acquire's pages not already pinned.
        requested_bytes: u64,
        /// The GPU budget.
        budget_bytes: u64,
    },
    /// A read or write past the end of the buffer.
    #[error("range {offset}+{len} is outside {buffer} of {bytes} bytes")]
    OutOfRange {
        /// The buffer.
        buffer: BufferId,
        /// Start asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The buffer's size.
        bytes: u64,
    },
    /// A copy failed on the device (the pool fails), or a zero fill of a slot did (that
    /// buffer is lost).
    #[error("device copy failed: {0}")]
    DeviceFailed(DeviceFault),
    /// A page of the buffer could not be brought back from the remote tier (after the
    /// tier's own failover, retries and grace): its bytes cannot be had. Only this buffer
    /// is affected: every later acquire and host access of it fails with this error until
    /// it is freed (a buffer allocated again starts afresh); other buffers go on.
    #[error("page {page} of {buffer} is lost: {reason}")]
    PageLost {
        /// The buffer.
        buffer: BufferId,
        /// The page's index in the buffer.
        page: u32,
        /// Why, as the remote tier said.
        reason: RemoteError,
    },
    /// The link to the remote tier is gone for good ([`RemoteError::TierGone`]: the node
    /// daemon of a daemon-mode client died): every later operation fails with this at
    /// once. The pages the tier held are gone; link to the node again and build a new
    /// pool (`spillway_client::daemon::DaemonLink::connect`).
    #[error("the pool's remote tier is gone ({reason}); connect to the node again")]
    RemoteTierGone {
        /// What the link said.
        reason: RemoteError,
    },
    /// The remote tier refused every spill for a whole deadline: the pool cannot make room.
    #[error(
        "the remote tier refused spills for {failing_ms} ms ({attempts} attempts, with backoff): {reason}"
    )]
    SpillsFailing {
        /// How long spills failed without one success.
        failing_ms: u64,
        /// Failed attempts in that time.
        attempts: u64,
        /// Why the last one failed.
        reason: RemoteError,
    },
}
