//! The mapper thread: maps frames into buffer ranges (`ranges`) off the caller's thread,
//! in submission order, so that the pool's lock is never held across `cuMemMap`.
//!
//! Invariants: mappings land in the order queued; [`Mapper::flush`] returns once every
//! mapping queued before it is done, with the first error if any (it stays reported); a
//! mapping for a buffer whose range is gone is skipped; a mapping already in place costs
//! nothing. The thread holds the ranges' lock only while it maps one page.

use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use cudarc::driver::sys;
use spillway_types::{BufferId, FrameId};

use super::context::Context;
use super::driver::{check, lock};
use super::frames::access_desc;
use super::ranges::Ranges;
use crate::DeviceError;

/// Maps frames into buffer ranges on a thread of its own, in submission order.
///
/// `cuMemMap` + `cuMemSetAccess` cost tens of microseconds per page; done inline they
/// would hold the pool's lock (or a completion thread) that long for every page loaded.
/// The pool queues a mapping when it starts a page's load and waits for the queue
/// ([`Device::flush_mappings`](crate::Device::flush_mappings)) only before handing out a guard, by which time the
/// mapping has almost always landed. A mapping that is already in place costs nothing.
pub(crate) struct Mapper {
    queue: Mutex<Option<mpsc::Sender<(BufferId, u32, FrameId)>>>,
    pub(crate) shared: Arc<MapperShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

pub(crate) struct MapperShared {
    /// (mappings queued, mappings done, first error).
    progress: Mutex<(u64, u64, Option<String>)>,
    cond: std::sync::Condvar,
    /// Mappings that changed something, and seconds spent in the driver on them.
    pub(crate) stats: Mutex<(u64, f64)>,
}

impl Mapper {
    pub(crate) fn new(
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

    pub(crate) fn enqueue(
        &self,
        buffer: BufferId,
        index: u32,
        frame: FrameId,
    ) -> Result<(), DeviceError> {
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
    pub(crate) fn flush(&self) -> Result<(), DeviceError> {
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

    pub(crate) fn shutdown(&self) {
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
