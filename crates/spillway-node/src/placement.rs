//! The remote tier's brain without IO: where spilled pages go, which reservations pay for
//! them, how they are cut into requests, where a fetch reads, and which copies must be
//! deleted. [`Placement`] never awaits, never touches a socket, a lock or the clock: the
//! driver (`remote::RemoteService`) hands it what it observed (the pool's
//! members, which peers are reachable, the outcomes of proposals, the replies of peers)
//! and `now`, and gets back what to do (proposals to make, requests to send, copies to
//! delete). Its unit tests run it without a pool.
//!
//! Method groups, in the order a driver calls them:
//! - spill: [`Placement::plan`] (holders for runs of pages; reservations to make and to
//!   release, as one proposal) -> propose -> [`Placement::reserved`] (the outcomes into
//!   the ledger; the reservations spent page by page) -> [`Placement::put_batches`] ->
//!   send, each reply to [`Placement::put_done`] -> [`Placement::after_moves`] (done,
//!   plan the unreachable peers' pages again, or fail; [`Placement::refund`] what the
//!   replanned or abandoned pages spent) -> [`Placement::placements`] -> propose ->
//!   [`Placement::placed`] (the copies a re-spill left elsewhere, to delete);
//! - fetch: [`Placement::known_holders`] (the directory fills the gaps) ->
//!   [`Placement::get_requests`] -> send, each reply to [`Placement::got`];
//! - discard: [`Placement::removals`] -> propose -> [`Placement::forget`] -> delete;
//! - deletes that did not land: [`Placement::queue_deletes`], retried from
//!   [`Placement::pending_deletes`], cleared by [`Placement::deletes_landed`].
//!
//! Next (node failure): replica choice lands in [`Placement::plan`] (k holders per run
//! instead of one), failure handling as an event (a member's `SetMemberState` to down,
//! seen in [`Candidate::state`]) that yields the re-replication requests.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use bytes::Bytes;
use spillway_meta::{Epoch, Extent, MemberState, ReservationId, Update};
use spillway_net::{NetError, Page, Response};
use spillway_types::{BufferId, NodeId, PageId};

use crate::ledger::{Ledger, Spent};
use crate::meta::Outcome;
use crate::tier::{
    MOVE_RETRIES, NODE_SHIFT, PAGES_PER_REQUEST, PENDING_DELETES_MAX, PeerRemoteCounters,
    REQUEST_BYTES_MAX, RESERVATION_TTL, RUN_PAGES, RemoteError, remote_page_id,
};

/// A reservation is no longer spent this long before it lapses: 30 s.
const RESERVATION_MARGIN: Duration = Duration::from_secs(30);

/// Where a spilled page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Held {
    /// The peer holding it.
    pub(crate) holder: NodeId,
    /// Its checksum as spilled; 0 when only the directory knew the holder (then the
    /// transport's check is trusted).
    pub(crate) checksum: u64,
}

/// A page to spill, hashed once when the spill starts.
#[derive(Clone, Debug)]
pub(crate) struct SpillPage {
    /// The client's page id.
    pub(crate) page: PageId,
    /// Its bytes.
    pub(crate) data: Bytes,
    /// `page_checksum(&data)`.
    pub(crate) checksum: u64,
}

/// One peer as the planner sees it, from the metadata view and the connection cache.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Candidate {
    /// The peer.
    pub(crate) id: NodeId,
    /// Up, down or leaving (only up peers take pages).
    pub(crate) state: MemberState,
    /// Its incarnation (placements carry it).
    pub(crate) epoch: Epoch,
    /// Lent capacity neither used nor reserved.
    pub(crate) free_bytes: u64,
    /// Whether its connection is not in a reconnect backoff.
    pub(crate) reachable: bool,
}

/// A reservation to propose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reserve {
    /// The peer.
    pub(crate) peer: NodeId,
    /// A fresh id.
    pub(crate) id: ReservationId,
    /// Bytes.
    pub(crate) bytes: u64,
}

/// A spill's plan before its reservations are settled (from [`Placement::plan`]).
#[derive(Debug)]
pub(crate) struct Plan {
    client: u32,
    pages: Vec<SpillPage>,
    /// The holder of each page, in order.
    assigned: Vec<NodeId>,
    epochs: BTreeMap<NodeId, Epoch>,
    reserves: Vec<Reserve>,
    releases: Vec<ReservationId>,
    now_ms: u64,
}

impl Plan {
    /// The proposal to make before any byte moves: the reservations, then the releases
    /// of reservations this node will not spend any more. Empty: nothing to propose.
    pub(crate) fn proposal(&self) -> Vec<Update> {
        let expires_at_ms = self.now_ms + RESERVATION_TTL.as_millis() as u64;
        let reserves = self.reserves.iter().map(|r| Update::Reserve {
            id: r.id,
            node: r.peer,
            bytes: r.bytes,
            expires_at_ms,
        });
        let releases = self.releases.iter().map(|&id| Update::Release { id });
        reserves.chain(releases).collect()
    }

    /// The holder chosen for each page, in page order.
    #[cfg(test)]
    pub(crate) fn holders(&self) -> &[NodeId] {
        &self.assigned
    }

    /// The reservations it asks for.
    #[cfg(test)]
    pub(crate) fn reserves(&self) -> &[Reserve] {
        &self.reserves
    }
}

/// One page's place in a settled plan.
#[derive(Clone, Debug)]
pub(crate) struct Planned {
    pub(crate) client_page: PageId,
    pub(crate) remote: PageId,
    pub(crate) data: Bytes,
    pub(crate) checksum: u64,
    pub(crate) holder: NodeId,
    pub(crate) epoch: Epoch,
    pub(crate) reservation: Option<Spent>,
}

/// What to do after a round of puts ([`Placement::after_moves`]).
#[derive(Debug)]
pub(crate) enum MoveVerdict {
    /// Every page landed.
    Done,
    /// These peers were unreachable: plan their pages again without them.
    Replan(Vec<NodeId>),
    /// Give up with this error.
    Fail(RemoteError),
}

/// A placement proposal: one `Place` per extent, with what a refusal needs.
#[derive(Debug)]
pub(crate) struct Placements {
    /// (extent, holder, epoch, reservation) per update, in order.
    pub(crate) extents: Vec<(Extent, NodeId, Epoch, Option<ReservationId>)>,
    /// The updates.
    pub(crate) updates: Vec<Update>,
}

/// One `Get` request of a fetch: the peer, the indexes of the pages in the fetch, and
/// their remote ids.
pub(crate) type GetRequest = (NodeId, Vec<usize>, Vec<PageId>);

/// Page copies to delete, per peer.
pub(crate) type Deletes = BTreeMap<NodeId, Vec<PageId>>;

/// The remote tier's decisions and the state they need (see the module docs).
#[derive(Debug)]
pub(crate) struct Placement {
    node: NodeId,
    page_bytes: u64,
    reserve_chunk_bytes: u64,
    pages: HashMap<(u32, PageId), Held>,
    ledger: Ledger,
    /// Copies to delete on peers that did not answer yet (retried until they land;
    /// deletes are idempotent). A spill never places a page on a peer where a delete of
    /// it is pending.
    pending_deletes: BTreeMap<NodeId, BTreeSet<PageId>>,
    pending_deletes_len: usize,
    pending_deletes_dropped: u64,
    pub(crate) per_peer: BTreeMap<NodeId, PeerRemoteCounters>,
    pub(crate) errors: u64,
    next_reservation: u64,
    next_version: u64,
}

impl Placement {
    /// A brain for `node`; reservation ids and placement versions start from `start_ms`
    /// (the clock when the node started), so a restarted node never reuses one.
    pub(crate) fn new(
        node: NodeId,
        page_bytes: u64,
        reserve_chunk_bytes: u64,
        start_ms: u64,
    ) -> Placement {
        Placement {
            node,
            page_bytes,
            reserve_chunk_bytes,
            pages: HashMap::new(),
            ledger: Ledger::default(),
            pending_deletes: BTreeMap::new(),
            pending_deletes_len: 0,
            pending_deletes_dropped: 0,
            per_peer: BTreeMap::new(),
            errors: 0,
            next_reservation: node.0 << RESERVATION_NODE_SHIFT
                | (start_ms & ((1 << RESERVATION_NODE_SHIFT) - 1)),
            next_version: start_ms << VERSION_SHIFT,
        }
    }

    /// The ledger of reservations (read-only).
    pub(crate) fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The ledger of reservations, for reconciliation with the group.
    pub(crate) fn ledger_mut(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    /// Chooses a holder for every page: runs of up to [`RUN_PAGES`] pages, each to the
    /// up, reachable, not excluded peer with the most room (free capacity plus what this
    /// node holds reserved there), page by page where no peer takes a whole run; and the
    /// reservations to make where this node's fall short, in chunks of
    /// `reserve_chunk_bytes` (down to the peer's free capacity).
    pub(crate) fn plan(
        &mut self,
        client: u32,
        pages: Vec<SpillPage>,
        pool: &[Candidate],
        excluded: &[NodeId],
        now_ms: u64,
    ) -> Result<Plan, RemoteError> {
        let spend_limit = now_ms + RESERVATION_MARGIN.as_millis() as u64;
        // Room per peer: (free, reserved by us, epoch).
        let mut room: BTreeMap<NodeId, (u64, u64, Epoch)> = BTreeMap::new();
        // A peer with a delete of one of these pages pending could drop the new copy.
        let deleting = |peer: NodeId| {
            self.pending_deletes.get(&peer).is_some_and(|set| {
                pages
                    .iter()
                    .any(|p| set.contains(&remote_page_id(self.node, client, p.page)))
            })
        };
        for m in pool {
            if m.id == self.node
                || m.state != MemberState::Up
                || excluded.contains(&m.id)
                || !m.reachable
                || deleting(m.id)
            {
                continue;
            }
            let ours = self.ledger.unspent_on(m.id, spend_limit);
            room.insert(m.id, (m.free_bytes, ours, m.epoch));
        }
        let needed_bytes = pages.len() as u64 * self.page_bytes;
        let total_room: u64 = room.values().map(|(f, o, _)| f + o).sum();
        let no_room = RemoteError::NoRoom {
            requested_bytes: needed_bytes,
            free_bytes: total_room,
        };
        if needed_bytes > total_room {
            return Err(no_room);
        }
        let mut left: BTreeMap<NodeId, u64> =
            room.iter().map(|(p, (f, o, _))| (*p, f + o)).collect();
        let most_room = |left: &BTreeMap<NodeId, u64>, bytes: u64| {
            left.iter()
                .filter(|(_, l)| **l >= bytes)
                .max_by_key(|(p, l)| (**l, std::cmp::Reverse(**p)))
                .map(|(p, _)| *p)
        };
        let mut assigned: Vec<NodeId> = Vec::with_capacity(pages.len());
        for run in pages.chunks(RUN_PAGES) {
            let run_bytes = run.len() as u64 * self.page_bytes;
            if let Some(peer) = most_room(&left, run_bytes) {
                *left.get_mut(&peer).expect("peer in room") -= run_bytes;
                assigned.extend(std::iter::repeat_n(peer, run.len()));
                continue;
            }
            // No single peer takes the whole run: page by page.
            for _ in run {
                let Some(peer) = most_room(&left, self.page_bytes) else {
                    return Err(no_room);
                };
                *left.get_mut(&peer).expect("peer in room") -= self.page_bytes;
                assigned.push(peer);
            }
        }
        let mut need_per_peer: BTreeMap<NodeId, u64> = BTreeMap::new();
        for peer in &assigned {
            *need_per_peer.entry(*peer).or_default() += self.page_bytes;
        }
        let mut reserves = Vec::new();
        for (peer, need) in &need_per_peer {
            let (free, ours, _) = room[peer];
            if *need > ours {
                let deficit = need - ours;
                let chunk = self.reserve_chunk_bytes.max(self.page_bytes);
                let want = deficit.div_ceil(chunk) * chunk;
                let bytes = want
                    .min(free / self.page_bytes * self.page_bytes)
                    .max(deficit);
                let id = ReservationId(self.next_reservation);
                self.next_reservation += 1;
                reserves.push(Reserve {
                    peer: *peer,
                    id,
                    bytes,
                });
            }
        }
        // Reservations this node will not spend any more are given back now, not at
        // expiry.
        let releases = self.ledger.take_lapsing(spend_limit);
        Ok(Plan {
            client,
            pages,
            assigned,
            epochs: room.iter().map(|(p, (_, _, e))| (*p, *e)).collect(),
            reserves,
            releases,
            now_ms,
        })
    }

    /// Settles `plan` with the outcomes of its proposal (empty if it proposed nothing):
    /// accepted reservations join the ledger, then every page spends a page of a
    /// reservation on its holder where one is left. A refused reservation fails the spill
    /// (nothing was spent).
    pub(crate) fn reserved(
        &mut self,
        plan: Plan,
        outcomes: &[Outcome],
    ) -> Result<Vec<Planned>, RemoteError> {
        let spend_until = plan.now_ms + (RESERVATION_TTL - RESERVATION_MARGIN).as_millis() as u64;
        let mut refused = None;
        // Releases may find their reservation already expired: their outcomes are not
        // looked at.
        for (r, outcome) in plan.reserves.iter().zip(outcomes) {
            match outcome {
                Outcome::Accepted => self.ledger.add(r.peer, r.id, r.bytes, spend_until),
                Outcome::Rejected { reason } => {
                    refused.get_or_insert(RemoteError::ReservationRefused {
                        peer: r.peer,
                        bytes: r.bytes,
                        reason: reason.clone(),
                    });
                }
            }
        }
        if let Some(e) = refused {
            return Err(e);
        }
        let spend_limit = plan.now_ms + RESERVATION_MARGIN.as_millis() as u64;
        let client = plan.client;
        Ok(plan
            .pages
            .into_iter()
            .zip(plan.assigned)
            .map(|(p, holder)| Planned {
                client_page: p.page,
                remote: remote_page_id(self.node, client, p.page),
                data: p.data,
                checksum: p.checksum,
                holder,
                epoch: plan.epochs[&holder],
                reservation: self.ledger.spend(holder, self.page_bytes, spend_limit),
            })
            .collect())
    }

    /// The `Put` requests of `planned`: per holder, at most [`PAGES_PER_REQUEST`] pages
    /// and [`REQUEST_BYTES_MAX`] bytes each.
    pub(crate) fn put_batches(&self, planned: &[Planned]) -> Vec<(NodeId, Vec<Page>)> {
        let mut by_peer: BTreeMap<NodeId, Vec<Page>> = BTreeMap::new();
        for p in planned {
            by_peer
                .entry(p.holder)
                .or_default()
                .push(Page::with_checksum(p.remote, p.data.clone(), p.checksum));
        }
        by_peer
            .into_iter()
            .flat_map(|(peer, pages)| {
                batches(pages, self.page_bytes)
                    .into_iter()
                    .map(move |b| (peer, b))
            })
            .collect()
    }

    /// The reply to a `Put` of `pages` pages and `bytes` bytes to `peer`: counted; the
    /// error it is, if it is one.
    pub(crate) fn put_done(
        &mut self,
        peer: NodeId,
        bytes: u64,
        pages: u64,
        result: Result<Response, NetError>,
    ) -> Option<RemoteError> {
        let c = self.per_peer.entry(peer).or_default();
        let e = match result {
            Ok(Response::Put { .. }) => {
                c.bytes_spilled += bytes;
                c.pages_spilled += pages;
                return None;
            }
            Ok(Response::Error(e)) => RemoteError::PeerRefused {
                peer,
                reason: e.message,
            },
            Ok(other) => RemoteError::PeerRefused {
                peer,
                reason: format!("answered a put with {:?}", other.kind()),
            },
            Err(e) => RemoteError::PeerUnreachable {
                peer,
                reason: e.to_string(),
            },
        };
        c.errors += 1;
        Some(e)
    }

    /// After round `attempt` (from 0) of puts with `failures` (the first error of each
    /// failed peer): done, place the unreachable peers' pages elsewhere (at most
    /// [`MOVE_RETRIES`] times), or give up (a refusal is not retried).
    pub(crate) fn after_moves(failures: Vec<(NodeId, RemoteError)>, attempt: usize) -> MoveVerdict {
        if failures.is_empty() {
            return MoveVerdict::Done;
        }
        let all_unreachable = failures
            .iter()
            .all(|(_, e)| matches!(e, RemoteError::PeerUnreachable { .. }));
        if attempt < MOVE_RETRIES && all_unreachable {
            return MoveVerdict::Replan(failures.into_iter().map(|(p, _)| p).collect());
        }
        let (_, e) = failures.into_iter().next().expect("a failure");
        MoveVerdict::Fail(e)
    }

    /// Gives back the reservation bytes `planned` spent (nothing of it was proposed).
    pub(crate) fn refund(&mut self, planned: &[Planned]) {
        for p in planned {
            if let Some(spent) = p.reservation {
                self.ledger.refund(p.holder, spent, self.page_bytes);
            }
        }
    }

    /// Forgets reservations whose state in the group is uncertain; returns the releases
    /// to propose for them (best effort: one not released expires with its TTL).
    pub(crate) fn forget_reservations(
        &mut self,
        ids: impl IntoIterator<Item = ReservationId>,
    ) -> Vec<Update> {
        ids.into_iter()
            .filter(|id| self.ledger.forget(*id))
            .map(|id| Update::Release { id })
            .collect()
    }

    /// The copies a failed spill may have left: every planned page, unless an earlier
    /// spill of the same page is recorded on that holder (then it stays).
    pub(crate) fn copies_to_drop(&self, client: u32, planned: &[Planned]) -> Deletes {
        let mut by_peer = Deletes::new();
        for p in planned {
            let recorded_there = self
                .pages
                .get(&(client, p.client_page))
                .is_some_and(|h| h.holder == p.holder);
            if !recorded_there {
                by_peer.entry(p.holder).or_default().push(p.remote);
            }
        }
        by_peer
    }

    /// The placement proposal of `planned`: one `Place` per extent (pages of one buffer,
    /// contiguous, same holder and reservation), all under one fresh version.
    pub(crate) fn placements(&mut self, planned: &[Planned]) -> Placements {
        let version = self.version();
        let mut extents: Vec<(Extent, NodeId, Epoch, Option<ReservationId>)> = Vec::new();
        for p in planned {
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
        let updates = extents
            .iter()
            .map(|&(extent, holder, epoch, reservation)| Update::Place {
                extent,
                holder,
                epoch,
                version,
                reservation,
                replica: 0,
            })
            .collect();
        Placements { extents, updates }
    }

    /// The placements refused in `outcomes`, proposed again from free capacity (a lapsed
    /// reservation): their indexes and updates. A reservation that paid for a refused
    /// placement is given up (the releases come back too): the group and this node would
    /// otherwise disagree on what is left of it.
    pub(crate) fn replace_refused(
        &mut self,
        placements: &Placements,
        outcomes: &[Outcome],
    ) -> (Vec<usize>, Vec<Update>, Vec<Update>) {
        let retry: Vec<usize> = outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| !o.is_accepted())
            .map(|(i, _)| i)
            .collect();
        let releases =
            self.forget_reservations(retry.iter().filter_map(|&i| placements.extents[i].3));
        let updates = retry
            .iter()
            .map(|&i| {
                let (extent, holder, epoch, _) = placements.extents[i];
                Update::Place {
                    extent,
                    holder,
                    epoch,
                    version: self.version(),
                    reservation: None,
                    replica: 0,
                }
            })
            .collect();
        (retry, updates, releases)
    }

    /// Records where `planned`'s pages now are; returns the copies a re-spill left on
    /// another holder, to delete.
    pub(crate) fn placed(&mut self, client: u32, planned: &[Planned]) -> Deletes {
        let mut stale = Deletes::new();
        for p in planned {
            let held = Held {
                holder: p.holder,
                checksum: p.checksum,
            };
            if let Some(old) = self.pages.insert((client, p.client_page), held)
                && old.holder != p.holder
            {
                stale.entry(old.holder).or_default().push(p.remote);
            }
        }
        stale
    }

    /// Where this node recorded `pages` of `client` when it spilled them (`None`: ask
    /// the directory).
    pub(crate) fn known_holders(&self, client: u32, pages: &[PageId]) -> Vec<Option<Held>> {
        pages
            .iter()
            .map(|p| self.pages.get(&(client, *p)).copied())
            .collect()
    }

    /// The `Get` requests of a fetch of `pages` held as `held`: per holder, at most
    /// [`PAGES_PER_REQUEST`] pages and [`REQUEST_BYTES_MAX`] bytes each. A page nobody
    /// holds fails the fetch.
    pub(crate) fn get_requests(
        &self,
        client: u32,
        pages: &[PageId],
        held: &[Option<Held>],
    ) -> Result<Vec<GetRequest>, RemoteError> {
        let mut by_peer: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
        for (i, h) in held.iter().enumerate() {
            let Some(h) = h else {
                return Err(RemoteError::NotFound {
                    client,
                    page: pages[i],
                });
            };
            by_peer.entry(h.holder).or_default().push(i);
        }
        let per_request = self.pages_per_request();
        let mut out = Vec::new();
        for (peer, idx) in by_peer {
            for chunk in idx.chunks(per_request) {
                let ids = chunk
                    .iter()
                    .map(|&i| remote_page_id(self.node, client, pages[i]))
                    .collect();
                out.push((peer, chunk.to_vec(), ids));
            }
        }
        Ok(out)
    }

    /// The reply to one `Get` request: its pages into `out` (each checked against the
    /// checksum recorded at spill), counted; the first error, if any.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn got(
        &mut self,
        client: u32,
        pages: &[PageId],
        held: &[Option<Held>],
        request: &GetRequest,
        result: Result<Response, NetError>,
        out: &mut [Option<Bytes>],
    ) -> Option<RemoteError> {
        let (peer, chunk, _) = request;
        let peer = *peer;
        let got = match result {
            Ok(Response::Get { pages: got, .. }) => got,
            other => {
                self.per_peer.entry(peer).or_default().errors += 1;
                return Some(match other {
                    Ok(Response::Error(e)) => RemoteError::PeerRefused {
                        peer,
                        reason: e.message,
                    },
                    Ok(o) => RemoteError::PeerRefused {
                        peer,
                        reason: format!("answered a get with {:?}", o.kind()),
                    },
                    Err(e) => RemoteError::PeerUnreachable {
                        peer,
                        reason: e.to_string(),
                    },
                });
            }
        };
        let by_id: HashMap<PageId, Page> = got.into_iter().map(|p| (p.id, p)).collect();
        let (mut bytes, mut n, mut first_error) = (0u64, 0u64, None);
        for &i in chunk {
            let id = remote_page_id(self.node, client, pages[i]);
            let Some(p) = by_id.get(&id) else {
                first_error.get_or_insert(RemoteError::NotFound {
                    client,
                    page: pages[i],
                });
                continue;
            };
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
        let c = self.per_peer.entry(peer).or_default();
        c.bytes_fetched += bytes;
        c.pages_fetched += n;
        first_error
    }

    /// What a discard of `pages` (sorted, deduplicated) held as `held` takes: one
    /// `Remove` per extent, and the copies to delete per holder.
    pub(crate) fn removals(
        &self,
        client: u32,
        pages: &[PageId],
        held: &[Option<Held>],
    ) -> (Vec<Update>, Deletes) {
        let mut by_peer = Deletes::new();
        let mut removes: Vec<Update> = Vec::new();
        let mut current: Option<Extent> = None;
        for (p, h) in pages.iter().zip(held) {
            let Some(h) = h else { continue };
            let remote = remote_page_id(self.node, client, *p);
            by_peer.entry(h.holder).or_default().push(remote);
            match &mut current {
                Some(e) if e.buffer == remote.buffer && e.end_page() == u64::from(remote.index) => {
                    e.page_count += 1
                }
                _ => {
                    if let Some(e) = current.replace(Extent::new(remote.buffer, remote.index, 1)) {
                        removes.push(Update::Remove { extent: e });
                    }
                }
            }
        }
        if let Some(e) = current {
            removes.push(Update::Remove { extent: e });
        }
        (removes, by_peer)
    }

    /// Forgets the record of `pages` of `client` (their directory entries are gone).
    pub(crate) fn forget(&mut self, client: u32, pages: &[PageId]) {
        for p in pages {
            self.pages.remove(&(client, *p));
        }
    }

    /// Queues deletes on `peer` that did not land, up to [`PENDING_DELETES_MAX`] over all
    /// peers (past it a copy stays on its peer, logged).
    pub(crate) fn queue_deletes(&mut self, peer: NodeId, ids: Vec<PageId>) {
        self.per_peer.entry(peer).or_default().errors += 1;
        let set = self.pending_deletes.entry(peer).or_default();
        for id in ids {
            if self.pending_deletes_len >= PENDING_DELETES_MAX {
                self.pending_deletes_dropped += 1;
                if self.pending_deletes_dropped.is_power_of_two() {
                    tracing::warn!(
                        %peer,
                        dropped = self.pending_deletes_dropped,
                        "too many deletes pending; a page copy stays on its peer"
                    );
                }
                continue;
            }
            if set.insert(id) {
                self.pending_deletes_len += 1;
            }
        }
    }

    /// The deletes waiting, per peer.
    pub(crate) fn pending_deletes(&self) -> Vec<(NodeId, Vec<PageId>)> {
        self.pending_deletes
            .iter()
            .map(|(p, ids)| (*p, ids.iter().copied().collect()))
            .collect()
    }

    /// How many deletes wait.
    pub(crate) fn pending_deletes_len(&self) -> usize {
        self.pending_deletes_len
    }

    /// Deletes of `ids` on `peer` landed.
    pub(crate) fn deletes_landed(&mut self, peer: NodeId, ids: &[PageId]) {
        if let Some(set) = self.pending_deletes.get_mut(&peer) {
            for id in ids {
                if set.remove(id) {
                    self.pending_deletes_len -= 1;
                }
            }
            if set.is_empty() {
                self.pending_deletes.remove(&peer);
            }
        }
    }

    /// Bytes this node's clients may keep on `pool` now: the up and reachable peers'
    /// free capacity plus what this node holds reserved there and has not spent.
    pub(crate) fn capacity_bytes(&self, pool: &[Candidate], now_ms: u64) -> u64 {
        pool.iter()
            .filter(|m| m.id != self.node && m.state == MemberState::Up && m.reachable)
            .map(|m| m.free_bytes + self.ledger.unspent_on(m.id, now_ms))
            .sum()
    }

    fn version(&mut self) -> u64 {
        self.next_version += 1;
        self.next_version - 1
    }

    fn pages_per_request(&self) -> usize {
        (REQUEST_BYTES_MAX / self.page_bytes.max(1)).clamp(1, PAGES_PER_REQUEST as u64) as usize
    }
}

/// Reservation ids: the node id above this bit, the start clock (ms) below it.
const RESERVATION_NODE_SHIFT: u32 = 52;
/// Placement versions: the start clock (ms) above this bit, a counter below it (1,024
/// placements per ms of start time before two incarnations could share a version).
const VERSION_SHIFT: u32 = 10;

/// Whether the remote buffer id `buffer` belongs to `node` (see `remote_page_id`).
pub(crate) fn buffer_of_node(buffer: BufferId, node: NodeId) -> bool {
    buffer.0 >> NODE_SHIFT == node.0
}

/// Cuts `pages` into requests of at most [`PAGES_PER_REQUEST`] pages and
/// [`REQUEST_BYTES_MAX`] bytes.
pub(crate) fn batches(pages: Vec<Page>, page_bytes: u64) -> Vec<Vec<Page>> {
    let per = (REQUEST_BYTES_MAX / page_bytes.max(1)).clamp(1, PAGES_PER_REQUEST as u64) as usize;
    let mut out = Vec::new();
    let mut it = pages.into_iter().peekable();
    while it.peek().is_some() {
        out.push(it.by_ref().take(per).collect());
    }
    out
}

#[cfg(test)]
mod tests;
