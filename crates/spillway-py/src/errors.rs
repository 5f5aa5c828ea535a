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
type Field = (&'static str, Py<PyAny>);

/// The class name in `spillway._errors` and the attributes for `err`.
fn class_and_fields(py: Python<'_>, err: &PoolError) -> PyResult<(&'static str, Vec<Field>)> {
    let f = |name: &'static str, v: Bound<'_, PyAny>| (name, v.unbind());
    let int = |v: u64| v.into_pyobject(py).map(|b| b.into_any());
    let text = |v: &str| v.into_pyobject(py).map(|b| b.into_any());
    Ok(match err {
        PoolError::Pool(core) => match core {
            CoreError::EmptyBuffer => ("EmptyBufferError", vec![]),
            CoreError::BufferTooLarge {
                requested_bytes,
                pages,
                budget_bytes,
            } => (
                "BufferTooLargeError",
                vec![
                    f("requested_bytes", int(*requested_bytes)?),
                    f("pages", int(*pages)?),
                    f("budget_bytes", int(*budget_bytes)?),
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
                    f("requested_bytes", int(*requested_bytes)?),
                    f("needed_pages", int(*needed_pages)?),
                    f("free_pages", int(*free_pages)?),
                    f("total_pages", int(*total_pages)?),
                ],
            ),
            CoreError::TooManyBuffers { limit } => {
                ("TooManyBuffersError", vec![f("limit", int(*limit as u64)?)])
            }
            CoreError::UnknownBuffer(b) => ("UnknownBufferError", vec![f("buffer", int(b.0)?)]),
            CoreError::Freed(b) => ("BufferFreedError", vec![f("buffer", int(b.0)?)]),
            CoreError::BufferHeld { buffer, holders } => (
                "BufferHeldError",
                vec![
                    f("buffer", int(buffer.0)?),
                    f("holders", int(u64::from(*holders))?),
                ],
            ),
            CoreError::BufferBusy { buffer, mode } => (
                "BufferBusyError",
                vec![f("buffer", int(buffer.0)?), f("mode", text(mode.as_str())?)],
            ),
            CoreError::HeldAcquiresExceedBudget {
                buffer,
                held_bytes,
                requested_bytes,
                budget_bytes,
            } => (
                "HeldAcquiresExceedBudgetError",
                vec![
                    f("buffer", int(buffer.0)?),
                    f("held_bytes", int(*held_bytes)?),
                    f("requested_bytes", int(*requested_bytes)?),
                    f("budget_bytes", int(*budget_bytes)?),
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
                    f("buffer", int(buffer.0)?),
                    f("offset", int(*offset)?),
                    f("len", int(*len)?),
                    f("bytes", int(*bytes)?),
                ],
            ),
            CoreError::DeviceFailed(fault) => {
                ("DeviceError", vec![f("reason", text(&fault.message)?)])
            }
            CoreError::PageLost {
                buffer,
                page,
                reason,
            } => (
                "PageLostError",
                vec![
                    f("buffer", int(buffer.0)?),
                    f("page", int(u64::from(*page))?),
                    f("reason", text(&reason.to_string())?),
                ],
            ),
            CoreError::RemoteTierGone { reason } => (
                "RemoteTierGoneError",
                vec![f("reason", text(&reason.to_string())?)],
            ),
            CoreError::SpillsFailing {
                failing_ms,
                attempts,
                reason,
            } => (
                "SpillsFailingError",
                vec![
                    f("failing_ms", int(*failing_ms)?),
                    f("attempts", int(*attempts)?),
                    f("reason", text(&reason.to_string())?),
                ],
            ),
        },
        PoolError::Device(DeviceError::Unavailable { backend, reason }) => (
            "DeviceUnavailableError",
            vec![f("backend", text(backend)?), f("reason", text(reason)?)],
        ),
        PoolError::Device(_) => ("DeviceError", vec![]),
        PoolError::Config(c) => (
            "ConfigError",
            vec![f("field", text(c.field)?), f("problem", text(&c.problem)?)],
        ),
        PoolError::Missing(field) => ("ConfigError", vec![f("field", text(field)?)]),
        PoolError::NotHostVisible(backend) => {
            ("NotHostVisibleError", vec![f("backend", text(backend)?)])
        }
        PoolError::NoSuchPage { index, pages } => (
            "OutOfRangeError",
            vec![
                f("index", int(*index as u64)?),
                f("pages", int(*pages as u64)?),
            ],
        ),
        PoolError::NotExclusive => ("NotExclusiveError", vec![]),
        PoolError::Remote(reason) => ("RemoteError", vec![f("reason", text(&reason.to_string())?)]),
    })
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
    let (class, fields) = match class_and_fields(py, &err) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let exc = new_error(py, class, err.to_string());
    let value = exc.value(py);
    for (name, v) in fields {
        if let Err(e) = value.setattr(name, v) {
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
    let message = err.to_string();
    let text = |v: String| v.into_pyobject(py).map(|b| b.into_any().unbind());
    let int = |v: u64| v.into_pyobject(py).map(|b| b.into_any().unbind());
    let fields: PyResult<(&'static str, Vec<Field>)> = (|| {
        Ok(match &err {
            DaemonError::NoNode { socket, .. } => (
                "NoNodeError",
                vec![("socket", text(socket.display().to_string())?)],
            ),
            DaemonError::Connect { socket, source } => (
                "NodeLinkError",
                vec![
                    ("socket", text(socket.display().to_string())?),
                    ("reason", text(source.to_string())?),
                ],
            ),
            DaemonError::Refused { code, message } => (
                "NodeRefusedError",
                vec![
                    ("code", text(format!("{code:?}"))?),
                    ("reason", text(message.clone())?),
                ],
            ),
            DaemonError::VersionMismatch { node, client } => (
                "NodeProtocolError",
                vec![
                    ("node_version", int(u64::from(*node))?),
                    ("client_version", int(u64::from(*client))?),
                ],
            ),
            DaemonError::Protocol { reason } => {
                ("NodeProtocolError", vec![("reason", text(reason.clone())?)])
            }
            DaemonError::Io { source } => {
                ("NodeLinkError", vec![("reason", text(source.to_string())?)])
            }
            DaemonError::Map { bytes, source } => (
                "NodeLinkError",
                vec![
                    ("bytes", int(*bytes)?),
                    ("reason", text(source.to_string())?),
                ],
            ),
        })
    })();
    let (class, fields) = match fields {
        Ok(c) => c,
        Err(e) => return e,
    };
    let exc = new_error(py, class, message);
    let value = exc.value(py);
    for (name, v) in fields {
        if let Err(e) = value.setattr(name, v) {
            return e;
        }
    }
    exc
}
