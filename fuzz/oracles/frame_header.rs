//! The header checks both frame oracles (`wire_frame.rs`, `local_frame.rs`) run, whose
//! headers share a frozen layout: magic, then a little-endian `u16` protocol version.
//!
//! A corpus outlives protocol versions, so a frame of another version is also checked
//! with this build's version in its header ([`check_also_as_current`]): its body keeps
//! exercising the body decoder after a version bump.

/// Runs `check_bytes` on `data`; when `data` starts with `magic` and another version than
/// `version`, also on a copy that carries `version`. Returns whether either run accepted.
pub fn check_also_as_current(
    data: &[u8],
    magic: [u8; 4],
    version: [u8; 2],
    check_bytes: fn(&[u8]) -> bool,
) -> bool {
    let accepted = check_bytes(data);
    match data.get(..6) {
        Some(start) if start[..4] == magic && start[4..6] != version => {
            let mut current = data.to_vec();
            current[4..6].copy_from_slice(&version);
            check_bytes(&current) || accepted
        }
        _ => accepted,
    }
}

/// Panics unless a header of `N` bytes at the start of `data` that decodes re-encodes to
/// the same bytes; `reencode` decodes and encodes again (`None`: it does not decode).
pub fn round_trips<const N: usize>(data: &[u8], reencode: impl Fn(&[u8; N]) -> Option<[u8; N]>) {
    if let Some(header_bytes) = data.get(..N) {
        let header_bytes: &[u8; N] = header_bytes.try_into().expect("N bytes");
        if let Some(again) = reencode(header_bytes) {
            assert_eq!(&again, header_bytes, "header does not round-trip");
        }
    }
}
