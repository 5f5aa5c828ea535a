//! The seam between the local socket server and the remote tier: [`ClientPages`], what
//! the server asks of the tier, with the tier's typed errors; its implementation by the
//! node's [`RemoteService`], and its in-memory twin [`MemClientPages`] (tests).

use std::future::Future;
use std::sync::Mutex;

use bytes::Bytes;
use spillway_types::PageId;
use spillway_types::local::OpErrorCode;

use crate::remote::{CLIENT_BUFFER_BITS, RemoteError, RemoteService};

/// Where a node's local clients' pages go when they leave the clients' host tiers: the
/// remote tier. The server calls it from its tasks, many calls at once.
///
/// Contract: `spill` stores the pages under `(client, page)`, replacing what was there;
/// `fetch` returns the bytes last spilled for each page, in the order asked, or an
/// error naming a page it does not hold; `discard` forgets pages and ignores those it
/// does not hold. Clients are independent namespaces. Errors are the remote tier's
/// ([`RemoteError`]); the client is told their text.
pub trait ClientPages: Send + Sync + 'static {
    /// Stores `pages` of `client`.
    fn spill(
        &self,
        client: u32,
        pages: Vec<(PageId, Bytes)>,
    ) -> impl Future<Output = Result<(), RemoteError>> + Send;
    /// The bytes of `pages` of `client`, in order.
    fn fetch(
        &self,
        client: u32,
        pages: Vec<PageId>,
    ) -> impl Future<Output = Result<Vec<Bytes>, RemoteError>> + Send;
    /// Forgets `pages` of `client`.
    fn discard(
        &self,
        client: u32,
        pages: Vec<PageId>,
    ) -> impl Future<Output = Result<(), RemoteError>> + Send;
    /// Bytes of pages the clients may keep in the tier (told to each client at `Welcome`).
    fn capacity_bytes(&self) -> u64;
    /// A first guess of the tier's bandwidth per direction, told to each client. The
    /// default is what QUIC reaches on loopback on a small machine (1.2 GB/s).
    fn bandwidth_hint_bytes_per_s(&self) -> u64 {
        1_200_000_000
    }
}

/// How a client is told that a fetch failed: [`OpErrorCode::PageLost`] when no copy of
/// the page could be had (none recorded, every holder unreachable or refusing after the
/// tier's failover and grace, or the bytes not the ones spilled), so the client loses
/// that page's buffer and nothing else; [`OpErrorCode::Remote`] for the rest. Exhaustive:
/// a new [`RemoteError`] variant must be placed here.
pub(crate) fn fetch_error_code(e: &RemoteError) -> OpErrorCode {
    match e {
        RemoteError::NotFound { .. }
        | RemoteError::Corrupt { .. }
        | RemoteError::PeerUnreachable { .. }
        | RemoteError::PeerRefused { .. } => OpErrorCode::PageLost,
        RemoteError::NoRoom { .. }
        | RemoteError::ShortOfPeers { .. }
        | RemoteError::ReservationRefused { .. }
        | RemoteError::PlacementRefused { .. }
        | RemoteError::Meta(_)
        | RemoteError::Invalid { .. } => OpErrorCode::Remote,
    }
}

/// Checks that `page` fits [`RemoteService`]'s key scheme (buffer ids below 2^40).
fn check_remote_key(client: u32, page: PageId) -> Result<(), RemoteError> {
    if page.buffer.0 >> CLIENT_BUFFER_BITS != 0 {
        Err(RemoteError::Invalid {
            client,
            page,
            reason: format!("buffer ids of local clients must be below 2^{CLIENT_BUFFER_BITS}"),
        })
    } else {
        Ok(())
    }
}

impl ClientPages for RemoteService {
    async fn spill(&self, client: u32, pages: Vec<(PageId, Bytes)>) -> Result<(), RemoteError> {
        for (page, _) in &pages {
            check_remote_key(client, *page)?;
        }
        RemoteService::spill(self, client, pages).await
    }

    async fn fetch(&self, client: u32, pages: Vec<PageId>) -> Result<Vec<Bytes>, RemoteError> {
        for page in &pages {
            check_remote_key(client, *page)?;
        }
        RemoteService::fetch(self, client, pages).await
    }

    async fn discard(&self, client: u32, pages: Vec<PageId>) -> Result<(), RemoteError> {
        // Pages outside the key scheme were never stored: nothing to forget.
        let pages = pages
            .into_iter()
            .filter(|p| check_remote_key(client, *p).is_ok())
            .collect();
        RemoteService::discard(self, client, pages).await
    }

    fn capacity_bytes(&self) -> u64 {
        RemoteService::capacity_bytes(self)
    }
}

/// A [`ClientPages`] in this process's memory: the backend of tests.
#[derive(Debug)]
pub struct MemClientPages {
    capacity_bytes: u64,
    pages: Mutex<std::collections::HashMap<(u32, PageId), Bytes>>,
}

impl MemClientPages {
    /// A tier holding at most `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> MemClientPages {
        MemClientPages {
            capacity_bytes,
            pages: Mutex::new(Default::default()),
        }
    }

    /// Pages of `client` held now.
    pub fn pages_of(&self, client: u32) -> usize {
        let pages = self.pages.lock().expect("mem pages lock");
        pages.keys().filter(|(c, _)| *c == client).count()
    }

    /// The bytes held for `page` of `client`.
    pub fn get(&self, client: u32, page: PageId) -> Option<Bytes> {
        let pages = self.pages.lock().expect("mem pages lock");
        pages.get(&(client, page)).cloned()
    }
}

impl ClientPages for MemClientPages {
    async fn spill(&self, client: u32, pages: Vec<(PageId, Bytes)>) -> Result<(), RemoteError> {
        let mut held = self.pages.lock().expect("mem pages lock");
        let used: u64 = held.values().map(|b| b.len() as u64).sum();
        let replaced: u64 = pages
            .iter()
            .filter_map(|(p, _)| held.get(&(client, *p)))
            .map(|b| b.len() as u64)
            .sum();
        let adding: u64 = pages.iter().map(|(_, b)| b.len() as u64).sum();
        if used - replaced + adding > self.capacity_bytes {
            return Err(RemoteError::NoRoom {
                requested_bytes: adding,
                free_bytes: self.capacity_bytes - (used - replaced),
            });
        }
        for (page, data) in pages {
            held.insert((client, page), data);
        }
        Ok(())
    }

    async fn fetch(&self, client: u32, pages: Vec<PageId>) -> Result<Vec<Bytes>, RemoteError> {
        let held = self.pages.lock().expect("mem pages lock");
        pages
            .into_iter()
            .map(|p| {
                held.get(&(client, p))
                    .cloned()
                    .ok_or(RemoteError::NotFound { client, page: p })
            })
            .collect()
    }

    async fn discard(&self, client: u32, pages: Vec<PageId>) -> Result<(), RemoteError> {
        let mut held = self.pages.lock().expect("mem pages lock");
        for p in pages {
            held.remove(&(client, p));
        }
        Ok(())
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_types::BufferId;

    #[test]
    fn pages_outside_the_remote_key_scheme_are_refused() {
        let page = |buffer| PageId {
            buffer: BufferId(buffer),
            index: 3,
        };
        assert!(check_remote_key(1, page((1 << CLIENT_BUFFER_BITS) - 1)).is_ok());
        let err = check_remote_key(1, page(1 << CLIENT_BUFFER_BITS)).unwrap_err();
        assert!(
            matches!(err, RemoteError::Invalid { client: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("2^40"), "{err}");
    }

    #[test]
    fn a_fetch_with_no_copy_left_is_page_lost_and_other_failures_are_remote() {
        let page = PageId {
            buffer: BufferId(2),
            index: 1,
        };
        let lost = [
            RemoteError::NotFound { client: 1, page },
            RemoteError::Corrupt {
                client: 1,
                page,
                peer: spillway_types::NodeId(3),
            },
            RemoteError::PeerUnreachable {
                peer: spillway_types::NodeId(3),
                reason: "timed out".into(),
            },
        ];
        for e in &lost {
            assert_eq!(fetch_error_code(e), OpErrorCode::PageLost, "{e}");
        }
        let other = RemoteError::Invalid {
            client: 1,
            page,
            reason: "too big".into(),
        };
        assert_eq!(fetch_error_code(&other), OpErrorCode::Remote);
    }

    #[tokio::test]
    async fn the_memory_twin_refuses_past_its_capacity_and_names_missing_pages() {
        let twin = MemClientPages::new(10);
        let page = PageId {
            buffer: BufferId(1),
            index: 0,
        };
        twin.spill(1, vec![(page, Bytes::from_static(b"12345678"))])
            .await
            .unwrap();
        let err = twin
            .spill(
                1,
                vec![(PageId { index: 1, ..page }, Bytes::from_static(b"123"))],
            )
            .await
            .unwrap_err();
        assert!(matches!(
            err,
            RemoteError::NoRoom {
                requested_bytes: 3,
                free_bytes: 2
            }
        ));
        assert!(matches!(
            twin.fetch(2, vec![page]).await,
            Err(RemoteError::NotFound { client: 2, .. })
        ));
    }
}
