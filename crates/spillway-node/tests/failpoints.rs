//! A node whose Raft log fails as on a full disk (the failpoint
//! `spillway-meta::storage::write` on that node's log only), in a pool of three in one
//! process: within a second `/status` and `/metrics` say it is unhealthy and why, its
//! proposals and reads fail with a typed error instead of waiting, the other two go on
//! committing; once writes succeed again it reopens its log, is healthy again and its
//! commit index catches up with the group's. A failed fsync (raft-engine panics on it)
//! stops the metadata group of the node for good, says so, and resolves `raft_failed`
//! (on which the daemon exits).
//!
//!
//! A proposer whose clock ran 20 minutes ahead (the failpoint
//! `spillway-node::meta::clock-ahead-ms`) stamps the group's clock forward; after it, spills
//! still go through (reservations are asked by the group's clock when it is ahead).
//!
//! Run: `cargo test --release -p spillway-node --features failpoints --test failpoints`.
//! Failpoints are global to the process: each test holds a `fail::FailScenario`, which
//! runs them one at a time and clears every failpoint when it ends.

mod common;

use std::time::{Duration, Instant};

use common::*;
use spillway_meta::{ReservationId, Update};
use spillway_node::ProposeFailure;

const PAGE: u64 = 64 << 10;
const WRITE: &str = "spillway-meta::storage::write";
const CLOCK_AHEAD: &str = "spillway-node::meta::clock-ahead-ms";
/// How soon a failure must show in `/status`.
const UNHEALTHY_WITHIN: Duration = Duration::from_secs(1);

/// A proposal that commits an entry and changes nothing (the reservation does not exist).
fn release(id: u64) -> Vec<Update> {
    vec![Update::Release {
        id: ReservationId(id),
    }]
}

fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_raft_disk_is_reported_at_once_and_the_node_recovers_when_space_returns() {
    let scenario = fail::FailScenario::setup();
    let pool = Pool::new("fullraft", PAGE, [64, 64, 64]);
    let (nodes, leader) = pool.start_settled().await;
    let lead = live_node(&nodes, |n| n == leader);
    let full = live_node(&nodes, |n| n != leader);
    let status = full.status();
    assert!(
        status.raft_healthy && status.raft_error.is_none(),
        "{status:?}"
    );
    assert!(full.metrics_text().contains("spillway_raft_healthy 1\n"));

    // The follower's disk fills up; the next entry it must append fails.
    let raft_dir = full.config().data_dir.join("raft");
    fail::cfg(WRITE, &format!("return({})", raft_dir.display())).unwrap();
    let failed_at = Instant::now();
    let committed_before = full.commit_index();
    within("a proposal of the leader", lead.propose(release(1)))
        .await
        .unwrap();
    let status = wait_for(
        "the node to say it is unhealthy",
        UNHEALTHY_WITHIN * 5,
        || {
            let s = full.status();
            (!s.raft_healthy).then_some(s)
        },
    )
    .await;
    let to_unhealthy = failed_at.elapsed();
    println!("unhealthy in /status after {to_unhealthy:?}");
    assert!(to_unhealthy < UNHEALTHY_WITHIN, "{to_unhealthy:?}");
    let cause = status.raft_error.clone().unwrap();
    assert!(cause.contains("StorageFull"), "{cause}");
    assert!(cause.contains(&raft_dir.display().to_string()), "{cause}");
    assert_eq!(status.known_leader(), None);
    let metrics = full.metrics_text();
    assert!(metrics.contains("spillway_raft_healthy 0\n"), "{metrics}");
    assert!(
        metrics_total(&metrics, "spillway_raft_storage_errors") >= 1,
        "{metrics}"
    );
    // The same over HTTP, as `spillway status` reads it.
    let over_http = status_over_http(full.metrics_addr()).await;
    assert_eq!(over_http["raft_healthy"], false, "{over_http}");
    assert!(
        over_http["raft_error"]
            .as_str()
            .unwrap()
            .contains("StorageFull"),
        "{over_http}"
    );

    // Its proposals and reads fail at once, with the cause.
    let t = Instant::now();
    match within("a proposal on the full node", full.propose(release(2))).await {
        Err(ProposeFailure::Degraded { cause }) => assert!(cause.contains("StorageFull")),
        other => panic!("{other:?}"),
    }
    match within(
        "a read on the full node",
        full.meta_read(|s| s.applied_index()),
    )
    .await
    {
        Err(ProposeFailure::Degraded { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );

    // The other two still commit; the full node stays unhealthy while it retries.
    for id in 3..6 {
        within("a proposal of the leader", lead.propose(release(id)))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let status = full.status();
    assert!(!status.raft_healthy, "{status:?}");
    assert!(lead.commit_index() > status.commit_index.max(committed_before));
    let errors_while_full = metrics_total(&full.metrics_text(), "spillway_raft_storage_errors");
    assert!(
        errors_while_full >= 2,
        "retries count too: {errors_while_full}"
    );

    // Space returns: the node reopens its log, is healthy again and catches up.
    fail::remove(WRITE);
    let freed_at = Instant::now();
    wait_for("the node to be healthy again", WAIT, || {
        let s = full.status();
        (s.raft_healthy && s.raft_error.is_none()).then_some(())
    })
    .await;
    let to_healthy = freed_at.elapsed();
    println!("healthy again after {to_healthy:?}");
    let target = lead.commit_index();
    wait_for("the node to catch up with the leader", WAIT, || {
        (full.commit_index() >= target && full.leader() == Some(leader)).then_some(())
    })
    .await;
    let caught_up = freed_at.elapsed();
    println!("caught up with the leader's commit index {target} after {caught_up:?}");
    let metrics = full.metrics_text();
    assert!(metrics.contains("spillway_raft_healthy 1\n"), "{metrics}");
    assert_eq!(
        metrics_total(&metrics, "spillway_raft_storage_recoveries"),
        1,
        "{metrics}"
    );
    // It takes part again: its own proposal commits, and its commit index follows.
    within("a proposal of the recovered node", full.propose(release(7)))
        .await
        .unwrap();
    let target = lead.commit_index();
    wait_for("the next commit on the recovered node", WAIT, || {
        (full.commit_index() >= target).then_some(())
    })
    .await;
    shutdown_all(nodes).await;
    scenario.teardown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fsync_stops_the_metadata_group_for_good_and_says_so() {
    let scenario = fail::FailScenario::setup();
    let pool = Pool::new("fsync", PAGE, [64, 64, 64]);
    let (nodes, leader) = pool.start_settled().await;
    let lead = live_node(&nodes, |n| n == leader);
    // Every log in this process fails its next fsync (raft-engine's own failpoint), and
    // raft-engine panics on it: reopening could trust what the disk lost.
    fail::cfg("log_fd::sync::err", "return").unwrap();
    let failed_at = Instant::now();
    let outcome = within("a proposal of the leader", lead.propose(release(1))).await;
    assert!(
        matches!(outcome, Err(ProposeFailure::Stopped)),
        "{outcome:?}"
    );
    within("the Raft thread to stop for good", lead.raft_failed()).await;
    let to_failed = failed_at.elapsed();
    println!("stopped for good after {to_failed:?}");
    assert!(to_failed < UNHEALTHY_WITHIN, "{to_failed:?}");
    let status = lead.status();
    assert!(!status.raft_healthy, "{status:?}");
    let cause = status.raft_error.unwrap();
    assert!(
        cause.contains("fsync") && cause.contains("restart the node"),
        "{cause}"
    );
    assert!(!lead.meta_view().running);
    let metrics = lead.metrics_text();
    assert!(metrics.contains("spillway_raft_healthy 0\n"), "{metrics}");
    assert!(matches!(
        within("a later proposal", lead.propose(release(2))).await,
        Err(ProposeFailure::Stopped)
    ));
    fail::remove("log_fd::sync::err");
    shutdown_all(nodes).await;
    scenario.teardown();
}

fn metrics_total(text: &str, name: &str) -> u64 {
    metric(text, &format!("{name}_total")).unwrap_or_else(|| panic!("{name} missing"))
}

/// `/status` over HTTP as JSON (what `spillway status` parses).
/// Found by `spillway chaos sim`'s clock faults: one proposer's clock minutes ahead moved
/// the group's clock forward, and every other node asked for reservations by its own
/// clock, which expired on arrival ("expiry is not after the group clock") until real
/// time caught up: no spill went through for as long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spills_go_on_after_a_proposer_stamped_the_group_clock_minutes_ahead() {
    const AHEAD_MS: u64 = 20 * 60_000;
    let scenario = fail::FailScenario::setup();
    let pool = Pool::new("clockahead", PAGE, [64, 64, 64]);
    let (nodes, leader) = pool.start_settled().await;
    let spiller = live_node(&nodes, |n| n != leader);
    // Every batch proposed while the failpoint is on is stamped 20 minutes ahead.
    fail::cfg(CLOCK_AHEAD, &format!("return({AHEAD_MS})")).unwrap();
    within("a proposal with a clock ahead", spiller.propose(release(1)))
        .await
        .unwrap();
    fail::remove(CLOCK_AHEAD);
    let ahead = spillway_node::now_ms() + AHEAD_MS / 2;
    wait_for(
        "the group's clock ahead on every node",
        Duration::from_secs(10),
        || {
            nodes
                .iter()
                .flatten()
                .all(|n| n.meta_view().clock_ms > ahead)
                .then_some(())
        },
    )
    .await;
    // Every node's own clock is now 20 minutes behind the group's.
    let pages = patterned_pages(4, 6, 5, PAGE);
    within(
        "a spill after the clock jump",
        spiller.remote().spill(2, pages.clone()),
    )
    .await
    .expect("reservations asked by the group's clock");
    let ids: Vec<_> = pages.iter().map(|(id, _)| *id).collect();
    let back = within("a fetch", spiller.remote().fetch(2, ids))
        .await
        .unwrap();
    assert_eq!(
        back,
        pages.into_iter().map(|(_, b)| b).collect::<Vec<_>>(),
        "the pages' bytes"
    );
    scenario.teardown();
    shutdown_all(nodes).await;
}

async fn status_over_http(addr: std::net::SocketAddr) -> serde_json::Value {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = within("connect", tokio::net::TcpStream::connect(addr))
        .await
        .unwrap();
    s.write_all(b"GET /status HTTP/1.1\r\n\r\n").await.unwrap();
    let mut reply = String::new();
    within("read", s.read_to_string(&mut reply)).await.unwrap();
    let body = reply.split("\r\n\r\n").nth(1).unwrap();
    serde_json::from_str(body).unwrap()
}
