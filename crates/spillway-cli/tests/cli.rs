//! Black-box tests of the `spillway` binary.

use std::process::Command;

use serde_json::Value;

fn spillway(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args(args)
        .output()
        .expect("run spillway")
}

const SMALL: &[&str] = &[
    "--layers",
    "8",
    "--weight-mib",
    "1",
    "--act-mib",
    "1",
    "--page-kib",
    "256",
    "--steps",
    "4",
    "--compute-passes",
    "16",
    "--device",
    "sim",
];

#[test]
fn demo_json_has_every_field_and_verifies_every_page() {
    let mut args = vec!["demo", "--json"];
    args.extend_from_slice(SMALL);
    let out = spillway(&args);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert_eq!(v["device"], "sim");
    assert_eq!(v["page_bytes"], 256 << 10);
    let ws = v["working_set_bytes"].as_u64().unwrap();
    assert_eq!(ws, 16 << 20);
    assert!(v["gpu_budget_bytes"].as_u64().unwrap() * 3 <= ws, "the working set is at least 3x the budget");
    assert_eq!(v["corrupt_pages"], 0);
    assert!(v["verified_bytes"].as_u64().unwrap() >= ws * 4);
    let steps = v["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4);
    for s in steps {
        for key in ["step", "wall_s", "stall_s", "acquires", "hits"] {
            assert!(s.get(key).is_some(), "step lacks {key}: {s}");
        }
        assert_eq!(s["acquires"], 32);
    }
}

#[test]
fn demo_diverge_flag_marks_the_step() {
    let mut args = vec!["demo", "--json", "--diverge-step", "3"];
    args.extend_from_slice(SMALL);
    let out = spillway(&args);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let steps = v["steps"].as_array().unwrap();
    assert_eq!(steps[2]["diverged"], true);
    assert_eq!(steps[2]["acquires"], 28);
    assert_eq!(v["corrupt_pages"], 0);
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = spillway(&["demo", "--page-kib", "100", "--device", "sim"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("power of two"), "{err}");
    let out = spillway(&["demo", "--policy", "lru"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown policy"));
    let out = spillway(&["demo", "--gpu-budget-mib", "0", "--device", "sim"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("gpu_budget_bytes"));
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_a_clear_error() {
    let out = spillway(&["demo", "--device", "cuda", "--steps", "1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--features cuda"));
}

#[test]
fn offload_bench_json_has_every_variant() {
    let dir = std::env::temp_dir().join(format!("spillway-offload-{}", std::process::id()));
    let mut args = vec!["bench", "offload", "--json", "--out", dir.to_str().unwrap()];
    args.extend_from_slice(SMALL);
    let out = spillway(&args);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let floor = v["floor_s"].as_f64().unwrap();
    assert!(floor > 0.0);
    let names: Vec<&str> = v["variants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["resident", "copy_only", "on_demand", "clock", "learned"]
    );
    for x in v["variants"].as_array().unwrap() {
        let ratio = x["ratio_to_floor"].as_f64().unwrap();
        assert!((ratio - x["step_s_median"].as_f64().unwrap() / floor).abs() < 1e-9);
        assert!(x["hit_rate"].as_f64().is_some());
        assert_eq!(x["corrupt_pages"], 0);
    }
    assert!(
        std::fs::read_to_string(dir.join("offload.svg"))
            .unwrap()
            .contains("<svg")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
