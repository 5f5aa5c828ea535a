//! A node crashes at each failpoint (feature `failpoints`, action `panic`) inside the
//! whole-pool simulation (`spillway_node::chaos`): its Raft member before applying,
//! before and after persisting, before marking what it applied; its remote tier with
//! reservations granted, between replica writes, before a spill's acknowledgement, in a
//! discard, in a repair scan and after a repair's placement, on a fetch's reply and on its
//! completion; its host store in a put. The node restarts 2 s later; the run must end
//! with every invariant held: no acknowledged page lost, every page read back with its
//! bytes, the directory in agreement with the holders, every page with its copies.
//!
//! Run: `cargo test --release -p spillway-node --features failpoints --test chaos_failpoints`.

use spillway_node::chaos::{self, ChaosConfig, FaultMix};

/// (failpoint, hits let through before the crash, whether crashes by the fault schedule
/// are needed for it to be reached: repairs follow a holder's death).
const POINTS: &[(&str, u32, bool)] = &[
    ("spillway-meta::ready::before-apply", 300, false),
    ("spillway-meta::ready::before-persist", 300, false),
    ("spillway-meta::ready::after-persist", 300, false),
    ("spillway-meta::ready::before-advance-apply", 200, false),
    ("spillway-node::spill::reserved", 3, false),
    ("spillway-node::spill::between-replica-writes", 40, false),
    ("spillway-node::spill::before-ack", 20, false),
    ("spillway-node::discard::forget", 5, false),
    ("spillway-node::repair::scan", 10, true),
    ("spillway-node::repair::placed", 0, true),
    ("spillway-node::fetch::reply", 30, false),
    ("spillway-node::fetch::complete", 20, false),
    ("spillway-node::store::put", 50, false),
];

#[test]
fn a_crash_at_every_failpoint_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = fail::FailScenario::setup();
    let mut report = Vec::new();
    for (i, &(point, after, with_crashes)) in POINTS.iter().enumerate() {
        let config = ChaosConfig {
            length_ms: 30_000,
            faults: if with_crashes {
                FaultMix {
                    crashes: true,
                    ..FaultMix::none()
                }
            } else {
                FaultMix::none()
            },
            keep_log: true,
            ..ChaosConfig::default()
        };
        fail::cfg(point, &format!("{after}*off->1*panic->off")).unwrap();
        let seed = 40 + i as u64;
        let r = chaos::run(seed, &config, &dir.path().join(format!("fp-{i}"))).unwrap();
        fail::remove(point);
        assert_eq!(
            r.counts.failpoint_crashes, 1,
            "{point} (seed {seed}) was not reached: {:?}",
            r.counts
        );
        assert!(
            r.passed(),
            "{point} (seed {seed}): {:#?}\n{}",
            r.violations,
            r.log.join("\n")
        );
        report.push(format!(
            "{point}: crashed once, {} pages verified, {} copies repaired",
            r.counts.pages_verified, r.counts.pages_repaired
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert!(POINTS.len() >= 10);
    scenario.teardown();
}
