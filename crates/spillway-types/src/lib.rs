//! Ids, limits and configuration types shared by every Spillway crate.
//!
//! This crate does no IO and reads no clock. It holds:
//! - the ids ([`BufferId`], [`PageId`], [`FrameId`], [`HostSlot`], [`TransferId`], [`NodeId`],
//!   [`PoolId`]), all `u64`/`u32` newtypes so they cannot be mixed up;
//! - [`PageSize`], a validated page size (a power of two from 64 KiB to 64 MiB);
//! - [`limits`]: every named bound of the pool, with what it costs;
//! - [`config`]: the pool's configuration in two layers (plain fields, then `validate()`);
//! - [`wire`]: the frames of the peer page service (fixed header, bincode bodies decoded
//!   with a size limit, raw page payloads with xxh3 checksums);
//! - [`local`]: the frames between a client and its node daemon over the Unix socket.

pub mod config;
pub mod limits;
pub mod local;
pub mod pattern;
pub mod size;
pub mod wire;

use std::fmt;

use serde::{Deserialize, Serialize};

/// Declares a type that crosses the wire: copied, ordered, hashable, serde and bincode.
macro_rules! wire_type {
    ($item:item) => {
        #[derive(
            Clone,
            Copy,
            Debug,
            PartialEq,
            Eq,
            Hash,
            PartialOrd,
            Ord,
            Serialize,
            Deserialize,
            bincode::Encode,
            bincode::Decode,
        )]
        $item
    };
}

/// A `u64` id that crosses the wire ([`wire_type!`]), shown as `$show`.
macro_rules! wire_id {
    ($(#[$doc:meta])* $name:ident, $show:literal) => {
        wire_type! {
            $(#[$doc])*
            pub struct $name(pub u64);
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, $show, self.0)
            }
        }
    };
}

wire_id!(
    /// One allocation of a client (a layer's weights, an activation, a KV block), unique in the pool.
    BufferId, "buffer#{}"
);

wire_type! {
    /// A page: the `index`-th page-sized piece of a buffer (the last one may be short).
    pub struct PageId {
        /// The buffer the page belongs to.
        pub buffer: BufferId,
        /// Index of the page inside its buffer, from 0.
        pub index: u32,
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/page{}", self.buffer, self.index)
    }
}

/// One page-sized piece of device memory in the GPU tier (a "physical page" of the budget).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FrameId(pub u32);

/// One page-sized slot of the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HostSlot(pub u32);

/// One page-sized piece of device memory lent to this GPU by a neighbouring GPU of the
/// same host (the peer-GPU tier), numbered from 0 within what was lent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PeerFrameId(pub u32);

/// One copy between tiers, unique for the life of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TransferId(pub u64);

wire_id!(
    /// One node daemon of the pool (one per machine), unique in the pool.
    NodeId, "node#{}"
);

wire_id!(
    /// One deployment (all nodes and clients that share a CA). Peers of another pool are
    /// refused even if their certificates were somehow accepted.
    PoolId, "pool#{:016x}"
);

/// Where a page lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tier {
    /// In the client's GPU tier.
    Gpu,
    /// In the host tier of the client's node.
    Host,
}

/// Direction of a copy between the GPU tier and the tier beside it: the host tier, or
/// (the peer-GPU tier) memory a neighbouring GPU lent. Each direction has its own stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Direction {
    /// Host to device: a page comes back to the GPU (a load or a prefetch).
    HostToDevice,
    /// Device to host: a dirty page leaves the GPU (an eviction).
    DeviceToHost,
    /// Peer GPU to device: a page comes back from the copy a neighbouring GPU keeps.
    PeerToDevice,
    /// Device to peer GPU: a clean page leaving the GPU leaves a copy on the neighbour.
    DeviceToPeer,
}

impl Direction {
    /// The direction's place in per-direction arrays (`0..4`).
    pub fn index(self) -> usize {
        match self {
            Direction::HostToDevice => 0,
            Direction::DeviceToHost => 1,
            Direction::PeerToDevice => 2,
            Direction::DeviceToPeer => 3,
        }
    }

    /// Whether the far side is the peer GPU's memory (else a host slot).
    pub fn is_peer(self) -> bool {
        matches!(self, Direction::PeerToDevice | Direction::DeviceToPeer)
    }

    /// Whether the bytes come into the GPU frame.
    pub fn into_frame(self) -> bool {
        matches!(self, Direction::HostToDevice | Direction::PeerToDevice)
    }
}

/// The side of a copy away from the GPU frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Far {
    /// A host slot (the host tier).
    Host(HostSlot),
    /// A frame lent by a neighbouring GPU (the peer-GPU tier).
    Peer(PeerFrameId),
}

/// One copy of (part of) a page between a GPU frame and the tier beside it: what the core
/// asks for (`spillway_core::PoolCore::poll_transfer`) is what the device takes
/// (`spillway_device::Device::submit`), one type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    /// Reported back in the completion.
    pub id: TransferId,
    /// Which way the bytes go; also picks the stream. Host directions go with
    /// [`Far::Host`], peer directions with [`Far::Peer`] (see [`CopyOp::far_matches`]).
    pub direction: Direction,
    /// The device side.
    pub frame: FrameId,
    /// The other side.
    pub far: Far,
    /// Bytes from the start of the page (at most the page size; a buffer's last page
    /// may be short).
    pub bytes: u64,
}

impl CopyOp {
    /// Whether the far side is of the kind the direction names.
    pub fn far_matches(&self) -> bool {
        matches!(
            (self.direction.is_peer(), self.far),
            (false, Far::Host(_)) | (true, Far::Peer(_))
        )
    }

    /// The host slot of a host-tier copy.
    pub fn slot(&self) -> Option<HostSlot> {
        match self.far {
            Far::Host(slot) => Some(slot),
            Far::Peer(_) => None,
        }
    }
}

/// A validated page size: a power of two from [`limits::PAGE_BYTES_MIN`] to [`limits::PAGE_BYTES_MAX`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u64")]
pub struct PageSize(u64);

/// A page size that is not a power of two in the allowed range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "page size {bytes} bytes is invalid: it must be a power of two from {min} to {max} bytes",
    min = limits::PAGE_BYTES_MIN,
    max = limits::PAGE_BYTES_MAX
)]
pub struct InvalidPageSize {
    /// The size that was asked for.
    pub bytes: u64,
}

impl PageSize {
    /// The default page size, 2 MiB (the CUDA virtual-memory granularity on current GPUs).
    pub const DEFAULT: PageSize = PageSize(limits::PAGE_BYTES_DEFAULT);

    /// Checks `bytes` and returns it as a page size.
    pub fn new(bytes: u64) -> Result<Self, InvalidPageSize> {
        if bytes.is_power_of_two()
            && (limits::PAGE_BYTES_MIN..=limits::PAGE_BYTES_MAX).contains(&bytes)
        {
            Ok(PageSize(bytes))
        } else {
            Err(InvalidPageSize { bytes })
        }
    }

    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }

    /// How many pages a buffer of `buffer_bytes` takes (the last page may be short).
    pub fn pages_for(self, buffer_bytes: u64) -> u64 {
        buffer_bytes.div_ceil(self.0)
    }

    /// How many whole pages fit in `budget_bytes`.
    pub fn pages_in(self, budget_bytes: u64) -> u64 {
        budget_bytes / self.0
    }
}

impl Default for PageSize {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl TryFrom<u64> for PageSize {
    type Error = InvalidPageSize;
    fn try_from(bytes: u64) -> Result<Self, Self::Error> {
        PageSize::new(bytes)
    }
}

impl From<PageSize> for u64 {
    fn from(p: PageSize) -> u64 {
        p.0
    }
}

/// Formats a byte count with a binary unit (`1.5 GiB`), for tables and errors.
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_show_their_kind() {
        assert_eq!(BufferId(7).to_string(), "buffer#7");
        let page = PageId {
            buffer: BufferId(7),
            index: 2,
        };
        assert_eq!(page.to_string(), "buffer#7/page2");
        assert_eq!(NodeId(3).to_string(), "node#3");
        assert_eq!(PoolId(255).to_string(), "pool#00000000000000ff");
    }

    #[test]
    fn page_size_accepts_powers_of_two_in_range() {
        assert_eq!(PageSize::new(64 << 10).unwrap().bytes(), 64 << 10);
        assert_eq!(PageSize::new(64 << 20).unwrap().bytes(), 64 << 20);
        assert_eq!(PageSize::default().bytes(), 2 << 20);
    }

    #[test]
    fn page_size_rejects_bad_values() {
        for bad in [0, 1, 32 << 10, 128 << 20, (2 << 20) + 1, 3 << 20] {
            assert_eq!(
                PageSize::new(bad),
                Err(InvalidPageSize { bytes: bad }),
                "{bad}"
            );
        }
    }

    #[test]
    fn page_arithmetic() {
        let p = PageSize::new(1 << 20).unwrap();
        assert_eq!(p.pages_for(0), 0);
        assert_eq!(p.pages_for(1), 1);
        assert_eq!(p.pages_for(1 << 20), 1);
        assert_eq!(p.pages_for((1 << 20) + 1), 2);
        assert_eq!(p.pages_in((3 << 20) - 1), 2);
    }

    #[test]
    fn bytes_are_formatted_with_binary_units() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(3 << 20), "3.0 MiB");
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
    }
}
