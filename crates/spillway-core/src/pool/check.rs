//! Checks of the core's invariants (for tests and simulation) and a dump of the page
//! table for failure messages.

use super::*;

impl PoolCore {
    /// Every page's state, one line each, and the queues: for failure messages of tests.
    pub fn describe_pages(&self) -> String {
        let mut out = String::new();
        let mut ids: Vec<_> = self.buffers.keys().copied().collect();
        ids.sort();
        for id in ids {
            let b = &self.buffers[&id];
            for (i, p) in b.pages.iter().enumerate() {
                out += &format!(
                    "{id:?}/{i} freed={} holders={} host={:?} rs={} gpu={:?} pins={} hp={} inf={} next={:?}\n",
                    b.freed,
                    b.holders(),
                    p.host,
                    p.remote_space,
                    p.gpu,
                    p.pins,
                    p.host_pins,
                    p.in_flight,
                    self.next_use_of(id)
                );
            }
        }
        out += &format!(
            "free_slots={:?} free_frames={:?} spilling={} evicting={} demand={:?} host_demand={:?} remote_pages={}/{}",
            self.host.free_slots,
            self.gpu.free_frames,
            self.remote.spilling,
            self.gpu.evicting_frames,
            self.access.demand,
            self.remote.host_demand,
            self.remote.remote_pages,
            self.remote.remote_pages_max
        );
        out
    }

    /// Checks every invariant of the module docs; panics with a description if one fails.
    pub fn check_invariants(&self) {
        let total = self.gpu.frames.len();
        let used = self.gpu.frames.iter().filter(|f| f.is_some()).count();
        assert_eq!(
            used + self.gpu.free_frames.len(),
            total,
            "frames in use + free = budget"
        );
        for (i, owner) in self.gpu.frames.iter().enumerate() {
            if let Some(pid) = owner {
                let frame = match self.page(*pid).gpu {
                    Gpu::Loading { frame, .. }
                    | Gpu::Resident { frame, .. }
                    | Gpu::Evicting { frame } => frame,
                    Gpu::Absent => panic!("frame {i} owned by absent page {pid}"),
                };
                assert_eq!(frame.0 as usize, i, "frame {i} and its page {pid} agree");
            }
        }
        let mut slots = self.host.free_slots.len() as u64;
        let mut pinned = 0;
        let mut remote_space = 0;
        for (id, b) in &self.buffers {
            slots += b.pages.iter().filter(|p| p.host.slot().is_some()).count() as u64;
            remote_space += b.pages.iter().filter(|p| p.remote_space).count() as u64;
            for (index, p) in b.pages.iter().enumerate() {
                pinned += u64::from(p.pins > 0);
                if let Gpu::Loading { frame, .. }
                | Gpu::Resident { frame, .. }
                | Gpu::Evicting { frame } = p.gpu
                {
                    let pid = PageId {
                        buffer: *id,
                        index: index as u32,
                    };
                    assert_eq!(
                        self.gpu.frames[frame.0 as usize],
                        Some(pid),
                        "{pid} owns its frame"
                    );
                }
                let in_flight = matches!(p.gpu, Gpu::Loading { .. } | Gpu::Evicting { .. })
                    || matches!(p.host, Host::Fetching { .. } | Host::Spilling { .. });
                assert_eq!(
                    in_flight,
                    p.in_flight > 0,
                    "in-flight count of a page matches its state"
                );
                match (p.gpu, p.host) {
                    (Gpu::Absent, _) | (_, Host::Slot { .. }) => {}
                    (Gpu::Resident { .. }, Host::Remote) => assert!(
                        p.remote_space,
                        "a page on the GPU without a slot has its bytes in the remote tier"
                    ),
                    (gpu, host) => panic!("a page {gpu:?} on the GPU needs its slot: {host:?}"),
                }
                if matches!(p.host, Host::Remote | Host::Spilling { .. }) {
                    assert!(p.remote_space, "a remote page has remote space");
                }
            }
        }
        assert_eq!(
            slots,
            self.cfg.host_slots(),
            "slots in use + free = host budget"
        );
        assert_eq!(pinned, self.held.pinned_pages, "pinned page count");
        assert_eq!(
            remote_space, self.remote.remote_pages,
            "remote pages counted"
        );
        assert!(
            self.remote.remote_pages <= self.remote.remote_pages_max,
            "remote pages within the remote budget"
        );
        assert!(
            self.held.pinned_pages <= total as u64,
            "pinned pages within the budget"
        );
        let mut sums = [0u64; 2];
        for t in self.copies.transfers.values() {
            sums[dir_index(t.direction)] += t.bytes;
        }
        assert_eq!(sums, self.copies.in_flight_bytes, "bytes in flight");
        for (d, max) in [
            self.cfg.h2d_bytes_in_flight_max,
            self.cfg.d2h_bytes_in_flight_max,
        ]
        .into_iter()
        .enumerate()
        {
            let single = self
                .copies
                .transfers
                .values()
                .filter(|t| dir_index(t.direction) == d)
                .count()
                <= 1;
            assert!(
                single || self.copies.in_flight_bytes[d] <= max,
                "in-flight bound of direction {d}"
            );
        }
    }
}
