//! The frames: the GPU budget as physical chunks of the CUDA virtual-memory API
//! (`cuMemCreate`), all mapped into one reserved address range, so a frame's address
//! ([`Frames::ptr`]) is stable for the device's life.
//!
//! `chunk_bytes = round_up(page_bytes, granularity)` (the granularity is 2 MiB on the
//! H200). When a page is smaller than the granularity one chunk holds
//! `chunk_bytes / page_bytes` frames, and a frame cannot be mapped alone into a buffer
//! range ([`Frames::remappable`] is false).
//!
//! Invariants: sized once; creation refuses with [`DeviceError::OutOfMemory`] (asked and
//! free bytes) when the range exceeds the free device memory, before allocating anything.
//! A frame id out of range panics (a caller bug). Drop unmaps only what was mapped, frees
//! the range and releases the handles; the lanes are drained before the frames drop.

use std::sync::Arc;

use cudarc::driver::sys;
use spillway_types::FrameId;

use super::context::Context;
use super::driver::check;
use crate::DeviceError;

/// The frames: physical chunks mapped into one reserved range.
pub(crate) struct Frames {
    ctx: Arc<Context>,
    base: sys::CUdeviceptr,
    /// Bytes of the reserved range: `handles.len() * chunk_bytes`.
    range_bytes: u64,
    pub(crate) chunk_bytes: u64,
    frames_per_chunk: u64,
    page_bytes: u64,
    frames: u32,
    /// One per chunk, in address order.
    pub(crate) handles: Vec<sys::CUmemGenericAllocationHandle>,
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

pub(crate) fn access_desc(device: sys::CUdevice) -> sys::CUmemAccessDesc {
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
    pub(crate) fn new(
        ctx: &Arc<Context>,
        frames: u32,
        page_bytes: u64,
    ) -> Result<Frames, DeviceError> {
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
    pub(crate) fn ptr(&self, frame: FrameId) -> u64 {
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

    /// Whether `ptr..ptr+len` lies inside the frames' range.
    pub(crate) fn contains(&self, ptr: u64, len: u64) -> bool {
        ptr >= self.base
            && ptr
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.range_bytes)
    }

    /// Whether consecutive frame ids lie at consecutive addresses (`frame_ptr(f + 1) ==
    /// frame_ptr(f) + page_bytes` for every f): true when a chunk is a whole number of
    /// pages, so an extent of frames is one array.
    pub(crate) fn contiguous(&self) -> bool {
        self.frames_per_chunk * self.page_bytes == self.chunk_bytes
    }

    /// Whether a frame is a whole physical chunk, so it can be mapped into a buffer range.
    pub(crate) fn remappable(&self) -> bool {
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
