//! The failure detector: which members the leader declares down, and when this node
//! declares itself up again. Sans-IO like the rest of [`super::MetaNode`]: time is ticks.
//!
//! How a member is found dead: the leader hears from every live member at least once per
//! heartbeat (its heartbeat responses, its append responses). The detector stamps every
//! message [`super::MetaNode::step`] takes with the tick it came in at, per sender; a
//! member the leader has not heard from for [`super::MetaConfig::down_after_ticks`] is
//! proposed `SetMemberState { Down }`. The count starts when this node became leader, so a
//! new leader gives every member the whole timeout. raft-rs's own `recent_active` flag was
//! the other candidate: it is cleared at every check-quorum round (each election timeout),
//! so it only says "heard within the last 0.5 to 1 s", too coarse for a timeout of its own;
//! the stamps cost one map entry per member.
//!
//! How a member comes back: a node whose applied state says it is down while it runs
//! proposes `SetMemberState { Up }` for itself (forwarded to the leader by raft-rs when it
//! follows). Down to up starts a new epoch, which makes every record of its earlier epoch
//! dead (the state machine's fencing). A restarted node does the same once it has caught
//! up on the log that says it is down.
//!
//! Proposals are not repeated while one may still be on its way: a member is proposed down
//! at most once per timeout, and a node proposes itself up at most once per
//! `up_retry_ticks`.

use std::collections::BTreeMap;

use crate::command::{MemberState, Update};
use crate::ids::NodeId;
use crate::state::MetaState;

#[derive(Clone, Debug)]
pub(crate) struct Detector {
    /// 0: off.
    down_after_ticks: u64,
    up_retry_ticks: u64,
    /// Ticks since the node opened.
    now: u64,
    /// The tick each member was last heard from at.
    heard: BTreeMap<NodeId, u64>,
    /// The term this node leads in and the tick it started leading at.
    leading: Option<(u64, u64)>,
    /// The tick each member was last proposed down (or, for this node, up) at.
    proposed: BTreeMap<NodeId, u64>,
}

impl Detector {
    pub(crate) fn new(down_after_ticks: u64, up_retry_ticks: u64) -> Self {
        Detector {
            down_after_ticks,
            up_retry_ticks,
            now: 0,
            heard: BTreeMap::new(),
            leading: None,
            proposed: BTreeMap::new(),
        }
    }

    /// A message from `peer` came in.
    pub(crate) fn heard_from(&mut self, peer: NodeId) {
        self.heard.insert(peer, self.now);
    }

    /// One tick: the updates this node should propose now. `leading_term` is the term this
    /// node leads in, if it leads.
    pub(crate) fn tick(
        &mut self,
        me: NodeId,
        leading_term: Option<u64>,
        state: &MetaState,
    ) -> Vec<Update> {
        self.now += 1;
        let mut out = Vec::new();
        if self.down_after_ticks == 0 {
            return out;
        }
        let now = self.now;
        match leading_term {
            Some(term) => {
                let since = match self.leading {
                    Some((t, since)) if t == term => since,
                    _ => {
                        self.leading = Some((term, now));
                        now
                    }
                };
                for m in state.members() {
                    if m.id == me || m.state == MemberState::Down {
                        continue;
                    }
                    let heard = self.heard.get(&m.id).copied().unwrap_or(0).max(since);
                    let pending = self
                        .proposed
                        .get(&m.id)
                        .is_some_and(|&t| now - t < self.down_after_ticks);
                    if now - heard >= self.down_after_ticks && !pending {
                        self.proposed.insert(m.id, now);
                        tracing::warn!(
                            node = %me,
                            member = %m.id,
                            silent_ticks = now - heard,
                            "member not heard from: proposing it down"
                        );
                        out.push(Update::SetMemberState {
                            node: m.id,
                            state: MemberState::Down,
                        });
                    }
                }
            }
            None => self.leading = None,
        }
        let down = state
            .member(me)
            .is_some_and(|m| m.state == MemberState::Down);
        let pending = self
            .proposed
            .get(&me)
            .is_some_and(|&t| now - t < self.up_retry_ticks);
        if down && !pending {
            self.proposed.insert(me, now);
            tracing::warn!(node = %me, "this node is down in the pool's state: proposing it up (a new epoch)");
            out.push(Update::SetMemberState {
                node: me,
                state: MemberState::Up,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Batch, InitialCluster};

    fn state(n: u64) -> MetaState {
        MetaState::initial(&InitialCluster::for_tests(n, 0, 4096))
    }

    fn downs(updates: &[Update]) -> Vec<(u64, MemberState)> {
        updates
            .iter()
            .map(|u| match u {
                Update::SetMemberState { node, state } => (node.0, *state),
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_silent_member_is_proposed_down_once_per_timeout_and_a_talking_one_never() {
        let s = state(3);
        let me = NodeId(1);
        let mut d = Detector::new(5, 3);
        // Leading from tick 1; node 2 talks every tick, node 3 never.
        for tick in 1..=5 {
            d.heard_from(NodeId(2));
            assert!(d.tick(me, Some(7), &s).is_empty(), "tick {tick}");
        }
        d.heard_from(NodeId(2));
        // Tick 6: node 3 silent for 5 ticks since leadership began at tick 1.
        assert_eq!(
            downs(&d.tick(me, Some(7), &s)),
            vec![(3, MemberState::Down)]
        );
        // Not proposed again within the timeout...
        for _ in 0..4 {
            d.heard_from(NodeId(2));
            assert!(d.tick(me, Some(7), &s).is_empty());
        }
        // ...but again after it, while the state still says up (the first was lost).
        d.heard_from(NodeId(2));
        assert_eq!(
            downs(&d.tick(me, Some(7), &s)),
            vec![(3, MemberState::Down)]
        );
    }

    #[test]
    fn a_new_leader_gives_everyone_the_whole_timeout_and_followers_propose_nobody_down() {
        let s = state(2);
        let me = NodeId(1);
        let mut d = Detector::new(3, 3);
        for _ in 0..10 {
            assert!(d.tick(me, None, &s).is_empty());
        }
        // Leads from tick 11 in term 2: node 2 (never heard) is due at tick 14.
        assert!(d.tick(me, Some(2), &s).is_empty());
        assert!(d.tick(me, Some(2), &s).is_empty());
        assert!(d.tick(me, Some(2), &s).is_empty());
        assert_eq!(
            downs(&d.tick(me, Some(2), &s)),
            vec![(2, MemberState::Down)]
        );
        // A new term starts the count again.
        assert!(d.tick(me, Some(3), &s).is_empty());
    }

    #[test]
    fn a_node_down_in_the_state_proposes_itself_up_and_detection_can_be_off() {
        let mut s = state(2);
        let mut b = Batch::new(1);
        b.push(Update::SetMemberState {
            node: NodeId(2),
            state: MemberState::Down,
        });
        s.apply_batch(&b);
        let mut d = Detector::new(4, 2);
        assert_eq!(
            downs(&d.tick(NodeId(2), None, &s)),
            vec![(2, MemberState::Up)]
        );
        assert!(d.tick(NodeId(2), None, &s).is_empty());
        assert_eq!(
            downs(&d.tick(NodeId(2), None, &s)),
            vec![(2, MemberState::Up)]
        );
        // The leader does not propose an already-down member down again.
        d.heard_from(NodeId(1));
        let mut leader = Detector::new(2, 2);
        for _ in 0..6 {
            assert!(leader.tick(NodeId(1), Some(1), &s).is_empty());
        }
        let mut off = Detector::new(0, 2);
        for _ in 0..6 {
            assert!(off.tick(NodeId(2), Some(1), &s).is_empty());
        }
    }
}
