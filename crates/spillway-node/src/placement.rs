//! The remote tier's brain without IO: where spilled pages go (and their replicas), which
//! reservations pay for them, how they are cut into requests, where a fetch reads and
//! where it fails over, which copies must be deleted, and which pages a dead holder left
//! under-replicated. [`Placement`] never awaits, never touches a socket, a lock or the
//! clock: the driver (`remote::RemoteService`) hands it what it observed (the pool's
//! members, which peers are reachable, the outcomes of proposals, the replies of peers)
//! and `now`, and gets back what to do (proposals to make, requests to send, copies to
//! delete). Its unit tests run it without a pool.
//!
//! Replicas: every page is spilled to `replicas` holders (node config), one per directory
//! replica slot, on distinct nodes and, when every candidate carries a zone label, on
//! distinct zones where the pool has enough of them (a preference: with fewer zones than
//! replicas, distinct nodes are still required). With fewer eligible peers than replicas a
//! spill keeps what exists (the missing copies are counted as under-replicated and
//! repaired when a peer comes); with none it fails. Each run's slots are chosen in turn,
//! each by the most *weighted* room (room times [`ramp_permille`]): a member that came up
//! recently has its room discounted by how long it has been up (1/16 at first, full
//! after [`RAMP_MS`]), so a node restarted empty takes new pages only once the others'
//! room falls below its discounted room: it is filled to at most `others' room / weight`
//! at any time, gradually, instead of taking every new page at once.
//!
//! Method groups, in the order a driver calls them:
//! - spill: [`Placement::spill_items`] -> [`Placement::plan`] (holders for runs of pages
//!   and slots; reservations to make and to release, as one proposal) -> propose ->
//!   [`Placement::reserved`] (the outcomes into the ledger; the reservations spent copy
//!   by copy) -> [`Placement::put_batches`] -> send, each reply to
//!   [`Placement::put_done`] -> [`Placement::after_moves`] (done, plan the unreachable
//!   peers' copies again ([`Placement::replan_items`]), or fail; [`Placement::refund`]
//!   what the replanned or abandoned copies spent; [`SpillRounds`] keeps these rounds'
//!   copies for both drivers) -> [`Placement::placements`] ->
//!   propose -> [`Placement::placed`] (the copies a re-spill left elsewhere, to delete);
//! - fetch (`placement::fetch`): [`Placement::known_holders`] (the directory fills the
//!   gaps) -> [`Placement::start_fetch`] -> rounds of [`Placement::get_requests`] -> send,
//!   each reply to [`Placement::got`] (a page that failed moves to its next holder) ->
//!   [`Fetch::finish`];
//! - repair (`placement::repair`): [`Placement::repair_jobs`] (pages with a dead or
//!   missing copy, and the pool-wide count) -> read them like a fetch -> plan, reserve,
//!   move and place as a spill into the dead slots -> [`Placement::repaired`];
//! - discard: [`Placement::removals`] -> propose -> [`Placement::forget`] -> delete;
//! - a restarted node (`placement::incarnation`): [`incarnation_updates`] -> propose ->
//!   [`earlier_extents`] -> [`EarlierPages::of`] -> propose the removals -> delete;
//! - deletes that did not land: [`Placement::queue_deletes`], retried from
//!   [`Placement::pending_deletes`], cleared by [`Placement::deletes_landed`].

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use spillway_meta::{Epoch, Extent, MemberState, MetaState, ReservationId, Update};
use spillway_net::{NetError, Page, Response};
use spillway_types::{BufferId, NodeId, PageId};

use crate::ledger::{Ledger, Spent};
use crate::meta::Outcome;
use crate::tier::{
    MOVE_RETRIES, NODE_SHIFT, PAGES_PER_REQUEST, PENDING_DELETES_MAX, PeerRemoteCounters,
    REQUEST_BYTES_MAX, RESERVATION_TTL, RemoteError, remote_page_id,
};

mod fetch;
mod incarnation;
mod plan;
mod repair;
mod spill;

pub(crate) use fetch::{FETCH_ROUNDS_MAX, Fetch};
pub(crate) use incarnation::{EarlierPages, earlier_extents, incarnation_updates};
pub(crate) use repair::{RepairJob, UnderReplicated};
pub(crate) use spill::{SpillRounds, SpillStep, checksummed};

/// Replica slots of a page: `crate::config::REPLICAS_MAX`, the directory's slots.
pub(crate) const SLOTS: usize = crate::config::REPLICAS_MAX as usize;

/// A reservation is no longer spent this long before it lapses: 30 s.
const RESERVATION_MARGIN: Duration = Duration::from_secs(30);

/// How long a member that came up takes to reach its full placement weight: 60 s. Over
/// it the weight grows linearly from [`RAMP_FLOOR_PERMILLE`]; a node restarted empty then
/// takes new pages gradually instead of every new page at once.
pub(crate) const RAMP_MS: u64 = 60_000;
/// Placement weight of a member that has just come up: 1/16 (62 per mille).
pub(crate) const RAMP_FLOOR_PERMILLE: u64 = 62;

/// The placement weight, per mille, of a member up since `up_since_ms` at `now_ms`:
/// [`RAMP_FLOOR_PERMILLE`] when it just came up, growing linearly to 1000 at [`RAMP_MS`].
pub(crate) fn ramp_permille(up_since_ms: u64, now_ms: u64) -> u64 {
    let up_for = now_ms.saturating_sub(up_since_ms);
    if up_for >= RAMP_MS {
        return 1000;
    }
    RAMP_FLOOR_PERMILLE + (1000 - RAMP_FLOOR_PERMILLE) * up_for / RAMP_MS
}

/// One copy of a page: its holder and the holder's incarnation when it took the copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Replica {
    /// The peer holding it.
    pub(crate) holder: NodeId,
    /// The peer's epoch then (a copy outlives no restart of its holder).
    pub(crate) epoch: Epoch,
}

/// Where a spilled page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Held {
    /// Its copies, by replica slot.
    pub(crate) replicas: [Option<Replica>; SLOTS],
    /// Its checksum as spilled; 0 when only the directory knew the holders (then the
    /// transport's check is trusted).
    pub(crate) checksum: u64,
}

impl Held {
    /// Its copies with their slots, in slot order.
    pub(crate) fn copies(&self) -> impl Iterator<Item = (u8, Replica)> + '_ {
        self.replicas
            .iter()
            .enumerate()
            .filter_map(|(s, r)| r.map(|r| (s as u8, r)))
    }

    /// Whether `node` holds a copy.
    pub(crate) fn held_on(&self, node: NodeId) -> bool {
        self.copies().any(|(_, r)| r.holder == node)
    }

    /// The copies of remote page `id` that the replicated directory names, if any. The
    /// checksum is not known there: 0, "trust the transport's check".
    pub(crate) fn in_directory(state: &MetaState, id: PageId) -> Option<Held> {
        let copies = state.holders_of(id);
        if copies.is_empty() {
            return None;
        }
        let mut held = Held {
            replicas: [None; SLOTS],
            checksum: 0,
        };
        for (slot, _, holder) in copies {
            held.replicas[slot as usize] = Some(Replica {
                holder: holder.node,
                epoch: holder.epoch,
            });
        }
        Some(held)
    }
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

/// A page to place and the replica slots to fill: all of them for a new spill, the
/// failed ones after a round of puts, the dead ones for a repair.
#[derive(Clone, Debug)]
pub(crate) struct ToPlace {
    /// The page.
    pub(crate) page: SpillPage,
    /// Slots to fill, one bit each (bit r: slot r).
    pub(crate) slots: u8,
    /// The copies it keeps (new copies go to other nodes, and other zones when labelled).
    pub(crate) keep: [Option<Replica>; SLOTS],
}

/// One peer as the planner sees it, from the metadata view and the connection cache.
#[derive(Clone, Debug)]
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
    /// Its failure domain, if labelled.
    pub(crate) zone: Option<Arc<str>>,
    /// Group clock (ms) when it last came up (its placement weight ramps from there).
    pub(crate) up_since_ms: u64,
}

impl Candidate {
    /// Whether a copy `r` on it is still there: it is the same incarnation and not
    /// declared down.
    pub(crate) fn keeps(&self, r: &Replica) -> bool {
        self.id == r.holder && self.epoch == r.epoch && self.state != MemberState::Down
    }
}

/// Whether copy `r` is live in `pool` (its holder is a member, not down, same epoch).
pub(crate) fn is_live(pool: &[Candidate], r: &Replica) -> bool {
    pool.iter().any(|c| c.keeps(r))
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
    items: Vec<ToPlace>,
    /// (item, slot, holder) per copy, in item order.
    assigned: Vec<(usize, u8, NodeId)>,
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

    /// The holders chosen for each page, in page order and slot order within a page.
    #[cfg(test)]
    pub(crate) fn holders(&self) -> Vec<Vec<NodeId>> {
        let mut out = vec![Vec::new(); self.items.len()];
        let mut sorted = self.assigned.clone();
        sorted.sort_by_key(|(i, s, _)| (*i, *s));
        for (i, _, h) in sorted {
            out[i].push(h);
        }
        out
    }

    /// The reservations it asks for.
    #[cfg(test)]
    pub(crate) fn reserves(&self) -> &[Reserve] {
        &self.reserves
    }
}

/// One copy's place in a settled plan.
#[derive(Clone, Debug)]
pub(crate) struct Planned {
    pub(crate) client_page: PageId,
    pub(crate) remote: PageId,
    pub(crate) data: Bytes,
    pub(crate) checksum: u64,
    pub(crate) holder: NodeId,
    pub(crate) epoch: Epoch,
    /// The replica slot this copy fills.
    pub(crate) slot: u8,
    pub(crate) reservation: Option<Spent>,
}

/// What to do after a round of puts ([`Placement::after_moves`]).
#[derive(Debug)]
pub(crate) enum MoveVerdict {
    /// Every copy landed.
    Done,
    /// These peers were unreachable: plan their copies again without them.
    Replan(Vec<NodeId>),
    /// Give up with this error.
    Fail(RemoteError),
}

/// One `Place` of a placement proposal, with what a refusal needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlaceRecord {
    pub(crate) extent: Extent,
    pub(crate) holder: NodeId,
    pub(crate) epoch: Epoch,
    pub(crate) reservation: Option<ReservationId>,
    pub(crate) slot: u8,
}

impl PlaceRecord {
    fn update(&self, version: u64, reservation: Option<ReservationId>) -> Update {
        Update::Place {
            extent: self.extent,
            holder: self.holder,
            epoch: self.epoch,
            version,
            reservation,
            replica: self.slot,
        }
    }
}

/// A placement proposal: a `Remove` per extent of pages spilled before (their earlier
/// copies' records, from every slot), then one `Place` per extent and slot, with what a
/// refusal needs.
#[derive(Debug)]
pub(crate) struct Placements {
    /// One record per `Place`, in order.
    pub(crate) extents: Vec<PlaceRecord>,
    /// How many `Remove`s lead `updates`.
    pub(crate) removes: usize,
    /// The updates: the removes, then the places.
    pub(crate) updates: Vec<Update>,
}

impl Placements {
    /// The first placement of `retry` (indexes into `extents`) that `outcomes`, of their
    /// second proposal, refused again: the error the spill or repair ends with.
    pub(crate) fn refused_again(
        &self,
        retry: &[usize],
        outcomes: &[Outcome],
    ) -> Result<(), RemoteError> {
        for (k, o) in outcomes.iter().enumerate() {
            if let Outcome::Rejected { reason } = o {
                let r = self.extents[retry[k]];
                return Err(RemoteError::PlacementRefused {
                    peer: r.holder,
                    extent: r.extent,
                    reason: reason.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Page copies to delete, per peer.
pub(crate) type Deletes = BTreeMap<NodeId, Vec<PageId>>;

/// Buffers with a copy on each holder, per client: see [`Placement::buffers_by_holder`].
pub(crate) type HolderBuffers = BTreeMap<u32, BTreeMap<NodeId, BTreeSet<BufferId>>>;

/// Most (client, holder, buffer) entries `/placements` lists: 65,536, about 1.3 MiB of
/// JSON at 20 bytes an entry (a debugging view, not a directory dump).
pub(crate) const PLACEMENTS_LISTED_MAX: usize = 1 << 16;

/// The remote tier's decisions and the state they need (see the module docs).
#[derive(Debug)]
pub(crate) struct Placement {
    node: NodeId,
    page_bytes: u64,
    reserve_chunk_bytes: u64,
    /// Holders wanted per page (the node's `replicas`).
    replicas: u8,
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
    /// Pages read from a further holder after the nearest failed.
    pub(crate) fetch_failovers: u64,
    /// Copies spills could not place for want of distinct peers.
    pub(crate) short_copies: u64,
    /// Whether a short spill has been logged since the last full one.
    short_logged: bool,
    /// The last repair scan's count.
    pub(crate) under_replicated: UnderReplicated,
    /// Bytes copied to new holders by repairs.
    pub(crate) repaired_bytes: u64,
    /// Pages copied to new holders by repairs.
    pub(crate) repaired_pages: u64,
    /// Repair batches that failed.
    pub(crate) repair_errors: u64,
    /// Whether a repair scan is due whatever the pool (a spill came out short).
    repair_dirty: bool,
    /// The last page a repair scan handed out: the next scan starts after it, so pages
    /// that cannot be repaired now never keep the others from their turn.
    repair_cursor: Option<(u32, PageId)>,
    /// Pages a client's spill or discard is changing, with how many such operations are
    /// running: a repair scan leaves them out (see [`Placement::claim`]).
    changing: HashMap<(u32, PageId), u32>,
    /// Pages a repair batch is copying: a client's spill or discard of them waits until
    /// the batch ends (see [`Placement::claim`]).
    repairing: HashSet<(u32, PageId)>,
    next_reservation: u64,
    next_version: u64,
}

impl Placement {
    /// A brain for `node` keeping `replicas` copies of each page; reservation ids and
    /// placement versions start from `start_ms` (the clock when the node started), so a
    /// restarted node never reuses one.
    pub(crate) fn new(
        node: NodeId,
        page_bytes: u64,
        reserve_chunk_bytes: u64,
        replicas: u8,
        start_ms: u64,
    ) -> Placement {
        debug_assert!((1..=SLOTS as u8).contains(&replicas));
        Placement {
            node,
            page_bytes,
            reserve_chunk_bytes,
            replicas: replicas.clamp(1, SLOTS as u8),
            pages: HashMap::new(),
            ledger: Ledger::default(),
            pending_deletes: BTreeMap::new(),
            pending_deletes_len: 0,
            pending_deletes_dropped: 0,
            per_peer: BTreeMap::new(),
            errors: 0,
            fetch_failovers: 0,
            short_copies: 0,
            short_logged: false,
            under_replicated: UnderReplicated::default(),
            repaired_bytes: 0,
            repaired_pages: 0,
            repair_errors: 0,
            repair_dirty: false,
            repair_cursor: None,
            changing: HashMap::new(),
            repairing: HashSet::new(),
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

    /// Holders wanted per page.
    pub(crate) fn replicas(&self) -> u8 {
        self.replicas
    }

    /// The items of a new spill of `pages`: every slot up to `replicas`.
    pub(crate) fn spill_items(&self, pages: Vec<SpillPage>) -> Vec<ToPlace> {
        let slots = ((1u16 << self.replicas) - 1) as u8;
        pages
            .into_iter()
            .map(|page| ToPlace {
                page,
                slots,
                keep: [None; SLOTS],
            })
            .collect()
    }

    /// The items to plan again after a round of puts: the copies of `redo` (whose holders
    /// failed), each page keeping the copies of it in `ok` (which landed).
    pub(crate) fn replan_items(ok: &[Planned], redo: Vec<Planned>) -> Vec<ToPlace> {
        let mut items: Vec<ToPlace> = Vec::new();
        let mut index: HashMap<PageId, usize> = HashMap::new();
        for p in redo {
            let i = *index.entry(p.client_page).or_insert_with(|| {
                let mut keep = [None; SLOTS];
                for o in ok.iter().filter(|o| o.client_page == p.client_page) {
                    keep[o.slot as usize] = Some(Replica {
                        holder: o.holder,
                        epoch: o.epoch,
                    });
                }
                items.push(ToPlace {
                    page: SpillPage {
                        page: p.client_page,
                        data: p.data.clone(),
                        checksum: p.checksum,
                    },
                    slots: 0,
                    keep,
                });
                items.len() - 1
            });
            items[i].slots |= 1 << p.slot;
        }
        items
    }

    /// Settles `plan` with the outcomes of its proposal (empty if it proposed nothing):
    /// accepted reservations join the ledger, then every copy spends a page of a
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
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-node::spill::reserved");
        let spend_limit = plan.now_ms + RESERVATION_MARGIN.as_millis() as u64;
        let client = plan.client;
        let mut out = Vec::with_capacity(plan.assigned.len());
        for (i, slot, holder) in plan.assigned {
            let p = &plan.items[i].page;
            let reservation = self.ledger.spend(holder, self.page_bytes, spend_limit);
            out.push(Planned {
                client_page: p.page,
                remote: remote_page_id(self.node, client, p.page),
                data: p.data.clone(),
                checksum: p.checksum,
                holder,
                epoch: plan.epochs[&holder],
                slot,
                reservation,
            });
        }
        Ok(out)
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
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-node::spill::between-replica-writes");
        let c = self.per_peer.entry(peer).or_default();
        if let Ok(Response::Put { .. }) = result {
            c.bytes_spilled += bytes;
            c.pages_spilled += pages;
            return None;
        }
        c.errors += 1;
        Some(failed_reply(peer, "put", &result))
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

    /// The copies a failed spill may have left: every planned copy, unless an earlier
    /// spill of the same page is recorded on that holder (then it stays).
    pub(crate) fn copies_to_drop(&self, client: u32, planned: &[Planned]) -> Deletes {
        let mut by_peer = Deletes::new();
        for p in planned {
            let recorded_there = self
                .pages
                .get(&(client, p.client_page))
                .is_some_and(|h| h.held_on(p.holder));
            if !recorded_there {
                by_peer.entry(p.holder).or_default().push(p.remote);
            }
        }
        by_peer
    }

    /// The placement proposal of `planned`: one `Place` per extent (pages of one buffer,
    /// contiguous, same slot, holder and reservation), all under one fresh version. Pages
    /// this node spilled before are first removed from every slot in the same proposal (one
    /// Raft entry): their new holders may hold the earlier copy in another slot, which
    /// the directory would refuse as a duplicate holder. A repair (`spill` false) only
    /// fills slots: the live copies' records stay.
    pub(crate) fn placements(
        &mut self,
        planned: &[Planned],
        client: u32,
        spill: bool,
    ) -> Placements {
        let version = self.version();
        let mut again: Vec<PageId> = planned
            .iter()
            .filter(|p| spill && self.pages.contains_key(&(client, p.client_page)))
            .map(|p| p.remote)
            .collect();
        again.sort();
        again.dedup();
        let removes = extents_of(&again)
            .into_iter()
            .map(|extent| Update::Remove { extent });
        let mut updates: Vec<Update> = removes.collect();
        let leading = updates.len();
        let mut sorted: Vec<&Planned> = planned.iter().collect();
        sorted.sort_by_key(|p| (p.slot, p.remote));
        let mut extents: Vec<PlaceRecord> = Vec::new();
        for p in sorted {
            let reservation = p.reservation.map(|s| s.id);
            if let Some(r) = extents.last_mut()
                && r.extent.buffer == p.remote.buffer
                && r.extent.end_page() == u64::from(p.remote.index)
                && r.holder == p.holder
                && r.reservation == reservation
                && r.slot == p.slot
            {
                r.extent.page_count += 1;
                continue;
            }
            extents.push(PlaceRecord {
                extent: Extent::new(p.remote.buffer, p.remote.index, 1),
                holder: p.holder,
                epoch: p.epoch,
                reservation,
                slot: p.slot,
            });
        }
        updates.extend(extents.iter().map(|r| r.update(version, r.reservation)));
        Placements {
            extents,
            removes: leading,
            updates,
        }
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
        // The removes lead and are not refused for a reason a retry would change.
        let retry: Vec<usize> = outcomes
            .iter()
            .enumerate()
            .skip(placements.removes)
            .filter(|(_, o)| !o.is_accepted())
            .map(|(i, _)| i - placements.removes)
            .collect();
        let releases = self.forget_reservations(
            retry
                .iter()
                .filter_map(|&i| placements.extents[i].reservation),
        );
        let updates = retry
            .iter()
            .map(|&i| {
                let version = self.version();
                placements.extents[i].update(version, None)
            })
            .collect();
        (retry, updates, releases)
    }

    /// Records where `planned`'s pages now are (a spill: their copies replace every
    /// earlier copy); returns the copies a re-spill left on other holders, to delete.
    pub(crate) fn placed(&mut self, client: u32, planned: &[Planned]) -> Deletes {
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-node::spill::before-ack");
        let mut fresh: BTreeMap<PageId, (PageId, Held)> = BTreeMap::new();
        for p in planned {
            let (_, held) = fresh.entry(p.client_page).or_insert((
                p.remote,
                Held {
                    replicas: [None; SLOTS],
                    checksum: p.checksum,
                },
            ));
            held.replicas[p.slot as usize] = Some(Replica {
                holder: p.holder,
                epoch: p.epoch,
            });
        }
        let mut stale = Deletes::new();
        for (page, (remote, held)) in fresh {
            if let Some(old) = self.pages.insert((client, page), held) {
                for (_, r) in old.copies() {
                    if !held.held_on(r.holder) {
                        stale.entry(r.holder).or_default().push(remote);
                    }
                }
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

    /// What a discard of `pages` (sorted, deduplicated) held as `held` takes: one
    /// `Remove` per extent (it clears every slot), and the copies to delete per holder.
    pub(crate) fn removals(
        &self,
        client: u32,
        pages: &[PageId],
        held: &[Option<Held>],
    ) -> (Vec<Update>, Deletes) {
        let mut by_peer = Deletes::new();
        let mut gone = Vec::new();
        for (p, h) in pages.iter().zip(held) {
            let Some(h) = h else { continue };
            let remote = remote_page_id(self.node, client, *p);
            for (_, r) in h.copies() {
                by_peer.entry(r.holder).or_default().push(remote);
            }
            gone.push(remote);
        }
        let removes = extents_of(&gone)
            .into_iter()
            .map(|extent| Update::Remove { extent })
            .collect();
        (removes, by_peer)
    }

    /// Forgets the record of `pages` of `client` (their directory entries are gone).
    pub(crate) fn forget(&mut self, client: u32, pages: &[PageId]) {
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-node::discard::forget");
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

    /// Which buffers have a copy of a page on each holder, per client of this node: what
    /// a holder's death would take (`/placements`). At most
    /// [`PLACEMENTS_LISTED_MAX`] (client, holder, buffer) entries; the flag says more
    /// were left out.
    pub(crate) fn buffers_by_holder(&self) -> (HolderBuffers, bool) {
        let mut out = HolderBuffers::new();
        let mut listed = 0usize;
        let mut truncated = false;
        for ((client, page), held) in &self.pages {
            for (_, r) in held.copies() {
                let set = out.entry(*client).or_default().entry(r.holder).or_default();
                if set.contains(&page.buffer) {
                    continue;
                }
                if listed == PLACEMENTS_LISTED_MAX {
                    truncated = true;
                    continue;
                }
                set.insert(page.buffer);
                listed += 1;
            }
        }
        (out, truncated)
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

    /// Bytes of pages this node's clients may keep on `pool` now: the up and reachable
    /// peers' free capacity plus what this node holds reserved there and has not spent,
    /// divided by the copies each page takes (`replicas`, or fewer with fewer peers).
    pub(crate) fn capacity_bytes(&self, pool: &[Candidate], now_ms: u64) -> u64 {
        let up: Vec<&Candidate> = pool
            .iter()
            .filter(|m| m.id != self.node && m.state == MemberState::Up && m.reachable)
            .collect();
        let copies = (up.len() as u64).clamp(1, u64::from(self.replicas));
        let bytes: u64 = up
            .iter()
            .map(|m| m.free_bytes + self.ledger.unspent_on(m.id, now_ms))
            .sum();
        bytes / copies
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

/// The error of a peer's answer to a `request` ("put", "get") that is not the reply
/// asked for: a refusal, another reply, or no answer at all.
pub(crate) fn failed_reply(
    peer: NodeId,
    request: &str,
    result: &Result<Response, NetError>,
) -> RemoteError {
    match result {
        Ok(Response::Error(e)) => RemoteError::PeerRefused {
            peer,
            reason: e.message.clone(),
        },
        Ok(other) => RemoteError::PeerRefused {
            peer,
            reason: format!("answered a {request} with {:?}", other.kind()),
        },
        Err(e) => RemoteError::PeerUnreachable {
            peer,
            reason: e.to_string(),
        },
    }
}

/// Whether the remote buffer id `buffer` belongs to `node` (see `remote_page_id`).
pub(crate) fn buffer_of_node(buffer: BufferId, node: NodeId) -> bool {
    buffer.0 >> NODE_SHIFT == node.0
}

/// The extents (runs of contiguous pages of one buffer) of `pages`, sorted.
fn extents_of(pages: &[PageId]) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::new();
    for p in pages {
        match out.last_mut() {
            Some(e) if e.buffer == p.buffer && e.end_page() == u64::from(p.index) => {
                e.page_count += 1
            }
            _ => out.push(Extent::new(p.buffer, p.index, 1)),
        }
    }
    out
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
