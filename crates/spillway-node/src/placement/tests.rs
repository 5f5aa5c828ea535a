//! Unit tests of the remote tier's brain, without a pool: plans (replicas on distinct
//! nodes and zones, fewer peers than replicas, the weight ramp of a member that came
//! back), reservations, batches, move verdicts, placements, fetch routing with fail-over
//! and checks, repair of dead copies, pending deletes.
use super::*;
use crate::tier::RUN_PAGES;

const PAGE: u64 = 2 << 20;

fn peer(id: u64, free_pages: u64) -> Candidate {
    Candidate {
        id: NodeId(id),
        state: MemberState::Up,
        epoch: Epoch(1),
        free_bytes: free_pages * PAGE,
        reachable: true,
        zone: None,
        up_since_ms: 0,
    }
}

fn zoned(id: u64, free_pages: u64, zone: &str) -> Candidate {
    Candidate {
        zone: Some(Arc::from(zone)),
        ..peer(id, free_pages)
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

/// A brain of node 1 keeping `replicas` copies.
fn brain(replicas: u8, chunk_pages: u64) -> Placement {
    Placement::new(NodeId(1), PAGE, chunk_pages * PAGE, replicas, 0)
}

/// Plans a spill of `n` pages over `pool` at `now_ms`.
fn plan(b: &mut Placement, n: u32, pool: &[Candidate], now_ms: u64) -> Result<Plan, RemoteError> {
    let items = b.spill_items(pages(n));
    b.plan(1, items, pool, &[], now_ms)
}

/// Plans, accepts every reservation, and records a spill of `n` pages.
fn spilled(b: &mut Placement, n: u32, pool: &[Candidate]) -> Vec<Planned> {
    let p = plan(b, n, pool, 0).unwrap();
    let outcomes = vec![Outcome::Accepted; p.proposal().len()];
    let planned = b.reserved(p, &outcomes).unwrap();
    b.placed(1, &planned);
    planned
}

/// `pool` with its peer at `index` in `state`.
fn with_state(pool: &[Candidate], index: usize, state: MemberState) -> Vec<Candidate> {
    let mut after = pool.to_vec();
    after[index].state = state;
    after
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
    let mut brain = brain(1, 8);
    // Node 1 is this node; node 4 is down.
    let mut pool = vec![peer(1, 100), peer(2, 40), peer(3, 30), peer(4, 100)];
    pool[3].state = MemberState::Down;
    let plan = plan(&mut brain, 20, &pool, 5_000).unwrap();
    // 16 pages to node 2 (most room), the last 4 to node 3 (30 > 40 - 16).
    let holders = plan.holders();
    assert!(holders[..16].iter().all(|h| *h == vec![NodeId(2)]));
    assert!(holders[16..].iter().all(|h| *h == vec![NodeId(3)]));
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
    let placements = brain.placements(&planned, 1, true);
    assert_eq!(placements.extents.len(), 2);
    assert_eq!(placements.extents[0].extent.page_count, 16);
}

#[test]
fn two_replicas_go_to_two_distinct_peers_per_run() {
    let mut brain = brain(2, 8);
    let pool = [peer(2, 40), peer(3, 30), peer(4, 35)];
    let plan = plan(&mut brain, 40, &pool, 0).unwrap();
    assert_eq!(brain.short_copies, 0);
    let holders = plan.holders();
    for h in &holders {
        assert_eq!(h.len(), 2);
        assert_ne!(h[0], h[1], "{holders:?}");
    }
    // The first run's slot 0 goes to the most room (node 2), slot 1 to the next (node 4).
    assert_eq!(holders[0], vec![NodeId(2), NodeId(4)]);
    // 80 copies in all, spread by room: no peer takes more than it has.
    let count = |n| {
        holders
            .iter()
            .flatten()
            .filter(|h| **h == NodeId(n))
            .count()
    };
    assert_eq!(count(2) + count(3) + count(4), 80);
    assert!(count(2) <= 40 && count(3) <= 30 && count(4) <= 35);
    let outcomes = vec![Outcome::Accepted; plan.proposal().len()];
    let planned = brain.reserved(plan, &outcomes).unwrap();
    assert_eq!(planned.len(), 80);
    // Every copy is put to its holder.
    let put: usize = brain
        .put_batches(&planned)
        .iter()
        .map(|(_, b)| b.len())
        .sum();
    assert_eq!(put, 80);
    // The record names both holders of every page, in their slots.
    brain.placed(1, &planned);
    let ids: Vec<PageId> = pages(40).iter().map(|p| p.page).collect();
    for (h, want) in brain.known_holders(1, &ids).iter().zip(&holders) {
        let got: Vec<NodeId> = h.unwrap().copies().map(|(_, r)| r.holder).collect();
        assert_eq!(&got, want);
    }
}

#[test]
fn replicas_go_to_distinct_zones_when_every_peer_has_one() {
    // Without zones the two roomiest (2 and 3, both in zone a) would take every page.
    let pool = [
        zoned(2, 100, "a"),
        zoned(3, 90, "a"),
        zoned(4, 20, "b"),
        zoned(5, 20, "b"),
    ];
    let mut b = brain(2, 8);
    let holders = plan(&mut b, 32, &pool, 0).unwrap().holders();
    let zone = |n: NodeId| pool.iter().find(|c| c.id == n).unwrap().zone.clone();
    for h in &holders {
        assert_ne!(zone(h[0]), zone(h[1]), "{h:?}");
    }
    // One peer unlabelled: zones are not all known, distinct nodes only.
    let mut pool = pool.to_vec();
    pool[3].zone = None;
    let holders = plan(&mut b, 16, &pool, 0).unwrap().holders();
    assert_eq!(holders[0], vec![NodeId(2), NodeId(3)]);
}

#[test]
fn fewer_peers_than_replicas_keep_what_exists_and_none_fails() {
    let mut b = brain(3, 8);
    let p = plan(&mut b, 4, &[peer(2, 9), peer(3, 9)], 0).unwrap();
    assert!(p.holders().iter().all(|h| h.len() == 2));
    assert_eq!(b.short_copies, 4);
    assert!(matches!(
        plan(&mut b, 1, &[], 0),
        Err(RemoteError::NoRoom { .. })
    ));
    // What a client may keep on peers is their room over the copies a page takes.
    assert_eq!(b.capacity_bytes(&[peer(2, 9), peer(3, 9)], 0), 9 * PAGE);
    assert_eq!(b.capacity_bytes(&[peer(2, 9)], 0), 9 * PAGE);
}

#[test]
fn no_room_and_unreachable_peers() {
    let mut brain = brain(1, 1);
    let mut pool = vec![peer(2, 3), peer(3, 3)];
    pool[1].reachable = false;
    assert!(matches!(
        plan(&mut brain, 4, &pool, 0),
        Err(RemoteError::NoRoom {
            requested_bytes,
            free_bytes
        }) if requested_bytes == 4 * PAGE && free_bytes == 3 * PAGE
    ));
    pool[1].reachable = true;
    // Excluded after a failed put: the same answer.
    let items = brain.spill_items(pages(4));
    assert!(brain.plan(1, items, &pool, &[NodeId(3)], 0).is_err());
    // Both: a run that fits no single peer goes page by page.
    let holders = plan(&mut brain, 4, &pool, 0).unwrap().holders();
    let on_2 = holders.iter().filter(|h| **h == vec![NodeId(2)]).count();
    assert_eq!(on_2, 2);
}

#[test]
fn a_refused_reservation_fails_the_spill_and_spends_nothing() {
    let mut brain = brain(1, 1);
    let plan = plan(&mut brain, 2, &[peer(2, 9)], 0).unwrap();
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
fn a_failed_replica_is_replanned_away_from_the_copy_that_landed() {
    let mut b = brain(2, 8);
    let pool = [peer(2, 9), peer(3, 9), peer(4, 9)];
    let p = plan(&mut b, 2, &pool, 0).unwrap();
    let planned = b
        .reserved(p, &[Outcome::Accepted, Outcome::Accepted])
        .unwrap();
    let failed = planned[1].holder;
    let (redo, ok): (Vec<Planned>, Vec<Planned>) =
        planned.into_iter().partition(|p| p.holder == failed);
    let items = Placement::replan_items(&ok, redo);
    assert_eq!(items.len(), 2);
    let p = b.plan(1, items, &pool, &[failed], 0).unwrap();
    for (h, page_ok) in p.holders().iter().zip([0, 1]) {
        let kept = ok.iter().find(|o| o.client_page.index == page_ok).unwrap();
        assert_eq!(h.len(), 1);
        assert_ne!(h[0], failed);
        assert_ne!(h[0], kept.holder);
    }
}

#[test]
fn a_respill_elsewhere_leaves_a_copy_to_delete_and_fetches_route_by_holder() {
    let mut brain = brain(1, 1);
    let first = spilled(&mut brain, 1, &[peer(2, 9)]);
    let items = brain.spill_items(pages(1));
    let plan = brain
        .plan(1, items, &[peer(2, 9), peer(3, 9)], &[NodeId(2)], 0)
        .unwrap();
    let second = brain.reserved(plan, &[Outcome::Accepted]).unwrap();
    let stale = brain.placed(1, &second);
    assert_eq!(stale.keys().copied().collect::<Vec<_>>(), vec![NodeId(2)]);
    let ids = vec![first[0].client_page];
    let held = brain.known_holders(1, &ids);
    let pool = [peer(2, 9), peer(3, 9)];
    let fetch = brain
        .start_fetch(1, ids.clone(), &held, &pool, None)
        .unwrap();
    let gets = brain.get_requests(&fetch);
    assert_eq!(gets.len(), 1);
    assert_eq!(gets[0].peer, NodeId(3));
    assert_eq!(gets[0].ids, vec![first[0].remote]);
    // The only holder: a stop in answering is waited for.
    assert!(gets[0].last_chance);
    // A page nobody holds fails the fetch.
    assert!(matches!(
        brain.start_fetch(1, ids, &[None], &pool, None),
        Err(RemoteError::NotFound { .. })
    ));
}

#[test]
fn a_fetch_fails_over_to_the_next_holder_checking_every_copy() {
    let mut b = brain(3, 8);
    let pool = [peer(2, 9), peer(3, 8), peer(4, 7)];
    let planned = spilled(&mut b, 2, &pool);
    let ids: Vec<PageId> = pages(2).iter().map(|p| p.page).collect();
    let held = b.known_holders(1, &ids);
    let mut fetch = b.start_fetch(1, ids.clone(), &held, &pool, None).unwrap();
    // Slot order: node 2, then 3, then 4.
    assert_eq!(fetch.order(0), &[NodeId(2), NodeId(3), NodeId(4)]);
    let remote = |i: usize| {
        planned
            .iter()
            .find(|p| p.client_page == ids[i])
            .unwrap()
            .remote
    };
    // Round 1: node 2 is gone.
    let gets = b.get_requests(&fetch);
    assert_eq!(gets.len(), 1);
    assert!(!gets[0].last_chance);
    let gone = Err(NetError::ConnectionLost {
        peer: NodeId(2),
        reason: "killed".into(),
    });
    b.got(&mut fetch, &gets[0], gone);
    // Round 2: node 3 serves page 0 with other bytes, page 1 right.
    let gets = b.get_requests(&fetch);
    assert_eq!((gets.len(), gets[0].peer), (1, NodeId(3)));
    let right = |i: usize| Page::new(remote(i), Bytes::from_static(b"x"));
    let reply = Response::Get {
        pages: vec![Page::new(remote(0), Bytes::from_static(b"y")), right(1)],
        missing: vec![],
    };
    b.got(&mut fetch, &gets[0], Ok(reply));
    // Round 3: page 0 alone from node 4, its last holder.
    let gets = b.get_requests(&fetch);
    assert_eq!((gets.len(), gets[0].peer), (1, NodeId(4)));
    assert_eq!(gets[0].idx, vec![0]);
    assert!(gets[0].last_chance);
    let reply = Response::Get {
        pages: vec![right(0)],
        missing: vec![],
    };
    b.got(&mut fetch, &gets[0], Ok(reply));
    assert!(b.get_requests(&fetch).is_empty());
    let back = fetch.finish().unwrap();
    assert!(back.iter().all(|d| d.as_ref() == b"x"));
    assert_eq!(b.fetch_failovers, 2);
    assert_eq!(b.per_peer[&NodeId(2)].errors, 1);
}

#[test]
fn a_page_no_holder_serves_fails_with_its_last_error() {
    let mut b = brain(1, 1);
    let planned = spilled(&mut b, 1, &[peer(2, 9)]);
    let ids = vec![planned[0].client_page];
    let held = b.known_holders(1, &ids);
    let mut fetch = b.start_fetch(1, ids, &held, &[peer(2, 9)], None).unwrap();
    let gets = b.get_requests(&fetch);
    let reply = Response::Get {
        pages: vec![Page::new(planned[0].remote, Bytes::from_static(b"y"))],
        missing: vec![],
    };
    b.got(&mut fetch, &gets[0], Ok(reply));
    assert!(b.get_requests(&fetch).is_empty());
    assert!(matches!(
        fetch.finish(),
        Err(RemoteError::Corrupt { peer, .. }) if peer == NodeId(2)
    ));
}

#[test]
fn the_nearest_live_holder_is_read_first() {
    let mut b = brain(3, 8);
    let pool = [zoned(2, 9, "a"), zoned(3, 8, "b"), zoned(4, 7, "c")];
    spilled(&mut b, 1, &pool);
    let ids = vec![pages(1)[0].page];
    let held = b.known_holders(1, &ids);
    let order = |pool: &[Candidate], zone| {
        b.start_fetch(1, ids.clone(), &held, pool, zone)
            .unwrap()
            .order(0)
            .to_vec()
    };
    let slots: Vec<NodeId> = held[0].unwrap().copies().map(|(_, r)| r.holder).collect();
    // This node's zone first, then slot order.
    let mine = pool.iter().find(|c| c.id == slots[2]).unwrap().zone.clone();
    assert_eq!(
        order(&pool, mine.as_deref()),
        vec![slots[2], slots[0], slots[1]]
    );
    // A holder declared down goes last; one that restarted (another epoch) is not asked.
    let mut pool = pool.to_vec();
    let at = |n: NodeId| pool.iter().position(|c| c.id == n).unwrap();
    let (first, second) = (at(slots[0]), at(slots[1]));
    pool[first].state = MemberState::Down;
    pool[second].epoch = Epoch(2);
    assert_eq!(order(&pool, None), vec![slots[2], slots[0]]);
}

#[test]
fn the_ramp_grows_from_its_floor_to_full_weight() {
    assert_eq!(ramp_permille(5_000, 5_000), RAMP_FLOOR_PERMILLE);
    // A clock behind the member's up time counts as just up.
    assert_eq!(ramp_permille(5_000, 0), RAMP_FLOOR_PERMILLE);
    let steps: Vec<u64> = (0..=10)
        .map(|k| ramp_permille(0, k * RAMP_MS / 10))
        .collect();
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "{steps:?}");
    // Linear: the middle is half way between floor and full.
    assert_eq!(
        steps[5],
        RAMP_FLOOR_PERMILLE + (1000 - RAMP_FLOOR_PERMILLE) / 2
    );
    assert_eq!(steps[10], 1000);
    assert_eq!(ramp_permille(0, 10 * RAMP_MS), 1000);
}

#[test]
fn a_node_restarted_empty_is_filled_gradually_not_flooded() {
    // Three peers up for long with 100 pages free; node 5 just restarted, empty (400).
    let up_at = 1_000_000;
    let mut pool = vec![peer(2, 100), peer(3, 100), peer(4, 100), peer(5, 400)];
    pool[3].up_since_ms = up_at;
    let times = [0, RAMP_MS / 8, RAMP_MS / 4, RAMP_MS / 2, RAMP_MS];
    let shares: Vec<u64> = times
        .iter()
        .map(|t| {
            let mut b = brain(1, 8);
            let holders = plan(&mut b, 96, &pool, up_at + t).unwrap().holders();
            holders.iter().filter(|h| **h == vec![NodeId(5)]).count() as u64
        })
        .collect();
    // Just up: nothing while the others have room (without the ramp it would take all
    // 96 pages, having the most room).
    assert_eq!(shares[0], 0, "{shares:?}");
    // Then more and more as it ramps up...
    assert!(shares.windows(2).all(|w| w[0] <= w[1]), "{shares:?}");
    assert!(shares[1] < shares[3], "{shares:?}");
    // ...but never filled past its weight: its room left stays at least the others'
    // room over its weight (less one run, the planner's granularity).
    for (t, taken) in times.iter().zip(&shares) {
        let w = ramp_permille(up_at, up_at + t);
        let floor = (100 * 1000 / w).saturating_sub(RUN_PAGES as u64);
        assert!(
            400 - taken >= floor.min(400),
            "at {t} ms: took {taken} {shares:?}"
        );
    }
    // Ramped up: it is a peer like the others (the one with most room).
    assert_eq!(shares[4], 96, "{shares:?}");
}

#[test]
fn a_dead_copy_is_repaired_on_a_new_holder_keeping_the_live_one() {
    let mut b = brain(2, 8);
    let pool = [peer(2, 50), peer(3, 40), peer(4, 30)];
    let planned = spilled(&mut b, 4, &pool);
    // Every page on 2 and 3; node 2 dies (down).
    assert!(planned.iter().all(|p| p.holder != NodeId(4)));
    let mut after = with_state(&pool, 0, MemberState::Down);
    let jobs = b.repair_jobs(&after, 100);
    assert_eq!(jobs.len(), 4);
    assert_eq!(
        b.under_replicated,
        UnderReplicated {
            pages: 4,
            bytes: 4 * PAGE,
            lost_pages: 0
        }
    );
    assert!(jobs.iter().all(|j| j.slots == 0b01));
    let data = vec![Some(Bytes::from_static(b"x")); 4];
    let items = Placement::repair_items(&jobs, data);
    let p = b.plan(1, items, &after, &[], 0).unwrap();
    assert!(p.holders().iter().all(|h| *h == vec![NodeId(4)]));
    let outcomes = vec![Outcome::Accepted; p.proposal().len()];
    let copies = b.reserved(p, &outcomes).unwrap();
    assert!(copies.iter().all(|c| c.slot == 0));
    // The dead copies on node 2 are to delete (it may have been paused, not gone).
    let dead = b.repaired(1, &copies);
    assert_eq!(dead.keys().copied().collect::<Vec<_>>(), vec![NodeId(2)]);
    assert_eq!(dead[&NodeId(2)].len(), 4);
    assert_eq!((b.repaired_pages, b.repaired_bytes), (4, 4));
    assert!(b.repair_jobs(&after, 100).is_empty());
    assert_eq!(b.under_replicated, UnderReplicated::default());
    // Node 3 restarts too (another epoch): no live copy but node 4's.
    after[1].epoch = Epoch(2);
    assert_eq!(b.repair_jobs(&after, 2).len(), 2);
    assert_eq!(b.under_replicated.pages, 4);
    // Node 4 dies as well: the only copies left are node 3's, fenced by its new epoch;
    // they are read (checksum checked) in case node 3 was only cut off, and every slot
    // is placed anew.
    after[2].state = MemberState::Down;
    let jobs = b.repair_jobs(&after, 100);
    assert_eq!(jobs.len(), 4);
    assert!(jobs.iter().all(|j| j.fenced && j.slots == 0b11));
    assert_eq!(b.under_replicated.lost_pages, 0);
    // Node 3 down too: every page lost.
    after[1].state = MemberState::Down;
    assert!(b.repair_jobs(&after, 100).is_empty());
    assert_eq!(b.under_replicated.lost_pages, 4);
}

#[test]
fn a_repair_of_a_page_spilled_again_meanwhile_is_deleted() {
    let mut b = brain(1, 8);
    let planned = spilled(&mut b, 1, &[peer(2, 9)]);
    let mut copy = planned[0].clone();
    copy.holder = NodeId(3);
    copy.checksum ^= 1;
    let stale = b.repaired(1, &[copy]);
    assert_eq!(stale.keys().copied().collect::<Vec<_>>(), vec![NodeId(3)]);
    assert_eq!(b.repaired_pages, 0);
}

#[test]
fn a_page_is_never_repaired_while_a_client_changes_it_nor_changed_while_repaired() {
    // Found by `spillway chaos run --scenarios kill-two`: a repair copying a page's old
    // bytes raced a newer spill of it to the same holder and then deleted that copy as
    // stale; the record named a copy that was gone, and a second death lost the page.
    let mut b = brain(2, 8);
    let pool = [peer(2, 50), peer(3, 40), peer(4, 30)];
    let planned = spilled(&mut b, 4, &pool);
    let mut pages: Vec<PageId> = planned.iter().map(|p| p.client_page).collect();
    pages.dedup();
    assert_eq!(pages.len(), 4);
    let after = with_state(&pool, 0, MemberState::Down);
    // A client spills pages 0 and 1 again: the scan counts them but leaves them out.
    assert!(b.claim(1, &pages[..2]));
    let jobs = b.repair_jobs(&after, 100);
    assert_eq!(
        jobs.iter().map(|j| j.page).collect::<Vec<_>>(),
        pages[2..].to_vec()
    );
    assert_eq!(b.under_replicated.pages, 4);
    // The batch holds pages 2 and 3: a client's claim on one of them fails, whole.
    b.hold_for_repair(&jobs);
    assert!(!b.claim(1, &pages[1..3]));
    assert!(b.claim(1, &pages[..2]), "claims of clients stack");
    // A second scan hands out nothing: 0 and 1 are claimed, 2 and 3 held.
    assert!(b.repair_jobs(&after, 100).is_empty());
    b.end_repair(&jobs);
    assert!(b.claim(1, &pages[2..3]));
    b.unclaim(1, &pages[2..3]);
    // Page 0 and 1 stay claimed until both claims end.
    b.unclaim(1, &pages[..2]);
    assert_eq!(b.repair_jobs(&after, 100).len(), 2);
    b.unclaim(1, &pages[..2]);
    assert_eq!(b.repair_jobs(&after, 100).len(), 4);
}

#[test]
fn pending_deletes_keep_a_peer_out_of_plans_until_they_land() {
    let mut brain = brain(1, 1);
    let remote = remote_page_id(NodeId(1), 1, pages(1)[0].page);
    brain.queue_deletes(NodeId(2), vec![remote]);
    assert_eq!(brain.pending_deletes_len(), 1);
    assert!(plan(&mut brain, 1, &[peer(2, 9)], 0).is_err());
    brain.deletes_landed(NodeId(2), &[remote]);
    assert_eq!(brain.pending_deletes_len(), 0);
    assert!(plan(&mut brain, 1, &[peer(2, 9)], 0).is_ok());
}

#[test]
fn a_respill_removes_the_earlier_records_first_and_a_repair_does_not() {
    let mut b = brain(2, 8);
    let pool = [peer(2, 9), peer(3, 9)];
    let first = spilled(&mut b, 2, &pool);
    // Spilled again: one remove of both pages (every slot), then a place per slot.
    let p = b.placements(&first, 1, true);
    assert_eq!((p.removes, p.extents.len()), (1, 2));
    assert!(matches!(p.updates[0], Update::Remove { extent } if extent.page_count == 2));
    assert!(
        p.updates[1..]
            .iter()
            .zip([0u8, 1])
            .all(|(u, s)| matches!(u, Update::Place { replica, .. } if *replica == s))
    );
    // A refused place is found behind the removes.
    let mut outcomes = vec![Outcome::Accepted; p.updates.len()];
    outcomes[2] = Outcome::Rejected {
        reason: "lapsed".into(),
    };
    let (retry, updates, _) = b.replace_refused(&p, &outcomes);
    assert_eq!(retry, vec![1]);
    assert!(matches!(updates[..], [Update::Place { replica: 1, .. }]));
    // A repair fills slots only.
    assert_eq!(b.placements(&first, 1, false).removes, 0);
}

#[test]
fn a_leaving_holder_is_drained_from_its_own_copy() {
    let mut b = brain(2, 8);
    let pool = [peer(2, 50), peer(3, 40), peer(4, 30)];
    spilled(&mut b, 2, &pool);
    let after = with_state(&pool, 0, MemberState::Leaving);
    let jobs = b.repair_jobs(&after, 100);
    assert_eq!(jobs.len(), 2);
    // Node 2's copy stays a source (live), its slot is refilled.
    assert!(
        jobs.iter()
            .all(|j| j.slots == 0b01 && j.live.held_on(NodeId(2)))
    );
    let data = vec![Some(Bytes::from_static(b"x")); 2];
    let p = b
        .plan(1, Placement::repair_items(&jobs, data), &after, &[], 0)
        .unwrap();
    // The new copy goes to the one peer holding none: node 4.
    assert!(p.holders().iter().all(|h| *h == vec![NodeId(4)]));
    let outcomes = vec![Outcome::Accepted; p.proposal().len()];
    let copies = b.reserved(p, &outcomes).unwrap();
    let drained = b.repaired(1, &copies);
    assert_eq!(drained[&NodeId(2)].len(), 2);
    assert!(b.repair_jobs(&after, 100).is_empty());
}

#[test]
fn buffers_by_holder_names_every_buffer_a_holder_has_a_page_of() {
    let mut b = brain(2, 8);
    let pool = [peer(2, 30), peer(3, 30), peer(4, 30)];
    // Ten buffers of four pages.
    let ids: Vec<PageId> = (0..40u32)
        .map(|i| PageId {
            buffer: BufferId(1 + u64::from(i / 4)),
            index: i % 4,
        })
        .collect();
    let items = b.spill_items(
        ids.iter()
            .map(|&page| SpillPage {
                page,
                data: Bytes::from_static(b"x"),
                checksum: spillway_types::wire::page_checksum(b"x"),
            })
            .collect(),
    );
    let p = b.plan(1, items, &pool, &[], 0).unwrap();
    let outcomes = vec![Outcome::Accepted; p.proposal().len()];
    let planned = b.reserved(p, &outcomes).unwrap();
    b.placed(1, &planned);
    let mut want: BTreeMap<NodeId, BTreeSet<BufferId>> = BTreeMap::new();
    for (id, held) in ids.iter().zip(b.known_holders(1, &ids)) {
        for (_, r) in held.unwrap().copies() {
            want.entry(r.holder).or_default().insert(id.buffer);
        }
    }
    let (got, truncated) = b.buffers_by_holder();
    assert!(!truncated);
    assert_eq!(got.keys().copied().collect::<Vec<_>>(), [1], "one client");
    assert_eq!(got[&1], want);
    // Two copies of each page on distinct holders: every buffer is listed at least twice.
    let listed: usize = want.values().map(BTreeSet::len).sum();
    assert!(listed >= 20, "{want:?}");
}

#[test]
fn a_spill_is_not_acknowledged_short_while_an_up_member_is_out_of_reach() {
    // Regression (`spillway chaos sim`): node 3 cut off but not declared down; the spill
    // used to go through with one copy, which a single crash then lost.
    let mut b = brain(2, 8);
    let mut pool = vec![peer(2, 40), peer(3, 40)];
    pool[1].reachable = false;
    let err = plan(&mut b, 4, &pool, 0).unwrap_err();
    assert!(
        matches!(
            &err,
            RemoteError::ShortOfPeers { copies: 1, wanted: 2, out_of_reach } if *out_of_reach == vec![NodeId(3)]
        ),
        "{err}"
    );
    // The same after a failed put (excluded), with a delete of the page pending there.
    pool[1].reachable = true;
    let items = b.spill_items(pages(4));
    assert!(matches!(
        b.plan(1, items, &pool, &[NodeId(3)], 0),
        Err(RemoteError::ShortOfPeers { .. })
    ));
    // Once the pool declares it down, the spill keeps the copy that exists.
    pool[1].state = MemberState::Down;
    let p = plan(&mut b, 4, &pool, 0).unwrap();
    assert!(p.holders().iter().all(|h| *h == vec![NodeId(2)]));
    assert_eq!(b.short_copies, 4);
}

/// A fetch of `ids` run to its end, each holder answering with `bytes(holder)` for every
/// page asked (`None`: it has none of them).
fn serve_rounds(
    b: &mut Placement,
    ids: Vec<PageId>,
    held: &[Option<Held>],
    pool: &[Candidate],
    bytes: impl Fn(NodeId) -> Option<&'static [u8]>,
) -> Fetch {
    let mut fetch = b.start_fetch(1, ids, held, pool, None).unwrap();
    for _ in 0..=FETCH_ROUNDS_MAX {
        for r in b.get_requests(&fetch) {
            let reply = match bytes(r.peer) {
                Some(data) => Response::Get {
                    pages: r
                        .ids
                        .iter()
                        .map(|id| Page::new(*id, Bytes::from_static(data)))
                        .collect(),
                    missing: vec![],
                },
                None => Response::Get {
                    pages: vec![],
                    missing: r.ids.clone(),
                },
            };
            b.got(&mut fetch, &r, Ok(reply));
        }
    }
    fetch
}

/// Node 1's pages 0..n spilled on nodes 2 and 3, then both fenced: node 2 came back
/// from a partition at epoch 2 (its bytes kept), node 3 restarted at epoch 2.
fn fenced_pool(b: &mut Placement, n: u32) -> Vec<Candidate> {
    let pool = [peer(2, 40), peer(3, 40)];
    spilled(b, n, &pool);
    pool.iter()
        .map(|c| Candidate {
            epoch: Epoch(2),
            ..c.clone()
        })
        .collect()
}

#[test]
fn a_page_whose_copies_are_all_fenced_is_read_from_an_up_holder_by_its_checksum() {
    // Regression (`spillway chaos sim`): a partition then a crash left a page's only
    // bytes on a holder fenced by its new epoch; the page was unreadable for good.
    let mut b = brain(2, 8);
    let pool = fenced_pool(&mut b, 2);
    let ids: Vec<PageId> = pages(2).iter().map(|p| p.page).collect();
    let held = b.known_holders(1, &ids);
    // Node 3 restarted (nothing there); node 2 kept the bytes.
    let fetch = serve_rounds(&mut b, ids.clone(), &held, &pool, |peer| {
        (peer == NodeId(2)).then_some(&b"x"[..])
    });
    assert_eq!(fetch.finish().unwrap(), vec![Bytes::from_static(b"x"); 2]);
    // Other bytes under the same id (a stale version) are refused by the checksum.
    let fetch = serve_rounds(&mut b, ids.clone(), &held, &pool, |_| Some(&b"old"[..]));
    assert!(matches!(fetch.finish(), Err(RemoteError::Corrupt { .. })));
    // A holder that is down is not read.
    let mut down = pool.clone();
    down[0].state = MemberState::Down;
    down[1].state = MemberState::Down;
    assert!(matches!(
        b.start_fetch(1, ids, &held, &down, None),
        Err(RemoteError::NotFound { .. })
    ));
}

#[test]
fn a_fenced_page_is_repaired_into_every_slot_and_a_re_placed_holder_keeps_its_copy() {
    let mut b = brain(2, 8);
    let pool = fenced_pool(&mut b, 1);
    let jobs = b.repair_jobs(&pool, 100);
    assert_eq!(jobs.len(), 1);
    assert!(jobs[0].fenced);
    assert_eq!(jobs[0].slots, 0b11);
    assert_eq!(b.under_replicated.lost_pages, 0);
    let items = Placement::repair_items(&jobs, vec![Some(Bytes::from_static(b"x"))]);
    assert!(
        items[0].keep.iter().all(Option::is_none),
        "fenced copies are not kept"
    );
    let p = b.plan(1, items, &pool, &[], 0).unwrap();
    let outcomes = vec![Outcome::Accepted; p.proposal().len()];
    let copies = b.reserved(p, &outcomes).unwrap();
    assert_eq!(copies.len(), 2);
    // Both holders took the page again at their new epoch: no copy is deleted, though
    // each slot's dead copy may name the other holder.
    let dead = b.repaired(1, &copies);
    assert!(dead.is_empty(), "{dead:?}");
    assert_eq!(b.repair_jobs(&pool, 100).len(), 0);
}

#[test]
fn repair_rounds_take_turns_so_no_page_waits_forever() {
    // Regression (`spillway chaos sim`): pages that could not be repaired kept the head
    // of every round, and the pages after them were never repaired.
    let mut b = brain(2, 8);
    let pool = [peer(2, 50), peer(3, 50), peer(4, 50)];
    spilled(&mut b, 6, &pool);
    // Every page on nodes 2 and 3 (most room, lowest id first); node 2 is down.
    let after = with_state(&pool, 0, MemberState::Down);
    let round = |b: &mut Placement| -> Vec<u32> {
        b.repair_jobs(&after, 4)
            .iter()
            .map(|j| j.page.index)
            .collect()
    };
    let first = round(&mut b);
    assert_eq!(first.len(), 4);
    let second = round(&mut b);
    // The two pages left out come first, then the turn wraps around.
    assert!(
        second.contains(&4) && second.contains(&5),
        "{first:?} then {second:?}"
    );
    let mut seen: Vec<u32> = first.iter().chain(&second).copied().collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen, vec![0, 1, 2, 3, 4, 5]);
}

#[test]
fn a_holder_that_did_not_answer_is_asked_again_once_the_others_failed() {
    // Regression (`spillway chaos sim`, clients running the real core): a page's first
    // holder was cut off for a moment and its second died; the fetch failed, and the core
    // lost the buffer, though the first holder was back with the bytes.
    let mut b = brain(2, 8);
    let pool = [peer(2, 40), peer(3, 40)];
    spilled(&mut b, 1, &pool);
    let ids: Vec<PageId> = pages(1).iter().map(|p| p.page).collect();
    let held = b.known_holders(1, &ids);
    let mut fetch = b.start_fetch(1, ids, &held, &pool, None).unwrap();
    let mut asked = Vec::new();
    for _ in 0..=FETCH_ROUNDS_MAX {
        for r in b.get_requests(&fetch) {
            asked.push((r.peer, r.last_chance));
            // Each holder fails the first time it is asked; node 2 answers the second.
            let again = asked.iter().filter(|(p, _)| *p == r.peer).count() > 1;
            let reply = if again && r.peer == NodeId(2) {
                Ok(Response::Get {
                    pages: r
                        .ids
                        .iter()
                        .map(|id| Page::new(*id, Bytes::from_static(b"x")))
                        .collect(),
                    missing: vec![],
                })
            } else {
                Err(NetError::ConnectionLost {
                    peer: r.peer,
                    reason: "no answer".into(),
                })
            };
            b.got(&mut fetch, &r, reply);
        }
    }
    assert_eq!(fetch.finish().unwrap(), vec![Bytes::from_static(b"x")]);
    assert_eq!(asked.len(), 3, "{asked:?}");
    assert!(
        asked[2].1,
        "the holder asked again is waited for: {asked:?}"
    );
    // A holder that answered it has no copy is not asked again.
    let ids: Vec<PageId> = pages(1).iter().map(|p| p.page).collect();
    let fetch = serve_rounds(&mut b, ids, &held, &pool, |_| None);
    assert!(matches!(fetch.finish(), Err(RemoteError::NotFound { .. })));
}
