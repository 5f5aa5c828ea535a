//! Appending a measured result to a results file (`bench/RESULTS.md`): a section with the
//! exact command, the machine, a table and the program's JSON, written by the program so
//! that no number is typed by hand.
//!
//! `bench/RESULTS.md` is a result page: one section per claim with its newest figures, and
//! a last heading, "Runs since ...", under which every recorded run lands, because a run is
//! appended at the end of the file (as `bench offload`, `replay`, `demo`,
//! `bench/cluster/demo_pool.sh` and `bench/gpu/record.py` do too). A run there supersedes
//! its claim's figures until someone copies its rows into the claim's section and moves the
//! raw section under `bench/history/` (the top of the page says so). Appending keeps a
//! recording run from ever rewriting what others wrote.

use std::io::Write as _;
use std::path::Path;

use anyhow::{Context, Result};

/// `path` opened for appending (created when missing): records never rewrite what is there.
pub(crate) fn open_for_append(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

/// Appends `### {title}, {time}` with the command line of this process, the machine,
/// `body` (markdown) and `json` to `path`.
pub(crate) fn append_section(path: &Path, title: &str, body: &str, json: &str) -> Result<()> {
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let mut f = open_for_append(path)?;
    // The load when the section is written: on a shared machine it says how much the
    // neighbours took.
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into());
    writeln!(
        f,
        "\n### {title}, {}\n\nCommand: `{command}`\n\nMachine: {}; load average (1 min) {load}\n\n{body}\nJSON: `{json}`\n",
        spillway_bench::report::now_rfc3339(),
        spillway_bench::report::machine_description(),
    )
    .with_context(|| format!("appending to {}", path.display()))
}
