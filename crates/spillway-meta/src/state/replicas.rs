//! Reads over the replica slots: who holds a page, which holders are live, which pages
//! lost copies.
//!
//! A record is live when its holder can serve it: the member exists, is not down, and is
//! still at the record's epoch ([`MetaState::is_live`]). A member that is leaving still
//! serves the pages it holds (it drains), so its records are live. A slot whose record is
//! not live is under-replicated while another slot still has a live copy of the pages, and
//! the pages are lost when no slot has.

use std::ops::Range;

use spillway_types::{BufferId, PageId};

use super::MetaState;
use crate::command::{Extent, MemberState};
use crate::directory::Holder;

/// A run of pages whose copy in one replica slot is dead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnderReplicated {
    /// The pages: every one has the same dead record in `slot` and the same live copies.
    pub extent: Extent,
    /// The slot whose copy is dead: a repair places the pages into it.
    pub slot: u8,
    /// The dead record's holder.
    pub dead: Holder,
    /// The live copies of every page of `extent` (slot, holder), in slot order: where a
    /// repair copies from. Empty when the pages are lost.
    pub live: Vec<(u8, Holder)>,
}

/// The pool's replication health, for status and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplicationHealth {
    /// Bytes of copies to make again: for every dead slot of a page that still has a live
    /// copy elsewhere, a page's bytes.
    pub under_replicated_bytes: u64,
    /// Bytes of pages with records but no live copy (each page counted once).
    pub lost_bytes: u64,
}

impl MetaState {
    /// Whether `holder`'s record is live: its member exists, is not down, and is at the
    /// record's epoch.
    pub fn is_live(&self, holder: &Holder) -> bool {
        self.members
            .get(&holder.node)
            .is_some_and(|m| m.state != MemberState::Down && m.epoch == holder.epoch)
    }

    /// Every slot's record covering `page` (dead ones included), in slot order.
    pub fn holders_of(&self, page: PageId) -> Vec<(u8, Extent, Holder)> {
        self.directory.lookup(page)
    }

    /// The copy of `page` to read, with the extent of its record: among the live records,
    /// the first (in slot order) of the newest version. `None` when no copy is live.
    pub fn holder_of(&self, page: PageId) -> Option<(Extent, Holder)> {
        let mut best: Option<(Extent, Holder)> = None;
        for (_, e, h) in self.directory.lookup(page) {
            if self.is_live(&h) && best.is_none_or(|(_, b)| h.version > b.version) {
                best = Some((e, h));
            }
        }
        best
    }

    /// The dead copies of the pages of the buffers in `buffers` (a node passes the range of
    /// the buffer ids it is the origin of), each with the live copies to repair it from,
    /// sorted by page then slot. O(records of those buffers).
    pub fn under_replicated(&self, buffers: Range<BufferId>) -> Vec<UnderReplicated> {
        let mut out = Vec::new();
        for (slot, extent, dead) in self.directory.iter_buffers(buffers) {
            if self.is_live(&dead) {
                continue;
            }
            for (piece, others) in self.pieces(slot, extent) {
                out.push(UnderReplicated {
                    extent: piece,
                    slot,
                    dead,
                    live: others
                        .into_iter()
                        .filter(|(_, h)| self.is_live(h))
                        .collect(),
                });
            }
        }
        out.sort_by_key(|u| (u.extent.buffer, u.extent.first_page, u.slot));
        out
    }

    /// The bytes of copies to make again and of pages lost, over the pool.
    /// O(records): for status and metrics, not for every request.
    pub fn replication_health(&self) -> ReplicationHealth {
        let mut health = ReplicationHealth::default();
        for (slot, extent, dead) in self.directory.iter() {
            if self.is_live(&dead) {
                continue;
            }
            for (piece, others) in self.pieces(slot, extent) {
                let bytes = u64::from(piece.page_count) * self.page_bytes;
                if others.iter().any(|(_, h)| self.is_live(h)) {
                    health.under_replicated_bytes += bytes;
                } else if others.iter().all(|&(s, _)| s > slot) {
                    // Lost: counted by the first dead slot of the pages only.
                    health.lost_bytes += bytes;
                }
            }
        }
        health
    }

    /// `extent` (a record of `slot`) cut where the other slots' records start or end, each
    /// piece with the other slots' records covering it, in slot order.
    fn pieces(&self, slot: u8, extent: Extent) -> Vec<(Extent, Vec<(u8, Holder)>)> {
        let others: Vec<(u8, Extent, Holder)> = self
            .directory
            .overlapping_all(extent)
            .filter(|&(s, _, _)| s != slot)
            .collect();
        let (lo, hi) = (u64::from(extent.first_page), extent.end_page());
        let mut cuts = vec![lo, hi];
        for (_, e, _) in &others {
            cuts.push(u64::from(e.first_page).max(lo));
            cuts.push(e.end_page().min(hi));
        }
        cuts.sort_unstable();
        cuts.dedup();
        cuts.windows(2)
            .map(|w| {
                // Both ends lie within `extent`, whose pages fit in u32.
                let piece = Extent::new(extent.buffer, w[0] as u32, (w[1] - w[0]) as u32);
                let covering = others
                    .iter()
                    .filter(|(_, e, _)| u64::from(e.first_page) <= w[0] && e.end_page() >= w[1])
                    .map(|&(s, _, h)| (s, h))
                    .collect();
                (piece, covering)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
