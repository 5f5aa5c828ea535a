//! Unit tests of the node: config errors and bootstrap checks.
use super::*;

#[test]
fn config_errors_name_the_field() {
    let ok = MetaConfig::new(NodeId(1), "/nonexistent");
    ok.validate().unwrap();
    let mut c = ok.clone();
    c.id = NodeId(0);
    assert_eq!(c.validate().unwrap_err().field, "id");
    let mut c = ok.clone();
    c.election_ticks = c.heartbeat_ticks;
    assert_eq!(c.validate().unwrap_err().field, "election_ticks");
    let mut c = ok.clone();
    c.election_ticks_max = c.election_ticks;
    assert_eq!(c.validate().unwrap_err().field, "election_ticks_max");
    let mut c = ok;
    c.completions_max = 0;
    assert_eq!(c.validate().unwrap_err().field, "completions_max");
}

#[test]
fn bootstrap_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let member = |id| crate::MemberInfo {
        id: NodeId(id),
        addresses: vec![],
        capacity_bytes: 1,
        zone: None,
    };
    let cluster = InitialCluster {
        members: vec![member(1), member(2)],
        page_bytes: 1,
    };
    let open = |id, c: &InitialCluster| {
        MetaNode::open(
            MetaConfig::new(NodeId(id), dir.path().join(id.to_string())),
            Some(c),
        )
    };
    assert!(matches!(
        open(3, &cluster),
        Err(MetaError::Bootstrap { .. })
    ));
    let twice = InitialCluster {
        members: vec![member(1), member(1)],
        page_bytes: 1,
    };
    assert!(matches!(open(1, &twice), Err(MetaError::Bootstrap { .. })));
    // A single voter elects itself and commits.
    let one = InitialCluster {
        members: vec![member(1)],
        page_bytes: 1,
    };
    let mut n = open(1, &one).unwrap();
    assert_eq!(
        n.propose(&Batch::new(0)).unwrap_err(),
        ProposeError::EmptyBatch
    );
    for _ in 0..limits::ELECTION_TICKS_MAX_DEFAULT * 2 {
        n.tick();
        n.handle_ready().unwrap();
    }
    assert!(n.is_leader());
    assert!(n.peers().is_empty());
    let mut b = Batch::new(5);
    b.push(crate::Update::SetCapacity {
        node: NodeId(1),
        capacity_bytes: 10,
    });
    let t = n.propose(&b).unwrap();
    n.handle_ready().unwrap();
    let done = n.take_completions();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].ticket, t);
    assert_eq!(n.state().member(NodeId(1)).unwrap().capacity_bytes, 10);
    let huge = Batch {
        now_ms: 0,
        updates: vec![b.updates[0].clone(); limits::BATCH_UPDATES_MAX + 1],
    };
    assert!(matches!(
        n.propose(&huge),
        Err(ProposeError::BatchTooLarge { .. })
    ));
}
