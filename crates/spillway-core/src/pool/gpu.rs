//! The GPU tier's moves, across the rooms: starting loads and write-backs, choosing a
//! frame for a load (a free one, one coming free, or the eviction policy's victim), and
//! the copies' completions.

use std::ops::Range;
use std::time::Duration;

use spillway_types::{BufferId, Direction, Far, FrameId, PageId, TransferId};

use super::PoolCore;
use super::frames::GpuFrames;
use super::pages::{Gpu, Host, Page, PageTable};
use super::peer::PeerFill;
use super::pump::Place;
use crate::error::{CoreError, DeviceFault};
use crate::eviction::VictimView;

impl PoolCore {
    /// Records that copy `id` finished at `now` (`Err` with the device's fault if it
    /// failed: the pool fails, since the device's state is unknown; but a copy to or from
    /// the peer GPU that failed loses only that copy, since the host tier holds every
    /// page: see `PoolCore::peer_copy_failed`).
    pub fn handle_transfer_done(
        &mut self,
        id: TransferId,
        result: Result<(), DeviceFault>,
        now: Duration,
    ) {
        self.transfer_done(id, result, now);
        self.pump(now);
    }

    /// [`PoolCore::handle_transfer_done`] for several copies that finished by `now`, in
    /// order, with one pass of the pump after the last: the same state as handling them
    /// one by one, at a fraction of the cost when completions come in bursts (a driver
    /// thread that finds several copies done, each pass of the pump walking the plans).
    pub fn handle_transfers_done(
        &mut self,
        done: impl IntoIterator<Item = (TransferId, Result<(), DeviceFault>)>,
        now: Duration,
    ) {
        for (id, result) in done {
            self.transfer_done(id, result, now);
        }
        self.pump(now);
    }

    /// A copy's completion without the pump's pass that follows it.
    fn transfer_done(&mut self, id: TransferId, result: Result<(), DeviceFault>, now: Duration) {
        let Some(t) = self.copies.complete(id, now) else {
            debug_assert!(false, "completion of unknown transfer {id:?}");
            return;
        };
        let pid = t.page;
        self.pages.page_mut(pid).in_flight -= 1;
        let freed = self.pages.get(pid.buffer).is_none_or(|b| b.freed);
        let wanted = self.pages.page(pid).pins > 0;
        match (result, t.far) {
            (Ok(()), _) => {}
            (Err(_), Far::Peer(on)) => {
                self.peer_copy_failed(pid, on, freed, wanted);
                self.reap(pid.buffer);
                return;
            }
            (Err(e), Far::Host(_)) => {
                self.failed.get_or_insert(CoreError::DeviceFailed(e));
            }
        }
        match (t.direction, self.pages.page(pid).gpu) {
            (
                Direction::HostToDevice | Direction::PeerToDevice,
                Gpu::Loading { frame, prefetch },
            ) => {
                if let Far::Peer(from) = t.far {
                    self.stats.p2d_bytes += t.bytes;
                    self.end_peer_copy(pid, from, freed);
                } else {
                    self.stats.h2d_bytes += t.bytes;
                }
                self.pages.page_mut(pid).gpu = Gpu::Resident {
                    frame,
                    dirty: false,
                    unused_prefetch: prefetch && !wanted,
                };
                self.eviction.on_fill(frame);
                self.gpu
                    .set_next_use(frame, self.access.next_use(pid.buffer));
                if freed {
                    self.release_frame(pid, frame);
                }
            }
            (Direction::DeviceToHost | Direction::DeviceToPeer, Gpu::Evicting { frame }) => {
                if let Far::Peer(to) = t.far {
                    self.stats.d2p_bytes += t.bytes;
                    self.end_peer_copy(pid, to, freed);
                } else {
                    self.stats.d2h_bytes += t.bytes;
                    if let Host::Slot { clean, .. } = &mut self.pages.page_mut(pid).host {
                        *clean = false;
                    }
                }
                self.settle_evicted(pid, frame, wanted && !freed);
            }
            (dir, state) => panic!("completion of {dir:?} for {pid} in state {state:?}"),
        }
        self.reap(pid.buffer);
    }

    /// A copy out of `frame` (a write-back or a fill of the peer) ended: `pid` is clean
    /// and resident again, and leaves the frame unless it is `kept` (an acquire wants it).
    pub(super) fn settle_evicted(&mut self, pid: PageId, frame: FrameId, kept: bool) {
        self.pages.page_mut(pid).gpu = Gpu::Resident {
            frame,
            dirty: false,
            unused_prefetch: false,
        };
        self.gpu.end_evicting();
        if !kept {
            self.release_frame(pid, frame);
        }
    }

    /// Starts a copy of `pid` between `frame` and its slot.
    fn start_copy(&mut self, pid: PageId, direction: Direction, frame: FrameId, now: Duration) {
        let p = self.pages.page(pid);
        let Host::Slot { slot, .. } = p.host else {
            panic!("GPU copy of {pid} whose host state is {:?}", p.host);
        };
        self.issue_copy(pid, direction, frame, Far::Host(slot), now);
    }

    /// Takes `pid` off the GPU now: a clean page is dropped (true), or first leaves a
    /// copy on the peer GPU as `fill` allows (false; the frame comes free when it lands);
    /// a dirty one starts its write-back (false, likewise) if the bound and a slot allow.
    pub(super) fn evict(&mut self, pid: PageId, fill: PeerFill, now: Duration) -> bool {
        let Gpu::Resident { frame, dirty, .. } = self.pages.page(pid).gpu else {
            return false;
        };
        if !dirty {
            // A reserved frame held none of the page's bytes: no eviction of the page.
            if !self.pages.page(pid).reserved {
                self.stats.on_evict(false);
                if self.start_peer_fill(pid, frame, fill, now) {
                    return false;
                }
            }
            self.release_frame(pid, frame);
            return true;
        }
        if !self
            .copies
            .may_issue(Direction::DeviceToHost, self.pages.len_of(pid))
        {
            return false;
        }
        if !matches!(self.pages.page(pid).host, Host::Slot { .. }) {
            // Its slot was released while the remote tier held its bytes; the write-back
            // needs one again.
            let Some(slot) = self.free_slot_now(pid, now) else {
                return false;
            };
            self.pages.page_mut(pid).host = Host::Slot { slot, clean: false };
        }
        self.stats.on_evict(true);
        self.gpu.begin_evicting();
        self.pages.page_mut(pid).gpu = Gpu::Evicting { frame };
        self.start_copy(pid, Direction::DeviceToHost, frame, now);
        false
    }

    /// Whether `pid` is being written back.
    fn evicting(&self, pid: PageId) -> bool {
        matches!(self.pages.page(pid).gpu, Gpu::Evicting { .. })
    }

    /// A frame for a load of `pid`, next used at `bound` (`None`: needed now).
    /// `waiting` counts loads of this pump pass already waiting for a write-back.
    /// Clean victims are dropped at once; a dirty one starts a write-back, and the frame
    /// comes free when it finishes.
    ///
    /// Extents: a buffer's pages go to consecutive frames when they can (the frame after
    /// the previous page's, else the start of a free run or of the victim's own extent),
    /// so that the device can show an acquired buffer as one array at its frames' own
    /// addresses, with no remapping (`Device::acquire_ptr`).
    pub(super) fn frame_for(
        &mut self,
        pid: PageId,
        bound: Option<u64>,
        waiting: &mut u64,
        now: Duration,
    ) -> Place<FrameId> {
        let next_to = self.extent_neighbour(pid);
        // A page that starts its buffer goes back to its last frame when it can (the start
        // of its last extent).
        let preferred = next_to.or(if pid.index == 0 {
            self.pages.page(pid).last_frame
        } else {
            None
        });
        loop {
            if let Some(f) = self.gpu.take(preferred, next_to.is_none()) {
                return Place::Got(f);
            }
            if self.gpu.evicting() > *waiting {
                *waiting += 1;
                return Place::Later;
            }
            let victim = match next_to.filter(|&n| self.continues_victim_extent(n, bound)) {
                Some(n) => n,
                None => {
                    let Some(mut victim) = self.policy_victim(bound, preferred) else {
                        return Place::Never;
                    };
                    if Some(victim) != preferred {
                        victim = self.victim_extent_start(victim);
                    }
                    victim
                }
            };
            let victim = self.gpu.owner(victim).expect("eligible frames hold a page");
            // The incoming page's own copy on the peer stays: it loads from it.
            let fill = PeerFill::Keeping(pid);
            if !self.evict(victim, fill, now) && !self.evicting(victim) {
                // Dirty, and the write-back bound is reached or no slot can take it now:
                // a clean page may leave instead; else try again after a completion.
                let Some(other) = self.evictable_victim(bound) else {
                    return Place::Never;
                };
                if !self.evict(other, fill, now) && !self.evicting(other) {
                    return Place::Never;
                }
            }
        }
    }

    /// The frame that would continue `pid`'s buffer's extent: the one after the previous
    /// page's frame, else the one before the next page's (when that page is on the GPU).
    fn extent_neighbour(&self, pid: PageId) -> Option<FrameId> {
        let pages = &self.pages.get(pid.buffer).expect("page of the table").pages;
        let i = pid.index as usize;
        let on_gpu = |p: &Page| match p.gpu {
            Gpu::Loading { frame, .. } | Gpu::Resident { frame, .. } => Some(frame.0),
            Gpu::Absent | Gpu::Evicting { .. } => None,
        };
        let n = self.gpu.total() as u32;
        let after = i
            .checked_sub(1)
            .and_then(|j| on_gpu(&pages[j]))
            .and_then(|f| f.checked_add(1))
            .filter(|&f| f < n);
        let before = || {
            pages
                .get(i + 1)
                .and_then(on_gpu)
                .and_then(|f| f.checked_sub(1))
        };
        after.or_else(before).map(FrameId)
    }

    /// Whether frame `next_to`, the one that extends a buffer's extent, may be taken for
    /// it: its page may leave now and is used after `bound` (a demand load: after the
    /// next access). This overrides the policy's order among such pages on purpose: a
    /// buffer split over two extents costs a remap of each page on every acquire (tens
    /// of microseconds each, on the job's critical path), a victim used a little sooner
    /// than the policy's best costs at most a copy that prefetch can hide.
    fn continues_victim_extent(&self, next_to: FrameId, bound: Option<u64>) -> bool {
        let Some(holder) = self.gpu.owner(next_to) else {
            return false;
        };
        let page = self.pages.page(holder);
        if !matches!(page.gpu, Gpu::Resident { .. }) || page.pins > 0 || page.host_pins > 0 {
            return false;
        }
        let accesses = self.access.accesses();
        let bound = bound.unwrap_or(accesses + 1);
        match self.gpu.next_use_after(next_to, accesses) {
            None => true,
            Some(n) => n > bound,
        }
    }

    /// The first frame of the victim's own extent: walks back while the frame before
    /// holds the previous page of the same buffer, evictable and next used at the same
    /// access (equally good by any policy's measure), so the incoming buffer takes the
    /// extent from its start. Bounded by the buffer's page count.
    fn victim_extent_start(&self, victim: FrameId) -> FrameId {
        let evictable = |f: u32| {
            self.gpu.owner(FrameId(f)).filter(|p| {
                let page = self.pages.page(*p);
                matches!(page.gpu, Gpu::Resident { .. }) && page.pins == 0 && page.host_pins == 0
            })
        };
        let Some(mut holder) = evictable(victim.0) else {
            return victim;
        };
        let next_use = self.gpu.next_use(victim);
        let mut f = victim.0;
        while f > 0 && holder.index > 0 {
            match evictable(f - 1) {
                Some(p)
                    if p.buffer == holder.buffer
                        && p.index + 1 == holder.index
                        && self.gpu.next_use(FrameId(f - 1)) == next_use =>
                {
                    holder = p;
                    f -= 1;
                }
                _ => break,
            }
        }
        FrameId(f)
    }

    /// Starts loading `pid` into `frame` (taken).
    pub(super) fn start_load(
        &mut self,
        pid: PageId,
        frame: FrameId,
        prefetch: bool,
        now: Duration,
    ) {
        self.gpu
            .occupy(frame, pid, self.access.next_use(pid.buffer));
        self.pages.page_mut(pid).gpu = Gpu::Loading { frame, prefetch };
        self.copies.map(pid, frame);
        match self.pages.page(pid).peer.held() {
            Some(from) => {
                self.gpu.peer.begin_copy(from);
                self.stats.peer_loads += 1;
                self.issue_copy(pid, Direction::PeerToDevice, frame, Far::Peer(from), now);
            }
            None => self.start_copy(pid, Direction::HostToDevice, frame, now),
        }
        self.stats.on_load(prefetch, self.gpu.in_use());
    }

    /// Gives `pid`, whose contents an acquire discards, `frame` without a load: it is
    /// resident and dirty at once (its frame's bytes are undefined until the holder
    /// writes them). Its host and remote copies are stale: a clean slot becomes dirty
    /// and the remote tier's copy is dropped (the page keeps its remote space).
    pub(super) fn start_overwrite(&mut self, pid: PageId, frame: FrameId) {
        self.drop_peer_copy(pid);
        self.settle_without_copy(pid, frame, true);
        let page = self.pages.page_mut(pid);
        page.overwrite = false;
        if let Host::Slot { clean, .. } = &mut page.host {
            *clean = false;
        }
        if page.remote_space {
            self.remote.discard(pid);
        }
        self.stats.on_overwrite(self.gpu.in_use());
    }

    /// Reserves `frame` (taken) for `pid`, whose next access is predicted to overwrite
    /// it: resident and clean with no copy, its frame's bytes not its own (`reserved`;
    /// see [`super::pages::Page::reserved`]). The page's host and remote copies stay
    /// as they are, so a wrong prediction loses nothing.
    pub(super) fn start_reserve(&mut self, pid: PageId, frame: FrameId) {
        debug_assert_eq!(self.pages.page(pid).pins, 0, "{pid}: a held page is read");
        self.settle_without_copy(pid, frame, false);
        self.pages.page_mut(pid).reserved = true;
        self.stats.on_reserve(self.gpu.in_use());
    }

    /// Makes `pid` resident in `frame` (taken) with no copy: the frame's bytes are not
    /// the page's (an overwrite or a reservation).
    fn settle_without_copy(&mut self, pid: PageId, frame: FrameId, dirty: bool) {
        self.gpu
            .occupy(frame, pid, self.access.next_use(pid.buffer));
        self.pages.page_mut(pid).gpu = Gpu::Resident {
            frame,
            dirty,
            unused_prefetch: false,
        };
        self.copies.map(pid, frame);
        self.eviction.on_fill(frame);
    }

    /// Gives up the frame reserved for `pid` (the prediction was wrong): the page is
    /// off the GPU again, its bytes where they were.
    pub(super) fn unreserve(&mut self, pid: PageId) {
        let page = self.pages.page(pid);
        debug_assert!(page.reserved, "{pid} has a reserved frame");
        if let Gpu::Resident { frame, .. } = page.gpu {
            self.release_frame(pid, frame);
        }
    }

    /// Gives up the reserved frames among pages `range` of buffer `id` (an access that
    /// needs their bytes).
    pub(super) fn unreserve_pages(&mut self, id: BufferId, range: Range<usize>) {
        for index in range {
            let pid = PageId {
                buffer: id,
                index: index as u32,
            };
            if self.pages.page(pid).reserved {
                self.unreserve(pid);
            }
        }
    }

    /// The page leaves `frame`: the frame is free again (a reservation leaving it was of
    /// no use: counted missed).
    pub(super) fn release_frame(&mut self, pid: PageId, frame: FrameId) {
        let page = self.pages.page_mut(pid);
        self.stats.reservations_missed += u64::from(page.reserved);
        page.reserved = false;
        if let Gpu::Resident {
            unused_prefetch: true,
            ..
        } = page.gpu
        {
            self.stats.prefetch_wasted += 1;
        }
        page.last_frame = Some(frame);
        page.gpu = Gpu::Absent;
        self.gpu.vacate(frame, pid);
        self.eviction.on_free(frame);
        self.copies.unmap(pid);
    }

    /// The eviction policy's victim among the GPU frames (see [`VictimView`]).
    pub(super) fn policy_victim(
        &mut self,
        bound: Option<u64>,
        preferred: Option<FrameId>,
    ) -> Option<FrameId> {
        self.eviction.choose_victim(&FrameView {
            gpu: &self.gpu,
            pages: &self.pages,
            accesses: self.access.accesses(),
            bound,
            preferred,
        })
    }

    /// A page on the GPU that can leave now without help (see
    /// [`super::pages::Page::can_leave_gpu`]), used furthest ahead and beyond `bound`:
    /// the fallback when the policy's victim is dirty and cannot be written back now.
    fn evictable_victim(&self, bound: Option<u64>) -> Option<PageId> {
        let mut best: Option<(u64, PageId)> = None;
        for (frame, pid) in self.gpu.owned() {
            if !self.pages.page(pid).can_leave_gpu() {
                continue;
            }
            let next = self
                .gpu
                .next_use_after(frame, self.access.accesses())
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
    pub(super) fn evict_for_slot(&mut self, now: Duration) -> bool {
        let Some(frame) = self.policy_victim(None, None) else {
            return false;
        };
        let pid = self.gpu.owner(frame).expect("eligible frames hold a page");
        // Its slot goes next, and a peer copy with it: none is made.
        self.evict(pid, PeerFill::Skip, now)
    }
}

/// What the eviction policy sees of the GPU tier: the rooms it reads, borrowed beside
/// the policy (which is borrowed mutably).
struct FrameView<'a> {
    gpu: &'a GpuFrames,
    pages: &'a PageTable,
    accesses: u64,
    bound: Option<u64>,
    preferred: Option<FrameId>,
}

impl VictimView for FrameView<'_> {
    fn frame_count(&self) -> u32 {
        self.gpu.total() as u32
    }

    fn eligible(&self, frame: FrameId) -> bool {
        let Some(pid) = self.gpu.owner(frame) else {
            return false;
        };
        let page = self.pages.page(pid);
        matches!(page.gpu, Gpu::Resident { .. }) && page.pins == 0 && page.host_pins == 0
    }

    fn next_use(&self, frame: FrameId) -> Option<u64> {
        self.gpu.next_use_after(frame, self.accesses)
    }

    fn must_exceed(&self) -> Option<u64> {
        self.bound
    }

    fn preferred(&self) -> Option<FrameId> {
        self.preferred
    }

    fn indexed(&self) -> bool {
        true
    }

    fn visit_unpredicted(&self, from: FrameId, visit: &mut dyn FnMut(FrameId) -> bool) {
        for f in self.gpu.unpredicted_from(from) {
            if visit(f) {
                return;
            }
        }
    }

    fn visit_furthest_first(&self, visit: &mut dyn FnMut(FrameId, Option<u64>) -> bool) {
        for (f, next) in self.gpu.predicted_furthest_first() {
            // A use already passed counts as none predicted.
            if visit(f, Some(next).filter(|&n| n > self.accesses)) {
                return;
            }
        }
    }
}
