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
//! - `spillway launch -- CMD`: one node per host of a multi-host job, then CMD;
//! - `spillway bench remote`: page throughput over QUIC against raw TCP, same run.
//!
//! Output to a reader that went away (`spillway status | head -1`) ends the command the
//! way it ends `cat` or `ls`: SIGPIPE, quietly, instead of a panic from `println!`. Only
//! the node daemon keeps the Rust default (SIGPIPE ignored): it must outlive a closed log
//! pipe. Sockets are unaffected either way: std and the node send with `MSG_NOSIGNAL`.
//!
//! Errors are for people: a user error (an `Err` out of a command) prints one line,
//! `error: ` and its causes joined by `: ` (a cause its outer message already states is
//! said once), and exits 1, with no backtrace whatever `RUST_BACKTRACE` says. A panic is a
//! bug: it prints its message, a backtrace (always) and where to report it.
//!
//! Flags share one vocabulary (`--gpu-budget`, `--host-budget`, `--page-size`,
//! `--transport`, `--device`, `--policy`, `--json`, `--dir`) and sizes one parser
//! ([`size`]).

mod bench_remote;
mod chaos_cmd;
mod chaos_run;
mod cluster_cmd;
mod demo;
mod launch;
mod local_pool;
mod node_cmd;
mod record;
mod replay;
// The demo's in-process remote tier lives in the SDK; `crate::service_tier` names it here.
use spillway_client::service_tier;
mod size;
mod status;

use std::process::ExitCode;

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
    /// Run a training-like loop on 3 in-process nodes; its working set is 12x the GPU
    /// budget by default (3x with --nodes 1).
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
    /// Failure injection: whole pools simulated from seeds, with every invariant checked.
    #[command(subcommand)]
    Chaos(chaos_cmd::ChaosCommand),
    /// Start one node per host of a multi-host job (Slurm, torchrun, LeaderWorkerSet or
    /// --hosts), wait for the pool, run CMD with SPILLWAY_SOCKET set.
    Launch(launch::LaunchArgs),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    #[command(flatten)]
    Local(demo::BenchCommand),
    /// Page throughput between two endpoints on loopback: QUIC (mutual TLS) against raw
    /// TCP moving the same bytes in the same run.
    Remote(bench_remote::RemoteArgs),
}

fn main() -> ExitCode {
    std::panic::set_hook(Box::new(report_bug));
    let cli = Cli::parse();
    let daemon = matches!(&cli.command, Command::Node(n) if !n.check_only());
    if !daemon {
        default_sigpipe();
    }
    // A daemon logs what it does; the other commands only warnings.
    let default_log = if matches!(cli.command, Command::Node(_)) {
        "info"
    } else if matches!(cli.command, Command::Chaos(_)) {
        // The simulated nodes warn at every fault; the run reports what matters.
        "error"
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
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<()> {
    let command = match command {
        // The job's exit status is launch's.
        Command::Launch(args) => std::process::exit(launch::run_launch(args)?),
        other => other,
    };
    match command {
        Command::Demo(args) => demo::run_demo(args),
        Command::Bench(BenchCommand::Local(b)) => demo::run_bench(b),
        Command::Bench(BenchCommand::Remote(args)) => bench_remote::run_remote(args),
        Command::Replay(args) => replay::run_replay(args),
        Command::Node(args) => node_cmd::run_node(args),
        Command::Cluster(cmd) => cluster_cmd::run(cmd),
        Command::Status(args) => status::run_status(args),
        Command::Chaos(cmd) => chaos_cmd::run(cmd),
        Command::Launch(_) => Ok(()),
    }
}

/// An error and its causes on one line, outermost first, joined by `: `. A cause whose
/// text the message before it already contains (a `thiserror` message that formats its
/// `source`) is left out, so nothing is said twice.
fn error_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    let mut previous = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if text.is_empty() || previous.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
        previous = text;
    }
    line
}

/// The panic hook: a panic is a bug in spillway, so it prints its message and place, a
/// backtrace whatever `RUST_BACKTRACE` says, and where to report it.
fn report_bug(info: &std::panic::PanicHookInfo<'_>) {
    let backtrace = std::backtrace::Backtrace::force_capture();
    let thread = std::thread::current();
    eprintln!(
        "thread '{}' {info}\nstack backtrace:\n{backtrace}\n\
         This is a bug in spillway: please report this at the project's issue tracker with \
         the command you ran and the output above.",
        thread.name().unwrap_or("<unnamed>"),
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_line_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        #[derive(Debug)]
        struct Open(std::io::Error);
        impl std::fmt::Display for Open {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "cannot open x: {}", self.0)
            }
        }
        impl std::error::Error for Open {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let err = anyhow::Error::new(Open(io)).context("replaying x");
        assert_eq!(error_line(&err), "replaying x: cannot open x: no such file");
    }
}
