//! The node's part in the pool's metadata group: a [`MetaNode`] (raft-rs + raft-engine,
//! sans-IO) driven on a dedicated thread, talking to its peers over the node's QUIC
//! connections.
//!
//! Parts:
//! - the **Raft thread** (started by `MetaDriver::start`) owns the [`MetaNode`]: it ticks every
//!   `tick_ms`, steps the messages peers sent, turns queued proposals into one
//!   [`Batch`] per Ready round (group commit), runs the Ready loop (raft-engine fsyncs
//!   there, which is why it is a thread and not a task), hands outgoing messages to the
//!   peer senders and answers proposals from their completions. It never waits on the
//!   network: everything it sends goes through bounded queues with `try_send`.
//! - one **peer sender** task per peer takes that peer's messages in order and sends each
//!   as a [`Request::Raft`] on the cached connection (`crate::peers::Peers`); a message that cannot
//!   be delivered is reported back (`report_unreachable`, `report_snapshot`).
//! - the connection cache, `crate::peers::Peers` (a room of its own: pages use it too).
//! - **forwarding**: a follower sends its queued proposals to the leader as one
//!   [`Request::Propose`]; the leader proposes them and answers with each update's
//!   outcome, or names the leader it knows. Proposals wait (up to
//!   [`PROPOSAL_TIMEOUT`]) while no leader is known, and are proposed again when Raft
//!   says a leader change lost them.
//! - the **view** ([`MetaView`]): role, leader, term, commit index and members with their
//!   capacity and usage, republished by the thread whenever they change, read without
//!   touching the thread.
//!
//! Bounds: [`INPUTS_MAX`] inputs queued for the thread, [`PEER_OUTBOX_MAX`] messages per
//! peer, [`PROPOSALS_QUEUED_MAX`] updates waiting to be proposed. Raft retransmits what a
//! full queue drops.
//!
//! Graceful shutdown: a leader hands leadership to its most caught-up follower (Raft's
//! leadership transfer) before its thread stops, so the pool elects at once instead of
//! after an election timeout; a node that dies (or whose handle is dropped) does not.
//!
//! Initial capacity: the members' lent capacity is known only to each member, so the pool
//! starts with capacity 0 everywhere and every node proposes `SetCapacity` for itself
//! (its `lend_bytes`) once a leader is known and whenever the replicated value differs.
//!
//! Storage failures: when a Ready fails (the Raft log's disk is full or fails), the
//! [`MetaNode`] is poisoned mid-Ready. The thread then drops it (releasing the log) and
//! the node is **degraded**: the view says so at once ([`MetaView::healthy`] false, the
//! cause in [`MetaView::error`], no role in the group), proposals and reads fail with
//! [`ProposeFailure::Degraded`] instead of waiting, Raft messages from peers are dropped,
//! and every failure counts in `storage_errors`. The thread retries with exponential
//! backoff ([`STORAGE_RETRY_BACKOFF_MIN`] to [`STORAGE_RETRY_BACKOFF_MAX`]; a log line
//! per [`STORAGE_RETRY_LOG_EVERY`] at most): it checks that the log takes a write again
//! ([`EngineStorage::check_writable`]) and rebuilds the node from its directory with
//! [`MetaNode::open`], the path of a restart. Then the node is healthy again, as a
//! follower, and catches up from the leader. A node that fails again within
//! [`STORAGE_STABLE_AFTER`] of recovering resumes the backoff where it was.
//!
//! raft-engine panics when an fsync fails (the page cache may then hold data the disk
//! lost, so reopening could acknowledge entries that are not durable): the thread then
//! stops for good, the view says why, and [`MetaDriver::failed`] resolves so that the
//! daemon exits with the cause.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use spillway_meta::storage::EngineStorage;
use spillway_meta::{
    Applied, Batch, Epoch, InitialCluster, MemberInfo, MemberState, MembershipChange, MetaConfig,
    MetaNode, MetaState, ProposalFailed, ProposeError, RaftMessage, Role, Ticket, Update,
};
use spillway_net::{Request, Response};
use spillway_types::NodeId;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::NodeConfig;
use crate::peers::Peers;

mod forward;
mod thread;

pub(crate) use forward::{ForwardReply, decode_forward_reply, encode_forward_reply};
use thread::{ThreadCtx, panic_message, peer_sender, run, stop_for_good};

/// Inputs queued for the Raft thread at most: 16384 (Raft messages, proposals, reports).
/// A full queue drops Raft messages (Raft retransmits) and refuses proposals
/// ([`ProposeFailure::Busy`]).
pub const INPUTS_MAX: usize = 16 * 1024;
/// Messages queued for one peer at most: 4096. Past it new messages to that peer are
/// dropped and the peer reported unreachable (Raft probes it again).
pub const PEER_OUTBOX_MAX: usize = 4096;
/// Updates waiting to be proposed at most: 65536 (four full batches).
pub const PROPOSALS_QUEUED_MAX: usize = 4 * spillway_meta::limits::BATCH_UPDATES_MAX;
/// How long a proposal may wait for a leader and its commit: 5 s.
pub const PROPOSAL_TIMEOUT: Duration = Duration::from_secs(5);
// The wire's bounds on blob frames are spillway-meta's codec bounds (spillway-types cannot
// name spillway-meta, so they are checked here, where both are known).
const _: () = assert!(
    spillway_types::wire::RAFT_PAYLOAD_BYTES_MAX
        == spillway_meta::limits::RAFT_MESSAGE_BYTES_MAX as u64
);
const _: () = assert!(
    spillway_types::wire::PROPOSAL_PAYLOAD_BYTES_MAX
        == spillway_meta::limits::COMMAND_DECODE_BYTES_MAX as u64
);

/// First wait before reopening the Raft log after a storage failure: 100 ms; doubles per
/// failed attempt.
pub const STORAGE_RETRY_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two attempts to reopen the Raft log: 5 s (each attempt reads the
/// log: at most `snapshot_interval_entries` entries and one snapshot).
pub const STORAGE_RETRY_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A node that stayed healthy this long after recovering starts its next recovery from
/// [`STORAGE_RETRY_BACKOFF_MIN`] again: 30 s (one that fails again sooner, on a disk that
/// fills again at once, keeps the longer backoff).
pub const STORAGE_STABLE_AFTER: Duration = Duration::from_secs(30);
/// Failed attempts to reopen the Raft log are logged at most once per 30 s (every one is
/// counted in `storage_errors`).
pub const STORAGE_RETRY_LOG_EVERY: Duration = Duration::from_secs(30);

/// Longest wait at shutdown for a leadership transfer to complete: 1 s (then the node
/// stops anyway, and the others elect after their election timeout).
pub const TRANSFER_WAIT: Duration = Duration::from_secs(1);
/// Longest rejection reason sent back to a follower: 256 bytes (a full batch's reasons
/// stay below 5 MiB, inside `wire::PROPOSAL_PAYLOAD_BYTES_MAX`).
pub const REASON_BYTES_MAX: usize = 256;

/// What became of one update of a proposal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// It took effect.
    Accepted,
    /// The state machine refused it (it changed nothing); `reason` says why.
    Rejected {
        /// The [`spillway_meta::Rejection`], as text (cut at [`REASON_BYTES_MAX`]).
        reason: String,
    },
}

impl Outcome {
    /// Whether the update took effect.
    pub fn is_accepted(&self) -> bool {
        matches!(self, Outcome::Accepted)
    }
}

/// Why a proposal did not complete (each update's own refusal is an [`Outcome`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProposeFailure {
    /// No leader was known, or the proposal was not committed, within the timeout.
    #[error("no commit within {timeout_ms} ms (leader: {leader:?})")]
    TimedOut {
        /// The bound ([`PROPOSAL_TIMEOUT`]).
        timeout_ms: u64,
        /// The leader known when it gave up.
        leader: Option<NodeId>,
    },
    /// Too much is queued for the metadata group; try again later.
    #[error("the metadata group is busy ({queued} updates queued)")]
    Busy {
        /// Updates queued.
        queued: usize,
    },
    /// The proposal is unusable (empty, too large).
    #[error("proposal refused: {reason}")]
    Invalid {
        /// Why.
        reason: String,
    },
    /// The leader refused it or its outcome is unknown.
    #[error("proposal failed: {reason}")]
    Failed {
        /// Why.
        reason: String,
    },
    /// This node's Raft log failed (a full or failing disk): the metadata group is
    /// degraded here until the log is reopened, which the Raft thread retries. A proposal
    /// in flight when it failed may or may not take effect.
    #[error("the metadata group is degraded on this node until its Raft log reopens: {cause}")]
    Degraded {
        /// The storage failure.
        cause: String,
    },
    /// The node is shutting down (or its Raft thread failed).
    #[error("the metadata group of this node is stopped")]
    Stopped,
}

/// One member as this node's applied state shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberView {
    /// Its id.
    pub id: NodeId,
    /// Its peer address (the first it advertises), as text.
    pub addr: String,
    /// Up, down or leaving.
    pub state: MemberState,
    /// Its incarnation (placements must carry it).
    pub epoch: Epoch,
    /// Bytes it lends to the pool.
    pub capacity_bytes: u64,
    /// Bytes of placed pages it holds.
    pub used_bytes: u64,
    /// Bytes reserved on it and not yet used.
    pub reserved_bytes: u64,
    /// Whether it votes in the metadata group (else a learner, or not in the group yet).
    pub voter: bool,
}

impl MemberView {
    /// Capacity neither used nor reserved.
    pub fn free_bytes(&self) -> u64 {
        self.capacity_bytes
            .saturating_sub(self.used_bytes)
            .saturating_sub(self.reserved_bytes)
    }
}

/// The metadata group as this node sees it now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaView {
    /// This node's role.
    pub role: Role,
    /// The leader it knows of.
    pub leader: Option<NodeId>,
    /// The current term.
    pub term: u64,
    /// The commit index.
    pub commit_index: u64,
    /// The index applied to the state here.
    pub applied_index: u64,
    /// The members, by id.
    pub members: Vec<MemberView>,
    /// The group's clock in the state applied here (ms since the Unix epoch): the
    /// largest clock any proposer stamped on a batch, which reservations expire by.
    pub clock_ms: u64,
    /// Whether the Raft thread runs.
    pub running: bool,
    /// Whether this node takes part in the group: false from a storage failure until its
    /// Raft log is reopened (then `role` is follower, `leader` none, and the indexes and
    /// members are the last known), or for good after the Raft thread stopped on a failure.
    pub healthy: bool,
    /// Why it is not healthy: the latest storage failure (`None` when healthy).
    pub error: Option<String>,
}

impl Default for MetaView {
    fn default() -> Self {
        MetaView {
            role: Role::Follower,
            leader: None,
            term: 0,
            commit_index: 0,
            applied_index: 0,
            members: Vec::new(),
            clock_ms: 0,
            running: false,
            healthy: true,
            error: None,
        }
    }
}

/// Counters of the metadata driver.
#[derive(Debug, Default)]
pub(crate) struct MetaCountersAtomic {
    /// Raft messages from peers dropped because the input queue was full.
    pub inputs_dropped: AtomicU64,
    /// Messages to peers that could not be delivered.
    pub messages_undelivered: AtomicU64,
    /// Proposals forwarded to the leader.
    pub proposals_forwarded: AtomicU64,
    /// Storage failures of the Raft log: failed Readies and failed attempts to reopen.
    pub storage_errors: AtomicU64,
    /// Times the Raft log was reopened after a storage failure.
    pub storage_recoveries: AtomicU64,
}

type Reply = oneshot::Sender<Result<Vec<Outcome>, ProposeFailure>>;
/// A read of the applied state; given the failure instead while degraded.
type Query = Box<dyn FnOnce(Result<&MetaState, ProposeFailure>) + Send>;

/// A proposal of one caller, waiting.
struct Pending {
    updates: Vec<Update>,
    reply: Option<Reply>,
    deadline: Instant,
}

enum Input {
    Raft(RaftMessage),
    Propose(Pending),
    Requeue(Vec<Pending>),
    Unreachable(NodeId),
    Snapshot(NodeId, bool),
    Query(Query),
    /// Hand leadership to the most caught-up active follower, if this node leads.
    Transfer,
    /// Propose a membership change if this node leads; else ask the leader to hand
    /// leadership to this node (`crate::membership`), and say so.
    Membership(MembershipChange, MembershipReply),
    Stop,
}

/// The answer to a membership change: applied, or why not.
type MembershipReply = oneshot::Sender<Result<(), MembershipFailure>>;

/// Why a membership change did not apply.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MembershipFailure {
    /// This node does not lead (it asked for the lead); try again.
    #[error("this node does not lead")]
    NotLeader,
    /// Another change is in progress, or leadership changed under it; try again.
    #[error("another membership change is in progress")]
    Busy,
    /// The change is invalid, or failed.
    #[error("{reason}")]
    Failed {
        /// Why.
        reason: String,
    },
    /// It did not apply within [`PROPOSAL_TIMEOUT`].
    #[error("not applied within {} ms", PROPOSAL_TIMEOUT.as_millis())]
    TimedOut,
    /// The metadata group of this node is stopped or degraded.
    #[error("the metadata group of this node is stopped or degraded")]
    Stopped,
}

/// The running driver (see the module docs). Cheap to share behind an `Arc`.
pub struct MetaDriver {
    id: NodeId,
    inputs: SyncSender<Input>,
    view: Arc<RwLock<MetaView>>,
    queued: Arc<AtomicU64>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stop: Arc<AtomicBool>,
    /// Cancelled when the Raft thread stopped on a failure it cannot recover from.
    failed: CancellationToken,
    pub(crate) counters: Arc<MetaCountersAtomic>,
}

impl std::fmt::Debug for MetaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaDriver")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// Why the metadata group could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetaStartError {
    /// The Raft log could not be opened.
    #[error("cannot open the Raft log in {dir}: {source}")]
    Open {
        /// The directory.
        dir: String,
        /// Why.
        #[source]
        source: spillway_meta::MetaError,
    },
    /// The Raft thread could not be started.
    #[error("cannot start the Raft thread: {0}")]
    Thread(String),
}

/// Wall-clock milliseconds since the Unix epoch (0 if the clock is before it): the
/// proposer's clock stamped on batches, and the remote tier's reservation clock.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl MetaDriver {
    /// Opens the node's Raft log in `<data_dir>/raft` (a new pool from `members` when it
    /// is empty), starts the Raft thread and one sender task per peer. Call inside a
    /// tokio runtime; the tasks go on `tasks` and stop on `cancel`.
    pub(crate) async fn start(
        config: &NodeConfig,
        peers: Arc<Peers>,
        tasks: &TaskTracker,
        cancel: &CancellationToken,
    ) -> Result<Arc<MetaDriver>, MetaStartError> {
        let id = config.node_id;
        let dir = config.data_dir.join("raft");
        let mut meta_config = MetaConfig::new(id, &dir);
        meta_config.heartbeat_ticks = config.heartbeat_ticks;
        meta_config.election_ticks = config.election_ticks;
        meta_config.election_ticks_max = config.election_ticks_max;
        meta_config.down_after_ticks = config.down_after_ms.div_ceil(config.tick_ms);
        meta_config.seed ^= now_ms();
        let initial = InitialCluster {
            members: config
                .initial_members()
                .iter()
                .map(|m| MemberInfo {
                    id: m.id,
                    addresses: vec![m.addr.to_string()],
                    capacity_bytes: 0,
                    zone: None,
                })
                .collect(),
            page_bytes: config.page_size.bytes(),
        };
        let joined = crate::membership::joined(config);
        let (inputs_tx, inputs_rx) = std::sync::mpsc::sync_channel(INPUTS_MAX);
        let view = Arc::new(RwLock::new(MetaView::default()));
        let queued = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(MetaCountersAtomic::default());
        let failed = CancellationToken::new();
        let mut outboxes = HashMap::new();
        for m in config.initial_members() {
            if m.id == id {
                continue;
            }
            let (tx, rx) = mpsc::channel(PEER_OUTBOX_MAX);
            outboxes.insert(m.id, tx);
            tasks.spawn(peer_sender(
                m.id,
                rx,
                peers.clone(),
                inputs_tx.clone(),
                counters.clone(),
                cancel.clone(),
            ));
        }
        let ctx = ThreadCtx {
            id,
            tick: Duration::from_millis(config.tick_ms),
            lend_bytes: config.lend_bytes,
            outboxes,
            view: view.clone(),
            queued: queued.clone(),
            inputs: inputs_tx.clone(),
            peers,
            runtime: tokio::runtime::Handle::current(),
            tasks: tasks.clone(),
            counters: counters.clone(),
            stop: stop.clone(),
            meta_config: meta_config.clone(),
            initial: initial.clone(),
            joined,
            failed: failed.clone(),
        };
        let (opened_tx, opened_rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name(format!("spillway-raft-{}", id.0))
            .spawn(move || {
                // raft-engine caches blocks per thread: the node is opened and used on
                // this thread only.
                // A node that joined with a token waits for the leader's snapshot.
                let initial = (!joined).then_some(&initial);
                let node = match MetaNode::open(meta_config, initial) {
                    Ok(node) => {
                        let _ = opened_tx.send(Ok(()));
                        node
                    }
                    Err(e) => {
                        let _ = opened_tx.send(Err(e));
                        return;
                    }
                };
                // A panic anywhere else (a bug) ends the thread too; its waiters see
                // `Stopped` as their replies unwind. Say so instead of stopping silently.
                let (view, failed) = (ctx.view.clone(), ctx.failed.clone());
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(node, inputs_rx, ctx)
                }));
                if let Err(panic) = ran {
                    let cause = format!(
                        "the Raft thread panicked ({}); restart the node",
                        panic_message(&*panic)
                    );
                    stop_for_good(id, &view, &failed, cause);
                }
            })
            .map_err(|e| MetaStartError::Thread(e.to_string()))?;
        match opened_rx.await {
            Ok(Ok(())) => {}
            Ok(Err(source)) => {
                let _ = thread.join();
                return Err(MetaStartError::Open {
                    dir: dir.display().to_string(),
                    source,
                });
            }
            Err(_) => return Err(MetaStartError::Thread("the Raft thread died".into())),
        }
        Ok(Arc::new(MetaDriver {
            id,
            inputs: inputs_tx,
            view,
            queued,
            thread: Mutex::new(Some(thread)),
            stop,
            failed,
            counters,
        }))
    }

    /// The view now.
    pub fn view(&self) -> MetaView {
        self.view.read().expect("meta view").clone()
    }

    /// Resolves when the Raft thread stopped on a failure it cannot recover from (see the
    /// module docs); the view's `error` says why. Never resolves on a graceful stop.
    pub fn failed(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.failed.cancelled()
    }

    /// Fails at once while the node is degraded (the thread also answers what it receives
    /// then, so this only saves a round through its queue).
    fn check_healthy(&self) -> Result<(), ProposeFailure> {
        let view = self.view.read().expect("meta view");
        match (&view.error, view.healthy) {
            (Some(cause), false) if view.running => Err(ProposeFailure::Degraded {
                cause: cause.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Proposes `updates` (through the leader); resolves with each update's outcome once
    /// committed and applied on the leader.
    pub async fn propose(&self, updates: Vec<Update>) -> Result<Vec<Outcome>, ProposeFailure> {
        if updates.is_empty() {
            return Ok(Vec::new());
        }
        if updates.len() > spillway_meta::limits::BATCH_UPDATES_MAX {
            return Err(ProposeFailure::Invalid {
                reason: format!(
                    "{} updates, more than {}",
                    updates.len(),
                    spillway_meta::limits::BATCH_UPDATES_MAX
                ),
            });
        }
        self.check_healthy()?;
        let queued = self.queued.load(Ordering::Relaxed) as usize;
        if queued + updates.len() > PROPOSALS_QUEUED_MAX {
            return Err(ProposeFailure::Busy { queued });
        }
        let (tx, rx) = oneshot::channel();
        let pending = Pending {
            updates,
            reply: Some(tx),
            deadline: Instant::now() + PROPOSAL_TIMEOUT,
        };
        self.send(Input::Propose(pending))?;
        rx.await.unwrap_or(Err(ProposeFailure::Stopped))
    }

    /// Makes a membership change through Raft, waiting (at most [`PROPOSAL_TIMEOUT`])
    /// until it applied. On a follower it first asks for the lead (see
    /// `crate::membership`), and retries while another change is in progress.
    pub async fn change_membership(
        &self,
        change: MembershipChange,
    ) -> Result<(), MembershipFailure> {
        let deadline = Instant::now() + PROPOSAL_TIMEOUT;
        loop {
            let (tx, rx) = oneshot::channel();
            self.send(Input::Membership(change.clone(), tx))
                .map_err(|_| MembershipFailure::Stopped)?;
            let left = deadline.saturating_duration_since(Instant::now());
            let result = match tokio::time::timeout(left, rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(MembershipFailure::Stopped),
                Err(_) => Err(MembershipFailure::TimedOut),
            };
            match result {
                Err(MembershipFailure::NotLeader | MembershipFailure::Busy)
                    if Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(MembershipFailure::NotLeader | MembershipFailure::Busy) => {
                    return Err(MembershipFailure::TimedOut);
                }
                other => return other,
            }
        }
    }

    /// Runs `f` on the applied state, on the Raft thread, and returns its result.
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&MetaState) -> T + Send + 'static,
    ) -> Result<T, ProposeFailure> {
        self.check_healthy()?;
        let (tx, rx) = oneshot::channel();
        self.send(Input::Query(Box::new(move |s| {
            let _ = tx.send(s.map(f));
        })))?;
        rx.await.unwrap_or(Err(ProposeFailure::Stopped))
    }

    fn send(&self, input: Input) -> Result<(), ProposeFailure> {
        match self.inputs.try_send(input) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(ProposeFailure::Busy {
                queued: self.queued.load(Ordering::Relaxed) as usize,
            }),
            Err(TrySendError::Disconnected(_)) => Err(ProposeFailure::Stopped),
        }
    }

    /// Hands a Raft message from `peer` (authenticated by the transport) to the thread.
    /// Returns false if it was refused (not from `peer`, or not for this node).
    pub(crate) fn step(&self, peer: NodeId, message: RaftMessage) -> bool {
        if message.from != peer.0 || message.to != self.id.0 {
            tracing::warn!(%peer, from = message.from, to = message.to, "Raft message with a forged sender or recipient refused");
            return false;
        }
        if self.inputs.try_send(Input::Raft(message)).is_err() {
            self.counters.inputs_dropped.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// If this node leads, hands leadership to its most caught-up follower and waits (at
    /// most [`TRANSFER_WAIT`]) until it no longer leads, so a graceful stop costs the pool
    /// no election timeout. Call while peers are still served.
    pub(crate) async fn hand_over(&self) {
        if self.view().role == Role::Leader && self.send(Input::Transfer).is_ok() {
            let deadline = Instant::now() + TRANSFER_WAIT;
            while self.view().role == Role::Leader && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }

    /// Stops the Raft thread and waits for it.
    pub(crate) async fn shutdown(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.inputs.try_send(Input::Stop);
        let thread = self.thread.lock().expect("raft thread").take();
        if let Some(thread) = thread {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

impl MetaDriver {
    /// Tells the Raft thread to stop; does not wait.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.inputs.try_send(Input::Stop);
    }
}

impl Drop for MetaDriver {
    fn drop(&mut self) {
        // Tell the thread; never wait for it here.
        self.stop();
    }
}
