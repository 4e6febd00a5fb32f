//! hprt-swap: activation swap between device and pinned host memory, written once against
//! `hprt_platform::Platform`.
//!
//! One engine, three front ends:
//! - [`SwapTensor`] / [`DeviceTensor`] — one saved value and its state machine
//!   (device → d2h → host → h2d → device, or non-tensor pass-through).
//! - [`payload`](Origin) — what the engine moves: owned hprt storage, borrowed framework memory
//!   re-acquired through the framework's [`Allocator`], and either compressed
//!   ([`Compression`]: on the device, or in a host stage on the pinned block).
//! - [`PinnedPool`] — pinned host blocks reused by size, bounded by a host budget.
//! - [`SwapEngine`] — batched offload/reload on the engine's copy streams, with every wait the
//!   invariants need (offload after the producer, release after the copy, use after the reload).
//! - [`SwapManager`] — hyper_parallel's layer-group swap: forward/backward hooks and the
//!   per-group calls (`add_storage`, `launch_offload`, `wait_offload`, `launch_load`, `wait_load`).
//! - [`KeyedSwap`] — (layer, index)-keyed `swap_out_cur_and_release_prev` /
//!   `wait_cur_and_prefetch_next` with proportional prefetch.
//! - [`PipelineOffload`] — chunked pipeline offload with groups, delays, warm-up and a summary
//!   (Megatron-LM).
//! - [`plan_offload`] — which layers to offload for a memory budget, an offload fraction or
//!   `auto` (what hides behind compute), from measured bytes, compute times and link speed.
//! - `sim` — a simulated N-layer step driven through each front end (the tests, `hprt bench`'s
//!   swap rows), with the non-default feature `sim`.
//! - `Faults` and `set_faults` — test-only switches that each remove one wait, with the
//!   non-default feature `test-faults` (the tests enable it; the product never does).

/// The engine accessors of a front end (a struct with an `engine: SwapEngine` field), so every
/// front end hands its engine out alike.
macro_rules! engine_accessors {
    () => {
        pub fn engine(&self) -> &SwapEngine {
            &self.engine
        }

        /// The engine, to choose compression (`set_compression`, `set_compression_policy`).
        pub fn engine_mut(&mut self) -> &mut SwapEngine {
            &mut self.engine
        }

        #[cfg(feature = "test-faults")]
        #[doc(hidden)]
        pub fn set_faults(&mut self, faults: crate::engine::Faults) {
            self.engine.set_faults(faults);
        }
    };
}

mod engine;
mod error;
mod keyed;
mod layer_group;
mod payload;
mod pipeline;
mod plan;
mod pool;
#[cfg(feature = "sim")]
pub mod sim;
mod tensor;

#[cfg(feature = "test-faults")]
pub use engine::Faults;
pub use engine::{
    EngineConfig, EngineStats, InflightWindow, PlatformHandle, ReleaseGuard, SwapEngine,
};
pub use error::{Result, SwapError, SwapState};
/// The names of layers and saved tensors, shared with hprt-compress's activation manager.
pub use hprt_compress::{LayerId, TensorKey};
pub use keyed::{
    proportional_slice, KeyedSwap, ModuleTag, Packed, SwapContext, SwapPredicate, TensorKeyManager,
};
pub use layer_group::{SavedRef, SwapManager};
pub use payload::{Compression, CompressionPolicy, SwapTensor};
pub use pipeline::{
    link_summary_table, offload_summary_table, ChunkId, OffloadTag, PipelineConfig, PipelineOffload,
};
pub use plan::{plan_offload, LayerProfile, OffloadPlan, PlanTarget};
pub use pool::{PinnedBlock, PinnedPool, PoolConfig, PoolStats};
pub use tensor::{
    Allocator, DeviceTensor, FrameworkHandle, Origin, Reacquired, Saved, VersionCounter,
};
