//! The pool's certificate authority and the node certificates it signs, as PEM files in a
//! directory. This backs `spillway cluster init`.
//!
//! Layout of a pool directory (keys are written with mode 0600):
//!
//! ```text
//! pool_id                 the pool id, 16 hex digits
//! ca.pem, ca.key.pem      the pool's CA certificate and key (the key signs new nodes;
//!                         keep it off the nodes if you can)
//! node-<id>.pem           node <id>'s certificate, signed by the CA
//! node-<id>.key.pem       node <id>'s key
//! ```
//!
//! Every node certificate is valid for both TLS roles (each node connects and serves) and
//! carries two DNS names: [`SERVER_NAME`], which every client checks (any pool member may
//! serve any address), and `node-<id>.spillway`, which names the node.
//!
//! Keys are ECDSA P-256. Validity runs from 2025 to 2125: the pool's CA is the trust root
//! of a closed deployment, and rotation (a new CA, nodes re-issued) is an explicit act.
//! Revocation is not supported yet: remove a node by rotating the CA.

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

    /// A certificate and key for `node`, signed by this CA.
    pub fn issue_node(&self, node: NodeId) -> Result<NodeIdentity, CertError> {
        let what = format!("certificate of {node}");
        let key = KeyPair::generate().map_err(generate_err(what.clone()))?;
        let mut params = CertificateParams::new(vec![
            SERVER_NAME.to_string(),
            format!("node-{}.spillway", node.0),
        ])
        .map_err(generate_err(what.clone()))?;
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
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params
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

    /// Writes `pool_id`, `ca.pem` and `ca.key.pem` into `dir` (created if missing).
    /// Refuses to overwrite existing files.
    pub fn write(&self, dir: &Path) -> Result<(), CertError> {
        fs::create_dir_all(dir).map_err(|source| CertError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        write_new(
            &dir.join("pool_id"),
            format!("{:016x}\n", self.pool_id.0).as_bytes(),
            false,
        )?;
        write_new(&dir.join("ca.pem"), self.cert_pem.as_bytes(), false)?;
        write_new(
            &dir.join("ca.key.pem"),
            self.key.serialize_pem().as_bytes(),
            true,
        )
    }

    /// Reads the CA written by [`PoolCa::write`], to sign more nodes.
    pub fn load(dir: &Path) -> Result<PoolCa, CertError> {
        let pool_id = read_pool_id(dir)?;
        let cert_pem = read_string(&dir.join("ca.pem"))?;
        let key_path = dir.join("ca.key.pem");
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

    /// Reads node `node`'s identity from a pool directory (`pool_id`, `ca.pem`,
    /// `node-<id>.pem`, `node-<id>.key.pem`). The CA key is not needed.
    pub fn load(dir: &Path, node: NodeId) -> Result<NodeIdentity, CertError> {
        let pool_id = read_pool_id(dir)?;
        let ca_pem = read_string(&dir.join("ca.pem"))?;
        let cert_path = node_file(dir, node, ".pem");
        let cert_pem = read_string(&cert_path)?;
        let key_pem = read_string(&node_file(dir, node, ".key.pem"))?;
        NodeIdentity::from_pem(pool_id, node, &ca_pem, &cert_pem, &key_pem, &cert_path)
    }
}

/// Creates a pool directory: a new CA for `pool_id` and a certificate for each of `nodes`.
/// What `spillway cluster init` does. Fails without writing anything over existing files.
pub fn init_pool_dir(dir: &Path, pool_id: PoolId, nodes: &[NodeId]) -> Result<PoolCa, CertError> {
    let ca = PoolCa::generate(pool_id)?;
    let identities = nodes
        .iter()
        .map(|n| ca.issue_node(*n))
        .collect::<Result<Vec<_>, _>>()?;
    for path in ["pool_id", "ca.pem", "ca.key.pem"]
        .iter()
        .map(|f| dir.join(f))
        .chain(
            nodes
                .iter()
                .flat_map(|n| [node_file(dir, *n, ".pem"), node_file(dir, *n, ".key.pem")]),
        )
    {
        if path.exists() {
            return Err(CertError::Exists { path });
        }
    }
    ca.write(dir)?;
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
        let dir = std::env::temp_dir().join(format!(
            "spillway-certs-{name}-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn init_writes_a_pool_that_loads_back() {
        let dir = temp_dir("init");
        let nodes = [NodeId(1), NodeId(2)];
        init_pool_dir(&dir, PoolId(0xabc), &nodes).unwrap();
        for n in nodes {
            let id = NodeIdentity::load(&dir, n).unwrap();
            assert_eq!(id.pool_id, PoolId(0xabc));
            assert_eq!(id.node_id, n);
            assert_eq!(id.chain.len(), 1);
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            for f in ["ca.key.pem", "node-1.key.pem"] {
                let mode = fs::metadata(dir.join(f)).unwrap().permissions().mode();
                assert_eq!(mode & 0o777, 0o600, "{f}");
            }
        }
        // A second init never overwrites the CA.
        assert!(matches!(
            init_pool_dir(&dir, PoolId(1), &nodes),
            Err(CertError::Exists { .. })
        ));
        // The CA loads back and signs new nodes.
        let ca = PoolCa::load(&dir).unwrap();
        assert_eq!(ca.pool_id(), PoolId(0xabc));
        ca.issue_node(NodeId(3)).unwrap().write(&dir).unwrap();
        NodeIdentity::load(&dir, NodeId(3)).unwrap();
        fs::remove_dir_all(&dir).unwrap();
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
