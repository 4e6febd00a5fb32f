//! Streams: one worker thread per stream draining a FIFO of jobs (`hprt_emulator_common::worker`),
//! so asynchronous calls really return before their work runs and missing synchronisation shows
//! up as wrong data. A job's `Err(code)` is the stream's asynchronous error: the first one since
//! the last `aclrtSynchronizeStream` is what that call returns (and clears).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use hprt_emulator_common::worker::Worker;

use crate::codes::*;
use crate::state::{self, acl_entry, lock, put, STREAM_TAG};

/// A stream is a worker thread (`hprt_emulator_common::worker`); jobs fail with `AclError`s.
pub(crate) type Stream = Worker;

fn start() -> Result<Arc<Stream>, AclError> {
    Worker::start(
        state::next_id(),
        "hp-emu-stream",
        state::config().delay_seed,
        ACL_ERROR_RT_INTERNAL_ERROR,
    )
    .map_err(|_| ACL_ERROR_RT_INTERNAL_ERROR)
}

fn streams() -> MutexGuard<'static, HashMap<u64, Arc<Stream>>> {
    static STREAMS: LazyLock<Mutex<HashMap<u64, Arc<Stream>>>> = LazyLock::new(Default::default);
    lock(&STREAMS)
}

/// The stream a handle names: null is the calling thread's device's default stream (created on
/// first use, never destroyed); anything else must be a live stream.
pub(crate) fn resolve(h: *mut c_void) -> Result<Arc<Stream>, AclError> {
    if h.is_null() {
        let dev = state::require_device()?;
        static DEFAULTS: LazyLock<Mutex<HashMap<i32, Arc<Stream>>>> =
            LazyLock::new(Default::default);
        let mut d = lock(&DEFAULTS);
        if let Some(s) = d.get(&dev) {
            return Ok(s.clone());
        }
        let s = start()?;
        d.insert(dev, s.clone());
        return Ok(s);
    }
    let id = state::handle_id(STREAM_TAG, h as usize).ok_or(ACL_ERROR_INVALID_PARAM)?;
    streams().get(&id).cloned().ok_or(ACL_ERROR_INVALID_PARAM)
}

/// The id a handle names even if the stream is already destroyed (for unsubscribing).
pub(crate) fn id_of(h: *mut c_void) -> Result<u64, AclError> {
    if h.is_null() {
        return resolve(h).map(|s| s.id);
    }
    state::handle_id(STREAM_TAG, h as usize).ok_or(ACL_ERROR_INVALID_PARAM)
}

pub(crate) fn live() -> u64 {
    streams().len() as u64
}

#[no_mangle]
pub unsafe extern "C" fn aclrtCreateStream(stream: *mut *mut c_void) -> AclError {
    acl_entry("aclrtCreateStream", || {
        state::require_device()?;
        if stream.is_null() {
            return Err(ACL_ERROR_INVALID_PARAM);
        }
        let s = start()?;
        let h = state::handle(STREAM_TAG, s.id);
        streams().insert(s.id, s);
        // SAFETY: header contract; checked non-null above.
        unsafe { put(stream, h as *mut c_void) }
    })
}

/// Queued work still runs; the handle is dead at once. The default stream cannot be destroyed.
#[no_mangle]
pub unsafe extern "C" fn aclrtDestroyStream(stream: *mut c_void) -> AclError {
    acl_entry("aclrtDestroyStream", || {
        state::require_device()?;
        let id = state::handle_id(STREAM_TAG, stream as usize).ok_or(ACL_ERROR_INVALID_PARAM)?;
        let s = streams().remove(&id).ok_or(ACL_ERROR_INVALID_PARAM)?;
        s.close();
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtSynchronizeStream(stream: *mut c_void) -> AclError {
    acl_entry("aclrtSynchronizeStream", || {
        state::require_device()?;
        resolve(stream)?.synchronize()
    })
}

/// Optional in CANN (newer releases). Asynchronous errors are left for `aclrtSynchronizeStream`.
#[no_mangle]
pub unsafe extern "C" fn aclrtStreamQuery(stream: *mut c_void, status: *mut u32) -> AclError {
    acl_entry("aclrtStreamQuery", || {
        state::require_device()?;
        let s = resolve(stream)?;
        let v = if s.idle() {
            ACL_STREAM_STATUS_COMPLETE
        } else {
            ACL_STREAM_STATUS_NOT_READY
        };
        // SAFETY: header contract.
        unsafe { put(status, v) }
    })
}
