//! The two copy lanes, host-to-device and device-to-host. A [`Lane`] is one direction's
//! streams (copies go round-robin), its submitter thread, its queue to the completion
//! thread and its event free list.
//!
//! A copy's way through a lane: the submitting thread (the pool's caller or a completion
//! thread, holding the pool's lock) resolves its run of pages to addresses
//! (`CudaDevice::resolve`); the first run of a batch is enqueued in the driver on that
//! thread when the lane's submitter is idle (a demand load waits for no thread hand-off),
//! the rest go to [`submit_loop`], which enqueues them ([`Lane::enqueue`]: the copy and
//! its event) off the caller's thread and off the pool's lock; [`completion_loop`] waits
//! for each enqueued copy's event in turn and reports it to the sink. On the H200 each
//! driver copy and event cost the submitting thread microseconds, which the caller used
//! to pay for every page moved (DESIGN, "Where the rest goes").
//!
//! Invariants: runs are enqueued in the order they were submitted (the inline one only
//! when nothing is queued before it), the completion queue holds them in that order and
//! the thread reports them in that order, so completions of one direction arrive in
//! submission order even when copies on two streams finish out of order. Every submitted
//! copy gets exactly one completion, a refused one too (`event: None`). An event goes
//! back to the free list once waited for. The sink is called with no lock of the device
//! held.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// One run of neighbouring pages resolved to addresses (`CudaDevice::resolve`), to be
/// enqueued as one driver copy.
pub(crate) struct Submission {
    /// The copies it carries, reported in order.
    pub(crate) ids: Vec<TransferId>,
    /// Where it copies, or why it was refused (reported as its completion).
    pub(crate) copy: Result<RawCopy, DeviceError>,
}

/// A driver copy between a frame and a pinned host slot.
#[derive(Clone, Copy)]
pub(crate) struct RawCopy {
    pub(crate) direction: Direction,
    pub(crate) frame: sys::CUdeviceptr,
    /// The pinned slot's address (as an integer, so that a submission can cross threads).
    pub(crate) slot: usize,
    pub(crate) bytes: u64,
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
    /// Driver copies enqueued by the submitter thread, and its seconds doing it.
    pub(crate) submitted_off_thread: u64,
    pub(crate) submit_thread_s: f64,
}

/// One direction's streams, queue and event pool.
pub(crate) struct Lane {
    pub(crate) ctx: Arc<Context>,
    /// At least one; copies go round-robin, so consecutive copies can overlap.
    pub(crate) streams: Vec<Stream>,
    pub(crate) state: Mutex<LaneState>,
    /// To the submitter thread; `None` when copies are enqueued by the thread that submits
    /// them (`SPILLWAY_CUDA_SUBMIT=inline`) or once the device is dropping. Held while a
    /// batch is submitted, so batches reach the lane in order.
    pub(crate) submitter: Mutex<Option<mpsc::Sender<Vec<Submission>>>>,
    /// Runs sent to the submitter thread and not yet enqueued by it.
    pub(crate) queued: AtomicUsize,
    /// Written by the lane's threads.
    pub(crate) stats: Mutex<LaneStats>,
}

impl Lane {
    /// Submits `runs` (this lane's direction, in order): the first on this thread when
    /// the submitter has nothing queued, the rest through it (all here without one).
    pub(crate) fn submit(&self, runs: Vec<Submission>) {
        let submitter = lock(&self.submitter);
        let Some(tx) = submitter.as_ref() else {
            for run in runs {
                self.enqueue_and_queue(run);
            }
            return;
        };
        let mut runs = runs.into_iter();
        if self.queued.load(Ordering::Acquire) == 0
            && let Some(first) = runs.next()
        {
            self.enqueue_and_queue(first);
        }
        let rest: Vec<Submission> = runs.collect();
        if rest.is_empty() {
            return;
        }
        self.queued.fetch_add(rest.len(), Ordering::AcqRel);
        tx.send(rest)
            .expect("the submitter thread lives until its sender is dropped");
    }

    /// Enqueues `run` in the driver and queues it for the completion thread, under the
    /// lane's lock (so the completion queue's order is the enqueue order).
    pub(crate) fn enqueue_and_queue(&self, run: Submission) {
        let mut state = lock(&self.state);
        let (event, result) = match run.copy.and_then(|c| self.enqueue(&mut state, c)) {
            Ok(event) => (Some(event), Ok(())),
            Err(e) => (None, Err(e)),
        };
        let pending = Pending {
            ids: run.ids,
            event,
            result,
        };
        if let Some(queue) = state.queue.as_ref() {
            // The completion thread ends only after the queue's sender is dropped.
            let _ = queue.send(pending);
        }
    }

    /// Enqueues `copy` on the lane's next stream and records its event (lane lock held).
    fn enqueue(&self, state: &mut LaneState, copy: RawCopy) -> Result<Event, DeviceError> {
        self.ctx.bind()?;
        let event = match state.free_events.pop() {
            Some(e) => e,
            None => Event::new()?,
        };
        let stream = self.streams[state.next_stream].raw;
        state.next_stream = (state.next_stream + 1) % self.streams.len();
        let copied = if copy.bytes == 0 {
            Ok(())
        } else {
            let slot = copy.slot as *mut u8;
            // SAFETY: `CudaDevice::resolve` checked that every page's range lies inside
            // its frame and slot and that a run's frames and slots are neighbours at
            // consecutive addresses; the slots are pinned, so the copy is truly
            // asynchronous, and by the pool's contract nobody touches the frames or slots
            // until the completions arrive.
            check("cuMemcpyAsync", unsafe {
                match copy.direction {
                    Direction::HostToDevice => sys::cuMemcpyHtoDAsync_v2(
                        copy.frame,
                        slot.cast_const().cast(),
                        copy.bytes as usize,
                        stream,
                    ),
                    Direction::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(
                        slot.cast(),
                        copy.frame,
                        copy.bytes as usize,
                        stream,
                    ),
                    Direction::PeerToDevice | Direction::DeviceToPeer => {
                        unreachable!("peer copies are refused in `CudaDevice::resolve`")
                    }
                }
            })
        };
        // SAFETY: a live event and stream of the current context.
        let recorded = copied.and_then(|()| {
            check("cuEventRecord", unsafe {
                sys::cuEventRecord(event.0, stream)
            })
        });
        match recorded {
            Ok(()) => Ok(event),
            Err(e) => {
                state.free_events.push(event);
                Err(e)
            }
        }
    }

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

/// The lane of a direction: into the frame on lane 0, out of it on lane 1 (a peer copy
/// is refused in `CudaDevice::resolve`, and its completion goes in order on the lane of
/// its way).
pub(crate) fn lane_index(direction: Direction) -> usize {
    usize::from(!direction.into_frame())
}

/// A lane's submitter thread: enqueues each batch of runs it is sent, in order. Ends
/// when the device drops its sender and the channel is empty.
pub(crate) fn submit_loop(lane: &Lane, rx: &mpsc::Receiver<Vec<Submission>>) {
    // A failed bind shows again in each copy's own `bind` (its completion says why).
    let _ = lane.ctx.bind();
    while let Ok(runs) = rx.recv() {
        let started = Instant::now();
        let n = runs.len();
        for run in runs {
            lane.enqueue_and_queue(run);
        }
        lane.queued.fetch_sub(n, Ordering::AcqRel);
        let mut st = lock(&lane.stats);
        st.submitted_off_thread += n as u64;
        st.submit_thread_s += started.elapsed().as_secs_f64();
    }
}

/// A lane's completion thread: waits for each queued copy's event in order, then
/// reports it, saying that another follows when the next queued copy has finished too
/// (the pool handles such a burst under one lock; not when `bursts` is off). Ends when
/// the device drops its sender and the queue is empty.
pub(crate) fn completion_loop(
    ctx: &Context,
    lane: &Lane,
    rx: &mpsc::Receiver<Pending>,
    sink: &CompletionSink,
    bursts: bool,
) {
    let bound = ctx.bind().err().map(|e| e.to_string());
    // Copies received and not reported yet, in order (read ahead to see whether the next
    // one has finished too: then this one's completions say another follows).
    let mut ahead: VecDeque<Pending> = VecDeque::new();
    while let Some(p) = ahead.pop_front().or_else(|| rx.recv().ok()) {
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
        if bursts {
            ahead.extend(rx.try_iter());
        }
        let next_done = ahead
            .front()
            .is_some_and(|next| match (&next.event, &bound) {
                (Some(event), None) => {
                    // SAFETY: the event stays alive while its copy is in `ahead`.
                    let status = unsafe { sys::cuEventQuery(event.0) };
                    status == sys::CUresult::CUDA_SUCCESS
                }
                // Refused, or no context: reported at once.
                _ => true,
            });
        let started = Instant::now();
        let n = p.ids.len() as u64;
        for (k, id) in p.ids.into_iter().enumerate() {
            sink(Completion {
                id,
                result: result.clone(),
                follows: (k as u64) + 1 < n || next_done,
            });
        }
        let mut st = lock(&lane.stats);
        st.completions += n;
        st.copies += 1;
        st.completions_late += u64::from(late) * n;
        st.completion_sink_s += started.elapsed().as_secs_f64();
    }
}
