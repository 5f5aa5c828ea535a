//! Sizes as Python callers write them: an `int` of bytes, or a string such as `"8GiB"`.
//!
//! The string form is the CLI's vocabulary (`spillway-cli/src/size.rs`): a whole or
//! fractional number, then an optional unit, binary (`KiB` .. `EiB`, or `Ki` ..) or decimal
//! (`KB` .. `EB`, or `K` ..), in any case; a fraction rounds down to whole bytes. Anything
//! past 2^64 - 1 bytes, negative, or not a size is a `ValueError` naming the argument.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

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

/// Parses a size string (see the module doc) into bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let number_len = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(number_len);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(format!(
            "{text:?} is not a size: write bytes or a number with a unit, e.g. 64MiB or 2GiB"
        ));
    }
    let unit = unit.trim_start();
    let Some(factor) = unit_bytes(unit) else {
        return Err(format!(
            "{unit:?} in {text:?} is not a unit: use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)"
        ));
    };
    let too_large = || format!("{text:?} is more than 2^64 - 1 bytes");
    let whole: u64 = match whole {
        "" => 0,
        w => w.parse().map_err(|_| too_large())?,
    };
    let mut bytes = whole.checked_mul(factor).ok_or_else(too_large)?;
    // 19 digits keep `digits * 2^60` inside a u128.
    let fraction = &fraction[..fraction.len().min(19)];
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

/// A size argument: an `int` of bytes or a size string; a `ValueError` naming `arg` else.
pub(crate) fn size_arg(arg: &str, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    let bad = |why: String| PyValueError::new_err(format!("{arg}: {why}"));
    if let Ok(text) = value.extract::<String>() {
        return parse_size(&text).map_err(bad);
    }
    // `bool` is an `int` in Python; a flag where a size belongs is a mistake.
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(bad("expected a size, got a bool".into()));
    }
    match value.extract::<i128>() {
        Ok(n) => u64::try_from(n).map_err(|_| bad(format!("{n} is not a size in bytes"))),
        Err(_) => Err(bad(format!(
            "expected an int of bytes or a string such as \"8GiB\", got {}",
            value.get_type().name()?
        ))),
    }
}
