//! An in-process cluster on a seeded simulated network, for tests and measurements
//! (in the manner of raft-rs's `harness/src/network.rs`).
//!
//! Time is simulated in microseconds. Every node ticks every [`SimConfig::tick_ms`]
//! (each with its own phase, as independent timers would), and every message is encoded
//! with [`crate::wire`], then dropped (at [`SimConfig::drop_rate`], across a partition, or
//! to a dead node) or delivered after a latency drawn from
//! [`SimConfig::latency_us_min`]..=[`SimConfig::latency_us_max`]. Nodes keep their logs in
//! real raft-engine directories under the root the caller gives, so kill and restart
//! exercise the real recovery path. All randomness (the network's and each node's
//! election timeouts) comes from [`SimConfig::seed`]: the same seed replays the same run,
//! and a panicking test prints the seed to replay it with.
//!
//! The file system and the CPU are real: fsync costs wall-clock time but no simulated
//! time, so simulated durations measure the protocol (ticks, timeouts, latencies), and
//! wall-clock durations of a run measure the implementation.
//!
//! Each node lives on its own thread and the simulation calls it synchronously (one call
//! at a time, so runs stay deterministic). raft-engine 0.4 caches the last block it read
//! in a thread-local keyed by file position only; two engines read on one thread would
//! get each other's entries. [`SimCluster::node`] hands out a lock guard on a node: drop
//! it before the simulation runs again.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;

use raft::eraftpb::{Message, MessageType};

use crate::command::{Batch, InitialCluster, MemberInfo, MembershipChange};
use crate::ids::{NodeId, Ticket};
use crate::limits;
use crate::node::{
    Applied, Completion, MetaConfig, MetaError, MetaNode, ProposalFailed, ProposeError,
};
use crate::rng::SimRng;
use crate::state::InvariantError;
use crate::wire;

/// Environment variable that overrides the seed of tests that honour it.
pub const SEED_ENV: &str = "SPILLWAY_SEED";

/// The seed a test should use: `SPILLWAY_SEED` if set, else `default`.
pub fn seed_from_env(default: u64) -> u64 {
    std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// How the simulated cluster and its network behave.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Initial voters, ids 1..=voters.
    pub voters: u64,
    /// Simulated length of a tick.
    pub tick_ms: u64,
    /// Smallest one-way message latency.
    pub latency_us_min: u64,
    /// Largest one-way message latency.
    pub latency_us_max: u64,
    /// Probability that a message is lost.
    pub drop_rate: f64,
    /// Probability that a message is delivered twice (each copy with its own latency).
    pub duplicate_rate: f64,
    /// The pool's page size.
    pub page_bytes: u64,
    /// Capacity of each initial member and of nodes added with [`SimCluster::add_node`].
    pub capacity_bytes: u64,
    /// Whether nodes fsync their log writes.
    pub sync_writes: bool,
    /// See [`MetaConfig::heartbeat_ticks`].
    pub heartbeat_ticks: usize,
    /// See [`MetaConfig::election_ticks`].
    pub election_ticks: usize,
    /// See [`MetaConfig::election_ticks_max`].
    pub election_ticks_max: usize,
    /// See [`MetaConfig::snapshot_interval_entries`].
    pub snapshot_interval_entries: u64,
    /// See [`MetaConfig::log_entries_kept_after_snapshot`].
    pub log_entries_kept_after_snapshot: u64,
    /// See [`MetaConfig::proposals_in_flight_max`].
    pub proposals_in_flight_max: usize,
    /// See [`MetaConfig::down_after_ticks`].
    pub down_after_ticks: u64,
    /// A node whose thread panics is killed (a crash, as at a failpoint set to `panic`)
    /// instead of failing the simulation.
    pub crash_on_panic: bool,
}

impl SimConfig {
    /// Three voters, the recommended 100 ms tick and default timeouts, a LAN-like
    /// 0.2–2 ms latency, no loss, fsync on.
    pub fn new(seed: u64) -> Self {
        SimConfig {
            seed,
            voters: 3,
            tick_ms: limits::TICK_MS_RECOMMENDED,
            latency_us_min: 200,
            latency_us_max: 2_000,
            drop_rate: 0.0,
            duplicate_rate: 0.0,
            page_bytes: 2 << 20,
            capacity_bytes: 64 << 30,
            sync_writes: true,
            heartbeat_ticks: limits::HEARTBEAT_TICKS_DEFAULT,
            election_ticks: limits::ELECTION_TICKS_DEFAULT,
            election_ticks_max: limits::ELECTION_TICKS_MAX_DEFAULT,
            snapshot_interval_entries: limits::SNAPSHOT_INTERVAL_ENTRIES_DEFAULT,
            log_entries_kept_after_snapshot: limits::LOG_ENTRIES_KEPT_AFTER_SNAPSHOT_DEFAULT,
            proposals_in_flight_max: limits::PROPOSALS_IN_FLIGHT_MAX_DEFAULT,
            down_after_ticks: limits::DOWN_AFTER_TICKS_DEFAULT,
            crash_on_panic: false,
        }
    }

    /// The address the simulation gives node `id` (never dialled).
    pub fn address(id: NodeId) -> String {
        format!("sim://node{}", id.0)
    }
}

/// Counts of the simulated network.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Messages handed to the network.
    pub sent: u64,
    /// Messages delivered and stepped.
    pub delivered: u64,
    /// Messages lost (random loss, partition, dead node).
    pub dropped: u64,
    /// Bytes of delivered messages.
    pub delivered_bytes: u64,
}

#[derive(Clone, Debug)]
enum EventKind {
    Tick {
        node: NodeId,
        generation: u64,
    },
    Deliver {
        from: NodeId,
        to: NodeId,
        generation: u64,
        bytes: Vec<u8>,
        snapshot: bool,
    },
}

#[derive(Debug)]
struct Event {
    at_us: u64,
    seq: u64,
    kind: EventKind,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        (self.at_us, self.seq) == (other.at_us, other.seq)
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at_us, self.seq).cmp(&(other.at_us, other.seq))
    }
}

struct SimNode {
    host: Option<NodeHost>,
    dir: PathBuf,
    /// Grows at every kill and restart, so ticks and messages of a former life are void.
    generation: u64,
    seed: u64,
}

type Job = Box<dyn FnOnce(&mut MetaNode) + Send>;

/// A node on its own thread (see the module doc).
struct NodeHost {
    node: Arc<Mutex<MetaNode>>,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl NodeHost {
    fn open(config: MetaConfig, initial: Option<InitialCluster>) -> Result<Self, MetaError> {
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (open_tx, open_rx) = mpsc::sync_channel(1);
        let id = config.id;
        let thread = std::thread::Builder::new()
            .name(format!("sim-node-{}", id.0))
            .spawn(move || match MetaNode::open(config, initial.as_ref()) {
                Ok(node) => {
                    let node = Arc::new(Mutex::new(node));
                    let _ = open_tx.send(Ok(Arc::clone(&node)));
                    for job in jobs_rx {
                        let mut guard = node.lock().expect("node lock");
                        job(&mut guard);
                    }
                }
                Err(e) => {
                    let _ = open_tx.send(Err(e));
                }
            })
            .expect("spawn a node thread");
        let node = open_rx
            .recv()
            .unwrap_or_else(|_| panic!("{id}'s thread died while opening"))?;
        Ok(NodeHost {
            node,
            jobs: Some(jobs_tx),
            thread: Some(thread),
        })
    }

    /// Runs `f` on the node's thread and waits for it; `None` if the thread panicked.
    fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut MetaNode) -> R + Send + 'static,
    ) -> Option<R> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |n| {
            let _ = tx.send(f(n));
        });
        self.jobs.as_ref().expect("open host").send(job).ok()?;
        rx.recv().ok()
    }
}

impl Drop for NodeHost {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a node produced in one call.
struct Output {
    messages: Vec<Message>,
    completions: Vec<Completion>,
}

/// How a node's clock reads against simulated time (a clock fault of a harness; see
/// [`SimCluster::set_clock`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeClock {
    /// `ms` ahead of simulated time (behind when negative; never below 0).
    Skewed(i64),
    /// Stopped at this reading until set otherwise.
    StoppedAt(u64),
}

/// An in-process cluster (see the module doc).
pub struct SimCluster {
    config: SimConfig,
    root: PathBuf,
    rng: SimRng,
    now_us: u64,
    next_seq: u64,
    nodes: BTreeMap<NodeId, SimNode>,
    queue: BinaryHeap<Reverse<Event>>,
    cut: BTreeSet<(NodeId, NodeId)>,
    initial: InitialCluster,
    completions: Vec<(NodeId, Completion)>,
    stats: NetStats,
    /// Nodes whose clock is off ([`SimCluster::set_clock`]).
    clocks: BTreeMap<NodeId, NodeClock>,
    /// Nodes with a slow log disk: µs each of their messages leaves late
    /// ([`SimCluster::set_disk_delay_us`]).
    disk_delay_us: BTreeMap<NodeId, u64>,
}

impl SimCluster {
    /// Starts `config.voters` voters with their logs under `root` (one directory each).
    pub fn new(config: SimConfig, root: &Path) -> Result<Self, MetaError> {
        let initial = InitialCluster {
            members: (1..=config.voters)
                .map(|i| MemberInfo {
                    id: NodeId(i),
                    addresses: vec![SimConfig::address(NodeId(i))],
                    capacity_bytes: config.capacity_bytes,
                    zone: None,
                })
                .collect(),
            page_bytes: config.page_bytes,
        };
        let mut c = SimCluster {
            rng: SimRng::new(config.seed),
            config,
            root: root.to_path_buf(),
            now_us: 0,
            next_seq: 0,
            nodes: BTreeMap::new(),
            queue: BinaryHeap::new(),
            cut: BTreeSet::new(),
            initial,
            completions: Vec::new(),
            stats: NetStats::default(),
            clocks: BTreeMap::new(),
            disk_delay_us: BTreeMap::new(),
        };
        for i in 1..=c.config.voters {
            c.start(NodeId(i), true)?;
        }
        Ok(c)
    }

    /// The seed of this run.
    pub fn seed(&self) -> u64 {
        self.config.seed
    }

    /// Simulated time since the start, in milliseconds.
    pub fn now_ms(&self) -> u64 {
        self.now_us / 1000
    }

    /// What node `id`'s clock reads, ms: simulated time unless a clock fault holds
    /// ([`SimCluster::set_clock`]).
    pub fn clock_ms(&self, id: NodeId) -> u64 {
        let now = self.now_ms();
        match self.clocks.get(&id) {
            None => now,
            Some(NodeClock::Skewed(ms)) => now.saturating_add_signed(*ms),
            Some(NodeClock::StoppedAt(at)) => *at,
        }
    }

    /// Puts node `id`'s clock off (`None`: back to simulated time). Its metadata node
    /// observes this clock at every tick; a clock never runs back there (a node keeps
    /// the largest reading it saw), so a clock set behind stands still until time
    /// catches up.
    pub fn set_clock(&mut self, id: NodeId, clock: Option<NodeClock>) {
        match clock {
            Some(c) => self.clocks.insert(id, c),
            None => self.clocks.remove(&id),
        };
    }

    /// Makes node `id`'s log disk slow: every message it sends leaves `us` later (a
    /// Raft message goes out after the log write before it; heartbeats, which follow
    /// none, are delayed too, so this overstates the fault a little). 0 ends it.
    pub fn set_disk_delay_us(&mut self, id: NodeId, us: u64) {
        if us == 0 {
            self.disk_delay_us.remove(&id);
        } else {
            self.disk_delay_us.insert(id, us);
        }
    }

    /// Simulated time since the start, in microseconds.
    pub fn now_us(&self) -> u64 {
        self.now_us
    }

    /// Counts of the network.
    pub fn net_stats(&self) -> NetStats {
        self.stats
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    fn node_config(&self, id: NodeId, seed: u64) -> MetaConfig {
        let mut mc = MetaConfig::new(id, self.root.join(format!("node-{}", id.0)));
        mc.sync_writes = self.config.sync_writes;
        mc.heartbeat_ticks = self.config.heartbeat_ticks;
        mc.election_ticks = self.config.election_ticks;
        mc.election_ticks_max = self.config.election_ticks_max;
        mc.snapshot_interval_entries = self.config.snapshot_interval_entries;
        mc.log_entries_kept_after_snapshot = self.config.log_entries_kept_after_snapshot;
        mc.proposals_in_flight_max = self.config.proposals_in_flight_max;
        mc.down_after_ticks = self.config.down_after_ticks;
        mc.seed = seed;
        mc
    }

    fn start(&mut self, id: NodeId, initial_member: bool) -> Result<(), MetaError> {
        let generation = self.nodes.get(&id).map_or(0, |n| n.generation + 1);
        // Each life of a node gets its own seed, drawn from the run's generator.
        let seed = self.rng.next_u64();
        let config = self.node_config(id, seed);
        let dir = config.dir.clone();
        let initial = initial_member.then(|| self.initial.clone());
        let host = NodeHost::open(config, initial)?;
        self.nodes.insert(
            id,
            SimNode {
                host: Some(host),
                dir,
                generation,
                seed,
            },
        );
        // Send what opening produced.
        self.drive(id, |_| ());
        let tick_us = self.config.tick_ms * 1000;
        let phase = self.rng.below(tick_us.max(1));
        self.schedule(
            self.now_us + phase,
            EventKind::Tick {
                node: id,
                generation,
            },
        );
        Ok(())
    }

    /// Stops a node as a crash would: its process state is gone, its directory stays;
    /// messages to and from it in flight are lost.
    pub fn kill(&mut self, id: NodeId) {
        if let Some(n) = self.nodes.get_mut(&id) {
            n.host = None;
            n.generation += 1;
        }
    }

    /// Restarts a killed node from its directory.
    pub fn restart(&mut self, id: NodeId) -> Result<(), MetaError> {
        assert!(
            self.nodes.get(&id).is_some_and(|n| n.host.is_none()),
            "{id} is not a dead node"
        );
        // The initial cluster is passed again, as a daemon would: ignored when a log exists.
        let initial_member = self.initial.members.iter().any(|m| m.id == id);
        self.start(id, initial_member)
    }

    /// Starts a new, empty node that waits to be added with
    /// [`MembershipChange::AddLearner`] (see [`SimCluster::member_info`]).
    pub fn add_node(&mut self, id: NodeId) -> Result<(), MetaError> {
        assert!(!self.nodes.contains_key(&id), "{id} exists");
        self.start(id, false)
    }

    /// What node `id` would tell the pool about itself.
    pub fn member_info(&self, id: NodeId) -> MemberInfo {
        MemberInfo {
            id,
            addresses: vec![SimConfig::address(id)],
            capacity_bytes: self.config.capacity_bytes,
            zone: None,
        }
    }

    /// The directory of node `id`'s log.
    pub fn dir(&self, id: NodeId) -> &Path {
        &self.nodes[&id].dir
    }

    /// The election-timeout seed of node `id`'s current life.
    pub fn node_seed(&self, id: NodeId) -> u64 {
        self.nodes[&id].seed
    }

    /// Cuts every link between nodes of different groups (both ways).
    pub fn partition(&mut self, groups: &[&[NodeId]]) {
        for (i, a) in groups.iter().enumerate() {
            for b in &groups[i + 1..] {
                for &x in a.iter() {
                    for &y in b.iter() {
                        self.cut.insert((x, y));
                        self.cut.insert((y, x));
                    }
                }
            }
        }
    }

    /// Cuts `id` off from every other node.
    pub fn isolate(&mut self, id: NodeId) {
        let others: Vec<NodeId> = self.nodes.keys().copied().filter(|&n| n != id).collect();
        self.partition(&[&[id], &others]);
    }

    /// Restores every link.
    pub fn heal(&mut self) {
        self.cut.clear();
    }

    /// Sets the probability that a message is delivered twice.
    pub fn set_duplicate_rate(&mut self, p: f64) {
        self.config.duplicate_rate = p;
    }

    /// Sets the probability that a message is lost.
    pub fn set_drop_rate(&mut self, p: f64) {
        self.config.drop_rate = p;
    }

    /// Sets the one-way latency range.
    pub fn set_latency_us(&mut self, min: u64, max: u64) {
        assert!(min <= max);
        self.config.latency_us_min = min;
        self.config.latency_us_max = max;
    }

    /// Ids of the nodes that are running.
    pub fn live_nodes(&self) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.host.is_some())
            .map(|(&id, _)| id)
            .collect()
    }

    /// A running node, locked: drop the guard before running the simulation again.
    pub fn node(&self, id: NodeId) -> MutexGuard<'_, MetaNode> {
        self.try_node(id)
            .unwrap_or_else(|| panic!("{id} is not running"))
    }

    /// A running node, locked, or `None`.
    pub fn try_node(&self, id: NodeId) -> Option<MutexGuard<'_, MetaNode>> {
        let host = self.nodes.get(&id)?.host.as_ref()?;
        Some(host.node.lock().expect("node lock"))
    }

    /// The leader: among running nodes that think they lead, the one of the highest term.
    pub fn leader(&self) -> Option<NodeId> {
        self.live_nodes()
            .into_iter()
            .filter_map(|id| {
                let n = self.node(id);
                n.is_leader().then(|| (n.term(), id))
            })
            .max()
            .map(|(_, id)| id)
    }

    /// Runs `f` on node `id` (on its thread), then its Ready handling, and routes what it
    /// produced. `None` if the node is not running.
    pub fn with_node<R: Send + 'static>(
        &mut self,
        id: NodeId,
        f: impl FnOnce(&mut MetaNode) -> R + Send + 'static,
    ) -> Option<R> {
        self.drive(id, f)
    }

    // ---- running ----

    fn schedule(&mut self, at_us: u64, kind: EventKind) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push(Reverse(Event { at_us, seq, kind }));
    }

    /// Whether node `id` runs in life `generation` (events of an earlier life are void).
    fn is_running(&self, id: NodeId, generation: u64) -> bool {
        self.nodes
            .get(&id)
            .is_some_and(|n| n.generation == generation && n.host.is_some())
    }

    /// Processes the next event; false if there is none.
    pub fn step_event(&mut self) -> bool {
        let Some(Reverse(ev)) = self.queue.pop() else {
            return false;
        };
        debug_assert!(ev.at_us >= self.now_us);
        self.now_us = ev.at_us;
        match ev.kind {
            EventKind::Tick { node, generation } => {
                if self.is_running(node, generation) {
                    let now_ms = self.clock_ms(node);
                    self.drive(node, move |n| {
                        n.observe_clock_ms(now_ms);
                        n.tick()
                    });
                    let next = self.now_us + self.config.tick_ms * 1000;
                    self.schedule(next, EventKind::Tick { node, generation });
                }
            }
            EventKind::Deliver {
                from,
                to,
                generation,
                bytes,
                snapshot,
            } => {
                if !self.is_running(to, generation) || self.cut.contains(&(from, to)) {
                    self.stats.dropped += 1;
                    if snapshot {
                        self.drive(from, move |n| n.report_snapshot(to, false));
                    }
                    return true;
                }
                let msg = wire::decode_message(&bytes)
                    .unwrap_or_else(|e| panic!("simulated wire corrupted a message: {e}"));
                self.stats.delivered += 1;
                self.stats.delivered_bytes += bytes.len() as u64;
                self.drive(to, move |n| {
                    n.step(msg)
                        .unwrap_or_else(|e| panic!("{to} failed to step a message: {e}"));
                });
                if snapshot {
                    self.drive(from, move |n| n.report_snapshot(to, true));
                }
            }
        }
        true
    }

    /// Runs `f` then Ready handling on `id`'s thread, and routes the output.
    fn drive<R: Send + 'static>(
        &mut self,
        id: NodeId,
        f: impl FnOnce(&mut MetaNode) -> R + Send + 'static,
    ) -> Option<R> {
        let host = self.nodes.get(&id)?.host.as_ref()?;
        let ran = host.run(move |n| {
            let r = f(n);
            n.handle_ready()
                .unwrap_or_else(|e| panic!("{} failed in handle_ready: {e}", n.id()));
            let out = Output {
                messages: n.poll_messages(),
                completions: n.take_completions(),
            };
            (r, out)
        });
        let Some((r, out)) = ran else {
            // Its thread panicked (its message is above): a crash where allowed.
            assert!(
                self.config.crash_on_panic,
                "{id}'s thread panicked (its message is above)"
            );
            self.kill(id);
            return None;
        };
        self.completions
            .extend(out.completions.into_iter().map(|c| (id, c)));
        let mut failed_snapshots = Vec::new();
        for m in out.messages {
            let to = NodeId(m.to);
            let snapshot = m.get_msg_type() == MessageType::MsgSnapshot;
            if !self.route(id, m) && snapshot {
                failed_snapshots.push(to);
            }
        }
        // raft-rs sends a snapshot again only after a report, so this does not recurse
        // more than once.
        if !failed_snapshots.is_empty() {
            let report: Job = Box::new(move |n| {
                for to in failed_snapshots {
                    n.report_snapshot(to, false);
                }
            });
            self.drive(id, report);
        }
        Some(r)
    }

    /// Puts a message on the network; false if it was lost at once.
    fn route(&mut self, from: NodeId, msg: Message) -> bool {
        self.stats.sent += 1;
        let to = NodeId(msg.to);
        let target = self.nodes.get(&to).filter(|n| n.host.is_some());
        let lost = target.is_none()
            || self.cut.contains(&(from, to))
            || self.rng.chance(self.config.drop_rate);
        let Some(target) = target.filter(|_| !lost) else {
            self.stats.dropped += 1;
            return false;
        };
        let generation = target.generation;
        let latency = self
            .rng
            .between(self.config.latency_us_min, self.config.latency_us_max)
            + self.disk_delay_us.get(&from).copied().unwrap_or(0);
        let snapshot = msg.get_msg_type() == MessageType::MsgSnapshot;
        let deliver = EventKind::Deliver {
            from,
            to,
            generation,
            bytes: wire::encode_message(&msg),
            snapshot,
        };
        if self.rng.chance(self.config.duplicate_rate) {
            let again = self
                .rng
                .between(self.config.latency_us_min, self.config.latency_us_max);
            self.schedule(self.now_us + again, deliver.clone());
        }
        self.schedule(self.now_us + latency, deliver);
        true
    }

    /// When the next event (a tick or a delivery) is due, in simulated microseconds.
    pub fn next_event_at_us(&self) -> Option<u64> {
        self.queue.peek().map(|Reverse(e)| e.at_us)
    }

    /// Runs every event due at or before `at_us`, then moves the clock to `at_us` (never
    /// back): for a driver that merges its own events with the cluster's.
    pub fn run_until_us(&mut self, at_us: u64) {
        while self.queue.peek().is_some_and(|Reverse(e)| e.at_us <= at_us) {
            self.step_event();
        }
        self.now_us = self.now_us.max(at_us);
    }

    /// Takes the completion of `ticket` if it came in, with the node that reported it.
    pub fn take_completion(&mut self, ticket: Ticket) -> Option<(NodeId, Completion)> {
        let pos = self
            .completions
            .iter()
            .position(|(_, c)| c.ticket == ticket)?;
        Some(self.completions.remove(pos))
    }

    /// Cuts the link from `from` to `to` only (a one-way partition); [`SimCluster::heal`]
    /// restores it.
    pub fn cut_one_way(&mut self, from: NodeId, to: NodeId) {
        self.cut.insert((from, to));
    }

    /// Whether messages from `from` to `to` are cut.
    pub fn is_cut(&self, from: NodeId, to: NodeId) -> bool {
        self.cut.contains(&(from, to))
    }

    /// Runs for `ms` of simulated time.
    pub fn run_for_ms(&mut self, ms: u64) {
        self.run_until_us(self.now_us + ms * 1000);
    }

    /// Runs until `done` holds (checked after every event) or `max_ms` of simulated time
    /// pass. Returns the simulated milliseconds it took, or `None` on time-out.
    pub fn run_until(
        &mut self,
        max_ms: u64,
        mut done: impl FnMut(&SimCluster) -> bool,
    ) -> Option<u64> {
        let start = self.now_us;
        let end = start + max_ms * 1000;
        loop {
            if done(self) {
                return Some((self.now_us - start) / 1000);
            }
            if self.queue.peek().is_none_or(|Reverse(e)| e.at_us > end) || !self.step_event() {
                self.now_us = self.now_us.max(end);
                return done(self).then(|| (self.now_us - start) / 1000);
            }
        }
    }

    /// Runs until some node leads; panics after `max_ms`.
    pub fn wait_for_leader(&mut self, max_ms: u64) -> NodeId {
        self.run_until(max_ms, |c| c.leader().is_some())
            .unwrap_or_else(|| panic!("no leader after {max_ms} ms"));
        self.leader().expect("checked")
    }

    /// Runs until every running node has applied everything the leader committed.
    pub fn wait_converged(&mut self, max_ms: u64) -> bool {
        self.run_until(max_ms, |c| {
            let Some(l) = c.leader() else { return false };
            let commit = c.node(l).commit_index();
            c.live_nodes()
                .iter()
                .all(|&n| c.node(n).state().applied_index() >= commit)
        })
        .is_some()
    }

    // ---- proposals ----

    /// Proposes at the current leader.
    pub fn propose(&mut self, batch: &Batch) -> Result<(NodeId, Ticket), ProposeError> {
        let batch = batch.clone();
        self.propose_at_leader(move |n| n.propose(&batch))
    }

    /// Proposes a membership change at the current leader.
    pub fn propose_membership(
        &mut self,
        change: &MembershipChange,
    ) -> Result<(NodeId, Ticket), ProposeError> {
        let change = change.clone();
        self.propose_at_leader(move |n| n.propose_membership(&change))
    }

    /// Runs `propose` on the current leader; the leader and its ticket.
    fn propose_at_leader(
        &mut self,
        propose: impl FnOnce(&mut MetaNode) -> Result<Ticket, ProposeError> + Send + 'static,
    ) -> Result<(NodeId, Ticket), ProposeError> {
        let leader = self
            .leader()
            .ok_or(ProposeError::NotLeader { leader: None })?;
        let t = self
            .drive(leader, propose)
            .ok_or(ProposeError::NotLeader { leader: None })??;
        Ok((leader, t))
    }

    /// Takes the completion of `ticket`, running up to `max_ms` for it.
    pub fn wait_for(&mut self, ticket: Ticket, max_ms: u64) -> Option<Completion> {
        self.run_until(max_ms, |c| {
            c.completions.iter().any(|(_, x)| x.ticket == ticket)
        })?;
        self.take_completion(ticket).map(|(_, c)| c)
    }

    /// Proposes `batch` until it applies (retrying while there is no leader, when a
    /// proposal is lost, and when one has not completed after four election timeouts);
    /// panics after `max_ms`. The batch may then apply more than once: use it for
    /// idempotent updates.
    pub fn commit(&mut self, batch: &Batch, max_ms: u64) -> Applied {
        self.retry(max_ms, |c| c.propose(batch))
    }

    /// Like [`SimCluster::commit`] for a membership change.
    pub fn commit_membership(&mut self, change: &MembershipChange, max_ms: u64) -> Applied {
        self.retry(max_ms, |c| c.propose_membership(change))
    }

    fn retry(
        &mut self,
        max_ms: u64,
        mut propose: impl FnMut(&mut SimCluster) -> Result<(NodeId, Ticket), ProposeError>,
    ) -> Applied {
        let deadline = self.now_ms() + max_ms;
        while self.now_ms() < deadline {
            match propose(self) {
                Ok((_, t)) => {
                    // A proposal made at a leader that is then cut off completes only
                    // when that node hears from the new leader: propose again after a
                    // few election timeouts (the updates of these tests are idempotent).
                    let attempt_ms =
                        4 * self.config.election_ticks_max as u64 * self.config.tick_ms;
                    let left = deadline.saturating_sub(self.now_ms()).min(attempt_ms);
                    match self.wait_for(t, left).map(|c| c.result) {
                        Some(Ok(applied)) => return applied,
                        Some(Err(ProposalFailed::Lost | ProposalFailed::Overtaken)) | None => {}
                        Some(Err(e)) => panic!("proposal failed: {e}"),
                    }
                }
                Err(
                    ProposeError::NotLeader { .. }
                    | ProposeError::ConfChangePending
                    | ProposeError::Dropped { .. },
                ) => {
                    self.run_for_ms(self.config.tick_ms);
                }
                Err(e) => panic!("proposal refused: {e}"),
            }
        }
        panic!("not applied within {max_ms} ms\n{}", self.describe());
    }

    /// One line per node (role, term, indexes, counters) and the network's counts, for
    /// failure messages.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        for &id in self.nodes.keys() {
            match self.try_node(id) {
                Some(node) => out.push_str(&format!("{id}: {:?}\n", node.status())),
                None => out.push_str(&format!("{id}: dead\n")),
            }
        }
        out.push_str(&format!(
            "network: {:?}, cut links: {:?}",
            self.stats, self.cut
        ));
        out
    }

    /// Takes every completion gathered so far, with the node that reported it.
    pub fn take_completions(&mut self) -> Vec<(NodeId, Completion)> {
        std::mem::take(&mut self.completions)
    }

    /// Checks every running node's invariants, and that nodes that applied the same
    /// index hold the same state.
    pub fn check_consistency(&self) -> Result<(), InvariantError> {
        let mut by_index: BTreeMap<u64, NodeId> = BTreeMap::new();
        for id in self.live_nodes() {
            let node = self.node(id);
            let s = node.state();
            s.check_invariants().map_err(|e| InvariantError {
                reason: format!("{id}: {}", e.reason),
            })?;
            match by_index.get(&s.applied_index()) {
                Some(&other) if self.node(other).state() != s => {
                    return Err(InvariantError {
                        reason: format!(
                            "{id} and {other} applied up to {} but differ",
                            s.applied_index()
                        ),
                    });
                }
                Some(_) => {}
                None => {
                    by_index.insert(s.applied_index(), id);
                }
            }
        }
        Ok(())
    }
}

impl Drop for SimCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "simulation failed at {} ms: replay with {SEED_ENV}={}",
                self.now_ms(),
                self.config.seed
            );
        }
    }
}
