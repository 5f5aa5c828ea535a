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
//!   as a [`Request::Raft`] on the cached connection ([`Peers`]); a message that cannot
//!   be delivered is reported back (`report_unreachable`, `report_snapshot`).
//! - [`Peers`]: one cached QUIC connection per peer, opened on first use, reconnected with
//!   exponential backoff ([`RECONNECT_BACKOFF_MIN`] to [`RECONNECT_BACKOFF_MAX`]); while a
//!   peer is in backoff, requests to it fail at once instead of piling up.
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
    Applied, Batch, Epoch, InitialCluster, MemberInfo, MemberState, MetaConfig, MetaNode,
    MetaState, ProposalFailed, ProposeError, RaftMessage, Role, Ticket, Update,
};
use spillway_net::quic::{QuicConnection, QuicTransport};
use spillway_net::{Connection, NetError, Request, Response, Transport};
use spillway_types::NodeId;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::NodeConfig;

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
/// Time a connection attempt to a peer may take: 1 s (a dead peer on loopback would
/// otherwise hold it for the whole QUIC idle timeout).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// First wait before reconnecting to a peer that failed: 50 ms; doubles per failure.
pub const RECONNECT_BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest wait before reconnecting: 1 s.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(1);
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
    Stop,
}

/// The connections of this node to its peers (see the module docs).
#[derive(Debug)]
pub struct Peers {
    transport: Arc<QuicTransport>,
    addrs: RwLock<HashMap<NodeId, SocketAddr>>,
    slots: Mutex<HashMap<NodeId, Arc<tokio::sync::Mutex<Slot>>>>,
    /// Page requests over UCX (`transport = "ucx"`), introduced over the QUIC connections.
    #[cfg(feature = "ucx")]
    ucx: Option<crate::ucx_pages::UcxPages>,
}

#[derive(Debug, Default)]
struct Slot {
    conn: Option<QuicConnection>,
    retry_at: Option<Instant>,
    backoff: Duration,
    /// The last failure since the last success.
    failed_at: Option<Instant>,
}

/// A peer that failed within this long (and has not answered since) is left out of
/// placements: 2 s.
pub const UNREACHABLE_FOR: Duration = Duration::from_secs(2);

impl Peers {
    pub(crate) fn new(transport: Arc<QuicTransport>, addrs: HashMap<NodeId, SocketAddr>) -> Self {
        Peers {
            transport,
            addrs: RwLock::new(addrs),
            slots: Mutex::new(HashMap::new()),
            #[cfg(feature = "ucx")]
            ucx: None,
        }
    }

    /// Sends page requests (put, get, delete) over `ucx` from now on; everything else
    /// stays on QUIC, which introduces the UCX connections.
    #[cfg(feature = "ucx")]
    pub(crate) fn with_ucx(mut self, ucx: Arc<spillway_net::ucx::UcxTransport>) -> Self {
        self.ucx = Some(crate::ucx_pages::UcxPages::new(ucx));
        self
    }

    /// The transport page requests travel on: `"quic"` or `"ucx"`.
    pub fn page_transport(&self) -> &'static str {
        #[cfg(feature = "ucx")]
        if self.ucx.is_some() {
            return "ucx";
        }
        "quic"
    }

    /// The address `peer` is known at.
    pub fn addr(&self, peer: NodeId) -> Option<SocketAddr> {
        self.addrs
            .read()
            .expect("peer addresses")
            .get(&peer)
            .copied()
    }

    /// Learns (or corrects) where `peer` is, from the replicated member list.
    pub(crate) fn learn(&self, peer: NodeId, addr: SocketAddr) {
        let mut addrs = self.addrs.write().expect("peer addresses");
        if addrs.get(&peer) != Some(&addr) {
            addrs.insert(peer, addr);
        }
    }

    fn slot(&self, peer: NodeId) -> Arc<tokio::sync::Mutex<Slot>> {
        self.slots
            .lock()
            .expect("peer slots")
            .entry(peer)
            .or_default()
            .clone()
    }

    /// The cached connection to `peer`, or a new one; fails at once while the peer is in
    /// backoff after a failure.
    pub async fn connection(&self, peer: NodeId) -> Result<QuicConnection, NetError> {
        let addr = self.addr(peer).ok_or_else(|| NetError::Connect {
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            reason: format!("{peer} has no known address"),
        })?;
        let slot = self.slot(peer);
        let mut slot = slot.lock().await;
        if let Some(conn) = &slot.conn {
            if conn.lanes().iter().any(|l| l.close_reason().is_none()) {
                return Ok(conn.clone());
            }
            slot.conn = None;
        }
        if let Some(at) = slot.retry_at
            && Instant::now() < at
        {
            return Err(NetError::Connect {
                addr,
                reason: format!("{peer} failed recently; retrying after a backoff"),
            });
        }
        let attempt = tokio::time::timeout(CONNECT_TIMEOUT, self.transport.connect(addr)).await;
        let result = match attempt {
            Ok(Ok(conn)) if conn.peer() == peer => Ok(conn),
            Ok(Ok(conn)) => Err(NetError::Connect {
                addr,
                reason: format!("expected {peer} but {} answered", conn.peer()),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(NetError::Connect {
                addr,
                reason: format!("no answer within {} ms", CONNECT_TIMEOUT.as_millis()),
            }),
        };
        match result {
            Ok(conn) => {
                slot.conn = Some(conn.clone());
                slot.retry_at = None;
                slot.backoff = Duration::ZERO;
                slot.failed_at = None;
                Ok(conn)
            }
            Err(e) => {
                slot.backoff =
                    (slot.backoff * 2).clamp(RECONNECT_BACKOFF_MIN, RECONNECT_BACKOFF_MAX);
                slot.retry_at = Some(Instant::now() + slot.backoff);
                slot.failed_at = Some(Instant::now());
                Err(e)
            }
        }
    }

    /// Whether `peer` is worth trying now: not in backoff after a failure.
    pub fn reachable(&self, peer: NodeId) -> bool {
        let slot = self.slot(peer);
        let Ok(slot) = slot.try_lock() else {
            // Someone is connecting or using it right now.
            return true;
        };
        slot.conn.is_some()
            || slot
                .failed_at
                .is_none_or(|t| t.elapsed() >= UNREACHABLE_FOR)
    }

    /// Forgets the connection to `peer` after a failed request and starts its backoff.
    pub fn failed(&self, peer: NodeId) {
        let slot = self.slot(peer);
        if let Ok(mut slot) = slot.try_lock() {
            slot.conn = None;
            slot.backoff = (slot.backoff * 2).clamp(RECONNECT_BACKOFF_MIN, RECONNECT_BACKOFF_MAX);
            slot.retry_at = Some(Instant::now() + slot.backoff);
            slot.failed_at = Some(Instant::now());
        }
    }

    /// Sends `request` to `peer` on the cached connection (page requests over UCX when
    /// the node uses it); a transport failure drops the connection (the next request
    /// reconnects after the backoff).
    pub async fn request(&self, peer: NodeId, request: Request) -> Result<Response, NetError> {
        #[cfg(feature = "ucx")]
        if let Some(ucx) = &self.ucx
            && matches!(
                request,
                Request::Put { .. } | Request::Get { .. } | Request::Delete { .. }
            )
        {
            return ucx.request(self, peer, request).await;
        }
        self.quic_request(peer, request).await
    }

    /// Sends `request` to `peer` over QUIC, as [`Peers::request`].
    pub(crate) async fn quic_request(
        &self,
        peer: NodeId,
        request: Request,
    ) -> Result<Response, NetError> {
        let conn = self.connection(peer).await?;
        match conn.request(request).await {
            Ok(r) => Ok(r),
            Err(e) => {
                if !matches!(e, NetError::Encode { .. } | NetError::Remote { .. }) {
                    self.failed(peer);
                }
                Err(e)
            }
        }
    }
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
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn cut(mut s: String) -> String {
    if s.len() > REASON_BYTES_MAX {
        let mut at = REASON_BYTES_MAX;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
    s
}

/// The reply to a forwarded proposal, as it travels back (bincode 2, serde).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ForwardReply {
    /// Committed and applied: one outcome per update, in order.
    Applied { outcomes: Vec<Outcome> },
    /// This node does not lead; `leader` is the one it knows (the follower retries there).
    NotLeader { leader: Option<u64> },
    /// It failed; `retry` when proposing again may succeed (busy, timed out).
    Failed { failure: String, retry: bool },
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_limit::<{ spillway_types::wire::PROPOSAL_PAYLOAD_BYTES_MAX as usize }>()
}

pub(crate) fn encode_forward_reply(reply: &ForwardReply) -> Bytes {
    bincode::serde::encode_to_vec(reply, bincode_config())
        .expect("a forward reply encodes")
        .into()
}

pub(crate) fn decode_forward_reply(bytes: &[u8]) -> Result<ForwardReply, String> {
    match bincode::serde::decode_from_slice(bytes, bincode_config()) {
        Ok((r, n)) if n == bytes.len() => Ok(r),
        Ok((_, n)) => Err(format!("{} trailing bytes", bytes.len() - n)),
        Err(e) => Err(e.to_string()),
    }
}

struct ThreadCtx {
    id: NodeId,
    tick: Duration,
    lend_bytes: u64,
    outboxes: HashMap<NodeId, mpsc::Sender<RaftMessage>>,
    view: Arc<RwLock<MetaView>>,
    queued: Arc<AtomicU64>,
    inputs: SyncSender<Input>,
    peers: Arc<Peers>,
    runtime: tokio::runtime::Handle,
    tasks: TaskTracker,
    counters: Arc<MetaCountersAtomic>,
    stop: Arc<AtomicBool>,
    /// What the node is reopened with after a storage failure (as at start).
    meta_config: MetaConfig,
    initial: InitialCluster,
    /// Cancelled when the thread stops on a failure it cannot recover from.
    failed: CancellationToken,
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
        meta_config.seed ^= now_ms();
        let initial = InitialCluster {
            members: config
                .initial_members()
                .iter()
                .map(|m| MemberInfo {
                    id: m.id,
                    addresses: vec![m.addr.to_string()],
                    capacity_bytes: 0,
                })
                .collect(),
            page_bytes: config.page_size.bytes(),
        };
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
            failed: failed.clone(),
        };
        let (opened_tx, opened_rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name(format!("spillway-raft-{}", id.0))
            .spawn(move || {
                // raft-engine caches blocks per thread: the node is opened and used on
                // this thread only.
                let node = match MetaNode::open(meta_config, Some(&initial)) {
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

/// Sends `peer`'s Raft messages, in order, one request each.
async fn peer_sender(
    peer: NodeId,
    mut rx: mpsc::Receiver<RaftMessage>,
    peers: Arc<Peers>,
    inputs: SyncSender<Input>,
    counters: Arc<MetaCountersAtomic>,
    cancel: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return,
            m = rx.recv() => match m { Some(m) => m, None => return },
        };
        let snapshot = msg.get_msg_type() == raft::eraftpb::MessageType::MsgSnapshot;
        let bytes = spillway_meta::wire::encode_message(&msg);
        let result = tokio::select! {
            _ = cancel.cancelled() => return,
            r = peers.request(peer, Request::Raft { message: bytes.into() }) => r,
        };
        let delivered = matches!(result, Ok(Response::RaftAck));
        if !delivered {
            counters
                .messages_undelivered
                .fetch_add(1, Ordering::Relaxed);
            if let Err(e) = &result {
                tracing::debug!(%peer, error = %e, "Raft message not delivered");
            }
            let _ = inputs.try_send(Input::Unreachable(peer));
        }
        if snapshot {
            let _ = inputs.try_send(Input::Snapshot(peer, delivered));
        }
    }
}

/// Proposals in flight: for each ticket, the callers and how many updates each gave.
type InFlight = HashMap<Ticket, Vec<Pending>>;

/// This node's member of the group, on the Raft thread.
enum Member {
    /// Running (boxed: 1.7 KiB, against the other's 0.1).
    Up(Box<MetaNode>),
    /// Its Raft log failed; the node was dropped and is reopened after a backoff.
    Degraded(Degraded),
}

/// A member whose Raft log failed (see the module docs).
struct Degraded {
    /// The latest failure: the Ready's, then each failed attempt to reopen.
    cause: String,
    /// When the Ready failed.
    since: Instant,
    /// Failed attempts to reopen.
    attempts: u64,
    /// The wait before the next attempt.
    backoff: Duration,
    retry_at: Instant,
    /// When a failed attempt was last logged.
    logged_at: Instant,
}

impl Degraded {
    fn failure(&self) -> ProposeFailure {
        ProposeFailure::Degraded {
            cause: self.cause.clone(),
        }
    }
}

fn run(node: MetaNode, inputs: Receiver<Input>, mut ctx: ThreadCtx) {
    let mut member = Member::Up(Box::new(node));
    let mut next_tick = Instant::now() + ctx.tick;
    let mut queue: VecDeque<Pending> = VecDeque::new();
    let mut in_flight: InFlight = HashMap::new();
    let mut last_capacity_sync: Option<Instant> = None;
    let mut last_view: Option<(u64, u64, Role, Option<NodeId>, u64)> = None;
    // When the log was last reopened, and the backoff it had then.
    let mut recovered: Option<(Instant, Duration)> = None;
    // Why the thread stops for good, if it does (see the module docs).
    let mut fatal: Option<String> = None;
    let mut stopping = false;
    if let Member::Up(node) = &member {
        publish(node, &ctx, &mut last_view, true);
    }
    while !stopping && !ctx.stop.load(Ordering::Relaxed) {
        let wake = match &member {
            Member::Up(_) => next_tick,
            Member::Degraded(d) => d.retry_at,
        };
        let timeout = wake.saturating_duration_since(Instant::now());
        let first = match inputs.recv_timeout(timeout) {
            Ok(i) => Some(i),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        // Take everything queued (bounded, so a flood cannot starve the tick).
        let mut batch: Vec<Input> = first.into_iter().collect();
        while batch.len() < INPUTS_MAX {
            match inputs.try_recv() {
                Ok(i) => batch.push(i),
                Err(_) => break,
            }
        }
        for input in batch {
            match (&mut member, input) {
                (_, Input::Stop) => stopping = true,
                (Member::Up(node), input) => take_input(node, input, &mut queue, &ctx),
                (Member::Degraded(d), input) => refuse_input(d, input),
            }
        }
        let now = Instant::now();
        if let Member::Degraded(d) = &mut member {
            if now < d.retry_at {
                continue;
            }
            match reopen(&ctx) {
                Ok(node) => {
                    ctx.counters
                        .storage_recoveries
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        node = %ctx.id,
                        attempts = d.attempts + 1,
                        degraded_ms = d.since.elapsed().as_millis() as u64,
                        "Raft log reopened; the metadata group is healthy again on this node"
                    );
                    recovered = Some((now, d.backoff));
                    next_tick = now + ctx.tick;
                    publish(&node, &ctx, &mut last_view, true);
                    member = Member::Up(Box::new(node));
                }
                Err(e) => {
                    ctx.counters.storage_errors.fetch_add(1, Ordering::Relaxed);
                    d.attempts += 1;
                    d.cause = e.to_string();
                    d.backoff = (d.backoff * 2).min(STORAGE_RETRY_BACKOFF_MAX);
                    d.retry_at = Instant::now() + d.backoff;
                    if d.logged_at.elapsed() >= STORAGE_RETRY_LOG_EVERY {
                        d.logged_at = Instant::now();
                        tracing::warn!(
                            node = %ctx.id,
                            attempts = d.attempts,
                            degraded_ms = d.since.elapsed().as_millis() as u64,
                            retry_ms = d.backoff.as_millis() as u64,
                            error = %d.cause,
                            "the Raft log still fails; the metadata group stays degraded on this node"
                        );
                    }
                    publish_degraded(d, &ctx);
                }
            }
            continue;
        }
        let Member::Up(node) = &mut member else {
            continue;
        };
        if now >= next_tick {
            node.tick();
            next_tick += ctx.tick;
            if next_tick < now {
                next_tick = now + ctx.tick;
            }
            expire(&mut queue, &ctx, node.leader());
            sync_capacity(node, &mut queue, &ctx, &mut last_capacity_sync);
        }
        flush(node, &mut queue, &mut in_flight, &ctx);
        let ready = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| node.handle_ready()));
        let Ok(ready) = ready.map_err(|panic| {
            fatal = Some(format!(
                "the Raft log panicked ({}): raft-engine does so when an fsync fails, and a log \
                 whose fsync failed may have lost what it acknowledged, so it is not reopened; \
                 restart the node",
                panic_message(&*panic)
            ));
        }) else {
            break;
        };
        if let Err(e) = ready {
            // The node is poisoned mid-Ready; dropping it releases the log for reopening.
            let d = degrade(e, &mut queue, &mut in_flight, &ctx, recovered);
            publish_degraded(&d, &ctx);
            last_view = None;
            member = Member::Degraded(d);
            continue;
        }
        route(node, &mut ctx);
        for c in node.take_completions() {
            let Some(waiters) = in_flight.remove(&c.ticket) else {
                continue;
            };
            match c.result {
                Ok(Applied::Batch { outcomes }) => {
                    let mut outcomes = outcomes.into_iter();
                    for w in waiters {
                        let mine: Vec<Outcome> = outcomes
                            .by_ref()
                            .take(w.updates.len())
                            .map(|o| match o {
                                Ok(()) => Outcome::Accepted,
                                Err(r) => Outcome::Rejected {
                                    reason: cut(r.to_string()),
                                },
                            })
                            .collect();
                        answer(w, Ok(mine));
                    }
                }
                Ok(Applied::Membership { .. }) => {}
                Err(ProposalFailed::Lost) => {
                    // Never applied: propose again, first in line.
                    for w in waiters.into_iter().rev() {
                        ctx.queued
                            .fetch_add(w.updates.len() as u64, Ordering::Relaxed);
                        queue.push_front(w);
                    }
                }
                Err(other) => {
                    for w in waiters {
                        answer(
                            w,
                            Err(ProposeFailure::Failed {
                                reason: other.to_string(),
                            }),
                        );
                    }
                }
            }
        }
        publish(node, &ctx, &mut last_view, false);
    }
    for p in queue.drain(..) {
        answer(p, Err(ProposeFailure::Stopped));
    }
    for (_, ws) in in_flight.drain() {
        for w in ws {
            answer(w, Err(ProposeFailure::Stopped));
        }
    }
    match fatal {
        Some(cause) => {
            // Dropping the engine would fsync again, and panic again: leak it, the process
            // is about to exit.
            if let Member::Up(node) = member {
                std::mem::forget(node);
            }
            stop_for_good(ctx.id, &ctx.view, &ctx.failed, cause);
        }
        None => {
            ctx.view.write().expect("meta view").running = false;
            tracing::info!(node = %ctx.id, "Raft thread stopped");
        }
    }
}

/// Says in the view that the Raft thread stopped for good, and why, and resolves
/// [`MetaDriver::failed`].
fn stop_for_good(id: NodeId, view: &RwLock<MetaView>, failed: &CancellationToken, cause: String) {
    tracing::error!(node = %id, cause, "the metadata group stopped on this node");
    let mut v = view.write().unwrap_or_else(|e| e.into_inner());
    v.running = false;
    v.healthy = false;
    v.error = Some(cause);
    v.role = Role::Follower;
    v.leader = None;
    drop(v);
    failed.cancel();
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}

/// Takes one input while the member runs.
fn take_input(node: &mut MetaNode, input: Input, queue: &mut VecDeque<Pending>, ctx: &ThreadCtx) {
    match input {
        Input::Raft(m) => {
            if let Err(e) = node.step(m) {
                tracing::error!(node = %ctx.id, error = %e, "Raft step failed");
            }
        }
        Input::Propose(p) => {
            ctx.queued
                .fetch_add(p.updates.len() as u64, Ordering::Relaxed);
            queue.push_back(p);
        }
        Input::Requeue(ps) => {
            for p in ps.into_iter().rev() {
                ctx.queued
                    .fetch_add(p.updates.len() as u64, Ordering::Relaxed);
                queue.push_front(p);
            }
        }
        Input::Unreachable(peer) => node.report_unreachable(peer),
        Input::Snapshot(peer, ok) => node.report_snapshot(peer, ok),
        Input::Query(f) => f(Ok(node.state())),
        Input::Transfer => {
            let best = node
                .peers()
                .into_iter()
                .filter(|p| p.recently_active)
                .max_by_key(|p| p.matched_index);
            if let Some(to) = best {
                tracing::info!(node = %ctx.id, to = %to.id, "handing leadership over before stopping");
                node.transfer_leader(to.id);
            }
        }
        Input::Stop => {}
    }
}

/// Answers one input while the member is degraded: proposals and reads fail at once; Raft
/// messages are dropped (the leader sends them again once this node answers).
fn refuse_input(d: &Degraded, input: Input) {
    match input {
        Input::Propose(p) => answer(p, Err(d.failure())),
        Input::Requeue(ps) => {
            for p in ps {
                answer(p, Err(d.failure()));
            }
        }
        Input::Query(f) => f(Err(d.failure())),
        Input::Raft(_)
        | Input::Unreachable(_)
        | Input::Snapshot(..)
        | Input::Transfer
        | Input::Stop => {}
    }
}

/// After a failed Ready: fails every waiting proposal (those in flight may or may not take
/// effect) and starts the backoff, resuming it if the last recovery was recent.
fn degrade(
    e: spillway_meta::MetaError,
    queue: &mut VecDeque<Pending>,
    in_flight: &mut InFlight,
    ctx: &ThreadCtx,
    recovered: Option<(Instant, Duration)>,
) -> Degraded {
    ctx.counters.storage_errors.fetch_add(1, Ordering::Relaxed);
    let cause = e.to_string();
    tracing::error!(
        node = %ctx.id,
        error = %cause,
        "Raft Ready failed; the metadata group is degraded on this node: proposals fail and the Raft log is reopened with backoff"
    );
    let now = Instant::now();
    let backoff = match recovered {
        Some((at, backoff)) if now.duration_since(at) < STORAGE_STABLE_AFTER => {
            (backoff * 2).min(STORAGE_RETRY_BACKOFF_MAX)
        }
        _ => STORAGE_RETRY_BACKOFF_MIN,
    };
    let d = Degraded {
        cause,
        since: now,
        attempts: 0,
        backoff,
        retry_at: now + backoff,
        logged_at: now,
    };
    for p in queue.drain(..) {
        ctx.queued
            .fetch_sub(p.updates.len() as u64, Ordering::Relaxed);
        answer(p, Err(d.failure()));
    }
    for (_, ws) in in_flight.drain() {
        for w in ws {
            answer(w, Err(d.failure()));
        }
    }
    d
}

/// Rebuilds the member from its directory, as a restart does, once the log takes a write
/// (a log on a full disk opens, and fails at its next write).
fn reopen(ctx: &ThreadCtx) -> Result<MetaNode, spillway_meta::MetaError> {
    EngineStorage::open(&ctx.meta_config.dir)?.check_writable()?;
    MetaNode::open(ctx.meta_config.clone(), Some(&ctx.initial))
}

fn answer(p: Pending, result: Result<Vec<Outcome>, ProposeFailure>) {
    if let Some(reply) = p.reply {
        let _ = reply.send(result);
    }
}

/// Fails queued proposals past their deadline.
fn expire(queue: &mut VecDeque<Pending>, ctx: &ThreadCtx, leader: Option<NodeId>) {
    let now = Instant::now();
    let (late, keep): (Vec<Pending>, Vec<Pending>) =
        queue.drain(..).partition(|p| p.deadline <= now);
    queue.extend(keep);
    for p in late {
        ctx.queued
            .fetch_sub(p.updates.len() as u64, Ordering::Relaxed);
        answer(
            p,
            Err(ProposeFailure::TimedOut {
                timeout_ms: PROPOSAL_TIMEOUT.as_millis() as u64,
                leader,
            }),
        );
    }
}

/// Proposes `SetCapacity` for this node when the replicated capacity is not its
/// `lend_bytes` (at most once a second).
fn sync_capacity(
    node: &MetaNode,
    queue: &mut VecDeque<Pending>,
    ctx: &ThreadCtx,
    last: &mut Option<Instant>,
) {
    if node.leader().is_none() || last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
        return;
    }
    let Some(me) = node.state().member(ctx.id) else {
        return;
    };
    if me.capacity_bytes == ctx.lend_bytes {
        return;
    }
    *last = Some(Instant::now());
    ctx.queued.fetch_add(1, Ordering::Relaxed);
    queue.push_back(Pending {
        updates: vec![Update::SetCapacity {
            node: ctx.id,
            capacity_bytes: ctx.lend_bytes,
        }],
        reply: None,
        deadline: Instant::now() + PROPOSAL_TIMEOUT,
    });
}

/// Takes pendings from the front of `queue` up to one batch's worth of updates.
fn take_batch(queue: &mut VecDeque<Pending>, ctx: &ThreadCtx) -> (Batch, Vec<Pending>) {
    let mut batch = Batch::new(now_ms());
    let mut taken = Vec::new();
    while let Some(p) = queue.front() {
        if !taken.is_empty()
            && batch.len() + p.updates.len() > spillway_meta::limits::BATCH_UPDATES_MAX
        {
            break;
        }
        let p = queue.pop_front().expect("front exists");
        ctx.queued
            .fetch_sub(p.updates.len() as u64, Ordering::Relaxed);
        batch.updates.extend(p.updates.iter().cloned());
        taken.push(p);
    }
    (batch, taken)
}

/// Proposes what is queued (leader) or forwards it (follower with a known leader).
fn flush(
    node: &mut MetaNode,
    queue: &mut VecDeque<Pending>,
    in_flight: &mut InFlight,
    ctx: &ThreadCtx,
) {
    while !queue.is_empty() {
        match node.leader() {
            Some(l) if l == ctx.id && node.is_leader() => {
                let (batch, taken) = take_batch(queue, ctx);
                match node.propose(&batch) {
                    Ok(ticket) => {
                        in_flight.insert(ticket, taken);
                    }
                    Err(
                        ProposeError::TooManyInFlight { .. }
                        | ProposeError::Dropped { .. }
                        | ProposeError::NotLeader { .. },
                    ) => {
                        // Try again next round (or once a leader is known).
                        for p in taken.into_iter().rev() {
                            ctx.queued
                                .fetch_add(p.updates.len() as u64, Ordering::Relaxed);
                            queue.push_front(p);
                        }
                        return;
                    }
                    Err(e) => {
                        for p in taken {
                            answer(
                                p,
                                Err(ProposeFailure::Invalid {
                                    reason: e.to_string(),
                                }),
                            );
                        }
                    }
                }
            }
            Some(leader) if leader != ctx.id => {
                let (batch, taken) = take_batch(queue, ctx);
                forward(leader, batch, taken, ctx);
            }
            _ => return,
        }
    }
}

/// Sends `batch` to `leader` on a task; answers `taken` from the reply, or puts them back
/// in the queue when the leader moved or could not be reached.
fn forward(leader: NodeId, batch: Batch, taken: Vec<Pending>, ctx: &ThreadCtx) {
    ctx.counters
        .proposals_forwarded
        .fetch_add(1, Ordering::Relaxed);
    let peers = ctx.peers.clone();
    let inputs = ctx.inputs.clone();
    let bytes: Bytes = batch.encode().into();
    ctx.tasks.spawn_on(
        async move {
            let result = peers.request(leader, Request::Propose { batch: bytes }).await;
            let requeue = |taken: Vec<Pending>| {
                // Back to the queue: proposed again once a leader is known. A short
                // pause keeps a bouncing proposal from spinning.
                if let Err(e) = inputs.try_send(Input::Requeue(taken)) {
                    let taken = match e {
                        TrySendError::Full(Input::Requeue(t))
                        | TrySendError::Disconnected(Input::Requeue(t)) => t,
                        _ => Vec::new(),
                    };
                    for p in taken {
                        answer(p, Err(ProposeFailure::Busy { queued: INPUTS_MAX }));
                    }
                }
            };
            match result {
                Ok(Response::Propose { reply }) => match decode_forward_reply(&reply) {
                    Ok(ForwardReply::Applied { outcomes }) => {
                        let mut outcomes = outcomes.into_iter();
                        for p in taken {
                            let n = p.updates.len();
                            let mine: Vec<Outcome> = outcomes.by_ref().take(n).collect();
                            if mine.len() == n {
                                answer(p, Ok(mine));
                            } else {
                                answer(
                                    p,
                                    Err(ProposeFailure::Failed {
                                        reason: format!("{leader} answered too few outcomes"),
                                    }),
                                );
                            }
                        }
                    }
                    Ok(ForwardReply::NotLeader { .. } | ForwardReply::Failed { retry: true, .. }) => {
                        tokio::time::sleep(RECONNECT_BACKOFF_MIN).await;
                        requeue(taken);
                    }
                    Ok(ForwardReply::Failed { failure, retry: false }) => {
                        for p in taken {
                            answer(p, Err(ProposeFailure::Failed { reason: failure.clone() }));
                        }
                    }
                    Err(e) => {
                        for p in taken {
                            answer(
                                p,
                                Err(ProposeFailure::Failed {
                                    reason: format!("undecodable reply from {leader}: {e}"),
                                }),
                            );
                        }
                    }
                },
                Ok(other) => {
                    tracing::warn!(%leader, reply = ?other.kind(), "unexpected reply to a forwarded proposal");
                    tokio::time::sleep(RECONNECT_BACKOFF_MIN).await;
                    requeue(taken);
                }
                Err(e) => {
                    tracing::debug!(%leader, error = %e, "forwarding a proposal failed");
                    tokio::time::sleep(RECONNECT_BACKOFF_MIN).await;
                    requeue(taken);
                }
            }
        },
        &ctx.runtime,
    );
}

/// Hands outgoing messages to the peer senders, without waiting.
fn route(node: &mut MetaNode, ctx: &mut ThreadCtx) {
    for m in node.poll_messages() {
        let to = NodeId(m.to);
        let snapshot = m.get_msg_type() == raft::eraftpb::MessageType::MsgSnapshot;
        let sent = match ctx.outboxes.get(&to) {
            Some(tx) => tx.try_send(m).is_ok(),
            None => {
                // A member not in the initial list: start its sender if its address is known.
                if let Some(addr) = node
                    .state()
                    .member(to)
                    .and_then(|m| m.addresses.first())
                    .and_then(|a| a.parse::<SocketAddr>().ok())
                {
                    ctx.peers.learn(to, addr);
                    let (tx, rx) = mpsc::channel(PEER_OUTBOX_MAX);
                    ctx.tasks.spawn_on(
                        peer_sender(
                            to,
                            rx,
                            ctx.peers.clone(),
                            ctx.inputs.clone(),
                            ctx.counters.clone(),
                            CancellationToken::new(),
                        ),
                        &ctx.runtime,
                    );
                    let ok = tx.try_send(m).is_ok();
                    ctx.outboxes.insert(to, tx);
                    ok
                } else {
                    false
                }
            }
        };
        if !sent {
            ctx.counters
                .messages_undelivered
                .fetch_add(1, Ordering::Relaxed);
            node.report_unreachable(to);
            if snapshot {
                node.report_snapshot(to, false);
            }
        }
    }
}

/// Republishes the view when something in it changed (or `force`).
fn publish(
    node: &MetaNode,
    ctx: &ThreadCtx,
    last: &mut Option<(u64, u64, Role, Option<NodeId>, u64)>,
    force: bool,
) {
    let status = node.status();
    let key = (
        status.term,
        status.commit_index,
        status.role,
        status.leader,
        status.applied_index,
    );
    if !force && *last == Some(key) {
        return;
    }
    *last = Some(key);
    let state = node.state();
    let members = state
        .members()
        .map(|m| {
            let usage = state.usage(m.id).unwrap_or_default();
            MemberView {
                id: m.id,
                addr: m.addresses.first().cloned().unwrap_or_default(),
                state: m.state,
                epoch: m.epoch,
                capacity_bytes: m.capacity_bytes,
                used_bytes: usage.used_bytes,
                reserved_bytes: usage.reserved_bytes,
            }
        })
        .collect();
    *ctx.view.write().expect("meta view") = MetaView {
        role: status.role,
        leader: status.leader,
        term: status.term,
        commit_index: status.commit_index,
        applied_index: status.applied_index,
        members,
        running: true,
        healthy: true,
        error: None,
    };
}

/// Says in the view that the member is degraded, and why; the indexes and members stay
/// the last known.
fn publish_degraded(d: &Degraded, ctx: &ThreadCtx) {
    let mut view = ctx.view.write().expect("meta view");
    view.role = Role::Follower;
    view.leader = None;
    view.healthy = false;
    view.error = Some(d.cause.clone());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_replies_round_trip_and_garbage_is_an_error() {
        let reply = ForwardReply::Applied {
            outcomes: vec![
                Outcome::Accepted,
                Outcome::Rejected {
                    reason: "no".into(),
                },
            ],
        };
        match decode_forward_reply(&encode_forward_reply(&reply)).unwrap() {
            ForwardReply::Applied { outcomes } => {
                assert_eq!(outcomes.len(), 2);
                assert!(outcomes[0].is_accepted() && !outcomes[1].is_accepted());
            }
            other => panic!("{other:?}"),
        }
        let not_leader = encode_forward_reply(&ForwardReply::NotLeader { leader: Some(3) });
        assert!(matches!(
            decode_forward_reply(&not_leader),
            Ok(ForwardReply::NotLeader { leader: Some(3) })
        ));
        let mut trailing = not_leader.to_vec();
        trailing.push(0);
        assert!(decode_forward_reply(&trailing).is_err());
        // A hostile length prefix hits the decode limit instead of allocating.
        assert!(
            decode_forward_reply(&[0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff])
                .is_err()
        );
    }

    #[test]
    fn reasons_are_cut_at_a_character_boundary() {
        let long = "é".repeat(REASON_BYTES_MAX);
        let cut = cut(long);
        assert!(cut.len() <= REASON_BYTES_MAX);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
