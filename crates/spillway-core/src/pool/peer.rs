//! The peer-GPU tier: frames a neighbouring GPU of the same host lends this pool
//! ([`PeerFrames`], a room of [`super::frames::GpuFrames`]) and the facade's moves on them.
//!
//! The peer keeps *clean copies*: a clean page leaving the GPU leaves a copy in a peer
//! frame (device→peer, over NVLink on real GPUs, several times PCIe's speed), and a page
//! with a copy there loads from it (peer→device) instead of from its host slot. The host
//! tier stays inclusive and authoritative, so a peer copy is only ever dropped, never
//! written back: taking lent frames back needs no copy, only the copies in flight on them
//! to land ([`PoolCore::set_peer_frames`], bounded by one copy's time). A page's copy
//! ([`Peer`]) is dropped whenever its bytes change (an exclusive acquire or a host write
//! ends, an acquire overwrites it) or its slot goes (the host copy is what the peer copy
//! is checked against), and with its buffer. Dirty pages are written back to the host as
//! before and leave no peer copy.
//!
//! Which pages keep a copy: a free peer frame, else the copy whose page is next used
//! furthest, if that is later than the incoming page's next use (the learned policy's
//! next-use rule; a page with no predicted use gets only a free frame). The victim search
//! visits every peer frame (linear: a peer lends thousands of frames, not millions).

use std::time::Duration;

use spillway_types::{BufferId, CopyOp, Direction, Far, FrameId, PageId, PeerFrameId};

use super::PoolCore;
use super::pages::{Gpu, Host};

/// Whether a clean page leaving the GPU may leave a copy on the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PeerFill {
    /// Yes, and the copy of this page (one about to load from it) is not a victim.
    Keeping(PageId),
    /// No: the page's slot goes next, and a copy with it.
    Skip,
}

/// A page's copy on the peer GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(super) enum Peer {
    /// None.
    #[default]
    Absent,
    /// A device→peer copy of the (clean) page is in flight into the frame; the page is
    /// `Gpu::Evicting` until it lands.
    Filling(PeerFrameId),
    /// The frame holds the page's current bytes (the same as its host slot's).
    Held(PeerFrameId),
}

impl Peer {
    /// The frame of a copy that is whole.
    pub(super) fn held(self) -> Option<PeerFrameId> {
        match self {
            Peer::Held(f) => Some(f),
            Peer::Absent | Peer::Filling(_) => None,
        }
    }
}

/// The frames lent to this pool: which page's copy each holds, which have copies in
/// flight, which are free, and how many may be used now.
///
/// Invariant: owned + free + (unowned with a copy in flight, or above the limit) = the
/// frames ever lent; only frames below the limit are free or taken.
#[derive(Debug, Default)]
pub(super) struct PeerFrames {
    owner: Vec<Option<PageId>>,
    /// Copies in flight reading or writing each frame.
    busy: Vec<u8>,
    free: Vec<PeerFrameId>,
    /// Frames `0..limit` may be used.
    limit: u32,
    /// A limit lowered and not yet reported back: the frames above it are still owned
    /// or busy, or the report is not polled yet.
    returning: Option<u32>,
}

impl PeerFrames {
    /// Frames that may be used now.
    pub(super) fn limit(&self) -> u32 {
        self.limit
    }

    /// Frames holding a copy or filling.
    pub(super) fn in_use(&self) -> u64 {
        self.owner.iter().filter(|o| o.is_some()).count() as u64
    }

    /// The page whose copy `frame` holds.
    pub(super) fn owner(&self, frame: PeerFrameId) -> Option<PageId> {
        self.owner[frame.0 as usize]
    }

    /// Frames holding copies, with their pages.
    pub(super) fn owned(&self) -> impl Iterator<Item = (PeerFrameId, PageId)> + '_ {
        self.owner
            .iter()
            .enumerate()
            .filter_map(|(f, o)| o.map(|p| (PeerFrameId(f as u32), p)))
    }

    /// Whether a copy in flight reads or writes `frame`.
    pub(super) fn busy(&self, frame: PeerFrameId) -> bool {
        self.busy[frame.0 as usize] > 0
    }

    /// A free frame, taken.
    pub(super) fn take(&mut self) -> Option<PeerFrameId> {
        self.free.pop()
    }

    /// `page`'s copy goes into `frame` (taken, or vacated by a victim).
    pub(super) fn occupy(&mut self, frame: PeerFrameId, page: PageId) {
        debug_assert!(self.owner[frame.0 as usize].is_none(), "{frame:?} is free");
        self.owner[frame.0 as usize] = Some(page);
    }

    /// `frame` holds no copy any more: free once no copy is in flight on it (and it is
    /// below the limit).
    pub(super) fn vacate(&mut self, frame: PeerFrameId) {
        self.owner[frame.0 as usize] = None;
        self.settle(frame);
    }

    /// A copy on `frame` starts.
    pub(super) fn begin_copy(&mut self, frame: PeerFrameId) {
        self.busy[frame.0 as usize] += 1;
    }

    /// A copy on `frame` ended.
    pub(super) fn end_copy(&mut self, frame: PeerFrameId) {
        self.busy[frame.0 as usize] -= 1;
        self.settle(frame);
    }

    /// Puts `frame` on the free list if nothing holds or uses it and it may be used.
    fn settle(&mut self, frame: PeerFrameId) {
        let i = frame.0 as usize;
        if self.owner[i].is_none() && self.busy[i] == 0 && frame.0 < self.limit {
            self.free.push(frame);
        }
    }

    /// Frames `0..frames` may be used from now on. Growing frees the new frames at once;
    /// shrinking takes the frames above off the free list and returns those holding a
    /// copy, for the caller to drop; the shrink is reported by
    /// [`PeerFrames::poll_returned`] once no frame above holds or moves anything.
    pub(super) fn set_limit(&mut self, frames: u32) -> Vec<(PeerFrameId, PageId)> {
        let old = self.limit;
        self.limit = frames;
        if frames as usize > self.owner.len() {
            self.owner.resize(frames as usize, None);
            self.busy.resize(frames as usize, 0);
        }
        // Frames above the new count that were ever lent are reported back once idle,
        // whether this call grows or shrinks (a grow during a shrink reports the new
        // count).
        self.returning = ((frames as usize) < self.owner.len()).then_some(frames);
        if frames >= old {
            for f in old..frames {
                self.settle(PeerFrameId(f));
            }
            return Vec::new();
        }
        self.free.retain(|f| f.0 < frames);
        self.owned().filter(|(f, _)| f.0 >= frames).collect()
    }

    /// The limit a shrink went to, once: when every frame above it is unowned and idle.
    pub(super) fn poll_returned(&mut self) -> Option<u32> {
        let to = self.returning?;
        let above = (to as usize)..self.owner.len();
        let idle = above
            .clone()
            .all(|i| self.owner[i].is_none() && self.busy[i] == 0);
        idle.then(|| {
            self.returning = None;
            to
        })
    }

    /// Checks the counts: free frames are below the limit, unowned and idle.
    pub(super) fn check(&self) {
        for f in &self.free {
            let i = f.0 as usize;
            assert!(f.0 < self.limit, "free peer frame {f:?} above the limit");
            assert!(
                self.owner[i].is_none() && self.busy[i] == 0,
                "free peer frame {f:?} in use"
            );
        }
        let mut sorted: Vec<u32> = self.free.iter().map(|f| f.0).collect();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), self.free.len(), "a peer frame free twice");
    }
}

/// # The peer-GPU tier (see the module docs of `peer.rs`)
impl PoolCore {
    /// The neighbouring GPU lends `frames` frames now (peer frames `0..frames`). A lower
    /// count than before takes the frames above back: their copies are dropped (the host
    /// tier holds every page), at once or as soon as the copy in flight on the frame
    /// lands; [`PoolCore::poll_peer_returned`] says when they are free for the lender.
    pub fn set_peer_frames(&mut self, frames: u32, now: Duration) {
        for (frame, pid) in self.gpu.peer.set_limit(frames) {
            if !self.gpu.peer.busy(frame) {
                self.drop_peer_copy(pid);
            }
        }
        self.pump(now);
    }

    /// Peer frames the pool may use now (the last [`PoolCore::set_peer_frames`]).
    pub fn peer_frames(&self) -> u32 {
        self.gpu.peer.limit()
    }

    /// After [`PoolCore::set_peer_frames`] lowered the count: the count, once no frame
    /// above it holds a copy or has a copy in flight (the lender may use them again).
    pub fn poll_peer_returned(&mut self) -> Option<u32> {
        self.gpu.peer.poll_returned()
    }

    /// Drops `pid`'s copy on the peer (its bytes changed, its slot went, its buffer was
    /// freed). A frame with a copy in flight comes free when the copy lands.
    pub(super) fn drop_peer_copy(&mut self, pid: PageId) {
        let page = self.pages.page_mut(pid);
        if let Peer::Held(frame) = page.peer {
            page.peer = Peer::Absent;
            self.gpu.peer.vacate(frame);
        }
    }

    /// Drops the peer copies of pages `range` of buffer `id`.
    pub(super) fn drop_peer_copies(&mut self, id: BufferId, range: std::ops::Range<usize>) {
        for index in range {
            self.drop_peer_copy(PageId {
                buffer: id,
                index: index as u32,
            });
        }
    }

    /// Starts a device→peer copy of clean page `pid` leaving `frame`, if the peer can
    /// take it now (a free frame, or a copy used later than `pid`): the page is
    /// `Evicting` until it lands. False if it cannot (the page is simply dropped).
    pub(super) fn start_peer_fill(
        &mut self,
        pid: PageId,
        frame: FrameId,
        fill: PeerFill,
        now: Duration,
    ) -> bool {
        let PeerFill::Keeping(keep) = fill else {
            return false;
        };
        if self.gpu.peer.limit() == 0
            || self.pages.page(pid).peer != Peer::Absent
            || !self
                .copies
                .may_issue(Direction::DeviceToPeer, self.pages.len_of(pid))
            || !matches!(self.pages.page(pid).host, Host::Slot { .. })
        {
            return false;
        }
        let Some(to) = self.peer_frame_for(pid, keep) else {
            return false;
        };
        if let Gpu::Resident {
            unused_prefetch: true,
            ..
        } = self.pages.page(pid).gpu
        {
            // It leaves the GPU unused (the fill's end makes it resident again, briefly).
            self.stats.prefetch_wasted += 1;
        }
        self.gpu.peer.occupy(to, pid);
        self.gpu.peer.begin_copy(to);
        self.stats.peer_fills += 1;
        self.gpu.begin_evicting();
        let page = self.pages.page_mut(pid);
        page.peer = Peer::Filling(to);
        page.gpu = Gpu::Evicting { frame };
        self.issue_copy(pid, Direction::DeviceToPeer, frame, Far::Peer(to), now);
        true
    }

    /// A peer frame for a copy of `pid`: a free one, else the frame of the idle copy
    /// used furthest ahead, if that is after `pid`'s next use (its copy is dropped). The
    /// copies of `keep` and of pages an acquire waits for are no victims: they are about
    /// to be loaded from.
    fn peer_frame_for(&mut self, pid: PageId, keep: PageId) -> Option<PeerFrameId> {
        if let Some(f) = self.gpu.peer.take() {
            return Some(f);
        }
        let now = self.access.accesses();
        let key = |next: Option<u64>| next.filter(|&n| n > now).unwrap_or(u64::MAX);
        let incoming = self.access.next_use(pid.buffer);
        // A page with no predicted use takes only a free frame.
        incoming?;
        let incoming = key(incoming);
        let mut best: Option<(u64, PeerFrameId, PageId)> = None;
        for (f, owner) in self.gpu.peer.owned() {
            if self.gpu.peer.busy(f) || owner == keep || self.pages.page(owner).pins > 0 {
                continue;
            }
            let next = key(self.access.next_use(owner.buffer));
            if next > incoming && best.is_none_or(|(n, ..)| next > n) {
                best = Some((next, f, owner));
            }
        }
        let (_, frame, owner) = best?;
        self.drop_peer_copy(owner);
        let taken = self.gpu.peer.take();
        debug_assert_eq!(
            taken,
            Some(frame),
            "the victim's peer frame comes free at once"
        );
        taken
    }

    /// A copy of `pid` to or from peer frame `on` failed: the copy is lost, not the page
    /// (its host slot holds its bytes). A fill's page is clean and resident again (its
    /// frame comes free as after a drop); a load's frame holds garbage, so the page
    /// leaves it and, if an acquire waits for it, loads again from its slot.
    pub(super) fn peer_copy_failed(
        &mut self,
        pid: PageId,
        on: PeerFrameId,
        freed: bool,
        wanted: bool,
    ) {
        self.stats.peer_errors += 1;
        self.gpu.peer.end_copy(on);
        let page = self.pages.page_mut(pid);
        if matches!(page.peer, Peer::Held(f) | Peer::Filling(f) if f == on) {
            page.peer = Peer::Absent;
            self.gpu.peer.vacate(on);
        }
        match self.pages.page(pid).gpu {
            Gpu::Evicting { frame } => self.settle_evicted(pid, frame, wanted && !freed),
            Gpu::Loading { frame, .. } => {
                self.release_frame(pid, frame);
                if wanted && !freed {
                    self.access.demand.push_back(pid);
                }
            }
            state => debug_assert!(false, "a peer copy of {pid} failed in state {state:?}"),
        }
    }

    /// The direction a load of `pid` takes: from its peer copy if it has one, else from
    /// its host slot.
    pub(super) fn load_direction(&self, pid: PageId) -> Direction {
        if self.pages.page(pid).peer.held().is_some() {
            Direction::PeerToDevice
        } else {
            Direction::HostToDevice
        }
    }

    /// Queues a copy of `pid` between `frame` and `far` (its slot or its peer frame).
    pub(super) fn issue_copy(
        &mut self,
        pid: PageId,
        direction: Direction,
        frame: FrameId,
        far: Far,
        now: Duration,
    ) {
        let op = CopyOp {
            id: self.ids.transfer(),
            direction,
            frame,
            far,
            bytes: self.pages.len_of(pid),
        };
        self.pages.page_mut(pid).in_flight += 1;
        self.copies.issue(op, pid, now);
    }

    /// A copy of `pid` on peer `frame` landed: a fill makes the copy whole; the frame
    /// is idle again; the copy goes if the frame was asked back or the buffer freed
    /// meanwhile (a copy dropped while read was vacated already).
    pub(super) fn end_peer_copy(&mut self, pid: PageId, frame: PeerFrameId, freed: bool) {
        let page = self.pages.page_mut(pid);
        if page.peer == Peer::Filling(frame) {
            page.peer = Peer::Held(frame);
        }
        self.gpu.peer.end_copy(frame);
        if (freed || frame.0 >= self.gpu.peer.limit()) && page.peer == Peer::Held(frame) {
            page.peer = Peer::Absent;
            self.gpu.peer.vacate(frame);
        }
    }
}
