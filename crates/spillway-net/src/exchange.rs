//! One request round trip, written once and run by every transport (QUIC, UCX and the
//! simulated twin), so the twin tests the code the real transports run.
//!
//! A transport supplies only what differs between them, a [`Carrier`]: how one request
//! frame reaches the peer and how its reply frame comes back (a QUIC stream, a pair of
//! UCX tagged messages, a function call). Everything else is here, in this order:
//!
//! Client ([`round_trip`]):
//! 1. encode: the [`Request`] becomes a frame (`spillway_types::wire`), header and body
//!    first, the pages' bytes after it as payload parts (not copied);
//! 2. size budget: a frame longer than the carrier's message bound is refused before it
//!    is sent ([`NetError::TooLarge`]);
//! 3. in-flight budget: the request's payload bytes are taken from the peer's outbound
//!    budget; the permit goes to the carrier, which drops it once the request's bytes have
//!    left (QUIC: when the reply's header arrives; whole-message carriers: with the reply);
//! 4. send, through [`Carrier::carry`];
//! 5. decode with a limit: a reply that arrives as one buffer is decoded by
//!    [`decode_whole`] (`wire::decode_frame`: every length checked before anything is
//!    allocated, every checksum verified); a streaming carrier (QUIC) decodes as it reads,
//!    with the same checks, and hands over the decoded frame;
//! 6. kind check: the reply must carry the request's id and a kind that answers the
//!    request ([`Response::answers`]); otherwise the peer is broken, and the reply is
//!    treated as a bad frame: [`Carrier::reject`] closes the connection and counts it.
//!
//! Server ([`serve_whole`] for whole-message carriers, [`answer`] for all): decode with
//! the same limits (a bad frame closes the connection and is counted), take the payload
//! from the peer's inbound budget, hand the request to the [`Handler`], and encode its
//! response; a response that cannot be encoded becomes an `Internal` error reply.
//!
//! Every transport keeps its own node's side of these links in a [`Local`]: who it is (its
//! hello), its counters and in-flight budgets per peer, and whether it serves.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use spillway_types::wire::{
    self, ErrorCode, ErrorReply, Hello, Message, PROTOCOL_VERSION, WireError,
};
use spillway_types::{NodeId, PoolId};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::permits_for;
use crate::stats::PeerState;
use crate::{Handler, NetError, NetStats, QuicConfig, Request, Response};

/// A request encoded for the wire: the frame's parts (header and body, then the payload
/// chunks) and what the round trip needs to check the reply.
pub(crate) struct Outgoing {
    /// The request id in the frame header.
    pub(crate) id: u64,
    /// The frame: header and body first, then the payload chunks.
    pub(crate) parts: Vec<Bytes>,
    /// Payload bytes (what the in-flight budget counts).
    pub(crate) payload_bytes: u64,
    /// Frame bytes in all (what the byte counters and the size bound count).
    pub(crate) frame_bytes: u64,
}

/// A reply as a carrier received it.
pub(crate) enum Received {
    /// The whole frame in one buffer, not yet decoded (UCX, the simulated transport).
    Whole(Bytes),
    /// A frame the carrier decoded as it read it (QUIC), with the same checks as
    /// [`decode_whole`].
    Decoded(Decoded),
}

/// A decoded frame: its request id, its message and its payload (checksums verified).
pub(crate) struct Decoded {
    /// The request id in its header.
    pub(crate) request_id: u64,
    /// The body.
    pub(crate) message: Message,
    /// The payload, a slice of what was received.
    pub(crate) payload: Bytes,
    /// Frame bytes received (header, body and payload).
    pub(crate) wire_bytes: u64,
}

/// Why a carrier did not bring a reply back.
pub(crate) enum CarryError {
    /// The connection failed or was closed (the error names the peer and the reason).
    Lost(NetError),
    /// The reply failed the wire checks while the carrier decoded it.
    BadFrame(WireError),
}

/// What every connection's round trips share, whatever carries them: the peer, its
/// counters and in-flight budgets, the request ids, and whether the connection was closed
/// for good (a bad frame).
pub(crate) struct Link {
    /// The peer at the other end.
    pub(crate) peer: NodeId,
    /// The peer's counters and in-flight budgets (shared by all its connections).
    pub(crate) state: Arc<PeerState>,
    /// Permits of the peer's in-flight budgets (see [`permits_for`]).
    pub(crate) budget_permits: u32,
    closed: AtomicBool,
    next_request_id: AtomicU64,
}

impl Link {
    /// A fresh link to `peer`.
    pub(crate) fn new(peer: NodeId, state: Arc<PeerState>, budget_permits: u32) -> Link {
        Link {
            peer,
            state,
            budget_permits,
            closed: AtomicBool::new(false),
            next_request_id: AtomicU64::new(1),
        }
    }

    /// The error for a request on a lost or closed connection.
    pub(crate) fn lost(&self, reason: impl Into<String>) -> NetError {
        NetError::ConnectionLost {
            peer: self.peer,
            reason: reason.into(),
        }
    }

    /// Closes the connection for good: later requests fail at once.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Whether [`Link::close`] was called.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

/// This node's side of every link a transport makes: who it is, its counters and in-flight
/// budgets per peer, and whether it serves (one server per transport).
#[derive(Debug)]
pub(crate) struct Local {
    /// This node's pool.
    pub(crate) pool_id: PoolId,
    /// This node.
    pub(crate) node_id: NodeId,
    /// Counters and in-flight budgets per peer, of all the transport's connections.
    pub(crate) stats: Arc<NetStats>,
    /// Permits of each peer's in-flight budgets ([`QuicConfig::peer_permits`]).
    pub(crate) budget_permits: u32,
    serving: AtomicBool,
}

impl Local {
    /// Node `node_id` of `pool_id`, with the in-flight budget of `config`, not yet serving.
    pub(crate) fn new(pool_id: PoolId, node_id: NodeId, config: &QuicConfig) -> Local {
        let budget_permits = config.peer_permits();
        Local {
            pool_id,
            node_id,
            stats: Arc::new(NetStats::new(budget_permits)),
            budget_permits,
            serving: AtomicBool::new(false),
        }
    }

    /// The hello this node says (and answers one with).
    pub(crate) fn hello(&self) -> Hello {
        Hello {
            pool_id: self.pool_id,
            node_id: self.node_id,
            protocol_version: PROTOCOL_VERSION,
        }
    }

    /// A fresh link to `peer`, on the peer's counters and budgets.
    pub(crate) fn link(&self, peer: NodeId) -> Link {
        Link::new(peer, self.stats.peer_state(peer), self.budget_permits)
    }

    /// Marks the transport as serving; fails if it already was ([`crate::Transport::serve`]).
    pub(crate) fn start_serving(&self) -> Result<(), NetError> {
        if self.serving.swap(true, Ordering::SeqCst) {
            return Err(NetError::AlreadyServing);
        }
        Ok(())
    }
}

/// What differs between transports in a round trip: moving bytes. See the module docs for
/// the order in which [`round_trip`] calls these.
pub(crate) trait Carrier: Sync {
    /// The connection's shared part.
    fn link(&self) -> &Link;
    /// The longest frame this carrier can move, if it has a bound (UCX's receive slot).
    fn frame_bytes_max(&self) -> Option<u64> {
        None
    }
    /// Sends `request` and brings back its reply. `permit` holds the request's payload
    /// bytes in the peer's outbound budget; drop it once they have left.
    fn carry(
        &self,
        request: Outgoing,
        permit: Option<OwnedSemaphorePermit>,
    ) -> impl Future<Output = Result<Received, CarryError>> + Send;
    /// The peer sent a bad reply: close the connection (every lane of it) for good.
    fn close_bad_frame(&self, _error: &WireError) {
        self.link().close();
    }
    /// Whether the connection may still carry requests ([`crate::Connection::is_open`]):
    /// by default, until its link was closed.
    fn is_open(&self) -> bool {
        !self.link().is_closed()
    }
}

/// Implements [`crate::Connection`] for a [`Carrier`] type: the peer is its link's, it is
/// open while [`Carrier::is_open`], and every request runs [`round_trip`]. A macro because
/// each transport's connection is a type of its own (a trait impl per type).
macro_rules! connection_over_carrier {
    ($conn:ty) => {
        impl $crate::Connection for $conn {
            fn peer(&self) -> spillway_types::NodeId {
                $crate::exchange::Carrier::link(self).peer
            }

            fn is_open(&self) -> bool {
                $crate::exchange::Carrier::is_open(self)
            }

            async fn request(
                &self,
                request: $crate::Request,
            ) -> Result<$crate::Response, $crate::NetError> {
                $crate::exchange::round_trip(self, request).await
            }
        }
    };
}
pub(crate) use connection_over_carrier;

/// Encodes `request` as frame `id`.
pub(crate) fn encode_request(
    peer: NodeId,
    id: u64,
    request: Request,
) -> Result<Outgoing, NetError> {
    let (message, pages) = request
        .into_wire()
        .map_err(|source| NetError::Encode { peer, source })?;
    let payload_bytes = parts_len(&pages);
    let parts =
        frame_parts(id, &message, pages).map_err(|source| NetError::Encode { peer, source })?;
    Ok(Outgoing {
        id,
        frame_bytes: parts_len(&parts),
        parts,
        payload_bytes,
    })
}

/// The frame of `message` (header and body) followed by its payload chunks.
pub(crate) fn frame_parts(
    request_id: u64,
    message: &Message,
    payload: Vec<Bytes>,
) -> Result<Vec<Bytes>, WireError> {
    let head = wire::encode_frame(request_id, message)?;
    let mut parts = Vec::with_capacity(1 + payload.len());
    parts.push(Bytes::from(head));
    parts.extend(payload);
    Ok(parts)
}

/// Total bytes of `parts`.
pub(crate) fn parts_len(parts: &[Bytes]) -> u64 {
    parts.iter().map(|p| p.len() as u64).sum()
}

/// `parts` in one buffer (a carrier that moves whole messages of one buffer).
pub(crate) fn concat(parts: &[Bytes]) -> Bytes {
    if let [one] = parts {
        return one.clone();
    }
    let mut buf = BytesMut::with_capacity(parts_len(parts) as usize);
    for p in parts {
        buf.extend_from_slice(p);
    }
    buf.freeze()
}

/// Decodes a frame received in one buffer, with every limit and checksum check of
/// `wire::decode_frame`; the payload is a slice of `buf` (no copy).
pub(crate) fn decode_whole(buf: &Bytes) -> Result<Decoded, WireError> {
    let (frame, used) = wire::decode_frame(buf)?;
    let payload_at = used - frame.payload.len();
    Ok(Decoded {
        request_id: frame.header.request_id,
        message: frame.message,
        payload: buf.slice(payload_at..used),
        wire_bytes: used as u64,
    })
}

/// Takes `bytes` from an in-flight budget of `budget_permits` permits; none for no bytes.
pub(crate) async fn acquire(
    budget: &Arc<Semaphore>,
    bytes: u64,
    budget_permits: u32,
) -> Option<OwnedSemaphorePermit> {
    if bytes == 0 {
        return None;
    }
    Some(
        budget
            .clone()
            .acquire_many_owned(permits_for(bytes, budget_permits))
            .await
            .expect("in-flight budgets are never closed"),
    )
}

/// One request and its reply over `carrier`, in the order of the module docs.
pub(crate) async fn round_trip<C: Carrier>(
    carrier: &C,
    request: Request,
) -> Result<Response, NetError> {
    let link = carrier.link();
    let peer = link.peer;
    if link.is_closed() {
        return Err(link.lost("connection closed"));
    }
    let kind = request.kind();
    let outgoing = encode_request(
        peer,
        link.next_request_id.fetch_add(1, Ordering::Relaxed),
        request,
    )?;
    if let Some(limit_bytes) = carrier.frame_bytes_max()
        && outgoing.frame_bytes > limit_bytes
    {
        return Err(NetError::TooLarge {
            peer,
            frame_bytes: outgoing.frame_bytes,
            limit_bytes,
        });
    }
    let state = &*link.state;
    let permit = acquire(&state.outbound, outgoing.payload_bytes, link.budget_permits).await;
    let (id, frame_bytes) = (outgoing.id, outgoing.frame_bytes);
    let received = carrier.carry(outgoing, permit).await;
    // Counted once the request left (a carrier fails before sending only for a closed
    // connection, whose counters no longer matter).
    state.add_out(frame_bytes);
    let bad_frame = |source: WireError| {
        state.reject();
        carrier.close_bad_frame(&source);
        NetError::BadFrame {
            peer: Some(peer),
            source,
        }
    };
    let reply = match received {
        Ok(Received::Whole(buf)) => decode_whole(&buf).map_err(bad_frame)?,
        Ok(Received::Decoded(d)) => d,
        Err(CarryError::Lost(e)) => return Err(e),
        Err(CarryError::BadFrame(source)) => return Err(bad_frame(source)),
    };
    state.add_in(reply.wire_bytes);
    let reply_kind = reply.message.kind();
    if reply.request_id != id || !Response::answers(reply_kind, kind) {
        return Err(bad_frame(WireError::UndecodableBody {
            kind: reply_kind,
            reason: format!(
                "reply {} does not answer {kind:?} request {id}",
                reply.request_id
            ),
        }));
    }
    Response::from_wire(reply.message, &reply.payload).map_err(|reply| NetError::UnexpectedReply {
        peer,
        request: kind,
        reply,
    })
}

/// Answers one decoded request: hands it to `handler` (a frame that is not a request gets
/// a `BadRequest` reply) and encodes the response as the parts of reply frame
/// `request_id`. A response that cannot be encoded becomes an `Internal` error reply.
pub(crate) async fn answer<H: Handler>(
    handler: &H,
    peer: NodeId,
    request_id: u64,
    message: Message,
    payload: &Bytes,
    permit: Option<OwnedSemaphorePermit>,
) -> Vec<Bytes> {
    let response = match Request::from_wire(message, payload) {
        Ok(request) => handler.handle(peer, request).await,
        Err(kind) => Response::Error(ErrorReply::new(
            ErrorCode::BadRequest,
            format!("a {kind:?} frame is not a request"),
        )),
    };
    drop(permit);
    response
        .into_wire()
        .and_then(|(message, pages)| frame_parts(request_id, &message, pages))
        .unwrap_or_else(|e| {
            tracing::error!(%peer, error = %e, "the handler's response cannot be sent");
            let message = Message::Error(ErrorReply::new(
                ErrorCode::Internal,
                format!("response cannot be sent: {e}"),
            ));
            frame_parts(request_id, &message, Vec::new()).expect("an error reply encodes")
        })
}

/// Serves one request frame received whole from `peer` at `local`: decodes it with the
/// wire limits (a bad frame is counted and returned: the caller closes the connection),
/// takes its payload from the peer's inbound budget, and answers it ([`answer`]). Returns
/// the request's id and the reply frame's parts, already counted.
pub(crate) async fn serve_whole<H: Handler>(
    handler: &H,
    local: &Local,
    peer: NodeId,
    frame: &Bytes,
) -> Result<(u64, Vec<Bytes>), WireError> {
    let state = local.stats.peer_state(peer);
    let request = match decode_whole(frame) {
        Ok(d) => d,
        Err(e) => {
            state.reject();
            return Err(e);
        }
    };
    let permit = acquire(
        &state.inbound,
        request.payload.len() as u64,
        local.budget_permits,
    )
    .await;
    state.add_in(request.wire_bytes);
    let parts = answer(
        handler,
        peer,
        request.request_id,
        request.message,
        &request.payload,
        permit,
    )
    .await;
    state.add_out(parts_len(&parts));
    Ok((request.request_id, parts))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Page;
    use spillway_types::{BufferId, PageId};

    fn page(index: u32, len: usize) -> Page {
        let id = PageId {
            buffer: BufferId(7),
            index,
        };
        Page::new(id, Bytes::from(vec![index as u8; len]))
    }

    #[test]
    fn a_request_encodes_to_parts_that_decode_back() {
        let pages = vec![page(0, 100), page(1, 50)];
        let out = encode_request(
            NodeId(1),
            9,
            Request::Put {
                pages: pages.clone(),
            },
        )
        .unwrap();
        assert_eq!(out.payload_bytes, 150);
        assert_eq!(out.parts.len(), 3);
        assert_eq!(out.frame_bytes, parts_len(&out.parts));
        let whole = concat(&out.parts);
        assert_eq!(whole.len() as u64, out.frame_bytes);
        let d = decode_whole(&whole).unwrap();
        assert_eq!(d.request_id, 9);
        assert_eq!(d.wire_bytes, out.frame_bytes);
        assert_eq!(
            Request::from_wire(d.message, &d.payload).unwrap(),
            Request::Put { pages }
        );
    }

    #[test]
    fn a_flipped_payload_byte_fails_the_decode() {
        let out = encode_request(
            NodeId(1),
            1,
            Request::Put {
                pages: vec![page(0, 64)],
            },
        )
        .unwrap();
        let mut whole = concat(&out.parts).to_vec();
        let last = whole.len() - 1;
        whole[last] ^= 1;
        assert!(matches!(
            decode_whole(&Bytes::from(whole)),
            Err(WireError::ChecksumMismatch { .. })
        ));
    }
}
