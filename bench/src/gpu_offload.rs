//! The GPU offload benchmark (feature `cuda`): the workload of the hand-written PyTorch
//! baseline (`bench/baselines/torch_offload.py`) through Spillway on a real GPU.
//!
//! `layers` layers of `hidden x hidden` bf16 weights (48 x 128 MiB by default) live in
//! the pool; the GPU budget holds `slots` layers (8). Each step runs one cuBLAS GEMM per
//! layer, `[batch, hidden] x [hidden, hidden]`, on the device's compute stream, reading
//! the layer through its guard's contiguous device range; activations stay on the GPU
//! outside the pool. Dropping a guard releases the layer only once the GEMM queued on it
//! has finished (a fence), so a frame is never reused under a running kernel.
//!
//! Variants, each a median over `iters` steps after a warm-up step, per batch size:
//! `resident` (budget = every layer: GEMMs alone), `copy_only` (the layers' pages through
//! the device's copy path with no GEMM, all queued at once), `on_demand`, `clock`,
//! `learned`. In the first step of `learned` every page is checked against the checksum
//! of what was written (`corrupt_pages`).
//!
//! Spread (issue 18): the whole set runs `repeats` times (default 3), interleaved, the
//! variants' order rotating each repeat, as `bench offload` does ([`crate::repeats`]);
//! each variant's step time and ratio to its own floor are reported as median and
//! min–max over the repeats ([`crate::gpu_report`]), with the load average and the core
//! count before and after and a warning when the machine was busy.
//!
//! Accounting (issue 12): each variant reports the bytes it moved per step and its own
//! floor, `max(compute, copy)`: compute is `resident`'s step at that batch, copy is the
//! variant's host-to-device bytes at `copy_only`'s bandwidth (same page size, same run).
//! A variant that keeps layers resident moves fewer bytes and has a lower floor. Each
//! step's time is split into what the caller's thread did: stall (waiting for copies),
//! the pool's planning, lock waits and views (mapping, when a layer's frames are not
//! consecutive), GEMM launches and the end-of-step sync; the device's threads' time
//! (handling completions, their lock waits) runs beside the step and is reported too.

use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use cudarc::cublas::sys as cublas;
use spillway_client::{
    Buffer, Completion, CompletionSink, CopyOp, DeviceChoice, DeviceConfig, DeviceTimings,
    Direction, Far, FrameId, HostSlot, PageSize, Policy, Pool, PoolBuilder, PoolStats, TransferId,
    pattern,
};
use spillway_device::cuda::CudaDevice;

pub use crate::gpu_report::{GpuBatch, GpuOffloadResult, GpuVariant, markdown, notes};
use crate::repeats::{is_busy, order};
use crate::report::{Load, machine_description};
use crate::workload::median;

/// What to run.
#[derive(Debug, Clone)]
pub struct GpuOffloadConfig {
    /// Layers (48).
    pub layers: usize,
    /// Hidden size (8192: 128 MiB of bf16 weights per layer).
    pub hidden: usize,
    /// Layers the GPU budget holds (8).
    pub slots: usize,
    /// Batch sizes (1024, 4096, 16384).
    pub batches: Vec<usize>,
    /// Timed steps per variant and batch, after one warm-up step.
    pub iters: usize,
    /// Page size.
    pub page_size: PageSize,
    /// Repeats of the whole set of variants, interleaved (1 to
    /// [`crate::repeats::REPEATS_MAX`]).
    pub repeats: usize,
}

struct Blas {
    handle: cublas::cublasHandle_t,
}

impl Blas {
    fn new(dev: &CudaDevice) -> Result<Blas> {
        // SAFETY: probing the loader has no preconditions.
        if !unsafe { cublas::is_culib_present() } {
            bail!(
                "cuBLAS (libcublas.so) was not found: add the CUDA toolkit's lib64 to LD_LIBRARY_PATH"
            );
        }
        dev.bind()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: the context is current; writes the handle.
        let st = unsafe { cublas::cublasCreate_v2(&mut handle) };
        if st != cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            bail!("cublasCreate failed: {st:?}");
        }
        // SAFETY: a live handle and the device's compute stream (same context).
        let st = unsafe {
            cublas::cublasSetStream_v2(handle, dev.compute_stream() as cublas::cudaStream_t)
        };
        if st != cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            bail!("cublasSetStream failed: {st:?}");
        }
        Ok(Blas { handle })
    }

    /// `y[batch, h] = x[batch, h] * w[h, h]` in bf16 with fp32 accumulation, queued on the
    /// compute stream (column-major: `y^T = w^T x^T`).
    fn gemm(&self, x: u64, w: u64, y: u64, batch: usize, h: usize) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (h, b) = (h as i32, batch as i32);
        // SAFETY: `x`, `y` hold `batch * h` bf16, `w` holds `h * h` bf16, all device
        // memory of the handle's context, alive until the stream passes this GEMM (the
        // weights through the guard's fenced release).
        let st = unsafe {
            cublas::cublasGemmEx(
                self.handle,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                h,
                b,
                h,
                (&alpha as *const f32).cast(),
                w as *const std::ffi::c_void,
                cublas::cudaDataType::CUDA_R_16BF,
                h,
                x as *const std::ffi::c_void,
                cublas::cudaDataType::CUDA_R_16BF,
                h,
                (&beta as *const f32).cast(),
                y as *mut std::ffi::c_void,
                cublas::cudaDataType::CUDA_R_16BF,
                h,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if st != cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            bail!("cublasGemmEx failed: {st:?}");
        }
        Ok(())
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `Blas::new`, destroyed once.
        unsafe {
            let _ = cublas::cublasDestroy_v2(self.handle);
        }
    }
}

/// Fills `out` with finite bf16 values (about 0.01 in magnitude) derived from `seed`.
fn fill_bf16(seed: u64, out: &mut [u8]) {
    pattern::fill(seed, out);
    for c in out.chunks_exact_mut(2) {
        let v = u16::from_le_bytes([c[0], c[1]]);
        c.copy_from_slice(&((v & 0x807F) | 0x3C00).to_le_bytes());
    }
}

struct Model {
    pool: Pool,
    weights: Vec<Buffer>,
    /// Expected checksum of each page of each layer.
    sums: Vec<Vec<u64>>,
}

fn build(cfg: &GpuOffloadConfig, policy: Policy, budget_layers: usize) -> Result<Model> {
    let layer_bytes = (cfg.hidden * cfg.hidden * 2) as u64;
    let page = cfg.page_size.bytes();
    let pages = cfg.page_size.pages_for(layer_bytes);
    let pool = PoolBuilder::new()
        .gpu_budget_bytes(budget_layers as u64 * pages * page)
        .host_budget_bytes(cfg.layers as u64 * pages * page)
        .page_size(cfg.page_size)
        .policy(policy)
        .device(DeviceChoice::Cuda)
        .build()?;
    let mut weights = Vec::new();
    let mut sums = Vec::new();
    let mut bytes = vec![0u8; page as usize];
    for i in 0..cfg.layers {
        let w = pool.alloc(&format!("layers.{i}.weight"), layer_bytes)?;
        let mut layer_sums = Vec::new();
        for k in 0..pages {
            let n = (layer_bytes - k * page).min(page) as usize;
            fill_bf16(pattern::page_seed(i as u64, k), &mut bytes[..n]);
            layer_sums.push(pattern::checksum(&bytes[..n]));
            pool.write(&w, k * page, &bytes[..n])?;
        }
        weights.push(w);
        sums.push(layer_sums);
    }
    Ok(Model {
        pool,
        weights,
        sums,
    })
}

/// Sums over the timed steps, per step once divided.
#[derive(Default)]
struct Timed {
    step_s: f64,
    stall_s: f64,
    hit_rate: f64,
    steps: f64,
    h2d_bytes: f64,
    d2h_bytes: f64,
    planning_s: f64,
    lock_wait_s: f64,
    view_s: f64,
    launch_s: f64,
    sync_s: f64,
    acquire_s: f64,
    unaccounted_s: f64,
    device_planning_s: f64,
    device_lock_wait_s: f64,
    device: DeviceTimings,
}

fn pool_interval(after: &PoolStats, before: &PoolStats, t: &mut Timed) {
    let (a, b) = (&after.timings, &before.timings);
    t.h2d_bytes = (after.core.h2d_bytes - before.core.h2d_bytes) as f64;
    t.d2h_bytes = (after.core.d2h_bytes - before.core.d2h_bytes) as f64;
    t.planning_s = (a.planning - b.planning).as_secs_f64();
    t.lock_wait_s = (a.lock_wait - b.lock_wait).as_secs_f64();
    t.view_s = (a.view - b.view).as_secs_f64();
    t.device_planning_s = (a.device_planning - b.device_planning).as_secs_f64();
    t.device_lock_wait_s = (a.device_lock_wait - b.device_lock_wait).as_secs_f64();
    t.device = after.device.since(&before.device);
}

/// Runs warm-up plus `iters` steps at `batch`; checks every page in the first step when
/// `verify` (returns pages checked and corrupt).
fn run_steps(
    cfg: &GpuOffloadConfig,
    m: &Model,
    batch: usize,
    verify: bool,
) -> Result<(Timed, u64, u64)> {
    let dev = m.pool.device();
    let cuda = dev
        .as_any()
        .downcast_ref::<CudaDevice>()
        .context("the pool is not on a CUDA device")?;
    let blas = Blas::new(cuda)?;
    let act_bytes = (batch * cfg.hidden * 2) as u64;
    let x = cuda.alloc_device(act_bytes)?;
    let y = cuda.alloc_device(act_bytes)?;
    let mut times = Vec::new();
    let mut stalls = Vec::new();
    let mut t = Timed::default();
    let (mut acquires, mut hits) = (0u64, 0u64);
    let mut before = m.pool.stats();
    let (mut checked, mut corrupt) = (0u64, 0u64);
    for step in 0..=cfg.iters {
        let started = Instant::now();
        let (mut stall, mut launch, mut acquiring) = (0.0, 0.0, 0.0);
        let (mut a, mut b) = (x.ptr().0, y.ptr().0);
        for (i, w) in m.weights.iter().enumerate() {
            let asked = Instant::now();
            let g = m.pool.acquire(w)?;
            acquiring += asked.elapsed().as_secs_f64();
            if step > 0 {
                acquires += 1;
                hits += u64::from(g.hit());
                stall += g.waited().as_secs_f64();
            }
            if verify && step == 0 {
                for k in 0..g.pages() {
                    checked += 1;
                    corrupt += u64::from(g.checksum(k)? != m.sums[i][k]);
                }
            }
            let launching = Instant::now();
            let wptr = g.device_ptr()?.context(
                "the layer's pages are neither in consecutive frames nor mappable into a range: \
                 use a page size of at least 2 MiB",
            )?;
            blas.gemm(a, wptr.0, b, batch, cfg.hidden)?;
            std::mem::swap(&mut a, &mut b);
            drop(g);
            launch += launching.elapsed().as_secs_f64();
        }
        let syncing = Instant::now();
        cuda.synchronize_compute()?;
        m.pool.step();
        let sync = syncing.elapsed().as_secs_f64();
        let step_s = started.elapsed().as_secs_f64();
        if step > 0 {
            times.push(step_s);
            stalls.push(stall);
            t.launch_s += launch;
            t.sync_s += sync;
            t.acquire_s += acquiring;
            t.unaccounted_s += step_s - acquiring - launch - sync;
        } else {
            before = m.pool.stats();
        }
    }
    m.pool.quiesce();
    let after = m.pool.stats();
    pool_interval(&after, &before, &mut t);
    t.steps = cfg.iters as f64;
    t.step_s = median(times);
    t.stall_s = median(stalls);
    t.hit_rate = if acquires == 0 {
        1.0
    } else {
        hits as f64 / acquires as f64
    };
    Ok((t, checked, corrupt))
}

/// Every layer's pages host-to-device through a fresh device's copy path, all submitted
/// at once (neighbouring pages share driver copies), `iters` times after a warm-up; the median time and the bytes of one pass.
fn copy_only(cfg: &GpuOffloadConfig) -> Result<(f64, u64)> {
    let layer_bytes = (cfg.hidden * cfg.hidden * 2) as u64;
    let page = cfg.page_size.bytes();
    let pages = cfg.page_size.pages_for(layer_bytes);
    let frames = (cfg.slots as u64 * pages) as u32;
    let (tx, rx) = mpsc::channel::<Completion>();
    let tx = Mutex::new(tx);
    let sink: CompletionSink = Arc::new(move |c| {
        let _ = tx.lock().expect("sender").send(c);
    });
    let dev = CudaDevice::new(
        DeviceConfig {
            frames,
            host_slots: frames,
            page_bytes: page,
        },
        sink,
        0,
    )?;
    let total = cfg.layers as u64 * pages;
    let mut times = Vec::new();
    let mut id = 0u64;
    for iter in 0..=cfg.iters {
        let started = Instant::now();
        // Submitted together, so neighbouring pages share driver copies: the floor is
        // the best the copy path does at this page size.
        let ops: Vec<CopyOp> = (0..total)
            .map(|k| {
                id += 1;
                let f = (k % u64::from(frames)) as u32;
                CopyOp {
                    id: TransferId(id),
                    direction: Direction::HostToDevice,
                    frame: FrameId(f),
                    far: Far::Host(HostSlot(f)),
                    bytes: page,
                }
            })
            .collect();
        spillway_client::Device::submit_batch(&dev, &ops);
        for _ in 0..total {
            rx.recv().context("device stopped")?.result?;
        }
        if iter > 0 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    Ok((median(times), total * page))
}

/// The variants in the first repeat's order (later repeats rotate it).
const VARIANTS: [&str; 5] = ["resident", "learned", "on_demand", "clock", "copy_only"];
/// The order of the variants in the result.
const SHOWN: [&str; 5] = ["copy_only", "resident", "on_demand", "clock", "learned"];

/// One repeat's figures of one pool variant: per batch size, what it measured.
struct Measured {
    name: &'static str,
    timed: Vec<Timed>,
}

/// Every variant at every batch size, `repeats` times interleaved, folded into medians
/// and min–max (`gpu_report::fold_repeats`); `say` hears of each run.
pub fn run(cfg: &GpuOffloadConfig, say: impl Fn(&str)) -> Result<GpuOffloadResult> {
    if cfg.page_size.bytes() < 2 << 20 {
        bail!(
            "the GPU benchmark needs pages of at least 2 MiB (a layer must be one contiguous device range)"
        );
    }
    crate::repeats::check(cfg.repeats)?;
    let device = spillway_device::cuda::cuda_available()?;
    let load_before = Load::now();
    let mut repeats = Vec::new();
    let (mut verified, mut corrupt) = (0, 0);
    for repeat in 0..cfg.repeats {
        let mut copy = (0.0, 0);
        let mut measured = Vec::new();
        for name in order(VARIANTS, repeat) {
            let says = |what: &str| {
                say(&format!(
                    "repeat {}/{}: {name}{what}",
                    repeat + 1,
                    cfg.repeats
                ))
            };
            let (policy, budget) = match name {
                "copy_only" => {
                    says("");
                    copy = copy_only(cfg)?;
                    continue;
                }
                "resident" => (Policy::Learned, cfg.layers),
                "on_demand" => (Policy::OnDemand, cfg.slots),
                "clock" => (Policy::Clock, cfg.slots),
                _ => (Policy::Learned, cfg.slots),
            };
            says(&format!(": writing {} layers...", cfg.layers));
            let m = build(cfg, policy, budget)?;
            let mut timed = Vec::new();
            for (bi, &batch) in cfg.batches.iter().enumerate() {
                says(&format!(": batch {batch}"));
                let verify = name == "learned" && bi == 0 && repeat == 0;
                let (t, v, c) = run_steps(cfg, &m, batch, verify)?;
                verified += v;
                corrupt += c;
                timed.push(t);
            }
            measured.push(Measured { name, timed });
        }
        repeats.push(batches_of_repeat(cfg, copy, &measured));
    }
    Ok(GpuOffloadResult {
        device,
        machine: machine_description(),
        layers: cfg.layers,
        hidden: cfg.hidden,
        slots: cfg.slots,
        page_bytes: cfg.page_size.bytes(),
        default_page_bytes: PageSize::default().bytes(),
        repeats: cfg.repeats,
        verified_pages: verified,
        corrupt_pages: corrupt,
        batches: crate::gpu_report::fold_repeats(&repeats),
        busy: is_busy(&load_before),
        load_before,
        load_after: Load::now(),
    })
}

/// One repeat's figures per batch size, in [`SHOWN`]'s order: `copy` is that repeat's
/// copy_only (seconds, bytes), `measured` its pool variants; each ratio is to this
/// repeat's own floor.
fn batches_of_repeat(
    cfg: &GpuOffloadConfig,
    (copy_s, copy_bytes): (f64, u64),
    measured: &[Measured],
) -> Vec<GpuBatch> {
    let copy_bytes_per_s = copy_bytes as f64 / copy_s;
    let of = |name: &str| measured.iter().find(|m| m.name == name);
    let mut batches = Vec::new();
    for (bi, &batch) in cfg.batches.iter().enumerate() {
        let compute_s = of("resident").map_or(0.0, |m| m.timed[bi].step_s);
        let floor = |h2d_bytes: f64| compute_s.max(h2d_bytes / copy_bytes_per_s);
        let mut variants = vec![GpuVariant {
            name: "copy_only".into(),
            step_s: copy_s,
            h2d_bytes_per_step: copy_bytes as f64,
            // Its own floor is the copy alone (no GEMM runs).
            own_floor_s: copy_s,
            ratio_to_own_floor: 1.0,
            hit_rate: 1.0,
            ..GpuVariant::default()
        }];
        for m in SHOWN.iter().filter_map(|n| of(n)) {
            let t = &m.timed[bi];
            let n = t.steps.max(1.0);
            let own_floor_s = floor(t.h2d_bytes / n);
            variants.push(GpuVariant {
                name: m.name.into(),
                step_s: t.step_s,
                h2d_bytes_per_step: t.h2d_bytes / n,
                d2h_bytes_per_step: t.d2h_bytes / n,
                own_floor_s,
                ratio_to_own_floor: t.step_s / own_floor_s,
                hit_rate: t.hit_rate,
                stall_s: t.stall_s,
                planning_s: t.planning_s / n,
                lock_wait_s: t.lock_wait_s / n,
                view_s: t.view_s / n,
                launch_s: t.launch_s / n,
                sync_s: t.sync_s / n,
                acquire_s: t.acquire_s / n,
                unaccounted_s: t.unaccounted_s / n,
                device_planning_s: t.device_planning_s / n,
                device_lock_wait_s: t.device_lock_wait_s / n,
                completion_s: t.device.completion_sink_s / n,
                submit_thread_s: t.device.submit_thread_s / n,
                copies_per_step: t.device.copies as f64 / n,
                completions_late_per_step: t.device.completions_late as f64 / n,
                views_in_place_per_step: t.device.views_in_place as f64 / n,
                views_mapped_per_step: t.device.views_mapped as f64 / n,
                remaps_per_step: t.device.pages_remapped as f64 / n,
                remap_s_per_step: t.device.mapping_s / n,
                ..GpuVariant::default()
            });
        }
        let flops = 2.0 * batch as f64 * (cfg.hidden * cfg.hidden) as f64 * cfg.layers as f64;
        batches.push(GpuBatch {
            batch,
            compute_s,
            copy_bytes_per_s,
            tflops_resident: flops / compute_s / 1e12,
            variants,
        });
    }
    batches
}
