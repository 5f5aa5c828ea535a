//! The core's public vocabulary: ids, access modes, the mapping changes, remote ops and
//! zero fills it hands the driver (its copies are [`spillway_types::CopyOp`], as the
//! device takes them), where a page is for host access, and its counters.

use spillway_types::{FrameId, HostSlot, PageId, TransferId};

use crate::predictor::PredictorStats;

/// One acquire in progress or held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AcquireId(pub u64);

/// How a buffer is acquired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AccessMode {
    /// Read only; any number of shared acquires at once.
    Shared,
    /// Read and write; no other acquire at the same time. Pages become dirty.
    Exclusive,
}

impl AccessMode {
    /// How a buffer held this way is held, as a word for messages: `shared` or
    /// `exclusively`.
    pub fn as_str(self) -> &'static str {
        match self {
            AccessMode::Shared => "shared",
            AccessMode::Exclusive => "exclusively",
        }
    }
}

/// A change to a buffer's device address range, for backends with virtual memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MappingChange {
    /// `page` now lives in `frame`.
    Map {
        /// The page.
        page: PageId,
        /// Its frame.
        frame: FrameId,
    },
    /// `page` left its frame.
    Unmap {
        /// The page.
        page: PageId,
    },
}

/// What a remote op does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RemoteOpKind {
    /// Copy `bytes` of the host slot to the remote tier under the page's id (replacing
    /// what the tier held for it).
    Spill,
    /// Copy the page's bytes from the remote tier into the host slot.
    Fetch,
}

/// One page moving between the host tier and the remote tier, for the driver to start:
/// the core hands it out ([`super::PoolCore::poll_remote`]) and the driver passes it to
/// its remote tier as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteOp {
    /// Reported back to [`super::PoolCore::handle_remote_done`].
    pub id: TransferId,
    /// Which way.
    pub kind: RemoteOpKind,
    /// The page (its id is the key in the remote tier).
    pub page: PageId,
    /// The host side.
    pub slot: HostSlot,
    /// The page's length (the last page of a buffer may be short).
    pub bytes: u64,
}

/// A host slot to fill with zeros: a page never written came into it. The driver does
/// it before anything else it polls uses the slot; no completion unless it fails
/// ([`super::PoolCore::handle_zero_fill_failed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroFill {
    /// The page that now lives in the slot.
    pub page: PageId,
    /// The slot.
    pub slot: HostSlot,
    /// Bytes to zero from the start of the slot (the page's length).
    pub bytes: u64,
}

/// Where a page's current contents are, for host reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageLocation {
    /// On the GPU, in this frame.
    Gpu(FrameId),
    /// In the host tier, in this slot.
    Host(HostSlot),
}

/// Counters of the pool since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CoreStats {
    /// Acquires begun.
    pub acquires: u64,
    /// Acquires whose pages were all resident when asked for (no wait for a copy).
    pub hits: u64,
    /// Steps marked.
    pub steps: u64,
    /// Bytes copied host to device.
    pub h2d_bytes: u64,
    /// Bytes copied device to host.
    pub d2h_bytes: u64,
    /// Loads started because an acquire needed them.
    pub demand_loads: u64,
    /// Loads started by the prefetcher.
    pub prefetch_loads: u64,
    /// Prefetched pages evicted before any acquire used them.
    pub prefetch_wasted: u64,
    /// Clean pages dropped from the GPU (no copy needed).
    pub evictions_clean: u64,
    /// Dirty pages written back to the host.
    pub evictions_dirty: u64,
    /// Frames in use now.
    pub frames_in_use: u64,
    /// Most frames in use at once.
    pub frames_in_use_peak: u64,
    /// Frames of the GPU budget.
    pub frames_total: u64,
    /// Host slots in use now.
    pub slots_in_use: u64,
    /// Host slots of the host budget.
    pub slots_total: u64,
    /// Live buffers.
    pub buffers: u64,
    /// Estimated host-to-device bandwidth, bytes/s.
    pub h2d_bytes_per_s: f64,
    /// Estimated device-to-host bandwidth, bytes/s.
    pub d2h_bytes_per_s: f64,
    /// Bytes fetched from the remote tier.
    pub remote_bytes_in: u64,
    /// Bytes spilled to the remote tier.
    pub remote_bytes_out: u64,
    /// Fetches started because an acquire or a host access needed the page.
    pub remote_demand_fetches: u64,
    /// Fetches started by the prefetcher.
    pub remote_prefetches: u64,
    /// Pages that left the host tier without a copy (the remote tier held the same bytes).
    pub spills_clean: u64,
    /// Slots given back by pages on the GPU whose bytes the remote tier holds (their host
    /// copies were a third copy), when the host tier needed room.
    pub gpu_page_slots_dropped: u64,
    /// Remote ops that failed.
    pub remote_errors: u64,
    /// Pages whose bytes the remote tier holds (or is being sent) now.
    pub remote_pages: u64,
    /// Remote pages of the remote budget.
    pub remote_pages_total: u64,
    /// Estimated remote tier bandwidth, bytes/s.
    pub remote_bytes_per_s: f64,
    /// The predictor's counters.
    pub predictor: PredictorStats,
}
