//! `spillway cluster remove` as a black box: a pool of three node processes laid out by
//! `spillway cluster init`, node 1 serving joins with the pool's CA; a live node is not
//! removed (it should leave), a SIGKILLed one is, once the pool has declared it down, and
//! `spillway status` stops listing it.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Longest any wait of this test may take.
const DEADLINE: Duration = Duration::from_secs(60);

/// The node processes; killed on drop, whatever the test did.
struct Nodes(Vec<Child>);

impl Drop for Nodes {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn status(dir: &Path) -> Value {
    stdout_json(&spillway_ok(&[
        "status",
        "--dir",
        dir.to_str().unwrap(),
        "--json",
    ]))
}

/// Polls the pool's status until `f` holds; panics after [`DEADLINE`].
fn wait_status(dir: &Path, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let s = status(dir);
        if f(&s) {
            return s;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "timed out waiting for {what}: {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn member_states(s: &Value) -> Vec<(u64, String)> {
    let mut v: Vec<(u64, String)> = s["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_u64().unwrap(),
                m["state"].as_str().unwrap().into(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_dead_host_is_removed_and_a_live_one_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pool");
    let d = dir.to_str().unwrap();
    let port = 43_000 + (std::process::id() % 400) * 8;
    let bootstrap = format!("127.0.0.1:{}", port + 6);
    spillway_ok(&[
        "cluster",
        "init",
        "--dir",
        d,
        "--nodes",
        "3",
        "--base-port",
        &port.to_string(),
        "--host-budget",
        "64MiB",
    ]);
    let node = |k: u32, extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_spillway"))
            .arg("node")
            .arg("--config")
            .arg(dir.join(format!("node-{k}.toml")))
            .args(extra)
            .env("SPILLWAY_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let ca = dir.join("pool");
    let mut nodes = Nodes(vec![
        node(
            1,
            &["--ca", ca.to_str().unwrap(), "--bootstrap-addr", &bootstrap],
        ),
        node(2, &[]),
        node(3, &[]),
    ]);
    wait_status(&dir, "three nodes and a leader", |s| {
        s["answering"] == 3
            && s["leader_agreed"] == true
            && s["members"].as_array().unwrap().len() == 3
    });

    // A live node is refused: it should leave so its pages move first.
    let err = spillway_err(&[
        "cluster", "remove", "--dir", d, "--node", "2", "--via", &bootstrap,
    ]);
    assert!(err.contains("node 2 is up"), "{err}");
    assert!(err.contains("--leave-on-stop"), "{err}");

    // Node 3 dies; once the pool declares it down, the operator removes it.
    nodes.0[2].kill().unwrap();
    nodes.0[2].wait().unwrap();
    wait_status(&dir, "node 3 declared down", |s| {
        member_states(s).contains(&(3, "down".into())) && s["leader_agreed"] == true
    });
    let out = spillway_ok(&[
        "cluster", "remove", "--dir", d, "--node", "3", "--via", &bootstrap,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("node 3 removed from pool"), "{stdout}");
    let s = wait_status(&dir, "node 3 gone from the members", |s| {
        s["members"].as_array().unwrap().len() == 2
    });
    assert_eq!(
        member_states(&s),
        [(1, "up".to_string()), (2, "up".to_string())]
    );
    // Removed already: a second removal says so.
    let err = spillway_err(&[
        "cluster", "remove", "--dir", d, "--node", "3", "--via", &bootstrap,
    ]);
    assert!(err.contains("node 3 is not a member of the pool"), "{err}");
}
