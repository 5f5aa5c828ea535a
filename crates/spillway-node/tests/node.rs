//! Nodes on loopback (127.0.0.1, port 0): two nodes of one pool move pages between them
//! with checksums verified; a node of another pool is refused; a malformed frame closes
//! only its connection and is counted; a full host tier answers with its typed error and
//! loses nothing; shutdown completes; `/status` answers at once while slow clients hold
//! hundreds of connections open.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use quinn::{ConnectionError, VarInt};
use spillway_net::certs::init_pool_dir;
use spillway_net::quic::CLOSE_BAD_FRAME;
use spillway_net::{Connection, NetError, Page};
use spillway_node::{Node, NodeConfig, NodeHandle};
use spillway_types::wire::{self, ErrorCode};
use spillway_types::{NodeId, PageSize, PoolId, pattern};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use common::{TempDir, page_id};

const POOL: PoolId = PoolId(0x05b1_10de);
const PAGE: u64 = 64 << 10;
const WAIT: Duration = Duration::from_secs(10);

/// A pool directory with nodes 1 to 3 of pool `pool`.
fn pool_dir(root: &TempDir, pool: PoolId) -> PathBuf {
    let dir = root.0.join(format!("pool-{}", pool.0));
    init_pool_dir(&dir, pool, &[NodeId(1), NodeId(2), NodeId(3)]).unwrap();
    dir
}

/// A node's config: loopback, port 0, 64 KiB pages, a host tier of `tier_pages` pages.
fn config(root: &TempDir, pool_dir: &std::path::Path, node: u64, tier_pages: u64) -> NodeConfig {
    let mut c = NodeConfig::new(
        NodeId(node),
        pool_dir.to_path_buf(),
        root.0.join(format!("data-{node}")),
        tier_pages * PAGE,
    );
    c.listen_addr = "127.0.0.1:0".parse().unwrap();
    c.metrics_addr = "127.0.0.1:0".parse().unwrap();
    c.page_size = PageSize::new(PAGE).unwrap();
    c
}

async fn start(c: NodeConfig) -> NodeHandle {
    within("node start", Node::start(c)).await.unwrap()
}

/// Nodes 1 (A) and 2 (B) of [`POOL`], each with a host tier of `tier_pages` pages, under a
/// fresh root named `name`; the root and the pool directory come back for more nodes.
async fn two_nodes(name: &str, tier_pages: u64) -> (TempDir, PathBuf, NodeHandle, NodeHandle) {
    let root = TempDir::new(name);
    let pool = pool_dir(&root, POOL);
    let a = start(config(&root, &pool, 1, tier_pages)).await;
    let b = start(config(&root, &pool, 2, tier_pages)).await;
    (root, pool, a, b)
}

/// Shuts `nodes` down in turn, each within [`WAIT`].
async fn shutdown(nodes: impl IntoIterator<Item = NodeHandle>) {
    for n in nodes {
        within("shutdown", n.shutdown()).await;
    }
}

/// A page filled with the pattern for its id.
fn page(buffer: u64, index: u32, len: usize) -> Page {
    let mut data = vec![0u8; len];
    pattern::fill(buffer * 1_000_003 + u64::from(index), &mut data);
    Page::new(page_id(buffer, index), Bytes::from(data))
}

/// Awaits `f`, failing the test if it takes longer than [`WAIT`].
async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Polls `cond` (counters another task updates) until it holds; fails after [`WAIT`].
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Checks the pages independently of the transport's checks.
fn assert_same(got: &[Page], sent: &[Page]) {
    assert_eq!(got.len(), sent.len());
    for (g, s) in got.iter().zip(sent) {
        assert_eq!(g.id, s.id);
        assert!(g.verify(), "page {} does not match its checksum", g.id);
        assert_eq!(wire::page_checksum(&g.data), wire::page_checksum(&s.data));
        assert!(g.data == s.data, "page {} came back changed", g.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_a_puts_pages_on_node_b_and_gets_them_back() {
    let (_root, _pool, a, b) = two_nodes("put-get", 16).await;
    assert!(b.config().data_dir.is_dir());

    let conn = within("connect", a.connect(b.local_addr())).await.unwrap();
    assert_eq!(conn.peer(), NodeId(2));
    let pages = vec![
        page(1, 0, PAGE as usize),
        page(1, 1, PAGE as usize),
        page(1, 2, 12_345),
    ];
    assert_eq!(
        within("put", conn.put_pages(pages.clone())).await.unwrap(),
        3
    );
    let wanted = vec![page_id(1, 2), page_id(9, 9), page_id(1, 0), page_id(1, 1)];
    let (got, missing) = within("get", conn.get_pages(wanted)).await.unwrap();
    assert_eq!(missing, vec![page_id(9, 9)]);
    assert_same(
        &got,
        &[pages[2].clone(), pages[0].clone(), pages[1].clone()],
    );

    let (deleted, missing) = within(
        "delete",
        conn.delete_pages(vec![page_id(1, 0), page_id(7, 7)]),
    )
    .await
    .unwrap();
    assert_eq!((deleted, missing), (1, 1));

    let c = b.counters();
    assert_eq!(c.store.pages, 2);
    assert_eq!(c.store.used_bytes, PAGE + 12_345);
    assert_eq!((c.store.pages_put, c.store.pages_got), (3, 3));
    assert_eq!(c.frames_rejected, 0);
    assert!(c.peer_bytes_in > 2 * PAGE, "{c:?}");
    // A put nothing on itself.
    assert_eq!(a.counters().store.pages, 0);

    shutdown([a, b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_another_pool_is_refused() {
    let root = TempDir::new("other-pool");
    let pool = pool_dir(&root, POOL);
    let other = pool_dir(&root, PoolId(0x0e1e));
    let b = start(config(&root, &pool, 2, 4)).await;
    // Node 1 of another pool: another CA, another pool id.
    let stranger = start(config(&root, &other, 1, 4)).await;

    let err = within("refused connect", stranger.connect(b.local_addr()))
        .await
        .unwrap_err();
    assert!(matches!(err, NetError::Connect { .. }), "{err}");
    wait_for("b to count the refusal", || {
        b.counters().handshakes_refused == 1
    })
    .await;
    let c = b.counters();
    assert_eq!(c.connections_accepted, 0);
    assert_eq!(c.store.pages, 0);
    assert!(b.net_stats().peers().is_empty());

    within("shutdown", stranger.shutdown()).await;
    within("shutdown", b.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_frame_closes_its_connection_is_counted_and_b_keeps_serving_a() {
    let (root, pool, a, b) = two_nodes("bad-frame", 16).await;
    // Node 3 of the pool, broken: one lane, so the lane B closes is its whole connection.
    let mut c3 = config(&root, &pool, 3, 4);
    c3.quic.connections_per_peer = 1;
    let broken = start(c3).await;

    let good = a.connect(b.local_addr()).await.unwrap();
    let first = page(1, 0, PAGE as usize);
    assert_eq!(good.put_pages(vec![first.clone()]).await.unwrap(), 1);

    let bad = broken.connect(b.local_addr()).await.unwrap();
    let (mut send, _recv) = bad.quinn().open_bi().await.unwrap();
    // B may close before it read everything: a failed write is fine.
    let _ = send
        .write_all(b"this is not a spillway frame, only garbage bytes")
        .await;
    let _ = send.finish();
    match within("b to close the connection", bad.quinn().closed()).await {
        ConnectionError::ApplicationClosed(close) => {
            assert_eq!(
                close.error_code,
                VarInt::from_u32(CLOSE_BAD_FRAME),
                "{close}"
            );
        }
        other => panic!("closed for another reason: {other}"),
    }
    wait_for("the bad frame to be counted", || {
        b.counters().frames_rejected == 1
    })
    .await;
    assert_eq!(
        b.net_stats().peer(NodeId(3)).unwrap().frames_rejected,
        1,
        "counted against the node that sent it"
    );
    let err = bad.put_pages(vec![page(3, 0, 10)]).await.unwrap_err();
    assert!(matches!(err, NetError::ConnectionLost { .. }), "{err}");

    // A was not disturbed: its connection still puts and gets.
    let second = page(1, 1, 4096);
    assert_eq!(good.put_pages(vec![second.clone()]).await.unwrap(), 1);
    let (got, missing) = good
        .get_pages(vec![page_id(1, 0), page_id(1, 1)])
        .await
        .unwrap();
    assert!(missing.is_empty());
    assert_same(&got, &[first, second]);
    assert_eq!(b.net_stats().peer(NodeId(1)).unwrap().frames_rejected, 0);
    assert_eq!(b.counters().frames_rejected, 1);
    assert_eq!(b.counters().store.pages, 2, "the bad frame stored nothing");

    shutdown([broken, a, b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_host_tier_answers_no_capacity_and_loses_no_page() {
    let (_root, _pool, a, b) = two_nodes("full", 4).await;
    let conn = a.connect(b.local_addr()).await.unwrap();

    let held: Vec<Page> = (0..3).map(|i| page(1, i, PAGE as usize)).collect();
    assert_eq!(conn.put_pages(held.clone()).await.unwrap(), 3);
    // Two more pages: one fits, two do not; the put fails whole.
    let err = conn
        .put_pages(vec![page(2, 0, PAGE as usize), page(2, 1, PAGE as usize)])
        .await
        .unwrap_err();
    match &err {
        NetError::Remote {
            peer,
            code,
            message,
        } => {
            assert_eq!(*peer, NodeId(2));
            assert_eq!(*code, ErrorCode::NoCapacity);
            let numbers = format!(
                "{} more bytes requested, {} of {} used",
                2 * PAGE,
                3 * PAGE,
                4 * PAGE
            );
            assert!(message.contains(&numbers), "{message}");
        }
        other => panic!("{other}"),
    }
    let c = b.counters().store;
    assert_eq!(
        (c.pages, c.used_bytes, c.puts_refused_full),
        (3, 3 * PAGE, 1)
    );

    // No page was lost or replaced, and none of the refused put was stored.
    let ids = vec![page_id(1, 0), page_id(1, 1), page_id(1, 2), page_id(2, 0)];
    let (got, missing) = conn.get_pages(ids).await.unwrap();
    assert_eq!(missing, vec![page_id(2, 0)]);
    assert_same(&got, &held);
    // The one that fits still does.
    assert_eq!(
        conn.put_pages(vec![page(2, 0, PAGE as usize)])
            .await
            .unwrap(),
        1
    );

    shutdown([a, b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_completes_and_peers_see_the_connection_close() {
    let (_root, _pool, a, b) = two_nodes("shutdown", 4).await;
    let conn = a.connect(b.local_addr()).await.unwrap();
    assert_eq!(conn.put_pages(vec![page(1, 0, 100)]).await.unwrap(), 1);

    within("b's shutdown", b.shutdown()).await;
    let err = within(
        "a put to a stopped node",
        conn.put_pages(vec![page(1, 1, 100)]),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            NetError::ConnectionLost { .. } | NetError::Connect { .. }
        ),
        "{err}"
    );
    within("a's shutdown", a.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_its_certificate_does_not_start() {
    let root = TempDir::new("no-cert");
    let pool = pool_dir(&root, POOL);
    let err = Node::start(config(&root, &pool, 4, 4)).await.unwrap_err();
    assert!(
        err.to_string().contains("node#4"),
        "the error names the node: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_starts_from_a_toml_file() {
    let root = TempDir::new("toml");
    let pool = pool_dir(&root, POOL);
    let path = root.0.join("node.toml");
    std::fs::write(
        &path,
        format!(
            "node_id = 2\npool_dir = {:?}\ndata_dir = {:?}\nhost_tier_bytes = {}\n\
             listen_addr = \"127.0.0.1:0\"\npage_size = {PAGE}\n\n[quic]\nconnections_per_peer = 1\n",
            pool.display().to_string(),
            root.0.join("data-2").display().to_string(),
            8 * PAGE,
        ),
    )
    .unwrap();
    let b = start(NodeConfig::load(&path).unwrap()).await;
    assert_eq!(b.node_id(), NodeId(2));
    assert_eq!(b.pool_id(), POOL);
    assert_eq!(b.counters().store.budget_bytes, 8 * PAGE);

    // And a bad one names the file and the field.
    std::fs::write(&path, "node_id = 2\nhost_tier_bytes = -1\n").unwrap();
    let err = NodeConfig::load(&path).unwrap_err().to_string();
    assert!(err.contains("host_tier_bytes"), "{err}");
    assert!(err.contains(&path.display().to_string()), "{err}");
    within("shutdown", b.shutdown()).await;
}

/// Slow clients cannot starve `/status` (issue 13): with 200 connections held open, each
/// having sent part of a request head, fresh `GET /status` requests are each answered
/// within 100 ms. (Before, 32 such clients held every slot for their 5 s timeouts.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_answers_within_100ms_while_200_slow_connections_are_held() {
    const SLOW: usize = 200;
    const PROBES: usize = 10;
    const DEADLINE: Duration = Duration::from_millis(100);
    let root = TempDir::new("slow-http");
    let pool = pool_dir(&root, POOL);
    let node = start(config(&root, &pool, 1, 4)).await;
    let addr = node.metrics_addr();
    let mut slow = Vec::with_capacity(SLOW);
    for _ in 0..SLOW {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /status HTTP/1.1\r\nHost: slow\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    // Time for the node to take them all from the backlog.
    tokio::time::sleep(Duration::from_millis(200)).await;

    let mut latencies_ms = Vec::with_capacity(PROBES);
    for i in 0..PROBES {
        let started = Instant::now();
        let probe = async {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /status HTTP/1.1\r\nHost: probe\r\n\r\n")
                .await
                .unwrap();
            let mut reply = String::new();
            s.read_to_string(&mut reply).await.unwrap();
            reply
        };
        // Far above the deadline, so a starved probe fails here with a clear message
        // rather than after the slow clients' timeouts.
        let reply = tokio::time::timeout(Duration::from_secs(2), probe)
            .await
            .unwrap_or_else(|_| panic!("probe {i}: no answer within 2 s"));
        let elapsed = started.elapsed();
        assert!(
            reply.starts_with("HTTP/1.1 200 OK\r\n"),
            "probe {i}: {reply}"
        );
        assert!(reply.contains("\"node_id\":1"), "probe {i}: {reply}");
        latencies_ms.push(elapsed.as_secs_f64() * 1e3);
    }
    let figures: Vec<String> = latencies_ms.iter().map(|ms| format!("{ms:.2}")).collect();
    println!(
        "GET /status with {SLOW} slow connections held: {} ms (max {:.2} ms)",
        figures.join(", "),
        latencies_ms.iter().copied().fold(0.0, f64::max)
    );
    for (i, ms) in latencies_ms.iter().enumerate() {
        assert!(
            *ms < DEADLINE.as_secs_f64() * 1e3,
            "probe {i} took {ms:.2} ms; all: {figures:?}"
        );
    }
    // The slow clients are still connected: none was closed to make room.
    for (i, s) in slow.iter_mut().enumerate() {
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_millis(1), s.read(&mut b)).await;
        assert!(
            r.is_err(),
            "slow connection {i} was closed or answered: {r:?}"
        );
    }
    drop(slow);
    within("shutdown", node.shutdown()).await;
}
