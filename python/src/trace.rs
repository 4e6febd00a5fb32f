//! `hprt.StreamClock` / `hprt.StreamMark`: hprt-platform's stream clock, the one mechanism that
//! puts a point of a stream on the host clock, so Python tracers (`hprt.fsdp.StreamTrace`) time
//! streams exactly as the Rust ones do. Times are seconds on `time.perf_counter()`'s clock
//! (`CLOCK_MONOTONIC` on Linux), so they compare directly with host timestamps.

use hprt_platform::{host_seconds, StreamClock, StreamMark};
use pyo3::prelude::*;

use crate::error::Result;
use crate::handles::{PyPlatform, PyStream};
use crate::wait::interruptible;

/// A clock for the streams of one platform.
///
/// ```python
/// clock = hprt.StreamClock(platform)
/// start = clock.mark(stream)      # a timing event on the stream
/// ...                             # queue work on the stream
/// end = clock.mark(stream)
/// end.seconds() - start.seconds() # waits for the stream; perf_counter() seconds
/// ```
#[pyclass(name = "StreamClock", module = "hprt._native", frozen)]
pub struct PyStreamClock {
    clock: StreamClock,
}

/// A point of a stream recorded by `StreamClock.mark`; its time is known once the stream
/// reached it.
#[pyclass(name = "StreamMark", module = "hprt._native", frozen)]
pub struct PyStreamMark {
    mark: StreamMark,
}

#[pymethods]
impl PyStreamClock {
    /// Calibrates on the platform's current device (a few round trips on an idle stream, off
    /// the GIL).
    #[new]
    fn new(py: Python<'_>, platform: &PyPlatform) -> Result<Self> {
        let p = platform.p.clone();
        let clock = py.detach(move || StreamClock::new(p))?;
        Ok(PyStreamClock { clock })
    }

    /// Records the point `stream` reached with the work queued on it so far.
    fn mark(&self, stream: &PyStream) -> Result<PyStreamMark> {
        Ok(PyStreamMark {
            mark: self.clock.mark(&stream.s)?,
        })
    }

    /// The host clock now: `time.perf_counter()`'s value on Linux.
    #[staticmethod]
    fn now() -> f64 {
        host_seconds()
    }
}

#[pymethods]
impl PyStreamMark {
    /// Whether the stream reached the mark.
    fn reached(&self) -> Result<bool> {
        Ok(self.mark.reached()?)
    }

    /// The host seconds at which the stream reached the mark, waiting for it to get there
    /// (Ctrl-C interrupts the wait).
    fn seconds(&self, py: Python<'_>) -> Result<f64> {
        if let Some(s) = self.mark.try_seconds()? {
            return Ok(s);
        }
        let mark = self.mark.clone();
        Ok(interruptible(py, self.mark.platform(), move |_| {
            mark.seconds()
        })??)
    }

    /// How far `seconds()` may be off the host clock, at most (half the round trip the clock
    /// was calibrated with on this device); differences between marks do not have it.
    fn uncertainty_s(&self) -> f64 {
        self.mark.uncertainty_s()
    }

    /// The host seconds at which the stream reached the mark, or `None` while it has not.
    fn try_seconds(&self) -> Result<Option<f64>> {
        Ok(self.mark.try_seconds()?)
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.mark)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStreamClock>()?;
    m.add_class::<PyStreamMark>()?;
    Ok(())
}
