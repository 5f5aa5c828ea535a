//! Shared by the process tests: running the `spillway` binary, a pool directory whose
//! nodes are always stopped on drop, polling with deadlines, ports per test.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use spillway_cluster::ClusterSpec;

/// Runs `spillway args...` to completion.
pub fn spillway(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args(args)
        .env("SPILLWAY_LOG", "warn")
        .output()
        .expect("run spillway")
}

/// Runs `spillway args...` and returns its stdout; panics with its stderr if it fails.
pub fn spillway_ok(args: &[&str]) -> String {
    let out = spillway(args);
    assert!(
        out.status.success(),
        "spillway {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// A base port for test `slot` (0..50) of this process: ports of tests running at once,
/// here and in other test processes, should not collide. 100 ports per slot.
pub fn base_port(slot: u16) -> u16 {
    let per_process = (std::process::id() % 40) as u16;
    20_000 + per_process * 1000 + (slot % 10) * 100
}

/// A pool directory in a temporary directory; dropping it stops every node of the pool
/// (SIGTERM, then SIGKILL) whatever the test did, then removes the directory.
pub struct Pool {
    pub tmp: tempfile::TempDir,
    pub dir: PathBuf,
}

impl Pool {
    pub fn new() -> Pool {
        let tmp = tempfile::tempdir().expect("a temporary directory");
        let dir = tmp.path().join("pool");
        Pool { tmp, dir }
    }

    pub fn dir_str(&self) -> &str {
        self.dir.to_str().expect("a UTF-8 temporary path")
    }

    pub fn spec(&self) -> ClusterSpec {
        ClusterSpec::load(&self.dir).expect("cluster.json")
    }

    /// `spillway status --dir D --json`, parsed (also when no node answers).
    pub fn status(&self) -> Value {
        let out = spillway(&[
            "status",
            "--dir",
            self.dir_str(),
            "--json",
            "--timeout-ms",
            "500",
        ]);
        serde_json::from_slice(&out.stdout).expect("status prints one JSON document")
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Ok(spec) = ClusterSpec::load(&self.dir) {
            let _ = spillway_cluster::process::stop_nodes(&spec, Duration::from_secs(2));
        }
    }
}

/// Polls `f` every 10 ms until it returns `Some` or `timeout` passes.
pub fn poll<T>(timeout: Duration, f: impl FnMut() -> Option<T>) -> Option<T> {
    spillway_cluster::poll_until(timeout, Duration::from_millis(10), f)
}

/// The text of a file, or empty.
pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The page transport of the pools these tests start: `SPILLWAY_TEST_TRANSPORT` (`quic`
/// by default, or `ucx` with a build of the `ucx` feature and `UCX_NET_DEVICES=lo`).
pub fn test_transport() -> String {
    let t = std::env::var("SPILLWAY_TEST_TRANSPORT").unwrap_or_else(|_| "quic".into());
    if t == "ucx" {
        assert_eq!(
            std::env::var("UCX_NET_DEVICES").as_deref(),
            Ok("lo"),
            "UCX tests run on loopback only: set UCX_NET_DEVICES=lo"
        );
    }
    t
}

/// The model the process tests' demos run: 12 layers, 4 MiB of weights and 2 MiB of
/// activations each.
pub const DEMO_MODEL: [&str; 6] = ["--layers", "12", "--weight-mib", "4", "--act-mib", "2"];

/// `spillway cluster VERB --dir D --nodes N` of `pool`, to which callers add their flags.
pub fn cluster<'a>(verb: &'a str, pool: &'a Pool, nodes: &'a str) -> Vec<&'a str> {
    vec!["cluster", verb, "--dir", pool.dir_str(), "--nodes", nodes]
}

/// `cluster init` of a pool of `nodes` nodes from the base port of test `slot`, with
/// `extra` arguments after; its stdout.
pub fn init(pool: &Pool, nodes: u16, slot: u16, extra: &[&str]) -> String {
    let nodes = nodes.to_string();
    let port = base_port(slot).to_string();
    let mut args = cluster("init", pool, &nodes);
    args.extend(["--base-port", &port]);
    args.extend_from_slice(extra);
    spillway_ok(&args)
}

/// `cluster up` of a pool of three nodes of 64 MiB host budget each; its stdout.
pub fn up(pool: &Pool, slot: u16) -> String {
    up_with_host_budget(pool, slot, "64MiB")
}

/// `cluster up` of a pool of three nodes of `host_budget` each; its stdout.
pub fn up_with_host_budget(pool: &Pool, slot: u16, host_budget: &str) -> String {
    let port = base_port(slot).to_string();
    let transport = test_transport();
    let mut args = cluster("up", pool, "3");
    args.extend(["--base-port", &port, "--host-budget", host_budget]);
    args.extend(["--transport", &transport, "--timeout-s", "20"]);
    spillway_ok(&args)
}
