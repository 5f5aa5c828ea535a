//! The configuration of one node of the metadata group, checked by
//! [`MetaConfig::validate`]; every timeout in ticks (the node never reads a clock).

use std::path::PathBuf;

use crate::ids::NodeId;
use crate::limits;

/// Configuration of one node of the metadata group. Every timeout is in ticks; the node
/// never reads a clock.
#[derive(Clone, Debug)]
pub struct MetaConfig {
    /// This node's id (its Raft id; not 0).
    pub id: NodeId,
    /// Directory of the raft-engine log. A node restarts from it.
    pub dir: PathBuf,
    /// Whether every Ready that must be durable is fsynced before its messages go out.
    /// Turning it off is only for benchmarks and tests: a crash may then lose
    /// acknowledged entries.
    pub sync_writes: bool,
    /// Ticks between leader heartbeats. Shorter finds a dead leader sooner, costs more
    /// messages.
    pub heartbeat_ticks: usize,
    /// Election timeout (lower bound of the randomized timeout; also the leader's
    /// check-quorum window). Shorter fails over sooner; too short elects spuriously when
    /// a leader stalls.
    pub election_ticks: usize,
    /// Upper bound (exclusive) of the randomized election timeout. A wider range makes
    /// split votes rarer; a narrower one bounds fail-over time tighter.
    pub election_ticks_max: usize,
    /// Applied entries between two snapshots. Fewer: more snapshot writes; more: longer
    /// restart replay and more log on disk.
    pub snapshot_interval_entries: u64,
    /// Entries kept behind a snapshot for followers that are a little behind.
    pub log_entries_kept_after_snapshot: u64,
    /// Bound on this node's proposals waiting to be applied.
    pub proposals_in_flight_max: usize,
    /// Bound on outgoing messages not yet taken by [`MetaNode::poll_messages`].
    pub outbox_messages_max: usize,
    /// Bound on completions not yet taken by [`MetaNode::take_completions`].
    pub completions_max: usize,
    /// Bytes of entries in one append message.
    pub append_bytes_per_message: u64,
    /// Append messages in flight to one follower.
    pub appends_in_flight: usize,
    /// Bytes of uncommitted entries the leader accepts before dropping proposals.
    pub uncommitted_bytes_max: u64,
    /// Ticks without a message from a member after which the leader proposes it down
    /// (0: never). Shorter finds a dead node sooner, and so starts re-replicating its
    /// pages sooner; too short declares down a node that merely stalled (a long fsync, a
    /// GC pause), which then comes back at a new epoch with every copy it held dead. At
    /// least `election_ticks_max`: a member must have missed heartbeats for longer than
    /// the group waits before it elects a new leader.
    pub down_after_ticks: u64,
    /// Seed of the election-timeout generator (see the module doc). Give every node a
    /// different one; a simulation derives them from its seed.
    pub seed: u64,
}

impl MetaConfig {
    /// Defaults from [`crate::limits`] for node `id` keeping its log in `dir`.
    pub fn new(id: NodeId, dir: impl Into<PathBuf>) -> Self {
        MetaConfig {
            id,
            dir: dir.into(),
            sync_writes: true,
            heartbeat_ticks: limits::HEARTBEAT_TICKS_DEFAULT,
            election_ticks: limits::ELECTION_TICKS_DEFAULT,
            election_ticks_max: limits::ELECTION_TICKS_MAX_DEFAULT,
            snapshot_interval_entries: limits::SNAPSHOT_INTERVAL_ENTRIES_DEFAULT,
            log_entries_kept_after_snapshot: limits::LOG_ENTRIES_KEPT_AFTER_SNAPSHOT_DEFAULT,
            proposals_in_flight_max: limits::PROPOSALS_IN_FLIGHT_MAX_DEFAULT,
            outbox_messages_max: limits::OUTBOX_MESSAGES_MAX_DEFAULT,
            completions_max: limits::COMPLETIONS_MAX_DEFAULT,
            append_bytes_per_message: limits::APPEND_BYTES_PER_MESSAGE_DEFAULT,
            appends_in_flight: limits::APPENDS_IN_FLIGHT_DEFAULT,
            uncommitted_bytes_max: limits::UNCOMMITTED_BYTES_MAX_DEFAULT,
            down_after_ticks: limits::DOWN_AFTER_TICKS_DEFAULT,
            seed: id.0.wrapping_mul(0x2545_F491_4F6C_DD1D),
        }
    }

    /// Checks the fields; the error names the one that is wrong.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, reason: &str| {
            Err(ConfigError {
                field,
                reason: reason.to_string(),
            })
        };
        if self.id.0 == 0 {
            return bad("id", "0 is not a valid Raft id");
        }
        if self.heartbeat_ticks == 0 {
            return bad("heartbeat_ticks", "must be at least 1");
        }
        if self.election_ticks <= self.heartbeat_ticks {
            return bad("election_ticks", "must be greater than heartbeat_ticks");
        }
        if self.election_ticks_max <= self.election_ticks {
            return bad("election_ticks_max", "must be greater than election_ticks");
        }
        if self.snapshot_interval_entries == 0 {
            return bad("snapshot_interval_entries", "must be at least 1");
        }
        for (field, v) in [
            ("proposals_in_flight_max", self.proposals_in_flight_max),
            ("outbox_messages_max", self.outbox_messages_max),
            ("completions_max", self.completions_max),
            ("appends_in_flight", self.appends_in_flight),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1");
            }
        }
        if self.append_bytes_per_message == 0 {
            return bad("append_bytes_per_message", "must be at least 1");
        }
        if self.uncommitted_bytes_max == 0 {
            return bad("uncommitted_bytes_max", "must be at least 1");
        }
        if self.down_after_ticks != 0 && self.down_after_ticks < self.election_ticks_max as u64 {
            return bad(
                "down_after_ticks",
                "must be 0 (off) or at least election_ticks_max",
            );
        }
        Ok(())
    }
}

/// A configuration field that is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid metadata config field `{field}`: {reason}")]
pub struct ConfigError {
    /// The field.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}
