//! The private codec of forwarded proposals' replies (bincode 2 under the wire's
//! proposal bound): what a leader answers a follower's `Request::Propose`.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::{Outcome, REASON_BYTES_MAX};

pub(super) fn cut(mut s: String) -> String {
    if s.len() > REASON_BYTES_MAX {
        let mut at = REASON_BYTES_MAX;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
    s
}

/// The reply to a forwarded proposal, as it travels back (bincode 2, serde).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ForwardReply {
    /// Committed and applied: one outcome per update, in order.
    Applied { outcomes: Vec<Outcome> },
    /// This node does not lead; `leader` is the one it knows (the follower retries there).
    NotLeader { leader: Option<u64> },
    /// It failed; `retry` when proposing again may succeed (busy, timed out).
    Failed { failure: String, retry: bool },
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_limit::<{ spillway_types::wire::PROPOSAL_PAYLOAD_BYTES_MAX as usize }>()
}

pub(crate) fn encode_forward_reply(reply: &ForwardReply) -> Bytes {
    bincode::serde::encode_to_vec(reply, bincode_config())
        .expect("a forward reply encodes")
        .into()
}

/// Why a forwarded proposal's reply could not be decoded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ForwardDecodeError {
    /// Not a reply (or past the decode limit).
    #[error(transparent)]
    Bincode(#[from] bincode::error::DecodeError),
    /// A reply followed by bytes that belong to none.
    #[error("{0} trailing bytes")]
    Trailing(usize),
}

pub(crate) fn decode_forward_reply(bytes: &[u8]) -> Result<ForwardReply, ForwardDecodeError> {
    let (reply, n) = bincode::serde::decode_from_slice(bytes, bincode_config())?;
    if n != bytes.len() {
        return Err(ForwardDecodeError::Trailing(bytes.len() - n));
    }
    Ok(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_replies_round_trip_and_garbage_is_an_error() {
        let reply = ForwardReply::Applied {
            outcomes: vec![
                Outcome::Accepted,
                Outcome::Rejected {
                    reason: "no".into(),
                },
            ],
        };
        match decode_forward_reply(&encode_forward_reply(&reply)).unwrap() {
            ForwardReply::Applied { outcomes } => {
                assert_eq!(outcomes.len(), 2);
                assert!(outcomes[0].is_accepted() && !outcomes[1].is_accepted());
            }
            other => panic!("{other:?}"),
        }
        let not_leader = encode_forward_reply(&ForwardReply::NotLeader { leader: Some(3) });
        assert!(matches!(
            decode_forward_reply(&not_leader),
            Ok(ForwardReply::NotLeader { leader: Some(3) })
        ));
        let mut trailing = not_leader.to_vec();
        trailing.push(0);
        assert!(decode_forward_reply(&trailing).is_err());
        // A hostile length prefix hits the decode limit instead of allocating.
        assert!(
            decode_forward_reply(&[0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff])
                .is_err()
        );
    }

    #[test]
    fn reasons_are_cut_at_a_character_boundary() {
        let long = "é".repeat(REASON_BYTES_MAX);
        let cut = cut(long);
        assert!(cut.len() <= REASON_BYTES_MAX);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
