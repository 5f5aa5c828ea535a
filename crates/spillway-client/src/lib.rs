//! The Spillway SDK: a tiered memory pool for one process.
//!
//! [`Pool`] is the embedded pool: the GPU tier (a [`Device`]'s frames) and the host tier
//! (its host slots) of one process, driven by the sans-IO [`PoolCore`]. Build one with
//! [`PoolBuilder`], then:
//!
//! ```
//! use spillway_client::{DeviceChoice, PoolBuilder};
//! let pool = PoolBuilder::new()
//!     .gpu_budget_bytes(8 << 20)
//!     .host_budget_bytes(32 << 20)
//!     .device(DeviceChoice::Sim)
//!     .build()?;
//! let weights = pool.alloc("layer0.weight", 3 << 20)?;
//! pool.write(&weights, 0, &vec![7u8; 3 << 20])?;
//! {
//!     let guard = pool.acquire(&weights)?; // every page on the GPU now
//!     assert_eq!(guard.page(0)?[0], 7);
//! } // dropping the guard lets the pages be evicted again
//! pool.step(); // end of an iteration: the prefetcher learns per step
//! pool.free(&weights)?;
//! # Ok::<(), spillway_client::PoolError>(())
//! ```
//!
//! ## Threads and locks
//! One mutex guards the core. Device completions arrive on the device's copy threads,
//! which take the mutex, hand the completion to the core, start the copies that follow,
//! and wake waiting acquires through one condition variable. So copies keep flowing while
//! the caller computes, without a thread of the pool's own. Lock order: the pool's mutex,
//! then the device's internal queues; the device never calls back with a lock held.

mod builder;
pub mod daemon;
mod peer;
mod pool;
pub mod remote;
#[cfg(feature = "node")]
pub mod service_tier;
mod view_kinds;

pub use peer::PeerError;
pub use pool::{
    Buffer, DeviceChoice, Guard, Pool, PoolBuilder, PoolError, PoolStats, PoolTimings, make_device,
    make_device_in,
};
pub use remote::{
    RemoteCompletion, RemoteError, RemoteFactory, RemoteOp, RemoteOpKind, RemoteSetupError,
    RemoteSink, RemoteTier,
};
pub use spillway_core::{AccessMode, CoreError, CoreStats};
pub use spillway_device::sim::PeerLease;
pub use spillway_device::{Completion, CompletionSink, CopyOp, DeviceConfig};
pub use spillway_device::{Device, DeviceError, DeviceKind, DeviceTimings, HostMemory};
pub use spillway_types::config::{Policy, PoolConfig};
pub use spillway_types::{
    BufferId, Direction, Far, FrameId, HostSlot, PageId, PageSize, PeerFrameId, TransferId,
    fmt_bytes, pattern,
};
