//! Fetch routing with fail-over, without IO: each page is read from its nearest live
//! holder; a page whose holder fails (unreachable, refusing, missing the page, or
//! answering with bytes that do not match the checksum recorded at spill) moves to its
//! next holder in the next round of the same fetch. A fetch ends when every page came
//! back, or fails with the last error of a page whose holders are all tried.
//!
//! Nearest first: live holders (member up, same incarnation as when the copy was made,
//! connection not in backoff) before the others; in this node's zone before other
//! zones; then slot order. A copy whose holder restarted since (another epoch) is never
//! asked: the holder lost it with its memory, and would refuse to serve it anyway.
//! A holder declared down but of the same epoch (paused, partitioned) is tried last.
//!
//! A holder that did not answer (unreachable, timed out) is asked once more after the
//! page's other holders all failed: a copy whose holder was cut off for a moment while
//! the other holder died is still read (found by `spillway chaos sim` with clients
//! running the real core, which loses a buffer on a failed fetch).
//!
//! Bounds: at most [`FETCH_ROUNDS_MAX`] rounds per fetch (each page moves on by one
//! holder per round, every holder asked at most twice).

use bytes::Bytes;
use spillway_meta::MemberState;
use spillway_net::{NetError, Page, Response};
use spillway_types::{NodeId, PageId};

use super::{Candidate, Held, Placement, failed_reply};
use crate::tier::{RemoteError, remote_page_id};

/// Rounds a fetch takes at most: every holder of a page asked once, and those that did
/// not answer once more.
pub(crate) const FETCH_ROUNDS_MAX: usize = 2 * super::SLOTS;

/// One `Get` request of a fetch.
#[derive(Clone, Debug)]
pub(crate) struct GetRequest {
    /// The holder asked.
    pub(crate) peer: NodeId,
    /// The indexes of its pages in the fetch.
    pub(crate) idx: Vec<usize>,
    /// Their remote ids.
    pub(crate) ids: Vec<PageId>,
    /// Whether some page in it has no other holder left: only then is a holder that
    /// stops answering waited for (the node's peer grace); otherwise the fetch fails over
    /// at once.
    pub(crate) last_chance: bool,
}

/// One fetch in progress (from [`Placement::start_fetch`]).
#[derive(Debug)]
pub(crate) struct Fetch {
    client: u32,
    pages: Vec<PageId>,
    checksums: Vec<u64>,
    /// Per page: its holders to try, nearest first.
    order: Vec<Vec<NodeId>>,
    /// Per page: the index in `order` of the holder to ask next.
    next: Vec<usize>,
    out: Vec<Option<Bytes>>,
    errors: Vec<Option<RemoteError>>,
    /// Per page: holders that did not answer, to ask once more at the end; `None` once
    /// they were put back in `order`.
    unanswered: Vec<Option<Vec<NodeId>>>,
    /// Per page: how many holders `order` had before any was put back.
    first_pass: Vec<usize>,
}

impl Fetch {
    /// The pages' bytes in the order asked, or the last error of the first page that
    /// no holder served.
    pub(crate) fn finish(self) -> Result<Vec<Bytes>, RemoteError> {
        // The client's completion path: every page read, not yet handed back.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-node::fetch::complete");
        let mut errors = self.errors;
        let mut out = Vec::with_capacity(self.out.len());
        for (i, b) in self.out.into_iter().enumerate() {
            match b {
                Some(b) => out.push(b),
                None => {
                    return Err(errors[i].take().unwrap_or(RemoteError::NotFound {
                        client: self.client,
                        page: self.pages[i],
                    }));
                }
            }
        }
        Ok(out)
    }

    /// Each page's bytes, `None` for the pages no holder served (a repair keeps what it
    /// could read).
    pub(crate) fn finish_partial(self) -> Vec<Option<Bytes>> {
        self.out
    }

    /// The holders page `i` will be asked for, nearest first (for tests and logs).
    #[cfg(test)]
    pub(crate) fn order(&self, i: usize) -> &[NodeId] {
        &self.order[i]
    }
}

/// The rank of a holder in a fetch's order: lower first.
fn rank(pool: &[Candidate], my_zone: Option<&str>, holder: NodeId, slot: u8) -> (u8, u8, u8) {
    let c = pool.iter().find(|c| c.id == holder);
    let live = c.is_some_and(|c| c.state != MemberState::Down && c.reachable);
    let near = match (my_zone, c.and_then(|c| c.zone.as_deref())) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    };
    (u8::from(!live), u8::from(!near), slot)
}

impl Placement {
    /// Starts a fetch of `pages` of `client` held as `held`, reading each from its
    /// nearest holder in `pool` first (see the module docs). A page no holder has a copy
    /// of fails it at once ([`RemoteError::NotFound`]).
    pub(crate) fn start_fetch(
        &self,
        client: u32,
        pages: Vec<PageId>,
        held: &[Option<Held>],
        pool: &[Candidate],
        my_zone: Option<&str>,
    ) -> Result<Fetch, RemoteError> {
        let mut order = Vec::with_capacity(pages.len());
        let mut checksums = Vec::with_capacity(pages.len());
        for (i, h) in held.iter().enumerate() {
            let not_found = RemoteError::NotFound {
                client,
                page: pages[i],
            };
            let Some(h) = h else {
                return Err(not_found);
            };
            let mut holders: Vec<(u8, NodeId, (u8, u8, u8))> = h
                .copies()
                // A copy of another incarnation is gone with its holder's memory.
                .filter(|(_, r)| {
                    pool.iter()
                        .find(|c| c.id == r.holder)
                        .is_none_or(|c| c.epoch == r.epoch)
                })
                .map(|(s, r)| (s, r.holder, rank(pool, my_zone, r.holder, s)))
                .collect();
            if holders.is_empty() && h.checksum != 0 {
                // No live copy: a copy fenced by its holder's new epoch is still read when
                // that holder is up, its checksum deciding. A holder declared down while
                // only cut off (not restarted) kept the bytes; one that restarted answers
                // that it has nothing. Found by `spillway chaos sim`: a partition then a
                // crash left a page's only bytes on a fenced holder, unreadable.
                holders = h
                    .copies()
                    .filter(|(_, r)| {
                        pool.iter()
                            .any(|c| c.id == r.holder && c.state == MemberState::Up)
                    })
                    .map(|(s, r)| (s, r.holder, rank(pool, my_zone, r.holder, s)))
                    .collect();
            }
            if holders.is_empty() {
                return Err(not_found);
            }
            holders.sort_by_key(|(_, _, rank)| *rank);
            order.push(holders.into_iter().map(|(_, n, _)| n).collect());
            checksums.push(h.checksum);
        }
        let n = pages.len();
        Ok(Fetch {
            client,
            pages,
            checksums,
            next: vec![0; n],
            out: vec![None; n],
            errors: (0..n).map(|_| None).collect(),
            unanswered: vec![Some(Vec::new()); n],
            first_pass: order.iter().map(Vec::len).collect(),
            order,
        })
    }

    /// The next round's `Get` requests: every page not yet served, to its next holder;
    /// per holder, at most `PAGES_PER_REQUEST` pages and `REQUEST_BYTES_MAX` bytes each.
    /// Empty: the fetch is over ([`Fetch::finish`]).
    pub(crate) fn get_requests(&self, fetch: &Fetch) -> Vec<GetRequest> {
        let mut by_peer: std::collections::BTreeMap<NodeId, Vec<usize>> = Default::default();
        for i in 0..fetch.pages.len() {
            if fetch.out[i].is_some() {
                continue;
            }
            if let Some(peer) = fetch.order[i].get(fetch.next[i]) {
                by_peer.entry(*peer).or_default().push(i);
            }
        }
        let per_request = self.pages_per_request();
        let mut out = Vec::new();
        for (peer, idx) in by_peer {
            for chunk in idx.chunks(per_request) {
                let ids = chunk
                    .iter()
                    .map(|&i| remote_page_id(self.node, fetch.client, fetch.pages[i]))
                    .collect();
                // A holder asked again (it did not answer the first time) is waited for
                // too: every other holder failed already.
                let last_chance = chunk.iter().any(|&i| {
                    fetch.next[i] + 1 >= fetch.order[i].len()
                        || fetch.next[i] >= fetch.first_pass[i]
                });
                out.push(GetRequest {
                    peer,
                    idx: chunk.to_vec(),
                    ids,
                    last_chance,
                });
            }
        }
        out
    }

    /// The reply to one `Get` request of `fetch`: its pages into the fetch (each checked
    /// against the checksum recorded at spill), counted; a page that failed moves on to
    /// its next holder, with its error kept.
    pub(crate) fn got(
        &mut self,
        fetch: &mut Fetch,
        request: &GetRequest,
        result: Result<Response, NetError>,
    ) {
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-node::fetch::reply");
        let peer = request.peer;
        let client = fetch.client;
        let failed = |fetch: &mut Fetch, i: usize, e: RemoteError| {
            let silent = matches!(e, RemoteError::PeerUnreachable { .. });
            fetch.errors[i] = Some(e);
            fetch.next[i] += 1;
            if silent && let Some(again) = &mut fetch.unanswered[i] {
                again.push(peer);
            }
            // Every holder tried: those that did not answer are asked once more.
            if fetch.next[i] >= fetch.order[i].len()
                && let Some(again) = fetch.unanswered[i].take()
            {
                fetch.order[i].extend(again);
            }
        };
        let got = match result {
            Ok(Response::Get { pages: got, .. }) => got,
            other => {
                self.per_peer.entry(peer).or_default().errors += 1;
                for &i in &request.idx {
                    failed(fetch, i, failed_reply(peer, "get", &other));
                }
                return;
            }
        };
        let by_id: std::collections::HashMap<PageId, Page> =
            got.into_iter().map(|p| (p.id, p)).collect();
        let (mut bytes, mut n) = (0u64, 0u64);
        for &i in &request.idx {
            let page = fetch.pages[i];
            let id = remote_page_id(self.node, client, page);
            let Some(p) = by_id.get(&id) else {
                failed(fetch, i, RemoteError::NotFound { client, page });
                continue;
            };
            let expected = fetch.checksums[i];
            // The transport checked the bytes against `p.checksum` on arrival.
            if expected != 0 && p.checksum != expected {
                failed(fetch, i, RemoteError::Corrupt { client, page, peer });
                continue;
            }
            if fetch.next[i] > 0 {
                self.fetch_failovers += 1;
            }
            bytes += p.data.len() as u64;
            n += 1;
            fetch.out[i] = Some(p.data.clone());
        }
        let c = self.per_peer.entry(peer).or_default();
        c.bytes_fetched += bytes;
        c.pages_fetched += n;
    }
}
