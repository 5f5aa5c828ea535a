//! The flag vocabulary every command shares, and the one parser of its sizes.
//!
//! Sizes: `--gpu-budget 64MiB`, `--host-budget 1GiB`, `--page-size 2MiB` and every other
//! size flag go through [`size_in`]: a whole number of bytes (`1048576`) or a number with
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

/// Digits of a fraction that count: 19 keep `fraction * 2^60` within a u128.
const FRACTION_DIGITS_MAX: usize = 19;

/// Bytes per unit; `None` for a name that is no unit.
fn unit_bytes(unit: &str) -> Option<u64> {
    const UNITS: &[(&[&str], u64)] = &[
        (&["", "b"], 1),
        (&["k", "kb"], 1_000),
        (&["m", "mb"], 1_000_000),
        (&["g", "gb"], 1_000_000_000),
        (&["t", "tb"], 1_000_000_000_000),
        (&["p", "pb"], 1_000_000_000_000_000),
        (&["e", "eb"], 1_000_000_000_000_000_000),
        (&["ki", "kib"], 1 << 10),
        (&["mi", "mib"], 1 << 20),
        (&["gi", "gib"], 1 << 30),
        (&["ti", "tib"], 1 << 40),
        (&["pi", "pib"], 1 << 50),
        (&["ei", "eib"], 1 << 60),
    ];
    UNITS
        .iter()
        .find(|(names, _)| names.iter().any(|n| n.eq_ignore_ascii_case(unit)))
        .map(|(_, bytes)| *bytes)
}

/// Parses a size (see the module doc) into bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let number_len = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(number_len);
    let unit = unit.trim_start();
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(format!(
            "`{text}` is not a size: write a number of bytes or a number with a unit, e.g. \
             64MiB or 2GiB"
        ));
    }
    let Some(factor) = unit_bytes(unit) else {
        return Err(format!(
            "`{unit}` in `{text}` is not a unit: use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)"
        ));
    };
    let too_large = || format!("`{text}` is more than 2^64 - 1 bytes");
    let whole: u64 = match whole {
        "" => 0,
        w => w.parse().map_err(|_| too_large())?,
    };
    let mut bytes = whole.checked_mul(factor).ok_or_else(too_large)?;
    let fraction = &fraction[..fraction.len().min(FRACTION_DIGITS_MAX)];
    if !fraction.is_empty() {
        let digits: u128 = fraction.parse().map_err(|_| too_large())?;
        let part = digits * u128::from(factor) / 10u128.pow(fraction.len() as u32);
        bytes = u64::try_from(part)
            .ok()
            .and_then(|p| bytes.checked_add(p))
            .ok_or_else(too_large)?;
    }
    Ok(bytes)
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
    fn sizes_parse_with_and_without_units() {
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("64 mib"), Ok(64 << 20));
        assert_eq!(parse_size("2Mi"), Ok(2 << 20));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("0.5KiB"), Ok(512));
        assert_eq!(parse_size("512B"), Ok(512));
        assert_eq!(parse_size("15EiB"), Ok(15 << 60));
    }

    #[test]
    fn overflow_and_nonsense_are_errors_not_saturated() {
        for text in [
            "16EiB",
            "99999999999999999999",
            "18446744073709551616",
            "17592186044417TiB",
            "15.99999999999999999999999EiB1",
        ] {
            assert!(parse_size(text).is_err(), "{text} was accepted");
        }
        assert!(parse_size("16EiB").unwrap_err().contains("2^64"));
        assert!(parse_size("15.9999EiB").is_ok());
        for text in ["", "MiB", "1.2.3MiB", "12 parsecs", "-1MiB", "."] {
            assert!(parse_size(text).is_err(), "{text} was accepted");
        }
    }

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
