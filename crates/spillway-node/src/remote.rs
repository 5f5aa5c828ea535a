//! The remote tier as this node's local clients see it: [`RemoteService`] stores their
//! pages on peers, fetches them back and discards them.
//!
//! Key namespace on peers: a local client's buffer `b` is stored under
//! `BufferId(client << 40 | b)` ([`peer_page_id`]), so the buffers of different clients of
//! one node never collide on a peer, and peers key their stores by origin node as well.
//! A client's buffers are numbered from 1 and below 2^40.
//!
//! This first version keeps the pages in this node's memory; the peer path replaces it.

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use spillway_types::{BufferId, NodeId, PageId};

/// Bits of a peer-side [`BufferId`] that carry the client's own buffer number.
pub const CLIENT_BUFFER_BITS: u32 = 40;

/// The page id a peer stores page `page` of local client `client` under.
pub fn peer_page_id(client: u32, page: PageId) -> PageId {
    debug_assert!(page.buffer.0 < 1 << CLIENT_BUFFER_BITS);
    PageId {
        buffer: BufferId(u64::from(client) << CLIENT_BUFFER_BITS | page.buffer.0),
        index: page.index,
    }
}

/// Why a remote-tier operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// No peer has room for the pages.
    #[error("no peer has room for {requested_bytes} bytes ({free_bytes} free in the pool)")]
    NoRoom {
        /// Bytes asked for.
        requested_bytes: u64,
        /// Bytes free on peers.
        free_bytes: u64,
    },
    /// A page is not held by the remote tier.
    #[error("page {page} of client {client} is not in the remote tier")]
    NotFound {
        /// The client.
        client: u32,
        /// The page.
        page: PageId,
    },
    /// The peer could not be reached.
    #[error("peer {peer} unreachable: {reason}")]
    PeerUnreachable {
        /// The peer.
        peer: NodeId,
        /// Why.
        reason: String,
    },
}

/// Counters of the remote tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteCounters {
    /// Bytes sent to peers.
    pub bytes_out: u64,
    /// Bytes fetched from peers.
    pub bytes_in: u64,
    /// Pages spilled.
    pub pages_spilled: u64,
    /// Pages fetched.
    pub pages_fetched: u64,
    /// Failed operations.
    pub errors: u64,
}

/// The remote tier of this node's clients (see the module docs).
#[derive(Debug, Default)]
pub struct RemoteService {
    pages: Mutex<HashMap<PageId, Bytes>>,
    counters: Mutex<RemoteCounters>,
    capacity_bytes: u64,
}

impl RemoteService {
    /// A remote tier of `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> RemoteService {
        RemoteService {
            capacity_bytes,
            ..RemoteService::default()
        }
    }

    /// Stores pages of local client `client` on peers.
    pub async fn spill(&self, client: u32, pages: Vec<(PageId, Bytes)>) -> Result<(), RemoteError> {
        let mut map = self.pages.lock().expect("remote lock");
        let mut c = self.counters.lock().expect("remote lock");
        for (id, data) in pages {
            c.bytes_out += data.len() as u64;
            c.pages_spilled += 1;
            map.insert(peer_page_id(client, id), data);
        }
        Ok(())
    }

    /// The pages' bytes back, in the order asked.
    pub async fn fetch(&self, client: u32, pages: Vec<PageId>) -> Result<Vec<Bytes>, RemoteError> {
        let map = self.pages.lock().expect("remote lock");
        let mut c = self.counters.lock().expect("remote lock");
        let mut out = Vec::with_capacity(pages.len());
        for page in pages {
            let data = map
                .get(&peer_page_id(client, page))
                .ok_or(RemoteError::NotFound { client, page })?;
            c.bytes_in += data.len() as u64;
            c.pages_fetched += 1;
            out.push(data.clone());
        }
        Ok(out)
    }

    /// Drops the pages; unknown pages are ignored.
    pub async fn discard(&self, client: u32, pages: Vec<PageId>) -> Result<(), RemoteError> {
        let mut map = self.pages.lock().expect("remote lock");
        for page in pages {
            map.remove(&peer_page_id(client, page));
        }
        Ok(())
    }

    /// Bytes this node's clients may keep on peers now.
    pub fn capacity_bytes(&self) -> u64 {
        let used: u64 = self
            .pages
            .lock()
            .expect("remote lock")
            .values()
            .map(|b| b.len() as u64)
            .sum();
        self.capacity_bytes.saturating_sub(used)
    }

    /// Counters.
    pub fn counters(&self) -> RemoteCounters {
        self.counters.lock().expect("remote lock").clone()
    }
}
