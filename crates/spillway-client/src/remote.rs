//! The remote tier as the pool sees it: the spare RAM of other machines, behind the
//! [`RemoteTier`] trait.
//!
//! The core ([`spillway_core::PoolCore`]) decides which pages leave the host tier and
//! which come back; the pool hands each decision to a [`RemoteTier`] as a [`RemoteOp`]
//! and gets a [`RemoteCompletion`] back through the [`RemoteSink`] given when the tier
//! was made, from any thread. Implementations:
//! - `spillway_client::daemon`: the local node daemon, over its Unix socket, with the host
//!   slots in memory shared with the node (no page crosses the socket);
//! - an in-process one over `spillway-node`'s remote service (the multi-node demo);
//! - [`MemRemote`]: pages kept in this process's memory (tests).
//!
//! Contract (the same as a device's copies): while an op is in flight, nobody else
//! touches its host slot; a spill's bytes are read from the slot before its completion,
//! a fetch's bytes are in the slot before its completion. Every op completes exactly once,
//! successfully or with a message.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use spillway_device::Device;
use spillway_types::{HostSlot, PageId, TransferId};

/// What a remote op does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RemoteOpKind {
    /// Copy `bytes` of the host slot to the remote tier, under the page's id (replacing
    /// what the tier held for it).
    Spill,
    /// Copy the page's bytes from the remote tier into the host slot.
    Fetch,
}

/// One page moving between the host tier and the remote tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteOp {
    /// Reported back in the completion.
    pub id: TransferId,
    /// Which way.
    pub kind: RemoteOpKind,
    /// The page (its id is the key in the remote tier).
    pub page: PageId,
    /// The host side.
    pub slot: HostSlot,
    /// The page's length (the last page of a buffer may be short).
    pub bytes: u64,
}

/// A finished remote op.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteCompletion {
    /// The op's id, as submitted.
    pub id: TransferId,
    /// Whether the bytes arrived; the error names what failed.
    pub result: Result<(), String>,
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
pub type RemoteFactory =
    Box<dyn FnOnce(Arc<dyn Device>, RemoteSink) -> Result<Arc<dyn RemoteTier>, String> + Send>;

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
                .map_err(|e| format!("cannot start the remote tier's thread: {e}"))?;
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
    fn run(&self, op: RemoteOp) -> Result<(), String> {
        let mut pages = self.pages.lock().expect("mem remote lock");
        match op.kind {
            RemoteOpKind::Spill => {
                let mut data = vec![0u8; op.bytes as usize];
                self.device
                    .read_host(op.slot, 0, &mut data)
                    .map_err(|e| e.to_string())?;
                pages.insert(op.page, data);
                Ok(())
            }
            RemoteOpKind::Fetch => {
                let data = pages
                    .get(&op.page)
                    .ok_or_else(|| format!("remote tier does not hold page {}", op.page))?;
                if data.len() as u64 != op.bytes {
                    return Err(format!(
                        "page {} has {} bytes in the remote tier, {} expected",
                        op.page,
                        data.len(),
                        op.bytes
                    ));
                }
                self.device
                    .write_host(op.slot, 0, data)
                    .map_err(|e| e.to_string())
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
        5e9
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
