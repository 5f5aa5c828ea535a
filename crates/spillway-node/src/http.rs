//! The node's metrics endpoint: `GET /metrics` (Prometheus text format, built with
//! `prometheus-client`) and `GET /status` ([`NodeStatus`] as JSON), served on
//! `metrics_addr` by a minimal HTTP/1.1 responder on tokio.
//!
//! The responder answers one request per connection and closes it: it reads at most
//! [`REQUEST_BYTES_MAX`] bytes of request head within [`REQUEST_TIMEOUT`], serves `GET`
//! of the two paths, answers 404 for other paths, 405 for other methods and 400 for a
//! head that is malformed, too large or too slow, and gives the client
//! [`RESPONSE_TIMEOUT`] to take the answer. A scraper is trusted no more than any other
//! client: nothing it sends is kept.
//!
//! `/status` is how `spillway status` and `cluster up` tell a live node from a dead one,
//! so slow clients must never starve it. Hence:
//! - the accept loop never waits for anything but the listener: each connection is its own
//!   task, with its own deadlines (at most `REQUEST_TIMEOUT + RESPONSE_TIMEOUT` in all);
//! - at most [`CONNECTIONS_MAX`] connections are held; a new one beyond that closes the
//!   oldest held (the one nearest its deadline, typically a slow or idle client), and so
//!   does running out of file descriptors. A well-behaved request is therefore read and
//!   answered as soon as it arrives, however many slow connections are open: to push it
//!   out, a client would have to open `CONNECTIONS_MAX` connections during the
//!   milliseconds it takes to answer.
//!
//! A crate (hyper, axum) would bring a whole HTTP stack for two read-only GETs; this is
//! ~150 lines with explicit bounds.
//!
//! Both documents are built from `StatusSources`, shared handles to the node's parts,
//! at request time: nothing is cached, so they are as fresh as the counters.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use spillway_meta::{MemberState, Role};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::meta::MetaDriver;
use crate::remote::RemoteService;
use crate::service::ServiceCounters;
use crate::store::HostStore;

/// Largest request head read: 8 KiB (request line and headers; a body is never read).
pub const REQUEST_BYTES_MAX: usize = 8 << 10;
/// Time a client has to send its request head: 5 s.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a client has to take the whole response: 5 s.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections held at once: 512; a new one past it closes the oldest. One that is still
/// sending its head holds its task (under 1 KiB), a 1 KiB read buffer and at most
/// [`REQUEST_BYTES_MAX`] of head: under 10 KiB, so about 5 MiB for all of them (plus the
/// kernel's socket buffers). One being answered holds its document instead (`/status` a
/// few KiB, `/metrics` about 1 KiB per peer). 512 also stays well under the usual soft
/// limit of 1024 file descriptors, leaving the node's own files and sockets theirs.
pub const CONNECTIONS_MAX: usize = 512;

/// The responder's bounds; [`Limits::NODE`] in a node, smaller ones in tests.
#[derive(Clone, Copy, Debug)]
struct Limits {
    connections_max: usize,
    request_timeout: Duration,
    response_timeout: Duration,
}

impl Limits {
    const NODE: Limits = Limits {
        connections_max: CONNECTIONS_MAX,
        request_timeout: REQUEST_TIMEOUT,
        response_timeout: RESPONSE_TIMEOUT,
    };
}

/// A response: status code, content type, body.
type Reply = (u16, &'static str, String);

/// `/status`: the node's identity, Raft state, members, tiers and traffic. Other tools
/// parse it (`spillway status`): field names are an interface. Every field has a default
/// when absent, so a node of a slightly older or newer version still reads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeStatus {
    /// This node.
    pub node_id: u64,
    /// The pool, as 16 hex digits.
    pub pool_id: String,
    /// Where peers reach it.
    pub addr: String,
    /// Where this endpoint listens.
    pub metrics_addr: String,
    /// `leader`, `follower`, `candidate` or `precandidate`.
    pub role: String,
    /// The leader it knows of, if any.
    pub leader: Option<u64>,
    /// The Raft term.
    pub term: u64,
    /// The Raft commit index.
    pub commit_index: u64,
    /// Whether this node takes part in the metadata group: false while its Raft log
    /// fails (a full disk: the node reopens it with backoff, and `role`, `term` and
    /// `commit_index` are the last known) or after its Raft thread stopped. True when
    /// absent (a node older than the field).
    pub raft_healthy: bool,
    /// Why Raft is unhealthy here: the storage failure (`null` when healthy).
    pub raft_error: Option<String>,
    /// The members as applied here.
    pub members: Vec<MemberStatus>,
    /// The host tier.
    pub host_tier: HostTierStatus,
    /// The remote tier of this node's clients.
    pub remote: RemoteStatus,
    /// Frame bytes received from peers.
    pub peer_bytes_in: u64,
    /// Frame bytes sent to peers.
    pub peer_bytes_out: u64,
    /// Frames from peers that failed the wire checks.
    pub frames_rejected: u64,
    /// Local clients connected.
    pub clients: u64,
    /// How pages move to and from peers: `quic` or `ucx` (the config's `transport`).
    pub page_transport: String,
    /// Frame bytes of page requests and replies received over UCX (within
    /// `peer_bytes_in`; 0 with `quic`).
    pub ucx_bytes_in: u64,
    /// Frame bytes of page requests and replies sent over UCX (within `peer_bytes_out`).
    pub ucx_bytes_out: u64,
}

impl Default for NodeStatus {
    /// Every field empty or zero, except `raft_healthy`: a status that does not say
    /// otherwise (an older node's) is healthy.
    fn default() -> Self {
        NodeStatus {
            node_id: 0,
            pool_id: String::new(),
            addr: String::new(),
            metrics_addr: String::new(),
            role: String::new(),
            leader: None,
            term: 0,
            commit_index: 0,
            raft_healthy: true,
            raft_error: None,
            members: Vec::new(),
            host_tier: HostTierStatus::default(),
            remote: RemoteStatus::default(),
            peer_bytes_in: 0,
            peer_bytes_out: 0,
            frames_rejected: 0,
            clients: 0,
            page_transport: String::new(),
            ucx_bytes_in: 0,
            ucx_bytes_out: 0,
        }
    }
}

impl NodeStatus {
    /// Whether this node says it is the leader.
    pub fn is_leader(&self) -> bool {
        self.role.eq_ignore_ascii_case("leader")
    }

    /// The leader it knows (0 means none).
    pub fn known_leader(&self) -> Option<u64> {
        self.leader.filter(|&l| l != 0)
    }
}

/// One member in [`NodeStatus`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemberStatus {
    /// Its id.
    pub id: u64,
    /// Its peer address.
    pub addr: String,
    /// `up`, `down` or `leaving`.
    pub state: String,
    /// Bytes it lends.
    pub capacity_bytes: u64,
    /// Bytes of placed pages it holds.
    pub used_bytes: u64,
    /// Bytes reserved on it.
    pub reserved_bytes: u64,
    /// Its part in the metadata group: `voter` or `learner` (empty from a node older than
    /// the field).
    pub raft: String,
}

/// The host tier in [`NodeStatus`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HostTierStatus {
    /// Its budget.
    pub budget_bytes: u64,
    /// Bytes held.
    pub used_bytes: u64,
    /// Pages held.
    pub pages: u64,
}

/// The remote tier in [`NodeStatus`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RemoteStatus {
    /// Page bytes sent to peers.
    pub bytes_out: u64,
    /// Page bytes fetched from peers.
    pub bytes_in: u64,
    /// Pages spilled.
    pub pages_spilled: u64,
    /// Pages fetched.
    pub pages_fetched: u64,
    /// Bytes of this node's reservations on peers not spent yet (equal to what the group
    /// holds reserved for this node once its placements have committed).
    pub reserved_unspent_bytes: u64,
    /// Page copies on peers whose delete waits for the peer to answer (retried until
    /// they land).
    pub deletes_pending: u64,
    /// Holders wanted per spilled page (the node's `replicas`).
    pub replicas: u8,
    /// This node's spilled pages with fewer live copies than `replicas`.
    pub under_replicated_pages: u64,
    /// Their missing copies, in bytes: what re-replication has left to copy.
    pub under_replicated_bytes: u64,
    /// This node's spilled pages with no live copy left.
    pub lost_pages: u64,
    /// Bytes re-replication copied so far (its progress).
    pub repaired_bytes: u64,
    /// Pages read from a further holder after a nearer one failed.
    pub fetch_failovers: u64,
}

/// Shared handles to what the documents are built from.
#[derive(Clone, Debug)]
pub(crate) struct StatusSources {
    pub node_id: u64,
    pub addr: SocketAddr,
    pub transport: Arc<dyn crate::peers::PeerTransport>,
    pub store: Arc<HostStore>,
    pub meta: Arc<MetaDriver>,
    pub remote: Arc<RemoteService>,
    pub service: Arc<ServiceCounters>,
    pub clients: Arc<AtomicU64>,
    pub page_transport: &'static str,
    /// The UCX transport's counters, when pages move over UCX.
    pub ucx_stats: Option<Arc<spillway_net::NetStats>>,
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Leader => "leader",
        Role::Follower => "follower",
        Role::Candidate => "candidate",
        Role::PreCandidate => "precandidate",
    }
}

fn state_name(state: MemberState) -> &'static str {
    match state {
        MemberState::Up => "up",
        MemberState::Down => "down",
        MemberState::Leaving => "leaving",
    }
}

impl StatusSources {
    /// The `/placements` view.
    pub fn placements(&self) -> PlacementsView {
        let (by, truncated) = self.remote.buffers_by_holder();
        PlacementsView {
            node_id: self.node_id,
            clients: by
                .into_iter()
                .map(|(c, holders)| {
                    let holders = holders
                        .into_iter()
                        .map(|(h, bufs)| (h.0, bufs.into_iter().map(|b| b.0).collect()))
                        .collect();
                    (c, holders)
                })
                .collect(),
            truncated,
        }
    }

    /// The `/status` document now.
    pub fn status(&self, metrics_addr: SocketAddr) -> NodeStatus {
        let view = self.meta.view();
        let store = self.store.counters();
        let remote = self.remote.counters();
        let net = self.transport.stats().total();
        let ucx = self
            .ucx_stats
            .as_ref()
            .map(|s| s.total())
            .unwrap_or_default();
        NodeStatus {
            node_id: self.node_id,
            pool_id: format!("{:016x}", self.transport.pool_id().0),
            addr: self.addr.to_string(),
            metrics_addr: metrics_addr.to_string(),
            role: role_name(view.role).to_string(),
            leader: view.leader.map(|l| l.0),
            term: view.term,
            commit_index: view.commit_index,
            raft_healthy: view.healthy,
            raft_error: view.error.clone(),
            members: view
                .members
                .iter()
                .map(|m| MemberStatus {
                    id: m.id.0,
                    addr: m.addr.clone(),
                    state: state_name(m.state).to_string(),
                    capacity_bytes: m.capacity_bytes,
                    used_bytes: m.used_bytes,
                    reserved_bytes: m.reserved_bytes,
                    raft: if m.voter { "voter" } else { "learner" }.to_string(),
                })
                .collect(),
            host_tier: HostTierStatus {
                budget_bytes: store.budget_bytes,
                used_bytes: store.used_bytes,
                pages: store.pages,
            },
            remote: RemoteStatus {
                bytes_out: remote.bytes_out,
                bytes_in: remote.bytes_in,
                pages_spilled: remote.pages_spilled,
                pages_fetched: remote.pages_fetched,
                reserved_unspent_bytes: remote.reserved_unspent_bytes,
                deletes_pending: remote.deletes_pending,
                replicas: remote.replicas,
                under_replicated_pages: remote.under_replicated_pages,
                under_replicated_bytes: remote.under_replicated_bytes,
                lost_pages: remote.lost_pages,
                repaired_bytes: remote.repaired_bytes,
                fetch_failovers: remote.fetch_failovers,
            },
            peer_bytes_in: net.bytes_in + ucx.bytes_in,
            peer_bytes_out: net.bytes_out + ucx.bytes_out,
            frames_rejected: net.frames_rejected + ucx.frames_rejected,
            clients: self.clients.load(Ordering::Relaxed),
            page_transport: self.page_transport.to_string(),
            ucx_bytes_in: ucx.bytes_in,
            ucx_bytes_out: ucx.bytes_out,
        }
    }

    /// The `/metrics` document now (Prometheus text format).
    pub fn metrics(&self) -> String {
        let mut registry = Registry::with_prefix("spillway");
        let view = self.meta.view();
        let store = self.store.counters();
        let remote = self.remote.counters();
        let gauge = |registry: &mut Registry, name: &str, help: &str, v: u64| {
            let g: Gauge<i64> = Gauge::default();
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
            registry.register(name, help, g);
        };
        let counter = |registry: &mut Registry, name: &str, help: &str, v: u64| {
            let c: Counter<u64> = Counter::default();
            c.inc_by(v);
            registry.register(name, help, c);
        };
        gauge(&mut registry, "raft_term", "Current Raft term", view.term);
        gauge(
            &mut registry,
            "raft_commit_index",
            "Raft commit index",
            view.commit_index,
        );
        gauge(
            &mut registry,
            "raft_applied_index",
            "Raft index applied here",
            view.applied_index,
        );
        gauge(
            &mut registry,
            "raft_leader",
            "Node id of the known leader (0: none)",
            view.leader.map_or(0, |l| l.0),
        );
        gauge(
            &mut registry,
            "raft_is_leader",
            "1 if this node leads",
            u64::from(view.role == Role::Leader),
        );
        gauge(
            &mut registry,
            "raft_healthy",
            "1 if this node takes part in the metadata group; 0 while its Raft log fails (see /status raft_error)",
            u64::from(view.healthy),
        );
        counter(
            &mut registry,
            "raft_storage_errors",
            "Storage failures of the Raft log (failed Readies and failed attempts to reopen the log)",
            self.meta.counters.storage_errors.load(Ordering::Relaxed),
        );
        counter(
            &mut registry,
            "raft_storage_recoveries",
            "Times the Raft log was reopened after a storage failure",
            self.meta
                .counters
                .storage_recoveries
                .load(Ordering::Relaxed),
        );
        gauge(
            &mut registry,
            "members",
            "Members of the pool",
            view.members.len() as u64,
        );
        gauge(
            &mut registry,
            "host_tier_budget_bytes",
            "Host tier budget",
            store.budget_bytes,
        );
        gauge(
            &mut registry,
            "host_tier_used_bytes",
            "Host tier bytes held",
            store.used_bytes,
        );
        gauge(
            &mut registry,
            "host_tier_pages",
            "Host tier pages held",
            store.pages,
        );
        counter(
            &mut registry,
            "host_tier_pages_put",
            "Pages stored by peers",
            store.pages_put,
        );
        counter(
            &mut registry,
            "host_tier_hits",
            "Pages served to peers (hits)",
            store.pages_got,
        );
        counter(
            &mut registry,
            "host_tier_misses",
            "Pages asked for and not held (misses)",
            store.pages_missing,
        );
        counter(
            &mut registry,
            "host_tier_puts_refused_full",
            "Puts refused at the budget",
            store.puts_refused_full,
        );
        counter(
            &mut registry,
            "host_tier_checksum_failures",
            "Stored pages that failed their checksum",
            store.checksum_failures,
        );
        gauge(
            &mut registry,
            "remote_capacity_bytes",
            "Bytes this node's clients may place on peers now",
            self.remote.capacity_bytes(),
        );
        counter(
            &mut registry,
            "remote_errors",
            "Failed remote tier operations",
            remote.errors,
        );
        gauge(
            &mut registry,
            "remote_replicas",
            "Holders wanted per page spilled to peers",
            u64::from(remote.replicas),
        );
        gauge(
            &mut registry,
            "remote_under_replicated_bytes",
            "Bytes of copies of this node's pages to make again (a holder died)",
            remote.under_replicated_bytes,
        );
        gauge(
            &mut registry,
            "remote_under_replicated_pages",
            "This node's pages with fewer live copies than replicas",
            remote.under_replicated_pages,
        );
        gauge(
            &mut registry,
            "remote_lost_pages",
            "This node's pages with no live copy left",
            remote.lost_pages,
        );
        counter(
            &mut registry,
            "remote_repaired_bytes",
            "Bytes copied to new holders by re-replication",
            remote.repaired_bytes,
        );
        counter(
            &mut registry,
            "remote_repaired_pages",
            "Page copies made by re-replication",
            remote.repaired_pages,
        );
        counter(
            &mut registry,
            "remote_repair_errors",
            "Re-replication batches that failed (retried)",
            remote.repair_errors,
        );
        counter(
            &mut registry,
            "remote_fetch_failovers",
            "Pages read from a further holder after a nearer one failed",
            remote.fetch_failovers,
        );
        counter(
            &mut registry,
            "remote_short_copies",
            "Copies spills could not place for want of distinct peers",
            remote.short_copies,
        );
        gauge(
            &mut registry,
            "clients",
            "Local clients connected now",
            self.clients.load(Ordering::Relaxed),
        );
        counter(
            &mut registry,
            "peer_requests_refused",
            "Raft messages or proposals refused after decoding",
            self.service.peer_requests_refused.load(Ordering::Relaxed),
        );
        let members: Family<Vec<(String, String)>, Gauge<i64>> = Family::default();
        for m in &view.members {
            let id = m.id.0.to_string();
            for (what, v) in [
                ("capacity", m.capacity_bytes),
                ("used", m.used_bytes),
                ("reserved", m.reserved_bytes),
            ] {
                members
                    .get_or_create(&vec![
                        ("member".into(), id.clone()),
                        ("kind".into(), what.into()),
                    ])
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            }
        }
        registry.register(
            "member_bytes",
            "Members' capacity, used and reserved bytes",
            members,
        );
        let peer_bytes: Family<Vec<(String, String)>, Counter<u64>> = Family::default();
        let frames: Family<Vec<(String, String)>, Counter<u64>> = Family::default();
        for (peer, c) in self.transport.stats().peers() {
            let p = peer.0.to_string();
            for (dir, bytes) in [("in", c.bytes_in), ("out", c.bytes_out)] {
                let labels = vec![("peer".into(), p.clone()), ("direction".into(), dir.into())];
                peer_bytes.get_or_create(&labels).inc_by(bytes);
            }
            frames
                .get_or_create(&vec![("peer".into(), p)])
                .inc_by(c.frames_rejected);
        }
        registry.register(
            "peer_bytes",
            "Frame bytes moved per peer and direction",
            peer_bytes,
        );
        registry.register(
            "peer_frames_rejected",
            "Frames that failed the wire checks, per peer",
            frames,
        );
        let remote_bytes: Family<Vec<(String, String)>, Counter<u64>> = Family::default();
        let remote_pages: Family<Vec<(String, String)>, Counter<u64>> = Family::default();
        for (peer, c) in &remote.per_peer {
            let p = peer.0.to_string();
            for (dir, bytes, pages) in [
                ("spilled", c.bytes_spilled, c.pages_spilled),
                ("fetched", c.bytes_fetched, c.pages_fetched),
            ] {
                let labels = vec![("peer".into(), p.clone()), ("direction".into(), dir.into())];
                remote_bytes.get_or_create(&labels).inc_by(bytes);
                remote_pages.get_or_create(&labels).inc_by(pages);
            }
        }
        registry.register(
            "remote_bytes",
            "Page bytes of this node's clients moved per peer",
            remote_bytes,
        );
        registry.register(
            "remote_pages",
            "Pages of this node's clients moved per peer",
            remote_pages,
        );
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &registry);
        out
    }
}

/// Binds `addr` and serves the documents of `sources` on `tasks` until `cancel`.
pub(crate) async fn serve(
    addr: SocketAddr,
    sources: StatusSources,
    cancel: CancellationToken,
    tasks: TaskTracker,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tasks.clone().spawn(accept_loop(
        listener,
        Limits::NODE,
        cancel,
        tasks,
        move |head: &[u8]| route(head, &sources, bound),
    ));
    Ok(bound)
}

/// Accepts connections until `cancel`, each answered by its own task (on `tasks`) with
/// `route`. Never waits for a connection to finish: past `limits.connections_max`, or
/// when file descriptors run out, the oldest held connection is closed instead.
async fn accept_loop<R>(
    listener: TcpListener,
    limits: Limits,
    cancel: CancellationToken,
    tasks: TaskTracker,
    route: R,
) where
    R: Fn(&[u8]) -> Reply + Clone + Send + Sync + 'static,
{
    // The held connections, oldest first: each task cancels its token when it ends, so a
    // cancelled token is a finished connection and cancelling a live one closes it.
    let mut held: VecDeque<CancellationToken> = VecDeque::new();
    let mut evicted = 0u64;
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                let out_of_fds = matches!(
                    rustix::io::Errno::from_io_error(&e),
                    Some(rustix::io::Errno::MFILE | rustix::io::Errno::NFILE)
                );
                held.retain(|c| !c.is_cancelled());
                if out_of_fds && let Some(oldest) = held.pop_front() {
                    // The kernel keeps the new connection in the backlog: free a
                    // descriptor for it and accept again at once.
                    oldest.cancel();
                    evicted += 1;
                    tracing::debug!(
                        error = %e,
                        evicted,
                        "metrics accept: out of file descriptors, closed the oldest connection"
                    );
                } else {
                    tracing::debug!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                continue;
            }
        };
        while held.front().is_some_and(CancellationToken::is_cancelled) {
            held.pop_front();
        }
        if held.len() >= limits.connections_max {
            held.retain(|c| !c.is_cancelled());
        }
        if held.len() >= limits.connections_max
            && let Some(oldest) = held.pop_front()
        {
            oldest.cancel();
            evicted += 1;
            tracing::debug!(
                evicted,
                limit = limits.connections_max,
                "metrics endpoint full: closed the oldest connection"
            );
        }
        let conn = cancel.child_token();
        held.push_back(conn.clone());
        let route = route.clone();
        tasks.spawn(async move {
            let _ended = conn.clone().drop_guard();
            tokio::select! {
                _ = conn.cancelled() => {}
                _ = answer(stream, limits, &route) => {}
            }
        });
    }
}

/// Reads one request head (bounded in size and time) and answers it (bounded in time).
async fn answer(mut stream: TcpStream, limits: Limits, route: &impl Fn(&[u8]) -> Reply) {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(limits.request_timeout, async {
        loop {
            if head.windows(4).any(|w| w == b"\r\n\r\n") {
                return true;
            }
            if head.len() >= REQUEST_BYTES_MAX {
                return false;
            }
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n.min(REQUEST_BYTES_MAX - head.len())]),
            }
        }
    })
    .await;
    let (status, content_type, body) = match read {
        Ok(true) => route(&head),
        _ => (400, "text/plain", "bad request\n".to_string()),
    };
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Bad Request",
    };
    let mut response = String::with_capacity(body.len() + 128);
    let _ = write!(
        response,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    response.push_str(&body);
    let _ = tokio::time::timeout(limits.response_timeout, async {
        let _ = stream.write_all(response.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

fn route(head: &[u8], sources: &StatusSources, bound: SocketAddr) -> Reply {
    let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let (Some(method), Some(target), Some(version)) = (method, target, version) else {
        return (400, "text/plain", "bad request\n".into());
    };
    if !version.starts_with("HTTP/1.") {
        return (400, "text/plain", "bad request\n".into());
    }
    if method != "GET" {
        return (405, "text/plain", "only GET\n".into());
    }
    let path = target.split('?').next().unwrap_or_default();
    match path {
        "/metrics" => (
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            sources.metrics(),
        ),
        "/status" => (
            200,
            "application/json",
            serde_json::to_string(&sources.status(bound)).unwrap_or_else(|_| "{}".into()),
        ),
        "/placements" => (
            200,
            "application/json",
            serde_json::to_string(&sources.placements()).unwrap_or_else(|_| "{}".into()),
        ),
        _ => (404, "text/plain", "not found\n".into()),
    }
}

/// `/placements`: which buffers of this node's clients have a copy of a page on each
/// holder, so a test (or an operator) knows what a holder's death takes.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct PlacementsView {
    /// This node.
    pub node_id: u64,
    /// Client (connection number on this node) to holder node id to buffer ids.
    pub clients: BTreeMap<u32, BTreeMap<u64, Vec<u64>>>,
    /// More entries than the view lists were left out.
    pub truncated: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A responder of `limits` on loopback answering every request `ok`.
    async fn start(limits: Limits) -> (SocketAddr, CancellationToken, TaskTracker) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(accept_loop(
            listener,
            limits,
            cancel.clone(),
            tasks.clone(),
            |_: &[u8]| (200, "text/plain", "ok\n".to_string()),
        ));
        (addr, cancel, tasks)
    }

    async fn stop(cancel: CancellationToken, tasks: TaskTracker) {
        cancel.cancel();
        tasks.close();
        tokio::time::timeout(Duration::from_secs(5), tasks.wait())
            .await
            .expect("every connection task ends on cancel");
    }

    /// A connection that sent part of a request head and waits.
    async fn slow(addr: SocketAddr) -> TcpStream {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /status HTTP/1.1\r\n").await.unwrap();
        s
    }

    async fn get(addr: SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /status HTTP/1.1\r\n\r\n").await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    /// Whether the server closed `s` (end of stream, or a reset when it closed with our
    /// bytes unread) within `wait`.
    async fn closed_within(s: &mut TcpStream, wait: Duration) -> Option<Vec<u8>> {
        let mut got = Vec::new();
        match tokio::time::timeout(wait, s.read_to_end(&mut got)).await {
            Ok(_) => Some(got),
            Err(_) => None,
        }
    }

    #[tokio::test]
    async fn past_the_limit_the_oldest_connections_close_and_a_fresh_request_is_answered() {
        let limits = Limits {
            connections_max: 4,
            request_timeout: Duration::from_secs(60),
            response_timeout: Duration::from_secs(5),
        };
        let (addr, cancel, tasks) = start(limits).await;
        let mut held = Vec::new();
        for _ in 0..10 {
            held.push(slow(addr).await);
        }
        let reply = tokio::time::timeout(Duration::from_secs(2), get(addr))
            .await
            .expect("a fresh request is answered while the slow ones are held");
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        assert!(reply.ends_with("\r\n\r\nok\n"), "{reply}");
        // Accepted in order: the fresh request closed the 7th, the 5th to 10th closed the
        // 1st to 6th; the newest three are still held, unanswered.
        for (i, s) in held.iter_mut().enumerate() {
            let closed =
                closed_within(s, Duration::from_millis(if i < 7 { 2000 } else { 100 })).await;
            if i < 7 {
                let got = closed.unwrap_or_else(|| panic!("connection {i} is still held"));
                assert!(got.is_empty(), "connection {i} got an answer");
            } else {
                assert!(closed.is_none(), "connection {i} was closed");
            }
        }
        stop(cancel, tasks).await;
    }

    #[tokio::test]
    async fn a_head_that_does_not_come_in_time_is_answered_400_and_closed() {
        let limits = Limits {
            connections_max: 4,
            request_timeout: Duration::from_millis(100),
            response_timeout: Duration::from_secs(5),
        };
        let (addr, cancel, tasks) = start(limits).await;
        let mut s = slow(addr).await;
        let got = closed_within(&mut s, Duration::from_secs(5))
            .await
            .expect("closed after the request timeout");
        let got = String::from_utf8(got).unwrap();
        assert!(got.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{got}");
        stop(cancel, tasks).await;
    }
}
