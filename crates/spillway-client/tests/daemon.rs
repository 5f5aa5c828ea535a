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
use spillway_client::remote::{
    RemoteCompletion, RemoteOp, RemoteOpKind, RemoteSetupError, RemoteSink, RemoteTier,
};
use spillway_client::{
    Device, DeviceChoice, DeviceConfig, HostSlot, PageSize, TransferId, make_device_in, pattern,
};
use spillway_node::RemoteError;
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
    // A page the node does not hold fails with the node's reason.
    tier.submit(op(20, RemoteOpKind::Fetch, 9, 0, PAGE));
    let c = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(c.id, TransferId(20));
    assert!(
        c.result
            .unwrap_err()
            .to_string()
            .contains("is not in the remote tier")
    );
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
    ) -> impl Future<Output = Result<(), RemoteError>> + Send {
        std::future::pending()
    }
    async fn fetch(&self, client: u32, pages: Vec<PageId>) -> Result<Vec<Bytes>, RemoteError> {
        Err(RemoteError::PeerRefused {
            peer: spillway_types::NodeId(2),
            reason: format!("nothing here for {client}: {} pages", pages.len()),
        })
    }
    async fn discard(&self, _client: u32, _pages: Vec<PageId>) -> Result<(), RemoteError> {
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
    }
    // Later ops fail at once with the same cause.
    tier.submit(op(8, RemoteOpKind::Fetch, 0, 0, PAGE));
    let c = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(c.id, TransferId(8));
    assert_eq!(c.result.unwrap_err().to_string(), failed[0].1);
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
