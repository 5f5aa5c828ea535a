//! Sans-IO state machines of Spillway.
//!
//! Nothing here touches a socket, a thread, a device or the clock: time comes in as an
//! argument (`now`, a [`std::time::Duration`] since the pool began), and work goes out
//! through `poll_*` methods, in the shape of `quinn-proto`. The driver that does the IO
//! is `spillway-client`. Parts:
//! - [`pool`]: the page table, tier accounting with hard budgets, and transfer planning;
//! - [`eviction`]: the [`eviction::EvictionPolicy`] trait, CLOCK and next-use;
//! - [`predictor`]: the [`predictor::Predictor`] trait; the learned predictor learns each
//!   step's access order and predicts what comes next;
//! - [`retry`]: bounded backoff for operations the remote tier refuses.

pub mod error;
pub mod eviction;
mod idmap;
pub mod pool;
pub mod predictor;
pub mod retry;

pub use error::{CoreError, DeviceFault, RemoteError};
pub use pool::{
    AccessMode, AcquireId, CoreStats, MappingChange, PageLocation, PoolCore, RemoteOp,
    RemoteOpKind, ZeroFill,
};
pub use spillway_types::CopyOp;
