//! What the black-box tests of the `spillway` binary share: how to run it (and check that
//! it succeeded or failed cleanly), a small demo model, the example traces, and a scratch
//! folder for a run's files.

// Each test file uses its own share of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// The binary with `args`, run in the temporary folder, where the plots and JSON of a run
/// that names no `--out` land (`spillway-out/`), not in the source tree.
pub fn spillway_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_spillway"));
    command.args(args).current_dir(std::env::temp_dir());
    command
}

/// Runs the binary with `args` and asserts it succeeded (its stderr in the message).
pub fn spillway_ok(args: &[&str]) -> Output {
    let out = spillway_command(args)
        .env_remove("NO_COLOR")
        .output()
        .expect("run spillway");
    assert!(
        out.status.success(),
        "spillway {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs the binary with `args` and asserts it failed without a panic; its stderr.
pub fn spillway_err(args: &[&str]) -> String {
    let out = spillway_command(args).output().expect("run spillway");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "spillway {args:?} was accepted: {err}"
    );
    assert!(!err.contains("panicked"), "spillway {args:?}: {err}");
    err
}

/// The one JSON object a run printed on stdout.
pub fn stdout_json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

/// A JSON array of numbers.
pub fn f64s(array: &Value) -> Vec<f64> {
    array
        .as_array()
        .expect("a JSON array")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

/// The string `key` of every object of a JSON array.
pub fn strs<'a>(array: &'a Value, key: &str) -> Vec<&'a str> {
    array
        .as_array()
        .expect("a JSON array")
        .iter()
        .map(|x| x[key].as_str().expect("a string"))
        .collect()
}

/// Asserts that `text` (what `what` is) contains every one of `needles`.
pub fn assert_contains_all(what: &str, text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "{needle:?} not in {what}:\n{text}");
    }
}

/// A JSON file a run wrote.
pub fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A demo model small enough for a test: 8 layers of 1 MiB, 256 KiB pages, 4 steps.
pub const SMALL: &[&str] = &[
    "--layers",
    "8",
    "--weight-mib",
    "1",
    "--act-mib",
    "1",
    "--page-size",
    "256KiB",
    "--steps",
    "4",
    "--compute-passes",
    "16",
    "--device",
    "sim",
];

/// The path of an example trace in `bench/traces/`.
pub fn trace_path(name: &str) -> String {
    format!("{}/../../bench/traces/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `replay --compare` of the MoE trace on the simulated device, in a GPU budget of 16 MiB
/// (`COMPARE_BUDGET_BYTES`): the run whose JSON and whose table the tests check.
pub const COMPARE_MOE: &[&str] = &[
    "--compare",
    "--time-scale",
    "0.05",
    "--device",
    "sim",
    "--gpu-budget",
    "16MiB",
];

/// The GPU budget of [`COMPARE_MOE`].
pub const COMPARE_BUDGET_BYTES: u64 = 16 << 20;

/// A fresh folder for one test's files (`--out`, `--record`), removed when dropped.
pub struct Scratch {
    dir: tempfile::TempDir,
    out: String,
    record: String,
}

impl Scratch {
    /// A folder named after the test.
    pub fn new(name: &str) -> Scratch {
        let dir = tempfile::Builder::new()
            .prefix(&format!("spillway-{name}-"))
            .tempdir()
            .expect("a temporary directory");
        let out = dir.path().to_str().expect("a UTF-8 path").to_string();
        let record = format!("{out}/RESULTS.md");
        Scratch { dir, out, record }
    }

    /// `--out` and the folder.
    pub fn out_args(&self) -> [&str; 2] {
        ["--out", &self.out]
    }

    /// `--record` and `RESULTS.md` in the folder.
    pub fn record_args(&self) -> [&str; 2] {
        ["--record", &self.record]
    }

    /// What `--record` wrote.
    pub fn recorded(&self) -> String {
        std::fs::read_to_string(&self.record).unwrap()
    }

    /// A file in the folder.
    pub fn join(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}
