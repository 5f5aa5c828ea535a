//! The peer-GPU tier in the embedded pool: one pool lends GPU memory beyond its own
//! budget ([`crate::PoolBuilder::lendable_gpu_bytes`], [`Pool::lend`]), another borrows it
//! ([`Pool::borrow`]) and keeps clean copies of its evicted pages there (the core's
//! `peer.rs`). The lender takes frames back through the lease
//! ([`PeerLease::ask_back`], then [`PeerLease::wait_given_back`]): the borrower's pool
//! is woken at once, drops its copies above the new count, and gives the frames back as
//! soon as the copies in flight on them land.
//!
//! Built on the sim device (two simulated GPUs of one host); the CUDA backend neither
//! lends nor borrows yet (a machine with two GPUs is needed to build and measure it).

use std::sync::{Arc, Weak};

use spillway_device::sim::{PeerLease, SimDevice};

use crate::pool::{Pool, PoolError, Shared, State};

/// Why GPU memory cannot be lent or borrowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// The lender's device was built with no memory beyond its budget to lend.
    #[error(
        "this pool has no GPU memory to lend: build it with `lendable_gpu_bytes` (memory beyond its own GPU budget)"
    )]
    NothingToLend,
    /// The backend cannot lend or borrow GPU memory.
    #[error("the {backend} device cannot lend or borrow GPU memory yet (the sim device can)")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
    },
}

impl Pool {
    /// Lends `frames` page-sized frames of this pool's lendable GPU memory (all of it at
    /// most) to a neighbour, which borrows them with [`Pool::borrow`]. The lender keeps
    /// the lease to take frames back.
    pub fn lend(&self, frames: u32) -> Result<PeerLease, PoolError> {
        let device = self.shared.device();
        let sim = sim_of(device.as_ref())?;
        if sim.lendable_frames() == 0 {
            return Err(PeerError::NothingToLend.into());
        }
        Ok(sim.lease(frames))
    }

    /// Borrows the frames of `lease` (made by another pool's [`Pool::lend`]) as this
    /// pool's peer-GPU tier: from now on clean pages leaving the GPU leave a copy there,
    /// and load from it. Once per pool.
    pub fn borrow(&self, lease: PeerLease) -> Result<(), PoolError> {
        let device = self.shared.device();
        sim_of(device.as_ref())?.attach_peer(lease.clone())?;
        self.shared
            .borrowing
            .store(true, std::sync::atomic::Ordering::Release);
        let weak: Weak<Shared> = Arc::downgrade(&self.shared);
        lease.set_waker(Arc::new(move || {
            if let Some(shared) = weak.upgrade() {
                let mut state = shared.lock_on_device_thread();
                shared.drive(&mut state);
                drop(state);
                // Acquires waiting for frames may go on.
                shared.cond.notify_all();
            }
        }));
        let mut state = self.shared.lock();
        self.shared.drive(&mut state);
        Ok(())
    }
}

impl Shared {
    /// Keeps the core's peer frames in step with what the device is lent: a count asked
    /// back is passed on (the core drops the copies above it), frames lent anew are
    /// used, and frames the core no longer uses are given back. Called at the start of
    /// every `drive` of a borrowing pool, under the lock.
    pub(crate) fn peer_handshake(&self, state: &mut State) {
        let device = self.device();
        let lent = device.peer_frames();
        let want = device.peer_asked_back().unwrap_or(lent).min(lent);
        if want != state.core.peer_frames() {
            let now = self.now();
            state.core.set_peer_frames(want, now);
        }
        if let Some(frames) = state.core.poll_peer_returned() {
            device.peer_give_back(frames);
        }
    }
}

/// The sim device behind `device`, or why this backend cannot lend or borrow.
fn sim_of(device: &dyn spillway_device::Device) -> Result<&SimDevice, PoolError> {
    device.as_any().downcast_ref::<SimDevice>().ok_or_else(|| {
        PeerError::Unsupported {
            backend: device.kind().name(),
        }
        .into()
    })
}
