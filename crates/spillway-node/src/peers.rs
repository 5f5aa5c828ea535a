//! The node's connections to its peers, for all traffic (Raft messages, forwarded
//! proposals, pages): one cached QUIC connection per peer, opened on first use and
//! reconnected with exponential backoff ([`RECONNECT_BACKOFF_MIN`] to
//! [`RECONNECT_BACKOFF_MAX`]); while a peer is in backoff, requests to it fail at once
//! instead of piling up, and [`Peers::reachable`] leaves it out of placements for
//! [`UNREACHABLE_FOR`]. With `transport = "ucx"` (feature `ucx`), page requests go over
//! UCX connections that `ucx_pages` introduces over these QUIC connections.
//!
//! The transport is erased once, here ([`PeerTransport`], [`PeerConnection`]): any
//! `spillway_net::Transport` works (QUIC in production, the simulated transport in the
//! whole-node tests), and the rooms above (Raft, the remote tier, the status pages) are
//! written once for all of them. The cost is one boxed future per request.
//!
//! Lock order: the slot map's mutex only to find a slot; one slot's async mutex across
//! its connect; the address map's lock never across an await.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use spillway_net::{Connection, NetError, NetStats, Request, Response, Transport};
use spillway_types::{NodeId, PoolId};

/// Time a connection attempt to a peer may take: 1 s (a dead peer on loopback would
/// otherwise hold it for the whole QUIC idle timeout).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// First wait before reconnecting to a peer that failed: 50 ms; doubles per failure.
pub const RECONNECT_BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest wait before reconnecting: 1 s.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// A boxed future that can cross threads (what an erased transport returns).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One node's end of the network as the node uses it: a `spillway_net::Transport`, erased
/// (every `Transport` is one).
pub trait PeerTransport: Send + Sync + 'static {
    /// This node.
    fn node_id(&self) -> NodeId;
    /// This node's pool.
    fn pool_id(&self) -> PoolId;
    /// Where peers reach this node.
    fn local_addr(&self) -> SocketAddr;
    /// Counters per peer.
    fn stats(&self) -> &Arc<NetStats>;
    /// Connects to the node at `addr` (see `Transport::connect`).
    fn connect_erased(
        &self,
        addr: SocketAddr,
    ) -> BoxFuture<'_, Result<Arc<dyn PeerConnection>, NetError>>;
    /// Closes every connection and waits until peers were told (see `Transport::close`).
    fn close_erased(&self) -> BoxFuture<'_, ()>;
}

impl<T: Transport> PeerTransport for T {
    fn node_id(&self) -> NodeId {
        Transport::node_id(self)
    }

    fn pool_id(&self) -> PoolId {
        Transport::pool_id(self)
    }

    fn local_addr(&self) -> SocketAddr {
        Transport::local_addr(self)
    }

    fn stats(&self) -> &Arc<NetStats> {
        Transport::stats(self)
    }

    fn connect_erased(
        &self,
        addr: SocketAddr,
    ) -> BoxFuture<'_, Result<Arc<dyn PeerConnection>, NetError>> {
        Box::pin(async move {
            let conn = self.connect(addr).await?;
            Ok(Arc::new(conn) as Arc<dyn PeerConnection>)
        })
    }

    fn close_erased(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.close())
    }
}

impl std::fmt::Debug for dyn PeerTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTransport")
            .field("node_id", &self.node_id())
            .field("local_addr", &self.local_addr())
            .finish()
    }
}

/// A connection to one peer, erased (every `spillway_net::Connection` is one).
pub trait PeerConnection: Send + Sync + 'static {
    /// The peer.
    fn peer(&self) -> NodeId;
    /// Whether it may still carry requests.
    fn is_open(&self) -> bool;
    /// Sends `request` and waits for the reply.
    fn request_erased(&self, request: Request) -> BoxFuture<'_, Result<Response, NetError>>;
}

impl<C: Connection> PeerConnection for C {
    fn peer(&self) -> NodeId {
        Connection::peer(self)
    }

    fn is_open(&self) -> bool {
        Connection::is_open(self)
    }

    fn request_erased(&self, request: Request) -> BoxFuture<'_, Result<Response, NetError>> {
        Box::pin(self.request(request))
    }
}

impl std::fmt::Debug for dyn PeerConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerConnection")
            .field("peer", &self.peer())
            .field("open", &self.is_open())
            .finish()
    }
}

/// The connections of this node to its peers (see the module docs).
#[derive(Debug)]
pub struct Peers {
    transport: Arc<dyn PeerTransport>,
    addrs: RwLock<HashMap<NodeId, SocketAddr>>,
    slots: Mutex<HashMap<NodeId, Arc<tokio::sync::Mutex<Slot>>>>,
    /// Page requests over UCX (`transport = "ucx"`), introduced over the QUIC connections.
    #[cfg(feature = "ucx")]
    ucx: Option<crate::ucx_pages::UcxPages>,
}

#[derive(Debug, Default)]
struct Slot {
    conn: Option<Arc<dyn PeerConnection>>,
    retry_at: Option<Instant>,
    backoff: Duration,
    /// The last failure since the last success.
    failed_at: Option<Instant>,
}

/// A peer that failed within this long (and has not answered since) is left out of
/// placements: 2 s.
pub const UNREACHABLE_FOR: Duration = Duration::from_secs(2);

impl Peers {
    pub(crate) fn new(
        transport: Arc<dyn PeerTransport>,
        addrs: HashMap<NodeId, SocketAddr>,
    ) -> Self {
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
    pub(crate) async fn connection(
        &self,
        peer: NodeId,
    ) -> Result<Arc<dyn PeerConnection>, NetError> {
        let addr = self.addr(peer).ok_or_else(|| NetError::Connect {
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            reason: format!("{peer} has no known address"),
        })?;
        let slot = self.slot(peer);
        let mut slot = slot.lock().await;
        if let Some(conn) = &slot.conn {
            if conn.is_open() {
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
        let attempt =
            tokio::time::timeout(CONNECT_TIMEOUT, self.transport.connect_erased(addr)).await;
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
            let result = ucx
                .request(peer, request, |r| self.quic_request(peer, r))
                .await;
            if let Err(e) = &result
                && e.connection_failed()
            {
                self.failed(peer);
            }
            return result;
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
        match conn.request_erased(request).await {
            Ok(r) => Ok(r),
            Err(e) => {
                if e.connection_failed() {
                    self.failed(peer);
                }
                Err(e)
            }
        }
    }
}
