//! The copy benchmark: raw pinned-memory `cuMemcpyAsync` bandwidth to and from plain
//! device memory, without the copy lanes; the ceiling that `submit` is measured against
//! (`tests/gpu.rs`; figures in the `cuda` module docs, "Performance"). It opens its own
//! context, streams and memory, apart from any [`CudaDevice`](super::CudaDevice).
//!
//! Invariants: everything it allocates is freed before it returns, after the streams are
//! synchronised, on error too.

use std::time::Instant;

use cudarc::driver::sys;
use spillway_types::HostSlot;

use super::context::{Context, Event, Stream};
use super::driver::{check, device_handle, init_driver};
use super::host::HostSlots;
use crate::DeviceError;

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
