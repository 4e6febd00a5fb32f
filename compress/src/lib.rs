//! hprt-compress: lossless activation compression (codec, cost model, planner, layer manager).

pub mod bench;
pub mod codec;
pub mod data;
mod error;
pub mod format;

pub use error::{CompressError, Result};
pub use format::CodecDType;
