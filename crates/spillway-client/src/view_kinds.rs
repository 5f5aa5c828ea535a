//! Which acquires of a buffer want it as one array: each buffer's acquires of the last
//! step, whole ([`crate::Guard::device_ptr`] asked) or page by page, predict the kind of
//! its next one, and the pool tells the device ([`Device::expect_view`]) whenever that
//! prediction changes.
//!
//! Why: on `cuda` a buffer whose pages scatter over the frames is shown whole through its
//! range, and the map-ahead thread maps its pages as their loads are issued. A buffer read
//! whole in some places of a step and page by page in others (`spillway.torch`'s weights:
//! whole in forward and backward, page by page in the optimizer) had every load mapped,
//! the optimizer's too, although nothing there reads the mapping and the pages leave
//! before the next whole view: on the H100 the optimizer phase of `bench/torch` mapped
//! about 900 pages a step (0.26 s of the map-ahead thread, whose mapping holds the range's
//! lock that the pool's loads take), and ran 0.09 s faster with mapping ahead off, while
//! forward and backward ran slower without it
//! (`bench/torch/runs/2026-12-07-bursts-phases-h100.out`, `learned` against
//! `learned_no_ahead`). Not yet measured with this change: no GPU was lent after it.
//!
//! The prediction is positional: the `k`-th acquire of a step is expected to be of the
//! kind the `k`-th was in the last step (past the last step's count: its first, the next
//! step's). Before a step has ended, a buffer once viewed whole is expected whole (the
//! device's own rule). Jobs that never mark steps keep that rule.
//!
//! [`Device::expect_view`]: spillway_device::Device::expect_view

use std::collections::HashMap;

use spillway_types::BufferId;

/// Acquires of one buffer in one step whose kind is kept: 64 (a byte each in two lists,
/// this step's and the last: 128 bytes a buffer at most). Past it, the next acquire is
/// expected to be of the step's first kind.
pub const VIEW_KINDS_PER_STEP_MAX: usize = 64;

/// One buffer's acquires: their kinds (true: whole) in the last step and in this one.
#[derive(Debug, Default)]
struct Kinds {
    last: Vec<bool>,
    now: Vec<bool>,
    /// Acquires this step, counted past [`VIEW_KINDS_PER_STEP_MAX`].
    count: usize,
    /// Whether any acquire so far viewed the buffer whole.
    ever_whole: bool,
    /// What the device was last told.
    told: Option<bool>,
}

impl Kinds {
    /// The kind expected of the next acquire.
    fn next(&self) -> bool {
        if self.last.is_empty() {
            return self.ever_whole;
        }
        match self.last.get(self.count) {
            Some(&whole) if self.count < VIEW_KINDS_PER_STEP_MAX => whole,
            _ => self.last[0],
        }
    }

    /// `Some(next)` when the expectation differs from what the device was told.
    fn tell(&mut self) -> Option<bool> {
        let next = self.next();
        (self.told != Some(next)).then(|| {
            self.told = Some(next);
            next
        })
    }
}

/// Every live buffer's acquire kinds (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct ViewKinds {
    buffers: HashMap<BufferId, Kinds>,
}

impl ViewKinds {
    /// Records that an acquire of `buffer` ended, `whole` if it was viewed as one array.
    /// Returns the kind its next acquire is expected to be when the device should hear
    /// of it (it changed).
    pub(crate) fn ended(&mut self, buffer: BufferId, whole: bool) -> Option<bool> {
        let k = self.buffers.entry(buffer).or_default();
        if k.now.len() < VIEW_KINDS_PER_STEP_MAX {
            k.now.push(whole);
        }
        k.count += 1;
        k.ever_whole |= whole;
        k.tell()
    }

    /// The step ended: this step's kinds become the last step's (a buffer not acquired
    /// in it keeps its older ones). Returns the buffers whose expected next kind changed.
    pub(crate) fn end_step(&mut self) -> Vec<(BufferId, bool)> {
        let mut changed = Vec::new();
        for (&buffer, k) in &mut self.buffers {
            if k.count > 0 {
                k.last = std::mem::take(&mut k.now);
                k.count = 0;
            }
            if let Some(next) = k.tell() {
                changed.push((buffer, next));
            }
        }
        changed
    }

    /// `buffer` was freed.
    pub(crate) fn forget(&mut self, buffer: BufferId) {
        self.buffers.remove(&buffer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(n: u64) -> BufferId {
        BufferId(n)
    }

    #[test]
    fn first_step_keeps_the_devices_rule_then_positions_predict() {
        let mut v = ViewKinds::default();
        // Step 1: whole, whole, paged (forward, backward, optimizer).
        assert_eq!(v.ended(b(1), true), Some(true));
        assert_eq!(v.ended(b(1), true), None);
        // Once whole, expected whole until a step has ended.
        assert_eq!(v.ended(b(1), false), None);
        // After the step: the first acquire is expected whole (already told).
        assert!(v.end_step().is_empty());
        // Step 2: after the first two (whole), the third is expected paged.
        assert_eq!(v.ended(b(1), true), None);
        assert_eq!(v.ended(b(1), true), Some(false));
        // After the paged one: past last step's count, the next step's first: whole.
        assert_eq!(v.ended(b(1), false), Some(true));
        assert!(v.end_step().is_empty());
    }

    #[test]
    fn a_buffer_only_read_page_by_page_is_never_expected_whole() {
        let mut v = ViewKinds::default();
        assert_eq!(v.ended(b(2), false), Some(false));
        assert_eq!(v.ended(b(2), false), None);
        assert!(v.end_step().is_empty());
        assert_eq!(v.ended(b(2), false), None);
    }

    #[test]
    fn step_end_tells_the_first_kind_when_it_changed() {
        let mut v = ViewKinds::default();
        // Step 1: paged then whole; at its end the next step's first kind (paged).
        assert_eq!(v.ended(b(3), false), Some(false));
        assert_eq!(v.ended(b(3), true), Some(true));
        assert_eq!(v.end_step(), vec![(b(3), false)]);
        // Step 2: after the first (paged) the second is expected whole.
        assert_eq!(v.ended(b(3), false), Some(true));
        // A step in which the buffer is not acquired keeps the older kinds.
        assert_eq!(v.ended(b(3), true), Some(false));
        assert!(v.end_step().is_empty());
        assert!(v.end_step().is_empty());
        assert_eq!(v.ended(b(3), false), Some(true));
    }

    #[test]
    fn kinds_are_bounded_per_step() {
        let mut v = ViewKinds::default();
        for _ in 0..VIEW_KINDS_PER_STEP_MAX + 10 {
            v.ended(b(4), true);
        }
        v.ended(b(4), false);
        v.end_step();
        let k = &v.buffers[&b(4)];
        assert_eq!(k.last.len(), VIEW_KINDS_PER_STEP_MAX);
        // Past the kept count the step's first kind is expected.
        for _ in 0..VIEW_KINDS_PER_STEP_MAX + 5 {
            v.ended(b(4), true);
        }
        assert!(v.buffers[&b(4)].next());
        v.forget(b(4));
        assert!(v.buffers.is_empty());
    }
}
