//! `spillway replay TRACE`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde::Serialize;
use spillway_bench::replay::{ReplayConfig, ReplayReport, replay, stall_from};
use spillway_bench::report::{StepTable, machine_description, now_rfc3339, progress_bar};
use spillway_bench::trace::{TraceError, load_trace};
use spillway_client::{DeviceChoice, PageSize, Policy, fmt_bytes};

use crate::size::{BUDGET_BYTES_MAX, PAGE_BYTES_MAX, PAGE_BYTES_MIN, size_in};

/// Arguments of `spillway replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The trace: JSON Lines as described in docs/TRACE.md.
    trace: PathBuf,
    /// GPU budget, e.g. 64MiB or 2GiB, at most 16TiB (default: a third of the trace's
    /// buffer bytes).
    #[arg(long, value_name = "SIZE", value_parser = size_in(0..=BUDGET_BYTES_MAX))]
    gpu_budget: Option<u64>,
    /// Host budget, e.g. 1GiB, at most 16TiB (default: every page of every buffer).
    #[arg(long, value_name = "SIZE", value_parser = size_in(0..=BUDGET_BYTES_MAX))]
    host_budget: Option<u64>,
    /// Page size, a power of two from 64KiB to 64MiB.
    #[arg(long, value_name = "SIZE", default_value = "256KiB",
          value_parser = size_in(PAGE_BYTES_MIN..=PAGE_BYTES_MAX))]
    page_size: u64,
    /// Nodes of the pool (only 1, the one-process pool, exists so far).
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// Compute time per MiB of buffer for lines without `compute_us`.
    #[arg(long, default_value_t = 100.0)]
    compute_us_per_mib: f64,
    /// Multiplies every compute time (0.1 replays ten times faster than recorded).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Policy: learned, clock or on_demand.
    #[arg(long, default_value = "learned")]
    policy: Policy,
    /// Run all three policies and print them side by side.
    #[arg(long)]
    compare: bool,
    /// GPU backend: auto, sim or cuda.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// Print JSON instead of tables: one report, or `{"runs": [...]}` with --compare.
    #[arg(long)]
    json: bool,
    /// Append the comparison, the command and the machine to this Markdown file.
    #[arg(long)]
    record: Option<PathBuf>,
}

fn compare_table(runs: &[ReplayReport]) -> String {
    let r0 = &runs[0].run;
    let mut s = format!(
        "GPU budget {} for a working set of {} ({:.1}x), page {}; accesses to buffers the step before did not use: {} per step\n\n| policy | hit rate (steps 2..) | stall s (steps 2..) | step s (median) | GPU peak | corrupt pages |\n|---|---|---|---|---|---|\n",
        fmt_bytes(r0.gpu_budget_bytes),
        fmt_bytes(r0.working_set_bytes),
        r0.working_set_bytes as f64 / r0.gpu_budget_bytes as f64,
        fmt_bytes(r0.page_bytes),
        runs[0]
            .novel_access_fraction
            .iter()
            .map(|f| format!("{:.0}%", 100.0 * f))
            .collect::<Vec<_>>()
            .join(" ")
    );
    for r in runs {
        s += &format!(
            "| {} | {:.2}% | {:.4} | {:.4} | {} | {} |\n",
            r.run.policy,
            100.0 * r.run.hit_rate_from(2),
            stall_from(&r.run, 2),
            r.run.median_step_s(2),
            fmt_bytes(r.run.gpu_bytes_peak),
            r.run.corrupt_pages
        );
    }
    s
}

#[derive(Serialize)]
struct Compared<'a> {
    runs: &'a [ReplayReport],
}

pub fn run_replay(args: ReplayArgs) -> Result<()> {
    // A trace error names its cause already; the path is said once, then what to do.
    let trace = load_trace(&args.trace).map_err(|e| match e {
        TraceError::Open { .. } => anyhow!("{e}; check the path"),
        e => anyhow!(
            "{}: {e} (docs/TRACE.md describes the format)",
            args.trace.display()
        ),
    })?;
    let name = args.trace.display().to_string();
    let page_size = PageSize::new(args.page_size)?;
    let base = ReplayConfig {
        gpu_budget_bytes: args.gpu_budget,
        host_budget_bytes: args.host_budget,
        page_size,
        policy: args.policy,
        device: args.device,
        compute_us_per_mib: args.compute_us_per_mib,
        time_scale: args.time_scale,
        nodes: args.nodes,
    };
    let policies: Vec<Policy> = if args.compare {
        Policy::ALL.to_vec()
    } else {
        vec![args.policy]
    };
    if !args.json {
        println!(
            "replay {name}: {} accesses in {} steps over {} buffers ({}), page {}",
            trace.accesses.len(),
            trace.steps.len(),
            trace.buffers.len(),
            fmt_bytes(trace.buffer_bytes_total()),
            fmt_bytes(page_size.bytes())
        );
    }
    let mut runs = Vec::new();
    for policy in policies {
        let cfg = ReplayConfig {
            policy,
            ..base.clone()
        };
        let bar = progress_bar(trace.steps.len() as u64, "steps", args.json);
        let mut table = StepTable::new(!args.json && !args.compare);
        let r = replay(&trace, &name, &cfg, |s| {
            bar.suspend(|| table.row(s));
            bar.inc(1);
        })?;
        bar.finish_and_clear();
        table.summary(&r.run);
        runs.push(r);
    }
    if args.json {
        let mut out = std::io::stdout().lock();
        if args.compare {
            serde_json::to_writer(&mut out, &Compared { runs: &runs })?;
        } else {
            serde_json::to_writer(&mut out, &runs[0])?;
        }
        writeln!(out)?;
    } else if args.compare {
        print!("{}", compare_table(&runs));
    }
    if let Some(path) = &args.record {
        let command = std::env::args().collect::<Vec<_>>().join(" ");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        writeln!(
            f,
            "\n### Replay of `{name}`, {}\n\nCommand: `{command}`\n\nMachine: {}; device: {}\n\n{} accesses in {} steps over {} buffers.\n\n{}",
            now_rfc3339(),
            machine_description(),
            runs[0].run.device_description,
            trace.accesses.len(),
            trace.steps.len(),
            trace.buffers.len(),
            compare_table(&runs)
        )?;
    }
    let corrupt: u64 = runs.iter().map(|r| r.run.corrupt_pages).sum();
    if corrupt > 0 {
        bail!("{corrupt} pages were corrupt");
    }
    Ok(())
}
