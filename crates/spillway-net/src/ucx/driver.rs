//! The worker thread: owns the UCX context, worker, endpoints and registration, takes
//! commands from the handles and drives progress.
//!
//! Loop: progress until UCX reports no more events, hand out what completed, then arm
//! the event fd; if arming says events are pending, progress again; else sleep until
//! the fd is readable or a command arrives. So the thread sleeps whenever UCX has
//! nothing to do, and wakes for the network or for its handles only.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tokio::io::unix::AsyncFd;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::raw::{
    self, CloseOp, EventFd, Landed, MemHandle, RawEp, RawWorker, RecvOp, RecvSlot, Region, SendOp,
};
use super::{Shared, UcxError, UcxWorkerConfig, WorkerStats};

/// Longest sleep of an idle worker without progressing: 50 ms. It wakes on its event fd
/// or a command first; this bounds the wait if a wake-up is ever missed.
pub(super) const IDLE_PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

/// Progress calls at shutdown while cancelled operations complete, at most.
const SHUTDOWN_PROGRESS_CALLS_MAX: u32 = 100_000;

pub(super) enum Command {
    Connect {
        id: u64,
        address: Vec<u8>,
        done: oneshot::Sender<Result<(), UcxError>>,
    },
    Close {
        id: u64,
    },
    Send {
        id: u64,
        endpoint: u64,
        tag: u64,
        parts: Vec<Bytes>,
        done: oneshot::Sender<Result<(), UcxError>>,
    },
    Recv {
        id: u64,
        tag: u64,
        tag_mask: u64,
        from: Option<u64>,
        slot: RecvSlot,
        done: oneshot::Sender<Result<(RecvSlot, u64), UcxError>>,
    },
    /// A receive into a buffer of the message's own length (at most `max_bytes`), posted
    /// once the message is there (a probe), so nothing is copied out of a slot.
    RecvOwned {
        id: u64,
        tag: u64,
        tag_mask: u64,
        from: Option<u64>,
        max_bytes: usize,
        done: oneshot::Sender<Result<(Vec<u8>, u64), UcxError>>,
    },
    CancelRecv {
        id: u64,
    },
    Stop {
        done: oneshot::Sender<()>,
    },
}

/// Starts the thread; returns once the worker exists (or failed to).
pub(super) fn start(config: &UcxWorkerConfig) -> Result<Arc<Shared>, UcxError> {
    let (commands, rx) = mpsc::unbounded_channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let stats = Arc::new(WorkerStats::default());
    let thread_stats = Arc::clone(&stats);
    let config = config.clone();
    let thread = std::thread::Builder::new()
        .name("spillway-ucx".into())
        .spawn(move || run(config, rx, thread_stats, ready_tx))
        .map_err(|source| UcxError::Io {
            context: "spawning the UCX worker thread",
            source,
        })?;
    let ready: Result<Ready, UcxError> = ready_rx.recv().map_err(|_| UcxError::WorkerStopped)?;
    let ready = ready?;
    Ok(Arc::new(Shared {
        thread: std::sync::Mutex::new(Some(thread)),
        os_thread_id: ready.os_thread_id,
        commands,
        recv_slots: Arc::new(Semaphore::new(ready.region_slots)),
        region: ready.region,
        sends: Arc::new(Semaphore::new(ready.sends_max)),
        address: ready.address,
        next_id: AtomicU64::new(1),
        stats,
        version: ready.version,
    }))
}

struct Ready {
    os_thread_id: Option<u32>,
    region: Arc<Region>,
    region_slots: usize,
    sends_max: usize,
    address: Vec<u8>,
    version: String,
}

fn run(
    config: UcxWorkerConfig,
    commands: mpsc::UnboundedReceiver<Command>,
    stats: Arc<WorkerStats>,
    ready: std::sync::mpsc::SyncSender<Result<Ready, UcxError>>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
    {
        Ok(r) => r,
        Err(source) => {
            let _ = ready.send(Err(UcxError::Io {
                context: "building the UCX worker's runtime",
                source,
            }));
            return;
        }
    };
    runtime.block_on(async move {
        let mut driver = match Driver::new(&config, stats) {
            Ok(d) => d,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        // The worker's address, then the event fd to watch: the first that fails is sent back.
        let started = driver
            .worker
            .address()
            .and_then(|address| Ok((address, driver.worker.watch_event_fd()?)));
        let (address, efd) = match started {
            Ok(v) => v,
            Err(e) => {
                let _ = ready.send(Err(e));
                driver.shutdown();
                return;
            }
        };
        let _ = ready.send(Ok(Ready {
            os_thread_id: os_thread_id(),
            region: Arc::clone(&driver.region),
            region_slots: config.recv_slots_count,
            sends_max: config.sends_in_flight_max,
            address,
            version: raw::version(),
        }));
        let stop = driver.run(commands, &efd).await;
        drop(efd);
        driver.shutdown();
        // The worker and the context are destroyed before the stop is acknowledged: a
        // caller that then exits must not race UCX's teardown with the libraries' own
        // destructors at process exit (that corrupted the heap, about 1 run in 10).
        drop(driver);
        if let Some(done) = stop {
            let _ = done.send(());
        }
    });
}

struct EpEntry {
    raw: RawEp,
}

struct PendingSend {
    op: SendOp,
    done: oneshot::Sender<Result<(), UcxError>>,
    endpoint: u64,
}

/// Who waits for a receive, and for what.
enum RecvDone {
    Slot(oneshot::Sender<Result<(RecvSlot, u64), UcxError>>),
    Owned(oneshot::Sender<Result<(Vec<u8>, u64), UcxError>>),
}

impl RecvDone {
    fn fail(self, e: UcxError) {
        match self {
            RecvDone::Slot(d) => {
                let _ = d.send(Err(e));
            }
            RecvDone::Owned(d) => {
                let _ = d.send(Err(e));
            }
        }
    }

    fn deliver(self, landed: Landed, sender_tag: u64) {
        match (self, landed) {
            (RecvDone::Slot(d), Landed::Slot(slot)) => {
                let _ = d.send(Ok((slot, sender_tag)));
            }
            (RecvDone::Owned(d), Landed::Owned(buf)) => {
                let _ = d.send(Ok((buf, sender_tag)));
            }
            // A receive lands where it was posted; the other pairs cannot happen.
            (done, _) => done.fail(UcxError::Cancelled),
        }
    }
}

/// A receive waiting for its message to arrive before it is posted (`RecvOwned`).
struct PendingProbe {
    id: u64,
    tag: u64,
    tag_mask: u64,
    from: Option<u64>,
    max_bytes: usize,
    done: oneshot::Sender<Result<(Vec<u8>, u64), UcxError>>,
}

struct PendingRecv {
    op: RecvOp,
    done: RecvDone,
    from: Option<u64>,
    /// Set when `from`'s peer was lost and the receive cancelled for it.
    peer_lost: Option<String>,
    /// The longest message it takes.
    max_bytes: usize,
}

struct Driver {
    /// Shared only with the event fd's watcher, which keeps it alive while it watches.
    worker: Rc<RawWorker>,
    region: Arc<Region>,
    memh: Option<MemHandle>,
    eps: HashMap<u64, EpEntry>,
    /// Endpoints whose peer was lost: why.
    lost: HashMap<u64, String>,
    sends: HashMap<u64, PendingSend>,
    recvs: HashMap<u64, PendingRecv>,
    /// Receives waiting for a matching message, in the order they were asked for.
    probes: Vec<PendingProbe>,
    closing: Vec<CloseOp>,
    stats: Arc<WorkerStats>,
}

impl Driver {
    fn new(config: &UcxWorkerConfig, stats: Arc<WorkerStats>) -> Result<Driver, UcxError> {
        let worker = Rc::new(RawWorker::new()?);
        let region = Region::new(config.recv_slot_bytes, config.recv_slots_count);
        let memh = worker.map(&region)?;
        Ok(Driver {
            worker,
            region,
            memh: Some(memh),
            eps: HashMap::new(),
            lost: HashMap::new(),
            sends: HashMap::new(),
            recvs: HashMap::new(),
            probes: Vec::new(),
            closing: Vec::new(),
            stats,
        })
    }

    /// Runs until a stop command or until every handle is gone; returns the stop's
    /// completion signal.
    async fn run(
        &mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        efd: &AsyncFd<EventFd>,
    ) -> Option<oneshot::Sender<()>> {
        let mut woke_by_timer = false;
        loop {
            let events = self.progress_until_idle();
            let posted = self.post_probed();
            if woke_by_timer && (events > 0 || posted) {
                self.stats.missed_wakeups.fetch_add(1, Ordering::Relaxed);
            }
            woke_by_timer = false;
            if posted {
                // A message was taken: its receive may complete at once.
                continue;
            }
            if !self.closing.is_empty() {
                self.closing.retain_mut(|c| !c.is_done());
            }
            match self.worker.arm() {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "UCX worker cannot arm its event fd; stopping it");
                    return None;
                }
            }
            tokio::select! {
                command = commands.recv() => match command {
                    Some(Command::Stop { done }) => return Some(done),
                    Some(c) => self.handle(c),
                    None => return None,
                },
                ready = efd.readable() => match ready {
                    Ok(mut guard) => {
                        guard.clear_ready();
                        self.stats.wakeups.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "UCX event fd failed; stopping the worker");
                        return None;
                    }
                },
                // A safety net: progress now and then even when no wake-up came, so work
                // that arrived without one (counted in `missed_wakeups`) waits at most
                // this long.
                _ = tokio::time::sleep(IDLE_PROGRESS_INTERVAL) => woke_by_timer = true,
            }
        }
    }

    /// Progresses until UCX reports no more events; returns how many it reported.
    fn progress_until_idle(&mut self) -> u64 {
        let mut total = 0;
        loop {
            let events = self.worker.progress();
            self.stats.progress_calls.fetch_add(1, Ordering::Relaxed);
            self.complete();
            if events == 0 {
                return total;
            }
            total += u64::from(events);
        }
    }

    /// Posts the receives whose message has arrived; says whether any was.
    fn post_probed(&mut self) -> bool {
        let mut posted = false;
        let mut i = 0;
        while i < self.probes.len() {
            let p = &self.probes[i];
            let Some(probed) = self.worker.probe(p.tag, p.tag_mask) else {
                i += 1;
                continue;
            };
            let p = self.probes.remove(i);
            posted = true;
            let op = self.worker.recv_probed(p.id, probed, p.max_bytes);
            self.track_recv(p.id, op, RecvDone::Owned(p.done), p.from, p.max_bytes);
        }
        posted
    }

    /// Tracks receive `id` until it completes, or fails it at once if it could not be
    /// posted.
    fn track_recv(
        &mut self,
        id: u64,
        posted: Result<RecvOp, UcxError>,
        done: RecvDone,
        from: Option<u64>,
        max_bytes: usize,
    ) {
        match posted {
            Ok(op) => {
                self.recvs.insert(
                    id,
                    PendingRecv {
                        op,
                        done,
                        from,
                        peer_lost: None,
                        max_bytes,
                    },
                );
            }
            Err(e) => done.fail(e),
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Connect { id, address, done } => {
                let result = self.worker.connect(&address, id).map(|raw| {
                    self.eps.insert(id, EpEntry { raw });
                });
                let _ = done.send(result);
            }
            Command::Close { id } => {
                self.lost.remove(&id);
                if let Some(ep) = self.eps.remove(&id) {
                    self.closing.extend(self.worker.close(ep.raw, false));
                }
            }
            Command::Send {
                id,
                endpoint,
                tag,
                parts,
                done,
            } => {
                let Some(ep) = self.eps.get(&endpoint) else {
                    let status = self
                        .lost
                        .get(&endpoint)
                        .cloned()
                        .unwrap_or_else(|| "endpoint closed".into());
                    let _ = done.send(Err(UcxError::PeerLost { endpoint, status }));
                    return;
                };
                match self.worker.send(&ep.raw, id, tag, parts) {
                    Ok(op) => {
                        self.sends.insert(id, PendingSend { op, done, endpoint });
                    }
                    Err(e) => {
                        let _ = done.send(Err(e));
                    }
                }
            }
            Command::Recv {
                id,
                tag,
                tag_mask,
                from,
                slot,
                done,
            } => {
                if let Some(e) = self.lost_error(from) {
                    let _ = done.send(Err(e));
                    return;
                }
                let Some(memh) = &self.memh else {
                    let _ = done.send(Err(UcxError::WorkerStopped));
                    return;
                };
                let op = self.worker.recv(memh, id, tag, tag_mask, slot);
                let max_bytes = self.region.slot_bytes();
                self.track_recv(id, op, RecvDone::Slot(done), from, max_bytes);
            }
            Command::RecvOwned {
                id,
                tag,
                tag_mask,
                from,
                max_bytes,
                done,
            } => {
                if let Some(e) = self.lost_error(from) {
                    let _ = done.send(Err(e));
                    return;
                }
                self.probes.push(PendingProbe {
                    id,
                    tag,
                    tag_mask,
                    from,
                    max_bytes,
                    done,
                });
            }
            Command::CancelRecv { id } => {
                if let Some(at) = self.probes.iter().position(|p| p.id == id) {
                    let p = self.probes.remove(at);
                    let _ = p.done.send(Err(UcxError::Cancelled));
                    return;
                }
                if let Some(r) = self.recvs.get(&id) {
                    self.worker.cancel(&r.op);
                }
                self.complete();
            }
            Command::Stop { done } => {
                // Handled by `run`; here only if it arrives some other way.
                let _ = done.send(());
            }
        }
    }

    /// Hands out the operations whose callbacks ran, then handles lost peers.
    fn complete(&mut self) {
        // Handling a lost peer cancels and closes, which may run more callbacks: loop
        // until none is left, so nothing waits for a wake-up that will not come.
        loop {
            let completed = raw::take_completed();
            let ep_errors = raw::take_ep_errors();
            if completed.is_empty() && ep_errors.is_empty() {
                return;
            }
            self.complete_ops(completed);
            self.lose_peers(ep_errors);
        }
    }

    fn complete_ops(&mut self, completed: Vec<u64>) {
        for id in completed {
            if let Some(s) = self.sends.remove(&id) {
                let result = match s.op.status() {
                    Some(raw::OK) => {
                        self.stats.sends_completed.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }
                    Some(status) => Err(self.send_error(s.endpoint, status)),
                    None => Err(UcxError::Cancelled),
                };
                let _ = s.done.send(result);
            } else if let Some(mut r) = self.recvs.remove(&id) {
                let error = match (r.op.status(), r.op.take_received()) {
                    (Some(raw::OK), Some((landed, sender_tag))) => {
                        self.stats.recvs_completed.fetch_add(1, Ordering::Relaxed);
                        r.done.deliver(landed, sender_tag);
                        continue;
                    }
                    (Some(raw::TRUNCATED), _) => UcxError::MessageTooLarge {
                        slot_bytes: r.max_bytes,
                    },
                    (Some(raw::CANCELED), _) => match (r.from, r.peer_lost.take()) {
                        (Some(endpoint), Some(status)) => UcxError::PeerLost { endpoint, status },
                        _ => UcxError::Cancelled,
                    },
                    (Some(status), _) => UcxError::Call {
                        call: "ucp_tag_recv_nbx",
                        status: raw::status_name(status),
                    },
                    (None, _) => UcxError::Cancelled,
                };
                r.done.fail(error);
            }
        }
    }

    fn lose_peers(&mut self, ep_errors: Vec<(u64, i8)>) {
        for (endpoint, status) in ep_errors {
            let status = raw::status_name(status);
            tracing::debug!(endpoint, %status, "UCX peer lost");
            if let Some(ep) = self.eps.remove(&endpoint) {
                self.closing.extend(self.worker.close(ep.raw, true));
            }
            for r in self.recvs.values_mut() {
                if r.from == Some(endpoint) && r.peer_lost.is_none() {
                    r.peer_lost = Some(status.clone());
                    self.worker.cancel(&r.op);
                }
            }
            let (lost, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.probes)
                .into_iter()
                .partition(|p| p.from == Some(endpoint));
            self.probes = kept;
            for p in lost {
                let _ = p.done.send(Err(UcxError::PeerLost {
                    endpoint,
                    status: status.clone(),
                }));
            }
            self.lost.insert(endpoint, status);
        }
    }

    /// The error of a receive expected from `from`, if that peer is already lost.
    fn lost_error(&self, from: Option<u64>) -> Option<UcxError> {
        let endpoint = from?;
        let status = self.lost.get(&endpoint)?;
        Some(UcxError::PeerLost {
            endpoint,
            status: status.clone(),
        })
    }

    fn send_error(&self, endpoint: u64, status: i8) -> UcxError {
        if let Some(lost) = self.lost.get(&endpoint) {
            return UcxError::PeerLost {
                endpoint,
                status: lost.clone(),
            };
        }
        UcxError::PeerLost {
            endpoint,
            status: raw::status_name(status),
        }
    }

    /// Cancels what is pending, closes every endpoint at once, waits (bounded) for the
    /// cancellations, then releases the registration; the worker and context go with
    /// `self`. Operations still pending after the bound are leaked, never freed.
    fn shutdown(&mut self) {
        for r in self.recvs.values() {
            self.worker.cancel(&r.op);
        }
        for (_, ep) in self.eps.drain() {
            self.closing.extend(self.worker.close(ep.raw, true));
        }
        let mut calls = 0;
        while (!self.sends.is_empty() || !self.recvs.is_empty() || !self.closing.is_empty())
            && calls < SHUTDOWN_PROGRESS_CALLS_MAX
        {
            self.worker.progress();
            self.complete();
            self.closing.retain_mut(|c| !c.is_done());
            calls += 1;
        }
        for c in self.closing.drain(..) {
            c.abandon();
        }
        let leaked = !self.sends.is_empty() || !self.recvs.is_empty();
        for (_, s) in self.sends.drain() {
            let _ = s.done.send(Err(UcxError::Cancelled));
        }
        for (_, r) in self.recvs.drain() {
            r.done.fail(UcxError::Cancelled);
        }
        for p in self.probes.drain(..) {
            let _ = p.done.send(Err(UcxError::Cancelled));
        }
        if !leaked
            && let Some(memh) = self.memh.take()
            && let Err(e) = self.worker.unmap(memh)
        {
            tracing::warn!(error = %e, "UCX receive memory could not be unregistered");
        }
    }
}

/// This thread's id in the OS (Linux: from `/proc/thread-self`), for CPU accounting.
fn os_thread_id() -> Option<u32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}
