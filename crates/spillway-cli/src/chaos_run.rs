//! `spillway chaos run`: a real pool of `spillway node` processes, each in its own
//! network namespace, broken on purpose while a client runs the demo against it.
//!
//! Every scenario starts afresh: namespaces `TAG-h1..TAG-hN` with `eth0` at
//! `10.77.0.K/24` on a bridge in a namespace of its own (`TAG-br`, where this command
//! watches from, at `10.77.0.254`), a pool laid out by `spillway cluster init` with each
//! node's addresses moved to its namespace, one node process per namespace, and
//! `spillway demo --connect` on one node's socket. After the demo's second step the fault
//! hits; the demo must finish every step with every page verified, none corrupt and no
//! buffer lost, and the pool must have every page's copies again (`under_replicated_bytes`
//! 0 on every live node) within [`REPAIR_LIMIT`]. The recovery time is from the fault's
//! end (the kill, or the heal) to that moment.
//!
//! Faults: SIGKILL (a holder, the leader, two holders one after the other), SIGSTOP for
//! [`FAULT_HOLD`] then SIGCONT, nftables rules in a node's namespace (every packet to and
//! from the other nodes dropped, for a holder or the leader; a share of its outgoing
//! packets dropped), and a node's Raft log on a small tmpfs filled to the last byte (the
//! disk full) then emptied, and every packet a node sends delayed by an NFQUEUE program
//! (the kernel has no netem). The namespaces, rules and mounts are removed on every way out
//! ([`Net`]'s and [`Pool`]'s `Drop`). Needs root, `ip` (iproute2), `nft` (nftables) and
//! `iptables` (its NFQUEUE target: this kernel has no nft `queue`).

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use serde::Serialize;
use spillway_cluster::status::fetch_status;
use spillway_cluster::{ClusterSpec, InitOptions};

/// How long a held fault (a pause, a partition, loss, the full disk) lasts: 10 s.
pub const FAULT_HOLD: Duration = Duration::from_secs(10);
/// How long the pool has to copy every page again after a fault ends: 60 s.
pub const REPAIR_LIMIT: Duration = Duration::from_secs(60);
/// How long the demo may take: 10 minutes.
const DEMO_LIMIT: Duration = Duration::from_secs(600);
/// Starts of the demo client while its node reports no room on peers yet: 5.
const DEMO_STARTS: u32 = 5;
/// A node's longest reconnect backoff (1 s): what a client waits before starting again.
const PEER_BACKOFF: Duration = spillway_node::peers::RECONNECT_BACKOFF_MAX;
/// The step after which the fault hits (the pool has learned the loop, and every page
/// has been spilled once).
const FAULT_AFTER_STEP: u32 = 2;
/// The share of a node's outgoing packets dropped by `one-way-loss`: 30 %.
const LOSS_PERCENT: u32 = 30;
/// The tmpfs under the `disk-full` node's data directory: 64 MiB.
const DISK_BYTES: u64 = 64 << 20;
/// The delay `delay` adds to each packet: 100 ms.
const DELAY: Duration = Duration::from_millis(100);
/// The NFQUEUE queue number of `delay`.
const DELAY_QUEUE: u16 = 7;
/// The address this command watches the pool from, on the bridge.
const WATCHER_ADDR: &str = "10.77.0.254";

/// One way to break the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// SIGKILL a peer holding pages (not the leader).
    KillHolder,
    /// SIGKILL the Raft leader (the client on another node).
    KillLeader,
    /// SIGKILL a holder, wait until its pages have their copies again, SIGKILL another
    /// (5 nodes at least, so the survivors can hold every copy).
    KillTwo,
    /// SIGSTOP a holder for 10 s, then SIGCONT.
    StopPeer,
    /// Cut a holder off from every other node for 10 s (nftables).
    PartitionNode,
    /// Cut the leader off from every other node for 10 s (the client on another node).
    PartitionLeader,
    /// Drop 30 % of a holder's outgoing packets for 10 s (nftables).
    OneWayLoss,
    /// Fill a holder's Raft log disk (a 64 MiB tmpfs) for 10 s, then free it.
    DiskFull,
    /// Delay every packet a holder sends to the other nodes by 100 ms for 10 s (an
    /// NFQUEUE program: the kernel has no netem).
    Delay,
}

impl Scenario {
    /// What a run without --scenarios does: every scenario.
    const DEFAULT: [Scenario; 9] = [
        Scenario::KillHolder,
        Scenario::KillLeader,
        Scenario::KillTwo,
        Scenario::StopPeer,
        Scenario::PartitionNode,
        Scenario::PartitionLeader,
        Scenario::OneWayLoss,
        Scenario::DiskFull,
        Scenario::Delay,
    ];

    fn name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }

    fn hits_leader(self) -> bool {
        matches!(self, Scenario::KillLeader | Scenario::PartitionLeader)
    }
}

/// `spillway chaos run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Scenarios to run (comma-separated); by default all nine.
    #[arg(long, value_enum, value_delimiter = ',')]
    scenarios: Vec<Scenario>,
    /// Node processes in the pool (kill-two uses at least 5).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(4..=16))]
    nodes: u64,
    /// Demo steps (the fault hits after step 2).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(4..=100))]
    steps: u32,
    /// Where pools and logs go (a fresh directory under it; kept when a scenario fails).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Print one JSON object per scenario (one per line) instead of the table.
    #[arg(long)]
    json: bool,
    /// The nodes' log filter (`SPILLWAY_LOG` syntax, e.g.
    /// `info,spillway_node::remote=debug` to see every spill, repair and placement).
    #[arg(long, value_name = "FILTER", default_value = "info")]
    node_log: String,
}

/// What one scenario found.
#[derive(Debug, Default, Serialize)]
pub struct ScenarioReport {
    scenario: String,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    nodes: u64,
    client_node: u64,
    victims: Vec<u64>,
    steps: u64,
    pages_verified: u64,
    pages_lost: u64,
    pages_corrupt: u64,
    /// From the fault's end (the kill, or the heal) to every page having its copies.
    recovery_s: Option<f64>,
    /// What the fault did, when there is more to say (packets delayed).
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    /// Where the pool's logs are (kept when it failed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pool_dir: Option<PathBuf>,
}

pub fn run(args: RunArgs) -> Result<()> {
    preflight()?;
    let exe = std::env::current_exe().context("finding this spillway binary")?;
    let scenarios = if args.scenarios.is_empty() {
        Scenario::DEFAULT.to_vec()
    } else {
        args.scenarios.clone()
    };
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let root = tempfile::Builder::new()
        .prefix("spillway-chaos-run-")
        .tempdir_in(&base)
        .with_context(|| format!("making a directory under {}", base.display()))?;
    let mut reports = Vec::new();
    for (i, &scenario) in scenarios.iter().enumerate() {
        if !args.json {
            eprintln!(
                "chaos run: {} ({} of {})...",
                scenario.name(),
                i + 1,
                scenarios.len()
            );
        }
        let dir = root.path().join(scenario.name());
        let nodes = if scenario == Scenario::KillTwo {
            args.nodes.max(5)
        } else {
            args.nodes
        };
        let mut report = ScenarioReport {
            scenario: scenario.name(),
            nodes,
            ..ScenarioReport::default()
        };
        if let Err(e) = run_scenario(&exe, scenario, nodes, &args, &dir, i, &mut report) {
            report.ok = false;
            report.error = Some(format!("{e:#}"));
            report.pool_dir = Some(dir.clone());
        }
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        }
        reports.push(report);
    }
    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.scenario.as_str())
        .collect();
    if !args.json {
        print_table(&reports);
    }
    if !failed.is_empty() {
        // Keep the pools' logs of the failures.
        let kept = root.keep();
        bail!(
            "{} of {} scenarios failed: {} (logs under {})",
            failed.len(),
            reports.len(),
            failed.join(", "),
            kept.display()
        );
    }
    Ok(())
}

fn print_table(reports: &[ScenarioReport]) {
    println!(
        "| scenario | nodes | victims | steps | pages verified | lost | corrupt | recovery | result |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in reports {
        println!(
            "| {} | {} | {:?} | {} | {} | {} | {} | {} | {} |",
            r.scenario,
            r.nodes,
            r.victims,
            r.steps,
            r.pages_verified,
            r.pages_lost,
            r.pages_corrupt,
            r.recovery_s.map_or("-".into(), |s| format!("{s:.1} s")),
            match (&r.error, &r.detail) {
                (Some(e), _) => format!("FAILED: {e}"),
                (None, Some(d)) => format!("ok ({d})"),
                (None, None) => "ok".into(),
            }
        );
    }
}

/// Root, `ip` and `nft`, or a clear error.
fn preflight() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!(
            "spillway chaos run needs root: it makes network namespaces (ip netns), nftables rules and a tmpfs; run it with sudo"
        );
    }
    for (tool, arg, package) in [
        ("ip", "-V", "iproute2"),
        ("nft", "--version", "nftables"),
        ("iptables", "--version", "iptables"),
    ] {
        let ok = Command::new(tool)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            bail!("spillway chaos run needs `{tool}` (package {package}); install it first");
        }
    }
    Ok(())
}

/// Runs a command, failing with its stderr.
fn sh(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The namespaces of one scenario (see the module doc); removed on drop.
struct Net {
    tag: String,
    hosts: u64,
}

impl Net {
    fn up(tag: String, hosts: u64) -> Result<Net> {
        let net = Net { tag, hosts };
        let br = net.bridge();
        sh("ip", &["netns", "add", &br])?;
        sh("ip", &["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        sh(
            "ip",
            &[
                "-n",
                &br,
                "addr",
                "add",
                &format!("{WATCHER_ADDR}/24"),
                "dev",
                "br0",
            ],
        )?;
        sh("ip", &["-n", &br, "link", "set", "br0", "up"])?;
        sh("ip", &["-n", &br, "link", "set", "lo", "up"])?;
        for k in 1..=hosts {
            let ns = net.host(k);
            let port = format!("p{k}");
            sh("ip", &["netns", "add", &ns])?;
            sh("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            sh(
                "ip",
                &[
                    "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port,
                    "netns", &br,
                ],
            )?;
            sh(
                "ip",
                &[
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("10.77.0.{k}/24"),
                    "dev",
                    "eth0",
                ],
            )?;
            sh("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
            sh("ip", &["-n", &br, "link", "set", &port, "master", "br0"])?;
            sh("ip", &["-n", &br, "link", "set", &port, "up"])?;
        }
        // This thread watches from the bridge's namespace (it reaches every node).
        let file = fs::File::open(format!("/var/run/netns/{br}"))
            .with_context(|| format!("opening the namespace {br}"))?;
        rustix::thread::move_into_link_name_space(
            file.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .context("entering the bridge's network namespace")?;
        Ok(net)
    }

    fn bridge(&self) -> String {
        format!("{}-br", self.tag)
    }

    fn host(&self, k: u64) -> String {
        format!("{}-h{k}", self.tag)
    }

    /// `nft` run in node `k`'s namespace, with `script` on its stdin.
    fn nft(&self, k: u64, script: &str) -> Result<()> {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.host(k), "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running nft")?;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(script.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "nft in {}: {}",
                self.host(k),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for k in 1..=self.hosts {
            let ns = self.host(k);
            if let Ok(out) = Command::new("ip").args(["netns", "pids", &ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    if let Ok(pid) = pid.parse::<i32>()
                        && let Some(pid) = rustix::process::Pid::from_raw(pid)
                    {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    }
                }
            }
            let _ = sh("ip", &["netns", "del", &ns]);
        }
        let _ = sh("ip", &["netns", "del", &self.bridge()]);
    }
}

/// A pool of node processes in the namespaces of a [`Net`].
struct Pool {
    spec: ClusterSpec,
    /// The nodes' `SPILLWAY_LOG`.
    node_log: String,
    children: Vec<Option<Child>>,
    mounted: Option<PathBuf>,
}

impl Pool {
    /// Lays the pool out in `dir` (addresses moved to the namespaces; node `tmpfs_node`'s
    /// data directory on a small tmpfs) and starts every node.
    fn start(
        exe: &Path,
        net: &Net,
        nodes: u64,
        dir: &Path,
        tmpfs_node: Option<u64>,
        base_port: u16,
        node_log: &str,
    ) -> Result<Pool> {
        let options = InitOptions {
            nodes: nodes as u32,
            base_port,
            ..InitOptions::default()
        };
        spillway_cluster::init(dir, &options).context("laying out the pool")?;
        let spec = ClusterSpec::load(dir)?;
        // Each node's addresses move from 127.0.0.1 to its namespace's.
        let mut files: Vec<PathBuf> = spec.nodes.iter().map(|n| n.config.clone()).collect();
        files.push(ClusterSpec::path(dir));
        for file in &files {
            let mut text = fs::read_to_string(file)?;
            for n in &spec.nodes {
                for addr in [n.peer_addr, n.metrics_addr] {
                    let moved = SocketAddr::new(format!("10.77.0.{}", n.id).parse()?, addr.port());
                    text = text.replace(&format!("\"{addr}\""), &format!("\"{moved}\""));
                }
            }
            fs::write(file, text)?;
        }
        let spec = ClusterSpec::load(dir)?;
        let mut pool = Pool {
            children: Vec::new(),
            mounted: None,
            spec,
            node_log: node_log.to_string(),
        };
        if let Some(k) = tmpfs_node {
            let data = pool.node(k).data_dir.clone();
            fs::create_dir_all(&data)?;
            sh(
                "mount",
                &[
                    "-t",
                    "tmpfs",
                    "-o",
                    &format!("size={DISK_BYTES}"),
                    "tmpfs",
                    &data.to_string_lossy(),
                ],
            )?;
            pool.mounted = Some(data);
        }
        for k in 1..=nodes {
            let child = pool.spawn(exe, net, k)?;
            pool.children.push(Some(child));
        }
        Ok(pool)
    }

    fn node(&self, k: u64) -> &spillway_cluster::spec::NodeSpec {
        &self.spec.nodes[(k - 1) as usize]
    }

    fn spawn(&self, exe: &Path, net: &Net, k: u64) -> Result<Child> {
        let n = self.node(k);
        let log =
            fs::File::create(&n.log).with_context(|| format!("creating {}", n.log.display()))?;
        let child = Command::new("ip")
            .args(["netns", "exec", &net.host(k)])
            .arg(exe)
            .arg("node")
            .arg("--config")
            .arg(&n.config)
            .env("SPILLWAY_LOG", &self.node_log)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting node {k}"))?;
        Ok(child)
    }

    fn pid(&self, k: u64) -> Result<rustix::process::Pid> {
        let child = self.children[(k - 1) as usize]
            .as_ref()
            .ok_or_else(|| anyhow!("node {k} is not running"))?;
        rustix::process::Pid::from_raw(child.id() as i32).ok_or_else(|| anyhow!("node {k}'s pid"))
    }

    fn signal(&mut self, k: u64, signal: rustix::process::Signal) -> Result<()> {
        rustix::process::kill_process(self.pid(k)?, signal)
            .with_context(|| format!("signalling node {k}"))?;
        if signal == rustix::process::Signal::KILL
            && let Some(mut c) = self.children[(k - 1) as usize].take()
        {
            let _ = c.wait();
        }
        Ok(())
    }

    fn live(&self) -> Vec<u64> {
        (1..=self.spec.nodes.len() as u64)
            .filter(|&k| self.children[(k - 1) as usize].is_some())
            .collect()
    }

    fn status(&self, k: u64) -> Option<spillway_cluster::status::NodeStatus> {
        fetch_status(self.node(k).metrics_addr, Duration::from_millis(500)).ok()
    }

    /// The leader every live node agrees on, with every member up and lending.
    fn settled_leader(&self) -> Option<u64> {
        let live = self.live();
        let mut leader = None;
        for &k in &live {
            let s = self.status(k)?;
            if s.leader.is_none() || (leader.is_some() && leader != s.leader) {
                return None;
            }
            leader = s.leader;
            // Every member up and lending (a client asks for room on its peers first).
            let ready = s
                .members
                .iter()
                .filter(|m| m.state == "up" && m.capacity_bytes > 0)
                .count();
            if ready < live.len() {
                return None;
            }
        }
        leader
    }

    /// Bytes short of their copies, summed over the live nodes (`None` while one does
    /// not answer).
    fn under_replicated(&self) -> Option<u64> {
        self.live()
            .iter()
            .map(|&k| self.status(k).map(|s| s.remote.under_replicated_bytes))
            .sum()
    }

    /// How many buffers of the live nodes' clients have a copy on node `k`, by their
    /// records (`/placements`); `None` while a node does not answer.
    fn placed_on(&self, k: u64) -> Option<usize> {
        let mut n = 0;
        for live in self.live() {
            let r = spillway_cluster::http::get(
                self.node(live).metrics_addr,
                "/placements",
                Duration::from_millis(500),
            )
            .ok()?;
            let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
            for holders in v["clients"].as_object()?.values() {
                n += holders[k.to_string()].as_array().map_or(0, Vec::len);
            }
        }
        Some(n)
    }

    /// Whether every live node sees node `k` down.
    fn declared_down(&self, k: u64) -> bool {
        self.live().iter().all(|&n| {
            self.status(n)
                .is_some_and(|s| s.members.iter().any(|m| m.id == k && m.state == "down"))
        })
    }

    /// Peers holding pages, most bytes first, but those in `skip`.
    fn holders(&self, skip: &[u64]) -> Vec<u64> {
        for k in self.live() {
            if let Some(s) = self.status(k) {
                let mut held: Vec<(u64, u64)> = s
                    .members
                    .iter()
                    .filter(|m| m.used_bytes > 0 && !skip.contains(&m.id))
                    .map(|m| (m.used_bytes, m.id))
                    .collect();
                held.sort_unstable_by(|a, b| b.cmp(a));
                return held.into_iter().map(|(_, id)| id).collect();
            }
        }
        Vec::new()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(m) = &self.mounted {
            let _ = sh("umount", &["-l", &m.to_string_lossy()]);
        }
    }
}

/// Polls `cond` every 100 ms until it gives a value, for at most `limit`.
fn wait_for<T>(what: &str, limit: Duration, mut cond: impl FnMut() -> Option<T>) -> Result<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = cond() {
            return Ok(v);
        }
        if t0.elapsed() > limit {
            bail!("{what}: not within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// nftables rules cutting a node off from the other nodes (the watcher still reaches
/// it), or dropping `loss` percent of what it sends.
fn rules(loss: Option<u32>) -> String {
    match loss {
        None => format!(
            "table inet spillway_chaos {{
  chain input {{ type filter hook input priority 0; ip saddr {WATCHER_ADDR} accept; ip saddr 10.77.0.0/24 drop; }}
  chain output {{ type filter hook output priority 0; ip daddr {WATCHER_ADDR} accept; ip daddr 10.77.0.0/24 drop; }}
}}
"
        ),
        Some(p) => format!(
            "table inet spillway_chaos {{
  chain output {{ type filter hook output priority 0; ip daddr {WATCHER_ADDR} accept; ip daddr 10.77.0.0/24 numgen random mod 100 < {p} drop; }}
}}
"
        ),
    }
}

fn run_scenario(
    exe: &Path,
    scenario: Scenario,
    nodes: u64,
    args: &RunArgs,
    dir: &Path,
    index: usize,
    report: &mut ScenarioReport,
) -> Result<()> {
    let steps = args.steps;
    let tag = format!("spwc{}x{index}", std::process::id() % 100_000);
    let net = Net::up(tag, nodes)?;
    // A disk-full victim is chosen before the pool starts: the last node (not the
    // leader's usual first, not the client's node).
    let disk_victim = (scenario == Scenario::DiskFull).then_some(nodes);
    let base_port = 17_100 + (index as u16) * 40;
    let mut pool = Pool::start(
        exe,
        &net,
        nodes,
        dir,
        disk_victim,
        base_port,
        &args.node_log,
    )?;
    let leader = wait_for(
        "a pool with every node up and one leader",
        Duration::from_secs(60),
        || pool.settled_leader(),
    )?;
    let client = if scenario.hits_leader() {
        (1..=nodes).find(|&k| k != leader).expect("4 nodes or more")
    } else {
        1
    };
    report.client_node = client;
    // The client: the demo against its node's socket, in its node's namespace.
    let out_path = dir.join("demo.json");
    // A node that has just started may not reach its peers yet (its connections in their
    // first backoff) and tell the client it has no room: the client starts again then,
    // up to DEMO_STARTS times.
    let mut attempt = 0;
    let (mut demo, mut progress) = loop {
        attempt += 1;
        let mut demo = Command::new("ip")
            .args(["netns", "exec", &net.host(client)])
            .arg(exe)
            .args(["demo", "--connect"])
            .arg(&pool.node(client).client_socket)
            .args(["--steps", &steps.to_string(), "--device", "sim", "--json"])
            .stdout(fs::File::create(&out_path)?)
            .stderr(Stdio::piped())
            .spawn()
            .context("starting the demo client")?;
        let mut progress = BufReader::new(demo.stderr.take().expect("piped"));
        let mut line = String::new();
        let mut stderr_tail = Vec::new();
        let reached = loop {
            line.clear();
            if progress.read_line(&mut line)? == 0 {
                let _ = demo.wait();
                break false;
            }
            stderr_tail.push(line.trim().to_string());
            if line.starts_with(&format!("demo: steps {FAULT_AFTER_STEP}/")) {
                break true;
            }
        };
        if reached {
            break (demo, progress);
        }
        let no_room = stderr_tail
            .iter()
            .any(|l| l.contains("of room on its peers"));
        if !no_room || attempt >= DEMO_STARTS {
            bail!(
                "the demo ended before step {FAULT_AFTER_STEP}: {}",
                stderr_tail.join(" | ")
            );
        }
        std::thread::sleep(PEER_BACKOFF);
    };
    // The rest of the demo's stderr is drained beside, so it never blocks on a pipe.
    let drain = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut progress, &mut rest);
        rest
    });
    let holder = |pool: &Pool, skip: &[u64]| -> Result<u64> {
        pool.holders(skip)
            .first()
            .copied()
            .ok_or_else(|| anyhow!("no peer outside {skip:?} holds pages"))
    };
    use rustix::process::Signal;
    let fault_end = match scenario {
        Scenario::KillHolder | Scenario::KillLeader => {
            let v = if scenario == Scenario::KillLeader {
                leader
            } else {
                holder(&pool, &[client, leader])?
            };
            report.victims.push(v);
            pool.signal(v, Signal::KILL)?;
            Instant::now()
        }
        Scenario::KillTwo => {
            let a = holder(&pool, &[client, leader])?;
            report.victims.push(a);
            pool.signal(a, Signal::KILL)?;
            // Declared down first (until then nothing counts as short), then repaired.
            wait_for("the first victim declared down", REPAIR_LIMIT, || {
                pool.declared_down(a).then_some(())
            })?;
            // Every page copied off it: no node's record names it as a holder any more
            // (each node's `/placements`), and none short of copies.
            wait_for(
                "every copy on the first victim made again elsewhere",
                REPAIR_LIMIT,
                || (pool.placed_on(a)? == 0 && pool.under_replicated()? == 0).then_some(()),
            )?;
            let b = holder(&pool, &[client, leader, a])?;
            report.victims.push(b);
            pool.signal(b, Signal::KILL)?;
            Instant::now()
        }
        Scenario::StopPeer => {
            let v = holder(&pool, &[client, leader])?;
            report.victims.push(v);
            pool.signal(v, Signal::STOP)?;
            std::thread::sleep(FAULT_HOLD);
            pool.signal(v, Signal::CONT)?;
            Instant::now()
        }
        Scenario::PartitionNode | Scenario::PartitionLeader | Scenario::OneWayLoss => {
            let v = match scenario {
                Scenario::PartitionLeader => leader,
                _ => holder(&pool, &[client, leader])?,
            };
            report.victims.push(v);
            let loss = (scenario == Scenario::OneWayLoss).then_some(LOSS_PERCENT);
            net.nft(v, &rules(loss))?;
            std::thread::sleep(FAULT_HOLD);
            net.nft(v, "delete table inet spillway_chaos\n")?;
            Instant::now()
        }
        Scenario::Delay => {
            let v = holder(&pool, &[client, leader])?;
            report.victims.push(v);
            let stop = Arc::new(AtomicBool::new(false));
            let delayer = delay_packets(net.host(v), DELAY, Arc::clone(&stop));
            // This kernel queues to user space through the xtables NFQUEUE target (it has
            // no nft `queue`): iptables, whose nft backend uses it. With no program
            // listening, packets pass (bypass).
            let ns = net.host(v);
            let ipt = |args: &[&str]| {
                let mut all = vec!["netns", "exec", ns.as_str(), "iptables"];
                all.extend_from_slice(args);
                sh("ip", &all)
            };
            ipt(&[
                "-A",
                "OUTPUT",
                "-d",
                &format!("{WATCHER_ADDR}/32"),
                "-j",
                "ACCEPT",
            ])?;
            let queue = DELAY_QUEUE.to_string();
            ipt(&[
                "-A",
                "OUTPUT",
                "-d",
                "10.77.0.0/24",
                "-j",
                "NFQUEUE",
                "--queue-num",
                &queue,
                "--queue-bypass",
            ])?;
            std::thread::sleep(FAULT_HOLD);
            ipt(&["-F", "OUTPUT"])?;
            stop.store(true, Ordering::Release);
            let held = delayer
                .join()
                .map_err(|_| anyhow!("the delaying thread panicked"))??;
            if held == 0 {
                bail!("no packet of node {v} went through the delay queue");
            }
            report.detail = Some(format!("{held} packets held {} ms", DELAY.as_millis()));
            Instant::now()
        }
        Scenario::DiskFull => {
            let v = disk_victim.expect("chosen");
            report.victims.push(v);
            let filler = pool.node(v).data_dir.join("chaos-filler");
            let mut f = fs::File::create(&filler)?;
            let block = vec![0u8; 1 << 20];
            // Until the disk is full (ENOSPC ends it).
            while f.write_all(&block).is_ok() {}
            drop(f);
            std::thread::sleep(FAULT_HOLD);
            fs::remove_file(&filler)?;
            Instant::now()
        }
    };
    // The demo finishes, every page verified; meanwhile, the pool copies the pages the
    // fault left short (the recovery: from the fault's end until none is short, once
    // some were).
    let t0 = Instant::now();
    let mut short_seen = false;
    let mut recovered = None;
    let status = loop {
        if let Some(s) = demo.try_wait()? {
            break s;
        }
        if t0.elapsed() > DEMO_LIMIT {
            let _ = demo.kill();
            bail!("the demo did not finish within {} s", DEMO_LIMIT.as_secs());
        }
        if recovered.is_none() {
            match pool.under_replicated() {
                Some(0) if short_seen => recovered = Some(fault_end.elapsed()),
                Some(b) if b > 0 => short_seen = true,
                _ => {}
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let rest = drain.join().unwrap_or_default();
    let demo_report: serde_json::Value = serde_json::from_str(&fs::read_to_string(&out_path)?)
        .map_err(|e| {
            anyhow!(
                "the demo's report does not parse ({e}); its stderr: {}",
                rest.trim()
            )
        })?;
    let page_bytes = demo_report["page_bytes"].as_u64().unwrap_or(1).max(1);
    report.steps = demo_report["steps"]
        .as_array()
        .map_or(0, |s| s.len() as u64);
    report.pages_verified = demo_report["verified_bytes"].as_u64().unwrap_or(0) / page_bytes;
    report.pages_corrupt = demo_report["corrupt_pages"].as_u64().unwrap_or(u64::MAX);
    report.pages_lost = demo_report["lost_buffers"]
        .as_array()
        .map_or(0, |l| l.len() as u64);
    if !status.success() {
        bail!(
            "the demo failed: {}",
            rest.trim().lines().last().unwrap_or("")
        );
    }
    if report.steps != u64::from(steps) || report.pages_corrupt != 0 || report.pages_lost != 0 {
        bail!(
            "the demo ran {} of {steps} steps, {} corrupt, {} buffers lost",
            report.steps,
            report.pages_corrupt,
            report.pages_lost
        );
    }
    // Every page has its copies again.
    wait_for("every page's copies again", REPAIR_LIMIT, || {
        pool.under_replicated().filter(|&b| b == 0)
    })?;
    let recovery = recovered.unwrap_or_else(|| fault_end.elapsed());
    report.recovery_s = Some((recovery.as_secs_f64() * 10.0).round() / 10.0);
    report.ok = true;
    drop(pool);
    drop(net);
    Ok(())
}

/// Holds every packet queued to [`DELAY_QUEUE`] in namespace `ns` for `delay`, then lets
/// it go, until `stop` (then lets everything go at once and returns how many passed).
fn delay_packets(
    ns: String,
    delay: Duration,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Result<u64>> {
    std::thread::spawn(move || {
        // The queue is the namespace's: this thread moves there first.
        let file = fs::File::open(format!("/var/run/netns/{ns}"))?;
        rustix::thread::move_into_link_name_space(
            file.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )?;
        let mut queue = nfq::Queue::open().context("opening an NFQUEUE socket")?;
        queue
            .bind(DELAY_QUEUE)
            .context("binding the NFQUEUE queue")?;
        queue.set_fail_open(DELAY_QUEUE, true)?;
        queue.set_nonblocking(true);
        let mut held: std::collections::VecDeque<(Instant, nfq::Message)> = Default::default();
        let mut passed = 0u64;
        loop {
            let stopping = stop.load(Ordering::Acquire);
            while held
                .front()
                .is_some_and(|(t, _)| stopping || t.elapsed() >= delay)
            {
                let (_, mut m) = held.pop_front().expect("checked");
                m.set_verdict(nfq::Verdict::Accept);
                queue.verdict(m)?;
                passed += 1;
            }
            match queue.recv() {
                Ok(m) => held.push_back((Instant::now(), m)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if stopping && held.is_empty() {
                        return Ok(passed);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e.into()),
            }
        }
    })
}
