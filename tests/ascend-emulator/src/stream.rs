//! Streams: one worker thread per stream draining a FIFO of jobs, so asynchronous calls really
//! return before their work runs and missing synchronisation shows up as wrong data.
//!
//! A job's `Err(code)` is the stream's asynchronous error: the first one since the last
//! `aclrtSynchronizeStream` is what that call returns (and clears); later jobs still run.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use crate::codes::*;
use crate::state::{self, acl_entry, lock, put, STREAM_TAG};

pub(crate) type Job = Box<dyn FnOnce() -> Result<(), AclError> + Send + 'static>;

pub(crate) struct Stream {
    pub id: u64,
    q: Mutex<Queue>,
    /// Signals both "a job was queued" (to the worker) and "a job finished" (to synchronizers).
    cv: Condvar,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    submitted: u64,
    completed: u64,
    error: Option<AclError>,
    closed: bool,
}

/// splitmix64: deterministic and good enough to spread delays.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Stream {
    fn start() -> Result<Arc<Stream>, AclError> {
        let s = Arc::new(Stream {
            id: state::next_id(),
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
        });
        let seed = state::config().delay_seed;
        let worker = s.clone();
        std::thread::Builder::new()
            .name(format!("hp-emu-stream-{}", s.id))
            .spawn(move || worker.work(seed))
            .map_err(|_| ACL_ERROR_RT_INTERNAL_ERROR)?;
        Ok(s)
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Queue>) -> MutexGuard<'a, Queue> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    fn work(&self, delay_seed: Option<u64>) {
        let mut rng = delay_seed.map(|seed| seed ^ self.id);
        loop {
            let job = {
                let mut q = lock(&self.q);
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        break job;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.wait(q);
                }
            };
            if let Some(r) = rng.as_mut() {
                std::thread::sleep(Duration::from_micros(splitmix(r) % 2001));
            }
            let res =
                catch_unwind(AssertUnwindSafe(job)).unwrap_or(Err(ACL_ERROR_RT_INTERNAL_ERROR));
            let mut q = lock(&self.q);
            q.completed += 1;
            if let Err(code) = res {
                q.error.get_or_insert(code);
            }
            self.cv.notify_all();
        }
    }

    pub(crate) fn enqueue(&self, job: Job) {
        let mut q = lock(&self.q);
        q.jobs.push_back(job);
        q.submitted += 1;
        self.cv.notify_all();
    }

    /// Waits for everything queued before the call; returns (and clears) the first error.
    pub(crate) fn synchronize(&self) -> Result<(), AclError> {
        let mut q = lock(&self.q);
        let target = q.submitted;
        while q.completed < target {
            q = self.wait(q);
        }
        q.error.take().map_or(Ok(()), Err)
    }

    /// Whether everything queued so far has run; errors stay for the next synchronize.
    fn idle(&self) -> bool {
        let q = lock(&self.q);
        q.completed == q.submitted
    }

    /// The worker drains what is queued, then exits.
    fn close(&self) {
        lock(&self.q).closed = true;
        self.cv.notify_all();
    }
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
        let s = Stream::start()?;
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
        let s = Stream::start()?;
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
