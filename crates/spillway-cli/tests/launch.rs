//! `spillway launch` as a black box on one host (loopback): the plan under a Slurm
//! environment, the job's environment and exit status, SIGTERM forwarded to the job, two
//! ranks of one host sharing one node, and the node stopped after the host's last rank.
//! The 4-host runs are scripts/launch-netns-test.sh (root, network namespaces).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Longest any wait of these tests may take.
const DEADLINE: Duration = Duration::from_secs(60);

fn launch(dir: &Path, port: u16, extra: &[&str], job: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spillway"));
    c.arg("launch");
    if !extra.contains(&"--host-budget") {
        c.args(["--host-budget", "64MiB"]);
    }
    c.arg("--dir")
        .arg(dir.join("pool"))
        .arg("--run-base")
        .arg(dir.join("run"))
        .args(["--port", &port.to_string()])
        .args(["--timeout-s", "60"])
        .args(extra)
        .args(["--", "sh", "-c", job])
        // Nothing of the test's own environment picks a launcher.
        .env_remove("SLURM_JOB_NODELIST")
        .env_remove("MASTER_ADDR")
        .env_remove("LWS_LEADER_ADDRESS")
        .env("SPILLWAY_LOG", "warn");
    c
}

/// [`launch`] as host 0 of the one host 127.0.0.1, for job `job_key`, `extra` after.
fn launch_here(dir: &Path, port: u16, job_key: &str, extra: &[&str], job: &str) -> Command {
    let mut args = vec![
        "--hosts",
        "127.0.0.1",
        "--host-index",
        "0",
        "--job-key",
        job_key,
    ];
    args.extend_from_slice(extra);
    launch(dir, port, &args, job)
}

/// [`launch`] of `--dry-run` (the plan only: nothing started or written) with `extra`
/// after.
fn dry_run(dir: &Path, port: u16, extra: &[&str]) -> Command {
    let mut args = vec!["--dry-run"];
    args.extend_from_slice(extra);
    launch(dir, port, &args, "true")
}

/// Asserts that launch failed with exit code 1 (an error of its own, not a job's status);
/// its stderr.
fn launch_error(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Starts `c` with its stdout and stderr piped (for [`wait_output`]).
fn spawn_piped(mut c: Command) -> Child {
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Polls `f` until it holds; panics after [`DEADLINE`].
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        // The poll interval: `f` reads files and processes of other processes, which
        // signal nothing this test could wait on.
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_output(child: Child) -> Output {
    child.wait_with_output().expect("launch runs")
}

fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit(')').next().unwrap_or("").split_whitespace().next();
            !matches!(state, Some("Z" | "X") | None)
        })
        .unwrap_or(false)
}

/// The node pid launch recorded in its run directory.
fn node_pid(run: &Path) -> u32 {
    let dir = std::fs::read_dir(run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("node.pid").exists())
        .expect("a run directory with node.pid");
    std::fs::read_to_string(dir.join("node.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn dry_run_prints_the_slurm_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let out = dry_run(tmp.path(), 18100, &[])
        .envs([
            ("SLURM_JOB_NODELIST", "gpu[01-04,07]"),
            ("SLURM_NNODES", "5"),
            ("SLURM_NODEID", "3"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_PROCID", "7"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x5)"),
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_ID", "1"),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(text.contains("environment:   slurm\n"), "{text}");
    assert!(text.contains("gpu01,gpu02,gpu03,gpu04,gpu07"), "{text}");
    assert!(
        text.contains("index 3 (node 4), local rank 1 of 2"),
        "{text}"
    );
    assert!(text.contains("host indices 0,1,2,3,4\n"), "{text}");
    assert!(text.contains("spillway-slurm-77.1-node4"), "{text}");
    // Nothing was started or written.
    assert!(!tmp.path().join("pool").exists());
}

#[test]
fn inconsistent_environment_is_refused_with_the_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let out = dry_run(tmp.path(), 18110, &[])
        .envs([
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("WORLD_SIZE", "7"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
        ])
        .output()
        .unwrap();
    let err = launch_error(&out);
    assert!(
        err.contains("WORLD_SIZE=7 is not a multiple of LOCAL_WORLD_SIZE=2"),
        "{err}"
    );
}

#[test]
fn the_job_gets_the_socket_and_its_exit_status_is_launchs() {
    let tmp = tempfile::tempdir().unwrap();
    let seen = tmp.path().join("seen");
    let job = format!(
        "test -S \"$SPILLWAY_SOCKET\" && echo \"$SPILLWAY_SOCKET $SPILLWAY_NODE_ID $SPILLWAY_HOSTS $SPILLWAY_STATUS_ADDR\" > {} && exit 7",
        seen.display()
    );
    let out = launch_here(tmp.path(), 18120, "t", &[], &job)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    let text = std::fs::read_to_string(&seen).unwrap();
    let words: Vec<&str> = text.split_whitespace().collect();
    let socket = tmp.path().join("run/spillway-t-node1/client.sock");
    assert_eq!(
        words,
        [socket.to_str().unwrap(), "1", "1", "127.0.0.1:18121"]
    );
    // The node is gone once launch has returned.
    assert!(!pid_alive(node_pid(&tmp.path().join("run"))));
}

#[test]
fn sigterm_is_forwarded_to_the_job_and_the_node_stops() {
    let tmp = tempfile::tempdir().unwrap();
    let started = tmp.path().join("started");
    let job = format!(
        "trap 'exit 42' TERM; touch {}; while :; do sleep 0.05; done",
        started.display()
    );
    let child = spawn_piped(launch_here(tmp.path(), 18130, "sig", &[], &job));
    wait_until("the job to start", || started.exists());
    let node = node_pid(&tmp.path().join("run"));
    assert!(pid_alive(node));
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = wait_output(child);
    assert_eq!(out.status.code(), Some(42), "{out:?}");
    assert!(!pid_alive(node));
}

#[test]
fn two_ranks_share_one_node_that_outlives_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let (go, r0, r1) = (
        tmp.path().join("go"),
        tmp.path().join("r0"),
        tmp.path().join("r1"),
    );
    let rank = |r: u32, job: String| {
        let extra = ["--local-rank", &r.to_string(), "--local-world-size", "2"];
        spawn_piped(launch_here(tmp.path(), 18140, "two", &extra, &job))
    };
    // Rank 1 first: it must wait for rank 0's node, not fail.
    let one = rank(
        1,
        format!(
            "echo \"$SPILLWAY_SOCKET\" > {}; while [ ! -e {} ]; do sleep 0.05; done",
            r1.display(),
            go.display()
        ),
    );
    let zero = rank(0, format!("echo \"$SPILLWAY_SOCKET\" > {}", r0.display()));
    wait_until("both ranks' jobs", || r0.exists() && r1.exists());
    assert_eq!(
        std::fs::read_to_string(&r0).unwrap(),
        std::fs::read_to_string(&r1).unwrap()
    );
    let node = node_pid(&tmp.path().join("run"));
    // Rank 0's job has ended; its launch keeps the node while rank 1 runs.
    let run_dir: PathBuf = tmp.path().join("run/spillway-two-node1");
    wait_until("rank 0's done marker", || run_dir.join("done-0").exists());
    assert!(pid_alive(node), "the node stopped while rank 1 ran");
    std::fs::write(&go, "").unwrap();
    let (o1, o0) = (wait_output(one), wait_output(zero));
    assert!(o1.status.success(), "{o1:?}");
    assert!(o0.status.success(), "{o0:?}");
    assert!(!pid_alive(node));
}

#[test]
fn host_budget_is_a_share_of_the_host_or_refused_above_it() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = |budget: &str| {
        dry_run(tmp.path(), 18150, &["--host-budget", budget])
            .output()
            .unwrap()
    };
    let err = launch_error(&plan("15TiB"));
    assert!(
        err.contains("--host-budget asks for 16492674416640 bytes"),
        "{err}"
    );
    let out = plan("50%");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let bytes: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("host tier:"))
        .and_then(|v| v.trim().strip_suffix(" bytes"))
        .and_then(|v| v.parse().ok())
        .expect("a host tier line");
    assert!(bytes > 0 && bytes.is_multiple_of(2 << 20), "{bytes}");
}

#[test]
fn a_pinned_host_budget_above_memlock_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = |pinned: &str| {
        let mut c = dry_run(
            tmp.path(),
            18160,
            &["--host-budget", "64MiB", "--pinned", pinned],
        );
        // RLIMIT_MEMLOCK of 8 MiB for launch alone (lowering a limit needs no privilege).
        // SAFETY: setrlimit is a plain system call, safe between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut c, || {
                let limit = rustix::process::Rlimit {
                    current: Some(8 << 20),
                    maximum: Some(8 << 20),
                };
                rustix::process::setrlimit(rustix::process::Resource::Memlock, limit)
                    .map_err(std::io::Error::from)
            });
        }
        c.output().unwrap()
    };
    let err = launch_error(&plan("on"));
    assert!(
        err.contains("--host-budget 67108864 bytes would be page-locked"),
        "{err}"
    );
    assert!(err.contains("allows 8388608 bytes"), "{err}");
    assert!(err.contains("ulimit -l"), "{err}");
    // A job that pins nothing is not held to memlock.
    let out = plan("off");
    assert!(out.status.success(), "{out:?}");
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten() {
            let path = e.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out
}

#[test]
fn three_hosts_join_host_0_with_tokens_and_no_key_leaves_its_host() {
    // Three hosts on loopback addresses of their own (127.0.0.1-3), one launch each, the
    // shared directory the only thing they share.
    let tmp = tempfile::tempdir().unwrap();
    let hosts = "127.0.0.1,127.0.0.2,127.0.0.3";
    let children: Vec<Child> = (0..3)
        .map(|i| {
            let mut c = launch(
                tmp.path(),
                18170,
                &[
                    "--hosts",
                    hosts,
                    "--host-index",
                    &i.to_string(),
                    "--job-key",
                    "j",
                ],
                &format!(
                    "\"{}\" status --node \"$SPILLWAY_STATUS_ADDR\" --json > {}/status-$SPILLWAY_HOST_INDEX.json",
                    env!("CARGO_BIN_EXE_spillway"),
                    tmp.path().display()
                ),
            );
            c.stdout(Stdio::piped()).stderr(Stdio::piped());
            c.spawn().unwrap()
        })
        .collect();
    for (i, child) in children.into_iter().enumerate() {
        let out = wait_output(child);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "host {i}: {err}");
        if i == 0 {
            assert!(err.contains("serving joins on port 18172"), "{err}");
        } else {
            assert!(err.contains("joining through 127.0.0.1:18172"), "{err}");
        }
        assert!(err.contains("pool of 3 nodes ready"), "{err}");
    }
    for i in 0..3 {
        let text = std::fs::read_to_string(tmp.path().join(format!("status-{i}.json"))).unwrap();
        let status: serde_json::Value = serde_json::from_str(&text).unwrap();
        let members = status["members"].as_array().unwrap();
        let mut seen: Vec<(u64, &str, &str)> = members
            .iter()
            .map(|m| {
                (
                    m["id"].as_u64().unwrap(),
                    m["state"].as_str().unwrap(),
                    m["raft"].as_str().unwrap(),
                )
            })
            .collect();
        seen.sort();
        // Three hosts: every one votes (the first 3 do).
        assert_eq!(
            seen,
            [(1, "up", "voter"), (2, "up", "voter"), (3, "up", "voter")],
            "host {i}: {text}"
        );
        let addrs: Vec<&str> = members
            .iter()
            .map(|m| m["addr"].as_str().unwrap())
            .collect();
        assert!(
            addrs.contains(&format!("127.0.0.{}:18170", i + 1).as_str()),
            "{addrs:?}"
        );
    }
    // Each host's key is in its own run directory only; the CA key on host 0 only; the
    // shared directory holds no key, and the tokens were used up.
    let keys = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = files_under(dir)
            .iter()
            .filter(|p| p.to_string_lossy().ends_with(".key.pem"))
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let run = |k: u64| tmp.path().join(format!("run/spillway-j-node{k}"));
    assert_eq!(keys(&run(1)), ["ca.key.pem", "node-1.key.pem"]);
    assert_eq!(keys(&run(2)), ["node-2.key.pem"]);
    assert_eq!(keys(&run(3)), ["node-3.key.pem"]);
    let shared = files_under(&tmp.path().join("pool"));
    assert!(
        shared.iter().all(|p| p
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("done-")),
        "{shared:?}"
    );
    assert_eq!(shared.len(), 3, "{shared:?}");
}

#[test]
fn a_bad_join_token_fails_the_launch_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let out = launch(
        tmp.path(),
        18180,
        &[
            "--hosts",
            "127.0.0.1,127.0.0.2",
            "--host-index",
            "1",
            "--job-key",
            "bad",
            "--no-barrier",
            "--token",
            "spw1.not-a-token",
        ],
        "true",
    )
    .output()
    .unwrap();
    let err = launch_error(&out);
    assert!(err.contains("node 2 exited"), "{err}");
    assert!(
        err.contains("joining the pool through 127.0.0.1:18182"),
        "{err}"
    );
    // No shared directory was needed, none was made.
    assert!(!tmp.path().join("pool").exists());
}

#[test]
fn a_one_host_job_runs_the_demo_client_on_the_nodes_host_memory() {
    // A pool of one node has no peers to lend room: the demo client's pages live in the
    // host memory the node gives it, which holds the whole working set (24 MiB).
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("demo.json");
    let job = format!(
        "\"{}\" demo --connect \"$SPILLWAY_SOCKET\" --layers 8 --weight-mib 2 --act-mib 1 --steps 2 --host-budget 32MiB --json --out {} > {}",
        env!("CARGO_BIN_EXE_spillway"),
        tmp.path().join("demo.d").display(),
        json.display()
    );
    let out = launch_here(tmp.path(), 18190, "one", &[], &job)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let d: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(d["corrupt_pages"], 0);
    let steps = d["steps"].as_array().unwrap();
    assert!(
        d["verified_bytes"].as_u64().unwrap()
            >= d["working_set_bytes"].as_u64().unwrap() * steps.len() as u64,
        "{d}"
    );
    assert!(steps.iter().all(|s| s["remote_bytes_out"] == 0), "{d}");
}
