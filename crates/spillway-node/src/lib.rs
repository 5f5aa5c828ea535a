//! The Spillway node daemon, as a library: what `spillway node --config node.toml` runs.
//!
//! A node keeps a host tier (pages in its RAM, within a byte budget) and serves it to the
//! pool's other nodes over QUIC with mutual TLS (`spillway-net`): peers put, get and delete
//! pages; every page carries its checksum, checked on arrival and again on every read. The
//! same node runs over any `spillway_net::Transport` ([`Node::start_over`]; the simulated
//! transport in the whole-node tests).
//!
//! Parts:
//! - [`chaos`]: the whole pool in one process from a seed, under faults, with its
//!   invariants checked (`spillway chaos sim`).
//! - [`config`]: [`NodeConfig`], read from TOML and validated; every error names the file
//!   and the field.
//! - [`store`]: [`HostStore`], the host tier, and its peer [`Handler`](spillway_net::Handler).
//! - [`peers`]: the connection cache for all peer traffic, over an erased transport.
//! - [`meta`]: the node's member of the metadata group (spillway-meta's Raft node on its
//!   own thread, messages and forwarded proposals over the peer connections).
//! - [`service`]: the peer [`Handler`](spillway_net::Handler): pages to the host tier,
//!   Raft messages and proposals to the metadata group.
//! - [`remote`]: [`RemoteService`], the remote tier of this node's local clients (pages
//!   spilled to peers, placed in the replicated directory): the tokio driver of
//!   `placement`, the sans-IO brain that decides placement, reservation spending,
//!   batching, fetch routing and deletes; `ledger`, the sans-IO record of the
//!   reservations it holds on peers and spends; `tier`, their shared ids, limits, errors.
//! - [`http`]: `/metrics` (Prometheus) and `/status` (JSON) on `metrics_addr`.
//! - [`memory`]: what the node may hold resident ([`MemoryPlan`]: the host budget, which
//!   the peers' pages and the local clients' host tiers share, plus a documented
//!   overhead), checked at start against the cgroup's limit and `RLIMIT_MEMLOCK`.
//! - [`local`]: the Unix socket for this machine's clients, and the `ClientPages` seam
//!   behind it (with its in-memory twin, `MemClientPages`).
//! - [`membership`]: joining with a token (the bootstrap endpoint on the node holding
//!   the CA key, [`join_pool`] on the joining host), promotion of learners and removal
//!   of drained leaving members by the leader, [`NodeHandle::leave`].
//! - [`node`]: [`Node::start`] and the [`NodeHandle`] with the counters and the graceful
//!   shutdown.
//! - `ucx_pages` (feature `ucx`): page requests over UCX (`transport = "ucx"`), each UCX
//!   connection introduced over the authenticated QUIC connection to the peer.

pub mod chaos;
pub mod config;
mod config_size;
pub mod http;
mod ledger;
pub mod local;
pub mod membership;
pub mod memory;
pub mod meta;
pub mod node;
pub mod peers;
mod placement;
pub mod remote;
pub mod service;
pub mod store;
mod tier;
#[cfg(feature = "ucx")]
mod ucx_pages;

pub use config::{FieldDoc, MemberAddr, NodeConfig, NodeConfigError, PageTransport};
pub use http::{HostTierStatus, MemberStatus, NodeStatus, PlacementsView, RemoteStatus};
pub use membership::{JoinNodeError, LeaveError, ServeJoinsError, join_pool};
pub use memory::{HostBudget, MemoryError, MemoryLimits, MemoryPlan};
pub use meta::{MemberView, MetaView, Outcome, ProposeFailure, now_ms};
pub use node::{Node, NodeCounters, NodeError, NodeHandle};
pub use remote::{PeerRemoteCounters, RemoteCounters, RemoteError, RemoteService};
pub use store::{HostStore, StoreCounters, StoreError};
