//! The page kernels and the sync lane that runs them: the PTX module (`kernels.ptx`,
//! loaded with `cuModuleLoadData`, so the driver compiles it for whatever GPU is
//! present), one stream, and the scratch word the reductions add into.
//! [`compute_reference`] is the CPU value of the `compute` kernel. What each kernel
//! computes: the `cuda` module docs, "Kernels".
//!
//! Invariants: the device holds the [`SyncLane`] under a mutex, with its context current,
//! for every use; each use ends with a stream sync (the calls are synchronous), so the
//! scratch word is never used by two calls at once.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::context::{Context, Stream};
use super::driver::{SUCCESS, check, result_text};
use crate::DeviceError;

/// The PTX module, NUL-terminated as `cuModuleLoadData` wants it.
const KERNELS_PTX: &str = concat!(include_str!("kernels.ptx"), "\0");
/// Threads per block of every kernel (a multiple of the warp size: the reductions need
/// full warps).
const BLOCK_THREADS: u32 = 256;
/// Most blocks per multiprocessor a launch asks for; the loops are grid-stride, so more
/// work than threads is fine.
const BLOCKS_PER_SM: u32 = 8;

/// The sync lane: stream, kernels and the reduction's scratch word.
pub(crate) struct SyncLane {
    pub(crate) stream: Stream,
    module: sys::CUmodule,
    pub(crate) fill: sys::CUfunction,
    pub(crate) checksum: sys::CUfunction,
    pub(crate) compute: sys::CUfunction,
    /// 8 bytes of device memory the reductions add into.
    pub(crate) scratch_dev: sys::CUdeviceptr,
    /// 8 bytes of pinned host memory the result is copied back to.
    scratch_host: *mut u64,
}

// SAFETY: handles and pointers used only under the `Mutex<SyncLane>`.
unsafe impl Send for SyncLane {}

impl SyncLane {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<SyncLane, DeviceError> {
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
    pub(crate) fn launch(
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
    pub(crate) fn reduce(
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

/// The value [`Device::compute`](crate::Device::compute) returns on this backend, computed on the CPU (see the
/// `cuda` module docs, "Kernels").
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

#[cfg(test)]
mod tests {
    use spillway_types::pattern;

    use super::*;

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
