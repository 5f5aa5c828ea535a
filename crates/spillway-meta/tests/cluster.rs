//! Seeded simulations of the metadata group: elections, fail-over, restart, snapshots,
//! membership changes, capacity and fencing. Each test prints its seed when it fails;
//! rerun with `SPILLWAY_SEED=<seed>` to replay it.

use spillway_meta::sim::{SimCluster, SimConfig, seed_from_env};
use spillway_meta::{
    Applied, Batch, Epoch, Extent, MemberState, MembershipChange, NodeId, Rejection, ReservationId,
    Update,
};
use spillway_types::{BufferId, PageId};

const MAX_MS: u64 = 30_000;

fn cluster(seed: u64, tune: impl FnOnce(&mut SimConfig)) -> (SimCluster, tempfile::TempDir) {
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

/// A batch placing `count` one-page extents of `buffer` at `holder`, epoch 1.
fn placements(now_ms: u64, buffer: u64, count: u32, holder: u64) -> Batch {
    let mut b = Batch::new(now_ms);
    for i in 0..count {
        b.push(Update::Place {
            extent: Extent::new(BufferId(buffer), i, 1),
            holder: NodeId(holder),
            epoch: Epoch(1),
            version: 1,
            reservation: None,
        });
    }
    b
}

fn all_ok(applied: &Applied) {
    match applied {
        Applied::Batch { outcomes } => {
            for o in outcomes {
                assert_eq!(o, &Ok(()));
            }
        }
        other => panic!("expected a batch, got {other:?}"),
    }
}

fn page(buffer: u64, index: u32) -> PageId {
    PageId {
        buffer: BufferId(buffer),
        index,
    }
}

#[test]
fn three_nodes_elect_a_leader_and_commit() {
    let (mut c, _dir) = cluster(seed_from_env(1), |_| {});
    let leader = c.wait_for_leader(MAX_MS);
    let applied = c.commit(&placements(c.now_ms(), 1, 100, 2), MAX_MS);
    all_ok(&applied);
    assert!(c.wait_converged(MAX_MS));
    for id in c.live_nodes() {
        let s = c.node(id).state();
        assert_eq!(s.extent_count(), 100, "{id}");
        assert_eq!(s.holder_of(page(1, 42)).unwrap().1.node, NodeId(2));
    }
    c.check_consistency().unwrap();
    assert_eq!(c.leader(), Some(leader));
}
