//! Spillway's workloads and benchmarks.
pub mod trace;
