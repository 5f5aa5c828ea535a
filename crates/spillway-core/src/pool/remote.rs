//! The remote tier as the core accounts for it ([`RemoteAccount`]): the remote pages the
//! pool may use and uses, the ops in flight and the bytes they move per direction
//! (bounded), the ops and discards queued for the driver, the tier's measured
//! throughput, and the backoff of spills after the tier refused one.

use std::collections::VecDeque;

use crate::idmap::IdMap;
use std::time::Duration;

use spillway_types::{PageId, TransferId};

use super::rate::Throughput;
use super::types::{RemoteOp, RemoteOpKind};
use super::{SPILL_DEADLINE, SPILL_RETRY_MAX, SPILL_RETRY_MIN};
use crate::retry::{Backoff, Verdict};

/// A remote op in flight.
#[derive(Debug)]
pub(super) struct RemoteInFlight {
    pub(super) page: PageId,
    pub(super) kind: RemoteOpKind,
    pub(super) bytes: u64,
}

/// The remote tier's accounting. With `pages_max == 0` the pool has no remote tier.
#[derive(Debug)]
pub(super) struct RemoteAccount {
    /// Pages the remote tier may hold, and holds (or is being sent).
    pages_max: u64,
    pages: u64,
    ops: IdMap<TransferId, RemoteInFlight>,
    out: VecDeque<RemoteOp>,
    in_flight_bytes: [u64; 2],
    in_flight_bytes_max: u64,
    throughput: Throughput,
    /// Spills in flight (their slots come free when they finish).
    spilling: u64,
    /// Backoff of spills after the remote tier refused one (back-pressure, not a spin).
    spill_retry: Backoff,
    discards: Vec<PageId>,
}

fn index(kind: RemoteOpKind) -> usize {
    usize::from(kind == RemoteOpKind::Spill)
}

impl RemoteAccount {
    /// A tier of `pages_max` pages (0: none) with at most `in_flight_bytes_max` bytes in
    /// flight each way (one op is always allowed), bandwidth first guessed at
    /// `bytes_per_s`.
    pub(super) fn new(pages_max: u64, in_flight_bytes_max: u64, bytes_per_s: f64) -> Self {
        RemoteAccount {
            pages_max,
            pages: 0,
            ops: IdMap::default(),
            out: VecDeque::new(),
            in_flight_bytes: [0; 2],
            in_flight_bytes_max,
            throughput: Throughput::new(bytes_per_s),
            spilling: 0,
            spill_retry: Backoff::new(SPILL_RETRY_MIN, SPILL_RETRY_MAX, SPILL_DEADLINE),
            discards: Vec::new(),
        }
    }

    /// Whether the pool has a remote tier.
    pub(super) fn enabled(&self) -> bool {
        self.pages_max > 0
    }

    /// Pages the tier may hold.
    pub(super) fn pages_max(&self) -> u64 {
        self.pages_max
    }

    /// Pages the tier holds (or is being sent).
    pub(super) fn pages(&self) -> u64 {
        self.pages
    }

    /// Whether an op of `bytes` may start now: within the bound of its direction, or
    /// the first in flight.
    pub(super) fn may_issue(&self, kind: RemoteOpKind, bytes: u64) -> bool {
        let d = index(kind);
        self.in_flight_bytes[d] == 0 || self.in_flight_bytes[d] + bytes <= self.in_flight_bytes_max
    }

    /// Records `op` as in flight from `now` and queues it for the driver.
    pub(super) fn issue(&mut self, op: RemoteOp, now: Duration) {
        self.in_flight_bytes[index(op.kind)] += op.bytes;
        self.throughput.on_issue(now);
        if op.kind == RemoteOpKind::Spill {
            self.spilling += 1;
        }
        self.ops.insert(
            op.id,
            RemoteInFlight {
                page: op.page,
                kind: op.kind,
                bytes: op.bytes,
            },
        );
        self.out.push_back(op);
    }

    /// Op `id` finished at `now` (`ok`: its bytes arrived). `None` if no such op is in
    /// flight.
    pub(super) fn complete(
        &mut self,
        id: TransferId,
        ok: bool,
        now: Duration,
    ) -> Option<RemoteInFlight> {
        let op = self.ops.remove(&id)?;
        self.in_flight_bytes[index(op.kind)] -= op.bytes;
        self.throughput.on_done(now, if ok { op.bytes } else { 0 });
        if op.kind == RemoteOpKind::Spill {
            self.spilling -= 1;
        }
        Some(op)
    }

    /// Takes one page of free remote space; false if the tier is full.
    pub(super) fn take_space(&mut self) -> bool {
        if self.pages < self.pages_max {
            self.pages += 1;
            true
        } else {
            false
        }
    }

    /// `page`'s remote space is given back: its remote copy is to be dropped.
    pub(super) fn give_space(&mut self, page: PageId) {
        self.pages -= 1;
        self.discards.push(page);
    }

    /// `page` keeps its remote space for another page's bytes: its own remote copy is to
    /// be dropped.
    pub(super) fn discard(&mut self, page: PageId) {
        self.discards.push(page);
    }

    /// Whether a spill may start at `now` (no backoff is running).
    pub(super) fn spill_ready(&self, now: Duration) -> bool {
        self.spill_retry.ready(now)
    }

    /// A spill succeeded: the backoff resets.
    pub(super) fn spill_succeeded(&mut self) {
        self.spill_retry.on_success();
    }

    /// A spill failed at `now`: the backoff grows; what to do next.
    pub(super) fn spill_failed(&mut self, now: Duration) -> Verdict {
        self.spill_retry.on_failure(now)
    }

    /// Failed spills since the last success.
    pub(super) fn spill_failures(&self) -> u64 {
        self.spill_retry.failures()
    }

    /// When the running spill backoff ends, if one runs.
    pub(super) fn retry_at(&self) -> Option<Duration> {
        self.spill_retry.retry_at()
    }

    /// Spills in flight.
    pub(super) fn spilling(&self) -> u64 {
        self.spilling
    }

    /// The next op for the driver.
    pub(super) fn poll(&mut self) -> Option<RemoteOp> {
        self.out.pop_front()
    }

    /// Pages whose remote copies are to be dropped.
    pub(super) fn take_discards(&mut self) -> Vec<PageId> {
        std::mem::take(&mut self.discards)
    }

    /// The tier's estimated throughput, bytes/s.
    pub(super) fn bytes_per_s(&self) -> f64 {
        self.throughput.bytes_per_s()
    }

    /// Replaces the throughput estimate with a first guess.
    pub(super) fn set_bandwidth_hint(&mut self, bytes_per_s: f64) {
        self.throughput.set_hint(bytes_per_s);
    }

    /// Ops in flight.
    pub(super) fn len(&self) -> usize {
        self.ops.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_types::{BufferId, HostSlot};

    fn op(id: u64, kind: RemoteOpKind, bytes: u64) -> RemoteOp {
        RemoteOp {
            id: TransferId(id),
            kind,
            page: PageId {
                buffer: BufferId(1),
                index: id as u32,
            },
            slot: HostSlot(0),
            bytes,
        }
    }

    #[test]
    fn space_ops_and_spills_are_counted() {
        let mut r = RemoteAccount::new(2, 100, 1e9);
        assert!(r.enabled());
        assert!(r.take_space() && r.take_space());
        assert!(!r.take_space(), "two pages of two");
        r.issue(op(1, RemoteOpKind::Spill, 80), Duration::ZERO);
        assert_eq!(r.spilling(), 1);
        assert!(!r.may_issue(RemoteOpKind::Spill, 21));
        assert!(
            r.may_issue(RemoteOpKind::Fetch, 500),
            "the first fetch always"
        );
        assert_eq!(r.poll().map(|o| o.id), Some(TransferId(1)));
        let done = r
            .complete(TransferId(1), true, Duration::from_millis(1))
            .unwrap();
        assert_eq!(
            (done.kind, done.bytes, r.spilling(), r.len()),
            (RemoteOpKind::Spill, 80, 0, 0)
        );
        r.give_space(done.page);
        assert_eq!(r.pages(), 1);
        assert_eq!(r.take_discards(), vec![done.page]);
        assert!(!RemoteAccount::new(0, 100, 1e9).enabled());
    }
}
