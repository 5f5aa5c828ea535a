//! Pages between nodes over UCX (`transport = "ucx"`, feature `ucx`).
//!
//! Only page requests (put, get, delete) travel over UCX; Raft, reservations and
//! forwarded proposals stay on QUIC. A UCX connection to a peer is introduced over the
//! node's QUIC connection to it, which mutual TLS authenticates: this node sends a
//! [`Request::UcxConnect`] with its offer (a connection id and its UCX worker address),
//! the peer connects to that worker, starts serving the connection with its peer service
//! and answers with its own id and address ([`accept`]). So a worker address, which UCX
//! unpacks without bounds checks, only ever comes from a peer holding a pool certificate,
//! and peer addresses come from the pool's membership (the QUIC addresses in Raft).
//!
//! One UCX connection per peer is cached; a request that fails on the transport drops it
//! (the caller, the connection cache `peers`, marks the peer failed: the same backoff as QUIC),
//! and the next request introduces a new one. This module knows nothing of the peer
//! cache: the introduction is sent through the function the caller passes.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Weak};

use spillway_net::ucx::{UcxConnection, UcxTransport};
use spillway_net::{Connection, NetError, Request, Response};
use spillway_types::NodeId;
use spillway_types::wire::{ErrorCode, ErrorReply};

/// The UCX connections of one node to its peers.
#[derive(Debug)]
pub(crate) struct UcxPages {
    transport: Arc<UcxTransport>,
    conns: tokio::sync::Mutex<HashMap<NodeId, UcxConnection>>,
}

impl UcxPages {
    pub(crate) fn new(transport: Arc<UcxTransport>) -> Self {
        UcxPages {
            transport,
            conns: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The cached UCX connection to `peer`, or a new one introduced over QUIC.
    async fn connection<F: Future<Output = Result<Response, NetError>>>(
        &self,
        peer: NodeId,
        introduce: impl FnOnce(Request) -> F,
    ) -> Result<UcxConnection, NetError> {
        let mut conns = self.conns.lock().await;
        if let Some(c) = conns.get(&peer) {
            return Ok(c.clone());
        }
        let offer = self.transport.offer();
        let answer = match introduce(Request::UcxConnect {
            offer: offer.bytes(),
        })
        .await?
        {
            Response::UcxConnect { answer } => answer,
            Response::Error(e) => {
                return Err(NetError::Remote {
                    peer,
                    code: e.code,
                    message: format!("UCX introduction refused: {}", e.message),
                });
            }
            other => {
                return Err(NetError::ConnectionLost {
                    peer,
                    reason: format!("UCX introduction answered with {:?}", other.kind()),
                });
            }
        };
        let conn = self.transport.complete(peer, offer, &answer).await?;
        tracing::debug!(%peer, "UCX connection introduced over QUIC");
        conns.insert(peer, conn.clone());
        Ok(conn)
    }

    /// Sends a page request to `peer` over UCX; `introduce` sends the introduction over
    /// the authenticated QUIC connection when no UCX connection is cached. A transport
    /// failure drops the cached connection.
    pub(crate) async fn request<F: Future<Output = Result<Response, NetError>>>(
        &self,
        peer: NodeId,
        request: Request,
        introduce: impl FnOnce(Request) -> F,
    ) -> Result<Response, NetError> {
        let conn = self.connection(peer, introduce).await?;
        let result = conn.request(request).await;
        if let Err(e) = &result
            && e.connection_failed()
        {
            self.conns.lock().await.remove(&peer);
        }
        result
    }
}

/// Answers a peer's [`Request::UcxConnect`]: serves a UCX connection to it when this node
/// moves pages over UCX, else refuses.
pub(crate) async fn accept(
    ucx: Option<&Weak<UcxTransport>>,
    peer: NodeId,
    offer: &[u8],
) -> Response {
    let Some(ucx) = ucx.and_then(Weak::upgrade) else {
        return Response::Error(ErrorReply::new(
            ErrorCode::BadRequest,
            "this node moves pages over QUIC (transport = \"quic\"); set the same transport on every member",
        ));
    };
    match ucx.accept(peer, offer).await {
        Ok(answer) => Response::UcxConnect { answer },
        Err(e) => Response::Error(ErrorReply::new(ErrorCode::BadRequest, e.to_string())),
    }
}
