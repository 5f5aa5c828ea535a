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
