//! The QUIC transport: `quinn` with mutual TLS (`rustls`, ring provider).
//!
//! One [`QuicTransport`] per node: one UDP socket and one quinn endpoint, both client
//! (connect) and server (serve). Both TLS roles check the peer against the pool's CA:
//! the server requires a client certificate, the client checks the server's certificate
//! and its name [`SERVER_NAME`]. TLS 1.3 only, ALPN `spillway/1`.
//!
//! Peer identity: a peer is the node its certificate names ([`cert_node_id`], the DNS name
//! `node-<id>.spillway`), not whatever its hello says. The server refuses a hello whose
//! node id differs from its certificate's, or a certificate that names no node, with an
//! [`ErrorCode::IdentityMismatch`] reply; it logs a warning and counts it in
//! [`NetStats::handshakes_refused`]. The client checks the server's hello reply the same
//! way ([`NetError::IdentityMismatch`]), so [`Connection::peer`] is the node the server's
//! certificate names, and a caller that dialled an address for a given node compares it
//! (the node's Raft transport does).
//!
//! A [`QuicConnection`] to a peer is several QUIC connections ("lanes",
//! [`QuicConfig::connections_per_peer`]) used in turn: quinn drives each connection from
//! one task, so one lane keeps about one core busy, and lanes let one peer's traffic use
//! every core. All lanes of a peer share its counters and in-flight budget.
//!
//! Per QUIC connection: the first stream carries the hello exchange; every later stream
//! carries one request frame and its reply frame, and ends with it. Frames are read in
//! three steps (header, body, payload) with the checks of `spillway_types::wire` after
//! each, so a peer never makes us allocate more than the header's checked lengths allow,
//! and the payload is allocated only after its bytes were taken from the peer's in-flight
//! budget. Page checksums are verified chunk by chunk as the payload arrives.
//! Any failed check closes the connection the frame came on (the peer is broken or
//! hostile; a client closes every lane to a server that sent one) with [`CLOSE_BAD_FRAME`]
//! and counts a rejected frame; the accept loop and other connections go on.
//!
//! Tasks: the accept loop, one task per connection, one per request stream; all are
//! tracked by the [`Server`] and stop at its cancellation.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use quinn::{RecvStream, SendStream, VarInt};
use spillway_types::NodeId;
use spillway_types::wire::{
    self, ErrorCode, ErrorReply, FrameHeader, HEADER_BYTES, Hello, Message, PROTOCOL_VERSION,
    WireError,
};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::certs::{CertIdError, NodeIdentity, SERVER_NAME};
use crate::exchange::{self, Carrier, CarryError, Decoded, Link, Local, Outgoing, Received};
use crate::stats::PeerState;
use crate::tls::{certified_name, client_tls, peer_node_id, server_tls, tls_err};
use crate::{Handler, NetError, NetStats, QuicConfig, Server, Transport};

/// ALPN protocol of the peer page service.
pub const ALPN: &[u8] = b"spillway/1";
/// Connection close code: the peer sent a frame that failed the wire checks.
pub const CLOSE_BAD_FRAME: u32 = 1;
/// Connection close code: the server is shutting down.
pub const CLOSE_SHUTDOWN: u32 = 2;
/// Connection close code: the hello was refused (another pool or version, or a node id its
/// certificate does not name).
pub const CLOSE_REFUSED: u32 = 3;

/// A node's QUIC endpoint.
#[derive(Debug)]
pub struct QuicTransport {
    endpoint: quinn::Endpoint,
    client_config: quinn::ClientConfig,
    local: Arc<Local>,
    config: QuicConfig,
    local_addr: SocketAddr,
}

/// quinn's transport settings from our config; `mtu` is `Some` on loopback (fixed MTU).
fn transport_config(
    config: &QuicConfig,
    loopback: bool,
) -> Result<quinn::TransportConfig, NetError> {
    let mut t = quinn::TransportConfig::default();
    if loopback {
        t.initial_mtu(config.loopback_mtu_bytes)
            .min_mtu(config.loopback_mtu_bytes)
            .mtu_discovery_config(None);
    } else {
        t.initial_mtu(config.initial_mtu_bytes);
        if !config.mtu_discovery {
            t.mtu_discovery_config(None);
        }
    }
    let idle = quinn::IdleTimeout::try_from(Duration::from_millis(config.idle_timeout_ms))
        .map_err(|e| spillway_types::config::ConfigError {
            field: "idle_timeout_ms",
            problem: e.to_string(),
        })?;
    t.enable_segmentation_offload(config.gso)
        .max_concurrent_bidi_streams(VarInt::from_u32(config.streams_per_connection_max))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .stream_receive_window(VarInt::from_u32(config.stream_receive_window_bytes))
        .receive_window(VarInt::from_u32(config.connection_receive_window_bytes))
        .send_window(config.send_window_bytes)
        .max_idle_timeout(Some(idle))
        .keep_alive_interval(Some(Duration::from_millis(config.keep_alive_interval_ms)));
    Ok(t)
}

/// A UDP socket with the configured buffers, bound to `addr`.
fn udp_socket(addr: SocketAddr, config: &QuicConfig) -> Result<std::net::UdpSocket, NetError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let io = |context: &str| {
        let context = format!("{context} ({addr})");
        move |source| NetError::Io { context, source }
    };
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .map_err(io("creating the UDP socket"))?;
    socket
        .set_recv_buffer_size(config.socket_buffer_bytes)
        .map_err(io("setting SO_RCVBUF"))?;
    socket
        .set_send_buffer_size(config.socket_buffer_bytes)
        .map_err(io("setting SO_SNDBUF"))?;
    // Linux reports twice what it granted; less than asked means `net.core.rmem_max` capped it.
    let granted = socket.recv_buffer_size().unwrap_or(0);
    if granted < config.socket_buffer_bytes {
        tracing::warn!(
            requested_bytes = config.socket_buffer_bytes,
            granted_bytes = granted,
            "UDP receive buffer smaller than configured (raise net.core.rmem_max); expect packet loss under load"
        );
    }
    socket
        .bind(&addr.into())
        .map_err(io("binding the UDP socket"))?;
    socket
        .set_nonblocking(true)
        .map_err(io("making the UDP socket non-blocking"))?;
    Ok(socket.into())
}

impl QuicTransport {
    /// Binds a node's endpoint to `addr` (port 0 picks a free port). Must be called
    /// inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        identity: NodeIdentity,
        config: QuicConfig,
    ) -> Result<QuicTransport, NetError> {
        config.validate()?;
        let loopback = addr.ip().is_loopback();
        let transport = Arc::new(transport_config(&config, loopback)?);

        let server_crypto =
            quinn::crypto::rustls::QuicServerConfig::try_from(server_tls(&identity)?)
                .map_err(tls_err)?;
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server_config.transport_config(transport.clone());
        server_config.migration(false);

        let client_crypto =
            quinn::crypto::rustls::QuicClientConfig::try_from(client_tls(&identity)?)
                .map_err(tls_err)?;
        let mut client_config = quinn::ClientConfig::new(Arc::new(client_crypto));
        client_config.transport_config(transport);

        let mut endpoint_config = quinn::EndpointConfig::default();
        if loopback {
            endpoint_config
                .max_udp_payload_size(config.loopback_mtu_bytes)
                .map_err(|e| spillway_types::config::ConfigError {
                    field: "loopback_mtu_bytes",
                    problem: e.to_string(),
                })?;
        }
        let socket = udp_socket(addr, &config)?;
        let endpoint = quinn::Endpoint::new(
            endpoint_config,
            Some(server_config),
            socket,
            Arc::new(quinn::TokioRuntime),
        )
        .map_err(|source| NetError::Io {
            context: format!("starting the QUIC endpoint on {addr}"),
            source,
        })?;
        let local_addr = endpoint.local_addr().map_err(|source| NetError::Io {
            context: "reading the endpoint's address".to_string(),
            source,
        })?;
        Ok(QuicTransport {
            endpoint,
            client_config,
            local: Arc::new(Local::new(identity.pool_id, identity.node_id, &config)),
            config,
            local_addr,
        })
    }

    /// Closes every connection of this endpoint (client and server side) and waits until
    /// the peers were told.
    pub async fn close(&self) {
        self.endpoint
            .close(VarInt::from_u32(CLOSE_SHUTDOWN), b"shutting down");
        self.endpoint.wait_idle().await;
    }

    /// Completes only the QUIC and TLS handshakes, without the hello: for tests of what a
    /// server does with a peer that has a pool certificate but says no proper hello.
    #[doc(hidden)]
    pub async fn connect_tls_only(&self, addr: SocketAddr) -> Result<quinn::Connection, NetError> {
        let connect_err = |reason: String| NetError::Connect { addr, reason };
        self.endpoint
            .connect_with(self.client_config.clone(), addr, SERVER_NAME)
            .map_err(|e| connect_err(e.to_string()))?
            .await
            .map_err(|e| connect_err(format!("TLS handshake: {e}")))
    }

    /// One QUIC connection to `addr` with its hello exchange: the connection and the
    /// peer's hello.
    async fn connect_lane(&self, addr: SocketAddr) -> Result<(quinn::Connection, Hello), NetError> {
        let connect_err = |reason: String| NetError::Connect { addr, reason };
        let connecting = self
            .endpoint
            .connect_with(self.client_config.clone(), addr, SERVER_NAME)
            .map_err(|e| connect_err(e.to_string()))?;
        let hello_timeout = self.hello_timeout();
        let timed_out = || NetError::HelloTimeout {
            addr,
            timeout_ms: self.config.hello_timeout_ms,
        };
        let conn = tokio::time::timeout(hello_timeout, connecting)
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| connect_err(format!("TLS handshake: {e}")))?;
        let unidentified = self.local.stats.unidentified_state().clone();
        let exchange = async {
            let (mut send, mut recv) = conn
                .open_bi()
                .await
                .map_err(|e| connect_err(e.to_string()))?;
            let head = wire::encode_frame(0, &Message::Hello(self.local.hello()))
                .expect("a hello always encodes");
            let sent = write_frame(&mut send, vec![Bytes::from(head)])
                .await
                .map_err(|e| connect_err(e.to_string()))?;
            let reply = match read_head(&mut recv).await {
                Ok(head) => head,
                Err(ReadFail::Stream(reason)) => return Err(connect_err(reason)),
                Err(ReadFail::Wire(source)) => {
                    reject(&conn, &unidentified, &source);
                    return Err(NetError::BadFrame { peer: None, source });
                }
            };
            Ok((sent, reply))
        };
        let (sent, reply) = tokio::time::timeout(hello_timeout, exchange)
            .await
            .map_err(|_| timed_out())??;
        let hello = match reply.message {
            Message::HelloReply(hello) => hello,
            Message::Error(e) => {
                return Err(connect_err(format!(
                    "hello refused: {:?}: {}",
                    e.code, e.message
                )));
            }
            other => {
                let source = WireError::UndecodableBody {
                    kind: other.kind(),
                    reason: "expected a hello reply".to_string(),
                };
                reject(&conn, &unidentified, &source);
                return Err(NetError::BadFrame { peer: None, source });
            }
        };
        if hello.pool_id != self.local.pool_id {
            conn.close(VarInt::from_u32(CLOSE_REFUSED), b"pool mismatch");
            return Err(NetError::PoolMismatch {
                addr,
                peer: hello.node_id,
                expected: self.local.pool_id,
                found: hello.pool_id,
            });
        }
        let certified = peer_node_id(&conn);
        if certified.as_ref() != Ok(&hello.node_id) {
            tracing::warn!(
                %addr,
                cert_node = %certified_name(&certified),
                claimed_node = %hello.node_id,
                "refusing a server: its hello names another node than its certificate"
            );
            conn.close(VarInt::from_u32(CLOSE_REFUSED), b"identity mismatch");
            return Err(NetError::IdentityMismatch {
                addr,
                claimed: hello.node_id,
                certified: certified.ok(),
            });
        }
        let state = self.local.stats.peer_state(hello.node_id);
        state.add_out(sent);
        state.add_in(reply.wire_bytes);
        Ok((conn, hello))
    }

    fn hello_timeout(&self) -> Duration {
        Duration::from_millis(self.config.hello_timeout_ms)
    }
}

/// A frame read from a stream: the header and body; the payload is read separately.
struct Head {
    header: FrameHeader,
    message: Message,
    wire_bytes: u64,
}

/// Why reading a frame failed.
enum ReadFail {
    /// The peer sent something the wire checks refuse.
    Wire(WireError),
    /// The stream or connection failed (closed, reset, timed out): nobody to blame here.
    Stream(String),
}

async fn read_exact_or_truncated(
    recv: &mut RecvStream,
    buf: &mut [u8],
    already: u64,
) -> Result<(), ReadFail> {
    recv.read_exact(buf).await.map_err(|e| match e {
        quinn::ReadExactError::FinishedEarly(got) => ReadFail::Wire(WireError::Truncated {
            needed_bytes: already + buf.len() as u64,
            available_bytes: already + got as u64,
        }),
        quinn::ReadExactError::ReadError(e) => ReadFail::Stream(e.to_string()),
    })
}

/// Reads and checks a frame's header and body.
async fn read_head(recv: &mut RecvStream) -> Result<Head, ReadFail> {
    let mut header_bytes = [0u8; HEADER_BYTES];
    read_exact_or_truncated(recv, &mut header_bytes, 0).await?;
    let header = FrameHeader::decode(&header_bytes).map_err(ReadFail::Wire)?;
    // Bounded by FRAME_BODY_BYTES_MAX, checked above.
    let mut body = vec![0u8; header.body_bytes as usize];
    read_exact_or_truncated(recv, &mut body, HEADER_BYTES as u64).await?;
    let message = wire::decode_body(&header, &body).map_err(ReadFail::Wire)?;
    Ok(Head {
        header,
        message,
        wire_bytes: (HEADER_BYTES + body.len()) as u64,
    })
}

/// Reads the payload of `head` (its length checked against the limits and the page
/// descriptors already) and verifies every page's checksum as its bytes arrive. The caller
/// holds the permits for it. Reads chunks straight into one buffer (no zeroing, one copy
/// out of quinn) and hashes each chunk while it is still in cache.
async fn read_payload(recv: &mut RecvStream, head: &Head) -> Result<Bytes, ReadFail> {
    let len = head.header.payload_bytes as usize;
    if len == 0 {
        return Ok(Bytes::new());
    }
    let mut verifier = wire::PayloadVerifier::new(&head.message);
    let mut buf = Vec::with_capacity(len);
    while buf.len() < len {
        match recv.read_chunk(len - buf.len(), true).await {
            Ok(Some(chunk)) => {
                buf.extend_from_slice(&chunk.bytes);
                verifier.update(&chunk.bytes).map_err(ReadFail::Wire)?;
            }
            Ok(None) => {
                return Err(ReadFail::Wire(WireError::Truncated {
                    needed_bytes: head.wire_bytes + len as u64,
                    available_bytes: head.wire_bytes + buf.len() as u64,
                }));
            }
            Err(e) => return Err(ReadFail::Stream(e.to_string())),
        }
    }
    verifier.finish().map_err(ReadFail::Wire)?;
    Ok(Bytes::from(buf))
}

/// Checks that the stream ends after the frame: one frame per stream and direction, so
/// anything after it means the peer's lengths lied.
async fn expect_end(recv: &mut RecvStream, head: &Head) -> Result<(), ReadFail> {
    match recv.read_chunk(usize::MAX, true).await {
        Ok(None) => Ok(()),
        Ok(Some(extra)) => Err(ReadFail::Wire(WireError::PayloadMismatch {
            kind: head.header.kind,
            payload_bytes: head.header.payload_bytes + extra.bytes.len() as u64,
            pages_bytes: head.header.payload_bytes,
        })),
        Err(e) => Err(ReadFail::Stream(e.to_string())),
    }
}

/// Reads the payload of `head` and the end of the stream.
async fn read_rest(recv: &mut RecvStream, head: &Head) -> Result<Bytes, ReadFail> {
    let payload = read_payload(recv, head).await?;
    expect_end(recv, head).await?;
    Ok(payload)
}

/// Why a frame could not be written: the stream or its connection failed.
#[derive(Debug, thiserror::Error)]
enum WriteFail {
    #[error(transparent)]
    Write(#[from] quinn::WriteError),
    #[error(transparent)]
    Finish(#[from] quinn::ClosedStream),
}

/// Writes a frame (header and body first, then the payload parts) and finishes the
/// stream; returns the bytes written.
async fn write_frame(send: &mut SendStream, mut parts: Vec<Bytes>) -> Result<u64, WriteFail> {
    let bytes = exchange::parts_len(&parts);
    send.write_all_chunks(&mut parts).await?;
    send.finish()?;
    Ok(bytes)
}

/// Closes `conn` for a bad frame and counts it on `state`.
fn reject(conn: &quinn::Connection, state: &PeerState, error: &WireError) {
    state.reject();
    close_bad_frame(conn, error);
}

/// Closes `conn` with [`CLOSE_BAD_FRAME`] and the error as reason.
fn close_bad_frame(conn: &quinn::Connection, error: &WireError) {
    let reason = error.to_string();
    let mut cut = reason.len().min(256);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    conn.close(VarInt::from_u32(CLOSE_BAD_FRAME), &reason.as_bytes()[..cut]);
}

impl Transport for QuicTransport {
    type Connection = QuicConnection;

    fn node_id(&self) -> NodeId {
        self.local.node_id
    }

    fn pool_id(&self) -> spillway_types::PoolId {
        self.local.pool_id
    }

    fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    async fn connect(&self, addr: SocketAddr) -> Result<QuicConnection, NetError> {
        let lanes_wanted = self.config.connections_per_peer as usize;
        let mut lanes = Vec::with_capacity(lanes_wanted);
        let mut peer = None;
        for _ in 0..lanes_wanted {
            let lane = self.connect_lane(addr).await;
            let (conn, hello) = match lane {
                Ok(v) => v,
                Err(e) => {
                    for conn in &lanes {
                        close_lane(conn);
                    }
                    return Err(e);
                }
            };
            if peer.is_some_and(|p| p != hello.node_id) {
                close_lane(&conn);
                for conn in &lanes {
                    close_lane(conn);
                }
                return Err(NetError::Connect {
                    addr,
                    reason: format!(
                        "two nodes answer at this address ({} and {})",
                        peer.expect("checked"),
                        hello.node_id
                    ),
                });
            }
            peer = Some(hello.node_id);
            lanes.push(conn);
        }
        let peer = peer.expect("connections_per_peer is at least 1");
        Ok(QuicConnection {
            inner: Arc::new(ConnInner {
                lanes,
                next_lane: AtomicUsize::new(0),
                link: self.local.link(peer),
            }),
        })
    }

    fn serve<H: Handler>(&self, handler: Arc<H>) -> Result<Server, NetError> {
        self.local.start_serving()?;
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        let ctx = Arc::new(ServeCtx {
            handler,
            local: self.local.clone(),
            hello_timeout: self.hello_timeout(),
            connections: AtomicUsize::new(0),
            connections_max: self.config.connections_max,
            cancel: cancel.clone(),
            tasks: tasks.clone(),
        });
        tasks.spawn(accept_loop(self.endpoint.clone(), ctx));
        Ok(Server::new(cancel, tasks))
    }

    fn stats(&self) -> &Arc<NetStats> {
        &self.local.stats
    }

    async fn close(&self) {
        QuicTransport::close(self).await;
    }
}

/// What every task of a server shares.
struct ServeCtx<H> {
    handler: Arc<H>,
    local: Arc<Local>,
    hello_timeout: Duration,
    connections: AtomicUsize,
    connections_max: usize,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

/// Releases a connection slot when a connection task ends, however it ends.
struct ConnectionSlot<H>(Arc<ServeCtx<H>>);

impl<H> Drop for ConnectionSlot<H> {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn accept_loop<H: Handler>(endpoint: quinn::Endpoint, ctx: Arc<ServeCtx<H>>) {
    loop {
        let incoming = tokio::select! {
            _ = ctx.cancel.cancelled() => break,
            incoming = endpoint.accept() => match incoming {
                Some(incoming) => incoming,
                None => break, // the endpoint was closed
            },
        };
        if ctx.connections.fetch_add(1, Ordering::SeqCst) >= ctx.connections_max {
            ctx.connections.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(
                remote = %incoming.remote_address(),
                connections_max = ctx.connections_max,
                "refusing a connection: connections_max reached"
            );
            incoming.refuse();
            continue;
        }
        let slot = ConnectionSlot(ctx.clone());
        ctx.tasks.spawn(serve_connection(incoming, slot));
    }
}

async fn serve_connection<H: Handler>(incoming: quinn::Incoming, slot: ConnectionSlot<H>) {
    let ctx = &slot.0;
    let remote = incoming.remote_address();
    let cancel = ctx.cancel.clone();
    let identified = tokio::select! {
        _ = cancel.cancelled() => return,
        r = tokio::time::timeout(ctx.hello_timeout, accept_hello(incoming, ctx)) => r,
    };
    let (conn, peer) = match identified {
        Ok(Ok(v)) => v,
        Ok(Err(Refused::Other(reason))) => {
            ctx.local.stats.handshake_refused();
            tracing::info!(%remote, %reason, "refused a connection");
            return;
        }
        Ok(Err(Refused::Identity { certified, claimed })) => {
            ctx.local.stats.handshake_refused();
            tracing::warn!(
                %remote,
                cert_node = %certified_name(&certified),
                claimed_node = %claimed,
                "refused a connection: its hello names another node than its certificate"
            );
            return;
        }
        Err(_) => {
            ctx.local.stats.handshake_refused();
            tracing::info!(%remote, "refused a connection: no hello in time");
            return;
        }
    };
    ctx.local.stats.connection_accepted();
    let state = ctx.local.stats.peer_state(peer);
    loop {
        let (send, recv) = tokio::select! {
            _ = cancel.cancelled() => {
                conn.close(VarInt::from_u32(CLOSE_SHUTDOWN), b"shutting down");
                break;
            }
            stream = conn.accept_bi() => match stream {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%peer, %remote, reason = %e, "connection ended");
                    break;
                }
            },
        };
        let stream_task = serve_stream(conn.clone(), send, recv, peer, state.clone(), ctx.clone());
        let cancel = cancel.clone();
        ctx.tasks.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                () = stream_task => {}
            }
        });
    }
}

/// Why [`accept_hello`] refused a connection.
enum Refused {
    /// TLS, the hello frame, its pool or its version (logged at info by the caller).
    Other(String),
    /// The hello names a node its certificate does not (logged as a warning).
    Identity {
        /// The node the certificate names, or why it names none.
        certified: Result<NodeId, CertIdError>,
        /// The node the hello names.
        claimed: NodeId,
    },
}

impl From<String> for Refused {
    fn from(reason: String) -> Self {
        Refused::Other(reason)
    }
}

/// Completes TLS (which checks the client's certificate against the pool's CA) and the
/// hello exchange, and checks that the hello names the node the certificate does. Returns
/// the connection and the peer's node id, or why it was refused (already counted where a
/// frame was bad).
async fn accept_hello<H: Handler>(
    incoming: quinn::Incoming,
    ctx: &ServeCtx<H>,
) -> Result<(quinn::Connection, NodeId), Refused> {
    let conn = incoming
        .accept()
        .map_err(|e| format!("QUIC: {e}"))?
        .await
        .map_err(|e| format!("TLS handshake: {e}"))?;
    let (mut send, mut recv) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("waiting for the hello: {e}"))?;
    let unidentified = ctx.local.stats.unidentified_state();
    let head = match read_head(&mut recv).await {
        Ok(head) => head,
        Err(ReadFail::Stream(reason)) => {
            return Err(format!("reading the hello: {reason}").into());
        }
        Err(ReadFail::Wire(e)) => {
            reject(&conn, unidentified, &e);
            return Err(format!("bad hello frame: {e}").into());
        }
    };
    let hello = match head.message {
        Message::Hello(hello) => hello,
        other => {
            let e = WireError::UndecodableBody {
                kind: other.kind(),
                reason: "the first frame of a connection must be a hello".to_string(),
            };
            reject(&conn, unidentified, &e);
            return Err(e.to_string().into());
        }
    };
    let certified = peer_node_id(&conn);
    let refusal = if hello.pool_id != ctx.local.pool_id {
        Some(ErrorReply::new(
            ErrorCode::PoolMismatch,
            format!("this is {}, you are {}", ctx.local.pool_id, hello.pool_id),
        ))
    } else if hello.protocol_version != PROTOCOL_VERSION {
        Some(ErrorReply::new(
            ErrorCode::VersionMismatch,
            format!(
                "this node speaks protocol {PROTOCOL_VERSION}, you speak {}",
                hello.protocol_version
            ),
        ))
    } else if certified.as_ref() != Ok(&hello.node_id) {
        Some(ErrorReply::new(
            ErrorCode::IdentityMismatch,
            format!(
                "your hello says {} but your certificate names {}",
                hello.node_id,
                certified_name(&certified)
            ),
        ))
    } else {
        None
    };
    let reply = match &refusal {
        Some(e) => Message::Error(e.clone()),
        None => Message::HelloReply(ctx.local.hello()),
    };
    let frame = wire::encode_frame(head.header.request_id, &reply).expect("a hello reply encodes");
    let sent = write_frame(&mut send, vec![Bytes::from(frame)]).await;
    if let Some(e) = refusal {
        // Let the error reply reach the peer before closing; bounded by the hello timeout.
        if sent.is_ok() {
            let _ = send.stopped().await;
        }
        conn.close(VarInt::from_u32(CLOSE_REFUSED), b"hello refused");
        return Err(match e.code {
            ErrorCode::IdentityMismatch => Refused::Identity {
                certified,
                claimed: hello.node_id,
            },
            _ => Refused::Other(format!("hello refused: {:?}: {}", e.code, e.message)),
        });
    }
    let sent = sent.map_err(|e| format!("answering the hello: {e}"))?;
    let state = ctx.local.stats.peer_state(hello.node_id);
    state.add_in(head.wire_bytes);
    state.add_out(sent);
    Ok((conn, hello.node_id))
}

/// A request stream that could not be read ends: a bad frame closes its connection and is
/// counted against `peer`; a stream that failed on its own just ends.
fn end_request_stream(conn: &quinn::Connection, state: &PeerState, peer: NodeId, fail: ReadFail) {
    match fail {
        ReadFail::Wire(e) => {
            tracing::warn!(%peer, error = %e, "closing the connection: bad frame");
            reject(conn, state, &e);
        }
        ReadFail::Stream(reason) => tracing::debug!(%peer, %reason, "request stream ended"),
    }
}

/// Serves one request stream: reads the request, asks the handler, writes the reply.
async fn serve_stream<H: Handler>(
    conn: quinn::Connection,
    mut send: SendStream,
    mut recv: RecvStream,
    peer: NodeId,
    state: Arc<PeerState>,
    ctx: Arc<ServeCtx<H>>,
) {
    let head = match read_head(&mut recv).await {
        Ok(head) => head,
        Err(fail) => return end_request_stream(&conn, &state, peer, fail),
    };
    let permit = exchange::acquire(
        &state.inbound,
        head.header.payload_bytes,
        ctx.local.budget_permits,
    )
    .await;
    let payload = match read_rest(&mut recv, &head).await {
        Ok(p) => p,
        Err(fail) => return end_request_stream(&conn, &state, peer, fail),
    };
    state.add_in(head.wire_bytes + payload.len() as u64);
    let request_id = head.header.request_id;
    let parts = exchange::answer(
        &*ctx.handler,
        peer,
        request_id,
        head.message,
        &payload,
        permit,
    )
    .await;
    drop(payload);
    match write_frame(&mut send, parts).await {
        Ok(bytes) => state.add_out(bytes),
        Err(reason) => tracing::debug!(%peer, %reason, "could not send a reply"),
    }
}

struct ConnInner {
    /// The QUIC connections to the peer, used in turn (see
    /// [`QuicConfig::connections_per_peer`]).
    lanes: Vec<quinn::Connection>,
    next_lane: AtomicUsize,
    link: Link,
}

/// A QUIC connection to one peer (see [`Connection`]).
#[derive(Clone)]
pub struct QuicConnection {
    inner: Arc<ConnInner>,
}

impl std::fmt::Debug for QuicConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicConnection")
            .field("peer", &self.inner.link.peer)
            .field("remote", &self.inner.lanes[0].remote_address())
            .field("lanes", &self.inner.lanes.len())
            .finish()
    }
}

/// Closes one lane of ours, for good.
fn close_lane(conn: &quinn::Connection) {
    conn.close(VarInt::from_u32(0), b"done");
}

impl QuicConnection {
    /// The first underlying quinn connection (for its statistics, or for tests that need
    /// to send raw bytes).
    pub fn quinn(&self) -> &quinn::Connection {
        &self.inner.lanes[0]
    }

    /// All underlying quinn connections.
    pub fn lanes(&self) -> &[quinn::Connection] {
        &self.inner.lanes
    }

    /// The next lane in turn that is still open (or, if none is, the next lane, whose
    /// request will then fail with its close reason).
    fn lane(&self) -> &quinn::Connection {
        let lanes = &self.inner.lanes;
        let start = self.inner.next_lane.fetch_add(1, Ordering::Relaxed);
        (0..lanes.len())
            .map(|i| &lanes[(start + i) % lanes.len()])
            .find(|c| c.close_reason().is_none())
            .unwrap_or(&lanes[start % lanes.len()])
    }

    fn lost(&self, lane: &quinn::Connection, reason: impl std::fmt::Display) -> NetError {
        // Prefer the connection's own reason (for example our peer closing it for a bad
        // frame) over the stream's echo of it.
        let reason = match lane.close_reason() {
            Some(r) => r.to_string(),
            None => reason.to_string(),
        };
        NetError::ConnectionLost {
            peer: self.inner.link.peer,
            reason,
        }
    }
}

impl Carrier for QuicConnection {
    fn link(&self) -> &Link {
        &self.inner.link
    }

    /// One stream per request: the request's bytes are in flight until the reply's header
    /// arrives; the reply's payload is then taken from the same budget while it is read,
    /// its checksums verified chunk by chunk.
    async fn carry(
        &self,
        request: Outgoing,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<Received, CarryError> {
        let inner = &*self.inner;
        let lane = self.lane();
        let lost = |e: &dyn std::fmt::Display| CarryError::Lost(self.lost(lane, e));
        let (mut send, mut recv) = lane.open_bi().await.map_err(|e| lost(&e))?;
        write_frame(&mut send, request.parts)
            .await
            .map_err(|e| lost(&e))?;
        let reply = match read_head(&mut recv).await {
            Ok(head) => head,
            Err(ReadFail::Wire(e)) => return Err(CarryError::BadFrame(e)),
            Err(ReadFail::Stream(reason)) => return Err(lost(&reason)),
        };
        drop(permit);
        let reply_permit = exchange::acquire(
            &inner.link.state.outbound,
            reply.header.payload_bytes,
            inner.link.budget_permits,
        )
        .await;
        let payload = match read_rest(&mut recv, &reply).await {
            Ok(p) => p,
            Err(ReadFail::Wire(e)) => return Err(CarryError::BadFrame(e)),
            Err(ReadFail::Stream(reason)) => return Err(lost(&reason)),
        };
        drop(reply_permit);
        Ok(Received::Decoded(Decoded {
            request_id: reply.header.request_id,
            wire_bytes: reply.wire_bytes + payload.len() as u64,
            message: reply.message,
            payload,
        }))
    }

    /// The peer is broken: every lane to it is closed.
    fn close_bad_frame(&self, error: &WireError) {
        for lane in &self.inner.lanes {
            close_bad_frame(lane, error);
        }
    }

    /// Open while any lane is.
    fn is_open(&self) -> bool {
        self.inner.lanes.iter().any(|l| l.close_reason().is_none())
    }
}

exchange::connection_over_carrier!(QuicConnection);
