//! hprt-compress: lossless compression of activations and weights (f32, f16, bf16), and the
//! machinery that compresses saved activations while the model computes.
//!
//! - [`format`] — the container of `FORMAT.md`: header, chunk table, checksums, worst-case size.
//! - [`codec`] — the CPU codec: sign+exponent symbols rANS-coded per chunk, mantissas raw,
//!   multi-threaded; decoding untrusted bytes returns [`CompressError`], never panics.
//! - [`device`] — the codec on a `Platform` stream ([`device::DeviceCodec`]; the host fallback
//!   every backend has) and [`device::CompressedTensor`], a [`device::SwapPayload`] a swap engine
//!   can offload (compress-then-swap).
//! - [`cost`] — measured, cached, overridable throughputs; operator durations and how much the
//!   codec can do within them.
//! - [`planner`] — layer order learned in the first step; which tensors fit a window.
//! - [`manager`] — the per-layer activation manager of seed 003.
//! - [`cli`] — `hprt compress`, `hprt decompress`, `hprt codec-stats`.
//! - [`bench`], [`data`] — the codec benchmark (against zstd level 1) and its synthetic tensors.

pub mod bench;
pub mod cli;
pub mod codec;
pub mod cost;
pub mod data;
pub mod device;
mod error;
pub mod format;
pub mod manager;
pub mod planner;

pub use error::{CompressError, Result};
pub use format::CodecDType;
