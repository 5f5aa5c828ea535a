//! [`TracePredictor`], the learned predictor: the order of accesses of earlier steps.
//!
//! Each step's accesses (buffer ids, with the time since the step began) are recorded as
//! a *trace*. The predictor keeps the last `history_steps` traces and, for each, a
//! *cursor*: where in that trace the job is now. On every access each cursor moves:
//! - the access is the one the trace expected: the cursor steps past it;
//! - the access is further ahead in the trace (a layer was skipped): the cursor jumps to
//!   just after it, and the entries it jumped over stay predicted for a while (they may
//!   come back: two layers swapped), until they are used or expire;
//! - the access is closer *behind* the cursor than ahead (the second of two swapped
//!   layers, a re-read): the cursor stays;
//! - the buffer is not in the trace at all (a new branch, a new expert): the cursor stays.
//!
//! So one divergent access costs at most that access; the rest of the trace stays useful
//! (unlike systems that discard the trace on the first mismatch). Cursors wrap: the end
//! of a trace predicts the start of the next step.
//!
//! Predictions ([`TracePredictor::upcoming`]) are the union of the traces whose cursors have
//! matched recently (a score, an exponential average of matches), each buffer at its
//! nearest predicted distance. With several different recent steps (mixture-of-experts
//! routing that changes per step) the union predicts every expert chosen recently at that
//! point; the pool then loads as many of them as the budget allows, nearest first.
//!
//! Steps come from [`TracePredictor::end_step`]. A job that never marks steps gets them from
//! period detection: each access whose buffer was seen `p` accesses ago (one of its last few
//! positions) proposes period `p`; a proposal survives while every following access equals the one `p` before it,
//! and once it has held for a whole period the smallest such `p` is taken, and from then
//! on a step is cut every `p` accesses. A warm-up prefix before the loop does no harm. Memory is bounded by `history_steps` traces of at most
//! [`limits::TRACE_ACCESSES_PER_STEP_MAX`] accesses.

use std::collections::VecDeque;

use crate::idmap::IdMap;
use std::time::Duration;

use spillway_types::{BufferId, limits};

use super::{Predictor, PredictorStats, Upcoming};

/// Weight of the newest access in a cursor's match score.
const SCORE_ALPHA: f64 = 0.1;
/// A trace whose score falls below this stops contributing predictions.
pub(super) const SCORE_FLOOR: f64 = 0.3;
/// Skipped entries stay predicted for this many accesses plus twice the skip length.
const PENDING_TTL_ACCESSES: u64 = 8;
/// Most skipped entries kept predicted at once.
const PENDING_MAX: usize = 256;
/// During the first step, how many of its first accesses are predicted to come back at
/// the start of the next step.
const PROVISIONAL_PREFIX_ACCESSES: usize = 4;
/// Most period candidates tracked while detecting a period.
const PERIOD_CANDIDATES_MAX: usize = 64;
/// A period is accepted once the sequence has repeated itself for a whole period and for
/// at least this many accesses (so a buffer used twice in a row is not a period of 1).
const PERIOD_MIN_RUN: usize = 4;
/// Earlier positions of each buffer that propose periods: a buffer used several times per
/// step (forward and backward) needs more than its last position.
const PERIOD_OCCURRENCES_KEPT: usize = 4;

/// One recorded step.
#[derive(Debug, Clone)]
pub(super) struct Trace {
    pub(super) seq: Vec<BufferId>,
    /// Time from the step's start to each access.
    offsets: Vec<Duration>,
    /// Time from the step's start to the start of the next step.
    duration: Duration,
    /// Sorted positions of each buffer in `seq`.
    pub(super) positions: IdMap<BufferId, Vec<u32>>,
    /// For each position, the next position of the same buffer in this step
    /// ([`NO_POSITION`]: none): where a buffer used here comes back within the step.
    pub(super) next_in_step: Vec<u32>,
    /// For each position, the previous position of the same buffer in this step
    /// ([`NO_POSITION`]: none).
    pub(super) prev_in_step: Vec<u32>,
}

/// No position (see [`Trace::next_in_step`]).
pub(super) const NO_POSITION: u32 = u32::MAX;

impl Trace {
    fn new(seq: Vec<BufferId>, offsets: Vec<Duration>, duration: Duration) -> Trace {
        let mut positions: IdMap<BufferId, Vec<u32>> = IdMap::default();
        for (i, b) in seq.iter().enumerate() {
            positions.entry(*b).or_default().push(i as u32);
        }
        let mut next_in_step = vec![NO_POSITION; seq.len()];
        let mut prev_in_step = vec![NO_POSITION; seq.len()];
        for ps in positions.values() {
            for w in ps.windows(2) {
                next_in_step[w[0] as usize] = w[1];
                prev_in_step[w[1] as usize] = w[0];
            }
        }
        Trace {
            seq,
            offsets,
            duration,
            positions,
            next_in_step,
            prev_in_step,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.seq.len()
    }

    /// Time from position `from` to position `from + k` (wrapping into later steps).
    pub(super) fn time_between(&self, from: usize, k: usize) -> Duration {
        let n = self.len();
        let (a, b) = (from % n, from + k);
        let laps = (b / n) as u32;
        let b = b % n;
        (self.offsets[b] + self.duration * laps).saturating_sub(self.offsets[a])
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Cursor {
    /// Position of the next expected access, in `0..len`.
    pub(super) pos: usize,
    pub(super) score: f64,
}

/// See the module docs.
#[derive(Debug)]
pub struct TracePredictor {
    pub(super) history: VecDeque<(Trace, Cursor)>,
    history_max: usize,
    current: Vec<BufferId>,
    current_offsets: Vec<Duration>,
    step_start: Option<Duration>,
    /// Skipped-over entries still predicted: (buffer, expires at access number).
    pub(super) pending: VecDeque<(BufferId, u64)>,
    steps_marked: bool,
    period: Option<usize>,
    /// Period candidates: (period, accesses in a row that repeat at that distance).
    candidates: Vec<(usize, usize)>,
    /// Last position of each buffer in the current run, while detecting a period.
    last_seen: IdMap<BufferId, VecDeque<usize>>,
    stats: PredictorStats,
}

impl TracePredictor {
    /// A predictor keeping `history_steps` traces.
    pub fn new(history_steps: usize) -> TracePredictor {
        TracePredictor {
            history: VecDeque::new(),
            history_max: history_steps.clamp(1, limits::HISTORY_STEPS_MAX),
            current: Vec::new(),
            current_offsets: Vec::new(),
            step_start: None,
            pending: VecDeque::new(),
            steps_marked: false,
            period: None,
            candidates: Vec::new(),
            last_seen: IdMap::default(),
            stats: PredictorStats::default(),
        }
    }

    fn finish_step(&mut self, now: Duration) {
        if self.current.is_empty() {
            return;
        }
        let start = self.step_start.unwrap_or(now);
        let seq = std::mem::take(&mut self.current);
        let offsets = std::mem::take(&mut self.current_offsets);
        let duration = now
            .saturating_sub(start)
            .max(offsets.last().copied().unwrap_or_default());
        self.push_trace(Trace::new(seq, offsets, duration));
        self.step_start = Some(now);
        self.stats.steps += 1;
    }

    fn push_trace(&mut self, trace: Trace) {
        // A new step begins: every cursor goes back to the start of its trace.
        for (_, c) in &mut self.history {
            c.pos = 0;
        }
        // The new trace starts as trusted as the best existing one, or fully.
        let score = self
            .history
            .iter()
            .map(|(_, c)| c.score)
            .fold(None, |m: Option<f64>, s| Some(m.map_or(s, |m| m.max(s))));
        if self.history.len() == self.history_max {
            self.history.pop_front();
        }
        self.history.push_back((
            trace,
            Cursor {
                pos: 0,
                score: score.unwrap_or(1.0).max(SCORE_FLOOR),
            },
        ));
        self.pending.clear();
    }

    /// The trace with the best score, the most recent among equals.
    fn best_index(&self) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (i, (_, c)) in self.history.iter().enumerate() {
            if best.is_none_or(|(_, s)| c.score >= s) {
                best = Some((i, c.score));
            }
        }
        best.map(|(i, _)| i)
    }

    fn detect_period(&mut self, now: Duration) {
        if let Some(p) = self.period {
            if self.current.len() >= p {
                self.finish_step(now);
            }
            return;
        }
        let n = self.current.len() - 1;
        let x = self.current[n];
        // Extend every candidate's run of positions where the sequence equals itself
        // `p` accesses earlier; drop those that break.
        let current = &self.current;
        self.candidates.retain_mut(|(p, run)| {
            if current[n] == current[n - *p] {
                *run += 1;
                true
            } else {
                false
            }
        });
        let seen = self.last_seen.entry(x).or_default();
        for &m in seen.iter() {
            let p = n - m;
            if !self.candidates.iter().any(|&(q, _)| q == p)
                && self.candidates.len() < PERIOD_CANDIDATES_MAX
            {
                self.candidates.push((p, 1));
            }
        }
        if seen.len() == PERIOD_OCCURRENCES_KEPT {
            seen.pop_front();
        }
        seen.push_back(n);
        let found = self
            .candidates
            .iter()
            .filter(|&&(p, run)| run >= p.max(PERIOD_MIN_RUN))
            .map(|&(p, _)| p)
            .min();
        if let Some(p) = found {
            // The last p accesses repeat the p before them: keep them as one step.
            let split = self.current.len() - p;
            let seq = self.current[split..].to_vec();
            let base = self.current_offsets[split];
            let offsets: Vec<Duration> = self.current_offsets[split..]
                .iter()
                .map(|t| t.saturating_sub(base))
                .collect();
            let start = self.step_start.unwrap_or(now) + base;
            self.current.clear();
            self.current_offsets.clear();
            self.push_trace(Trace::new(seq, offsets, now.saturating_sub(start)));
            self.step_start = Some(now);
            self.stats.steps += 1;
            self.period = Some(p);
            self.stats.detected_period = Some(p as u64);
            self.candidates.clear();
            self.last_seen.clear();
        }
    }
}

impl Predictor for TracePredictor {
    fn name(&self) -> &'static str {
        "trace"
    }

    /// Counters so far.
    fn stats(&self) -> PredictorStats {
        self.stats
    }

    /// Whether any earlier step is known (predictions exist).
    fn has_history(&self) -> bool {
        !self.history.is_empty()
    }

    /// Records an access to `buffer` at `now`.
    fn on_access(&mut self, buffer: BufferId, now: Duration) {
        let start = *self.step_start.get_or_insert(now);
        self.stats.accesses += 1;
        let count = self.stats.accesses;
        self.pending
            .retain(|&(b, expires)| b != buffer && expires > count);
        let best = self.best_index();
        for (i, (trace, cursor)) in self.history.iter_mut().enumerate() {
            let matched = advance(trace, cursor, buffer, |skipped| {
                if Some(i) == best {
                    let ttl = PENDING_TTL_ACCESSES + 2 * skipped.len() as u64;
                    for &b in skipped {
                        if self.pending.len() >= PENDING_MAX {
                            self.pending.pop_front();
                        }
                        self.pending.push_back((b, count + ttl));
                    }
                }
            });
            if matched && Some(i) == best {
                self.stats.matched += 1;
            }
        }
        self.current.push(buffer);
        self.current_offsets.push(now.saturating_sub(start));
        if !self.steps_marked {
            self.detect_period(now);
        }
        if self.current.len() >= limits::TRACE_ACCESSES_PER_STEP_MAX {
            self.finish_step(now);
        }
    }

    /// Marks the end of a step at `now`; the next access starts the next step.
    fn end_step(&mut self, now: Duration) {
        self.steps_marked = true;
        self.period = None;
        self.finish_step(now);
    }

    /// Predicted upcoming accesses, each buffer once at its nearest distance, sorted by
    /// distance, at most `limit` of them.
    fn upcoming(&self, limit: usize) -> Vec<Upcoming> {
        let mut nearest: IdMap<BufferId, Upcoming> = IdMap::default();
        let mut offer = |u: Upcoming| {
            nearest
                .entry(u.buffer)
                .and_modify(|e| {
                    if u.distance < e.distance {
                        *e = u
                    }
                })
                .or_insert(u);
        };
        for &(b, _) in &self.pending {
            offer(Upcoming {
                buffer: b,
                distance: 0,
                time_until: Duration::ZERO,
                probability: 1.0,
            });
        }
        if self.history.is_empty() {
            // The first step: nothing to learn from yet, but a loop's next iteration starts
            // where this one started, no sooner than this step's length from now. This
            // keeps the step's first buffers over pages with no predicted use.
            let elapsed = self.current_offsets.last().copied().unwrap_or_default();
            let n = self.current.len();
            for (k, &b) in self
                .current
                .iter()
                .take(PROVISIONAL_PREFIX_ACCESSES.min(limit))
                .enumerate()
            {
                offer(Upcoming {
                    buffer: b,
                    distance: (n + k) as u64,
                    time_until: elapsed,
                    probability: 1.0,
                });
            }
        }
        for (trace, cursor) in &self.history {
            if cursor.score < SCORE_FLOOR || trace.len() == 0 {
                continue;
            }
            let mut seen = 0usize;
            for k in 0..limit.min(trace.len()) {
                let b = trace.seq[(cursor.pos + k) % trace.len()];
                offer(Upcoming {
                    buffer: b,
                    distance: k as u64,
                    time_until: trace.time_between(cursor.pos, k),
                    probability: 1.0,
                });
                seen += 1;
            }
            debug_assert!(seen <= limit);
        }
        let mut out: Vec<Upcoming> = nearest.into_values().collect();
        out.sort_by_key(|u| (u.distance, u.time_until, u.buffer));
        out.truncate(limit);
        out
    }
}

/// Moves `cursor` over `trace` for an access to `buffer`; `skipped` receives the entries
/// jumped over. Returns whether the access was the expected one.
fn advance(
    trace: &Trace,
    cursor: &mut Cursor,
    buffer: BufferId,
    mut skipped: impl FnMut(&[BufferId]),
) -> bool {
    let n = trace.len();
    if n == 0 {
        return false;
    }
    let p = cursor.pos;
    if trace.seq[p] == buffer {
        cursor.pos = (p + 1) % n;
        cursor.score += SCORE_ALPHA * (1.0 - cursor.score);
        return true;
    }
    cursor.score *= 1.0 - SCORE_ALPHA;
    let Some(positions) = trace.positions.get(&buffer) else {
        return false;
    };
    let p32 = p as u32;
    let ahead = match positions.partition_point(|&q| q < p32) {
        i if i < positions.len() => positions[i] as usize - p,
        _ => positions[0] as usize + n - p,
    };
    let behind = match positions.partition_point(|&q| q < p32) {
        0 => p + n - *positions.last().expect("non-empty") as usize,
        i => p - positions[i - 1] as usize,
    };
    if ahead < behind {
        let jumped: Vec<BufferId> = (0..ahead).map(|k| trace.seq[(p + k) % n]).collect();
        skipped(&jumped);
        cursor.pos = (p + ahead + 1) % n;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(i: u64) -> BufferId {
        BufferId(i)
    }

    fn ms(i: u64) -> Duration {
        Duration::from_millis(i)
    }

    fn run_step(p: &mut TracePredictor, seq: &[u64], t0: &mut u64) -> Vec<bool> {
        // Returns, for each access, whether it was among the first 3 predicted before it.
        let mut hits = Vec::new();
        for &x in seq {
            let up = p.upcoming(3);
            hits.push(up.iter().any(|u| u.buffer == b(x)));
            p.on_access(b(x), ms(*t0));
            *t0 += 1;
        }
        p.end_step(ms(*t0));
        hits
    }

    #[test]
    fn predicts_the_next_step_in_order() {
        let mut p = TracePredictor::new(4);
        let mut t = 0;
        let seq = [1, 2, 3, 4, 4, 3, 2, 1];
        run_step(&mut p, &seq, &mut t);
        let up = p.upcoming(4);
        assert_eq!(
            up.iter().map(|u| u.buffer).collect::<Vec<_>>(),
            vec![b(1), b(2), b(3), b(4)]
        );
        assert_eq!(up[0].distance, 0);
        assert_eq!(up[2].time_until, ms(2));
        let hits = run_step(&mut p, &seq, &mut t);
        assert!(hits.iter().all(|&h| h), "{hits:?}");
    }

    #[test]
    fn survives_a_swap_and_a_skip() {
        let mut p = TracePredictor::new(4);
        let mut t = 0;
        let normal: Vec<u64> = (0..10).chain((0..10).rev()).collect();
        run_step(&mut p, &normal, &mut t);
        run_step(&mut p, &normal, &mut t);
        // Swap 3 and 4, skip 6, in both directions.
        let odd = [0, 1, 2, 4, 3, 5, 7, 8, 9, 9, 8, 7, 5, 3, 4, 2, 1, 0];
        let hits = run_step(&mut p, &odd, &mut t);
        assert!(hits.iter().all(|&h| h), "diverged step: {hits:?}");
        // The next normal step is predicted in full, 6 included.
        let hits = run_step(&mut p, &normal, &mut t);
        assert!(hits.iter().all(|&h| h), "next step: {hits:?}");
    }

    #[test]
    fn new_buffers_do_not_derail_the_cursor() {
        let mut p = TracePredictor::new(2);
        let mut t = 0;
        run_step(&mut p, &[1, 2, 3, 4], &mut t);
        p.on_access(b(1), ms(t));
        p.on_access(b(99), ms(t + 1));
        assert_eq!(p.upcoming(1)[0].buffer, b(2));
    }

    #[test]
    fn detects_the_period_without_step_marks() {
        let mut p = TracePredictor::new(2);
        // A warm-up access, then a loop of period 5.
        p.on_access(b(100), ms(0));
        let mut predicted = 0;
        for i in 0..40 {
            let x = b(i % 5);
            if p.has_history() && p.upcoming(1)[0].buffer == x {
                predicted += 1;
            }
            p.on_access(x, ms(1 + i));
        }
        assert_eq!(p.stats().detected_period, Some(5));
        assert!(predicted >= 25, "predicted {predicted}");
    }

    #[test]
    fn history_is_bounded() {
        let mut p = TracePredictor::new(3);
        let mut t = 0;
        for s in 0..10 {
            run_step(&mut p, &[s, s + 1], &mut t);
        }
        assert_eq!(p.history.len(), 3);
        assert_eq!(p.stats().steps, 10);
    }
}
