//! Three nodes of one pool in one process, on loopback: they elect a leader over QUIC; a
//! spill from one node lands on its peers by free capacity and comes back byte for byte;
//! the directory entries are committed on every node; discard frees the peers' bytes;
//! shutting the leader down elects another within a second (it hands leadership over),
//! and the node restarts from its data directory and catches up; a leader that crashes
//! (its handle dropped) is replaced after an election timeout; bad config fields are named; malformed Raft frames
//! close only their connection, are counted, and the node keeps serving; `/status` and
//! `/metrics` answer. Real time, but every wait polls a condition with a deadline.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use spillway_meta::Role;
use spillway_net::{Connection, Request, Response};
use spillway_node::remote::remote_page_id;
use spillway_node::{Node, NodeError, NodeHandle, PageTransport, RemoteError};
use spillway_types::wire::{self, ErrorCode};
use spillway_types::{NodeId, PageId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PAGE: u64 = 64 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_elect_spill_fetch_and_discard() {
    let pool = Pool::new("spill", PAGE, [256, 256, 256]);
    let (nodes, leader) = pool.start_settled().await;
    assert!((1..=3).contains(&leader.0));
    let n1 = nodes[0].as_ref().unwrap();
    let remote = n1.remote();
    // Two peers lending 256 pages each, two copies of every page (replicas = 2).
    assert_eq!(n1.config().replicas, 2);
    assert_eq!(remote.capacity_bytes(), 256 * PAGE);

    // Two buffers of client 5, the last page short.
    let mut pages = Vec::new();
    for b in 1..=2u64 {
        for i in 0..20u32 {
            let len = if i == 19 { 1000 } else { PAGE };
            pages.push((page_id(b, i), page_bytes(b * 100 + u64::from(i), len)));
        }
    }
    within("spill", remote.spill(5, pages.clone()))
        .await
        .unwrap();

    // The pages travelled on the transport the pool was set to.
    let total: u64 = pages.iter().map(|(_, d)| d.len() as u64).sum();
    let page_bytes_out = n1.page_net_stats().total().bytes_out;
    assert!(page_bytes_out >= total, "{page_bytes_out} < {total}");
    assert_eq!(n1.page_transport(), test_transport().name());
    if test_transport() == PageTransport::Ucx {
        assert!(n1.net_stats().total().bytes_out < total);
    }

    // On peers, never on node 1 itself, and all of it twice: one copy on each peer.
    let held_by = |i: usize| nodes[i].as_ref().unwrap().store().used_bytes_of(NodeId(1));
    assert_eq!(held_by(0), 0);
    assert_eq!((held_by(1), held_by(2)), (total, total));
    assert!(
        held_by(1) > 0 && held_by(2) > 0,
        "both peers hold some: {} {}",
        held_by(1),
        held_by(2)
    );

    // Every byte back, in the order asked (reversed here).
    let wanted: Vec<PageId> = pages.iter().rev().map(|(id, _)| *id).collect();
    let back = within("fetch", remote.fetch(5, wanted)).await.unwrap();
    for ((_, sent), got) in pages.iter().rev().zip(&back) {
        assert!(sent == got, "a page came back different");
    }
    // Spilled counts copies (two per page), fetched pages (each read once).
    let c = remote.counters();
    assert_eq!((c.pages_spilled, c.pages_fetched), (80, 40));
    assert_eq!((c.bytes_out, c.bytes_in), (2 * total, total));
    assert_eq!(
        c.per_peer.values().map(|p| p.pages_spilled).sum::<u64>(),
        80
    );

    // The directory entries are committed and applied on every node.
    let ids: Vec<PageId> = pages
        .iter()
        .map(|(id, _)| remote_page_id(NodeId(1), 5, *id))
        .collect();
    for n in nodes.iter().flatten() {
        let ids = ids.clone();
        let holders = wait_for_async(|| async {
            let ids = ids.clone();
            let h = n
                .meta_read(move |s| {
                    ids.iter()
                        .map(|id| s.holder_of(*id).map(|(_, h)| h.node))
                        .collect::<Vec<_>>()
                })
                .await
                .unwrap();
            h.iter().all(Option::is_some).then_some(h)
        })
        .await;
        assert!(
            holders.iter().all(|h| matches!(h, Some(NodeId(2 | 3)))),
            "{holders:?}"
        );
    }
    // The members' used bytes count whole pages, of both copies.
    let used: u64 = n1.members().iter().map(|m| m.used_bytes).sum();
    assert_eq!(used, 80 * PAGE);

    // An unknown page is not found; discard ignores it.
    let err = remote.fetch(5, vec![page_id(9, 0)]).await.unwrap_err();
    assert!(matches!(err, RemoteError::NotFound { .. }), "{err}");
    within(
        "discard",
        remote.discard(
            5,
            pages
                .iter()
                .map(|(id, _)| *id)
                .chain([page_id(9, 9)])
                .collect(),
        ),
    )
    .await
    .unwrap();
    assert_eq!(held_by(1) + held_by(2), 0);
    wait_for("the directory to drop the entries", WAIT, || {
        nodes
            .iter()
            .flatten()
            .all(|n| n.members().iter().all(|m| m.used_bytes == 0))
            .then_some(())
    })
    .await;
    let err = remote.fetch(5, vec![page_id(1, 0)]).await.unwrap_err();
    assert!(matches!(err, RemoteError::NotFound { .. }), "{err}");
    shutdown_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_follows_free_capacity() {
    // Node 2 lends 64 pages, node 3 only 16.
    let mut pool = Pool::new("placement", PAGE, [64, 64, 16]);
    pool.configs[1].lend_bytes = 64 * PAGE;
    // One copy per page: where the pages go is the room of each peer alone.
    pool.configs[0].replicas = 1;
    let (nodes, _) = pool.start_settled().await;
    let n1 = nodes[0].as_ref().unwrap();
    let remote = n1.remote();
    assert_eq!(remote.capacity_bytes(), 80 * PAGE);
    let pages = patterned_pages(1, 60, 0, PAGE);
    within("spill", remote.spill(1, pages)).await.unwrap();
    let on2 = nodes[1].as_ref().unwrap().store().used_bytes_of(NodeId(1)) / PAGE;
    let on3 = nodes[2].as_ref().unwrap().store().used_bytes_of(NodeId(1)) / PAGE;
    assert_eq!(on2 + on3, 60);
    assert!(
        on2 >= 44 && on3 <= 16,
        "node 2 has {on2} pages, node 3 {on3}"
    );
    // What is left: 20 pages; 30 more do not fit anywhere and nothing moves.
    let more = patterned_pages(2, 30, 0, PAGE);
    let err = within("spill over capacity", remote.spill(1, more))
        .await
        .unwrap_err();
    assert!(
        matches!(err, RemoteError::NoRoom { requested_bytes, .. } if requested_bytes == 30 * PAGE),
        "{err}"
    );
    assert_eq!(remote.counters().errors, 1);
    shutdown_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_and_catches_up_after_restart() {
    // One copy per page: the killed node's pages are lost with it (what this test
    // checks of the directory); replicas are sim_pool's and the peer-death tests'.
    let pool = Pool::new("failover", PAGE, [128, 128, 128]).one_copy();
    let (mut nodes, leader) = pool.start_settled().await;
    let li = (leader.0 - 1) as usize;
    // Spill from a node that is not the leader, so its pages stay reachable.
    let si = (li + 1) % 3;
    let spiller = nodes[si].as_ref().unwrap();
    // Every node's first incarnation is recorded (epoch 2), so a later epoch is a restart.
    wait_for("the first incarnations", WAIT, || {
        spiller
            .meta_view()
            .members
            .iter()
            .all(|m| m.epoch == spillway_meta::Epoch(2))
            .then_some(())
    })
    .await;
    let pages = patterned_pages(3, 8, 77, PAGE);
    within("spill", spiller.remote().spill(2, pages.clone()))
        .await
        .unwrap();
    let spiller_id = spiller.node_id();
    let term = spiller.term();
    // Where the pages went, once the spiller has applied its placements.
    let holders_before = wait_for_async(|| async {
        let h = holders_of(spiller, spiller_id, &pages).await;
        h.iter().all(Option::is_some).then_some(h)
    })
    .await;
    let epoch_before = spiller
        .meta_view()
        .members
        .iter()
        .find(|m| m.id.0 == li as u64 + 1)
        .unwrap()
        .epoch;

    // Kill the leader.
    let killed = nodes[li].take().unwrap();
    let t0 = Instant::now();
    within("shutdown the leader", killed.shutdown()).await;
    let elected = new_leader_elected(&nodes, leader, term, t0, "was shut down").await;
    assert!(
        elected < Duration::from_secs(1),
        "election took {elected:?}"
    );

    // The group still commits: a proposal through the remaining nodes.
    let more = patterned_pages(4, 4, 5, PAGE);
    let spiller = nodes[si].as_ref().unwrap();
    // Only one peer is left: it takes everything it has room for.
    within("spill after fail-over", spiller.remote().spill(2, more))
        .await
        .unwrap();

    // Restart the killed node from its data directory: it catches up.
    nodes[li] = Some(pool.restart(li).await);
    let restarted = nodes[li].as_ref().unwrap();
    let target = nodes[si].as_ref().unwrap().commit_index();
    wait_for("the restarted node to catch up", WAIT, || {
        (restarted.commit_index() >= target && restarted.meta_view().applied_index >= target)
            .then_some(())
    })
    .await;
    // The restarted node lost its RAM: once its new incarnation is recorded, the directory
    // names it for none of the pages it held, and still names the survivor for its own.
    let killed_id = NodeId(li as u64 + 1);
    wait_for("the restarted node's new incarnation", WAIT, || {
        let before = epoch_before;
        restarted
            .meta_view()
            .members
            .iter()
            .any(|m| m.id == killed_id && m.epoch > before)
            .then_some(())
    })
    .await;
    let after = holders_of(restarted, spiller_id, &pages).await;
    for (b, a) in holders_before.iter().zip(&after) {
        if *b == Some(killed_id) {
            assert_eq!(*a, None, "a page of the killed node's RAM is still listed");
        } else {
            assert_eq!(a, b, "a page on a surviving node moved");
        }
    }
    shutdown_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_stops_waiting_for_a_dead_holder_once_the_pool_declares_it_down() {
    // One copy per page. The fetch of a page whose holder died waits for the holder only
    // until the pool declares it down (2 s after a leader hears nothing), not for the
    // whole peer grace (30 s, more than `within` allows): a member declared down comes
    // back at a new epoch, with every copy it held dead, so waiting saves nothing.
    let pool = Pool::new("downgrace", PAGE, [64, 64, 64]).one_copy();
    let (mut nodes, _) = pool.start_settled().await;
    let spiller = nodes[0].as_ref().unwrap();
    let origin = spiller.node_id();
    let pages = patterned_pages(6, 4, 31, PAGE);
    within("spill", spiller.remote().spill(2, pages.clone()))
        .await
        .unwrap();
    let holder =
        wait_for_async(|| async { holders_of(spiller, origin, &pages[..1]).await[0] }).await;
    assert_ne!(holder, origin);
    let killed = nodes[(holder.0 - 1) as usize].take().unwrap();
    within("shutdown the holder", killed.shutdown()).await;
    let spiller = nodes[0].as_ref().unwrap();
    let t = Instant::now();
    let err = within(
        "a fetch of a page whose holder died",
        spiller.remote().fetch(2, vec![pages[0].0]),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, RemoteError::PeerUnreachable { .. }), "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    let declared = spiller
        .meta_view()
        .members
        .iter()
        .any(|m| m.id == holder && m.state == spillway_meta::MemberState::Down);
    assert!(declared, "it failed once the holder was declared down");
    shutdown_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_config_fields_are_named_at_start() {
    let pool = Pool::new("badconfig", PAGE, [16, 16, 16]);
    let mut c = pool.configs[0].clone();
    c.members.retain(|m| m.id != NodeId(1));
    let err = Node::start(c).await.unwrap_err();
    match &err {
        NodeError::Config(e) => assert_eq!(e.field(), Some("members"), "{err}"),
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("`members`"), "{err}");
    let mut c = pool.configs[0].clone();
    c.election_ticks_max = c.election_ticks;
    let err = Node::start(c).await.unwrap_err();
    assert!(err.to_string().contains("`election_ticks_max`"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_raft_frames_are_refused_and_counted_and_the_node_keeps_serving() {
    let pool = Pool::new("badraft", PAGE, [64, 64, 64]);
    let (nodes, _) = pool.start_settled().await;
    let n1 = nodes[0].as_ref().unwrap();
    let n3 = nodes[2].as_ref().unwrap();
    let before = n1.counters();

    // 1. A Raft frame whose blob fails its checksum: the connection is closed, counted.
    let conn = within("connect", n3.connect(n1.local_addr()))
        .await
        .unwrap();
    let data = vec![1u8; 64];
    let mut blob = wire::Blob::describe(&data);
    blob.chunks[0].checksum ^= 1;
    let mut frame = wire::encode_frame(1, &wire::Message::RaftMessage(blob)).unwrap();
    frame.extend_from_slice(&data);
    for lane in conn.lanes() {
        send_until_closed(lane, &frame).await;
    }
    wait_for("the bad frames to be counted", WAIT, || {
        (n1.counters().frames_rejected > before.frames_rejected).then_some(())
    })
    .await;

    // 2. An oversized Raft frame header: refused before reading, counted.
    let conn = within("connect", n3.connect(n1.local_addr()))
        .await
        .unwrap();
    let header = wire::FrameHeader {
        kind: wire::Kind::RaftMessage,
        request_id: 1,
        body_bytes: 1,
        payload_bytes: wire::RAFT_PAYLOAD_BYTES_MAX + 1,
    };
    let rejected = n1.counters().frames_rejected;
    send_until_closed(conn.quinn(), &header.encode()).await;
    wait_for("the oversized frame to be counted", WAIT, || {
        (n1.counters().frames_rejected > rejected).then_some(())
    })
    .await;

    // 3. Sound frames whose blobs do not decode, or a message with a forged sender: an
    //    error reply, counted, and the connection stays.
    let conn = within("connect", n3.connect(n1.local_addr()))
        .await
        .unwrap();
    let forged = spillway_meta::RaftMessage {
        from: 2,
        to: 1,
        ..Default::default()
    };
    let bad = [
        Request::Raft {
            message: Bytes::from_static(&[0xff; 16]),
        },
        Request::Raft {
            message: spillway_meta::wire::encode_message(&forged).into(),
        },
        Request::Propose {
            batch: Bytes::from_static(&[0xff; 16]),
        },
    ];
    for request in bad {
        let err = conn.request(request).await.unwrap();
        assert!(
            matches!(err, Response::Error(ref e) if e.code == ErrorCode::BadRequest),
            "{err:?}"
        );
    }
    assert_eq!(
        n1.counters().peer_requests_refused,
        before.peer_requests_refused + 3
    );
    // The same connection still carries pages.
    let p = spillway_net::Page::new(page_id(1, 0), page_bytes(1, 100));
    assert_eq!(conn.put_pages(vec![p]).await.unwrap(), 1);

    // The pool still works: a spill from node 1 commits.
    let pages = vec![(page_id(1, 0), page_bytes(3, PAGE))];
    within("spill", n1.remote().spill(1, pages)).await.unwrap();
    shutdown_all(nodes).await;
}

/// Writes `bytes` on a new stream of `lane` and waits for the node to close the lane.
async fn send_until_closed(lane: &quinn::Connection, bytes: &[u8]) {
    let (mut send, _recv) = lane.open_bi().await.unwrap();
    let _ = send.write_all(bytes).await;
    let _ = send.finish();
    within("the node to close the lane", lane.closed()).await;
}

async fn http_get(addr: SocketAddr, request: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_metrics_answer_over_http() {
    let pool = Pool::new("http", PAGE, [64, 64, 64]);
    let (nodes, leader) = pool.start_settled().await;
    let n2 = nodes[1].as_ref().unwrap();
    n2.clients()
        .fetch_add(2, std::sync::atomic::Ordering::Relaxed);
    let addr = n2.metrics_addr();
    let reply = within(
        "GET /status",
        http_get(addr, "GET /status HTTP/1.1\r\nHost: x\r\n\r\n"),
    )
    .await;
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    let body = reply.split("\r\n\r\n").nth(1).unwrap();
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["node_id"], 2);
    assert_eq!(v["leader"], leader.0);
    assert_eq!(v["addr"], n2.local_addr().to_string());
    assert_eq!(v["metrics_addr"], addr.to_string());
    assert_eq!(v["members"].as_array().unwrap().len(), 3);
    assert_eq!(v["members"][1]["capacity_bytes"], 64 * PAGE);
    assert_eq!(v["members"][1]["state"], "up");
    assert_eq!(v["host_tier"]["budget_bytes"], 64 * PAGE);
    assert_eq!(v["clients"], 2);
    for key in [
        "pool_id",
        "role",
        "term",
        "commit_index",
        "remote",
        "peer_bytes_in",
        "peer_bytes_out",
        "frames_rejected",
    ] {
        assert!(v.get(key).is_some(), "{key} missing in {body}");
    }
    let typed: spillway_node::NodeStatus = serde_json::from_str(body).unwrap();
    assert_eq!(typed.node_id, 2);

    let reply = within(
        "GET /metrics",
        http_get(addr, "GET /metrics HTTP/1.1\r\n\r\n"),
    )
    .await;
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    assert!(
        reply.contains(&format!("spillway_raft_leader {}", leader.0)),
        "{reply}"
    );
    assert!(reply.contains("spillway_raft_term "), "{reply}");
    assert!(reply.contains("spillway_clients 2\n"), "{reply}");
    assert!(
        reply.contains("# TYPE spillway_host_tier_hits counter"),
        "{reply}"
    );
    assert!(
        reply.contains("spillway_host_tier_budget_bytes "),
        "{reply}"
    );
    // Node 2 hears from the leader, or (leading) from node 1.
    let heard = if leader.0 == 2 { 1 } else { leader.0 };
    assert!(
        reply.contains(&format!(
            "spillway_peer_bytes_total{{peer=\"{heard}\",direction=\"in\"}}"
        )),
        "{reply}"
    );

    let reply = within("GET /nope", http_get(addr, "GET /nope HTTP/1.1\r\n\r\n")).await;
    assert!(reply.starts_with("HTTP/1.1 404"), "{reply}");
    let reply = within("POST", http_get(addr, "POST /status HTTP/1.1\r\n\r\n")).await;
    assert!(reply.starts_with("HTTP/1.1 405"), "{reply}");
    let huge = format!("GET /status HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
    let reply = within("oversized head", http_get(addr, &huge)).await;
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    shutdown_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_releases_the_pages_its_gone_clients_spilled() {
    // Regression: a node that died kept its clients' pages listed and held on the peers
    // for good (its clients went with it; a restarted node reuses client numbers).
    let pool = Pool::new("refetch", PAGE, [64, 64, 64]);
    let (mut nodes, _) = pool.start_settled().await;
    let pages = patterned_pages(6, 12, 900, PAGE);
    let n1 = nodes[0].as_ref().unwrap();
    within("spill", n1.remote().spill(3, pages.clone()))
        .await
        .unwrap();
    let held = |nodes: &[Option<NodeHandle>]| -> u64 {
        nodes[1..]
            .iter()
            .flatten()
            .map(|n| n.store().used_bytes_of(NodeId(1)))
            .sum()
    };
    // Two copies of each page, one on each peer.
    assert_eq!(held(&nodes), 2 * 12 * PAGE);
    // Node 1 goes away with its clients and comes back.
    let n1 = nodes[0].take().unwrap();
    within("shutdown node 1", n1.shutdown()).await;
    nodes[0] = Some(pool.restart(0).await);
    settled(&nodes).await;
    // Its earlier clients' pages leave the directory and the peers.
    let n2 = nodes[1].as_ref().unwrap();
    let ids: Vec<PageId> = pages
        .iter()
        .map(|(id, _)| remote_page_id(NodeId(1), 3, *id))
        .collect();
    wait_for_async(|| {
        let ids = ids.clone();
        async move {
            let listed = n2
                .meta_read(move |s| ids.iter().filter(|id| s.holder_of(**id).is_some()).count())
                .await
                .unwrap();
            (listed == 0).then_some(())
        }
    })
    .await;
    wait_for("the peers to drop node 1's earlier pages", WAIT, || {
        (held(&nodes) == 0).then_some(())
    })
    .await;
    // A new client of the restarted node with the same number spills the same page ids:
    // they are its own, and come back byte for byte.
    let n1 = nodes[0].as_ref().unwrap();
    let fresh = patterned_pages(6, 4, 5000, PAGE);
    within("spill again", n1.remote().spill(3, fresh.clone()))
        .await
        .unwrap();
    let back = within(
        "fetch",
        n1.remote()
            .fetch(3, fresh.iter().map(|(id, _)| *id).collect()),
    )
    .await
    .unwrap();
    for ((_, sent), got) in fresh.iter().zip(&back) {
        assert!(sent == got, "a page came back different");
    }
    shutdown_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_handle_does_not_hang_and_its_directory_reopens() {
    let pool = Pool::new("drop", PAGE, [16, 16, 16]);
    let mut alone = pool.configs[0].clone();
    alone.members.clear();
    let node = within("start", Node::start(alone.clone())).await.unwrap();
    wait_for("a pool of one to elect itself", WAIT, || {
        (node.role() == Role::Leader).then_some(())
    })
    .await;
    let t0 = Instant::now();
    drop(node);
    assert!(
        t0.elapsed() < Duration::from_millis(100),
        "drop took {:?}",
        t0.elapsed()
    );
    // The Raft thread lets go of the log within a tick or so: the node starts again.
    let again = wait_for_async(|| async { Node::start(alone.clone()).await.ok() }).await;
    wait_for("the restarted node to lead again", WAIT, || {
        (again.role() == Role::Leader).then_some(())
    })
    .await;
    within("shutdown", again.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_proposal_is_forwarded_and_each_update_answered() {
    use spillway_meta::{ReservationId, Update};
    use spillway_node::Outcome;
    let pool = Pool::new("forward", PAGE, [32, 32, 32]);
    let (nodes, leader) = pool.start_settled().await;
    let follower = live_node(&nodes, |n| n != leader);
    let target = live_node(&nodes, |n| n != follower.node_id()).node_id();
    let expires_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 60_000;
    let reserve = |id, bytes| Update::Reserve {
        id: ReservationId(id),
        node: target,
        bytes,
        expires_at_ms,
    };
    let forwarded_before = follower.counters().proposals_forwarded;
    let outcomes = within(
        "propose",
        follower.propose(vec![
            reserve(1, 4 * PAGE),
            reserve(2, 1000 * PAGE),
            reserve(1, PAGE),
        ]),
    )
    .await
    .unwrap();
    assert_eq!(outcomes.len(), 3);
    assert_eq!(outcomes[0], Outcome::Accepted);
    match &outcomes[1] {
        Outcome::Rejected { reason } => assert!(reason.contains("bytes free"), "{reason}"),
        other => panic!("{other:?}"),
    }
    match &outcomes[2] {
        Outcome::Rejected { reason } => assert!(reason.contains("already exists"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(follower.counters().proposals_forwarded > forwarded_before);
    // Applied on the follower too, soon after.
    wait_for(
        "the reservation to be applied on the follower",
        WAIT,
        || {
            follower
                .members()
                .iter()
                .any(|m| m.id == target && m.reserved_bytes == 4 * PAGE)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        within("empty", follower.propose(Vec::new())).await.unwrap(),
        vec![]
    );
    shutdown_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_leader_is_replaced_after_an_election_timeout() {
    let pool = Pool::new("crash", PAGE, [16, 16, 16]);
    let (mut nodes, leader) = pool.start_settled().await;
    let li = (leader.0 - 1) as usize;
    let term = nodes[(li + 1) % 3].as_ref().unwrap().term();
    // Dropping the handle stops it without the graceful hand-over: the others must notice
    // the missing heartbeats (election timeout 5..8 ticks of 100 ms).
    let t0 = Instant::now();
    drop(nodes[li].take());
    let elected = new_leader_elected(&nodes, leader, term, t0, "crashed").await;
    // 0.5-0.8 s of election timeout, plus a second round when the first vote splits.
    assert!(
        elected < Duration::from_secs(2),
        "election took {elected:?}"
    );
    shutdown_all(nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_spills_share_raft_entries() {
    let mut pool = Pool::new("concurrent", PAGE, [256, 256, 256]);
    for c in &mut pool.configs {
        c.reserve_chunk_bytes = 64 * PAGE;
    }
    let (nodes, _) = pool.start_settled().await;
    let n1 = nodes[0].as_ref().unwrap();
    let remote = n1.remote();
    // Reserve once, so the spills below need only their placements.
    within(
        "first spill",
        remote.spill(1, vec![(page_id(100, 0), page_bytes(1, PAGE))]),
    )
    .await
    .unwrap();
    let before = n1.commit_index();
    const SPILLS: u32 = 32;
    let mut set = tokio::task::JoinSet::new();
    for b in 0..SPILLS {
        let remote = remote.clone();
        set.spawn(async move {
            let pages = vec![(page_id(u64::from(b) + 1, 0), page_bytes(u64::from(b), PAGE))];
            remote.spill(1, pages).await
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap().unwrap();
    }
    let entries = n1.commit_index() - before;
    println!("{SPILLS} concurrent spills took {entries} Raft entries");
    assert!(
        entries < u64::from(SPILLS),
        "{entries} entries for {SPILLS} spills"
    );
    let ids: Vec<PageId> = (0..SPILLS).map(|b| page_id(u64::from(b) + 1, 0)).collect();
    let back = within("fetch", remote.fetch(1, ids)).await.unwrap();
    for (b, got) in back.iter().enumerate() {
        assert!(
            *got == page_bytes(b as u64, PAGE),
            "spill {b} came back different"
        );
    }
    shutdown_all(nodes).await;
}

/// The directory's holder of each of `pages` (client 2 of `origin`), as `node` applied it.
async fn holders_of(
    node: &NodeHandle,
    origin: NodeId,
    pages: &[(PageId, Bytes)],
) -> Vec<Option<NodeId>> {
    let ids: Vec<PageId> = pages
        .iter()
        .map(|(id, _)| remote_page_id(origin, 2, *id))
        .collect();
    node.meta_read(move |s| {
        ids.iter()
            .map(|id| s.holder_of(*id).map(|(_, h)| h.node))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap()
}
