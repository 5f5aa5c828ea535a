//! The directory: which nodes hold the pages that left their home node.
//!
//! One interval map per replica slot (`0..`[`crate::limits::REPLICAS_MAX`]): a page spilled
//! with `k` replicas has a record in slots `0..k`, each naming one holder. Within a slot,
//! records are keyed by `(buffer, first_page)` and never overlap. Placing an extent into a
//! slot cuts that slot's records it overlaps (keeping the parts outside the extent) and
//! inserts the new one; removing an extent cuts in every slot without inserting. Adjacent
//! records are not merged, so the number of records is bounded by the number of
//! placements, and [`crate::limits::DIRECTORY_EXTENTS_MAX`] bounds that over all slots.
//!
//! Whether a record is live (its holder up at the record's epoch) is the state machine's
//! business ([`crate::MetaState::is_live`]): the directory keeps dead records too, so the
//! slots a death emptied stay visible until a repair places into them or the pages leave.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use spillway_types::{BufferId, PageId};

use crate::command::Extent;
use crate::ids::{Epoch, NodeId};
use crate::limits::REPLICAS_MAX;

/// Who holds a run of pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Holder {
    /// The node whose host memory has the pages.
    pub node: NodeId,
    /// The node's epoch when the record was written; records of an earlier epoch are dead.
    pub epoch: Epoch,
    /// Version of the pages' data.
    pub version: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    page_count: u32,
    holder: Holder,
}

/// A piece of a record that an insert or a remove took out: `pages` pages at `holder`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cut {
    pub holder: Holder,
    pub pages: u64,
}

/// One slot's interval map.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct SlotMap {
    map: BTreeMap<(BufferId, u32), Record>,
}

impl SlotMap {
    fn overlapping(&self, extent: Extent) -> impl Iterator<Item = (Extent, Holder)> + '_ {
        let start = match self
            .map
            .range(..=(extent.buffer, extent.first_page))
            .next_back()
        {
            Some((&(buffer, first), r))
                if buffer == extent.buffer
                    && u64::from(first) + u64::from(r.page_count)
                        > u64::from(extent.first_page) =>
            {
                (buffer, first)
            }
            _ => (extent.buffer, extent.first_page),
        };
        // end_page() <= PAGES_PER_BUFFER_MAX (validated), which fits in u32.
        let end = (extent.buffer, extent.end_page() as u32);
        self.map
            .range(start..end)
            .map(|(&(buffer, first_page), r)| {
                (Extent::new(buffer, first_page, r.page_count), r.holder)
            })
    }

    fn cut(&mut self, extent: Extent, cuts: &mut Vec<Cut>) {
        // Usually zero or one record overlaps: collect only the keys.
        let keys: Vec<(Extent, Holder)> = self.overlapping(extent).collect();
        let (lo, hi) = (u64::from(extent.first_page), extent.end_page());
        for (old, holder) in keys {
            self.map.remove(&(old.buffer, old.first_page));
            let (old_lo, old_hi) = (u64::from(old.first_page), old.end_page());
            if old_lo < lo {
                self.map.insert(
                    (old.buffer, old.first_page),
                    Record {
                        page_count: (lo - old_lo) as u32,
                        holder,
                    },
                );
            }
            if old_hi > hi {
                self.map.insert(
                    (old.buffer, hi as u32),
                    Record {
                        page_count: (old_hi - hi) as u32,
                        holder,
                    },
                );
            }
            cuts.push(Cut {
                holder,
                pages: old_hi.min(hi) - old_lo.max(lo),
            });
        }
    }

    fn lookup(&self, page: PageId) -> Option<(Extent, Holder)> {
        let (&(buffer, first), r) = self.map.range(..=(page.buffer, page.index)).next_back()?;
        let extent = Extent::new(buffer, first, r.page_count);
        extent.contains(page).then_some((extent, r.holder))
    }

    fn iter(&self) -> impl Iterator<Item = (Extent, Holder)> + '_ {
        self.map
            .iter()
            .map(|(&(buffer, first), r)| (Extent::new(buffer, first, r.page_count), r.holder))
    }

    fn iter_buffers(
        &self,
        buffers: Range<BufferId>,
    ) -> impl Iterator<Item = (Extent, Holder)> + '_ {
        // BTreeMap::range panics on an inverted range: an empty one iterates nothing.
        let range = (buffers.start < buffers.end)
            .then(|| self.map.range((buffers.start, 0)..(buffers.end, 0)));
        range
            .into_iter()
            .flatten()
            .map(|(&(buffer, first), r)| (Extent::new(buffer, first, r.page_count), r.holder))
    }
}

/// The directory: [`REPLICAS_MAX`] slot maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Directory {
    slots: [SlotMap; REPLICAS_MAX],
}

impl Directory {
    /// Records over all slots.
    pub(crate) fn len(&self) -> usize {
        self.slots.iter().map(|s| s.map.len()).sum()
    }

    /// Records of `slot` that share at least one page with `extent`, in page order.
    pub(crate) fn overlapping(
        &self,
        slot: u8,
        extent: Extent,
    ) -> impl Iterator<Item = (Extent, Holder)> + '_ {
        self.slots[usize::from(slot)].overlapping(extent)
    }

    /// Records of every slot that share at least one page with `extent`, slot by slot.
    pub(crate) fn overlapping_all(
        &self,
        extent: Extent,
    ) -> impl Iterator<Item = (u8, Extent, Holder)> + '_ {
        (0..REPLICAS_MAX as u8).flat_map(move |slot| {
            self.overlapping(slot, extent)
                .map(move |(e, h)| (slot, e, h))
        })
    }

    /// Replaces whatever records `extent`'s pages had in `slot` by one record at `holder`.
    pub(crate) fn insert(&mut self, slot: u8, extent: Extent, holder: Holder, cuts: &mut Vec<Cut>) {
        let s = &mut self.slots[usize::from(slot)];
        s.cut(extent, cuts);
        s.map.insert(
            (extent.buffer, extent.first_page),
            Record {
                page_count: extent.page_count,
                holder,
            },
        );
    }

    /// Forgets the records of `extent`'s pages in every slot.
    pub(crate) fn remove(&mut self, extent: Extent, cuts: &mut Vec<Cut>) {
        for s in &mut self.slots {
            s.cut(extent, cuts);
        }
    }

    /// Every slot's record covering `page`, in slot order.
    pub(crate) fn lookup(&self, page: PageId) -> Vec<(u8, Extent, Holder)> {
        (0..REPLICAS_MAX as u8)
            .filter_map(|slot| {
                self.slots[usize::from(slot)]
                    .lookup(page)
                    .map(|(e, h)| (slot, e, h))
            })
            .collect()
    }

    /// Pages of the records of `node` that `select` selects, over all slots.
    pub(crate) fn pages_where(&self, node: NodeId, mut select: impl FnMut(&Holder) -> bool) -> u64 {
        self.iter()
            .filter(|(_, _, h)| h.node == node && select(h))
            .map(|(_, e, _)| u64::from(e.page_count))
            .sum()
    }

    /// Drops every record of `node`, in every slot; returns the records dropped.
    pub(crate) fn drop_node(&mut self, node: NodeId) -> Vec<(Extent, Holder)> {
        let mut dropped = Vec::new();
        for s in &mut self.slots {
            s.map.retain(|&(buffer, first), r| {
                let gone = r.holder.node == node;
                if gone {
                    dropped.push((Extent::new(buffer, first, r.page_count), r.holder));
                }
                !gone
            });
        }
        dropped
    }

    /// Every record, slot by slot, each slot in page order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u8, Extent, Holder)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .flat_map(|(slot, s)| s.iter().map(move |(e, h)| (slot as u8, e, h)))
    }

    /// The records of the buffers in `buffers`, slot by slot, each slot in page order.
    pub(crate) fn iter_buffers(
        &self,
        buffers: Range<BufferId>,
    ) -> impl Iterator<Item = (u8, Extent, Holder)> + '_ {
        self.slots.iter().enumerate().flat_map(move |(slot, s)| {
            s.iter_buffers(buffers.clone())
                .map(move |(e, h)| (slot as u8, e, h))
        })
    }

    /// Rebuilds a directory from records; `None` if a slot is out of range or two records
    /// of one slot overlap.
    pub(crate) fn from_records(
        records: impl IntoIterator<Item = (u8, Extent, Holder)>,
    ) -> Option<Self> {
        let mut dir = Directory::default();
        for (slot, e, holder) in records {
            let s = dir.slots.get_mut(usize::from(slot))?;
            let old = s.map.insert(
                (e.buffer, e.first_page),
                Record {
                    page_count: e.page_count,
                    holder,
                },
            );
            if old.is_some() {
                return None;
            }
        }
        dir.is_disjoint().then_some(dir)
    }

    /// Whether every record is valid and no two records of one slot share a page.
    pub(crate) fn is_disjoint(&self) -> bool {
        self.slots.iter().all(|s| {
            let mut prev: Option<(BufferId, u64)> = None;
            for (&(buffer, first), r) in &s.map {
                let e = Extent::new(buffer, first, r.page_count);
                if e.invalid_reason().is_some() {
                    return false;
                }
                if let Some((b, end)) = prev
                    && b == e.buffer
                    && end > u64::from(e.first_page)
                {
                    return false;
                }
                prev = Some((e.buffer, e.end_page()));
            }
            true
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(node: u64) -> Holder {
        Holder {
            node: NodeId(node),
            epoch: Epoch(1),
            version: 1,
        }
    }

    fn page(b: u64, i: u32) -> PageId {
        PageId {
            buffer: BufferId(b),
            index: i,
        }
    }

    fn nodes(d: &Directory, p: PageId) -> Vec<(u8, u64)> {
        d.lookup(p).iter().map(|&(s, _, h)| (s, h.node.0)).collect()
    }

    #[test]
    fn insert_cuts_overlaps_of_its_slot_and_keeps_outside_parts() {
        let mut d = Directory::default();
        let mut cuts = Vec::new();
        d.insert(0, Extent::new(BufferId(1), 0, 10), h(1), &mut cuts);
        d.insert(1, Extent::new(BufferId(1), 0, 10), h(3), &mut cuts);
        assert!(cuts.is_empty());
        d.insert(0, Extent::new(BufferId(1), 3, 4), h(2), &mut cuts);
        assert_eq!(
            cuts,
            vec![Cut {
                holder: h(1),
                pages: 4
            }]
        );
        assert_eq!(d.len(), 4);
        assert_eq!(nodes(&d, page(1, 2)), vec![(0, 1), (1, 3)]);
        assert_eq!(nodes(&d, page(1, 3)), vec![(0, 2), (1, 3)]);
        assert_eq!(nodes(&d, page(1, 6)), vec![(0, 2), (1, 3)]);
        assert_eq!(nodes(&d, page(1, 7)), vec![(0, 1), (1, 3)]);
        assert!(d.lookup(page(1, 10)).is_empty());
        assert!(d.lookup(page(2, 0)).is_empty());
        assert!(d.is_disjoint());

        // A remove cuts every slot.
        cuts.clear();
        d.remove(Extent::new(BufferId(1), 1, 8), &mut cuts);
        let total: u64 = cuts.iter().map(|c| c.pages).sum();
        assert_eq!(total, 16);
        assert_eq!(d.len(), 4);
        assert_eq!(nodes(&d, page(1, 0)), vec![(0, 1), (1, 3)]);
        assert!(d.lookup(page(1, 5)).is_empty());
        assert_eq!(nodes(&d, page(1, 9)), vec![(0, 1), (1, 3)]);
    }

    #[test]
    fn buffers_do_not_mix_and_ranges_select_buffers() {
        let mut d = Directory::default();
        let mut cuts = Vec::new();
        d.insert(0, Extent::new(BufferId(1), 0, 100), h(1), &mut cuts);
        d.insert(2, Extent::new(BufferId(1), 0, 100), h(2), &mut cuts);
        d.insert(0, Extent::new(BufferId(2), 0, 1), h(2), &mut cuts);
        assert!(cuts.is_empty());
        assert_eq!(d.overlapping(0, Extent::new(BufferId(2), 0, 5)).count(), 1);
        assert_eq!(d.overlapping_all(Extent::new(BufferId(1), 5, 5)).count(), 2);
        assert_eq!(d.iter_buffers(BufferId(1)..BufferId(2)).count(), 2);
        assert_eq!(d.iter_buffers(BufferId(2)..BufferId(9)).count(), 1);
        assert_eq!(d.iter_buffers(BufferId(9)..BufferId(2)).count(), 0);
        assert_eq!(d.pages_where(NodeId(2), |_| true), 101);
        assert_eq!(d.drop_node(NodeId(1)).len(), 1);
        assert_eq!(d.len(), 2);
        let slots: Vec<u8> = d.iter().map(|(s, _, _)| s).collect();
        assert_eq!(slots, vec![0, 2]);
    }

    #[test]
    fn overlapping_records_and_bad_slots_are_refused_on_rebuild() {
        let e1 = Extent::new(BufferId(1), 0, 4);
        let e2 = Extent::new(BufferId(1), 3, 4);
        assert!(Directory::from_records([(0, e1, h(1)), (0, e2, h(1))]).is_none());
        assert!(Directory::from_records([(0, e1, h(1)), (0, e1, h(2))]).is_none());
        assert!(Directory::from_records([(0, e1, h(1)), (1, e2, h(2))]).is_some());
        assert!(Directory::from_records([(REPLICAS_MAX as u8, e1, h(1))]).is_none());
        let e3 = Extent::new(BufferId(1), 4, 4);
        assert!(Directory::from_records([(0, e1, h(1)), (0, e3, h(1))]).is_some());
    }
}
