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

/// The pool's status, `None` while no node answers (`spillway status` fails then).
fn status(dir: &Path) -> Option<Value> {
    let out = spillway_command(&["status", "--dir", dir.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    out.status.success().then(|| stdout_json(&out))
}

/// Polls the pool's status until `f` holds; panics after [`DEADLINE`].
fn wait_status(dir: &Path, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let s = status(dir);
        if let Some(s) = s.as_ref().filter(|s| f(s)) {
            return s.clone();
        }
        assert!(
            start.elapsed() < DEADLINE,
            "timed out waiting for {what}: {s:?}"
        );
        // The poll interval: the status comes from `spillway status` against node
        // processes, which signal nothing this test could wait on.
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
    let s = wait_status(&dir, "three nodes and a leader", |s| {
        s["answering"] == 3
            && s["leader_agreed"] == true
            && s["members"].as_array().unwrap().len() == 3
    });
    // Of nodes 2 and 3, one that does not lead stays up; the other dies (a leader too
    // may die: the pool elects another before it declares it down).
    let (live, dead) = if s["leader"] == 2 { (3, 2) } else { (2, 3) };
    let (live_s, dead_s) = (live.to_string(), dead.to_string());
    fn remove<'a>(d: &'a str, node: &'a str, via: &'a str) -> [&'a str; 8] {
        [
            "cluster", "remove", "--dir", d, "--node", node, "--via", via,
        ]
    }

    // A live node is refused: it should leave so its pages move first.
    let err = spillway_err(&remove(d, &live_s, &bootstrap));
    assert!(err.contains(&format!("node {live} is up")), "{err}");
    assert!(err.contains("--leave-on-stop"), "{err}");

    // The other dies; once the pool declares it down, the operator removes it.
    nodes.0[dead - 1].kill().unwrap();
    nodes.0[dead - 1].wait().unwrap();
    wait_status(&dir, "the dead node declared down", |s| {
        member_states(s).contains(&(dead as u64, "down".into())) && s["leader_agreed"] == true
    });
    let out = spillway_ok(&remove(d, &dead_s, &bootstrap));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("node {dead} removed from pool")),
        "{stdout}"
    );
    let s = wait_status(&dir, "the dead node gone from the members", |s| {
        s["members"].as_array().unwrap().len() == 2
    });
    assert_eq!(
        member_states(&s),
        [(1, "up".to_string()), (live as u64, "up".to_string())]
    );
    // Removed already: a second removal says so.
    let err = spillway_err(&remove(d, &dead_s, &bootstrap));
    assert!(
        err.contains(&format!("node {dead} is not a member of the pool")),
        "{err}"
    );
}
