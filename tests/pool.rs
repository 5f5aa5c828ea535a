//! End-to-end tests of a pool of `spillway node` processes: `cluster up`, `status`,
//! `cluster down`, and leader fail-over with real SIGKILLs.
//!
//! Every wait polls a condition against a deadline, and the [`Pool`] guard stops every
//! node on drop, whatever the test did.

mod support;

use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};
use serde_json::Value;
use support::{
    DEMO_MODEL, Pool, cluster, init, poll, read, spillway, spillway_ok, test_transport, up,
};

fn leader_of(status: &Value) -> Option<u64> {
    status["leader_agreed"]
        .as_bool()
        .filter(|&agreed| agreed)
        .and_then(|_| status["leader"].as_u64())
}

/// `cluster up` of the three nodes `pool`'s directory already lays out.
fn up_again(pool: &Pool) -> Vec<&str> {
    let mut args = cluster("up", pool, "3");
    args.extend(["--timeout-s", "20"]);
    args
}

#[test]
fn three_nodes_up_report_one_leader_and_down_leaves_no_process() {
    let pool = Pool::new();
    up(&pool, 3);
    let status = pool.status();
    assert_eq!(status["answering"], 3, "{status}");
    assert_eq!(status["members"].as_array().unwrap().len(), 3, "{status}");
    let leader = leader_of(&status).expect("one agreed leader");
    let leaders: Vec<_> = status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["status"]["role"] == "leader")
        .collect();
    assert_eq!(leaders.len(), 1, "{status}");
    assert_eq!(leaders[0]["status"]["node_id"], leader);

    // A second `up` finds every node running and starts none; `init --force` refuses to
    // replace a running pool.
    let again = spillway_ok(&up_again(&pool));
    assert!(again.contains("0 started now"), "{again}");
    let forced = spillway(&["cluster", "init", "--dir", pool.dir_str(), "--force"]);
    assert!(!forced.status.success());
    assert!(
        String::from_utf8_lossy(&forced.stderr).contains("still runs"),
        "{}",
        String::from_utf8_lossy(&forced.stderr)
    );

    let pids: Vec<u32> = pool
        .spec()
        .nodes
        .iter()
        .map(|n| {
            std::fs::read_to_string(&n.pid_file)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    assert!(
        pids.iter()
            .all(|&p| spillway_cluster::process::pid_alive(p))
    );
    let out = spillway_ok(&["cluster", "down", "--dir", pool.dir_str()]);
    assert!(out.contains("3 of 3 nodes"), "{out}");
    for (pid, node) in pids.iter().zip(&pool.spec().nodes) {
        assert!(
            !spillway_cluster::process::pid_alive(*pid),
            "pid {pid} still runs"
        );
        assert!(!node.pid_file.exists());
    }
    let after = pool.status();
    assert_eq!(after["answering"], 0, "{after}");
}

#[test]
fn a_killed_leader_is_replaced_and_catches_up_after_restart() {
    let pool = Pool::new();
    up(&pool, 4);
    let spec = pool.spec();
    // Kill the leader of a settled pool: all up, one leader, the same commit index.
    let targets = spillway_cluster::launcher::status_targets(&spec);
    let before = poll(Duration::from_secs(10), || {
        Some(spillway_cluster::query_pool(
            &targets,
            Duration::from_millis(200),
        ))
        .filter(|r| r.settled(3))
    })
    .expect("the pool settles");
    let old = before.leader.expect("a leader");
    let old_term = before.term.unwrap();
    let node = spec.node(old).unwrap().clone();
    let pid: i32 = std::fs::read_to_string(&node.pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    let killed_at = Instant::now();
    kill_process(Pid::from_raw(pid).unwrap(), Signal::KILL).unwrap();
    let others: Vec<(String, Option<u64>)> = spec
        .nodes
        .iter()
        .filter(|n| n.id != old)
        .map(|n| (n.metrics_addr.to_string(), Some(n.id)))
        .collect();
    // How fast is `spillway cluster failover-bench`'s to measure (p99 over many trials on a
    // quiet machine); here other tests share the cores, so the bound is only generous.
    let new = poll(Duration::from_secs(10), || {
        let r = spillway_cluster::query_pool(&others, Duration::from_millis(200));
        r.leader.filter(|&l| l != old && r.term > Some(old_term))
    });
    let elapsed = killed_at.elapsed();
    let new = new.unwrap_or_else(|| panic!("no new leader {elapsed:?} after killing node {old}"));
    assert_ne!(new, old);

    // Restarted with its own config, it rejoins and its commit index reaches the leader's.
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_spillway"));
    let mut child = spillway_cluster::process::spawn_node(exe, &node, "info").unwrap();
    let caught_up = poll(Duration::from_secs(10), || {
        let r = spillway_cluster::query_pool(&targets, Duration::from_millis(200));
        let leader_commit = r.node(r.leader?)?.commit_index;
        let mine = r.node(old)?.commit_index;
        (r.answering == 3 && r.leader_agreed && mine >= leader_commit && mine > 0).then_some(mine)
    });
    assert!(
        caught_up.is_some(),
        "node {old} did not catch up: {}",
        pool.status()
    );
    spillway_ok(&["cluster", "down", "--dir", pool.dir_str()]);
    assert!(poll(Duration::from_secs(5), || child.try_wait().unwrap()).is_some());
}

#[test]
fn up_fails_with_the_log_of_a_node_that_cannot_start_and_leaves_no_process() {
    let pool = Pool::new();
    init(&pool, 3, 5, &["--host-budget", "64MiB"]);
    // Node 2's status port is taken.
    let spec = pool.spec();
    let _taken = std::net::TcpListener::bind(spec.nodes[1].metrics_addr).unwrap();
    let out = spillway(&up_again(&pool));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("node 2"), "{err}");
    assert!(
        err.contains(&spec.nodes[1].metrics_addr.to_string()),
        "{err}"
    );
    // Every node it started is stopped again.
    for node in &spec.nodes {
        assert!(
            spillway_cluster::process::running_pid(node).is_none(),
            "node {} still runs: {}",
            node.id,
            read(&node.log)
        );
    }
}

/// A client process in daemon mode over a pool of three node processes: its working set
/// is 4x its GPU plus host budgets, so most pages live on the peers; every page of every
/// access is verified, and the pages really travel (bytes to and from peers each step).
/// (The hit rate depends on how much compute hides the network: it is a benchmark,
/// recorded in bench/RESULTS.md, not asserted here.)
#[test]
fn a_client_process_runs_the_demo_over_the_pool_with_every_page_verified() {
    let pool = Pool::new();
    let printed = up(&pool, 6);
    let socket = pool.spec().nodes[0].client_socket.clone();
    // `cluster up` printed the socket and the command this test runs (`demo --connect`'s
    // help says so).
    let command = format!("spillway demo --connect {}", socket.display());
    assert!(printed.contains(&command), "{printed}");
    let mut args = vec!["demo", "--connect", socket.to_str().unwrap()];
    args.extend(DEMO_MODEL);
    args.extend(["--steps", "3", "--json"]);
    let out = spillway_ok(&args);
    let report: Value = serde_json::from_str(out.trim()).expect("one JSON report");
    assert_eq!(report["corrupt_pages"], 0, "{report}");
    let ws = report["working_set_bytes"].as_u64().unwrap();
    let budgets = report["gpu_budget_bytes"].as_u64().unwrap()
        + report["host_budget_bytes"].as_u64().unwrap();
    assert!(
        ws >= 4 * budgets - 4 * (2 << 20),
        "working set {ws} vs budgets {budgets}"
    );
    let steps = report["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 3);
    assert!(
        report["verified_bytes"].as_u64().unwrap() >= ws * 3,
        "every page of every access verified: {report}"
    );
    for s in steps {
        assert!(s["remote_bytes_in"].as_u64().unwrap() > 0, "{s}");
        assert!(s["remote_bytes_out"].as_u64().unwrap() > 0, "{s}");
    }
    // The node served one client and the peers held its pages while it ran.
    let status = pool.status();
    let spilled: u64 = status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["status"]["remote"]["pages_spilled"].as_u64())
        .sum();
    assert!(spilled > 0, "{status}");
    // The pages travelled on the pool's transport.
    let transport = test_transport();
    let nodes = status["nodes"].as_array().unwrap();
    for n in nodes {
        assert_eq!(n["status"]["page_transport"], transport.as_str(), "{n}");
    }
    let ucx_out: u64 = nodes
        .iter()
        .filter_map(|n| n["status"]["ucx_bytes_out"].as_u64())
        .sum();
    if transport == "ucx" {
        assert!(ucx_out > 0, "{status}");
    } else {
        assert_eq!(ucx_out, 0, "{status}");
    }
}
