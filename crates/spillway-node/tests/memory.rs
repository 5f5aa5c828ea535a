//! A node whose memory plan does not fit an (injected) cgroup limit or `RLIMIT_MEMLOCK`
//! refuses to start with a typed error naming the numbers, before it creates anything; the
//! largest host budget that error names starts.

mod common;

use std::path::PathBuf;

use common::{TempDir, members_at, sim_transports, within};
use spillway_net::sim::SimNetwork;
use spillway_node::{MemoryError, MemoryLimits, MemoryPlan, Node, NodeConfig, NodeError};
use spillway_types::NodeId;

const GIB: u64 = 1 << 30;

/// A fake `/` whose cgroup allows 1 GiB (`testdata/cgroup/v2-namespace`).
fn one_gib_cgroup() -> MemoryLimits {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/cgroup/v2-namespace");
    let limits = MemoryLimits::read_under(&root, None);
    assert_eq!(limits.cgroup.as_ref().map(|c| c.limit_bytes), Some(GIB));
    limits
}

/// Node 1 of a pool of three over the simulated network, with `host_budget` bytes.
fn config(
    root: &TempDir,
    net: &SimNetwork,
    host_budget: u64,
) -> (NodeConfig, impl spillway_net::Transport) {
    let (transports, addrs) = sim_transports(net, 3);
    let mut c = NodeConfig::new(
        NodeId(1),
        root.0.join("pool"),
        root.0.join("data-1"),
        host_budget,
    );
    c.members = members_at(&addrs);
    c.listen_addr = addrs[0];
    c.metrics_addr = "127.0.0.1:0".parse().unwrap();
    c.client_socket = root.0.join("client.sock");
    (c, transports.into_iter().next().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_above_its_cgroup_limit_refuses_to_start_naming_the_numbers() {
    let root = TempDir::new("memory-over");
    let net = SimNetwork::seeded(7);
    let (c, transport) = config(&root, &net, GIB);
    let plan = MemoryPlan::of(&c, None);
    let data_dir = c.data_dir.clone();
    let err = within(
        "node start",
        Node::start_over_within(c, transport, &one_gib_cgroup()),
    )
    .await
    .unwrap_err();
    let NodeError::Memory(MemoryError::OverCgroupLimit {
        needed_bytes,
        limit_bytes,
        file,
        plan: refused,
    }) = &err
    else {
        panic!("expected a memory error, got {err:?}")
    };
    assert_eq!(*limit_bytes, GIB);
    assert_eq!(*refused, plan);
    // 1 GiB x 1.05 + 32 MiB base + 2 peers x 64 MiB in flight + 64 x 2 MiB page copies.
    assert_eq!(
        *needed_bytes,
        (GIB as f64 * 1.05).ceil() as u64 + (32 + 128 + 128) * (1 << 20)
    );
    assert!(file.ends_with("sys/fs/cgroup/memory.max"));
    let text = err.to_string();
    assert!(text.contains("lower host_budget"), "{text}");
    assert!(text.contains("cgroup allows 1.0 GiB"), "{text}");
    // Refused before anything was created.
    assert!(!data_dir.exists());

    // The largest budget the error names fits, and that node starts.
    let fits = plan.host_budget_max_bytes(GIB) / (64 << 10) * (64 << 10);
    let root = TempDir::new("memory-fits");
    let net = SimNetwork::seeded(8);
    let (c, transport) = config(&root, &net, fits);
    let node = within(
        "node start",
        Node::start_over_within(c, transport, &one_gib_cgroup()),
    )
    .await
    .unwrap();
    assert_eq!(node.config().host_tier_bytes, fits);
    within("shutdown", node.shutdown()).await;
}
