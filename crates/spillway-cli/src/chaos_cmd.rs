//! `spillway chaos sim`: the whole pool simulated from seeds, under faults, with its
//! invariants checked ([`spillway_node::chaos`]; what each fault and invariant means:
//! docs/CHAOS.md).

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use spillway_node::chaos::{self, ChaosConfig, FaultMix, RunReport};

/// The commit this binary was built from (`git rev-parse`, at build time).
pub const COMMIT: &str = env!("SPILLWAY_COMMIT");

/// `spillway chaos ...`.
#[derive(Debug, Subcommand)]
pub enum ChaosCommand {
    /// Simulate whole pools (Raft with its log on disk, placement, page service, host
    /// stores, a client per node) from seeds, with faults injected and every invariant
    /// checked after each event; a failing seed is printed with its shrunk event log.
    Sim(SimArgs),
    /// Break a real pool: node processes each in its own network namespace, a demo
    /// client, and scenarios (SIGKILL of a holder, of the leader, of two nodes; SIGSTOP;
    /// partitions of a node and of the leader; one-way loss; a full log disk). Needs root.
    Run(crate::chaos_run::RunArgs),
}

/// Which faults a simulation injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FaultKind {
    /// Every kind below.
    All,
    /// Crashes (with torn log writes) and restarts.
    Crashes,
    /// Processes stopped for a while.
    Pauses,
    /// Isolation, one-way cuts, a node cut from the leader, a minority split off.
    Partitions,
    /// Message loss, delay (reordering) and duplication.
    Network,
    /// A node's clock skewed (seconds to minutes, either way) or stopped.
    Clocks,
    /// A node's log disk slow (20 to 500 ms a write).
    Disks,
    /// No faults: the workload alone.
    None,
}

/// `spillway chaos sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// How many seeds to run, from --first-seed.
    #[arg(long, default_value_t = 100, value_name = "N")]
    seeds: u64,
    /// The first seed of --seeds.
    #[arg(long, default_value_t = 1, value_name = "S")]
    first_seed: u64,
    /// Run this one seed and print its event log (replays a failure exactly).
    #[arg(long, value_name = "S", conflicts_with_all = ["seeds", "first_seed"])]
    seed: Option<u64>,
    /// Nodes in the pool (3 to 9); by default the seed chooses 3 to 5.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(3..=9))]
    nodes: Option<u64>,
    /// Copies of each page.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=3))]
    replicas: u8,
    /// Simulated seconds of workload under faults (the end checks come after).
    #[arg(long, default_value_t = 60, value_name = "S", value_parser = clap::value_parser!(u64).range(10..=3600))]
    length_s: u64,
    /// Faults to inject (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
    faults: Vec<FaultKind>,
    /// Runs at once (default: the machine's cores).
    #[arg(long, value_name = "N")]
    jobs: Option<usize>,
    /// Do not shrink a failing seed's fault list.
    #[arg(long)]
    no_shrink: bool,
    /// Where the simulated nodes keep their logs (removed after each run).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct Summary {
    commit: &'static str,
    seeds: u64,
    first_seed: u64,
    passed: u64,
    failed: Vec<u64>,
    sim_ms: u64,
    wall_ms: u64,
    /// Simulated time over wall time, summed over the runs.
    sim_over_wall: f64,
    events: u64,
    spills_ok: u64,
    fetches_ok: u64,
    pages_verified: u64,
    pages_lost_allowed: u64,
    pages_repaired: u64,
    /// Spills and discards that waited for a repair batch holding their pages.
    ops_waited: u64,
    /// Accesses of the clients running the real core.
    core_acquires: u64,
    /// Buffers those clients lost where the loss rule allowed it.
    core_buffers_lost_allowed: u64,
    faults: u64,
    crashes: u64,
    /// The first failing run, shrunk (its fault list cut to what still fails).
    #[serde(skip_serializing_if = "Option::is_none")]
    first_failure: Option<RunReport>,
}

fn mix(kinds: &[FaultKind]) -> FaultMix {
    let mut m = FaultMix::none();
    for k in kinds {
        match k {
            FaultKind::All => m = FaultMix::all(),
            FaultKind::Crashes => m.crashes = true,
            FaultKind::Pauses => m.pauses = true,
            FaultKind::Partitions => m.partitions = true,
            FaultKind::Network => m.network = true,
            FaultKind::Clocks => m.clocks = true,
            FaultKind::Disks => m.disks = true,
            FaultKind::None => {}
        }
    }
    m
}

pub fn run(cmd: ChaosCommand) -> Result<()> {
    match cmd {
        ChaosCommand::Sim(args) => run_sim(args),
        ChaosCommand::Run(args) => crate::chaos_run::run(args),
    }
}

fn run_sim(args: SimArgs) -> Result<()> {
    let config = ChaosConfig {
        nodes: args.nodes.unwrap_or(0),
        replicas: args.replicas,
        length_ms: args.length_s * 1000,
        faults: mix(&args.faults),
        keep_log: args.seed.is_some(),
        ..ChaosConfig::default()
    };
    let root = tempfile::Builder::new()
        .prefix("spillway-chaos-")
        .tempdir_in(args.dir.clone().unwrap_or_else(std::env::temp_dir))
        .context("making the simulation's directory")?;
    if let Some(seed) = args.seed {
        let report = chaos::run(seed, &config, &root.path().join("run"))?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            for line in &report.log {
                println!("{line}");
            }
            print_report(&report);
        }
        if !report.passed() {
            bail!(
                "seed {seed} broke {} invariant(s) (commit {COMMIT})",
                report.violations.len()
            );
        }
        return Ok(());
    }
    let jobs = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let bar = if args.json {
        ProgressBar::with_draw_target(Some(args.seeds), ProgressDrawTarget::hidden())
    } else {
        ProgressBar::new(args.seeds)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} seeds, {elapsed} ({msg})")
            .expect("a valid template"),
    );
    let next = AtomicU64::new(0);
    let reports: Mutex<Vec<RunReport>> = Mutex::new(Vec::new());
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= args.seeds {
                        return;
                    }
                    let seed = args.first_seed + i;
                    let dir = root.path().join(format!("seed-{seed}"));
                    match chaos::run(seed, &config, &dir) {
                        Ok(r) => {
                            if !r.passed() {
                                bar.println(format!("seed {seed}: {}", r.violations[0]));
                            }
                            reports.lock().expect("reports").push(r);
                        }
                        Err(e) => errors
                            .lock()
                            .expect("errors")
                            .push(format!("seed {seed}: {e}")),
                    }
                    let _ = std::fs::remove_dir_all(&dir);
                    let failed = reports
                        .lock()
                        .expect("reports")
                        .iter()
                        .filter(|r| !r.passed())
                        .count();
                    bar.set_message(format!("{failed} failed"));
                    bar.inc(1);
                }
            });
        }
    });
    bar.finish_and_clear();
    let wall_ms = started.elapsed().as_millis() as u64;
    let errors = errors.into_inner().expect("errors");
    if let Some(e) = errors.first() {
        bail!("{} run(s) could not be made; the first: {e}", errors.len());
    }
    let mut reports = reports.into_inner().expect("reports");
    reports.sort_by_key(|r| r.seed);
    let sum = |f: fn(&RunReport) -> u64| reports.iter().map(f).sum::<u64>();
    let failed: Vec<u64> = reports
        .iter()
        .filter(|r| !r.passed())
        .map(|r| r.seed)
        .collect();
    let first_failure = match reports.iter().find(|r| !r.passed()) {
        Some(r) if !args.no_shrink => {
            eprintln!("shrinking seed {}'s {} faults...", r.seed, r.faults.len());
            Some(chaos::shrink(r, &config, &root.path().join("shrink"))?)
        }
        Some(r) => Some(r.clone()),
        None => None,
    };
    let sim_ms = sum(|r| r.sim_ms);
    let run_wall_ms = sum(|r| r.wall_ms).max(1);
    let summary = Summary {
        commit: COMMIT,
        seeds: args.seeds,
        first_seed: args.first_seed,
        passed: reports.len() as u64 - failed.len() as u64,
        failed: failed.clone(),
        sim_ms,
        wall_ms,
        sim_over_wall: sim_ms as f64 / run_wall_ms as f64,
        events: sum(|r| r.counts.events),
        spills_ok: sum(|r| r.counts.spills_ok),
        fetches_ok: sum(|r| r.counts.fetches_ok),
        pages_verified: sum(|r| r.counts.pages_verified),
        pages_lost_allowed: sum(|r| r.counts.pages_lost_allowed),
        pages_repaired: sum(|r| r.counts.pages_repaired),
        ops_waited: sum(|r| r.counts.ops_waited),
        core_acquires: sum(|r| r.counts.core_acquires),
        core_buffers_lost_allowed: sum(|r| r.counts.core_buffers_lost_allowed),
        faults: sum(|r| r.counts.faults),
        crashes: sum(|r| r.counts.crashes),
        first_failure,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_summary(&summary, jobs);
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} seeds broke an invariant: {:?} (commit {COMMIT}; replay one with `spillway chaos sim --seed S`)",
            failed.len(),
            args.seeds,
            failed
        );
    }
    Ok(())
}

fn print_report(r: &RunReport) {
    println!(
        "seed {}: {} nodes, {} faults ({} crashes), {:.1} s simulated in {:.2} s, {} events",
        r.seed,
        r.nodes,
        r.counts.faults,
        r.counts.crashes,
        r.sim_ms as f64 / 1e3,
        r.wall_ms as f64 / 1e3,
        r.counts.events
    );
    println!(
        "  spills {} ok / {} failed, fetches {} ok / {} failed, {} pages verified, {} copies repaired, {} pages lost as allowed, {} operations waited for a repair batch",
        r.counts.spills_ok,
        r.counts.spills_failed,
        r.counts.fetches_ok,
        r.counts.fetches_failed,
        r.counts.pages_verified,
        r.counts.pages_repaired,
        r.counts.pages_lost_allowed,
        r.counts.ops_waited
    );
    println!("  event log hash {:016x}, commit {COMMIT}", r.log_hash);
    if r.passed() {
        println!("  every invariant held");
    }
    for v in &r.violations {
        println!("  VIOLATION {v}");
    }
}

fn print_summary(s: &Summary, jobs: usize) {
    println!("spillway chaos sim, commit {}", s.commit);
    println!(
        "| seeds | passed | failed | simulated | wall | sim/wall (per run) | events | pages verified | copies repaired | lost as allowed | faults | crashes |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {}..{} | {} | {} | {:.0} s | {:.1} s ({jobs} jobs) | {:.0}x | {} | {} | {} | {} | {} | {} |",
        s.first_seed,
        s.first_seed + s.seeds - 1,
        s.passed,
        s.failed.len(),
        s.sim_ms as f64 / 1e3,
        s.wall_ms as f64 / 1e3,
        s.sim_over_wall,
        s.events,
        s.pages_verified,
        s.pages_repaired,
        s.pages_lost_allowed,
        s.faults,
        s.crashes
    );
    if let Some(r) = &s.first_failure {
        println!(
            "\nfirst failing seed {} (faults shrunk to {}):",
            r.seed,
            r.faults.len()
        );
        for line in &r.log {
            println!("{line}");
        }
        print_report(r);
    }
}
