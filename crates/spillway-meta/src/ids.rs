//! Ids of the metadata group: all `u64` newtypes so they cannot be mixed up.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A node of the pool: one daemon, one Raft peer; its id is also its Raft id, so never 0.
pub use spillway_types::NodeId;

/// The incarnation of a member. It grows each time a member that was declared down comes
/// back, so records written for an earlier incarnation can be told apart and refused.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct Epoch(pub u64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "epoch{}", self.0)
    }
}

/// A capacity reservation, chosen by the proposer, unique among live reservations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ReservationId(pub u64);

/// A proposal of one node, handed back by `propose` and named again in its
/// [`crate::Completion`]. Unique per proposer for the life of the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket {
    /// The node that proposed.
    pub proposer: NodeId,
    /// Sequence number of the proposal at that node, from 1.
    pub seq: u64,
}

impl Ticket {
    pub(crate) const ENCODED_BYTES: usize = 16;

    pub(crate) fn encode(self) -> [u8; Self::ENCODED_BYTES] {
        let mut out = [0u8; Self::ENCODED_BYTES];
        out[..8].copy_from_slice(&self.proposer.0.to_le_bytes());
        out[8..].copy_from_slice(&self.seq.to_le_bytes());
        out
    }

    /// The ticket a committed entry's context carries (for tracing, or for a daemon that
    /// forwards proposals and matches them up later).
    pub fn decode(bytes: &[u8]) -> Option<Ticket> {
        if bytes.len() != Self::ENCODED_BYTES {
            return None;
        }
        let proposer = u64::from_le_bytes(bytes[..8].try_into().ok()?);
        let seq = u64::from_le_bytes(bytes[8..].try_into().ok()?);
        Some(Ticket {
            proposer: NodeId(proposer),
            seq,
        })
    }
}

impl fmt::Display for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ticket {}/{}", self.proposer.0, self.seq)
    }
}
