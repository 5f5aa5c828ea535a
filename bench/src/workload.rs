//! The demo's workload: a training-like loop over a tiered pool.
//!
//! Each step runs forward over `layers` layers, then backward in reverse:
//! - forward layer `i`: acquire weights `W[i]` (shared), check every page's checksum, run
//!   the kernel over every page; then acquire activation `A[i]` exclusively and fill each
//!   page with data unique to (step, layer, page);
//! - backward layer `i`: acquire `W[i]`, check and compute; acquire `A[i]`, check that it
//!   holds what forward wrote this step, and compute.
//!
//! The kernel is real arithmetic over every byte on the device (`passes` rounds), never a
//! sleep. Every acquire checks every page against the checksum of the data that must be
//! there, so corruption anywhere (a lost write-back, a stale page, a wrong frame) is
//! counted in `corrupt_pages`. A *diverging* step swaps two layers and skips one, in
//! both directions, to show that prediction survives a change of order.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use spillway_client::{
    Buffer, CoreError, DeviceChoice, Guard, PageSize, Policy, Pool, PoolBuilder, PoolError,
    PoolStats, pattern,
};

/// The shape of the training-like loop.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Number of layers.
    pub layers: usize,
    /// Bytes of each layer's weights.
    pub weight_bytes: u64,
    /// Bytes of each layer's activation.
    pub act_bytes: u64,
    /// GPU budget in bytes.
    pub gpu_budget_bytes: u64,
    /// Host budget in bytes; `None`: the working set rounded up to pages.
    pub host_budget_bytes: Option<u64>,
    /// Page size.
    pub page_size: PageSize,
    /// Steps to run.
    pub steps: usize,
    /// Rounds of arithmetic per page per kernel.
    pub compute_passes: u32,
    /// Prefetch and eviction policy.
    pub policy: Policy,
    /// GPU backend.
    pub device: DeviceChoice,
    /// Steps (1-based) that swap layers 1 and 2 and skip the middle layer.
    pub diverge_steps: Vec<usize>,
    /// Whether the job marks step boundaries (`false` exercises period detection).
    pub mark_steps: bool,
    /// Go on past a buffer whose page the remote tier lost (`CoreError::PageLost`):
    /// its kernels are skipped and its name reported ([`RunReport::lost_buffers`]).
    /// Without it a lost page ends the run with an error naming the buffer.
    pub skip_lost: bool,
}

impl TrainConfig {
    /// The demo's defaults: 24 layers of 8 MiB weights and 4 MiB activations (288 MiB)
    /// on a 96 MiB GPU budget (a working set of 3x the budget), 6 steps.
    pub fn demo_default() -> TrainConfig {
        TrainConfig {
            layers: 24,
            weight_bytes: 8 << 20,
            act_bytes: 4 << 20,
            gpu_budget_bytes: 96 << 20,
            host_budget_bytes: None,
            page_size: PageSize::default(),
            steps: 6,
            compute_passes: 2,
            policy: Policy::Learned,
            device: DeviceChoice::Auto,
            diverge_steps: Vec::new(),
            mark_steps: true,
            skip_lost: false,
        }
    }

    /// The host tier budget the pool gets.
    pub fn pool_builder_host_budget(&self) -> u64 {
        self.host_budget()
    }

    /// A builder for this loop's pool: budgets, page size, policy and device.
    pub fn pool_builder(&self) -> PoolBuilder {
        PoolBuilder::new()
            .gpu_budget_bytes(self.gpu_budget_bytes)
            .host_budget_bytes(self.host_budget())
            .page_size(self.page_size)
            .policy(self.policy)
            .device(self.device)
    }

    /// Bytes of all buffers.
    pub fn working_set_bytes(&self) -> u64 {
        self.layers as u64 * (self.weight_bytes + self.act_bytes)
    }

    fn host_budget(&self) -> u64 {
        let page = self.page_size.bytes();
        self.host_budget_bytes.unwrap_or_else(|| {
            self.layers as u64
                * (self.page_size.pages_for(self.weight_bytes)
                    + self.page_size.pages_for(self.act_bytes))
                * page
        })
    }
}

/// What one step did.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StepReport {
    /// Step number, from 1.
    pub step: usize,
    /// Wall time of the step.
    pub wall_s: f64,
    /// Time acquires waited for copies.
    pub stall_s: f64,
    /// Acquires made.
    pub acquires: u64,
    /// Acquires that did not wait for a copy.
    pub hits: u64,
    /// Loads the pool started only when an acquire asked (no prefetch had): the misses
    /// that prediction, not a late copy, is to blame for.
    pub demand_loads: u64,
    /// Bytes copied host to device.
    pub h2d_bytes: u64,
    /// Bytes copied device to host.
    pub d2h_bytes: u64,
    /// Bytes whose checksum was checked.
    pub verified_bytes: u64,
    /// Pages whose checksum was wrong.
    pub corrupt_pages: u64,
    /// Whether this step diverged (swapped and skipped layers).
    pub diverged: bool,
    /// Bytes fetched from the remote tier (peers).
    pub remote_bytes_in: u64,
    /// Bytes spilled to the remote tier (peers).
    pub remote_bytes_out: u64,
    /// The pool's own time in the step, besides the stall.
    pub overhead: StepOverhead,
    /// Time spent checking checksums ([`StepReport::verify`]), inside `wall_s`: the
    /// harness's check, not the job's work.
    pub verify_s: f64,
    /// Time the stepping thread waited for a core in the step (its run delay,
    /// `/proc/thread-self/schedstat`; 0 where not measured or unknown), inside `wall_s`.
    pub run_delay_s: f64,
}

/// The pool's own time in one step, seconds (issue 12): what the caller's thread spent
/// planning, waiting for the pool's lock and on views (mapping pages, when a buffer's
/// frames are not consecutive), and what the device's threads spent handling
/// completions and waiting for the lock beside it.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct StepOverhead {
    /// Planning on the caller's thread (acquires, `step`).
    pub planning_s: f64,
    /// Waiting for the pool's lock on the caller's thread.
    pub lock_wait_s: f64,
    /// Views of acquired buffers on the caller's thread (mapping included).
    pub view_s: f64,
    /// Handling completions and fenced releases on the device's threads.
    pub device_planning_s: f64,
    /// Waiting for the pool's lock on the device's threads.
    pub device_lock_wait_s: f64,
    /// Pages mapped into a buffer range (0 when every acquire was in place).
    pub remaps: u64,
}

impl StepOverhead {
    /// The overhead between two readings of the pool's counters.
    pub fn between(before: &PoolStats, after: &PoolStats) -> StepOverhead {
        let (a, b) = (&after.timings, &before.timings);
        StepOverhead {
            planning_s: (a.planning - b.planning).as_secs_f64(),
            lock_wait_s: (a.lock_wait - b.lock_wait).as_secs_f64(),
            view_s: (a.view - b.view).as_secs_f64(),
            device_planning_s: (a.device_planning - b.device_planning).as_secs_f64(),
            device_lock_wait_s: (a.device_lock_wait - b.device_lock_wait).as_secs_f64(),
            remaps: after.device.pages_remapped - before.device.pages_remapped,
        }
    }
}

impl StepReport {
    /// An empty report for step `step`.
    pub fn new(step: usize, diverged: bool) -> StepReport {
        StepReport {
            step,
            wall_s: 0.0,
            stall_s: 0.0,
            acquires: 0,
            hits: 0,
            demand_loads: 0,
            h2d_bytes: 0,
            d2h_bytes: 0,
            verified_bytes: 0,
            corrupt_pages: 0,
            diverged,
            remote_bytes_in: 0,
            remote_bytes_out: 0,
            overhead: StepOverhead::default(),
            verify_s: 0.0,
            run_delay_s: 0.0,
        }
    }

    /// The step's time as the job would see it: wall time less the checksum checks and
    /// less the time the thread waited for a core, seconds.
    pub fn step_s(&self) -> f64 {
        (self.wall_s - self.verify_s - self.run_delay_s).max(0.0)
    }

    /// Counts an acquire: whether it hit and how long it waited; then shows its buffer as
    /// one array, as a job's kernels read it (on `cuda` a scattered buffer is mapped into
    /// its range by this first [`Guard::device_ptr`]; the acquire itself maps nothing), so
    /// that the step pays what a job's step pays.
    pub fn record(&mut self, g: &Guard<'_>) -> Result<()> {
        g.device_ptr()?;
        self.acquires += 1;
        self.hits += u64::from(g.hit());
        self.stall_s += g.waited().as_secs_f64();
        Ok(())
    }

    /// Checks every page of `g` against the pattern of `seed` (see [`write_pattern`]),
    /// on the device, counting verified bytes and corrupt pages.
    pub fn verify(&mut self, g: &Guard<'_>, seed: u64) -> Result<()> {
        let started = std::time::Instant::now();
        for k in 0..g.pages() {
            let len = g.page_len(k);
            if g.checksum(k)?
                != pattern::expected_checksum(pattern::page_seed(seed, k as u64), len as usize)
            {
                self.corrupt_pages += 1;
            }
            self.verified_bytes += len;
        }
        self.verify_s += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// hits / acquires.
    pub fn hit_rate(&self) -> f64 {
        if self.acquires == 0 {
            1.0
        } else {
            self.hits as f64 / self.acquires as f64
        }
    }
}

/// What the remote tier did over a whole run.
#[derive(Debug, Clone, Serialize)]
pub struct RemoteReport {
    /// Remote budget in bytes.
    pub budget_bytes: u64,
    /// Bytes fetched from peers.
    pub bytes_in: u64,
    /// Bytes spilled to peers.
    pub bytes_out: u64,
    /// Fetches a waiting acquire or host access asked for.
    pub demand_fetches: u64,
    /// Fetches the prefetcher started.
    pub prefetches: u64,
    /// Pages that left the host tier without a copy (the peers held the same bytes).
    pub spills_clean: u64,
    /// Remote ops that failed.
    pub errors: u64,
    /// The pool's estimate of the remote tier's bandwidth at the end, bytes/s.
    pub bytes_per_s: f64,
}

/// What a whole run did.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// `sim` or `cuda`.
    pub device: String,
    /// The device's description.
    pub device_description: String,
    /// Policy name.
    pub policy: String,
    /// Page size.
    pub page_bytes: u64,
    /// GPU budget.
    pub gpu_budget_bytes: u64,
    /// Host budget.
    pub host_budget_bytes: u64,
    /// Bytes of all buffers.
    pub working_set_bytes: u64,
    /// Pages whose checksum was wrong, over all steps.
    pub corrupt_pages: u64,
    /// Bytes checked, over all steps.
    pub verified_bytes: u64,
    /// Most GPU bytes in use at once.
    pub gpu_bytes_peak: u64,
    /// Prefetched pages evicted before use.
    pub prefetch_wasted_pages: u64,
    /// Period detected when steps are not marked.
    pub detected_period: Option<u64>,
    /// The remote tier's counters, when the pool has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteReport>,
    /// Total wall time.
    pub total_s: f64,
    /// Buffers lost with a page the remote tier could not give back (with
    /// [`TrainConfig::skip_lost`]; the run went on without them), by name.
    pub lost_buffers: Vec<String>,
    /// Their buffer ids, in the same order (the ids a node's `/placements` lists).
    pub lost_buffer_ids: Vec<u64>,
    /// Per step.
    pub steps: Vec<StepReport>,
}

impl RunReport {
    /// Median step time over steps from `from` (1-based) on.
    pub fn median_step_s(&self, from: usize) -> f64 {
        median(
            self.steps
                .iter()
                .filter(|s| s.step >= from)
                .map(|s| s.wall_s)
                .collect(),
        )
    }

    /// Hit rate over steps from `from` on.
    pub fn hit_rate_from(&self, from: usize) -> f64 {
        let (a, h) = self
            .steps
            .iter()
            .filter(|s| s.step >= from)
            .fold((0, 0), |(a, h), s| (a + s.acquires, h + s.hits));
        if a == 0 { 1.0 } else { h as f64 / a as f64 }
    }
}

/// The median of `v` (0 for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn act_seed(step: usize, layer: usize) -> u64 {
    pattern::word(0xAC7 ^ ((step as u64) << 20), layer as u64)
}

fn weight_seed(layer: usize) -> u64 {
    pattern::word(0x3E1, layer as u64)
}

/// Writes the pattern of `seed` over the whole of `b` through the pool, page by page
/// (`scratch` is one page long).
pub fn write_pattern(pool: &Pool, b: &Buffer, seed: u64, scratch: &mut [u8]) -> Result<()> {
    let page = scratch.len() as u64;
    let (mut off, mut k) = (0u64, 0u64);
    while off < b.bytes() {
        let n = (b.bytes() - off).min(page) as usize;
        pattern::fill(pattern::page_seed(seed, k), &mut scratch[..n]);
        pool.write(b, off, &scratch[..n])?;
        off += n as u64;
        k += 1;
    }
    Ok(())
}

fn compute_pages(g: &Guard<'_>, passes: u32) -> Result<u64> {
    let mut sink = 0;
    for k in 0..g.pages() {
        sink ^= g.compute(k, passes)?;
    }
    Ok(sink)
}

/// The guard of an acquire of `buffer`; `None` when a page of it is lost
/// (`CoreError::PageLost`) and `skip` says to go on without it (its name goes into
/// `lost`); without `skip` that is an error naming the buffer.
fn lost_or<'p>(
    acquired: Result<Guard<'p>, PoolError>,
    buffer: &Buffer,
    skip: bool,
    lost: &mut std::collections::BTreeMap<String, u64>,
) -> Result<Option<Guard<'p>>> {
    match acquired {
        Ok(g) => Ok(Some(g)),
        Err(PoolError::Pool(e @ CoreError::PageLost { .. })) => {
            if !skip {
                bail!(
                    "{} is lost ({e}); run with --skip-lost to go on without it",
                    buffer.name()
                );
            }
            if lost
                .insert(buffer.name().to_string(), buffer.id().0)
                .is_none()
            {
                tracing::warn!(buffer = buffer.name(), error = %e, "buffer lost; going on without it");
            }
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// A pool and the buffers of the loop, ready to run steps.
pub struct Training {
    cfg: TrainConfig,
    pool: Pool,
    weights: Vec<Buffer>,
    acts: Vec<Buffer>,
    /// Step whose data each activation holds (None: never written).
    act_written: Vec<Option<usize>>,
    /// Names of the buffers found lost (with `skip_lost`), with their ids.
    lost: std::collections::BTreeMap<String, u64>,
    step: usize,
    /// Keeps the kernels' results alive so no work can be optimised away.
    pub sink: u64,
}

impl Training {
    /// Builds the pool and fills every weight with its pattern.
    pub fn new(cfg: TrainConfig) -> Result<Training> {
        if cfg.layers < 3 {
            bail!("the demo needs at least 3 layers, got {}", cfg.layers);
        }
        let pool = cfg.pool_builder().build().context("building the pool")?;
        Self::with_pool(cfg, pool)
    }

    /// Fills every weight with its pattern in `pool`, made for `cfg` (by
    /// [`TrainConfig::pool_builder`], plus a remote tier or shared host memory).
    pub fn with_pool(cfg: TrainConfig, pool: Pool) -> Result<Training> {
        if cfg.layers < 3 {
            bail!("the demo needs at least 3 layers, got {}", cfg.layers);
        }
        let page = cfg.page_size.bytes() as usize;
        let mut weights = Vec::new();
        let mut acts = Vec::new();
        let mut bytes = vec![0u8; page];
        for i in 0..cfg.layers {
            let w = pool.alloc(&format!("layers.{i}.weight"), cfg.weight_bytes)?;
            write_pattern(&pool, &w, weight_seed(i), &mut bytes)?;
            weights.push(w);
            acts.push(pool.alloc(&format!("layers.{i}.activation"), cfg.act_bytes)?);
        }
        let layers = cfg.layers;
        Ok(Training {
            cfg,
            pool,
            weights,
            acts,
            act_written: vec![None; layers],
            lost: Default::default(),
            step: 0,
            sink: 0,
        })
    }

    /// The pool (for its stats).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The layer order of a step (forward; backward is its reverse).
    fn order(&self, diverge: bool) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.cfg.layers).collect();
        if diverge {
            let mid = self.cfg.layers / 2;
            order.swap(1, 2);
            order.retain(|&i| i != mid);
        }
        order
    }

    /// Runs one step and reports it.
    pub fn run_step(&mut self) -> Result<StepReport> {
        self.step += 1;
        let step = self.step;
        let diverged = self.cfg.diverge_steps.contains(&step);
        let before_all = self.pool.stats();
        let before = before_all.core;
        let started = Instant::now();
        let mut c = StepReport::new(step, diverged);
        let mut sink = 0;
        let passes = self.cfg.compute_passes;
        let order = self.order(diverged);
        let skip = self.cfg.skip_lost;
        for &i in &order {
            let w = &self.weights[i];
            if let Some(g) = lost_or(self.pool.acquire(w), w, skip, &mut self.lost)? {
                c.record(&g)?;
                c.verify(&g, weight_seed(i))?;
                sink ^= compute_pages(&g, passes)?;
            }
            let a = &self.acts[i];
            let Some(mut g) = lost_or(self.pool.acquire_mut(a), a, skip, &mut self.lost)? else {
                continue;
            };
            c.record(&g)?;
            let seed = act_seed(step, i);
            for k in 0..g.pages() {
                g.fill_pattern(k, pattern::page_seed(seed, k as u64))?;
            }
            self.act_written[i] = Some(step);
        }
        for &i in order.iter().rev() {
            let w = &self.weights[i];
            if let Some(g) = lost_or(self.pool.acquire(w), w, skip, &mut self.lost)? {
                c.record(&g)?;
                c.verify(&g, weight_seed(i))?;
                sink ^= compute_pages(&g, passes)?;
            }
            let a = &self.acts[i];
            let Some(g) = lost_or(self.pool.acquire(a), a, skip, &mut self.lost)? else {
                continue;
            };
            c.record(&g)?;
            let written = self.act_written[i].context("activation read before it was written")?;
            c.verify(&g, act_seed(written, i))?;
            sink ^= compute_pages(&g, passes)?;
        }
        if self.cfg.mark_steps {
            self.pool.step();
        }
        let after_all = self.pool.stats();
        let after = after_all.core;
        c.overhead = StepOverhead::between(&before_all, &after_all);
        c.wall_s = started.elapsed().as_secs_f64();
        c.h2d_bytes = after.h2d_bytes - before.h2d_bytes;
        c.demand_loads = after.demand_loads - before.demand_loads;
        c.d2h_bytes = after.d2h_bytes - before.d2h_bytes;
        c.remote_bytes_in = after.remote_bytes_in - before.remote_bytes_in;
        c.remote_bytes_out = after.remote_bytes_out - before.remote_bytes_out;
        self.sink ^= sink;
        Ok(c)
    }

    /// Builds the run's report from its steps.
    pub fn report(&self, steps: Vec<StepReport>, total: Duration) -> RunReport {
        let s = self.pool.stats().core;
        RunReport {
            device: self.pool.device_kind().name().into(),
            device_description: self.pool.device_description(),
            policy: self.cfg.policy.name().into(),
            page_bytes: self.cfg.page_size.bytes(),
            gpu_budget_bytes: self.cfg.gpu_budget_bytes,
            host_budget_bytes: self.cfg.host_budget(),
            working_set_bytes: self.cfg.working_set_bytes(),
            corrupt_pages: steps.iter().map(|s| s.corrupt_pages).sum(),
            verified_bytes: steps.iter().map(|s| s.verified_bytes).sum(),
            gpu_bytes_peak: s.frames_in_use_peak * self.cfg.page_size.bytes(),
            prefetch_wasted_pages: s.prefetch_wasted,
            detected_period: s.predictor.detected_period,
            remote: (s.remote_pages_total > 0).then(|| RemoteReport {
                budget_bytes: s.remote_pages_total * self.cfg.page_size.bytes(),
                bytes_in: s.remote_bytes_in,
                bytes_out: s.remote_bytes_out,
                demand_fetches: s.remote_demand_fetches,
                prefetches: s.remote_prefetches,
                spills_clean: s.spills_clean,
                errors: s.remote_errors,
                bytes_per_s: s.remote_bytes_per_s,
            }),
            total_s: total.as_secs_f64(),
            lost_buffers: self.lost.keys().cloned().collect(),
            lost_buffer_ids: self.lost.values().copied().collect(),
            steps,
        }
    }
}

/// Runs the whole loop, calling `on_step` after each step.
pub fn run_training(cfg: TrainConfig, on_step: impl FnMut(&StepReport)) -> Result<RunReport> {
    let pool = cfg.pool_builder().build().context("building the pool")?;
    run_training_in(cfg, pool, on_step)
}

/// [`run_training`] in a pool the caller made (with a remote tier, or host memory shared
/// with a node daemon).
pub fn run_training_in(
    cfg: TrainConfig,
    pool: Pool,
    mut on_step: impl FnMut(&StepReport),
) -> Result<RunReport> {
    let started = Instant::now();
    let steps = cfg.steps;
    let mut t = Training::with_pool(cfg, pool)?;
    let mut reports = Vec::with_capacity(steps);
    for _ in 0..steps {
        let r = t.run_step()?;
        on_step(&r);
        reports.push(r);
    }
    t.pool().quiesce();
    Ok(t.report(reports, started.elapsed()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Tests whose assertions depend on copies finishing during compute take this lock,
    /// so they do not compete with each other for the machine's cores.
    pub(crate) static TIMING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Takes [`TIMING`] for the rest of the calling test (also after another test that
    /// held it panicked).
    pub(crate) fn serial_timing() -> std::sync::MutexGuard<'static, ()> {
        TIMING.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn small(policy: Policy) -> TrainConfig {
        TrainConfig {
            layers: 8,
            weight_bytes: 256 << 10,
            act_bytes: 128 << 10,
            gpu_budget_bytes: 1 << 20,
            page_size: PageSize::new(64 << 10).unwrap(),
            steps: 4,
            compute_passes: 8,
            policy,
            device: DeviceChoice::Sim,
            ..TrainConfig::demo_default()
        }
    }

    /// [`small`] under the learned policy for `steps` steps, its compute far heavier than
    /// its copies, so that only prediction decides hits, not timing.
    fn learned_compute_bound(steps: usize) -> TrainConfig {
        TrainConfig {
            compute_passes: 300,
            steps,
            ..small(Policy::Learned)
        }
    }

    /// Each step's hit rate and its demand loads, in step order.
    fn hit_rates_and_demand_loads(r: &RunReport) -> (Vec<f64>, Vec<u64>) {
        let rates = r.steps.iter().map(StepReport::hit_rate).collect();
        let demand = r.steps.iter().map(|s| s.demand_loads).collect();
        (rates, demand)
    }

    /// A remote tier in memory whose fetches of buffer `lost` fail as every holder gone.
    fn losing_tier(lost: u64) -> spillway_client::RemoteFactory {
        use spillway_client::remote::{MemRemote, RemoteError, RemoteOpKind};
        use std::collections::HashMap;
        use std::sync::{Arc, Mutex};
        let fetches: Arc<Mutex<HashMap<u64, spillway_client::PageId>>> = Default::default();
        Box::new(move |device, sink| {
            let seen = fetches.clone();
            let inner = MemRemote::factory(1 << 30)(
                device,
                Arc::new(move |mut c: spillway_client::RemoteCompletion| {
                    if let Some(page) = seen.lock().unwrap().remove(&c.id.0)
                        && page.buffer.0 == lost
                    {
                        c.result = Err(RemoteError::Lost {
                            page,
                            message: "its holder died".into(),
                        });
                    }
                    sink(c)
                }),
            )?;
            struct Losing(
                Arc<dyn spillway_client::RemoteTier>,
                Arc<Mutex<HashMap<u64, spillway_client::PageId>>>,
            );
            impl spillway_client::RemoteTier for Losing {
                fn describe(&self) -> String {
                    self.0.describe()
                }
                fn capacity_bytes(&self) -> u64 {
                    self.0.capacity_bytes()
                }
                fn bandwidth_hint_bytes_per_s(&self) -> f64 {
                    self.0.bandwidth_hint_bytes_per_s()
                }
                fn submit(&self, op: spillway_client::RemoteOp) {
                    if op.kind == RemoteOpKind::Fetch {
                        self.1.lock().unwrap().insert(op.id.0, op.page);
                    }
                    self.0.submit(op)
                }
                fn discard(&self, pages: Vec<spillway_client::PageId>) {
                    self.0.discard(pages)
                }
            }
            Ok(Arc::new(Losing(inner, fetches)) as Arc<dyn spillway_client::RemoteTier>)
        })
    }

    #[test]
    fn a_lost_buffer_ends_the_run_or_is_skipped_and_reported() {
        let mut cfg = small(Policy::Learned);
        cfg.host_budget_bytes = Some(2 << 20);
        // Buffer 1 is layers.0.weight (allocated first).
        let pool = |cfg: &TrainConfig| {
            cfg.pool_builder()
                .remote_budget_bytes(64 << 20)
                .remote(losing_tier(1))
                .build()
                .unwrap()
        };
        let err = run_training_in(cfg.clone(), pool(&cfg), |_| {}).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("layers.0.weight is lost"), "{text}");
        assert!(text.contains("--skip-lost"), "{text}");
        assert!(!text.contains('\n'), "one line: {text}");
        cfg.skip_lost = true;
        let report = run_training_in(cfg.clone(), pool(&cfg), |_| {}).unwrap();
        assert_eq!(report.lost_buffers, vec!["layers.0.weight".to_string()]);
        assert_eq!(report.lost_buffer_ids, vec![1]);
        assert_eq!(report.corrupt_pages, 0);
        assert_eq!(report.steps.len(), cfg.steps);
        assert!(report.verified_bytes > 0);
    }

    #[test]
    fn every_page_is_verified_and_none_is_corrupt() {
        for policy in Policy::ALL {
            let cfg = small(policy);
            let ws = cfg.working_set_bytes();
            let r = run_training(cfg, |_| {}).unwrap();
            assert_eq!(r.corrupt_pages, 0, "{policy:?}");
            assert!(
                r.verified_bytes >= ws * 4,
                "{policy:?}: verified {} of {}",
                r.verified_bytes,
                ws * 4
            );
            assert!(r.gpu_bytes_peak <= 1 << 20);
            assert_eq!(r.steps.len(), 4);
            assert!(r.steps.iter().all(|s| s.acquires == 32));
        }
    }

    #[test]
    fn diverging_step_skips_and_swaps() {
        let mut cfg = small(Policy::Learned);
        cfg.diverge_steps = vec![3];
        let r = run_training(cfg, |_| {}).unwrap();
        assert_eq!(
            r.steps[2].acquires, 28,
            "one layer skipped in both directions"
        );
        assert!(r.steps[2].diverged && !r.steps[3].diverged);
        assert_eq!(r.corrupt_pages, 0);
    }

    #[test]
    fn learned_hits_from_step_two_and_survives_divergence() {
        // Compute far heavier than copies, so only prediction decides hits, not timing.
        let _serial = serial_timing();
        let mut cfg = learned_compute_bound(5);
        cfg.layers = 12;
        cfg.gpu_budget_bytes = 12 * (384 << 10) / 3;
        cfg.diverge_steps = vec![3];
        let r = run_training(cfg, |_| {}).unwrap();
        let (rates, demand) = hit_rates_and_demand_loads(&r);
        assert!(rates[0] < 0.9, "nothing to learn from in step 1: {rates:?}");
        // Prediction: from step 2 every load but the diverging step's is a prefetch.
        // Timing: on a loaded machine a prefetch can still land a little late (one
        // acquire of 48 seen at load), so the hit rates allow two misses per step.
        assert!(demand[0] > 0, "step 1 loads on demand: {demand:?}");
        assert!(
            demand[1] == 0 && demand[3] == 0 && demand[4] == 0,
            "demand loads per step: {demand:?}"
        );
        assert!(rates[1] >= 0.95, "{rates:?}");
        assert!(rates[2] >= 0.90, "the diverging step: {rates:?}");
        assert!(
            rates[3] >= 0.95 && rates[4] >= 0.95,
            "after divergence: {rates:?}"
        );
        assert_eq!(r.corrupt_pages, 0);
    }

    #[test]
    fn learned_with_a_remote_tier_prefetches_every_page_from_step_two() {
        // The demo's shape with a remote tier: the working set 12x the GPU budget and 4x
        // the GPU plus host budgets, so every layer's pages come from the remote tier;
        // compute far heavier than copies, so only planning decides hits. Reusing a plan
        // while its pages waited for frames left the weights of every other layer to a
        // demand load (11 of 96 acquires a step missed in the demo).
        let _serial = serial_timing();
        let mut cfg = learned_compute_bound(4);
        cfg.layers = 24;
        let ws = cfg.working_set_bytes();
        let page = cfg.page_size.bytes();
        cfg.gpu_budget_bytes = ws / 12 / page * page;
        cfg.host_budget_bytes = Some(ws / 6 / page * page);
        let pool = cfg
            .pool_builder()
            .remote_budget_bytes(4 * ws)
            .remote(spillway_client::remote::MemRemote::factory(4 * ws))
            .build()
            .unwrap();
        let r = run_training_in(cfg, pool, |_| {}).unwrap();
        let (rates, demand) = hit_rates_and_demand_loads(&r);
        assert!(
            r.steps.iter().all(|s| s.remote_bytes_in > 0),
            "the remote tier is used"
        );
        // Timing, as above: on a loaded machine (a CI run beside other builds) a prefetch
        // can land a little late, 2 demand loads of 96 acquires seen once; the planning
        // fault this test guards against missed 11 a step.
        assert!(
            demand[1..].iter().all(|&d| d <= 2),
            "demand loads per step: {demand:?}, hit rates {rates:?}"
        );
        assert!(rates[1..].iter().all(|&h| h >= 0.95), "{rates:?}");
        assert_eq!(r.corrupt_pages, 0);
    }

    #[test]
    fn period_is_found_when_steps_are_not_marked() {
        let _serial = serial_timing();
        let mut cfg = learned_compute_bound(5);
        cfg.mark_steps = false;
        let r = run_training(cfg, |_| {}).unwrap();
        assert_eq!(r.detected_period, Some(32));
        assert!(
            r.steps[3].hit_rate() >= 0.99 && r.steps[4].hit_rate() >= 0.99,
            "{:?}",
            r.steps
        );
    }

    #[test]
    fn median_of_values() {
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
