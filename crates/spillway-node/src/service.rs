//! The node's peer service: one [`Handler`] for everything peers ask of this node.
//!
//! - page requests (put, get, delete) go to the host tier ([`HostStore`]), keyed by the
//!   peer the transport authenticated;
//! - Raft messages are decoded (raft-rs protobuf, under
//!   `spillway_meta::limits::RAFT_MESSAGE_BYTES_MAX`, only after the transport checked the
//!   frame and the peer's certificate) and handed to the Raft thread; a message whose
//!   sender is not the peer that sent it is refused;
//! - forwarded proposals are decoded with the log's own codec (bounded) and proposed here
//!   if this node leads; otherwise the reply names the leader this node knows.
//!
//! - a UCX introduction (`transport = "ucx"`) starts serving pages to the peer over UCX
//!   and answers with this node's UCX address (`crate::ucx_pages`).
//!
//! A blob that passed the wire checks but does not decode is answered with a `BadRequest`
//! error and counted ([`ServiceCounters::peer_requests_refused`]): the connection stays
//! open, since the frame itself was sound.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use spillway_meta::{Batch, Role};
use spillway_net::{Handler, Request, Response};
use spillway_types::NodeId;
use spillway_types::wire::{ErrorCode, ErrorReply};

use crate::meta::{ForwardReply, MetaDriver, ProposeFailure, encode_forward_reply};
use crate::store::HostStore;

/// Counters of the peer service.
#[derive(Debug, Default)]
pub struct ServiceCounters {
    /// Raft messages and proposals from peers that did not decode or named another sender.
    pub peer_requests_refused: AtomicU64,
    /// Raft messages received from peers.
    pub raft_messages_in: AtomicU64,
    /// Proposals forwarded to this node by followers.
    pub proposals_in: AtomicU64,
}

/// The peer service of one node.
#[derive(Debug)]
pub(crate) struct NodeService {
    pub store: Arc<HostStore>,
    pub meta: Arc<MetaDriver>,
    pub counters: Arc<ServiceCounters>,
    /// This node's UCX transport, when pages move over UCX (weak: the transport's server
    /// holds this service).
    #[cfg(feature = "ucx")]
    pub ucx: Option<std::sync::Weak<spillway_net::ucx::UcxTransport>>,
}

impl NodeService {
    fn refuse(&self, peer: NodeId, what: &str, reason: String) -> Response {
        self.counters
            .peer_requests_refused
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%peer, %reason, "refused a {what}");
        Response::Error(ErrorReply::new(
            ErrorCode::BadRequest,
            format!("{what} refused: {reason}"),
        ))
    }
}

impl Handler for NodeService {
    async fn handle(&self, peer: NodeId, request: Request) -> Response {
        match request {
            Request::Raft { message } => {
                self.counters
                    .raft_messages_in
                    .fetch_add(1, Ordering::Relaxed);
                match spillway_meta::wire::decode_message(&message) {
                    Ok(m) => {
                        if self.meta.step(peer, m) {
                            Response::RaftAck
                        } else {
                            self.refuse(
                                peer,
                                "Raft message",
                                "its sender or recipient is not this connection's".into(),
                            )
                        }
                    }
                    Err(e) => self.refuse(peer, "Raft message", e.to_string()),
                }
            }
            Request::Propose { batch } => {
                self.counters.proposals_in.fetch_add(1, Ordering::Relaxed);
                let batch = match Batch::decode(&batch) {
                    Ok(b) => b,
                    Err(e) => return self.refuse(peer, "proposal", e.to_string()),
                };
                let view = self.meta.view();
                let reply = if view.role != Role::Leader {
                    ForwardReply::NotLeader {
                        leader: view.leader.map(|l| l.0),
                    }
                } else {
                    match self.meta.propose(batch.updates).await {
                        Ok(outcomes) => ForwardReply::Applied { outcomes },
                        Err(e) => ForwardReply::Failed {
                            // A degraded leader loses its lead: another takes the retry.
                            retry: matches!(
                                e,
                                ProposeFailure::Busy { .. }
                                    | ProposeFailure::TimedOut { .. }
                                    | ProposeFailure::Degraded { .. }
                            ),
                            failure: e.to_string(),
                        },
                    }
                };
                Response::Propose {
                    reply: encode_forward_reply(&reply),
                }
            }
            #[cfg(feature = "ucx")]
            Request::UcxConnect { offer } => {
                crate::ucx_pages::accept(self.ucx.as_ref(), peer, &offer).await
            }
            #[cfg(not(feature = "ucx"))]
            Request::UcxConnect { .. } => self.refuse(
                peer,
                "UCX introduction",
                "this build has no UCX transport (feature `ucx`); set transport = \"quic\" on every member".into(),
            ),
            pages => self.store.handle_pages(peer, pages),
        }
    }
}
