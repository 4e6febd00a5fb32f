//! Emulator-only exports for tests: fault injection at run time, the HCCL timeout, and counters
//! of live resources for leak checks. None of these exist in CANN; callers probe them.

use std::ffi::{c_char, CStr};

use crate::codes::*;
use crate::state::{self, acl_guard};
use crate::{event, faults, hccl, memory, stream};

/// Counters for leak tests. Default streams (the null `aclrtStream`) are not counted: they are
/// the runtime's, not the caller's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HprtEmuStats {
    pub init_calls: u64,
    pub finalize_calls: u64,
    pub live_device_allocations: u64,
    pub live_device_bytes: u64,
    pub live_host_allocations: u64,
    pub live_streams: u64,
    pub live_events: u64,
    pub live_comms: u64,
}

/// Replaces the fault list (same syntax as `HP_EMU_FAULTS`; "" clears it) and restarts every
/// per-function call count. A null or malformed spec changes nothing and returns
/// `ACL_ERROR_INVALID_PARAM`.
#[no_mangle]
pub unsafe extern "C" fn hprtEmuSetFaults(spec: *const c_char) -> AclError {
    acl_guard(|| {
        if spec.is_null() {
            return ACL_ERROR_INVALID_PARAM;
        }
        // SAFETY: a NUL-terminated string by contract.
        let Ok(spec) = unsafe { CStr::from_ptr(spec) }.to_str() else {
            return ACL_ERROR_INVALID_PARAM;
        };
        match faults::replace(spec) {
            Ok(()) => ACL_SUCCESS,
            Err(()) => ACL_ERROR_INVALID_PARAM,
        }
    })
}

/// How long ranks wait for each other (communicator set-up, collectives, send/recv) before the
/// operation fails; overrides `HP_EMU_HCCL_TIMEOUT_MS` for operations that start afterwards.
#[no_mangle]
pub extern "C" fn hprtEmuSetHcclTimeoutMs(ms: u64) -> AclError {
    acl_guard(|| {
        state::set_hccl_timeout_ms(ms);
        ACL_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn hprtEmuGetStats(out: *mut HprtEmuStats) -> AclError {
    acl_guard(|| {
        let (init_calls, finalize_calls) = {
            let l = state::life();
            (l.init_calls, l.finalize_calls)
        };
        let (live_device_allocations, live_device_bytes, live_host_allocations) = memory::stats();
        let stats = HprtEmuStats {
            init_calls,
            finalize_calls,
            live_device_allocations,
            live_device_bytes,
            live_host_allocations,
            live_streams: stream::live(),
            live_events: event::live(),
            live_comms: hccl::live(),
        };
        // SAFETY: header contract.
        state::status(unsafe { state::put(out, stats) })
    })
}
