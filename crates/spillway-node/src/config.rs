//! The node's configuration, in two layers like the pool's: [`NodeConfig`] is the serde
//! struct read from TOML (unknown keys refused, every optional field with a default), and
//! [`NodeConfig::validate`] checks ranges and names the first field that is wrong.
//! [`NodeConfig::load`] does both and names the file in every error.
//!
//! Two fields default from others: `client_socket` from `data_dir`, `lend_bytes` from
//! `host_budget` (the field `host_tier_bytes`; the old key is read with a note, and sizes
//! are integers or strings of the one size parser: `config_size`); [`NodeConfig::parse`] and [`NodeConfig::new`] fill them in, so a
//! loaded config always holds concrete values. [`NodeConfig::field_docs`] lists every
//! field with its doc and default (for `spillway node --help`).
//!
//! A file for the first node of a pool of three:
//!
//! ```toml
//! node_id = 1
//! pool_dir = "/etc/spillway/pool"
//! data_dir = "/var/lib/spillway/node-1"
//! host_budget = "64GiB"
//! listen_addr = "10.0.0.1:7700"
//! members = [
//!   { id = 1, addr = "10.0.0.1:7700" },
//!   { id = 2, addr = "10.0.0.2:7700" },
//!   { id = 3, addr = "10.0.0.3:7700" },
//! ]
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

/// Name of the client socket inside `data_dir` when `client_socket` is not set.
pub const CLIENT_SOCKET_FILE: &str = "spillway.sock";
/// Default length of one Raft tick: 100 ms (`spillway_meta::limits::TICK_MS_RECOMMENDED`).
pub const TICK_MS_DEFAULT: u64 = 100;
/// Shortest tick accepted: 10 ms (shorter ticks cost CPU and fsyncs for nothing).
pub const TICK_MS_MIN: u64 = 10;
/// Longest tick accepted: 10 s (fail-over would take minutes).
pub const TICK_MS_MAX: u64 = 10_000;
/// Default size of one capacity reservation: 64 MiB (32 pages of 2 MiB). A spill takes a
/// Raft round trip only once per chunk; a node may leave up to this much reserved and
/// unused on each peer.
pub const RESERVE_CHUNK_BYTES_DEFAULT: u64 = 64 << 20;
/// Default grace given a peer that stops answering before a fetch from it fails: 30 s
/// (longer than a garbage-collection pause, a `SIGSTOP` of seconds or a QUIC reconnect).
pub const PEER_GRACE_MS_DEFAULT: u64 = 30_000;
/// Shortest peer grace accepted: 1 s (QUIC notices a dead connection after its idle
/// timeout; less would fail fetches on a hiccup).
pub const PEER_GRACE_MS_MIN: u64 = 1_000;
/// Longest peer grace accepted: 10 min (a client waits this long at most on one fetch).
pub const PEER_GRACE_MS_MAX: u64 = 600_000;
/// Default failure-detection timeout: 2 s (`spillway_meta::limits::DOWN_AFTER_TICKS_DEFAULT`
/// at the default tick). The Raft leader declares a member down when it has not heard
/// from it for this long; the member's copies are then made again elsewhere, and when it
/// comes back it does so at a new epoch, with nothing it held before.
pub const DOWN_AFTER_MS_DEFAULT: u64 = 2_000;
/// Default number of holders of a page spilled to peers: 2 (a peer's death loses
/// nothing; spilled pages take twice their bytes of the pool's lent memory).
pub const REPLICAS_DEFAULT: u8 = 2;
/// Most holders of one page: 4, the directory's replica slots
/// (`spillway_meta::limits::REPLICAS_MAX`); each costs the page's bytes again on a peer.
pub const REPLICAS_MAX: u8 = spillway_meta::limits::REPLICAS_MAX as u8;
/// Longest zone label: 64 bytes (`spillway_meta::limits::ZONE_BYTES_MAX`; sent to every
/// member in the node's `MemberInfo`).
pub const ZONE_BYTES_MAX: usize = spillway_meta::limits::ZONE_BYTES_MAX;
/// Default bandwidth of re-replication (copying the pages of a dead holder to a new one):
/// 256 MiB/s per origin node, a small share of a NIC or of a loopback's ~4 GB/s, so demand
/// fetches keep the link; a dead holder of 64 GiB of one node's pages is repaired in
/// about 4.5 minutes.
pub const REPAIR_BYTES_PER_S_DEFAULT: u64 = 256 << 20;
/// Slowest re-replication accepted: 1 MiB/s (slower would leave pages under-replicated
/// for days).
pub const REPAIR_BYTES_PER_S_MIN: u64 = 1 << 20;
/// Largest node id: 4095. The remote tier packs the origin node into the top 12 bits of
/// a buffer id (see the remote tier's `remote_page_id`), so ids must fit there.
pub const NODE_ID_MAX: u64 = (1 << 12) - 1;
/// Most members in `members`: 1024 (`spillway_meta::limits::MEMBERS_MAX`).
pub const MEMBERS_MAX: usize = 1024;
/// `lend_bytes` as read when the file does not set it: replaced by `host_budget`.
const LEND_BYTES_UNSET: u64 = u64::MAX;

fn default_tick_ms() -> u64 {
    TICK_MS_DEFAULT
}
fn default_heartbeat_ticks() -> usize {
    1
}
fn default_election_ticks() -> usize {
    5
}
fn default_election_ticks_max() -> usize {
    8
}
fn default_lend_bytes() -> u64 {
    LEND_BYTES_UNSET
}
fn default_reserve_chunk_bytes() -> u64 {
    RESERVE_CHUNK_BYTES_DEFAULT
}
fn default_peer_grace_ms() -> u64 {
    PEER_GRACE_MS_DEFAULT
}
fn default_down_after_ms() -> u64 {
    DOWN_AFTER_MS_DEFAULT
}
fn default_replicas() -> u8 {
    REPLICAS_DEFAULT
}
fn default_repair_bytes_per_s() -> u64 {
    REPAIR_BYTES_PER_S_DEFAULT
}

/// How pages move between nodes (the `transport` field). Raft, reservations and the
/// introduction of UCX connections always travel over QUIC with mutual TLS.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PageTransport {
    /// Pages over the node's QUIC connections.
    #[default]
    Quic,
    /// Pages over UCX tagged messages (RDMA, shared memory or TCP, as UCX finds them and
    /// `UCX_TLS` / `UCX_NET_DEVICES` allow); needs the `ucx` feature and libucx. Every
    /// member of a pool should use the same transport: a node without UCX answers a UCX
    /// introduction with an error, and pages to it go over QUIC.
    Ucx,
}

impl PageTransport {
    /// Its name in the config file.
    pub fn name(self) -> &'static str {
        match self {
            PageTransport::Quic => "quic",
            PageTransport::Ucx => "ucx",
        }
    }
}

/// One member of the pool as the configuration names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemberAddr {
    /// Its node id.
    pub id: NodeId,
    /// Where peers reach it (its `listen_addr`, as seen from the others).
    pub addr: SocketAddr,
}

/// One documented field of [`NodeConfig`], for help texts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldDoc {
    /// The TOML key (`quic.` before the fields of the `[quic]` table).
    pub key: &'static str,
    /// What it is and what it trades.
    pub doc: &'static str,
    /// Its default, or `required`.
    pub default: &'static str,
}

/// Every field of [`NodeConfig`] with its doc and default (see [`NodeConfig::field_docs`]).
const FIELD_DOCS: &[FieldDoc] = &[
    FieldDoc {
        key: "node_id",
        doc: "this node's id in the pool (1..=4095); must match node-<id>.pem in pool_dir",
        default: "required",
    },
    FieldDoc {
        key: "pool_dir",
        doc: "the pool's CA certificate and this node's certificate and key",
        default: "required",
    },
    FieldDoc {
        key: "data_dir",
        doc: "the node's own directory (Raft log in raft/); on a local disk, its fsync bounds commit latency",
        default: "required",
    },
    FieldDoc {
        key: "host_budget",
        doc: "RAM the host tier may hold in pages, a size such as \"64GiB\" (at least one page; was host_tier_bytes); the node holds up to 1.05 x this + 32 MiB + buffers in flight (64 MiB per peer) + its local clients' host tiers, checked at start against the cgroup's memory limit",
        default: "required",
    },
    FieldDoc {
        key: "listen_addr",
        doc: "where peers reach this node (UDP, QUIC); port 0 picks a free port",
        default: LISTEN_ADDR_DEFAULT,
    },
    FieldDoc {
        key: "page_size",
        doc: "largest page stored, bytes (power of two, 64 KiB..64 MiB); must match clients",
        default: "2097152",
    },
    FieldDoc {
        key: "metrics_addr",
        doc: "where /metrics and /status listen (TCP); keep it off public interfaces",
        default: METRICS_ADDR_DEFAULT,
    },
    FieldDoc {
        key: "members",
        doc: "the initial pool: [{ id, addr }], this node among them; empty means a pool of this node alone",
        default: "[]",
    },
    FieldDoc {
        key: "client_socket",
        doc: "the Unix socket this machine's clients connect to",
        default: "<data_dir>/spillway.sock",
    },
    FieldDoc {
        key: "tick_ms",
        doc: "length of one Raft tick; every Raft timeout counts ticks",
        default: "100",
    },
    FieldDoc {
        key: "heartbeat_ticks",
        doc: "ticks between leader heartbeats (below election_ticks)",
        default: "1",
    },
    FieldDoc {
        key: "election_ticks",
        doc: "lower bound of the randomized election timeout, ticks; shorter fails over sooner, too short elects spuriously",
        default: "5",
    },
    FieldDoc {
        key: "election_ticks_max",
        doc: "upper bound (exclusive) of the election timeout, ticks; a wider range makes split votes rarer",
        default: "8",
    },
    FieldDoc {
        key: "lend_bytes",
        doc: "bytes of the host tier lent to the pool's other nodes (one page to host_budget)",
        default: "host_budget",
    },
    FieldDoc {
        key: "reserve_chunk_bytes",
        doc: "capacity reserved on a peer at a time; larger means fewer Raft rounds, more held idle",
        default: "67108864",
    },
    FieldDoc {
        key: "peer_grace_ms",
        doc: "how long a peer that stops answering is waited for (fetches retried with backoff) before a fetch from it fails; longer rides out pauses, shorter fails a job sooner",
        default: "30000",
    },
    FieldDoc {
        key: "down_after_ms",
        doc: "how long the Raft leader waits without hearing from a member before it declares it down (its copies are made again elsewhere); 0 never; at least election_ticks_max ticks",
        default: "2000",
    },
    FieldDoc {
        key: "replicas",
        doc: "holders of each page spilled to peers (1..=4), on distinct nodes (and zones, when labelled); 1 loses pages with their holder, each more costs the pages' bytes again",
        default: "2",
    },
    FieldDoc {
        key: "zone",
        doc: "this node's failure domain (rack, switch); replicas of a page go to distinct zones when every member has one",
        default: "none",
    },
    FieldDoc {
        key: "repair_bytes_per_s",
        doc: "bytes per second (or a size such as \"256MiB\") this node spends copying its pages from a surviving holder when another died; higher repairs sooner, takes more of the links from demand fetches",
        default: "268435456",
    },
    FieldDoc {
        key: "transport",
        doc: "how pages move between nodes: \"quic\" or \"ucx\" (needs the ucx feature and libucx); Raft always uses QUIC",
        default: "quic",
    },
    FieldDoc {
        key: "quic.loopback_mtu_bytes",
        doc: "MTU on loopback addresses (no MTU discovery there)",
        default: "6000",
    },
    FieldDoc {
        key: "quic.initial_mtu_bytes",
        doc: "initial MTU elsewhere; 1200 works on every path",
        default: "1200",
    },
    FieldDoc {
        key: "quic.mtu_discovery",
        doc: "probe for a larger MTU on non-loopback addresses",
        default: "true",
    },
    FieldDoc {
        key: "quic.socket_buffer_bytes",
        doc: "SO_SNDBUF and SO_RCVBUF of the UDP socket",
        default: "4194304",
    },
    FieldDoc {
        key: "quic.gso",
        doc: "generic segmentation offload (many packets per system call)",
        default: "true",
    },
    FieldDoc {
        key: "quic.peer_bytes_in_flight_max",
        doc: "payload bytes in flight per peer and direction",
        default: "67108864",
    },
    FieldDoc {
        key: "quic.stream_receive_window_bytes",
        doc: "flow-control window of one stream (one request)",
        default: "4194304",
    },
    FieldDoc {
        key: "quic.connection_receive_window_bytes",
        doc: "flow-control window of one connection",
        default: "16777216",
    },
    FieldDoc {
        key: "quic.send_window_bytes",
        doc: "bytes a connection may have sent but not acknowledged",
        default: "16777216",
    },
    FieldDoc {
        key: "quic.streams_per_connection_max",
        doc: "requests a peer may have open on one connection",
        default: "64",
    },
    FieldDoc {
        key: "quic.connections_per_peer",
        doc: "QUIC connections opened to each peer, used in turn",
        default: "4",
    },
    FieldDoc {
        key: "quic.connections_max",
        doc: "connections accepted at once",
        default: "see QuicConfig",
    },
    FieldDoc {
        key: "quic.idle_timeout_ms",
        doc: "a connection with no traffic for this long is closed",
        default: "3000",
    },
    FieldDoc {
        key: "quic.keep_alive_interval_ms",
        doc: "keep-alive ping interval (below idle_timeout_ms)",
        default: "1000",
    },
    FieldDoc {
        key: "quic.hello_timeout_ms",
        doc: "time a new connection has for TLS and the hello exchange",
        default: "see QuicConfig",
    },
];

/// One node's configuration, as written in its TOML file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// This node's id in the pool (required, not 0). Must match a certificate in
    /// `pool_dir` (`node-<id>.pem`, which names this id); peers know the node by it.
    pub node_id: NodeId,
    /// The node's pool directory (required; `cluster init` writes one per node): the pool's
    /// CA certificate and this node's certificate and key, never the CA's key. Whoever can
    /// read it can join the pool as this node, and only as this node.
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
    /// anything else. The page index adds about 100 bytes per page on top. In the file:
    /// `host_budget`, a size (`"64GiB"` or bytes); the old key `host_tier_bytes` is read
    /// with a note.
    #[serde(
        rename = "host_budget",
        alias = "host_tier_bytes",
        deserialize_with = "crate::config_size::size"
    )]
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
    /// The pool's first members, each `{ id, addr }` (peer QUIC addresses); this node must
    /// be one of them. Used only when the Raft log in `data_dir` is empty (a new pool):
    /// every first node must list the same members. Empty (the default) means a pool of
    /// this node alone, at `listen_addr`.
    #[serde(default)]
    pub members: Vec<MemberAddr>,
    /// The Unix socket this machine's clients connect to. Default
    /// `<data_dir>/spillway.sock`. Whoever can connect can spend this node's memory.
    #[serde(default)]
    pub client_socket: PathBuf,
    /// Length of one Raft tick in milliseconds (default 100). Every Raft timeout below is
    /// counted in ticks; a shorter tick fails over sooner and costs more heartbeats.
    #[serde(default = "default_tick_ms")]
    pub tick_ms: u64,
    /// Ticks between leader heartbeats (default 1; below `election_ticks`).
    #[serde(default = "default_heartbeat_ticks")]
    pub heartbeat_ticks: usize,
    /// Lower bound of the randomized election timeout, in ticks (default 5). Shorter fails
    /// over sooner; too short elects spuriously when a leader stalls (a slow fsync).
    #[serde(default = "default_election_ticks")]
    pub election_ticks: usize,
    /// Upper bound (exclusive) of the randomized election timeout, in ticks (default 8).
    /// A wider range makes split votes rarer; a narrower one bounds fail-over tighter.
    #[serde(default = "default_election_ticks_max")]
    pub election_ticks_max: usize,
    /// Bytes of the host tier lent to the pool's other nodes (default: all of
    /// `host_tier_bytes`; at least one page). Peers place pages here through the
    /// directory; what is lent is not available to this node's own clients when peers use
    /// it.
    #[serde(
        default = "default_lend_bytes",
        deserialize_with = "crate::config_size::size"
    )]
    pub lend_bytes: u64,
    /// Capacity reserved on a peer at a time when spilling (default 64 MiB, at least one
    /// page). Larger: fewer Raft rounds per spilled byte, more capacity held idle per peer.
    #[serde(
        default = "default_reserve_chunk_bytes",
        deserialize_with = "crate::config_size::size"
    )]
    pub reserve_chunk_bytes: u64,
    /// How long a peer that stops answering is waited for before a fetch of pages it holds
    /// fails, in milliseconds (default 30 000, from 1 000 to 600 000). Fetches are retried
    /// with backoff within it; discards are retried until they land, whatever the grace.
    /// Longer rides out longer pauses (GC, `SIGSTOP`, a rebooting switch); shorter fails a
    /// job sooner when a peer is really gone.
    #[serde(default = "default_peer_grace_ms")]
    pub peer_grace_ms: u64,
    /// How long the Raft leader goes without hearing from a member before it declares it
    /// down, in milliseconds (default 2 000; 0: never; else at least `election_ticks_max`
    /// ticks). Shorter starts re-replication sooner; longer forgives longer stalls (a node
    /// declared down that was only paused comes back at a new epoch, its copies dead).
    #[serde(default = "default_down_after_ms")]
    pub down_after_ms: u64,
    /// Holders of each page this node spills to peers (default 2, from 1 to
    /// [`REPLICAS_MAX`]), on distinct nodes, and on distinct zones when every member has a
    /// `zone`. A spill completes when every holder acknowledged the bytes and the directory
    /// recorded them. More survives more deaths and costs the pages' bytes again per
    /// holder; 1 (logged as a warning) loses a page with its holder.
    #[serde(default = "default_replicas")]
    pub replicas: u8,
    /// This node's failure domain (a rack, a switch, a power feed), at most
    /// [`ZONE_BYTES_MAX`] bytes; unset by default. Replicas of a page go to distinct zones
    /// when every member has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Bandwidth, in bytes per second, this node spends on re-replication: copying its
    /// pages from a surviving holder to a new one after a holder died (default 256 MiB/s,
    /// at least 1 MiB/s). Higher repairs sooner and takes more of the links from demand
    /// fetches, which always go first.
    #[serde(
        default = "default_repair_bytes_per_s",
        deserialize_with = "crate::config_size::size"
    )]
    pub repair_bytes_per_s: u64,
    /// How pages move between nodes: `"quic"` (default) or `"ucx"` (RDMA where the NICs
    /// have it; needs a build with the `ucx` feature and libucx on the machine). Raft and
    /// reservations always use QUIC, which also introduces the UCX connections, so a UCX
    /// worker address is only ever taken from an authenticated peer.
    #[serde(default)]
    pub transport: PageTransport,
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
        let mut config = NodeConfig {
            node_id,
            pool_dir,
            listen_addr: default_listen_addr(),
            data_dir,
            host_tier_bytes,
            page_size: PageSize::default(),
            quic: QuicConfig::default(),
            metrics_addr: default_metrics_addr(),
            members: Vec::new(),
            client_socket: PathBuf::new(),
            tick_ms: TICK_MS_DEFAULT,
            heartbeat_ticks: default_heartbeat_ticks(),
            election_ticks: default_election_ticks(),
            election_ticks_max: default_election_ticks_max(),
            lend_bytes: LEND_BYTES_UNSET,
            reserve_chunk_bytes: RESERVE_CHUNK_BYTES_DEFAULT,
            peer_grace_ms: PEER_GRACE_MS_DEFAULT,
            down_after_ms: DOWN_AFTER_MS_DEFAULT,
            replicas: REPLICAS_DEFAULT,
            zone: None,
            repair_bytes_per_s: REPAIR_BYTES_PER_S_DEFAULT,
            transport: PageTransport::Quic,
        };
        config.fill_defaults();
        config
    }

    /// Every field with its doc and default, in file order (for `spillway node --help`).
    pub fn field_docs() -> &'static [FieldDoc] {
        FIELD_DOCS
    }

    /// Fills in the fields whose defaults come from other fields.
    fn fill_defaults(&mut self) {
        if self.client_socket.as_os_str().is_empty() {
            self.client_socket = self.data_dir.join(CLIENT_SOCKET_FILE);
        }
        if self.lend_bytes == LEND_BYTES_UNSET {
            self.lend_bytes = self.host_tier_bytes;
        }
    }

    /// The pool's first members: `members`, or this node alone at `listen_addr`.
    pub fn initial_members(&self) -> Vec<MemberAddr> {
        if self.members.is_empty() {
            vec![MemberAddr {
                id: self.node_id,
                addr: self.listen_addr,
            }]
        } else {
            self.members.clone()
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

    /// Parses and validates TOML `text`; `origin` names it in errors. A file with the old
    /// key `host_tier_bytes` is read, and a note printed to stderr.
    pub fn parse(text: &str, origin: &Path) -> Result<NodeConfig, NodeConfigError> {
        if let Some(note) = crate::config_size::old_key_note(text, origin) {
            eprintln!("{note}");
        }
        let mut config: NodeConfig = toml::from_str(text).map_err(|e| NodeConfigError::Parse {
            path: origin.to_path_buf(),
            message: e.to_string(),
        })?;
        config.fill_defaults();
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
        if self.node_id.0 > NODE_ID_MAX {
            return err(
                "node_id",
                format!(
                    "is {} but node ids end at {NODE_ID_MAX} (the remote tier packs them into buffer ids)",
                    self.node_id.0
                ),
            );
        }
        let page = self.page_size.bytes();
        if self.host_tier_bytes < page {
            return err(
                "host_budget",
                format!(
                    "is {} but must hold at least one page of {page} bytes",
                    self.host_tier_bytes
                ),
            );
        }
        if self.host_tier_pages() > limits::SLOTS_MAX {
            return err(
                "host_budget",
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
        if self.members.len() > MEMBERS_MAX {
            return err(
                "members",
                format!(
                    "lists {} members, more than {MEMBERS_MAX}",
                    self.members.len()
                ),
            );
        }
        for (i, m) in self.members.iter().enumerate() {
            if m.id.0 == 0 || m.id.0 > NODE_ID_MAX {
                return err(
                    "members",
                    format!("entry {i} has id {}, not in 1..={NODE_ID_MAX}", m.id.0),
                );
            }
            if let Some(dup) = self.members[..i].iter().find(|o| o.id == m.id) {
                return err("members", format!("lists {} twice", dup.id));
            }
            if let Some(dup) = self.members[..i].iter().find(|o| o.addr == m.addr) {
                return err(
                    "members",
                    format!("gives {} to {} and {}", m.addr, dup.id, m.id),
                );
            }
            if m.addr.port() == 0 || m.addr.ip().is_unspecified() {
                return err(
                    "members",
                    format!(
                        "gives {} the address {}, which peers cannot reach",
                        m.id, m.addr
                    ),
                );
            }
        }
        if !self.members.is_empty() && !self.members.iter().any(|m| m.id == self.node_id) {
            return err(
                "members",
                format!("does not list this node ({})", self.node_id),
            );
        }
        if let Some(me) = self.members.iter().find(|m| m.id == self.node_id) {
            let listen = self.listen_addr;
            let consistent = if listen.ip().is_unspecified() {
                listen.port() == 0 || listen.port() == me.addr.port()
            } else {
                listen.port() == 0 || listen == me.addr
            };
            if !consistent {
                return err(
                    "listen_addr",
                    format!(
                        "is {listen} but members gives this node {}: peers would not reach it",
                        me.addr
                    ),
                );
            }
        }
        if self.client_socket.as_os_str().is_empty() {
            return err("client_socket", "is empty".to_string());
        }
        if !(TICK_MS_MIN..=TICK_MS_MAX).contains(&self.tick_ms) {
            return err(
                "tick_ms",
                format!(
                    "is {} but must be from {TICK_MS_MIN} to {TICK_MS_MAX}",
                    self.tick_ms
                ),
            );
        }
        if self.heartbeat_ticks == 0 {
            return err("heartbeat_ticks", "is 0 but must be at least 1".to_string());
        }
        if self.election_ticks <= self.heartbeat_ticks {
            return err(
                "election_ticks",
                format!(
                    "is {} but must be more than heartbeat_ticks ({})",
                    self.election_ticks, self.heartbeat_ticks
                ),
            );
        }
        if self.election_ticks_max <= self.election_ticks {
            return err(
                "election_ticks_max",
                format!(
                    "is {} but must be more than election_ticks ({})",
                    self.election_ticks_max, self.election_ticks
                ),
            );
        }
        if self.lend_bytes > self.host_tier_bytes {
            return err(
                "lend_bytes",
                format!(
                    "is {} but the host tier holds only {} (host_budget)",
                    self.lend_bytes, self.host_tier_bytes
                ),
            );
        }
        // A member with no room for a page would never be ready: `cluster up` waits for
        // every member's lent capacity, and peers could place nothing on it.
        if self.lend_bytes < page {
            return err(
                "lend_bytes",
                format!(
                    "is {} but a node lends at least one page ({page} bytes) to its peers; \
                     leave it out to lend the whole host tier",
                    self.lend_bytes
                ),
            );
        }
        if self.reserve_chunk_bytes < page
            || self.reserve_chunk_bytes > limits::PAGE_BYTES_MAX * 1024
        {
            return err(
                "reserve_chunk_bytes",
                format!(
                    "is {} but must be from one page ({page} bytes) to {} bytes",
                    self.reserve_chunk_bytes,
                    limits::PAGE_BYTES_MAX * 1024
                ),
            );
        }
        if !(PEER_GRACE_MS_MIN..=PEER_GRACE_MS_MAX).contains(&self.peer_grace_ms) {
            return err(
                "peer_grace_ms",
                format!(
                    "is {} but must be from {PEER_GRACE_MS_MIN} to {PEER_GRACE_MS_MAX} ms",
                    self.peer_grace_ms
                ),
            );
        }
        let election_ms = self.election_ticks_max as u64 * self.tick_ms;
        if self.down_after_ms != 0 && self.down_after_ms < election_ms {
            return err(
                "down_after_ms",
                format!(
                    "is {} but must be 0 (never) or at least election_ticks_max ticks ({election_ms} ms)",
                    self.down_after_ms
                ),
            );
        }
        if self.replicas == 0 || self.replicas > REPLICAS_MAX {
            return err(
                "replicas",
                format!("is {} but must be from 1 to {REPLICAS_MAX}", self.replicas),
            );
        }
        if let Some(zone) = &self.zone
            && (zone.is_empty()
                || zone.len() > ZONE_BYTES_MAX
                || zone.chars().any(|c| c.is_control()))
        {
            return err(
                "zone",
                format!(
                    "is {zone:?} but must be 1 to {ZONE_BYTES_MAX} bytes without control characters"
                ),
            );
        }
        if self.repair_bytes_per_s < REPAIR_BYTES_PER_S_MIN {
            return err(
                "repair_bytes_per_s",
                format!(
                    "is {} but must be at least {REPAIR_BYTES_PER_S_MIN}",
                    self.repair_bytes_per_s
                ),
            );
        }
        if self.transport == PageTransport::Ucx && !cfg!(feature = "ucx") {
            return err(
                "transport",
                "is \"ucx\" but this build has no UCX transport: build spillway with \
                 `--features ucx` (system packages: scripts/install-ucx.sh), or set \
                 transport = \"quic\""
                    .to_string(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
