//! `spillway cluster init|up|down|failover-bench|token create|remove`: a pool of node
//! processes on this machine, through [`spillway_cluster`]; join tokens and the removal of
//! a dead host for pools that span hosts.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rustix::process::Signal;
use serde::Serialize;
use spillway_cluster::launcher::{POLL_INTERVAL, status_targets};
use spillway_cluster::process::{self, STOP_GRACE_DEFAULT};
use spillway_cluster::spec::{self, BASE_PORT_DEFAULT};
use spillway_cluster::{
    ClusterSpec, InitOptions, PoolReport, StopOutcome, UpEvent, UpOptions, poll_until, query_pool,
};
use spillway_net::certs::PoolCa;
use spillway_net::join::JoinToken;
use spillway_node::PageTransport;

use crate::size::{BUDGET_BYTES_MAX, deprecated, size_in};

/// `spillway cluster ...`.
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Lay out a pool in a directory: the pool's CA and node certificates, a
    /// node-K.toml per node (loopback ports from --base-port), cluster.json.
    Init(InitArgs),
    /// Start a pool of node processes (initializing it if needed) and wait until every
    /// node answers /status and they agree on a leader.
    Up(UpArgs),
    /// Stop the pool's nodes: SIGTERM, then SIGKILL after --grace-s.
    Down(DownArgs),
    /// Kill the leader (SIGKILL) of a pool of real processes over and over and measure
    /// the time until another node reports itself leader; prints JSON.
    FailoverBench(FailoverArgs),
    /// Join tokens, for hosts that join a running pool (`spillway node --join`).
    #[command(subcommand)]
    Token(TokenCommand),
    /// Remove a host that died for good from a running pool (on the host holding the
    /// pool's CA key, through its bootstrap endpoint). A live host should leave instead
    /// (`spillway node --leave-on-stop`), so its pages move first.
    Remove(RemoveArgs),
}

/// `spillway cluster remove`.
#[derive(Debug, Args)]
pub struct RemoveArgs {
    #[command(flatten)]
    ca: CaArg,
    /// The node to remove.
    #[arg(long, value_name = "ID")]
    node: u64,
    /// The bootstrap endpoint of the node serving joins (its --bootstrap-addr).
    #[arg(long, value_name = "HOST:PORT")]
    via: String,
    /// Remove it even if the pool sees it up (its pages are not moved first).
    #[arg(long)]
    force: bool,
}

/// Time the token a removal makes for itself stays valid: 60 s.
const REMOVE_TOKEN_TTL: Duration = Duration::from_secs(60);

/// The pool's CA, for tokens.
#[derive(Debug, Args)]
pub struct CaArg {
    #[command(flatten)]
    dir: DirArg,
    /// The CA's directory (ca.pem, ca.key.pem) [default: the pool directory's pool/].
    #[arg(long = "ca", value_name = "DIR")]
    ca_dir: Option<PathBuf>,
}

impl CaArg {
    /// The CA, and a one-time token of it valid for `ttl`, recorded in its directory.
    fn token(&self, ttl: Duration) -> Result<(PoolCa, JoinToken)> {
        let ca_dir = match &self.ca_dir {
            Some(d) => d.clone(),
            None => self.dir.resolve().join(spec::CERTS_DIR),
        };
        let ca = PoolCa::load(&ca_dir)
            .with_context(|| format!("reading the pool's CA in {}", ca_dir.display()))?;
        let (token, _) = spillway_net::join::TokenStore::in_ca_dir(&ca_dir).create(
            ca.fingerprint()?,
            ttl,
            spillway_node::now_ms(),
        )?;
        Ok((ca, token))
    }
}

fn remove(args: RemoveArgs) -> Result<()> {
    let (ca, token) = args.ca.token(REMOVE_TOKEN_TTL)?;
    let node = spillway_types::NodeId(args.node);
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(spillway_net::join::remove(
            &args.via, &token, node, args.force,
        ))
        .with_context(|| format!("removing node {} through {}", args.node, args.via))?;
    println!(
        "node {} removed from pool {}: its copies are re-replicated from the others",
        args.node,
        ca.pool_id()
    );
    Ok(())
}

/// `spillway cluster token ...`.
#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Make a one-time join token (on the host holding the pool's CA key): it carries a
    /// secret and the CA certificate's SHA-256, and expires after --ttl.
    Create(TokenCreateArgs),
}

/// `spillway cluster token create`.
#[derive(Debug, Args)]
pub struct TokenCreateArgs {
    #[command(flatten)]
    ca: CaArg,
    /// How long the token may be used: a number and s, m, h or d (at most 30d).
    #[arg(long, default_value = "1h", value_parser = parse_ttl)]
    ttl: Duration,
}

/// `90s`, `30m`, `1h`, `2d`.
fn parse_ttl(text: &str) -> Result<Duration, String> {
    let (digits, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 90s, 30m, 1h or 2d"))?;
    let secs = match unit {
        "s" | "" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("{text:?}: the unit is s, m, h or d")),
    };
    Ok(Duration::from_secs(n.saturating_mul(secs)))
}

fn token_create(args: TokenCreateArgs) -> Result<()> {
    let (ca, token) = args.ca.token(args.ttl)?;
    println!("{token}");
    eprintln!(
        "one-time join token of pool {}, valid for {} s; on the new host:\n  spillway node --config node.toml --join <BOOTSTRAP_HOST:PORT> --token {token}",
        ca.pool_id(),
        args.ttl.as_secs()
    );
    Ok(())
}

/// `--host-budget`'s default: [`spec::HOST_TIER_BYTES_DEFAULT`] as a user writes it
/// (a test checks they agree).
const HOST_BUDGET_DEFAULT: &str = "1GiB";

/// Where the pool lives.
#[derive(Debug, Args)]
pub struct DirArg {
    /// The pool directory [default: $XDG_RUNTIME_DIR/spillway, else /tmp/spillway-$USER].
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

impl DirArg {
    /// The directory given, or the default (announced on stderr).
    pub(crate) fn resolve(&self) -> PathBuf {
        match &self.dir {
            Some(d) => d.clone(),
            None => {
                let d = spec::default_dir();
                eprintln!("pool directory: {}", d.display());
                d
            }
        }
    }
}

/// The layout of a new pool.
#[derive(Debug, Args)]
pub struct LayoutArgs {
    /// Nodes in the pool (1 to 64).
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// First port: node K listens for peers on P+2(K-1) and serves /status on the next.
    #[arg(long, value_name = "P", default_value_t = BASE_PORT_DEFAULT)]
    base_port: u16,
    /// Host tier budget of each node, e.g. 1GiB or 512MiB, at most 16TiB (the nodes'
    /// `host_budget`).
    #[arg(long, value_name = "SIZE", default_value = HOST_BUDGET_DEFAULT,
          value_parser = size_in(0..=BUDGET_BYTES_MAX))]
    host_budget: u64,
    /// Deprecated: --host-budget.
    #[arg(long, hide = true, value_name = "SIZE", conflicts_with = "host_budget",
          value_parser = size_in(0..=BUDGET_BYTES_MAX))]
    host_tier_bytes: Option<u64>,
    /// How the nodes move pages: quic, or ucx (a build with the `ucx` feature and libucx;
    /// set UCX_NET_DEVICES=lo to keep UCX on loopback). Raft always uses QUIC.
    #[arg(long, value_enum, default_value_t = TransportArg::Quic)]
    transport: TransportArg,
}

/// `--transport` of the pool's nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportArg {
    /// QUIC with mutual TLS.
    Quic,
    /// UCX tagged messages (feature `ucx`).
    Ucx,
}

impl LayoutArgs {
    fn options(&self, force: bool) -> InitOptions {
        let host_tier_bytes = match self.host_tier_bytes {
            Some(b) => {
                deprecated("--host-tier-bytes", "--host-budget", b);
                b
            }
            None => self.host_budget,
        };
        InitOptions {
            nodes: self.nodes,
            base_port: self.base_port,
            host_tier_bytes,
            force,
            transport: match self.transport {
                TransportArg::Quic => PageTransport::Quic,
                TransportArg::Ucx => PageTransport::Ucx,
            },
        }
    }
}

/// `spillway cluster init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    #[command(flatten)]
    dir: DirArg,
    #[command(flatten)]
    layout: LayoutArgs,
    /// Replace an existing pool (refused while one of its nodes runs).
    #[arg(long)]
    force: bool,
}

/// `spillway cluster up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    #[command(flatten)]
    dir: DirArg,
    /// The layout, used when the directory holds no pool yet (with a pool, --nodes
    /// must match it).
    #[command(flatten)]
    layout: LayoutArgs,
    /// Seconds to wait for every node to answer and a leader to be agreed.
    #[arg(long, default_value_t = 30)]
    timeout_s: u64,
    /// The nodes' log filter (their SPILLWAY_LOG).
    #[arg(long, default_value = "info")]
    log: String,
}

/// `spillway cluster down`.
#[derive(Debug, Args)]
pub struct DownArgs {
    #[command(flatten)]
    dir: DirArg,
    /// Seconds nodes have to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = STOP_GRACE_DEFAULT.as_secs())]
    grace_s: u64,
}

/// `spillway cluster failover-bench`.
#[derive(Debug, Args)]
pub struct FailoverArgs {
    /// Leader kills to measure.
    #[arg(long, default_value_t = 20)]
    trials: u32,
    /// Nodes in the pool.
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// First port of the benchmark's own pool (a temporary directory, removed after).
    #[arg(long, default_value_t = 17700)]
    base_port: u16,
    /// Seconds a trial may take to elect a new leader or to bring the killed node back.
    #[arg(long, default_value_t = 15)]
    trial_timeout_s: u64,
    /// Print only the JSON document (no progress).
    #[arg(long)]
    json: bool,
    /// Append the result to this markdown file (e.g. bench/RESULTS.md).
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
}

/// Runs `spillway cluster ...`.
pub fn run(cmd: ClusterCommand) -> Result<()> {
    match cmd {
        ClusterCommand::Init(a) => init(a),
        ClusterCommand::Up(a) => up(a),
        ClusterCommand::Down(a) => down(a),
        ClusterCommand::FailoverBench(a) => failover_bench(a),
        ClusterCommand::Token(TokenCommand::Create(a)) => token_create(a),
        ClusterCommand::Remove(a) => remove(a),
    }
}

/// One row per node: its addresses, then its config, log and client socket (what
/// `spillway demo --connect` takes) under each other.
fn print_nodes(spec: &ClusterSpec) {
    println!(
        "{:>4}  {:<21} {:<21} config / log / client socket",
        "node", "peer addr", "status addr"
    );
    for n in &spec.nodes {
        println!(
            "{:>4}  {:<21} {:<21} {}",
            n.id,
            n.peer_addr.to_string(),
            n.metrics_addr.to_string(),
            n.config.display()
        );
        println!("{:>50}{}", "", n.log.display());
        println!("{:>50}{}", "", n.client_socket.display());
    }
}

fn init(args: InitArgs) -> Result<()> {
    let dir = args.dir.resolve();
    let spec = spillway_cluster::init(&dir, &args.layout.options(args.force))?;
    println!(
        "pool {} laid out in {} ({} nodes)",
        spec.pool_id,
        spec.dir.display(),
        spec.nodes.len()
    );
    print_nodes(&spec);
    Ok(())
}

fn up(args: UpArgs) -> Result<()> {
    let dir = args.dir.resolve();
    let opts = UpOptions {
        init: args.layout.options(false),
        exe: std::env::current_exe().context("finding the spillway executable")?,
        ready_timeout: Duration::from_secs(args.timeout_s),
        log_filter: args.log.clone(),
    };
    let bar = ProgressBar::with_draw_target(
        Some(u64::from(args.layout.nodes)),
        ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed}] {pos}/{len} nodes answering {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    let mut on_event = |e: &UpEvent| match e {
        UpEvent::Initialized { nodes } => {
            bar.println(format!("initialized a pool of {nodes} nodes"));
        }
        UpEvent::Spawned { node, pid } => bar.println(format!("started node {node} (pid {pid})")),
        UpEvent::AlreadyRunning { node, pid } => {
            bar.println(format!("node {node} already runs (pid {pid})"));
        }
        UpEvent::Waiting {
            answering,
            total,
            leader,
        } => {
            bar.set_length(*total as u64);
            bar.set_position(*answering as u64);
            bar.set_message(match leader {
                Some(l) => format!("leader: node {l}"),
                None => "no leader yet".to_string(),
            });
        }
    };
    let result = spillway_cluster::up(&dir, &opts, &mut on_event);
    bar.finish_and_clear();
    let report = result?;
    println!(
        "pool {} up in {:.1} s: {} nodes, leader node {} (term {}); {} started now",
        report.spec.pool_id,
        report.elapsed.as_secs_f64(),
        report.spec.nodes.len(),
        report.status.leader.unwrap_or(0),
        report.status.term.unwrap_or(0),
        report.started.len()
    );
    print_nodes(&report.spec);
    let dir = report.spec.dir.display();
    println!("\nnext:");
    if let Some(first) = report.spec.nodes.first() {
        println!(
            "  spillway demo --connect {}   # the demo as a client of node {}",
            first.client_socket.display(),
            first.id
        );
    }
    println!("  spillway status --dir {dir}");
    println!("  spillway cluster down --dir {dir}");
    Ok(())
}

fn down(args: DownArgs) -> Result<()> {
    let dir = args.dir.resolve();
    let (spec, report) = spillway_cluster::down(&dir, Duration::from_secs(args.grace_s))?;
    let mut stopped = 0;
    for (node, pid, outcome) in &report.nodes {
        let pid = pid.map(|p| format!(" (pid {p})")).unwrap_or_default();
        let what = match outcome {
            StopOutcome::Terminated => "stopped",
            StopOutcome::Killed => "killed after the grace period",
            StopOutcome::NotRunning => "was not running",
        };
        if *outcome != StopOutcome::NotRunning {
            stopped += 1;
        }
        println!("node {node}{pid}: {what}");
    }
    println!(
        "{stopped} of {} nodes of the pool in {} stopped",
        spec.nodes.len(),
        spec.dir.display()
    );
    Ok(())
}

/// Node processes this command started; killed and reaped when dropped, so an error or a
/// panic leaves none behind.
struct NodeProcesses {
    children: Vec<(u64, Child)>,
}

impl NodeProcesses {
    fn kill(&mut self, node: u64) -> Result<()> {
        if let Some(i) = self.children.iter().position(|(id, _)| *id == node) {
            let (id, mut child) = self.children.remove(i);
            process::signal_node(id, child.id(), Signal::KILL)?;
            child.wait().context("reaping a killed node")?;
        }
        Ok(())
    }
}

impl Drop for NodeProcesses {
    fn drop(&mut self) {
        let pids: Vec<(u64, u32)> = self.children.iter().map(|(id, c)| (*id, c.id())).collect();
        let _ = process::stop_pids(&pids, Duration::from_secs(2));
        for (_, child) in &mut self.children {
            let _ = child.wait();
        }
    }
}

/// What `cluster failover-bench` measured.
#[derive(Debug, Serialize)]
struct FailoverReport {
    nodes: u32,
    trials: u32,
    /// Time from SIGKILL of the leader to another node reporting itself leader, per trial.
    new_leader_ms: Vec<f64>,
    new_leader_ms_p50: f64,
    new_leader_ms_p99: f64,
    new_leader_ms_max: f64,
    /// Time from restarting the killed node to its commit index reaching the leader's.
    caught_up_ms_p50: f64,
    caught_up_ms_max: f64,
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn failover_bench(args: FailoverArgs) -> Result<()> {
    if args.trials == 0 {
        bail!("--trials must be at least 1");
    }
    let tmp = std::env::temp_dir().join(format!("spillway-failover-{}", std::process::id()));
    let result = failover_trials(&args, &tmp);
    let _ = std::fs::remove_dir_all(&tmp);
    let report = result?;
    let json = serde_json::to_string(&report)?;
    println!("{json}");
    if !args.json {
        eprintln!(
            "{} kills of the leader of {} node processes: new leader after p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; restarted node caught up after p50 {:.0} ms",
            report.trials,
            report.nodes,
            report.new_leader_ms_p50,
            report.new_leader_ms_p99,
            report.new_leader_ms_max,
            report.caught_up_ms_p50,
        );
    }
    if let Some(path) = &args.record {
        let body = format!(
            "{} SIGKILLs of the leader of {} `spillway node` processes on loopback; time until another node reports itself leader (polling every node's `/status`), then the killed node restarted with its config until its commit index reaches the leader's.\n\n| trials | new leader p50 | p99 | max | caught up p50 | max |\n|---|---|---|---|---|---|\n| {} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms |\n",
            report.trials,
            report.nodes,
            report.trials,
            report.new_leader_ms_p50,
            report.new_leader_ms_p99,
            report.new_leader_ms_max,
            report.caught_up_ms_p50,
            report.caught_up_ms_max,
        );
        crate::record::append_section(path, "Leader fail-over of node processes", &body, &json)?;
    }
    Ok(())
}

fn failover_trials(args: &FailoverArgs, dir: &Path) -> Result<FailoverReport> {
    let spec = spillway_cluster::init(
        dir,
        &InitOptions {
            nodes: args.nodes,
            base_port: args.base_port,
            host_tier_bytes: 64 << 20,
            force: true,
            transport: PageTransport::Quic,
        },
    )?;
    let exe = std::env::current_exe().context("finding the spillway executable")?;
    let timeout = Duration::from_secs(args.trial_timeout_s);
    let mut nodes = NodeProcesses {
        children: Vec::new(),
    };
    for n in &spec.nodes {
        nodes
            .children
            .push((n.id, process::spawn_node(&exe, n, "info")?));
    }
    spillway_cluster::wait_ready(&spec, timeout, &mut nodes.children, &mut |_| {})?;
    let targets = status_targets(&spec);
    let quick = Duration::from_millis(200);
    let (mut new_leader_ms, mut caught_up_ms) = (Vec::new(), Vec::new());
    for trial in 0..args.trials {
        // Kill only a settled pool: every node up, one leader, the same commit index.
        let Some(before) = poll_until(timeout, POLL_INTERVAL, || {
            Some(query_pool(&targets, quick)).filter(|r| r.settled(targets.len()))
        }) else {
            bail!("trial {trial}: the pool did not settle within {timeout:?}");
        };
        let Some(old) = before.leader else {
            bail!("trial {trial}: no leader before the kill");
        };
        let old_term = before.term.unwrap_or(0);
        let others: Vec<_> = targets
            .iter()
            .filter(|(_, id)| *id != Some(old))
            .cloned()
            .collect();
        let killed_at = Instant::now();
        nodes.kill(old)?;
        let elected = poll_until(timeout, Duration::from_millis(5), || {
            let r = query_pool(&others, quick);
            r.leader.filter(|&l| l != old && r.term > Some(old_term))
        });
        let Some(new) = elected else {
            bail!("trial {trial}: no new leader within {timeout:?} after killing node {old}");
        };
        let elapsed_ms = killed_at.elapsed().as_secs_f64() * 1e3;
        new_leader_ms.push(elapsed_ms);

        let node = spec.node(old).expect("the leader is a node of the pool");
        let restarted_at = Instant::now();
        nodes
            .children
            .push((old, process::spawn_node(&exe, node, "info")?));
        let caught_up = poll_until(timeout, POLL_INTERVAL, || {
            let r: PoolReport = query_pool(&targets, quick);
            let leader_commit = r.node(r.leader?)?.commit_index;
            (r.answering == targets.len()
                && r.leader_agreed
                && r.node(old)?.commit_index >= leader_commit)
                .then_some(())
        });
        if caught_up.is_none() {
            bail!("trial {trial}: node {old} did not catch up within {timeout:?} of its restart");
        }
        caught_up_ms.push(restarted_at.elapsed().as_secs_f64() * 1e3);
        if !args.json {
            eprintln!(
                "trial {trial}: killed node {old}, node {new} leads after {elapsed_ms:.0} ms"
            );
        }
    }
    let mut sorted = new_leader_ms.clone();
    sorted.sort_by(f64::total_cmp);
    caught_up_ms.sort_by(f64::total_cmp);
    Ok(FailoverReport {
        nodes: args.nodes,
        trials: args.trials,
        new_leader_ms_p50: percentile(&sorted, 0.50),
        new_leader_ms_p99: percentile(&sorted, 0.99),
        new_leader_ms_max: sorted.last().copied().unwrap_or(0.0),
        caught_up_ms_p50: percentile(&caught_up_ms, 0.50),
        caught_up_ms_max: caught_up_ms.last().copied().unwrap_or(0.0),
        new_leader_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_budget_default_is_the_cluster_default() {
        assert_eq!(
            crate::size::parse_size(HOST_BUDGET_DEFAULT),
            Ok(spec::HOST_TIER_BYTES_DEFAULT)
        );
    }

    #[test]
    fn ttls_take_a_unit() {
        assert_eq!(parse_ttl("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_ttl("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_ttl("2d"), Ok(Duration::from_secs(172_800)));
        assert!(parse_ttl("1w").is_err());
        assert!(parse_ttl("h").is_err());
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.50), 10.0);
        assert_eq!(percentile(&v, 0.99), 20.0);
        assert_eq!(percentile(&[], 0.99), 0.0);
    }
}
