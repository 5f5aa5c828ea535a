//! The embedded pool: [`PoolCore`] driven by a [`Device`] in one process.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use spillway_core::{
    AccessMode, AcquireId, CoreError, CoreStats, DeviceFault, MappingChange, PageLocation,
    PoolCore, RemoteError,
};
use spillway_device::sim::SimDevice;
use spillway_device::{
    Completion, CompletionSink, Device, DeviceConfig, DeviceError, DeviceKind, DevicePtr,
    DeviceTimings, HostMemory,
};
use spillway_types::config::{ConfigError, PoolConfig};
use spillway_types::{BufferId, Direction, FrameId};

pub use crate::builder::{DeviceChoice, PoolBuilder};
use crate::remote::{RemoteCompletion, RemoteFactory, RemoteSetupError, RemoteSink, RemoteTier};
use crate::view_kinds::ViewKinds;

/// Errors of the pool's API.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The pool refused the operation (see [`CoreError`] for each case).
    #[error(transparent)]
    Pool(#[from] CoreError),
    /// The device failed or is unavailable.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A required builder setting was not given.
    #[error("`{0}` is required: the pool has no default for it")]
    Missing(&'static str),
    /// Host access to device memory on a backend whose memory the host cannot see.
    #[error("the {0} device's memory is not visible to the host; use the device kernels or read()")]
    NotHostVisible(&'static str),
    /// A page index past the end of the buffer.
    #[error("page {index} is past the end of a buffer of {pages} pages")]
    NoSuchPage {
        /// Index asked for.
        index: usize,
        /// Pages of the buffer.
        pages: usize,
    },
    /// Writing through a guard that was acquired shared.
    #[error("the buffer was acquired shared; use acquire_mut to write")]
    NotExclusive,
    /// The remote tier could not be set up.
    #[error("the remote tier is unavailable: {0}")]
    Remote(#[from] RemoteSetupError),
    /// GPU memory cannot be lent or borrowed here (the peer-GPU tier).
    #[error(transparent)]
    Peer(#[from] crate::peer::PeerError),
}

/// A buffer of the pool: a handle, cheap to clone. Freeing it twice is an error.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Buffer {
    id: BufferId,
    bytes: u64,
    name: Arc<str>,
    range: Option<DevicePtr>,
}

impl Buffer {
    /// The buffer's id.
    pub fn id(&self) -> BufferId {
        self.id
    }
    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// The name given at `alloc`.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Counters of a pool: the core's plus what the driver measured.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolStats {
    /// The state machine's counters.
    pub core: CoreStats,
    /// Time acquires spent waiting for copies.
    pub stall: Duration,
    /// The pool's own time, by thread and kind.
    pub timings: PoolTimings,
    /// The device's own time (views, mappings, completions).
    pub device: DeviceTimings,
}

/// The pool's own time so far (besides stalls), split by the threads that spend it: the
/// caller's (acquires, steps, guard drops, host access), which a job's step waits for,
/// and the device's (completions, fenced releases), which runs beside it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolTimings {
    /// Waiting for the pool's lock, on the caller's threads.
    pub lock_wait: Duration,
    /// Planning on the caller's threads: the core's calls (acquire, step) and starting
    /// the copies they queue.
    pub planning: Duration,
    /// Showing acquired buffers as one array ([`Device::acquire_ptr`]: nothing when a
    /// buffer's frames are consecutive, mapping its pages when not), on the caller's
    /// threads.
    pub view: Duration,
    /// Waiting for the pool's lock, on the device's threads.
    pub device_lock_wait: Duration,
    /// Planning on the device's threads: handling completions and fenced releases.
    pub device_planning: Duration,
}

/// [`PoolTimings`] as counters that any thread adds to without a lock (nanoseconds).
#[derive(Default)]
struct Timings {
    lock_wait_ns: AtomicU64,
    planning_ns: AtomicU64,
    view_ns: AtomicU64,
    device_lock_wait_ns: AtomicU64,
    device_planning_ns: AtomicU64,
}

impl Timings {
    fn add(counter: &AtomicU64, d: Duration) {
        counter.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    fn read(&self) -> PoolTimings {
        let get = |c: &AtomicU64| Duration::from_nanos(c.load(Ordering::Relaxed));
        PoolTimings {
            lock_wait: get(&self.lock_wait_ns),
            planning: get(&self.planning_ns),
            view: get(&self.view_ns),
            device_lock_wait: get(&self.device_lock_wait_ns),
            device_planning: get(&self.device_planning_ns),
        }
    }
}

pub(crate) struct State {
    pub(crate) core: PoolCore,
    stall: Duration,
    /// Guards dropped whose release waits for the device's queued work (a fence).
    pending_releases: u64,
    names: HashMap<BufferId, Arc<str>>,
    /// Which acquires of each buffer want it whole (tells the device what to map ahead).
    view_kinds: ViewKinds,
    remote_errors_log: LogLimit,
    /// Device mapping failures (a device that refused every page's mapping once wrote a
    /// line per page loaded, under this lock).
    mapping_errors_log: LogLimit,
}

/// At most one log line a second for a kind of repeated error; counts what it held back.
#[derive(Debug, Default)]
struct LogLimit {
    last: Option<Duration>,
    suppressed: u64,
}

impl LogLimit {
    /// Interval between lines: 1 s.
    const INTERVAL: Duration = Duration::from_secs(1);

    /// `Some(lines held back since the last one)` when a line may be written at `now`.
    fn should_log(&mut self, now: Duration) -> Option<u64> {
        if self.last.is_some_and(|l| now < l + Self::INTERVAL) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

pub(crate) struct Shared {
    state: Mutex<State>,
    pub(crate) cond: Condvar,
    device: OnceLock<Arc<dyn Device>>,
    remote: OnceLock<Arc<dyn RemoteTier>>,
    epoch: Instant,
    timings: Timings,
    /// The pool borrows a peer GPU's memory ([`Pool::borrow`]): `drive` keeps the core's
    /// peer frames in step with the lease (nothing to do otherwise).
    pub(crate) borrowing: std::sync::atomic::AtomicBool,
    /// Completions that another follows right after ([`Completion::follows`]), kept off
    /// the pool's lock until that one comes: a burst of completions takes the lock and
    /// runs the core's pump once, not once each (the device's threads held the lock a
    /// quarter of a training step on an H100, one completion at a time).
    parked: Mutex<Vec<Completion>>,
}

impl Shared {
    pub(crate) fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    pub(crate) fn device(&self) -> &Arc<dyn Device> {
        self.device.get().expect("set before any use")
    }

    /// The pool's lock, from a caller's thread (the wait is counted as such).
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.lock_counted(&self.timings.lock_wait_ns)
    }

    /// The pool's lock, from one of the device's threads.
    pub(crate) fn lock_on_device_thread(&self) -> MutexGuard<'_, State> {
        self.lock_counted(&self.timings.device_lock_wait_ns)
    }

    fn lock_counted(&self, wait: &AtomicU64) -> MutexGuard<'_, State> {
        let started = Instant::now();
        // A panic while holding the lock leaves the core mid-update: do not go on with it.
        let state = self
            .state
            .lock()
            .expect("pool state poisoned by an earlier panic");
        Timings::add(wait, started.elapsed());
        state
    }

    /// Starts every copy and mapping change the core has queued. Called with the lock held.
    pub(crate) fn drive(&self, state: &mut State) {
        if self.borrowing.load(Ordering::Acquire) {
            self.peer_handshake(state);
        }
        let device = self.device();
        // Zero fills first: the copies and remote ops below may read those slots.
        while let Some(fill) = state.core.poll_zero_fill() {
            let zeros = vec![0u8; fill.bytes as usize];
            if let Err(e) = device.write_host(fill.slot, 0, &zeros) {
                tracing::error!(error = %e, page = %fill.page, "zero fill failed");
                let now = self.now();
                state
                    .core
                    .handle_zero_fill_failed(fill.page, DeviceFault::new(e), now);
            }
        }
        while let Some(m) = state.core.poll_mapping() {
            let r = match m {
                MappingChange::Map { page, frame } => {
                    device.map_page(page.buffer, page.index, frame)
                }
                MappingChange::Unmap { page } => device.unmap_page(page.buffer, page.index),
            };
            if let Err(e) = r
                && let Some(suppressed) = state.mapping_errors_log.should_log(self.now())
            {
                tracing::error!(error = %e, suppressed, "device mapping failed");
            }
        }
        // All at once: the device may carry neighbouring pages in one copy.
        let copies: Vec<_> = std::iter::from_fn(|| state.core.poll_transfer()).collect();
        if !copies.is_empty() {
            device.submit_batch(&copies);
        }
        while let Some(op) = state.core.poll_remote() {
            match self.remote.get() {
                Some(remote) => remote.submit(op),
                None => {
                    let now = self.now();
                    state
                        .core
                        .handle_remote_done(op.id, Err(RemoteError::NoTier), now);
                }
            }
        }
        let discards = state.core.take_discards();
        if !discards.is_empty()
            && let Some(remote) = self.remote.get()
        {
            remote.discard(discards);
        }
    }

    /// Waits for a completion or for the core's timer (`poll_timeout`), whichever comes
    /// first; at the timer, lets the core start what waited for it.
    fn wait<'a>(&'a self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        let Some(at) = state.core.poll_timeout() else {
            return self.cond.wait(state).expect("pool state poisoned");
        };
        let timeout = at.saturating_sub(self.now());
        let (mut state, _) = self
            .cond
            .wait_timeout(state, timeout)
            .expect("pool state poisoned");
        let now = self.now();
        if state.core.poll_timeout().is_some_and(|at| at <= now) {
            state.core.handle_timeout(now);
            self.drive(&mut state);
        }
        state
    }

    fn on_remote_completion(&self, c: RemoteCompletion) {
        let mut state = self.lock_on_device_thread();
        let started = Instant::now();
        let now = self.now();
        if let Err(e) = &c.result {
            // Spills that fail are retried with backoff: say so once a second, not per try.
            let shown = state.remote_errors_log.should_log(now);
            if let Some(suppressed) = shown {
                tracing::error!(error = %e, suppressed, "remote tier op failed");
            }
        }
        state.core.handle_remote_done(c.id, c.result, now);
        self.drive(&mut state);
        drop(state);
        Timings::add(&self.timings.device_planning_ns, started.elapsed());
        self.cond.notify_all();
    }

    fn on_completion(&self, c: Completion) {
        if c.follows {
            // Handled with the completion that follows it (the device promises one).
            self.parked
                .lock()
                .expect("parked completions poisoned")
                .push(c);
            return;
        }
        let mut state = self.lock_on_device_thread();
        let started = Instant::now();
        let now = self.now();
        let mut done =
            std::mem::take(&mut *self.parked.lock().expect("parked completions poisoned"));
        done.push(c);
        let done = done.into_iter().map(|c| {
            let result = c.result.map_err(|e| {
                tracing::error!(error = %e, "device copy failed");
                DeviceFault::new(e)
            });
            (c.id, result)
        });
        // One pass of the pump for the burst; the copies it starts go to the device
        // together (neighbouring pages may share a driver copy).
        state.core.handle_transfers_done(done, now);
        self.drive(&mut state);
        drop(state);
        Timings::add(&self.timings.device_planning_ns, started.elapsed());
        self.cond.notify_all();
    }
}

/// The embedded pool. Cheap to share across threads (`&Pool` is enough); see the crate docs.
pub struct Pool {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("device", &self.device_kind())
            .field("stats", &self.stats())
            .finish()
    }
}

/// Creates a device of the chosen backend (for tools that drive a device directly, such
/// as the copy-only benchmark; a [`Pool`] makes its own).
pub fn make_device(
    choice: DeviceChoice,
    config: DeviceConfig,
    sink: CompletionSink,
) -> Result<Arc<dyn Device>, PoolError> {
    make_device_in(choice, config, None, sink)
}

/// [`make_device`] with the host slots in `host` when given.
pub fn make_device_in(
    choice: DeviceChoice,
    config: DeviceConfig,
    host: Option<HostMemory>,
    sink: CompletionSink,
) -> Result<Arc<dyn Device>, PoolError> {
    match choice {
        DeviceChoice::Sim => Ok(Arc::new(SimDevice::with_host_memory(config, host, sink)?)),
        DeviceChoice::Cuda => cuda_device(config, host, sink),
        DeviceChoice::Auto => match cuda_device(config, host.clone(), sink.clone()) {
            Ok(d) => Ok(d),
            Err(e) => {
                tracing::debug!(reason = %e, "no GPU: using the sim device");
                Ok(Arc::new(SimDevice::with_host_memory(config, host, sink)?))
            }
        },
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(
    config: DeviceConfig,
    host: Option<HostMemory>,
    sink: CompletionSink,
) -> Result<Arc<dyn Device>, PoolError> {
    Ok(Arc::new(
        spillway_device::cuda::CudaDevice::with_host_memory(config, host, sink, 0)?,
    ))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(
    _config: DeviceConfig,
    _host: Option<HostMemory>,
    _sink: CompletionSink,
) -> Result<Arc<dyn Device>, PoolError> {
    Err(DeviceError::Unavailable {
        backend: "cuda",
        reason: "this build has no CUDA support: rebuild with `--features cuda`".into(),
    }
    .into())
}

impl Pool {
    pub(crate) fn new(
        cfg: PoolConfig,
        choice: DeviceChoice,
        host_memory: Option<HostMemory>,
        remote: Option<RemoteFactory>,
        lendable_frames: u32,
    ) -> Result<Pool, PoolError> {
        let device_config = DeviceConfig {
            frames: cfg.gpu_frames() as u32,
            host_slots: cfg.host_slots() as u32,
            page_bytes: cfg.page_size.bytes(),
        };
        let core = PoolCore::new(cfg, 0.0)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                core,
                stall: Duration::ZERO,
                pending_releases: 0,
                names: HashMap::new(),
                view_kinds: ViewKinds::default(),
                remote_errors_log: LogLimit::default(),
                mapping_errors_log: LogLimit::default(),
            }),
            cond: Condvar::new(),
            device: OnceLock::new(),
            remote: OnceLock::new(),
            epoch: Instant::now(),
            timings: Timings::default(),
            borrowing: std::sync::atomic::AtomicBool::new(false),
            parked: Mutex::new(Vec::new()),
        });
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        let sink: CompletionSink = Arc::new(move |c| {
            if let Some(shared) = weak.upgrade() {
                shared.on_completion(c);
            }
        });
        let device = match (lendable_frames, choice) {
            (0, _) => make_device_in(choice, device_config, host_memory, sink)?,
            // Lending GPU memory is built on the sim device only (see `peer.rs`).
            (_, DeviceChoice::Cuda) => {
                return Err(crate::peer::PeerError::Unsupported { backend: "cuda" }.into());
            }
            (_, DeviceChoice::Sim | DeviceChoice::Auto) if host_memory.is_some() => {
                return Err(crate::peer::PeerError::Unsupported {
                    backend: "sim with shared host memory",
                }
                .into());
            }
            (frames, DeviceChoice::Sim | DeviceChoice::Auto) => {
                Arc::new(SimDevice::lending(device_config, frames, sink)?)
            }
        };
        let hint = device.bandwidth_hint_bytes_per_s(Direction::HostToDevice);
        shared.lock().core.set_bandwidth_hint(hint);
        let _ = shared.device.set(device.clone());
        if let Some(factory) = remote {
            let weak: Weak<Shared> = Arc::downgrade(&shared);
            let sink: RemoteSink = Arc::new(move |c| {
                if let Some(shared) = weak.upgrade() {
                    shared.on_remote_completion(c);
                }
            });
            let tier = factory(device, sink)?;
            shared
                .lock()
                .core
                .set_remote_bandwidth_hint(tier.bandwidth_hint_bytes_per_s());
            let _ = shared.remote.set(tier);
        }
        Ok(Pool { shared })
    }

    /// The backend in use.
    pub fn device_kind(&self) -> DeviceKind {
        self.shared.device().kind()
    }

    /// A description of the device.
    pub fn device_description(&self) -> String {
        self.shared.device().describe()
    }

    /// The device, for benchmarks that drive copies directly.
    pub fn device(&self) -> Arc<dyn Device> {
        self.shared.device().clone()
    }

    /// The pool's configuration.
    pub fn config(&self) -> PoolConfig {
        self.shared.lock().core.config().clone()
    }

    /// Registers a buffer of `bytes`; its contents start as zeros in the host tier.
    pub fn alloc(&self, name: &str, bytes: u64) -> Result<Buffer, PoolError> {
        let mut state = self.shared.lock();
        let id = state.core.alloc(bytes)?;
        let range = match self.shared.device().reserve_range(id, bytes) {
            Ok(r) => r,
            Err(e) => {
                state
                    .core
                    .free(id, self.shared.now())
                    .expect("just allocated");
                return Err(e.into());
            }
        };
        let name: Arc<str> = name.into();
        state.names.insert(id, name.clone());
        // With a remote tier the core zero-fills each page when it first needs a slot.
        let core_zeroes = state.core.has_remote();
        drop(state);
        let buffer = Buffer {
            id,
            bytes,
            name,
            range,
        };
        if core_zeroes {
            return Ok(buffer);
        }
        // Slots may hold a freed buffer's bytes: a new buffer reads as zeros.
        let zeros = vec![0u8; (bytes.min(self.config().page_size.bytes())) as usize];
        let mut offset = 0;
        while offset < bytes {
            let n = (bytes - offset).min(zeros.len() as u64);
            self.write(&buffer, offset, &zeros[..n as usize])?;
            offset += n;
        }
        Ok(buffer)
    }

    /// Frees a buffer. Errors if it is acquired, already freed or unknown.
    pub fn free(&self, buffer: &Buffer) -> Result<(), PoolError> {
        let mut state = self.shared.lock();
        state.core.free(buffer.id, self.shared.now())?;
        state.names.remove(&buffer.id);
        state.view_kinds.forget(buffer.id);
        self.shared.drive(&mut state);
        drop(state);
        self.shared.device().release_range(buffer.id)?;
        Ok(())
    }

    /// Runs `f` on each page piece of `[offset, offset + len)` once no copy uses them.
    fn host_access(
        &self,
        buffer: &Buffer,
        offset: u64,
        len: u64,
        write: bool,
        mut f: impl FnMut(PageLocation, u64, std::ops::Range<usize>) -> Result<(), DeviceError>,
    ) -> Result<(), PoolError> {
        let mut state = self.shared.lock();
        let locations = loop {
            match state
                .core
                .begin_host_access(buffer.id, offset, len, write, self.shared.now())
            {
                Ok(Some(l)) => break l,
                Ok(None) => {}
                // A guard dropped just before whose release still waits for queued
                // kernels (a consumer's stream): it comes free when they pass, so wait.
                Err(CoreError::BufferBusy { .. }) if state.pending_releases > 0 => {
                    state = self.shared.wait(state);
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
            // Pages may have to come from the remote tier first: start what the core asked
            // (zero fills finish inside `drive`, so look again before waiting).
            self.shared.drive(&mut state);
            if let Some(l) =
                state
                    .core
                    .begin_host_access(buffer.id, offset, len, write, self.shared.now())?
            {
                break l;
            }
            state = self.shared.wait(state);
        };
        let page_bytes = state.core.config().page_size.bytes();
        drop(state);
        let mut result = Ok(());
        let mut pos = offset;
        let end = offset + len;
        for loc in locations {
            let in_page = pos % page_bytes;
            let n = (page_bytes - in_page).min(end - pos);
            let range = (pos - offset) as usize..(pos - offset + n) as usize;
            if let Err(e) = f(loc, in_page, range) {
                result = Err(e);
                break;
            }
            pos += n;
        }
        let mut state = self.shared.lock();
        state.core.end_host_access(
            buffer.id,
            offset,
            len,
            write && result.is_ok(),
            self.shared.now(),
        );
        self.shared.drive(&mut state);
        Ok(result?)
    }

    /// Writes `data` at `offset` of the buffer (to wherever its pages are now).
    pub fn write(&self, buffer: &Buffer, offset: u64, data: &[u8]) -> Result<(), PoolError> {
        let device = self.shared.device().clone();
        self.host_access(
            buffer,
            offset,
            data.len() as u64,
            true,
            |loc, at, range| match loc {
                PageLocation::Gpu(frame) => device.write_frame(frame, at, &data[range]),
                PageLocation::Host(slot) => device.write_host(slot, at, &data[range]),
            },
        )
    }

    /// Reads `out.len()` bytes at `offset` of the buffer.
    pub fn read(&self, buffer: &Buffer, offset: u64, out: &mut [u8]) -> Result<(), PoolError> {
        let device = self.shared.device().clone();
        let len = out.len() as u64;
        self.host_access(buffer, offset, len, false, |loc, at, range| match loc {
            PageLocation::Gpu(frame) => device.read_frame(frame, at, &mut out[range]),
            PageLocation::Host(slot) => device.read_host(slot, at, &mut out[range]),
        })
    }

    /// Waits until every page of `buffer` is on the GPU and returns a shared guard.
    pub fn acquire(&self, buffer: &Buffer) -> Result<Guard<'_>, PoolError> {
        self.acquire_with(buffer, AccessMode::Shared, false)
    }

    /// As [`Pool::acquire`], exclusively: the guard may write, and the pages become dirty.
    pub fn acquire_mut(&self, buffer: &Buffer) -> Result<Guard<'_>, PoolError> {
        self.acquire_with(buffer, AccessMode::Exclusive, false)
    }

    /// As [`Pool::acquire_mut`], for a holder that overwrites every byte: the buffer's
    /// contents are discarded. Pages not on the GPU get frames without a copy from the
    /// host or remote tier, and their bytes are undefined (whatever the frames held, not
    /// zeros) until the holder writes them; at release they are dirty, and their old host
    /// and remote copies are gone for good.
    pub fn acquire_discard(&self, buffer: &Buffer) -> Result<Guard<'_>, PoolError> {
        self.acquire_with(buffer, AccessMode::Exclusive, true)
    }

    fn acquire_with(
        &self,
        buffer: &Buffer,
        mode: AccessMode,
        discard: bool,
    ) -> Result<Guard<'_>, PoolError> {
        let mut state = self.shared.lock();
        let mut planning = Instant::now();
        let (id, hit) = loop {
            let now = self.shared.now();
            let begun = if discard {
                state.core.begin_acquire_discard(buffer.id, now)
            } else {
                state.core.begin_acquire(buffer.id, mode, now)
            };
            match begun {
                Ok(r) => break r,
                // Pages still held by released guards whose kernels have not finished:
                // they come free when the device passes the fence, so wait, not fail.
                Err(CoreError::HeldAcquiresExceedBudget { .. } | CoreError::BufferBusy { .. })
                    if state.pending_releases > 0 =>
                {
                    state = self.shared.wait(state);
                    planning = Instant::now();
                }
                Err(e) => return Err(e.into()),
            }
        };
        self.shared.drive(&mut state);
        Timings::add(&self.shared.timings.planning_ns, planning.elapsed());
        // The stall: waiting for the copies (not the lock wait or planning above).
        let waiting = Instant::now();
        loop {
            match state.core.is_ready(id) {
                Ok(true) => break,
                Ok(false) => state = self.shared.wait(state),
                Err(e) => {
                    state.core.release(id, self.shared.now());
                    return Err(e.into());
                }
            }
        }
        let waited = if hit {
            Duration::ZERO
        } else {
            waiting.elapsed()
        };
        state.stall += waited;
        let frames = state.core.frames_of(id);
        drop(state);
        Ok(Guard {
            pool: self,
            id,
            mode,
            frames,
            bytes: buffer.bytes,
            buffer: buffer.id,
            range: OnceLock::new(),
            hit,
            waited,
            streams: Vec::new(),
        })
    }

    /// Marks the end of a step (one iteration of the job).
    pub fn step(&self) {
        let mut state = self.shared.lock();
        let started = Instant::now();
        state.core.step(self.shared.now());
        let device = self.shared.device();
        for (buffer, whole) in state.view_kinds.end_step() {
            device.expect_view(buffer, whole);
        }
        self.shared.drive(&mut state);
        Timings::add(&self.shared.timings.planning_ns, started.elapsed());
    }

    /// Counters so far.
    pub fn stats(&self) -> PoolStats {
        let state = self.shared.lock();
        PoolStats {
            core: state.core.stats(),
            stall: state.stall,
            timings: self.shared.timings.read(),
            device: self.shared.device().timings(),
        }
    }

    /// Waits until no copy is in flight and every dropped guard is released (for clean
    /// measurements and shutdown).
    pub fn quiesce(&self) {
        let mut state = self.shared.lock();
        while state.core.transfers_in_flight() > 0 || state.pending_releases > 0 {
            state = self.shared.wait(state);
        }
    }

    /// The name a buffer was allocated with.
    pub fn buffer_name(&self, id: BufferId) -> Option<String> {
        self.shared.lock().names.get(&id).map(|n| n.to_string())
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Let copies in flight land before the device and its memory go away.
        self.quiesce();
    }
}

/// A buffer held on the GPU. Its pages stay resident until the guard is dropped.
pub struct Guard<'p> {
    pool: &'p Pool,
    id: AcquireId,
    mode: AccessMode,
    frames: Vec<FrameId>,
    bytes: u64,
    buffer: BufferId,
    /// The buffer as one array, once [`Guard::device_ptr`] asked for it.
    range: OnceLock<Option<DevicePtr>>,
    hit: bool,
    waited: Duration,
    /// Consumer streams the release waits for besides the compute stream (the DLPack
    /// stream contract; see [`Guard::release_after_stream`]).
    streams: Vec<u64>,
}

impl std::fmt::Debug for Guard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("buffer", &self.buffer)
            .field("mode", &self.mode)
            .field("hit", &self.hit)
            .finish()
    }
}

impl Guard<'_> {
    /// Whether the acquire found every page already on the GPU (no wait for a copy).
    pub fn hit(&self) -> bool {
        self.hit
    }
    /// How long the acquire waited for copies.
    pub fn waited(&self) -> Duration {
        self.waited
    }
    /// Number of pages.
    pub fn pages(&self) -> usize {
        self.frames.len()
    }
    /// Bytes of page `index` (the last one may be short).
    pub fn page_len(&self, index: usize) -> u64 {
        let page = self.pool.shared.device().config().page_bytes;
        (self.bytes - index as u64 * page).min(page)
    }

    fn frame(&self, index: usize) -> Result<FrameId, PoolError> {
        self.frames
            .get(index)
            .copied()
            .ok_or(PoolError::NoSuchPage {
                index,
                pages: self.frames.len(),
            })
    }

    /// The buffer as one contiguous device array, valid while held: on `cuda`, at its
    /// frames' own addresses when they are consecutive (any page size), else through the
    /// buffer's range (pages of at least the allocation granularity), its pages mapped
    /// there by the first call (on the calling thread); `None` otherwise. A holder that
    /// reads the buffer page by page ([`Guard::page_ptr`]) never calls it, and then
    /// nothing is mapped for it.
    pub fn device_ptr(&self) -> Result<Option<DevicePtr>, PoolError> {
        if let Some(range) = self.range.get() {
            return Ok(*range);
        }
        let viewing = Instant::now();
        let range = self
            .pool
            .shared
            .device()
            .acquire_ptr(self.buffer, &self.frames)?;
        Timings::add(&self.pool.shared.timings.view_ns, viewing.elapsed());
        Ok(*self.range.get_or_init(|| range))
    }

    /// Device address of page `index`.
    pub fn page_ptr(&self, index: usize) -> Result<DevicePtr, PoolError> {
        Ok(self.pool.shared.device().frame_ptr(self.frame(index)?))
    }

    /// The host address of page `index`'s frame, on a host-visible device.
    fn host_view(&self, index: usize) -> Result<NonNull<u8>, PoolError> {
        let frame = self.frame(index)?;
        let device = self.pool.shared.device();
        device
            .host_view(frame)
            .ok_or(PoolError::NotHostVisible(device.kind().name()))
    }

    /// Page `index` as bytes, on a device whose memory the host can see (`sim`).
    pub fn page(&self, index: usize) -> Result<&[u8], PoolError> {
        let ptr = self.host_view(index)?;
        // SAFETY: the frame is pinned by this guard, so no copy writes it and it is not
        // reused; writers need an exclusive acquire (refused while this shared one is
        // held) or `&mut self` of an exclusive guard; the length is inside the frame.
        Ok(unsafe { std::slice::from_raw_parts(ptr.as_ptr(), self.page_len(index) as usize) })
    }

    /// Page `index` as writable bytes, on a host-visible device, through an exclusive guard.
    pub fn page_mut(&mut self, index: usize) -> Result<&mut [u8], PoolError> {
        if self.mode != AccessMode::Exclusive {
            return Err(PoolError::NotExclusive);
        }
        let ptr = self.host_view(index)?;
        // SAFETY: as in `page`, and the acquire is exclusive and borrowed mutably.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), self.page_len(index) as usize) })
    }

    /// Makes the release wait also for the work queued on `stream` (a raw `CUstream` of
    /// the device's context, as DLPack passes it: `1` the legacy default stream) until
    /// the guard is dropped, so the pool reuses no frame a consumer's queued kernel still
    /// reads. Only the `cuda` backend has streams; elsewhere kernels are synchronous and
    /// this does nothing.
    pub fn release_after_stream(&mut self, stream: u64) {
        if self.pool.shared.device().kind() == DeviceKind::Cuda && !self.streams.contains(&stream) {
            self.streams.push(stream);
        }
    }

    /// Fills page `index` on the device with the deterministic pattern of `seed`.
    pub fn fill_pattern(&mut self, index: usize, seed: u64) -> Result<(), PoolError> {
        if self.mode != AccessMode::Exclusive {
            return Err(PoolError::NotExclusive);
        }
        Ok(self.pool.shared.device().fill_pattern(
            self.frame(index)?,
            self.page_len(index),
            seed,
        )?)
    }

    /// The checksum of page `index`, computed on the device.
    pub fn checksum(&self, index: usize) -> Result<u64, PoolError> {
        Ok(self
            .pool
            .shared
            .device()
            .checksum(self.frame(index)?, self.page_len(index))?)
    }

    /// Arithmetic work over page `index` on the device (the demo's kernel).
    pub fn compute(&self, index: usize, passes: u32) -> Result<u64, PoolError> {
        Ok(self
            .pool
            .shared
            .device()
            .compute(self.frame(index)?, self.page_len(index), passes)?)
    }
}

/// Runs `done` after the device's queued work, and the consumer `streams`' on `cuda`.
fn release_after(device: &dyn Device, streams: &[u64], done: Box<dyn FnOnce() + Send>) {
    #[cfg(feature = "cuda")]
    if !streams.is_empty()
        && let Some(cuda) = device
            .as_any()
            .downcast_ref::<spillway_device::cuda::CudaDevice>()
    {
        return cuda.after_streams_work(streams, done);
    }
    let _ = streams;
    device.after_queued_work(done);
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        // The release waits for the kernels queued on the device while the guard was held
        // (at once on `sim`, whose kernels are synchronous).
        let shared = self.pool.shared.clone();
        let device = shared.device().clone();
        {
            let mut state = shared.lock();
            state.pending_releases += 1;
            // Before the release can issue loads: whether they are mapped ahead.
            let whole = self.range.get().is_some();
            if let Some(next) = state.view_kinds.ended(self.buffer, whole) {
                device.expect_view(self.buffer, next);
            }
        }
        let id = self.id;
        let done: Box<dyn FnOnce() + Send> = Box::new(move || {
            let mut state = shared.lock_on_device_thread();
            let started = Instant::now();
            state.pending_releases -= 1;
            state.core.release(id, shared.now());
            shared.drive(&mut state);
            drop(state);
            Timings::add(&shared.timings.device_planning_ns, started.elapsed());
            shared.cond.notify_all();
        });
        release_after(&*device, &self.streams, done);
    }
}
