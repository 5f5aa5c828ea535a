//! `spillway chaos sim` as a user runs it: seeds pass and report their figures, one seed
//! replays with its event log and the same hash, bad arguments are refused in one line.

use std::process::Command;

fn spillway(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args(args)
        .output()
        .expect("run spillway")
}

#[test]
fn seeds_pass_and_report_their_figures_as_json() {
    let out = spillway(&["chaos", "sim", "--seeds", "3", "--length-s", "20", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["seeds"], 3);
    assert_eq!(v["passed"], 3);
    assert_eq!(v["failed"].as_array().unwrap().len(), 0);
    assert!(v["pages_verified"].as_u64().unwrap() > 100, "{v}");
    assert!(v["faults"].as_u64().unwrap() > 0, "{v}");
    assert!(v["sim_over_wall"].as_f64().unwrap() > 1.0, "{v}");
    assert!(v["commit"].as_str().is_some_and(|c| !c.is_empty()));
}

#[test]
fn one_seed_replays_with_its_event_log() {
    let run = || {
        let out = spillway(&["chaos", "sim", "--seed", "42", "--length-s", "15"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let (a, b) = (run(), run());
    assert!(a.contains("every invariant held"), "{a}");
    assert!(a.contains(" spilled ") && a.contains(" fetched "), "{a}");
    // The same seed, the same events (wall time aside).
    let events = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| !l.contains("simulated in"))
            .map(String::from)
            .collect()
    };
    assert_eq!(events(&a), events(&b));
}

#[test]
fn bad_arguments_are_refused() {
    let out = spillway(&["chaos", "sim", "--nodes", "2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--nodes"), "{err}");
    let out = spillway(&["chaos", "sim", "--seed", "1", "--seeds", "2"]);
    assert!(!out.status.success());
}
