//! Directory throughput: extent updates per second committed by a 3-node in-process
//! group (real raft-engine logs in a temporary directory, messages encoded as on the
//! wire, zero network latency), with fsync on and off.
//!
//! ```text
//! cargo run --release -p spillway-meta --example directory_throughput -- \
//!     [--extents 200000] [--batch 1024] [--window 8] [--sync both|on|off] [--dir PATH]
//! ```
//! Prints a table, then one JSON line per run. `--dir` puts the logs on another file
//! system (the default temporary directory may be a tmpfs, where fsync is free).

use std::time::Instant;

use spillway_meta::sim::{SimCluster, SimConfig};
use spillway_meta::{Applied, Batch, Epoch, Extent, NodeId, ProposeError, Update};
use spillway_types::BufferId;

struct Args {
    extents: u64,
    batch: u32,
    window: usize,
    sync: Vec<bool>,
    dir: Option<std::path::PathBuf>,
}

fn args() -> Args {
    let mut a = Args {
        extents: 200_000,
        batch: 1024,
        window: 8,
        sync: vec![true, false],
        dir: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--extents" => a.extents = v().parse().expect("--extents N"),
            "--batch" => a.batch = v().parse().expect("--batch N"),
            "--window" => a.window = v().parse().expect("--window N"),
            "--sync" => {
                a.sync = match v().as_str() {
                    "on" => vec![true],
                    "off" => vec![false],
                    "both" => vec![true, false],
                    other => panic!("--sync on|off|both, not {other}"),
                }
            }
            "--dir" => a.dir = Some(v().into()),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

struct Run {
    sync: bool,
    extents: u64,
    batches: u64,
    seconds: f64,
    entries_per_fsync_leader: f64,
}

fn batch_of(n: u64, per_batch: u32) -> Batch {
    let mut b = Batch::new(n);
    for i in 0..per_batch {
        let k = n * u64::from(per_batch) + u64::from(i);
        b.push(Update::Place {
            // Four-page extents, 64 per buffer.
            extent: Extent::new(BufferId(k / 64), (k % 64) as u32 * 4, 4),
            holder: NodeId(1 + k % 3),
            epoch: Epoch(1),
            version: 1,
            reservation: None,
            replica: 0,
        });
    }
    b
}

fn run(a: &Args, sync: bool) -> Run {
    let root = match &a.dir {
        Some(d) => tempfile::tempdir_in(d).expect("temp dir"),
        None => tempfile::tempdir().expect("temp dir"),
    };
    let mut config = SimConfig::new(42);
    config.sync_writes = sync;
    config.latency_us_min = 0;
    config.latency_us_max = 0;
    config.page_bytes = 64 << 10;
    config.capacity_bytes = 1 << 50;
    config.proposals_in_flight_max = a.window.max(1);
    let mut c = SimCluster::new(config, root.path()).expect("cluster");
    let leader = c.wait_for_leader(10_000);
    let batches = a.extents.div_ceil(u64::from(a.batch));
    let start = Instant::now();
    let (mut next, mut done, mut in_flight) = (0u64, 0u64, 0usize);
    let mut committed = 0u64;
    while done < batches {
        if in_flight < a.window && next < batches {
            // Everything proposed in one call is appended by one Ready: one fsync.
            let n = (a.window - in_flight).min((batches - next) as usize);
            let props: Vec<Batch> = (next..next + n as u64)
                .map(|i| batch_of(i, a.batch))
                .collect();
            let accepted = c
                .with_node(leader, move |node| {
                    let mut ok = 0;
                    for b in &props {
                        match node.propose(b) {
                            Ok(_) => ok += 1,
                            Err(ProposeError::TooManyInFlight { .. }) => break,
                            Err(e) => panic!("propose: {e}"),
                        }
                    }
                    ok
                })
                .expect("leader runs");
            next += accepted as u64;
            in_flight += accepted;
        }
        c.step_event();
        for (_, comp) in c.take_completions() {
            match comp.result {
                Ok(Applied::Batch { outcomes }) => {
                    assert!(outcomes.iter().all(|o| o.is_ok()), "rejected updates");
                    committed += outcomes.len() as u64;
                }
                other => panic!("batch failed: {other:?}"),
            }
            in_flight -= 1;
            done += 1;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    assert_eq!(
        c.leader(),
        Some(leader),
        "leadership changed during the run"
    );
    let status = c.node(leader).status();
    Run {
        sync,
        extents: committed,
        batches,
        seconds,
        entries_per_fsync_leader: status.last_log_index as f64,
    }
}

fn main() {
    let a = args();
    let runs: Vec<Run> = a.sync.iter().map(|&s| run(&a, s)).collect();
    println!(
        "{:<6} {:>10} {:>8} {:>6} {:>7} {:>9} {:>14}",
        "fsync", "extents", "batch", "window", "batches", "seconds", "extents/s"
    );
    for r in &runs {
        println!(
            "{:<6} {:>10} {:>8} {:>6} {:>7} {:>9.3} {:>14.0}",
            if r.sync { "on" } else { "off" },
            r.extents,
            a.batch,
            a.window,
            r.batches,
            r.seconds,
            r.extents as f64 / r.seconds
        );
    }
    for r in &runs {
        let _ = r.entries_per_fsync_leader;
        println!(
            "{}",
            serde_json::json!({
                "bench": "directory_throughput",
                "nodes": 3,
                "fsync": r.sync,
                "extents": r.extents,
                "extents_per_batch": a.batch,
                "batches_in_flight": a.window,
                "seconds": r.seconds,
                "extent_updates_per_s": r.extents as f64 / r.seconds,
            })
        );
    }
}
