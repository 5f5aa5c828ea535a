//! RAII owners of the driver handles every part shares: the GPU's retained primary
//! [`Context`], a non-blocking [`Stream`] and a blocking-sync [`Event`].
//!
//! Invariants: every handle is owned by one value that holds an `Arc` of the context (an
//! event: by a lane or fence that does) and makes it current before destroying the
//! handle, so teardown works on any thread and the context is released last. A thread
//! makes the context current ([`Context::bind`]) before it calls the driver.

use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::check;
use crate::DeviceError;

/// The retained primary context of one GPU.
pub(crate) struct Context {
    pub(crate) device: sys::CUdevice,
    raw: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be used from any thread (the driver API is
// thread-safe); each thread makes it current before use (`bind`).
unsafe impl Send for Context {}
// SAFETY: as above; `Context` has no interior state of its own.
unsafe impl Sync for Context {}

impl Context {
    pub(crate) fn retain(device: sys::CUdevice) -> Result<Arc<Context>, DeviceError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `device` is a valid device handle; writes the context handle.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw, device)
        })?;
        let ctx = Arc::new(Context { device, raw });
        ctx.bind()?;
        Ok(ctx)
    }

    /// Makes the context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: `raw` is a retained context, alive while `self` is.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `Context::retain`; every other handle of this
        // context was destroyed first (each holds an `Arc<Context>`).
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

/// A stream, destroyed with its context current.
pub(crate) struct Stream {
    pub(crate) ctx: Arc<Context>,
    pub(crate) raw: sys::CUstream,
}

// SAFETY: stream handles may be used from any thread (the driver API is thread-safe);
// work enqueued from several threads is ordered by the lane lock that guards each use.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Stream, DeviceError> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the context is current; writes the stream handle. Non-blocking: the
        // stream never waits for the legacy default stream.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream {
            ctx: ctx.clone(),
            raw,
        })
    }

    pub(crate) fn synchronize(&self) -> Result<(), DeviceError> {
        // SAFETY: a live stream of the current context (callers bind first).
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: the stream is ours; wait for its work, then destroy it.
            unsafe {
                let _ = sys::cuStreamSynchronize(self.raw);
                let _ = sys::cuStreamDestroy_v2(self.raw);
            }
        }
    }
}

/// A blocking-sync, timing-free event. Destroyed with its lane (which holds the context).
pub(crate) struct Event(pub(crate) sys::CUevent);

// SAFETY: event handles may be used from any thread; each use is by one thread at a time
// (the lane's free list or one queued copy owns it).
unsafe impl Send for Event {}

impl Event {
    pub(crate) fn new() -> Result<Event, DeviceError> {
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: callers have the context current; writes the event handle.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Event(raw))
    }

    /// Destroys the event; the caller has the context current.
    pub(crate) fn destroy(self) {
        // SAFETY: the event is ours and no longer recorded in flight.
        unsafe {
            let _ = sys::cuEventDestroy_v2(self.0);
        }
    }
}
