//! The remote tier as this node's local clients see it: [`RemoteService`] stores their
//! pages on peers, fetches them back and discards them, with the pool's directory (the
//! metadata group) recording where every spilled page lives.
//!
//! A spill, step by step:
//! 1. **plan**: the pages are cut into runs of at most [`RUN_PAGES`] pages, and each of a
//!    run's `replicas` copies goes to a distinct up peer (distinct zones when labelled)
//!    with the most weighted room: its capacity left (lent minus used minus reserved, as
//!    applied here) plus what this node still holds reserved there, times its ramp
//!    weight (see [`crate::placement`]);
//! 2. **reserve**: where this node's reservations on a peer do not cover the plan, it
//!    reserves [`crate::NodeConfig::reserve_chunk_bytes`] at a time (rounded up to cover
//!    the deficit, down to the peer's free capacity) through the leader, all peers in one
//!    proposal, before any byte moves. Reservations are then spent locally, page by page,
//!    so most spills need no Raft round trip for them;
//! 3. **move**: each holder gets `Put` requests of up to [`PAGES_PER_REQUEST`] pages, with
//!    up to [`REQUESTS_IN_FLIGHT_PER_PEER`] requests in flight per peer (shared by all
//!    calls), over the node's cached QUIC connections;
//! 4. **place**: one `Place` update per extent and replica slot (pages of one buffer,
//!    contiguous, same holder and reservation) is proposed, after a `Remove` of the
//!    earlier records of pages spilled again; concurrent spills' updates are queued together
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
//! Fetch reads each page from its nearest live holder (this node's record of every copy,
//! else the replicated directory's `holders_of`) and fails over to the next holder within
//! the same fetch ([`crate::placement::Fetch`]); only a page's last holder is waited for
//! within the peer grace, and only until the pool declares it down. A node that restarts has lost its clients (their links die with it), so
//! before it takes a client it releases every page its earlier incarnation spilled
//! ([`RemoteService::release_earlier_incarnation`]): new clients reuse client numbers,
//! hence page ids. Every page's checksum is checked on
//! arrival by the transport and again against the checksum recorded at spill time, on
//! every copy read.
//!
//! Re-replication ([`RemoteService::run_repair`], beside the upkeep): this node repairs
//! its own pages whose copy died, in paced batches (`repair_bytes_per_s`).
//!
//! In-memory twin: none here; the seam local clients see is the local socket's
//! `ClientPages`, whose twin is `MemClientPages`, and the whole service runs over the
//! simulated transport (`Node::start_over`, test `sim_pool`).
//!
//! Rooms: the decisions (placement, reservation spending, batching, fetch routing, which
//! copies to delete) are [`crate::placement::Placement`], a sans-IO brain; this module is
//! its tokio driver: it reads the metadata view and the connection cache, makes the
//! proposals and the requests the brain asks for, and feeds their outcomes back. The
//! vocabulary both share (ids, limits, errors, counters) is `crate::tier`, re-exported
//! here.
//!
//! Lock order: `plan` (async, held across the reservation proposal only) before `brain`
//! (sync, never held across an await).

mod repair;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use spillway_meta::{MemberState, ReservationId, Update};
use spillway_net::{NetError, Request, Response};
use spillway_types::{NodeId, PageId};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::config::NodeConfig;
use crate::meta::{MetaDriver, now_ms};
use crate::peers::Peers;
use crate::placement::{
    Candidate, Deletes, EarlierPages, FETCH_ROUNDS_MAX, Fetch, Held, Placement, Planned,
    SpillRounds, SpillStep, ToPlace, checksummed, earlier_extents,
};
pub use crate::tier::{
    CLIENT_BUFFER_BITS, CLIENT_BUFFER_MAX, CLIENT_ID_BITS, CLIENT_ID_MAX, MOVE_RETRIES,
    PAGES_PER_REQUEST, PENDING_DELETES_MAX, PENDING_DELETES_RETRY, PeerRemoteCounters,
    REQUEST_BYTES_MAX, REQUESTS_IN_FLIGHT_PER_PEER, RESERVATION_TTL, RUN_PAGES, RemoteCounters,
    RemoteError, remote_page_id,
};

/// First wait before a request to a peer that stopped answering is sent again: 50 ms,
/// doubling up to [`GRACE_RETRY_MAX`], within the node's `peer_grace_ms`.
pub(crate) const GRACE_RETRY_MIN: Duration = Duration::from_millis(50);
/// Longest wait between two tries of a request within the peer grace: 1 s.
pub(crate) const GRACE_RETRY_MAX: Duration = Duration::from_secs(1);

/// The remote tier of this node's clients (see the module docs).
#[derive(Debug)]
pub struct RemoteService {
    node: NodeId,
    page_bytes: u64,
    peer_grace: Duration,
    /// This node's zone label (a fetch reads from its own zone first).
    zone: Option<Arc<str>>,
    /// Bandwidth of re-replication, bytes per second.
    repair_bytes_per_s: u64,
    meta: Arc<MetaDriver>,
    peers: Arc<Peers>,
    /// The brain: every decision and the state it needs (never held across an await).
    brain: Mutex<Placement>,
    /// Serializes planning and reserving, so two spills never spend one reservation twice.
    plan: tokio::sync::Mutex<()>,
    /// Woken when a repair batch ends: a client's spill or discard waiting for the
    /// batch's pages ([`Placement::claim`]) tries again.
    repair_ended: tokio::sync::Notify,
    in_flight: Mutex<HashMap<NodeId, Arc<Semaphore>>>,
    /// What the metadata view does not carry of each member: (epoch, zone, group-clock
    /// ms it came up), read from the replicated state by the repair loop every
    /// [`REPAIR_IDLE`] ([`RemoteService::refresh_members`]).
    member_extras: Mutex<HashMap<NodeId, MemberExtra>>,
}

impl RemoteService {
    /// The service of a running node: pages on peers, placed in the directory.
    pub(crate) fn over_pool(config: &NodeConfig, meta: Arc<MetaDriver>, peers: Arc<Peers>) -> Self {
        let page_bytes = config.page_size.bytes();
        if config.replicas == 1 {
            tracing::warn!(
                "replicas = 1: a page spilled to a peer is lost with that peer; \
                 set replicas = 2 (the default) or more to survive a peer's death"
            );
        }
        RemoteService {
            node: config.node_id,
            page_bytes,
            peer_grace: Duration::from_millis(config.peer_grace_ms),
            zone: config.zone.as_deref().map(Arc::from),
            repair_bytes_per_s: config.repair_bytes_per_s,
            meta,
            peers,
            // Ids and versions from the clock, so a restarted node never reuses one.
            brain: Mutex::new(Placement::new(
                config.node_id,
                page_bytes,
                config.reserve_chunk_bytes,
                config.replicas,
                now_ms(),
            )),
            plan: tokio::sync::Mutex::new(()),
            repair_ended: tokio::sync::Notify::new(),
            in_flight: Mutex::new(HashMap::new()),
            member_extras: Mutex::new(HashMap::new()),
        }
    }

    fn pool(&self) -> (&Arc<MetaDriver>, &Arc<Peers>) {
        (&self.meta, &self.peers)
    }

    fn brain(&self) -> std::sync::MutexGuard<'_, Placement> {
        self.brain.lock().expect("remote tier lock")
    }

    /// The clock reservations are asked for and spent by: this host's, or the group's
    /// when that is ahead. A proposer whose clock runs minutes ahead stamps the group's
    /// clock forward; asked by this host's clock alone, every reservation would expire on
    /// arrival until real time caught up (found by `spillway chaos sim`'s clock faults).
    fn pool_now_ms(&self) -> u64 {
        now_ms().max(self.meta.view().clock_ms)
    }

    /// The pool as the brain sees it now: members from the metadata view, reachability
    /// from the connection cache.
    fn candidates(&self) -> Vec<Candidate> {
        let (meta, peers) = self.pool();
        let extras = self
            .member_extras
            .lock()
            .expect("member extras lock")
            .clone();
        let view = meta.view();
        // In the group's clock, as `up_since_ms` is (see `pool_now_ms`).
        let now = now_ms().max(view.clock_ms);
        view.members
            .iter()
            .map(|m| {
                // A member at another epoch than last read came back since: just up.
                let (zone, up_since_ms) = match extras.get(&m.id) {
                    Some((epoch, zone, up)) if *epoch == m.epoch => (zone.clone(), *up),
                    Some((_, zone, _)) => (zone.clone(), now),
                    None => (None, 0),
                };
                (m, zone, up_since_ms)
            })
            .map(|(m, zone, up_since_ms)| Candidate {
                id: m.id,
                state: m.state,
                epoch: m.epoch,
                free_bytes: m.free_bytes(),
                reachable: m.id != self.node && peers.reachable(m.id),
                zone,
                up_since_ms,
            })
            .collect()
    }

    fn slots(&self, peer: NodeId) -> Arc<Semaphore> {
        self.in_flight
            .lock()
            .expect("remote in-flight lock")
            .entry(peer)
            .or_insert_with(|| Arc::new(Semaphore::new(REQUESTS_IN_FLIGHT_PER_PEER)))
            .clone()
    }

    /// Claims `pages` of `client` for a spill or a discard, waiting while a repair batch
    /// holds one of them; the claim ends when the guard drops (see
    /// [`crate::placement::repair`]).
    async fn claim(&self, client: u32, pages: Vec<PageId>) -> Claim<'_> {
        loop {
            let ended = self.repair_ended.notified();
            tokio::pin!(ended);
            // Registered before the try: a batch ending in between still wakes it.
            ended.as_mut().enable();
            if self.brain().claim(client, &pages) {
                return Claim {
                    service: self,
                    client,
                    pages,
                };
            }
            tracing::debug!(
                client,
                pages = pages.len(),
                "waiting for a repair batch holding some of these pages"
            );
            ended.await;
        }
    }

    fn failed<T>(&self, e: RemoteError) -> Result<T, RemoteError> {
        self.brain().errors += 1;
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

    /// Drives one spill through the brain (see [`crate::placement`] for the order).
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
        pages.sort_by_key(|(id, _)| *id);
        pages.dedup_by_key(|(id, _)| *id);
        let _claim = self
            .claim(client, pages.iter().map(|(id, _)| *id).collect())
            .await;
        // Hash once, outside every lock.
        let pages = checksummed(pages);
        // Move; copies whose holder turned out unreachable are planned again without it.
        let items = self.brain().spill_items(pages);
        let mut rounds = SpillRounds::new(self.plan_and_reserve(client, items, &[]).await?);
        for attempt in 0..=MOVE_RETRIES {
            let failures = self.move_pages(rounds.pending()).await;
            let step = rounds.after_round(&mut self.brain(), failures, attempt);
            let items = match step {
                SpillStep::Done => break,
                SpillStep::Fail(e) => {
                    self.abandon(client, rounds.copies()).await;
                    return Err(e);
                }
                SpillStep::Replan { failed, items } => {
                    tracing::debug!(
                        ?failed,
                        "peers unreachable during a spill; placing their pages elsewhere"
                    );
                    items
                }
            };
            match self
                .plan_and_reserve(client, items, rounds.excluded())
                .await
            {
                Ok(p) => rounds.planned(p),
                Err(e) => {
                    self.abandon(client, rounds.copies()).await;
                    return Err(e);
                }
            }
        }
        let plan = rounds.into_copies();
        if let Err(e) = self.place(client, &plan, true).await {
            self.drop_copies(client, &plan).await;
            return Err(e);
        }
        tracing::debug!(client, copies = %copies_of(&plan), "spilled");
        // Record, and drop copies a re-spill left on another holder.
        let stale = self.brain().placed(client, &plan);
        self.delete_all_or_queue(stale).await;
        Ok(())
    }

    /// Chooses holders for every item's slots and makes sure reservations cover them: the
    /// brain plans, the group settles the reservations, the brain spends them.
    async fn plan_and_reserve(
        &self,
        client: u32,
        items: Vec<ToPlace>,
        excluded: &[NodeId],
    ) -> Result<Vec<Planned>, RemoteError> {
        let _plan = self.plan.lock().await;
        let candidates = self.candidates();
        let plan = self
            .brain()
            .plan(client, items, &candidates, excluded, self.pool_now_ms())?;
        let proposal = plan.proposal();
        let outcomes = if proposal.is_empty() {
            Vec::new()
        } else {
            self.pool().0.propose(proposal).await?
        };
        self.brain().reserved(plan, &outcomes)
    }

    /// Puts the planned pages on their holders, several requests in flight per peer;
    /// returns the peers that failed, each with its first error.
    async fn move_pages(&self, plan: &[Planned]) -> Vec<(NodeId, RemoteError)> {
        let mut set = JoinSet::new();
        for (peer, batch) in self.brain().put_batches(plan) {
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
        let mut failures: BTreeMap<NodeId, RemoteError> = BTreeMap::new();
        while let Some(joined) = set.join_next().await {
            let Ok((peer, bytes, n, result)) = joined else {
                continue;
            };
            if let Some(e) = self.brain().put_done(peer, bytes, n, result) {
                failures.entry(peer).or_insert(e);
            }
        }
        failures.into_iter().collect()
    }

    /// After a spill failed before placing: refunds its reservations and drops its copies.
    async fn abandon(&self, client: u32, plan: &[Planned]) {
        self.brain().refund(plan);
        self.drop_copies(client, plan).await;
    }

    /// Forgets reservations whose state in the group is uncertain and releases them there
    /// (best effort: one that cannot be released expires with its TTL).
    async fn release(&self, releases: Vec<Update>) {
        if releases.is_empty() {
            return;
        }
        if let Err(e) = self.pool().0.propose(releases).await {
            tracing::debug!(error = %e, "could not release reservations; they lapse at expiry");
        }
    }

    /// Best effort after a failed spill: deletes what may have reached the holders.
    async fn drop_copies(&self, client: u32, plan: &[Planned]) {
        let copies = self.brain().copies_to_drop(client, plan);
        self.delete_all_or_queue(copies).await;
    }

    /// Records the planned pages in the directory (one `Place` per extent); a placement
    /// refused because its reservation lapsed is proposed again from free capacity.
    /// A spill's placements (`spill`) first remove the pages' earlier records; a repair's
    /// only fill their dead slots.
    async fn place(&self, client: u32, plan: &[Planned], spill: bool) -> Result<(), RemoteError> {
        let placements = self.brain().placements(plan, client, spill);
        let meta = self.pool().0;
        let outcomes = match meta.propose(placements.updates.clone()).await {
            Ok(o) => o,
            Err(e) => {
                // The placements may or may not have committed: the reservations they
                // spent can no longer be counted on.
                let used = placements.extents.iter().filter_map(|e| e.reservation);
                let releases = self.brain().forget_reservations(used);
                self.release(releases).await;
                return Err(e.into());
            }
        };
        let (retry, updates, releases) = self.brain().replace_refused(&placements, &outcomes);
        if retry.is_empty() {
            return Ok(());
        }
        self.release(releases).await;
        let again = meta.propose(updates).await?;
        placements.refused_again(&retry, &again)
    }

    /// Where `pages` of `client` are: the brain's record, else the replicated directory.
    async fn locate(
        &self,
        client: u32,
        pages: &[PageId],
    ) -> Result<Vec<Option<Held>>, RemoteError> {
        let mut out = self.brain().known_holders(client, pages);
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
                        .map(|id| Held::in_directory(s, *id))
                        .collect::<Vec<_>>()
                })
                .await?;
            for ((i, _), held) in unknown.into_iter().zip(holders) {
                out[i] = held;
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
        let held = self.locate(client, &pages).await?;
        let pool = self.candidates();
        let mut fetch =
            self.brain()
                .start_fetch(client, pages, &held, &pool, self.zone.as_deref())?;
        self.run_fetch(&mut fetch, true).await;
        fetch.finish()
    }

    /// Runs `fetch` to its end: rounds of requests, each page to its next holder after a
    /// failure. A request whose pages all have another holder left is tried once; the
    /// last holder of a page is waited for within the peer grace when `grace` (a demand
    /// fetch; a repair tries again at its next round instead).
    async fn run_fetch(&self, fetch: &mut Fetch, grace: bool) {
        // Each round moves every failed page to its next holder: SLOTS rounds at most;
        // the bound also ends a round whose replies were lost (a panicked task).
        for _ in 0..=FETCH_ROUNDS_MAX {
            let requests = self.brain().get_requests(fetch);
            if requests.is_empty() {
                return;
            }
            let mut set = JoinSet::new();
            for (k, r) in requests.iter().enumerate() {
                let (peer, ids, last_chance) = (r.peer, r.ids.clone(), r.last_chance && grace);
                let peers = self.pool().1.clone();
                let slots = self.slots(peer);
                let grace = self.peer_grace;
                let meta = self.meta.clone();
                let declared_down = move || {
                    meta.view()
                        .members
                        .iter()
                        .any(|m| m.id == peer && m.state == MemberState::Down)
                };
                set.spawn(async move {
                    let _slot = slots.acquire_owned().await.expect("never closed");
                    let request = Request::Get { pages: ids };
                    let r = if last_chance {
                        request_within_grace(&peers, peer, request, grace, declared_down).await
                    } else {
                        peers.request(peer, request).await
                    };
                    (k, r)
                });
            }
            while let Some(joined) = set.join_next().await {
                let Ok((k, result)) = joined else {
                    continue;
                };
                if let Err(e) = &result {
                    tracing::debug!(peer = %requests[k].peer, error = %e,
                        "get failed; its pages are read from their next holder");
                }
                self.brain().got(fetch, &requests[k], result);
            }
        }
    }

    async fn delete_on(&self, peer: NodeId, ids: Vec<PageId>) -> Result<(), RemoteError> {
        for chunk in ids.chunks(spillway_types::wire::PAGES_PER_FRAME_MAX) {
            let request = Request::Delete {
                pages: chunk.to_vec(),
            };
            match self.pool().1.request(peer, request).await {
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
        let _claim = self.claim(client, pages.clone()).await;
        let held = self.locate(client, &pages).await?;
        let (removes, copies) = self.brain().removals(client, &pages, &held);
        if removes.is_empty() {
            return Ok(());
        }
        // The directory first: once no record names the copies, nobody reads them.
        self.pool().0.propose(removes).await?;
        self.brain().forget(client, &pages);
        // Once the directory forgets them the pages are gone for the pool; deletes that
        // do not land now are retried until they do (`retry_pending_deletes`).
        self.delete_all_or_queue(copies).await;
        Ok(())
    }

    /// Deletes `ids` on `peer`, or queues them for [`RemoteService::retry_pending_deletes`]
    /// when the peer does not answer or refuses. A peer in its reconnect backoff (dead or
    /// paused: a repair's dead copies are on one) is not waited for: queued at once.
    async fn delete_or_queue(&self, peer: NodeId, ids: Vec<PageId>) {
        if !self.peers.reachable(peer) {
            self.brain().queue_deletes(peer, ids);
            return;
        }
        if let Err(e) = self.delete_on(peer, ids.clone()).await {
            tracing::debug!(%peer, error = %e, pages = ids.len(), "delete queued for retry");
            self.brain().queue_deletes(peer, ids);
        }
    }

    async fn delete_all_or_queue(&self, deletes: Deletes) {
        for (peer, ids) in deletes {
            self.delete_or_queue(peer, ids).await;
        }
    }

    /// Tries the pending deletes of every peer once; returns how many pages are still
    /// pending. Reachable peers first; a peer in its reconnect backoff waits for the next
    /// round.
    pub async fn retry_pending_deletes(&self) -> usize {
        let work = self.brain().pending_deletes();
        for (peer, ids) in work {
            if !self.peers.reachable(peer) {
                continue;
            }
            if self.delete_on(peer, ids.clone()).await.is_ok() {
                self.brain().deletes_landed(peer, &ids);
                tracing::debug!(%peer, pages = ids.len(), "pending deletes landed");
            }
        }
        self.brain().pending_deletes_len()
    }

    /// Forgets reservations the group no longer holds (see `Ledger::drop_gone`): the
    /// group drops a node's reservations when that node starts a new incarnation, and
    /// expires them by its clock. Returns how many were forgotten.
    pub async fn reconcile_reservations(&self) -> Result<usize, RemoteError> {
        let meta = &self.meta;
        let known: Vec<ReservationId> = self.brain().ledger().remaining().into_keys().collect();
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
            .brain()
            .ledger_mut()
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
        let meta = &self.meta;
        let node = self.node;
        let found = meta.read(move |s| earlier_extents(s, node)).await?;
        if found.is_empty() {
            return Ok(0);
        }
        let EarlierPages {
            removals,
            deletes,
            pages,
        } = EarlierPages::of(&found);
        for removes in removals {
            meta.propose(removes).await?;
        }
        self.delete_all_or_queue(deletes).await;
        tracing::info!(
            pages,
            extents = found.len(),
            "released the pages of an earlier incarnation's clients"
        );
        Ok(pages)
    }

    /// Until `cancel`: every [`PENDING_DELETES_RETRY`], retries the pending deletes and
    /// reconciles the reservation ledger with the group; and, beside it, re-replicates
    /// this node's pages whose copies died ([`RemoteService::run_repair`]).
    pub(crate) async fn run_upkeep(self: Arc<Self>, cancel: tokio_util::sync::CancellationToken) {
        tokio::join!(
            self.clone().run_repair(cancel.clone()),
            self.run_housekeeping(cancel)
        );
    }

    async fn run_housekeeping(self: Arc<Self>, cancel: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(PENDING_DELETES_RETRY) => {}
            }
            if self.brain().pending_deletes_len() > 0 {
                self.retry_pending_deletes().await;
            }
            if let Err(e) = self.reconcile_reservations().await {
                tracing::debug!(error = %e, "could not reconcile reservations");
            }
        }
    }

    /// Bytes this node's clients may keep on peers now: the up and reachable peers' lent
    /// capacity not used or reserved, plus what this node holds reserved there and has not
    /// spent, divided by the copies a page takes.
    pub fn capacity_bytes(&self) -> u64 {
        let candidates = self.candidates();
        self.brain().capacity_bytes(&candidates, self.pool_now_ms())
    }

    /// Which buffers of this node's clients have a copy of a page on each holder (at
    /// most [`crate::placement::PLACEMENTS_LISTED_MAX`] entries; `true`: more left out).
    pub(crate) fn buffers_by_holder(&self) -> (crate::placement::HolderBuffers, bool) {
        self.brain().buffers_by_holder()
    }

    /// Counters: bytes and pages spilled/fetched per peer, errors.
    pub fn counters(&self) -> RemoteCounters {
        let brain = self.brain();
        let under = brain.under_replicated;
        let mut c = RemoteCounters {
            errors: brain.errors,
            replicas: brain.replicas(),
            fetch_failovers: brain.fetch_failovers,
            short_copies: brain.short_copies,
            under_replicated_pages: under.pages,
            under_replicated_bytes: under.bytes,
            lost_pages: under.lost_pages,
            repaired_pages: brain.repaired_pages,
            repaired_bytes: brain.repaired_bytes,
            repair_errors: brain.repair_errors,
            reserved_unspent_bytes: brain.ledger().remaining().values().sum(),
            deletes_pending: brain.pending_deletes_len() as u64,
            per_peer: brain.per_peer.clone(),
            ..RemoteCounters::default()
        };
        for p in brain.per_peer.values() {
            c.bytes_out += p.bytes_spilled;
            c.bytes_in += p.bytes_fetched;
            c.pages_spilled += p.pages_spilled;
            c.pages_fetched += p.pages_fetched;
        }
        c
    }
}

/// Sends `request` to `peer`, sending it again after a transport failure (with backoff,
/// [`GRACE_RETRY_MIN`] doubling to [`GRACE_RETRY_MAX`]) until `grace` has passed since the
/// first try: a peer that pauses (a GC, `SIGSTOP`, a reconnect) costs a stall, not the
/// operation. Answers, even errors, return at once. Only for idempotent requests.
///
/// The wait ends early once the pool has declared the peer down (`declared_down`): a
/// member declared down comes back at a new epoch, which makes every copy it held dead,
/// so waiting could not save the page (with one copy, `PageLost` comes after the failure
/// detector's timeout, 2 s by default, instead of after the whole grace).
async fn request_within_grace(
    peers: &Peers,
    peer: NodeId,
    request: Request,
    grace: Duration,
    declared_down: impl Fn() -> bool,
) -> Result<Response, NetError> {
    let start = Instant::now();
    let mut delay = GRACE_RETRY_MIN;
    let mut tries = 0u32;
    loop {
        tries += 1;
        match peers.request(peer, request.clone()).await {
            Err(e) if transient(&e) && declared_down() => {
                tracing::warn!(%peer, error = %e, tries, waited_ms = start.elapsed().as_millis() as u64,
                    "peer declared down: its copies are dead, not waiting for it");
                return Err(e);
            }
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

/// A member's epoch, zone and the group-clock ms it came up (see `member_extras`).
type MemberExtra = (spillway_meta::Epoch, Option<Arc<str>>, u64);

/// Whether a request's failure may pass if the peer is waited for (the connection, not the
/// request, failed).
pub(crate) fn transient(e: &NetError) -> bool {
    matches!(
        e,
        NetError::Connect { .. }
            | NetError::ConnectionLost { .. }
            | NetError::Io { .. }
            | NetError::HelloTimeout { .. }
    )
}

/// A client's claim on pages for a spill or a discard ([`RemoteService::claim`]).
struct Claim<'a> {
    service: &'a RemoteService,
    client: u32,
    pages: Vec<PageId>,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.service.brain().unclaim(self.client, &self.pages);
    }
}

/// `planned`'s copies for a debug log: `buffer.page@holder/slot`, comma-separated.
fn copies_of(planned: &[Planned]) -> String {
    let copies: Vec<String> = planned
        .iter()
        .map(|p| {
            format!(
                "{}.{}@{}/{}",
                p.client_page.buffer.0, p.client_page.index, p.holder.0, p.slot
            )
        })
        .collect();
    copies.join(",")
}
