//! `spillway demo` and `spillway bench`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use spillway_bench::offload::{self, OffloadConfig};
use spillway_bench::repeats;
use spillway_bench::report::{
    Progress, StepTable, bold, default_out_dir, step_message, steps_table, summary_line, write_json,
};
use spillway_bench::workload::{TrainConfig, run_training_in};
use spillway_client::{DeviceChoice, PageSize, Policy};

use crate::size::{BUDGET_BYTES_MAX, PAGE_BYTES_MAX, PAGE_BYTES_MIN, merge_deprecated, size_in};

/// Rounds of arithmetic per page per kernel by default.
const COMPUTE_PASSES_DEFAULT: u32 = 2;
/// The same with a remote tier: the network moves pages more slowly than a copy engine, so
/// the loop needs more compute per byte for prefetch to hide it.
const COMPUTE_PASSES_REMOTE_DEFAULT: u32 = 64;

// Bounds of the size flags, checked by clap before any arithmetic: with them no size the
// demo computes (MiB to bytes, layers times bytes, pages times page size) can overflow a
// u64, so a huge value is refused instead of wrapping to a small one.
/// Most layers: 65536.
const LAYERS_MAX: u64 = 1 << 16;
/// Largest `--weight-mib` and `--act-mib`: 1 TiB, a trace's largest buffer
/// (`spillway_bench::trace::BUFFER_BYTES_MAX`).
const LAYER_MIB_MAX: u64 = 1 << 20;
/// Largest deprecated `--gpu-budget-mib` and `--host-budget-mib`: 16 TiB
/// ([`BUDGET_BYTES_MAX`], the bound of `--gpu-budget` and `--host-budget`). 0 is let
/// through for the pool to refuse with its own words.
const BUDGET_MIB_MAX: u64 = BUDGET_BYTES_MAX >> 20;
/// Deprecated `--page-kib`: 64 KiB to 64 MiB (`spillway_types::limits`, the bounds of
/// `--page-size`); the pool also wants a power of two.
const PAGE_KIB_MIN: u64 = PAGE_BYTES_MIN >> 10;
/// See [`PAGE_KIB_MIN`].
const PAGE_KIB_MAX: u64 = PAGE_BYTES_MAX >> 10;
/// Smallest `bench gpu-offload --page-size`: 2 MiB, the bound its `--page-kib` had.
const GPU_PAGE_BYTES_MIN: u64 = 2 << 20;
/// Largest `bench gpu-offload --hidden`: a layer of 65536^2 bf16 is 8 GiB.
const GPU_HIDDEN_MAX: u64 = 1 << 16;
/// Largest `bench gpu-offload --batch`: 2^20 rows (activations of 2^37 bytes at most).
const GPU_BATCH_MAX: u64 = 1 << 20;

/// The loop's shape, shared by the demo and the offload benchmark.
#[derive(Debug, Clone, Args)]
pub struct ShapeArgs {
    /// Number of layers (1 to 65536).
    #[arg(long, default_value_t = 24,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=LAYERS_MAX))]
    layers: usize,
    /// MiB of weights per layer (1 to 1048576).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=LAYER_MIB_MAX))]
    weight_mib: u64,
    /// MiB of activation per layer (1 to 1048576).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=LAYER_MIB_MAX))]
    act_mib: u64,
    /// GPU budget, e.g. 64MiB or 2GiB, at most 16TiB (default: a third of the working
    /// set; a twelfth with a remote tier).
    #[arg(long, value_name = "SIZE", value_parser = size_in(0..=BUDGET_BYTES_MAX))]
    gpu_budget: Option<u64>,
    /// Deprecated: --gpu-budget in MiB.
    #[arg(long, hide = true, conflicts_with = "gpu_budget",
          value_parser = clap::value_parser!(u64).range(..=BUDGET_MIB_MAX))]
    gpu_budget_mib: Option<u64>,
    /// Page size, a power of two from 64KiB to 64MiB.
    #[arg(long, value_name = "SIZE", default_value = "2MiB",
          value_parser = size_in(PAGE_BYTES_MIN..=PAGE_BYTES_MAX))]
    page_size: u64,
    /// Deprecated: --page-size in KiB.
    #[arg(long, hide = true, conflicts_with = "page_size",
          value_parser = clap::value_parser!(u64).range(PAGE_KIB_MIN..=PAGE_KIB_MAX))]
    page_kib: Option<u64>,
    /// Steps (iterations) to run.
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Rounds of arithmetic per page per kernel: more makes the loop more compute-bound
    /// (default 2; the demo with a remote tier defaults to 64, enough compute per byte for
    /// loopback QUIC to keep up on a small machine).
    #[arg(long)]
    compute_passes: Option<u32>,
    /// GPU backend: auto (a GPU if present), sim or cuda.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
}

impl ShapeArgs {
    /// Folds the deprecated spellings into the new ones, with a note for each used.
    fn take_deprecated(&mut self) {
        self.gpu_budget = merge_deprecated(
            self.gpu_budget,
            self.gpu_budget_mib.take(),
            20,
            "--gpu-budget-mib",
            "--gpu-budget",
        );
        if let Some(p) =
            merge_deprecated(None, self.page_kib.take(), 10, "--page-kib", "--page-size")
        {
            self.page_size = p;
        }
    }

    fn train_config(&self) -> Result<TrainConfig> {
        let page = PageSize::new(self.page_size)?;
        let mut cfg = TrainConfig {
            layers: self.layers,
            weight_bytes: self.weight_mib << 20,
            act_bytes: self.act_mib << 20,
            page_size: page,
            steps: self.steps,
            compute_passes: self.compute_passes.unwrap_or(COMPUTE_PASSES_DEFAULT),
            device: self.device,
            ..TrainConfig::demo_default()
        };
        if self.steps == 0 {
            bail!("--steps must be at least 1");
        }
        cfg.gpu_budget_bytes = match self.gpu_budget {
            Some(b) => b,
            None => (cfg.working_set_bytes() / 3 / page.bytes()).max(1) * page.bytes(),
        };
        Ok(cfg)
    }
}

/// Arguments of `spillway demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    shape: ShapeArgs,
    /// Policy: learned, clock or on_demand.
    #[arg(long, default_value = "learned")]
    policy: Policy,
    /// Make these steps (1-based, comma-separated) diverge: swap layers 1 and 2, skip the middle one.
    #[arg(long, value_delimiter = ',')]
    diverge_step: Vec<usize>,
    /// Do not mark step boundaries: the pool must find the loop's period itself.
    #[arg(long)]
    no_step_marks: bool,
    /// Go on past buffers whose pages the remote tier lost (every holder died): skip
    /// their kernels and report them (count and names, in the table and the JSON's
    /// `lost_buffers`). Without it a lost page ends the demo with an error.
    #[arg(long)]
    skip_lost: bool,
    /// Print one JSON object at the end instead of the table (progress still goes to
    /// stderr).
    #[arg(long)]
    json: bool,
    /// Append the per-step table, the totals, the command and the machine to this
    /// Markdown file (e.g. bench/RESULTS.md).
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
    /// Folder for the run's JSON (demo.json) and its plot of each step's time split into
    /// stall and the rest (demo.svg) [default: spillway-out/demo-TIME, printed].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Nodes of the pool, all in this process on loopback QUIC (1: no remote tier, the
    /// host tier holds every page). With 2 or more, node 1 serves the loop and the
    /// others lend their RAM: the working set is 4x the GPU plus host budgets by default,
    /// so pages travel to peers and back every step.
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// Run against the node daemon listening on this Unix socket (`spillway cluster up`
    /// prints each node's, and the command to try) instead of a pool in this process: the
    /// host tier lives in memory shared with the node, the remote tier is the node's peers
    /// (a node with none: no remote tier, when --host-budget holds the working set).
    /// Defaults to $SPILLWAY_SOCKET, which `spillway launch` sets for its job.
    #[arg(long, value_name = "SOCKET", env = "SPILLWAY_SOCKET")]
    connect: Option<PathBuf>,
    /// Host tier budget with a remote tier, e.g. 1GiB, at most 16TiB (default: a sixth of
    /// the working set; the GPU budget then defaults to a twelfth).
    #[arg(long, value_name = "SIZE", value_parser = size_in(0..=BUDGET_BYTES_MAX))]
    host_budget: Option<u64>,
    /// Deprecated: --host-budget in MiB.
    #[arg(long, hide = true, conflicts_with = "host_budget",
          value_parser = clap::value_parser!(u64).range(..=BUDGET_MIB_MAX))]
    host_budget_mib: Option<u64>,
    /// How pages move between the in-process nodes: `quic`, or `ucx` (a build with the
    /// `ucx` feature and libucx; set `UCX_NET_DEVICES=lo` to keep UCX on loopback).
    #[arg(long, value_enum, default_value_t = DemoTransport::Quic)]
    transport: DemoTransport,
}

/// `--transport` of the demo.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoTransport {
    /// QUIC with mutual TLS.
    Quic,
    /// UCX tagged messages (feature `ucx`).
    Ucx,
}

/// `spillway bench ...`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// The offload benchmark: resident, copy-only, on-demand, CLOCK and learned prefetch.
    Offload(OffloadArgs),
    /// The GPU offload benchmark (needs `--features cuda` and a GPU): cuBLAS GEMMs over
    /// layers streamed through the pool, against resident and copy-only.
    GpuOffload(GpuOffloadArgs),
}

/// Arguments of `spillway bench gpu-offload`.
#[derive(Debug, Args)]
pub struct GpuOffloadArgs {
    /// Layers (1 to 65536).
    #[arg(long, default_value_t = 48,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=LAYERS_MAX))]
    layers: usize,
    /// Hidden size: each layer is hidden x hidden bf16 (1 to 65536: 8 GiB a layer; cuBLAS
    /// takes it as an i32).
    #[arg(long, default_value_t = 8192,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=GPU_HIDDEN_MAX))]
    hidden: usize,
    /// Layers the GPU budget holds.
    #[arg(long, default_value_t = 8)]
    slots: usize,
    /// Batch sizes, comma-separated (each 1 to 1048576; cuBLAS takes them as i32).
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,16384",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=GPU_BATCH_MAX))]
    batch: Vec<usize>,
    /// Timed steps per variant and batch (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    #[command(flatten)]
    repeats: RepeatsArg,
    /// Page size, a power of two from 2MiB to 64MiB.
    #[arg(long, value_name = "SIZE", default_value = "8MiB",
          value_parser = size_in(GPU_PAGE_BYTES_MIN..=PAGE_BYTES_MAX))]
    page_size: u64,
    /// Deprecated: --page-size in KiB.
    #[arg(long, hide = true, conflicts_with = "page_size",
          value_parser = clap::value_parser!(u64).range(GPU_PAGE_BYTES_MIN >> 10..=PAGE_KIB_MAX))]
    page_kib: Option<u64>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Append the results, the command and the machine to this Markdown file.
    #[arg(long)]
    record: Option<PathBuf>,
}

/// `--repeats` of the benchmarks that compare variants.
#[derive(Debug, Args)]
pub struct RepeatsArg {
    /// Repeats of every variant, interleaved; the table shows each ratio's median and
    /// min–max over them (1 to 100).
    #[arg(long, default_value_t = repeats::REPEATS_DEFAULT,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(1..=repeats::REPEATS_MAX as u64))]
    repeats: usize,
}

/// Arguments of `spillway bench offload`.
#[derive(Debug, Args)]
pub struct OffloadArgs {
    #[command(flatten)]
    shape: ShapeArgs,
    #[command(flatten)]
    repeats: RepeatsArg,
    /// Print one JSON object at the end (progress still goes to stderr).
    #[arg(long)]
    json: bool,
    /// Folder for the plot (offload.svg) and the JSON results (offload.json) [default:
    /// spillway-out/offload-TIME, printed].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Append the results, the command and the machine to this Markdown file.
    #[arg(long)]
    record: Option<PathBuf>,
}

/// Where the demo's remote tier is.
enum Remote {
    None,
    InProcess(crate::local_pool::LocalPool),
    Daemon(spillway_client::daemon::DaemonLink),
}

pub fn run_demo(mut args: DemoArgs) -> Result<()> {
    let started = std::time::Instant::now();
    args.shape.take_deprecated();
    args.host_budget = merge_deprecated(
        args.host_budget,
        args.host_budget_mib.take(),
        20,
        "--host-budget-mib",
        "--host-budget",
    );
    let mut cfg = args.shape.train_config()?;
    cfg.policy = args.policy;
    cfg.diverge_steps = args.diverge_step.clone();
    cfg.mark_steps = !args.no_step_marks;
    cfg.skip_lost = args.skip_lost;
    if args.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    if args.transport == DemoTransport::Ucx {
        if !cfg!(feature = "ucx") {
            bail!(
                "--transport ucx: this build has no UCX transport; build spillway with \
                 `--features ucx` (system packages: scripts/install-ucx.sh), or use --transport quic"
            );
        }
        if args.connect.is_some() || args.nodes < 2 {
            bail!(
                "--transport chooses how the demo's in-process nodes move pages (--nodes 2 or \
                 more, no --connect); a daemon pool's transport is set by `transport` in the \
                 node configs (`spillway cluster up --transport ucx`)"
            );
        }
    }
    let remote_mode = args.connect.is_some() || args.nodes > 1;
    let page = cfg.page_size.bytes();
    if remote_mode {
        if args.shape.compute_passes.is_none() {
            cfg.compute_passes = COMPUTE_PASSES_REMOTE_DEFAULT;
        }
        // Working set = 4x (GPU + host) unless told otherwise.
        let ws_pages = cfg.page_size.pages_for(cfg.working_set_bytes());
        if args.shape.gpu_budget.is_none() {
            cfg.gpu_budget_bytes = (ws_pages / 12).max(2) * page;
        }
        cfg.host_budget_bytes = Some(match args.host_budget {
            Some(b) => b,
            None => (ws_pages / 6).max(cfg.gpu_budget_bytes / page + 2) * page,
        });
    }
    let host_budget = cfg.pool_builder_host_budget();
    // The remote tier holds what the host tier does not, plus room to swap.
    let remote_need = (cfg.page_size.pages_for(cfg.working_set_bytes()) * 2 + 8) * page;
    let remote = if let Some(socket) = &args.connect {
        let link = spillway_client::daemon::DaemonLink::connect(socket, host_budget, cfg.page_size)
            .with_context(|| format!("connecting to the node at {}", socket.display()))?;
        Remote::Daemon(link)
    } else if args.nodes > 1 {
        Remote::InProcess(
            crate::local_pool::LocalPool::start(
                args.nodes,
                remote_need,
                cfg.page_size,
                remote_need,
                match args.transport {
                    DemoTransport::Quic => spillway_node::PageTransport::Quic,
                    DemoTransport::Ucx => spillway_node::PageTransport::Ucx,
                },
            )
            .context("starting the in-process pool")?,
        )
    } else {
        Remote::None
    };
    let (pool, tier) = match &remote {
        Remote::None => (cfg.pool_builder().build()?, String::new()),
        Remote::Daemon(link) => {
            let budget = link.remote_capacity_bytes().min(remote_need);
            // A pool of one node lends its clients no room on peers (it has none); the
            // loop still runs on the host memory it gives when that holds every page.
            let alone = budget < 2 * page && host_budget >= cfg.working_set_bytes();
            if budget < 2 * page && !alone {
                bail!(
                    "the node at {} has {} of room on its peers, the loop needs {}: wait until \
                     `spillway status` shows every member's capacity, or lend more (a pool of \
                     one node has no peers: give --host-budget of at least the working set, {})",
                    link.socket().display(),
                    spillway_client::fmt_bytes(link.remote_capacity_bytes()),
                    spillway_client::fmt_bytes(remote_need),
                    spillway_client::fmt_bytes(cfg.working_set_bytes()),
                );
            }
            let builder = cfg.pool_builder().host_memory(link.host_memory());
            let pool = if alone {
                builder.build()?
            } else {
                builder
                    .remote_budget_bytes(budget)
                    .remote(link.remote_factory())
                    .build()?
            };
            let describe = format!(
                "the node daemon at {} (client {}){}",
                link.socket().display(),
                link.client_id(),
                if alone {
                    ": its host memory only, no room on peers (the pool has none)"
                } else {
                    ""
                }
            );
            (pool, describe)
        }
        Remote::InProcess(p) => {
            let describe = format!(
                "{} in-process nodes, pages over loopback {} (node 1 serves this pool)",
                args.nodes,
                match args.transport {
                    DemoTransport::Quic => "QUIC",
                    DemoTransport::Ucx => "UCX",
                }
            );
            let pool = cfg
                .pool_builder()
                .remote_budget_bytes(remote_need)
                .remote(crate::service_tier::ServiceTier::factory(
                    p.service(),
                    p.handle(),
                    1,
                    remote_need,
                    describe.clone(),
                ))
                .build()?;
            (pool, describe)
        }
    };
    let progress = Progress::new(cfg.steps as u64, "steps", "demo");
    let step_bytes_max = cfg.working_set_bytes() * 2;
    let mut table = StepTable::new(!args.json, step_bytes_max);
    let mut heading = vec![format!(
        "spillway demo: {} layers, working set {} on a GPU budget of {} ({:.1}x), policy {}, page {}",
        cfg.layers,
        spillway_client::fmt_bytes(cfg.working_set_bytes()),
        spillway_client::fmt_bytes(cfg.gpu_budget_bytes),
        cfg.working_set_bytes() as f64 / cfg.gpu_budget_bytes as f64,
        cfg.policy.name(),
        spillway_client::fmt_bytes(cfg.page_size.bytes()),
    )];
    if !tier.is_empty() {
        heading.push(format!(
            "remote tier: {tier}; host tier {} ({:.1}x GPU + host in the working set)",
            spillway_client::fmt_bytes(host_budget),
            cfg.working_set_bytes() as f64 / (cfg.gpu_budget_bytes + host_budget) as f64,
        ));
    }
    if !args.json {
        println!("{}", bold(&heading[0]));
        for line in &heading[1..] {
            println!("{line}");
        }
    }
    let report = run_training_in(cfg, pool, |s| {
        progress.suspend(|| table.row(s));
        progress.inc(&step_message(s));
    });
    progress.finish();
    if let Remote::InProcess(p) = remote {
        p.shutdown();
    }
    let report = report?;
    if args.json {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer(&mut out, &report)?;
        writeln!(out)?;
    } else {
        table.summary(&report);
        if !report.lost_buffers.is_empty() {
            println!(
                "{} buffers lost with their pages (skipped): {}",
                report.lost_buffers.len(),
                report.lost_buffers.join(", ")
            );
        }
    }
    let all_s = started.elapsed().as_secs_f64();
    let all_line = format!(
        "{all_s:.1} s from start to end, the pool's start-up and shut-down included ({:.1} s of steps)",
        report.total_s
    );
    if !args.json {
        println!("{all_line}");
    }
    let dir = args.out.unwrap_or_else(|| default_out_dir("demo"));
    let json = write_json(&dir, "demo.json", &report)?;
    spillway_bench::plot::time_split(&report, &dir.join("demo.svg"))?;
    eprintln!(
        "wrote {} and its plot demo.svg (each step's time: stall and the rest)",
        json.display()
    );
    if let Some(path) = &args.record {
        let body = format!(
            "{}\n\n{}\n{}\n\n{all_line}\n",
            heading.join("\n\n"),
            steps_table(&report.steps, step_bytes_max).markdown(),
            summary_line(&report)
        );
        crate::record::append_section(path, "Demo", &body, &serde_json::to_string(&report)?)?;
    }
    if report.corrupt_pages > 0 {
        bail!("{} pages were corrupt", report.corrupt_pages);
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn run_gpu_offload(mut args: GpuOffloadArgs) -> Result<()> {
    if let Some(p) = merge_deprecated(None, args.page_kib.take(), 10, "--page-kib", "--page-size") {
        args.page_size = p;
    }
    use spillway_bench::gpu_offload::{GpuOffloadConfig, markdown, run};
    let cfg = GpuOffloadConfig {
        layers: args.layers,
        hidden: args.hidden,
        slots: args.slots,
        batches: args.batch.clone(),
        iters: args.iters.max(1),
        page_size: PageSize::new(args.page_size)?,
        repeats: args.repeats.repeats,
    };
    let quiet = args.json;
    let result = run(&cfg, |m| {
        if !quiet {
            eprintln!("{m}");
        }
    })?;
    if result.busy {
        // On stderr also with --json, so a scripted run's log keeps it.
        for n in spillway_bench::gpu_offload::notes(&result) {
            if n.starts_with("warning") {
                eprintln!("{n}");
            }
        }
    }
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        print!("{}", markdown(&result));
    }
    if let Some(path) = &args.record {
        use std::io::Write as _;
        let mut f = crate::record::open_for_append(path)?;
        let command = std::env::args().collect::<Vec<_>>().join(" ");
        writeln!(
            f,
            "\n### GPU offload benchmark, {}\n\nCommand: `{command}`\n\n{}",
            spillway_bench::report::now_rfc3339(),
            markdown(&result)
        )?;
    }
    if result.corrupt_pages > 0 {
        bail!("{} pages were corrupt", result.corrupt_pages);
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn run_gpu_offload(mut args: GpuOffloadArgs) -> Result<()> {
    merge_deprecated(None, args.page_kib.take(), 10, "--page-kib", "--page-size");
    bail!(
        "`bench gpu-offload` needs a build with CUDA support: rebuild with `--features spillway-cli/cuda`"
    )
}

pub fn run_bench(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::GpuOffload(args) => run_gpu_offload(args),
        BenchCommand::Offload(mut args) => {
            args.shape.take_deprecated();
            let out_dir = args.out.unwrap_or_else(|| default_out_dir("offload"));
            let cfg = OffloadConfig {
                train: args.shape.train_config()?,
                out_dir: out_dir.clone(),
                repeats: args.repeats.repeats,
            };
            let runs = (cfg.repeats * 5) as u64;
            let progress = Progress::new(runs, "runs", "bench offload");
            let result = offload::run(&cfg, |m| progress.inc(m)).context("offload benchmark")?;
            progress.finish();
            if args.json {
                println!("{}", serde_json::to_string(&result)?);
            } else {
                offload::print_table(&result);
            }
            eprintln!(
                "wrote {} and its plot offload.svg",
                out_dir.join("offload.json").display()
            );
            if let Some(path) = &args.record {
                let command = std::env::args().collect::<Vec<_>>().join(" ");
                offload::record_markdown(&result, path, &command)?;
            }
            let corrupt: u64 = result.variants.iter().map(|v| v.corrupt_pages).sum();
            if corrupt > 0 {
                bail!("{corrupt} pages were corrupt");
            }
            Ok(())
        }
    }
}
