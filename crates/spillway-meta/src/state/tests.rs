//! Unit tests of the replicated state machine.
use spillway_types::BufferId;

use super::*;

pub(super) const PAGE: u64 = 1 << 20;

fn state(capacities: &[u64]) -> MetaState {
    MetaState::initial(&InitialCluster {
        members: capacities
            .iter()
            .enumerate()
            .map(|(i, &c)| MemberInfo {
                id: NodeId(i as u64 + 1),
                addresses: vec![format!("127.0.0.1:{}", 7000 + i)],
                capacity_bytes: c,
                zone: None,
            })
            .collect(),
        page_bytes: PAGE,
    })
}

fn place(buffer: u64, first: u32, count: u32, node: u64, epoch: u64, version: u64) -> Update {
    Update::Place {
        extent: Extent::new(BufferId(buffer), first, count),
        holder: NodeId(node),
        epoch: Epoch(epoch),
        version,
        reservation: None,
        replica: 0,
    }
}

/// `update` (a placement) paid by reservation `id`.
fn paid(mut update: Update, id: u64) -> Update {
    let Update::Place { reservation, .. } = &mut update else {
        panic!("not a placement: {update:?}");
    };
    *reservation = Some(ReservationId(id));
    update
}

/// An update setting `node`'s member state.
pub(super) fn set(node: u64, state: MemberState) -> Update {
    Update::SetMemberState {
        node: NodeId(node),
        state,
    }
}

/// Applies `updates` as one batch at `now_ms` and checks the invariants after it.
pub(super) fn apply(
    s: &mut MetaState,
    now_ms: u64,
    updates: Vec<Update>,
) -> Vec<Result<(), Rejection>> {
    let out = s.apply_batch(&Batch { now_ms, updates });
    s.check_invariants().unwrap();
    out
}

#[test]
fn placement_is_bounded_by_capacity() {
    let mut s = state(&[4 * PAGE, 4 * PAGE]);
    let out = apply(
        &mut s,
        1,
        vec![place(1, 0, 3, 1, 1, 1), place(2, 0, 2, 1, 1, 1)],
    );
    assert_eq!(out[0], Ok(()));
    assert_eq!(
        out[1],
        Err(Rejection::InsufficientCapacity {
            node: NodeId(1),
            requested_bytes: 2 * PAGE,
            free_bytes: PAGE
        })
    );
    // Re-placing pages already at node 1 costs nothing more.
    assert_eq!(
        apply(&mut s, 2, vec![place(1, 0, 3, 1, 1, 2)]),
        vec![Ok(())]
    );
    // Moving them to node 2 frees node 1.
    assert_eq!(
        apply(&mut s, 3, vec![place(1, 1, 2, 2, 1, 3)]),
        vec![Ok(())]
    );
    assert_eq!(s.usage(NodeId(1)).unwrap().used_bytes, PAGE);
    assert_eq!(s.usage(NodeId(2)).unwrap().used_bytes, 2 * PAGE);
}

#[test]
fn reservations_pay_for_placements_and_expire() {
    let mut s = state(&[4 * PAGE]);
    let reserve = |id, bytes, exp| Update::Reserve {
        id: ReservationId(id),
        node: NodeId(1),
        bytes,
        expires_at_ms: exp,
    };
    let out = apply(
        &mut s,
        10,
        vec![reserve(1, 3 * PAGE, 100), reserve(2, 2 * PAGE, 100)],
    );
    assert_eq!(out[0], Ok(()));
    assert!(matches!(
        out[1],
        Err(Rejection::InsufficientCapacity { .. })
    ));
    // Without the reservation there is only one page free.
    let out = apply(&mut s, 11, vec![place(1, 0, 2, 1, 1, 1)]);
    assert!(matches!(
        out[0],
        Err(Rejection::InsufficientCapacity { .. })
    ));
    let with = paid(place(1, 0, 2, 1, 1, 1), 1);
    assert_eq!(apply(&mut s, 12, vec![with]), vec![Ok(())]);
    assert_eq!(s.reservation(ReservationId(1)).unwrap().bytes, PAGE);
    // The rest lapses with the clock.
    apply(&mut s, 100, vec![]);
    assert!(s.reservation(ReservationId(1)).is_none());
    assert_eq!(s.usage(NodeId(1)).unwrap().reserved_bytes, 0);
    assert!(matches!(
        apply(&mut s, 100, vec![reserve(3, 1, 50)])[0],
        Err(Rejection::AlreadyExpired { .. })
    ));
}

#[test]
fn a_reservation_pays_for_pages_already_at_the_holder_and_frees_what_they_did_not_need() {
    // Regression: re-placing pages already at the holder took only the new pages from
    // the reservation, while the proposer counted every page as spent: the rest stayed
    // reserved until expiry, and repeated re-spills reserved a node full.
    let mut s = state(&[8 * PAGE]);
    let reserve = |id, bytes| Update::Reserve {
        id: ReservationId(id),
        node: NodeId(1),
        bytes,
        expires_at_ms: 1_000_000,
    };
    let with = |id, version| paid(place(1, 0, 3, 1, 1, version), id);
    assert_eq!(
        apply(&mut s, 1, vec![reserve(1, 3 * PAGE), with(1, 1)]),
        vec![Ok(()), Ok(())]
    );
    assert!(s.reservation(ReservationId(1)).is_none(), "spent to zero");
    // The same three pages again, from a new reservation of three pages.
    assert_eq!(
        apply(&mut s, 2, vec![reserve(2, 4 * PAGE), with(2, 2)]),
        vec![Ok(()), Ok(())]
    );
    assert_eq!(s.reservation(ReservationId(2)).unwrap().bytes, PAGE);
    let u = s.usage(NodeId(1)).unwrap();
    assert_eq!((u.used_bytes, u.reserved_bytes), (3 * PAGE, PAGE));
    assert_eq!(s.free_bytes(NodeId(1)), Some(4 * PAGE));
    // A reservation smaller than the extent is refused, even if only new pages count.
    assert!(matches!(
        apply(&mut s, 3, vec![with(2, 3)])[0],
        Err(Rejection::ReservationTooSmall { needed_bytes, .. }) if needed_bytes == 3 * PAGE
    ));
}

#[test]
fn stale_epochs_and_versions_are_refused() {
    let mut s = state(&[16 * PAGE, 16 * PAGE]);
    assert_eq!(
        apply(&mut s, 1, vec![place(1, 0, 4, 2, 1, 5)]),
        vec![Ok(())]
    );
    // An older version of those pages cannot overwrite the newer record.
    assert!(matches!(
        apply(&mut s, 2, vec![place(1, 2, 4, 1, 1, 4)])[0],
        Err(Rejection::StaleVersion {
            current_version: 5,
            proposed_version: 4,
            ..
        })
    ));
    // Node 2 goes down and comes back: a new epoch, its old records are gone.
    apply(&mut s, 3, vec![set(2, MemberState::Down)]);
    assert!(matches!(
        apply(&mut s, 4, vec![place(1, 8, 1, 2, 1, 1)])[0],
        Err(Rejection::NodeNotUp { .. })
    ));
    apply(&mut s, 5, vec![set(2, MemberState::Up)]);
    assert_eq!(s.member(NodeId(2)).unwrap().epoch, Epoch(2));
    assert!(
        s.holder_of(PageId {
            buffer: BufferId(1),
            index: 0
        })
        .is_none()
    );
    assert_eq!(
        apply(&mut s, 6, vec![place(1, 0, 1, 2, 1, 6)])[0],
        Err(Rejection::StaleEpoch {
            node: NodeId(2),
            record_epoch: Epoch(1),
            current_epoch: Epoch(2)
        })
    );
    assert_eq!(
        apply(&mut s, 7, vec![place(1, 0, 1, 2, 2, 6)]),
        vec![Ok(())]
    );
}

#[test]
fn capacity_never_goes_below_use() {
    let mut s = state(&[4 * PAGE]);
    apply(&mut s, 81, vec![place(1, 0, 3, 1, 1, 1)]);
    assert!(matches!(
        apply(
            &mut s,
            82,
            vec![Update::SetCapacity {
                node: NodeId(1),
                capacity_bytes: 2 * PAGE
            }]
        )[0],
        Err(Rejection::CapacityBelowUse { .. })
    ));
}

#[test]
fn snapshot_round_trips_and_corruption_is_caught() {
    let mut s = state(&[64 * PAGE, 64 * PAGE]);
    apply(
        &mut s,
        1,
        (0..20).map(|i| place(i, 0, 2, 1 + i % 2, 1, 1)).collect(),
    );
    s.set_applied_index(77);
    let bytes = s.encode_snapshot();
    let back = MetaState::decode_snapshot(&bytes, 77).unwrap();
    assert_eq!(back, s);
    assert!(MetaState::decode_snapshot(&bytes[..bytes.len() / 2], 77).is_err());
}

#[test]
fn membership_changes_update_members() {
    let mut s = state(&[PAGE, PAGE, PAGE]);
    apply(&mut s, 1, vec![place(1, 0, 1, 3, 1, 1)]);
    s.apply_membership(
        &MembershipChange::AddLearner {
            member: MemberInfo {
                id: NodeId(4),
                addresses: vec![],
                capacity_bytes: PAGE,
                zone: None,
            },
        },
        &[1, 2, 3],
        &[4],
    );
    assert_eq!(s.member(NodeId(4)).unwrap().role, RaftRole::Learner);
    s.apply_membership(
        &MembershipChange::Replace {
            old: NodeId(3),
            new: NodeId(4),
        },
        &[1, 2, 4],
        &[],
    );
    assert_eq!(s.member(NodeId(4)).unwrap().role, RaftRole::Voter);
    assert!(s.member(NodeId(3)).is_none());
    assert_eq!(s.extent_count(), 0);
    s.check_invariants().unwrap();
}
