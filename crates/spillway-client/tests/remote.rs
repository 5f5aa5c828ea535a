//! The embedded pool over a remote tier (in-process memory standing in for other
//! machines): pages leave the host tier and come back with every byte intact.

use spillway_client::remote::MemRemote;
use spillway_client::{DeviceChoice, PageSize, Policy, PoolBuilder, PoolError, pattern};

const PAGE: u64 = 256 << 10;

fn pool(policy: Policy) -> spillway_client::Pool {
    PoolBuilder::new()
        .gpu_budget_bytes(4 * PAGE)
        .host_budget_bytes(8 * PAGE)
        .remote_budget_bytes(48 * PAGE)
        .page_size(PageSize::new(PAGE).unwrap())
        .policy(policy)
        .device(DeviceChoice::Sim)
        .remote(MemRemote::factory(48 * PAGE))
        .build()
        .unwrap()
}

#[test]
fn a_working_set_four_times_gpu_plus_host_round_trips_every_byte() {
    for policy in [Policy::Learned, Policy::Clock] {
        let pool = pool(policy);
        // 24 buffers of 2 pages = 48 pages = 4x (4 + 8).
        let bufs: Vec<_> = (0..24)
            .map(|i| pool.alloc(&format!("b{i}"), 2 * PAGE).unwrap())
            .collect();
        // New buffers read as zeros even though most never had a slot.
        let mut head = vec![1u8; 64];
        pool.read(&bufs[23], PAGE, &mut head).unwrap();
        assert!(head.iter().all(|&b| b == 0), "{policy:?}: {head:?}");
        let mut version = vec![0u64; bufs.len()];
        for step in 0..4u64 {
            for (i, b) in bufs.iter().enumerate() {
                let seed = |v: u64, page: usize| (i as u64) << 32 | v << 8 | page as u64;
                if step > 0 {
                    let g = pool.acquire(b).unwrap();
                    for page in 0..g.pages() {
                        let want = pattern::expected_checksum(
                            seed(version[i], page),
                            g.page_len(page) as usize,
                        );
                        assert_eq!(
                            g.checksum(page).unwrap(),
                            want,
                            "{policy:?} step {step} buffer {i} page {page}"
                        );
                    }
                }
                if (i as u64 + step).is_multiple_of(2) {
                    let mut g = pool.acquire_mut(b).unwrap();
                    version[i] += 1;
                    for page in 0..g.pages() {
                        g.fill_pattern(page, seed(version[i], page)).unwrap();
                    }
                } else if step == 0 {
                    let mut g = pool.acquire_mut(b).unwrap();
                    for page in 0..g.pages() {
                        g.fill_pattern(page, seed(0, page)).unwrap();
                    }
                }
            }
            pool.step();
        }
        // Host reads see the newest bytes too.
        let mut page = vec![0u8; PAGE as usize];
        pool.read(&bufs[5], 0, &mut page).unwrap();
        let seed = 5u64 << 32 | version[5] << 8;
        assert_eq!(
            pattern::checksum(&page),
            pattern::expected_checksum(seed, PAGE as usize)
        );
        let s = pool.stats().core;
        assert!(
            s.remote_bytes_out > 0 && s.remote_bytes_in > 0,
            "{policy:?}: {s:?}"
        );
        for b in &bufs {
            pool.free(b).unwrap();
        }
        // Freed pages give back their remote space once their ops in flight land.
        pool.quiesce();
        assert_eq!(pool.stats().core.remote_pages, 0, "{policy:?}");
    }
}

#[test]
fn a_remote_tier_needs_a_budget_and_a_budget_needs_a_tier() {
    let e = PoolBuilder::new()
        .gpu_budget_bytes(4 * PAGE)
        .host_budget_bytes(8 * PAGE)
        .page_size(PageSize::new(PAGE).unwrap())
        .device(DeviceChoice::Sim)
        .remote(MemRemote::factory(48 * PAGE))
        .build()
        .unwrap_err();
    assert!(
        matches!(e, PoolError::Missing("remote_budget_bytes")),
        "{e}"
    );
    let e = PoolBuilder::new()
        .gpu_budget_bytes(4 * PAGE)
        .host_budget_bytes(8 * PAGE)
        .remote_budget_bytes(8 * PAGE)
        .page_size(PageSize::new(PAGE).unwrap())
        .device(DeviceChoice::Sim)
        .build()
        .unwrap_err();
    assert!(matches!(e, PoolError::Missing("remote")), "{e}");
}
