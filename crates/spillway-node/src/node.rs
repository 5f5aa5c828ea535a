//! A running node: [`Node::start`] loads the identity, binds the QUIC transport and serves
//! the host tier to peers; the [`NodeHandle`] it returns connects to peers, reads the
//! counters and shuts the node down.
//!
//! Shutdown follows mini-redis: one [`CancellationToken`] tells every task of the node to
//! stop, and a [`TaskTracker`] holds every task the node spawned, so
//! [`NodeHandle::shutdown`] returns only when all of them are gone. The peer service has
//! its own token and tracker inside [`Server`]; shutdown stops it first (no new requests),
//! then the node's own tasks, then closes the endpoint and waits until peers were told.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use spillway_net::certs::{CertError, NodeIdentity};
use spillway_net::quic::{QuicConnection, QuicTransport};
use spillway_net::{NetError, NetStats, Server, Transport};
use spillway_types::{NodeId, PoolId};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{NodeConfig, NodeConfigError};
use crate::remote::RemoteService;
use crate::store::{HostStore, StoreCounters};

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] NodeConfigError),
    /// The node's certificate could not be loaded from the pool directory.
    #[error("cannot load the identity of {node} from {}: {source}", pool_dir.display())]
    Identity {
        /// The node.
        node: NodeId,
        /// Where it was looked for.
        pool_dir: PathBuf,
        /// Why it failed.
        #[source]
        source: CertError,
    },
    /// The data directory could not be created.
    #[error("cannot create the data directory {}: {source}", path.display())]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The transport could not be bound.
    #[error("cannot bind the peer transport on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: NetError,
    },
}

/// A snapshot of a node's counters: what `/metrics` will export.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeCounters {
    /// The host tier.
    pub store: StoreCounters,
    /// Frames from peers that failed the wire checks (each closed its connection).
    pub frames_rejected: u64,
    /// Incoming connections refused at TLS (no pool certificate) or hello.
    pub handshakes_refused: u64,
    /// Incoming connections that completed TLS and hello.
    pub connections_accepted: u64,
    /// Frame bytes received from peers.
    pub peer_bytes_in: u64,
    /// Frame bytes sent to peers.
    pub peer_bytes_out: u64,
}

/// Starts nodes.
#[derive(Debug)]
pub struct Node;

impl Node {
    /// Validates `config`, loads the node's identity from `pool_dir`, creates `data_dir`,
    /// binds the peer transport on `listen_addr` and serves the host tier. Must be called
    /// inside a tokio runtime.
    pub async fn start(config: NodeConfig) -> Result<NodeHandle, NodeError> {
        config.validate()?;
        let identity = NodeIdentity::load(&config.pool_dir, config.node_id).map_err(|source| {
            NodeError::Identity {
                node: config.node_id,
                pool_dir: config.pool_dir.clone(),
                source,
            }
        })?;
        std::fs::create_dir_all(&config.data_dir).map_err(|source| NodeError::DataDir {
            path: config.data_dir.clone(),
            source,
        })?;
        let addr = config.listen_addr;
        let bind_err = |source| NodeError::Bind { addr, source };
        let transport =
            QuicTransport::bind(addr, identity, config.quic.clone()).map_err(bind_err)?;
        let store = Arc::new(HostStore::new(config.host_tier_bytes, config.page_size));
        let server = transport.serve(store.clone()).map_err(bind_err)?;
        tracing::info!(
            node = %config.node_id,
            addr = %transport.local_addr(),
            host_tier_bytes = config.host_tier_bytes,
            "node serving peers"
        );
        let config_remote_bytes = config.host_tier_bytes;
        Ok(NodeHandle {
            config,
            transport: Arc::new(transport),
            store,
            server: Some(server),
            remote: Arc::new(RemoteService::new(config_remote_bytes)),
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
        })
    }
}

/// A running node (from [`Node::start`]). Dropping it stops serving peers without waiting;
/// [`NodeHandle::shutdown`] stops everything and waits.
#[derive(Debug)]
pub struct NodeHandle {
    config: NodeConfig,
    transport: Arc<QuicTransport>,
    store: Arc<HostStore>,
    server: Option<Server>,
    remote: Arc<RemoteService>,
    /// Tells the node's own tasks to stop (none yet; Raft and the client socket will be).
    cancel: CancellationToken,
    /// Every task the node spawned besides the peer service's.
    tasks: TaskTracker,
}

impl NodeHandle {
    /// This node.
    pub fn node_id(&self) -> NodeId {
        self.transport.node_id()
    }

    /// This node's pool.
    pub fn pool_id(&self) -> PoolId {
        self.transport.pool_id()
    }

    /// Where peers reach this node (the bound port when the config asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.transport.local_addr()
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The host tier.
    pub fn store(&self) -> &Arc<HostStore> {
        &self.store
    }

    /// The remote tier of this node's local clients.
    pub fn remote(&self) -> Arc<RemoteService> {
        self.remote.clone()
    }

    /// The transport's per-peer counters.
    pub fn net_stats(&self) -> &Arc<NetStats> {
        self.transport.stats()
    }

    /// Connects to the peer at `addr` (mutual TLS and hello), to put, get and delete pages.
    pub async fn connect(&self, addr: SocketAddr) -> Result<QuicConnection, NetError> {
        self.transport.connect(addr).await
    }

    /// The node's counters now.
    pub fn counters(&self) -> NodeCounters {
        let net = self.transport.stats();
        let total = net.total();
        NodeCounters {
            store: self.store.counters(),
            frames_rejected: total.frames_rejected,
            handshakes_refused: net.handshakes_refused(),
            connections_accepted: net.connections_accepted(),
            peer_bytes_in: total.bytes_in,
            peer_bytes_out: total.bytes_out,
        }
    }

    /// Stops serving peers (requests in progress are abandoned; peers see their
    /// connections close), stops the node's tasks and waits for all of them, then closes
    /// the endpoint and waits until peers were told.
    pub async fn shutdown(mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        self.transport.close().await;
        tracing::info!(node = %self.config.node_id, "node shut down");
    }
}

impl Drop for NodeHandle {
    fn drop(&mut self) {
        // Dropping the server cancels it; the node's tasks are told too.
        self.cancel.cancel();
    }
}
