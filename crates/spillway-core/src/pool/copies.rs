//! Copies between the GPU and the host tier: starting loads and write-backs, choosing
//! a frame for a load (a free one, one coming free, or an eviction by the policy), and
//! their completions, which feed the bandwidth estimate of each direction.

use super::*;
use crate::eviction::VictimView;

impl PoolCore {
    /// Records that copy `id` finished (`Err` with the device's message if it failed).
    pub fn handle_transfer_done(
        &mut self,
        id: TransferId,
        result: Result<(), String>,
        now: Duration,
    ) {
        let Some(t) = self.copies.transfers.remove(&id) else {
            debug_assert!(false, "completion of unknown transfer {id:?}");
            return;
        };
        let d = dir_index(t.direction);
        self.copies.in_flight_bytes[d] -= t.bytes;
        self.copies.bandwidth[d].on_done(t.issued_at, now, t.bytes);
        let pid = t.page;
        let page = self.page_mut(pid);
        page.in_flight -= 1;
        if let Err(e) = result {
            self.failed.get_or_insert(CoreError::DeviceFailed(e));
        }
        let (freed, wanted) = {
            let b = &self.buffers[&pid.buffer];
            let p = &b.pages[pid.index as usize];
            (b.freed, p.pins > 0)
        };
        match (t.direction, self.page(pid).gpu) {
            (Direction::HostToDevice, Gpu::Loading { frame, prefetch }) => {
                self.stats.h2d_bytes += t.bytes;
                self.page_mut(pid).gpu = Gpu::Resident {
                    frame,
                    dirty: false,
                    unused_prefetch: prefetch && !wanted,
                };
                self.eviction.on_fill(frame);
                self.gpu.frame_next_use[frame.0 as usize] =
                    self.access.next_use.get(&pid.buffer).copied();
                if freed {
                    self.release_frame(pid, frame);
                }
            }
            (Direction::DeviceToHost, Gpu::Evicting { frame }) => {
                self.stats.d2h_bytes += t.bytes;
                if let Host::Slot { clean, .. } = &mut self.page_mut(pid).host {
                    *clean = false;
                }
                self.gpu.evicting_frames -= 1;
                self.page_mut(pid).gpu = Gpu::Resident {
                    frame,
                    dirty: false,
                    unused_prefetch: false,
                };
                if !wanted || freed {
                    self.release_frame(pid, frame);
                }
            }
            (dir, state) => panic!("completion of {dir:?} for {pid} in state {state:?}"),
        }
        self.reap(pid.buffer);
        self.pump(now);
    }

    pub(super) fn new_transfer(
        &mut self,
        pid: PageId,
        direction: Direction,
        frame: FrameId,
        now: Duration,
    ) {
        let (slot, bytes) = {
            let b = &self.buffers[&pid.buffer];
            let p = &b.pages[pid.index as usize];
            let Host::Slot { slot, .. } = p.host else {
                panic!("GPU copy of {pid} whose host state is {:?}", p.host);
            };
            (slot, self.page_len(b.bytes, pid.index))
        };
        let id = TransferId(self.ids.next_transfer);
        self.ids.next_transfer += 1;
        self.copies.in_flight_bytes[dir_index(direction)] += bytes;
        self.page_mut(pid).in_flight += 1;
        self.copies.transfers.insert(
            id,
            InFlight {
                page: pid,
                direction,
                bytes,
                issued_at: now,
            },
        );
        self.copies.out.push_back(Transfer {
            id,
            direction,
            page: pid,
            frame,
            slot,
            bytes,
        });
    }

    pub(super) fn may_issue(&self, direction: Direction, bytes: u64) -> bool {
        let d = dir_index(direction);
        let max = match direction {
            Direction::HostToDevice => self.cfg.h2d_bytes_in_flight_max,
            Direction::DeviceToHost => self.cfg.d2h_bytes_in_flight_max,
        };
        self.copies.in_flight_bytes[d] == 0 || self.copies.in_flight_bytes[d] + bytes <= max
    }

    /// Takes `pid` off the GPU now: a clean page is dropped, a dirty one written back.
    pub(super) fn evict(&mut self, pid: PageId, now: Duration) -> bool {
        let Gpu::Resident { frame, dirty, .. } = self.page(pid).gpu else {
            return false;
        };
        if !dirty {
            self.stats.evictions_clean += 1;
            self.release_frame(pid, frame);
            return true;
        }
        let bytes = self.page_len(self.buffers[&pid.buffer].bytes, pid.index);
        if !self.may_issue(Direction::DeviceToHost, bytes) {
            return false;
        }
        if !matches!(self.page(pid).host, Host::Slot { .. }) {
            // Its slot was released while the remote tier held its bytes; the write-back
            // needs one again.
            let Some(slot) = self.free_slot_now(pid, now) else {
                return false;
            };
            self.page_mut(pid).host = Host::Slot { slot, clean: false };
        }
        self.stats.evictions_dirty += 1;
        self.gpu.evicting_frames += 1;
        self.page_mut(pid).gpu = Gpu::Evicting { frame };
        self.new_transfer(pid, Direction::DeviceToHost, frame, now);
        false
    }

    /// A frame for a load whose page is next used at `bound` (`None`: needed now).
    /// `waiting` counts loads of this pump pass already waiting for a write-back.
    /// Clean victims are dropped at once; a dirty one starts a write-back, and the frame
    /// comes free when it finishes.
    ///
    /// Extents: a buffer's pages go to consecutive frames when they can (the frame after
    /// the previous page's, else the start of a free run or of the victim's own extent),
    /// so that the device can show an acquired buffer as one array at its frames' own
    /// addresses, with no remapping (`Device::acquire_ptr`).
    pub(super) fn frame_for(
        &mut self,
        pid: PageId,
        bound: Option<u64>,
        waiting: &mut u64,
        now: Duration,
    ) -> Got {
        let next_to = self.extent_neighbour(pid);
        let preferred = next_to.or(self.page(pid).last_frame);
        loop {
            // The frame that extends the buffer's extent, or the page's last frame, if it
            // is free; else a free frame (the start of its free run when the page starts
            // an extent).
            if let Some(p) = preferred
                && self.gpu.frames[p.0 as usize].is_none()
                && let Some(i) = self.gpu.free_frames.iter().rposition(|&f| f == p)
            {
                return Got::Frame(self.gpu.free_frames.swap_remove(i));
            }
            if let Some(mut f) = self.gpu.free_frames.pop() {
                if next_to.is_none() {
                    let start = self.free_run_start(f);
                    if start != f
                        && let Some(i) = self.gpu.free_frames.iter().rposition(|&x| x == start)
                    {
                        self.gpu.free_frames[i] = f;
                        f = start;
                    }
                }
                return Got::Frame(f);
            }
            if self.gpu.evicting_frames > *waiting {
                *waiting += 1;
                return Got::Later;
            }
            let Some(mut victim) = self.policy_victim(bound, preferred) else {
                return Got::Never;
            };
            if Some(victim) != preferred {
                victim = self.victim_extent_start(victim);
            }
            let pid = self.gpu.frames[victim.0 as usize].expect("eligible frames hold a page");
            if !self.evict(pid, now) && !matches!(self.page(pid).gpu, Gpu::Evicting { .. }) {
                // Dirty, and the write-back bound is reached or no slot can take it now:
                // a clean page may leave instead; else try again after a completion.
                match self.evictable_victim(bound) {
                    Some(other) => {
                        if !self.evict(other, now)
                            && !matches!(self.page(other).gpu, Gpu::Evicting { .. })
                        {
                            return Got::Never;
                        }
                    }
                    None => return Got::Never,
                }
            }
        }
    }

    /// The frame that would continue `pid`'s buffer's extent: the one after the previous
    /// page's frame, else the one before the next page's (when that page is on the GPU).
    fn extent_neighbour(&self, pid: PageId) -> Option<FrameId> {
        let pages = &self.buffers[&pid.buffer].pages;
        let i = pid.index as usize;
        let on_gpu = |p: &Page| match p.gpu {
            Gpu::Loading { frame, .. } | Gpu::Resident { frame, .. } => Some(frame.0),
            Gpu::Absent | Gpu::Evicting { .. } => None,
        };
        let n = self.gpu.frames.len() as u32;
        let after = i
            .checked_sub(1)
            .and_then(|j| on_gpu(&pages[j]))
            .and_then(|f| f.checked_add(1))
            .filter(|&f| f < n);
        let before = || {
            pages
                .get(i + 1)
                .and_then(on_gpu)
                .and_then(|f| f.checked_sub(1))
        };
        after.or_else(before).map(FrameId)
    }

    /// The first frame of the free run that `frame` (free) lies in. Bounded by the run.
    fn free_run_start(&self, frame: FrameId) -> FrameId {
        let mut f = frame.0;
        while f > 0 && self.gpu.frames[f as usize - 1].is_none() {
            f -= 1;
        }
        FrameId(f)
    }

    /// The first frame of the victim's own extent: walks back while the frame before
    /// holds the previous page of the same buffer, evictable and next used at the same
    /// access (equally good by any policy's measure), so the incoming buffer takes the
    /// extent from its start. Bounded by the buffer's page count.
    fn victim_extent_start(&self, victim: FrameId) -> FrameId {
        let evictable = |f: u32| {
            self.gpu.frames[f as usize].filter(|p| {
                let page = self.page(*p);
                matches!(page.gpu, Gpu::Resident { .. }) && page.pins == 0 && page.host_pins == 0
            })
        };
        let Some(mut holder) = evictable(victim.0) else {
            return victim;
        };
        let next_use = self.gpu.frame_next_use[victim.0 as usize];
        let mut f = victim.0;
        while f > 0 && holder.index > 0 {
            match evictable(f - 1) {
                Some(p)
                    if p.buffer == holder.buffer
                        && p.index + 1 == holder.index
                        && self.gpu.frame_next_use[f as usize - 1] == next_use =>
                {
                    holder = p;
                    f -= 1;
                }
                _ => break,
            }
        }
        FrameId(f)
    }

    pub(super) fn start_load(
        &mut self,
        pid: PageId,
        frame: FrameId,
        prefetch: bool,
        now: Duration,
    ) {
        debug_assert!(self.gpu.frames[frame.0 as usize].is_none());
        self.gpu.frames[frame.0 as usize] = Some(pid);
        self.gpu.frame_next_use[frame.0 as usize] = self.access.next_use.get(&pid.buffer).copied();
        self.page_mut(pid).gpu = Gpu::Loading { frame, prefetch };
        if prefetch {
            self.stats.prefetch_loads += 1;
        } else {
            self.stats.demand_loads += 1;
        }
        self.copies
            .mappings
            .push_back(MappingChange::Map { page: pid, frame });
        self.new_transfer(pid, Direction::HostToDevice, frame, now);
        let used = (self.gpu.frames.len() - self.gpu.free_frames.len()) as u64;
        self.stats.frames_in_use_peak = self.stats.frames_in_use_peak.max(used);
    }

    /// Whether `pid` still needs a load: its buffer is live, it is absent, and the host
    /// is not touching it.
    pub(super) fn needs_load(&self, pid: PageId) -> bool {
        match self.buffers.get(&pid.buffer) {
            Some(b) if !b.freed => {
                let p = &b.pages[pid.index as usize];
                p.gpu == Gpu::Absent && p.host_pins == 0 && matches!(p.host, Host::Slot { .. })
            }
            _ => false,
        }
    }

    /// Next predicted use of `pid`'s buffer (`None`: none predicted).
    pub(super) fn next_use_of(&self, buffer: BufferId) -> Option<u64> {
        self.access
            .next_use
            .get(&buffer)
            .copied()
            .filter(|&n| n > self.access.accesses)
    }

    /// The eviction policy's victim among the GPU frames (see [`VictimView`]).
    pub(super) fn policy_victim(
        &mut self,
        bound: Option<u64>,
        preferred: Option<FrameId>,
    ) -> Option<FrameId> {
        self.eviction.choose_victim(&View::of(
            &self.gpu,
            &self.buffers,
            &self.access,
            bound,
            preferred,
        ))
    }
}

/// What the eviction policy sees of the core: the rooms it reads, not the policy, so the
/// policy can be borrowed mutably beside them.
struct View<'a> {
    gpu: &'a GpuFrames,
    buffers: &'a HashMap<BufferId, Buffer>,
    accesses: u64,
    bound: Option<u64>,
    preferred: Option<FrameId>,
}

impl<'a> View<'a> {
    /// What the eviction policy sees of `core` (the rooms it reads, not the policy, so
    /// the policy can be borrowed mutably beside it).
    fn of(
        gpu: &'a GpuFrames,
        buffers: &'a HashMap<BufferId, Buffer>,
        access: &Access,
        bound: Option<u64>,
        preferred: Option<FrameId>,
    ) -> Self {
        View {
            gpu,
            buffers,
            accesses: access.accesses,
            bound,
            preferred,
        }
    }
}

impl VictimView for View<'_> {
    fn frame_count(&self) -> u32 {
        self.gpu.frames.len() as u32
    }

    fn eligible(&self, frame: FrameId) -> bool {
        let Some(pid) = self.gpu.frames[frame.0 as usize] else {
            return false;
        };
        let page = &self.buffers[&pid.buffer].pages[pid.index as usize];
        matches!(page.gpu, Gpu::Resident { .. }) && page.pins == 0 && page.host_pins == 0
    }

    fn next_use(&self, frame: FrameId) -> Option<u64> {
        self.gpu.frame_next_use[frame.0 as usize].filter(|&n| n > self.accesses)
    }

    fn must_exceed(&self) -> Option<u64> {
        self.bound
    }

    fn preferred(&self) -> Option<FrameId> {
        self.preferred
    }
}
