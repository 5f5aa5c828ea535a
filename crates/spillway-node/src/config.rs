//! The node's configuration, in two layers like the pool's: [`NodeConfig`] is the serde
//! struct read from TOML (unknown keys refused, every optional field with a default), and
//! [`NodeConfig::validate`] checks ranges and names the first field that is wrong.
//! [`NodeConfig::load`] does both and names the file in every error.
//!
//! A minimal file:
//!
//! ```toml
//! node_id = 1
//! pool_dir = "/etc/spillway/pool"
//! data_dir = "/var/lib/spillway/node-1"
//! host_tier_bytes = 68719476736   # 64 GiB
//!
//! [quic]
//! connections_per_peer = 2
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use spillway_net::QuicConfig;
use spillway_types::{NodeId, PageSize, limits};

/// Default address peers reach the node at: 127.0.0.1:7700 (loopback; a multi-machine
/// pool sets a routable address).
pub const LISTEN_ADDR_DEFAULT: &str = "127.0.0.1:7700";
/// Default address of the Prometheus endpoint: 127.0.0.1:7701.
pub const METRICS_ADDR_DEFAULT: &str = "127.0.0.1:7701";

fn default_listen_addr() -> SocketAddr {
    LISTEN_ADDR_DEFAULT.parse().expect("valid default")
}

fn default_metrics_addr() -> SocketAddr {
    METRICS_ADDR_DEFAULT.parse().expect("valid default")
}

/// One node's configuration, as written in its TOML file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// This node's id in the pool (required, not 0). Must match a certificate in
    /// `pool_dir` (`node-<id>.pem`); peers know the node by it.
    pub node_id: NodeId,
    /// The pool directory made by `init_pool_dir` (required): the pool's CA certificate and
    /// this node's certificate and key. Whoever can read it can join the pool.
    pub pool_dir: PathBuf,
    /// Where peers reach this node (UDP, QUIC). Port 0 picks a free port (tests). A
    /// loopback address enables the large loopback MTU ([`QuicConfig::loopback_mtu_bytes`]).
    #[serde(default = "default_listen_addr")]
    pub listen_addr: SocketAddr,
    /// The node's own directory (required; created if missing): where the Raft log and
    /// state will live. Put it on a local disk; its fsync latency bounds commit latency.
    pub data_dir: PathBuf,
    /// Bytes of RAM the host tier may hold in pages (required, at least one page). More
    /// holds more of the pool's pages here; it is memory the machine no longer has for
    /// anything else. The page index adds about 100 bytes per page on top.
    pub host_tier_bytes: u64,
    /// Largest page the node stores, in bytes (a power of two from 64 KiB to 64 MiB; default
    /// 2 MiB). Must match the pool's clients; larger pages mean fewer requests and less
    /// index, smaller ones less waste on short buffers.
    #[serde(default)]
    pub page_size: PageSize,
    /// Tuning of the peer transport (the `[quic]` table); every field has a default.
    #[serde(default)]
    pub quic: QuicConfig,
    /// Where the Prometheus `/metrics` endpoint will listen (TCP). Keep it off public
    /// interfaces: it lists peers and their traffic.
    #[serde(default = "default_metrics_addr")]
    pub metrics_addr: SocketAddr,
}

/// Why a node configuration cannot be used. Every variant names the file (or `<memory>`
/// for a config built in code) and, where one is to blame, the field.
#[derive(Debug, thiserror::Error)]
pub enum NodeConfigError {
    /// The file could not be read.
    #[error("cannot read node config {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML for a [`NodeConfig`]: a syntax error, an unknown key, a
    /// missing required key or a value of the wrong type. `message` is toml's, which names
    /// the key and shows the line.
    #[error("invalid node config {}: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What toml said.
        message: String,
    },
    /// A value is out of its range.
    #[error("invalid node config {}: `{field}` {problem}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The field, as in TOML (`quic.` before the fields of the `[quic]` table).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
}

impl NodeConfigError {
    /// The field to blame, for range errors.
    pub fn field(&self) -> Option<&str> {
        match self {
            NodeConfigError::Invalid { field, .. } => Some(field),
            _ => None,
        }
    }
}

impl NodeConfig {
    /// A configuration with the required fields and every other at its default.
    pub fn new(
        node_id: NodeId,
        pool_dir: PathBuf,
        data_dir: PathBuf,
        host_tier_bytes: u64,
    ) -> Self {
        NodeConfig {
            node_id,
            pool_dir,
            listen_addr: default_listen_addr(),
            data_dir,
            host_tier_bytes,
            page_size: PageSize::default(),
            quic: QuicConfig::default(),
            metrics_addr: default_metrics_addr(),
        }
    }

    /// Reads, parses and validates the TOML file at `path`.
    pub fn load(path: &Path) -> Result<NodeConfig, NodeConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| NodeConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        NodeConfig::parse(&text, path)
    }

    /// Parses and validates TOML `text`; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<NodeConfig, NodeConfigError> {
        let config: NodeConfig = toml::from_str(text).map_err(|e| NodeConfigError::Parse {
            path: origin.to_path_buf(),
            message: e.to_string(),
        })?;
        config.validate_at(origin)?;
        Ok(config)
    }

    /// Number of whole pages the host tier holds.
    pub fn host_tier_pages(&self) -> u64 {
        self.page_size.pages_in(self.host_tier_bytes)
    }

    /// Checks every range; the error names the first field that is wrong.
    pub fn validate(&self) -> Result<(), NodeConfigError> {
        self.validate_at(Path::new("<memory>"))
    }

    fn validate_at(&self, path: &Path) -> Result<(), NodeConfigError> {
        let err = |field: &str, problem: String| {
            Err(NodeConfigError::Invalid {
                path: path.to_path_buf(),
                field: field.to_string(),
                problem,
            })
        };
        if self.node_id.0 == 0 {
            return err("node_id", "is 0, but node ids start at 1".to_string());
        }
        let page = self.page_size.bytes();
        if self.host_tier_bytes < page {
            return err(
                "host_tier_bytes",
                format!(
                    "is {} but must hold at least one page of {page} bytes",
                    self.host_tier_bytes
                ),
            );
        }
        if self.host_tier_pages() > limits::SLOTS_MAX {
            return err(
                "host_tier_bytes",
                format!(
                    "holds {} pages, more than the limit of {}",
                    self.host_tier_pages(),
                    limits::SLOTS_MAX
                ),
            );
        }
        if self.metrics_addr == self.listen_addr && self.listen_addr.port() != 0 {
            return err(
                "metrics_addr",
                format!(
                    "is {} like listen_addr; they must differ",
                    self.metrics_addr
                ),
            );
        }
        if let Err(e) = self.quic.validate() {
            return err(&format!("quic.{}", e.field), e.problem);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "/etc/spillway/node.toml";

    fn parse(text: &str) -> Result<NodeConfig, NodeConfigError> {
        NodeConfig::parse(text, Path::new(FILE))
    }

    const MINIMAL: &str = r#"
node_id = 3
pool_dir = "/pool"
data_dir = "/data"
host_tier_bytes = 1073741824
"#;

    /// The error's text names `field` and the file.
    fn assert_names(err: &NodeConfigError, field: &str) {
        let text = err.to_string();
        assert!(text.contains(field), "{text:?} does not name {field}");
        assert!(text.contains(FILE), "{text:?} does not name the file");
    }

    #[test]
    fn a_minimal_file_gets_the_defaults() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.node_id, NodeId(3));
        assert_eq!(c.listen_addr, "127.0.0.1:7700".parse().unwrap());
        assert_eq!(c.metrics_addr, "127.0.0.1:7701".parse().unwrap());
        assert_eq!(c.page_size, PageSize::default());
        assert_eq!(c.quic, QuicConfig::default());
        assert_eq!(c.host_tier_pages(), 512);
    }

    #[test]
    fn a_full_file_round_trips() {
        let mut c = NodeConfig::new(NodeId(7), "/p".into(), "/d".into(), 64 << 20);
        c.page_size = PageSize::new(64 << 10).unwrap();
        c.quic.connections_per_peer = 2;
        c.listen_addr = "10.0.0.7:7800".parse().unwrap();
        let text = toml::to_string(&c).unwrap();
        assert_eq!(parse(&text).unwrap(), c);
    }

    #[test]
    fn an_unknown_field_is_named() {
        let err = parse(&format!("{MINIMAL}host_tier_gib = 4\n")).unwrap_err();
        assert!(matches!(err, NodeConfigError::Parse { .. }), "{err}");
        assert_names(&err, "host_tier_gib");
    }

    #[test]
    fn an_unknown_quic_field_is_named() {
        let err = parse(&format!("{MINIMAL}[quic]\nmtu = 9000\n")).unwrap_err();
        assert_names(&err, "mtu");
    }

    #[test]
    fn a_wrong_type_is_named() {
        let text = MINIMAL.replace(
            "host_tier_bytes = 1073741824",
            "host_tier_bytes = \"1 GiB\"",
        );
        let err = parse(&text).unwrap_err();
        assert!(matches!(err, NodeConfigError::Parse { .. }), "{err}");
        assert_names(&err, "host_tier_bytes");
    }

    #[test]
    fn a_missing_required_field_is_named() {
        let text = MINIMAL.replace("host_tier_bytes = 1073741824", "");
        let err = parse(&text).unwrap_err();
        assert_names(&err, "host_tier_bytes");
    }

    #[test]
    fn a_bad_page_size_is_named() {
        let err = parse(&format!("{MINIMAL}page_size = 1000\n")).unwrap_err();
        assert_names(&err, "page_size");
    }

    #[test]
    fn range_errors_name_the_field() {
        let h = "host_tier_bytes = 1073741824";
        let cases = [
            (h, "host_tier_bytes = 4096", "host_tier_bytes"),
            ("node_id = 3", "node_id = 0", "node_id"),
            (
                h,
                "host_tier_bytes = 1073741824\n[quic]\nloopback_mtu_bytes = 9000",
                "quic.loopback_mtu_bytes",
            ),
            (
                h,
                "host_tier_bytes = 1073741824\nmetrics_addr = \"127.0.0.1:7700\"",
                "metrics_addr",
            ),
        ];
        for (from, to, field) in cases {
            let err = parse(&MINIMAL.replace(from, to)).unwrap_err();
            assert_eq!(err.field(), Some(field), "{err}");
            assert_names(&err, &format!("`{field}`"));
        }
    }

    #[test]
    fn a_missing_file_is_named() {
        let path = Path::new("/nonexistent/spillway/node.toml");
        let err = NodeConfig::load(path).unwrap_err();
        assert!(matches!(err, NodeConfigError::Read { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent/spillway/node.toml"));
    }
}
