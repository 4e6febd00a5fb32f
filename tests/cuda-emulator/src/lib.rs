//! An emulator of the CUDA driver, NCCL and NVRTC subset hprt's cuda backend loads
//! (`platform/src/cuda`: `DRIVER_SYMBOLS`, the NCCL and NVRTC tables), so that backend runs in CI
//! without a GPU: point `HP_CUDA_LIB`, `HP_NCCL_LIB` and `HP_NVRTC_LIB` at this one library. Its
//! soname is `libcuda.so.1`, so cudarc's own lookup of the driver by name finds it once loaded.
//!
//! Device memory is host memory in a registry, counted against a capacity; streams are worker
//! threads (real asynchrony, random delays with `HP_EMU_DELAY_SEED`); kernels are the CUDA C
//! compiled by the host C++ compiler and run with their blocks' threads as fibers that meet at
//! barriers and warp operations; NCCL ranks are threads of this process. Its value is in
//! refusing what the driver refuses, with the documented codes (see each module).
//!
//! - [`codes`] — `CUresult`, `ncclResult_t`, `nvrtcResult` values and flags.
//! - [`state`] — configuration (`HP_EMU_*`), `cuInit`, handles, entry guards, fault table.
//! - [`context`] — devices, primary contexts, the current context per thread.
//! - [`memory`] — device and pinned allocations, copies, memsets.
//! - [`stream`] — streams, events with timing, host functions.
//! - [`nvrtc`] — NVRTC on the host compiler; [`module`] — modules and kernel launches.
//! - [`nccl`] — communicators, collectives, send/receive.
//! - [`control`] — emulator-only exports: `hprtEmuSetFaults`, `hprtEmuSetNcclTimeoutMs`,
//!   `hprtEmuGetStats`, `hprtEmuGetCallCount` (and `hprtEmuGetDeviceMemoryCalls` in [`memory`]).
//!
//! Not modelled (a GPU run is what checks these): speed (a grid runs block by block on its
//! stream's thread); device memory being unreachable from the host (here it is host memory, so a
//! host dereference of a device pointer goes unnoticed); the legacy default stream's implicit
//! synchronisation with blocking streams; peer access; `cuLaunchKernel`'s `extra` parameter
//! buffer (`CUDA_ERROR_NOT_SUPPORTED`); NVRTC options whose numerics the host cannot reproduce
//! (`NVRTC_ERROR_INVALID_OPTION`); a kernel's own out-of-bounds accesses.
//!
//! Environment (read once, at first use; a value that does not parse makes `cuInit` fail with
//! `CUDA_ERROR_INVALID_VALUE`): `HP_EMU_DEVICES` (default 1), `HP_EMU_DEVICE_MEMORY` (bytes per
//! device, default 8 GiB), `HP_EMU_DELAY_SEED`, `HP_EMU_NCCL_TIMEOUT_MS` (how long
//! `ncclCommInitRank` waits for every rank, default 120 000; collectives never time out, as on
//! NCCL),
//! `HP_EMU_FAULTS` (`name:n:code,...`: the n-th call of `name` returns `code`), `CXX` (the
//! compiler NVRTC runs, default `c++`).

// The CUDA, NCCL and NVRTC headers are the contract of every exported function: pointer
// validity and sizes are as they document them, so per-function `# Safety` sections would only
// repeat them.
#![allow(clippy::missing_safety_doc)]
#![warn(unsafe_op_in_unsafe_fn)]

pub mod codes;
pub mod context;
pub mod control;
pub mod memory;
pub mod module;
pub mod nccl;
pub mod nvrtc;
pub mod state;
pub mod stream;

#[cfg(test)]
mod tests;
