//! `up` and `down` of a pool of node processes on this machine.
//!
//! `up` initializes the pool directory if it holds no pool, starts every node that is
//! not running, and waits, with a deadline, until every node answers `/status` and they
//! agree on a leader. If a node it started exits meanwhile, or the deadline passes, it
//! stops the nodes it started and returns an error with the end of the log of the node
//! to blame. `down` stops every running node (SIGTERM, then SIGKILL after a deadline).

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use crate::error::ClusterError;
use crate::process::{self, LOG_TAIL_LINES, StopReport};
use crate::spec::{self, ClusterSpec, InitOptions};
use crate::status::{PoolReport, query_pool};

/// Default time `up` waits for the pool to be ready: 30 s (start-up takes about one
/// election, under a second, when the machine is not overloaded).
pub const READY_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Interval between two rounds of `/status` queries while waiting.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Time each node has to answer one `/status` query while waiting.
const POLL_STATUS_TIMEOUT: Duration = Duration::from_millis(250);

/// What `up` does.
#[derive(Clone, Debug)]
pub struct UpOptions {
    /// The layout, if the pool has to be initialized (`force` is not used: `up` never
    /// replaces a pool). With an existing pool, `nodes` must match it.
    pub init: InitOptions,
    /// The `spillway` executable that runs nodes (`spillway node --config ...`).
    pub exe: PathBuf,
    /// How long to wait for the pool to be ready.
    pub ready_timeout: Duration,
    /// The nodes' `SPILLWAY_LOG` filter.
    pub log_filter: String,
}

/// Progress of `up`, for a progress display.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpEvent {
    /// A new pool was laid out in the directory.
    Initialized {
        /// Its nodes.
        nodes: usize,
    },
    /// A node was started.
    Spawned {
        /// The node.
        node: u64,
        /// Its process.
        pid: u32,
    },
    /// A node was already running.
    AlreadyRunning {
        /// The node.
        node: u64,
        /// Its process.
        pid: u32,
    },
    /// One round of `/status` queries.
    Waiting {
        /// Nodes that answered.
        answering: usize,
        /// Nodes in the pool.
        total: usize,
        /// The leader they agree on, if they do.
        leader: Option<u64>,
    },
}

/// What `up` did.
#[derive(Debug)]
pub struct UpReport {
    /// The pool.
    pub spec: ClusterSpec,
    /// Whether it was initialized now.
    pub initialized: bool,
    /// Nodes started now: (node, pid).
    pub started: Vec<(u64, u32)>,
    /// The pool's status once ready.
    pub status: PoolReport,
    /// From the call to ready.
    pub elapsed: Duration,
}

/// Calls `f` every `interval` until it returns `Some` or `timeout` passes (then `None`).
/// `f` is called at least once and once more at the deadline.
pub fn poll_until<T>(
    timeout: Duration,
    interval: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        std::thread::sleep(interval.min(deadline - now));
    }
}

/// The `/status` targets of a pool: (metrics address, node id).
pub fn status_targets(spec: &ClusterSpec) -> Vec<(String, Option<u64>)> {
    spec.nodes
        .iter()
        .map(|n| (n.metrics_addr.to_string(), Some(n.id)))
        .collect()
}

/// Starts the pool in `dir` (initializing it if needed) and waits until it is ready.
pub fn up(
    dir: &Path,
    opts: &UpOptions,
    on_event: &mut dyn FnMut(&UpEvent),
) -> Result<UpReport, ClusterError> {
    let start = Instant::now();
    let initialized = !ClusterSpec::exists(dir);
    let spec = if initialized {
        let init = InitOptions {
            force: false,
            ..opts.init.clone()
        };
        let spec = spec::init(dir, &init)?;
        on_event(&UpEvent::Initialized {
            nodes: spec.nodes.len(),
        });
        spec
    } else {
        let spec = ClusterSpec::load(dir)?;
        if spec.nodes.len() != opts.init.nodes as usize {
            return Err(ClusterError::Option {
                option: "--nodes",
                problem: format!(
                    "is {} but the pool in {} has {} nodes; use `spillway cluster init --force` to lay out another",
                    opts.init.nodes,
                    spec.dir.display(),
                    spec.nodes.len()
                ),
            });
        }
        spec
    };

    let mut children: Vec<(u64, Child)> = Vec::new();
    for node in &spec.nodes {
        if let Some(pid) = process::running_pid(node) {
            on_event(&UpEvent::AlreadyRunning { node: node.id, pid });
            continue;
        }
        match process::spawn_node(&opts.exe, node, &opts.log_filter) {
            Ok(child) => {
                on_event(&UpEvent::Spawned {
                    node: node.id,
                    pid: child.id(),
                });
                children.push((node.id, child));
            }
            Err(e) => {
                stop_children(&spec, &mut children);
                return Err(e);
            }
        }
    }
    match wait_ready(&spec, opts.ready_timeout, &mut children, on_event) {
        Ok(status) => Ok(UpReport {
            started: children.iter().map(|(id, c)| (*id, c.id())).collect(),
            spec,
            initialized,
            status,
            elapsed: start.elapsed(),
        }),
        Err(e) => {
            stop_children(&spec, &mut children);
            Err(e)
        }
    }
}

/// Stops the nodes `up` started (after a failure) and reaps them.
fn stop_children(spec: &ClusterSpec, children: &mut [(u64, Child)]) {
    let pids: Vec<(u64, u32)> = children.iter().map(|(id, c)| (*id, c.id())).collect();
    if let Err(e) = process::stop_pids(&pids, Duration::from_secs(2)) {
        tracing::warn!("stopping the nodes after a failed start: {e}");
    }
    for (id, child) in children.iter_mut() {
        let _ = child.wait();
        if let Some(node) = spec.node(*id) {
            let _ = std::fs::remove_file(&node.pid_file);
        }
    }
}

/// Waits until every node of `spec` answers `/status`, they agree on a leader and the
/// leader sees every member's lent capacity, or `timeout` passes. `children` are processes to watch: if one exits, the wait ends
/// with [`ClusterError::Exited`].
pub fn wait_ready(
    spec: &ClusterSpec,
    timeout: Duration,
    children: &mut [(u64, Child)],
    on_event: &mut dyn FnMut(&UpEvent),
) -> Result<PoolReport, ClusterError> {
    let targets = status_targets(spec);
    let total = spec.nodes.len();
    let start = Instant::now();
    let mut last: Option<PoolReport> = None;
    let mut exited: Option<ClusterError> = None;
    let ready = poll_until(timeout, POLL_INTERVAL, || {
        for (id, child) in children.iter_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                let node = spec.node(*id).expect("children are nodes of the spec");
                exited = Some(ClusterError::Exited {
                    node: *id,
                    status: status.to_string(),
                    log: node.log.clone(),
                    log_tail: process::log_tail(&node.log, LOG_TAIL_LINES),
                });
                // Stop polling: report it.
                return Some(None);
            }
        }
        let report = query_pool(&targets, POLL_STATUS_TIMEOUT);
        on_event(&UpEvent::Waiting {
            answering: report.answering,
            total,
            leader: report.leader.filter(|_| report.leader_agreed),
        });
        // Ready also means every member's lent capacity is committed: before that, a
        // client would find no room on the peers.
        let done = report.answering == total
            && report.leader_agreed
            && report.members.len() == total
            && report.members.iter().all(|m| m.capacity_bytes > 0);
        last = Some(report.clone());
        done.then_some(Some(report))
    });
    if let Some(e) = exited {
        return Err(e);
    }
    if let Some(Some(report)) = ready {
        return Ok(report);
    }
    // Blame the first node that did not answer, else node 1 (no leader agreed).
    let (blamed, problem) = match last.as_ref().and_then(|r| r.nodes.iter().find(|n| !n.up)) {
        Some(down) => (
            down.expected_id.and_then(|id| spec.node(id)),
            format!(
                "node {} did not answer /status at {}: {}",
                down.expected_id.unwrap_or(0),
                down.target,
                down.error.as_deref().unwrap_or("no answer")
            ),
        ),
        None => (
            spec.nodes.first(),
            match last.as_ref().map(|r| (r.leader, r.leader_agreed)) {
                Some((Some(l), true)) => {
                    format!("node {l} leads but the members' lent capacity was not committed")
                }
                Some((Some(l), false)) => format!("the nodes do not agree that node {l} leads"),
                _ => "every node answers but none is the leader".to_string(),
            },
        ),
    };
    let log = blamed.map(|n| n.log.clone()).unwrap_or_default();
    Err(ClusterError::NotReady {
        waited: start.elapsed(),
        problem,
        log_tail: process::log_tail(&log, LOG_TAIL_LINES),
        log,
    })
}

/// Stops every running node of the pool in `dir`: SIGTERM, `grace` to exit, SIGKILL.
pub fn down(dir: &Path, grace: Duration) -> Result<(ClusterSpec, StopReport), ClusterError> {
    let spec = ClusterSpec::load(dir)?;
    let report = process::stop_nodes(&spec, grace)?;
    Ok((spec, report))
}
