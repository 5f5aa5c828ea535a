//! Helpers shared by the client's tests.

use spillway_client::{Buffer, Pool, pattern};

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
