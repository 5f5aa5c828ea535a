use super::*;
use crate::BufferId;

/// A header of a frame of `kind` with request id 1.
fn header(kind: Kind, body_bytes: u32, payload_bytes: u64) -> FrameHeader {
    FrameHeader {
        kind,
        request_id: 1,
        body_bytes,
        payload_bytes,
    }
}

fn page(buffer: u64, index: u32) -> PageId {
    PageId {
        buffer: BufferId(buffer),
        index,
    }
}

/// A put frame of `n` pages of `len` bytes each, with the payload appended.
fn put_frame(n: u32, len: usize) -> (Vec<u8>, Message) {
    let datas: Vec<Vec<u8>> = (0..n)
        .map(|i| crate::pattern::bytes(u64::from(i), len))
        .collect();
    let message = Message::PutPages(PutPages {
        pages: datas
            .iter()
            .enumerate()
            .map(|(i, d)| PageDesc::for_page(page(7, i as u32), d))
            .collect(),
    });
    let mut frame = encode_frame(42, &message).unwrap();
    for d in &datas {
        frame.extend_from_slice(d);
    }
    (frame, message)
}

fn every_message() -> Vec<Message> {
    let hello = Hello {
        pool_id: PoolId(0xfeed),
        node_id: NodeId(3),
        protocol_version: PROTOCOL_VERSION,
    };
    vec![
        Message::Hello(hello),
        Message::HelloReply(hello),
        Message::PutPages(PutPages { pages: vec![] }),
        Message::PutPagesReply(PutPagesReply { pages_stored: 5 }),
        Message::GetPages(GetPages {
            pages: vec![page(1, 0), page(u64::MAX, u32::MAX)],
        }),
        Message::GetPagesReply(GetPagesReply {
            pages: vec![],
            missing: vec![page(2, 9)],
        }),
        Message::DeletePages(DeletePages {
            pages: vec![page(1, 1)],
        }),
        Message::DeletePagesReply(DeletePagesReply {
            pages_deleted: 1,
            pages_missing: 2,
        }),
        Message::Error(ErrorReply::new(ErrorCode::NoCapacity, "host tier full")),
        Message::RaftMessage(Blob::default()),
        Message::RaftMessageReply(Blob::default()),
        Message::Propose(Blob::default()),
        Message::ProposeReply(Blob::default()),
        Message::UcxConnect(Blob::default()),
        Message::UcxConnectReply(Blob::default()),
    ]
}

/// A blob frame of `kind` carrying `data`, with the payload appended.
fn blob_frame(kind: Kind, data: &[u8]) -> Vec<u8> {
    let blob = Blob::describe(data);
    let message = match kind {
        Kind::RaftMessage => Message::RaftMessage(blob),
        Kind::Propose => Message::Propose(blob),
        Kind::ProposeReply => Message::ProposeReply(blob),
        Kind::UcxConnect => Message::UcxConnect(blob),
        Kind::UcxConnectReply => Message::UcxConnectReply(blob),
        _ => Message::RaftMessageReply(blob),
    };
    let mut frame = encode_frame(9, &message).unwrap();
    frame.extend_from_slice(data);
    frame
}

#[test]
fn blobs_round_trip_in_chunks_with_checksums() {
    let data: Vec<u8> = (0..(BLOB_CHUNK_BYTES as usize + 1000))
        .map(|i| (i * 7) as u8)
        .collect();
    let frame = blob_frame(Kind::RaftMessage, &data);
    let (f, used) = decode_frame(&frame).unwrap();
    assert_eq!(used, frame.len());
    assert_eq!(f.payload, &data[..]);
    match f.message {
        Message::RaftMessage(b) => {
            assert_eq!(b.chunks.len(), 2);
            assert_eq!(b.len(), data.len() as u64);
            assert_eq!(u64::from(b.chunks[0].len), BLOB_CHUNK_BYTES);
        }
        other => panic!("{other:?}"),
    }
    // A flipped byte in the blob fails its chunk's checksum.
    let mut bad = frame.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    let e = decode_frame(&bad).unwrap_err();
    assert!(
        matches!(e, WireError::ChecksumMismatch { index: 1, .. }),
        "{e}"
    );
}

#[test]
fn blob_payloads_are_bounded_per_kind() {
    for (kind, limit) in [
        (Kind::RaftMessage, RAFT_PAYLOAD_BYTES_MAX),
        (Kind::Propose, PROPOSAL_PAYLOAD_BYTES_MAX),
        (Kind::ProposeReply, PROPOSAL_PAYLOAD_BYTES_MAX),
        (Kind::UcxConnect, UCX_CONNECT_PAYLOAD_BYTES_MAX),
        (Kind::UcxConnectReply, UCX_CONNECT_PAYLOAD_BYTES_MAX),
    ] {
        assert_eq!(kind.payload_bytes_max(), limit);
        let h = header(kind, 0, limit + 1);
        assert_eq!(
            FrameHeader::decode(&h.encode()).unwrap_err(),
            WireError::PayloadTooLarge {
                payload_bytes: limit + 1,
                limit_bytes: limit
            }
        );
        let ok = FrameHeader {
            payload_bytes: limit,
            ..h
        };
        assert_eq!(FrameHeader::decode(&ok.encode()).unwrap(), ok);
    }
    // An ack carries nothing.
    let ack = header(Kind::RaftMessageReply, 0, 1);
    assert!(matches!(
        FrameHeader::decode(&ack.encode()),
        Err(WireError::PayloadMismatch { .. })
    ));
}

#[test]
fn misnamed_or_oversized_blob_chunks_are_refused() {
    let data = vec![5u8; 100];
    let mut blob = Blob::describe(&data);
    blob.chunks[0].page = page(1, 0);
    let e = encode_frame(1, &Message::Propose(blob)).unwrap_err();
    assert!(
        matches!(
            e,
            WireError::UndecodableBody {
                kind: Kind::Propose,
                ..
            }
        ),
        "{e}"
    );
    // The same check on receipt: a hand-built body with a chunk over BLOB_CHUNK_BYTES.
    let big = Blob {
        chunks: vec![PageDesc {
            page: page(0, 0),
            len: BLOB_CHUNK_BYTES as u32 + 1,
            checksum: 0,
        }],
    };
    let mut body = Vec::new();
    bincode::encode_into_std_write(&big, &mut body, body_config()).unwrap();
    let h = header(Kind::RaftMessage, body.len() as u32, BLOB_CHUNK_BYTES + 1);
    let e = decode_body(&h, &body).unwrap_err();
    assert!(e.to_string().contains("BLOB_CHUNK_BYTES"), "{e}");
}

#[test]
fn header_layout_is_fixed() {
    let h = FrameHeader {
        kind: Kind::GetPagesReply,
        request_id: 0x0102_0304_0506_0708,
        body_bytes: 0x11,
        payload_bytes: 0x2233,
    };
    let b = h.encode();
    assert_eq!(&b[0..4], b"SPWY");
    assert_eq!(&b[4..6], &[3, 0]);
    assert_eq!(b[6], 6);
    assert_eq!(b[7], 0);
    assert_eq!(&b[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
    assert_eq!(&b[16..20], &[0x11, 0, 0, 0]);
    assert_eq!(&b[20..24], &[0, 0, 0, 0]);
    assert_eq!(&b[24..32], &[0x33, 0x22, 0, 0, 0, 0, 0, 0]);
    assert_eq!(FrameHeader::decode(&b).unwrap(), h);
}

#[test]
fn every_message_round_trips() {
    for (i, m) in every_message().into_iter().enumerate() {
        let bytes = encode_frame(i as u64, &m).unwrap();
        let (frame, used) = decode_frame(&bytes).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(frame.message, m);
        assert_eq!(frame.header.kind, m.kind());
        assert_eq!(frame.header.request_id, i as u64);
        assert!(frame.payload.is_empty());
    }
}

#[test]
fn pages_round_trip_with_checksums() {
    let (bytes, message) = put_frame(3, 70_000);
    let (frame, used) = decode_frame(&bytes).unwrap();
    assert_eq!(used, bytes.len());
    assert_eq!(frame.message, message);
    assert_eq!(frame.header.payload_bytes, 3 * 70_000);
    let ranges: Vec<_> = page_ranges(frame.message.page_descs()).collect();
    assert_eq!(ranges[2].1, 140_000..210_000);
    let mut expect = vec![0u8; 70_000];
    crate::pattern::fill(2, &mut expect);
    assert_eq!(&frame.payload[ranges[2].1.clone()], &expect[..]);
}

#[test]
fn bad_magic_is_refused() {
    let mut bytes = encode_frame(1, &every_message()[0]).unwrap();
    bytes[0] = b'X';
    assert_eq!(
        decode_frame(&bytes).unwrap_err(),
        WireError::BadMagic { found: *b"XPWY" }
    );
}

#[test]
fn other_versions_are_refused() {
    let mut bytes = encode_frame(1, &every_message()[0]).unwrap();
    bytes[4..6].copy_from_slice(&1u16.to_le_bytes());
    assert_eq!(
        decode_frame(&bytes).unwrap_err(),
        WireError::UnsupportedVersion {
            found: 1,
            supported: PROTOCOL_VERSION
        }
    );
}

#[test]
fn unknown_kinds_and_reserved_bits_are_refused() {
    let mut bytes = encode_frame(1, &every_message()[0]).unwrap();
    bytes[6] = 0;
    assert_eq!(
        decode_frame(&bytes).unwrap_err(),
        WireError::UnknownKind { found: 0 }
    );
    bytes[6] = Kind::Hello as u8;
    bytes[7] = 1;
    assert!(matches!(
        decode_frame(&bytes).unwrap_err(),
        WireError::ReservedNotZero { flags: 1, .. }
    ));
    bytes[7] = 0;
    bytes[21] = 1;
    assert!(matches!(
        decode_frame(&bytes).unwrap_err(),
        WireError::ReservedNotZero {
            reserved: 0x100,
            ..
        }
    ));
}

#[test]
fn oversized_body_is_refused_before_reading_it() {
    let h = header(Kind::GetPages, FRAME_BODY_BYTES_MAX + 1, 0);
    let e = FrameHeader::decode(&h.encode()).unwrap_err();
    assert_eq!(
        e,
        WireError::BodyTooLarge {
            body_bytes: u64::from(FRAME_BODY_BYTES_MAX) + 1,
            limit_bytes: FRAME_BODY_BYTES_MAX
        }
    );
    assert!(e.to_string().contains("FRAME_BODY_BYTES_MAX"), "{e}");
    // Only the header is there: the limit is checked before the body is wanted.
    assert!(matches!(
        decode_frame(&h.encode()),
        Err(WireError::BodyTooLarge { .. })
    ));
}

#[test]
fn oversized_payload_is_refused_before_reading_it() {
    let h = header(Kind::PutPages, 1, u64::MAX);
    let e = decode_frame(&h.encode()).unwrap_err();
    assert_eq!(
        e,
        WireError::PayloadTooLarge {
            payload_bytes: u64::MAX,
            limit_bytes: FRAME_PAYLOAD_BYTES_MAX
        }
    );
    assert!(e.to_string().contains("FRAME_PAYLOAD_BYTES_MAX"), "{e}");
}

#[test]
fn payload_on_a_kind_without_pages_is_refused() {
    let h = header(Kind::GetPages, 1, 10);
    assert!(matches!(
        FrameHeader::decode(&h.encode()),
        Err(WireError::PayloadMismatch {
            kind: Kind::GetPages,
            payload_bytes: 10,
            pages_bytes: 0
        })
    ));
}

#[test]
fn too_many_pages_are_refused_both_ways() {
    let many = Message::GetPages(GetPages {
        pages: (0..=PAGES_PER_FRAME_MAX as u32)
            .map(|i| page(1, i))
            .collect(),
    });
    let e = encode_frame(1, &many).unwrap_err();
    assert_eq!(
        e,
        WireError::TooManyPages {
            pages: PAGES_PER_FRAME_MAX + 1,
            limit: PAGES_PER_FRAME_MAX
        }
    );
    // Hand-built: a body listing too many pages but within the byte limits.
    let body = bincode::encode_to_vec(
        GetPages {
            pages: (0..=PAGES_PER_FRAME_MAX as u32)
                .map(|i| page(1, i))
                .collect(),
        },
        bincode::config::standard(),
    )
    .unwrap();
    let h = header(Kind::GetPages, body.len() as u32, 0);
    assert!(matches!(
        decode_body(&h, &body),
        Err(WireError::TooManyPages { .. })
    ));
}

#[test]
fn hostile_length_prefix_hits_the_decode_limit() {
    // A GetPages body whose Vec length prefix claims 2^40 entries: without the
    // decode limit bincode would try to allocate that (and abort the process).
    let mut body = Vec::new();
    body.push(253u8); // varint marker: a u64 follows
    body.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let h = header(Kind::GetPages, body.len() as u32, 0);
    let e = decode_body(&h, &body).unwrap_err();
    assert!(
        matches!(&e, WireError::UndecodableBody { kind: Kind::GetPages, reason } if reason.contains("BODY_DECODE_BYTES_MAX")),
        "{e}"
    );
}

#[test]
fn truncated_frames_say_how_much_is_missing() {
    let (bytes, _) = put_frame(2, 1000);
    // Cut in the header, in the body and in the payload.
    for cut in [0, 10, HEADER_BYTES + 1, bytes.len() - 1] {
        match decode_frame(&bytes[..cut]).unwrap_err() {
            WireError::Truncated {
                needed_bytes,
                available_bytes,
            } => {
                assert_eq!(available_bytes, cut as u64);
                assert!(needed_bytes > available_bytes);
            }
            other => panic!("cut at {cut}: {other}"),
        }
    }
}

#[test]
fn checksum_mismatch_names_the_page() {
    let (mut bytes, message) = put_frame(3, 1000);
    let at = bytes.len() - 1000 + 17; // inside the third page
    bytes[at] ^= 0x40;
    match decode_frame(&bytes).unwrap_err() {
        WireError::ChecksumMismatch {
            page: p,
            index,
            expected,
            actual,
        } => {
            assert_eq!(p, page(7, 2));
            assert_eq!(index, 2);
            assert_eq!(expected, message.page_descs()[2].checksum);
            assert_ne!(actual, expected);
        }
        other => panic!("{other}"),
    }
}

#[test]
fn streaming_verifier_agrees_with_the_whole_payload_check() {
    let (bytes, message) = put_frame(3, 5000);
    let payload = &bytes[bytes.len() - 15_000..];
    for piece in [1, 7, 4999, 5000, 5001, 15_000] {
        let mut v = PayloadVerifier::new(&message);
        for chunk in payload.chunks(piece) {
            v.update(chunk).unwrap();
        }
        v.finish().unwrap();
        // A flipped byte in the second page is caught and named, in any piece size.
        let mut bad = payload.to_vec();
        bad[7000] ^= 1;
        let mut v = PayloadVerifier::new(&message);
        let err = bad
            .chunks(piece)
            .try_for_each(|c| v.update(c))
            .and_then(|()| v.finish())
            .unwrap_err();
        assert!(
            matches!(err, WireError::ChecksumMismatch { index: 1, .. }),
            "{piece}: {err}"
        );
    }
    // Short and long payloads.
    let mut v = PayloadVerifier::new(&message);
    v.update(&payload[..14_999]).unwrap();
    assert!(matches!(v.finish(), Err(WireError::Truncated { .. })));
    let mut v = PayloadVerifier::new(&message);
    v.update(payload).unwrap();
    assert!(matches!(
        v.update(&[0]),
        Err(WireError::PayloadMismatch {
            kind: Kind::PutPages,
            ..
        })
    ));
    // Empty pages need no bytes.
    let empty = Message::PutPages(PutPages {
        pages: vec![
            PageDesc::for_page(page(1, 0), &[]),
            PageDesc::for_page(page(1, 1), &[]),
        ],
    });
    PayloadVerifier::new(&empty).finish().unwrap();
}

#[test]
fn payload_length_must_match_the_pages() {
    let (mut bytes, _) = put_frame(2, 1000);
    // Claim one byte more in the header than the descriptors add up to.
    bytes[24..32].copy_from_slice(&2001u64.to_le_bytes());
    bytes.push(0);
    assert_eq!(
        decode_frame(&bytes).unwrap_err(),
        WireError::PayloadMismatch {
            kind: Kind::PutPages,
            payload_bytes: 2001,
            pages_bytes: 2000
        }
    );
}

#[test]
fn undecodable_and_trailing_bodies_are_refused() {
    let mut bytes = encode_frame(1, &every_message()[8]).unwrap();
    // The error code is the first field: 200 is no variant.
    bytes[HEADER_BYTES] = 200;
    assert!(matches!(
        decode_frame(&bytes).unwrap_err(),
        WireError::UndecodableBody {
            kind: Kind::Error,
            ..
        }
    ));
    let mut bytes = encode_frame(1, &every_message()[3]).unwrap();
    bytes.push(0);
    let body_bytes = (bytes.len() - HEADER_BYTES) as u32;
    bytes[16..20].copy_from_slice(&body_bytes.to_le_bytes());
    match decode_frame(&bytes).unwrap_err() {
        WireError::UndecodableBody { reason, .. } => assert!(reason.contains("left over")),
        other => panic!("{other}"),
    }
}

#[test]
fn oversized_page_descriptor_is_refused() {
    let message = Message::PutPages(PutPages {
        pages: vec![PageDesc {
            page: page(1, 0),
            len: (limits::PAGE_BYTES_MAX + 1) as u32,
            checksum: 0,
        }],
    });
    assert!(matches!(
        encode_frame(1, &message).unwrap_err(),
        WireError::PageTooLarge { .. }
    ));
}

#[test]
fn error_messages_are_cut_at_the_limit() {
    let e = ErrorReply::new(ErrorCode::Internal, "é".repeat(ERROR_MESSAGE_BYTES_MAX));
    assert!(e.message.len() <= ERROR_MESSAGE_BYTES_MAX);
    assert!(e.message.len() > ERROR_MESSAGE_BYTES_MAX - 2);
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_frame(&bytes);
        }

        #[test]
        fn random_bodies_behind_a_valid_header_never_panic(
            kind in 1u8..=9,
            body in proptest::collection::vec(any::<u8>(), 0..512),
            payload_bytes in 0u64..4096,
        ) {
            let mut buf = FrameHeader {
                kind: Kind::from_u8(kind).unwrap(),
                request_id: 9,
                body_bytes: body.len() as u32,
                payload_bytes,
            }
            .encode()
            .to_vec();
            buf.extend_from_slice(&body);
            buf.resize(buf.len() + payload_bytes as usize, 0xAB);
            let _ = decode_frame(&buf);
        }

        #[test]
        fn flipping_any_byte_of_a_valid_frame_is_caught_or_harmless(at in 0usize..(HEADER_BYTES + 64 + 3000), bit in 0u8..8) {
            let (mut bytes, message) = put_frame(3, 1000);
            let original = bytes.clone();
            let payload_at = original.len() - 3000;
            let at = at % bytes.len();
            bytes[at] ^= 1 << bit;
            // Either refused, or the page bytes that come out are the ones that went
            // in, with the same lengths and checksums (a flipped request id or page id
            // is not the checksum's business: TLS protects those on the wire).
            if let Ok((frame, _)) = decode_frame(&bytes) {
                prop_assert!(at < payload_at);
                prop_assert_eq!(frame.payload, &original[payload_at..]);
                for (got, sent) in frame.message.page_descs().iter().zip(message.page_descs()) {
                    prop_assert_eq!((got.len, got.checksum), (sent.len, sent.checksum));
                }
            }
        }
    }
}
