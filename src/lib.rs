//! hprt — hyper-parallel runtime: the native layer under large-model training frameworks.
//!
//! This crate is the product library: the C ABI (`libhprt.so` / `libhprt.a`, `include/hprt.h`)
//! and a facade over the workspace's library crates. The tooling — the `hprt` binary (`hprt
//! info`, `hprt conformance`, `hprt bench`, `hprt demo`, `hprt compress`), the demo, the trace
//! decorator and the benchmarks — is the crate `hprt-cli` (`cli/`), so `libhprt` carries neither
//! clap, anyhow, zstd, lz4_flex nor the conformance suite.
//!
//! - [`platform`] — the `Platform` trait, handles, and the cpu / cuda / npu backends.
//! - [`swap`] — activation swap to pinned host memory.
//! - [`compress`] — lossless activation compression.
//! - [`hsdp`] — sharded parameters and gradient reduction.
//! - [`ffi`] — the C ABI (`include/hprt.h`), built into `libhprt.so` / `libhprt.a`.

// C entry points mirror the Platform calls argument for argument.
#[allow(clippy::too_many_arguments)]
pub mod ffi;

pub use hprt_compress as compress;
pub use hprt_hsdp as hsdp;
pub use hprt_platform as platform;
pub use hprt_swap as swap;

pub use hprt_platform::{get_platform, BackendKind, DType, Error, Platform, ReduceOp, Result};

/// The README's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
