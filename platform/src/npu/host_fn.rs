//! Host functions on an ACL stream: a report thread subscribed to our streams runs callbacks
//! launched with `aclrtLaunchCallback`, in stream order. Used where the ACL subset has no device
//! kernel (the scale step of an `Avg` reduction). Needs the optional callback symbols.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use hprt_sys::types::{aclrtCallbackBlockType, ACL_ERROR_RT_REPORT_TIMEOUT};
use hprt_sys::Ascend;

use super::check::{acl, npu_err};
use crate::error::{ErrorKind, Result};

extern "C" {
    fn pthread_self() -> usize;
}

type HostFn = Box<dyn FnOnce() + Send>;

unsafe extern "C" fn trampoline(user: *mut c_void) {
    // SAFETY: `user` is the box `launch` leaked for exactly one call.
    let f: Box<HostFn> = unsafe { Box::from_raw(user.cast()) };
    // A panic must not unwind into the driver's thread.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

/// Whether the loaded ACL has everything host functions need.
pub(crate) fn available(api: &Ascend) -> bool {
    api.acl.aclrtSubscribeReport.is_ok()
        && api.acl.aclrtUnSubscribeReport.is_ok()
        && api.acl.aclrtLaunchCallback.is_ok()
        && api.acl.aclrtProcessReport.is_ok()
}

/// The thread that runs callbacks of the streams subscribed to it.
pub(crate) struct Reporter {
    api: Arc<Ascend>,
    tid: u64,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Reporter {
    pub(crate) fn start(api: Arc<Ascend>, device: i32) -> Result<Reporter> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let (a, s) = (Arc::clone(&api), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("hprt-npu-report".into())
            .spawn(move || {
                // SAFETY: no pointer arguments; ACL checks the ordinal itself; the library
                // outlives this thread (`a` holds it).
                let bound = acl(unsafe { a.acl.aclrtSetDevice(device) }, "aclrtSetDevice");
                // SAFETY: `pthread_self` has no preconditions and cannot fail; its `pthread_t`
                // is an unsigned long on Linux, the `usize` declared above.
                let _ = tx.send(bound.map(|()| unsafe { pthread_self() } as u64));
                while !s.load(Ordering::Acquire) {
                    // SAFETY: no pointer arguments; the library outlives this thread. (A
                    // missing optional symbol panics in the table, never calls through null;
                    // reporters start only where `available` found it.)
                    let code = unsafe { a.acl.aclrtProcessReport(50) };
                    if code != 0 && code != ACL_ERROR_RT_REPORT_TIMEOUT as i32 {
                        tracing::warn!(code, "aclrtProcessReport failed");
                    }
                }
            })
            .map_err(|e| npu_err(ErrorKind::Internal, "host_fn", e.to_string()))?;
        let tid = rx
            .recv()
            .map_err(|_| npu_err(ErrorKind::Internal, "host_fn", "report thread died"))??;
        Ok(Reporter {
            api,
            tid,
            stop,
            thread: Some(thread),
        })
    }

    pub(crate) fn subscribe(&self, stream: usize) -> Result<()> {
        // SAFETY: `stream` is a live stream of this library.
        acl(
            unsafe { self.api.acl.aclrtSubscribeReport(self.tid, stream as _) },
            "aclrtSubscribeReport",
        )
    }

    pub(crate) fn unsubscribe(&self, stream: usize) -> Result<()> {
        // SAFETY: as in `subscribe`.
        acl(
            unsafe { self.api.acl.aclrtUnSubscribeReport(self.tid, stream as _) },
            "aclrtUnSubscribeReport",
        )
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Queues `f` on `stream` (subscribed to a reporter); with `block` the stream waits for it.
pub(crate) fn launch(api: &Ascend, stream: usize, block: bool, f: HostFn) -> Result<()> {
    let user = Box::into_raw(Box::new(f));
    let block_type = aclrtCallbackBlockType(u32::from(block));
    // SAFETY: the trampoline takes back the box exactly once when the driver runs it.
    let code = unsafe {
        api.acl
            .aclrtLaunchCallback(Some(trampoline), user.cast(), block_type, stream as _)
    };
    if code != 0 {
        // The driver refused it, so it will never run: take the box back.
        // SAFETY: `user` came from `Box::into_raw` above, and the trampoline that would have
        // taken it back will not run, so this is its one release.
        drop(unsafe { Box::from_raw(user) });
    }
    acl(code, "aclrtLaunchCallback")
}
