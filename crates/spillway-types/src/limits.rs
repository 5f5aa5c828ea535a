//! Every named bound of the pool, with the worst-case cost it implies.
//!
//! A bound that a user can change lives in [`crate::config`] with its default here; a bound
//! that protects the implementation itself is a constant here.

/// Smallest page size: 64 KiB. Smaller pages make per-page bookkeeping and per-copy
/// overhead dominate (a PCIe copy of 64 KiB already runs at a fraction of peak bandwidth).
pub const PAGE_BYTES_MIN: u64 = 64 << 10;
/// Largest page size: 64 MiB. Larger pages waste GPU memory on partly used pages.
pub const PAGE_BYTES_MAX: u64 = 64 << 20;
/// Default page size: 2 MiB, the CUDA virtual-memory granularity of current GPUs.
pub const PAGE_BYTES_DEFAULT: u64 = 2 << 20;

/// Most pages one buffer may have: 2^24 (32 TiB at 2 MiB). Page indices are `u32`.
pub const PAGES_PER_BUFFER_MAX: u64 = 1 << 24;
/// Most live buffers in one pool: each costs about 100 bytes of bookkeeping plus
/// 40 bytes per page, so 2^20 buffers is about 100 MiB of metadata at most.
pub const BUFFERS_MAX: usize = 1 << 20;
/// Most frames (GPU pages) or host slots one pool manages: 2^24 (32 TiB at 2 MiB).
pub const SLOTS_MAX: u64 = 1 << 24;

/// Default bytes of host-to-device copies in flight: 64 MiB. Copies in flight use no
/// memory of their own (they move frame to slot); the bound keeps a demand load from
/// queueing behind too many prefetches.
pub const H2D_BYTES_IN_FLIGHT_DEFAULT: u64 = 64 << 20;
/// Default bytes of device-to-host copies (evictions) in flight: 64 MiB.
pub const D2H_BYTES_IN_FLIGHT_DEFAULT: u64 = 64 << 20;

/// Default bound on bytes moving between the host tier and the remote tier at once (each
/// way): enough 2 MiB pages in flight to keep a loopback or 25 Gb/s link busy.
pub const REMOTE_BYTES_IN_FLIGHT_DEFAULT: u64 = 64 << 20;
/// Remote pages kept free of the pool's pages when a remote tier is used: a page coming
/// back and a page leaving can then always swap places, so the tiers never deadlock full.
pub const REMOTE_HEADROOM_PAGES: u64 = 1;

/// Default number of upcoming accesses the prefetcher looks at: 4096. Planning costs
/// O(this) per access and per completed copy.
pub const LOOKAHEAD_ACCESSES_DEFAULT: usize = 4096;
/// Largest allowed lookahead: 2^20 accesses (about 24 MiB of planning state).
pub const LOOKAHEAD_ACCESSES_MAX: usize = 1 << 20;
/// Default number of earlier steps whose traces the predictor keeps: 4.
pub const HISTORY_STEPS_DEFAULT: usize = 4;
/// Most earlier steps the predictor keeps: 64.
pub const HISTORY_STEPS_MAX: usize = 64;
/// Most accesses recorded for one step: 2^22 (a trace of 4M accesses, 32 MiB). Past it the
/// step is cut as if `step()` had been called, so a job that never marks steps and has no
/// period cannot grow the trace without bound.
pub const TRACE_ACCESSES_PER_STEP_MAX: usize = 1 << 22;
