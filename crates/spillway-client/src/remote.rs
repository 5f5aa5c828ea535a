//! The remote tier as the pool sees it: the spare RAM of other machines, behind the
//! [`RemoteTier`] trait.
//!
//! The core ([`spillway_core::PoolCore`]) decides which pages leave the host tier and
//! which come back; the pool hands each decision to a [`RemoteTier`] as a [`RemoteOp`]
//! and gets a [`RemoteCompletion`] back through the [`RemoteSink`] given when the tier
//! was made, from any thread. Implementations:
//! - `spillway_client::daemon`: the local node daemon, over its Unix socket, with the host
//!   slots in memory shared with the node (no page crosses the socket);
//! - `spillway_client::service_tier` (feature `node`): a node in this process, through
//!   `spillway-node`'s remote service (the multi-node demo);
//! - [`MemRemote`]: pages kept in this process's memory (tests).
//!
//! Contract (the same as a device's copies): while an op is in flight, nobody else
//! touches its host slot; a spill's bytes are read from the slot before its completion,
//! a fetch's bytes are in the slot before its completion. Every op completes exactly once,
//! successfully or with a [`RemoteError`]. The ops are the core's own
//! ([`spillway_core::RemoteOp`]): the pool hands them over as the core gives them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use spillway_device::Device;
use spillway_types::PageId;

pub use spillway_core::{DeviceFault, RemoteError, RemoteOp, RemoteOpKind};

/// A finished remote op.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteCompletion {
    /// The op's id, as submitted.
    pub id: spillway_types::TransferId,
    /// Whether the bytes arrived; the error says what failed.
    pub result: Result<(), RemoteError>,
}

/// Why a pool's remote tier could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RemoteSetupError {
    /// A thread of the tier could not be started.
    #[error("cannot start the remote tier's {role} thread: {source}")]
    Thread {
        /// What the thread does.
        role: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The socket to the node could not be cloned for the tier's threads.
    #[error("cannot clone the socket to the node: {source}")]
    Socket {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A node link makes one remote tier; this one already made it.
    #[error("the link to {} already made its remote tier", socket.display())]
    LinkTaken {
        /// The node's socket.
        socket: PathBuf,
    },
}

/// Where remote completions go; called from the tier's threads, never while it holds a
/// lock of its own, so it may submit new ops.
pub type RemoteSink = Arc<dyn Fn(RemoteCompletion) + Send + Sync>;

/// The remote tier of one pool. See the module docs for the contract.
pub trait RemoteTier: Send + Sync {
    /// A human description (`"3 peers over QUIC via node 1"`).
    fn describe(&self) -> String;
    /// Bytes of pages this pool may keep in the remote tier.
    fn capacity_bytes(&self) -> u64;
    /// A first guess of the tier's bandwidth per direction, before any op is measured.
    fn bandwidth_hint_bytes_per_s(&self) -> f64;
    /// Starts `op`; its completion reaches the sink.
    fn submit(&self, op: RemoteOp);
    /// Drops the tier's copies of `pages` (their buffers were freed, or the pool holds
    /// newer bytes). Pages the tier does not hold are ignored. No completion.
    fn discard(&self, pages: Vec<PageId>);
}

/// Makes a pool's remote tier once the pool's device exists (the tier reads and writes
/// host slots through it) and its completion sink is known.
pub type RemoteFactory = Box<
    dyn FnOnce(Arc<dyn Device>, RemoteSink) -> Result<Arc<dyn RemoteTier>, RemoteSetupError> + Send,
>;

/// The bandwidth [`MemRemote`] claims: 5 GB/s, about a `memcpy` into touched memory on
/// a small machine (`../shared/FACTS.md`).
pub const MEM_REMOTE_BYTES_PER_S: f64 = 5e9;

/// A remote tier in this process's memory, for tests: ops run in order on a thread of
/// its own (so completions never arrive inside `submit`).
pub struct MemRemote {
    inner: Arc<MemInner>,
    ops: Mutex<std::sync::mpsc::Sender<RemoteOp>>,
}

struct MemInner {
    device: Arc<dyn Device>,
    capacity_bytes: u64,
    pages: Mutex<HashMap<PageId, Vec<u8>>>,
}

impl MemRemote {
    /// A factory for [`crate::PoolBuilder::remote`] of a tier holding at most
    /// `capacity_bytes`.
    pub fn factory(capacity_bytes: u64) -> RemoteFactory {
        Box::new(move |device, sink| {
            let inner = Arc::new(MemInner {
                device,
                capacity_bytes,
                pages: Mutex::new(HashMap::new()),
            });
            let (tx, rx) = std::sync::mpsc::channel::<RemoteOp>();
            let worker = inner.clone();
            std::thread::Builder::new()
                .name("spillway-mem-remote".into())
                .spawn(move || {
                    for op in rx {
                        let result = worker.run(op);
                        sink(RemoteCompletion { id: op.id, result });
                    }
                })
                .map_err(|source| RemoteSetupError::Thread {
                    role: "worker",
                    source,
                })?;
            Ok(Arc::new(MemRemote {
                inner,
                ops: Mutex::new(tx),
            }) as Arc<dyn RemoteTier>)
        })
    }

    /// Pages held now.
    pub fn pages_held(&self) -> usize {
        self.inner.pages.lock().expect("mem remote lock").len()
    }
}

impl MemInner {
    fn run(&self, op: RemoteOp) -> Result<(), RemoteError> {
        let mut pages = self.pages.lock().expect("mem remote lock");
        let slot_fault = |e: spillway_device::DeviceError| RemoteError::Slot {
            slot: op.slot,
            fault: DeviceFault::new(e),
        };
        match op.kind {
            RemoteOpKind::Spill => {
                let mut data = vec![0u8; op.bytes as usize];
                self.device
                    .read_host(op.slot, 0, &mut data)
                    .map_err(slot_fault)?;
                pages.insert(op.page, data);
                Ok(())
            }
            RemoteOpKind::Fetch => {
                let data = pages
                    .get(&op.page)
                    .ok_or(RemoteError::NotHeld { page: op.page })?;
                if data.len() as u64 != op.bytes {
                    return Err(RemoteError::WrongLength {
                        page: op.page,
                        got_bytes: data.len() as u64,
                        expected_bytes: op.bytes,
                    });
                }
                self.device.write_host(op.slot, 0, data).map_err(slot_fault)
            }
        }
    }
}

impl RemoteTier for MemRemote {
    fn describe(&self) -> String {
        "in-process memory".into()
    }

    fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes
    }

    fn bandwidth_hint_bytes_per_s(&self) -> f64 {
        MEM_REMOTE_BYTES_PER_S
    }

    fn submit(&self, op: RemoteOp) {
        // The worker lives as long as the sender: a send cannot fail while `self` exists.
        let _ = self.ops.lock().expect("mem remote lock").send(op);
    }

    fn discard(&self, pages: Vec<PageId>) {
        let mut held = self.inner.pages.lock().expect("mem remote lock");
        for p in pages {
            held.remove(&p);
        }
    }
}
