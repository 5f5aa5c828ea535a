//! Every `unsafe` of the UCX wrapper: thin owners of UCX handles and of the memory UCX
//! writes into, each with the invariant that makes its calls sound.
//!
//! UCX's functions are reached through [`sys::Ucp`], the libucp that [`sys::load`] opens
//! at run time: [`Context::new`] loads it (or fails with [`UcxError::Library`]) and every
//! handle made from the context keeps the `&'static` library it was made with, so no call
//! after the first can find UCX missing.
//!
//! Invariants (the driver in `super::driver` keeps them; nothing else uses this module):
//! 1. **One thread.** A [`Context`], its [`RawWorker`], every [`RawEp`], [`SendOp`] and
//!    [`RecvOp`] are created, used and dropped on the worker's own thread (they hold raw
//!    pointers, so they are neither `Send` nor `Sync`). The worker is created with
//!    `UCS_THREAD_MODE_SINGLE`, which this makes true.
//! 2. **Callbacks only record.** UCX calls [`send_done`], [`recv_done`] and [`ep_failed`]
//!    from inside `ucp_worker_progress` (or `ucp_request_cancel`) on that thread. They
//!    store the status in the operation's [`OpState`] (a `Cell`) and push its id onto a
//!    thread-local list that the driver drains after each progress call; they never free,
//!    never panic and never call back into UCX.
//! 3. **Buffers outlive their requests.** An operation's buffers (the send's parts and
//!    iov array; the receive's slot) are owned by its boxed op, which is
//!    freed only once UCX reported completion. An op dropped before completion is
//!    leaked, never freed (its memory may still be written by UCX until the worker is
//!    destroyed).
//! 4. **Registered memory.** [`Region`] owns plain heap memory that the worker's context
//!    registers once ([`RawWorker::map`]). The registration is released
//!    ([`RawWorker::unmap`]) before the context is cleaned up; the memory lives as long
//!    as any [`RecvSlot`] of it (an `Arc`). A slot is lent to at most one receive at a
//!    time (the free list), and read by its owner only after the receive completed: the
//!    completion travels through a channel, which orders UCX's writes before the reads.
//! 5. **Drop order.** [`RawWorker`] owns its [`Context`] and destroys the worker before
//!    cleaning up the context; endpoints are closed before the worker is destroyed.
//! 6. **The library stays.** [`sys::load`] keeps libucp loaded until the process exits,
//!    so the function pointers every handle holds outlive it.
//! 7. **A probed message is received.** [`RawWorker::probe`] takes a message out of UCX's
//!    unexpected queue (`remove = 1`); the [`Probed`] handle it returns is consumed by
//!    [`RawWorker::recv_probed`], which posts `ucp_tag_msg_recv_nbx` for it (into a buffer
//!    of its length, or of none when it is too long, which UCX completes as truncated),
//!    so no taken message is left unreceived. Its buffer is a `Vec` owned by the op
//!    (invariant 3), handed out with its length set only after a successful completion,
//!    when UCX has written that many bytes.

use std::cell::{Cell, RefCell};
use std::ffi::{CStr, CString, c_void};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use spillway_ucx_sys as sys;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::UcxError;

thread_local! {
    /// Ids of operations whose completion callback ran (invariant 2).
    static COMPLETED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// Endpoints whose error handler ran: (endpoint id, status).
    static EP_ERRORS: RefCell<Vec<(u64, sys::ucs_status_t)>> = const { RefCell::new(Vec::new()) };
}

/// Takes the ids of the operations completed since the last call (this thread's).
pub(super) fn take_completed() -> Vec<u64> {
    COMPLETED.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

/// Takes the endpoint failures reported since the last call (this thread's).
pub(super) fn take_ep_errors() -> Vec<(u64, i8)> {
    EP_ERRORS.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

/// UCX's name for `status`.
pub(super) fn status_name(status: sys::ucs_status_t) -> String {
    // A status comes from a worker, whose context loaded the library: the number is only
    // a fallback that keeps this infallible.
    let Ok(ucp) = sys::load() else {
        return format!("UCX status {status}");
    };
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string for
    // every value, known or not.
    let s = unsafe { CStr::from_ptr(ucp.ucs_status_string(status)) };
    s.to_string_lossy().into_owned()
}

/// `UCS_OK`.
pub(super) const OK: i8 = sys::UCS_OK;
/// `UCS_ERR_CANCELED`.
pub(super) const CANCELED: i8 = sys::UCS_ERR_CANCELED;
/// `UCS_ERR_MESSAGE_TRUNCATED`.
pub(super) const TRUNCATED: i8 = sys::UCS_ERR_MESSAGE_TRUNCATED;

fn check(call: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::Call {
            call,
            status: status_name(status),
        })
    }
}

/// The UCX version the library reports (`unknown` if it cannot be loaded).
pub(super) fn version() -> String {
    let Ok(ucp) = sys::load() else {
        return "unknown".into();
    };
    // SAFETY: returns a pointer to a static NUL-terminated string.
    let s = unsafe { CStr::from_ptr(ucp.ucp_get_version_string()) };
    s.to_string_lossy().into_owned()
}

/// A UCP context with the tag and wake-up features.
pub(super) struct Context {
    h: sys::ucp_context_h,
    ucp: &'static sys::Ucp,
}

impl Context {
    /// Loads libucp (once per process), reads UCX's configuration from the environment
    /// (`UCX_*`) and creates a context. Without the library: [`UcxError::Library`].
    pub(super) fn new() -> Result<Context, UcxError> {
        let ucp = sys::load().map_err(|source| UcxError::Library { source })?;
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null prefix and file mean "the environment"; config is an out pointer.
        check("ucp_config_read", unsafe {
            ucp.ucp_config_read(ptr::null(), ptr::null(), &mut config)
        })?;
        // The defaults are the TCP transport's: UCX warns about settings no transport in
        // use takes, so they apply only where TCP may be used.
        let tcp_in_use = std::env::var("UCX_TLS")
            .map(|tls| tls.contains("tcp") || tls.contains("all") || tls.starts_with('^'))
            .unwrap_or(true);
        for (name, value) in super::UCX_DEFAULTS.iter().filter(|_| tcp_in_use) {
            if std::env::var_os(format!("UCX_{name}")).is_some()
                || std::env::var_os(format!("UCX_TCP_{name}")).is_some()
            {
                continue;
            }
            let (Ok(cname), Ok(cvalue)) = (CString::new(*name), CString::new(*value)) else {
                continue;
            };
            // SAFETY: config came from ucp_config_read and is live; both strings are
            // NUL-terminated and outlive the call (UCX copies the value).
            let status = unsafe { ucp.ucp_config_modify(config, cname.as_ptr(), cvalue.as_ptr()) };
            if status != OK {
                // Not every build of UCX has every transport: a default it does not know
                // is left out.
                tracing::debug!(name, value, status = %status_name(status), "UCX default not applied");
            }
        }
        let params = sys::ucp_params_t {
            field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
            features: u64::from(sys::UCP_FEATURE_TAG | sys::UCP_FEATURE_WAKEUP),
            ..Default::default()
        };
        let mut h: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: params and config are valid for the call; h is an out pointer.
        let status = unsafe {
            ucp.ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut h,
            )
        };
        // SAFETY: config came from ucp_config_read and is not used after this.
        unsafe { ucp.ucp_config_release(config) };
        check("ucp_init", status)?;
        Ok(Context { h, ucp })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: h is a live context; its only worker was destroyed first (invariant 5).
        unsafe { self.ucp.ucp_cleanup(self.h) };
    }
}

/// A UCP worker and the context it belongs to (invariant 5: the worker goes first).
pub(super) struct RawWorker {
    h: sys::ucp_worker_h,
    context: Context,
}

impl RawWorker {
    /// Creates a single-threaded worker on a new context.
    pub(super) fn new() -> Result<RawWorker, UcxError> {
        let context = Context::new()?;
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut h: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: context is live; params valid for the call; h is an out pointer.
        check("ucp_worker_create", unsafe {
            context.ucp.ucp_worker_create(context.h, &params, &mut h)
        })?;
        Ok(RawWorker { h, context })
    }

    /// The worker's address, to hand to peers out of band.
    pub(super) fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: worker live; out pointers valid.
        check("ucp_worker_get_address", unsafe {
            self.context
                .ucp
                .ucp_worker_get_address(self.h, &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at addr, valid until released below.
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: addr came from ucp_worker_get_address of this worker.
        unsafe { self.context.ucp.ucp_worker_release_address(self.h, addr) };
        Ok(bytes)
    }

    /// The worker's event fd, watched by the current tokio runtime: readable when there
    /// may be work for [`RawWorker::progress`] after [`RawWorker::arm`] said `true`. The
    /// fd belongs to the worker; the watcher holds the worker, so the fd stays open for
    /// as long as it is watched.
    pub(super) fn watch_event_fd(self: &Rc<Self>) -> Result<AsyncFd<EventFd>, UcxError> {
        let mut fd: i32 = -1;
        // SAFETY: worker live (context has UCP_FEATURE_WAKEUP); fd is an out pointer.
        check("ucp_worker_get_efd", unsafe {
            self.context.ucp.ucp_worker_get_efd(self.h, &mut fd)
        })?;
        let watched = EventFd {
            fd,
            _worker: Rc::clone(self),
        };
        // SAFETY: fd is open and the same for as long as the worker lives, and `watched`
        // keeps the worker alive until the AsyncFd is dropped.
        unsafe { AsyncFd::register_with_interest(watched, Interest::READABLE) }.map_err(|e| {
            UcxError::Io {
                context: "watching the UCX event fd",
                source: e.into_parts().1,
            }
        })
    }

    /// Progresses communication once; returns how many events it handled (0: idle).
    pub(super) fn progress(&self) -> u32 {
        // SAFETY: worker live, on its own thread (invariant 1).
        unsafe { self.context.ucp.ucp_worker_progress(self.h) }
    }

    /// Arms the event fd. `Ok(true)`: armed, safe to wait on the fd; `Ok(false)`: events
    /// are pending, progress again first.
    pub(super) fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: worker live, on its own thread.
        let status = unsafe { self.context.ucp.ucp_worker_arm(self.h) };
        if status == sys::UCS_ERR_BUSY {
            return Ok(false);
        }
        check("ucp_worker_arm", status).map(|()| true)
    }

    /// Creates an endpoint to the worker at `address` (as [`RawWorker::address`] gave
    /// it), with peer failure reported under `id` ([`take_ep_errors`]).
    ///
    /// `address` must be a UCX worker address: UCX unpacks it without a length check, so
    /// it must come from a trusted channel (the caller's contract, see the module docs of
    /// `super`). An address shorter than a few bytes is refused here.
    pub(super) fn connect(&self, address: &[u8], id: u64) -> Result<RawEp, UcxError> {
        if address.len() < ADDRESS_BYTES_MIN {
            return Err(UcxError::BadAddress {
                address_bytes: address.len(),
            });
        }
        let params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            ),
            address: address.as_ptr().cast(),
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(ep_failed),
                // Not a pointer: the endpoint's id, handed back to ep_failed.
                arg: id as usize as *mut c_void,
            },
            ..Default::default()
        };
        let mut h: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: worker live; params (and the address bytes it points to) valid for the
        // call, UCX copies what it keeps; h is an out pointer.
        check("ucp_ep_create", unsafe {
            self.context.ucp.ucp_ep_create(self.h, &params, &mut h)
        })?;
        Ok(RawEp { h })
    }

    /// Starts closing `ep`: gracefully (flushing its sends) or, with `force`, at once
    /// (for a failed endpoint, or at shutdown). Returns the close request to poll with
    /// [`CloseOp::is_done`], if it did not finish at once.
    pub(super) fn close(&self, ep: RawEp, force: bool) -> Option<CloseOp> {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if force {
                sys::UCP_EP_CLOSE_FLAG_FORCE
            } else {
                0
            },
            ..Default::default()
        };
        // SAFETY: ep is a live endpoint of this worker, consumed here (never used again).
        let r = unsafe { self.context.ucp.ucp_ep_close_nbx(ep.h, &param) };
        // `ep` is consumed: its handle is never used again.
        let _ = ep;
        if sys::status_ptr_is_ptr(r) {
            Some(CloseOp {
                req: r,
                worker: self.h,
                ucp: self.context.ucp,
            })
        } else {
            None
        }
    }

    /// Registers `region`'s memory with the context (once, for every receive into it).
    pub(super) fn map(&self, region: &Region) -> Result<MemHandle, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            ),
            address: region.base.as_ptr().cast(),
            length: region.total_bytes(),
            ..Default::default()
        };
        let mut h: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: context live; the region's memory is allocated and stays so for longer
        // than the registration (invariant 4); h is an out pointer.
        check("ucp_mem_map", unsafe {
            self.context
                .ucp
                .ucp_mem_map(self.context.h, &params, &mut h)
        })?;
        Ok(MemHandle { h })
    }

    /// Releases a registration made by [`RawWorker::map`].
    pub(super) fn unmap(&self, memh: MemHandle) -> Result<(), UcxError> {
        // SAFETY: memh came from ucp_mem_map on this context, and no receive using it is
        // still posted (the driver unmaps after the last one completed or was leaked with
        // the worker about to be destroyed).
        check("ucp_mem_unmap", unsafe {
            self.context.ucp.ucp_mem_unmap(self.context.h, memh.h)
        })
    }

    /// Posts a tagged send of `parts`, back to back, as one message (an iov: no copy).
    pub(super) fn send(
        &self,
        ep: &RawEp,
        id: u64,
        tag: u64,
        parts: Vec<Bytes>,
    ) -> Result<SendOp, UcxError> {
        let iov: Vec<sys::ucp_dt_iov_t> = parts
            .iter()
            .map(|p| sys::ucp_dt_iov_t {
                buffer: p.as_ptr().cast_mut().cast(),
                length: p.len(),
            })
            .collect();
        let iov_count = iov.len();
        let (op, state) = PostedOp::new(self.context.ucp, id, SendData { iov, _parts: parts });
        let mut cb = sys::ucp_request_param_t__bindgen_ty_1::default();
        cb.send = Some(send_done);
        // SAFETY: inner is a live allocation owned by this op until freed in
        // SendOp::drop after completion (invariant 3).
        let iov = unsafe { (*op.inner.as_ptr()).data.iov.as_ptr() };
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FIELD_DATATYPE
                | sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            cb,
            datatype: u64::from(sys::UCP_DATATYPE_IOV),
            user_data: state.cast(),
            ..Default::default()
        };
        // SAFETY: ep live; the iov array (its heap buffer does not move: the Vec is never
        // touched again) and the buffers it points to live in `inner` until completion
        // (invariant 3); send_done only touches `state`.
        let r = unsafe {
            self.context
                .ucp
                .ucp_tag_send_nbx(ep.h, iov.cast(), iov_count, tag, &param)
        };
        op.set_request(r, "ucp_tag_send_nbx")?;
        Ok(op)
    }

    /// Posts a tagged receive of one message matching `tag` under `tag_mask` into `slot`.
    pub(super) fn recv(
        &self,
        memh: &MemHandle,
        id: u64,
        tag: u64,
        tag_mask: u64,
        slot: RecvSlot,
    ) -> Result<RecvOp, UcxError> {
        let (buf, len) = slot.raw_parts();
        let (op, param) = self.recv_op(id, Some(slot), None, Some(memh));
        // SAFETY: worker live; buf..buf+len is a slot of the registered region, lent to
        // this receive alone and kept alive by `inner` (invariant 4).
        let r = unsafe {
            self.context
                .ucp
                .ucp_tag_recv_nbx(self.h, buf.cast(), len, tag, tag_mask, &param)
        };
        op.set_request(r, "ucp_tag_recv_nbx")?;
        Ok(op)
    }

    /// Takes the first message matching `tag` under `tag_mask` out of UCX's unexpected
    /// queue, if one is there; it must be handed to [`RawWorker::recv_probed`]
    /// (invariant 7).
    pub(super) fn probe(&self, tag: u64, tag_mask: u64) -> Option<Probed> {
        let mut info = sys::ucp_tag_recv_info_t::default();
        // SAFETY: worker live; info is an out parameter valid for the call.
        let h = unsafe {
            self.context
                .ucp
                .ucp_tag_probe_nb(self.h, tag, tag_mask, 1, &mut info)
        };
        (!h.is_null()).then_some(Probed {
            h,
            length: info.length,
        })
    }

    /// Receives a probed message into a buffer of its own length, or, when it is longer
    /// than `max_bytes`, into none (it completes as truncated and its bytes are dropped).
    pub(super) fn recv_probed(
        &self,
        id: u64,
        probed: Probed,
        max_bytes: usize,
    ) -> Result<RecvOp, UcxError> {
        let len = if probed.length <= max_bytes {
            probed.length
        } else {
            0
        };
        let mut buf: Vec<u8> = Vec::with_capacity(len.max(1));
        let ptr = buf.as_mut_ptr();
        let (op, param) = self.recv_op(id, None, Some(buf), None);
        // SAFETY: worker live; probed.h came from this worker's probe and is consumed
        // here, once (invariant 7); ptr..ptr+len is the capacity of the Vec that `inner`
        // owns until completion (invariant 3).
        let r = unsafe {
            self.context
                .ucp
                .ucp_tag_msg_recv_nbx(self.h, ptr.cast(), len, probed.h, &param)
        };
        op.set_request(r, "ucp_tag_msg_recv_nbx")?;
        Ok(op)
    }

    /// A receive's op, owning where it lands (`slot` or `owned`), and the request
    /// parameters that report its completion to [`recv_done`] (with `memh` when it lands
    /// in registered memory).
    fn recv_op(
        &self,
        id: u64,
        slot: Option<RecvSlot>,
        owned: Option<Vec<u8>>,
        memh: Option<&MemHandle>,
    ) -> (RecvOp, sys::ucp_request_param_t) {
        let (op, state) = PostedOp::new(self.context.ucp, id, RecvData { slot, owned });
        let mut cb = sys::ucp_request_param_t__bindgen_ty_1::default();
        cb.recv = Some(recv_done);
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            cb,
            user_data: state,
            ..Default::default()
        };
        if let Some(memh) = memh {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
            param.memh = memh.h;
        }
        (op, param)
    }

    /// Asks UCX to cancel a posted receive; its callback then reports `UCS_ERR_CANCELED`
    /// (or its real status, if it had already completed).
    pub(super) fn cancel(&self, op: &RecvOp) {
        // SAFETY: req is this worker's live request (not freed before completion).
        let req = unsafe { (*op.inner.as_ptr()).req };
        if !req.is_null() {
            // SAFETY: as above.
            unsafe { self.context.ucp.ucp_request_cancel(self.h, req) };
        }
    }
}

impl Drop for RawWorker {
    fn drop(&mut self) {
        // SAFETY: worker live; called on its thread; its context is cleaned up after
        // this (field drop order).
        unsafe { self.context.ucp.ucp_worker_destroy(self.h) };
    }
}

/// A worker's event fd, with the worker that owns it (see [`RawWorker::watch_event_fd`]).
pub(super) struct EventFd {
    fd: RawFd,
    _worker: Rc<RawWorker>,
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

/// Shortest worker address we hand to UCX (its header alone is longer).
const ADDRESS_BYTES_MIN: usize = 8;

/// An endpoint to a peer's worker.
pub(super) struct RawEp {
    h: sys::ucp_ep_h,
}

/// An endpoint being closed.
pub(super) struct CloseOp {
    req: sys::ucs_status_ptr_t,
    worker: sys::ucp_worker_h,
    ucp: &'static sys::Ucp,
}

impl CloseOp {
    /// Whether the close finished (then the request is freed).
    pub(super) fn is_done(&mut self) -> bool {
        if self.req.is_null() {
            return true;
        }
        // SAFETY: req is a live request of this thread's worker.
        let status = unsafe { self.ucp.ucp_request_check_status(self.req) };
        if status == sys::UCS_INPROGRESS {
            return false;
        }
        // SAFETY: completed; freed once, then forgotten.
        unsafe { self.ucp.ucp_request_free(self.req) };
        self.req = ptr::null_mut();
        true
    }

    /// Cancels the (force) close's request if it is still pending, at shutdown.
    pub(super) fn abandon(mut self) {
        if !self.is_done() {
            // SAFETY: live request of this worker; cancelled, then released: UCX frees
            // it when it completes, no callback was set.
            unsafe {
                self.ucp.ucp_request_cancel(self.worker, self.req);
                self.ucp.ucp_request_free(self.req);
            }
        }
    }
}

/// A registration of a [`Region`].
pub(super) struct MemHandle {
    h: sys::ucp_mem_h,
}

/// Completion of one operation, written by its callback (invariant 2).
struct OpState {
    id: u64,
    status: Cell<Option<sys::ucs_status_t>>,
    received_bytes: Cell<usize>,
    sender_tag: Cell<u64>,
}

impl OpState {
    fn new(id: u64) -> OpState {
        OpState {
            id,
            status: Cell::new(None),
            received_bytes: Cell::new(0),
            sender_tag: Cell::new(0),
        }
    }
}

fn record_completion(id: u64) {
    COMPLETED.with(|c| {
        if let Ok(mut v) = c.try_borrow_mut() {
            v.push(id);
        }
    });
}

unsafe extern "C" fn send_done(_req: *mut c_void, status: sys::ucs_status_t, data: *mut c_void) {
    // SAFETY: data is the OpState of a live SendOp (invariant 3); only Cells are set.
    let state = unsafe { &*data.cast::<OpState>() };
    state.status.set(Some(status));
    record_completion(state.id);
}

unsafe extern "C" fn recv_done(
    _req: *mut c_void,
    status: sys::ucs_status_t,
    info: *const sys::ucp_tag_recv_info_t,
    data: *mut c_void,
) {
    // SAFETY: data is the OpState of a live RecvOp (invariant 3).
    let state = unsafe { &*data.cast::<OpState>() };
    if status == sys::UCS_OK && !info.is_null() {
        // SAFETY: UCX passes a valid info for a completed receive.
        let info = unsafe { &*info };
        state.received_bytes.set(info.length);
        state.sender_tag.set(info.sender_tag);
    }
    state.status.set(Some(status));
    record_completion(state.id);
}

unsafe extern "C" fn ep_failed(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    EP_ERRORS.with(|c| {
        if let Ok(mut v) = c.try_borrow_mut() {
            v.push((arg as usize as u64, status));
        }
    });
}

/// What a send keeps alive until it completes: the iov array and the buffers it points to.
pub(super) struct SendData {
    iov: Vec<sys::ucp_dt_iov_t>,
    _parts: Vec<Bytes>,
}

/// Where a receive lands: a slot (`RawWorker::recv`), or, for a probed message
/// (`RawWorker::recv_probed`), a buffer whose capacity is its length.
pub(super) struct RecvData {
    slot: Option<RecvSlot>,
    owned: Option<Vec<u8>>,
}

/// An op while UCX may hold it: its completion (written by its callback), its request,
/// and what it keeps alive.
struct OpInner<T> {
    state: OpState,
    req: sys::ucs_status_ptr_t,
    data: T,
}

/// A posted send or receive. Dropped after completion it frees its request and what it
/// kept alive; dropped before, it leaks them (invariant 3).
pub(super) struct PostedOp<T> {
    inner: NonNull<OpInner<T>>,
    ucp: &'static sys::Ucp,
}

/// A posted send.
pub(super) type SendOp = PostedOp<SendData>;
/// A posted receive.
pub(super) type RecvOp = PostedOp<RecvData>;

impl<T> PostedOp<T> {
    /// The op `id` keeping `data` alive, not yet posted, and the `user_data` its callback
    /// gets (its [`OpState`]). Leaked until `drop` after completion (invariant 3).
    fn new(ucp: &'static sys::Ucp, id: u64, data: T) -> (PostedOp<T>, *mut c_void) {
        let inner = NonNull::from(Box::leak(Box::new(OpInner {
            state: OpState::new(id),
            req: ptr::null_mut(),
            data,
        })));
        // SAFETY: inner is live until drop after completion (invariant 3).
        let state = unsafe { ptr::addr_of!((*inner.as_ptr()).state).cast_mut() };
        (PostedOp { inner, ucp }, state.cast())
    }

    /// Takes what `call` returned: an error (the op counts as completed, and UCX keeps
    /// no reference), done at once (null), or a request to free after completion.
    fn set_request(&self, r: sys::ucs_status_ptr_t, call: &'static str) -> Result<(), UcxError> {
        // SAFETY: inner live; only this thread touches it outside callbacks.
        let inner = unsafe { &mut *self.inner.as_ptr() };
        if sys::status_ptr_is_err(r) {
            inner.state.status.set(Some(sys::status_ptr_status(r)));
            return Err(UcxError::Call {
                call,
                status: status_name(sys::status_ptr_status(r)),
            });
        }
        if r.is_null() {
            inner.state.status.set(Some(sys::UCS_OK));
        }
        inner.req = r;
        Ok(())
    }

    /// The completion status, once the callback ran.
    pub(super) fn status(&self) -> Option<i8> {
        // SAFETY: inner live; read on the worker's thread.
        unsafe { (*self.inner.as_ptr()).state.status.get() }
    }
}

impl<T> Drop for PostedOp<T> {
    fn drop(&mut self) {
        if self.status().is_none() {
            // Still owned by UCX, and so is what it keeps alive: leak both (invariant 3).
            return;
        }
        // SAFETY: completed: UCX no longer touches inner; we own it (Box::leak in new).
        let inner = unsafe { Box::from_raw(self.inner.as_ptr()) };
        if sys::status_ptr_is_ptr(inner.req) {
            // SAFETY: completed request of this worker, freed once.
            unsafe { self.ucp.ucp_request_free(inner.req) };
        }
    }
}

/// A message taken out of the unexpected queue by [`RawWorker::probe`], to be received
/// with [`RawWorker::recv_probed`] (invariant 7).
pub(super) struct Probed {
    h: sys::ucp_tag_message_h,
    length: usize,
}

/// Where a completed receive's bytes are.
pub(super) enum Landed {
    /// In a registered slot.
    Slot(RecvSlot),
    /// In a buffer of its own.
    Owned(Vec<u8>),
}

impl RecvOp {
    /// After a successful completion: where the message landed, its length set, and the
    /// sender's tag.
    pub(super) fn take_received(&mut self) -> Option<(Landed, u64)> {
        if self.status() != Some(sys::UCS_OK) {
            return None;
        }
        // SAFETY: completed: UCX no longer writes inner, the slot or the buffer.
        let inner = unsafe { &mut *self.inner.as_ptr() };
        let received = inner.state.received_bytes.get();
        let landed = if let Some(mut slot) = inner.data.slot.take() {
            slot.len = received.min(slot.region.slot_bytes);
            Landed::Slot(slot)
        } else {
            let mut buf = inner.data.owned.take()?;
            let len = received.min(buf.capacity());
            // SAFETY: the receive completed successfully, so UCX wrote the message's
            // `received` bytes from the start of the buffer (invariant 7); no more than
            // its capacity is exposed.
            unsafe { buf.set_len(len) };
            Landed::Owned(buf)
        };
        Some((landed, inner.state.sender_tag.get()))
    }
}

/// Memory for receives: `slots_count` slots of `slot_bytes`, registered once with UCX.
pub(crate) struct Region {
    base: NonNull<u8>,
    slot_bytes: usize,
    slots_count: usize,
    free: Mutex<Vec<usize>>,
}

// SAFETY: the memory is plain bytes; who may touch which slot is decided by the free list
// (a Mutex) and completion channels (invariant 4).
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// Allocates `slots_count * slot_bytes` zeroed bytes (both checked non-zero and their
    /// product to fit by the caller's config validation).
    pub(crate) fn new(slot_bytes: usize, slots_count: usize) -> Arc<Region> {
        let total = slot_bytes * slots_count;
        let mem: Box<[u8]> = vec![0u8; total].into_boxed_slice();
        let base = NonNull::from(Box::leak(mem)).cast::<u8>();
        Arc::new(Region {
            base,
            slot_bytes,
            slots_count,
            free: Mutex::new((0..slots_count).rev().collect()),
        })
    }

    fn total_bytes(&self) -> usize {
        self.slot_bytes * self.slots_count
    }

    /// The bytes of one slot.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Lends a free slot, if any.
    pub(crate) fn take_slot(self: &Arc<Region>) -> Option<RecvSlot> {
        let index = self.free.lock().ok()?.pop()?;
        Some(RecvSlot {
            region: Arc::clone(self),
            index,
            len: 0,
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let total = self.total_bytes();
        // SAFETY: base came from Box::leak of a boxed slice of `total` bytes; no slot is
        // lent (each holds an Arc), and the registration was released (invariant 4).
        drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(self.base.as_ptr(), total)) });
    }
}

/// One slot of a [`Region`], lent to one receive and then to its reader; returned to the
/// free list on drop.
pub(crate) struct RecvSlot {
    region: Arc<Region>,
    index: usize,
    len: usize,
}

impl RecvSlot {
    fn raw_parts(&self) -> (*mut u8, usize) {
        // SAFETY: index < slots_count, so the offset stays inside the allocation.
        let p = unsafe {
            self.region
                .base
                .as_ptr()
                .add(self.index * self.region.slot_bytes)
        };
        (p, self.region.slot_bytes)
    }

    /// The received bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        let (p, _) = self.raw_parts();
        // SAFETY: the slot is lent to this owner alone; the receive into it completed
        // before the slot left the driver (invariant 4); len <= slot_bytes.
        unsafe { std::slice::from_raw_parts(p, self.len) }
    }
}

impl Drop for RecvSlot {
    fn drop(&mut self) {
        if let Ok(mut free) = self.region.free.lock() {
            free.push(self.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ucs_status_string` is libucs's: the loaded library reaches it through libucp's
    /// dependencies, so names are UCX's own, not the numeric fallback.
    #[test]
    fn status_names_come_from_libucs() {
        assert_eq!(status_name(OK), "Success");
        assert_eq!(status_name(CANCELED), "Request canceled");
        assert!(!version().is_empty() && version() != "unknown");
    }
}
