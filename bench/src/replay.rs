//! `spillway replay`: a recorded access trace run through the embedded pool.
//!
//! Every buffer of the trace is allocated with its recorded size and filled with the
//! deterministic page pattern; every access acquires the buffer, checks every page's
//! checksum, then computes for the access's `compute_us` (or `compute_us_per_mib` times
//! its size when the line has none), scaled by `time_scale`. Computing is real arithmetic
//! over the buffer's pages on the device, repeated until the time is spent, never a
//! sleep. Accesses whose phase starts with `opt` (an optimizer writing parameters)
//! acquire exclusively and write a new version of the data, which later accesses check.
//! A step ends where the trace's step number changes, and the pool is told (`step()`).
//!
//! Before anything is allocated, the trace is checked against the memory it would take
//! ([`ReplayError`]): every page of every buffer lives in the host tier of this one-process
//! pool, and the pool allocates its budgets up front (the `sim` device's GPU frames in
//! host memory too). A trace that cannot fit fails at once, naming the sizes, instead of
//! after filling memory for as long as it takes to find out.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use spillway_client::{
    Buffer, DeviceChoice, Guard, PageSize, Policy, Pool, PoolBuilder, fmt_bytes, pattern,
};

use crate::trace::Trace;
use crate::workload::{RunReport, StepOverhead, StepReport, write_pattern};

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// GPU budget; `None`: a third of the trace's buffer bytes.
    pub gpu_budget_bytes: Option<u64>,
    /// Host budget; `None`: every page of every buffer.
    pub host_budget_bytes: Option<u64>,
    /// Page size.
    pub page_size: PageSize,
    /// Prefetch and eviction policy.
    pub policy: Policy,
    /// GPU backend.
    pub device: DeviceChoice,
    /// Compute time per MiB of buffer for lines without `compute_us`.
    pub compute_us_per_mib: f64,
    /// Multiplies every compute time (0.1 replays ten times faster than recorded).
    pub time_scale: f64,
    /// Nodes of the pool. Only 1 (the embedded pool) exists so far.
    pub nodes: usize,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            gpu_budget_bytes: None,
            host_budget_bytes: None,
            page_size: PageSize::new(256 << 10).expect("valid"),
            policy: Policy::Learned,
            device: DeviceChoice::Auto,
            compute_us_per_mib: 100.0,
            time_scale: 1.0,
            nodes: 1,
        }
    }
}

/// Why a trace cannot be replayed as configured, found before anything is allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    /// The host budget cannot hold every page of the trace's buffers, as the one-process
    /// pool needs.
    #[error(
        "the trace's {buffers} buffers hold {} ({trace_bytes} bytes), {} ({pages_bytes} bytes) \
         in pages of {}, but the host budget is {} ({host_budget_bytes} bytes): every page \
         lives in the host tier; raise --host-budget{}",
        fmt_bytes(*trace_bytes),
        fmt_bytes(*pages_bytes),
        fmt_bytes(*page_bytes),
        fmt_bytes(*host_budget_bytes),
        smaller_page_hint(*trace_bytes, *pages_bytes)
    )]
    HostBudgetTooSmall {
        /// Distinct buffers of the trace.
        buffers: usize,
        /// Their bytes.
        trace_bytes: u64,
        /// Their bytes in whole pages.
        pages_bytes: u64,
        /// The page size.
        page_bytes: u64,
        /// The host budget.
        host_budget_bytes: u64,
    },
    /// The pool's budgets, allocated when it is built, exceed the memory this machine has
    /// available.
    #[error(
        "the trace's {buffers} buffers hold {} ({trace_bytes} bytes), {} ({pages_bytes} bytes) \
         in pages of {}; replaying them needs {} ({needed_bytes} bytes) of memory up front \
         (host tier {}, GPU frames in host memory {}), but this machine has {} \
         ({available_bytes} bytes) available; replay a smaller trace or on a larger machine{}",
        fmt_bytes(*trace_bytes),
        fmt_bytes(*pages_bytes),
        fmt_bytes(*page_bytes),
        fmt_bytes(*needed_bytes),
        fmt_bytes(*host_budget_bytes),
        fmt_bytes(*sim_gpu_bytes),
        fmt_bytes(*available_bytes),
        smaller_page_hint(*trace_bytes, *pages_bytes)
    )]
    NotEnoughMemory {
        /// Distinct buffers of the trace.
        buffers: usize,
        /// Their bytes.
        trace_bytes: u64,
        /// Their bytes in whole pages.
        pages_bytes: u64,
        /// The page size.
        page_bytes: u64,
        /// The host budget.
        host_budget_bytes: u64,
        /// The GPU budget when the device is `sim` (its frames are host memory), else 0.
        sim_gpu_bytes: u64,
        /// `host_budget_bytes + sim_gpu_bytes`.
        needed_bytes: u64,
        /// `MemAvailable` of /proc/meminfo.
        available_bytes: u64,
    },
}

/// A hint when whole pages more than double the trace's bytes (small buffers).
fn smaller_page_hint(trace_bytes: u64, pages_bytes: u64) -> &'static str {
    if pages_bytes / 2 > trace_bytes {
        "; the buffers are small for the page size: a smaller --page-size wastes less"
    } else {
        ""
    }
}

/// `MemAvailable` of /proc/meminfo in bytes, `None` where unknown.
fn memory_available_bytes() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))?
        .split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()
        .map(|kib| kib.saturating_mul(1024))
}

/// Checks that a pool of these budgets can hold `trace` and fits in `available_bytes` of
/// memory (`None`: unknown, not checked), before any of it is allocated.
fn check_fits(
    trace: &Trace,
    page_size: PageSize,
    device: DeviceChoice,
    gpu_budget_bytes: u64,
    host_budget_bytes: u64,
    available_bytes: Option<u64>,
) -> Result<(), ReplayError> {
    let page_bytes = page_size.bytes();
    // At most 2^20 buffers of at most 1 TiB (the trace's limits): no overflow.
    let pages_bytes: u64 = trace
        .buffers
        .iter()
        .map(|(_, b)| page_size.pages_for(*b) * page_bytes)
        .sum();
    let buffers = trace.buffers.len();
    let trace_bytes = trace.buffer_bytes_total();
    if pages_bytes > host_budget_bytes {
        return Err(ReplayError::HostBudgetTooSmall {
            buffers,
            trace_bytes,
            pages_bytes,
            page_bytes,
            host_budget_bytes,
        });
    }
    // With `auto` in a CUDA build the frames may be on a GPU: counted as not.
    let sim = match device {
        DeviceChoice::Sim => true,
        DeviceChoice::Cuda => false,
        DeviceChoice::Auto => !cfg!(feature = "cuda"),
    };
    let sim_gpu_bytes = if sim { gpu_budget_bytes } else { 0 };
    let needed_bytes = host_budget_bytes.saturating_add(sim_gpu_bytes);
    match available_bytes {
        Some(available_bytes) if needed_bytes > available_bytes => {
            Err(ReplayError::NotEnoughMemory {
                buffers,
                trace_bytes,
                pages_bytes,
                page_bytes,
                host_budget_bytes,
                sim_gpu_bytes,
                needed_bytes,
                available_bytes,
            })
        }
        _ => Ok(()),
    }
}

/// The result of one replay: the demo's report plus the trace's name.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// The trace file.
    pub trace: String,
    /// Accesses replayed.
    pub accesses: u64,
    /// Per step from the second: the fraction of its accesses to buffers that the step
    /// before did not use (what no predictor can know from the previous step alone).
    pub novel_access_fraction: Vec<f64>,
    /// The most GPU bytes the trace held acquired at once (the pages of the buffers under
    /// acquire at one time): no budget below it can run the trace, whatever the policy.
    pub gpu_bytes_held_peak: u64,
    /// The run, with the same fields as `spillway demo --json` (`gpu_bytes_peak` is the
    /// most GPU memory the pool used at once: the caching policies fill their budget by
    /// design, so for them it is the budget; `spillway replay --find-budget` answers how
    /// much the job needs).
    #[serde(flatten)]
    pub run: RunReport,
}

fn buffer_seed(name: &str, version: u64) -> u64 {
    pattern::word(xxhash_rust::xxh3::xxh3_64(name.as_bytes()), version)
}

struct Buf {
    handle: Buffer,
    version: u64,
}

/// Computes over the guard's pages until `budget` has passed; returns a value derived
/// from the work so it cannot be skipped.
fn compute_for(g: &Guard<'_>, budget: Duration) -> Result<u64> {
    let started = Instant::now();
    let mut sink = 0u64;
    let mut k = 0;
    while started.elapsed() < budget {
        sink ^= g.compute(k % g.pages(), 1)?;
        k += 1;
    }
    Ok(sink)
}

/// A remote tier for a replay over a pool of nodes (`--nodes N`), built by the caller (the
/// CLI starts the nodes, as the demo does).
pub struct ReplayRemote {
    /// Makes the pool's remote tier (the nodes' RAM).
    pub factory: spillway_client::RemoteFactory,
    /// Bytes the pool may place on the nodes.
    pub budget_bytes: u64,
}

/// Replays `trace` under `cfg` on a one-process pool (`cfg.nodes` 1).
pub fn replay(
    trace: &Trace,
    name: &str,
    cfg: &ReplayConfig,
    on_step: impl FnMut(&StepReport),
) -> Result<ReplayReport> {
    replay_with(trace, name, cfg, None, on_step)
}

/// Replays `trace` under `cfg`, over `remote` when given (`cfg.nodes` > 1): then the host
/// tier holds a third of the trace's pages unless `cfg` says otherwise (at least the GPU's
/// pages and 2), and the rest lives on the nodes.
pub fn replay_with(
    trace: &Trace,
    name: &str,
    cfg: &ReplayConfig,
    remote: Option<ReplayRemote>,
    mut on_step: impl FnMut(&StepReport),
) -> Result<ReplayReport> {
    if cfg.nodes != 1 && remote.is_none() {
        bail!(
            "--nodes {}: a pool of nodes needs its remote tier (spillway replay --nodes starts the nodes)",
            cfg.nodes
        );
    }
    if !(cfg.time_scale.is_finite() && cfg.time_scale >= 0.0) {
        bail!("--time-scale must be a number >= 0, got {}", cfg.time_scale);
    }
    if !(cfg.compute_us_per_mib.is_finite() && cfg.compute_us_per_mib >= 0.0) {
        bail!(
            "--compute-us-per-mib must be a number >= 0, got {}",
            cfg.compute_us_per_mib
        );
    }
    let page = cfg.page_size.bytes();
    let pages_total = trace.pages_total(cfg.page_size);
    let working_set = trace.buffer_bytes_total();
    let gpu_budget = cfg
        .gpu_budget_bytes
        .unwrap_or_else(|| (working_set / 3).div_ceil(page) * page);
    let host_budget = match (&remote, cfg.host_budget_bytes) {
        (_, Some(b)) => b,
        (None, None) => pages_total * page,
        (Some(_), None) => (pages_total / 3).max(gpu_budget / page + 2) * page,
    };
    if remote.is_none() {
        check_fits(
            trace,
            cfg.page_size,
            cfg.device,
            gpu_budget,
            host_budget,
            memory_available_bytes(),
        )?;
    }
    let mut builder = PoolBuilder::new()
        .gpu_budget_bytes(gpu_budget)
        .host_budget_bytes(host_budget)
        .page_size(cfg.page_size)
        .policy(cfg.policy)
        .device(cfg.device);
    if let Some(r) = remote {
        builder = builder
            .remote_budget_bytes(r.budget_bytes)
            .remote(r.factory);
    }
    let pool: Pool = builder.build().context("building the pool")?;
    let mut bufs: HashMap<&str, Buf> = HashMap::new();
    let mut bytes = vec![0u8; page as usize];
    for (bname, size) in &trace.buffers {
        let handle = pool
            .alloc(bname, *size)
            .with_context(|| format!("allocating {bname} ({size} bytes)"))?;
        write_pattern(&pool, &handle, buffer_seed(bname, 0), &mut bytes)?;
        bufs.insert(bname.as_str(), Buf { handle, version: 0 });
    }
    let started = Instant::now();
    let mut steps = Vec::new();
    let mut sink = 0u64;
    let mut held_peak = 0u64;
    for (ordinal, (_, accesses)) in trace.accesses_by_step().enumerate() {
        let before_all = pool.stats();
        let before = before_all.core;
        let step_started = Instant::now();
        let delay_before = crate::offload::my_run_delay_s();
        let mut s = StepReport::new(ordinal + 1, false);
        for a in accesses {
            let b = bufs
                .get_mut(a.buffer.as_str())
                .expect("every accessed buffer was allocated");
            let writes = a.phase.starts_with("opt");
            let mut g = if writes {
                pool.acquire_mut(&b.handle)?
            } else {
                pool.acquire(&b.handle)?
            };
            s.record(&g)?;
            // One guard at a time: what it holds is what the trace holds now.
            held_peak = held_peak.max(g.pages() as u64 * page);
            if !g.hit() {
                tracing::debug!(step = ordinal + 1, buffer = %a.buffer, phase = %a.phase, "miss");
            }
            s.verify(&g, buffer_seed(&a.buffer, b.version))?;
            let us = a
                .compute_us
                .unwrap_or(cfg.compute_us_per_mib * a.bytes as f64 / (1 << 20) as f64)
                * cfg.time_scale;
            sink ^= compute_for(&g, Duration::from_secs_f64(us / 1e6))?;
            if writes {
                b.version += 1;
                let seed = buffer_seed(&a.buffer, b.version);
                for k in 0..g.pages() {
                    g.fill_pattern(k, pattern::page_seed(seed, k as u64))?;
                }
            }
        }
        pool.step();
        let after_all = pool.stats();
        let after = after_all.core;
        s.overhead = StepOverhead::between(&before_all, &after_all);
        s.wall_s = step_started.elapsed().as_secs_f64();
        s.run_delay_s = (crate::offload::my_run_delay_s() - delay_before).max(0.0);
        s.h2d_bytes = after.h2d_bytes - before.h2d_bytes;
        s.d2h_bytes = after.d2h_bytes - before.d2h_bytes;
        on_step(&s);
        steps.push(s);
    }
    pool.quiesce();
    std::hint::black_box(sink);
    let stats = pool.stats().core;
    let run = RunReport {
        device: pool.device_kind().name().into(),
        device_description: pool.device_description(),
        policy: cfg.policy.name().into(),
        page_bytes: page,
        gpu_budget_bytes: gpu_budget,
        host_budget_bytes: host_budget,
        working_set_bytes: working_set,
        corrupt_pages: steps.iter().map(|s| s.corrupt_pages).sum(),
        verified_bytes: steps.iter().map(|s| s.verified_bytes).sum(),
        gpu_bytes_peak: stats.frames_in_use_peak * page,
        prefetch_wasted_pages: stats.prefetch_wasted,
        detected_period: stats.predictor.detected_period,
        remote: (stats.remote_pages_total > 0).then(|| crate::workload::RemoteReport {
            budget_bytes: stats.remote_pages_total * page,
            bytes_in: stats.remote_bytes_in,
            bytes_out: stats.remote_bytes_out,
            demand_fetches: stats.remote_demand_fetches,
            prefetches: stats.remote_prefetches,
            spills_clean: stats.spills_clean,
            errors: stats.remote_errors,
            bytes_per_s: stats.remote_bytes_per_s,
        }),
        total_s: started.elapsed().as_secs_f64(),
        lost_buffers: Vec::new(),
        lost_buffer_ids: Vec::new(),
        steps,
    };
    Ok(ReplayReport {
        trace: name.into(),
        accesses: trace.accesses.len() as u64,
        novel_access_fraction: novel_fractions(trace),
        gpu_bytes_held_peak: held_peak,
        run,
    })
}

/// For each step after the first, the fraction of its accesses to buffers the step
/// before did not use.
pub fn novel_fractions(trace: &Trace) -> Vec<f64> {
    let mut out = Vec::new();
    let mut prev: Option<std::collections::HashSet<&str>> = None;
    for (_, accesses) in trace.accesses_by_step() {
        let used: std::collections::HashSet<&str> =
            accesses.iter().map(|a| a.buffer.as_str()).collect();
        if let Some(p) = &prev {
            let novel = accesses
                .iter()
                .filter(|a| !p.contains(a.buffer.as_str()))
                .count();
            out.push(novel as f64 / accesses.len() as f64);
        }
        prev = Some(used);
    }
    out
}

/// Stall time summed over steps from `from` (1-based) on.
pub fn stall_from(r: &RunReport, from: usize) -> f64 {
    r.steps
        .iter()
        .filter(|s| s.step >= from)
        .map(|s| s.stall_s)
        .sum()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::trace::parse_trace;

    /// 64 KiB pages on the simulated device; the rest as [`ReplayConfig::default`].
    pub(crate) fn sim_config() -> ReplayConfig {
        ReplayConfig {
            page_size: PageSize::new(64 << 10).unwrap(),
            device: DeviceChoice::Sim,
            ..ReplayConfig::default()
        }
    }

    /// A trace of `steps` steps, each accessing buffer `l{i}` for every `i` of `order` in
    /// turn: `bytes` bytes, phase `fwd`, `compute_us` of compute.
    pub(crate) fn forward_trace(steps: u64, order: &[usize], bytes: u64, compute_us: u64) -> Trace {
        let mut text = String::new();
        for s in 0..steps {
            for i in order {
                text += &format!(
                    "{{\"step\": {s}, \"buffer\": \"l{i}\", \"bytes\": {bytes}, \"phase\": \"fwd\", \"compute_us\": {compute_us}}}\n"
                );
            }
        }
        parse_trace(text.as_bytes()).unwrap()
    }

    fn dense_trace(steps: u64, layers: usize, bytes: u64) -> Trace {
        let mut text = String::new();
        for s in 0..steps {
            for i in 0..layers {
                text += &format!(
                    "{{\"step\": {s}, \"buffer\": \"l{i}\", \"bytes\": {bytes}, \"phase\": \"fwd\", \"compute_us\": 2000}}\n"
                );
            }
            for i in (0..layers).rev() {
                text += &format!(
                    "{{\"step\": {s}, \"buffer\": \"l{i}\", \"bytes\": {bytes}, \"phase\": \"bwd\", \"compute_us\": 2000}}\n"
                );
            }
            for i in 0..layers {
                text += &format!(
                    "{{\"step\": {s}, \"buffer\": \"l{i}\", \"bytes\": {bytes}, \"phase\": \"opt\"}}\n"
                );
            }
            text += &format!(
                "{{\"step\": {s}, \"buffer\": \"\", \"bytes\": 0, \"phase\": \"step\"}}\n"
            );
        }
        parse_trace(text.as_bytes()).unwrap()
    }

    fn cfg(policy: Policy) -> ReplayConfig {
        ReplayConfig {
            page_size: PageSize::new(64 << 10).unwrap(),
            policy,
            device: DeviceChoice::Sim,
            compute_us_per_mib: 20_000.0,
            ..ReplayConfig::default()
        }
    }

    #[test]
    fn replay_verifies_every_access_and_learns() {
        // 24 one-page buffers on a GPU of 8 pages; 2 ms of compute per access leaves
        // room for scheduling noise, so only prediction decides hits.
        let _serial = crate::workload::tests::serial_timing();
        let t = dense_trace(4, 24, 60_000);
        let r = replay(&t, "synthetic", &cfg(Policy::Learned), |_| {}).unwrap();
        assert_eq!(r.accesses, 4 * 72);
        assert_eq!(r.run.corrupt_pages, 0);
        assert_eq!(r.run.steps.len(), 4);
        assert!(r.run.steps.iter().all(|s| s.acquires == 72));
        // Every access checks every byte of its buffer.
        assert_eq!(r.run.verified_bytes, 4 * 72 * 60_000);
        assert!(r.run.gpu_bytes_peak <= r.run.gpu_budget_bytes);
        // One buffer of 60,000 bytes is one 64 KiB page.
        assert_eq!(r.gpu_bytes_held_peak, 64 << 10);
        assert!(r.run.gpu_budget_bytes * 3 <= r.run.working_set_bytes + (64 << 10) * 3);
        for s in &r.run.steps[1..] {
            assert!(s.hit_rate() >= 0.99, "{:?}", r.run.steps);
        }
        // Optimizer accesses write: dirty pages go back to the host.
        assert!(r.run.steps[1].d2h_bytes > 0);
    }

    #[test]
    fn a_replay_over_a_remote_tier_keeps_a_third_on_the_host_and_the_rest_remote() {
        let _serial = crate::workload::tests::serial_timing();
        // 24 buffers of one 64 KiB page: GPU 8 pages; host a third (8), at least the GPU's
        // pages and 2 (10); the rest remote.
        let t = dense_trace(3, 24, 60_000);
        let page = 64 << 10;
        let c = ReplayConfig {
            nodes: 3,
            ..cfg(Policy::Learned)
        };
        let remote = ReplayRemote {
            factory: spillway_client::remote::MemRemote::factory(64 * page),
            budget_bytes: 64 * page,
        };
        let r = replay_with(&t, "synthetic", &c, Some(remote), |_| {}).unwrap();
        assert_eq!(r.run.host_budget_bytes, 10 * page);
        assert_eq!(r.run.corrupt_pages, 0);
        assert_eq!(r.run.verified_bytes, 3 * 72 * 60_000);
        let remote = r.run.remote.expect("a remote tier");
        assert_eq!(remote.budget_bytes, 64 * page);
        assert!(remote.bytes_out > 0 && remote.bytes_in > 0, "{remote:?}");
        assert_eq!(remote.errors, 0);
    }

    #[test]
    fn novel_fraction_counts_buffers_new_to_the_step() {
        let text = "{\"step\": 0, \"buffer\": \"a\", \"bytes\": 8, \"phase\": \"fwd\"}\n{\"step\": 0, \"buffer\": \"b\", \"bytes\": 8, \"phase\": \"fwd\"}\n{\"step\": 1, \"buffer\": \"a\", \"bytes\": 8, \"phase\": \"fwd\"}\n{\"step\": 1, \"buffer\": \"c\", \"bytes\": 8, \"phase\": \"fwd\"}\n{\"step\": 1, \"buffer\": \"c\", \"bytes\": 8, \"phase\": \"bwd\"}\n{\"step\": 1, \"buffer\": \"b\", \"bytes\": 8, \"phase\": \"bwd\"}\n";
        let t = parse_trace(text.as_bytes()).unwrap();
        assert_eq!(novel_fractions(&t), vec![0.5]);
    }

    #[test]
    fn more_than_one_node_is_a_clear_error() {
        let t = dense_trace(1, 3, 1000);
        let e = replay(
            &t,
            "x",
            &ReplayConfig {
                nodes: 3,
                ..cfg(Policy::Learned)
            },
            |_| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("--nodes"), "{e}");
        let e = replay(
            &t,
            "x",
            &ReplayConfig {
                time_scale: -1.0,
                ..cfg(Policy::Learned)
            },
            |_| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("--time-scale"), "{e}");
    }

    #[test]
    fn example_traces_replay_with_every_page_verified() {
        for name in ["dense", "checkpoint_accum", "moe"] {
            let path = format!("{}/traces/{name}.jsonl", env!("CARGO_MANIFEST_DIR"));
            let t = crate::trace::load_trace(std::path::Path::new(&path)).unwrap();
            let c = ReplayConfig {
                time_scale: 0.02,
                ..cfg(Policy::Learned)
            };
            let r = replay(&t, name, &c, |_| {}).unwrap();
            assert_eq!(r.run.corrupt_pages, 0, "{name}");
            assert_eq!(r.run.steps.len(), t.steps.len(), "{name}");
        }
    }

    /// 300k buffers of 64 KiB (issue 13): refused before anything is allocated, naming
    /// the sizes, whether the host budget or the machine is what is too small.
    #[test]
    fn a_trace_larger_than_its_budget_or_the_machine_is_refused_before_allocating() {
        let mut text = String::new();
        for i in 0..300_000 {
            text += &format!(
                "{{\"step\": 0, \"buffer\": \"b{i}\", \"bytes\": 65536, \"phase\": \"fwd\"}}\n"
            );
        }
        let t = parse_trace(text.as_bytes()).unwrap();
        let page = PageSize::new(256 << 10).unwrap();
        let pages_bytes = 300_000 * (256 << 10);
        let e = check_fits(&t, page, DeviceChoice::Sim, 1 << 30, 1 << 30, None).unwrap_err();
        assert_eq!(
            e,
            ReplayError::HostBudgetTooSmall {
                buffers: 300_000,
                trace_bytes: 300_000 * 65536,
                pages_bytes,
                page_bytes: 256 << 10,
                host_budget_bytes: 1 << 30,
            }
        );
        let text = e.to_string();
        for size in ["19660800000 bytes", "78643200000 bytes", "1073741824 bytes"] {
            assert!(text.contains(size), "{text}");
        }
        assert!(text.contains("--page-size"), "{text}");

        let gpu = pages_bytes / 3;
        let e =
            check_fits(&t, page, DeviceChoice::Sim, gpu, pages_bytes, Some(8 << 30)).unwrap_err();
        assert!(
            matches!(e, ReplayError::NotEnoughMemory { needed_bytes, available_bytes, .. }
                if needed_bytes == pages_bytes + gpu && available_bytes == 8 << 30),
            "{e:?}"
        );
        assert!(e.to_string().contains("8589934592 bytes"), "{e}");
        // A CUDA device keeps its frames on the GPU: only the host tier counts.
        check_fits(
            &t,
            page,
            DeviceChoice::Cuda,
            gpu,
            pages_bytes,
            Some(pages_bytes),
        )
        .unwrap();
        // Unknown available memory is not checked.
        check_fits(&t, page, DeviceChoice::Sim, gpu, pages_bytes, None).unwrap();
    }

    #[test]
    fn replay_returns_the_typed_error_before_building_the_pool() {
        let t = dense_trace(1, 3, 1 << 20);
        let e = replay(
            &t,
            "x",
            &ReplayConfig {
                host_budget_bytes: Some(1 << 20),
                ..cfg(Policy::Learned)
            },
            |_| {},
        )
        .unwrap_err();
        assert!(
            matches!(
                e.downcast_ref::<ReplayError>(),
                Some(ReplayError::HostBudgetTooSmall { .. })
            ),
            "{e:?}"
        );
    }
}
