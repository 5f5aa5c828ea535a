//! Behaviour of the pool's state machine, driven by a scripted device that finishes
//! copies when the test says so.

use std::time::Duration;

use proptest::prelude::*;
use spillway_core::{AccessMode, CopyOp, CoreError, PoolCore};
use spillway_types::config::{Policy, PoolConfig};
use spillway_types::{BufferId, Direction, PageSize};

const PAGE: u64 = 64 << 10;

fn pool(gpu_pages: u64, host_pages: u64, policy: Policy) -> PoolCore {
    let mut cfg = PoolConfig::new(gpu_pages * PAGE, host_pages * PAGE);
    cfg.page_size = PageSize::new(PAGE).unwrap();
    cfg.policy = policy;
    PoolCore::new(cfg, 1e9).unwrap()
}

/// [`pool`] with a buffer of each size in `bytes` allocated.
fn pool_with<const N: usize>(
    gpu_pages: u64,
    host_pages: u64,
    policy: Policy,
    bytes: [u64; N],
) -> (PoolCore, [BufferId; N]) {
    let mut c = pool(gpu_pages, host_pages, policy);
    let buffers = bytes.map(|b| c.alloc(b).unwrap());
    (c, buffers)
}

/// Finishes every copy the pool has started (and those they lead to), as a device would.
fn settle(core: &mut PoolCore, now: Duration) -> Vec<CopyOp> {
    let mut done = Vec::new();
    while let Some(t) = core.poll_transfer() {
        core.handle_transfer_done(t.id, Ok(()), now);
        done.push(t);
        core.check_invariants();
    }
    done
}

fn t(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

#[test]
fn alloc_errors_carry_numbers() {
    let mut c = pool(4, 8, Policy::Learned);
    assert_eq!(c.alloc(0), Err(CoreError::EmptyBuffer));
    assert_eq!(
        c.alloc(5 * PAGE),
        Err(CoreError::BufferTooLarge {
            requested_bytes: 5 * PAGE,
            pages: 5,
            budget_bytes: 4 * PAGE
        })
    );
    let a = c.alloc(4 * PAGE).unwrap();
    let _b = c.alloc(3 * PAGE + 1).unwrap();
    assert_eq!(
        c.alloc(PAGE + 1),
        Err(CoreError::PoolFull {
            requested_bytes: PAGE + 1,
            needed_pages: 2,
            free_pages: 0,
            total_pages: 8
        })
    );
    c.free(a, t(0)).unwrap();
    assert_eq!(c.free(a, t(0)), Err(CoreError::Freed(a)));
    assert_eq!(
        c.free(BufferId(99), t(0)),
        Err(CoreError::UnknownBuffer(BufferId(99)))
    );
    assert!(matches!(
        c.begin_acquire(a, AccessMode::Shared, t(0)),
        Err(CoreError::Freed(_))
    ));
    // The freed slots are usable again.
    c.alloc(4 * PAGE).unwrap();
    c.check_invariants();
}

#[test]
fn acquire_loads_then_hits() {
    let (mut c, [a]) = pool_with(4, 8, Policy::Clock, [2 * PAGE]);
    let (acq, hit) = c.begin_acquire(a, AccessMode::Shared, t(0)).unwrap();
    assert!(!hit);
    assert!(!c.is_ready(acq).unwrap());
    let done = settle(&mut c, t(1));
    assert_eq!(done.len(), 2);
    assert!(
        done.iter()
            .all(|t| t.direction == Direction::HostToDevice && t.bytes == PAGE)
    );
    assert!(c.is_ready(acq).unwrap());
    assert_eq!(c.frames_of(acq).len(), 2);
    c.release(acq, t(2));
    let (acq, hit) = c.begin_acquire(a, AccessMode::Shared, t(3)).unwrap();
    assert!(hit);
    assert!(c.is_ready(acq).unwrap());
    let s = c.stats();
    assert_eq!((s.acquires, s.hits, s.h2d_bytes), (2, 1, 2 * PAGE));
}

#[test]
fn short_last_page_copies_only_its_bytes() {
    let (mut c, [a]) = pool_with(4, 8, Policy::Clock, [PAGE + 100]);
    c.begin_acquire(a, AccessMode::Shared, t(0)).unwrap();
    let done = settle(&mut c, t(1));
    let mut sizes: Vec<u64> = done.iter().map(|t| t.bytes).collect();
    sizes.sort();
    assert_eq!(sizes, vec![100, PAGE]);
}

#[test]
fn dirty_pages_are_written_back_and_clean_ones_dropped() {
    let (mut c, [w, r]) = pool_with(2, 8, Policy::Clock, [2 * PAGE, 2 * PAGE]);
    let (acq, _) = c.begin_acquire(w, AccessMode::Exclusive, t(0)).unwrap();
    settle(&mut c, t(1));
    c.release(acq, t(2));
    // Loading r needs both frames: w's dirty pages go back to the host first.
    let (acq, hit) = c.begin_acquire(r, AccessMode::Shared, t(3)).unwrap();
    assert!(!hit);
    let done = settle(&mut c, t(4));
    assert_eq!(
        done.iter()
            .filter(|t| t.direction == Direction::DeviceToHost)
            .count(),
        2
    );
    assert!(c.is_ready(acq).unwrap());
    c.release(acq, t(5));
    // Loading w again drops r's clean pages without a copy.
    let before = c.stats().d2h_bytes;
    c.begin_acquire(w, AccessMode::Shared, t(6)).unwrap();
    settle(&mut c, t(7));
    let s = c.stats();
    assert_eq!(s.d2h_bytes, before);
    assert_eq!(s.evictions_clean, 2);
    assert_eq!(s.evictions_dirty, 2);
}

#[test]
fn held_acquires_over_budget_fail_at_once() {
    let (mut c, [a, b]) = pool_with(3, 8, Policy::Learned, [2 * PAGE, 2 * PAGE]);
    let (ha, _) = c.begin_acquire(a, AccessMode::Shared, t(0)).unwrap();
    let err = c.begin_acquire(b, AccessMode::Shared, t(1)).unwrap_err();
    assert_eq!(
        err,
        CoreError::HeldAcquiresExceedBudget {
            buffer: b,
            held_bytes: 2 * PAGE,
            requested_bytes: 2 * PAGE,
            budget_bytes: 3 * PAGE
        }
    );
    // A second shared acquire of the same buffer pins nothing new.
    let (ha2, _) = c.begin_acquire(a, AccessMode::Shared, t(2)).unwrap();
    settle(&mut c, t(3));
    c.release(ha, t(4));
    c.release(ha2, t(4));
    let (hb, _) = c.begin_acquire(b, AccessMode::Shared, t(5)).unwrap();
    settle(&mut c, t(6));
    assert!(c.is_ready(hb).unwrap());
}

#[test]
fn exclusive_and_shared_conflict_and_held_buffers_cannot_be_freed() {
    let (mut c, [a]) = pool_with(4, 8, Policy::Clock, [PAGE]);
    let (exclusive, shared) = (AccessMode::Exclusive, AccessMode::Shared);
    for (held, other, now) in [(exclusive, shared, 0), (shared, exclusive, 2)] {
        let (h, _) = c.begin_acquire(a, held, t(now)).unwrap();
        assert_eq!(
            c.begin_acquire(a, other, t(now)).unwrap_err(),
            CoreError::BufferBusy {
                buffer: a,
                mode: held
            }
        );
        assert_eq!(
            c.free(a, t(now)).unwrap_err(),
            CoreError::BufferHeld {
                buffer: a,
                holders: 1
            }
        );
        settle(&mut c, t(now + 1));
        c.release(h, t(now + 1));
    }
    c.free(a, t(3)).unwrap();
}

#[test]
fn free_while_a_copy_is_in_flight_gives_memory_back_after_it() {
    let (mut c, [a]) = pool_with(2, 2, Policy::Clock, [2 * PAGE]);
    let (h, _) = c.begin_acquire(a, AccessMode::Shared, t(0)).unwrap();
    let started: Vec<_> = std::iter::from_fn(|| c.poll_transfer()).collect();
    assert_eq!(started.len(), 2);
    // Cannot free while acquired; release first, with the loads still in flight.
    c.release(h, t(1));
    c.free(a, t(1)).unwrap();
    assert_eq!(
        c.stats().slots_in_use,
        2,
        "slots stay taken while copies use them"
    );
    for tr in started {
        c.handle_transfer_done(tr.id, Ok(()), t(2));
    }
    c.check_invariants();
    let s = c.stats();
    assert_eq!((s.slots_in_use, s.frames_in_use), (0, 0));
    c.alloc(2 * PAGE).unwrap();
}

#[test]
fn on_demand_drops_pages_at_release() {
    let (mut c, [a]) = pool_with(4, 8, Policy::OnDemand, [PAGE]);
    for i in 0..3 {
        let (h, hit) = c.begin_acquire(a, AccessMode::Shared, t(i)).unwrap();
        assert!(!hit, "on-demand never keeps pages");
        settle(&mut c, t(i));
        c.release(h, t(i));
    }
    assert_eq!(c.stats().h2d_bytes, 3 * PAGE);
}

#[test]
fn in_flight_bytes_are_bounded() {
    let mut cfg = PoolConfig::new(16 * PAGE, 32 * PAGE);
    cfg.page_size = PageSize::new(PAGE).unwrap();
    cfg.h2d_bytes_in_flight_max = 3 * PAGE;
    let mut c = PoolCore::new(cfg, 1e9).unwrap();
    let a = c.alloc(10 * PAGE).unwrap();
    let (h, _) = c.begin_acquire(a, AccessMode::Shared, t(0)).unwrap();
    let mut rounds = 0;
    while !c.is_ready(h).unwrap() {
        let batch: Vec<_> = std::iter::from_fn(|| c.poll_transfer()).collect();
        assert!(
            !batch.is_empty() && batch.len() <= 3,
            "batch of {}",
            batch.len()
        );
        for tr in batch {
            c.handle_transfer_done(tr.id, Ok(()), t(1));
        }
        c.check_invariants();
        rounds += 1;
    }
    assert!(rounds >= 4, "{rounds} rounds");
}

/// A training-like loop: forward over layers, backward in reverse. Copies finish during
/// the "compute" after each acquire, as they would on a device that keeps up.
fn train_step(
    c: &mut PoolCore,
    weights: &[BufferId],
    acts: &[BufferId],
    clock: &mut u64,
    skip: Option<usize>,
    swap: Option<(usize, usize)>,
) -> (u64, u64) {
    let before = c.stats();
    let mut order: Vec<usize> = (0..weights.len()).filter(|&i| Some(i) != skip).collect();
    if let Some((x, y)) = swap {
        let (px, py) = (
            order.iter().position(|&i| i == x).unwrap(),
            order.iter().position(|&i| i == y).unwrap(),
        );
        order.swap(px, py);
    }
    let access = |c: &mut PoolCore, b: BufferId, mode: AccessMode, clock: &mut u64| {
        let (h, _) = c.begin_acquire(b, mode, t(*clock)).unwrap();
        while !c.is_ready(h).unwrap() {
            settle(c, t(*clock));
        }
        *clock += 10;
        settle(c, t(*clock));
        c.release(h, t(*clock));
    };
    for &i in &order {
        access(c, weights[i], AccessMode::Shared, clock);
        access(c, acts[i], AccessMode::Exclusive, clock);
    }
    for &i in order.iter().rev() {
        access(c, weights[i], AccessMode::Shared, clock);
        access(c, acts[i], AccessMode::Shared, clock);
    }
    c.step(t(*clock));
    let after = c.stats();
    (after.acquires - before.acquires, after.hits - before.hits)
}

fn layers(c: &mut PoolCore, n: usize) -> (Vec<BufferId>, Vec<BufferId>) {
    let w = (0..n).map(|_| c.alloc(2 * PAGE).unwrap()).collect();
    let a = (0..n).map(|_| c.alloc(PAGE).unwrap()).collect();
    (w, a)
}

#[test]
fn learned_prefetch_hits_every_access_from_the_second_step() {
    // 12 layers x 3 pages = 36 pages on a GPU of 12: the working set is 3x the budget.
    let mut c = pool(12, 64, Policy::Learned);
    let (w, a) = layers(&mut c, 12);
    let mut clock = 0;
    let (n1, h1) = train_step(&mut c, &w, &a, &mut clock, None, None);
    assert!(h1 < n1, "the first step has nothing to learn from");
    for _ in 0..3 {
        let (n, h) = train_step(&mut c, &w, &a, &mut clock, None, None);
        assert_eq!(h, n, "every access is a hit");
    }
    let s = c.stats();
    assert!(s.prefetch_loads > 0);
    assert!(s.frames_in_use_peak <= 12);
}

#[test]
fn learned_prefetch_survives_divergence() {
    let mut c = pool(12, 64, Policy::Learned);
    let (w, a) = layers(&mut c, 12);
    let mut clock = 0;
    for _ in 0..3 {
        train_step(&mut c, &w, &a, &mut clock, None, None);
    }
    let (n, h) = train_step(&mut c, &w, &a, &mut clock, Some(7), Some((2, 3)));
    assert!(h as f64 / n as f64 >= 0.9, "diverged step {h}/{n}");
    let (n, h) = train_step(&mut c, &w, &a, &mut clock, None, None);
    assert_eq!(h, n, "the step after divergence is all hits");
}

#[test]
fn clock_and_on_demand_miss_where_learned_hits() {
    let mut hits = Vec::new();
    for policy in [Policy::OnDemand, Policy::Clock, Policy::Learned] {
        let mut c = pool(12, 64, policy);
        let (w, a) = layers(&mut c, 12);
        let mut clock = 0;
        train_step(&mut c, &w, &a, &mut clock, None, None);
        hits.push(train_step(&mut c, &w, &a, &mut clock, None, None).1);
    }
    assert!(
        hits[0] < hits[2] && hits[1] < hits[2],
        "hits on_demand/clock/learned: {hits:?}"
    );
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Acquire(usize, bool),
    Release(usize),
    Free(usize),
    HostAccess(usize),
    Complete(usize),
    Step,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u64..5 * PAGE).prop_map(Op::Alloc),
        (0usize..8, any::<bool>()).prop_map(|(i, x)| Op::Acquire(i, x)),
        (0usize..8).prop_map(Op::Release),
        (0usize..8).prop_map(Op::Free),
        (0usize..8).prop_map(Op::HostAccess),
        (0usize..4).prop_map(Op::Complete),
        Just(Op::Step),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    /// Random sequences never break an invariant (budgets, pins, in-flight bounds), and
    /// every acquire becomes ready once the device finishes its copies.
    #[test]
    fn random_sequences_keep_invariants(ops in proptest::collection::vec(op(), 1..120), policy in prop_oneof![Just(Policy::Learned), Just(Policy::Clock), Just(Policy::OnDemand)]) {
        let mut c = pool(6, 24, policy);
        let mut bufs: Vec<BufferId> = Vec::new();
        let mut held: Vec<(usize, spillway_core::AcquireId)> = Vec::new();
        let mut pending: Vec<CopyOp> = Vec::new();
        let mut now = 0u64;
        for op in ops {
            now += 1;
            match op {
                Op::Alloc(bytes) => if let Ok(b) = c.alloc(bytes) { bufs.push(b) },
                Op::Acquire(i, excl) if !bufs.is_empty() => {
                    let b = bufs[i % bufs.len()];
                    let mode = if excl { AccessMode::Exclusive } else { AccessMode::Shared };
                    if let Ok((h, _)) = c.begin_acquire(b, mode, t(now)) {
                        held.push((i % bufs.len(), h));
                    }
                }
                Op::Release(i) if !held.is_empty() => {
                    let (_, h) = held.remove(i % held.len());
                    // Guards are only handed out once ready: finish the copies first.
                    while !c.is_ready(h).unwrap() {
                        pending.extend(std::iter::from_fn(|| c.poll_transfer()));
                        prop_assert!(!pending.is_empty(), "an acquire waits with no copy in flight");
                        let tr = pending.remove(0);
                        c.handle_transfer_done(tr.id, Ok(()), t(now));
                    }
                    c.release(h, t(now));
                }
                Op::Free(i) if !bufs.is_empty() => {
                    let idx = i % bufs.len();
                    let is_held = held.iter().any(|(j, _)| *j == idx);
                    let r = c.free(bufs[idx], t(now));
                    prop_assert_eq!(r.is_err(), is_held);
                    if r.is_ok() { bufs.remove(idx); held.iter_mut().for_each(|(j, _)| if *j > idx { *j -= 1 }); }
                }
                Op::HostAccess(i) if !bufs.is_empty() => {
                    let b = bufs[i % bufs.len()];
                    let write = held.iter().all(|(j, _)| *j != i % bufs.len());
                    match c.begin_host_access(b, 0, 1, write, t(now)) {
                        Ok(Some(_locations)) => c.end_host_access(b, 0, 1, write, t(now)),
                        Ok(None) => {}
                        Err(e) => prop_assert!(matches!(e, CoreError::BufferBusy { .. }), "{e}"),
                    }
                }
                Op::Complete(n) => {
                    pending.extend(std::iter::from_fn(|| c.poll_transfer()));
                    for _ in 0..n.min(pending.len()) {
                        let tr = pending.remove(0);
                        c.handle_transfer_done(tr.id, Ok(()), t(now));
                    }
                }
                Op::Step => c.step(t(now)),
                _ => {}
            }
            pending.extend(std::iter::from_fn(|| c.poll_transfer()));
            c.check_invariants();
            let s = c.stats();
            prop_assert!(s.frames_in_use <= s.frames_total && s.slots_in_use <= s.slots_total);
        }
    }
}

#[test]
fn a_page_returns_to_its_last_frame_when_it_can() {
    // Returning to the same frame saves remapping the buffer's device range.
    let (mut c, [a, b, cc]) = pool_with(4, 8, Policy::OnDemand, [PAGE; 3]);
    let (h, _) = c.begin_acquire(a, AccessMode::Shared, t(0)).unwrap();
    settle(&mut c, t(0));
    let x = c.frames_of(h)[0];
    c.release(h, t(0));
    let (hb, _) = c.begin_acquire(b, AccessMode::Shared, t(1)).unwrap();
    settle(&mut c, t(1));
    assert_eq!(
        c.frames_of(hb)[0],
        x,
        "the most recently freed frame is reused first"
    );
    let (hc, _) = c.begin_acquire(cc, AccessMode::Shared, t(2)).unwrap();
    settle(&mut c, t(2));
    let y = c.frames_of(hc)[0];
    c.release(hb, t(3));
    c.release(hc, t(3));
    // y was freed last, but a's last frame x is free: a goes back there.
    let (h, _) = c.begin_acquire(a, AccessMode::Shared, t(4)).unwrap();
    settle(&mut c, t(4));
    assert_ne!(x, y);
    assert_eq!(c.frames_of(h)[0], x);
}

#[test]
fn a_discard_acquire_loads_nothing_and_its_pages_are_written_back() {
    let (mut c, [a, r]) = pool_with(2, 8, Policy::Learned, [2 * PAGE, 2 * PAGE]);
    let (h, hit) = c.begin_acquire_discard(a, t(0)).unwrap();
    assert!(hit, "no page needs a load");
    assert!(c.is_ready(h).unwrap(), "frames were free: ready at once");
    assert!(settle(&mut c, t(1)).is_empty(), "no copy");
    c.release(h, t(2));
    let s = c.stats();
    assert_eq!((s.h2d_bytes, s.overwrites, s.demand_loads), (0, 2, 0));
    // Both frames hold a's pages, dirty: loading r writes them back first.
    let (h, _) = c.begin_acquire(r, AccessMode::Shared, t(3)).unwrap();
    let done = settle(&mut c, t(4));
    let d2h = done
        .iter()
        .filter(|t| t.direction == Direction::DeviceToHost)
        .count();
    assert_eq!(d2h, 2, "the overwritten pages are written back");
    assert!(c.is_ready(h).unwrap());
    c.release(h, t(5));
    // Discarding a again (now off the GPU, in slots) still loads nothing; a shared
    // acquire of it loads both pages (its slot holds the written-back bytes).
    let h2d = c.stats().h2d_bytes;
    let (h, _) = c.begin_acquire_discard(a, t(6)).unwrap();
    let done = settle(&mut c, t(7));
    assert!(c.is_ready(h).unwrap());
    assert!(done.iter().all(|t| t.direction == Direction::DeviceToHost));
    assert_eq!(c.stats().h2d_bytes, h2d);
    c.release(h, t(8));
    c.check_invariants();
}

/// Acquires `b` (shared, or discarding its contents), lets the copies finish, releases
/// it; returns whether the acquire was a hit.
fn use_once(c: &mut PoolCore, b: BufferId, discard: bool, ms: &mut u64) -> bool {
    *ms += 1;
    let (h, hit) = if discard {
        c.begin_acquire_discard(b, t(*ms)).unwrap()
    } else {
        c.begin_acquire(b, AccessMode::Shared, t(*ms)).unwrap()
    };
    settle(c, t(*ms));
    assert!(c.is_ready(h).unwrap());
    c.release(h, t(*ms));
    settle(c, t(*ms));
    hit
}

/// A learned pool of four frames with three weight buffers and a gradient buffer of two
/// pages each (8 pages: every buffer leaves the GPU between its uses).
fn training_pool() -> (PoolCore, Vec<BufferId>, BufferId) {
    let mut c = pool(4, 16, Policy::Learned);
    let w = (0..3).map(|_| c.alloc(2 * PAGE).unwrap()).collect();
    let g = c.alloc(2 * PAGE).unwrap();
    (c, w, g)
}

/// One training-like step: weights read, gradients overwritten then read (the
/// optimizer), more weights read; copies finish after each acquire. Returns whether the
/// overwrite found its frames (a hit).
fn training_step(c: &mut PoolCore, w: &[BufferId], g: BufferId, ms: &mut u64) -> bool {
    use_once(c, w[0], false, ms);
    use_once(c, w[1], false, ms);
    let overwrite_hit = use_once(c, g, true, ms);
    use_once(c, w[0], false, ms);
    use_once(c, g, false, ms);
    use_once(c, w[2], false, ms);
    c.step(t(*ms));
    settle(c, t(*ms));
    overwrite_hit
}

/// [`training_pool`] after `steps` of [`training_step`], with the milliseconds they took.
fn trained_pool(steps: usize) -> (PoolCore, Vec<BufferId>, BufferId, u64) {
    let (mut c, w, g) = training_pool();
    let mut ms = 0;
    for _ in 0..steps {
        training_step(&mut c, &w, g, &mut ms);
    }
    (c, w, g, ms)
}

#[test]
fn a_learned_pool_reserves_frames_without_a_copy_for_a_buffer_its_next_access_overwrites() {
    // Four frames for 8 pages of weights and gradients: every buffer leaves the GPU
    // between its uses, so each access but the overwrite needs its pages brought back.
    let (mut c, w, g, mut ms) = trained_pool(2);
    let before = c.stats();
    for _ in 0..3 {
        assert!(
            training_step(&mut c, &w, g, &mut ms),
            "the overwrite finds frames reserved for it"
        );
    }
    let after = c.stats();
    assert_eq!(
        after.overwrites - before.overwrites,
        3 * 2,
        "the gradients' pages get frames without a load at each step (not prefetched)"
    );
    assert_eq!(
        (
            after.reservations - before.reservations,
            after.reservations_missed - before.reservations_missed
        ),
        (3 * 2, 0),
        "reserved ahead, each used by the overwrite"
    );
    // Per step at most the weights' 3 buffers and one reload of the first (4 frames):
    // 8 pages. Prefetching the gradients' old bytes too made it 10.
    let h2d_pages = (after.h2d_bytes - before.h2d_bytes) / PAGE;
    assert!(h2d_pages <= 3 * 8, "{h2d_pages} pages loaded in 3 steps");
    c.check_invariants();
}

#[test]
fn a_frame_reserved_for_an_overwrite_that_does_not_come_is_given_up_and_the_page_loaded() {
    let (mut c, w, g, mut ms) = trained_pool(3);
    // The next step reads the gradients where the last ones overwrote them.
    for &b in &w[..2] {
        use_once(&mut c, b, false, &mut ms);
    }
    let before = c.stats();
    assert!(before.reservations > before.reservations_missed);
    ms += 1;
    let (h, hit) = c.begin_acquire(g, AccessMode::Shared, t(ms)).unwrap();
    assert!(!hit, "a reserved frame holds none of the page's bytes");
    settle(&mut c, t(ms));
    assert!(c.is_ready(h).unwrap());
    let after = c.stats();
    assert_eq!(
        after.reservations_missed - before.reservations_missed,
        2,
        "both of g's reservations given up"
    );
    assert_eq!(
        (after.h2d_bytes - before.h2d_bytes) / PAGE,
        2,
        "g's pages loaded from the host tier"
    );
    c.release(h, t(ms));
    c.check_invariants();
}

#[test]
fn a_reservation_whose_prediction_no_longer_holds_is_given_up_and_the_page_prefetched() {
    let (mut c, w, g) = training_pool();
    let mut ms = 0;
    // Steps that start by overwriting g: near each step's end g's frames are reserved
    // for the next step's first access.
    let step = |c: &mut PoolCore, discard: bool, ms: &mut u64| {
        let hit = use_once(c, g, discard, ms);
        for &b in &w {
            use_once(c, b, false, ms);
        }
        c.step(t(*ms));
        settle(c, t(*ms));
        hit
    };
    for _ in 0..3 {
        step(&mut c, true, &mut ms);
    }
    let before = c.stats();
    assert!(before.reservations > 0);
    // A step that reads g first: the reservation made for it is given up; this step
    // teaches that g's first access reads.
    assert!(
        !step(&mut c, false, &mut ms),
        "the reserved frames held none of g's bytes"
    );
    // Reserved again? No: g's first access is now predicted to read, so it is
    // prefetched, and the next step's read is a hit.
    let mid = c.stats();
    assert!(step(&mut c, false, &mut ms), "g prefetched for its read");
    let after = c.stats();
    assert_eq!(
        after.reservations, mid.reservations,
        "no reservation for a read"
    );
    assert!(after.prefetch_loads > mid.prefetch_loads);
    c.check_invariants();
}
