//! hprt — hyper-parallel runtime: the native layer under large-model training frameworks.
//!
//! This facade re-exports the workspace's crates; the `hprt` binary (`hprt info`,
//! `hprt conformance`, `hprt bench`, `hprt demo`, `hprt compress`) lives beside it.
//!
//! The default feature `tooling` builds the binary, [`demo`] and [`trace`], and turns on the
//! workspace crates' bench / CLI / simulation modules. The C library is built without it
//! (`cargo build --lib --no-default-features`), so `libhprt.so` carries neither zstd, lz4_flex,
//! anyhow, clap nor the conformance crate.
//!
//! - [`platform`] — the `Platform` trait, handles, and the cpu / cuda / npu backends.
//! - [`swap`] — activation swap to pinned host memory (arrives with its issue).
//! - [`compress`] — lossless activation compression (arrives with its issue).
//! - [`hsdp`] — sharded parameters and gradient reduction (arrives with its issue).
//! - [`ffi`] — the C ABI (`include/hprt.h`), built into `libhprt.so` / `libhprt.a`.
//! - [`demo`] — `hprt demo`: a simulated training step under each memory strategy, compared.
//! - [`trace`] — a tracing `Platform` decorator, Chrome/Perfetto traces and ASCII timelines.

// C entry points mirror the Platform calls argument for argument.
#[allow(clippy::too_many_arguments)]
pub mod ffi;

#[cfg(feature = "tooling")]
pub mod demo;
#[cfg(feature = "tooling")]
pub mod trace;

pub use hprt_compress as compress;
pub use hprt_hsdp as hsdp;
pub use hprt_platform as platform;
pub use hprt_swap as swap;

pub use hprt_platform::{get_platform, BackendKind, DType, Error, Platform, ReduceOp, Result};

/// The README's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
