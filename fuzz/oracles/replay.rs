//! Replays a fuzz target's corpus (`fuzz/corpus/<target>/`) through its oracle, for the
//! workspace's `tests/fuzz_corpus.rs`: CI checks every input the fuzzer kept without
//! cargo-fuzz or a nightly feature.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

/// What a replay saw.
#[derive(Debug)]
pub struct Replayed {
    /// Inputs replayed.
    pub files: usize,
    /// Inputs the decoder accepted (the rest got a typed error).
    pub accepted: usize,
}

/// Runs `check` (an oracle's `check`) on every file of `fuzz/corpus/<target>/`, the
/// repository root being `root`. Panics, naming every input that made `check` panic.
pub fn replay(root: &Path, target: &str, check: fn(&[u8]) -> bool) -> Replayed {
    let dir = root.join("fuzz/corpus").join(target);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read corpus {}: {e}", dir.display()))
        .map(|entry| entry.expect("a corpus entry").path())
        .collect();
    paths.sort();
    let mut accepted = 0;
    let mut failed = Vec::new();
    for path in &paths {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        match catch_unwind(AssertUnwindSafe(|| check(&data))) {
            Ok(true) => accepted += 1,
            Ok(false) => {}
            Err(_) => failed.push(path.display().to_string()),
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} inputs of {target} broke the oracle (the panic of each is above): {failed:#?}",
        failed.len(),
        paths.len()
    );
    Replayed {
        files: paths.len(),
        accepted,
    }
}
