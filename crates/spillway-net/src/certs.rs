//! The pool's certificate authority and the node certificates it signs, as PEM files in
//! directories. This backs `spillway cluster init`.
//!
//! Two kinds of directory; keys are written with mode 0600, and nothing is overwritten.
//!
//! The CA's directory ([`PoolCa::write`], [`PoolCa::load`]): the operator's, never a
//! node's, because whoever reads the CA key can mint a certificate for any node id.
//!
//! ```text
//! pool_id                 the pool id, 16 hex digits
//! ca.pem, ca.key.pem      the pool's CA certificate and key
//! ```
//!
//! A node's pool directory ([`PoolCa::write_node_dir`]; the node config's `pool_dir`, read
//! by [`NodeIdentity::load`] at start, which warns if a CA key lies there too):
//!
//! ```text
//! pool_id, ca.pem         as above: the CA certificate, to check peers; no CA key
//! node-<id>.pem           node <id>'s certificate, signed by the CA
//! node-<id>.key.pem       node <id>'s key
//! ```
//!
//! [`init_pool`] writes one CA directory and one directory per node. [`init_pool_dir`]
//! writes one directory of the second kind holding several nodes, for nodes that run
//! together (in one process, in tests); it writes no CA key and hands the CA back in
//! memory.
//!
//! Node identity: every node certificate is valid for both TLS roles (each node connects
//! and serves) and carries two DNS names (subject alternative names): [`SERVER_NAME`],
//! which every client checks (any pool member may serve any address), and
//! `node-<id>.spillway` ([`node_dns_name`]: the id in decimal, no leading zeros), which
//! names the node. A certificate names exactly one node; [`cert_node_id`] reads it. The
//! transport knows a peer by the node its certificate names, and refuses a hello that
//! names another (`quic`), so a holder of one node's certificate cannot act as another
//! node.
//!
//! Keys are ECDSA P-256. Validity runs from 2025 to 2125: the pool's CA is the trust root
//! of a closed deployment, and rotation (a new CA, nodes re-issued) is an explicit act.
//! Revocation is not supported yet: remove a node by rotating the CA.
//!
//! Joining without a shared disk ([`crate::join`]): a new host makes its key and a
//! signing request locally ([`node_key_and_csr`]); the CA's holder signs only the request's
//! public key ([`PoolCa::sign_node_csr`]), so no private key ever leaves its host. The
//! host checks the CA by its SHA-256 fingerprint ([`ca_fingerprint`]), which its join
//! token carries.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use spillway_types::{NodeId, PoolId};

/// The TLS server name every node's certificate carries and every client checks.
pub const SERVER_NAME: &str = "spillway-node";

/// The CA key's file in the CA's directory; never in a node's.
const CA_KEY_FILE: &str = "ca.key.pem";

/// The DNS name by which node `node`'s certificate names it: `node-<id>.spillway`.
pub fn node_dns_name(node: NodeId) -> String {
    format!("node-{}.spillway", node.0)
}

/// Why a certificate names no node (see [`cert_node_id`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CertIdError {
    /// The peer presented no certificate.
    #[error("no certificate")]
    NoCertificate,
    /// The certificate is not DER X.509 (TLS accepted it, so this is not expected).
    #[error("the certificate cannot be parsed: {reason}")]
    Unparsable {
        /// The parser's error.
        reason: String,
    },
    /// No DNS name of the form `node-<id>.spillway`.
    #[error("the certificate names no node (no DNS name node-<id>.spillway)")]
    NoNodeName,
    /// A DNS name `node-….spillway` whose id is not a canonical decimal number.
    #[error("the certificate's DNS name {name:?} has no decimal node id")]
    BadNodeName {
        /// The name.
        name: String,
    },
    /// Two different node names.
    #[error("the certificate names two nodes, {first} and {second}")]
    SeveralNodes {
        /// The first named.
        first: NodeId,
        /// Another one.
        second: NodeId,
    },
}

/// The node a certificate names: its one DNS name `node-<id>.spillway` (compared without
/// regard to case, as DNS names are). Only parses: the caller has checked the certificate
/// against the pool's CA (TLS does). Never panics, whatever the bytes.
pub fn cert_node_id(cert: &CertificateDer<'_>) -> Result<NodeId, CertIdError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).map_err(|e| {
        CertIdError::Unparsable {
            reason: e.to_string(),
        }
    })?;
    let san = parsed
        .subject_alternative_name()
        .map_err(|e| CertIdError::Unparsable {
            reason: e.to_string(),
        })?
        .ok_or(CertIdError::NoNodeName)?;
    let mut found: Option<NodeId> = None;
    for name in &san.value.general_names {
        let x509_parser::extensions::GeneralName::DNSName(name) = name else {
            continue;
        };
        let lower = name.to_ascii_lowercase();
        let Some(digits) = lower
            .strip_prefix("node-")
            .and_then(|rest| rest.strip_suffix(".spillway"))
        else {
            continue;
        };
        let id = digits
            .parse::<u64>()
            .ok()
            .filter(|id| id.to_string() == digits)
            .map(NodeId)
            .ok_or_else(|| CertIdError::BadNodeName {
                name: name.to_string(),
            })?;
        match found {
            Some(first) if first != id => {
                return Err(CertIdError::SeveralNodes { first, second: id });
            }
            _ => found = Some(id),
        }
    }
    found.ok_or(CertIdError::NoNodeName)
}

/// Certificates could not be made, written or read.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen failed to build or sign a certificate.
    #[error("cannot make the {what}: {source}")]
    Generate {
        /// Which certificate.
        what: String,
        /// rcgen's error.
        #[source]
        source: rcgen::Error,
    },
    /// A file could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A file does not hold what it should.
    #[error("{path}: {problem}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A file that `init` would write already exists (it never overwrites a CA).
    #[error("{path} already exists: refusing to overwrite a pool's certificates")]
    Exists {
        /// The file.
        path: PathBuf,
    },
    /// rustls refused the certificates or keys.
    #[error("TLS configuration: {reason}")]
    Tls {
        /// rustls's error.
        reason: String,
    },
}

/// The pool's certificate authority: signs node certificates.
pub struct PoolCa {
    pool_id: PoolId,
    params: CertificateParams,
    key: KeyPair,
    cert_pem: String,
}

impl std::fmt::Debug for PoolCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolCa")
            .field("pool_id", &self.pool_id)
            .finish_non_exhaustive()
    }
}

fn generate_err(what: impl Into<String>) -> impl FnOnce(rcgen::Error) -> CertError {
    let what = what.into();
    move |source| CertError::Generate { what, source }
}

/// The CA's parameters for `pool_id`. Deterministic, so the CA's issuer identity (its
/// name and key usages) can be rebuilt from the pool id and the key alone when the CA is
/// loaded to sign more nodes.
fn ca_params(pool_id: PoolId) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, "Spillway");
    name.push(DnType::CommonName, format!("Spillway {pool_id} CA"));
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = rcgen::date_time_ymd(2025, 1, 1);
    params.not_after = rcgen::date_time_ymd(2125, 1, 1);
    params
}

impl PoolCa {
    /// A new CA for `pool_id`, with a fresh key.
    pub fn generate(pool_id: PoolId) -> Result<PoolCa, CertError> {
        let key = KeyPair::generate().map_err(generate_err("pool CA key"))?;
        let params = ca_params(pool_id);
        let cert = params
            .self_signed(&key)
            .map_err(generate_err("pool CA certificate"))?;
        Ok(PoolCa {
            pool_id,
            params,
            key,
            cert_pem: cert.pem(),
        })
    }

    /// The pool this CA belongs to.
    pub fn pool_id(&self) -> PoolId {
        self.pool_id
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The parameters of node `node`'s certificate: both TLS roles, the names
    /// [`SERVER_NAME`] and [`node_dns_name`], valid 2025 to 2125.
    fn node_params(&self, node: NodeId) -> Result<CertificateParams, CertError> {
        let what = format!("certificate of {node}");
        let mut params = CertificateParams::new(vec![SERVER_NAME.to_string(), node_dns_name(node)])
            .map_err(generate_err(what))?;
        let mut name = DistinguishedName::new();
        name.push(DnType::OrganizationName, "Spillway");
        name.push(DnType::CommonName, format!("{} {node}", self.pool_id));
        params.distinguished_name = name;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.not_before = rcgen::date_time_ymd(2025, 1, 1);
        params.not_after = rcgen::date_time_ymd(2125, 1, 1);
        Ok(params)
    }

    /// A certificate and key for `node`, signed by this CA.
    pub fn issue_node(&self, node: NodeId) -> Result<NodeIdentity, CertError> {
        let what = format!("certificate of {node}");
        let key = KeyPair::generate().map_err(generate_err(what.clone()))?;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = self
            .node_params(node)?
            .signed_by(&key, &issuer)
            .map_err(generate_err(what))?;
        NodeIdentity::from_pem(
            self.pool_id,
            node,
            &self.cert_pem,
            &cert.pem(),
            &key.serialize_pem(),
            Path::new("<generated>"),
        )
    }

    /// Node `node`'s certificate (PEM) for the public key of a certificate signing
    /// request (DER, PKCS #10, as [`node_key_and_csr`] makes), signed by this CA. The
    /// request's signature is checked (its sender holds the key); everything else it asks
    /// for (names, usages, validity) is ignored: the certificate is exactly what
    /// [`PoolCa::issue_node`] would issue, naming `node` only. Never panics, whatever the
    /// bytes.
    pub fn sign_node_csr(&self, node: NodeId, csr_der: &[u8]) -> Result<String, CsrError> {
        let csr = rcgen::CertificateSigningRequestParams::from_der(
            &rustls::pki_types::CertificateSigningRequestDer::from(csr_der),
        )
        .map_err(|e| CsrError::Invalid {
            reason: e.to_string(),
        })?;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = self
            .node_params(node)
            .map_err(|e| CsrError::Sign {
                reason: e.to_string(),
            })?
            .signed_by(&csr.public_key, &issuer)
            .map_err(|e| CsrError::Sign {
                reason: e.to_string(),
            })?;
        Ok(cert.pem())
    }

    /// SHA-256 of the CA certificate's DER: what a join token pins ([`ca_fingerprint`]).
    pub fn fingerprint(&self) -> Result<[u8; 32], CertError> {
        ca_fingerprint(&self.cert_pem)
    }

    /// Writes the CA's directory (`pool_id`, `ca.pem` and `ca.key.pem`) into `dir`
    /// (created if missing): the operator's directory, never a node's. Refuses to
    /// overwrite existing files.
    pub fn write(&self, dir: &Path) -> Result<(), CertError> {
        self.write_public(dir)?;
        write_new(
            &dir.join(CA_KEY_FILE),
            self.key.serialize_pem().as_bytes(),
            true,
        )
    }

    /// Writes `pool_id` and `ca.pem` (no key) into `dir`, created if missing.
    fn write_public(&self, dir: &Path) -> Result<(), CertError> {
        write_pool_public(dir, self.pool_id, &self.cert_pem)
    }

    /// Issues node `node`'s certificate and writes its pool directory into `dir` (created
    /// if missing): `pool_id`, `ca.pem`, `node-<id>.pem`, `node-<id>.key.pem`, and never
    /// the CA key. Refuses to overwrite; checks every file before writing any.
    pub fn write_node_dir(&self, node: NodeId, dir: &Path) -> Result<NodeIdentity, CertError> {
        let identity = self.issue_node(node)?;
        refuse_existing(node_dir_files(dir, node))?;
        self.write_public(dir)?;
        identity.write(dir)?;
        Ok(identity)
    }

    /// Reads the CA written by [`PoolCa::write`], to sign more nodes.
    pub fn load(dir: &Path) -> Result<PoolCa, CertError> {
        let pool_id = read_pool_id(dir)?;
        let cert_pem = read_string(&dir.join("ca.pem"))?;
        let key_path = dir.join(CA_KEY_FILE);
        let key = KeyPair::from_pem(&read_string(&key_path)?).map_err(|e| CertError::Invalid {
            path: key_path,
            problem: e.to_string(),
        })?;
        Ok(PoolCa {
            pool_id,
            params: ca_params(pool_id),
            key,
            cert_pem,
        })
    }
}

/// What one node needs for mutual TLS: the pool's CA certificate (to check peers), its own
/// certificate chain and key, and who it is.
#[derive(Debug)]
pub struct NodeIdentity {
    /// The pool.
    pub pool_id: PoolId,
    /// This node.
    pub node_id: NodeId,
    pub(crate) ca: CertificateDer<'static>,
    pub(crate) chain: Vec<CertificateDer<'static>>,
    pub(crate) key: PrivateKeyDer<'static>,
    cert_pem: String,
    key_pem: String,
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        NodeIdentity {
            pool_id: self.pool_id,
            node_id: self.node_id,
            ca: self.ca.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            cert_pem: self.cert_pem.clone(),
            key_pem: self.key_pem.clone(),
        }
    }
}

fn node_file(dir: &Path, node: NodeId, suffix: &str) -> PathBuf {
    dir.join(format!("node-{}{suffix}", node.0))
}

impl NodeIdentity {
    /// An identity from PEM text: the CA certificate that peers must be signed by, this
    /// node's certificate (chain) and key. `origin` names where they came from, for errors.
    /// Does not check that the certificate names `node_id` ([`NodeIdentity::load`] does,
    /// and so does every peer).
    pub fn from_pem(
        pool_id: PoolId,
        node_id: NodeId,
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
        origin: &Path,
    ) -> Result<NodeIdentity, CertError> {
        let invalid = |problem: String| CertError::Invalid {
            path: origin.to_path_buf(),
            problem,
        };
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes())
            .map_err(|e| invalid(format!("CA certificate: {e}")))?;
        let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(format!("node certificate: {e}")))?;
        if chain.is_empty() {
            return Err(invalid("no node certificate".to_string()));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| invalid(format!("node key: {e}")))?;
        Ok(NodeIdentity {
            pool_id,
            node_id,
            ca,
            chain,
            key,
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
        })
    }

    /// This node's certificate (chain), PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// This node's private key, PEM.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Writes `node-<id>.pem` and `node-<id>.key.pem` into `dir` (created if missing).
    /// Refuses to overwrite.
    pub fn write(&self, dir: &Path) -> Result<(), CertError> {
        fs::create_dir_all(dir).map_err(|source| CertError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        write_new(
            &node_file(dir, self.node_id, ".pem"),
            self.cert_pem.as_bytes(),
            false,
        )?;
        write_new(
            &node_file(dir, self.node_id, ".key.pem"),
            self.key_pem.as_bytes(),
            true,
        )
    }

    /// Reads node `node`'s identity from its pool directory (`pool_id`, `ca.pem`,
    /// `node-<id>.pem`, `node-<id>.key.pem`), and checks that the certificate names
    /// `node` (peers would refuse it otherwise). The CA key is not needed, and a warning
    /// is logged if it lies in `dir`.
    pub fn load(dir: &Path, node: NodeId) -> Result<NodeIdentity, CertError> {
        let pool_id = read_pool_id(dir)?;
        let ca_pem = read_string(&dir.join("ca.pem"))?;
        let cert_path = node_file(dir, node, ".pem");
        let cert_pem = read_string(&cert_path)?;
        let key_pem = read_string(&node_file(dir, node, ".key.pem"))?;
        let identity =
            NodeIdentity::from_pem(pool_id, node, &ca_pem, &cert_pem, &key_pem, &cert_path)?;
        match cert_node_id(&identity.chain[0]) {
            Ok(named) if named == node => {}
            Ok(named) => {
                return Err(CertError::Invalid {
                    path: cert_path,
                    problem: format!("the certificate is {named}'s, not {node}'s"),
                });
            }
            Err(e) => {
                return Err(CertError::Invalid {
                    path: cert_path,
                    problem: e.to_string(),
                });
            }
        }
        let ca_key = dir.join(CA_KEY_FILE);
        if ca_key.exists() {
            tracing::warn!(
                path = %ca_key.display(),
                "the pool's CA key lies in a node's pool directory: whoever reads it can mint \
                 a certificate for any node; keep it in the operator's directory only"
            );
        }
        Ok(identity)
    }
}

/// Why a certificate signing request was not signed (see [`PoolCa::sign_node_csr`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CsrError {
    /// Not a PKCS #10 request, an unsupported extension, or its signature does not verify.
    #[error("the certificate signing request is invalid: {reason}")]
    Invalid {
        /// rcgen's words.
        reason: String,
    },
    /// The certificate could not be made.
    #[error("cannot sign the certificate: {reason}")]
    Sign {
        /// rcgen's words.
        reason: String,
    },
}

/// A fresh key pair for node `node` and a certificate signing request for it (DER): what a
/// joining host makes locally, so that its private key never leaves it. Returns the key
/// as PEM.
pub fn node_key_and_csr(node: NodeId) -> Result<(String, Vec<u8>), CertError> {
    let what = format!("signing request of {node}");
    let key = KeyPair::generate().map_err(generate_err(what.clone()))?;
    let params = CertificateParams::new(vec![SERVER_NAME.to_string(), node_dns_name(node)])
        .map_err(generate_err(what.clone()))?;
    let csr = params.serialize_request(&key).map_err(generate_err(what))?;
    Ok((key.serialize_pem(), csr.der().to_vec()))
}

/// SHA-256 of the DER of the (first) certificate in `ca_pem`: the CA fingerprint a join
/// token carries and a joining host pins the bootstrap connection to.
pub fn ca_fingerprint(ca_pem: &str) -> Result<[u8; 32], CertError> {
    let der =
        CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(|e| CertError::Invalid {
            path: PathBuf::from("<CA certificate>"),
            problem: e.to_string(),
        })?;
    Ok(sha256(der.as_ref()))
}

/// SHA-256 of `bytes`.
pub(crate) fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// Writes `pool_id` and `ca.pem` (no key) into a node's pool directory `dir`, from what a
/// joining host received; refuses to overwrite.
pub fn write_pool_public(dir: &Path, pool_id: PoolId, ca_pem: &str) -> Result<(), CertError> {
    fs::create_dir_all(dir).map_err(|source| CertError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    write_new(
        &dir.join("pool_id"),
        format!("{:016x}\n", pool_id.0).as_bytes(),
        false,
    )?;
    write_new(&dir.join("ca.pem"), ca_pem.as_bytes(), false)
}

/// The files [`PoolCa::write_node_dir`] writes.
fn node_dir_files(dir: &Path, node: NodeId) -> [PathBuf; 4] {
    [
        dir.join("pool_id"),
        dir.join("ca.pem"),
        node_file(dir, node, ".pem"),
        node_file(dir, node, ".key.pem"),
    ]
}

/// [`CertError::Exists`] for the first of `paths` that exists.
fn refuse_existing(paths: impl IntoIterator<Item = PathBuf>) -> Result<(), CertError> {
    match paths.into_iter().find(|p| p.exists()) {
        Some(path) => Err(CertError::Exists { path }),
        None => Ok(()),
    }
}

/// Lays out a pool for nodes that run apart: a new CA for `pool_id` in `ca_dir` (with its
/// key), and for each `(node, dir)` of `nodes` the node's pool directory in `dir` (see
/// [`PoolCa::write_node_dir`]; no CA key). What `spillway cluster init` does. Checks every
/// file before writing any, and fails without writing over existing files.
pub fn init_pool(
    ca_dir: &Path,
    pool_id: PoolId,
    nodes: &[(NodeId, PathBuf)],
) -> Result<PoolCa, CertError> {
    let ca = PoolCa::generate(pool_id)?;
    let identities = nodes
        .iter()
        .map(|(n, _)| ca.issue_node(*n))
        .collect::<Result<Vec<_>, _>>()?;
    refuse_existing(
        ["pool_id", "ca.pem", CA_KEY_FILE]
            .iter()
            .map(|f| ca_dir.join(f))
            .chain(nodes.iter().flat_map(|(n, d)| node_dir_files(d, *n))),
    )?;
    ca.write(ca_dir)?;
    for ((_, dir), identity) in nodes.iter().zip(&identities) {
        ca.write_public(dir)?;
        identity.write(dir)?;
    }
    Ok(ca)
}

/// Creates one pool directory shared by `nodes`, for nodes that run together (in one
/// process, in tests): a new CA for `pool_id`, `pool_id`, `ca.pem` and each node's
/// certificate and key. The CA key is not written: the CA comes back in memory (to issue
/// more nodes; [`PoolCa::write`] keeps it, in another directory). Fails without writing
/// anything over existing files.
pub fn init_pool_dir(dir: &Path, pool_id: PoolId, nodes: &[NodeId]) -> Result<PoolCa, CertError> {
    let ca = PoolCa::generate(pool_id)?;
    let identities = nodes
        .iter()
        .map(|n| ca.issue_node(*n))
        .collect::<Result<Vec<_>, _>>()?;
    refuse_existing(
        ["pool_id", "ca.pem"].iter().map(|f| dir.join(f)).chain(
            nodes
                .iter()
                .flat_map(|n| [node_file(dir, *n, ".pem"), node_file(dir, *n, ".key.pem")]),
        ),
    )?;
    ca.write_public(dir)?;
    for id in &identities {
        id.write(dir)?;
    }
    Ok(ca)
}

fn read_string(path: &Path) -> Result<String, CertError> {
    fs::read_to_string(path).map_err(|source| CertError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_pool_id(dir: &Path) -> Result<PoolId, CertError> {
    let path = dir.join("pool_id");
    let text = read_string(&path)?;
    u64::from_str_radix(text.trim(), 16)
        .map(PoolId)
        .map_err(|e| CertError::Invalid {
            path,
            problem: format!("pool id {:?} is not hex: {e}", text.trim()),
        })
}

/// Writes a new file; `secret` files get mode 0600 from creation on (never readable by
/// others, not even briefly).
fn write_new(path: &Path, contents: &[u8], secret: bool) -> Result<(), CertError> {
    let io_err = |source| CertError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(if secret { 0o600 } else { 0o644 });
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut file = options.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            CertError::Exists {
                path: path.to_path_buf(),
            }
        } else {
            io_err(e)
        }
    })?;
    file.write_all(contents).map_err(io_err)?;
    file.sync_all().map_err(io_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        crate::test_dirs::temp_dir("certs", name)
    }

    #[cfg(unix)]
    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    fn file_names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn init_pool_dir_writes_nodes_that_load_back_and_no_ca_key() {
        let dir = temp_dir("init");
        let nodes = [NodeId(1), NodeId(2)];
        let ca = init_pool_dir(&dir, PoolId(0xabc), &nodes).unwrap();
        for n in nodes {
            let id = NodeIdentity::load(&dir, n).unwrap();
            assert_eq!(id.pool_id, PoolId(0xabc));
            assert_eq!(id.node_id, n);
            assert_eq!(id.chain.len(), 1);
        }
        assert!(!dir.join(CA_KEY_FILE).exists());
        #[cfg(unix)]
        assert_eq!(mode(&dir.join("node-1.key.pem")), 0o600);
        // A second init never overwrites.
        assert!(matches!(
            init_pool_dir(&dir, PoolId(1), &nodes),
            Err(CertError::Exists { .. })
        ));
        // The CA, kept in memory, signs new nodes.
        ca.issue_node(NodeId(3)).unwrap().write(&dir).unwrap();
        NodeIdentity::load(&dir, NodeId(3)).unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn init_pool_keeps_the_ca_key_out_of_every_node_dir() {
        let root = temp_dir("init-pool");
        let ca_dir = root.join("ca");
        let node_dir = |n: u64| root.join(format!("node-{n}"));
        let nodes: Vec<(NodeId, PathBuf)> = (1..=2).map(|n| (NodeId(n), node_dir(n))).collect();
        init_pool(&ca_dir, PoolId(0xabc), &nodes).unwrap();
        assert_eq!(file_names(&ca_dir), ["ca.key.pem", "ca.pem", "pool_id"]);
        #[cfg(unix)]
        assert_eq!(mode(&ca_dir.join(CA_KEY_FILE)), 0o600);
        for (n, dir) in &nodes {
            let k = n.0;
            assert_eq!(
                file_names(dir),
                [
                    "ca.pem".to_string(),
                    format!("node-{k}.key.pem"),
                    format!("node-{k}.pem"),
                    "pool_id".to_string()
                ]
            );
            #[cfg(unix)]
            assert_eq!(mode(&dir.join(format!("node-{k}.key.pem"))), 0o600);
            let id = NodeIdentity::load(dir, *n).unwrap();
            assert_eq!((id.pool_id, id.node_id), (PoolId(0xabc), *n));
        }
        // A second init writes nothing, not even where nothing was.
        let more = [nodes.clone(), vec![(NodeId(4), node_dir(4))]].concat();
        assert!(matches!(
            init_pool(&ca_dir, PoolId(1), &more),
            Err(CertError::Exists { .. })
        ));
        assert!(!node_dir(4).exists());
        // The operator's CA loads back and lays out another node's directory.
        let ca = PoolCa::load(&ca_dir).unwrap();
        assert_eq!(ca.pool_id(), PoolId(0xabc));
        let three = ca.write_node_dir(NodeId(3), &node_dir(3)).unwrap();
        assert_eq!(cert_node_id(&three.chain[0]), Ok(NodeId(3)));
        assert!(!node_dir(3).join(CA_KEY_FILE).exists());
        NodeIdentity::load(&node_dir(3), NodeId(3)).unwrap();
        assert!(matches!(
            ca.write_node_dir(NodeId(3), &node_dir(3)),
            Err(CertError::Exists { .. })
        ));
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn load_refuses_a_certificate_of_another_node() {
        let dir = temp_dir("swapped");
        init_pool_dir(&dir, PoolId(5), &[NodeId(2), NodeId(3)]).unwrap();
        // Node 3's certificate and key under node 2's names.
        for suffix in [".pem", ".key.pem"] {
            fs::remove_file(node_file(&dir, NodeId(2), suffix)).unwrap();
            fs::copy(
                node_file(&dir, NodeId(3), suffix),
                node_file(&dir, NodeId(2), suffix),
            )
            .unwrap();
        }
        let e = NodeIdentity::load(&dir, NodeId(2)).unwrap_err();
        match &e {
            CertError::Invalid { path, problem } => {
                assert!(path.ends_with("node-2.pem"), "{e}");
                assert!(problem.contains("node#3"), "{e}");
            }
            other => panic!("{other}"),
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    fn self_signed(names: &[&str]) -> CertificateDer<'static> {
        let names = names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        rcgen::generate_simple_self_signed(names)
            .unwrap()
            .cert
            .der()
            .clone()
    }

    #[test]
    fn a_certificate_names_exactly_one_node() {
        let ca = PoolCa::generate(PoolId(9)).unwrap();
        let issued = ca.issue_node(NodeId(4095)).unwrap();
        assert_eq!(cert_node_id(&issued.chain[0]), Ok(NodeId(4095)));
        assert_eq!(
            cert_node_id(&self_signed(&[
                SERVER_NAME,
                "NODE-5.Spillway",
                "node-5.spillway"
            ])),
            Ok(NodeId(5))
        );
        assert_eq!(
            cert_node_id(&self_signed(&[SERVER_NAME])),
            Err(CertIdError::NoNodeName)
        );
        assert_eq!(
            cert_node_id(&self_signed(&["node-.spillway.example"])),
            Err(CertIdError::NoNodeName)
        );
        for bad in [
            "node-02.spillway",
            "node-+2.spillway",
            "node-x.spillway",
            "node-.spillway",
        ] {
            assert_eq!(
                cert_node_id(&self_signed(&[bad])),
                Err(CertIdError::BadNodeName {
                    name: bad.to_string()
                }),
                "{bad}"
            );
        }
        assert_eq!(
            cert_node_id(&self_signed(&["node-1.spillway", "node-2.spillway"])),
            Err(CertIdError::SeveralNodes {
                first: NodeId(1),
                second: NodeId(2)
            })
        );
        // Garbage is an error, never a panic.
        for junk in [&b""[..], b"\x30", b"\x30\x82\xff\xff", &[0xa5; 300]] {
            assert!(matches!(
                cert_node_id(&CertificateDer::from(junk.to_vec())),
                Err(CertIdError::Unparsable { .. })
            ));
        }
    }

    #[test]
    fn missing_and_bad_files_name_the_file() {
        let dir = temp_dir("bad");
        fs::create_dir_all(&dir).unwrap();
        let e = NodeIdentity::load(&dir, NodeId(1)).unwrap_err();
        assert!(e.to_string().contains("pool_id"), "{e}");
        fs::write(dir.join("pool_id"), "zz\n").unwrap();
        let e = NodeIdentity::load(&dir, NodeId(1)).unwrap_err();
        assert!(matches!(e, CertError::Invalid { .. }), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
