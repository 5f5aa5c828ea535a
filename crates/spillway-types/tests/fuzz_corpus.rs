//! Replays the corpora of the `wire_frame` and `local_frame` fuzz targets
//! (`fuzz/corpus/`) through the same oracles the fuzz targets run (`fuzz/oracles/`): every
//! input decodes to a message or a typed error, never a panic, and what is accepted
//! re-encodes to the same message. The seeds, one frame of every kind from today's
//! encoders, must all be accepted. See fuzz/README.md.
// Both frame oracles include `fuzz/oracles/frame_header.rs` as their own module (each
// fuzz target builds one oracle alone), so this binary, which runs both, loads it twice.
#![allow(clippy::duplicate_mod)]

use std::path::Path;

#[path = "../../../fuzz/oracles/local_frame.rs"]
mod local_frame;
#[path = "../../../fuzz/oracles/replay.rs"]
mod replay;
#[path = "../../../fuzz/oracles/seeds.rs"]
mod seeds;
#[path = "../../../fuzz/oracles/wire_frame.rs"]
mod wire_frame;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

#[test]
fn wire_frame_corpus_decodes_or_errs_and_round_trips() {
    let replayed = replay::replay(root(), "wire_frame", wire_frame::check);
    // The corpus reaches both sides of the decoder: frames it accepts and frames it refuses.
    assert!(replayed.accepted > 0, "{replayed:?}");
    assert!(replayed.accepted < replayed.files, "{replayed:?}");
}

#[test]
fn local_frame_corpus_decodes_or_errs_and_round_trips() {
    let replayed = replay::replay(root(), "local_frame", local_frame::check);
    assert!(replayed.accepted > 0, "{replayed:?}");
    assert!(replayed.accepted < replayed.files, "{replayed:?}");
}

#[test]
fn every_seed_of_todays_encoders_is_accepted() {
    let wire = seeds::wire_frames();
    assert_eq!(wire.len(), 16, "a seed per kind, and an empty put");
    for (name, frame) in &wire {
        assert!(wire_frame::check(frame), "wire seed {name} refused");
    }
    let local = seeds::local_frames();
    assert_eq!(local.len(), 8, "a seed per message of each direction");
    for (name, frame) in &local {
        assert!(local_frame::check(frame), "local seed {name} refused");
    }
}
