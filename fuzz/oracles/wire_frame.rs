//! Oracle of the peer wire decoder (`spillway_types::wire`), shared by the `wire_frame`
//! fuzz target and the corpus replay test of spillway-types (`tests/fuzz_corpus.rs`).
//!
//! Whatever the bytes, decoding returns `Ok` or a typed [`WireError`] and never panics
//! (a panic is a fuzz crash). What it accepts must also hold:
//! - a header that decodes re-encodes to the same 32 bytes (the layout is fixed);
//! - a frame that decodes re-encodes (a node can send what it accepts) and the re-encoded
//!   frame decodes to the same message and payload;
//! - the streaming [`PayloadVerifier`] gives the one-shot [`wire::verify_pages`]'s verdict,
//!   on the payload as received and with one byte flipped, fed in pieces of any size.
//!
//! Besides the frame, the bytes after the header are decoded as the body of every kind,
//! so bodies are fuzzed without the fuzzer having to get the header right first.

use spillway_types::wire::{
    self, FRAME_BODY_BYTES_MAX, FrameHeader, HEADER_BYTES, Kind, PayloadVerifier, WireError,
};

#[path = "frame_header.rs"]
mod frame_header;

/// Runs every check on `data`; returns whether it decoded as a whole frame. Panics when a
/// property above does not hold.
pub fn check(data: &[u8]) -> bool {
    let version = wire::PROTOCOL_VERSION.to_le_bytes();
    frame_header::check_also_as_current(data, wire::MAGIC, version, check_bytes)
}

/// [`check`] on `data` as it is.
fn check_bytes(data: &[u8]) -> bool {
    frame_header::round_trips(data, |h: &[u8; HEADER_BYTES]| {
        FrameHeader::decode(h).ok().map(|h| h.encode())
    });
    bodies_of_every_kind(data.get(HEADER_BYTES..).unwrap_or_default());

    let decoded: Result<_, WireError> = wire::decode_frame(data);
    let Ok((frame, used)) = decoded else {
        return false;
    };
    assert_eq!(
        used,
        HEADER_BYTES + frame.header.body_bytes as usize + frame.payload.len(),
        "decode_frame took a length that is not its header's"
    );
    assert!(used <= data.len());
    assert_eq!(frame.payload.len() as u64, frame.header.payload_bytes);

    let mut again = wire::encode_frame(frame.header.request_id, &frame.message)
        .unwrap_or_else(|e| panic!("accepted {:?} does not re-encode: {e}", frame.message));
    again.extend_from_slice(frame.payload);
    let (frame_again, used_again) = wire::decode_frame(&again)
        .unwrap_or_else(|e| panic!("re-encoded {:?} does not decode: {e}", frame.message));
    assert_eq!(used_again, again.len());
    assert_eq!(frame_again.message, frame.message);
    assert_eq!(frame_again.payload, frame.payload);
    assert_eq!(frame_again.header.kind, frame.header.kind);
    assert_eq!(frame_again.header.request_id, frame.header.request_id);

    // Piece sizes from the request id, so the fuzzer chooses them too.
    let piece_bytes = (frame.header.request_id % 4099) as usize + 1;
    let descs = frame.message.page_descs();
    assert_eq!(
        streamed_verdict(&frame.message, frame.payload, piece_bytes),
        Ok(())
    );
    if !frame.payload.is_empty() {
        let mut flipped = frame.payload.to_vec();
        let at = (frame.header.request_id as usize) % flipped.len();
        flipped[at] ^= 0x5a;
        let one_shot = wire::verify_pages(descs, &flipped);
        assert!(
            one_shot.is_err(),
            "a flipped payload byte passed its checksum"
        );
        assert_eq!(
            streamed_verdict(&frame.message, &flipped, piece_bytes),
            one_shot
        );
    }
    true
}

/// Decodes `body` (cut to the largest body a header allows) as the body of each kind; an
/// accepted body must re-encode.
fn bodies_of_every_kind(body: &[u8]) {
    let body = &body[..body.len().min(FRAME_BODY_BYTES_MAX as usize)];
    for kind in Kind::ALL {
        let header = FrameHeader {
            kind,
            request_id: 0,
            body_bytes: body.len() as u32,
            payload_bytes: 0,
        };
        let message = match wire::decode_body(&header, body) {
            Ok(message) => message,
            // The same body with the payload length its pages need, where the kind's
            // payload limit allows it (the header check refuses the rest first).
            Err(WireError::PayloadMismatch { pages_bytes, .. })
                if pages_bytes <= kind.payload_bytes_max() =>
            {
                let header = FrameHeader {
                    payload_bytes: pages_bytes,
                    ..header
                };
                match wire::decode_body(&header, body) {
                    Ok(message) => message,
                    Err(_) => continue,
                }
            }
            Err(_) => continue,
        };
        assert_eq!(message.kind(), kind);
        wire::encode_frame(0, &message)
            .unwrap_or_else(|e| panic!("accepted {message:?} does not re-encode: {e}"));
    }
}

/// The streaming verifier's verdict on `payload` fed in pieces of `piece_bytes`.
fn streamed_verdict(
    message: &wire::Message,
    payload: &[u8],
    piece_bytes: usize,
) -> Result<(), WireError> {
    let mut verifier = PayloadVerifier::new(message);
    for piece in payload.chunks(piece_bytes) {
        verifier.update(piece)?;
    }
    verifier.finish()
}
