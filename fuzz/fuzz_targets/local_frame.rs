//! Fuzz target `local_frame`: every input goes through [`oracle::check`], the same function
//! the workspace's corpus replay test runs (see ../README.md).
#![no_main]

#[path = "../oracles/local_frame.rs"]
mod oracle;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    oracle::check(data);
});
