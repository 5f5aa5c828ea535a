//! Unit tests of the replica slots: placement rules per slot, liveness, under-replicated
//! and lost pages, and the snapshot of slots.
use spillway_types::BufferId;

use super::super::{SNAPSHOT_FORMAT, SnapshotData, SnapshotError};
use super::*;
use crate::command::{InitialCluster, MemberInfo, Update};
use crate::ids::{Epoch, NodeId};
use crate::limits::REPLICAS_MAX;
use crate::state::Rejection;
use crate::state::tests::{PAGE, apply, set};

fn state(nodes: u64) -> MetaState {
    let mut initial = InitialCluster::for_tests(nodes, 64 * PAGE, PAGE);
    for m in &mut initial.members {
        m.zone = Some(format!("rack-{}", m.id.0 % 2));
    }
    MetaState::initial(&initial)
}

struct P {
    buffer: u64,
    first: u32,
    count: u32,
    node: u64,
    epoch: u64,
    version: u64,
    replica: u8,
}

fn place(p: P) -> Update {
    Update::Place {
        extent: Extent::new(BufferId(p.buffer), p.first, p.count),
        holder: NodeId(p.node),
        epoch: Epoch(p.epoch),
        version: p.version,
        reservation: None,
        replica: p.replica,
    }
}

/// `count` pages of buffer 1 from `first` at `node` (epoch 1, version 1) in `replica`.
fn at(first: u32, count: u32, node: u64, replica: u8) -> Update {
    place(P {
        buffer: 1,
        first,
        count,
        node,
        epoch: 1,
        version: 1,
        replica,
    })
}

/// Node `node` goes down and comes back up at `now_ms`: a new epoch, its records dead.
fn come_back(s: &mut MetaState, now_ms: u64, node: u64) {
    apply(
        s,
        now_ms,
        vec![set(node, MemberState::Down), set(node, MemberState::Up)],
    );
}

fn page(index: u32) -> PageId {
    PageId {
        buffer: BufferId(1),
        index,
    }
}

fn used(s: &MetaState, node: u64) -> u64 {
    s.usage(NodeId(node)).unwrap().used_bytes
}

fn holder_nodes(s: &MetaState, index: u32) -> Vec<(u8, u64)> {
    s.holders_of(page(index))
        .iter()
        .map(|&(slot, _, h)| (slot, h.node.0))
        .collect()
}

const EVERY_BUFFER: Range<BufferId> = BufferId(0)..BufferId(u64::MAX);

#[test]
fn slots_hold_independent_copies_and_remove_clears_every_slot() {
    let mut s = state(3);
    let out = apply(&mut s, 1, vec![at(0, 8, 1, 0), at(0, 8, 2, 1)]);
    assert_eq!(out, vec![Ok(()), Ok(())]);
    assert_eq!(holder_nodes(&s, 3), vec![(0, 1), (1, 2)]);
    assert_eq!((used(&s, 1), used(&s, 2)), (8 * PAGE, 8 * PAGE));
    // Placing into slot 1 replaces slot 1's record only.
    assert_eq!(apply(&mut s, 2, vec![at(2, 2, 3, 1)]), vec![Ok(())]);
    assert_eq!(holder_nodes(&s, 2), vec![(0, 1), (1, 3)]);
    assert_eq!(holder_nodes(&s, 4), vec![(0, 1), (1, 2)]);
    assert_eq!(
        (used(&s, 1), used(&s, 2), used(&s, 3)),
        (8 * PAGE, 6 * PAGE, 2 * PAGE)
    );
    assert_eq!(s.extent_count(), 4);
    let slots: Vec<u8> = s.extents().map(|(slot, _, _)| slot).collect();
    assert_eq!(slots, vec![0, 1, 1, 1]);
    // A remove clears every slot.
    let out = apply(
        &mut s,
        3,
        vec![Update::Remove {
            extent: Extent::new(BufferId(1), 0, 8),
        }],
    );
    assert_eq!(out, vec![Ok(())]);
    assert_eq!(s.extent_count(), 0);
    assert_eq!((used(&s, 1), used(&s, 2), used(&s, 3)), (0, 0, 0));
}

#[test]
fn a_slot_at_or_past_the_maximum_is_refused() {
    let mut s = state(2);
    let out = apply(
        &mut s,
        1,
        vec![at(0, 1, 1, REPLICAS_MAX as u8), at(0, 1, 1, u8::MAX)],
    );
    let refused = Err(Rejection::InvalidReplica {
        replica: REPLICAS_MAX as u8,
        max: REPLICAS_MAX,
    });
    assert_eq!(out[0], refused);
    assert_eq!(
        out[1],
        Err(Rejection::InvalidReplica {
            replica: u8::MAX,
            max: REPLICAS_MAX
        })
    );
    assert_eq!(s.extent_count(), 0);
    assert_eq!(used(&s, 1), 0);
    // The last slot is fine.
    let last = at(0, 1, 1, REPLICAS_MAX as u8 - 1);
    assert_eq!(apply(&mut s, 2, vec![last]), vec![Ok(())]);
}

#[test]
fn the_copies_of_a_page_are_on_distinct_nodes() {
    let mut s = state(2);
    apply(&mut s, 1, vec![at(0, 4, 1, 0)]);
    // Node 1 already holds pages 2 and 3 in slot 0.
    assert_eq!(
        apply(&mut s, 2, vec![at(2, 4, 1, 1)]),
        vec![Err(Rejection::DuplicateHolder {
            node: NodeId(1),
            page: page(2),
            replica: 0
        })]
    );
    assert_eq!(s.extent_count(), 1);
    // Pages it does not hold, and a re-place into its own slot, are fine.
    assert_eq!(
        apply(&mut s, 3, vec![at(4, 4, 1, 1), at(0, 4, 1, 0)]),
        vec![Ok(()), Ok(())]
    );
    assert_eq!(used(&s, 1), 8 * PAGE);
    // Once node 1 came back (its old records are dead), it may hold the pages again in
    // another slot: the dead copy does not count.
    come_back(&mut s, 4, 1);
    assert_eq!(used(&s, 1), 0);
    let again = place(P {
        buffer: 1,
        first: 0,
        count: 4,
        node: 1,
        epoch: 2,
        version: 1,
        replica: 2,
    });
    assert_eq!(apply(&mut s, 5, vec![again]), vec![Ok(())]);
    assert_eq!(holder_nodes(&s, 0), vec![(0, 1), (2, 1)]);
    assert_eq!(used(&s, 1), 4 * PAGE);
}

#[test]
fn versions_are_compared_over_every_slot_and_the_newest_live_copy_is_read() {
    let mut s = state(3);
    let v = |node, version, replica| {
        place(P {
            buffer: 1,
            first: 0,
            count: 2,
            node,
            epoch: 1,
            version,
            replica,
        })
    };
    apply(&mut s, 1, vec![v(1, 5, 0)]);
    assert_eq!(
        apply(&mut s, 2, vec![v(2, 4, 1)]),
        vec![Err(Rejection::StaleVersion {
            page: page(0),
            current_version: 5,
            proposed_version: 4
        })]
    );
    assert_eq!(apply(&mut s, 3, vec![v(2, 6, 1)]), vec![Ok(())]);
    // Slot 0 still has version 5; the newest live copy (slot 1) is the one to read.
    let (_, h) = s.holder_of(page(1)).unwrap();
    assert_eq!((h.node, h.version), (NodeId(2), 6));
    // Node 2 dies: the older live copy is what is left.
    apply(&mut s, 4, vec![set(2, MemberState::Down)]);
    let (_, h) = s.holder_of(page(1)).unwrap();
    assert_eq!((h.node, h.version), (NodeId(1), 5));
    // A dead record of an earlier epoch carries no version that blocks anything.
    apply(
        &mut s,
        5,
        vec![set(2, MemberState::Up), set(1, MemberState::Down)],
    );
    assert_eq!(s.holder_of(page(1)), None);
    assert_eq!(apply(&mut s, 6, vec![v(3, 5, 2)]), vec![Ok(())]);
}

#[test]
fn liveness_follows_state_and_epoch() {
    let mut s = state(2);
    apply(&mut s, 1, vec![at(0, 1, 1, 0)]);
    let (_, _, h) = s.holders_of(page(0))[0];
    assert!(s.is_live(&h));
    apply(&mut s, 2, vec![set(1, MemberState::Leaving)]);
    assert!(s.is_live(&h), "a leaving member still serves what it holds");
    apply(&mut s, 3, vec![set(1, MemberState::Down)]);
    assert!(!s.is_live(&h));
    apply(&mut s, 4, vec![set(1, MemberState::Up)]);
    assert!(!s.is_live(&h), "the record is of the earlier epoch");
    assert_eq!(s.member(NodeId(1)).unwrap().epoch, Epoch(2));
    assert!(!s.is_live(&Holder {
        node: NodeId(9),
        epoch: Epoch(1),
        version: 1
    }));
    // The dead record stays, uncounted.
    assert_eq!(s.holders_of(page(0)).len(), 1);
    assert_eq!(used(&s, 1), 0);
    // A second comeback uncounts only what the second epoch held.
    let second = place(P {
        buffer: 2,
        first: 0,
        count: 3,
        node: 1,
        epoch: 2,
        version: 1,
        replica: 0,
    });
    assert_eq!(apply(&mut s, 5, vec![second]), vec![Ok(())]);
    assert_eq!(used(&s, 1), 3 * PAGE);
    come_back(&mut s, 6, 1);
    assert_eq!(s.member(NodeId(1)).unwrap().epoch, Epoch(3));
    assert_eq!(used(&s, 1), 0);
    assert_eq!(s.extent_count(), 2);
}

#[test]
fn dead_slots_are_under_replicated_and_pages_without_a_live_copy_are_lost() {
    let mut s = state(3);
    apply(
        &mut s,
        1,
        vec![at(0, 8, 1, 0), at(0, 4, 2, 1), at(4, 4, 3, 1)],
    );
    assert!(s.under_replicated(EVERY_BUFFER).is_empty());
    assert_eq!(s.replication_health(), ReplicationHealth::default());
    let h = |node: u64, epoch: u64| Holder {
        node: NodeId(node),
        epoch: Epoch(epoch),
        version: 1,
    };
    // Pages `first..first + 4` of buffer 1, their copy in `slot` dead.
    let under = |first, slot, dead, live| UnderReplicated {
        extent: Extent::new(BufferId(1), first, 4),
        slot,
        dead,
        live,
    };
    let health = |under_replicated_bytes, lost_bytes| ReplicationHealth {
        under_replicated_bytes,
        lost_bytes,
    };

    apply(&mut s, 2, vec![set(2, MemberState::Down)]);
    assert_eq!(
        s.under_replicated(EVERY_BUFFER),
        vec![under(0, 1, h(2, 1), vec![(0, h(1, 1))])]
    );
    assert_eq!(s.replication_health(), health(4 * PAGE, 0));
    assert_eq!(s.holder_of(page(0)).unwrap().1.node, NodeId(1));

    // Node 1 dies too: pages 0..4 have no live copy left; 4..8 still have node 3's.
    apply(&mut s, 3, vec![set(1, MemberState::Down)]);
    assert_eq!(
        s.under_replicated(EVERY_BUFFER),
        vec![
            under(0, 0, h(1, 1), vec![]),
            under(0, 1, h(2, 1), vec![]),
            under(4, 0, h(1, 1), vec![(1, h(3, 1))]),
        ]
    );
    assert_eq!(s.replication_health(), health(4 * PAGE, 4 * PAGE));
    assert_eq!(s.holder_of(page(0)), None);
    assert_eq!(s.holder_of(page(5)).unwrap().1.node, NodeId(3));
    // The range selects buffers: buffer 1 is outside 2..10.
    assert!(s.under_replicated(BufferId(2)..BufferId(10)).is_empty());
    assert_eq!(s.under_replicated(BufferId(1)..BufferId(2)).len(), 3);

    // Node 2 comes back at epoch 2: its old record stays dead until a repair places into
    // its slot (here: node 2 again, now at epoch 2, for pages 4..8 of slot 0).
    apply(&mut s, 4, vec![set(2, MemberState::Up)]);
    assert_eq!(s.member(NodeId(2)).unwrap().up_since_ms, 4);
    let repair = place(P {
        buffer: 1,
        first: 4,
        count: 4,
        node: 2,
        epoch: 2,
        version: 1,
        replica: 0,
    });
    assert_eq!(apply(&mut s, 5, vec![repair]), vec![Ok(())]);
    assert_eq!(s.replication_health(), health(0, 4 * PAGE));
    assert_eq!(used(&s, 2), 4 * PAGE);
    // The lost pages leave the pool: nothing is left to repair.
    apply(
        &mut s,
        6,
        vec![Update::Remove {
            extent: Extent::new(BufferId(1), 0, 4),
        }],
    );
    assert_eq!(s.replication_health(), ReplicationHealth::default());
    assert!(s.under_replicated(EVERY_BUFFER).is_empty());
}

#[test]
fn members_carry_their_zone_and_when_they_came_up() {
    let mut s = state(2);
    let m = s.member(NodeId(1)).unwrap();
    assert_eq!((m.zone.as_deref(), m.up_since_ms), (Some("rack-1"), 0));
    apply(&mut s, 10, vec![set(1, MemberState::Down)]);
    assert_eq!(s.member(NodeId(1)).unwrap().up_since_ms, 0);
    apply(&mut s, 25, vec![set(1, MemberState::Up)]);
    assert_eq!(s.member(NodeId(1)).unwrap().up_since_ms, 25);
    // Up to up is no comeback.
    apply(&mut s, 30, vec![set(1, MemberState::Up)]);
    assert_eq!(s.member(NodeId(1)).unwrap().up_since_ms, 25);
    let long = MemberInfo {
        id: NodeId(3),
        addresses: vec![],
        capacity_bytes: 0,
        zone: Some("z".repeat(crate::limits::ZONE_BYTES_MAX + 1)),
    };
    assert_eq!(long.invalid_reason(), Some("the zone label is too long"));
}

fn snapshot(s: &MetaState, format: u32, extents: Vec<(u8, Extent, Holder)>) -> Vec<u8> {
    crate::command::encode(&SnapshotData {
        format,
        page_bytes: s.page_bytes,
        clock_ms: s.clock_ms,
        members: s.members.values().cloned().collect(),
        extents,
        reservations: vec![],
    })
}

#[test]
fn snapshots_keep_slots_and_dead_records_and_refuse_bad_ones() {
    let mut s = state(3);
    apply(
        &mut s,
        1,
        vec![at(0, 8, 1, 0), at(0, 8, 2, 1), at(0, 8, 3, 3)],
    );
    come_back(&mut s, 2, 3);
    s.set_applied_index(9);
    let back = MetaState::decode_snapshot(&s.encode_snapshot(), 9).unwrap();
    assert_eq!(back, s);
    assert_eq!(back.replication_health().under_replicated_bytes, 8 * PAGE);

    // An earlier format is refused as such.
    let old = snapshot(&s, 2, vec![]);
    assert!(matches!(
        MetaState::decode_snapshot(&old, 9),
        Err(SnapshotError::Format {
            found: 2,
            expected: SNAPSHOT_FORMAT
        })
    ));
    // One node holding a page live in two slots breaks an invariant.
    let h1 = Holder {
        node: NodeId(1),
        epoch: Epoch(1),
        version: 1,
    };
    let e = Extent::new(BufferId(1), 0, 2);
    let twice = snapshot(&s, SNAPSHOT_FORMAT, vec![(0, e, h1), (1, e, h1)]);
    assert!(matches!(
        MetaState::decode_snapshot(&twice, 9),
        Err(SnapshotError::Inconsistent { .. })
    ));
    // A slot past the maximum too.
    let past = snapshot(&s, SNAPSHOT_FORMAT, vec![(REPLICAS_MAX as u8, e, h1)]);
    assert!(matches!(
        MetaState::decode_snapshot(&past, 9),
        Err(SnapshotError::Inconsistent { .. })
    ));
    // The same record in two slots at a dead epoch is fine (not live twice).
    let mut dead = h1;
    dead.node = NodeId(3);
    let ok = snapshot(&s, SNAPSHOT_FORMAT, vec![(0, e, dead), (1, e, dead)]);
    assert!(MetaState::decode_snapshot(&ok, 9).is_ok());
}
