//! Joining a pool without a shared disk, as `kubeadm join` does: a one-time token, a
//! bootstrap connection pinned to the pool's CA, and a certificate signed for a key that
//! never left the joining host.
//!
//! Parts:
//! - [`token`]: the token (`spw1.<id>.<secret>.<ca-sha256>`) and where tokens are recorded
//!   (the CA's directory), used up atomically;
//! - the protocol: one QUIC connection ([`JOIN_ALPN`]), one stream, one
//!   [`BootstrapRequest`] answered by one reply. A [`JoinRequest`] (token, node id,
//!   address, a certificate signing request) gets a [`JoinReply`] (the pool id, the CA
//!   certificate, the node's certificate and the members to reach) or a typed
//!   [`JoinRefusal`]; a [`RemoveRequest`] (token, node id: an operator holding the CA key
//!   removes a dead host, [`remove`]) gets a [`RemoveReply`]. Every message is bincode 2
//!   decoded under [`JOIN_MESSAGE_BYTES_MAX`]; trailing bytes are refused;
//! - [`BootstrapServer`]: serves the protocol for a [`JoinHandler`] (the node holding the
//!   CA key decides: token, node id, signature, membership). Its TLS presents the node's
//!   certificate and the CA certificate; it asks for no client certificate (the joiner
//!   has none yet);
//! - [`join`]: the joiner's side. It accepts the server only if the chain it presents
//!   holds a certificate whose SHA-256 is the token's CA fingerprint and that certificate
//!   signed the server's ([`JoinError::CaMismatch`] otherwise), so a token sent to the
//!   wrong host gives its secret to no one but the pool.
//!
//! Bounds: [`JOIN_CONNECTIONS_MAX`] connections served at once (each decodes at most
//! [`JOIN_MESSAGE_BYTES_MAX`]: 1 MiB in all), each given [`JOIN_TIMEOUT`]. Nothing a
//! peer sends can panic the server: every field is checked, every error is a refusal.

pub mod token;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::RootCertStore;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use serde::{Deserialize, Serialize};
use spillway_types::{NodeId, PoolId};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::certs::{self, CertError, NodeIdentity, SERVER_NAME, cert_node_id, sha256};
pub use token::{JoinToken, TokenError, TokenStore};

/// The bootstrap protocol's ALPN.
pub const JOIN_ALPN: &[u8] = b"spillway-join/1";
/// The bootstrap protocol's version, in every request (2: removals).
pub const JOIN_PROTOCOL_VERSION: u16 = 2;
/// Largest bootstrap message either way: 64 KiB (a request is ~1 KiB; a reply holds two
/// certificates of ~1 KiB and up to [`JOIN_MEMBERS_MAX`] addresses).
pub const JOIN_MESSAGE_BYTES_MAX: usize = 64 * 1024;
/// Members a reply lists at most: 256 (of at most 128 bytes each, 32 KiB).
pub const JOIN_MEMBERS_MAX: usize = 256;
/// Longest address or zone label in a request: 128 bytes.
pub const JOIN_FIELD_BYTES_MAX: usize = 128;
/// Bootstrap connections served at once: 16 (with their messages, 1 MiB at most).
pub const JOIN_CONNECTIONS_MAX: usize = 16;
/// Time one join may take, from connecting to the reply: 20 s (the server may wait for
/// a leadership transfer and a membership commit).
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(20);

/// What a joining host sends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinRequest {
    /// [`JOIN_PROTOCOL_VERSION`].
    pub version: u16,
    /// The token's id.
    pub token_id: u64,
    /// The token's secret.
    pub secret: [u8; 16],
    /// The node id the host will run as.
    pub node: u64,
    /// Where its peers reach it (its `listen_addr`), at most [`JOIN_FIELD_BYTES_MAX`].
    pub addr: String,
    /// Its failure domain, at most [`JOIN_FIELD_BYTES_MAX`].
    pub zone: Option<String>,
    /// Its certificate signing request (DER).
    pub csr_der: Vec<u8>,
}

impl JoinRequest {
    /// Why the request is unusable, before any token or signature is looked at.
    pub fn invalid_reason(&self) -> Option<String> {
        if self.version != JOIN_PROTOCOL_VERSION {
            return Some(format!(
                "protocol version {} (this server speaks {JOIN_PROTOCOL_VERSION})",
                self.version
            ));
        }
        if self.node == 0 {
            return Some("node id 0 is reserved".into());
        }
        if self.addr.len() > JOIN_FIELD_BYTES_MAX
            || self
                .zone
                .as_ref()
                .is_some_and(|z| z.len() > JOIN_FIELD_BYTES_MAX)
        {
            return Some(format!(
                "an address or zone is longer than {JOIN_FIELD_BYTES_MAX} bytes"
            ));
        }
        match self.addr.parse::<SocketAddr>() {
            Ok(a) if a.port() != 0 && !a.ip().is_unspecified() => None,
            _ => Some(format!(
                "{:?} is not an address peers can reach (IP:PORT)",
                self.addr
            )),
        }
    }
}

/// What an operator sends to remove a member (a host that died for good): a token made
/// with the CA key proves the right to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveRequest {
    /// [`JOIN_PROTOCOL_VERSION`].
    pub version: u16,
    /// The token's id.
    pub token_id: u64,
    /// The token's secret.
    pub secret: [u8; 16],
    /// The member to remove.
    pub node: u64,
    /// Remove it even if the pool sees it up (its pages are not moved first).
    pub force: bool,
}

/// One request on a bootstrap connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BootstrapRequest {
    /// A host joins.
    Join(JoinRequest),
    /// An operator removes a member.
    Remove(RemoveRequest),
}

impl BootstrapRequest {
    /// Why the request is unusable, before any token is looked at.
    pub fn invalid_reason(&self) -> Option<String> {
        match self {
            BootstrapRequest::Join(r) => r.invalid_reason(),
            BootstrapRequest::Remove(r) if r.version != JOIN_PROTOCOL_VERSION => Some(format!(
                "protocol version {} (this server speaks {JOIN_PROTOCOL_VERSION})",
                r.version
            )),
            BootstrapRequest::Remove(r) if r.node == 0 => Some("node id 0 is reserved".into()),
            BootstrapRequest::Remove(_) => None,
        }
    }
}

/// The answer to a [`RemoveRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoveReply {
    /// The member is out of the metadata group and the pool's state.
    Removed,
    /// Refused.
    Refused(JoinRefusal),
}

/// What the pool grants a joining host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// The pool.
    pub pool_id: u64,
    /// The pool's CA certificate (PEM).
    pub ca_pem: String,
    /// The host's node certificate (PEM), for the key of its request.
    pub cert_pem: String,
    /// The members to reach, `(id, peer address)`, at most [`JOIN_MEMBERS_MAX`].
    pub members: Vec<(u64, String)>,
}

/// The server's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JoinReply {
    /// Joined: the node is a learner of the metadata group.
    Accepted(Admission),
    /// Refused.
    Refused(JoinRefusal),
}

/// Why the pool refused a join.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum JoinRefusal {
    /// No such token (never made, or made for another CA directory).
    #[error("the join token is unknown to this pool")]
    UnknownToken,
    /// The token was used already (tokens are one-time).
    #[error("the join token was used already (tokens are one-time: make another)")]
    TokenUsed,
    /// The token expired.
    #[error("the join token expired at {expired_at_ms} ms (Unix time)")]
    TokenExpired {
        /// When.
        expired_at_ms: u64,
    },
    /// The secret does not match the token's.
    #[error("the join token's secret is wrong")]
    WrongSecret,
    /// The request is malformed (version, node id, address, size).
    #[error("bad join request: {reason}")]
    BadRequest {
        /// What is wrong.
        reason: String,
    },
    /// The node id is a member already.
    #[error(
        "node id {node} is a member of the pool already (a host that died with it: `spillway cluster remove --node {node}` first)"
    )]
    NodeTaken {
        /// The id.
        node: u64,
    },
    /// The node to remove is not a member.
    #[error("node {node} is not a member of the pool")]
    NotAMember {
        /// The id.
        node: u64,
    },
    /// The node to remove is up: it should leave (its pages move first), or be forced.
    #[error(
        "node {node} is up: stop it with `spillway node --leave-on-stop` so its pages move first, or remove it with --force"
    )]
    NodeUp {
        /// The id.
        node: u64,
    },
    /// The node to remove serves this request or leads the metadata group.
    #[error("node {node} {role}: remove another node, or stop it with --leave-on-stop")]
    Busy {
        /// The id.
        node: u64,
        /// What it does (`serves joins`, `leads the pool`).
        role: String,
    },
    /// The certificate signing request is invalid (its signature, its encoding).
    #[error("{reason}")]
    BadCsr {
        /// What is wrong.
        reason: String,
    },
    /// The node could not be added to the metadata group.
    #[error("the pool could not add the node: {reason}")]
    Membership {
        /// Why.
        reason: String,
    },
    /// The server failed (its token records, its CA).
    #[error("the bootstrap server failed: {reason}")]
    Internal {
        /// Why.
        reason: String,
    },
}

/// Decides joins: the node holding the pool's CA key.
///
/// Contract: called once per well-formed request ([`JoinRequest::invalid_reason`] is
/// `None`); MUST answer every request, MUST use a token up before granting a certificate,
/// and MUST NOT panic on any request.
pub trait JoinHandler: Send + Sync + 'static {
    /// Answers `request`.
    fn admit(&self, request: JoinRequest) -> impl Future<Output = JoinReply> + Send;
    /// Answers a removal (same contract: a token is used up before anything changes).
    fn remove(&self, request: RemoveRequest) -> impl Future<Output = RemoveReply> + Send;
}

/// Why a join failed, on the joining host.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The server presented no certificate with the token's CA fingerprint: not this
    /// pool's bootstrap endpoint, or a token of another pool.
    #[error(
        "the bootstrap endpoint at {addr} does not hold the pool's CA: expected SHA-256 {expected}, it presented {}",
        if presented.is_empty() { "no CA certificate".to_string() } else { presented.join(", ") }
    )]
    CaMismatch {
        /// Where.
        addr: SocketAddr,
        /// The token's fingerprint.
        expected: String,
        /// The fingerprints of the certificates the server presented.
        presented: Vec<String>,
    },
    /// The pool refused.
    #[error("the pool refused the join: {0}")]
    Refused(#[from] JoinRefusal),
    /// The pool refused a removal.
    #[error("the pool refused the removal: {0}")]
    RemovalRefused(JoinRefusal),
    /// No connection (unreachable, TLS failed for another reason).
    #[error("cannot reach the bootstrap endpoint {addr}: {reason}")]
    Connect {
        /// Where.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The server's reply is not a reply (or is too large), or what it granted does not
    /// fit the request (another CA, a certificate for another node).
    #[error("bad reply from the bootstrap endpoint: {reason}")]
    BadReply {
        /// What is wrong.
        reason: String,
    },
    /// The join took longer than [`JOIN_TIMEOUT`].
    #[error("no answer from the bootstrap endpoint {addr} within {} s", JOIN_TIMEOUT.as_secs())]
    Timeout {
        /// Where.
        addr: String,
    },
    /// The local key or request could not be made.
    #[error(transparent)]
    Cert(#[from] CertError),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<JOIN_MESSAGE_BYTES_MAX>()
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Plain serde data into a Vec: cannot fail.
    bincode::serde::encode_to_vec(value, config()).expect("bincode encoding of in-memory data")
}

/// Why bytes are not a join message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Longer than any message may be.
    #[error("{bytes} bytes, more than {JOIN_MESSAGE_BYTES_MAX}")]
    TooLarge {
        /// Its length.
        bytes: usize,
    },
    /// Not a message of the expected kind (bincode's reason).
    #[error("malformed: {0}")]
    Malformed(String),
    /// A message followed by bytes that belong to none.
    #[error("{0} trailing bytes")]
    Trailing(usize),
}

/// Decodes one message under [`JOIN_MESSAGE_BYTES_MAX`], refusing trailing bytes.
pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    if bytes.len() > JOIN_MESSAGE_BYTES_MAX {
        return Err(DecodeError::TooLarge { bytes: bytes.len() });
    }
    let (value, n) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if n != bytes.len() {
        return Err(DecodeError::Trailing(bytes.len() - n));
    }
    Ok(value)
}

/// Encodes a request (the joiner) or a reply (the server).
pub fn encode_message<T: Serialize>(value: &T) -> Vec<u8> {
    encode(value)
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The bootstrap endpoint (see the module docs).
#[derive(Debug)]
pub struct BootstrapServer {
    endpoint: quinn::Endpoint,
    addr: SocketAddr,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl BootstrapServer {
    /// Serves joins on `addr` (port 0: a free one) for `handler`, presenting `identity`'s
    /// certificate and its CA. Must be called inside a tokio runtime.
    pub fn start<H: JoinHandler>(
        addr: SocketAddr,
        identity: &NodeIdentity,
        handler: Arc<H>,
    ) -> Result<BootstrapServer, CertError> {
        use crate::tls::tls_err;
        let mut chain = identity.chain.clone();
        chain.push(identity.ca.clone());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_no_client_auth()
            .with_single_cert(chain, identity.key.clone_key())
            .map_err(tls_err)?;
        tls.alpn_protocols = vec![JOIN_ALPN.to_vec()];
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(tls_err)?;
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server_config.migration(false);
        let endpoint =
            quinn::Endpoint::server(server_config, addr).map_err(|source| CertError::Io {
                path: format!("<bootstrap endpoint {addr}>").into(),
                source,
            })?;
        let addr = endpoint.local_addr().map_err(|source| CertError::Io {
            path: "<bootstrap endpoint>".into(),
            source,
        })?;
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(accept_loop(
            endpoint.clone(),
            handler,
            cancel.clone(),
            tasks.clone(),
        ));
        Ok(BootstrapServer {
            endpoint,
            addr,
            cancel,
            tasks,
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and waits for the joins in progress to end.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.endpoint.close(0u32.into(), b"shutting down");
        self.tasks.close();
        self.tasks.wait().await;
    }
}

async fn accept_loop<H: JoinHandler>(
    endpoint: quinn::Endpoint,
    handler: Arc<H>,
    cancel: CancellationToken,
    tasks: TaskTracker,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(JOIN_CONNECTIONS_MAX));
    loop {
        let incoming = tokio::select! {
            _ = cancel.cancelled() => return,
            i = endpoint.accept() => match i { Some(i) => i, None => return },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(
                from = %incoming.remote_address(),
                "bootstrap connection refused: {JOIN_CONNECTIONS_MAX} joins in progress"
            );
            incoming.refuse();
            continue;
        };
        let (handler, cancel) = (handler.clone(), cancel.clone());
        tasks.spawn(async move {
            let from = incoming.remote_address();
            tokio::select! {
                _ = cancel.cancelled() => {}
                r = tokio::time::timeout(JOIN_TIMEOUT, serve_one(incoming, &*handler)) => {
                    match r {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => tracing::info!(%from, error = %e, "bootstrap connection failed"),
                        Err(_) => tracing::info!(%from, "bootstrap connection timed out"),
                    }
                }
            }
            drop(permit);
        });
    }
}

async fn serve_one<H: JoinHandler>(incoming: quinn::Incoming, handler: &H) -> Result<(), String> {
    let conn = incoming.await.map_err(|e| e.to_string())?;
    let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| e.to_string())?;
    let bytes = recv
        .read_to_end(JOIN_MESSAGE_BYTES_MAX)
        .await
        .map_err(|e| e.to_string());
    let from = conn.remote_address();
    // A request that does not decode is answered as a refused join (what a version 1
    // joiner reads).
    let reply = match bytes.and_then(|b| decode::<BootstrapRequest>(&b).map_err(|e| e.to_string()))
    {
        Err(reason) => encode(&JoinReply::Refused(JoinRefusal::BadRequest { reason })),
        Ok(request) => match (request.invalid_reason(), request) {
            (Some(reason), BootstrapRequest::Remove(_)) => {
                encode(&RemoveReply::Refused(JoinRefusal::BadRequest { reason }))
            }
            (Some(reason), BootstrapRequest::Join(_)) => {
                encode(&JoinReply::Refused(JoinRefusal::BadRequest { reason }))
            }
            (None, BootstrapRequest::Join(request)) => {
                let node = request.node;
                let reply = handler.admit(request).await;
                match &reply {
                    JoinReply::Accepted(_) => tracing::info!(node, %from, "node joined the pool"),
                    JoinReply::Refused(r) => {
                        tracing::info!(node, %from, reason = %r, "join refused")
                    }
                }
                encode(&reply)
            }
            (None, BootstrapRequest::Remove(request)) => {
                let node = request.node;
                let reply = handler.remove(request).await;
                match &reply {
                    RemoveReply::Removed => {
                        tracing::info!(node, %from, "node removed from the pool")
                    }
                    RemoveReply::Refused(r) => {
                        tracing::info!(node, %from, reason = %r, "removal refused")
                    }
                }
                encode(&reply)
            }
        },
    };
    send.write_all(&reply).await.map_err(|e| e.to_string())?;
    send.finish().map_err(|e| e.to_string())?;
    // The joiner closes once it has read the reply.
    let _ = conn.closed().await;
    Ok(())
}

/// What a joining host is.
#[derive(Clone, Debug)]
pub struct JoinParams {
    /// The node id it runs as.
    pub node: NodeId,
    /// Where peers reach it (its `listen_addr`).
    pub addr: SocketAddr,
    /// Its failure domain.
    pub zone: Option<String>,
}

/// What a host got by joining.
#[derive(Debug)]
pub struct Joined {
    /// Its identity: the pool's CA, its certificate and its key (made here).
    pub identity: NodeIdentity,
    /// The pool's CA certificate (PEM).
    pub ca_pem: String,
    /// The members to reach, `(id, peer address)`.
    pub members: Vec<(NodeId, SocketAddr)>,
}

/// Checks the bootstrap server's chain against the token's CA fingerprint (see the module
/// docs), and records what it saw when it does not match.
#[derive(Debug)]
struct PinnedCa {
    fingerprint: [u8; 32],
    provider: Arc<CryptoProvider>,
    mismatch: Mutex<Option<Vec<String>>>,
}

impl ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(ca) = intermediates
            .iter()
            .find(|c| sha256(c.as_ref()) == self.fingerprint)
        else {
            let seen = std::iter::once(end_entity)
                .chain(intermediates)
                .map(|c| token::hex(&sha256(c.as_ref())))
                .collect();
            *self.mismatch.lock().expect("pinned CA") = Some(seen);
            return Err(rustls::Error::General(
                "no certificate of the pinned CA fingerprint".into(),
            ));
        };
        let mut roots = RootCertStore::empty();
        roots.add(ca.clone().into_owned())?;
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            self.provider.clone(),
        )
        .build()
        .map_err(|e| rustls::Error::General(e.to_string()))?;
        verifier.verify_server_cert(end_entity, &[], server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Joins the pool whose bootstrap endpoint is at `server` (`HOST:PORT`) with `token`:
/// makes a key and a signing request here, proves the token over a connection pinned to
/// the token's CA fingerprint, and returns the identity the pool granted (not written
/// anywhere: the caller writes it, [`NodeIdentity::write`]). Must be called inside a
/// tokio runtime.
pub async fn join(
    server: &str,
    token: &JoinToken,
    params: &JoinParams,
) -> Result<Joined, JoinError> {
    match tokio::time::timeout(JOIN_TIMEOUT, join_inner(server, token, params)).await {
        Ok(r) => r,
        Err(_) => Err(JoinError::Timeout {
            addr: server.to_string(),
        }),
    }
}

/// A client endpoint and a connection to the bootstrap endpoint at `server`, accepted
/// only if it holds the CA of `token`'s fingerprint.
async fn connect_pinned(
    server: &str,
    token: &JoinToken,
) -> Result<(quinn::Endpoint, quinn::Connection), JoinError> {
    let connect_err = |reason: String| JoinError::Connect {
        addr: server.to_string(),
        reason,
    };
    let addr = tokio::net::lookup_host(server)
        .await
        .map_err(|e| connect_err(e.to_string()))?
        .next()
        .ok_or_else(|| connect_err("the name has no address".into()))?;
    let pinned = Arc::new(PinnedCa {
        fingerprint: token.ca_sha256,
        provider: provider(),
        mismatch: Mutex::new(None),
    });
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(crate::tls::tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(pinned.clone())
        .with_no_client_auth();
    tls.alpn_protocols = vec![JOIN_ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .map_err(|e| connect_err(e.to_string()))?;
    let client_config = quinn::ClientConfig::new(Arc::new(crypto));
    let local: SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let endpoint = quinn::Endpoint::client(local).map_err(|e| connect_err(e.to_string()))?;
    let connecting = match endpoint.connect_with(client_config, addr, SERVER_NAME) {
        Ok(c) => c,
        Err(e) => {
            endpoint.close(0u32.into(), b"done");
            return Err(connect_err(e.to_string()));
        }
    };
    match connecting.await {
        Ok(conn) => Ok((endpoint, conn)),
        Err(e) => {
            endpoint.close(0u32.into(), b"done");
            if let Some(presented) = pinned.mismatch.lock().expect("pinned CA").take() {
                return Err(JoinError::CaMismatch {
                    addr,
                    expected: token::hex(&token.ca_sha256),
                    presented,
                });
            }
            Err(connect_err(e.to_string()))
        }
    }
}

/// Sends `request` on a new stream of `conn` and reads the reply's bytes.
async fn round_trip(
    conn: &quinn::Connection,
    request: &BootstrapRequest,
) -> Result<Vec<u8>, JoinError> {
    let connect_err = |reason: String| JoinError::Connect {
        addr: conn.remote_address().to_string(),
        reason,
    };
    let (mut send, mut recv) = conn
        .open_bi()
        .await
        .map_err(|e| connect_err(e.to_string()))?;
    send.write_all(&encode(request))
        .await
        .map_err(|e| connect_err(e.to_string()))?;
    send.finish().map_err(|e| connect_err(e.to_string()))?;
    let bytes = recv
        .read_to_end(JOIN_MESSAGE_BYTES_MAX)
        .await
        .map_err(|e| JoinError::BadReply {
            reason: e.to_string(),
        })?;
    conn.close(0u32.into(), b"done");
    Ok(bytes)
}

async fn join_inner(
    server: &str,
    token: &JoinToken,
    params: &JoinParams,
) -> Result<Joined, JoinError> {
    let (key_pem, csr_der) = certs::node_key_and_csr(params.node)?;
    let (endpoint, conn) = connect_pinned(server, token).await?;
    let request = BootstrapRequest::Join(JoinRequest {
        version: JOIN_PROTOCOL_VERSION,
        token_id: token.id,
        secret: token.secret,
        node: params.node.0,
        addr: params.addr.to_string(),
        zone: params.zone.clone(),
        csr_der,
    });
    let result = round_trip(&conn, &request).await;
    endpoint.close(0u32.into(), b"done");
    let admission = match decode::<JoinReply>(&result?).map_err(|e| JoinError::BadReply {
        reason: e.to_string(),
    })? {
        JoinReply::Accepted(a) => a,
        JoinReply::Refused(r) => return Err(JoinError::Refused(r)),
    };
    if certs::ca_fingerprint(&admission.ca_pem).ok() != Some(token.ca_sha256) {
        return Err(JoinError::BadReply {
            reason: "the CA certificate it sent is not the token's".into(),
        });
    }
    let identity = NodeIdentity::from_pem(
        PoolId(admission.pool_id),
        params.node,
        &admission.ca_pem,
        &admission.cert_pem,
        &key_pem,
        std::path::Path::new("<join reply>"),
    )
    .map_err(|e| JoinError::BadReply {
        reason: e.to_string(),
    })?;
    match cert_node_id(&identity.chain[0]) {
        Ok(n) if n == params.node => {}
        other => {
            return Err(JoinError::BadReply {
                reason: format!(
                    "the certificate it granted names {other:?}, not {}",
                    params.node
                ),
            });
        }
    }
    if admission.members.len() > JOIN_MEMBERS_MAX {
        return Err(JoinError::BadReply {
            reason: format!("{} members listed", admission.members.len()),
        });
    }
    let members = admission
        .members
        .iter()
        .filter_map(|(id, a)| Some((NodeId(*id), a.parse().ok()?)))
        .collect();
    Ok(Joined {
        identity,
        ca_pem: admission.ca_pem,
        members,
    })
}

/// Removes member `node` from the pool whose bootstrap endpoint is at `server`, with
/// `token` (made with the pool's CA key, so only its holder can): for a host that died
/// for good. The pool refuses a member it sees up unless `force` (stop it with
/// `--leave-on-stop` instead, so its pages move first), the node serving the request and
/// the leader. Resolves once the removal is committed. Must be called inside a tokio
/// runtime.
pub async fn remove(
    server: &str,
    token: &JoinToken,
    node: NodeId,
    force: bool,
) -> Result<(), JoinError> {
    let inner = async {
        let (endpoint, conn) = connect_pinned(server, token).await?;
        let request = BootstrapRequest::Remove(RemoveRequest {
            version: JOIN_PROTOCOL_VERSION,
            token_id: token.id,
            secret: token.secret,
            node: node.0,
            force,
        });
        let result = round_trip(&conn, &request).await;
        endpoint.close(0u32.into(), b"done");
        match decode::<RemoveReply>(&result?).map_err(|e| JoinError::BadReply {
            reason: e.to_string(),
        })? {
            RemoveReply::Removed => Ok(()),
            RemoveReply::Refused(r) => Err(JoinError::RemovalRefused(r)),
        }
    };
    match tokio::time::timeout(JOIN_TIMEOUT, inner).await {
        Ok(r) => r,
        Err(_) => Err(JoinError::Timeout {
            addr: server.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests;
