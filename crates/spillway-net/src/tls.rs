//! The TLS of peer connections, and who a peer is: mutual TLS 1.3 whose certificates
//! are checked against the pool's CA, and the node a connection's certificate names (its
//! `node-<id>.spillway` name, see [`crate::certs`]), which a hello must match.

use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use spillway_types::NodeId;

use crate::certs::{CertError, CertIdError, NodeIdentity, cert_node_id};
use crate::quic::ALPN;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(crate) fn tls_err(e: impl std::fmt::Display) -> CertError {
    CertError::Tls {
        reason: e.to_string(),
    }
}

fn roots(identity: &NodeIdentity) -> Result<Arc<RootCertStore>, CertError> {
    let mut roots = RootCertStore::empty();
    roots.add(identity.ca.clone()).map_err(tls_err)?;
    Ok(Arc::new(roots))
}

/// The server's TLS: our node certificate, and client certificates required and checked
/// against the pool's CA.
pub(crate) fn server_tls(identity: &NodeIdentity) -> Result<rustls::ServerConfig, CertError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(identity)?, provider())
        .build()
        .map_err(tls_err)?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.chain.clone(), identity.key.clone_key())
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    Ok(tls)
}

/// The client's TLS: the server checked against the pool's CA, our node certificate
/// presented.
pub(crate) fn client_tls(identity: &NodeIdentity) -> Result<rustls::ClientConfig, CertError> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_root_certificates(roots(identity)?)
        .with_client_auth_cert(identity.chain.clone(), identity.key.clone_key())
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    Ok(tls)
}

/// The node `conn`'s peer certificate names (its end-entity certificate; TLS has checked
/// the chain against the pool's CA).
pub(crate) fn peer_node_id(conn: &quinn::Connection) -> Result<NodeId, CertIdError> {
    let certs = conn
        .peer_identity()
        .and_then(|any| {
            any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .ok_or(CertIdError::NoCertificate)?;
    cert_node_id(certs.first().ok_or(CertIdError::NoCertificate)?)
}

/// A certificate's node for logs: its id, or why it has none.
pub(crate) fn certified_name(certified: &Result<NodeId, CertIdError>) -> String {
    match certified {
        Ok(node) => node.to_string(),
        Err(e) => format!("none ({e})"),
    }
}
