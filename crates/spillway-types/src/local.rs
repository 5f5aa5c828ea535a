//! Frames between a client process and the node daemon of its machine, over the node's
//! Unix socket ("daemon mode").
//!
//! The client's host tier lives in a `memfd` the node creates and passes with the
//! [`Welcome`] (SCM_RIGHTS); both map it. So no page crosses the socket: a [`PageOp`]
//! names a host slot, and the node reads (spill) or writes (fetch) the page's bytes in
//! the shared mapping before it answers [`Done`].
//!
//! A frame is a fixed header and a bincode 2 body:
//!
//! ```text
//! ┌──────────────────────────────────────────────┬──────────────────────────────┐
//! │ header, 12 bytes                             │ body, `body_bytes`           │
//! │ magic b"SPWL" | version u16 | 0u16 | len u32 │ bincode 2 (varint), limited  │
//! └──────────────────────────────────────────────┴──────────────────────────────┘
//! ```
//!
//! (integers little-endian). The body is a [`ClientMessage`] on the way to the node and
//! a [`NodeMessage`] on the way back, so neither side can be sent a message meant for
//! the other.
//!
//! Conversation: the client sends [`Hello`]; the node answers [`Welcome`] with the memfd
//! attached to the frame's bytes, or [`Refused`] and closes. Then the client sends
//! [`ClientMessage::Spill`], [`ClientMessage::Fetch`] (each answered by one [`Done`]
//! with its id, in any order) and [`ClientMessage::Discard`] (no answer).
//!
//! Checks a receiver makes before it allocates anything sized by its peer
//! ([`FrameHeader::decode`]): magic, version, reserved bits zero, body length at most
//! [`FRAME_BODY_BYTES_MAX`]. Then the body is decoded under [`BODY_DECODE_BYTES_MAX`]
//! (bincode 2 without a limit would allocate whatever a length prefix claims), must have
//! no bytes left over, and lists at most [`DISCARD_PAGES_MAX`] pages. Any failure means
//! the peer is broken or hostile: the connection is closed.
//!
//! Versioning: the header carries [`PROTOCOL_VERSION`] and so does the [`Hello`]. The
//! header layout is frozen across versions: a node answers a client of another version
//! with a [`Refused`] of its own version, and the client, seeing that version in the
//! header, can say which versions the two sides speak without decoding the body.
//!
//! This module does no IO.

use bincode::{Decode, Encode};

use crate::PageId;

/// The first four bytes of every frame (`L` for local; peer frames use `SPWY`).
pub const MAGIC: [u8; 4] = *b"SPWL";
/// The protocol version this build speaks. 2: [`OpErrorCode::PageLost`].
pub const PROTOCOL_VERSION: u16 = 2;
/// Size of the fixed header.
pub const HEADER_BYTES: usize = 12;
/// Largest body: 32 KiB. The largest message is a [`Discard`] of [`DISCARD_PAGES_MAX`]
/// pages (at most 15 bytes each with varints: 15 KiB); error texts are cut at
/// [`ERROR_MESSAGE_BYTES_MAX`]. A reader holds one body at a time per connection, so the
/// node's worst case is this times [`CLIENTS_MAX`] (2 MiB).
pub const FRAME_BODY_BYTES_MAX: u32 = 32 << 10;
/// Most memory bincode may claim while decoding one body (its `len x size_of::<T>()`
/// count before allocating a container): 32 KiB. [`DISCARD_PAGES_MAX`] page ids take
/// 1024 x 16 bytes = 16 KiB decoded, inside it.
pub const BODY_DECODE_BYTES_MAX: usize = 32 << 10;
/// Most pages one [`Discard`] may name: 1024. A client with more sends several.
pub const DISCARD_PAGES_MAX: usize = 1024;
/// Longest error text in a [`Refused`] or a failed [`Done`]: 1 KiB, the peer wire's
/// bound; longer text is cut when the message is built.
pub use crate::wire::ERROR_MESSAGE_BYTES_MAX;
/// Most clients one node serves at once: 64. Each holds a mapping of its host tier (at
/// most the node's per-client host limit), one frame body, and its ops in flight.
pub const CLIENTS_MAX: usize = 64;

/// The fixed header of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// The version of the body that follows.
    pub version: u16,
    /// Length of the body.
    pub body_bytes: u32,
}

impl FrameHeader {
    /// The header as it goes on the wire.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6..8].copy_from_slice(&0u16.to_le_bytes());
        out[8..12].copy_from_slice(&self.body_bytes.to_le_bytes());
        out
    }

    /// Checks and reads a header: magic, reserved bits, body length. The version is
    /// returned, not checked, so that the node can refuse another version with a reason
    /// ([`FrameHeader::check_version`]).
    pub fn decode(bytes: &[u8; HEADER_BYTES]) -> Result<FrameHeader, LocalWireError> {
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(LocalWireError::BadMagic { found: magic });
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        let reserved = u16::from_le_bytes([bytes[6], bytes[7]]);
        if reserved != 0 {
            return Err(LocalWireError::ReservedNotZero { reserved });
        }
        let body_bytes = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        if body_bytes > FRAME_BODY_BYTES_MAX {
            return Err(LocalWireError::BodyTooLarge {
                body_bytes,
                limit_bytes: FRAME_BODY_BYTES_MAX,
            });
        }
        Ok(FrameHeader {
            version,
            body_bytes,
        })
    }

    /// Whether the body is of the version this build speaks.
    pub fn check_version(&self) -> Result<(), LocalWireError> {
        if self.version == PROTOCOL_VERSION {
            Ok(())
        } else {
            Err(LocalWireError::UnsupportedVersion {
                found: self.version,
                supported: PROTOCOL_VERSION,
            })
        }
    }
}

/// First frame of a connection, from the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode)]
pub struct Hello {
    /// The protocol version the client runs ([`PROTOCOL_VERSION`]).
    pub version: u16,
    /// The client's page size in bytes; must be the node's.
    pub page_bytes: u64,
    /// Bytes of host tier the client wants (a whole number of pages): the size of the
    /// shared memory the node creates.
    pub host_bytes: u64,
}

/// The node accepts the client. The frame carries the memfd of the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode)]
pub struct Welcome {
    /// The client's number on this node (in the node's logs and counters).
    pub client: u32,
    /// The size of the shared memory, as asked.
    pub host_bytes: u64,
    /// Bytes of pages the client may keep in the remote tier.
    pub remote_capacity_bytes: u64,
    /// A first guess of the remote tier's bandwidth per direction.
    pub bandwidth_hint_bytes_per_s: u64,
}

/// Why a node refuses a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Encode, Decode)]
pub enum RefusedCode {
    /// The client speaks another protocol version.
    VersionMismatch,
    /// The client's page size is not the node's.
    PageSizeMismatch,
    /// The client asked for more host memory than the node gives one client.
    HostBytesTooLarge,
    /// The host size is zero or not a whole number of pages.
    BadHostBytes,
    /// The node serves as many clients as it may.
    TooManyClients,
    /// The node could not create the shared memory or is shutting down.
    Unavailable,
}

/// The node refuses the client, then closes the connection.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct Refused {
    /// Why, for programs.
    pub code: RefusedCode,
    /// Why, for people (at most [`ERROR_MESSAGE_BYTES_MAX`] bytes).
    pub message: String,
}

impl Refused {
    /// A refusal; `message` is cut to [`ERROR_MESSAGE_BYTES_MAX`] bytes.
    pub fn new(code: RefusedCode, message: impl Into<String>) -> Refused {
        Refused {
            code,
            message: cut_message(message.into()),
        }
    }
}

/// One page moving between the client's host slot and the remote tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode)]
pub struct PageOp {
    /// Chosen by the client, unique among its ops in flight; the [`Done`] carries it.
    pub id: u64,
    /// The page (the key in the remote tier).
    pub page: PageId,
    /// The host slot: bytes `slot * page_bytes ..` of the shared memory.
    pub slot: u32,
    /// The page's length (at most a page; the last page of a buffer may be short).
    pub bytes: u64,
}

/// Drop the remote tier's copies of these pages. No answer; the node has dropped them
/// before it reads the client's next frame.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct Discard {
    /// At most [`DISCARD_PAGES_MAX`].
    pub pages: Vec<PageId>,
}

/// Why an op failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Encode, Decode)]
pub enum OpErrorCode {
    /// The slot or length lies outside the shared memory or a page.
    BadRequest,
    /// The remote tier failed (no capacity, a peer that refused a spill).
    Remote,
    /// The node is shutting down.
    Unavailable,
    /// A fetch found no copy of the page: every holder is gone (died, fenced, or answered
    /// with other bytes) or none was ever recorded, after the node failed over between
    /// holders and waited for them. The client loses that page's buffer, nothing else.
    PageLost,
}

/// A failed op.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct OpError {
    /// What went wrong, for programs.
    pub code: OpErrorCode,
    /// What went wrong, for people (at most [`ERROR_MESSAGE_BYTES_MAX`] bytes).
    pub message: String,
}

impl OpError {
    /// An op error; `message` is cut to [`ERROR_MESSAGE_BYTES_MAX`] bytes.
    pub fn new(code: OpErrorCode, message: impl Into<String>) -> OpError {
        OpError {
            code,
            message: cut_message(message.into()),
        }
    }
}

impl std::fmt::Display for OpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

/// An op finished: the spill's bytes were read from the slot and stored, or the fetch's
/// bytes are in the slot.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct Done {
    /// The op's id.
    pub id: u64,
    /// Whether it worked.
    pub result: Result<(), OpError>,
}

/// What a client sends.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub enum ClientMessage {
    /// First frame.
    Hello(Hello),
    /// Copy the slot's bytes to the remote tier.
    Spill(PageOp),
    /// Copy the page's bytes from the remote tier into the slot.
    Fetch(PageOp),
    /// Drop pages from the remote tier.
    Discard(Discard),
}

/// What a node sends.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub enum NodeMessage {
    /// The answer to a [`Hello`], with the memfd.
    Welcome(Welcome),
    /// The answer to a [`Hello`] that is refused.
    Refused(Refused),
    /// An op finished.
    Done(Done),
}

/// Everything that can be wrong with a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocalWireError {
    /// Not a local Spillway frame, or the stream lost its place.
    #[error("bad frame magic {found:02x?} (expected {MAGIC:02x?})")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// A protocol version this build does not speak.
    #[error("unsupported local protocol version {found} (this build speaks {supported})")]
    UnsupportedVersion {
        /// The version in the frame.
        found: u16,
        /// [`PROTOCOL_VERSION`].
        supported: u16,
    },
    /// Reserved header bits are set.
    #[error("reserved header field is not zero ({reserved:#x})")]
    ReservedNotZero {
        /// The reserved field.
        reserved: u16,
    },
    /// The body is longer than [`FRAME_BODY_BYTES_MAX`].
    #[error("frame body of {body_bytes} bytes exceeds FRAME_BODY_BYTES_MAX ({limit_bytes} bytes)")]
    BodyTooLarge {
        /// The length claimed (or needed, when encoding).
        body_bytes: u32,
        /// [`FRAME_BODY_BYTES_MAX`].
        limit_bytes: u32,
    },
    /// A [`Discard`] names more than [`DISCARD_PAGES_MAX`] pages.
    #[error("discard of {pages} pages exceeds DISCARD_PAGES_MAX ({limit})")]
    TooManyPages {
        /// Pages named.
        pages: usize,
        /// [`DISCARD_PAGES_MAX`].
        limit: usize,
    },
    /// The buffer ends before the frame does.
    #[error("truncated frame: needed {needed_bytes} bytes, have {available_bytes}")]
    Truncated {
        /// Bytes the frame needs (so far).
        needed_bytes: usize,
        /// Bytes there are.
        available_bytes: usize,
    },
    /// The body is not a valid message, claims more memory than
    /// [`BODY_DECODE_BYTES_MAX`], or has bytes left over.
    #[error("undecodable body: {reason}")]
    UndecodableBody {
        /// What bincode (or the leftover check) said.
        reason: String,
    },
}

fn cut_message(mut message: String) -> String {
    if message.len() > ERROR_MESSAGE_BYTES_MAX {
        let mut cut = ERROR_MESSAGE_BYTES_MAX;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    message
}

/// The bincode configuration of every body: standard (varint) encoding, decode limit
/// [`BODY_DECODE_BYTES_MAX`].
fn body_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<BODY_DECODE_BYTES_MAX>()
}

/// A message of one direction of the conversation.
pub trait LocalMessage: Encode + Decode<()> + Sized {
    /// Checks what the body's shape cannot: list lengths.
    fn check(&self) -> Result<(), LocalWireError>;
}

impl LocalMessage for ClientMessage {
    fn check(&self) -> Result<(), LocalWireError> {
        match self {
            ClientMessage::Discard(d) if d.pages.len() > DISCARD_PAGES_MAX => {
                Err(LocalWireError::TooManyPages {
                    pages: d.pages.len(),
                    limit: DISCARD_PAGES_MAX,
                })
            }
            _ => Ok(()),
        }
    }
}

impl LocalMessage for NodeMessage {
    fn check(&self) -> Result<(), LocalWireError> {
        Ok(())
    }
}

/// Encodes `message` as one frame (header and body). Refuses what a receiver would
/// refuse, so a frame we send is never rejected for its size.
pub fn encode_frame<M: LocalMessage>(message: &M) -> Result<Vec<u8>, LocalWireError> {
    message.check()?;
    let mut out = vec![0u8; HEADER_BYTES];
    bincode::encode_into_std_write(message, &mut out, body_config()).map_err(|e| {
        LocalWireError::UndecodableBody {
            reason: format!("encode: {e}"),
        }
    })?;
    let body_bytes = out.len() - HEADER_BYTES;
    if body_bytes > FRAME_BODY_BYTES_MAX as usize {
        return Err(LocalWireError::BodyTooLarge {
            body_bytes: u32::try_from(body_bytes).unwrap_or(u32::MAX),
            limit_bytes: FRAME_BODY_BYTES_MAX,
        });
    }
    let header = FrameHeader {
        version: PROTOCOL_VERSION,
        body_bytes: body_bytes as u32,
    };
    out[..HEADER_BYTES].copy_from_slice(&header.encode());
    Ok(out)
}

/// Decodes the body of a frame whose header passed [`FrameHeader::decode`] and
/// [`FrameHeader::check_version`]. `body` must be exactly the header's `body_bytes`.
pub fn decode_body<M: LocalMessage>(body: &[u8]) -> Result<M, LocalWireError> {
    let (message, read) = bincode::decode_from_slice::<M, _>(body, body_config()).map_err(|e| {
        let reason = match e {
            bincode::error::DecodeError::LimitExceeded => format!(
                "a length prefix claims more memory than BODY_DECODE_BYTES_MAX ({BODY_DECODE_BYTES_MAX} bytes)"
            ),
            other => other.to_string(),
        };
        LocalWireError::UndecodableBody { reason }
    })?;
    if read != body.len() {
        return Err(LocalWireError::UndecodableBody {
            reason: format!("{} bytes left over after the body", body.len() - read),
        });
    }
    message.check()?;
    Ok(message)
}

/// Decodes the frame at the start of `buf`; returns it and the bytes it took. Never
/// panics and allocates at most [`BODY_DECODE_BYTES_MAX`], whatever `buf` holds.
pub fn decode_frame<M: LocalMessage>(buf: &[u8]) -> Result<(M, usize), LocalWireError> {
    let header: &[u8; HEADER_BYTES] = buf
        .get(..HEADER_BYTES)
        .and_then(|h| h.try_into().ok())
        .ok_or(LocalWireError::Truncated {
            needed_bytes: HEADER_BYTES,
            available_bytes: buf.len(),
        })?;
    let header = FrameHeader::decode(header)?;
    header.check_version()?;
    let end = HEADER_BYTES + header.body_bytes as usize;
    let body = buf
        .get(HEADER_BYTES..end)
        .ok_or(LocalWireError::Truncated {
            needed_bytes: end,
            available_bytes: buf.len(),
        })?;
    Ok((decode_body(body)?, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BufferId;

    fn page(buffer: u64, index: u32) -> PageId {
        PageId {
            buffer: BufferId(buffer),
            index,
        }
    }

    fn op(id: u64) -> PageOp {
        PageOp {
            id,
            page: page(u64::MAX, u32::MAX),
            slot: 7,
            bytes: 2 << 20,
        }
    }

    fn client_messages() -> Vec<ClientMessage> {
        vec![
            ClientMessage::Hello(Hello {
                version: PROTOCOL_VERSION,
                page_bytes: 2 << 20,
                host_bytes: 64 << 30,
            }),
            ClientMessage::Spill(op(1)),
            ClientMessage::Fetch(op(u64::MAX)),
            ClientMessage::Discard(Discard { pages: vec![] }),
            ClientMessage::Discard(Discard {
                pages: (0..DISCARD_PAGES_MAX as u32)
                    .map(|i| page(u64::MAX - 1, u32::MAX - i))
                    .collect(),
            }),
        ]
    }

    fn node_messages() -> Vec<NodeMessage> {
        vec![
            NodeMessage::Welcome(Welcome {
                client: 3,
                host_bytes: 1 << 30,
                remote_capacity_bytes: u64::MAX,
                bandwidth_hint_bytes_per_s: 5_000_000_000,
            }),
            NodeMessage::Refused(Refused::new(RefusedCode::TooManyClients, "64 clients")),
            NodeMessage::Done(Done {
                id: 9,
                result: Ok(()),
            }),
            NodeMessage::Done(Done {
                id: 10,
                result: Err(OpError::new(OpErrorCode::Remote, "page not held")),
            }),
            NodeMessage::Done(Done {
                id: 11,
                result: Err(OpError::new(OpErrorCode::PageLost, "holder 3 is down")),
            }),
        ]
    }

    #[test]
    fn header_layout_is_fixed() {
        let h = FrameHeader {
            version: 0x0102,
            body_bytes: 0x0a0b_0c0d,
        }
        .encode();
        assert_eq!(&h[0..4], b"SPWL");
        assert_eq!(h[4..6], [0x02, 0x01]);
        assert_eq!(h[6..8], [0, 0]);
        assert_eq!(h[8..12], [0x0d, 0x0c, 0x0b, 0x0a]);
    }

    #[test]
    fn every_message_round_trips() {
        for m in client_messages() {
            let frame = encode_frame(&m).unwrap();
            assert!(frame.len() - HEADER_BYTES <= FRAME_BODY_BYTES_MAX as usize);
            let (back, used) = decode_frame::<ClientMessage>(&frame).unwrap();
            assert_eq!(back, m);
            assert_eq!(used, frame.len());
        }
        for m in node_messages() {
            let frame = encode_frame(&m).unwrap();
            let (back, used) = decode_frame::<NodeMessage>(&frame).unwrap();
            assert_eq!(back, m);
            assert_eq!(used, frame.len());
        }
    }

    #[test]
    fn frames_decode_back_to_back() {
        let mut buf = encode_frame(&ClientMessage::Spill(op(1))).unwrap();
        buf.extend(encode_frame(&ClientMessage::Fetch(op(2))).unwrap());
        let (first, used) = decode_frame::<ClientMessage>(&buf).unwrap();
        assert_eq!(first, ClientMessage::Spill(op(1)));
        let (second, _) = decode_frame::<ClientMessage>(&buf[used..]).unwrap();
        assert_eq!(second, ClientMessage::Fetch(op(2)));
    }

    #[test]
    fn bad_magic_reserved_and_version_are_refused() {
        let good = encode_frame(&ClientMessage::Spill(op(1))).unwrap();
        let mut bad = good.clone();
        bad[0] = b'X';
        assert_eq!(
            decode_frame::<ClientMessage>(&bad),
            Err(LocalWireError::BadMagic { found: *b"XPWL" })
        );
        let mut bad = good.clone();
        bad[7] = 1;
        assert_eq!(
            decode_frame::<ClientMessage>(&bad),
            Err(LocalWireError::ReservedNotZero { reserved: 0x100 })
        );
        let mut bad = good.clone();
        bad[4] = 9;
        let header = FrameHeader::decode(bad[..HEADER_BYTES].try_into().unwrap()).unwrap();
        assert_eq!(header.version, 9);
        assert_eq!(
            header.check_version(),
            Err(LocalWireError::UnsupportedVersion {
                found: 9,
                supported: PROTOCOL_VERSION
            })
        );
        assert_eq!(
            decode_frame::<ClientMessage>(&bad),
            Err(LocalWireError::UnsupportedVersion {
                found: 9,
                supported: PROTOCOL_VERSION
            })
        );
    }

    #[test]
    fn oversized_body_is_refused_from_the_header() {
        let header = FrameHeader {
            version: PROTOCOL_VERSION,
            body_bytes: FRAME_BODY_BYTES_MAX + 1,
        }
        .encode();
        // Only the header is there: the length is refused before any body is read.
        assert_eq!(
            decode_frame::<ClientMessage>(&header),
            Err(LocalWireError::BodyTooLarge {
                body_bytes: FRAME_BODY_BYTES_MAX + 1,
                limit_bytes: FRAME_BODY_BYTES_MAX
            })
        );
        let header = FrameHeader {
            version: PROTOCOL_VERSION,
            body_bytes: u32::MAX,
        }
        .encode();
        assert!(matches!(
            FrameHeader::decode(&header),
            Err(LocalWireError::BodyTooLarge {
                body_bytes: u32::MAX,
                ..
            })
        ));
    }

    #[test]
    fn too_many_discarded_pages_are_refused_both_ways() {
        let m = ClientMessage::Discard(Discard {
            pages: vec![page(1, 0); DISCARD_PAGES_MAX + 1],
        });
        let expected = Err(LocalWireError::TooManyPages {
            pages: DISCARD_PAGES_MAX + 1,
            limit: DISCARD_PAGES_MAX,
        });
        assert_eq!(encode_frame(&m).map(|_| ()), expected);
        // Encoded by hand, as a hostile client would.
        let body = bincode::encode_to_vec(&m, bincode::config::standard()).unwrap();
        assert_eq!(decode_body::<ClientMessage>(&body).map(|_| ()), expected);
    }

    #[test]
    fn hostile_length_prefix_hits_the_decode_limit() {
        // Variant 3 (Discard), then a varint length of u64::MAX (253: eight bytes follow).
        let body = [3u8, 253, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        let err = decode_body::<ClientMessage>(&body).unwrap_err();
        match err {
            LocalWireError::UndecodableBody { reason } => {
                assert!(reason.contains("BODY_DECODE_BYTES_MAX"), "{reason}")
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn truncated_and_trailing_frames_are_refused() {
        let frame = encode_frame(&ClientMessage::Spill(op(1))).unwrap();
        assert_eq!(
            decode_frame::<ClientMessage>(&frame[..5]),
            Err(LocalWireError::Truncated {
                needed_bytes: HEADER_BYTES,
                available_bytes: 5
            })
        );
        assert_eq!(
            decode_frame::<ClientMessage>(&frame[..frame.len() - 1]),
            Err(LocalWireError::Truncated {
                needed_bytes: frame.len(),
                available_bytes: frame.len() - 1
            })
        );
        let mut body = frame[HEADER_BYTES..].to_vec();
        body.push(0);
        assert_eq!(
            decode_body::<ClientMessage>(&body),
            Err(LocalWireError::UndecodableBody {
                reason: "1 bytes left over after the body".into()
            })
        );
    }

    #[test]
    fn a_node_message_is_not_a_client_message() {
        // Variant 4 does not exist on the client side.
        let body = [4u8, 0];
        assert!(matches!(
            decode_body::<ClientMessage>(&body),
            Err(LocalWireError::UndecodableBody { .. })
        ));
    }

    #[test]
    fn error_texts_are_cut_at_the_limit() {
        let r = Refused::new(
            RefusedCode::Unavailable,
            "é".repeat(ERROR_MESSAGE_BYTES_MAX),
        );
        assert_eq!(r.message.len(), ERROR_MESSAGE_BYTES_MAX);
        let e = OpError::new(OpErrorCode::Remote, "x".repeat(5000));
        assert_eq!(e.message.len(), ERROR_MESSAGE_BYTES_MAX);
        // The largest node message still fits a frame.
        let frame = encode_frame(&NodeMessage::Done(Done {
            id: u64::MAX,
            result: Err(e),
        }))
        .unwrap();
        assert!(frame.len() < FRAME_BODY_BYTES_MAX as usize);
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = decode_frame::<ClientMessage>(&bytes);
            let _ = decode_frame::<NodeMessage>(&bytes);
            let _ = decode_body::<ClientMessage>(&bytes);
            let _ = decode_body::<NodeMessage>(&bytes);
        }
    }
}
