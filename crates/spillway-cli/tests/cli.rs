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
    assert!(
        v["gpu_budget_bytes"].as_u64().unwrap() * 3 <= ws,
        "the working set is at least 3x the budget"
    );
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

/// Asking for UCX without it is a clear error: without the feature, one naming the
/// feature; with it but without the library, one naming the library (here: a path that
/// does not exist, through SPILLWAY_UCX_LIB).
#[test]
fn ucx_without_the_feature_or_the_library_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args(["demo", "--transport", "ucx", "--steps", "1"])
        .env("SPILLWAY_UCX_LIB", "/nonexistent/libucp.so.0")
        .env("UCX_NET_DEVICES", "lo")
        .output()
        .expect("run spillway");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "ucx") {
        assert!(err.contains("/nonexistent/libucp.so.0"), "{err}");
        assert!(err.contains("libucx0"), "{err}");
    } else {
        assert!(err.contains("--features ucx"), "{err}");
    }
    if !cfg!(feature = "ucx") {
        let out = spillway(&["bench", "remote", "--transport", "ucx"]);
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("--features ucx"));
    }
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

fn trace_path(name: &str) -> String {
    format!("{}/../../bench/traces/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn replay_json_has_the_demo_fields_and_peak_gpu_bytes() {
    let path = trace_path("dense.jsonl");
    let out = spillway(&[
        "replay",
        &path,
        "--json",
        "--time-scale",
        "0.05",
        "--device",
        "sim",
    ]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["corrupt_pages"], 0);
    assert_eq!(v["steps"].as_array().unwrap().len(), 8);
    assert_eq!(v["accesses"], 432);
    let peak = v["gpu_bytes_peak"].as_u64().unwrap();
    assert!(peak > 0 && peak <= v["gpu_budget_bytes"].as_u64().unwrap());
    assert!(
        v["gpu_budget_bytes"].as_u64().unwrap() * 3
            <= v["working_set_bytes"].as_u64().unwrap() + 3 * (256 << 10)
    );
}

#[test]
fn replay_compare_runs_every_policy() {
    let path = trace_path("moe.jsonl");
    let out = spillway(&[
        "replay",
        &path,
        "--compare",
        "--json",
        "--time-scale",
        "0.05",
        "--device",
        "sim",
        "--gpu-budget",
        "16MiB",
    ]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let policies: Vec<&str> = v["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["policy"].as_str().unwrap())
        .collect();
    assert_eq!(policies, ["on_demand", "clock", "learned"]);
    for r in v["runs"].as_array().unwrap() {
        assert_eq!(r["gpu_budget_bytes"], 16 << 20);
        assert_eq!(r["corrupt_pages"], 0);
    }
}

#[test]
fn replay_of_a_malformed_trace_names_the_line() {
    let dir = std::env::temp_dir().join(format!("spillway-bad-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            "bad_json.jsonl",
            "{\"step\": 0, \"buffer\": \"a\", \"bytes\": 10, \"phase\": \"fwd\"}\n{not json\n",
            "line 2",
        ),
        (
            "negative.jsonl",
            "{\"step\": 0, \"buffer\": \"a\", \"bytes\": -5, \"phase\": \"fwd\"}\n",
            "line 1",
        ),
        (
            "resized.jsonl",
            "{\"step\": 0, \"buffer\": \"a\", \"bytes\": 10, \"phase\": \"fwd\"}\n{\"step\": 0, \"buffer\": \"a\", \"bytes\": 11, \"phase\": \"bwd\"}\n",
            "line 2",
        ),
        ("empty.jsonl", "", "no accesses"),
    ];
    for (name, text, expect) in cases {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let out = spillway(&["replay", path.to_str().unwrap(), "--device", "sim"]);
        assert!(!out.status.success(), "{name} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expect), "{name}: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
    let out = spillway(&["replay", "/nonexistent/trace.jsonl"]);
    assert!(!out.status.success());
    std::fs::remove_dir_all(&dir).unwrap();
}
