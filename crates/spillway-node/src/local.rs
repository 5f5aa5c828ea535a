//! The local client socket: processes on this machine ("daemon mode" clients) reach the
//! node over a Unix socket, with their host tier in shared memory the node creates.
//!
//! Protocol: [`spillway_types::local`]. Per client:
//! 1. The client sends `Hello { version, page_bytes, host_bytes }`. The node checks it
//!    (version, page size, `host_bytes` a whole number of pages within
//!    [`LocalServerConfig::client_host_bytes_max`], fewer than
//!    [`LocalServerConfig::clients_max`] clients) and answers `Refused` with the reason,
//!    or creates a `memfd` of `host_bytes`, seals its size, maps it and sends `Welcome`
//!    with the fd attached (SCM_RIGHTS). The client maps it too: that is its host tier.
//! 2. `Spill { id, page, slot, bytes }`: the node copies the slot's bytes out of the
//!    mapping and hands them to the [`ClientPages`] backend; `Fetch`: the backend's bytes
//!    are copied into the slot; each is answered by `Done { id, result }` once the bytes
//!    moved. Up to [`LocalServerConfig::ops_in_flight_per_client_max`] ops of a client run
//!    at once, each its own task, so answers may come in any order. A fetch that finds no
//!    copy of its page (every holder gone, after the remote tier's failover and grace) is
//!    answered `PageLost`, which costs the client that page's buffer only; other failures
//!    are `Remote` (`local/pages.rs` sorts the tier's errors).
//! 3. `Discard { pages }` is done before the client's next frame is read: an op sent
//!    after a discard never races it.
//! 4. When the client goes (or breaks the protocol), its ops in flight finish, the pages it
//!    spilled and did not discard are discarded from the backend, and its mapping goes
//!    with the last op that used it.
//!
//! Invariants:
//! - A malformed or oversized frame closes only its client's connection and is counted
//!   ([`LocalCounters::frames_rejected`]); nothing a client sends can panic the node. An
//!   op naming a slot outside its memory is answered with `BadRequest`.
//! - The memfd is sealed against shrinking before it is sent, so a client cannot make
//!   the node's mapping fault (SIGBUS) by truncating it.
//! - The socket file is created with mode 0600 (bound under a temporary name, chmod,
//!   then renamed into place, so no other user can connect in between) in a parent
//!   directory created 0700 when missing. A stale socket (nobody listening) is removed;
//!   a live one is an error.
//!
//! Limits and the memory they imply: clients at most [`LocalServerConfig::clients_max`]
//! (<= [`CLIENTS_MAX`]); each holds a shared mapping of at most `client_host_bytes_max`
//! (page cache of the memfd, charged as pages are touched), one frame body (at most
//! [`FRAME_BODY_BYTES_MAX`]) and at most `ops_in_flight_per_client_max` page copies (so
//! `64 x 2 MiB = 128 MiB` by default with 2 MiB pages). Handshakes in progress at most
//! [`HANDSHAKES_IN_FLIGHT_MAX`], each bounded by [`HELLO_TIMEOUT`].
//!
//! Tasks: one accept task; per client one task reading frames and one writing answers
//! (fed by a bounded channel of `ops_in_flight_per_client_max`), plus a task per op. The
//! node runs them on its own tracker and token ([`spawn_in`]); [`LocalServer`] runs them
//! on its own. Cancelling stops them all (ops in flight are abandoned, the clients'
//! pages discarded) and removes the socket file. The only `unsafe` is in the private
//! `shm` module.

use std::collections::{BTreeSet, HashSet};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use spillway_types::PageId;
use spillway_types::local::{
    self, CLIENTS_MAX, ClientMessage, Done, FRAME_BODY_BYTES_MAX, FrameHeader, HEADER_BYTES, Hello,
    LocalWireError, NodeMessage, OpError, OpErrorCode, PageOp, Refused, RefusedCode, Welcome,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

mod config;
mod pages;

pub use config::{
    HANDSHAKES_IN_FLIGHT_MAX, HELLO_TIMEOUT, LocalServerConfig, LocalServerError,
    OPS_IN_FLIGHT_PER_CLIENT_DEFAULT, OPS_IN_FLIGHT_PER_CLIENT_MAX,
};
pub use pages::{ClientPages, MemClientPages};

/// Pause after a failed accept (out of file descriptors), so the loop does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);
/// Largest client number: 4095 ([`crate::remote::CLIENT_ID_MAX`]: the remote tier keys
/// a client's pages on peers with 12 bits of client number); numbers are reused (the
/// lowest free one is given), and at most [`CLIENTS_MAX`] are in use, so they stay far
/// below.
pub use crate::remote::CLIENT_ID_MAX;
const _: () = assert!(CLIENTS_MAX as u32 <= CLIENT_ID_MAX);

/// Counters of the local socket server: what `/metrics` exports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalCounters {
    /// Clients welcomed and still connected (a gauge).
    pub clients_connected: u64,
    /// Clients welcomed since start.
    pub clients_accepted: u64,
    /// Hellos refused (any [`RefusedCode`]).
    pub clients_refused: u64,
    /// Connections closed for a malformed, oversized or unexpected frame, or a missing
    /// `Hello` within [`HELLO_TIMEOUT`].
    pub frames_rejected: u64,
    /// Spills answered successfully.
    pub spills: u64,
    /// Fetches answered successfully.
    pub fetches: u64,
    /// Ops answered with an error.
    pub ops_failed: u64,
    /// Pages discarded because their client went away.
    pub pages_discarded_on_disconnect: u64,
}

#[derive(Debug)]
struct Stats {
    /// Woken on every change, for [`LocalServer::wait_until`].
    changed: tokio::sync::Notify,
    /// Shared with the node's own gauge of local clients.
    clients_connected: Arc<AtomicU64>,
    clients_accepted: AtomicU64,
    clients_refused: AtomicU64,
    frames_rejected: AtomicU64,
    spills: AtomicU64,
    fetches: AtomicU64,
    ops_failed: AtomicU64,
    pages_discarded_on_disconnect: AtomicU64,
}

impl Stats {
    fn new(clients_connected: Arc<AtomicU64>) -> Stats {
        Stats {
            changed: tokio::sync::Notify::new(),
            clients_connected,
            clients_accepted: AtomicU64::new(0),
            clients_refused: AtomicU64::new(0),
            frames_rejected: AtomicU64::new(0),
            spills: AtomicU64::new(0),
            fetches: AtomicU64::new(0),
            ops_failed: AtomicU64::new(0),
            pages_discarded_on_disconnect: AtomicU64::new(0),
        }
    }

    fn add(&self, pick: impl Fn(&Stats) -> &AtomicU64, n: u64) {
        pick(self).fetch_add(n, Ordering::Relaxed);
        self.changed.notify_waiters();
    }

    fn bump(&self, pick: impl Fn(&Stats) -> &AtomicU64) {
        self.add(pick, 1);
    }

    fn snapshot(&self) -> LocalCounters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LocalCounters {
            clients_connected: get(&self.clients_connected),
            clients_accepted: get(&self.clients_accepted),
            clients_refused: get(&self.clients_refused),
            frames_rejected: get(&self.frames_rejected),
            spills: get(&self.spills),
            fetches: get(&self.fetches),
            ops_failed: get(&self.ops_failed),
            pages_discarded_on_disconnect: get(&self.pages_discarded_on_disconnect),
        }
    }
}

struct Shared<B> {
    config: LocalServerConfig,
    backend: Arc<B>,
    stats: Arc<Stats>,
    /// Numbers of the clients welcomed and not yet gone (their pages discarded): at
    /// most `clients_max`. A number is given again only once its client is gone.
    clients: Mutex<BTreeSet<u32>>,
    /// Wakes every connection task at shutdown.
    cancel: CancellationToken,
}

/// The counters of a running server, cheap to clone (from [`spawn_in`] or
/// [`LocalServer::monitor`]).
#[derive(Clone, Debug)]
pub struct LocalMonitor {
    stats: Arc<Stats>,
}

impl LocalMonitor {
    /// The counters now.
    pub fn counters(&self) -> LocalCounters {
        self.stats.snapshot()
    }

    /// Waits until `condition` holds for the counters (checked at once and after every
    /// change). Callers bound the wait with a timeout of their own.
    pub async fn wait_until(&self, condition: impl Fn(&LocalCounters) -> bool) -> LocalCounters {
        loop {
            let changed = self.stats.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let now = self.stats.snapshot();
            if condition(&now) {
                return now;
            }
            changed.await;
        }
    }
}

/// Validates `config`, creates the socket (see the module docs) and serves clients with
/// `backend` on tasks spawned in `tasks`, until `cancel` fires; the socket file is
/// removed then. `clients_gauge` is kept equal to the number of clients connected. This
/// is how the node runs the server among its own tasks; [`LocalServer::start`] runs it
/// on its own. Must be called inside a tokio runtime.
pub fn spawn_in<B: ClientPages>(
    config: LocalServerConfig,
    backend: Arc<B>,
    clients_gauge: Arc<AtomicU64>,
    tasks: &TaskTracker,
    cancel: &CancellationToken,
) -> Result<LocalMonitor, LocalServerError> {
    spawn_gated_in(
        config,
        backend,
        clients_gauge,
        tasks,
        cancel,
        Box::pin(std::future::ready(())),
    )
}

/// [`spawn_in`], with clients taken only once `ready` resolves: the socket is bound at
/// once (a client's connect succeeds and its hello waits, within its handshake timeout),
/// so a node can finish what must precede its first client (releasing an earlier
/// incarnation's client pages, whose ids new clients would reuse).
pub fn spawn_gated_in<B: ClientPages>(
    config: LocalServerConfig,
    backend: Arc<B>,
    clients_gauge: Arc<AtomicU64>,
    tasks: &TaskTracker,
    cancel: &CancellationToken,
    ready: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
) -> Result<LocalMonitor, LocalServerError> {
    config.validate()?;
    let (listener, identity) = bind_socket(&config.socket_path)?;
    let stats = Arc::new(Stats::new(clients_gauge));
    tracing::info!(socket = %config.socket_path.display(), "serving local clients");
    let shared = Arc::new(Shared {
        config,
        backend,
        stats: stats.clone(),
        clients: Mutex::default(),
        cancel: cancel.clone(),
    });
    tasks.spawn(accept_loop(
        listener,
        identity,
        shared,
        tasks.clone(),
        ready,
    ));
    Ok(LocalMonitor { stats })
}

/// A local socket server on tasks of its own (from [`LocalServer::start`]). Dropping it
/// cancels its tasks without waiting; [`LocalServer::shutdown`] waits.
#[derive(Debug)]
pub struct LocalServer {
    socket_path: PathBuf,
    monitor: LocalMonitor,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl LocalServer {
    /// [`spawn_in`] on a tracker and token of the server's own, with a gauge of its own.
    pub fn start<B: ClientPages>(
        config: LocalServerConfig,
        backend: Arc<B>,
    ) -> Result<LocalServer, LocalServerError> {
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        let socket_path = config.socket_path.clone();
        let monitor = spawn_in(config, backend, Arc::default(), &tasks, &cancel)?;
        Ok(LocalServer {
            socket_path,
            monitor,
            cancel,
            tasks,
        })
    }

    /// The socket's path.
    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// The counters, as a handle that outlives the server.
    pub fn monitor(&self) -> LocalMonitor {
        self.monitor.clone()
    }

    /// The counters now.
    pub fn counters(&self) -> LocalCounters {
        self.monitor.counters()
    }

    /// See [`LocalMonitor::wait_until`].
    pub async fn wait_until(&self, condition: impl Fn(&LocalCounters) -> bool) -> LocalCounters {
        self.monitor.wait_until(condition).await
    }

    /// Stops accepting, closes every client's connection (ops in flight are abandoned and
    /// the clients' pages discarded), waits for every task, and removes the socket file.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Creates the socket at `path`: parent dir (0700 if created), stale socket removed,
/// bound under a temporary name, chmod 0600, renamed into place. Returns the listener
/// and the socket file's identity.
fn bind_socket(path: &Path) -> Result<(UnixListener, SocketFile), LocalServerError> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(parent)
        .map_err(|source| LocalServerError::SocketDir {
            path: parent.to_path_buf(),
            source,
        })?;
    let bind_err = |step: &'static str, p: &Path| {
        let path = p.to_path_buf();
        move |source| LocalServerError::Bind { step, path, source }
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(LocalServerError::InUse {
                    path: path.to_path_buf(),
                });
            }
            tracing::info!(socket = %path.display(), "removing a stale client socket");
            std::fs::remove_file(path).map_err(bind_err("remove the stale", path))?;
        }
        Ok(_) => {
            return Err(LocalServerError::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Err(_) => {}
    }
    let mut temp = path.as_os_str().to_owned();
    temp.push(format!(".{}.tmp", std::process::id()));
    let temp = PathBuf::from(temp);
    let _ = std::fs::remove_file(&temp);
    let listener = UnixListener::bind(&temp).map_err(bind_err("bind", &temp))?;
    let placed = std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o600))
        .map_err(bind_err("chmod", &temp))
        .and_then(|()| std::fs::rename(&temp, path).map_err(bind_err("rename into place", path)));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&temp);
        return Err(e);
    }
    let identity = SocketFile::of(path).map_err(bind_err("stat", path))?;
    Ok((listener, identity))
}

/// The socket file as bound: removed when the server stops, unless another node has
/// replaced it in the meantime.
struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    fn of(path: &Path) -> io::Result<SocketFile> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(path)?;
        Ok(SocketFile {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    fn remove(&self) {
        let ours =
            SocketFile::of(&self.path).is_ok_and(|now| (now.dev, now.ino) == (self.dev, self.ino));
        if !ours {
            return;
        }
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(socket = %self.path.display(), error = %e, "cannot remove the client socket");
        }
    }
}

async fn accept_loop<B: ClientPages>(
    listener: UnixListener,
    socket: SocketFile,
    shared: Arc<Shared<B>>,
    tasks: TaskTracker,
    ready: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
) {
    let open = tokio::select! {
        _ = shared.cancel.cancelled() => false,
        _ = ready => true,
    };
    if open {
        accept_until_cancelled(listener, &shared, &tasks).await;
    }
    socket.remove();
}

async fn accept_until_cancelled<B: ClientPages>(
    listener: UnixListener,
    shared: &Arc<Shared<B>>,
    tasks: &TaskTracker,
) {
    let handshakes = Arc::new(Semaphore::new(HANDSHAKES_IN_FLIGHT_MAX));
    loop {
        let permit = tokio::select! {
            _ = shared.cancel.cancelled() => return,
            p = handshakes.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            _ = shared.cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, _)) => {
                tasks.spawn(serve_connection(stream, shared.clone(), permit));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a local client failed");
                tokio::select! {
                    _ = shared.cancel.cancelled() => return,
                    _ = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => {}
                }
            }
        }
    }
}

/// Why reading a frame stopped.
#[derive(Debug)]
enum ReadError {
    /// The peer closed the connection between frames.
    Closed,
    /// The socket failed (or closed inside a frame).
    Io(io::Error),
    /// The frame is malformed.
    Wire(LocalWireError),
}

/// Reads one frame: the header is checked before the body is read.
async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R) -> Result<ClientMessage, ReadError> {
    let mut header = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match reader.read(&mut header[got..]).await {
            Ok(0) if got == 0 => return Err(ReadError::Closed),
            Ok(0) => return Err(ReadError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    let header = FrameHeader::decode(&header).map_err(ReadError::Wire)?;
    header.check_version().map_err(ReadError::Wire)?;
    debug_assert!(header.body_bytes <= FRAME_BODY_BYTES_MAX);
    let mut body = vec![0u8; header.body_bytes as usize];
    reader.read_exact(&mut body).await.map_err(ReadError::Io)?;
    local::decode_body(&body).map_err(ReadError::Wire)
}

async fn write_message(writer: &mut OwnedWriteHalf, message: &NodeMessage) -> io::Result<()> {
    let frame = local::encode_frame(message).map_err(io::Error::other)?;
    writer.write_all(&frame).await
}

/// A welcomed client's number, counted while it lives.
struct ClientSlot<'a> {
    client: u32,
    clients: &'a Mutex<BTreeSet<u32>>,
    stats: &'a Stats,
    /// The client's host tier's share of the node's host budget, given back with the slot.
    host: Option<(&'a crate::memory::HostBudget, u64)>,
}

impl Drop for ClientSlot<'_> {
    fn drop(&mut self) {
        self.clients
            .lock()
            .expect("client numbers lock")
            .remove(&self.client);
        // Given back before the count drops, so whoever saw the client go sees its
        // memory free.
        if let Some((budget, bytes)) = self.host {
            budget.give_back(bytes);
        }
        self.stats.clients_connected.fetch_sub(1, Ordering::Relaxed);
        self.stats.changed.notify_waiters();
    }
}

async fn serve_connection<B: ClientPages>(
    mut stream: UnixStream,
    shared: Arc<Shared<B>>,
    handshake_permit: tokio::sync::OwnedSemaphorePermit,
) {
    let stats = &shared.stats;
    let hello = tokio::select! {
        _ = shared.cancel.cancelled() => return,
        r = tokio::time::timeout(HELLO_TIMEOUT, read_frame(&mut stream)) => r,
    };
    let hello = match hello {
        Err(_) => {
            tracing::warn!("a local client sent no hello within {HELLO_TIMEOUT:?}");
            stats.bump(|s| &s.frames_rejected);
            return;
        }
        Ok(Ok(ClientMessage::Hello(h))) => h,
        Ok(Err(ReadError::Wire(LocalWireError::UnsupportedVersion { found, supported }))) => {
            let refused = Refused::new(
                RefusedCode::VersionMismatch,
                format!("the client speaks local protocol version {found}, this node {supported}"),
            );
            refuse(&mut stream, &shared, refused).await;
            return;
        }
        Ok(Ok(other)) => {
            tracing::warn!(?other, "a local client's first frame is not a hello");
            stats.bump(|s| &s.frames_rejected);
            return;
        }
        Ok(Err(ReadError::Wire(e))) => {
            tracing::warn!(error = %e, "malformed hello from a local client");
            stats.bump(|s| &s.frames_rejected);
            return;
        }
        Ok(Err(ReadError::Closed | ReadError::Io(_))) => return,
    };
    let Some((client, region, slot)) = welcome(&mut stream, &shared, hello).await else {
        return;
    };
    drop(handshake_permit);
    tracing::info!(
        client,
        host_bytes = hello.host_bytes,
        "local client connected"
    );
    serve_ops(stream, &shared, client, Arc::new(region)).await;
    drop(slot);
    tracing::info!(client, "local client gone");
}

async fn refuse<B>(stream: &mut UnixStream, shared: &Shared<B>, refused: Refused) {
    tracing::info!(code = ?refused.code, reason = %refused.message, "refusing a local client");
    shared.stats.bump(|s| &s.clients_refused);
    if let Ok(frame) = local::encode_frame(&NodeMessage::Refused(refused)) {
        // The client may be gone already; nothing more to tell it.
        let _ = stream.write_all(&frame).await;
        let _ = stream.shutdown().await;
    }
}

/// Checks the hello, reserves a client slot, creates and sends the shared memory.
async fn welcome<'a, B: ClientPages>(
    stream: &mut UnixStream,
    shared: &'a Shared<B>,
    hello: Hello,
) -> Option<(u32, shm::SharedRegion, ClientSlot<'a>)> {
    let config = &shared.config;
    let page = config.page_size.bytes();
    let refusal = if hello.version != local::PROTOCOL_VERSION {
        Some(Refused::new(
            RefusedCode::VersionMismatch,
            format!(
                "the client speaks local protocol version {}, this node {}",
                hello.version,
                local::PROTOCOL_VERSION
            ),
        ))
    } else if hello.page_bytes != page {
        Some(Refused::new(
            RefusedCode::PageSizeMismatch,
            format!(
                "the client's pages are {} bytes, this node's {page}",
                hello.page_bytes
            ),
        ))
    } else if hello.host_bytes == 0 || !hello.host_bytes.is_multiple_of(page) {
        Some(Refused::new(
            RefusedCode::BadHostBytes,
            format!(
                "host_bytes {} is not a positive multiple of the page size {page}",
                hello.host_bytes
            ),
        ))
    } else if hello.host_bytes > config.client_host_bytes_max {
        Some(Refused::new(
            RefusedCode::HostBytesTooLarge,
            format!(
                "host_bytes {} exceeds this node's limit per client of {}",
                hello.host_bytes, config.client_host_bytes_max
            ),
        ))
    } else {
        None
    };
    if let Some(r) = refusal {
        refuse(stream, shared, r).await;
        return None;
    }
    let client = {
        let mut clients = shared.clients.lock().expect("client numbers lock");
        // The lowest number not in use: the first gap in the sorted set.
        let free = (1..=CLIENT_ID_MAX)
            .zip(clients.iter().copied().chain(std::iter::once(u32::MAX)))
            .find(|(want, used)| want != used)
            .map(|(want, _)| want);
        match free {
            Some(n) if clients.len() < config.clients_max => {
                clients.insert(n);
                Some(n)
            }
            _ => None,
        }
    };
    let Some(client) = client else {
        let r = Refused::new(
            RefusedCode::TooManyClients,
            format!("this node serves {} clients, its limit", config.clients_max),
        );
        refuse(stream, shared, r).await;
        return None;
    };
    shared.stats.bump(|s| &*s.clients_connected);
    let mut slot = ClientSlot {
        client,
        clients: &shared.clients,
        stats: &shared.stats,
        host: None,
    };
    // The client's host tier is memory this node maps: it is admitted only while the
    // room the node's cgroup leaves the clients (crate::memory) holds it.
    if let Some(budget) = &config.host_budget {
        if let Err(used) = budget.try_take(hello.host_bytes) {
            let r = Refused::new(
                RefusedCode::HostBytesTooLarge,
                format!(
                    "host_bytes {} do not fit the memory this node may map for its clients: \
                     {} of {} bytes are taken by other clients' host tiers (its cgroup's \
                     limit less the node's own plan); ask for less, lower the node's \
                     host_budget, or raise the cgroup's memory limit",
                    hello.host_bytes,
                    used,
                    budget.budget_bytes()
                ),
            );
            drop(slot);
            refuse(stream, shared, r).await;
            return None;
        }
        slot.host = Some((&**budget, hello.host_bytes));
    }
    let (fd, region) = match shm::SharedRegion::create(client, hello.host_bytes) {
        Ok(made) => made,
        Err(e) => {
            let r = Refused::new(
                RefusedCode::Unavailable,
                format!(
                    "cannot create {} bytes of shared memory: {e}",
                    hello.host_bytes
                ),
            );
            refuse(stream, shared, r).await;
            return None;
        }
    };
    let message = NodeMessage::Welcome(Welcome {
        client,
        host_bytes: hello.host_bytes,
        remote_capacity_bytes: shared.backend.capacity_bytes(),
        bandwidth_hint_bytes_per_s: shared.backend.bandwidth_hint_bytes_per_s(),
    });
    let frame = local::encode_frame(&message).ok()?;
    // Counted before the client can see the welcome, so a client that saw it sees the count.
    shared.stats.bump(|s| &s.clients_accepted);
    if let Err(e) = send_with_fd(stream, &frame, &fd).await {
        tracing::warn!(client, error = %e, "cannot send the welcome to a local client");
        return None;
    }
    Some((client, region, slot))
}

/// Sends `frame` with `fd` attached to its first bytes.
async fn send_with_fd(
    stream: &mut UnixStream,
    frame: &[u8],
    fd: &std::os::fd::OwnedFd,
) -> io::Result<()> {
    let sent = stream
        .async_io(tokio::io::Interest::WRITABLE, || {
            shm::send_with_fd(stream.as_fd(), frame, fd.as_fd())
        })
        .await?;
    // The fd went with the first byte; the rest (in practice nothing) follows plainly.
    stream.write_all(&frame[sent..]).await
}

/// Serves one welcomed client until it goes, breaks the protocol, or the server stops.
async fn serve_ops<B: ClientPages>(
    stream: UnixStream,
    shared: &Shared<B>,
    client: u32,
    region: Arc<shm::SharedRegion>,
) {
    let stats = &shared.stats;
    let ops_max = shared.config.ops_in_flight_per_client_max;
    let (mut reader, mut writer) = stream.into_split();
    let (done_tx, mut done_rx) = mpsc::channel::<Done>(ops_max);
    let writer_task = tokio::spawn(async move {
        while let Some(done) = done_rx.recv().await {
            if let Err(e) = write_message(&mut writer, &NodeMessage::Done(done)).await {
                tracing::debug!(client, error = %e, "cannot answer a local client");
                return;
            }
        }
    });
    // Pages spilled and not discarded: discarded from the backend when the client goes.
    let held: Arc<Mutex<HashSet<PageId>>> = Arc::default();
    let mut ops = JoinSet::new();
    let cancelled = loop {
        while ops.try_join_next().is_some() {}
        if ops.len() >= ops_max {
            tokio::select! {
                _ = shared.cancel.cancelled() => break true,
                _ = ops.join_next() => continue,
            }
        }
        let frame = tokio::select! {
            _ = shared.cancel.cancelled() => break true,
            f = read_frame(&mut reader) => f,
        };
        match frame {
            Ok(ClientMessage::Spill(op)) => {
                let ctx = OpContext::new(shared, client, &region, &done_tx, &held);
                ops.spawn(ctx.spill(op));
            }
            Ok(ClientMessage::Fetch(op)) => {
                let ctx = OpContext::new(shared, client, &region, &done_tx, &held);
                ops.spawn(ctx.fetch(op));
            }
            Ok(ClientMessage::Discard(d)) => {
                {
                    let mut held = held.lock().expect("held pages lock");
                    for p in &d.pages {
                        held.remove(p);
                    }
                }
                if let Err(e) = shared.backend.discard(client, d.pages).await {
                    tracing::warn!(client, error = %e, "discarding a local client's pages failed");
                }
            }
            Ok(ClientMessage::Hello(_)) => {
                tracing::warn!(client, "a local client sent a second hello");
                stats.bump(|s| &s.frames_rejected);
                break false;
            }
            Err(ReadError::Wire(e)) => {
                tracing::warn!(client, error = %e, "malformed frame from a local client");
                stats.bump(|s| &s.frames_rejected);
                break false;
            }
            Err(ReadError::Closed) => break false,
            Err(ReadError::Io(e)) => {
                tracing::debug!(client, error = %e, "a local client's socket failed");
                break false;
            }
        }
    };
    if cancelled {
        ops.shutdown().await;
    } else {
        while ops.join_next().await.is_some() {}
    }
    drop(done_tx);
    if cancelled {
        writer_task.abort();
    }
    let _ = writer_task.await;
    let pages: Vec<PageId> = held.lock().expect("held pages lock").drain().collect();
    if !pages.is_empty() {
        let n = pages.len() as u64;
        match shared.backend.discard(client, pages).await {
            Ok(()) => {
                stats.add(|s| &s.pages_discarded_on_disconnect, n);
            }
            Err(e) => {
                tracing::warn!(client, error = %e, "discarding a gone client's pages failed")
            }
        }
    }
}

/// What one op task needs.
struct OpContext<B> {
    backend: Arc<B>,
    stats: Arc<Stats>,
    client: u32,
    page_bytes: u64,
    region: Arc<shm::SharedRegion>,
    done: mpsc::Sender<Done>,
    held: Arc<Mutex<HashSet<PageId>>>,
}

impl<B: ClientPages> OpContext<B> {
    fn new(
        shared: &Shared<B>,
        client: u32,
        region: &Arc<shm::SharedRegion>,
        done: &mpsc::Sender<Done>,
        held: &Arc<Mutex<HashSet<PageId>>>,
    ) -> Self {
        OpContext {
            backend: shared.backend.clone(),
            stats: shared.stats.clone(),
            client,
            page_bytes: shared.config.page_size.bytes(),
            region: region.clone(),
            done: done.clone(),
            held: held.clone(),
        }
    }

    /// The op's byte offset in the region, if its slot and length fit.
    fn offset(&self, op: &PageOp) -> Result<u64, OpError> {
        let offset = u64::from(op.slot) * self.page_bytes;
        let fits =
            op.bytes > 0 && op.bytes <= self.page_bytes && offset + op.bytes <= self.region.len();
        if fits {
            Ok(offset)
        } else {
            Err(OpError::new(
                OpErrorCode::BadRequest,
                format!(
                    "slot {} with {} bytes is outside {} bytes of host memory in pages of {}",
                    op.slot,
                    op.bytes,
                    self.region.len(),
                    self.page_bytes
                ),
            ))
        }
    }

    async fn spill(self, op: PageOp) {
        let result = match self.offset(&op) {
            Ok(offset) => {
                let mut data = vec![0u8; op.bytes as usize];
                self.region.read(offset, &mut data);
                match self
                    .backend
                    .spill(self.client, vec![(op.page, Bytes::from(data))])
                    .await
                {
                    Ok(()) => {
                        self.held.lock().expect("held pages lock").insert(op.page);
                        self.stats.bump(|s| &s.spills);
                        Ok(())
                    }
                    Err(e) => Err(OpError::new(OpErrorCode::Remote, e.to_string())),
                }
            }
            Err(e) => Err(e),
        };
        self.finish(op.id, result).await;
    }

    async fn fetch(self, op: PageOp) {
        let result = match self.offset(&op) {
            Ok(offset) => match self.backend.fetch(self.client, vec![op.page]).await {
                Ok(pages) => match pages.as_slice() {
                    [data] if data.len() as u64 == op.bytes => {
                        self.region.write(offset, data);
                        self.stats.bump(|s| &s.fetches);
                        Ok(())
                    }
                    [data] => Err(OpError::new(
                        OpErrorCode::Remote,
                        format!(
                            "page {} has {} bytes in the remote tier, {} asked",
                            op.page,
                            data.len(),
                            op.bytes
                        ),
                    )),
                    other => Err(OpError::new(
                        OpErrorCode::Remote,
                        format!("the remote tier returned {} pages for one", other.len()),
                    )),
                },
                Err(e) => Err(OpError::new(pages::fetch_error_code(&e), e.to_string())),
            },
            Err(e) => Err(e),
        };
        self.finish(op.id, result).await;
    }

    async fn finish(self, id: u64, result: Result<(), OpError>) {
        if result.is_err() {
            self.stats.bump(|s| &s.ops_failed);
        }
        // The writer is gone only when the client is: nobody to tell.
        let _ = self.done.send(Done { id, result }).await;
    }
}

mod shm;
