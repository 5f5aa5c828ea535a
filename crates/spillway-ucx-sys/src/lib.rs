//! Raw bindings to UCX's `ucp` API (`ucp/api/ucp.h`), generated at build time by bindgen
//! against the system's UCX headers (>= 1.13, found through pkg-config), and loaded at
//! run time: nothing links libucp, so a binary built with spillway-net's `ucx` feature
//! starts on a machine without UCX, and only asking it for UCX fails there.
//!
//! Only what `spillway-net`'s `ucx` module uses is bound (the allowlist in `build.rs`).
//! The functions are the fields (and same-named `unsafe` methods) of [`Ucp`], filled by
//! [`load`] from libucp; `ucs_status_string`, which is libucs's, is found through
//! libucp's own dependency on libucs. Every call is `unsafe` and every invariant is kept
//! by that module, which is the only user. What bindgen cannot carry over is written out
//! here:
//! - `ucp_init` is a static inline function in the header: call [`Ucp::ucp_init_version`]
//!   with [`UCP_API_MAJOR`] and [`UCP_API_MINOR`];
//! - the status-pointer macros (`UCS_PTR_IS_ERR`, `UCS_PTR_STATUS`, ...) are
//!   [`status_ptr_is_err`], [`status_ptr_is_ptr`] and [`status_ptr_status`].
//!
//! Which library [`load`] opens: the path in [`LIBRARY_ENV`] (`SPILLWAY_UCX_LIB`) if it
//! is set, else the first of [`LIBRARY_NAMES`] the dynamic loader finds (`libucp.so.0`,
//! the soname of Debian's `libucx0`, then `libucp.so`). It loads once per process and
//! keeps the library loaded until the process exits (UCX is never unloaded under a live
//! worker). When none loads, [`LoadError`] names what was tried, the loader's message and
//! how to install UCX.

#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code
)]
#![allow(missing_docs, clippy::all, unsafe_op_in_unsafe_fn)]

include!(concat!(env!("OUT_DIR"), "/ucp.rs"));

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::sync::OnceLock;

/// Environment variable naming the libucp to load instead of [`LIBRARY_NAMES`]: a path
/// (`/opt/ucx/lib/libucp.so.0`), or a file name the dynamic loader searches for.
pub const LIBRARY_ENV: &str = "SPILLWAY_UCX_LIB";

/// Names tried in order when [`LIBRARY_ENV`] is not set: the soname that Debian's
/// `libucx0` ships, then the unversioned name of a development install.
pub const LIBRARY_NAMES: [&str; 2] = ["libucp.so.0", "libucp.so"];

/// How to get libucp, ending every [`LoadError`].
const INSTALL_HINT: &str = "install UCX's runtime library (Debian package libucx0; \
     scripts/install-ucx.sh installs it with the build tools), or set SPILLWAY_UCX_LIB \
     to the path of libucp.so.0";

/// Why libucp could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// No library of those tried could be opened.
    NotFound {
        /// What was tried, in order (paths or file names).
        tried: Vec<String>,
        /// Whether `tried` came from [`LIBRARY_ENV`].
        from_env: bool,
        /// The dynamic loader's message for each of `tried`.
        dlopen: Vec<String>,
    },
    /// A library opened but lacks a function the bindings need (not UCX, or a UCX
    /// older than the headers the bindings were generated from).
    MissingFunction {
        /// The library opened.
        library: String,
        /// The dynamic loader's message.
        dlsym: String,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotFound {
                tried,
                from_env,
                dlopen,
            } => {
                let from = if *from_env {
                    format!(" from {LIBRARY_ENV}")
                } else {
                    String::new()
                };
                write!(
                    f,
                    "UCX library not found: cannot load libucp (tried {}{from}): {}; {INSTALL_HINT}",
                    tried.join(", "),
                    dlopen.join("; "),
                )
            }
            LoadError::MissingFunction { library, dlsym } => write!(
                f,
                "{library} is not a usable UCX (1.13 or later): {dlsym}; {INSTALL_HINT}"
            ),
        }
    }
}

impl std::error::Error for LoadError {}

/// The process's libucp, loaded on first use (see the crate docs for which one); later
/// calls return the same library, or the same error.
pub fn load() -> Result<&'static Ucp, LoadError> {
    static LOADED: OnceLock<Result<Ucp, LoadError>> = OnceLock::new();
    LOADED
        .get_or_init(|| match std::env::var_os(LIBRARY_ENV) {
            Some(path) if !path.is_empty() => load_first(&[path], true),
            _ => load_first(&LIBRARY_NAMES.map(OsString::from), false),
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Loads `library` (a path or a file name) afresh, ignoring [`LIBRARY_ENV`] and what
/// [`load`] holds: for tests of the error, and for tools that name their libucp.
/// Dropping the result unloads the library if nothing else holds it.
pub fn load_from(library: impl AsRef<OsStr>) -> Result<Ucp, LoadError> {
    load_first(&[library.as_ref().to_os_string()], false)
}

fn load_first(candidates: &[OsString], from_env: bool) -> Result<Ucp, LoadError> {
    let mut dlopen = Vec::with_capacity(candidates.len());
    for candidate in candidates {
        // SAFETY: opening libucp runs its initialisers (UCX's global setup), which are
        // made to run in any process that uses UCX, exactly as when it was linked. Which
        // file is opened is the user's choice, as with LD_LIBRARY_PATH.
        let library = match unsafe { libloading::Library::new(candidate) } {
            Ok(library) => library,
            Err(e) => {
                dlopen.push(e.to_string());
                continue;
            }
        };
        // SAFETY: every function is looked up under its C name and given the type bindgen
        // generated from UCX's own declaration of it; UCX keeps its 1.x ABI stable, and a
        // library lacking a function fails here instead of at its first call.
        return unsafe { Ucp::from_library(library) }.map_err(|e| LoadError::MissingFunction {
            library: candidate.to_string_lossy().into_owned(),
            dlsym: e.to_string(),
        });
    }
    Err(LoadError::NotFound {
        tried: candidates
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect(),
        from_env,
        dlopen,
    })
}

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
