//! A real full disk under one node's Raft log, in a pool of `spillway node` processes: a
//! tiny tmpfs mounted as node 3's `data_dir/raft`, filled while a client's spills make
//! the group write. Node 3 must say it is unhealthy (with the cause) in `/status`,
//! `/metrics` and `spillway status` within a second of failing, and be healthy again and
//! caught up once the filler file is removed, without a restart.
//!
//! Needs root (to mount the tmpfs): skipped, with the reason printed, otherwise or when
//! the mount fails.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use spillway_cluster::{NodeStatus, fetch_status};
use support::{DEMO_MODEL, Pool, init, poll, read, spillway, spillway_ok};

/// The tmpfs's size: 1 MiB, below raft-engine's 2 MiB preallocation, so its log takes
/// real pages as it writes and a full filesystem fails its next write, not one 2 MiB
/// later.
const TMPFS_SIZE: &str = "1m";
/// How soon the failure must show.
const UNHEALTHY_WITHIN: Duration = Duration::from_secs(1);

/// A tmpfs mounted for the test; unmounted (lazily, so a node holding files in it does not
/// stop the unmount) on drop.
struct Mount(PathBuf);

impl Mount {
    fn tmpfs(at: &Path, size: &str) -> Result<Mount, String> {
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "spillway-test",
            ])
            .arg(at)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Mount(at.to_path_buf()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A client of node 1 spilling pages over the pool: every spill commits entries, which
/// node 3 must append.
fn demo(socket: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args(["demo", "--connect"])
        .arg(socket)
        .args(DEMO_MODEL)
        .args(["--steps", "20"])
        .env("SPILLWAY_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run the demo")
}

/// Writes zeros to `path` until the filesystem refuses another byte.
fn fill(path: &Path) -> u64 {
    let mut f = std::fs::File::create(path).expect("create the filler");
    let mut written = 0u64;
    for chunk in [64 << 10, 4 << 10, 512, 1] {
        let zeros = vec![0u8; chunk];
        while f.write_all(&zeros).is_ok() {
            written += chunk as u64;
        }
    }
    let _ = f.sync_all();
    written
}

#[test]
fn a_full_raft_disk_makes_a_node_process_unhealthy_and_it_recovers_when_space_returns() {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: mounting a tmpfs needs root");
        return;
    }
    let pool = Pool::new();
    init(&pool, 3, 8, &["--host-budget", "64MiB"]);
    let spec = pool.spec();
    let node3 = spec.nodes[2].clone();
    let raft_dir = node3.data_dir.join("raft");
    std::fs::create_dir_all(&raft_dir).unwrap();
    // Declared after the pool: unmounted before the pool's nodes stop and its directory goes.
    let _mount = match Mount::tmpfs(&raft_dir, TMPFS_SIZE) {
        Ok(m) => m,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    spillway_ok(&[
        "cluster",
        "up",
        "--dir",
        pool.dir_str(),
        "--timeout-s",
        "20",
    ]);
    let status3 = || fetch_status(node3.metrics_addr, Duration::from_millis(500)).ok();
    assert!(status3().unwrap().raft_healthy);

    // Fill the filesystem, then make the group write.
    let filler = raft_dir.join("filler");
    let filled = fill(&filler);
    println!("filled the tmpfs with {filled} bytes");
    let mut client = demo(&spec.nodes[0].client_socket);
    let mut logged_at = None;
    let unhealthy = poll(Duration::from_secs(120), || {
        let s = status3().filter(|s: &NodeStatus| !s.raft_healthy);
        let now = Instant::now();
        if logged_at.is_none() && read(&node3.log).contains("Raft Ready failed") {
            logged_at = Some(now);
        }
        if let Some(s) = s {
            return Some((s, now));
        }
        if let Ok(Some(_)) = client.try_wait() {
            client = demo(&spec.nodes[0].client_socket);
        }
        None
    });
    let (status, unhealthy_at) = unhealthy.unwrap_or_else(|| {
        panic!(
            "node 3 never said it is unhealthy; its log:\n{}",
            read(&node3.log)
        )
    });
    let logged_at = logged_at.unwrap_or_else(Instant::now);
    let after_log = unhealthy_at.saturating_duration_since(logged_at);
    println!("unhealthy in /status {after_log:?} after the failure was logged");
    assert!(after_log < UNHEALTHY_WITHIN, "{after_log:?}");
    let cause = status.raft_error.clone().unwrap();
    println!("cause: {cause}");
    assert!(
        cause.contains("StorageFull") || cause.to_lowercase().contains("space"),
        "{cause}"
    );
    let metrics = String::from_utf8(
        spillway_cluster::http::get(node3.metrics_addr, "/metrics", Duration::from_secs(2))
            .unwrap()
            .body,
    )
    .unwrap();
    assert!(metrics.contains("spillway_raft_healthy 0\n"), "{metrics}");
    let text = spillway_ok(&["status", "--dir", pool.dir_str(), "--timeout-ms", "500"]);
    println!("{text}");
    assert!(text.contains("UNHEALTHY"), "{text}");
    assert!(text.contains(&cause), "{text}");
    // The process still runs and serves: it did not give up.
    assert!(status3().is_some());

    // Space returns: it reopens its log, without a restart, and catches up.
    let _ = client.kill();
    let _ = client.wait();
    std::fs::remove_file(&filler).unwrap();
    let freed_at = Instant::now();
    poll(Duration::from_secs(20), || {
        status3().filter(|s| s.raft_healthy && s.raft_error.is_none())
    })
    .unwrap_or_else(|| panic!("node 3 did not recover; its log:\n{}", read(&node3.log)));
    println!(
        "healthy again {:?} after the space returned",
        freed_at.elapsed()
    );
    let group_commit = spec.nodes[..2]
        .iter()
        .filter_map(|n| fetch_status(n.metrics_addr, Duration::from_millis(500)).ok())
        .map(|s| s.commit_index)
        .max()
        .unwrap();
    let caught_up = poll(Duration::from_secs(20), || {
        status3().filter(|s| s.commit_index >= group_commit && s.known_leader().is_some())
    });
    assert!(
        caught_up.is_some(),
        "node 3 did not catch up to {group_commit}: {:?}",
        status3()
    );
    println!(
        "caught up with commit index {group_commit} {:?} after the space returned",
        freed_at.elapsed()
    );
    let report = pool.status();
    assert_eq!(report["raft_healthy"], 3, "{report}");
    let out = spillway(&["cluster", "down", "--dir", pool.dir_str()]);
    assert!(out.status.success());
}
