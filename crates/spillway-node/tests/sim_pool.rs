//! Three whole nodes (Raft on its thread with its log on disk, placement, the page
//! service, the host store, the remote tier that local clients use) over the simulated
//! transport, from a seed: the seed chooses which node spills, how many pages and their
//! bytes, the order they are fetched back in, and how the network delays each request.
//! Every page comes back with the bytes spilled (checksums checked by the transport, by
//! the remote tier against the checksum recorded at spill, and here).
//!
//! Replay: the page traffic (every put, get and delete delivered, by sender, receiver and
//! bytes) hashes the same for two runs of one seed, and differently for another seed.
//! What is not replayed: the Raft traffic and the order of deliveries, which depend on
//! the Raft thread's clock and the tokio runtime's scheduling (see `spillway_net::sim`).

mod common;

use std::net::SocketAddr;

use common::{
    TempDir, member_config, members_at, page_bytes, page_id, settled, shutdown_all, sim_transports,
    within,
};
use spillway_net::sim::SimNetwork;
use spillway_node::{Node, NodeHandle, PageTransport};
use spillway_types::NodeId;
use spillway_types::wire::{Kind, page_checksum};

const PAGE: u64 = 64 << 10;

/// A small seeded generator (splitmix64), for the workload.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// What one run saw: the page traffic's hash, the spiller, and every page's checksum.
#[derive(Debug, PartialEq, Eq)]
struct Run {
    page_traffic: u64,
    spiller: usize,
    checksums: Vec<u64>,
}

/// Starts `n` members of one pool (QUIC pages, default replicas) over `net`, their files
/// under `root`; returns their addresses and handles.
async fn start_members(
    root: &TempDir,
    net: &SimNetwork,
    n: u64,
) -> (Vec<SocketAddr>, Vec<Option<NodeHandle>>) {
    let (transports, addrs) = sim_transports(net, n);
    let members = members_at(&addrs);
    let mut nodes = Vec::new();
    for (i, transport) in transports.into_iter().enumerate() {
        let mut c = member_config(root, &root.0.join("pool"), &members, i, PAGE, 256);
        c.transport = PageTransport::Quic;
        assert_eq!(c.replicas, 2, "the default");
        let node = within("node start", Node::start_over(c, transport))
            .await
            .unwrap();
        nodes.push(Some(node));
    }
    (addrs, nodes)
}

async fn run(seed: u64) -> Run {
    let root = TempDir::new(&format!("sim-{seed}"));
    let net = SimNetwork::seeded(seed);
    let (_, nodes) = start_members(&root, &net, 3).await;
    settled(&nodes).await;

    let mut rng = Rng(seed);
    let spiller = (rng.next() % 3) as usize;
    let count = 8 + rng.next() % 40;
    let pages: Vec<_> = (0..count)
        .map(|i| {
            // The last page of a buffer may be short.
            let len = if rng.next().is_multiple_of(4) {
                1 + rng.next() % PAGE
            } else {
                PAGE
            };
            (page_id(1 + i % 3, i as u32), page_bytes(rng.next(), len))
        })
        .collect();
    let remote = nodes[spiller].as_ref().unwrap().remote();
    within("spill", remote.spill(1, pages.clone()))
        .await
        .unwrap();
    let mut order: Vec<usize> = (0..pages.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let wanted = order.iter().map(|&i| pages[i].0).collect();
    let back = within("fetch", remote.fetch(1, wanted)).await.unwrap();
    let mut checksums = Vec::new();
    for (k, &i) in order.iter().enumerate() {
        assert_eq!(
            back[k], pages[i].1,
            "seed {seed}: page {} differs",
            pages[i].0
        );
        assert_eq!(page_checksum(&back[k]), page_checksum(&pages[i].1));
        checksums.push(page_checksum(&back[k]));
    }
    // The spiller kept nothing: every page is on the other two, one copy on each
    // (replicas = 2).
    for (i, n) in nodes.iter().flatten().enumerate() {
        let want = if i == spiller { 0 } else { count };
        assert_eq!(n.store().counters().pages, want, "seed {seed}");
    }
    assert_eq!(nodes[spiller].as_ref().unwrap().store().counters().pages, 0);
    shutdown_all(nodes).await;
    // Puts of at most 8 pages (PAGES_PER_REQUEST) per copy, at least one get: the
    // traffic is in the log the hash is made of.
    let delivered = |kind: Kind| {
        net.deliveries()
            .iter()
            .filter(|d| d.kind == kind as u8)
            .count() as u64
    };
    assert!(
        delivered(Kind::PutPages) >= 2 * count.div_ceil(8),
        "seed {seed}"
    );
    assert!(delivered(Kind::GetPages) >= 1, "seed {seed}");
    assert!(delivered(Kind::RaftMessage) > 0, "seed {seed}");
    Run {
        page_traffic: net.traffic_hash(&[Kind::PutPages, Kind::GetPages, Kind::DeletePages]),
        spiller,
        checksums,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_whole_nodes_over_the_simulated_transport_replay_from_a_seed() {
    for seed in [7u64, 1_000_003] {
        let first = run(seed).await;
        let again = run(seed).await;
        assert_eq!(first, again, "seed {seed} did not replay");
        let other = run(seed + 1).await;
        assert_ne!(
            first.page_traffic,
            other.page_traffic,
            "seeds {seed} and {} moved the same pages",
            seed + 1
        );
    }
}

/// The live nodes agree on a leader and see `n` members, each with its lent capacity.
async fn settled_n(nodes: &[Option<NodeHandle>], n: usize) -> NodeId {
    common::wait_for("a leader and every member's capacity", common::WAIT, || {
        let live: Vec<&NodeHandle> = nodes.iter().flatten().collect();
        let v0 = live[0].meta_view();
        let leader = v0.leader?;
        let agree = live.iter().all(|h| {
            let v = h.meta_view();
            v.leader == Some(leader)
                && v.members.len() == n
                && common::capacities_applied(nodes, &v)
        });
        agree.then_some(leader)
    })
    .await
}

/// Four whole nodes, replicas 2: node 1 spills, a peer holding its pages dies (dropped
/// from the simulated network, then declared down), and every page still comes back
/// with its bytes, first by fail-over inside the fetch, then after re-replication has
/// brought every page back to two live holders (the directory says so, and the survivors'
/// stores hold the copies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holder_loses_nothing_and_its_copies_are_made_again() {
    let seed = 14u64;
    let root = TempDir::new("sim-replicas");
    let net = SimNetwork::seeded(seed);
    let (addrs, mut nodes) = start_members(&root, &net, 4).await;
    let leader = settled_n(&nodes, 4).await;

    let count = 40u32;
    let pages: Vec<_> = (0..count)
        .map(|i| {
            (
                page_id(1 + u64::from(i) % 2, i),
                page_bytes(seed ^ u64::from(i), PAGE),
            )
        })
        .collect();
    let spiller = nodes[0].as_ref().unwrap();
    let remote = spiller.remote();
    within("spill", remote.spill(1, pages.clone()))
        .await
        .unwrap();
    // Two copies of every page, on the three peers.
    let held = |nodes: &[Option<NodeHandle>]| -> u64 {
        nodes
            .iter()
            .flatten()
            .map(|n| n.store().counters().pages)
            .sum()
    };
    assert_eq!(held(&nodes), 2 * u64::from(count), "seed {seed}");
    // The victim: a peer holding pages, not the leader (the leader's death is Raft's).
    let victim = (1..4)
        .find(|&i| {
            let n = nodes[i].as_ref().unwrap();
            n.node_id() != leader && n.store().counters().pages > 0
        })
        .expect("a holder that does not lead");
    let victim_id = NodeId(victim as u64 + 1);
    let victim_pages = nodes[victim].as_ref().unwrap().store().counters().pages;
    net.set_down(addrs[victim], true);
    let dead = nodes[victim].take().unwrap();
    let spiller = nodes[0].as_ref().unwrap();

    let check = |back: Vec<bytes::Bytes>| {
        assert_eq!(back.len(), pages.len());
        for (b, (id, data)) in back.iter().zip(&pages) {
            assert_eq!(
                page_checksum(b),
                page_checksum(data),
                "seed {seed}: page {id}"
            );
            assert_eq!(b, data, "seed {seed}: page {id}");
        }
    };
    // Before anybody declares it down: the fetch fails over to the other copy.
    let wanted: Vec<_> = pages.iter().map(|(id, _)| *id).collect();
    let back = within("fetch after the kill", remote.fetch(1, wanted.clone()))
        .await
        .unwrap();
    check(back);
    assert!(remote.counters().fetch_failovers >= victim_pages.min(1));

    // Declared down (by the leader's failure detection, or here if it has none yet).
    let down = spillway_meta::Update::SetMemberState {
        node: victim_id,
        state: spillway_meta::MemberState::Down,
    };
    let _ = within("declare down", spiller.propose(vec![down])).await;
    common::wait_for("the victim down", common::WAIT, || {
        spiller
            .meta_view()
            .members
            .iter()
            .any(|m| m.id == victim_id && m.state == spillway_meta::MemberState::Down)
            .then_some(())
    })
    .await;

    // Re-replication brings every page back to two live holders.
    common::wait_for("re-replication", common::WAIT, || {
        let c = remote.counters();
        (c.under_replicated_bytes == 0 && c.repaired_pages >= victim_pages).then_some(())
    })
    .await;
    let c = remote.counters();
    assert_eq!(
        (c.lost_pages, c.repaired_pages),
        (0, victim_pages),
        "seed {seed}"
    );
    let ids: Vec<_> = wanted
        .iter()
        .map(|p| spillway_node::remote::remote_page_id(NodeId(1), 1, *p))
        .collect();
    let holders = within(
        "directory",
        spiller.meta_read(move |s| {
            ids.iter()
                .map(|id| {
                    s.holders_of(*id)
                        .into_iter()
                        .filter(|(_, _, h)| s.is_live(h))
                        .map(|(_, _, h)| h.node)
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        }),
    )
    .await
    .unwrap();
    for (p, h) in wanted.iter().zip(&holders) {
        assert_eq!(h.len(), 2, "seed {seed}: page {p} live on {h:?}");
        assert_ne!(h[0], h[1]);
        assert!(!h.contains(&victim_id) && !h.contains(&NodeId(1)));
    }
    assert_eq!(held(&nodes), 2 * u64::from(count), "seed {seed}");
    // And every page still reads back right.
    let back = within("fetch after repair", remote.fetch(1, wanted))
        .await
        .unwrap();
    check(back);
    drop(dead);
    shutdown_all(nodes).await;
}
