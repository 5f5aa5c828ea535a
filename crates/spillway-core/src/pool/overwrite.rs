//! [`Overwrites`]: which upcoming accesses overwrite their buffer, so the planner moves
//! no bytes for them.
//!
//! An acquire with discard ([`super::PoolCore::begin_acquire_discard`]) gets frames and
//! no load: the holder writes every byte. The predictor knows which buffers come next,
//! not how they are acquired, so the planner used to prefetch such a buffer's old bytes
//! only for the acquire to throw them away: training's gradient buffers (the first store
//! after `zero_grad` overwrites them) were loaded whole each step, 7.5 GB of 47.9 GB
//! moved host→GPU a step on the `bench/torch` Llama (issue 11).
//!
//! The pool remembers, per buffer, which of its accesses in the last marked step were
//! discards, by occurrence (the buffer's first, second, ... access of the step). The
//! buffer's next access is its next occurrence (or, once this step has used it as often
//! as the last one did, the next step's first): where that occurrence was a discard, the
//! next access is predicted to overwrite. The GPU tier then reserves frames for the
//! buffer's pages in plan order, with no copy (`Page::reserved`), and the host tier
//! stages none of them. A wrong guess costs a demand load, never a byte: a reserved
//! frame is given up, the page's bytes are where they were.
//!
//! Only marked steps ([`super::PoolCore::step`]) are learned from; a job that never marks
//! steps gets the plain plan. State: one entry per buffer used in the current step, and
//! one per buffer with a discard in the last step, each with the occurrences that
//! discarded: at most one per access, and a step's accesses are counted up to
//! [`limits::TRACE_ACCESSES_PER_STEP_MAX`] (past it the step is forgotten and teaches
//! nothing, as for a job that never marks steps). Worst case, both steps full of
//! discards: 2 x 2^22 occurrences of 4 bytes (32 MiB) plus one map entry (about 40
//! bytes) per buffer used.

use crate::idmap::IdMap;
use spillway_types::{BufferId, limits};

/// One buffer's accesses in a step: how many, and which of them (0-based occurrence
/// numbers, ascending) were discards.
#[derive(Debug, Default)]
struct Occurrences {
    count: u32,
    discards: Vec<u32>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Overwrites {
    /// The current step.
    step: IdMap<BufferId, Occurrences>,
    /// The last marked step, only buffers with at least one discard.
    last: IdMap<BufferId, Occurrences>,
    /// Accesses of the current step, up to the limit.
    accesses: usize,
    /// The current step passed the limit: it is not learned from.
    overflowed: bool,
}

impl Overwrites {
    /// `buffer` is acquired, with discard or not.
    pub(super) fn on_access(&mut self, buffer: BufferId, discard: bool) {
        if self.overflowed {
            return;
        }
        self.accesses += 1;
        if self.accesses > limits::TRACE_ACCESSES_PER_STEP_MAX {
            self.overflowed = true;
            self.step = IdMap::default();
            return;
        }
        let o = self.step.entry(buffer).or_default();
        if discard {
            o.discards.push(o.count);
        }
        o.count = o.count.saturating_add(1);
    }

    /// A step was marked: its discards predict the next step's.
    pub(super) fn end_step(&mut self) {
        self.last.clear();
        if !self.overflowed {
            self.last
                .extend(self.step.drain().filter(|(_, o)| !o.discards.is_empty()));
        }
        self.step.clear();
        self.accesses = 0;
        self.overflowed = false;
    }

    /// Whether `buffer`'s next access is predicted to overwrite it.
    pub(super) fn next_overwrites(&self, buffer: BufferId) -> bool {
        let Some(last) = self.last.get(&buffer) else {
            return false;
        };
        if self.overflowed {
            return false;
        }
        let used = self.step.get(&buffer).map_or(0, |o| o.count);
        let next = if used < last.count { used } else { 0 };
        last.discards.binary_search(&next).is_ok()
    }

    /// Whether any buffer's access is predicted to overwrite it (the planner skips its
    /// checks otherwise).
    pub(super) fn any(&self) -> bool {
        !self.last.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(i: u64) -> BufferId {
        BufferId(i)
    }

    #[test]
    fn the_next_occurrence_of_a_discard_in_the_last_step_overwrites() {
        let mut o = Overwrites::default();
        // A step: read 1, write-all 2 (discard), read 2, read 1.
        for (x, d) in [(1, false), (2, true), (2, false), (1, false)] {
            assert!(
                !o.next_overwrites(b(x)),
                "nothing learned before a step ends"
            );
            o.on_access(b(x), d);
        }
        o.end_step();
        assert!(o.any());
        assert!(
            o.next_overwrites(b(2)),
            "2's first access of a step discards"
        );
        assert!(!o.next_overwrites(b(1)));
        o.on_access(b(1), false);
        o.on_access(b(2), true);
        assert!(!o.next_overwrites(b(2)), "2's second access reads");
        o.on_access(b(2), false);
        assert!(
            o.next_overwrites(b(2)),
            "used as often as last step: the next step's first access discards"
        );
    }

    #[test]
    fn a_step_without_discards_forgets_the_earlier_ones() {
        let mut o = Overwrites::default();
        o.on_access(b(7), true);
        o.end_step();
        assert!(o.any() && o.next_overwrites(b(7)));
        o.on_access(b(7), false);
        o.end_step();
        assert!(!o.any());
        assert!(!o.next_overwrites(b(7)));
    }

    #[test]
    fn a_step_past_the_access_limit_teaches_nothing_and_holds_no_occurrences() {
        let mut o = Overwrites::default();
        o.on_access(b(1), true);
        o.end_step();
        for _ in 0..limits::TRACE_ACCESSES_PER_STEP_MAX {
            o.on_access(b(2), true);
        }
        assert_eq!(
            o.step[&b(2)].discards.len(),
            limits::TRACE_ACCESSES_PER_STEP_MAX
        );
        o.on_access(b(2), true);
        assert!(
            o.step.is_empty(),
            "past the limit the step's occurrences are dropped"
        );
        assert!(
            !o.next_overwrites(b(1)),
            "no prediction while the step cannot be followed"
        );
        o.end_step();
        assert!(!o.any(), "the overflowed step teaches nothing");
        o.on_access(b(3), true);
        o.end_step();
        assert!(
            o.next_overwrites(b(3)),
            "the next step is learned from again"
        );
    }

    #[test]
    fn a_buffer_used_more_often_than_last_step_is_predicted_from_its_first_occurrence() {
        let mut o = Overwrites::default();
        o.on_access(b(3), false);
        o.on_access(b(3), true);
        o.end_step();
        for _ in 0..3 {
            o.on_access(b(3), false);
        }
        assert!(
            !o.next_overwrites(b(3)),
            "occurrence 0 of the last step read"
        );
    }
}
