//! Bandwidth estimates: [`Bandwidth`] per copy direction (service time of each copy),
//! [`Throughput`] for the remote tier, whose ops overlap (bytes over busy time).

use std::time::Duration;

use super::BANDWIDTH_ALPHA;

/// Bandwidth of one copy direction (one copy at a time per engine): an exponential
/// average of bytes over each copy's service time.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bandwidth {
    pub(super) bytes_per_s: f64,
    pub(super) last_done: Duration,
}

impl Bandwidth {
    /// A copy of `bytes` issued at `issued_at` finished at `now`: its service time runs
    /// from when it was issued or the previous copy of the engine finished, whichever is
    /// later (copies of one direction run one after another).
    pub(super) fn on_done(&mut self, issued_at: Duration, now: Duration, bytes: u64) {
        let service = now
            .saturating_sub(issued_at.max(self.last_done))
            .as_secs_f64();
        if service > 0.0 {
            self.bytes_per_s += BANDWIDTH_ALPHA * (bytes as f64 / service - self.bytes_per_s);
        }
        self.last_done = now;
    }
}

/// Throughput of a tier whose ops run many at once (the network): bytes completed over
/// the time at least one op was in flight, sampled every [`Throughput::WINDOW`] of busy
/// time. Per-op service times would overestimate it, since completions arrive in bursts.
#[derive(Debug, Clone, Copy)]
pub(super) struct Throughput {
    pub(super) bytes_per_s: f64,
    pub(super) window_bytes: u64,
    pub(super) window_busy: Duration,
    pub(super) last_event: Duration,
    pub(super) in_flight: u64,
}

impl Throughput {
    /// Busy time per sample: long enough to hold several 2 MiB pages at 1 GB/s.
    const WINDOW: Duration = Duration::from_millis(20);

    pub(super) fn new(bytes_per_s: f64) -> Throughput {
        Throughput {
            bytes_per_s,
            window_bytes: 0,
            window_busy: Duration::ZERO,
            last_event: Duration::ZERO,
            in_flight: 0,
        }
    }

    pub(super) fn advance(&mut self, now: Duration) {
        if self.in_flight > 0 {
            self.window_busy += now.saturating_sub(self.last_event);
        }
        self.last_event = self.last_event.max(now);
    }

    pub(super) fn on_issue(&mut self, now: Duration) {
        self.advance(now);
        self.in_flight += 1;
    }

    pub(super) fn on_done(&mut self, now: Duration, bytes: u64) {
        self.advance(now);
        self.in_flight = self.in_flight.saturating_sub(1);
        self.window_bytes += bytes;
        if self.window_busy >= Self::WINDOW {
            let sample = self.window_bytes as f64 / self.window_busy.as_secs_f64();
            self.bytes_per_s += BANDWIDTH_ALPHA * (sample - self.bytes_per_s);
            self.window_bytes = 0;
            self.window_busy = Duration::ZERO;
        }
    }
}
