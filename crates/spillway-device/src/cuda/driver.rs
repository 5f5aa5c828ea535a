//! Loading the CUDA driver and asking it about GPUs. Every entry point starts here, so
//! that a machine without a driver gets [`DeviceError::Unavailable`] with a reason, not
//! a crash.
//!
//! Also the helpers every other module uses: [`check`] turns a `CUresult` into a
//! [`DeviceError::Driver`] naming the call, and [`lock`] takes one of our mutexes
//! whatever a panic left behind.
//!
//! Invariants: [`init_driver`] runs, and succeeds, before any other driver call of the
//! backend; it checks that libcuda is on the loader path before resolving any symbol.

use std::ffi::CStr;
use std::sync::{Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys;

use crate::DeviceError;

pub(crate) const SUCCESS: sys::CUresult = sys::CUresult::CUDA_SUCCESS;

pub(crate) fn unavailable(reason: impl Into<String>) -> DeviceError {
    DeviceError::Unavailable {
        backend: "cuda",
        reason: reason.into(),
    }
}

/// The driver's name and text for `r` (`CUDA_ERROR_OUT_OF_MEMORY: out of memory`).
pub(crate) fn result_text(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string of the driver, or leave
    // it null for an unknown code; we read the strings only when non-null.
    unsafe {
        let _ = sys::cuGetErrorName(r, &mut name);
        let _ = sys::cuGetErrorString(r, &mut text);
        let name = (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy());
        let text = (!text.is_null()).then(|| CStr::from_ptr(text).to_string_lossy());
        match (name, text) {
            (Some(n), Some(t)) => format!("{n}: {t}"),
            (Some(n), None) => n.into_owned(),
            _ => format!("CUresult {}", r as u32),
        }
    }
}

pub(crate) fn check(op: &'static str, r: sys::CUresult) -> Result<(), DeviceError> {
    if r == SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Driver {
            op,
            message: result_text(r),
        })
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of our locks leaves plain data (handles, lists) that is
    // still consistent: every update is a single push/pop/insert.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Loads the driver library and initialises it, or says why it cannot be used.
pub(crate) fn init_driver() -> Result<(), DeviceError> {
    // SAFETY: `is_culib_present` dlopens and closes libcuda; the library is designed to
    // be loaded this way and runs no code of ours.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable(
            "libcuda.so (the NVIDIA driver library) was not found on the loader path: \
             no NVIDIA driver, so no usable GPU, on this machine",
        ));
    }
    // SAFETY: the library is present (checked above), so resolving the symbol cannot
    // fail; cuInit may be called any number of times.
    let r = unsafe { sys::cuInit(0) };
    if r != SUCCESS {
        return Err(unavailable(format!(
            "the NVIDIA driver is installed but cuInit failed ({}): no usable GPU",
            result_text(r)
        )));
    }
    Ok(())
}

fn device_count() -> Result<usize, DeviceError> {
    let mut n = 0;
    // SAFETY: the driver is initialised (callers run `init_driver` first); writes one int.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

pub(crate) fn device_handle(ordinal: usize) -> Result<sys::CUdevice, DeviceError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(unavailable(if count == 0 {
            "the NVIDIA driver found no CUDA GPU".to_string()
        } else {
            format!("no CUDA GPU {ordinal}: the driver found {count}")
        }));
    }
    let mut dev = 0;
    // SAFETY: `ordinal < count`; writes one int.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal as i32)
    })?;
    Ok(dev)
}

pub(crate) fn device_name(dev: sys::CUdevice) -> Result<String, DeviceError> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the driver writes a NUL-terminated name of at most `len` bytes into `buf`.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev)
    })?;
    // SAFETY: NUL-terminated by the driver within the buffer (the last byte stays 0).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

pub(crate) fn device_attribute(
    dev: sys::CUdevice,
    attr: sys::CUdevice_attribute,
) -> Result<i32, DeviceError> {
    let mut v = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, dev)
    })?;
    Ok(v)
}

/// Whether a CUDA GPU can be used here; the name of GPU 0 if so. `--device auto` picks
/// `cuda` when this is `Ok`.
pub fn cuda_available() -> Result<String, DeviceError> {
    init_driver()?;
    let dev = device_handle(0)?;
    device_name(dev)
}
