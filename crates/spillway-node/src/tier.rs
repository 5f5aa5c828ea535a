//! The remote tier's vocabulary, shared by its brain (`placement`) and its driver
//! (`remote`), which both import it and which it imports neither of: how a client's page
//! is named on peers, the limits of requests and of the queues, the errors and the
//! counters. Re-exported from `remote`, where the public paths have always been.

use std::collections::BTreeMap;
use std::time::Duration;

use spillway_meta::Extent;
use spillway_types::{BufferId, NodeId, PageId};

use crate::meta::ProposeFailure;

/// Bits of a remote buffer id that carry the client's own buffer number.
pub const CLIENT_BUFFER_BITS: u32 = 40;
/// Largest buffer number of a client: 2^40 - 1.
pub const CLIENT_BUFFER_MAX: u64 = (1 << CLIENT_BUFFER_BITS) - 1;
/// Bits of a remote buffer id that carry the client id (above the buffer bits).
pub const CLIENT_ID_BITS: u32 = 12;
/// Largest client id: 4095.
pub const CLIENT_ID_MAX: u32 = (1 << CLIENT_ID_BITS) - 1;
/// Where the node id starts in a remote buffer id.
pub(crate) const NODE_SHIFT: u32 = CLIENT_BUFFER_BITS + CLIENT_ID_BITS;
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
    /// Fewer holders than the page's copies can be had now, and some up members are out
    /// of reach (unreachable, failed a put, a delete of the page pending there): the
    /// spill is not acknowledged short of copies. It can be retried; it goes through with
    /// fewer copies once the pool declares those members down.
    #[error(
        "only {copies} of {wanted} copies could be placed: members {out_of_reach:?} are up but out of reach (retry, or wait until the pool declares them down)"
    )]
    ShortOfPeers {
        /// Copies that could be had.
        copies: u8,
        /// Copies wanted.
        wanted: u8,
        /// The up members that could not be used.
        out_of_reach: Vec<NodeId>,
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
    /// Holders wanted per page (the node's `replicas`).
    pub replicas: u8,
    /// Pages read from a further holder after a nearer one failed.
    pub fetch_failovers: u64,
    /// Copies spills could not place for want of distinct peers (repaired later).
    pub short_copies: u64,
    /// This node's pages with fewer live copies than `replicas` (at the last repair scan).
    pub under_replicated_pages: u64,
    /// Their missing copies, in bytes (page size each): what re-replication has left.
    pub under_replicated_bytes: u64,
    /// This node's pages with no live copy left (lost with their holders).
    pub lost_pages: u64,
    /// Copies re-replication made.
    pub repaired_pages: u64,
    /// Bytes re-replication copied.
    pub repaired_bytes: u64,
    /// Repair batches that failed (retried later).
    pub repair_errors: u64,
    /// Per peer.
    pub per_peer: BTreeMap<NodeId, PeerRemoteCounters>,
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
}
