//! hprt-compress: lossless compression of activations and weights (f32, f16, bf16), and the
//! machinery that compresses saved activations while the model computes.
//!
//! - [`format`] — the version-1 container of `FORMAT.md` (header, chunk table), the checksum
//!   and its bounds; version 2's layout is [`codec::v2`].
//! - [`codec`] — the CPU codec: sign+exponent symbols rANS-coded (v2: one table per tensor,
//!   blocks of 32 interleaved states, AVX2 where available), mantissas raw, multi-threaded;
//!   decoding untrusted bytes returns [`CompressError`], never panics. [`codec::cuda`] holds the
//!   same codec as CUDA C (checked byte for byte as host C++) and [`device::CudaCodec`],
//!   which launches it through the cuda backend's NVRTC.
//! - [`device`] — the codec on a `Platform` stream ([`device::DeviceCodec`], chosen per backend
//!   by [`device::codec_for`]) and [`device::CompressedTensor`], a [`device::SwapPayload`] a swap
//!   engine can offload (compress-then-swap).
//! - [`cost`] — measured, cached, overridable throughputs; operator durations and how much the
//!   codec can do within them.
//! - [`key`] — [`LayerId`] and [`TensorKey`], the names of layers and saved tensors in every
//!   front end (swap's and the activation manager's).
//! - [`planner`] — layer order learned in the first step; which tensors fit a window.
//! - [`manager`] — MindSpeed's per-layer activation manager.
//! - [`data`] — synthetic tensors (the cost model calibrates the codec on them).
//! - `cli` — `hprt compress`, `hprt decompress`, `hprt codec-stats`; `bench` — the codec
//!   benchmark (against zstd level 1 and LZ4). Both only with the non-default feature
//!   `tooling`, so the library the C ABI and the Python wheel link carries neither zstd nor
//!   lz4_flex.

#[cfg(feature = "tooling")]
pub mod bench;
#[cfg(feature = "tooling")]
pub mod cli;
pub mod codec;
pub mod cost;
pub mod data;
pub mod device;
mod error;
pub mod format;
pub mod key;
pub mod manager;
pub mod planner;

pub use error::{CompressError, Result};
pub use format::CodecDType;
pub use key::{LayerId, TensorKey};
