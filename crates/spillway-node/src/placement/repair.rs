//! Re-replication without IO: which of this node's pages have fewer live copies than
//! `replicas`, and how their missing copies are made again.
//!
//! Every origin node repairs its own pages (it spilled them, it knows their checksums and
//! every copy; nobody else has to agree on who repairs what). A copy is live while its
//! holder is a member, not declared down, and of the incarnation that took the copy
//! ([`super::is_live`]). A page with a dead or missing copy and at least one live copy is
//! a [`RepairJob`]: the driver reads it from a live copy (a fetch, checksum checked),
//! plans its dead slots as a spill that keeps the live copies (so the new holders are
//! distinct from them), moves and places it, then calls [`Placement::repaired`]. A page
//! with no live copy is lost (counted, not repairable). A copy on a member that is
//! leaving is live (read from, kept apart from) but its slot is refilled elsewhere, so a
//! leaving node drains.
//!
//! A page is never changed by a client and repaired at once (found by `spillway chaos run
//! kill-two`): a repair that read a page's old bytes could put them over the copy a
//! newer spill left on the same holder (copies are keyed by page, not by version), or
//! delete that copy as stale when it finds the record changed, leaving the record naming
//! a copy that is gone; a second death then lost the page. So a client's spill or
//! discard claims its pages ([`Placement::claim`]; it waits while a repair batch holds
//! one of them), a repair scan leaves claimed pages out, and a repair batch holds its
//! pages ([`Placement::hold_for_repair`]) until it ends ([`Placement::end_repair`]).
//!
//! Bounds: a scan visits every page this node spilled once (it runs at most every
//! repair round of the driver) and yields at most `max_pages` jobs.

use bytes::Bytes;
use spillway_types::{NodeId, PageId};

use super::{Candidate, Deletes, Held, Placement, Planned, Replica, SLOTS, SpillPage, ToPlace};

/// Whether `node` is a member that is leaving the pool.
fn leaving(pool: &[Candidate], node: spillway_types::NodeId) -> bool {
    pool.iter()
        .any(|c| c.id == node && c.state == spillway_meta::MemberState::Leaving)
}

/// How many of this node's pages lack copies, from the last scan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct UnderReplicated {
    /// Pages with fewer live copies than `replicas` (and at least one).
    pub(crate) pages: u64,
    /// Their copies missing, in page bytes (each page counted at the page size).
    pub(crate) bytes: u64,
    /// Pages with no live copy left.
    pub(crate) lost_pages: u64,
}

/// One page to repair.
#[derive(Clone, Debug)]
pub(crate) struct RepairJob {
    /// The local client that spilled it.
    pub(crate) client: u32,
    /// Its id for that client.
    pub(crate) page: PageId,
    /// Its live copies (and its checksum).
    pub(crate) live: Held,
    /// Slots to fill, one bit each.
    pub(crate) slots: u8,
    /// Whether `live` holds no live copy but fenced ones (their holders up at a newer
    /// epoch, maybe only cut off for a while): read them, checksum checked, and place
    /// every slot anew.
    pub(crate) fenced: bool,
}

impl RepairJob {
    /// `jobs` cut into batches of one client each (runs of equal `client`, in order; never
    /// empty): a repair batch reads, plans and places one client's pages.
    pub(crate) fn by_client(jobs: &[RepairJob]) -> impl Iterator<Item = &[RepairJob]> {
        jobs.chunk_by(|a, b| a.client == b.client)
    }
}

impl Placement {
    /// Whether a repair scan is due whatever the pool (a spill came out short since the
    /// last call).
    pub(crate) fn take_repair_dirty(&mut self) -> bool {
        std::mem::take(&mut self.repair_dirty)
    }

    /// Scans this node's pages against `pool`: counts the under-replicated and lost ones
    /// (kept for [`Placement::under_replicated`]), and returns up to `max_pages`
    /// repairable ones, in page order per client (so a batch makes few extents).
    pub(crate) fn repair_jobs(&mut self, pool: &[Candidate], max_pages: usize) -> Vec<RepairJob> {
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-node::repair::scan");
        let mut count = UnderReplicated::default();
        let mut jobs = Vec::new();
        let wanted = self.replicas as usize;
        for (&(client, page), held) in &self.pages {
            let mut live = Held {
                replicas: [None; SLOTS],
                checksum: held.checksum,
            };
            let mut slots = 0u8;
            for s in 0..wanted {
                match held.replicas[s] {
                    Some(r) if super::is_live(pool, &r) => {
                        live.replicas[s] = Some(r);
                        // A leaving holder still serves its copy (a repair reads it) but
                        // drains: its slot is refilled elsewhere.
                        if leaving(pool, r.holder) {
                            slots |= 1 << s;
                        }
                    }
                    _ => slots |= 1 << s,
                }
            }
            // Copies past `replicas` (a node restarted with fewer) count as live copies.
            for s in wanted..SLOTS {
                if let Some(r) = held.replicas[s].filter(|r| super::is_live(pool, r)) {
                    live.replicas[s] = Some(r);
                }
            }
            if slots == 0 {
                continue;
            }
            let mut fenced = false;
            if live.copies().next().is_none() {
                // Copies fenced by a new epoch of a holder that is up may still hold the
                // bytes (their checksum decides when read): copy them anew, every slot.
                for (s, r) in held.copies() {
                    if held.checksum != 0
                        && pool
                            .iter()
                            .any(|c| c.id == r.holder && c.state == spillway_meta::MemberState::Up)
                    {
                        live.replicas[s as usize] = Some(r);
                        fenced = true;
                    }
                }
                if !fenced {
                    count.lost_pages += 1;
                    continue;
                }
                slots = ((1u16 << wanted) - 1) as u8;
            }
            count.pages += 1;
            count.bytes += u64::from(slots.count_ones()) * self.page_bytes;
            // Counted, but left to a later scan while a client changes it or another
            // batch repairs it.
            if self.changing.contains_key(&(client, page))
                || self.repairing.contains(&(client, page))
            {
                continue;
            }
            jobs.push(RepairJob {
                client,
                page,
                live,
                slots,
                fenced,
            });
        }
        self.under_replicated = count;
        jobs.sort_by_key(|j| (j.client, j.page));
        // Round robin from where the last scan stopped (found by `spillway chaos sim`:
        // pages whose copies could not be read kept the head of the order, and the pages
        // after them were never repaired).
        if let Some(cursor) = self.repair_cursor {
            let after = jobs.partition_point(|j| (j.client, j.page) <= cursor);
            jobs.rotate_left(after);
        }
        jobs.truncate(max_pages);
        self.repair_cursor = jobs.last().map(|j| (j.client, j.page));
        // Each client's pages in page order again (a batch makes few extents).
        jobs.sort_by_key(|j| (j.client, j.page));
        jobs
    }

    /// Marks `jobs`' pages as being repaired: a client's [`Placement::claim`] of one of
    /// them fails until [`Placement::end_repair`].
    pub(crate) fn hold_for_repair(&mut self, jobs: &[RepairJob]) {
        self.repairing
            .extend(jobs.iter().map(|j| (j.client, j.page)));
    }

    /// Ends the repair of `jobs`' pages (whatever became of it).
    pub(crate) fn end_repair(&mut self, jobs: &[RepairJob]) {
        for j in jobs {
            self.repairing.remove(&(j.client, j.page));
        }
    }

    /// Claims `pages` of `client` for a spill or a discard: `false` (nothing claimed)
    /// while a repair batch holds one of them, then the caller waits for the batch to
    /// end and tries again. A claimed page is left out of repair scans until
    /// [`Placement::unclaim`].
    pub(crate) fn claim(&mut self, client: u32, pages: &[PageId]) -> bool {
        // A build without claims (the race `spillway chaos run`'s kill-two found), which
        // the simulation must catch (`tests/chaos_broken.rs`).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-node::repair::claim", |_| true);
        if pages.iter().any(|p| self.repairing.contains(&(client, *p))) {
            return false;
        }
        for p in pages {
            *self.changing.entry((client, *p)).or_default() += 1;
        }
        true
    }

    /// Ends a claim of [`Placement::claim`].
    pub(crate) fn unclaim(&mut self, client: u32, pages: &[PageId]) {
        for p in pages {
            if let Some(n) = self.changing.get_mut(&(client, *p)) {
                *n -= 1;
                if *n == 0 {
                    self.changing.remove(&(client, *p));
                }
            }
        }
    }

    /// The spill items of `jobs` whose bytes were read (`data`, in job order; `None`:
    /// not read this round): their dead slots, keeping their live copies.
    pub(crate) fn repair_items(jobs: &[RepairJob], data: Vec<Option<Bytes>>) -> Vec<ToPlace> {
        jobs.iter()
            .zip(data)
            .filter_map(|(j, d)| {
                Some(ToPlace {
                    page: SpillPage {
                        page: j.page,
                        data: d?,
                        checksum: j.live.checksum,
                    },
                    slots: j.slots,
                    // Fenced copies are read, not kept: every slot is placed anew.
                    keep: if j.fenced {
                        [None; SLOTS]
                    } else {
                        j.live.replicas
                    },
                })
            })
            .collect()
    }

    /// Records the new copies of a repair of `client`'s pages (placed in the directory):
    /// each fills its slot, and the dead copy it replaces comes back to delete (a holder
    /// that was only paused still has it; a restarted one answers the delete as missing).
    /// A page discarded or spilled again meanwhile (its record gone or of another
    /// checksum) keeps its record; the copies made for it come back, to delete.
    pub(crate) fn repaired(&mut self, client: u32, planned: &[Planned]) -> Deletes {
        #[cfg(feature = "failpoints")]
        fail::fail_point!("spillway-node::repair::placed");
        let mut stale = Deletes::new();
        let mut dead_copies: Vec<(NodeId, PageId, PageId)> = Vec::new();
        for p in planned {
            match self.pages.get_mut(&(client, p.client_page)) {
                Some(h) if h.checksum == p.checksum => {
                    let new = Replica {
                        holder: p.holder,
                        epoch: p.epoch,
                    };
                    if let Some(dead) = h.replicas[p.slot as usize].replace(new) {
                        dead_copies.push((dead.holder, p.client_page, p.remote));
                    }
                    self.repaired_pages += 1;
                    self.repaired_bytes += p.data.len() as u64;
                }
                _ => stale.entry(p.holder).or_default().push(p.remote),
            }
        }
        // A dead copy is deleted unless its holder now keeps a copy of the page in some
        // slot (the same bytes under the same key: a fenced holder placed again).
        for (holder, page, remote) in dead_copies {
            let kept = self
                .pages
                .get(&(client, page))
                .is_some_and(|h| h.held_on(holder));
            if !kept {
                stale.entry(holder).or_default().push(remote);
            }
        }
        stale
    }
}
