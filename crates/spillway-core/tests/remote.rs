//! The remote tier in the state machine, checked against a model of the bytes
//! (`common/mod.rs`): an acquire must see the newest version of each of its pages,
//! whatever the tiers did in between: no page is ever lost or stale.

mod common;

use std::collections::VecDeque;
use std::time::Duration;

use common::*;
use proptest::prelude::*;
use spillway_core::{
    AccessMode, AcquireId, CoreError, DeviceFault, PageLocation, RemoteError, RemoteOpKind,
    ZeroFill,
};
use spillway_types::config::Policy;
use spillway_types::{BufferId, HostSlot};

/// The pool of the loop tests, learned: 4 GPU pages, 8 host pages and 24 buffers of 2
/// pages (48 pages): most live in the remote tier.
fn a_loop_four_times_gpu_plus_host() -> (Model, Vec<BufferId>) {
    let mut m = Model::new(4, 8, 44, Policy::Learned);
    let bufs = (0..24).map(|_| m.core.alloc(2 * PAGE).unwrap()).collect();
    (m, bufs)
}

/// How the loop tests access buffer `i`: every third exclusively.
fn loop_mode(i: usize) -> AccessMode {
    if i.is_multiple_of(3) {
        AccessMode::Exclusive
    } else {
        AccessMode::Shared
    }
}

/// Six steps over `bufs` (each acquired as `loop_mode` says, or overwritten with discard
/// where `overwritten(i)`), letting every op finish between accesses; returns the hits
/// and the reads of the last four steps.
fn loop_six_steps(
    m: &mut Model,
    bufs: &[BufferId],
    overwritten: impl Fn(usize) -> bool,
) -> (u64, u64) {
    let mut hits_late = (0u64, 0u64);
    for step in 0..6 {
        for (i, &b) in bufs.iter().enumerate() {
            if overwritten(i) {
                m.discard_once(b);
            } else {
                m.use_counted(b, loop_mode(i), step >= 2, &mut hits_late);
            }
            // Time passes between accesses: the copies and remote ops of the plan run.
            m.settle();
        }
        m.step();
    }
    hits_late
}

#[test]
fn a_working_set_four_times_gpu_plus_host_keeps_every_version() {
    let (mut m, bufs) = a_loop_four_times_gpu_plus_host();
    let hits_late = loop_six_steps(&mut m, &bufs, |_| false);
    let s = m.core.stats();
    assert!(s.remote_bytes_out > 0 && s.remote_bytes_in > 0, "{s:?}");
    assert!(s.remote_prefetches > 0, "the planner stages pages: {s:?}");
    assert_eq!(
        hits_late.0, hits_late.1,
        "with every op finished between accesses, a learned loop always hits: {s:?}"
    );
}

#[test]
fn alloc_is_bounded_by_host_plus_remote_less_headroom() {
    let mut m = Model::new(2, 4, 8, Policy::Clock);
    // 4 + 8 - 1 headroom = 11 pages.
    m.core.alloc(11 * PAGE).unwrap_err(); // larger than the GPU budget: refused
    for _ in 0..5 {
        m.core.alloc(2 * PAGE).unwrap();
    }
    m.core.alloc(PAGE).unwrap();
    let e = m.core.alloc(PAGE).unwrap_err();
    assert!(e.to_string().contains("full"), "{e}");
}

/// Writes each of `bufs` once (an exclusive acquire), then lets every op finish.
fn write_each_then_settle(m: &mut Model, bufs: &[BufferId]) {
    for &b in bufs {
        m.use_once(b, AccessMode::Exclusive);
    }
    m.settle();
}

#[test]
fn freeing_buffers_drops_their_remote_copies() {
    let mut m = Model::new(2, 4, 16, Policy::Clock);
    let bufs = m.one_page_buffers(8);
    write_each_then_settle(&mut m, &bufs);
    assert!(!m.remote.is_empty(), "some pages went to the remote tier");
    for &b in &bufs {
        m.free(b);
        m.settle();
    }
    assert!(m.remote.is_empty(), "remote copies left: {:?}", m.remote);
    assert_eq!(m.core.stats().remote_pages, 0);
}

/// A clock pool of 1 GPU frame, 2 host slots and 16 remote pages, with `buffers` new
/// buffers of one page each.
fn one_frame_two_slots(buffers: usize) -> (Model, Vec<BufferId>) {
    let mut m = Model::new(1, 2, 16, Policy::Clock);
    let bufs = m.one_page_buffers(buffers);
    (m, bufs)
}

#[test]
fn a_discard_acquire_fetches_nothing_and_drops_the_stale_remote_copy() {
    // 1 GPU frame, 2 host slots: of 4 one-page buffers written once, some live only in
    // the remote tier.
    let (mut m, bufs) = one_frame_two_slots(4);
    write_each_then_settle(&mut m, &bufs);
    let remote_only = *bufs
        .iter()
        .find(|&&b| {
            let pid = page(b, 0);
            m.remote.contains_key(&pid) && !m.slots.values().any(|v| v.0 == pid)
        })
        .expect("a page only the remote tier holds");
    let pid = page(remote_only, 0);
    let before = m.core.stats();
    m.discard_once(remote_only);
    let after = m.core.stats();
    assert_eq!(after.remote_bytes_in, before.remote_bytes_in, "no fetch");
    assert_eq!(after.h2d_bytes, before.h2d_bytes, "no load");
    assert_eq!(after.overwrites, before.overwrites + 1);
    assert!(
        !m.remote.contains_key(&pid),
        "the stale remote copy is dropped"
    );
    // Another buffer takes the frame: the overwritten page is written back, and reads
    // back as its new version.
    m.use_once(
        bufs[(bufs.iter().position(|&b| b == remote_only).unwrap() + 1) % 4],
        AccessMode::Shared,
    );
    m.settle();
    assert!(
        m.core.stats().d2h_bytes > before.d2h_bytes,
        "the dirty page is written back"
    );
    assert!(m.host_access(remote_only, false));
    m.use_once(remote_only, AccessMode::Shared);
}

/// Refuses every spill the core has issued (as a tier with no room does); returns how many.
fn refuse_spills(m: &mut Model, now: Duration) -> usize {
    m.collect();
    let mut refused = 0;
    let mut kept = VecDeque::new();
    while let Some(op) = m.net.pop_front() {
        if op.kind == RemoteOpKind::Spill {
            m.core
                .handle_remote_done(op.id, Err(RemoteError::tier("no peer has room")), now);
            refused += 1;
        } else {
            kept.push_back(op);
        }
    }
    m.net = kept;
    refused
}

/// A pool of 1 GPU frame and 2 host slots whose GPU and host hold dirty pages, and an
/// acquire of another buffer that needs a spill; returns the model, the acquire and when
/// it began (the spill it needs is issued, not finished).
fn an_acquire_that_needs_a_spill() -> (Model, AcquireId, Duration) {
    let (mut m, bufs) = one_frame_two_slots(6);
    for &b in &bufs[..3] {
        m.use_once(b, AccessMode::Exclusive);
        while m.finish_gpu() {}
    }
    let (h, start) = m.begin_acquire(bufs[3], AccessMode::Exclusive);
    while m.finish_gpu() {}
    (m, h, start)
}

#[test]
fn refused_spills_back_off_then_fail_the_pool_with_a_typed_error() {
    // Regression: a refused spill was issued again at once, forever (a livelock with
    // thousands of errors a second). Now spills wait out a doubling backoff, the core asks
    // to be woken through `poll_timeout`, and after `SPILL_DEADLINE` the pool fails.
    let (mut m, h, start) = an_acquire_that_needs_a_spill();
    assert_eq!(
        refuse_spills(&mut m, start),
        1,
        "one spill issued for the acquire"
    );
    assert!(!m.core.is_ready(h).unwrap());
    // Nothing happens until the timer: no spill is issued in between.
    let at = m.core.poll_timeout().expect("a backoff timer is armed");
    assert_eq!(at, start + spillway_core::pool::SPILL_RETRY_MIN);
    m.core.handle_timeout(at - Duration::from_millis(1));
    assert_eq!(
        refuse_spills(&mut m, at),
        0,
        "no spill before the backoff ends"
    );
    // Each retry comes after a wait twice as long, up to the max.
    let mut now = at;
    let mut waits = Vec::new();
    let mut tries = 0;
    loop {
        m.core.handle_timeout(now);
        let n = refuse_spills(&mut m, now);
        tries += n;
        match m.core.is_ready(h) {
            Ok(false) => {}
            Ok(true) => panic!("an acquire became ready with every spill refused"),
            Err(e) => {
                assert!(
                    matches!(e, spillway_core::CoreError::SpillsFailing { .. }),
                    "{e:?}"
                );
                assert!(e.to_string().contains("no peer has room"), "{e}");
                break;
            }
        }
        assert_eq!(n, 1, "one attempt per timer");
        let next = m.core.poll_timeout().expect("still backing off");
        waits.push((next - now).as_millis());
        now = next;
        assert!(tries < 1000, "spills retried without bound: {tries}");
    }
    let failed_after = now - start;
    assert!(
        failed_after >= spillway_core::pool::SPILL_DEADLINE
            && failed_after <= spillway_core::pool::SPILL_DEADLINE + Duration::from_secs(1),
        "gave up after {failed_after:?}"
    );
    assert_eq!(&waits[..4], &[20, 40, 80, 160]);
    assert!(waits.iter().all(|&w| w <= 1000), "{waits:?}");
    // About SPILL_DEADLINE / SPILL_RETRY_MAX attempts, not thousands.
    assert!(tries < 140, "{tries} attempts in {failed_after:?}");
    assert_eq!(m.core.poll_timeout(), None, "no timer once failed");
}

#[test]
fn a_page_that_cannot_be_fetched_loses_its_buffer_not_the_pool() {
    // Regression: one failed fetch set a sticky failure that every later acquire of every
    // buffer reported as "device copy failed".
    let (mut m, bufs) = one_frame_two_slots(6);
    for &b in &bufs {
        m.use_once(b, AccessMode::Exclusive);
        m.settle();
    }
    assert!(m.remote.contains_key(&page(bufs[0], 0)));
    // Buffer 0's page comes back from the remote tier: the tier fails the fetch.
    let (h, _) = m.begin_acquire(bufs[0], AccessMode::Shared);
    let fetch = loop {
        if let Some(i) = m
            .net
            .iter()
            .position(|op| op.kind == RemoteOpKind::Fetch && op.page.buffer == bufs[0])
        {
            break m.net.remove(i).unwrap();
        }
        assert!(
            m.finish_gpu() | m.finish_net(),
            "no fetch of buffer 0 was issued"
        );
    };
    let now = m.t();
    m.core
        .handle_remote_done(fetch.id, Err(RemoteError::tier("peer 2 unreachable")), now);
    let err = m.core.is_ready(h).unwrap_err();
    assert_eq!(
        err,
        CoreError::PageLost {
            buffer: bufs[0],
            page: 0,
            reason: RemoteError::tier("peer 2 unreachable")
        }
    );
    assert_eq!(
        err.to_string(),
        format!("page 0 of {} is lost: peer 2 unreachable", bufs[0])
    );
    m.release(h);
    let s = m.core.stats();
    assert_eq!((s.pages_lost, s.buffers_lost), (1, 1), "{s:?}");
    // The lost buffer refuses acquires and host accesses with the same cause...
    let now = m.t();
    assert_eq!(
        m.core.begin_acquire(bufs[0], AccessMode::Shared, now),
        Err(err.clone())
    );
    assert!(!m.host_access(bufs[0], false));
    // ...while every other buffer still comes back with its newest bytes.
    for &b in &bufs[1..] {
        m.use_once(b, AccessMode::Shared);
        m.settle();
    }
    // And it can be freed: its slot and remote space come back, and a buffer allocated
    // in its place works.
    m.free(bufs[0]);
    m.settle();
    m.core.check_invariants();
    let again = m.core.alloc(PAGE).unwrap();
    m.use_once(again, AccessMode::Exclusive);
    m.settle();
    m.use_once(again, AccessMode::Shared);
    let s = m.core.stats();
    assert_eq!(
        (s.pages_lost, s.buffers_lost),
        (1, 1),
        "counted once: {s:?}"
    );
}

#[test]
fn a_lost_page_fails_only_its_buffer_while_the_loop_keeps_hitting() {
    // The loop of the first test; from step 3 the remote tier has lost every page of two
    // buffers (their only holder died). Those fail with `PageLost`, at every later
    // acquire; every other buffer keeps its newest bytes and keeps hitting.
    let (mut m, bufs) = a_loop_four_times_gpu_plus_host();
    let doomed = [bufs[5], bufs[17]];
    let (mut hits_late, mut lost_seen) = ((0u64, 0u64), 0u64);
    for step in 0..6 {
        if step == 3 {
            m.lost.extend(doomed);
        }
        for (i, &b) in bufs.iter().enumerate() {
            match m.try_acquire(b, loop_mode(i)) {
                Ok((h, hit)) => {
                    m.release(h);
                    if step >= 4 && !doomed.contains(&b) {
                        hits_late.0 += u64::from(hit);
                        hits_late.1 += 1;
                    }
                }
                Err(CoreError::PageLost { buffer, page, .. }) => {
                    assert!(doomed.contains(&buffer) && buffer == b && page < 2);
                    assert!(step >= 3, "lost before the tier lost anything");
                    lost_seen += 1;
                }
                Err(e) => panic!("{e:?}"),
            }
            m.settle();
        }
        m.step();
    }
    // Steps 3, 4 and 5: both doomed buffers fail at each (a buffer that had its pages in
    // the host tier or on the GPU when the tier lost them may fail later, at its first
    // fetch; here every buffer is fetched each step, with 4 + 8 local pages of 48).
    assert_eq!(lost_seen, 6, "{:?}", m.core.stats());
    assert_eq!(
        hits_late.0,
        hits_late.1,
        "every other buffer keeps hitting: {:?}",
        m.core.stats()
    );
    let s = m.core.stats();
    assert_eq!(s.buffers_lost, 2, "{s:?}");
    assert!((2..=4).contains(&s.pages_lost), "{s:?}");
    m.core.check_invariants();
}

#[test]
fn a_remote_tier_that_is_gone_fails_the_pool_at_once() {
    // The link to a daemon-mode client's node died: the spill in flight fails with
    // `TierGone`, and every acquire and host access of every buffer fails at once with
    // `RemoteTierGone` (no backoff for 120 s).
    let (mut m, h, start) = an_acquire_that_needs_a_spill();
    m.collect();
    let spill = m.net.pop_front().expect("a spill in flight");
    assert_eq!(spill.kind, RemoteOpKind::Spill);
    let gone = RemoteError::TierGone {
        message: "the node daemon closed the connection".into(),
    };
    m.core
        .handle_remote_done(spill.id, Err(gone.clone()), start);
    let want = CoreError::RemoteTierGone { reason: gone };
    assert_eq!(m.core.is_ready(h), Err(want.clone()));
    assert_eq!(m.core.poll_timeout(), None, "no backoff timer");
    m.release(h);
    let now = m.t();
    for b in 1..=6 {
        assert_eq!(
            m.core.begin_acquire(BufferId(b), AccessMode::Shared, now),
            Err(want.clone())
        );
        assert_eq!(
            m.core.begin_host_access(BufferId(b), 0, 1, false, now),
            Err(want.clone())
        );
    }
    assert!(
        want.to_string().contains("connect to the node again"),
        "{want}"
    );
}

#[test]
fn a_page_never_written_is_zero_filled_into_a_slot_at_once() {
    let mut m = Model::new(2, 4, 8, Policy::Learned);
    let b = m.core.alloc(PAGE + 100).unwrap();
    let now = m.t();
    // Not in a slot yet: the access waits, and both pages get slots at once, to be
    // zeroed by the driver before anything reads them; no remote op, nothing in flight.
    assert_eq!(
        m.core.begin_host_access(b, 0, PAGE + 100, false, now),
        Ok(None)
    );
    let fills: Vec<ZeroFill> = std::iter::from_fn(|| m.core.poll_zero_fill()).collect();
    assert_eq!(
        fills,
        vec![
            ZeroFill {
                page: page(b, 0),
                slot: HostSlot(0),
                bytes: PAGE
            },
            ZeroFill {
                page: page(b, 1),
                slot: HostSlot(1),
                bytes: 100
            },
        ]
    );
    assert_eq!(m.core.poll_remote(), None);
    assert_eq!(m.core.transfers_in_flight(), 0);
    let now = m.t();
    assert_eq!(
        m.core.begin_host_access(b, 0, PAGE + 100, false, now),
        Ok(Some(vec![
            PageLocation::Host(HostSlot(0)),
            PageLocation::Host(HostSlot(1))
        ]))
    );
    m.core.end_host_access(b, 0, PAGE + 100, false, now);
    assert_eq!(m.core.stats().remote_demand_fetches, 0);
}

#[test]
fn a_zero_fill_that_fails_loses_its_buffer_only() {
    let mut m = Model::new(2, 4, 8, Policy::Clock);
    let (lost, kept) = (m.core.alloc(PAGE).unwrap(), m.core.alloc(PAGE).unwrap());
    let now = m.t();
    let (h, hit) = m.core.begin_acquire(lost, AccessMode::Shared, now).unwrap();
    assert!(!hit);
    let fill = m.core.poll_zero_fill().unwrap();
    assert_eq!(fill.page.buffer, lost);
    // The slot holds whatever it held (the model's copies still read it).
    m.slots.insert(fill.slot, (fill.page, u64::MAX));
    let fault = DeviceFault::new("slot out of range");
    m.core
        .handle_zero_fill_failed(fill.page, fault.clone(), now);
    assert_eq!(
        m.core.is_ready(h),
        Err(spillway_core::CoreError::DeviceFailed(fault))
    );
    m.core.release(h, now);
    m.collect();
    m.use_once(kept, AccessMode::Exclusive);
    m.free(lost);
    m.settle();
    m.core.check_invariants();
}

#[test]
fn a_spill_that_lands_after_refusals_resets_the_backoff() {
    let (mut m, h, start) = an_acquire_that_needs_a_spill();
    assert_eq!(refuse_spills(&mut m, start), 1);
    let at = m.core.poll_timeout().unwrap();
    m.core.handle_timeout(at);
    m.now = (at.as_micros() / 100) as u64 + 1;
    // This time the tier takes it: the acquire completes and no timer is left.
    while !m.core.is_ready(h).unwrap() {
        assert!(m.finish_gpu() | m.finish_net(), "stuck");
    }
    assert_eq!(m.core.poll_timeout(), None);
    let now = m.t();
    m.core.release(h, now);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    /// Random sequences over a small GPU, a small host tier and a remote tier: every
    /// acquire and host access sees the newest version of its pages, and no invariant
    /// breaks.
    #[test]
    fn random_sequences_never_lose_a_version(
        ops in ops(false),
        policy in prop_oneof![Just(Policy::Learned), Just(Policy::Clock), Just(Policy::OnDemand)],
    ) {
        let mut m = Model::new(4, 6, 24, policy);
        m.run_ops(ops)?;
        let s = m.core.stats();
        prop_assert!(s.slots_in_use <= s.slots_total && s.remote_pages <= s.remote_pages_total);
    }

    /// The same with GPU copies finishing in bursts, each told to the core in one call
    /// (`handle_transfers_done`, one pass of the pump): every version read is still the
    /// newest and no invariant breaks.
    #[test]
    fn random_sequences_with_completions_in_bursts_never_lose_a_version(
        ops in ops(false),
        policy in prop_oneof![Just(Policy::Learned), Just(Policy::Clock), Just(Policy::OnDemand)],
    ) {
        let mut m = Model::new(4, 6, 24, policy);
        m.bursts = true;
        m.run_ops(ops)?;
        let s = m.core.stats();
        prop_assert!(s.slots_in_use <= s.slots_total && s.remote_pages <= s.remote_pages_total);
    }
}

#[test]
fn completions_told_in_one_call_leave_the_pool_as_told_one_by_one() {
    // Two pools run the same loop over more buffers than frames, every acquire checking
    // it sees the newest version; one hears of its copies one by one, the other in
    // bursts: the same bytes move each way and every page ends as written.
    let run = |bursts: bool| {
        let mut m = Model::new(4, 16, 0, Policy::Learned);
        m.bursts = bursts;
        let bufs = m.one_page_buffers(8);
        for _ in 0..4 {
            for &b in &bufs {
                m.use_once(b, AccessMode::Exclusive);
            }
            m.step();
        }
        m.settle();
        for &b in &bufs {
            assert!(m.host_access(b, false));
        }
        (m.core.stats(), m.largest_burst)
    };
    let (one, _) = run(false);
    let (burst, largest) = run(true);
    assert!(largest > 1, "some copies finished together");
    assert!(one.h2d_bytes > 0 && one.d2h_bytes > 0);
    assert_eq!(one.h2d_bytes, burst.h2d_bytes);
    assert_eq!(one.d2h_bytes, burst.d2h_bytes);
}

#[test]
fn a_loop_that_overwrites_some_buffers_keeps_every_version_and_hits_the_others() {
    // As above, with every fourth buffer overwritten (discard) instead of read: those
    // are predicted to be overwritten (frames reserved, nothing staged from the remote
    // tier), and every version read is still the newest.
    let (mut m, bufs) = a_loop_four_times_gpu_plus_host();
    let hits_late = loop_six_steps(&mut m, &bufs, |i| i % 4 == 1);
    let s = m.core.stats();
    assert!(s.overwrites > 0 && s.remote_prefetches > 0, "{s:?}");
    assert_eq!(
        hits_late.0, hits_late.1,
        "every buffer read is prefetched past the overwritten ones: {s:?}"
    );
}

/// Hits of the reads and pages loaded in the last four of six steps over `bufs`, every
/// fourth buffer overwritten (with discard, or read and rewritten exclusively), with time
/// for only three copies and three remote ops after each access.
fn reads_around_overwrites(discard: bool) -> ((u64, u64), u64) {
    let (mut m, bufs) = a_loop_four_times_gpu_plus_host();
    let mut hits = (0u64, 0u64);
    let mut loaded = 0;
    for step in 0..6 {
        let h2d = m.core.stats().h2d_bytes;
        for (i, &b) in bufs.iter().enumerate() {
            if i % 4 == 1 {
                if discard {
                    m.discard_once(b);
                } else {
                    m.use_once(b, AccessMode::Exclusive);
                }
            } else {
                m.use_counted(b, loop_mode(i), step >= 2, &mut hits);
            }
            for _ in 0..3 {
                m.finish_gpu();
                m.finish_net();
            }
        }
        m.step();
        if step >= 2 {
            loaded += (m.core.stats().h2d_bytes - h2d) / PAGE;
        }
    }
    (hits, loaded)
}

#[test]
fn overwriting_with_discard_moves_fewer_pages_and_slows_no_read_over_a_remote_tier() {
    // Predicted overwrites get frames reserved and nothing staged: the reads planned
    // after them are prefetched as well as when those buffers are read and rewritten
    // (a predicted overwrite whose bytes were in the remote tier used to stop the GPU
    // plan until its acquire: 21 hits of 72 against 24).
    let ((hits, reads), loaded) = reads_around_overwrites(true);
    let ((hits_rmw, reads_rmw), loaded_rmw) = reads_around_overwrites(false);
    assert_eq!(reads, reads_rmw);
    assert!(
        hits >= hits_rmw,
        "{hits} hits of {reads} against {hits_rmw}"
    );
    assert!(
        loaded < loaded_rmw,
        "{loaded} pages loaded against {loaded_rmw}"
    );
}
