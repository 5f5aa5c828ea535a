//! The page table: every live buffer's pages and where each page is in the GPU tier
//! ([`Gpu`]) and in the host and remote tiers ([`Host`]).
//!
//! The table answers questions about one page or buffer (is it live, may it be loaded,
//! fetched, spilled) and does not move anything itself: the facade moves pages by
//! changing their states here and in the rooms that own frames, slots and ops together.

use crate::idmap::IdMap;

use spillway_types::{BufferId, FrameId, HostSlot, PageId};

use super::peer::Peer;
use crate::error::CoreError;

/// Where a page is in the GPU tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gpu {
    Absent,
    /// A host→device copy is in flight.
    Loading {
        frame: FrameId,
        prefetch: bool,
    },
    Resident {
        frame: FrameId,
        dirty: bool,
        unused_prefetch: bool,
    },
    /// A device→host copy of the dirty page is in flight.
    Evicting {
        frame: FrameId,
    },
}

impl Gpu {
    /// The frame the page holds, if it holds one.
    pub(super) fn frame(self) -> Option<FrameId> {
        match self {
            Gpu::Loading { frame, .. } | Gpu::Resident { frame, .. } | Gpu::Evicting { frame } => {
                Some(frame)
            }
            Gpu::Absent => None,
        }
    }
}

/// Where a page is in the host and remote tiers (see the module docs of [`super`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Host {
    /// Never written: no slot, no remote copy; it reads as zeros.
    Zero,
    /// Only the remote tier holds it.
    Remote,
    /// Coming into `slot` from the remote tier.
    Fetching { slot: HostSlot },
    /// In `slot`; `clean` when the remote tier holds the same bytes.
    Slot { slot: HostSlot, clean: bool },
    /// Being copied from `slot` to the remote tier.
    Spilling { slot: HostSlot },
}

impl Host {
    /// The slot the page holds, if it holds one.
    pub(super) fn slot(self) -> Option<HostSlot> {
        match self {
            Host::Fetching { slot } | Host::Slot { slot, .. } | Host::Spilling { slot } => {
                Some(slot)
            }
            Host::Zero | Host::Remote => None,
        }
    }

    /// Whether the page must come into a slot before it can be loaded or read.
    pub(super) fn away(self) -> bool {
        matches!(self, Host::Zero | Host::Remote)
    }
}

/// One page's state.
#[derive(Debug)]
pub(super) struct Page {
    pub(super) host: Host,
    /// The remote tier holds bytes for this page (current or stale): it uses remote
    /// capacity until the buffer is freed or the space is given back.
    pub(super) remote_space: bool,
    pub(super) gpu: Gpu,
    /// Acquires holding the page.
    pub(super) pins: u32,
    /// Host reads and writes in progress.
    pub(super) host_pins: u32,
    /// Copies and remote ops in flight for the page.
    pub(super) in_flight: u8,
    /// The frame the page last lived in: loading it there again needs no remap of the
    /// buffer's device range.
    pub(super) last_frame: Option<FrameId>,
    /// The acquire that pins the page discards its contents
    /// ([`super::PoolCore::begin_acquire_discard`]): it gets a frame without a load.
    pub(super) overwrite: bool,
    /// The page is `Gpu::Resident` (clean, unpinned) in a frame taken ahead for an
    /// access predicted to overwrite it, and no bytes were copied: the frame's bytes are
    /// not the page's (its host or remote copy is). A discarding acquire uses the frame
    /// as it is; any other access gives it up and loads the page as usual.
    pub(super) reserved: bool,
    /// Its copy on the peer GPU (see `peer.rs`).
    pub(super) peer: Peer,
}

impl Page {
    /// A page of a new buffer: in `slot` (no remote tier), or `Zero` (a slot when needed).
    pub(super) fn new(slot: Option<HostSlot>) -> Page {
        Page {
            host: match slot {
                Some(slot) => Host::Slot { slot, clean: false },
                None => Host::Zero,
            },
            remote_space: false,
            gpu: Gpu::Absent,
            pins: 0,
            host_pins: 0,
            in_flight: 0,
            last_frame: None,
            overwrite: false,
            reserved: false,
            peer: Peer::Absent,
        }
    }

    /// Whether nothing holds or moves the page.
    pub(super) fn settled(&self) -> bool {
        self.pins == 0 && self.host_pins == 0 && self.in_flight == 0
    }

    /// Whether the page, off the GPU and in a slot, may leave the host tier now
    /// (`protected`: a host access waits for it).
    pub(super) fn spillable(&self, protected: bool) -> bool {
        matches!(self.host, Host::Slot { .. })
            && self.gpu == Gpu::Absent
            && self.settled()
            && !protected
    }

    /// Whether the page is on the GPU and its slot holds the same bytes as the remote
    /// tier: the slot can go without a copy (the page gets one again if it is written
    /// and evicted).
    pub(super) fn slot_redundant(&self, protected: bool) -> bool {
        matches!(self.gpu, Gpu::Resident { .. })
            && matches!(self.host, Host::Slot { clean: true, .. })
            && self.remote_space
            && self.host_pins == 0
            && self.in_flight == 0
            && !protected
    }

    /// Whether the page may leave the GPU now without help: resident, not held, not
    /// touched by the host; clean, or dirty with a slot to be written back to.
    pub(super) fn can_leave_gpu(&self) -> bool {
        let leaves = match self.gpu {
            Gpu::Resident { dirty: false, .. } => true,
            Gpu::Resident { dirty: true, .. } => matches!(self.host, Host::Slot { .. }),
            _ => false,
        };
        leaves && self.pins == 0 && self.host_pins == 0
    }
}

/// One buffer: its pages and who holds it.
#[derive(Debug)]
pub(super) struct Buffer {
    pub(super) bytes: u64,
    pub(super) pages: Vec<Page>,
    pub(super) shared_holders: u32,
    pub(super) exclusive: bool,
    pub(super) freed: bool,
    /// Why the buffer's contents are gone (a page could not be fetched back): acquires
    /// and host accesses of it fail with this; other buffers go on. It can still be freed.
    pub(super) lost: Option<CoreError>,
}

impl Buffer {
    /// Acquires holding the buffer.
    pub(super) fn holders(&self) -> u32 {
        self.shared_holders + u32::from(self.exclusive)
    }

    /// `Err` with why its contents are gone, if they are.
    pub(super) fn usable(&self) -> Result<(), CoreError> {
        match &self.lost {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

/// The page table: live buffers (and freed ones whose pages are still in flight).
#[derive(Debug)]
pub(super) struct PageTable {
    buffers: IdMap<BufferId, Buffer>,
    page_bytes: u64,
    /// The id the next buffer gets (ids below it were handed out).
    next_buffer: u64,
    /// Pages of the buffers in the table (an alloc checks room without visiting them).
    pages_committed: u64,
}

impl PageTable {
    pub(super) fn new(page_bytes: u64) -> PageTable {
        PageTable {
            buffers: IdMap::default(),
            page_bytes,
            next_buffer: 1,
            pages_committed: 0,
        }
    }

    /// Bytes of one page.
    pub(super) fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Bytes of page `index` of a buffer of `bytes` (the last page may be short).
    pub(super) fn page_len(&self, bytes: u64, index: u32) -> u64 {
        (bytes - u64::from(index) * self.page_bytes).min(self.page_bytes)
    }

    /// Bytes of page `pid`.
    pub(super) fn len_of(&self, pid: PageId) -> u64 {
        self.page_len(self.buffers[&pid.buffer].bytes, pid.index)
    }

    /// Number of buffers in the table (freed ones with copies in flight count).
    pub(super) fn len(&self) -> usize {
        self.buffers.len()
    }

    /// Adds a buffer of `bytes` with `pages`; returns its new id.
    pub(super) fn insert(&mut self, bytes: u64, pages: Vec<Page>) -> BufferId {
        let id = BufferId(self.next_buffer);
        self.next_buffer += 1;
        self.pages_committed += pages.len() as u64;
        self.buffers.insert(
            id,
            Buffer {
                bytes,
                pages,
                shared_holders: 0,
                exclusive: false,
                freed: false,
                lost: None,
            },
        );
        id
    }

    /// Removes a buffer (freed, nothing in flight) and returns it.
    pub(super) fn remove(&mut self, id: BufferId) -> Option<Buffer> {
        let b = self.buffers.remove(&id)?;
        self.pages_committed -= b.pages.len() as u64;
        Some(b)
    }

    pub(super) fn get(&self, id: BufferId) -> Option<&Buffer> {
        self.buffers.get(&id)
    }

    /// The buffer if it is live (allocated and not freed).
    pub(super) fn live_buffer(&self, id: BufferId) -> Option<&Buffer> {
        self.buffers.get(&id).filter(|b| !b.freed)
    }

    /// The buffer if it is live and not lost: one whose pages are worth staging (a lost
    /// buffer's slots hold no bytes of it).
    pub(super) fn plannable(&self, id: BufferId) -> Option<&Buffer> {
        self.live_buffer(id).filter(|b| b.lost.is_none())
    }

    /// The buffer of a page in the table.
    pub(super) fn buffer_mut(&mut self, id: BufferId) -> &mut Buffer {
        self.buffers.get_mut(&id).expect("buffer in the page table")
    }

    /// The live buffer `id`, or why there is none.
    pub(super) fn live(&self, id: BufferId) -> Result<&Buffer, CoreError> {
        match self.buffers.get(&id) {
            Some(b) if !b.freed => Ok(b),
            Some(_) => Err(CoreError::Freed(id)),
            None if id.0 > 0 && id.0 < self.next_buffer => Err(CoreError::Freed(id)),
            None => Err(CoreError::UnknownBuffer(id)),
        }
    }

    pub(super) fn page(&self, pid: PageId) -> &Page {
        &self.buffers[&pid.buffer].pages[pid.index as usize]
    }

    pub(super) fn page_mut(&mut self, pid: PageId) -> &mut Page {
        &mut self.buffer_mut(pid.buffer).pages[pid.index as usize]
    }

    /// Every buffer, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (BufferId, &Buffer)> {
        self.buffers.iter().map(|(&id, b)| (id, b))
    }

    /// Pages of buffers not yet given back (freed buffers with copies in flight count).
    pub(super) fn committed_pages(&self) -> u64 {
        self.pages_committed
    }

    /// Whether `pid`'s buffer is live and an acquire holds the page.
    pub(super) fn wanted(&self, pid: PageId) -> bool {
        self.live_buffer(pid.buffer)
            .is_some_and(|b| b.pages[pid.index as usize].pins > 0)
    }

    /// Whether `pid` still needs a load: its buffer is live, it is absent from the GPU,
    /// in a slot, and the host is not touching it.
    pub(super) fn needs_load(&self, pid: PageId) -> bool {
        self.live_buffer(pid.buffer).is_some_and(|b| {
            let p = &b.pages[pid.index as usize];
            p.gpu == Gpu::Absent && p.host_pins == 0 && matches!(p.host, Host::Slot { .. })
        })
    }

    /// Whether `pid` waits for a frame that an acquire discarding its contents will
    /// overwrite: no tier brings its bytes.
    pub(super) fn overwriting(&self, pid: PageId) -> bool {
        self.live_buffer(pid.buffer)
            .is_some_and(|b| b.pages[pid.index as usize].overwrite)
    }

    /// Whether `pid` (of a live buffer) holds a frame reserved for a predicted overwrite.
    pub(super) fn reserved(&self, pid: PageId) -> bool {
        self.live_buffer(pid.buffer)
            .is_some_and(|b| b.pages[pid.index as usize].reserved)
    }

    /// Whether `pid` must come into a slot (from the remote tier, or zero-filled) before
    /// it can be loaded or read: its buffer is live and it has no slot.
    pub(super) fn needs_fetch(&self, pid: PageId) -> bool {
        self.live_buffer(pid.buffer).is_some_and(|b| {
            let p = &b.pages[pid.index as usize];
            p.gpu == Gpu::Absent && p.host.away()
        })
    }

    /// Whether `pid` is moving between the host and the remote tier.
    pub(super) fn staging(&self, pid: PageId) -> bool {
        self.live_buffer(pid.buffer).is_some_and(|b| {
            matches!(
                b.pages[pid.index as usize].host,
                Host::Fetching { .. } | Host::Spilling { .. }
            )
        })
    }

    /// A page with remote space whose bytes are also in a slot and nothing moves: its
    /// remote space can be given to another page.
    pub(super) fn remote_space_donor(&self) -> Option<PageId> {
        self.buffers.iter().find_map(|(&buffer, b)| {
            b.pages.iter().enumerate().find_map(|(i, p)| {
                (p.remote_space && matches!(p.host, Host::Slot { .. }) && p.in_flight == 0)
                    .then_some(PageId {
                        buffer,
                        index: i as u32,
                    })
            })
        })
    }
}
