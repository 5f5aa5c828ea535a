//! Seeds of the `wire_frame` and `local_frame` fuzz targets: one frame of every kind of
//! each protocol, encoded by the real encoders (peer frames with their payloads of pages
//! or blob chunks). The `fuzz_seeds` example of spillway-types writes them to the corpus;
//! the corpus replay test checks that every one is accepted by the current decoders.
//!
//! Pages are small (at most 4 KiB): libFuzzer mutates inputs of a few KiB far faster than
//! frames of 2 MiB pages, and the decoder takes the same paths for both.

use spillway_types::local::{self, ClientMessage, NodeMessage};
use spillway_types::wire::{self, Blob, Message, PageDesc};
use spillway_types::{BufferId, NodeId, PageId, PoolId};

fn page(buffer: u64, index: u32) -> PageId {
    PageId {
        buffer: BufferId(buffer),
        index,
    }
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    spillway_types::pattern::bytes(seed, len)
}

/// A seed named `name` of a message that carries `payload` as its blob.
fn blob_seed(
    name: &'static str,
    message: fn(Blob) -> Message,
    payload: &[u8],
) -> (&'static str, Message, Vec<u8>) {
    (name, message(Blob::describe(payload)), payload.to_vec())
}

/// Every peer message, with the bytes of its payload.
fn wire_messages() -> Vec<(&'static str, Message, Vec<u8>)> {
    let hello = wire::Hello {
        pool_id: PoolId(0x5eed),
        node_id: NodeId(2),
        protocol_version: wire::PROTOCOL_VERSION,
    };
    let pages: Vec<Vec<u8>> = [64, 4096, 1, 512]
        .iter()
        .map(|&n| bytes(n as u64, n))
        .collect();
    let descs: Vec<PageDesc> = pages
        .iter()
        .enumerate()
        .map(|(i, d)| PageDesc::for_page(page(9, i as u32), d))
        .collect();
    let all_pages: Vec<u8> = pages.concat();
    let raft = bytes(10, 300);
    let proposal = bytes(12, 90);
    let ucx = bytes(14, 128);
    vec![
        ("hello", Message::Hello(hello), vec![]),
        ("hello_reply", Message::HelloReply(hello), vec![]),
        (
            "put_pages",
            Message::PutPages(wire::PutPages {
                pages: descs.clone(),
            }),
            all_pages.clone(),
        ),
        (
            "put_pages_empty",
            Message::PutPages(wire::PutPages { pages: vec![] }),
            vec![],
        ),
        (
            "put_pages_reply",
            Message::PutPagesReply(wire::PutPagesReply { pages_stored: 4 }),
            vec![],
        ),
        (
            "get_pages",
            Message::GetPages(wire::GetPages {
                pages: vec![page(9, 0), page(9, 3), page(u64::MAX, u32::MAX)],
            }),
            vec![],
        ),
        (
            "get_pages_reply",
            Message::GetPagesReply(wire::GetPagesReply {
                pages: descs[..2].to_vec(),
                missing: vec![page(9, 7)],
            }),
            pages[..2].concat(),
        ),
        (
            "delete_pages",
            Message::DeletePages(wire::DeletePages {
                pages: vec![page(9, 1), page(3, 0)],
            }),
            vec![],
        ),
        (
            "delete_pages_reply",
            Message::DeletePagesReply(wire::DeletePagesReply {
                pages_deleted: 1,
                pages_missing: 1,
            }),
            vec![],
        ),
        (
            "error",
            Message::Error(wire::ErrorReply::new(
                wire::ErrorCode::NoCapacity,
                "host tier full: 64 of 64 pages held",
            )),
            vec![],
        ),
        blob_seed("raft_message", Message::RaftMessage, &raft),
        (
            "raft_message_reply",
            Message::RaftMessageReply(Blob::default()),
            vec![],
        ),
        blob_seed("propose", Message::Propose, &proposal),
        blob_seed("propose_reply", Message::ProposeReply, &proposal[..20]),
        blob_seed("ucx_connect", Message::UcxConnect, &ucx),
        blob_seed("ucx_connect_reply", Message::UcxConnectReply, &ucx[..64]),
    ]
}

/// Every local frame, of both directions, named by its message.
pub fn local_frames() -> Vec<(&'static str, Vec<u8>)> {
    let op = local::PageOp {
        id: 17,
        page: page(1 << 48 | 5, 12),
        slot: 3,
        bytes: 2 << 20,
    };
    let client = [
        (
            "hello",
            ClientMessage::Hello(local::Hello {
                version: local::PROTOCOL_VERSION,
                page_bytes: 2 << 20,
                host_bytes: 1 << 30,
            }),
        ),
        ("spill", ClientMessage::Spill(op)),
        (
            "fetch",
            ClientMessage::Fetch(local::PageOp { id: 18, ..op }),
        ),
        (
            "discard",
            ClientMessage::Discard(local::Discard {
                pages: (0..8).map(|i| page(1 << 48 | 5, i)).collect(),
            }),
        ),
    ];
    let node = [
        (
            "welcome",
            NodeMessage::Welcome(local::Welcome {
                client: 1,
                host_bytes: 1 << 30,
                remote_capacity_bytes: 4 << 30,
                bandwidth_hint_bytes_per_s: 3_000_000_000,
            }),
        ),
        (
            "refused",
            NodeMessage::Refused(local::Refused::new(
                local::RefusedCode::PageSizeMismatch,
                "this node stores pages of 2097152 bytes, not 1048576",
            )),
        ),
        (
            "done",
            NodeMessage::Done(local::Done {
                id: 17,
                result: Ok(()),
            }),
        ),
        (
            "done_error",
            NodeMessage::Done(local::Done {
                id: 18,
                result: Err(local::OpError::new(
                    local::OpErrorCode::Remote,
                    "page not found on node 2",
                )),
            }),
        ),
    ];
    let mut frames = Vec::new();
    for (name, m) in client {
        frames.push((name, local::encode_frame(&m).expect("a seed encodes")));
    }
    for (name, m) in node {
        frames.push((name, local::encode_frame(&m).expect("a seed encodes")));
    }
    frames
}

/// Every peer frame: header, body and payload, named by its kind.
pub fn wire_frames() -> Vec<(&'static str, Vec<u8>)> {
    wire_messages()
        .into_iter()
        .enumerate()
        .map(|(i, (name, message, payload))| {
            let mut frame =
                wire::encode_frame(i as u64 * 1001 + 1, &message).expect("a seed encodes");
            frame.extend_from_slice(&payload);
            (name, frame)
        })
        .collect()
}
