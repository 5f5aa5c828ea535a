//! The remote tier as this node's local clients see it: [`RemoteService`] stores their
//! pages on peers, fetches them back and discards them, with the pool's directory (the
//! metadata group) recording where every spilled page lives.
//!
//! A spill, step by step:
//! 1. **plan**: the pages are cut into runs of at most [`RUN_PAGES`] pages, and each run
//!    goes to the up peer with the most room: its capacity left (lent minus used minus
//!    reserved, as applied here) plus what this node still holds reserved there;
//! 2. **reserve**: where this node's reservations on a peer do not cover the plan, it
//!    reserves [`crate::NodeConfig::reserve_chunk_bytes`] at a time (rounded up to cover
//!    the deficit, down to the peer's free capacity) through the leader, all peers in one
//!    proposal, before any byte moves. Reservations are then spent locally, page by page,
//!    so most spills need no Raft round trip for them;
//! 3. **move**: each peer gets `Put` requests of up to [`PAGES_PER_REQUEST`] pages, with
//!    up to [`REQUESTS_IN_FLIGHT_PER_PEER`] requests in flight per peer (shared by all
//!    calls), over the node's cached QUIC connections;
//! 4. **place**: one `Place` update per extent (pages of one buffer, contiguous, same
//!    holder and reservation) is proposed; concurrent spills' updates are queued together
//!    and go in one Raft entry (group commit in [`crate::meta`]). `spill` returns when
//!    they are committed. A placement refused because its reservation lapsed is proposed
//!    again, paid from the holder's free capacity.
//!
//! Key namespace: page `(buffer b, index i)` of local client `c` of node `n` is stored on
//! peers, and recorded in the directory, as `PageId { buffer: BufferId(n << 52 | c << 40
//! | b), index: i }` ([`remote_page_id`]): 12 bits of node ([`crate::config::NODE_ID_MAX`]),
//! 12 bits of client ([`CLIENT_ID_MAX`]), 40 bits of buffer ([`CLIENT_BUFFER_MAX`]; a
//! client numbers its buffers from 1). Peers key their stores by origin too, so pages of
//! different nodes never collide there either.
//!
//! Fetch reads from the holder this node recorded when it spilled, else the replicated
//! directory. A node that restarts has lost its clients (their links die with it), so
//! before it takes a client it releases every page its earlier incarnation spilled
//! ([`RemoteService::release_earlier_incarnation`]): new clients reuse client numbers,
//! hence page ids. Every page's checksum is checked on
//! arrival by the transport and again against the checksum recorded at spill time.
//!
//! In-memory twin: [`RemoteService::new`] makes a service that keeps the pages in this
//! process, with the same API, checks and counters (for tests of its callers).
//!
//! Lock order: `plan` (async, held across the reservation proposal only) before `inner`
//! (sync, never held across an await).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use spillway_meta::{Epoch, Extent, MemberState, ReservationId, Update};
use spillway_net::{NetError, Page, Request, Response};
use spillway_types::wire::page_checksum;
use spillway_types::{BufferId, NodeId, PageId};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::config::NodeConfig;
use crate::ledger::{Ledger, Spent};
use crate::meta::{MetaDriver, Outcome, Peers, ProposeFailure, now_ms};

/// Bits of a remote buffer id that carry the client's own buffer number.
pub const CLIENT_BUFFER_BITS: u32 = 40;
/// Largest buffer number of a client: 2^40 - 1.
pub const CLIENT_BUFFER_MAX: u64 = (1 << CLIENT_BUFFER_BITS) - 1;
/// Bits of a remote buffer id that carry the client id (above the buffer bits).
pub const CLIENT_ID_BITS: u32 = 12;
/// Largest client id: 4095.
pub const CLIENT_ID_MAX: u32 = (1 << CLIENT_ID_BITS) - 1;
/// Where the node id starts in a remote buffer id.
const NODE_SHIFT: u32 = CLIENT_BUFFER_BITS + CLIENT_ID_BITS;
/// Pages in one `Put` or `Get` request: 8 (16 MiB of 2 MiB pages), within the frame limits
/// (`wire::FRAME_PAYLOAD_BYTES_MAX`, 128 MiB) for any page size up to 16 MiB; larger pages
/// go fewer per request.
pub const PAGES_PER_REQUEST: usize = 8;
/// Payload bytes of one request at most: 64 MiB.
pub const REQUEST_BYTES_MAX: u64 = 64 << 20;
/// Requests in flight to one peer, over all calls: 8 (with 16 MiB requests, 128 MiB of
/// page bytes per peer; the transport's in-flight budget bounds it again).
pub const REQUESTS_IN_FLIGHT_PER_PEER: usize = 8;
/// Times a spill places again the pages of peers that turned out unreachable: 2.
pub const MOVE_RETRIES: usize = 2;
/// Longest run of pages placed on one peer before the next run picks again: 16 pages.
/// Shorter runs spread a spill wider; longer ones make fewer directory extents.
pub const RUN_PAGES: usize = 16;
/// Lifetime of a reservation: 10 minutes of group clock. A lapsed one is not spent: its
/// placements fall back to the holder's free capacity.
pub const RESERVATION_TTL: Duration = Duration::from_secs(600);
/// A reservation is no longer spent this long before it lapses: 30 s.
const RESERVATION_MARGIN: Duration = Duration::from_secs(30);
/// First wait before a request to a peer that stopped answering is sent again: 50 ms,
/// doubling up to [`GRACE_RETRY_MAX`], within the node's `peer_grace_ms`.
const GRACE_RETRY_MIN: Duration = Duration::from_millis(50);
/// Longest wait between two tries of a request within the peer grace: 1 s.
const GRACE_RETRY_MAX: Duration = Duration::from_secs(1);
/// Page deletes waiting for their peer to answer, over all peers: 1,048,576 page ids
/// (16 MiB). Past it a delete that fails is dropped and logged: its copy stays on the peer.
pub const PENDING_DELETES_MAX: usize = 1 << 20;
/// How often the pending deletes are tried again: every 2 s.
pub const PENDING_DELETES_RETRY: Duration = Duration::from_secs(2);

/// The id page `page` of local client `client` of node `node` has on peers and in the
/// directory (see the module docs). The caller checks the bounds.
pub fn remote_page_id(node: NodeId, client: u32, page: PageId) -> PageId {
    debug_assert!(node.0 <= crate::config::NODE_ID_MAX);
    debug_assert!(client <= CLIENT_ID_MAX);
    debug_assert!(page.buffer.0 <= CLIENT_BUFFER_MAX);
    PageId {
        buffer: BufferId(
            node.0 << NODE_SHIFT | u64::from(client) << CLIENT_BUFFER_BITS | page.buffer.0,
        ),
        index: page.index,
    }
}

/// Why a remote-tier operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The peers together have not enough room for the pages.
    #[error("no peer has room: {requested_bytes} bytes asked for, {free_bytes} free on peers")]
    NoRoom {
        /// Bytes the pages take (whole pages).
        requested_bytes: u64,
        /// Bytes free on peers, this node's reservations included.
        free_bytes: u64,
    },
    /// A peer could not be reached or lost the connection.
    #[error("peer {peer} unreachable: {reason}")]
    PeerUnreachable {
        /// The peer.
        peer: NodeId,
        /// Why.
        reason: String,
    },
    /// A peer refused the request (full, or a protocol error).
    #[error("peer {peer} refused: {reason}")]
    PeerRefused {
        /// The peer.
        peer: NodeId,
        /// What it said.
        reason: String,
    },
    /// A page is not in the remote tier (never spilled, discarded, or lost with its holder).
    #[error("page {page} of client {client} is not in the remote tier")]
    NotFound {
        /// The client.
        client: u32,
        /// The page.
        page: PageId,
    },
    /// A page came back with other bytes than were spilled.
    #[error(
        "page {page} of client {client} from {peer} does not match the checksum recorded at spill"
    )]
    Corrupt {
        /// The client.
        client: u32,
        /// The page.
        page: PageId,
        /// Where it came from.
        peer: NodeId,
    },
    /// The leader refused to reserve capacity on a peer.
    #[error("the leader refused a reservation of {bytes} bytes on {peer}: {reason}")]
    ReservationRefused {
        /// The peer.
        peer: NodeId,
        /// Bytes asked for.
        bytes: u64,
        /// The state machine's reason.
        reason: String,
    },
    /// The leader refused to record where pages went.
    #[error("the leader refused to place {extent:?} on {peer}: {reason}")]
    PlacementRefused {
        /// The holder.
        peer: NodeId,
        /// The pages (in remote ids).
        extent: Extent,
        /// The state machine's reason.
        reason: String,
    },
    /// The metadata group did not take a proposal.
    #[error("metadata group: {0}")]
    Meta(#[from] ProposeFailure),
    /// The request names a page the remote tier cannot hold.
    #[error("page {page} of client {client} cannot be spilled: {reason}")]
    Invalid {
        /// The client.
        client: u32,
        /// The page.
        page: PageId,
        /// Why.
        reason: String,
    },
}

/// Counters of one peer in [`RemoteCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerRemoteCounters {
    /// Page bytes spilled to it.
    pub bytes_spilled: u64,
    /// Pages spilled to it.
    pub pages_spilled: u64,
    /// Page bytes fetched from it.
    pub bytes_fetched: u64,
    /// Pages fetched from it.
    pub pages_fetched: u64,
    /// Requests to it that failed.
    pub errors: u64,
}

/// Counters of the remote tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteCounters {
    /// Page bytes sent to peers.
    pub bytes_out: u64,
    /// Page bytes fetched from peers.
    pub bytes_in: u64,
    /// Pages spilled.
    pub pages_spilled: u64,
    /// Pages fetched.
    pub pages_fetched: u64,
    /// Failed operations (spill, fetch or discard calls that returned an error).
    pub errors: u64,
    /// Bytes of this node's reservations on peers not spent yet (the group's reserved
    /// bytes for this node, once its placements have committed).
    pub reserved_unspent_bytes: u64,
    /// Page copies on peers whose delete waits for the peer to answer.
    pub deletes_pending: u64,
    /// Per peer.
    pub per_peer: BTreeMap<NodeId, PeerRemoteCounters>,
}

/// Where a spilled page is.
#[derive(Clone, Copy, Debug)]
struct Held {
    holder: NodeId,
    checksum: u64,
}

#[derive(Debug, Default)]
struct Inner {
    pages: HashMap<(u32, PageId), Held>,
    ledger: Ledger,
    /// Copies to delete on peers that did not answer yet (retried until they land;
    /// deletes are idempotent). A spill never places a page on a peer where a delete of
    /// it is pending.
    pending_deletes: BTreeMap<NodeId, BTreeSet<PageId>>,
    pending_deletes_len: usize,
    pending_deletes_dropped: u64,
    per_peer: BTreeMap<NodeId, PeerRemoteCounters>,
    errors: u64,
}

/// Where a [`RemoteService`] keeps pages.
#[derive(Debug)]
enum Backend {
    /// On peers, recorded in the directory (the real thing).
    Pool {
        meta: Arc<MetaDriver>,
        peers: Arc<Peers>,
    },
    /// In this process (the in-memory twin), up to `capacity_bytes`.
    Memory {
        capacity_bytes: u64,
        pages: Mutex<HashMap<(u32, PageId), Bytes>>,
    },
}

/// The node id the in-memory twin counts its traffic under.
const MEMORY_PEER: NodeId = NodeId(0);

/// The remote tier of this node's clients (see the module docs).
#[derive(Debug)]
pub struct RemoteService {
    node: NodeId,
    page_bytes: u64,
    reserve_chunk_bytes: u64,
    peer_grace: Duration,
    backend: Backend,
    inner: Mutex<Inner>,
    /// Serializes planning and reserving, so two spills never spend one reservation twice.
    plan: tokio::sync::Mutex<()>,
    in_flight: Mutex<HashMap<NodeId, Arc<Semaphore>>>,
    next_reservation: AtomicU64,
    next_version: AtomicU64,
}

/// One page's place in a spill plan.
struct Planned {
    client_page: PageId,
    remote: PageId,
    data: Bytes,
    /// `page_checksum(&data)`, computed once when the spill starts.
    checksum: u64,
    holder: NodeId,
    epoch: Epoch,
    reservation: Option<Spent>,
}

impl RemoteService {
    /// The in-memory twin: pages kept in this process, up to `capacity_bytes` (page bytes
    /// as given), with the same checks and counters as the real service.
    pub fn new(capacity_bytes: u64) -> RemoteService {
        RemoteService {
            node: NodeId(1),
            page_bytes: spillway_types::limits::PAGE_BYTES_MAX,
            reserve_chunk_bytes: spillway_types::limits::PAGE_BYTES_MAX,
            peer_grace: Duration::from_millis(crate::config::PEER_GRACE_MS_DEFAULT),
            backend: Backend::Memory {
                capacity_bytes,
                pages: Mutex::new(HashMap::new()),
            },
            inner: Mutex::new(Inner::default()),
            plan: tokio::sync::Mutex::new(()),
            in_flight: Mutex::new(HashMap::new()),
            next_reservation: AtomicU64::new(1),
            next_version: AtomicU64::new(1),
        }
    }

    /// The service of a running node: pages on peers, placed in the directory.
    pub(crate) fn over_pool(config: &NodeConfig, meta: Arc<MetaDriver>, peers: Arc<Peers>) -> Self {
        let start = now_ms();
        RemoteService {
            node: config.node_id,
            page_bytes: config.page_size.bytes(),
            reserve_chunk_bytes: config.reserve_chunk_bytes,
            peer_grace: Duration::from_millis(config.peer_grace_ms),
            backend: Backend::Pool { meta, peers },
            inner: Mutex::new(Inner::default()),
            plan: tokio::sync::Mutex::new(()),
            in_flight: Mutex::new(HashMap::new()),
            // Ids and versions from the clock, so a restarted node never reuses one.
            next_reservation: AtomicU64::new(config.node_id.0 << 52 | (start & ((1 << 52) - 1))),
            next_version: AtomicU64::new(start << 10),
        }
    }

    fn pool(&self) -> (&Arc<MetaDriver>, &Arc<Peers>) {
        match &self.backend {
            Backend::Pool { meta, peers } => (meta, peers),
            Backend::Memory { .. } => unreachable!("pool paths run only over a pool"),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("remote tier lock")
    }

    fn slots(&self, peer: NodeId) -> Arc<Semaphore> {
        self.in_flight
            .lock()
            .expect("remote in-flight lock")
            .entry(peer)
            .or_insert_with(|| Arc::new(Semaphore::new(REQUESTS_IN_FLIGHT_PER_PEER)))
            .clone()
    }

    fn failed<T>(&self, e: RemoteError) -> Result<T, RemoteError> {
        self.lock().errors += 1;
        tracing::debug!(error = %e, "remote tier operation failed");
        Err(e)
    }

    fn check(&self, client: u32, page: PageId, len: Option<usize>) -> Result<(), RemoteError> {
        let invalid = |reason: String| {
            Err(RemoteError::Invalid {
                client,
                page,
                reason,
            })
        };
        if client > CLIENT_ID_MAX {
            return invalid(format!("client ids end at {CLIENT_ID_MAX}"));
        }
        if page.buffer.0 > CLIENT_BUFFER_MAX {
            return invalid("buffer numbers must be below 2^40".to_string());
        }
        if u64::from(page.index) >= spillway_types::limits::PAGES_PER_BUFFER_MAX {
            return invalid("page index past the largest of a buffer".into());
        }
        if let Some(len) = len
            && len as u64 > self.page_bytes
        {
            return invalid(format!(
                "{len} bytes, more than the page size of {}",
                self.page_bytes
            ));
        }
        Ok(())
    }

    /// Stores pages of local client `client` on peers (chosen by free capacity), with a
    /// reservation accepted by the leader before bytes move; returns when the peers hold
    /// them and the directory entries are committed.
    pub async fn spill(&self, client: u32, pages: Vec<(PageId, Bytes)>) -> Result<(), RemoteError> {
        match self.spill_inner(client, pages).await {
            Ok(()) => Ok(()),
            Err(e) => self.failed(e),
        }
    }

    async fn spill_inner(
        &self,
        client: u32,
        mut pages: Vec<(PageId, Bytes)>,
    ) -> Result<(), RemoteError> {
        if pages.is_empty() {
            return Ok(());
        }
        for (id, data) in &pages {
            self.check(client, *id, Some(data.len()))?;
        }
        if let Backend::Memory {
            capacity_bytes,
            pages: held,
        } = &self.backend
        {
            let mut held = held.lock().expect("memory twin lock");
            let used: u64 = held
                .iter()
                .filter(|(k, _)| !pages.iter().any(|(id, _)| *k == &(client, *id)))
                .map(|(_, b)| b.len() as u64)
                .sum();
            let requested_bytes: u64 = pages.iter().map(|(_, b)| b.len() as u64).sum();
            if used + requested_bytes > *capacity_bytes {
                return Err(RemoteError::NoRoom {
                    requested_bytes,
                    free_bytes: capacity_bytes.saturating_sub(used),
                });
            }
            let mut inner = self.lock();
            let c = inner.per_peer.entry(MEMORY_PEER).or_default();
            for (id, data) in pages {
                c.bytes_spilled += data.len() as u64;
                c.pages_spilled += 1;
                held.insert((client, id), data);
            }
            return Ok(());
        }
        pages.sort_by_key(|(id, _)| *id);
        pages.dedup_by_key(|(id, _)| *id);
        // Hash once, outside every lock; the checksum travels with the page from here.
        let pages: Vec<(PageId, Bytes, u64)> = pages
            .into_iter()
            .map(|(id, data)| {
                let sum = page_checksum(&data);
                (id, data, sum)
            })
            .collect();
        // Move; pages whose holder turned out unreachable are planned again without it.
        let mut excluded: Vec<NodeId> = Vec::new();
        let mut pending = self.plan_and_reserve(client, pages, &excluded).await?;
        let mut plan: Vec<Planned> = Vec::with_capacity(pending.len());
        for attempt in 0..=MOVE_RETRIES {
            let failures = self.move_pages(&pending).await;
            if failures.is_empty() {
                plan.append(&mut pending);
                break;
            }
            let retry = attempt < MOVE_RETRIES
                && failures
                    .iter()
                    .all(|(_, e)| matches!(e, RemoteError::PeerUnreachable { .. }));
            if !retry {
                let (_, e) = failures.into_iter().next().expect("a failure");
                plan.append(&mut pending);
                self.abandon(client, &plan).await;
                return Err(e);
            }
            let failed: Vec<NodeId> = failures.iter().map(|(p, _)| *p).collect();
            tracing::debug!(
                ?failed,
                "peers unreachable during a spill; placing their pages elsewhere"
            );
            excluded.extend(failed.iter().copied());
            let (redo, ok): (Vec<Planned>, Vec<Planned>) = pending
                .into_iter()
                .partition(|p| failed.contains(&p.holder));
            plan.extend(ok);
            // Their pages go elsewhere: what they spent on the failed peers comes back.
            self.refund(&redo);
            let redo_pages = redo
                .into_iter()
                .map(|p| (p.client_page, p.data, p.checksum))
                .collect();
            pending = match self.plan_and_reserve(client, redo_pages, &excluded).await {
                Ok(p) => p,
                Err(e) => {
                    self.abandon(client, &plan).await;
                    return Err(e);
                }
            };
        }
        if let Err(e) = self.place(&plan).await {
            self.drop_copies(client, &plan).await;
            return Err(e);
        }
        // Record, and drop copies a re-spill left on another holder.
        let mut stale: HashMap<NodeId, Vec<PageId>> = HashMap::new();
        {
            let mut inner = self.lock();
            for p in &plan {
                let held = Held {
                    holder: p.holder,
                    checksum: p.checksum,
                };
                if let Some(old) = inner.pages.insert((client, p.client_page), held)
                    && old.holder != p.holder
                {
                    stale.entry(old.holder).or_default().push(p.remote);
                }
            }
        }
        for (peer, ids) in stale {
            self.delete_or_queue(peer, ids).await;
        }
        Ok(())
    }

    /// Chooses a holder for every page and makes sure reservations cover them.
    async fn plan_and_reserve(
        &self,
        client: u32,
        pages: Vec<(PageId, Bytes, u64)>,
        excluded: &[NodeId],
    ) -> Result<Vec<Planned>, RemoteError> {
        let _plan = self.plan.lock().await;
        let (meta, peers) = self.pool();
        let view = meta.view();
        let now = now_ms();
        let spend_limit = now + RESERVATION_MARGIN.as_millis() as u64;
        // Room per peer: free capacity plus what we hold reserved there.
        let mut room: BTreeMap<NodeId, (u64, u64, Epoch)> = BTreeMap::new(); // (free, reserved by us, epoch)
        {
            let inner = self.lock();
            // A peer with a delete of one of these pages pending could drop the new copy.
            let deleting = |peer: NodeId| {
                inner.pending_deletes.get(&peer).is_some_and(|set| {
                    pages
                        .iter()
                        .any(|(id, _, _)| set.contains(&remote_page_id(self.node, client, *id)))
                })
            };
            for m in &view.members {
                if m.id == self.node
                    || m.state != MemberState::Up
                    || excluded.contains(&m.id)
                    || !peers.reachable(m.id)
                    || deleting(m.id)
                {
                    continue;
                }
                let ours = inner.ledger.unspent_on(m.id, spend_limit);
                room.insert(m.id, (m.free_bytes(), ours, m.epoch));
            }
        }
        let needed_bytes = pages.len() as u64 * self.page_bytes;
        let total_room: u64 = room.values().map(|(f, o, _)| f + o).sum();
        if needed_bytes > total_room {
            return Err(RemoteError::NoRoom {
                requested_bytes: needed_bytes,
                free_bytes: total_room,
            });
        }
        // Runs of pages to the peer with the most room left.
        let mut left: BTreeMap<NodeId, u64> =
            room.iter().map(|(p, (f, o, _))| (*p, f + o)).collect();
        let mut assigned: Vec<NodeId> = Vec::with_capacity(pages.len());
        for run in pages.chunks(RUN_PAGES) {
            let run_bytes = run.len() as u64 * self.page_bytes;
            let best = left
                .iter()
                .filter(|(_, l)| **l >= run_bytes)
                .max_by_key(|(p, l)| (**l, std::cmp::Reverse(**p)))
                .map(|(p, _)| *p);
            match best {
                Some(peer) => {
                    *left.get_mut(&peer).expect("peer in room") -= run_bytes;
                    assigned.extend(std::iter::repeat_n(peer, run.len()));
                }
                None => {
                    // No single peer takes the whole run: page by page.
                    for _ in run {
                        let peer = left
                            .iter()
                            .filter(|(_, l)| **l >= self.page_bytes)
                            .max_by_key(|(p, l)| (**l, std::cmp::Reverse(**p)))
                            .map(|(p, _)| *p)
                            .ok_or(RemoteError::NoRoom {
                                requested_bytes: needed_bytes,
                                free_bytes: total_room,
                            })?;
                        *left.get_mut(&peer).expect("peer in room") -= self.page_bytes;
                        assigned.push(peer);
                    }
                }
            }
        }
        // Reserve where our reservations fall short, all peers in one proposal.
        let mut need_per_peer: BTreeMap<NodeId, u64> = BTreeMap::new();
        for peer in &assigned {
            *need_per_peer.entry(*peer).or_default() += self.page_bytes;
        }
        let mut reserves = Vec::new();
        // Reservations this node will not spend any more are given back now, not at expiry.
        let releases: Vec<Update> = self
            .lock()
            .ledger
            .take_lapsing(spend_limit)
            .into_iter()
            .map(|id| Update::Release { id })
            .collect();
        for (peer, need) in &need_per_peer {
            let (free, ours, _) = room[peer];
            if *need > ours {
                let deficit = need - ours;
                let chunk = self.reserve_chunk_bytes.max(self.page_bytes);
                let want = deficit.div_ceil(chunk) * chunk;
                let bytes = want
                    .min(free / self.page_bytes * self.page_bytes)
                    .max(deficit);
                let id = ReservationId(self.next_reservation.fetch_add(1, Ordering::Relaxed));
                reserves.push((
                    *peer,
                    id,
                    bytes,
                    Update::Reserve {
                        id,
                        node: *peer,
                        bytes,
                        expires_at_ms: now + RESERVATION_TTL.as_millis() as u64,
                    },
                ));
            }
        }
        if !reserves.is_empty() || !releases.is_empty() {
            let mut updates: Vec<Update> = reserves.iter().map(|r| r.3.clone()).collect();
            updates.extend(releases);
            // Releases may find their reservation already expired: their outcomes are not
            // looked at.
            let outcomes = meta.propose(updates).await?;
            let mut inner = self.lock();
            let mut refused = None;
            for ((peer, id, bytes, _), outcome) in reserves.iter().zip(&outcomes) {
                match outcome {
                    Outcome::Accepted => inner.ledger.add(
                        *peer,
                        *id,
                        *bytes,
                        now + (RESERVATION_TTL - RESERVATION_MARGIN).as_millis() as u64,
                    ),
                    Outcome::Rejected { reason } => {
                        refused.get_or_insert(RemoteError::ReservationRefused {
                            peer: *peer,
                            bytes: *bytes,
                            reason: reason.clone(),
                        });
                    }
                }
            }
            if let Some(e) = refused {
                return Err(e);
            }
        }
        // Spend reservations page by page.
        let mut inner = self.lock();
        let mut plan = Vec::with_capacity(pages.len());
        for ((client_page, data, checksum), holder) in pages.into_iter().zip(assigned) {
            let reservation = inner.ledger.spend(holder, self.page_bytes, spend_limit);
            plan.push(Planned {
                client_page,
                remote: remote_page_id(self.node, client, client_page),
                data,
                checksum,
                holder,
                epoch: room[&holder].2,
                reservation,
            });
        }
        Ok(plan)
    }

    /// Puts the planned pages on their holders, several requests in flight per peer;
    /// returns the peers that failed, each with its first error.
    async fn move_pages(&self, plan: &[Planned]) -> Vec<(NodeId, RemoteError)> {
        let mut by_peer: BTreeMap<NodeId, Vec<Page>> = BTreeMap::new();
        for p in plan {
            by_peer
                .entry(p.holder)
                .or_default()
                .push(Page::with_checksum(p.remote, p.data.clone(), p.checksum));
        }
        let mut set = JoinSet::new();
        for (peer, pages) in by_peer {
            for batch in batches(pages, self.page_bytes) {
                let peers = self.pool().1.clone();
                let slots = self.slots(peer);
                set.spawn(async move {
                    let _slot = slots.acquire_owned().await.expect("never closed");
                    let bytes: u64 = batch.iter().map(|p| p.data.len() as u64).sum();
                    let n = batch.len() as u64;
                    let r = peers.request(peer, Request::Put { pages: batch }).await;
                    (peer, bytes, n, r)
                });
            }
        }
        let mut failures: BTreeMap<NodeId, RemoteError> = BTreeMap::new();
        while let Some(joined) = set.join_next().await {
            let Ok((peer, bytes, n, result)) = joined else {
                continue;
            };
            let mut inner = self.lock();
            let c = inner.per_peer.entry(peer).or_default();
            match result {
                Ok(Response::Put { .. }) => {
                    c.bytes_spilled += bytes;
                    c.pages_spilled += n;
                }
                Ok(Response::Error(e)) => {
                    c.errors += 1;
                    failures.entry(peer).or_insert(RemoteError::PeerRefused {
                        peer,
                        reason: e.message,
                    });
                }
                Ok(other) => {
                    c.errors += 1;
                    failures.entry(peer).or_insert(RemoteError::PeerRefused {
                        peer,
                        reason: format!("answered a put with {:?}", other.kind()),
                    });
                }
                Err(e) => {
                    c.errors += 1;
                    failures
                        .entry(peer)
                        .or_insert(RemoteError::PeerUnreachable {
                            peer,
                            reason: e.to_string(),
                        });
                }
            }
        }
        failures.into_iter().collect()
    }

    /// Gives back the reservation bytes `plan` spent (nothing of it was proposed).
    fn refund(&self, plan: &[Planned]) {
        let mut inner = self.lock();
        for p in plan {
            if let Some(spent) = p.reservation {
                inner.ledger.refund(p.holder, spent, self.page_bytes);
            }
        }
    }

    /// After a spill failed before placing: refunds its reservations and drops its copies.
    async fn abandon(&self, client: u32, plan: &[Planned]) {
        self.refund(plan);
        self.drop_copies(client, plan).await;
    }

    /// Forgets reservations whose state in the group is uncertain and releases them there
    /// (best effort: one that cannot be released expires with its TTL).
    async fn forget_reservations(&self, ids: impl IntoIterator<Item = ReservationId>) {
        let releases: Vec<Update> = {
            let mut inner = self.lock();
            ids.into_iter()
                .filter(|id| inner.ledger.forget(*id))
                .map(|id| Update::Release { id })
                .collect()
        };
        if releases.is_empty() {
            return;
        }
        if let Err(e) = self.pool().0.propose(releases).await {
            tracing::debug!(error = %e, "could not release reservations; they lapse at expiry");
        }
    }

    /// Best effort after a failed spill: deletes what may have reached the holders, unless
    /// an earlier spill of the same page is recorded on that holder (then it stays).
    async fn drop_copies(&self, client: u32, plan: &[Planned]) {
        let mut by_peer: BTreeMap<NodeId, Vec<PageId>> = BTreeMap::new();
        {
            let inner = self.lock();
            for p in plan {
                let recorded_there = inner
                    .pages
                    .get(&(client, p.client_page))
                    .is_some_and(|h| h.holder == p.holder);
                if !recorded_there {
                    by_peer.entry(p.holder).or_default().push(p.remote);
                }
            }
        }
        for (peer, ids) in by_peer {
            self.delete_or_queue(peer, ids).await;
        }
    }

    /// Records the planned pages in the directory (one `Place` per extent).
    async fn place(&self, plan: &[Planned]) -> Result<(), RemoteError> {
        let version = self.next_version.fetch_add(1, Ordering::Relaxed);
        let mut extents: Vec<(Extent, NodeId, Epoch, Option<ReservationId>)> = Vec::new();
        for p in plan {
            let reservation = p.reservation.map(|s| s.id);
            if let Some((e, holder, _, res)) = extents.last_mut()
                && e.buffer == p.remote.buffer
                && e.end_page() == u64::from(p.remote.index)
                && *holder == p.holder
                && *res == reservation
            {
                e.page_count += 1;
                continue;
            }
            extents.push((
                Extent::new(p.remote.buffer, p.remote.index, 1),
                p.holder,
                p.epoch,
                reservation,
            ));
        }
        let updates: Vec<Update> = extents
            .iter()
            .map(|(extent, holder, epoch, reservation)| Update::Place {
                extent: *extent,
                holder: *holder,
                epoch: *epoch,
                version,
                reservation: *reservation,
            })
            .collect();
        let meta = self.pool().0;
        let used: Vec<ReservationId> = extents.iter().filter_map(|e| e.3).collect();
        let outcomes = match meta.propose(updates).await {
            Ok(o) => o,
            Err(e) => {
                // The placements may or may not have committed: the reservations they
                // spent can no longer be counted on.
                self.forget_reservations(used).await;
                return Err(e.into());
            }
        };
        // Refused placements: once more from free capacity (a lapsed reservation). A
        // reservation that paid for a refused placement is given up: the group and this
        // node would otherwise disagree on what is left of it.
        let retry: Vec<usize> = outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| !o.is_accepted())
            .map(|(i, _)| i)
            .collect();
        if retry.is_empty() {
            return Ok(());
        }
        self.forget_reservations(retry.iter().filter_map(|&i| extents[i].3))
            .await;
        let updates: Vec<Update> = retry
            .iter()
            .map(|&i| {
                let (extent, holder, epoch, _) = extents[i];
                Update::Place {
                    extent,
                    holder,
                    epoch,
                    version: self.next_version.fetch_add(1, Ordering::Relaxed),
                    reservation: None,
                }
            })
            .collect();
        let again = meta.propose(updates).await?;
        for (k, o) in again.iter().enumerate() {
            if let Outcome::Rejected { reason } = o {
                let (extent, holder, _, _) = extents[retry[k]];
                return Err(RemoteError::PlacementRefused {
                    peer: holder,
                    extent,
                    reason: reason.clone(),
                });
            }
        }
        Ok(())
    }

    /// Where `pages` of `client` are: the local record, else the replicated directory.
    async fn locate(
        &self,
        client: u32,
        pages: &[PageId],
    ) -> Result<Vec<Option<Held>>, RemoteError> {
        let mut out: Vec<Option<Held>> = {
            let inner = self.lock();
            pages
                .iter()
                .map(|p| inner.pages.get(&(client, *p)).copied())
                .collect()
        };
        let unknown: Vec<(usize, PageId)> = out
            .iter()
            .enumerate()
            .filter(|(_, h)| h.is_none())
            .map(|(i, _)| (i, remote_page_id(self.node, client, pages[i])))
            .collect();
        if !unknown.is_empty() {
            let ids: Vec<PageId> = unknown.iter().map(|(_, id)| *id).collect();
            let holders = self
                .pool()
                .0
                .read(move |s| {
                    ids.iter()
                        .map(|id| s.holder_of(*id).map(|(_, h)| h.node))
                        .collect::<Vec<_>>()
                })
                .await?;
            for ((i, _), holder) in unknown.into_iter().zip(holders) {
                // The checksum is not known here; 0 means "trust the transport's check".
                out[i] = holder.map(|holder| Held {
                    holder,
                    checksum: 0,
                });
            }
        }
        Ok(out)
    }

    /// The pages' bytes back (checksums verified), in the order asked.
    pub async fn fetch(&self, client: u32, pages: Vec<PageId>) -> Result<Vec<Bytes>, RemoteError> {
        match self.fetch_inner(client, pages).await {
            Ok(v) => Ok(v),
            Err(e) => self.failed(e),
        }
    }

    async fn fetch_inner(
        &self,
        client: u32,
        pages: Vec<PageId>,
    ) -> Result<Vec<Bytes>, RemoteError> {
        for p in &pages {
            self.check(client, *p, None)?;
        }
        if let Backend::Memory { pages: held, .. } = &self.backend {
            let held = held.lock().expect("memory twin lock");
            let mut out = Vec::with_capacity(pages.len());
            for page in pages {
                let data = held
                    .get(&(client, page))
                    .ok_or(RemoteError::NotFound { client, page })?;
                out.push(data.clone());
            }
            let mut inner = self.lock();
            let c = inner.per_peer.entry(MEMORY_PEER).or_default();
            c.pages_fetched += out.len() as u64;
            c.bytes_fetched += out.iter().map(|b| b.len() as u64).sum::<u64>();
            return Ok(out);
        }
        let held = self.locate(client, &pages).await?;
        let mut by_peer: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
        for (i, h) in held.iter().enumerate() {
            match h {
                Some(h) => by_peer.entry(h.holder).or_default().push(i),
                None => {
                    return Err(RemoteError::NotFound {
                        client,
                        page: pages[i],
                    });
                }
            }
        }
        let per_request =
            (REQUEST_BYTES_MAX / self.page_bytes).clamp(1, PAGES_PER_REQUEST as u64) as usize;
        let mut set = JoinSet::new();
        for (peer, idx) in by_peer {
            for chunk in idx.chunks(per_request) {
                let chunk = chunk.to_vec();
                let ids: Vec<PageId> = chunk
                    .iter()
                    .map(|&i| remote_page_id(self.node, client, pages[i]))
                    .collect();
                let peers = self.pool().1.clone();
                let slots = self.slots(peer);
                let grace = self.peer_grace;
                set.spawn(async move {
                    let _slot = slots.acquire_owned().await.expect("never closed");
                    let r = request_within_grace(&peers, peer, Request::Get { pages: ids }, grace)
                        .await;
                    (peer, chunk, r)
                });
            }
        }
        let mut out: Vec<Option<Bytes>> = vec![None; pages.len()];
        let mut first_error = None;
        while let Some(joined) = set.join_next().await {
            let Ok((peer, chunk, result)) = joined else {
                continue;
            };
            match result {
                Ok(Response::Get { pages: got, .. }) => {
                    let mut bytes = 0u64;
                    let mut n = 0u64;
                    let by_id: HashMap<PageId, Page> = got.into_iter().map(|p| (p.id, p)).collect();
                    for i in chunk {
                        let id = remote_page_id(self.node, client, pages[i]);
                        match by_id.get(&id) {
                            Some(p) => {
                                let expected = held[i].map_or(0, |h| h.checksum);
                                if expected != 0 && p.checksum != expected {
                                    first_error.get_or_insert(RemoteError::Corrupt {
                                        client,
                                        page: pages[i],
                                        peer,
                                    });
                                    continue;
                                }
                                bytes += p.data.len() as u64;
                                n += 1;
                                out[i] = Some(p.data.clone());
                            }
                            None => {
                                first_error.get_or_insert(RemoteError::NotFound {
                                    client,
                                    page: pages[i],
                                });
                            }
                        }
                    }
                    let mut inner = self.lock();
                    let c = inner.per_peer.entry(peer).or_default();
                    c.bytes_fetched += bytes;
                    c.pages_fetched += n;
                }
                Ok(other) => {
                    self.lock().per_peer.entry(peer).or_default().errors += 1;
                    let reason = match other {
                        Response::Error(e) => e.message,
                        o => format!("answered a get with {:?}", o.kind()),
                    };
                    first_error.get_or_insert(RemoteError::PeerRefused { peer, reason });
                }
                Err(e) => {
                    self.lock().per_peer.entry(peer).or_default().errors += 1;
                    first_error.get_or_insert(RemoteError::PeerUnreachable {
                        peer,
                        reason: e.to_string(),
                    });
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(out.into_iter().map(|b| b.unwrap_or_default()).collect())
    }

    async fn delete_on(&self, peer: NodeId, ids: Vec<PageId>) -> Result<(), RemoteError> {
        for chunk in ids.chunks(spillway_types::wire::PAGES_PER_FRAME_MAX) {
            match self
                .pool()
                .1
                .request(
                    peer,
                    Request::Delete {
                        pages: chunk.to_vec(),
                    },
                )
                .await
            {
                Ok(Response::Delete { .. }) => {}
                Ok(other) => {
                    let reason = match other {
                        Response::Error(e) => e.message,
                        o => format!("answered a delete with {:?}", o.kind()),
                    };
                    return Err(RemoteError::PeerRefused { peer, reason });
                }
                Err(e) => {
                    return Err(RemoteError::PeerUnreachable {
                        peer,
                        reason: e.to_string(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Drops the peers' copies and the directory entries; unknown pages are ignored.
    pub async fn discard(&self, client: u32, pages: Vec<PageId>) -> Result<(), RemoteError> {
        match self.discard_inner(client, pages).await {
            Ok(()) => Ok(()),
            Err(e) => self.failed(e),
        }
    }

    async fn discard_inner(&self, client: u32, mut pages: Vec<PageId>) -> Result<(), RemoteError> {
        pages.retain(|p| self.check(client, *p, None).is_ok());
        pages.sort();
        pages.dedup();
        if let Backend::Memory { pages: held, .. } = &self.backend {
            let mut held = held.lock().expect("memory twin lock");
            for p in pages {
                held.remove(&(client, p));
            }
            return Ok(());
        }
        let held = self.locate(client, &pages).await?;
        let mut by_peer: BTreeMap<NodeId, Vec<PageId>> = BTreeMap::new();
        let mut removes: Vec<Update> = Vec::new();
        let mut current: Option<Extent> = None;
        for (p, h) in pages.iter().zip(&held) {
            let Some(h) = h else { continue };
            let remote = remote_page_id(self.node, client, *p);
            by_peer.entry(h.holder).or_default().push(remote);
            match &mut current {
                Some(e) if e.buffer == remote.buffer && e.end_page() == u64::from(remote.index) => {
                    e.page_count += 1
                }
                _ => {
                    if let Some(e) = current.take() {
                        removes.push(Update::Remove { extent: e });
                    }
                    current = Some(Extent::new(remote.buffer, remote.index, 1));
                }
            }
        }
        if let Some(e) = current {
            removes.push(Update::Remove { extent: e });
        }
        if removes.is_empty() {
            return Ok(());
        }
        // The directory first: once no record names the copies, nobody reads them.
        self.pool().0.propose(removes).await?;
        {
            let mut inner = self.lock();
            for p in &pages {
                inner.pages.remove(&(client, *p));
            }
        }
        // Once the directory forgets them the pages are gone for the pool; deletes that
        // do not land now are retried until they do (`retry_pending_deletes`).
        for (peer, ids) in by_peer {
            self.delete_or_queue(peer, ids).await;
        }
        Ok(())
    }

    /// Deletes `ids` on `peer`, or queues them for [`RemoteService::retry_pending_deletes`]
    /// when the peer does not answer or refuses.
    async fn delete_or_queue(&self, peer: NodeId, ids: Vec<PageId>) {
        if let Err(e) = self.delete_on(peer, ids.clone()).await {
            tracing::debug!(%peer, error = %e, pages = ids.len(), "delete queued for retry");
            self.lock().per_peer.entry(peer).or_default().errors += 1;
            self.queue_deletes(peer, ids);
        }
    }

    fn queue_deletes(&self, peer: NodeId, ids: Vec<PageId>) {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let set = inner.pending_deletes.entry(peer).or_default();
        for id in ids {
            if inner.pending_deletes_len >= PENDING_DELETES_MAX {
                inner.pending_deletes_dropped += 1;
                if inner.pending_deletes_dropped.is_power_of_two() {
                    tracing::warn!(
                        %peer,
                        dropped = inner.pending_deletes_dropped,
                        "too many deletes pending; a page copy stays on its peer"
                    );
                }
                continue;
            }
            if set.insert(id) {
                inner.pending_deletes_len += 1;
            }
        }
    }

    /// Tries the pending deletes of every peer once; returns how many pages are still
    /// pending. Reachable peers first; a peer in its reconnect backoff waits for the next
    /// round.
    pub async fn retry_pending_deletes(&self) -> usize {
        let work: Vec<(NodeId, Vec<PageId>)> = {
            let inner = self.lock();
            inner
                .pending_deletes
                .iter()
                .map(|(p, ids)| (*p, ids.iter().copied().collect()))
                .collect()
        };
        for (peer, ids) in work {
            if let Backend::Pool { peers, .. } = &self.backend
                && !peers.reachable(peer)
            {
                continue;
            }
            if self.delete_on(peer, ids.clone()).await.is_ok() {
                let mut inner = self.lock();
                let inner = &mut *inner;
                if let Some(set) = inner.pending_deletes.get_mut(&peer) {
                    for id in &ids {
                        if set.remove(id) {
                            inner.pending_deletes_len -= 1;
                        }
                    }
                    if set.is_empty() {
                        inner.pending_deletes.remove(&peer);
                    }
                }
                tracing::debug!(%peer, pages = ids.len(), "pending deletes landed");
            }
        }
        self.lock().pending_deletes_len
    }

    /// Forgets reservations the group no longer holds (see [`Ledger::drop_gone`]): the
    /// group drops a node's reservations when that node starts a new incarnation, and
    /// expires them by its clock. Returns how many were forgotten.
    pub async fn reconcile_reservations(&self) -> Result<usize, RemoteError> {
        let Backend::Pool { meta, .. } = &self.backend else {
            return Ok(0);
        };
        let known: Vec<ReservationId> = self.lock().ledger.remaining().into_keys().collect();
        if known.is_empty() {
            return Ok(0);
        }
        let ids = known.clone();
        let held: BTreeSet<ReservationId> = meta
            .read(move |s| {
                ids.iter()
                    .copied()
                    .filter(|id| s.reservation(*id).is_some())
                    .collect()
            })
            .await?;
        let gone = self
            .lock()
            .ledger
            .drop_gone(&known, |id| held.contains(&id));
        if gone > 0 {
            tracing::debug!(gone, "forgot reservations the group no longer holds");
        }
        Ok(gone)
    }

    /// Releases every page an earlier incarnation of this node spilled for its clients:
    /// those clients went with it (a client's link dies with its node), and new clients
    /// reuse their numbers, so their pages' ids. The directory forgets them first; their
    /// copies are deleted on the holders, or queued until the holders answer (and no new
    /// spill places a page where its delete is pending). Call it before the first client
    /// is taken. Returns how many pages it released.
    pub async fn release_earlier_incarnation(&self) -> Result<u64, RemoteError> {
        let Backend::Pool { meta, .. } = &self.backend else {
            return Ok(0);
        };
        let node = self.node;
        let found: Vec<(Extent, NodeId)> = meta
            .read(move |s| {
                s.extents()
                    .filter(|(e, _)| e.buffer.0 >> NODE_SHIFT == node.0)
                    .map(|(e, h)| (e, h.node))
                    .collect()
            })
            .await?;
        if found.is_empty() {
            return Ok(0);
        }
        for chunk in found.chunks(spillway_meta::limits::BATCH_UPDATES_MAX) {
            let removes = chunk
                .iter()
                .map(|(extent, _)| Update::Remove { extent: *extent })
                .collect();
            meta.propose(removes).await?;
        }
        let mut by_peer: BTreeMap<NodeId, Vec<PageId>> = BTreeMap::new();
        let mut pages = 0u64;
        for (extent, holder) in &found {
            let ids = by_peer.entry(*holder).or_default();
            for index in extent.first_page..extent.first_page + extent.page_count {
                ids.push(PageId {
                    buffer: extent.buffer,
                    index,
                });
                pages += 1;
            }
        }
        for (peer, ids) in by_peer {
            self.delete_or_queue(peer, ids).await;
        }
        tracing::info!(
            pages,
            extents = found.len(),
            "released the pages of an earlier incarnation's clients"
        );
        Ok(pages)
    }

    /// Every [`PENDING_DELETES_RETRY`] until `cancel`: retries the pending deletes and
    /// reconciles the reservation ledger with the group.
    pub(crate) async fn run_upkeep(self: Arc<Self>, cancel: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(PENDING_DELETES_RETRY) => {}
            }
            if self.lock().pending_deletes_len > 0 {
                self.retry_pending_deletes().await;
            }
            if let Err(e) = self.reconcile_reservations().await {
                tracing::debug!(error = %e, "could not reconcile reservations");
            }
        }
    }

    /// Bytes this node's clients may keep on peers now: the up and reachable peers' lent
    /// capacity not used or reserved, plus what this node holds reserved there and has not
    /// spent.
    pub fn capacity_bytes(&self) -> u64 {
        let (meta, peers) = match &self.backend {
            Backend::Pool { meta, peers } => (meta, peers),
            Backend::Memory {
                capacity_bytes,
                pages,
            } => {
                let used: u64 = pages
                    .lock()
                    .expect("memory twin lock")
                    .values()
                    .map(|b| b.len() as u64)
                    .sum();
                return capacity_bytes.saturating_sub(used);
            }
        };
        let view = meta.view();
        let now = now_ms();
        let inner = self.lock();
        view.members
            .iter()
            .filter(|m| m.id != self.node && m.state == MemberState::Up && peers.reachable(m.id))
            .map(|m| m.free_bytes() + inner.ledger.unspent_on(m.id, now))
            .sum()
    }

    /// Counters: bytes and pages spilled/fetched per peer, errors.
    pub fn counters(&self) -> RemoteCounters {
        let inner = self.lock();
        let mut c = RemoteCounters {
            errors: inner.errors,
            reserved_unspent_bytes: inner.ledger.remaining().values().sum(),
            deletes_pending: inner.pending_deletes_len as u64,
            per_peer: inner.per_peer.clone(),
            ..RemoteCounters::default()
        };
        for p in inner.per_peer.values() {
            c.bytes_out += p.bytes_spilled;
            c.bytes_in += p.bytes_fetched;
            c.pages_spilled += p.pages_spilled;
            c.pages_fetched += p.pages_fetched;
        }
        c
    }
}

/// Cuts `pages` into requests of at most [`PAGES_PER_REQUEST`] pages and
/// [`REQUEST_BYTES_MAX`] bytes.
fn batches(pages: Vec<Page>, page_bytes: u64) -> Vec<Vec<Page>> {
    let per = (REQUEST_BYTES_MAX / page_bytes.max(1)).clamp(1, PAGES_PER_REQUEST as u64) as usize;
    let mut out = Vec::new();
    let mut it = pages.into_iter().peekable();
    while it.peek().is_some() {
        out.push(it.by_ref().take(per).collect());
    }
    out
}

/// Sends `request` to `peer`, sending it again after a transport failure (with backoff,
/// [`GRACE_RETRY_MIN`] doubling to [`GRACE_RETRY_MAX`]) until `grace` has passed since the
/// first try: a peer that pauses (a GC, `SIGSTOP`, a reconnect) costs a stall, not the
/// operation. Answers, even errors, return at once. Only for idempotent requests.
async fn request_within_grace(
    peers: &Peers,
    peer: NodeId,
    request: Request,
    grace: Duration,
) -> Result<Response, NetError> {
    let start = Instant::now();
    let mut delay = GRACE_RETRY_MIN;
    let mut tries = 0u32;
    loop {
        tries += 1;
        match peers.request(peer, request.clone()).await {
            Err(e) if transient(&e) && start.elapsed() + delay < grace => {
                if tries == 1 {
                    tracing::warn!(%peer, error = %e, grace_ms = grace.as_millis() as u64,
                        "peer not answering; waiting for it within the grace");
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(GRACE_RETRY_MAX);
            }
            Err(e) if tries > 1 => {
                tracing::warn!(%peer, error = %e, tries, waited_ms = start.elapsed().as_millis() as u64,
                    "peer did not answer within the grace");
                return Err(e);
            }
            r => {
                if tries > 1 {
                    tracing::info!(%peer, tries, waited_ms = start.elapsed().as_millis() as u64,
                        "peer answers again");
                }
                return r;
            }
        }
    }
}

/// Whether a request's failure may pass if the peer is waited for (the connection, not the
/// request, failed).
fn transient(e: &NetError) -> bool {
    matches!(
        e,
        NetError::Connect { .. }
            | NetError::ConnectionLost { .. }
            | NetError::Io { .. }
            | NetError::HelloTimeout { .. }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_ids_pack_node_client_and_buffer_apart() {
        let page = PageId {
            buffer: BufferId(5),
            index: 9,
        };
        let a = remote_page_id(NodeId(1), 2, page);
        let b = remote_page_id(NodeId(2), 2, page);
        let c = remote_page_id(NodeId(1), 3, page);
        assert_eq!(a.buffer.0, 1 << 52 | 2 << 40 | 5);
        assert_eq!(a.index, 9);
        assert_ne!(a, b);
        assert_ne!(a, c);
        let max = remote_page_id(
            NodeId(crate::config::NODE_ID_MAX),
            CLIENT_ID_MAX,
            PageId {
                buffer: BufferId(CLIENT_BUFFER_MAX),
                index: 0,
            },
        );
        assert_eq!(max.buffer.0, u64::MAX);
    }

    #[test]
    fn batches_respect_the_page_and_byte_bounds() {
        let pages: Vec<Page> = (0..20)
            .map(|i| {
                Page::new(
                    PageId {
                        buffer: BufferId(1),
                        index: i,
                    },
                    Bytes::from_static(b"x"),
                )
            })
            .collect();
        let b = batches(pages.clone(), 2 << 20);
        assert_eq!(b.iter().map(Vec::len).collect::<Vec<_>>(), vec![8, 8, 4]);
        let b = batches(pages, 64 << 20);
        assert_eq!(b.len(), 20);
    }
}
