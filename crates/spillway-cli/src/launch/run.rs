//! The side effects of `spillway launch`, in the order [`super`] describes: pool
//! directory, addresses, node config, node process, readiness, the job, the barriers.
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
use spillway_cluster::spec::{self, BASE_PORT_DEFAULT};
use spillway_cluster::{ClusterSpec, InitOptions, NodeSpec, query_pool};
use spillway_node::config::MemberAddr;
use spillway_node::{NodeConfig, PageTransport};
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
/// Largest marker or rendezvous file read: 4 KiB.
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

/// Lays out or loads the pool, finds the hosts' addresses, writes the node config,
/// starts the node and waits until the pool is ready.
async fn start_node(
    plan: &Plan,
    args: &LaunchArgs,
    timeout: Duration,
    signals: &mut Signals,
) -> Result<(NodeGuard, SocketAddr)> {
    let p = &plan.placement;
    let hosts = p.hosts.len();
    let spec = pool_spec(plan, args, timeout, signals).await?;
    // The node's certificates by the layout's convention (`node-K/pool` in the pool
    // directory), not cluster.json's absolute paths: the directory may be mounted
    // elsewhere on this host than where it was laid out.
    let mut me = spec
        .nodes
        .get(p.host_index)
        .with_context(|| format!("the pool in {} has {} nodes, the job {hosts} hosts; lay out another with `spillway cluster init --force --nodes {hosts}`",
            spec.dir.display(), spec.nodes.len()))?
        .clone();
    me.pool_dir = plan
        .pool_dir
        .join(format!("node-{}", plan.node_id))
        .join(spec::CERTS_DIR);
    let needs_rendezvous = !args.no_barrier || matches!(p.hosts, Hosts::Count { .. });
    if needs_rendezvous {
        fs::create_dir_all(&plan.rendezvous_dir)
            .with_context(|| format!("creating {}", plan.rendezvous_dir.display()))?;
    }
    let done_marker = plan.rendezvous_dir.join(format!("done-{}", p.host_index));
    if needs_rendezvous && done_marker.exists() {
        bail!(
            "job key {:?} was used by a finished run ({} exists): pass another --job-key, or remove {}",
            p.job_key,
            done_marker.display(),
            plan.rendezvous_dir.display()
        );
    }
    let addrs = host_addrs(plan, timeout, signals).await?;
    let peer = |ip: IpAddr| SocketAddr::new(ip, plan.peer_port);
    let metrics = |ip: IpAddr| SocketAddr::new(ip, plan.metrics_port);

    let data_dir = plan.run_dir.join("data");
    let _ = fs::remove_dir_all(&data_dir);
    let socket = plan.client_socket();
    let _ = fs::remove_file(&socket);
    let mut config = NodeConfig::new(
        NodeId(plan.node_id),
        me.pool_dir.clone(),
        data_dir.clone(),
        plan.host_budget,
    );
    config.listen_addr = peer(addrs[p.host_index]);
    config.metrics_addr = metrics(addrs[p.host_index]);
    config.client_socket = socket;
    config.tick_ms = spec::TICK_MS;
    config.heartbeat_ticks = spec::HEARTBEAT_TICKS;
    (config.election_ticks, config.election_ticks_max) = spec::ELECTION_TICKS;
    config.members = addrs
        .iter()
        .enumerate()
        .map(|(i, ip)| MemberAddr {
            id: NodeId(i as u64 + 1),
            addr: peer(*ip),
        })
        .collect();
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
        pool_dir: me.pool_dir.clone(),
        log: plan.run_dir.join("node.log"),
        pid_file: plan.run_dir.join("node.pid"),
    };
    let exe = std::env::current_exe().context("finding the spillway executable")?;
    let child = process::spawn_node(&exe, &node_spec, &args.log)?;
    let mut guard = NodeGuard {
        id: plan.node_id,
        child,
    };
    eprintln!(
        "spillway launch: host {} of {hosts} ({}), node {} pid {} at {}, log {}",
        p.host_index,
        p.source,
        plan.node_id,
        guard.child.id(),
        config.listen_addr,
        node_spec.log.display()
    );
    let targets: Vec<(String, Option<u64>)> = addrs
        .iter()
        .enumerate()
        .map(|(i, ip)| (metrics(*ip).to_string(), Some(i as u64 + 1)))
        .collect();
    let started = Instant::now();
    wait_for(
        "waiting for every host's node to answer and agree on a leader",
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
            Ok((r.answering == hosts
                && r.leader_agreed
                && r.members.len() == hosts
                && r.members.iter().all(|m| m.capacity_bytes > 0))
            .then_some(r))
        },
    )
    .await
    .inspect(|r| {
        eprintln!(
            "spillway launch: pool of {hosts} nodes ready after {:.1} s, leader node {}",
            started.elapsed().as_secs_f64(),
            r.leader.unwrap_or(0)
        )
    })?;
    Ok((guard, config.metrics_addr))
}

/// The pool in the pool directory; host 0 lays it out if it is missing, the others wait
/// for it.
async fn pool_spec(
    plan: &Plan,
    args: &LaunchArgs,
    timeout: Duration,
    signals: &mut Signals,
) -> Result<ClusterSpec> {
    let dir = &plan.pool_dir;
    let hosts = plan.placement.hosts.len() as u32;
    if !ClusterSpec::exists(dir) && plan.placement.host_index == 0 {
        let base_port = if u32::from(args.port) + 2 * hosts <= u32::from(u16::MAX) {
            args.port.max(spec::BASE_PORT_MIN)
        } else {
            BASE_PORT_DEFAULT
        };
        let spec = spillway_cluster::init(
            dir,
            &InitOptions {
                nodes: hosts,
                base_port,
                host_tier_bytes: plan.host_budget,
                force: false,
                transport: PageTransport::Quic,
            },
        )?;
        eprintln!(
            "spillway launch: laid out pool {} for {hosts} hosts in {}",
            spec.pool_id,
            spec.dir.display()
        );
        return Ok(spec);
    }
    // `init` writes cluster.json last; a half-written one does not parse yet.
    wait_for(
        &format!("waiting for the pool in {}", dir.display()),
        Some(timeout),
        signals,
        || Ok(ClusterSpec::load(dir).ok()),
    )
    .await
}

/// Every host's address, by host index.
async fn host_addrs(plan: &Plan, timeout: Duration, signals: &mut Signals) -> Result<Vec<IpAddr>> {
    let p = &plan.placement;
    match &p.hosts {
        Hosts::Named(names) => names
            .iter()
            .map(|n| {
                resolve(n, plan.peer_port, names.len()).or_else(|e| {
                    // A Slurm node name need not be a DNS name: Slurm knows its address.
                    (p.source == Source::Slurm)
                        .then(|| slurm_node_addr(n))
                        .flatten()
                        .ok_or(e)
                })
            })
            .collect(),
        Hosts::Count { count, first } => {
            let first_ip = resolve(first, plan.peer_port, *count)?;
            let mine = route_to(first_ip, plan.peer_port)?;
            let dir = &plan.rendezvous_dir;
            let key = &p.job_key;
            write_atomic(
                &dir.join(format!("host-{}", p.host_index)),
                &format!("{key} {mine}\n"),
            )?;
            let files: Vec<PathBuf> = (0..*count).map(|h| dir.join(format!("host-{h}"))).collect();
            wait_for(
                &format!("waiting for {count} hosts in {}", dir.display()),
                Some(timeout),
                signals,
                || {
                    let mut ips = Vec::with_capacity(files.len());
                    for f in &files {
                        let Some(text) = read_marker(f) else {
                            return Ok(None);
                        };
                        match text.split_whitespace().collect::<Vec<_>>().as_slice() {
                            [k, ip] if k == key => ips.push(ip.parse::<IpAddr>()?),
                            _ => return Ok(None),
                        }
                    }
                    Ok(Some(ips))
                },
            )
            .await
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
