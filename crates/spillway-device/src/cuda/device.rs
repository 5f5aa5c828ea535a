//! [`CudaDevice`]: the parts put together. Creation (driver and GPU checks, then frames,
//! host slots, sync lane, ranges, copy lanes, fences, completion and submitter threads),
//! the API beyond the [`Device`](crate::Device) trait (compute stream, memory outside the
//! budget in a [`DeviceAlloc`], reads through a buffer range), the helpers the trait impl
//! (`device_impl`) uses, and the teardown order.
//!
//! Invariants: drop order is field order, after [`Drop`] stopped the fences, joined the
//! submitter threads (each enqueues what it was sent first), closed the queues, drained
//! the lanes and joined the lane threads (unless it runs on one): sync lane, ranges,
//! frames, host slots, and the context last. Lock order: a lane's lock (its submitter's
//! lock may be held around it, never taken inside it), or the sync lane's lock, or the
//! buffer ranges' lock; never two of these at once.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, mpsc};
use std::thread::{JoinHandle, ThreadId};

use cudarc::driver::sys;
use spillway_types::BufferId;

use super::ahead::{MAP_AHEAD_VAR, MapAhead};
use super::context::{Context, Stream};
use super::driver::{
    check, device_attribute, device_handle, device_name, init_driver, lock, unavailable,
};
use super::fence::FenceLane;
use super::frames::Frames;
use super::host::HostSlots;
use super::kernels::SyncLane;
use super::lanes::{
    Lane, LaneState, LaneStats, Pending, RawCopy, Submission, completion_loop, submit_loop,
};
use super::mapper::{ViewStats, apply};
use super::ranges::Ranges;
use crate::{
    CompletionSink, CopyOp, DeviceConfig, DeviceError, DevicePtr, DeviceTimings, HostMemory,
    check_range,
};

/// First guess of PCIe Gen5 x16 pinned copy bandwidth per direction (~55 GB/s measured).
pub const BANDWIDTH_HINT_BYTES_PER_S: f64 = 50e9;
/// Most bytes one copy carries when neighbouring pages are submitted together
/// ([`Device::submit_batch`](crate::Device::submit_batch)): 16 MiB. Copies of 2 MiB with an event each run at
/// 0.90x of raw pinned bandwidth on the H200, 8 MiB ones at 0.97-0.98x; a run completes
/// as a whole, so a longer one delays its first page's completion (16 MiB: ~0.3 ms).
pub const COPY_RUN_BYTES_MAX: u64 = 16 << 20;
/// Streams per copy direction that [`CudaDevice::new`] uses. More than one lets the next
/// copy start while the previous one's completion is being signalled.
pub const STREAMS_PER_DIRECTION_DEFAULT: usize = 1;
/// Most streams per direction [`CudaDevice::with_streams`] accepts; each costs one
/// driver stream and nothing else.
pub const STREAMS_PER_DIRECTION_MAX: usize = 8;

/// An NVIDIA GPU as a Spillway device. See the module docs.
pub struct CudaDevice {
    pub(crate) config: DeviceConfig,
    pub(crate) name: String,
    pub(crate) ordinal: usize,
    pub(crate) sm_count: u32,
    // Drop order is field order: lanes (drain copies), sync lane, ranges, frames, host
    // slots, and the context last (every part also holds an `Arc` of it).
    pub(crate) fences: FenceLane,
    pub(crate) lanes: [Arc<Lane>; 2],
    /// The lanes' completion threads.
    threads: Vec<JoinHandle<()>>,
    /// The lanes' submitter threads (none with `SPILLWAY_CUDA_SUBMIT=inline`).
    submitters: Vec<JoinHandle<()>>,
    sync: Mutex<SyncLane>,
    /// Counts of the views of acquired buffers (`mapper`).
    pub(crate) views: ViewStats,
    /// The frames' physical chunks, for mapping into buffer ranges (empty when frames
    /// cannot be mapped one by one).
    pub(crate) handles: Vec<sys::CUmemGenericAllocationHandle>,
    pub(crate) ranges: Arc<Ranges>,
    /// The map-ahead thread (see `ahead`; `SPILLWAY_CUDA_MAP_AHEAD=0` turns it off).
    pub(crate) ahead: Option<Arc<MapAhead>>,
    pub(crate) frames: Frames,
    pub(crate) host: HostSlots,
    pub(crate) ctx: Arc<Context>,
    /// Switches for finding a fault (module docs of `cuda`, "Diagnostics").
    pub(crate) diagnostics: Diagnostics,
}

/// Switches that turn parts of the copy and view paths off, read once from the
/// environment when a device is made, for telling which part a wrong result comes from
/// (each costs speed, none changes what is copied where):
/// - `SPILLWAY_CUDA_COPY_RUNS=0`: every page its own copy and event (no runs);
/// - `SPILLWAY_CUDA_VIEWS=mapped`: an acquire is shown through its buffer's range even
///   when its frames are consecutive (needs pages of a multiple of the granularity);
/// - `SPILLWAY_CUDA_SYNC_RELEASES=1`: a release behind consumer streams synchronizes them
///   on the releasing thread before the pool takes the pages back;
/// - `SPILLWAY_CUDA_SUBMIT=inline`: every copy is enqueued in the driver by the thread
///   that submits it (the pool's caller, under the pool's lock), no submitter threads;
/// - `SPILLWAY_CUDA_COMPLETION_BURSTS=0`: each finished copy is reported on its own, not
///   as part of a burst with the copies found finished after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Diagnostics {
    /// Neighbouring pages go as one copy (default true).
    pub copy_runs: bool,
    /// Consecutive frames are shown in place (default true).
    pub views_in_place: bool,
    /// Releases wait for their consumer streams on the host (default false).
    pub sync_releases: bool,
    /// Copies after a batch's first are enqueued by the lane's submitter thread
    /// (default true).
    pub submit_off_thread: bool,
    /// A completion thread that finds the next copies finished too reports them as one
    /// burst ([`crate::Completion::follows`]; default true).
    pub completion_bursts: bool,
}

impl Default for Diagnostics {
    fn default() -> Self {
        Diagnostics {
            copy_runs: true,
            views_in_place: true,
            sync_releases: false,
            submit_off_thread: true,
            completion_bursts: true,
        }
    }
}

impl Diagnostics {
    /// The switches set in the environment (unset or other values: the default).
    pub fn from_env() -> Diagnostics {
        let d = Diagnostics::parse(|name| std::env::var(name).ok());
        if d != Diagnostics::default() {
            tracing::warn!(diagnostics = ?d, "cuda device: diagnostic switches set (slower)");
        }
        d
    }

    /// The switches as `var` names them.
    fn parse(var: impl Fn(&str) -> Option<String>) -> Diagnostics {
        Diagnostics {
            copy_runs: var("SPILLWAY_CUDA_COPY_RUNS").as_deref() != Some("0"),
            views_in_place: var("SPILLWAY_CUDA_VIEWS").as_deref() != Some("mapped"),
            sync_releases: var("SPILLWAY_CUDA_SYNC_RELEASES").as_deref() == Some("1"),
            submit_off_thread: var("SPILLWAY_CUDA_SUBMIT").as_deref() != Some("inline"),
            completion_bursts: var("SPILLWAY_CUDA_COMPLETION_BURSTS").as_deref() != Some("0"),
        }
    }
}

impl CudaDevice {
    /// The diagnostic switches this device was made with.
    pub fn diagnostics(&self) -> Diagnostics {
        self.diagnostics
    }

    /// Opens GPU `ordinal`, allocates `config.frames` frames of device memory and
    /// `config.host_slots` pinned host slots, loads the kernels and starts the two
    /// completion threads.
    ///
    /// Errors: [`DeviceError::Unavailable`] without a driver or GPU (checked before any
    /// other driver call), [`DeviceError::OutOfMemory`] when the frames exceed the free
    /// device memory or the slots cannot be pinned, [`DeviceError::Driver`] otherwise.
    pub fn new(
        config: DeviceConfig,
        sink: CompletionSink,
        ordinal: usize,
    ) -> Result<CudaDevice, DeviceError> {
        Self::with_streams(config, sink, ordinal, STREAMS_PER_DIRECTION_DEFAULT)
    }

    /// [`CudaDevice::new`] with the host slots in `host` (when given), registered with the
    /// driver as pinned, instead of pinned memory of its own.
    pub fn with_host_memory(
        config: DeviceConfig,
        host: Option<HostMemory>,
        sink: CompletionSink,
        ordinal: usize,
    ) -> Result<CudaDevice, DeviceError> {
        Self::build(config, host, sink, ordinal, STREAMS_PER_DIRECTION_DEFAULT)
    }

    /// [`CudaDevice::new`] with `streams_per_direction` copy streams in each direction
    /// (clamped to `1..=STREAMS_PER_DIRECTION_MAX`), used round-robin. Completions stay
    /// in submission order whatever the count.
    pub fn with_streams(
        config: DeviceConfig,
        sink: CompletionSink,
        ordinal: usize,
        streams_per_direction: usize,
    ) -> Result<CudaDevice, DeviceError> {
        Self::build(config, None, sink, ordinal, streams_per_direction)
    }

    fn build(
        config: DeviceConfig,
        host_memory: Option<HostMemory>,
        sink: CompletionSink,
        ordinal: usize,
        streams_per_direction: usize,
    ) -> Result<CudaDevice, DeviceError> {
        init_driver()?;
        if config.page_bytes == 0 {
            return Err(DeviceError::OutOfRange {
                offset: 0,
                len: 0,
                page_bytes: 0,
            });
        }
        let dev = device_handle(ordinal)?;
        let name = device_name(dev)?;
        let vmm = device_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
        )?;
        if vmm == 0 {
            return Err(unavailable(format!(
                "{name} does not support the CUDA virtual-memory API"
            )));
        }
        let sm_count = device_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?
        .max(1) as u32;
        let ctx = Context::retain(dev)?;
        let frames = Frames::new(&ctx, config.frames, config.page_bytes)?;
        let host = match host_memory {
            Some(memory) => {
                HostSlots::register(&ctx, config.host_slots, config.page_bytes, memory)?
            }
            None => HostSlots::new(&ctx, config.host_slots, config.page_bytes)?,
        };
        let sync = SyncLane::new(&ctx)?;
        let ranges = Arc::new(Ranges {
            ctx: ctx.clone(),
            page_bytes: config.page_bytes,
            map: Mutex::new(HashMap::new()),
        });
        let handles = if frames.remappable() {
            frames.handles.clone()
        } else {
            Vec::new()
        };
        let ahead = if frames.remappable() && std::env::var(MAP_AHEAD_VAR).as_deref() != Ok("0") {
            Some(MapAhead::start(
                ctx.clone(),
                ranges.clone(),
                handles.clone(),
            )?)
        } else {
            None
        };

        let new_lane = |queue: mpsc::Sender<Pending>| -> Result<Arc<Lane>, DeviceError> {
            let streams = (0..streams_per_direction.clamp(1, STREAMS_PER_DIRECTION_MAX))
                .map(|_| Stream::new(&ctx))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Arc::new(Lane {
                ctx: ctx.clone(),
                streams,
                state: Mutex::new(LaneState {
                    queue: Some(queue),
                    free_events: Vec::new(),
                    next_stream: 0,
                }),
                submitter: Mutex::new(None),
                queued: AtomicUsize::new(0),
                stats: Mutex::new(LaneStats::default()),
            }))
        };
        let (h2d_tx, h2d_rx) = mpsc::channel();
        let (d2h_tx, d2h_rx) = mpsc::channel();
        let lanes = [new_lane(h2d_tx)?, new_lane(d2h_tx)?];
        let fences = FenceLane::new(&ctx)?;
        let mut device = CudaDevice {
            config,
            name,
            ordinal,
            sm_count,
            fences,
            views: ViewStats::default(),
            handles,
            lanes,
            threads: Vec::new(),
            submitters: Vec::new(),
            sync: Mutex::new(sync),
            ranges,
            ahead,
            frames,
            host,
            ctx,
            diagnostics: Diagnostics::from_env(),
        };
        let bursts = device.diagnostics.completion_bursts;
        for (i, rx) in [h2d_rx, d2h_rx].into_iter().enumerate() {
            let lane = device.lanes[i].clone();
            let ctx = device.ctx.clone();
            let sink = sink.clone();
            let name = ["spillway-cuda-h2d", "spillway-cuda-d2h"][i];
            let handle = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || completion_loop(&ctx, &lane, &rx, &sink, bursts))
                .map_err(|e| DeviceError::Driver {
                    op: "spawn completion thread",
                    message: e.to_string(),
                })?;
            device.threads.push(handle);
        }
        if device.diagnostics.submit_off_thread {
            for i in 0..2 {
                let lane = device.lanes[i].clone();
                let (tx, rx) = mpsc::channel();
                let name = ["spillway-cuda-h2d-submit", "spillway-cuda-d2h-submit"][i];
                let handle = std::thread::Builder::new()
                    .name(name.into())
                    .spawn(move || submit_loop(&lane, &rx))
                    .map_err(|e| DeviceError::Driver {
                        op: "spawn submitter thread",
                        message: e.to_string(),
                    })?;
                *lock(&device.lanes[i].submitter) = Some(tx);
                device.submitters.push(handle);
            }
        }
        Ok(device)
    }

    /// The compute stream: the stream the caller's kernels (GEMMs) should run on, so that
    /// releases are fenced behind them ([`Device::after_queued_work`](crate::Device::after_queued_work)).
    pub fn compute_stream(&self) -> sys::CUstream {
        self.fences.stream.raw
    }

    /// Pages mapped into buffer ranges where another frame (or none) was, and seconds the
    /// driver took for them (paid by the acquiring thread, only for buffers whose frames
    /// are not consecutive).
    pub fn mapping_stats(&self) -> (u64, f64) {
        let t = lock(&self.views.counts);
        (t.pages_remapped, t.mapping_s)
    }

    /// Whether pages are mapped ahead (module `ahead`).
    pub fn mapping_ahead(&self) -> bool {
        self.ahead.is_some()
    }

    /// Waits until the map-ahead thread has mapped every buffer queued so far, at most
    /// `timeout`; whether it has (true without the thread). For tests and tools.
    pub fn wait_mapped_ahead(&self, timeout: std::time::Duration) -> bool {
        self.ahead.as_ref().is_none_or(|a| a.wait_idle(timeout))
    }

    /// Where the device's own time went so far (views, mappings, completions).
    pub fn timings(&self) -> DeviceTimings {
        let mut t = *lock(&self.views.counts);
        if let Some(ahead) = &self.ahead {
            let a = ahead.stats();
            t.pages_mapped_ahead = a.pages;
            t.map_ahead_s = a.seconds;
        }
        for lane in &self.lanes {
            let l = lock(&lane.stats);
            t.completions += l.completions;
            t.copies += l.copies;
            t.completions_late += l.completions_late;
            t.completion_sink_s += l.completion_sink_s;
            t.submitted_off_thread += l.submitted_off_thread;
            t.submit_thread_s += l.submit_thread_s;
        }
        t
    }

    /// Maps `buffer`'s pages where `map_page` said they are (those not mapped there
    /// yet) and returns its range's base address.
    pub(crate) fn map_buffer(&self, buffer: BufferId) -> Result<u64, DeviceError> {
        let shared = self.ranges.get(buffer).ok_or_else(|| DeviceError::Driver {
            op: "map buffer range",
            message: format!("{buffer} has no reserved range"),
        })?;
        let mut range = lock(&shared);
        self.ctx.bind()?;
        apply(
            &self.ranges,
            &mut range,
            &self.handles,
            self.ctx.device,
            &self.views,
        )?;
        Ok(range.base)
    }

    /// Makes the device's context current on the calling thread (before calling CUDA
    /// libraries such as cuBLAS directly).
    pub fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind()
    }

    /// Waits until the compute stream has finished everything queued on it.
    pub fn synchronize_compute(&self) -> Result<(), DeviceError> {
        self.ctx.bind()?;
        self.fences.stream.synchronize()
    }

    /// Allocates `bytes` of device memory outside the pool's budget (activations).
    pub fn alloc_device(&self, bytes: u64) -> Result<DeviceAlloc, DeviceError> {
        self.ctx.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; writes the allocation's address.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, bytes.max(1) as usize)
        })?;
        Ok(DeviceAlloc {
            ctx: self.ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// The GPU's ordinal, as given to [`CudaDevice::new`].
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Bytes of one physical chunk: the page rounded up to the allocation granularity.
    pub fn chunk_bytes(&self) -> u64 {
        self.frames.chunk_bytes
    }

    /// How many of `ops` (one direction, in order) one copy can carry from the first:
    /// neighbouring pages (consecutive frames at consecutive addresses, consecutive
    /// slots), every one but the last whole, at most [`COPY_RUN_BYTES_MAX`] in all.
    pub(crate) fn run_len(&self, ops: &[CopyOp]) -> usize {
        let page = self.config.page_bytes;
        if !self.frames.contiguous() || !self.diagnostics.copy_runs || ops.is_empty() {
            return ops.len().min(1);
        }
        let mut bytes = ops[0].bytes;
        let mut n = 1;
        while n < ops.len() {
            let (prev, next) = (&ops[n - 1], &ops[n]);
            if next.direction != prev.direction
                || prev.bytes != page
                || prev.frame.0.checked_add(1) != Some(next.frame.0)
                || !matches!((prev.slot(), next.slot()), (Some(a), Some(b)) if a.0.checked_add(1) == Some(b.0))
                || bytes + next.bytes > COPY_RUN_BYTES_MAX.max(page)
            {
                break;
            }
            bytes += next.bytes;
            n += 1;
        }
        n
    }

    /// `run` (one op, or neighbouring pages that [`CudaDevice::run_len`] accepted) as
    /// one driver copy's addresses, checked; refused (its completion will say why) when a
    /// page's bytes exceed a page. An id out of range panics (a caller bug), on the
    /// submitting thread.
    pub(crate) fn resolve(&self, run: &[CopyOp]) -> Submission {
        let ids = run.iter().map(|op| op.id).collect();
        let mut bytes = 0;
        let mut first_slot = None;
        for op in run {
            if let Err(e) = check_range(0, op.bytes, self.config.page_bytes) {
                return Submission { ids, copy: Err(e) };
            }
            let Some(slot) = op.slot().filter(|_| op.far_matches()) else {
                // This backend lends and borrows no GPU memory (`Device::peer_frames` is
                // 0), so a pool never asks it for a peer copy.
                return Submission {
                    ids,
                    copy: Err(DeviceError::Driver {
                        op: "peer copy",
                        message: "no peer GPU is attached to this CUDA device".into(),
                    }),
                };
            };
            // Validates the ids (panics on a caller bug, as everywhere).
            let _ = (self.frames.ptr(op.frame), self.host.ptr(slot));
            first_slot.get_or_insert(slot);
            bytes += op.bytes;
        }
        let first = &run[0];
        let copy = RawCopy {
            direction: first.direction,
            frame: self.frames.ptr(first.frame),
            slot: self.host.ptr(first_slot.expect("a run has a page")) as usize,
            bytes,
        };
        Submission {
            ids,
            copy: Ok(copy),
        }
    }

    /// Runs `f` on the sync lane with the context current.
    pub(crate) fn with_sync<T>(
        &self,
        f: impl FnOnce(&SyncLane) -> Result<T, DeviceError>,
    ) -> Result<T, DeviceError> {
        let lane = lock(&self.sync);
        self.ctx.bind()?;
        f(&lane)
    }

    /// Synchronous copy host -> device address `dst` (inside memory we own).
    pub(crate) fn copy_to_device(&self, dst: u64, data: &[u8]) -> Result<(), DeviceError> {
        if data.is_empty() {
            return Ok(());
        }
        self.with_sync(|lane| {
            // SAFETY: callers checked `dst..dst+len` lies in our device memory; `data`
            // is borrowed until the stream sync below, after which the driver is done
            // with it (pageable copies are staged, then DMA'd, before the sync returns).
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len(), lane.stream.raw)
            })?;
            lane.stream.synchronize()
        })
    }

    /// Synchronous copy device address `src` (inside memory we own) -> host.
    pub(crate) fn copy_from_device(&self, src: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        if out.is_empty() {
            return Ok(());
        }
        self.with_sync(|lane| {
            // SAFETY: callers checked the source range; `out` is borrowed mutably until
            // the sync below, so nothing else reads or writes it meanwhile.
            check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, out.len(), lane.stream.raw)
            })?;
            lane.stream.synchronize()
        })
    }

    pub(crate) fn checksum_at(&self, ptr: u64, len: u64) -> Result<u64, DeviceError> {
        if len == 0 {
            return Ok(0);
        }
        debug_assert_eq!(ptr % 8, 0, "kernels read aligned words");
        let (mut p, mut l, sms) = (ptr, len, self.sm_count);
        self.with_sync(|lane| {
            let mut out = lane.scratch_dev;
            let mut params: [*mut c_void; 3] = [
                (&raw mut p).cast(),
                (&raw mut l).cast(),
                (&raw mut out).cast(),
            ];
            lane.reduce(lane.checksum, len.div_ceil(8), sms, &mut params)
        })
        .map(|sum| sum ^ len)
    }

    /// Checks that every page of `buffer` overlapping `offset..offset+len` is mapped;
    /// returns the range's base address.
    fn mapped_span(&self, buffer: BufferId, offset: u64, len: u64) -> Result<u64, DeviceError> {
        let shared = self.ranges.get(buffer).ok_or_else(|| DeviceError::Driver {
            op: "read buffer range",
            message: format!("{buffer} has no reserved range"),
        })?;
        let range = lock(&shared);
        let page = self.config.page_bytes;
        let range_bytes = range.mapped.len() as u64 * page;
        check_range(offset, len, range_bytes)?;
        if len > 0 {
            for index in offset / page..=(offset + len - 1) / page {
                if range.mapped[index as usize].is_none() {
                    return Err(DeviceError::Driver {
                        op: "read buffer range",
                        message: format!("page {index} of {buffer} is not mapped"),
                    });
                }
            }
        }
        Ok(range.base)
    }

    /// Copies `out.len()` bytes at `offset` of `buffer`'s range (see
    /// [`Device::reserve_range`](crate::Device::reserve_range)) to `out`, through the range's own addresses. Every page
    /// touched must be mapped. For tests and tools: shows the range is one contiguous view.
    pub fn read_range(
        &self,
        buffer: BufferId,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.map_buffer(buffer)?;
        let base = self.mapped_span(buffer, offset, out.len() as u64)?;
        self.copy_from_device(base + offset, out)
    }

    /// [`spillway_types::pattern::checksum`] of the first `len` bytes of `buffer`'s range,
    /// computed by one kernel over the range's contiguous addresses. Every page touched
    /// must be mapped.
    pub fn checksum_range(&self, buffer: BufferId, len: u64) -> Result<u64, DeviceError> {
        self.map_buffer(buffer)?;
        let base = self.mapped_span(buffer, 0, len)?;
        self.checksum_at(base, len)
    }
}

impl CudaDevice {
    /// [`spillway_types::pattern::checksum`] of `len` bytes at `ptr`, an address that
    /// [`Device::acquire_ptr`](crate::Device::acquire_ptr) returned (inside the frames, or inside a buffer range whose
    /// pages touched are mapped; anything else is refused). For tests and tools: shows
    /// that a view is one array.
    pub fn checksum_view(&self, ptr: DevicePtr, len: u64) -> Result<u64, DeviceError> {
        if !self.frames.contains(ptr.0, len) {
            let ranges: Vec<_> = lock(&self.ranges.map).values().cloned().collect();
            let page = self.config.page_bytes;
            let inside = ranges.iter().any(|r| {
                let r = lock(r);
                let end = r.base + r.mapped.len() as u64 * page;
                ptr.0 >= r.base
                    && ptr.0.checked_add(len).is_some_and(|e| e <= end)
                    && (len == 0
                        || (((ptr.0 - r.base) / page)..=((ptr.0 - r.base + len - 1) / page))
                            .all(|i| r.mapped[i as usize].is_some()))
            });
            if !inside {
                return Err(DeviceError::OutOfRange {
                    offset: ptr.0,
                    len,
                    page_bytes: page,
                });
            }
        }
        self.checksum_at(ptr.0, len)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Fences first: their `done` may call back into the pool.
        self.fences.shutdown();
        // The map-ahead thread maps frames' chunks: ended before they are freed.
        if let Some(ahead) = &self.ahead {
            ahead.stop();
        }
        // Close the submitters: they enqueue every run sent to them, then end (they never
        // call into the pool, so joining them from a completion thread is safe).
        for lane in &self.lanes {
            lock(&lane.submitter).take();
        }
        for t in self.submitters.drain(..) {
            let _ = t.join();
        }
        // Close the queues: the threads deliver every queued completion, then end.
        for lane in &self.lanes {
            lock(&lane.state).queue.take();
        }
        // Let every copy already enqueued finish before the memory it uses is freed
        // (matters when a lane thread is not joined below).
        if self.ctx.bind().is_ok() {
            for lane in &self.lanes {
                lane.synchronize();
            }
        }
        let me: ThreadId = std::thread::current().id();
        for t in self.threads.drain(..) {
            // Dropped from inside the sink (on a lane thread): that thread cannot join
            // itself; it ends on its own after the sink returns.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        // Fields drop next, in declaration order (see the struct).
    }
}

/// Device memory outside the pool's budget (activations, workspaces), freed on drop.
pub struct DeviceAlloc {
    ctx: Arc<Context>,
    ptr: sys::CUdeviceptr,
    bytes: u64,
}

// SAFETY: a device address; the driver API is thread-safe.
unsafe impl Send for DeviceAlloc {}
// SAFETY: as above.
unsafe impl Sync for DeviceAlloc {}

impl DeviceAlloc {
    /// The device address.
    pub fn ptr(&self) -> DevicePtr {
        DevicePtr(self.ptr)
    }
    /// Its size.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: allocated by `cuMemAlloc` in `CudaDevice::alloc_device`, freed once.
            unsafe {
                let _ = sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Diagnostics;

    #[test]
    fn diagnostic_switches_are_off_unless_set_to_their_values() {
        assert_eq!(Diagnostics::parse(|_| None), Diagnostics::default());
        let set = |n: &str| {
            Some(String::from(match n {
                "SPILLWAY_CUDA_COPY_RUNS" => "0",
                "SPILLWAY_CUDA_VIEWS" => "mapped",
                "SPILLWAY_CUDA_SUBMIT" => "inline",
                "SPILLWAY_CUDA_COMPLETION_BURSTS" => "0",
                _ => "1",
            }))
        };
        assert_eq!(
            Diagnostics::parse(set),
            Diagnostics {
                copy_runs: false,
                views_in_place: false,
                sync_releases: true,
                submit_off_thread: false,
                completion_bursts: false,
            }
        );
        let other = |_: &str| Some("yes".to_string());
        assert_eq!(Diagnostics::parse(other), Diagnostics::default());
    }
}
