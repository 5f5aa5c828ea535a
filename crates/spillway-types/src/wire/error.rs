//! [`WireError`]: everything a receiver can find wrong with a frame, in the order
//! [`super`]'s module docs list the checks.

use super::{Kind, MAGIC};
use crate::PageId;

/// Everything that can be wrong with a frame. On receipt, any of these means the peer is
/// broken or hostile: the transport drops the connection and counts a rejected frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The first four bytes are not [`MAGIC`]: not a Spillway frame, or the stream lost its place.
    #[error("bad frame magic {found:02x?} (expected {MAGIC:02x?})")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// The frame is of a protocol version this build does not speak.
    #[error("unsupported protocol version {found} (this build speaks {supported})")]
    UnsupportedVersion {
        /// The version in the frame.
        found: u16,
        /// The version this build speaks.
        supported: u16,
    },
    /// The kind byte names no [`Kind`].
    #[error("unknown frame kind {found}")]
    UnknownKind {
        /// The kind byte.
        found: u8,
    },
    /// Flags or reserved bytes are set; a newer peer may mean something by them that we would ignore.
    #[error("reserved header fields are not zero (flags {flags:#x}, reserved {reserved:#x})")]
    ReservedNotZero {
        /// The flags byte.
        flags: u8,
        /// The reserved word.
        reserved: u32,
    },
    /// The body is longer than [`FRAME_BODY_BYTES_MAX`](super::FRAME_BODY_BYTES_MAX).
    #[error("frame body of {body_bytes} bytes exceeds FRAME_BODY_BYTES_MAX ({limit_bytes} bytes)")]
    BodyTooLarge {
        /// The body length asked for.
        body_bytes: u64,
        /// [`FRAME_BODY_BYTES_MAX`](super::FRAME_BODY_BYTES_MAX).
        limit_bytes: u32,
    },
    /// The payload is longer than [`FRAME_PAYLOAD_BYTES_MAX`](super::FRAME_PAYLOAD_BYTES_MAX).
    #[error(
        "frame payload of {payload_bytes} bytes exceeds the limit of its kind ({limit_bytes} bytes: FRAME_PAYLOAD_BYTES_MAX for pages, RAFT_PAYLOAD_BYTES_MAX or PROPOSAL_PAYLOAD_BYTES_MAX for blobs)"
    )]
    PayloadTooLarge {
        /// The payload length asked for.
        payload_bytes: u64,
        /// [`FRAME_PAYLOAD_BYTES_MAX`](super::FRAME_PAYLOAD_BYTES_MAX).
        limit_bytes: u64,
    },
    /// The body lists more pages than [`PAGES_PER_FRAME_MAX`](super::PAGES_PER_FRAME_MAX).
    #[error("frame lists {pages} pages, more than PAGES_PER_FRAME_MAX ({limit})")]
    TooManyPages {
        /// Pages listed.
        pages: usize,
        /// [`PAGES_PER_FRAME_MAX`](super::PAGES_PER_FRAME_MAX).
        limit: usize,
    },
    /// A page descriptor is longer than [`limits::PAGE_BYTES_MAX`](crate::limits::PAGE_BYTES_MAX).
    #[error("page {page} of {page_bytes} bytes exceeds PAGE_BYTES_MAX ({limit_bytes} bytes)")]
    PageTooLarge {
        /// The page.
        page: PageId,
        /// Its length in the descriptor.
        page_bytes: u32,
        /// [`limits::PAGE_BYTES_MAX`](crate::limits::PAGE_BYTES_MAX).
        limit_bytes: u64,
    },
    /// The payload length in the header is not the sum of the page lengths in the body.
    #[error(
        "{kind:?} frame has a payload of {payload_bytes} bytes but its pages add up to {pages_bytes}"
    )]
    PayloadMismatch {
        /// The frame's kind.
        kind: Kind,
        /// The payload length in the header (or the bytes present).
        payload_bytes: u64,
        /// The sum of the page lengths.
        pages_bytes: u64,
    },
    /// The frame ended early.
    #[error("truncated frame: needed {needed_bytes} bytes, have {available_bytes}")]
    Truncated {
        /// Bytes the frame's lengths call for (so far).
        needed_bytes: u64,
        /// Bytes there are.
        available_bytes: u64,
    },
    /// A page's bytes do not match its checksum: corrupted in memory, on the wire, or by the sender.
    #[error(
        "checksum mismatch on page {page} (entry {index} of the frame): expected {expected:#018x}, got {actual:#018x}"
    )]
    ChecksumMismatch {
        /// The page.
        page: PageId,
        /// Its position in the frame's page list.
        index: usize,
        /// The checksum in the descriptor.
        expected: u64,
        /// The checksum of the bytes received.
        actual: u64,
    },
    /// The body is not a valid encoding of its kind's struct, claims more memory than
    /// [`BODY_DECODE_BYTES_MAX`](super::BODY_DECODE_BYTES_MAX), or has bytes left over.
    #[error("undecodable {kind:?} body: {reason}")]
    UndecodableBody {
        /// The kind the header named.
        kind: Kind,
        /// What bincode (or the leftover check) said.
        reason: String,
    },
}
