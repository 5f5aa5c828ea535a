//! Planning: [`PoolCore::pump`] starts every copy the state allows (demand first, then the
//! plan); [`PoolCore::replan`] turns the predictor's upcoming accesses into the plans of
//! both tiers, within the lookahead horizon (see the module docs of [`super`]).

use super::*;

impl PoolCore {
    /// Starts every copy that the current state allows: demand loads, then prefetches.
    pub(super) fn pump(&mut self, now: Duration) {
        if self.failed.is_some() {
            return;
        }
        if self.has_remote() {
            self.pump_remote(now);
        }
        let mut waiting = 0u64;
        let mut i = 0;
        while i < self.access.demand.len() {
            let pid = self.access.demand[i];
            let wanted = self
                .buffers
                .get(&pid.buffer)
                .is_some_and(|b| !b.freed && b.pages[pid.index as usize].pins > 0);
            if wanted && self.page(pid).host_pins > 0 {
                // The host is reading or writing it: retried when that ends.
                i += 1;
                continue;
            }
            if wanted
                && self.page(pid).gpu == Gpu::Absent
                && !matches!(self.page(pid).host, Host::Slot { .. })
            {
                // Not in a slot yet: a fetch is queued or in flight (pump_remote).
                i += 1;
                continue;
            }
            if !wanted || !self.needs_load(pid) {
                // Loaded, loading, being written back (it will be kept), or not wanted.
                self.access.demand.remove(i);
                continue;
            }
            if !self.may_issue(Direction::HostToDevice, self.page_bytes()) {
                return;
            }
            match self.frame_for(pid, None, &mut waiting, now) {
                Got::Frame(frame) if !self.needs_load(pid) => {
                    // Making room sent the page itself out of its slot: load it later.
                    self.gpu.free_frames.push(frame);
                    i += 1;
                }
                Got::Frame(frame) => {
                    self.access.demand.remove(i);
                    self.start_load(pid, frame, false, now);
                }
                Got::Later => i += 1,
                Got::Never => return,
                Got::Slot(_) => unreachable!("frame_for returns frames"),
            }
        }
        let mut i = 0;
        while i < self.access.plan.len() {
            let (pid, next) = self.access.plan[i];
            if !self.needs_load(pid) {
                if self.needs_fetch(pid)
                    || self.buffers.get(&pid.buffer).is_some_and(|b| {
                        !b.freed
                            && matches!(
                                b.pages[pid.index as usize].host,
                                Host::Fetching { .. } | Host::Spilling { .. }
                            )
                    })
                {
                    // Being staged from the remote tier: loaded once it is in a slot. Pages
                    // after it wait too, or they would take frames it then has to evict.
                    return;
                } else {
                    self.access.plan.remove(i);
                }
                continue;
            }
            if !self.may_issue(Direction::HostToDevice, self.page_bytes()) {
                return;
            }
            match self.frame_for(pid, Some(next), &mut waiting, now) {
                Got::Frame(frame) if !self.needs_load(pid) => {
                    // Making room sent the page itself out of its slot: load it later.
                    self.gpu.free_frames.push(frame);
                    i += 1;
                }
                Got::Frame(frame) => {
                    self.access.plan.remove(i);
                    self.start_load(pid, frame, true, now);
                }
                Got::Later => i += 1,
                Got::Never => return,
                Got::Slot(_) => unreachable!("frame_for returns frames"),
            }
        }
    }

    /// Recomputes next uses and the prefetch plan from the predictor.
    pub(super) fn replan(&mut self) {
        self.access.plan.clear();
        self.access.next_use.clear();
        let upcoming = self
            .access
            .predictor
            .upcoming(self.cfg.lookahead_accesses_max);
        for u in &upcoming {
            self.access
                .next_use
                .insert(u.buffer, self.access.accesses + 1 + u.distance);
        }
        for (f, owner) in self.gpu.frames.iter().enumerate() {
            self.gpu.frame_next_use[f] =
                owner.and_then(|p| self.access.next_use.get(&p.buffer).copied());
        }
        let bw = self.copies.bandwidth[0].bytes_per_s;
        let mut queued_bytes = 0u64;
        for u in &upcoming {
            if u.distance >= MIN_LOOKAHEAD_ACCESSES
                && u.time_until.as_secs_f64()
                    > LEAD_FACTOR * queued_bytes as f64 / bw + JITTER_MARGIN.as_secs_f64()
            {
                break;
            }
            let Some(b) = self.buffers.get(&u.buffer).filter(|b| !b.freed) else {
                continue;
            };
            let next = self.access.accesses + 1 + u.distance;
            for (index, p) in b.pages.iter().enumerate() {
                match p.gpu {
                    Gpu::Absent => {
                        self.access.plan.push_back((
                            PageId {
                                buffer: u.buffer,
                                index: index as u32,
                            },
                            next,
                        ));
                        queued_bytes += self.page_len(b.bytes, index as u32);
                    }
                    Gpu::Loading { .. } => queued_bytes += self.page_len(b.bytes, index as u32),
                    _ => {}
                }
            }
        }
        self.remote.remote_plan.clear();
        if !self.has_remote() {
            return;
        }
        // Staging remote→host: the same horizon rule, at the remote tier's bandwidth and
        // REMOTE_LEAD_FACTOR.
        let rbw = self.remote.remote_bw.bytes_per_s;
        let mut queued_bytes = 0u64;
        self.remote.remote_horizon = self.access.accesses;
        for u in &upcoming {
            if u.distance >= MIN_LOOKAHEAD_ACCESSES
                && u.time_until.as_secs_f64()
                    > REMOTE_LEAD_FACTOR * queued_bytes as f64 / rbw + JITTER_MARGIN.as_secs_f64()
            {
                break;
            }
            let Some(b) = self.buffers.get(&u.buffer).filter(|b| !b.freed) else {
                continue;
            };
            let next = self.access.accesses + 1 + u.distance;
            self.remote.remote_horizon = self.remote.remote_horizon.max(next);
            for (index, p) in b.pages.iter().enumerate() {
                let len = self.page_len(b.bytes, index as u32);
                match p.host {
                    Host::Zero | Host::Remote if p.gpu == Gpu::Absent => {
                        self.remote.remote_plan.push_back((
                            PageId {
                                buffer: u.buffer,
                                index: index as u32,
                            },
                            next,
                        ));
                        queued_bytes += len;
                    }
                    Host::Fetching { .. } => queued_bytes += len,
                    _ => {}
                }
            }
        }
    }
}
