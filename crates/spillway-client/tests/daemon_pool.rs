//! Daemon mode end to end: three nodes of one pool on loopback QUIC, a client process's
//! pool (here, this test) linked to node 1's socket. Pages leave the client's host tier
//! (the memory it shares with node 1), land on nodes 2 and 3, and come back byte for
//! byte; when the client goes, node 1 discards them from the peers.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use spillway_client::daemon::DaemonLink;
use spillway_client::{DeviceChoice, PageSize};
use spillway_meta::Role;
use spillway_net::certs::init_pool_dir;
use spillway_node::{MemberAddr, Node, NodeConfig, NodeHandle};
use spillway_types::{NodeId, PoolId};

const PAGE: u64 = 64 << 10;
const WAIT: Duration = Duration::from_secs(30);

/// Free UDP ports on loopback (bound and released; the nodes bind them right after).
fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let sockets: Vec<std::net::UdpSocket> = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    sockets.iter().map(|s| s.local_addr().unwrap()).collect()
}

/// Polls `cond` (state other threads change) every 5 ms; panics after [`WAIT`].
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        // The poll interval: `cond` reads state of the node's tasks, which signal
        // nothing this test could wait on.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pool_spills_through_its_node_to_the_peers() {
    let root = tempfile::tempdir().unwrap();
    let pool_dir = root.path().join("pool");
    init_pool_dir(&pool_dir, PoolId(0xda3), &[NodeId(1), NodeId(2), NodeId(3)]).unwrap();
    let addrs = free_addrs(3);
    let members: Vec<MemberAddr> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| MemberAddr {
            id: NodeId(i as u64 + 1),
            addr: *a,
        })
        .collect();
    let mut nodes: Vec<NodeHandle> = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let mut c = NodeConfig::new(
            NodeId(i as u64 + 1),
            pool_dir.clone(),
            root.path().join(format!("data-{}", i + 1)),
            256 * PAGE,
        );
        c.listen_addr = *addr;
        c.metrics_addr = "127.0.0.1:0".parse().unwrap();
        c.page_size = PageSize::new(PAGE).unwrap();
        c.members = members.clone();
        c.reserve_chunk_bytes = 4 * PAGE;
        let node = tokio::time::timeout(WAIT, Node::start(c)).await.unwrap();
        nodes.push(node.unwrap());
    }
    wait_for("a leader and every member's capacity", || {
        let views: Vec<_> = nodes.iter().map(|n| n.meta_view()).collect();
        let leader = views[0].leader;
        leader.is_some()
            && nodes
                .iter()
                .any(|n| Some(n.node_id()) == leader && n.role() == Role::Leader)
            && views.iter().all(|v| {
                v.leader == leader
                    && v.members.len() == 3
                    && v.members.iter().all(|m| m.capacity_bytes > 0)
            })
    })
    .await;
    let socket = nodes[0].config().client_socket.clone();

    // The client: blocking code, as in a training process.
    let client = tokio::task::spawn_blocking(move || {
        let link = DaemonLink::connect(&socket, 8 * PAGE, PageSize::new(PAGE).unwrap()).unwrap();
        assert!(link.remote_capacity_bytes() >= 48 * PAGE, "{link:?}");
        let (pool, _bufs) = common::spill_through_link(&link, DeviceChoice::Sim, 16);
        pool.quiesce();
        (link, pool)
    })
    .await
    .unwrap();

    // The pages went to the peers, never to node 1's own host tier.
    let held_by = |i: usize| nodes[i].store().used_bytes_of(NodeId(1));
    assert_eq!(held_by(0), 0);
    assert!(held_by(1) + held_by(2) > 0);
    let remote = nodes[0].remote().counters();
    assert!(
        remote.pages_spilled > 0 && remote.pages_fetched > 0,
        "{remote:?}"
    );
    let local = nodes[0].local_clients().unwrap().counters();
    assert_eq!(
        (local.ops_failed, local.frames_rejected),
        (0, 0),
        "{local:?}"
    );

    // The client goes: node 1 discards its pages from the peers.
    drop(client);
    wait_for("the client's pages discarded from the peers", || {
        nodes[0]
            .local_clients()
            .unwrap()
            .counters()
            .clients_connected
            == 0
            && held_by(1) + held_by(2) == 0
    })
    .await;
    for n in nodes {
        tokio::time::timeout(WAIT, n.shutdown()).await.unwrap();
    }
}
