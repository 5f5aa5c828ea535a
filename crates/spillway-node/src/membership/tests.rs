use spillway_meta::{Batch, InitialCluster};

use super::*;

fn pool(n: u64) -> MetaState {
    MetaState::initial(&InitialCluster {
        members: (1..=n)
            .map(|id| MemberInfo {
                id: NodeId(id),
                addresses: vec![format!("10.0.0.{id}:7000")],
                capacity_bytes: 1 << 30,
                zone: None,
            })
            .collect(),
        page_bytes: 1 << 21,
    })
}

fn ids(v: &[u64]) -> Vec<NodeId> {
    v.iter().copied().map(NodeId).collect()
}

fn progress(v: &[(u64, u64)]) -> Vec<PeerProgress> {
    v.iter()
        .map(|&(id, matched)| PeerProgress {
            id: NodeId(id),
            matched_index: matched,
            recently_active: true,
        })
        .collect()
}

fn set_state(state: &mut MetaState, node: u64, to: MemberState) {
    let mut b = Batch::new(1);
    b.push(Update::SetMemberState {
        node: NodeId(node),
        state: to,
    });
    assert!(state.apply_batch(&b).iter().all(|r| r.is_ok()));
}

#[test]
fn voters_are_three_or_five() {
    assert_eq!(
        (1..=8).map(voters_wanted).collect::<Vec<_>>(),
        [3, 3, 3, 3, 5, 5, 5, 5]
    );
}

#[test]
fn a_caught_up_learner_is_promoted_while_voters_are_few() {
    let state = pool(4);
    let me = NodeId(1);
    // Two voters, two learners; learner 3 lags, learner 4 is current.
    let next = next_change(
        me,
        &state,
        &ids(&[1, 2]),
        &ids(&[3, 4]),
        &progress(&[(2, 100), (3, 10), (4, 100)]),
        100,
    );
    assert_eq!(
        next,
        Next::Propose(MembershipChange::Promote { node: NodeId(4) })
    );
    // Of two caught-up learners, the lower id first (whatever order they joined in): a
    // launched job's first hosts vote.
    let next = next_change(
        me,
        &state,
        &ids(&[1]),
        &ids(&[4, 2, 3]),
        &progress(&[(2, 100), (3, 100), (4, 100)]),
        100,
    );
    assert_eq!(
        next,
        Next::Propose(MembershipChange::Promote { node: NodeId(2) })
    );
    // Three voters in a pool of four: the learner stays one.
    let next = next_change(
        me,
        &state,
        &ids(&[1, 2, 3]),
        &ids(&[4]),
        &progress(&[(2, 100), (3, 100), (4, 100)]),
        100,
    );
    assert_eq!(next, Next::Nothing);
    // A fifth member: five voters wanted.
    let state = pool(5);
    let next = next_change(
        me,
        &state,
        &ids(&[1, 2, 3]),
        &ids(&[4, 5]),
        &progress(&[(2, 100), (3, 100), (4, 100), (5, 100)]),
        100,
    );
    assert_eq!(
        next,
        Next::Propose(MembershipChange::Promote { node: NodeId(4) })
    );
}

#[test]
fn a_drained_leaving_member_is_removed_and_a_leaving_leader_hands_over() {
    let mut state = pool(4);
    let all = progress(&[(2, 100), (3, 100), (4, 100)]);
    set_state(&mut state, 4, MemberState::Leaving);
    // Holds nothing: removed, before any promotion.
    let next = next_change(NodeId(1), &state, &ids(&[1, 2, 3]), &ids(&[4]), &all, 100);
    assert_eq!(
        next,
        Next::Propose(MembershipChange::Remove { node: NodeId(4) })
    );
    // The leader itself leaves: it hands over to a staying, caught-up voter.
    let mut state = pool(3);
    set_state(&mut state, 1, MemberState::Leaving);
    let next = next_change(NodeId(1), &state, &ids(&[1, 2, 3]), &[], &all, 100);
    assert!(
        matches!(next, Next::HandOver(n) if n == NodeId(2) || n == NodeId(3)),
        "{next:?}"
    );
}
