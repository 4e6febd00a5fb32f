//! hprt-sys: raw FFI for the Ascend ACL runtime and HCCL.
//!
//! - `include/hprt_ascend.h` — our own header of the subset hprt uses, written from the public
//!   CANN API; [`types`], [`AclApi`] and [`HcclApi`] are bindgen's output for it (committed under
//!   `src/generated/`, checked for drift by `tests/bindgen_drift.rs`).
//! - [`load`] — finds and opens `libascendcl.so` and `libhccl.so` with libloading, in the
//!   documented search order, and checks every required symbol; optional symbols stay `Err` in
//!   the tables and are probed before use.
//! - [`acl_error_name`], [`hccl_result_name`] — every status code of the header by name.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

mod loader;
mod status;

// The three modules below are bindgen's output, committed verbatim (`tests/bindgen_drift.rs`
// fails on any hand edit), so they carry no SAFETY comments: the workspace's
// `undocumented_unsafe_blocks = "deny"` is allowed here. Their unsafe code is bindgen's own: the
// zeroing `Default` of `HcclRootInfo` (a byte array, for which all-zero is valid), and the
// libloading function tables, whose `unsafe fn`s leave the C contract to hprt's callers (no
// unsafe block there today; allowed on all three so a bindgen upgrade cannot break the build).

/// Types and constants of `hprt_ascend.h`.
#[rustfmt::skip]
#[allow(dead_code, clippy::all, clippy::undocumented_unsafe_blocks)]
pub mod types {
    include!("generated/types.rs");
}

#[rustfmt::skip]
#[allow(dead_code, clippy::all, clippy::undocumented_unsafe_blocks)]
mod acl {
    use super::types::*;
    include!("generated/acl.rs");
}

#[rustfmt::skip]
#[allow(dead_code, clippy::all, clippy::undocumented_unsafe_blocks)]
mod hccl {
    use super::types::*;
    include!("generated/hccl.rs");
}

pub use acl::AclApi;
pub use hccl::HcclApi;
pub use loader::{load, load_with, Ascend, Candidate, LoadError, SearchEnv, OPTIONAL_SYMBOLS};
pub use status::{acl_error_name, hccl_result_name};
