//! Events: each `aclrtRecordEvent` queues a fresh completion mark on the stream and makes it the
//! event's latest; waits and queries look at the latest mark as of the call, as on hardware where
//! a re-record replaces what later waiters see but not what earlier waits captured.
//!
//! A mark carries the stream's asynchronous error as of the point it marks (one not yet reported
//! by `aclrtSynchronizeStream`): `aclrtSynchronizeEvent` returns it and a stream that waits on
//! the mark takes it as its own error, so a failure reaches all work ordered after it.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Instant;

use hprt_emulator_common::mark::{elapsed_ms, Latest};

use crate::codes::*;
use crate::state::{self, acl_entry, lock, put, EVENT_TAG};
use crate::stream;

struct Event {
    flags: u32,
    latest: Latest,
}

fn events() -> MutexGuard<'static, HashMap<u64, Arc<Event>>> {
    static EVENTS: LazyLock<Mutex<HashMap<u64, Arc<Event>>>> = LazyLock::new(Default::default);
    lock(&EVENTS)
}

fn resolve(h: *mut c_void) -> Result<Arc<Event>, AclError> {
    let id = state::handle_id(EVENT_TAG, h as usize).ok_or(ACL_ERROR_INVALID_PARAM)?;
    events().get(&id).cloned().ok_or(ACL_ERROR_INVALID_PARAM)
}

pub(crate) fn live() -> u64 {
    events().len() as u64
}

fn create(out: *mut *mut c_void, flags: u32) -> Result<(), AclError> {
    state::require_device()?;
    if out.is_null() || flags & !(ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE) != 0 {
        return Err(ACL_ERROR_INVALID_PARAM);
    }
    let id = state::next_id();
    events().insert(
        id,
        Arc::new(Event {
            flags,
            latest: Latest::default(),
        }),
    );
    // SAFETY: header contract; checked non-null above.
    unsafe { put(out, state::handle(EVENT_TAG, id) as *mut c_void) }
}

/// A plain event synchronises but carries no timestamps: timing needs `ACL_EVENT_TIME_LINE`.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEvent(event: *mut *mut c_void) -> AclError {
    acl_entry("aclrtCreateEvent", || create(event, ACL_EVENT_SYNC))
}

#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEventWithFlag(event: *mut *mut c_void, flag: u32) -> AclError {
    acl_entry("aclrtCreateEventWithFlag", || create(event, flag))
}

#[no_mangle]
pub unsafe extern "C" fn aclrtDestroyEvent(event: *mut c_void) -> AclError {
    acl_entry("aclrtDestroyEvent", || {
        state::require_device()?;
        let id = state::handle_id(EVENT_TAG, event as usize).ok_or(ACL_ERROR_INVALID_PARAM)?;
        events()
            .remove(&id)
            .map(drop)
            .ok_or(ACL_ERROR_INVALID_PARAM)
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtRecordEvent(event: *mut c_void, stream: *mut c_void) -> AclError {
    acl_entry("aclrtRecordEvent", || {
        state::require_device()?;
        let ev = resolve(event)?;
        let s = stream::resolve(stream)?;
        ev.latest.record(&s);
        Ok(())
    })
}

/// Never recorded: nothing to wait for.
#[no_mangle]
pub unsafe extern "C" fn aclrtStreamWaitEvent(stream: *mut c_void, event: *mut c_void) -> AclError {
    acl_entry("aclrtStreamWaitEvent", || {
        state::require_device()?;
        let s = stream::resolve(stream)?;
        if let Some(mark) = resolve(event)?.latest.get() {
            s.enqueue(Box::new(move || mark.wait()));
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtSynchronizeEvent(event: *mut c_void) -> AclError {
    acl_entry("aclrtSynchronizeEvent", || {
        state::require_device()?;
        match resolve(event)?.latest.get() {
            Some(mark) => mark.wait(),
            None => Ok(()),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtQueryEventStatus(event: *mut c_void, status: *mut u32) -> AclError {
    acl_entry("aclrtQueryEventStatus", || {
        state::require_device()?;
        let ev = resolve(event)?;
        let done = ev.latest.get().is_none_or(|m| m.time().is_some());
        let v = if done {
            ACL_EVENT_RECORDED_STATUS_COMPLETE
        } else {
            ACL_EVENT_RECORDED_STATUS_NOT_READY
        };
        // SAFETY: header contract.
        unsafe { put(status, v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtEventElapsedTime(
    ms: *mut f32,
    start: *mut c_void,
    end: *mut c_void,
) -> AclError {
    acl_entry("aclrtEventElapsedTime", || {
        state::require_device()?;
        let stamp = |h| -> Result<Instant, AclError> {
            let ev = resolve(h)?;
            if ev.flags & ACL_EVENT_TIME_LINE == 0 {
                return Err(ACL_ERROR_INVALID_PARAM);
            }
            ev.latest
                .get()
                .and_then(|m| m.time())
                .ok_or(ACL_ERROR_INVALID_PARAM)
        };
        let (t0, t1) = (stamp(start)?, stamp(end)?);
        // SAFETY: header contract.
        unsafe { put(ms, elapsed_ms(t0, t1)) }
    })
}
