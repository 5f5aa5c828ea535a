use super::*;

fn root(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("spillway-chaos-{name}-"))
        .tempdir()
        .expect("a temporary directory")
}

fn short(mix: FaultMix) -> ChaosConfig {
    ChaosConfig {
        length_ms: 30_000,
        faults: mix,
        keep_log: true,
        ..ChaosConfig::default()
    }
}

#[test]
fn a_run_without_faults_moves_and_verifies_pages() {
    let dir = root("quiet");
    let r = run(3, &short(FaultMix::none()), dir.path()).unwrap();
    assert!(r.passed(), "{:#?}", r.violations);
    assert!(r.counts.spills_ok > 10, "{:?}", r.counts);
    assert!(r.counts.fetches_ok > 10, "{:?}", r.counts);
    assert!(r.counts.pages_verified > 20, "{:?}", r.counts);
    assert_eq!(r.counts.spills_failed, 0, "{:?}", r.counts);
    assert_eq!(r.counts.faults, 0);
}

#[test]
fn a_seed_replays_the_same_run() {
    let a = run(11, &short(FaultMix::all()), root("a").path()).unwrap();
    let b = run(11, &short(FaultMix::all()), root("b").path()).unwrap();
    assert_eq!(a.log, b.log);
    assert_eq!(a.log_hash, b.log_hash);
    assert_eq!(a.counts, b.counts);
    let c = run(12, &short(FaultMix::all()), root("c").path()).unwrap();
    assert_ne!(a.log_hash, c.log_hash);
}

#[test]
fn seeds_with_every_fault_keep_every_page() {
    for seed in 100..104 {
        let dir = root("faults");
        let r = run(seed, &short(FaultMix::all()), dir.path()).unwrap();
        assert!(r.counts.faults > 0, "seed {seed}: {:?}", r.counts);
        assert!(
            r.passed(),
            "seed {seed}: {:#?}\n{}",
            r.violations,
            r.log.join("\n")
        );
    }
}

/// Found by the clock faults: a node's clock minutes ahead stamped the group's clock
/// forward, and every other node's reservations then expired on arrival, so no spill
/// went through until real time caught up (`NoProgress`: spills must resume once the
/// faults heal). Seed 3's clock faults include one 14.6 minutes ahead.
#[test]
fn spills_go_on_after_a_clock_ran_minutes_ahead() {
    let mix = FaultMix {
        clocks: true,
        ..FaultMix::none()
    };
    let config = ChaosConfig {
        faults: mix,
        keep_log: true,
        ..ChaosConfig::default()
    };
    let r = run(3, &config, root("clock").path()).unwrap();
    let ahead = r
        .faults
        .iter()
        .any(|f| matches!(f.fault, faults::Fault::ClockSkew { skew_ms, .. } if skew_ms > 600_000));
    assert!(ahead, "a clock more than 10 minutes ahead: {:?}", r.faults);
    assert!(r.passed(), "{:#?}", r.violations);
    // Before the fix: 203 spills went through and 973 failed.
    assert!(
        r.counts.spills_failed * 10 < r.counts.spills_ok,
        "{:?}",
        r.counts
    );
}

/// A slow log disk slows the group down and loses nothing; a stopped clock neither.
#[test]
fn slow_disks_and_stopped_clocks_keep_every_page() {
    let mix = FaultMix {
        clocks: true,
        disks: true,
        crashes: true,
        ..FaultMix::none()
    };
    let mut seen = (false, false);
    for seed in 20..26 {
        let r = run(seed, &short(mix), root("disk").path()).unwrap();
        assert!(r.passed(), "seed {seed}: {:#?}", r.violations);
        for f in &r.faults {
            match f.fault {
                faults::Fault::SlowDisk { .. } => seen.0 = true,
                faults::Fault::ClockStop { .. } => seen.1 = true,
                _ => {}
            }
        }
    }
    assert_eq!(seen, (true, true), "both kinds of fault ran");
}
