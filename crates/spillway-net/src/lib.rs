//! The remote tier's transport: how one node moves pages to and from another.
//!
//! Parts:
//! - [`Transport`], [`Connection`] and [`Handler`]: the contract. A node binds one
//!   transport, [`Transport::serve`]s its peer page service through a [`Handler`], and
//!   [`Transport::connect`]s to peers to put, get and delete pages.
//! - [`quic`]: the real transport, QUIC (`quinn`) with mutual TLS (`rustls`, ring): both
//!   sides must hold a certificate of the pool's CA ([`certs`]), which names their node,
//!   tuned as `FACTS.md` measured ([`QuicConfig`]); `tls` builds both sides' TLS and
//!   reads the node a peer's certificate names.
//! - `exchange`: the one request round trip every transport runs (encode, size and
//!   in-flight budgets, decode with the wire limits, id and kind check; the server's
//!   decode, budget and answer); a transport supplies only its `Carrier`, how bytes move.
//! - [`sim`]: the in-memory twin for tests, the same round trip over function calls, seeded
//!   delivery and a delivery log.
//! - [`mem_store`]: a handler that keeps pages in memory (tests, bench, a first host tier).
//!
//! Page throughput over QUIC against raw TCP (`spillway bench remote`) is measured in the
//! `spillway-bench` crate (`bench/src/remote.rs`).
//!
//! Invariants every implementation keeps:
//! - every frame is encoded and decoded by `spillway_types::wire`, with its size limits,
//!   and every page's checksum is computed when it is sent and checked when it arrives;
//! - a frame that fails those checks closes the connection it came on, is counted in
//!   [`PeerCounters::frames_rejected`], and never stops the server serving others;
//! - the payload bytes in flight per peer and direction are bounded
//!   ([`QuicConfig::peer_bytes_in_flight_max`]).
//!
//! Connections carry one request per stream, so requests to one peer proceed in parallel
//! and a slow one does not block the rest. The first stream of a connection carries the
//! [`wire::Hello`](spillway_types::wire::Hello) exchange, which names the peer's node and
//! checks pool id and protocol version. Over QUIC the node a hello names must be the one
//! the peer's certificate names, or the hello is refused; the in-memory twin has no
//! certificates and takes the hello's word.

pub mod certs;
pub mod config;
pub mod join;
pub mod mem_store;
pub mod quic;
pub mod sim;
pub mod stats;
#[cfg(feature = "ucx")]
pub mod ucx;

mod exchange;
mod message;
mod server;
#[cfg(test)]
mod test_dirs;
mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

pub use config::QuicConfig;
pub use mem_store::MemStore;
pub use message::{Page, Request, Response};
pub use server::Server;
use spillway_types::wire::{ErrorCode, Kind, WireError};
use spillway_types::{NodeId, PageId, PoolId};
pub use stats::{NetStats, PeerCounters};

/// Serves the peer page service: answers the requests of one peer at a time (many at once).
///
/// Contract: the transport calls [`Handler::handle`] only with requests whose frames
/// passed every check (limits, checksums), so `pages` hold exactly the bytes the peer
/// sent. The handler MUST answer every request with a [`Response`] of the matching kind
/// or [`Response::Error`]; it may take its time (the peer's other requests proceed), but
/// the payload bytes of the request count against that peer's in-flight budget until it
/// returns. It must not panic on any request: a panic takes down only that stream's task,
/// but the peer then waits for a reply that never comes until its connection times out.
pub trait Handler: Send + Sync + 'static {
    /// Answers `request` from node `peer`.
    fn handle(&self, peer: NodeId, request: Request) -> impl Future<Output = Response> + Send;
}

/// A connection to one peer, as returned by [`Transport::connect`]. Cheap to clone; all
/// clones share the connection and its in-flight budget.
pub trait Connection: Clone + Send + Sync + 'static {
    /// The peer's node id. Over QUIC it is the node the peer's certificate (from the pool's
    /// CA) names, which its hello had to repeat; a caller that dialled an address for a
    /// given node compares it with that node.
    fn peer(&self) -> NodeId;

    /// Whether the connection may still carry requests: false once it was closed (a bad
    /// frame, the peer closed it, every QUIC lane lost). A cache of connections drops one
    /// that is not open and connects again.
    fn is_open(&self) -> bool {
        true
    }

    /// Sends `request` and waits for the reply. A [`Response::Error`] from the peer comes
    /// back as `Ok`; use the typed helpers ([`Connection::put_pages`] ...) to get it as an
    /// error. Dropping the future abandons the request (its stream is reset).
    fn request(&self, request: Request) -> impl Future<Output = Result<Response, NetError>> + Send;

    /// Stores `pages` on the peer; returns how many it stored.
    fn put_pages(&self, pages: Vec<Page>) -> impl Future<Output = Result<u32, NetError>> + Send {
        async move {
            match self.request(Request::Put { pages }).await? {
                Response::Put { pages_stored } => Ok(pages_stored),
                other => Err(unexpected_reply(self.peer(), Kind::PutPages, other)),
            }
        }
    }

    /// Fetches `pages` from the peer: the pages it holds (checksums verified) and the ids
    /// of those it does not.
    fn get_pages(
        &self,
        pages: Vec<PageId>,
    ) -> impl Future<Output = Result<(Vec<Page>, Vec<PageId>), NetError>> + Send {
        async move {
            match self.request(Request::Get { pages }).await? {
                Response::Get { pages, missing } => Ok((pages, missing)),
                other => Err(unexpected_reply(self.peer(), Kind::GetPages, other)),
            }
        }
    }

    /// Drops `pages` on the peer; returns (deleted, missing).
    fn delete_pages(
        &self,
        pages: Vec<PageId>,
    ) -> impl Future<Output = Result<(u32, u32), NetError>> + Send {
        async move {
            match self.request(Request::Delete { pages }).await? {
                Response::Delete {
                    pages_deleted,
                    pages_missing,
                } => Ok((pages_deleted, pages_missing)),
                other => Err(unexpected_reply(self.peer(), Kind::DeletePages, other)),
            }
        }
    }
}

/// One node's end of the network: connects to peers and serves them.
pub trait Transport: Send + Sync + 'static {
    /// A connection to one peer.
    type Connection: Connection;

    /// This node.
    fn node_id(&self) -> NodeId;

    /// This node's pool.
    fn pool_id(&self) -> PoolId;

    /// The address peers reach this node at.
    fn local_addr(&self) -> SocketAddr;

    /// Connects to the node at `addr` and exchanges hellos. Fails if the peer is not of
    /// this pool (certificate or pool id), speaks another protocol version, or (QUIC) names
    /// another node in its hello than in its certificate.
    fn connect(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = Result<Self::Connection, NetError>> + Send;

    /// Starts serving peers through `handler`, until [`Server::shutdown`]. At most one
    /// server per transport.
    fn serve<H: Handler>(&self, handler: Arc<H>) -> Result<Server, NetError>;

    /// Counters per peer.
    fn stats(&self) -> &Arc<NetStats>;

    /// Closes every connection of this transport and waits until the peers were told
    /// (QUIC); the default has nothing to close.
    fn close(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// Everything that can go wrong moving pages.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A peer sent a frame that failed the wire checks; its connection was closed.
    #[error("bad frame from {}: {source}", peer_name(*.peer))]
    BadFrame {
        /// The peer, if it had said who it is.
        peer: Option<NodeId>,
        /// What was wrong.
        #[source]
        source: WireError,
    },
    /// We could not build a frame (too many pages, a page or payload too large).
    #[error("cannot send to {peer}: {source}")]
    Encode {
        /// The peer.
        peer: NodeId,
        /// Which limit the request breaks.
        #[source]
        source: WireError,
    },
    /// No connection to `addr` could be made (unreachable, refused by TLS, wrong pool).
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// Where we tried.
        addr: SocketAddr,
        /// Why it failed.
        reason: String,
    },
    /// The peer belongs to another pool.
    #[error("peer {peer} at {addr} belongs to {found}, not {expected}")]
    PoolMismatch {
        /// Where the peer is.
        addr: SocketAddr,
        /// Who it says it is.
        peer: NodeId,
        /// Our pool.
        expected: PoolId,
        /// Its pool.
        found: PoolId,
    },
    /// The peer's hello names another node than its certificate does (or its certificate
    /// names none); the connection was closed.
    #[error(
        "the peer at {addr} says it is {claimed} but its certificate names {}",
        certified.map_or_else(|| "no node".to_string(), |n| n.to_string())
    )]
    IdentityMismatch {
        /// Where the peer is.
        addr: SocketAddr,
        /// The node its hello names.
        claimed: NodeId,
        /// The node its certificate names, if any.
        certified: Option<NodeId>,
    },
    /// The connection to a peer was lost or closed while a request was in flight.
    #[error("connection to {peer} lost: {reason}")]
    ConnectionLost {
        /// The peer.
        peer: NodeId,
        /// What the connection said.
        reason: String,
    },
    /// The peer answered with an error.
    #[error("{peer} answered {code:?}: {message}")]
    Remote {
        /// The peer.
        peer: NodeId,
        /// What went wrong.
        code: ErrorCode,
        /// Its explanation.
        message: String,
    },
    /// The peer answered a request with a reply of the wrong kind (a broken peer).
    #[error("{peer} answered a {request:?} with a {reply:?}")]
    UnexpectedReply {
        /// The peer.
        peer: NodeId,
        /// What we asked.
        request: Kind,
        /// What came back.
        reply: Kind,
    },
    /// A configuration value is invalid.
    #[error(transparent)]
    Config(#[from] spillway_types::config::ConfigError),
    /// Certificates could not be made, read or used.
    #[error(transparent)]
    Cert(#[from] certs::CertError),
    /// A socket could not be set up.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The transport already serves (one server per transport).
    #[error("this transport is already serving")]
    AlreadyServing,
    /// A request longer than the transport's message bound (UCX: the receive bound both
    /// sides share, `UcxWorkerConfig::recv_slot_bytes`); not sent.
    #[error(
        "a request of {frame_bytes} bytes to {peer} exceeds the transport's message bound of {limit_bytes} bytes"
    )]
    TooLarge {
        /// The peer.
        peer: NodeId,
        /// The request's frame and pages.
        frame_bytes: u64,
        /// The bound.
        limit_bytes: u64,
    },
    /// The transport cannot run here: its library is missing or refused to start (UCX).
    #[error("the {transport} transport cannot start: {reason}")]
    Unavailable {
        /// Which transport.
        transport: &'static str,
        /// Why (the library's own words, with what to install).
        reason: String,
    },
    /// A hello did not arrive or was not answered in time.
    #[error("no hello from {addr} within {timeout_ms} ms")]
    HelloTimeout {
        /// The peer's address.
        addr: SocketAddr,
        /// The bound ([`QuicConfig::hello_timeout_ms`]).
        timeout_ms: u64,
    },
}

impl NetError {
    /// Whether the connection failed, not only the request: every error but a request
    /// that could not be encoded or that the peer answered with an error. A caller that
    /// caches connections drops the connection on these and reconnects.
    pub fn connection_failed(&self) -> bool {
        !matches!(self, NetError::Encode { .. } | NetError::Remote { .. })
    }
}

fn peer_name(peer: Option<NodeId>) -> String {
    peer.map_or_else(|| "an unidentified peer".to_string(), |p| p.to_string())
}

/// The error for a reply that does not answer a request of kind `request`: the peer's
/// error reply, or (transports check reply kinds, so only from a broken transport) a
/// reply of another kind.
fn unexpected_reply(peer: NodeId, request: Kind, reply: Response) -> NetError {
    match reply {
        Response::Error(e) => NetError::Remote {
            peer,
            code: e.code,
            message: e.message,
        },
        other => NetError::UnexpectedReply {
            peer,
            request,
            reply: other.kind(),
        },
    }
}
