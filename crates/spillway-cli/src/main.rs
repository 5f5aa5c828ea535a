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
//!
//! Output to a reader that went away (`spillway status | head -1`) ends the command the
//! way it ends `cat` or `ls`: SIGPIPE, quietly, instead of a panic from `println!`. Only
//! the node daemon keeps the Rust default (SIGPIPE ignored): it must outlive a closed log
//! pipe. Sockets are unaffected either way: std and the node send with `MSG_NOSIGNAL`.

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
    let daemon = matches!(&cli.command, Command::Node(n) if !n.check_only());
    if !daemon {
        default_sigpipe();
    }
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

/// Restores SIGPIPE's default action (end the process), which the Rust runtime sets to
/// "ignore" so that a write to a closed pipe returns `BrokenPipe` and `println!` panics.
#[cfg(unix)]
fn default_sigpipe() {
    unsafe extern "C" {
        /// `signal(2)` of the C library std links; `handler` 0 is `SIG_DFL`.
        fn signal(signum: std::ffi::c_int, handler: usize) -> usize;
    }
    const SIG_DFL: usize = 0;
    // SAFETY: called at the start of main before any thread is spawned; `SIG_DFL` installs
    // no handler of ours, so no Rust code runs in signal context.
    unsafe {
        signal(rustix::process::Signal::PIPE.as_raw(), SIG_DFL);
    }
}

#[cfg(not(unix))]
fn default_sigpipe() {}
