//! UCX (feature `ucx`): a safe wrapper over UCX's tagged messages, the base of the UCX
//! transport of the remote tier. UCX reaches RDMA, shared memory and TCP
//! through one API; which one it uses is UCX's choice under `UCX_TLS` and
//! `UCX_NET_DEVICES` (tests set `UCX_NET_DEVICES=lo UCX_TLS=tcp,self`: UCX over TCP
//! otherwise uses every interface it finds).
//!
//! Parts:
//! - [`Worker`]: one UCP context and worker, owned by a dedicated thread
//!   (`spillway-ucx`) that runs a single-threaded tokio runtime. Handles send it commands
//!   over a channel; the thread posts them to UCX and drives progress. When there is no
//!   work it sleeps on the worker's event fd (`ucp_worker_get_efd`, armed with
//!   `ucp_worker_arm`, watched by tokio's `AsyncFd`) and on the command channel: an idle
//!   worker burns no CPU ([`WorkerStats::wakeups`] counts the fd's wake-ups).
//! - [`Worker::address`] and [`Worker::connect`]: the worker's address is exchanged out of
//!   band (by the caller: a side channel, or the pool's membership); [`Endpoint`] is a
//!   connection to a peer's worker, with peer failure detection on
//!   (`UCP_ERR_HANDLING_MODE_PEER`).
//! - [`Endpoint::send`]: a tagged message of a frame header and a payload, sent as one
//!   iov (no copy); [`Worker::recv`]: a tagged receive into a slot of memory registered
//!   once with `ucp_mem_map` ([`Received`] lends the slot until dropped).
//! - [`UcxTransport`]: the remote tier's [`Transport`](crate::Transport) over these
//!   messages, with the same frames and checks as QUIC.
//! - `raw`: every `unsafe` of this module, with the invariants that make it sound.
//!
//! The library: UCX is not linked but loaded when the first [`Worker`] starts
//! (`spillway-ucx-sys`: `libucp.so.0`, then `libucp.so`, or the path in
//! `SPILLWAY_UCX_LIB`), once per process. A binary built with `ucx` so runs without
//! libucx as long as it does not ask for UCX; when it does, [`Worker::start`] fails with
//! [`UcxError::Library`], whose message names the library tried, the loader's reason and
//! how to install UCX (Debian package `libucx0`, or `scripts/install-ucx.sh`). Building
//! still needs UCX's headers (`libucx-dev`) and libclang.
//!
//! Limits (each from [`UcxWorkerConfig`]): receives in flight at most
//! [`UcxWorkerConfig::recv_slots_count`] (a receive waits for a free slot); a message of
//! more than [`UcxWorkerConfig::recv_slot_bytes`] fails its receive with
//! [`UcxError::MessageTooLarge`]; registered memory is their product (64 MiB by
//! default). Sends in flight at most [`UcxWorkerConfig::sends_in_flight_max`]; each
//! holds its `Bytes` until UCX is done with them.
//!
//! Failure: when a peer goes away, UCX reports it on the endpoint; its sends fail with
//! [`UcxError::PeerLost`], and so do the receives posted with that endpoint as their
//! expected sender ([`Worker::recv`]'s `from`). Receives from anyone stay posted.
//!
//! Transports: peer failure detection needs a UCX transport that supports it. UCX 1.13's
//! shared-memory transports (`sm`: posix, sysv, cma) do not, so with `UCX_TLS=sm,self`
//! connecting fails ("no peer failure handler", `Destination is unreachable`); on one
//! host use TCP on `lo` (`UCX_TLS=tcp,self`) until error handling becomes a choice.
//!
//! Trust: a worker address is handed to UCX as is, and UCX unpacks it without bounds
//! checks. Addresses must come from an authenticated channel (the pool's TLS side
//! channel or membership), never straight from an unauthenticated socket.

mod driver;
mod raw;
mod transport;

pub use spillway_ucx_sys::LoadError;
pub use transport::{UcxConnection, UcxTransport};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use driver::Command;

/// Default receive slot: 4 MiB + 64 KiB, one 4 MiB page and its frame header.
pub const RECV_SLOT_BYTES_DEFAULT: usize = (4 << 20) + (64 << 10);
/// Default receive slots: 16 (about 65 MiB registered per worker).
pub const RECV_SLOTS_DEFAULT: usize = 16;
/// Most registered receive memory per worker: 4 GiB.
pub const RECV_REGION_BYTES_MAX: usize = 4 << 30;
/// Default sends in flight per worker: 64.
pub const SENDS_IN_FLIGHT_DEFAULT: usize = 64;
/// UCX settings a worker applies unless the environment sets them (`UCX_<name>` or
/// `UCX_TCP_<name>`), when TCP may be in use (`UCX_TLS` unset or naming it): the TCP
/// transport's segment sizes. UCX's TCP rendezvous moves a
/// large message as a pipeline of active messages of one segment each (8 KiB sent, 64 KiB
/// received by default: a system call and a copy per segment); 1 MiB segments moved 2 MiB
/// pages about half again as fast on loopback (`spillway bench remote --transport ucx`,
/// recorded in bench/RESULTS.md). UCX takes transport settings without their prefix here
/// (`TX_SEG_SIZE`, not `TCP_TX_SEG_SIZE`), so they reach every transport that has them.
pub const UCX_DEFAULTS: &[(&str, &str)] = &[("TX_SEG_SIZE", "1m"), ("RX_SEG_SIZE", "1m")];

/// Tuning of one [`Worker`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxWorkerConfig {
    /// Bytes of one receive slot: the largest message a receive takes. Larger slots
    /// take larger pages, at the cost of that many registered bytes per slot.
    pub recv_slot_bytes: usize,
    /// Receive slots: receives in flight at once. More keep more messages moving, at the
    /// cost of `recv_slot_bytes` of registered memory each.
    pub recv_slots_count: usize,
    /// Sends in flight at once; a send beyond waits. Each holds its buffers until done.
    pub sends_in_flight_max: usize,
}

impl Default for UcxWorkerConfig {
    fn default() -> Self {
        UcxWorkerConfig {
            recv_slot_bytes: RECV_SLOT_BYTES_DEFAULT,
            recv_slots_count: RECV_SLOTS_DEFAULT,
            sends_in_flight_max: SENDS_IN_FLIGHT_DEFAULT,
        }
    }
}

impl UcxWorkerConfig {
    /// Names the first field that is wrong.
    pub fn validate(&self) -> Result<(), UcxError> {
        let bad = |field: &'static str, problem: String| Err(UcxError::Config { field, problem });
        if self.recv_slot_bytes == 0 {
            return bad("recv_slot_bytes", "must be at least 1".into());
        }
        if self.recv_slots_count == 0 {
            return bad("recv_slots_count", "must be at least 1".into());
        }
        match self.recv_slot_bytes.checked_mul(self.recv_slots_count) {
            Some(total) if total <= RECV_REGION_BYTES_MAX => {}
            _ => {
                return bad(
                    "recv_slots_count",
                    format!(
                        "{} slots of {} bytes exceed the {RECV_REGION_BYTES_MAX} bytes of registered memory allowed",
                        self.recv_slots_count, self.recv_slot_bytes
                    ),
                );
            }
        }
        if self.sends_in_flight_max == 0 {
            return bad("sends_in_flight_max", "must be at least 1".into());
        }
        Ok(())
    }
}

/// What can go wrong in the UCX wrapper.
#[derive(Debug, thiserror::Error)]
pub enum UcxError {
    /// UCX's library could not be loaded (not installed, or not where `SPILLWAY_UCX_LIB`
    /// points): the message names what was tried, why it failed and how to install UCX.
    #[error(transparent)]
    Library {
        /// What the loader reported.
        source: LoadError,
    },
    /// A UCX call failed.
    #[error("UCX {call} failed: {status}")]
    Call {
        /// The UCX function.
        call: &'static str,
        /// UCX's name for the status.
        status: String,
    },
    /// The peer of an endpoint went away (or its connection broke).
    #[error("peer of UCX endpoint {endpoint} lost: {status}")]
    PeerLost {
        /// The endpoint's id.
        endpoint: u64,
        /// What UCX reported.
        status: String,
    },
    /// A message was larger than the receive slot.
    #[error("a message was larger than the {slot_bytes}-byte receive slot")]
    MessageTooLarge {
        /// [`UcxWorkerConfig::recv_slot_bytes`].
        slot_bytes: usize,
    },
    /// A receive was cancelled (the worker is stopping).
    #[error("UCX request cancelled")]
    Cancelled,
    /// The worker's thread has stopped.
    #[error("the UCX worker has stopped")]
    WorkerStopped,
    /// A worker address too short to be one.
    #[error("a UCX worker address of {address_bytes} bytes is not one")]
    BadAddress {
        /// Its length.
        address_bytes: usize,
    },
    /// A configuration field is invalid.
    #[error("UCX config: {field} {problem}")]
    Config {
        /// The field.
        field: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// The worker's thread or its runtime could not be started.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Counters of one worker.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Times the worker's event fd woke its thread.
    pub wakeups: AtomicU64,
    /// Calls of `ucp_worker_progress`.
    pub progress_calls: AtomicU64,
    /// Messages sent (completed successfully).
    pub sends_completed: AtomicU64,
    /// Messages received.
    pub recvs_completed: AtomicU64,
    /// Times the idle timer found work that no wake-up had announced.
    pub missed_wakeups: AtomicU64,
}

pub(crate) struct Shared {
    /// The worker's thread, joined when the last handle goes ([`Drop`] below): no UCX
    /// teardown outlives the handles, so none runs while the process exits.
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    os_thread_id: Option<u32>,
    commands: mpsc::UnboundedSender<Command>,
    region: Arc<raw::Region>,
    recv_slots: Arc<Semaphore>,
    sends: Arc<Semaphore>,
    address: Vec<u8>,
    next_id: AtomicU64,
    stats: Arc<WorkerStats>,
    version: String,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The command channel closes as this drops (after this body), which is what tells
        // the thread to stop: close it first, then wait for the teardown.
        let (closed, _) = mpsc::unbounded_channel();
        drop(std::mem::replace(&mut self.commands, closed));
        let thread = self.thread.get_mut().ok().and_then(Option::take);
        if let Some(t) = thread
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn command(&self, c: Command) -> Result<(), UcxError> {
        self.commands.send(c).map_err(|_| UcxError::WorkerStopped)
    }
}

/// A UCP worker on its own thread. Cheap to clone; the thread stops at
/// [`Worker::shutdown`] or when the last handle (and endpoint) is dropped.
#[derive(Clone)]
pub struct Worker {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("address_bytes", &self.shared.address.len())
            .finish()
    }
}

impl Worker {
    /// Starts a worker thread with its own UCP context (configured by the `UCX_*`
    /// environment), and registers its receive memory. The first start in a process
    /// loads libucp; without it this fails with [`UcxError::Library`].
    pub fn start(config: &UcxWorkerConfig) -> Result<Worker, UcxError> {
        config.validate()?;
        let shared = driver::start(config)?;
        Ok(Worker { shared })
    }

    /// This worker's address, for peers' [`Worker::connect`].
    pub fn address(&self) -> &[u8] {
        &self.shared.address
    }

    /// The UCX library's version.
    pub fn ucx_version(&self) -> &str {
        &self.shared.version
    }

    /// The OS id of the worker's thread (Linux), to account its CPU time
    /// (`/proc/self/task/<id>/stat`); `None` where it cannot be read.
    pub fn os_thread_id(&self) -> Option<u32> {
        self.shared.os_thread_id
    }

    /// The longest message a receive takes ([`UcxWorkerConfig::recv_slot_bytes`]).
    pub fn max_message_bytes(&self) -> usize {
        self.shared.region.slot_bytes()
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<WorkerStats> {
        &self.shared.stats
    }

    /// Connects to the worker at `address` (from that worker's [`Worker::address`],
    /// received over an authenticated channel: see the module docs).
    pub async fn connect(&self, address: &[u8]) -> Result<Endpoint, UcxError> {
        let id = self.shared.next_id();
        let (done, rx) = oneshot::channel();
        self.shared.command(Command::Connect {
            id,
            address: address.to_vec(),
            done,
        })?;
        rx.await.map_err(|_| UcxError::WorkerStopped)??;
        Ok(Endpoint {
            inner: Arc::new(EndpointInner {
                id,
                worker: self.clone(),
            }),
        })
    }

    /// Receives one message whose tag matches `tag` on the bits set in `tag_mask`, into a
    /// registered slot (waits for a free one). With `from`, the receive fails with
    /// [`UcxError::PeerLost`] if that endpoint's peer goes away. Dropping the future
    /// cancels the receive.
    pub async fn recv(
        &self,
        tag: u64,
        tag_mask: u64,
        from: Option<&Endpoint>,
    ) -> Result<Received, UcxError> {
        let permit = Arc::clone(&self.shared.recv_slots)
            .acquire_owned()
            .await
            .map_err(|_| UcxError::WorkerStopped)?;
        let slot = self
            .shared
            .region
            .take_slot()
            .ok_or(UcxError::WorkerStopped)?;
        let (slot, sender_tag) = self
            .receive(|id, done| Command::Recv {
                id,
                tag,
                tag_mask,
                from: from.map(|e| e.inner.id),
                slot,
                done,
            })
            .await?;
        Ok(Received {
            sender_tag,
            slot,
            _permit: permit,
        })
    }

    /// Receives one message whose tag matches `tag` on the bits set in `tag_mask` into a
    /// buffer of its own length, once it has arrived (UCX's probe, then a receive of that
    /// message): no receive slot is held while waiting and nothing is copied out of one.
    /// A message longer than `max_bytes` is dropped and fails the receive with
    /// [`UcxError::MessageTooLarge`]. Returns the bytes and the sender's tag. With
    /// `from` and dropping the future, as [`Worker::recv`].
    pub async fn recv_owned(
        &self,
        tag: u64,
        tag_mask: u64,
        from: Option<&Endpoint>,
        max_bytes: usize,
    ) -> Result<(Bytes, u64), UcxError> {
        let (buf, sender_tag) = self
            .receive(|id, done| Command::RecvOwned {
                id,
                tag,
                tag_mask,
                from: from.map(|e| e.inner.id),
                max_bytes,
                done,
            })
            .await?;
        Ok((Bytes::from(buf), sender_tag))
    }

    /// Posts the receive that `command` makes of a fresh id and the channel for its outcome,
    /// and waits for that outcome; dropping the future cancels the receive.
    async fn receive<T>(
        &self,
        command: impl FnOnce(u64, oneshot::Sender<Result<T, UcxError>>) -> Command,
    ) -> Result<T, UcxError> {
        let id = self.shared.next_id();
        let (done, rx) = oneshot::channel();
        self.shared.command(command(id, done))?;
        let mut guard = CancelOnDrop {
            shared: &self.shared,
            id,
            armed: true,
        };
        let result = rx.await.map_err(|_| UcxError::WorkerStopped);
        guard.armed = false;
        result?
    }

    /// Stops the worker thread: cancels receives, closes endpoints, releases the
    /// registration and destroys the worker; returns when that is done. Pending and
    /// later operations of any handle fail with [`UcxError::WorkerStopped`] or
    /// [`UcxError::Cancelled`].
    pub async fn shutdown(&self) {
        let (done, rx) = oneshot::channel();
        if self.shared.command(Command::Stop { done }).is_ok() {
            let _ = rx.await;
        }
    }
}

struct CancelOnDrop<'a> {
    shared: &'a Shared,
    id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.shared.command(Command::CancelRecv { id: self.id });
        }
    }
}

/// A received message: its sender's tag and its bytes, in a registered slot lent until
/// this is dropped.
pub struct Received {
    sender_tag: u64,
    slot: raw::RecvSlot,
    _permit: OwnedSemaphorePermit,
}

impl Received {
    /// The tag the sender used.
    pub fn sender_tag(&self) -> u64 {
        self.sender_tag
    }

    /// The message: header then payload, as sent.
    pub fn bytes(&self) -> &[u8] {
        self.slot.bytes()
    }
}

impl std::fmt::Debug for Received {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Received")
            .field("sender_tag", &self.sender_tag)
            .field("bytes", &self.bytes().len())
            .finish()
    }
}

struct EndpointInner {
    id: u64,
    worker: Worker,
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        let _ = self.worker.shared.command(Command::Close { id: self.id });
    }
}

/// A connection to a peer's worker. Cheap to clone; closed (after its sends are
/// flushed) when the last clone is dropped.
#[derive(Clone)]
pub struct Endpoint {
    inner: Arc<EndpointInner>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl Endpoint {
    /// This endpoint's id (as in [`UcxError::PeerLost`]).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Sends `header` then `payload` as one tagged message, without copying them; returns
    /// when UCX is done with the buffers (the message was delivered or handed to the
    /// network). Waits while [`UcxWorkerConfig::sends_in_flight_max`] sends are pending.
    pub async fn send(&self, tag: u64, header: Bytes, payload: Bytes) -> Result<(), UcxError> {
        self.send_parts(tag, vec![header, payload]).await
    }

    /// Sends `parts` back to back as one tagged message, without copying them (a frame
    /// header and its pages); otherwise as [`Endpoint::send`].
    pub async fn send_parts(&self, tag: u64, parts: Vec<Bytes>) -> Result<(), UcxError> {
        let shared = &self.inner.worker.shared;
        let _permit = Arc::clone(&shared.sends)
            .acquire_owned()
            .await
            .map_err(|_| UcxError::WorkerStopped)?;
        let (done, rx) = oneshot::channel();
        shared.command(Command::Send {
            id: shared.next_id(),
            endpoint: self.inner.id,
            tag,
            parts,
            done,
        })?;
        rx.await.map_err(|_| UcxError::WorkerStopped)?
    }
}
