//! The [`Device`] trait on [`CudaDevice`]: a copy goes to its direction's lane (a refused
//! one becomes a queued failed completion, so every copy gets exactly one), host slots
//! are read and written in place, frames through the sync lane, views of acquired buffers
//! in place or through buffer ranges (`mapper`), kernels on the sync lane, and releases behind a fence on the compute stream.
//!
//! Invariants: those of the trait (crate docs): the caller guarantees that nobody touches
//! a frame or slot while a copy using it is in flight; an id out of range panics.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use spillway_types::{BufferId, Direction, FrameId, HostSlot};

use super::device::{BANDWIDTH_HINT_BYTES_PER_S, CudaDevice};
use super::driver::{check, lock};
use super::lanes::{Submission, lane_index};
use super::mapper::{consecutive, forget, record};
use super::ranges::BufferRange;
use crate::{
    CopyOp, Device, DeviceConfig, DeviceError, DeviceKind, DevicePtr, DeviceTimings, check_range,
    read_page, write_page,
};

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
        self.submit_batch(&[op]);
    }

    /// Runs of neighbouring pages ([`CudaDevice::run_len`]) go as one copy with one
    /// event; the completion thread reports each page of a run, in order. Each lane's
    /// first run is enqueued here, the rest by its submitter thread (`lanes`).
    fn submit_batch(&self, ops: &[CopyOp]) {
        let mut per_lane: [Vec<Submission>; 2] = [Vec::new(), Vec::new()];
        let mut rest = ops;
        while !rest.is_empty() {
            let n = self.run_len(rest);
            let (run, tail) = rest.split_at(n);
            rest = tail;
            per_lane[lane_index(run[0].direction)].push(self.resolve(run));
        }
        for (lane, runs) in self.lanes.iter().zip(per_lane) {
            if !runs.is_empty() {
                lane.submit(runs);
            }
        }
    }

    fn write_host(&self, slot: HostSlot, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        // SAFETY: the slot is `page_bytes` of pinned host memory; the caller holds it (pool
        // contract).
        unsafe { write_page(self.host.ptr(slot), self.config.page_bytes, offset, data) }
    }

    fn read_host(&self, slot: HostSlot, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        // SAFETY: as in `write_host`.
        unsafe { read_page(self.host.ptr(slot), self.config.page_bytes, offset, out) }
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
            Arc::new(Mutex::new(BufferRange {
                base,
                mapped: vec![None; pages as usize],
                desired: vec![None; pages as usize],
                released: false,
                map_ahead: false,
                pool_expects: false,
            })),
        );
        Ok(Some(DevicePtr(base)))
    }

    /// Records that page `index` of the buffer is in `frame` (replacing whatever was
    /// there); the page is mapped into the buffer's range only when a view needs it
    /// ([`Device::acquire_ptr`] of a buffer whose frames are not consecutive,
    /// [`Device::flush_mappings`]), or ahead by the map-ahead thread when it is on and
    /// the frame breaks the buffer's extent (module `ahead`). The buffer must have a
    /// range.
    /// A no-op with pages smaller than the allocation granularity: no buffer has a range
    /// then (`reserve_range` returned `None`), and an acquire is shown in place or page
    /// by page. (It was an error, which the pool logged once per page loaded: on the H200
    /// ~1,200 log lines per step of a 256 KiB replay, under the pool's lock.)
    fn map_page(&self, buffer: BufferId, index: u32, frame: FrameId) -> Result<(), DeviceError> {
        if !self.frames.remappable() {
            return Ok(());
        }
        // Validates the frame id (panics on a caller bug, as everywhere).
        let _ = self.frames.ptr(frame);
        let breaks = record(&self.ranges, buffer, index, frame)?;
        if breaks && let Some(ahead) = &self.ahead {
            ahead.want(buffer);
        }
        Ok(())
    }

    /// Sets whether the buffer's loads are mapped ahead from now on (module `ahead`).
    fn expect_view(&self, buffer: BufferId, whole: bool) {
        if let Some(range) = self.ranges.get(buffer) {
            lock(&range).expect_view(whole);
        }
    }

    /// Maps every page recorded by `map_page` that is not mapped there yet.
    fn flush_mappings(&self) -> Result<(), DeviceError> {
        let buffers: Vec<BufferId> = lock(&self.ranges.map).keys().copied().collect();
        for b in buffers {
            match self.map_buffer(b) {
                // Released meanwhile: nothing to map.
                Err(DeviceError::Driver {
                    op: "map buffer range",
                    ..
                }) => {}
                other => {
                    other?;
                }
            }
        }
        Ok(())
    }

    /// In place when `frames` are consecutive (the frames' own addresses, no driver
    /// call); else through the buffer's range, its pages mapped first (those whose frame
    /// changed, access set once over the span); `None` without either.
    fn acquire_ptr(
        &self,
        buffer: BufferId,
        frames: &[FrameId],
    ) -> Result<Option<DevicePtr>, DeviceError> {
        let Some(&first) = frames.first() else {
            return Ok(None);
        };
        if self.frames.contiguous() && self.diagnostics.views_in_place && consecutive(frames) {
            self.views.in_place();
            return Ok(Some(DevicePtr(self.frames.ptr(first))));
        }
        let Some(range) = self.ranges.get(buffer) else {
            return Ok(None);
        };
        // Wanted as one array: unless the pool says what it expects (`expect_view`), its
        // pages are mapped ahead from now on when they scatter.
        lock(&range).viewed_whole();
        let base = self.map_buffer(buffer)?;
        self.views.through_range();
        Ok(Some(DevicePtr(base)))
    }

    fn timings(&self) -> DeviceTimings {
        CudaDevice::timings(self)
    }

    /// Lazy: the page's mapping stays until the page is mapped again (into another frame
    /// or the same one, which then costs nothing) or the range is released. A page that
    /// is not resident is never read through its range (guards exist only for resident
    /// pages), so a stale mapping is never observed, and it is still valid memory. Only
    /// the record of where it is goes, so nothing maps it ahead to a frame another page
    /// now holds.
    fn unmap_page(&self, buffer: BufferId, index: u32) -> Result<(), DeviceError> {
        if self.frames.remappable() {
            forget(&self.ranges, buffer, index);
        }
        Ok(())
    }

    /// Unmaps every page of the buffer's range and frees it; no-op without a range.
    fn release_range(&self, buffer: BufferId) -> Result<(), DeviceError> {
        let Some(range) = lock(&self.ranges.map).remove(&buffer) else {
            return Ok(());
        };
        self.ctx.bind()?;
        self.ranges.release(&mut lock(&range))
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
