//! The pool's state machine: page table, tier accounting, eviction and transfer planning.
//!
//! [`PoolCore`] does no IO and reads no clock: `now` comes in as an argument, work goes
//! out through `poll_*`. It is a facade over rooms with one job each:
//! - `GpuFrames` (the frame table), `HostSlots` (free host slots), the buffers' page
//!   table (`Buffer`, `Page`), `Held` (acquires and the pages they pin);
//! - `Copies` (GPU⇄host copies queued and in flight, mapping changes, measured bandwidth;
//!   logic in `copies.rs`, estimators in `rate.rs`);
//! - `Access` (demand, the plan, the predictor; logic in `plan.rs`);
//! - `RemoteRoom` (the remote tier's accounting, ops, staging plan and spill backoff;
//!   logic in `remote.rs`); the eviction policy; the counters.
//!
//! ## Method groups, in the order a driver calls them
//! 1. **Requests**, each with `now`: [`PoolCore::alloc`], [`PoolCore::free`],
//!    [`PoolCore::begin_acquire`] / [`PoolCore::is_ready`] / [`PoolCore::release`],
//!    [`PoolCore::begin_host_access`] / [`PoolCore::end_host_access`], [`PoolCore::step`].
//! 2. **Work out**, after every call into the core: [`PoolCore::poll_mapping`] (device
//!    mapping changes, before the copies that need them), [`PoolCore::poll_transfer`]
//!    (copies to start), [`PoolCore::poll_remote`] (remote ops), and
//!    [`PoolCore::take_discards`] (remote copies to drop).
//! 3. **Events in**: [`PoolCore::handle_transfer_done`] when a copy finished,
//!    [`PoolCore::handle_remote_done`] when a remote op finished; then step 2 again.
//! 4. **Time**: [`PoolCore::poll_timeout`] says when the core next needs a call if nothing
//!    else happens (a spill backoff ending); the driver calls
//!    [`PoolCore::handle_timeout`] then, and step 2 again.
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
use crate::eviction::{Clock, EvictionPolicy, NextUse};
use crate::predictor::{Predictor, TracePredictor};
use crate::retry::{Backoff, Verdict};

mod check;
mod copies;
mod plan;
mod rate;
mod remote;
mod types;

use rate::{Bandwidth, Throughput};

pub use types::{
    AccessMode, AcquireId, CoreStats, MappingChange, PageLocation, RemoteKind, RemoteTransfer,
    Transfer,
};

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
    /// Why the buffer's contents are gone (a page could not be fetched back): acquires
    /// and host accesses of it fail with this; other buffers go on. It can still be freed.
    lost: Option<CoreError>,
}

impl Buffer {
    fn holders(&self) -> u32 {
        self.shared_holders + u32::from(self.exclusive)
    }

    /// `Err` with why its contents are gone, if they are.
    fn usable(&self) -> Result<(), CoreError> {
        match &self.lost {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
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

fn dir_index(d: Direction) -> usize {
    match d {
        Direction::HostToDevice => 0,
        Direction::DeviceToHost => 1,
    }
}

/// The pool's state machine. See the module docs.
pub struct PoolCore {
    cfg: PoolConfig,
    /// The GPU frame table.
    gpu: GpuFrames,
    /// The host slot table.
    host: HostSlots,
    buffers: HashMap<BufferId, Buffer>,
    /// Copies between the tiers: queued, in flight, and their measured bandwidth.
    copies: Copies,
    /// Ids handed out.
    ids: Ids,
    /// The accesses: what waits, what is planned, what the predictor expects.
    access: Access,
    /// Acquires held and the pages they pin.
    held: Held,
    eviction: Box<dyn EvictionPolicy>,
    stats: CoreStats,
    failed: Option<CoreError>,
    /// The remote tier's accounting, ops and staging plan.
    remote: RemoteRoom,
}

/// The GPU frame table: which page each frame holds, when it is next used, which are free.
struct GpuFrames {
    frames: Vec<Option<PageId>>,
    frame_next_use: Vec<Option<u64>>,
    free_frames: Vec<FrameId>,
    /// Frames whose page is being written back (they come free when the copy lands).
    evicting_frames: u64,
}

/// The host slot table: the free slots (a slot's page is in the page table).
struct HostSlots {
    free_slots: Vec<HostSlot>,
}

/// Copies between GPU and host: in flight, queued for the driver, mapping changes, and
/// the bandwidth measured per direction.
struct Copies {
    transfers: HashMap<TransferId, InFlight>,
    out: VecDeque<Transfer>,
    mappings: VecDeque<MappingChange>,
    in_flight_bytes: [u64; 2],
    bandwidth: [Bandwidth; 2],
}

/// Ids handed out so far.
struct Ids {
    next_buffer: u64,
    next_transfer: u64,
    next_acquire: u64,
}

/// The access stream: demand loads waiting, the plan of upcoming loads, each buffer's
/// next predicted use, accesses counted this step, and the predictor.
struct Access {
    demand: VecDeque<PageId>,
    plan: VecDeque<(PageId, u64)>,
    next_use: HashMap<BufferId, u64>,
    accesses: u64,
    predictor: Box<dyn Predictor>,
}

/// Acquires held, and the pages they pin (bounded by the frames).
struct Held {
    acquires: HashMap<AcquireId, Acquire>,
    pinned_pages: u64,
}

/// The remote tier as the core accounts for it (see the module docs).
struct RemoteRoom {
    /// Pages the remote tier may hold, and holds.
    remote_pages_max: u64,
    remote_pages: u64,
    remote_ops: HashMap<TransferId, RemoteInFlight>,
    remote_out: VecDeque<RemoteTransfer>,
    remote_in_flight_bytes: [u64; 2],
    remote_bw: Throughput,
    spilling: u64,
    /// Backoff of spills after the remote tier refused one (back-pressure, not a spin).
    spill_retry: Backoff,
    /// Pages a host access waits for (they must come into a slot first).
    host_demand: VecDeque<PageId>,
    remote_plan: VecDeque<(PageId, u64)>,
    discards: Vec<PageId>,
    /// The furthest access the last plan stages for: pages used by then are not spilled
    /// ahead of need.
    remote_horizon: u64,
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
            gpu: GpuFrames {
                frames: vec![None; frames as usize],
                frame_next_use: vec![None; frames as usize],
                free_frames: (0..frames).rev().map(FrameId).collect(),
                evicting_frames: 0,
            },
            host: HostSlots {
                free_slots: (0..slots).rev().map(HostSlot).collect(),
            },
            buffers: HashMap::new(),
            copies: Copies {
                transfers: HashMap::new(),
                out: VecDeque::new(),
                mappings: VecDeque::new(),
                in_flight_bytes: [0; 2],
                bandwidth: [bw; 2],
            },
            ids: Ids {
                next_buffer: 1,
                next_transfer: 1,
                next_acquire: 1,
            },
            access: Access {
                demand: VecDeque::new(),
                plan: VecDeque::new(),
                next_use: HashMap::new(),
                accesses: 0,
                predictor: Box::new(TracePredictor::new(cfg.history_steps)),
            },
            held: Held {
                acquires: HashMap::new(),
                pinned_pages: 0,
            },
            eviction,
            stats: CoreStats::default(),
            failed: None,
            remote: RemoteRoom {
                remote_pages_max: cfg.remote_pages(),
                remote_pages: 0,
                remote_ops: HashMap::new(),
                remote_out: VecDeque::new(),
                remote_in_flight_bytes: [0; 2],
                remote_bw: Throughput::new(1e9),
                spilling: 0,
                spill_retry: Backoff::new(SPILL_RETRY_MIN, SPILL_RETRY_MAX, SPILL_DEADLINE),
                host_demand: VecDeque::new(),
                remote_plan: VecDeque::new(),
                discards: Vec::new(),
                remote_horizon: 0,
            },
            cfg,
        })
    }

    /// Bytes of one page.
    fn page_bytes(&self) -> u64 {
        self.cfg.page_size.bytes()
    }

    /// Replaces the bandwidth estimate of both directions with a first guess (a device's
    /// hint), until copies are measured.
    pub fn set_bandwidth_hint(&mut self, bytes_per_s: f64) {
        for bw in &mut self.copies.bandwidth {
            bw.bytes_per_s = bytes_per_s.max(1e6);
        }
    }

    /// Replaces the remote tier's bandwidth estimate with a first guess, until remote
    /// ops are measured.
    pub fn set_remote_bandwidth_hint(&mut self, bytes_per_s: f64) {
        self.remote.remote_bw.bytes_per_s = bytes_per_s.max(1e6);
    }

    /// Whether the pool has a remote tier.
    pub fn has_remote(&self) -> bool {
        self.remote.remote_pages_max > 0
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
        (bytes - u64::from(index) * self.page_bytes()).min(self.page_bytes())
    }

    fn live(&self, id: BufferId) -> Result<&Buffer, CoreError> {
        match self.buffers.get(&id) {
            Some(b) if !b.freed => Ok(b),
            Some(_) => Err(CoreError::Freed(id)),
            None if id.0 > 0 && id.0 < self.ids.next_buffer => Err(CoreError::Freed(id)),
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
        let pages = bytes.div_ceil(self.page_bytes());
        if pages > self.gpu.frames.len() as u64 || pages > limits::PAGES_PER_BUFFER_MAX {
            return Err(CoreError::BufferTooLarge {
                requested_bytes: bytes,
                pages,
                budget_bytes: self.gpu.frames.len() as u64 * self.page_bytes(),
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
        let id = BufferId(self.ids.next_buffer);
        self.ids.next_buffer += 1;
        let remote = self.has_remote();
        let pages = (0..pages)
            .map(|_| Page {
                // Without a remote tier every page has its slot for life (the driver
                // zero-fills it); with one, a page gets a slot when it is first needed.
                host: if remote {
                    Host::Zero
                } else {
                    Host::Slot {
                        slot: self.host.free_slots.pop().expect("counted"),
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
                last_access: self.access.accesses,
                shared_holders: 0,
                exclusive: false,
                freed: false,
                lost: None,
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
            self.cfg.host_slots() + self.remote.remote_pages_max - limits::REMOTE_HEADROOM_PAGES
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
                self.host.free_slots.push(slot);
            }
            if p.remote_space {
                self.remote.remote_pages -= 1;
                self.remote.discards.push(PageId {
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
        debug_assert_eq!(self.gpu.frames[frame.0 as usize], Some(pid));
        self.gpu.frames[frame.0 as usize] = None;
        self.gpu.frame_next_use[frame.0 as usize] = None;
        self.eviction.on_free(frame);
        self.gpu.free_frames.push(frame);
        self.copies
            .mappings
            .push_back(MappingChange::Unmap { page: pid });
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
        b.usable()?;
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
        if self.held.pinned_pages + newly > self.gpu.frames.len() as u64 {
            return Err(CoreError::HeldAcquiresExceedBudget {
                buffer: id,
                held_bytes: self.held.pinned_pages * self.page_bytes(),
                requested_bytes: newly * self.page_bytes(),
                budget_bytes: self.gpu.frames.len() as u64 * self.page_bytes(),
            });
        }
        self.access.accesses += 1;
        if self.cfg.policy == Policy::Learned {
            self.access.predictor.on_access(id, now);
        }
        self.held.pinned_pages += newly;
        let b = self.buffers.get_mut(&id).expect("live");
        b.last_access = self.access.accesses;
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
                    self.access.demand.push_back(PageId { buffer: id, index });
                }
            }
        }
        self.stats.acquires += 1;
        self.stats.hits += u64::from(hit);
        let acquire = AcquireId(self.ids.next_acquire);
        self.ids.next_acquire += 1;
        self.held
            .acquires
            .insert(acquire, Acquire { buffer: id, mode });
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
            .held
            .acquires
            .get(&acquire)
            .expect("acquire ids come from begin_acquire");
        let b = &self.buffers[&a.buffer];
        b.usable()?;
        Ok(b.pages
            .iter()
            .all(|p| matches!(p.gpu, Gpu::Resident { .. })))
    }

    /// The frames of a ready acquire's pages, in page order.
    pub fn frames_of(&self, acquire: AcquireId) -> Vec<FrameId> {
        let a = self
            .held
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
            .held
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
        self.held.pinned_pages -= unpinned;
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
            self.access.predictor.end_step(now);
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
        now: Duration,
    ) -> Result<Option<Vec<PageLocation>>, CoreError> {
        let b = self.live(id)?;
        b.usable()?;
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
            (offset / self.page_bytes()) as usize,
            ((offset + len - 1) / self.page_bytes()) as usize,
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
                if !self.remote.host_demand.contains(&pid) {
                    self.remote.host_demand.push_back(pid);
                }
            }
            self.pump(now);
            return Ok(None);
        }
        if !self.remote.host_demand.is_empty() {
            self.remote.host_demand.retain(|p| {
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
        let page_bytes = self.page_bytes();
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
        self.remote.spill_retry.retry_at()
    }

    /// The instant of [`PoolCore::poll_timeout`] has come: starts what waited for it.
    pub fn handle_timeout(&mut self, now: Duration) {
        self.pump(now);
    }

    /// The next copy to start, if any.
    pub fn poll_transfer(&mut self) -> Option<Transfer> {
        self.copies.out.pop_front()
    }

    /// The next change to device address ranges, if any.
    pub fn poll_mapping(&mut self) -> Option<MappingChange> {
        self.copies.mappings.pop_front()
    }

    /// The next remote op (or zero fill) to start, if any.
    pub fn poll_remote(&mut self) -> Option<RemoteTransfer> {
        self.remote.remote_out.pop_front()
    }

    /// Pages whose remote copies are no longer needed (their buffers were freed): the
    /// driver tells the remote tier to drop them.
    pub fn take_discards(&mut self) -> Vec<PageId> {
        std::mem::take(&mut self.remote.discards)
    }

    /// Counters and gauges now.
    pub fn stats(&self) -> CoreStats {
        CoreStats {
            frames_in_use: (self.gpu.frames.len() - self.gpu.free_frames.len()) as u64,
            frames_total: self.gpu.frames.len() as u64,
            slots_in_use: self.cfg.host_slots() - self.host.free_slots.len() as u64,
            slots_total: self.cfg.host_slots(),
            buffers: self.buffers.values().filter(|b| !b.freed).count() as u64,
            h2d_bytes_per_s: self.copies.bandwidth[0].bytes_per_s,
            d2h_bytes_per_s: self.copies.bandwidth[1].bytes_per_s,
            remote_pages: self.remote.remote_pages,
            remote_pages_total: self.remote.remote_pages_max,
            remote_bytes_per_s: self.remote.remote_bw.bytes_per_s,
            predictor: self.access.predictor.stats(),
            ..self.stats
        }
    }

    /// Number of copies and remote ops in flight.
    pub fn transfers_in_flight(&self) -> usize {
        self.copies.transfers.len() + self.remote.remote_ops.len()
    }
}
