//! Helpers shared by the client's tests.

use spillway_client::daemon::DaemonLink;
use spillway_client::{Buffer, DeviceChoice, Policy, Pool, pattern};

/// Runs `steps` steps over `buffers`: each step acquires every buffer shared and checks
/// each page against the pattern the previous step wrote (from the second step on), then
/// acquires it exclusively and writes this step's pattern. Panics on a wrong page.
pub fn steps_with_checked_pages(pool: &Pool, buffers: &[Buffer], steps: u64) {
    let seed = |i: usize, step: u64, page: usize| (i as u64) << 32 | step << 8 | page as u64;
    for step in 0..steps {
        for (i, b) in buffers.iter().enumerate() {
            if step > 0 {
                let g = pool.acquire(b).unwrap();
                for page in 0..g.pages() {
                    let want = pattern::expected_checksum(
                        seed(i, step - 1, page),
                        g.page_len(page) as usize,
                    );
                    assert_eq!(
                        g.checksum(page).unwrap(),
                        want,
                        "step {step} buffer {i} page {page}"
                    );
                }
            }
            let mut g = pool.acquire_mut(b).unwrap();
            for page in 0..g.pages() {
                g.fill_pattern(page, seed(i, step, page)).unwrap();
            }
        }
        pool.step();
    }
}

/// Daemon mode's spill check: a learned pool over `link` (4 frames of the link's page size
/// and a remote tier of 48 pages, beside the link's host tier) whose `buffers` buffers of
/// two pages each go through [`steps_with_checked_pages`] three times. Returns the pool
/// and its buffers.
pub fn spill_through_link(
    link: &DaemonLink,
    device: DeviceChoice,
    buffers: usize,
) -> (Pool, Vec<Buffer>) {
    let page = link.page_size().bytes();
    let pool = link
        .pool_builder()
        .gpu_budget_bytes(4 * page)
        .remote_budget_bytes(48 * page)
        .policy(Policy::Learned)
        .device(device)
        .build()
        .unwrap();
    let bufs: Vec<Buffer> = (0..buffers)
        .map(|i| pool.alloc(&format!("b{i}"), 2 * page).unwrap())
        .collect();
    steps_with_checked_pages(&pool, &bufs, 3);
    (pool, bufs)
}
