//! Raft's log and hard state kept in `raft-engine`: [`EngineStorage`] implements
//! [`raft::Storage`] so a node restarts from its directory.
//!
//! One raft-engine group ([`GROUP`]) holds the entries plus four keys:
//! - `hard_state`: Raft's term, vote and commit (protobuf `HardState`);
//! - `snapshot_meta`: index, term and configuration of the latest snapshot (protobuf
//!   `SnapshotMetadata`); its configuration is the one at that index, so a restarted
//!   node applies the entries after it and replays every later configuration change;
//! - `snapshot_data`: the state machine at that index (see [`crate::MetaState`]);
//! - `truncated`: index and term of the entry just before the first one kept, so that
//!   `term(first_index - 1)` is always answerable, as raft-rs requires.
//!
//! Invariants: entries are contiguous from `truncated + 1`; `truncated <= snapshot index`;
//! the persisted commit index is at least the snapshot index. A snapshot, its compaction
//! and the hard state are written in one raft-engine batch, so a crash leaves either the
//! old or the new snapshot, never a mix. Terms of the kept entries are cached in memory
//! (8 bytes an entry) because raft-rs asks for terms far more often than for entries.
//!
//! A write that fails (a full disk: raft-engine truncates what it appended and returns
//! the error) changes nothing in memory here; the caller decides what to do, and
//! [`crate::MetaNode`] stops until it is reopened. With the feature `failpoints`, the
//! failpoint `spillway-meta::storage::write` makes writes fail as a full disk does.

use std::cell::Cell;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, Storage};
use raft_engine::{Command, Config as EngineConfig, Engine, LogBatch, MessageExt, ReadableSize};

use crate::limits;

/// The raft-engine group id of the metadata log (the engine holds only this group).
pub const GROUP: u64 = 1;
const KEY_HARD_STATE: &[u8] = b"hard_state";
const KEY_SNAPSHOT_META: &[u8] = b"snapshot_meta";
const KEY_SNAPSHOT_DATA: &[u8] = b"snapshot_data";
const KEY_TRUNCATED: &[u8] = b"truncated";
/// Index and term of the snapshot a new pool starts from (index 0 would read as "no
/// snapshot" to raft-rs, and joining nodes must catch up through a snapshot first).
pub(crate) const BOOTSTRAP_INDEX: u64 = 1;
pub(crate) const BOOTSTRAP_TERM: u64 = 1;
/// Entries read per call while rebuilding the term cache at open.
const OPEN_FETCH_BYTES: usize = 8 << 20;

/// A failure of the log store.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// raft-engine returned an error.
    #[error("raft-engine at {} failed to {action}: {source}", dir.display())]
    Engine {
        /// The engine's directory.
        dir: PathBuf,
        /// What was being done.
        action: &'static str,
        /// The engine's error.
        #[source]
        source: raft_engine::Error,
    },
    /// The stored state breaks an invariant of the module doc.
    #[error("the log at {} is inconsistent: {reason}", dir.display())]
    Corrupt {
        /// The engine's directory.
        dir: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Tells raft-engine how to find an entry's index.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EntryExt;

impl MessageExt for EntryExt {
    type Entry = Entry;
    fn index(e: &Entry) -> u64 {
        e.index
    }
}

/// [`raft::Storage`] over raft-engine. See the module doc.
pub struct EngineStorage {
    dir: PathBuf,
    engine: Engine,
    hard_state: HardState,
    snapshot_meta: SnapshotMetadata,
    truncated_index: u64,
    truncated_term: u64,
    /// Terms of the entries from `truncated_index + 1` to the last one.
    terms: VecDeque<u64>,
    /// Set when raft-rs asked for a snapshot the stored one cannot serve (too old, or
    /// taken before the recipient joined); the node takes a fresh one after the Ready.
    snapshot_wanted: Cell<bool>,
}

impl EngineStorage {
    /// Opens (or creates) the log in `dir`.
    pub fn open(dir: &Path) -> Result<Self, StorageError> {
        let cfg = EngineConfig {
            dir: dir.to_string_lossy().into_owned(),
            target_file_size: ReadableSize(limits::ENGINE_FILE_BYTES_TARGET),
            purge_threshold: ReadableSize(limits::ENGINE_PURGE_THRESHOLD_BYTES),
            recovery_threads: 1,
            ..Default::default()
        };
        let engine_err = |action| {
            let dir = dir.to_path_buf();
            move |source| StorageError::Engine {
                dir,
                action,
                source,
            }
        };
        let engine = Engine::open(cfg).map_err(engine_err("open"))?;
        let hard_state = engine
            .get_message::<HardState>(GROUP, KEY_HARD_STATE)
            .map_err(engine_err("read the hard state"))?
            .unwrap_or_default();
        let snapshot_meta = engine
            .get_message::<SnapshotMetadata>(GROUP, KEY_SNAPSHOT_META)
            .map_err(engine_err("read the snapshot metadata"))?
            .unwrap_or_default();
        let (truncated_index, truncated_term) = match engine.get(GROUP, KEY_TRUNCATED) {
            Some(v) => decode_pair(&v).ok_or_else(|| StorageError::Corrupt {
                dir: dir.to_path_buf(),
                reason: format!("`truncated` has {} bytes, not 16", v.len()),
            })?,
            None => (0, 0),
        };
        let mut s = EngineStorage {
            dir: dir.to_path_buf(),
            engine,
            hard_state,
            snapshot_meta,
            truncated_index,
            truncated_term,
            terms: VecDeque::new(),
            snapshot_wanted: Cell::new(false),
        };
        s.load_terms()?;
        s.check_open_invariants()?;
        Ok(s)
    }

    fn load_terms(&mut self) -> Result<(), StorageError> {
        let (Some(first), Some(last)) = (
            self.engine.first_index(GROUP),
            self.engine.last_index(GROUP),
        ) else {
            return Ok(());
        };
        if first != self.truncated_index + 1 {
            return Err(self.corrupt(format!(
                "entries start at {first} but the log is truncated at {}",
                self.truncated_index
            )));
        }
        let mut next = first;
        let mut buf = Vec::new();
        while next <= last {
            buf.clear();
            self.engine
                .fetch_entries_to::<EntryExt>(
                    GROUP,
                    next,
                    last + 1,
                    Some(OPEN_FETCH_BYTES),
                    &mut buf,
                )
                .map_err(|source| self.engine_error("read entries", source))?;
            if buf.is_empty() {
                return Err(self.corrupt(format!("entry {next} is missing")));
            }
            for e in &buf {
                self.terms.push_back(e.term);
            }
            next += buf.len() as u64;
        }
        Ok(())
    }

    fn check_open_invariants(&self) -> Result<(), StorageError> {
        let snap = self.snapshot_meta.index;
        if self.truncated_index > snap {
            return Err(self.corrupt(format!(
                "truncated at {} past the snapshot at {snap}",
                self.truncated_index
            )));
        }
        if self.hard_state.commit < snap {
            return Err(self.corrupt(format!(
                "commit {} is before the snapshot at {snap}",
                self.hard_state.commit
            )));
        }
        if self.hard_state.commit > self.last_index_inner() {
            return Err(self.corrupt(format!(
                "commit {} is past the last entry {}",
                self.hard_state.commit,
                self.last_index_inner()
            )));
        }
        Ok(())
    }

    /// Whether this log belongs to a node that was ever part of a group.
    pub fn is_initialized(&self) -> bool {
        self.snapshot_meta.index > 0 || self.hard_state != HardState::default()
    }

    /// Writes the snapshot a new pool starts from: `state` at index 1, configuration `conf`.
    pub(crate) fn bootstrap(
        &mut self,
        conf: ConfState,
        state: Vec<u8>,
    ) -> Result<(), StorageError> {
        let mut meta = SnapshotMetadata {
            index: BOOTSTRAP_INDEX,
            term: BOOTSTRAP_TERM,
            ..Default::default()
        };
        meta.set_conf_state(conf);
        let hs = HardState {
            term: BOOTSTRAP_TERM,
            commit: BOOTSTRAP_INDEX,
            ..Default::default()
        };
        let mut batch = LogBatch::default();
        self.put_snapshot(&mut batch, &meta, state)?;
        put_message(&mut batch, KEY_HARD_STATE, &hs, self)?;
        batch
            .put(
                GROUP,
                KEY_TRUNCATED.to_vec(),
                encode_pair(BOOTSTRAP_INDEX, BOOTSTRAP_TERM),
            )
            .map_err(|source| self.engine_error("encode", source))?;
        self.write(&mut batch, true, "write the bootstrap snapshot")?;
        self.snapshot_meta = meta;
        self.hard_state = hs;
        self.truncated_index = BOOTSTRAP_INDEX;
        self.truncated_term = BOOTSTRAP_TERM;
        Ok(())
    }

    /// Appends entries from a Ready (replacing any conflicting tail) and stores the hard
    /// state, in one write; `sync` makes it durable before returning.
    pub(crate) fn append(
        &mut self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
        sync: bool,
    ) -> Result<(), StorageError> {
        if entries.is_empty() && hard_state.is_none() {
            return Ok(());
        }
        if let Some(first) = entries.first() {
            let last = self.last_index_inner();
            if first.index <= self.truncated_index || first.index > last + 1 {
                return Err(self.corrupt(format!(
                    "append at {} does not fit a log of ({}, {last}]",
                    first.index, self.truncated_index
                )));
            }
        }
        let mut batch = LogBatch::with_capacity(entries.len() + 1);
        batch
            .add_entries::<EntryExt>(GROUP, entries)
            .map_err(|source| self.engine_error("encode entries", source))?;
        if let Some(hs) = hard_state {
            put_message(&mut batch, KEY_HARD_STATE, hs, self)?;
        }
        self.write(&mut batch, sync, "append entries")?;
        if let Some(first) = entries.first() {
            let keep = (first.index - self.truncated_index - 1) as usize;
            self.terms.truncate(keep);
            self.terms.extend(entries.iter().map(|e| e.term));
        }
        if let Some(hs) = hard_state {
            self.hard_state = hs.clone();
        }
        Ok(())
    }

    /// Records a new commit index (not synced: a lower commit after a crash is safe, Raft
    /// learns it again from the leader).
    pub(crate) fn set_commit(&mut self, commit: u64) -> Result<(), StorageError> {
        if commit <= self.hard_state.commit {
            return Ok(());
        }
        let mut hs = self.hard_state.clone();
        hs.commit = commit;
        self.append(&[], Some(&hs), false)
    }

    /// Installs a snapshot received from the leader: drops every entry, stores the
    /// snapshot, and records it as the truncation point. Synced.
    pub(crate) fn install_snapshot(&mut self, snap: &Snapshot) -> Result<(), StorageError> {
        let meta = snap.get_metadata().clone();
        let mut hs = self.hard_state.clone();
        hs.term = hs.term.max(meta.term);
        // raft-rs only installs a snapshot past its commit index.
        debug_assert!(meta.index >= hs.commit);
        hs.commit = meta.index;
        let mut batch = LogBatch::default();
        // Clean removes the whole group (entries and keys); the keys are rewritten below,
        // in the same batch, so a crash leaves the old log or the new one.
        batch.add_command(GROUP, Command::Clean);
        self.put_snapshot(&mut batch, &meta, snap.data.to_vec())?;
        put_message(&mut batch, KEY_HARD_STATE, &hs, self)?;
        batch
            .put(
                GROUP,
                KEY_TRUNCATED.to_vec(),
                encode_pair(meta.index, meta.term),
            )
            .map_err(|source| self.engine_error("encode", source))?;
        self.write(&mut batch, true, "install a snapshot")?;
        self.truncated_index = meta.index;
        self.truncated_term = meta.term;
        self.terms.clear();
        self.snapshot_meta = meta;
        self.hard_state = hs;
        Ok(())
    }

    /// Stores a snapshot of the local state machine and drops the entries before
    /// `compact_to` (which must be at most `meta.index + 1`). Synced.
    pub(crate) fn save_snapshot(
        &mut self,
        meta: SnapshotMetadata,
        data: Vec<u8>,
        compact_to: u64,
    ) -> Result<(), StorageError> {
        debug_assert!(compact_to <= meta.index + 1);
        let compact_to = compact_to.min(meta.index + 1);
        let mut batch = LogBatch::default();
        self.put_snapshot(&mut batch, &meta, data)?;
        let mut hs = self.hard_state.clone();
        hs.commit = hs.commit.max(meta.index);
        put_message(&mut batch, KEY_HARD_STATE, &hs, self)?;
        let new_truncated = if compact_to > self.truncated_index + 1 {
            let index = compact_to - 1;
            let term = self
                .term_inner(index)
                .ok_or_else(|| self.corrupt(format!("no term for entry {index}")))?;
            batch
                .put(GROUP, KEY_TRUNCATED.to_vec(), encode_pair(index, term))
                .map_err(|source| self.engine_error("encode", source))?;
            batch.add_command(GROUP, Command::Compact { index: compact_to });
            Some((index, term))
        } else {
            None
        };
        self.write(&mut batch, true, "save a snapshot")?;
        if let Some((index, term)) = new_truncated {
            let dropped = (index - self.truncated_index) as usize;
            self.terms.drain(..dropped.min(self.terms.len()));
            self.truncated_index = index;
            self.truncated_term = term;
        }
        self.snapshot_meta = meta;
        self.hard_state = hs;
        // Reclaim log files that hold only compacted entries. The groups it names for
        // compaction can only be ours, and we just compacted.
        if let Err(e) = self.engine.purge_expired_files() {
            tracing::warn!(dir = %self.dir.display(), error = %e, "raft-engine purge failed");
        }
        Ok(())
    }

    /// Writes the hard state again, synced: whether the log takes writes now. A log on a
    /// full disk opens (reading needs no space) and fails only at its next write, so check
    /// this before rebuilding a node from a log that failed (then drop this storage: the
    /// directory is locked while it is open).
    pub fn check_writable(&mut self) -> Result<(), StorageError> {
        let mut batch = LogBatch::default();
        put_message(&mut batch, KEY_HARD_STATE, &self.hard_state, self)?;
        self.write(
            &mut batch,
            true,
            "write the hard state (a check that the log takes writes)",
        )
    }

    /// Whether raft-rs asked for a snapshot newer than the stored one (and clears it).
    pub(crate) fn take_snapshot_wanted(&self) -> bool {
        self.snapshot_wanted.replace(false)
    }

    /// Index of the latest snapshot (0: none).
    pub fn snapshot_index(&self) -> u64 {
        self.snapshot_meta.index
    }

    /// The latest snapshot's state-machine bytes.
    pub(crate) fn snapshot_data(&self) -> Vec<u8> {
        self.engine
            .get(GROUP, KEY_SNAPSHOT_DATA)
            .unwrap_or_default()
    }

    /// The persisted hard state.
    pub fn hard_state(&self) -> &HardState {
        &self.hard_state
    }

    fn put_snapshot(
        &self,
        batch: &mut LogBatch,
        meta: &SnapshotMetadata,
        data: Vec<u8>,
    ) -> Result<(), StorageError> {
        put_message(batch, KEY_SNAPSHOT_META, meta, self)?;
        batch
            .put(GROUP, KEY_SNAPSHOT_DATA.to_vec(), data)
            .map_err(|source| self.engine_error("encode", source))
    }

    fn write(
        &self,
        batch: &mut LogBatch,
        sync: bool,
        action: &'static str,
    ) -> Result<(), StorageError> {
        #[cfg(feature = "failpoints")]
        self.injected_failure(action)?;
        self.engine
            .write(batch, sync)
            .map(|_| ())
            .map_err(|source| self.engine_error(action, source))
    }

    /// The failpoint `spillway-meta::storage::write` (feature `failpoints`): configured
    /// with `return`, every write fails as on a full disk; with `return(DIR)`, only the
    /// writes of logs under DIR.
    #[cfg(feature = "failpoints")]
    fn injected_failure(&self, action: &'static str) -> Result<(), StorageError> {
        fail::fail_point!("spillway-meta::storage::write", |only: Option<String>| {
            if only.is_some_and(|d| !self.dir.starts_with(d)) {
                return Ok(());
            }
            let full = std::io::Error::from(std::io::ErrorKind::StorageFull);
            Err(self.engine_error(action, raft_engine::Error::Io(full)))
        });
        Ok(())
    }

    fn last_index_inner(&self) -> u64 {
        self.truncated_index + self.terms.len() as u64
    }

    fn term_inner(&self, idx: u64) -> Option<u64> {
        if idx == self.truncated_index {
            return Some(self.truncated_term);
        }
        if idx < self.truncated_index {
            return None;
        }
        self.terms
            .get((idx - self.truncated_index - 1) as usize)
            .copied()
    }

    fn engine_error(&self, action: &'static str, source: raft_engine::Error) -> StorageError {
        StorageError::Engine {
            dir: self.dir.clone(),
            action,
            source,
        }
    }

    fn corrupt(&self, reason: String) -> StorageError {
        StorageError::Corrupt {
            dir: self.dir.clone(),
            reason,
        }
    }
}

fn put_message<M: protobuf::Message>(
    batch: &mut LogBatch,
    key: &[u8],
    msg: &M,
    s: &EngineStorage,
) -> Result<(), StorageError> {
    batch
        .put_message(GROUP, key.to_vec(), msg)
        .map_err(|source| s.engine_error("encode", source))
}

fn encode_pair(a: u64, b: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(16);
    v.extend_from_slice(&a.to_le_bytes());
    v.extend_from_slice(&b.to_le_bytes());
    v
}

fn decode_pair(v: &[u8]) -> Option<(u64, u64)> {
    if v.len() != 16 {
        return None;
    }
    Some((
        u64::from_le_bytes(v[..8].try_into().ok()?),
        u64::from_le_bytes(v[8..].try_into().ok()?),
    ))
}

fn store_error(e: StorageError) -> raft::Error {
    raft::Error::Store(raft::StorageError::Other(Box::new(e)))
}

impl Storage for EngineStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState {
            hard_state: self.hard_state.clone(),
            conf_state: self.snapshot_meta.get_conf_state().clone(),
        })
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.truncated_index {
            return Err(raft::Error::Store(raft::StorageError::Compacted));
        }
        if high > self.last_index_inner() + 1 {
            return Err(raft::Error::Store(raft::StorageError::Unavailable));
        }
        let mut out = Vec::with_capacity((high - low) as usize);
        if low == high {
            return Ok(out);
        }
        let max_size = max_size.into().map(|s| s as usize);
        self.engine
            .fetch_entries_to::<EntryExt>(GROUP, low, high, max_size, &mut out)
            .map_err(|source| store_error(self.engine_error("read entries", source)))?;
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx < self.truncated_index {
            return Err(raft::Error::Store(raft::StorageError::Compacted));
        }
        self.term_inner(idx)
            .ok_or(raft::Error::Store(raft::StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.truncated_index + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last_index_inner())
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        let cs = self.snapshot_meta.get_conf_state();
        let knows_recipient = [
            &cs.voters,
            &cs.learners,
            &cs.voters_outgoing,
            &cs.learners_next,
        ]
        .iter()
        .any(|ids| ids.contains(&to));
        // A follower refuses a snapshot whose configuration does not contain it.
        if self.snapshot_meta.index < request_index || !knows_recipient {
            self.snapshot_wanted.set(true);
            return Err(raft::Error::Store(
                raft::StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        let mut snap = Snapshot::default();
        snap.set_metadata(self.snapshot_meta.clone());
        snap.data = self.snapshot_data().into();
        Ok(snap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            data: vec![index as u8; 10].into(),
            ..Default::default()
        }
    }

    #[test]
    fn entries_survive_reopen_and_tails_are_replaced() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut s = EngineStorage::open(dir.path()).unwrap();
            assert!(!s.is_initialized());
            s.bootstrap(ConfState::from((vec![1, 2, 3], vec![])), b"state".to_vec())
                .unwrap();
            let ents: Vec<_> = (2..=6).map(|i| entry(i, 1)).collect();
            s.append(&ents, None, true).unwrap();
            // A new leader's entries replace the tail from 5 on.
            s.append(&[entry(5, 2)], None, true).unwrap();
            assert_eq!(s.last_index().unwrap(), 5);
            assert_eq!(s.term(5).unwrap(), 2);
            let mut hs = s.hard_state().clone();
            hs.commit = 5;
            hs.term = 2;
            s.append(&[], Some(&hs), true).unwrap();
        }
        let s = EngineStorage::open(dir.path()).unwrap();
        assert!(s.is_initialized());
        assert_eq!(s.first_index().unwrap(), 2);
        assert_eq!(s.last_index().unwrap(), 5);
        assert_eq!(s.term(1).unwrap(), 1);
        assert_eq!(s.term(5).unwrap(), 2);
        let got = s
            .entries(2, 6, None, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(got.len(), 4);
        assert_eq!(got[3].term, 2);
        assert_eq!(s.initial_state().unwrap().conf_state.voters, vec![1, 2, 3]);
        assert_eq!(s.snapshot(0, 2).unwrap().data.as_ref(), b"state");
    }

    #[test]
    fn snapshots_compact_and_install() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = EngineStorage::open(dir.path()).unwrap();
        s.bootstrap(ConfState::from((vec![1], vec![])), b"s0".to_vec())
            .unwrap();
        let ents: Vec<_> = (2..=20).map(|i| entry(i, 1)).collect();
        let mut hs = s.hard_state().clone();
        hs.commit = 16;
        s.append(&ents, Some(&hs), true).unwrap();
        let mut meta = SnapshotMetadata {
            index: 15,
            term: 1,
            ..Default::default()
        };
        meta.set_conf_state(ConfState::from((vec![1], vec![])));
        s.save_snapshot(meta, b"s15".to_vec(), 11).unwrap();
        assert_eq!(s.first_index().unwrap(), 11);
        assert_eq!(s.term(10).unwrap(), 1);
        assert!(
            s.entries(5, 12, None, GetEntriesContext::empty(false))
                .is_err()
        );
        drop(s);

        let mut s = EngineStorage::open(dir.path()).unwrap();
        assert_eq!(s.first_index().unwrap(), 11);
        assert_eq!(s.last_index().unwrap(), 20);
        assert_eq!(s.snapshot_index(), 15);

        // A snapshot from the leader replaces everything, including entries after it.
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 17;
        snap.mut_metadata().term = 3;
        snap.mut_metadata()
            .set_conf_state(ConfState::from((vec![1, 2], vec![])));
        snap.data = b"s17".to_vec().into();
        s.install_snapshot(&snap).unwrap();
        assert_eq!(s.first_index().unwrap(), 18);
        assert_eq!(s.last_index().unwrap(), 17);
        s.append(&[entry(18, 3)], None, true).unwrap();
        drop(s);
        let s = EngineStorage::open(dir.path()).unwrap();
        assert_eq!(s.first_index().unwrap(), 18);
        assert_eq!(s.last_index().unwrap(), 18);
        assert_eq!(s.term(17).unwrap(), 3);
        assert_eq!(s.snapshot(0, 1).unwrap().data.as_ref(), b"s17");
        assert_eq!(s.initial_state().unwrap().conf_state.voters, vec![1, 2]);
        assert_eq!(s.hard_state().commit, 17);
    }
}
