//! Swap of a framework's own tensors (what `hprt.torch` packs and unpacks).
//!
//! hprt-swap's front ends release and re-acquire storage that hprt owns (`resize_device`); a
//! framework's tensor is memory hprt only borrows, so this path keeps the same rules with the
//! framework in charge of allocation:
//! - an offload is queued on hprt's d2h stream after the framework's compute work queued so far,
//!   into a block of hprt-swap's pinned pool;
//! - the framework's memory is handed back (the borrow dropped, its owner released) only after
//!   the host synchronized with that copy;
//! - a reload copies into memory the framework allocated for it, on hprt's h2d stream, and the
//!   compute stream (and, for frameworks without streams, the host) waits for it before the
//!   tensor is handed back;
//! - a pinned block returns to the pool only once its last copy completed.
//!
//! Every borrowed byte is counted while hprt references it, so a program can compare how much
//! of its saved tensors stayed on the device with and without swap.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hprt_platform::{DeviceBuffer, Event, ReleaseFn, Stream};
use hprt_swap::{PinnedBlock, PinnedPool, PlatformHandle, PoolConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::{invalid, BindError, Result};
use crate::platform::{PyPlatform, PyStream};

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Writers replace whole values under the lock, so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bytes of framework memory hprt references, and bytes moved.
#[derive(Default)]
struct Counters {
    device_current: AtomicUsize,
    device_peak: AtomicUsize,
    offloaded_tensors: AtomicU64,
    offloaded_bytes: AtomicU64,
    reloaded_bytes: AtomicU64,
}

impl Counters {
    fn add(&self, n: usize) {
        let now = self.device_current.fetch_add(n, Ordering::AcqRel) + n;
        self.device_peak.fetch_max(now, Ordering::AcqRel);
    }
    fn sub(&self, n: usize) {
        self.device_current.fetch_sub(n, Ordering::AcqRel);
    }
}

struct Shared {
    p: PlatformHandle,
    d2h: Stream,
    h2d: Stream,
    pool: PinnedPool,
    counters: Counters,
    /// Blocks whose last copy may still be queued: they go back to the pool once it completed.
    retiring: Mutex<Vec<(PinnedBlock, Arc<Event>)>>,
}

impl Shared {
    /// Borrows framework memory, counting it until the borrow is released.
    fn borrow(
        self: &Arc<Self>,
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
    ) -> Result<DeviceBuffer> {
        if ptr == 0 && nbytes > 0 {
            return Err(invalid("cannot borrow a null pointer"));
        }
        let me = Arc::clone(self);
        let release: ReleaseFn = Box::new(move || {
            drop(owner);
            me.counters.sub(nbytes);
        });
        self.counters.add(nbytes);
        // SAFETY: the caller (the Python API's documented contract) passes the data pointer and
        // byte size of a live framework tensor of this backend, and `owner` keeps that tensor
        // alive until the release callback runs.
        Ok(unsafe { self.p.wrap_device_memory(ptr, nbytes, Some(release))? })
    }

    /// Work queued on `waiter` from now on runs after the work queued on `on` so far.
    fn order_after(&self, waiter: &Stream, on: &Stream) -> Result<()> {
        let mark = self.p.create_event(false)?;
        self.p.record_event(&mark, on)?;
        Ok(self.p.stream_wait_event(waiter, &mark)?)
    }

    fn retire(&self, block: PinnedBlock, fence: Arc<Event>) {
        locked(&self.retiring).push((block, fence));
    }

    /// Gives back to the pool the retiring blocks whose copies completed.
    fn reap(&self) -> Result<()> {
        let mut r = locked(&self.retiring);
        let mut i = 0;
        while i < r.len() {
            if self.p.query_event(&r[i].1)? {
                r.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }
}

enum State {
    /// The d2h copy is queued; the framework memory is still borrowed.
    Offloading {
        src: DeviceBuffer,
        owner: Py<PyAny>,
        block: PinnedBlock,
        fence: Arc<Event>,
    },
    /// Only the host copy exists.
    Host { block: PinnedBlock },
    /// The h2d copy into framework memory is queued.
    Reloading {
        dst: DeviceBuffer,
        owner: Py<PyAny>,
        block: PinnedBlock,
        fence: Arc<Event>,
    },
    /// Not swapped: the framework memory stays borrowed until this handle is dropped.
    Kept {
        _src: DeviceBuffer,
        owner: Py<PyAny>,
    },
    /// Handed back to the framework.
    Done,
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::Offloading { .. } => "d2h",
            State::Host { .. } => "host",
            State::Reloading { .. } => "h2d",
            State::Kept { .. } => "kept",
            State::Done => "done",
        }
    }
}

fn wrong(op: &str, expected: &str, state: &State) -> BindError {
    BindError::Swap(hprt_swap::SwapError::Order(format!(
        "{op} needs a host copy in state {expected}, this one is in state {}",
        state.name()
    )))
}

/// Offloads and reloads a framework's tensors through hprt streams, events and pinned memory.
///
/// ```python
/// fs = hprt.FrameworkSwap(hprt.get_platform())
/// compute = fs.platform_stream()            # or p.wrap_stream(framework_stream)
/// h = fs.offload(t.data_ptr(), t.nbytes, t, compute)
/// h.wait_offload()                          # t's memory is no longer referenced by hprt
/// out = torch.empty_like(t)
/// h.start_reload(out.data_ptr(), out.nbytes, out, compute)
/// h.finish_reload(compute, host_sync=True)  # out holds t's bytes
/// ```
#[pyclass(name = "FrameworkSwap", module = "hprt._native", frozen)]
pub struct PyFrameworkSwap {
    shared: Arc<Shared>,
}

/// One framework tensor's bytes on their way through host memory.
#[pyclass(name = "HostCopy", module = "hprt._native", frozen)]
pub struct PyHostCopy {
    shared: Arc<Shared>,
    nbytes: usize,
    state: Mutex<State>,
}

#[pymethods]
impl PyFrameworkSwap {
    #[new]
    #[pyo3(signature = (platform=None, host_budget=None))]
    fn new(platform: Option<&PyPlatform>, host_budget: Option<usize>) -> Result<Self> {
        let p = crate::platform::resolve(platform)?;
        let d2h = p.create_stream()?;
        let h2d = p.create_stream()?;
        let pool = PinnedPool::new(p.clone(), PoolConfig { host_budget });
        Ok(PyFrameworkSwap {
            shared: Arc::new(Shared {
                p,
                d2h,
                h2d,
                pool,
                counters: Counters::default(),
                retiring: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Queues a copy of `nbytes` at `ptr` (a framework tensor's memory; `owner` keeps it alive)
    /// into pinned memory, after the work queued on `compute` so far.
    fn offload(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
        compute: &PyStream,
    ) -> Result<PyHostCopy> {
        let sh = &self.shared;
        let src = sh.borrow(ptr, nbytes, owner.clone_ref(py))?;
        let state = py.detach(|| -> Result<State> {
            sh.reap()?;
            sh.order_after(&sh.d2h, &compute.s)?;
            let block = sh.pool.acquire(nbytes)?;
            sh.p.copy_async(block.buffer().into(), 0, (&src).into(), 0, nbytes, &sh.d2h)?;
            let fence = Arc::new(sh.p.create_event(false)?);
            sh.p.record_event(&fence, &sh.d2h)?;
            Ok(State::Offloading {
                src,
                owner,
                block,
                fence,
            })
        })?;
        sh.counters
            .offloaded_tensors
            .fetch_add(1, Ordering::Relaxed);
        sh.counters
            .offloaded_bytes
            .fetch_add(nbytes as u64, Ordering::Relaxed);
        Ok(PyHostCopy {
            shared: Arc::clone(sh),
            nbytes,
            state: Mutex::new(state),
        })
    }

    /// Keeps a tensor on the device but counts it like an offloaded one would be counted before
    /// its release: the no-swap baseline of the accounting.
    fn keep(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
    ) -> Result<PyHostCopy> {
        let src = self.shared.borrow(ptr, nbytes, owner.clone_ref(py))?;
        Ok(PyHostCopy {
            shared: Arc::clone(&self.shared),
            nbytes,
            state: Mutex::new(State::Kept { _src: src, owner }),
        })
    }

    /// A stream of this platform to stand for the compute stream of a framework that has none
    /// (torch on the CPU: its work is done when the call returns).
    fn platform_stream(&self) -> Result<PyStream> {
        Ok(PyStream {
            p: self.shared.p.clone(),
            s: self.shared.p.create_stream()?,
        })
    }

    /// Blocks until every copy queued so far completed, then returns idle blocks to the pool.
    fn synchronize(&self, py: Python<'_>) -> Result<()> {
        let sh = &self.shared;
        py.detach(|| {
            sh.p.synchronize_stream(&sh.d2h)?;
            sh.p.synchronize_stream(&sh.h2d)?;
            sh.reap()
        })
    }

    /// `device_current` / `device_peak`: framework bytes hprt references (borrowed for a copy or
    /// kept); offloaded and reloaded totals; the pinned pool's counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.shared.counters;
        let pool = self.shared.pool.stats();
        let d = PyDict::new(py);
        d.set_item("device_current", c.device_current.load(Ordering::Acquire))?;
        d.set_item("device_peak", c.device_peak.load(Ordering::Acquire))?;
        d.set_item(
            "offloaded_tensors",
            c.offloaded_tensors.load(Ordering::Acquire),
        )?;
        d.set_item("offloaded_bytes", c.offloaded_bytes.load(Ordering::Acquire))?;
        d.set_item("reloaded_bytes", c.reloaded_bytes.load(Ordering::Acquire))?;
        d.set_item("pinned_bytes_held", pool.bytes_held)?;
        d.set_item("pinned_bytes_in_use", pool.bytes_in_use)?;
        d.set_item("pinned_high_water", pool.high_water)?;
        Ok(d)
    }

    /// Starts a new peak measurement from the current usage.
    fn reset_peak(&self) {
        let c = &self.shared.counters;
        c.device_peak
            .store(c.device_current.load(Ordering::Acquire), Ordering::Release);
    }
}

#[pymethods]
impl PyHostCopy {
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }
    /// `d2h`, `host`, `h2d`, `kept` or `done`.
    #[getter]
    fn state(&self) -> &'static str {
        locked(&self.state).name()
    }
    /// Whether the offload copy completed (never blocks).
    fn offload_done(&self) -> Result<bool> {
        match &*locked(&self.state) {
            State::Offloading { fence, .. } => Ok(self.shared.p.query_event(fence)?),
            _ => Ok(true),
        }
    }

    /// Waits (on the host, without the GIL) for the offload copy, then drops hprt's reference to
    /// the framework memory. A copy already on the host is left alone.
    fn wait_offload(&self, py: Python<'_>) -> Result<()> {
        let sh = &self.shared;
        let mut st = locked(&self.state);
        match std::mem::replace(&mut *st, State::Done) {
            State::Offloading {
                src,
                owner,
                block,
                fence,
            } => {
                let synced = py.detach(|| sh.p.synchronize_event(&fence));
                if let Err(e) = synced {
                    *st = State::Offloading {
                        src,
                        owner,
                        block,
                        fence,
                    };
                    return Err(e.into());
                }
                drop(src);
                drop(owner);
                *st = State::Host { block };
                Ok(())
            }
            other @ State::Host { .. } => {
                *st = other;
                Ok(())
            }
            other => {
                let e = wrong("wait_offload", "d2h", &other);
                *st = other;
                Err(e)
            }
        }
    }

    /// Takes back a tensor whose offload has not been waited for: its memory was never released,
    /// so the original tensor is returned without a copy (its pinned block is retired once the
    /// queued copy completed). `None` when the offload was already waited for.
    fn take_back(&self, py: Python<'_>) -> Result<Option<Py<PyAny>>> {
        let mut st = locked(&self.state);
        match std::mem::replace(&mut *st, State::Done) {
            State::Offloading {
                src,
                owner,
                block,
                fence,
            } => {
                self.shared.retire(block, fence);
                drop(src);
                Ok(Some(owner))
            }
            State::Kept { _src, owner } => {
                let back = owner.clone_ref(py);
                *st = State::Kept { _src, owner };
                Ok(Some(back))
            }
            other => {
                *st = other;
                Ok(None)
            }
        }
    }

    /// Queues the copy back into `ptr` (memory the framework allocated, `owner` keeping it
    /// alive), after the work queued on `compute` so far. An offload not yet waited for is
    /// waited for first.
    fn start_reload(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
        compute: &PyStream,
    ) -> Result<()> {
        if nbytes != self.nbytes {
            return Err(invalid(format!(
                "reload target has {nbytes} bytes, the host copy {}",
                self.nbytes
            )));
        }
        if matches!(&*locked(&self.state), State::Offloading { .. }) {
            self.wait_offload(py)?;
        }
        let sh = &self.shared;
        let mut st = locked(&self.state);
        let block = match std::mem::replace(&mut *st, State::Done) {
            State::Host { block } => block,
            other => {
                let e = wrong("start_reload", "host", &other);
                *st = other;
                return Err(e);
            }
        };
        let dst = match sh.borrow(ptr, nbytes, owner.clone_ref(py)) {
            Ok(d) => d,
            Err(e) => {
                *st = State::Host { block };
                return Err(e);
            }
        };
        let queued = py.detach(|| -> Result<Arc<Event>> {
            sh.order_after(&sh.h2d, &compute.s)?;
            sh.p.copy_async((&dst).into(), 0, block.buffer().into(), 0, nbytes, &sh.h2d)?;
            let fence = Arc::new(sh.p.create_event(false)?);
            sh.p.record_event(&fence, &sh.h2d)?;
            Ok(fence)
        });
        match queued {
            Ok(fence) => {
                sh.counters
                    .reloaded_bytes
                    .fetch_add(nbytes as u64, Ordering::Relaxed);
                *st = State::Reloading {
                    dst,
                    owner,
                    block,
                    fence,
                };
                Ok(())
            }
            Err(e) => {
                // Nothing was copied into `dst`, or the copy is queued without a fence: either
                // way the host copy stays intact for a retry.
                *st = State::Host { block };
                Err(e)
            }
        }
    }

    /// Makes `compute` wait for the reload (and, with `host_sync`, the host too: frameworks
    /// whose work runs on the calling thread need it), then hands the tensor back: returns the
    /// `owner` given to `start_reload`.
    #[pyo3(signature = (compute, host_sync=true))]
    fn finish_reload(
        &self,
        py: Python<'_>,
        compute: &PyStream,
        host_sync: bool,
    ) -> Result<Py<PyAny>> {
        let sh = &self.shared;
        let mut st = locked(&self.state);
        let State::Reloading { fence, .. } = &*st else {
            return Err(wrong("finish_reload", "h2d", &st));
        };
        let fence = Arc::clone(fence);
        py.detach(|| -> Result<()> {
            sh.p.stream_wait_event(&compute.s, &fence)?;
            if host_sync {
                sh.p.synchronize_event(&fence)?;
            }
            Ok(())
        })?;
        let State::Reloading {
            dst, owner, block, ..
        } = std::mem::replace(&mut *st, State::Done)
        else {
            return Err(invalid("the host copy changed state during finish_reload"));
        };
        drop(dst);
        sh.retire(block, fence);
        Ok(owner)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFrameworkSwap>()?;
    m.add_class::<PyHostCopy>()?;
    Ok(())
}
