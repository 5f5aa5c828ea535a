//! Black-box tests of `spillway node`, `cluster init`, `status` and `bench remote` as
//! processes: what works without the node's Raft group.

mod support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process};
use serde_json::Value;
use support::{Pool, base_port, init, poll, read, spillway, spillway_ok};

#[test]
fn node_help_lists_every_config_field_with_its_default() {
    let help = spillway_ok(&["node", "--help"]);
    for field in [
        "node_id",
        "pool_dir",
        "listen_addr",
        "data_dir",
        "host_budget",
        "metrics_addr",
        "quic.connections_per_peer",
        "quic.loopback_mtu_bytes",
    ] {
        assert!(help.contains(field), "help lacks {field}:\n{help}");
    }
    assert!(help.contains("[required]"), "{help}");
    assert!(help.contains("[default 127.0.0.1:7701]"), "{help}");
}

/// Writes `config` to `path` and runs `spillway node` on it: it must exit with 1; its
/// stderr.
fn node_config_error(path: &std::path::Path, config: &str) -> String {
    std::fs::write(path, config).unwrap();
    let out = spillway(&["node", "--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_bad_node_config_exits_nonzero_naming_the_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("node.toml");
    let err = node_config_error(
        &path,
        "node_id = 1\npool_dir = \"/p\"\ndata_dir = \"/d\"\nhost_budget = \"4KiB\"\n",
    );
    assert!(err.contains("`host_budget`"), "{err}");
    assert!(err.contains(path.to_str().unwrap()), "{err}");

    // The old key is read (the same range error), with a note naming the new one.
    let err = node_config_error(
        &path,
        "node_id = 1\npool_dir = \"/p\"\ndata_dir = \"/d\"\nhost_tier_bytes = 4096\n",
    );
    assert!(err.contains("`host_tier_bytes` is deprecated"), "{err}");
    assert!(err.contains("write `host_budget`"), "{err}");
    assert!(
        err.contains("`host_budget` is 4096 but must hold at least one page"),
        "{err}"
    );

    let err = node_config_error(&path, "node_id = 1\nhost_tier_gib = 4\n");
    assert!(err.contains("host_tier_gib"), "{err}");
}

#[test]
fn cluster_init_lays_out_a_pool_and_refuses_to_overwrite_it() {
    let pool = Pool::new();
    let port = base_port(1).to_string();
    let out = init(&pool, 3, 1, &[]);
    assert!(out.contains("3 nodes"), "{out}");
    let spec: Value =
        serde_json::from_str(&read(&pool.dir.join("cluster.json"))).expect("cluster.json");
    let nodes = spec["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3);
    let base: u16 = port.parse().unwrap();
    for (k, node) in nodes.iter().enumerate() {
        let k = k as u16;
        assert_eq!(node["id"], u64::from(k) + 1);
        assert_eq!(node["peer_addr"], format!("127.0.0.1:{}", base + 2 * k));
        assert_eq!(
            node["metrics_addr"],
            format!("127.0.0.1:{}", base + 2 * k + 1)
        );
        let config = node["config"].as_str().unwrap();
        // The config it wrote is one `spillway node` accepts.
        let checked = spillway_ok(&["node", "--config", config, "--check"]);
        assert!(
            checked.contains(&format!("node_id = {}", k + 1)),
            "{checked}"
        );
    }
    for f in [
        "pool/ca.pem",
        "pool/ca.key.pem",
        "node-1/pool/ca.pem",
        "node-1/pool/node-1.pem",
        "node-3/pool/node-3.key.pem",
        "node-2.toml",
    ] {
        assert!(pool.dir.join(f).exists(), "{f} missing");
    }
    // The CA key stays in the operator's directory: no node's directory, nor the pool
    // directory its config names, holds it.
    for (k, node) in nodes.iter().enumerate() {
        let config: toml::Table = toml::from_str(&read(std::path::Path::new(
            node["config"].as_str().unwrap(),
        )))
        .expect("the node config is TOML");
        let pool_dir = config["pool_dir"].as_str().expect("a pool_dir").to_string();
        for dir in [pool.dir.join(format!("node-{}", k + 1)), pool_dir.into()] {
            assert!(
                !contains_file(&dir, "ca.key.pem"),
                "node {}: the CA key is under {}",
                k + 1,
                dir.display()
            );
        }
    }

    let again = spillway(&[
        "cluster",
        "init",
        "--dir",
        pool.dir_str(),
        "--base-port",
        &port,
    ]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    let pool_id = read(&pool.dir.join("pool/pool_id"));
    spillway_ok(&[
        "cluster",
        "init",
        "--dir",
        pool.dir_str(),
        "--nodes",
        "2",
        "--base-port",
        &port,
        "--force",
    ]);
    assert_ne!(read(&pool.dir.join("pool/pool_id")), pool_id);
    assert_eq!(pool.spec().nodes.len(), 2);
    assert!(!pool.dir.join("node-3.toml").exists());
}

/// Whether a file named `name` lies anywhere under `dir`.
fn contains_file(dir: &std::path::Path, name: &str) -> bool {
    std::fs::read_dir(dir).unwrap().any(|entry| {
        let path = entry.unwrap().path();
        if path.is_dir() {
            contains_file(&path, name)
        } else {
            path.file_name().is_some_and(|n| n == name)
        }
    })
}

#[test]
fn a_node_runs_until_sigterm_and_shuts_down_gracefully() {
    let pool = Pool::new();
    init(&pool, 1, 2, &[]);
    let spec = pool.spec();
    let node = &spec.nodes[0];
    let log = pool.tmp.path().join("node.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args(["node", "--config", node.config.to_str().unwrap()])
        .env("SPILLWAY_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let started = poll(Duration::from_secs(20), || {
        read(&log).contains("SIGTERM stops it").then_some(())
    });
    if started.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the node did not start:\n{}", read(&log));
    }
    let pid = Pid::from_raw(child.id() as i32).unwrap();
    kill_process(pid, Signal::TERM).unwrap();
    let status = poll(Duration::from_secs(10), || child.try_wait().unwrap());
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the node did not exit after SIGTERM:\n{}", read(&log));
    };
    assert!(status.success(), "{status}: {}", read(&log));
    let text = read(&log);
    assert!(text.contains("shutting down"), "{text}");
    assert!(text.contains("node shut down"), "{text}");
}

/// A server answering `/status` with `body` for every connection.
fn status_server(body: String) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let mut buf = [0u8; 2048];
            let _ = s.read(&mut buf);
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
    });
    addr
}

#[test]
fn status_shows_down_nodes_and_fails_only_when_none_answers() {
    let body = r#"{"node_id":1,"pool_id":"00000000000000ab","addr":"127.0.0.1:7001","metrics_addr":"127.0.0.1:9001","role":"leader","leader":1,"term":3,"commit_index":120,"members":[{"id":1,"addr":"127.0.0.1:7001","state":"up","capacity_bytes":1073741824,"used_bytes":0,"reserved_bytes":0},{"id":2,"addr":"127.0.0.1:7002","state":"down","capacity_bytes":1073741824,"used_bytes":0,"reserved_bytes":0}],"host_tier":{"budget_bytes":1073741824,"used_bytes":2097152,"pages":1},"remote":{"bytes_out":0,"bytes_in":0,"pages_spilled":0,"pages_fetched":0},"peer_bytes_in":0,"peer_bytes_out":0,"frames_rejected":0,"clients":0}"#;
    let up = status_server(body.to_string());
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();

    let json = spillway_ok(&["status", "--node", &up, "--node", &dead, "--json"]);
    let v: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["answering"], 1);
    assert_eq!(v["leader"], 1);
    assert_eq!(v["term"], 3);
    assert_eq!(v["members"].as_array().unwrap().len(), 2);
    assert_eq!(v["nodes"][0]["up"], true);
    assert_eq!(v["nodes"][0]["status"]["commit_index"], 120);
    assert_eq!(v["nodes"][1]["up"], false);
    assert!(v["nodes"][1]["error"].as_str().unwrap().contains(&dead));

    let table = spillway_ok(&["status", "--node", &up, "--node", &dead]);
    assert!(
        table.contains("1 of 2 nodes answering; leader node 1, term 3"),
        "{table}"
    );
    assert!(table.contains("DOWN"), "{table}");
    assert!(table.contains("2.0 MiB / 1.0 GiB"), "{table}");

    let none = spillway(&["status", "--node", &dead, "--json"]);
    assert_eq!(none.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&none.stdout).unwrap();
    assert_eq!(v["answering"], 0);
}

#[test]
fn bench_remote_reports_both_paths_and_their_ratio() {
    let json = spillway_ok(&[
        "bench",
        "remote",
        "--page-size",
        "256KiB",
        "--bytes",
        "16MiB",
        "--in-flight",
        "4",
        "--json",
    ]);
    let v: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["page_bytes"], 256 << 10);
    assert_eq!(v["total_bytes"], 16 << 20);
    assert_eq!(v["transport"], "quic");
    let tcp = v["tcp_bytes_per_s"].as_f64().unwrap();
    let quic = v["quic_bytes_per_s"].as_f64().unwrap();
    assert!(tcp > 0.0 && quic > 0.0, "{v}");
    let ratio = v["quic_over_tcp"].as_f64().unwrap();
    assert!((ratio - quic / tcp).abs() < 1e-9, "{v}");
}

/// Without the `ucx` feature, `--transport ucx` names what is missing; with it (run with
/// `UCX_NET_DEVICES=lo`), the JSON adds UCX beside QUIC and TCP, and the bare floor.
#[test]
fn bench_remote_over_ucx_reports_ucx_or_names_the_missing_transport() {
    if !cfg!(feature = "ucx") {
        let out = spillway(&["bench", "remote", "--transport", "ucx"]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("ucx") && err.contains("no UCX transport"),
            "{err}"
        );
        return;
    }
    assert_eq!(
        std::env::var("UCX_NET_DEVICES").as_deref(),
        Ok("lo"),
        "UCX tests run on loopback only: set UCX_NET_DEVICES=lo"
    );
    let json = spillway_ok(&[
        "bench",
        "remote",
        "--transport",
        "ucx",
        "--page-size",
        "256KiB",
        "--bytes",
        "16MiB",
        "--json",
    ]);
    let v: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["transport"], "ucx");
    let tcp = v["tcp_bytes_per_s"].as_f64().unwrap();
    let ucx = v["ucx_bytes_per_s"].as_f64().unwrap();
    let raw = v["ucx_raw_bytes_per_s"].as_f64().unwrap();
    assert!(ucx > 0.0 && raw > 0.0, "{v}");
    assert!(
        (v["ucx_over_tcp"].as_f64().unwrap() - ucx / tcp).abs() < 1e-9,
        "{v}"
    );
    assert_eq!(v["ucx_env"]["UCX_NET_DEVICES"], "lo", "{v}");
}
