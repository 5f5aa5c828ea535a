//! The client's side of a node's local socket, as the local-socket tests speak it: frames
//! written whole, frames read with the file descriptors that came with them.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use spillway_types::local::{self, ClientMessage, FrameHeader, HEADER_BYTES, NodeMessage};

/// Writes `message` as one frame.
pub fn send(stream: &mut UnixStream, message: &ClientMessage) {
    stream
        .write_all(&local::encode_frame(message).unwrap())
        .unwrap();
}

/// Reads one frame; the fds that came with it are returned too. `None` at the end of the
/// stream.
pub fn read_frame(stream: &mut UnixStream) -> Option<(FrameHeader, NodeMessage, Vec<OwnedFd>)> {
    let mut header = [0u8; HEADER_BYTES];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < HEADER_BYTES {
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let r = rustix::net::recvmsg(
            stream.as_fd(),
            &mut [std::io::IoSliceMut::new(&mut header[got..])],
            &mut control,
            rustix::net::RecvFlags::CMSG_CLOEXEC,
        )
        .ok()?;
        for m in control.drain() {
            if let rustix::net::RecvAncillaryMessage::ScmRights(received) = m {
                fds.extend(received);
            }
        }
        if r.bytes == 0 {
            return None;
        }
        got += r.bytes;
    }
    let header = FrameHeader::decode(&header).unwrap();
    let mut body = vec![0u8; header.body_bytes as usize];
    stream.read_exact(&mut body).unwrap();
    Some((header, local::decode_body(&body).unwrap(), fds))
}
