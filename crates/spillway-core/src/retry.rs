//! Bounded retry of an operation that keeps failing: exponential backoff between
//! attempts, and a deadline after which the failure is final.
//!
//! Sans-IO like the rest of the core: the caller passes `now` and asks [`Backoff::ready`]
//! before each attempt; [`Backoff::retry_at`] is the instant a driver should wake the core
//! at (the core's `poll_timeout`). A success resets it.
//!
//! Used for spills to the remote tier: a spill that the tier refuses (no room on peers, a
//! peer unreachable) is retried after [`Backoff::delay`], doubling up to `max`, so a full
//! pool becomes back-pressure (acquires wait) rather than a spin; when spills have failed
//! without one success for `deadline`, the pool fails with a typed error.

use std::time::Duration;

/// What a failure means for the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Try again at this instant (or later).
    RetryAt(Duration),
    /// Failures went on for the whole deadline: give up. Carries how long they went on.
    GiveUp(Duration),
}

/// Backoff state of one kind of operation.
#[derive(Clone, Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    deadline: Duration,
    delay: Duration,
    failing_since: Option<Duration>,
    retry_at: Option<Duration>,
    failures: u64,
}

impl Backoff {
    /// Waits of `min` doubling up to `max` between attempts; gives up after `deadline` of
    /// failures without a success.
    pub fn new(min: Duration, max: Duration, deadline: Duration) -> Self {
        debug_assert!(min <= max && !min.is_zero());
        Backoff {
            min,
            max,
            deadline,
            delay: Duration::ZERO,
            failing_since: None,
            retry_at: None,
            failures: 0,
        }
    }

    /// Whether an attempt may start at `now`.
    pub fn ready(&self, now: Duration) -> bool {
        self.retry_at.is_none_or(|at| now >= at)
    }

    /// When the next attempt may start, while backing off.
    pub fn retry_at(&self) -> Option<Duration> {
        self.retry_at
    }

    /// The wait before the next attempt (zero when not failing).
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// Failures since the last success.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// Records a failure at `now`.
    pub fn on_failure(&mut self, now: Duration) -> Verdict {
        let since = *self.failing_since.get_or_insert(now);
        self.failures += 1;
        let failing_for = now.saturating_sub(since);
        if failing_for >= self.deadline {
            return Verdict::GiveUp(failing_for);
        }
        self.delay = (self.delay * 2).clamp(self.min, self.max);
        let at = now + self.delay;
        // Never later than the deadline, so the verdict comes on time.
        let at = at.min(since + self.deadline);
        self.retry_at = Some(self.retry_at.map_or(at, |r| r.max(at)));
        Verdict::RetryAt(at)
    }

    /// Records a success: the next failure starts from `min` again.
    pub fn on_success(&mut self) {
        self.delay = Duration::ZERO;
        self.failing_since = None;
        self.retry_at = None;
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn waits_double_up_to_the_max_and_a_success_resets_them() {
        let mut b = Backoff::new(10 * MS, 80 * MS, Duration::from_secs(10));
        assert!(b.ready(Duration::ZERO));
        let mut now = Duration::ZERO;
        let mut delays = Vec::new();
        for _ in 0..6 {
            match b.on_failure(now) {
                Verdict::RetryAt(at) => {
                    delays.push((at - now).as_millis());
                    assert!(!b.ready(at - MS));
                    assert!(b.ready(at));
                    now = at;
                }
                v => panic!("gave up early: {v:?}"),
            }
        }
        assert_eq!(delays, vec![10, 20, 40, 80, 80, 80]);
        assert_eq!(b.failures(), 6);
        b.on_success();
        assert!(b.ready(now));
        assert_eq!(b.retry_at(), None);
        assert_eq!(b.on_failure(now), Verdict::RetryAt(now + 10 * MS));
    }

    #[test]
    fn gives_up_once_failures_last_the_deadline() {
        let mut b = Backoff::new(100 * MS, Duration::from_secs(1), Duration::from_secs(2));
        let mut now = Duration::from_secs(5);
        let start = now;
        let verdict = loop {
            match b.on_failure(now) {
                Verdict::RetryAt(at) => {
                    assert!(
                        at <= start + Duration::from_secs(2),
                        "retry past the deadline"
                    );
                    now = at;
                }
                v => break v,
            }
        };
        assert_eq!(verdict, Verdict::GiveUp(Duration::from_secs(2)));
    }
}
