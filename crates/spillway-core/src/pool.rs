//! The pool's state machine: page table, tier accounting, eviction and transfer planning.
//!
//! [`PoolCore`] does no IO. The driver (the embedded pool in `spillway-client`) calls:
//! - `alloc` / `free` / `begin_acquire` / `release` / `step` / host access, with `now`;
//! - [`PoolCore::poll_transfer`] to take copies to start, and [`PoolCore::poll_mapping`]
//!   for device mappings to change, after every call;
//! - [`PoolCore::handle_transfer_done`] when the device reports a copy finished.
//!
//! ## Pages and tiers
//! The host tier is *inclusive*: every page of every buffer has a host slot from `alloc`
//! to `free`, so a page whose GPU copy is clean leaves the GPU without a copy. A page's
//! GPU state is one of `Absent`, `Loading` (host→device copy in flight), `Resident`
//! (clean or dirty) and `Evicting` (device→host copy of a dirty page in flight).
//!
//! ## The remote tier
//! With a remote budget (`remote_budget_bytes > 0`), the host tier becomes a cache of
//! the pool's pages too: a page's host state is `Zero` (never written, no slot), `Remote`
//! (only the remote tier has it), `Fetching` (coming into a slot: from the remote tier,
//! or zero-filled), `Slot` (in a slot; `clean` when the remote tier holds the same bytes)
//! or `Spilling` (being copied to the remote tier). A page on the GPU (or in flight to or
//! from it) keeps its slot, so mostly pages off the GPU leave the host; when none can, a
//! page on the GPU whose slot holds the same bytes as the remote tier gives its slot up
//! (the host copy was a third copy; the page gets a slot again if it is written and
//! evicted). A demand that finds every slot held by GPU pages takes a page off the GPU. Remote ops go out through [`PoolCore::poll_remote`] and come
//! back through [`PoolCore::handle_remote_done`]; the remote copies of freed pages are
//! dropped through [`PoolCore::take_discards`]. A slot is had by dropping a clean page
//! (no copy) or spilling one, furthest next use first (least recently used without a
//! prediction). Under [`Policy::Learned`] the planner stages pages remote→host with the
//! same horizon rule as host→GPU but the remote tier's bandwidth, so staging runs ahead
//! of the GPU loads that need it. Without a remote budget no page ever leaves its slot.
//!
//! ## Invariants (checked by [`PoolCore::check_invariants`] in tests)
//! - frames in use + free frames = frames of the budget; each frame has at most one page;
//!   so the GPU budget is never exceeded. The same for host slots.
//! - a page that is pinned (acquired), host-pinned (read or written by the host) or in
//!   flight is never chosen for eviction, and a page being read or written by the host
//!   never starts a copy.
//! - bytes in flight per direction never exceed the configured bound (one copy is always
//!   allowed when none is in flight, so progress is guaranteed).
//! - the pages pinned at once never exceed the frames: an acquire that would need more
//!   fails at once ([`CoreError::HeldAcquiresExceedBudget`]), so waiting always ends.
//!
//! ## Planning
//! Demand loads (pages of a pending acquire) go first. Under [`Policy::Learned`] the
//! planner then walks the predictor's upcoming accesses, nearest first, and queues loads
//! of absent pages while (a) the access is within the lookahead horizon: the first
//! [`MIN_LOOKAHEAD_ACCESSES`] accesses always, later ones while the predicted time until
//! them is below [`LEAD_FACTOR`] times the time the copies queued so far will take at
//! the measured bandwidth, plus [`JITTER_MARGIN`]; and (b) a frame can be had without evicting a page whose next
//! use is sooner than the incoming page's. Eviction is by next use (furthest first).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use spillway_types::config::{Policy, PoolConfig};
use spillway_types::{BufferId, Direction, FrameId, HostSlot, PageId, TransferId, limits};

use crate::error::CoreError;
use crate::eviction::{Clock, EvictionPolicy, NextUse, VictimView};
use crate::predictor::{Predictor, PredictorStats};
use crate::retry::{Backoff, Verdict};

/// The first this many predicted accesses are always considered for prefetch (planning
/// only happens at accesses, so the next few must be covered whatever their timing).
pub const MIN_LOOKAHEAD_ACCESSES: u64 = 8;
/// How far ahead of its predicted use a copy is started, as a multiple of the time the
/// copies queued before it will take. Larger hides more jitter but loads mispredicted
/// pages earlier.
pub const LEAD_FACTOR: f64 = 8.0;
/// [`LEAD_FACTOR`] for staging remote→host: larger, because a network's latency varies
/// more than a copy engine's and a staged page waits in a slot, not on the GPU. Staging
/// never takes a slot from a page used sooner, so a long horizon costs no hits.
pub const REMOTE_LEAD_FACTOR: f64 = 16.0;
/// Time added to the horizon for what bandwidth does not explain: the OS descheduling a
/// copy thread, driver latency. A few scheduler time slices.
pub const JITTER_MARGIN: Duration = Duration::from_millis(10);
/// First wait before a spill is tried again after the remote tier refused one: 10 ms.
pub const SPILL_RETRY_MIN: Duration = Duration::from_millis(10);
/// Longest wait between spill attempts: 1 s.
pub const SPILL_RETRY_MAX: Duration = Duration::from_secs(1);
/// Spills failing this long without one success fail the pool: 120 s (longer than the
/// node's peer grace, so a paused peer costs a stall, not the job).
pub const SPILL_DEADLINE: Duration = Duration::from_secs(120);
/// Weight of the newest copy in the bandwidth estimate.
const BANDWIDTH_ALPHA: f64 = 0.2;

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

/// A copy for the driver to start on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// Reported back to [`PoolCore::handle_transfer_done`].
    pub id: TransferId,
    /// Which way.
    pub direction: Direction,
    /// The page moved.
    pub page: PageId,
    /// The device side.
    pub frame: FrameId,
    /// The host side.
    pub slot: HostSlot,
    /// Bytes to copy (the page's length; the last page of a buffer may be short).
    pub bytes: u64,
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
pub enum RemoteKind {
    /// Copy the slot's bytes to the remote tier under the page's id.
    Spill,
    /// Copy the page's bytes from the remote tier into the slot.
    Fetch,
    /// Fill the slot with zeros (a page never written); no remote tier involved.
    Zero,
}

/// A move between the host tier and the remote tier, for the driver to start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteTransfer {
    /// Reported back to [`PoolCore::handle_remote_done`].
    pub id: TransferId,
    /// Which way.
    pub kind: RemoteKind,
    /// The page.
    pub page: PageId,
    /// The host side.
    pub slot: HostSlot,
    /// The page's length.
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gpu {
    Absent,
    Loading {
        frame: FrameId,
        prefetch: bool,
    },
    Resident {
        frame: FrameId,
        dirty: bool,
        unused_prefetch: bool,
    },
    Evicting {
        frame: FrameId,
    },
}

/// Where a page is in the host and remote tiers (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Host {
    Zero,
    Remote,
    Fetching { slot: HostSlot },
    Slot { slot: HostSlot, clean: bool },
    Spilling { slot: HostSlot },
}

impl Host {
    fn slot(self) -> Option<HostSlot> {
        match self {
            Host::Fetching { slot } | Host::Slot { slot, .. } | Host::Spilling { slot } => {
                Some(slot)
            }
            Host::Zero | Host::Remote => None,
        }
    }
}

#[derive(Debug)]
struct Page {
    host: Host,
    /// The remote tier holds bytes for this page (current or stale): it uses remote
    /// capacity until the buffer is freed or the space is given back.
    remote_space: bool,
    gpu: Gpu,
    pins: u32,
    host_pins: u32,
    in_flight: u8,
    /// The frame the page last lived in: loading it there again needs no remap of the
    /// buffer's device range.
    last_frame: Option<FrameId>,
}

#[derive(Debug)]
struct Buffer {
    bytes: u64,
    pages: Vec<Page>,
    /// Access count at the buffer's last acquire (recency for host-tier victims).
    last_access: u64,
    shared_holders: u32,
    exclusive: bool,
    freed: bool,
}

impl Buffer {
    fn holders(&self) -> u32 {
        self.shared_holders + u32::from(self.exclusive)
    }
}

#[derive(Debug)]
struct InFlight {
    page: PageId,
    direction: Direction,
    bytes: u64,
    issued_at: Duration,
}

#[derive(Debug)]
struct RemoteInFlight {
    page: PageId,
    kind: RemoteKind,
    bytes: u64,
}

#[derive(Debug, Clone, Copy)]
struct Acquire {
    buffer: BufferId,
    mode: AccessMode,
}

#[derive(Debug, Clone, Copy)]
struct Bandwidth {
    bytes_per_s: f64,
    last_done: Duration,
}

/// Throughput of a tier whose ops run many at once (the network): bytes completed over
/// the time at least one op was in flight, sampled every [`Throughput::WINDOW`] of busy
/// time. Per-op service times would overestimate it, since completions arrive in bursts.
#[derive(Debug, Clone, Copy)]
struct Throughput {
    bytes_per_s: f64,
    window_bytes: u64,
    window_busy: Duration,
    last_event: Duration,
    in_flight: u64,
}

impl Throughput {
    /// Busy time per sample: long enough to hold several 2 MiB pages at 1 GB/s.
    const WINDOW: Duration = Duration::from_millis(20);

    fn new(bytes_per_s: f64) -> Throughput {
        Throughput {
            bytes_per_s,
            window_bytes: 0,
            window_busy: Duration::ZERO,
            last_event: Duration::ZERO,
            in_flight: 0,
        }
    }

    fn advance(&mut self, now: Duration) {
        if self.in_flight > 0 {
            self.window_busy += now.saturating_sub(self.last_event);
        }
        self.last_event = self.last_event.max(now);
    }

    fn on_issue(&mut self, now: Duration) {
        self.advance(now);
        self.in_flight += 1;
    }

    fn on_done(&mut self, now: Duration, bytes: u64) {
        self.advance(now);
        self.in_flight = self.in_flight.saturating_sub(1);
        self.window_bytes += bytes;
        if self.window_busy >= Self::WINDOW {
            let sample = self.window_bytes as f64 / self.window_busy.as_secs_f64();
            self.bytes_per_s += BANDWIDTH_ALPHA * (sample - self.bytes_per_s);
            self.window_bytes = 0;
            self.window_busy = Duration::ZERO;
        }
    }
}

fn dir_index(d: Direction) -> usize {
    match d {
        Direction::HostToDevice => 0,
        Direction::DeviceToHost => 1,
    }
}

/// The pool's state machine. See the module docs.
pub struct PoolCore {
    cfg: PoolConfig,
    page_bytes: u64,
    frames: Vec<Option<PageId>>,
    frame_next_use: Vec<Option<u64>>,
    free_frames: Vec<FrameId>,
    free_slots: Vec<HostSlot>,
    buffers: HashMap<BufferId, Buffer>,
    next_buffer: u64,
    transfers: HashMap<TransferId, InFlight>,
    next_transfer: u64,
    out: VecDeque<Transfer>,
    mappings: VecDeque<MappingChange>,
    in_flight_bytes: [u64; 2],
    demand: VecDeque<PageId>,
    plan: VecDeque<(PageId, u64)>,
    next_use: HashMap<BufferId, u64>,
    accesses: u64,
    acquires: HashMap<AcquireId, Acquire>,
    next_acquire: u64,
    pinned_pages: u64,
    evicting_frames: u64,
    eviction: Box<dyn EvictionPolicy>,
    predictor: Predictor,
    bandwidth: [Bandwidth; 2],
    stats: CoreStats,
    failed: Option<CoreError>,
    /// Backoff of spills after the remote tier refused one (back-pressure, not a spin).
    spill_retry: Backoff,
    remote_pages_max: u64,
    remote_pages: u64,
    remote_ops: HashMap<TransferId, RemoteInFlight>,
    remote_out: VecDeque<RemoteTransfer>,
    remote_in_flight_bytes: [u64; 2],
    remote_bw: Throughput,
    spilling: u64,
    /// Pages a host access waits for (they must come into a slot first).
    host_demand: VecDeque<PageId>,
    remote_plan: VecDeque<(PageId, u64)>,
    discards: Vec<PageId>,
    /// The furthest access the last plan stages for: pages used by then are not spilled
    /// ahead of need.
    remote_horizon: u64,
    /// The latest `now` handed in, for calls that take none.
    last_now: Duration,
}

impl std::fmt::Debug for PoolCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolCore")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// What [`PoolCore::frame_for`] found.
enum Got {
    Frame(FrameId),
    /// A write-back in flight will free a frame for this load.
    Later,
    /// A free host slot (for a fetch).
    Slot(HostSlot),
    /// No frame can be had now.
    Never,
}

/// What [`PoolCore::spill`] did.
enum Spilled {
    /// The page left at once (the remote tier held its bytes); its slot is free.
    Freed,
    /// A copy to the remote tier started; the slot comes free when it finishes.
    Started,
    /// Nothing: the page cannot leave now (in-flight bound, no remote space).
    Blocked,
}

struct View<'a> {
    core: &'a PoolCore,
    bound: Option<u64>,
    preferred: Option<FrameId>,
}

impl VictimView for View<'_> {
    fn frame_count(&self) -> u32 {
        self.core.frames.len() as u32
    }

    fn eligible(&self, frame: FrameId) -> bool {
        let Some(pid) = self.core.frames[frame.0 as usize] else {
            return false;
        };
        let page = self.core.page(pid);
        matches!(page.gpu, Gpu::Resident { .. }) && page.pins == 0 && page.host_pins == 0
    }

    fn next_use(&self, frame: FrameId) -> Option<u64> {
        self.core.frame_next_use[frame.0 as usize].filter(|&n| n > self.core.accesses)
    }

    fn must_exceed(&self) -> Option<u64> {
        self.bound
    }

    fn preferred(&self) -> Option<FrameId> {
        self.preferred
    }
}

impl PoolCore {
    /// A pool for `cfg` (validated here). `bandwidth_hint_bytes_per_s` seeds the copy
    /// bandwidth estimate until copies are measured.
    pub fn new(
        cfg: PoolConfig,
        bandwidth_hint_bytes_per_s: f64,
    ) -> Result<PoolCore, spillway_types::config::ConfigError> {
        cfg.validate()?;
        let frames = cfg.gpu_frames() as u32;
        let slots = cfg.host_slots() as u32;
        let eviction: Box<dyn EvictionPolicy> = match cfg.policy {
            Policy::Learned => Box::new(NextUse::new(frames)),
            Policy::Clock | Policy::OnDemand => Box::new(Clock::new(frames)),
        };
        let bw = Bandwidth {
            bytes_per_s: bandwidth_hint_bytes_per_s.max(1e6),
            last_done: Duration::ZERO,
        };
        Ok(PoolCore {
            page_bytes: cfg.page_size.bytes(),
            frames: vec![None; frames as usize],
            frame_next_use: vec![None; frames as usize],
            free_frames: (0..frames).rev().map(FrameId).collect(),
            free_slots: (0..slots).rev().map(HostSlot).collect(),
            buffers: HashMap::new(),
            next_buffer: 1,
            transfers: HashMap::new(),
            next_transfer: 1,
            out: VecDeque::new(),
            mappings: VecDeque::new(),
            in_flight_bytes: [0; 2],
            demand: VecDeque::new(),
            plan: VecDeque::new(),
            next_use: HashMap::new(),
            accesses: 0,
            acquires: HashMap::new(),
            next_acquire: 1,
            pinned_pages: 0,
            evicting_frames: 0,
            eviction,
            predictor: Predictor::new(cfg.history_steps),
            bandwidth: [bw; 2],
            stats: CoreStats::default(),
            failed: None,
            spill_retry: Backoff::new(SPILL_RETRY_MIN, SPILL_RETRY_MAX, SPILL_DEADLINE),
            remote_pages_max: cfg.remote_pages(),
            remote_pages: 0,
            remote_ops: HashMap::new(),
            remote_out: VecDeque::new(),
            remote_in_flight_bytes: [0; 2],
            remote_bw: Throughput::new(1e9),
            spilling: 0,
            host_demand: VecDeque::new(),
            remote_plan: VecDeque::new(),
            discards: Vec::new(),
            remote_horizon: 0,
            last_now: Duration::ZERO,
            cfg,
        })
    }

    /// Replaces the bandwidth estimate of both directions with a first guess (a device's
    /// hint), until copies are measured.
    pub fn set_bandwidth_hint(&mut self, bytes_per_s: f64) {
        for bw in &mut self.bandwidth {
            bw.bytes_per_s = bytes_per_s.max(1e6);
        }
    }

    /// Replaces the remote tier's bandwidth estimate with a first guess, until remote
    /// ops are measured.
    pub fn set_remote_bandwidth_hint(&mut self, bytes_per_s: f64) {
        self.remote_bw.bytes_per_s = bytes_per_s.max(1e6);
    }

    /// Whether the pool has a remote tier.
    pub fn has_remote(&self) -> bool {
        self.remote_pages_max > 0
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    fn page(&self, pid: PageId) -> &Page {
        &self.buffers[&pid.buffer].pages[pid.index as usize]
    }

    fn page_mut(&mut self, pid: PageId) -> &mut Page {
        &mut self
            .buffers
            .get_mut(&pid.buffer)
            .expect("page of a live buffer")
            .pages[pid.index as usize]
    }

    /// Bytes of page `index` of a buffer of `bytes`.
    fn page_len(&self, bytes: u64, index: u32) -> u64 {
        (bytes - u64::from(index) * self.page_bytes).min(self.page_bytes)
    }

    fn live(&self, id: BufferId) -> Result<&Buffer, CoreError> {
        match self.buffers.get(&id) {
            Some(b) if !b.freed => Ok(b),
            Some(_) => Err(CoreError::Freed(id)),
            None if id.0 > 0 && id.0 < self.next_buffer => Err(CoreError::Freed(id)),
            None => Err(CoreError::UnknownBuffer(id)),
        }
    }

    /// Size of a live buffer in bytes.
    pub fn buffer_bytes(&self, id: BufferId) -> Result<u64, CoreError> {
        Ok(self.live(id)?.bytes)
    }

    /// Registers a buffer of `bytes`; its pages start in the host tier, zero-filled.
    pub fn alloc(&mut self, bytes: u64) -> Result<BufferId, CoreError> {
        if bytes == 0 {
            return Err(CoreError::EmptyBuffer);
        }
        let pages = bytes.div_ceil(self.page_bytes);
        if pages > self.frames.len() as u64 || pages > limits::PAGES_PER_BUFFER_MAX {
            return Err(CoreError::BufferTooLarge {
                requested_bytes: bytes,
                pages,
                budget_bytes: self.frames.len() as u64 * self.page_bytes,
            });
        }
        if self.buffers.len() >= limits::BUFFERS_MAX {
            return Err(CoreError::TooManyBuffers {
                limit: limits::BUFFERS_MAX,
            });
        }
        let total_pages = self.capacity_pages();
        let free_pages = total_pages.saturating_sub(self.committed_pages());
        if free_pages < pages {
            return Err(CoreError::PoolFull {
                requested_bytes: bytes,
                needed_pages: pages,
                free_pages,
                total_pages,
            });
        }
        let id = BufferId(self.next_buffer);
        self.next_buffer += 1;
        let remote = self.has_remote();
        let pages = (0..pages)
            .map(|_| Page {
                // Without a remote tier every page has its slot for life (the driver
                // zero-fills it); with one, a page gets a slot when it is first needed.
                host: if remote {
                    Host::Zero
                } else {
                    Host::Slot {
                        slot: self.free_slots.pop().expect("counted"),
                        clean: false,
                    }
                },
                remote_space: false,
                gpu: Gpu::Absent,
                pins: 0,
                host_pins: 0,
                in_flight: 0,
                last_frame: None,
            })
            .collect();
        self.buffers.insert(
            id,
            Buffer {
                bytes,
                pages,
                last_access: self.accesses,
                shared_holders: 0,
                exclusive: false,
                freed: false,
            },
        );
        Ok(id)
    }

    /// Frees a buffer. Its frames and slots are given back at once, or when copies in
    /// flight for it finish.
    pub fn free(&mut self, id: BufferId, now: Duration) -> Result<(), CoreError> {
        let b = self.live(id)?;
        let holders = b.holders() + b.pages.iter().map(|p| p.host_pins).sum::<u32>();
        if holders > 0 {
            return Err(CoreError::BufferHeld {
                buffer: id,
                holders,
            });
        }
        self.buffers.get_mut(&id).expect("live").freed = true;
        let n = self.buffers[&id].pages.len() as u32;
        for index in 0..n {
            let pid = PageId { buffer: id, index };
            if let Gpu::Resident { frame, .. } = self.page(pid).gpu {
                self.release_frame(pid, frame);
            }
        }
        self.reap(id);
        self.pump(now);
        Ok(())
    }

    /// Pages the pool can hold: the host slots, plus the remote pages less the headroom.
    fn capacity_pages(&self) -> u64 {
        if self.has_remote() {
            self.cfg.host_slots() + self.remote_pages_max - limits::REMOTE_HEADROOM_PAGES
        } else {
            self.cfg.host_slots()
        }
    }

    /// Pages of buffers not yet given back (freed buffers with copies in flight count).
    fn committed_pages(&self) -> u64 {
        self.buffers.values().map(|b| b.pages.len() as u64).sum()
    }

    /// Gives back a freed buffer's slots once no copy uses its pages.
    fn reap(&mut self, id: BufferId) {
        let Some(b) = self.buffers.get(&id) else {
            return;
        };
        if !b.freed || b.pages.iter().any(|p| p.in_flight > 0) {
            return;
        }
        let b = self.buffers.remove(&id).expect("present");
        for (index, p) in b.pages.into_iter().enumerate() {
            debug_assert_eq!(p.gpu, Gpu::Absent);
            if let Some(slot) = p.host.slot() {
                self.free_slots.push(slot);
            }
            if p.remote_space {
                self.remote_pages -= 1;
                self.discards.push(PageId {
                    buffer: id,
                    index: index as u32,
                });
            }
        }
    }

    /// The page leaves `frame`: the frame is free again.
    fn release_frame(&mut self, pid: PageId, frame: FrameId) {
        let page = self.page_mut(pid);
        if let Gpu::Resident {
            unused_prefetch: true,
            ..
        } = page.gpu
        {
            self.stats.prefetch_wasted += 1;
        }
        self.page_mut(pid).last_frame = Some(frame);
        self.page_mut(pid).gpu = Gpu::Absent;
        debug_assert_eq!(self.frames[frame.0 as usize], Some(pid));
        self.frames[frame.0 as usize] = None;
        self.frame_next_use[frame.0 as usize] = None;
        self.eviction.on_free(frame);
        self.free_frames.push(frame);
        self.mappings.push_back(MappingChange::Unmap { page: pid });
    }

    /// Starts an acquire of `id`: pins its pages and queues loads of those not resident.
    /// Returns the acquire and whether it is a hit (every page already resident).
    pub fn begin_acquire(
        &mut self,
        id: BufferId,
        mode: AccessMode,
        now: Duration,
    ) -> Result<(AcquireId, bool), CoreError> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let b = self.live(id)?;
        match mode {
            AccessMode::Exclusive if b.holders() > 0 => {
                return Err(CoreError::BufferBusy {
                    buffer: id,
                    mode: if b.exclusive { "exclusively" } else { "shared" },
                });
            }
            AccessMode::Shared if b.exclusive => {
                return Err(CoreError::BufferBusy {
                    buffer: id,
                    mode: "exclusively",
                });
            }
            _ => {}
        }
        let newly = b.pages.iter().filter(|p| p.pins == 0).count() as u64;
        if self.pinned_pages + newly > self.frames.len() as u64 {
            return Err(CoreError::HeldAcquiresExceedBudget {
                buffer: id,
                held_bytes: self.pinned_pages * self.page_bytes,
                requested_bytes: newly * self.page_bytes,
                budget_bytes: self.frames.len() as u64 * self.page_bytes,
            });
        }
        self.accesses += 1;
        if self.cfg.policy == Policy::Learned {
            self.predictor.on_access(id, now);
        }
        self.pinned_pages += newly;
        let b = self.buffers.get_mut(&id).expect("live");
        b.last_access = self.accesses;
        match mode {
            AccessMode::Shared => b.shared_holders += 1,
            AccessMode::Exclusive => b.exclusive = true,
        }
        let mut hit = true;
        for index in 0..b.pages.len() as u32 {
            let page = &mut b.pages[index as usize];
            page.pins += 1;
            match &mut page.gpu {
                Gpu::Resident {
                    frame,
                    unused_prefetch,
                    ..
                } => {
                    *unused_prefetch = false;
                    self.eviction.on_access(*frame);
                }
                _ => {
                    hit = false;
                    self.demand.push_back(PageId { buffer: id, index });
                }
            }
        }
        self.stats.acquires += 1;
        self.stats.hits += u64::from(hit);
        let acquire = AcquireId(self.next_acquire);
        self.next_acquire += 1;
        self.acquires.insert(acquire, Acquire { buffer: id, mode });
        if self.cfg.policy == Policy::Learned {
            self.replan();
        }
        self.pump(now);
        Ok((acquire, hit))
    }

    /// Whether every page of the acquire is resident (its frames may be used).
    pub fn is_ready(&self, acquire: AcquireId) -> Result<bool, CoreError> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let a = self
            .acquires
            .get(&acquire)
            .expect("acquire ids come from begin_acquire");
        Ok(self.buffers[&a.buffer]
            .pages
            .iter()
            .all(|p| matches!(p.gpu, Gpu::Resident { .. })))
    }

    /// The frames of a ready acquire's pages, in page order.
    pub fn frames_of(&self, acquire: AcquireId) -> Vec<FrameId> {
        let a = self
            .acquires
            .get(&acquire)
            .expect("acquire ids come from begin_acquire");
        self.buffers[&a.buffer]
            .pages
            .iter()
            .map(|p| match p.gpu {
                Gpu::Resident { frame, .. } => frame,
                other => panic!("frames_of an acquire that is not ready: {other:?}"),
            })
            .collect()
    }

    /// Ends an acquire; an exclusive one leaves its pages dirty.
    pub fn release(&mut self, acquire: AcquireId, now: Duration) {
        let a = self
            .acquires
            .remove(&acquire)
            .expect("acquire ids come from begin_acquire");
        let on_demand = self.cfg.policy == Policy::OnDemand;
        let b = self
            .buffers
            .get_mut(&a.buffer)
            .expect("held buffers cannot be freed");
        match a.mode {
            AccessMode::Shared => b.shared_holders -= 1,
            AccessMode::Exclusive => b.exclusive = false,
        }
        let mut unpinned = 0;
        let mut drop_now = Vec::new();
        for (index, page) in b.pages.iter_mut().enumerate() {
            page.pins -= 1;
            if let (AccessMode::Exclusive, Gpu::Resident { dirty, .. }) = (a.mode, &mut page.gpu) {
                *dirty = true;
            }
            if page.pins == 0 {
                unpinned += 1;
                if on_demand && page.host_pins == 0 {
                    drop_now.push(index as u32);
                }
            }
        }
        self.pinned_pages -= unpinned;
        for index in drop_now {
            self.evict(
                PageId {
                    buffer: a.buffer,
                    index,
                },
                now,
            );
        }
        self.pump(now);
    }

    /// Marks the end of a step (an iteration of the job).
    pub fn step(&mut self, now: Duration) {
        self.stats.steps += 1;
        if self.cfg.policy == Policy::Learned {
            self.predictor.end_step(now);
            self.replan();
        }
        self.pump(now);
    }

    /// Begins a host read or write of `len` bytes at `offset`: returns `None` while a
    /// page of the range is in flight (wait for a completion and ask again), else the
    /// location of each page of the range, which stay put until
    /// [`PoolCore::end_host_access`].
    /// A write is refused while the buffer is acquired, a read while it is acquired
    /// exclusively ([`CoreError::BufferBusy`]).
    pub fn begin_host_access(
        &mut self,
        id: BufferId,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Result<Option<Vec<PageLocation>>, CoreError> {
        let b = self.live(id)?;
        if b.exclusive || (write && b.holders() > 0) {
            return Err(CoreError::BufferBusy {
                buffer: id,
                mode: if b.exclusive { "exclusively" } else { "shared" },
            });
        }
        if offset.checked_add(len).is_none_or(|end| end > b.bytes) || len == 0 {
            return Err(CoreError::OutOfRange {
                buffer: id,
                offset,
                len,
                bytes: b.bytes,
            });
        }
        let (first, last) = (
            (offset / self.page_bytes) as usize,
            ((offset + len - 1) / self.page_bytes) as usize,
        );
        if b.pages[first..=last].iter().any(|p| p.in_flight > 0) {
            return Ok(None);
        }
        let away: Vec<u32> = (first..=last)
            .filter(|&i| {
                b.pages[i].gpu == Gpu::Absent
                    && matches!(b.pages[i].host, Host::Zero | Host::Remote)
            })
            .map(|i| i as u32)
            .collect();
        if !away.is_empty() {
            // Not in the host tier: bring the pages into slots first.
            for index in away {
                let pid = PageId { buffer: id, index };
                if !self.host_demand.contains(&pid) {
                    self.host_demand.push_back(pid);
                }
            }
            self.pump(self.last_now);
            return Ok(None);
        }
        if !self.host_demand.is_empty() {
            self.host_demand.retain(|p| {
                p.buffer != id || (p.index as usize) < first || (p.index as usize) > last
            });
        }
        let b = self.buffers.get_mut(&id).expect("live");
        let mut out = Vec::with_capacity(last - first + 1);
        for p in &mut b.pages[first..=last] {
            p.host_pins += 1;
            out.push(match (p.gpu, p.host) {
                (Gpu::Resident { frame, .. }, _) => PageLocation::Gpu(frame),
                (Gpu::Absent, Host::Slot { slot, .. }) => PageLocation::Host(slot),
                (gpu, host) => {
                    unreachable!("checked not in flight and in a slot: {gpu:?} {host:?}")
                }
            });
        }
        Ok(Some(out))
    }

    /// Ends a host access begun with the same range; `wrote` marks GPU copies dirty.
    pub fn end_host_access(
        &mut self,
        id: BufferId,
        offset: u64,
        len: u64,
        wrote: bool,
        now: Duration,
    ) {
        let page_bytes = self.page_bytes;
        let b = self
            .buffers
            .get_mut(&id)
            .expect("host-pinned buffers cannot be freed");
        let (first, last) = (
            (offset / page_bytes) as usize,
            ((offset + len - 1) / page_bytes) as usize,
        );
        for p in &mut b.pages[first..=last] {
            p.host_pins -= 1;
            if let (true, Gpu::Resident { dirty, .. }) = (wrote, &mut p.gpu) {
                *dirty = true;
            }
            if let (true, Host::Slot { clean, .. }) = (wrote, &mut p.host) {
                *clean = false;
            }
        }
        self.pump(now);
    }

    /// When the driver must call [`PoolCore::handle_timeout`] if nothing else happens
    /// first: the end of a spill backoff. `None`: no timer is armed.
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.failed.is_some() {
            return None;
        }
        self.spill_retry.retry_at()
    }

    /// The instant of [`PoolCore::poll_timeout`] has come: starts what waited for it.
    pub fn handle_timeout(&mut self, now: Duration) {
        self.pump(now);
    }

    /// The next copy to start, if any.
    pub fn poll_transfer(&mut self) -> Option<Transfer> {
        self.out.pop_front()
    }

    /// The next change to device address ranges, if any.
    pub fn poll_mapping(&mut self) -> Option<MappingChange> {
        self.mappings.pop_front()
    }

    /// The next remote op (or zero fill) to start, if any.
    pub fn poll_remote(&mut self) -> Option<RemoteTransfer> {
        self.remote_out.pop_front()
    }

    /// Pages whose remote copies are no longer needed (their buffers were freed): the
    /// driver tells the remote tier to drop them.
    pub fn take_discards(&mut self) -> Vec<PageId> {
        std::mem::take(&mut self.discards)
    }

    /// Records that remote op `id` finished (`Err` with the tier's message if it failed).
    /// A failed fetch fails the pool (the page cannot be had); a failed spill leaves the
    /// page in its slot, counted in [`CoreStats::remote_errors`].
    pub fn handle_remote_done(
        &mut self,
        id: TransferId,
        result: Result<(), String>,
        now: Duration,
    ) {
        let Some(op) = self.remote_ops.remove(&id) else {
            debug_assert!(false, "completion of unknown remote op {id:?}");
            return;
        };
        let d = usize::from(op.kind == RemoteKind::Spill);
        self.remote_in_flight_bytes[d] -= op.bytes;
        if op.kind != RemoteKind::Zero {
            let bytes = if result.is_ok() { op.bytes } else { 0 };
            self.remote_bw.on_done(now, bytes);
        }
        let pid = op.page;
        self.page_mut(pid).in_flight -= 1;
        let (freed, wanted) = {
            let b = &self.buffers[&pid.buffer];
            let p = &b.pages[pid.index as usize];
            (
                b.freed,
                p.pins > 0 || p.host_pins > 0 || self.host_demand.contains(&pid),
            )
        };
        let host = self.page(pid).host;
        match (op.kind, host, result) {
            (RemoteKind::Fetch | RemoteKind::Zero, Host::Fetching { slot }, Ok(())) => {
                if op.kind == RemoteKind::Fetch {
                    self.stats.remote_bytes_in += op.bytes;
                }
                self.page_mut(pid).host = Host::Slot {
                    slot,
                    clean: op.kind == RemoteKind::Fetch,
                };
            }
            (RemoteKind::Fetch | RemoteKind::Zero, Host::Fetching { slot }, Err(e)) => {
                self.stats.remote_errors += 1;
                self.page_mut(pid).host = Host::Slot { slot, clean: false };
                self.failed.get_or_insert(CoreError::FetchFailed {
                    page: pid,
                    reason: e,
                });
            }
            (RemoteKind::Spill, Host::Spilling { slot }, Ok(())) => {
                self.spilling -= 1;
                self.spill_retry.on_success();
                self.stats.remote_bytes_out += op.bytes;
                if wanted || freed {
                    self.page_mut(pid).host = Host::Slot { slot, clean: true };
                } else {
                    self.page_mut(pid).host = Host::Remote;
                    self.free_slots.push(slot);
                }
            }
            (RemoteKind::Spill, Host::Spilling { slot }, Err(e)) => {
                // The page stays in its slot; spills wait out a backoff, and fail the pool
                // once they have failed for `SPILL_DEADLINE` without one success.
                self.spilling -= 1;
                self.stats.remote_errors += 1;
                self.page_mut(pid).host = Host::Slot { slot, clean: false };
                if let Verdict::GiveUp(failing_for) = self.spill_retry.on_failure(now) {
                    self.failed.get_or_insert(CoreError::SpillsFailing {
                        failing_ms: failing_for.as_millis() as u64,
                        attempts: self.spill_retry.failures(),
                        reason: e,
                    });
                }
            }
            (kind, state, _) => panic!("completion of {kind:?} for {pid} in state {state:?}"),
        }
        self.reap(pid.buffer);
        self.pump(now);
    }

    /// Records that copy `id` finished (`Err` with the device's message if it failed).
    pub fn handle_transfer_done(
        &mut self,
        id: TransferId,
        result: Result<(), String>,
        now: Duration,
    ) {
        let Some(t) = self.transfers.remove(&id) else {
            debug_assert!(false, "completion of unknown transfer {id:?}");
            return;
        };
        let d = dir_index(t.direction);
        self.in_flight_bytes[d] -= t.bytes;
        let bw = &mut self.bandwidth[d];
        let service = now
            .saturating_sub(t.issued_at.max(bw.last_done))
            .as_secs_f64();
        if service > 0.0 {
            bw.bytes_per_s += BANDWIDTH_ALPHA * (t.bytes as f64 / service - bw.bytes_per_s);
        }
        bw.last_done = now;
        let pid = t.page;
        let page = self.page_mut(pid);
        page.in_flight -= 1;
        if let Err(e) = result {
            self.failed.get_or_insert(CoreError::DeviceFailed(e));
        }
        let (freed, wanted) = {
            let b = &self.buffers[&pid.buffer];
            let p = &b.pages[pid.index as usize];
            (b.freed, p.pins > 0)
        };
        match (t.direction, self.page(pid).gpu) {
            (Direction::HostToDevice, Gpu::Loading { frame, prefetch }) => {
                self.stats.h2d_bytes += t.bytes;
                self.page_mut(pid).gpu = Gpu::Resident {
                    frame,
                    dirty: false,
                    unused_prefetch: prefetch && !wanted,
                };
                self.eviction.on_fill(frame);
                self.frame_next_use[frame.0 as usize] = self.next_use.get(&pid.buffer).copied();
                if freed {
                    self.release_frame(pid, frame);
                }
            }
            (Direction::DeviceToHost, Gpu::Evicting { frame }) => {
                self.stats.d2h_bytes += t.bytes;
                if let Host::Slot { clean, .. } = &mut self.page_mut(pid).host {
                    *clean = false;
                }
                self.evicting_frames -= 1;
                self.page_mut(pid).gpu = Gpu::Resident {
                    frame,
                    dirty: false,
                    unused_prefetch: false,
                };
                if !wanted || freed {
                    self.release_frame(pid, frame);
                }
            }
            (dir, state) => panic!("completion of {dir:?} for {pid} in state {state:?}"),
        }
        self.reap(pid.buffer);
        self.pump(now);
    }

    fn new_transfer(&mut self, pid: PageId, direction: Direction, frame: FrameId, now: Duration) {
        let (slot, bytes) = {
            let b = &self.buffers[&pid.buffer];
            let p = &b.pages[pid.index as usize];
            let Host::Slot { slot, .. } = p.host else {
                panic!("GPU copy of {pid} whose host state is {:?}", p.host);
            };
            (slot, self.page_len(b.bytes, pid.index))
        };
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        self.in_flight_bytes[dir_index(direction)] += bytes;
        self.page_mut(pid).in_flight += 1;
        self.transfers.insert(
            id,
            InFlight {
                page: pid,
                direction,
                bytes,
                issued_at: now,
            },
        );
        self.out.push_back(Transfer {
            id,
            direction,
            page: pid,
            frame,
            slot,
            bytes,
        });
    }

    fn may_issue(&self, direction: Direction, bytes: u64) -> bool {
        let d = dir_index(direction);
        let max = match direction {
            Direction::HostToDevice => self.cfg.h2d_bytes_in_flight_max,
            Direction::DeviceToHost => self.cfg.d2h_bytes_in_flight_max,
        };
        self.in_flight_bytes[d] == 0 || self.in_flight_bytes[d] + bytes <= max
    }

    /// Takes `pid` off the GPU now: a clean page is dropped, a dirty one written back.
    fn evict(&mut self, pid: PageId, now: Duration) -> bool {
        let Gpu::Resident { frame, dirty, .. } = self.page(pid).gpu else {
            return false;
        };
        if !dirty {
            self.stats.evictions_clean += 1;
            self.release_frame(pid, frame);
            return true;
        }
        let bytes = self.page_len(self.buffers[&pid.buffer].bytes, pid.index);
        if !self.may_issue(Direction::DeviceToHost, bytes) {
            return false;
        }
        if !matches!(self.page(pid).host, Host::Slot { .. }) {
            // Its slot was released while the remote tier held its bytes; the write-back
            // needs one again.
            let Some(slot) = self.free_slot_now(pid, now) else {
                return false;
            };
            self.page_mut(pid).host = Host::Slot { slot, clean: false };
        }
        self.stats.evictions_dirty += 1;
        self.evicting_frames += 1;
        self.page_mut(pid).gpu = Gpu::Evicting { frame };
        self.new_transfer(pid, Direction::DeviceToHost, frame, now);
        false
    }

    /// A frame for a load whose page is next used at `bound` (`None`: needed now).
    /// `waiting` counts loads of this pump pass already waiting for a write-back.
    /// Clean victims are dropped at once; a dirty one starts a write-back, and the frame
    /// comes free when it finishes.
    fn frame_for(
        &mut self,
        pid: PageId,
        bound: Option<u64>,
        waiting: &mut u64,
        now: Duration,
    ) -> Got {
        let preferred = self.page(pid).last_frame;
        loop {
            // The page's last frame if it is free (no remap), else any free frame.
            if let Some(p) = preferred
                && self.frames[p.0 as usize].is_none()
                && let Some(i) = self.free_frames.iter().rposition(|&f| f == p)
            {
                return Got::Frame(self.free_frames.swap_remove(i));
            }
            if let Some(f) = self.free_frames.pop() {
                return Got::Frame(f);
            }
            if self.evicting_frames > *waiting {
                *waiting += 1;
                return Got::Later;
            }
            let mut policy = std::mem::replace(&mut self.eviction, Box::new(Clock::new(0)));
            let victim = policy.choose_victim(&View {
                core: self,
                bound,
                preferred,
            });
            self.eviction = policy;
            let Some(victim) = victim else {
                return Got::Never;
            };
            let pid = self.frames[victim.0 as usize].expect("eligible frames hold a page");
            if !self.evict(pid, now) && !matches!(self.page(pid).gpu, Gpu::Evicting { .. }) {
                // Dirty, and the write-back bound is reached or no slot can take it now:
                // a clean page may leave instead; else try again after a completion.
                match self.evictable_victim(bound) {
                    Some(other) => {
                        if !self.evict(other, now)
                            && !matches!(self.page(other).gpu, Gpu::Evicting { .. })
                        {
                            return Got::Never;
                        }
                    }
                    None => return Got::Never,
                }
            }
        }
    }

    fn start_load(&mut self, pid: PageId, frame: FrameId, prefetch: bool, now: Duration) {
        debug_assert!(self.frames[frame.0 as usize].is_none());
        self.frames[frame.0 as usize] = Some(pid);
        self.frame_next_use[frame.0 as usize] = self.next_use.get(&pid.buffer).copied();
        self.page_mut(pid).gpu = Gpu::Loading { frame, prefetch };
        if prefetch {
            self.stats.prefetch_loads += 1;
        } else {
            self.stats.demand_loads += 1;
        }
        self.mappings
            .push_back(MappingChange::Map { page: pid, frame });
        self.new_transfer(pid, Direction::HostToDevice, frame, now);
        let used = (self.frames.len() - self.free_frames.len()) as u64;
        self.stats.frames_in_use_peak = self.stats.frames_in_use_peak.max(used);
    }

    /// Whether `pid` still needs a load: its buffer is live, it is absent, and the host
    /// is not touching it.
    fn needs_load(&self, pid: PageId) -> bool {
        match self.buffers.get(&pid.buffer) {
            Some(b) if !b.freed => {
                let p = &b.pages[pid.index as usize];
                p.gpu == Gpu::Absent && p.host_pins == 0 && matches!(p.host, Host::Slot { .. })
            }
            _ => false,
        }
    }

    /// Whether `pid` must come into a slot (from the remote tier, or zero-filled) before
    /// it can be loaded or read: its buffer is live and it has no slot.
    fn needs_fetch(&self, pid: PageId) -> bool {
        match self.buffers.get(&pid.buffer) {
            Some(b) if !b.freed => {
                let p = &b.pages[pid.index as usize];
                p.gpu == Gpu::Absent && matches!(p.host, Host::Zero | Host::Remote)
            }
            _ => false,
        }
    }

    /// Next predicted use of `pid`'s buffer (`None`: none predicted).
    fn next_use_of(&self, buffer: BufferId) -> Option<u64> {
        self.next_use
            .get(&buffer)
            .copied()
            .filter(|&n| n > self.accesses)
    }

    fn may_issue_remote(&self, kind: RemoteKind, bytes: u64) -> bool {
        let d = usize::from(kind == RemoteKind::Spill);
        self.remote_in_flight_bytes[d] == 0
            || self.remote_in_flight_bytes[d] + bytes <= self.cfg.remote_bytes_in_flight_max
    }

    fn new_remote(&mut self, pid: PageId, kind: RemoteKind, slot: HostSlot, now: Duration) {
        let bytes = self.page_len(self.buffers[&pid.buffer].bytes, pid.index);
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        self.remote_in_flight_bytes[usize::from(kind == RemoteKind::Spill)] += bytes;
        if kind != RemoteKind::Zero {
            self.remote_bw.on_issue(now);
        }
        self.page_mut(pid).in_flight += 1;
        self.remote_ops.insert(
            id,
            RemoteInFlight {
                page: pid,
                kind,
                bytes,
            },
        );
        self.remote_out.push_back(RemoteTransfer {
            id,
            kind,
            page: pid,
            slot,
            bytes,
        });
    }

    /// Starts bringing `pid` (Zero or Remote) into `slot`.
    fn start_fetch(&mut self, pid: PageId, slot: HostSlot, prefetch: bool, now: Duration) {
        let kind = match self.page(pid).host {
            Host::Zero => RemoteKind::Zero,
            Host::Remote => {
                if prefetch {
                    self.stats.remote_prefetches += 1;
                } else {
                    self.stats.remote_demand_fetches += 1;
                }
                RemoteKind::Fetch
            }
            other => panic!("fetch of {pid} in host state {other:?}"),
        };
        self.page_mut(pid).host = Host::Fetching { slot };
        self.new_remote(pid, kind, slot, now);
    }

    /// A free slot now: from the free list, or by dropping a clean page; starts a spill
    /// (for later) when only dirty pages could leave.
    fn free_slot_now(&mut self, exclude: PageId, now: Duration) -> Option<HostSlot> {
        if let Some(slot) = self.free_slots.pop() {
            return Some(slot);
        }
        let victim = self.host_victim(None, exclude)?;
        self.spill(victim, now);
        self.free_slots.pop()
    }

    /// Whether `pid` is on the GPU and its slot holds the same bytes as the remote tier:
    /// the slot can go without a copy (the page gets one again if it is written and
    /// evicted).
    fn slot_redundant(&self, pid: PageId) -> bool {
        let p = self.page(pid);
        matches!(p.gpu, Gpu::Resident { .. })
            && matches!(p.host, Host::Slot { clean: true, .. })
            && p.remote_space
            && p.host_pins == 0
            && p.in_flight == 0
            && !self.host_demand.contains(&pid)
    }

    /// Whether the page in a slot may leave the host tier now.
    fn spillable(&self, pid: PageId) -> bool {
        let p = self.page(pid);
        matches!(p.host, Host::Slot { .. })
            && p.gpu == Gpu::Absent
            && p.pins == 0
            && p.host_pins == 0
            && p.in_flight == 0
            && !self.host_demand.contains(&pid)
    }

    /// The page to take out of the host tier: the furthest next use (or none predicted)
    /// beyond `bound`, then the least recently used; `None` if no page may leave.
    fn host_victim(&self, bound: Option<u64>, exclude: PageId) -> Option<PageId> {
        // Only a demand (no bound) takes slots from pages on the GPU: staging with them
        // would trade a page needed later for one needed again when it leaves the GPU.
        self.host_victim_by(bound, exclude, false).or_else(|| {
            bound
                .is_none()
                .then(|| self.host_victim_by(None, exclude, true))
                .flatten()
        })
    }

    /// [`PoolCore::host_victim`] among pages off the GPU (`on_gpu` false), or among pages
    /// on the GPU whose slots are redundant (`on_gpu` true; any next use: the page stays
    /// on the GPU, only its host copy goes).
    fn host_victim_by(&self, bound: Option<u64>, exclude: PageId, on_gpu: bool) -> Option<PageId> {
        let mut best: Option<(u64, u64, PageId)> = None;
        for (&bid, b) in &self.buffers {
            if b.freed || b.holders() > 0 {
                continue;
            }
            let next = self.next_use_of(bid).unwrap_or(u64::MAX);
            if bound.is_some_and(|bound| next <= bound) {
                continue;
            }
            // Larger key wins: later next use, then older last access.
            let key = (next, u64::MAX - b.last_access);
            if best.is_some_and(|(n, a, _)| (n, a) >= key) {
                continue;
            }
            for index in (0..b.pages.len() as u32).rev() {
                let pid = PageId { buffer: bid, index };
                let fits = if on_gpu {
                    self.slot_redundant(pid)
                } else {
                    self.spillable(pid)
                };
                if pid != exclude && fits {
                    best = Some((key.0, key.1, pid));
                    break;
                }
            }
        }
        best.map(|(_, _, pid)| pid)
    }

    /// Remote space for a spill of `pid`: its own, a free one, or one taken back from a
    /// page in a slot (whose remote copy is then dropped). False if none can be had.
    fn remote_space_for(&mut self, pid: PageId) -> bool {
        if self.page(pid).remote_space {
            return true;
        }
        if self.remote_pages < self.remote_pages_max {
            self.remote_pages += 1;
            self.page_mut(pid).remote_space = true;
            return true;
        }
        let donor = self.buffers.iter().find_map(|(&bid, b)| {
            b.pages.iter().enumerate().find_map(|(i, p)| {
                (p.remote_space && matches!(p.host, Host::Slot { .. }) && p.in_flight == 0)
                    .then_some(PageId {
                        buffer: bid,
                        index: i as u32,
                    })
            })
        });
        let Some(donor) = donor else {
            return false;
        };
        let d = self.page_mut(donor);
        d.remote_space = false;
        if let Host::Slot { clean, .. } = &mut d.host {
            *clean = false;
        }
        self.discards.push(donor);
        self.page_mut(pid).remote_space = true;
        true
    }

    /// A slot for a fetch of a page next used at `bound` (`None`: needed now). A clean
    /// victim leaves at once; a dirty one starts a spill and the slot comes free when it
    /// finishes.
    fn slot_for(
        &mut self,
        pid: PageId,
        bound: Option<u64>,
        waiting: &mut u64,
        now: Duration,
    ) -> Got {
        loop {
            if let Some(slot) = self.free_slots.pop() {
                return Got::Slot(slot);
            }
            if self.spilling > *waiting {
                *waiting += 1;
                return Got::Later;
            }
            let Some(victim) = self.host_victim(bound, pid) else {
                // Every slot is held by a page on the GPU (or one that may not leave).
                // For a demand, take a page off the GPU: its slot can then be had.
                if bound.is_none() && self.evict_for_slot(now) {
                    continue;
                }
                return if self.evicting_frames > 0 {
                    Got::Later
                } else {
                    Got::Never
                };
            };
            match self.spill(victim, now) {
                Spilled::Freed => {}
                Spilled::Started => {}
                Spilled::Blocked => return Got::Never,
            }
        }
    }

    /// A page on the GPU that can leave now without help (not held, not touched by the
    /// host; clean, or dirty with a slot to be written back to), used furthest ahead and
    /// beyond `bound`.
    fn evictable_victim(&self, bound: Option<u64>) -> Option<PageId> {
        let mut best: Option<(u64, PageId)> = None;
        for (f, owner) in self.frames.iter().enumerate() {
            let Some(pid) = *owner else { continue };
            let p = self.page(pid);
            let can_leave = match p.gpu {
                Gpu::Resident { dirty: false, .. } => true,
                Gpu::Resident { dirty: true, .. } => matches!(p.host, Host::Slot { .. }),
                _ => false,
            };
            if !can_leave || p.pins > 0 || p.host_pins > 0 {
                continue;
            }
            let next = self.frame_next_use[f]
                .filter(|&n| n > self.accesses)
                .unwrap_or(u64::MAX);
            if bound.is_some_and(|b| next <= b) || best.is_some_and(|(n, _)| n >= next) {
                continue;
            }
            best = Some((next, pid));
        }
        best.map(|(_, pid)| pid)
    }

    /// Takes a page off the GPU so that its slot can leave the host tier: the eviction
    /// policy's victim. True if one left at once (it was clean).
    fn evict_for_slot(&mut self, now: Duration) -> bool {
        let mut policy = std::mem::replace(&mut self.eviction, Box::new(Clock::new(0)));
        let victim = policy.choose_victim(&View {
            core: self,
            bound: None,
            preferred: None,
        });
        self.eviction = policy;
        let Some(frame) = victim else {
            return false;
        };
        let pid = self.frames[frame.0 as usize].expect("eligible frames hold a page");
        self.evict(pid, now)
    }

    /// Takes `pid` (in a slot, off the GPU) out of the host tier.
    fn spill(&mut self, pid: PageId, now: Duration) -> Spilled {
        let Host::Slot { slot, clean } = self.page(pid).host else {
            return Spilled::Blocked;
        };
        let redundant = clean && self.page(pid).remote_space;
        if self.page(pid).gpu != Gpu::Absent && !redundant {
            // A page on the GPU keeps its slot unless the remote tier holds its bytes.
            return Spilled::Blocked;
        }
        if redundant {
            if self.page(pid).gpu == Gpu::Absent {
                self.stats.spills_clean += 1;
            } else {
                self.stats.gpu_page_slots_dropped += 1;
            }
            self.page_mut(pid).host = Host::Remote;
            self.free_slots.push(slot);
            return Spilled::Freed;
        }
        let bytes = self.page_len(self.buffers[&pid.buffer].bytes, pid.index);
        if !self.spill_retry.ready(now)
            || !self.may_issue_remote(RemoteKind::Spill, bytes)
            || !self.remote_space_for(pid)
        {
            return Spilled::Blocked;
        }
        self.spilling += 1;
        self.page_mut(pid).host = Host::Spilling { slot };
        self.new_remote(pid, RemoteKind::Spill, slot, now);
        Spilled::Started
    }

    /// Starts bringing pages of pending acquires, host accesses and the staging plan into
    /// slots, as far as slots and the in-flight bound allow.
    fn pump_remote(&mut self, now: Duration) {
        let mut waiting = 0u64;
        // Demand: pages of pending acquires and host accesses.
        // A host access's pages stay protected from leaving until it pins them (then
        // `begin_host_access` takes them off the list); pages of freed buffers go.
        let live =
            |core: &PoolCore, p: PageId| core.buffers.get(&p.buffer).is_some_and(|b| !b.freed);
        let host_demand: VecDeque<PageId> = std::mem::take(&mut self.host_demand)
            .into_iter()
            .filter(|&p| live(self, p))
            .collect();
        self.host_demand = host_demand;
        let mut demand: Vec<PageId> = self.demand.iter().copied().collect();
        demand.extend(self.host_demand.iter().copied());
        for pid in demand {
            if !self.needs_fetch(pid) || self.page(pid).in_flight > 0 {
                continue;
            }
            if !self.may_issue_remote(RemoteKind::Fetch, self.page_bytes) {
                return;
            }
            match self.slot_for(pid, None, &mut waiting, now) {
                Got::Slot(slot) => self.start_fetch(pid, slot, false, now),
                Got::Later | Got::Frame(_) => {}
                Got::Never => break,
            }
        }
        // Staging: predicted pages, nearest first.
        let mut i = 0;
        while i < self.remote_plan.len() {
            let (pid, next) = self.remote_plan[i];
            if !self.needs_fetch(pid) || self.page(pid).in_flight > 0 {
                self.remote_plan.remove(i);
                continue;
            }
            if !self.may_issue_remote(RemoteKind::Fetch, self.page_bytes) {
                return;
            }
            match self.slot_for(pid, Some(next), &mut waiting, now) {
                Got::Slot(slot) => {
                    self.remote_plan.remove(i);
                    self.start_fetch(pid, slot, true, now);
                }
                Got::Later | Got::Frame(_) => i += 1,
                Got::Never => return,
            }
        }
        self.spill_ahead(now);
    }

    /// Under the learned policy, keeps a quarter of the slots not holding GPU pages free
    /// (or coming free), by spilling pages whose next use is beyond everything planned,
    /// so that staging finds slots without waiting for a spill's round trip.
    fn spill_ahead(&mut self, now: Duration) {
        if self.cfg.policy != Policy::Learned {
            return;
        }
        let room = self
            .cfg
            .host_slots()
            .saturating_sub(self.frames.len() as u64);
        let target = (room / 4).max(1);
        // Pages within the staging horizon of the last plan (staged or not) stay.
        let bound = self
            .remote_horizon
            .max(self.plan.iter().map(|&(_, n)| n).max().unwrap_or(0))
            .max(self.accesses + MIN_LOOKAHEAD_ACCESSES);
        let nobody = PageId {
            buffer: BufferId(0),
            index: 0,
        };
        while (self.free_slots.len() as u64 + self.spilling) < target {
            let Some(victim) = self.host_victim(Some(bound), nobody) else {
                break;
            };
            if matches!(self.spill(victim, now), Spilled::Blocked) {
                break;
            }
        }
    }

    /// Starts every copy that the current state allows: demand loads, then prefetches.
    fn pump(&mut self, now: Duration) {
        self.last_now = self.last_now.max(now);
        if self.failed.is_some() {
            return;
        }
        if self.has_remote() {
            self.pump_remote(now);
        }
        let mut waiting = 0u64;
        let mut i = 0;
        while i < self.demand.len() {
            let pid = self.demand[i];
            let wanted = self
                .buffers
                .get(&pid.buffer)
                .is_some_and(|b| !b.freed && b.pages[pid.index as usize].pins > 0);
            if wanted && self.page(pid).host_pins > 0 {
                // The host is reading or writing it: retried when that ends.
                i += 1;
                continue;
            }
            if wanted
                && self.page(pid).gpu == Gpu::Absent
                && !matches!(self.page(pid).host, Host::Slot { .. })
            {
                // Not in a slot yet: a fetch is queued or in flight (pump_remote).
                i += 1;
                continue;
            }
            if !wanted || !self.needs_load(pid) {
                // Loaded, loading, being written back (it will be kept), or not wanted.
                self.demand.remove(i);
                continue;
            }
            if !self.may_issue(Direction::HostToDevice, self.page_bytes) {
                return;
            }
            match self.frame_for(pid, None, &mut waiting, now) {
                Got::Frame(frame) if !self.needs_load(pid) => {
                    // Making room sent the page itself out of its slot: load it later.
                    self.free_frames.push(frame);
                    i += 1;
                }
                Got::Frame(frame) => {
                    self.demand.remove(i);
                    self.start_load(pid, frame, false, now);
                }
                Got::Later => i += 1,
                Got::Never => return,
                Got::Slot(_) => unreachable!("frame_for returns frames"),
            }
        }
        let mut i = 0;
        while i < self.plan.len() {
            let (pid, next) = self.plan[i];
            if !self.needs_load(pid) {
                if self.needs_fetch(pid)
                    || self.buffers.get(&pid.buffer).is_some_and(|b| {
                        !b.freed
                            && matches!(
                                b.pages[pid.index as usize].host,
                                Host::Fetching { .. } | Host::Spilling { .. }
                            )
                    })
                {
                    // Being staged from the remote tier: loaded once it is in a slot. Pages
                    // after it wait too, or they would take frames it then has to evict.
                    return;
                } else {
                    self.plan.remove(i);
                }
                continue;
            }
            if !self.may_issue(Direction::HostToDevice, self.page_bytes) {
                return;
            }
            match self.frame_for(pid, Some(next), &mut waiting, now) {
                Got::Frame(frame) if !self.needs_load(pid) => {
                    // Making room sent the page itself out of its slot: load it later.
                    self.free_frames.push(frame);
                    i += 1;
                }
                Got::Frame(frame) => {
                    self.plan.remove(i);
                    self.start_load(pid, frame, true, now);
                }
                Got::Later => i += 1,
                Got::Never => return,
                Got::Slot(_) => unreachable!("frame_for returns frames"),
            }
        }
    }

    /// Recomputes next uses and the prefetch plan from the predictor.
    fn replan(&mut self) {
        self.plan.clear();
        self.next_use.clear();
        let upcoming = self.predictor.upcoming(self.cfg.lookahead_accesses_max);
        for u in &upcoming {
            self.next_use
                .insert(u.buffer, self.accesses + 1 + u.distance);
        }
        for (f, owner) in self.frames.iter().enumerate() {
            self.frame_next_use[f] = owner.and_then(|p| self.next_use.get(&p.buffer).copied());
        }
        let bw = self.bandwidth[0].bytes_per_s;
        let mut queued_bytes = 0u64;
        for u in &upcoming {
            if u.distance >= MIN_LOOKAHEAD_ACCESSES
                && u.time_until.as_secs_f64()
                    > LEAD_FACTOR * queued_bytes as f64 / bw + JITTER_MARGIN.as_secs_f64()
            {
                break;
            }
            let Some(b) = self.buffers.get(&u.buffer).filter(|b| !b.freed) else {
                continue;
            };
            let next = self.accesses + 1 + u.distance;
            for (index, p) in b.pages.iter().enumerate() {
                match p.gpu {
                    Gpu::Absent => {
                        self.plan.push_back((
                            PageId {
                                buffer: u.buffer,
                                index: index as u32,
                            },
                            next,
                        ));
                        queued_bytes += self.page_len(b.bytes, index as u32);
                    }
                    Gpu::Loading { .. } => queued_bytes += self.page_len(b.bytes, index as u32),
                    _ => {}
                }
            }
        }
        self.remote_plan.clear();
        if !self.has_remote() {
            return;
        }
        // Staging remote→host: the same horizon rule, at the remote tier's bandwidth and
        // REMOTE_LEAD_FACTOR.
        let rbw = self.remote_bw.bytes_per_s;
        let mut queued_bytes = 0u64;
        self.remote_horizon = self.accesses;
        for u in &upcoming {
            if u.distance >= MIN_LOOKAHEAD_ACCESSES
                && u.time_until.as_secs_f64()
                    > REMOTE_LEAD_FACTOR * queued_bytes as f64 / rbw + JITTER_MARGIN.as_secs_f64()
            {
                break;
            }
            let Some(b) = self.buffers.get(&u.buffer).filter(|b| !b.freed) else {
                continue;
            };
            let next = self.accesses + 1 + u.distance;
            self.remote_horizon = self.remote_horizon.max(next);
            for (index, p) in b.pages.iter().enumerate() {
                let len = self.page_len(b.bytes, index as u32);
                match p.host {
                    Host::Zero | Host::Remote if p.gpu == Gpu::Absent => {
                        self.remote_plan.push_back((
                            PageId {
                                buffer: u.buffer,
                                index: index as u32,
                            },
                            next,
                        ));
                        queued_bytes += len;
                    }
                    Host::Fetching { .. } => queued_bytes += len,
                    _ => {}
                }
            }
        }
    }

    /// Every page's state, one line each, and the queues: for failure messages of tests.
    pub fn describe_pages(&self) -> String {
        let mut out = String::new();
        let mut ids: Vec<_> = self.buffers.keys().copied().collect();
        ids.sort();
        for id in ids {
            let b = &self.buffers[&id];
            for (i, p) in b.pages.iter().enumerate() {
                out += &format!(
                    "{id:?}/{i} freed={} holders={} host={:?} rs={} gpu={:?} pins={} hp={} inf={} next={:?}\n",
                    b.freed,
                    b.holders(),
                    p.host,
                    p.remote_space,
                    p.gpu,
                    p.pins,
                    p.host_pins,
                    p.in_flight,
                    self.next_use_of(id)
                );
            }
        }
        out += &format!(
            "free_slots={:?} free_frames={:?} spilling={} evicting={} demand={:?} host_demand={:?} remote_pages={}/{}",
            self.free_slots,
            self.free_frames,
            self.spilling,
            self.evicting_frames,
            self.demand,
            self.host_demand,
            self.remote_pages,
            self.remote_pages_max
        );
        out
    }

    /// Counters and gauges now.
    pub fn stats(&self) -> CoreStats {
        CoreStats {
            frames_in_use: (self.frames.len() - self.free_frames.len()) as u64,
            frames_total: self.frames.len() as u64,
            slots_in_use: self.cfg.host_slots() - self.free_slots.len() as u64,
            slots_total: self.cfg.host_slots(),
            buffers: self.buffers.values().filter(|b| !b.freed).count() as u64,
            h2d_bytes_per_s: self.bandwidth[0].bytes_per_s,
            d2h_bytes_per_s: self.bandwidth[1].bytes_per_s,
            remote_pages: self.remote_pages,
            remote_pages_total: self.remote_pages_max,
            remote_bytes_per_s: self.remote_bw.bytes_per_s,
            predictor: self.predictor.stats(),
            ..self.stats
        }
    }

    /// Number of copies and remote ops in flight.
    pub fn transfers_in_flight(&self) -> usize {
        self.transfers.len() + self.remote_ops.len()
    }

    /// Checks every invariant of the module docs; panics with a description if one fails.
    pub fn check_invariants(&self) {
        let total = self.frames.len();
        let used = self.frames.iter().filter(|f| f.is_some()).count();
        assert_eq!(
            used + self.free_frames.len(),
            total,
            "frames in use + free = budget"
        );
        for (i, owner) in self.frames.iter().enumerate() {
            if let Some(pid) = owner {
                let frame = match self.page(*pid).gpu {
                    Gpu::Loading { frame, .. }
                    | Gpu::Resident { frame, .. }
                    | Gpu::Evicting { frame } => frame,
                    Gpu::Absent => panic!("frame {i} owned by absent page {pid}"),
                };
                assert_eq!(frame.0 as usize, i, "frame {i} and its page {pid} agree");
            }
        }
        let mut slots = self.free_slots.len() as u64;
        let mut pinned = 0;
        let mut remote_space = 0;
        for (id, b) in &self.buffers {
            slots += b.pages.iter().filter(|p| p.host.slot().is_some()).count() as u64;
            remote_space += b.pages.iter().filter(|p| p.remote_space).count() as u64;
            for (index, p) in b.pages.iter().enumerate() {
                pinned += u64::from(p.pins > 0);
                if let Gpu::Loading { frame, .. }
                | Gpu::Resident { frame, .. }
                | Gpu::Evicting { frame } = p.gpu
                {
                    let pid = PageId {
                        buffer: *id,
                        index: index as u32,
                    };
                    assert_eq!(
                        self.frames[frame.0 as usize],
                        Some(pid),
                        "{pid} owns its frame"
                    );
                }
                let in_flight = matches!(p.gpu, Gpu::Loading { .. } | Gpu::Evicting { .. })
                    || matches!(p.host, Host::Fetching { .. } | Host::Spilling { .. });
                assert_eq!(
                    in_flight,
                    p.in_flight > 0,
                    "in-flight count of a page matches its state"
                );
                match (p.gpu, p.host) {
                    (Gpu::Absent, _) | (_, Host::Slot { .. }) => {}
                    (Gpu::Resident { .. }, Host::Remote) => assert!(
                        p.remote_space,
                        "a page on the GPU without a slot has its bytes in the remote tier"
                    ),
                    (gpu, host) => panic!("a page {gpu:?} on the GPU needs its slot: {host:?}"),
                }
                if matches!(p.host, Host::Remote | Host::Spilling { .. }) {
                    assert!(p.remote_space, "a remote page has remote space");
                }
            }
        }
        assert_eq!(
            slots,
            self.cfg.host_slots(),
            "slots in use + free = host budget"
        );
        assert_eq!(pinned, self.pinned_pages, "pinned page count");
        assert_eq!(remote_space, self.remote_pages, "remote pages counted");
        assert!(
            self.remote_pages <= self.remote_pages_max,
            "remote pages within the remote budget"
        );
        assert!(
            self.pinned_pages <= total as u64,
            "pinned pages within the budget"
        );
        let mut sums = [0u64; 2];
        for t in self.transfers.values() {
            sums[dir_index(t.direction)] += t.bytes;
        }
        assert_eq!(sums, self.in_flight_bytes, "bytes in flight");
        for (d, max) in [
            self.cfg.h2d_bytes_in_flight_max,
            self.cfg.d2h_bytes_in_flight_max,
        ]
        .into_iter()
        .enumerate()
        {
            let single = self
                .transfers
                .values()
                .filter(|t| dir_index(t.direction) == d)
                .count()
                <= 1;
            assert!(
                single || self.in_flight_bytes[d] <= max,
                "in-flight bound of direction {d}"
            );
        }
    }
}
