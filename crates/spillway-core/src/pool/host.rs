//! The host tier's moves, across the rooms: bringing pages into slots (a fetch from the
//! remote tier, or a zero fill), taking them out (dropping a clean page, spilling a dirty
//! one, with backoff after refusals), the slots for demand and staging, the host-tier
//! victims (chosen by the eviction policy), and the remote ops' completions.

use std::time::Duration;

use spillway_types::{BufferId, HostSlot, PageId, TransferId};

use super::PoolCore;
use super::pages::{Gpu, Host, PageTable};
use super::plan::Access;
use super::pump::Place;
use super::types::{RemoteOp, RemoteOpKind, ZeroFill};
use crate::error::{CoreError, DeviceFault, RemoteError};
use crate::eviction::HostVictimView;
use crate::retry::Verdict;

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
    /// Records that remote op `id` finished at `now` (`Err` with why if it failed).
    /// A failed fetch loses the page's buffer (its acquires and host accesses fail with
    /// [`CoreError::PageLost`] until it is freed; other buffers go on; counted in
    /// [`super::CoreStats::pages_lost`] and [`super::CoreStats::buffers_lost`]); a failed
    /// spill leaves the page in its slot and backs spills off. Both count in
    /// [`super::CoreStats::remote_errors`]. An op that failed with
    /// [`RemoteError::TierGone`] fails the pool at once ([`CoreError::RemoteTierGone`]):
    /// no retry or grace could bring the tier back.
    pub fn handle_remote_done(
        &mut self,
        id: TransferId,
        result: Result<(), RemoteError>,
        now: Duration,
    ) {
        let Some(op) = self.remote.complete(id, result.is_ok(), now) else {
            debug_assert!(false, "completion of unknown remote op {id:?}");
            return;
        };
        let pid = op.page;
        self.pages.page_mut(pid).in_flight -= 1;
        let b = self
            .pages
            .get(pid.buffer)
            .expect("pages in flight keep their buffer");
        let p = &b.pages[pid.index as usize];
        let freed = b.freed;
        let wanted = p.pins > 0 || p.host_pins > 0 || self.access.host_waits_for(pid);
        if let Err(e @ RemoteError::TierGone { .. }) = &result {
            self.failed
                .get_or_insert(CoreError::RemoteTierGone { reason: e.clone() });
        }
        match (op.kind, p.host, result) {
            (RemoteOpKind::Fetch, Host::Fetching { slot }, Ok(())) => {
                self.stats.remote_bytes_in += op.bytes;
                self.pages.page_mut(pid).host = Host::Slot { slot, clean: true };
            }
            (RemoteOpKind::Fetch, Host::Fetching { slot }, Err(e)) => {
                // The slot's garbage is marked clean so that it leaves without being
                // spilled over the remote copy.
                self.stats.remote_errors += 1;
                self.pages.page_mut(pid).host = Host::Slot { slot, clean: true };
                self.stats.pages_lost += u64::from(!freed);
                self.lose(
                    pid.buffer,
                    CoreError::PageLost {
                        buffer: pid.buffer,
                        page: pid.index,
                        reason: e,
                    },
                );
            }
            (RemoteOpKind::Spill, Host::Spilling { slot }, Ok(())) => {
                self.remote.spill_succeeded();
                self.stats.remote_bytes_out += op.bytes;
                if wanted || freed {
                    self.pages.page_mut(pid).host = Host::Slot { slot, clean: true };
                } else {
                    self.pages.page_mut(pid).host = Host::Remote;
                    self.host.give_back(slot);
                    // Its copy on the peer is checked against its slot's: it goes too.
                    self.drop_peer_copy(pid);
                }
            }
            (RemoteOpKind::Spill, Host::Spilling { slot }, Err(e)) => {
                // The page stays in its slot; spills wait out a backoff, and fail the pool
                // once they have failed for `SPILL_DEADLINE` without one success.
                self.stats.remote_errors += 1;
                self.pages.page_mut(pid).host = Host::Slot { slot, clean: false };
                if let Verdict::GiveUp(failing_for) = self.remote.spill_failed(now) {
                    self.failed.get_or_insert(CoreError::SpillsFailing {
                        failing_ms: failing_for.as_millis() as u64,
                        attempts: self.remote.spill_failures(),
                        reason: e,
                    });
                }
            }
            (kind, state, _) => panic!("completion of {kind:?} for {pid} in state {state:?}"),
        }
        self.reap(pid.buffer);
        self.pump(now);
    }

    /// Records that the zero fill of `page` (from [`PoolCore::poll_zero_fill`]) failed:
    /// its buffer is lost, as for a failed fetch. A fill that succeeds needs no call.
    pub fn handle_zero_fill_failed(&mut self, page: PageId, fault: DeviceFault, now: Duration) {
        if self.pages.live_buffer(page.buffer).is_some() {
            self.lose(page.buffer, CoreError::DeviceFailed(fault));
        }
        self.pump(now);
    }

    /// `buffer`'s contents are gone for `why`: its acquires and host accesses fail with
    /// it, its demand is dropped; other buffers go on.
    fn lose(&mut self, buffer: BufferId, why: CoreError) {
        let b = self.pages.buffer_mut(buffer);
        if b.lost.is_none() && !b.freed {
            self.stats.buffers_lost += 1;
        }
        b.lost.get_or_insert(why);
        self.access.forget_demand(buffer);
    }

    /// Starts bringing `pid` (`Zero` or `Remote`) into `slot`: a page never written is
    /// zero-filled there at once (by the driver, before anything else it polls), a page
    /// in the remote tier is fetched.
    pub(super) fn start_fetch(
        &mut self,
        pid: PageId,
        slot: HostSlot,
        prefetch: bool,
        now: Duration,
    ) {
        let bytes = self.pages.len_of(pid);
        match self.pages.page(pid).host {
            Host::Zero => {
                self.pages.page_mut(pid).host = Host::Slot { slot, clean: false };
                self.host.zero_fill(ZeroFill {
                    page: pid,
                    slot,
                    bytes,
                });
            }
            Host::Remote => {
                self.stats.on_fetch(prefetch);
                self.pages.page_mut(pid).host = Host::Fetching { slot };
                self.start_remote(pid, RemoteOpKind::Fetch, slot, now);
            }
            other => panic!("fetch of {pid} in host state {other:?}"),
        }
    }

    fn start_remote(&mut self, pid: PageId, kind: RemoteOpKind, slot: HostSlot, now: Duration) {
        let op = RemoteOp {
            id: self.ids.transfer(),
            kind,
            page: pid,
            slot,
            bytes: self.pages.len_of(pid),
        };
        self.pages.page_mut(pid).in_flight += 1;
        self.remote.issue(op, now);
    }

    /// A free slot now: from the free list, or by dropping a clean page; starts a spill
    /// (for later) when only dirty pages could leave.
    pub(super) fn free_slot_now(&mut self, exclude: PageId, now: Duration) -> Option<HostSlot> {
        if let Some(slot) = self.host.take() {
            return Some(slot);
        }
        let victim = self.host_victim(None, exclude)?;
        self.spill(victim, now);
        self.host.take()
    }

    /// The page to take out of the host tier, chosen by the eviction policy: first among
    /// pages off the GPU whose next use is beyond `bound`; for a demand (no bound), then
    /// among pages on the GPU whose slots are redundant (any next use: the page stays on
    /// the GPU, only its host copy goes). Staging never takes slots from pages on the
    /// GPU: it would trade a page needed later for one needed again when it leaves the
    /// GPU. `None` if no page may leave.
    fn host_victim(&mut self, bound: Option<u64>, exclude: PageId) -> Option<PageId> {
        let mut view = SlotView {
            pages: &self.pages,
            access: &self.access,
            bound,
            exclude,
            on_gpu: false,
        };
        if let Some(victim) = self.eviction.choose_host_victim(&view) {
            return Some(victim);
        }
        if bound.is_some() {
            return None;
        }
        view.on_gpu = true;
        self.eviction.choose_host_victim(&view)
    }

    /// Remote space for a spill of `pid`: its own, a free one, or one taken back from a
    /// page in a slot (whose remote copy is then dropped). False if none can be had.
    fn remote_space_for(&mut self, pid: PageId) -> bool {
        if self.pages.page(pid).remote_space {
            return true;
        }
        if !self.remote.take_space() {
            let Some(donor) = self.pages.remote_space_donor() else {
                return false;
            };
            let d = self.pages.page_mut(donor);
            d.remote_space = false;
            if let Host::Slot { clean, .. } = &mut d.host {
                *clean = false;
            }
            self.remote.discard(donor);
        }
        self.pages.page_mut(pid).remote_space = true;
        true
    }

    /// A slot for a fetch of `pid`, next used at `bound` (`None`: needed now). A clean
    /// victim leaves at once; a dirty one starts a spill and the slot comes free when it
    /// finishes.
    pub(super) fn slot_for(
        &mut self,
        pid: PageId,
        bound: Option<u64>,
        waiting: &mut u64,
        now: Duration,
    ) -> Place<HostSlot> {
        loop {
            if let Some(slot) = self.host.take() {
                return Place::Got(slot);
            }
            if self.remote.spilling() > *waiting {
                *waiting += 1;
                return Place::Later;
            }
            let Some(victim) = self.host_victim(bound, pid) else {
                // Every slot is held by a page on the GPU (or one that may not leave).
                // For a demand, take a page off the GPU: its slot can then be had.
                if bound.is_none() && self.evict_for_slot(now) {
                    continue;
                }
                return if self.gpu.evicting() > 0 {
                    Place::Later
                } else {
                    Place::Never
                };
            };
            match self.spill(victim, now) {
                Spilled::Freed | Spilled::Started => {}
                Spilled::Blocked => return Place::Never,
            }
        }
    }

    /// Takes `pid` (in a slot) out of the host tier: at once if the remote tier holds
    /// its bytes, else by a spill (off the GPU only).
    fn spill(&mut self, pid: PageId, now: Duration) -> Spilled {
        let page = self.pages.page(pid);
        let Host::Slot { slot, clean } = page.host else {
            return Spilled::Blocked;
        };
        let redundant = clean && page.remote_space;
        let on_gpu = page.gpu != Gpu::Absent;
        if on_gpu && !redundant {
            // A page on the GPU keeps its slot unless the remote tier holds its bytes.
            return Spilled::Blocked;
        }
        if redundant {
            self.stats.on_slot_dropped(on_gpu);
            self.pages.page_mut(pid).host = Host::Remote;
            self.host.give_back(slot);
            self.drop_peer_copy(pid);
            return Spilled::Freed;
        }
        if !self.remote.spill_ready(now)
            || !self
                .remote
                .may_issue(RemoteOpKind::Spill, self.pages.len_of(pid))
            || !self.remote_space_for(pid)
        {
            return Spilled::Blocked;
        }
        self.pages.page_mut(pid).host = Host::Spilling { slot };
        self.start_remote(pid, RemoteOpKind::Spill, slot, now);
        Spilled::Started
    }

    /// Under the learned policy, keeps one in [`super::SPILL_AHEAD_DIVISOR`] of the slots
    /// not holding GPU pages free (or coming free), by spilling pages whose next use is
    /// beyond everything planned, so that staging finds slots without waiting for a
    /// spill's round trip.
    pub(super) fn spill_ahead(&mut self, now: Duration) {
        if !self.access.learned() {
            return;
        }
        let room = self.host.total().saturating_sub(self.gpu.total());
        let target = (room / super::SPILL_AHEAD_DIVISOR).max(1);
        // Pages within the staging horizon of the last plan (staged or not) stay.
        let bound = self.access.keep_bound();
        let nobody = PageId {
            buffer: BufferId(0),
            index: 0,
        };
        while self.host.free() + self.remote.spilling() < target {
            let Some(victim) = self.host_victim(Some(bound), nobody) else {
                break;
            };
            if matches!(self.spill(victim, now), Spilled::Blocked) {
                break;
            }
        }
    }
}

/// What the eviction policy sees of the host tier.
struct SlotView<'a> {
    pages: &'a PageTable,
    access: &'a Access,
    bound: Option<u64>,
    exclude: PageId,
    /// Offer pages on the GPU whose slots are redundant, instead of pages off the GPU.
    on_gpu: bool,
}

impl HostVictimView for SlotView<'_> {
    fn next_use(&self, buffer: BufferId) -> Option<u64> {
        self.access.next_use_ahead(buffer)
    }

    fn must_exceed(&self) -> Option<u64> {
        self.bound
    }

    fn victim_page(&self, buffer: BufferId) -> Option<PageId> {
        let b = self.pages.live_buffer(buffer)?;
        if b.holders() > 0 {
            return None;
        }
        (0..b.pages.len() as u32).rev().find_map(|index| {
            let pid = PageId { buffer, index };
            let p = &b.pages[index as usize];
            let protected = self.access.host_waits_for(pid);
            let fits = if self.on_gpu {
                p.slot_redundant(protected)
            } else {
                p.spillable(protected)
            };
            (pid != self.exclude && fits).then_some(pid)
        })
    }
}
