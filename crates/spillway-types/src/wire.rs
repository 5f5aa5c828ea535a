//! Frames of the peer page service: what one node sends another over QUIC (or any stream).
//!
//! A frame is three parts, back to back:
//!
//! ```text
//! ┌──────────────────────┬──────────────────────────┬───────────────────────────────┐
//! │ header, 32 bytes      │ body, `body_bytes`       │ payload, `payload_bytes`      │
//! │ fixed layout (below)  │ bincode 2, size-limited  │ raw page bytes, concatenated  │
//! └──────────────────────┴──────────────────────────┴───────────────────────────────┘
//! ```
//!
//! Header layout (all integers little-endian):
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0  | 4 | magic, `b"SPWY"` ([`MAGIC`]) |
//! | 4  | 2 | protocol version ([`PROTOCOL_VERSION`]) |
//! | 6  | 1 | kind ([`Kind`]) |
//! | 7  | 1 | flags, must be 0 |
//! | 8  | 8 | request id (a reply carries its request's id) |
//! | 16 | 4 | body length in bytes, at most [`FRAME_BODY_BYTES_MAX`] |
//! | 20 | 4 | reserved, must be 0 |
//! | 24 | 8 | payload length in bytes, at most [`FRAME_PAYLOAD_BYTES_MAX`] |
//!
//! Invariants a receiver checks, in this order, before it allocates anything sized by the
//! peer: the header is whole, magic and version match, the kind is known, flags and
//! reserved are zero, both lengths are within their limits ([`FrameHeader::decode`]).
//! Then the body is decoded with bincode under [`BODY_DECODE_BYTES_MAX`] (bincode 2
//! without a limit aborts the process on a hostile length prefix), and the page
//! descriptors it holds must add up to exactly the payload length ([`decode_body`]).
//! Finally every page of the payload must match its xxh3-64 checksum ([`verify_pages`]).
//!
//! Page bytes never go through the serializer: the body only describes them
//! ([`PageDesc`]: id, length, checksum) and they follow as one raw payload, in the order of
//! the descriptors, so a transport can send them from and receive them into page buffers.
//!
//! This module does no IO: a transport reads the header, then the body, then the payload,
//! and calls the matching check after each. [`decode_frame`] does all three on one buffer.
//!
//! Besides pages, the payload may carry one opaque **blob** (kinds [`Kind::carries_blob`]:
//! a Raft message, a forwarded proposal and its reply). The body of such a frame is a
//! [`Blob`]: the blob cut in chunks of at most [`BLOB_CHUNK_BYTES`], each described like a
//! page (chunk `i` is named `PageId { buffer: BufferId(0), index: i }`) with its length and
//! checksum, so the same length and checksum checks cover it. What the blob holds is not
//! this module's business: the node decodes it with the bound of its own codec, after the
//! blob passed these checks. A blob frame's payload is bounded per kind
//! ([`Kind::payload_bytes_max`]): [`RAFT_PAYLOAD_BYTES_MAX`] for Raft messages (a snapshot
//! travels in one), [`PROPOSAL_PAYLOAD_BYTES_MAX`] for proposals and their replies.
//!
//! Version history: 1, pages only; 2, the blob kinds (10 to 13).
//!
//! Parts: this file holds the limits, the header, the messages and the frame codec;
//! `error` holds [`WireError`]; `payload` the page checks ([`verify_pages`],
//! [`PayloadVerifier`]).

use bincode::{Decode, Encode};

use crate::{NodeId, PageId, PoolId, limits};

mod error;
mod payload;

pub use error::WireError;
pub use payload::{PayloadVerifier, page_ranges, pages_bytes, verify_pages};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"SPWY";
/// The protocol version this build speaks. A frame of any other version is refused
/// ([`WireError::UnsupportedVersion`]); the [`Hello`] exchange catches a mismatch first.
pub const PROTOCOL_VERSION: u16 = 3;
/// Size of the fixed frame header.
pub const HEADER_BYTES: usize = 32;

/// Largest frame body: 64 KiB. A receiver holds one body buffer per stream being read,
/// so the worst case is this times the streams a connection may open at once
/// (64 KiB x 64 streams = 4 MiB per connection). 1024 page descriptors take at most
/// 1024 x 24 bytes on the wire, well inside it.
pub const FRAME_BODY_BYTES_MAX: u32 = 64 << 10;
/// Most memory bincode may claim while decoding one body: 64 KiB (bincode counts
/// `len x size_of::<T>()` for each container before it allocates it). This is the `N` of
/// `config::standard().with_limit::<N>()`; a length prefix that claims more is an error,
/// not an allocation.
pub const BODY_DECODE_BYTES_MAX: usize = 64 << 10;
/// Largest payload of one frame: 128 MiB (two pages of the largest size, or 64 pages of
/// 2 MiB). A receiver allocates the payload before reading it, after it has taken that
/// many bytes from its peer's in-flight budget, so the real worst case per peer is that
/// budget, not this times the streams.
pub const FRAME_PAYLOAD_BYTES_MAX: u64 = 2 * limits::PAGE_BYTES_MAX;
/// Largest chunk of a blob: 16 MiB. A blob of `n` bytes takes `ceil(n / 16 MiB)` chunk
/// descriptors (80 for the largest Raft message), far below [`PAGES_PER_FRAME_MAX`].
pub const BLOB_CHUNK_BYTES: u64 = 16 << 20;
/// Largest payload of a [`Kind::RaftMessage`] frame: 1.25 GiB, the bound of
/// `spillway_meta::limits::RAFT_MESSAGE_BYTES_MAX` (a snapshot of a full directory travels
/// in one message; spillway-node checks the two agree). The receiver takes the bytes from
/// the peer's in-flight budget before it allocates them, so this is the most one message
/// can make a node allocate, not a per-stream multiple.
pub const RAFT_PAYLOAD_BYTES_MAX: u64 = (1 << 30) + (256 << 20);
const _: () = assert!(RAFT_PAYLOAD_BYTES_MAX > FRAME_PAYLOAD_BYTES_MAX);
const _: () = assert!(BLOB_CHUNK_BYTES <= limits::PAGE_BYTES_MAX);

/// Largest payload of a [`Kind::Propose`] or [`Kind::ProposeReply`] frame: 16 MiB, the
/// decode bound of a command in spillway-meta (`COMMAND_DECODE_BYTES_MAX`); a full batch
/// of 16384 updates encodes to about 0.7 MiB.
pub const PROPOSAL_PAYLOAD_BYTES_MAX: u64 = 16 << 20;
/// Largest payload of a [`Kind::UcxConnect`] or [`Kind::UcxConnectReply`] frame: 64 KiB
/// plus 4 bytes, a connection id and a UCX worker address (a few hundred bytes over TCP,
/// more with RDMA devices).
pub const UCX_CONNECT_PAYLOAD_BYTES_MAX: u64 = (64 << 10) + 4;
/// Most pages one frame may describe: 1024 (1024 x 32 bytes = 32 KiB of decoded
/// descriptors, inside [`BODY_DECODE_BYTES_MAX`]).
pub const PAGES_PER_FRAME_MAX: usize = 1024;
/// Longest message text of an [`ErrorReply`]: 1 KiB; longer text is cut when the reply is built.
pub const ERROR_MESSAGE_BYTES_MAX: usize = 1 << 10;

/// The checksum every page carries: xxh3-64 of its bytes.
pub fn page_checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// What a frame is. The header names it, and the body is decoded as that kind's struct.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// First frame of a connection, from the side that connected: [`Hello`].
    Hello = 1,
    /// The accepting side's answer to [`Kind::Hello`]: [`Hello`].
    HelloReply = 2,
    /// Store pages: [`PutPages`], with a payload.
    PutPages = 3,
    /// Answer to [`Kind::PutPages`]: [`PutPagesReply`].
    PutPagesReply = 4,
    /// Fetch pages: [`GetPages`].
    GetPages = 5,
    /// Answer to [`Kind::GetPages`]: [`GetPagesReply`], with a payload.
    GetPagesReply = 6,
    /// Drop pages: [`DeletePages`].
    DeletePages = 7,
    /// Answer to [`Kind::DeletePages`]: [`DeletePagesReply`].
    DeletePagesReply = 8,
    /// Answer to any request that failed: [`ErrorReply`].
    Error = 9,
    /// A Raft message (raft-rs protobuf bytes) as the blob of a [`Blob`] body.
    RaftMessage = 10,
    /// Answer to [`Kind::RaftMessage`]: an empty [`Blob`] (the message was handed to Raft).
    RaftMessageReply = 11,
    /// A proposal forwarded to the leader (an encoded `spillway_meta::Batch`) as the blob.
    Propose = 12,
    /// Answer to [`Kind::Propose`]: the outcome (encoded by the node) as the blob.
    ProposeReply = 13,
    /// An offer to move pages over UCX: the sender's connection id and UCX worker address
    /// as the blob. Sent over an authenticated connection, so the address is trusted.
    UcxConnect = 14,
    /// Answer to [`Kind::UcxConnect`]: the accepting side's connection id and address.
    UcxConnectReply = 15,
}

impl Kind {
    /// Every kind, in wire order.
    pub const ALL: [Kind; 15] = [
        Kind::Hello,
        Kind::HelloReply,
        Kind::PutPages,
        Kind::PutPagesReply,
        Kind::GetPages,
        Kind::GetPagesReply,
        Kind::DeletePages,
        Kind::DeletePagesReply,
        Kind::Error,
        Kind::RaftMessage,
        Kind::RaftMessageReply,
        Kind::Propose,
        Kind::ProposeReply,
        Kind::UcxConnect,
        Kind::UcxConnectReply,
    ];

    /// The kind with wire value `value`, if there is one.
    pub fn from_u8(value: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u8 == value)
    }

    /// Whether frames of this kind may carry a page payload.
    pub fn carries_pages(self) -> bool {
        matches!(self, Kind::PutPages | Kind::GetPagesReply)
    }

    /// Whether frames of this kind carry a blob (a [`Blob`] body and its bytes as payload).
    pub fn carries_blob(self) -> bool {
        matches!(
            self,
            Kind::RaftMessage
                | Kind::RaftMessageReply
                | Kind::Propose
                | Kind::ProposeReply
                | Kind::UcxConnect
                | Kind::UcxConnectReply
        )
    }

    /// Largest payload a frame of this kind may carry: [`FRAME_PAYLOAD_BYTES_MAX`] for
    /// pages, [`RAFT_PAYLOAD_BYTES_MAX`], [`PROPOSAL_PAYLOAD_BYTES_MAX`] or
    /// [`UCX_CONNECT_PAYLOAD_BYTES_MAX`] for blobs, 0 for the rest.
    pub fn payload_bytes_max(self) -> u64 {
        match self {
            Kind::PutPages | Kind::GetPagesReply => FRAME_PAYLOAD_BYTES_MAX,
            Kind::RaftMessage => RAFT_PAYLOAD_BYTES_MAX,
            Kind::Propose | Kind::ProposeReply => PROPOSAL_PAYLOAD_BYTES_MAX,
            Kind::UcxConnect | Kind::UcxConnectReply => UCX_CONNECT_PAYLOAD_BYTES_MAX,
            _ => 0,
        }
    }
}

/// The fixed-size header of a frame (layout in the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the body is.
    pub kind: Kind,
    /// Chosen by the requester; a reply carries the id of its request.
    pub request_id: u64,
    /// Length of the body that follows the header.
    pub body_bytes: u32,
    /// Length of the page payload that follows the body.
    pub payload_bytes: u64,
}

impl FrameHeader {
    /// The header as it goes on the wire.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out[6] = self.kind as u8;
        out[7] = 0;
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.body_bytes.to_le_bytes());
        out[20..24].copy_from_slice(&0u32.to_le_bytes());
        out[24..32].copy_from_slice(&self.payload_bytes.to_le_bytes());
        out
    }

    /// Checks and reads a header. After this succeeds, the body and payload lengths are
    /// within [`FRAME_BODY_BYTES_MAX`] and [`FRAME_PAYLOAD_BYTES_MAX`], and a kind that
    /// carries no pages has an empty payload.
    pub fn decode(bytes: &[u8; HEADER_BYTES]) -> Result<FrameHeader, WireError> {
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let u32_at = |at: usize| {
            u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes in the header"))
        };
        let u64_at = |at: usize| {
            u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes in the header"))
        };
        let magic: [u8; 4] = bytes[0..4].try_into().expect("4 bytes in the header");
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        let version = u16_at(4);
        if version != PROTOCOL_VERSION {
            return Err(WireError::UnsupportedVersion {
                found: version,
                supported: PROTOCOL_VERSION,
            });
        }
        let kind = Kind::from_u8(bytes[6]).ok_or(WireError::UnknownKind { found: bytes[6] })?;
        let flags = bytes[7];
        let reserved = u32_at(20);
        if flags != 0 || reserved != 0 {
            return Err(WireError::ReservedNotZero { flags, reserved });
        }
        let body_bytes = u32_at(16);
        if body_bytes > FRAME_BODY_BYTES_MAX {
            return Err(WireError::BodyTooLarge {
                body_bytes: body_bytes.into(),
                limit_bytes: FRAME_BODY_BYTES_MAX,
            });
        }
        let payload_bytes = u64_at(24);
        let limit_bytes = kind.payload_bytes_max();
        if payload_bytes > limit_bytes && limit_bytes > 0 {
            return Err(WireError::PayloadTooLarge {
                payload_bytes,
                limit_bytes,
            });
        }
        if limit_bytes == 0 && payload_bytes != 0 {
            return Err(WireError::PayloadMismatch {
                kind,
                payload_bytes,
                pages_bytes: 0,
            });
        }
        Ok(FrameHeader {
            kind,
            request_id: u64_at(8),
            body_bytes,
            payload_bytes,
        })
    }
}

/// First frame each way on a connection: who is speaking, for which pool, which version.
/// Mutual TLS already proved the peer holds a certificate of the pool's CA; this names
/// the node and catches a version or pool mismatch with a clear error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode)]
pub struct Hello {
    /// The pool the speaker belongs to.
    pub pool_id: PoolId,
    /// The speaker.
    pub node_id: NodeId,
    /// The protocol version the speaker runs ([`PROTOCOL_VERSION`]).
    pub protocol_version: u16,
}

/// Describes one page of a payload: which page, how long, and its checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode)]
pub struct PageDesc {
    /// The page.
    pub page: PageId,
    /// Its length in bytes (at most [`limits::PAGE_BYTES_MAX`]; the last page of a buffer may be short).
    pub len: u32,
    /// [`page_checksum`] of its bytes.
    pub checksum: u64,
}

impl PageDesc {
    /// The descriptor of `page` whose bytes are `data` (computes the checksum).
    ///
    /// # Panics
    /// If `data` is longer than [`limits::PAGE_BYTES_MAX`]: pages that large do not exist.
    pub fn for_page(page: PageId, data: &[u8]) -> PageDesc {
        assert!(
            data.len() as u64 <= limits::PAGE_BYTES_MAX,
            "page {page} of {} bytes is larger than PAGE_BYTES_MAX",
            data.len()
        );
        PageDesc {
            page,
            len: data.len() as u32,
            checksum: page_checksum(data),
        }
    }
}

/// Store these pages (they follow as the payload). Pages already held are overwritten.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct PutPages {
    /// The pages, in payload order.
    pub pages: Vec<PageDesc>,
}

/// The pages of a [`PutPages`] are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode)]
pub struct PutPagesReply {
    /// How many pages were stored (all of them: a put that cannot store them all is an error).
    pub pages_stored: u32,
}

/// Send back these pages.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct GetPages {
    /// The pages wanted.
    pub pages: Vec<PageId>,
}

/// The pages found (in the payload) and those the node does not hold.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct GetPagesReply {
    /// The pages found, in payload order.
    pub pages: Vec<PageDesc>,
    /// The pages asked for that the node does not hold.
    pub missing: Vec<PageId>,
}

/// Drop these pages.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct DeletePages {
    /// The pages to drop.
    pub pages: Vec<PageId>,
}

/// The pages of a [`DeletePages`] are gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode)]
pub struct DeletePagesReply {
    /// How many of them the node held and dropped.
    pub pages_deleted: u32,
    /// How many of them the node did not hold.
    pub pages_missing: u32,
}

/// The body of a blob frame ([`Kind::carries_blob`]): the blob's chunks, in payload order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Encode, Decode)]
pub struct Blob {
    /// Chunk `i` is `PageId { buffer: BufferId(0), index: i }`, at most
    /// [`BLOB_CHUNK_BYTES`] long, with its checksum.
    pub chunks: Vec<PageDesc>,
}

impl Blob {
    /// The descriptors of `data` cut in chunks of [`BLOB_CHUNK_BYTES`] (checksums computed).
    pub fn describe(data: &[u8]) -> Blob {
        Blob {
            chunks: data
                .chunks(BLOB_CHUNK_BYTES as usize)
                .enumerate()
                .map(|(i, c)| PageDesc::for_page(blob_chunk_id(i), c))
                .collect(),
        }
    }

    /// The blob's length in bytes.
    pub fn len(&self) -> u64 {
        pages_bytes(&self.chunks)
    }

    /// Whether the blob is empty.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Why the chunk list is not one a sender builds, if it is not.
    fn invalid_reason(&self) -> Option<String> {
        for (i, c) in self.chunks.iter().enumerate() {
            if c.page != blob_chunk_id(i) {
                return Some(format!("blob chunk {i} is named {}", c.page));
            }
            if u64::from(c.len) > BLOB_CHUNK_BYTES {
                return Some(format!(
                    "blob chunk {i} has {} bytes, more than BLOB_CHUNK_BYTES ({BLOB_CHUNK_BYTES})",
                    c.len
                ));
            }
        }
        None
    }
}

/// The name of chunk `i` of a blob.
fn blob_chunk_id(i: usize) -> PageId {
    PageId {
        buffer: crate::BufferId(0),
        index: u32::try_from(i).unwrap_or(u32::MAX),
    }
}

/// Why a request failed, as a code a program can act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Encode, Decode)]
pub enum ErrorCode {
    /// The request was well-formed but makes no sense (for example a reply kind sent as a request).
    BadRequest,
    /// The peer belongs to another pool.
    PoolMismatch,
    /// The peer speaks another protocol version.
    VersionMismatch,
    /// The node has no room for the pages.
    NoCapacity,
    /// The node is shutting down or overloaded; try again or elsewhere.
    Unavailable,
    /// The node failed for a reason of its own.
    Internal,
    /// The peer's hello names another node than its certificate does (or its certificate
    /// names none): it is refused, whatever else it says.
    IdentityMismatch,
}

/// A request failed.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct ErrorReply {
    /// What went wrong, for programs.
    pub code: ErrorCode,
    /// What went wrong, for people (at most [`ERROR_MESSAGE_BYTES_MAX`] bytes).
    pub message: String,
}

impl ErrorReply {
    /// An error reply; `message` is cut to [`ERROR_MESSAGE_BYTES_MAX`] bytes (at a character boundary).
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ErrorReply {
        let mut message = message.into();
        if message.len() > ERROR_MESSAGE_BYTES_MAX {
            let mut cut = ERROR_MESSAGE_BYTES_MAX;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        ErrorReply { code, message }
    }
}

/// The body of a frame, one variant per [`Kind`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// [`Kind::Hello`].
    Hello(Hello),
    /// [`Kind::HelloReply`].
    HelloReply(Hello),
    /// [`Kind::PutPages`].
    PutPages(PutPages),
    /// [`Kind::PutPagesReply`].
    PutPagesReply(PutPagesReply),
    /// [`Kind::GetPages`].
    GetPages(GetPages),
    /// [`Kind::GetPagesReply`].
    GetPagesReply(GetPagesReply),
    /// [`Kind::DeletePages`].
    DeletePages(DeletePages),
    /// [`Kind::DeletePagesReply`].
    DeletePagesReply(DeletePagesReply),
    /// [`Kind::Error`].
    Error(ErrorReply),
    /// [`Kind::RaftMessage`].
    RaftMessage(Blob),
    /// [`Kind::RaftMessageReply`].
    RaftMessageReply(Blob),
    /// [`Kind::Propose`].
    Propose(Blob),
    /// [`Kind::ProposeReply`].
    ProposeReply(Blob),
    /// [`Kind::UcxConnect`].
    UcxConnect(Blob),
    /// [`Kind::UcxConnectReply`].
    UcxConnectReply(Blob),
}

impl Message {
    /// The kind the header carries for this body.
    pub fn kind(&self) -> Kind {
        match self {
            Message::Hello(_) => Kind::Hello,
            Message::HelloReply(_) => Kind::HelloReply,
            Message::PutPages(_) => Kind::PutPages,
            Message::PutPagesReply(_) => Kind::PutPagesReply,
            Message::GetPages(_) => Kind::GetPages,
            Message::GetPagesReply(_) => Kind::GetPagesReply,
            Message::DeletePages(_) => Kind::DeletePages,
            Message::DeletePagesReply(_) => Kind::DeletePagesReply,
            Message::Error(_) => Kind::Error,
            Message::RaftMessage(_) => Kind::RaftMessage,
            Message::RaftMessageReply(_) => Kind::RaftMessageReply,
            Message::Propose(_) => Kind::Propose,
            Message::ProposeReply(_) => Kind::ProposeReply,
            Message::UcxConnect(_) => Kind::UcxConnect,
            Message::UcxConnectReply(_) => Kind::UcxConnectReply,
        }
    }

    /// The pages the payload holds, in order (empty for kinds without pages).
    pub fn page_descs(&self) -> &[PageDesc] {
        match self {
            Message::PutPages(m) => &m.pages,
            Message::GetPagesReply(m) => &m.pages,
            Message::RaftMessage(b)
            | Message::RaftMessageReply(b)
            | Message::Propose(b)
            | Message::ProposeReply(b)
            | Message::UcxConnect(b)
            | Message::UcxConnectReply(b) => &b.chunks,
            _ => &[],
        }
    }

    /// How many page ids or descriptors the body lists (bounded by [`PAGES_PER_FRAME_MAX`]).
    fn pages_listed(&self) -> usize {
        match self {
            Message::PutPages(m) => m.pages.len(),
            Message::GetPages(m) => m.pages.len(),
            Message::GetPagesReply(m) => m.pages.len() + m.missing.len(),
            Message::DeletePages(m) => m.pages.len(),
            Message::RaftMessage(b)
            | Message::RaftMessageReply(b)
            | Message::Propose(b)
            | Message::ProposeReply(b)
            | Message::UcxConnect(b)
            | Message::UcxConnectReply(b) => b.chunks.len(),
            _ => 0,
        }
    }
}

/// The bincode configuration of every body: standard (varint) encoding, and a decode
/// limit of [`BODY_DECODE_BYTES_MAX`].
fn body_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<BODY_DECODE_BYTES_MAX>()
}

/// Encodes `message` as a frame header and body (the payload, the pages' bytes in the
/// order of [`Message::page_descs`], goes after it). Refuses what a receiver would refuse,
/// so a frame we send is never rejected for its size.
pub fn encode_frame(request_id: u64, message: &Message) -> Result<Vec<u8>, WireError> {
    check_pages(message)?;
    let payload_bytes = pages_bytes(message.page_descs());
    let limit_bytes = message.kind().payload_bytes_max();
    if payload_bytes > limit_bytes {
        return Err(WireError::PayloadTooLarge {
            payload_bytes,
            limit_bytes,
        });
    }
    let mut out = vec![0u8; HEADER_BYTES];
    let config = body_config();
    let encoded = match message {
        Message::Hello(m) | Message::HelloReply(m) => {
            bincode::encode_into_std_write(m, &mut out, config)
        }
        Message::PutPages(m) => bincode::encode_into_std_write(m, &mut out, config),
        Message::PutPagesReply(m) => bincode::encode_into_std_write(m, &mut out, config),
        Message::GetPages(m) => bincode::encode_into_std_write(m, &mut out, config),
        Message::GetPagesReply(m) => bincode::encode_into_std_write(m, &mut out, config),
        Message::DeletePages(m) => bincode::encode_into_std_write(m, &mut out, config),
        Message::DeletePagesReply(m) => bincode::encode_into_std_write(m, &mut out, config),
        Message::Error(m) => bincode::encode_into_std_write(m, &mut out, config),
        Message::RaftMessage(m)
        | Message::RaftMessageReply(m)
        | Message::Propose(m)
        | Message::ProposeReply(m)
        | Message::UcxConnect(m)
        | Message::UcxConnectReply(m) => bincode::encode_into_std_write(m, &mut out, config),
    };
    // Encoding plain structs into a Vec cannot fail; keep the error typed all the same.
    encoded.map_err(|e| WireError::UndecodableBody {
        kind: message.kind(),
        reason: format!("encode: {e}"),
    })?;
    let body_bytes = (out.len() - HEADER_BYTES) as u64;
    if body_bytes > u64::from(FRAME_BODY_BYTES_MAX) {
        return Err(WireError::BodyTooLarge {
            body_bytes,
            limit_bytes: FRAME_BODY_BYTES_MAX,
        });
    }
    let header = FrameHeader {
        kind: message.kind(),
        request_id,
        body_bytes: body_bytes as u32,
        payload_bytes,
    };
    out[..HEADER_BYTES].copy_from_slice(&header.encode());
    Ok(out)
}

/// Decodes the body of a frame whose header passed [`FrameHeader::decode`]. `body` must be
/// exactly `header.body_bytes` long. On success the message's page descriptors add up to
/// `header.payload_bytes`, none is larger than a page, and there are at most
/// [`PAGES_PER_FRAME_MAX`] of them.
pub fn decode_body(header: &FrameHeader, body: &[u8]) -> Result<Message, WireError> {
    if body.len() as u64 != u64::from(header.body_bytes) {
        return Err(WireError::Truncated {
            needed_bytes: header.body_bytes.into(),
            available_bytes: body.len() as u64,
        });
    }
    let kind = header.kind;
    let message = match kind {
        Kind::Hello => Message::Hello(decode_exact(kind, body)?),
        Kind::HelloReply => Message::HelloReply(decode_exact(kind, body)?),
        Kind::PutPages => Message::PutPages(decode_exact(kind, body)?),
        Kind::PutPagesReply => Message::PutPagesReply(decode_exact(kind, body)?),
        Kind::GetPages => Message::GetPages(decode_exact(kind, body)?),
        Kind::GetPagesReply => Message::GetPagesReply(decode_exact(kind, body)?),
        Kind::DeletePages => Message::DeletePages(decode_exact(kind, body)?),
        Kind::DeletePagesReply => Message::DeletePagesReply(decode_exact(kind, body)?),
        Kind::Error => Message::Error(decode_exact(kind, body)?),
        Kind::RaftMessage => Message::RaftMessage(decode_exact(kind, body)?),
        Kind::RaftMessageReply => Message::RaftMessageReply(decode_exact(kind, body)?),
        Kind::Propose => Message::Propose(decode_exact(kind, body)?),
        Kind::ProposeReply => Message::ProposeReply(decode_exact(kind, body)?),
        Kind::UcxConnect => Message::UcxConnect(decode_exact(kind, body)?),
        Kind::UcxConnectReply => Message::UcxConnectReply(decode_exact(kind, body)?),
    };
    check_pages(&message)?;
    let pages_bytes = pages_bytes(message.page_descs());
    if pages_bytes != header.payload_bytes {
        return Err(WireError::PayloadMismatch {
            kind,
            payload_bytes: header.payload_bytes,
            pages_bytes,
        });
    }
    Ok(message)
}

/// Decodes one struct with the limited configuration and refuses leftover bytes (a body
/// with a tail is as malformed as one cut short).
fn decode_exact<T: Decode<()>>(kind: Kind, body: &[u8]) -> Result<T, WireError> {
    let (value, read) = bincode::decode_from_slice::<T, _>(body, body_config()).map_err(|e| {
        let reason = match e {
            bincode::error::DecodeError::LimitExceeded => format!(
                "a length prefix claims more memory than BODY_DECODE_BYTES_MAX ({BODY_DECODE_BYTES_MAX} bytes)"
            ),
            other => other.to_string(),
        };
        WireError::UndecodableBody { kind, reason }
    })?;
    if read != body.len() {
        return Err(WireError::UndecodableBody {
            kind,
            reason: format!("{} bytes left over after the body", body.len() - read),
        });
    }
    Ok(value)
}

fn check_pages(message: &Message) -> Result<(), WireError> {
    let listed = message.pages_listed();
    if listed > PAGES_PER_FRAME_MAX {
        return Err(WireError::TooManyPages {
            pages: listed,
            limit: PAGES_PER_FRAME_MAX,
        });
    }
    if let Message::RaftMessage(b)
    | Message::RaftMessageReply(b)
    | Message::Propose(b)
    | Message::ProposeReply(b)
    | Message::UcxConnect(b)
    | Message::UcxConnectReply(b) = message
        && let Some(reason) = b.invalid_reason()
    {
        return Err(WireError::UndecodableBody {
            kind: message.kind(),
            reason,
        });
    }
    for d in message.page_descs() {
        if u64::from(d.len) > limits::PAGE_BYTES_MAX {
            return Err(WireError::PageTooLarge {
                page: d.page,
                page_bytes: d.len,
                limit_bytes: limits::PAGE_BYTES_MAX,
            });
        }
    }
    Ok(())
}

/// A whole frame decoded from one buffer (see [`decode_frame`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The header.
    pub header: FrameHeader,
    /// The body.
    pub message: Message,
    /// The payload: the pages of [`Message::page_descs`], back to back, checksums verified.
    pub payload: &'a [u8],
}

/// Decodes and checks the frame at the start of `buf`: header, body, payload and every
/// page checksum. Returns the frame and how many bytes of `buf` it took. Never panics and
/// never allocates more than [`FRAME_BODY_BYTES_MAX`] plus what bincode's limit allows,
/// whatever `buf` holds.
pub fn decode_frame(buf: &[u8]) -> Result<(Frame<'_>, usize), WireError> {
    let header_bytes: &[u8; HEADER_BYTES] = buf
        .get(..HEADER_BYTES)
        .and_then(|h| h.try_into().ok())
        .ok_or(WireError::Truncated {
            needed_bytes: HEADER_BYTES as u64,
            available_bytes: buf.len() as u64,
        })?;
    let header = FrameHeader::decode(header_bytes)?;
    let body_end = HEADER_BYTES + header.body_bytes as usize;
    let body = buf
        .get(HEADER_BYTES..body_end)
        .ok_or(WireError::Truncated {
            needed_bytes: body_end as u64,
            available_bytes: buf.len() as u64,
        })?;
    let message = decode_body(&header, body)?;
    // Lengths are bounded by the header checks, so this sum cannot overflow.
    let frame_end = body_end as u64 + header.payload_bytes;
    let payload = buf
        .get(body_end..frame_end as usize)
        .ok_or(WireError::Truncated {
            needed_bytes: frame_end,
            available_bytes: buf.len() as u64,
        })?;
    verify_pages(message.page_descs(), payload)?;
    Ok((
        Frame {
            header,
            message,
            payload,
        },
        frame_end as usize,
    ))
}

#[cfg(test)]
mod tests;
