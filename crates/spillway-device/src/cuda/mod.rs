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
//!   range, so [`Device::frame_ptr`](crate::Device::frame_ptr) is stable for the device's life. When a page is
//!   smaller than the granularity one chunk holds `chunk_bytes / page_bytes` frames.
//! - **Views of acquired buffers** (`mapper`): a kernel needs an acquired buffer as one
//!   array. When a chunk is a whole number of pages the frames are one contiguous address
//!   range, and the pool puts a buffer's pages in consecutive frames (extents), so
//!   [`Device::acquire_ptr`](crate::Device::acquire_ptr) returns the first frame's address: no mapping at all.
//!   Only when an acquire's frames are not consecutive does it use the buffer's range:
//!   when each frame is exactly one chunk (`page_bytes` a multiple of the granularity),
//!   [`Device::reserve_range`](crate::Device::reserve_range) reserves a contiguous address range per buffer,
//!   [`Device::map_page`](crate::Device::map_page) records where each page is, and the view maps the pages
//!   whose frame changed (`cuMemMap` of one handle at two addresses) on the acquiring
//!   thread, with one `cuMemSetAccess` over the span. With smaller pages a frame is part
//!   of a chunk and cannot be mapped alone: `reserve_range` returns `Ok(None)`, and a
//!   fragmented acquire has no view (the caller works page by page through `frame_ptr`).
//! - **Host slots**: one `cuMemHostAlloc` (pinned, portable) region, pre-faulted, so
//!   copies run at full PCIe speed and never fault.
//! - **Two copy lanes**, host-to-device and device-to-host, each with its own
//!   non-blocking stream(s) (so the GPU's copy engines run both directions at once) and
//!   a submitter and a completion thread. A copy is enqueued as
//!   `cuMemcpy{HtoD,DtoH}Async` with an event recorded right after it on one of the
//!   lane's streams (round-robin when there are several, [`CudaDevice::with_streams`]),
//!   under the lane's lock, and `(id, event)` queued to the completion thread. A batch's
//!   first copy per lane is enqueued by the submitting thread when the lane's submitter
//!   thread is idle (a demand load waits for no hand-off); the rest are enqueued by the
//!   submitter thread, so the pool's caller, which submits holding the pool's lock, does
//!   not pay the driver's microseconds per copy. The thread waits for each event in turn with
//!   `cuEventSynchronize` on a *blocking-sync* event (the thread sleeps in the kernel
//!   driver until the copy engine signals; it does not spin a core) and then calls the
//!   sink. The queue holds copies in submission order and the thread reports them in that
//!   order, so completions of one direction arrive in submission order even when copies
//!   on two streams finish out of order (a later copy's completion then waits for the
//!   earlier one's). Events are recycled through a per-lane free list (as many as copies
//!   in flight). [`Device::submit_batch`](crate::Device::submit_batch) carries neighbouring pages (consecutive frames
//!   and slots, one direction) in one copy of up to [`COPY_RUN_BYTES_MAX`] with one event;
//!   the thread reports each page of the run in order, marking all but the last
//!   `follows`, so the pool submits the loads they free together (runs again).
//! - **Sync lane**: one more stream, under a mutex, for the synchronous calls
//!   (`write_frame`, `read_frame`, the kernels); each call ends with a stream sync.
//! - **Compute stream and fences**: [`CudaDevice::compute_stream`] is where the caller's
//!   own kernels (GEMMs) go. [`Device::after_queued_work`](crate::Device::after_queued_work) records an event on it and a
//!   fence thread runs the callback once the stream passes the event: the pool releases
//!   an acquire that way, so a frame is never reused while a queued kernel reads it.
//!
//! # Modules
//! One part per module; the parent uses the children, and a child uses only the children
//! listed before it (and the crate root), so there is no import circle.
//! - `driver`: loading the driver, GPU queries, [`cuda_available`]; `check` and `lock`.
//! - `context`: RAII owners of the context, streams and events.
//! - `frames`: the frames (physical chunks in one reserved range).
//! - `host`: the pinned host slots.
//! - `kernels`: the PTX module and the sync lane that runs the kernels;
//!   [`compute_reference`].
//! - `lanes`: the two copy lanes, their submitter and completion threads.
//! - `fence`: the compute stream and its fences.
//! - `ranges`: buffer ranges; `mapper`: views of acquired buffers (in place, or pages
//!   mapped into their buffer's range).
//! - `device`: [`CudaDevice`] put together (creation, teardown, the API beyond the trait)
//!   and [`DeviceAlloc`]; `device_impl`: the [`Device`](crate::Device) trait on it.
//! - `streams`: releases behind consumer streams (the DLPack stream contract):
//!   [`CudaDevice::after_streams_work`].
//! - `bench`: the raw pinned-copy benchmark ([`raw_pinned_bandwidth`]), the ceiling the
//!   copy lanes are measured against.
//!
//! # Diagnostics
//! [`Diagnostics`]: environment switches, read when a device is made, that turn off copy
//! runs (`SPILLWAY_CUDA_COPY_RUNS=0`) or in-place views (`SPILLWAY_CUDA_VIEWS=mapped`),
//! or make releases wait for their consumer streams on the host
//! (`SPILLWAY_CUDA_SYNC_RELEASES=1`), or enqueue every copy on the thread that submits it
//! (`SPILLWAY_CUDA_SUBMIT=inline`, no submitter threads), or report each finished copy on
//! its own (`SPILLWAY_CUDA_COMPLETION_BURSTS=0`), to tell which part a wrong result (or a
//! slow one) comes from.
//! A device made with any of them set logs a warning once.
//!
//! # Kernels
//! Hand-written PTX (`cuda/kernels.ptx`, loaded by `kernels`) loaded with `cuModuleLoadData`: the driver
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
//! - Device memory is sized once: creation refuses with [`DeviceError::OutOfMemory`](crate::DeviceError::OutOfMemory)
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

mod ahead;
mod bench;
mod context;
mod device;
mod device_impl;
mod driver;
mod fence;
mod frames;
mod host;
mod kernels;
mod lanes;
mod mapper;
mod ranges;
mod streams;

pub use ahead::MAP_AHEAD_VAR;
pub use bench::{
    RawCopyBandwidth, RawCopyOptions, raw_pinned_bandwidth, raw_pinned_bandwidth_with,
};
pub use device::{
    BANDWIDTH_HINT_BYTES_PER_S, COPY_RUN_BYTES_MAX, CudaDevice, DeviceAlloc, Diagnostics,
    STREAMS_PER_DIRECTION_DEFAULT, STREAMS_PER_DIRECTION_MAX,
};
pub use driver::cuda_available;
pub use kernels::compute_reference;
pub use streams::CONSUMER_STREAMS_MAX;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use cudarc::driver::sys;

    use super::*;
    use crate::{CompletionSink, DeviceConfig, DeviceError};

    fn no_gpu_here() -> bool {
        // SAFETY: see `driver::init_driver`.
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
}
