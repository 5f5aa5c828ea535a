//! The simulated transport passes the same round trip as QUIC, and refuses what QUIC refuses.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{page, round_trip, within};
use spillway_net::sim::{SimNetwork, SimTransport};
use spillway_net::{Connection, MemStore, NetError, QuicConfig, Server, Transport};
use spillway_types::wire::{self, FrameHeader, Kind};
use spillway_types::{NodeId, PoolId};

const POOL: PoolId = PoolId(42);

#[tokio::test]
async fn round_trip_over_the_simulated_transport() {
    let net = SimNetwork::new();
    let config = QuicConfig::default();
    let server = net.transport(POOL, NodeId(1), &config);
    let store = Arc::new(MemStore::new(1024));
    let serving = server.serve(store.clone()).unwrap();
    let client = net.transport(POOL, NodeId(2), &config);
    let conn = client.connect(server.local_addr()).await.unwrap();
    assert_eq!(conn.peer(), NodeId(1));
    within("round trip", Duration::from_secs(60), round_trip(&conn)).await;
    assert_eq!(store.len(), 3);
    let c = client.stats().peer(NodeId(1)).unwrap();
    let s = server.stats().peer(NodeId(2)).unwrap();
    assert_eq!((c.bytes_out, c.bytes_in), (s.bytes_in, s.bytes_out));
    assert!(c.bytes_out > (68 << 20));

    // A node that is down or shut down answers no more.
    net.set_down(server.local_addr(), true);
    assert!(matches!(
        conn.put_pages(vec![page(4, 0, 10)]).await.unwrap_err(),
        NetError::ConnectionLost { .. }
    ));
    net.set_down(server.local_addr(), false);
    assert_eq!(conn.put_pages(vec![page(4, 0, 10)]).await.unwrap(), 1);
    serving.shutdown().await;
    assert!(client.connect(server.local_addr()).await.is_err());
}

/// A network with node 1 of [`POOL`] serving a small `MemStore`, and the config its
/// other transports take.
fn node_1_serving() -> (SimNetwork, QuicConfig, SimTransport, Server) {
    let net = SimNetwork::new();
    let config = QuicConfig::default();
    let server = net.transport(POOL, NodeId(1), &config);
    let serving = server.serve(Arc::new(MemStore::new(8))).unwrap();
    (net, config, server, serving)
}

#[tokio::test]
async fn a_node_of_another_pool_is_refused() {
    let (net, config, server, _serving) = node_1_serving();
    let stranger = net.transport(PoolId(7), NodeId(9), &config);
    let err = stranger.connect(server.local_addr()).await.unwrap_err();
    assert!(matches!(err, NetError::Connect { .. }), "{err}");
    assert_eq!(server.stats().handshakes_refused(), 1);
}

#[tokio::test]
async fn bad_frames_close_the_connection_and_are_counted() {
    let (net, config, server, _serving) = node_1_serving();
    let good = net
        .transport(POOL, NodeId(2), &config)
        .connect(server.local_addr())
        .await
        .unwrap();
    let bad_node = net.transport(POOL, NodeId(3), &config);

    let oversized = FrameHeader {
        kind: Kind::GetPages,
        request_id: 1,
        body_bytes: wire::FRAME_BODY_BYTES_MAX + 1,
        payload_bytes: 0,
    }
    .encode();
    for (i, frame) in [
        Bytes::from_static(b"garbage garbage garbage garbage!!"),
        Bytes::copy_from_slice(&oversized),
    ]
    .into_iter()
    .enumerate()
    {
        let bad = bad_node.connect(server.local_addr()).await.unwrap();
        assert!(bad.send_raw(frame).await.is_err());
        // The connection is closed for good.
        assert!(matches!(
            bad.put_pages(vec![page(3, 0, 10)]).await.unwrap_err(),
            NetError::ConnectionLost { .. }
        ));
        assert_eq!(
            server.stats().peer(NodeId(3)).unwrap().frames_rejected,
            i as u64 + 1
        );
    }
    assert_eq!(good.put_pages(vec![page(2, 0, 10)]).await.unwrap(), 1);
    assert_eq!(server.stats().peer(NodeId(2)).unwrap().frames_rejected, 0);
}
