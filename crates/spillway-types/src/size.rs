//! Sizes as people write them, in flags, config values and the Python SDK: a whole
//! number of bytes (`1048576`) or a number with a unit, `KiB` `MiB` `GiB` `TiB` `PiB`
//! `EiB` (powers of 1024; `Ki`, `Mi`, ... too) or `KB` `MB` `GB` `TB` `PB` `EB` (powers of
//! 1000; `K`, `M`, ... too), `B`, in any case, with or without a space. A fraction
//! (`1.5GiB`) is rounded down to whole bytes. Unlike crates that saturate, a size past
//! 2^64 - 1 bytes is an error: nothing computed from a size can wrap.
//!
//! One parser for every caller: the `spillway` command's size flags and the Python
//! package's size arguments.

/// Digits of a fraction that count: 19 keep `fraction * 2^60` within a u128.
const FRACTION_DIGITS_MAX: usize = 19;

/// Why a text is not a size.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// No number where one belongs (empty, a unit alone, two decimal points).
    #[error(
        "`{text}` is not a size: write a number of bytes or a number with a unit, e.g. 64MiB or 2GiB"
    )]
    NotASize {
        /// The text as given (trimmed).
        text: String,
    },
    /// The number is followed by something that is no unit.
    #[error("`{unit}` in `{text}` is not a unit: use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")]
    NotAUnit {
        /// What stood where the unit belongs.
        unit: String,
        /// The text as given (trimmed).
        text: String,
    },
    /// More than 2^64 - 1 bytes.
    #[error("`{text}` is more than 2^64 - 1 bytes")]
    TooLarge {
        /// The text as given (trimmed).
        text: String,
    },
}

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

/// Parses a size (see the module docs) into bytes.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let text = text.trim();
    let number_len = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(number_len);
    let unit = unit.trim_start();
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(SizeError::NotASize { text: text.into() });
    }
    let Some(factor) = unit_bytes(unit) else {
        return Err(SizeError::NotAUnit {
            unit: unit.into(),
            text: text.into(),
        });
    };
    let too_large = || SizeError::TooLarge { text: text.into() };
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
    fn overflow_and_nonsense_are_typed_errors_not_saturated() {
        for text in [
            "16EiB",
            "99999999999999999999",
            "18446744073709551616",
            "17592186044417TiB",
        ] {
            assert!(
                matches!(parse_size(text), Err(SizeError::TooLarge { .. })),
                "{text}"
            );
        }
        assert!(
            parse_size("16EiB")
                .unwrap_err()
                .to_string()
                .contains("2^64")
        );
        assert!(parse_size("15.9999EiB").is_ok());
        for text in ["", "MiB", "1.2.3MiB", "."] {
            assert!(
                matches!(parse_size(text), Err(SizeError::NotASize { .. })),
                "{text}"
            );
        }
        for text in ["12 parsecs", "-1MiB", "15.99999999999999999999999EiB1"] {
            assert!(parse_size(text).is_err(), "{text} was accepted");
        }
        assert_eq!(
            parse_size("3 parsecs"),
            Err(SizeError::NotAUnit {
                unit: "parsecs".into(),
                text: "3 parsecs".into()
            })
        );
    }
}
