//! Fuzz target `trace`: every input goes through [`oracle::check`], the same function
//! the workspace's corpus replay test runs (see ../README.md).
#![no_main]

#[path = "../oracles/trace.rs"]
mod oracle;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    oracle::check(data);
});
