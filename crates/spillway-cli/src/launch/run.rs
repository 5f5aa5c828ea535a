//! The side effects of `spillway launch`, in the order [`super`] describes: addresses,
//! certificates and join tokens, node config, node process, readiness, the job, the
//! barriers.
//! Every wait polls a condition (a file, a process, the pool's `/status`) and ends early
//! on SIGINT or SIGTERM; the node is stopped on every way out ([`NodeGuard`]).

use std::fs;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustix::process::{Pid, Signal, kill_process};
use spillway_cluster::process::{self, LOG_TAIL_LINES};
use spillway_cluster::spec;
use spillway_cluster::{NodeSpec, PoolReport, query_pool};
use spillway_net::certs::PoolCa;
use spillway_net::join::TokenStore;
use spillway_node::NodeConfig;
use spillway_node::config::MemberAddr;
use spillway_node::membership::voters_wanted;
use spillway_types::NodeId;
use tokio::signal::unix::{SignalKind, signal};

use super::LaunchArgs;
use super::env::{Hosts, Source};
use super::plan::Plan;

/// Interval between two checks of a condition being waited for.
const POLL: Duration = Duration::from_millis(50);
/// Time each node has to answer one `/status` query while waiting for the pool.
const STATUS_TIMEOUT: Duration = Duration::from_millis(250);
/// Time the node has to exit after SIGTERM before SIGKILL.
const NODE_STOP_GRACE: Duration = Duration::from_secs(10);
/// Largest marker or token file read: 4 KiB.
const MARKER_BYTES_MAX: u64 = 4096;

/// SIGINT and SIGTERM of this process.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("listening for SIGINT")?,
        })
    }

    async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => Signal::TERM,
            _ = self.int.recv() => Signal::INT,
        }
    }
}

/// Why a wait ended without its condition.
#[derive(Debug, thiserror::Error)]
enum WaitError {
    #[error("{what}: not after {0:?}", what = .1)]
    Timeout(Duration, String),
    #[error("{what}: interrupted by signal {0:?}", what = .1)]
    Signal(Signal, String),
}

/// Polls `f` every [`POLL`] until it returns `Some`, `timeout` passes or a signal comes.
async fn wait_for<T>(
    what: &str,
    timeout: Option<Duration>,
    signals: &mut Signals,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        if let Some(t) = timeout
            && start.elapsed() >= t
        {
            return Err(WaitError::Timeout(t, what.to_string()).into());
        }
        tokio::select! {
            () = tokio::time::sleep(POLL) => {}
            s = signals.next() => return Err(WaitError::Signal(s, what.to_string()).into()),
        }
    }
}

/// The host's node process; stopped (SIGTERM, then SIGKILL) and reaped when dropped.
struct NodeGuard {
    id: u64,
    child: Child,
}

impl Drop for NodeGuard {
    fn drop(&mut self) {
        let _ = process::stop_pids(&[(self.id, self.child.id())], NODE_STOP_GRACE);
        let _ = self.child.wait();
    }
}

/// Writes `text` to `path` so that readers see all of it or nothing.
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// A small file's text, `None` if it does not exist (or is too large to be ours).
fn read_marker(path: &Path) -> Option<String> {
    let len = fs::metadata(path).ok()?.len();
    (len <= MARKER_BYTES_MAX)
        .then(|| fs::read_to_string(path).ok())
        .flatten()
}

fn pid_alive(pid: u32) -> bool {
    process::pid_alive(pid)
}

/// Runs the plan; returns the job's exit status.
pub(super) fn run(plan: &Plan, args: &LaunchArgs) -> Result<i32> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(run_async(plan, args))
}

async fn run_async(plan: &Plan, args: &LaunchArgs) -> Result<i32> {
    let mut signals = Signals::new()?;
    let timeout = Duration::from_secs(args.timeout_s);
    let p = &plan.placement;
    fs::create_dir_all(&plan.run_dir)
        .with_context(|| format!("creating {}", plan.run_dir.display()))?;
    let lr = p.local_rank;
    let ready_file = plan.run_dir.join("ready");
    // Registered before anything else, so local rank 0 can tell a rank that died.
    write_atomic(
        &plan.run_dir.join(format!("rank-{lr}.pid")),
        &format!("{}\n", std::process::id()),
    )?;

    let (node, status_addr) = if plan.starts_node() {
        for stale in ["ready".to_string()]
            .into_iter()
            .chain((0..p.local_world_size).map(|r| format!("done-{r}")))
        {
            let _ = fs::remove_file(plan.run_dir.join(stale));
        }
        let (guard, status_addr) = start_node(plan, args, timeout, &mut signals).await?;
        write_atomic(
            &ready_file,
            &format!(
                "{} {} {status_addr}\n",
                guard.child.id(),
                std::process::id()
            ),
        )?;
        (Some(guard), status_addr.to_string())
    } else {
        let socket = plan.client_socket();
        let status_addr = wait_for(
            "waiting for local rank 0's node",
            Some(timeout),
            &mut signals,
            || {
                let Some(text) = read_marker(&ready_file) else {
                    return Ok(None);
                };
                // "<node pid> <launch pid> <status address>"
                let words: Vec<&str> = text.split_whitespace().collect();
                let alive = words
                    .iter()
                    .filter_map(|w| w.parse::<u32>().ok())
                    .all(pid_alive);
                Ok((alive && words.len() == 3 && socket.exists()).then(|| words[2].to_string()))
            },
        )
        .await?;
        (None, status_addr)
    };

    let status = run_job(plan, &status_addr, &mut signals).await?;
    write_atomic(&plan.run_dir.join(format!("done-{lr}")), "done\n")?;
    if let Some(guard) = node {
        end_of_job(plan, args.no_barrier, &mut signals).await?;
        drop(guard);
        let _ = fs::remove_file(&ready_file);
        eprintln!(
            "spillway launch: node {} stopped (host {} done)",
            plan.node_id, p.host_index
        );
    }
    Ok(status)
}

/// Waits until every rank of this host has exited (its done marker, or its process gone),
/// then until every host's rank 0 got there too.
async fn end_of_job(plan: &Plan, no_barrier: bool, signals: &mut Signals) -> Result<()> {
    let p = &plan.placement;
    wait_for("waiting for this host's other ranks", None, signals, || {
        Ok((1..p.local_world_size)
            .all(|r| {
                plan.run_dir.join(format!("done-{r}")).exists()
                    || read_marker(&plan.run_dir.join(format!("rank-{r}.pid")))
                        .and_then(|t| t.trim().parse::<u32>().ok())
                        .is_some_and(|pid| !pid_alive(pid))
            })
            .then_some(()))
    })
    .await?;
    if no_barrier {
        return Ok(());
    }
    let dir = &plan.rendezvous_dir;
    write_atomic(&dir.join(format!("done-{}", p.host_index)), "done\n")?;
    let hosts = p.hosts.len();
    wait_for("waiting for every host's job to end", None, signals, || {
        Ok((0..hosts)
            .all(|h| dir.join(format!("done-{h}")).exists())
            .then_some(()))
    })
    .await
}

/// Time a job's join token stays valid after the host timeout: 60 s (the joining host
/// may start late by up to `--timeout-s`).
const TOKEN_TTL_SLACK: Duration = Duration::from_secs(60);

/// How this host's node gets its certificate.
enum Identity {
    /// Host 0: signs its own with the job's CA in `ca_dir` and serves joins with it.
    Authority { ca_dir: PathBuf },
    /// Another host: makes its key and joins through `server` with `token`.
    Joiner { server: String, token: String },
}

/// Finds the addresses, gets this host's certificate (host 0 makes the job's CA and a
/// join token per other host; the others join with theirs), writes the node config,
/// starts the node and waits until the pool is ready.
async fn start_node(
    plan: &Plan,
    args: &LaunchArgs,
    timeout: Duration,
    signals: &mut Signals,
) -> Result<(NodeGuard, SocketAddr)> {
    let p = &plan.placement;
    let hosts = p.hosts.len();
    let host0 = p.host_index == 0;
    // The shared directory carries the join tokens (unless they are given) and the
    // end-of-job barrier (unless --no-barrier).
    let tokens_by_dir = hosts > 1
        && if host0 {
            args.ca.is_none()
        } else {
            args.token.is_none()
        };
    if !args.no_barrier || tokens_by_dir {
        fs::create_dir_all(&plan.rendezvous_dir)
            .with_context(|| format!("creating {}", plan.rendezvous_dir.display()))?;
        let done_marker = plan.rendezvous_dir.join(format!("done-{}", p.host_index));
        if done_marker.exists() {
            bail!(
                "job key {:?} was used by a finished run ({} exists): pass another --job-key, or remove {}",
                p.job_key,
                done_marker.display(),
                plan.rendezvous_dir.display()
            );
        }
    }
    let (first_ip, my_ip) = host_addrs(plan)?;
    let peer = |ip: IpAddr| SocketAddr::new(ip, plan.peer_port);
    let metrics = |ip: IpAddr| SocketAddr::new(ip, plan.metrics_port);

    // This host's certificate and key are made here and stay here (the run directory).
    let certs_dir = plan.run_dir.join(spec::CERTS_DIR);
    let data_dir = plan.run_dir.join("data");
    for dir in [&certs_dir, &data_dir] {
        let _ = fs::remove_dir_all(dir);
    }
    let socket = plan.client_socket();
    let _ = fs::remove_file(&socket);
    let identity = if host0 {
        Identity::Authority {
            ca_dir: job_ca(plan, args, &certs_dir, timeout)?,
        }
    } else {
        let token = match &args.token {
            Some(t) => t.clone(),
            None => {
                let file = plan.rendezvous_dir.join(format!("token-{}", p.host_index));
                let token = wait_for(
                    &format!("waiting for host 0's join token {}", file.display()),
                    Some(timeout),
                    signals,
                    || Ok(read_marker(&file).map(|t| t.trim().to_string())),
                )
                .await?;
                // One use: the node spends it now.
                let _ = fs::remove_file(&file);
                token
            }
        };
        let server = args
            .join
            .clone()
            .unwrap_or_else(|| SocketAddr::new(first_ip, plan.bootstrap_port).to_string());
        Identity::Joiner { server, token }
    };
    let mut config = NodeConfig::new(
        NodeId(plan.node_id),
        certs_dir.clone(),
        data_dir.clone(),
        plan.host_budget,
    );
    config.listen_addr = peer(my_ip);
    config.metrics_addr = metrics(my_ip);
    config.client_socket = socket;
    config.tick_ms = spec::TICK_MS;
    config.heartbeat_ticks = spec::HEARTBEAT_TICKS;
    (config.election_ticks, config.election_ticks_max) = spec::ELECTION_TICKS;
    // Host 0 founds the pool alone; a joining host learns the members when it joins
    // (host 0 is listed so a restarted node finds the pool).
    config.members = vec![MemberAddr {
        id: NodeId(plan.node_id),
        addr: config.listen_addr,
    }];
    if !host0 {
        config.members.insert(
            0,
            MemberAddr {
                id: NodeId(1),
                addr: peer(first_ip),
            },
        );
    }
    config.validate()?;
    let config_path = plan.run_dir.join("node.toml");
    let text = format!(
        "# Node {} of a `spillway launch` job ({}).\n{}",
        plan.node_id,
        p.job_key,
        toml::to_string(&config)?
    );
    fs::write(&config_path, text).with_context(|| format!("writing {}", config_path.display()))?;
    let node_spec = NodeSpec {
        id: plan.node_id,
        peer_addr: config.listen_addr,
        metrics_addr: config.metrics_addr,
        client_socket: config.client_socket.clone(),
        config: config_path,
        data_dir,
        pool_dir: certs_dir,
        log: plan.run_dir.join("node.log"),
        pid_file: plan.run_dir.join("node.pid"),
    };
    let exe = std::env::current_exe().context("finding the spillway executable")?;
    let child = match &identity {
        Identity::Authority { ca_dir } => {
            let bootstrap = SocketAddr::new(my_ip, plan.bootstrap_port).to_string();
            let node_args = [
                "--ca".to_string(),
                ca_dir.display().to_string(),
                "--bootstrap-addr".to_string(),
                bootstrap,
            ];
            process::spawn_node_with(&exe, &node_spec, &args.log, &node_args, &[])?
        }
        Identity::Joiner { server, token } => process::spawn_node_with(
            &exe,
            &node_spec,
            &args.log,
            &["--join".to_string(), server.clone()],
            &[("SPILLWAY_JOIN_TOKEN", token.as_str())],
        )?,
    };
    let mut guard = NodeGuard {
        id: plan.node_id,
        child,
    };
    eprintln!(
        "spillway launch: host {} of {hosts} ({}), node {} pid {} at {}{}, log {}",
        p.host_index,
        p.source,
        plan.node_id,
        guard.child.id(),
        config.listen_addr,
        match &identity {
            Identity::Authority { .. } =>
                format!(", serving joins on port {}", plan.bootstrap_port),
            Identity::Joiner { server, .. } => format!(", joining through {server}"),
        },
        node_spec.log.display()
    );
    // Host 0's view and this host's: every member up with its capacity, the voters chosen.
    let mut targets = vec![(metrics(first_ip).to_string(), Some(1))];
    if !host0 {
        targets.push((config.metrics_addr.to_string(), Some(plan.node_id)));
    }
    let started = Instant::now();
    wait_for(
        "waiting for every host's node to join and agree on a leader",
        Some(timeout),
        signals,
        || {
            if let Some(status) = guard.child.try_wait()? {
                bail!(
                    "node {} exited ({status}); the end of {}:\n{}",
                    plan.node_id,
                    node_spec.log.display(),
                    process::log_tail(&node_spec.log, LOG_TAIL_LINES)
                );
            }
            let r = query_pool(&targets, STATUS_TIMEOUT);
            Ok(pool_ready(&r, targets.len(), hosts).then_some(r))
        },
    )
    .await
    .inspect(|r| {
        eprintln!(
            "spillway launch: pool of {hosts} nodes ready after {:.1} s, leader node {}, voters {}",
            started.elapsed().as_secs_f64(),
            r.leader.unwrap_or(0),
            r.members
                .iter()
                .filter(|m| m.raft == "voter")
                .map(|m| m.id.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )
    })?;
    Ok((guard, config.metrics_addr))
}

/// Whether the pool is ready for the job: the `queried` nodes answered and name one
/// leader, and it has `hosts` members, each up with its capacity committed, and as many
/// voters as a pool of that size wants.
fn pool_ready(r: &PoolReport, queried: usize, hosts: usize) -> bool {
    let voters = r.members.iter().filter(|m| m.raft == "voter").count();
    r.answering == queried
        && r.leader_agreed
        && r.members.len() == hosts
        && r.members
            .iter()
            .all(|m| m.state == "up" && m.capacity_bytes > 0)
        && voters == hosts.min(voters_wanted(hosts))
}

/// Host 0's CA directory: `--ca`'s (a pool laid out by `spillway cluster init`), or a
/// fresh CA for this job in the run directory. Writes host 0's own certificate and key
/// into `certs_dir` and, unless `--ca` was given (the operator hands out the tokens then),
/// a one-time join token per other host into the rendezvous directory (mode 0600).
fn job_ca(plan: &Plan, args: &LaunchArgs, certs_dir: &Path, timeout: Duration) -> Result<PathBuf> {
    let ca_dir = match &args.ca {
        Some(dir) => dir.clone(),
        None => {
            let dir = plan.run_dir.join("ca");
            let _ = fs::remove_dir_all(&dir);
            PoolCa::generate(spec::fresh_pool_id())?.write(&dir)?;
            dir
        }
    };
    let ca = PoolCa::load(&ca_dir)
        .with_context(|| format!("reading the pool's CA in {}", ca_dir.display()))?;
    ca.write_node_dir(NodeId(plan.node_id), certs_dir)?;
    let hosts = plan.placement.hosts.len();
    if args.ca.is_none() && hosts > 1 {
        let store = TokenStore::in_ca_dir(&ca_dir);
        let fingerprint = ca.fingerprint()?;
        for h in 1..hosts {
            let (token, _) = store.create(
                fingerprint,
                timeout + TOKEN_TTL_SLACK,
                spillway_node::now_ms(),
            )?;
            write_secret(
                &plan.rendezvous_dir.join(format!("token-{h}")),
                &format!("{token}\n"),
            )?;
        }
    }
    Ok(ca_dir)
}

/// Writes `text` to `path` as [`write_atomic`] does, readable by the owner only.
fn write_secret(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// Host 0's address and this host's. Under torchrun and LeaderWorkerSet, which name only
/// host 0, this host's is the one on its route to host 0.
fn host_addrs(plan: &Plan) -> Result<(IpAddr, IpAddr)> {
    let p = &plan.placement;
    match &p.hosts {
        Hosts::Named(names) => {
            let addr = |n: &String| {
                resolve(n, plan.peer_port, names.len()).or_else(|e| {
                    // A Slurm node name need not be a DNS name: Slurm knows its address.
                    (p.source == Source::Slurm)
                        .then(|| slurm_node_addr(n))
                        .flatten()
                        .ok_or(e)
                })
            };
            Ok((addr(&names[0])?, addr(&names[p.host_index])?))
        }
        Hosts::Count { count, first } => {
            let first_ip = resolve(first, plan.peer_port, *count)?;
            Ok((first_ip, route_to(first_ip, plan.peer_port)?))
        }
    }
}

/// A host's address: an IP literal as is, else its first IPv4 address from the resolver.
/// A job of one host whose name does not resolve (a Slurm node name) runs on loopback.
fn resolve(name: &str, port: u16, hosts: usize) -> Result<IpAddr> {
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(ip);
    }
    match (name, port).to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            addrs
                .iter()
                .find(|a| a.is_ipv4())
                .or(addrs.first())
                .map(|a| a.ip())
                .with_context(|| format!("host {name:?} has no address"))
        }
        Err(_) if hosts == 1 => Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        Err(e) => Err(e).with_context(|| format!("resolving host {name:?}")),
    }
}

/// A Slurm node's `NodeAddr`, from `scontrol show node NAME` (`None` if scontrol fails or
/// the address is not an IP).
fn slurm_node_addr(name: &str) -> Option<IpAddr> {
    let out = Command::new("scontrol")
        .args(["show", "node", name, "--oneliner"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .find_map(|w| w.strip_prefix("NodeAddr="))
        .and_then(|a| a.parse().ok())
}

/// This host's address on the route to `to` (a connected UDP socket; nothing is sent).
fn route_to(to: IpAddr, port: u16) -> Result<IpAddr> {
    let bind: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let s = UdpSocket::bind(bind).context("binding a UDP socket to find this host's address")?;
    s.connect((to, port))
        .with_context(|| format!("finding the route to {to}"))?;
    Ok(s.local_addr()?.ip())
}

/// Runs the job's command with `SPILLWAY_SOCKET` (and `SPILLWAY_STATUS_ADDR`, the node's
/// `/status` and `/metrics`, `SPILLWAY_NODE_ID`, `SPILLWAY_HOST_INDEX`, `SPILLWAY_HOSTS`) set, forwarding SIGINT and SIGTERM;
/// returns its exit status (128 + signal when a signal ended it).
async fn run_job(plan: &Plan, status_addr: &str, signals: &mut Signals) -> Result<i32> {
    use std::os::unix::process::ExitStatusExt;
    let (program, rest) = plan.command.split_first().context("no command to run")?;
    let p = &plan.placement;
    let mut child = Command::new(program)
        .args(rest)
        .env("SPILLWAY_SOCKET", plan.client_socket())
        .env("SPILLWAY_STATUS_ADDR", status_addr)
        .env("SPILLWAY_NODE_ID", plan.node_id.to_string())
        .env("SPILLWAY_HOST_INDEX", p.host_index.to_string())
        .env("SPILLWAY_HOSTS", p.hosts.len().to_string())
        .spawn()
        .with_context(|| format!("running {program:?}"))?;
    let pid = Pid::from_raw(child.id() as i32).context("the job's pid")?;
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    loop {
        tokio::select! {
            status = &mut rx => {
                let status = status.context("waiting for the job")??;
                return Ok(status
                    .code()
                    .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)));
            }
            s = signals.next() => {
                let _ = kill_process(pid, s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use spillway_cluster::status::MemberStatus;

    use super::*;

    fn report(members: &[(&str, &str, u64)], answering: usize, agreed: bool) -> PoolReport {
        PoolReport {
            answering,
            raft_healthy: answering,
            leader: Some(1),
            term: Some(1),
            leader_agreed: agreed,
            members: members
                .iter()
                .enumerate()
                .map(|(i, &(state, raft, capacity_bytes))| MemberStatus {
                    id: i as u64 + 1,
                    state: state.into(),
                    raft: raft.into(),
                    capacity_bytes,
                    ..MemberStatus::default()
                })
                .collect(),
            nodes: Vec::new(),
        }
    }

    #[test]
    fn the_pool_is_ready_with_every_host_up_and_its_voters() {
        let up = |raft| ("up", raft, 1 << 30);
        let three = [up("voter"), up("voter"), up("voter")];
        assert!(pool_ready(&report(&three, 2, true), 2, 3));
        // Four hosts want three voters; the fourth stays a learner.
        let four = [up("voter"), up("voter"), up("voter"), up("learner")];
        assert!(pool_ready(&report(&four, 2, true), 2, 4));
        // A learner not promoted yet, a host not joined yet, one without its capacity,
        // one down, a node that did not answer, no agreed leader: not ready.
        let promoting = [up("voter"), up("voter"), up("learner")];
        assert!(!pool_ready(&report(&promoting, 2, true), 2, 3));
        assert!(!pool_ready(&report(&three[..2], 2, true), 2, 3));
        let no_capacity = [up("voter"), up("voter"), ("up", "voter", 0)];
        assert!(!pool_ready(&report(&no_capacity, 2, true), 2, 3));
        let down = [up("voter"), up("voter"), ("down", "voter", 1 << 30)];
        assert!(!pool_ready(&report(&down, 2, true), 2, 3));
        assert!(!pool_ready(&report(&three, 1, true), 2, 3));
        assert!(!pool_ready(&report(&three, 2, false), 2, 3));
    }
}
