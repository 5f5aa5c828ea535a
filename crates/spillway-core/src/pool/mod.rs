//! The pool's state machine: page table, tier accounting, eviction and transfer planning.
//!
//! [`PoolCore`] does no IO and reads no clock: `now` comes in as an argument, work goes
//! out through `poll_*`. It is a thin facade over rooms with one job each, in the shape
//! of `quinn-proto`'s `Connection`:
//! - `PageTable` (`pages.rs`): every buffer's pages and where each page is;
//! - `GpuFrames` and `HostSlots` (`frames.rs`): the frame table (owner and next use of
//!   each frame, free frames, and the frames a peer GPU lends: `PeerFrames`, `peer.rs`)
//!   and the slot table (free slots, zero fills queued);
//! - `Copies` (`copies.rs`): GPU⇄host copies in flight and queued, mapping changes, the
//!   bandwidth measured per direction (`Bandwidth`, `rate.rs`);
//! - `RemoteAccount` (`remote.rs`): the remote tier's pages, ops, bytes in flight,
//!   throughput (`Throughput`, `rate.rs`) and spill backoff;
//! - `Access` (`plan.rs`): demand per tier, the predictor, next uses, and one `TierPlan`
//!   per tier (the same horizon rule for loads and for staging);
//! - the [`EvictionPolicy`], which owns its records and picks the victims of both tiers;
//! - `Held` (acquires and the pages they pin), `Ids`, and the counters ([`CoreStats`]).
//!
//! The moves that span rooms are the facade's: the GPU tier's in `gpu.rs` (loads,
//! write-backs, frames for loads), the host tier's in `host.rs` (fetches, zero fills,
//! spills, slots for fetches), and one loop that brings queued pages into either tier
//! in `pump.rs`.
//!
//! ## Method groups, in the order a driver calls them
//! 1. **Requests**, each with `now`: [`PoolCore::alloc`], [`PoolCore::free`],
//!    [`PoolCore::begin_acquire`] / [`PoolCore::is_ready`] / [`PoolCore::release`],
//!    [`PoolCore::begin_host_access`] / [`PoolCore::end_host_access`], [`PoolCore::step`].
//! 2. **Work out**, after every call into the core, in this order:
//!    [`PoolCore::poll_zero_fill`] (slots to zero; done before anything below reads
//!    them), [`PoolCore::poll_mapping`] (device mapping changes, before the copies that
//!    need them), [`PoolCore::poll_transfer`] (copies to start), [`PoolCore::poll_remote`]
//!    (remote ops), and [`PoolCore::take_discards`] (remote copies to drop).
//! 3. **Events in**: [`PoolCore::handle_transfer_done`] when a copy finished (or
//!    [`PoolCore::handle_transfers_done`] for several that finished together),
//!    [`PoolCore::handle_remote_done`] when a remote op finished,
//!    [`PoolCore::handle_zero_fill_failed`] if a zero fill failed; then step 2 again.
//! 4. **Time**: [`PoolCore::poll_timeout`] says when the core next needs a call if nothing
//!    else happens (a spill backoff ending); the driver calls
//!    [`PoolCore::handle_timeout`] then, and step 2 again.
//!
//! ## The data path of one acquire
//! `begin_acquire` pins the buffer's pages and puts those not on the GPU in the GPU
//! demand; `pump` then, for the host tier, fetches demanded pages that are not in a slot
//! (`slot_for` frees one by the policy's host victim: dropped if the remote tier holds
//! its bytes, else spilled) and, for the GPU tier, loads demanded pages in slots
//! (`frame_for` frees a frame by the policy's victim: dropped if clean, else written
//! back). The driver runs what `poll_*` hands out and reports completions; each
//! completion pumps again, until every page is resident and `is_ready` says so. Under
//! [`Policy::Learned`] the same pass then starts the planned prefetches of both tiers.
//! [`PoolCore::begin_acquire_discard`] (the holder overwrites every byte) puts its absent
//! pages in the same demand marked `overwrite`: `pump` gives them frames and no copy, no
//! tier fetches or plans them, and they are dirty at once (host and remote copies stale).
//!
//! ## Pages and tiers
//! The host tier is *inclusive*: every page of every buffer has a host slot from `alloc`
//! to `free`, so a page whose GPU copy is clean leaves the GPU without a copy. A page's
//! GPU state is one of `Absent`, `Loading` (host→device or peer→device copy in flight),
//! `Resident` (clean or dirty) and `Evicting` (device→host copy of a dirty page, or
//! device→peer copy of a clean one, in flight).
//!
//! ## The remote tier
//! With a remote budget (`remote_budget_bytes > 0`), the host tier becomes a cache of
//! the pool's pages too: a page's host state is `Zero` (never written, no slot), `Remote`
//! (only the remote tier has it), `Fetching` (coming into a slot from the remote tier),
//! `Slot` (in a slot; `clean` when the remote tier holds the same bytes) or `Spilling`
//! (being copied to the remote tier). A `Zero` page that needs a slot gets one at once,
//! zero-filled by the driver ([`PoolCore::poll_zero_fill`]). A page on the GPU (or in
//! flight to or from it) keeps its slot, so mostly pages off the GPU leave the host; when
//! none can, a page on the GPU whose slot holds the same bytes as the remote tier gives
//! its slot up (the host copy was a third copy; the page gets a slot again if it is
//! written and evicted). A demand that finds every slot held by GPU pages takes a page
//! off the GPU. A slot is had by dropping a clean page (no copy) or spilling one, as the
//! eviction policy chooses (furthest next use first, least recently used without a
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
//! - a page's copy on the peer GPU (`peer.rs`) holds its current bytes: the page is not
//!   dirty and has its slot; peer frames in use are the pages with a copy, and no copy
//!   starts on a frame above the count lent ([`PoolCore::set_peer_frames`]).
//!
//! ## Planning
//! Demand loads (pages of a pending acquire) go first. Under [`Policy::Learned`] the
//! planner then walks the predictor's upcoming accesses, nearest first, and queues loads
//! of absent pages while (a) the access is within the lookahead horizon: the first
//! [`MIN_LOOKAHEAD_ACCESSES`] accesses always, later ones while the predicted time until
//! them is below [`LEAD_FACTOR`] times the time the copies queued so far will take at
//! the measured bandwidth (or the time the GPU budget takes to fill at it, if longer),
//! plus [`JITTER_MARGIN`]; and (b) a frame can be had without evicting a page whose next
//! use is sooner than the incoming page's. Eviction is by next use (furthest first).

use std::time::Duration;

use spillway_types::config::{ConfigError, Policy, PoolConfig};
use spillway_types::{BufferId, CopyOp, Direction, FrameId, PageId, TransferId, limits};

use crate::error::CoreError;
use crate::eviction::{Clock, EvictionPolicy, NextUse};
use crate::predictor::OrderPredictor;

mod check;
mod copies;
mod frames;
mod gpu;
mod host;
mod overwrite;
mod pages;
mod peer;
mod plan;
mod pump;
mod rate;
mod remote;
mod types;

use copies::Copies;
use frames::{GpuFrames, HostSlots};
use pages::{Gpu, Host, Page, PageTable};
use plan::Access;
use remote::RemoteAccount;

pub use rate::{BANDWIDTH_MIN_BYTES_PER_S, REMOTE_BANDWIDTH_GUESS_BYTES_PER_S};
pub use types::{
    AccessMode, AcquireId, CoreStats, MappingChange, PageLocation, RemoteOp, RemoteOpKind, ZeroFill,
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
/// Speculation's cap (issue 12): a plan loads a guess (a prediction of probability `p`
/// below 1, which the predictor bounds by its measured precision) only while the
/// expected unused bytes of the guesses planned, the sum of `(1 - p) x bytes`, stay
/// within this share of the bytes of the sure predictions planned so far (at least those
/// of the next `MIN_LOOKAHEAD_ACCESSES`), plus one page. A runaway stop, not the bound
/// that usually binds: the bandwidth horizon counts the guesses' bytes and the eviction
/// bound keeps a guess from displacing a page needed sooner. At 0.25 batch-1 MoE steps
/// stalled on the experts no guess brought (DESIGN, "The cap raised to 4").
pub const SPECULATION_WASTE_RATIO: f64 = 4.0;
/// First wait before a spill is tried again after the remote tier refused one: 10 ms.
pub const SPILL_RETRY_MIN: Duration = Duration::from_millis(10);
/// Longest wait between spill attempts: 1 s.
pub const SPILL_RETRY_MAX: Duration = Duration::from_secs(1);
/// Spills failing this long without one success fail the pool: 120 s (longer than the
/// node's peer grace, so a paused peer costs a stall, not the job).
pub const SPILL_DEADLINE: Duration = Duration::from_secs(120);
/// Under the learned policy, one in this many of the slots not holding GPU pages is kept
/// free (or coming free) ahead of need: a quarter. More spills pages that may come back
/// sooner; fewer makes staging wait for a spill's round trip.
pub const SPILL_AHEAD_DIVISOR: u64 = 4;

/// One acquire held.
#[derive(Debug, Clone, Copy)]
struct Acquire {
    buffer: BufferId,
    mode: AccessMode,
}

/// Acquires held, and the pages they pin (bounded by the frames).
#[derive(Debug, Default)]
struct Held {
    acquires: crate::idmap::IdMap<AcquireId, Acquire>,
    pinned_pages: u64,
    next_acquire: u64,
}

impl Held {
    /// Records an acquire of `buffer` pinning `newly` more pages; returns its id.
    fn insert(&mut self, buffer: BufferId, mode: AccessMode, newly: u64) -> AcquireId {
        self.next_acquire += 1;
        let id = AcquireId(self.next_acquire);
        self.acquires.insert(id, Acquire { buffer, mode });
        self.pinned_pages += newly;
        id
    }

    fn get(&self, id: AcquireId) -> Acquire {
        *self
            .acquires
            .get(&id)
            .expect("acquire ids come from begin_acquire")
    }
}

/// Ids of copies and remote ops handed out (one space: a completion names one op).
#[derive(Debug, Default)]
struct Ids {
    last_transfer: u64,
}

impl Ids {
    fn transfer(&mut self) -> TransferId {
        self.last_transfer += 1;
        TransferId(self.last_transfer)
    }
}

/// The pool's state machine. See the module docs.
pub struct PoolCore {
    cfg: PoolConfig,
    pages: PageTable,
    gpu: GpuFrames,
    host: HostSlots,
    copies: Copies,
    remote: RemoteAccount,
    access: Access,
    held: Held,
    eviction: Box<dyn EvictionPolicy>,
    ids: Ids,
    stats: CoreStats,
    /// Why the whole pool failed (a device copy failed, spills failed past their
    /// deadline, the remote tier's link is gone): every later acquire and host access
    /// reports it. A lost page is not a reason: it loses only its buffer.
    failed: Option<CoreError>,
}

impl std::fmt::Debug for PoolCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolCore")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// # Setup and queries
impl PoolCore {
    /// A pool for `cfg` (validated here). `bandwidth_hint_bytes_per_s` seeds the copy
    /// bandwidth estimate until copies are measured.
    pub fn new(cfg: PoolConfig, bandwidth_hint_bytes_per_s: f64) -> Result<PoolCore, ConfigError> {
        cfg.validate()?;
        let frames = cfg.gpu_frames() as u32;
        let eviction: Box<dyn EvictionPolicy> = match cfg.policy {
            Policy::Learned => Box::new(NextUse::new(frames)),
            Policy::Clock | Policy::OnDemand => Box::new(Clock::new(frames)),
        };
        Ok(PoolCore {
            pages: PageTable::new(cfg.page_size.bytes()),
            gpu: GpuFrames::new(frames),
            host: HostSlots::new(cfg.host_slots() as u32),
            copies: Copies::new(
                cfg.h2d_bytes_in_flight_max,
                cfg.d2h_bytes_in_flight_max,
                bandwidth_hint_bytes_per_s,
            ),
            remote: RemoteAccount::new(
                cfg.remote_pages(),
                cfg.remote_bytes_in_flight_max,
                REMOTE_BANDWIDTH_GUESS_BYTES_PER_S,
            ),
            access: Access::new(
                Box::new(OrderPredictor::new(cfg.history_steps)),
                cfg.policy == Policy::Learned,
                cfg.gpu_frames() * cfg.page_size.bytes(),
            ),
            held: Held::default(),
            eviction,
            ids: Ids::default(),
            stats: CoreStats::default(),
            failed: None,
            cfg,
        })
    }

    /// Replaces the bandwidth estimate of both directions with a first guess (a device's
    /// hint), until copies are measured.
    pub fn set_bandwidth_hint(&mut self, bytes_per_s: f64) {
        self.copies.set_bandwidth_hint(bytes_per_s);
    }

    /// Replaces the remote tier's bandwidth estimate with a first guess, until remote
    /// ops are measured.
    pub fn set_remote_bandwidth_hint(&mut self, bytes_per_s: f64) {
        self.remote.set_bandwidth_hint(bytes_per_s);
    }

    /// Whether the pool has a remote tier.
    pub fn has_remote(&self) -> bool {
        self.remote.enabled()
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// Size of a live buffer in bytes.
    pub fn buffer_bytes(&self, id: BufferId) -> Result<u64, CoreError> {
        Ok(self.pages.live(id)?.bytes)
    }

    /// Counters and gauges now.
    pub fn stats(&self) -> CoreStats {
        CoreStats {
            frames_in_use: self.gpu.in_use(),
            frames_total: self.gpu.total(),
            slots_in_use: self.host.total() - self.host.free(),
            slots_total: self.host.total(),
            buffers: self.pages.iter().filter(|(_, b)| !b.freed).count() as u64,
            h2d_bytes_per_s: self.copies.bytes_per_s(Direction::HostToDevice),
            d2h_bytes_per_s: self.copies.bytes_per_s(Direction::DeviceToHost),
            remote_pages: self.remote.pages(),
            remote_pages_total: self.remote.pages_max(),
            remote_bytes_per_s: self.remote.bytes_per_s(),
            peer_frames_in_use: self.gpu.peer.in_use(),
            peer_frames_total: u64::from(self.gpu.peer.limit()),
            predictor: self.access.predictor_stats(),
            ..self.stats
        }
    }

    /// Number of copies and remote ops in flight.
    pub fn transfers_in_flight(&self) -> usize {
        self.copies.len() + self.remote.len()
    }
}

/// # Requests (group 1 of the module docs)
impl PoolCore {
    /// Registers a buffer of `bytes`; its pages start in the host tier, zero-filled.
    pub fn alloc(&mut self, bytes: u64) -> Result<BufferId, CoreError> {
        if bytes == 0 {
            return Err(CoreError::EmptyBuffer);
        }
        let page_bytes = self.pages.page_bytes();
        let pages = bytes.div_ceil(page_bytes);
        if pages > self.gpu.total() || pages > limits::PAGES_PER_BUFFER_MAX {
            return Err(CoreError::BufferTooLarge {
                requested_bytes: bytes,
                pages,
                budget_bytes: self.gpu.total() * page_bytes,
            });
        }
        if self.pages.len() >= limits::BUFFERS_MAX {
            return Err(CoreError::TooManyBuffers {
                limit: limits::BUFFERS_MAX,
            });
        }
        let total_pages = self.capacity_pages();
        let free_pages = total_pages.saturating_sub(self.pages.committed_pages());
        if free_pages < pages {
            return Err(CoreError::PoolFull {
                requested_bytes: bytes,
                needed_pages: pages,
                free_pages,
                total_pages,
            });
        }
        // Without a remote tier every page has its slot for life (the driver zero-fills
        // it); with one, a page gets a slot when it is first needed.
        let remote = self.remote.enabled();
        let pages = (0..pages)
            .map(|_| Page::new((!remote).then(|| self.host.take().expect("counted"))))
            .collect();
        let id = self.pages.insert(bytes, pages);
        self.eviction.on_buffer_use(id, self.access.accesses());
        Ok(id)
    }

    /// Frees a buffer. Its frames and slots are given back at once, or when copies in
    /// flight for it finish.
    pub fn free(&mut self, id: BufferId, now: Duration) -> Result<(), CoreError> {
        let b = self.pages.live(id)?;
        let holders = b.holders() + b.pages.iter().map(|p| p.host_pins).sum::<u32>();
        if holders > 0 {
            return Err(CoreError::BufferHeld {
                buffer: id,
                holders,
            });
        }
        let b = self.pages.buffer_mut(id);
        b.freed = true;
        let resident: Vec<(PageId, FrameId)> = (0..b.pages.len() as u32)
            .filter_map(|index| match b.pages[index as usize].gpu {
                Gpu::Resident { frame, .. } => Some((PageId { buffer: id, index }, frame)),
                _ => None,
            })
            .collect();
        for (pid, frame) in resident {
            self.release_frame(pid, frame);
        }
        self.eviction.on_buffer_free(id);
        self.reap(id);
        self.pump(now);
        Ok(())
    }

    /// Starts an acquire of `id`: pins its pages and queues loads of those not resident.
    /// Returns the acquire and whether it is a hit (every page already resident).
    pub fn begin_acquire(
        &mut self,
        id: BufferId,
        mode: AccessMode,
        now: Duration,
    ) -> Result<(AcquireId, bool), CoreError> {
        self.acquire_as(id, mode, false, now)
    }

    /// Starts an exclusive acquire of `id` that discards its contents (the holder
    /// overwrites every byte): pages not on the GPU get frames without a load, whatever
    /// tier holds their bytes, and are dirty at once; their host and remote copies are
    /// stale (the remote copy is dropped, [`PoolCore::take_discards`]). The frames' bytes
    /// are undefined until the holder writes them (no zero fill: the point is moving
    /// nothing). A page the host is reading or that is in flight is loaded as usual.
    /// The hit flag is true when no page needs a load (a frame may still come free
    /// only after a write-back).
    pub fn begin_acquire_discard(
        &mut self,
        id: BufferId,
        now: Duration,
    ) -> Result<(AcquireId, bool), CoreError> {
        self.acquire_as(id, AccessMode::Exclusive, true, now)
    }

    fn acquire_as(
        &mut self,
        id: BufferId,
        mode: AccessMode,
        discard: bool,
        now: Duration,
    ) -> Result<(AcquireId, bool), CoreError> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let b = self.pages.live(id)?;
        b.usable()?;
        let busy = match mode {
            AccessMode::Exclusive if b.holders() > 0 => true,
            AccessMode::Shared => b.exclusive,
            AccessMode::Exclusive => false,
        };
        if busy {
            return Err(CoreError::BufferBusy {
                buffer: id,
                mode: held_as(b.exclusive),
            });
        }
        let newly = b.pages.iter().filter(|p| p.pins == 0).count() as u64;
        if self.held.pinned_pages + newly > self.gpu.total() {
            let page_bytes = self.pages.page_bytes();
            return Err(CoreError::HeldAcquiresExceedBudget {
                buffer: id,
                held_bytes: self.held.pinned_pages * page_bytes,
                requested_bytes: newly * page_bytes,
                budget_bytes: self.gpu.total() * page_bytes,
            });
        }
        self.access.on_access(id, discard, now);
        self.eviction.on_buffer_use(id, self.access.accesses());
        let b = self.pages.buffer_mut(id);
        match mode {
            AccessMode::Shared => b.shared_holders += 1,
            AccessMode::Exclusive => b.exclusive = true,
        }
        let mut hit = true;
        // Frames reserved for an overwrite this acquire does not do: given up, and the
        // pages loaded as usual.
        if !discard {
            let all = 0..b.pages.len();
            self.unreserve_pages(id, all);
        }
        let b = self.pages.buffer_mut(id);
        for index in 0..b.pages.len() as u32 {
            let page = &mut b.pages[index as usize];
            page.pins += 1;
            // A reserved frame is the page's now: the holder overwrites it.
            if page.reserved {
                page.reserved = false;
                self.stats.overwrites += 1;
            }
            match &mut page.gpu {
                Gpu::Resident {
                    frame,
                    unused_prefetch,
                    ..
                } => {
                    if discard && *unused_prefetch {
                        // Prefetched, and its bytes are about to be overwritten.
                        self.stats.prefetch_wasted += 1;
                    }
                    *unused_prefetch = false;
                    self.eviction.on_access(*frame);
                }
                Gpu::Absent if discard && page.in_flight == 0 && page.host_pins == 0 => {
                    page.overwrite = true;
                    self.access.demand.push_back(PageId { buffer: id, index });
                }
                _ => {
                    hit = false;
                    self.access.demand.push_back(PageId { buffer: id, index });
                }
            }
        }
        self.stats.on_acquire(hit);
        let acquire = self.held.insert(id, mode, newly);
        self.replan();
        self.pump(now);
        Ok((acquire, hit))
    }

    /// Whether every page of the acquire is resident (its frames may be used).
    pub fn is_ready(&self, acquire: AcquireId) -> Result<bool, CoreError> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let b = self
            .pages
            .get(self.held.get(acquire).buffer)
            .expect("held buffers cannot be freed");
        b.usable()?;
        Ok(b.pages
            .iter()
            .all(|p| matches!(p.gpu, Gpu::Resident { .. })))
    }

    /// The frames of a ready acquire's pages, in page order.
    pub fn frames_of(&self, acquire: AcquireId) -> Vec<FrameId> {
        self.pages
            .get(self.held.get(acquire).buffer)
            .expect("held buffers cannot be freed")
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
        let a = self.held.get(acquire);
        self.held.acquires.remove(&acquire);
        let on_demand = self.cfg.policy == Policy::OnDemand;
        let b = self.pages.buffer_mut(a.buffer);
        match a.mode {
            AccessMode::Shared => b.shared_holders -= 1,
            AccessMode::Exclusive => b.exclusive = false,
        }
        let mut unpinned = 0;
        let mut drop_now = Vec::new();
        let pages = b.pages.len();
        for (index, page) in b.pages.iter_mut().enumerate() {
            page.pins -= 1;
            // Released before its frame came: nothing was overwritten.
            page.overwrite = false;
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
        if a.mode == AccessMode::Exclusive {
            // Its bytes may have changed: a copy on the peer is stale.
            self.drop_peer_copies(a.buffer, 0..pages);
        }
        for index in drop_now {
            let pid = PageId {
                buffer: a.buffer,
                index,
            };
            self.evict(pid, peer::PeerFill::Keeping(pid), now);
        }
        self.pump(now);
    }

    /// Marks the end of a step (an iteration of the job).
    pub fn step(&mut self, now: Duration) {
        self.stats.steps += 1;
        self.access.end_step(now);
        self.replan();
        self.pump(now);
    }

    /// Begins a host read or write of `len` bytes at `offset`: returns `None` while a
    /// page of the range is in flight or not in the host tier (run the work the core
    /// queued, wait for a completion, and ask again), else the location of each page of
    /// the range, which stay put until [`PoolCore::end_host_access`].
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
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let b = self.pages.live(id)?;
        b.usable()?;
        if b.exclusive || (write && b.holders() > 0) {
            return Err(CoreError::BufferBusy {
                buffer: id,
                mode: held_as(b.exclusive),
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
        let range = self.page_range(offset, len);
        // A frame reserved for a predicted overwrite does not hold the page's bytes: the
        // host reads and writes them where they are.
        self.unreserve_pages(id, range.clone());
        let b = self.pages.live(id)?;
        if b.pages[range.clone()].iter().any(|p| p.in_flight > 0) {
            return Ok(None);
        }
        let away: Vec<PageId> = range
            .clone()
            .filter(|&i| b.pages[i].gpu == Gpu::Absent && b.pages[i].host.away())
            .map(|i| PageId {
                buffer: id,
                index: i as u32,
            })
            .collect();
        if !away.is_empty() {
            // Not in the host tier: bring the pages into slots first.
            for pid in away {
                if !self.access.host_waits_for(pid) {
                    self.access.host_demand.push_back(pid);
                }
            }
            self.pump(now);
            return Ok(None);
        }
        self.access
            .host_demand
            .retain(|p| p.buffer != id || !range.contains(&(p.index as usize)));
        if write {
            // The host changes the bytes: a copy on the peer is stale.
            self.drop_peer_copies(id, range.clone());
        }
        let b = self.pages.buffer_mut(id);
        let mut out = Vec::with_capacity(range.len());
        for p in &mut b.pages[range] {
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
        let range = self.page_range(offset, len);
        for p in &mut self.pages.buffer_mut(id).pages[range] {
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
}

/// # Work out (group 2) and time (group 4)
impl PoolCore {
    /// The next slot to fill with zeros (a page never written came into it), if any. The
    /// driver zeroes every slot polled here before it starts anything else it polls.
    pub fn poll_zero_fill(&mut self) -> Option<ZeroFill> {
        self.host.poll_zero_fill()
    }

    /// The next change to device address ranges, if any.
    pub fn poll_mapping(&mut self) -> Option<MappingChange> {
        self.copies.poll_mapping()
    }

    /// The next copy to start, if any.
    pub fn poll_transfer(&mut self) -> Option<CopyOp> {
        self.copies.poll()
    }

    /// The next remote op to start, if any.
    pub fn poll_remote(&mut self) -> Option<RemoteOp> {
        self.remote.poll()
    }

    /// Pages whose remote copies are no longer needed (their buffers were freed): the
    /// driver tells the remote tier to drop them.
    pub fn take_discards(&mut self) -> Vec<PageId> {
        self.remote.take_discards()
    }

    /// When the driver must call [`PoolCore::handle_timeout`] if nothing else happens
    /// first: the end of a spill backoff. `None`: no timer is armed.
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.failed.is_some() {
            return None;
        }
        self.remote.retry_at()
    }

    /// The instant of [`PoolCore::poll_timeout`] has come: starts what waited for it.
    pub fn handle_timeout(&mut self, now: Duration) {
        self.pump(now);
    }
}

/// How a busy buffer is held, for [`CoreError::BufferBusy`].
fn held_as(exclusive: bool) -> AccessMode {
    if exclusive {
        AccessMode::Exclusive
    } else {
        AccessMode::Shared
    }
}

impl PoolCore {
    /// Pages the pool can hold: the host slots, plus the remote pages less the headroom.
    fn capacity_pages(&self) -> u64 {
        if self.remote.enabled() {
            self.host.total() + self.remote.pages_max() - limits::REMOTE_HEADROOM_PAGES
        } else {
            self.host.total()
        }
    }

    /// The indices of the pages of `[offset, offset + len)` (`len > 0`).
    fn page_range(&self, offset: u64, len: u64) -> std::ops::Range<usize> {
        let page_bytes = self.pages.page_bytes();
        (offset / page_bytes) as usize..((offset + len - 1) / page_bytes) as usize + 1
    }

    /// Under the learned policy: new next uses and plans from the predictor.
    fn replan(&mut self) {
        if !self.access.learned() {
            return;
        }
        let remote_bw = self.remote.enabled().then(|| self.remote.bytes_per_s());
        let changed = self.access.replan(
            self.cfg.lookahead_accesses_max,
            &self.pages,
            plan::Rate {
                bytes_per_s: self.copies.bytes_per_s(Direction::HostToDevice),
                peer_bytes_per_s: self.copies.bytes_per_s(Direction::PeerToDevice),
            },
            remote_bw,
        );
        // Only the frames of buffers whose next use changed: the cost of a plan does not
        // grow with the frames.
        for b in changed {
            let Some(buffer) = self.pages.get(b) else {
                continue;
            };
            let next = self.access.next_use(b);
            for p in &buffer.pages {
                if let Some(frame) = p.gpu.frame() {
                    self.gpu.set_next_use(frame, next);
                }
            }
        }
    }

    /// Gives back a freed buffer's slots and remote space once no copy uses its pages.
    fn reap(&mut self, id: BufferId) {
        let Some(b) = self.pages.get(id) else {
            return;
        };
        if !b.freed || b.pages.iter().any(|p| p.in_flight > 0) {
            return;
        }
        let b = self.pages.remove(id).expect("present");
        for (index, p) in b.pages.into_iter().enumerate() {
            debug_assert_eq!(p.gpu, Gpu::Absent);
            if let Some(frame) = p.peer.held() {
                self.gpu.peer.vacate(frame);
            }
            if let Some(slot) = p.host.slot() {
                self.host.give_back(slot);
            }
            if p.remote_space {
                self.remote.give_space(PageId {
                    buffer: id,
                    index: index as u32,
                });
            }
        }
    }
}
