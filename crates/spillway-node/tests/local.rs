//! The local client socket against the in-memory backend: a client's slot bytes go to the
//! backend and come back through the shared memory byte for byte; the socket is 0600;
//! malformed and oversized frames close only their connection and are counted; refused
//! hellos say why; a client that goes has its pages discarded.
//!
//! The server runs on a runtime of its own; each test talks to it like a client process
//! would, with blocking std sockets, and reads and writes the shared memory through the
//! memfd (`pread`/`pwrite` reach the same pages as the node's mapping).

#[path = "common/client_socket.rs"]
mod client_socket;

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use spillway_node::HostBudget;
use spillway_node::local::{
    LocalCounters, LocalServer, LocalServerConfig, LocalServerError, MemClientPages,
};
use spillway_types::local::{
    self, ClientMessage, Discard, Done, FRAME_BODY_BYTES_MAX, FrameHeader, Hello, NodeMessage,
    OpErrorCode, PageOp, Refused, RefusedCode, Welcome,
};
use spillway_types::{BufferId, PageId, PageSize, pattern};

use client_socket::{read_frame, send};

const PAGE: u64 = 64 << 10;
const HOST_BYTES: u64 = 16 * PAGE;
const WAIT: Duration = Duration::from_secs(10);

struct Harness {
    rt: tokio::runtime::Runtime,
    server: Option<LocalServer>,
    backend: Arc<MemClientPages>,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Harness {
    fn start() -> Harness {
        Harness::with(|_| {})
    }

    fn with(tune: impl FnOnce(&mut LocalServerConfig)) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/spillway/client.sock");
        let mut config =
            LocalServerConfig::new(path.clone(), PageSize::new(PAGE).unwrap(), HOST_BYTES);
        tune(&mut config);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let backend = Arc::new(MemClientPages::new(64 * PAGE));
        let server = rt
            .block_on(async { LocalServer::start(config, backend.clone()) })
            .unwrap();
        Harness {
            rt,
            server: Some(server),
            backend,
            path,
            _dir: dir,
        }
    }

    fn server(&self) -> &LocalServer {
        self.server.as_ref().unwrap()
    }

    /// Waits (at most [`WAIT`]) until the counters satisfy `cond`.
    fn wait_until(&self, cond: impl Fn(&LocalCounters) -> bool) -> LocalCounters {
        self.rt
            .block_on(async { tokio::time::timeout(WAIT, self.server().wait_until(cond)).await })
            .unwrap_or_else(|_| panic!("condition not met: {:?}", self.server().counters()))
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            self.rt.block_on(server.shutdown());
        }
    }
}

/// A client speaking the protocol by hand.
struct Client {
    stream: UnixStream,
    welcome: Welcome,
    memory: File,
}

fn hello(host_bytes: u64) -> Hello {
    Hello {
        version: local::PROTOCOL_VERSION,
        page_bytes: PAGE,
        host_bytes,
    }
}

/// Says hello; the welcome and the shared memory, or the refusal.
fn try_connect(path: &Path, hello: Hello) -> Result<Client, Refused> {
    let mut stream = UnixStream::connect(path).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    send(&mut stream, &ClientMessage::Hello(hello));
    match read_frame(&mut stream).expect("an answer to the hello") {
        (_, NodeMessage::Welcome(welcome), mut fds) => {
            assert_eq!(fds.len(), 1, "the welcome carries one fd");
            let memory = File::from(fds.pop().unwrap());
            assert_eq!(memory.metadata().unwrap().len(), welcome.host_bytes);
            Ok(Client {
                stream,
                welcome,
                memory,
            })
        }
        (_, NodeMessage::Refused(r), fds) => {
            assert!(fds.is_empty());
            // The node closes after a refusal.
            assert!(read_frame(&mut stream).is_none());
            Err(r)
        }
        (_, other, _) => panic!("unexpected answer {other:?}"),
    }
}

fn connect(path: &Path) -> Client {
    try_connect(path, hello(HOST_BYTES)).unwrap()
}

fn page(buffer: u64, index: u32) -> PageId {
    PageId {
        buffer: BufferId(buffer),
        index,
    }
}

impl Client {
    fn op(&mut self, message: ClientMessage) -> Done {
        send(&mut self.stream, &message);
        self.done()
    }

    fn done(&mut self) -> Done {
        match read_frame(&mut self.stream).expect("a done") {
            (_, NodeMessage::Done(d), _) => d,
            (_, other, _) => panic!("unexpected {other:?}"),
        }
    }

    fn write_slot(&self, slot: u32, data: &[u8]) {
        self.memory
            .write_all_at(data, u64::from(slot) * PAGE)
            .unwrap();
    }

    fn read_slot(&self, slot: u32, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.memory
            .read_exact_at(&mut out, u64::from(slot) * PAGE)
            .unwrap();
        out
    }

    /// Spills page 0 of `buffer`, a page of pattern `seed` written to slot 0, and checks
    /// that it went through.
    fn spill_one(&mut self, buffer: u64, seed: u64) {
        self.write_slot(0, &pattern_bytes(PAGE, seed));
        assert_eq!(self.op(spill(1, page(buffer, 0), 0, PAGE)).result, Ok(()));
    }

    /// Whether the node closed the connection (EOF on the next read).
    fn closed_by_node(&mut self) -> bool {
        read_frame(&mut self.stream).is_none()
    }
}

fn spill(id: u64, page: PageId, slot: u32, bytes: u64) -> ClientMessage {
    ClientMessage::Spill(PageOp {
        id,
        page,
        slot,
        bytes,
    })
}

fn fetch(id: u64, page: PageId, slot: u32, bytes: u64) -> ClientMessage {
    ClientMessage::Fetch(PageOp {
        id,
        page,
        slot,
        bytes,
    })
}

/// The answer to a successful operation `id`.
fn done_ok(id: u64) -> Done {
    Done { id, result: Ok(()) }
}

fn pattern_bytes(len: u64, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    pattern::fill(seed, &mut v);
    v
}

#[test]
fn a_spilled_slot_comes_back_byte_for_byte() {
    let h = Harness::start();
    let mut c = connect(&h.path);
    assert_eq!(c.welcome.host_bytes, HOST_BYTES);
    assert_eq!(c.welcome.remote_capacity_bytes, 64 * PAGE);
    let full = pattern_bytes(PAGE, 11);
    let short = pattern_bytes(PAGE / 3, 12);
    c.write_slot(3, &full);
    c.write_slot(15, &short);
    assert_eq!(c.op(spill(1, page(1, 0), 3, PAGE)), done_ok(1));
    assert_eq!(c.op(spill(2, page(1, 1), 15, PAGE / 3)), done_ok(2));
    // The backend got the slot's bytes.
    let client = c.welcome.client;
    assert_eq!(h.backend.get(client, page(1, 0)).unwrap(), full);
    // Overwrite the slots, then fetch into them and into another slot.
    c.write_slot(3, &vec![0u8; PAGE as usize]);
    c.write_slot(15, &vec![0xee; PAGE as usize]);
    assert_eq!(c.op(fetch(3, page(1, 0), 3, PAGE)), done_ok(3));
    assert_eq!(c.op(fetch(4, page(1, 1), 15, PAGE / 3)), done_ok(4));
    assert_eq!(c.op(fetch(5, page(1, 0), 0, PAGE)), done_ok(5));
    assert!(c.read_slot(3, PAGE as usize) == full);
    assert!(c.read_slot(0, PAGE as usize) == full);
    let back = c.read_slot(15, PAGE as usize);
    assert!(back[..short.len()] == short[..]);
    // Only the page's bytes were written: the rest of the slot is untouched.
    assert!(back[short.len()..].iter().all(|b| *b == 0xee));
    let counters = h.server().counters();
    assert_eq!(counters.spills, 2);
    assert_eq!(counters.fetches, 3);
    assert_eq!(counters.ops_failed, 0);
    assert_eq!(counters.clients_connected, 1);
}

#[test]
fn many_ops_in_flight_are_all_answered() {
    let h = Harness::with(|c| c.ops_in_flight_per_client_max = 4);
    let mut c = connect(&h.path);
    for slot in 0..16u32 {
        c.write_slot(slot, &pattern_bytes(PAGE, u64::from(slot)));
    }
    // All 16 spills before reading any answer: at most 4 run at once, all complete.
    for slot in 0..16u32 {
        send(
            &mut c.stream,
            &spill(100 + u64::from(slot), page(2, slot), slot, PAGE),
        );
    }
    let mut ids: Vec<u64> = (0..16)
        .map(|_| {
            let d = c.done();
            assert_eq!(d.result, Ok(()));
            d.id
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (100..116).collect::<Vec<_>>());
    // Fetch them crosswise (slot s gets page 15 - s).
    for slot in 0..16u32 {
        c.write_slot(slot, &vec![0u8; PAGE as usize]);
    }
    for slot in 0..16u32 {
        send(
            &mut c.stream,
            &fetch(u64::from(slot), page(2, 15 - slot), slot, PAGE),
        );
    }
    for _ in 0..16 {
        assert_eq!(c.done().result, Ok(()));
    }
    for slot in 0..16u32 {
        assert!(c.read_slot(slot, PAGE as usize) == pattern_bytes(PAGE, u64::from(15 - slot)));
    }
}

#[test]
fn the_socket_is_private_and_a_stale_one_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.sock");
    // A socket left by a node that died: nobody listens on it.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let config = LocalServerConfig::new(path.clone(), PageSize::new(PAGE).unwrap(), HOST_BYTES);
    let backend = Arc::new(MemClientPages::new(PAGE * 4));
    let server = rt
        .block_on(async { LocalServer::start(config.clone(), backend.clone()) })
        .unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    // A second node on the same path is refused while the first lives.
    let err = rt
        .block_on(async { LocalServer::start(config.clone(), backend.clone()) })
        .unwrap_err();
    assert!(matches!(err, LocalServerError::InUse { .. }), "{err}");
    assert!(err.to_string().contains("node.sock"));
    // Connecting works, and shutdown removes the file.
    connect(&path);
    rt.block_on(server.shutdown());
    assert!(!path.exists());
    // Something that is not a socket is never removed.
    std::fs::write(&path, b"data").unwrap();
    let err = rt
        .block_on(async { LocalServer::start(config, backend) })
        .unwrap_err();
    assert!(matches!(err, LocalServerError::NotASocket { .. }), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"data");
}

#[test]
fn malformed_and_oversized_frames_close_only_their_connection() {
    let h = Harness::start();
    let mut good = connect(&h.path);
    good.spill_one(3, 5);

    // Garbage after the welcome.
    let mut bad = connect(&h.path);
    bad.stream.write_all(b"not a spillway frame").unwrap();
    assert!(bad.closed_by_node());
    h.wait_until(|c| c.frames_rejected == 1);

    // A header claiming a body over the limit: refused before any body is read.
    let mut big = connect(&h.path);
    let header = FrameHeader {
        version: local::PROTOCOL_VERSION,
        body_bytes: FRAME_BODY_BYTES_MAX + 1,
    };
    big.stream.write_all(&header.encode()).unwrap();
    assert!(big.closed_by_node());
    h.wait_until(|c| c.frames_rejected == 2);

    // A body that does not decode, as the very first frame.
    let mut first = UnixStream::connect(&h.path).unwrap();
    first.set_read_timeout(Some(WAIT)).unwrap();
    let header = FrameHeader {
        version: local::PROTOCOL_VERSION,
        body_bytes: 3,
    };
    first.write_all(&header.encode()).unwrap();
    first.write_all(&[0xff, 0xff, 0xff]).unwrap();
    assert!(read_frame(&mut first).is_none());
    let counters = h.wait_until(|c| c.frames_rejected == 3);
    // Both welcomed bad clients are gone; the good one still works.
    assert_eq!(counters.clients_accepted, 3);
    h.wait_until(|c| c.clients_connected == 1);
    good.write_slot(0, &vec![0u8; PAGE as usize]);
    assert_eq!(good.op(fetch(2, page(3, 0), 0, PAGE)).result, Ok(()));
    assert!(good.read_slot(0, PAGE as usize) == pattern_bytes(PAGE, 5));
}

#[test]
fn bad_ops_get_typed_errors_and_the_connection_stays() {
    let h = Harness::start();
    let mut c = connect(&h.path);
    let outside = c.op(spill(1, page(4, 0), 16, PAGE));
    assert_eq!(outside.result.unwrap_err().code, OpErrorCode::BadRequest);
    let too_long = c.op(spill(2, page(4, 0), 0, PAGE + 1));
    assert_eq!(too_long.result.unwrap_err().code, OpErrorCode::BadRequest);
    let empty = c.op(spill(3, page(4, 0), 0, 0));
    assert_eq!(empty.result.unwrap_err().code, OpErrorCode::BadRequest);
    // A page the tier has no copy of: the client loses that buffer, typed.
    let missing = c.op(fetch(4, page(4, 9), 0, PAGE)).result.unwrap_err();
    assert_eq!(missing.code, OpErrorCode::PageLost);
    assert!(
        missing.message.contains("is not in the remote tier"),
        "{}",
        missing.message
    );
    // Spilled short, fetched long: the lengths disagree.
    c.write_slot(1, &pattern_bytes(PAGE, 1));
    assert_eq!(c.op(spill(5, page(4, 1), 1, PAGE / 2)).result, Ok(()));
    let wrong = c.op(fetch(6, page(4, 1), 1, PAGE)).result.unwrap_err();
    assert_eq!(wrong.code, OpErrorCode::Remote);
    assert_eq!(h.server().counters().ops_failed, 5);
    assert_eq!(h.server().counters().frames_rejected, 0);
}

#[test]
fn refused_hellos_say_why() {
    let h = Harness::with(|c| c.clients_max = 1);
    let wrong_page = Hello {
        page_bytes: PAGE * 2,
        ..hello(HOST_BYTES)
    };
    let r = try_connect(&h.path, wrong_page).err().unwrap();
    assert_eq!(r.code, RefusedCode::PageSizeMismatch);
    assert!(r.message.contains(&PAGE.to_string()), "{}", r.message);

    let r = try_connect(&h.path, hello(HOST_BYTES + PAGE))
        .err()
        .unwrap();
    assert_eq!(r.code, RefusedCode::HostBytesTooLarge);
    assert!(r.message.contains(&HOST_BYTES.to_string()), "{}", r.message);

    let r = try_connect(&h.path, hello(PAGE + 1)).err().unwrap();
    assert_eq!(r.code, RefusedCode::BadHostBytes);
    let r = try_connect(&h.path, hello(0)).err().unwrap();
    assert_eq!(r.code, RefusedCode::BadHostBytes);

    let old = Hello {
        version: 0,
        ..hello(HOST_BYTES)
    };
    let r = try_connect(&h.path, old).err().unwrap();
    assert_eq!(r.code, RefusedCode::VersionMismatch);

    // A frame of another version (in the header) is refused with the same reason.
    let mut stream = UnixStream::connect(&h.path).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut frame = local::encode_frame(&ClientMessage::Hello(hello(HOST_BYTES))).unwrap();
    frame[4] = 7;
    stream.write_all(&frame).unwrap();
    match read_frame(&mut stream) {
        Some((_, NodeMessage::Refused(r), _)) => {
            assert_eq!(r.code, RefusedCode::VersionMismatch);
            assert!(r.message.contains("version 7"), "{}", r.message);
        }
        other => panic!("unexpected {other:?}"),
    }

    let first = connect(&h.path);
    let r = try_connect(&h.path, hello(HOST_BYTES)).err().unwrap();
    assert_eq!(r.code, RefusedCode::TooManyClients);
    let counters = h.server().counters();
    assert_eq!(counters.clients_refused, 7);
    assert_eq!(counters.clients_accepted, 1);
    assert_eq!(counters.frames_rejected, 0);
    // When the first goes, there is room again, and its number is given again.
    assert_eq!(first.welcome.client, 1);
    drop(first);
    h.wait_until(|c| c.clients_connected == 0);
    assert_eq!(connect(&h.path).welcome.client, 1);
}

#[test]
fn clients_take_their_host_tiers_from_the_nodes_host_budget() {
    let budget = Arc::new(HostBudget::new(24 * PAGE));
    let h = Harness::with(|c| c.host_budget = Some(budget.clone()));
    // Other clients hold 8 pages of the budget; a client of 16 fits exactly.
    budget.try_take(8 * PAGE).unwrap();
    let first = connect(&h.path);
    assert_eq!(budget.used_bytes(), 24 * PAGE);
    let r = try_connect(&h.path, hello(PAGE)).err().unwrap();
    assert_eq!(r.code, RefusedCode::HostBytesTooLarge);
    assert!(
        r.message
            .contains(&format!("{} of {} bytes", 24 * PAGE, 24 * PAGE)),
        "{}",
        r.message
    );
    // The refused client took nothing; the first gives its share back when it goes.
    assert_eq!(budget.used_bytes(), 24 * PAGE);
    drop(first);
    h.wait_until(|c| c.clients_connected == 0);
    assert_eq!(budget.used_bytes(), 8 * PAGE);
    assert_eq!(connect(&h.path).welcome.host_bytes, HOST_BYTES);
}

#[test]
fn a_client_that_goes_has_its_pages_discarded() {
    let h = Harness::start();
    let mut other = connect(&h.path);
    other.spill_one(5, 9);

    let mut c = connect(&h.path);
    let client = c.welcome.client;
    assert_eq!((other.welcome.client, client), (1, 2));
    for i in 0..3u32 {
        c.write_slot(i, &pattern_bytes(PAGE, u64::from(i)));
        assert_eq!(
            c.op(spill(u64::from(i), page(5, i), i, PAGE)).result,
            Ok(())
        );
    }
    assert_eq!(h.backend.pages_of(client), 3);
    // An explicit discard is done before the next frame is read: the fetch after it fails.
    send(
        &mut c.stream,
        &ClientMessage::Discard(Discard {
            pages: vec![page(5, 0), page(5, 7)],
        }),
    );
    let gone = c.op(fetch(10, page(5, 0), 0, PAGE)).result.unwrap_err();
    assert_eq!(gone.code, OpErrorCode::PageLost);
    assert_eq!(h.backend.pages_of(client), 2);

    drop(c);
    let counters =
        h.wait_until(|c| c.clients_connected == 1 && c.pages_discarded_on_disconnect == 2);
    assert_eq!(counters.clients_accepted, 2);
    assert_eq!(h.backend.pages_of(client), 0);
    // The other client's page is untouched.
    assert_eq!(h.backend.pages_of(other.welcome.client), 1);
    assert_eq!(other.op(fetch(2, page(5, 0), 1, PAGE)).result, Ok(()));
    assert!(other.read_slot(1, PAGE as usize) == pattern_bytes(PAGE, 9));
}

#[test]
fn shutdown_closes_clients_and_discards_their_pages() {
    let mut h = Harness::start();
    let mut c = connect(&h.path);
    c.spill_one(6, 1);
    let server = h.server.take().unwrap();
    h.rt.block_on(server.shutdown());
    assert!(c.closed_by_node());
    assert_eq!(h.backend.pages_of(c.welcome.client), 0);
    assert!(!h.path.exists());
}
