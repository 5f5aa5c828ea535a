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

/// Counters of the pool since it was made. The core counts through the methods below
/// (one per event), and fills the gauges when asked ([`super::PoolCore::stats`]).
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
    /// Prefetched pages evicted before any acquire used them, or overwritten by an
    /// acquire that discarded their contents.
    pub prefetch_wasted: u64,
    /// Pages given frames without a load, by acquires that discard their contents
    /// (reservations they used included).
    pub overwrites: u64,
    /// Pages given a frame ahead of an access predicted to overwrite them, without a
    /// copy (the learned policy; see `PoolCore::begin_acquire_discard`).
    pub reservations: u64,
    /// Reservations of no use: the page was read instead (the frame given up, the page
    /// loaded on demand), touched by the host, no longer predicted, evicted or freed
    /// before its access. The rest were used by the overwrite (counted in `overwrites`)
    /// or are outstanding.
    pub reservations_missed: u64,
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
    /// Pages the remote tier could not give back (each failed fetch: every copy of the
    /// page was gone), so their buffers were lost.
    pub pages_lost: u64,
    /// Buffers that were lost (a page could not be fetched back, or a zero fill of one
    /// failed): their acquires fail until they are freed. Counted once per buffer.
    pub buffers_lost: u64,
    /// Pages whose bytes the remote tier holds (or is being sent) now.
    pub remote_pages: u64,
    /// Remote pages of the remote budget.
    pub remote_pages_total: u64,
    /// Estimated remote tier bandwidth, bytes/s.
    pub remote_bytes_per_s: f64,
    /// Bytes copied from the peer GPU's copies to the device (loads that crossed no
    /// PCIe link to the host).
    pub p2d_bytes: u64,
    /// Bytes copied from the device to the peer GPU (clean pages leaving a copy there).
    pub d2p_bytes: u64,
    /// Copies left on the peer GPU by clean pages leaving the GPU.
    pub peer_fills: u64,
    /// Loads served from the peer GPU.
    pub peer_loads: u64,
    /// Copies to or from the peer GPU that failed (each lost only that copy: the page
    /// loads from its slot instead).
    pub peer_errors: u64,
    /// Peer frames holding (or filling) a copy now.
    pub peer_frames_in_use: u64,
    /// Peer frames lent to the pool now.
    pub peer_frames_total: u64,
    /// The predictor's counters.
    pub predictor: PredictorStats,
}

impl CoreStats {
    /// An acquire began; `hit` when every page was resident.
    pub(super) fn on_acquire(&mut self, hit: bool) {
        self.acquires += 1;
        self.hits += u64::from(hit);
    }

    /// A load host→device started (`prefetch`: planned, not demanded); `frames_in_use`
    /// frames are in use now.
    pub(super) fn on_load(&mut self, prefetch: bool, frames_in_use: u64) {
        if prefetch {
            self.prefetch_loads += 1;
        } else {
            self.demand_loads += 1;
        }
        self.frames_in_use_peak = self.frames_in_use_peak.max(frames_in_use);
    }

    /// A page got a frame without a load (its contents are discarded); `frames_in_use`
    /// frames are in use now.
    pub(super) fn on_overwrite(&mut self, frames_in_use: u64) {
        self.overwrites += 1;
        self.frames_in_use_peak = self.frames_in_use_peak.max(frames_in_use);
    }

    /// A page got a frame ahead of an access predicted to overwrite it, without a copy;
    /// `frames_in_use` frames are in use now.
    pub(super) fn on_reserve(&mut self, frames_in_use: u64) {
        self.reservations += 1;
        self.frames_in_use_peak = self.frames_in_use_peak.max(frames_in_use);
    }

    /// A page left the GPU: dropped (`dirty` false) or its write-back started.
    pub(super) fn on_evict(&mut self, dirty: bool) {
        if dirty {
            self.evictions_dirty += 1;
        } else {
            self.evictions_clean += 1;
        }
    }

    /// A fetch from the remote tier started (`prefetch`: staged, not demanded).
    pub(super) fn on_fetch(&mut self, prefetch: bool) {
        if prefetch {
            self.remote_prefetches += 1;
        } else {
            self.remote_demand_fetches += 1;
        }
    }

    /// A slot was given up without a copy (the remote tier holds the same bytes), by a
    /// page on the GPU or off it.
    pub(super) fn on_slot_dropped(&mut self, on_gpu: bool) {
        if on_gpu {
            self.gpu_page_slots_dropped += 1;
        } else {
            self.spills_clean += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_event_counts_where_it_belongs() {
        let mut s = CoreStats::default();
        s.on_acquire(true);
        s.on_acquire(false);
        s.on_load(true, 3);
        s.on_load(false, 2);
        s.on_evict(true);
        s.on_evict(false);
        s.on_evict(false);
        s.on_fetch(true);
        s.on_slot_dropped(true);
        s.on_slot_dropped(false);
        s.on_slot_dropped(false);
        let want = CoreStats {
            acquires: 2,
            hits: 1,
            prefetch_loads: 1,
            demand_loads: 1,
            frames_in_use_peak: 3,
            evictions_dirty: 1,
            evictions_clean: 2,
            remote_prefetches: 1,
            gpu_page_slots_dropped: 1,
            spills_clean: 2,
            ..CoreStats::default()
        };
        assert_eq!(s, want);
    }
}
