//! Spill planning without IO: which peers take each run of pages and each replica slot,
//! and which reservations pay for them ([`Placement::plan`]; see the parent module's docs
//! for the rules: distinct holders, distinct zones when labelled, weighted room, the
//! ramp of a member that came back).

use std::collections::BTreeMap;
use std::sync::Arc;

use spillway_meta::{Epoch, MemberState, ReservationId};
use spillway_types::NodeId;

use super::{
    Candidate, Placement, Plan, RESERVATION_MARGIN, Reserve, SLOTS, ToPlace, ramp_permille,
};
use crate::tier::{RUN_PAGES, RemoteError, remote_page_id};

/// Room on one eligible peer while planning.
#[derive(Clone, Debug)]
struct Room {
    free: u64,
    ours: u64,
    epoch: Epoch,
    zone: Option<Arc<str>>,
    weight_permille: u64,
}

impl Placement {
    /// Chooses holders for every item's slots: runs of up to [`RUN_PAGES`] pages, each
    /// slot of a run to the up, reachable, not excluded peer with the most weighted room
    /// (free capacity plus what this node holds reserved there, times its ramp weight)
    /// that holds no other copy of those pages (and is in another zone, when labelled and
    /// possible), page by page where no peer takes a whole run; and the reservations to
    /// make where this node's fall short, in chunks of `reserve_chunk_bytes` (down to the
    /// peer's free capacity). A copy with no distinct peer left is skipped and counted
    /// (`short_copies`, logged once, repaired later); no room for the copies that have a
    /// peer is [`RemoteError::NoRoom`].
    pub(crate) fn plan(
        &mut self,
        client: u32,
        items: Vec<ToPlace>,
        pool: &[Candidate],
        excluded: &[NodeId],
        now_ms: u64,
    ) -> Result<Plan, RemoteError> {
        let spend_limit = now_ms + RESERVATION_MARGIN.as_millis() as u64;
        // A peer with a delete of one of these pages pending could drop the new copy.
        let deleting = |peer: NodeId| {
            self.pending_deletes.get(&peer).is_some_and(|set| {
                items
                    .iter()
                    .any(|p| set.contains(&remote_page_id(self.node, client, p.page.page)))
            })
        };
        let mut room: BTreeMap<NodeId, Room> = BTreeMap::new();
        for m in pool {
            if m.id == self.node
                || m.state != MemberState::Up
                || excluded.contains(&m.id)
                || !m.reachable
                || deleting(m.id)
            {
                continue;
            }
            room.insert(
                m.id,
                Room {
                    free: m.free_bytes,
                    ours: self.ledger.unspent_on(m.id, spend_limit),
                    epoch: m.epoch,
                    zone: m.zone.clone(),
                    weight_permille: ramp_permille(m.up_since_ms, now_ms),
                },
            );
        }
        let zoned = !room.is_empty() && room.values().all(|r| r.zone.is_some());
        let zone_of = |node: NodeId| -> Option<Arc<str>> {
            pool.iter()
                .find(|c| c.id == node)
                .and_then(|c| c.zone.clone())
        };
        // Per item: the nodes holding a copy (kept or planned here) and their zones.
        let mut taken: Vec<Vec<NodeId>> = items
            .iter()
            .map(|it| it.keep.iter().flatten().map(|r| r.holder).collect())
            .collect();
        let mut taken_zones: Vec<Vec<Arc<str>>> = taken
            .iter()
            .map(|t| t.iter().filter_map(|n| zone_of(*n)).collect())
            .collect();
        let copies_wanted: u64 = items
            .iter()
            .zip(&taken)
            .map(|(it, t)| {
                let distinct = room.keys().filter(|p| !t.contains(p)).count() as u64;
                u64::from(it.slots.count_ones()).min(distinct)
            })
            .sum();
        let needed_bytes = copies_wanted * self.page_bytes;
        let total_room: u64 = room.values().map(|r| r.free + r.ours).sum();
        let no_room = RemoteError::NoRoom {
            requested_bytes: needed_bytes,
            free_bytes: total_room,
        };
        if needed_bytes > total_room || (room.is_empty() && !items.is_empty()) {
            return Err(no_room);
        }
        let mut left: BTreeMap<NodeId, u64> =
            room.iter().map(|(p, r)| (*p, r.free + r.ours)).collect();
        let best = |left: &BTreeMap<NodeId, u64>, bytes: u64, ok: &dyn Fn(NodeId) -> bool| {
            left.iter()
                .filter(|(p, l)| **l >= bytes && ok(**p))
                .max_by_key(|(p, l)| {
                    let score = u128::from(**l) * u128::from(room[*p].weight_permille);
                    (score, std::cmp::Reverse(**p))
                })
                .map(|(p, _)| *p)
        };
        let mut assigned: Vec<(usize, u8, NodeId)> = Vec::new();
        let mut short_copies = 0u64;
        let all: Vec<usize> = (0..items.len()).collect();
        for run in all.chunks(RUN_PAGES) {
            for slot in 0..SLOTS as u8 {
                let members: Vec<usize> = run
                    .iter()
                    .copied()
                    .filter(|&i| items[i].slots & (1 << slot) != 0)
                    .collect();
                if members.is_empty() {
                    continue;
                }
                let bytes = members.len() as u64 * self.page_bytes;
                let clash_node = |p: NodeId| members.iter().any(|&i| taken[i].contains(&p));
                let clash_zone = |p: NodeId| {
                    zoned
                        && room[&p]
                            .zone
                            .as_ref()
                            .is_some_and(|z| members.iter().any(|&i| taken_zones[i].contains(z)))
                };
                let whole = best(&left, bytes, &|p| !clash_node(p) && !clash_zone(p))
                    .or_else(|| best(&left, bytes, &|p| !clash_node(p)));
                let picks: Vec<(usize, Option<NodeId>)> = match whole {
                    Some(peer) => members.iter().map(|&i| (i, Some(peer))).collect(),
                    None => {
                        // No single peer takes the whole run: page by page.
                        let mut picks = Vec::with_capacity(members.len());
                        for &i in &members {
                            if room.keys().all(|p| taken[i].contains(p)) {
                                picks.push((i, None));
                                continue;
                            }
                            let zone_ok = |p: NodeId| {
                                !zoned
                                    || room[&p]
                                        .zone
                                        .as_ref()
                                        .is_none_or(|z| !taken_zones[i].contains(z))
                            };
                            let own = |p: NodeId| !taken[i].contains(&p);
                            let Some(peer) =
                                best(&left, self.page_bytes, &|p| own(p) && zone_ok(p))
                                    .or_else(|| best(&left, self.page_bytes, &own))
                            else {
                                return Err(no_room);
                            };
                            *left.get_mut(&peer).expect("peer in room") -= self.page_bytes;
                            taken[i].push(peer);
                            picks.push((i, Some(peer)));
                        }
                        // Already charged and taken: record only.
                        for (i, peer) in &picks {
                            match peer {
                                Some(peer) => assigned.push((*i, slot, *peer)),
                                None => short_copies += 1,
                            }
                            if let Some(z) = peer.and_then(|p| room[&p].zone.clone()) {
                                taken_zones[*i].push(z);
                            }
                        }
                        continue;
                    }
                };
                for (i, peer) in picks {
                    let peer = peer.expect("a whole-run pick");
                    *left.get_mut(&peer).expect("peer in room") -= self.page_bytes;
                    taken[i].push(peer);
                    if let Some(z) = room[&peer].zone.clone() {
                        taken_zones[i].push(z);
                    }
                    assigned.push((i, slot, peer));
                }
            }
        }
        // Every page keeps or gets at least one copy.
        for (i, it) in items.iter().enumerate() {
            if it.keep.iter().all(Option::is_none) && !assigned.iter().any(|(j, _, _)| *j == i) {
                return Err(no_room);
            }
        }
        // A copy is left out only for want of members: an up member that this spill
        // cannot use (unreachable, failed a put, a delete pending there) fails it, so an
        // acknowledged page is never short of copies while a member that could hold one
        // is merely out of reach (found by `spillway chaos sim`: a spill during a
        // partition was acknowledged with one copy, and a single crash then lost it).
        if short_copies > 0 {
            self.check_short_for_want_of_members(&items, &assigned, pool, &room)?;
        }
        assigned.sort_by_key(|(i, s, _)| (*i, *s));
        let mut need_per_peer: BTreeMap<NodeId, u64> = BTreeMap::new();
        for (_, _, peer) in &assigned {
            *need_per_peer.entry(*peer).or_default() += self.page_bytes;
        }
        let mut reserves = Vec::new();
        for (peer, need) in &need_per_peer {
            let r = &room[peer];
            if *need > r.ours {
                let deficit = need - r.ours;
                let chunk = self.reserve_chunk_bytes.max(self.page_bytes);
                let want = deficit.div_ceil(chunk) * chunk;
                let bytes = want
                    .min(r.free / self.page_bytes * self.page_bytes)
                    .max(deficit);
                let id = ReservationId(self.next_reservation);
                self.next_reservation += 1;
                reserves.push(Reserve {
                    peer: *peer,
                    id,
                    bytes,
                });
            }
        }
        // Reservations this node will not spend any more are given back now, not at
        // expiry.
        let releases = self.ledger.take_lapsing(spend_limit);
        if short_copies > 0 {
            self.short_copies += short_copies;
            self.repair_dirty = true;
            if !self.short_logged {
                self.short_logged = true;
                tracing::warn!(
                    replicas = self.replicas,
                    peers = room.len(),
                    "fewer peers than replicas: pages spilled with fewer copies (repaired when peers come)"
                );
            }
        } else if assigned.len() as u64 >= u64::from(self.replicas) {
            self.short_logged = false;
        }
        Ok(Plan {
            client,
            items,
            assigned,
            epochs: room.iter().map(|(p, r)| (*p, r.epoch)).collect(),
            reserves,
            releases,
            now_ms,
        })
    }

    /// Fails a plan that leaves a copy out while an up member, not holding that page,
    /// is left out of `room` ([`RemoteError::ShortOfPeers`]).
    fn check_short_for_want_of_members(
        &self,
        items: &[ToPlace],
        assigned: &[(usize, u8, NodeId)],
        pool: &[Candidate],
        room: &BTreeMap<NodeId, Room>,
    ) -> Result<(), RemoteError> {
        for (i, it) in items.iter().enumerate() {
            let kept: Vec<NodeId> = it.keep.iter().flatten().map(|r| r.holder).collect();
            let wanted = it.slots.count_ones() as usize;
            let placed = assigned.iter().filter(|(j, _, _)| *j == i).count();
            if placed >= wanted {
                continue;
            }
            let out_of_reach: Vec<NodeId> = pool
                .iter()
                .filter(|m| {
                    m.id != self.node
                        && m.state == MemberState::Up
                        && !room.contains_key(&m.id)
                        && !kept.contains(&m.id)
                })
                .map(|m| m.id)
                .collect();
            if !out_of_reach.is_empty() {
                return Err(RemoteError::ShortOfPeers {
                    copies: (kept.len() + placed) as u8,
                    wanted: (kept.len() + wanted) as u8,
                    out_of_reach,
                });
            }
        }
        Ok(())
    }
}
