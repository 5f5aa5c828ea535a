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
//! Not modelled: latency, loss, reordering (requests complete in call order per task).

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use spillway_types::wire::{self, Hello, Message, PROTOCOL_VERSION, WireError};
use spillway_types::{NodeId, PoolId};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::exchange::{self, Carrier, CarryError, Link, Outgoing, Received};
use crate::{
    Connection, Handler, NetError, NetStats, QuicConfig, Request, Response, Server, Transport,
};

type ServeFuture = Pin<Box<dyn Future<Output = Result<Bytes, WireError>> + Send>>;
/// A served node: takes (peer, request frame) and returns the reply frame, or the wire
/// error that made it close the connection.
type Service = Arc<dyn Fn(NodeId, Bytes) -> ServeFuture + Send + Sync>;

struct SimNode {
    pool_id: PoolId,
    node_id: NodeId,
    stats: Arc<NetStats>,
    service: Option<(Service, CancellationToken)>,
    down: bool,
}

/// A simulated network: nodes by address.
#[derive(Clone, Default)]
pub struct SimNetwork {
    nodes: Arc<Mutex<HashMap<SocketAddr, SimNode>>>,
    next_port: Arc<AtomicU64>,
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

    /// A new node of `pool_id` named `node_id`, at a fresh address (`127.0.0.1:<n>`, a
    /// name only: nothing is bound). `config` supplies the in-flight budget.
    pub fn transport(&self, pool_id: PoolId, node_id: NodeId, config: &QuicConfig) -> SimTransport {
        let port = 10_000 + self.next_port.fetch_add(1, Ordering::Relaxed) as u16;
        let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
        let stats = Arc::new(NetStats::new(config.peer_permits()));
        self.lock().insert(
            addr,
            SimNode {
                pool_id,
                node_id,
                stats: stats.clone(),
                service: None,
                down: false,
            },
        );
        SimTransport {
            network: self.clone(),
            addr,
            pool_id,
            node_id,
            stats,
            budget_permits: config.peer_permits(),
            serving: AtomicBool::new(false),
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
                pool_id: node.pool_id,
                node_id: node.node_id,
                stats: node.stats.clone(),
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
    pool_id: PoolId,
    node_id: NodeId,
    stats: Arc<NetStats>,
}

/// One simulated node's transport.
#[derive(Debug)]
pub struct SimTransport {
    network: SimNetwork,
    addr: SocketAddr,
    pool_id: PoolId,
    node_id: NodeId,
    stats: Arc<NetStats>,
    budget_permits: u32,
    serving: AtomicBool,
}

/// A hello frame, encoded and decoded as over the wire so that its checks run too.
fn hello_frame(pool_id: PoolId, node_id: NodeId) -> Result<Bytes, WireError> {
    let hello = Message::Hello(Hello {
        pool_id,
        node_id,
        protocol_version: PROTOCOL_VERSION,
    });
    let frame = Bytes::from(wire::encode_frame(0, &hello)?);
    exchange::decode_whole(&frame)?;
    Ok(frame)
}

impl Transport for SimTransport {
    type Connection = SimConnection;

    fn node_id(&self) -> NodeId {
        self.node_id
    }

    fn pool_id(&self) -> PoolId {
        self.pool_id
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    async fn connect(&self, addr: SocketAddr) -> Result<SimConnection, NetError> {
        let target = self.network.target(addr).map_err(|e| NetError::Connect {
            addr,
            reason: e.to_string(),
        })?;
        if target.pool_id != self.pool_id {
            // What mutual TLS does to a certificate of another CA: both sides refuse.
            target.stats.handshake_refused();
            return Err(NetError::Connect {
                addr,
                reason: "TLS handshake: peer certificate not signed by the pool's CA".to_string(),
            });
        }
        // The hello exchange, as frames, so that its encoding and checks run too.
        let hellos = hello_frame(self.pool_id, self.node_id)
            .and_then(|ours| Ok((ours, hello_frame(target.pool_id, target.node_id)?)));
        let (ours, theirs) = hellos.map_err(|source| NetError::BadFrame { peer: None, source })?;
        target.stats.connection_accepted();
        let server_side = target.stats.peer_state(self.node_id);
        server_side.add_in(ours.len() as u64);
        server_side.add_out(theirs.len() as u64);
        let state = self.stats.peer_state(target.node_id);
        state.add_out(ours.len() as u64);
        state.add_in(theirs.len() as u64);
        Ok(SimConnection {
            inner: Arc::new(SimConnInner {
                network: self.network.clone(),
                addr,
                me: self.node_id,
                link: Link::new(target.node_id, state, self.budget_permits),
            }),
        })
    }

    fn serve<H: Handler>(&self, handler: Arc<H>) -> Result<Server, NetError> {
        if self.serving.swap(true, Ordering::SeqCst) {
            return Err(NetError::AlreadyServing);
        }
        let cancel = CancellationToken::new();
        let stats = self.stats.clone();
        let budget_permits = self.budget_permits;
        let service: Service = Arc::new(move |peer: NodeId, frame: Bytes| {
            let handler = handler.clone();
            let stats = stats.clone();
            Box::pin(async move {
                let state = stats.peer_state(peer);
                let (_, parts) =
                    exchange::serve_whole(&*handler, peer, &state, budget_permits, &frame).await?;
                Ok(exchange::concat(&parts))
            }) as ServeFuture
        });
        if let Some(node) = self.network.lock().get_mut(&self.addr) {
            node.service = Some((service, cancel.clone()));
        }
        Ok(Server::new(cancel, TaskTracker::new()))
    }

    fn stats(&self) -> &Arc<NetStats> {
        &self.stats
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

impl Connection for SimConnection {
    fn peer(&self) -> NodeId {
        self.inner.link.peer
    }

    async fn request(&self, request: Request) -> Result<Response, NetError> {
        exchange::round_trip(self, request).await
    }
}
