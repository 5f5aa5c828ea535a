//! Spillway's workloads and benchmarks.
