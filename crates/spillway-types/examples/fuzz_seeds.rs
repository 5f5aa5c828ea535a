//! Writes the seeds of the `wire_frame` and `local_frame` fuzz targets
//! (`fuzz/oracles/seeds.rs`: one frame of every kind of each protocol, from the real
//! encoders) into `<DIR>/wire_frame/` and `<DIR>/local_frame/`:
//!
//! ```sh
//! cargo run --release -p spillway-types --example fuzz_seeds -- fuzz/corpus
//! ```

use std::path::{Path, PathBuf};

#[path = "../../../fuzz/oracles/seeds.rs"]
mod seeds;

fn write(dir: &Path, name: &str, data: &[u8]) {
    std::fs::create_dir_all(dir).expect("create the corpus directory");
    let path = dir.join(format!("seed-{name}"));
    std::fs::write(&path, data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

fn main() {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .expect("usage: fuzz_seeds <corpus dir, e.g. fuzz/corpus>"),
    );
    let wire = seeds::wire_frames();
    let local = seeds::local_frames();
    for (target, frames) in [("wire_frame", &wire), ("local_frame", &local)] {
        for (name, frame) in frames {
            write(&dir.join(target), name, frame);
        }
    }
    println!(
        "{} wire_frame and {} local_frame seeds in {}",
        wire.len(),
        local.len(),
        dir.display()
    );
}
