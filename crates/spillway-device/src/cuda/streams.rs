//! Releases behind other streams' work: the DLPack stream contract's second half.
//!
//! A consumer (PyTorch through DLPack) runs its kernels on a stream of its own, not on
//! the device's compute stream, so a release fenced on the compute stream alone could let
//! the pool overwrite a frame that a queued kernel of the consumer still reads.
//! [`CudaDevice::after_streams_work`] records an event on each consumer stream, makes
//! the compute stream wait for those events (`cuStreamWaitEvent`: a device-side wait, the
//! host never blocks), then queues the callback behind the compute stream as
//! [`Device::after_queued_work`] does. So the callback runs once the compute stream and
//! every consumer stream have passed the work queued on them so far.
//!
//! Invariant: the callback always runs, after the work or, when the driver refuses an
//! event, after synchronizing the streams on the calling thread.

use cudarc::driver::sys;

use super::context::Event;
use super::device::CudaDevice;
use super::driver::check;
use crate::{Device, DeviceError};

/// How many consumer streams one release may wait for (a view exported to more streams
/// than that synchronizes them instead); each costs one event of a few hundred bytes.
pub const CONSUMER_STREAMS_MAX: usize = 16;

impl CudaDevice {
    /// Calls `done` once the compute stream and each of `streams` have passed the work
    /// queued on them so far. `streams` are raw `CUstream` handles of this device's
    /// context as DLPack passes them (`1` is the legacy default stream, `2` the
    /// per-thread default stream; PyTorch's `torch.cuda.Stream.cuda_stream`). The caller
    /// guarantees they are live streams of this device's primary context.
    pub fn after_streams_work(&self, streams: &[u64], done: Box<dyn FnOnce() + Send>) {
        if streams.is_empty() {
            return self.after_queued_work(done);
        }
        if self.diagnostics.sync_releases && self.ctx.bind().is_ok() {
            for &s in streams {
                // SAFETY: a live stream of the current context (the caller's guarantee).
                let _ = unsafe { sys::cuStreamSynchronize(s as sys::CUstream) };
            }
        }
        if let Err(e) = self.wait_on_compute_stream(streams) {
            // No device-side wait could be set up: wait for the consumers here, so the
            // release still comes after their work.
            tracing::warn!(error = %e, "stream fence failed; synchronizing consumer streams");
            for &s in streams {
                // SAFETY: a live stream of the current context (the caller's guarantee).
                let _ = unsafe { sys::cuStreamSynchronize(s as sys::CUstream) };
            }
        }
        self.after_queued_work(done);
    }

    /// Makes the compute stream wait for the work queued so far on each of `streams`.
    fn wait_on_compute_stream(&self, streams: &[u64]) -> Result<(), DeviceError> {
        if streams.len() > CONSUMER_STREAMS_MAX {
            return Err(DeviceError::Driver {
                op: "stream fence",
                message: format!(
                    "{} consumer streams, at most {CONSUMER_STREAMS_MAX}",
                    streams.len()
                ),
            });
        }
        self.ctx.bind()?;
        for &s in streams {
            let event = Event::new()?;
            // SAFETY: a live event of the current context; `s` is a live stream of it
            // (the caller's guarantee); the compute stream is ours.
            let waited = check("cuEventRecord", unsafe {
                sys::cuEventRecord(event.0, s as sys::CUstream)
            })
            .and_then(|()| {
                check("cuStreamWaitEvent", unsafe {
                    sys::cuStreamWaitEvent(self.fences.stream.raw, event.0, 0)
                })
            });
            // Destroying an event with a wait queued on it is allowed: the driver frees
            // it once the wait is done.
            event.destroy();
            waited?;
        }
        Ok(())
    }
}
