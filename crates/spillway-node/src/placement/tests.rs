//! Unit tests of the remote tier's brain, without a pool: plans, reservations, batches,
//! move verdicts, placements, fetch routing and checks, pending deletes.
use super::*;

const PAGE: u64 = 2 << 20;

fn peer(id: u64, free_pages: u64) -> Candidate {
    Candidate {
        id: NodeId(id),
        state: MemberState::Up,
        epoch: Epoch(1),
        free_bytes: free_pages * PAGE,
        reachable: true,
    }
}

fn pages(n: u32) -> Vec<SpillPage> {
    (0..n)
        .map(|i| SpillPage {
            page: PageId {
                buffer: BufferId(1),
                index: i,
            },
            data: Bytes::from_static(b"x"),
            checksum: spillway_types::wire::page_checksum(b"x"),
        })
        .collect()
}

#[test]
fn batches_respect_the_page_and_byte_bounds() {
    let pages: Vec<Page> = pages(20)
        .into_iter()
        .map(|p| Page::new(p.page, p.data))
        .collect();
    let b = batches(pages.clone(), 2 << 20);
    assert_eq!(b.iter().map(Vec::len).collect::<Vec<_>>(), vec![8, 8, 4]);
    let b = batches(pages, 64 << 20);
    assert_eq!(b.len(), 20);
}

#[test]
fn runs_go_to_the_peer_with_most_room_and_reserve_in_chunks() {
    let mut brain = Placement::new(NodeId(1), PAGE, 8 * PAGE, 1_000);
    let pool = [peer(1, 100), peer(2, 40), peer(3, 30), peer(4, 100)];
    // Node 1 is this node; node 4 is down.
    let mut pool = pool.to_vec();
    pool[3].state = MemberState::Down;
    let plan = brain.plan(7, pages(20), &pool, &[], 5_000).unwrap();
    // 16 pages to node 2 (most room), the last 4 to node 3 (30 > 40 - 16).
    let holders = plan.holders();
    assert!(holders[..16].iter().all(|h| *h == NodeId(2)));
    assert!(holders[16..].iter().all(|h| *h == NodeId(3)));
    // Reservations rounded up to the 8-page chunk.
    let r: Vec<(NodeId, u64)> = plan.reserves().iter().map(|r| (r.peer, r.bytes)).collect();
    assert_eq!(r, vec![(NodeId(2), 16 * PAGE), (NodeId(3), 8 * PAGE)]);
    assert_eq!(plan.proposal().len(), 2);
    let outcomes = vec![Outcome::Accepted, Outcome::Accepted];
    let planned = brain.reserved(plan, &outcomes).unwrap();
    assert!(planned.iter().all(|p| p.reservation.is_some()));
    // Node 3's reservation has 4 pages left, node 2's none.
    assert_eq!(brain.ledger().unspent_on(NodeId(3), 5_000), 4 * PAGE);
    assert_eq!(brain.ledger().unspent_on(NodeId(2), 5_000), 0);
    // One put of 8 pages, 8 pages, and 4 pages.
    let puts = brain.put_batches(&planned);
    let sizes: Vec<(NodeId, usize)> = puts.iter().map(|(p, b)| (*p, b.len())).collect();
    assert_eq!(sizes, vec![(NodeId(2), 8), (NodeId(2), 8), (NodeId(3), 4)]);
    // Two extents (holder changes), one version.
    let placements = brain.placements(&planned);
    assert_eq!(placements.extents.len(), 2);
    assert_eq!(placements.extents[0].0.page_count, 16);
}

#[test]
fn no_room_and_unreachable_peers() {
    let mut brain = Placement::new(NodeId(1), PAGE, PAGE, 0);
    let mut pool = vec![peer(2, 3), peer(3, 3)];
    pool[1].reachable = false;
    assert!(matches!(
        brain.plan(1, pages(4), &pool, &[], 0),
        Err(RemoteError::NoRoom {
            requested_bytes,
            free_bytes
        }) if requested_bytes == 4 * PAGE && free_bytes == 3 * PAGE
    ));
    pool[1].reachable = true;
    // Excluded after a failed put: the same answer.
    assert!(brain.plan(1, pages(4), &pool, &[NodeId(3)], 0).is_err());
    // Both: a run that fits no single peer goes page by page.
    let plan = brain.plan(1, pages(4), &pool, &[], 0).unwrap();
    let on_2 = plan.holders().iter().filter(|h| **h == NodeId(2)).count();
    assert_eq!(on_2, 2);
}

#[test]
fn a_refused_reservation_fails_the_spill_and_spends_nothing() {
    let mut brain = Placement::new(NodeId(1), PAGE, PAGE, 0);
    let plan = brain.plan(1, pages(2), &[peer(2, 9)], &[], 0).unwrap();
    let refused = vec![Outcome::Rejected {
        reason: "full".into(),
    }];
    assert!(matches!(
        brain.reserved(plan, &refused),
        Err(RemoteError::ReservationRefused { peer, .. }) if peer == NodeId(2)
    ));
    assert_eq!(brain.ledger().unspent_on(NodeId(2), 0), 0);
}

#[test]
fn only_unreachable_peers_are_replanned_and_only_so_often() {
    let unreachable = |p| RemoteError::PeerUnreachable {
        peer: NodeId(p),
        reason: "gone".into(),
    };
    assert!(matches!(
        Placement::after_moves(vec![], 0),
        MoveVerdict::Done
    ));
    assert!(matches!(
        Placement::after_moves(vec![(NodeId(2), unreachable(2))], 0),
        MoveVerdict::Replan(p) if p == vec![NodeId(2)]
    ));
    assert!(matches!(
        Placement::after_moves(vec![(NodeId(2), unreachable(2))], MOVE_RETRIES),
        MoveVerdict::Fail(RemoteError::PeerUnreachable { .. })
    ));
    let refused = RemoteError::PeerRefused {
        peer: NodeId(3),
        reason: "full".into(),
    };
    assert!(matches!(
        Placement::after_moves(vec![(NodeId(3), refused)], 0),
        MoveVerdict::Fail(RemoteError::PeerRefused { .. })
    ));
}

#[test]
fn a_respill_elsewhere_leaves_a_copy_to_delete_and_fetches_route_by_holder() {
    let mut brain = Placement::new(NodeId(1), PAGE, PAGE, 0);
    let plan = brain.plan(1, pages(1), &[peer(2, 9)], &[], 0).unwrap();
    let first = brain.reserved(plan, &[Outcome::Accepted]).unwrap();
    assert!(brain.placed(1, &first).is_empty());
    let plan = brain
        .plan(1, pages(1), &[peer(2, 9), peer(3, 9)], &[NodeId(2)], 0)
        .unwrap();
    let second = brain.reserved(plan, &[Outcome::Accepted]).unwrap();
    let stale = brain.placed(1, &second);
    assert_eq!(stale.keys().copied().collect::<Vec<_>>(), vec![NodeId(2)]);
    let ids = [first[0].client_page];
    let held = brain.known_holders(1, &ids);
    assert_eq!(held[0].map(|h| h.holder), Some(NodeId(3)));
    let gets = brain.get_requests(1, &ids, &held).unwrap();
    assert_eq!(gets.len(), 1);
    assert_eq!(gets[0].0, NodeId(3));
    assert_eq!(gets[0].2, vec![first[0].remote]);
    // A page nobody holds fails the fetch.
    assert!(matches!(
        brain.get_requests(1, &ids, &[None]),
        Err(RemoteError::NotFound { .. })
    ));
}

#[test]
fn a_fetched_page_with_another_checksum_is_corrupt_and_a_missing_one_not_found() {
    let mut brain = Placement::new(NodeId(1), PAGE, PAGE, 0);
    let plan = brain.plan(1, pages(2), &[peer(2, 9)], &[], 0).unwrap();
    let planned = brain.reserved(plan, &[Outcome::Accepted]).unwrap();
    brain.placed(1, &planned);
    let ids: Vec<PageId> = planned.iter().map(|p| p.client_page).collect();
    let held = brain.known_holders(1, &ids);
    let gets = brain.get_requests(1, &ids, &held).unwrap();
    assert_eq!(gets.len(), 1);
    // The peer answers page 0 with other bytes and does not have page 1.
    let reply = Response::Get {
        pages: vec![Page::new(planned[0].remote, Bytes::from_static(b"y"))],
        missing: vec![planned[1].remote],
    };
    let mut out = vec![None; 2];
    let e = brain.got(1, &ids, &held, &gets[0], Ok(reply), &mut out);
    assert!(matches!(e, Some(RemoteError::Corrupt { peer, .. }) if peer == NodeId(2)));
    assert_eq!(out, vec![None, None]);
    // The right bytes come back and are counted.
    let reply = Response::Get {
        pages: planned
            .iter()
            .map(|p| Page::with_checksum(p.remote, p.data.clone(), p.checksum))
            .collect(),
        missing: vec![],
    };
    assert!(
        brain
            .got(1, &ids, &held, &gets[0], Ok(reply), &mut out)
            .is_none()
    );
    assert!(out.iter().all(|b| b.as_deref() == Some(&b"x"[..])));
    assert_eq!(brain.per_peer[&NodeId(2)].pages_fetched, 2);
}

#[test]
fn pending_deletes_keep_a_peer_out_of_plans_until_they_land() {
    let mut brain = Placement::new(NodeId(1), PAGE, PAGE, 0);
    let remote = remote_page_id(NodeId(1), 1, pages(1)[0].page);
    brain.queue_deletes(NodeId(2), vec![remote]);
    assert_eq!(brain.pending_deletes_len(), 1);
    assert!(brain.plan(1, pages(1), &[peer(2, 9)], &[], 0).is_err());
    brain.deletes_landed(NodeId(2), &[remote]);
    assert_eq!(brain.pending_deletes_len(), 0);
    assert!(brain.plan(1, pages(1), &[peer(2, 9)], &[], 0).is_ok());
}
