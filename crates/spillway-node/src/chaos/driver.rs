//! The simulation's driver of the remote tier's brain: the steps `remote::RemoteService`
//! takes for a spill, a fetch, a discard, a repair batch, the pending deletes, the
//! reservation reconciliation and a restarted node's announcement, in the same order
//! and with the same brain calls (see [`crate::placement`] for the order), over the
//! simulated pool instead of tokio and QUIC. Requests of one round go out together and
//! are waited for together, as the tokio driver's `JoinSet` does.
//!
//! Differences, on purpose: a node's view of its peers' zones is empty (no zones here),
//! and repairs are not paced by bytes per second but run in batches of
//! [`REPAIR_BATCH_PAGES`] every [`REPAIR_EVERY_MS`].

use bytes::Bytes;
use spillway_meta::{MemberState, Update};
use spillway_net::{NetError, Request, Response};
use spillway_types::{NodeId, PageId};

use super::world::{OpError, World};
use crate::placement::{
    Candidate, Deletes, EarlierPages, FETCH_ROUNDS_MAX, Fetch, Held, Placement, Planned, RepairJob,
    SpillRounds, SpillStep, ToPlace, checksummed, earlier_extents, incarnation_updates,
};
use crate::tier::{MOVE_RETRIES, RemoteError, remote_page_id};

/// A repair round copies at most 16 pages.
pub(super) const REPAIR_BATCH_PAGES: usize = 16;
/// A node looks for pages to repair every 500 ms (the node's `REPAIR_IDLE`).
pub(super) const REPAIR_EVERY_MS: u64 = 500;
/// Pending deletes are retried and reservations reconciled every 2 s (the node's
/// `PENDING_DELETES_RETRY`).
pub(super) const HOUSEKEEPING_EVERY_MS: u64 = crate::tier::PENDING_DELETES_RETRY.as_millis() as u64;
/// How long a fetch waits for the last holder of a page: the node's default peer grace
/// (30 s), cut short when the pool declares the holder down.
const PEER_GRACE_US: u64 = crate::config::PEER_GRACE_MS_DEFAULT * 1000;
/// Waits between asks of a page's last holder within the grace: 50 ms doubling to 1 s
/// (the node's `GRACE_RETRY_MIN` and `GRACE_RETRY_MAX`).
const GRACE_RETRY_MIN_US: u64 = crate::remote::GRACE_RETRY_MIN.as_micros() as u64;
const GRACE_RETRY_MAX_US: u64 = crate::remote::GRACE_RETRY_MAX.as_micros() as u64;
/// A page request's timeout (3 s, the QUIC idle timeout).
const REQUEST_US: u64 = spillway_net::config::IDLE_TIMEOUT_MS_DEFAULT * 1000;

/// One request of a round.
pub(super) struct Ask {
    pub(super) peer: NodeId,
    pub(super) request: Request,
    pub(super) timeout_us: u64,
    /// Stop waiting once the asking node sees the peer declared down.
    pub(super) until_down: bool,
}

/// The pool as `node`'s brain sees it: members from its applied state, reachability from
/// its backoffs.
pub(super) fn candidates(w: &World, node: NodeId) -> Vec<Candidate> {
    let Some(meta) = w.c.try_node(node) else {
        return Vec::new();
    };
    let s = meta.state();
    s.members()
        .map(|m| Candidate {
            id: m.id,
            state: m.state,
            epoch: m.epoch,
            free_bytes: s.free_bytes(m.id).unwrap_or(0),
            reachable: w.reachable(node, m.id),
            zone: None,
            up_since_ms: m.up_since_ms,
        })
        .collect()
}

/// Whether `node` sees `peer` declared down.
fn declared_down(w: &World, node: NodeId, peer: NodeId) -> bool {
    w.c.try_node(node).is_some_and(|m| {
        m.state()
            .member(peer)
            .is_some_and(|p| p.state == MemberState::Down)
    })
}

/// Sends every ask at once and waits for each until its answer, its timeout, or (when
/// asked) its peer declared down.
pub(super) fn request_all(
    w: &mut World,
    node: NodeId,
    generation: u64,
    asks: Vec<Ask>,
) -> Result<Vec<Result<Response, NetError>>, OpError> {
    let mut pending = Vec::with_capacity(asks.len());
    for a in asks {
        let id = w.send_request(node, generation, a.peer, a.request)?;
        let deadline = w.now_us() + a.timeout_us;
        pending.push((a.peer, id, deadline, a.until_down));
    }
    let last = pending.iter().map(|p| p.2).max().unwrap_or(0);
    let mut out: Vec<Option<Result<Response, NetError>>> = pending
        .iter()
        .map(|(peer, id, _, _)| {
            id.is_none().then(|| {
                Err(NetError::ConnectionLost {
                    peer: *peer,
                    reason: format!("{peer} failed recently; retrying after a backoff"),
                })
            })
        })
        .collect();
    let mut crashed = false;
    w.run_until(last, |w| {
        if w.alive(node, generation).is_err() {
            crashed = true;
            return true;
        }
        for (k, &(peer, id, deadline, until_down)) in pending.iter().enumerate() {
            let Some(id) = id.filter(|_| out[k].is_none()) else {
                continue;
            };
            if let Some(r) = w.take_response(node, id) {
                out[k] = Some(Ok(r));
            } else if w.now_us() >= deadline || (until_down && declared_down(w, node, peer)) {
                w.start_backoff(node, peer);
                out[k] = Some(Err(NetError::ConnectionLost {
                    peer,
                    reason: "no answer within the idle timeout".into(),
                }));
            }
        }
        out.iter().all(Option::is_some)
    });
    if crashed {
        return Err(OpError::Crashed);
    }
    Ok(out
        .into_iter()
        .zip(&pending)
        .map(|(r, (peer, ..))| {
            r.unwrap_or_else(|| {
                Err(NetError::ConnectionLost {
                    peer: *peer,
                    reason: "no answer within the idle timeout".into(),
                })
            })
        })
        .collect())
}

fn brain(w: &mut World, node: NodeId, generation: u64) -> Result<&mut Placement, OpError> {
    Ok(&mut w.node(node, generation)?.brain)
}

/// Stores `pages` of `client` on peers and records them (`RemoteService::spill`).
pub(super) fn spill(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    mut pages: Vec<(PageId, Bytes)>,
) -> Result<(), OpError> {
    pages.sort_by_key(|(id, _)| *id);
    pages.dedup_by_key(|(id, _)| *id);
    let ids: Vec<PageId> = pages.iter().map(|(id, _)| *id).collect();
    claimed(w, node, generation, client, &ids, |w| {
        spill_claimed(w, node, generation, client, pages)
    })
}

/// Runs `op` with `pages` of `client` claimed (`RemoteService::claim`): refused with
/// [`OpError::Busy`] while a repair batch holds one of them; the claim ends with `op`.
fn claimed<T>(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    pages: &[PageId],
    op: impl FnOnce(&mut World) -> Result<T, OpError>,
) -> Result<T, OpError> {
    if !brain(w, node, generation)?.claim(client, pages) {
        w.log(format!(
            "{node}'s client waits: a repair batch holds some of {pages:?}"
        ));
        return Err(OpError::Busy);
    }
    let out = op(w);
    // A crash took the claim with the brain.
    if let Ok(b) = brain(w, node, generation) {
        b.unclaim(client, pages);
    }
    out
}

fn spill_claimed(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    pages: Vec<(PageId, Bytes)>,
) -> Result<(), OpError> {
    let pages = checksummed(pages);
    let items = brain(w, node, generation)?.spill_items(pages);
    let pending = plan_and_reserve(w, node, generation, client, items, &[])?;
    let mut rounds = SpillRounds::new(pending);
    for attempt in 0..=MOVE_RETRIES {
        let failures = move_pages(w, node, generation, rounds.pending())?;
        let items = match rounds.after_round(brain(w, node, generation)?, failures, attempt) {
            SpillStep::Done => break,
            SpillStep::Fail(e) => {
                abandon(w, node, generation, client, rounds.copies())?;
                return Err(e.into());
            }
            SpillStep::Replan { items, .. } => items,
        };
        match plan_and_reserve(w, node, generation, client, items, rounds.excluded()) {
            Ok(p) => rounds.planned(p),
            Err(e) => {
                abandon(w, node, generation, client, rounds.copies())?;
                return Err(e);
            }
        }
    }
    let plan = rounds.into_copies();
    // The tokio driver's repair task runs while a spill awaits: it may come now.
    w.repair_during_spill(node, generation)?;
    if let Err(e) = place(w, node, generation, client, &plan, true) {
        drop_copies(w, node, generation, client, &plan)?;
        return Err(e);
    }
    let stale = brain(w, node, generation)?.placed(client, &plan);
    delete_all_or_queue(w, node, generation, stale)?;
    Ok(())
}

fn plan_and_reserve(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    items: Vec<ToPlace>,
    excluded: &[NodeId],
) -> Result<Vec<Planned>, OpError> {
    let pool = candidates(w, node);
    // `RemoteService::pool_now_ms`: this node's clock, or the group's when ahead.
    let group_ms = w.c.try_node(node).map_or(0, |m| m.state().clock_ms());
    let now = w.c.clock_ms(node).max(group_ms);
    let plan = brain(w, node, generation)?.plan(client, items, &pool, excluded, now)?;
    let proposal = plan.proposal();
    let outcomes = if proposal.is_empty() {
        Vec::new()
    } else {
        w.propose(node, generation, proposal)?
    };
    Ok(brain(w, node, generation)?.reserved(plan, &outcomes)?)
}

fn move_pages(
    w: &mut World,
    node: NodeId,
    generation: u64,
    plan: &[Planned],
) -> Result<Vec<(NodeId, RemoteError)>, OpError> {
    let batches = brain(w, node, generation)?.put_batches(plan);
    let sizes: Vec<(NodeId, u64, u64)> = batches
        .iter()
        .map(|(peer, b)| {
            (
                *peer,
                b.iter().map(|p| p.data.len() as u64).sum(),
                b.len() as u64,
            )
        })
        .collect();
    let asks = batches
        .into_iter()
        .map(|(peer, pages)| Ask {
            peer,
            request: Request::Put { pages },
            timeout_us: REQUEST_US,
            until_down: false,
        })
        .collect();
    let results = request_all(w, node, generation, asks)?;
    let mut failures: std::collections::BTreeMap<NodeId, RemoteError> = Default::default();
    for ((peer, bytes, n), result) in sizes.into_iter().zip(results) {
        if let Some(e) = brain(w, node, generation)?.put_done(peer, bytes, n, result) {
            failures.entry(peer).or_insert(e);
        }
    }
    Ok(failures.into_iter().collect())
}

fn abandon(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    plan: &[Planned],
) -> Result<(), OpError> {
    brain(w, node, generation)?.refund(plan);
    drop_copies(w, node, generation, client, plan)
}

fn drop_copies(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    plan: &[Planned],
) -> Result<(), OpError> {
    let copies = brain(w, node, generation)?.copies_to_drop(client, plan);
    delete_all_or_queue(w, node, generation, copies)
}

fn release(
    w: &mut World,
    node: NodeId,
    generation: u64,
    releases: Vec<Update>,
) -> Result<(), OpError> {
    if releases.is_empty() {
        return Ok(());
    }
    match w.propose(node, generation, releases) {
        Err(OpError::Crashed) => Err(OpError::Crashed),
        _ => Ok(()), // best effort: an unreleased reservation lapses
    }
}

fn place(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    plan: &[Planned],
    spill: bool,
) -> Result<(), OpError> {
    let placements = brain(w, node, generation)?.placements(plan, client, spill);
    let outcomes = match w.propose(node, generation, placements.updates.clone()) {
        Ok(o) => o,
        Err(OpError::Crashed) => return Err(OpError::Crashed),
        Err(e) => {
            let used = placements.extents.iter().filter_map(|e| e.reservation);
            let releases = brain(w, node, generation)?.forget_reservations(used);
            release(w, node, generation, releases)?;
            return Err(e);
        }
    };
    let (retry, updates, releases) =
        brain(w, node, generation)?.replace_refused(&placements, &outcomes);
    if retry.is_empty() {
        return Ok(());
    }
    release(w, node, generation, releases)?;
    let again = w.propose(node, generation, updates)?;
    Ok(placements.refused_again(&retry, &again)?)
}

/// Where `pages` of `client` are: the brain's record, else `node`'s applied directory.
fn locate(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    pages: &[PageId],
) -> Result<Vec<Option<Held>>, OpError> {
    let mut out = brain(w, node, generation)?.known_holders(client, pages);
    let Some(meta) = w.c.try_node(node) else {
        return Err(OpError::Crashed);
    };
    for (i, h) in out.iter_mut().enumerate() {
        if h.is_none() {
            *h = Held::in_directory(meta.state(), remote_page_id(node, client, pages[i]));
        }
    }
    Ok(out)
}

/// The pages' bytes back, checksums verified (`RemoteService::fetch`).
pub(super) fn fetch(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    pages: Vec<PageId>,
) -> Result<Vec<Bytes>, OpError> {
    let held = locate(w, node, generation, client, &pages)?;
    let pool = candidates(w, node);
    let mut fetch = brain(w, node, generation)?.start_fetch(client, pages, &held, &pool, None)?;
    run_fetch(w, node, generation, &mut fetch, true)?;
    Ok(fetch.finish()?)
}

fn run_fetch(
    w: &mut World,
    node: NodeId,
    generation: u64,
    fetch: &mut Fetch,
    grace: bool,
) -> Result<(), OpError> {
    for _ in 0..=FETCH_ROUNDS_MAX {
        let requests = brain(w, node, generation)?.get_requests(fetch);
        if requests.is_empty() {
            return Ok(());
        }
        // The round's requests go out together; a page's last hope is then asked again
        // and again within the peer grace, as `request_within_grace` does.
        let asks = requests
            .iter()
            .map(|r| Ask {
                peer: r.peer,
                request: Request::Get {
                    pages: r.ids.clone(),
                },
                timeout_us: REQUEST_US,
                until_down: false,
            })
            .collect();
        let mut results = request_all(w, node, generation, asks)?;
        let start = w.now_us();
        for (r, result) in requests.iter().zip(results.iter_mut()) {
            if r.last_chance && grace {
                let mut delay = GRACE_RETRY_MIN_US;
                while let Err(e) = result {
                    if !crate::remote::transient(e)
                        || declared_down(w, node, r.peer)
                        || w.now_us() + delay >= start + PEER_GRACE_US
                    {
                        break;
                    }
                    let at = w.now_us() + delay;
                    w.run_until(at, |w| w.alive(node, generation).is_err());
                    w.alive(node, generation)?;
                    delay = (delay * 2).min(GRACE_RETRY_MAX_US);
                    let ask = Ask {
                        peer: r.peer,
                        request: Request::Get {
                            pages: r.ids.clone(),
                        },
                        timeout_us: REQUEST_US,
                        until_down: true,
                    };
                    *result = request_all(w, node, generation, vec![ask])?
                        .pop()
                        .expect("one answer per ask");
                }
            }
        }
        for (r, result) in requests.iter().zip(results) {
            brain(w, node, generation)?.got(fetch, r, result);
        }
    }
    Ok(())
}

/// Drops the pages' copies and records (`RemoteService::discard`).
pub(super) fn discard(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    mut pages: Vec<PageId>,
) -> Result<(), OpError> {
    pages.sort();
    pages.dedup();
    let ids = pages.clone();
    claimed(w, node, generation, client, &ids, |w| {
        discard_claimed(w, node, generation, client, pages)
    })
}

fn discard_claimed(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    pages: Vec<PageId>,
) -> Result<(), OpError> {
    let held = locate(w, node, generation, client, &pages)?;
    let (removes, copies) = brain(w, node, generation)?.removals(client, &pages, &held);
    if removes.is_empty() {
        return Ok(());
    }
    w.propose(node, generation, removes)?;
    brain(w, node, generation)?.forget(client, &pages);
    delete_all_or_queue(w, node, generation, copies)
}

fn delete_all_or_queue(
    w: &mut World,
    node: NodeId,
    generation: u64,
    deletes: Deletes,
) -> Result<(), OpError> {
    let mut asks = Vec::new();
    let mut ids_of = Vec::new();
    for (peer, ids) in deletes {
        if !w.reachable(node, peer) {
            w.log(format!("{node} queues deletes on {peer}: {ids:?}"));
            brain(w, node, generation)?.queue_deletes(peer, ids);
            continue;
        }
        ids_of.push((peer, ids.clone()));
        asks.push(Ask {
            peer,
            request: Request::Delete { pages: ids },
            timeout_us: REQUEST_US,
            until_down: false,
        });
    }
    let results = request_all(w, node, generation, asks)?;
    for ((peer, ids), r) in ids_of.into_iter().zip(results) {
        if !matches!(r, Ok(Response::Delete { .. })) {
            w.log(format!("{node} queues deletes on {peer}: {ids:?}"));
            brain(w, node, generation)?.queue_deletes(peer, ids);
        }
    }
    Ok(())
}

/// Retries the pending deletes and forgets reservations the group no longer holds
/// (`RemoteService::retry_pending_deletes`, `reconcile_reservations`).
pub(super) fn housekeeping(w: &mut World, node: NodeId, generation: u64) -> Result<(), OpError> {
    let work = brain(w, node, generation)?.pending_deletes();
    for (peer, ids) in work {
        if !w.reachable(node, peer) {
            continue;
        }
        let asks = vec![Ask {
            peer,
            request: Request::Delete { pages: ids.clone() },
            timeout_us: REQUEST_US,
            until_down: false,
        }];
        let r = request_all(w, node, generation, asks)?.pop();
        if matches!(r, Some(Ok(Response::Delete { .. }))) {
            brain(w, node, generation)?.deletes_landed(peer, &ids);
        }
    }
    let known: Vec<_> = brain(w, node, generation)?
        .ledger()
        .remaining()
        .into_keys()
        .collect();
    if known.is_empty() {
        return Ok(());
    }
    let held: std::collections::BTreeSet<_> = {
        let Some(meta) = w.c.try_node(node) else {
            return Err(OpError::Crashed);
        };
        known
            .iter()
            .copied()
            .filter(|id| meta.state().reservation(*id).is_some())
            .collect()
    };
    brain(w, node, generation)?
        .ledger_mut()
        .drop_gone(&known, |id| held.contains(&id));
    Ok(())
}

/// A restarted node's first steps (`announce_incarnation`): down and up in one proposal
/// (a new epoch fences every copy its earlier life held), then the release of every page
/// its earlier incarnation's clients spilled. Done when both landed.
pub(super) fn announce(w: &mut World, node: NodeId, generation: u64) -> Result<bool, OpError> {
    match w.propose(node, generation, incarnation_updates(node)) {
        Ok(_) => {}
        Err(OpError::Crashed) => return Err(OpError::Crashed),
        Err(_) => return Ok(false),
    }
    let found = {
        let Some(meta) = w.c.try_node(node) else {
            return Err(OpError::Crashed);
        };
        earlier_extents(meta.state(), node)
    };
    if !found.is_empty() {
        let earlier = EarlierPages::of(&found);
        for removes in earlier.removals {
            match w.propose(node, generation, removes) {
                Ok(_) => {}
                Err(OpError::Crashed) => return Err(OpError::Crashed),
                Err(_) => return Ok(false),
            }
        }
        delete_all_or_queue(w, node, generation, earlier.deletes)?;
    }
    Ok(true)
}

/// One repair round of `node` (`RemoteService::repair_once`): pages whose copy died are
/// read from a live copy and copied into their dead slots. Returns the copies made.
pub(super) fn repair_once(w: &mut World, node: NodeId, generation: u64) -> Result<u64, OpError> {
    let pool = candidates(w, node);
    let jobs = {
        let b = brain(w, node, generation)?;
        let jobs = b.repair_jobs(&pool, REPAIR_BATCH_PAGES);
        b.hold_for_repair(&jobs);
        jobs
    };
    let out = repair_held(w, node, generation, &jobs, &pool);
    // A crash took the hold with the brain.
    if let Ok(b) = brain(w, node, generation) {
        b.end_repair(&jobs);
    }
    out
}

fn repair_held(
    w: &mut World,
    node: NodeId,
    generation: u64,
    jobs: &[RepairJob],
    pool: &[Candidate],
) -> Result<u64, OpError> {
    let mut copies = 0;
    for batch in RepairJob::by_client(jobs) {
        let client = batch[0].client;
        match repair_client(w, node, generation, client, batch, pool) {
            Ok(n) => copies += n,
            Err(OpError::Crashed) => return Err(OpError::Crashed),
            Err(e) => {
                w.log(format!(
                    "{node}'s repair of {} pages failed: {e:?}",
                    batch.len()
                ));
                brain(w, node, generation)?.repair_errors += 1;
            }
        }
    }
    Ok(copies)
}

fn repair_client(
    w: &mut World,
    node: NodeId,
    generation: u64,
    client: u32,
    jobs: &[RepairJob],
    pool: &[Candidate],
) -> Result<u64, OpError> {
    let pages: Vec<PageId> = jobs.iter().map(|j| j.page).collect();
    let held: Vec<Option<Held>> = jobs.iter().map(|j| Some(j.live)).collect();
    let mut fetch = brain(w, node, generation)?.start_fetch(client, pages, &held, pool, None)?;
    run_fetch(w, node, generation, &mut fetch, false)?;
    // The tokio driver's client operations run while a repair batch awaits: one may
    // come now, between the batch's read and its writes.
    w.client_op_during_repair(node, generation, client, jobs)?;
    let items = Placement::repair_items(jobs, fetch.finish_partial());
    if items.is_empty() {
        return Ok(0);
    }
    let planned = plan_and_reserve(w, node, generation, client, items, &[])?;
    if planned.is_empty() {
        return Ok(0);
    }
    let failures = move_pages(w, node, generation, &planned)?;
    if let Some((_, e)) = failures.into_iter().next() {
        abandon(w, node, generation, client, &planned)?;
        return Err(e.into());
    }
    if let Err(e) = place(w, node, generation, client, &planned, false) {
        drop_copies(w, node, generation, client, &planned)?;
        return Err(e);
    }
    let stale = brain(w, node, generation)?.repaired(client, &planned);
    delete_all_or_queue(w, node, generation, stale)?;
    Ok(planned.len() as u64)
}
