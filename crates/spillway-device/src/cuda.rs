//! The `cuda` backend: an NVIDIA GPU through the CUDA driver API (cudarc, loaded at run
//! time, so building needs no CUDA and a machine without a driver gets an error, not a
//! crash).
//!
//! # Parts
//! - **Context**: the device's primary context, retained at creation and made current on
//!   every thread before it calls the driver (a cheap thread-local switch).
//! - **Frames**: device memory from the CUDA virtual-memory API. Physical chunks of
//!   `chunk_bytes = round_up(page_bytes, granularity)` come from `cuMemCreate` (the
//!   granularity is 2 MiB on the H200) and are all mapped into one reserved address
//!   range, so [`Device::frame_ptr`] is stable for the device's life. When a page is
//!   smaller than the granularity one chunk holds `chunk_bytes / page_bytes` frames.
//! - **Buffer ranges**: when each frame is exactly one chunk (`page_bytes` a multiple of
//!   the granularity), [`Device::reserve_range`] reserves a contiguous address range per
//!   buffer and [`Device::map_page`] maps the frame's physical chunk a second time at
//!   the page's place in it (`cuMemMap` of one handle at two addresses), so a kernel sees
//!   the buffer's resident pages as one array. With smaller pages a frame is part of a
//!   chunk and cannot be mapped alone: `reserve_range` returns `Ok(None)` and the caller
//!   works page by page through `frame_ptr`.
//! - **Host slots**: one `cuMemHostAlloc` (pinned, portable) region, pre-faulted, so
//!   copies run at full PCIe speed and never fault.
//! - **Two copy lanes**, host-to-device and device-to-host, each with its own
//!   non-blocking stream(s) (so the GPU's copy engines run both directions at once) and
//!   a completion thread. `submit` enqueues `cuMemcpy{HtoD,DtoH}Async` and records an
//!   event right after it on one of the lane's streams (round-robin when there are
//!   several, [`CudaDevice::with_streams`]), under the lane's lock, and queues
//!   `(id, event)` to the lane's thread. The thread waits for each event in turn with
//!   `cuEventSynchronize` on a *blocking-sync* event (the thread sleeps in the kernel
//!   driver until the copy engine signals; it does not spin a core) and then calls the
//!   sink. The queue holds copies in submission order and the thread reports them in that
//!   order, so completions of one direction arrive in submission order even when copies
//!   on two streams finish out of order (a later copy's completion then waits for the
//!   earlier one's). Events are recycled through a per-lane free list (as many as copies
//!   in flight).
//! - **Sync lane**: one more stream, under a mutex, for the synchronous calls
//!   (`write_frame`, `read_frame`, the kernels); each call ends with a stream sync.
//! - **Compute stream and fences**: [`CudaDevice::compute_stream`] is where the caller's
//!   own kernels (GEMMs) go. [`Device::after_queued_work`] records an event on it and a
//!   fence thread runs the callback once the stream passes the event: the pool releases
//!   an acquire that way, so a frame is never reused while a queued kernel reads it.
//!
//! # Kernels
//! Hand-written PTX (`cuda/kernels.ptx`) loaded with `cuModuleLoadData`: the driver
//! compiles it for whatever GPU is present, so neither NVRTC nor nvcc is needed at build
//! or run time. Each kernel is a grid-stride loop over the page's little-endian `u64`
//! words (the trailing `len % 8` bytes byte by byte, zero-padded when read):
//! - `fill_pattern` writes exactly [`spillway_types::pattern::fill`];
//! - `checksum` returns exactly [`spillway_types::pattern::checksum`] (the per-word sums
//!   are reduced with warp shuffles and one 64-bit atomic add per warp; the sum wraps and
//!   is order-independent, so the parallel result is the serial one);
//! - `compute` returns [`compute_reference`]: for every word `w` at index `i`,
//!   `x = w ^ i * 0xD6E8_FEB8_6659_FD93`, then `passes` rounds of
//!   `x = rotl(x * 0x9E37_79B9_7F4A_7C15 + (w + p), 17)`; the result is the wrapping sum
//!   of every word's `x`, XOR the length. It reads every byte once, does `passes` rounds
//!   of 64-bit arithmetic per word, and depends on every byte. It is *not* the value of
//!   [`crate::sim::compute_passes`] (a serial chain that a GPU cannot run in parallel).
//!
//! # Performance (H200, PCIe Gen5 x16; `tests/gpu.rs`, results in `measurements/`)
//! Raw pinned `cuMemcpyAsync` of 256 MiB blocks: ~55 GB/s each way, 86-102 GB/s both
//! ways. `submit` with 8 MiB pages: 0.97-0.98x of that each way and ~95 GB/s both ways.
//! With 2 MiB pages: 0.85-0.90x each way and 77-83 GB/s both ways with 64 MiB in flight
//! per direction. The 2 MiB gap is the copy size (raw 2 MiB copies reach 0.93-0.96x)
//! plus the event recorded after every copy (raw 2 MiB copies with an event each reach
//! 0.90-0.91x, which is also what `submit` reaches with 256 MiB in flight). A second
//! stream per direction ([`CudaDevice::with_streams`]) helped in one run and not in
//! another, so the default stays at one.
//!
//! # Invariants
//! - Device memory is sized once: creation refuses with [`DeviceError::OutOfMemory`]
//!   (asked and free bytes) when `chunks * chunk_bytes` exceeds the free device memory
//!   that `cuMemGetInfo` reports, before allocating anything.
//! - Every submitted copy gets exactly one completion, also when it was refused (a bad
//!   range, a driver error): the refusal travels through the lane's queue, in order.
//! - The sink is called from a lane thread with no lock of the device held, so it may
//!   submit. Dropping the device waits for every submitted copy and delivers its
//!   completion, then joins the lane threads (unless the drop runs on one of them: then
//!   that thread ends by itself once its queue is empty).
//! - Safety rests on the pool's contract (crate docs): nobody touches a frame or slot
//!   while a copy using it is in flight, and frame and slot ids are in range (checked;
//!   an id out of range is a caller bug and panics, as in `sim`).
//! - Every CUDA handle is owned by one RAII value that holds an `Arc` of the context and
//!   makes it current before destroying the handle, so teardown works on any thread and
//!   the context is released last.
//!
//! Lock order: a lane's lock, or the sync lane's lock, or the buffer ranges' lock; never
//! two at once.

use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc};
use std::thread::{JoinHandle, ThreadId};
use std::time::Instant;

use cudarc::driver::sys;
use spillway_types::{BufferId, Direction, FrameId, HostSlot, TransferId};

use crate::{
    Completion, CompletionSink, CopyOp, Device, DeviceConfig, DeviceError, DeviceKind, DevicePtr,
    HostMemory, check_range,
};

/// The PTX module, NUL-terminated as `cuModuleLoadData` wants it.
const KERNELS_PTX: &str = concat!(include_str!("cuda/kernels.ptx"), "\0");
/// Threads per block of every kernel (a multiple of the warp size: the reductions need
/// full warps).
const BLOCK_THREADS: u32 = 256;
/// Most blocks per multiprocessor a launch asks for; the loops are grid-stride, so more
/// work than threads is fine.
const BLOCKS_PER_SM: u32 = 8;
/// Bytes of one OS page, the stride of pre-faulting.
const OS_PAGE_BYTES: usize = 4096;
/// First guess of PCIe Gen5 x16 pinned copy bandwidth per direction (~55 GB/s measured).
pub const BANDWIDTH_HINT_BYTES_PER_S: f64 = 50e9;
/// Streams per copy direction that [`CudaDevice::new`] uses. More than one lets the next
/// copy start while the previous one's completion is being signalled.
pub const STREAMS_PER_DIRECTION_DEFAULT: usize = 1;
/// Most streams per direction [`CudaDevice::with_streams`] accepts; each costs one
/// driver stream and nothing else.
pub const STREAMS_PER_DIRECTION_MAX: usize = 8;

const SUCCESS: sys::CUresult = sys::CUresult::CUDA_SUCCESS;

fn unavailable(reason: impl Into<String>) -> DeviceError {
    DeviceError::Unavailable {
        backend: "cuda",
        reason: reason.into(),
    }
}

/// The driver's name and text for `r` (`CUDA_ERROR_OUT_OF_MEMORY: out of memory`).
fn result_text(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string of the driver, or leave
    // it null for an unknown code; we read the strings only when non-null.
    unsafe {
        let _ = sys::cuGetErrorName(r, &mut name);
        let _ = sys::cuGetErrorString(r, &mut text);
        let name = (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy());
        let text = (!text.is_null()).then(|| CStr::from_ptr(text).to_string_lossy());
        match (name, text) {
            (Some(n), Some(t)) => format!("{n}: {t}"),
            (Some(n), None) => n.into_owned(),
            _ => format!("CUresult {}", r as u32),
        }
    }
}

fn check(op: &'static str, r: sys::CUresult) -> Result<(), DeviceError> {
    if r == SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Driver {
            op,
            message: result_text(r),
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of our locks leaves plain data (handles, lists) that is
    // still consistent: every update is a single push/pop/insert.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Loads the driver library and initialises it, or says why it cannot be used.
fn init_driver() -> Result<(), DeviceError> {
    // SAFETY: `is_culib_present` dlopens and closes libcuda; the library is designed to
    // be loaded this way and runs no code of ours.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable(
            "libcuda.so (the NVIDIA driver library) was not found on the loader path: \
             no NVIDIA driver, so no usable GPU, on this machine",
        ));
    }
    // SAFETY: the library is present (checked above), so resolving the symbol cannot
    // fail; cuInit may be called any number of times.
    let r = unsafe { sys::cuInit(0) };
    if r != SUCCESS {
        return Err(unavailable(format!(
            "the NVIDIA driver is installed but cuInit failed ({}): no usable GPU",
            result_text(r)
        )));
    }
    Ok(())
}

fn device_count() -> Result<usize, DeviceError> {
    let mut n = 0;
    // SAFETY: the driver is initialised (callers run `init_driver` first); writes one int.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

fn device_handle(ordinal: usize) -> Result<sys::CUdevice, DeviceError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(unavailable(if count == 0 {
            "the NVIDIA driver found no CUDA GPU".to_string()
        } else {
            format!("no CUDA GPU {ordinal}: the driver found {count}")
        }));
    }
    let mut dev = 0;
    // SAFETY: `ordinal < count`; writes one int.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal as i32)
    })?;
    Ok(dev)
}

fn device_name(dev: sys::CUdevice) -> Result<String, DeviceError> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the driver writes a NUL-terminated name of at most `len` bytes into `buf`.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev)
    })?;
    // SAFETY: NUL-terminated by the driver within the buffer (the last byte stays 0).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

fn device_attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32, DeviceError> {
    let mut v = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, dev)
    })?;
    Ok(v)
}

/// Whether a CUDA GPU can be used here; the name of GPU 0 if so. `--device auto` picks
/// `cuda` when this is `Ok`.
pub fn cuda_available() -> Result<String, DeviceError> {
    init_driver()?;
    let dev = device_handle(0)?;
    device_name(dev)
}

/// The retained primary context of one GPU.
struct Context {
    device: sys::CUdevice,
    raw: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be used from any thread (the driver API is
// thread-safe); each thread makes it current before use (`bind`).
unsafe impl Send for Context {}
// SAFETY: as above; `Context` has no interior state of its own.
unsafe impl Sync for Context {}

impl Context {
    fn retain(device: sys::CUdevice) -> Result<Arc<Context>, DeviceError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `device` is a valid device handle; writes the context handle.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw, device)
        })?;
        let ctx = Arc::new(Context { device, raw });
        ctx.bind()?;
        Ok(ctx)
    }

    /// Makes the context current on the calling thread.
    fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: `raw` is a retained context, alive while `self` is.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `Context::retain`; every other handle of this
        // context was destroyed first (each holds an `Arc<Context>`).
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

/// A stream, destroyed with its context current.
struct Stream {
    ctx: Arc<Context>,
    raw: sys::CUstream,
}

// SAFETY: stream handles may be used from any thread (the driver API is thread-safe);
// work enqueued from several threads is ordered by the lane lock that guards each use.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    fn new(ctx: &Arc<Context>) -> Result<Stream, DeviceError> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the context is current; writes the stream handle. Non-blocking: the
        // stream never waits for the legacy default stream.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream {
            ctx: ctx.clone(),
            raw,
        })
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        // SAFETY: a live stream of the current context (callers bind first).
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: the stream is ours; wait for its work, then destroy it.
            unsafe {
                let _ = sys::cuStreamSynchronize(self.raw);
                let _ = sys::cuStreamDestroy_v2(self.raw);
            }
        }
    }
}

/// A blocking-sync, timing-free event. Destroyed with its lane (which holds the context).
struct Event(sys::CUevent);

// SAFETY: event handles may be used from any thread; each use is by one thread at a time
// (the lane's free list or one queued copy owns it).
unsafe impl Send for Event {}

impl Event {
    fn new() -> Result<Event, DeviceError> {
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: callers have the context current; writes the event handle.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Event(raw))
    }

    /// Destroys the event; the caller has the context current.
    fn destroy(self) {
        // SAFETY: the event is ours and no longer recorded in flight.
        unsafe {
            let _ = sys::cuEventDestroy_v2(self.0);
        }
    }
}

/// One queued copy, on its way to the lane's completion thread.
struct Pending {
    id: TransferId,
    /// Recorded after the copy; `None` when the copy was refused (`result` says why).
    event: Option<Event>,
    result: Result<(), DeviceError>,
}

struct LaneState {
    /// To the completion thread; `None` once the device is dropping.
    queue: Option<mpsc::Sender<Pending>>,
    /// Events not in flight, for reuse.
    free_events: Vec<Event>,
    /// The stream the next copy goes to (round-robin).
    next_stream: usize,
}

/// One direction's streams, queue and event pool.
struct Lane {
    ctx: Arc<Context>,
    /// At least one; copies go round-robin, so consecutive copies can overlap.
    streams: Vec<Stream>,
    state: Mutex<LaneState>,
}

impl Lane {
    /// Waits for every copy enqueued so far. The context is current.
    fn synchronize(&self) {
        for s in &self.streams {
            let _ = s.synchronize();
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            self.synchronize();
            for e in lock(&self.state).free_events.drain(..) {
                e.destroy();
            }
        }
    }
}

/// The frames: physical chunks mapped into one reserved range.
struct Frames {
    ctx: Arc<Context>,
    base: sys::CUdeviceptr,
    /// Bytes of the reserved range: `handles.len() * chunk_bytes`.
    range_bytes: u64,
    chunk_bytes: u64,
    frames_per_chunk: u64,
    page_bytes: u64,
    frames: u32,
    /// One per chunk, in address order.
    handles: Vec<sys::CUmemGenericAllocationHandle>,
    /// How many of `handles` are mapped (all, once construction finished).
    mapped: usize,
}

// SAFETY: plain handles and numbers, immutable after construction; the driver API is
// thread-safe.
unsafe impl Send for Frames {}
// SAFETY: as above.
unsafe impl Sync for Frames {}

fn allocation_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn access_desc(device: sys::CUdevice) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// Free and total device memory of the current context's GPU.
fn mem_info() -> Result<(u64, u64), DeviceError> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: a context is current (callers bind); writes two sizes.
    check("cuMemGetInfo", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

impl Frames {
    fn new(ctx: &Arc<Context>, frames: u32, page_bytes: u64) -> Result<Frames, DeviceError> {
        ctx.bind()?;
        let prop = allocation_prop(ctx.device);
        let mut granularity = 0usize;
        // SAFETY: `prop` is a valid property struct; writes one size.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        let granularity = (granularity as u64).max(1);
        let chunk_bytes = page_bytes.div_ceil(granularity) * granularity;
        let frames_per_chunk = (chunk_bytes / page_bytes).max(1);
        let chunks = u64::from(frames).div_ceil(frames_per_chunk);
        let range_bytes = chunks * chunk_bytes;
        let mut out = Frames {
            ctx: ctx.clone(),
            base: 0,
            range_bytes,
            chunk_bytes,
            frames_per_chunk,
            page_bytes,
            frames,
            handles: Vec::with_capacity(chunks as usize),
            mapped: 0,
        };
        if chunks == 0 {
            return Ok(out);
        }
        let (free, _total) = mem_info()?;
        if range_bytes > free {
            return Err(DeviceError::OutOfMemory {
                what: "device",
                requested_bytes: range_bytes,
                available_bytes: free,
            });
        }
        // SAFETY: reserves address space only; `out`'s drop frees it on any later error.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(
                &mut out.base,
                range_bytes as usize,
                chunk_bytes as usize,
                0,
                0,
            )
        })?;
        for c in 0..chunks {
            let mut handle = 0;
            // SAFETY: `prop` is valid; on success we own the handle (kept in `handles`,
            // released in drop).
            let r = unsafe { sys::cuMemCreate(&mut handle, chunk_bytes as usize, &prop, 0) };
            if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(DeviceError::OutOfMemory {
                    what: "device",
                    requested_bytes: range_bytes,
                    available_bytes: free,
                });
            }
            check("cuMemCreate", r)?;
            out.handles.push(handle);
            // SAFETY: the chunk's place lies inside the reserved range and is unmapped.
            check("cuMemMap", unsafe {
                sys::cuMemMap(
                    out.base + c * chunk_bytes,
                    chunk_bytes as usize,
                    0,
                    handle,
                    0,
                )
            })?;
            out.mapped += 1;
        }
        let desc = access_desc(ctx.device);
        // SAFETY: the whole range is mapped (loop above).
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(out.base, range_bytes as usize, &desc, 1)
        })?;
        Ok(out)
    }

    /// Device address of `frame`. Panics on an id out of range (a caller bug).
    fn ptr(&self, frame: FrameId) -> u64 {
        assert!(
            frame.0 < self.frames,
            "frame {} of {}",
            frame.0,
            self.frames
        );
        let f = u64::from(frame.0);
        self.base
            + (f / self.frames_per_chunk) * self.chunk_bytes
            + (f % self.frames_per_chunk) * self.page_bytes
    }

    /// Whether a frame is a whole physical chunk, so it can be mapped into a buffer range.
    fn remappable(&self) -> bool {
        self.chunk_bytes == self.page_bytes
    }
}

impl Drop for Frames {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: we unmap only what we mapped, free the range we reserved and release
        // the handles we created; no copy or kernel is in flight (lanes and the sync
        // lane were drained before the frames drop).
        unsafe {
            for c in 0..self.mapped as u64 {
                let _ =
                    sys::cuMemUnmap(self.base + c * self.chunk_bytes, self.chunk_bytes as usize);
            }
            if self.base != 0 {
                let _ = sys::cuMemAddressFree(self.base, self.range_bytes as usize);
            }
            for &h in &self.handles {
                let _ = sys::cuMemRelease(h);
            }
        }
    }
}

/// The host slots: one pinned region, allocated by the driver, or memory made elsewhere
/// ([`HostMemory`], shared with the node daemon) registered as pinned.
struct HostSlots {
    ctx: Arc<Context>,
    ptr: *mut u8,
    slots: u32,
    page_bytes: u64,
    /// Set when the slots are registered memory of someone else's (unregistered in drop,
    /// not freed; the clone keeps it mapped until then).
    external: Option<HostMemory>,
}

// SAFETY: plain pinned memory; who touches which slot is governed by the pool's contract.
unsafe impl Send for HostSlots {}
// SAFETY: as above.
unsafe impl Sync for HostSlots {}

/// `MemAvailable` of /proc/meminfo in bytes, or 0 when unknown.
fn host_available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

impl HostSlots {
    /// `memory`, registered with the driver as pinned, as `slots` slots.
    fn register(
        ctx: &Arc<Context>,
        slots: u32,
        page_bytes: u64,
        memory: HostMemory,
    ) -> Result<HostSlots, DeviceError> {
        let bytes = u64::from(slots) * page_bytes;
        if memory.len() < bytes {
            return Err(DeviceError::OutOfMemory {
                what: "host",
                requested_bytes: bytes,
                available_bytes: memory.len(),
            });
        }
        let mut out = HostSlots {
            ctx: ctx.clone(),
            ptr: std::ptr::null_mut(),
            slots,
            page_bytes,
            external: None,
        };
        if bytes == 0 {
            return Ok(out);
        }
        ctx.bind()?;
        // SAFETY: the region is mapped, readable and writable for `bytes` and stays so
        // while `memory` lives (HostMemory's contract); the clone kept in `external`
        // outlives the registration, undone in drop.
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                memory.as_ptr().as_ptr().cast(),
                bytes as usize,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        check("cuMemHostRegister", r)?;
        out.ptr = memory.as_ptr().as_ptr();
        out.external = Some(memory);
        Ok(out)
    }

    fn new(ctx: &Arc<Context>, slots: u32, page_bytes: u64) -> Result<HostSlots, DeviceError> {
        let bytes = u64::from(slots) * page_bytes;
        let mut out = HostSlots {
            ctx: ctx.clone(),
            ptr: std::ptr::null_mut(),
            slots,
            page_bytes,
            external: None,
        };
        if bytes == 0 {
            return Ok(out);
        }
        let oom = || DeviceError::OutOfMemory {
            what: "host",
            requested_bytes: bytes,
            available_bytes: host_available_bytes(),
        };
        let size = usize::try_from(bytes).map_err(|_| oom())?;
        ctx.bind()?;
        let mut raw: *mut c_void = std::ptr::null_mut();
        // SAFETY: the context is current; on success the driver hands us `size` bytes of
        // pinned memory, freed in drop.
        let r = unsafe { sys::cuMemHostAlloc(&mut raw, size, sys::CU_MEMHOSTALLOC_PORTABLE) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(oom());
        }
        check("cuMemHostAlloc", r)?;
        out.ptr = raw.cast();
        // Pinned memory is locked, so already resident; touch each OS page anyway so the
        // first copies never pay for a fault whatever the driver did.
        for off in (0..size).step_by(OS_PAGE_BYTES) {
            // SAFETY: `off < size`, inside the allocation.
            unsafe { out.ptr.add(off).write_volatile(0) };
        }
        Ok(out)
    }

    /// Host address of `slot`. Panics on an id out of range (a caller bug).
    fn ptr(&self, slot: HostSlot) -> *mut u8 {
        assert!(slot.0 < self.slots, "slot {} of {}", slot.0, self.slots);
        // SAFETY: `slot < slots`, so the offset is inside the region.
        unsafe { self.ptr.add((u64::from(slot.0) * self.page_bytes) as usize) }
    }
}

impl Drop for HostSlots {
    fn drop(&mut self) {
        if !self.ptr.is_null() && self.ctx.bind().is_ok() {
            if self.external.is_some() {
                // SAFETY: registered in `register`; no copy is in flight (the lanes were
                // drained before the slots drop); `external` still keeps it mapped.
                unsafe {
                    let _ = sys::cuMemHostUnregister(self.ptr.cast());
                }
                return;
            }
            // SAFETY: allocated by cuMemHostAlloc in `new`; no copy is in flight (the
            // lanes were drained before the slots drop).
            unsafe {
                let _ = sys::cuMemFreeHost(self.ptr.cast());
            }
        }
    }
}

/// The sync lane: stream, kernels and the reduction's scratch word.
struct SyncLane {
    stream: Stream,
    module: sys::CUmodule,
    fill: sys::CUfunction,
    checksum: sys::CUfunction,
    compute: sys::CUfunction,
    /// 8 bytes of device memory the reductions add into.
    scratch_dev: sys::CUdeviceptr,
    /// 8 bytes of pinned host memory the result is copied back to.
    scratch_host: *mut u64,
}

// SAFETY: handles and pointers used only under the `Mutex<SyncLane>`.
unsafe impl Send for SyncLane {}

impl SyncLane {
    fn new(ctx: &Arc<Context>) -> Result<SyncLane, DeviceError> {
        let stream = Stream::new(ctx)?;
        let mut lane = SyncLane {
            stream,
            module: std::ptr::null_mut(),
            fill: std::ptr::null_mut(),
            checksum: std::ptr::null_mut(),
            compute: std::ptr::null_mut(),
            scratch_dev: 0,
            scratch_host: std::ptr::null_mut(),
        };
        lane.module = load_module()?;
        for (name, f) in [
            (c"spillway_fill", &mut lane.fill),
            (c"spillway_checksum", &mut lane.checksum),
            (c"spillway_compute", &mut lane.compute),
        ] {
            // SAFETY: the module is loaded; `name` is NUL-terminated; writes the handle.
            check("cuModuleGetFunction", unsafe {
                sys::cuModuleGetFunction(f, lane.module, name.as_ptr())
            })?;
        }
        // SAFETY: the context is current (Stream::new bound it); writes the pointer.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut lane.scratch_dev, 8)
        })?;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: as above; 8 bytes of pinned memory, freed in drop.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut host, 8, 0)
        })?;
        lane.scratch_host = host.cast();
        Ok(lane)
    }

    /// Launches `f` over `words` words with `params` and waits for it.
    fn launch(
        &self,
        f: sys::CUfunction,
        words: u64,
        sm_count: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), DeviceError> {
        let blocks = words
            .div_ceil(u64::from(BLOCK_THREADS))
            .clamp(1, u64::from(sm_count.max(1) * BLOCKS_PER_SM)) as u32;
        // SAFETY: `f` is a kernel of our module; `params` holds one pointer per kernel
        // parameter, to values of the declared types, alive for the call (the driver
        // copies them at launch).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f,
                blocks,
                1,
                1,
                BLOCK_THREADS,
                1,
                1,
                0,
                self.stream.raw,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Zeroes the scratch word, runs a reduction kernel, returns the word.
    fn reduce(
        &self,
        f: sys::CUfunction,
        words: u64,
        sm_count: u32,
        params: &mut [*mut c_void],
    ) -> Result<u64, DeviceError> {
        // SAFETY: the scratch word is ours and only this (locked) lane uses it.
        check("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(self.scratch_dev, 0, 2, self.stream.raw)
        })?;
        self.launch(f, words, sm_count, params)?;
        // SAFETY: copies 8 bytes into our pinned scratch, which outlives the copy (we
        // synchronise right after).
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                self.scratch_host.cast(),
                self.scratch_dev,
                8,
                self.stream.raw,
            )
        })?;
        self.stream.synchronize()?;
        // SAFETY: the copy above finished; the pointer is valid pinned memory.
        Ok(unsafe { self.scratch_host.read_volatile() })
    }
}

impl Drop for SyncLane {
    fn drop(&mut self) {
        if self.stream.ctx.bind().is_err() {
            return;
        }
        let _ = self.stream.synchronize();
        // SAFETY: each handle was created in `new` (or is null/0 and skipped) and no
        // work uses it any more (stream synchronised).
        unsafe {
            if !self.scratch_host.is_null() {
                let _ = sys::cuMemFreeHost(self.scratch_host.cast());
            }
            if self.scratch_dev != 0 {
                let _ = sys::cuMemFree_v2(self.scratch_dev);
            }
            if !self.module.is_null() {
                let _ = sys::cuModuleUnload(self.module);
            }
        }
    }
}

/// Loads the PTX module, with the JIT's error log in the error if it fails.
fn load_module() -> Result<sys::CUmodule, DeviceError> {
    let mut module = std::ptr::null_mut();
    let mut log = vec![0u8; 16 << 10];
    let mut options = [
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
    // SAFETY: the image is NUL-terminated PTX; the options point at a buffer of the size
    // given, alive for the call (the size option is passed by value in the pointer, as
    // the driver API specifies).
    let r = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            KERNELS_PTX.as_ptr().cast(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    if r != SUCCESS {
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        return Err(DeviceError::Driver {
            op: "cuModuleLoadData (kernels.ptx)",
            message: format!(
                "{}; JIT log: {}",
                result_text(r),
                String::from_utf8_lossy(&log[..end])
            ),
        });
    }
    Ok(module)
}

/// A buffer's reserved range and which frame is mapped at each page.
struct BufferRange {
    base: sys::CUdeviceptr,
    mapped: Vec<Option<FrameId>>,
}

/// Every buffer's range; unmapped and freed on drop.
struct Ranges {
    ctx: Arc<Context>,
    page_bytes: u64,
    map: Mutex<HashMap<BufferId, BufferRange>>,
}

// SAFETY: device addresses (integers) behind a mutex.
unsafe impl Send for Ranges {}
// SAFETY: as above.
unsafe impl Sync for Ranges {}

impl Ranges {
    /// Unmaps page `index` of `range` if mapped. The context is current.
    fn unmap(&self, range: &mut BufferRange, index: usize) -> Result<(), DeviceError> {
        if range.mapped[index].take().is_some() {
            // SAFETY: exactly the page we mapped in `map_page`; by the pool's contract no
            // kernel or copy uses the buffer's range while its pages change.
            check("cuMemUnmap", unsafe {
                sys::cuMemUnmap(
                    range.base + index as u64 * self.page_bytes,
                    self.page_bytes as usize,
                )
            })?;
        }
        Ok(())
    }

    fn release(&self, mut range: BufferRange) -> Result<(), DeviceError> {
        for i in 0..range.mapped.len() {
            self.unmap(&mut range, i)?;
        }
        // SAFETY: the range we reserved, now with nothing mapped in it.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(
                range.base,
                (range.mapped.len() as u64 * self.page_bytes) as usize,
            )
        })
    }
}

impl Drop for Ranges {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        let ranges: Vec<BufferRange> = lock(&self.map).drain().map(|(_, r)| r).collect();
        for r in ranges {
            let _ = self.release(r);
        }
    }
}

/// An NVIDIA GPU as a Spillway device. See the module docs.
pub struct CudaDevice {
    config: DeviceConfig,
    name: String,
    ordinal: usize,
    sm_count: u32,
    // Drop order is field order: lanes (drain copies), sync lane, ranges, frames, host
    // slots, and the context last (every part also holds an `Arc` of it).
    fences: FenceLane,
    lanes: [Arc<Lane>; 2],
    threads: Vec<JoinHandle<()>>,
    sync: Mutex<SyncLane>,
    mapper: Mapper,
    ranges: Arc<Ranges>,
    frames: Frames,
    host: HostSlots,
    ctx: Arc<Context>,
}

fn lane_index(direction: Direction) -> usize {
    match direction {
        Direction::HostToDevice => 0,
        Direction::DeviceToHost => 1,
    }
}

impl CudaDevice {
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
        let mapper = Mapper::new(
            &ctx,
            ranges.clone(),
            if frames.remappable() {
                frames.handles.clone()
            } else {
                Vec::new()
            },
            config.page_bytes,
        )?;

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
            mapper,
            lanes,
            threads: Vec::new(),
            sync: Mutex::new(sync),
            ranges,
            frames,
            host,
            ctx,
        };
        for (i, rx) in [h2d_rx, d2h_rx].into_iter().enumerate() {
            let lane = device.lanes[i].clone();
            let ctx = device.ctx.clone();
            let sink = sink.clone();
            let name = ["spillway-cuda-h2d", "spillway-cuda-d2h"][i];
            let handle = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || completion_loop(&ctx, &lane, &rx, &sink))
                .map_err(|e| DeviceError::Driver {
                    op: "spawn completion thread",
                    message: e.to_string(),
                })?;
            device.threads.push(handle);
        }
        Ok(device)
    }

    /// The compute stream: the stream the caller's kernels (GEMMs) should run on, so that
    /// releases are fenced behind them ([`Device::after_queued_work`]).
    pub fn compute_stream(&self) -> sys::CUstream {
        self.fences.stream.raw
    }

    /// Mappings into buffer ranges that changed something, and seconds the driver took for
    /// them (the cost of remapping pages, paid on the mapper thread).
    pub fn mapping_stats(&self) -> (u64, f64) {
        *lock(&self.mapper.shared.stats)
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

    /// Enqueues `op` on its lane's stream and records its event (lane lock held).
    fn enqueue(
        &self,
        lane: &Lane,
        state: &mut LaneState,
        op: &CopyOp,
    ) -> Result<Event, DeviceError> {
        check_range(0, op.bytes, self.config.page_bytes)?;
        let frame = self.frames.ptr(op.frame);
        let slot = self.host.ptr(op.slot);
        self.ctx.bind()?;
        let event = match state.free_events.pop() {
            Some(e) => e,
            None => Event::new()?,
        };
        let stream = lane.streams[state.next_stream].raw;
        state.next_stream = (state.next_stream + 1) % lane.streams.len();
        let copied = if op.bytes == 0 {
            Ok(())
        } else {
            // SAFETY: both ranges lie inside their regions (checked above); the slot is
            // pinned, so the copy is truly asynchronous, and by the pool's contract
            // nobody touches the frame or the slot until the completion arrives.
            check("cuMemcpyAsync", unsafe {
                match op.direction {
                    Direction::HostToDevice => sys::cuMemcpyHtoDAsync_v2(
                        frame,
                        slot.cast_const().cast(),
                        op.bytes as usize,
                        stream,
                    ),
                    Direction::DeviceToHost => {
                        sys::cuMemcpyDtoHAsync_v2(slot.cast(), frame, op.bytes as usize, stream)
                    }
                }
            })
        };
        // SAFETY: a live event and stream of the current context.
        let recorded = copied.and_then(|()| {
            check("cuEventRecord", unsafe {
                sys::cuEventRecord(event.0, stream)
            })
        });
        match recorded {
            Ok(()) => Ok(event),
            Err(e) => {
                state.free_events.push(event);
                Err(e)
            }
        }
    }

    /// Runs `f` on the sync lane with the context current.
    fn with_sync<T>(
        &self,
        f: impl FnOnce(&SyncLane) -> Result<T, DeviceError>,
    ) -> Result<T, DeviceError> {
        let lane = lock(&self.sync);
        self.ctx.bind()?;
        f(&lane)
    }

    /// Synchronous copy host -> device address `dst` (inside memory we own).
    fn copy_to_device(&self, dst: u64, data: &[u8]) -> Result<(), DeviceError> {
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
    fn copy_from_device(&self, src: u64, out: &mut [u8]) -> Result<(), DeviceError> {
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

    fn checksum_at(&self, ptr: u64, len: u64) -> Result<u64, DeviceError> {
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
        let map = lock(&self.ranges.map);
        let range = map.get(&buffer).ok_or_else(|| DeviceError::Driver {
            op: "read buffer range",
            message: format!("{buffer} has no reserved range"),
        })?;
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
    /// [`Device::reserve_range`]) to `out`, through the range's own addresses. Every page
    /// touched must be mapped. For tests and tools: shows the range is one contiguous view.
    pub fn read_range(
        &self,
        buffer: BufferId,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.mapper.flush()?;
        let base = self.mapped_span(buffer, offset, out.len() as u64)?;
        self.copy_from_device(base + offset, out)
    }

    /// [`spillway_types::pattern::checksum`] of the first `len` bytes of `buffer`'s range,
    /// computed by one kernel over the range's contiguous addresses. Every page touched
    /// must be mapped.
    pub fn checksum_range(&self, buffer: BufferId, len: u64) -> Result<u64, DeviceError> {
        self.mapper.flush()?;
        let base = self.mapped_span(buffer, 0, len)?;
        self.checksum_at(base, len)
    }
}

/// A lane's completion thread: waits for each queued copy's event in order, then
/// reports it. Ends when the device drops its sender and the queue is empty.
fn completion_loop(
    ctx: &Context,
    lane: &Lane,
    rx: &mpsc::Receiver<Pending>,
    sink: &CompletionSink,
) {
    let bound = ctx.bind().err().map(|e| e.to_string());
    while let Ok(p) = rx.recv() {
        let result = match (p.event, &bound) {
            (None, _) => p.result,
            (Some(event), None) => {
                // SAFETY: the event was recorded after the copy on the lane's stream and
                // stays alive until we return it to the free list below.
                let r = check("cuEventSynchronize", unsafe {
                    sys::cuEventSynchronize(event.0)
                });
                lock(&lane.state).free_events.push(event);
                r
            }
            (Some(event), Some(message)) => {
                lock(&lane.state).free_events.push(event);
                Err(DeviceError::Driver {
                    op: "cuCtxSetCurrent (completion thread)",
                    message: message.clone(),
                })
            }
        };
        sink(Completion { id: p.id, result });
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Fences first: their `done` may call back into the pool.
        self.fences.shutdown();
        self.mapper.shutdown();
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

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn describe(&self) -> String {
        format!(
            "{} (cuda:{}, {} SMs, {} MiB physical chunks)",
            self.name,
            self.ordinal,
            self.sm_count,
            self.frames.chunk_bytes >> 20
        )
    }

    fn config(&self) -> DeviceConfig {
        self.config
    }

    fn submit(&self, op: CopyOp) {
        let lane = &self.lanes[lane_index(op.direction)];
        let mut state = lock(&lane.state);
        let pending = match self.enqueue(lane, &mut state, &op) {
            Ok(event) => Pending {
                id: op.id,
                event: Some(event),
                result: Ok(()),
            },
            Err(e) => Pending {
                id: op.id,
                event: None,
                result: Err(e),
            },
        };
        state
            .queue
            .as_ref()
            .expect("queues live until drop")
            .send(pending)
            .expect("completion thread lives until drop");
    }

    fn write_host(&self, slot: HostSlot, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        check_range(offset, data.len() as u64, self.config.page_bytes)?;
        // SAFETY: inside the slot (checked); the caller holds the slot (pool contract).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.host.ptr(slot).add(offset as usize),
                data.len(),
            )
        };
        Ok(())
    }

    fn read_host(&self, slot: HostSlot, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        check_range(offset, out.len() as u64, self.config.page_bytes)?;
        // SAFETY: as in `write_host`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.host.ptr(slot).add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    fn write_frame(&self, frame: FrameId, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        check_range(offset, data.len() as u64, self.config.page_bytes)?;
        self.copy_to_device(self.frames.ptr(frame) + offset, data)
    }

    fn read_frame(&self, frame: FrameId, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        check_range(offset, out.len() as u64, self.config.page_bytes)?;
        self.copy_from_device(self.frames.ptr(frame) + offset, out)
    }

    fn frame_ptr(&self, frame: FrameId) -> DevicePtr {
        DevicePtr(self.frames.ptr(frame))
    }

    fn host_view(&self, _frame: FrameId) -> Option<NonNull<u8>> {
        None
    }

    /// Reserves `round_up(bytes, page)` of address space, page-aligned. `Ok(None)` when a
    /// page is smaller than the allocation granularity (frames share physical chunks and
    /// cannot be mapped one by one). A buffer has at most one range.
    fn reserve_range(
        &self,
        buffer: BufferId,
        bytes: u64,
    ) -> Result<Option<DevicePtr>, DeviceError> {
        if !self.frames.remappable() {
            return Ok(None);
        }
        let page = self.config.page_bytes;
        let pages = bytes.div_ceil(page).max(1);
        let mut map = lock(&self.ranges.map);
        if map.contains_key(&buffer) {
            return Err(DeviceError::Driver {
                op: "reserve_range",
                message: format!("{buffer} already has a range"),
            });
        }
        self.ctx.bind()?;
        let mut base = 0;
        // SAFETY: reserves address space only; freed in `release_range` or on drop.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, (pages * page) as usize, page as usize, 0, 0)
        })?;
        map.insert(
            buffer,
            BufferRange {
                base,
                mapped: vec![None; pages as usize],
            },
        );
        Ok(Some(DevicePtr(base)))
    }

    /// Maps `frame`'s physical chunk at page `index` of the buffer's range (replacing
    /// whatever was mapped there). The buffer must have a range.
    fn map_page(&self, buffer: BufferId, index: u32, frame: FrameId) -> Result<(), DeviceError> {
        if !self.frames.remappable() {
            return Err(DeviceError::Driver {
                op: "map_page",
                message: "pages smaller than the allocation granularity cannot be mapped \
                          one by one (reserve_range returned None)"
                    .into(),
            });
        }
        // Validates the frame id (panics on a caller bug, as everywhere).
        let _ = self.frames.ptr(frame);
        {
            let map = lock(&self.ranges.map);
            let range = map.get(&buffer).ok_or_else(|| DeviceError::Driver {
                op: "map_page",
                message: format!("{buffer} has no reserved range"),
            })?;
            if index as usize >= range.mapped.len() {
                return Err(DeviceError::Driver {
                    op: "map_page",
                    message: format!(
                        "page {index} is outside {buffer}'s range of {} pages",
                        range.mapped.len()
                    ),
                });
            }
        }
        self.mapper.enqueue(buffer, index, frame)
    }

    fn flush_mappings(&self) -> Result<(), DeviceError> {
        self.mapper.flush()
    }

    /// Lazy: the page's mapping stays until the page is mapped again (into another frame
    /// or the same one, which then costs nothing) or the range is released. A page that
    /// is not resident is never read through its range (guards exist only for resident
    /// pages), so a stale mapping is never observed, and it is still valid memory.
    fn unmap_page(&self, _buffer: BufferId, _index: u32) -> Result<(), DeviceError> {
        Ok(())
    }

    /// Unmaps every page of the buffer's range and frees it; no-op without a range.
    fn release_range(&self, buffer: BufferId) -> Result<(), DeviceError> {
        // Mappings queued for this buffer must land (or fail) before its range goes.
        let flushed = self.mapper.flush();
        let Some(range) = lock(&self.ranges.map).remove(&buffer) else {
            return Ok(());
        };
        self.ctx.bind()?;
        self.ranges.release(range)?;
        flushed
    }

    fn fill_pattern(&self, frame: FrameId, len: u64, seed: u64) -> Result<(), DeviceError> {
        check_range(0, len, self.config.page_bytes)?;
        if len == 0 {
            return Ok(());
        }
        let (mut p, mut l, mut s, sms) = (self.frames.ptr(frame), len, seed, self.sm_count);
        self.with_sync(|lane| {
            let mut params: [*mut c_void; 3] = [
                (&raw mut p).cast(),
                (&raw mut l).cast(),
                (&raw mut s).cast(),
            ];
            lane.launch(lane.fill, len.div_ceil(8), sms, &mut params)?;
            lane.stream.synchronize()
        })
    }

    fn checksum(&self, frame: FrameId, len: u64) -> Result<u64, DeviceError> {
        check_range(0, len, self.config.page_bytes)?;
        self.checksum_at(self.frames.ptr(frame), len)
    }

    fn compute(&self, frame: FrameId, len: u64, passes: u32) -> Result<u64, DeviceError> {
        check_range(0, len, self.config.page_bytes)?;
        if len == 0 {
            return Ok(0);
        }
        let (mut p, mut l, mut n, sms) = (self.frames.ptr(frame), len, passes, self.sm_count);
        self.with_sync(|lane| {
            let mut out = lane.scratch_dev;
            let mut params: [*mut c_void; 4] = [
                (&raw mut p).cast(),
                (&raw mut l).cast(),
                (&raw mut n).cast(),
                (&raw mut out).cast(),
            ];
            lane.reduce(lane.compute, len.div_ceil(8), sms, &mut params)
        })
        .map(|sum| sum ^ len)
    }

    fn bandwidth_hint_bytes_per_s(&self, _direction: Direction) -> f64 {
        BANDWIDTH_HINT_BYTES_PER_S
    }

    fn after_queued_work(&self, done: Box<dyn FnOnce() + Send>) {
        if let Err((e, done)) = self.fences.enqueue(done) {
            // No event could be recorded: wait for the stream here instead, so the
            // release still comes after the work.
            tracing::warn!(error = %e, "fence event failed; synchronizing the compute stream");
            let _ = self
                .ctx
                .bind()
                .and_then(|()| self.fences.stream.synchronize());
            done();
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Maps frames into buffer ranges on a thread of its own, in submission order.
///
/// `cuMemMap` + `cuMemSetAccess` cost tens of microseconds per page; done inline they
/// would hold the pool's lock (or a completion thread) that long for every page loaded.
/// The pool queues a mapping when it starts a page's load and waits for the queue
/// ([`Device::flush_mappings`]) only before handing out a guard, by which time the
/// mapping has almost always landed. A mapping that is already in place costs nothing.
struct Mapper {
    queue: Mutex<Option<mpsc::Sender<(BufferId, u32, FrameId)>>>,
    shared: Arc<MapperShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct MapperShared {
    /// (mappings queued, mappings done, first error).
    progress: Mutex<(u64, u64, Option<String>)>,
    cond: std::sync::Condvar,
    /// Mappings that changed something, and seconds spent in the driver on them.
    stats: Mutex<(u64, f64)>,
}

impl Mapper {
    fn new(
        ctx: &Arc<Context>,
        ranges: Arc<Ranges>,
        handles: Vec<sys::CUmemGenericAllocationHandle>,
        page_bytes: u64,
    ) -> Result<Mapper, DeviceError> {
        let shared = Arc::new(MapperShared {
            progress: Mutex::new((0, 0, None)),
            cond: std::sync::Condvar::new(),
            stats: Mutex::new((0, 0.0)),
        });
        let (tx, rx) = mpsc::channel::<(BufferId, u32, FrameId)>();
        let (ctx, thread_shared) = (ctx.clone(), shared.clone());
        let handle = std::thread::Builder::new()
            .name("spillway-cuda-map".into())
            .spawn(move || {
                let bound = ctx.bind().map_err(|e| e.to_string());
                while let Ok((buffer, index, frame)) = rx.recv() {
                    let started = Instant::now();
                    let result = match &bound {
                        Ok(()) => {
                            map_now(&ctx, &ranges, &handles, page_bytes, buffer, index, frame)
                        }
                        Err(m) => Err(DeviceError::Driver {
                            op: "cuCtxSetCurrent (mapper thread)",
                            message: m.clone(),
                        }),
                    };
                    let changed = matches!(result, Ok(true));
                    if changed {
                        let mut st = lock(&thread_shared.stats);
                        st.0 += 1;
                        st.1 += started.elapsed().as_secs_f64();
                    }
                    let mut p = lock(&thread_shared.progress);
                    p.1 += 1;
                    if let Err(e) = result {
                        tracing::error!(error = %e, %buffer, index, "mapping a page failed");
                        p.2.get_or_insert(e.to_string());
                    }
                    drop(p);
                    thread_shared.cond.notify_all();
                }
            })
            .map_err(|e| DeviceError::Driver {
                op: "spawn mapper thread",
                message: e.to_string(),
            })?;
        Ok(Mapper {
            queue: Mutex::new(Some(tx)),
            shared,
            thread: Mutex::new(Some(handle)),
        })
    }

    fn enqueue(&self, buffer: BufferId, index: u32, frame: FrameId) -> Result<(), DeviceError> {
        let queue = lock(&self.queue);
        let q = queue.as_ref().ok_or_else(|| DeviceError::Driver {
            op: "map_page",
            message: "the device is shutting down".into(),
        })?;
        lock(&self.shared.progress).0 += 1;
        q.send((buffer, index, frame))
            .map_err(|_| DeviceError::Driver {
                op: "map_page",
                message: "the mapper thread has stopped".into(),
            })
    }

    /// Waits until every mapping queued before this call is done; the first error, if any.
    fn flush(&self) -> Result<(), DeviceError> {
        let mut p = lock(&self.shared.progress);
        let target = p.0;
        while p.1 < target {
            p = self
                .shared
                .cond
                .wait(p)
                .unwrap_or_else(PoisonError::into_inner);
        }
        match &p.2 {
            Some(e) => Err(DeviceError::Driver {
                op: "map_page",
                message: e.clone(),
            }),
            None => Ok(()),
        }
    }

    fn shutdown(&self) {
        lock(&self.queue).take();
        if let Some(t) = lock(&self.thread).take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

/// Maps `frame`'s chunk at page `index` of `buffer`'s range unless it is already there;
/// returns whether anything changed. The context is current.
fn map_now(
    ctx: &Context,
    ranges: &Ranges,
    handles: &[sys::CUmemGenericAllocationHandle],
    page: u64,
    buffer: BufferId,
    index: u32,
    frame: FrameId,
) -> Result<bool, DeviceError> {
    let mut map = lock(&ranges.map);
    // A buffer freed since the mapping was queued has no range any more: nothing to do.
    let Some(range) = map.get_mut(&buffer) else {
        return Ok(false);
    };
    let i = index as usize;
    if range.mapped[i] == Some(frame) {
        return Ok(false);
    }
    ranges.unmap(range, i)?;
    let handle = handles[frame.0 as usize];
    let va = range.base + u64::from(index) * page;
    let desc = access_desc(ctx.device);
    // SAFETY: `va..va+page` lies in the buffer's reserved range and is unmapped (just
    // above); `handle` is a live chunk of exactly `page` bytes (remappable frames).
    check("cuMemMap", unsafe {
        sys::cuMemMap(va, page as usize, 0, handle, 0)
    })?;
    // SAFETY: the page was just mapped.
    let access = check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(va, page as usize, &desc, 1)
    });
    if let Err(e) = access {
        // SAFETY: undo the mapping made above.
        unsafe {
            let _ = sys::cuMemUnmap(va, page as usize);
        }
        return Err(e);
    }
    range.mapped[i] = Some(frame);
    Ok(true)
}

/// Work to run once the compute stream passes an event.
struct Fence {
    event: Event,
    done: Box<dyn FnOnce() + Send>,
}

/// The compute stream (where the caller's kernels run) and the thread that runs each
/// fence's `done` once the stream has passed it.
struct FenceLane {
    stream: Stream,
    queue: Mutex<Option<mpsc::Sender<Fence>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl FenceLane {
    fn new(ctx: &Arc<Context>) -> Result<FenceLane, DeviceError> {
        let stream = Stream::new(ctx)?;
        let (tx, rx) = mpsc::channel::<Fence>();
        let thread_ctx = ctx.clone();
        let handle = std::thread::Builder::new()
            .name("spillway-cuda-fence".into())
            .spawn(move || {
                let bound = thread_ctx.bind();
                while let Ok(f) = rx.recv() {
                    if bound.is_ok() {
                        // SAFETY: the event was recorded on the compute stream and is ours.
                        let _ = unsafe { sys::cuEventSynchronize(f.event.0) };
                    }
                    f.event.destroy();
                    (f.done)();
                }
            })
            .map_err(|e| DeviceError::Driver {
                op: "spawn fence thread",
                message: e.to_string(),
            })?;
        Ok(FenceLane {
            stream,
            queue: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(handle)),
        })
    }

    /// Records an event on the compute stream and queues `done` behind it.
    #[allow(clippy::type_complexity)]
    fn enqueue(
        &self,
        done: Box<dyn FnOnce() + Send>,
    ) -> Result<(), (DeviceError, Box<dyn FnOnce() + Send>)> {
        if let Err(e) = self.stream.ctx.bind() {
            return Err((e, done));
        }
        let event = match Event::new() {
            Ok(e) => e,
            Err(e) => return Err((e, done)),
        };
        // SAFETY: a live event and stream of the current context.
        if let Err(e) = check("cuEventRecord", unsafe {
            sys::cuEventRecord(event.0, self.stream.raw)
        }) {
            event.destroy();
            return Err((e, done));
        }
        match lock(&self.queue).as_ref() {
            Some(q) => q.send(Fence { event, done }).map_err(|e| {
                let f = e.0;
                f.event.destroy();
                (
                    DeviceError::Driver {
                        op: "fence queue",
                        message: "the fence thread has stopped".into(),
                    },
                    f.done,
                )
            }),
            None => {
                event.destroy();
                Err((
                    DeviceError::Driver {
                        op: "fence queue",
                        message: "the device is shutting down".into(),
                    },
                    done,
                ))
            }
        }
    }

    /// Runs every queued fence, then stops the thread (unless called from it).
    fn shutdown(&self) {
        lock(&self.queue).take();
        if let Some(t) = lock(&self.thread).take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
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

/// The value [`Device::compute`] returns on this backend, computed on the CPU (see the
/// module docs, "Kernels").
pub fn compute_reference(data: &[u8], passes: u32) -> u64 {
    let mut sum = 0u64;
    for (i, chunk) in data.chunks(8).enumerate() {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let mut x = w ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        for p in 0..passes {
            x = x
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(w.wrapping_add(u64::from(p)))
                .rotate_left(17);
        }
        sum = sum.wrapping_add(x);
    }
    sum ^ data.len() as u64
}

/// Raw pinned-memory copy bandwidth, the ceiling the copy lanes are measured against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawCopyBandwidth {
    /// Bytes of each `cuMemcpyAsync`.
    pub block_bytes: u64,
    /// Host to device alone.
    pub h2d_bytes_per_s: f64,
    /// Device to host alone.
    pub d2h_bytes_per_s: f64,
    /// Both at once, two streams: bytes of both directions over the wall time.
    pub both_bytes_per_s: f64,
}

/// How [`raw_pinned_bandwidth_with`] copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawCopyOptions {
    /// Bytes of each `cuMemcpyAsync`.
    pub block_bytes: u64,
    /// Copies per direction per measurement.
    pub blocks: u32,
    /// Bytes of host and of device memory per direction that successive copies walk
    /// through (rounded up to a whole block); one block reuses the same memory.
    pub region_bytes: u64,
    /// Record an event after every copy, as the copy lanes do.
    pub event_per_copy: bool,
}

/// Measures `cuMemcpyAsync` between pinned host memory and plain device memory
/// (`cuMemAlloc`) on GPU `ordinal`: `blocks` copies of `block_bytes` per direction, one
/// direction alone, then both at once on two streams. Allocates `2 * block_bytes` on
/// each side. Wall-clock timing from the first enqueue to the stream syncs.
pub fn raw_pinned_bandwidth(
    ordinal: usize,
    block_bytes: u64,
    blocks: u32,
) -> Result<RawCopyBandwidth, DeviceError> {
    raw_pinned_bandwidth_with(
        ordinal,
        RawCopyOptions {
            block_bytes,
            blocks,
            region_bytes: block_bytes,
            event_per_copy: false,
        },
    )
}

/// [`raw_pinned_bandwidth`] with the options spelled out: how much memory successive
/// copies walk through, and whether each copy is followed by an event record. Allocates
/// `2 * region_bytes` of pinned host and of device memory.
pub fn raw_pinned_bandwidth_with(
    ordinal: usize,
    options: RawCopyOptions,
) -> Result<RawCopyBandwidth, DeviceError> {
    let RawCopyOptions {
        block_bytes,
        blocks,
        region_bytes,
        event_per_copy,
    } = options;
    let region_blocks = region_bytes.div_ceil(block_bytes).max(1);
    let region = region_blocks * block_bytes;
    init_driver()?;
    let ctx = Context::retain(device_handle(ordinal)?)?;
    let streams = [Stream::new(&ctx)?, Stream::new(&ctx)?];
    let host = HostSlots::new(&ctx, 2, region)?;
    let events = [Event::new()?, Event::new()?];
    let mut dev = [0u64; 2];
    let result = (|| {
        for d in &mut dev {
            // SAFETY: the context is current; writes the pointer.
            check("cuMemAlloc", unsafe {
                sys::cuMemAlloc_v2(d, region as usize)
            })?;
        }
        // Copy `k` of direction `dir` (0 = H2D, 1 = D2H) on stream `dir`, buffer `dir`.
        let enqueue = |dir: usize, k: u64| -> Result<(), DeviceError> {
            let off = (k % region_blocks) * block_bytes;
            // SAFETY: `off + block_bytes <= region` on both sides; the memory is alive
            // until the syncs below.
            let h = unsafe { host.ptr(HostSlot(dir as u32)).add(off as usize) };
            let size = block_bytes as usize;
            let stream = streams[dir].raw;
            // SAFETY: as above; the events are ours and alive.
            check("cuMemcpyAsync", unsafe {
                if dir == 0 {
                    sys::cuMemcpyHtoDAsync_v2(dev[0] + off, h.cast_const().cast(), size, stream)
                } else {
                    sys::cuMemcpyDtoHAsync_v2(h.cast(), dev[1] + off, size, stream)
                }
            })?;
            if event_per_copy {
                // SAFETY: a live event and stream of the current context.
                check("cuEventRecord", unsafe {
                    sys::cuEventRecord(events[dir].0, stream)
                })?;
            }
            Ok(())
        };
        let run = |dirs: &[usize]| -> Result<f64, DeviceError> {
            for &d in dirs {
                for k in 0..region_blocks {
                    enqueue(d, k)?; // warm-up: touch the whole region once
                }
                streams[d].synchronize()?;
            }
            let start = Instant::now();
            for k in 0..u64::from(blocks) {
                for &d in dirs {
                    enqueue(d, k)?;
                }
            }
            for &d in dirs {
                streams[d].synchronize()?;
            }
            let bytes = block_bytes as f64 * f64::from(blocks) * dirs.len() as f64;
            Ok(bytes / start.elapsed().as_secs_f64())
        };
        Ok(RawCopyBandwidth {
            block_bytes,
            h2d_bytes_per_s: run(&[0])?,
            d2h_bytes_per_s: run(&[1])?,
            both_bytes_per_s: run(&[0, 1])?,
        })
    })();
    for s in &streams {
        let _ = s.synchronize();
    }
    for e in events {
        e.destroy();
    }
    for d in dev {
        if d != 0 {
            // SAFETY: allocated above with cuMemAlloc; the streams are synchronised.
            unsafe {
                let _ = sys::cuMemFree_v2(d);
            }
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_types::pattern;

    fn no_gpu_here() -> bool {
        // SAFETY: see `init_driver`.
        !unsafe { sys::is_culib_present() }
    }

    #[test]
    fn without_a_driver_cuda_is_unavailable_with_a_reason() {
        if !no_gpu_here() {
            eprintln!("skipped: libcuda is present on this machine");
            return;
        }
        match cuda_available() {
            Err(DeviceError::Unavailable { backend, reason }) => {
                assert_eq!(backend, "cuda");
                assert!(reason.contains("libcuda"), "{reason}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
        let sink: CompletionSink = Arc::new(|_| {});
        let config = DeviceConfig {
            frames: 4,
            host_slots: 4,
            page_bytes: 2 << 20,
        };
        assert!(matches!(
            CudaDevice::new(config, sink, 0),
            Err(DeviceError::Unavailable { .. })
        ));
        assert!(matches!(
            raw_pinned_bandwidth(0, 1 << 20, 1),
            Err(DeviceError::Unavailable { .. })
        ));
    }

    #[test]
    fn compute_reference_depends_on_every_byte_and_on_passes() {
        let mut data = vec![0u8; 4099];
        pattern::fill(3, &mut data);
        let base = compute_reference(&data, 3);
        assert_ne!(compute_reference(&data, 2), base);
        for i in [0, 7, 8, 2048, 4095, 4096, 4098] {
            data[i] ^= 0x01;
            assert_ne!(compute_reference(&data, 3), base, "byte {i}");
            data[i] ^= 0x01;
        }
        assert_eq!(compute_reference(&data, 3), base);
        assert_eq!(compute_reference(&[], 5), 0);
    }

    #[test]
    fn compute_reference_with_no_passes_is_a_mixed_sum() {
        let data = [1u8, 0, 0, 0, 0, 0, 0, 0, 2];
        let expected = 1u64.wrapping_add(2 ^ 0xD6E8_FEB8_6659_FD93) ^ 9;
        assert_eq!(compute_reference(&data, 0), expected);
    }

    #[test]
    fn kernels_ptx_names_every_entry_point_and_is_terminated() {
        for entry in ["spillway_fill", "spillway_checksum", "spillway_compute"] {
            assert!(KERNELS_PTX.contains(&format!(".entry {entry}(")), "{entry}");
        }
        assert!(KERNELS_PTX.ends_with('\0'));
        assert_eq!(KERNELS_PTX.matches('\0').count(), 1);
    }
}
