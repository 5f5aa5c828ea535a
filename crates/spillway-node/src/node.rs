//! A running node: [`Node::start`] loads the identity, binds the QUIC transport, opens the
//! metadata group ([`crate::meta`], a Raft thread over `<data_dir>/raft`), serves the host
//! tier and the Raft traffic to peers ([`crate::service`]), and starts the remote tier
//! ([`crate::remote`]) and the metrics endpoint ([`crate::http`]); the [`NodeHandle`] it
//! returns reads the node's state and counters, proposes updates and shuts it down.
//!
//! Shutdown follows mini-redis: one [`CancellationToken`] tells every task of the node to
//! stop, and a [`TaskTracker`] holds every task the node spawned, so
//! [`NodeHandle::shutdown`] returns only when all of them are gone. The peer service has
//! its own token and tracker inside [`Server`]. Shutdown stops the local client socket
//! first (its clients' pages are discarded while Raft and the peers still serve), then a
//! leader hands leadership over, then the peer service stops (no new requests), then the
//! Raft thread (joined), then the node's own tasks (peer senders, forwarded
//! proposals, the metrics server), then closes the endpoint and waits until peers were
//! told. Dropping the handle instead tells all of them to stop and waits for none.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use spillway_net::certs::{CertError, NodeIdentity};
use spillway_net::quic::{QuicConnection, QuicTransport};
use spillway_net::{NetError, NetStats, Server, Transport};
use spillway_types::{NodeId, PoolId};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use spillway_meta::{MetaState, Role, Update};

use crate::config::{NodeConfig, NodeConfigError};
use crate::memory::{HostBudget, MemoryError, MemoryLimits, MemoryPlan};
use crate::meta::{MemberView, MetaDriver, MetaStartError, MetaView, Outcome, ProposeFailure};
use crate::peers::{PeerTransport, Peers};
use crate::remote::RemoteService;
use crate::service::{NodeService, ServiceCounters};
use crate::store::{HostStore, StoreCounters};

/// Longest wait at shutdown for the peer connections to drain after they were closed:
/// 500 ms (peers were told when the close was sent; the wait only lets the close be
/// retransmitted if it was lost).
pub const TRANSPORT_CLOSE_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] NodeConfigError),
    /// The node's memory plan does not fit the cgroup's memory limit or
    /// `RLIMIT_MEMLOCK` ([`crate::memory`]): refused at start, not OOM-killed later.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The node's certificate could not be loaded from the pool directory.
    #[error("cannot load the identity of {node} from {}: {source}", pool_dir.display())]
    Identity {
        /// The node.
        node: NodeId,
        /// Where it was looked for.
        pool_dir: PathBuf,
        /// Why it failed.
        #[source]
        source: CertError,
    },
    /// The data directory could not be created.
    #[error("cannot create the data directory {}: {source}", path.display())]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The metadata group could not start.
    #[error(transparent)]
    Meta(#[from] MetaStartError),
    /// The local client socket could not be created (`crate::local`).
    #[error(transparent)]
    ClientSocket(#[from] crate::local::LocalServerError),
    /// The metrics endpoint could not be bound.
    #[error("cannot bind the metrics endpoint on {addr}: {source}")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The transport could not be bound.
    #[error("cannot bind the peer transport on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: NetError,
    },
    /// The UCX transport (`transport = "ucx"`) could not be started: no libucx, or UCX
    /// refused (the error says which).
    #[error("cannot start the UCX page transport (transport = \"ucx\")")]
    Ucx {
        /// Why.
        #[source]
        source: NetError,
    },
}

/// A snapshot of a node's counters: what `/metrics` will export.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeCounters {
    /// The host tier.
    pub store: StoreCounters,
    /// Frames from peers that failed the wire checks (each closed its connection).
    pub frames_rejected: u64,
    /// Incoming connections refused at TLS (no pool certificate) or hello.
    pub handshakes_refused: u64,
    /// Incoming connections that completed TLS and hello.
    pub connections_accepted: u64,
    /// Frame bytes received from peers.
    pub peer_bytes_in: u64,
    /// Frame bytes sent to peers.
    pub peer_bytes_out: u64,
    /// Raft messages and proposals from peers that passed the wire checks but did not
    /// decode or named another sender (each answered with an error).
    pub peer_requests_refused: u64,
    /// Raft messages to peers that could not be delivered.
    pub raft_messages_undelivered: u64,
    /// Proposals this node forwarded to the leader.
    pub proposals_forwarded: u64,
}

/// Starts nodes.
#[derive(Debug)]
pub struct Node;

impl Node {
    /// Validates `config`, checks its memory plan against this process's cgroup limit
    /// and `RLIMIT_MEMLOCK` ([`crate::memory`]), loads the node's identity from
    /// `pool_dir`, creates `data_dir`, binds the peer transport on `listen_addr` and
    /// serves the host tier. Must be called inside a tokio runtime.
    pub async fn start(config: NodeConfig) -> Result<NodeHandle, NodeError> {
        config.validate()?;
        let client_room = check_memory(&config, &MemoryLimits::read())?;
        let identity = NodeIdentity::load(&config.pool_dir, config.node_id).map_err(|source| {
            NodeError::Identity {
                node: config.node_id,
                pool_dir: config.pool_dir.clone(),
                source,
            }
        })?;
        std::fs::create_dir_all(&config.data_dir).map_err(|source| NodeError::DataDir {
            path: config.data_dir.clone(),
            source,
        })?;
        let addr = config.listen_addr;
        let transport = QuicTransport::bind(addr, identity, config.quic.clone())
            .map_err(|source| NodeError::Bind { addr, source })?;
        let transport = Arc::new(transport);
        Node::start_inner(config, transport.clone(), Some(transport), client_room).await
    }

    /// Starts a node over `transport` (bound already) instead of QUIC: the same node,
    /// with its Raft log in `data_dir`, its host tier, remote tier, metrics and client
    /// socket, its peers reached through `transport`. The whole-node tests run nodes over
    /// `spillway_net::sim`. `pool_dir` is not read (no certificates);
    /// [`NodeHandle::connect`] is refused. Must be called inside a tokio runtime.
    pub async fn start_over<T: Transport>(
        config: NodeConfig,
        transport: T,
    ) -> Result<NodeHandle, NodeError> {
        Node::start_over_within(config, transport, &MemoryLimits::read()).await
    }

    /// [`Node::start_over`], its memory plan checked against `limits` instead of this
    /// process's (tests inject a cgroup limit).
    pub async fn start_over_within<T: Transport>(
        config: NodeConfig,
        transport: T,
        limits: &MemoryLimits,
    ) -> Result<NodeHandle, NodeError> {
        config.validate()?;
        let client_room = check_memory(&config, limits)?;
        std::fs::create_dir_all(&config.data_dir).map_err(|source| NodeError::DataDir {
            path: config.data_dir.clone(),
            source,
        })?;
        Node::start_inner(config, Arc::new(transport), None, client_room).await
    }

    async fn start_inner<T: Transport>(
        config: NodeConfig,
        transport: Arc<T>,
        quic: Option<Arc<QuicTransport>>,
        client_room: Option<u64>,
    ) -> Result<NodeHandle, NodeError> {
        let addr = transport.local_addr();
        let bind_err = |source| NodeError::Bind { addr, source };
        let store = Arc::new(HostStore::new(config.host_tier_bytes, config.page_size));
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        let addrs = config
            .initial_members()
            .into_iter()
            .map(|m| (m.id, m.addr))
            .collect();
        let peers = Peers::new(transport.clone(), addrs);
        #[cfg(feature = "ucx")]
        let ucx = match config.transport {
            crate::config::PageTransport::Ucx => Some(Arc::new(
                start_ucx(&config, transport.pool_id())
                    .map_err(|source| NodeError::Ucx { source })?,
            )),
            crate::config::PageTransport::Quic => None,
        };
        #[cfg(feature = "ucx")]
        let peers = match &ucx {
            Some(u) => peers.with_ucx(u.clone()),
            None => peers,
        };
        let peers = Arc::new(peers);
        let meta = MetaDriver::start(&config, peers.clone(), &tasks, &cancel).await?;
        let service_counters = Arc::new(ServiceCounters::default());
        let service = Arc::new(NodeService {
            store: store.clone(),
            meta: meta.clone(),
            counters: service_counters.clone(),
            #[cfg(feature = "ucx")]
            ucx: ucx.as_ref().map(Arc::downgrade),
        });
        let server = match transport.serve(service.clone()) {
            Ok(s) => s,
            Err(e) => {
                meta.shutdown().await;
                return Err(bind_err(e));
            }
        };
        #[cfg(feature = "ucx")]
        let ucx = match ucx {
            Some(u) => match u.serve(service) {
                Ok(server) => Some((u, server)),
                Err(e) => {
                    server.shutdown().await;
                    meta.shutdown().await;
                    return Err(NodeError::Ucx { source: e });
                }
            },
            None => None,
        };
        let remote = Arc::new(RemoteService::over_pool(
            &config,
            meta.clone(),
            peers.clone(),
        ));
        // Deletes of copies on peers that did not answer are retried until they land, and
        // reservations the group dropped leave this node's ledger.
        tasks.spawn(remote.clone().run_upkeep(cancel.child_token()));
        // This incarnation starts with an empty host tier and no clients: the directory
        // must stop naming this node for pages an earlier incarnation held, and the pages
        // its earlier clients spilled are released, before the first client is taken.
        let (ready_tx, mut ready_rx) = tokio::sync::watch::channel(false);
        tasks.spawn(announce_incarnation(
            meta.clone(),
            remote.clone(),
            config.node_id,
            ready_tx,
            cancel.child_token(),
        ));
        let clients_ready: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
            Box::pin(async move {
                let _ = ready_rx.wait_for(|ready| *ready).await;
            });
        let clients = Arc::new(AtomicU64::new(0));
        let mut handle = NodeHandle {
            config,
            transport,
            quic,
            store,
            server: Some(server),
            meta,
            peers,
            remote,
            service_counters,
            clients,
            local: None,
            metrics_addr: None,
            local_cancel: cancel.child_token(),
            local_tasks: TaskTracker::new(),
            cancel,
            tasks,
            #[cfg(feature = "ucx")]
            ucx,
        };
        match crate::http::serve(
            handle.config().metrics_addr,
            handle.status_sources(),
            handle.cancel_token().clone(),
            handle.task_tracker().clone(),
        )
        .await
        {
            Ok(bound) => handle.metrics_addr = Some(bound),
            Err(source) => {
                let addr = handle.config.metrics_addr;
                handle.shutdown_inner().await;
                return Err(NodeError::Metrics { addr, source });
            }
        }
        // The local client socket (crate::local): this machine's clients, their host tiers
        // shared with the node, the remote tier behind them; on the node's tasks.
        let local = crate::local::LocalServerConfig::new(
            handle.config.client_socket.clone(),
            handle.config.page_size,
            handle.config.host_tier_bytes,
        );
        let local = match client_room {
            Some(room) => local.sharing(Arc::new(HostBudget::new(room))),
            None => local,
        };
        let (remote, clients) = (handle.remote.clone(), handle.clients.clone());
        match crate::local::spawn_gated_in(
            local,
            remote,
            clients,
            &handle.local_tasks,
            &handle.local_cancel,
            clients_ready,
        ) {
            Ok(monitor) => handle.local = Some(monitor),
            Err(e) => {
                handle.shutdown_inner().await;
                return Err(NodeError::ClientSocket(e));
            }
        }
        tracing::info!(
            node = %handle.config.node_id,
            addr = %handle.transport.local_addr(),
            host_tier_bytes = handle.config.host_tier_bytes,
            lend_bytes = handle.config.lend_bytes,
            "node serving peers"
        );
        Ok(handle)
    }
}

/// Checks `config`'s memory plan against `limits` and logs it; the room the limit leaves
/// the local clients' host tiers (`None`: no limit).
fn check_memory(config: &NodeConfig, limits: &MemoryLimits) -> Result<Option<u64>, MemoryError> {
    let ucx_tls = std::env::var("UCX_TLS").ok();
    let plan = MemoryPlan::of(config, ucx_tls.as_deref());
    crate::memory::check(&plan, limits)?;
    let client_room = crate::memory::client_room_bytes(&plan, limits);
    tracing::info!(
        host_budget_bytes = plan.host_budget_bytes,
        overhead_bytes = plan.overhead_bytes(),
        resident_max_bytes = plan.resident_max_bytes(),
        cgroup_limit_bytes = limits.cgroup.as_ref().map(|c| c.limit_bytes),
        memlock_bytes = limits.memlock_bytes,
        pinned_bytes = plan.pinned_bytes,
        client_room_bytes = client_room,
        "memory plan fits"
    );
    Ok(client_room)
}

/// First wait before the incarnation announcement is proposed again: 100 ms, doubling
/// to [`ANNOUNCE_RETRY_MAX`].
const ANNOUNCE_RETRY_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two tries of the incarnation announcement: 5 s.
const ANNOUNCE_RETRY_MAX: Duration = Duration::from_secs(5);

/// Tells the metadata group that this node starts with an empty host tier: the node goes
/// down and up again in one proposal, which starts a new epoch and drops every directory
/// record of pages an earlier incarnation held (their bytes died with its RAM; a peer
/// fetching one gets a clear "not in the remote tier" instead of a page that is not
/// there). Then releases the pages the earlier incarnation's clients spilled to peers,
/// and only then lets `ready` open the client socket. Each step is retried with backoff
/// until it lands.
async fn announce_incarnation(
    meta: Arc<MetaDriver>,
    remote: Arc<RemoteService>,
    node: NodeId,
    ready: tokio::sync::watch::Sender<bool>,
    cancel: CancellationToken,
) {
    let updates = crate::placement::incarnation_updates(node);
    let Some(outcomes) = until_done(&cancel, "incarnation not recorded yet", || {
        meta.propose(updates.clone())
    })
    .await
    else {
        return;
    };
    if outcomes.iter().all(Outcome::is_accepted) {
        tracing::info!(%node, "new incarnation recorded: the directory no longer names this node for earlier pages");
    } else {
        tracing::warn!(%node, ?outcomes, "the group refused this node's new incarnation");
    }
    // The earlier incarnation's clients are gone; new ones reuse their numbers.
    if until_done(&cancel, "earlier pages not released yet", || {
        remote.release_earlier_incarnation()
    })
    .await
    .is_none()
    {
        return;
    }
    let _ = ready.send(true);
}

/// Runs `attempt` until it succeeds, waiting [`ANNOUNCE_RETRY_MIN`] doubling to
/// [`ANNOUNCE_RETRY_MAX`] between tries; `None` if `cancel` fires first.
async fn until_done<T, E: std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    cancel: &CancellationToken,
    what: &str,
    mut attempt: impl FnMut() -> F,
) -> Option<T> {
    let mut delay = ANNOUNCE_RETRY_MIN;
    loop {
        match attempt().await {
            Ok(v) => return Some(v),
            Err(e) => tracing::debug!(error = %e, "{what}; retrying"),
        }
        tokio::select! {
            _ = cancel.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(ANNOUNCE_RETRY_MAX);
    }
}

/// A running node (from [`Node::start`]). Dropping it stops serving peers without waiting;
/// [`NodeHandle::shutdown`] stops everything and waits.
#[derive(Debug)]
pub struct NodeHandle {
    config: NodeConfig,
    transport: Arc<dyn PeerTransport>,
    /// The QUIC transport, when the node runs over QUIC (every node but the simulated
    /// ones of tests).
    quic: Option<Arc<QuicTransport>>,
    store: Arc<HostStore>,
    server: Option<Server>,
    meta: Arc<MetaDriver>,
    peers: Arc<Peers>,
    remote: Arc<RemoteService>,
    service_counters: Arc<ServiceCounters>,
    /// Local clients connected now (set by the client socket server).
    clients: Arc<AtomicU64>,
    /// The local client socket's counters (`None` only while starting).
    local: Option<crate::local::LocalMonitor>,
    /// Where `/metrics` and `/status` listen (the bound port when the config asked for 0).
    metrics_addr: Option<SocketAddr>,
    /// Tells the local client socket's tasks to stop (a child of `cancel`): shutdown stops
    /// them first, while Raft and the peers still serve the discards of their pages.
    local_cancel: CancellationToken,
    /// The local client socket's tasks.
    local_tasks: TaskTracker,
    /// Tells the node's own tasks to stop (peer senders, forwarded proposals, metrics).
    cancel: CancellationToken,
    /// Every task the node spawned besides the peer service's.
    tasks: TaskTracker,
    /// The UCX page transport and its server (`transport = "ucx"`).
    #[cfg(feature = "ucx")]
    ucx: Option<(Arc<spillway_net::ucx::UcxTransport>, Server)>,
}

impl NodeHandle {
    /// This node.
    pub fn node_id(&self) -> NodeId {
        self.transport.node_id()
    }

    /// This node's pool.
    pub fn pool_id(&self) -> PoolId {
        self.transport.pool_id()
    }

    /// Where peers reach this node (the bound port when the config asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.transport.local_addr()
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The host tier.
    pub fn store(&self) -> &Arc<HostStore> {
        &self.store
    }

    /// The remote tier of this node's local clients.
    pub fn remote(&self) -> Arc<RemoteService> {
        self.remote.clone()
    }

    /// The number of local clients connected now: the client socket server increments
    /// and decrements it; `/status` and `/metrics` report it.
    pub fn clients(&self) -> &Arc<AtomicU64> {
        &self.clients
    }

    /// The local client socket's counters (frames rejected, ops, clients refused).
    pub fn local_clients(&self) -> Option<&crate::local::LocalMonitor> {
        self.local.as_ref()
    }

    /// Where `/metrics` and `/status` listen.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr.unwrap_or(self.config.metrics_addr)
    }

    /// The metadata group as this node sees it now.
    pub fn meta_view(&self) -> MetaView {
        self.meta.view()
    }

    /// This node's Raft role.
    pub fn role(&self) -> Role {
        self.meta.view().role
    }

    /// The leader this node knows of.
    pub fn leader(&self) -> Option<NodeId> {
        self.meta.view().leader
    }

    /// The current Raft term.
    pub fn term(&self) -> u64 {
        self.meta.view().term
    }

    /// The commit index.
    pub fn commit_index(&self) -> u64 {
        self.meta.view().commit_index
    }

    /// Resolves when this node's Raft thread stopped on a failure it cannot recover from
    /// (raft-engine panics when an fsync fails); the view's `error` says why. A failure it
    /// recovers from (a full disk: the node is degraded and reopens its log) does not
    /// resolve it. A daemon exits on it: the node must be restarted.
    pub async fn raft_failed(&self) {
        self.meta.failed().await;
    }

    /// The members with their capacity, used and reserved bytes, as applied here.
    pub fn members(&self) -> Vec<MemberView> {
        self.meta.view().members
    }

    /// Proposes `updates` to the metadata group (forwarded to the leader when this node
    /// follows); returns each update's outcome once committed. Updates queued at the same
    /// time go in one Raft entry.
    pub async fn propose(&self, updates: Vec<Update>) -> Result<Vec<Outcome>, ProposeFailure> {
        self.meta.propose(updates).await
    }

    /// Runs `f` on the replicated state as applied on this node (on the Raft thread; keep
    /// it short) and returns what it returns.
    pub async fn meta_read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&MetaState) -> T + Send + 'static,
    ) -> Result<T, ProposeFailure> {
        self.meta.read(f).await
    }

    /// The connections to peers (cached, reconnected with backoff).
    pub fn peers(&self) -> &Arc<Peers> {
        &self.peers
    }

    pub(crate) fn meta(&self) -> &Arc<MetaDriver> {
        &self.meta
    }

    pub(crate) fn transport(&self) -> &Arc<dyn PeerTransport> {
        &self.transport
    }

    pub(crate) fn service_counters(&self) -> &Arc<ServiceCounters> {
        &self.service_counters
    }

    pub(crate) fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    pub(crate) fn task_tracker(&self) -> &TaskTracker {
        &self.tasks
    }

    /// The transport's per-peer counters.
    pub fn net_stats(&self) -> &Arc<NetStats> {
        self.transport.stats()
    }

    /// The transport pages move on: `"quic"` or `"ucx"` (`transport` in the config).
    pub fn page_transport(&self) -> &'static str {
        self.peers.page_transport()
    }

    /// The per-peer counters of the transport pages move on (the QUIC transport's, or the
    /// UCX transport's when `transport = "ucx"`).
    pub fn page_net_stats(&self) -> &Arc<NetStats> {
        #[cfg(feature = "ucx")]
        if let Some((ucx, _)) = &self.ucx {
            return spillway_net::Transport::stats(&**ucx);
        }
        self.transport.stats()
    }

    /// Connects to the peer at `addr` (mutual TLS and hello), to put, get and delete pages.
    /// Refused for a node started over another transport ([`Node::start_over`]).
    pub async fn connect(&self, addr: SocketAddr) -> Result<QuicConnection, NetError> {
        match &self.quic {
            Some(quic) => quic.connect(addr).await,
            None => Err(NetError::Unavailable {
                transport: "QUIC",
                reason: "this node runs over another transport".to_string(),
            }),
        }
    }

    /// The node's counters now.
    pub fn counters(&self) -> NodeCounters {
        let net = self.transport.stats();
        let total = net.total();
        NodeCounters {
            store: self.store.counters(),
            frames_rejected: total.frames_rejected,
            handshakes_refused: net.handshakes_refused(),
            connections_accepted: net.connections_accepted(),
            peer_bytes_in: total.bytes_in,
            peer_bytes_out: total.bytes_out,
            peer_requests_refused: self
                .service_counters
                .peer_requests_refused
                .load(Ordering::Relaxed),
            raft_messages_undelivered: self
                .meta
                .counters
                .messages_undelivered
                .load(Ordering::Relaxed),
            proposals_forwarded: self
                .meta
                .counters
                .proposals_forwarded
                .load(Ordering::Relaxed),
        }
    }

    /// Stops serving peers (requests in progress are abandoned; peers see their
    /// connections close), stops the node's tasks and waits for all of them, then closes
    /// the endpoint and waits until peers were told.
    pub async fn shutdown(mut self) {
        self.shutdown_inner().await;
    }

    async fn shutdown_inner(&mut self) {
        // Local clients first: their pages are discarded through Raft and the peers.
        self.local_cancel.cancel();
        self.local_tasks.close();
        self.local_tasks.wait().await;
        // A leader hands over while it can still hear its followers.
        self.meta.hand_over().await;
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
        #[cfg(feature = "ucx")]
        if let Some((ucx, server)) = self.ucx.take() {
            server.shutdown().await;
            ucx.shutdown().await;
        }
        self.meta.shutdown().await;
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        // Peers are told at once; waiting for the connections to drain is bounded, since a
        // connection still in its handshake to a dead peer drains for seconds.
        if tokio::time::timeout(TRANSPORT_CLOSE_WAIT, self.transport.close_erased())
            .await
            .is_err()
        {
            tracing::debug!(node = %self.config.node_id, "peer connections still draining at shutdown");
        }
        tracing::info!(node = %self.config.node_id, "node shut down");
    }
}

/// Starts the UCX page transport of a node: receive slots that hold the largest page
/// request the remote tier sends (its pages and frame header).
#[cfg(feature = "ucx")]
fn start_ucx(
    config: &NodeConfig,
    pool_id: PoolId,
) -> Result<spillway_net::ucx::UcxTransport, NetError> {
    use spillway_net::ucx::{UcxTransport, UcxWorkerConfig};
    let page = config.page_size.bytes();
    let request_bytes = (crate::remote::PAGES_PER_REQUEST as u64 * page)
        .min(crate::remote::REQUEST_BYTES_MAX.max(page));
    let worker = UcxWorkerConfig {
        recv_slot_bytes: usize::try_from(request_bytes + UCX_FRAME_HEADROOM_BYTES)
            .unwrap_or(usize::MAX),
        recv_slots_count: UCX_RECV_SLOTS,
        ..UcxWorkerConfig::default()
    };
    // No side channel: connections are introduced over the authenticated QUIC ones.
    UcxTransport::introduced_only(pool_id, config.node_id, &config.quic, &worker)
}

/// Bytes of a UCX receive slot beyond the pages of the largest request: 64 KiB for the
/// frame's header and page descriptors.
#[cfg(feature = "ucx")]
const UCX_FRAME_HEADROOM_BYTES: u64 = 64 << 10;
/// UCX receive slots of a node: 1. Page traffic is received into buffers of each
/// message's own length (`Worker::recv_owned`); the registered slot is the worker's
/// bound on a message's length.
#[cfg(feature = "ucx")]
const UCX_RECV_SLOTS: usize = 1;

impl NodeHandle {
    pub(crate) fn status_sources(&self) -> crate::http::StatusSources {
        crate::http::StatusSources {
            node_id: self.node_id().0,
            addr: self.local_addr(),
            transport: self.transport().clone(),
            store: self.store().clone(),
            meta: self.meta().clone(),
            remote: self.remote(),
            service: self.service_counters().clone(),
            clients: self.clients().clone(),
            page_transport: self.page_transport(),
            ucx_stats: (self.page_transport() == "ucx").then(|| self.page_net_stats().clone()),
        }
    }

    /// The `/status` document now.
    pub fn status(&self) -> crate::http::NodeStatus {
        self.status_sources().status(self.metrics_addr())
    }

    /// The `/metrics` document now.
    pub fn metrics_text(&self) -> String {
        self.status_sources().metrics()
    }
}

impl Drop for NodeHandle {
    fn drop(&mut self) {
        // Dropping the server cancels it; the node's tasks and the Raft thread are told
        // too, and nothing is waited for.
        self.cancel.cancel();
        self.meta.stop();
    }
}
