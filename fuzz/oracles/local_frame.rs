//! Oracle of the local socket decoder (`spillway_types::local`), shared by the
//! `local_frame` fuzz target and the corpus replay test of spillway-types
//! (`tests/fuzz_corpus.rs`).
//!
//! Whatever the bytes, decoding returns `Ok` or a typed [`LocalWireError`] and never
//! panics (a panic is a fuzz crash). The bytes are decoded both ways (as a frame a node
//! reads from a client, [`ClientMessage`], and one a client reads from its node,
//! [`NodeMessage`]), as a whole frame and as a bare body. What is accepted must hold:
//! - a header that decodes re-encodes to the same 12 bytes;
//! - a message that decodes re-encodes (each side can send what the other accepts) and
//!   decodes again to the same message.

use std::fmt::Debug;

use spillway_types::local::{
    self, ClientMessage, FrameHeader, HEADER_BYTES, LocalMessage, LocalWireError, NodeMessage,
};

#[path = "frame_header.rs"]
mod frame_header;

/// Runs every check on `data`; returns whether it decoded as a whole frame of either
/// direction. Panics when a property above does not hold.
pub fn check(data: &[u8]) -> bool {
    let version = local::PROTOCOL_VERSION.to_le_bytes();
    frame_header::check_also_as_current(data, local::MAGIC, version, check_bytes)
}

/// [`check`] on `data` as it is.
fn check_bytes(data: &[u8]) -> bool {
    frame_header::round_trips(data, |h: &[u8; HEADER_BYTES]| {
        FrameHeader::decode(h).ok().map(|h| h.encode())
    });
    body_round_trips::<ClientMessage>(data);
    body_round_trips::<NodeMessage>(data);
    let client = frame_round_trips::<ClientMessage>(data);
    let node = frame_round_trips::<NodeMessage>(data);
    client || node
}

fn frame_round_trips<M: LocalMessage + PartialEq + Debug>(data: &[u8]) -> bool {
    let decoded: Result<(M, usize), LocalWireError> = local::decode_frame(data);
    let Ok((message, used)) = decoded else {
        return false;
    };
    assert!(used <= data.len());
    let again = local::encode_frame(&message)
        .unwrap_or_else(|e| panic!("accepted {message:?} does not re-encode: {e}"));
    let (message_again, used_again) = local::decode_frame::<M>(&again)
        .unwrap_or_else(|e| panic!("re-encoded {message:?} does not decode: {e}"));
    assert_eq!(used_again, again.len());
    assert_eq!(message_again, message);
    true
}

fn body_round_trips<M: LocalMessage + PartialEq + Debug>(body: &[u8]) {
    let Ok(message) = local::decode_body::<M>(body) else {
        return;
    };
    let again = local::encode_frame(&message)
        .unwrap_or_else(|e| panic!("accepted {message:?} does not re-encode: {e}"));
    let (message_again, _) = local::decode_frame::<M>(&again)
        .unwrap_or_else(|e| panic!("re-encoded {message:?} does not decode: {e}"));
    assert_eq!(message_again, message);
}
