//! Joining and leaving a running pool, in one process over QUIC on loopback: three nodes
//! hold pages; node 1 (holding the CA key) serves joins; a fourth host joins with a
//! one-time token (its key made here, its certificate signed by the pool's CA) and every
//! member lists it; the token used again, another pool's CA fingerprint and a taken node
//! id are refused with typed errors; a voter holding pages leaves gracefully (its pages
//! drain to other holders), every member stops listing it and the joined learner is
//! promoted; every page spilled before is read back byte for byte. Real time;
//! every wait polls a condition with a deadline.

mod common;

use std::time::Duration;

use common::*;
use spillway_net::certs::{PoolCa, init_pool_dir};
use spillway_net::join::{JoinError, JoinRefusal, TokenStore};
use spillway_node::{JoinNodeError, Node, NodeConfig, NodeHandle, join_pool};
use spillway_types::{NodeId, PageId};

const PAGE: u64 = 64 << 10;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The config of a host that has nothing of the pool yet: its own empty pool directory.
fn joiner_config(root: &TempDir, id: u64) -> NodeConfig {
    let mut c = NodeConfig::new(
        NodeId(id),
        root.0.join(format!("joiner-{id}/pool")),
        root.0.join(format!("joiner-{id}/data")),
        256 * PAGE,
    );
    c.listen_addr = free_addrs(1)[0];
    c.metrics_addr = "127.0.0.1:0".parse().unwrap();
    c.page_size = spillway_types::PageSize::new(PAGE).unwrap();
    c.reserve_chunk_bytes = 4 * PAGE;
    c
}

fn lists(n: &NodeHandle, id: u64) -> bool {
    n.members().iter().any(|m| m.id == NodeId(id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_joins_with_a_token_and_leaves_without_losing_a_page() {
    let root = TempDir::new("join");
    let pool_dir = root.0.join("pool");
    let ca_dir = root.0.join("ca");
    let ca = init_pool_dir(&pool_dir, POOL, &[NodeId(1), NodeId(2), NodeId(3)]).unwrap();
    ca.write(&ca_dir).unwrap();
    let members = members_at(&free_addrs(3));
    let mut nodes = Vec::new();
    for i in 0..3 {
        let c = member_config(&root, &pool_dir, &members, i, PAGE, 256);
        nodes.push(Some(within("start", Node::start(c)).await.unwrap()));
    }
    settled(&nodes).await;
    let n1 = nodes[0].as_ref().unwrap();

    // Pages on the pool before anyone joins.
    let pages: Vec<(PageId, bytes::Bytes)> = (0..24u32)
        .map(|i| (page_id(1, i), page_bytes(u64::from(i) + 7, PAGE)))
        .collect();
    within("spill", n1.remote().spill(5, pages.clone()))
        .await
        .unwrap();

    let bootstrap = n1
        .serve_joins(&ca_dir, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let at = bootstrap.local_addr().to_string();
    let tokens = TokenStore::in_ca_dir(&ca_dir);
    let fingerprint = PoolCa::load(&ca_dir).unwrap().fingerprint().unwrap();
    let (token, _) = tokens
        .create(fingerprint, Duration::from_secs(60), now_ms())
        .unwrap();

    // Another pool's fingerprint: refused before the secret leaves this host.
    let mut other = token.clone();
    other.ca_sha256 = PoolCa::generate(spillway_types::PoolId(9))
        .unwrap()
        .fingerprint()
        .unwrap();
    let mut c5 = joiner_config(&root, 5);
    match join_pool(&mut c5, &at, &other.to_string()).await {
        Err(JoinNodeError::Join(JoinError::CaMismatch { .. })) => {}
        other => panic!("{other:?}"),
    }
    // A node id that is a member already: refused, and the token is not used up.
    let mut taken = joiner_config(&root, 2);
    match join_pool(&mut taken, &at, &token.to_string()).await {
        Err(JoinNodeError::Join(JoinError::Refused(JoinRefusal::NodeTaken { node: 2 }))) => {}
        other => panic!("{other:?}"),
    }

    // Host 4 joins: its key made here, its certificate signed by the pool's CA.
    let mut c4 = joiner_config(&root, 4);
    within("join", join_pool(&mut c4, &at, &token.to_string()))
        .await
        .unwrap();
    assert!(c4.pool_dir.join("node-4.key.pem").exists());
    assert!(!c4.pool_dir.join("ca.key.pem").exists());
    assert!(
        c4.members.iter().any(|m| m.id == NodeId(1)),
        "{:?}",
        c4.members
    );
    let n4 = within("start the joined node", Node::start(c4.clone()))
        .await
        .unwrap();
    // Every member lists it (what `spillway status` shows), and it lists every member.
    wait_for("every member to list node 4", WAIT, || {
        (nodes.iter().flatten().all(|n| lists(n, 4)) && (1..=4).all(|id| lists(&n4, id)))
            .then_some(())
    })
    .await;
    // Three voters already: it stays a learner, and the pool keeps its leader.
    assert_eq!(n4.meta_view().members.len(), 4);

    // One-time: the same token again is refused, typed.
    match join_pool(&mut c5, &at, &token.to_string()).await {
        Err(JoinNodeError::Join(JoinError::Refused(JoinRefusal::TokenUsed))) => {}
        other => panic!("{other:?}"),
    }

    // Node 3, a voter holding pages, leaves: declared leaving, its pages copied to other
    // holders, removed; no member lists it any more, and learner 4 takes its vote.
    let held_by_3 = nodes[2].as_ref().unwrap().store().used_bytes_of(NodeId(1));
    assert!(held_by_3 > 0, "node 3 holds some of node 1's pages");
    let n3 = nodes[2].as_ref().unwrap();
    within("leave", n3.leave(Duration::from_secs(15)))
        .await
        .unwrap();
    wait_for("every member to drop node 3", WAIT, || {
        (nodes[..2].iter().flatten().all(|n| !lists(n, 3)) && !lists(&n4, 3)).then_some(())
    })
    .await;
    let role = wait_for_async(|| async {
        let r = n1
            .meta_read(|s| s.member(NodeId(4)).map(|m| m.role))
            .await
            .unwrap();
        (r == Some(spillway_meta::RaftRole::Voter)).then_some(r)
    })
    .await;
    assert_eq!(role, Some(spillway_meta::RaftRole::Voter));

    // Every page is still there, byte for byte.
    let wanted: Vec<PageId> = pages.iter().map(|(id, _)| *id).collect();
    let back = within("fetch", n1.remote().fetch(5, wanted)).await.unwrap();
    assert_eq!(back.len(), pages.len());
    for ((id, sent), got) in pages.iter().zip(&back) {
        assert!(sent == got, "page {id:?} came back different");
    }
    bootstrap.shutdown().await;
    within("shutdown of node 4", n4.shutdown()).await;
    shutdown_all(nodes).await;
}
