//! The embedded pool on the sim device: data through every tier, errors, and a property
//! test of random operation sequences against a model of the contents.

use proptest::prelude::*;
use spillway_client::{
    CoreError, DeviceChoice, PageSize, Policy, Pool, PoolBuilder, PoolError, pattern,
};

const PAGE: u64 = 64 << 10;

fn pool(gpu_pages: u64, host_pages: u64, policy: Policy) -> Pool {
    PoolBuilder::new()
        .gpu_budget_bytes(gpu_pages * PAGE)
        .host_budget_bytes(host_pages * PAGE)
        .page_size(PageSize::new(PAGE).unwrap())
        .policy(policy)
        .device(DeviceChoice::Sim)
        .build()
        .unwrap()
}

#[test]
fn budgets_are_required() {
    let e = PoolBuilder::new()
        .host_budget_bytes(1 << 30)
        .build()
        .unwrap_err();
    assert!(matches!(e, PoolError::Missing("gpu_budget_bytes")), "{e}");
    let e = PoolBuilder::new()
        .gpu_budget_bytes(1 << 30)
        .build()
        .unwrap_err();
    assert!(matches!(e, PoolError::Missing("host_budget_bytes")), "{e}");
    let e = PoolBuilder::new()
        .gpu_budget_bytes(1)
        .host_budget_bytes(1 << 30)
        .device(DeviceChoice::Sim)
        .build()
        .unwrap_err();
    assert!(
        matches!(e, PoolError::Config(ref c) if c.field == "gpu_budget_bytes"),
        "{e}"
    );
}

#[test]
fn copies_in_flight_are_set_both_ways_and_at_least_a_page() {
    let build = |bytes: u64| {
        PoolBuilder::new()
            .gpu_budget_bytes(8 * PAGE)
            .host_budget_bytes(32 * PAGE)
            .page_size(PageSize::new(PAGE).unwrap())
            .device(DeviceChoice::Sim)
            .copy_bytes_in_flight(bytes)
            .build()
    };
    let cfg = build(4 * PAGE).unwrap().config();
    assert_eq!(cfg.h2d_bytes_in_flight_max, 4 * PAGE);
    assert_eq!(cfg.d2h_bytes_in_flight_max, 4 * PAGE);
    let e = build(PAGE - 1).unwrap_err();
    assert!(
        matches!(e, PoolError::Config(ref c) if c.field == "h2d_bytes_in_flight_max"),
        "{e}"
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_names_it() {
    let e = PoolBuilder::new()
        .gpu_budget_bytes(4 << 20)
        .host_budget_bytes(8 << 20)
        .device(DeviceChoice::Cuda)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("--features cuda"), "{e}");
    // Auto falls back to the sim device.
    let p = PoolBuilder::new()
        .gpu_budget_bytes(4 << 20)
        .host_budget_bytes(8 << 20)
        .build()
        .unwrap();
    assert_eq!(p.device_kind().name(), "sim");
}

#[test]
fn data_survives_eviction_and_reload() {
    // 4 buffers of 3 pages on a GPU of 4 pages: every acquire evicts something.
    let p = pool(4, 16, Policy::Clock);
    let bufs: Vec<_> = (0..4)
        .map(|i| p.alloc(&format!("b{i}"), 3 * PAGE - 17).unwrap())
        .collect();
    for (i, b) in bufs.iter().enumerate() {
        p.write(b, 0, &pattern::bytes(i as u64, b.bytes() as usize))
            .unwrap();
    }
    for round in 0..3u64 {
        for (i, b) in bufs.iter().enumerate() {
            let mut g = p.acquire_mut(b).unwrap();
            let expect = pattern::bytes(round * 10 + i as u64, b.bytes() as usize);
            let prev = if round == 0 {
                pattern::bytes(i as u64, b.bytes() as usize)
            } else {
                pattern::bytes((round - 1) * 10 + i as u64, b.bytes() as usize)
            };
            for page in 0..g.pages() {
                let at = page * PAGE as usize;
                assert_eq!(
                    g.page(page).unwrap(),
                    &prev[at..at + g.page_len(page) as usize],
                    "round {round} buffer {i} page {page}"
                );
                let len = g.page_len(page) as usize;
                g.page_mut(page)
                    .unwrap()
                    .copy_from_slice(&expect[at..at + len]);
            }
        }
    }
    for (i, b) in bufs.iter().enumerate() {
        let mut out = vec![0u8; b.bytes() as usize];
        p.read(b, 0, &mut out).unwrap();
        assert_eq!(out, pattern::bytes(20 + i as u64, b.bytes() as usize));
    }
    let s = p.stats().core;
    assert!(s.evictions_dirty > 0 && s.d2h_bytes > 0, "{s:?}");
    assert!(s.frames_in_use_peak <= 4);
}

#[test]
fn unaligned_reads_and_writes_cross_pages() {
    let p = pool(4, 16, Policy::Learned);
    let b = p.alloc("x", 3 * PAGE).unwrap();
    let d = pattern::bytes(3, 100_000);
    p.write(&b, PAGE - 5, &d).unwrap();
    let mut out = vec![0u8; 100_000];
    p.read(&b, PAGE - 5, &mut out).unwrap();
    assert_eq!(out, d);
    let g = p.acquire(&b).unwrap();
    assert_eq!(&g.page(0).unwrap()[PAGE as usize - 5..], &d[..5]);
    assert_eq!(g.page(1).unwrap()[0], d[5]);
    assert!(matches!(
        g.page(3),
        Err(PoolError::NoSuchPage { index: 3, pages: 3 })
    ));
}

#[test]
fn typed_errors() {
    let p = pool(4, 8, Policy::Learned);
    let too_big = p.alloc("big", 5 * PAGE).unwrap_err();
    assert!(
        matches!(too_big, PoolError::Pool(CoreError::BufferTooLarge { requested_bytes, budget_bytes, .. }) if requested_bytes == 5 * PAGE && budget_bytes == 4 * PAGE)
    );
    let a = p.alloc("a", 4 * PAGE).unwrap();
    let b = p.alloc("b", 3 * PAGE).unwrap();
    let full = p.alloc("c", 2 * PAGE).unwrap_err();
    assert!(
        matches!(
            full,
            PoolError::Pool(CoreError::PoolFull {
                free_pages: 1,
                total_pages: 8,
                ..
            })
        ),
        "{full}"
    );
    assert!(full.to_string().contains("pool full"), "{full}");
    {
        let g = p.acquire(&a).unwrap();
        let e = p.acquire(&b).unwrap_err();
        assert!(
            matches!(
                e,
                PoolError::Pool(CoreError::HeldAcquiresExceedBudget { .. })
            ),
            "{e}"
        );
        assert!(matches!(
            p.free(&a),
            Err(PoolError::Pool(CoreError::BufferHeld { .. }))
        ));
        assert!(matches!(
            p.write(&a, 0, &[1]),
            Err(PoolError::Pool(CoreError::BufferBusy { .. }))
        ));
        let mut shared = g;
        assert!(matches!(shared.page_mut(0), Err(PoolError::NotExclusive)));
    }
    p.free(&a).unwrap();
    assert!(matches!(
        p.free(&a),
        Err(PoolError::Pool(CoreError::Freed(_)))
    ));
    assert!(matches!(
        p.acquire(&a),
        Err(PoolError::Pool(CoreError::Freed(_)))
    ));
    let out_of_range = p.write(&b, 3 * PAGE - 1, &[1, 2]).unwrap_err();
    assert!(matches!(
        out_of_range,
        PoolError::Pool(CoreError::OutOfRange { .. })
    ));
    // A handle from another pool is unknown here.
    let other = pool(4, 8, Policy::Learned);
    let foreign = other.alloc("f", PAGE).unwrap();
    let _b2 = other.alloc("g", PAGE).unwrap();
    let foreign2 = other.alloc("h", PAGE).unwrap();
    assert!(matches!(
        p.acquire(&foreign2),
        Err(PoolError::Pool(CoreError::UnknownBuffer(_)))
    ));
    drop(foreign);
}

#[test]
fn device_kernels_match_host_pattern() {
    let p = pool(4, 8, Policy::Learned);
    let b = p.alloc("k", 2 * PAGE + 3).unwrap();
    {
        let mut g = p.acquire_mut(&b).unwrap();
        for i in 0..g.pages() {
            g.fill_pattern(i, 100 + i as u64).unwrap();
        }
        for i in 0..g.pages() {
            assert_eq!(
                g.checksum(i).unwrap(),
                pattern::expected_checksum(100 + i as u64, g.page_len(i) as usize)
            );
        }
        assert_ne!(g.compute(0, 2).unwrap(), g.compute(1, 2).unwrap());
    }
    let mut out = vec![0u8; 3];
    p.read(&b, 2 * PAGE, &mut out).unwrap();
    let mut expect = vec![0u8; 3];
    pattern::fill(102, &mut expect);
    assert_eq!(out, expect);
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Write(usize, u64, u64, u64),
    Acquire(usize),
    AcquireMut(usize, u64),
    Release(usize),
    Free(usize),
    Step,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1u64..4 * PAGE).prop_map(Op::Alloc),
        2 => (0usize..8, 0u64..4 * PAGE, 1u64..2 * PAGE, any::<u64>()).prop_map(|(i, o, l, s)| Op::Write(i, o, l, s)),
        3 => (0usize..8).prop_map(Op::Acquire),
        2 => (0usize..8, any::<u64>()).prop_map(|(i, s)| Op::AcquireMut(i, s)),
        3 => (0usize..4).prop_map(Op::Release),
        1 => (0usize..8).prop_map(Op::Free),
        1 => Just(Op::Step),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    /// Random alloc / write / acquire / release / free sequences: contents always equal a
    /// model kept beside the pool, budgets always hold, and errors are the expected ones.
    #[test]
    fn random_sequences_keep_contents_and_budgets(ops in proptest::collection::vec(op(), 1..60), policy in prop_oneof![Just(Policy::Learned), Just(Policy::Clock), Just(Policy::OnDemand)]) {
        let p = pool(8, 24, policy);
        let mut live: Vec<(spillway_client::Buffer, Vec<u8>)> = Vec::new();
        let mut held: Vec<(usize, spillway_client::Guard<'_>)> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(bytes) => match p.alloc("p", bytes) {
                    Ok(b) => live.push((b, vec![0u8; bytes as usize])),
                    Err(PoolError::Pool(CoreError::PoolFull { .. } | CoreError::BufferTooLarge { .. })) => {}
                    Err(e) => prop_assert!(false, "alloc: {e}"),
                },
                Op::Write(i, off, len, seed) if !live.is_empty() => {
                    let i = i % live.len();
                    let size = live[i].0.bytes();
                    let (off, len) = (off % size, len.min(size - off % size));
                    let d = pattern::bytes(seed, len as usize);
                    match p.write(&live[i].0, off, &d) {
                        Ok(()) => live[i].1[off as usize..(off + len) as usize].copy_from_slice(&d),
                        Err(PoolError::Pool(CoreError::BufferBusy { .. })) => prop_assert!(held.iter().any(|(j, _)| *j == i)),
                        Err(e) => prop_assert!(false, "write: {e}"),
                    }
                }
                Op::Acquire(i) | Op::AcquireMut(i, _) if !live.is_empty() => {
                    let i = i % live.len();
                    let seed = if let Op::AcquireMut(_, s) = op { Some(s) } else { None };
                    let r = if seed.is_some() { p.acquire_mut(&live[i].0) } else { p.acquire(&live[i].0) };
                    match r {
                        Ok(mut g) => {
                            let page = PAGE as usize;
                            for k in 0..g.pages() {
                                let len = g.page_len(k) as usize;
                                prop_assert!(g.page(k).unwrap() == &live[i].1[k * page..k * page + len], "contents of buffer {} page {}", i, k);
                            }
                            if let Some(s) = seed {
                                for k in 0..g.pages() {
                                    let len = g.page_len(k) as usize;
                                    let d = pattern::bytes(s ^ k as u64, len);
                                    g.page_mut(k).unwrap().copy_from_slice(&d);
                                    live[i].1[k * page..k * page + len].copy_from_slice(&d);
                                }
                            }
                            held.push((i, g));
                        }
                        Err(PoolError::Pool(CoreError::BufferBusy { .. } | CoreError::HeldAcquiresExceedBudget { .. })) => prop_assert!(!held.is_empty()),
                        Err(e) => prop_assert!(false, "acquire: {e}"),
                    }
                }
                Op::Release(k) if !held.is_empty() => {
                    held.remove(k % held.len());
                }
                Op::Free(i) if !live.is_empty() => {
                    let i = i % live.len();
                    match p.free(&live[i].0) {
                        Ok(()) => {
                            let (b, _) = live.remove(i);
                            prop_assert!(matches!(p.free(&b), Err(PoolError::Pool(CoreError::Freed(_)))));
                            held.iter_mut().for_each(|(j, _)| if *j > i { *j -= 1 });
                        }
                        Err(PoolError::Pool(CoreError::BufferHeld { .. })) => prop_assert!(held.iter().any(|(j, _)| *j == i)),
                        Err(e) => prop_assert!(false, "free: {e}"),
                    }
                }
                Op::Step => p.step(),
                _ => {}
            }
            let s = p.stats().core;
            prop_assert!(s.frames_in_use <= s.frames_total, "{s:?}");
            prop_assert!(s.slots_in_use <= s.slots_total, "{s:?}");
        }
        held.clear();
        for (b, model) in &live {
            let mut out = vec![0u8; b.bytes() as usize];
            p.read(b, 0, &mut out).unwrap();
            prop_assert!(&out == model, "final contents of {}", b.name());
        }
    }
}

#[test]
fn a_discard_acquire_moves_nothing_in_and_its_writes_survive_eviction() {
    // 2 buffers of 3 pages on a GPU of 4 pages: each acquire evicts the other's pages.
    let p = pool(4, 16, Policy::Clock);
    let a = p.alloc("a", 3 * PAGE - 17).unwrap();
    let b = p.alloc("b", 3 * PAGE).unwrap();
    p.write(&a, 0, &pattern::bytes(1, a.bytes() as usize))
        .unwrap();
    for round in 0..3u64 {
        // b pushes a off the GPU; a's discard acquire then loads nothing.
        drop(p.acquire(&b).unwrap());
        let h2d = p.stats().core.h2d_bytes;
        let want = pattern::bytes(10 + round, a.bytes() as usize);
        let mut g = p.acquire_discard(&a).unwrap();
        for page in 0..g.pages() {
            let at = page * PAGE as usize;
            let len = g.page_len(page) as usize;
            g.page_mut(page)
                .unwrap()
                .copy_from_slice(&want[at..at + len]);
        }
        drop(g);
        p.quiesce();
        assert_eq!(p.stats().core.h2d_bytes, h2d, "round {round}: no load");
        // The overwritten pages are dirty: evicted, written back, and read back.
        drop(p.acquire(&b).unwrap());
        p.quiesce();
        let mut out = vec![0u8; a.bytes() as usize];
        p.read(&a, 0, &mut out).unwrap();
        assert_eq!(out, want, "round {round}");
    }
    let s = p.stats().core;
    // Round 0 overwrites a's 3 pages; b then needs 3 of the 4 frames, so from round 1 one
    // page of a is still resident (a hit) and 2 are overwritten.
    assert_eq!(s.overwrites, 3 + 2 + 2, "{s:?}");
    assert_eq!(s.evictions_dirty, 2 * 3, "{s:?}");
}

#[test]
fn the_device_hears_which_acquires_are_expected_whole() {
    let p = pool(8, 24, Policy::Learned);
    let device = p.device();
    let sim = device
        .as_any()
        .downcast_ref::<spillway_device::sim::SimDevice>()
        .expect("a sim pool");
    let w = p.alloc("weights", 2 * PAGE).unwrap();
    let g = p.alloc("grads", 2 * PAGE).unwrap();
    // Whole in forward (`device_ptr`), page by page in the optimizer.
    let step = |expect_after_whole: Option<bool>, expect_after_paged: Option<bool>| {
        let guard = p.acquire(&w).unwrap();
        assert!(guard.device_ptr().unwrap().is_some());
        drop(guard);
        assert_eq!(sim.expected_view(w.id()), expect_after_whole);
        drop(p.acquire(&w).unwrap());
        drop(p.acquire_mut(&g).unwrap());
        assert_eq!(sim.expected_view(w.id()), expect_after_paged);
        p.step();
    };
    // Step 1: once viewed whole, expected whole (no step seen yet).
    step(Some(true), Some(true));
    assert_eq!(sim.expected_view(g.id()), Some(false));
    // From step 2: the acquire after the whole one is expected page by page, and the
    // next step's first whole again.
    step(Some(false), Some(true));
    step(Some(false), Some(true));
    assert_eq!(sim.expected_view(g.id()), Some(false));
}
