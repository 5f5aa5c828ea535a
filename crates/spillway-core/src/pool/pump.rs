//! Pumping: [`PoolCore::pump`] starts every move the state allows, after every call into
//! the core. One loop, [`PoolCore::drain`], serves each queue of each tier: the demand
//! (pages an acquire or a host access waits for) and then the plan (pages predicted),
//! for the host tier (fetches into slots) and then the GPU tier (loads into frames).

use std::time::Duration;

use spillway_types::{FrameId, HostSlot, PageId};

use super::PoolCore;
use super::pages::{Gpu, Host};
use super::plan::Tier;
use super::types::RemoteOpKind;

/// A queue of a tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Queue {
    /// Pages something waits for now.
    Demand,
    /// Pages predicted, nearest first.
    Plan,
}

/// What to do with one entry of a queue.
enum Verdict {
    /// Bring the page into the tier now, if a place can be had.
    Bring,
    /// Leave it queued; look at the next.
    Skip,
    /// Take it off the queue (done, or not wanted any more).
    Drop,
    /// Leave it and everything after it for later.
    Stop,
}

/// What asking a tier for a place found.
pub(super) enum Place<T> {
    /// A free place, taken.
    Got(T),
    /// A move in flight (a write-back, a spill) will free one for this page.
    Later,
    /// None can be had now.
    Never,
}

impl<T> Place<T> {
    fn map<U>(self, f: impl FnOnce(T) -> U) -> Place<U> {
        match self {
            Place::Got(t) => Place::Got(f(t)),
            Place::Later => Place::Later,
            Place::Never => Place::Never,
        }
    }
}

/// A place in either tier.
enum Spot {
    Frame(FrameId),
    Slot(HostSlot),
}

impl PoolCore {
    /// Starts every move that the current state allows: for the host tier (with a remote
    /// tier) its demand, its staging plan and the spills ahead of need; then for the GPU
    /// tier its demand loads and its prefetches.
    pub(super) fn pump(&mut self, now: Duration) {
        if self.failed.is_some() {
            return;
        }
        if self.remote.enabled() {
            let mut waiting = 0u64;
            if self.drain(Tier::Host, Queue::Demand, &mut waiting, now)
                && self.drain(Tier::Host, Queue::Plan, &mut waiting, now)
            {
                self.spill_ahead(now);
            }
        }
        let mut waiting = 0u64;
        if self.drain(Tier::Gpu, Queue::Demand, &mut waiting, now) {
            self.drain(Tier::Gpu, Queue::Plan, &mut waiting, now);
        }
    }

    /// Brings the pages of `queue` into `tier` in order while places and the in-flight
    /// bound allow. `waiting` counts pages of this pass already waiting for a place
    /// coming free. False when the tier can start nothing more now (the caller stops).
    ///
    /// The host tier's demand is the pages of pending acquires and host accesses.
    fn drain(&mut self, tier: Tier, queue: Queue, waiting: &mut u64, now: Duration) -> bool {
        let snapshot: Vec<PageId> = match (tier, queue) {
            (Tier::Host, Queue::Demand) => {
                // A host access's pages stay protected from leaving until it pins them
                // (then `begin_host_access` takes them off); pages of freed buffers go.
                let pages = &self.pages;
                self.access
                    .host_demand
                    .retain(|p| pages.live_buffer(p.buffer).is_some());
                let mut all: Vec<PageId> = self.access.demand.iter().copied().collect();
                all.extend(self.access.host_demand.iter().copied());
                all
            }
            _ => Vec::new(),
        };
        let mut i = 0;
        loop {
            let entry = match (tier, queue) {
                (Tier::Host, Queue::Demand) => snapshot.get(i).map(|&p| (p, None)),
                (Tier::Gpu, Queue::Demand) => self.access.demand.get(i).map(|&p| (p, None)),
                (_, Queue::Plan) => self
                    .access
                    .plan_mut(tier)
                    .queue
                    .get(i)
                    .map(|&(p, n)| (p, Some(n))),
            };
            let Some((pid, bound)) = entry else {
                return true;
            };
            match self.verdict(tier, queue, pid) {
                Verdict::Bring => {}
                Verdict::Skip => {
                    i += 1;
                    continue;
                }
                Verdict::Drop => {
                    if !self.remove_entry(tier, queue, i) {
                        i += 1;
                    }
                    continue;
                }
                Verdict::Stop => return false,
            }
            if self.pages.page(pid).reserved {
                // No longer predicted to be overwritten: its frame goes, and the entry is
                // judged again as the absent page it now is.
                self.unreserve(pid);
                continue;
            }
            let overwrite = tier == Tier::Gpu && self.pages.overwriting(pid);
            // A planned page whose next access is predicted to overwrite it: a frame is
            // reserved for it, no copy. Not while an acquire holds it: that acquire
            // reads it (a discarding one would have marked it `overwrite`).
            let reserve = tier == Tier::Gpu
                && queue == Queue::Plan
                && !overwrite
                && self.pages.page(pid).pins == 0
                && self.access.next_overwrites(pid.buffer);
            let may = match tier {
                // A page whose contents are discarded gets a frame, no copy.
                Tier::Gpu if overwrite || reserve => true,
                Tier::Gpu => self
                    .copies
                    .may_issue(self.load_direction(pid), self.pages.page_bytes()),
                Tier::Host => self
                    .remote
                    .may_issue(RemoteOpKind::Fetch, self.pages.page_bytes()),
            };
            if !may {
                return false;
            }
            let place = match tier {
                Tier::Gpu => self.frame_for(pid, bound, waiting, now).map(Spot::Frame),
                Tier::Host => self.slot_for(pid, bound, waiting, now).map(Spot::Slot),
            };
            let prefetch = queue == Queue::Plan;
            match place {
                Place::Got(Spot::Frame(frame)) if !overwrite && !self.pages.needs_load(pid) => {
                    // Making room sent the page itself out of its slot: load it later.
                    self.gpu.untake(frame);
                    i += 1;
                }
                Place::Got(spot) => {
                    if !self.remove_entry(tier, queue, i) {
                        i += 1;
                    }
                    match spot {
                        Spot::Frame(frame) if overwrite => self.start_overwrite(pid, frame),
                        Spot::Frame(frame) if reserve => self.start_reserve(pid, frame),
                        Spot::Frame(frame) => self.start_load(pid, frame, prefetch, now),
                        Spot::Slot(slot) => self.start_fetch(pid, slot, prefetch, now),
                    }
                }
                Place::Later => i += 1,
                // A page of the host tier's demand that finds no slot does not stop the
                // staging after it.
                Place::Never => return tier == Tier::Host && queue == Queue::Demand,
            }
        }
    }

    /// What `queue` of `tier` does with `pid` now.
    fn verdict(&self, tier: Tier, queue: Queue, pid: PageId) -> Verdict {
        let pages = &self.pages;
        match (tier, queue) {
            (Tier::Gpu, Queue::Demand) => {
                let wanted = pages.wanted(pid);
                if wanted && pages.page(pid).host_pins > 0 {
                    // The host is reading or writing it: retried when that ends.
                    Verdict::Skip
                } else if wanted && pages.overwriting(pid) {
                    // Its contents are discarded: a frame, wherever its bytes are.
                    Verdict::Bring
                } else if wanted
                    && pages.page(pid).gpu == Gpu::Absent
                    && !matches!(pages.page(pid).host, Host::Slot { .. })
                {
                    // Not in a slot yet: a fetch is queued or in flight (the host tier's
                    // demand).
                    Verdict::Skip
                } else if !wanted || !pages.needs_load(pid) {
                    // Loaded, loading, being written back (it will be kept), not wanted.
                    Verdict::Drop
                } else {
                    Verdict::Bring
                }
            }
            // A page about to be overwritten is neither loaded nor staged.
            (_, Queue::Plan) if pages.overwriting(pid) => Verdict::Drop,
            // A frame reserved for an overwrite no longer predicted: given up, then the
            // page is planned as any other (see `drain`).
            (Tier::Gpu, Queue::Plan) if pages.reserved(pid) => {
                if self.access.next_overwrites(pid.buffer) || !pages.page(pid).settled() {
                    Verdict::Drop
                } else {
                    Verdict::Bring
                }
            }
            (Tier::Host, Queue::Demand) if pages.overwriting(pid) => Verdict::Skip,
            (Tier::Gpu, Queue::Plan) if pages.needs_load(pid) => Verdict::Bring,
            // Predicted to be overwritten and not in a slot: nothing to stage for it (the
            // host tier plans none), and it must not hold up the pages after it.
            (Tier::Gpu, Queue::Plan) if self.access.next_overwrites(pid.buffer) => Verdict::Drop,
            (Tier::Gpu, Queue::Plan) if pages.needs_fetch(pid) || pages.staging(pid) => {
                // Being staged from the remote tier: loaded once it is in a slot. Pages
                // after it wait too, or they would take frames it then has to evict.
                Verdict::Stop
            }
            (Tier::Gpu, Queue::Plan) => Verdict::Drop,
            (Tier::Host, _) if pages.needs_fetch(pid) && pages.page(pid).in_flight == 0 => {
                Verdict::Bring
            }
            (Tier::Host, Queue::Demand) => Verdict::Skip,
            (Tier::Host, Queue::Plan) => Verdict::Drop,
        }
    }

    /// Takes entry `i` off the queue; false for the host tier's demand, which is read,
    /// not consumed (the acquires' pages stay in the GPU tier's demand).
    fn remove_entry(&mut self, tier: Tier, queue: Queue, i: usize) -> bool {
        match (tier, queue) {
            (Tier::Gpu, Queue::Demand) => self.access.demand.remove(i).is_some(),
            (_, Queue::Plan) => self.access.plan_mut(tier).queue.remove(i).is_some(),
            (Tier::Host, Queue::Demand) => false,
        }
    }
}
