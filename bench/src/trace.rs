//! Access traces recorded from a training job, read and checked line by line.
//!
//! The format is documented in `docs/TRACE.md`: JSON Lines, one object per line,
//! `{"step": int, "buffer": str, "bytes": int, "phase": str}` plus an optional
//! `"compute_us"`, in the order the job touched its buffers. `python/spillway_trace.py`
//! records such traces from a PyTorch job; the replay engine feeds them to the pool.
//!
//! Parts:
//! - [`parse_trace`] / [`load_trace`]: read a whole trace into a [`Trace`], or fail with a
//!   [`TraceError`] that names the 1-based line and what is wrong. Nothing in a trace file
//!   makes the parser panic.
//! - [`Trace`]: the accesses with markers removed, the distinct buffers in first-seen order
//!   with their sizes, and the distinct steps.
//!
//! Invariants of a [`Trace`] that [`parse_trace`] returns:
//! - `accesses` is not empty and its `step`s never decrease, so one step's accesses are a
//!   contiguous slice ([`Trace::step_accesses`], [`Trace::accesses_by_step`]);
//! - every access has `bytes` in `1..=BUFFER_BYTES_MAX`, and every access to a buffer has the
//!   size listed for it in `buffers` (a buffer never changes size within a trace);
//! - `steps` holds each step that has at least one access, once, increasing.
//!
//! Markers (`bytes` 0) are checked like any line, then dropped; their `compute_us`, if any,
//! is added to the access before them, so the replay keeps the time the job spent there.
//! The sum keeps [`COMPUTE_US_MAX`] too: no access has more `compute_us` than that.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

/// Longest line, not counting its `\n`: 64 KiB. The parser holds one line at a time, so
/// this bounds the memory used to read; real lines are under 200 bytes.
pub const LINE_BYTES_MAX: usize = 64 << 10;
/// Largest buffer: 1 TiB, far above any one tensor of a real job; a larger size is taken
/// for a unit mistake (bits, or an element count times a stride).
pub const BUFFER_BYTES_MAX: u64 = 1 << 40;
/// Longest buffer name: 256 bytes (qualified module names of large models are under 80).
pub const BUFFER_NAME_BYTES_MAX: usize = 256;
/// Longest phase: 64 bytes (`bwd-recompute` is 13).
pub const PHASE_BYTES_MAX: usize = 64;
/// Most accesses in one trace: 2^24 (16.7M). Each costs 80 bytes plus its two strings on
/// the heap: about 2 GiB for typical 30-byte names, at worst (names and phases at their
/// limits) 6.7 GiB. Markers are not kept and do not count.
pub const ACCESSES_MAX: usize = 1 << 24;
/// Most distinct buffers in one trace: as many as one pool can hold
/// ([`spillway_types::limits::BUFFERS_MAX`]).
pub const BUFFERS_MAX: usize = spillway_types::limits::BUFFERS_MAX;
/// Largest `compute_us`: one hour. A larger gap between two accesses is a stall or a
/// clock mistake, not compute, and would stall a replay for as long.
pub const COMPUTE_US_MAX: f64 = 3.6e9;

/// One access of a job to one of its buffers: a line of the trace whose `bytes` is not 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Access {
    /// The training step (optimizer step) the access belongs to.
    pub step: u64,
    /// The buffer's name, unique in the trace (the recorder uses the module's qualified name).
    pub buffer: String,
    /// The buffer's size, the same on every access to it.
    pub bytes: u64,
    /// Free text: `fwd`, `bwd`, `bwd-recompute`, `opt`, ...
    pub phase: String,
    /// Microseconds the job computed after this access, before its next one, if recorded.
    pub compute_us: Option<f64>,
}

/// A parsed and checked trace. See the module doc for its invariants.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// Every access in file order, markers removed.
    pub accesses: Vec<Access>,
    /// Each distinct buffer once, in the order of its first access, with its size.
    pub buffers: Vec<(String, u64)>,
    /// Each step that has at least one access, once, increasing.
    pub steps: Vec<u64>,
    /// Lines with `bytes` 0 (markers) that were checked and dropped.
    pub markers_skipped: u64,
}

impl Trace {
    /// The accesses of `step`, in order; empty if the step has none.
    pub fn step_accesses(&self, step: u64) -> &[Access] {
        // Steps never decrease along `accesses`, so a step's accesses are contiguous.
        let start = self.accesses.partition_point(|a| a.step < step);
        let end = start + self.accesses[start..].partition_point(|a| a.step == step);
        &self.accesses[start..end]
    }

    /// Each step with its accesses, in order.
    pub fn accesses_by_step(&self) -> impl Iterator<Item = (u64, &[Access])> {
        self.accesses
            .chunk_by(|a, b| a.step == b.step)
            .map(|chunk| (chunk[0].step, chunk))
    }

    /// Total size of the distinct buffers: the memory the job would need to hold them all.
    pub fn buffer_bytes_total(&self) -> u64 {
        // Each size is at most 2^40 and there are at most 2^20 buffers: no overflow.
        self.buffers.iter().map(|(_, bytes)| bytes).sum()
    }

    /// Pages of `page_size` the distinct buffers take: the GPU budget, in pages, of a run
    /// that keeps them all resident.
    pub fn pages_total(&self, page_size: spillway_types::PageSize) -> u64 {
        self.buffers
            .iter()
            .map(|(_, bytes)| page_size.pages_for(*bytes))
            .sum()
    }
}

/// Why a trace could not be read. Every variant about a line names that line, from 1.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened.
    #[error("cannot open trace {}: {source}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// Reading failed.
    #[error("line {line}: read failed: {source}")]
    Read {
        /// The line being read.
        line: u64,
        /// What the reader said.
        source: io::Error,
    },
    /// The line is longer than [`LINE_BYTES_MAX`].
    #[error("line {line}: longer than {limit_bytes} bytes")]
    LineTooLong {
        /// The line.
        line: u64,
        /// [`LINE_BYTES_MAX`].
        limit_bytes: usize,
    },
    /// The line is not one valid JSON object.
    #[error("line {line}, column {column}: not a valid JSON object: {reason}")]
    BadJson {
        /// The line.
        line: u64,
        /// Where in the line, from 1 (0 when unknown).
        column: usize,
        /// What serde_json said.
        reason: String,
    },
    /// A required field is absent.
    #[error("line {line}: missing field `{field}`")]
    MissingField {
        /// The line.
        line: u64,
        /// The field.
        field: &'static str,
    },
    /// A field appears twice in one object.
    #[error("line {line}: field `{field}` appears twice")]
    DuplicateField {
        /// The line.
        line: u64,
        /// The field.
        field: &'static str,
    },
    /// A field that the format does not have and whose name does not start with `_`.
    #[error(
        "line {line}: unknown field `{field}` (known: step, buffer, bytes, phase, compute_us; \
         prefix a key with `_` to carry extra data)"
    )]
    UnknownField {
        /// The line.
        line: u64,
        /// The field as written.
        field: String,
    },
    /// A field has the wrong JSON type.
    #[error("line {line}: `{field}` must be {expected}, found {found}")]
    WrongType {
        /// The line.
        line: u64,
        /// The field.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
        /// The JSON type it has.
        found: &'static str,
    },
    /// An integer field (`step`, `bytes`) is negative.
    #[error("line {line}: `{field}` is negative ({value})")]
    Negative {
        /// The line.
        line: u64,
        /// The field.
        field: &'static str,
        /// The value as written.
        value: String,
    },
    /// An integer field (`step`, `bytes`) is a fraction, has an exponent or a decimal point,
    /// or does not fit in 64 bits.
    #[error(
        "line {line}: `{field}` must be a whole number below 2^64 written without a decimal point, found {value}"
    )]
    NotAnInteger {
        /// The line.
        line: u64,
        /// The field.
        field: &'static str,
        /// The value as serde_json read it.
        value: String,
    },
    /// A buffer is larger than [`BUFFER_BYTES_MAX`].
    #[error("line {line}: buffer `{buffer}` has {bytes} bytes, above the limit of {limit_bytes}")]
    BufferTooLarge {
        /// The line.
        line: u64,
        /// The buffer.
        buffer: String,
        /// Its size.
        bytes: u64,
        /// [`BUFFER_BYTES_MAX`].
        limit_bytes: u64,
    },
    /// A buffer's size differs from the size of its first access.
    #[error(
        "line {line}: buffer `{buffer}` has {bytes} bytes, but {first_bytes} bytes on line \
         {first_line}; a buffer keeps its size for the whole trace"
    )]
    BufferSizeChanged {
        /// The line with the new size.
        line: u64,
        /// The buffer.
        buffer: String,
        /// The new size.
        bytes: u64,
        /// The line of the buffer's first access.
        first_line: u64,
        /// The size there.
        first_bytes: u64,
    },
    /// An access with an empty buffer name.
    #[error("line {line}: empty buffer name (only markers, with bytes 0, may have one)")]
    EmptyBufferName {
        /// The line.
        line: u64,
    },
    /// A string field is longer than its limit.
    #[error("line {line}: `{field}` is {len_bytes} bytes long, above the limit of {limit_bytes}")]
    StringTooLong {
        /// The line.
        line: u64,
        /// The field (`buffer` or `phase`).
        field: &'static str,
        /// Its length.
        len_bytes: usize,
        /// [`BUFFER_NAME_BYTES_MAX`] or [`PHASE_BYTES_MAX`].
        limit_bytes: usize,
    },
    /// The step number is smaller than on an earlier line.
    #[error(
        "line {line}: step {step} comes after step {previous_step} (line {previous_line}); steps never go back"
    )]
    StepWentBack {
        /// The line.
        line: u64,
        /// Its step.
        step: u64,
        /// The step of the line before.
        previous_step: u64,
        /// The line before.
        previous_line: u64,
    },
    /// `compute_us` is negative, not finite, or above [`COMPUTE_US_MAX`]; or a marker's
    /// `compute_us`, added to the access before it, takes that access above it.
    #[error("line {line}: `compute_us` must be a number from 0 to {limit_us}, found {value}")]
    BadComputeTime {
        /// The line.
        line: u64,
        /// The value as serde_json read it.
        value: String,
        /// [`COMPUTE_US_MAX`].
        limit_us: f64,
    },
    /// More accesses than [`ACCESSES_MAX`].
    #[error("line {line}: more than {limit} accesses")]
    TooManyAccesses {
        /// The line of the first access past the limit.
        line: u64,
        /// [`ACCESSES_MAX`].
        limit: usize,
    },
    /// More distinct buffers than [`BUFFERS_MAX`].
    #[error("line {line}: more than {limit} distinct buffers")]
    TooManyBuffers {
        /// The line of the first buffer past the limit.
        line: u64,
        /// [`BUFFERS_MAX`].
        limit: usize,
    },
    /// The trace is empty or holds only markers.
    #[error("no accesses: the trace has {markers} marker lines and no line with bytes > 0")]
    NoAccesses {
        /// Markers seen.
        markers: u64,
    },
}

/// Reads a trace from `path`. See [`parse_trace`].
pub fn load_trace(path: &Path) -> Result<Trace, TraceError> {
    let file = File::open(path).map_err(|source| TraceError::Open {
        path: path.to_owned(),
        source,
    })?;
    parse_trace(BufReader::new(file))
}

/// Reads and checks a whole trace (the rules are in `docs/TRACE.md`).
pub fn parse_trace(reader: impl BufRead) -> Result<Trace, TraceError> {
    parse_with_limits(reader, Limits::DEFAULT)
}

/// The bounds that tests shrink to reach them quickly.
#[derive(Clone, Copy, Debug)]
struct Limits {
    line_bytes_max: usize,
    accesses_max: usize,
    buffers_max: usize,
}

impl Limits {
    const DEFAULT: Limits = Limits {
        line_bytes_max: LINE_BYTES_MAX,
        accesses_max: ACCESSES_MAX,
        buffers_max: BUFFERS_MAX,
    };
}

/// What the parser remembers of a buffer: where it is in `Trace::buffers` and where it was
/// first seen, to name that line if the size changes.
struct BufferSeen {
    index: usize,
    first_line: u64,
}

fn parse_with_limits(mut reader: impl BufRead, limits: Limits) -> Result<Trace, TraceError> {
    let mut trace = Trace {
        accesses: Vec::new(),
        buffers: Vec::new(),
        steps: Vec::new(),
        markers_skipped: 0,
    };
    let mut seen: HashMap<String, BufferSeen> = HashMap::new();
    // (step, line) of the last non-blank line.
    let mut previous: Option<(u64, u64)> = None;
    let mut buf = Vec::with_capacity(256);
    let mut line: u64 = 0;
    loop {
        line += 1;
        buf.clear();
        // One byte past the limit tells a line at the limit from a longer one without ever
        // holding more than the limit.
        let read = (&mut reader)
            .take(limits.line_bytes_max as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|source| TraceError::Read { line, source })?;
        if read == 0 {
            break;
        }
        let text: &[u8] = match buf.strip_suffix(b"\n") {
            Some(text) => text,
            None if buf.len() > limits.line_bytes_max => {
                return Err(TraceError::LineTooLong {
                    line,
                    limit_bytes: limits.line_bytes_max,
                });
            }
            None => &buf,
        };
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let raw: RawLine = serde_json::from_slice(text).map_err(|e| bad_json(line, &e))?;
        let checked = check_line(line, raw)?;

        if let Some((previous_step, previous_line)) = previous
            && checked.step < previous_step
        {
            return Err(TraceError::StepWentBack {
                line,
                step: checked.step,
                previous_step,
                previous_line,
            });
        }
        previous = Some((checked.step, line));

        if checked.bytes == 0 {
            trace.markers_skipped += 1;
            if let (Some(marker_us), Some(last)) = (checked.compute_us, trace.accesses.last_mut()) {
                // The time after a marker is time after the access before it, and that
                // access's whole gap keeps COMPUTE_US_MAX (each line alone does not bound
                // the sum).
                let access_us = last.compute_us.unwrap_or(0.0);
                let gap_us = access_us + marker_us;
                if gap_us > COMPUTE_US_MAX {
                    return Err(TraceError::BadComputeTime {
                        line,
                        value: format!(
                            "{marker_us} after the {access_us} us of the access before it \
                             ({gap_us} us in all)"
                        ),
                        limit_us: COMPUTE_US_MAX,
                    });
                }
                last.compute_us = Some(gap_us);
            }
            continue;
        }

        if checked.buffer.is_empty() {
            return Err(TraceError::EmptyBufferName { line });
        }
        if checked.bytes > BUFFER_BYTES_MAX {
            return Err(TraceError::BufferTooLarge {
                line,
                buffer: checked.buffer,
                bytes: checked.bytes,
                limit_bytes: BUFFER_BYTES_MAX,
            });
        }
        if trace.accesses.len() >= limits.accesses_max {
            return Err(TraceError::TooManyAccesses {
                line,
                limit: limits.accesses_max,
            });
        }
        match seen.entry(checked.buffer.clone()) {
            Entry::Occupied(entry) => {
                let first_bytes = trace.buffers[entry.get().index].1;
                if first_bytes != checked.bytes {
                    return Err(TraceError::BufferSizeChanged {
                        line,
                        buffer: checked.buffer,
                        bytes: checked.bytes,
                        first_line: entry.get().first_line,
                        first_bytes,
                    });
                }
            }
            Entry::Vacant(entry) => {
                if trace.buffers.len() >= limits.buffers_max {
                    return Err(TraceError::TooManyBuffers {
                        line,
                        limit: limits.buffers_max,
                    });
                }
                entry.insert(BufferSeen {
                    index: trace.buffers.len(),
                    first_line: line,
                });
                trace.buffers.push((checked.buffer.clone(), checked.bytes));
            }
        }
        if trace.steps.last() != Some(&checked.step) {
            trace.steps.push(checked.step);
        }
        trace.accesses.push(Access {
            step: checked.step,
            buffer: checked.buffer,
            bytes: checked.bytes,
            phase: checked.phase,
            compute_us: checked.compute_us,
        });
    }
    if trace.accesses.is_empty() {
        return Err(TraceError::NoAccesses {
            markers: trace.markers_skipped,
        });
    }
    Ok(trace)
}

/// Turns serde_json's error into [`TraceError::BadJson`]. Its message ends with
/// "at line 1 column N" (a trace line is one JSON line); that position is kept as `column`
/// and cut from the reason so it is not mistaken for the file's line.
fn bad_json(line: u64, error: &serde_json::Error) -> TraceError {
    let message = error.to_string();
    let reason = match message.rfind(" at line ") {
        Some(at) if error.line() != 0 => message[..at].to_owned(),
        _ => message,
    };
    TraceError::BadJson {
        line,
        column: error.column(),
        reason,
    }
}

/// The fields of one line as JSON values, before their types and ranges are checked.
/// Its hand-written `Deserialize` notes unknown and repeated keys instead of failing, so
/// that they get their own [`TraceError`] variants.
#[derive(Default)]
struct RawLine {
    step: Option<Value>,
    buffer: Option<Value>,
    bytes: Option<Value>,
    phase: Option<Value>,
    compute_us: Option<Value>,
    duplicate: Option<&'static str>,
    unknown: Option<String>,
}

impl<'de> Deserialize<'de> for RawLine {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(RawLineVisitor)
    }
}

struct RawLineVisitor;

impl<'de> Visitor<'de> for RawLineVisitor {
    type Value = RawLine;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a trace line object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawLine, A::Error> {
        let mut raw = RawLine::default();
        while let Some(key) = map.next_key::<String>()? {
            let (name, slot): (&'static str, &mut Option<Value>) = match key.as_ref() {
                "step" => ("step", &mut raw.step),
                "buffer" => ("buffer", &mut raw.buffer),
                "bytes" => ("bytes", &mut raw.bytes),
                "phase" => ("phase", &mut raw.phase),
                "compute_us" => ("compute_us", &mut raw.compute_us),
                other => {
                    if !other.starts_with('_') && raw.unknown.is_none() {
                        raw.unknown = Some(other.to_owned());
                    }
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            let value = map.next_value::<Value>()?;
            if slot.is_some() {
                raw.duplicate.get_or_insert(name);
            }
            *slot = Some(value);
        }
        Ok(raw)
    }
}

/// One line with its fields' types checked; `compute_us` null is taken as absent.
struct CheckedLine {
    step: u64,
    buffer: String,
    bytes: u64,
    phase: String,
    compute_us: Option<f64>,
}

fn check_line(line: u64, raw: RawLine) -> Result<CheckedLine, TraceError> {
    if let Some(field) = raw.unknown {
        return Err(TraceError::UnknownField { line, field });
    }
    if let Some(field) = raw.duplicate {
        return Err(TraceError::DuplicateField { line, field });
    }
    let step = non_negative_integer(line, "step", raw.step)?;
    let buffer = bounded_string(line, "buffer", raw.buffer, BUFFER_NAME_BYTES_MAX)?;
    let bytes = non_negative_integer(line, "bytes", raw.bytes)?;
    let phase = bounded_string(line, "phase", raw.phase, PHASE_BYTES_MAX)?;
    let compute_us = match raw.compute_us {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => {
            // Without serde_json's arbitrary_precision every number has an f64 value.
            let us = n.as_f64().unwrap_or(f64::NAN);
            if !(0.0..=COMPUTE_US_MAX).contains(&us) {
                return Err(TraceError::BadComputeTime {
                    line,
                    value: n.to_string(),
                    limit_us: COMPUTE_US_MAX,
                });
            }
            Some(us)
        }
        Some(other) => {
            return Err(TraceError::WrongType {
                line,
                field: "compute_us",
                expected: "a number",
                found: json_type(&other),
            });
        }
    };
    Ok(CheckedLine {
        step,
        buffer,
        bytes,
        phase,
        compute_us,
    })
}

fn required(line: u64, field: &'static str, value: Option<Value>) -> Result<Value, TraceError> {
    value.ok_or(TraceError::MissingField { line, field })
}

/// Required field `field` of line `line`, a non-negative integer.
fn non_negative_integer(
    line: u64,
    field: &'static str,
    value: Option<Value>,
) -> Result<u64, TraceError> {
    let value = required(line, field, value)?;
    let Value::Number(n) = value else {
        return Err(TraceError::WrongType {
            line,
            field,
            expected: "a non-negative integer",
            found: json_type(&value),
        });
    };
    if let Some(v) = n.as_u64() {
        return Ok(v);
    }
    let negative = n.as_i64().is_some() || n.as_f64().is_some_and(|f| f < 0.0);
    if negative {
        Err(TraceError::Negative {
            line,
            field,
            value: n.to_string(),
        })
    } else {
        Err(TraceError::NotAnInteger {
            line,
            field,
            value: n.to_string(),
        })
    }
}

/// Required field `field` of line `line`, a string of at most `limit_bytes`.
fn bounded_string(
    line: u64,
    field: &'static str,
    value: Option<Value>,
    limit_bytes: usize,
) -> Result<String, TraceError> {
    let value = required(line, field, value)?;
    let Value::String(s) = value else {
        return Err(TraceError::WrongType {
            line,
            field,
            expected: "a string",
            found: json_type(&value),
        });
    };
    if s.len() > limit_bytes {
        return Err(TraceError::StringTooLong {
            line,
            field,
            len_bytes: s.len(),
            limit_bytes,
        });
    }
    Ok(s)
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests;
