//! Copies between the GPU and the tiers beside it, the host tier and the peer GPU
//! ([`Copies`]): the copies in flight and the bytes they move per direction (bounded by
//! the configuration), the copies and device mapping changes queued for the driver, and
//! the bandwidth measured per direction.

use std::collections::VecDeque;

use crate::idmap::IdMap;
use std::time::Duration;

use spillway_types::{CopyOp, Direction, Far, FrameId, PageId, TransferId};

use super::rate::Bandwidth;
use super::types::MappingChange;

/// A copy in flight.
#[derive(Debug)]
pub(super) struct InFlight {
    pub(super) page: PageId,
    pub(super) direction: Direction,
    pub(super) far: Far,
    pub(super) bytes: u64,
    pub(super) issued_at: Duration,
}

/// Copies between GPU and host: in flight, queued for the driver, mapping changes, and
/// the bandwidth measured per direction.
#[derive(Debug)]
pub(super) struct Copies {
    in_flight: IdMap<TransferId, InFlight>,
    out: VecDeque<CopyOp>,
    mappings: VecDeque<MappingChange>,
    in_flight_bytes: [u64; 4],
    in_flight_bytes_max: [u64; 4],
    bandwidth: [Bandwidth; 4],
}

impl Copies {
    /// No copies; at most `h2d_max` bytes in flight into the GPU and `d2h_max` out of it,
    /// per direction (one copy is always allowed; the peer directions have the same
    /// bounds as the host's), bandwidth first guessed at `bytes_per_s`.
    pub(super) fn new(h2d_max: u64, d2h_max: u64, bytes_per_s: f64) -> Copies {
        Copies {
            in_flight: IdMap::default(),
            out: VecDeque::new(),
            mappings: VecDeque::new(),
            in_flight_bytes: [0; 4],
            in_flight_bytes_max: [h2d_max, d2h_max, h2d_max, d2h_max],
            bandwidth: [Bandwidth::new(bytes_per_s); 4],
        }
    }

    /// Whether a copy of `bytes` may start now: within the direction's bound, or one of
    /// the first two in flight whatever the bound (so progress is guaranteed, and the
    /// next copy is queued before the previous one ends: with pages as large as the
    /// bound, one at a time left the copy engine idle for each completion's round trip,
    /// 7% of a step at 64 MiB pages on the H200).
    pub(super) fn may_issue(&self, direction: Direction, bytes: u64) -> bool {
        let d = direction.index();
        self.in_flight_bytes[d] + bytes <= self.in_flight_bytes_max[d].max(2 * bytes)
    }

    /// Records `op` (of `page`) as in flight from `now` and queues it for the driver.
    pub(super) fn issue(&mut self, op: CopyOp, page: PageId, now: Duration) {
        self.in_flight_bytes[op.direction.index()] += op.bytes;
        self.in_flight.insert(
            op.id,
            InFlight {
                page,
                direction: op.direction,
                far: op.far,
                bytes: op.bytes,
                issued_at: now,
            },
        );
        self.out.push_back(op);
    }

    /// Copy `id` finished at `now`: it is no longer in flight and its time is a bandwidth
    /// sample. `None` if no such copy is in flight.
    pub(super) fn complete(&mut self, id: TransferId, now: Duration) -> Option<InFlight> {
        let t = self.in_flight.remove(&id)?;
        let d = t.direction.index();
        self.in_flight_bytes[d] -= t.bytes;
        self.bandwidth[d].on_done(t.issued_at, now, t.bytes);
        Some(t)
    }

    /// Queues a mapping change: `page` now lives in `frame`.
    pub(super) fn map(&mut self, page: PageId, frame: FrameId) {
        self.mappings.push_back(MappingChange::Map { page, frame });
    }

    /// Queues a mapping change: `page` left its frame.
    pub(super) fn unmap(&mut self, page: PageId) {
        self.mappings.push_back(MappingChange::Unmap { page });
    }

    /// The next copy for the driver.
    pub(super) fn poll(&mut self) -> Option<CopyOp> {
        self.out.pop_front()
    }

    /// The next mapping change for the driver.
    pub(super) fn poll_mapping(&mut self) -> Option<MappingChange> {
        self.mappings.pop_front()
    }

    /// The estimated bandwidth of `direction`, bytes/s.
    pub(super) fn bytes_per_s(&self, direction: Direction) -> f64 {
        self.bandwidth[direction.index()].bytes_per_s()
    }

    /// Replaces both directions' estimates with a first guess.
    pub(super) fn set_bandwidth_hint(&mut self, bytes_per_s: f64) {
        for bw in &mut self.bandwidth {
            bw.set_hint(bytes_per_s);
        }
    }

    /// Copies in flight.
    pub(super) fn len(&self) -> usize {
        self.in_flight.len()
    }

    /// Checks that the bytes in flight are the sum of the copies' and within the bounds.
    pub(super) fn check(&self) {
        let mut sums = [0u64; 4];
        let mut counts = [0usize; 4];
        for t in self.in_flight.values() {
            sums[t.direction.index()] += t.bytes;
            counts[t.direction.index()] += 1;
        }
        assert_eq!(sums, self.in_flight_bytes, "bytes in flight");
        for (d, count) in counts.into_iter().enumerate() {
            assert!(
                count <= 1 || self.in_flight_bytes[d] <= self.in_flight_bytes_max[d],
                "in-flight bound of direction {d}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_types::{BufferId, HostSlot};

    fn op(id: u64, direction: Direction, bytes: u64) -> CopyOp {
        CopyOp {
            id: TransferId(id),
            direction,
            frame: FrameId(0),
            far: Far::Host(HostSlot(0)),
            bytes,
        }
    }

    const PAGE: PageId = PageId {
        buffer: BufferId(1),
        index: 0,
    };

    #[test]
    fn the_bound_admits_one_copy_always_and_more_while_under_it() {
        let mut c = Copies::new(100, 10, 1e9);
        assert!(
            c.may_issue(Direction::HostToDevice, 500),
            "the first copy always"
        );
        c.issue(op(1, Direction::HostToDevice, 60), PAGE, Duration::ZERO);
        assert!(c.may_issue(Direction::HostToDevice, 40));
        assert!(!c.may_issue(Direction::HostToDevice, 41));
        assert!(
            c.may_issue(Direction::DeviceToHost, 11),
            "directions are apart"
        );
        assert_eq!(c.poll(), Some(op(1, Direction::HostToDevice, 60)));
        c.check();
        let done = c.complete(TransferId(1), Duration::from_secs(1)).unwrap();
        assert_eq!((done.page, done.bytes), (PAGE, 60));
        assert!(c.complete(TransferId(1), Duration::from_secs(1)).is_none());
        assert_eq!(c.len(), 0);
        assert!(c.may_issue(Direction::HostToDevice, 500));
    }
}
