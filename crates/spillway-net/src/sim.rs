//! The in-memory twin of the QUIC transport, for tests: same traits, same frames, no sockets.
//!
//! A [`SimNetwork`] is a registry of simulated nodes by address. Every request is encoded
//! into one frame buffer with `spillway_types::wire`, decoded on the other side with the
//! same limits and checksum checks as over QUIC, handed to the [`Handler`] in the caller's
//! task, and the reply goes back the same way. So the logic tested here is the logic that
//! runs over QUIC; only the bytes do not leave the process.
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

use bytes::{Bytes, BytesMut};
use spillway_types::wire::{self, Hello, Message, PROTOCOL_VERSION, WireError};
use spillway_types::{NodeId, PoolId};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::permits_for;
use crate::stats::PeerState;
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
    fn target(&self, addr: SocketAddr) -> Result<Target, String> {
        let nodes = self.lock();
        let node = nodes.get(&addr).ok_or("no node at this address")?;
        if node.down {
            return Err("node is down".to_string());
        }
        match &node.service {
            Some((service, cancel)) if !cancel.is_cancelled() => Ok(Target {
                service: service.clone(),
                pool_id: node.pool_id,
                node_id: node.node_id,
                stats: node.stats.clone(),
            }),
            _ => Err("node is not serving".to_string()),
        }
    }
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

/// The frame of `message` with its pages appended, in one buffer.
fn frame_bytes(request_id: u64, message: &Message, pages: &[Bytes]) -> Result<Bytes, WireError> {
    let head = wire::encode_frame(request_id, message)?;
    let mut buf = BytesMut::with_capacity(head.len() + pages.iter().map(Bytes::len).sum::<usize>());
    buf.extend_from_slice(&head);
    for p in pages {
        buf.extend_from_slice(p);
    }
    Ok(buf.freeze())
}

/// Decodes a frame buffer; the payload comes back as a slice of it (no copy).
fn decode(buf: &Bytes) -> Result<(Message, Bytes), WireError> {
    let (frame, used) = wire::decode_frame(buf)?;
    let payload_at = used - frame.payload.len();
    Ok((frame.message, buf.slice(payload_at..used)))
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
        let target = self
            .network
            .target(addr)
            .map_err(|reason| NetError::Connect { addr, reason })?;
        if target.pool_id != self.pool_id {
            // What mutual TLS does to a certificate of another CA: both sides refuse.
            target.stats.handshake_refused();
            return Err(NetError::Connect {
                addr,
                reason: "TLS handshake: peer certificate not signed by the pool's CA".to_string(),
            });
        }
        // The hello exchange, as frames, so that its encoding and checks run too.
        let hello = |pool_id, node_id| {
            frame_bytes(
                0,
                &Message::Hello(Hello {
                    pool_id,
                    node_id,
                    protocol_version: PROTOCOL_VERSION,
                }),
                &[],
            )
            .expect("a hello encodes")
        };
        let ours = hello(self.pool_id, self.node_id);
        let theirs = hello(target.pool_id, target.node_id);
        for frame in [&ours, &theirs] {
            decode(frame).map_err(|source| NetError::BadFrame { peer: None, source })?;
        }
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
                peer: target.node_id,
                state,
                budget_permits: self.budget_permits,
                closed: AtomicBool::new(false),
                next_request_id: AtomicU64::new(1),
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
                let (message, payload) = match decode(&frame) {
                    Ok(v) => v,
                    Err(e) => {
                        state.reject();
                        return Err(e);
                    }
                };
                let permit = if payload.is_empty() {
                    None
                } else {
                    Some(
                        state
                            .inbound
                            .clone()
                            .acquire_many_owned(permits_for(payload.len() as u64, budget_permits))
                            .await
                            .expect("in-flight budgets are never closed"),
                    )
                };
                state.add_in(frame.len() as u64);
                let request_id =
                    u64::from_le_bytes(frame[8..16].try_into().expect("header checked"));
                let response = match Request::from_wire(message, &payload) {
                    Ok(request) => handler.handle(peer, request).await,
                    Err(kind) => Response::Error(wire::ErrorReply::new(
                        wire::ErrorCode::BadRequest,
                        format!("a {kind:?} frame is not a request"),
                    )),
                };
                drop(permit);
                let reply = response
                    .into_wire()
                    .and_then(|(message, pages)| frame_bytes(request_id, &message, &pages))
                    .unwrap_or_else(|e| {
                        let message = Message::Error(wire::ErrorReply::new(
                            wire::ErrorCode::Internal,
                            format!("response cannot be sent: {e}"),
                        ));
                        frame_bytes(request_id, &message, &[]).expect("an error reply encodes")
                    });
                state.add_out(reply.len() as u64);
                Ok(reply)
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
    peer: NodeId,
    state: Arc<PeerState>,
    budget_permits: u32,
    closed: AtomicBool,
    next_request_id: AtomicU64,
}

/// A simulated connection to one peer.
#[derive(Clone)]
pub struct SimConnection {
    inner: Arc<SimConnInner>,
}

impl std::fmt::Debug for SimConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimConnection")
            .field("peer", &self.inner.peer)
            .field("addr", &self.inner.addr)
            .finish()
    }
}

impl SimConnection {
    /// Sends `frame` as raw bytes, as a broken or hostile peer would, and returns the raw
    /// reply frame. A frame the peer refuses closes this connection, as over QUIC.
    pub async fn send_raw(&self, frame: Bytes) -> Result<Bytes, NetError> {
        let inner = &*self.inner;
        if inner.closed.load(Ordering::SeqCst) {
            return Err(self.lost("connection closed"));
        }
        let target = inner.network.target(inner.addr).map_err(|r| self.lost(r))?;
        inner.state.add_out(frame.len() as u64);
        match (target.service)(inner.me, frame).await {
            Ok(reply) => Ok(reply),
            Err(e) => {
                inner.closed.store(true, Ordering::SeqCst);
                Err(self.lost(format!("closed by peer: bad frame: {e}")))
            }
        }
    }

    fn lost(&self, reason: impl Into<String>) -> NetError {
        NetError::ConnectionLost {
            peer: self.inner.peer,
            reason: reason.into(),
        }
    }
}

impl Connection for SimConnection {
    fn peer(&self) -> NodeId {
        self.inner.peer
    }

    async fn request(&self, request: Request) -> Result<Response, NetError> {
        let inner = &*self.inner;
        let peer = inner.peer;
        let kind = request.kind();
        let payload_bytes = request.payload_bytes();
        let (message, pages) = request
            .into_wire()
            .map_err(|source| NetError::Encode { peer, source })?;
        let id = inner.next_request_id.fetch_add(1, Ordering::Relaxed);
        let frame = frame_bytes(id, &message, &pages)
            .map_err(|source| NetError::Encode { peer, source })?;
        drop(pages);
        let permit = if payload_bytes == 0 {
            None
        } else {
            Some(
                inner
                    .state
                    .outbound
                    .clone()
                    .acquire_many_owned(permits_for(payload_bytes, inner.budget_permits))
                    .await
                    .expect("in-flight budgets are never closed"),
            )
        };
        let reply = self.send_raw(frame).await?;
        drop(permit);
        let (message, payload) = match decode(&reply) {
            Ok(v) => v,
            Err(source) => {
                inner.state.reject();
                inner.closed.store(true, Ordering::SeqCst);
                return Err(NetError::BadFrame {
                    peer: Some(peer),
                    source,
                });
            }
        };
        inner.state.add_in(reply.len() as u64);
        if !Response::answers(message.kind(), kind) {
            return Err(NetError::UnexpectedReply {
                peer,
                request: kind,
                reply: message.kind(),
            });
        }
        Response::from_wire(message, &payload).map_err(|reply| NetError::UnexpectedReply {
            peer,
            request: kind,
            reply,
        })
    }
}
