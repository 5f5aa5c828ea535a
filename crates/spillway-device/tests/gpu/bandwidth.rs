//! The copy benchmark of the GPU suite: the submit path ([`CudaDevice::submit`] and its
//! lanes) against raw pinned copies, per page size and stream count; prints a table and
//! writes `gpu_copy_bandwidth.json` when `SPILLWAY_BENCH_OUT` names a directory.

use std::sync::Condvar;

use spillway_device::cuda::{
    RawCopyBandwidth, RawCopyOptions, raw_pinned_bandwidth, raw_pinned_bandwidth_with,
};
use spillway_types::limits::H2D_BYTES_IN_FLIGHT_DEFAULT;

use super::*;

/// Counts completions per direction; the benchmark's sink.
struct Counter {
    done: Mutex<[u64; 2]>,
    errors: Mutex<u64>,
    changed: Condvar,
}

const D2H_BIT: u64 = 1 << 63;

impl Counter {
    fn wait_until(&self, lane: usize, at_least: u64) {
        let mut done = self.done.lock().unwrap();
        while done[lane] < at_least {
            let (g, timeout) = self.changed.wait_timeout(done, COMPLETION_TIMEOUT).unwrap();
            assert!(!timeout.timed_out(), "no completion within the timeout");
            done = g;
        }
    }
}

/// Submits `count` copies of `page` in one direction, at most `window` in flight, and
/// waits for the last; returns the seconds taken.
fn stream_copies(
    d: &CudaDevice,
    counter: &Counter,
    direction: Direction,
    frames: u32,
    count: u64,
    window: u64,
) -> f64 {
    let lane = usize::from(direction == Direction::DeviceToHost);
    let base = counter.done.lock().unwrap()[lane];
    let page = d.config().page_bytes;
    let start = Instant::now();
    for k in 0..count {
        if k >= window {
            counter.wait_until(lane, base + k - window + 1);
        }
        let f = (k % u64::from(frames)) as u32;
        // H2D uses slots 0..frames, D2H slots frames..2*frames: no slot is shared.
        let (slot, id) = if direction.into_frame() {
            (f, k)
        } else {
            (frames + f, k | D2H_BIT)
        };
        d.submit(copy(id, direction, f, slot, page));
    }
    counter.wait_until(lane, base + count);
    start.elapsed().as_secs_f64()
}

#[derive(Debug, Clone, Copy)]
struct LaneRates {
    h2d: f64,
    d2h: f64,
    both: f64,
}

fn gbps(bytes_per_s: f64) -> f64 {
    bytes_per_s / 1e9
}

/// One submit-path measurement: best of three runs of 4 GiB per direction.
struct SubmitRow {
    page: u64,
    streams: usize,
    window: u64,
    rates: LaneRates,
    latency_us: f64,
}

fn measure_submit(page: u64, streams: usize, window_bytes: u64) -> SubmitRow {
    let region_bytes = 1024 * MIB;
    let per_direction_bytes = 4096 * MIB;
    let frames = (region_bytes / page) as u32;
    let counter = Arc::new(Counter {
        done: Mutex::new([0; 2]),
        errors: Mutex::new(0),
        changed: Condvar::new(),
    });
    let c2 = counter.clone();
    let sink: CompletionSink = Arc::new(move |c: Completion| {
        let lane = usize::from(c.id.0 & D2H_BIT != 0);
        if c.result.is_err() {
            *c2.errors.lock().unwrap() += 1;
        }
        c2.done.lock().unwrap()[lane] += 1;
        c2.changed.notify_all();
    });
    let config = DeviceConfig {
        frames,
        host_slots: 2 * frames,
        page_bytes: page,
    };
    let d = CudaDevice::with_streams(config, sink, 0, streams).unwrap();
    let count = per_direction_bytes / page;
    let window = (window_bytes / page).max(2);
    // Warm-up both lanes (event pool, first-touch paths).
    stream_copies(
        &d,
        &counter,
        Direction::HostToDevice,
        frames,
        window * 2,
        window,
    );
    stream_copies(
        &d,
        &counter,
        Direction::DeviceToHost,
        frames,
        window * 2,
        window,
    );
    let mut best = LaneRates {
        h2d: 0.0,
        d2h: 0.0,
        both: 0.0,
    };
    let bytes = (count * page) as f64;
    for _ in 0..3 {
        let t = stream_copies(&d, &counter, Direction::HostToDevice, frames, count, window);
        best.h2d = best.h2d.max(bytes / t);
        let t = stream_copies(&d, &counter, Direction::DeviceToHost, frames, count, window);
        best.d2h = best.d2h.max(bytes / t);
        let start = Instant::now();
        std::thread::scope(|s| {
            let (d, c) = (&d, &*counter);
            s.spawn(move || stream_copies(d, c, Direction::HostToDevice, frames, count, window));
            s.spawn(move || stream_copies(d, c, Direction::DeviceToHost, frames, count, window));
        });
        best.both = best.both.max(2.0 * bytes / start.elapsed().as_secs_f64());
    }
    // Latency of one copy on an idle lane (submit to completion), median of 21.
    let mut lat: Vec<f64> = (0..21)
        .map(|_| stream_copies(&d, &counter, Direction::HostToDevice, frames, 1, 1) * 1e6)
        .collect();
    lat.sort_by(f64::total_cmp);
    assert_eq!(*counter.errors.lock().unwrap(), 0, "no copy failed");
    SubmitRow {
        page,
        streams,
        window,
        rates: best,
        latency_us: lat[10],
    }
}

/// Best of three raw measurements.
fn raw_best(block: u64, blocks: u32) -> RawCopyBandwidth {
    let mut raw = raw_pinned_bandwidth(0, block, blocks).unwrap();
    for _ in 0..2 {
        let r = raw_pinned_bandwidth(0, block, blocks).unwrap();
        raw.h2d_bytes_per_s = raw.h2d_bytes_per_s.max(r.h2d_bytes_per_s);
        raw.d2h_bytes_per_s = raw.d2h_bytes_per_s.max(r.d2h_bytes_per_s);
        raw.both_bytes_per_s = raw.both_bytes_per_s.max(r.both_bytes_per_s);
    }
    raw
}

#[test]
fn copy_bandwidth_of_submit_against_raw_pinned() {
    let Some(_gpu) = gpu("bandwidth") else {
        return;
    };
    let name = cuda_available().unwrap();
    // The ceiling: large blocks. Page-sized raw blocks (no events, all enqueued at once)
    // show how much of any gap is the copy size itself.
    let raw = raw_best(256 * MIB, 16);
    let raw_pages: Vec<RawCopyBandwidth> = [2 * MIB, 8 * MIB]
        .into_iter()
        .map(|b| raw_best(b, (4096 * MIB / b) as u32))
        .collect();
    let mut rows = Vec::new();
    for page in [2 * MIB, 8 * MIB] {
        for streams in [1, 2] {
            rows.push(measure_submit(page, streams, H2D_BYTES_IN_FLIGHT_DEFAULT));
        }
    }
    // Where the 2 MiB gap comes from: copies walking 1 GiB (as the lanes do) with and
    // without an event per copy, and the lanes with 4x the bytes in flight.
    let diag_raw: Vec<(&str, RawCopyBandwidth)> = [false, true]
        .into_iter()
        .map(|event_per_copy| {
            let label = if event_per_copy {
                "raw 2 MiB over 1 GiB, event per copy"
            } else {
                "raw 2 MiB over 1 GiB"
            };
            let options = RawCopyOptions {
                block_bytes: 2 * MIB,
                blocks: 2048,
                region_bytes: 1024 * MIB,
                event_per_copy,
            };
            (label, raw_pinned_bandwidth_with(0, options).unwrap())
        })
        .collect();
    let diag_window = measure_submit(2 * MIB, STREAMS_PER_DIRECTION_DEFAULT, 256 * MIB);

    println!();
    println!(
        "copy bandwidth on {name} (GB/s = 1e9 B/s; best of 3 runs of 4 GiB per direction; \
         submit() keeps {} MiB in flight per direction; default streams per direction: {})",
        H2D_BYTES_IN_FLIGHT_DEFAULT / MIB,
        STREAMS_PER_DIRECTION_DEFAULT
    );
    println!(
        "| path | page/block | streams/dir | H2D GB/s | D2H GB/s | both at once GB/s (sum) | H2D / raw | D2H / raw | both / raw | 1-copy latency us |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in std::iter::once(&raw).chain(&raw_pages) {
        println!(
            "| raw cuMemcpyAsync, pinned | {} MiB | 1 | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | - |",
            r.block_bytes / MIB,
            gbps(r.h2d_bytes_per_s),
            gbps(r.d2h_bytes_per_s),
            gbps(r.both_bytes_per_s),
            r.h2d_bytes_per_s / raw.h2d_bytes_per_s,
            r.d2h_bytes_per_s / raw.d2h_bytes_per_s,
            r.both_bytes_per_s / raw.both_bytes_per_s,
        );
    }
    println!("diagnostics, 2 MiB copies (one run each):");
    for (label, r) in &diag_raw {
        println!(
            "| {label} | {:.1} | {:.1} | {:.1} |",
            gbps(r.h2d_bytes_per_s),
            gbps(r.d2h_bytes_per_s),
            gbps(r.both_bytes_per_s)
        );
    }
    println!(
        "| submit(), 256 MiB in flight | {:.1} | {:.1} | {:.1} |",
        gbps(diag_window.rates.h2d),
        gbps(diag_window.rates.d2h),
        gbps(diag_window.rates.both)
    );
    let mut json_rows = Vec::new();
    let mut misses = Vec::new();
    for row in &rows {
        let r = row.rates;
        let (rh, rd, rb) = (
            r.h2d / raw.h2d_bytes_per_s,
            r.d2h / raw.d2h_bytes_per_s,
            r.both / raw.both_bytes_per_s,
        );
        println!(
            "| submit() | {} MiB | {} | {:.1} | {:.1} | {:.1} | {rh:.2} | {rd:.2} | {rb:.2} | {:.0} |",
            row.page / MIB,
            row.streams,
            gbps(r.h2d),
            gbps(r.d2h),
            gbps(r.both),
            row.latency_us,
        );
        if row.streams == STREAMS_PER_DIRECTION_DEFAULT {
            if rh < 0.9 || rd < 0.9 {
                misses.push(format!(
                    "{} MiB: below 0.9x raw one way ({rh:.2}, {rd:.2})",
                    row.page / MIB
                ));
            }
            if r.both < 75e9 {
                misses.push(format!(
                    "{} MiB: both at once {:.1} GB/s < 75",
                    row.page / MIB,
                    gbps(r.both)
                ));
            }
        }
        json_rows.push(serde_json::json!({
            "page_bytes": row.page,
            "streams_per_direction": row.streams,
            "default_streams": row.streams == STREAMS_PER_DIRECTION_DEFAULT,
            "window_copies": row.window,
            "h2d_bytes_per_s": r.h2d,
            "d2h_bytes_per_s": r.d2h,
            "both_bytes_per_s": r.both,
            "h2d_vs_raw": rh,
            "d2h_vs_raw": rd,
            "both_vs_raw": rb,
            "single_copy_latency_us_median": row.latency_us,
        }));
    }
    println!(
        "targets with the default streams (>= 0.9x raw each way, >= 75 GB/s both): {}",
        if misses.is_empty() {
            "met".to_string()
        } else {
            misses.join("; ")
        }
    );

    if let Ok(dir) = std::env::var("SPILLWAY_BENCH_OUT") {
        let raw_json = |r: &RawCopyBandwidth| {
            serde_json::json!({
                "block_bytes": r.block_bytes,
                "h2d_bytes_per_s": r.h2d_bytes_per_s,
                "d2h_bytes_per_s": r.d2h_bytes_per_s,
                "both_bytes_per_s": r.both_bytes_per_s,
            })
        };
        let doc = serde_json::json!({
            "device": name,
            "bytes_per_direction_per_run": 4096 * MIB,
            "runs": 3,
            "raw_pinned": raw_json(&raw),
            "raw_pinned_page_blocks": raw_pages.iter().map(raw_json).collect::<Vec<_>>(),
            "submit": json_rows,
            "diagnostics_2mib": {
                "raw_over_1gib": raw_json(&diag_raw[0].1),
                "raw_over_1gib_event_per_copy": raw_json(&diag_raw[1].1),
                "submit_256mib_in_flight": {
                    "h2d_bytes_per_s": diag_window.rates.h2d,
                    "d2h_bytes_per_s": diag_window.rates.d2h,
                    "both_bytes_per_s": diag_window.rates.both,
                },
            },
            "targets_missed": misses,
        });
        let path = std::path::Path::new(&dir).join("gpu_copy_bandwidth.json");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
        println!("wrote {}", path.display());
    }
    if std::env::var("SPILLWAY_BENCH_STRICT").is_ok_and(|v| v == "1") {
        assert!(misses.is_empty(), "bandwidth targets missed: {misses:?}");
    }
}
