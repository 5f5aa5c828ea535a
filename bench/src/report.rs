//! Human output shared by the demo, the benchmarks and replay: tables drawn for the
//! terminal (Markdown only for a results file), colour only on a terminal, progress on
//! stderr, one unit per byte column, the machine and its load for recorded results, and
//! the output folder that plots and JSON go to.
//!
//! Output contract: stdout carries the result (a table, or one JSON object with `--json`);
//! stderr carries progress, notes and where files were written, so `--json` output stays
//! parseable and a user still sees the run move. Progress is a bar when stderr is a
//! terminal, else one line per step (logs, CI). Colour is used only when stdout is a
//! terminal and `NO_COLOR` is unset.

use std::io::IsTerminal;
use std::path::PathBuf;

use comfy_table::{CellAlignment, ContentArrangement, presets};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use spillway_client::fmt_bytes;

use crate::workload::{RunReport, StepReport};

/// Progress of a run on stderr: a bar on a terminal, else one line per item.
pub struct Progress {
    bar: Option<ProgressBar>,
    what: String,
    len: u64,
    done: std::cell::Cell<u64>,
}

impl Progress {
    /// Progress over `len` items called `what` (e.g. "steps"), prefixed by `label`; `len`
    /// 0 when the count is not known in advance.
    pub fn new(len: u64, what: &str, label: &str) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(&format!(
                "{label} {{spinner}} [{{elapsed_precise}}] {{bar:30}} {{pos}}/{{len}} {what} {{msg}}"
            ))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar
        });
        Progress {
            bar,
            what: format!("{label}: {what}"),
            len,
            done: std::cell::Cell::new(0),
        }
    }

    /// One item done; `msg` says how it went.
    pub fn inc(&self, msg: &str) {
        self.done.set(self.done.get() + 1);
        match &self.bar {
            Some(bar) => {
                bar.set_message(msg.to_string());
                bar.inc(1);
            }
            None if self.len == 0 => eprintln!("{} {}: {msg}", self.what, self.done.get()),
            None => eprintln!("{} {}/{}: {msg}", self.what, self.done.get(), self.len),
        }
    }

    /// Runs `f` (which prints to stdout) with the bar cleared.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    /// Clears the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// How a step went, for a progress line: wall time, stall and hits.
pub fn step_message(s: &StepReport) -> String {
    format!(
        "{:.3} s, stall {:.3} s, {:.1}% hits",
        s.wall_s,
        s.stall_s,
        100.0 * s.hit_rate()
    )
}

/// A binary byte unit that one column (or table) uses for every value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteUnit {
    /// `B`, `KiB`, `MiB`, `GiB` or `TiB`.
    pub name: &'static str,
    shift: u32,
}

impl ByteUnit {
    /// The largest unit in which `max_bytes` is at least 1 (bytes for 0).
    pub fn for_max(max_bytes: u64) -> ByteUnit {
        const UNITS: [(&str, u32); 5] =
            [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10), ("B", 0)];
        for (name, shift) in UNITS {
            if max_bytes >> shift > 0 {
                return ByteUnit { name, shift };
            }
        }
        ByteUnit {
            name: "B",
            shift: 0,
        }
    }

    /// `bytes` in this unit, without the unit's name (`384.0`).
    pub fn value(&self, bytes: u64) -> String {
        if self.shift == 0 {
            bytes.to_string()
        } else {
            format!("{:.1}", bytes as f64 / (1u64 << self.shift) as f64)
        }
    }

    /// A rate in this unit per second, without the unit's name (`1.23`).
    pub fn rate(&self, bytes_per_s: f64) -> String {
        format!("{:.2}", bytes_per_s / (1u64 << self.shift) as f64)
    }
}

/// A table of results: drawn for the terminal ([`Table::terminal`]), or as Markdown for a
/// results file ([`Table::markdown`]). The first column is a label, the rest numbers
/// (right-aligned).
#[derive(Clone, Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Table {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (as many cells as columns).
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        let row: Vec<String> = cells.into_iter().map(Into::into).collect();
        debug_assert_eq!(row.len(), self.header.len(), "one cell per column");
        self.rows.push(row);
    }

    /// The table drawn with box-drawing lines, numbers right-aligned.
    pub fn terminal(&self) -> String {
        let mut t = comfy_table::Table::new();
        t.load_style(presets::UTF8_FULL_CONDENSED)
            .set_content_arrangement(ContentArrangement::Disabled)
            .set_header(&self.header);
        for r in &self.rows {
            t.add_row(r);
        }
        for i in 1..self.header.len() {
            if let Some(c) = t.column_mut(i) {
                c.set_cell_alignment(CellAlignment::Right);
            }
        }
        format!("{t}\n")
    }

    /// The table as Markdown (for `--record` only).
    pub fn markdown(&self) -> String {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        let mut s = line(&self.header);
        s += &format!("|{}\n", "---|".repeat(self.header.len()));
        for r in &self.rows {
            s += &line(r);
        }
        s
    }
}

/// Whether to colour stdout: a terminal, and `NO_COLOR` unset.
pub fn colour_stdout() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

/// `text` in bold when stdout takes colour.
pub fn bold(text: &str) -> String {
    paint(text, "1")
}

/// `text` in green (`good`) or yellow when stdout takes colour.
pub fn verdict(text: &str, good: bool) -> String {
    paint(text, if good { "32" } else { "33" })
}

fn paint(text: &str, sgr: &str) -> String {
    if colour_stdout() {
        format!("\x1b[{sgr}m{text}\x1b[0m")
    } else {
        text.to_string()
    }
}

/// The per-step table of the demo and replay: printed row by row as steps finish, in
/// aligned columns, every byte column in one unit chosen up front from the most a step
/// can move.
pub struct StepTable {
    enabled: bool,
    header_done: bool,
    unit: ByteUnit,
}

impl StepTable {
    /// A table that prints only when `enabled`; byte columns in the unit of
    /// `step_bytes_max` (e.g. the working set).
    pub fn new(enabled: bool, step_bytes_max: u64) -> Self {
        StepTable {
            enabled,
            header_done: false,
            unit: ByteUnit::for_max(step_bytes_max),
        }
    }

    /// Prints one step (and the header before the first).
    pub fn row(&mut self, s: &StepReport) {
        if !self.enabled {
            return;
        }
        if !self.header_done {
            println!(
                "{}",
                bold(&format!(
                    "{:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}",
                    "step",
                    "wall s",
                    "stall s",
                    "verify s",
                    "plan ms",
                    "lock ms",
                    "views ms",
                    "device ms",
                    "hits",
                    "hit %",
                    "to GPU",
                    "from GPU",
                    "to peers",
                    "from peers",
                    "verified",
                    "corrupt"
                ))
            );
            println!(
                "{:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}",
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                self.unit.name,
                self.unit.name,
                self.unit.name,
                self.unit.name,
                self.unit.name,
                "pages"
            );
            self.header_done = true;
        }
        let u = self.unit;
        println!(
            "{:>5} {:>8.3} {:>8.3} {:>8.3} {:>8.2} {:>8.2} {:>8.2} {:>9.2} {:>9} {:>6.1}% {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}{}",
            s.step,
            s.wall_s,
            s.stall_s,
            s.verify_s,
            s.overhead.planning_s * 1e3,
            s.overhead.lock_wait_s * 1e3,
            s.overhead.view_s * 1e3,
            (s.overhead.device_planning_s + s.overhead.device_lock_wait_s) * 1e3,
            format!("{}/{}", s.hits, s.acquires),
            100.0 * s.hit_rate(),
            u.value(s.h2d_bytes),
            u.value(s.d2h_bytes),
            u.value(s.remote_bytes_out),
            u.value(s.remote_bytes_in),
            u.value(s.verified_bytes),
            s.corrupt_pages,
            if s.diverged { "  (diverged)" } else { "" }
        );
    }

    /// Prints the run's totals.
    pub fn summary(&self, r: &RunReport) {
        if !self.enabled {
            return;
        }
        println!("\n{}", summary_line(r));
        if let Some(p) = r.detected_period {
            println!("steps were not marked: the pool detected a period of {p} accesses");
        }
    }
}

/// The run's totals on one line: policy, device, bytes verified, corrupt pages, hit rate
/// from step 2, GPU peak against the budget, seconds.
pub fn summary_line(r: &RunReport) -> String {
    format!(
        "{} on {} | verified {} | corrupt pages {} | hit rate from step 2: {} | GPU peak {} of {} budget | {:.1} s",
        r.policy,
        r.device_description,
        fmt_bytes(r.verified_bytes),
        r.corrupt_pages,
        hit_rate_from_step_2(r),
        fmt_bytes(r.gpu_bytes_peak),
        fmt_bytes(r.gpu_budget_bytes),
        r.total_s
    )
}

/// The hit rate over steps 2.. as a percentage, or "none" for a run of one step (step 1
/// has nothing to learn from, so there is no rate to give).
pub fn hit_rate_from_step_2(r: &RunReport) -> String {
    if r.steps.iter().any(|s| s.step >= 2) {
        format!("{:.2}%", 100.0 * r.hit_rate_from(2))
    } else {
        "none (one step)".to_string()
    }
}

/// The per-step figures as a [`Table`] (for a results file), byte columns in the unit of
/// `step_bytes_max`, as [`StepTable`] prints them.
pub fn steps_table(steps: &[StepReport], step_bytes_max: u64) -> Table {
    let u = ByteUnit::for_max(step_bytes_max);
    let mut t = Table::new([
        "step".to_string(),
        "wall s".into(),
        "stall s".into(),
        "verify s".into(),
        "planning ms".into(),
        "lock wait ms".into(),
        "views ms".into(),
        "device threads ms".into(),
        "hits".into(),
        "hit %".into(),
        format!("to GPU {}", u.name),
        format!("from GPU {}", u.name),
        format!("to peers {}", u.name),
        format!("from peers {}", u.name),
        format!("verified {}", u.name),
        "corrupt pages".into(),
    ]);
    for s in steps {
        t.row([
            s.step.to_string(),
            format!("{:.3}", s.wall_s),
            format!("{:.3}", s.stall_s),
            format!("{:.3}", s.verify_s),
            format!("{:.2}", s.overhead.planning_s * 1e3),
            format!("{:.2}", s.overhead.lock_wait_s * 1e3),
            format!("{:.2}", s.overhead.view_s * 1e3),
            format!(
                "{:.2}",
                (s.overhead.device_planning_s + s.overhead.device_lock_wait_s) * 1e3
            ),
            format!("{}/{}", s.hits, s.acquires),
            format!("{:.1}%", 100.0 * s.hit_rate()),
            u.value(s.h2d_bytes),
            u.value(s.d2h_bytes),
            u.value(s.remote_bytes_out),
            u.value(s.remote_bytes_in),
            u.value(s.verified_bytes),
            s.corrupt_pages.to_string(),
        ]);
    }
    t
}

/// The machine's load when sampled: load averages over 1, 5 and 15 minutes
/// (`/proc/loadavg`; 0 where unknown) and the cores this process may use.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Load {
    /// Runnable tasks averaged over the last minute.
    pub load_1min: f64,
    /// ... the last 5 minutes.
    pub load_5min: f64,
    /// ... the last 15 minutes.
    pub load_15min: f64,
    /// Cores available to this process.
    pub cores: usize,
}

impl Load {
    /// The load now.
    pub fn now() -> Load {
        let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let mut f = text
            .split_whitespace()
            .map(|x| x.parse::<f64>().unwrap_or(0.0));
        Load {
            load_1min: f.next().unwrap_or(0.0),
            load_5min: f.next().unwrap_or(0.0),
            load_15min: f.next().unwrap_or(0.0),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// The folder a command writes its plots and JSON to when the user names none:
/// `spillway-out/<command>-<UTC time>` under the current directory, one per run.
pub fn default_out_dir(command: &str) -> PathBuf {
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .replace([':', '-'], "");
    PathBuf::from("spillway-out").join(format!("{command}-{stamp}"))
}

/// Creates `dir` and writes `json` to `dir/name`.
pub fn write_json(
    dir: &std::path::Path,
    name: &str,
    json: &impl serde::Serialize,
) -> anyhow::Result<PathBuf> {
    use anyhow::Context as _;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(json)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// One line describing this machine: CPU model, cores, memory, kernel.
pub fn machine_description() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<u64>().ok())
        })
        .map(|kib| fmt_bytes(kib << 10))
        .unwrap_or_else(|| "unknown memory".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    format!("{cpu}, {cores} cores, {mem} RAM, Linux {kernel}")
}

/// The current time as RFC 3339 (UTC, seconds).
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_byte_unit_fits_the_largest_value() {
        assert_eq!(ByteUnit::for_max(0).name, "B");
        assert_eq!(ByteUnit::for_max(1023).name, "B");
        assert_eq!(ByteUnit::for_max(1 << 20).name, "MiB");
        let u = ByteUnit::for_max(3 << 30);
        assert_eq!(u.name, "GiB");
        assert_eq!(u.value(384 << 20), "0.4");
        assert_eq!(ByteUnit::for_max(500 << 20).value(384 << 20), "384.0");
    }

    #[test]
    fn a_table_draws_for_the_terminal_and_as_markdown() {
        let mut t = Table::new(["variant", "ratio"]);
        t.row(["learned", "1.013"]);
        t.row(["on_demand", "1.278"]);
        let term = t.terminal();
        assert!(!term.contains("|---"), "{term}");
        assert!(term.contains("│ learned   ┆ 1.013 │"), "{term}");
        assert!(term.contains("│ on_demand ┆ 1.278 │"), "{term}");
        assert_eq!(
            t.markdown(),
            "| variant | ratio |\n|---|---|\n| learned | 1.013 |\n| on_demand | 1.278 |\n"
        );
    }
}
