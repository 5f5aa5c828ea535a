//! The planner's own cost: nanoseconds per acquire (begin, plan, copies, release) of the
//! sans-IO pool core, as the pool grows from 10k to 1M pages (issue 12, point 3).
//!
//! ```sh
//! cargo run --release -p spillway-bench --example planner_cost -- [--json PATH] [--pages 10000,100000,1000000]
//! ```
//!
//! Drives `spillway_core::PoolCore` directly, with no device: every copy it asks for
//! completes at once, so the time measured is the core's (page table, predictor, planner,
//! eviction), not a copy's. The job is a training loop: buffers of
//! [`PAGES_PER_BUFFER`] pages, acquired in order, one step per sweep over all of them,
//! on a GPU budget of a quarter of the pages (so three quarters of the acquires load and
//! evict). After [`WARMUP_STEPS`] whole steps (the learned policy needs a step of
//! history), [`MEASURED_ACQUIRES`] acquires are timed (continuing the sweep, with its
//! step marks). The JSON (default `bench/out/planner_cost.json`) has one row per policy
//! and size, and the ratio of the largest size's cost to the smallest's per policy,
//! measured in the same run.

use std::time::{Duration, Instant};

use serde::Serialize;
use spillway_core::{AccessMode, PoolCore};
use spillway_types::config::{Policy, PoolConfig};
use spillway_types::{BufferId, PageSize};

/// Pages of each buffer (1 MiB buffers at 64 KiB pages).
const PAGES_PER_BUFFER: u64 = 16;
/// Page size: the smallest allowed, so budgets stay small numbers (the core allocates
/// no page memory; only counts matter).
const PAGE_BYTES: u64 = 64 << 10;
/// The GPU budget as a fraction of the pages: 1 / this.
const GPU_FRACTION_INV: u64 = 4;
/// Whole steps before timing.
const WARMUP_STEPS: usize = 1;
/// Acquires timed per policy and size.
const MEASURED_ACQUIRES: u64 = 20_000;
/// Model time between the core's events (it reads no clock; bandwidth estimates need
/// time to pass).
const TICK: Duration = Duration::from_micros(10);

#[derive(Serialize)]
struct Row {
    policy: String,
    pages: u64,
    buffers: u64,
    gpu_frames: u64,
    alloc_ns_per_buffer: f64,
    warmup_s: f64,
    acquires: u64,
    ns_per_acquire: f64,
    loads_per_acquire: f64,
}

#[derive(Serialize)]
struct Report {
    pages_per_buffer: u64,
    page_bytes: u64,
    gpu_fraction: f64,
    measured_acquires: u64,
    rows: Vec<Row>,
    /// Per policy: ns per acquire at the largest size over that at the smallest.
    growth: Vec<(String, f64)>,
}

struct Driver {
    core: PoolCore,
    now: Duration,
    buffers: Vec<BufferId>,
    next: usize,
}

impl Driver {
    fn tick(&mut self) -> Duration {
        self.now += TICK;
        self.now
    }

    /// Runs every copy the core asks for, completing each at once.
    fn drain(&mut self) {
        loop {
            while self.core.poll_mapping().is_some() {}
            let mut any = false;
            while let Some(t) = self.core.poll_transfer() {
                let now = self.tick();
                self.core.handle_transfer_done(t.id, Ok(()), now);
                any = true;
            }
            if !any {
                break;
            }
        }
    }

    /// One acquire of the next buffer in the sweep, and its release; a step mark at the
    /// end of a sweep.
    fn one(&mut self) {
        let id = self.buffers[self.next];
        let now = self.tick();
        let (a, _hit) = self
            .core
            .begin_acquire(id, AccessMode::Shared, now)
            .expect("acquire");
        self.drain();
        assert!(
            self.core.is_ready(a).expect("no device faults"),
            "not ready"
        );
        let now = self.tick();
        self.core.release(a, now);
        self.drain();
        self.next += 1;
        if self.next == self.buffers.len() {
            self.next = 0;
            let now = self.tick();
            self.core.step(now);
            self.drain();
        }
    }
}

fn measure(policy: Policy, pages: u64) -> Row {
    let buffers = pages / PAGES_PER_BUFFER;
    let frames = pages / GPU_FRACTION_INV;
    let cfg = PoolConfig {
        page_size: PageSize::new(PAGE_BYTES).expect("valid"),
        policy,
        ..PoolConfig::new(frames * PAGE_BYTES, pages * PAGE_BYTES)
    };
    let core = PoolCore::new(cfg, 50e9).expect("config");
    let mut d = Driver {
        core,
        now: Duration::ZERO,
        buffers: Vec::with_capacity(buffers as usize),
        next: 0,
    };
    let t = Instant::now();
    for _ in 0..buffers {
        let id = d.core.alloc(PAGES_PER_BUFFER * PAGE_BYTES).expect("alloc");
        d.buffers.push(id);
    }
    let alloc_ns_per_buffer = t.elapsed().as_nanos() as f64 / buffers as f64;
    let t = Instant::now();
    for _ in 0..WARMUP_STEPS as u64 * buffers {
        d.one();
    }
    let warmup_s = t.elapsed().as_secs_f64();
    let loads_before = d.core.stats().demand_loads + d.core.stats().prefetch_loads;
    let t = Instant::now();
    for _ in 0..MEASURED_ACQUIRES {
        d.one();
    }
    let ns = t.elapsed().as_nanos() as f64 / MEASURED_ACQUIRES as f64;
    let loads = d.core.stats().demand_loads + d.core.stats().prefetch_loads - loads_before;
    Row {
        policy: policy.name().into(),
        pages,
        buffers,
        gpu_frames: frames,
        alloc_ns_per_buffer,
        warmup_s,
        acquires: MEASURED_ACQUIRES,
        ns_per_acquire: ns,
        loads_per_acquire: loads as f64 / MEASURED_ACQUIRES as f64,
    }
}

fn main() -> anyhow::Result<()> {
    let mut json = std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/out/planner_cost.json"
    ));
    let mut sizes = vec![10_000u64, 100_000, 1_000_000];
    let mut policies = Policy::ALL.to_vec();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" => json = args.next().expect("--json PATH").into(),
            "--pages" => {
                sizes = args
                    .next()
                    .expect("--pages N,N,..")
                    .split(',')
                    .map(|s| s.parse().expect("a number of pages"))
                    .collect()
            }
            "--policy" => {
                policies = vec![
                    args.next()
                        .expect("--policy NAME")
                        .parse()
                        .map_err(|e| anyhow::anyhow!("{e:?}"))?,
                ]
            }
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    println!(
        "planner cost: buffers of {PAGES_PER_BUFFER} pages of {} KiB, GPU budget 1/{GPU_FRACTION_INV} of the pages, {MEASURED_ACQUIRES} acquires timed after {WARMUP_STEPS} step(s)\n",
        PAGE_BYTES >> 10
    );
    println!(
        "| policy | pages | buffers | GPU frames | ns per acquire | loads per acquire | alloc ns per buffer | warm-up s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for &policy in &policies {
        for &pages in &sizes {
            let r = measure(policy, pages);
            println!(
                "| {} | {} | {} | {} | {:.0} | {:.2} | {:.0} | {:.2} |",
                r.policy,
                r.pages,
                r.buffers,
                r.gpu_frames,
                r.ns_per_acquire,
                r.loads_per_acquire,
                r.alloc_ns_per_buffer,
                r.warmup_s
            );
            rows.push(r);
        }
    }
    let mut growth = Vec::new();
    for &policy in &policies {
        let of: Vec<&Row> = rows.iter().filter(|r| r.policy == policy.name()).collect();
        if let (Some(first), Some(last)) = (of.first(), of.last()) {
            growth.push((
                policy.name().to_string(),
                last.ns_per_acquire / first.ns_per_acquire,
            ));
        }
    }
    println!();
    for (p, g) in &growth {
        println!(
            "{p}: ns per acquire at {} pages / at {} pages = {g:.2}x",
            sizes.last().unwrap_or(&0),
            sizes.first().unwrap_or(&0)
        );
    }
    let report = Report {
        pages_per_buffer: PAGES_PER_BUFFER,
        page_bytes: PAGE_BYTES,
        gpu_fraction: 1.0 / GPU_FRACTION_INV as f64,
        measured_acquires: MEASURED_ACQUIRES,
        rows,
        growth,
    };
    if let Some(dir) = json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&json, serde_json::to_string_pretty(&report)? + "\n")?;
    println!("\nwrote {}", json.display());
    Ok(())
}
