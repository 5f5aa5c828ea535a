//! Bandwidth estimates: [`Bandwidth`] per copy direction (service time of each copy),
//! [`Throughput`] for the remote tier, whose ops overlap (bytes over busy time).

use std::time::Duration;

/// Weight of the newest sample in a bandwidth estimate.
const BANDWIDTH_ALPHA: f64 = 0.2;
/// The least an estimate may be, bytes/s: 1 MB/s. A first guess of 0 (a device with no
/// hint) would make every planned copy look infinitely long.
pub const BANDWIDTH_MIN_BYTES_PER_S: f64 = 1e6;
/// The remote tier's bandwidth before the tier gives a hint or an op is measured: 1 GB/s,
/// what loopback QUIC moves on a small machine (bench/RESULTS.md).
pub const REMOTE_BANDWIDTH_GUESS_BYTES_PER_S: f64 = 1e9;

/// Bandwidth of one copy direction (one copy at a time per engine): an exponential
/// average of bytes over each copy's service time.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bandwidth {
    bytes_per_s: f64,
    last_done: Duration,
}

impl Bandwidth {
    /// An estimate starting at `bytes_per_s` (at least [`BANDWIDTH_MIN_BYTES_PER_S`]).
    pub(super) fn new(bytes_per_s: f64) -> Bandwidth {
        Bandwidth {
            bytes_per_s: bytes_per_s.max(BANDWIDTH_MIN_BYTES_PER_S),
            last_done: Duration::ZERO,
        }
    }

    /// The estimate, bytes/s.
    pub(super) fn bytes_per_s(&self) -> f64 {
        self.bytes_per_s
    }

    /// Replaces the estimate with a first guess (at least [`BANDWIDTH_MIN_BYTES_PER_S`]).
    pub(super) fn set_hint(&mut self, bytes_per_s: f64) {
        self.bytes_per_s = bytes_per_s.max(BANDWIDTH_MIN_BYTES_PER_S);
    }

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
    bytes_per_s: f64,
    window_bytes: u64,
    window_busy: Duration,
    last_event: Duration,
    in_flight: u64,
}

impl Throughput {
    /// Busy time per sample: long enough to hold several 2 MiB pages at 1 GB/s.
    const WINDOW: Duration = Duration::from_millis(20);

    /// An estimate starting at `bytes_per_s` (at least [`BANDWIDTH_MIN_BYTES_PER_S`]).
    pub(super) fn new(bytes_per_s: f64) -> Throughput {
        Throughput {
            bytes_per_s: bytes_per_s.max(BANDWIDTH_MIN_BYTES_PER_S),
            window_bytes: 0,
            window_busy: Duration::ZERO,
            last_event: Duration::ZERO,
            in_flight: 0,
        }
    }

    /// The estimate, bytes/s.
    pub(super) fn bytes_per_s(&self) -> f64 {
        self.bytes_per_s
    }

    /// Replaces the estimate with a first guess (at least [`BANDWIDTH_MIN_BYTES_PER_S`]).
    pub(super) fn set_hint(&mut self, bytes_per_s: f64) {
        self.bytes_per_s = bytes_per_s.max(BANDWIDTH_MIN_BYTES_PER_S);
    }

    fn advance(&mut self, now: Duration) {
        if self.in_flight > 0 {
            self.window_busy += now.saturating_sub(self.last_event);
        }
        self.last_event = self.last_event.max(now);
    }

    /// An op started at `now`.
    pub(super) fn on_issue(&mut self, now: Duration) {
        self.advance(now);
        self.in_flight += 1;
    }

    /// An op that moved `bytes` (0 if it failed) finished at `now`.
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

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn bandwidth_moves_a_fifth_toward_each_sample_and_never_below_the_floor() {
        let mut b = Bandwidth::new(0.0);
        assert_eq!(b.bytes_per_s(), BANDWIDTH_MIN_BYTES_PER_S);
        b.set_hint(1e9);
        // 1 MB in 1 ms: a 1 GB/s sample leaves the estimate where it is.
        b.on_done(Duration::ZERO, MS, 1_000_000);
        assert!((b.bytes_per_s() - 1e9).abs() < 1.0);
        // The next copy was issued before the last finished: its service time starts then.
        b.on_done(Duration::ZERO, 2 * MS, 3_000_000);
        assert!((b.bytes_per_s() - (1e9 + 0.2 * (3e9 - 1e9))).abs() < 1.0);
    }

    #[test]
    fn throughput_samples_busy_time_only() {
        let mut t = Throughput::new(1e9);
        t.on_issue(Duration::ZERO);
        t.on_issue(Duration::ZERO);
        t.on_done(10 * MS, 5_000_000);
        assert_eq!(
            t.bytes_per_s(),
            1e9,
            "no sample before a window of busy time"
        );
        // Idle from 10 to 100 ms: not counted.
        t.on_done(10 * MS, 5_000_000);
        t.on_issue(100 * MS);
        t.on_done(110 * MS, 15_000_000);
        // 25 MB over 20 ms of busy time: a 1.25 GB/s sample, a fifth of the way.
        assert!((t.bytes_per_s() - 1.05e9).abs() < 1.0);
    }
}
