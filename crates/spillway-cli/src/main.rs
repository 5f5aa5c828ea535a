//! `spillway`: the command-line front of Spillway.
//!
//! - `spillway demo`: a training-like loop whose working set is several times the GPU
//!   budget, on an embedded pool (sim device unless a GPU is present);
//! - `spillway bench offload`: the demo's workload under every policy against its floor;
//! - `spillway replay TRACE`: a recorded access trace through the pool;
//! - `spillway node --config node.toml`: one node daemon until SIGINT/SIGTERM;
//! - `spillway cluster init|up|down|failover-bench`: a pool of node processes on this
//!   machine;
//! - `spillway status`: every node's `/status`;
//! - `spillway bench remote`: page throughput over QUIC against raw TCP, same run.

mod bench_remote;
mod cluster_cmd;
mod demo;
mod local_pool;
mod node_cmd;
mod record;
mod replay;
mod service_tier;
mod status;

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
    Bench(BenchCommand),
    /// Run a recorded access trace (docs/TRACE.md) through the pool.
    Replay(replay::ReplayArgs),
    /// Run one node daemon until SIGINT or SIGTERM.
    Node(node_cmd::NodeArgs),
    /// A pool of node processes on this machine.
    #[command(subcommand)]
    Cluster(cluster_cmd::ClusterCommand),
    /// Members, leader, term, commit index and tier use of every node of a pool.
    Status(status::StatusArgs),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    #[command(flatten)]
    Local(demo::BenchCommand),
    /// Page throughput between two endpoints on loopback: QUIC (mutual TLS) against raw
    /// TCP moving the same bytes in the same run.
    Remote(bench_remote::RemoteArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // A daemon logs what it does; the other commands only warnings.
    let default_log = if matches!(cli.command, Command::Node(_)) {
        "info"
    } else {
        // raft-rs warns when a pool in this process shuts down node by node.
        "warn,raft=error"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SPILLWAY_LOG")
                .unwrap_or_else(|_| default_log.into()),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: node logs go to files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Demo(args) => demo::run_demo(args),
        Command::Bench(BenchCommand::Local(b)) => demo::run_bench(b),
        Command::Bench(BenchCommand::Remote(args)) => bench_remote::run_remote(args),
        Command::Replay(args) => replay::run_replay(args),
        Command::Node(args) => node_cmd::run_node(args),
        Command::Cluster(cmd) => cluster_cmd::run(cmd),
        Command::Status(args) => status::run_status(args),
    }
}
