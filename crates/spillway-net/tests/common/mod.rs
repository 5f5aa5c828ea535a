//! Helpers shared by the transport tests: a pool directory, pages, the round trip every
//! transport must pass, and waiting for a condition.

#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use spillway_net::{Connection, Page};
use spillway_types::{BufferId, PageId, pattern, wire};

/// A fresh, empty directory under the system temp dir, unique to this test.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "spillway-net-{name}-{}-{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub fn page_id(buffer: u64, index: u32) -> PageId {
    PageId {
        buffer: BufferId(buffer),
        index,
    }
}

/// A page filled with the pattern for its id.
pub fn page(buffer: u64, index: u32, len: usize) -> Page {
    let mut data = vec![0u8; len];
    pattern::fill(buffer * 1_000_003 + u64::from(index), &mut data);
    Page::new(page_id(buffer, index), Bytes::from(data))
}

/// Polls `cond` until it holds; panics after `timeout` with `what`.
pub async fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Awaits `f`, failing the test if it takes longer than `timeout`.
pub async fn within<T>(what: &str, timeout: Duration, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(timeout, f)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Put, get (with a missing id), delete and get again against a fresh `MemStore` peer;
/// pages of several sizes including a short last page and the largest page size.
pub async fn round_trip<C: Connection>(conn: &C) {
    let pages = vec![
        page(1, 0, 2 << 20),
        page(1, 1, 2 << 20),
        page(1, 2, 12_345),
        page(2, 0, 64 << 10),
    ];
    assert_eq!(conn.put_pages(pages.clone()).await.unwrap(), 4);
    let big = page(3, 0, 64 << 20);
    assert_eq!(conn.put_pages(vec![big.clone()]).await.unwrap(), 1);

    let wanted = vec![page_id(1, 2), page_id(9, 9), page_id(1, 0), page_id(3, 0)];
    let (got, missing) = conn.get_pages(wanted).await.unwrap();
    assert_eq!(missing, vec![page_id(9, 9)]);
    assert_eq!(got.len(), 3);
    assert_eq!(got[0], pages[2]);
    assert_eq!(got[1], pages[0]);
    assert_eq!(got[2].id, big.id);
    assert!(got[2].data == big.data, "the 64 MiB page came back changed");
    for p in &got {
        // The transport verified checksums on arrival; check the bytes independently.
        let sent = if p.id == big.id {
            &big
        } else {
            pages.iter().find(|s| s.id == p.id).unwrap()
        };
        assert_eq!(
            wire::page_checksum(&p.data),
            wire::page_checksum(&sent.data)
        );
    }

    let (deleted, missing) = conn
        .delete_pages(vec![page_id(1, 0), page_id(1, 1), page_id(7, 7)])
        .await
        .unwrap();
    assert_eq!((deleted, missing), (2, 1));
    let (got, missing) = conn
        .get_pages(vec![page_id(1, 0), page_id(2, 0)])
        .await
        .unwrap();
    assert_eq!(missing, vec![page_id(1, 0)]);
    assert_eq!(got, vec![pages[3].clone()]);
}
