//! Seeded simulations of the metadata group: elections, fail-over, restart, snapshots,
//! membership changes, capacity and fencing. Each test prints its seed when it fails;
//! rerun with `SPILLWAY_SEED=<seed>` to replay it.

mod common;

use common::{MAX_MS, cluster};
use spillway_meta::sim::{SimCluster, seed_from_env};
use spillway_meta::{
    Applied, Batch, Epoch, Extent, MemberState, MembershipChange, NodeId, Rejection, ReservationId,
    Update,
};
use spillway_types::{BufferId, PageId};

/// A batch placing `count` one-page extents of `buffer` at `holder`, epoch 1.
fn placements(now_ms: u64, buffer: u64, count: u32, holder: u64) -> Batch {
    let mut b = Batch::new(now_ms);
    for i in 0..count {
        b.push(Update::Place {
            extent: Extent::new(BufferId(buffer), i, 1),
            holder: NodeId(holder),
            epoch: Epoch(1),
            version: 1,
            reservation: None,
            replica: 0,
        });
    }
    b
}

fn all_ok(applied: &Applied) {
    match applied {
        Applied::Batch { outcomes } => {
            for o in outcomes {
                assert_eq!(o, &Ok(()));
            }
        }
        other => panic!("expected a batch, got {other:?}"),
    }
}

fn page(buffer: u64, index: u32) -> PageId {
    PageId {
        buffer: BufferId(buffer),
        index,
    }
}

#[test]
fn three_nodes_elect_a_leader_and_commit() {
    // This one fsyncs, as a deployment does.
    let (mut c, _dir) = cluster(seed_from_env(1), |cfg| cfg.sync_writes = true);
    let leader = c.wait_for_leader(MAX_MS);
    let applied = c.commit(&placements(c.now_ms(), 1, 100, 2), MAX_MS);
    all_ok(&applied);
    assert!(c.wait_converged(MAX_MS));
    // Followers refuse proposals and name the leader.
    let follower = c.live_nodes().into_iter().find(|&n| n != leader).unwrap();
    let refused = c
        .with_node(follower, |n| n.propose(&placements(0, 9, 1, 1)))
        .unwrap();
    assert_eq!(
        refused.unwrap_err(),
        spillway_meta::ProposeError::NotLeader {
            leader: Some(leader)
        }
    );
    for id in c.live_nodes() {
        let guard = c.node(id);
        let s = guard.state();
        assert_eq!(s.extent_count(), 100, "{id}");
        assert_eq!(s.holder_of(page(1, 42)).unwrap().1.node, NodeId(2));
    }
    c.check_consistency().unwrap();
    assert_eq!(c.leader(), Some(leader));
    let peers = c.node(leader).peers();
    assert_eq!(peers.len(), 2);
    let commit = c.node(leader).commit_index();
    assert!(
        peers
            .iter()
            .all(|p| p.matched_index == commit && p.recently_active)
    );
}

/// Commits `batches` batches of `per_batch` extents of fresh buffers at node 2 and
/// returns the buffers they used.
fn commit_many(c: &mut SimCluster, first_buffer: u64, batches: u64, per_batch: u32) -> Vec<u64> {
    let mut used = Vec::new();
    for b in 0..batches {
        let buffer = first_buffer + b;
        let applied = c.commit(&placements(c.now_ms(), buffer, per_batch, 2), MAX_MS);
        all_ok(&applied);
        used.push(buffer);
    }
    used
}

fn assert_has(c: &SimCluster, node: NodeId, buffers: &[u64], per_batch: u32) {
    let guard = c.node(node);
    let s = guard.state();
    for &b in buffers {
        for i in [0, per_batch - 1] {
            assert!(
                s.holder_of(page(b, i)).is_some(),
                "{node} lost buffer {b} page {i}"
            );
        }
    }
}

#[test]
fn killing_the_leader_elects_another_and_loses_nothing_committed() {
    let (mut c, _dir) = cluster(seed_from_env(2), |_| {});
    let old = c.wait_for_leader(MAX_MS);
    let committed = commit_many(&mut c, 100, 10, 50);
    c.kill(old);
    let took_ms = c
        .run_until(MAX_MS, |c| c.leader().is_some_and(|l| l != old))
        .expect("a new leader");
    let new = c.leader().unwrap();
    assert_ne!(new, old);
    assert!(took_ms < 2_000, "fail-over took {took_ms} ms");
    // Everything committed before the kill is there, and the group still commits.
    assert_has(&c, new, &committed, 50);
    let more = commit_many(&mut c, 200, 3, 50);
    assert!(c.wait_converged(MAX_MS));
    for id in c.live_nodes() {
        assert_has(&c, id, &committed, 50);
        assert_has(&c, id, &more, 50);
    }
    c.check_consistency().unwrap();
}

#[test]
fn a_killed_node_restarts_from_its_log_and_catches_up() {
    let (mut c, _dir) = cluster(seed_from_env(3), |_| {});
    let leader = c.wait_for_leader(MAX_MS);
    let before = commit_many(&mut c, 100, 5, 20);
    assert!(c.wait_converged(MAX_MS));
    let victim = c.live_nodes().into_iter().find(|&n| n != leader).unwrap();
    let applied_before = c.node(victim).state().applied_index();
    c.kill(victim);
    let during = commit_many(&mut c, 200, 5, 20);
    c.restart(victim).unwrap();
    // Straight after restart the node has its own log back (the snapshot plus replay).
    assert!(c.node(victim).state().applied_index() >= 1);
    assert!(c.wait_converged(MAX_MS));
    assert!(c.node(victim).state().applied_index() > applied_before);
    assert_has(&c, victim, &before, 20);
    assert_has(&c, victim, &during, 20);
    assert_eq!(
        c.node(victim).status().counters.snapshots_installed,
        0,
        "a short absence is caught up from the log"
    );
    c.check_consistency().unwrap();

    // The whole group restarts from disk.
    for id in c.live_nodes() {
        c.kill(id);
    }
    for id in [1, 2, 3] {
        c.restart(NodeId(id)).unwrap();
    }
    c.wait_for_leader(MAX_MS);
    let after = commit_many(&mut c, 300, 1, 20);
    assert!(c.wait_converged(MAX_MS));
    for id in c.live_nodes() {
        assert_has(&c, id, &before, 20);
        assert_has(&c, id, &during, 20);
        assert_has(&c, id, &after, 20);
    }
    c.check_consistency().unwrap();
}

#[test]
fn a_node_far_behind_is_sent_a_snapshot() {
    let (mut c, _dir) = cluster(seed_from_env(4), |cfg| {
        cfg.snapshot_interval_entries = 16;
        cfg.log_entries_kept_after_snapshot = 4;
    });
    let leader = c.wait_for_leader(MAX_MS);
    let victim = c.live_nodes().into_iter().find(|&n| n != leader).unwrap();
    c.kill(victim);
    let missed = commit_many(&mut c, 100, 60, 10);
    let l = c.leader().unwrap();
    let status = c.node(l).status();
    assert!(status.counters.snapshots_taken >= 2, "{status:?}");
    assert!(
        status.first_log_index > 2,
        "the log was compacted: {status:?}"
    );
    c.restart(victim).unwrap();
    assert!(c.wait_converged(MAX_MS));
    let vs = c.node(victim).status();
    assert!(vs.counters.snapshots_installed >= 1, "{vs:?}");
    assert_has(&c, victim, &missed, 10);
    c.check_consistency().unwrap();
    // The installed snapshot survives a restart of the node that received it.
    c.kill(victim);
    c.restart(victim).unwrap();
    assert_has(&c, victim, &missed, 10);
    let more = commit_many(&mut c, 500, 3, 10);
    assert!(c.wait_converged(MAX_MS));
    assert_has(&c, victim, &more, 10);
    c.check_consistency().unwrap();
}

/// Starts node `id` empty and commits its addition as a learner.
fn add_learner(c: &mut SimCluster, id: NodeId) -> Applied {
    c.add_node(id).unwrap();
    let info = c.member_info(id);
    c.commit_membership(&MembershipChange::AddLearner { member: info }, MAX_MS)
}

#[test]
fn nodes_join_leave_and_replace() {
    let (mut c, _dir) = cluster(seed_from_env(5), |cfg| {
        cfg.snapshot_interval_entries = 32;
        cfg.log_entries_kept_after_snapshot = 8;
    });
    let leader = c.wait_for_leader(MAX_MS);
    let early = commit_many(&mut c, 100, 40, 5);

    // Join: node 4 starts empty, is added as a learner, catches up, becomes a voter.
    let applied = add_learner(&mut c, NodeId(4));
    assert!(
        matches!(&applied, Applied::Membership { learners, .. } if learners.contains(&NodeId(4)))
    );
    assert!(c.wait_converged(MAX_MS));
    assert_has(&c, NodeId(4), &early, 5);
    c.commit_membership(&MembershipChange::Promote { node: NodeId(4) }, MAX_MS);
    assert!(c.wait_converged(MAX_MS));
    let s = c.node(leader).status();
    assert_eq!(s.voters.len(), 4, "{s:?}");
    let member = c
        .node(NodeId(4))
        .state()
        .member(NodeId(4))
        .cloned()
        .unwrap();
    assert_eq!(member.role, spillway_meta::RaftRole::Voter);
    assert_eq!(member.epoch, Epoch(1));

    // Replace: node 5 joins as a learner and takes a follower's place in one joint step.
    let old = c
        .live_nodes()
        .into_iter()
        .find(|&n| n != c.leader().unwrap() && n != NodeId(4))
        .unwrap();
    add_learner(&mut c, NodeId(5));
    assert!(c.wait_converged(MAX_MS));
    c.commit_membership(
        &MembershipChange::Replace {
            old,
            new: NodeId(5),
        },
        MAX_MS,
    );
    // raft-rs leaves the joint configuration by itself.
    c.run_until(MAX_MS, |c| {
        let l = c.leader().unwrap();
        let s = c.node(l).status();
        !s.voters.contains(&old) && s.voters.contains(&NodeId(5)) && s.voters.len() == 4
    })
    .expect("joint configuration left");
    c.kill(old);
    let l = c.leader().unwrap();
    assert!(c.node(l).state().member(old).is_none());

    // Leave: a follower is removed. The leader refuses to remove itself.
    let l = c.leader().unwrap();
    assert_eq!(
        c.propose_membership(&MembershipChange::Remove { node: l })
            .unwrap_err(),
        spillway_meta::ProposeError::RemovesLeader
    );
    let gone = c
        .live_nodes()
        .into_iter()
        .find(|&n| n != l && n != NodeId(5))
        .unwrap();
    c.commit_membership(&MembershipChange::Remove { node: gone }, MAX_MS);
    c.kill(gone);
    let late = commit_many(&mut c, 900, 3, 5);
    assert!(c.wait_converged(MAX_MS));
    let s = c.node(c.leader().unwrap()).status();
    assert_eq!(s.voters.len(), 3, "{s:?}");
    for id in c.live_nodes() {
        assert_has(&c, id, &early, 5);
        assert_has(&c, id, &late, 5);
        assert_eq!(c.node(id).state().members().count(), 3);
    }
    c.check_consistency().unwrap();
}

#[test]
fn reservations_over_capacity_are_rejected() {
    let page_bytes = 1 << 20;
    let (mut c, _dir) = cluster(seed_from_env(6), |cfg| {
        cfg.page_bytes = page_bytes;
        cfg.capacity_bytes = 10 * page_bytes;
    });
    c.wait_for_leader(MAX_MS);
    let now = c.now_ms();
    let reserve = |id, bytes| Update::Reserve {
        id: ReservationId(id),
        node: NodeId(2),
        bytes,
        expires_at_ms: now + 60_000,
    };
    let mut b = Batch::new(now);
    b.push(reserve(1, 6 * page_bytes))
        .push(reserve(2, 6 * page_bytes))
        .push(reserve(3, 4 * page_bytes));
    let Applied::Batch { outcomes } = c.commit(&b, MAX_MS) else {
        panic!("not a batch")
    };
    assert_eq!(outcomes[0], Ok(()));
    assert_eq!(
        outcomes[1],
        Err(Rejection::InsufficientCapacity {
            node: NodeId(2),
            requested_bytes: 6 * page_bytes,
            free_bytes: 4 * page_bytes
        })
    );
    assert_eq!(outcomes[2], Ok(()));
    // Node 2 is now fully committed: a placement without a reservation is refused, one
    // paid by a reservation is accepted.
    let place = |buffer, pages, reservation| Update::Place {
        extent: Extent::new(BufferId(buffer), 0, pages),
        holder: NodeId(2),
        epoch: Epoch(1),
        version: 1,
        reservation,
        replica: 0,
    };
    let mut b = Batch::new(now + 1);
    b.push(place(1, 1, None))
        .push(place(1, 6, Some(ReservationId(1))))
        .push(place(2, 5, Some(ReservationId(3))));
    let Applied::Batch { outcomes } = c.commit(&b, MAX_MS) else {
        panic!("not a batch")
    };
    assert!(matches!(
        outcomes[0],
        Err(Rejection::InsufficientCapacity { .. })
    ));
    assert_eq!(outcomes[1], Ok(()));
    assert!(matches!(
        outcomes[2],
        Err(Rejection::ReservationTooSmall {
            remaining_bytes,
            needed_bytes,
            ..
        }) if remaining_bytes == 4 * page_bytes && needed_bytes == 5 * page_bytes
    ));
    assert!(c.wait_converged(MAX_MS));
    for id in c.live_nodes() {
        let guard = c.node(id);
        let s = guard.state();
        let u = s.usage(NodeId(2)).unwrap();
        assert_eq!(u.used_bytes, 6 * page_bytes);
        assert_eq!(u.reserved_bytes, 4 * page_bytes);
        assert_eq!(s.free_bytes(NodeId(2)), Some(0));
    }
    c.check_consistency().unwrap();
}

#[test]
fn stale_epoch_holder_records_are_rejected() {
    let (mut c, _dir) = cluster(seed_from_env(7), |_| {});
    c.wait_for_leader(MAX_MS);
    let placed = commit_many(&mut c, 100, 1, 8);
    // Node 2 is declared down, then up again: a new epoch.
    for state in [MemberState::Down, MemberState::Up] {
        let mut b = Batch::new(c.now_ms());
        b.push(Update::SetMemberState {
            node: NodeId(2),
            state,
        });
        all_ok(&c.commit(&b, MAX_MS));
    }
    let l = c.leader().unwrap();
    let guard = c.node(l);
    let s = guard.state();
    assert_eq!(s.member(NodeId(2)).unwrap().epoch, Epoch(2));
    assert!(
        s.holder_of(page(placed[0], 0)).is_none(),
        "records of the old epoch are gone"
    );
    drop(guard);
    // A placement written for the old incarnation is refused; one for the new is taken.
    let Applied::Batch { outcomes } = c.commit(&placements(c.now_ms(), 100, 1, 2), MAX_MS) else {
        panic!("not a batch")
    };
    assert_eq!(
        outcomes[0],
        Err(Rejection::StaleEpoch {
            node: NodeId(2),
            record_epoch: Epoch(1),
            current_epoch: Epoch(2)
        })
    );
    let mut b = Batch::new(c.now_ms());
    b.push(Update::Place {
        extent: Extent::new(BufferId(100), 0, 1),
        holder: NodeId(2),
        epoch: Epoch(2),
        version: 2,
        reservation: None,
        replica: 0,
    });
    all_ok(&c.commit(&b, MAX_MS));
    assert!(c.wait_converged(MAX_MS));
    c.check_consistency().unwrap();
}

/// Random loss, latency spikes, partitions and kills; afterwards every committed
/// placement is on every node and all nodes agree.
#[test]
fn chaos_keeps_committed_entries_and_agreement() {
    let base = seed_from_env(1000);
    for seed in base..base + 3 {
        chaos(seed);
    }
}

fn chaos(seed: u64) {
    let (mut c, _dir) = cluster(seed, |cfg| {
        cfg.drop_rate = 0.05;
        cfg.snapshot_interval_entries = 24;
        cfg.log_entries_kept_after_snapshot = 6;
        // Agreement is what this checks: placements name epoch 1 at random holders, so
        // no member may be declared down (tests/failure_detection.rs checks that part).
        cfg.down_after_ticks = 0;
    });
    let mut rng = spillway_meta::rng::SimRng::new(seed ^ 0xC4A05);
    let mut committed = Vec::new();
    let ids = [NodeId(1), NodeId(2), NodeId(3)];
    let mut next_buffer = 1;
    for round in 0..12 {
        match rng.below(4) {
            0 => {
                let v = ids[rng.below(3) as usize];
                if c.try_node(v).is_some() && c.live_nodes().len() == 3 {
                    c.kill(v);
                }
            }
            1 => {
                let v = ids[rng.below(3) as usize];
                c.isolate(v);
            }
            2 => c.set_latency_us(200, 20_000),
            _ => {}
        }
        // A few batches under the fault (some may be lost and retried).
        for _ in 0..3 {
            let batch = placements(c.now_ms(), next_buffer, 4, 1 + rng.below(3));
            all_ok(&c.commit(&batch, 60_000));
            committed.push(next_buffer);
            next_buffer += 1;
        }
        c.run_for_ms(rng.between(0, 2_000));
        // Repair.
        c.heal();
        c.set_latency_us(200, 2_000);
        for id in ids {
            if c.try_node(id).is_none() {
                c.restart(id).unwrap();
            }
        }
        c.check_consistency()
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
    c.set_drop_rate(0.0);
    assert!(c.wait_converged(60_000));
    for id in c.live_nodes() {
        assert_has(&c, id, &committed, 4);
    }
    c.check_consistency().unwrap();
}

#[test]
fn the_same_seed_replays_the_same_run() {
    let trace = |seed| {
        let (mut c, _dir) = cluster(seed, |cfg| cfg.drop_rate = 0.1);
        let mut out = Vec::new();
        for i in 0..3 {
            let l = c.wait_for_leader(MAX_MS);
            out.push((c.now_us(), l, c.node(l).term()));
            c.commit(&placements(c.now_ms(), i, 3, 1), MAX_MS);
            c.kill(l);
            c.run_for_ms(500);
            c.restart(l).unwrap();
        }
        out.push((c.now_us(), NodeId(0), c.net_stats().delivered));
        out
    };
    let seed = seed_from_env(8);
    assert_eq!(trace(seed), trace(seed));
}
