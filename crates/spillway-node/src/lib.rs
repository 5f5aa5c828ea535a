//! The Spillway node daemon, as a library: what `spillway node --config node.toml` runs.
//!
//! A node keeps a host tier (pages in its RAM, within a byte budget) and serves it to the
//! pool's other nodes over QUIC with mutual TLS (`spillway-net`): peers put, get and delete
//! pages; every page carries its checksum, checked on arrival and again on every read.
//!
//! Parts:
//! - [`config`]: [`NodeConfig`], read from TOML and validated; every error names the file
//!   and the field.
//! - [`store`]: [`HostStore`], the host tier, and its peer [`Handler`](spillway_net::Handler).
//! - [`node`]: [`Node::start`] and the [`NodeHandle`] with the counters and the graceful
//!   shutdown.
//!
//! Not yet here: the Raft-coordinated directory (`spillway-meta`), the local client socket
//! with pages in shared memory, the `/metrics` endpoint (the counters are ready in
//! [`NodeCounters`]) and the remote tier (spilling to peers when the host tier is full).

pub mod config;
pub mod local;
pub mod node;
pub mod remote;
pub mod store;

pub use config::{FieldDoc, MemberAddr, NodeConfig, NodeConfigError};
pub use node::{Node, NodeCounters, NodeError, NodeHandle};
pub use remote::{RemoteCounters, RemoteError, RemoteService};
pub use store::{HostStore, StoreCounters, StoreError};
