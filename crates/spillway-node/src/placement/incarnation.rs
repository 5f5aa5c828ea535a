//! A restarted node's first steps without IO, for both drivers (`node::announce_incarnation`
//! with `RemoteService::release_earlier_incarnation`, and `chaos::driver::announce`):
//!
//! 1. propose [`incarnation_updates`]: down and up in one proposal, so the node comes
//!    back at a new epoch that fences every copy its earlier life held;
//! 2. read [`earlier_extents`] from the replicated state: the records of pages the
//!    earlier incarnation's clients spilled (their clients are gone, and new ones reuse
//!    their numbers);
//! 3. [`EarlierPages::of`] those: propose each batch of `removals`, then delete
//!    `deletes` from their holders (or queue them).

use spillway_meta::{Extent, MemberState, MetaState, Update};
use spillway_types::{NodeId, PageId};

use super::{Deletes, buffer_of_node};

/// The proposal that records a new incarnation of `node`: down, then up.
pub(crate) fn incarnation_updates(node: NodeId) -> Vec<Update> {
    vec![
        Update::SetMemberState {
            node,
            state: MemberState::Down,
        },
        Update::SetMemberState {
            node,
            state: MemberState::Up,
        },
    ]
}

/// Every directory record (one per replica slot) of a page `node`'s clients spilled:
/// the extent and its holder.
pub(crate) fn earlier_extents(state: &MetaState, node: NodeId) -> Vec<(Extent, NodeId)> {
    state
        .extents()
        .filter(|(_, e, _)| buffer_of_node(e.buffer, node))
        .map(|(_, e, h)| (e, h.node))
        .collect()
}

/// How to release the pages of an earlier incarnation's clients.
#[derive(Debug)]
pub(crate) struct EarlierPages {
    /// Proposals that remove every extent once (from every slot), each at most
    /// `BATCH_UPDATES_MAX` updates.
    pub(crate) removals: Vec<Vec<Update>>,
    /// The copies to delete, by holder.
    pub(crate) deletes: Deletes,
    /// How many copies `deletes` names.
    pub(crate) pages: u64,
}

impl EarlierPages {
    /// The removals and deletes of the records `found` ([`earlier_extents`]).
    pub(crate) fn of(found: &[(Extent, NodeId)]) -> Self {
        // One record per replica slot: each extent is removed once (from every slot).
        let mut extents: Vec<Extent> = found.iter().map(|(e, _)| *e).collect();
        extents.sort_by_key(|e| (e.buffer, e.first_page, e.page_count));
        extents.dedup();
        let removals = extents
            .chunks(spillway_meta::limits::BATCH_UPDATES_MAX)
            .map(|chunk| {
                chunk
                    .iter()
                    .map(|extent| Update::Remove { extent: *extent })
                    .collect()
            })
            .collect();
        let mut deletes = Deletes::new();
        let mut pages = 0u64;
        for (extent, holder) in found {
            let ids = deletes.entry(*holder).or_default();
            for index in extent.first_page..extent.first_page + extent.page_count {
                ids.push(PageId {
                    buffer: extent.buffer,
                    index,
                });
                pages += 1;
            }
        }
        Self {
            removals,
            deletes,
            pages,
        }
    }
}
