//! One spill's rounds of puts without IO ([`SpillRounds`]): the copies planned so far,
//! those whose put is still to be made, and the peers left out after they failed. Both
//! drivers (`remote::RemoteService` over tokio and QUIC, `chaos::driver` over the
//! simulated pool) run the same loop around it:
//!
//! 1. hash the pages ([`checksummed`], outside every lock), plan and reserve their items,
//!    and start the rounds with the result ([`SpillRounds::new`]);
//! 2. put [`SpillRounds::pending`] on their holders;
//! 3. hand the failures to [`SpillRounds::after_round`]: done (place
//!    [`SpillRounds::copies`]), fail (refund and drop [`SpillRounds::copies`]), or plan
//!    the returned items again without [`SpillRounds::excluded`], give the result to
//!    [`SpillRounds::planned`] and go back to 2 (a planning error abandons
//!    [`SpillRounds::copies`] as a failure does).
//!
//! Invariant: a copy is in exactly one of `copies` and `pending`, until a replan takes
//! the failed peers' copies out of both (their reservations refunded).

use bytes::Bytes;
use spillway_types::wire::page_checksum;
use spillway_types::{NodeId, PageId};

use super::{MoveVerdict, Placement, Planned, SpillPage, ToPlace};
use crate::tier::RemoteError;

/// Hashes each page once; the checksum travels with the page from here.
pub(crate) fn checksummed(pages: Vec<(PageId, Bytes)>) -> Vec<SpillPage> {
    pages
        .into_iter()
        .map(|(page, data)| SpillPage {
            page,
            checksum: page_checksum(&data),
            data,
        })
        .collect()
}

/// The copies of one spill between its rounds of puts (see the module docs).
#[derive(Debug)]
pub(crate) struct SpillRounds {
    /// Copies whose put landed; after a failure, every copy planned and not refunded.
    copies: Vec<Planned>,
    /// Copies planned and reserved whose put is still to be made.
    pending: Vec<Planned>,
    /// Peers found unreachable: later rounds plan without them.
    excluded: Vec<NodeId>,
}

/// What the driver does after a round of puts ([`SpillRounds::after_round`]).
#[derive(Debug)]
pub(crate) enum SpillStep {
    /// Every copy landed: place [`SpillRounds::copies`].
    Done,
    /// Give up with this error: refund and drop [`SpillRounds::copies`].
    Fail(RemoteError),
    /// The `failed` peers were unreachable (their copies refunded): plan `items` again
    /// without [`SpillRounds::excluded`] and hand the plan to [`SpillRounds::planned`].
    Replan {
        /// The peers of this round that were unreachable.
        failed: Vec<NodeId>,
        /// Their copies' pages, each keeping the copies that landed.
        items: Vec<ToPlace>,
    },
}

impl SpillRounds {
    /// The rounds of a spill whose first plan is `pending` (reserved, nothing put yet).
    pub(crate) fn new(pending: Vec<Planned>) -> Self {
        Self {
            copies: Vec::with_capacity(pending.len()),
            pending,
            excluded: Vec::new(),
        }
    }

    /// The copies to put this round.
    pub(crate) fn pending(&self) -> &[Planned] {
        &self.pending
    }

    /// The copies to place (after [`SpillStep::Done`]) or to abandon (after
    /// [`SpillStep::Fail`] or a planning error).
    pub(crate) fn copies(&self) -> &[Planned] {
        &self.copies
    }

    /// The peers to plan without.
    pub(crate) fn excluded(&self) -> &[NodeId] {
        &self.excluded
    }

    /// Settles round `attempt` (from 0) of puts, with `failures` (the first error of each
    /// failed peer; see [`Placement::after_moves`]). On a replan, gives `brain` back what
    /// the failed peers' copies spent.
    pub(crate) fn after_round(
        &mut self,
        brain: &mut Placement,
        failures: Vec<(NodeId, RemoteError)>,
        attempt: usize,
    ) -> SpillStep {
        let failed = match Placement::after_moves(failures, attempt) {
            MoveVerdict::Done => {
                self.copies.append(&mut self.pending);
                return SpillStep::Done;
            }
            MoveVerdict::Fail(e) => {
                self.copies.append(&mut self.pending);
                return SpillStep::Fail(e);
            }
            MoveVerdict::Replan(failed) => failed,
        };
        self.excluded.extend(failed.iter().copied());
        let (redo, ok): (Vec<Planned>, Vec<Planned>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| failed.contains(&p.holder));
        self.copies.extend(ok);
        // Their copies go elsewhere: what they spent on the failed peers comes back.
        brain.refund(&redo);
        let items = Placement::replan_items(&self.copies, redo);
        SpillStep::Replan { failed, items }
    }

    /// The plan for the items of the last [`SpillStep::Replan`], reserved: next round's
    /// copies to put.
    pub(crate) fn planned(&mut self, pending: Vec<Planned>) {
        self.pending = pending;
    }

    /// The copies, once the rounds are over.
    pub(crate) fn into_copies(self) -> Vec<Planned> {
        self.copies
    }
}
