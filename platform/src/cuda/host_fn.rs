//! Host functions on a CUDA stream (`cuLaunchHostFunc`), and deferred releases.
//!
//! CUDA forbids driver calls inside a host function, but a closure may hold the last handle of a
//! buffer, stream or event, whose release needs the driver (wait for its use events, free). While
//! a host function runs, its thread is marked; releases on a marked thread go to a reaper thread
//! instead of running there.

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;

use cudarc::driver::sys as cu;

use super::check::{cu, cuda_err};
use crate::error::{ErrorKind, Result};
use crate::kernel::HostFn;
use crate::sync::lock;

type Job = Box<dyn FnOnce() + Send + 'static>;

thread_local! {
    static IN_HOST_FN: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is running one of our host functions.
pub(crate) fn in_host_fn() -> bool {
    IN_HOST_FN.try_with(Cell::get).unwrap_or(false)
}

unsafe extern "C" fn trampoline(user: *mut c_void) {
    // SAFETY: `user` is the box `launch` leaked for exactly one call.
    let f: Box<HostFn> = unsafe { Box::from_raw(user.cast()) };
    let _ = IN_HOST_FN.try_with(|c| c.set(true));
    // A panic must not unwind into the driver's thread.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    let _ = IN_HOST_FN.try_with(|c| c.set(false));
}

/// Queues `f` on `stream`; the stream waits for it to return.
pub(crate) fn launch(stream: super::result::Stream, f: HostFn) -> Result<()> {
    let user = Box::into_raw(Box::new(f));
    // SAFETY: the trampoline takes back the box exactly once when the driver runs it.
    let r = unsafe { cu::cuLaunchHostFunc(stream.sys(), Some(trampoline), user.cast()) };
    if r != cu::CUresult::CUDA_SUCCESS {
        // The driver refused it, so it will never run: take the box back.
        // SAFETY: not handed to the driver.
        drop(unsafe { Box::from_raw(user) });
    }
    cu(r, "cuLaunchHostFunc")
}

/// A thread that runs releases handed over from host-function threads. It is never joined: it
/// ends when the platform (the last sender) is gone and its queue is drained.
pub(crate) struct Reaper {
    tx: Mutex<Option<Sender<Job>>>,
}

impl Reaper {
    pub(crate) fn new() -> Self {
        Reaper {
            tx: Mutex::new(None),
        }
    }

    fn sender(&self) -> Result<Sender<Job>> {
        let mut tx = lock(&self.tx);
        if let Some(tx) = tx.as_ref() {
            return Ok(tx.clone());
        }
        let (send, recv) = channel::<Job>();
        std::thread::Builder::new()
            .name("hprt-cuda-reaper".into())
            .spawn(move || {
                while let Ok(job) = recv.recv() {
                    job();
                }
            })
            .map_err(|e| cuda_err(ErrorKind::Internal, "reaper", e.to_string()))?;
        *tx = Some(send.clone());
        Ok(send)
    }

    /// Runs `job` now, or on the reaper thread when called from inside a host function.
    pub(crate) fn run_or_defer(&self, job: impl FnOnce() + Send + 'static) {
        if !in_host_fn() {
            return job();
        }
        match self.sender() {
            Ok(tx) => {
                if let Err(returned) = tx.send(Box::new(job)) {
                    // The reaper is gone (it cannot be while we hold a sender): a fresh thread.
                    let job = returned.0;
                    std::thread::spawn(job);
                }
            }
            // No thread could be started for the reaper: try a plain one; failing that the
            // resources leak, which beats a driver call the host function may not make.
            Err(_) => {
                let _ = std::thread::Builder::new().spawn(job);
            }
        }
    }
}
