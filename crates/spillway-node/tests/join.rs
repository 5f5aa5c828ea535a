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
use spillway_net::join::{JoinError, JoinRefusal, JoinToken, TokenStore};
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

/// A pool of three started from one pool directory, node 1 holding the CA key and
/// serving joins.
struct JoinPool {
    root: TempDir,
    nodes: Vec<Option<NodeHandle>>,
    bootstrap: spillway_net::join::BootstrapServer,
    /// The bootstrap endpoint.
    at: String,
    tokens: TokenStore,
    fingerprint: [u8; 32],
}

impl JoinPool {
    async fn start(name: &str) -> JoinPool {
        let root = TempDir::new(name);
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
        let bootstrap = nodes[0]
            .as_ref()
            .unwrap()
            .serve_joins(&ca_dir, "127.0.0.1:0".parse().unwrap())
            .unwrap();
        JoinPool {
            at: bootstrap.local_addr().to_string(),
            tokens: TokenStore::in_ca_dir(&ca_dir),
            fingerprint: PoolCa::load(&ca_dir).unwrap().fingerprint().unwrap(),
            root,
            nodes,
            bootstrap,
        }
    }

    fn token(&self) -> JoinToken {
        self.tokens
            .create(self.fingerprint, Duration::from_secs(60), now_ms())
            .unwrap()
            .0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_joins_with_a_token_and_leaves_without_losing_a_page() {
    let JoinPool {
        root,
        nodes,
        bootstrap,
        at,
        tokens,
        fingerprint,
    } = JoinPool::start("join").await;
    let n1 = nodes[0].as_ref().unwrap();

    // Pages on the pool before anyone joins.
    let pages = patterned_pages(1, 24, 7, PAGE);
    within("spill", n1.remote().spill(5, pages.clone()))
        .await
        .unwrap();

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_removes_a_dead_host_and_its_pages_are_re_replicated() {
    let mut pool = JoinPool::start("remove").await;
    let mut nodes = std::mem::take(&mut pool.nodes);
    let mut c4 = joiner_config(&pool.root, 4);
    let token = pool
        .tokens
        .create(pool.fingerprint, Duration::from_secs(60), now_ms())
        .unwrap()
        .0;
    within("join", join_pool(&mut c4, &pool.at, &token.to_string()))
        .await
        .unwrap();
    let n4 = within("start node 4", Node::start(c4)).await.unwrap();
    let n1 = nodes[0].as_ref().unwrap();
    wait_for("node 4 to lend its capacity", WAIT, || {
        n1.meta_view()
            .members
            .iter()
            .any(|m| m.id == NodeId(4) && m.capacity_bytes > 0)
            .then_some(())
    })
    .await;
    // Pages spread over the four, two copies each, until node 4 holds some.
    let mut pages: Vec<(PageId, bytes::Bytes)> = Vec::new();
    for round in 0..8u32 {
        let batch: Vec<_> = (0..16u32)
            .map(|i| {
                let n = round * 16 + i;
                (page_id(1, n), page_bytes(u64::from(n) + 3, PAGE))
            })
            .collect();
        within("spill", n1.remote().spill(7, batch.clone()))
            .await
            .unwrap();
        pages.extend(batch);
        if n4.store().used_bytes_of(NodeId(1)) > 0 {
            break;
        }
    }
    let on_4 = n4.store().used_bytes_of(NodeId(1));
    assert!(on_4 > 0, "node 4 holds some of node 1's pages");

    // A live node, the node serving joins and a stranger are refused, typed, and the
    // tokens they came with stay unused.
    let refused = |r: Result<(), JoinError>| match r {
        Err(JoinError::RemovalRefused(refusal)) => refusal,
        other => panic!("{other:?}"),
    };
    let t = pool.token();
    assert_eq!(
        refused(spillway_net::join::remove(&pool.at, &t, NodeId(4), false).await),
        JoinRefusal::NodeUp { node: 4 }
    );
    assert!(matches!(
        refused(spillway_net::join::remove(&pool.at, &t, NodeId(1), true).await),
        JoinRefusal::Busy { node: 1, .. }
    ));
    assert_eq!(
        refused(spillway_net::join::remove(&pool.at, &t, NodeId(9), false).await),
        JoinRefusal::NotAMember { node: 9 }
    );

    // Node 4 dies (no leave): the pool declares it down; an operator removes it.
    within("node 4 dies", n4.shutdown()).await;
    wait_for("node 4 declared down", WAIT, || {
        n1.meta_view()
            .members
            .iter()
            .any(|m| m.id == NodeId(4) && m.state == spillway_meta::MemberState::Down)
            .then_some(())
    })
    .await;
    within(
        "remove node 4",
        spillway_net::join::remove(&pool.at, &t, NodeId(4), false),
    )
    .await
    .unwrap();
    wait_for("every member to drop node 4", WAIT, || {
        nodes.iter().flatten().all(|n| !lists(n, 4)).then_some(())
    })
    .await;
    // The copies it held are made again on the others, and every page reads back.
    wait_for("re-replication", WAIT, || {
        let c = n1.remote().counters();
        (c.under_replicated_bytes == 0 && c.repaired_pages > 0).then_some(())
    })
    .await;
    assert_eq!(n1.remote().counters().lost_pages, 0);
    let wanted: Vec<PageId> = pages.iter().map(|(id, _)| *id).collect();
    let back = within("fetch", n1.remote().fetch(7, wanted)).await.unwrap();
    assert_eq!(back.len(), pages.len());
    for ((id, sent), got) in pages.iter().zip(&back) {
        assert!(sent == got, "page {id:?} came back different");
    }
    // Its id is free again: a new host joins as node 4.
    let mut again = joiner_config(&pool.root, 4);
    again.pool_dir = pool.root.0.join("joiner-4-again/pool");
    again.data_dir = pool.root.0.join("joiner-4-again/data");
    within(
        "rejoin",
        join_pool(&mut again, &pool.at, &pool.token().to_string()),
    )
    .await
    .unwrap();
    pool.bootstrap.shutdown().await;
    nodes.retain(Option::is_some);
    shutdown_all(nodes).await;
}
