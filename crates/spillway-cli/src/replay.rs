//! `spillway replay TRACE`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use spillway_bench::find_budget::{BudgetSearch, find_budget};
use spillway_bench::replay::{
    ReplayConfig, ReplayRemote, ReplayReport, replay, replay_with, stall_from,
};
use spillway_bench::replay_compare::{self as compare, VARIANTS, compare};
use spillway_bench::report::{
    ByteUnit, Progress, StepTable, Table, bold, default_out_dir, machine_description, now_rfc3339,
    step_message, verdict, write_json,
};
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
    /// Nodes of the pool: 1 is the one-process pool; N > 1 starts N nodes in this process
    /// on loopback QUIC (as `demo --nodes`), node 1 serving the replay's pool, whose remote
    /// tier is the other nodes' RAM (the host tier then holds a third of the trace's pages
    /// unless --host-budget says otherwise). A fresh pool of nodes per policy.
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
    /// Run all three policies and a resident replay (the floor: every page on the GPU)
    /// side by side, interleaved over --repeats.
    #[arg(long)]
    compare: bool,
    /// With --compare: repeats of the whole set, interleaved (each policy reports the
    /// median and min-max of its step time and its ratio to each repeat's floor).
    #[arg(long, default_value_t = spillway_bench::offload::REPEATS_DEFAULT,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(1..=spillway_bench::offload::REPEATS_MAX as u64))]
    repeats: usize,
    /// GPU backend: auto, sim or cuda.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// Search the GPU budget the trace needs under the learned policy: the smallest at
    /// which it reaches 99% hits (steps 2..), and the smallest at which its step time is
    /// within 5% of the compute time (every page resident). Replays the trace about
    /// 2 log2(pages) times; --time-scale shortens each.
    #[arg(long, conflicts_with_all = ["compare", "gpu_budget", "policy"])]
    find_budget: bool,
    /// Print JSON instead of tables: one report, `{"runs": [...]}` with --compare, the
    /// search with --find-budget (progress still goes to stderr).
    #[arg(long)]
    json: bool,
    /// Folder for the JSON (replay.json) and the plot of step time and stall per step per
    /// policy (replay.svg) [default: spillway-out/replay-TIME, printed].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Append the comparison, the command and the machine to this Markdown file.
    #[arg(long)]
    record: Option<PathBuf>,
}

/// The comparison's opening line: budget, working set, page, and what no predictor can
/// know.
fn compare_title(runs: &[ReplayReport]) -> String {
    let r0 = &runs[0].run;
    format!(
        "GPU budget {} for a working set of {} ({:.1}x), page {}; the trace holds at most {} \
         at once; accesses to buffers the step before did not use: {} per step",
        fmt_bytes(r0.gpu_budget_bytes),
        fmt_bytes(r0.working_set_bytes),
        r0.working_set_bytes as f64 / r0.gpu_budget_bytes as f64,
        fmt_bytes(r0.page_bytes),
        fmt_bytes(runs[0].gpu_bytes_held_peak),
        runs[0]
            .novel_access_fraction
            .iter()
            .map(|f| format!("{:.0}%", 100.0 * f))
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// One row per policy; GPU columns in one unit.
fn compare_table(runs: &[ReplayReport]) -> Table {
    let unit = ByteUnit::for_max(runs[0].run.gpu_budget_bytes);
    let mut t = Table::new([
        "policy".to_string(),
        "hit rate (steps 2..)".into(),
        "stall s (steps 2..)".into(),
        "step s (median)".into(),
        format!("GPU peak {}", unit.name),
        "GPU peak / budget".into(),
        "corrupt pages".into(),
    ]);
    for r in runs {
        t.row([
            r.run.policy.clone(),
            spillway_bench::report::hit_rate_from_step_2(&r.run),
            format!("{:.4}", stall_from(&r.run, 2)),
            format!("{:.4}", r.run.median_step_s(2)),
            unit.value(r.run.gpu_bytes_peak),
            format!(
                "{:.0}%",
                100.0 * r.run.gpu_bytes_peak as f64 / r.run.gpu_budget_bytes.max(1) as f64
            ),
            r.run.corrupt_pages.to_string(),
        ]);
    }
    t
}

/// The budget search as a table, then its answer.
fn budget_table(b: &BudgetSearch) -> (Table, String) {
    let unit = ByteUnit::for_max(b.pages_bytes);
    let mut t = Table::new([
        format!("GPU budget {}", unit.name),
        "x of working set".into(),
        "hit rate (steps 2..)".into(),
        "step s (median)".into(),
        "step / compute".into(),
    ]);
    let mut probes = b.probes.clone();
    probes.sort_by_key(|p| p.gpu_budget_bytes);
    for p in &probes {
        t.row([
            unit.value(p.gpu_budget_bytes),
            format!("{:.2}", p.gpu_budget_bytes as f64 / b.pages_bytes as f64),
            format!("{:.2}%", 100.0 * p.hit_rate),
            format!("{:.4}", p.step_s_median),
            format!("{:.3}", p.step_s_median / b.compute_s),
        ]);
    }
    let mut answer = format!(
        "{} needs a GPU budget of {} ({:.0}% of its pages) for {:.0}% hits, and {} ({:.0}%) \
         for a step time within {:.0}% of the compute time ({:.4} s, every page resident)",
        b.policy,
        fmt_bytes(b.hits_budget_bytes),
        100.0 * b.hits_budget_bytes as f64 / b.pages_bytes as f64,
        100.0 * b.hit_rate_target,
        fmt_bytes(b.step_budget_bytes),
        100.0 * b.step_budget_bytes as f64 / b.pages_bytes as f64,
        100.0 * b.step_slack,
        b.compute_s,
    );
    if b.compute_spread > b.step_slack {
        answer += &format!(
            "\nnote: step times at one budget varied by {:.0}% of the median here (the resident \
             replay's steps), more than the {:.0}% asked: the step-time answer is within this \
             machine's noise; run it on a quieter machine, or compare budgets within one run",
            100.0 * b.compute_spread,
            100.0 * b.step_slack
        );
    }
    (t, answer)
}

/// [`replay`] over `cfg.nodes` in-process nodes (the remote tier), started for this run
/// and shut down after it.
fn replay_over_nodes(
    trace: &spillway_bench::trace::Trace,
    name: &str,
    cfg: &ReplayConfig,
    on_step: impl FnMut(&spillway_bench::workload::StepReport),
) -> Result<ReplayReport> {
    let page_size = cfg.page_size;
    let page = page_size.bytes();
    let pages: u64 = trace
        .buffers
        .iter()
        .map(|(_, b)| page_size.pages_for(*b))
        .sum();
    // The remote tier holds what the host tier does not, plus room to swap (as the demo).
    let remote_need = (pages * 2 + 8) * page;
    let nodes = u32::try_from(cfg.nodes).context("--nodes")?;
    let local = crate::local_pool::LocalPool::start(
        nodes,
        remote_need,
        page_size,
        remote_need,
        spillway_node::PageTransport::Quic,
    )
    .context("starting the in-process nodes")?;
    let factory = spillway_client::service_tier::ServiceTier::factory(
        local.service(),
        local.handle(),
        1,
        remote_need,
        format!("{nodes} in-process nodes over loopback QUIC (node 1 serves this pool)"),
    );
    let r = replay_with(
        trace,
        name,
        cfg,
        Some(ReplayRemote {
            factory,
            budget_bytes: remote_need,
        }),
        on_step,
    );
    local.shutdown();
    r
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
    let out_dir = args
        .out
        .clone()
        .unwrap_or_else(|| default_out_dir("replay"));
    if !args.json {
        println!(
            "{}",
            bold(&format!(
                "replay {name}: {} accesses in {} steps over {} buffers ({}), page {}",
                trace.accesses.len(),
                trace.steps.len(),
                trace.buffers.len(),
                fmt_bytes(trace.buffer_bytes_total()),
                fmt_bytes(page_size.bytes())
            ))
        );
    }
    if args.find_budget {
        let progress = Progress::new(0, "replays", "replay --find-budget");
        let search = find_budget(&trace, &name, &base, |p| {
            progress.inc(&format!(
                "budget {}: {:.2}% hits, {:.4} s/step",
                fmt_bytes(p.gpu_budget_bytes),
                100.0 * p.hit_rate,
                p.step_s_median
            ))
        })?;
        progress.finish();
        let (table, answer) = budget_table(&search);
        if args.json {
            println!("{}", serde_json::to_string(&search)?);
        } else {
            print!("{}", table.terminal());
            let mut lines = answer.lines();
            println!("{}", verdict(lines.next().unwrap_or_default(), true));
            for line in lines {
                println!("{line}");
            }
        }
        let json = write_json(&out_dir, "budget.json", &search)?;
        eprintln!("wrote {}", json.display());
        if let Some(path) = &args.record {
            let body = format!("{}\n{answer}\n", table.markdown());
            crate::record::append_section(
                path,
                &format!("Replay budget search of `{name}`"),
                &body,
                &serde_json::to_string(&search)?,
            )?;
        }
        let corrupt: u64 = search.probes.iter().map(|p| p.corrupt_pages).sum();
        if corrupt > 0 {
            bail!("{corrupt} pages were corrupt");
        }
        return Ok(());
    }
    if args.compare {
        return run_compare(&args, &trace, &name, &base, &out_dir);
    }
    let cfg = ReplayConfig {
        policy: args.policy,
        ..base.clone()
    };
    let progress = Progress::new(
        trace.steps.len() as u64,
        "steps",
        &format!("replay {}", args.policy.name()),
    );
    let mut table = StepTable::new(!args.json, trace.buffer_bytes_total() * 2);
    let on_step = |s: &_| {
        progress.suspend(|| table.row(s));
        progress.inc(&step_message(s));
    };
    let r = if args.nodes > 1 {
        replay_over_nodes(&trace, &name, &cfg, on_step)?
    } else {
        replay(&trace, &name, &cfg, on_step)?
    };
    progress.finish();
    table.summary(&r.run);
    if !args.json {
        println!(
            "the trace holds at most {} on the GPU at once; the pool used {} ({}): \
             `--find-budget` searches the budget the job needs",
            fmt_bytes(r.gpu_bytes_held_peak),
            fmt_bytes(r.run.gpu_bytes_peak),
            if r.run.gpu_bytes_peak >= r.run.gpu_budget_bytes {
                "the whole budget: this policy keeps pages until it needs the room"
            } else {
                "less than the budget"
            }
        );
    }
    let runs = vec![r];
    if args.json {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer(&mut out, &runs[0])?;
        writeln!(out)?;
    }
    let json = write_json(&out_dir, "replay.json", &runs[0])?;
    plot_policies(&runs, &out_dir, &json, "")?;
    append_record(
        &args,
        &trace,
        &name,
        &runs,
        &compare_table(&runs).markdown(),
    )?;
    let corrupt: u64 = runs.iter().map(|r| r.run.corrupt_pages).sum();
    if corrupt > 0 {
        bail!("{corrupt} pages were corrupt");
    }
    Ok(())
}

/// Draws step time and stall per step by policy of `runs` as `replay.svg` in `out_dir`,
/// beside their JSON `json`, and says so; `qualifier` says which steps it draws
/// (", last repeat"), or is empty.
fn plot_policies(
    runs: &[ReplayReport],
    out_dir: &std::path::Path,
    json: &std::path::Path,
    qualifier: &str,
) -> Result<()> {
    let reports: Vec<_> = runs.iter().map(|r| &r.run).collect();
    spillway_bench::plot::policies(&reports, &out_dir.join("replay.svg"))?;
    eprintln!(
        "wrote {} and its plot replay.svg (step time and stall per step, by policy{qualifier})",
        json.display()
    );
    Ok(())
}

/// Appends a replay of `trace` (named `name`) to `--record`, when given: heading,
/// command, machine, the trace's shape, the title of `runs` and `body` (the table and
/// what follows it).
fn append_record(
    args: &ReplayArgs,
    trace: &spillway_bench::trace::Trace,
    name: &str,
    runs: &[ReplayReport],
    body: &str,
) -> Result<()> {
    let Some(path) = &args.record else {
        return Ok(());
    };
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let mut f = crate::record::open_for_append(path)?;
    writeln!(
        f,
        "\n### Replay of `{name}`, {}\n\nCommand: `{command}`\n\nMachine: {}; device: {}\n\n{} accesses in {} steps over {} buffers.\n\n{}\n\n{body}",
        now_rfc3339(),
        machine_description(),
        runs[0].run.device_description,
        trace.accesses.len(),
        trace.steps.len(),
        trace.buffers.len(),
        compare_title(runs),
    )?;
    Ok(())
}

/// `--compare`: resident and the three policies, interleaved over `--repeats`; prints the
/// table (or the JSON), writes `replay.json` and the plot, appends to `--record`.
fn run_compare(
    args: &ReplayArgs,
    trace: &spillway_bench::trace::Trace,
    name: &str,
    base: &ReplayConfig,
    out_dir: &std::path::Path,
) -> Result<()> {
    let progress = Progress::new(
        (args.repeats * VARIANTS.len()) as u64,
        "replays",
        "replay --compare",
    );
    let result = compare(
        trace,
        name,
        base,
        args.repeats,
        |cfg| {
            if args.nodes > 1 {
                replay_over_nodes(trace, name, cfg, |_| {})
            } else {
                replay(trace, name, cfg, |_| {})
            }
        },
        |m| progress.inc(m),
    )?;
    progress.finish();
    let table = compare::table(&result);
    let notes = compare::notes(&result);
    if args.json {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer(&mut out, &result)?;
        writeln!(out)?;
    } else {
        println!("{}", compare_title(&result.runs));
        print!("{}", table.terminal());
        for n in &notes {
            println!("{n}");
        }
    }
    let json = write_json(out_dir, "replay.json", &result)?;
    plot_policies(&result.runs, out_dir, &json, ", last repeat")?;
    let notes: String = notes.iter().map(|n| format!("- {n}\n")).collect();
    let body = format!("{}\n{notes}", table.markdown());
    append_record(args, trace, name, &result.runs, &body)?;
    let corrupt: u64 = result
        .policies
        .iter()
        .chain(std::iter::once(&result.resident))
        .map(|p| p.corrupt_pages)
        .sum();
    if corrupt > 0 {
        bail!("{corrupt} pages were corrupt");
    }
    Ok(())
}
