//! The compute stream and its fences. The caller's own kernels (GEMMs) run on
//! [`FenceLane::stream`]; `Device::after_queued_work` records an event on it, and the
//! fence thread runs the callback once the stream has passed the event. The pool releases
//! an acquire that way, so a frame is never reused while a queued kernel reads it.
//!
//! Invariants: callbacks run in the order queued, each after its event; shutdown runs
//! every queued callback before the thread ends. When no event can be recorded,
//! [`FenceLane::enqueue`] hands the callback back, so the caller can synchronise instead
//! and the release still comes after the work.

use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;

use cudarc::driver::sys;

use super::context::{Context, Event, Stream};
use super::driver::{check, lock};
use crate::DeviceError;

/// Work to run once the compute stream passes an event.
struct Fence {
    event: Event,
    done: Box<dyn FnOnce() + Send>,
}

/// The compute stream (where the caller's kernels run) and the thread that runs each
/// fence's `done` once the stream has passed it.
pub(crate) struct FenceLane {
    pub(crate) stream: Stream,
    queue: Mutex<Option<mpsc::Sender<Fence>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl FenceLane {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<FenceLane, DeviceError> {
        let stream = Stream::new(ctx)?;
        let (tx, rx) = mpsc::channel::<Fence>();
        let thread_ctx = ctx.clone();
        let handle = std::thread::Builder::new()
            .name("spillway-cuda-fence".into())
            .spawn(move || {
                let bound = thread_ctx.bind();
                while let Ok(f) = rx.recv() {
                    if bound.is_ok() {
                        // SAFETY: the event was recorded on the compute stream and is ours.
                        let _ = unsafe { sys::cuEventSynchronize(f.event.0) };
                    }
                    f.event.destroy();
                    (f.done)();
                }
            })
            .map_err(|e| DeviceError::Driver {
                op: "spawn fence thread",
                message: e.to_string(),
            })?;
        Ok(FenceLane {
            stream,
            queue: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(handle)),
        })
    }

    /// Records an event on the compute stream and queues `done` behind it.
    #[allow(clippy::type_complexity)]
    pub(crate) fn enqueue(
        &self,
        done: Box<dyn FnOnce() + Send>,
    ) -> Result<(), (DeviceError, Box<dyn FnOnce() + Send>)> {
        if let Err(e) = self.stream.ctx.bind() {
            return Err((e, done));
        }
        let event = match Event::new() {
            Ok(e) => e,
            Err(e) => return Err((e, done)),
        };
        // SAFETY: a live event and stream of the current context.
        if let Err(e) = check("cuEventRecord", unsafe {
            sys::cuEventRecord(event.0, self.stream.raw)
        }) {
            event.destroy();
            return Err((e, done));
        }
        match lock(&self.queue).as_ref() {
            Some(q) => q.send(Fence { event, done }).map_err(|e| {
                let f = e.0;
                f.event.destroy();
                (
                    DeviceError::Driver {
                        op: "fence queue",
                        message: "the fence thread has stopped".into(),
                    },
                    f.done,
                )
            }),
            None => {
                event.destroy();
                Err((
                    DeviceError::Driver {
                        op: "fence queue",
                        message: "the device is shutting down".into(),
                    },
                    done,
                ))
            }
        }
    }

    /// Runs every queued fence, then stops the thread (unless called from it).
    pub(crate) fn shutdown(&self) {
        lock(&self.queue).take();
        if let Some(t) = lock(&self.thread).take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}
