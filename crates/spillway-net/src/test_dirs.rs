//! Scratch directories for the crate's unit tests.

use std::path::PathBuf;

/// A fresh path under the system's temporary directory, named for the module and test
/// (`spillway-{module}-{name}-{pid}-{nanos}`), removed first if it exists. The test
/// creates and removes it.
pub(crate) fn temp_dir(module: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "spillway-{module}-{name}-{}-{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("the clock is after 1970")
            .as_nanos()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
