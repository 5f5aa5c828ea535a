//! `spillway launch [OPTIONS] -- CMD ARGS...`: one node per host of a multi-host job,
//! then the job's command with `SPILLWAY_SOCKET` set.
//!
//! Safe to run on every rank: [`env::detect`] finds the host and the local rank. Local
//! rank 0 of each host starts the host's node and marks the host ready; the host's other
//! ranks wait for that mark. Each rank runs the command with SIGINT and SIGTERM
//! forwarded, and exits with its status. Local rank 0 stops the node once every rank of
//! its host has exited and every host's job has ended (a barrier in the shared directory:
//! a node holds other hosts' pages, so none leaves before the others are done).
//!
//! How the hosts make one pool, with no private key leaving its host:
//! - Host 0 makes a CA for the job in its run directory (or uses `--ca`, a pool laid out
//!   by `spillway cluster init`), signs its own node certificate, founds the pool alone
//!   and serves joins on the peer port + 2. It writes a one-time join token per other
//!   host into the job's directory under the shared directory (mode 0600).
//! - Every other host makes its own key and joins through host 0's endpoint with its
//!   token (`spillway node --join`), which checks the endpoint against the CA fingerprint
//!   in the token; the pool adds it as a Raft learner. Without a shared directory, give
//!   each host its token (`--token`, or `SPILLWAY_JOIN_TOKEN`, from `spillway cluster token
//!   create` on the host holding `--ca`) and pass `--no-barrier`.
//! - The leader promotes learners, lowest node id first, until the pool has 3 voters
//!   (5 from 5 hosts on): the job's first hosts vote.
//! - Every host waits until host 0's node and its own name one leader and the pool has
//!   every host as an up member with its capacity, and its voters.
//!
//! Only host 0's address is needed (Slurm and `--hosts` name every host; torchrun and
//! LeaderWorkerSet name host 0): each host advertises its own address, the one that
//! routes to host 0 under torchrun and LeaderWorkerSet.

pub mod env;
pub mod plan;
mod run;
pub mod sizing;

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;

use self::env::Explicit;
use self::plan::Plan;

/// Default peer port of every host's node (its `/status` port is the next one).
pub const PEER_PORT_DEFAULT: u16 = 7700;

/// Arguments of `spillway launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// The job's hosts, comma-separated, Slurm hostlist syntax allowed (`gpu[01-04]`);
    /// with --host-index, replaces what the environment says.
    #[arg(long, value_name = "LIST")]
    hosts: Option<String>,
    /// This host's index in --hosts (from 0).
    #[arg(long, value_name = "I")]
    host_index: Option<usize>,
    /// This process's rank among the ranks of its host, with --hosts (default 0).
    #[arg(long, value_name = "R")]
    local_rank: Option<u32>,
    /// Ranks on this host, with --hosts (default 1).
    #[arg(long, value_name = "N")]
    local_world_size: Option<u32>,
    /// A name of this run, the same on every rank (default: from the environment, e.g.
    /// slurm-JOB.STEP).
    #[arg(long, value_name = "KEY")]
    job_key: Option<String>,
    /// The directory the hosts share: the job's join tokens and its end-of-job barrier
    /// [default: $SPILLWAY_DIR, else ~/.spillway/pool].
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Host 0: serve joins with the CA in this directory (`spillway cluster init`'s
    /// `pool/`), whose tokens the operator hands out, instead of a CA made for the job
    /// with a token per host in --dir.
    #[arg(long = "ca", value_name = "DIR")]
    ca: Option<PathBuf>,
    /// Other hosts: the bootstrap endpoint to join through [default: host 0's address,
    /// port --port + 2].
    #[arg(long, value_name = "HOST:PORT")]
    join: Option<String>,
    /// Other hosts: this host's one-time join token, instead of the one host 0 leaves in
    /// --dir.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "SPILLWAY_JOIN_TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,
    /// Where each host keeps its node's config, log, data and socket [default: $TMPDIR or
    /// /tmp].
    #[arg(long, value_name = "DIR")]
    run_base: Option<PathBuf>,
    /// Peer port of every node (UDP); /status on the next (TCP); host 0 serves joins on
    /// the one after (UDP).
    #[arg(long, value_name = "P", default_value_t = PEER_PORT_DEFAULT)]
    port: u16,
    /// Host tier of each node: a size (64GiB) or a share of the memory this host may use
    /// (50%: of the cgroup's memory limit, else of the machine's); refused above it.
    #[arg(long, value_name = "SIZE", default_value = "1GiB",
          value_parser = sizing::parse_budget)]
    host_budget: sizing::BudgetArg,
    /// Whether the job page-locks its host tier (a client with a GPU does), so that
    /// --host-budget must fit RLIMIT_MEMLOCK (`ulimit -l`): auto (where the host has an
    /// NVIDIA device), on or off.
    #[arg(long, value_enum, default_value = "auto")]
    pinned: sizing::Pinned,
    /// Seconds to wait for the pool (and, on other ranks, for the host's node).
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// The nodes' log filter (their SPILLWAY_LOG).
    #[arg(long, default_value = "info")]
    log: String,
    /// Stop this host's node when its own ranks have exited, without waiting for the
    /// other hosts (a node run as a service, e.g. a DaemonSet; no shared directory needed).
    #[arg(long)]
    no_barrier: bool,
    /// Print the plan and exit.
    #[arg(long)]
    dry_run: bool,
    /// The job's command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

/// Runs `spillway launch`.
pub fn run_launch(args: LaunchArgs) -> Result<i32> {
    let explicit = Explicit {
        hosts: args.hosts.clone(),
        host_index: args.host_index,
        local_rank: args.local_rank,
        local_world_size: args.local_world_size,
        job_key: args.job_key.clone(),
    };
    let placement = env::detect(&explicit, &|k| {
        std::env::var(k).ok().filter(|v| !v.is_empty())
    })?;
    let shared_dir = match (&args.dir, std::env::var_os("SPILLWAY_DIR")) {
        (Some(d), _) => d.clone(),
        (None, Some(d)) if !d.is_empty() => PathBuf::from(d),
        _ => match std::env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".spillway").join("pool"),
            None => bail!("--dir: no shared directory given and HOME is not set"),
        },
    };
    let run_base = args.run_base.clone().unwrap_or_else(std::env::temp_dir);
    let host_budget = sizing::host_budget(
        args.host_budget,
        sizing::HostMemory::read(),
        args.pinned.pins(sizing::host_has_gpu()),
    )?;
    let plan = Plan::new(
        placement,
        &shared_dir,
        &run_base,
        args.port,
        host_budget,
        args.command.clone(),
    );
    if args.dry_run {
        print!("{}", plan.describe());
        return Ok(0);
    }
    run::run(&plan, &args)
}
