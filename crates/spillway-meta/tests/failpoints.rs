//! A log write that fails as on a full disk (the failpoint `spillway-meta::storage::write`,
//! feature `failpoints`): the Ready fails with the cause, the node refuses work until it
//! is reopened, the log reopens on the full disk but `check_writable` fails, and a node
//! reopened from its directory once writes succeed again keeps what was durable and
//! commits again.
//!
//! Run: `cargo test --release -p spillway-meta --features failpoints --test failpoints`.
//! Failpoints are global to the process: each test holds a `fail::FailScenario`, which
//! runs them one at a time and clears every failpoint when it ends.

use spillway_meta::storage::EngineStorage;
use spillway_meta::{
    Batch, InitialCluster, MemberInfo, MetaConfig, MetaError, MetaNode, NodeId, Update, limits,
};

const WRITE: &str = "spillway-meta::storage::write";

fn open(dir: &std::path::Path) -> Result<MetaNode, MetaError> {
    let initial = InitialCluster {
        members: vec![MemberInfo {
            id: NodeId(1),
            addresses: vec![],
            capacity_bytes: 1,
            zone: None,
        }],
        page_bytes: 1,
    };
    MetaNode::open(MetaConfig::new(NodeId(1), dir), Some(&initial))
}

fn lead(n: &mut MetaNode) {
    for _ in 0..limits::ELECTION_TICKS_MAX_DEFAULT * 2 {
        n.tick();
        n.handle_ready().unwrap();
    }
    assert!(n.is_leader());
}

fn set_capacity(bytes: u64) -> Batch {
    let mut b = Batch::new(0);
    b.push(Update::SetCapacity {
        node: NodeId(1),
        capacity_bytes: bytes,
    });
    b
}

fn capacity(n: &MetaNode) -> u64 {
    n.state().member(NodeId(1)).unwrap().capacity_bytes
}

#[test]
fn a_full_disk_fails_the_ready_and_a_reopened_node_commits_again() {
    let scenario = fail::FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let mut n = open(dir.path()).unwrap();
    lead(&mut n);
    n.propose(&set_capacity(10)).unwrap();
    n.handle_ready().unwrap();
    assert_eq!(capacity(&n), 10);

    // The failpoint for another directory changes nothing here.
    fail::cfg(WRITE, "return(/nonexistent)").unwrap();
    n.propose(&set_capacity(11)).unwrap();
    n.handle_ready().unwrap();
    assert_eq!(capacity(&n), 11);

    // The disk is full: the Ready fails with the cause, and the node refuses work.
    fail::cfg(WRITE, &format!("return({})", dir.path().display())).unwrap();
    n.propose(&set_capacity(20)).unwrap();
    let e = n.handle_ready().unwrap_err();
    assert!(matches!(e, MetaError::Storage(_)), "{e:?}");
    assert!(e.to_string().contains("StorageFull"), "{e}");
    assert!(matches!(
        n.handle_ready(),
        Err(MetaError::Poisoned { node: NodeId(1) })
    ));
    drop(n);

    // Still full: the log reopens (reading needs no space), but a write fails.
    let mut log = EngineStorage::open(dir.path()).unwrap();
    let e = log.check_writable().unwrap_err();
    assert!(e.to_string().contains("StorageFull"), "{e}");
    drop(log);

    // Space is back: the reopened node has what was durable, not the failed Ready.
    fail::remove(WRITE);
    EngineStorage::open(dir.path())
        .unwrap()
        .check_writable()
        .unwrap();
    let mut n = open(dir.path()).unwrap();
    assert_eq!(capacity(&n), 11);
    lead(&mut n);
    let before = n.commit_index();
    n.propose(&set_capacity(30)).unwrap();
    n.handle_ready().unwrap();
    assert_eq!(capacity(&n), 30);
    assert!(n.commit_index() > before);
    scenario.teardown();
}
