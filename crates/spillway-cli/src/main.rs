//! `spillway`: the command-line front of Spillway.
//!
//! - `spillway demo`: a training-like loop whose working set is several times the GPU
//!   budget, on an embedded pool (sim device unless a GPU is present);
//! - `spillway bench offload`: the demo's workload under every policy against its floor;
//! - `spillway replay TRACE`: a recorded access trace through the pool.

mod demo;
mod replay;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Spillway: a tiered memory pool for GPU jobs whose working set exceeds GPU memory.
#[derive(Debug, Parser)]
#[command(name = "spillway", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a training-like loop whose working set is 3x the GPU budget.
    Demo(demo::DemoArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(demo::BenchCommand),
    /// Run a recorded access trace (docs/TRACE.md) through the pool.
    Replay(replay::ReplayArgs),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SPILLWAY_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(args) => demo::run_demo(args),
        Command::Bench(b) => demo::run_bench(b),
        Command::Replay(args) => replay::run_replay(args),
    }
}
