//! Mapping ahead (on by default; `SPILLWAY_CUDA_MAP_AHEAD=0` turns it off): one thread
//! maps the pages of buffers whose frames are not consecutive into their ranges as soon
//! as `map_page` records them, so that an acquire of such a buffer finds its view mapped
//! instead of mapping it on the acquiring thread.
//!
//! Why: a training step of `bench/torch` (Llama, 8 MiB pages, 2 GiB budget, H100,
//! 2026-12-07) remapped about 4,900 pages a step on the acquiring thread, 0.53 s of a
//! 1.16 s step (0.36 s in the optimizer phase alone, about 110 µs a page): a
//! page-granular cache by next use scatters buffers, and the pool's extents keep only
//! some of them whole. A page's mapping does not depend on its bytes, and `map_page` is
//! called when its load is issued, so the mapping can run beside the copy. Measured
//! (H100, same run, `bench/torch/runs/2026-12-07-map-ahead-h100.out`): the step went from
//! 1.406 s to 1.257 s, the acquiring threads' mapping from 0.93 s to 0.19 s a step; the
//! thread itself mapped about 5,100 pages a step in 1.06 s (about 210 µs a page, busy
//! through most of the optimizer phase), so fewer remaps, not only hidden ones, are
//! what is left to win.
//!
//! Which buffers: a record that breaks the extent (a neighbouring page sits in a frame
//! that is not the one beside it) of a buffer whose next acquire is expected whole queues
//! the buffer once. Expected whole: a holder has viewed it whole before, and, once the
//! pool has seen a step, the acquire at the same place of the last step was whole
//! (`Device::expect_view`, spillway-client's `view_kinds`: `spillway.torch`'s weights are
//! read page by page in the optimizer, whose loads are then not mapped). A buffer only
//! ever read page by page (gradients and optimizer state) is never mapped. The thread
//! maps every recorded page of it not mapped there yet, one page at a time under the
//! range's own lock (so `map_page` of another page of the buffer waits at most one
//! page's mapping).
//! A page that left its frame is forgotten (`unmap_page`), so nothing is mapped to a
//! frame another page holds. Safety is the view path's: a page is recorded in a new
//! frame only while no acquire holds its buffer, so no kernel reads a page whose mapping
//! changes; a released range is marked and never mapped into again.

use std::collections::HashSet;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use spillway_types::BufferId;

use super::context::Context;
use super::driver::lock;
use super::mapper::map_one_ahead;
use super::ranges::Ranges;
use crate::DeviceError;

/// The environment variable that turns mapping ahead off (`0`; anything else or unset:
/// on).
pub const MAP_AHEAD_VAR: &str = "SPILLWAY_CUDA_MAP_AHEAD";

/// What the thread did: pages mapped, and the seconds its driver calls took (beside the
/// job, not on an acquiring thread).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AheadStats {
    pub(crate) pages: u64,
    pub(crate) seconds: f64,
}

/// The map-ahead thread and its queue of buffers.
pub(crate) struct MapAhead {
    tx: Mutex<Option<mpsc::Sender<BufferId>>>,
    /// Buffers queued and not yet taken up (each queued once).
    pending: Mutex<HashSet<BufferId>>,
    /// Buffers queued and not yet done, for [`MapAhead::wait_idle`].
    busy: (Mutex<u64>, Condvar),
    stats: Mutex<AheadStats>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl MapAhead {
    /// Starts the thread, mapping into `ranges` with the frames' chunks `handles`.
    pub(crate) fn start(
        ctx: Arc<Context>,
        ranges: Arc<Ranges>,
        handles: Vec<sys::CUmemGenericAllocationHandle>,
    ) -> Result<Arc<MapAhead>, DeviceError> {
        let (tx, rx) = mpsc::channel::<BufferId>();
        let ahead = Arc::new(MapAhead {
            tx: Mutex::new(Some(tx)),
            pending: Mutex::new(HashSet::new()),
            busy: (Mutex::new(0), Condvar::new()),
            stats: Mutex::new(AheadStats::default()),
            thread: Mutex::new(None),
        });
        let me = ahead.clone();
        let handle = std::thread::Builder::new()
            .name("spillway-cuda-map-ahead".into())
            .spawn(move || me.run(&ctx, &ranges, &handles, &rx))
            .map_err(|e| DeviceError::Driver {
                op: "spawn map-ahead thread",
                message: e.to_string(),
            })?;
        *lock(&ahead.thread) = Some(handle);
        Ok(ahead)
    }

    /// Queues `buffer` to be mapped (once while it waits).
    pub(crate) fn want(&self, buffer: BufferId) {
        if !lock(&self.pending).insert(buffer) {
            return;
        }
        *lock(&self.busy.0) += 1;
        let sent = lock(&self.tx)
            .as_ref()
            .is_some_and(|tx| tx.send(buffer).is_ok());
        if !sent {
            lock(&self.pending).remove(&buffer);
            self.done_one();
        }
    }

    fn done_one(&self) {
        let mut busy = lock(&self.busy.0);
        *busy = busy.saturating_sub(1);
        self.busy.1.notify_all();
    }

    /// Pages mapped ahead so far, and the seconds it took.
    pub(crate) fn stats(&self) -> AheadStats {
        *lock(&self.stats)
    }

    /// Waits until every buffer queued so far is mapped, at most `timeout`; whether it
    /// was (tests and tools).
    pub(crate) fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut busy = lock(&self.busy.0);
        while *busy > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            busy = self
                .busy
                .1
                .wait_timeout(busy, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Ends the thread once it has mapped what is queued (before the frames' chunks are
    /// freed). Never calls into the pool, so joining it from any thread is safe.
    pub(crate) fn stop(&self) {
        lock(&self.tx).take();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }

    fn run(
        &self,
        ctx: &Context,
        ranges: &Ranges,
        handles: &[sys::CUmemGenericAllocationHandle],
        rx: &mpsc::Receiver<BufferId>,
    ) {
        let bound = ctx.bind();
        while let Ok(buffer) = rx.recv() {
            lock(&self.pending).remove(&buffer);
            if bound.is_ok()
                && let Some(shared) = ranges.get(buffer)
            {
                let started = Instant::now();
                let (mut from, mut pages) = (0, 0u64);
                loop {
                    let mut range = lock(&shared);
                    match map_one_ahead(ranges, &mut range, from, handles, ctx.device) {
                        Ok(Some(i)) => {
                            pages += 1;
                            from = i + 1;
                        }
                        Ok(None) => break,
                        Err(e) => {
                            // The whole view (`acquire_ptr`) maps what is left and reports a failure.
                            tracing::warn!(%buffer, error = %e, "cuda: mapping ahead failed");
                            break;
                        }
                    }
                }
                let mut s = lock(&self.stats);
                s.pages += pages;
                s.seconds += started.elapsed().as_secs_f64();
            }
            self.done_one();
        }
    }
}
