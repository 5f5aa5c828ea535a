//! The harness can fail: with a deliberately broken build, `spillway chaos sim` finds a
//! broken invariant within its first seeds; with the failpoint off, the same seed
//! passes. Two breaks:
//! - `spillway-node::store::put` acknowledges some puts without storing them (the effect
//!   of a replica's acknowledgement dropped);
//! - `spillway-node::repair::claim` lets a client's spill or discard run while a repair
//!   batch holds its pages (the race `spillway chaos run`'s kill-two found in real
//!   processes, before the simulation interleaved a client's operation with a repair).
//!
//! Run: `cargo test --release -p spillway-node --features failpoints --test chaos_broken`.

use spillway_node::chaos::{self, ChaosConfig, ViolationKind};

const SEEDS: std::ops::Range<u64> = 1..21;

fn config() -> ChaosConfig {
    ChaosConfig {
        length_ms: 30_000,
        ..ChaosConfig::default()
    }
}

/// Runs `SEEDS` with `failpoint` set to `action` until one breaks an invariant, then
/// the same seed without it, which must pass.
fn caught(failpoint: &str, action: &str) {
    let dir = tempfile::tempdir().unwrap();
    let scenario = fail::FailScenario::setup();
    fail::cfg(failpoint, action).unwrap();
    let mut caught = None;
    for seed in SEEDS {
        let r = chaos::run(seed, &config(), &dir.path().join(format!("broken-{seed}"))).unwrap();
        if let Some(v) = r.violations.first() {
            caught = Some((seed, v.clone()));
            break;
        }
    }
    fail::remove(failpoint);
    let (seed, v) = caught.expect("the broken build passed every seed");
    eprintln!("{failpoint}: caught at seed {seed}: {v}");
    assert!(
        matches!(
            v.kind,
            ViolationKind::PageLost
                | ViolationKind::DirectoryDisagrees
                | ViolationKind::NoProgress
                | ViolationKind::WrongBytes
        ),
        "seed {seed}: {v}"
    );
    // The same seed passes with the failpoint off: the harness found the break, not noise.
    let r = chaos::run(seed, &config(), &dir.path().join("fixed")).unwrap();
    assert!(
        r.passed(),
        "seed {seed} without the failpoint: {:?}",
        r.violations
    );
    scenario.teardown();
}

#[test]
fn a_put_acknowledged_and_not_stored_is_caught() {
    // Every put whose first page has index 5 is acknowledged and dropped.
    caught("spillway-node::store::put", "return(5)");
}

#[test]
fn a_spill_racing_a_repair_batch_is_caught() {
    caught("spillway-node::repair::claim", "return");
}
