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
    let promote = |node| Next::Propose(MembershipChange::Promote { node: NodeId(node) });
    // (why, members, voters, learners, each peer's matched index, what comes next)
    type Case = (
        &'static str,
        u64,
        &'static [u64],
        &'static [u64],
        &'static [(u64, u64)],
        Next,
    );
    let cases: [Case; 4] = [
        (
            "two voters, two learners; learner 3 lags, learner 4 is current",
            4,
            &[1, 2],
            &[3, 4],
            &[(2, 100), (3, 10), (4, 100)],
            promote(4),
        ),
        (
            "of two caught-up learners, the lower id first (whatever order they joined \
             in): a launched job's first hosts vote",
            4,
            &[1],
            &[4, 2, 3],
            &[(2, 100), (3, 100), (4, 100)],
            promote(2),
        ),
        (
            "three voters in a pool of four: the learner stays one",
            4,
            &[1, 2, 3],
            &[4],
            &[(2, 100), (3, 100), (4, 100)],
            Next::Nothing,
        ),
        (
            "a fifth member: five voters wanted",
            5,
            &[1, 2, 3],
            &[4, 5],
            &[(2, 100), (3, 100), (4, 100), (5, 100)],
            promote(4),
        ),
    ];
    for (why, members, voters, learners, matched, want) in cases {
        let next = next_change(
            NodeId(1),
            &pool(members),
            &ids(voters),
            &ids(learners),
            &progress(matched),
            100,
        );
        assert_eq!(next, want, "{why}");
    }
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
