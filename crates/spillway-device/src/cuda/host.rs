//! The host slots: the host tier in pinned memory, so copies run at full PCIe speed and
//! never fault. Either one `cuMemHostAlloc` region (pinned, portable, pre-faulted) of the
//! device's own, or memory made elsewhere ([`HostMemory`], shared with the node daemon)
//! registered with the driver as pinned.
//!
//! Invariants: sized once (refused with [`DeviceError::OutOfMemory`] when it cannot be
//! pinned); a slot id out of range panics (a caller bug); who touches which slot is the
//! pool's contract. Registered memory is unregistered, not freed, on drop, and the lanes
//! are drained before the slots drop.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use spillway_types::HostSlot;

use super::context::Context;
use super::driver::check;
use crate::{DeviceError, HostMemory};

/// Bytes of one OS page, the stride of pre-faulting.
const OS_PAGE_BYTES: usize = 4096;

/// The host slots: one pinned region, allocated by the driver, or memory made elsewhere
/// ([`HostMemory`], shared with the node daemon) registered as pinned.
pub(crate) struct HostSlots {
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
    /// `slots` slots with no memory behind them yet (null `ptr`): the constructors' start,
    /// and the whole result when there are no bytes to hold.
    fn unbacked(ctx: &Arc<Context>, slots: u32, page_bytes: u64) -> HostSlots {
        HostSlots {
            ctx: ctx.clone(),
            ptr: std::ptr::null_mut(),
            slots,
            page_bytes,
            external: None,
        }
    }

    /// `memory`, registered with the driver as pinned, as `slots` slots.
    pub(crate) fn register(
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
        let mut out = HostSlots::unbacked(ctx, slots, page_bytes);
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

    pub(crate) fn new(
        ctx: &Arc<Context>,
        slots: u32,
        page_bytes: u64,
    ) -> Result<HostSlots, DeviceError> {
        let bytes = u64::from(slots) * page_bytes;
        let mut out = HostSlots::unbacked(ctx, slots, page_bytes);
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
    pub(crate) fn ptr(&self, slot: HostSlot) -> *mut u8 {
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
