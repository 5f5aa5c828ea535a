//! The access stream and the planner ([`Access`]): what waits (demand), what the predictor
//! expects, and one [`TierPlan`] per tier: loads host→GPU and staging remote→host, made
//! by the same horizon rule (see the module docs of [`super`], "Planning") at each tier's
//! bandwidth and lead factor.

use std::collections::VecDeque;

use crate::idmap::IdMap;
use std::time::Duration;

use spillway_types::{BufferId, PageId};

use super::overwrite::Overwrites;
use super::pages::{Gpu, Host, Page, PageTable};
use super::{
    JITTER_MARGIN, LEAD_FACTOR, MIN_LOOKAHEAD_ACCESSES, REMOTE_LEAD_FACTOR, SPECULATION_WASTE_RATIO,
};

/// Most upcoming accesses asked of the predictor at an access between whole plans: the
/// plans need the nearest (a window that ends before the horizon is widened, to this
/// and then to the whole lookahead), next uses further ahead change little from one
/// access to the next. What keeps a plan's cost flat as the pool and its steps grow.
pub const PARTIAL_LOOKAHEAD_ACCESSES: usize = 256;
/// The least window asked between whole plans. The window follows the horizon: twice
/// the upcoming accesses the last plan walked before its horizon ended, doubled while
/// a plan's horizon reaches past it (up to [`PARTIAL_LOOKAHEAD_ACCESSES`]). The
/// predictor's cost is linear in the window, so an access pays for the horizon the
/// copies need, not for the rest of the step (issue 12: planning was 10-24 ms a step on
/// the MoE traces, the predictor walking each earlier step's whole remainder at every
/// acquire). Twice [`MIN_LOOKAHEAD_ACCESSES`].
pub const WINDOW_MIN_ACCESSES: usize = 2 * MIN_LOOKAHEAD_ACCESSES as usize;
/// The farthest access the GPU budget's reach (see `TierPlan::replan`) extends a
/// horizon to: half of [`PARTIAL_LOOKAHEAD_ACCESSES`], so that a budget holding every
/// page of the step (every access resident, the reach never ended by a copy) keeps its
/// plans within the partial window instead of walking the whole lookahead each time.
pub const REACH_ACCESSES_MAX: u64 = PARTIAL_LOOKAHEAD_ACCESSES as u64 / 2;
/// Accesses one plan between whole plans serves at most, while each is the access it
/// predicted surely next: such an access changes no prediction the plan was made from
/// (the sure ones keep their absolute next uses), so planning again would give the same
/// plan less the page just used, and pages entering the horizon wait at most this many
/// accesses less one (the horizon is at least [`MIN_LOOKAHEAD_ACCESSES`]). An access
/// the plan did not predict surely (a guess, a surprise, a step's end) plans at once,
/// and so does every access while pages of the last plan wait for a place. Cuts the
/// planning on the caller's thread where the order holds and the copies keep up.
pub const PLAN_REUSE_ACCESSES_MAX: usize = 4;
/// A plan from the whole lookahead at least every this many accesses, and at every
/// step's end.
pub const FULL_REPLAN_EVERY_ACCESSES: u64 = 64;
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
    /// What `p` needs of the tier; `overwritten`: its buffer's next access is predicted
    /// to overwrite it (a frame reserved for an earlier prediction that no longer holds
    /// is planned again: the pump gives it up and loads the page).
    fn need(self, p: &Page, overwritten: bool) -> Need {
        match (self, p.gpu, p.host) {
            (Tier::Gpu, Gpu::Absent, _) => Need::Bring,
            (Tier::Gpu, Gpu::Resident { .. }, _) if p.reserved && !overwritten => Need::Bring,
            (Tier::Gpu, Gpu::Loading { .. }, _) => Need::Coming,
            (Tier::Host, Gpu::Absent, Host::Zero | Host::Remote) => Need::Bring,
            (Tier::Host, _, Host::Fetching { .. }) => Need::Coming,
            _ => Need::Nothing,
        }
    }
}

/// How fast a tier brings pages in: from the tier below, and (the GPU tier) from copies
/// on the peer GPU, which a page with one loads from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Rate {
    pub(super) bytes_per_s: f64,
    pub(super) peer_bytes_per_s: f64,
}

impl From<f64> for Rate {
    /// One rate for every page.
    fn from(bytes_per_s: f64) -> Rate {
        Rate {
            bytes_per_s,
            peer_bytes_per_s: bytes_per_s,
        }
    }
}

impl Rate {
    /// Seconds to bring `bytes` of `p` into `tier`.
    fn secs(&self, tier: Tier, p: &Page, bytes: u64) -> f64 {
        let from_peer = tier == Tier::Gpu && p.peer.held().is_some();
        bytes as f64
            / if from_peer {
                self.peer_bytes_per_s
            } else {
                self.bytes_per_s
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
    /// Bytes the tier holds (the GPU tier: its budget; the host tier: 0): the horizon
    /// reaches at least as far ahead as they take to come at the tier's bandwidth.
    reach_bytes: u64,
}

impl TierPlan {
    fn new(tier: Tier, lead_factor: f64, reach_bytes: u64) -> TierPlan {
        TierPlan {
            tier,
            lead_factor,
            queue: VecDeque::new(),
            horizon: 0,
            reach_bytes,
        }
    }

    /// Plans the pages of `upcoming` accesses (after access `now`) not in the tier,
    /// within the horizon at `rate` (each page at the rate of where it loads from); a guess only within the speculation cap
    /// ([`SPECULATION_WASTE_RATIO`]). A buffer whose next access `overwrites` predicts to
    /// overwrite it needs frames but not its bytes: the GPU tier plans its pages (the
    /// pump reserves their frames, no copy: nothing counts against the horizon), the
    /// host tier stages none.
    /// Returns where the horizon ended the plan, the index of the first entry of
    /// `upcoming` beyond it (`None`: the upcoming accesses ran out first).
    fn replan(
        &mut self,
        upcoming: &[Upcoming],
        now: u64,
        rate: impl Into<Rate>,
        pages: &PageTable,
        overwrites: &Overwrites,
    ) -> Option<usize> {
        let rate = rate.into();
        self.queue.clear();
        self.horizon = now;
        // Seconds the pages planned so far (and on their way) take to come.
        let mut queued_secs = 0f64;
        // The bytes of the sure predictions planned so far, and at least those of the
        // next MIN_LOOKAHEAD_ACCESSES (a guess may come before them).
        let sure_near: f64 = upcoming
            .iter()
            .filter(|u| u.probability >= 1.0 && u.distance < MIN_LOOKAHEAD_ACCESSES)
            .filter_map(|u| pages.plannable(u.buffer))
            .map(|b| b.bytes as f64)
            .sum();
        let mut sure_bytes = 0f64;
        let mut guess_waste = 0f64;
        // However little is queued, the horizon reaches as far as the tier's contents take
        // to come (up to REACH_ACCESSES_MAX accesses): a stretch of accesses whose pages
        // are all in the tier does not end it while the copies after the stretch could
        // already start (issue 11: on a paced sim run shaped like the H200's, the copy
        // engine idled through the first layers of backward, whose pages had stayed on
        // the GPU, then the layers after them waited).
        let reach_secs = self.reach_bytes as f64 / rate.bytes_per_s;
        for (i, u) in upcoming.iter().enumerate() {
            let reach = if u.distance < REACH_ACCESSES_MAX {
                reach_secs
            } else {
                0.0
            };
            if u.distance >= MIN_LOOKAHEAD_ACCESSES
                && u.time_until.as_secs_f64()
                    > (self.lead_factor * queued_secs).max(reach) + JITTER_MARGIN.as_secs_f64()
            {
                return Some(i);
            }
            let Some(b) = pages.plannable(u.buffer) else {
                continue;
            };
            let overwritten = overwrites.any() && overwrites.next_overwrites(u.buffer);
            if overwritten && self.tier == Tier::Host {
                continue;
            }
            // What the buffer needs of the tier, on its way included (a guess loading
            // still counts against the cap).
            let bring: u64 = (0..b.pages.len())
                .filter(|&i| !matches!(self.tier.need(&b.pages[i], overwritten), Need::Nothing))
                .map(|i| pages.page_len(b.bytes, i as u32))
                .sum();
            if u.probability >= 1.0 {
                sure_bytes += b.bytes as f64;
            } else {
                let waste = (1.0 - u.probability) * bring as f64;
                let cap = SPECULATION_WASTE_RATIO
                    * (sure_bytes.max(sure_near) + pages.page_bytes() as f64);
                if guess_waste + waste > cap {
                    continue;
                }
                guess_waste += waste;
            }
            let next = now + 1 + u.distance;
            self.horizon = self.horizon.max(next);
            for (index, p) in b.pages.iter().enumerate() {
                let index = index as u32;
                let secs = || rate.secs(self.tier, p, pages.page_len(b.bytes, index));
                match self.tier.need(p, overwritten) {
                    Need::Bring => {
                        self.queue.push_back((
                            PageId {
                                buffer: u.buffer,
                                index,
                            },
                            next,
                        ));
                        if !overwritten {
                            queued_secs += secs();
                        }
                    }
                    Need::Coming => queued_secs += secs(),
                    Need::Nothing => {}
                }
            }
        }
        None
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
    next_use: IdMap<BufferId, u64>,
    /// The map of the plan before last, kept for its allocation.
    spare_next_use: IdMap<BufferId, u64>,
    /// The access count at the last plan from the whole lookahead.
    last_full: u64,
    /// The next plan uses the whole lookahead (a step ended).
    full_due: bool,
    /// The window of the next plan between whole plans (see [`WINDOW_MIN_ACCESSES`]).
    window: usize,
    /// The accesses the last plan predicted surely next, in order (at most
    /// [`PLAN_REUSE_ACCESSES_MAX`]), less those that came as predicted since.
    expected: VecDeque<BufferId>,
    /// The last access was the first of `expected`.
    as_planned: bool,
    /// Accesses served by the last plan.
    reused: usize,
    /// Buffers used since the last plan (their passed next uses go at the next one).
    used_since_plan: Vec<BufferId>,
    /// Accesses (acquires) so far: the clock of next uses.
    accesses: u64,
    predictor: Box<dyn Predictor>,
    /// Whether the predictor is used (the learned policy).
    learned: bool,
    /// Which predicted accesses overwrite their buffer (learned policy only).
    overwrites: Overwrites,
}

impl Access {
    /// The plan of `tier`: loads ahead of use for the GPU, staging for the host.
    pub(super) fn plan_mut(&mut self, tier: Tier) -> &mut TierPlan {
        match tier {
            Tier::Gpu => &mut self.gpu_plan,
            Tier::Host => &mut self.host_plan,
        }
    }

    /// An access stream predicted by `predictor` when `learned` (else nothing is planned),
    /// into a GPU tier of `gpu_bytes`.
    pub(super) fn new(predictor: Box<dyn Predictor>, learned: bool, gpu_bytes: u64) -> Access {
        Access {
            demand: VecDeque::new(),
            host_demand: VecDeque::new(),
            gpu_plan: TierPlan::new(Tier::Gpu, LEAD_FACTOR, gpu_bytes),
            host_plan: TierPlan::new(Tier::Host, REMOTE_LEAD_FACTOR, 0),
            next_use: IdMap::default(),
            spare_next_use: IdMap::default(),
            last_full: 0,
            full_due: true,
            window: WINDOW_MIN_ACCESSES,
            expected: VecDeque::new(),
            as_planned: false,
            reused: 0,
            used_since_plan: Vec::new(),
            accesses: 0,
            predictor,
            learned,
            overwrites: Overwrites::default(),
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

    /// `buffer` is acquired at `now` (with `discard`: to be overwritten): one more access.
    pub(super) fn on_access(&mut self, buffer: BufferId, discard: bool, now: Duration) {
        self.accesses += 1;
        self.used_since_plan.push(buffer);
        self.as_planned = self.expected.front() == Some(&buffer);
        if self.as_planned {
            self.expected.pop_front();
        } else {
            self.expected.clear();
        }
        if self.learned {
            self.predictor.on_access(buffer, now);
            self.overwrites.on_access(buffer, discard);
        }
    }

    /// A step ended at `now`.
    pub(super) fn end_step(&mut self, now: Duration) {
        self.full_due = true;
        if self.learned {
            self.predictor.end_step(now);
            self.overwrites.end_step();
        }
    }

    /// A plan was made from `upcoming`: the accesses it predicts surely next, in order,
    /// are what may reuse it.
    fn planned(&mut self, upcoming: &[Upcoming]) {
        self.reused = 0;
        self.expected.clear();
        self.expected.extend(
            upcoming
                .iter()
                .enumerate()
                .take_while(|&(i, u)| u.distance == i as u64 && u.probability >= 1.0)
                .take(PLAN_REUSE_ACCESSES_MAX)
                .map(|(_, u)| u.buffer),
        );
    }

    /// Next uses from a window of the upcoming accesses, merged into those of the last
    /// whole plan (uses further ahead keep their values until the next one); the buffers
    /// acquired since the last plan leave unless the window predicts them again. Returns
    /// the buffers whose next use changed.
    fn merge_next_uses(&mut self, upcoming: &[Upcoming]) -> Vec<BufferId> {
        let mut changed = Vec::new();
        for u in upcoming {
            let next = self.accesses + 1 + u.distance;
            if self.next_use.insert(u.buffer, next) != Some(next) {
                changed.push(u.buffer);
            }
        }
        // A buffer used since the last plan whose predicted use has passed and that the
        // window does not predict again has no prediction until the next whole plan.
        for b in self.used_since_plan.drain(..) {
            if self.next_use.get(&b).is_some_and(|&n| n <= self.accesses) {
                self.next_use.remove(&b);
                changed.push(b);
            }
        }
        changed
    }

    /// The predicted next use of `buffer` as last planned (it may have passed).
    pub(super) fn next_use(&self, buffer: BufferId) -> Option<u64> {
        self.next_use.get(&buffer).copied()
    }

    /// Whether `buffer`'s next access is predicted to overwrite it (learned policy): its
    /// planned pages get frames reserved, not loads.
    pub(super) fn next_overwrites(&self, buffer: BufferId) -> bool {
        self.learned && self.overwrites.any() && self.overwrites.next_overwrites(buffer)
    }

    /// The predicted next use of `buffer` if it is still ahead (`None`: none predicted).
    pub(super) fn next_use_ahead(&self, buffer: BufferId) -> Option<u64> {
        self.next_use(buffer).filter(|&n| n > self.accesses)
    }

    /// Recomputes next uses from the predictor's `lookahead` upcoming accesses, and the
    /// plans of both tiers (staging only with a remote tier) at their bandwidths. Returns
    /// the buffers whose next use changed (at most twice the lookahead: the frames to
    /// update are found without visiting every frame).
    pub(super) fn replan(
        &mut self,
        lookahead: usize,
        pages: &PageTable,
        gpu_rate: impl Into<Rate>,
        remote_bytes_per_s: Option<f64>,
    ) -> Vec<BufferId> {
        let gpu_rate = gpu_rate.into();
        let most = lookahead.min(PARTIAL_LOOKAHEAD_ACCESSES);
        if most < lookahead
            && !self.full_due
            && self.accesses < self.last_full + FULL_REPLAN_EVERY_ACCESSES
        {
            // Only a plan with nothing left to start serves: while its pages wait for a
            // frame or a slot, what they wait for changes at every access (a release, a
            // next use passed, a page come into its slot), and the next plan orders them
            // from the state of now (issue 14: reused while pages waited, the demo with
            // a remote tier missed 11 of 96 acquires a step, forward weights of every
            // other layer; planned again, none).
            if self.as_planned
                && self.reused + 1 < PLAN_REUSE_ACCESSES_MAX
                && self.gpu_plan.queue.is_empty()
                && self.host_plan.queue.is_empty()
            {
                self.reused += 1;
                return Vec::new();
            }
            let mut window = self.window.clamp(WINDOW_MIN_ACCESSES.min(most), most);
            loop {
                let upcoming = self.predictor.upcoming(window);
                let gpu_end = self.gpu_plan.replan(
                    &upcoming,
                    self.accesses,
                    gpu_rate,
                    pages,
                    &self.overwrites,
                );
                let host_end = match remote_bytes_per_s {
                    Some(bw) => {
                        self.host_plan
                            .replan(&upcoming, self.accesses, bw, pages, &self.overwrites)
                    }
                    None => {
                        self.host_plan.queue.clear();
                        Some(0)
                    }
                };
                if let (Some(g), Some(h)) = (gpu_end, host_end) {
                    // The next access needs about as far: twice this, for the slack.
                    self.window = (2 * g.max(h)).max(WINDOW_MIN_ACCESSES);
                    self.planned(&upcoming);
                    return self.merge_next_uses(&upcoming);
                }
                // Fewer than asked at the widest window: the predictor knows no more
                // (fewer at a narrower one may be buffers used twice in it).
                if window >= most {
                    self.window = most;
                    if upcoming.len() < window {
                        self.planned(&upcoming);
                        return self.merge_next_uses(&upcoming);
                    }
                    break;
                }
                window = (2 * window).min(most);
            }
            // The horizon reaches past the widest window: plan from the whole lookahead.
        }
        self.full_due = false;
        self.last_full = self.accesses;
        let upcoming = self.predictor.upcoming(lookahead);
        let mut next_use = std::mem::take(&mut self.spare_next_use);
        next_use.clear();
        for u in &upcoming {
            next_use.insert(u.buffer, self.accesses + 1 + u.distance);
        }
        let mut changed: Vec<BufferId> = next_use
            .iter()
            .filter(|&(b, n)| self.next_use.get(b) != Some(n))
            .map(|(&b, _)| b)
            .collect();
        changed.extend(
            self.next_use
                .keys()
                .filter(|b| !next_use.contains_key(b))
                .copied(),
        );
        self.spare_next_use = std::mem::replace(&mut self.next_use, next_use);
        self.used_since_plan.clear();
        self.planned(&upcoming);
        self.gpu_plan
            .replan(&upcoming, self.accesses, gpu_rate, pages, &self.overwrites);
        match remote_bytes_per_s {
            Some(bw) => {
                self.host_plan
                    .replan(&upcoming, self.accesses, bw, pages, &self.overwrites);
            }
            None => self.host_plan.queue.clear(),
        }
        changed
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

#[cfg(test)]
mod tests {
    use super::*;

    fn upcoming(buffer: u64, distance: u64, ms: u64) -> Upcoming {
        Upcoming {
            buffer: BufferId(buffer),
            distance,
            time_until: Duration::from_millis(ms),
            probability: 1.0,
        }
    }

    /// Page `index` of `buffer`.
    fn page(buffer: BufferId, index: u32) -> PageId {
        PageId { buffer, index }
    }

    /// A clean page in frame `frame`.
    fn resident(frame: u32) -> Gpu {
        Gpu::Resident {
            frame: spillway_types::FrameId(frame),
            dirty: false,
            unused_prefetch: false,
        }
    }

    /// Two buffers `a` and `b` of two pages (the second page of 10 bytes), never written:
    /// absent from the GPU and from the host tier (no remote tier: none would be `Zero`);
    /// `a` is predicted next, `b` 9 accesses on (past the first MIN_LOOKAHEAD_ACCESSES) in
    /// 50 ms.
    fn two_buffers_of_two_pages() -> (PageTable, BufferId, BufferId, [Upcoming; 2]) {
        let mut pages = PageTable::new(100);
        let a = pages.insert(110, vec![Page::new(None), Page::new(None)]);
        let b = pages.insert(110, vec![Page::new(None), Page::new(None)]);
        let ups = [upcoming(a.0, 0, 0), upcoming(b.0, 9, 50)];
        (pages, a, b, ups)
    }

    #[test]
    fn one_rule_plans_both_tiers_within_the_horizon() {
        let (mut pages, a, b, ups) = two_buffers_of_two_pages();
        for (tier, lead) in [(Tier::Gpu, LEAD_FACTOR), (Tier::Host, REMOTE_LEAD_FACTOR)] {
            let mut plan = TierPlan::new(tier, lead, 0);
            // At 1 kB/s the 110 bytes queued for `a` take 110 ms: `b` is within the horizon.
            plan.replan(&ups, 5, 1e3, &pages, &Overwrites::default());
            assert_eq!(
                plan.queue,
                [
                    (page(a, 0), 6),
                    (page(a, 1), 6),
                    (page(b, 0), 15),
                    (page(b, 1), 15)
                ],
                "{tier:?}"
            );
            assert_eq!((plan.horizon, plan.furthest()), (15, Some(15)));
            // At 1 MB/s they take 0.11 ms, plus the jitter margin: `b` is beyond it.
            plan.replan(&ups, 5, 1e6, &pages, &Overwrites::default());
            assert_eq!(plan.queue, [(page(a, 0), 6), (page(a, 1), 6)], "{tier:?}");
            assert_eq!(plan.horizon, 6);
        }
        // A page loading counts against the GPU horizon but is not planned again.
        pages.page_mut(page(a, 0)).gpu = Gpu::Loading {
            frame: spillway_types::FrameId(0),
            prefetch: true,
        };
        let mut plan = TierPlan::new(Tier::Gpu, LEAD_FACTOR, 0);
        plan.replan(&ups, 5, 1e3, &pages, &Overwrites::default());
        assert_eq!(plan.queue[0], (page(a, 1), 6));
        assert_eq!(plan.queue.len(), 3);
    }

    #[test]
    fn a_page_with_a_copy_on_the_peer_counts_at_the_peers_rate() {
        let (mut pages, a, _, ups) = two_buffers_of_two_pages();
        let rate = Rate {
            bytes_per_s: 1e3,
            peer_bytes_per_s: 1e6,
        };
        let mut plan = TierPlan::new(Tier::Gpu, LEAD_FACTOR, 0);
        // From the host `a` takes 110 ms: `b` is within the horizon.
        plan.replan(&ups, 5, rate, &pages, &Overwrites::default());
        assert_eq!(plan.queue.len(), 4);
        // With copies on the peer `a` takes 0.11 ms: `b` is beyond it.
        for index in 0..2 {
            pages.page_mut(page(a, index)).peer =
                super::super::peer::Peer::Held(spillway_types::PeerFrameId(index));
        }
        plan.replan(&ups, 5, rate, &pages, &Overwrites::default());
        assert_eq!(plan.queue, [(page(a, 0), 6), (page(a, 1), 6)]);
        // The host tier stages from the remote tier: a peer copy changes nothing there.
        let mut host = TierPlan::new(Tier::Host, REMOTE_LEAD_FACTOR, 0);
        host.replan(&ups, 5, rate, &pages, &Overwrites::default());
        assert_eq!(host.queue.len(), 4);
    }

    #[test]
    fn the_horizon_reaches_as_far_as_the_tiers_contents_take_to_come() {
        // `a` is on the GPU: nothing is queued before `b`, 9 accesses and 50 ms on, whose
        // copies take 0.11 ms at 1 MB/s.
        let (mut pages, a, b, ups) = two_buffers_of_two_pages();
        for index in 0..2 {
            pages.page_mut(page(a, index)).gpu = resident(index);
        }
        // A tier of 40 kB fills in 40 ms; with the jitter margin `b` is within its reach.
        let mut plan = TierPlan::new(Tier::Gpu, LEAD_FACTOR, 40_000);
        plan.replan(&ups, 5, 1e6, &pages, &Overwrites::default());
        assert_eq!(plan.queue, [(page(b, 0), 15), (page(b, 1), 15)]);
        assert_eq!(plan.horizon, 15);
        // One of 30 kB fills in 30 ms: `b` is beyond it, for a later plan.
        let mut plan = TierPlan::new(Tier::Gpu, LEAD_FACTOR, 30_000);
        plan.replan(&ups, 5, 1e6, &pages, &Overwrites::default());
        assert!(plan.queue.is_empty());
        assert_eq!(plan.horizon, 6);
    }

    /// A predictor that predicts `seq` surely, one access a millisecond, and records the
    /// window of each question.
    struct Scripted {
        seq: Vec<BufferId>,
        at: usize,
        asked: Asked,
    }

    /// The windows a [`Scripted`] predictor was asked for.
    type Asked = std::sync::Arc<std::sync::Mutex<Vec<usize>>>;

    impl Scripted {
        fn new(seq: &[BufferId]) -> (Box<Scripted>, Asked) {
            let asked = Asked::default();
            let predictor = Scripted {
                seq: seq.to_vec(),
                at: 0,
                asked: asked.clone(),
            };
            (Box::new(predictor), asked)
        }
    }

    impl Predictor for Scripted {
        fn name(&self) -> &'static str {
            "scripted"
        }
        fn on_access(&mut self, _: BufferId, _: Duration) {
            self.at += 1;
        }
        fn end_step(&mut self, _: Duration) {}
        fn upcoming(&self, limit: usize) -> Vec<Upcoming> {
            self.asked.lock().unwrap().push(limit);
            (self.at..self.seq.len())
                .take(limit)
                .map(|i| {
                    let k = (i - self.at) as u64;
                    upcoming(self.seq[i].0, k, k)
                })
                .collect()
        }
        fn stats(&self) -> PredictorStats {
            PredictorStats::default()
        }
        fn has_history(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_plan_serves_the_accesses_it_predicted_and_its_window_follows_the_horizon() {
        let mut pages = PageTable::new(100);
        let seq: Vec<BufferId> = (0..400)
            .map(|_| pages.insert(100, vec![Page::new(None)]))
            .collect();
        let (predictor, asked) = Scripted::new(&seq);
        let mut access = Access::new(predictor, true, 0);
        let lookahead = 1024;
        // At 1 TB/s the horizon is the jitter margin: 10 ms, the entry at 11 ms ends it.
        let plan = |a: &mut Access| a.replan(lookahead, &pages, 1e12, None);
        let step = |a: &mut Access, b: BufferId| {
            a.on_access(b, false, Duration::ZERO);
            plan(a);
        };
        let asked_now = || std::mem::take(&mut *asked.lock().unwrap());
        plan(&mut access);
        assert_eq!(asked_now(), [lookahead], "a first plan is whole");
        assert_eq!(access.gpu_plan.queue.len(), 11);
        // While pages of the plan wait for a place, every access plans again, although
        // each comes as predicted.
        for &b in &seq[..2] {
            step(&mut access, b);
        }
        // The first from the least window, the next from twice the horizon's reach.
        assert_eq!(asked_now(), [WINDOW_MIN_ACCESSES, 22]);
        // Everything planned has started (the pump took the queues): the next accesses
        // as predicted surely are served by the plan, then it plans again from a window
        // the horizon does not pass.
        access.gpu_plan.queue.clear();
        for &b in &seq[2..2 + PLAN_REUSE_ACCESSES_MAX] {
            step(&mut access, b);
        }
        assert_eq!(asked_now(), [22]);
        assert_eq!(access.gpu_plan.queue.len(), 11);
        // A surprise plans at once, from twice the horizon's reach.
        step(&mut access, seq[300]);
        assert_eq!(asked_now(), [22]);
        // The horizon widens (a slower tier): the window doubles until it holds it, and a
        // horizon past the widest window takes the whole lookahead.
        access.expected.clear();
        access.on_access(seq[301], false, Duration::ZERO);
        access.replan(lookahead, &pages, 1e4, None);
        assert_eq!(asked_now(), [22, 44, 88, 176, 256, lookahead]);
    }

    #[test]
    fn a_budget_holding_every_page_keeps_its_plans_within_the_partial_window() {
        // Every buffer on the GPU, and a budget that takes longer to fill than the whole
        // sequence lasts: only REACH_ACCESSES_MAX ends the horizon.
        let mut pages = PageTable::new(100);
        let seq: Vec<BufferId> = (0..400)
            .map(|i| {
                let mut p = Page::new(None);
                p.gpu = resident(i);
                pages.insert(100, vec![p])
            })
            .collect();
        let (predictor, asked) = Scripted::new(&seq);
        let mut access = Access::new(predictor, true, 1 << 30);
        let lookahead = 1024;
        access.replan(lookahead, &pages, 1e6, None);
        assert_eq!(access.gpu_plan.horizon, REACH_ACCESSES_MAX);
        asked.lock().unwrap().clear();
        for &b in &seq[..3] {
            access.on_access(b, false, Duration::ZERO);
            access.expected.clear();
            access.replan(lookahead, &pages, 1e6, None);
        }
        let asked = std::mem::take(&mut *asked.lock().unwrap());
        assert!(
            asked.iter().all(|&w| w <= PARTIAL_LOOKAHEAD_ACCESSES),
            "windows asked: {asked:?}"
        );
        assert!(access.gpu_plan.queue.is_empty());
    }

    #[test]
    fn a_guess_is_planned_only_within_the_speculation_cap() {
        // Pages of 100 bytes; a sure buffer of 4 pages, then guesses of `n` pages each,
        // sized from the cap so that one guess at probability 0.5 fits and two do not:
        // the cap is R x (400 sure + one page of 100) = 500 R, a guess's expected unused
        // bytes 0.5 x 100 n = 300 R.
        let n = (6.0 * SPECULATION_WASTE_RATIO).ceil() as usize;
        let mut pages = PageTable::new(100);
        let sure = pages.insert(400, (0..4).map(|_| Page::new(None)).collect());
        let guesses: Vec<BufferId> = (0..4)
            .map(|_| pages.insert(100 * n as u64, (0..n).map(|_| Page::new(None)).collect()))
            .collect();
        let guess = |b: BufferId, d: u64, p: f64| Upcoming {
            buffer: b,
            distance: d,
            time_until: Duration::from_millis(d),
            probability: p,
        };
        // The sure buffer counts wherever it stands in the lookahead (here after the
        // guesses).
        let mut ups: Vec<Upcoming> = guesses
            .iter()
            .enumerate()
            .map(|(i, &g)| guess(g, i as u64, 0.5))
            .collect();
        ups.push(upcoming(sure.0, 7, 7));
        // At 1 B/s the horizon covers every access: only the cap limits.
        let slow = 1.0;
        let mut plan = TierPlan::new(Tier::Gpu, LEAD_FACTOR, 0);
        plan.replan(&ups, 0, slow, &pages, &Overwrites::default());
        let planned: Vec<BufferId> = plan.queue.iter().map(|(p, _)| p.buffer).collect();
        let mut want = vec![guesses[0]; n];
        want.extend([sure; 4]);
        assert_eq!(planned, want);
        let waste = 0.5 * 100.0 * n as f64;
        let cap = SPECULATION_WASTE_RATIO * 500.0;
        assert!(waste <= cap && 2.0 * waste > cap);
        // A guess already loading counts against the cap: the next one does not fit.
        pages.page_mut(page(guesses[0], 0)).gpu = Gpu::Loading {
            frame: spillway_types::FrameId(0),
            prefetch: true,
        };
        plan.replan(&ups, 0, slow, &pages, &Overwrites::default());
        let planned: Vec<BufferId> = plan.queue.iter().map(|(p, _)| p.buffer).collect();
        let mut want = vec![guesses[0]; n - 1];
        want.extend([sure; 4]);
        assert_eq!(planned, want);
        // Sure predictions are never capped; nearly sure guesses (0.95) fit ten times
        // more: all four (expected unused 4 x 0.05 x 100 n = 120 R <= 500 R).
        let ups: Vec<Upcoming> = std::iter::once(upcoming(sure.0, 0, 0))
            .chain(
                guesses
                    .iter()
                    .enumerate()
                    .map(|(i, &g)| guess(g, 1 + i as u64, 0.95)),
            )
            .collect();
        plan.replan(&ups, 0, slow, &pages, &Overwrites::default());
        assert_eq!(plan.queue.len(), 4 + (n - 1) + 3 * n);
    }
}
