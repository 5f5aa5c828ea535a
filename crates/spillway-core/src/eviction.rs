//! Eviction policies: which page leaves the GPU tier when a frame is needed, and which
//! leaves the host tier when a slot is needed.
//!
//! A policy owns its records and sees the pool through a view borrowed for one choice.
//! In the GPU tier it keeps records of frames: the pool tells it when a frame is filled,
//! accessed and freed, and asks it for a victim through a [`VictimView`]. In the host
//! tier it keeps records of buffers: the pool tells it when a buffer is allocated or
//! acquired and when it is freed, and asks it for a victim page through a
//! [`HostVictimView`].
//!
//! Contract, for every implementation:
//! - The caller guarantees that `on_fill` is called once when a frame starts holding a
//!   page, `on_access` whenever that page is acquired, and `on_free` once when the frame
//!   is given back; that `on_buffer_use` is called when a buffer is allocated and at
//!   every acquire of it (with the pool's access count), and `on_buffer_free` once when
//!   it is freed; and that `choose_victim` and `choose_host_victim` are called with
//!   views that answer for the current state.
//! - `choose_host_victim` MUST return only a page the view offers
//!   ([`HostVictimView::victim_page`]) and, if the view has a bound, only one whose
//!   buffer's next use is further than the bound (none predicted counts as infinitely
//!   far). It returns `None` when no page qualifies.
//! - `choose_victim` SHOULD return `preferred` among victims that are equally good by
//!   the policy's own measure (ties), since it saves a remap.
//! - `choose_victim` MUST return only a frame for which `eligible` is true; if the view
//!   has a bound (`must_exceed`), it MUST return only a frame whose `next_use` is further
//!   than the bound (a frame with no known next use counts as infinitely far). It returns
//!   `None` when no frame qualifies. It must not loop forever: at most two sweeps.
//! - Policies keep O(frames + buffers) state; choosing a victim never allocates.

use std::collections::BTreeMap;

use spillway_types::{BufferId, FrameId, PageId};

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
    /// Whether the view lists frames by next use ([`VictimView::visit_unpredicted`],
    /// [`VictimView::visit_furthest_first`]), so that a policy finds a victim without
    /// visiting every frame.
    fn indexed(&self) -> bool {
        false
    }
    /// Visits the frames holding a page with no predicted use, in frame order from `from`
    /// on (wrapping), until `visit` returns true. Only when [`VictimView::indexed`].
    fn visit_unpredicted(&self, _from: FrameId, _visit: &mut dyn FnMut(FrameId) -> bool) {}
    /// Visits the frames holding a page with a predicted use, the furthest first, with
    /// [`VictimView::next_use`], until `visit` returns true. Only when
    /// [`VictimView::indexed`].
    fn visit_furthest_first(&self, _visit: &mut dyn FnMut(FrameId, Option<u64>) -> bool) {}
}

/// What a policy may ask about the host tier while choosing a victim there.
pub trait HostVictimView {
    /// The predicted next use of `buffer`, as an absolute access number; `None` when no
    /// use is predicted.
    fn next_use(&self, buffer: BufferId) -> Option<u64>;
    /// When set, the victim's buffer's next use must be later than this.
    fn must_exceed(&self) -> Option<u64>;
    /// The page of `buffer` that may leave the host tier now, if any (the buffer is live
    /// and not held, the page is settled in a slot).
    fn victim_page(&self, buffer: BufferId) -> Option<PageId>;
}

/// A policy choosing which frame, and which host page, to free. See the module docs for
/// the contract.
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
    /// `buffer` was allocated or acquired when the pool had counted `accesses` accesses.
    fn on_buffer_use(&mut self, buffer: BufferId, accesses: u64);
    /// `buffer` was freed.
    fn on_buffer_free(&mut self, buffer: BufferId);
    /// Picks a page to take out of the host tier, or `None`.
    fn choose_host_victim(&mut self, view: &dyn HostVictimView) -> Option<PageId>;
}

/// The host tier's records, shared by the policies here: each buffer's last use. The
/// victim is a page of the buffer used furthest ahead (none predicted counts as
/// infinitely far), then of the least recently used; ties go to the lowest buffer id.
#[derive(Debug, Default)]
pub struct HostRecency {
    last_use: BTreeMap<BufferId, u64>,
}

impl HostRecency {
    /// `buffer` was allocated or acquired at access count `accesses`.
    pub fn on_use(&mut self, buffer: BufferId, accesses: u64) {
        self.last_use.insert(buffer, accesses);
    }

    /// `buffer` was freed.
    pub fn on_free(&mut self, buffer: BufferId) {
        self.last_use.remove(&buffer);
    }

    /// The victim page (see the type's docs).
    pub fn choose(&self, view: &dyn HostVictimView) -> Option<PageId> {
        let mut best: Option<((u64, u64), PageId)> = None;
        for (&buffer, &last) in &self.last_use {
            let next = view.next_use(buffer).unwrap_or(u64::MAX);
            if view.must_exceed().is_some_and(|bound| next <= bound) {
                continue;
            }
            // Larger key wins: later next use, then older last use.
            let key = (next, u64::MAX - last);
            if best.is_some_and(|(k, _)| k >= key) {
                continue;
            }
            if let Some(page) = view.victim_page(buffer) {
                best = Some((key, page));
            }
        }
        best.map(|(_, page)| page)
    }
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
    host: HostRecency,
}

impl Clock {
    /// A clock over `frames` frames.
    pub fn new(frames: u32) -> Clock {
        Clock {
            referenced: vec![false; frames as usize],
            hand: 0,
            host: HostRecency::default(),
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

    fn on_buffer_use(&mut self, buffer: BufferId, accesses: u64) {
        self.host.on_use(buffer, accesses);
    }

    fn on_buffer_free(&mut self, buffer: BufferId) {
        self.host.on_free(buffer);
    }

    fn choose_host_victim(&mut self, view: &dyn HostVictimView) -> Option<PageId> {
        self.host.choose(view)
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

impl NextUse {
    /// [`EvictionPolicy::choose_victim`] through the view's index, with the same choice as
    /// the scan: the unpredicted frames from the clock hand (the first one not referenced
    /// since the hand passed, else the first), else the furthest predicted. Its cost
    /// grows with the frames it passes, not with the frames of the tier.
    fn choose_indexed(&mut self, view: &dyn VictimView) -> Option<FrameId> {
        let n = view.frame_count();
        if n == 0 {
            return None;
        }
        let referenced = &mut self.clock.referenced;
        let (mut first, mut unref) = (None, None);
        view.visit_unpredicted(FrameId(self.clock.hand % n), &mut |f| {
            if !view.eligible(f) {
                return false;
            }
            first.get_or_insert(f);
            if referenced[f.0 as usize] {
                // The hand passes it: it loses its reference, as in CLOCK.
                referenced[f.0 as usize] = false;
                false
            } else {
                unref = Some(f);
                true
            }
        });
        if let Some(f) = unref.or(first) {
            self.clock.hand = (f.0 + 1) % n;
            return Some(f);
        }
        let bound = view.must_exceed();
        let mut found: Option<(Option<u64>, FrameId)> = None;
        view.visit_furthest_first(&mut |f, next| {
            if next.is_some() && bound.is_some_and(|b| next.is_some_and(|n| n <= b)) {
                // The furthest left is needed no later than the bound: none qualifies.
                return true;
            }
            if view.eligible(f) {
                found = Some((next, f));
                return true;
            }
            false
        });
        let (next, mut f) = found?;
        if let Some(p) = view.preferred()
            && p.0 < n
            && next.is_some()
            && view.next_use(p) == next
            && view.eligible(p)
        {
            f = p;
        }
        Some(f)
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
        if view.indexed() {
            return self.choose_indexed(view);
        }
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
        let bound = view.must_exceed();
        for k in 0..n {
            let i = (self.clock.hand + k) % n;
            let f = FrameId(i);
            let next = view.next_use(f);
            // A predicted frame that cannot beat the best so far or the bound is skipped
            // before `eligible` (the costly question): the victim is the same.
            if let Some(next) = next
                && (furthest.is_some_and(|(b, _)| next <= b) || bound.is_some_and(|b| next <= b))
            {
                continue;
            }
            if !view.eligible(f) {
                continue;
            }
            match next {
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

    fn on_buffer_use(&mut self, buffer: BufferId, accesses: u64) {
        self.clock.on_buffer_use(buffer, accesses);
    }

    fn on_buffer_free(&mut self, buffer: BufferId) {
        self.clock.on_buffer_free(buffer);
    }

    fn choose_host_victim(&mut self, view: &dyn HostVictimView) -> Option<PageId> {
        self.clock.choose_host_victim(view)
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

    /// Buffers 1..=4: next uses, which offer a page, and a bound.
    struct Host {
        next: Vec<Option<u64>>,
        offers: Vec<bool>,
        bound: Option<u64>,
    }

    impl HostVictimView for Host {
        fn next_use(&self, b: BufferId) -> Option<u64> {
            self.next[b.0 as usize - 1]
        }
        fn must_exceed(&self) -> Option<u64> {
            self.bound
        }
        fn victim_page(&self, b: BufferId) -> Option<PageId> {
            self.offers[b.0 as usize - 1].then_some(PageId {
                buffer: b,
                index: 0,
            })
        }
    }

    fn page(b: u64) -> Option<PageId> {
        Some(PageId {
            buffer: BufferId(b),
            index: 0,
        })
    }

    #[test]
    fn host_victims_go_furthest_next_use_then_least_recently_used() {
        for mut p in [
            Box::new(Clock::new(1)) as Box<dyn EvictionPolicy>,
            Box::new(NextUse::new(1)),
        ] {
            for (b, at) in [(1, 5), (2, 3), (3, 9), (4, 1)] {
                p.on_buffer_use(BufferId(b), at);
            }
            let mut view = Host {
                next: vec![None, None, None, Some(20)],
                offers: vec![true; 4],
                bound: None,
            };
            // No prediction (infinitely far) beats 20; among those, buffer 2 is oldest.
            assert_eq!(p.choose_host_victim(&view), page(2), "{}", p.name());
            view.offers[1] = false;
            assert_eq!(p.choose_host_victim(&view), page(1), "{}", p.name());
            // A bound keeps pages used by then.
            view.next = vec![Some(10), Some(11), Some(12), Some(20)];
            view.bound = Some(12);
            assert_eq!(p.choose_host_victim(&view), page(4), "{}", p.name());
            view.bound = Some(20);
            assert_eq!(p.choose_host_victim(&view), None, "{}", p.name());
            // A freed buffer is forgotten.
            view.bound = None;
            p.on_buffer_free(BufferId(4));
            assert_eq!(p.choose_host_victim(&view), page(3), "{}", p.name());
        }
    }

    /// A view with the index the pool's frame table keeps: frames by next use.
    struct Indexed(View);

    impl VictimView for Indexed {
        fn frame_count(&self) -> u32 {
            self.0.frame_count()
        }
        fn eligible(&self, f: FrameId) -> bool {
            self.0.eligible(f)
        }
        fn next_use(&self, f: FrameId) -> Option<u64> {
            self.0.next_use(f)
        }
        fn must_exceed(&self) -> Option<u64> {
            self.0.bound
        }
        fn indexed(&self) -> bool {
            true
        }
        fn visit_unpredicted(&self, from: FrameId, visit: &mut dyn FnMut(FrameId) -> bool) {
            let n = self.frame_count();
            for k in 0..n {
                let f = FrameId((from.0 + k) % n);
                if self.0.next[f.0 as usize].is_none() && visit(f) {
                    return;
                }
            }
        }
        fn visit_furthest_first(&self, visit: &mut dyn FnMut(FrameId, Option<u64>) -> bool) {
            let mut order: Vec<(u64, u32)> = (0..self.frame_count())
                .filter_map(|f| self.0.next[f as usize].map(|n| (n, f)))
                .collect();
            order.sort_unstable_by(|a, b| b.cmp(a));
            for (n, f) in order {
                if visit(FrameId(f), Some(n)) {
                    return;
                }
            }
        }
    }

    #[test]
    fn next_use_through_the_index_chooses_as_the_scan_does() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for _ in 0..2000 {
            let n = 1 + (next() % 12) as usize;
            let view = View {
                eligible: (0..n).map(|_| next() % 4 != 0).collect(),
                next: (0..n)
                    .map(|_| (next() % 3 != 0).then(|| next() % 20))
                    .collect(),
                bound: (next() % 2 == 0).then(|| next() % 20),
            };
            let (mut scan, mut indexed) = (NextUse::new(n as u32), NextUse::new(n as u32));
            let a = scan.choose_victim(&view);
            let indexed_view = Indexed(view);
            let b = indexed.choose_victim(&indexed_view);
            let view = indexed_view.0;
            match (a, b) {
                (None, None) => {}
                (Some(a), Some(b)) => {
                    assert!(view.eligible(b));
                    // The same victim, or one as good (ties in next use).
                    assert_eq!(view.next_use(a), view.next_use(b), "{a:?} {b:?}");
                }
                other => panic!("scan and index disagree: {other:?}"),
            }
        }
    }
}
