//! The harness can fail: with a deliberately broken build (the failpoint
//! `spillway-node::store::put` acknowledges some puts without storing them, the effect of
//! a replica's acknowledgement dropped), `spillway chaos sim` finds a broken invariant
//! within its first seeds; with the failpoint off, the same seeds pass.
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

#[test]
fn a_put_acknowledged_and_not_stored_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = fail::FailScenario::setup();
    // Every put whose first page has index 5 is acknowledged and dropped.
    fail::cfg("spillway-node::store::put", "return(5)").unwrap();
    let mut caught = None;
    for seed in SEEDS {
        let r = chaos::run(seed, &config(), &dir.path().join(format!("broken-{seed}"))).unwrap();
        if let Some(v) = r.violations.first() {
            caught = Some((seed, v.clone()));
            break;
        }
    }
    fail::remove("spillway-node::store::put");
    let (seed, v) = caught.expect("the broken build passed every seed");
    eprintln!("caught at seed {seed}: {v}");
    assert!(
        matches!(
            v.kind,
            ViolationKind::PageLost | ViolationKind::DirectoryDisagrees | ViolationKind::NoProgress
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
