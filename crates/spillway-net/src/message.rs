//! Requests and responses as the node sees them (pages as [`Bytes`]), and their mapping to
//! and from wire frames (descriptors in the body, bytes in the payload).
//!
//! Besides pages, two requests carry an opaque blob for the pool's metadata group: a Raft
//! message ([`Request::Raft`]) and a proposal forwarded to the leader
//! ([`Request::Propose`], answered by [`Response::Propose`]). The transport checks their
//! size ([`wire::Kind::payload_bytes_max`]) and checksums like pages; what they hold is
//! decoded by the node, under the bounds of spillway-meta's codecs.

use bytes::Bytes;
use spillway_types::wire::{
    self, Blob, DeletePages, DeletePagesReply, ErrorReply, GetPages, GetPagesReply, Kind, Message,
    PageDesc, PutPages, PutPagesReply, WireError, page_checksum, page_ranges,
};
use spillway_types::{PageId, limits};

/// One page, its bytes and their checksum. `data` is shared, not copied: a page received
/// is a slice of the frame's payload buffer.
///
/// The checksum travels with the page from where it was first computed (when the page
/// was written, or by [`Page::new`]) to every node that receives it, which checks it on
/// arrival: a page corrupted anywhere on the way, in memory or on the wire, is caught.
/// A node that passes on a page it received or stored keeps its checksum instead of
/// hashing the bytes again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page {
    /// Which page.
    pub id: PageId,
    /// Its bytes (at most a page; the last page of a buffer may be short).
    pub data: Bytes,
    /// `wire::page_checksum(&data)` (xxh3-64).
    pub checksum: u64,
}

impl Page {
    /// A page with its checksum computed now.
    pub fn new(id: PageId, data: Bytes) -> Page {
        let checksum = page_checksum(&data);
        Page { id, data, checksum }
    }

    /// A page whose checksum is already known (stored with it, or received with it).
    /// The receiver checks it; debug builds check it here too.
    pub fn with_checksum(id: PageId, data: Bytes, checksum: u64) -> Page {
        debug_assert_eq!(page_checksum(&data), checksum, "stale checksum for {id}");
        Page { id, data, checksum }
    }

    /// Whether the bytes match the checksum.
    pub fn verify(&self) -> bool {
        page_checksum(&self.data) == self.checksum
    }
}

/// What one node asks another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Store these pages (overwriting any held under the same ids).
    Put {
        /// The pages.
        pages: Vec<Page>,
    },
    /// Send back these pages.
    Get {
        /// The pages wanted.
        pages: Vec<PageId>,
    },
    /// Drop these pages.
    Delete {
        /// The pages to drop.
        pages: Vec<PageId>,
    },
    /// Hand this Raft message (raft-rs protobuf bytes) to the node's metadata group.
    Raft {
        /// The encoded message, at most [`wire::RAFT_PAYLOAD_BYTES_MAX`] bytes.
        message: Bytes,
    },
    /// Propose this batch (an encoded `spillway_meta::Batch`) to the metadata group: sent
    /// by a follower to the leader.
    Propose {
        /// The encoded batch, at most [`wire::PROPOSAL_PAYLOAD_BYTES_MAX`] bytes.
        batch: Bytes,
    },
    /// Move this peer's page requests over UCX too (feature `ucx` of spillway-net): the
    /// offer of `UcxTransport::offer`. Sent only over an authenticated connection (QUIC),
    /// which is what makes the worker address in it trustworthy.
    UcxConnect {
        /// A connection id and a UCX worker address, at most
        /// [`wire::UCX_CONNECT_PAYLOAD_BYTES_MAX`] bytes.
        offer: Bytes,
    },
}

/// What a node answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    /// Answer to [`Request::Put`].
    Put {
        /// How many pages were stored.
        pages_stored: u32,
    },
    /// Answer to [`Request::Get`].
    Get {
        /// The pages held.
        pages: Vec<Page>,
        /// The ids asked for that are not held.
        missing: Vec<PageId>,
    },
    /// Answer to [`Request::Delete`].
    Delete {
        /// How many were held and dropped.
        pages_deleted: u32,
        /// How many were not held.
        pages_missing: u32,
    },
    /// Answer to [`Request::Raft`]: the message was handed to Raft (which may still drop
    /// it; Raft retransmits what matters).
    RaftAck,
    /// Answer to [`Request::Propose`]: the outcome, encoded by the node.
    Propose {
        /// The encoded outcome, at most [`wire::PROPOSAL_PAYLOAD_BYTES_MAX`] bytes.
        reply: Bytes,
    },
    /// Answer to [`Request::UcxConnect`]: the accepting side's connection id and address.
    UcxConnect {
        /// As the offer, from the side that accepted it.
        answer: Bytes,
    },
    /// The request failed.
    Error(ErrorReply),
}

/// The frame body and payload chunks of a blob.
fn describe_blob(data: Bytes) -> (Blob, Vec<Bytes>) {
    let blob = Blob::describe(&data);
    let chunk = wire::BLOB_CHUNK_BYTES as usize;
    let chunks = (0..data.len())
        .step_by(chunk)
        .map(|at| data.slice(at..(at + chunk).min(data.len())))
        .collect();
    (blob, chunks)
}

/// Descriptors (with the pages' checksums) and the page bytes in payload order. Refuses a
/// page larger than any page can be.
fn describe(pages: Vec<Page>) -> Result<(Vec<PageDesc>, Vec<Bytes>), WireError> {
    if let Some(p) = pages
        .iter()
        .find(|p| p.data.len() as u64 > limits::PAGE_BYTES_MAX)
    {
        return Err(WireError::PageTooLarge {
            page: p.id,
            page_bytes: u32::try_from(p.data.len()).unwrap_or(u32::MAX),
            limit_bytes: limits::PAGE_BYTES_MAX,
        });
    }
    Ok(pages
        .into_iter()
        .map(|p| {
            debug_assert!(p.verify(), "page {} does not match its checksum", p.id);
            let desc = PageDesc {
                page: p.id,
                len: p.data.len() as u32,
                checksum: p.checksum,
            };
            (desc, p.data)
        })
        .unzip())
}

/// Splits a verified payload into its pages, without copying.
fn split(descs: &[PageDesc], payload: &Bytes) -> Vec<Page> {
    page_ranges(descs)
        .map(|(d, range)| Page {
            id: d.page,
            data: payload.slice(range),
            checksum: d.checksum,
        })
        .collect()
}

impl Request {
    /// The frame kind of this request.
    pub fn kind(&self) -> Kind {
        match self {
            Request::Put { .. } => Kind::PutPages,
            Request::Get { .. } => Kind::GetPages,
            Request::Delete { .. } => Kind::DeletePages,
            Request::Raft { .. } => Kind::RaftMessage,
            Request::Propose { .. } => Kind::Propose,
            Request::UcxConnect { .. } => Kind::UcxConnect,
        }
    }

    /// Payload bytes this request carries.
    pub fn payload_bytes(&self) -> u64 {
        match self {
            Request::Put { pages } => pages.iter().map(|p| p.data.len() as u64).sum(),
            Request::Raft { message } => message.len() as u64,
            Request::Propose { batch } => batch.len() as u64,
            Request::UcxConnect { offer } => offer.len() as u64,
            _ => 0,
        }
    }

    pub(crate) fn into_wire(self) -> Result<(Message, Vec<Bytes>), WireError> {
        Ok(match self {
            Request::Put { pages } => {
                let (pages, data) = describe(pages)?;
                (Message::PutPages(PutPages { pages }), data)
            }
            Request::Get { pages } => (Message::GetPages(GetPages { pages }), Vec::new()),
            Request::Delete { pages } => (Message::DeletePages(DeletePages { pages }), Vec::new()),
            Request::Raft { message } => {
                let (blob, data) = describe_blob(message);
                (Message::RaftMessage(blob), data)
            }
            Request::Propose { batch } => {
                let (blob, data) = describe_blob(batch);
                (Message::Propose(blob), data)
            }
            Request::UcxConnect { offer } => {
                let (blob, data) = describe_blob(offer);
                (Message::UcxConnect(blob), data)
            }
        })
    }

    /// The request a decoded frame carries; `Err(kind)` if the frame is not a request.
    /// `payload` must have passed `wire::verify_pages`.
    pub(crate) fn from_wire(message: Message, payload: &Bytes) -> Result<Request, Kind> {
        match message {
            Message::PutPages(m) => Ok(Request::Put {
                pages: split(&m.pages, payload),
            }),
            Message::GetPages(m) => Ok(Request::Get { pages: m.pages }),
            Message::DeletePages(m) => Ok(Request::Delete { pages: m.pages }),
            Message::RaftMessage(_) => Ok(Request::Raft {
                message: payload.clone(),
            }),
            Message::Propose(_) => Ok(Request::Propose {
                batch: payload.clone(),
            }),
            Message::UcxConnect(_) => Ok(Request::UcxConnect {
                offer: payload.clone(),
            }),
            other => Err(other.kind()),
        }
    }
}

impl Response {
    /// The frame kind of this response.
    pub fn kind(&self) -> Kind {
        match self {
            Response::Put { .. } => Kind::PutPagesReply,
            Response::Get { .. } => Kind::GetPagesReply,
            Response::Delete { .. } => Kind::DeletePagesReply,
            Response::RaftAck => Kind::RaftMessageReply,
            Response::Propose { .. } => Kind::ProposeReply,
            Response::UcxConnect { .. } => Kind::UcxConnectReply,
            Response::Error(_) => Kind::Error,
        }
    }

    /// Whether this response may answer a request of kind `request`.
    pub(crate) fn answers(kind: Kind, request: Kind) -> bool {
        matches!(
            (request, kind),
            (_, Kind::Error)
                | (Kind::PutPages, Kind::PutPagesReply)
                | (Kind::GetPages, Kind::GetPagesReply)
                | (Kind::DeletePages, Kind::DeletePagesReply)
                | (Kind::RaftMessage, Kind::RaftMessageReply)
                | (Kind::Propose, Kind::ProposeReply)
                | (Kind::UcxConnect, Kind::UcxConnectReply)
        )
    }

    pub(crate) fn into_wire(self) -> Result<(Message, Vec<Bytes>), WireError> {
        Ok(match self {
            Response::Put { pages_stored } => (
                Message::PutPagesReply(PutPagesReply { pages_stored }),
                Vec::new(),
            ),
            Response::Get { pages, missing } => {
                let (pages, data) = describe(pages)?;
                (
                    Message::GetPagesReply(GetPagesReply { pages, missing }),
                    data,
                )
            }
            Response::Delete {
                pages_deleted,
                pages_missing,
            } => (
                Message::DeletePagesReply(DeletePagesReply {
                    pages_deleted,
                    pages_missing,
                }),
                Vec::new(),
            ),
            Response::RaftAck => (Message::RaftMessageReply(Blob::default()), Vec::new()),
            Response::Propose { reply } => {
                let (blob, data) = describe_blob(reply);
                (Message::ProposeReply(blob), data)
            }
            Response::UcxConnect { answer } => {
                let (blob, data) = describe_blob(answer);
                (Message::UcxConnectReply(blob), data)
            }
            Response::Error(e) => (Message::Error(e), Vec::new()),
        })
    }

    /// The response a decoded frame carries; `Err(kind)` if the frame is not a response.
    /// `payload` must have passed `wire::verify_pages`.
    pub(crate) fn from_wire(message: Message, payload: &Bytes) -> Result<Response, Kind> {
        match message {
            Message::PutPagesReply(m) => Ok(Response::Put {
                pages_stored: m.pages_stored,
            }),
            Message::GetPagesReply(m) => Ok(Response::Get {
                pages: split(&m.pages, payload),
                missing: m.missing,
            }),
            Message::DeletePagesReply(m) => Ok(Response::Delete {
                pages_deleted: m.pages_deleted,
                pages_missing: m.pages_missing,
            }),
            Message::RaftMessageReply(_) => Ok(Response::RaftAck),
            Message::ProposeReply(_) => Ok(Response::Propose {
                reply: payload.clone(),
            }),
            Message::UcxConnectReply(_) => Ok(Response::UcxConnect {
                answer: payload.clone(),
            }),
            Message::Error(e) => Ok(Response::Error(e)),
            other => Err(other.kind()),
        }
    }
}
