//! The replicated state machine: members, the directory, reservations.
//!
//! Every node applies the same committed entries in the same order to a [`MetaState`],
//! so every change here is deterministic: ordered maps only, no clock (the group clock is
//! the largest `now_ms` carried by a batch), no randomness.
//!
//! Invariants (checked by [`MetaState::check_invariants`], which tests run after every
//! step):
//! - the records of one replica slot never overlap, every slot is below
//!   [`limits::REPLICAS_MAX`], and every record's holder is a member at that record's
//!   epoch or a later one;
//! - the live copies of a page are on distinct nodes (no node holds a page live in two
//!   slots);
//! - for every member, `used_bytes + reserved_bytes <= capacity_bytes`: a placement is
//!   paid for by a reservation or by free capacity, so no node is over-committed;
//! - `used_bytes` is the pages of the member's records at its current epoch times the page
//!   size (records of earlier epochs are dead and cost nothing), and `reserved_bytes` the
//!   sum of its live reservations.
//!
//! Fencing: a record carries the holder's epoch; a placement naming another epoch than the
//! member's current one is refused, and when a member that was declared down comes back
//! its epoch grows, so the records of its earlier epochs are dead (the pages they named
//! were in the memory of a process that is gone, or that the pool stopped trusting). Dead
//! records stay in the directory, freed from the member's accounting, until a repair
//! places into their slot or the pages leave the pool: they are how the under-replicated
//! and lost pages are found (see `replicas`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use spillway_types::PageId;

use crate::command::{
    self, Batch, DecodeError, Extent, InitialCluster, MemberInfo, MemberState, MembershipChange,
    Update,
};
use crate::directory::{Cut, Directory, Holder};
use crate::ids::{Epoch, NodeId, ReservationId};
use crate::limits;

/// A member's part in the Raft group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RaftRole {
    /// Votes and counts for the quorum.
    Voter,
    /// Receives the log, does not vote.
    Learner,
}

/// A member of the pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Its id.
    pub id: NodeId,
    /// Where peers and clients reach it.
    pub addresses: Vec<String>,
    /// Bytes of host memory it lends to the pool.
    pub capacity_bytes: u64,
    /// Up, down or leaving.
    pub state: MemberState,
    /// Its incarnation (see the module doc on fencing).
    pub epoch: Epoch,
    /// Voter or learner.
    pub role: RaftRole,
    /// Its failure domain, if it has one (see [`MemberInfo::zone`]).
    pub zone: Option<String>,
    /// Group-clock milliseconds when it last became up (joined, or came back from down):
    /// placements ramp up towards a member that came back recently.
    pub up_since_ms: u64,
}

/// What a member's capacity is used for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes of pages the directory puts at the member.
    pub used_bytes: u64,
    /// Bytes of live reservations on the member.
    pub reserved_bytes: u64,
}

/// Capacity set aside on a node before bytes move there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// Its id.
    pub id: ReservationId,
    /// The node.
    pub node: NodeId,
    /// Bytes still reserved (placements paid by it take from this).
    pub bytes: u64,
    /// When it lapses, in group-clock milliseconds.
    pub expires_at_ms: u64,
}

/// Why one update of a batch was refused (the update changed nothing).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The extent is empty or runs past the largest page index.
    #[error("extent {extent:?} is invalid: {reason}")]
    InvalidExtent {
        /// The extent.
        extent: Extent,
        /// Why.
        reason: &'static str,
    },
    /// No such member.
    #[error("{node} is not a member")]
    UnknownNode {
        /// The node named.
        node: NodeId,
    },
    /// The member cannot take pages or reservations now.
    #[error("{node} is {state:?}, not up")]
    NodeNotUp {
        /// The member.
        node: NodeId,
        /// Its state.
        state: MemberState,
    },
    /// The record names an epoch the member is no longer (or not yet) at.
    #[error("the record for {node} carries {record_epoch} but the member is at {current_epoch}")]
    StaleEpoch {
        /// The member.
        node: NodeId,
        /// The epoch in the update.
        record_epoch: Epoch,
        /// The member's epoch.
        current_epoch: Epoch,
    },
    /// A covered page already has newer data recorded.
    #[error("{page} is at version {current_version}, newer than the proposed {proposed_version}")]
    StaleVersion {
        /// The first such page.
        page: PageId,
        /// Its recorded version.
        current_version: u64,
        /// The version in the update.
        proposed_version: u64,
    },
    /// The node has not enough free capacity.
    #[error("{node} has {free_bytes} bytes free, {requested_bytes} requested")]
    InsufficientCapacity {
        /// The node.
        node: NodeId,
        /// Bytes asked for.
        requested_bytes: u64,
        /// Bytes free (capacity minus used minus reserved).
        free_bytes: u64,
    },
    /// No live reservation with this id.
    #[error("reservation {id:?} is unknown or expired")]
    UnknownReservation {
        /// The reservation.
        id: ReservationId,
    },
    /// The reservation is on another node than the placement.
    #[error("reservation {id:?} is on {reserved_node}, not on {node}")]
    ReservationNodeMismatch {
        /// The reservation.
        id: ReservationId,
        /// Where it reserves.
        reserved_node: NodeId,
        /// Where the placement goes.
        node: NodeId,
    },
    /// The reservation has fewer bytes left than the placement needs.
    #[error("reservation {id:?} has {remaining_bytes} bytes left, {needed_bytes} needed")]
    ReservationTooSmall {
        /// The reservation.
        id: ReservationId,
        /// Bytes left in it.
        remaining_bytes: u64,
        /// Bytes the placement needs.
        needed_bytes: u64,
    },
    /// A reservation with this id is live.
    #[error("reservation {id:?} already exists")]
    DuplicateReservation {
        /// The reservation.
        id: ReservationId,
    },
    /// The replica slot is not below [`limits::REPLICAS_MAX`].
    #[error("replica slot {replica} is not below {max}")]
    InvalidReplica {
        /// The slot asked for.
        replica: u8,
        /// The number of slots.
        max: usize,
    },
    /// The holder already holds a covered page live in another replica slot: the copies of
    /// a page are on distinct nodes.
    #[error("{node} already holds {page} in replica slot {replica}")]
    DuplicateHolder {
        /// The holder.
        node: NodeId,
        /// The first such page.
        page: PageId,
        /// The slot it already holds the page in.
        replica: u8,
    },
    /// The expiry is not after the group clock.
    #[error("expiry {expires_at_ms} ms is not after the group clock ({clock_ms} ms)")]
    AlreadyExpired {
        /// The expiry asked for.
        expires_at_ms: u64,
        /// The group clock.
        clock_ms: u64,
    },
    /// A reservation of zero bytes.
    #[error("a reservation needs at least one byte")]
    ZeroBytes,
    /// A table reached its bound.
    #[error("the {table} table is full ({max} entries)")]
    TableFull {
        /// Which table.
        table: &'static str,
        /// Its bound.
        max: usize,
    },
    /// The new capacity is below what the member holds and has reserved.
    #[error("{node} uses {in_use_bytes} bytes; capacity {capacity_bytes} is below that")]
    CapacityBelowUse {
        /// The member.
        node: NodeId,
        /// The capacity asked for.
        capacity_bytes: u64,
        /// Used plus reserved bytes.
        in_use_bytes: u64,
    },
}

/// A snapshot that decodes but breaks an invariant.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// It did not decode.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// It was written in another format (by another version of Spillway).
    #[error("snapshot format {found} is not the supported format {expected}")]
    Format {
        /// The format it carries.
        found: u32,
        /// The format this version reads and writes.
        expected: u32,
    },
    /// It decoded to a state that breaks an invariant.
    #[error("snapshot is inconsistent: {reason}")]
    Inconsistent {
        /// Which invariant.
        reason: String,
    },
}

/// The snapshot's format: 3. 1 had a table of client leases (cut since); 2 had one holder
/// per page (no replica slots) and members without zones. The log's entries changed with
/// 3 as well (`Update::Place` carries its slot, `MemberInfo` its zone), and every log
/// starts from a snapshot, so an older directory is refused at open
/// ([`SnapshotError::Format`]).
pub(crate) const SNAPSHOT_FORMAT: u32 = 3;

/// What a snapshot stores: only the facts, never derived accounting (rebuilt and checked
/// on load).
#[derive(Serialize, Deserialize)]
struct SnapshotData {
    format: u32,
    page_bytes: u64,
    clock_ms: u64,
    members: Vec<Member>,
    extents: Vec<(u8, Extent, Holder)>,
    reservations: Vec<Reservation>,
}

/// The replicated state, as applied up to [`MetaState::applied_index`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaState {
    page_bytes: u64,
    clock_ms: u64,
    applied_index: u64,
    members: BTreeMap<NodeId, Member>,
    usage: BTreeMap<NodeId, Usage>,
    directory: Directory,
    reservations: BTreeMap<ReservationId, Reservation>,
}

impl MetaState {
    /// The state a new pool starts with: every initial member up, a voter, at epoch 1.
    pub fn initial(cluster: &InitialCluster) -> Self {
        let mut s = MetaState {
            page_bytes: cluster.page_bytes,
            ..Default::default()
        };
        for m in &cluster.members {
            s.insert_member(m, RaftRole::Voter);
        }
        s
    }

    // ---- reads ----

    /// The pool's page size in bytes.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// The group clock: the largest `now_ms` of any applied batch.
    pub fn clock_ms(&self) -> u64 {
        self.clock_ms
    }

    /// Index of the last Raft entry applied to this state.
    pub fn applied_index(&self) -> u64 {
        self.applied_index
    }

    /// All members, by id.
    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    /// One member.
    pub fn member(&self, node: NodeId) -> Option<&Member> {
        self.members.get(&node)
    }

    /// What a member's capacity is used for.
    pub fn usage(&self, node: NodeId) -> Option<Usage> {
        self.usage.get(&node).copied()
    }

    /// Bytes a member can still take (capacity minus used minus reserved).
    pub fn free_bytes(&self, node: NodeId) -> Option<u64> {
        let m = self.members.get(&node)?;
        let u = self.usage.get(&node).copied().unwrap_or_default();
        Some(
            m.capacity_bytes
                .saturating_sub(u.used_bytes)
                .saturating_sub(u.reserved_bytes),
        )
    }

    /// Every directory record, dead ones included: slot by slot, each slot in page order.
    pub fn extents(&self) -> impl Iterator<Item = (u8, Extent, Holder)> + '_ {
        self.directory.iter()
    }

    /// Number of directory records, over all slots, dead ones included.
    pub fn extent_count(&self) -> usize {
        self.directory.len()
    }

    /// One live reservation.
    pub fn reservation(&self, id: ReservationId) -> Option<&Reservation> {
        self.reservations.get(&id)
    }

    /// All live reservations.
    pub fn reservations(&self) -> impl Iterator<Item = &Reservation> {
        self.reservations.values()
    }

    // ---- apply ----

    pub(crate) fn set_applied_index(&mut self, index: u64) {
        debug_assert!(index >= self.applied_index);
        self.applied_index = index;
    }

    /// Applies one batch: the clock first (expiring what lapsed), then each update.
    /// Deterministic: the group applies committed batches through this; proposers' tests
    /// and simulations may apply batches to a state of their own.
    pub fn apply_batch(&mut self, batch: &Batch) -> Vec<Result<(), Rejection>> {
        self.advance_clock(batch.now_ms);
        batch.updates.iter().map(|u| self.apply_update(u)).collect()
    }

    fn advance_clock(&mut self, now_ms: u64) {
        if now_ms <= self.clock_ms {
            return;
        }
        self.clock_ms = now_ms;
        let usage = &mut self.usage;
        self.reservations.retain(|_, r| {
            let live = r.expires_at_ms > now_ms;
            if !live && let Some(u) = usage.get_mut(&r.node) {
                u.reserved_bytes -= r.bytes;
            }
            live
        });
    }

    fn apply_update(&mut self, update: &Update) -> Result<(), Rejection> {
        match *update {
            Update::Place {
                extent,
                holder,
                epoch,
                version,
                reservation,
                replica,
            } => self.place(extent, holder, epoch, version, reservation, replica),
            Update::Remove { extent } => {
                check_extent(extent)?;
                let mut cuts = Vec::new();
                self.directory.remove(extent, &mut cuts);
                self.uncount(&cuts);
                Ok(())
            }
            Update::Reserve {
                id,
                node,
                bytes,
                expires_at_ms,
            } => self.reserve(id, node, bytes, expires_at_ms),
            Update::Release { id } => {
                let r = self
                    .reservations
                    .remove(&id)
                    .ok_or(Rejection::UnknownReservation { id })?;
                self.usage_mut(r.node).reserved_bytes -= r.bytes;
                Ok(())
            }
            Update::SetMemberState { node, state } => self.set_member_state(node, state),
            Update::SetCapacity {
                node,
                capacity_bytes,
            } => {
                let u = self.usage.get(&node).copied().unwrap_or_default();
                let m = self
                    .members
                    .get_mut(&node)
                    .ok_or(Rejection::UnknownNode { node })?;
                let in_use_bytes = u.used_bytes + u.reserved_bytes;
                if capacity_bytes < in_use_bytes {
                    return Err(Rejection::CapacityBelowUse {
                        node,
                        capacity_bytes,
                        in_use_bytes,
                    });
                }
                m.capacity_bytes = capacity_bytes;
                Ok(())
            }
        }
    }

    fn place(
        &mut self,
        extent: Extent,
        node: NodeId,
        epoch: Epoch,
        version: u64,
        reservation: Option<ReservationId>,
        replica: u8,
    ) -> Result<(), Rejection> {
        check_extent(extent)?;
        if usize::from(replica) >= limits::REPLICAS_MAX {
            return Err(Rejection::InvalidReplica {
                replica,
                max: limits::REPLICAS_MAX,
            });
        }
        let member = self
            .members
            .get(&node)
            .ok_or(Rejection::UnknownNode { node })?;
        if member.epoch != epoch {
            return Err(Rejection::StaleEpoch {
                node,
                record_epoch: epoch,
                current_epoch: member.epoch,
            });
        }
        if member.state != MemberState::Up {
            return Err(Rejection::NodeNotUp {
                node,
                state: member.state,
            });
        }
        let mut pages_already_there = 0u64;
        for (slot, old, holder) in self.directory.overlapping_all(extent) {
            let first = PageId {
                buffer: extent.buffer,
                index: old.first_page.max(extent.first_page),
            };
            // Dead records of earlier epochs hold nothing anyone reads: only current
            // ones (live, or of a member that is down at the same epoch) carry versions.
            if holder.version > version && self.is_current(&holder) {
                return Err(Rejection::StaleVersion {
                    page: first,
                    current_version: holder.version,
                    proposed_version: version,
                });
            }
            // The member is up at `epoch`: such a record is live and counted.
            if holder.node == node && holder.epoch == epoch {
                if slot != replica {
                    return Err(Rejection::DuplicateHolder {
                        node,
                        page: first,
                        replica: slot,
                    });
                }
                let lo = u64::from(first.index);
                let hi = old.end_page().min(extent.end_page());
                pages_already_there += hi - lo;
            }
        }
        let extent_bytes = u64::from(extent.page_count) * self.page_bytes;
        let needed_bytes = extent_bytes - pages_already_there * self.page_bytes;
        match reservation {
            // A reservation pays for every page of the extent, pages already at the holder
            // included: the proposer spent them from its share and cannot know which pages
            // the directory already places there, so charging less would leave bytes
            // reserved that the proposer counts as spent (they would leak until expiry).
            // What the pages already there did not need returns to free capacity.
            Some(id) => {
                let r = self
                    .reservations
                    .get(&id)
                    .ok_or(Rejection::UnknownReservation { id })?;
                if r.node != node {
                    return Err(Rejection::ReservationNodeMismatch {
                        id,
                        reserved_node: r.node,
                        node,
                    });
                }
                if r.bytes < extent_bytes {
                    return Err(Rejection::ReservationTooSmall {
                        id,
                        remaining_bytes: r.bytes,
                        needed_bytes: extent_bytes,
                    });
                }
            }
            None => {
                let free_bytes = self.free_bytes(node).unwrap_or(0);
                if needed_bytes > free_bytes {
                    return Err(Rejection::InsufficientCapacity {
                        node,
                        requested_bytes: needed_bytes,
                        free_bytes,
                    });
                }
            }
        }
        // A placement may split one record in two and add one: at most two more records.
        if self.directory.len() + 2 > limits::DIRECTORY_EXTENTS_MAX {
            return Err(Rejection::TableFull {
                table: "directory",
                max: limits::DIRECTORY_EXTENTS_MAX,
            });
        }
        // Accepted: from here on nothing fails.
        if let Some(id) = reservation {
            let r = self.reservations.get_mut(&id).expect("checked above");
            r.bytes -= extent_bytes;
            if r.bytes == 0 {
                self.reservations.remove(&id);
            }
            self.usage_mut(node).reserved_bytes -= extent_bytes;
        }
        let mut cuts = Vec::new();
        self.directory.insert(
            replica,
            extent,
            Holder {
                node,
                epoch,
                version,
            },
            &mut cuts,
        );
        self.uncount(&cuts);
        self.usage_mut(node).used_bytes += u64::from(extent.page_count) * self.page_bytes;
        Ok(())
    }

    fn reserve(
        &mut self,
        id: ReservationId,
        node: NodeId,
        bytes: u64,
        expires_at_ms: u64,
    ) -> Result<(), Rejection> {
        self.up_member(node)?;
        if bytes == 0 {
            return Err(Rejection::ZeroBytes);
        }
        self.check_expiry(expires_at_ms)?;
        if self.reservations.contains_key(&id) {
            return Err(Rejection::DuplicateReservation { id });
        }
        if self.reservations.len() >= limits::RESERVATIONS_MAX {
            return Err(Rejection::TableFull {
                table: "reservation",
                max: limits::RESERVATIONS_MAX,
            });
        }
        let free_bytes = self.free_bytes(node).unwrap_or(0);
        if bytes > free_bytes {
            return Err(Rejection::InsufficientCapacity {
                node,
                requested_bytes: bytes,
                free_bytes,
            });
        }
        self.reservations.insert(
            id,
            Reservation {
                id,
                node,
                bytes,
                expires_at_ms,
            },
        );
        self.usage_mut(node).reserved_bytes += bytes;
        Ok(())
    }

    fn set_member_state(&mut self, node: NodeId, state: MemberState) -> Result<(), Rejection> {
        let m = self
            .members
            .get_mut(&node)
            .ok_or(Rejection::UnknownNode { node })?;
        let before = m.state;
        m.state = state;
        match (before, state) {
            (MemberState::Down, MemberState::Up) => {
                // A new incarnation: what the old one held is not trusted any more. Its
                // records stay, dead, so that their slots are found and repaired; they no
                // longer count against the member's capacity.
                // Only the records of the epoch that ends were counted: those of earlier
                // ones were uncounted when their epoch ended.
                let ended = m.epoch;
                m.epoch = Epoch(m.epoch.0 + 1);
                m.up_since_ms = self.clock_ms;
                let pages = self.directory.pages_where(node, |h| h.epoch == ended);
                self.usage_mut(node).used_bytes -= pages * self.page_bytes;
            }
            (_, MemberState::Down) => self.drop_reservations_of(node),
            _ => {}
        }
        Ok(())
    }

    /// Applies a membership change whose Raft conf change was accepted; `voters` and
    /// `learners` are the configuration after it.
    pub(crate) fn apply_membership(
        &mut self,
        change: &MembershipChange,
        voters: &[u64],
        learners: &[u64],
    ) {
        match change {
            MembershipChange::AddLearner { member } => {
                if let Some(m) = self.members.get_mut(&member.id) {
                    m.addresses.clone_from(&member.addresses);
                    m.zone.clone_from(&member.zone);
                    m.capacity_bytes = m.capacity_bytes.max(member.capacity_bytes);
                } else {
                    self.insert_member(member, RaftRole::Learner);
                }
            }
            MembershipChange::Promote { .. } => {}
            MembershipChange::Remove { node } => self.remove_member(*node),
            MembershipChange::Replace { old, .. } => self.remove_member(*old),
        }
        for m in self.members.values_mut() {
            if voters.contains(&m.id.0) {
                m.role = RaftRole::Voter;
            } else if learners.contains(&m.id.0) {
                m.role = RaftRole::Learner;
            }
        }
    }

    fn insert_member(&mut self, info: &MemberInfo, role: RaftRole) {
        if self.members.len() >= limits::MEMBERS_MAX {
            tracing::warn!(node = %info.id, "member table full; member not recorded");
            return;
        }
        self.members.insert(
            info.id,
            Member {
                id: info.id,
                addresses: info.addresses.clone(),
                capacity_bytes: info.capacity_bytes,
                state: MemberState::Up,
                epoch: Epoch(1),
                role,
                zone: info.zone.clone(),
                up_since_ms: self.clock_ms,
            },
        );
        self.usage.insert(info.id, Usage::default());
    }

    fn remove_member(&mut self, node: NodeId) {
        if self.members.remove(&node).is_none() {
            return;
        }
        self.directory.drop_node(node);
        self.reservations.retain(|_, r| r.node != node);
        self.usage.remove(&node);
    }

    fn drop_reservations_of(&mut self, node: NodeId) {
        let mut freed = 0;
        self.reservations.retain(|_, r| {
            let keep = r.node != node;
            if !keep {
                freed += r.bytes;
            }
            keep
        });
        self.usage_mut(node).reserved_bytes -= freed;
    }

    fn up_member(&self, node: NodeId) -> Result<&Member, Rejection> {
        let m = self
            .members
            .get(&node)
            .ok_or(Rejection::UnknownNode { node })?;
        if m.state != MemberState::Up {
            return Err(Rejection::NodeNotUp {
                node,
                state: m.state,
            });
        }
        Ok(m)
    }

    fn check_expiry(&self, expires_at_ms: u64) -> Result<(), Rejection> {
        if expires_at_ms <= self.clock_ms {
            return Err(Rejection::AlreadyExpired {
                expires_at_ms,
                clock_ms: self.clock_ms,
            });
        }
        Ok(())
    }

    fn usage_mut(&mut self, node: NodeId) -> &mut Usage {
        self.usage.entry(node).or_default()
    }

    /// Takes the pages `cuts` took out off their holders' accounting; dead records of an
    /// earlier epoch were not counted.
    fn uncount(&mut self, cuts: &[Cut]) {
        for c in cuts {
            if self.is_current(&c.holder) {
                let bytes = c.pages * self.page_bytes;
                self.usage_mut(c.holder.node).used_bytes -= bytes;
            }
        }
    }

    /// Whether `holder` is at its member's current epoch (counted in its accounting; live
    /// unless the member is down).
    fn is_current(&self, holder: &Holder) -> bool {
        self.members
            .get(&holder.node)
            .is_some_and(|m| m.epoch == holder.epoch)
    }

    // ---- snapshots ----

    /// Encodes the state for a snapshot.
    pub(crate) fn encode_snapshot(&self) -> Vec<u8> {
        command::encode(&SnapshotData {
            format: SNAPSHOT_FORMAT,
            page_bytes: self.page_bytes,
            clock_ms: self.clock_ms,
            members: self.members.values().cloned().collect(),
            extents: self.directory.iter().collect(),
            reservations: self.reservations.values().copied().collect(),
        })
    }

    /// Decodes a snapshot taken at `applied_index`, rebuilds the accounting and checks
    /// every invariant.
    pub(crate) fn decode_snapshot(bytes: &[u8], applied_index: u64) -> Result<Self, SnapshotError> {
        let data: SnapshotData = command::decode_snapshot(bytes)?;
        let inconsistent = |reason: String| SnapshotError::Inconsistent { reason };
        if data.format != SNAPSHOT_FORMAT {
            return Err(SnapshotError::Format {
                found: data.format,
                expected: SNAPSHOT_FORMAT,
            });
        }
        if data.members.len() > limits::MEMBERS_MAX
            || data.extents.len() > limits::DIRECTORY_EXTENTS_MAX
            || data.reservations.len() > limits::RESERVATIONS_MAX
        {
            return Err(inconsistent("a table is over its bound".into()));
        }
        let directory = Directory::from_records(data.extents).ok_or_else(|| {
            inconsistent("directory records overlap, are invalid or name no slot".into())
        })?;
        let mut s = MetaState {
            page_bytes: data.page_bytes,
            clock_ms: data.clock_ms,
            applied_index,
            members: data.members.into_iter().map(|m| (m.id, m)).collect(),
            usage: BTreeMap::new(),
            directory,
            reservations: data.reservations.into_iter().map(|r| (r.id, r)).collect(),
        };
        s.usage = s.recount().map_err(|e| inconsistent(e.reason))?;
        s.check_invariants().map_err(|e| inconsistent(e.reason))?;
        Ok(s)
    }

    /// Usage recomputed from the records and reservations.
    fn recount(&self) -> Result<BTreeMap<NodeId, Usage>, InvariantError> {
        let mut usage: BTreeMap<NodeId, Usage> = self
            .members
            .keys()
            .map(|&id| (id, Usage::default()))
            .collect();
        for (slot, e, h) in self.directory.iter() {
            let m = self.members.get(&h.node).ok_or_else(|| {
                broken(format!(
                    "{e:?} (slot {slot}) is held by {} which is not a member",
                    h.node
                ))
            })?;
            if h.epoch == m.epoch {
                usage.entry(h.node).or_default().used_bytes +=
                    u64::from(e.page_count) * self.page_bytes;
            }
        }
        for r in self.reservations.values() {
            let u = usage
                .get_mut(&r.node)
                .ok_or_else(|| broken(format!("reservation {:?} is on a non-member", r.id)))?;
            u.reserved_bytes += r.bytes;
        }
        Ok(usage)
    }

    /// Checks every invariant of the module doc. O(size of the state): for tests,
    /// simulations and snapshot loading, not for every apply.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        if !self.directory.is_disjoint() {
            return Err(broken("directory records of one slot overlap".into()));
        }
        let usage = self.recount()?;
        if usage != self.usage {
            return Err(broken(format!(
                "accounting drifted: counted {usage:?}, kept {:?}",
                self.usage
            )));
        }
        for (id, u) in &usage {
            let m = &self.members[id];
            if u.used_bytes + u.reserved_bytes > m.capacity_bytes {
                return Err(broken(format!(
                    "{id} is over-committed: used {} + reserved {} > capacity {}",
                    u.used_bytes, u.reserved_bytes, m.capacity_bytes
                )));
            }
        }
        for (slot, e, h) in self.directory.iter() {
            if h.epoch > self.members[&h.node].epoch {
                return Err(broken(format!(
                    "{e:?} carries a future epoch for {}",
                    h.node
                )));
            }
            if !self.is_live(&h) {
                continue;
            }
            if let Some((other, _, _)) = self
                .directory
                .overlapping_all(e)
                .find(|&(s, _, o)| s != slot && o.node == h.node && self.is_live(&o))
            {
                return Err(broken(format!(
                    "{e:?} is held live by {} in slots {slot} and {other}",
                    h.node
                )));
            }
        }
        Ok(())
    }
}

/// An invariant of the state machine that does not hold (a bug, or a corrupt snapshot).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invariant broken: {reason}")]
pub struct InvariantError {
    /// Which invariant, and the values that break it.
    pub reason: String,
}

fn broken(reason: String) -> InvariantError {
    InvariantError { reason }
}

fn check_extent(extent: Extent) -> Result<(), Rejection> {
    match extent.invalid_reason() {
        Some(reason) => Err(Rejection::InvalidExtent { extent, reason }),
        None => Ok(()),
    }
}

mod replicas;
pub use replicas::{ReplicationHealth, UnderReplicated};

#[cfg(test)]
mod tests;
