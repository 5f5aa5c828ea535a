//! Spillway's workloads and benchmarks.
pub mod find_budget;
#[cfg(feature = "cuda")]
pub mod gpu_offload;
pub mod gpu_report;
pub mod offload;
pub mod plot;
pub mod remote;
mod remote_ucx;
pub mod repeats;
pub mod replay;
pub mod replay_compare;
pub mod report;
pub mod trace;
pub mod workload;
