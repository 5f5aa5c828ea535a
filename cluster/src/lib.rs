//! The launcher of a pool of Spillway node processes on one machine, and the client of
//! the nodes' `/status` endpoint: what `spillway cluster init|up|down` and
//! `spillway status` run. This crate is where the launcher for multi-node jobs (Slurm,
//! several hosts) will grow.
//!
//! Parts:
//! - [`spec`]: a pool directory ([`ClusterSpec`], `cluster.json`): the pool's CA and node
//!   certificates, one `node-<id>.toml` per node, loopback ports from a base port.
//! - [`process`]: node processes: spawned in their own process group with their output in
//!   `node-<id>/node.log` and their pid in `node-<id>/node.pid`; stopped with SIGTERM, then
//!   SIGKILL after a deadline. A pid is only signalled if `/proc` shows it is still the
//!   node started with that config (pids are reused).
//! - [`http`] and [`status`]: a bounded HTTP/1.1 GET over a std `TcpStream` (connect and
//!   read deadlines, at most [`http::RESPONSE_BYTES_MAX`] bytes) and the `/status` schema;
//!   a node that does not answer is reported down, never an error of the whole query.
//! - [`launcher`]: `up` (init if needed, spawn, wait until every node answers and they
//!   agree on a leader, with a deadline) and `down`.
//!
//! Nothing here sleeps in place of a condition: every wait polls a condition against a
//! deadline ([`launcher::poll_until`]).

pub mod error;
pub mod http;
pub mod launcher;
pub mod process;
pub mod spec;
pub mod status;

pub use error::ClusterError;
pub use launcher::{UpEvent, UpOptions, UpReport, down, poll_until, up, wait_ready};
pub use process::{StopOutcome, StopReport};
pub use spec::{ClusterSpec, InitOptions, NodeSpec, init};
pub use status::{NodeReport, NodeStatus, PoolReport, StatusError, fetch_status, query_pool};
