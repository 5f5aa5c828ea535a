//! The pool's replicated metadata: one Raft group over the nodes.
//!
//! Parts, from the bottom up:
//! - [`storage`]: raft-rs's [`raft::Storage`] over `raft-engine` (entries, hard state,
//!   snapshot and its configuration), so a node restarts from its directory;
//! - [`state`]: the replicated state machine ([`MetaState`]): members with their epochs
//!   and zones, the directory of pages that left their home node (one interval map per
//!   replica slot: extents → holder, epoch, version; the copies of a page on distinct
//!   nodes; dead copies kept until repaired, so under-replicated and lost pages can be
//!   listed) and capacity reservations; deterministic, with its invariants written down
//!   and checkable;
//! - [`command`]: what a proposal carries ([`Batch`] of [`Update`]s, or a
//!   [`MembershipChange`]), encoded with `bincode` 2 under a decode limit;
//! - [`node`]: [`MetaNode`], the driver: `tick`, `step`, `propose`, `handle_ready` (the
//!   Ready loop in raft-rs's order), `poll_messages`, `take_completions`. No sockets,
//!   no threads, no clock;
//! - [`sim`]: an in-process cluster on a seeded simulated network that drops, delays,
//!   partitions, kills and restarts nodes, for tests and measurements;
//! - [`wire`]: Raft messages to and from bytes, with a size check.
//!
//! What the node daemon adds: a timer calling `tick` every
//! [`limits::TICK_MS_RECOMMENDED`] ms, authenticated connections carrying
//! `poll_messages` output to peers, and forwarding proposals to the leader.
//!
//! Failure detection runs inside [`MetaNode::tick`] (`node/detector.rs`): the leader
//! proposes [`Update::SetMemberState`] down for a member it has not heard from for
//! [`MetaConfig::down_after_ticks`], and a node its state says is down proposes itself
//! up, at a new epoch, which fences what it held before. Client leases were cut (nothing granted or read them); a snapshot of the
//! earlier format is refused with [`state::SnapshotError::Format`] (format 3 now: 2 had one
//! holder per page and no zones).

pub mod command;
mod directory;
pub mod ids;
pub mod limits;
mod logger;
pub mod node;
pub mod rng;
pub mod sim;
pub mod state;
pub mod storage;
pub mod wire;

pub use command::{
    Batch, Extent, InitialCluster, MemberInfo, MemberState, MembershipChange, Update,
};
pub use directory::Holder;
pub use ids::{Epoch, NodeId, ReservationId, Ticket};
pub use node::{
    Applied, Completion, ConfigError, MetaConfig, MetaCounters, MetaError, MetaNode, MetaStatus,
    PeerProgress, ProposalFailed, ProposeError, Role,
};
/// raft-rs's message type, as [`MetaNode::step`] takes and [`MetaNode::poll_messages`] gives.
pub use raft::eraftpb::Message as RaftMessage;
pub use state::{
    InvariantError, Member, MetaState, RaftRole, Rejection, ReplicationHealth, Reservation,
    UnderReplicated, Usage,
};
