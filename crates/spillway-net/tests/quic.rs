//! The QUIC transport on loopback (127.0.0.1 only): round trips with checksums, mutual TLS
//! refusals, and bad frames that close their connection while the server keeps serving.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{page, page_id, round_trip, temp_dir, wait_for, within};
use quinn::{ConnectionError, VarInt};
use spillway_net::certs::{NodeIdentity, PoolCa, SERVER_NAME, init_pool_dir};
use spillway_net::quic::{CLOSE_BAD_FRAME, QuicConnection, QuicTransport};
use spillway_net::{Connection, MemStore, NetError, QuicConfig, Server, Transport};
use spillway_types::wire::{self, FrameHeader, Kind};
use spillway_types::{NodeId, PoolId};

const POOL: PoolId = PoolId(0x5b11_1a7e);
const WAIT: Duration = Duration::from_secs(10);

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A pool directory with nodes 1 to 4, removed when dropped.
struct Pool {
    dir: std::path::PathBuf,
    ca: PoolCa,
}

impl Pool {
    fn new(name: &str) -> Pool {
        let dir = temp_dir(name);
        let ca = init_pool_dir(&dir, POOL, &[NodeId(1), NodeId(2), NodeId(3), NodeId(4)]).unwrap();
        Pool { dir, ca }
    }

    fn identity(&self, node: u64) -> NodeIdentity {
        NodeIdentity::load(&self.dir, NodeId(node)).unwrap()
    }

    fn transport(&self, node: u64) -> QuicTransport {
        QuicTransport::bind(loopback(), self.identity(node), QuicConfig::default()).unwrap()
    }

    /// `node` with one lane per peer, so that the lane a server closes is the whole
    /// connection: the broken peer of the bad-frame tests.
    fn one_lane_transport(&self, node: u64) -> QuicTransport {
        QuicTransport::bind(
            loopback(),
            self.identity(node),
            QuicConfig {
                connections_per_peer: 1,
                ..QuicConfig::default()
            },
        )
        .unwrap()
    }

    /// Node 1 serving a `MemStore`.
    fn server(&self) -> (QuicTransport, Server, Arc<MemStore>) {
        let t = self.transport(1);
        let store = Arc::new(MemStore::new(1024));
        let server = t.serve(store.clone()).unwrap();
        (t, server, store)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_get_delete_round_trip_with_checksums() {
    let pool = Pool::new("round-trip");
    let (server, serving, store) = pool.server();
    let client = pool.transport(2);
    let conn = within("connect", WAIT, client.connect(server.local_addr()))
        .await
        .unwrap();
    assert_eq!(conn.peer(), NodeId(1));

    within("round trip", Duration::from_secs(60), round_trip(&conn)).await;
    // What is left on the server: pages (1,2), (2,0) and (3,0).
    assert_eq!(store.len(), 3);

    // Both sides counted the same traffic, each from its side.
    let c = client.stats().peer(NodeId(1)).unwrap();
    let s = server.stats().peer(NodeId(2)).unwrap();
    assert!(c.bytes_out > (68 << 20), "{c:?}");
    assert_eq!(c.frames_rejected, 0);
    wait_for("server counters to settle", WAIT, || {
        let s = server.stats().peer(NodeId(2)).unwrap();
        s.bytes_in == c.bytes_out && s.bytes_out == c.bytes_in
    })
    .await;
    assert_eq!(s.frames_rejected, 0);
    // One per lane.
    assert_eq!(
        server.stats().connections_accepted(),
        u64::from(QuicConfig::default().connections_per_peer)
    );

    serving.shutdown().await;
    // A shut-down server answers no more.
    let err = conn.put_pages(vec![page(5, 0, 100)]).await.unwrap_err();
    assert!(matches!(err, NetError::ConnectionLost { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_share_the_budget() {
    let pool = Pool::new("budget");
    let (server, _serving, store) = pool.server();
    let client = pool.transport(2);
    let conn = client.connect(server.local_addr()).await.unwrap();
    // 48 puts of 4 MiB at once: three times the default 64 MiB budget per peer.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..48 {
        let conn = conn.clone();
        tasks.spawn(async move { conn.put_pages(vec![page(8, i, 4 << 20)]).await });
    }
    within("48 puts", Duration::from_secs(60), async {
        while let Some(r) = tasks.join_next().await {
            assert_eq!(r.unwrap().unwrap(), 1);
        }
    })
    .await;
    assert_eq!(store.len(), 48);
    let stored = store.get(page_id(8, 47)).unwrap();
    assert_eq!(stored, page(8, 47, 4 << 20));
    assert!(stored.verify());
}

/// Connecting as `identity` to node 1 of `pool` must fail, and node 1 must count a refusal.
async fn assert_refused(pool: &Pool, identity: NodeIdentity) -> NetError {
    let (server, _serving, _) = pool.server();
    let stranger = QuicTransport::bind(loopback(), identity, QuicConfig::default()).unwrap();
    let err = within(
        "refused connect",
        WAIT,
        stranger.connect(server.local_addr()),
    )
    .await
    .unwrap_err();
    assert_one_refusal_counted(&server).await;
    err
}

/// Waits until `server` counted one refused handshake, and checks that it accepted no
/// connection and counted no peer.
async fn assert_one_refusal_counted(server: &QuicTransport) {
    wait_for("the server to count the refusal", WAIT, || {
        server.stats().handshakes_refused() == 1
    })
    .await;
    assert_eq!(server.stats().connections_accepted(), 0);
    assert!(server.stats().peers().is_empty());
}

/// Node 9, trusting the pool's CA (so it would accept the server) but presenting
/// `cert_pem` and `key_pem`, which the pool's CA did not sign: its connect must fail with
/// `NetError::Connect`, and node 1 must count the refusal.
async fn assert_stranger_refused(pool: &Pool, cert_pem: &str, key_pem: &str, origin: &str) {
    let identity = NodeIdentity::from_pem(
        POOL,
        NodeId(9),
        pool.ca.cert_pem(),
        cert_pem,
        key_pem,
        Path::new(origin),
    )
    .unwrap();
    let err = assert_refused(pool, identity).await;
    assert!(matches!(err, NetError::Connect { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_signed_peer_is_refused() {
    let pool = Pool::new("self-signed");
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()]).unwrap();
    let key = signing_key.serialize_pem();
    assert_stranger_refused(&pool, &cert.pem(), &key, "self-signed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_signed_by_another_ca_is_refused() {
    let pool = Pool::new("other-ca");
    // Same pool id, another CA: the certificate is what counts.
    let other = PoolCa::generate(POOL).unwrap();
    let foreign = other.issue_node(NodeId(9)).unwrap();
    // Trusting our CA, presenting the other's certificate: the server refuses it.
    assert_stranger_refused(&pool, foreign.cert_pem(), foreign.key_pem(), "other-ca").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_signed_by_another_ca_is_refused_by_the_client() {
    let pool = Pool::new("other-ca-server");
    let other = PoolCa::generate(POOL).unwrap();
    let impostor = QuicTransport::bind(
        loopback(),
        other.issue_node(NodeId(1)).unwrap(),
        QuicConfig::default(),
    )
    .unwrap();
    let _serving = impostor.serve(Arc::new(MemStore::new(8))).unwrap();
    let client = pool.transport(2);
    let err = within("connect", WAIT, client.connect(impostor.local_addr()))
        .await
        .unwrap_err();
    match &err {
        NetError::Connect { reason, .. } => assert!(reason.contains("TLS"), "{err}"),
        other => panic!("{other}"),
    }
    wait_for("the impostor to see the refusal", WAIT, || {
        impostor.stats().handshakes_refused() == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_of_another_pool_id_is_refused_at_hello() {
    let pool = Pool::new("pool-id");
    let mut identity = pool.identity(2);
    identity.pool_id = PoolId(1);
    let err = assert_refused(&pool, identity).await;
    match &err {
        NetError::Connect { reason, .. } => assert!(reason.contains("PoolMismatch"), "{err}"),
        other => panic!("{other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_naming_another_node_than_the_certificate_is_refused_and_counted() {
    let pool = Pool::new("identity");
    let (server, _serving, _) = pool.server();
    // A valid pool certificate of node 2, and a hello that says node 3.
    let mut liar = pool.identity(2);
    liar.node_id = NodeId(3);
    let liar = QuicTransport::bind(loopback(), liar, QuicConfig::default()).unwrap();
    let err = within("refused connect", WAIT, liar.connect(server.local_addr()))
        .await
        .unwrap_err();
    match &err {
        NetError::Connect { reason, .. } => {
            assert!(reason.contains("IdentityMismatch"), "{err}");
            assert!(
                reason.contains("node#2") && reason.contains("node#3"),
                "{err}"
            );
        }
        other => panic!("{other}"),
    }
    assert_one_refusal_counted(&server).await;

    // The same certificate with its own node id in the hello is accepted.
    let honest = pool.transport(2);
    let conn = within("connect", WAIT, honest.connect(server.local_addr()))
        .await
        .unwrap();
    assert_eq!(conn.peer(), NodeId(1));
    assert_eq!(conn.put_pages(vec![page(2, 0, 100)]).await.unwrap(), 1);
    assert_eq!(server.stats().handshakes_refused(), 1);
    // The server counts each lane once its hello is answered, which may come after the
    // client has its connection: wait for the count, do not race it.
    let lanes = u64::from(QuicConfig::default().connections_per_peer);
    wait_for("the server to accept every lane", WAIT, || {
        server.stats().connections_accepted() == lanes
    })
    .await;
    let peers: Vec<NodeId> = server.stats().peers().into_keys().collect();
    assert_eq!(peers, [NodeId(2)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_hello_names_another_node_is_refused_by_the_client() {
    let pool = Pool::new("identity-server");
    // Node 1's certificate, serving as "node 4".
    let mut liar = pool.identity(1);
    liar.node_id = NodeId(4);
    let impostor = QuicTransport::bind(loopback(), liar, QuicConfig::default()).unwrap();
    let _serving = impostor.serve(Arc::new(MemStore::new(8))).unwrap();
    let client = pool.transport(2);
    let err = within("connect", WAIT, client.connect(impostor.local_addr()))
        .await
        .unwrap_err();
    match err {
        NetError::IdentityMismatch {
            claimed, certified, ..
        } => assert_eq!((claimed, certified), (NodeId(4), Some(NodeId(1)))),
        other => panic!("{other}"),
    }
    assert!(client.stats().peers().is_empty());
}

/// Sends `bytes` on a new stream of `conn`, as a broken peer would, and waits until the
/// server closes the connection for a bad frame.
async fn send_raw_and_expect_close(conn: &quinn::Connection, bytes: &[u8]) {
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    // The server may close before it read everything: a failed write is fine.
    let _ = send.write_all(bytes).await;
    let _ = send.finish();
    match within("the server to close the connection", WAIT, conn.closed()).await {
        ConnectionError::ApplicationClosed(close) => {
            assert_eq!(
                close.error_code,
                VarInt::from_u32(CLOSE_BAD_FRAME),
                "{close}"
            );
        }
        other => panic!("closed for another reason: {other}"),
    }
}

/// The bytes of a frame header of request 1 claiming these lengths, to be sent alone.
fn header_only(kind: Kind, body_bytes: u32, payload_bytes: u64) -> [u8; wire::HEADER_BYTES] {
    FrameHeader {
        kind,
        request_id: 1,
        body_bytes,
        payload_bytes,
    }
    .encode()
}

/// Frames rejected from `node` so far, as `server` counts them.
fn rejected(server: &QuicTransport, node: u64) -> u64 {
    server
        .stats()
        .peer(NodeId(node))
        .map_or(0, |c| c.frames_rejected)
}

/// `bad_node` connects to `server` afresh and sends `bytes`; the server closes that
/// connection for a bad frame and counts it as the `nth` frame rejected from node 3.
/// Returns the closed connection.
async fn send_bad_frame(
    bad_node: &QuicTransport,
    server: &QuicTransport,
    bytes: &[u8],
    what: &str,
    nth: u64,
) -> QuicConnection {
    let bad = bad_node.connect(server.local_addr()).await.unwrap();
    send_raw_and_expect_close(bad.quinn(), bytes).await;
    wait_for(what, WAIT, || rejected(server, 3) == nth).await;
    bad
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_frames_close_their_connection_and_are_counted() {
    let pool = Pool::new("bad-frames");
    let (server, _serving, _) = pool.server();
    let good_node = pool.transport(2);
    let good = good_node.connect(server.local_addr()).await.unwrap();
    assert_eq!(good.put_pages(vec![page(1, 0, 1 << 20)]).await.unwrap(), 1);

    let bad_node = pool.one_lane_transport(3);

    // 1. Garbage: bad magic.
    let bad = send_bad_frame(
        &bad_node,
        &server,
        b"this is not a spillway frame, only garbage bytes",
        "the garbage frame to be counted",
        1,
    )
    .await;
    let err = bad.put_pages(vec![page(3, 0, 10)]).await.unwrap_err();
    assert!(matches!(err, NetError::ConnectionLost { .. }), "{err}");

    // 2. A body larger than FRAME_BODY_BYTES_MAX, refused from the header alone.
    let header = header_only(Kind::GetPages, wire::FRAME_BODY_BYTES_MAX + 1, 0);
    let body = "the oversized body to be counted";
    send_bad_frame(&bad_node, &server, &header, body, 2).await;

    // 3. A payload larger than FRAME_PAYLOAD_BYTES_MAX.
    let header = header_only(Kind::PutPages, 1, wire::FRAME_PAYLOAD_BYTES_MAX + 1);
    let payload = "the oversized payload to be counted";
    send_bad_frame(&bad_node, &server, &header, payload, 3).await;

    // 4. A page whose bytes do not match its checksum.
    let p = page(3, 1, 4096);
    let mut desc = wire::PageDesc::for_page(p.id, &p.data);
    desc.checksum ^= 1;
    let mut frame = wire::encode_frame(
        1,
        &wire::Message::PutPages(wire::PutPages { pages: vec![desc] }),
    )
    .unwrap();
    frame.extend_from_slice(&p.data);
    let mismatch = "the checksum mismatch to be counted";
    send_bad_frame(&bad_node, &server, &frame, mismatch, 4).await;

    // 5. A good frame with bytes after it: its lengths lied.
    let mut frame = wire::encode_frame(
        1,
        &wire::Message::GetPages(wire::GetPages {
            pages: vec![page_id(1, 0)],
        }),
    )
    .unwrap();
    frame.extend_from_slice(b"trailing");
    let trailing = "the trailing bytes to be counted";
    send_bad_frame(&bad_node, &server, &frame, trailing, 5).await;

    // The good client was never disturbed and still works; nothing was counted against it.
    assert_eq!(good.put_pages(vec![page(1, 1, 1 << 20)]).await.unwrap(), 1);
    let (got, missing) = good
        .get_pages(vec![page_id(1, 0), page_id(1, 1)])
        .await
        .unwrap();
    assert!(missing.is_empty());
    assert_eq!(got[1], page(1, 1, 1 << 20));
    assert_eq!(server.stats().peer(NodeId(2)).unwrap().frames_rejected, 0);
    // And the bad node may come back with good frames on a new connection.
    let again = bad_node.connect(server.local_addr()).await.unwrap();
    assert_eq!(again.put_pages(vec![page(3, 2, 100)]).await.unwrap(), 1);
    assert_eq!(server.stats().total().frames_rejected, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_a_hello_is_counted_as_unidentified() {
    let pool = Pool::new("bad-hello");
    let (server, _serving, _) = pool.server();
    let client = pool.transport(2);
    // TLS with a valid pool certificate, then garbage where the hello should be.
    let conn = client.connect_tls_only(server.local_addr()).await.unwrap();
    send_raw_and_expect_close(&conn, b"hello? no: garbage bytes instead of a hello frame").await;
    wait_for("the bad hello to be counted", WAIT, || {
        server.stats().unidentified().frames_rejected == 1
            && server.stats().handshakes_refused() == 1
    })
    .await;
    // The same node says hello properly and is served.
    let good = client.connect(server.local_addr()).await.unwrap();
    assert_eq!(good.put_pages(vec![page(2, 0, 100)]).await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_sent_as_a_request_gets_an_error_reply_not_a_closed_connection() {
    let pool = Pool::new("reply-as-request");
    let (server, _serving, _) = pool.server();
    let client = pool.transport(2);
    let conn = client.connect(server.local_addr()).await.unwrap();
    let frame = wire::encode_frame(
        7,
        &wire::Message::PutPagesReply(wire::PutPagesReply { pages_stored: 1 }),
    )
    .unwrap();
    let (mut send, mut recv) = conn.quinn().open_bi().await.unwrap();
    send.write_all(&frame).await.unwrap();
    send.finish().unwrap();
    let reply = within("the error reply", WAIT, recv.read_to_end(4096))
        .await
        .unwrap();
    let (frame, _) = wire::decode_frame(&reply).unwrap();
    match frame.message {
        wire::Message::Error(e) => assert_eq!(e.code, wire::ErrorCode::BadRequest),
        other => panic!("{other:?}"),
    }
    assert_eq!(frame.header.request_id, 7);
    assert_eq!(server.stats().total().frames_rejected, 0);
    // The connection is still good.
    assert_eq!(conn.put_pages(vec![page(2, 0, 100)]).await.unwrap(), 1);
}

/// Answers Raft messages with an ack and proposals with their bytes reversed.
struct BlobEcho;

impl spillway_net::Handler for BlobEcho {
    async fn handle(
        &self,
        _peer: NodeId,
        request: spillway_net::Request,
    ) -> spillway_net::Response {
        match request {
            spillway_net::Request::Raft { .. } => spillway_net::Response::RaftAck,
            spillway_net::Request::Propose { batch } => {
                let mut v = batch.to_vec();
                v.reverse();
                spillway_net::Response::Propose { reply: v.into() }
            }
            _ => spillway_net::Response::Error(wire::ErrorReply::new(
                wire::ErrorCode::BadRequest,
                "blobs only",
            )),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_and_proposal_blobs_round_trip_and_bad_ones_close_the_connection() {
    use spillway_net::{Request, Response};
    let pool = Pool::new("blobs");
    let server = pool.transport(1);
    let _serving = server.serve(Arc::new(BlobEcho)).unwrap();
    let client = pool.transport(2);
    let conn = client.connect(server.local_addr()).await.unwrap();
    // A message larger than one blob chunk travels in several, checked each.
    let big: Vec<u8> = (0..(wire::BLOB_CHUNK_BYTES as usize + 123))
        .map(|i| (i % 251) as u8)
        .collect();
    let reply = conn
        .request(Request::Raft {
            message: big.clone().into(),
        })
        .await
        .unwrap();
    assert_eq!(reply, Response::RaftAck);
    let reply = conn
        .request(Request::Propose {
            batch: vec![1u8, 2, 3].into(),
        })
        .await
        .unwrap();
    assert_eq!(
        reply,
        Response::Propose {
            reply: vec![3u8, 2, 1].into()
        }
    );
    // A proposal over PROPOSAL_PAYLOAD_BYTES_MAX is refused before it is sent.
    let err = conn
        .request(Request::Propose {
            batch: vec![0u8; wire::PROPOSAL_PAYLOAD_BYTES_MAX as usize + 1].into(),
        })
        .await
        .unwrap_err();
    assert!(matches!(err, NetError::Encode { .. }), "{err}");

    let bad_node = pool.one_lane_transport(3);
    // 1. A Raft message claiming more than RAFT_PAYLOAD_BYTES_MAX.
    let header = header_only(Kind::RaftMessage, 1, wire::RAFT_PAYLOAD_BYTES_MAX + 1);
    let oversized = "the oversized Raft message to be counted";
    send_bad_frame(&bad_node, &server, &header, oversized, 1).await;
    // 2. A proposal whose bytes do not match their checksum.
    let data = vec![7u8; 100];
    let mut blob = wire::Blob::describe(&data);
    blob.chunks[0].checksum ^= 1;
    let mut frame = wire::encode_frame(1, &wire::Message::Propose(blob)).unwrap();
    frame.extend_from_slice(&data);
    let corrupt = "the corrupt proposal to be counted";
    send_bad_frame(&bad_node, &server, &frame, corrupt, 2).await;
    // 3. A Raft message whose body lies about its length.
    let mut frame =
        wire::encode_frame(1, &wire::Message::RaftMessage(wire::Blob::describe(&data))).unwrap();
    frame.extend_from_slice(&data[..50]);
    let truncated = "the truncated Raft message to be counted";
    send_bad_frame(&bad_node, &server, &frame, truncated, 3).await;
    // The good peer is still served.
    let reply = conn
        .request(Request::Raft {
            message: vec![1u8; 10].into(),
        })
        .await
        .unwrap();
    assert_eq!(reply, Response::RaftAck);
    assert_eq!(server.stats().peer(NodeId(2)).unwrap().frames_rejected, 0);
}
