//! A whole node serves its local client socket: `Node::start` creates it at
//! `client_socket` (0600), a client is welcomed with its shared memory and counted in the
//! node's gauge, its ops are answered by the node's remote tier, and shutdown removes the
//! socket.

#[path = "common/client_socket.rs"]
mod client_socket;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use spillway_net::certs::init_pool_dir;
use spillway_node::{Node, NodeConfig};
use spillway_types::local::{self, ClientMessage, Hello, NodeMessage, PageOp};
use spillway_types::{BufferId, NodeId, PageId, PageSize, PoolId};

use client_socket::{read_frame, send};

const PAGE: u64 = 64 << 10;
const WAIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_its_client_socket() {
    let root = tempfile::tempdir().unwrap();
    let pool_dir = root.path().join("pool");
    init_pool_dir(&pool_dir, PoolId(7), &[NodeId(1)]).unwrap();
    let mut config = NodeConfig::new(NodeId(1), pool_dir, root.path().join("data"), 16 * PAGE);
    config.listen_addr = "127.0.0.1:0".parse().unwrap();
    config.metrics_addr = "127.0.0.1:0".parse().unwrap();
    config.page_size = PageSize::new(PAGE).unwrap();
    config.client_socket = root.path().join("run/client.sock");
    let node = tokio::time::timeout(WAIT, Node::start(config.clone()))
        .await
        .unwrap()
        .unwrap();
    let socket = node.config().client_socket.clone();
    assert_eq!(socket, config.client_socket);
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let monitor = node.local_clients().unwrap().clone();

    let client = tokio::task::spawn_blocking(move || {
        let mut stream = UnixStream::connect(&socket).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let hello = ClientMessage::Hello(Hello {
            version: local::PROTOCOL_VERSION,
            page_bytes: PAGE,
            host_bytes: 4 * PAGE,
        });
        send(&mut stream, &hello);
        let (_, welcome, fds) = read_frame(&mut stream).unwrap();
        let NodeMessage::Welcome(welcome) = welcome else {
            panic!("unexpected {welcome:?}");
        };
        assert_eq!(fds.len(), 1);
        assert_eq!(welcome.host_bytes, 4 * PAGE);
        // A spill is answered by the node's remote tier (stored, or refused for want of
        // peers: either way a done with the op's id).
        let spill = ClientMessage::Spill(PageOp {
            id: 42,
            page: PageId {
                buffer: BufferId(1),
                index: 0,
            },
            slot: 1,
            bytes: PAGE,
        });
        send(&mut stream, &spill);
        match read_frame(&mut stream).unwrap().1 {
            NodeMessage::Done(d) => assert_eq!(d.id, 42),
            other => panic!("unexpected {other:?}"),
        }
        stream
    })
    .await
    .unwrap();
    assert_eq!(node.clients().load(Ordering::Relaxed), 1);
    assert_eq!(monitor.counters().clients_accepted, 1);
    drop(client);
    tokio::time::timeout(WAIT, monitor.wait_until(|c| c.clients_connected == 0))
        .await
        .unwrap();
    assert_eq!(node.clients().load(Ordering::Relaxed), 0);
    tokio::time::timeout(WAIT, node.shutdown()).await.unwrap();
    assert!(!config.client_socket.exists());
}
