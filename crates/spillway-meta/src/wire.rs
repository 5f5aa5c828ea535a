//! Raft messages on the wire: raft-rs's own protobuf encoding, with a size check.
//!
//! The node daemon frames these bytes on its authenticated peer connections. `protobuf` 2
//! is old: decode only messages from authenticated peers, and check the frame length
//! against [`limits::RAFT_MESSAGE_BYTES_MAX`] before reading the frame into memory.

use protobuf::Message as _;
use raft::eraftpb::Message;

use crate::limits;

/// A Raft message that could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Larger than [`limits::RAFT_MESSAGE_BYTES_MAX`].
    #[error("raft message of {bytes} bytes is over the bound of {max} bytes")]
    TooLarge {
        /// Its size.
        bytes: usize,
        /// The bound.
        max: usize,
    },
    /// Not a valid protobuf `eraftpb.Message`.
    #[error("malformed raft message: {source}")]
    Malformed {
        /// The decoder's error.
        #[source]
        source: protobuf::ProtobufError,
    },
}

/// Encodes a message for the wire.
pub fn encode_message(msg: &Message) -> Vec<u8> {
    // Writing a well-formed in-memory message to a Vec cannot fail.
    msg.write_to_bytes()
        .expect("protobuf encoding of an in-memory message")
}

/// Decodes a message from the wire.
pub fn decode_message(bytes: &[u8]) -> Result<Message, WireError> {
    if bytes.len() > limits::RAFT_MESSAGE_BYTES_MAX {
        return Err(WireError::TooLarge {
            bytes: bytes.len(),
            max: limits::RAFT_MESSAGE_BYTES_MAX,
        });
    }
    Message::parse_from_bytes(bytes).map_err(|source| WireError::Malformed { source })
}

#[cfg(test)]
mod tests {
    use raft::eraftpb::MessageType;

    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgHeartbeat);
        m.to = 2;
        m.from = 1;
        m.term = 7;
        let back = decode_message(&encode_message(&m)).unwrap();
        assert_eq!(back, m);
        assert!(decode_message(&[0xFF, 0xFF, 0xFF, 0xFF, 0xFF]).is_err());
    }
}
