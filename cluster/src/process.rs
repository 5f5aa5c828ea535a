//! Node processes: start, find, stop.
//!
//! A node runs `<exe> node --config <node-k.toml>` in its own process group (a terminal's
//! Ctrl-C does not reach it; `down` stops it), with stdin closed and stdout and stderr
//! appended to its `node.log`. Its pid goes to `node.pid`.
//!
//! A pid file can outlive its process and the pid can be reused, so a pid counts as a
//! running node only if `/proc/<pid>` exists, is not a zombie, and its command line names
//! the node's config file. Only such pids are ever signalled.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process_group};
use serde::Serialize;

use crate::error::{ClusterError, io_at};
use crate::spec::{ClusterSpec, NodeSpec};

/// Default time nodes have to exit after SIGTERM before SIGKILL: 10 s (a graceful
/// shutdown closes connections and flushes the log; it takes milliseconds when healthy).
pub const STOP_GRACE_DEFAULT: Duration = Duration::from_secs(10);
/// How long to wait for the kernel to finish a SIGKILLed process: 5 s.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// Interval between checks while waiting for processes to exit.
const POLL: Duration = Duration::from_millis(20);
/// Lines of a node's log shown when it fails.
pub const LOG_TAIL_LINES: usize = 20;

/// Whether `pid` is a live process (exists and is not a zombie).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "pid (comm) S ...": the state follows the last ')' (comm may contain anything).
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    !matches!(state, Some("Z" | "X" | "x") | None)
}

/// Whether live process `pid` is the node started with `config`.
fn is_node_process(pid: u32, config: &Path) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let config = config.as_os_str().as_encoded_bytes();
    pid_alive(pid) && cmdline.split(|&b| b == 0).any(|arg| arg == config)
}

/// The pid recorded for `node`, if that process runs and is that node.
pub fn running_pid(node: &NodeSpec) -> Option<u32> {
    let pid = recorded_pid(node)?;
    is_node_process(pid, &node.config).then_some(pid)
}

fn recorded_pid(node: &NodeSpec) -> Option<u32> {
    fs::read_to_string(&node.pid_file)
        .ok()?
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|&p| p > 1)
}

/// Starts `node` as `exe node --config <config>`; `log_filter` becomes its `SPILLWAY_LOG`.
/// Records its pid. The caller may keep the [`Child`] to reap it; dropping it leaves the
/// node running.
pub fn spawn_node(exe: &Path, node: &NodeSpec, log_filter: &str) -> Result<Child, ClusterError> {
    spawn_node_with(exe, node, log_filter, &[], &[])
}

/// [`spawn_node`] with more arguments after `--config <config>` (`--join`, `--ca`, ...)
/// and more environment variables (a join token, kept out of the command line that `ps`
/// shows).
pub fn spawn_node_with(
    exe: &Path,
    node: &NodeSpec,
    log_filter: &str,
    args: &[String],
    envs: &[(&str, &str)],
) -> Result<Child, ClusterError> {
    use std::os::unix::process::CommandExt;
    let node_dir = node.log.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(node_dir).map_err(io_at(node_dir))?;
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&node.log)
        .map_err(io_at(&node.log))?;
    let log_err = log.try_clone().map_err(io_at(&node.log))?;
    let mut command = Command::new(exe);
    command
        .arg("node")
        .arg("--config")
        .arg(&node.config)
        .args(args)
        .envs(envs.iter().copied())
        .env("SPILLWAY_LOG", log_filter);
    // An error that stops the node should end its log, not a backtrace of it (panics
    // still print theirs under RUST_BACKTRACE).
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        command.env("RUST_LIB_BACKTRACE", "0");
    }
    let child = command
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .process_group(0)
        .spawn()
        .map_err(|source| ClusterError::Spawn {
            node: node.id,
            exe: exe.to_path_buf(),
            source,
        })?;
    fs::write(&node.pid_file, format!("{}\n", child.id())).map_err(io_at(&node.pid_file))?;
    Ok(child)
}

/// The last `lines` lines of a log (empty if it cannot be read). Reads at most 64 KiB.
pub fn log_tail(path: &Path, lines: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let from = len.saturating_sub(64 << 10);
    let mut text = String::new();
    if file.seek(SeekFrom::Start(from)).is_err() {
        return String::new();
    }
    let mut bytes = Vec::new();
    if file.read_to_end(&mut bytes).is_err() {
        return String::new();
    }
    text.push_str(&String::from_utf8_lossy(&bytes));
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Sends `signal` to the process group of node process `pid` (its group leader).
pub fn signal_node(node: u64, pid: u32, signal: Signal) -> Result<(), ClusterError> {
    let signal_err = |source: std::io::Error| ClusterError::Signal { node, pid, source };
    let p = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| signal_err(std::io::Error::other("not a pid")))?;
    match kill_process_group(p, signal) {
        Ok(()) => Ok(()),
        // Gone between the check and the signal: what we wanted.
        Err(rustix::io::Errno::SRCH) => Ok(()),
        Err(e) => Err(signal_err(e.into())),
    }
}

/// Stops processes `(node, pid)`: SIGTERM to each, up to `grace` for all to exit, then
/// SIGKILL to those left, and waits for them to go. Returns the pids that were killed.
pub fn stop_pids(running: &[(u64, u32)], grace: Duration) -> Result<Vec<u32>, ClusterError> {
    for &(node, pid) in running {
        signal_node(node, pid, Signal::TERM)?;
    }
    let all_exited = || running.iter().all(|&(_, pid)| !pid_alive(pid));
    let deadline = Instant::now() + grace;
    while !all_exited() && Instant::now() < deadline {
        std::thread::sleep(POLL);
    }
    let mut killed = Vec::new();
    for &(node, pid) in running {
        if pid_alive(pid) {
            signal_node(node, pid, Signal::KILL)?;
            killed.push(pid);
        }
    }
    let deadline = Instant::now() + KILL_WAIT;
    while !all_exited() && Instant::now() < deadline {
        std::thread::sleep(POLL);
    }
    Ok(killed)
}

/// How one node was stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopOutcome {
    /// It exited after SIGTERM.
    Terminated,
    /// It did not exit within the grace period and was SIGKILLed.
    Killed,
    /// It was not running (a stale pid file was removed, if any).
    NotRunning,
}

/// What `down` did, per node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StopReport {
    /// (node id, pid if it ran, outcome).
    pub nodes: Vec<(u64, Option<u32>, StopOutcome)>,
}

/// Stops every running node of `spec`: SIGTERM, up to `grace` to exit, then SIGKILL.
/// Removes the pid files.
pub fn stop_nodes(spec: &ClusterSpec, grace: Duration) -> Result<StopReport, ClusterError> {
    let running: Vec<(u64, u32)> = spec
        .nodes
        .iter()
        .filter_map(|n| running_pid(n).map(|pid| (n.id, pid)))
        .collect();
    let killed = stop_pids(&running, grace)?;
    let mut report = StopReport { nodes: Vec::new() };
    for node in &spec.nodes {
        let pid = running.iter().find(|(id, _)| *id == node.id).map(|p| p.1);
        let outcome = match pid {
            None => StopOutcome::NotRunning,
            Some(pid) if killed.contains(&pid) => StopOutcome::Killed,
            Some(_) => StopOutcome::Terminated,
        };
        if node.pid_file.exists() {
            fs::remove_file(&node.pid_file).map_err(io_at(&node.pid_file))?;
        }
        report.nodes.push((node.id, pid, outcome));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_reaped_child_is_not() {
        assert!(pid_alive(std::process::id()));
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!pid_alive(pid));
    }

    #[test]
    fn a_pid_file_of_another_program_is_not_a_node() {
        let tmp = tempfile::tempdir().unwrap();
        let node = NodeSpec {
            id: 1,
            peer_addr: "127.0.0.1:1".parse().unwrap(),
            metrics_addr: "127.0.0.1:2".parse().unwrap(),
            client_socket: tmp.path().join("c.sock"),
            config: tmp.path().join("node-1.toml"),
            data_dir: tmp.path().join("d"),
            pool_dir: tmp.path().join("pool"),
            log: tmp.path().join("node.log"),
            pid_file: tmp.path().join("node.pid"),
        };
        assert_eq!(running_pid(&node), None);
        // This test process is alive but is not node 1.
        fs::write(&node.pid_file, format!("{}\n", std::process::id())).unwrap();
        assert_eq!(running_pid(&node), None);
        fs::write(&node.pid_file, "garbage").unwrap();
        assert_eq!(running_pid(&node), None);
    }

    #[test]
    fn log_tail_keeps_the_last_lines() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("log");
        let text: String = (0..100).map(|i| format!("line {i}\n")).collect();
        fs::write(&path, text).unwrap();
        assert_eq!(log_tail(&path, 2), "line 98\nline 99");
        assert_eq!(log_tail(&tmp.path().join("none"), 2), "");
    }
}
