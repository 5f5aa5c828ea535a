//! What a proposal carries, and how it is encoded.
//!
//! A normal Raft entry carries one [`Batch`]: many [`Update`]s applied in order, each
//! accepted or rejected on its own (a rejected update changes nothing). A configuration
//! entry carries a [`MembershipChange`] in its context. Both are encoded with `bincode` 2
//! (serde, standard config) and decoded with a size limit
//! ([`crate::limits::COMMAND_DECODE_BYTES_MAX`]): a bad entry is refused, never a cause of
//! an allocation failure. Entries and messages themselves are protobuf (raft-rs's own).

use serde::{Deserialize, Serialize};
use spillway_types::{BufferId, PageId, limits::PAGES_PER_BUFFER_MAX};

use crate::ids::{Epoch, NodeId, ReservationId};
use crate::limits;

/// A run of pages of one buffer: `page_count` pages from `first_page`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Extent {
    /// The buffer the pages belong to.
    pub buffer: BufferId,
    /// Index of the first page.
    pub first_page: u32,
    /// Number of pages, at least 1.
    pub page_count: u32,
}

impl Extent {
    /// `page_count` pages of `buffer` from `first_page`.
    pub fn new(buffer: BufferId, first_page: u32, page_count: u32) -> Self {
        Extent {
            buffer,
            first_page,
            page_count,
        }
    }

    /// Index one past the last page.
    pub fn end_page(&self) -> u64 {
        u64::from(self.first_page) + u64::from(self.page_count)
    }

    /// Whether `page` lies in this extent.
    pub fn contains(&self, page: PageId) -> bool {
        page.buffer == self.buffer
            && page.index >= self.first_page
            && u64::from(page.index) < self.end_page()
    }

    /// The first page, as a [`PageId`].
    pub fn first(&self) -> PageId {
        PageId {
            buffer: self.buffer,
            index: self.first_page,
        }
    }

    /// Why the extent cannot be stored, if it cannot.
    pub(crate) fn invalid_reason(&self) -> Option<&'static str> {
        if self.page_count == 0 {
            Some("an extent has at least one page")
        } else if self.end_page() > PAGES_PER_BUFFER_MAX {
            Some("the extent runs past the largest page index of a buffer")
        } else {
            None
        }
    }
}

/// The life state of a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemberState {
    /// Serving: may hold pages and take reservations.
    Up,
    /// Declared down: its reservations are gone; when it comes back its epoch grows and its
    /// earlier records are dropped.
    Down,
    /// Draining before removal: keeps its pages but takes no new ones.
    Leaving,
}

/// What a node tells the pool about itself when it joins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    /// Its id (also its Raft id; not 0).
    pub id: NodeId,
    /// Where peers and clients reach it (at most
    /// [`limits::ADDRESSES_PER_MEMBER_MAX`], each at most [`limits::ADDRESS_BYTES_MAX`] bytes).
    pub addresses: Vec<String>,
    /// Bytes of host memory it lends to the pool.
    pub capacity_bytes: u64,
    /// Its failure domain (a rack, a power zone), at most [`limits::ZONE_BYTES_MAX`]
    /// bytes: replicas of a page go to distinct zones when every candidate has one.
    pub zone: Option<String>,
}

impl MemberInfo {
    /// Why this member cannot join, if it cannot.
    pub(crate) fn invalid_reason(&self) -> Option<&'static str> {
        if self.id.0 == 0 {
            Some("node id 0 is reserved")
        } else if self.addresses.len() > limits::ADDRESSES_PER_MEMBER_MAX {
            Some("too many addresses")
        } else if self
            .addresses
            .iter()
            .any(|a| a.len() > limits::ADDRESS_BYTES_MAX)
        {
            Some("an address is too long")
        } else if self
            .zone
            .as_ref()
            .is_some_and(|z| z.len() > limits::ZONE_BYTES_MAX)
        {
            Some("the zone label is too long")
        } else {
            None
        }
    }
}

/// One change to the replicated state, inside a [`Batch`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Update {
    /// The pages of `extent` now have their copy number `replica` at `holder` (replacing
    /// any earlier record of those pages in that replica slot; the other slots keep
    /// theirs). Refused unless `replica` is below [`limits::REPLICAS_MAX`], `holder` is up
    /// and at `epoch`, no covered page has a current record (any slot) with a newer
    /// `version`, `holder` holds none of the pages live in another slot (the copies of a
    /// page are on distinct nodes), and the holder has room: either in `reservation`,
    /// which pays for every page of the extent (pages already at the holder in this slot
    /// included: what they did not need returns to free capacity), or in its free
    /// capacity, which pays only for pages not already there.
    Place {
        /// The pages.
        extent: Extent,
        /// The node that holds them.
        holder: NodeId,
        /// The holder's epoch as the proposer knows it (fencing).
        epoch: Epoch,
        /// Version of the pages' data; never goes backwards for a page.
        version: u64,
        /// A reservation on `holder` that pays for the bytes, if any.
        reservation: Option<ReservationId>,
        /// The replica slot, below [`limits::REPLICAS_MAX`].
        replica: u8,
    },
    /// The pages of `extent` left the pool's remote tiers (came home or were freed): their
    /// records are removed from every replica slot.
    Remove {
        /// The pages.
        extent: Extent,
    },
    /// Reserve `bytes` on `node` until `expires_at_ms` (group clock), before bytes move.
    Reserve {
        /// Id chosen by the proposer.
        id: ReservationId,
        /// The node whose capacity is reserved.
        node: NodeId,
        /// How many bytes.
        bytes: u64,
        /// When the reservation lapses, in group-clock milliseconds.
        expires_at_ms: u64,
    },
    /// Give back what is left of a reservation.
    Release {
        /// The reservation.
        id: ReservationId,
    },
    /// Declare a member up, down or leaving. Down → Up starts a new epoch.
    SetMemberState {
        /// The member.
        node: NodeId,
        /// Its new state.
        state: MemberState,
    },
    /// Change what a member lends; never below what it holds and has reserved.
    SetCapacity {
        /// The member.
        node: NodeId,
        /// New capacity in bytes.
        capacity_bytes: u64,
    },
}

/// One proposal: many updates, applied in order, each accepted or rejected on its own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// The proposer's clock in milliseconds. The group clock is the largest of these seen,
    /// so it never goes backwards; reservations expire against it.
    pub now_ms: u64,
    /// The updates, at most [`limits::BATCH_UPDATES_MAX`].
    pub updates: Vec<Update>,
}

impl Batch {
    /// An empty batch stamped with the proposer's clock.
    pub fn new(now_ms: u64) -> Self {
        Batch {
            now_ms,
            updates: Vec::new(),
        }
    }

    /// Adds one update.
    pub fn push(&mut self, update: Update) -> &mut Self {
        self.updates.push(update);
        self
    }

    /// Number of updates.
    pub fn len(&self) -> usize {
        self.updates.len()
    }

    /// Whether there are no updates.
    pub fn is_empty(&self) -> bool {
        self.updates.is_empty()
    }
}

/// A change of the Raft configuration, carried by a Raft conf change (`ConfChangeV2`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MembershipChange {
    /// A new node joins as a learner: it receives the log (or a snapshot) but does not vote.
    AddLearner {
        /// Who it is.
        member: MemberInfo,
    },
    /// A learner that has caught up becomes a voter.
    Promote {
        /// The learner.
        node: NodeId,
    },
    /// A member leaves the group; its records and reservations are dropped.
    /// The leader cannot remove itself: transfer leadership first.
    Remove {
        /// The member.
        node: NodeId,
    },
    /// A learner takes a voter's place in one joint-consensus step.
    Replace {
        /// The voter that leaves.
        old: NodeId,
        /// The learner that becomes a voter.
        new: NodeId,
    },
}

/// The members a new pool starts with; every first node is opened with the same value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitialCluster {
    /// The first voters.
    pub members: Vec<MemberInfo>,
    /// The pool's page size in bytes; capacity is counted in whole pages.
    pub page_bytes: u64,
}

#[cfg(test)]
impl InitialCluster {
    /// Members `1..=n` with no address and no zone, each lending `capacity_bytes` (tests).
    pub(crate) fn for_tests(n: u64, capacity_bytes: u64, page_bytes: u64) -> Self {
        InitialCluster {
            members: (1..=n)
                .map(|i| MemberInfo {
                    id: NodeId(i),
                    addresses: vec![],
                    capacity_bytes,
                    zone: None,
                })
                .collect(),
            page_bytes,
        }
    }
}

/// A command that could not be decoded.
#[derive(Debug, thiserror::Error)]
#[error("cannot decode {what}: {source}")]
pub struct DecodeError {
    /// What was being decoded.
    pub what: &'static str,
    /// Why it failed.
    #[source]
    pub source: bincode::error::DecodeError,
}

impl Batch {
    /// The batch as a proposal carries it (bincode 2, as in the log), for forwarding a
    /// proposal from a follower to the leader.
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }

    /// A batch from [`Batch::encode`]d bytes, decoded under
    /// [`limits::COMMAND_DECODE_BYTES_MAX`] (a hostile length is an error, not an
    /// allocation); trailing bytes are refused. The update count is not checked here:
    /// [`crate::MetaNode::propose`] refuses more than [`limits::BATCH_UPDATES_MAX`].
    pub fn decode(bytes: &[u8]) -> Result<Batch, DecodeError> {
        decode_command("batch", bytes)
    }
}

pub(crate) fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Encoding plain serde data into a Vec cannot fail: no custom serializer, no IO.
    bincode::serde::encode_to_vec(value, bincode::config::standard())
        .expect("bincode encoding of in-memory data")
}

pub(crate) fn decode_command<T: serde::de::DeserializeOwned>(
    what: &'static str,
    bytes: &[u8],
) -> Result<T, DecodeError> {
    let config = bincode::config::standard().with_limit::<{ limits::COMMAND_DECODE_BYTES_MAX }>();
    decode_with(what, bytes, config)
}

pub(crate) fn decode_snapshot<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
) -> Result<T, DecodeError> {
    let config = bincode::config::standard().with_limit::<{ limits::SNAPSHOT_DECODE_BYTES_MAX }>();
    decode_with("snapshot", bytes, config)
}

fn decode_with<T: serde::de::DeserializeOwned, C: bincode::config::Config>(
    what: &'static str,
    bytes: &[u8],
    config: C,
) -> Result<T, DecodeError> {
    let (value, read) = bincode::serde::decode_from_slice(bytes, config)
        .map_err(|source| DecodeError { what, source })?;
    if read != bytes.len() {
        return Err(DecodeError {
            what,
            source: bincode::error::DecodeError::OtherString(format!(
                "{} trailing bytes",
                bytes.len() - read
            )),
        });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_public_batch_codec_round_trips_and_refuses_garbage() {
        let mut b = Batch::new(7);
        b.push(Update::Release {
            id: ReservationId(3),
        });
        assert_eq!(Batch::decode(&b.encode()).unwrap(), b);
        let mut trailing = b.encode();
        trailing.push(0);
        assert!(Batch::decode(&trailing).is_err());
        assert!(Batch::decode(&[0xff; 12]).is_err());
    }

    #[test]
    fn batch_round_trips() {
        let mut b = Batch::new(42);
        b.push(Update::Place {
            extent: Extent::new(BufferId(7), 3, 4),
            holder: NodeId(2),
            epoch: Epoch(1),
            version: 9,
            reservation: Some(ReservationId(5)),
            replica: 1,
        })
        .push(Update::Remove {
            extent: Extent::new(BufferId(7), 0, 1),
        });
        let bytes = encode(&b);
        let back: Batch = decode_command("batch", &bytes).unwrap();
        assert_eq!(back, b);
    }

    #[test]
    fn hostile_length_is_an_error_not_an_abort() {
        // A Batch whose update vector claims 2^62 elements.
        let mut bytes = encode(&Batch::new(1));
        bytes.pop();
        bytes.push(0xFF);
        bytes.extend_from_slice(&(1u64 << 62).to_le_bytes());
        assert!(decode_command::<Batch>("batch", &bytes).is_err());
        // Trailing garbage is refused too.
        let mut ok = encode(&Batch::new(1));
        ok.push(0);
        assert!(decode_command::<Batch>("batch", &ok).is_err());
    }

    #[test]
    fn extent_bounds() {
        assert!(Extent::new(BufferId(1), 0, 0).invalid_reason().is_some());
        assert!(
            Extent::new(BufferId(1), (PAGES_PER_BUFFER_MAX - 1) as u32, 2)
                .invalid_reason()
                .is_some()
        );
        let e = Extent::new(BufferId(1), 4, 2);
        assert!(e.invalid_reason().is_none());
        assert!(e.contains(PageId {
            buffer: BufferId(1),
            index: 5
        }));
        assert!(!e.contains(PageId {
            buffer: BufferId(1),
            index: 6
        }));
    }
}
