//! Collectives over HCCL, communicator lifetimes, and the names of collectives that failed.
//!
//! HCCL fails a collective whose peer never comes, or that the ranks disagree on, at its own
//! timeout, as a stream error that names neither the collective nor the cause
//! (`ACL_ERROR_RT_INTERNAL_ERROR` from a synchronize). So each collective outside a group is
//! queued between two timing marks, and kept with its place in its stream's order
//! ([`Watched`]) until its end mark shows it finished. When a synchronize fails, the watched
//! collectives whose end mark carries an error become errors of their own at their places
//! (`host_errors`), so the failing synchronize, and every stream ordered after them, reports
//! `all_gather #3 on the HCCL communicator of rank 0 of 2 timed out after 5.0 s` (`Timeout`, when
//! it ran for the collective timeout, `HP_COLLECTIVE_TIMEOUT_MS`) or `... failed after 0.2 s`.

use super::*;
use std::time::Duration;

/// A collective queued between two timing marks, not yet known to have finished. Its marks
/// are plain ACL events (an `EventObj` would keep the platform's `Shared` alive from its own
/// list), destroyed when it is no longer watched.
pub(crate) struct Watched {
    at: Point,
    start: result::Event,
    end: result::Event,
    op: &'static str,
    what: String,
}

impl Watched {
    /// # Safety
    /// Once, with this platform's device bound; nothing waits on the marks any more.
    pub(super) unsafe fn destroy(self, api: &Ascend) {
        // SAFETY: the caller's contract; the marks were created by `mark` and are not shared.
        unsafe {
            result::event::destroy(api, self.start);
            result::event::destroy(api, self.end);
        }
    }
}

impl Shared {
    /// Turns each watched collective whose end mark was reached into an error at its place
    /// when the mark carries the driver's error (it failed), and stops watching it.
    ///
    /// The list stays locked until every failure is posted: ranks that are threads of one
    /// process share it, and a synchronize that found it emptied by another rank's settle, still
    /// posting, would report the driver's unnamed error.
    pub(super) fn settle_collectives(&self) {
        let mut watched = lock(&self.watched);
        if watched.is_empty() || self.bind().is_err() {
            return;
        }
        let timeout = Duration::from_millis(self.collective_timeout_ms.load(Ordering::Relaxed));
        let (mut done, mut pending) = (Vec::new(), Vec::new());
        for w in watched.drain(..) {
            match result::event::query(&self.api, w.end) {
                Ok(true) => done.push(w),
                _ => pending.push(w),
            }
        }
        *watched = pending;
        for w in done {
            // An error the start mark carries came before the collective: not its failure.
            let before = result::event::synchronize(&self.api, w.start);
            if let (Ok(()), Err(e)) = (before, result::event::synchronize(&self.api, w.end)) {
                let ran = result::event::elapsed_ms(&self.api, w.start, w.end)
                    .ok()
                    .map(|ms| Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3));
                w.at.fail(failed_collective(&w, ran, timeout, &e));
            }
            // SAFETY: bound above; the marks are reached and only this list knew them.
            unsafe { w.destroy(&self.api) };
        }
    }
}

/// The error of a collective whose end mark carries `driver`'s error after it ran `ran`.
fn failed_collective(
    w: &Watched,
    ran: Option<Duration>,
    timeout: Duration,
    driver: &Error,
) -> Error {
    let cause = format!("{} ({})", driver.code_name, driver.message);
    match ran {
        Some(ran) if ran >= timeout => Error::new(
            ErrorKind::Timeout,
            BackendKind::Npu,
            w.op,
            format!(
                "{} timed out after {:.1} s (the collective timeout is {} ms, \
                 HP_COLLECTIVE_TIMEOUT_MS): a peer died, never issued it or disagrees on it, \
                 and HCCL failed it with {cause}",
                w.what,
                ran.as_secs_f64(),
                timeout.as_millis()
            ),
        ),
        _ => Error::driver(
            driver.kind,
            BackendKind::Npu,
            w.op,
            driver.code,
            driver.code_name.clone(),
            format!(
                "{} failed{}: the ranks disagree on it or a peer failed ({cause})",
                w.what,
                ran.map(|r| format!(" after {:.1} s", r.as_secs_f64()))
                    .unwrap_or_default()
            ),
        ),
    }
}

impl Drop for CommObj {
    fn drop(&mut self) {
        // SAFETY: we created this communicator.
        let _ = hccl(
            unsafe { self.shared.api.hccl.HcclCommDestroy(self.raw.sys()) }.0 as i32,
            "HcclCommDestroy",
        );
    }
}

pub(super) fn hccl_dtype(d: DType) -> HcclDataType {
    HcclDataType(match d {
        DType::I8 => 0,
        DType::I32 => 2,
        DType::F16 => 3,
        DType::F32 => 4,
        DType::I64 => 5,
        DType::U8 => 7,
        DType::F64 => 10,
        DType::BF16 => 11,
    })
}

pub(super) fn hccl_op(op: ReduceOp) -> HcclReduceOp {
    HcclReduceOp(match op {
        ReduceOp::Sum | ReduceOp::Avg => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    })
}

impl NpuBackend {
    pub(super) fn new_comm(
        &self,
        raw: result::Comm,
        rank: usize,
        world: usize,
    ) -> Result<Arc<CommObj>> {
        let scratch = Backend::alloc_device(self, 4)?.0;
        Ok(Arc::new(CommObj {
            shared: Arc::clone(&self.shared),
            raw,
            rank,
            world,
            scratch,
            issued: AtomicU64::new(0),
        }))
    }

    /// A timing mark recorded on `stream` now (whose device is bound); `None` when none can be
    /// (the collective is then not watched, and its failure stays the driver's).
    fn mark(&self, stream: &Arc<StreamObj>) -> Option<result::Event> {
        let e = result::event::create(self.api(), ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE).ok()?;
        if result::event::record(self.api(), e, stream.raw).is_err() {
            // SAFETY: created above, never recorded.
            unsafe { result::event::destroy(self.api(), e) };
            return None;
        }
        Some(e)
    }

    /// Queues `op` on `stream` ([`Backend::collective`]).
    pub(super) fn issue_collective(
        &self,
        comm: &Arc<CommObj>,
        op: Collective<Option<Place<Arc<MemObj>>>>,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        self.shared.bind()?;
        let h = &self.api().hccl;
        let op = match op {
            Collective::Barrier => auxil::comm::barrier_as_all_reduce(Arc::clone(&comm.scratch)),
            op => op,
        };
        let (c, s) = (comm.raw.sys(), stream.raw.sys());
        let grouped = GROUP_DEPTH.with(|d| d.get() > 0);
        let start = if grouped { None } else { self.mark(stream) };
        // SAFETY: (every call below) places were bounds-checked for the extent HCCL touches;
        // the communicator and stream are live (`comm` and `stream` own them and are borrowed
        // for the call); HCCL only queues the work on `s`.
        let (code, name) = unsafe {
            match &op {
                Collective::AllReduce {
                    send,
                    recv,
                    count,
                    dtype,
                    op,
                } => (
                    h.HcclAllReduce(
                        ptr(send),
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        hccl_op(*op),
                        c,
                        s,
                    ),
                    "HcclAllReduce",
                ),
                Collective::ReduceScatter {
                    send,
                    recv,
                    count,
                    dtype,
                    op,
                } => (
                    h.HcclReduceScatter(
                        ptr(send),
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        hccl_op(*op),
                        c,
                        s,
                    ),
                    "HcclReduceScatter",
                ),
                Collective::AllGather {
                    send,
                    recv,
                    count,
                    dtype,
                } => (
                    h.HcclAllGather(
                        ptr(send),
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        c,
                        s,
                    ),
                    "HcclAllGather",
                ),
                Collective::Broadcast {
                    buf,
                    count,
                    dtype,
                    root,
                } => (
                    h.HcclBroadcast(
                        ptr(buf),
                        *count as u64,
                        hccl_dtype(*dtype),
                        *root as u32,
                        c,
                        s,
                    ),
                    "HcclBroadcast",
                ),
                Collective::AllToAll {
                    send,
                    recv,
                    count,
                    dtype,
                } => {
                    let dt = hccl_dtype(*dtype);
                    (
                        h.HcclAlltoAll(
                            ptr(send),
                            *count as u64,
                            dt,
                            ptr(recv),
                            *count as u64,
                            dt,
                            c,
                            s,
                        ),
                        "HcclAlltoAll",
                    )
                }
                Collective::AllToAllV {
                    send,
                    recv,
                    send_counts,
                    send_displs,
                    recv_counts,
                    recv_displs,
                    dtype,
                } => {
                    let v = |x: &[usize]| x.iter().map(|&n| n as u64).collect::<Vec<u64>>();
                    let (sc, sd, rc, rd) = (
                        v(send_counts),
                        v(send_displs),
                        v(recv_counts),
                        v(recv_displs),
                    );
                    let dt = hccl_dtype(*dtype);
                    (
                        h.HcclAlltoAllV(
                            ptr(send),
                            sc.as_ptr().cast(),
                            sd.as_ptr().cast(),
                            dt,
                            ptr(recv),
                            rc.as_ptr().cast(),
                            rd.as_ptr().cast(),
                            dt,
                            c,
                            s,
                        ),
                        "HcclAlltoAllV",
                    )
                }
                Collective::Send {
                    send,
                    count,
                    dtype,
                    peer,
                } => (
                    h.HcclSend(
                        ptr(send),
                        *count as u64,
                        hccl_dtype(*dtype),
                        *peer as u32,
                        c,
                        s,
                    ),
                    "HcclSend",
                ),
                Collective::Recv {
                    recv,
                    count,
                    dtype,
                    peer,
                } => (
                    h.HcclRecv(
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        *peer as u32,
                        c,
                        s,
                    ),
                    "HcclRecv",
                ),
                Collective::Barrier => unreachable!("issued as an all-reduce above"),
            }
        };
        if let Err(e) = hccl(code.0 as i32, name) {
            if let Some(start) = start {
                // SAFETY: created by `mark`, waited on by nobody.
                unsafe { result::event::destroy(self.api(), start) };
            }
            return Err(e);
        }
        let end = start.and_then(|_| self.mark(stream));
        let seq = comm.issued.fetch_add(1, Ordering::Relaxed) + 1;
        let marks = match (start, end) {
            (Some(start), Some(end)) => Some((start, end)),
            (Some(start), None) => {
                // SAFETY: created by `mark`, waited on by nobody.
                unsafe { result::event::destroy(self.api(), start) };
                None
            }
            _ => None,
        };
        if let Some((start, end)) = marks {
            self.shared.settle_collectives();
            lock(&self.shared.watched).push(Watched {
                at: stream.errors.point(),
                start,
                end,
                op: op.name(),
                what: format!(
                    "{} #{seq} on the HCCL communicator of rank {} of {}",
                    op.name(),
                    comm.rank,
                    comm.world
                ),
            });
        }
        for (place, _) in op.places(comm.world) {
            if let Some(p) = place {
                p.mem.used_on(stream.raw)?;
            }
        }
        match auxil::comm::avg_to_scale(op, comm.world) {
            Some((recv, count, dtype)) => {
                self.divide_on_stream(&recv, count, dtype, comm.world, stream)
            }
            None => Ok(()),
        }
    }
}

#[cfg(test)]
impl NpuBackend {
    /// Sets the collective timeout `HP_COLLECTIVE_TIMEOUT_MS` would.
    pub(crate) fn set_collective_timeout(&self, t: Duration) {
        self.shared
            .collective_timeout_ms
            .store(t.as_millis() as u64, Ordering::Relaxed);
    }
}
