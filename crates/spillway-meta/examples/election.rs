//! Fail-over time: kill the leader of a 3-node group, measure until a new leader is
//! elected and until a proposal commits under it. Two ways:
//! - `sim`: the seeded simulation (ticks and 0.2–2 ms latencies in simulated time; the
//!   kill lands at a random moment);
//! - `threads`: one thread per node, real timers ticking every `--tick-ms`, messages over
//!   channels (encoded as on the wire), raft-engine with fsync; wall-clock time.
//!
//! ```text
//! cargo run --release -p spillway-meta --example election -- \
//!     [--mode both|sim|threads] [--trials 20] [--tick-ms 100] [--heartbeat-ticks 1] \
//!     [--election-ticks 5] [--election-ticks-max 8] [--seed 1]
//! ```
//! Prints a table, then one JSON line per mode. p99 is the nearest-rank 99th percentile
//! (with 20 trials, the slowest one).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use spillway_meta::sim::{SimCluster, SimConfig};
use spillway_meta::{
    Batch, Epoch, Extent, InitialCluster, MemberInfo, MetaConfig, MetaNode, NodeId, Update, wire,
};
use spillway_types::BufferId;

#[derive(Clone)]
struct Args {
    modes: Vec<&'static str>,
    trials: usize,
    tick_ms: u64,
    heartbeat_ticks: usize,
    election_ticks: usize,
    election_ticks_max: usize,
    seed: u64,
}

fn args() -> Args {
    let mut a = Args {
        modes: vec!["sim", "threads"],
        trials: 20,
        tick_ms: 100,
        heartbeat_ticks: 1,
        election_ticks: 5,
        election_ticks_max: 8,
        seed: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--mode" => {
                a.modes = match v().as_str() {
                    "sim" => vec!["sim"],
                    "threads" => vec!["threads"],
                    "both" => vec!["sim", "threads"],
                    other => panic!("--mode sim|threads|both, not {other}"),
                }
            }
            "--trials" => a.trials = v().parse().expect("--trials N"),
            "--tick-ms" => a.tick_ms = v().parse().expect("--tick-ms N"),
            "--heartbeat-ticks" => a.heartbeat_ticks = v().parse().expect("N"),
            "--election-ticks" => a.election_ticks = v().parse().expect("N"),
            "--election-ticks-max" => a.election_ticks_max = v().parse().expect("N"),
            "--seed" => a.seed = v().parse().expect("--seed N"),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn one_batch(now_ms: u64, buffer: u64) -> Batch {
    let mut b = Batch::new(now_ms);
    b.push(Update::Place {
        extent: Extent::new(BufferId(buffer), 0, 1),
        holder: NodeId(1),
        epoch: Epoch(1),
        version: 1,
        reservation: None,
        replica: 0,
    });
    b
}

/// (elected_ms, first_commit_ms) per trial.
fn sim_trials(a: &Args) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    for t in 0..a.trials {
        let root = tempfile::tempdir().expect("temp dir");
        let mut config = SimConfig::new(a.seed + t as u64);
        config.tick_ms = a.tick_ms;
        config.heartbeat_ticks = a.heartbeat_ticks;
        config.election_ticks = a.election_ticks;
        config.election_ticks_max = a.election_ticks_max;
        let mut c = SimCluster::new(config, root.path()).expect("cluster");
        c.wait_for_leader(60_000);
        c.commit(&one_batch(c.now_ms(), 1), 60_000);
        // Kill at a random moment relative to heartbeats and ticks.
        let wait = spillway_meta::rng::SimRng::new(a.seed ^ t as u64).below(10 * a.tick_ms);
        c.run_for_ms(wait);
        let old = c.leader().expect("leader");
        let old_term = c.node(old).term();
        c.kill(old);
        let t0 = c.now_us();
        c.run_until(60_000, |c| {
            c.leader()
                .is_some_and(|l| l != old && c.node(l).term() > old_term)
        })
        .expect("new leader");
        let elected = (c.now_us() - t0) as f64 / 1000.0;
        c.commit(&one_batch(c.now_ms(), 2), 60_000);
        let committed = (c.now_us() - t0) as f64 / 1000.0;
        out.push((elected, committed));
    }
    out
}

// ---- real threads ----

enum Input {
    Raft(Vec<u8>),
    Propose(Batch),
}

#[derive(Clone, Copy, Default)]
struct Seen {
    leader: bool,
    term: u64,
    commit: u64,
    alive: bool,
}

struct Live {
    thread: JoinHandle<Receiver<Input>>,
    stop: Arc<AtomicBool>,
}

struct Threads {
    peers: Vec<Sender<Input>>,
    inboxes: Vec<Option<Receiver<Input>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    live: Vec<Option<Live>>,
    initial: InitialCluster,
    root: tempfile::TempDir,
    a: Args,
    lives: u64,
}

impl Threads {
    fn new(a: &Args) -> Self {
        let n = 3;
        let mut peers = Vec::new();
        let mut inboxes = Vec::new();
        for _ in 0..n {
            let (tx, rx) = mpsc::channel();
            peers.push(tx);
            inboxes.push(Some(rx));
        }
        let initial = InitialCluster {
            members: (1..=n as u64)
                .map(|i| MemberInfo {
                    id: NodeId(i),
                    addresses: vec![],
                    capacity_bytes: 1 << 40,
                    zone: None,
                })
                .collect(),
            page_bytes: 2 << 20,
        };
        let mut t = Threads {
            peers,
            inboxes,
            seen: Arc::new(Mutex::new(vec![Seen::default(); n])),
            live: (0..n).map(|_| None).collect(),
            initial,
            root: tempfile::tempdir().expect("temp dir"),
            a: a.clone(),
            lives: 0,
        };
        for i in 0..n {
            t.start(i);
        }
        t
    }

    fn start(&mut self, i: usize) {
        let id = NodeId(i as u64 + 1);
        let mut config = MetaConfig::new(id, self.root.path().join(format!("node-{}", id.0)));
        config.heartbeat_ticks = self.a.heartbeat_ticks;
        config.election_ticks = self.a.election_ticks;
        config.election_ticks_max = self.a.election_ticks_max;
        // Each life of a node draws its election timeouts from its own seed.
        self.lives += 1;
        config.seed = self
            .a
            .seed
            .wrapping_mul(0x9E37_79B9)
            .wrapping_add(self.lives);
        // One inbox per node for the whole run (peers keep their senders); messages that
        // reached it while the node was dead are lost, as on a real network.
        let inbox = self.inboxes[i].take().expect("inbox of a dead node");
        while inbox.try_recv().is_ok() {}
        let peers = self.peers.clone();
        let seen = Arc::clone(&self.seen);
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let initial = self.initial.clone();
        let tick = Duration::from_millis(self.a.tick_ms);
        let thread = std::thread::spawn(move || {
            let mut node = MetaNode::open(config, Some(&initial)).expect("open");
            let mut next_tick = Instant::now() + tick;
            while !stop2.load(Ordering::Relaxed) {
                let timeout = next_tick.saturating_duration_since(Instant::now());
                match inbox.recv_timeout(timeout) {
                    Ok(Input::Raft(bytes)) => {
                        let m = wire::decode_message(&bytes).expect("decode");
                        node.step(m).expect("step");
                    }
                    Ok(Input::Propose(b)) => {
                        let _ = node.propose(&b);
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
                if Instant::now() >= next_tick {
                    node.tick();
                    next_tick += tick;
                }
                node.handle_ready().expect("ready");
                for m in node.poll_messages() {
                    let to = m.to as usize - 1;
                    let _ = peers[to].send(Input::Raft(wire::encode_message(&m)));
                }
                node.take_completions();
                seen.lock().unwrap()[i] = Seen {
                    leader: node.is_leader(),
                    term: node.term(),
                    commit: node.commit_index(),
                    alive: true,
                };
            }
            seen.lock().unwrap()[i].alive = false;
            inbox
        });
        self.live[i] = Some(Live { thread, stop });
    }

    fn kill(&mut self, i: usize) {
        if let Some(l) = self.live[i].take() {
            l.stop.store(true, Ordering::Relaxed);
            self.inboxes[i] = Some(l.thread.join().expect("node thread"));
        }
        self.seen.lock().unwrap()[i] = Seen::default();
    }

    fn leader(&self) -> Option<(usize, Seen)> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .enumerate()
            .filter(|(_, s)| s.alive && s.leader)
            .max_by_key(|(_, s)| s.term)
            .map(|(i, s)| (i, *s))
    }

    fn wait<T>(&self, max: Duration, mut f: impl FnMut(&Self) -> Option<T>) -> Option<T> {
        let end = Instant::now() + max;
        while Instant::now() < end {
            if let Some(v) = f(self) {
                return Some(v);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        None
    }
}

fn thread_trials(a: &Args) -> Vec<(f64, f64)> {
    let mut t = Threads::new(a);
    let mut out = Vec::new();
    let mut rng = spillway_meta::rng::SimRng::new(a.seed);
    for trial in 0..a.trials {
        let (old, s) = t
            .wait(Duration::from_secs(30), |t| t.leader())
            .expect("a leader");
        // Let the group settle, then kill at a random moment.
        std::thread::sleep(Duration::from_millis(300 + rng.below(a.tick_ms * 10)));
        let t0 = Instant::now();
        t.kill(old);
        let (new, _) = t
            .wait(Duration::from_secs(30), |t| {
                t.leader().filter(|(_, n)| n.term > s.term)
            })
            .unwrap_or_else(|| {
                let seen: Vec<(bool, bool, u64, u64)> = t
                    .seen
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|s| (s.alive, s.leader, s.term, s.commit))
                    .collect();
                panic!(
                    "no new leader after killing node {}: (alive, leader, term, commit) {seen:?}",
                    old + 1
                )
            });
        let elected = t0.elapsed().as_secs_f64() * 1000.0;
        let commit_before = t.seen.lock().unwrap()[new].commit;
        let _ = t.peers[new].send(Input::Propose(one_batch(trial as u64, trial as u64)));
        t.wait(Duration::from_secs(30), |t| {
            (t.seen.lock().unwrap()[new].commit > commit_before).then_some(())
        })
        .expect("a commit");
        let committed = t0.elapsed().as_secs_f64() * 1000.0;
        out.push((elected, committed));
        t.start(old);
    }
    for i in 0..3 {
        t.kill(i);
    }
    out
}

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank - 1]
}

fn main() {
    let a = args();
    println!(
        "tick {} ms, heartbeat {} ticks, election timeout {}..{} ticks, {} trials",
        a.tick_ms, a.heartbeat_ticks, a.election_ticks, a.election_ticks_max, a.trials
    );
    println!(
        "{:<8} {:>12} {:>12} {:>12} {:>14} {:>14}",
        "mode", "elect p50", "elect p99", "elect max", "commit p50", "commit p99"
    );
    let mut json = Vec::new();
    for mode in &a.modes {
        let r = if *mode == "sim" {
            sim_trials(&a)
        } else {
            thread_trials(&a)
        };
        let e: Vec<f64> = r.iter().map(|x| x.0).collect();
        let c: Vec<f64> = r.iter().map(|x| x.1).collect();
        let (e50, e99, emax) = (
            pct(e.clone(), 50.0),
            pct(e.clone(), 99.0),
            pct(e.clone(), 100.0),
        );
        let (c50, c99) = (pct(c.clone(), 50.0), pct(c.clone(), 99.0));
        println!(
            "{:<8} {:>9.0} ms {:>9.0} ms {:>9.0} ms {:>11.0} ms {:>11.0} ms",
            mode, e50, e99, emax, c50, c99
        );
        json.push(serde_json::json!({
            "bench": "election",
            "mode": mode,
            "trials": a.trials,
            "tick_ms": a.tick_ms,
            "heartbeat_ticks": a.heartbeat_ticks,
            "election_ticks": a.election_ticks,
            "election_ticks_max": a.election_ticks_max,
            "elected_ms_p50": e50,
            "elected_ms_p99": e99,
            "elected_ms_max": emax,
            "first_commit_ms_p50": c50,
            "first_commit_ms_p99": c99,
            "elected_ms": e,
        }));
    }
    for j in json {
        println!("{j}");
    }
}
