//! Spillway's workloads and benchmarks.
pub mod trace;
pub mod offload;
pub mod replay;
pub mod report;
pub mod workload;
