//! The whole pool in one process, from a seed: `spillway chaos sim`.
//!
//! What runs: N nodes (3 to 5, chosen by the seed), each with
//! - its member of the metadata group: spillway-meta's Raft node with its durable log in
//!   a real raft-engine directory ([`spillway_meta::sim::SimCluster`]), its failure
//!   detector and its incarnation announcement;
//! - its host tier, the real [`HostStore`], serving peers' page requests;
//! - its remote tier's brain, the real [`crate::placement::Placement`], driven by
//!   [`driver`] through spills, fetches, discards, re-replication, pending deletes and
//!   reservation reconciliation in the order `remote::RemoteService` drives it;
//! - two local clients: a scripted one that writes a page (a new version), spills it,
//!   fetches it back and checks every byte, discards some; and one running the real core
//!   (`spillway_core::PoolCore`, [`core_client`]) in a training-like loop.
//!
//! One seeded scheduler ([`world::World`]) merges the Raft cluster's events (ticks,
//! deliveries) with the page network's and the fault timers, on one simulated clock.
//! Nothing reads the wall clock or a thread's timing, so a seed replays the same run: the
//! same event log, hashed into [`RunReport::log_hash`].
//!
//! Faults ([`faults`]): page and Raft messages lost, delayed (reordered) and duplicated;
//! partitions (a node isolated, one-way in or out, a node cut from the leader only, a
//! minority split off); crashes with a torn write at the log's tail, then restarts;
//! pauses (a stopped process: its messages wait, its Raft peers hear nothing); clocks
//! skewed or stopped; slow log disks.
//!
//! Invariants ([`oracle`]), checked after every event (budgets) or every operation (the
//! rest), and at the end after every fault healed:
//! - no acknowledged page is lost while fewer than `replicas` nodes went down within the
//!   repair bound ([`REPAIR_BOUND_MS`]);
//! - every page read back has the bytes of its latest acknowledged write (no stale copy
//!   served after a fence, no corrupt one);
//! - no host store holds more than its budget;
//! - the Raft states agree (nodes that applied the same index hold the same state, and
//!   each passes its own invariant checks);
//! - the directory agrees with the holders: a live record of an acknowledged page names a
//!   holder that has its bytes;
//! - progress: within [`ChaosConfig::progress_bound_ms`] after the faults heal, every node
//!   is back, every page not lost reads back and has its `replicas` copies, and every
//!   client spills again.
//!
//! What is simplified, and said here so no one reads more into a green run: the clients'
//! operations run one at a time across the pool (background work — Raft, detection,
//! message delivery, faults — runs during them); a page's bytes are short (the page size
//! is the pool's, the data a few KiB); a pause stops the node's page traffic but its Raft
//! node still ticks (cut off from its peers); disks are real and fast, a slow one
//! modelled by delaying what its node sends (fsync costs wall time, not simulated time).

mod core_client;
mod driver;
pub mod faults;
mod oracle;
#[cfg(test)]
mod tests;
mod world;

use std::path::Path;
use std::time::Instant;

use bytes::Bytes;
use serde::Serialize;
use spillway_meta::rng::SimRng;

pub use faults::{Fault, FaultMix, ScheduledFault};

use crate::store::HostStore;

/// A page lost when fewer than `replicas` nodes went down within this long before is a
/// violation: 15 s, time for the detector to declare a node down (2 s) and for the
/// owner to copy the page again (a few paced repair rounds).
pub const REPAIR_BOUND_MS: u64 = 15_000;

/// How a simulation runs.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    /// Nodes in the pool; 0: 3 to 5, chosen by the seed.
    pub nodes: u64,
    /// Copies of each page (the nodes' `replicas`).
    pub replicas: u8,
    /// Simulated length of the workload under faults: 60 s (then every fault heals and
    /// the end checks run, within [`ChaosConfig::progress_bound_ms`]).
    pub length_ms: u64,
    /// Which faults are injected.
    pub faults: FaultMix,
    /// Simulated time allowed after every fault healed for the pool to serve every page
    /// again with all its copies: 60 s.
    pub progress_bound_ms: u64,
    /// Keep the full event log in the report (`--seed S` prints it).
    pub keep_log: bool,
}

impl Default for ChaosConfig {
    fn default() -> Self {
        ChaosConfig {
            nodes: 0,
            replicas: 2,
            length_ms: 60_000,
            faults: FaultMix::all(),
            progress_bound_ms: 60_000,
            keep_log: false,
        }
    }
}

/// What an invariant violation is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationKind {
    /// An acknowledged page is held by no node, although fewer than `replicas` nodes went
    /// down within [`REPAIR_BOUND_MS`].
    PageLost,
    /// A read returned other bytes than the page's latest acknowledged write.
    WrongBytes,
    /// A host store holds more than its budget.
    BudgetExceeded,
    /// Two nodes that applied the same index hold different states, or a state broke its
    /// own invariants.
    RaftDiverged,
    /// A live directory record names a holder that lacks the page's bytes.
    DirectoryDisagrees,
    /// After every fault healed, the pool did not serve every page with all its copies
    /// within the bound.
    NoProgress,
    /// A node could not reopen its log after a crash.
    RestartFailed,
}

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// Simulated time, ms.
    pub at_ms: u64,
    /// What broke.
    pub kind: ViolationKind,
    /// The pages, nodes and values involved.
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "at {} ms: {:?}: {}", self.at_ms, self.kind, self.detail)
    }
}

/// Counts of one run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RunCounts {
    /// Events processed (Raft ticks and deliveries, page messages, fault timers).
    pub events: u64,
    /// Spills acknowledged / failed.
    pub spills_ok: u64,
    /// Spills that failed (the client keeps the page).
    pub spills_failed: u64,
    /// Fetches that returned every page.
    pub fetches_ok: u64,
    /// Fetches that failed (the pages stay in the remote tier).
    pub fetches_failed: u64,
    /// Discards acknowledged.
    pub discards_ok: u64,
    /// Accesses of the clients running the real core (acquire, compare or write,
    /// release).
    pub core_acquires: u64,
    /// Buffers the core clients lost (a fetch failed) where the loss rule allowed it.
    pub core_buffers_lost_allowed: u64,
    /// Spills and discards refused while a repair batch held one of their pages (the
    /// client tries again later; the tokio driver waits).
    pub ops_waited: u64,
    /// Pages read back and compared byte for byte.
    pub pages_verified: u64,
    /// Pages lost with every copy's holder down (allowed: `replicas` or more nodes went
    /// down within the repair bound).
    pub pages_lost_allowed: u64,
    /// Copies made again by re-replication.
    pub pages_repaired: u64,
    /// Faults injected.
    pub faults: u64,
    /// Node crashes (each followed by a restart).
    pub crashes: u64,
    /// Of those, crashes at a failpoint (feature `failpoints`, action `panic`).
    pub failpoint_crashes: u64,
}

/// What one seed's run found.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// The seed.
    pub seed: u64,
    /// Nodes in the pool.
    pub nodes: u64,
    /// Simulated time, ms.
    pub sim_ms: u64,
    /// Wall-clock time, ms.
    pub wall_ms: u64,
    /// Counts.
    pub counts: RunCounts,
    /// The faults injected, in order.
    pub faults: Vec<ScheduledFault>,
    /// Broken invariants (empty: the run passed).
    pub violations: Vec<Violation>,
    /// Hash of the event log: equal for two runs of one seed.
    pub log_hash: u64,
    /// The event log, when [`ChaosConfig::keep_log`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub log: Vec<String>,
}

impl RunReport {
    /// Whether every invariant held.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Why a run could not be made at all (not a violation: the harness itself failed).
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    /// The simulated cluster could not start.
    #[error("cannot start the simulated cluster: {0}")]
    Start(#[from] spillway_meta::MetaError),
    /// The run's directory could not be made.
    #[error("cannot make the run's directory {path}: {source}")]
    Dir {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Runs the pool from `seed` with the faults the seed chooses; the logs go under `root`
/// (one directory per node, removed by the caller).
pub fn run(seed: u64, config: &ChaosConfig, root: &Path) -> Result<RunReport, ChaosError> {
    run_with(seed, config, root, None)
}

/// Runs the pool from `seed` with `faults` instead of the seed's own (the workload and
/// the network's randomness stay the seed's): for shrinking a failing run.
pub fn run_with(
    seed: u64,
    config: &ChaosConfig,
    root: &Path,
    faults: Option<Vec<ScheduledFault>>,
) -> Result<RunReport, ChaosError> {
    std::fs::create_dir_all(root).map_err(|source| ChaosError::Dir {
        path: root.to_path_buf(),
        source,
    })?;
    let started = Instant::now();
    let mut world = world::World::new(seed, config, root, faults)?;
    world.run();
    Ok(world.report(started.elapsed().as_millis() as u64))
}

/// The smallest fault list (greedily: each fault removed in turn, kept out while the run
/// still fails with a violation of the same kind) that still breaks `report`'s run.
/// Runs the seed up to once per fault; each run's logs go under `root`.
pub fn shrink(
    report: &RunReport,
    config: &ChaosConfig,
    root: &Path,
) -> Result<RunReport, ChaosError> {
    let Some(kind) = report.violations.first().map(|v| v.kind) else {
        return Ok(report.clone());
    };
    let mut best = report.clone();
    let mut i = 0;
    while i < best.faults.len() {
        let mut fewer = best.faults.clone();
        fewer.remove(i);
        let dir = root.join(format!("shrink-{}", best.faults.len()));
        let tried = run_with(report.seed, config, &dir, Some(fewer));
        let _ = std::fs::remove_dir_all(&dir);
        let tried = tried?;
        if tried.violations.iter().any(|v| v.kind == kind) {
            best = tried;
        } else {
            i += 1;
        }
    }
    let mut keep = config.clone();
    keep.keep_log = true;
    let dir = root.join("shrunk");
    let last = run_with(report.seed, &keep, &dir, Some(best.faults.clone()));
    let _ = std::fs::remove_dir_all(&dir);
    last
}

/// A node's host store of `budget_bytes` for pages of `page_bytes`.
fn host_store(budget_bytes: u64, page_bytes: u64) -> HostStore {
    let size = spillway_types::PageSize::new(page_bytes).expect("the simulation's page size");
    HostStore::new(budget_bytes, size)
}

/// `len` bytes drawn from `rng`: the simulated clients' page contents.
fn random_bytes(rng: &mut SimRng, len: usize) -> Bytes {
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len);
    Bytes::from(out)
}
