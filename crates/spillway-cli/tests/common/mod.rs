//! What the black-box tests of the `spillway` binary share: how to run it, a small demo
//! model, and where the example traces are.

use std::process::Command;

/// The binary with `args`, run in the temporary folder, where the plots and JSON of a run
/// that names no `--out` land (`spillway-out/`), not in the source tree.
pub fn spillway_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_spillway"));
    command.args(args).current_dir(std::env::temp_dir());
    command
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
