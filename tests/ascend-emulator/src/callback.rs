//! Host callbacks: `aclrtLaunchCallback` queues a stream job that hands the function to the
//! thread subscribed to that stream; that thread runs it from `aclrtProcessReport`. With
//! `ACL_CALLBACK_BLOCK` the stream holds until the function has returned.
//!
//! Lock order: the subscription table, then a thread's queue.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::codes::*;
use crate::state::{self, acl_entry, lock};
use crate::stream;

extern "C" {
    /// `pthread_t` is `unsigned long` on Linux; callers subscribe with this same value.
    fn pthread_self() -> usize;
}

/// `Some(true)` ran, `Some(false)` cancelled by `aclrtUnSubscribeReport`.
#[derive(Default)]
struct Done {
    state: Mutex<Option<bool>>,
    cv: Condvar,
}

impl Done {
    fn finish(&self, ran: bool) {
        lock(&self.state).get_or_insert(ran);
        self.cv.notify_all();
    }

    fn wait(&self) -> bool {
        let mut s = lock(&self.state);
        loop {
            if let Some(ran) = *s {
                return ran;
            }
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Signals completion even if the callback unwinds, so a blocked stream is never stranded.
struct FinishOnDrop(Arc<Done>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        self.0.finish(true);
    }
}

struct Pending {
    stream: u64,
    func: unsafe extern "C" fn(*mut c_void),
    user: usize,
    done: Arc<Done>,
}

#[derive(Default)]
struct ReportQueue {
    items: Mutex<VecDeque<Pending>>,
    cv: Condvar,
}

#[derive(Default)]
struct Reports {
    /// stream id → subscribed thread id
    bindings: HashMap<u64, u64>,
    /// thread id → callbacks waiting for that thread
    queues: HashMap<u64, Arc<ReportQueue>>,
}

fn reports() -> MutexGuard<'static, Reports> {
    static REPORTS: LazyLock<Mutex<Reports>> = LazyLock::new(Default::default);
    lock(&REPORTS)
}

/// One thread may serve many streams; a stream has at most one thread.
#[no_mangle]
pub unsafe extern "C" fn aclrtSubscribeReport(thread_id: u64, stream: *mut c_void) -> AclError {
    acl_entry("aclrtSubscribeReport", || {
        state::require_device()?;
        let s = stream::resolve(stream)?;
        let mut r = reports();
        if r.bindings.contains_key(&s.id) {
            return Err(ACL_ERROR_INVALID_PARAM);
        }
        r.bindings.insert(s.id, thread_id);
        r.queues.entry(thread_id).or_default();
        Ok(())
    })
}

/// Callbacks of that stream not yet run are cancelled: a blocked stream gets
/// `ACL_ERROR_RT_INTERNAL_ERROR` instead of waiting forever. Works after the stream was destroyed
/// (the documented order is unsubscribe first, but a leaked binding would be worse).
#[no_mangle]
pub unsafe extern "C" fn aclrtUnSubscribeReport(thread_id: u64, stream: *mut c_void) -> AclError {
    acl_entry("aclrtUnSubscribeReport", || {
        state::require_device()?;
        let sid = stream::id_of(stream)?;
        let mut r = reports();
        if r.bindings.get(&sid) != Some(&thread_id) {
            return Err(ACL_ERROR_INVALID_PARAM);
        }
        r.bindings.remove(&sid);
        if let Some(q) = r.queues.get(&thread_id) {
            let mut items = lock(&q.items);
            items.retain(|p| {
                let keep = p.stream != sid;
                if !keep {
                    p.done.finish(false);
                }
                keep
            });
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtLaunchCallback(
    func: AclrtCallback,
    user_data: *mut c_void,
    block_type: u32,
    stream: *mut c_void,
) -> AclError {
    acl_entry("aclrtLaunchCallback", || {
        state::require_device()?;
        let func = func.ok_or(ACL_ERROR_INVALID_PARAM)?;
        let block = match block_type {
            ACL_CALLBACK_NO_BLOCK => false,
            ACL_CALLBACK_BLOCK => true,
            _ => return Err(ACL_ERROR_INVALID_PARAM),
        };
        let s = stream::resolve(stream)?;
        if !reports().bindings.contains_key(&s.id) {
            return Err(ACL_ERROR_INVALID_PARAM);
        }
        let sid = s.id;
        let user = user_data as usize;
        s.enqueue(Box::new(move || {
            let done = Arc::new(Done::default());
            {
                let mut r = reports();
                // Unsubscribed while this job was queued: nobody will ever run it.
                let thread = *r.bindings.get(&sid).ok_or(ACL_ERROR_RT_INTERNAL_ERROR)?;
                let q = r.queues.entry(thread).or_default().clone();
                lock(&q.items).push_back(Pending {
                    stream: sid,
                    func,
                    user,
                    done: done.clone(),
                });
                q.cv.notify_all();
            }
            if block && !done.wait() {
                return Err(ACL_ERROR_RT_INTERNAL_ERROR);
            }
            Ok(())
        }));
        Ok(())
    })
}

/// Runs one callback queued for the calling thread; `timeout` in ms, -1 waits forever.
#[no_mangle]
pub unsafe extern "C" fn aclrtProcessReport(timeout: i32) -> AclError {
    acl_entry("aclrtProcessReport", || {
        state::require_device()?;
        if timeout < -1 {
            return Err(ACL_ERROR_INVALID_PARAM);
        }
        // SAFETY: no preconditions.
        let me = unsafe { pthread_self() } as u64;
        let q = reports().queues.entry(me).or_default().clone();
        let deadline = u64::try_from(timeout)
            .ok()
            .map(|ms| Instant::now() + Duration::from_millis(ms));
        let p = {
            let mut items = lock(&q.items);
            loop {
                if let Some(p) = items.pop_front() {
                    break p;
                }
                items = match deadline {
                    None => q.cv.wait(items).unwrap_or_else(|e| e.into_inner()),
                    Some(d) => {
                        let now = Instant::now();
                        if now >= d {
                            return Err(ACL_ERROR_RT_REPORT_TIMEOUT);
                        }
                        q.cv.wait_timeout(items, d - now)
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                    }
                };
            }
        };
        let _finish = FinishOnDrop(p.done.clone());
        // SAFETY: the caller registered this function for this user data.
        unsafe { (p.func)(p.user as *mut c_void) };
        Ok(())
    })
}
