//! The node's side of the shared memory and of passing its fd: every `unsafe` of the
//! local socket server.

use std::ffi::c_void;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

/// A client's host tier as the node maps it.
///
/// Invariants: `ptr..ptr + len` is a shared read-write mapping of a memfd whose size
/// is sealed at `len` (so no access inside it can fault), unmapped only in `drop`.
/// The node never creates a Rust reference into it: the client writes it at any time
/// (the pool's contract says not to a slot with an op in flight, but the node does
/// not trust that), so every access is a raw byte copy, for which any bytes are valid.
pub(super) struct SharedRegion {
    ptr: NonNull<u8>,
    len: u64,
}

// SAFETY: the region is plain bytes reached only through raw copies (see above);
// nothing in it is tied to a thread.
unsafe impl Send for SharedRegion {}
// SAFETY: as above; concurrent copies touch only bytes, never Rust values.
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    /// Creates a memfd of `len` bytes (`len` > 0), seals its size, and maps it.
    pub(super) fn create(client: u32, len: u64) -> io::Result<(OwnedFd, SharedRegion)> {
        let size = usize::try_from(len).map_err(io::Error::other)?;
        let fd = rustix::fs::memfd_create(
            format!("spillway-client-{client}"),
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, len)?;
        // Without these, the client could shrink the file and make the node's reads
        // fault; SEAL keeps it from adding seals of its own.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        // SAFETY: a fresh shared mapping chosen by the kernel (null hint), overlapping
        // nothing of ours; `size` > 0 bytes of a file of exactly that size.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                size,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }?;
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok((fd, SharedRegion { ptr, len }))
    }

    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// The start of the `len` bytes at `offset`.
    ///
    /// # Panics
    /// If the range is outside the region (callers check first).
    fn range_start(&self, offset: u64, len: usize) -> *mut u8 {
        assert!(
            offset
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.len)
        );
        // SAFETY: `offset` is inside the mapping or its end (asserted).
        unsafe { self.ptr.as_ptr().add(offset as usize) }
    }

    /// Copies `out.len()` bytes at `offset` out of the region.
    ///
    /// # Panics
    /// If the range is outside the region (callers check first).
    pub(super) fn read(&self, offset: u64, out: &mut [u8]) {
        let src = self.range_start(offset, out.len());
        // SAFETY: the range is inside the mapping (asserted), which stays mapped while
        // `self` lives; `out` is our own memory, so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
    }

    /// Copies `data` into the region at `offset`.
    ///
    /// # Panics
    /// If the range is outside the region (callers check first).
    pub(super) fn write(&self, offset: u64, data: &[u8]) {
        let dst = self.range_start(offset, data.len());
        // SAFETY: as in `read`, the other way.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: mapped in `create` with this length, unmapped only here; no
        // reference into it exists (only raw copies, none running: we are dropped).
        if let Err(e) =
            unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len as usize) }
        {
            tracing::warn!(error = %e, "cannot unmap a client's host memory");
        }
    }
}

/// Sends `bytes` on the socket with `fd` attached (SCM_RIGHTS); returns the bytes
/// sent. No `unsafe`: rustix checks the buffers.
pub(super) fn send_with_fd(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fd: BorrowedFd<'_>,
) -> io::Result<usize> {
    let fds = [fd];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for the fd in the control buffer"));
    }
    let sent = rustix::net::sendmsg(
        socket,
        &[io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
    )?;
    Ok(sent)
}
