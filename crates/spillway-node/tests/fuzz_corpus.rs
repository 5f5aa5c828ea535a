//! Replays the corpus of the `node_config` fuzz target (`fuzz/corpus/node_config/`)
//! through the oracle the fuzz target runs (`fuzz/oracles/node_config.rs`): every input
//! parses to a valid config or a typed error, never a panic, and an accepted config
//! survives being written back as TOML. See fuzz/README.md.

use std::path::Path;

#[path = "../../../fuzz/oracles/node_config.rs"]
mod node_config;
#[path = "../../../fuzz/oracles/replay.rs"]
mod replay;

#[test]
fn node_config_corpus_parses_or_errs_and_round_trips() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let replayed = replay::replay(root, "node_config", node_config::check);
    assert!(replayed.accepted > 0, "{replayed:?}");
    assert!(replayed.accepted < replayed.files, "{replayed:?}");
}
