//! [`UcxTransport`]: the remote tier's [`Transport`] over UCX tagged messages, with the
//! same frames and checks as QUIC (`spillway_types::wire`, page checksums, per-peer
//! in-flight budgets, a bad frame closes its connection).
//!
//! Connection setup, two ways:
//! - introduced ([`UcxTransport::offer`], [`UcxTransport::accept`],
//!   [`UcxTransport::complete`]): the two sides exchange a connection id and their worker
//!   addresses over another, authenticated channel (nodes use their mutual-TLS QUIC
//!   connection: `Request::UcxConnect`). Each side then makes a UCX endpoint to the
//!   other; the served connection ends when UCX reports the peer lost or serving stops.
//!   [`UcxTransport::introduced_only`] makes a transport that takes no other kind.
//! - side channel ([`UcxTransport::bind`], [`Transport::connect`]): a small TCP channel at
//!   [`Transport::local_addr`]. The client sends its hello frame, the id it will receive
//!   replies under and its worker address; the server answers with the same. The side
//!   channel stays open as the connection's lifeline. It is plain TCP: nothing
//!   authenticates the peer beyond its hello (pool id), so it is for trusted networks and
//!   benchmarks only.
//!
//! Tags: bits 63..62 say request (1) or reply (2); bits 61..32 the receiver's connection
//! id (the server's for requests, the client's for replies: each side picks ids unique on
//! its own worker); bits 31..0 the low bits of the request id (unique among a
//! connection's requests in flight).
//!
//! Limits and costs:
//! - a message is received once it has arrived, into a buffer of its own length
//!   ([`Worker::recv_owned`]): nothing is copied after UCX, and the buffer becomes the
//!   pages' `Bytes`;
//! - requests of all served connections are taken by one set of [`REQUEST_RECEIVES`]
//!   receives, each dispatched by the connection id in its tag, so idle connections hold
//!   none and starve no busy one. A
//!   served connection ends when its side channel closes, a bad frame arrives, or a
//!   reply cannot be sent (its peer is gone);
//! - throughput: `spillway bench remote --transport ucx --in-flight 8` on a 2-core VM
//!   (loopback, `UCX_TLS=tcp,self`, 2 MiB pages) moved 2.2-2.3 GB/s, 0.32-0.35x of raw
//!   TCP in the same runs, under a floor of 3.6-3.7 GB/s (0.53-0.57x) for bare UCX tagged
//!   messages without frames or checksums: UCX's TCP rendezvous copies every segment
//!   on both sides (see `UCX_DEFAULTS`);
//! - the largest frame is [`UcxWorkerConfig::recv_slot_bytes`], the same on both sides: a
//!   longer request is refused before it is sent ([`NetError::TooLarge`]); a longer
//!   reply fails its request; a longer request from a peer with a larger bound is
//!   dropped and counted as rejected. The in-flight budget is
//!   [`QuicConfig::peer_bytes_in_flight_max`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use spillway_types::wire::{self, Hello, Message, PROTOCOL_VERSION, WireError};
use spillway_types::{NodeId, PoolId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Endpoint, UcxError, UcxWorkerConfig, Worker};
use crate::exchange::{self, Carrier, CarryError, Link, Local, Outgoing, Received};
use crate::{Handler, NetError, NetStats, QuicConfig, Server, Transport};

const TAG_REQUEST: u64 = 1 << 62;
const TAG_REPLY: u64 = 2 << 62;
const TAG_KIND_MASK: u64 = 3 << 62;
const TAG_CONN_MASK: u64 = ((1 << 30) - 1) << 32;
const TAG_LOW_MASK: u64 = 0xFFFF_FFFF;
/// Connection ids: 30 bits.
const CONN_IDS: u32 = 1 << 30;
/// Largest hello frame on the side channel.
const HELLO_BYTES_MAX: u32 = 4096;
/// Largest worker address on the side channel.
const ADDRESS_BYTES_MAX: u32 = 64 << 10;

fn tag(kind: u64, conn: u32, request_id: u64) -> u64 {
    kind | (u64::from(conn) << 32 & TAG_CONN_MASK) | (request_id & TAG_LOW_MASK)
}

/// One node's UCX transport.
pub struct UcxTransport {
    worker: Worker,
    addr: SocketAddr,
    listener: Mutex<Option<TcpListener>>,
    /// Whether connections may come over the TCP side channel (see the module docs).
    side_channel: bool,
    local: Arc<Local>,
    hello_timeout: Duration,
    next_conn: AtomicU32,
    /// Where connections introduced over another channel are served (set by `serve`).
    introduced: OnceLock<Arc<dyn ServeIntroduced>>,
}

impl std::fmt::Debug for UcxTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxTransport")
            .field("node_id", &self.local.node_id)
            .field("addr", &self.addr)
            .finish()
    }
}

impl UcxTransport {
    /// Starts a UCX worker and binds the side channel at `addr` (port 0: any).
    /// `config` gives the in-flight budget and the hello timeout.
    pub async fn bind(
        pool_id: PoolId,
        node_id: NodeId,
        addr: SocketAddr,
        config: &QuicConfig,
        worker_config: &UcxWorkerConfig,
    ) -> Result<UcxTransport, NetError> {
        config.validate()?;
        let worker = Worker::start(worker_config).map_err(unavailable)?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| NetError::Io {
                context: format!("binding the UCX side channel at {addr}"),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| NetError::Io {
            context: "reading the side channel's address".into(),
            source,
        })?;
        Ok(UcxTransport::new(
            worker,
            pool_id,
            node_id,
            config,
            Some((addr, listener)),
        ))
    }

    /// Starts a UCX worker with no side channel: connections come only through
    /// [`UcxTransport::offer`] and [`UcxTransport::accept`] over another, authenticated
    /// channel (what nodes do), and [`Transport::connect`] fails.
    /// [`Transport::local_addr`] is the unspecified address.
    pub fn introduced_only(
        pool_id: PoolId,
        node_id: NodeId,
        config: &QuicConfig,
        worker_config: &UcxWorkerConfig,
    ) -> Result<UcxTransport, NetError> {
        config.validate()?;
        let worker = Worker::start(worker_config).map_err(unavailable)?;
        Ok(UcxTransport::new(worker, pool_id, node_id, config, None))
    }

    /// A transport over `worker`, with the side channel `side` (its address and listener)
    /// or none.
    fn new(
        worker: Worker,
        pool_id: PoolId,
        node_id: NodeId,
        config: &QuicConfig,
        side: Option<(SocketAddr, TcpListener)>,
    ) -> UcxTransport {
        let side_channel = side.is_some();
        let (addr, listener) = match side {
            Some((addr, listener)) => (addr, Some(listener)),
            None => (SocketAddr::from(([0, 0, 0, 0], 0)), None),
        };
        UcxTransport {
            worker,
            addr,
            listener: Mutex::new(listener),
            side_channel,
            local: Arc::new(Local::new(pool_id, node_id, config)),
            hello_timeout: Duration::from_millis(config.hello_timeout_ms),
            next_conn: AtomicU32::new(1),
            introduced: OnceLock::new(),
        }
    }

    /// The UCX worker (counters, version).
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    fn conn_id(&self) -> u32 {
        self.next_conn.fetch_add(1, Ordering::Relaxed) % CONN_IDS
    }

    /// Starts a connection introduced over another, authenticated channel (the node's
    /// QUIC connection to the peer): the offer to send there
    /// ([`Request::UcxConnect`](crate::Request::UcxConnect)). No side channel is used.
    pub fn offer(&self) -> UcxOffer {
        let conn = self.conn_id();
        UcxOffer {
            conn,
            bytes: encode_intro(conn, self.worker.address()),
        }
    }

    /// Accepts an offer that `peer` made over an authenticated channel: connects to its
    /// worker, serves its requests with the handler given to [`Transport::serve`] until
    /// the peer goes away or serving stops, and returns the answer to send back.
    pub async fn accept(&self, peer: NodeId, offer: &[u8]) -> Result<Bytes, NetError> {
        let reject = |reason: String| NetError::Remote {
            peer,
            code: wire::ErrorCode::BadRequest,
            message: reason,
        };
        let serving = self
            .introduced
            .get()
            .cloned()
            .ok_or_else(|| reject("this node does not serve UCX yet".into()))?;
        let (client_conn, address) = decode_intro(offer).map_err(|e| reject(e.to_string()))?;
        let ep = self
            .worker
            .connect(address)
            .await
            .map_err(|e| reject(format!("UCX endpoint to {peer}: {e}")))?;
        let my_conn = serving.conn_id();
        serving.start(peer, ep, my_conn, client_conn);
        Ok(encode_intro(my_conn, self.worker.address()))
    }

    /// Completes the connection `offer` started with the peer's `answer`.
    pub async fn complete(
        &self,
        peer: NodeId,
        offer: UcxOffer,
        answer: &[u8],
    ) -> Result<UcxConnection, NetError> {
        let lost = |reason: String| NetError::ConnectionLost { peer, reason };
        let (server_conn, address) = decode_intro(answer).map_err(|e| lost(e.to_string()))?;
        let ep = self
            .worker
            .connect(address)
            .await
            .map_err(|e| lost(format!("UCX endpoint: {e}")))?;
        Ok(UcxConnection {
            inner: Arc::new(ConnInner {
                worker: self.worker.clone(),
                ep,
                server_conn,
                my_conn: offer.conn,
                link: self.local.link(peer),
                _side: None,
            }),
        })
    }

    /// Stops the UCX worker (see [`Worker::shutdown`]); stop serving first.
    pub async fn shutdown(&self) {
        self.worker.shutdown().await;
    }
}

/// The first half of a connection introduced over another channel
/// ([`UcxTransport::offer`]).
#[derive(Debug)]
pub struct UcxOffer {
    conn: u32,
    bytes: Bytes,
}

impl UcxOffer {
    /// What to send to the peer.
    pub fn bytes(&self) -> Bytes {
        self.bytes.clone()
    }
}

/// An offer or answer: the connection id (4 bytes, little-endian) then the worker address.
fn encode_intro(conn: u32, address: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(4 + address.len());
    b.extend_from_slice(&conn.to_le_bytes());
    b.extend_from_slice(address);
    b.freeze()
}

/// A UCX introduction that is not one.
#[derive(Debug, thiserror::Error)]
#[error(
    "a UCX introduction of {0} bytes is not one (4 bytes of connection id, then an address of at most {ADDRESS_BYTES_MAX} bytes)"
)]
struct BadIntro(usize);

fn decode_intro(bytes: &[u8]) -> Result<(u32, &[u8]), BadIntro> {
    if bytes.len() < 5 || bytes.len() as u64 > u64::from(ADDRESS_BYTES_MAX) + 4 {
        return Err(BadIntro(bytes.len()));
    }
    let conn = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) % CONN_IDS;
    Ok((conn, &bytes[4..]))
}

/// Serves connections introduced over another channel (their requests go to the handler
/// of `serve` through the transport's receivers).
trait ServeIntroduced: Send + Sync {
    fn conn_id(&self) -> u32;
    fn start(&self, peer: NodeId, ep: Endpoint, my_conn: u32, client_conn: u32);
}

struct Serving {
    ctx: Arc<ServeCtx>,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl ServeIntroduced for Serving {
    fn conn_id(&self) -> u32 {
        self.ctx.conn_id()
    }

    fn start(&self, peer: NodeId, ep: Endpoint, my_conn: u32, client_conn: u32) {
        self.ctx.local.stats.connection_accepted();
        let conn = ServedConn {
            peer,
            ep,
            my_conn,
            client_conn,
            cancel: self.cancel.child_token(),
        };
        serve_requests(conn, &self.ctx, &self.tasks);
    }
}

/// A worker that cannot start: the transport is unavailable here.
fn unavailable(e: UcxError) -> NetError {
    NetError::Unavailable {
        transport: "UCX",
        reason: e.to_string(),
    }
}

/// What one side says on the side channel.
struct SideHello {
    hello: Hello,
    conn: u32,
    address: Vec<u8>,
}

async fn write_side_hello(
    stream: &mut TcpStream,
    hello: Hello,
    conn: u32,
    address: &[u8],
) -> std::io::Result<()> {
    let frame = wire::encode_frame(0, &Message::Hello(hello))
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let mut buf = BytesMut::with_capacity(12 + frame.len() + address.len());
    buf.extend_from_slice(&(frame.len() as u32).to_le_bytes());
    buf.extend_from_slice(&frame);
    buf.extend_from_slice(&conn.to_le_bytes());
    buf.extend_from_slice(&(address.len() as u32).to_le_bytes());
    buf.extend_from_slice(address);
    stream.write_all(&buf).await?;
    stream.flush().await
}

#[derive(Debug)]
enum SideError {
    Io(std::io::Error),
    Wire(WireError),
    TooLong { what: &'static str, bytes: u32 },
    NotHello,
}

impl std::fmt::Display for SideError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SideError::Io(e) => write!(f, "side channel: {e}"),
            SideError::Wire(e) => write!(f, "bad hello: {e}"),
            SideError::TooLong { what, bytes } => write!(f, "{what} of {bytes} bytes"),
            SideError::NotHello => write!(f, "first frame is not a hello"),
        }
    }
}

/// Reads a little-endian `u32` length, then that many bytes of `what`; a length above
/// `bytes_max` is refused before anything is allocated.
async fn read_length_prefixed(
    stream: &mut TcpStream,
    what: &'static str,
    bytes_max: u32,
) -> Result<Vec<u8>, SideError> {
    let bytes = stream.read_u32_le().await.map_err(SideError::Io)?;
    if bytes > bytes_max {
        return Err(SideError::TooLong { what, bytes });
    }
    let mut buf = vec![0u8; bytes as usize];
    stream.read_exact(&mut buf).await.map_err(SideError::Io)?;
    Ok(buf)
}

async fn read_side_hello(stream: &mut TcpStream) -> Result<SideHello, SideError> {
    let frame = read_length_prefixed(stream, "hello", HELLO_BYTES_MAX).await?;
    let hello = match wire::decode_frame(&frame)
        .map_err(SideError::Wire)?
        .0
        .message
    {
        Message::Hello(h) => h,
        _ => return Err(SideError::NotHello),
    };
    let conn = stream.read_u32_le().await.map_err(SideError::Io)? % CONN_IDS;
    let address = read_length_prefixed(stream, "worker address", ADDRESS_BYTES_MAX).await?;
    Ok(SideHello {
        hello,
        conn,
        address,
    })
}

impl Transport for UcxTransport {
    type Connection = UcxConnection;

    fn node_id(&self) -> NodeId {
        self.local.node_id
    }

    fn pool_id(&self) -> PoolId {
        self.local.pool_id
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    async fn connect(&self, addr: SocketAddr) -> Result<UcxConnection, NetError> {
        let connect_err = |reason: String| NetError::Connect { addr, reason };
        if !self.side_channel {
            return Err(connect_err(
                "this UCX transport takes connections introduced over the pool's QUIC connections only"
                    .into(),
            ));
        }
        let my_conn = self.conn_id();
        let exchange = async {
            let mut side = TcpStream::connect(addr)
                .await
                .map_err(|e| connect_err(e.to_string()))?;
            let _ = side.set_nodelay(true);
            write_side_hello(
                &mut side,
                self.local.hello(),
                my_conn,
                self.worker.address(),
            )
            .await
            .map_err(|e| connect_err(e.to_string()))?;
            let theirs = read_side_hello(&mut side)
                .await
                .map_err(|e| connect_err(e.to_string()))?;
            Ok::<_, NetError>((side, theirs))
        };
        let (side, theirs) = tokio::time::timeout(self.hello_timeout, exchange)
            .await
            .map_err(|_| NetError::HelloTimeout {
                addr,
                timeout_ms: self.hello_timeout.as_millis() as u64,
            })??;
        if theirs.hello.pool_id != self.local.pool_id {
            return Err(NetError::PoolMismatch {
                addr,
                peer: theirs.hello.node_id,
                expected: self.local.pool_id,
                found: theirs.hello.pool_id,
            });
        }
        if theirs.hello.protocol_version != PROTOCOL_VERSION {
            return Err(connect_err(format!(
                "peer speaks protocol {}, we {PROTOCOL_VERSION}",
                theirs.hello.protocol_version
            )));
        }
        let ep = self
            .worker
            .connect(&theirs.address)
            .await
            .map_err(|e| connect_err(format!("UCX endpoint: {e}")))?;
        let peer = theirs.hello.node_id;
        Ok(UcxConnection {
            inner: Arc::new(ConnInner {
                worker: self.worker.clone(),
                ep,
                server_conn: theirs.conn,
                my_conn,
                link: self.local.link(peer),
                _side: Some(side),
            }),
        })
    }

    fn serve<H: Handler>(&self, handler: Arc<H>) -> Result<Server, NetError> {
        self.local.start_serving()?;
        let listener = self.listener.lock().ok().and_then(|mut l| l.take());
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        let ctx = Arc::new(ServeCtx {
            worker: self.worker.clone(),
            local: self.local.clone(),
            hello_timeout: self.hello_timeout,
            next_conn: AtomicU32::new(1),
            conns: Mutex::new(HashMap::new()),
        });
        for _ in 0..REQUEST_RECEIVES {
            tasks.spawn(receive_requests(
                ctx.clone(),
                handler.clone(),
                cancel.clone(),
                tasks.clone(),
            ));
        }
        let _ = self.introduced.set(Arc::new(Serving {
            ctx: ctx.clone(),
            cancel: cancel.clone(),
            tasks: tasks.clone(),
        }));
        if let Some(listener) = listener {
            tasks.spawn(accept_loop(listener, ctx, cancel.clone(), tasks.clone()));
        }
        Ok(Server::new(cancel, tasks))
    }

    fn stats(&self) -> &Arc<NetStats> {
        &self.local.stats
    }
}

struct ServeCtx {
    worker: Worker,
    local: Arc<Local>,
    hello_timeout: Duration,
    next_conn: AtomicU32,
    /// The connections served, by the id their requests are tagged with.
    conns: Mutex<HashMap<u32, ServedConn>>,
}

impl ServeCtx {
    fn conn_id(&self) -> u32 {
        self.next_conn.fetch_add(1, Ordering::Relaxed) % CONN_IDS
    }
}

async fn accept_loop(
    listener: TcpListener,
    ctx: Arc<ServeCtx>,
    cancel: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let (stream, from) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "UCX side channel accept failed");
                continue;
            }
        };
        tasks.spawn(serve_connection(
            stream,
            from,
            ctx.clone(),
            cancel.clone(),
            tasks.clone(),
        ));
    }
}

async fn serve_connection(
    mut side: TcpStream,
    from: SocketAddr,
    ctx: Arc<ServeCtx>,
    cancel: CancellationToken,
    tasks: TaskTracker,
) {
    let _ = side.set_nodelay(true);
    let theirs = match tokio::time::timeout(ctx.hello_timeout, read_side_hello(&mut side)).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            ctx.local.stats.unidentified_state().reject();
            tracing::debug!(%from, error = %e, "UCX side channel: bad hello");
            return;
        }
        Err(_) => return,
    };
    if theirs.hello.pool_id != ctx.local.pool_id
        || theirs.hello.protocol_version != PROTOCOL_VERSION
    {
        ctx.local.stats.handshake_refused();
        return;
    }
    let my_conn = ctx.conn_id();
    let ep = match ctx.worker.connect(&theirs.address).await {
        Ok(ep) => ep,
        Err(e) => {
            tracing::warn!(%from, error = %e, "UCX endpoint to a client failed");
            return;
        }
    };
    // Served before the client learns our id: its first request may follow at once, and
    // a request for a connection not yet served would be dropped.
    let conn_cancel = cancel.child_token();
    let conn = ServedConn {
        peer: theirs.hello.node_id,
        ep,
        my_conn,
        client_conn: theirs.conn,
        cancel: conn_cancel.clone(),
    };
    serve_requests(conn, &ctx, &tasks);
    if write_side_hello(&mut side, ctx.local.hello(), my_conn, ctx.worker.address())
        .await
        .is_err()
    {
        conn_cancel.cancel();
        return;
    }
    ctx.local.stats.connection_accepted();
    // The side channel's end (EOF or error) closes the connection.
    let lifeline = async move {
        let mut byte = [0u8; 1];
        tokio::select! {
            _ = side.read(&mut byte) => conn_cancel.cancel(),
            _ = conn_cancel.cancelled() => {}
        }
    };
    tasks.spawn(lifeline);
}

/// One served connection: the client's endpoint and the ids each side receives under.
#[derive(Clone)]
struct ServedConn {
    peer: NodeId,
    ep: Endpoint,
    my_conn: u32,
    client_conn: u32,
    /// Cancelled when the connection ends (side channel closed, bad frame, peer lost).
    cancel: CancellationToken,
}

/// Starts serving `conn`: its requests are taken by the transport's receivers (see
/// [`receive_requests`]) until the connection ends, when it is forgotten.
fn serve_requests(conn: ServedConn, ctx: &Arc<ServeCtx>, tasks: &TaskTracker) {
    let (id, cancel) = (conn.my_conn, conn.cancel.clone());
    lock(&ctx.conns).insert(id, conn);
    let ctx = ctx.clone();
    tasks.spawn(async move {
        cancel.cancelled().await;
        lock(&ctx.conns).remove(&id);
    });
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Requests taken at once, all served connections together: 8. Each waits for any
/// request (a receive per connection would let idle connections starve busy ones) and
/// holds no memory until one arrives; each request then runs in its own task.
const REQUEST_RECEIVES: usize = 8;

/// One of the transport's receivers: takes any request, finds its connection by the
/// connection id in its tag, and hands it to its own task; a request for no connection
/// served here (or too large for a slot) is counted as rejected and dropped.
async fn receive_requests<H: Handler>(
    ctx: Arc<ServeCtx>,
    handler: Arc<H>,
    cancel: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        let got = tokio::select! {
            _ = cancel.cancelled() => return,
            g = ctx.worker.recv_owned(
                tag(TAG_REQUEST, 0, 0),
                TAG_KIND_MASK,
                None,
                ctx.worker.max_message_bytes(),
            ) => g,
        };
        let got = match got {
            Ok(g) => g,
            Err(UcxError::MessageTooLarge { slot_bytes }) => {
                // Its sender is not known: the request is lost and its sender waits
                // until its connection ends.
                ctx.local.stats.unidentified_state().reject();
                tracing::warn!(
                    slot_bytes,
                    "a UCX request larger than a receive slot was dropped"
                );
                continue;
            }
            Err(e) => {
                tracing::debug!(error = %e, "UCX receiver stopped");
                return;
            }
        };
        let (frame, sender_tag) = got;
        let conn_id = ((sender_tag & TAG_CONN_MASK) >> 32) as u32;
        let Some(conn) = lock(&ctx.conns).get(&conn_id).cloned() else {
            ctx.local.stats.unidentified_state().reject();
            continue;
        };
        tasks.spawn(serve_request(
            frame,
            conn,
            ctx.local.clone(),
            handler.clone(),
        ));
    }
}

/// Serves one request `frame` that came on `conn`, and sends the reply; a bad frame or a
/// reply that cannot be sent ends the connection.
async fn serve_request<H: Handler>(
    frame: Bytes,
    conn: ServedConn,
    local: Arc<Local>,
    handler: Arc<H>,
) {
    let peer = conn.peer;
    let (request_id, parts) = match exchange::serve_whole(&*handler, &local, peer, &frame).await {
        Ok(answered) => answered,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "bad frame over UCX; closing the connection");
            conn.cancel.cancel();
            return;
        }
    };
    if let Err(e) = conn
        .ep
        .send_parts(tag(TAG_REPLY, conn.client_conn, request_id), parts)
        .await
    {
        tracing::debug!(%peer, error = %e, "UCX reply not sent; the connection ends");
        conn.cancel.cancel();
    }
}

struct ConnInner {
    worker: Worker,
    ep: Endpoint,
    server_conn: u32,
    my_conn: u32,
    link: Link,
    /// The side channel, kept open: closing it tells the server the connection ended
    /// (none for connections introduced over another channel).
    _side: Option<TcpStream>,
}

/// A connection to one peer over UCX.
#[derive(Clone)]
pub struct UcxConnection {
    inner: Arc<ConnInner>,
}

impl std::fmt::Debug for UcxConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxConnection")
            .field("peer", &self.inner.link.peer)
            .finish()
    }
}

impl Carrier for UcxConnection {
    fn link(&self) -> &Link {
        &self.inner.link
    }

    /// The peer drops a message longer than its bound without knowing whose it was; both
    /// sides share the bound, so a longer request is refused here, where the caller can
    /// be told.
    fn frame_bytes_max(&self) -> Option<u64> {
        Some(self.inner.worker.max_message_bytes() as u64)
    }

    async fn carry(
        &self,
        request: Outgoing,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<Received, CarryError> {
        let inner = &*self.inner;
        let id = request.id;
        let reply = inner.worker.recv_owned(
            tag(TAG_REPLY, inner.my_conn, id),
            u64::MAX,
            Some(&inner.ep),
            inner.worker.max_message_bytes(),
        );
        let send = inner
            .ep
            .send_parts(tag(TAG_REQUEST, inner.server_conn, id), request.parts);
        // A send that fails ends the wait for its reply (the receive is cancelled).
        let send_failed = CancellationToken::new();
        let reply = async {
            tokio::select! {
                r = reply => Some(r),
                _ = send_failed.cancelled() => None,
            }
        };
        let send = async {
            let r = send.await;
            if r.is_err() {
                send_failed.cancel();
            }
            r
        };
        let (reply, sent) = tokio::join!(reply, send);
        drop(permit);
        let lost = |reason: String| CarryError::Lost(inner.link.lost(reason));
        sent.map_err(|e| lost(e.to_string()))?;
        let (reply, _) = reply
            .ok_or_else(|| lost("request not sent".to_string()))?
            .map_err(|e| lost(e.to_string()))?;
        Ok(Received::Whole(reply))
    }
}

exchange::connection_over_carrier!(UcxConnection);
