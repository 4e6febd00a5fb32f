//! An emulator of the Ascend ACL runtime + HCCL subset that hprt uses, exporting the C symbols of
//! `sys/include/hprt_ascend.h` with its signatures, so the npu backend (loading, symbol
//! resolution, status mapping, stream semantics, collectives) runs in CI without Ascend hardware:
//! point `HP_ACL_LIB` and `HP_HCCL_LIB` at this library. The optional `aclrtGetVersion` is left
//! out on purpose, so the backend's path for an absent optional symbol runs too.
//!
//! "Device" memory is host memory in a registry, streams are worker threads draining FIFOs, and
//! HCCL ranks are threads of this process. Its value is in refusing what real hardware refuses,
//! with the documented codes: calls before `aclInit`, bad or destroyed handles, a memcpy whose kind
//! does not match its pointers, `count > destMax`, buffers that leave their allocation, ranks that
//! disagree on a collective.
//!
//! - [`codes`] — status codes and enum values of the header.
//! - [`state`] — configuration (`HP_EMU_*`), the ACL lifecycle, the thread's device, handles, and
//!   the entry guards (fault injection, init check, panic barrier).
//! - [`device`] — `aclInit`, `aclFinalize`, device selection.
//! - [`memory`] — device and pinned-host allocations, memcpy, memset, memory info.
//! - [`stream`] — asynchronous streams, the default stream, delay injection.
//! - [`event`] — events, cross-stream waits, timing.
//! - [`callback`] — host callbacks on streams (`aclrtLaunchCallback` / `aclrtProcessReport`).
//! - [`hccl`] — communicators and collectives (reductions: `hprt-emulator-common`).
//! - [`faults`] — `HP_EMU_FAULTS` fault injection (the table: `hprt-emulator-common`).
//! - [`control`] — emulator-only exports: `hprtEmuSetFaults`, `hprtEmuSetHcclTimeoutMs`,
//!   `hprtEmuGetStats`.
//!
//! Environment (read once, at first use; a value that does not parse makes `aclInit` fail with
//! `ACL_ERROR_INVALID_PARAM`): `HP_EMU_DEVICES` (default 1), `HP_EMU_DEVICE_MEMORY` (bytes per
//! device, default 8 GiB), `HP_EMU_PREINIT=1`, `HP_EMU_DELAY_SEED`, `HP_EMU_HCCL_TIMEOUT_MS`
//! (default 120 000), `HP_EMU_FAULTS`.

// The C header is the contract of every exported function: pointer validity and sizes are as it
// documents them, so per-function `# Safety` sections would only repeat it.
#![allow(clippy::missing_safety_doc)]
#![warn(unsafe_op_in_unsafe_fn)]

pub mod callback;
pub mod codes;
pub mod control;
pub mod device;
pub mod event;
pub mod faults;
pub mod hccl;
pub mod memory;
pub mod state;
pub mod stream;

#[cfg(test)]
mod tests;
