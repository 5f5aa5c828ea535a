//! Eviction policies: which resident page leaves the GPU tier when a frame is needed.
//!
//! A policy sees frames, not pages: the pool tells it when a frame is filled, accessed
//! and freed, and asks it for a victim through a [`VictimView`].
//!
//! Contract, for every implementation:
//! - The caller guarantees that `on_fill` is called once when a frame starts holding a
//!   page, `on_access` whenever that page is acquired, and `on_free` once when the frame
//!   is given back; and that `choose_victim` is called with a view whose `eligible`
//!   answers for the current state.
//! - `choose_victim` SHOULD return `preferred` among victims that are equally good by
//!   the policy's own measure (ties), since it saves a remap.
//! - `choose_victim` MUST return only a frame for which `eligible` is true; if the view
//!   has a bound (`must_exceed`), it MUST return only a frame whose `next_use` is further
//!   than the bound (a frame with no known next use counts as infinitely far). It returns
//!   `None` when no frame qualifies. It must not loop forever: at most two sweeps.
//! - Policies keep O(frames) state and never allocate per call.

use spillway_types::FrameId;

/// What a policy may ask about frames while choosing a victim.
pub trait VictimView {
    /// Number of frames in the GPU tier (frame ids are `0..frame_count`).
    fn frame_count(&self) -> u32;
    /// Whether the frame holds an unpinned, settled page that may be evicted now.
    fn eligible(&self, frame: FrameId) -> bool;
    /// The predicted next use of the frame's page, as an absolute access number; `None`
    /// when no use is predicted.
    fn next_use(&self, frame: FrameId) -> Option<u64>;
    /// When set, the victim's next use must be later than this (see the module docs).
    fn must_exceed(&self) -> Option<u64>;
    /// A frame to prefer among equally good victims: the incoming page's last frame,
    /// which it can return to without remapping its buffer's device range.
    fn preferred(&self) -> Option<FrameId> {
        None
    }
}

/// A policy choosing which frame to free. See the module docs for the contract.
pub trait EvictionPolicy: Send {
    /// A short name for logs and benchmarks.
    fn name(&self) -> &'static str;
    /// `frame` now holds a page.
    fn on_fill(&mut self, frame: FrameId);
    /// The page in `frame` was acquired.
    fn on_access(&mut self, frame: FrameId);
    /// `frame` holds no page any more.
    fn on_free(&mut self, frame: FrameId);
    /// Picks an eligible frame to evict, or `None`.
    fn choose_victim(&mut self, view: &dyn VictimView) -> Option<FrameId>;
}

fn beyond(view: &dyn VictimView, frame: FrameId) -> bool {
    match (view.must_exceed(), view.next_use(frame)) {
        (None, _) | (Some(_), None) => true,
        (Some(bound), Some(next)) => next > bound,
    }
}

/// CLOCK (second chance): a hand sweeps the frames; a frame accessed since the last sweep
/// gets a second chance, the first one without is the victim.
#[derive(Debug)]
pub struct Clock {
    referenced: Vec<bool>,
    hand: u32,
}

impl Clock {
    /// A clock over `frames` frames.
    pub fn new(frames: u32) -> Clock {
        Clock {
            referenced: vec![false; frames as usize],
            hand: 0,
        }
    }
}

impl EvictionPolicy for Clock {
    fn name(&self) -> &'static str {
        "clock"
    }

    fn on_fill(&mut self, frame: FrameId) {
        self.referenced[frame.0 as usize] = true;
    }

    fn on_access(&mut self, frame: FrameId) {
        self.referenced[frame.0 as usize] = true;
    }

    fn on_free(&mut self, frame: FrameId) {
        self.referenced[frame.0 as usize] = false;
    }

    fn choose_victim(&mut self, view: &dyn VictimView) -> Option<FrameId> {
        let n = view.frame_count();
        if n == 0 {
            return None;
        }
        for _ in 0..2 * n {
            let f = FrameId(self.hand);
            self.hand = (self.hand + 1) % n;
            if !view.eligible(f) || !beyond(view, f) {
                continue;
            }
            let r = &mut self.referenced[f.0 as usize];
            if *r {
                *r = false;
            } else {
                return Some(f);
            }
        }
        None
    }
}

/// Next use (Belady with predictions): evicts the eligible frame whose page is needed
/// furthest in the future; pages with no predicted use go first, and among those CLOCK
/// decides.
#[derive(Debug)]
pub struct NextUse {
    clock: Clock,
}

impl NextUse {
    /// A next-use policy over `frames` frames.
    pub fn new(frames: u32) -> NextUse {
        NextUse {
            clock: Clock::new(frames),
        }
    }
}

impl EvictionPolicy for NextUse {
    fn name(&self) -> &'static str {
        "next_use"
    }

    fn on_fill(&mut self, frame: FrameId) {
        self.clock.on_fill(frame);
    }

    fn on_access(&mut self, frame: FrameId) {
        self.clock.on_access(frame);
    }

    fn on_free(&mut self, frame: FrameId) {
        self.clock.on_free(frame);
    }

    fn choose_victim(&mut self, view: &dyn VictimView) -> Option<FrameId> {
        // One pass from the clock hand: the first unpredicted frame not referenced since
        // the hand last passed (else the first unpredicted one), else the predicted frame
        // used furthest away. Frames the hand passes lose their reference bit, as in CLOCK.
        let n = view.frame_count();
        if n == 0 {
            return None;
        }
        let (mut unref, mut unpredicted, mut furthest): (
            Option<u32>,
            Option<u32>,
            Option<(u64, FrameId)>,
        ) = (None, None, None);
        for k in 0..n {
            let i = (self.clock.hand + k) % n;
            let f = FrameId(i);
            if !view.eligible(f) {
                continue;
            }
            match view.next_use(f) {
                None => {
                    unpredicted.get_or_insert(k);
                    if !self.clock.referenced[i as usize] {
                        unref = Some(k);
                        break;
                    }
                }
                Some(next) => {
                    if furthest.is_none_or(|(b, _)| next > b) {
                        furthest = Some((next, f));
                    }
                }
            }
        }
        if let Some(k) = unref.or(unpredicted) {
            for passed in 0..k {
                self.clock.referenced[((self.clock.hand + passed) % n) as usize] = false;
            }
            let victim = (self.clock.hand + k) % n;
            self.clock.hand = (victim + 1) % n;
            return Some(FrameId(victim));
        }
        let (next, mut f) = furthest?;
        if let Some(p) = view.preferred()
            && p.0 < n
            && view.eligible(p)
            && view.next_use(p) == Some(next)
        {
            f = p;
        }
        match view.must_exceed() {
            Some(bound) if next <= bound => None,
            _ => Some(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct View {
        eligible: Vec<bool>,
        next: Vec<Option<u64>>,
        bound: Option<u64>,
    }

    impl VictimView for View {
        fn frame_count(&self) -> u32 {
            self.eligible.len() as u32
        }
        fn eligible(&self, f: FrameId) -> bool {
            self.eligible[f.0 as usize]
        }
        fn next_use(&self, f: FrameId) -> Option<u64> {
            self.next[f.0 as usize]
        }
        fn must_exceed(&self) -> Option<u64> {
            self.bound
        }
    }

    #[test]
    fn clock_gives_second_chance() {
        let mut c = Clock::new(3);
        for f in 0..3 {
            c.on_fill(FrameId(f));
        }
        let view = View {
            eligible: vec![true; 3],
            next: vec![None; 3],
            bound: None,
        };
        // All referenced: the first sweep clears bits, the second picks frame 0.
        assert_eq!(c.choose_victim(&view), Some(FrameId(0)));
        c.on_access(FrameId(1));
        // Hand at 1: frame 1 was re-referenced, so frame 2 goes.
        assert_eq!(c.choose_victim(&view), Some(FrameId(2)));
    }

    #[test]
    fn clock_respects_eligibility() {
        let mut c = Clock::new(2);
        let view = View {
            eligible: vec![false, false],
            next: vec![None; 2],
            bound: None,
        };
        assert_eq!(c.choose_victim(&view), None);
        let view = View {
            eligible: vec![false, true],
            next: vec![None; 2],
            bound: None,
        };
        assert_eq!(c.choose_victim(&view), Some(FrameId(1)));
    }

    #[test]
    fn next_use_takes_unpredicted_first_then_furthest() {
        let mut p = NextUse::new(4);
        let mut view = View {
            eligible: vec![true; 4],
            next: vec![Some(5), None, Some(9), Some(7)],
            bound: None,
        };
        assert_eq!(p.choose_victim(&view), Some(FrameId(1)));
        view.next[1] = Some(3);
        assert_eq!(p.choose_victim(&view), Some(FrameId(2)));
        view.eligible[2] = false;
        assert_eq!(p.choose_victim(&view), Some(FrameId(3)));
    }

    #[test]
    fn next_use_never_evicts_a_page_needed_sooner() {
        let mut p = NextUse::new(3);
        let view = View {
            eligible: vec![true; 3],
            next: vec![Some(5), Some(6), Some(7)],
            bound: Some(7),
        };
        assert_eq!(p.choose_victim(&view), None);
        let view = View {
            eligible: vec![true; 3],
            next: vec![Some(5), Some(6), Some(8)],
            bound: Some(7),
        };
        assert_eq!(p.choose_victim(&view), Some(FrameId(2)));
        let mut c = Clock::new(3);
        assert_eq!(
            c.choose_victim(&View {
                eligible: vec![true; 3],
                next: vec![Some(1); 3],
                bound: Some(1)
            }),
            None
        );
    }
}
