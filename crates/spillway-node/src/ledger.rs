//! The reservations this node holds on its peers, as it spends them: a sans-IO ledger
//! that mirrors what the metadata group has reserved for this node.
//!
//! Invariant (checked by the property test below against the real state machine): once
//! every placement this node proposed has committed, for each reservation the group still
//! holds, this ledger holds the same id with the same bytes left; the group's reserved
//! bytes on a peer are what this node can still spend there. To keep it:
//! - a page placed with a reservation costs exactly one page of it, here and in the
//!   group ([`spillway_meta::Update::Place`] charges the whole extent);
//! - pages spent for a spill that failed before anything was proposed are
//!   [`Ledger::refund`]ed; a reservation whose placement was refused, or whose proposal's
//!   outcome is unknown, is [`Ledger::forget`]-ten and released in the group;
//! - reservations this node will no longer spend (too close to their expiry) leave the
//!   ledger through [`Ledger::take_lapsing`], and the caller proposes their
//!   [`spillway_meta::Update::Release`], so the group frees them at once instead of at
//!   expiry.
//!
//! Bounds: one entry per live reservation; a node reserves `reserve_chunk_bytes` at a
//! time, so entries ≈ peers × bytes spilled per reservation lifetime / chunk.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use spillway_meta::ReservationId;
use spillway_types::NodeId;

/// One reservation held on a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    id: ReservationId,
    remaining_bytes: u64,
    /// After this (local clock, ms) it is no longer spent.
    spend_until_ms: u64,
}

/// A page's worth spent from a reservation: what [`Ledger::refund`] needs to give it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spent {
    /// The reservation.
    pub id: ReservationId,
    spend_until_ms: u64,
}

/// This node's reservations on its peers (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    held: HashMap<NodeId, Vec<Held>>,
    /// Reservations the group did not hold at the last [`Ledger::drop_gone`].
    missing: BTreeSet<ReservationId>,
}

impl Ledger {
    /// Bytes this node may still spend on `peer` from reservations spendable past
    /// `spend_limit_ms`.
    pub fn unspent_on(&self, peer: NodeId, spend_limit_ms: u64) -> u64 {
        self.held.get(&peer).map_or(0, |rs| {
            rs.iter()
                .filter(|r| r.spend_until_ms > spend_limit_ms)
                .map(|r| r.remaining_bytes)
                .sum()
        })
    }

    /// Records a reservation the group accepted.
    pub fn add(&mut self, peer: NodeId, id: ReservationId, bytes: u64, spend_until_ms: u64) {
        debug_assert!(bytes > 0);
        self.held.entry(peer).or_default().push(Held {
            id,
            remaining_bytes: bytes,
            spend_until_ms,
        });
    }

    /// Spends `bytes` on `peer` from one reservation spendable past `spend_limit_ms`;
    /// `None` if none has that much left (the placement is then paid from free capacity).
    pub fn spend(&mut self, peer: NodeId, bytes: u64, spend_limit_ms: u64) -> Option<Spent> {
        let rs = self.held.get_mut(&peer)?;
        let i = rs
            .iter()
            .position(|r| r.spend_until_ms > spend_limit_ms && r.remaining_bytes >= bytes)?;
        let r = &mut rs[i];
        r.remaining_bytes -= bytes;
        let spent = Spent {
            id: r.id,
            spend_until_ms: r.spend_until_ms,
        };
        // The group drops a reservation spent to zero: so does the ledger.
        if r.remaining_bytes == 0 {
            rs.swap_remove(i);
        }
        Some(spent)
    }

    /// Gives back `bytes` spent with `spent` whose placement did not commit.
    pub fn refund(&mut self, peer: NodeId, spent: Spent, bytes: u64) {
        let rs = self.held.entry(peer).or_default();
        match rs.iter_mut().find(|r| r.id == spent.id) {
            Some(r) => r.remaining_bytes += bytes,
            None => rs.push(Held {
                id: spent.id,
                remaining_bytes: bytes,
                spend_until_ms: spent.spend_until_ms,
            }),
        }
    }

    /// Drops reservation `id` (when its state in the group is uncertain: a placement paid
    /// by it was refused, or a proposal's outcome is unknown). The caller releases it in
    /// the group. True if it was held.
    pub fn forget(&mut self, id: ReservationId) -> bool {
        let mut found = false;
        for rs in self.held.values_mut() {
            rs.retain(|r| {
                found |= r.id == id;
                r.id != id
            });
        }
        self.held.retain(|_, rs| !rs.is_empty());
        found
    }

    /// Drops the reservations among `known` that the group no longer holds (`held` says
    /// which ids it holds): expired, dropped with their node's old incarnation, or
    /// released. `known` must be taken before the group's state is read, so that a
    /// reservation accepted in between is not mistaken for a gone one. A reservation is
    /// dropped only when missing at two calls in a row: a follower's proposal is answered
    /// by the leader, so a reservation granted there may not be applied here yet when
    /// the state is read (dropped at once, it stayed reserved in the group, spent by
    /// nobody, until it expired: found by `tests/faults.rs` on a loaded machine).
    /// Returns how many went.
    pub fn drop_gone(
        &mut self,
        known: &[ReservationId],
        held: impl Fn(ReservationId) -> bool,
    ) -> usize {
        let missing: BTreeSet<ReservationId> =
            known.iter().copied().filter(|id| !held(*id)).collect();
        let gone: Vec<ReservationId> = missing.intersection(&self.missing).copied().collect();
        self.missing = missing;
        gone.iter().filter(|id| self.forget(**id)).count()
    }

    /// Removes the reservations no longer spendable past `spend_limit_ms` and returns
    /// their ids, for the caller to release in the group.
    pub fn take_lapsing(&mut self, spend_limit_ms: u64) -> Vec<ReservationId> {
        let mut out = Vec::new();
        for rs in self.held.values_mut() {
            rs.retain(|r| {
                let keep = r.spend_until_ms > spend_limit_ms;
                if !keep {
                    out.push(r.id);
                }
                keep
            });
        }
        self.held.retain(|_, rs| !rs.is_empty());
        out.sort();
        out
    }

    /// Every reservation held, with its bytes left (for checks, status and
    /// [`Ledger::drop_gone`]).
    pub fn remaining(&self) -> BTreeMap<ReservationId, u64> {
        self.held
            .values()
            .flatten()
            .map(|r| (r.id, r.remaining_bytes))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    //! The ledger against the real state machine, driven as `remote.rs` drives both:
    //! spills (new pages and re-spills of pages already placed, on the same or another
    //! holder), placements refused, spills that fail before placing, discards, and the
    //! clock running past spend limits and expiries.
    use proptest::prelude::*;
    use spillway_meta::{
        Batch, Extent, InitialCluster, MemberInfo, MemberState, MetaState, Update,
    };
    use spillway_types::BufferId;

    use super::*;

    const PAGE: u64 = 1 << 20;
    const CHUNK: u64 = 4 * PAGE;
    const TTL_MS: u64 = 600_000;
    const MARGIN_MS: u64 = 30_000;

    #[test]
    fn a_reservation_is_dropped_only_when_the_group_lacks_it_twice_in_a_row() {
        let (peer, a, b) = (NodeId(2), ReservationId(1), ReservationId(2));
        let mut ledger = Ledger::default();
        ledger.add(peer, a, PAGE, TTL_MS);
        ledger.add(peer, b, PAGE, TTL_MS);
        let known = [a, b];
        // Granted by the leader, not applied here yet: missing once, kept.
        assert_eq!(ledger.drop_gone(&known, |id| id == b), 0);
        // Applied by the next reconcile: kept; `b` now missing once.
        assert_eq!(ledger.drop_gone(&known, |id| id == a), 0);
        assert_eq!(ledger.unspent_on(peer, 0), 2 * PAGE);
        // `b` missing again: gone; `a` held.
        assert_eq!(ledger.drop_gone(&known, |id| id == a), 1);
        assert_eq!(ledger.remaining().into_keys().collect::<Vec<_>>(), vec![a]);
        // `a` missing twice: gone.
        assert_eq!(ledger.drop_gone(&[a], |_| false), 0);
        assert_eq!(ledger.drop_gone(&[a], |_| false), 1);
        assert_eq!(ledger.unspent_on(peer, 0), 0);
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Spill pages `first..first+count` of buffer `buffer` to `peer` (index into 2, 3).
        Spill {
            buffer: u64,
            first: u32,
            count: u32,
            peer: usize,
            /// The spill fails after spending (moving failed): nothing is placed.
            fails: bool,
        },
        Discard {
            buffer: u64,
        },
        Advance {
            ms: u64,
        },
        /// A holder restarts (a new incarnation: the group drops its reservations and
        /// records); the node then reconciles its ledger as its upkeep does.
        Restart {
            peer: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (1..4u64, 0..8u32, 1..6u32, 0..2usize, proptest::bool::weighted(0.15)).prop_map(
                |(buffer, first, count, peer, fails)| Op::Spill { buffer, first, count, peer, fails }
            ),
            1 => (1..4u64).prop_map(|buffer| Op::Discard { buffer }),
            2 => prop_oneof![Just(1_000u64), Just(200_000), Just(560_000), Just(700_000)]
                .prop_map(|ms| Op::Advance { ms }),
            1 => (0..2usize).prop_map(|peer| Op::Restart { peer }),
        ]
    }

    struct World {
        state: MetaState,
        ledger: Ledger,
        now_ms: u64,
        next_id: u64,
        version: u64,
    }

    impl World {
        fn commit(&mut self, updates: Vec<Update>) -> Vec<bool> {
            let out = self.state.apply_batch(&Batch {
                now_ms: self.now_ms,
                updates,
            });
            self.state.check_invariants().unwrap();
            out.iter().map(Result::is_ok).collect()
        }

        /// The placement of `extent` on `peer` at its current epoch, with `reservation`.
        fn place(
            &self,
            extent: Extent,
            peer: NodeId,
            reservation: Option<ReservationId>,
        ) -> Update {
            Update::Place {
                extent,
                holder: peer,
                epoch: self.state.member(peer).unwrap().epoch,
                version: self.version,
                reservation,
                replica: 0,
            }
        }

        /// One spill as `RemoteService::spill` does it.
        fn spill(&mut self, buffer: u64, first: u32, count: u32, peer: NodeId, fails: bool) {
            let spend_limit = self.now_ms + MARGIN_MS;
            let mut updates: Vec<Update> = self
                .ledger
                .take_lapsing(spend_limit)
                .into_iter()
                .map(|id| Update::Release { id })
                .collect();
            let need = u64::from(count) * PAGE;
            let ours = self.ledger.unspent_on(peer, spend_limit);
            let mut reserve = None;
            if need > ours {
                let free = self.state.free_bytes(peer).unwrap();
                let deficit = need - ours;
                let bytes = (deficit.div_ceil(CHUNK) * CHUNK)
                    .min(free / PAGE * PAGE)
                    .max(deficit);
                let id = ReservationId(self.next_id);
                self.next_id += 1;
                updates.push(Update::Reserve {
                    id,
                    node: peer,
                    bytes,
                    expires_at_ms: self.now_ms + TTL_MS,
                });
                reserve = Some((id, bytes));
            }
            let n = updates.len();
            let out = self.commit(updates);
            if let Some((id, bytes)) = reserve
                && out[n - 1]
            {
                self.ledger
                    .add(peer, id, bytes, self.now_ms + TTL_MS - MARGIN_MS);
            }
            let spent: Vec<Option<Spent>> = (0..count)
                .map(|_| self.ledger.spend(peer, PAGE, spend_limit))
                .collect();
            if fails {
                for s in spent.into_iter().flatten() {
                    self.ledger.refund(peer, s, PAGE);
                }
                return;
            }
            // One placement per run of pages with the same reservation.
            self.version += 1;
            let mut extents: Vec<(Extent, Option<Spent>)> = Vec::new();
            for (i, s) in spent.iter().enumerate() {
                let index = first + i as u32;
                match extents.last_mut() {
                    Some((e, r)) if r.map(|r| r.id) == s.map(|s| s.id) => e.page_count += 1,
                    _ => extents.push((Extent::new(BufferId(buffer), index, 1), *s)),
                }
            }
            let updates = extents
                .iter()
                .map(|(extent, s)| self.place(*extent, peer, s.map(|s| s.id)))
                .collect();
            let out = self.commit(updates);
            let mut retry = Vec::new();
            for ((extent, s), ok) in extents.iter().zip(out) {
                if ok {
                    continue;
                }
                if let Some(s) = s
                    && self.ledger.forget(s.id)
                {
                    retry.push(Update::Release { id: s.id });
                }
                retry.push(self.place(*extent, peer, None));
            }
            if !retry.is_empty() {
                self.commit(retry);
            }
        }

        fn check(&self) -> Result<(), TestCaseError> {
            let group: BTreeMap<ReservationId, u64> = self
                .state
                .reservations()
                .filter(|r| r.node != NodeId(1))
                .map(|r| (r.id, r.bytes))
                .collect();
            let ours = self.ledger.remaining();
            // The group may still hold what the ledger let lapse until the next commit
            // expires or releases it; every reservation the ledger holds, the group holds
            // with the same bytes.
            for (id, bytes) in &ours {
                prop_assert_eq!(group.get(id), Some(bytes), "reservation {:?}", id);
            }
            for (id, bytes) in &group {
                prop_assert!(
                    ours.get(id) == Some(bytes),
                    "the group holds {:?} with {} bytes the node does not: {:?}",
                    id,
                    bytes,
                    ours
                );
            }
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn the_groups_reserved_bytes_are_what_the_node_can_still_spend(
            ops in proptest::collection::vec(op(), 1..60)
        ) {
            let members = (1..=3)
                .map(|i| MemberInfo {
                    id: NodeId(i),
                    addresses: vec![format!("127.0.0.1:{}", 7000 + i)],
                    capacity_bytes: 48 * PAGE,
                    zone: None,
                })
                .collect();
            let mut w = World {
                state: MetaState::initial(&InitialCluster { members, page_bytes: PAGE }),
                ledger: Ledger::default(),
                now_ms: 1,
                next_id: 1,
                version: 0,
            };
            let mut placed: BTreeSet<u64> = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Spill { buffer, first, count, peer, fails } => {
                        w.spill(buffer, first, count, NodeId(peer as u64 + 2), fails);
                        placed.insert(buffer);
                    }
                    Op::Discard { buffer } => {
                        w.commit(vec![Update::Remove {
                            extent: Extent::new(BufferId(buffer), 0, 16),
                        }]);
                    }
                    Op::Restart { peer } => {
                        let node = NodeId(peer as u64 + 2);
                        let known: Vec<ReservationId> =
                            w.ledger.remaining().into_keys().collect();
                        w.commit(vec![
                            Update::SetMemberState { node, state: MemberState::Down },
                            Update::SetMemberState { node, state: MemberState::Up },
                        ]);
                        // Two reconciles: a reservation goes when missing at both.
                        let state = &w.state;
                        w.ledger.drop_gone(&known, |id| state.reservation(id).is_some());
                        w.ledger.drop_gone(&known, |id| state.reservation(id).is_some());
                    }
                    Op::Advance { ms } => {
                        w.now_ms += ms;
                        // A commit of anything advances the group clock (as the node's
                        // periodic capacity sync does).
                        let lapsing = w.ledger.take_lapsing(w.now_ms + MARGIN_MS);
                        w.commit(lapsing.into_iter().map(|id| Update::Release { id }).collect());
                    }
                }
                w.check()?;
            }
            // However long it ran, nothing stays reserved that the node cannot spend.
            let reserved: u64 = [2, 3]
                .iter()
                .map(|&n| w.state.usage(NodeId(n)).unwrap().reserved_bytes)
                .sum();
            let ours: u64 = w.ledger.remaining().values().sum();
            prop_assert_eq!(reserved, ours);
        }
    }
}
