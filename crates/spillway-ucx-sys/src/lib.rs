//! Raw bindings to UCX's `ucp` API (`ucp/api/ucp.h`), generated at build time by bindgen
//! against the system's UCX (>= 1.13, found through pkg-config).
//!
//! Only what `spillway-net`'s `ucx` module uses is bound (the allowlist in `build.rs`);
//! every call is `unsafe` and every invariant is kept by that module, which is the only
//! user. What bindgen cannot carry over is written out here:
//! - `ucp_init` is a static inline function in the header: call [`ucp_init_version`]
//!   with [`UCP_API_MAJOR`] and [`UCP_API_MINOR`];
//! - the status-pointer macros (`UCS_PTR_IS_ERR`, `UCS_PTR_STATUS`, ...) are
//!   [`status_ptr_is_err`], [`status_ptr_is_ptr`] and [`status_ptr_status`].

#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code
)]
#![allow(missing_docs, clippy::all, unsafe_op_in_unsafe_fn)]

include!(concat!(env!("OUT_DIR"), "/ucp.rs"));

/// `UCS_PTR_IS_ERR`: the pointer an `_nbx` call returned encodes an error status.
pub fn status_ptr_is_err(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_IS_PTR`: the pointer an `_nbx` call returned is a request (neither NULL,
/// meaning done, nor an error).
pub fn status_ptr_is_ptr(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize).wrapping_sub(1) < (UCS_ERR_LAST as isize as usize).wrapping_sub(1)
}

/// `UCS_PTR_STATUS`: `UCS_INPROGRESS` for a request, else the status the pointer encodes
/// (`UCS_OK` for NULL).
pub fn status_ptr_status(ptr: ucs_status_ptr_t) -> ucs_status_t {
    if status_ptr_is_ptr(ptr) {
        UCS_INPROGRESS
    } else {
        ptr as isize as ucs_status_t
    }
}
