//! The payload of a frame: where each page lies in it, and its checksums checked either
//! on the whole payload at once ([`verify_pages`]) or piece by piece while it arrives
//! ([`PayloadVerifier`]). Both give the same verdicts.

use std::ops::Range;

use super::{Kind, Message, PageDesc, WireError, page_checksum};

/// Total bytes of the pages described (no overflow: each is a `u32`, and there are at
/// most a few thousand).
pub fn pages_bytes(descs: &[PageDesc]) -> u64 {
    descs.iter().map(|d| u64::from(d.len)).sum()
}

/// Where each page lies in the payload, in order.
pub fn page_ranges(descs: &[PageDesc]) -> impl Iterator<Item = (&PageDesc, Range<usize>)> {
    descs.iter().scan(0usize, |at, d| {
        let start = *at;
        *at += d.len as usize;
        Some((d, start..*at))
    })
}

/// Checks that `payload` holds exactly the pages `descs` describe, each matching its
/// checksum. The error names the first page that does not.
pub fn verify_pages(descs: &[PageDesc], payload: &[u8]) -> Result<(), WireError> {
    let expected_bytes = pages_bytes(descs);
    if payload.len() as u64 != expected_bytes {
        return Err(WireError::Truncated {
            needed_bytes: expected_bytes,
            available_bytes: payload.len() as u64,
        });
    }
    for (index, (d, range)) in page_ranges(descs).enumerate() {
        let actual = page_checksum(&payload[range]);
        if actual != d.checksum {
            return Err(WireError::ChecksumMismatch {
                page: d.page,
                index,
                expected: d.checksum,
                actual,
            });
        }
    }
    Ok(())
}

/// Checks a payload's pages while it arrives in pieces: each piece is hashed right after
/// the transport copied it (still in cache), and each page is checked the moment its last
/// byte arrives. Gives the same verdicts as [`verify_pages`] on the whole payload.
#[derive(Clone)]
pub struct PayloadVerifier<'a> {
    kind: Kind,
    descs: &'a [PageDesc],
    /// The page being received, and its bytes so far.
    index: usize,
    page_got: u64,
    hasher: xxhash_rust::xxh3::Xxh3Default,
    got_bytes: u64,
}

impl std::fmt::Debug for PayloadVerifier<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadVerifier")
            .field("index", &self.index)
            .field("got_bytes", &self.got_bytes)
            .finish_non_exhaustive()
    }
}

impl<'a> PayloadVerifier<'a> {
    /// A verifier for the payload of `message` (its [`Message::page_descs`]).
    pub fn new(message: &'a Message) -> Self {
        PayloadVerifier {
            kind: message.kind(),
            descs: message.page_descs(),
            index: 0,
            page_got: 0,
            hasher: xxhash_rust::xxh3::Xxh3Default::new(),
            got_bytes: 0,
        }
    }

    /// Checks the page at `self.index` if all its bytes are in, and moves to the next.
    fn complete_pages(&mut self) -> Result<(), WireError> {
        while let Some(d) = self.descs.get(self.index) {
            if self.page_got < u64::from(d.len) {
                return Ok(());
            }
            let actual = self.hasher.digest();
            if actual != d.checksum {
                return Err(WireError::ChecksumMismatch {
                    page: d.page,
                    index: self.index,
                    expected: d.checksum,
                    actual,
                });
            }
            self.hasher.reset();
            self.page_got = 0;
            self.index += 1;
        }
        Ok(())
    }

    /// Takes the next `bytes` of the payload. Fails on the first page that is complete and
    /// does not match, or if `bytes` runs past the end of the payload.
    pub fn update(&mut self, mut bytes: &[u8]) -> Result<(), WireError> {
        self.complete_pages()?;
        let expected = pages_bytes(self.descs);
        if self.got_bytes + bytes.len() as u64 > expected {
            return Err(WireError::PayloadMismatch {
                kind: self.kind,
                payload_bytes: self.got_bytes + bytes.len() as u64,
                pages_bytes: expected,
            });
        }
        self.got_bytes += bytes.len() as u64;
        while !bytes.is_empty() {
            let d = &self.descs[self.index];
            let take = (u64::from(d.len) - self.page_got).min(bytes.len() as u64) as usize;
            self.hasher.update(&bytes[..take]);
            self.page_got += take as u64;
            bytes = &bytes[take..];
            self.complete_pages()?;
        }
        Ok(())
    }

    /// Ends the payload: every page must have arrived whole and matched.
    pub fn finish(mut self) -> Result<(), WireError> {
        self.complete_pages()?;
        let expected = pages_bytes(self.descs);
        if self.got_bytes != expected {
            return Err(WireError::Truncated {
                needed_bytes: expected,
                available_bytes: self.got_bytes,
            });
        }
        Ok(())
    }
}
