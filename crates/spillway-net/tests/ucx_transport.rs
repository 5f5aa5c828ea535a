//! The UCX transport on loopback passes the same round trip as QUIC and the simulated
//! transport (feature `ucx`). Run with
//! `UCX_NET_DEVICES=lo UCX_TLS=tcp,self cargo test -p spillway-net --features ucx --release`.
#![cfg(feature = "ucx")]

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::{page, round_trip, within};
use spillway_net::ucx::{UcxTransport, UcxWorkerConfig};
use spillway_net::{Connection, MemStore, NetError, QuicConfig, Server, Transport};
use spillway_types::{NodeId, PoolId};

const POOL: PoolId = PoolId(0x0c5_0001);
const WAIT: Duration = Duration::from_secs(60);

fn worker_config() -> UcxWorkerConfig {
    // The round trip gets 66 MiB of pages in one reply: slots take it and its header.
    UcxWorkerConfig {
        recv_slot_bytes: 80 << 20,
        recv_slots_count: 4,
        sends_in_flight_max: 16,
    }
}

async fn transport(pool: PoolId, node: u64) -> UcxTransport {
    transport_with(pool, node, &worker_config()).await
}

async fn transport_with(pool: PoolId, node: u64, config: &UcxWorkerConfig) -> UcxTransport {
    assert!(
        std::env::var_os("UCX_NET_DEVICES").is_some(),
        "set UCX_NET_DEVICES=lo (and UCX_TLS=tcp,self): UCX over TCP otherwise uses every interface"
    );
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    UcxTransport::bind(pool, NodeId(node), addr, &QuicConfig::default(), config)
        .await
        .expect("bind")
}

/// Node 1 of [`POOL`] serving a `MemStore` of 1024 pages, and node 2 to connect to it.
async fn server_and_client() -> (UcxTransport, Arc<MemStore>, Server, UcxTransport) {
    let server = transport(POOL, 1).await;
    let store = Arc::new(MemStore::new(1024));
    let serving = server.serve(store.clone()).expect("serve");
    let client = transport(POOL, 2).await;
    (server, store, serving, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_over_ucx() {
    let (server, store, serving, client) = server_and_client().await;
    let conn = within("connect", WAIT, client.connect(server.local_addr()))
        .await
        .expect("connect");
    assert_eq!(conn.peer(), NodeId(1));
    within("round trip", WAIT, round_trip(&conn)).await;
    assert_eq!(store.len(), 3);
    let c = client.stats().peer(NodeId(1)).expect("client counters");
    assert!(c.bytes_out > (68 << 20), "{c:?}");
    assert_eq!(c.frames_rejected, 0);
    assert_eq!(server.stats().connections_accepted(), 1);
    assert!(matches!(
        server.serve(store.clone()),
        Err(NetError::AlreadyServing)
    ));
    serving.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_over_ucx() {
    let (server, store, serving, client) = server_and_client().await;
    let conn = client.connect(server.local_addr()).await.expect("connect");
    let mut puts = Vec::new();
    for i in 0..32u32 {
        let conn = conn.clone();
        puts.push(tokio::spawn(async move {
            conn.put_pages(vec![page(5, i, 2 << 20)]).await
        }));
    }
    within("32 puts", WAIT, async {
        for p in puts {
            assert_eq!(p.await.expect("task").expect("put"), 1);
        }
    })
    .await;
    assert_eq!(store.len(), 32);
    let ids: Vec<_> = (0..32u32).map(|i| common::page_id(5, i)).collect();
    let (got, missing) = within("get 32", WAIT, conn.get_pages(ids))
        .await
        .expect("get");
    assert!(missing.is_empty());
    for (i, p) in got.iter().enumerate() {
        assert_eq!(*p, page(5, i as u32, 2 << 20), "page {i}");
    }
    serving.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_another_pool_is_refused() {
    let server = transport(POOL, 1).await;
    let serving = server.serve(Arc::new(MemStore::new(16))).expect("serve");
    let stranger = transport(PoolId(7), 9).await;
    match stranger.connect(server.local_addr()).await {
        Err(NetError::Connect { .. }) | Err(NetError::PoolMismatch { .. }) => {}
        other => panic!("expected a refusal, got {other:?}"),
    }
    serving.shutdown().await;
    assert_eq!(server.stats().handshakes_refused(), 1);
}

/// Connections introduced over another channel (as nodes do over QUIC): the server takes
/// requests for all of them through one set of receives, and idle connections must not
/// keep a busy one's requests from being taken; each client reads back what it stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn introduced_connections_share_the_receivers_and_idle_ones_starve_nobody() {
    let small = UcxWorkerConfig {
        recv_slot_bytes: 1 << 20,
        recv_slots_count: 4,
        sends_in_flight_max: 16,
    };
    let server = transport_with(POOL, 1, &small).await;
    let store = Arc::new(MemStore::new(1024));
    let serving = server.serve(store.clone()).expect("serve");
    // 4 clients, 3 of them idle after connecting.
    let mut clients = Vec::new();
    for node in 2..=5u64 {
        let client = transport_with(POOL, node, &small).await;
        let offer = client.offer();
        let answer = within("accept", WAIT, server.accept(NodeId(node), &offer.bytes()))
            .await
            .expect("accept");
        let conn = within("complete", WAIT, client.complete(NodeId(1), offer, &answer))
            .await
            .expect("complete");
        assert_eq!(conn.peer(), NodeId(1));
        clients.push((client, conn));
    }
    let (_, busy) = clients.last().unwrap();
    for i in 0..16u32 {
        let p = page(5, i, 64 << 10);
        let stored = within("put", WAIT, busy.put_pages(vec![p.clone()]))
            .await
            .expect("put");
        assert_eq!(stored, 1);
        let (got, missing) = within("get", WAIT, busy.get_pages(vec![p.id]))
            .await
            .expect("get");
        assert!(missing.is_empty());
        assert_eq!(got, vec![p]);
    }
    // An idle one still works afterwards.
    let (_, first) = &clients[0];
    let p = page(2, 0, 1000);
    assert_eq!(
        within("put", WAIT, first.put_pages(vec![p])).await.unwrap(),
        1
    );
    assert_eq!(store.len(), 17);
    // A request longer than the bound both sides share is refused before it is sent,
    // and the connection keeps working.
    let e = within("put", WAIT, busy.put_pages(vec![page(5, 99, 2 << 20)]))
        .await
        .unwrap_err();
    assert!(matches!(e, NetError::TooLarge { .. }), "{e}");
    let p = page(5, 100, 1000);
    assert_eq!(
        within("put", WAIT, busy.put_pages(vec![p])).await.unwrap(),
        1
    );
    assert_eq!(store.len(), 18);
    // A malformed introduction is refused with a reason, not a panic.
    let e = server.accept(NodeId(9), b"xy").await.unwrap_err();
    assert!(e.to_string().contains("introduction"), "{e}");
    drop(clients);
    serving.shutdown().await;
}
