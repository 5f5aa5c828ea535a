//! Tests of the sim device (`sim.rs`): copies, views, pacing, the peer lease.

use std::sync::{Arc, Mutex, mpsc};

use spillway_types::TransferId;

use super::*;

fn device(frames: u32, slots: u32) -> (SimDevice, mpsc::Receiver<Completion>) {
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let sink: CompletionSink = Arc::new(move |c| tx.lock().unwrap().send(c).unwrap());
    let d = SimDevice::new(
        DeviceConfig {
            frames,
            host_slots: slots,
            page_bytes: 64 << 10,
        },
        sink,
    )
    .unwrap();
    (d, rx)
}

#[test]
fn consecutive_frames_are_one_array_and_others_none() {
    let (d, _rx) = device(4, 4);
    let f = |ids: &[u32]| ids.iter().map(|&i| FrameId(i)).collect::<Vec<_>>();
    let at = d.acquire_ptr(BufferId(1), &f(&[1, 2, 3])).unwrap();
    assert_eq!(at, Some(d.frame_ptr(FrameId(1))));
    assert_eq!(
        d.frame_ptr(FrameId(2)).0 - d.frame_ptr(FrameId(1)).0,
        64 << 10,
        "frame i+1 follows frame i"
    );
    assert_eq!(d.acquire_ptr(BufferId(1), &f(&[2, 1])).unwrap(), None);
    assert_eq!(d.acquire_ptr(BufferId(1), &f(&[0, 2])).unwrap(), None);
    assert_eq!(
        d.acquire_ptr(BufferId(1), &f(&[3])).unwrap(),
        Some(d.frame_ptr(FrameId(3)))
    );
}

#[test]
fn copies_move_bytes_both_ways() {
    let (d, rx) = device(2, 4);
    let mut page = vec![0u8; 64 << 10];
    pattern::fill(9, &mut page);
    d.write_host(HostSlot(3), 0, &page).unwrap();
    let op = CopyOp {
        id: TransferId(1),
        direction: Direction::HostToDevice,
        frame: FrameId(1),
        far: Far::Host(HostSlot(3)),
        bytes: 64 << 10,
    };
    d.submit(op);
    let c = rx.recv().unwrap();
    assert_eq!(c.id, TransferId(1));
    c.result.unwrap();
    assert_eq!(
        d.checksum(FrameId(1), 64 << 10).unwrap(),
        pattern::expected_checksum(9, 64 << 10)
    );
    d.fill_pattern(FrameId(0), 1000, 5).unwrap();
    d.submit(CopyOp {
        id: TransferId(2),
        direction: Direction::DeviceToHost,
        frame: FrameId(0),
        far: Far::Host(HostSlot(0)),
        bytes: 1000,
    });
    rx.recv().unwrap().result.unwrap();
    let mut out = vec![0u8; 1000];
    d.read_host(HostSlot(0), 0, &mut out).unwrap();
    assert_eq!(pattern::checksum(&out), pattern::expected_checksum(5, 1000));
}

#[test]
fn a_paced_device_moves_a_page_no_faster_than_its_pace() {
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let sink: CompletionSink = Arc::new(move |c| tx.lock().unwrap().send(c).unwrap());
    let config = DeviceConfig {
        frames: 2,
        host_slots: 2,
        page_bytes: 4 << 20,
    };
    // 4 MiB at 0.2 GB/s: at least 20.97 ms, where a memcpy takes about 1 ms.
    let d = SimDevice::paced(config, 0.2e9, sink).unwrap();
    assert_eq!(d.bandwidth_hint_bytes_per_s(Direction::HostToDevice), 0.2e9);
    let began = Instant::now();
    for i in 0..2u32 {
        d.submit(CopyOp {
            id: TransferId(u64::from(i)),
            direction: Direction::HostToDevice,
            frame: FrameId(i),
            far: Far::Host(HostSlot(i)),
            bytes: 4 << 20,
        });
    }
    for _ in 0..2 {
        rx.recv().unwrap().result.unwrap();
    }
    let took = began.elapsed().as_secs_f64();
    // One stream: the two copies one after the other, each at the pace.
    assert!(took >= 2.0 * (4 << 20) as f64 / 0.2e9, "{took} s");
}

#[test]
fn a_copy_pace_is_a_positive_number_of_gigabytes_per_second() {
    assert_eq!(parse_copy_pace("2.5").unwrap(), 2.5e9);
    assert_eq!(parse_copy_pace(" 40 ").unwrap(), 40e9);
    for bad in ["0", "-1", "fast", "", "inf", "NaN"] {
        let e = parse_copy_pace(bad).unwrap_err().to_string();
        assert!(
            e.contains(COPY_PACE_VAR) && e.contains("GB/s"),
            "{bad}: {e}"
        );
    }
}

#[test]
fn out_of_range_is_an_error() {
    let (d, rx) = device(1, 1);
    assert!(matches!(
        d.write_host(HostSlot(0), 64 << 10, &[1]),
        Err(DeviceError::OutOfRange { .. })
    ));
    assert!(matches!(
        d.read_frame(FrameId(0), 1, &mut vec![0; 64 << 10]),
        Err(DeviceError::OutOfRange { .. })
    ));
    d.submit(CopyOp {
        id: TransferId(7),
        direction: Direction::HostToDevice,
        frame: FrameId(0),
        far: Far::Host(HostSlot(0)),
        bytes: (64 << 10) + 1,
    });
    assert!(matches!(
        rx.recv().unwrap().result,
        Err(DeviceError::OutOfRange { .. })
    ));
}

/// A lender with 4 frames of its own and 3 to lend, and a borrower of 2 frames.
fn two_gpus() -> (SimDevice, SimDevice, mpsc::Receiver<Completion>) {
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let sink: CompletionSink = Arc::new(move |c| tx.lock().unwrap().send(c).unwrap());
    let config = |frames| DeviceConfig {
        frames,
        host_slots: 2,
        page_bytes: 64 << 10,
    };
    let lender = SimDevice::lending(config(4), 3, sink.clone()).unwrap();
    let borrower = SimDevice::new(config(2), sink).unwrap();
    (lender, borrower, rx)
}

fn peer_copy(id: u64, direction: Direction, frame: u32, peer: u32) -> CopyOp {
    CopyOp {
        id: TransferId(id),
        direction,
        frame: FrameId(frame),
        far: Far::Peer(PeerFrameId(peer)),
        bytes: 64 << 10,
    }
}

#[test]
fn a_borrower_copies_to_and_from_the_frames_a_lender_lends_and_no_others() {
    let (lender, borrower, rx) = two_gpus();
    assert_eq!(borrower.peer_frames(), 0);
    borrower.submit(peer_copy(1, Direction::DeviceToPeer, 0, 0));
    let refused = rx.recv().unwrap().result.unwrap_err();
    assert!(refused.to_string().contains("no peer GPU"), "{refused}");

    let lease = lender.lease(2);
    borrower.attach_peer(lease.clone()).unwrap();
    assert!(
        borrower.attach_peer(lease.clone()).is_err(),
        "one peer a device"
    );
    assert_eq!(borrower.peer_frames(), 2);
    // The lender's own frames around the lent ones keep their bytes.
    lender.fill_pattern(FrameId(3), 64 << 10, 77).unwrap();
    borrower.fill_pattern(FrameId(1), 64 << 10, 5).unwrap();
    borrower.submit(peer_copy(2, Direction::DeviceToPeer, 1, 1));
    rx.recv().unwrap().result.unwrap();
    borrower.submit(peer_copy(3, Direction::PeerToDevice, 0, 1));
    rx.recv().unwrap().result.unwrap();
    assert_eq!(
        borrower.checksum(FrameId(0), 64 << 10).unwrap(),
        pattern::expected_checksum(5, 64 << 10),
        "the page went to the peer and back"
    );
    assert_eq!(
        lender.checksum(FrameId(3), 64 << 10).unwrap(),
        pattern::expected_checksum(77, 64 << 10),
        "the lender's own frames are untouched"
    );
    // Frame 2 of the lendable 3 is not lent.
    borrower.submit(peer_copy(4, Direction::DeviceToPeer, 0, 2));
    let refused = rx.recv().unwrap().result.unwrap_err();
    assert!(refused.to_string().contains("not lent"), "{refused}");
    // A peer direction with a host slot is refused, not copied.
    let mut wrong = peer_copy(5, Direction::PeerToDevice, 0, 0);
    wrong.far = Far::Host(HostSlot(0));
    borrower.submit(wrong);
    assert!(rx.recv().unwrap().result.is_err());
}

#[test]
fn a_lender_asks_frames_back_and_the_borrower_gives_them_back() {
    let (lender, borrower, rx) = two_gpus();
    let lease = lender.lease(3);
    borrower.attach_peer(lease.clone()).unwrap();
    assert_eq!((lease.lent(), lease.asked_back()), (3, None));
    lease.ask_back(1);
    assert_eq!((lease.lent(), lease.asked_back()), (3, Some(1)));
    lease.ask_back(2);
    assert_eq!(lease.asked_back(), Some(1), "the least asked for stands");
    lease.give_back(1);
    assert_eq!((lease.lent(), lease.asked_back()), (1, None));
    assert_eq!(borrower.peer_frames(), 1);
    borrower.submit(peer_copy(1, Direction::DeviceToPeer, 0, 1));
    assert!(
        rx.recv().unwrap().result.is_err(),
        "frame 1 is the lender's again"
    );
}

#[test]
fn a_lease_is_one_per_lender_and_one_borrower_and_only_answers_take_frames_back() {
    let (lender, borrower, rx) = two_gpus();
    let lease = lender.lease(2);
    // A second lease of the same lender is the same lease: lending more through it.
    let again = lender.lease(3);
    assert_eq!((lease.lent(), again.lent()), (3, 3));
    borrower.attach_peer(lease.clone()).unwrap();
    let (_, other, _) = two_gpus();
    let e = other.attach_peer(again.clone()).unwrap_err();
    assert!(e.to_string().contains("another device"), "{e}");
    // Lending fewer than are lent asks the rest back: nothing is taken unanswered.
    lease.lend(1);
    assert_eq!((lease.lent(), lease.asked_back()), (3, Some(1)));
    // An answer that a newer lend overtook changes nothing.
    lease.lend(3);
    lease.give_back(1);
    assert_eq!((lease.lent(), lease.asked_back()), (3, None));
    borrower.submit(peer_copy(1, Direction::DeviceToPeer, 0, 2));
    rx.recv().unwrap().result.unwrap();
    // A borrower gone gives every frame back.
    drop(borrower);
    assert_eq!(lease.lent(), 0);
    assert!(lease.wait_given_back(0, Duration::ZERO).is_some());
}

#[test]
fn compute_depends_on_every_word() {
    let mut a = vec![0u8; 4096];
    pattern::fill(1, &mut a);
    let base = compute_passes(&a, 2);
    a[4000] ^= 0x10;
    assert_ne!(compute_passes(&a, 2), base);
}

#[test]
fn a_completion_that_says_another_follows_is_followed() {
    // Copies queued together may be reported as one burst: each completion but the
    // burst's last says another follows, and the last of all says none does.
    let (d, rx) = device(8, 8);
    let ops: Vec<CopyOp> = (0..8)
        .map(|i| CopyOp {
            id: TransferId(u64::from(i)),
            direction: Direction::HostToDevice,
            frame: FrameId(i),
            far: Far::Host(HostSlot(i)),
            bytes: 64 << 10,
        })
        .collect();
    d.submit_batch(&ops);
    let got: Vec<Completion> = (0..8).map(|_| rx.recv().unwrap()).collect();
    let ids: Vec<u64> = got.iter().map(|c| c.id.0).collect();
    assert_eq!(ids, (0..8).collect::<Vec<_>>(), "in order, each once");
    assert!(!got[7].follows, "the last completion says none follows");
    assert!(got.iter().all(|c| c.result.is_ok()));
}
