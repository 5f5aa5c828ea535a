//! Spill and fetch throughput of the remote tier with 2 MiB pages, three nodes on
//! loopback in one process (alone in its test binary, so the other pool tests do not
//! share the cores with it). `SPILLWAY_BENCH_PAGES` sets the pages moved (default 64),
//! `SPILLWAY_BENCH_THREADS` the tokio worker threads all three nodes share (default 2).

mod common;

use std::time::Instant;

use common::*;
use spillway_types::PageId;

/// Spill and fetch throughput with 2 MiB pages (prints GB/s; asserts only correctness).
#[test]
fn spill_and_fetch_throughput_with_2_mib_pages() {
    let threads: usize = std::env::var("SPILLWAY_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run(threads));
}

async fn run(threads: usize) {
    const BIG: u64 = 2 << 20;
    let total_pages: u64 = std::env::var("SPILLWAY_BENCH_PAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let mut pool = Pool::new("throughput", BIG, [total_pages, total_pages, total_pages]);
    for c in &mut pool.configs {
        c.reserve_chunk_bytes = 64 << 20;
    }
    let (nodes, _) = pool.start_settled().await;
    let remote = nodes[0].as_ref().unwrap().remote();
    let pages = patterned_pages(1, total_pages as u32, 0, BIG);
    let bytes = total_pages * BIG;
    let t = Instant::now();
    within("spill", remote.spill(1, pages.clone()))
        .await
        .unwrap();
    let spill_s = t.elapsed().as_secs_f64();
    let ids: Vec<PageId> = pages.iter().map(|(id, _)| *id).collect();
    let t = Instant::now();
    let back = within("fetch", remote.fetch(1, ids)).await.unwrap();
    let fetch_s = t.elapsed().as_secs_f64();
    for ((_, sent), got) in pages.iter().zip(&back) {
        assert!(sent == got, "a page came back different");
    }
    println!(
        "{} MiB in 2 MiB pages, {threads} worker threads: spill {:.2} GB/s, fetch {:.2} GB/s",
        bytes >> 20,
        bytes as f64 / spill_s / 1e9,
        bytes as f64 / fetch_s / 1e9
    );
    shutdown_all(nodes).await;
}
