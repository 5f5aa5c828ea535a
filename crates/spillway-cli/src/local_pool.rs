//! A pool of node daemons inside this process, on loopback QUIC with mutual TLS: what
//! `spillway demo --nodes N` runs on. Each node is a full `spillway-node` (its Raft
//! member, host tier and peer service); node 1 serves the demo's pool, whose remote tier
//! is the other nodes' RAM.
//!
//! Everything lives in a fresh directory under the system's temporary directory (the
//! pool's CA and node certificates, each node's Raft log), removed when the pool shuts
//! down.

use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use spillway_client::PageSize;
use spillway_node::remote::RemoteService;
use spillway_node::{MemberAddr, Node, NodeConfig, NodeHandle, PageTransport};
use spillway_types::{NodeId, PoolId};

/// How long the nodes get to elect a leader and see each other's capacity.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// A running in-process pool (see the module docs).
pub struct LocalPool {
    runtime: tokio::runtime::Runtime,
    nodes: Vec<NodeHandle>,
    dir: PathBuf,
}

/// A loopback address with a port the OS just had free (bound and released at once; a
/// node binds it right after).
fn free_udp_port() -> Result<SocketAddr> {
    let s = UdpSocket::bind("127.0.0.1:0").context("finding a free loopback port")?;
    Ok(s.local_addr()?)
}

impl LocalPool {
    /// Starts `nodes` nodes, each lending `lend_bytes` of RAM to the others, and waits
    /// until node 1's clients can place `need_bytes` on peers.
    pub fn start(
        nodes: u32,
        lend_bytes: u64,
        page_size: PageSize,
        need_bytes: u64,
        transport: PageTransport,
    ) -> Result<LocalPool> {
        if nodes < 2 {
            bail!("an in-process pool needs at least 2 nodes, got {nodes}");
        }
        // The nodes' QUIC and Raft work: a thread per core up to 8 (the loop's own
        // threads need the rest).
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("spillway-node")
            .enable_all()
            .build()
            .context("starting the nodes' runtime")?;
        let dir = std::env::temp_dir().join(format!(
            "spillway-demo-{}-{:016x}",
            std::process::id(),
            rand_seed()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut pool = LocalPool {
            runtime,
            nodes: Vec::new(),
            dir,
        };
        let certs = pool.dir.join("certs");
        let ids: Vec<NodeId> = (1..=u64::from(nodes)).map(NodeId).collect();
        spillway_net::certs::init_pool_dir(&certs, PoolId(rand_seed().max(1)), &ids)
            .context("creating the pool's certificates")?;
        let members = ids
            .iter()
            .map(|&id| {
                Ok(MemberAddr {
                    id,
                    addr: free_udp_port()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for m in &members {
            let data = pool.dir.join(format!("node-{}", m.id.0));
            let mut cfg = NodeConfig::new(m.id, certs.clone(), data.clone(), lend_bytes);
            cfg.page_size = page_size;
            cfg.listen_addr = m.addr;
            cfg.metrics_addr = "127.0.0.1:0".parse().expect("a literal address");
            cfg.client_socket = data.join("client.sock");
            cfg.members = members.clone();
            cfg.lend_bytes = lend_bytes;
            cfg.transport = transport;
            let handle = pool
                .runtime
                .block_on(Node::start(cfg))
                .with_context(|| format!("starting node {}", m.id.0))?;
            pool.nodes.push(handle);
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        while pool.nodes[0].remote().capacity_bytes() < need_bytes {
            if Instant::now() > deadline {
                bail!(
                    "the in-process pool did not become ready in {READY_TIMEOUT:?}: node 1 can \
                     place {} bytes on peers, {need_bytes} needed",
                    pool.nodes[0].remote().capacity_bytes()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(pool)
    }

    /// Node 1's remote tier service, for the demo's pool.
    pub fn service(&self) -> Arc<RemoteService> {
        self.nodes[0].remote()
    }

    /// The runtime the nodes run on.
    pub fn handle(&self) -> tokio::runtime::Handle {
        self.runtime.handle().clone()
    }

    /// Stops every node gracefully and removes the pool's directory.
    pub fn shutdown(self) {
        let LocalPool {
            runtime,
            nodes,
            dir,
        } = self;
        runtime.block_on(async {
            for n in nodes {
                n.shutdown().await;
            }
        });
        drop(runtime);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove the pool's directory");
        }
    }
}

/// A seed that differs between runs (pool ids, directory names).
fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(u64::from(std::process::id()));
    h.finish()
}
