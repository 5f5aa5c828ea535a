//! The SDK's typed errors as Python exceptions.
//!
//! The classes live in `spillway/_errors.py` (Python allows the multiple bases that make
//! `PoolFullError` both a `SpillwayError` and a `MemoryError`); this module picks the class
//! for each [`PoolError`] variant, makes it with the SDK's message, and sets the cause's
//! numbers as attributes. Every variant maps to a class: a new variant fails to compile
//! here until it is given one. [`DaemonError`] (`Pool.connect`) maps the same way.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use spillway_client::daemon::DaemonError;
use spillway_client::{CoreError, DeviceError, PoolError};

/// One attribute of an exception: its name and value.
type Field = (&'static str, Value);

/// An attribute's value: a Python `int` or `str`.
enum Value {
    Int(u64),
    Text(String),
}

/// The attribute `name`, an `int`.
fn int(name: &'static str, v: u64) -> Field {
    (name, Value::Int(v))
}

/// The attribute `name`, a `str` (`v`'s `Display`).
fn text(name: &'static str, v: impl ToString) -> Field {
    (name, Value::Text(v.to_string()))
}

/// The class name in `spillway._errors` and the attributes for `err`.
fn class_and_fields(err: &PoolError) -> (&'static str, Vec<Field>) {
    match err {
        PoolError::Pool(core) => match core {
            CoreError::EmptyBuffer => ("EmptyBufferError", vec![]),
            CoreError::BufferTooLarge {
                requested_bytes,
                pages,
                budget_bytes,
            } => (
                "BufferTooLargeError",
                vec![
                    int("requested_bytes", *requested_bytes),
                    int("pages", *pages),
                    int("budget_bytes", *budget_bytes),
                ],
            ),
            CoreError::PoolFull {
                requested_bytes,
                needed_pages,
                free_pages,
                total_pages,
            } => (
                "PoolFullError",
                vec![
                    int("requested_bytes", *requested_bytes),
                    int("needed_pages", *needed_pages),
                    int("free_pages", *free_pages),
                    int("total_pages", *total_pages),
                ],
            ),
            CoreError::TooManyBuffers { limit } => {
                ("TooManyBuffersError", vec![int("limit", *limit as u64)])
            }
            CoreError::UnknownBuffer(b) => ("UnknownBufferError", vec![int("buffer", b.0)]),
            CoreError::Freed(b) => ("BufferFreedError", vec![int("buffer", b.0)]),
            CoreError::BufferHeld { buffer, holders } => (
                "BufferHeldError",
                vec![int("buffer", buffer.0), int("holders", u64::from(*holders))],
            ),
            CoreError::BufferBusy { buffer, mode } => (
                "BufferBusyError",
                vec![int("buffer", buffer.0), text("mode", mode.as_str())],
            ),
            CoreError::HeldAcquiresExceedBudget {
                buffer,
                held_bytes,
                requested_bytes,
                budget_bytes,
            } => (
                "HeldAcquiresExceedBudgetError",
                vec![
                    int("buffer", buffer.0),
                    int("held_bytes", *held_bytes),
                    int("requested_bytes", *requested_bytes),
                    int("budget_bytes", *budget_bytes),
                ],
            ),
            CoreError::OutOfRange {
                buffer,
                offset,
                len,
                bytes,
            } => (
                "OutOfRangeError",
                vec![
                    int("buffer", buffer.0),
                    int("offset", *offset),
                    int("len", *len),
                    int("bytes", *bytes),
                ],
            ),
            CoreError::DeviceFailed(fault) => ("DeviceError", vec![text("reason", &fault.message)]),
            CoreError::PageLost {
                buffer,
                page,
                reason,
            } => (
                "PageLostError",
                vec![
                    int("buffer", buffer.0),
                    int("page", u64::from(*page)),
                    text("reason", reason),
                ],
            ),
            CoreError::RemoteTierGone { reason } => {
                ("RemoteTierGoneError", vec![text("reason", reason)])
            }
            CoreError::SpillsFailing {
                failing_ms,
                attempts,
                reason,
            } => (
                "SpillsFailingError",
                vec![
                    int("failing_ms", *failing_ms),
                    int("attempts", *attempts),
                    text("reason", reason),
                ],
            ),
        },
        PoolError::Device(DeviceError::Unavailable { backend, reason }) => (
            "DeviceUnavailableError",
            vec![text("backend", backend), text("reason", reason)],
        ),
        // The Python package neither lends nor borrows GPU memory yet; were it to, the
        // message says why it cannot.
        PoolError::Device(_) | PoolError::Peer(_) => ("DeviceError", vec![]),
        PoolError::Config(c) => (
            "ConfigError",
            vec![text("field", c.field), text("problem", &c.problem)],
        ),
        PoolError::Missing(field) => ("ConfigError", vec![text("field", field)]),
        PoolError::NotHostVisible(backend) => {
            ("NotHostVisibleError", vec![text("backend", backend)])
        }
        PoolError::NoSuchPage { index, pages } => (
            "OutOfRangeError",
            vec![int("index", *index as u64), int("pages", *pages as u64)],
        ),
        PoolError::NotExclusive => ("NotExclusiveError", vec![]),
        PoolError::Remote(reason) => ("RemoteError", vec![text("reason", reason)]),
    }
}

/// The class name in `spillway._errors` and the attributes for `err` (`Pool.connect`).
fn daemon_class_and_fields(err: &DaemonError) -> (&'static str, Vec<Field>) {
    match err {
        DaemonError::NoNode { socket, .. } => {
            ("NoNodeError", vec![text("socket", socket.display())])
        }
        DaemonError::Connect { socket, source } => (
            "NodeLinkError",
            vec![text("socket", socket.display()), text("reason", source)],
        ),
        DaemonError::Refused { code, message } => (
            "NodeRefusedError",
            vec![text("code", format!("{code:?}")), text("reason", message)],
        ),
        DaemonError::VersionMismatch { node, client } => (
            "NodeProtocolError",
            vec![
                int("node_version", u64::from(*node)),
                int("client_version", u64::from(*client)),
            ],
        ),
        DaemonError::Protocol { reason } => ("NodeProtocolError", vec![text("reason", reason)]),
        DaemonError::Io { source } => ("NodeLinkError", vec![text("reason", source)]),
        DaemonError::Map { bytes, source } => (
            "NodeLinkError",
            vec![int("bytes", *bytes), text("reason", source)],
        ),
    }
}

/// An instance of `spillway._errors.<class>` with `message`.
pub(crate) fn new_error(py: Python<'_>, class: &str, message: String) -> PyErr {
    let made = py
        .import("spillway._errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call1((message.clone(),)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        // Only when `_core` is imported without its package (not a supported use).
        Err(_) => PyRuntimeError::new_err(format!("{class}: {message}")),
    }
}

/// `err` as the exception of its class, with its numbers as attributes.
pub(crate) fn to_py(py: Python<'_>, err: PoolError) -> PyErr {
    let (class, fields) = class_and_fields(&err);
    with_fields(py, class, err.to_string(), fields)
}

/// An instance of `spillway._errors.<class>` with `message` and `fields` as attributes.
fn with_fields(py: Python<'_>, class: &str, message: String, fields: Vec<Field>) -> PyErr {
    let exc = new_error(py, class, message);
    let value = exc.value(py);
    for (name, v) in fields {
        let set = match v {
            Value::Int(i) => value.setattr(name, i),
            Value::Text(t) => value.setattr(name, t),
        };
        if let Err(e) = set {
            return e;
        }
    }
    exc
}

/// Converts the SDK's results; `.py_err(py)?` at each call that returns a [`PoolError`].
pub(crate) trait IntoPyResult<T> {
    /// The result with its error as a Python exception.
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, PoolError> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// What `Pool.connect` can fail with: linking to the node, or building the pool on it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    /// The link to the node.
    #[error(transparent)]
    Daemon(DaemonError),
    /// The pool over the link.
    #[error(transparent)]
    Pool(PoolError),
}

impl ConnectError {
    /// The exception of its class, with its numbers as attributes.
    pub(crate) fn into_py(self, py: Python<'_>) -> PyErr {
        match self {
            ConnectError::Pool(e) => to_py(py, e),
            ConnectError::Daemon(e) => daemon_to_py(py, e),
        }
    }
}

/// `err` as the exception of its class (`spillway._errors`, under `NodeLinkError`).
fn daemon_to_py(py: Python<'_>, err: DaemonError) -> PyErr {
    let (class, fields) = daemon_class_and_fields(&err);
    with_fields(py, class, err.to_string(), fields)
}
