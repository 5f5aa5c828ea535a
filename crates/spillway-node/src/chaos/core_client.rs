//! A second client on every node that runs the real core (`spillway_core::PoolCore`) in a
//! training-like loop: its buffers are acquired in a forward pass (shared: every byte
//! compared with the buffer's latest write) and a backward pass (exclusive: new bytes
//! written), a step after each pair, with 2 GPU frames and 4 host slots for 8 pages, so
//! the core evicts to the remote tier, prefetches from it and discards from it. The
//! core's work is carried out as a driver does: copies between frames and slots at once,
//! remote spills, fetches and discards through the node's remote tier
//! ([`super::driver`]), timers at their time.
//!
//! A failed fetch loses the whole buffer in the core (as in the embedded and daemon
//! clients); the oracle then requires the loss rule to allow it, and the client frees the
//! buffer and allocates it again.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use spillway_core::{AccessMode, CoreError, DeviceFault, PoolCore, RemoteError, RemoteOpKind};
use spillway_types::config::{Policy, PoolConfig};
use spillway_types::{BufferId, Direction, FrameId, HostSlot, NodeId, PageId, PageSize};

use super::ViolationKind;
use super::driver;
use super::world::{OpError, PAGE_BYTES, World};

/// The core client's number on its node (the scripted client is 1).
pub(super) const CORE_CLIENT: u32 = 2;
/// Buffers of the loop, each two pages (the second short).
const BUFFERS: usize = 4;
/// GPU frames and host slots of the core: 8 pages, 4 of them at least remote.
const GPU_FRAMES: u64 = 2;
const HOST_SLOTS: u64 = 4;
/// Remote pages the core may use.
const REMOTE_PAGES: u64 = 12;
/// Rounds of work an acquire may take before it counts as stuck.
const ROUNDS_MAX: u32 = 400;

/// One buffer of the loop.
struct Buffer {
    id: BufferId,
    /// Each page's length and latest version.
    pages: Vec<(u64, u64)>,
    /// When its latest version was written (µs): its copies died after.
    written_us: u64,
}

/// The core client of one node incarnation.
pub(super) struct CoreClient {
    node: NodeId,
    generation: u64,
    core: PoolCore,
    frames: BTreeMap<FrameId, Bytes>,
    slots: BTreeMap<HostSlot, Bytes>,
    buffers: Vec<Buffer>,
    /// Where the loop is: accesses `0..BUFFERS` forward, then backward.
    cursor: usize,
    /// Discards refused while a repair batch held their pages, to send again.
    discards: Vec<PageId>,
}

impl CoreClient {
    pub(super) fn new(node: NodeId, generation: u64, now_us: u64) -> Result<Self, String> {
        let mut cfg = PoolConfig::new(GPU_FRAMES * PAGE_BYTES, HOST_SLOTS * PAGE_BYTES);
        cfg.page_size = PageSize::new(PAGE_BYTES).expect("64 KiB is a page size");
        cfg.remote_budget_bytes = REMOTE_PAGES * PAGE_BYTES;
        cfg.policy = Policy::Learned;
        cfg.h2d_bytes_in_flight_max = 2 * PAGE_BYTES;
        cfg.d2h_bytes_in_flight_max = 2 * PAGE_BYTES;
        cfg.remote_bytes_in_flight_max = 4 * PAGE_BYTES;
        let core = PoolCore::new(cfg, 1e9).map_err(|e| e.to_string())?;
        let mut c = CoreClient {
            node,
            generation,
            core,
            frames: BTreeMap::new(),
            slots: BTreeMap::new(),
            buffers: Vec::new(),
            cursor: 0,
            discards: Vec::new(),
        };
        for k in 0..BUFFERS {
            let b = c.alloc(k, now_us).map_err(|e| e.to_string())?;
            c.buffers.push(b);
        }
        Ok(c)
    }

    fn alloc(&mut self, k: usize, now_us: u64) -> Result<Buffer, CoreError> {
        let short = 256 + (self.node.0 * 977 + k as u64 * 131 + self.generation * 61) % 3840;
        let id = self.core.alloc(PAGE_BYTES + short)?;
        Ok(Buffer {
            id,
            pages: vec![(PAGE_BYTES, 0), (short, 0)],
            written_us: now_us,
        })
    }

    /// The bytes of `version` of page `index` of buffer `k`: zeros before its first write.
    fn data(&self, k: usize, index: usize, version: u64) -> Bytes {
        let len = self.buffers[k].pages[index].0 as usize;
        if version == 0 {
            return Bytes::from(vec![0u8; len]);
        }
        let mut rng = spillway_meta::rng::SimRng::new(
            self.node.0 << 48
                ^ self.generation << 40
                ^ (k as u64) << 32
                ^ (index as u64) << 24
                ^ version,
        );
        super::random_bytes(&mut rng, len)
    }
}

fn now(w: &World) -> Duration {
    Duration::from_micros(w.now_us())
}

/// What stopped an access of the core client.
enum Stop {
    /// The node crashed: the client went with it.
    Crashed,
    /// The core failed, or an acquire never became ready: a broken invariant.
    Broken(String),
}

impl From<OpError> for Stop {
    fn from(e: OpError) -> Self {
        match e {
            OpError::Crashed => Stop::Crashed,
            other => Stop::Broken(format!("{other:?}")),
        }
    }
}

impl World {
    /// One access of `id`'s core client (the next of its loop); `verify_all` instead
    /// reads every buffer back once (the end of the run).
    pub(super) fn core_op(&mut self, id: NodeId, generation: u64, verify_all: bool) {
        let Some(mut c) = self.nodes.get_mut(&id).and_then(|n| n.core.take()) else {
            return;
        };
        let result = if verify_all {
            (0..BUFFERS).try_for_each(|k| self.core_access(&mut c, k, AccessMode::Shared))
        } else {
            let (k, mode) = if c.cursor < BUFFERS {
                (c.cursor, AccessMode::Shared)
            } else {
                (2 * BUFFERS - 1 - c.cursor, AccessMode::Exclusive)
            };
            self.core_access(&mut c, k, mode).map(|()| {
                c.cursor += 1;
                if c.cursor == 2 * BUFFERS {
                    c.cursor = 0;
                    c.core.step(now(self));
                }
            })
        };
        match result {
            Ok(()) => {
                if let Some(n) = self
                    .nodes
                    .get_mut(&id)
                    .filter(|n| n.generation == generation)
                {
                    n.core = Some(c);
                }
            }
            Err(Stop::Crashed) => {}
            Err(Stop::Broken(why)) => {
                self.violation(
                    ViolationKind::NoProgress,
                    format!("{id}'s core client: {why}"),
                );
            }
        }
    }

    /// Acquires buffer `k` in `mode`, compares (shared) or writes (exclusive) its bytes,
    /// and releases it. A buffer the core lost is checked against the loss rule and
    /// allocated again.
    fn core_access(&mut self, c: &mut CoreClient, k: usize, mode: AccessMode) -> Result<(), Stop> {
        let (aid, _hit) = match c.core.begin_acquire(c.buffers[k].id, mode, now(self)) {
            Ok(a) => a,
            Err(CoreError::PageLost { .. }) => return self.core_buffer_lost(c, k),
            Err(e) => return Err(Stop::Broken(format!("acquire: {e}"))),
        };
        let mut rounds = 0;
        loop {
            self.core_pump(c)?;
            match c.core.is_ready(aid) {
                Ok(true) => break,
                Ok(false) => {}
                Err(CoreError::PageLost { .. }) => {
                    c.core.release(aid, now(self));
                    return self.core_buffer_lost(c, k);
                }
                Err(e) => return Err(Stop::Broken(format!("is_ready: {e}"))),
            }
            rounds += 1;
            if rounds > ROUNDS_MAX {
                return Err(Stop::Broken(format!(
                    "an acquire of buffer {k} not ready after {ROUNDS_MAX} rounds: {}",
                    c.core.describe_pages()
                )));
            }
            // Nothing left to carry out: the core waits for a timer (a spill's backoff),
            // while the nodes' background work (pending deletes, repairs) goes on.
            let wait_us = c.core.poll_timeout().map_or(10_000, |t| {
                (t.as_micros() as u64).saturating_sub(self.now_us())
            });
            let until = self.now_us() + wait_us.clamp(1_000, 1_000_000);
            while self.now_us() < until {
                self.turn(false);
                self.idle_ms(((until - self.now_us()) / 1000).clamp(1, 20));
            }
            self.alive(c.node, c.generation)?;
            c.core.handle_timeout(now(self));
        }
        let frames = c.core.frames_of(aid);
        let mut wrong = Vec::new();
        for (index, frame) in frames.iter().enumerate() {
            let version = c.buffers[k].pages[index].1;
            match mode {
                AccessMode::Shared => {
                    let want = c.data(k, index, version);
                    let got = c.frames.get(frame).cloned().unwrap_or_default();
                    self.counts.pages_verified += 1;
                    if got != want {
                        wrong.push(format!(
                            "buffer {k} page {index} version {version}: {} bytes, want {}",
                            got.len(),
                            want.len()
                        ));
                    }
                }
                AccessMode::Exclusive => {
                    c.buffers[k].written_us = self.now_us();
                    c.buffers[k].pages[index].1 = version + 1;
                    let data = c.data(k, index, version + 1);
                    c.frames.insert(*frame, data);
                }
            }
        }
        if !wrong.is_empty() {
            self.violation(
                ViolationKind::WrongBytes,
                format!("{}'s core client read {}", c.node, wrong.join(", ")),
            );
        }
        c.core.release(aid, now(self));
        self.counts.core_acquires += 1;
        self.core_pump(c)
    }

    /// The core lost buffer `k` (a fetch of one of its pages failed): allowed only when
    /// the loss rule allows it, now or when its copies died (`replicas` nodes crashed
    /// within one repair bound of each other, from one bound before it was written on: a
    /// node that crashed shortly before the write may still have been down or unrepaired
    /// then, and a spill leaves out a copy for want of up members, as the scripted
    /// client's rule counts it); the client starts the buffer over.
    fn core_buffer_lost(&mut self, c: &mut CoreClient, k: usize) -> Result<(), Stop> {
        let down = self.recently_down();
        let since = c.buffers[k]
            .written_us
            .saturating_sub(super::REPAIR_BOUND_MS * 1000);
        let crashed = self.crashes_within_bound_since(since);
        if self.loss_allowed(&down) || crashed >= usize::from(self.config.replicas) {
            self.counts.core_buffers_lost_allowed += 1;
        } else {
            self.violation(
                ViolationKind::PageLost,
                format!(
                    "{}'s core client lost buffer {k} with {} node(s) down within the repair bound ({down:?})",
                    c.node,
                    down.len()
                ),
            );
        }
        let old = c.buffers[k].id;
        c.core
            .free(old, now(self))
            .map_err(|e| Stop::Broken(format!("free: {e}")))?;
        let b = c
            .alloc(k, self.now_us())
            .map_err(|e| Stop::Broken(format!("alloc: {e}")))?;
        c.buffers[k] = b;
        self.core_pump(c)
    }

    /// The most distinct nodes that crashed within one repair bound of each other, at or
    /// after `since_us`.
    fn crashes_within_bound_since(&self, since_us: u64) -> usize {
        let mut crashes: Vec<(u64, NodeId)> = self
            .crashed_at
            .iter()
            .flat_map(|(id, times)| times.iter().map(move |&t| (t, *id)))
            .filter(|&(t, _)| t >= since_us)
            .collect();
        crashes.sort();
        let bound = super::REPAIR_BOUND_MS * 1000;
        (0..crashes.len())
            .map(|i| {
                let mut nodes: Vec<NodeId> = crashes[i..]
                    .iter()
                    .take_while(|(t, _)| *t <= crashes[i].0 + bound)
                    .map(|(_, n)| *n)
                    .collect();
                nodes.sort();
                nodes.dedup();
                nodes.len()
            })
            .max()
            .unwrap_or(0)
    }

    /// Carries out everything the core queued until it queues nothing more.
    fn core_pump(&mut self, c: &mut CoreClient) -> Result<(), Stop> {
        loop {
            let mut did = false;
            while let Some(fill) = c.core.poll_zero_fill() {
                c.slots
                    .insert(fill.slot, Bytes::from(vec![0u8; fill.bytes as usize]));
                did = true;
            }
            while c.core.poll_mapping().is_some() {}
            while let Some(op) = c.core.poll_transfer() {
                // The chaos client's core has no peer GPU: every copy is with a slot.
                let result = match (op.direction, op.slot()) {
                    (Direction::HostToDevice, Some(slot)) => {
                        let b = c.slots.get(&slot).cloned().unwrap_or_default();
                        c.frames.insert(op.frame, b);
                        Ok(())
                    }
                    (Direction::DeviceToHost, Some(slot)) => {
                        let b = c.frames.get(&op.frame).cloned().unwrap_or_default();
                        c.slots.insert(slot, b);
                        Ok(())
                    }
                    (direction, _) => Err(DeviceFault::new(format!(
                        "no peer GPU in the chaos client: {direction:?}"
                    ))),
                };
                c.core.handle_transfer_done(op.id, result, now(self));
                did = true;
            }
            let mut discards = std::mem::take(&mut c.discards);
            discards.extend(c.core.take_discards());
            if !discards.is_empty() {
                match driver::discard(self, c.node, c.generation, CORE_CLIENT, discards.clone()) {
                    Ok(()) | Err(OpError::Remote(_)) => {}
                    Err(OpError::Busy) => c.discards = discards,
                    Err(OpError::Crashed) => return Err(Stop::Crashed),
                }
            }
            while let Some(op) = c.core.poll_remote() {
                did = true;
                let result = match op.kind {
                    RemoteOpKind::Spill => {
                        let data = c.slots.get(&op.slot).cloned().unwrap_or_default();
                        match driver::spill(
                            self,
                            c.node,
                            c.generation,
                            CORE_CLIENT,
                            vec![(op.page, data)],
                        ) {
                            Ok(()) => Ok(()),
                            Err(OpError::Crashed) => return Err(Stop::Crashed),
                            Err(e) => Err(RemoteError::tier(format!("{e:?}"))),
                        }
                    }
                    RemoteOpKind::Fetch => {
                        match driver::fetch(self, c.node, c.generation, CORE_CLIENT, vec![op.page])
                        {
                            Ok(mut b) if b.len() == 1 && b[0].len() as u64 == op.bytes => {
                                c.slots.insert(op.slot, b.remove(0));
                                Ok(())
                            }
                            Ok(b) => Err(RemoteError::WrongLength {
                                page: op.page,
                                got_bytes: b.first().map_or(0, |b| b.len() as u64),
                                expected_bytes: op.bytes,
                            }),
                            Err(OpError::Crashed) => return Err(Stop::Crashed),
                            Err(e) => {
                                self.log(format!(
                                    "{}'s core client could not fetch {}: {e:?}",
                                    c.node, op.page
                                ));
                                Err(RemoteError::Lost {
                                    page: op.page,
                                    message: format!("{e:?}"),
                                })
                            }
                        }
                    }
                };
                c.core.handle_remote_done(op.id, result, now(self));
            }
            c.core.check_invariants();
            if !did {
                return Ok(());
            }
        }
    }
}
