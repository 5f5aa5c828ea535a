//! The `sim` backend: device memory is host memory under a hard budget.
//!
//! Frames and host slots are two page-aligned regions allocated and pre-faulted at
//! creation, so the budget is real memory and no copy pays for first-touch page faults.
//! Copies are real CPU copies on two threads, one per direction (the "streams"), so they
//! overlap with the caller's compute exactly as DMA engines would; a copy completes in
//! submission order within its direction. Like a DMA copy they leave the destination out
//! of the CPU caches (module `uncached`), so a page copied just before a kernel reads
//! it computes no faster than a resident one. Kernels run on the calling thread.
//!
//! An acquired buffer whose pages sit in consecutive frames (the core places a buffer's
//! pages that way when it can) is one array at its first frame's address
//! ([`Device::acquire_ptr`]); otherwise it is seen page by page.
//!
//! Safety rests on the pool's contract (see the crate docs): a frame or slot used by a
//! copy in flight is touched by nobody else, so the copy threads' raw-pointer copies never
//! race with other access.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::mpsc;
use std::thread::JoinHandle;

use spillway_types::{BufferId, Direction, FrameId, HostSlot, pattern};

use crate::uncached::copy_uncached;
use crate::{
    Completion, CompletionSink, CopyOp, Device, DeviceConfig, DeviceError, DeviceKind, DevicePtr,
    HostMemory, check_range, read_page, write_page,
};

/// Alignment of both regions: one 4 KiB OS page.
const REGION_ALIGN: usize = 4096;

/// A page-aligned, zeroed, pre-faulted piece of memory: our own, or a [`HostMemory`]
/// made elsewhere (then `layout` is `None` and `_external` keeps it mapped).
struct Region {
    ptr: NonNull<u8>,
    size: usize,
    layout: Option<Layout>,
    _external: Option<HostMemory>,
}

// SAFETY: `Region` is plain memory; who may touch which part of it is governed by the
// pool's contract (crate docs), not by the type.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    fn new(bytes: u64, what: &'static str) -> Result<Region, DeviceError> {
        let oom = || DeviceError::OutOfMemory {
            what,
            requested_bytes: bytes,
            available_bytes: 0,
        };
        let size = usize::try_from(bytes.max(1)).map_err(|_| oom())?;
        let layout = Layout::from_size_align(size, REGION_ALIGN).map_err(|_| oom())?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(oom)?;
        // Pre-fault: touch every OS page so copies measure memcpy, not page faults.
        for off in (0..size).step_by(REGION_ALIGN) {
            // SAFETY: `off < size`, inside the allocation.
            unsafe { ptr.as_ptr().add(off).write_volatile(0) };
        }
        Ok(Region {
            ptr,
            size,
            layout: Some(layout),
            _external: None,
        })
    }

    /// The slots in `memory`, which must hold `bytes`.
    fn external(memory: HostMemory, bytes: u64) -> Result<Region, DeviceError> {
        if memory.len() < bytes {
            return Err(DeviceError::OutOfMemory {
                what: "host",
                requested_bytes: bytes,
                available_bytes: memory.len(),
            });
        }
        Ok(Region {
            ptr: memory.as_ptr(),
            size: memory.len() as usize,
            layout: None,
            _external: Some(memory),
        })
    }

    /// Pointer to byte `offset`; the caller keeps `offset` inside the region.
    fn at(&self, offset: u64) -> *mut u8 {
        debug_assert!((offset as usize) < self.size);
        // SAFETY: callers pass offsets of frames/slots that exist, so inside the region.
        unsafe { self.ptr.as_ptr().add(offset as usize) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated with this layout in `Region::new`.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

struct Memory {
    frames: Region,
    slots: Region,
    config: DeviceConfig,
}

impl Memory {
    fn frame(&self, frame: FrameId) -> *mut u8 {
        assert!(
            frame.0 < self.config.frames,
            "frame {} of {}",
            frame.0,
            self.config.frames
        );
        self.frames.at(u64::from(frame.0) * self.config.page_bytes)
    }
    fn slot(&self, slot: HostSlot) -> *mut u8 {
        assert!(
            slot.0 < self.config.host_slots,
            "slot {} of {}",
            slot.0,
            self.config.host_slots
        );
        self.slots.at(u64::from(slot.0) * self.config.page_bytes)
    }
}

/// Host memory standing in for a GPU. See the module docs.
pub struct SimDevice {
    memory: std::sync::Arc<Memory>,
    streams: [Option<mpsc::Sender<CopyOp>>; 2],
    threads: Vec<JoinHandle<()>>,
}

impl SimDevice {
    /// Allocates (and pre-faults) the frames and slots, and starts the two copy threads.
    pub fn new(config: DeviceConfig, sink: CompletionSink) -> Result<SimDevice, DeviceError> {
        Self::with_host_memory(config, None, sink)
    }

    /// [`SimDevice::new`] with the host slots in `host` (when given) instead of memory of
    /// its own; `host` must hold `config.host_slots` pages.
    pub fn with_host_memory(
        config: DeviceConfig,
        host: Option<HostMemory>,
        sink: CompletionSink,
    ) -> Result<SimDevice, DeviceError> {
        let frames = Region::new(u64::from(config.frames) * config.page_bytes, "device")?;
        let slot_bytes = u64::from(config.host_slots) * config.page_bytes;
        let slots = match host {
            Some(memory) => Region::external(memory, slot_bytes)?,
            None => Region::new(slot_bytes, "host")?,
        };
        let memory = std::sync::Arc::new(Memory {
            frames,
            slots,
            config,
        });
        let mut streams = [None, None];
        let mut threads = Vec::new();
        for (i, name) in ["spillway-h2d", "spillway-d2h"].into_iter().enumerate() {
            let (tx, rx) = mpsc::channel::<CopyOp>();
            let memory = memory.clone();
            let sink = sink.clone();
            let handle = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || copy_stream(&memory, &rx, &sink))
                .map_err(|e| DeviceError::Driver {
                    op: "spawn copy thread",
                    message: e.to_string(),
                })?;
            streams[i] = Some(tx);
            threads.push(handle);
        }
        Ok(SimDevice {
            memory,
            streams,
            threads,
        })
    }
}

fn copy_stream(memory: &Memory, rx: &mpsc::Receiver<CopyOp>, sink: &CompletionSink) {
    while let Ok(op) = rx.recv() {
        let result = check_range(0, op.bytes, memory.config.page_bytes).map(|()| {
            let (frame, slot) = (memory.frame(op.frame), memory.slot(op.slot));
            let (src, dst) = match op.direction {
                Direction::HostToDevice => (slot, frame),
                Direction::DeviceToHost => (frame, slot),
            };
            // SAFETY: both ranges are inside their regions (checked above) and, by the
            // pool's contract, nobody else touches this frame or slot during the copy.
            // A frame and a slot live in different regions, so they never overlap.
            // Uncached, so the copied page is not hotter for the next kernel than a page
            // copied earlier or resident: a GPU copy leaves nothing in the CPU cache.
            unsafe { copy_uncached(src, dst, op.bytes as usize) };
        });
        sink(Completion {
            id: op.id,
            result,
            follows: false,
        });
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        for s in &mut self.streams {
            s.take();
        }
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            // The last owner may be dropped from a copy thread (its completion callback
            // held the last reference); a thread cannot join itself, and it exits anyway
            // once its channel is closed.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

impl SimDevice {
    /// The frame's bytes; the caller holds the frame (pool contract) for the borrow's life.
    fn frame_bytes(&self, frame: FrameId, len: u64) -> Result<&[u8], DeviceError> {
        check_range(0, len, self.memory.config.page_bytes)?;
        // SAFETY: inside the region (checked); nobody writes the frame meanwhile (pool
        // contract).
        Ok(unsafe { std::slice::from_raw_parts(self.memory.frame(frame), len as usize) })
    }
}

impl Device for SimDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Sim
    }

    fn describe(&self) -> String {
        "sim (host memory standing in for a GPU)".into()
    }

    fn config(&self) -> DeviceConfig {
        self.memory.config
    }

    fn submit(&self, op: CopyOp) {
        let i = match op.direction {
            Direction::HostToDevice => 0,
            Direction::DeviceToHost => 1,
        };
        let stream = self.streams[i].as_ref().expect("streams live until drop");
        stream.send(op).expect("copy thread lives until drop");
    }

    fn write_host(&self, slot: HostSlot, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let m = &self.memory;
        // SAFETY: the slot is `page_bytes` of the arena; the caller holds it (pool contract).
        unsafe { write_page(m.slot(slot), m.config.page_bytes, offset, data) }
    }

    fn read_host(&self, slot: HostSlot, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        let m = &self.memory;
        // SAFETY: as in `write_host`.
        unsafe { read_page(m.slot(slot), m.config.page_bytes, offset, out) }
    }

    fn write_frame(&self, frame: FrameId, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let m = &self.memory;
        // SAFETY: as in `write_host`, for the frame.
        unsafe { write_page(m.frame(frame), m.config.page_bytes, offset, data) }
    }

    fn read_frame(&self, frame: FrameId, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        let m = &self.memory;
        // SAFETY: as in `write_frame`.
        unsafe { read_page(m.frame(frame), m.config.page_bytes, offset, out) }
    }

    fn frame_ptr(&self, frame: FrameId) -> DevicePtr {
        DevicePtr(self.memory.frame(frame) as u64)
    }

    fn host_view(&self, frame: FrameId) -> Option<NonNull<u8>> {
        NonNull::new(self.memory.frame(frame))
    }

    fn acquire_ptr(
        &self,
        _buffer: BufferId,
        frames: &[FrameId],
    ) -> Result<Option<DevicePtr>, DeviceError> {
        // The frames are one region, frame `i` at `i * page_bytes`: consecutive frames are
        // one array at the first one's address. Others have no view (no address range to
        // map them into on this backend).
        let consecutive = frames.windows(2).all(|w| w[1].0 == w[0].0 + 1);
        Ok(match frames.first() {
            Some(&first) if consecutive => Some(self.frame_ptr(first)),
            _ => None,
        })
    }

    fn fill_pattern(&self, frame: FrameId, len: u64, seed: u64) -> Result<(), DeviceError> {
        check_range(0, len, self.memory.config.page_bytes)?;
        // SAFETY: inside the region (checked); exclusive use of the frame by the caller
        // (pool contract) for this call.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(self.memory.frame(frame), len as usize) };
        pattern::fill(seed, bytes);
        Ok(())
    }

    fn checksum(&self, frame: FrameId, len: u64) -> Result<u64, DeviceError> {
        Ok(pattern::checksum(self.frame_bytes(frame, len)?))
    }

    fn compute(&self, frame: FrameId, len: u64, passes: u32) -> Result<u64, DeviceError> {
        Ok(compute_passes(self.frame_bytes(frame, len)?, passes))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn bandwidth_hint_bytes_per_s(&self, _direction: Direction) -> f64 {
        // memcpy between pre-faulted regions on these machines: 5-8 GB/s.
        5e9
    }
}

/// Arithmetic over every word of `data`, `passes` times, with four independent chains so
/// the CPU's multipliers stay busy. Reads only: the demo's kernels never change weights.
pub fn compute_passes(data: &[u8], passes: u32) -> u64 {
    let mut acc = [1u64, 2, 3, 4];
    for p in 0..passes {
        let k = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(p);
        for chunk in data.chunks_exact(32) {
            for (j, a) in acc.iter_mut().enumerate() {
                let w = u64::from_le_bytes(chunk[j * 8..j * 8 + 8].try_into().expect("8 bytes"));
                *a = a.wrapping_mul(k).wrapping_add(w).rotate_left(17);
            }
        }
    }
    acc.iter().fold(0, |x, a| x ^ a)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex, mpsc};

    use spillway_types::TransferId;

    use super::*;

    fn device(frames: u32, slots: u32) -> (SimDevice, mpsc::Receiver<Completion>) {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let sink: CompletionSink = Arc::new(move |c| tx.lock().unwrap().send(c).unwrap());
        let d = SimDevice::new(
            DeviceConfig {
                frames,
                host_slots: slots,
                page_bytes: 64 << 10,
            },
            sink,
        )
        .unwrap();
        (d, rx)
    }

    #[test]
    fn consecutive_frames_are_one_array_and_others_none() {
        let (d, _rx) = device(4, 4);
        let f = |ids: &[u32]| ids.iter().map(|&i| FrameId(i)).collect::<Vec<_>>();
        let at = d.acquire_ptr(BufferId(1), &f(&[1, 2, 3])).unwrap();
        assert_eq!(at, Some(d.frame_ptr(FrameId(1))));
        assert_eq!(
            d.frame_ptr(FrameId(2)).0 - d.frame_ptr(FrameId(1)).0,
            64 << 10,
            "frame i+1 follows frame i"
        );
        assert_eq!(d.acquire_ptr(BufferId(1), &f(&[2, 1])).unwrap(), None);
        assert_eq!(d.acquire_ptr(BufferId(1), &f(&[0, 2])).unwrap(), None);
        assert_eq!(
            d.acquire_ptr(BufferId(1), &f(&[3])).unwrap(),
            Some(d.frame_ptr(FrameId(3)))
        );
    }

    #[test]
    fn copies_move_bytes_both_ways() {
        let (d, rx) = device(2, 4);
        let mut page = vec![0u8; 64 << 10];
        pattern::fill(9, &mut page);
        d.write_host(HostSlot(3), 0, &page).unwrap();
        let op = CopyOp {
            id: TransferId(1),
            direction: Direction::HostToDevice,
            frame: FrameId(1),
            slot: HostSlot(3),
            bytes: 64 << 10,
        };
        d.submit(op);
        let c = rx.recv().unwrap();
        assert_eq!(c.id, TransferId(1));
        c.result.unwrap();
        assert_eq!(
            d.checksum(FrameId(1), 64 << 10).unwrap(),
            pattern::expected_checksum(9, 64 << 10)
        );
        d.fill_pattern(FrameId(0), 1000, 5).unwrap();
        d.submit(CopyOp {
            id: TransferId(2),
            direction: Direction::DeviceToHost,
            frame: FrameId(0),
            slot: HostSlot(0),
            bytes: 1000,
        });
        rx.recv().unwrap().result.unwrap();
        let mut out = vec![0u8; 1000];
        d.read_host(HostSlot(0), 0, &mut out).unwrap();
        assert_eq!(pattern::checksum(&out), pattern::expected_checksum(5, 1000));
    }

    #[test]
    fn out_of_range_is_an_error() {
        let (d, rx) = device(1, 1);
        assert!(matches!(
            d.write_host(HostSlot(0), 64 << 10, &[1]),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert!(matches!(
            d.read_frame(FrameId(0), 1, &mut vec![0; 64 << 10]),
            Err(DeviceError::OutOfRange { .. })
        ));
        d.submit(CopyOp {
            id: TransferId(7),
            direction: Direction::HostToDevice,
            frame: FrameId(0),
            slot: HostSlot(0),
            bytes: (64 << 10) + 1,
        });
        assert!(matches!(
            rx.recv().unwrap().result,
            Err(DeviceError::OutOfRange { .. })
        ));
    }

    #[test]
    fn compute_depends_on_every_word() {
        let mut a = vec![0u8; 4096];
        pattern::fill(1, &mut a);
        let base = compute_passes(&a, 2);
        a[4000] ^= 0x10;
        assert_ne!(compute_passes(&a, 2), base);
    }
}
