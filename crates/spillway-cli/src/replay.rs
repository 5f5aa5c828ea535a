//! `spillway replay TRACE`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;
use spillway_bench::replay::{ReplayConfig, ReplayReport, replay, stall_from};
use spillway_bench::report::{StepTable, progress_bar};
use spillway_bench::trace::load_trace;
use spillway_client::{DeviceChoice, PageSize, Policy, fmt_bytes};

/// Arguments of `spillway replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The trace: JSON Lines as described in docs/TRACE.md.
    trace: PathBuf,
    /// GPU budget, e.g. `64MiB` or `2GiB` (default: a third of the trace's buffer bytes).
    #[arg(long)]
    gpu_budget: Option<bytesize::ByteSize>,
    /// Host budget (default: every page of every buffer).
    #[arg(long)]
    host_budget: Option<bytesize::ByteSize>,
    /// Page size, a power of two from 64KiB to 64MiB.
    #[arg(long, default_value = "256KiB")]
    page_size: bytesize::ByteSize,
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
}

#[derive(Serialize)]
struct Compared<'a> {
    runs: &'a [ReplayReport],
}

pub fn run_replay(args: ReplayArgs) -> Result<()> {
    let trace =
        load_trace(&args.trace).with_context(|| format!("reading {}", args.trace.display()))?;
    let name = args.trace.display().to_string();
    let page_size = PageSize::new(args.page_size.as_u64())?;
    let base = ReplayConfig {
        gpu_budget_bytes: args.gpu_budget.map(|b| b.as_u64()),
        host_budget_bytes: args.host_budget.map(|b| b.as_u64()),
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
        let r0 = &runs[0].run;
        println!(
            "GPU budget {} for a working set of {} ({:.1}x)",
            fmt_bytes(r0.gpu_budget_bytes),
            fmt_bytes(r0.working_set_bytes),
            r0.working_set_bytes as f64 / r0.gpu_budget_bytes as f64
        );
        println!(
            "{:>10} {:>16} {:>18} {:>16} {:>12} {:>9}",
            "policy", "hit rate (2..)", "stall s (2..)", "step s (median)", "GPU peak", "corrupt"
        );
        for r in &runs {
            println!(
                "{:>10} {:>15.2}% {:>18.4} {:>16.4} {:>12} {:>9}",
                r.run.policy,
                100.0 * r.run.hit_rate_from(2),
                stall_from(&r.run, 2),
                r.run.median_step_s(2),
                fmt_bytes(r.run.gpu_bytes_peak),
                r.run.corrupt_pages
            );
        }
    }
    let corrupt: u64 = runs.iter().map(|r| r.run.corrupt_pages).sum();
    if corrupt > 0 {
        bail!("{corrupt} pages were corrupt");
    }
    Ok(())
}
