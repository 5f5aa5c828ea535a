//! The host tier: pages kept in this node's RAM for itself and for its peers, within a byte
//! budget.
//!
//! Parts: [`HostStore`] (the pages, their checksums, the budget) and its [`Handler`]
//! implementation, which serves it to peers (put / get / delete) and turns
//! [`StoreError`]s into error replies of the matching [`ErrorCode`].
//!
//! Invariants:
//! - `bytes_used` is the sum of the stored pages' lengths and is taken from the store's
//!   [`HostBudget`] (its own in a node; [`HostStore::sharing`] lets others hold part of
//!   it): what it holds never exceeds `budget_bytes`; a put that would exceed it fails
//!   whole ([`StoreError::Full`]) and changes nothing, so no page already held is lost
//!   or half-replaced.
//! - every page is kept with the checksum it arrived with (computed where the page was
//!   written, checked by the transport on arrival) and is checked again on every read: a
//!   page corrupted in this node's memory is reported ([`StoreError::Corrupt`]), never
//!   served.
//!
//! A received page's bytes are a slice of its frame's payload buffer. A page that
//! arrived alone is its whole buffer and is kept as it is; the pages of a frame that
//! carries several are copied out into buffers of their own, so that the frame's buffer
//! is freed at once and deleting a page frees its bytes: what the budget counts is what
//! the node holds (before, one page left of a frame of 8 kept all 8 pages' bytes).
//!
//! Pages are keyed by their origin (the node that put them, as the transport
//! authenticated it) and their [`PageId`]: two nodes storing pages of the same id never
//! overwrite each other, and a peer can only read or delete pages it put itself.
//!
//! Lock order: one mutex over the map and the byte count, never held across an await.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use spillway_net::{Handler, Page, Request, Response};
use spillway_types::wire::{ErrorCode, ErrorReply};
use spillway_types::{NodeId, PageId, PageSize};

use crate::memory::HostBudget;

/// Why a store operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The pages do not fit in the budget; nothing was stored.
    #[error(
        "host tier full: {requested_bytes} more bytes requested, {used_bytes} of {budget_bytes} used"
    )]
    Full {
        /// Bytes the put would add (net of the pages it replaces).
        requested_bytes: u64,
        /// Bytes of the budget held before the put (the pages, and whatever else shares
        /// the budget).
        used_bytes: u64,
        /// The budget ([`crate::NodeConfig::host_tier_bytes`]).
        budget_bytes: u64,
    },
    /// A page is larger than the node's page size; nothing was stored.
    #[error("page {page} has {page_bytes} bytes, more than the page size of {page_size_bytes}")]
    PageTooLarge {
        /// The page.
        page: PageId,
        /// Its length.
        page_bytes: u64,
        /// The node's page size.
        page_size_bytes: u64,
    },
    /// A stored page no longer matches its checksum (memory corruption); it was not served.
    #[error("page {page} does not match its checksum {checksum:#018x}")]
    Corrupt {
        /// The page.
        page: PageId,
        /// The checksum stored with it.
        checksum: u64,
    },
}

impl StoreError {
    /// The wire code a peer sees for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            StoreError::Full { .. } => ErrorCode::NoCapacity,
            StoreError::PageTooLarge { .. } => ErrorCode::BadRequest,
            StoreError::Corrupt { .. } => ErrorCode::Internal,
        }
    }
}

/// A snapshot of the store's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreCounters {
    /// Pages held.
    pub pages: u64,
    /// Bytes held.
    pub used_bytes: u64,
    /// The budget.
    pub budget_bytes: u64,
    /// Pages stored by puts (each overwrite counts).
    pub pages_put: u64,
    /// Pages served by gets.
    pub pages_got: u64,
    /// Gets of pages not held.
    pub pages_missing: u64,
    /// Puts refused because the budget was reached.
    pub puts_refused_full: u64,
    /// Reads that found a page not matching its checksum.
    pub checksum_failures: u64,
}

/// A stored page's key: the node that put it and its id.
type Key = (NodeId, PageId);

#[derive(Debug, Default)]
struct Pages {
    map: HashMap<Key, Page>,
    used_bytes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    pages_put: AtomicU64,
    pages_got: AtomicU64,
    pages_missing: AtomicU64,
    puts_refused_full: AtomicU64,
    checksum_failures: AtomicU64,
}

/// The host tier's pages, bounded by a byte budget (see the module docs).
#[derive(Debug)]
pub struct HostStore {
    pages: Mutex<Pages>,
    budget: Arc<HostBudget>,
    budget_bytes: u64,
    page_size: PageSize,
    counters: Counters,
}

impl HostStore {
    /// An empty store of at most `budget_bytes` of pages of at most `page_size`.
    pub fn new(budget_bytes: u64, page_size: PageSize) -> HostStore {
        HostStore::sharing(Arc::new(HostBudget::new(budget_bytes)), page_size)
    }

    /// An empty store whose pages take their bytes from `budget`, which others may share.
    pub fn sharing(budget: Arc<HostBudget>, page_size: PageSize) -> HostStore {
        HostStore {
            pages: Mutex::new(Pages::default()),
            budget_bytes: budget.budget_bytes(),
            budget,
            page_size,
            counters: Counters::default(),
        }
    }

    /// The host budget the pages take their bytes from.
    pub fn budget(&self) -> &Arc<HostBudget> {
        &self.budget
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pages> {
        self.pages.lock().expect("host store lock poisoned")
    }

    /// Stores `pages` of node `origin` (replacing its pages of the same ids), all or none;
    /// returns how many.
    pub fn put(&self, origin: NodeId, new: Vec<Page>) -> Result<u32, StoreError> {
        let page_size_bytes = self.page_size.bytes();
        if let Some(p) = new.iter().find(|p| p.data.len() as u64 > page_size_bytes) {
            return Err(StoreError::PageTooLarge {
                page: p.id,
                page_bytes: p.data.len() as u64,
                page_size_bytes,
            });
        }
        for p in &new {
            debug_assert!(p.verify(), "page {} stored with a stale checksum", p.id);
        }
        #[cfg(feature = "failpoints")]
        if let Some(dropped) = dropped_put(&new) {
            return Ok(dropped);
        }
        let mut pages = self.lock();
        // Net growth: a page replacing one of the same id frees the old one's bytes. A
        // batch naming one id twice keeps the last; count each id once, at its last size.
        let mut last: HashMap<Key, u64> = HashMap::with_capacity(new.len());
        for p in &new {
            last.insert((origin, p.id), p.data.len() as u64);
        }
        let added: u64 = last.values().sum();
        let freed: u64 = last
            .keys()
            .filter_map(|id| pages.map.get(id))
            .map(|p| p.data.len() as u64)
            .sum();
        let after = pages.used_bytes - freed + added;
        // Taken under the map's lock, so the store's count and its share of the budget
        // move together.
        if after > pages.used_bytes {
            if let Err(used_bytes) = self.budget.try_take(after - pages.used_bytes) {
                self.counters
                    .puts_refused_full
                    .fetch_add(1, Ordering::Relaxed);
                return Err(StoreError::Full {
                    requested_bytes: added.saturating_sub(freed),
                    used_bytes,
                    budget_bytes: self.budget_bytes,
                });
            }
        } else {
            self.budget.give_back(pages.used_bytes - after);
        }
        let stored = new.len() as u32;
        let own_buffers = new.len() > 1;
        for mut p in new {
            if own_buffers {
                p.data = bytes::Bytes::copy_from_slice(&p.data);
            }
            pages.map.insert((origin, p.id), p);
        }
        pages.used_bytes = after;
        debug_assert_eq!(
            pages.used_bytes,
            pages.map.values().map(|p| p.data.len() as u64).sum::<u64>()
        );
        self.counters
            .pages_put
            .fetch_add(u64::from(stored), Ordering::Relaxed);
        Ok(stored)
    }

    /// The pages of `origin` held of `wanted` (each checked against its checksum), and the
    /// ids not held. A page that fails its check fails the whole get (and stays, for
    /// inspection).
    pub fn get(
        &self,
        origin: NodeId,
        wanted: &[PageId],
    ) -> Result<(Vec<Page>, Vec<PageId>), StoreError> {
        let mut found = Vec::new();
        let mut missing = Vec::new();
        {
            let pages = self.lock();
            for id in wanted {
                match pages.map.get(&(origin, *id)) {
                    Some(p) => found.push(p.clone()),
                    None => missing.push(*id),
                }
            }
        }
        // Hash outside the lock: the clones share the bytes.
        if let Some(bad) = found.iter().find(|p| !p.verify()) {
            self.counters
                .checksum_failures
                .fetch_add(1, Ordering::Relaxed);
            tracing::error!(page = %bad.id, "host tier page does not match its checksum");
            return Err(StoreError::Corrupt {
                page: bad.id,
                checksum: bad.checksum,
            });
        }
        self.counters
            .pages_got
            .fetch_add(found.len() as u64, Ordering::Relaxed);
        self.counters
            .pages_missing
            .fetch_add(missing.len() as u64, Ordering::Relaxed);
        Ok((found, missing))
    }

    /// Drops the pages `gone` of `origin`; returns (deleted, not held).
    pub fn delete(&self, origin: NodeId, gone: &[PageId]) -> (u32, u32) {
        let mut pages = self.lock();
        let mut deleted = 0u32;
        for id in gone {
            if let Some(p) = pages.map.remove(&(origin, *id)) {
                pages.used_bytes -= p.data.len() as u64;
                self.budget.give_back(p.data.len() as u64);
                deleted += 1;
            }
        }
        (deleted, gone.len() as u32 - deleted)
    }

    /// Counters and occupancy now.
    pub fn counters(&self) -> StoreCounters {
        let (pages, used_bytes) = {
            let p = self.lock();
            (p.map.len() as u64, p.used_bytes)
        };
        let c = &self.counters;
        StoreCounters {
            pages,
            used_bytes,
            budget_bytes: self.budget_bytes,
            pages_put: c.pages_put.load(Ordering::Relaxed),
            pages_got: c.pages_got.load(Ordering::Relaxed),
            pages_missing: c.pages_missing.load(Ordering::Relaxed),
            puts_refused_full: c.puts_refused_full.load(Ordering::Relaxed),
            checksum_failures: c.checksum_failures.load(Ordering::Relaxed),
        }
    }

    /// Bytes held for `origin` (a scan: for status pages and tests, not hot paths).
    pub fn used_bytes_of(&self, origin: NodeId) -> u64 {
        self.lock()
            .map
            .iter()
            .filter(|((o, _), _)| *o == origin)
            .map(|(_, p)| p.data.len() as u64)
            .sum()
    }

    #[cfg(test)]
    fn corrupt(&self, origin: NodeId, id: PageId) {
        let mut pages = self.lock();
        let p = pages.map.get_mut(&(origin, id)).expect("page held");
        let mut data = p.data.to_vec();
        data[0] ^= 0xff;
        p.data = data.into();
    }
}

/// The failpoint `spillway-node::store::put` (feature `failpoints`), a deliberately
/// broken build: configured with `return(K)`, a put whose first page has index K is
/// acknowledged and not stored (the acknowledgement's effect dropped). `spillway chaos
/// sim` must find it (`tests/chaos_broken.rs`).
#[cfg(feature = "failpoints")]
fn dropped_put(new: &[Page]) -> Option<u32> {
    fail::fail_point!("spillway-node::store::put", |index: Option<String>| {
        let index: Option<u32> = index.and_then(|i| i.parse().ok());
        new.first()
            .filter(|p| index.is_none_or(|i| p.id.index == i))
            .map(|_| new.len() as u32)
    });
    None
}

fn error_reply(e: &StoreError) -> Response {
    Response::Error(ErrorReply::new(e.code(), e.to_string()))
}

impl HostStore {
    /// Serves a page request of `peer` (the part of the node's peer handler that the host
    /// tier answers); Raft requests are not the store's and get a `BadRequest`.
    pub fn handle_pages(&self, peer: NodeId, request: Request) -> Response {
        match request {
            Request::Put { pages } => match self.put(peer, pages) {
                Ok(pages_stored) => Response::Put { pages_stored },
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "put refused");
                    error_reply(&e)
                }
            },
            Request::Get { pages } => match self.get(peer, &pages) {
                Ok((pages, missing)) => Response::Get { pages, missing },
                Err(e) => error_reply(&e),
            },
            Request::Delete { pages } => {
                let (pages_deleted, pages_missing) = self.delete(peer, &pages);
                Response::Delete {
                    pages_deleted,
                    pages_missing,
                }
            }
            Request::Raft { .. } | Request::Propose { .. } | Request::UcxConnect { .. } => {
                Response::Error(ErrorReply::new(
                    ErrorCode::BadRequest,
                    "the host tier serves pages only",
                ))
            }
        }
    }
}

impl Handler for HostStore {
    async fn handle(&self, peer: NodeId, request: Request) -> Response {
        self.handle_pages(peer, request)
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use spillway_types::BufferId;

    use super::*;

    const PAGE: u64 = 64 << 10;
    /// The origin of the pages in most tests.
    const O: NodeId = NodeId(2);

    fn id(buffer: u64, index: u32) -> PageId {
        PageId {
            buffer: BufferId(buffer),
            index,
        }
    }

    fn page(buffer: u64, index: u32, len: usize) -> Page {
        let data: Vec<u8> = (0..len)
            .map(|i| (i as u64 * 31 + buffer + u64::from(index)) as u8)
            .collect();
        Page::new(id(buffer, index), Bytes::from(data))
    }

    fn store(pages: u64) -> HostStore {
        HostStore::new(pages * PAGE, PageSize::new(PAGE).unwrap())
    }

    #[test]
    fn put_get_delete_keep_the_byte_count() {
        let s = store(4);
        assert_eq!(
            s.put(O, vec![page(1, 0, PAGE as usize), page(1, 1, 100)])
                .unwrap(),
            2
        );
        assert_eq!(s.counters().used_bytes, PAGE + 100);
        let (got, missing) = s.get(O, &[id(1, 1), id(2, 0), id(1, 0)]).unwrap();
        assert_eq!(got, vec![page(1, 1, 100), page(1, 0, PAGE as usize)]);
        assert_eq!(missing, vec![id(2, 0)]);
        assert_eq!(s.delete(O, &[id(1, 0), id(3, 3)]), (1, 1));
        let c = s.counters();
        assert_eq!((c.pages, c.used_bytes), (1, 100));
        assert_eq!((c.pages_put, c.pages_got, c.pages_missing), (2, 2, 1));
    }

    #[test]
    fn a_put_over_budget_fails_whole_with_the_numbers() {
        let s = store(2);
        s.put(O, vec![page(1, 0, PAGE as usize)]).unwrap();
        let err = s
            .put(O, vec![page(1, 1, PAGE as usize), page(1, 2, 10)])
            .unwrap_err();
        assert_eq!(
            err,
            StoreError::Full {
                requested_bytes: PAGE + 10,
                used_bytes: PAGE,
                budget_bytes: 2 * PAGE,
            }
        );
        assert_eq!(err.code(), ErrorCode::NoCapacity);
        // Nothing of the refused put was stored; what was held is intact.
        let c = s.counters();
        assert_eq!((c.pages, c.used_bytes, c.puts_refused_full), (1, PAGE, 1));
        assert_eq!(
            s.get(O, &[id(1, 0)]).unwrap().0,
            vec![page(1, 0, PAGE as usize)]
        );
    }

    #[test]
    fn an_overwrite_counts_only_the_growth() {
        let s = store(2);
        s.put(
            O,
            vec![page(1, 0, PAGE as usize), page(1, 1, PAGE as usize)],
        )
        .unwrap();
        // Full, but replacing a page with one of the same size or smaller fits.
        s.put(O, vec![page(1, 0, 10)]).unwrap();
        assert_eq!(s.counters().used_bytes, PAGE + 10);
        // The same id twice in one batch counts once, at its last size.
        s.put(O, vec![page(1, 0, PAGE as usize), page(1, 0, 20)])
            .unwrap();
        assert_eq!(s.counters().used_bytes, PAGE + 20);
        assert_eq!(s.get(O, &[id(1, 0)]).unwrap().0[0].data.len(), 20);
    }

    #[test]
    fn pages_share_the_host_budget_with_what_clients_hold() {
        let budget = Arc::new(HostBudget::new(4 * PAGE));
        let s = HostStore::sharing(budget.clone(), PageSize::new(PAGE).unwrap());
        // A local client's host tier holds 3 pages of the budget.
        budget.try_take(3 * PAGE).unwrap();
        s.put(O, vec![page(1, 0, PAGE as usize)]).unwrap();
        assert_eq!(budget.used_bytes(), 4 * PAGE);
        let err = s.put(O, vec![page(1, 1, 10)]).unwrap_err();
        assert_eq!(
            err,
            StoreError::Full {
                requested_bytes: 10,
                used_bytes: 4 * PAGE,
                budget_bytes: 4 * PAGE,
            }
        );
        // Shrinking and deleting give the bytes back.
        s.put(O, vec![page(1, 0, 100)]).unwrap();
        assert_eq!(budget.used_bytes(), 3 * PAGE + 100);
        s.delete(O, &[id(1, 0)]);
        assert_eq!(budget.used_bytes(), 3 * PAGE);
        budget.give_back(3 * PAGE);
        s.put(
            O,
            vec![page(1, 0, PAGE as usize), page(1, 1, PAGE as usize)],
        )
        .unwrap();
        assert_eq!(budget.used_bytes(), 2 * PAGE);
    }

    #[test]
    fn pages_of_one_frame_are_kept_in_buffers_of_their_own() {
        let s = store(4);
        // Two pages sliced from one buffer, as a frame of two arrives.
        let frame = Bytes::from(vec![7u8; 2 * PAGE as usize]);
        let pages = vec![
            Page::new(id(1, 0), frame.slice(..PAGE as usize)),
            Page::new(id(1, 1), frame.slice(PAGE as usize..)),
        ];
        s.put(O, pages).unwrap();
        let held = s.get(O, &[id(1, 0), id(1, 1)]).unwrap().0;
        let frame_range = frame.as_ptr_range();
        for p in &held {
            assert!(
                !frame_range.contains(&p.data.as_ptr()),
                "page {} still points into the frame's buffer",
                p.id
            );
            assert_eq!(p.data.len() as u64, PAGE);
        }
        // A page that came alone is kept as it came (it is its whole buffer).
        let alone = Bytes::from(vec![9u8; PAGE as usize]);
        s.put(O, vec![Page::new(id(2, 0), alone.clone())]).unwrap();
        assert_eq!(
            s.get(O, &[id(2, 0)]).unwrap().0[0].data.as_ptr(),
            alone.as_ptr()
        );
    }

    #[test]
    fn a_page_larger_than_the_page_size_is_refused() {
        let s = store(4);
        let err = s.put(O, vec![page(1, 0, PAGE as usize + 1)]).unwrap_err();
        assert!(matches!(err, StoreError::PageTooLarge { .. }), "{err}");
        assert_eq!(s.counters().pages, 0);
    }

    #[test]
    fn a_corrupted_page_is_reported_not_served() {
        let s = store(4);
        s.put(O, vec![page(1, 0, 4096), page(1, 1, 4096)]).unwrap();
        s.corrupt(O, id(1, 1));
        let err = s.get(O, &[id(1, 0), id(1, 1)]).unwrap_err();
        assert!(
            matches!(err, StoreError::Corrupt { page, .. } if page == id(1, 1)),
            "{err}"
        );
        assert_eq!(s.counters().checksum_failures, 1);
        // The good page is still served alone.
        assert_eq!(s.get(O, &[id(1, 0)]).unwrap().0.len(), 1);
    }

    #[test]
    fn pages_of_different_origins_never_collide() {
        let s = store(4);
        let (a, b) = (NodeId(2), NodeId(3));
        s.put(a, vec![page(1, 0, 100)]).unwrap();
        s.put(b, vec![page(1, 0, 200)]).unwrap();
        assert_eq!(s.counters().pages, 2);
        assert_eq!(s.get(a, &[id(1, 0)]).unwrap().0[0].data.len(), 100);
        assert_eq!(s.get(b, &[id(1, 0)]).unwrap().0[0].data.len(), 200);
        assert_eq!((s.used_bytes_of(a), s.used_bytes_of(b)), (100, 200));
        // One origin cannot delete the other's page.
        assert_eq!(s.delete(NodeId(4), &[id(1, 0)]), (0, 1));
        assert_eq!(s.delete(a, &[id(1, 0)]), (1, 0));
        assert_eq!(s.get(b, &[id(1, 0)]).unwrap().0.len(), 1);
        assert_eq!(s.counters().used_bytes, 200);
    }

    #[tokio::test]
    async fn the_handler_answers_errors_with_their_code() {
        let s = store(1);
        let peer = NodeId(2);
        let put = Request::Put {
            pages: vec![page(1, 0, PAGE as usize), page(1, 1, 1)],
        };
        match s.handle(peer, put).await {
            Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::NoCapacity);
                assert!(
                    e.message.contains(&format!("of {PAGE} used")),
                    "{}",
                    e.message
                );
            }
            other => panic!("{other:?}"),
        }
        let put = Request::Put {
            pages: vec![page(1, 0, 10)],
        };
        assert_eq!(s.handle(peer, put).await, Response::Put { pages_stored: 1 });
        let del = Request::Delete {
            pages: vec![id(1, 0), id(1, 1)],
        };
        assert_eq!(
            s.handle(peer, del).await,
            Response::Delete {
                pages_deleted: 1,
                pages_missing: 1
            }
        );
    }
}
