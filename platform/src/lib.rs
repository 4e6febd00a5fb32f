//! hprt-platform: one interface to CUDA, Ascend and the cpu reference backend.
//!
//! - [`Platform`] — the object-safe trait modules above program against; [`get_platform`] picks
//!   one at run time from `HP_PLATFORM` (`cpu` | `cuda` | `npu`; unset = auto-detect).
//! - Handles: [`Stream`], [`Event`], [`DeviceBuffer`], [`PinnedBuffer`], [`Communicator`] —
//!   backend-neutral, cheap to clone, typed errors after destroy.
//! - [`Place`] — memory plus a byte offset; [`Memory`] — device or page-locked host memory (one
//!   end of a copy). Callers name memory with them over handles (`Place<&DeviceBuffer>`,
//!   `Memory<&DeviceBuffer, &PinnedBuffer>`), a [`Backend`] over its own memory types.
//! - [`TensorRef`] — a tensor in device memory (storage, byte offset and length, dtype, shape):
//!   what swap's `DeviceTensor`, the activation manager and the bindings describe tensors with.
//! - [`Collective`], [`DType`], [`ReduceOp`] — what collectives do, for every backend.
//! - [`Capabilities`] — what a platform can do ([`Platform::capabilities`]): what the layers
//!   above branch on, never a backend's name.
//! - [`Backend`] — the static per-backend trait; every `Backend` is a `Platform` (`dispatch`).
//! - [`cpu`] — the reference backend: streams are worker threads, device memory has a capacity,
//!   ranks are threads, and `HP_CPU_JITTER` makes missing waits visible.
//! - [`cuda`] — CUDA driver API through cudarc, NCCL and NVRTC loaded at run time; probed first,
//!   so machines without CUDA get a typed `Unavailable` error (`HP_CUDA_LIB`, `HP_NCCL_LIB`,
//!   `HP_NVRTC_LIB` override the library search).
//! - [`npu`] — Ascend ACL + HCCL through `hprt-sys` (verified against the emulator in `tests/ascend-emulator`).
//! - [`Error`] — the crate's one error: backend, operation, status code and name, message;
//!   [`HprtStatus`] — hprt's one table of status numbers (the C ABI returns it).
//! - [`sync::lock`] — the poison-tolerant mutex lock every hprt crate uses.
//! - [`StreamClock`] / [`StreamMark`] — when a stream reached a point, on the host's monotonic
//!   clock ([`host_seconds`], Python's `perf_counter()`): the one mechanism hprt's tracers use.

mod auxil;
mod backend;
mod capabilities;
mod collective;
pub mod cpu;
pub mod cuda;
mod dispatch;
mod dtype;
#[cfg(test)]
mod emulated_tests;
mod error;
mod handle;
mod host_errors;
mod info;
mod kernel;
mod memory;
mod names;
pub mod npu;
mod place;
mod platform;
mod select;
pub mod sync;
mod tensor;
mod trace;

pub use backend::Backend;
pub use capabilities::{Capabilities, CapabilityValue};
pub use collective::{Collective, DEFAULT_COLLECTIVE_TIMEOUT};
pub use cpu::{CpuBackend, CpuConfig, HOST_STREAM as CPU_HOST_STREAM};
pub use cuda::CudaBackend;
pub use dtype::{DType, ReduceOp};
pub use error::{BackendKind, Error, ErrorKind, HprtStatus, Result};
pub use handle::{
    Communicator, CopyKind, DeviceBuffer, Event, PinnedBuffer, RawStream, ReleaseFn, Stream,
    UniqueId,
};
pub use info::{DeviceInfo, LibraryProbe, PlatformInfo};
pub use kernel::{Access, DeviceModule, HostFn, HostMemoryFn, Kernel, KernelArg, LaunchShape};
pub use memory::{MemInfo, MemoryCounter, MemoryStats};
pub use names::UnknownName;
pub use npu::NpuBackend;
pub use place::{Memory, Place};
pub use platform::{Platform, PlatformHandle};
pub use select::{
    get_platform, platform_selection_reason, select_platform, PlatformRequest, Selection,
};
pub use tensor::TensorRef;
pub use trace::{host_seconds, StreamClock, StreamMark, REANCHOR_AFTER_S};
