//! `spillway.View`: an acquire held from Python, its memory exported through DLPack.
//!
//! `pool.acquire(buf)` waits (GIL released) until every page is on the GPU and returns a
//! `View` holding the SDK's [`Guard`]; `with ... as view:` releases it at `__exit__` (or
//! `view.release()`). While held, `view.__dlpack__()` exports the buffer as a 1-D `uint8`
//! tensor with no copy (dlpark's exporter): a CPU tensor on `sim` (frames are host memory),
//! a CUDA tensor on `cuda`, read-only for a shared acquire. The whole buffer is one tensor
//! when the device shows it as one array (the SDK's `Guard::device_ptr`): its pages in
//! consecutive frames (both backends; the core places a buffer's pages that way when it
//! can), or on `cuda` mapped into the buffer's range; a buffer of one page always is.
//! Otherwise `view.page(i)` exports page `i`.
//!
//! ## Lifetime contract
//! A tensor made from a view may be used only while the view is held. After `__exit__`
//! the pool may evict the pages and reuse the frames for other buffers, so the tensor
//! then shows whatever the frames hold next, and writes through it land in other
//! buffers' pages. This is never a crash: each exported tensor owns an `Arc` of the pool
//! (its DLPack deleter drops it), so the device memory it points into stays allocated
//! until the last tensor is gone, even after the `Pool` object itself is. Using the
//! `View` itself after release raises `ViewReleasedError`.
//!
//! ## The DLPack stream contract (on `cuda`)
//! - The consumer's stream sees the data: the acquire waited (GIL released) for the
//!   copies' events before the view exists, so the bytes are in device memory before any
//!   consumer stream can be handed the tensor; no stream-side wait is left to queue.
//! - The pool does not reuse the frames until the consumer's queued work has passed:
//!   each `__dlpack__(stream=s)` records `s` in the view's guard
//!   ([`Guard::release_after_stream`]; `None` is the legacy default stream `1`, `-1`
//!   asks for nothing), and the release at `__exit__` records an event on every such
//!   stream and lets the pool take the pages back only after those events (the SDK's
//!   `CudaDevice::after_streams_work`). `__exit__` does not block: a `with` block may end
//!   while the consumer's kernels are still queued.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use dlpark::ffi::{DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::python::{CudaStreamRequest, DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::{PyBufferError, PyRuntimeError};
use pyo3::prelude::*;
use spillway_client::{Buffer, DeviceKind, Guard, Pool};

use crate::errors::{self, IntoPyResult};

/// The acquire a view holds. Field order is drop order: the guard (which borrows the
/// pool) goes before the `Arc` that keeps the pool alive.
struct Held {
    guard: Guard<'static>,
    _pool: Arc<Pool>,
}

/// `spillway.View`: see the module docs.
#[pyclass(name = "View", module = "spillway._core", frozen)]
pub(crate) struct View {
    held: Mutex<Option<Held>>,
    pool: Arc<Pool>,
    buffer_name: String,
    /// Bytes of the buffer.
    #[pyo3(get)]
    nbytes: u64,
    /// Pages of the buffer.
    #[pyo3(get)]
    pages: usize,
    /// Whether the acquire is exclusive (`acquire_mut`): the view is writable.
    #[pyo3(get)]
    exclusive: bool,
    /// Whether every page was already on the GPU (no wait for a copy).
    #[pyo3(get)]
    hit: bool,
    /// Seconds the acquire waited for copies.
    #[pyo3(get)]
    waited_s: f64,
    device: DLDevice,
    /// The address of the whole buffer when it is contiguous in device memory.
    base_ptr: Option<u64>,
}

/// How a view acquires its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// `acquire`: read only.
    Shared,
    /// `acquire_mut`: writable.
    Exclusive,
    /// `acquire_mut(discard=True)`: writable, the old contents discarded.
    Discard,
}

impl View {
    /// Acquires `buffer` as `access` says with the GIL released; `paged`: never shown as
    /// one array (exported page by page unless it is one page).
    pub(crate) fn acquire(
        py: Python<'_>,
        pool: &Arc<Pool>,
        buffer: &Buffer,
        access: Access,
        paged: bool,
    ) -> PyResult<View> {
        let exclusive = access != Access::Shared;
        let guard = py
            .detach(|| match access {
                Access::Shared => pool.acquire(buffer),
                Access::Exclusive => pool.acquire_mut(buffer),
                Access::Discard => pool.acquire_discard(buffer),
            })
            .py_err(py)?;
        // SAFETY: the guard borrows the `Pool` inside `pool`'s allocation, which does not
        // move and lives as long as `Held::_pool`, dropped after the guard (field order);
        // the guard never escapes `Held`.
        let guard: Guard<'static> = unsafe { std::mem::transmute::<Guard<'_>, _>(guard) };
        let pages = guard.pages();
        // The whole buffer as one array (on `cuda` it may map pages: GIL released), unless
        // the caller reads it page by page.
        let whole = if paged {
            None
        } else {
            py.detach(|| guard.device_ptr()).py_err(py)?
        };
        let base_ptr = match whole {
            Some(p) => Some(p.0),
            None if pages == 1 => Some(guard.page_ptr(0).py_err(py)?.0),
            None => None,
        };
        let device = match pool.device_kind() {
            DeviceKind::Sim => DLDevice::CPU,
            // The CUDA backend runs on GPU 0.
            DeviceKind::Cuda => DLDevice::cuda(0),
        };
        Ok(View {
            hit: guard.hit(),
            waited_s: guard.waited().as_secs_f64(),
            held: Mutex::new(Some(Held {
                guard,
                _pool: pool.clone(),
            })),
            pool: pool.clone(),
            buffer_name: buffer.name().to_string(),
            nbytes: buffer.bytes(),
            pages,
            exclusive,
            device,
            base_ptr,
        })
    }

    /// Makes the release wait for the consumer's stream of `request` (module docs).
    fn note_stream(&self, request: &ExportRequest<'_>) -> PyResult<()> {
        if self.device == DLDevice::CPU {
            return Ok(());
        }
        let stream = match request.cuda_stream()? {
            CudaStreamRequest::NoSync => return Ok(()),
            CudaStreamRequest::Omitted | CudaStreamRequest::LegacyDefault => 1,
            CudaStreamRequest::PerThreadDefault => 2,
            CudaStreamRequest::Pointer(p) => p as u64,
        };
        if let Some(h) = self.lock().as_mut() {
            h.guard.release_after_stream(stream);
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Option<Held>> {
        // A panic while holding this lock leaves no broken state (an Option swap).
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The export of page `index`, or of the whole buffer for `None`.
    fn export(&self, py: Python<'_>, index: Option<usize>) -> PyResult<Export> {
        let held = self.lock();
        let Some(h) = held.as_ref() else {
            return Err(errors::new_error(
                py,
                "ViewReleasedError",
                format!(
                    "the view of {:?} was released: acquire the buffer again",
                    self.buffer_name
                ),
            ));
        };
        let (ptr, len) = match index {
            None => match self.base_ptr {
                Some(p) => (p, self.nbytes),
                None => {
                    return Err(PyBufferError::new_err(format!(
                        "buffer {:?} has {} pages that are not contiguous on the {} device: \
                         export them one by one with view.page(i), or use a page size of at \
                         least the buffer's size",
                        self.buffer_name,
                        self.pages,
                        self.pool.device_kind().name()
                    )));
                }
            },
            Some(i) => (
                h.guard.page_ptr(i).py_err(py)?.0,
                h.guard.page_len(i.min(self.pages.saturating_sub(1))),
            ),
        };
        Ok(Export {
            ptr,
            len,
            device: self.device,
            read_only: !self.exclusive,
            pool: self.pool.clone(),
        })
    }

    /// `__dlpack__` of page `index`, or of the whole buffer for `None`, as `request` (the
    /// call's arguments, parsed) asks; a bad argument raises only once the view is known
    /// to be held.
    fn dlpack(
        &self,
        py: Python<'_>,
        index: Option<usize>,
        request: PyResult<ExportRequest<'_>>,
    ) -> PyResult<Py<PyAny>> {
        let export = self.export(py, index)?;
        let request = request?;
        self.note_stream(&request)?;
        export_dlpack(&export, py, request)
    }
}

#[pymethods]
impl View {
    /// DLPack export of the whole buffer (see the module docs for when it is one tensor).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream, max_version, dl_device, copy);
        self.dlpack(py, None, request)
    }

    /// `(device type, device id)` as DLPack numbers them: `(1, 0)` CPU, `(2, 0)` CUDA.
    fn __dlpack_device__(&self) -> (u32, i32) {
        (self.device.device_type.0, self.device.device_id)
    }

    /// Page `index` of the buffer, itself exportable through DLPack.
    fn page(slf: Bound<'_, Self>, index: usize) -> PyResult<PageView> {
        let pages = slf.get().pages;
        if index >= pages {
            return Err(errors::new_error(
                slf.py(),
                "OutOfRangeError",
                format!("page {index} is past the end of a buffer of {pages} pages"),
            ));
        }
        Ok(PageView {
            view: slf.unbind(),
            index,
        })
    }

    /// Releases the acquire (what `__exit__` does); a second call does nothing.
    fn release(&self, py: Python<'_>) {
        let held = self.lock().take();
        // Dropping the guard takes the pool's mutex: not with the GIL held.
        py.detach(move || drop(held));
    }

    /// Whether the view still holds its pages.
    #[getter]
    fn held(&self) -> bool {
        self.lock().is_some()
    }
    /// Whether the whole buffer exports as one tensor.
    #[getter]
    fn contiguous(&self) -> bool {
        self.base_ptr.is_some()
    }
    /// `"cpu"` or `"cuda"`: where the exported tensors live.
    #[getter]
    fn device(&self) -> &'static str {
        if self.device == DLDevice::CPU {
            "cpu"
        } else {
            "cuda"
        }
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.release(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "View(buffer={:?}, nbytes={}, pages={}, exclusive={}, held={})",
            self.buffer_name,
            self.nbytes,
            self.pages,
            self.exclusive,
            self.held()
        )
    }
}

/// `spillway.PageView`: one page of a held view, exportable through DLPack.
#[pyclass(name = "PageView", module = "spillway._core", frozen)]
pub(crate) struct PageView {
    view: Py<View>,
    /// The page's index in its buffer.
    #[pyo3(get)]
    index: usize,
}

#[pymethods]
impl PageView {
    /// DLPack export of the page (valid while the view is held).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream, max_version, dl_device, copy);
        self.view.get().dlpack(py, Some(self.index), request)
    }

    /// As `View.__dlpack_device__`.
    fn __dlpack_device__(&self) -> (u32, i32) {
        self.view.get().__dlpack_device__()
    }
}

/// One DLPack export: a pointer and a length, and the pool kept alive by each tensor.
struct Export {
    ptr: u64,
    len: u64,
    device: DLDevice,
    read_only: bool,
    pool: Arc<Pool>,
}

impl Export {
    fn tensor<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let len = i64::try_from(self.len)
            .map_err(|_| PyRuntimeError::new_err("buffer too large for DLPack"))?;
        let prepared = dlpark::metadata::Fixed::new([len], [1_i64])
            .prepare_as::<M>()
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        // The tensor's owner: the pool, so the memory outlives every tensor (module docs).
        let mut init = prepared.initialize(Box::new(self.pool.clone()));
        init.set_data(self.ptr as *mut c_void)
            .set_dtype(DLDataType::U8)
            .set_device(self.device);
        // SAFETY: READ_ONLY is the only flag, and it only restricts the consumer.
        unsafe { init.set_flags_unchecked(self.flags()) };
        // SAFETY: data points at `len` bytes of device memory owned by the pool, which the
        // context keeps allocated until the deleter runs; shape and strides are stored in
        // the allocation; the flags say what a consumer may do (module docs: the contents
        // are the buffer's only while the view is held).
        Ok(unsafe { init.finish() })
    }
}

impl DlpackExporter for Export {
    fn device(&self) -> DLDevice {
        self.device
    }
    fn flags(&self) -> DlpackFlags {
        if self.read_only {
            DlpackFlags::READ_ONLY
        } else {
            DlpackFlags::empty()
        }
    }
    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        // The acquire waited for the copies to complete: the data is ready on any stream.
        Ok(())
    }
    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.tensor()
    }
    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.tensor()
    }
}
