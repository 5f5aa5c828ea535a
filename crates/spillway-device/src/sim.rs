//! The `sim` backend: device memory is host memory under a hard budget.
//!
//! Frames and host slots are two page-aligned regions allocated and pre-faulted at
//! creation, so the budget is real memory and no copy pays for first-touch page faults.
//! Copies are real CPU copies on one thread per direction (the "streams"), so they
//! overlap with the caller's compute exactly as DMA engines would; a copy completes in
//! submission order within its direction. Like a DMA copy they leave the destination out
//! of the CPU caches (module `uncached`), so a page copied just before a kernel reads
//! it computes no faster than a resident one. Kernels run on the calling thread.
//!
//! An acquired buffer whose pages sit in consecutive frames (the core places a buffer's
//! pages that way when it can) is one array at its first frame's address
//! ([`Device::acquire_ptr`]); otherwise it is seen page by page.
//!
//! Two sim devices model two GPUs of one host with a peer link: one made with
//! [`SimDevice::lending`] keeps frames beyond its own budget that it lends
//! ([`SimDevice::lease`], a [`PeerLease`]); the other copies to and from them on two more
//! threads ([`SimDevice::attach_peer`], [`Direction::PeerToDevice`] and
//! [`Direction::DeviceToPeer`]). The lease carries the lender's requests to take frames
//! back and the borrower's answer (see [`PeerLease`]).
//!
//! A diagnostic, `SPILLWAY_SIM_COPY_GBPS=<decimal GB/s>`: each copy stream of a sim
//! device made after it is set moves at most that many bytes per second (a copy ends no
//! sooner than its bytes at that rate after it began), so a CPU stands in for a GPU whose
//! copies are slow next to its compute: the copy-bound phases of real jobs (a training
//! step's optimizer) show on a machine without a GPU. Unset, copies go at memcpy speed.
//! The pace is kept by sleeping out each copy's rest, so it holds for pages of 1 MiB and
//! more; a smaller page at a slow pace runs a little slower than asked (a sleep's
//! overshoot, tens of microseconds, per page).
//!
//! Safety rests on the pool's contract (see the crate docs): a frame or slot used by a
//! copy in flight is touched by nobody else, so the copy threads' raw-pointer copies never
//! race with other access.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use spillway_types::{BufferId, Direction, Far, FrameId, HostSlot, PeerFrameId, pattern};

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
    /// Frames after the budget's, lent to a neighbour (`SimDevice::lending`).
    lendable: u32,
    /// Each copy stream's pace in bytes per second (`SPILLWAY_SIM_COPY_GBPS`), if any.
    pace_bytes_per_s: Option<f64>,
}

/// The environment variable that paces a sim device's copies (see the module docs).
pub const COPY_PACE_VAR: &str = "SPILLWAY_SIM_COPY_GBPS";

/// The pace `value` of [`COPY_PACE_VAR`] asks for, in bytes per second: a positive,
/// finite decimal number of GB/s (10^9 bytes). An error names what is wrong.
pub fn parse_copy_pace(value: &str) -> Result<f64, DeviceError> {
    match value.trim().parse::<f64>() {
        Ok(gbps) if gbps.is_finite() && gbps > 0.0 => Ok(gbps * 1e9),
        _ => Err(DeviceError::Driver {
            op: "sim copy pace",
            message: format!("{COPY_PACE_VAR}={value:?}: expected a positive number of GB/s"),
        }),
    }
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
    /// Lent frame `i`: frame `config.frames + i` of the region.
    fn lent(&self, i: u32) -> *mut u8 {
        assert!(i < self.lendable, "lent frame {i} of {}", self.lendable);
        self.frames
            .at(u64::from(self.config.frames + i) * self.config.page_bytes)
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
    memory: Arc<Memory>,
    /// One copy thread per direction ([`Direction::index`]); the peer ones once a peer
    /// is attached.
    streams: [OnceLock<mpsc::Sender<Job>>; 4],
    threads: Mutex<Vec<JoinHandle<()>>>,
    sink: CompletionSink,
    /// The frames this device borrows.
    peer: OnceLock<PeerLease>,
    /// The lease of the frames this device lends (one at most).
    lent_out: OnceLock<PeerLease>,
    /// What the pool last expected of each buffer's next view ([`Device::expect_view`]):
    /// nothing is mapped here, it is kept for [`SimDevice::expected_view`].
    expected_views: Mutex<HashMap<BufferId, bool>>,
}

/// Frames one sim device lends another: the lender's memory, how many of its lendable
/// frames are lent now, and the handshake by which the lender takes some back.
///
/// The borrower uses peer frames `0..lent()`. To take frames back the lender asks for a
/// smaller count ([`PeerLease::ask_back`], which wakes the borrower through the waker it
/// set); the borrower's pool stops using the frames above it (copies on them finish
/// first) and answers with [`PeerLease::give_back`]; the lender sees the answer in
/// [`PeerLease::lent`] or waits for it ([`PeerLease::wait_given_back`]). Cheap to clone:
/// both sides hold one.
#[derive(Clone)]
pub struct PeerLease {
    memory: Arc<Memory>,
    state: Arc<LeaseState>,
}

struct LeaseState {
    /// Frames the borrower may use now.
    lent: AtomicU32,
    /// Frames the lender wants lent at most (`u32::MAX`: nothing asked).
    wanted: AtomicU32,
    /// Called when the lender asks frames back (the borrower's pool sets it).
    waker: Mutex<Option<Waker>>,
    /// Guards the changes of `lent` and `wanted` (so a give-back never undoes a lend that
    /// came after the count it answers), and is signalled when frames come back.
    given: (Mutex<()>, Condvar),
    /// A device borrows through this lease (one at most).
    attached: std::sync::atomic::AtomicBool,
}

/// What wakes the borrower.
type Waker = Arc<dyn Fn() + Send + Sync>;

impl PeerLease {
    /// Peer frames the borrower may use now.
    pub fn lent(&self) -> u32 {
        self.state.lent.load(Ordering::Acquire)
    }

    /// The count the lender asked to come down to, while the borrower has not answered.
    pub fn asked_back(&self) -> Option<u32> {
        let wanted = self.state.wanted.load(Ordering::Acquire);
        (wanted < self.lent()).then_some(wanted)
    }

    /// The lender wants at most `frames` lent: the borrower answers through
    /// [`PeerLease::give_back`] once it no longer uses the frames above.
    pub fn ask_back(&self, frames: u32) {
        {
            let _held = self.state.given.0.lock().expect("lease lock poisoned");
            self.state.wanted.fetch_min(frames, Ordering::AcqRel);
        }
        self.wake();
    }

    /// The borrower no longer uses peer frames `frames..`: they are the lender's again.
    /// Only an answer to a request counts ([`PeerLease::ask_back`] of `frames` or fewer
    /// still standing): one that a new [`PeerLease::lend`] overtook changes nothing.
    pub fn give_back(&self, frames: u32) {
        let (lock, given) = &self.state.given;
        let _held = lock.lock().expect("lease lock poisoned");
        if self.state.wanted.load(Ordering::Acquire) <= frames {
            self.state.lent.fetch_min(frames, Ordering::AcqRel);
            given.notify_all();
        }
    }

    /// The borrower is gone: every frame is the lender's again.
    fn detach(&self) {
        let (lock, given) = &self.state.given;
        let _held = lock.lock().expect("lease lock poisoned");
        self.state.lent.store(0, Ordering::Release);
        self.state.wanted.store(u32::MAX, Ordering::Release);
        given.notify_all();
    }

    /// Waits until at most `frames` are lent, or `timeout` passes; how long it waited,
    /// or `None` at the timeout.
    pub fn wait_given_back(&self, frames: u32, timeout: Duration) -> Option<Duration> {
        let started = Instant::now();
        let (lock, given) = &self.state.given;
        let held = lock.lock().expect("lease lock poisoned");
        let (_held, waited) = given
            .wait_timeout_while(held, timeout, |_| self.lent() > frames)
            .expect("lease lock poisoned");
        (!waited.timed_out() || self.lent() <= frames).then(|| started.elapsed())
    }

    /// Sets what [`PeerLease::ask_back`] calls to wake the borrower.
    pub fn set_waker(&self, wake: Waker) {
        *self.state.waker.lock().expect("lease waker poisoned") = Some(wake);
    }

    /// The lender lends up to `frames` (at most what it can lend): frames given back may
    /// be lent anew, and a request to take frames back is withdrawn. Fewer than are lent
    /// now is a request to take the rest back ([`PeerLease::ask_back`]): frames the
    /// borrower may be copying to are never taken without its answer. Wakes the borrower.
    pub fn lend(&self, frames: u32) {
        let frames = frames.min(self.memory.lendable);
        if frames < self.lent() {
            return self.ask_back(frames);
        }
        {
            let _held = self.state.given.0.lock().expect("lease lock poisoned");
            self.state.wanted.store(u32::MAX, Ordering::Release);
            self.state.lent.fetch_max(frames, Ordering::AcqRel);
        }
        self.wake();
    }

    fn wake(&self) {
        let waker = self
            .state
            .waker
            .lock()
            .expect("lease waker poisoned")
            .clone();
        if let Some(wake) = waker {
            wake();
        }
    }

    /// Bytes of one frame.
    pub fn page_bytes(&self) -> u64 {
        self.memory.config.page_bytes
    }
}

impl std::fmt::Debug for PeerLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerLease")
            .field("lent", &self.lent())
            .field("asked_back", &self.asked_back())
            .finish()
    }
}

impl SimDevice {
    /// Whether the pool last expected `buffer`'s next acquire to view it whole (`None`:
    /// it has said nothing of it). Tests of the pool's expectations.
    pub fn expected_view(&self, buffer: BufferId) -> Option<bool> {
        self.expected_views
            .lock()
            .expect("expected-views lock poisoned")
            .get(&buffer)
            .copied()
    }

    /// Allocates (and pre-faults) the frames and slots, and starts the two host copy
    /// threads (the peer's two start with [`SimDevice::attach_peer`]).
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
        Self::build(config, host, 0, sink)
    }

    /// [`SimDevice::new`] whose copy streams each move at most `bytes_per_s` (what
    /// `SPILLWAY_SIM_COPY_GBPS` sets for the other constructors; see the module docs).
    pub fn paced(
        config: DeviceConfig,
        bytes_per_s: f64,
        sink: CompletionSink,
    ) -> Result<SimDevice, DeviceError> {
        Self::build_paced(config, None, 0, Some(bytes_per_s), sink)
    }

    /// [`SimDevice::new`] with `lendable` frames of device memory beyond the budget, for
    /// a neighbour to borrow through [`SimDevice::lease`].
    pub fn lending(
        config: DeviceConfig,
        lendable: u32,
        sink: CompletionSink,
    ) -> Result<SimDevice, DeviceError> {
        Self::build(config, None, lendable, sink)
    }

    /// Lends `frames` of this device's lendable frames (all of them at most) to a
    /// neighbour, which attaches the lease ([`SimDevice::attach_peer`]). One lease per
    /// device: a later call lends through the same lease ([`PeerLease::lend`]), so no two
    /// borrowers ever share frames.
    pub fn lease(&self, frames: u32) -> PeerLease {
        let lease = self.lent_out.get_or_init(|| PeerLease {
            memory: self.memory.clone(),
            state: Arc::new(LeaseState {
                lent: AtomicU32::new(0),
                wanted: AtomicU32::new(u32::MAX),
                waker: Mutex::new(None),
                given: (Mutex::new(()), Condvar::new()),
                attached: std::sync::atomic::AtomicBool::new(false),
            }),
        });
        lease.lend(frames);
        lease.clone()
    }

    /// Borrows the frames of `lease` (made by another sim device) as this device's
    /// peer-GPU tier (copies in the peer directions use its frames). Once per device, and
    /// one device per lease.
    pub fn attach_peer(&self, lease: PeerLease) -> Result<(), DeviceError> {
        if lease.page_bytes() != self.memory.config.page_bytes {
            return Err(DeviceError::Driver {
                op: "attach peer",
                message: format!(
                    "the peer's pages are {} bytes, this device's {}",
                    lease.page_bytes(),
                    self.memory.config.page_bytes
                ),
            });
        }
        if self.peer.get().is_some() {
            return Err(DeviceError::Driver {
                op: "attach peer",
                message: "a peer is attached already".into(),
            });
        }
        if lease.state.attached.swap(true, Ordering::AcqRel) {
            return Err(DeviceError::Driver {
                op: "attach peer",
                message: "the lease is borrowed by another device already".into(),
            });
        }
        self.start_stream(Direction::PeerToDevice)?;
        self.start_stream(Direction::DeviceToPeer)?;
        self.peer.set(lease).map_err(|_| DeviceError::Driver {
            op: "attach peer",
            message: "a peer is attached already".into(),
        })
    }

    /// Frames beyond the budget that this device can lend.
    pub fn lendable_frames(&self) -> u32 {
        self.memory.lendable
    }

    /// The lease of the peer attached, if any.
    pub fn peer(&self) -> Option<&PeerLease> {
        self.peer.get()
    }

    fn build(
        config: DeviceConfig,
        host: Option<HostMemory>,
        lendable: u32,
        sink: CompletionSink,
    ) -> Result<SimDevice, DeviceError> {
        let pace = match std::env::var(COPY_PACE_VAR) {
            Ok(v) => Some(parse_copy_pace(&v)?),
            Err(_) => None,
        };
        Self::build_paced(config, host, lendable, pace, sink)
    }

    fn build_paced(
        config: DeviceConfig,
        host: Option<HostMemory>,
        lendable: u32,
        pace_bytes_per_s: Option<f64>,
        sink: CompletionSink,
    ) -> Result<SimDevice, DeviceError> {
        let frames = Region::new(
            (u64::from(config.frames) + u64::from(lendable)) * config.page_bytes,
            "device",
        )?;
        let slot_bytes = u64::from(config.host_slots) * config.page_bytes;
        let slots = match host {
            Some(memory) => Region::external(memory, slot_bytes)?,
            None => Region::new(slot_bytes, "host")?,
        };
        let memory = Arc::new(Memory {
            frames,
            slots,
            config,
            lendable,
            pace_bytes_per_s,
        });
        let device = SimDevice {
            memory,
            streams: Default::default(),
            threads: Mutex::new(Vec::new()),
            sink,
            peer: OnceLock::new(),
            lent_out: OnceLock::new(),
            expected_views: Mutex::new(HashMap::new()),
        };
        device.start_stream(Direction::HostToDevice)?;
        device.start_stream(Direction::DeviceToHost)?;
        Ok(device)
    }

    /// Starts the copy thread of `direction` (once).
    fn start_stream(&self, direction: Direction) -> Result<(), DeviceError> {
        if self.streams[direction.index()].get().is_some() {
            return Ok(());
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let memory = self.memory.clone();
        let sink = self.sink.clone();
        let handle = std::thread::Builder::new()
            .name(format!("spillway-{direction:?}"))
            .spawn(move || copy_stream(&memory, &rx, &sink))
            .map_err(|e| DeviceError::Driver {
                op: "spawn copy thread",
                message: e.to_string(),
            })?;
        let _ = self.streams[direction.index()].set(tx);
        self.threads
            .lock()
            .expect("copy threads lock poisoned")
            .push(handle);
        Ok(())
    }

    /// The far side's bytes of `op`: a slot of this device's host tier, or a frame the
    /// attached peer lent. An error for a copy the device cannot make (no peer, a frame
    /// not lent now, a far side of the other kind).
    fn far_ptr(&self, op: &CopyOp) -> Result<*mut u8, DeviceError> {
        let refused = |message: String| DeviceError::Driver {
            op: "peer copy",
            message,
        };
        if !op.far_matches() {
            return Err(refused(format!(
                "{:?} with far side {:?}",
                op.direction, op.far
            )));
        }
        match op.far {
            Far::Host(slot) => Ok(self.memory.slot(slot)),
            Far::Peer(PeerFrameId(i)) => {
                let lease = self
                    .peer
                    .get()
                    .ok_or_else(|| refused("no peer GPU is attached".into()))?;
                if i >= lease.lent() {
                    return Err(refused(format!(
                        "peer frame {i} is not lent (the peer lends {})",
                        lease.lent()
                    )));
                }
                Ok(lease.memory.lent(i))
            }
        }
    }
}

/// A copy a stream thread makes: the frame, the far side, which way, and where the
/// result goes.
struct Job {
    op: CopyOp,
    far: Result<*mut u8, DeviceError>,
    /// The peer's memory, for a peer copy: `far` points into it, so it lives as long.
    _peer: Option<Arc<Memory>>,
}

/// Copies an unpaced stream makes before reporting the first of them, when they are
/// queued already: the completions then come as one burst ([`Completion::follows`]), as
/// the CUDA device's completion thread reports copies it finds finished together.
const COMPLETION_BURST_MAX: usize = 8;

fn copy_stream(memory: &Memory, rx: &mpsc::Receiver<Job>, sink: &CompletionSink) {
    // The copies done and not reported yet, of the burst under way.
    let mut done: Vec<Completion> = Vec::new();
    while let Some(Job { op, far, .. }) = rx.try_recv().ok().or_else(|| {
        // Nothing queued: the burst ends, and the stream waits for the next copy.
        report(sink, &mut done);
        rx.recv().ok()
    }) {
        let began = Instant::now();

        let result = check_range(0, op.bytes, memory.config.page_bytes)
            .and(far)
            .map(|far| {
                let frame = memory.frame(op.frame);
                let (src, dst) = if op.direction.into_frame() {
                    (far, frame)
                } else {
                    (frame, far)
                };
                // SAFETY: both ranges are inside their regions (checked above, and the
                // far side resolved by `far_ptr`) and, by the pool's contract, nobody
                // else touches this frame or far side during the copy. A frame and its
                // far side live in different regions (a peer's frames are another
                // device's), so they never overlap. Uncached, so the copied page is not
                // hotter for the next kernel than a page copied earlier or resident: a
                // GPU copy leaves nothing in the CPU cache.
                unsafe { copy_uncached(src, dst, op.bytes as usize) };
            });
        if let Some(rate) = memory.pace_bytes_per_s {
            // The modelled engine is busy until its bytes have gone at the pace.
            let busy = Duration::from_secs_f64(op.bytes as f64 / rate);
            if let Some(rest) = busy.checked_sub(began.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        done.push(Completion {
            id: op.id,
            result,
            follows: false,
        });
        // A paced stream is an engine busy for each copy's time: it reports each at once.
        if memory.pace_bytes_per_s.is_some() || done.len() >= COMPLETION_BURST_MAX {
            report(sink, &mut done);
        }
    }
    report(sink, &mut done);
}

/// Reports the completions of a burst, each but the last saying that another follows.
fn report(sink: &CompletionSink, done: &mut Vec<Completion>) {
    let n = done.len();
    for (k, mut c) in done.drain(..).enumerate() {
        c.follows = k + 1 < n;
        sink(c);
    }
}

// SAFETY: the pointer in a `Job` is into a region that outlives the job (the copy
// thread's own `Arc<Memory>`, or the peer's, which the job holds), and is touched only by
// that copy under the pool's contract.
unsafe impl Send for Job {}

impl Drop for SimDevice {
    fn drop(&mut self) {
        for s in &mut self.streams {
            s.take();
        }
        // Copies still queued keep the peer's memory alive (their `Job`); the frames are
        // the lender's again once this device is gone.
        if let Some(lease) = self.peer.get() {
            lease.detach();
        }
        let me = std::thread::current().id();
        let threads = self
            .threads
            .get_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        for t in threads {
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
        let far = self.far_ptr(&op);
        // A peer copy before any peer is attached has no stream of its own: it fails
        // (`far`) on the host stream of its way, in order with that stream's copies.
        let host_way = if op.direction.into_frame() {
            Direction::HostToDevice
        } else {
            Direction::DeviceToHost
        };
        let stream = self.streams[op.direction.index()]
            .get()
            .or_else(|| self.streams[host_way.index()].get())
            .expect("the host streams live until drop");
        let peer = match op.far {
            Far::Peer(_) => self.peer.get().map(|lease| lease.memory.clone()),
            Far::Host(_) => None,
        };
        stream
            .send(Job {
                op,
                far,
                _peer: peer,
            })
            .expect("copy thread lives until drop");
    }

    fn peer_frames(&self) -> u32 {
        self.peer.get().map_or(0, PeerLease::lent)
    }

    fn peer_asked_back(&self) -> Option<u32> {
        self.peer.get().and_then(PeerLease::asked_back)
    }

    fn peer_give_back(&self, frames: u32) {
        if let Some(lease) = self.peer.get() {
            lease.give_back(frames);
        }
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

    fn expect_view(&self, buffer: BufferId, whole: bool) {
        self.expected_views
            .lock()
            .expect("expected-views lock poisoned")
            .insert(buffer, whole);
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
        // Every direction is a memcpy here, the peer's too.
        // memcpy between pre-faulted regions on these machines: 5-8 GB/s.
        self.memory
            .pace_bytes_per_s
            .map_or(5e9, |pace| pace.min(5e9))
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
#[path = "sim_tests.rs"]
mod tests;
