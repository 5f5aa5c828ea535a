//! Oracle of the node config parser (`spillway_node::config`), shared by the
//! `node_config` fuzz target and the corpus replay test of spillway-node
//! (`tests/fuzz_corpus.rs`).
//!
//! Whatever the bytes, [`NodeConfig::parse`] returns `Ok` or a typed [`NodeConfigError`]
//! and never panics (a panic is a fuzz crash). A config it accepts must hold:
//! - it passes [`NodeConfig::validate`] (parsing validates; nothing is filled in after
//!   that could break a range);
//! - written back as TOML (what `spillway node --check`, `launch` and `cluster init`
//!   do), it parses again to the same config.

use std::path::Path;

use spillway_node::config::{NodeConfig, NodeConfigError};

/// Runs every check on `data` (as UTF-8; other bytes are not a TOML file and are
/// skipped); returns whether it parsed. Panics when a property above does not hold.
pub fn check(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let origin = Path::new("fuzz.toml");
    let parsed: Result<NodeConfig, NodeConfigError> = NodeConfig::parse(text, origin);
    let Ok(config) = parsed else {
        return false;
    };
    if let Err(e) = config.validate() {
        panic!("parse accepted a config that validate refuses: {e}\n{text}");
    }
    let written = toml::to_string(&config)
        .unwrap_or_else(|e| panic!("an accepted config does not serialize: {e}\n{text}"));
    let again = NodeConfig::parse(&written, origin).unwrap_or_else(|e| {
        panic!("a written config does not parse: {e}\nread:\n{text}\nwritten:\n{written}")
    });
    assert_eq!(
        again, config,
        "config changed on the way through TOML:\n{written}"
    );
    true
}
