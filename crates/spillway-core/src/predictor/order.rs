//! [`OrderPredictor`] (`order`): the learned predictor made aware of orders that diverge
//! within a step (mixture-of-experts routing), in the spirit of MoE-Infinity's expert
//! activation matrix, for any job (the buffers are opaque: no layer or expert is named).
//!
//! It runs a [`TracePredictor`] (the cursors over earlier steps) and adds three things.
//!
//! 1. **The order within the step.** A step often uses a buffer twice: forward then
//!    backward, forward then recomputation, one micro-batch then the next. Each earlier
//!    step `T` knows, for each position, where the same buffer comes back in that step
//!    (`next_in_step`). Each access of the current step is *aligned* to a position of `T`
//!    (the one its cursor matched or jumped to; for a buffer `T` does not have there, the
//!    position the cursor expected: the slot it took, such as an expert routed instead of
//!    `T`'s). Where `T` says "position `s` comes back at `r`", the buffers of the current
//!    step aligned to `s` are predicted at `r`, *in place of* `T`'s own buffer there,
//!    which is predicted only if the current step used it. So the experts this step chose
//!    in the forward pass are predicted for its backward pass, and the experts `T` chose
//!    but this step did not are not. For a dense job this predicts what the cursor
//!    alone predicts.
//! 2. **Measured probability.** Each buffer's probability is the share of the earlier
//!    steps that predict it from where the job is now, weighted by each step's match
//!    score (the cursor's exponential average of matches: steps whose choices matched the
//!    recent ones, the experts of layer *l*, weigh more for layer *l+1*; MoE-Infinity
//!    matches the current activation matrix to past ones in the same way). Entries the
//!    cursor skipped (kept predicted in case two layers swapped) have the probability
//!    measured for such entries: the share of them that came back before expiring.
//! 3. **Speculation bounded by it.** A buffer predicted `d` accesses ahead with
//!    probability `p` is returned at distance `(d + 1) / p - 1` and time `t / p`, so the
//!    pool, which prefetches within a horizon nearest first and evicts the furthest next
//!    use, loads a guess only after the pages surely needed sooner, and never evicts a
//!    page for it that is surely needed before the guess's weighted distance. Demand
//!    fetches go before any prediction in the pool.
//! 4. **Speculation capped by its measured precision.** The weighting orders guesses;
//!    it does not bound how many are moved when the horizon is long (much compute per
//!    access), and on divergent steps (MoE at batch 1) guesses that never come are bytes
//!    moved for nothing (issue 12: 86-88 MiB per step on `moe.jsonl`, more than clock
//!    moved in all). So the guesses returned (predictions of probability below 1) are
//!    counted, and the share of them used before their step ended is measured
//!    ([`OrderPredictor::guess_precision`], with a prior of one hit and one miss); once
//!    16 guesses are measured, a guess's probability is at most that precision. The planner caps the bytes of
//!    guesses it loads by it (`pool::plan`, [`crate::pool::SPECULATION_WASTE_RATIO`]):
//!    their expected unused bytes stay within a share of the sure bytes planned.
//!
//! State beyond the [`TracePredictor`]: per earlier step, the buffers aligned to each of
//! its positions in the current step (at most one entry per access of the step), and the
//! set of buffers used in the step, both cleared at every step's end.

use std::cell::RefCell;
use std::time::Duration;

use spillway_types::BufferId;

use super::trace::{NO_POSITION, SCORE_FLOOR};
use super::{Predictor, PredictorStats, TracePredictor, Upcoming};
use crate::idmap::{IdMap, IdSet};

/// Lowest probability given to a prediction (so its weighted distance stays finite).
const PROBABILITY_MIN: f64 = 1.0 / 64.0;
/// Prior of the skipped-entries probability: as if this many of them had come back and as
/// many had not.
const PENDING_PRIOR: f64 = 1.0;
/// Prior of the guess precision: as if this many guesses had been used and as many not.
const GUESS_PRIOR: f64 = 1.0;
/// Guesses measured before their precision bounds a guess's probability.
const GUESS_SAMPLES_MIN: f64 = 16.0;

/// What one earlier step knows of the current step (see the module docs).
#[derive(Debug, Default, Clone)]
struct Alignment {
    /// Position of that step where each buffer of the current step comes back: the
    /// buffers predicted there instead of that step's own.
    echo_at: IdMap<u32, Vec<BufferId>>,
    /// The furthest position of that step the current step has been aligned to (the
    /// positions up to it are passed: their echoes are known).
    reached: Option<u32>,
}

/// See the module docs.
#[derive(Debug)]
pub struct OrderPredictor {
    inner: TracePredictor,
    /// One per trace of `inner.history`, in the same order.
    aligned: Vec<Alignment>,
    /// Buffers used in the current step.
    used: IdSet<BufferId>,
    /// Skipped entries that came back, and that expired or were dropped at a step's end.
    pending_hits: f64,
    pending_misses: f64,
    /// `inner`'s step count when `aligned` was last reset.
    steps_seen: u64,
    /// Guesses returned in this step not yet used (filled by [`Predictor::upcoming`],
    /// which takes `&self`; at most one entry per buffer).
    guessed: RefCell<IdSet<BufferId>>,
    /// Guesses used before their step ended, and not.
    guess_hits: f64,
    guess_misses: f64,
}

impl OrderPredictor {
    /// A predictor keeping `history_steps` earlier steps.
    pub fn new(history_steps: usize) -> OrderPredictor {
        OrderPredictor {
            inner: TracePredictor::new(history_steps),
            aligned: Vec::new(),
            used: IdSet::default(),
            pending_hits: 0.0,
            pending_misses: 0.0,
            steps_seen: 0,
            guessed: RefCell::new(IdSet::default()),
            guess_hits: 0.0,
            guess_misses: 0.0,
        }
    }

    /// The share of the guesses returned that were used before their step ended (with
    /// a prior of one used and one not).
    pub fn guess_precision(&self) -> f64 {
        (self.guess_hits + GUESS_PRIOR) / (self.guess_hits + self.guess_misses + 2.0 * GUESS_PRIOR)
    }

    /// The probability measured for entries the cursor skipped.
    fn pending_probability(&self) -> f64 {
        (self.pending_hits + PENDING_PRIOR)
            / (self.pending_hits + self.pending_misses + 2.0 * PENDING_PRIOR)
    }

    /// A new step began in `inner` (marked or detected): alignments start over.
    fn on_new_step(&mut self) {
        self.pending_misses += self.inner.pending.len() as f64;
        let guessed = self.guessed.get_mut();
        self.guess_misses += guessed.len() as f64;
        guessed.clear();
        self.aligned = vec![Alignment::default(); self.inner.history.len()];
        self.used.clear();
        self.steps_seen = self.inner.stats().steps;
    }
}

impl Predictor for OrderPredictor {
    fn name(&self) -> &'static str {
        "order"
    }

    fn on_access(&mut self, buffer: BufferId, now: Duration) {
        if self.inner.stats().steps != self.steps_seen {
            self.on_new_step();
        }
        // How the skipped entries fared: those that expire at this access, or this one.
        let count = self.inner.stats().accesses + 1;
        for &(b, expires) in &self.inner.pending {
            if b == buffer {
                self.pending_hits += 1.0;
            } else if expires <= count {
                self.pending_misses += 1.0;
            }
        }
        if self.guessed.get_mut().remove(&buffer) {
            self.guess_hits += 1.0;
        }
        let before: Vec<usize> = self.inner.history.iter().map(|(_, c)| c.pos).collect();
        self.inner.on_access(buffer, now);
        if self.inner.stats().steps != self.steps_seen {
            // This access ended a step (a detected period, or the step's size limit).
            self.on_new_step();
            return;
        }
        self.used.insert(buffer);
        for (i, ((trace, cursor), &p0)) in self.inner.history.iter().zip(&before).enumerate() {
            let n = trace.len();
            if n == 0 {
                continue;
            }
            let s = if trace.seq[p0] == buffer {
                p0
            } else if cursor.pos != p0 {
                (cursor.pos + n - 1) % n
            } else {
                // Not expected here: the nearest earlier position of the buffer in that
                // step if it has one before the cursor, else the slot it took.
                match trace.positions.get(&buffer) {
                    Some(ps) => match ps.partition_point(|&q| (q as usize) < p0) {
                        0 => p0,
                        j => ps[j - 1] as usize,
                    },
                    None => p0,
                }
            };
            let a = &mut self.aligned[i];
            a.reached = Some(a.reached.map_or(s as u32, |r| r.max(s as u32)));
            let r = trace.next_in_step[s];
            if r != NO_POSITION {
                let at = a.echo_at.entry(r).or_default();
                if !at.contains(&buffer) {
                    at.push(buffer);
                }
            }
        }
    }

    fn end_step(&mut self, now: Duration) {
        self.inner.end_step(now);
        self.on_new_step();
    }

    fn upcoming(&self, limit: usize) -> Vec<Upcoming> {
        if !self.inner.has_history() || self.aligned.len() != self.inner.history.len() {
            return self.inner.upcoming(limit);
        }
        struct Agg {
            distance: u64,
            time_until: Duration,
            weight: f64,
            last_trace: usize,
        }
        let mut agg: IdMap<BufferId, Agg> = IdMap::default();
        agg.reserve(limit.min(1024));
        let mut total_weight = 0.0;
        for (i, ((trace, cursor), a)) in self.inner.history.iter().zip(&self.aligned).enumerate() {
            let n = trace.len();
            if cursor.score < SCORE_FLOOR || n == 0 {
                continue;
            }
            let w = cursor.score;
            total_weight += w;
            let mut offer = |b: BufferId, k: usize| {
                // The time only where the entry is new or nearer.
                let e = agg.entry(b).or_insert_with(|| Agg {
                    distance: k as u64,
                    time_until: trace.time_between(cursor.pos, k),
                    weight: 0.0,
                    last_trace: usize::MAX,
                });
                if e.last_trace != i {
                    e.last_trace = i;
                    e.weight += w;
                }
                if (k as u64) < e.distance {
                    e.distance = k as u64;
                    e.time_until = trace.time_between(cursor.pos, k);
                }
            };
            for k in 0..limit.min(n) {
                let pos = cursor.pos + k;
                let r = pos % n;
                let src = trace.prev_in_step[r];
                let passed = pos < n && src != NO_POSITION && a.reached.is_some_and(|m| src <= m);
                if passed {
                    if let Some(bs) = a.echo_at.get(&(r as u32)) {
                        for &b in bs {
                            offer(b, k);
                        }
                    }
                    if self.used.contains(&trace.seq[r]) {
                        offer(trace.seq[r], k);
                    }
                } else {
                    offer(trace.seq[r], k);
                }
            }
        }
        let pending_p = self.pending_probability().clamp(PROBABILITY_MIN, 1.0);
        let mut out: Vec<Upcoming> = Vec::with_capacity(agg.len() + self.inner.pending.len());
        let pending: IdSet<BufferId> = self.inner.pending.iter().map(|&(b, _)| b).collect();
        for &b in &pending {
            if !agg.contains_key(&b) {
                out.push(weighted(b, 0, Duration::ZERO, pending_p));
            }
        }
        for (buffer, e) in agg {
            let p = if total_weight > 0.0 {
                (e.weight / total_weight).clamp(PROBABILITY_MIN, 1.0)
            } else {
                1.0
            };
            let u = weighted(buffer, e.distance, e.time_until, p);
            // A skipped entry is predicted now too: whichever comes first.
            let v = weighted(buffer, 0, Duration::ZERO, pending_p);
            out.push(if pending.contains(&buffer) && v.distance < u.distance {
                v
            } else {
                u
            });
        }
        out.sort_by_key(|u| (u.distance, u.time_until, u.buffer));
        out.truncate(limit);
        // A guess is no likelier than guesses have measured to be (module docs, 4).
        let q = if self.guess_hits + self.guess_misses >= GUESS_SAMPLES_MIN {
            self.guess_precision()
        } else {
            1.0
        };
        for u in out.iter_mut().filter(|u| u.probability < 1.0) {
            u.probability = u.probability.min(q).max(PROBABILITY_MIN);
        }
        self.guessed
            .borrow_mut()
            .extend(out.iter().filter(|u| u.probability < 1.0).map(|u| u.buffer));
        out
    }

    fn stats(&self) -> PredictorStats {
        self.inner.stats()
    }

    fn has_history(&self) -> bool {
        self.inner.has_history()
    }
}

/// A prediction at raw distance `d` and time `t` with probability `p`, weighted (see the
/// module docs).
fn weighted(buffer: BufferId, d: u64, t: Duration, p: f64) -> Upcoming {
    let distance = (((d + 1) as f64 / p).ceil() as u64)
        .saturating_sub(1)
        .max(d);
    Upcoming {
        buffer,
        distance,
        time_until: t.div_f64(p),
        probability: p,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(i: u64) -> BufferId {
        BufferId(i)
    }

    /// A mixture-of-experts training step: per layer an attention buffer, a router and
    /// `k` of `experts` experts chosen at random (distinct buffers per layer), then the
    /// output head, forward; then the head and the layers in reverse, each layer's
    /// experts in reverse.
    fn moe_step(rng: &mut u64, layers: u64, experts: u64, k: usize) -> (Vec<u64>, usize) {
        let mut chosen = Vec::new();
        for _ in 0..layers {
            let mut c: Vec<u64> = Vec::new();
            while c.len() < k {
                *rng ^= *rng << 13;
                *rng ^= *rng >> 7;
                *rng ^= *rng << 17;
                let e = *rng % experts;
                if !c.contains(&e) {
                    c.push(e);
                }
            }
            c.sort();
            chosen.push(c);
        }
        let mut seq = Vec::new();
        for (l, c) in chosen.iter().enumerate() {
            let l = l as u64;
            seq.extend([1000 + l, 2000 + l]);
            seq.extend(c.iter().map(|e| 10_000 + 100 * l + e));
        }
        seq.push(3000);
        let backward_from = seq.len();
        seq.push(3000);
        for (l, c) in chosen.iter().enumerate().rev() {
            let l = l as u64;
            seq.extend(c.iter().rev().map(|e| 10_000 + 100 * l + e));
            seq.extend([2000 + l, 1000 + l]);
        }
        (seq, backward_from)
    }

    /// Feeds `seq` as one step; returns, per access, whether it was among the first
    /// `window` predictions before it.
    fn feed(p: &mut dyn Predictor, seq: &[u64], window: usize, t: &mut u64) -> Vec<bool> {
        let mut hits = Vec::new();
        for &x in seq {
            hits.push(p.upcoming(window).iter().any(|u| u.buffer == b(x)));
            p.on_access(b(x), Duration::from_micros(*t));
            *t += 10;
        }
        p.end_step(Duration::from_micros(*t));
        hits
    }

    #[test]
    fn the_order_within_the_step_predicts_the_experts_of_the_backward_pass() {
        let (layers, experts, k, window) = (6, 8, 2, 4);
        let mut order = OrderPredictor::new(4);
        let mut trace = TracePredictor::new(4);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let (mut t1, mut t2) = (0, 0);
        let mut expert_hits = [0u32; 2];
        let mut experts_backward = 0u32;
        for step in 0..12 {
            let (seq, backward_from) = moe_step(&mut rng, layers, experts, k);
            let h_order = feed(&mut order, &seq, window, &mut t1);
            let h_trace = feed(&mut trace, &seq, window, &mut t2);
            if step < 4 {
                continue;
            }
            for (i, &x) in seq.iter().enumerate().skip(backward_from) {
                if x >= 10_000 {
                    experts_backward += 1;
                    expert_hits[0] += u32::from(h_order[i]);
                    expert_hits[1] += u32::from(h_trace[i]);
                }
            }
        }
        // Every expert of the backward pass was chosen in this step's forward pass: the
        // order within the step knows them all; earlier steps' orders guess.
        assert_eq!(experts_backward, 8 * (layers as u32) * (k as u32));
        assert!(
            expert_hits[0] * 100 >= experts_backward * 95,
            "order: {expert_hits:?} of {experts_backward}"
        );
        assert!(
            expert_hits[1] < experts_backward * 3 / 4,
            "trace alone: {expert_hits:?} of {experts_backward}"
        );
    }

    #[test]
    fn a_guess_is_weighted_by_the_share_of_steps_that_made_it() {
        let mut p = OrderPredictor::new(4);
        let mut t = 0;
        // The buffer after `1` was 10 in three of four steps, 11 in one.
        for e in [10, 10, 11, 10] {
            feed(&mut p, &[1, e, 2, 3], 8, &mut t);
        }
        p.on_access(b(1), Duration::from_micros(t));
        let up = p.upcoming(8);
        let of = |x: u64| *up.iter().find(|u| u.buffer == b(x)).expect("predicted");
        let (likely, unlikely, sure) = (of(10), of(11), of(2));
        assert_eq!(sure.probability, 1.0);
        assert_eq!(sure.distance, 1);
        assert!((0.6..0.9).contains(&likely.probability), "{likely:?}");
        assert!((0.1..0.4).contains(&unlikely.probability), "{unlikely:?}");
        // A guess stands behind what is surely needed at its raw distance or sooner:
        // raw distance 0 at probability p plans as (0 + 1) / p - 1.
        assert_eq!(
            likely.distance,
            ((1.0 / likely.probability).ceil() as u64) - 1
        );
        assert!(unlikely.distance > sure.distance, "{up:?}");
        assert!(unlikely.distance >= 3, "{up:?}");
        for w in up.windows(2) {
            assert!(w[0].distance <= w[1].distance);
        }
    }

    #[test]
    fn a_dense_job_is_predicted_as_the_trace_predictor_does() {
        let mut order = OrderPredictor::new(4);
        let mut trace = TracePredictor::new(4);
        let seq: Vec<u64> = (0..12).chain((0..12).rev()).collect();
        let (mut t1, mut t2) = (0, 0);
        for _ in 0..3 {
            feed(&mut order, &seq, 6, &mut t1);
            feed(&mut trace, &seq, 6, &mut t2);
        }
        for &x in &seq {
            assert_eq!(order.upcoming(16), trace.upcoming(16));
            order.on_access(b(x), Duration::from_micros(t1));
            trace.on_access(b(x), Duration::from_micros(t2));
            t1 += 10;
            t2 += 10;
        }
    }

    #[test]
    fn a_guess_is_no_likelier_than_guesses_measured_to_be() {
        // MoE at batch 1: one expert of 16 per layer, chosen at random each step, so a
        // guess of the forward pass's expert is right about one time in 16.
        let (layers, experts, k, window) = (8, 16, 1, 64);
        let mut p = OrderPredictor::new(4);
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut t = 0u64;
        let mut answers = 0;
        for step in 0..10 {
            let (seq, _) = moe_step(&mut rng, layers, experts, k);
            for &x in &seq {
                let up = p.upcoming(window);
                if step >= 4 {
                    // No guess is likelier than guesses measured to be.
                    let q = p.guess_precision();
                    for u in up.iter().filter(|u| u.probability < 1.0) {
                        assert!(u.probability <= q.max(PROBABILITY_MIN), "{u:?} at {q}");
                        answers += 1;
                    }
                }
                p.on_access(b(x), Duration::from_micros(t));
                t += 10;
            }
            p.end_step(Duration::from_micros(t));
        }
        assert!(answers > 0);
        // The forward pass's guesses are mostly wrong, and measured so.
        let q = p.guess_precision();
        assert!(q < 0.5, "precision {q}");
        assert!(
            p.guess_hits + p.guess_misses > 20.0,
            "{} {}",
            p.guess_hits,
            p.guess_misses
        );
    }
}
