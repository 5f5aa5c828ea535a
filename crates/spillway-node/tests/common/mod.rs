//! Helpers of the pool tests: a pool of three nodes on loopback with members, waiting
//! for conditions with deadlines, pages with patterns.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use spillway_meta::Role;
use spillway_net::QuicConfig;
use spillway_net::certs::init_pool_dir;
use spillway_net::sim::{SimNetwork, SimTransport};
use spillway_node::{MemberAddr, MetaView, Node, NodeConfig, NodeHandle, PageTransport};
use spillway_types::{BufferId, NodeId, PageId, PageSize, PoolId, pattern};

pub const POOL: PoolId = PoolId(0x0c15_7e40);
pub const WAIT: Duration = Duration::from_secs(20);

/// A fresh directory unique to this test, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let dir = tempfile::Builder::new()
            .prefix(&format!("spillway-cluster-{name}-"))
            .tempdir()
            .expect("a temporary directory");
        // Removed by this type's drop, as a plain path the tests join onto.
        TempDir(dir.keep())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Free UDP ports on loopback (bound and released; the nodes bind them right after).
pub fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let sockets: Vec<std::net::UdpSocket> = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    sockets.iter().map(|s| s.local_addr().unwrap()).collect()
}

/// The page transport the pool tests run over: `SPILLWAY_TEST_TRANSPORT` (`quic`, the
/// default, or `ucx`, which needs the `ucx` feature; run UCX with
/// `UCX_NET_DEVICES=lo UCX_TLS=tcp,self` so it stays on loopback).
pub fn test_transport() -> PageTransport {
    match std::env::var("SPILLWAY_TEST_TRANSPORT").as_deref() {
        Ok("ucx") => {
            assert_eq!(
                std::env::var("UCX_NET_DEVICES").as_deref(),
                Ok("lo"),
                "UCX tests run on loopback only: set UCX_NET_DEVICES=lo"
            );
            PageTransport::Ucx
        }
        Ok("quic") | Err(_) => PageTransport::Quic,
        Ok(other) => panic!("SPILLWAY_TEST_TRANSPORT={other}: expected quic or ucx"),
    }
}

/// Members 1, 2, ... at `addrs`, in order.
pub fn members_at(addrs: &[SocketAddr]) -> Vec<MemberAddr> {
    addrs
        .iter()
        .enumerate()
        .map(|(i, a)| MemberAddr {
            id: NodeId(i as u64 + 1),
            addr: *a,
        })
        .collect()
}

/// The config of member `i` (node `i + 1`) of `members`: its data under `root`, listening
/// at its member address, status on any loopback port, `page` pages, `tier_pages` of them
/// lent, reservations taken 4 pages at a time.
pub fn member_config(
    root: &TempDir,
    pool_dir: &std::path::Path,
    members: &[MemberAddr],
    i: usize,
    page: u64,
    tier_pages: u64,
) -> NodeConfig {
    let mut c = NodeConfig::new(
        NodeId(i as u64 + 1),
        pool_dir.to_path_buf(),
        root.0.join(format!("data-{}", i + 1)),
        tier_pages * page,
    );
    c.listen_addr = members[i].addr;
    c.metrics_addr = "127.0.0.1:0".parse().unwrap();
    c.page_size = PageSize::new(page).unwrap();
    c.members = members.to_vec();
    c.reserve_chunk_bytes = 4 * page;
    c
}

/// A pool of three: configs with members, loopback addresses, `page` pages.
pub struct Pool {
    pub root: TempDir,
    pub configs: Vec<NodeConfig>,
}

impl Pool {
    pub fn new(name: &str, page: u64, tier_pages: [u64; 3]) -> Pool {
        let root = TempDir::new(name);
        let pool_dir = root.0.join("pool");
        init_pool_dir(
            &pool_dir,
            POOL,
            &[NodeId(1), NodeId(2), NodeId(3), NodeId(4)],
        )
        .unwrap();
        let members = members_at(&free_addrs(3));
        let configs = (0..3)
            .map(|i| {
                let mut c = member_config(&root, &pool_dir, &members, i, page, tier_pages[i]);
                c.transport = test_transport();
                c
            })
            .collect();
        Pool { root, configs }
    }

    /// The same pool keeping one copy of each page (`replicas = 1` on every node): a
    /// page is lost with its holder.
    pub fn one_copy(mut self) -> Pool {
        for c in &mut self.configs {
            c.replicas = 1;
        }
        self
    }

    pub async fn start(&self, i: usize) -> NodeHandle {
        within("node start", Node::start(self.configs[i].clone()))
            .await
            .unwrap()
    }

    /// Starts node `i` again after a shutdown in this process: its UDP port is released
    /// when the endpoint's driver task notices the last handle is gone, so a bind may
    /// briefly find it in use; that (and only that) is retried until the deadline.
    pub async fn restart(&self, i: usize) -> NodeHandle {
        let deadline = Instant::now() + WAIT;
        loop {
            match Node::start(self.configs[i].clone()).await {
                Ok(n) => return n,
                Err(spillway_node::NodeError::Bind { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("restart of node {}: {e}", i + 1),
            }
        }
    }

    pub async fn start_all(&self) -> Vec<Option<NodeHandle>> {
        let mut v = Vec::new();
        for i in 0..3 {
            v.push(Some(self.start(i).await));
        }
        v
    }

    /// Starts all three nodes and waits until they have [`settled`]; returns them and
    /// their leader.
    pub async fn start_settled(&self) -> (Vec<Option<NodeHandle>>, NodeId) {
        let nodes = self.start_all().await;
        let leader = settled(&nodes).await;
        (nodes, leader)
    }
}

pub async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Polls `cond` every 5 ms until it returns `Some`; panics after `timeout`.
pub async fn wait_for<T>(what: &str, timeout: Duration, mut cond: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Transports of members `1..=n` of [`POOL`] on the simulated network `net`, and their
/// addresses.
pub fn sim_transports(net: &SimNetwork, n: u64) -> (Vec<SimTransport>, Vec<SocketAddr>) {
    let transports: Vec<SimTransport> = (1..=n)
        .map(|i| net.transport(POOL, NodeId(i), &QuicConfig::default()))
        .collect();
    let addrs = transports
        .iter()
        .map(spillway_net::Transport::local_addr)
        .collect();
    (transports, addrs)
}

/// Whether `view` shows every live node of `nodes` with its lent capacity.
pub fn capacities_applied(nodes: &[Option<NodeHandle>], view: &MetaView) -> bool {
    view.members.iter().all(|m| {
        nodes
            .iter()
            .flatten()
            .find(|h| h.node_id() == m.id)
            .is_none_or(|h| m.capacity_bytes == h.config().lend_bytes)
    })
}

/// The leader all live nodes agree on (same leader, same term, one of them leads), once
/// every member's lent capacity is applied on all of them.
pub async fn settled(nodes: &[Option<NodeHandle>]) -> NodeId {
    wait_for("a leader and the members' capacity", WAIT, || {
        let live: Vec<&NodeHandle> = nodes.iter().flatten().collect();
        let v0 = live[0].meta_view();
        let leader = v0.leader?;
        let leads = live
            .iter()
            .any(|n| n.node_id() == leader && n.role() == Role::Leader);
        let agree = live.iter().all(|n| {
            let v = n.meta_view();
            v.leader == Some(leader)
                && v.term == v0.term
                && v.members.len() == 3
                && capacities_applied(nodes, &v)
        });
        (leads && agree).then_some(leader)
    })
    .await
}

/// The first live node whose id `pick` accepts.
///
/// # Panics
/// If no live node is picked.
pub fn live_node(nodes: &[Option<NodeHandle>], pick: impl Fn(NodeId) -> bool) -> &NodeHandle {
    nodes
        .iter()
        .flatten()
        .find(|n| pick(n.node_id()))
        .expect("a live node picked")
}

/// Waits (up to 5 s) until the live nodes agree on a leader of a term after `term`, other
/// than `old`, which stopped (`how`) at `since`; prints and returns how long that took.
pub async fn new_leader_elected(
    nodes: &[Option<NodeHandle>],
    old: NodeId,
    term: u64,
    since: Instant,
    how: &str,
) -> Duration {
    let new_leader = wait_for("a new leader", Duration::from_secs(5), || {
        let live: Vec<&NodeHandle> = nodes.iter().flatten().collect();
        let l = live
            .iter()
            .find(|n| n.role() == Role::Leader && n.term() > term)?;
        live.iter()
            .all(|n| n.leader() == Some(l.node_id()))
            .then_some(l.node_id())
    })
    .await;
    let elected = since.elapsed();
    println!(
        "new leader {new_leader} elected {} ms after the leader {how}",
        elected.as_millis()
    );
    assert_ne!(new_leader, old);
    elected
}

pub fn page_id(buffer: u64, index: u32) -> PageId {
    PageId {
        buffer: BufferId(buffer),
        index,
    }
}

pub fn page_bytes(seed: u64, len: u64) -> Bytes {
    let mut d = vec![0u8; len as usize];
    pattern::fill(seed, &mut d);
    Bytes::from(d)
}

/// Pages `0..count` of `buffer`, `len` bytes each, page `i` filled from seed `seed + i`.
pub fn patterned_pages(buffer: u64, count: u32, seed: u64, len: u64) -> Vec<(PageId, Bytes)> {
    (0..count)
        .map(|i| (page_id(buffer, i), page_bytes(seed + u64::from(i), len)))
        .collect()
}

pub async fn shutdown_all(nodes: Vec<Option<NodeHandle>>) {
    for n in nodes.into_iter().flatten() {
        within("shutdown", n.shutdown()).await;
    }
}

/// Polls an async condition every 5 ms until `Some`, within [`WAIT`].
pub async fn wait_for_async<T, F, Fut>(mut cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = cond().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
