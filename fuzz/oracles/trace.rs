//! Oracle of the trace parser (`spillway_bench::trace`), shared by the `trace` fuzz
//! target and the corpus replay test of spillway-bench (`tests/fuzz_corpus.rs`).
//!
//! Whatever the bytes, [`parse_trace`] returns `Ok` or a typed [`TraceError`] and never
//! panics (a panic is a fuzz crash). A trace it accepts must hold the invariants its
//! module doc promises: accesses not empty with steps that never decrease, sizes in
//! `1..=BUFFER_BYTES_MAX`, one size per buffer, `buffers` in first-seen order, `steps`
//! each step once and increasing, strings and `compute_us` within their limits; and the
//! per-step views ([`Trace::step_accesses`], [`Trace::accesses_by_step`]) cover every
//! access once.

use std::collections::HashMap;

use spillway_bench::trace::{
    ACCESSES_MAX, BUFFER_BYTES_MAX, BUFFER_NAME_BYTES_MAX, BUFFERS_MAX, COMPUTE_US_MAX,
    PHASE_BYTES_MAX, Trace, TraceError, parse_trace,
};

/// Runs every check on `data`; returns whether it parsed. Panics when an invariant above
/// does not hold.
pub fn check(data: &[u8]) -> bool {
    let parsed: Result<Trace, TraceError> = parse_trace(data);
    let Ok(trace) = parsed else {
        return false;
    };
    assert!(!trace.accesses.is_empty());
    assert!(trace.accesses.len() <= ACCESSES_MAX);
    assert!(trace.buffers.len() <= BUFFERS_MAX);
    let lines = data.split(|b| *b == b'\n').count() as u64;
    assert!(trace.accesses.len() as u64 + trace.markers_skipped <= lines);

    let mut first_seen: Vec<(&str, u64)> = Vec::new();
    let mut sizes: HashMap<&str, u64> = HashMap::new();
    for (i, a) in trace.accesses.iter().enumerate() {
        assert!(
            (1..=BUFFER_BYTES_MAX).contains(&a.bytes),
            "access {i}: {a:?}"
        );
        assert!(!a.buffer.is_empty() && a.buffer.len() <= BUFFER_NAME_BYTES_MAX);
        assert!(a.phase.len() <= PHASE_BYTES_MAX, "access {i}: {a:?}");
        if let Some(us) = a.compute_us {
            assert!(
                us.is_finite() && (0.0..=COMPUTE_US_MAX).contains(&us),
                "access {i} has compute_us {us}, outside 0..=COMPUTE_US_MAX"
            );
        }
        if i > 0 {
            assert!(trace.accesses[i - 1].step <= a.step, "steps went back");
        }
        match sizes.get(a.buffer.as_str()) {
            Some(bytes) => assert_eq!(*bytes, a.bytes, "buffer {} changed size", a.buffer),
            None => {
                sizes.insert(&a.buffer, a.bytes);
                first_seen.push((&a.buffer, a.bytes));
            }
        }
    }
    let buffers: Vec<(&str, u64)> = trace
        .buffers
        .iter()
        .map(|(name, bytes)| (name.as_str(), *bytes))
        .collect();
    assert_eq!(buffers, first_seen, "buffers are not the first-seen order");
    assert!(trace.steps.windows(2).all(|w| w[0] < w[1]));

    let mut covered = 0;
    for ((step, accesses), listed) in trace.accesses_by_step().zip(&trace.steps) {
        assert_eq!(step, *listed);
        assert_eq!(trace.step_accesses(step), accesses);
        assert!(!accesses.is_empty() && accesses.iter().all(|a| a.step == step));
        covered += accesses.len();
    }
    assert_eq!(covered, trace.accesses.len());
    assert_eq!(trace.accesses_by_step().count(), trace.steps.len());
    let total: u64 = trace.buffers.iter().map(|(_, b)| b).sum();
    assert_eq!(trace.buffer_bytes_total(), total);
    true
}
