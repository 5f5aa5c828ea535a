//! Spillway's workloads and benchmarks.
#[cfg(feature = "cuda")]
pub mod gpu_offload;
pub mod offload;
pub mod remote;
mod remote_ucx;
pub mod replay;
pub mod report;
pub mod trace;
pub mod workload;
