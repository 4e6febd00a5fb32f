//! Emulator-only exports for tests: fault injection at run time, the NCCL timeout, counters of
//! live resources and tolerated contract breaches, and per-function call counts. None of these
//! exist in CUDA; callers look them up in the emulator library.

use std::ffi::{c_char, CStr};
use std::sync::atomic::Ordering;

use crate::{context, memory, module, nccl, state, stream};

/// Counters for leak tests. Default streams are the driver's, not the caller's: not counted.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HprtCudaEmuStats {
    pub live_contexts: u64,
    pub live_device_allocations: u64,
    pub live_device_bytes: u64,
    pub live_pinned_allocations: u64,
    pub live_streams: u64,
    pub live_events: u64,
    pub live_modules: u64,
    pub live_comms: u64,
    /// `cuMemFree` / `cuMemFreeHost` calls made while queued work still used the memory.
    pub frees_under_queued_work: u64,
    /// Streams, events, modules and allocations freed by their context's destruction rather
    /// than by their owner.
    pub reclaimed_at_context_destroy: u64,
}

/// Replaces the fault list (`HP_EMU_FAULTS` syntax; "" clears it) and restarts every
/// per-function call count. Returns 0, or 1 for a null or malformed spec (nothing changes).
#[no_mangle]
pub unsafe extern "C" fn hprtEmuSetFaults(spec: *const c_char) -> i32 {
    if spec.is_null() {
        return 1;
    }
    // SAFETY: a NUL-terminated string by contract.
    let Ok(spec) = unsafe { CStr::from_ptr(spec) }.to_str() else {
        return 1;
    };
    i32::from(state::FAULTS.replace(spec).is_err())
}

/// Calls of the exported function `name` (a driver, NCCL or NVRTC entry point fault injection
/// knows) since the process started or `hprtEmuSetFaults` last restarted the counts; 0 for a
/// null or unknown name.
#[no_mangle]
pub unsafe extern "C" fn hprtEmuGetCallCount(name: *const c_char) -> u64 {
    if name.is_null() {
        return 0;
    }
    // SAFETY: a NUL-terminated string by contract.
    match unsafe { CStr::from_ptr(name) }.to_str() {
        Ok(name) => state::FAULTS.calls(name),
        Err(_) => 0,
    }
}

/// How long `ncclCommInitRank` waits for every rank before failing; overrides
/// `HP_EMU_NCCL_TIMEOUT_MS`.
#[no_mangle]
pub extern "C" fn hprtEmuSetNcclTimeoutMs(ms: u64) {
    state::set_nccl_timeout_ms(ms);
}

/// Returns 0, or 1 for a null `out`.
#[no_mangle]
pub unsafe extern "C" fn hprtEmuGetStats(out: *mut HprtCudaEmuStats) -> i32 {
    let (live_device_allocations, live_device_bytes, live_pinned_allocations) = memory::stats();
    let stats = HprtCudaEmuStats {
        live_contexts: context::live(),
        live_device_allocations,
        live_device_bytes,
        live_pinned_allocations,
        live_streams: stream::live(),
        live_events: stream::live_events(),
        live_modules: module::live(),
        live_comms: nccl::live(),
        frees_under_queued_work: state::FREES_UNDER_QUEUED_WORK.load(Ordering::Relaxed),
        reclaimed_at_context_destroy: state::RECLAIMED_AT_CONTEXT_DESTROY.load(Ordering::Relaxed),
    };
    // SAFETY: API contract.
    i32::from(unsafe { state::put(out, stats, ()) }.is_err())
}
