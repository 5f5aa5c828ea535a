//! The simulated pool and its one scheduler: the Raft cluster's events, the page
//! network's messages and the fault timers, merged on one clock (the cluster's,
//! simulated microseconds), earliest first, ties to the cluster.
//!
//! The page network stands for the nodes' QUIC connections: reliable and ordered per
//! request, so a `Loss` fault delays a message (a retransmission after 200 ms, maybe
//! more than once) instead of dropping it; a cut link or a dead receiver drops it, and
//! the sender learns of it only when its request times out (the QUIC idle timeout, 3 s).
//! Raft messages go over the cluster's own simulated network, which drops, delays and
//! duplicates them under the same faults.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::path::Path;

use spillway_meta::rng::SimRng;
use spillway_meta::sim::{NodeClock, SimCluster, SimConfig};
use spillway_meta::{Applied, Batch, ProposalFailed, Ticket, Update};
use spillway_net::{Request, Response};
use spillway_types::NodeId;

use super::core_client::CoreClient;
use super::faults::{self, Fault, ScheduledFault};
use super::oracle::Client;
use super::{ChaosConfig, ChaosError, RunCounts, RunReport, Violation, ViolationKind};
use crate::meta::{Outcome, ProposeFailure};
use crate::placement::Placement;
use crate::store::HostStore;
use crate::tier::RemoteError;

/// The pool's page size in the simulation: 64 KiB, the smallest allowed (the data of a
/// page is shorter; capacity is counted in whole pages).
pub(super) const PAGE_BYTES: u64 = 64 << 10;
/// Each node lends room for 96 pages (6 MiB at 64 KiB): the other nodes' clients of a
/// 3-node pool keep at most 64 copies on it (the scripted client's 24 pages and the core
/// client's 8, 2 copies over 2 holders each), plus a reservation chunk each and copies
/// fenced or waiting to be deleted.
pub(super) const CAPACITY_PAGES: u64 = 96;
/// A proposal not answered this long fails: the node's `PROPOSAL_TIMEOUT` (5 s).
const PROPOSAL_TIMEOUT_US: u64 = crate::meta::PROPOSAL_TIMEOUT.as_micros() as u64;
/// One-way latency of a page message: 0.1 to 1 ms (a LAN), more under a `Delay` fault.
const LATENCY_US: (u64, u64) = (100, 1_000);
/// A retransmission under a `Loss` fault: 200 ms later.
const RETRANSMIT_US: u64 = 200_000;
/// A peer that failed a request is not tried for 1 s (the node's reconnect backoff).
const BACKOFF_US: u64 = crate::peers::RECONNECT_BACKOFF_MAX.as_micros() as u64;

/// A queue of timed items, earliest first, ties in insertion order.
pub(super) struct Queue<T> {
    heap: BinaryHeap<Reverse<(u64, u64)>>,
    items: BTreeMap<u64, T>,
    next: u64,
}

impl<T> Queue<T> {
    fn new() -> Self {
        Queue {
            heap: BinaryHeap::new(),
            items: BTreeMap::new(),
            next: 0,
        }
    }

    fn push(&mut self, at_us: u64, item: T) {
        self.heap.push(Reverse((at_us, self.next)));
        self.items.insert(self.next, item);
        self.next += 1;
    }

    fn peek_at(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    fn pop(&mut self) -> Option<T> {
        let Reverse((_, seq)) = self.heap.pop()?;
        self.items.remove(&seq)
    }
}

/// What a page message carries.
#[derive(Clone, Debug)]
pub(super) enum Body {
    /// A page request (put, get, delete) to the receiver's host store.
    Request(Request),
    /// Its answer.
    Response(Response),
    /// A proposal forwarded to the node the sender takes for the leader.
    Forward(Batch),
    /// The leader's answer to a forwarded proposal.
    Forwarded(Result<Vec<Outcome>, ProposeFailure>),
}

struct Msg {
    from: NodeId,
    to: NodeId,
    id: u64,
    /// The receiver's incarnation when it was sent (a reply to a crashed requester is void).
    to_gen: u64,
    body: Body,
}

enum Timer {
    Start(ScheduledFault),
    End(ScheduledFault),
    /// A node that crashed at a failpoint restarts.
    Restart(NodeId),
}

/// A node that crashed at a failpoint (feature `failpoints`, action `panic`) restarts
/// this long after: 2 s.
const FAILPOINT_RESTART_US: u64 = 2_000_000;

/// Why an operation stopped without an answer of the remote tier.
#[derive(Debug)]
pub(super) enum OpError {
    /// Its node crashed meanwhile (the operation died with it).
    Crashed,
    /// The remote tier's error.
    Remote(RemoteError),
    /// A repair batch of the node holds one of the pages ([`Placement::claim`] refused):
    /// the tokio driver waits for the batch to end; a simulated client tries again on a
    /// later turn.
    ///
    /// [`Placement::claim`]: crate::placement::Placement::claim
    Busy,
}

impl From<RemoteError> for OpError {
    fn from(e: RemoteError) -> Self {
        OpError::Remote(e)
    }
}

/// One node of the simulated pool, beside its Raft member (in the cluster).
pub(super) struct PoolNode {
    /// Grows at every crash: replies and operations of an earlier life are void.
    pub(super) generation: u64,
    pub(super) running: bool,
    pub(super) paused: bool,
    pub(super) store: HostStore,
    pub(super) brain: Placement,
    replies: BTreeMap<u64, Body>,
    /// Whether this incarnation's announcement (down and up: a new epoch) and the release
    /// of the earlier incarnation's pages are done; its client waits for it.
    pub(super) announced: bool,
    backoff_until_us: BTreeMap<NodeId, u64>,
    pub(super) next_repair_us: u64,
    pub(super) next_housekeeping_us: u64,
    pub(super) client: Client,
    /// The client running the real core; out of here while it works.
    pub(super) core: Option<CoreClient>,
}

impl PoolNode {
    fn new(id: NodeId, generation: u64, replicas: u8, now_ms: u64) -> Self {
        PoolNode {
            generation,
            running: true,
            paused: false,
            store: super::host_store(CAPACITY_PAGES * PAGE_BYTES, PAGE_BYTES),
            brain: Placement::new(
                id,
                PAGE_BYTES,
                crate::config::RESERVE_CHUNK_BYTES_DEFAULT.min(8 * PAGE_BYTES),
                replicas,
                now_ms,
            ),
            replies: BTreeMap::new(),
            announced: false,
            backoff_until_us: BTreeMap::new(),
            next_repair_us: 0,
            next_housekeeping_us: 0,
            client: Client::new(id, generation),
            core: Some(
                CoreClient::new(id, generation, now_ms * 1000)
                    .expect("the core client's configuration is valid"),
            ),
        }
    }
}

/// The whole simulated pool (see the module doc).
pub(super) struct World {
    pub(super) c: SimCluster,
    pub(super) seed: u64,
    pub(super) config: ChaosConfig,
    /// The page network's randomness.
    net_rng: SimRng,
    /// The workload's randomness (which operation, which pages).
    pub(super) work_rng: SimRng,
    /// Whether an operation runs inside another of its node (a client's spill inside a
    /// repair batch, or a repair batch inside a spill): no deeper nesting.
    pub(super) nested: bool,
    msgs: Queue<Msg>,
    timers: Queue<Timer>,
    page_cut: BTreeSet<(NodeId, NodeId)>,
    loss: f64,
    delay_max_us: u64,
    pub(super) nodes: BTreeMap<NodeId, PoolNode>,
    /// Proposals a leader carries for a node: (leader, ticket) -> (proposer, request id,
    /// proposer's incarnation).
    forwards: BTreeMap<(NodeId, Ticket), (NodeId, u64, u64)>,
    next_id: u64,
    /// Crash times (µs) per node, for the loss rule.
    pub(super) crashed_at: BTreeMap<NodeId, Vec<u64>>,
    pub(super) counts: RunCounts,
    pub(super) violations: Vec<Violation>,
    faults: Vec<ScheduledFault>,
    log_hash: u64,
    log: Vec<String>,
}

impl World {
    pub(super) fn new(
        seed: u64,
        config: &ChaosConfig,
        root: &Path,
        faults: Option<Vec<ScheduledFault>>,
    ) -> Result<Self, ChaosError> {
        let mut rng = SimRng::new(seed ^ 0x5EED_C4A0_5000_0001);
        let nodes = if config.nodes == 0 {
            rng.between(3, 5)
        } else {
            config.nodes
        };
        let mut sim = SimConfig::new(seed);
        sim.voters = nodes;
        sim.page_bytes = PAGE_BYTES;
        sim.capacity_bytes = CAPACITY_PAGES * PAGE_BYTES;
        // The log's bytes are real, their durability is not what this tests: no fsync.
        sim.sync_writes = false;
        sim.latency_us_min = LATENCY_US.0;
        sim.latency_us_max = LATENCY_US.1;
        // A Raft node panicking at a failpoint is a crash of that node.
        sim.crash_on_panic = true;
        let c = SimCluster::new(sim, root)?;
        let faults = faults.unwrap_or_else(|| {
            let mut fault_rng = SimRng::new(seed ^ 0xFA17_0000_0000_0002);
            faults::schedule(&mut fault_rng, config.faults, nodes, config.length_ms)
        });
        let mut timers = Queue::new();
        for f in &faults {
            timers.push(f.at_ms * 1000, Timer::Start(*f));
        }
        let replicas = config.replicas;
        let world = World {
            c,
            seed,
            config: config.clone(),
            net_rng: SimRng::new(seed ^ 0x0E70_0000_0000_0003),
            work_rng: SimRng::new(seed ^ 0x3012_0000_0000_0004),
            nested: false,
            msgs: Queue::new(),
            timers,
            page_cut: BTreeSet::new(),
            loss: 0.0,
            delay_max_us: 0,
            nodes: (1..=nodes)
                .map(|i| (NodeId(i), PoolNode::new(NodeId(i), 0, replicas, 0)))
                .collect(),
            forwards: BTreeMap::new(),
            next_id: 1,
            crashed_at: BTreeMap::new(),
            counts: RunCounts::default(),
            violations: Vec::new(),
            faults,
            log_hash: 0xcbf2_9ce4_8422_2325,
            log: Vec::new(),
        };
        Ok(world)
    }

    /// Simulated time, µs.
    pub(super) fn now_us(&self) -> u64 {
        self.c.now_us()
    }

    /// Simulated time, ms.
    pub(super) fn now_ms(&self) -> u64 {
        self.c.now_ms()
    }

    /// Adds a line to the event log (hashed always, kept when asked).
    pub(super) fn log(&mut self, line: impl Into<String>) {
        let line = format!("{:>8} ms {}", self.now_ms(), line.into());
        for b in line.bytes() {
            self.log_hash ^= u64::from(b);
            self.log_hash = self.log_hash.wrapping_mul(0x0100_0000_01b3);
        }
        if self.config.keep_log {
            self.log.push(line);
        }
    }

    /// Records a broken invariant.
    pub(super) fn violation(&mut self, kind: ViolationKind, detail: String) {
        self.log(format!("VIOLATION {kind:?}: {detail}"));
        let v = Violation {
            at_ms: self.now_ms(),
            kind,
            detail,
        };
        self.violations.push(v);
    }

    pub(super) fn report(self, wall_ms: u64) -> RunReport {
        RunReport {
            seed: self.seed,
            nodes: self.nodes.len() as u64,
            sim_ms: self.now_ms(),
            wall_ms,
            counts: self.counts,
            faults: self.faults,
            violations: self.violations,
            log_hash: self.log_hash,
            log: self.log,
        }
    }

    // ---- the scheduler ----

    /// Processes the next event due by `deadline_us`; false when there is none (the clock
    /// then stands at the deadline).
    pub(super) fn step_until(&mut self, deadline_us: u64) -> bool {
        let raft = self.c.next_event_at_us();
        let next = [raft, self.msgs.peek_at(), self.timers.peek_at()]
            .into_iter()
            .flatten()
            .min();
        let Some(at) = next.filter(|&t| t <= deadline_us) else {
            self.c.run_until_us(deadline_us);
            return false;
        };
        if raft == Some(at) {
            self.c.step_event();
            self.answer_forwards();
            self.reap_panicked();
        } else {
            self.c.run_until_us(at);
            if self.timers.peek_at() == Some(at) {
                match self.timers.pop().expect("peeked") {
                    Timer::Start(f) => self.start_fault(f),
                    Timer::End(f) => self.end_fault(f),
                    Timer::Restart(id) => {
                        self.log(format!("{id} restarts after its crash at a failpoint"));
                        self.restart(id);
                    }
                }
            } else {
                let m = self.msgs.pop().expect("peeked");
                self.deliver(m);
            }
        }
        self.counts.events += 1;
        self.check_budgets();
        true
    }

    /// Runs until `done` holds or the deadline passes; whether `done` held.
    pub(super) fn run_until(
        &mut self,
        deadline_us: u64,
        mut done: impl FnMut(&mut World) -> bool,
    ) -> bool {
        loop {
            if done(self) {
                return true;
            }
            if !self.step_until(deadline_us) {
                return done(self);
            }
        }
    }

    /// Lets `ms` of simulated time pass.
    pub(super) fn idle_ms(&mut self, ms: u64) {
        let end = self.now_us() + ms * 1000;
        while self.step_until(end) {}
    }

    /// Whether `node` still runs the incarnation `generation`.
    pub(super) fn alive(&self, node: NodeId, generation: u64) -> Result<(), OpError> {
        match self.nodes.get(&node) {
            Some(n) if n.running && n.generation == generation => Ok(()),
            _ => Err(OpError::Crashed),
        }
    }

    pub(super) fn node(&mut self, node: NodeId, generation: u64) -> Result<&mut PoolNode, OpError> {
        self.alive(node, generation)?;
        Ok(self.nodes.get_mut(&node).expect("alive"))
    }

    // ---- the page network ----

    fn send(&mut self, from: NodeId, to: NodeId, id: u64, body: Body) {
        let Some(to_gen) = self.nodes.get(&to).map(|n| n.generation) else {
            return;
        };
        let mut at = self.now_us() + 1;
        if from != to {
            if self.page_cut.contains(&(from, to)) {
                return;
            }
            let max = LATENCY_US.1.max(self.delay_max_us);
            at += self.net_rng.between(LATENCY_US.0, max);
            while self.net_rng.chance(self.loss) {
                at += RETRANSMIT_US;
            }
        }
        self.msgs.push(
            at,
            Msg {
                from,
                to,
                id,
                to_gen,
                body,
            },
        );
    }

    fn deliver(&mut self, m: Msg) {
        let Some(node) = self.nodes.get(&m.to) else {
            return;
        };
        if !node.running || node.generation != m.to_gen || self.page_cut.contains(&(m.from, m.to)) {
            return;
        }
        if node.paused {
            // A stopped process reads nothing; the message waits in its socket.
            let at = self.now_us() + 10_000;
            self.msgs.push(at, m);
            return;
        }
        match m.body {
            Body::Request(request) => {
                if self.config.keep_log {
                    let what = match &request {
                        Request::Put { pages } => {
                            format!("put {:?}", pages.iter().map(|p| p.id).collect::<Vec<_>>())
                        }
                        Request::Get { pages } => format!("get {pages:?}"),
                        Request::Delete { pages } => format!("delete {pages:?}"),
                        other => format!("{:?}", other.kind()),
                    };
                    self.log(format!("{} -> {}: {what}", m.from, m.to));
                }
                let node = &self.nodes[&m.to];
                let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    node.store.handle_pages(m.from, request)
                }));
                match handled {
                    Ok(response) => self.send(m.to, m.from, m.id, Body::Response(response)),
                    Err(_) => self.crashed_at_failpoint(m.to),
                }
            }
            Body::Forward(batch) => self.forward_arrived(m.from, m.to, m.id, batch),
            reply @ (Body::Response(_) | Body::Forwarded(_)) => {
                self.nodes
                    .get_mut(&m.to)
                    .expect("checked")
                    .replies
                    .insert(m.id, reply);
            }
        }
    }

    fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Waits for the reply to request `id` of `node` until `deadline_us`.
    fn wait_reply(
        &mut self,
        node: NodeId,
        generation: u64,
        id: u64,
        deadline_us: u64,
        mut give_up: impl FnMut(&World) -> bool,
    ) -> Result<Option<Body>, OpError> {
        let mut crashed = false;
        self.run_until(deadline_us, |w| {
            match w.nodes.get(&node) {
                Some(n) if n.running && n.generation == generation => {}
                _ => {
                    crashed = true;
                    return true;
                }
            }
            w.nodes[&node].replies.contains_key(&id) || give_up(w)
        });
        if crashed {
            return Err(OpError::Crashed);
        }
        Ok(self.node(node, generation)?.replies.remove(&id))
    }

    /// Whether `node` would try `peer` now (not in its backoff after a failure).
    pub(super) fn reachable(&self, node: NodeId, peer: NodeId) -> bool {
        node != peer
            && self.nodes[&node]
                .backoff_until_us
                .get(&peer)
                .is_none_or(|&t| t <= self.now_us())
    }

    /// Sends a page request from `node` to `peer`; its id, or `None` when `node` would
    /// not try `peer` now (in its backoff: the request fails at once).
    pub(super) fn send_request(
        &mut self,
        node: NodeId,
        generation: u64,
        peer: NodeId,
        request: Request,
    ) -> Result<Option<u64>, OpError> {
        self.alive(node, generation)?;
        if !self.reachable(node, peer) {
            return Ok(None);
        }
        let id = self.fresh_id();
        self.send(node, peer, id, Body::Request(request));
        Ok(Some(id))
    }

    /// The answer to `node`'s request `id`, if it came.
    pub(super) fn take_response(&mut self, node: NodeId, id: u64) -> Option<Response> {
        let n = self.nodes.get_mut(&node)?;
        match n.replies.remove(&id)? {
            Body::Response(r) => Some(r),
            other => {
                n.replies.insert(id, other);
                None
            }
        }
    }

    /// `node` stops trying `peer` for a while after a failed request.
    pub(super) fn start_backoff(&mut self, node: NodeId, peer: NodeId) {
        let until = self.now_us() + BACKOFF_US;
        if let Some(n) = self.nodes.get_mut(&node) {
            n.backoff_until_us.insert(peer, until);
        }
    }

    // ---- proposals ----

    /// Proposes `updates` from `node`: forwarded to the leader it knows (or made there if
    /// it leads), retried while there is no leader or the leader turns it away, until the
    /// proposal timeout.
    pub(super) fn propose(
        &mut self,
        node: NodeId,
        generation: u64,
        updates: Vec<Update>,
    ) -> Result<Vec<Outcome>, OpError> {
        let deadline = self.now_us() + PROPOSAL_TIMEOUT_US;
        let mut leader = None;
        loop {
            self.alive(node, generation)?;
            if self.now_us() >= deadline {
                return Err(OpError::Remote(RemoteError::Meta(
                    ProposeFailure::TimedOut {
                        timeout_ms: PROPOSAL_TIMEOUT_US / 1000,
                        leader,
                    },
                )));
            }
            leader = self.c.try_node(node).and_then(|n| n.leader());
            let Some(l) = leader else {
                let wait = self.now_us() + 100_000;
                self.run_until(wait.min(deadline), |_| false);
                continue;
            };
            let id = self.fresh_id();
            let batch = Batch {
                now_ms: self.c.clock_ms(node),
                updates: updates.clone(),
            };
            self.send(node, l, id, Body::Forward(batch));
            match self.wait_reply(node, generation, id, deadline, |_| false)? {
                Some(Body::Forwarded(Ok(outcomes))) => return Ok(outcomes),
                Some(Body::Forwarded(Err(e))) if retryable(&e) => {
                    let wait = self.now_us() + 50_000;
                    self.run_until(wait.min(deadline), |_| false);
                }
                Some(Body::Forwarded(Err(e))) => return Err(OpError::Remote(e.into())),
                _ => {} // timed out: the loop ends it
            }
        }
    }

    fn forward_arrived(&mut self, from: NodeId, at: NodeId, id: u64, batch: Batch) {
        let from_gen = self.nodes[&from].generation;
        let leads = self.c.try_node(at).is_some_and(|n| n.is_leader());
        if !leads {
            let leader = self.c.try_node(at).and_then(|n| n.leader());
            let e = ProposeFailure::Failed {
                reason: format!("not the leader (leader: {leader:?})"),
            };
            self.send(at, from, id, Body::Forwarded(Err(e)));
            return;
        }
        let proposed = self.c.with_node(at, move |n| n.propose(&batch));
        self.reap_panicked();
        match proposed {
            Some(Ok(ticket)) => {
                self.forwards.insert((at, ticket), (from, id, from_gen));
            }
            Some(Err(e)) => {
                let e = ProposeFailure::Failed {
                    reason: e.to_string(),
                };
                self.send(at, from, id, Body::Forwarded(Err(e)));
            }
            None => {}
        }
    }

    /// Sends the leaders' answers to the proposals they completed.
    fn answer_forwards(&mut self) {
        for (leader, completion) in self.c.take_completions() {
            let Some((to, id, _)) = self.forwards.remove(&(leader, completion.ticket)) else {
                continue;
            };
            let answer = match completion.result {
                Ok(Applied::Batch { outcomes }) => Ok(outcomes
                    .into_iter()
                    .map(|o| match o {
                        Ok(()) => Outcome::Accepted,
                        Err(r) => Outcome::Rejected {
                            reason: r.to_string(),
                        },
                    })
                    .collect()),
                Ok(Applied::Membership { .. }) => Ok(Vec::new()),
                Err(ProposalFailed::Lost | ProposalFailed::Overtaken) => {
                    Err(ProposeFailure::Busy { queued: 0 })
                }
                Err(e) => Err(ProposeFailure::Failed {
                    reason: e.to_string(),
                }),
            };
            self.send(leader, to, id, Body::Forwarded(answer));
        }
    }

    // ---- faults ----

    fn start_fault(&mut self, f: ScheduledFault) {
        self.counts.faults += 1;
        self.log(format!("fault {:?}", f.fault));
        let all: Vec<NodeId> = self.nodes.keys().copied().collect();
        match f.fault {
            Fault::Crash { node, torn, .. } => self.crash(NodeId(node), torn),
            Fault::Pause { node, .. } => {
                let id = NodeId(node);
                if let Some(n) = self.nodes.get_mut(&id) {
                    n.paused = true;
                }
                self.c.isolate(id);
            }
            Fault::Isolate { node, .. } => {
                let id = NodeId(node);
                self.c.isolate(id);
                self.cut_both(id, &all);
            }
            Fault::CutIn { node, .. } => {
                let id = NodeId(node);
                for &o in all.iter().filter(|&&o| o != id) {
                    self.c.cut_one_way(o, id);
                    self.page_cut.insert((o, id));
                }
            }
            Fault::CutOut { node, .. } => {
                let id = NodeId(node);
                for &o in all.iter().filter(|&&o| o != id) {
                    self.c.cut_one_way(id, o);
                    self.page_cut.insert((id, o));
                }
            }
            Fault::CutFromLeader { node, .. } => {
                let id = NodeId(node);
                if let Some(l) = self.c.leader().filter(|&l| l != id) {
                    self.c.partition(&[&[id], &[l]]);
                    self.page_cut.insert((id, l));
                    self.page_cut.insert((l, id));
                }
            }
            Fault::Split { minority, .. } => {
                let (a, b): (Vec<NodeId>, Vec<NodeId>) = all.iter().partition(|n| n.0 <= minority);
                self.c.partition(&[&a, &b]);
                for &x in &a {
                    self.cut_both(x, &b);
                }
            }
            Fault::Loss { permille, .. } => {
                let p = permille as f64 / 1000.0;
                self.c.set_drop_rate(p);
                self.loss = p;
            }
            Fault::Delay { max_ms, .. } => {
                self.c.set_latency_us(LATENCY_US.0, max_ms * 1000);
                self.delay_max_us = max_ms * 1000;
            }
            Fault::Duplicate { permille, .. } => {
                self.c.set_duplicate_rate(permille as f64 / 1000.0);
            }
            Fault::ClockSkew { node, skew_ms, .. } => {
                self.c
                    .set_clock(NodeId(node), Some(NodeClock::Skewed(skew_ms)));
            }
            Fault::ClockStop { node, .. } => {
                let at = self.c.clock_ms(NodeId(node));
                self.c
                    .set_clock(NodeId(node), Some(NodeClock::StoppedAt(at)));
            }
            Fault::SlowDisk { node, write_ms, .. } => {
                self.c.set_disk_delay_us(NodeId(node), write_ms * 1000);
            }
        }
        let end = self.now_us() + f.fault.ms() * 1000;
        self.timers.push(end, Timer::End(f));
    }

    fn cut_both(&mut self, x: NodeId, others: &[NodeId]) {
        for &o in others.iter().filter(|&&o| o != x) {
            self.page_cut.insert((x, o));
            self.page_cut.insert((o, x));
        }
    }

    fn end_fault(&mut self, f: ScheduledFault) {
        self.log(format!("healed {:?}", f.fault));
        match f.fault {
            Fault::Crash { node, .. } => self.restart(NodeId(node)),
            Fault::Pause { node, .. } => {
                if let Some(n) = self.nodes.get_mut(&NodeId(node)) {
                    n.paused = false;
                }
                self.heal_links();
            }
            Fault::Isolate { .. }
            | Fault::CutIn { .. }
            | Fault::CutOut { .. }
            | Fault::CutFromLeader { .. }
            | Fault::Split { .. } => self.heal_links(),
            Fault::Loss { .. } => {
                self.c.set_drop_rate(0.0);
                self.loss = 0.0;
            }
            Fault::Delay { .. } => {
                self.c.set_latency_us(LATENCY_US.0, LATENCY_US.1);
                self.delay_max_us = 0;
            }
            Fault::Duplicate { .. } => self.c.set_duplicate_rate(0.0),
            Fault::ClockSkew { node, .. } | Fault::ClockStop { node, .. } => {
                self.c.set_clock(NodeId(node), None);
            }
            Fault::SlowDisk { node, .. } => self.c.set_disk_delay_us(NodeId(node), 0),
        }
    }

    /// Restores every link (link faults never overlap, so this ends only the one on).
    fn heal_links(&mut self) {
        self.c.heal();
        self.page_cut.clear();
    }

    /// Ends every fault now (the end of the run): links, network, pauses, and restarts
    /// every crashed node.
    pub(super) fn heal_all(&mut self) {
        while let Some(t) = self.timers.pop() {
            if let Timer::End(f) = t {
                self.end_fault(f);
            }
        }
        self.heal_links();
    }

    fn crash(&mut self, id: NodeId, torn: bool) {
        let Some(n) = self.nodes.get_mut(&id) else {
            return;
        };
        if !n.running {
            return;
        }
        n.running = false;
        n.paused = false;
        n.generation += 1;
        self.counts.crashes += 1;
        self.c.kill(id);
        let now = self.now_us();
        self.crashed_at.entry(id).or_default().push(now);
        // The RAM is gone: check what that took with it before the store goes.
        self.pages_lost_with(id);
        let n = self.nodes.get_mut(&id).expect("exists");
        n.store = super::host_store(CAPACITY_PAGES * PAGE_BYTES, PAGE_BYTES);
        n.replies.clear();
        n.client.crashed();
        n.core = None;
        if torn {
            let bytes = 1 + self.net_rng.below(4096) as usize;
            let garbage: Vec<u8> = (0..bytes).map(|_| self.net_rng.next_u64() as u8).collect();
            if let Err(e) = tear_log_tail(self.c.dir(id), &garbage) {
                self.log(format!("could not tear {id}'s log: {e}"));
            }
        }
    }

    fn restart(&mut self, id: NodeId) {
        if self.nodes.get(&id).is_none_or(|n| n.running) {
            return;
        }
        if let Err(e) = self.c.restart(id) {
            self.violation(
                ViolationKind::RestartFailed,
                format!("{id} could not reopen its log: {e}"),
            );
            return;
        }
        let generation = self.nodes[&id].generation;
        let now_ms = self.now_ms();
        let fresh = PoolNode::new(id, generation, self.config.replicas, now_ms);
        self.nodes.insert(id, fresh);
    }

    /// A node that panicked at a failpoint (its Raft thread, its store or its brain)
    /// crashes there, and restarts [`FAILPOINT_RESTART_US`] later.
    pub(super) fn crashed_at_failpoint(&mut self, id: NodeId) {
        if !self.nodes.get(&id).is_some_and(|n| n.running) {
            return;
        }
        self.log(format!("{id} crashed at a failpoint"));
        self.counts.failpoint_crashes += 1;
        self.crash(id, false);
        let at = self.now_us() + FAILPOINT_RESTART_US;
        self.timers.push(at, Timer::Restart(id));
    }

    /// Nodes whose Raft thread panicked (the cluster killed them): crashes.
    fn reap_panicked(&mut self) {
        let dead: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(id, n)| n.running && self.c.try_node(**id).is_none())
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            self.crashed_at_failpoint(id);
        }
    }

    // ---- invariants checked after every event ----

    fn check_budgets(&mut self) {
        let over: Vec<(NodeId, u64, u64)> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.running)
            .map(|(&id, n)| {
                let b = n.store.budget();
                (id, b.used_bytes(), b.budget_bytes())
            })
            .filter(|(_, used, budget)| used > budget)
            .collect();
        for (id, used, budget) in over {
            self.violation(
                ViolationKind::BudgetExceeded,
                format!("{id}'s host store holds {used} bytes of a {budget}-byte budget"),
            );
        }
    }
}

fn retryable(e: &ProposeFailure) -> bool {
    matches!(
        e,
        ProposeFailure::Busy { .. }
            | ProposeFailure::Failed { .. }
            | ProposeFailure::TimedOut { .. }
    )
}

/// Appends `garbage` to the newest file of the log in `dir`: a write cut short by the
/// crash, which the log's recovery must drop (raft-engine tolerates a torn tail).
fn tear_log_tail(dir: &Path, garbage: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    // raft-engine names its log files by sequence number: the largest is the newest.
    let mut newest: Option<std::path::PathBuf> = None;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "raftlog")
            && newest
                .as_ref()
                .is_none_or(|n| path.file_name() > n.file_name())
        {
            newest = Some(path);
        }
    }
    if let Some(path) = newest {
        std::fs::OpenOptions::new()
            .append(true)
            .open(path)?
            .write_all(garbage)?;
    }
    Ok(())
}
