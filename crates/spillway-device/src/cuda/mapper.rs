//! Views of acquired buffers: where a kernel sees a buffer as one array.
//!
//! Issue 12 measured the old design on the H200: every page loaded into another frame
//! was remapped into its buffer's range (`cuMemUnmap` + `cuMemMap` + `cuMemSetAccess`)
//! on one mapper thread, ~70 us per page, ~2,900 pages and ~0.21 s per step at 2 MiB
//! pages, and an acquire waited for that thread: the step took 2x its copy floor. Now:
//!
//! - **In place** (the common case, no driver call): the frames are one contiguous
//!   address range (`Frames::contiguous`) and the pool puts a buffer's pages in
//!   consecutive frames (extents), so an acquire whose frames are consecutive is shown at
//!   its first frame's address.
//! - **Mapped** (fragmented frames): `map_page` only records which frame a page is in
//!   (`BufferRange::desired`); the view maps the pages whose mapping differs, on the
//!   acquiring thread, and sets access once over the span they cover, not per page.
//!
//! Invariants: a page's mapping changes only while its buffer is acquired by the caller
//! asking for the view or by none (the pool's contract: a frame changes page only when
//! no acquire holds it), so no kernel reads a range while it changes; a page already
//! mapped to its frame costs nothing; the ranges' lock is held while mapping one buffer.

use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::sys;
use spillway_types::{BufferId, FrameId};

use super::driver::{check, lock};
use super::frames::access_desc;
use super::ranges::{BufferRange, Ranges};
use crate::{DeviceError, DeviceTimings};

/// Counters of the views (the mapping part of [`DeviceTimings`]).
#[derive(Default)]
pub(crate) struct ViewStats {
    pub(crate) counts: Mutex<DeviceTimings>,
}

impl ViewStats {
    pub(crate) fn in_place(&self) {
        lock(&self.counts).views_in_place += 1;
    }

    /// An acquire shown through its buffer's range (whatever it had to map first).
    pub(crate) fn through_range(&self) {
        lock(&self.counts).views_mapped += 1;
    }

    fn mapped(&self, pages: u64, seconds: f64) {
        let mut c = lock(&self.counts);
        c.pages_remapped += pages;
        c.mapping_s += seconds;
    }
}

/// Whether `frames` are consecutive ids (a buffer's pages in one extent).
pub(crate) fn consecutive(frames: &[FrameId]) -> bool {
    frames
        .windows(2)
        .all(|w| w[0].0.checked_add(1) == Some(w[1].0))
}

/// Maps `frame` at page `i` of `range` (not released), unmapping what was there; access
/// is the caller's to set. The context is current.
fn map_at(
    ranges: &Ranges,
    range: &mut BufferRange,
    i: usize,
    frame: FrameId,
    handles: &[sys::CUmemGenericAllocationHandle],
) -> Result<(), DeviceError> {
    ranges.unmap(range, i)?;
    let page = ranges.page_bytes;
    let va = range.base + i as u64 * page;
    // SAFETY: `va..va+page` lies in the buffer's reserved range and is unmapped (just
    // above); the handle is a live chunk of exactly `page` bytes (remappable frames).
    check("cuMemMap", unsafe {
        sys::cuMemMap(va, page as usize, 0, handles[frame.0 as usize], 0)
    })?;
    range.mapped[i] = Some(frame);
    Ok(())
}

/// Maps every page of `range` whose desired frame differs from its mapped one, then sets
/// access once over the span of pages changed. The context is current; the caller holds
/// the ranges' lock. Returns the pages mapped.
pub(crate) fn apply(
    ranges: &Ranges,
    range: &mut BufferRange,
    handles: &[sys::CUmemGenericAllocationHandle],
    device: sys::CUdevice,
    stats: &ViewStats,
) -> Result<u64, DeviceError> {
    if range.released {
        return Ok(0);
    }
    let started = Instant::now();
    let page = ranges.page_bytes;
    let (mut lo, mut hi) = (usize::MAX, 0usize);
    let mut pages = 0u64;
    let mut result = Ok(());
    for i in 0..range.mapped.len() {
        let Some(frame) = range.desired[i] else {
            continue;
        };
        if range.mapped[i] == Some(frame) {
            continue;
        }
        if let Err(e) = map_at(ranges, range, i, frame, handles) {
            result = Err(e);
            break;
        }
        lo = lo.min(i);
        hi = hi.max(i);
        pages += 1;
    }
    if pages > 0 {
        // Every page of `lo..=hi` is mapped: the changed ones just now, and the others
        // because they are desired (a whole view maps its whole buffer) or mapped before.
        let all_mapped = range.mapped[lo..=hi].iter().all(Option::is_some);
        let desc = access_desc(device);
        let access = if all_mapped {
            let (va, len) = (range.base + lo as u64 * page, (hi - lo + 1) as u64 * page);
            // SAFETY: the whole span is mapped (checked above).
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(va, len as usize, &desc, 1)
            })
        } else {
            // Holes in the span: set access on each mapped run.
            let mut r = Ok(());
            let mut i = lo;
            while i <= hi && r.is_ok() {
                if range.mapped[i].is_none() {
                    i += 1;
                    continue;
                }
                let start = i;
                while i <= hi && range.mapped[i].is_some() {
                    i += 1;
                }
                // SAFETY: pages `start..i` are mapped.
                r = check("cuMemSetAccess", unsafe {
                    sys::cuMemSetAccess(
                        range.base + start as u64 * page,
                        ((i - start) as u64 * page) as usize,
                        &desc,
                        1,
                    )
                });
            }
            r
        };
        if let Err(e) = access {
            // Leave nothing half-done: unmap what has no access, so it is mapped again.
            for i in lo..=hi {
                let _ = ranges.unmap(range, i);
            }
            result = result.and(Err(e));
        }
        stats.mapped(pages, started.elapsed().as_secs_f64());
    }
    result.map(|()| pages)
}

/// Records that page `index` of `buffer` is in `frame` (mapped when a view needs it, or
/// ahead). Returns whether to map the buffer ahead: its next view is expected whole
/// (`BufferRange::map_ahead`) and the frame breaks its extent (a neighbouring page is
/// recorded in a frame that is not the one beside `frame`, so the next whole view will
/// go through its range).
pub(crate) fn record(
    ranges: &Ranges,
    buffer: BufferId,
    index: u32,
    frame: FrameId,
) -> Result<bool, DeviceError> {
    let shared = ranges.get(buffer).ok_or_else(|| DeviceError::Driver {
        op: "map_page",
        message: format!("{buffer} has no reserved range"),
    })?;
    let mut range = lock(&shared);
    let pages = range.desired.len();
    let i = index as usize;
    let slot = range
        .desired
        .get_mut(i)
        .ok_or_else(|| DeviceError::Driver {
            op: "map_page",
            message: format!("page {index} is outside {buffer}'s range of {pages} pages"),
        })?;
    *slot = Some(frame);
    let before = i
        .checked_sub(1)
        .and_then(|j| range.desired[j])
        .is_some_and(|p| p.0.checked_add(1) != Some(frame.0));
    let after = range
        .desired
        .get(i + 1)
        .copied()
        .flatten()
        .is_some_and(|n| frame.0.checked_add(1) != Some(n.0));
    Ok(range.map_ahead && (before || after))
}

/// Records that page `index` of `buffer` left its frame: nothing maps it ahead to a
/// frame that another page now holds. The mapping itself stays (lazy: never read until
/// the page is recorded again).
pub(crate) fn forget(ranges: &Ranges, buffer: BufferId, index: u32) {
    if let Some(shared) = ranges.get(buffer)
        && let Some(slot) = lock(&shared).desired.get_mut(index as usize)
    {
        *slot = None;
    }
}

/// Maps the first page at or after `from` of `range` whose recorded frame is not the
/// one mapped, and sets access on it: the map-ahead thread's step (one page at a time,
/// so that the range's lock is held briefly). The context is current. Returns the page
/// mapped, `None` when none needs it.
pub(crate) fn map_one_ahead(
    ranges: &Ranges,
    range: &mut BufferRange,
    from: usize,
    handles: &[sys::CUmemGenericAllocationHandle],
    device: sys::CUdevice,
) -> Result<Option<usize>, DeviceError> {
    if range.released {
        return Ok(None);
    }
    let Some(i) = (from..range.desired.len())
        .find(|&i| range.desired[i].is_some() && range.desired[i] != range.mapped[i])
    else {
        return Ok(None);
    };
    let frame = range.desired[i].expect("found above");
    // By the pool's contract no kernel uses the page's range now: a page is recorded in
    // a new frame only while its buffer is held by nobody.
    map_at(ranges, range, i, frame, handles)?;
    let page = ranges.page_bytes;
    let va = range.base + i as u64 * page;
    let desc = access_desc(device);
    // SAFETY: the page was just mapped.
    if let Err(e) = check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(va, page as usize, &desc, 1)
    }) {
        let _ = ranges.unmap(range, i);
        return Err(e);
    }
    Ok(Some(i))
}
