//! `/status` queries against test servers that speak the schema, and against nodes that
//! do not answer, answer too much or answer nonsense.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use spillway_cluster::http::{self, HttpError, RESPONSE_BYTES_MAX};
use spillway_cluster::{StatusError, fetch_status, query_pool};

/// A server that answers every connection with `response` (after reading the request).
fn serve(response: Vec<u8>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(&response);
        }
    });
    addr
}

fn status_json(id: u64, role: &str, leader: u64, term: u64) -> String {
    format!(
        r#"{{"node_id":{id},"pool_id":"00000000000000ab","addr":"127.0.0.1:700{id}","metrics_addr":"127.0.0.1:900{id}","role":"{role}","leader":{leader},"term":{term},"commit_index":120,"members":[{{"id":1,"addr":"127.0.0.1:7001","state":"up","capacity_bytes":1000,"used_bytes":10,"reserved_bytes":5}},{{"id":2,"addr":"127.0.0.1:7002","state":"up","capacity_bytes":1000,"used_bytes":0,"reserved_bytes":0}}],"host_tier":{{"budget_bytes":4096,"used_bytes":2048,"pages":1}},"remote":{{"bytes_out":1,"bytes_in":2,"pages_spilled":3,"pages_fetched":4}},"peer_bytes_in":5,"peer_bytes_out":6,"frames_rejected":0,"clients":2}}"#
    )
}

fn ok(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[test]
fn a_status_document_parses_field_by_field() {
    let addr = serve(ok(&status_json(1, "leader", 1, 3)));
    let s = fetch_status(addr, Duration::from_secs(2)).unwrap();
    assert_eq!(s.node_id, 1);
    assert_eq!(s.pool_id, "00000000000000ab");
    assert!(s.is_leader());
    assert_eq!(
        (s.known_leader(), s.term, s.commit_index),
        (Some(1), 3, 120)
    );
    assert_eq!(s.members.len(), 2);
    assert_eq!(s.members[0].capacity_bytes, 1000);
    assert_eq!(s.members[0].reserved_bytes, 5);
    assert_eq!(s.host_tier.used_bytes, 2048);
    assert_eq!(s.remote.pages_fetched, 4);
    assert_eq!((s.peer_bytes_in, s.peer_bytes_out, s.clients), (5, 6, 2));
    // A node older than `raft_healthy` says nothing about it: healthy.
    assert!(s.raft_healthy && s.raft_error.is_none());
}

#[test]
fn a_node_whose_raft_log_fails_answers_but_is_not_counted_healthy() {
    let leader = serve(ok(&status_json(1, "leader", 1, 3)));
    let healthy = status_json(2, "follower", 1, 3).replacen(
        "\"commit_index\"",
        "\"raft_healthy\":true,\"raft_error\":null,\"commit_index\"",
        1,
    );
    let failing = status_json(3, "follower", 1, 3).replacen(
        "\"commit_index\"",
        "\"raft_healthy\":false,\"raft_error\":\"raft-engine failed: No space left\",\"commit_index\"",
        1,
    );
    let (healthy, failing) = (serve(ok(&healthy)), serve(ok(&failing)));
    let targets = vec![
        (leader.to_string(), Some(1)),
        (healthy.to_string(), Some(2)),
        (failing.to_string(), Some(3)),
    ];
    let report = query_pool(&targets, Duration::from_secs(2));
    assert_eq!((report.answering, report.raft_healthy), (3, 2));
    assert!(!report.settled(3));
    let s = report.node(3).unwrap();
    assert!(!s.raft_healthy);
    assert_eq!(
        s.raft_error.as_deref(),
        Some("raft-engine failed: No space left")
    );
    assert!(report.node(2).unwrap().raft_healthy);
}

#[test]
fn a_pool_with_a_dead_node_reports_it_down_and_still_finds_the_leader() {
    let leader = serve(ok(&status_json(1, "leader", 1, 3)));
    let follower = serve(ok(&status_json(2, "follower", 1, 3)));
    // A port nobody listens on.
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let targets = vec![
        (leader.to_string(), Some(1)),
        (follower.to_string(), Some(2)),
        (dead.to_string(), Some(3)),
    ];
    let report = query_pool(&targets, Duration::from_secs(2));
    assert_eq!(report.answering, 2);
    assert_eq!(report.leader, Some(1));
    assert_eq!(report.term, Some(3));
    assert!(report.leader_agreed);
    assert_eq!(report.members.len(), 2);
    assert!(report.nodes[0].up && report.nodes[1].up);
    assert!(!report.nodes[2].up);
    assert!(
        report.nodes[2]
            .error
            .as_deref()
            .unwrap()
            .contains("connect"),
        "{:?}",
        report.nodes[2].error
    );
    assert_eq!(report.node(2).unwrap().role, "follower");
}

#[test]
fn followers_naming_another_leader_are_not_agreement() {
    let a = serve(ok(&status_json(1, "leader", 1, 3)));
    let b = serve(ok(&status_json(2, "follower", 3, 3)));
    let report = query_pool(
        &[(a.to_string(), Some(1)), (b.to_string(), Some(2))],
        Duration::from_secs(2),
    );
    assert_eq!(report.leader, Some(1));
    assert!(!report.leader_agreed);
    // A stale leader of an older term loses to the newer one.
    let old = serve(ok(&status_json(2, "leader", 2, 2)));
    let report = query_pool(
        &[(a.to_string(), Some(1)), (old.to_string(), Some(2))],
        Duration::from_secs(2),
    );
    assert_eq!((report.leader, report.term), (Some(1), Some(3)));
}

#[test]
fn a_silent_node_times_out_within_the_deadline() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // Accepts (the kernel does) but never answers; keep the listener alive.
    let start = Instant::now();
    let err = fetch_status(addr, Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(err, StatusError::Http(HttpError::Timeout { .. })),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    drop(listener);
}

#[test]
fn oversized_errors_and_nonsense_are_refused() {
    let huge = serve(ok(&"x".repeat(RESPONSE_BYTES_MAX + 10)));
    let err = http::get(huge, "/status", Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, HttpError::TooLarge { .. }), "{err}");

    let missing = serve(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec());
    let err = fetch_status(missing, Duration::from_secs(2)).unwrap_err();
    assert!(
        matches!(err, StatusError::Status { status: 404, .. }),
        "{err}"
    );

    let not_json = serve(ok("<html>hello</html>"));
    let err = fetch_status(not_json, Duration::from_secs(2)).unwrap_err();
    assert!(matches!(err, StatusError::Json { .. }), "{err}");
}
