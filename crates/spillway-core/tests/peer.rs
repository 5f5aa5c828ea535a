//! The peer-GPU tier in the state machine, checked against the model of the bytes
//! (`common/mod.rs`): clean pages leaving the GPU leave copies in frames a neighbouring
//! GPU lends, loads come from them, the lender takes frames back, and no acquire ever
//! sees a stale version; no copy touches a frame that is not lent.

mod common;

use common::*;
use proptest::prelude::*;
use spillway_core::AccessMode;
use spillway_types::BufferId;
use spillway_types::config::Policy;

/// 4 GPU frames, a host tier that holds everything, `policy`, the peer lending `peer`
/// frames, and 8 buffers of 2 pages (16 pages: 4x the GPU).
fn pool(policy: Policy, peer: u32) -> (Model, Vec<BufferId>) {
    let mut m = Model::new(4, 32, 0, policy);
    m.lend(peer);
    let bufs = (0..8).map(|_| m.core.alloc(2 * PAGE).unwrap()).collect();
    (m, bufs)
}

/// `steps` steps over `bufs`, every buffer read (every fourth also written), every copy
/// finished between accesses; returns the hits of the steps after the first two and the
/// accesses they counted.
fn read_loop(m: &mut Model, bufs: &[BufferId], steps: usize) -> (u64, u64) {
    let mut hits = (0, 0);
    for step in 0..steps {
        for (i, &b) in bufs.iter().enumerate() {
            let mode = if i % 4 == 3 {
                AccessMode::Exclusive
            } else {
                AccessMode::Shared
            };
            m.use_counted(b, mode, step >= 2, &mut hits);
            m.settle();
        }
        m.step();
    }
    hits
}

#[test]
fn clean_pages_leave_copies_on_the_peer_and_load_from_them_not_the_host() {
    let (mut with, bufs) = pool(Policy::Learned, 8);
    read_loop(&mut with, &bufs, 6);
    let (mut without, bufs_without) = pool(Policy::Learned, 0);
    read_loop(&mut without, &bufs_without, 6);
    let (s, base) = (with.core.stats(), without.core.stats());
    assert!(s.peer_fills > 0 && s.peer_loads > 0, "{s:?}");
    assert_eq!(s.p2d_bytes, s.peer_loads * PAGE, "{s:?}");
    assert_eq!(s.d2p_bytes, s.peer_fills * PAGE, "{s:?}");
    assert_eq!((base.peer_fills, base.p2d_bytes), (0, 0), "{base:?}");
    // About the same loads, under 60% of them over the host link: the peer's copies
    // serve the rest (the written buffers' pages, a quarter, always come from the host).
    let loads = (s.h2d_bytes + s.p2d_bytes) as f64;
    assert!(
        (loads / base.h2d_bytes as f64 - 1.0).abs() < 0.1
            && (s.h2d_bytes as f64) < 0.6 * base.h2d_bytes as f64,
        "host→device {} bytes with the peer, {} without; peer→device {}",
        s.h2d_bytes,
        base.h2d_bytes,
        s.p2d_bytes
    );
    assert!(
        s.peer_frames_in_use <= 8 && s.peer_frames_total == 8,
        "{s:?}"
    );
}

#[test]
fn a_page_written_on_the_gpu_or_by_the_host_never_loads_its_old_peer_copy() {
    // 1 GPU frame: every access evicts the other buffer, and a clean one leaves a copy.
    let mut m = Model::new(1, 8, 0, Policy::Clock);
    m.lend(4);
    let bufs = m.one_page_buffers(2);
    m.use_once(bufs[0], AccessMode::Shared);
    m.use_once(bufs[1], AccessMode::Shared);
    m.settle();
    assert_eq!(m.core.stats().peer_fills, 1, "bufs[0] left a copy");
    // Written on the GPU: the copy is stale and dropped; the next load reads the host
    // (the model checks the version on every acquire).
    m.use_once(bufs[0], AccessMode::Exclusive);
    m.use_once(bufs[1], AccessMode::Shared);
    m.settle();
    m.use_once(bufs[0], AccessMode::Shared);
    // Written by the host while it has a copy on the peer.
    m.use_once(bufs[1], AccessMode::Shared);
    m.settle();
    assert!(m.host_access(bufs[0], true));
    m.use_once(bufs[0], AccessMode::Shared);
    m.settle();
    let s = m.core.stats();
    assert!(
        s.peer_loads >= 1,
        "an unchanged page loads from its copy: {s:?}"
    );
}

#[test]
fn frames_taken_back_are_given_up_once_their_copies_land_and_never_used_again() {
    let (mut m, bufs) = pool(Policy::Learned, 8);
    read_loop(&mut m, &bufs, 3);
    assert!(m.core.stats().peer_frames_in_use > 2);
    // Ask back all but 2 in the middle of a step, with copies in flight.
    let (h, _) = m.acquire(bufs[0], AccessMode::Shared);
    m.release(h);
    let in_flight = m.gpu.len();
    m.lend(2);
    // Bounded: the frames come back once the copies in flight when asked have landed
    // (the core starts none on them after the ask; the model checks every copy).
    for _ in 0..in_flight {
        m.finish_gpu();
    }
    assert_eq!(
        m.peer_lent, 2,
        "given back after {in_flight} copies in flight landed"
    );
    assert!(m.core.stats().peer_frames_in_use <= 2);
    // The loop goes on over the 2 frames left, every version the newest.
    read_loop(&mut m, &bufs, 3);
    let s = m.core.stats();
    assert!(
        s.peer_frames_in_use <= 2 && s.peer_frames_total == 2,
        "{s:?}"
    );
    // Lent again: used again.
    let loads = s.peer_loads;
    m.lend(8);
    read_loop(&mut m, &bufs, 3);
    assert!(m.core.stats().peer_frames_in_use > 2);
    assert!(m.core.stats().peer_loads > loads);
}

#[test]
fn a_peer_whose_copies_fail_costs_those_copies_not_the_pool() {
    let (mut m, bufs) = pool(Policy::Learned, 8);
    read_loop(&mut m, &bufs, 2);
    let before = m.core.stats();
    assert!(before.peer_frames_in_use > 0, "{before:?}");
    // The peer dies: every copy to or from it fails from now on, with loads from it
    // in flight. Every acquire still gets the newest version, from the host.
    m.peer_fails = true;
    let (hits, reads) = read_loop(&mut m, &bufs, 4);
    let s = m.core.stats();
    assert!(s.peer_errors > 0, "{s:?}");
    assert!(
        s.h2d_bytes > before.h2d_bytes,
        "loads fall back to the host: {s:?}"
    );
    assert_eq!(
        s.p2d_bytes, before.p2d_bytes,
        "no load from the peer lands: {s:?}"
    );
    assert!(reads > 0 && hits <= reads);
    // Its copies are gone as they fail: none is left to fail again and again.
    assert!(s.peer_frames_in_use <= before.peer_frames_in_use, "{s:?}");
}

#[test]
fn taking_every_frame_back_leaves_a_pool_that_works_from_the_host() {
    let (mut m, bufs) = pool(Policy::Clock, 6);
    read_loop(&mut m, &bufs, 2);
    m.lend(0);
    m.settle();
    assert_eq!(m.peer_lent, 0);
    let loads = m.core.stats().peer_loads;
    read_loop(&mut m, &bufs, 2);
    let s = m.core.stats();
    assert_eq!((s.peer_loads, s.peer_frames_in_use), (loads, 0), "{s:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]
    /// Random sequences over a small GPU and a peer that lends and takes back frames,
    /// with a host tier that holds every page or a small one over a remote tier (pages
    /// leave their slots, and their copies on the peer with them, and come back): every
    /// acquire and host access sees the newest version of its pages, no copy touches a
    /// frame not lent, and no invariant breaks.
    #[test]
    fn random_sequences_with_a_lending_peer_never_lose_a_version(
        ops in ops(true),
        policy in prop_oneof![Just(Policy::Learned), Just(Policy::Clock), Just(Policy::OnDemand)],
        (host, remote) in prop_oneof![Just((24u64, 0u64)), Just((6, 24))],
    ) {
        let mut m = Model::new(3, host, remote, policy);
        m.lend(4);
        m.run_ops(ops)?;
        prop_assert_eq!(m.peer_lent, m.peer_asked, "every frame asked back came back");
    }
}
