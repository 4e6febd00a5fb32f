//! hprt-compress: lossless compression of activations and weights (f32, f16, bf16), and the
//! machinery that compresses saved activations while the model computes.
//!
//! The crate root is the API; the modules behind it are private except three namespaces whose
//! items are named by their module: [`codec`] (the CPU codec: `codec::encode`, `codec::decode`,
//! their options; `codec::v2`, version 2's layout; `codec::cuda`, the same codec as CUDA C,
//! checked byte for byte as host C++), [`format`](mod@format) (the version-1 container of `FORMAT.md`:
//! header, chunk table, checksum and bounds) and [`data`] (synthetic tensors: the cost model
//! calibrates the codec on them, tests and benchmarks use them). Decoding untrusted bytes
//! returns [`CompressError`], never panics.

pub mod codec;
mod cost;
pub mod data;
mod device;
mod error;
pub mod format;
mod key;
mod manager;
mod planner;
mod select;

// The crate's one error, and the element types the codec takes.
pub use error::{CompressError, Result};
pub use format::CodecDType;

// The names of layers and saved tensors in every front end (swap's and the activation manager's).
pub use key::{LayerId, TensorKey};

// The codec on a `Platform` stream: one per backend (`codec_for`: the CUDA kernels through NVRTC
// on cuda, the CPU codec in host functions elsewhere), and the tensor it encodes into, which a
// swap engine offloads in compress-then-swap.
pub use device::{
    CompressedTensor, CudaCodec, DecodeItem, DeviceCodec, EncodeItem, HostCodec, PendingDecode,
    PendingEncode,
};
pub use select::codec_for;

// The cost model: measured, cached, overridable throughputs; operator durations and how much
// the codec can do within them.
pub use cost::{
    check_codec_predictions, measure_codec, measure_collective, CollectiveKind, CostModel,
    CostOverrides, CostTable, Op, PredictionCheck,
};

// The layer order learned in the first step, and which tensors fit a window.
pub use planner::{fit_window, LayerOrder};

// MindSpeed's per-layer activation manager.
pub use manager::{
    ActivationManager, LayerStats, ManagerConfig, Schedule, TensorFilter, WindowRecord,
    RECORDS_KEPT,
};
