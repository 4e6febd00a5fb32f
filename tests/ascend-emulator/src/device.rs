//! `aclInit` / `aclFinalize` and device selection.

use std::ffi::c_char;

use crate::codes::*;
use crate::faults;
use crate::state::{self, acl_entry, acl_guard, life, put};

/// `configPath` is accepted and ignored: the emulator has no JSON configuration.
#[no_mangle]
pub unsafe extern "C" fn aclInit(_config_path: *const c_char) -> AclError {
    acl_guard(|| {
        life().init_calls += 1;
        if let Some(code) = faults::hit("aclInit") {
            return code;
        }
        if state::config().malformed || faults::env_malformed() {
            return ACL_ERROR_INVALID_PARAM;
        }
        let mut l = life();
        if l.initialized {
            return ACL_ERROR_REPEAT_INITIALIZE;
        }
        l.initialized = true;
        l.epoch += 1;
        ACL_SUCCESS
    })
}

/// Resources still alive at finalisation are kept (and stay visible in `hprtEmuGetStats`), so
/// leak tests see what the caller forgot to release.
#[no_mangle]
pub unsafe extern "C" fn aclFinalize() -> AclError {
    acl_guard(|| {
        life().finalize_calls += 1;
        if let Some(code) = faults::hit("aclFinalize") {
            return code;
        }
        let mut l = life();
        if !l.initialized {
            return ACL_ERROR_UNINITIALIZE;
        }
        l.initialized = false;
        ACL_SUCCESS
    })
}

fn valid_device(id: i32) -> Result<i32, AclError> {
    let n = state::config().devices;
    if id >= 0 && (id as u32) < n {
        Ok(id)
    } else {
        Err(ACL_ERROR_INVALID_PARAM)
    }
}

#[no_mangle]
pub unsafe extern "C" fn aclrtSetDevice(device_id: i32) -> AclError {
    acl_entry("aclrtSetDevice", || {
        state::set_current_device(valid_device(device_id)?);
        Ok(())
    })
}

/// Validates the id only. Real ACL reference-counts `aclrtSetDevice` per device and tears the
/// default context down at zero; the emulator keeps the thread's device, because its resources
/// (streams, memory) are not per context anyway.
#[no_mangle]
pub unsafe extern "C" fn aclrtResetDevice(device_id: i32) -> AclError {
    acl_entry("aclrtResetDevice", || valid_device(device_id).map(drop))
}

#[no_mangle]
pub unsafe extern "C" fn aclrtGetDevice(device_id: *mut i32) -> AclError {
    acl_entry("aclrtGetDevice", || {
        let dev = state::require_device()?;
        // SAFETY: header contract.
        unsafe { put(device_id, dev) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> AclError {
    acl_entry("aclrtGetDeviceCount", || {
        // SAFETY: header contract.
        unsafe { put(count, state::config().devices) }
    })
}
