//! Finds UCX's headers through pkg-config and generates bindings for the part of
//! `ucp/api/ucp.h` that spillway-net's UCX wrapper uses (the allowlist below). The
//! functions are bound for loading at run time (a struct of function pointers filled
//! through `libloading`), so nothing is linked: a binary with the `ucx` feature starts
//! without libucx, and asking it for UCX is then an error (`load` in `src/lib.rs`).
//! Missing headers or libclang are a build error that names `scripts/install-ucx.sh`.

use std::env;
use std::path::PathBuf;

const INSTALL_HINT: &str = "run scripts/install-ucx.sh (Debian: libucx-dev, pkg-config, libclang-dev), \
     or build without spillway-net's `ucx` feature";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    // Only the include paths: `cargo_metadata(false)` keeps pkg-config from emitting the
    // link directives of `ucx.pc` (the library is loaded at run time).
    let ucx = match pkg_config::Config::new()
        .atleast_version("1.13")
        .cargo_metadata(false)
        .probe("ucx")
    {
        Ok(lib) => lib,
        Err(e) => {
            panic!(
                "spillway-ucx-sys: UCX >= 1.13 not found through pkg-config ({e}); {INSTALL_HINT}"
            )
        }
    };
    let mut builder = bindgen::Builder::default()
        .header_contents("wrapper.h", "#include <ucp/api/ucp.h>\n")
        .allowlist_function(
            "ucp_(config_read|config_modify|config_release|init_version|cleanup|get_version_string\
             |worker_create|worker_destroy|worker_get_address|worker_release_address\
             |worker_progress|worker_get_efd|worker_arm\
             |ep_create|ep_close_nbx|tag_send_nbx|tag_recv_nbx|tag_probe_nb|tag_msg_recv_nbx\
             |request_check_status|request_free|request_cancel\
             |mem_map|mem_unmap)",
        )
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucs_status_t")
        .allowlist_type(
            "ucp_(params_field|feature|worker_params_field|ep_params_field\
             |mem_map_params_field|ep_close_flags_t|op_attr_t|dt_type|dt_iov_t)",
        )
        .allowlist_var("UCP_API_(MAJOR|MINOR)")
        // Flags and field masks as plain integer constants: a Rust enum holding a value
        // C never named (two flags or-ed) is undefined behaviour.
        .constified_enum("ucs_status_t")
        .constified_enum("ucp_.*")
        .constified_enum("ucs_thread_mode_t")
        .constified_enum("ucs_memory_type")
        .constified_enum("ucp_feature")
        .prepend_enum_name(false)
        // `Ucp::new` opens libucp and fails unless every function above is found in it
        // (or in the libraries it depends on: `ucs_status_string` is libucs's).
        .dynamic_library_name("Ucp")
        .dynamic_link_require_all(true)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(e) => panic!("spillway-ucx-sys: bindgen failed on ucp/api/ucp.h ({e}); {INSTALL_HINT}"),
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("ucp.rs");
    if let Err(e) = bindings.write_to_file(&out) {
        panic!("spillway-ucx-sys: cannot write {}: {e}", out.display());
    }
}
