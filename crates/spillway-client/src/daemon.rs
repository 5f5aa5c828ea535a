//! Daemon mode: the pool's host tier lives in memory shared with the node daemon of this
//! machine, and its remote tier is the node's, reached over the node's Unix socket.
//!
//! [`DaemonLink::connect`] says hello on the socket ([`spillway_types::local`]) and gets
//! back the node's `Welcome` with a `memfd` (SCM_RIGHTS), which it maps: that mapping is
//! the pool's host slots ([`DaemonLink::host_memory`]). [`DaemonLink::remote_factory`]
//! makes the pool's [`RemoteTier`]: each [`RemoteOp`] goes to the node as a frame naming
//! the slot, and the node reads or writes the page's bytes in the shared memory itself,
//! so no page crosses the socket. [`DaemonLink::pool_builder`] wires both into a
//! [`PoolBuilder`].
//!
//! ```no_run
//! use spillway_client::daemon::DaemonLink;
//! use spillway_client::PageSize;
//! let link = DaemonLink::connect("/run/spillway/client.sock".as_ref(), 1 << 30, PageSize::default())?;
//! let pool = link.pool_builder().gpu_budget_bytes(256 << 20).build()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Threads of the remote tier: a reader thread takes the node's `Done` frames, and a
//! completion thread calls the pool's sink, so the sink never runs inside
//! [`RemoteTier::submit`] (which the pool calls under its lock). Frames are written under
//! one mutex, by whichever thread submits. Every op is in the in-flight set from before
//! its frame is written until its completion; whoever takes it out of the set completes
//! it, so each op completes exactly once. When the socket dies (the node exits, a write
//! fails, a frame is malformed), the first cause ([`LinkDown`]) is kept, every op in
//! flight completes with it as [`RemoteError::TierGone`], and every later op fails with
//! it at once: the pool then fails every acquire with `CoreError::RemoteTierGone` at
//! once (no backoff, no hang). The pages the node held for this client went with the
//! node (a node that starts again removes its earlier clients' pages), so there is no
//! resuming a pool: once the node is back, [`DaemonLink::connect`] again and build a new
//! pool. A fetch the node answers `PageLost` (every holder of the page is gone) is
//! [`RemoteError::Lost`]: the pool loses that page's buffer only.
//!
//! Lock order: the tier's state, then nothing; the writer, then nothing. Neither is held
//! while the sink runs. The only `unsafe` is in the private `shm` module.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use spillway_device::HostMemory;
use spillway_types::local::{
    self, ClientMessage, DISCARD_PAGES_MAX, Discard, FrameHeader, HEADER_BYTES, Hello,
    LocalWireError, NodeMessage, OpError, OpErrorCode, PageOp, RefusedCode, Welcome,
};
use spillway_types::{PageId, PageSize};

use crate::PoolBuilder;
use crate::remote::{
    RemoteCompletion, RemoteError, RemoteFactory, RemoteOp, RemoteOpKind, RemoteSetupError,
    RemoteSink, RemoteTier,
};

/// How long the node has to answer the `Hello`: 10 s (it creates the shared memory
/// first, which is quick; a node that takes longer is stuck).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a client could not link to its node.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Nobody listens on the socket.
    #[error(
        "no Spillway node is listening on {} ({source}); start one with \
         `spillway node --config <node.toml>` or `spillway cluster up`",
        socket.display()
    )]
    NoNode {
        /// The socket path.
        socket: PathBuf,
        /// What connecting said (not found, refused).
        #[source]
        source: io::Error,
    },
    /// The socket is there but could not be reached (permissions: it is 0600, for the
    /// node's user).
    #[error("cannot connect to the node's socket {}: {source}", socket.display())]
    Connect {
        /// The socket path.
        socket: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The node refused the client.
    #[error("the node refused this client ({code:?}): {message}")]
    Refused {
        /// Why, for programs.
        code: RefusedCode,
        /// Why, in the node's words.
        message: String,
    },
    /// The node speaks another version of the local protocol.
    #[error(
        "the node speaks local protocol version {node}, this client {client}; use matching builds"
    )]
    VersionMismatch {
        /// The node's version.
        node: u16,
        /// Ours.
        client: u16,
    },
    /// The node's answer breaks the protocol.
    #[error("the node's answer to hello is invalid: {reason}")]
    Protocol {
        /// What is wrong with it.
        reason: String,
    },
    /// The socket failed during the handshake.
    #[error("the connection to the node failed during the handshake: {source}")]
    Io {
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The shared memory could not be mapped.
    #[error("cannot map {bytes} bytes of host memory shared by the node: {source}")]
    Map {
        /// Its size.
        bytes: u64,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Why the link to the node died: the cause every op in flight, and every later one,
/// fails with (as [`RemoteError::TierGone`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkDown {
    /// The node closed the connection (it exited, or was killed).
    #[error("{node} closed the connection")]
    Closed {
        /// The node, as the tier describes it (its socket, our client number).
        node: String,
    },
    /// Reading from or writing to the socket failed.
    #[error("the connection to {node} failed: {reason}")]
    Io {
        /// The node.
        node: String,
        /// What the socket said.
        reason: String,
    },
    /// The node sent a frame that breaks the local protocol (a bad header or body, a
    /// message a client never gets after the handshake, the answer to an op not in
    /// flight).
    #[error("{node} broke the local protocol: {problem}")]
    Protocol {
        /// The node.
        node: String,
        /// What was wrong.
        problem: FrameProblem,
    },
    /// A frame for the node could not be encoded (a bug: every frame we send is bounded).
    #[error("cannot encode a frame for the node: {0}")]
    Encode(LocalWireError),
    /// The pool closed the link (its normal end).
    #[error("{node} was closed by the pool")]
    ClosedByPool {
        /// The node.
        node: String,
    },
}

/// What was wrong with a frame from the node ([`LinkDown::Protocol`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameProblem {
    /// The connection ended inside a frame.
    #[error("the connection ended inside a frame")]
    Truncated,
    /// The header or body did not decode.
    #[error(transparent)]
    Wire(#[from] LocalWireError),
    /// A message other than `Done` after the handshake.
    #[error("an unexpected {0} after the handshake")]
    Unexpected(&'static str),
    /// The answer to an op that is not in flight.
    #[error("the answer to op {0}, which is not in flight")]
    UnknownOp(u64),
}

/// Why reading one frame failed (the private `read_frame`).
#[derive(Debug)]
enum ReadError {
    Io(io::Error),
    Frame(FrameProblem),
}

/// The core's error for an op the node answered with `error`: `PageLost` is
/// [`RemoteError::Lost`] (the pool loses that page's buffer only), `Unavailable` (the
/// node is going away) is [`RemoteError::TierGone`], the rest the node's words.
fn op_error(page: PageId, error: OpError) -> RemoteError {
    match error.code {
        OpErrorCode::PageLost => RemoteError::Lost {
            page,
            message: error.message,
        },
        OpErrorCode::Unavailable => RemoteError::TierGone {
            message: error.message,
        },
        OpErrorCode::BadRequest | OpErrorCode::Remote => RemoteError::tier(error),
    }
}

/// A client's link to its node: the shared host memory and the socket. See the module
/// docs.
pub struct DaemonLink {
    socket: PathBuf,
    page_size: PageSize,
    welcome: Welcome,
    region: Arc<shm::Mapping>,
    /// Taken by the first [`DaemonLink::remote_factory`].
    stream: Mutex<Option<UnixStream>>,
}

impl std::fmt::Debug for DaemonLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonLink")
            .field("socket", &self.socket)
            .field("welcome", &self.welcome)
            .finish_non_exhaustive()
    }
}

impl DaemonLink {
    /// Connects to the node at `socket`, asks for `host_bytes` of host tier (a whole
    /// number of pages of `page_size`, the node's page size), and maps the shared memory
    /// the node answers with. Blocks for at most [`HANDSHAKE_TIMEOUT`] once connected.
    pub fn connect(
        socket: &Path,
        host_bytes: u64,
        page_size: PageSize,
    ) -> Result<DaemonLink, DaemonError> {
        let mut stream = UnixStream::connect(socket).map_err(|source| {
            let socket = socket.to_path_buf();
            match source.kind() {
                io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
                    DaemonError::NoNode { socket, source }
                }
                _ => DaemonError::Connect { socket, source },
            }
        })?;
        let io_err = |source| DaemonError::Io { source };
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(io_err)?;
        let hello = ClientMessage::Hello(Hello {
            version: local::PROTOCOL_VERSION,
            page_bytes: page_size.bytes(),
            host_bytes,
        });
        let frame = local::encode_frame(&hello).map_err(|e| DaemonError::Protocol {
            reason: e.to_string(),
        })?;
        // A node that refuses at once may close before the hello is read; its answer is
        // still waiting to be read, so a failed write is reported only if there is none.
        let written = stream.write_all(&frame);
        let (message, fds) = match read_answer(&mut stream) {
            Ok(answer) => answer,
            Err(e) => {
                return Err(match written {
                    Err(source) => DaemonError::Io { source },
                    Ok(()) => e,
                });
            }
        };
        let welcome = match message {
            NodeMessage::Welcome(w) => w,
            NodeMessage::Refused(r) => {
                return Err(DaemonError::Refused {
                    code: r.code,
                    message: r.message,
                });
            }
            NodeMessage::Done(d) => {
                return Err(DaemonError::Protocol {
                    reason: format!("a done for op {} before any op", d.id),
                });
            }
        };
        if welcome.host_bytes != host_bytes {
            return Err(DaemonError::Protocol {
                reason: format!(
                    "the welcome is for {} bytes of host memory, {host_bytes} were asked",
                    welcome.host_bytes
                ),
            });
        }
        let mut fds = fds.into_iter();
        let (Some(fd), None) = (fds.next(), fds.next()) else {
            return Err(DaemonError::Protocol {
                reason: "the welcome must carry exactly one file descriptor".into(),
            });
        };
        let region = shm::Mapping::map(fd, host_bytes).map_err(|source| DaemonError::Map {
            bytes: host_bytes,
            source,
        })?;
        stream.set_read_timeout(None).map_err(io_err)?;
        tracing::info!(
            socket = %socket.display(),
            client = welcome.client,
            host_bytes,
            remote_capacity_bytes = welcome.remote_capacity_bytes,
            "linked to the node"
        );
        Ok(DaemonLink {
            socket: socket.to_path_buf(),
            page_size,
            welcome,
            region: Arc::new(region),
            stream: Mutex::new(Some(stream)),
        })
    }

    /// This client's number on the node.
    pub fn client_id(&self) -> u32 {
        self.welcome.client
    }

    /// Bytes of the shared host memory.
    pub fn host_bytes(&self) -> u64 {
        self.welcome.host_bytes
    }

    /// Bytes of pages the node's remote tier had room for at the handshake.
    pub fn remote_capacity_bytes(&self) -> u64 {
        self.welcome.remote_capacity_bytes
    }

    /// The page size agreed with the node.
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The shared host memory, for the device's host slots (slot `i` at
    /// `i * page_bytes`). It stays mapped while any clone lives.
    pub fn host_memory(&self) -> HostMemory {
        self.region.host_memory()
    }

    /// The factory of the pool's remote tier over this link. The first factory takes
    /// the socket; a second one fails when called.
    pub fn remote_factory(&self) -> RemoteFactory {
        let stream = self.stream.lock().expect("daemon link lock").take();
        let socket = self.socket.clone();
        let welcome = self.welcome;
        Box::new(move |_device, sink| {
            let stream = stream.ok_or_else(|| RemoteSetupError::LinkTaken {
                socket: socket.clone(),
            })?;
            DaemonRemote::start(stream, socket, welcome, sink)
                .map(|tier| Arc::new(tier) as Arc<dyn RemoteTier>)
        })
    }

    /// A [`PoolBuilder`] with the host tier in the shared memory (its budget, page size
    /// and memory) and, when the node has room for at least two pages, the remote tier
    /// over this link with the node's capacity as its budget. Set the GPU budget (and
    /// anything else) and build.
    pub fn pool_builder(&self) -> PoolBuilder {
        let builder = PoolBuilder::new()
            .page_size(self.page_size)
            .host_budget_bytes(self.host_bytes())
            .host_memory(self.host_memory());
        if self.page_size.pages_in(self.remote_capacity_bytes()) >= 2 {
            builder
                .remote_budget_bytes(self.remote_capacity_bytes())
                .remote(self.remote_factory())
        } else {
            builder
        }
    }
}

/// Reads the node's answer to the hello and the fds that came with it.
fn read_answer(stream: &mut UnixStream) -> Result<(NodeMessage, Vec<OwnedFd>), DaemonError> {
    let mut header = [0u8; HEADER_BYTES];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < HEADER_BYTES {
        let n = shm::recv_with_fds(stream, &mut header[got..], &mut fds)
            .map_err(|source| DaemonError::Io { source })?;
        if n == 0 {
            return Err(DaemonError::Io {
                source: io::ErrorKind::UnexpectedEof.into(),
            });
        }
        got += n;
    }
    let protocol = |e: LocalWireError| DaemonError::Protocol {
        reason: e.to_string(),
    };
    let header = FrameHeader::decode(&header).map_err(protocol)?;
    if header.version != local::PROTOCOL_VERSION {
        return Err(DaemonError::VersionMismatch {
            node: header.version,
            client: local::PROTOCOL_VERSION,
        });
    }
    let mut body = vec![0u8; header.body_bytes as usize];
    stream
        .read_exact(&mut body)
        .map_err(|source| DaemonError::Io { source })?;
    Ok((local::decode_body(&body).map_err(protocol)?, fds))
}

/// The remote tier over a daemon link (see the module docs).
struct DaemonRemote {
    conn: Arc<Conn>,
}

struct Conn {
    describe: String,
    capacity_bytes: u64,
    bandwidth_hint_bytes_per_s: f64,
    /// Frames go out under this lock.
    writer: Mutex<UnixStream>,
    /// Another handle of the socket, to shut it down without waiting for the writer.
    closer: UnixStream,
    state: Mutex<ConnState>,
    /// To the completion thread.
    completions: mpsc::Sender<RemoteCompletion>,
}

#[derive(Default)]
struct ConnState {
    /// The ops sent and not completed: id to page.
    in_flight: HashMap<u64, PageId>,
    /// Why the connection is dead, once it is.
    dead: Option<LinkDown>,
}

impl DaemonRemote {
    fn start(
        stream: UnixStream,
        socket: PathBuf,
        welcome: Welcome,
        sink: RemoteSink,
    ) -> Result<DaemonRemote, RemoteSetupError> {
        let clone = || {
            stream
                .try_clone()
                .map_err(|source| RemoteSetupError::Socket { source })
        };
        let (reader, closer) = (clone()?, clone()?);
        let (tx, rx) = mpsc::channel::<RemoteCompletion>();
        let conn = Arc::new(Conn {
            describe: format!(
                "the node daemon at {} (client {})",
                socket.display(),
                welcome.client
            ),
            capacity_bytes: welcome.remote_capacity_bytes,
            bandwidth_hint_bytes_per_s: welcome.bandwidth_hint_bytes_per_s as f64,
            writer: Mutex::new(stream),
            closer,
            state: Mutex::new(ConnState::default()),
            completions: tx,
        });
        std::thread::Builder::new()
            .name("spillway-daemon-done".into())
            .spawn(move || {
                for c in rx {
                    sink(c);
                }
            })
            .map_err(|source| RemoteSetupError::Thread {
                role: "completion",
                source,
            })?;
        let reading = conn.clone();
        std::thread::Builder::new()
            .name("spillway-daemon-read".into())
            .spawn(move || {
                let cause = reading.read_loop(reader);
                reading.die(cause);
            })
            .map_err(|source| RemoteSetupError::Thread {
                role: "reader",
                source,
            })?;
        Ok(DaemonRemote { conn })
    }
}

impl Conn {
    /// Completes op `id` with `result`.
    fn complete(&self, id: u64, result: Result<(), RemoteError>) {
        let c = RemoteCompletion {
            id: spillway_types::TransferId(id),
            result,
        };
        // The completion thread lives while any sender does; ours is one.
        let _ = self.completions.send(c);
    }

    /// Reads `Done` frames until the socket fails; returns why it stopped.
    fn read_loop(&self, mut reader: UnixStream) -> LinkDown {
        let node = || self.describe.clone();
        let protocol = |problem| LinkDown::Protocol {
            node: node(),
            problem,
        };
        loop {
            let message = match read_frame(&mut reader) {
                Ok(Some(m)) => m,
                Ok(None) => return LinkDown::Closed { node: node() },
                Err(ReadError::Io(e)) => return self.io_down(e),
                Err(ReadError::Frame(problem)) => return protocol(problem),
            };
            let done = match message {
                NodeMessage::Done(d) => d,
                NodeMessage::Welcome(_) => return protocol(FrameProblem::Unexpected("Welcome")),
                NodeMessage::Refused(_) => return protocol(FrameProblem::Unexpected("Refused")),
            };
            let page = self
                .state
                .lock()
                .expect("tier state lock")
                .in_flight
                .remove(&done.id);
            let Some(page) = page else {
                return protocol(FrameProblem::UnknownOp(done.id));
            };
            self.complete(done.id, done.result.map_err(|e| op_error(page, e)));
        }
    }

    /// Marks the connection dead with `cause` (the first cause wins) and fails every op
    /// in flight with it.
    fn die(&self, cause: LinkDown) {
        self.die_as(cause, false);
    }

    /// [`Self::die`]; `by_us` when the pool itself closes the link (its normal end, not
    /// worth an error in the log).
    fn die_as(&self, cause: LinkDown, by_us: bool) {
        let (failed, cause): (Vec<u64>, LinkDown) = {
            let mut state = self.state.lock().expect("tier state lock");
            if state.dead.is_none() {
                if by_us {
                    tracing::debug!(cause = %cause, "the link to the node is closed");
                } else {
                    tracing::error!(cause = %cause, "the link to the node is down");
                }
                state.dead = Some(cause);
            }
            let first = state.dead.clone().expect("set above");
            (state.in_flight.drain().map(|(id, _)| id).collect(), first)
        };
        for id in failed {
            self.complete(id, Err(gone(&cause)));
        }
        // Wakes the reader (if it is not the caller) and a writer blocked on a full socket.
        let _ = self.closer.shutdown(Shutdown::Both);
    }

    /// Why the link is down after the socket said `e`: the node closed it (a reset, a
    /// broken pipe: it exited while we wrote), or some other failure.
    fn io_down(&self, e: io::Error) -> LinkDown {
        let node = self.describe.clone();
        match e.kind() {
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => LinkDown::Closed { node },
            _ => LinkDown::Io {
                node,
                reason: e.to_string(),
            },
        }
    }

    fn send(&self, message: &ClientMessage) {
        let frame = match local::encode_frame(message) {
            Ok(f) => f,
            Err(e) => return self.die(LinkDown::Encode(e)),
        };
        let written = self.writer.lock().expect("writer lock").write_all(&frame);
        if let Err(e) = written {
            self.die(self.io_down(e));
        }
    }
}

/// The error of an op that cannot reach the node for `cause`.
fn gone(cause: &LinkDown) -> RemoteError {
    RemoteError::TierGone {
        message: cause.to_string(),
    }
}

/// Reads one frame from the node; `None` at a clean end between frames.
fn read_frame(reader: &mut UnixStream) -> Result<Option<NodeMessage>, ReadError> {
    let mut header = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match reader.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(ReadError::Frame(FrameProblem::Truncated)),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    let wire = |e: LocalWireError| ReadError::Frame(e.into());
    let header = FrameHeader::decode(&header).map_err(wire)?;
    header.check_version().map_err(wire)?;
    let mut body = vec![0u8; header.body_bytes as usize];
    reader.read_exact(&mut body).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ReadError::Frame(FrameProblem::Truncated)
        } else {
            ReadError::Io(e)
        }
    })?;
    local::decode_body(&body).map(Some).map_err(wire)
}

impl RemoteTier for DaemonRemote {
    fn describe(&self) -> String {
        self.conn.describe.clone()
    }

    fn capacity_bytes(&self) -> u64 {
        self.conn.capacity_bytes
    }

    fn bandwidth_hint_bytes_per_s(&self) -> f64 {
        self.conn.bandwidth_hint_bytes_per_s
    }

    fn submit(&self, op: RemoteOp) {
        let id = op.id.0;
        {
            let mut state = self.conn.state.lock().expect("tier state lock");
            if let Some(cause) = &state.dead {
                let error = gone(cause);
                drop(state);
                return self.conn.complete(id, Err(error));
            }
            if state.in_flight.contains_key(&id) {
                drop(state);
                return self.conn.complete(
                    id,
                    Err(RemoteError::tier(format!("op {id} is already in flight"))),
                );
            }
            state.in_flight.insert(id, op.page);
        }
        let page_op = PageOp {
            id,
            page: op.page,
            slot: op.slot.0,
            bytes: op.bytes,
        };
        self.conn.send(&match op.kind {
            RemoteOpKind::Spill => ClientMessage::Spill(page_op),
            RemoteOpKind::Fetch => ClientMessage::Fetch(page_op),
        });
    }

    fn discard(&self, pages: Vec<PageId>) {
        if self
            .conn
            .state
            .lock()
            .expect("tier state lock")
            .dead
            .is_some()
        {
            // The node discards a gone client's pages itself.
            return;
        }
        for chunk in pages.chunks(DISCARD_PAGES_MAX) {
            self.conn.send(&ClientMessage::Discard(Discard {
                pages: chunk.to_vec(),
            }));
        }
    }
}

impl Drop for DaemonRemote {
    fn drop(&mut self) {
        // Ends the reader thread (and with it the completion thread); the node then
        // discards this client's pages.
        self.conn.die_as(
            LinkDown::ClosedByPool {
                node: self.conn.describe.clone(),
            },
            true,
        );
    }
}

/// The client's side of the shared memory and of receiving its fd: every `unsafe` of
/// daemon mode.
mod shm {
    use std::ffi::c_void;
    use std::io;
    use std::os::fd::{AsFd, OwnedFd};
    use std::os::unix::net::UnixStream;
    use std::ptr::NonNull;
    use std::sync::Arc;

    use rustix::mm::{MapFlags, ProtFlags};
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    use spillway_device::HostMemory;

    /// Most fds taken from one receive: 4. The node sends one; extra ones are closed.
    const FDS_PER_RECEIVE_MAX: usize = 4;

    /// The node's memfd mapped into this process.
    ///
    /// Invariants: `ptr..ptr + len` is a shared read-write mapping of a memfd of at least
    /// `len` bytes (checked before mapping; the node seals its size, so it cannot shrink
    /// under us), unmapped only in `drop`.
    pub(super) struct Mapping {
        ptr: NonNull<u8>,
        len: u64,
    }

    // SAFETY: plain bytes; who touches which slot is the pool's contract (a slot with an
    // op in flight is the node's until the op completes).
    unsafe impl Send for Mapping {}
    // SAFETY: as above.
    unsafe impl Sync for Mapping {}

    impl Mapping {
        /// Maps `len` bytes of `fd`, which must be at least that long. The fd is closed
        /// afterwards; the mapping keeps the memory.
        pub(super) fn map(fd: OwnedFd, len: u64) -> io::Result<Mapping> {
            let file_len = std::fs::File::from(fd.try_clone()?).metadata()?.len();
            if file_len < len || len == 0 {
                return Err(io::Error::other(format!(
                    "the shared memory has {file_len} bytes, {len} expected"
                )));
            }
            let size = usize::try_from(len).map_err(io::Error::other)?;
            // SAFETY: a fresh shared mapping placed by the kernel (null hint), so it
            // overlaps nothing of ours; `size` > 0 bytes, inside the file (checked).
            let ptr = unsafe {
                rustix::mm::mmap(
                    std::ptr::null_mut(),
                    size,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::SHARED,
                    &fd,
                    0,
                )
            }?;
            let ptr = NonNull::new(ptr.cast::<u8>())
                .ok_or_else(|| io::Error::other("mmap returned null"))?;
            Ok(Mapping { ptr, len })
        }

        /// The mapping as the device's host memory, kept mapped by a clone of `self`.
        pub(super) fn host_memory(self: &Arc<Self>) -> HostMemory {
            // SAFETY: the range is mapped read-write and page-aligned (mmap), and stays
            // mapped while the `Arc` given as owner lives (unmapped only when the last
            // clone drops). Only the device and the node (for ops the pool sends it)
            // touch it.
            unsafe { HostMemory::new(self.ptr, self.len, self.clone()) }
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: mapped in `map` with this length; no clone of the owning `Arc`
            // (so no `HostMemory`) is left, so nothing uses the range any more.
            let unmapped = unsafe {
                rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len as usize)
            };
            if let Err(e) = unmapped {
                tracing::warn!(error = %e, "cannot unmap the shared host memory");
            }
        }
    }

    /// Receives bytes into `buf` and any fds that came with them into `fds`.
    pub(super) fn recv_with_fds(
        stream: &UnixStream,
        buf: &mut [u8],
        fds: &mut Vec<OwnedFd>,
    ) -> io::Result<usize> {
        let mut space =
            [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_RECEIVE_MAX))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let received = loop {
            match rustix::net::recvmsg(
                stream.as_fd(),
                &mut [io::IoSliceMut::new(buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Err(rustix::io::Errno::INTR) => continue,
                other => break other?,
            }
        };
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        Ok(received.bytes)
    }
}
