//! Replays the corpus of the `trace` fuzz target (`fuzz/corpus/trace/`) through the
//! oracle the fuzz target runs (`fuzz/oracles/trace.rs`): every input parses to a trace
//! that keeps the invariants of `spillway_bench::trace` or to a typed error, never a
//! panic. See fuzz/README.md.

use std::path::Path;

#[path = "../../fuzz/oracles/replay.rs"]
mod replay;
#[path = "../../fuzz/oracles/trace.rs"]
mod trace;

#[test]
fn trace_corpus_parses_or_errs_and_keeps_its_invariants() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let replayed = replay::replay(root, "trace", trace::check);
    assert!(replayed.accepted > 0, "{replayed:?}");
    assert!(replayed.accepted < replayed.files, "{replayed:?}");
}
