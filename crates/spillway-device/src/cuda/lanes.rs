//! The two copy lanes, host-to-device and device-to-host. A [`Lane`] is one direction's
//! streams (copies go round-robin), its queue to the completion thread and its event
//! free list; [`completion_loop`] is that thread: it waits for each queued copy's event
//! in turn and reports it to the sink. Enqueueing a copy (`CudaDevice::enqueue`, under the
//! lane's lock) lives with the device, which owns the frames and slots a copy uses.
//!
//! Invariants: the queue holds copies in submission order and the thread reports them in
//! that order, so completions of one direction arrive in submission order even when
//! copies on two streams finish out of order. Every queued copy gets exactly one
//! completion, a refused one too (`event: None`). An event goes back to the free list
//! once waited for. The sink is called with no lock of the device held.

use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use cudarc::driver::sys;
use spillway_types::{Direction, TransferId};

use super::context::{Context, Event, Stream};
use super::driver::{check, lock};
use crate::{Completion, CompletionSink, DeviceError};

/// One queued copy, on its way to the lane's completion thread.
pub(crate) struct Pending {
    /// The copies this one carries (a run of neighbouring pages), reported in order.
    pub(crate) ids: Vec<TransferId>,
    /// Recorded after the copy; `None` when the copy was refused (`result` says why).
    pub(crate) event: Option<Event>,
    pub(crate) result: Result<(), DeviceError>,
}

pub(crate) struct LaneState {
    /// To the completion thread; `None` once the device is dropping.
    pub(crate) queue: Option<mpsc::Sender<Pending>>,
    /// Events not in flight, for reuse.
    pub(crate) free_events: Vec<Event>,
    /// The stream the next copy goes to (round-robin).
    pub(crate) next_stream: usize,
}

/// What a lane's completion thread counted (see [`crate::DeviceTimings`]).
#[derive(Default)]
pub(crate) struct LaneStats {
    pub(crate) completions: u64,
    pub(crate) copies: u64,
    pub(crate) completions_late: u64,
    pub(crate) completion_sink_s: f64,
}

/// One direction's streams, queue and event pool.
pub(crate) struct Lane {
    pub(crate) ctx: Arc<Context>,
    /// At least one; copies go round-robin, so consecutive copies can overlap.
    pub(crate) streams: Vec<Stream>,
    pub(crate) state: Mutex<LaneState>,
    /// Written by the completion thread only.
    pub(crate) stats: Mutex<LaneStats>,
}

impl Lane {
    /// Waits for every copy enqueued so far. The context is current.
    pub(crate) fn synchronize(&self) {
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

pub(crate) fn lane_index(direction: Direction) -> usize {
    match direction {
        Direction::HostToDevice => 0,
        Direction::DeviceToHost => 1,
    }
}

/// A lane's completion thread: waits for each queued copy's event in order, then
/// reports it. Ends when the device drops its sender and the queue is empty.
pub(crate) fn completion_loop(
    ctx: &Context,
    lane: &Lane,
    rx: &mpsc::Receiver<Pending>,
    sink: &CompletionSink,
) {
    let bound = ctx.bind().err().map(|e| e.to_string());
    while let Ok(p) = rx.recv() {
        let mut late = false;
        let result = match (p.event, &bound) {
            (None, _) => p.result,
            (Some(event), None) => {
                // SAFETY: the event was recorded after the copy on the lane's stream and
                // stays alive until we return it to the free list below.
                late = unsafe { sys::cuEventQuery(event.0) } == sys::CUresult::CUDA_SUCCESS;
                // SAFETY: as above.
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
        let started = Instant::now();
        let n = p.ids.len() as u64;
        for (k, id) in p.ids.into_iter().enumerate() {
            sink(Completion {
                id,
                result: result.clone(),
                follows: (k as u64) + 1 < n,
            });
        }
        let mut st = lock(&lane.stats);
        st.completions += n;
        st.copies += 1;
        st.completions_late += u64::from(late) * n;
        st.completion_sink_s += started.elapsed().as_secs_f64();
    }
}
