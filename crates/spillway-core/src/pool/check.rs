//! Checks of the core's invariants (for tests and simulation) and a dump of the page
//! table for failure messages.

use std::fmt::Write;

use spillway_types::PageId;

use super::PoolCore;
use super::pages::{Gpu, Host};
use super::peer::Peer;

impl PoolCore {
    /// Every page's state, one line each, and the queues: for failure messages of tests.
    pub fn describe_pages(&self) -> String {
        let mut out = String::new();
        let mut ids: Vec<_> = self.pages.iter().map(|(id, _)| id).collect();
        ids.sort();
        for id in ids {
            let b = self.pages.get(id).expect("listed");
            for (i, p) in b.pages.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{id:?}/{i} freed={} holders={} host={:?} rs={} gpu={:?} pins={} hp={} inf={} next={:?}",
                    b.freed,
                    b.holders(),
                    p.host,
                    p.remote_space,
                    p.gpu,
                    p.pins,
                    p.host_pins,
                    p.in_flight,
                    self.access.next_use_ahead(id)
                );
            }
        }
        let _ = write!(
            out,
            "free_slots={:?} free_frames={:?} spilling={} evicting={} demand={:?} host_demand={:?} remote_pages={}/{}",
            self.host.free_list(),
            self.gpu.free_list(),
            self.remote.spilling(),
            self.gpu.evicting(),
            self.access.demand,
            self.access.host_demand,
            self.remote.pages(),
            self.remote.pages_max()
        );
        out
    }

    /// Checks every invariant of the module docs; panics with a description if one fails.
    pub fn check_invariants(&self) {
        let total = self.gpu.total();
        assert_eq!(
            self.gpu.owned().count() as u64,
            self.gpu.in_use(),
            "frames in use + free = budget"
        );
        for (frame, pid) in self.gpu.owned() {
            let Some(held) = self.pages.page(pid).gpu.frame() else {
                panic!("frame {frame:?} owned by absent page {pid}");
            };
            assert_eq!(held, frame, "frame {frame:?} and its page {pid} agree");
        }
        let mut slots = self.host.free();
        let mut pinned = 0;
        let mut remote_space = 0;
        let mut peer_owned = 0;
        for (id, b) in self.pages.iter() {
            slots += b.pages.iter().filter(|p| p.host.slot().is_some()).count() as u64;
            remote_space += b.pages.iter().filter(|p| p.remote_space).count() as u64;
            for (index, p) in b.pages.iter().enumerate() {
                pinned += u64::from(p.pins > 0);
                let pid = PageId {
                    buffer: id,
                    index: index as u32,
                };
                if let Some(frame) = p.gpu.frame() {
                    assert_eq!(self.gpu.owner(frame), Some(pid), "{pid} owns its frame");
                }
                if p.reserved {
                    assert!(
                        matches!(p.gpu, Gpu::Resident { dirty: false, .. })
                            && p.pins == 0
                            && p.host_pins == 0,
                        "a reserved frame's page is clean, resident and untouched: {p:?}"
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
                    // Overwritten on the GPU before it was ever written: no copy
                    // anywhere else; it gets a slot when it is written back.
                    (Gpu::Resident { dirty: true, .. }, Host::Zero) => {}
                    (Gpu::Resident { .. }, Host::Remote) => assert!(
                        p.remote_space,
                        "a page on the GPU without a slot has its bytes in the remote tier"
                    ),
                    (gpu, host) => panic!("a page {gpu:?} on the GPU needs its slot: {host:?}"),
                }
                match p.peer {
                    Peer::Absent => {}
                    Peer::Filling(f) => {
                        assert!(
                            matches!(p.gpu, Gpu::Evicting { .. }),
                            "{pid} fills {f:?} while leaving the GPU"
                        );
                        assert_eq!(self.gpu.peer.owner(f), Some(pid), "{pid} owns {f:?}");
                        peer_owned += 1;
                    }
                    Peer::Held(f) => {
                        assert!(
                            !matches!(p.gpu, Gpu::Resident { dirty: true, .. }),
                            "{pid}'s peer copy is current: the page is not dirty"
                        );
                        assert!(
                            matches!(p.host, Host::Slot { .. } | Host::Spilling { .. }),
                            "{pid}'s peer copy has its slot: {:?}",
                            p.host
                        );
                        assert_eq!(self.gpu.peer.owner(f), Some(pid), "{pid} owns {f:?}");
                        peer_owned += 1;
                    }
                }
                if matches!(p.host, Host::Remote | Host::Spilling { .. }) {
                    assert!(p.remote_space, "a remote page has remote space");
                }
            }
        }
        assert_eq!(
            slots,
            self.host.total(),
            "slots in use + free = host budget"
        );
        assert_eq!(pinned, self.held.pinned_pages, "pinned page count");
        assert_eq!(
            peer_owned,
            self.gpu.peer.in_use(),
            "peer frames owned = pages with a peer copy"
        );
        self.gpu.peer.check();
        assert_eq!(remote_space, self.remote.pages(), "remote pages counted");
        assert!(
            self.remote.pages() <= self.remote.pages_max(),
            "remote pages within the remote budget"
        );
        assert!(
            self.held.pinned_pages <= total,
            "pinned pages within the budget"
        );
        self.copies.check();
    }
}
