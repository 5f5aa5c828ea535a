//! Sizes as Python callers write them: an `int` of bytes, or a string such as `"8GiB"`.
//!
//! The string form is the pool's one size vocabulary (`spillway_types::size`): a whole or
//! fractional number, then an optional unit, binary (`KiB` .. `EiB`, or `Ki` ..) or decimal
//! (`KB` .. `EB`, or `K` ..), in any case; a fraction rounds down to whole bytes. Anything
//! past 2^64 - 1 bytes, negative, or not a size is a `ValueError` naming the argument.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Parses a size string (see the module doc) into bytes: the pool's one parser.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    spillway_types::size::parse_size(text).map_err(|e| e.to_string())
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
