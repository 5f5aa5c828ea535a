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
use serde::Serialize;
use spillway_client::{
    Buffer, Completion, CompletionSink, CopyOp, DeviceChoice, DeviceConfig, DeviceTimings,
    Direction, FrameId, HostSlot, PageSize, Policy, Pool, PoolBuilder, PoolStats, TransferId,
    pattern,
};
use spillway_device::cuda::CudaDevice;

use crate::report::machine_description;
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
}

/// One variant at one batch size. Times are seconds per step: medians for `step_s` and
/// `stall_s`, means over the timed steps for the rest.
#[derive(Debug, Clone, Serialize)]
pub struct GpuVariant {
    /// Variant name.
    pub name: String,
    /// Median step time.
    pub step_s: f64,
    /// Bytes copied host to device per step.
    pub h2d_bytes_per_step: f64,
    /// Bytes copied device to host per step.
    pub d2h_bytes_per_step: f64,
    /// The variant's own floor: max(compute, its own bytes at `copy_only`'s bandwidth).
    pub own_floor_s: f64,
    /// `step_s / own_floor_s`.
    pub ratio_to_own_floor: f64,
    /// Hits / acquires over the timed steps (1 for `copy_only`).
    pub hit_rate: f64,
    /// Median time acquires waited for copies.
    pub stall_s: f64,
    /// The pool's planning on the caller's thread (acquires and `step`).
    pub planning_s: f64,
    /// Waiting for the pool's lock on the caller's thread.
    pub lock_wait_s: f64,
    /// Showing acquired layers as one array on the caller's thread (mapping included).
    pub view_s: f64,
    /// Launching the GEMMs and dropping the guards.
    pub launch_s: f64,
    /// Waiting at the end of the step for the compute stream (GEMMs still queued).
    pub sync_s: f64,
    /// Time inside `acquire` (stall, planning, lock waits and view, and the rest of the
    /// call).
    pub acquire_s: f64,
    /// Step time outside acquires, launches and the sync (the loop itself; ~0).
    pub unaccounted_s: f64,
    /// The device's threads: handling completions and fenced releases (planning).
    pub device_planning_s: f64,
    /// The device's threads: waiting for the pool's lock.
    pub device_lock_wait_s: f64,
    /// The completion threads' time inside the pool's handler (a completion behind
    /// another reaches the pool that much later).
    pub completion_s: f64,
    /// Driver copies per step (neighbouring pages submitted together share one).
    pub copies_per_step: f64,
    /// Completions whose copy had already finished when their thread came to them.
    pub completions_late_per_step: f64,
    /// Layers shown at their frames' own addresses (consecutive frames, no mapping).
    pub views_in_place_per_step: f64,
    /// Layers shown through their buffer range (pages mapped first).
    pub views_mapped_per_step: f64,
    /// Pages mapped into a buffer range where another frame was.
    pub remaps_per_step: f64,
    /// Seconds of driver calls for those mappings (inside `view_s`).
    pub remap_s_per_step: f64,
}

/// All variants at one batch size.
#[derive(Debug, Clone, Serialize)]
pub struct GpuBatch {
    /// Batch size.
    pub batch: usize,
    /// The GEMMs alone (`resident`'s median step): every variant's compute floor.
    pub compute_s: f64,
    /// Host-to-device bandwidth of `copy_only` (same page size), bytes/s.
    pub copy_bytes_per_s: f64,
    /// GEMM throughput with every layer resident, TFLOP/s.
    pub tflops_resident: f64,
    /// The variants.
    pub variants: Vec<GpuVariant>,
}

/// The benchmark's result.
#[derive(Debug, Clone, Serialize)]
pub struct GpuOffloadResult {
    /// The GPU.
    pub device: String,
    /// The host.
    pub machine: String,
    /// Layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Layers the budget holds.
    pub slots: usize,
    /// Page size.
    pub page_bytes: u64,
    /// The pool's default page size on this device (what a pool built without one uses).
    pub default_page_bytes: u64,
    /// Pages checked against their checksum in `learned`'s first step.
    pub verified_pages: u64,
    /// Pages whose checksum was wrong (must be 0).
    pub corrupt_pages: u64,
    /// Per batch size.
    pub batches: Vec<GpuBatch>,
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
            let wptr = g.device_ptr().context(
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
                    slot: HostSlot(f),
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

/// Runs every variant at every batch size.
pub fn run(cfg: &GpuOffloadConfig, say: impl Fn(&str)) -> Result<GpuOffloadResult> {
    if cfg.page_size.bytes() < 2 << 20 {
        bail!(
            "the GPU benchmark needs pages of at least 2 MiB (a layer must be one contiguous device range)"
        );
    }
    let device = spillway_device::cuda::cuda_available()?;
    say("copy_only...");
    let (copy_s, copy_bytes) = copy_only(cfg)?;
    let copy_bytes_per_s = copy_bytes as f64 / copy_s;
    let mut per_variant: Vec<(String, Vec<Timed>)> = Vec::new();
    let (mut verified, mut corrupt) = (0, 0);
    for (name, policy, budget) in [
        ("resident", Policy::Learned, cfg.layers),
        ("on_demand", Policy::OnDemand, cfg.slots),
        ("clock", Policy::Clock, cfg.slots),
        ("learned", Policy::Learned, cfg.slots),
    ] {
        say(&format!("{name}: writing {} layers...", cfg.layers));
        let m = build(cfg, policy, budget)?;
        let mut timed = Vec::new();
        for (bi, &batch) in cfg.batches.iter().enumerate() {
            say(&format!("{name}: batch {batch}"));
            let (t, v, c) = run_steps(cfg, &m, batch, name == "learned" && bi == 0)?;
            verified += v;
            corrupt += c;
            timed.push(t);
        }
        per_variant.push((name.to_string(), timed));
    }
    let mut batches = Vec::new();
    for (bi, &batch) in cfg.batches.iter().enumerate() {
        let compute_s = per_variant[0].1[bi].step_s;
        let floor = |h2d_bytes: f64| compute_s.max(h2d_bytes / copy_bytes_per_s);
        let mut variants = vec![GpuVariant {
            name: "copy_only".into(),
            step_s: copy_s,
            h2d_bytes_per_step: copy_bytes as f64,
            d2h_bytes_per_step: 0.0,
            // Its own floor is the copy alone (no GEMM runs).
            own_floor_s: copy_s,
            ratio_to_own_floor: 1.0,
            hit_rate: 1.0,
            stall_s: 0.0,
            planning_s: 0.0,
            lock_wait_s: 0.0,
            view_s: 0.0,
            launch_s: 0.0,
            sync_s: 0.0,
            acquire_s: 0.0,
            unaccounted_s: 0.0,
            device_planning_s: 0.0,
            device_lock_wait_s: 0.0,
            completion_s: 0.0,
            copies_per_step: 0.0,
            completions_late_per_step: 0.0,
            views_in_place_per_step: 0.0,
            views_mapped_per_step: 0.0,
            remaps_per_step: 0.0,
            remap_s_per_step: 0.0,
        }];
        for (name, timed) in &per_variant {
            let t = &timed[bi];
            let n = t.steps.max(1.0);
            let own_floor_s = floor(t.h2d_bytes / n);
            variants.push(GpuVariant {
                name: name.clone(),
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
                copies_per_step: t.device.copies as f64 / n,
                completions_late_per_step: t.device.completions_late as f64 / n,
                views_in_place_per_step: t.device.views_in_place as f64 / n,
                views_mapped_per_step: t.device.views_mapped as f64 / n,
                remaps_per_step: t.device.pages_remapped as f64 / n,
                remap_s_per_step: t.device.mapping_s / n,
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
    Ok(GpuOffloadResult {
        device,
        machine: machine_description(),
        layers: cfg.layers,
        hidden: cfg.hidden,
        slots: cfg.slots,
        page_bytes: cfg.page_size.bytes(),
        default_page_bytes: PageSize::default().bytes(),
        verified_pages: verified,
        corrupt_pages: corrupt,
        batches,
    })
}

/// The result as Markdown: the step against its own floor, then where the time went.
pub fn markdown(r: &GpuOffloadResult) -> String {
    let mut s = format!(
        "{} layers of {}x{} bf16 ({} MiB each), GPU budget {} layers, page {} MiB (the pool's \
         default page size: {} MiB), {} ({}); pages verified {}, corrupt {}\n\n",
        r.layers,
        r.hidden,
        r.hidden,
        (r.hidden * r.hidden * 2) >> 20,
        r.slots,
        r.page_bytes >> 20,
        r.default_page_bytes >> 20,
        r.device,
        r.machine,
        r.verified_pages,
        r.corrupt_pages
    );
    s += "Own floor = max(compute, the variant's own host-to-device bytes at copy_only's \
          bandwidth). Times in seconds per step.\n\n\
          | batch | variant | step s (median) | GiB moved/step | own floor s | ratio to own floor | hit rate | stall | planning | lock wait | view (mapping) | remaps/step | launch | end sync | device threads: completions | device threads: lock wait |\n\
          |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for b in &r.batches {
        for v in &b.variants {
            s += &format!(
                "| {} | {} | {:.4} | {:.2} | {:.4} | {:.3} | {:.3} | {:.4} | {:.4} | {:.4} | {:.4} | {:.0} | {:.4} | {:.4} | {:.4} | {:.4} |\n",
                b.batch,
                v.name,
                v.step_s,
                (v.h2d_bytes_per_step + v.d2h_bytes_per_step) / (1u64 << 30) as f64,
                v.own_floor_s,
                v.ratio_to_own_floor,
                v.hit_rate,
                v.stall_s,
                v.planning_s,
                v.lock_wait_s,
                v.view_s,
                v.remaps_per_step,
                v.launch_s,
                v.sync_s,
                v.device_planning_s,
                v.device_lock_wait_s,
            );
        }
    }
    s
}
