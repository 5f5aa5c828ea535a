//! The directory: which node holds the pages that left their home node.
//!
//! An interval map per buffer: records are keyed by `(buffer, first_page)` and never
//! overlap. Placing an extent cuts any record it overlaps (keeping the parts outside the
//! extent) and inserts the new one; removing an extent cuts without inserting. Adjacent
//! records are not merged, so the number of records is bounded by the number of
//! placements, and [`crate::limits::DIRECTORY_EXTENTS_MAX`] bounds that.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use spillway_types::{BufferId, PageId};

use crate::command::Extent;
use crate::ids::{Epoch, NodeId};

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

/// A piece of a record that an insert or a remove took out: `pages` pages at `node`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cut {
    pub node: NodeId,
    pub pages: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Directory {
    map: BTreeMap<(BufferId, u32), Record>,
}

impl Directory {
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Records that share at least one page with `extent`, in page order.
    pub(crate) fn overlapping(
        &self,
        extent: Extent,
    ) -> impl Iterator<Item = (Extent, Holder)> + '_ {
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

    /// Replaces whatever records `extent`'s pages had by one record at `holder`.
    pub(crate) fn insert(&mut self, extent: Extent, holder: Holder, cuts: &mut Vec<Cut>) {
        self.cut(extent, cuts);
        self.map.insert(
            (extent.buffer, extent.first_page),
            Record {
                page_count: extent.page_count,
                holder,
            },
        );
    }

    /// Forgets the records of `extent`'s pages.
    pub(crate) fn remove(&mut self, extent: Extent, cuts: &mut Vec<Cut>) {
        self.cut(extent, cuts);
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
                node: holder.node,
                pages: old_hi.min(hi) - old_lo.max(lo),
            });
        }
    }

    /// The record covering `page`, if any.
    pub(crate) fn lookup(&self, page: PageId) -> Option<(Extent, Holder)> {
        let (&(buffer, first), r) = self.map.range(..=(page.buffer, page.index)).next_back()?;
        let extent = Extent::new(buffer, first, r.page_count);
        extent.contains(page).then_some((extent, r.holder))
    }

    /// Drops every record of `node` that `drop` selects; returns the pages dropped.
    pub(crate) fn drop_where(
        &mut self,
        node: NodeId,
        mut drop: impl FnMut(&Holder) -> bool,
    ) -> u64 {
        let mut pages = 0;
        self.map.retain(|_, r| {
            let gone = r.holder.node == node && drop(&r.holder);
            if gone {
                pages += u64::from(r.page_count);
            }
            !gone
        });
        pages
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (Extent, Holder)> + '_ {
        self.map
            .iter()
            .map(|(&(buffer, first), r)| (Extent::new(buffer, first, r.page_count), r.holder))
    }

    /// Rebuilds a directory from records; `None` if two of them overlap.
    pub(crate) fn from_records(
        records: impl IntoIterator<Item = (Extent, Holder)>,
    ) -> Option<Self> {
        let mut map = BTreeMap::new();
        for (e, holder) in records {
            map.insert(
                (e.buffer, e.first_page),
                Record {
                    page_count: e.page_count,
                    holder,
                },
            );
        }
        let dir = Directory { map };
        dir.is_disjoint().then_some(dir)
    }

    /// Whether no two records share a page.
    pub(crate) fn is_disjoint(&self) -> bool {
        let mut prev: Option<(BufferId, u64)> = None;
        for (e, _) in self.iter() {
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

    #[test]
    fn insert_cuts_overlaps_and_keeps_outside_parts() {
        let mut d = Directory::default();
        let mut cuts = Vec::new();
        d.insert(Extent::new(BufferId(1), 0, 10), h(1), &mut cuts);
        assert!(cuts.is_empty());
        d.insert(Extent::new(BufferId(1), 3, 4), h(2), &mut cuts);
        assert_eq!(
            cuts,
            vec![Cut {
                node: NodeId(1),
                pages: 4
            }]
        );
        assert_eq!(d.len(), 3);
        assert_eq!(d.lookup(page(1, 2)).unwrap().1.node, NodeId(1));
        assert_eq!(d.lookup(page(1, 3)).unwrap().1.node, NodeId(2));
        assert_eq!(d.lookup(page(1, 6)).unwrap().1.node, NodeId(2));
        assert_eq!(d.lookup(page(1, 7)).unwrap().1.node, NodeId(1));
        assert!(d.lookup(page(1, 10)).is_none());
        assert!(d.lookup(page(2, 0)).is_none());
        assert!(d.is_disjoint());

        cuts.clear();
        d.remove(Extent::new(BufferId(1), 1, 8), &mut cuts);
        let total: u64 = cuts.iter().map(|c| c.pages).sum();
        assert_eq!(total, 8);
        assert_eq!(d.len(), 2);
        assert!(d.lookup(page(1, 0)).is_some());
        assert!(d.lookup(page(1, 5)).is_none());
        assert!(d.lookup(page(1, 9)).is_some());
    }

    #[test]
    fn buffers_do_not_mix() {
        let mut d = Directory::default();
        let mut cuts = Vec::new();
        d.insert(Extent::new(BufferId(1), 0, 100), h(1), &mut cuts);
        d.insert(Extent::new(BufferId(2), 0, 1), h(2), &mut cuts);
        assert!(cuts.is_empty());
        assert_eq!(d.overlapping(Extent::new(BufferId(2), 0, 5)).count(), 1);
        assert_eq!(d.drop_where(NodeId(1), |_| true), 100);
        assert_eq!(d.len(), 1);
    }

    #[test]
    fn overlapping_records_are_refused_on_rebuild() {
        let e1 = Extent::new(BufferId(1), 0, 4);
        let e2 = Extent::new(BufferId(1), 3, 4);
        assert!(Directory::from_records([(e1, h(1)), (e2, h(1))]).is_none());
        let e3 = Extent::new(BufferId(1), 4, 4);
        assert!(Directory::from_records([(e1, h(1)), (e3, h(1))]).is_some());
    }
}
