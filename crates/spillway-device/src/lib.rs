//! GPU tier backends of Spillway.
//!
//! A [`Device`] owns two pieces of memory, both sized once at creation:
//! - **frames**: `frames` page-sized pieces of device memory, the GPU budget;
//! - **host slots**: `host_slots` page-sized pieces of host memory, the host tier (pinned
//!   on a real GPU, so copies run at full PCIe speed).
//!
//! It moves pages between them on a copy *stream* per [`Direction`], so a load and an
//! eviction run at once (two host directions; two more to and from the frames a
//! neighbouring GPU lends, where the backend has a peer: [`Device::peer_frames`]). Copies
//! of one direction complete in submission order, and
//! each completion is reported to the [`CompletionSink`] given at creation, from the
//! device's own thread. The caller (the pool) guarantees that no frame or slot is touched
//! by anyone else while a copy that uses it is in flight; the device does not check.
//!
//! Backends:
//! - [`sim::SimDevice`]: device memory is host memory under the budget, copies are real
//!   `memcpy` on one thread per direction. Always built; every test and the demo use it.
//! - `cuda::CudaDevice` (feature `cuda`): an NVIDIA GPU through the CUDA driver API
//!   (cudarc, loaded at run time, so the build needs no CUDA). A folder of modules, one
//!   per part (driver and context, frames, host slots, views of acquired buffers
//!   and buffer ranges, copy lanes, fences, kernels, the device and its trait impl, and a raw
//!   pinned-copy benchmark); `cuda/mod.rs` maps them.
//!
//! Besides copies, a device runs three small kernels on a page (fill with the
//! [`spillway_types::pattern`], checksum, and arithmetic work) so that the demo and the
//! tests work on every backend without reading pages back to the host.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod sim;
mod uncached;

use std::ptr::NonNull;
use std::sync::Arc;

use spillway_types::{BufferId, Direction, FrameId, HostSlot, TransferId};

/// Which backend a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// Host memory standing in for a GPU.
    Sim,
    /// An NVIDIA GPU through CUDA.
    Cuda,
}

impl DeviceKind {
    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Sim => "sim",
            DeviceKind::Cuda => "cuda",
        }
    }
}

/// Sizes a device is created with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Number of page-sized frames of device memory (the GPU budget in pages).
    pub frames: u32,
    /// Number of page-sized host slots (the host tier in pages).
    pub host_slots: u32,
    /// Bytes per page.
    pub page_bytes: u64,
}

/// Host memory made elsewhere for a device's host slots: a region shared with the node
/// daemon (a mapped `memfd`), so that the node reads and writes the pages the device
/// copies without a copy through a socket. A real GPU registers it as pinned.
///
/// Cheap to clone; the region stays mapped while any clone (or the device using it)
/// lives, through `owner`.
#[derive(Clone)]
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: u64,
    owner: Arc<dyn std::any::Any + Send + Sync>,
}

// SAFETY: the region is plain memory; who touches which slot is governed by the pool's
// contract (see the crate docs), not by the type.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl HostMemory {
    /// Wraps `len` bytes at `ptr`, kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be readable and writable memory, aligned to 4 KiB, that
    /// stays mapped as long as `owner` lives, and that nothing but the device and the
    /// parties of the pool's contract (the node serving the slots' pages) touches.
    pub unsafe fn new(
        ptr: NonNull<u8>,
        len: u64,
        owner: Arc<dyn std::any::Any + Send + Sync>,
    ) -> HostMemory {
        HostMemory { ptr, len, owner }
    }

    /// The start of the region.
    pub fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What keeps it mapped.
    pub fn owner(&self) -> &Arc<dyn std::any::Any + Send + Sync> {
        &self.owner
    }
}

/// One copy of (part of) a page between a frame and a host slot: the core's type.
pub use spillway_types::CopyOp;

/// A finished copy.
#[derive(Debug)]
pub struct Completion {
    /// The copy's id, as submitted.
    pub id: TransferId,
    /// Whether the bytes arrived.
    pub result: Result<(), DeviceError>,
    /// Another completion comes right after this one, from the same thread: of the same
    /// driver copy (a run of neighbouring pages), or of a later copy that has already
    /// finished. The sink may leave handling it and starting new work to the last, so
    /// that a burst takes its locks once and the copies it starts are submitted together.
    pub follows: bool,
}

/// Where completions go. Called from the device's threads, never while the device holds
/// a lock of its own, so it may submit new copies.
pub type CompletionSink = Arc<dyn Fn(Completion) + Send + Sync>;

/// An address in device memory as kernels see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevicePtr(pub u64);

/// Errors of a device backend.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DeviceError {
    /// The backend cannot be used on this machine or build.
    #[error("the {backend} device is unavailable: {reason}")]
    Unavailable {
        /// `sim` or `cuda`.
        backend: &'static str,
        /// What is missing (a feature, a driver, a GPU).
        reason: String,
    },
    /// Device or host memory could not be had.
    #[error("out of {what} memory: asked for {requested_bytes} bytes, {available_bytes} available")]
    OutOfMemory {
        /// `device` or `host`.
        what: &'static str,
        /// Bytes asked for.
        requested_bytes: u64,
        /// Bytes that were free.
        available_bytes: u64,
    },
    /// A range outside a frame or slot.
    #[error("range {offset}+{len} is outside a page of {page_bytes} bytes")]
    OutOfRange {
        /// Start inside the page.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Size of a page.
        page_bytes: u64,
    },
    /// The driver reported an error.
    #[error("device driver error during {op}: {message}")]
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's message.
        message: String,
    },
}

/// A GPU tier backend. See the crate docs for the contract on copies.
pub trait Device: Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> DeviceKind;
    /// A human description (`"sim (host memory)"`, the GPU's name).
    fn describe(&self) -> String;
    /// The sizes the device was created with.
    fn config(&self) -> DeviceConfig;
    /// Queues a copy on the stream of its direction. The completion reaches the sink.
    fn submit(&self, op: CopyOp);
    /// Queues copies in order, as [`Device::submit`] of each would; a backend may carry
    /// neighbouring pages (consecutive frames and slots, one direction) in one copy.
    /// Every op still gets its own completion, in order.
    fn submit_batch(&self, ops: &[CopyOp]) {
        for &op in ops {
            self.submit(op);
        }
    }

    /// Copies `data` into host slot `slot` at `offset`, synchronously.
    fn write_host(&self, slot: HostSlot, offset: u64, data: &[u8]) -> Result<(), DeviceError>;
    /// Copies from host slot `slot` at `offset` into `out`, synchronously.
    fn read_host(&self, slot: HostSlot, offset: u64, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Copies `data` into frame `frame` at `offset`; returns when the bytes are there.
    fn write_frame(&self, frame: FrameId, offset: u64, data: &[u8]) -> Result<(), DeviceError>;
    /// Copies from frame `frame` at `offset` into `out`; returns when the bytes are there.
    fn read_frame(&self, frame: FrameId, offset: u64, out: &mut [u8]) -> Result<(), DeviceError>;

    /// The device address of a frame.
    fn frame_ptr(&self, frame: FrameId) -> DevicePtr;
    /// The frame's memory as the host sees it, when device memory is host memory (`sim`).
    /// `None` for a real GPU.
    fn host_view(&self, frame: FrameId) -> Option<NonNull<u8>>;

    /// Reserves a contiguous device address range for a buffer of `bytes`, into which
    /// its resident pages are mapped. Backends without virtual memory return `None`.
    fn reserve_range(
        &self,
        buffer: BufferId,
        bytes: u64,
    ) -> Result<Option<DevicePtr>, DeviceError> {
        let _ = (buffer, bytes);
        Ok(None)
    }
    /// Maps `frame` as page `index` of `buffer`'s range (no-op without virtual memory).
    fn map_page(&self, buffer: BufferId, index: u32, frame: FrameId) -> Result<(), DeviceError> {
        let _ = (buffer, index, frame);
        Ok(())
    }
    /// Unmaps page `index` of `buffer`'s range (no-op without virtual memory).
    fn unmap_page(&self, buffer: BufferId, index: u32) -> Result<(), DeviceError> {
        let _ = (buffer, index);
        Ok(())
    }
    /// Whether the next acquire of `buffer` is expected to view it as one array
    /// ([`Device::acquire_ptr`]) or page by page: a backend that maps pages ahead of
    /// views maps only the former's (no-op without virtual memory). The pool calls it
    /// when its expectation changes; until the first call a backend keeps its own rule.
    fn expect_view(&self, buffer: BufferId, whole: bool) {
        let _ = (buffer, whole);
    }
    /// Makes every `map_page` made so far take effect (backends that map lazily).
    fn flush_mappings(&self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Where a kernel sees an acquired buffer as one array, valid while the acquire is
    /// held; `frames` are the buffer's pages in order, as the acquire holds them. The pool
    /// calls it at a guard's first `device_ptr` (an acquire the caller reads page by page
    /// never calls it, so never maps). A backend whose frames lie in one address
    /// range returns the first frame's address when `frames` are consecutive (no mapping
    /// at all); else the buffer's range ([`Device::reserve_range`]) once the pages are
    /// mapped there; `None` when it has neither (the caller works page by page).
    fn acquire_ptr(
        &self,
        buffer: BufferId,
        frames: &[FrameId],
    ) -> Result<Option<DevicePtr>, DeviceError> {
        let _ = (buffer, frames);
        Ok(None)
    }
    /// Where the device's own time went so far (backends that measure it; zeros
    /// otherwise).
    fn timings(&self) -> DeviceTimings {
        DeviceTimings::default()
    }
    /// Gives back `buffer`'s range (no-op without virtual memory).
    fn release_range(&self, buffer: BufferId) -> Result<(), DeviceError> {
        let _ = buffer;
        Ok(())
    }

    /// Fills `len` bytes of `frame` with [`spillway_types::pattern::fill`] of `seed`.
    fn fill_pattern(&self, frame: FrameId, len: u64, seed: u64) -> Result<(), DeviceError>;
    /// [`spillway_types::pattern::checksum`] of the first `len` bytes of `frame`.
    fn checksum(&self, frame: FrameId, len: u64) -> Result<u64, DeviceError>;
    /// Arithmetic work over the first `len` bytes of `frame`, `passes` times; returns a
    /// value derived from every byte so the work cannot be skipped. The demo's "kernel".
    fn compute(&self, frame: FrameId, len: u64, passes: u32) -> Result<u64, DeviceError>;

    /// Frames a neighbouring GPU lends this device now (the peer-GPU tier), numbered
    /// `0..peer_frames()`; copies in the peer directions use them. 0 (the default): no
    /// peer tier. The sim backend lends and borrows ([`sim::SimDevice::attach_peer`]);
    /// the CUDA backend does not yet.
    fn peer_frames(&self) -> u32 {
        0
    }

    /// The count the lender asked the peer frames to come down to, while this device
    /// still uses more (the pool stops using the frames above, then answers with
    /// [`Device::peer_give_back`]). `None` by default.
    fn peer_asked_back(&self) -> Option<u32> {
        None
    }

    /// The pool no longer uses peer frames `frames..`: the lender may have them back.
    fn peer_give_back(&self, _frames: u32) {}

    /// A first guess of copy bandwidth in one direction, before any copy is measured.
    fn bandwidth_hint_bytes_per_s(&self, direction: Direction) -> f64;

    /// Calls `done` once all the work queued so far on the device's compute stream (the
    /// stream the caller's kernels run on) has finished, from a device thread, or at
    /// once on the calling thread when kernels are synchronous (`sim`). The pool releases
    /// an acquire through this, so a page is never evicted while a kernel still reads it.
    fn after_queued_work(&self, done: Box<dyn FnOnce() + Send>) {
        done();
    }

    /// The device as `Any`, to reach backend-specific parts (the CUDA context and
    /// compute stream) from benchmarks.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Where a device's own time went, counted since it was created (see
/// [`Device::timings`]). Subtract two readings for an interval.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceTimings {
    /// Acquires shown at their frames' own addresses (consecutive frames: no mapping).
    pub views_in_place: u64,
    /// Acquires shown through their buffer's range (its pages mapped there first, by the
    /// acquiring thread or ahead).
    pub views_mapped: u64,
    /// Pages mapped into a buffer range where another frame (or none) was mapped.
    pub pages_remapped: u64,
    /// Seconds of driver calls for those mappings (`cuMemUnmap`, `cuMemMap`,
    /// `cuMemSetAccess`), on the thread that asked for the view (the acquiring thread).
    pub mapping_s: f64,
    /// Completions delivered to the sink.
    pub completions: u64,
    /// Driver copies they came from (neighbouring pages submitted together share one).
    pub copies: u64,
    /// Completions whose copy had already finished when the completion thread came to
    /// them (it was still delivering earlier ones): they reached the pool late.
    pub completions_late: u64,
    /// Seconds the completion threads spent inside the sink (the pool's handling of a
    /// completion: its lock wait and planning); a completion behind another waits that
    /// long.
    pub completion_sink_s: f64,
    /// Driver copies enqueued by the lanes' submitter threads, off the submitting
    /// thread and the pool's lock (cuda; the rest were enqueued by the thread that
    /// submitted them).
    pub submitted_off_thread: u64,
    /// Seconds the submitter threads spent enqueueing them.
    pub submit_thread_s: f64,
    /// Pages mapped into buffer ranges by the map-ahead thread (cuda with
    /// `SPILLWAY_CUDA_MAP_AHEAD=1`), beside the copies rather than on an acquiring thread.
    pub pages_mapped_ahead: u64,
    /// Seconds of that thread's driver calls.
    pub map_ahead_s: f64,
}

impl DeviceTimings {
    /// `self - earlier`, field by field (an interval between two readings).
    pub fn since(&self, earlier: &DeviceTimings) -> DeviceTimings {
        DeviceTimings {
            views_in_place: self.views_in_place - earlier.views_in_place,
            views_mapped: self.views_mapped - earlier.views_mapped,
            pages_remapped: self.pages_remapped - earlier.pages_remapped,
            mapping_s: self.mapping_s - earlier.mapping_s,
            completions: self.completions - earlier.completions,
            copies: self.copies - earlier.copies,
            completions_late: self.completions_late - earlier.completions_late,
            completion_sink_s: self.completion_sink_s - earlier.completion_sink_s,
            submitted_off_thread: self.submitted_off_thread - earlier.submitted_off_thread,
            submit_thread_s: self.submit_thread_s - earlier.submit_thread_s,
            pages_mapped_ahead: self.pages_mapped_ahead - earlier.pages_mapped_ahead,
            map_ahead_s: self.map_ahead_s - earlier.map_ahead_s,
        }
    }
}

/// Checks that `offset + len` fits in a page of `page_bytes`.
pub(crate) fn check_range(offset: u64, len: u64, page_bytes: u64) -> Result<(), DeviceError> {
    match offset.checked_add(len) {
        Some(end) if end <= page_bytes => Ok(()),
        _ => Err(DeviceError::OutOfRange {
            offset,
            len,
            page_bytes,
        }),
    }
}

/// Copies `data` into the page at `page` from `offset`, once [`check_range`] passes.
///
/// # Safety
/// `page` is valid for writes of `page_bytes` bytes, and nobody else touches those bytes
/// during the call (the caller holds the slot or frame: the pool's contract).
pub(crate) unsafe fn write_page(
    page: *mut u8,
    page_bytes: u64,
    offset: u64,
    data: &[u8],
) -> Result<(), DeviceError> {
    check_range(offset, data.len() as u64, page_bytes)?;
    // SAFETY: `offset + data.len()` fits in the page (checked); the rest is the caller's.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), page.add(offset as usize), data.len()) };
    Ok(())
}

/// Copies `out.len()` bytes of the page at `page` from `offset` into `out`, once
/// [`check_range`] passes.
///
/// # Safety
/// As [`write_page`], for reads.
pub(crate) unsafe fn read_page(
    page: *const u8,
    page_bytes: u64,
    offset: u64,
    out: &mut [u8],
) -> Result<(), DeviceError> {
    check_range(offset, out.len() as u64, page_bytes)?;
    // SAFETY: as in `write_page`.
    unsafe {
        std::ptr::copy_nonoverlapping(page.add(offset as usize), out.as_mut_ptr(), out.len())
    };
    Ok(())
}
