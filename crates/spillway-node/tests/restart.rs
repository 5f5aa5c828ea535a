//! A node that restarts has lost its RAM, so the pages it held are gone: its new
//! incarnation starts a new epoch, and the directory stops naming it for pages of the old
//! one, while the pages on other holders stay listed and readable.

mod common;

use bytes::Bytes;
use common::*;
use spillway_meta::Epoch;
use spillway_node::RemoteError;
use spillway_node::remote::remote_page_id;
use spillway_types::{NodeId, PageId};

const PAGE: u64 = 64 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_holder_is_no_longer_named_for_the_pages_its_ram_lost() {
    // One copy per page: a page on node 2 is gone with its RAM (with the default two
    // copies it would be read from the other; sim_pool covers that).
    let pool = Pool::new("reincarnate", PAGE, [64, 64, 64]).one_copy();
    let (mut nodes, _) = pool.start_settled().await;
    // Every node announces its incarnation at start: epoch 2 once settled.
    wait_for("the first incarnations", WAIT, || {
        let v = nodes[0].as_ref()?.meta_view();
        v.members.iter().all(|m| m.epoch == Epoch(2)).then_some(())
    })
    .await;
    // Enough pages from node 1 that both peers hold some.
    let pages = patterned_pages(9, 48, 300, PAGE);
    let n1 = nodes[0].as_ref().unwrap();
    within("spill", n1.remote().spill(4, pages.clone()))
        .await
        .unwrap();
    // Where the pages went, once node 1 has applied its placements.
    let before = wait_for_async(|| async {
        let h = holders(&nodes, &pages).await;
        h.iter().all(Option::is_some).then_some(h)
    })
    .await;
    let on2 = before.iter().filter(|h| **h == Some(NodeId(2))).count();
    let on3 = before.iter().filter(|h| **h == Some(NodeId(3))).count();
    assert!(on2 > 0 && on3 > 0 && on2 + on3 == pages.len(), "{before:?}");

    // Node 2 dies with its RAM and comes back.
    let n2 = nodes[1].take().unwrap();
    within("shutdown node 2", n2.shutdown()).await;
    nodes[1] = Some(pool.restart(1).await);
    wait_for("node 2's new incarnation", WAIT, || {
        let v = nodes[0].as_ref()?.meta_view();
        v.members
            .iter()
            .any(|m| m.id == NodeId(2) && m.epoch == Epoch(3))
            .then_some(())
    })
    .await;
    let after = holders(&nodes, &pages).await;
    for (b, a) in before.iter().zip(&after) {
        match b {
            Some(NodeId(2)) => assert_eq!(*a, None, "a page of node 2's old RAM is listed"),
            _ => assert_eq!(a, b, "a page on node 3 moved"),
        }
    }
    let view = nodes[0].as_ref().unwrap().meta_view();
    let m2 = view.members.iter().find(|m| m.id == NodeId(2)).unwrap();
    assert_eq!(m2.used_bytes, 0, "node 2's usage still counts lost pages");

    // Node 1 still reads every page on node 3; a page that was on node 2 is a clear error.
    let n1 = nodes[0].as_ref().unwrap();
    let (on3_ids, on3_data): (Vec<PageId>, Vec<Bytes>) = pages
        .iter()
        .zip(&before)
        .filter(|(_, h)| **h == Some(NodeId(3)))
        .map(|((id, d), _)| (*id, d.clone()))
        .unzip();
    let back = within("fetch from node 3", n1.remote().fetch(4, on3_ids))
        .await
        .unwrap();
    assert!(back == on3_data, "pages on node 3 came back different");
    let lost = pages
        .iter()
        .zip(&before)
        .find(|(_, h)| **h == Some(NodeId(2)))
        .map(|((id, _), _)| *id)
        .unwrap();
    let err = within("fetch a lost page", n1.remote().fetch(4, vec![lost]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, RemoteError::NotFound { .. }),
        "a lost page is NotFound, not a hang or garbage: {err}"
    );
    shutdown_all(nodes).await;
}

/// The directory's holder of each page, as node 1 applied it.
async fn holders(
    nodes: &[Option<spillway_node::NodeHandle>],
    pages: &[(PageId, Bytes)],
) -> Vec<Option<NodeId>> {
    let ids: Vec<PageId> = pages
        .iter()
        .map(|(id, _)| remote_page_id(NodeId(1), 4, *id))
        .collect();
    nodes[0]
        .as_ref()
        .unwrap()
        .meta_read(move |s| {
            ids.iter()
                .map(|id| s.holder_of(*id).map(|(_, h)| h.node))
                .collect::<Vec<_>>()
        })
        .await
        .unwrap()
}
