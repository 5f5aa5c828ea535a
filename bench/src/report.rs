//! Human output shared by the demo, the benchmarks and replay: the per-step table, the
//! progress bar, and a description of the machine for recorded results.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use spillway_client::fmt_bytes;

use crate::workload::{RunReport, StepReport};

/// A progress bar on stderr over `len` items, hidden when `hidden`.
pub fn progress_bar(len: u64, what: &str, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(&format!(
        "{{spinner}} [{{elapsed_precise}}] {{bar:30}} {{pos}}/{{len}} {what} {{msg}}"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// The per-step table: printed row by row as steps finish.
pub struct StepTable {
    enabled: bool,
    header_done: bool,
}

impl StepTable {
    /// A table that prints only when `enabled`.
    pub fn new(enabled: bool) -> Self {
        StepTable {
            enabled,
            header_done: false,
        }
    }

    /// Prints one step (and the header before the first).
    pub fn row(&mut self, s: &StepReport) {
        if !self.enabled {
            return;
        }
        if !self.header_done {
            println!(
                "{:>5} {:>8} {:>8} {:>9} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}",
                "step",
                "wall s",
                "stall s",
                "hits",
                "hit %",
                "to GPU",
                "from GPU",
                "to peers",
                "from peers",
                "verified",
                "corrupt"
            );
            self.header_done = true;
        }
        println!(
            "{:>5} {:>8.3} {:>8.3} {:>9} {:>6.1}% {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}{}",
            s.step,
            s.wall_s,
            s.stall_s,
            format!("{}/{}", s.hits, s.acquires),
            100.0 * s.hit_rate(),
            fmt_bytes(s.h2d_bytes),
            fmt_bytes(s.d2h_bytes),
            fmt_bytes(s.remote_bytes_out),
            fmt_bytes(s.remote_bytes_in),
            fmt_bytes(s.verified_bytes),
            s.corrupt_pages,
            if s.diverged { "  (diverged)" } else { "" }
        );
    }

    /// Prints the run's totals.
    pub fn summary(&self, r: &RunReport) {
        if !self.enabled {
            return;
        }
        println!(
            "\n{} on {} | verified {} | corrupt pages {} | hit rate from step 2: {:.2}% | GPU peak {} of {} budget | {:.1} s",
            r.policy,
            r.device_description,
            fmt_bytes(r.verified_bytes),
            r.corrupt_pages,
            100.0 * r.hit_rate_from(2),
            fmt_bytes(r.gpu_bytes_peak),
            fmt_bytes(r.gpu_budget_bytes),
            r.total_s
        );
        if let Some(p) = r.detected_period {
            println!("steps were not marked: the pool detected a period of {p} accesses");
        }
    }
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
