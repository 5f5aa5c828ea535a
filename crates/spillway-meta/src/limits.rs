//! Every named bound of the metadata group, with the worst-case cost it implies.
//!
//! Bounds a deployment may want to change are fields of [`crate::MetaConfig`] with their
//! defaults here; bounds that protect the implementation are plain constants.

/// Most bytes a decoded command (one proposal: a [`crate::Batch`] or a membership change)
/// may claim while being decoded: 16 MiB. A batch of [`BATCH_UPDATES_MAX`] extent updates
/// encodes to about 0.7 MiB, so this leaves a wide margin while a hostile length field
/// still cannot make the decoder allocate more than 16 MiB.
pub const COMMAND_DECODE_BYTES_MAX: usize = 16 << 20;
/// Most bytes a state-machine snapshot may claim while being decoded: 1 GiB. A directory of
/// [`DIRECTORY_EXTENTS_MAX`] extents is about 200 MiB in memory, so 1 GiB is the ceiling a
/// corrupt or hostile snapshot can cost.
pub const SNAPSHOT_DECODE_BYTES_MAX: usize = 1 << 30;
/// Largest encoded Raft message accepted by [`crate::wire::decode_message`]: 1.25 GiB
/// (a snapshot message carries the whole snapshot). Frames must be length-checked against
/// this before they are read into memory.
pub const RAFT_MESSAGE_BYTES_MAX: usize = SNAPSHOT_DECODE_BYTES_MAX + (256 << 20);

/// Most updates in one proposal: 16384. A full batch of extent placements encodes to about
/// 0.7 MiB, one Raft entry; larger batches would make every follower append wait for it.
pub const BATCH_UPDATES_MAX: usize = 16 * 1024;
/// Most extents the directory holds, over all replica slots: 2^22 (4M). Each costs about 48 bytes in memory and
/// about 30 bytes in a snapshot, so a full directory is ~200 MiB in memory, ~120 MiB on disk.
pub const DIRECTORY_EXTENTS_MAX: usize = 1 << 22;
/// Most replica slots of the directory: 4. A page spilled with `k` replicas has a record
/// in slots `0..k`; each slot is an interval map of its own, so the directory's records
/// (bounded by [`DIRECTORY_EXTENTS_MAX`] over all slots) grow with the replicas placed.
pub const REPLICAS_MAX: usize = 4;
/// Longest zone label of a member: 64 bytes (one per member: 64 KiB over
/// [`MEMBERS_MAX`] members).
pub const ZONE_BYTES_MAX: usize = 64;
/// Most members (voters and learners) of one pool: 1024.
pub const MEMBERS_MAX: usize = 1024;
/// Most addresses one member advertises: 8 (control, data, one per NIC...).
pub const ADDRESSES_PER_MEMBER_MAX: usize = 8;
/// Longest address string: 256 bytes.
pub const ADDRESS_BYTES_MAX: usize = 256;
/// Most live capacity reservations in the pool: 2^16 (each ~48 bytes: 3 MiB).
pub const RESERVATIONS_MAX: usize = 1 << 16;

/// Default number of applied entries between two state-machine snapshots: 4096. A snapshot
/// costs one encode of the whole state (about 30 bytes per extent) plus one synced write;
/// more entries between snapshots mean a longer log to replay at restart.
pub const SNAPSHOT_INTERVAL_ENTRIES_DEFAULT: u64 = 4096;
/// Default number of log entries kept behind a snapshot: 512, so a follower that is only a
/// little behind catches up from the log instead of receiving a whole snapshot. Costs at
/// most 512 entries of disk (up to ~350 MiB with full batches, typically far less).
pub const LOG_ENTRIES_KEPT_AFTER_SNAPSHOT_DEFAULT: u64 = 512;

/// Default bound on proposals of this node that are waiting to be applied: 1024. Past it
/// `propose` answers [`crate::ProposeError::TooManyInFlight`], so a slow group pushes back
/// on its callers instead of growing the log without bound.
pub const PROPOSALS_IN_FLIGHT_MAX_DEFAULT: usize = 1024;
/// Default bound on outgoing messages waiting for [`crate::MetaNode::poll_messages`]:
/// 65536. Past it new messages are dropped and counted (Raft retransmits what matters).
pub const OUTBOX_MESSAGES_MAX_DEFAULT: usize = 64 * 1024;
/// Default bound on completions waiting for [`crate::MetaNode::take_completions`]: 65536.
/// Past it the oldest are dropped and counted.
pub const COMPLETIONS_MAX_DEFAULT: usize = 64 * 1024;

/// Default bytes of log entries in one append message: 4 MiB (several full batches).
pub const APPEND_BYTES_PER_MESSAGE_DEFAULT: u64 = 4 << 20;
/// Default number of append messages in flight to one follower: 256. With
/// [`APPEND_BYTES_PER_MESSAGE_DEFAULT`] this bounds one follower's window at 1 GiB in the
/// worst case; in practice entries are far smaller than the per-message bound.
pub const APPENDS_IN_FLIGHT_DEFAULT: usize = 256;
/// Default bytes of proposed but uncommitted entries the leader accepts: 64 MiB. Past it
/// proposals are dropped (the caller sees `ProposalDropped`) until the followers catch up.
pub const UNCOMMITTED_BYTES_MAX_DEFAULT: u64 = 64 << 20;

/// The recommended wall-clock length of one tick: 100 ms. All timeouts below are in ticks.
pub const TICK_MS_RECOMMENDED: u64 = 100;
/// Default ticks between leader heartbeats: 1 (100 ms at the recommended tick).
pub const HEARTBEAT_TICKS_DEFAULT: usize = 1;
/// Default election timeout: 5 ticks (500 ms). A follower that hears nothing from the
/// leader for a random number of ticks in
/// [`ELECTION_TICKS_DEFAULT`, `ELECTION_TICKS_MAX_DEFAULT`) starts an election; the
/// leader steps down when it has not heard from a quorum for this many ticks. Shorter
/// means faster fail-over but more spurious elections when a leader stalls (a slow fsync).
pub const ELECTION_TICKS_DEFAULT: usize = 5;
/// Default upper bound (exclusive) of the randomized election timeout: 8 ticks (800 ms).
/// With the defaults a new leader is elected within about 0.7 s of the old one's death.
pub const ELECTION_TICKS_MAX_DEFAULT: usize = 8;

/// Default failure-detection timeout: 20 ticks (2 s at the recommended tick). The leader
/// proposes down a member it has not heard from for this long (it hears from every live
/// member each heartbeat, 100 ms). Shorter starts re-replication sooner after a death;
/// longer forgives longer stalls (a node declared down comes back at a new epoch, and
/// every copy it held is made again elsewhere).
pub const DOWN_AFTER_TICKS_DEFAULT: u64 = 20;

/// raft-engine: target size of one log file, 32 MiB. Smaller files are purged sooner after
/// compaction; larger ones mean fewer files.
pub const ENGINE_FILE_BYTES_TARGET: u64 = 32 << 20;
/// raft-engine: total size of log files past which purging rewrites live data, 256 MiB.
/// This is the disk one node's log may use before old files are reclaimed.
pub const ENGINE_PURGE_THRESHOLD_BYTES: u64 = 256 << 20;
