//! The remote tier in the core: fetching pages into host slots, spilling them out (with
//! backoff after refusals), choosing host-tier victims (furthest next use first, least
//! recently used without a prediction) and the slots for demand and staging, and the
//! completions of remote ops.

use super::*;

impl PoolCore {
    /// Records that remote op `id` finished (`Err` with the tier's message if it failed).
    /// A failed fetch loses the page's buffer (its acquires and host accesses fail with
    /// [`CoreError::FetchFailed`]; other buffers go on); a failed spill leaves the page in
    /// its slot and backs spills off. Both count in [`CoreStats::remote_errors`].
    pub fn handle_remote_done(
        &mut self,
        id: TransferId,
        result: Result<(), String>,
        now: Duration,
    ) {
        let Some(op) = self.remote.remote_ops.remove(&id) else {
            debug_assert!(false, "completion of unknown remote op {id:?}");
            return;
        };
        let d = usize::from(op.kind == RemoteKind::Spill);
        self.remote.remote_in_flight_bytes[d] -= op.bytes;
        if op.kind != RemoteKind::Zero {
            let bytes = if result.is_ok() { op.bytes } else { 0 };
            self.remote.remote_bw.on_done(now, bytes);
        }
        let pid = op.page;
        self.page_mut(pid).in_flight -= 1;
        let (freed, wanted) = {
            let b = &self.buffers[&pid.buffer];
            let p = &b.pages[pid.index as usize];
            (
                b.freed,
                p.pins > 0 || p.host_pins > 0 || self.remote.host_demand.contains(&pid),
            )
        };
        let host = self.page(pid).host;
        match (op.kind, host, result) {
            (RemoteKind::Fetch | RemoteKind::Zero, Host::Fetching { slot }, Ok(())) => {
                if op.kind == RemoteKind::Fetch {
                    self.stats.remote_bytes_in += op.bytes;
                }
                self.page_mut(pid).host = Host::Slot {
                    slot,
                    clean: op.kind == RemoteKind::Fetch,
                };
            }
            (RemoteKind::Fetch | RemoteKind::Zero, Host::Fetching { slot }, Err(e)) => {
                // The page's bytes cannot be had: its buffer is lost (its acquires and host
                // accesses fail with the cause), not the pool. The slot's garbage is marked
                // clean so that it leaves without being spilled over the remote copy.
                self.stats.remote_errors += 1;
                self.page_mut(pid).host = Host::Slot { slot, clean: true };
                let b = self
                    .buffers
                    .get_mut(&pid.buffer)
                    .expect("pages in flight keep their buffer");
                b.lost.get_or_insert(CoreError::FetchFailed {
                    page: pid,
                    reason: e,
                });
                self.access.demand.retain(|p| p.buffer != pid.buffer);
                self.remote.host_demand.retain(|p| p.buffer != pid.buffer);
            }
            (RemoteKind::Spill, Host::Spilling { slot }, Ok(())) => {
                self.remote.spilling -= 1;
                self.remote.spill_retry.on_success();
                self.stats.remote_bytes_out += op.bytes;
                if wanted || freed {
                    self.page_mut(pid).host = Host::Slot { slot, clean: true };
                } else {
                    self.page_mut(pid).host = Host::Remote;
                    self.host.free_slots.push(slot);
                }
            }
            (RemoteKind::Spill, Host::Spilling { slot }, Err(e)) => {
                // The page stays in its slot; spills wait out a backoff, and fail the pool
                // once they have failed for `SPILL_DEADLINE` without one success.
                self.remote.spilling -= 1;
                self.stats.remote_errors += 1;
                self.page_mut(pid).host = Host::Slot { slot, clean: false };
                if let Verdict::GiveUp(failing_for) = self.remote.spill_retry.on_failure(now) {
                    self.failed.get_or_insert(CoreError::SpillsFailing {
                        failing_ms: failing_for.as_millis() as u64,
                        attempts: self.remote.spill_retry.failures(),
                        reason: e,
                    });
                }
            }
            (kind, state, _) => panic!("completion of {kind:?} for {pid} in state {state:?}"),
        }
        self.reap(pid.buffer);
        self.pump(now);
    }

    /// Whether `pid` must come into a slot (from the remote tier, or zero-filled) before
    /// it can be loaded or read: its buffer is live and it has no slot.
    pub(super) fn needs_fetch(&self, pid: PageId) -> bool {
        match self.buffers.get(&pid.buffer) {
            Some(b) if !b.freed => {
                let p = &b.pages[pid.index as usize];
                p.gpu == Gpu::Absent && matches!(p.host, Host::Zero | Host::Remote)
            }
            _ => false,
        }
    }

    pub(super) fn may_issue_remote(&self, kind: RemoteKind, bytes: u64) -> bool {
        let d = usize::from(kind == RemoteKind::Spill);
        self.remote.remote_in_flight_bytes[d] == 0
            || self.remote.remote_in_flight_bytes[d] + bytes <= self.cfg.remote_bytes_in_flight_max
    }

    pub(super) fn new_remote(
        &mut self,
        pid: PageId,
        kind: RemoteKind,
        slot: HostSlot,
        now: Duration,
    ) {
        let bytes = self.page_len(self.buffers[&pid.buffer].bytes, pid.index);
        let id = TransferId(self.ids.next_transfer);
        self.ids.next_transfer += 1;
        self.remote.remote_in_flight_bytes[usize::from(kind == RemoteKind::Spill)] += bytes;
        if kind != RemoteKind::Zero {
            self.remote.remote_bw.on_issue(now);
        }
        self.page_mut(pid).in_flight += 1;
        self.remote.remote_ops.insert(
            id,
            RemoteInFlight {
                page: pid,
                kind,
                bytes,
            },
        );
        self.remote.remote_out.push_back(RemoteTransfer {
            id,
            kind,
            page: pid,
            slot,
            bytes,
        });
    }

    /// Starts bringing `pid` (Zero or Remote) into `slot`.
    pub(super) fn start_fetch(
        &mut self,
        pid: PageId,
        slot: HostSlot,
        prefetch: bool,
        now: Duration,
    ) {
        let kind = match self.page(pid).host {
            Host::Zero => RemoteKind::Zero,
            Host::Remote => {
                if prefetch {
                    self.stats.remote_prefetches += 1;
                } else {
                    self.stats.remote_demand_fetches += 1;
                }
                RemoteKind::Fetch
            }
            other => panic!("fetch of {pid} in host state {other:?}"),
        };
        self.page_mut(pid).host = Host::Fetching { slot };
        self.new_remote(pid, kind, slot, now);
    }

    /// A free slot now: from the free list, or by dropping a clean page; starts a spill
    /// (for later) when only dirty pages could leave.
    pub(super) fn free_slot_now(&mut self, exclude: PageId, now: Duration) -> Option<HostSlot> {
        if let Some(slot) = self.host.free_slots.pop() {
            return Some(slot);
        }
        let victim = self.host_victim(None, exclude)?;
        self.spill(victim, now);
        self.host.free_slots.pop()
    }

    /// Whether `pid` is on the GPU and its slot holds the same bytes as the remote tier:
    /// the slot can go without a copy (the page gets one again if it is written and
    /// evicted).
    pub(super) fn slot_redundant(&self, pid: PageId) -> bool {
        let p = self.page(pid);
        matches!(p.gpu, Gpu::Resident { .. })
            && matches!(p.host, Host::Slot { clean: true, .. })
            && p.remote_space
            && p.host_pins == 0
            && p.in_flight == 0
            && !self.remote.host_demand.contains(&pid)
    }

    /// Whether the page in a slot may leave the host tier now.
    pub(super) fn spillable(&self, pid: PageId) -> bool {
        let p = self.page(pid);
        matches!(p.host, Host::Slot { .. })
            && p.gpu == Gpu::Absent
            && p.pins == 0
            && p.host_pins == 0
            && p.in_flight == 0
            && !self.remote.host_demand.contains(&pid)
    }

    /// The page to take out of the host tier: the furthest next use (or none predicted)
    /// beyond `bound`, then the least recently used; `None` if no page may leave.
    pub(super) fn host_victim(&self, bound: Option<u64>, exclude: PageId) -> Option<PageId> {
        // Only a demand (no bound) takes slots from pages on the GPU: staging with them
        // would trade a page needed later for one needed again when it leaves the GPU.
        self.host_victim_by(bound, exclude, false).or_else(|| {
            bound
                .is_none()
                .then(|| self.host_victim_by(None, exclude, true))
                .flatten()
        })
    }

    /// [`PoolCore::host_victim`] among pages off the GPU (`on_gpu` false), or among pages
    /// on the GPU whose slots are redundant (`on_gpu` true; any next use: the page stays
    /// on the GPU, only its host copy goes).
    pub(super) fn host_victim_by(
        &self,
        bound: Option<u64>,
        exclude: PageId,
        on_gpu: bool,
    ) -> Option<PageId> {
        let mut best: Option<(u64, u64, PageId)> = None;
        for (&bid, b) in &self.buffers {
            if b.freed || b.holders() > 0 {
                continue;
            }
            let next = self.next_use_of(bid).unwrap_or(u64::MAX);
            if bound.is_some_and(|bound| next <= bound) {
                continue;
            }
            // Larger key wins: later next use, then older last access.
            let key = (next, u64::MAX - b.last_access);
            if best.is_some_and(|(n, a, _)| (n, a) >= key) {
                continue;
            }
            for index in (0..b.pages.len() as u32).rev() {
                let pid = PageId { buffer: bid, index };
                let fits = if on_gpu {
                    self.slot_redundant(pid)
                } else {
                    self.spillable(pid)
                };
                if pid != exclude && fits {
                    best = Some((key.0, key.1, pid));
                    break;
                }
            }
        }
        best.map(|(_, _, pid)| pid)
    }

    /// Remote space for a spill of `pid`: its own, a free one, or one taken back from a
    /// page in a slot (whose remote copy is then dropped). False if none can be had.
    pub(super) fn remote_space_for(&mut self, pid: PageId) -> bool {
        if self.page(pid).remote_space {
            return true;
        }
        if self.remote.remote_pages < self.remote.remote_pages_max {
            self.remote.remote_pages += 1;
            self.page_mut(pid).remote_space = true;
            return true;
        }
        let donor = self.buffers.iter().find_map(|(&bid, b)| {
            b.pages.iter().enumerate().find_map(|(i, p)| {
                (p.remote_space && matches!(p.host, Host::Slot { .. }) && p.in_flight == 0)
                    .then_some(PageId {
                        buffer: bid,
                        index: i as u32,
                    })
            })
        });
        let Some(donor) = donor else {
            return false;
        };
        let d = self.page_mut(donor);
        d.remote_space = false;
        if let Host::Slot { clean, .. } = &mut d.host {
            *clean = false;
        }
        self.remote.discards.push(donor);
        self.page_mut(pid).remote_space = true;
        true
    }

    /// A slot for a fetch of a page next used at `bound` (`None`: needed now). A clean
    /// victim leaves at once; a dirty one starts a spill and the slot comes free when it
    /// finishes.
    pub(super) fn slot_for(
        &mut self,
        pid: PageId,
        bound: Option<u64>,
        waiting: &mut u64,
        now: Duration,
    ) -> Got {
        loop {
            if let Some(slot) = self.host.free_slots.pop() {
                return Got::Slot(slot);
            }
            if self.remote.spilling > *waiting {
                *waiting += 1;
                return Got::Later;
            }
            let Some(victim) = self.host_victim(bound, pid) else {
                // Every slot is held by a page on the GPU (or one that may not leave).
                // For a demand, take a page off the GPU: its slot can then be had.
                if bound.is_none() && self.evict_for_slot(now) {
                    continue;
                }
                return if self.gpu.evicting_frames > 0 {
                    Got::Later
                } else {
                    Got::Never
                };
            };
            match self.spill(victim, now) {
                Spilled::Freed => {}
                Spilled::Started => {}
                Spilled::Blocked => return Got::Never,
            }
        }
    }

    /// A page on the GPU that can leave now without help (not held, not touched by the
    /// host; clean, or dirty with a slot to be written back to), used furthest ahead and
    /// beyond `bound`.
    pub(super) fn evictable_victim(&self, bound: Option<u64>) -> Option<PageId> {
        let mut best: Option<(u64, PageId)> = None;
        for (f, owner) in self.gpu.frames.iter().enumerate() {
            let Some(pid) = *owner else { continue };
            let p = self.page(pid);
            let can_leave = match p.gpu {
                Gpu::Resident { dirty: false, .. } => true,
                Gpu::Resident { dirty: true, .. } => matches!(p.host, Host::Slot { .. }),
                _ => false,
            };
            if !can_leave || p.pins > 0 || p.host_pins > 0 {
                continue;
            }
            let next = self.gpu.frame_next_use[f]
                .filter(|&n| n > self.access.accesses)
                .unwrap_or(u64::MAX);
            if bound.is_some_and(|b| next <= b) || best.is_some_and(|(n, _)| n >= next) {
                continue;
            }
            best = Some((next, pid));
        }
        best.map(|(_, pid)| pid)
    }

    /// Takes a page off the GPU so that its slot can leave the host tier: the eviction
    /// policy's victim. True if one left at once (it was clean).
    pub(super) fn evict_for_slot(&mut self, now: Duration) -> bool {
        let Some(frame) = self.policy_victim(None, None) else {
            return false;
        };
        let pid = self.gpu.frames[frame.0 as usize].expect("eligible frames hold a page");
        self.evict(pid, now)
    }

    /// Takes `pid` (in a slot, off the GPU) out of the host tier.
    pub(super) fn spill(&mut self, pid: PageId, now: Duration) -> Spilled {
        let Host::Slot { slot, clean } = self.page(pid).host else {
            return Spilled::Blocked;
        };
        let redundant = clean && self.page(pid).remote_space;
        if self.page(pid).gpu != Gpu::Absent && !redundant {
            // A page on the GPU keeps its slot unless the remote tier holds its bytes.
            return Spilled::Blocked;
        }
        if redundant {
            if self.page(pid).gpu == Gpu::Absent {
                self.stats.spills_clean += 1;
            } else {
                self.stats.gpu_page_slots_dropped += 1;
            }
            self.page_mut(pid).host = Host::Remote;
            self.host.free_slots.push(slot);
            return Spilled::Freed;
        }
        let bytes = self.page_len(self.buffers[&pid.buffer].bytes, pid.index);
        if !self.remote.spill_retry.ready(now)
            || !self.may_issue_remote(RemoteKind::Spill, bytes)
            || !self.remote_space_for(pid)
        {
            return Spilled::Blocked;
        }
        self.remote.spilling += 1;
        self.page_mut(pid).host = Host::Spilling { slot };
        self.new_remote(pid, RemoteKind::Spill, slot, now);
        Spilled::Started
    }

    /// Starts bringing pages of pending acquires, host accesses and the staging plan into
    /// slots, as far as slots and the in-flight bound allow.
    pub(super) fn pump_remote(&mut self, now: Duration) {
        let mut waiting = 0u64;
        // Demand: pages of pending acquires and host accesses.
        // A host access's pages stay protected from leaving until it pins them (then
        // `begin_host_access` takes them off the list); pages of freed buffers go.
        let live =
            |core: &PoolCore, p: PageId| core.buffers.get(&p.buffer).is_some_and(|b| !b.freed);
        let host_demand: VecDeque<PageId> = std::mem::take(&mut self.remote.host_demand)
            .into_iter()
            .filter(|&p| live(self, p))
            .collect();
        self.remote.host_demand = host_demand;
        let mut demand: Vec<PageId> = self.access.demand.iter().copied().collect();
        demand.extend(self.remote.host_demand.iter().copied());
        for pid in demand {
            if !self.needs_fetch(pid) || self.page(pid).in_flight > 0 {
                continue;
            }
            if !self.may_issue_remote(RemoteKind::Fetch, self.page_bytes()) {
                return;
            }
            match self.slot_for(pid, None, &mut waiting, now) {
                Got::Slot(slot) => self.start_fetch(pid, slot, false, now),
                Got::Later | Got::Frame(_) => {}
                Got::Never => break,
            }
        }
        // Staging: predicted pages, nearest first.
        let mut i = 0;
        while i < self.remote.remote_plan.len() {
            let (pid, next) = self.remote.remote_plan[i];
            if !self.needs_fetch(pid) || self.page(pid).in_flight > 0 {
                self.remote.remote_plan.remove(i);
                continue;
            }
            if !self.may_issue_remote(RemoteKind::Fetch, self.page_bytes()) {
                return;
            }
            match self.slot_for(pid, Some(next), &mut waiting, now) {
                Got::Slot(slot) => {
                    self.remote.remote_plan.remove(i);
                    self.start_fetch(pid, slot, true, now);
                }
                Got::Later | Got::Frame(_) => i += 1,
                Got::Never => return,
            }
        }
        self.spill_ahead(now);
    }

    /// Under the learned policy, keeps a quarter of the slots not holding GPU pages free
    /// (or coming free), by spilling pages whose next use is beyond everything planned,
    /// so that staging finds slots without waiting for a spill's round trip.
    pub(super) fn spill_ahead(&mut self, now: Duration) {
        if self.cfg.policy != Policy::Learned {
            return;
        }
        let room = self
            .cfg
            .host_slots()
            .saturating_sub(self.gpu.frames.len() as u64);
        let target = (room / 4).max(1);
        // Pages within the staging horizon of the last plan (staged or not) stay.
        let bound = self
            .remote
            .remote_horizon
            .max(self.access.plan.iter().map(|&(_, n)| n).max().unwrap_or(0))
            .max(self.access.accesses + MIN_LOOKAHEAD_ACCESSES);
        let nobody = PageId {
            buffer: BufferId(0),
            index: 0,
        };
        while (self.host.free_slots.len() as u64 + self.remote.spilling) < target {
            let Some(victim) = self.host_victim(Some(bound), nobody) else {
                break;
            };
            if matches!(self.spill(victim, now), Spilled::Blocked) {
                break;
            }
        }
    }
}
