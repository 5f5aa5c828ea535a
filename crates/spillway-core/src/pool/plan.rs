//! The access stream and the planner ([`Access`]): what waits (demand), what the predictor
//! expects, and one [`TierPlan`] per tier: loads host→GPU and staging remote→host, made
//! by the same horizon rule (see the module docs of [`super`], "Planning") at each tier's
//! bandwidth and lead factor.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use spillway_types::{BufferId, PageId};

use super::pages::{Gpu, Host, Page, PageTable};
use super::{JITTER_MARGIN, LEAD_FACTOR, MIN_LOOKAHEAD_ACCESSES, REMOTE_LEAD_FACTOR};
use crate::predictor::{Predictor, PredictorStats, Upcoming};

/// A tier pages are brought into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tier {
    /// Host→GPU loads, into frames.
    Gpu,
    /// Remote→host fetches (and zero fills), into slots.
    Host,
}

/// What a page needs from a tier's plan.
enum Need {
    /// It is not in the tier: plan it.
    Bring,
    /// It is on its way: its bytes count against the horizon.
    Coming,
    /// Nothing.
    Nothing,
}

impl Tier {
    fn need(self, p: &Page) -> Need {
        match (self, p.gpu, p.host) {
            (Tier::Gpu, Gpu::Absent, _) => Need::Bring,
            (Tier::Gpu, Gpu::Loading { .. }, _) => Need::Coming,
            (Tier::Host, Gpu::Absent, Host::Zero | Host::Remote) => Need::Bring,
            (Tier::Host, _, Host::Fetching { .. }) => Need::Coming,
            _ => Need::Nothing,
        }
    }
}

/// The pages to bring into one tier ahead of their use, nearest first, each with its
/// predicted use (an absolute access number).
#[derive(Debug)]
pub(super) struct TierPlan {
    tier: Tier,
    /// How far ahead of its use a page is brought, as a multiple of the time the pages
    /// planned before it take at the tier's bandwidth.
    lead_factor: f64,
    pub(super) queue: VecDeque<(PageId, u64)>,
    /// The furthest access the last plan covers.
    horizon: u64,
}

impl TierPlan {
    fn new(tier: Tier, lead_factor: f64) -> TierPlan {
        TierPlan {
            tier,
            lead_factor,
            queue: VecDeque::new(),
            horizon: 0,
        }
    }

    /// Plans the pages of `upcoming` accesses (after access `now`) not in the tier,
    /// within the horizon at `bytes_per_s`.
    fn replan(&mut self, upcoming: &[Upcoming], now: u64, bytes_per_s: f64, pages: &PageTable) {
        self.queue.clear();
        self.horizon = now;
        let mut queued_bytes = 0u64;
        for u in upcoming {
            if u.distance >= MIN_LOOKAHEAD_ACCESSES
                && u.time_until.as_secs_f64()
                    > self.lead_factor * queued_bytes as f64 / bytes_per_s
                        + JITTER_MARGIN.as_secs_f64()
            {
                break;
            }
            let Some(b) = pages.live_buffer(u.buffer) else {
                continue;
            };
            let next = now + 1 + u.distance;
            self.horizon = self.horizon.max(next);
            for (index, p) in b.pages.iter().enumerate() {
                let index = index as u32;
                match self.tier.need(p) {
                    Need::Bring => {
                        self.queue.push_back((
                            PageId {
                                buffer: u.buffer,
                                index,
                            },
                            next,
                        ));
                        queued_bytes += pages.page_len(b.bytes, index);
                    }
                    Need::Coming => queued_bytes += pages.page_len(b.bytes, index),
                    Need::Nothing => {}
                }
            }
        }
    }

    /// The furthest predicted use among the pages planned.
    fn furthest(&self) -> Option<u64> {
        self.queue.iter().map(|&(_, n)| n).max()
    }
}

/// The access stream: demand waiting per tier, the plans, each buffer's next predicted
/// use, accesses counted, and the predictor.
pub(super) struct Access {
    /// Pages of pending acquires (they must come onto the GPU).
    pub(super) demand: VecDeque<PageId>,
    /// Pages a host access waits for (they must come into a slot first).
    pub(super) host_demand: VecDeque<PageId>,
    /// Loads host→GPU ahead of use.
    pub(super) gpu_plan: TierPlan,
    /// Staging remote→host ahead of use.
    pub(super) host_plan: TierPlan,
    next_use: HashMap<BufferId, u64>,
    /// Accesses (acquires) so far: the clock of next uses.
    accesses: u64,
    predictor: Box<dyn Predictor>,
    /// Whether the predictor is used (the learned policy).
    learned: bool,
}

impl Access {
    /// An access stream predicted by `predictor` when `learned` (else nothing is planned).
    pub(super) fn new(predictor: Box<dyn Predictor>, learned: bool) -> Access {
        Access {
            demand: VecDeque::new(),
            host_demand: VecDeque::new(),
            gpu_plan: TierPlan::new(Tier::Gpu, LEAD_FACTOR),
            host_plan: TierPlan::new(Tier::Host, REMOTE_LEAD_FACTOR),
            next_use: HashMap::new(),
            accesses: 0,
            predictor,
            learned,
        }
    }

    /// Whether plans are made (the learned policy).
    pub(super) fn learned(&self) -> bool {
        self.learned
    }

    /// Accesses so far.
    pub(super) fn accesses(&self) -> u64 {
        self.accesses
    }

    /// `buffer` is acquired at `now`: one more access.
    pub(super) fn on_access(&mut self, buffer: BufferId, now: Duration) {
        self.accesses += 1;
        if self.learned {
            self.predictor.on_access(buffer, now);
        }
    }

    /// A step ended at `now`.
    pub(super) fn end_step(&mut self, now: Duration) {
        if self.learned {
            self.predictor.end_step(now);
        }
    }

    /// The predicted next use of `buffer` as last planned (it may have passed).
    pub(super) fn next_use(&self, buffer: BufferId) -> Option<u64> {
        self.next_use.get(&buffer).copied()
    }

    /// The predicted next use of `buffer` if it is still ahead (`None`: none predicted).
    pub(super) fn next_use_ahead(&self, buffer: BufferId) -> Option<u64> {
        self.next_use(buffer).filter(|&n| n > self.accesses)
    }

    /// Recomputes next uses from the predictor's `lookahead` upcoming accesses, and the
    /// plans of both tiers (staging only with a remote tier) at their bandwidths.
    pub(super) fn replan(
        &mut self,
        lookahead: usize,
        pages: &PageTable,
        gpu_bytes_per_s: f64,
        remote_bytes_per_s: Option<f64>,
    ) {
        self.next_use.clear();
        let upcoming = self.predictor.upcoming(lookahead);
        for u in &upcoming {
            self.next_use
                .insert(u.buffer, self.accesses + 1 + u.distance);
        }
        self.gpu_plan
            .replan(&upcoming, self.accesses, gpu_bytes_per_s, pages);
        match remote_bytes_per_s {
            Some(bw) => self.host_plan.replan(&upcoming, self.accesses, bw, pages),
            None => self.host_plan.queue.clear(),
        }
    }

    /// Pages used before this access stay in the host tier when slots are made ahead of
    /// need: everything planned in either tier, and the next few accesses.
    pub(super) fn keep_bound(&self) -> u64 {
        self.host_plan
            .horizon
            .max(self.gpu_plan.furthest().unwrap_or(0))
            .max(self.accesses + MIN_LOOKAHEAD_ACCESSES)
    }

    /// Drops the demand of `buffer` (its contents are lost).
    pub(super) fn forget_demand(&mut self, buffer: BufferId) {
        self.demand.retain(|p| p.buffer != buffer);
        self.host_demand.retain(|p| p.buffer != buffer);
    }

    /// Whether a host access waits for `pid` (it must not leave the host tier).
    pub(super) fn host_waits_for(&self, pid: PageId) -> bool {
        self.host_demand.contains(&pid)
    }

    /// The predictor's counters.
    pub(super) fn predictor_stats(&self) -> PredictorStats {
        self.predictor.stats()
    }
}
