//! The flag vocabulary every command shares, and the one parser of its sizes.
//!
//! Sizes: `--gpu-budget 64MiB`, `--host-budget 1GiB`, `--page-size 2MiB` and every other
//! size flag go through [`size_in`], over the one parser in [`spillway_types::size`]: a whole number of bytes (`1048576`) or a number with
//! a unit, `KiB` `MiB` `GiB` `TiB` `PiB` `EiB` (powers of 1024; `Ki`, `Mi`, ... too) or
//! `KB` `MB` `GB` `TB` `PB` `EB` (powers of 1000; `K`, `M`, ... too), `B`, in any case. A
//! fraction (`1.5GiB`) is rounded down to whole bytes. Unlike `bytesize`, which saturates,
//! a size past 2^64 - 1 bytes is an error, and so is one outside the flag's range: no size
//! a command computes from a flag can wrap.
//!
//! Old spellings (`demo --gpu-budget-mib`, `--host-budget-mib`, `--page-kib`, `cluster
//! --host-tier-bytes`, `bench remote --page-bytes`) stay for one release as hidden flags
//! with their old units; [`deprecated`] prints the one-line note when one is used.

use std::ops::RangeInclusive;

pub(crate) use spillway_types::limits::{PAGE_BYTES_MAX, PAGE_BYTES_MIN};

/// Largest `--gpu-budget` and `--host-budget`: 16 TiB. With it, sizes the demo derives
/// (pages of the budget times the page size, budgets summed) stay far below 2^64.
pub(crate) const BUDGET_BYTES_MAX: u64 = 1 << 44;

/// Parses a size (see [`spillway_types::size`]) into bytes; the error as text for clap.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    spillway_types::size::parse_size(text).map_err(|e| e.to_string())
}

/// A size the way a user would type it: `16TiB` when it is a whole number of a binary
/// unit, else bytes.
pub(crate) fn fmt_size(bytes: u64) -> String {
    const UNITS: [(&str, u32); 6] = [
        ("EiB", 60),
        ("PiB", 50),
        ("TiB", 40),
        ("GiB", 30),
        ("MiB", 20),
        ("KiB", 10),
    ];
    for (name, shift) in UNITS {
        if bytes != 0 && bytes.trailing_zeros() >= shift {
            return format!("{}{name}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

/// The value parser of a size flag whose value must lie in `range` (clap names the flag
/// and the value in its error).
pub(crate) fn size_in(
    range: RangeInclusive<u64>,
) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync + 'static {
    move |text| {
        let bytes = parse_size(text)?;
        if bytes > *range.end() {
            Err(format!(
                "{} is more than the most this flag takes, {}",
                fmt_size(bytes),
                fmt_size(*range.end())
            ))
        } else if bytes < *range.start() {
            Err(format!(
                "{} is less than the least this flag takes, {}",
                fmt_size(bytes),
                fmt_size(*range.start())
            ))
        } else {
            Ok(bytes)
        }
    }
}

/// Prints the one-line note for a deprecated flag that was used, naming its replacement
/// with the value it stands for.
pub(crate) fn deprecated(old: &str, new: &str, bytes: u64) {
    eprintln!(
        "note: {old} is deprecated and will be removed in the next release; use {new} {}",
        fmt_size(bytes)
    );
}

/// `Some(value << shift)` of a deprecated flag given in KiB (`shift` 10) or MiB (20),
/// announced with [`deprecated`]; the new flag's value when the old one was not used.
/// The old flags' ranges keep the shift from wrapping.
pub(crate) fn merge_deprecated(
    new_value: Option<u64>,
    old_value: Option<u64>,
    shift: u32,
    old: &str,
    new: &str,
) -> Option<u64> {
    match old_value {
        Some(v) => {
            let bytes = v.checked_shl(shift).filter(|b| b >> shift == v);
            let bytes = bytes.expect("the old flag's range keeps it from wrapping");
            deprecated(old, new, bytes);
            Some(bytes)
        }
        None => new_value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_and_named_in_units() {
        let page = size_in(PAGE_BYTES_MIN..=PAGE_BYTES_MAX);
        assert_eq!(page("2MiB"), Ok(2 << 20));
        let err = page("128MiB").unwrap_err();
        assert!(err.contains("128MiB") && err.contains("64MiB"), "{err}");
        let err = page("1KiB").unwrap_err();
        assert!(err.contains("64KiB"), "{err}");
        assert_eq!(fmt_size(BUDGET_BYTES_MAX), "16TiB");
        assert_eq!(fmt_size(1000), "1000B");
    }
}
