//! Prefetch predictors: which buffers the job will acquire next, and how soon.
//!
//! The pool holds one [`Predictor`] (under [`spillway_types::config::Policy::Learned`]),
//! tells it every acquire and every step end, and after each asks for the upcoming
//! accesses, which it turns into a prefetch plan and into each resident page's next use
//! (for eviction). Implementations:
//! - [`TracePredictor`] (`trace`): the order of earlier steps, matched by cursors that
//!   survive divergence (see [`trace`]);
//! - [`OrderPredictor`] (`order`): the same, plus the order within the step (what this
//!   step used comes back where earlier steps' did) and a measured probability for each
//!   guess, which bounds how far speculation may push out pages surely needed (see
//!   [`order`]). Mixture-of-experts routing is its case in point.
//!
//! ## Contract, for every implementation
//! - The caller guarantees: [`Predictor::on_access`] once per acquire, in the order the job
//!   acquires, with `now` never decreasing; [`Predictor::end_step`] where the job marks the
//!   end of a step (a job may never mark steps); [`Predictor::upcoming`] at any time.
//! - `upcoming(limit)` MUST return at most `limit` entries, each buffer at most once,
//!   sorted by `distance` (then `time_until`), each with `probability` in `(0, 1]`. It
//!   SHOULD give each buffer its nearest predicted distance. Entries are predictions only:
//!   the pool prefetches them ahead of need, and demand always goes before them.
//! - `probability` is the implementation's estimate that the access happens (as measured:
//!   an implementation that cannot tell says 1). `distance` and `time_until` are what the
//!   pool plans by (it loads nearest first within a horizon, and evicts the furthest next
//!   use): an implementation that guesses MUST weight them by the guess's probability, no
//!   nearer than `(d + 1) / p - 1` accesses and `t / p` for a raw distance `d` and time
//!   `t`, so that a guess never displaces a page surely needed sooner.
//! - Any order of buffers is valid input (unknown buffers, repeats, empty steps, steps of
//!   [`spillway_types::limits::TRACE_ACCESSES_PER_STEP_MAX`] accesses): an implementation
//!   never panics on it. State is bounded by the history it keeps: at most
//!   [`spillway_types::limits::HISTORY_STEPS_MAX`] steps of at most
//!   `TRACE_ACCESSES_PER_STEP_MAX` accesses.

use std::time::Duration;

use spillway_types::BufferId;

pub mod order;
pub mod trace;

pub use order::OrderPredictor;
pub use trace::TracePredictor;

/// One predicted upcoming access.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Upcoming {
    /// The buffer predicted.
    pub buffer: BufferId,
    /// How many accesses from now (0 = the next one), weighted by `probability` (see the
    /// module docs).
    pub distance: u64,
    /// Predicted time from now until the access, weighted by `probability`.
    pub time_until: Duration,
    /// Estimated probability that the access happens, in `(0, 1]`.
    pub probability: f64,
}

/// Counters of how well predictions held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PredictorStats {
    /// Accesses recorded.
    pub accesses: u64,
    /// Accesses the best cursor expected exactly.
    pub matched: u64,
    /// Steps completed (marked or detected).
    pub steps: u64,
    /// Period detected in a job that never marks steps, in accesses.
    pub detected_period: Option<u64>,
}

/// A prefetch predictor. See the module docs for the contract.
pub trait Predictor: Send {
    /// A short name for logs and benchmarks.
    fn name(&self) -> &'static str;
    /// Records an access to `buffer` at `now`.
    fn on_access(&mut self, buffer: BufferId, now: Duration);
    /// Marks the end of a step at `now`; the next access starts the next step.
    fn end_step(&mut self, now: Duration);
    /// Predicted upcoming accesses, nearest first, at most `limit` of them.
    fn upcoming(&self, limit: usize) -> Vec<Upcoming>;
    /// Counters so far.
    fn stats(&self) -> PredictorStats;
    /// Whether any earlier step is known (predictions beyond the first step exist).
    fn has_history(&self) -> bool;
}
