//! GPU tests and copy benchmark of the `cuda` backend.
//!
//! Built only with feature `cuda` (without it, `tests/gpu_skipped.rs` shows one ignored
//! test saying what this suite needs). The binary is built on a machine without a GPU and
//! carried to one (`bench/gpu/build-dist.sh`, `bench/gpu/run.sh`), so whether a GPU is
//! there is known only when the tests run, and stable Rust cannot mark a test ignored at
//! run time. So that a machine without a usable GPU never reads as a passing GPU suite:
//! - [`a_usable_gpu_is_present`] fails there, naming what is missing (driver, GPU) and
//!   saying that every other test returned early;
//! - every other test asks [`cuda_available`] first and, without a GPU, prints one line
//!   `[test] SKIPPED, no usable GPU: ...` (seen with `--nocapture`) and returns.
//!
//! So without a GPU the suite's result is `FAILED` with one failure that says why, and
//! with `--skip a_usable_gpu_is_present` it is the explicit choice to build-check only.
//! On a GPU the tests take one lock each so they never share the GPU, and the
//! bandwidth test prints a table and, when `SPILLWAY_BENCH_OUT` names a directory, writes
//! `gpu_copy_bandwidth.json` there. `SPILLWAY_BENCH_STRICT=1` turns the bandwidth targets
//! (>= 0.9x raw pinned each way, >= 75 GB/s both ways at once) into assertions.
//!
//! Run on a GPU machine (the binary needs no Rust there):
//! `gpu-<hash> --test-threads=1 --nocapture`.
#![cfg(feature = "cuda")]

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc};
use std::time::{Duration, Instant};

use spillway_device::cuda::{
    CudaDevice, MAP_AHEAD_VAR, STREAMS_PER_DIRECTION_DEFAULT, compute_reference, cuda_available,
};
use spillway_device::{
    Completion, CompletionSink, CopyOp, Device, DeviceConfig, DeviceError, DevicePtr,
};
use spillway_types::{BufferId, Direction, Far, FrameId, HostSlot, TransferId, pattern};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Longest wait for one completion before a test gives up (a hang would eat device time).
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(30);

static GPU: Mutex<()> = Mutex::new(());

#[path = "gpu/bandwidth.rs"]
mod bandwidth;

/// The GPU lock, or `None` (with the reason printed) when there is no usable GPU.
fn gpu(test: &str) -> Option<MutexGuard<'static, ()>> {
    match cuda_available() {
        Ok(name) => {
            let guard = GPU.lock().unwrap_or_else(PoisonError::into_inner);
            eprintln!("[{test}] on {name}");
            Some(guard)
        }
        Err(e) => {
            eprintln!("[{test}] SKIPPED, no usable GPU: {e}");
            None
        }
    }
}

/// Fails on a machine without a usable GPU, so the suite's result says it did not run:
/// every other test here then returns early and would otherwise count as passed.
#[test]
fn a_usable_gpu_is_present() {
    if let Err(e) = cuda_available() {
        panic!(
            "no usable GPU: {e}. Every other test in this suite returned early (SKIPPED) and \
             tested nothing; run it on a machine with an NVIDIA GPU and its driver \
             (bench/gpu/run.sh), or pass --skip a_usable_gpu_is_present to only build-check"
        );
    }
}

/// A device whose completions arrive on a channel.
fn open(frames: u32, host_slots: u32, page_bytes: u64) -> (CudaDevice, mpsc::Receiver<Completion>) {
    open_with_streams(
        frames,
        host_slots,
        page_bytes,
        STREAMS_PER_DIRECTION_DEFAULT,
    )
}

/// [`open`] with `streams` copy streams per direction.
fn open_with_streams(
    frames: u32,
    host_slots: u32,
    page_bytes: u64,
    streams: usize,
) -> (CudaDevice, mpsc::Receiver<Completion>) {
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let sink: CompletionSink = Arc::new(move |c| {
        let _ = tx.lock().unwrap().send(c);
    });
    let config = DeviceConfig {
        frames,
        host_slots,
        page_bytes,
    };
    let device = CudaDevice::with_streams(config, sink, 0, streams).expect("open the GPU");
    (device, rx)
}

fn next(rx: &mpsc::Receiver<Completion>) -> Completion {
    rx.recv_timeout(COMPLETION_TIMEOUT)
        .expect("a completion within the timeout")
}

/// `len` random bytes, none of them zero (so a zeroed or untouched page never passes).
fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 24) as u8).max(1)
        })
        .collect()
}

/// Writes a page of [`random_bytes`] (seed `seed + s`) into each host slot `s` of
/// `0..slots`; returns the pages.
fn random_host_pages(d: &CudaDevice, slots: u32, page: u64, seed: u64) -> Vec<Vec<u8>> {
    let data: Vec<Vec<u8>> = (0..slots)
        .map(|s| random_bytes(seed + u64::from(s), page as usize))
        .collect();
    for (s, bytes) in data.iter().enumerate() {
        d.write_host(HostSlot(s as u32), 0, bytes).unwrap();
    }
    data
}

fn copy(id: u64, direction: Direction, frame: u32, slot: u32, bytes: u64) -> CopyOp {
    CopyOp {
        id: TransferId(id),
        direction,
        frame: FrameId(frame),
        far: Far::Host(HostSlot(slot)),
        bytes,
    }
}

/// Submits `ops` all at once, then checks that each completes, successfully, in submission
/// order.
fn submit_in_order(
    d: &CudaDevice,
    rx: &mpsc::Receiver<Completion>,
    ops: impl IntoIterator<Item = CopyOp>,
) {
    let ops: Vec<CopyOp> = ops.into_iter().collect();
    for op in &ops {
        d.submit(*op);
    }
    for op in &ops {
        let c = next(rx);
        assert_eq!(
            c.id, op.id,
            "{:?} completions in submission order",
            op.direction
        );
        c.result.unwrap();
    }
}

#[test]
fn copies_round_trip_random_data_through_every_frame() {
    let Some(_gpu) = gpu("round trip") else {
        return;
    };
    for page in [64 * KIB, 2 * MIB, 8 * MIB] {
        let frames = 40u32;
        let (d, rx) = open(frames, 2 * frames, page);
        eprintln!("  page {} KiB: {}", page / KIB, d.describe());
        let sizes = [
            page,
            page - 1,
            1,
            7,
            9,
            4097,
            page / 2 + 3,
            65_537.min(page),
        ];
        let data: Vec<Vec<u8>> = (0..frames)
            .map(|f| {
                random_bytes(
                    u64::from(f) * 7919 + page,
                    sizes[f as usize % sizes.len()] as usize,
                )
            })
            .collect();
        let zeros = vec![0u8; page as usize];
        for f in 0..frames {
            d.write_host(HostSlot(f), 0, &data[f as usize]).unwrap();
            d.write_host(HostSlot(frames + f), 0, &zeros).unwrap();
        }
        // Up: slot f -> frame f, all in flight at once; completions in order.
        let len = |f: u32| data[f as usize].len() as u64;
        submit_in_order(
            &d,
            &rx,
            (0..frames).map(|f| copy(u64::from(f), Direction::HostToDevice, f, f, len(f))),
        );
        for f in 0..frames {
            let want = pattern::checksum(&data[f as usize]);
            let got = d
                .checksum(FrameId(f), data[f as usize].len() as u64)
                .unwrap();
            assert_eq!(got, want, "page {page}: checksum of frame {f}");
        }
        // Down: frame f -> slot frames+f.
        submit_in_order(
            &d,
            &rx,
            (0..frames).map(|f| {
                let id = 100 + u64::from(f);
                copy(id, Direction::DeviceToHost, f, frames + f, len(f))
            }),
        );
        let mut back = vec![0u8; page as usize];
        for f in 0..frames {
            let want = &data[f as usize];
            d.read_host(HostSlot(frames + f), 0, &mut back).unwrap();
            assert!(
                back[..want.len()] == want[..],
                "page {page}: frame {f} came back changed"
            );
            assert!(
                back[want.len()..].iter().all(|&b| b == 0),
                "page {page}: frame {f} wrote past its length"
            );
            // The synchronous path reads the same bytes.
            let mut sync = vec![0u8; want.len()];
            d.read_frame(FrameId(f), 0, &mut sync).unwrap();
            assert!(sync == *want, "page {page}: read_frame of frame {f}");
        }
        // Frames are distinct and laid out page after page.
        for f in 1..frames {
            assert_eq!(
                d.frame_ptr(FrameId(f)).0 - d.frame_ptr(FrameId(f - 1)).0,
                page
            );
        }
        // write_frame at an odd offset, read back.
        let patch = random_bytes(99, 1001);
        d.write_frame(FrameId(3), 5, &patch).unwrap();
        let mut out = vec![0u8; 1001];
        d.read_frame(FrameId(3), 5, &mut out).unwrap();
        assert!(out == patch);
        // A refused copy still completes, in order, with the error.
        d.submit(copy(500, Direction::HostToDevice, 0, 0, page + 1));
        d.submit(copy(501, Direction::HostToDevice, 0, 0, 8));
        let c = next(&rx);
        assert_eq!(c.id, TransferId(500));
        assert!(matches!(c.result, Err(DeviceError::OutOfRange { .. })));
        let c = next(&rx);
        assert_eq!(c.id, TransferId(501));
        c.result.unwrap();
        assert!(d.host_view(FrameId(0)).is_none());
    }
}

#[test]
fn kernels_match_the_cpu_functions() {
    let Some(_gpu) = gpu("kernels") else {
        return;
    };
    let page = 2 * MIB;
    let (d, _rx) = open(4, 1, page);
    let mut cpu = vec![0u8; page as usize];
    for (k, len) in [0u64, 1, 7, 8, 9, 4095, 65_543, 1_000_001, page - 1, page]
        .into_iter()
        .enumerate()
    {
        let seed = 0xABCD_0000 + k as u64;
        d.fill_pattern(FrameId(1), len, seed).unwrap();
        let bytes = &mut cpu[..len as usize];
        pattern::fill(seed, bytes);
        let mut gpu_bytes = vec![0u8; len as usize];
        d.read_frame(FrameId(1), 0, &mut gpu_bytes).unwrap();
        assert!(
            gpu_bytes == *bytes,
            "fill of {len} bytes differs from pattern::fill"
        );
        assert_eq!(
            d.checksum(FrameId(1), len).unwrap(),
            pattern::expected_checksum(seed, len as usize),
            "checksum of {len}"
        );
        for passes in [0u32, 1, 5] {
            assert_eq!(
                d.compute(FrameId(1), len, passes).unwrap(),
                compute_reference(bytes, passes),
                "compute of {len} bytes, {passes} passes"
            );
        }
    }
    // Random data, then one byte changed near the end.
    let mut data = random_bytes(5, 777_777);
    d.write_frame(FrameId(2), 0, &data).unwrap();
    let len = data.len() as u64;
    let (sum, work) = (
        d.checksum(FrameId(2), len).unwrap(),
        d.compute(FrameId(2), len, 3).unwrap(),
    );
    assert_eq!(sum, pattern::checksum(&data));
    assert_eq!(work, compute_reference(&data, 3));
    data[777_770] ^= 0x40;
    d.write_frame(FrameId(2), 777_770, &data[777_770..777_771])
        .unwrap();
    assert_ne!(d.checksum(FrameId(2), len).unwrap(), sum);
    assert_ne!(d.compute(FrameId(2), len, 3).unwrap(), work);
    assert_eq!(
        d.compute(FrameId(2), len, 3).unwrap(),
        compute_reference(&data, 3)
    );
    // A heavy compute call: time it (for the demo's sizing), check it.
    let t = Instant::now();
    let heavy = d.compute(FrameId(2), len, 1000).unwrap();
    eprintln!("  compute of {len} bytes x 1000 passes: {:?}", t.elapsed());
    assert_eq!(heavy, compute_reference(&data, 1000));
    assert!(matches!(
        d.checksum(FrameId(0), page + 1),
        Err(DeviceError::OutOfRange { .. })
    ));

    // Small pages share a physical chunk: neighbours must not clobber each other.
    let (small, _rx) = open(70, 1, 64 * KIB);
    for f in 0..70 {
        small
            .fill_pattern(FrameId(f), 64 * KIB, 1000 + u64::from(f))
            .unwrap();
    }
    for f in 0..70 {
        assert_eq!(
            small.checksum(FrameId(f), 64 * KIB).unwrap(),
            pattern::expected_checksum(1000 + u64::from(f), 64 << 10),
            "64 KiB frame {f}"
        );
    }
}

#[test]
fn mapped_pages_form_a_contiguous_buffer() {
    let Some(_gpu) = gpu("buffer view") else {
        return;
    };
    let page = 2 * MIB;
    let (d, _rx) = open(8, 1, page);
    let total = 3 * page + 100;
    let base = d
        .reserve_range(BufferId(1), total)
        .unwrap()
        .expect("2 MiB pages can be remapped");
    assert_eq!(base.0 % page, 0);
    let seeds = [11u64, 22, 33, 44];
    let frames = [5u32, 2, 7, 0];
    let mut expected = Vec::new();
    for (i, (&seed, &frame)) in seeds.iter().zip(&frames).enumerate() {
        d.fill_pattern(FrameId(frame), page, seed).unwrap();
        d.map_page(BufferId(1), i as u32, FrameId(frame)).unwrap();
        let mut p = vec![0u8; page as usize];
        pattern::fill(seed, &mut p);
        expected.extend_from_slice(&p);
    }
    expected.truncate(total as usize);
    let mut view = vec![0u8; total as usize];
    d.read_range(BufferId(1), 0, &mut view).unwrap();
    assert!(
        view == expected,
        "the buffer range shows its pages in order"
    );
    assert_eq!(
        d.checksum_range(BufferId(1), total).unwrap(),
        pattern::checksum(&expected),
        "a kernel sees the range as one array"
    );
    let mut seam = vec![0u8; 20];
    d.read_range(BufferId(1), 2 * page - 10, &mut seam).unwrap();
    assert!(seam[..] == expected[(2 * page - 10) as usize..(2 * page + 10) as usize]);

    // Unmapping is lazy: the page keeps its mapping until it is mapped again, and mapping
    // it back to the same frame changes nothing.
    let remaps = d.mapping_stats().0;
    d.unmap_page(BufferId(1), 1).unwrap();
    d.map_page(BufferId(1), 1, FrameId(2)).unwrap();
    d.read_range(BufferId(1), page, &mut seam).unwrap();
    assert_eq!(d.mapping_stats().0, remaps, "same frame: no remap");
    // Remapping to another frame shows the new frame.
    d.map_page(BufferId(1), 1, FrameId(0)).unwrap(); // frame 0 now at pages 1 and 3
    d.write_frame(FrameId(0), 0, &[0xAB; 16]).unwrap();
    let mut head = vec![0u8; 16];
    d.read_range(BufferId(1), page, &mut head).unwrap();
    assert_eq!(head, [0xAB; 16]);
    d.read_range(BufferId(1), 3 * page, &mut head).unwrap();
    assert_eq!(head, [0xAB; 16]);
    // Page 0 is still frame 5, through the frame's own address too.
    let mut first = vec![0u8; 64];
    d.read_frame(FrameId(5), 0, &mut first).unwrap();
    assert!(first[..] == expected[..64]);
    // Remap in place without unmapping first.
    d.map_page(BufferId(1), 2, FrameId(2)).unwrap();
    d.read_range(BufferId(1), 2 * page, &mut first).unwrap();
    assert!(first[..] == expected[page as usize..page as usize + 64]);

    assert!(
        d.reserve_range(BufferId(1), page).is_err(),
        "one range per buffer"
    );
    let other = d.reserve_range(BufferId(2), page).unwrap().unwrap();
    assert_ne!(other, base);
    d.map_page(BufferId(2), 0, FrameId(5)).unwrap();
    d.release_range(BufferId(1)).unwrap();
    assert!(d.read_range(BufferId(1), 0, &mut head).is_err());
    d.read_range(BufferId(2), 0, &mut first).unwrap();
    assert!(
        first[..] == expected[..64],
        "frame 5 lives on after buffer 1's range is gone"
    );
    d.release_range(BufferId(2)).unwrap();
    d.release_range(BufferId(2)).unwrap(); // idempotent

    // Pages smaller than the granularity cannot be mapped one by one: no range, and
    // mapping a page is a no-op (the Device trait's contract; c0109b9).
    let (small, _rx) = open(40, 1, 64 * KIB);
    assert_eq!(
        small.reserve_range(BufferId(3), 10 * 64 * KIB).unwrap(),
        None
    );
    small.map_page(BufferId(3), 0, FrameId(0)).unwrap();
    assert!(
        small.read_range(BufferId(3), 0, &mut first).is_err(),
        "still no range"
    );
}

#[test]
fn both_directions_run_at_once_and_stay_ordered() {
    let Some(_gpu) = gpu("both directions") else {
        return;
    };
    for streams in [1, 3] {
        both_directions_with(streams);
    }
}

fn both_directions_with(streams: usize) {
    let page = 2 * MIB;
    let n = 32u32;
    // Frames 0..n receive uploads from slots 0..n; frames n..2n go down to slots n..2n.
    let (d, rx) = open_with_streams(2 * n, 2 * n, page, streams);
    let up: Vec<Vec<u8>> = (0..n)
        .map(|i| random_bytes(31 + u64::from(i), (page - u64::from(i) * 13) as usize))
        .collect();
    for i in 0..n {
        d.write_host(HostSlot(i), 0, &up[i as usize]).unwrap();
        d.fill_pattern(FrameId(n + i), page, 77 + u64::from(i))
            .unwrap();
    }
    const DOWN: u64 = 1 << 40;
    let rounds = 8u64;
    std::thread::scope(|s| {
        let d = &d;
        let upl = &up;
        s.spawn(move || {
            for r in 0..rounds {
                for i in 0..n {
                    let id = r * u64::from(n) + u64::from(i);
                    d.submit(copy(
                        id,
                        Direction::HostToDevice,
                        i,
                        i,
                        upl[i as usize].len() as u64,
                    ));
                }
            }
        });
        s.spawn(move || {
            for r in 0..rounds {
                for i in 0..n {
                    let id = DOWN + r * u64::from(n) + u64::from(i);
                    d.submit(copy(id, Direction::DeviceToHost, n + i, n + i, page));
                }
            }
        });
    });
    let (mut next_up, mut next_down) = (0u64, DOWN);
    for _ in 0..2 * rounds * u64::from(n) {
        let c = next(&rx);
        c.result.unwrap();
        if c.id.0 >= DOWN {
            assert_eq!(c.id.0, next_down, "D2H in order");
            next_down += 1;
        } else {
            assert_eq!(c.id.0, next_up, "H2D in order");
            next_up += 1;
        }
    }
    for i in 0..n {
        let len = up[i as usize].len() as u64;
        assert_eq!(
            d.checksum(FrameId(i), len).unwrap(),
            pattern::checksum(&up[i as usize]),
            "uploaded frame {i}"
        );
        let mut back = vec![0u8; page as usize];
        d.read_host(HostSlot(n + i), 0, &mut back).unwrap();
        assert_eq!(
            pattern::checksum(&back),
            pattern::expected_checksum(77 + u64::from(i), page as usize),
            "downloaded frame {}",
            n + i
        );
    }
}

#[test]
fn an_acquire_in_consecutive_frames_is_shown_in_place_else_mapped_once() {
    let Some(_gpu) = gpu("views") else {
        return;
    };
    for page in [256 * KIB, 2 * MIB, 8 * MIB] {
        views_with(page);
    }
}

/// Fills each of `d`'s first `frames` frames with its own pattern (seeds from `seed`);
/// returns the checksum of frames read in a given order, one after another.
fn patterned_frames(d: &CudaDevice, frames: u32, page: u64, seed: u64) -> impl Fn(&[u32]) -> u64 {
    let seeds: Vec<u64> = (0..u64::from(frames)).map(|f| seed + f).collect();
    for (f, &seed) in seeds.iter().enumerate() {
        d.fill_pattern(FrameId(f as u32), page, seed).unwrap();
    }
    move |order: &[u32]| {
        let mut all = Vec::new();
        for &f in order {
            let mut p = vec![0u8; page as usize];
            pattern::fill(seeds[f as usize], &mut p);
            all.extend_from_slice(&p);
        }
        pattern::checksum(&all)
    }
}

fn views_with(page: u64) {
    // Mapping ahead off: this test counts the pages the acquiring thread maps.
    // SAFETY: every test of this binary that opens a device holds the GPU lock (taken by
    // the caller), so no other test reads the environment while it changes.
    unsafe { std::env::set_var(MAP_AHEAD_VAR, "0") };
    let (d, _rx) = open(12, 1, page);
    unsafe { std::env::remove_var(MAP_AHEAD_VAR) };
    let expected = patterned_frames(&d, 12, page, 500);
    let buffer = BufferId(7);
    let range = d.reserve_range(buffer, 4 * page).unwrap();
    assert_eq!(range.is_some(), page.is_multiple_of(2 * MIB), "{page}");

    // Consecutive frames: the first frame's own address, no driver call.
    let before = d.timings();
    let frames: Vec<FrameId> = (3..7).map(FrameId).collect();
    for (i, &f) in frames.iter().enumerate() {
        if range.is_some() {
            d.map_page(buffer, i as u32, f).unwrap();
        }
    }
    let ptr = d.acquire_ptr(buffer, &frames).unwrap().expect("a view");
    assert_eq!(ptr, d.frame_ptr(FrameId(3)));
    assert_eq!(
        d.checksum_view(ptr, 4 * page).unwrap(),
        expected(&[3, 4, 5, 6]),
        "{page}: the extent reads as one array"
    );
    let t = d.timings().since(&before);
    assert_eq!(
        (t.views_in_place, t.views_mapped, t.pages_remapped),
        (1, 0, 0)
    );

    // Not consecutive: through the buffer's range, each page mapped once, access set
    // over the span; asking again maps nothing.
    let frames: Vec<FrameId> = [9u32, 2, 11, 0].into_iter().map(FrameId).collect();
    for (i, &f) in frames.iter().enumerate() {
        if range.is_some() {
            d.map_page(buffer, i as u32, f).unwrap();
        }
    }
    let view = d.acquire_ptr(buffer, &frames).unwrap();
    let Some(base) = range else {
        assert_eq!(
            view, None,
            "{page}: pages under the granularity have no range"
        );
        return;
    };
    assert_eq!(view, Some(base));
    assert_eq!(
        d.checksum_view(base, 4 * page).unwrap(),
        expected(&[9, 2, 11, 0]),
        "{page}: the mapped range reads as one array"
    );
    let t = d.timings().since(&before);
    assert_eq!((t.views_mapped, t.pages_remapped), (1, 4));
    assert!(t.mapping_s > 0.0);
    d.acquire_ptr(buffer, &frames).unwrap();
    d.map_page(buffer, 1, FrameId(5)).unwrap();
    d.acquire_ptr(buffer, &[FrameId(9), FrameId(5), FrameId(11), FrameId(0)])
        .unwrap();
    let t = d.timings().since(&before);
    assert_eq!(t.pages_remapped, 5, "only the page whose frame changed");
    assert_eq!(
        d.checksum_view(base, 4 * page).unwrap(),
        expected(&[9, 5, 11, 0])
    );
    assert!(
        d.checksum_view(DevicePtr(base.0 + 4 * page), page).is_err(),
        "outside every view"
    );
    d.release_range(buffer).unwrap();
}

#[test]
fn with_mapping_ahead_a_scattered_buffer_is_mapped_before_its_acquire() {
    let Some(_gpu) = gpu("map ahead") else {
        return;
    };
    for page in [2 * MIB, 8 * MIB] {
        // SAFETY: every test of this binary that opens a device holds the GPU lock
        // (taken above), so no other test reads the environment while it changes.
        unsafe { std::env::set_var(MAP_AHEAD_VAR, "1") };
        let (d, _rx) = open(12, 1, page);
        unsafe { std::env::remove_var(MAP_AHEAD_VAR) };
        assert!(d.mapping_ahead(), "{page}: on");
        let expected = patterned_frames(&d, 12, page, 900);
        let buffer = BufferId(9);
        let base = d.reserve_range(buffer, 4 * page).unwrap().expect("a range");
        let before = d.timings();
        let frames: Vec<FrameId> = [9u32, 2, 11, 0].into_iter().map(FrameId).collect();
        for (i, &f) in frames.iter().enumerate() {
            d.map_page(buffer, i as u32, f).unwrap();
        }
        assert!(d.wait_mapped_ahead(COMPLETION_TIMEOUT));
        let t = d.timings().since(&before);
        assert_eq!(
            t.pages_mapped_ahead, 0,
            "{page}: a buffer nobody has viewed whole (read page by page) is not mapped"
        );
        // The first whole view maps on the acquiring thread, and marks the buffer.
        assert_eq!(d.acquire_ptr(buffer, &frames).unwrap(), Some(base));
        let t = d.timings().since(&before);
        assert_eq!((t.views_mapped, t.pages_remapped), (1, 4), "{page}");
        // Its pages leave and come back scattered elsewhere: mapped ahead now.
        let frames: Vec<FrameId> = [3u32, 10, 1, 7].into_iter().map(FrameId).collect();
        for (i, &f) in frames.iter().enumerate() {
            d.unmap_page(buffer, i as u32).unwrap();
            d.map_page(buffer, i as u32, f).unwrap();
        }
        assert!(
            d.wait_mapped_ahead(COMPLETION_TIMEOUT),
            "{page}: mapped ahead"
        );
        let t = d.timings().since(&before);
        assert_eq!(
            t.pages_mapped_ahead, 4,
            "{page}: every recorded page, ahead"
        );
        assert!(t.map_ahead_s > 0.0);
        assert_eq!(d.acquire_ptr(buffer, &frames).unwrap(), Some(base));
        assert_eq!(
            d.checksum_view(base, 4 * page).unwrap(),
            expected(&[3, 10, 1, 7]),
            "{page}: the range mapped ahead reads as one array"
        );
        let t = d.timings().since(&before);
        assert_eq!(
            (t.views_mapped, t.pages_remapped),
            (2, 4),
            "{page}: the second acquire mapped nothing itself"
        );
        // Page 1 leaves and comes back elsewhere: only it is mapped again, ahead.
        d.unmap_page(buffer, 1).unwrap();
        d.map_page(buffer, 1, FrameId(5)).unwrap();
        assert!(d.wait_mapped_ahead(COMPLETION_TIMEOUT));
        let frames = [FrameId(3), FrameId(5), FrameId(1), FrameId(7)];
        assert_eq!(d.acquire_ptr(buffer, &frames).unwrap(), Some(base));
        let t = d.timings().since(&before);
        assert_eq!((t.pages_mapped_ahead, t.pages_remapped), (5, 4), "{page}");
        assert_eq!(
            d.checksum_view(base, 4 * page).unwrap(),
            expected(&[3, 5, 1, 7])
        );
        // Consecutive frames are shown in place and queue nothing.
        let b2 = BufferId(10);
        d.reserve_range(b2, 3 * page).unwrap();
        for i in 0..3u32 {
            d.map_page(b2, i, FrameId(6 + i)).unwrap();
        }
        assert!(d.wait_mapped_ahead(COMPLETION_TIMEOUT));
        let t = d.timings().since(&before);
        assert_eq!(
            t.pages_mapped_ahead, 5,
            "{page}: an extent is not mapped ahead"
        );
        d.release_range(buffer).unwrap();
        d.release_range(b2).unwrap();
    }
}

#[test]
fn neighbouring_pages_go_as_one_copy_and_complete_one_by_one() {
    let Some(_gpu) = gpu("copy runs") else {
        return;
    };
    for page in [256 * KIB, 2 * MIB] {
        let (d, rx) = open(16, 16, page);
        let data = random_host_pages(&d, 16, page, 900);
        // Frames 4..12 from slots 2..10 (one run, the last page short), then two pages
        // that are nobody's neighbours.
        let mut ops: Vec<CopyOp> = (0..8u32)
            .map(|k| {
                let bytes = if k == 7 { page / 2 } else { page };
                copy(
                    u64::from(k) + 1,
                    Direction::HostToDevice,
                    4 + k,
                    2 + k,
                    bytes,
                )
            })
            .collect();
        ops.push(copy(9, Direction::HostToDevice, 0, 15, page));
        ops.push(copy(10, Direction::HostToDevice, 14, 12, page));
        if page < d.chunk_bytes() {
            // Pages smaller than a chunk have no buffer ranges: mapping one is a no-op.
            assert_eq!(d.reserve_range(BufferId(1), 4 * page).unwrap(), None);
            d.map_page(BufferId(1), 0, FrameId(3)).unwrap();
        }
        let before = d.timings();
        d.submit_batch(&ops);
        for op in &ops {
            let c = next(&rx);
            assert_eq!(c.id, op.id, "{page}: completions in submission order");
            c.result.unwrap();
        }
        let t = d.timings().since(&before);
        assert_eq!(
            (t.completions, t.copies),
            (10, 3),
            "{page}: one copy for the run"
        );
        for op in &ops {
            let mut back = vec![0u8; op.bytes as usize];
            d.read_frame(op.frame, 0, &mut back).unwrap();
            assert!(
                back[..] == data[op.slot().expect("a host copy").0 as usize][..op.bytes as usize],
                "{page}: frame {} holds slot {}",
                op.frame.0,
                op.slot().expect("a host copy").0
            );
        }
        // The half page after the run's short last page was not written.
        let mut tail = vec![0u8; 16];
        d.read_frame(FrameId(11), page / 2, &mut tail).unwrap();
        assert!(tail[..] != data[9][(page / 2) as usize..(page / 2 + 16) as usize]);
    }
}

/// Batches of non-neighbouring pages: each lane's first run may be enqueued by the
/// submitting thread, the rest by the lane's submitter thread; completions still come
/// once each, in submission order per direction, a refused copy (bytes past its page)
/// among them, and every page holds what was copied.
#[test]
fn batches_enqueued_partly_off_the_callers_thread_complete_once_in_order() {
    let Some(_gpu) = gpu("submitter threads") else {
        return;
    };
    let page = 256 * KIB;
    let n = 32u32;
    let (d, rx) = open(2 * n, 2 * n, page);
    let data = random_host_pages(&d, n, page, 4_000);
    for f in 0..n {
        d.fill_pattern(FrameId(n + f), page, 500 + u64::from(f))
            .unwrap();
    }
    const DOWN: u64 = 1 << 40;
    const REFUSED: u64 = 7_777;
    let before = d.timings();
    let rounds = 16u64;
    let mut expected_up = Vec::new();
    let mut expected_down = Vec::new();
    for r in 0..rounds {
        // Uploads to every other frame (no two neighbours: one run each) and downloads,
        // interleaved in one batch; one refused upload in round 3.
        let mut ops = Vec::new();
        for k in 0..n / 2 {
            let (frame, slot) = (2 * k + (r as u32 % 2), (k * 7 + r as u32) % n);
            let id = r * 1_000 + u64::from(k);
            ops.push(copy(id, Direction::HostToDevice, frame, slot, page));
            expected_up.push((id, frame, slot));
            let down = DOWN + id;
            ops.push(copy(
                down,
                Direction::DeviceToHost,
                n + 2 * k,
                n + 2 * k,
                page,
            ));
            expected_down.push(down);
            if r == 3 && k == 5 {
                ops.push(copy(REFUSED, Direction::HostToDevice, 0, 0, page + 1));
                expected_up.push((REFUSED, 0, 0));
            }
        }
        d.submit_batch(&ops);
    }
    let (mut up, mut down) = (expected_up.iter(), expected_down.iter());
    for _ in 0..expected_up.len() + expected_down.len() {
        let c = next(&rx);
        if c.id.0 >= DOWN {
            assert_eq!(Some(&c.id.0), down.next(), "D2H in submission order");
            c.result.unwrap();
        } else {
            let &(id, _, _) = up.next().expect("no extra H2D completion");
            assert_eq!(c.id.0, id, "H2D in submission order");
            if id == REFUSED {
                assert!(c.result.is_err(), "a copy past its page is refused");
            } else {
                c.result.unwrap();
            }
        }
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "one completion each"
    );
    // The last round's uploads are in their frames.
    for &(id, frame, slot) in expected_up.iter().rev().take((n / 2) as usize) {
        let mut back = vec![0u8; page as usize];
        d.read_frame(FrameId(frame), 0, &mut back).unwrap();
        assert!(
            back == data[slot as usize],
            "copy {id}: frame {frame} holds slot {slot}"
        );
    }
    for k in 0..n / 2 {
        let mut back = vec![0u8; page as usize];
        d.read_host(HostSlot(n + 2 * k), 0, &mut back).unwrap();
        assert_eq!(
            pattern::checksum(&back),
            pattern::expected_checksum(500 + u64::from(2 * k), page as usize),
            "slot {} holds frame {}",
            n + 2 * k,
            n + 2 * k
        );
    }
    let t = d.timings().since(&before);
    let runs = (expected_up.len() + expected_down.len()) as u64;
    assert_eq!(t.completions, runs);
    if d.diagnostics().submit_off_thread {
        assert!(
            t.submitted_off_thread > 0 && t.submitted_off_thread < runs,
            "some runs enqueued by the submitter threads, each lane's first by the caller \
             when idle: {} of {runs}",
            t.submitted_off_thread
        );
    } else {
        assert_eq!(t.submitted_off_thread, 0);
    }
}
