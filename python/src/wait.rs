//! Waits Ctrl-C can interrupt: a blocking platform call (a `comm_init` waiting for a missing
//! rank, a synchronize behind a stuck collective) runs on a helper thread while the calling
//! thread, without the GIL, checks for signals every 50 ms. Python's SIGINT handler only sets a
//! flag; the pending `KeyboardInterrupt` is raised once the calling thread runs Python's signal
//! check, which a call blocked in Rust would otherwise not do until the call returns.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use hprt_platform::{Platform, PlatformHandle};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

const POLL: Duration = Duration::from_millis(50);

/// Runs `f` on `platform` off the GIL and returns its result, or the exception a signal handler
/// raised meanwhile (`KeyboardInterrupt`). The helper thread works on the caller's current
/// device (a per-thread setting: `comm_init` joins on it). On interruption the helper thread
/// finishes `f` on its own (a synchronize completes with its stream; a `comm_init` joins or
/// times out, and a joined communicator is dropped, which its peers see as a departed rank) and
/// its result is dropped.
pub(crate) fn interruptible<T: Send + 'static>(
    py: Python<'_>,
    platform: &PlatformHandle,
    f: impl FnOnce(&dyn Platform) -> hprt_platform::Result<T> + Send + 'static,
) -> PyResult<hprt_platform::Result<T>> {
    let (p, device) = (platform.clone(), platform.current_device());
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("hprt-wait".into())
        .spawn(move || {
            let _ = tx.send(p.set_device(device).and_then(|()| f(&*p)));
        })
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start a waiting thread: {e}")))?;
    let mut rx = rx;
    loop {
        // The receiver travels into the GIL-free closure and back (it is not `Sync`).
        let (got, back) = py.detach(move || (rx.recv_timeout(POLL), rx));
        rx = back;
        match got {
            Ok(v) => return Ok(v),
            Err(RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(PyRuntimeError::new_err("the waiting thread panicked"))
            }
        }
    }
}
