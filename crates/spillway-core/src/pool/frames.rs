//! The GPU frame table ([`GpuFrames`]) and the host slot table ([`HostSlots`]): which
//! page each frame holds and when it is next used, which frames and slots are free.
//!
//! Invariant: frames in use + free frames = the frames of the GPU budget, and a frame
//! holds at most one page; the same for slots. So no budget is ever exceeded.

use std::collections::{BTreeSet, VecDeque};

use spillway_types::{FrameId, HostSlot, PageId};

use super::peer::PeerFrames;
use super::types::ZeroFill;

/// The key of a frame whose page has no predicted use in [`GpuFrames`]'s order: after
/// every predicted one (it is the first to go).
const UNPREDICTED: u64 = u64::MAX;

/// The GPU frame table: which page each frame holds, when it is next used, which are free.
#[derive(Debug)]
pub(super) struct GpuFrames {
    owner: Vec<Option<PageId>>,
    /// The predicted next use of each frame's page (an absolute access number).
    next_use: Vec<Option<u64>>,
    /// The frames holding pages, ordered by next use ([`UNPREDICTED`] for none), then
    /// frame: a victim is found without scanning every frame. 1M frames take ~40 MiB.
    by_next_use: BTreeSet<(u64, u32)>,
    free: Vec<FrameId>,
    /// Frames whose page is being written back or copied to the peer (they come free
    /// when the copy lands).
    evicting: u64,
    /// The frames a neighbouring GPU lends (the peer-GPU tier; none by default).
    pub(super) peer: PeerFrames,
}

impl GpuFrames {
    /// A table of `frames` free frames (the lowest ids are handed out first).
    pub(super) fn new(frames: u32) -> GpuFrames {
        GpuFrames {
            owner: vec![None; frames as usize],
            next_use: vec![None; frames as usize],
            by_next_use: BTreeSet::new(),
            free: (0..frames).rev().map(FrameId).collect(),
            evicting: 0,
            peer: PeerFrames::default(),
        }
    }

    /// Frames of the budget.
    pub(super) fn total(&self) -> u64 {
        self.owner.len() as u64
    }

    /// Frames holding a page (or reserved for one).
    pub(super) fn in_use(&self) -> u64 {
        self.total() - self.free.len() as u64
    }

    /// The page in `frame`.
    pub(super) fn owner(&self, frame: FrameId) -> Option<PageId> {
        self.owner[frame.0 as usize]
    }

    /// Frames with their pages.
    pub(super) fn owned(&self) -> impl Iterator<Item = (FrameId, PageId)> + '_ {
        self.owner
            .iter()
            .enumerate()
            .filter_map(|(f, p)| p.map(|p| (FrameId(f as u32), p)))
    }

    /// A free frame: `preferred` if it is free (the frame that extends a buffer's
    /// extent, or a page's last frame: no remap), else any; with `run_start`, the first
    /// frame of the free run that one lies in (a page that starts an extent).
    pub(super) fn take(&mut self, preferred: Option<FrameId>, run_start: bool) -> Option<FrameId> {
        if let Some(p) = preferred
            && self.owner[p.0 as usize].is_none()
            && let Some(i) = self.free.iter().rposition(|&f| f == p)
        {
            return Some(self.free.swap_remove(i));
        }
        let mut f = self.free.pop()?;
        if run_start {
            let start = self.free_run_start(f);
            if start != f
                && let Some(i) = self.free.iter().rposition(|&x| x == start)
            {
                self.free[i] = f;
                f = start;
            }
        }
        Some(f)
    }

    /// The first frame of the free run that `frame` (free) lies in. Bounded by the run.
    fn free_run_start(&self, frame: FrameId) -> FrameId {
        let mut f = frame.0;
        while f > 0 && self.owner[f as usize - 1].is_none() {
            f -= 1;
        }
        FrameId(f)
    }

    /// The predicted next use of `frame`'s page as last set (it may have passed).
    pub(super) fn next_use(&self, frame: FrameId) -> Option<u64> {
        self.next_use[frame.0 as usize]
    }

    /// Returns a frame taken with [`GpuFrames::take`] but not used.
    pub(super) fn untake(&mut self, frame: FrameId) {
        debug_assert!(self.owner[frame.0 as usize].is_none());
        self.free.push(frame);
    }

    /// `page` now holds `frame` (taken), next used at `next_use`.
    pub(super) fn occupy(&mut self, frame: FrameId, page: PageId, next_use: Option<u64>) {
        debug_assert!(self.owner[frame.0 as usize].is_none());
        self.owner[frame.0 as usize] = Some(page);
        self.next_use[frame.0 as usize] = next_use;
        self.by_next_use
            .insert((next_use.unwrap_or(UNPREDICTED), frame.0));
    }

    /// `page` left `frame`: the frame is free again.
    pub(super) fn vacate(&mut self, frame: FrameId, page: PageId) {
        debug_assert_eq!(self.owner[frame.0 as usize], Some(page));
        let key = self.next_use[frame.0 as usize].unwrap_or(UNPREDICTED);
        self.by_next_use.remove(&(key, frame.0));
        self.owner[frame.0 as usize] = None;
        self.next_use[frame.0 as usize] = None;
        self.free.push(frame);
    }

    /// Sets the next use of `frame`'s page.
    pub(super) fn set_next_use(&mut self, frame: FrameId, next_use: Option<u64>) {
        let old = self.next_use[frame.0 as usize];
        if old == next_use {
            return;
        }
        self.next_use[frame.0 as usize] = next_use;
        if self.owner[frame.0 as usize].is_some() {
            self.by_next_use
                .remove(&(old.unwrap_or(UNPREDICTED), frame.0));
            self.by_next_use
                .insert((next_use.unwrap_or(UNPREDICTED), frame.0));
        }
    }

    /// Frames holding a page with no predicted use, in frame order from `from` on,
    /// wrapping (the order a clock hand passes them).
    pub(super) fn unpredicted_from(&self, from: FrameId) -> impl Iterator<Item = FrameId> + '_ {
        self.by_next_use
            .range((UNPREDICTED, from.0)..)
            .chain(
                self.by_next_use
                    .range((UNPREDICTED, 0)..(UNPREDICTED, from.0)),
            )
            .map(|&(_, f)| FrameId(f))
    }

    /// Frames holding a page with a predicted use, the furthest first.
    pub(super) fn predicted_furthest_first(&self) -> impl Iterator<Item = (FrameId, u64)> + '_ {
        self.by_next_use
            .range(..(UNPREDICTED, 0))
            .rev()
            .map(|&(n, f)| (FrameId(f), n))
    }

    /// The next use of `frame`'s page if it is after access `now` (`None`: none predicted).
    pub(super) fn next_use_after(&self, frame: FrameId, now: u64) -> Option<u64> {
        self.next_use[frame.0 as usize].filter(|&n| n > now)
    }

    /// Frames being written back.
    pub(super) fn evicting(&self) -> u64 {
        self.evicting
    }

    /// A write-back of a frame's page started.
    pub(super) fn begin_evicting(&mut self) {
        self.evicting += 1;
    }

    /// A write-back finished.
    pub(super) fn end_evicting(&mut self) {
        self.evicting -= 1;
    }

    /// Free frames, for failure messages.
    pub(super) fn free_list(&self) -> &[FrameId] {
        &self.free
    }
}

/// The host slot table: the free slots (a slot's page is in the page table), and the
/// slots the driver must zero before anything else uses them.
#[derive(Debug)]
pub(super) struct HostSlots {
    free: Vec<HostSlot>,
    total: u64,
    fills: VecDeque<ZeroFill>,
}

impl HostSlots {
    /// A table of `slots` free slots.
    pub(super) fn new(slots: u32) -> HostSlots {
        HostSlots {
            free: (0..slots).rev().map(HostSlot).collect(),
            total: u64::from(slots),
            fills: VecDeque::new(),
        }
    }

    /// Slots of the budget.
    pub(super) fn total(&self) -> u64 {
        self.total
    }

    /// Slots free now.
    pub(super) fn free(&self) -> u64 {
        self.free.len() as u64
    }

    /// A free slot, if there is one.
    pub(super) fn take(&mut self) -> Option<HostSlot> {
        self.free.pop()
    }

    /// `slot` holds no page any more.
    pub(super) fn give_back(&mut self, slot: HostSlot) {
        self.free.push(slot);
    }

    /// Queues a zero fill for the driver (a page never written came into a slot).
    pub(super) fn zero_fill(&mut self, fill: ZeroFill) {
        self.fills.push_back(fill);
    }

    /// The next zero fill for the driver.
    pub(super) fn poll_zero_fill(&mut self) -> Option<ZeroFill> {
        self.fills.pop_front()
    }

    /// Free slots, for failure messages.
    pub(super) fn free_list(&self) -> &[HostSlot] {
        &self.free
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_types::BufferId;

    fn page(index: u32) -> PageId {
        PageId {
            buffer: BufferId(1),
            index,
        }
    }

    #[test]
    fn frames_prefer_the_last_frame_and_count_what_is_in_use() {
        let mut f = GpuFrames::new(3);
        assert_eq!(f.take(None, false), Some(FrameId(0)));
        assert_eq!(f.take(Some(FrameId(2)), false), Some(FrameId(2)));
        f.occupy(FrameId(2), page(0), Some(7));
        assert_eq!(f.in_use(), 2);
        assert_eq!(f.owner(FrameId(2)), Some(page(0)));
        assert_eq!(f.next_use_after(FrameId(2), 6), Some(7));
        assert_eq!(f.next_use_after(FrameId(2), 7), None);
        // A preferred frame that is taken falls back to any free frame.
        assert_eq!(f.take(Some(FrameId(2)), false), Some(FrameId(1)));
        f.untake(FrameId(1));
        f.vacate(FrameId(2), page(0));
        assert_eq!(f.owner(FrameId(2)), None);
        assert_eq!(f.in_use(), 1);
        assert_eq!(f.owned().count(), 0);
    }

    #[test]
    fn a_page_that_starts_an_extent_takes_the_start_of_a_free_run() {
        let mut f = GpuFrames::new(6);
        // Frames 0..3 in use, 3..6 free: the free list hands out 3 first anyway; with
        // frame 4 freed last it would hand out 4, unless the run's start is asked for.
        for i in 0..5 {
            let frame = f.take(None, false).unwrap();
            f.occupy(frame, page(i), None);
        }
        f.vacate(FrameId(3), page(3));
        f.vacate(FrameId(4), page(4));
        assert_eq!(f.take(None, true), Some(FrameId(3)));
        assert_eq!(f.take(None, false), Some(FrameId(4)));
    }

    #[test]
    fn slots_are_handed_out_lowest_first_and_given_back() {
        let mut s = HostSlots::new(2);
        assert_eq!(s.take(), Some(HostSlot(0)));
        assert_eq!(s.take(), Some(HostSlot(1)));
        assert_eq!(s.take(), None);
        s.give_back(HostSlot(0));
        assert_eq!((s.free(), s.total()), (1, 2));
        let fill = ZeroFill {
            page: page(3),
            slot: HostSlot(1),
            bytes: 10,
        };
        s.zero_fill(fill);
        assert_eq!(s.poll_zero_fill(), Some(fill));
        assert_eq!(s.poll_zero_fill(), None);
    }
}
