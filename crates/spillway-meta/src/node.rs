//! [`MetaNode`]: one member of the metadata group, driven by its caller. No sockets, no
//! threads, no clock: time is [`MetaNode::tick`], input is [`MetaNode::step`] and
//! [`MetaNode::propose`], output is [`MetaNode::poll_messages`] and
//! [`MetaNode::take_completions`].
//!
//! # Driving it
//! ```text
//! loop {
//!     every tick interval:        node.tick();
//!     for each peer message:      node.step(msg)?;
//!     for each local request:     node.propose(&batch)?;      // leader only
//!     node.handle_ready()?;                                   // persist, apply, queue output
//!     for msg in node.poll_messages() { send to msg.to }
//!     for c in node.take_completions() { answer the requester of c.ticket }
//! }
//! ```
//!
//! # The Ready loop
//! [`MetaNode::handle_ready`] is the only place Raft's output is consumed, in the order
//! raft-rs requires: send messages; install a received snapshot; apply committed entries;
//! append entries and the hard state (one raft-engine write, synced); send the messages
//! that had to wait for that write; `advance`; store the new commit index; send and apply
//! what the light Ready carries; `advance_apply`. Then a snapshot is taken when
//! [`MetaConfig::snapshot_interval_entries`] entries were applied since the last one, and
//! the log is compacted behind it. The empty entry a new leader appends is skipped.
//!
//! # Proposals
//! A proposal is remembered by the log index and term the leader gave it. When the entry
//! at that index is applied, the proposal completed if the term matches (two entries with
//! the same index and term are the same entry) and was lost otherwise. A snapshot that
//! jumps over the index leaves the outcome unknown ([`ProposalFailed::Overtaken`]).
//!
//! # Determinism
//! raft-rs draws election timeouts from a thread-local generator. So that a seed
//! reproduces a simulation, each node redraws its timeout from its own seeded generator
//! whenever raft-rs resets its election timer (a change of term, role or leader).
//!
//! # Errors
//! An error from [`MetaNode::handle_ready`] (the disk failed or is full, a snapshot would
//! not decode) leaves raft-rs mid-Ready: the node refuses further work
//! ([`MetaError::Poisoned`]). Drop it and reopen it from its directory with
//! [`MetaNode::open`], as a restart does: it rebuilds Raft from the durable log (what the
//! failed Ready did not write is lost, and Raft fetches it again from the leader). A log
//! on a full disk reopens fine and fails at its next write:
//! [`EngineStorage::check_writable`] tells first whether it takes writes again. The node
//! daemon does both in-process until they succeed.

use std::collections::{BTreeMap, VecDeque};

use protobuf::Message as _;
use raft::eraftpb::{
    ConfChange, ConfChangeSingle, ConfChangeTransition, ConfChangeType, ConfChangeV2, ConfState,
    Entry, EntryType, Message, Snapshot, SnapshotMetadata,
};
use raft::{RawNode, SnapshotStatus, StateRole, Storage as _};

use crate::command::{self, Batch, InitialCluster, MembershipChange};
use crate::ids::{NodeId, Ticket};
use crate::limits;
use crate::logger::raft_logger;
use crate::rng::SimRng;
use crate::state::{MetaState, Rejection, SnapshotError};
use crate::storage::{EngineStorage, StorageError};

mod config;
mod detector;
pub use config::{ConfigError, MetaConfig};
use detector::Detector;

/// A failure of the node itself (not of one proposal).
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The log store failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// raft-rs refused an operation.
    #[error("raft refused to {action}: {source}")]
    Raft {
        /// What was being done.
        action: &'static str,
        /// raft-rs's error.
        #[source]
        source: raft::Error,
    },
    /// A snapshot (received or stored) could not be loaded.
    #[error("snapshot at index {index} cannot be loaded: {source}")]
    Snapshot {
        /// Its index.
        index: u64,
        /// Why.
        #[source]
        source: SnapshotError,
    },
    /// The initial cluster description is unusable.
    #[error("cannot bootstrap: {reason}")]
    Bootstrap {
        /// Why.
        reason: String,
    },
    /// An earlier `handle_ready` failed; reopen the node from its directory.
    #[error("node {node} failed earlier and must be reopened from its directory")]
    Poisoned {
        /// This node.
        node: NodeId,
    },
}

/// Why a proposal was not accepted (nothing was appended).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    /// Only the leader takes proposals; `leader` is who this node thinks leads.
    #[error("not the leader (leader: {leader:?})")]
    NotLeader {
        /// The known leader, if any.
        leader: Option<NodeId>,
    },
    /// Too many proposals of this node wait to be applied.
    #[error("{in_flight} proposals in flight, at the bound of {max}")]
    TooManyInFlight {
        /// Proposals waiting.
        in_flight: usize,
        /// The bound.
        max: usize,
    },
    /// The batch is empty.
    #[error("the batch has no updates")]
    EmptyBatch,
    /// The batch has more than [`limits::BATCH_UPDATES_MAX`] updates.
    #[error("the batch has {updates} updates, more than {max}")]
    BatchTooLarge {
        /// Its updates.
        updates: usize,
        /// The bound.
        max: usize,
    },
    /// An earlier configuration change is not applied yet.
    #[error("a configuration change is still in progress")]
    ConfChangePending,
    /// The membership change does not fit the current configuration.
    #[error("invalid membership change: {reason}")]
    InvalidMembership {
        /// Why.
        reason: String,
    },
    /// The leader cannot remove or replace itself.
    #[error("the leader cannot remove itself: transfer leadership first")]
    RemovesLeader,
    /// raft-rs dropped it (a leadership transfer is in progress, or too many bytes are
    /// uncommitted).
    #[error("raft dropped the proposal: {reason}")]
    Dropped {
        /// raft-rs's reason.
        reason: String,
    },
}

/// What an applied proposal did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// A batch: one outcome per update, in order.
    Batch {
        /// `Ok` for each update that took effect.
        outcomes: Vec<Result<(), Rejection>>,
    },
    /// A membership change: the configuration after it.
    Membership {
        /// Voters (the incoming set while a joint change is under way).
        voters: Vec<NodeId>,
        /// Learners.
        learners: Vec<NodeId>,
    },
}

impl Applied {
    /// Number of updates refused (0 for a membership change).
    pub fn rejected(&self) -> usize {
        match self {
            Applied::Batch { outcomes } => outcomes.iter().filter(|o| o.is_err()).count(),
            Applied::Membership { .. } => 0,
        }
    }
}

/// Why a proposal that was appended did not take effect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProposalFailed {
    /// Another entry was committed at its index (leadership changed): it never applies.
    /// Propose again.
    #[error("lost in a change of leader; propose again")]
    Lost,
    /// A snapshot covered its index: it may or may not have applied. Read the state.
    #[error("overtaken by a snapshot; its outcome is unknown")]
    Overtaken,
    /// raft-rs refused the configuration change when applying it.
    #[error("configuration change refused: {reason}")]
    ConfChangeRefused {
        /// raft-rs's reason.
        reason: String,
    },
    /// The entry did not decode (every node refuses it alike).
    #[error("entry does not decode: {reason}")]
    Undecodable {
        /// The decoder's reason.
        reason: String,
    },
}

/// The end of one proposal of this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The proposal.
    pub ticket: Ticket,
    /// The log index it was given.
    pub index: u64,
    /// What came of it.
    pub result: Result<Applied, ProposalFailed>,
}

/// The node's part in the group right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Follows a leader (or waits for one).
    Follower,
    /// Asking for pre-votes before starting an election.
    PreCandidate,
    /// Asking for votes.
    Candidate,
    /// Leads: takes proposals.
    Leader,
}

/// A summary for status pages and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaStatus {
    /// This node.
    pub id: NodeId,
    /// Its role.
    pub role: Role,
    /// Current term.
    pub term: u64,
    /// The leader it knows, if any.
    pub leader: Option<NodeId>,
    /// Commit index.
    pub commit_index: u64,
    /// Applied index.
    pub applied_index: u64,
    /// Index of the latest snapshot (taken or installed).
    pub snapshot_index: u64,
    /// First index kept in the log.
    pub first_log_index: u64,
    /// Last index in the log (persisted or not).
    pub last_log_index: u64,
    /// Voters of the applied configuration.
    pub voters: Vec<NodeId>,
    /// Learners of the applied configuration.
    pub learners: Vec<NodeId>,
    /// Counters since open.
    pub counters: MetaCounters,
}

/// Replication progress of one peer, as the leader sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerProgress {
    /// The peer.
    pub id: NodeId,
    /// The highest log index known to be on the peer.
    pub matched_index: u64,
    /// Whether the peer answered within the last election timeout.
    pub recently_active: bool,
}

/// Counters since the node was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetaCounters {
    /// Entries applied (including empty ones).
    pub entries_applied: u64,
    /// Snapshots taken locally.
    pub snapshots_taken: u64,
    /// Snapshots received and installed.
    pub snapshots_installed: u64,
    /// Outgoing messages dropped because the outbox was full.
    pub messages_dropped: u64,
    /// Completions dropped because nobody took them.
    pub completions_dropped: u64,
    /// Peer messages refused by `step`.
    pub messages_refused: u64,
    /// Member state changes the failure detector proposed (members down, this node up).
    pub member_state_proposals: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    ticket: Ticket,
    term: u64,
}

/// One member of the metadata group (see the module doc).
pub struct MetaNode {
    id: NodeId,
    config: MetaConfig,
    raw: RawNode<EngineStorage>,
    state: MetaState,
    rng: SimRng,
    timer_seen: (u64, StateRole, u64),
    next_seq: u64,
    pending: BTreeMap<u64, Pending>,
    outbox: Vec<Message>,
    completions: VecDeque<Completion>,
    snapshot_index: u64,
    counters: MetaCounters,
    poisoned: bool,
    detector: Detector,
    /// The caller's clock as last told ([`MetaNode::observe_clock_ms`]), for the batches
    /// the detector proposes.
    clock_ms: u64,
}

impl MetaNode {
    /// Opens the node whose log is in `config.dir`.
    ///
    /// - The directory has a log: the node restarts from it (its latest snapshot, then
    ///   the entries after it) and `initial` is ignored.
    /// - It is empty and `initial` is given: a new pool; `config.id` must be one of
    ///   `initial`'s members, and every first member must be opened with the same value.
    /// - It is empty and `initial` is `None`: a joining node; it waits for the leader to
    ///   send it a snapshot once [`MembershipChange::AddLearner`] is applied.
    pub fn open(config: MetaConfig, initial: Option<&InitialCluster>) -> Result<Self, MetaError> {
        config.validate()?;
        let id = config.id;
        std::fs::create_dir_all(&config.dir).map_err(|e| MetaError::Bootstrap {
            reason: format!("cannot create {}: {e}", config.dir.display()),
        })?;
        let mut storage = EngineStorage::open(&config.dir)?;
        if !storage.is_initialized()
            && let Some(initial) = initial
        {
            check_initial(initial, id)?;
            let voters: Vec<u64> = initial.members.iter().map(|m| m.id.0).collect();
            let state = MetaState::initial(initial);
            storage.bootstrap(ConfState::from((voters, vec![])), state.encode_snapshot())?;
        }
        let snapshot_index = storage.snapshot_index();
        let mut state = if snapshot_index > 0 {
            MetaState::decode_snapshot(&storage.snapshot_data(), snapshot_index).map_err(
                |source| MetaError::Snapshot {
                    index: snapshot_index,
                    source,
                },
            )?
        } else {
            MetaState::default()
        };
        state.set_applied_index(snapshot_index);
        let raft_config = raft::Config {
            id: id.0,
            election_tick: config.election_ticks,
            heartbeat_tick: config.heartbeat_ticks,
            min_election_tick: config.election_ticks,
            max_election_tick: config.election_ticks_max,
            applied: snapshot_index,
            max_size_per_msg: config.append_bytes_per_message,
            max_inflight_msgs: config.appends_in_flight,
            max_uncommitted_size: config.uncommitted_bytes_max,
            check_quorum: true,
            pre_vote: true,
            batch_append: true,
            ..Default::default()
        };
        let raw = RawNode::new(&raft_config, storage, &raft_logger(id.0)).map_err(|source| {
            MetaError::Raft {
                action: "start",
                source,
            }
        })?;
        let detector = Detector::new(config.down_after_ticks, config.election_ticks_max as u64);
        let mut node = MetaNode {
            id,
            rng: SimRng::new(config.seed),
            config,
            raw,
            state,
            timer_seen: (u64::MAX, StateRole::Follower, u64::MAX),
            next_seq: 1,
            pending: BTreeMap::new(),
            outbox: Vec::new(),
            completions: VecDeque::new(),
            snapshot_index,
            counters: MetaCounters::default(),
            poisoned: false,
            detector,
            clock_ms: 0,
        };
        node.redraw_election_timeout();
        // Replay the entries this node knows are committed, so the state is as current as
        // the local log allows before the first tick.
        node.handle_ready()?;
        tracing::info!(
            node = %id,
            snapshot_index,
            applied_index = node.state.applied_index(),
            last_index = node.raw.raft.raft_log.last_index(),
            "metadata node opened"
        );
        Ok(node)
    }

    // ---- input ----

    /// Advances Raft's clock by one tick, and runs the failure detector (see
    /// [`MetaConfig::down_after_ticks`]): the leader proposes down the members it has not
    /// heard from for that long, and a node that the state says is down proposes itself up.
    pub fn tick(&mut self) {
        self.raw.tick();
        self.redraw_election_timeout();
        let leading = self.is_leader().then(|| self.term());
        let updates = self.detector.tick(self.id, leading, &self.state);
        if !updates.is_empty() && !self.poisoned {
            let batch = Batch {
                now_ms: self.clock_ms.max(self.state.clock_ms()),
                updates,
            };
            // No ticket: nobody waits for it; the detector looks at the state again.
            // A follower's proposal goes to the leader (raft-rs forwards it).
            match self.raw.propose(Vec::new(), command::encode(&batch)) {
                Ok(()) => self.counters.member_state_proposals += batch.len() as u64,
                Err(e) => {
                    tracing::debug!(node = %self.id, error = %e, "member state proposal dropped")
                }
            }
        }
    }

    /// Tells the node the caller's clock (milliseconds, as in [`Batch::now_ms`]), which
    /// stamps the batches the failure detector proposes. Optional: without it they carry
    /// the group clock.
    pub fn observe_clock_ms(&mut self, now_ms: u64) {
        self.clock_ms = self.clock_ms.max(now_ms);
    }

    /// Hands a message from a peer to Raft. Messages that Raft refuses (local message
    /// types, responses from peers it does not track) are counted and dropped.
    pub fn step(&mut self, msg: Message) -> Result<(), MetaError> {
        self.check_poisoned()?;
        self.detector.heard_from(NodeId(msg.from));
        if let Err(e) = self.raw.step(msg) {
            self.counters.messages_refused += 1;
            tracing::debug!(node = %self.id, error = %e, "peer message refused");
        }
        self.redraw_election_timeout();
        Ok(())
    }

    /// Proposes a batch of updates. Only the leader accepts; the [`Completion`] with the
    /// returned ticket says what came of each update.
    pub fn propose(&mut self, batch: &Batch) -> Result<Ticket, ProposeError> {
        if batch.is_empty() {
            return Err(ProposeError::EmptyBatch);
        }
        if batch.len() > limits::BATCH_UPDATES_MAX {
            return Err(ProposeError::BatchTooLarge {
                updates: batch.len(),
                max: limits::BATCH_UPDATES_MAX,
            });
        }
        self.check_can_propose()?;
        let data = command::encode(batch);
        self.propose_with_ticket(|raw, context| raw.propose(context, data))
    }

    /// Proposes a membership change (a Raft conf change). One at a time: a second one is
    /// refused until the first is applied.
    pub fn propose_membership(
        &mut self,
        change: &MembershipChange,
    ) -> Result<Ticket, ProposeError> {
        self.check_can_propose()?;
        let conf = self.raw.raft.prs().conf().to_conf_state();
        let changes = self.conf_changes(change, &conf)?;
        if self.raw.raft.has_pending_conf() || !conf.voters_outgoing.is_empty() {
            return Err(ProposeError::ConfChangePending);
        }
        let mut cc = ConfChangeV2::default();
        cc.set_transition(ConfChangeTransition::Auto);
        cc.set_changes(changes.into());
        cc.context = command::encode(change).into();
        self.propose_with_ticket(|raw, context| raw.propose_conf_change(context, cc))
    }

    /// Takes the next ticket and has `propose` hand Raft an entry with it as its context;
    /// remembers the ticket once Raft took the entry.
    fn propose_with_ticket(
        &mut self,
        propose: impl FnOnce(&mut RawNode<EngineStorage>, Vec<u8>) -> raft::Result<()>,
    ) -> Result<Ticket, ProposeError> {
        let ticket = self.next_ticket();
        propose(&mut self.raw, ticket.encode().to_vec()).map_err(|e| ProposeError::Dropped {
            reason: e.to_string(),
        })?;
        self.remember(ticket);
        Ok(ticket)
    }

    fn conf_changes(
        &self,
        change: &MembershipChange,
        conf: &ConfState,
    ) -> Result<Vec<ConfChangeSingle>, ProposeError> {
        let invalid = |reason: String| Err(ProposeError::InvalidMembership { reason });
        let is_voter = |n: NodeId| conf.voters.contains(&n.0);
        let is_learner = |n: NodeId| conf.learners.contains(&n.0);
        let single = |t: ConfChangeType, n: NodeId| {
            let mut s = ConfChangeSingle::default();
            s.set_change_type(t);
            s.node_id = n.0;
            s
        };
        match change {
            MembershipChange::AddLearner { member } => {
                if let Some(reason) = member.invalid_reason() {
                    return invalid(reason.to_string());
                }
                if is_voter(member.id) || is_learner(member.id) {
                    return invalid(format!("{} is already in the group", member.id));
                }
                if conf.voters.len() + conf.learners.len() >= limits::MEMBERS_MAX {
                    return invalid(format!("the group has {} members", limits::MEMBERS_MAX));
                }
                Ok(vec![single(ConfChangeType::AddLearnerNode, member.id)])
            }
            MembershipChange::Promote { node } => {
                if !is_learner(*node) {
                    return invalid(format!("{node} is not a learner"));
                }
                Ok(vec![single(ConfChangeType::AddNode, *node)])
            }
            MembershipChange::Remove { node } => {
                if *node == self.id {
                    return Err(ProposeError::RemovesLeader);
                }
                if !is_voter(*node) && !is_learner(*node) {
                    return invalid(format!("{node} is not in the group"));
                }
                Ok(vec![single(ConfChangeType::RemoveNode, *node)])
            }
            MembershipChange::Replace { old, new } => {
                if *old == self.id {
                    return Err(ProposeError::RemovesLeader);
                }
                if !is_voter(*old) {
                    return invalid(format!("{old} is not a voter"));
                }
                if !is_learner(*new) {
                    return invalid(format!("{new} must join as a learner first"));
                }
                Ok(vec![
                    single(ConfChangeType::AddNode, *new),
                    single(ConfChangeType::RemoveNode, *old),
                ])
            }
        }
    }

    /// Starts an election now (tests, or an operator forcing fail-over).
    pub fn campaign(&mut self) -> Result<(), MetaError> {
        self.check_poisoned()?;
        self.raw.campaign().map_err(|source| MetaError::Raft {
            action: "campaign",
            source,
        })?;
        self.redraw_election_timeout();
        Ok(())
    }

    /// Asks the leader to hand leadership to `to` (before removing the leader).
    pub fn transfer_leader(&mut self, to: NodeId) {
        self.raw.transfer_leader(to.0);
    }

    /// Tells Raft that a message to `to` could not be delivered.
    pub fn report_unreachable(&mut self, to: NodeId) {
        self.raw.report_unreachable(to.0);
    }

    /// Tells Raft whether a snapshot message to `to` was delivered. Must be called for
    /// every snapshot message sent, or the follower waits for one forever.
    pub fn report_snapshot(&mut self, to: NodeId, delivered: bool) {
        let status = if delivered {
            SnapshotStatus::Finish
        } else {
            SnapshotStatus::Failure
        };
        self.raw.report_snapshot(to.0, status);
    }

    // ---- the Ready loop ----

    /// Whether [`MetaNode::handle_ready`] has work.
    pub fn has_ready(&self) -> bool {
        !self.poisoned && self.raw.has_ready()
    }

    /// Consumes Raft's output (see the module doc for the order). Call after every batch
    /// of ticks, steps and proposals.
    pub fn handle_ready(&mut self) -> Result<(), MetaError> {
        self.check_poisoned()?;
        self.poisoned = true;
        // Each pass consumes one Ready; a new one exists only if something happened.
        while self.raw.has_ready() {
            self.handle_one_ready()?;
        }
        self.redraw_election_timeout();
        self.poisoned = false;
        Ok(())
    }

    fn handle_one_ready(&mut self) -> Result<(), MetaError> {
        let mut rd = self.raw.ready();
        self.queue_messages(rd.take_messages());
        if !rd.snapshot().is_empty() {
            self.install_snapshot(rd.snapshot())?;
        }
        let committed = rd.take_committed_entries();
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-meta::ready::before-apply");
        self.apply_entries(committed)?;
        let sync = self.config.sync_writes && rd.must_sync();
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-meta::ready::before-persist");
        self.raw.mut_store().append(rd.entries(), rd.hs(), sync)?;
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-meta::ready::after-persist");
        self.queue_messages(rd.take_persisted_messages());
        let mut light = self.raw.advance(rd);
        if let Some(commit) = light.commit_index() {
            self.raw.mut_store().set_commit(commit)?;
        }
        self.queue_messages(light.take_messages());
        self.apply_entries(light.take_committed_entries())?;
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-meta::ready::before-advance-apply");
        self.raw.advance_apply();
        self.maybe_snapshot()
    }

    fn install_snapshot(&mut self, snap: &Snapshot) -> Result<(), MetaError> {
        let index = snap.get_metadata().index;
        let state = MetaState::decode_snapshot(&snap.data, index)
            .map_err(|source| MetaError::Snapshot { index, source })?;
        self.raw.mut_store().install_snapshot(snap)?;
        self.state = state;
        self.snapshot_index = index;
        self.counters.snapshots_installed += 1;
        let overtaken: Vec<u64> = self.pending.range(..=index).map(|(&i, _)| i).collect();
        for i in overtaken {
            let p = self.pending.remove(&i).expect("listed above");
            self.complete(p.ticket, i, Err(ProposalFailed::Overtaken));
        }
        tracing::info!(node = %self.id, index, "snapshot installed");
        Ok(())
    }

    fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<(), MetaError> {
        for e in entries {
            let result = match e.get_entry_type() {
                EntryType::EntryNormal if e.data.is_empty() => None,
                EntryType::EntryNormal => {
                    Some(match command::decode_command::<Batch>("batch", &e.data) {
                        Ok(batch) => Ok(Applied::Batch {
                            outcomes: self.state.apply_batch(&batch),
                        }),
                        Err(err) => {
                            tracing::error!(node = %self.id, index = e.index, error = %err, "undecodable entry skipped");
                            Err(ProposalFailed::Undecodable {
                                reason: err.to_string(),
                            })
                        }
                    })
                }
                EntryType::EntryConfChange | EntryType::EntryConfChangeV2 => {
                    Some(self.apply_conf_change(&e))
                }
            };
            self.state.set_applied_index(e.index);
            self.counters.entries_applied += 1;
            if let Some(p) = self.pending.remove(&e.index) {
                let outcome = if p.term != e.term {
                    Err(ProposalFailed::Lost)
                } else {
                    // Our own proposals are never empty entries.
                    result.unwrap_or(Err(ProposalFailed::Lost))
                };
                self.complete(p.ticket, e.index, outcome);
            }
        }
        Ok(())
    }

    fn apply_conf_change(&mut self, e: &Entry) -> Result<Applied, ProposalFailed> {
        let undecodable = |reason: String| {
            tracing::error!(index = e.index, reason, "undecodable conf change skipped");
            ProposalFailed::Undecodable { reason }
        };
        let cc = if e.get_entry_type() == EntryType::EntryConfChangeV2 {
            ConfChangeV2::parse_from_bytes(&e.data).map_err(|err| undecodable(err.to_string()))?
        } else {
            // We never propose v1 changes; convert one all the same, as raft-rs would.
            let mut v1 = ConfChange::parse_from_bytes(&e.data)
                .map_err(|err| undecodable(err.to_string()))?;
            let mut single = ConfChangeSingle::default();
            single.set_change_type(v1.get_change_type());
            single.node_id = v1.node_id;
            let mut v2 = ConfChangeV2::default();
            v2.set_changes(vec![single].into());
            v2.context = v1.take_context();
            v2
        };
        // The context is empty for the change raft-rs proposes itself to leave a joint
        // configuration.
        let change = if cc.context.is_empty() {
            None
        } else {
            Some(
                command::decode_command::<MembershipChange>("membership change", &cc.context)
                    .map_err(|err| undecodable(err.to_string()))?,
            )
        };
        let cs = self.raw.apply_conf_change(&cc).map_err(|err| {
            tracing::warn!(node = %self.id, index = e.index, error = %err, "conf change refused");
            ProposalFailed::ConfChangeRefused {
                reason: err.to_string(),
            }
        })?;
        let learners: Vec<u64> = cs
            .learners
            .iter()
            .chain(cs.learners_next.iter())
            .copied()
            .collect();
        if let Some(change) = &change {
            self.state.apply_membership(change, &cs.voters, &learners);
        }
        tracing::info!(node = %self.id, index = e.index, voters = ?cs.voters, learners = ?learners, "configuration changed");
        Ok(Applied::Membership {
            voters: cs.voters.iter().map(|&v| NodeId(v)).collect(),
            learners: learners.into_iter().map(NodeId).collect(),
        })
    }

    fn maybe_snapshot(&mut self) -> Result<(), MetaError> {
        let applied = self.state.applied_index();
        let wanted = self.raw.store().take_snapshot_wanted() && applied > self.snapshot_index;
        if !wanted && applied < self.snapshot_index + self.config.snapshot_interval_entries {
            return Ok(());
        }
        let term = self
            .raw
            .store()
            .term(applied)
            .map_err(|source| MetaError::Raft {
                action: "read the term of the applied entry",
                source,
            })?;
        let mut meta = SnapshotMetadata {
            index: applied,
            term,
            ..Default::default()
        };
        meta.set_conf_state(self.raw.raft.prs().conf().to_conf_state());
        let data = self.state.encode_snapshot();
        let data_bytes = data.len();
        let compact_to = applied
            .saturating_sub(self.config.log_entries_kept_after_snapshot)
            .max(1)
            + 1;
        self.raw.mut_store().save_snapshot(meta, data, compact_to)?;
        self.snapshot_index = applied;
        self.counters.snapshots_taken += 1;
        tracing::debug!(node = %self.id, index = applied, data_bytes, compact_to, "snapshot taken");
        Ok(())
    }

    // ---- output ----

    /// Takes the messages to send, each to `msg.to`. Encode them with
    /// [`crate::wire::encode_message`]. For every `MsgSnapshot`, call
    /// [`MetaNode::report_snapshot`] once it was delivered or failed.
    pub fn poll_messages(&mut self) -> Vec<Message> {
        std::mem::take(&mut self.outbox)
    }

    /// Takes the completions of this node's proposals, in apply order.
    pub fn take_completions(&mut self) -> Vec<Completion> {
        self.completions.drain(..).collect()
    }

    // ---- reads ----

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The replicated state as applied here. On a follower it may lag the leader.
    pub fn state(&self) -> &MetaState {
        &self.state
    }

    /// Whether this node leads.
    pub fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    /// The leader this node knows of.
    pub fn leader(&self) -> Option<NodeId> {
        let l = self.raw.raft.leader_id;
        (l != raft::INVALID_ID).then_some(NodeId(l))
    }

    /// The current term.
    pub fn term(&self) -> u64 {
        self.raw.raft.term
    }

    /// The commit index.
    pub fn commit_index(&self) -> u64 {
        self.raw.raft.raft_log.committed
    }

    /// Proposals of this node waiting to be applied.
    pub fn proposals_in_flight(&self) -> usize {
        self.pending.len()
    }

    /// On the leader, how far each peer has replicated and whether it was heard from in
    /// the last election timeout: what decides when a learner can be promoted and when
    /// a node should be declared down. Empty on followers.
    pub fn peers(&self) -> Vec<PeerProgress> {
        if !self.is_leader() {
            return Vec::new();
        }
        let mut out: Vec<PeerProgress> = self
            .raw
            .raft
            .prs()
            .iter()
            .filter(|(id, _)| **id != self.id.0)
            .map(|(&id, pr)| PeerProgress {
                id: NodeId(id),
                matched_index: pr.matched,
                recently_active: pr.recent_active,
            })
            .collect();
        out.sort_by_key(|p| p.id);
        out
    }

    /// A summary for status pages and metrics.
    pub fn status(&self) -> MetaStatus {
        let r = &self.raw.raft;
        let conf = r.prs().conf().to_conf_state();
        MetaStatus {
            id: self.id,
            role: match r.state {
                StateRole::Follower => Role::Follower,
                StateRole::PreCandidate => Role::PreCandidate,
                StateRole::Candidate => Role::Candidate,
                StateRole::Leader => Role::Leader,
            },
            term: r.term,
            leader: self.leader(),
            commit_index: r.raft_log.committed,
            applied_index: self.state.applied_index(),
            snapshot_index: self.snapshot_index,
            first_log_index: self.raw.store().first_index().unwrap_or(0),
            last_log_index: r.raft_log.last_index(),
            voters: conf.voters.iter().map(|&v| NodeId(v)).collect(),
            learners: conf.learners.iter().map(|&v| NodeId(v)).collect(),
            counters: self.counters,
        }
    }

    // ---- helpers ----

    fn check_poisoned(&self) -> Result<(), MetaError> {
        if self.poisoned {
            Err(MetaError::Poisoned { node: self.id })
        } else {
            Ok(())
        }
    }

    fn check_can_propose(&self) -> Result<(), ProposeError> {
        if self.poisoned || !self.is_leader() {
            return Err(ProposeError::NotLeader {
                leader: self.leader(),
            });
        }
        if self.pending.len() >= self.config.proposals_in_flight_max {
            return Err(ProposeError::TooManyInFlight {
                in_flight: self.pending.len(),
                max: self.config.proposals_in_flight_max,
            });
        }
        Ok(())
    }

    fn next_ticket(&mut self) -> Ticket {
        let t = Ticket {
            proposer: self.id,
            seq: self.next_seq,
        };
        self.next_seq += 1;
        t
    }

    /// Records the index and term the leader just gave the proposal.
    fn remember(&mut self, ticket: Ticket) {
        let index = self.raw.raft.raft_log.last_index();
        let term = self.raw.raft.term;
        self.pending.insert(index, Pending { ticket, term });
    }

    fn complete(&mut self, ticket: Ticket, index: u64, result: Result<Applied, ProposalFailed>) {
        if self.completions.len() >= self.config.completions_max {
            self.completions.pop_front();
            self.counters.completions_dropped += 1;
        }
        self.completions.push_back(Completion {
            ticket,
            index,
            result,
        });
    }

    fn queue_messages(&mut self, msgs: Vec<Message>) {
        for m in msgs {
            if self.outbox.len() >= self.config.outbox_messages_max {
                self.counters.messages_dropped += 1;
            } else {
                self.outbox.push(m);
            }
        }
    }

    fn redraw_election_timeout(&mut self) {
        let r = &self.raw.raft;
        let seen = (r.term, r.state, r.leader_id);
        if seen != self.timer_seen {
            self.timer_seen = seen;
            let lo = self.config.election_ticks;
            let span = (self.config.election_ticks_max - lo) as u64;
            let t = lo + self.rng.below(span) as usize;
            self.raw.raft.set_randomized_election_timeout(t);
        }
    }
}

fn check_initial(initial: &InitialCluster, id: NodeId) -> Result<(), MetaError> {
    let bad = |reason: String| Err(MetaError::Bootstrap { reason });
    if initial.members.is_empty() {
        return bad("the initial cluster has no members".into());
    }
    if initial.page_bytes == 0 {
        return bad("page_bytes must be at least 1".into());
    }
    if initial.members.len() > limits::MEMBERS_MAX {
        return bad(format!("more than {} members", limits::MEMBERS_MAX));
    }
    let mut ids: Vec<NodeId> = initial.members.iter().map(|m| m.id).collect();
    ids.sort();
    ids.dedup();
    if ids.len() != initial.members.len() {
        return bad("member ids repeat".into());
    }
    for m in &initial.members {
        if let Some(reason) = m.invalid_reason() {
            return bad(format!("{}: {reason}", m.id));
        }
    }
    if !ids.contains(&id) {
        return bad(format!("{id} is not one of the initial members"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
