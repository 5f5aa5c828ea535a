//! The UCX wrapper against a real UCX over TCP on loopback (feature `ucx`). Run with
//! `UCX_NET_DEVICES=lo UCX_TLS=tcp,self cargo test -p spillway-net --features ucx --release`:
//! without `UCX_NET_DEVICES`, UCX over TCP would use every interface it finds, so the
//! tests refuse to run.
#![cfg(feature = "ucx")]

use std::time::Duration;

use bytes::Bytes;
use spillway_net::ucx::{Endpoint, UcxError, UcxWorkerConfig, Worker};

const PAYLOAD_BYTES: usize = 2 << 20;
const HEADER_BYTES: usize = 16;
/// A bound on how long a test waits for what must happen; a hang fails instead.
const WAIT: Duration = Duration::from_secs(20);

fn check_env() {
    assert!(
        std::env::var_os("UCX_NET_DEVICES").is_some(),
        "set UCX_NET_DEVICES=lo (and UCX_TLS=tcp,self): UCX over TCP otherwise uses every interface"
    );
}

fn config() -> UcxWorkerConfig {
    UcxWorkerConfig {
        recv_slot_bytes: PAYLOAD_BYTES + HEADER_BYTES,
        recv_slots_count: 8,
        sends_in_flight_max: 16,
    }
}

/// Two workers with an endpoint each way: (a, a's endpoint to b, b, b's endpoint to a).
async fn pair() -> (Worker, Endpoint, Worker, Endpoint) {
    check_env();
    let a = Worker::start(&config()).expect("worker a");
    let b = Worker::start(&config()).expect("worker b");
    let ab = a.connect(b.address()).await.expect("a to b");
    let ba = b.connect(a.address()).await.expect("b to a");
    (a, ab, b, ba)
}

/// A payload whose every byte depends on `seq` and its position.
fn payload(seq: u64) -> Bytes {
    let mut v = vec![0u8; PAYLOAD_BYTES];
    for (i, chunk) in v.chunks_mut(8).enumerate() {
        let word = (seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
    Bytes::from(v)
}

fn header(seq: u64) -> Bytes {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(&seq.to_le_bytes());
    h[8..].copy_from_slice(&(PAYLOAD_BYTES as u64).to_le_bytes());
    Bytes::copy_from_slice(&h)
}

/// [`pair`], with message 0 sent from a and received whole by b, so that the connection
/// exists both ways.
async fn connected_pair() -> (Worker, Endpoint, Worker, Endpoint) {
    let (a, ab, b, ba) = pair().await;
    let (got, sent) = tokio::join!(
        b.recv(TAG_REQUEST, u64::MAX, None),
        ab.send(TAG_REQUEST, header(0), payload(0))
    );
    sent.expect("send");
    check_message(got.expect("recv").bytes(), 0);
    (a, ab, b, ba)
}

/// Checks a received message against what `seq` sent, byte for byte.
fn check_message(bytes: &[u8], seq: u64) {
    assert_eq!(
        bytes.len(),
        HEADER_BYTES + PAYLOAD_BYTES,
        "message {seq} length"
    );
    assert_eq!(&bytes[..HEADER_BYTES], &header(seq)[..], "header of {seq}");
    let expected = payload(seq);
    if let Some(i) = (0..PAYLOAD_BYTES).find(|&i| bytes[HEADER_BYTES + i] != expected[i]) {
        panic!("message {seq}: payload byte {i} differs");
    }
}

const TAG_REQUEST: u64 = 1 << 32;
const TAG_REPLY: u64 = 2 << 32;
const KIND_MASK: u64 = 0xFFFF_FFFF << 32;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_of_2_mib_payloads_checks_every_byte() {
    let (a, ab, b, ba) = pair().await;
    for seq in 0..4u64 {
        let recv_b = b.recv(TAG_REQUEST | seq, u64::MAX, None);
        let send_a = ab.send(TAG_REQUEST | seq, header(seq), payload(seq));
        let (got, sent) = tokio::time::timeout(WAIT, async { tokio::join!(recv_b, send_a) })
            .await
            .expect("request within the bound");
        sent.expect("send a to b");
        let got = got.expect("recv on b");
        assert_eq!(got.sender_tag(), TAG_REQUEST | seq);
        check_message(got.bytes(), seq);

        // Echo what arrived back from the registered slot, then check it on a.
        let echo = Bytes::copy_from_slice(&got.bytes()[HEADER_BYTES..]);
        let recv_a = a.recv(TAG_REPLY | seq, u64::MAX, Some(&ab));
        let send_b = ba.send(TAG_REPLY | seq, header(seq), echo);
        let (back, sent) = tokio::time::timeout(WAIT, async { tokio::join!(recv_a, send_b) })
            .await
            .expect("reply within the bound");
        sent.expect("send b to a");
        check_message(back.expect("recv on a").bytes(), seq);
    }
    assert_eq!(
        a.stats()
            .sends_completed
            .load(std::sync::atomic::Ordering::Relaxed),
        4
    );
    assert_eq!(
        b.stats()
            .recvs_completed
            .load(std::sync::atomic::Ordering::Relaxed),
        4
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_in_flight_arrive_intact() {
    const MESSAGES: u64 = 48;
    let (a, ab, b, _ba) = pair().await;
    let mut receivers = Vec::new();
    for _ in 0..MESSAGES {
        let b = b.clone();
        // Any sequence number: arrival order is UCX's. Each receiver checks and drops
        // its message, giving its slot back (there are fewer slots than messages).
        receivers.push(tokio::spawn(async move {
            let got = b.recv(TAG_REQUEST, KIND_MASK, None).await?;
            let seq = got.sender_tag() & !KIND_MASK;
            assert!(seq < MESSAGES, "tag {seq} was not sent");
            check_message(got.bytes(), seq);
            Ok::<u64, UcxError>(seq)
        }));
    }
    let mut senders = Vec::new();
    for seq in 0..MESSAGES {
        let ab = ab.clone();
        senders.push(tokio::spawn(async move {
            ab.send(TAG_REQUEST | seq, header(seq), payload(seq)).await
        }));
    }
    let mut seen = vec![false; MESSAGES as usize];
    tokio::time::timeout(WAIT, async {
        for s in senders {
            s.await.expect("send task").expect("send");
        }
        for r in receivers {
            let seq = r.await.expect("recv task").expect("recv");
            assert!(!seen[seq as usize], "message {seq} arrived twice");
            seen[seq as usize] = true;
        }
    })
    .await
    .expect("all messages within the bound");
    assert!(seen.iter().all(|s| *s));
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_goes_away_fails_its_requests() {
    let (a, ab, b, ba) = connected_pair().await;

    // a waits for a reply from b that will never come; then b goes away.
    let pending = tokio::spawn({
        let a = a.clone();
        let ab = ab.clone();
        async move { a.recv(TAG_REPLY, u64::MAX, Some(&ab)).await }
    });
    drop(ba);
    b.shutdown().await;
    let result = tokio::time::timeout(WAIT, pending)
        .await
        .expect("the pending receive ends, no hang")
        .expect("recv task");
    match result {
        Err(UcxError::PeerLost { endpoint, .. }) => assert_eq!(endpoint, ab.id()),
        other => panic!("expected PeerLost, got {other:?}"),
    }
    let send = tokio::time::timeout(WAIT, ab.send(TAG_REQUEST, header(1), payload(1)))
        .await
        .expect("a send to a lost peer ends, no hang");
    assert!(
        matches!(send, Err(UcxError::PeerLost { .. })),
        "send to a lost peer: {send:?}"
    );
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_larger_than_the_slot_fails_its_receive() {
    check_env();
    let small = UcxWorkerConfig {
        recv_slot_bytes: 4096,
        ..config()
    };
    let a = Worker::start(&config()).expect("worker a");
    let b = Worker::start(&small).expect("worker b");
    let ab = a.connect(b.address()).await.expect("connect");
    let recv = b.recv(TAG_REQUEST, u64::MAX, None);
    let send = ab.send(TAG_REQUEST, header(0), Bytes::from(vec![7u8; 8192]));
    let (got, _sent) = tokio::time::timeout(WAIT, async { tokio::join!(recv, send) })
        .await
        .expect("within the bound");
    match got {
        Err(UcxError::MessageTooLarge { slot_bytes }) => assert_eq!(slot_bytes, 4096),
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// Receives into buffers of each message's own length: messages arrive intact, with
/// their sender's tag; one longer than the bound is dropped with `MessageTooLarge` and
/// the next one still arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_receives_get_whole_messages_and_bound_their_length() {
    let (a, ab, b, _ba) = pair().await;
    // The send starts first (a rendezvous send completes only once it is received).
    let early = tokio::spawn({
        let ab = ab.clone();
        async move { ab.send(TAG_REQUEST | 7, header(1), payload(1)).await }
    });
    let (got, tag) = within(b.recv_owned(TAG_REQUEST, KIND_MASK, None, 4 << 20))
        .await
        .expect("receive");
    within(early).await.expect("task").expect("send");
    assert_eq!(tag, TAG_REQUEST | 7);
    check_message(&got, 1);
    // Received while it is sent.
    let (got, sent) = tokio::join!(
        within(b.recv_owned(TAG_REQUEST, u64::MAX, None, 4 << 20)),
        within(ab.send(TAG_REQUEST, header(2), payload(2)))
    );
    sent.expect("send");
    check_message(&got.expect("receive").0, 2);
    // Too long for the bound, then one that fits.
    let (got, sent) = tokio::join!(
        within(b.recv_owned(TAG_REQUEST, u64::MAX, None, 4096)),
        within(ab.send(TAG_REQUEST, header(3), payload(3)))
    );
    sent.expect("send");
    match got {
        Err(UcxError::MessageTooLarge { slot_bytes }) => assert_eq!(slot_bytes, 4096),
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }
    let (got, sent) = tokio::join!(
        within(b.recv_owned(TAG_REQUEST, u64::MAX, None, 4 << 20)),
        within(ab.send(TAG_REQUEST, header(4), payload(4)))
    );
    sent.expect("send");
    check_message(&got.expect("receive").0, 4);
    a.shutdown().await;
    b.shutdown().await;
}

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .expect("within the bound")
}

/// CPU time (user + system, clock ticks) of one thread of this process.
fn thread_cpu_ticks(tid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).expect("stat");
    // Fields after the command name (which may hold spaces) start with the state.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields[11].parse().expect("utime");
    let stime: u64 = fields[12].parse().expect("stime");
    utime + stime
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_sleeps() {
    use std::sync::atomic::Ordering::Relaxed;
    let (a, _ab, b, _ba) = connected_pair().await;
    // A receive stays posted through the idle period: waiting is not spinning.
    let posted = tokio::spawn({
        let a = a.clone();
        async move { a.recv(TAG_REPLY, u64::MAX, None).await }
    });

    let tids = [
        a.os_thread_id().expect("tid a"),
        b.os_thread_id().expect("tid b"),
    ];
    let ticks_before: u64 = tids.iter().map(|t| thread_cpu_ticks(*t)).sum();
    let progress_before =
        a.stats().progress_calls.load(Relaxed) + b.stats().progress_calls.load(Relaxed);
    // The idle period is what is measured, not a stand-in for a condition.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ticks = tids.iter().map(|t| thread_cpu_ticks(*t)).sum::<u64>() - ticks_before;
    let progress = a.stats().progress_calls.load(Relaxed) + b.stats().progress_calls.load(Relaxed)
        - progress_before;
    // A spinning worker would use ~200 ticks per thread (2 s at 100 Hz) and millions of
    // progress calls; a sleeping one wakes for UCX's own timers at most a few times.
    assert!(ticks <= 10, "idle workers used {ticks} clock ticks in 2 s");
    assert!(
        progress <= 200,
        "idle workers progressed {progress} times in 2 s"
    );

    posted.abort();
    a.shutdown().await;
    b.shutdown().await;
}

#[test]
fn config_limits_are_checked() {
    assert!(UcxWorkerConfig::default().validate().is_ok());
    let zero = UcxWorkerConfig {
        recv_slots_count: 0,
        ..UcxWorkerConfig::default()
    };
    match zero.validate() {
        Err(UcxError::Config { field, .. }) => assert_eq!(field, "recv_slots_count"),
        other => panic!("expected a config error, got {other:?}"),
    }
    let huge = UcxWorkerConfig {
        recv_slot_bytes: 1 << 30,
        recv_slots_count: 8,
        ..UcxWorkerConfig::default()
    };
    assert!(matches!(huge.validate(), Err(UcxError::Config { .. })));
}

const MISSING_LIBRARY: &str = "/nonexistent/libucp.so.0";

/// The error names the path, the loader's reason and how to install UCX.
fn check_missing_library_message(message: &str) {
    for part in [
        MISSING_LIBRARY,
        "No such file or directory",
        "libucx0",
        "scripts/install-ucx.sh",
    ] {
        assert!(message.contains(part), "{part:?} not in {message:?}");
    }
}

#[test]
fn a_missing_library_is_named_with_how_to_install_it() {
    let err = match spillway_ucx_sys::load_from(MISSING_LIBRARY) {
        Ok(_) => panic!("{MISSING_LIBRARY} loaded"),
        Err(e) => e,
    };
    match &err {
        spillway_ucx_sys::LoadError::NotFound {
            tried,
            from_env,
            dlopen,
        } => {
            assert_eq!(tried, &[MISSING_LIBRARY.to_string()]);
            assert!(!from_env);
            assert_eq!(dlopen.len(), 1);
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    check_missing_library_message(&err.to_string());
    // What Worker::start returns says the same.
    let ucx = UcxError::Library { source: err };
    check_missing_library_message(&ucx.to_string());
}

#[test]
fn a_library_that_is_not_ucx_names_the_missing_function() {
    // glibc is loaded in every test process and has none of UCX's functions.
    let err = match spillway_ucx_sys::load_from("libc.so.6") {
        Ok(_) => panic!("libc.so.6 passed for libucp"),
        Err(e) => e,
    };
    match &err {
        spillway_ucx_sys::LoadError::MissingFunction { library, dlsym } => {
            assert_eq!(library, "libc.so.6");
            assert!(dlsym.contains("undefined symbol"), "{dlsym}");
        }
        other => panic!("expected MissingFunction, got {other:?}"),
    }
}

/// Marks the child process of [`worker_start_without_the_library_fails_clearly`].
const CHILD_ENV: &str = "SPILLWAY_TEST_UCX_WITHOUT_LIBRARY";

/// `SPILLWAY_UCX_LIB` is read once per process, so the worker start runs in a child: this
/// test binary again, running only the ignored test below with the variable set.
#[test]
fn worker_start_without_the_library_fails_clearly() {
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            "worker_start_without_the_library_child",
            "--ignored",
            "--nocapture",
        ])
        .env(spillway_ucx_sys::LIBRARY_ENV, MISSING_LIBRARY)
        .env(CHILD_ENV, "1")
        .output()
        .expect("running the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "run by worker_start_without_the_library_fails_clearly, in a child process"]
fn worker_start_without_the_library_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let err = match Worker::start(&config()) {
        Ok(_) => panic!("a worker started with {MISSING_LIBRARY}"),
        Err(e) => e,
    };
    let message = err.to_string();
    assert!(
        matches!(err, UcxError::Library { .. }),
        "expected UcxError::Library, got {err:?}"
    );
    check_missing_library_message(&message);
    assert!(message.contains("SPILLWAY_UCX_LIB"), "{message}");
    // The error is kept: a second start fails the same way without trying again.
    match Worker::start(&config()) {
        Err(again) => assert_eq!(again.to_string(), message),
        Ok(_) => panic!("second start succeeded"),
    }
    println!("{message}");
}
