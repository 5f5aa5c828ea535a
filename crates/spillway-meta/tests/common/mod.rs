//! What the simulation tests share: a cluster on the seeded simulated network, with its
//! logs in a temporary directory.

use spillway_meta::sim::{SimCluster, SimConfig};

/// Simulated time a test waits for anything before it fails.
pub const MAX_MS: u64 = 30_000;

/// A cluster of `SimConfig::new(seed)` with fsync off, changed by `tune`; keep the
/// directory for as long as the cluster runs.
pub fn cluster(seed: u64, tune: impl FnOnce(&mut SimConfig)) -> (SimCluster, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = SimConfig::new(seed);
    // Tests fsync nothing: the file system is real, durability is not what they check,
    // and 2 cores of fsync would dominate the run time. Restart tests still reopen
    // raft-engine from its files.
    config.sync_writes = false;
    tune(&mut config);
    let c = SimCluster::new(config, dir.path()).unwrap();
    (c, dir)
}
