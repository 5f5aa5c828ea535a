//! `spillway._core`: the Spillway SDK ([`spillway_client`]) for Python, built by maturin
//! into the `spillway` package (`python/spillway`, which re-exports these classes).
//!
//! Parts: [`PyPool`] (`spillway.Pool`) owns an embedded [`Pool`] behind an `Arc`;
//! [`PyBuffer`] (`spillway.Buffer`) is a handle; `view` holds an acquire and exports it
//! through DLPack; `errors` turns each [`spillway_client::PoolError`] into its exception
//! class (`spillway/_errors.py`); `size` reads `"8GiB"`.
//!
//! The GIL: every call that can wait on the pool (building it, `alloc`, `free`, `write`,
//! `read`, `acquire*`, releasing a view, `step`) runs inside `py.detach`, so other Python
//! threads run while copies land. The pool never needs the GIL: its completions arrive on
//! the device's threads, which take only the pool's mutex. Lock order: the GIL (or none),
//! then the pool's mutex; never the other way.
//!
//! No panic crosses into Python: PyO3 turns one into a `PanicException`, and every error
//! the SDK returns is a typed exception.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};
use spillway_client::daemon::DaemonLink;
use spillway_client::{Buffer, DeviceChoice, PageSize, Policy, Pool, PoolBuilder};

mod errors;
mod size;
mod view;

use errors::IntoPyResult;

/// `spillway.Pool`: a tiered pool (GPU frames over host slots) in this process.
#[pyclass(name = "Pool", module = "spillway._core", frozen)]
pub(crate) struct PyPool {
    pub(crate) pool: Arc<Pool>,
    page_bytes: u64,
    /// Daemon mode: the link to the node (its socket stays open while the pool lives).
    link: Option<DaemonLink>,
}

/// The arguments `Pool()` and `Pool.connect` share, checked: a bad one raises
/// `ValueError` naming it.
struct PoolArgs {
    gpu: u64,
    host: u64,
    page: PageSize,
    device: DeviceChoice,
    policy: Policy,
    /// Bytes of copies in flight each way (`None`: the default).
    in_flight: Option<u64>,
}

impl PoolArgs {
    fn parse(
        gpu_budget: &Bound<'_, PyAny>,
        host_budget: &Bound<'_, PyAny>,
        page_size: Option<&Bound<'_, PyAny>>,
        device: &str,
        policy: &str,
    ) -> PyResult<PoolArgs> {
        let gpu = size::size_arg("gpu_budget", gpu_budget)?;
        let host = size::size_arg("host_budget", host_budget)?;
        let page = match page_size {
            None => PageSize::DEFAULT,
            Some(p) => PageSize::new(size::size_arg("page_size", p)?)
                .map_err(|e| PyValueError::new_err(format!("page_size: {e}")))?,
        };
        let device: DeviceChoice = device
            .parse()
            .map_err(|e| PyValueError::new_err(format!("device: {e}")))?;
        let policy: Policy = policy
            .parse()
            .map_err(|e| PyValueError::new_err(format!("policy: {e}")))?;
        Ok(PoolArgs {
            gpu,
            host,
            page,
            device,
            policy,
            in_flight: None,
        })
    }

    /// These arguments with `copy_bytes_in_flight` (a size of at least a page) when given.
    fn in_flight(mut self, copy_bytes_in_flight: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let Some(b) = copy_bytes_in_flight else {
            return Ok(self);
        };
        let b = size::size_arg("copy_bytes_in_flight", b)?;
        if b < self.page.bytes() {
            return Err(PyValueError::new_err(format!(
                "copy_bytes_in_flight: {b} bytes is less than a page ({} bytes)",
                self.page.bytes()
            )));
        }
        self.in_flight = Some(b);
        Ok(self)
    }

    /// `builder` with the GPU budget, policy and device set; its host tier (budget and
    /// page size) is the caller's.
    fn gpu_side(&self, builder: PoolBuilder) -> PoolBuilder {
        let builder = builder
            .gpu_budget_bytes(self.gpu)
            .policy(self.policy)
            .device(self.device);
        match self.in_flight {
            Some(b) => builder.copy_bytes_in_flight(b),
            None => builder,
        }
    }

    /// The Python pool over `pool`, built from these arguments (with the node's `link`
    /// in daemon mode).
    fn into_pool(self, pool: Pool, link: Option<DaemonLink>) -> PyPool {
        PyPool {
            pool: Arc::new(pool),
            page_bytes: self.page.bytes(),
            link,
        }
    }
}

/// `spillway.Buffer`: a buffer of a pool; a handle, freed with `Pool.free`.
#[pyclass(name = "Buffer", module = "spillway._core", frozen)]
pub(crate) struct PyBuffer {
    pub(crate) buffer: Buffer,
}

#[pymethods]
impl PyBuffer {
    /// The name given at `alloc`.
    #[getter]
    fn name(&self) -> &str {
        self.buffer.name()
    }
    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.buffer.bytes()
    }
    /// The pool's id of the buffer (as in the errors' `buffer` attribute).
    #[getter]
    fn id(&self) -> u64 {
        self.buffer.id().0
    }
    fn __len__(&self) -> usize {
        self.buffer.bytes() as usize
    }
    fn __repr__(&self) -> String {
        format!(
            "Buffer(name={:?}, nbytes={}, id={})",
            self.buffer.name(),
            self.buffer.bytes(),
            self.buffer.id().0
        )
    }
}

/// The bytes of a bytes-like object: `bytes` without a copy, others copied once (the
/// buffer protocol is not in the stable ABI before 3.11, so `bytes(data)` reads them).
enum Data<'py> {
    Borrowed(Bound<'py, PyBytes>),
    Owned(Vec<u8>),
}

impl<'py> Data<'py> {
    fn from_any(data: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(b) = data.cast::<PyBytes>() {
            return Ok(Data::Borrowed(b.clone()));
        }
        if let Ok(b) = data.cast::<PyByteArray>() {
            return Ok(Data::Owned(b.to_vec()));
        }
        let py = data.py();
        let bytes = py
            .import("builtins")?
            .getattr("bytes")?
            .call1((data,))
            .map_err(|_| {
                PyValueError::new_err(format!(
                    "data: expected a bytes-like object, got {}",
                    data.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                ))
            })?;
        Ok(Data::Borrowed(bytes.cast_into::<PyBytes>()?))
    }
    fn as_slice(&self) -> &[u8] {
        match self {
            Data::Borrowed(b) => b.as_bytes(),
            Data::Owned(v) => v,
        }
    }
}

#[pymethods]
impl PyPool {
    /// See `spillway/_core.pyi`.
    #[new]
    #[pyo3(signature = (gpu_budget, host_budget, page_size=None, device="auto", policy="learned", copy_bytes_in_flight=None))]
    fn new(
        py: Python<'_>,
        gpu_budget: &Bound<'_, PyAny>,
        host_budget: &Bound<'_, PyAny>,
        page_size: Option<&Bound<'_, PyAny>>,
        device: &str,
        policy: &str,
        copy_bytes_in_flight: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let args = PoolArgs::parse(gpu_budget, host_budget, page_size, device, policy)?
            .in_flight(copy_bytes_in_flight)?;
        let pool = py
            .detach(|| {
                args.gpu_side(PoolBuilder::new())
                    .host_budget_bytes(args.host)
                    .page_size(args.page)
                    .build()
            })
            .py_err(py)?;
        Ok(args.into_pool(pool, None))
    }

    /// Daemon mode: a pool whose host tier is memory shared with the node listening on
    /// `socket` (`spillway node` or `spillway cluster up`), and whose remote tier is the
    /// node's (its peers' RAM). See `spillway/_core.pyi`.
    #[staticmethod]
    #[pyo3(signature = (socket, gpu_budget, host_budget, page_size=None, device="auto", policy="learned", copy_bytes_in_flight=None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn connect(
        py: Python<'_>,
        socket: std::path::PathBuf,
        gpu_budget: &Bound<'_, PyAny>,
        host_budget: &Bound<'_, PyAny>,
        page_size: Option<&Bound<'_, PyAny>>,
        device: &str,
        policy: &str,
        copy_bytes_in_flight: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let args = PoolArgs::parse(gpu_budget, host_budget, page_size, device, policy)?
            .in_flight(copy_bytes_in_flight)?;
        let (link, pool) = py
            .detach(|| {
                let link = DaemonLink::connect(&socket, args.host, args.page)
                    .map_err(errors::ConnectError::Daemon)?;
                let pool = args
                    .gpu_side(link.pool_builder())
                    .build()
                    .map_err(errors::ConnectError::Pool)?;
                Ok::<_, errors::ConnectError>((link, pool))
            })
            .map_err(|e| e.into_py(py))?;
        Ok(args.into_pool(pool, Some(link)))
    }

    /// The node's socket in daemon mode (`Pool.connect`), else `None`.
    #[getter]
    fn socket(&self) -> Option<std::path::PathBuf> {
        self.link.as_ref().map(|l| l.socket().to_path_buf())
    }

    /// This client's number on its node in daemon mode, else `None`.
    #[getter]
    fn client_id(&self) -> Option<u32> {
        self.link.as_ref().map(|l| l.client_id())
    }

    /// Registers a buffer of `nbytes` (zeros); returns its handle.
    fn alloc(&self, py: Python<'_>, name: &str, nbytes: &Bound<'_, PyAny>) -> PyResult<PyBuffer> {
        let nbytes = size::size_arg("nbytes", nbytes)?;
        let pool = &self.pool;
        let buffer = py.detach(|| pool.alloc(name, nbytes)).py_err(py)?;
        Ok(PyBuffer { buffer })
    }

    /// Frees a buffer; an error if it is acquired, freed or unknown.
    fn free(&self, py: Python<'_>, buf: &PyBuffer) -> PyResult<()> {
        let pool = &self.pool;
        py.detach(|| pool.free(&buf.buffer)).py_err(py)
    }

    /// Writes `data` (bytes-like) at `offset` of `buf`, wherever its pages are.
    fn write(
        &self,
        py: Python<'_>,
        buf: &PyBuffer,
        offset: u64,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let data = Data::from_any(data)?;
        let bytes = data.as_slice();
        let pool = &self.pool;
        py.detach(|| pool.write(&buf.buffer, offset, bytes))
            .py_err(py)
    }

    /// Reads `n` bytes at `offset` of `buf`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        buf: &PyBuffer,
        offset: u64,
        n: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let pool = &self.pool;
        let out = py
            .detach(|| {
                let mut out = vec![0u8; n];
                pool.read(&buf.buffer, offset, &mut out).map(|()| out)
            })
            .py_err(py)?;
        Ok(PyBytes::new(py, &out))
    }

    /// Waits until every page of `buf` is on the GPU; returns a view (a context manager)
    /// that holds them there, shared, until its `with` block ends. With `paged=True` the
    /// view is read page by page (`view.page(i)`): the device does not show the buffer as
    /// one array (on `cuda`, nothing is mapped into its range), and a buffer of several
    /// pages is `contiguous` only if it is one page.
    #[pyo3(signature = (buf, *, paged = false))]
    fn acquire(&self, py: Python<'_>, buf: &PyBuffer, paged: bool) -> PyResult<view::View> {
        view::View::acquire(py, &self.pool, &buf.buffer, view::Access::Shared, paged)
    }

    /// As `acquire`, exclusively: the view is writable and the pages become dirty. With
    /// `discard=True` the caller overwrites every byte: pages off the GPU get frames
    /// without a copy and their bytes are undefined until written (not zeros); the old
    /// contents are gone. `paged` as for `acquire`.
    #[pyo3(signature = (buf, *, discard = false, paged = false))]
    fn acquire_mut(
        &self,
        py: Python<'_>,
        buf: &PyBuffer,
        discard: bool,
        paged: bool,
    ) -> PyResult<view::View> {
        let access = if discard {
            view::Access::Discard
        } else {
            view::Access::Exclusive
        };
        view::View::acquire(py, &self.pool, &buf.buffer, access, paged)
    }

    /// Marks the end of a step (one iteration of the job): the prefetcher learns per step.
    fn step(&self, py: Python<'_>) {
        let pool = &self.pool;
        py.detach(|| pool.step());
    }

    /// The counters so far, as a dict (keys in `spillway/_core.pyi`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.pool.stats();
        let c = s.core;
        let page = self.page_bytes;
        let d = PyDict::new(py);
        d.set_item("acquires", c.acquires)?;
        d.set_item("hits", c.hits)?;
        d.set_item("stalls", c.acquires - c.hits)?;
        d.set_item("stall_s", s.stall.as_secs_f64())?;
        d.set_item("steps", c.steps)?;
        d.set_item("h2d_bytes", c.h2d_bytes)?;
        d.set_item("d2h_bytes", c.d2h_bytes)?;
        d.set_item("demand_loads", c.demand_loads)?;
        d.set_item("prefetch_loads", c.prefetch_loads)?;
        d.set_item("prefetch_wasted_pages", c.prefetch_wasted)?;
        d.set_item("prefetch_wasted_bytes", c.prefetch_wasted * page)?;
        d.set_item("overwrite_pages", c.overwrites)?;
        d.set_item("reserved_pages", c.reservations)?;
        d.set_item("reserved_pages_missed", c.reservations_missed)?;
        d.set_item("evictions_clean", c.evictions_clean)?;
        d.set_item("evictions_dirty", c.evictions_dirty)?;
        d.set_item("gpu_bytes", c.frames_in_use * page)?;
        d.set_item("gpu_bytes_peak", c.frames_in_use_peak * page)?;
        d.set_item("gpu_budget_bytes", c.frames_total * page)?;
        d.set_item("host_bytes", c.slots_in_use * page)?;
        d.set_item("host_budget_bytes", c.slots_total * page)?;
        d.set_item("remote_bytes", c.remote_pages * page)?;
        d.set_item("remote_budget_bytes", c.remote_pages_total * page)?;
        d.set_item("remote_bytes_in", c.remote_bytes_in)?;
        d.set_item("remote_bytes_out", c.remote_bytes_out)?;
        d.set_item("remote_errors", c.remote_errors)?;
        d.set_item("pages_lost", c.pages_lost)?;
        d.set_item("buffers_lost", c.buffers_lost)?;
        d.set_item("buffers", c.buffers)?;
        d.set_item("page_bytes", page)?;
        d.set_item("h2d_bytes_per_s", c.h2d_bytes_per_s)?;
        d.set_item("d2h_bytes_per_s", c.d2h_bytes_per_s)?;
        // The pool's own time besides stalls: on the caller's threads (a step waits for
        // it) and on the device's (beside the step).
        let t = s.timings;
        d.set_item("lock_wait_s", t.lock_wait.as_secs_f64())?;
        d.set_item("planning_s", t.planning.as_secs_f64())?;
        d.set_item("view_s", t.view.as_secs_f64())?;
        d.set_item("device_lock_wait_s", t.device_lock_wait.as_secs_f64())?;
        d.set_item("device_planning_s", t.device_planning.as_secs_f64())?;
        d.set_item("mapping_s", s.device.mapping_s)?;
        d.set_item("pages_mapped_ahead", s.device.pages_mapped_ahead)?;
        d.set_item("map_ahead_s", s.device.map_ahead_s)?;
        d.set_item("pages_remapped", s.device.pages_remapped)?;
        d.set_item("completions_late", s.device.completions_late)?;
        Ok(d)
    }

    /// `"sim"` or `"cuda"`: the backend the pool runs on.
    #[getter]
    fn device(&self) -> &'static str {
        self.pool.device_kind().name()
    }

    /// The page size in bytes.
    #[getter]
    fn page_size(&self) -> u64 {
        self.page_bytes
    }

    fn __repr__(&self) -> String {
        let c = self.pool.config();
        let socket = match &self.link {
            Some(l) => format!(", socket={:?}", l.socket().display().to_string()),
            None => String::new(),
        };
        format!(
            "Pool(gpu_budget={}, host_budget={}, page_size={}, device={:?}, policy={:?}{socket})",
            c.gpu_budget_bytes,
            c.host_budget_bytes,
            self.page_bytes,
            self.pool.device_kind().name(),
            c.policy.name()
        )
    }
}

/// The module `spillway._core`.
#[pymodule(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPool>()?;
    m.add_class::<PyBuffer>()?;
    m.add_class::<view::View>()?;
    m.add_class::<view::PageView>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
