//! Buffer ranges: a contiguous reserved address range per buffer, in which a resident
//! page's physical chunk is mapped a second time at the page's place (`cuMemMap` of one
//! handle at two addresses), so a kernel sees the buffer's resident pages as one array.
//! Only when each frame is exactly one chunk (`page_bytes` a multiple of the
//! granularity). Used only when an acquired buffer's frames are not consecutive (see
//! `mapper`): `desired[i]` records where page `i` is, and pages are mapped when a view
//! needs them.
//!
//! Invariants: a buffer has at most one range; `mapped[i]` names the frame mapped at page
//! `i`, and only mapped pages are unmapped; every range is unmapped and freed on drop. By
//! the pool's contract no kernel or copy uses a range while its pages change.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use spillway_types::{BufferId, FrameId};

use super::context::Context;
use super::driver::{check, lock};
use crate::DeviceError;

/// A buffer's reserved range and which frame is mapped at each page.
pub(crate) struct BufferRange {
    pub(crate) base: sys::CUdeviceptr,
    pub(crate) mapped: Vec<Option<FrameId>>,
    /// The frame each page is in, as `map_page` last said (mapped lazily, or ahead by
    /// the map-ahead thread); `None` once the page left it (`unmap_page`).
    pub(crate) desired: Vec<Option<FrameId>>,
    /// Unmapped and freed (`release_range`): nothing may map into it any more (the
    /// map-ahead thread may still hold it).
    pub(crate) released: bool,
    /// Whether its pages are mapped ahead as they are recorded: until the pool says what
    /// it expects, set when a holder asks for the buffer as one array through this range
    /// (`acquire_ptr`); from then on only as the pool expects the next acquire to be
    /// whole or page by page (`Device::expect_view`). A buffer only ever read page by
    /// page (the SDK's paged acquires) is never mapped.
    pub(crate) map_ahead: bool,
    /// Whether the pool has said what it expects of this buffer (`expect_view`): a whole
    /// view then leaves `map_ahead` as the pool set it.
    pub(crate) pool_expects: bool,
}

impl BufferRange {
    /// A holder asked for the buffer as one array through this range: its pages are
    /// mapped ahead from now on, unless the pool has said what it expects.
    pub(crate) fn viewed_whole(&mut self) {
        if !self.pool_expects {
            self.map_ahead = true;
        }
    }

    /// The pool expects the buffer's next acquire to be `whole` or page by page: only
    /// the former's loads are mapped ahead, from now on whatever the views.
    pub(crate) fn expect_view(&mut self, whole: bool) {
        self.map_ahead = whole;
        self.pool_expects = true;
    }
}

/// One buffer's range, locked on its own: the map-ahead thread maps one buffer while
/// others record pages and show views.
pub(crate) type SharedRange = Arc<Mutex<BufferRange>>;

/// Every buffer's range; unmapped and freed on drop. Lock order: `map`, then a range's
/// own lock (never the other way round).
pub(crate) struct Ranges {
    pub(crate) ctx: Arc<Context>,
    pub(crate) page_bytes: u64,
    pub(crate) map: Mutex<HashMap<BufferId, SharedRange>>,
}

// SAFETY: device addresses (integers) behind a mutex.
unsafe impl Send for Ranges {}
// SAFETY: as above.
unsafe impl Sync for Ranges {}

impl Ranges {
    /// `buffer`'s range, if it has one.
    pub(crate) fn get(&self, buffer: BufferId) -> Option<SharedRange> {
        lock(&self.map).get(&buffer).cloned()
    }

    /// Unmaps page `index` of `range` if mapped. The context is current.
    pub(crate) fn unmap(&self, range: &mut BufferRange, index: usize) -> Result<(), DeviceError> {
        if range.mapped[index].take().is_some() {
            // SAFETY: exactly the page we mapped in `map_page`; by the pool's contract no
            // kernel or copy uses the buffer's range while its pages change.
            check("cuMemUnmap", unsafe {
                sys::cuMemUnmap(
                    range.base + index as u64 * self.page_bytes,
                    self.page_bytes as usize,
                )
            })?;
        }
        Ok(())
    }

    /// Unmaps every page of `range` and frees its addresses (once). The context is
    /// current.
    pub(crate) fn release(&self, range: &mut BufferRange) -> Result<(), DeviceError> {
        if range.released {
            return Ok(());
        }
        for i in 0..range.mapped.len() {
            self.unmap(range, i)?;
        }
        range.released = true;
        // SAFETY: the range we reserved, now with nothing mapped in it.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(
                range.base,
                (range.mapped.len() as u64 * self.page_bytes) as usize,
            )
        })
    }
}

impl Drop for Ranges {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        let ranges: Vec<SharedRange> = lock(&self.map).drain().map(|(_, r)| r).collect();
        for r in ranges {
            let _ = self.release(&mut lock(&r));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range() -> BufferRange {
        BufferRange {
            base: 0,
            mapped: Vec::new(),
            desired: Vec::new(),
            released: false,
            map_ahead: false,
            pool_expects: false,
        }
    }

    #[test]
    fn a_whole_view_maps_ahead_until_the_pool_says_what_it_expects() {
        let mut r = range();
        r.viewed_whole();
        assert!(r.map_ahead);
        // The pool expects the next acquire page by page: a whole view no longer turns
        // mapping ahead back on; only the pool does.
        r.expect_view(false);
        assert!(!r.map_ahead);
        r.viewed_whole();
        assert!(!r.map_ahead);
        r.expect_view(true);
        assert!(r.map_ahead);
    }
}
