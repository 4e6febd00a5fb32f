//! hprt-cli: hprt's tooling, apart from the product library. The `hprt` binary (`hprt info`,
//! `hprt conformance`, `hprt bench`, `hprt demo`, `hprt compress|decompress|codec-stats`) is
//! built from this crate; `libhprt` (the C ABI) and the Python extension do not depend on it, so
//! neither carries clap, anyhow, zstd, lz4_flex, indicatif nor the conformance suite.
//!
//! - [`bench`](mod@bench) — `hprt bench`: every module against baselines measured in the same run.
//! - [`codec_cli`] — `hprt compress`, `hprt decompress`, `hprt codec-stats` on raw tensor files.
//! - [`demo`] — `hprt demo`: a simulated training step under each memory strategy, compared.
//! - [`trace`] — a tracing `Platform` decorator, Chrome/Perfetto traces and ASCII timelines.

pub mod bench;
pub mod codec_cli;
pub mod demo;
pub mod trace;
