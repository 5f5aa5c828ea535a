use std::path::PathBuf;

use super::*;
use crate::certs::PoolCa;

fn temp_dir(name: &str) -> PathBuf {
    crate::test_dirs::temp_dir("join", name)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A handler as a CA-holding node would be, without the metadata group: tokens from a
/// store, certificates from the CA, node 1 taken.
struct CaHandler {
    ca: PoolCa,
    tokens: TokenStore,
}

impl JoinHandler for CaHandler {
    async fn admit(&self, r: JoinRequest) -> JoinReply {
        let refuse = JoinReply::Refused;
        if let Err(e) = self.tokens.check(r.token_id, &r.secret, now_ms()) {
            return refuse(e);
        }
        if r.node == 1 {
            return refuse(JoinRefusal::NodeTaken { node: 1 });
        }
        if let Err(e) = self.tokens.consume(r.token_id, &r.secret, now_ms()) {
            return refuse(e);
        }
        match self.ca.sign_node_csr(NodeId(r.node), &r.csr_der) {
            Ok(cert_pem) => JoinReply::Accepted(Admission {
                pool_id: self.ca.pool_id().0,
                ca_pem: self.ca.cert_pem().to_string(),
                cert_pem,
                members: vec![(1, "127.0.0.1:7001".into())],
            }),
            Err(e) => refuse(JoinRefusal::BadCsr {
                reason: e.to_string(),
            }),
        }
    }

    async fn remove(&self, r: RemoveRequest) -> RemoveReply {
        if let Err(e) = self.tokens.consume(r.token_id, &r.secret, now_ms()) {
            return RemoveReply::Refused(e);
        }
        match r.node {
            1 => RemoveReply::Refused(JoinRefusal::Busy {
                node: 1,
                role: "serves joins".into(),
            }),
            2 if !r.force => RemoveReply::Refused(JoinRefusal::NodeUp { node: 2 }),
            2 | 3 => RemoveReply::Removed,
            node => RemoveReply::Refused(JoinRefusal::NotAMember { node }),
        }
    }
}

fn params(node: u64) -> JoinParams {
    JoinParams {
        node: NodeId(node),
        addr: "127.0.0.1:7009".parse().unwrap(),
        zone: None,
    }
}

#[tokio::test]
async fn a_token_joins_once_and_only_the_pinned_ca_is_trusted() {
    let dir = temp_dir("flow");
    let ca = PoolCa::generate(PoolId(0x77)).unwrap();
    ca.write(&dir).unwrap();
    let server_identity = ca.issue_node(NodeId(1)).unwrap();
    let tokens = TokenStore::in_ca_dir(&dir);
    let fingerprint = ca.fingerprint().unwrap();
    let (token, _) = tokens
        .create(fingerprint, Duration::from_secs(60), now_ms())
        .unwrap();
    let server = BootstrapServer::start(
        "127.0.0.1:0".parse().unwrap(),
        &server_identity,
        Arc::new(CaHandler {
            ca: PoolCa::load(&dir).unwrap(),
            tokens: tokens.clone(),
        }),
    )
    .unwrap();
    let at = server.local_addr().to_string();

    // A token whose fingerprint is another CA's: refused before the secret is sent.
    let other = PoolCa::generate(PoolId(0x78)).unwrap();
    let mut wrong_ca = token.clone();
    wrong_ca.ca_sha256 = other.fingerprint().unwrap();
    match join(&at, &wrong_ca, &params(5)).await {
        Err(JoinError::CaMismatch {
            expected,
            presented,
            ..
        }) => {
            assert_eq!(expected, token::hex(&wrong_ca.ca_sha256));
            assert!(
                presented.contains(&token::hex(&fingerprint)),
                "{presented:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // The token is still good after that: the server never saw it.
    tokens.check(token.id, &token.secret, now_ms()).unwrap();

    // A taken node id is refused and the token stays good.
    match join(&at, &token, &params(1)).await {
        Err(JoinError::Refused(JoinRefusal::NodeTaken { node: 1 })) => {}
        other => panic!("{other:?}"),
    }
    let joined = join(&at, &token, &params(5)).await.unwrap();
    assert_eq!(joined.identity.node_id, NodeId(5));
    assert_eq!(joined.identity.pool_id, PoolId(0x77));
    assert_eq!(cert_node_id(&joined.identity.chain[0]), Ok(NodeId(5)));
    assert_eq!(
        joined.members,
        vec![(NodeId(1), "127.0.0.1:7001".parse().unwrap())]
    );
    assert_eq!(joined.ca_pem, ca.cert_pem());
    // The key was made here and is the certificate's: the identity works for TLS.
    crate::tls::client_tls(&joined.identity).unwrap();

    // One-time.
    match join(&at, &token, &params(6)).await {
        Err(JoinError::Refused(JoinRefusal::TokenUsed)) => {}
        other => panic!("{other:?}"),
    }
    let mut wrong_secret = token.clone();
    wrong_secret.id ^= 1;
    match join(&at, &wrong_secret, &params(6)).await {
        Err(JoinError::Refused(JoinRefusal::UnknownToken)) => {}
        other => panic!("{other:?}"),
    }
    server.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_removal_takes_a_token_and_its_refusals_are_typed() {
    let dir = temp_dir("remove");
    let ca = PoolCa::generate(PoolId(0x79)).unwrap();
    ca.write(&dir).unwrap();
    let tokens = TokenStore::in_ca_dir(&dir);
    let server = BootstrapServer::start(
        "127.0.0.1:0".parse().unwrap(),
        &ca.issue_node(NodeId(1)).unwrap(),
        Arc::new(CaHandler {
            ca: PoolCa::load(&dir).unwrap(),
            tokens: tokens.clone(),
        }),
    )
    .unwrap();
    let at = server.local_addr().to_string();
    let fresh = || {
        tokens
            .create(ca.fingerprint().unwrap(), Duration::from_secs(60), now_ms())
            .unwrap()
            .0
    };
    remove(&at, &fresh(), NodeId(3), false).await.unwrap();
    let refused = |r: Result<(), JoinError>| match r {
        Err(JoinError::RemovalRefused(refusal)) => refusal,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        refused(remove(&at, &fresh(), NodeId(2), false).await),
        JoinRefusal::NodeUp { node: 2 }
    );
    remove(&at, &fresh(), NodeId(2), true).await.unwrap();
    assert_eq!(
        refused(remove(&at, &fresh(), NodeId(9), false).await),
        JoinRefusal::NotAMember { node: 9 }
    );
    // The token is one-time here too, and an error names the removal.
    let token = fresh();
    remove(&at, &token, NodeId(3), false).await.unwrap();
    let err = remove(&at, &token, NodeId(3), false).await.unwrap_err();
    assert!(
        err.to_string()
            .starts_with("the pool refused the removal: the join token was used already"),
        "{err}"
    );
    // A removal of node 0 is refused before the token is looked at.
    let bad = BootstrapRequest::Remove(RemoveRequest {
        version: JOIN_PROTOCOL_VERSION,
        token_id: 1,
        secret: [0; 16],
        node: 0,
        force: false,
    });
    assert_eq!(
        bad.invalid_reason().as_deref(),
        Some("node id 0 is reserved")
    );
    server.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hostile_messages_are_typed_errors() {
    // A huge length prefix hits the decode limit instead of allocating.
    let mut huge = vec![1u8, 0];
    huge.extend([0xff; 9]);
    assert!(matches!(
        decode::<JoinRequest>(&huge),
        Err(DecodeError::Malformed(_))
    ));
    assert!(matches!(
        decode::<JoinReply>(&[0xff; 100]),
        Err(DecodeError::Malformed(_))
    ));
    assert_eq!(
        decode::<JoinRequest>(&vec![0u8; JOIN_MESSAGE_BYTES_MAX + 1]),
        Err(DecodeError::TooLarge {
            bytes: JOIN_MESSAGE_BYTES_MAX + 1
        })
    );
    let request = JoinRequest {
        version: JOIN_PROTOCOL_VERSION,
        token_id: 1,
        secret: [0; 16],
        node: 3,
        addr: "10.0.0.1:7000".into(),
        zone: Some("a".into()),
        csr_der: vec![1, 2, 3],
    };
    let mut bytes = encode(&request);
    assert_eq!(decode::<JoinRequest>(&bytes).unwrap(), request);
    assert_eq!(request.invalid_reason(), None);
    bytes.push(0);
    assert_eq!(decode::<JoinRequest>(&bytes), Err(DecodeError::Trailing(1)));
    for (bad, what) in [
        (
            JoinRequest {
                version: 9,
                ..request.clone()
            },
            "version",
        ),
        (
            JoinRequest {
                node: 0,
                ..request.clone()
            },
            "node id 0",
        ),
        (
            JoinRequest {
                addr: "0.0.0.0:7000".into(),
                ..request.clone()
            },
            "reach",
        ),
        (
            JoinRequest {
                addr: "x".repeat(200),
                ..request.clone()
            },
            "longer",
        ),
    ] {
        let reason = bad.invalid_reason().unwrap();
        assert!(reason.contains(what), "{reason}");
    }
    // A signing request of junk is an error, never a panic.
    let ca = PoolCa::generate(PoolId(1)).unwrap();
    for junk in [&b""[..], b"\x30", b"\x30\x82\xff\xff", &[0xa5; 300]] {
        assert!(matches!(
            ca.sign_node_csr(NodeId(2), junk),
            Err(certs::CsrError::Invalid { .. })
        ));
    }
    // A request signed by another key than the one it names fails its signature check.
    let (_, mut csr) = certs::node_key_and_csr(NodeId(2)).unwrap();
    let last = csr.len() - 1;
    csr[last] ^= 1;
    assert!(ca.sign_node_csr(NodeId(2), &csr).is_err());
}
