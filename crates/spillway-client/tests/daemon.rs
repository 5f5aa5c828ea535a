//! Daemon mode against a node's local socket server in the same test (on a tokio runtime
//! of its own, with the in-memory backend): the pool's host tier is the node's shared
//! memory and its remote tier the node's; every byte comes back; ops in flight fail with
//! the cause when the node goes; connection errors are typed and say what to do.

mod common;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use spillway_client::daemon::{DaemonError, DaemonLink};
use spillway_client::remote::RemoteError;
use spillway_client::remote::{
    RemoteCompletion, RemoteOp, RemoteOpKind, RemoteSetupError, RemoteSink, RemoteTier,
};
use spillway_client::{
    CoreError, Device, DeviceChoice, DeviceConfig, HostSlot, PageSize, PoolError, TransferId,
    make_device_in, pattern,
};
use spillway_node::RemoteError as NodeRemoteError;
use spillway_node::local::{
    ClientPages, LocalCounters, LocalServer, LocalServerConfig, MemClientPages,
};
use spillway_types::local::{DISCARD_PAGES_MAX, RefusedCode};
use spillway_types::{BufferId, PageId};

const PAGE: u64 = 256 << 10;
const WAIT: Duration = Duration::from_secs(20);

struct Node<B> {
    rt: tokio::runtime::Runtime,
    server: Option<LocalServer>,
    backend: Arc<B>,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

fn node_with<B: ClientPages>(backend: B, client_host_bytes_max: u64) -> Node<B> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node/client.sock");
    let config = LocalServerConfig::new(
        path.clone(),
        PageSize::new(PAGE).unwrap(),
        client_host_bytes_max,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let backend = Arc::new(backend);
    let server = rt
        .block_on(async { LocalServer::start(config, backend.clone()) })
        .unwrap();
    Node {
        rt,
        server: Some(server),
        backend,
        path,
        _dir: dir,
    }
}

fn node(remote_pages: u64) -> Node<MemClientPages> {
    node_with(MemClientPages::new(remote_pages * PAGE), 64 * PAGE)
}

impl<B> Node<B> {
    fn server(&self) -> &LocalServer {
        self.server.as_ref().unwrap()
    }

    fn wait_until(&self, cond: impl Fn(&LocalCounters) -> bool) -> LocalCounters {
        self.rt
            .block_on(async { tokio::time::timeout(WAIT, self.server().wait_until(cond)).await })
            .unwrap_or_else(|_| panic!("condition not met: {:?}", self.server().counters()))
    }

    fn shutdown(&mut self) {
        if let Some(server) = self.server.take() {
            self.rt.block_on(server.shutdown());
        }
    }
}

impl<B> Drop for Node<B> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn page_size() -> PageSize {
    PageSize::new(PAGE).unwrap()
}

#[test]
fn a_pool_in_daemon_mode_round_trips_every_byte() {
    round_trip(DeviceChoice::Sim);
}

/// The same on a GPU: the shared memory is registered as pinned host memory.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn a_pool_in_daemon_mode_on_a_gpu_round_trips_every_byte() {
    round_trip(DeviceChoice::Cuda);
}

fn round_trip(device: DeviceChoice) {
    let node = node(64);
    let link = DaemonLink::connect(&node.path, 8 * PAGE, page_size()).unwrap();
    assert_eq!(link.host_bytes(), 8 * PAGE);
    assert_eq!(link.remote_capacity_bytes(), 64 * PAGE);
    assert_eq!(link.host_memory().len(), 8 * PAGE);
    let client = link.client_id();
    // 24 buffers of 2 pages: 48 pages through 4 frames and 8 slots.
    let (pool, bufs) = common::spill_through_link(&link, device, 24);
    let counters = node.server().counters();
    assert!(counters.spills > 0 && counters.fetches > 0, "{counters:?}");
    assert_eq!(counters.ops_failed, 0);
    assert!(node.backend.pages_of(client) > 0);
    // Freed buffers are discarded from the remote tier.
    for b in &bufs {
        pool.free(b).unwrap();
    }
    pool.quiesce();
    drop(pool);
    drop(link);
    let counters = node.wait_until(|c| c.clients_connected == 0);
    assert_eq!(node.backend.pages_of(client), 0, "{counters:?}");
}

/// A device over the link's memory, and a remote tier whose completions arrive on `rx`.
fn tier(
    link: &DaemonLink,
    slots: u32,
) -> (
    Arc<dyn Device>,
    Arc<dyn RemoteTier>,
    mpsc::Receiver<RemoteCompletion>,
) {
    let config = DeviceConfig {
        frames: 1,
        host_slots: slots,
        page_bytes: PAGE,
    };
    let device = make_device_in(
        DeviceChoice::Sim,
        config,
        Some(link.host_memory()),
        Arc::new(|_| {}),
    )
    .unwrap();
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let sink: RemoteSink = Arc::new(move |c| {
        let _ = tx.lock().unwrap().send(c);
    });
    let tier = (link.remote_factory())(device.clone(), sink).unwrap();
    (device, tier, rx)
}

fn op(id: u64, kind: RemoteOpKind, page: u32, slot: u32, bytes: u64) -> RemoteOp {
    RemoteOp {
        id: TransferId(id),
        kind,
        page: PageId {
            buffer: BufferId(1),
            index: page,
        },
        slot: HostSlot(slot),
        bytes,
    }
}

#[test]
fn the_remote_tier_moves_slots_through_the_node() {
    let node = node(16);
    let link = DaemonLink::connect(&node.path, 4 * PAGE, page_size()).unwrap();
    let (device, tier, rx) = tier(&link, 4);
    assert_eq!(tier.capacity_bytes(), 16 * PAGE);
    assert!(
        tier.describe().contains("client.sock"),
        "{}",
        tier.describe()
    );
    for slot in 0..4u32 {
        device
            .write_host(
                HostSlot(slot),
                0,
                &pattern::bytes(u64::from(slot), PAGE as usize),
            )
            .unwrap();
        tier.submit(op(u64::from(slot), RemoteOpKind::Spill, slot, slot, PAGE));
    }
    let mut ids: Vec<u64> = (0..4)
        .map(|_| {
            let c = rx.recv_timeout(WAIT).unwrap();
            assert_eq!(c.result, Ok(()));
            c.id.0
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![0, 1, 2, 3]);
    // The node holds the slots' bytes.
    let held = node
        .backend
        .get(
            link.client_id(),
            PageId {
                buffer: BufferId(1),
                index: 2,
            },
        )
        .unwrap();
    assert_eq!(held, Bytes::from(pattern::bytes(2, PAGE as usize)));
    // Zero the slots, then fetch each page into the slot of the next.
    for slot in 0..4u32 {
        device
            .write_host(HostSlot(slot), 0, &vec![0u8; PAGE as usize])
            .unwrap();
    }
    for page in 0..4u32 {
        tier.submit(op(
            10 + u64::from(page),
            RemoteOpKind::Fetch,
            page,
            (page + 1) % 4,
            PAGE,
        ));
    }
    for _ in 0..4 {
        assert_eq!(rx.recv_timeout(WAIT).unwrap().result, Ok(()));
    }
    for page in 0..4u32 {
        let mut out = vec![0u8; PAGE as usize];
        device
            .read_host(HostSlot((page + 1) % 4), 0, &mut out)
            .unwrap();
        assert!(
            out == pattern::bytes(u64::from(page), PAGE as usize),
            "page {page}"
        );
    }
    // A page the node does not hold is lost, typed, with the node's reason.
    tier.submit(op(20, RemoteOpKind::Fetch, 9, 0, PAGE));
    let c = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(c.id, TransferId(20));
    match c.result.unwrap_err() {
        RemoteError::Lost { page, message } => {
            assert_eq!(
                page,
                PageId {
                    buffer: BufferId(1),
                    index: 9
                }
            );
            assert!(message.contains("is not in the remote tier"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Discarded pages are gone; a long list goes in several frames (pages 2 and 3 are
    // in the last one, past DISCARD_PAGES_MAX).
    let mut pages: Vec<PageId> = (100..2200)
        .map(|index| PageId {
            buffer: BufferId(1),
            index,
        })
        .collect();
    pages.insert(
        0,
        PageId {
            buffer: BufferId(1),
            index: 0,
        },
    );
    pages.extend((2..4).map(|index| PageId {
        buffer: BufferId(1),
        index,
    }));
    assert!(pages.len() > 2 * DISCARD_PAGES_MAX);
    tier.discard(pages);
    tier.submit(op(21, RemoteOpKind::Fetch, 0, 0, PAGE));
    assert!(rx.recv_timeout(WAIT).unwrap().result.is_err());
    assert_eq!(node.backend.pages_of(link.client_id()), 1);
    assert_eq!(node.server().counters().frames_rejected, 0);
}

/// A backend whose spills never finish.
struct Stuck;

impl ClientPages for Stuck {
    fn spill(
        &self,
        _client: u32,
        _pages: Vec<(PageId, Bytes)>,
    ) -> impl Future<Output = Result<(), NodeRemoteError>> + Send {
        std::future::pending()
    }
    async fn fetch(&self, client: u32, pages: Vec<PageId>) -> Result<Vec<Bytes>, NodeRemoteError> {
        Err(NodeRemoteError::PeerRefused {
            peer: spillway_types::NodeId(2),
            reason: format!("nothing here for {client}: {} pages", pages.len()),
        })
    }
    async fn discard(&self, _client: u32, _pages: Vec<PageId>) -> Result<(), NodeRemoteError> {
        Ok(())
    }
    fn capacity_bytes(&self) -> u64 {
        64 * PAGE
    }
}

#[test]
fn ops_in_flight_fail_with_the_cause_when_the_node_goes() {
    let mut node = node_with(Stuck, 64 * PAGE);
    let link = DaemonLink::connect(&node.path, 4 * PAGE, page_size()).unwrap();
    let (_device, tier, rx) = tier(&link, 4);
    for id in 0..3 {
        tier.submit(op(id, RemoteOpKind::Spill, id as u32, id as u32, PAGE));
    }
    // Answered by the node: the connection works.
    tier.submit(op(7, RemoteOpKind::Fetch, 0, 3, PAGE));
    let c = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(c.id, TransferId(7));
    assert!(c.result.unwrap_err().to_string().contains("nothing here"));
    node.shutdown();
    let mut failed: Vec<(u64, String)> = (0..3)
        .map(|_| {
            let c = rx.recv_timeout(WAIT).unwrap();
            (c.id.0, c.result.unwrap_err().to_string())
        })
        .collect();
    failed.sort();
    assert_eq!(
        failed.iter().map(|f| f.0).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    for (_, cause) in &failed {
        assert!(cause.contains("closed the connection"), "{cause}");
        assert!(cause.contains("client.sock"), "{cause}");
        assert!(cause.starts_with("the remote tier is gone"), "{cause}");
    }
    // Later ops fail at once with the same cause.
    tier.submit(op(8, RemoteOpKind::Fetch, 0, 0, PAGE));
    let c = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(c.id, TransferId(8));
    let err = c.result.unwrap_err();
    assert!(matches!(err, RemoteError::TierGone { .. }), "{err:?}");
    assert_eq!(err.to_string(), failed[0].1);
}

/// Starts a node's local server again on `node`'s socket, with a fresh backend (a node
/// that restarts has lost its clients' pages).
fn restart(node: &mut Node<MemClientPages>, remote_pages: u64) {
    let config = LocalServerConfig::new(node.path.clone(), page_size(), 64 * PAGE);
    node.backend = Arc::new(MemClientPages::new(remote_pages * PAGE));
    let backend = node.backend.clone();
    let server = node
        .rt
        .block_on(async { LocalServer::start(config, backend) })
        .unwrap();
    node.server = Some(server);
}

#[test]
fn a_pool_whose_node_dies_fails_at_once_and_a_new_link_works_when_it_is_back() {
    let mut node = node(64);
    let link = DaemonLink::connect(&node.path, 8 * PAGE, page_size()).unwrap();
    // 24 buffers of 2 pages through 4 frames and 8 slots: most pages are on the node.
    let (pool, bufs) = common::spill_through_link(&link, DeviceChoice::Sim, 24);
    assert!(node.backend.pages_of(link.client_id()) > 0);
    // The node's side of the socket goes (the node process died).
    node.shutdown();
    let started = std::time::Instant::now();
    // Every buffer is acquired in turn: those whose pages are on the node need it, and
    // the first such acquire fails, typed, and so does every later one.
    let first = bufs
        .iter()
        .find_map(|b| pool.acquire(b).err())
        .expect("an acquire needs the node");
    match &first {
        PoolError::Pool(CoreError::RemoteTierGone {
            reason: RemoteError::TierGone { message },
        }) => assert!(message.contains("closed the connection"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert!(
        first.to_string().contains("connect to the node again"),
        "{first}"
    );
    for b in &bufs {
        assert!(matches!(
            pool.acquire(b),
            Err(PoolError::Pool(CoreError::RemoteTierGone { .. }))
        ));
    }
    // At once: no spill backoff (120 s) and no peer grace (30 s) in between.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    drop(pool);
    drop(link);
    // The node is back: connecting again gives a new pool that works.
    restart(&mut node, 64);
    let link = DaemonLink::connect(&node.path, 8 * PAGE, page_size()).unwrap();
    let (pool, bufs) = common::spill_through_link(&link, DeviceChoice::Sim, 24);
    assert!(node.backend.pages_of(link.client_id()) > 0);
    assert_eq!(pool.stats().core.pages_lost, 0);
    drop(bufs);
}

/// A backend whose one holder of buffers 1 to 6 died: their fetches fail (and are
/// recorded); it holds the rest.
struct LostSome {
    pages: MemClientPages,
    failed: std::sync::Mutex<std::collections::BTreeSet<BufferId>>,
}

impl ClientPages for LostSome {
    async fn spill(&self, client: u32, pages: Vec<(PageId, Bytes)>) -> Result<(), NodeRemoteError> {
        self.pages.spill(client, pages).await
    }
    async fn fetch(&self, client: u32, pages: Vec<PageId>) -> Result<Vec<Bytes>, NodeRemoteError> {
        if let Some(p) = pages.iter().find(|p| (1..=6).contains(&p.buffer.0)) {
            self.failed.lock().unwrap().insert(p.buffer);
            return Err(NodeRemoteError::PeerUnreachable {
                peer: spillway_types::NodeId(3),
                reason: format!("holder of {p} is down"),
            });
        }
        self.pages.fetch(client, pages).await
    }
    async fn discard(&self, client: u32, pages: Vec<PageId>) -> Result<(), NodeRemoteError> {
        self.pages.discard(client, pages).await
    }
    fn capacity_bytes(&self) -> u64 {
        self.pages.capacity_bytes()
    }
}

#[test]
fn pages_the_node_lost_fail_only_their_buffers() {
    let node = node_with(
        LostSome {
            pages: MemClientPages::new(64 * PAGE),
            failed: Default::default(),
        },
        64 * PAGE,
    );
    let link = DaemonLink::connect(&node.path, 8 * PAGE, page_size()).unwrap();
    let pool = link
        .pool_builder()
        .gpu_budget_bytes(4 * PAGE)
        .remote_budget_bytes(48 * PAGE)
        .device(DeviceChoice::Sim)
        .build()
        .unwrap();
    let bufs: Vec<_> = (0..24)
        .map(|i| pool.alloc(&format!("b{i}"), 2 * PAGE).unwrap())
        .collect();
    assert_eq!(bufs[0].id(), BufferId(1));
    // Every buffer written once (most leave for the node), then read back three times.
    let mut lost = std::collections::BTreeSet::new();
    for pass in 0..4 {
        for (i, b) in bufs.iter().enumerate() {
            let result = if pass == 0 {
                pool.acquire_mut(b).map(|mut g| {
                    for page in 0..g.pages() {
                        g.fill_pattern(page, i as u64).unwrap();
                    }
                })
            } else {
                pool.acquire(b).map(|g| {
                    for page in 0..g.pages() {
                        let want = pattern::expected_checksum(i as u64, g.page_len(page) as usize);
                        assert_eq!(g.checksum(page).unwrap(), want, "buffer {i} page {page}");
                    }
                })
            };
            match result {
                Ok(()) => assert!(!lost.contains(&b.id()), "a lost buffer came back"),
                Err(PoolError::Pool(CoreError::PageLost {
                    buffer,
                    page,
                    reason: RemoteError::Lost { message, .. },
                })) => {
                    assert_eq!(buffer, b.id());
                    assert!(page < 2);
                    assert!(message.contains("is down"), "{message}");
                    lost.insert(buffer);
                }
                Err(other) => panic!("{other:?}"),
            }
        }
    }
    // Exactly the buffers whose pages the node could not fetch are lost, and the stats
    // count them; every other buffer kept its bytes (checked above).
    let failed = node.backend.failed.lock().unwrap().clone();
    assert!(!failed.is_empty(), "no page of buffers 1-6 left the client");
    assert_eq!(lost, failed);
    let s = pool.stats().core;
    assert_eq!(s.buffers_lost, lost.len() as u64, "{s:?}");
    assert!(s.pages_lost >= s.buffers_lost, "{s:?}");
    // Freed, a lost buffer's room can be taken by a new buffer that works.
    let first = bufs.iter().find(|b| lost.contains(&b.id())).unwrap();
    pool.free(first).unwrap();
    let again = pool.alloc("again", 2 * PAGE).unwrap();
    pool.acquire_mut(&again)
        .unwrap()
        .fill_pattern(0, 7)
        .unwrap();
    assert_eq!(node.server().counters().frames_rejected, 0);
}

#[test]
fn connection_errors_are_typed_and_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nobody.sock");
    let err = DaemonLink::connect(&missing, 4 * PAGE, page_size()).unwrap_err();
    assert!(matches!(err, DaemonError::NoNode { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("nobody.sock"), "{text}");
    assert!(text.contains("spillway node --config"), "{text}");
    assert!(text.contains("spillway cluster up"), "{text}");

    let node = node(16);
    let err =
        DaemonLink::connect(&node.path, 4 * PAGE, PageSize::new(PAGE * 2).unwrap()).unwrap_err();
    match &err {
        DaemonError::Refused { code, message } => {
            assert_eq!(*code, RefusedCode::PageSizeMismatch);
            assert!(message.contains(&PAGE.to_string()), "{message}");
        }
        other => panic!("unexpected {other}"),
    }
    let err = DaemonLink::connect(&node.path, 65 * PAGE, page_size()).unwrap_err();
    assert!(
        matches!(
            err,
            DaemonError::Refused {
                code: RefusedCode::HostBytesTooLarge,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("refused"), "{err}");
    assert_eq!(node.server().counters().clients_refused, 2);
}

#[test]
fn a_link_makes_one_remote_tier() {
    let node = node(16);
    let link = DaemonLink::connect(&node.path, 4 * PAGE, page_size()).unwrap();
    let (_device, _tier, _rx) = tier(&link, 4);
    let device = make_device_in(
        DeviceChoice::Sim,
        DeviceConfig {
            frames: 1,
            host_slots: 4,
            page_bytes: PAGE,
        },
        Some(link.host_memory()),
        Arc::new(|_| {}),
    )
    .unwrap();
    let err = (link.remote_factory())(device, Arc::new(|_| {}))
        .err()
        .unwrap();
    assert!(matches!(err, RemoteSetupError::LinkTaken { .. }), "{err}");
}
