//! Two embedded pools on the sim device as two GPUs of one host: one lends GPU memory
//! beyond its budget, the other borrows it as its peer-GPU tier. Every byte is checked
//! on both sides, the lender takes frames back while the borrower runs, and errors are
//! typed.

use std::time::Duration;

use spillway_client::{
    Buffer, DeviceChoice, PageSize, PeerError, PeerLease, Policy, Pool, PoolBuilder, PoolError,
    pattern,
};

const PAGE: u64 = 64 << 10;

fn builder(gpu_pages: u64) -> PoolBuilder {
    PoolBuilder::new()
        .gpu_budget_bytes(gpu_pages * PAGE)
        .host_budget_bytes(64 * PAGE)
        .page_size(PageSize::new(PAGE).unwrap())
        .policy(Policy::Learned)
        .device(DeviceChoice::Sim)
}

/// A lender of 4 GPU pages that can lend 8 more, and a borrower of 4 GPU pages.
fn two_gpus() -> (Pool, Pool) {
    let lender = builder(4).lendable_gpu_bytes(8 * PAGE).build().unwrap();
    let borrower = builder(4).build().unwrap();
    (lender, borrower)
}

/// [`two_gpus`] with the borrower borrowing all 8 lendable frames, its 8 buffers written
/// and read once.
fn borrowing_eight() -> (Pool, Pool, PeerLease, Vec<Buffer>) {
    let (lender, borrower) = two_gpus();
    let lease = lender.lend(8).unwrap();
    borrower.borrow(lease.clone()).unwrap();
    let theirs = written(&borrower, 2, 8);
    read_step(&borrower, 2, &theirs);
    (lender, borrower, lease, theirs)
}

fn seed(pool: u64, i: usize, page: usize) -> u64 {
    pool << 40 | (i as u64) << 8 | page as u64
}

/// `n` buffers of 2 pages, each page written once with its own pattern.
fn written(pool: &Pool, tag: u64, n: usize) -> Vec<Buffer> {
    (0..n)
        .map(|i| {
            let b = pool.alloc(&format!("b{i}"), 2 * PAGE).unwrap();
            let mut g = pool.acquire_mut(&b).unwrap();
            for page in 0..g.pages() {
                g.fill_pattern(page, seed(tag, i, page)).unwrap();
            }
            drop(g);
            b
        })
        .collect()
}

/// One step reading every buffer and checking every page.
fn read_step(pool: &Pool, tag: u64, buffers: &[Buffer]) {
    for (i, b) in buffers.iter().enumerate() {
        let g = pool.acquire(b).unwrap();
        for page in 0..g.pages() {
            let want = pattern::expected_checksum(seed(tag, i, page), g.page_len(page) as usize);
            assert_eq!(
                g.checksum(page).unwrap(),
                want,
                "pool {tag} buffer {i} page {page}"
            );
        }
    }
    pool.step();
}

#[test]
fn a_borrower_loads_evicted_pages_from_the_lent_memory_and_the_lenders_own_pages_stay_intact() {
    let (lender, borrower) = two_gpus();
    borrower.borrow(lender.lend(8).unwrap()).unwrap();
    // 16 pages each: 4x the GPU budget; the borrower's 4 + 8 lent frames hold 12.
    let mine = written(&lender, 1, 8);
    let theirs = written(&borrower, 2, 8);
    for _ in 0..5 {
        read_step(&borrower, 2, &theirs);
        read_step(&lender, 1, &mine);
    }
    borrower.quiesce();
    let s = borrower.stats().core;
    assert!(
        s.peer_loads > 0 && s.p2d_bytes == s.peer_loads * PAGE,
        "{s:?}"
    );
    assert!(
        s.peer_frames_in_use <= 8 && s.peer_frames_total == 8,
        "{s:?}"
    );
    let l = lender.stats().core;
    assert_eq!(
        (l.peer_loads, l.peer_frames_total),
        (0, 0),
        "the lender borrows nothing"
    );
    assert!(
        l.frames_in_use_peak <= 4,
        "the lender keeps to its budget: {l:?}"
    );
}

#[test]
fn the_lender_takes_frames_back_while_the_borrower_runs_and_lends_them_again() {
    let (lender, borrower, lease, theirs) = borrowing_eight();
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            for _ in 0..6 {
                read_step(&borrower, 2, &theirs);
            }
        });
        read_step(&lender, 1, &written(&lender, 1, 2));
        lease.ask_back(2);
        let waited = lease.wait_given_back(2, Duration::from_secs(10));
        assert!(waited.is_some(), "frames given back within 10 s: {lease:?}");
        assert_eq!(lease.lent(), 2);
        reader.join().unwrap();
    });
    let s = borrower.stats().core;
    assert!(
        s.peer_frames_in_use <= 2 && s.peer_frames_total == 2,
        "{s:?}"
    );
    // Lent again: the borrower uses them again.
    let loads = s.peer_loads;
    lease.lend(8);
    for _ in 0..3 {
        read_step(&borrower, 2, &theirs);
    }
    let s = borrower.stats().core;
    assert_eq!(s.peer_frames_total, 8, "{s:?}");
    assert!(s.peer_loads > loads, "{s:?}");
}

#[test]
fn an_idle_borrower_gives_frames_back_at_once() {
    let (_lender, borrower, lease, theirs) = borrowing_eight();
    read_step(&borrower, 2, &theirs);
    borrower.quiesce();
    assert!(borrower.stats().core.peer_frames_in_use > 0);
    // Nobody calls the borrower: the lease wakes it.
    lease.ask_back(0);
    assert!(lease.wait_given_back(0, Duration::from_secs(10)).is_some());
    assert_eq!(borrower.stats().core.peer_frames_in_use, 0);
    read_step(&borrower, 2, &theirs);
}

#[test]
fn lending_without_lendable_memory_or_on_cuda_is_a_typed_error() {
    let (_, borrower) = two_gpus();
    let e = borrower.lend(4).unwrap_err();
    assert!(
        matches!(e, PoolError::Peer(PeerError::NothingToLend)),
        "{e}"
    );
    assert!(e.to_string().contains("lendable_gpu_bytes"), "{e}");
    let e = builder(4)
        .lendable_gpu_bytes(4 * PAGE)
        .device(DeviceChoice::Cuda)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            e,
            PoolError::Peer(PeerError::Unsupported { backend: "cuda" })
        ),
        "{e}"
    );
}
