//! A model of the bytes for the state machine's tests (`remote.rs`, `peer.rs`): every
//! frame, slot, peer frame and remote page holds a (page, version) pair, moved by the
//! copies and remote ops exactly as a device, a peer GPU and a remote tier would move
//! bytes. An acquire must see the newest version of each of its pages, whatever the
//! tiers did in between: no page is ever lost or stale.

// Each test file uses a part of the model.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use proptest::prelude::*;
use spillway_core::{
    AccessMode, AcquireId, CopyOp, CoreError, DeviceFault, MappingChange, PageLocation, PoolCore,
    RemoteError, RemoteOp, RemoteOpKind,
};
use spillway_types::config::{Policy, PoolConfig};
use spillway_types::{BufferId, Direction, Far, FrameId, HostSlot, PageId, PageSize, PeerFrameId};

pub const PAGE: u64 = 64 << 10;

pub type Version = (PageId, u64);

/// Page `index` of `buffer`.
pub fn page(buffer: BufferId, index: u32) -> PageId {
    PageId { buffer, index }
}

/// The core and a model of where each version of each page is.
pub struct Model {
    pub core: PoolCore,
    pub frames: HashMap<FrameId, Version>,
    pub slots: HashMap<HostSlot, Version>,
    pub remote: HashMap<PageId, u64>,
    /// The frames a peer GPU lends, and how many it lends now: a copy on a frame not lent
    /// fails the test (the lender's memory was touched).
    pub peer: HashMap<PeerFrameId, Version>,
    pub peer_lent: u32,
    /// What the lender asked to come down to, until the core says the frames are back.
    pub peer_asked: u32,
    /// Every copy to or from the peer fails (the peer GPU is gone): nothing moves.
    pub peer_fails: bool,
    pub latest: HashMap<PageId, u64>,
    pub gpu: VecDeque<CopyOp>,
    pub net: VecDeque<RemoteOp>,
    /// The page mapped at each frame (from the core's mapping changes).
    pub mapped: HashMap<FrameId, PageId>,
    /// Buffers whose pages the remote tier has lost (every holder died): their fetches
    /// fail with [`RemoteError::Lost`].
    pub lost: HashSet<BufferId>,
    pub now: u64,
    /// Copies and remote ops the model may still finish: a livelock (ops that never let
    /// an acquire become ready) fails the test instead of hanging it.
    pub budget: u64,
    /// Acquires and `run_ops` finish GPU copies in bursts of up to [`Model::BURST`], one
    /// `handle_transfers_done` call each.
    pub bursts: bool,
    /// The most copies finished in one burst so far.
    pub largest_burst: usize,
}

impl Model {
    pub fn new(gpu_pages: u64, host_pages: u64, remote_pages: u64, policy: Policy) -> Model {
        let mut cfg = PoolConfig::new(gpu_pages * PAGE, host_pages * PAGE);
        cfg.page_size = PageSize::new(PAGE).unwrap();
        cfg.remote_budget_bytes = remote_pages * PAGE;
        cfg.policy = policy;
        cfg.h2d_bytes_in_flight_max = 4 * PAGE;
        cfg.remote_bytes_in_flight_max = 4 * PAGE;
        Model {
            core: PoolCore::new(cfg, 1e9).unwrap(),
            frames: HashMap::new(),
            slots: HashMap::new(),
            remote: HashMap::new(),
            peer: HashMap::new(),
            peer_lent: 0,
            peer_asked: 0,
            peer_fails: false,
            latest: HashMap::new(),
            gpu: VecDeque::new(),
            net: VecDeque::new(),
            mapped: HashMap::new(),
            lost: HashSet::new(),
            now: 0,
            budget: 200_000,
            bursts: false,
            largest_burst: 0,
        }
    }

    pub fn t(&mut self) -> Duration {
        self.budget = self
            .budget
            .checked_sub(1)
            .expect("the pool keeps moving pages without making progress");
        self.now += 1;
        Duration::from_micros(self.now * 100)
    }

    /// Takes the work the core queued, as a driver does after every call; true if it
    /// zero-filled a slot.
    pub fn collect(&mut self) -> bool {
        // Zero fills first: the copies and ops polled after them may read the slots.
        let mut filled = false;
        while let Some(fill) = self.core.poll_zero_fill() {
            self.slots.insert(fill.slot, (fill.page, 0));
            filled = true;
        }
        while let Some(m) = self.core.poll_mapping() {
            match m {
                MappingChange::Map { page, frame } => {
                    self.mapped.insert(frame, page);
                }
                MappingChange::Unmap { page } => self.mapped.retain(|_, p| *p != page),
            }
        }
        while let Some(op) = self.core.poll_transfer() {
            if let Far::Peer(f) = op.far {
                assert!(
                    f.0 < self.peer_asked,
                    "a copy on peer frame {} starts while {} are lent",
                    f.0,
                    self.peer_asked
                );
            }
            self.gpu.push_back(op);
        }
        if let Some(back) = self.core.poll_peer_returned() {
            assert_eq!(back, self.peer_asked, "the frames asked back come back");
            self.peer_lent = back;
            self.peer.retain(|f, _| f.0 < back);
        }
        let s = self.core.stats();
        assert!(
            s.peer_frames_in_use <= u64::from(self.peer_lent),
            "{} peer frames in use, {} lent",
            s.peer_frames_in_use,
            self.peer_lent
        );
        self.net
            .extend(std::iter::from_fn(|| self.core.poll_remote()));
        for p in self.core.take_discards() {
            self.remote.remove(&p);
        }
        self.core.check_invariants();
        filled
    }

    /// Finishes the oldest GPU copy; false if none is in flight.
    pub fn finish_gpu(&mut self) -> bool {
        self.collect();
        let Some(tr) = self.gpu.pop_front() else {
            return false;
        };
        let result = self.copy_bytes(&tr);
        let now = self.t();
        self.core.handle_transfer_done(tr.id, result, now);
        self.collect();
        true
    }

    /// Copies finished at once when the model finishes them in bursts.
    pub const BURST: usize = 4;

    /// Finishes the `n` oldest GPU copies (those in flight, if fewer) and tells the core
    /// in one call, as a driver thread that found them all done; how many it finished.
    pub fn finish_gpu_burst(&mut self, n: usize) -> usize {
        self.collect();
        let burst: Vec<CopyOp> = (0..n).map_while(|_| self.gpu.pop_front()).collect();
        let done: Vec<_> = burst
            .iter()
            .map(|tr| (tr.id, self.copy_bytes(tr)))
            .collect();
        let now = self.t();
        self.core.handle_transfers_done(done, now);
        self.collect();
        self.largest_burst = self.largest_burst.max(burst.len());
        burst.len()
    }

    /// Moves the bytes of copy `tr` between the model's frames, slots and peer frames
    /// (checking each reads its own page); what its completion says.
    fn copy_bytes(&mut self, tr: &CopyOp) -> Result<(), DeviceFault> {
        let page = self.mapped[&tr.frame];
        if let Far::Peer(f) = tr.far {
            assert!(
                f.0 < self.peer_lent,
                "{:?} of {page} on peer frame {} while the peer lends {}",
                tr.direction,
                f.0,
                self.peer_lent
            );
        }
        if self.peer_fails && matches!(tr.far, Far::Peer(_)) {
            // A frame a failed load was copying into holds garbage.
            self.frames.remove(&tr.frame);
            return Err(DeviceFault::new("the peer GPU is gone"));
        }
        match (tr.direction, tr.far) {
            (Direction::PeerToDevice, Far::Peer(f)) => {
                let v = self.peer[&f];
                assert_eq!(v.0, page, "P2D of {page} reads its own peer copy");
                self.frames.insert(tr.frame, v);
            }
            (Direction::DeviceToPeer, Far::Peer(f)) => {
                let v = self.frames[&tr.frame];
                assert_eq!(v.0, page, "D2P of {page} reads its own frame");
                self.peer.insert(f, v);
            }
            (Direction::HostToDevice, Far::Host(slot)) => {
                let v = self.slot_version(slot, page);
                // A lost buffer's bytes are undefined (its failed fetch left garbage).
                if !self.lost.contains(&page.buffer) {
                    assert_eq!(v.0, page, "H2D of {page} reads its own slot");
                }
                self.frames.insert(tr.frame, v);
            }
            (Direction::DeviceToHost, Far::Host(slot)) => {
                let v = self.frames[&tr.frame];
                assert_eq!(v.0, page, "D2H of {page} reads its own frame");
                self.slots.insert(slot, v);
            }
            (direction, far) => panic!("{direction:?} with far side {far:?}"),
        }
        Ok(())
    }

    /// Finishes the oldest remote op; false if none is in flight.
    pub fn finish_net(&mut self) -> bool {
        self.collect();
        let Some(op) = self.net.pop_front() else {
            return false;
        };
        match op.kind {
            RemoteOpKind::Spill => {
                let v = self.slots[&op.slot];
                if !self.lost.contains(&op.page.buffer) {
                    assert_eq!(v.0, op.page, "spill of {} reads its own slot", op.page);
                }
                self.remote.insert(op.page, v.1);
            }
            RemoteOpKind::Fetch if self.lost.contains(&op.page.buffer) => {
                let now = self.t();
                let lost = RemoteError::Lost {
                    page: op.page,
                    message: "its holder node 3 is down".into(),
                };
                self.core.handle_remote_done(op.id, Err(lost), now);
                self.collect();
                return true;
            }
            RemoteOpKind::Fetch => {
                let v = *self
                    .remote
                    .get(&op.page)
                    .unwrap_or_else(|| panic!("fetch of {} that the remote tier lost", op.page));
                self.slots.insert(op.slot, (op.page, v));
            }
        }
        let now = self.t();
        self.core.handle_remote_done(op.id, Ok(()), now);
        self.collect();
        true
    }

    pub fn settle(&mut self) {
        while self.finish_gpu() | self.finish_net() {}
    }

    /// Finishes one copy or remote op for `waiter` (what waits on them); fails the test
    /// if none is in flight.
    pub fn progress(&mut self, waiter: &str) {
        let gpu = if self.bursts {
            self.finish_gpu_burst(Self::BURST) > 0
        } else {
            self.finish_gpu()
        };
        assert!(
            gpu | self.finish_net(),
            "{waiter} waits with nothing in flight\n{}",
            self.core.describe_pages()
        );
    }

    /// What slot `slot` holds for `page`: its version there, or, without a remote tier,
    /// version 0 of a page never written (the driver zero-filled its slot at `alloc`).
    pub fn slot_version(&self, slot: HostSlot, page: PageId) -> Version {
        match self.slots.get(&slot) {
            Some(&v) if v.0 == page => v,
            _ if !self.core.has_remote() && self.newest(page) == 0 => (page, 0),
            Some(&v) => v,
            None => panic!("{page} reads slot {slot:?}, which holds nothing"),
        }
    }

    /// The newest version of `pid` written so far (0: never written).
    pub fn newest(&self, pid: PageId) -> u64 {
        self.latest.get(&pid).copied().unwrap_or(0)
    }

    /// Each page of acquire `h` of buffer `b`, with the frame it holds.
    pub fn pages_of(&self, h: AcquireId, b: BufferId) -> Vec<(PageId, FrameId)> {
        let frames = self.core.frames_of(h).into_iter().enumerate();
        frames
            .map(|(i, frame)| (page(b, i as u32), frame))
            .collect()
    }

    /// The peer GPU lends `frames` from now on: more at once; fewer once the core has
    /// stopped using the frames above (see `collect`).
    pub fn lend(&mut self, frames: u32) {
        self.peer_asked = frames;
        if frames > self.peer_lent {
            self.peer_lent = frames;
        }
        let now = self.t();
        self.core.set_peer_frames(frames, now);
        self.collect();
    }

    /// Ends a step of the job, as a driver does.
    pub fn step(&mut self) {
        let now = self.t();
        self.core.step(now);
        self.collect();
    }

    /// Frees `b`, which must not be held.
    pub fn free(&mut self, b: BufferId) {
        let now = self.t();
        self.core.free(b, now).unwrap();
        self.collect();
    }

    /// Begins an acquire of `b` now, without waiting for it; returns it and when it began.
    pub fn begin_acquire(&mut self, b: BufferId, mode: AccessMode) -> (AcquireId, Duration) {
        let now = self.t();
        let (h, _) = self.core.begin_acquire(b, mode, now).unwrap();
        self.collect();
        (h, now)
    }

    /// Acquires `b` and waits for it, finishing copies; checks every page is the newest.
    pub fn acquire(&mut self, b: BufferId, mode: AccessMode) -> (AcquireId, bool) {
        self.try_acquire(b, mode).unwrap()
    }

    /// [`Model::acquire`], or the error the acquire began or ended with (released).
    pub fn try_acquire(
        &mut self,
        b: BufferId,
        mode: AccessMode,
    ) -> Result<(AcquireId, bool), CoreError> {
        let now = self.t();
        let (h, hit) = self.core.begin_acquire(b, mode, now)?;
        self.collect();
        loop {
            match self.core.is_ready(h) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    self.release(h);
                    return Err(e);
                }
            }
            self.progress("an acquire");
        }
        for (pid, frame) in self.pages_of(h, b) {
            let want = self.newest(pid);
            assert_eq!(
                self.frames[&frame],
                (pid, want),
                "{pid} on the GPU is its newest version"
            );
            if mode == AccessMode::Exclusive {
                self.latest.insert(pid, want + 1);
                self.frames.insert(frame, (pid, want + 1));
            }
        }
        Ok((h, hit))
    }

    /// Acquires `b` discarding its contents, waits for it, and writes a new version of
    /// every page (the old one is not read: the frames' bytes are undefined).
    pub fn discard_once(&mut self, b: BufferId) -> bool {
        let now = self.t();
        let (h, hit) = self.core.begin_acquire_discard(b, now).unwrap();
        self.collect();
        while !self.core.is_ready(h).unwrap() {
            self.progress("a discard acquire");
        }
        for (pid, frame) in self.pages_of(h, b) {
            let next = self.newest(pid) + 1;
            self.latest.insert(pid, next);
            self.frames.insert(frame, (pid, next));
        }
        self.release(h);
        hit
    }

    pub fn release(&mut self, h: AcquireId) {
        let now = self.t();
        self.core.release(h, now);
        self.collect();
    }

    /// [`Model::acquire`], then release at once: every page checked, and given a new
    /// version when `mode` is exclusive.
    pub fn use_once(&mut self, b: BufferId, mode: AccessMode) {
        let (h, _) = self.acquire(b, mode);
        self.release(h);
    }

    /// [`Model::use_once`], counting into `hits` (hits, reads) when `counted`.
    pub fn use_counted(
        &mut self,
        b: BufferId,
        mode: AccessMode,
        counted: bool,
        hits: &mut (u64, u64),
    ) {
        let (h, hit) = self.acquire(b, mode);
        self.release(h);
        if counted {
            hits.0 += u64::from(hit);
            hits.1 += 1;
        }
    }

    /// `n` new buffers of one page each.
    pub fn one_page_buffers(&mut self, n: usize) -> Vec<BufferId> {
        (0..n).map(|_| self.core.alloc(PAGE).unwrap()).collect()
    }

    /// Reads (and with `write`, writes) page 0 of `b` from the host; false if busy.
    pub fn host_access(&mut self, b: BufferId, write: bool) -> bool {
        let locs = loop {
            let now = self.t();
            match self.core.begin_host_access(b, 0, 1, write, now) {
                Ok(Some(l)) => break l,
                // The pages may have come into slots at once, zero-filled: ask again.
                Ok(None) if self.collect() => {}
                Ok(None) => self.progress("a host access"),
                Err(_) => return false,
            }
        };
        let pid = page(b, 0);
        let want = self.newest(pid);
        let cell = match locs[0] {
            PageLocation::Gpu(f) => self.frames.get_mut(&f).unwrap(),
            PageLocation::Host(s) => {
                let v = self.slot_version(s, pid);
                self.slots.insert(s, v);
                self.slots.get_mut(&s).unwrap()
            }
        };
        assert_eq!(*cell, (pid, want), "host sees the newest {pid}");
        if write {
            *cell = (pid, want + 1);
            self.latest.insert(pid, want + 1);
        }
        let now = self.t();
        self.core.end_host_access(b, 0, 1, write, now);
        self.collect();
        true
    }
}

/// One step of a random sequence (`random_sequences_*` in `remote.rs` and `peer.rs`);
/// indexes are taken modulo the buffers alive.
#[derive(Debug, Clone)]
pub enum Op {
    Alloc(u64),
    Acquire(usize, bool),
    HostAccess(usize, bool),
    Free(usize),
    Discard(usize),
    FinishGpu(usize),
    FinishNet(usize),
    /// The peer GPU lends this many frames from now on.
    Lend(u32),
    Step,
}

/// Random steps; with `lend`, the peer lends and takes back frames among them.
pub fn ops(lend: bool) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        1 => (1u64..3 * PAGE).prop_map(Op::Alloc),
        4 => (0usize..16, any::<bool>()).prop_map(|(i, x)| Op::Acquire(i, x)),
        1 => (0usize..16, any::<bool>()).prop_map(|(i, x)| Op::HostAccess(i, x)),
        1 => (0usize..16).prop_map(Op::Free),
        1 => (0usize..16).prop_map(Op::Discard),
        2 => (0usize..4).prop_map(Op::FinishGpu),
        1 => (0usize..4).prop_map(Op::FinishNet),
        u32::from(lend) => (0u32..6).prop_map(Op::Lend),
        1 => Just(Op::Step),
    ];
    proptest::collection::vec(op, 1..150)
}

impl Model {
    /// Runs `ops`, then lets everything finish and reads every buffer left from the
    /// host: every acquire and host access sees the newest version (the model panics
    /// otherwise).
    pub fn run_ops(&mut self, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let mut bufs: Vec<BufferId> = Vec::new();
        for op in ops {
            let pick = |bufs: &[BufferId], i: usize| bufs[i % bufs.len()];
            match op {
                Op::Alloc(bytes) => {
                    if let Ok(b) = self.core.alloc(bytes) {
                        bufs.push(b)
                    }
                }
                Op::Acquire(i, excl) if !bufs.is_empty() => {
                    let mode = if excl {
                        AccessMode::Exclusive
                    } else {
                        AccessMode::Shared
                    };
                    self.use_once(pick(&bufs, i), mode);
                }
                Op::HostAccess(i, write) if !bufs.is_empty() => {
                    prop_assert!(self.host_access(pick(&bufs, i), write));
                }
                Op::Free(i) if !bufs.is_empty() => {
                    let b = bufs.remove(i % bufs.len());
                    self.free(b);
                }
                Op::Discard(i) if !bufs.is_empty() => {
                    self.discard_once(pick(&bufs, i));
                }
                Op::FinishGpu(n) if self.bursts => {
                    self.finish_gpu_burst(n);
                }
                Op::FinishGpu(n) => {
                    for _ in 0..n {
                        self.finish_gpu();
                    }
                }
                Op::FinishNet(n) => {
                    for _ in 0..n {
                        self.finish_net();
                    }
                }
                Op::Lend(n) => self.lend(n),
                Op::Step => self.step(),
                _ => {}
            }
        }
        self.settle();
        for &b in &bufs {
            prop_assert!(self.host_access(b, false));
        }
        Ok(())
    }
}
