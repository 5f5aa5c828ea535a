//! A pool directory: what `spillway cluster init` writes and every other command reads.
//!
//! ```text
//! D/cluster.json          the pool: id, and per node its id, addresses, config, log, pid file
//! D/pool/                 the pool's CA: pool_id, ca.pem, ca.key.pem (the operator's: no
//!                         node reads it)
//! D/node-<id>.toml        node <id>'s configuration (spillway node --config)
//! D/node-<id>/            node <id>'s data directory, node.log, node.pid, client.sock
//! D/node-<id>/pool/       node <id>'s pool directory (its config's pool_dir): pool_id,
//!                         ca.pem, node-<id>.pem, node-<id>.key.pem; never the CA key
//! ```
//!
//! `init` issues every node's certificate and key into its own directory up front
//! (`spillway_net::certs::init_pool`); a node only reads them. So a node's directory can
//! go to another machine without the CA key, and one compromised node cannot mint
//! certificates for others.
//!
//! Ports are on 127.0.0.1 from a base port P: node k (from 1) takes P + 2(k-1) for peers
//! (UDP, QUIC) and the next port for `/status` and `/metrics` (TCP). With the default P,
//! node 1 has the node config's default addresses.
//!
//! Paths in `cluster.json` and in the node configs are absolute, so the pool works from any
//! working directory. `init` never overwrites a pool; `init --force` replaces it only
//! when none of its nodes runs, and removes only what `init` wrote.

use std::fs;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use spillway_net::certs;
use spillway_node::config::MemberAddr;
use spillway_node::{NodeConfig, PageTransport};
use spillway_types::{NodeId, PoolId};

use crate::error::{ClusterError, io_at};

/// Most nodes `init` lays out on one machine: 64 (128 ports from the base port).
pub const NODES_MAX: u32 = 64;
/// Default base port: 7700 (node 1 at 7700 and 7701, like a node config's defaults).
pub const BASE_PORT_DEFAULT: u16 = 7700;
/// Lowest base port: 1024 (no privileged ports).
pub const BASE_PORT_MIN: u16 = 1024;
/// Default host tier of each node: 1 GiB (pages take RAM only when stored).
pub const HOST_TIER_BYTES_DEFAULT: u64 = 1 << 30;
/// Raft tick of the nodes `init` lays out: 10 ms. With [`HEARTBEAT_TICKS`] and
/// [`ELECTION_TICKS`] this is the node's default timing (heartbeats every 100 ms, election
/// timeouts drawn from 500..800 ms) in finer steps: 30 distinct timeouts instead of 3.
/// Nodes started together tick in phase, so two followers that draw the same timeout
/// start their elections at the same instant and split the vote; with 100 ms ticks one
/// first fail-over in three after `cluster up` took 1.2 to 2.4 s instead of about 0.5.
pub const TICK_MS: u64 = 10;
/// Ticks between heartbeats (100 ms).
pub const HEARTBEAT_TICKS: usize = 10;
/// Election timeout range in ticks, upper bound exclusive (500..800 ms).
pub const ELECTION_TICKS: (usize, usize) = (50, 80);
/// The file that describes a pool.
pub const SPEC_FILE: &str = "cluster.json";
/// Where the pool's CA goes, under the pool directory; also the name of each node's own
/// pool directory, under its node directory.
pub const CERTS_DIR: &str = "pool";
/// Largest `cluster.json` read: 1 MiB (64 nodes take about 30 KiB).
const SPEC_BYTES_MAX: u64 = 1 << 20;

/// The pool directory when none is given: `$XDG_RUNTIME_DIR/spillway` if that variable
/// is set, else `/tmp/spillway-$USER` (`/tmp/spillway` without `USER`).
pub fn default_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(runtime) => PathBuf::from(runtime).join("spillway"),
        None => match std::env::var("USER").ok().filter(|u| !u.is_empty()) {
            Some(user) => PathBuf::from(format!("/tmp/spillway-{user}")),
            None => PathBuf::from("/tmp/spillway"),
        },
    }
}

/// One node of a pool, as `cluster.json` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    /// The node's id (1..=nodes).
    pub id: u64,
    /// Where peers reach it (UDP, QUIC).
    pub peer_addr: SocketAddr,
    /// Where it serves `/status` and `/metrics` (TCP).
    pub metrics_addr: SocketAddr,
    /// The local socket clients of this machine connect to.
    pub client_socket: PathBuf,
    /// Its configuration file.
    pub config: PathBuf,
    /// Its data directory.
    pub data_dir: PathBuf,
    /// Its pool directory (its config's `pool_dir`): its certificate and key and the CA's
    /// certificate, never the CA's key. Empty in pools laid out before nodes had their
    /// own.
    #[serde(default)]
    pub pool_dir: PathBuf,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
    /// Its pid while it runs.
    pub pid_file: PathBuf,
}

/// A pool of node processes on this machine (`cluster.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterSpec {
    /// The pool id, 16 hex digits.
    pub pool_id: String,
    /// The pool directory (absolute).
    pub dir: PathBuf,
    /// The pool's CA directory (absolute): its certificate and key, for the operator; no
    /// node reads it.
    pub certs_dir: PathBuf,
    /// The nodes, by id.
    pub nodes: Vec<NodeSpec>,
}

/// What `init` lays out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitOptions {
    /// Nodes (1..=[`NODES_MAX`]).
    pub nodes: u32,
    /// First port; see the module docs.
    pub base_port: u16,
    /// Each node's host tier.
    pub host_tier_bytes: u64,
    /// Replace an existing pool (only when none of its nodes runs).
    pub force: bool,
    /// How the nodes move pages (`transport` in their configs).
    pub transport: PageTransport,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            nodes: 3,
            base_port: BASE_PORT_DEFAULT,
            host_tier_bytes: HOST_TIER_BYTES_DEFAULT,
            force: false,
            transport: PageTransport::Quic,
        }
    }
}

impl InitOptions {
    /// Checks the ranges; the error names the option.
    pub fn validate(&self) -> Result<(), ClusterError> {
        if self.nodes == 0 || self.nodes > NODES_MAX {
            return Err(ClusterError::Option {
                option: "--nodes",
                problem: format!("is {} but must be from 1 to {NODES_MAX}", self.nodes),
            });
        }
        let last = u32::from(self.base_port) + 2 * self.nodes - 1;
        if self.base_port < BASE_PORT_MIN || last > u32::from(u16::MAX) {
            return Err(ClusterError::Option {
                option: "--base-port",
                problem: format!(
                    "is {} but {} nodes need ports {}..={last}, which must lie in {BASE_PORT_MIN}..=65535",
                    self.base_port, self.nodes, self.base_port
                ),
            });
        }
        Ok(())
    }
}

impl ClusterSpec {
    /// The path of `cluster.json` in `dir`.
    pub fn path(dir: &Path) -> PathBuf {
        dir.join(SPEC_FILE)
    }

    /// Whether `dir` holds a pool.
    pub fn exists(dir: &Path) -> bool {
        ClusterSpec::path(dir).exists()
    }

    /// Reads `dir/cluster.json`.
    pub fn load(dir: &Path) -> Result<ClusterSpec, ClusterError> {
        let path = ClusterSpec::path(dir);
        if !path.exists() {
            return Err(ClusterError::NoPool {
                dir: dir.to_path_buf(),
            });
        }
        let len = fs::metadata(&path).map_err(io_at(&path))?.len();
        if len > SPEC_BYTES_MAX {
            return Err(ClusterError::Spec {
                path,
                problem: format!("is {len} bytes, more than {SPEC_BYTES_MAX}"),
            });
        }
        let text = fs::read_to_string(&path).map_err(io_at(&path))?;
        let spec: ClusterSpec = serde_json::from_str(&text).map_err(|e| ClusterError::Spec {
            path: path.clone(),
            problem: e.to_string(),
        })?;
        if spec.nodes.is_empty() {
            return Err(ClusterError::Spec {
                path,
                problem: "lists no nodes".to_string(),
            });
        }
        Ok(spec)
    }

    /// The node with id `id`.
    pub fn node(&self, id: u64) -> Option<&NodeSpec> {
        self.nodes.iter().find(|n| n.id == id)
    }
}

/// The addresses of node `k` (from 1) for a base port.
fn node_addrs(base_port: u16, k: u32) -> (SocketAddr, SocketAddr) {
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let peer = base_port + 2 * (k as u16 - 1);
    (SocketAddr::new(lo, peer), SocketAddr::new(lo, peer + 1))
}

/// A fresh pool id: 8 bytes of `/dev/urandom` (the time and pid if that fails).
pub fn fresh_pool_id() -> PoolId {
    use std::io::Read;
    let mut b = [0u8; 8];
    let random = fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if random.is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        b = (nanos ^ (u64::from(std::process::id()) << 32)).to_le_bytes();
    }
    PoolId(u64::from_le_bytes(b).max(1))
}

/// Node `node`'s configuration in the pool `spec`: loopback addresses, data directory
/// under the pool directory, its own pool directory (its certificate, not the CA's key).
pub fn node_config(spec: &ClusterSpec, node: &NodeSpec, host_tier_bytes: u64) -> NodeConfig {
    let mut config = NodeConfig::new(
        NodeId(node.id),
        node.pool_dir.clone(),
        node.data_dir.clone(),
        host_tier_bytes,
    );
    config.listen_addr = node.peer_addr;
    config.metrics_addr = node.metrics_addr;
    config.client_socket = node.client_socket.clone();
    config.tick_ms = TICK_MS;
    config.heartbeat_ticks = HEARTBEAT_TICKS;
    (config.election_ticks, config.election_ticks_max) = ELECTION_TICKS;
    config.members = spec
        .nodes
        .iter()
        .map(|n| MemberAddr {
            id: NodeId(n.id),
            addr: n.peer_addr,
        })
        .collect();
    config
}

/// Lays out a pool of `opts.nodes` nodes in `dir` (created if missing): the CA, each
/// node's certificate in its own directory, node configs, `cluster.json`. Refuses an
/// existing pool unless `opts.force`, and even then while one of its nodes runs.
pub fn init(dir: &Path, opts: &InitOptions) -> Result<ClusterSpec, ClusterError> {
    opts.validate()?;
    fs::create_dir_all(dir).map_err(io_at(dir))?;
    let dir = dir.canonicalize().map_err(io_at(dir))?;
    let certs_dir = dir.join(CERTS_DIR);
    let existing = [ClusterSpec::path(&dir), certs_dir.clone()]
        .into_iter()
        .find(|p| p.exists());
    if let Some(found) = existing {
        if !opts.force {
            return Err(ClusterError::Exists { dir, found });
        }
        remove_pool(&dir)?;
    }

    let pool_id = fresh_pool_id();
    let nodes: Vec<NodeSpec> = (1..=opts.nodes)
        .map(|k| {
            let (peer_addr, metrics_addr) = node_addrs(opts.base_port, k);
            let node_dir = dir.join(format!("node-{k}"));
            NodeSpec {
                id: u64::from(k),
                peer_addr,
                metrics_addr,
                client_socket: node_dir.join("client.sock"),
                config: dir.join(format!("node-{k}.toml")),
                data_dir: node_dir.join("data"),
                pool_dir: node_dir.join(CERTS_DIR),
                log: node_dir.join("node.log"),
                pid_file: node_dir.join("node.pid"),
            }
        })
        .collect();
    let node_dirs: Vec<(NodeId, PathBuf)> = nodes
        .iter()
        .map(|n| (NodeId(n.id), n.pool_dir.clone()))
        .collect();
    certs::init_pool(&certs_dir, pool_id, &node_dirs).map_err(|source| ClusterError::Certs {
        dir: certs_dir.clone(),
        source,
    })?;
    let spec = ClusterSpec {
        pool_id: format!("{:016x}", pool_id.0),
        dir: dir.clone(),
        certs_dir,
        nodes,
    };
    for node in &spec.nodes {
        let node_dir = node
            .log
            .parent()
            .expect("the log is in the node's directory");
        fs::create_dir_all(node_dir).map_err(io_at(node_dir))?;
        let mut config = node_config(&spec, node, opts.host_tier_bytes);
        config.transport = opts.transport;
        config.validate()?;
        let text = format!(
            "# Node {} of pool {}, written by `spillway cluster init`.\n{}",
            node.id,
            spec.pool_id,
            toml::to_string(&config).map_err(|e| ClusterError::Spec {
                path: node.config.clone(),
                problem: e.to_string(),
            })?
        );
        fs::write(&node.config, text).map_err(io_at(&node.config))?;
    }
    let path = ClusterSpec::path(&dir);
    let json = serde_json::to_string_pretty(&spec).expect("the spec serializes");
    fs::write(&path, json + "\n").map_err(io_at(&path))?;
    Ok(spec)
}

/// Removes what `init` wrote in `dir`, after checking that no node of the pool runs.
fn remove_pool(dir: &Path) -> Result<(), ClusterError> {
    if let Ok(old) = ClusterSpec::load(dir) {
        for node in &old.nodes {
            if let Some(pid) = crate::process::running_pid(node) {
                return Err(ClusterError::Running {
                    dir: dir.to_path_buf(),
                    node: node.id,
                    pid,
                });
            }
        }
    }
    let entries = fs::read_dir(dir).map_err(io_at(dir))?;
    for entry in entries {
        let entry = entry.map_err(io_at(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name == SPEC_FILE
            || name == CERTS_DIR
            || (name.starts_with("node-")
                && name["node-".len()..]
                    .trim_end_matches(".toml")
                    .parse::<u32>()
                    .is_ok());
        if !ours {
            continue;
        }
        let path = entry.path();
        let removed = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        removed.map_err(io_at(&path))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(nodes: u32) -> InitOptions {
        InitOptions {
            nodes,
            base_port: 17000,
            host_tier_bytes: 64 << 20,
            force: false,
            transport: PageTransport::Quic,
        }
    }

    #[test]
    fn init_lays_out_certificates_configs_and_the_spec() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pool-a");
        let spec = init(&dir, &opts(3)).unwrap();
        assert_eq!(spec.nodes.len(), 3);
        assert_eq!(spec.pool_id.len(), 16);
        assert_eq!(spec.dir, dir.canonicalize().unwrap());
        let ports: Vec<(u16, u16)> = spec
            .nodes
            .iter()
            .map(|n| (n.peer_addr.port(), n.metrics_addr.port()))
            .collect();
        assert_eq!(ports, [(17000, 17001), (17002, 17003), (17004, 17005)]);
        for node in &spec.nodes {
            let config = NodeConfig::load(&node.config).unwrap();
            assert_eq!(config.node_id, NodeId(node.id));
            assert_eq!(config.listen_addr, node.peer_addr);
            assert_eq!(config.metrics_addr, node.metrics_addr);
            assert_eq!(config.host_tier_bytes, 64 << 20);
            assert_eq!(config.client_socket, node.client_socket);
            assert_eq!(config.tick_ms * config.heartbeat_ticks as u64, 100);
            assert_eq!(
                (config.election_ticks, config.election_ticks_max),
                ELECTION_TICKS
            );
            let members: Vec<(u64, SocketAddr)> =
                config.members.iter().map(|m| (m.id.0, m.addr)).collect();
            let expected: Vec<(u64, SocketAddr)> =
                spec.nodes.iter().map(|n| (n.id, n.peer_addr)).collect();
            assert_eq!(members, expected);
            assert!(config.data_dir.starts_with(&spec.dir));
            assert_eq!(config.pool_dir, node.pool_dir);
            assert!(
                node.pool_dir
                    .starts_with(spec.dir.join(format!("node-{}", node.id)))
            );
            spillway_net::certs::NodeIdentity::load(&config.pool_dir, NodeId(node.id)).unwrap();
        }
        assert_eq!(ClusterSpec::load(&dir).unwrap(), spec);
    }

    /// Every file under `dir`, at any depth.
    fn files_under(dir: &Path) -> Vec<PathBuf> {
        let mut files = Vec::new();
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files.extend(files_under(&path));
            } else {
                files.push(path);
            }
        }
        files
    }

    #[test]
    fn init_keeps_the_ca_key_out_of_every_node_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = init(tmp.path(), &opts(3)).unwrap();
        assert!(spec.certs_dir.join("ca.key.pem").exists());
        for node in &spec.nodes {
            let config = NodeConfig::load(&node.config).unwrap();
            let node_dir = spec.dir.join(format!("node-{}", node.id));
            for dir in [&node_dir, &config.pool_dir] {
                let keys: Vec<PathBuf> = files_under(dir)
                    .into_iter()
                    .filter(|f| f.file_name().is_some_and(|n| n == "ca.key.pem"))
                    .collect();
                assert!(keys.is_empty(), "node {}: {keys:?}", node.id);
            }
            // The node's directory holds its own certificate and key, and no other node's.
            let mut names: Vec<String> = fs::read_dir(&config.pool_dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            let k = node.id;
            assert_eq!(
                names,
                [
                    "ca.pem".to_string(),
                    format!("node-{k}.key.pem"),
                    format!("node-{k}.pem"),
                    "pool_id".to_string()
                ]
            );
        }
    }

    #[test]
    fn init_refuses_an_existing_pool_unless_forced() {
        let tmp = tempfile::tempdir().unwrap();
        let first = init(tmp.path(), &opts(2)).unwrap();
        let stranger = tmp.path().join("notes.txt");
        fs::write(&stranger, "keep me").unwrap();
        let err = init(tmp.path(), &opts(3)).unwrap_err();
        assert!(matches!(err, ClusterError::Exists { .. }), "{err}");
        assert!(err.to_string().contains("--force"), "{err}");
        assert_eq!(ClusterSpec::load(tmp.path()).unwrap(), first);

        let forced = init(
            tmp.path(),
            &InitOptions {
                force: true,
                ..opts(3)
            },
        )
        .unwrap();
        assert_eq!(forced.nodes.len(), 3);
        assert_ne!(forced.pool_id, first.pool_id);
        assert_eq!(fs::read_to_string(&stranger).unwrap(), "keep me");
    }

    #[test]
    fn options_out_of_range_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        let err = init(tmp.path(), &opts(0)).unwrap_err();
        assert!(err.to_string().contains("--nodes"), "{err}");
        let err = init(
            tmp.path(),
            &InitOptions {
                base_port: 65530,
                ..opts(4)
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("--base-port"), "{err}");
        assert!(!ClusterSpec::exists(tmp.path()));
    }
}
