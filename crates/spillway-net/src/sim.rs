//! The in-memory twin of the QUIC transport, for tests: same traits, same frames, no sockets.
//!
//! A [`SimNetwork`] is a registry of simulated nodes by address. A request goes through
//! the one round trip every transport runs (`exchange::round_trip`: encode, size and
//! in-flight budgets, decode with the wire limits, kind check); only its carrier differs:
//! the request frame, in one buffer, is handed to the peer's service in the caller's task,
//! which serves it through `exchange::serve_whole` (as UCX does) and hands the reply frame
//! back. So the logic tested here is the logic that runs over QUIC and UCX; only the bytes
//! do not leave the process.
//!
//! What is modelled: mutual TLS by pool id (a node of another pool is refused at connect,
//! like a certificate of another CA); a bad frame closes its connection and is counted;
//! per-peer counters and in-flight budgets; a node can be taken down
//! ([`SimNetwork::set_down`]), which fails connects and in-flight requests.
//! Seeded ([`SimNetwork::seeded`]): each request waits a number of yields drawn from the
//! seed before it is delivered, and every delivery is logged ([`SimNetwork::deliveries`],
//! [`SimNetwork::traffic_hash`]). Not modelled: latency in time, loss. Not deterministic:
//! the tokio runtime's own scheduling, and whatever runs on other threads (a node's Raft
//! thread), so the seed chooses the workload's interleaving only as far as those let it.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use spillway_types::wire::{self, Message, WireError};
use spillway_types::{NodeId, PoolId};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::exchange::{self, Carrier, CarryError, Link, Local, Outgoing, Received};
use crate::{Handler, NetError, NetStats, QuicConfig, Server, Transport};

type ServeFuture = Pin<Box<dyn Future<Output = Result<Bytes, WireError>> + Send>>;
/// A served node: takes (peer, request frame) and returns the reply frame, or the wire
/// error that made it close the connection.
type Service = Arc<dyn Fn(NodeId, Bytes) -> ServeFuture + Send + Sync>;

struct SimNode {
    local: Arc<Local>,
    service: Option<(Service, CancellationToken)>,
    down: bool,
}

/// A simulated network: nodes by address.
#[derive(Clone, Default)]
pub struct SimNetwork {
    nodes: Arc<Mutex<HashMap<SocketAddr, SimNode>>>,
    next_port: Arc<AtomicU64>,
    schedule: Arc<Mutex<Schedule>>,
}

/// The seeded part of a simulated network: how long each request waits before it is
/// delivered (in yields to the runtime), and the log of what was delivered.
#[derive(Debug, Default)]
struct Schedule {
    /// splitmix64 state; `None`: deliver at once.
    rng: Option<u64>,
    /// Every request delivered: (from, to, frame kind, xxh3 of the frame past its header).
    log: Vec<Delivery>,
}

/// One request delivered by a [`SimNetwork`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Delivery {
    /// The sender.
    pub from: NodeId,
    /// The receiver.
    pub to: NodeId,
    /// The frame's kind (its header's byte).
    pub kind: u8,
    /// xxh3-64 of the frame's body and payload (the header, which carries the request id,
    /// is left out: ids depend on how concurrent requests interleave).
    pub body_hash: u64,
}

/// Longest wait of a request in a seeded network: 7 yields to the runtime.
const DELIVERY_YIELDS_MAX: u64 = 7;

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl std::fmt::Debug for SimNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimNetwork").finish_non_exhaustive()
    }
}

impl SimNetwork {
    /// An empty network.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty network whose requests wait a number of yields to the runtime drawn from
    /// `seed` (0 to [`DELIVERY_YIELDS_MAX`]) before they are delivered: the seed chooses
    /// how concurrent requests interleave, as far as the runtime's own scheduling lets it.
    pub fn seeded(seed: u64) -> Self {
        let net = Self::default();
        net.schedule().rng = Some(seed);
        net
    }

    /// Every request delivered so far, in delivery order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.schedule().log.clone()
    }

    /// A hash of the requests of `kinds` delivered so far, as a multiset (independent of
    /// their order): equal for two runs that moved the same frames between the same
    /// nodes, whatever the interleaving.
    pub fn traffic_hash(&self, kinds: &[spillway_types::wire::Kind]) -> u64 {
        let mut log: Vec<Delivery> = self
            .schedule()
            .log
            .iter()
            .filter(|d| kinds.iter().any(|k| *k as u8 == d.kind))
            .copied()
            .collect();
        log.sort_unstable();
        let mut bytes = Vec::with_capacity(log.len() * 25);
        for d in log {
            bytes.extend_from_slice(&d.from.0.to_le_bytes());
            bytes.extend_from_slice(&d.to.0.to_le_bytes());
            bytes.push(d.kind);
            bytes.extend_from_slice(&d.body_hash.to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }

    fn schedule(&self) -> std::sync::MutexGuard<'_, Schedule> {
        self.schedule.lock().expect("sim schedule lock")
    }

    /// Logs a request frame from `from` to `to` and returns how many yields it waits.
    fn deliver(&self, from: NodeId, to: NodeId, frame: &[u8]) -> u64 {
        let mut schedule = self.schedule();
        let kind = frame.get(wire_kind_offset()).copied().unwrap_or(0);
        let body = frame.get(wire::HEADER_BYTES..).unwrap_or(&[]);
        schedule.log.push(Delivery {
            from,
            to,
            kind,
            body_hash: xxhash_rust::xxh3::xxh3_64(body),
        });
        match &mut schedule.rng {
            Some(state) => splitmix64(state) % (DELIVERY_YIELDS_MAX + 1),
            None => 0,
        }
    }

    /// A new node of `pool_id` named `node_id`, at a fresh address (`127.0.0.1:<n>`, a
    /// name only: nothing is bound). `config` supplies the in-flight budget.
    pub fn transport(&self, pool_id: PoolId, node_id: NodeId, config: &QuicConfig) -> SimTransport {
        let port = 10_000 + self.next_port.fetch_add(1, Ordering::Relaxed) as u16;
        let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
        let local = Arc::new(Local::new(pool_id, node_id, config));
        self.lock().insert(
            addr,
            SimNode {
                local: local.clone(),
                service: None,
                down: false,
            },
        );
        SimTransport {
            network: self.clone(),
            addr,
            local,
        }
    }

    /// Takes the node at `addr` down (connects and requests to it fail) or brings it back.
    pub fn set_down(&self, addr: SocketAddr, down: bool) {
        if let Some(node) = self.lock().get_mut(&addr) {
            node.down = down;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, SimNode>> {
        self.nodes.lock().expect("sim network lock poisoned")
    }

    /// The node at `addr`, if it is up and serving.
    fn target(&self, addr: SocketAddr) -> Result<Target, Unreachable> {
        let nodes = self.lock();
        let node = nodes.get(&addr).ok_or(Unreachable::NoNode)?;
        if node.down {
            return Err(Unreachable::Down);
        }
        match &node.service {
            Some((service, cancel)) if !cancel.is_cancelled() => Ok(Target {
                service: service.clone(),
                local: node.local.clone(),
            }),
            _ => Err(Unreachable::NotServing),
        }
    }
}

/// Why a simulated node cannot be reached.
#[derive(Clone, Copy, Debug, thiserror::Error)]
enum Unreachable {
    #[error("no node at this address")]
    NoNode,
    #[error("node is down")]
    Down,
    #[error("node is not serving")]
    NotServing,
}

/// A node reached through the network.
struct Target {
    service: Service,
    local: Arc<Local>,
}

/// One simulated node's transport.
#[derive(Debug)]
pub struct SimTransport {
    network: SimNetwork,
    addr: SocketAddr,
    local: Arc<Local>,
}

/// `node`'s hello frame, encoded and decoded as over the wire so that its checks run too.
fn hello_frame(node: &Local) -> Result<Bytes, WireError> {
    let frame = Bytes::from(wire::encode_frame(0, &Message::Hello(node.hello()))?);
    exchange::decode_whole(&frame)?;
    Ok(frame)
}

impl Transport for SimTransport {
    type Connection = SimConnection;

    fn node_id(&self) -> NodeId {
        self.local.node_id
    }

    fn pool_id(&self) -> PoolId {
        self.local.pool_id
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    async fn connect(&self, addr: SocketAddr) -> Result<SimConnection, NetError> {
        let target = self.network.target(addr).map_err(|e| NetError::Connect {
            addr,
            reason: e.to_string(),
        })?;
        if target.local.pool_id != self.local.pool_id {
            // What mutual TLS does to a certificate of another CA: both sides refuse.
            target.local.stats.handshake_refused();
            return Err(NetError::Connect {
                addr,
                reason: "TLS handshake: peer certificate not signed by the pool's CA".to_string(),
            });
        }
        // The hello exchange, as frames, so that its encoding and checks run too.
        let hellos =
            hello_frame(&self.local).and_then(|ours| Ok((ours, hello_frame(&target.local)?)));
        let (ours, theirs) = hellos.map_err(|source| NetError::BadFrame { peer: None, source })?;
        target.local.stats.connection_accepted();
        let server_side = target.local.stats.peer_state(self.local.node_id);
        server_side.add_in(ours.len() as u64);
        server_side.add_out(theirs.len() as u64);
        let link = self.local.link(target.local.node_id);
        link.state.add_out(ours.len() as u64);
        link.state.add_in(theirs.len() as u64);
        Ok(SimConnection {
            inner: Arc::new(SimConnInner {
                network: self.network.clone(),
                addr,
                me: self.local.node_id,
                link,
            }),
        })
    }

    fn serve<H: Handler>(&self, handler: Arc<H>) -> Result<Server, NetError> {
        self.local.start_serving()?;
        let cancel = CancellationToken::new();
        let local = self.local.clone();
        let service: Service = Arc::new(move |peer: NodeId, frame: Bytes| {
            let handler = handler.clone();
            let local = local.clone();
            Box::pin(async move {
                let (_, parts) = exchange::serve_whole(&*handler, &local, peer, &frame).await?;
                Ok(exchange::concat(&parts))
            }) as ServeFuture
        });
        if let Some(node) = self.network.lock().get_mut(&self.addr) {
            node.service = Some((service, cancel.clone()));
        }
        Ok(Server::new(cancel, TaskTracker::new()))
    }

    fn stats(&self) -> &Arc<NetStats> {
        &self.local.stats
    }
}

struct SimConnInner {
    network: SimNetwork,
    addr: SocketAddr,
    me: NodeId,
    link: Link,
}

/// A simulated connection to one peer.
#[derive(Clone)]
pub struct SimConnection {
    inner: Arc<SimConnInner>,
}

impl std::fmt::Debug for SimConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimConnection")
            .field("peer", &self.inner.link.peer)
            .field("addr", &self.inner.addr)
            .finish()
    }
}

impl SimConnection {
    /// Sends `frame` as raw bytes, as a broken or hostile peer would, and returns the raw
    /// reply frame. A frame the peer refuses closes this connection, as over QUIC.
    pub async fn send_raw(&self, frame: Bytes) -> Result<Bytes, NetError> {
        self.inner.link.state.add_out(frame.len() as u64);
        self.send(frame).await
    }

    /// Hands `frame` to the peer's service and returns its reply frame.
    async fn send(&self, frame: Bytes) -> Result<Bytes, NetError> {
        let inner = &*self.inner;
        if inner.link.is_closed() {
            return Err(inner.link.lost("connection closed"));
        }
        let target = inner
            .network
            .target(inner.addr)
            .map_err(|r| inner.link.lost(r.to_string()))?;
        let waits = inner.network.deliver(inner.me, inner.link.peer, &frame);
        for _ in 0..waits {
            tokio::task::yield_now().await;
        }
        match (target.service)(inner.me, frame).await {
            Ok(reply) => Ok(reply),
            Err(e) => {
                inner.link.close();
                Err(inner.link.lost(format!("closed by peer: bad frame: {e}")))
            }
        }
    }
}

impl Carrier for SimConnection {
    fn link(&self) -> &Link {
        &self.inner.link
    }

    async fn carry(
        &self,
        request: Outgoing,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<Received, CarryError> {
        let reply = self.send(exchange::concat(&request.parts)).await;
        drop(permit);
        reply.map(Received::Whole).map_err(CarryError::Lost)
    }
}

exchange::connection_over_carrier!(SimConnection);

/// Where a frame header keeps its kind byte (found by encoding one, so that no layout is
/// assumed here).
fn wire_kind_offset() -> usize {
    static OFFSET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *OFFSET.get_or_init(|| {
        let header = |kind| {
            wire::FrameHeader {
                kind,
                request_id: 0,
                body_bytes: 0,
                payload_bytes: 0,
            }
            .encode()
        };
        let (a, b) = (header(wire::Kind::PutPages), header(wire::Kind::GetPages));
        (0..wire::HEADER_BYTES)
            .find(|&i| a[i] != b[i])
            .expect("kinds differ in the header")
    })
}
