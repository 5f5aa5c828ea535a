//! The Raft thread: owns the [`MetaNode`], ticks it, steps peers' messages, turns queued
//! proposals into one batch per Ready round, runs the Ready loop (raft-engine fsyncs, so
//! a thread, not a task), forwards proposals to the leader, republishes the view, and
//! degrades and recovers on storage failures (see the parent module's docs); and the peer
//! sender tasks that carry its messages.

use super::forward::cut;
use super::*;
use crate::peers::RECONNECT_BACKOFF_MIN;

pub(super) struct ThreadCtx {
    pub(super) id: NodeId,
    pub(super) tick: Duration,
    pub(super) lend_bytes: u64,
    pub(super) outboxes: HashMap<NodeId, mpsc::Sender<RaftMessage>>,
    pub(super) view: Arc<RwLock<MetaView>>,
    pub(super) queued: Arc<AtomicU64>,
    pub(super) inputs: SyncSender<Input>,
    pub(super) peers: Arc<Peers>,
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) tasks: TaskTracker,
    pub(super) counters: Arc<MetaCountersAtomic>,
    pub(super) stop: Arc<AtomicBool>,
    /// What the node is reopened with after a storage failure (as at start).
    pub(super) meta_config: MetaConfig,
    pub(super) initial: InitialCluster,
    /// Whether this node joined with a token (its log starts from a snapshot).
    pub(super) joined: bool,
    /// Cancelled when the thread stops on a failure it cannot recover from.
    pub(super) failed: CancellationToken,
}

/// Sends `peer`'s Raft messages, in order, one request each.
pub(super) async fn peer_sender(
    peer: NodeId,
    mut rx: mpsc::Receiver<RaftMessage>,
    peers: Arc<Peers>,
    inputs: SyncSender<Input>,
    counters: Arc<MetaCountersAtomic>,
    cancel: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return,
            m = rx.recv() => match m { Some(m) => m, None => return },
        };
        let snapshot = msg.get_msg_type() == raft::eraftpb::MessageType::MsgSnapshot;
        let bytes = spillway_meta::wire::encode_message(&msg);
        let result = tokio::select! {
            _ = cancel.cancelled() => return,
            r = peers.request(peer, Request::Raft { message: bytes.into() }) => r,
        };
        let delivered = matches!(result, Ok(Response::RaftAck));
        if !delivered {
            counters
                .messages_undelivered
                .fetch_add(1, Ordering::Relaxed);
            if let Err(e) = &result {
                tracing::debug!(%peer, error = %e, "Raft message not delivered");
            }
            let _ = inputs.try_send(Input::Unreachable(peer));
        }
        if snapshot {
            let _ = inputs.try_send(Input::Snapshot(peer, delivered));
        }
    }
}

/// Proposals in flight: for each ticket, the callers and how many updates each gave.
type InFlight = HashMap<Ticket, Vec<Pending>>;

/// This node's member of the group, on the Raft thread.
enum Member {
    /// Running (boxed: 1.7 KiB, against the other's 0.1).
    Up(Box<MetaNode>),
    /// Its Raft log failed; the node was dropped and is reopened after a backoff.
    Degraded(Degraded),
}

/// A member whose Raft log failed (see the module docs).
struct Degraded {
    /// The latest failure: the Ready's, then each failed attempt to reopen.
    cause: String,
    /// When the Ready failed.
    since: Instant,
    /// Failed attempts to reopen.
    attempts: u64,
    /// The wait before the next attempt.
    backoff: Duration,
    retry_at: Instant,
    /// When a failed attempt was last logged.
    logged_at: Instant,
}

impl Degraded {
    fn failure(&self) -> ProposeFailure {
        ProposeFailure::Degraded {
            cause: self.cause.clone(),
        }
    }
}

pub(super) fn run(node: MetaNode, inputs: Receiver<Input>, mut ctx: ThreadCtx) {
    let mut member = Member::Up(Box::new(node));
    let mut next_tick = Instant::now() + ctx.tick;
    let mut queue: VecDeque<Pending> = VecDeque::new();
    let mut in_flight: InFlight = HashMap::new();
    let mut last_capacity_sync: Option<Instant> = None;
    let mut last_view: Option<(u64, u64, Role, Option<NodeId>, u64)> = None;
    // When the log was last reopened, and the backoff it had then.
    let mut recovered: Option<(Instant, Duration)> = None;
    // Why the thread stops for good, if it does (see the module docs).
    let mut fatal: Option<String> = None;
    let mut stopping = false;
    // Membership changes asked for, by ticket, and when the leader last looked for one.
    let mut changes: HashMap<Ticket, MembershipReply> = HashMap::new();
    let mut last_reconcile = Instant::now();
    if let Member::Up(node) = &member {
        publish(node, &ctx, &mut last_view, true);
    }
    while !stopping && !ctx.stop.load(Ordering::Relaxed) {
        let wake = match &member {
            Member::Up(_) => next_tick,
            Member::Degraded(d) => d.retry_at,
        };
        let timeout = wake.saturating_duration_since(Instant::now());
        let first = match inputs.recv_timeout(timeout) {
            Ok(i) => Some(i),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        // Take everything queued (bounded, so a flood cannot starve the tick).
        let mut batch: Vec<Input> = first.into_iter().collect();
        while batch.len() < INPUTS_MAX {
            match inputs.try_recv() {
                Ok(i) => batch.push(i),
                Err(_) => break,
            }
        }
        for input in batch {
            match (&mut member, input) {
                (_, Input::Stop) => stopping = true,
                (Member::Up(node), Input::Membership(change, reply)) => {
                    propose_membership(node, change, reply, &mut changes, &ctx);
                }
                (Member::Up(node), input) => take_input(node, input, &mut queue, &ctx),
                (Member::Degraded(d), input) => refuse_input(d, input),
            }
        }
        let now = Instant::now();
        if let Member::Degraded(d) = &mut member {
            if now < d.retry_at {
                continue;
            }
            match reopen(&ctx) {
                Ok(node) => {
                    ctx.counters
                        .storage_recoveries
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        node = %ctx.id,
                        attempts = d.attempts + 1,
                        degraded_ms = d.since.elapsed().as_millis() as u64,
                        "Raft log reopened; the metadata group is healthy again on this node"
                    );
                    recovered = Some((now, d.backoff));
                    next_tick = now + ctx.tick;
                    publish(&node, &ctx, &mut last_view, true);
                    member = Member::Up(Box::new(node));
                }
                Err(e) => {
                    ctx.counters.storage_errors.fetch_add(1, Ordering::Relaxed);
                    d.attempts += 1;
                    d.cause = e.to_string();
                    d.backoff = (d.backoff * 2).min(STORAGE_RETRY_BACKOFF_MAX);
                    d.retry_at = Instant::now() + d.backoff;
                    if d.logged_at.elapsed() >= STORAGE_RETRY_LOG_EVERY {
                        d.logged_at = Instant::now();
                        tracing::warn!(
                            node = %ctx.id,
                            attempts = d.attempts,
                            degraded_ms = d.since.elapsed().as_millis() as u64,
                            retry_ms = d.backoff.as_millis() as u64,
                            error = %d.cause,
                            "the Raft log still fails; the metadata group stays degraded on this node"
                        );
                    }
                    publish_degraded(d, &ctx);
                }
            }
            continue;
        }
        let Member::Up(node) = &mut member else {
            continue;
        };
        if now >= next_tick {
            // The failure detector's proposals carry this clock.
            node.observe_clock_ms(now_ms());
            node.tick();
            next_tick += ctx.tick;
            if next_tick < now {
                next_tick = now + ctx.tick;
            }
            expire(&mut queue, &ctx, node.leader());
            sync_capacity(node, &mut queue, &ctx, &mut last_capacity_sync);
            if node.is_leader() && last_reconcile.elapsed() >= crate::membership::RECONCILE_EVERY {
                last_reconcile = Instant::now();
                crate::membership::reconcile(node);
            }
        }
        flush(node, &mut queue, &mut in_flight, &ctx);
        let ready = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| node.handle_ready()));
        let Ok(ready) = ready.map_err(|panic| {
            fatal = Some(format!(
                "the Raft log panicked ({}): raft-engine does so when an fsync fails, and a log \
                 whose fsync failed may have lost what it acknowledged, so it is not reopened; \
                 restart the node",
                panic_message(&*panic)
            ));
        }) else {
            break;
        };
        if let Err(e) = ready {
            // The node is poisoned mid-Ready; dropping it releases the log for reopening.
            let d = degrade(e, &mut queue, &mut in_flight, &ctx, recovered);
            publish_degraded(&d, &ctx);
            last_view = None;
            member = Member::Degraded(d);
            continue;
        }
        route(node, &mut ctx);
        for c in node.take_completions() {
            if let Some(reply) = changes.remove(&c.ticket) {
                let _ = reply.send(match c.result {
                    Ok(_) => Ok(()),
                    Err(ProposalFailed::Lost) => Err(MembershipFailure::Busy),
                    Err(e) => Err(MembershipFailure::Failed {
                        reason: e.to_string(),
                    }),
                });
                continue;
            }
            let Some(waiters) = in_flight.remove(&c.ticket) else {
                continue;
            };
            match c.result {
                Ok(Applied::Batch { outcomes }) => {
                    let mut outcomes = outcomes.into_iter();
                    for w in waiters {
                        let mine: Vec<Outcome> = outcomes
                            .by_ref()
                            .take(w.updates.len())
                            .map(|o| match o {
                                Ok(()) => Outcome::Accepted,
                                Err(r) => Outcome::Rejected {
                                    reason: cut(r.to_string()),
                                },
                            })
                            .collect();
                        answer(w, Ok(mine));
                    }
                }
                Ok(Applied::Membership { .. }) => {}
                Err(ProposalFailed::Lost) => {
                    // Never applied: propose again, first in line.
                    requeue_front(&mut queue, &ctx, waiters);
                }
                Err(other) => {
                    for w in waiters {
                        answer(
                            w,
                            Err(ProposeFailure::Failed {
                                reason: other.to_string(),
                            }),
                        );
                    }
                }
            }
        }
        publish(node, &ctx, &mut last_view, false);
    }
    for p in queue.drain(..) {
        answer(p, Err(ProposeFailure::Stopped));
    }
    for (_, ws) in in_flight.drain() {
        for w in ws {
            answer(w, Err(ProposeFailure::Stopped));
        }
    }
    match fatal {
        Some(cause) => {
            // Dropping the engine would fsync again, and panic again: leak it, the process
            // is about to exit.
            if let Member::Up(node) = member {
                std::mem::forget(node);
            }
            stop_for_good(ctx.id, &ctx.view, &ctx.failed, cause);
        }
        None => {
            ctx.view.write().expect("meta view").running = false;
            tracing::info!(node = %ctx.id, "Raft thread stopped");
        }
    }
}

/// Says in the view that the Raft thread stopped for good, and why, and resolves
/// [`MetaDriver::failed`].
pub(super) fn stop_for_good(
    id: NodeId,
    view: &RwLock<MetaView>,
    failed: &CancellationToken,
    cause: String,
) {
    tracing::error!(node = %id, cause, "the metadata group stopped on this node");
    let mut v = view.write().unwrap_or_else(|e| e.into_inner());
    v.running = false;
    v.healthy = false;
    v.error = Some(cause);
    v.role = Role::Follower;
    v.leader = None;
    drop(v);
    failed.cancel();
}

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}

/// Takes one input while the member runs.
fn take_input(node: &mut MetaNode, input: Input, queue: &mut VecDeque<Pending>, ctx: &ThreadCtx) {
    match input {
        Input::Raft(m) => {
            if let Err(e) = node.step(m) {
                tracing::error!(node = %ctx.id, error = %e, "Raft step failed");
            }
        }
        Input::Propose(p) => {
            ctx.queued
                .fetch_add(p.updates.len() as u64, Ordering::Relaxed);
            queue.push_back(p);
        }
        Input::Requeue(ps) => requeue_front(queue, ctx, ps),
        Input::Unreachable(peer) => node.report_unreachable(peer),
        Input::Snapshot(peer, ok) => node.report_snapshot(peer, ok),
        Input::Query(f) => f(Ok(node.state())),
        Input::Membership(_, reply) => {
            // Handled by the loop (it keeps the waiters); never reaches here.
            let _ = reply.send(Err(MembershipFailure::Busy));
        }
        Input::Transfer => {
            let best = node
                .peers()
                .into_iter()
                .filter(|p| p.recently_active)
                .max_by_key(|p| p.matched_index);
            if let Some(to) = best {
                tracing::info!(node = %ctx.id, to = %to.id, "handing leadership over before stopping");
                node.transfer_leader(to.id);
            }
        }
        Input::Stop => {}
    }
}

/// Answers one input while the member is degraded: proposals and reads fail at once; Raft
/// messages are dropped (the leader sends them again once this node answers).
fn refuse_input(d: &Degraded, input: Input) {
    match input {
        Input::Propose(p) => answer(p, Err(d.failure())),
        Input::Requeue(ps) => {
            for p in ps {
                answer(p, Err(d.failure()));
            }
        }
        Input::Query(f) => f(Err(d.failure())),
        Input::Membership(_, reply) => {
            let _ = reply.send(Err(MembershipFailure::Stopped));
        }
        Input::Raft(_)
        | Input::Unreachable(_)
        | Input::Snapshot(..)
        | Input::Transfer
        | Input::Stop => {}
    }
}

/// After a failed Ready: fails every waiting proposal (those in flight may or may not take
/// effect) and starts the backoff, resuming it if the last recovery was recent.
fn degrade(
    e: spillway_meta::MetaError,
    queue: &mut VecDeque<Pending>,
    in_flight: &mut InFlight,
    ctx: &ThreadCtx,
    recovered: Option<(Instant, Duration)>,
) -> Degraded {
    ctx.counters.storage_errors.fetch_add(1, Ordering::Relaxed);
    let cause = e.to_string();
    tracing::error!(
        node = %ctx.id,
        error = %cause,
        "Raft Ready failed; the metadata group is degraded on this node: proposals fail and the Raft log is reopened with backoff"
    );
    let now = Instant::now();
    let backoff = match recovered {
        Some((at, backoff)) if now.duration_since(at) < STORAGE_STABLE_AFTER => {
            (backoff * 2).min(STORAGE_RETRY_BACKOFF_MAX)
        }
        _ => STORAGE_RETRY_BACKOFF_MIN,
    };
    let d = Degraded {
        cause,
        since: now,
        attempts: 0,
        backoff,
        retry_at: now + backoff,
        logged_at: now,
    };
    for p in queue.drain(..) {
        ctx.queued
            .fetch_sub(p.updates.len() as u64, Ordering::Relaxed);
        answer(p, Err(d.failure()));
    }
    for (_, ws) in in_flight.drain() {
        for w in ws {
            answer(w, Err(d.failure()));
        }
    }
    d
}

/// Rebuilds the member from its directory, as a restart does, once the log takes a write
/// (a log on a full disk opens, and fails at its next write).
fn reopen(ctx: &ThreadCtx) -> Result<MetaNode, spillway_meta::MetaError> {
    EngineStorage::open(&ctx.meta_config.dir)?.check_writable()?;
    let initial = (!ctx.joined).then_some(&ctx.initial);
    MetaNode::open(ctx.meta_config.clone(), initial)
}

/// Proposes `change` if this node leads (its completion answers `reply`); else asks the
/// leader to hand leadership here (raft-rs forwards a follower's transfer to itself) and
/// answers [`MembershipFailure::NotLeader`], for the caller to try again.
fn propose_membership(
    node: &mut MetaNode,
    change: MembershipChange,
    reply: MembershipReply,
    changes: &mut HashMap<Ticket, MembershipReply>,
    ctx: &ThreadCtx,
) {
    match node.propose_membership(&change) {
        Ok(ticket) => {
            changes.insert(ticket, reply);
        }
        Err(ProposeError::NotLeader { .. }) => {
            if node.leader().is_some() {
                node.transfer_leader(ctx.id);
            }
            let _ = reply.send(Err(MembershipFailure::NotLeader));
        }
        Err(ProposeError::ConfChangePending | ProposeError::TooManyInFlight { .. }) => {
            let _ = reply.send(Err(MembershipFailure::Busy));
        }
        Err(e) => {
            let _ = reply.send(Err(MembershipFailure::Failed {
                reason: e.to_string(),
            }));
        }
    }
}

fn answer(p: Pending, result: Result<Vec<Outcome>, ProposeFailure>) {
    if let Some(reply) = p.reply {
        let _ = reply.send(result);
    }
}

/// Fails queued proposals past their deadline.
fn expire(queue: &mut VecDeque<Pending>, ctx: &ThreadCtx, leader: Option<NodeId>) {
    let now = Instant::now();
    let (late, keep): (Vec<Pending>, Vec<Pending>) =
        queue.drain(..).partition(|p| p.deadline <= now);
    queue.extend(keep);
    for p in late {
        ctx.queued
            .fetch_sub(p.updates.len() as u64, Ordering::Relaxed);
        answer(
            p,
            Err(ProposeFailure::TimedOut {
                timeout_ms: PROPOSAL_TIMEOUT.as_millis() as u64,
                leader,
            }),
        );
    }
}

/// Proposes `SetCapacity` for this node when the replicated capacity is not its
/// `lend_bytes` (at most once a second).
fn sync_capacity(
    node: &MetaNode,
    queue: &mut VecDeque<Pending>,
    ctx: &ThreadCtx,
    last: &mut Option<Instant>,
) {
    if node.leader().is_none() || last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
        return;
    }
    let Some(me) = node.state().member(ctx.id) else {
        return;
    };
    if me.capacity_bytes == ctx.lend_bytes {
        return;
    }
    *last = Some(Instant::now());
    ctx.queued.fetch_add(1, Ordering::Relaxed);
    queue.push_back(Pending {
        updates: vec![Update::SetCapacity {
            node: ctx.id,
            capacity_bytes: ctx.lend_bytes,
        }],
        reply: None,
        deadline: Instant::now() + PROPOSAL_TIMEOUT,
    });
}

/// Puts `taken` back at the front of `queue`, first in line in their order, counted in
/// `ctx.queued`.
fn requeue_front(queue: &mut VecDeque<Pending>, ctx: &ThreadCtx, taken: Vec<Pending>) {
    for p in taken.into_iter().rev() {
        ctx.queued
            .fetch_add(p.updates.len() as u64, Ordering::Relaxed);
        queue.push_front(p);
    }
}

/// Takes pendings from the front of `queue` up to one batch's worth of updates.
fn take_batch(queue: &mut VecDeque<Pending>, ctx: &ThreadCtx) -> (Batch, Vec<Pending>) {
    let stamp = now_ms();
    // A clock running ahead by the failpoint's milliseconds (`tests/failpoints.rs`).
    #[cfg(feature = "failpoints")]
    let stamp = stamp
        + fail::eval("spillway-node::meta::clock-ahead-ms", |ms| {
            ms.and_then(|m| m.parse::<u64>().ok()).unwrap_or(0)
        })
        .unwrap_or(0);
    let mut batch = Batch::new(stamp);
    let mut taken = Vec::new();
    while let Some(p) = queue.front() {
        if !taken.is_empty()
            && batch.len() + p.updates.len() > spillway_meta::limits::BATCH_UPDATES_MAX
        {
            break;
        }
        let p = queue.pop_front().expect("front exists");
        ctx.queued
            .fetch_sub(p.updates.len() as u64, Ordering::Relaxed);
        batch.updates.extend(p.updates.iter().cloned());
        taken.push(p);
    }
    (batch, taken)
}

/// Proposes what is queued (leader) or forwards it (follower with a known leader).
fn flush(
    node: &mut MetaNode,
    queue: &mut VecDeque<Pending>,
    in_flight: &mut InFlight,
    ctx: &ThreadCtx,
) {
    while !queue.is_empty() {
        match node.leader() {
            Some(l) if l == ctx.id && node.is_leader() => {
                let (batch, taken) = take_batch(queue, ctx);
                match node.propose(&batch) {
                    Ok(ticket) => {
                        in_flight.insert(ticket, taken);
                    }
                    Err(
                        ProposeError::TooManyInFlight { .. }
                        | ProposeError::Dropped { .. }
                        | ProposeError::NotLeader { .. },
                    ) => {
                        // Try again next round (or once a leader is known).
                        requeue_front(queue, ctx, taken);
                        return;
                    }
                    Err(e) => {
                        for p in taken {
                            answer(
                                p,
                                Err(ProposeFailure::Invalid {
                                    reason: e.to_string(),
                                }),
                            );
                        }
                    }
                }
            }
            Some(leader) if leader != ctx.id => {
                let (batch, taken) = take_batch(queue, ctx);
                forward(leader, batch, taken, ctx);
            }
            _ => return,
        }
    }
}

/// Sends `batch` to `leader` on a task; answers `taken` from the reply, or puts them back
/// in the queue when the leader moved or could not be reached.
fn forward(leader: NodeId, batch: Batch, taken: Vec<Pending>, ctx: &ThreadCtx) {
    ctx.counters
        .proposals_forwarded
        .fetch_add(1, Ordering::Relaxed);
    let peers = ctx.peers.clone();
    let inputs = ctx.inputs.clone();
    let bytes: Bytes = batch.encode().into();
    ctx.tasks.spawn_on(
        async move {
            let result = peers.request(leader, Request::Propose { batch: bytes }).await;
            let requeue = |taken: Vec<Pending>| {
                // Back to the queue: proposed again once a leader is known. A short
                // pause keeps a bouncing proposal from spinning.
                if let Err(e) = inputs.try_send(Input::Requeue(taken)) {
                    let taken = match e {
                        TrySendError::Full(Input::Requeue(t))
                        | TrySendError::Disconnected(Input::Requeue(t)) => t,
                        _ => Vec::new(),
                    };
                    for p in taken {
                        answer(p, Err(ProposeFailure::Busy { queued: INPUTS_MAX }));
                    }
                }
            };
            match result {
                Ok(Response::Propose { reply }) => match decode_forward_reply(&reply) {
                    Ok(ForwardReply::Applied { outcomes }) => {
                        let mut outcomes = outcomes.into_iter();
                        for p in taken {
                            let n = p.updates.len();
                            let mine: Vec<Outcome> = outcomes.by_ref().take(n).collect();
                            if mine.len() == n {
                                answer(p, Ok(mine));
                            } else {
                                answer(
                                    p,
                                    Err(ProposeFailure::Failed {
                                        reason: format!("{leader} answered too few outcomes"),
                                    }),
                                );
                            }
                        }
                    }
                    Ok(ForwardReply::NotLeader { .. } | ForwardReply::Failed { retry: true, .. }) => {
                        tokio::time::sleep(RECONNECT_BACKOFF_MIN).await;
                        requeue(taken);
                    }
                    Ok(ForwardReply::Failed { failure, retry: false }) => {
                        for p in taken {
                            answer(p, Err(ProposeFailure::Failed { reason: failure.clone() }));
                        }
                    }
                    Err(e) => {
                        for p in taken {
                            answer(
                                p,
                                Err(ProposeFailure::Failed {
                                    reason: format!("undecodable reply from {leader}: {e}"),
                                }),
                            );
                        }
                    }
                },
                Ok(other) => {
                    tracing::warn!(%leader, reply = ?other.kind(), "unexpected reply to a forwarded proposal");
                    tokio::time::sleep(RECONNECT_BACKOFF_MIN).await;
                    requeue(taken);
                }
                Err(e) => {
                    tracing::debug!(%leader, error = %e, "forwarding a proposal failed");
                    tokio::time::sleep(RECONNECT_BACKOFF_MIN).await;
                    requeue(taken);
                }
            }
        },
        &ctx.runtime,
    );
}

/// Hands outgoing messages to the peer senders, without waiting.
fn route(node: &mut MetaNode, ctx: &mut ThreadCtx) {
    for m in node.poll_messages() {
        let to = NodeId(m.to);
        let snapshot = m.get_msg_type() == raft::eraftpb::MessageType::MsgSnapshot;
        let sent = match ctx.outboxes.get(&to) {
            Some(tx) => tx.try_send(m).is_ok(),
            None => {
                // A member not in the initial list: start its sender if its address is known.
                if let Some(addr) = node
                    .state()
                    .member(to)
                    .and_then(|m| m.addresses.first())
                    .and_then(|a| a.parse::<SocketAddr>().ok())
                {
                    ctx.peers.learn(to, addr);
                    let (tx, rx) = mpsc::channel(PEER_OUTBOX_MAX);
                    ctx.tasks.spawn_on(
                        peer_sender(
                            to,
                            rx,
                            ctx.peers.clone(),
                            ctx.inputs.clone(),
                            ctx.counters.clone(),
                            CancellationToken::new(),
                        ),
                        &ctx.runtime,
                    );
                    let ok = tx.try_send(m).is_ok();
                    ctx.outboxes.insert(to, tx);
                    ok
                } else {
                    false
                }
            }
        };
        if !sent {
            ctx.counters
                .messages_undelivered
                .fetch_add(1, Ordering::Relaxed);
            node.report_unreachable(to);
            if snapshot {
                node.report_snapshot(to, false);
            }
        }
    }
}

/// Republishes the view when something in it changed (or `force`).
fn publish(
    node: &MetaNode,
    ctx: &ThreadCtx,
    last: &mut Option<(u64, u64, Role, Option<NodeId>, u64)>,
    force: bool,
) {
    let status = node.status();
    let key = (
        status.term,
        status.commit_index,
        status.role,
        status.leader,
        status.applied_index,
    );
    if !force && *last == Some(key) {
        return;
    }
    *last = Some(key);
    let state = node.state();
    // Every member's address, for pages as well as Raft (a joined member was not in the
    // config).
    for m in state.members() {
        if m.id != ctx.id
            && let Some(addr) = m
                .addresses
                .first()
                .and_then(|a| a.parse::<SocketAddr>().ok())
        {
            ctx.peers.learn(m.id, addr);
        }
    }
    let members = state
        .members()
        .map(|m| {
            let usage = state.usage(m.id).unwrap_or_default();
            MemberView {
                id: m.id,
                addr: m.addresses.first().cloned().unwrap_or_default(),
                state: m.state,
                epoch: m.epoch,
                capacity_bytes: m.capacity_bytes,
                used_bytes: usage.used_bytes,
                reserved_bytes: usage.reserved_bytes,
                voter: status.voters.contains(&m.id),
            }
        })
        .collect();
    *ctx.view.write().expect("meta view") = MetaView {
        role: status.role,
        leader: status.leader,
        term: status.term,
        commit_index: status.commit_index,
        applied_index: status.applied_index,
        members,
        clock_ms: state.clock_ms(),
        running: true,
        healthy: true,
        error: None,
    };
}

/// Says in the view that the member is degraded, and why; the indexes and members stay
/// the last known.
fn publish_degraded(d: &Degraded, ctx: &ThreadCtx) {
    let mut view = ctx.view.write().expect("meta view");
    view.role = Role::Follower;
    view.leader = None;
    view.healthy = false;
    view.error = Some(d.cause.clone());
}
