//! A [`Handler`] that keeps pages in memory: the server of tests and of the throughput
//! bench, and the simplest host tier a node could serve.

use std::collections::HashMap;
use std::sync::Mutex;

use spillway_types::wire::{ErrorCode, ErrorReply};
use spillway_types::{NodeId, PageId};

use crate::{Handler, Page, Request, Response};

/// Pages by id, at most `pages_max` of them (a put that would exceed it fails whole with
/// [`ErrorCode::NoCapacity`]). Stores the received pages as they are (bytes and
/// checksum): no copy, no second hash.
#[derive(Debug)]
pub struct MemStore {
    pages: Mutex<HashMap<PageId, Page>>,
    pages_max: usize,
}

impl MemStore {
    /// An empty store that holds at most `pages_max` pages.
    pub fn new(pages_max: usize) -> Self {
        MemStore {
            pages: Mutex::new(HashMap::new()),
            pages_max,
        }
    }

    /// How many pages it holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it holds no page.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `page`, if held.
    pub fn get(&self, page: PageId) -> Option<Page> {
        self.lock().get(&page).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PageId, Page>> {
        self.pages.lock().expect("store lock poisoned")
    }

    fn apply(&self, request: Request) -> Response {
        let mut pages = self.lock();
        match request {
            Request::Put { pages: new } => {
                let added = new.iter().filter(|p| !pages.contains_key(&p.id)).count();
                if pages.len() + added > self.pages_max {
                    return Response::Error(ErrorReply::new(
                        ErrorCode::NoCapacity,
                        format!(
                            "holds {} of {} pages, {added} more do not fit",
                            pages.len(),
                            self.pages_max
                        ),
                    ));
                }
                let stored = new.len() as u32;
                for p in new {
                    pages.insert(p.id, p);
                }
                Response::Put {
                    pages_stored: stored,
                }
            }
            Request::Get { pages: wanted } => {
                let mut found = Vec::new();
                let mut missing = Vec::new();
                for id in wanted {
                    match pages.get(&id) {
                        Some(p) => found.push(p.clone()),
                        None => missing.push(id),
                    }
                }
                Response::Get {
                    pages: found,
                    missing,
                }
            }
            Request::Delete { pages: gone } => {
                let total = gone.len() as u32;
                let deleted = gone.iter().filter(|id| pages.remove(id).is_some()).count() as u32;
                Response::Delete {
                    pages_deleted: deleted,
                    pages_missing: total - deleted,
                }
            }
            Request::Raft { .. } | Request::Propose { .. } | Request::UcxConnect { .. } => {
                Response::Error(ErrorReply::new(
                    ErrorCode::BadRequest,
                    "this store serves pages only, not the metadata group",
                ))
            }
        }
    }
}

impl Handler for MemStore {
    async fn handle(&self, _peer: NodeId, request: Request) -> Response {
        self.apply(request)
    }
}
