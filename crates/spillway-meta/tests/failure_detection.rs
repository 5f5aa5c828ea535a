//! Seeded simulations of failure detection: a member the leader stops hearing from is
//! declared down within `down_after_ticks`, comes back up at a new epoch with its earlier
//! records dead, and a healthy pool declares nobody down. Each test prints its seed when
//! it fails; rerun with `SPILLWAY_SEED=<seed>` to replay it.

mod common;

use common::MAX_MS;
use spillway_meta::limits::DOWN_AFTER_TICKS_DEFAULT;
use spillway_meta::sim::{SimCluster, seed_from_env};
use spillway_meta::{Batch, Epoch, Extent, MemberState, NodeId, Update};
use spillway_types::{BufferId, PageId};

/// A cluster of `voters` voters (see [`common::cluster`]).
fn cluster(seed: u64, voters: u64) -> (SimCluster, tempfile::TempDir) {
    common::cluster(seed, |config| config.voters = voters)
}

/// The detection timeout at the simulation's tick, in ms.
fn down_after_ms(c: &SimCluster) -> u64 {
    DOWN_AFTER_TICKS_DEFAULT * c.config().tick_ms
}

/// `pages` pages of buffer 1 in slot 0 at `a` and slot 1 at `b`, both at epoch 1.
fn place_two_copies(c: &mut SimCluster, a: NodeId, b: NodeId, pages: u32) {
    let mut batch = Batch::new(c.now_ms());
    for (slot, holder) in [(0, a), (1, b)] {
        batch.push(Update::Place {
            extent: Extent::new(BufferId(1), 0, pages),
            holder,
            epoch: Epoch(1),
            version: 1,
            reservation: None,
            replica: slot,
        });
    }
    let applied = c.commit(&batch, MAX_MS);
    assert_eq!(applied.rejected(), 0, "{applied:?}");
}

/// The state of `member` as `observer` has applied it.
fn member_state(c: &SimCluster, observer: NodeId, member: NodeId) -> (MemberState, Epoch) {
    let n = c.node(observer);
    let m = n.state().member(member).expect("a member");
    (m.state, m.epoch)
}

fn page0() -> PageId {
    PageId {
        buffer: BufferId(1),
        index: 0,
    }
}

/// Runs until every running node has `member` up again at epoch 2; panics after `MAX_MS`.
fn wait_back_up(c: &mut SimCluster, member: NodeId) {
    c.run_until(MAX_MS, |c| {
        c.live_nodes()
            .iter()
            .all(|&n| member_state(c, n, member) == (MemberState::Up, Epoch(2)))
    })
    .unwrap_or_else(|| panic!("seed {}: {member} never came back up", c.seed()));
}

/// A follower of the current leader, other than `not`.
fn a_follower(c: &SimCluster, not: &[NodeId]) -> NodeId {
    let leader = c.leader().expect("a leader");
    c.live_nodes()
        .into_iter()
        .find(|n| *n != leader && !not.contains(n))
        .expect("a follower")
}

#[test]
fn a_killed_node_is_declared_down_within_the_timeout_and_comes_back_at_a_new_epoch() {
    let seed = seed_from_env(141);
    let (mut c, _dir) = cluster(seed, 3);
    let leader = c.wait_for_leader(MAX_MS);
    let dead = a_follower(&c, &[]);
    let other = a_follower(&c, &[dead]);
    place_two_copies(&mut c, dead, other, 4);
    let page_bytes = c.config().page_bytes;

    c.kill(dead);
    let took = c
        .run_until(MAX_MS, |c| {
            member_state(c, leader, dead) == (MemberState::Down, Epoch(1))
        })
        .unwrap_or_else(|| panic!("seed {seed}: {dead} never declared down"));
    let timeout = down_after_ms(&c);
    // Heard last at most one tick before the kill; declared at the leader's first tick
    // past the timeout, then committed within a round trip.
    assert!(
        (timeout - 2 * c.config().tick_ms..=timeout + 2 * c.config().tick_ms).contains(&took),
        "seed {seed}: declared down after {took} ms, timeout {timeout} ms"
    );
    {
        let n = c.node(leader);
        let s = n.state();
        let holders = s.holders_of(page0());
        assert_eq!(holders.len(), 2);
        assert!(!s.is_live(&holders[0].2), "the dead node's copy is dead");
        assert!(s.is_live(&holders[1].2));
        assert_eq!(s.holder_of(page0()).unwrap().1.node, other);
        let health = s.replication_health();
        assert_eq!(health.under_replicated_bytes, 4 * page_bytes);
        assert_eq!(health.lost_bytes, 0);
        let under = s.under_replicated(BufferId(1)..BufferId(2));
        assert_eq!(under.len(), 1);
        assert_eq!((under[0].slot, under[0].dead.node), (0, dead));
        assert_eq!(under[0].live.len(), 1);
        assert_eq!(under[0].live[0].1.node, other);
    }
    // Nobody else went down.
    for n in [leader, other] {
        assert_eq!(member_state(&c, leader, n), (MemberState::Up, Epoch(1)));
    }

    // It restarts: it catches up, finds itself down and proposes itself up, at epoch 2.
    c.restart(dead).unwrap();
    wait_back_up(&mut c, dead);
    let n = c.node(dead);
    let s = n.state();
    let holders = s.holders_of(page0());
    assert_eq!(holders[0].2.epoch, Epoch(1), "the old record stays, dead");
    assert!(!s.is_live(&holders[0].2));
    assert_eq!(s.usage(dead).unwrap().used_bytes, 0);
    assert_eq!(
        s.replication_health().under_replicated_bytes,
        4 * page_bytes
    );
    assert!(s.member(dead).unwrap().up_since_ms > 0);
    drop(n);
    c.check_consistency().unwrap();
}

#[test]
fn a_cut_off_node_is_declared_down_and_brings_itself_back_when_the_partition_heals() {
    let seed = seed_from_env(142);
    let (mut c, _dir) = cluster(seed, 3);
    let leader = c.wait_for_leader(MAX_MS);
    let cut = a_follower(&c, &[]);
    // As a SIGSTOP would: the process keeps its state, nobody hears from it.
    c.isolate(cut);
    let took = c
        .run_until(MAX_MS, |c| {
            member_state(c, leader, cut).0 == MemberState::Down
        })
        .unwrap_or_else(|| panic!("seed {seed}: {cut} never declared down"));
    assert!(
        took <= down_after_ms(&c) + 2 * c.config().tick_ms,
        "seed {seed}: {took} ms"
    );
    // The cut-off node itself does not know yet.
    assert_eq!(member_state(&c, cut, cut), (MemberState::Up, Epoch(1)));
    c.heal();
    wait_back_up(&mut c, cut);
    assert!(c.node(cut).status().counters.member_state_proposals >= 1);
    c.check_consistency().unwrap();
}

#[test]
fn the_leaders_death_is_detected_by_the_next_leader_and_nobody_else_goes_down() {
    let seed = seed_from_env(143);
    let (mut c, _dir) = cluster(seed, 5);
    let old = c.wait_for_leader(MAX_MS);
    c.kill(old);
    let took = c
        .run_until(MAX_MS, |c| {
            c.leader()
                .is_some_and(|l| l != old && member_state(c, l, old).0 == MemberState::Down)
        })
        .unwrap_or_else(|| panic!("seed {seed}: the old leader {old} never declared down"));
    // An election (at most about 2 election timeouts), then the whole timeout from the
    // new leader's first tick.
    let election_ms = 2 * c.config().election_ticks_max as u64 * c.config().tick_ms;
    assert!(
        took <= election_ms + down_after_ms(&c) + 2 * c.config().tick_ms,
        "seed {seed}: {took} ms"
    );
    let new = c.leader().unwrap();
    c.run_for_ms(3 * down_after_ms(&c));
    for n in c.live_nodes() {
        assert_eq!(member_state(&c, new, n), (MemberState::Up, Epoch(1)), "{n}");
    }
    c.check_consistency().unwrap();
}

#[test]
fn a_healthy_pool_declares_nobody_down() {
    let seed = seed_from_env(144);
    let (mut c, _dir) = cluster(seed, 5);
    // A lossy, jittery LAN: 2% of messages lost, up to 20 ms one way.
    c.set_drop_rate(0.02);
    c.set_latency_us(200, 20_000);
    c.wait_for_leader(MAX_MS);
    // 60 s of simulated time, with proposals going on.
    for second in 0..60u64 {
        let mut b = Batch::new(c.now_ms());
        b.push(Update::SetCapacity {
            node: NodeId(1 + second % 5),
            capacity_bytes: 1 << 30,
        });
        let _ = c.propose(&b);
        c.run_for_ms(1000);
    }
    assert!(c.wait_converged(MAX_MS), "seed {seed}");
    for observer in c.live_nodes() {
        let n = c.node(observer);
        for m in n.state().members() {
            assert_eq!(
                (m.state, m.epoch),
                (MemberState::Up, Epoch(1)),
                "seed {seed}: {m:?}"
            );
        }
        assert_eq!(n.status().counters.member_state_proposals, 0, "seed {seed}");
    }
    c.check_consistency().unwrap();
}
