//! The NCCL watchdog, as torch's `ProcessGroupNCCL` has one: NCCL never times a collective out
//! (a peer that died, skipped the call or disagrees on it leaves the kernel spinning and every
//! host wait on it blocked), so a thread of the platform watches the collectives outstanding on
//! each communicator. When NCCL reports an asynchronous error, or the oldest outstanding
//! collective has not finished within the collective timeout (`HP_COLLECTIVE_TIMEOUT_MS`), it
//! aborts the communicator (`ncclCommAbort` ends its queued kernels, which unblocks the waits)
//! and fails every collective of it that had not finished at their places in their streams'
//! order (`host_errors`), so the waits report the cause; later collectives fail at once with it.
//!
//! Completion is an event recorded after each collective (kept for reuse once it completed).
//! The thread exists only while some communicator has collectives outstanding and sleeps a
//! tenth of the timeout (at most 100 ms) between looks.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::check::{cuda_err, nccl_error};
use super::nccl::Nccl;
use super::{lock, result, CommObj, StreamObj};
use crate::error::{Error, ErrorKind, Result};
use crate::host_errors::Point;

/// `ncclInProgress`: what a communicator reports while a non-blocking call runs; not a failure.
const NCCL_IN_PROGRESS: i32 = 7;

/// One collective queued on a communicator and not known to have finished.
struct Work {
    /// Recorded on the collective's stream right after it.
    event: result::Event,
    /// Its place in the stream's order, where a failure is reported.
    at: Point,
    op: &'static str,
    seq: u64,
    issued: Instant,
}

/// What a communicator's watch keeps, under one lock that also serialises its NCCL calls with
/// the abort (NCCL must not be handed a communicator that another thread is aborting).
#[derive(Default)]
pub(crate) struct CommWatch {
    /// Set once the communicator was aborted: the first cause, which every later operation
    /// fails with (`ncclCommAbort` freed it, so it is never used or destroyed again).
    pub(crate) aborted: Option<Error>,
    /// Collectives of an open `ncclGroupStart` are queued by `ncclGroupEnd`: they are watched
    /// from there, and the communicator is not aborted under the open group (NCCL would use
    /// the freed communicator at the group's end).
    pub(crate) in_group: u32,
    issued: u64,
    outstanding: VecDeque<Work>,
    /// Events of finished collectives, for the next ones.
    spare: Vec<result::Event>,
}

/// The platform's watchdog: the communicators with collectives outstanding.
pub(crate) struct Watchdog {
    timeout: Duration,
    watched: Mutex<Watched>,
}

#[derive(Default)]
struct Watched {
    comms: Vec<Weak<CommObj>>,
    running: bool,
}

fn finished(event: result::Event) -> bool {
    // An event this watch created and has not destroyed. Any answer but NOT_READY
    // means the work is over: an error there is the driver's, reported by the waits themselves.
    !matches!(result::event::query(event), Ok(false))
}

impl Watchdog {
    pub(crate) fn new(timeout: Duration) -> Self {
        Watchdog {
            timeout,
            watched: Mutex::default(),
        }
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Watches the collective `op` just queued on `stream` over `comm` (whose device is bound and
    /// whose watch the caller holds).
    pub(crate) fn watch(
        self: &Arc<Self>,
        comm: &Arc<CommObj>,
        watch: &mut CommWatch,
        op: &'static str,
        stream: &StreamObj,
    ) -> Result<()> {
        let event = match watch.spare.pop() {
            Some(e) => e,
            None => result::event::create(super::CU_EVENT_DISABLE_TIMING)?,
        };
        let recorded = result::event::record(event, stream.raw);
        if let Err(e) = recorded {
            watch.spare.push(event);
            return Err(e);
        }
        watch.issued += 1;
        let first = watch.outstanding.is_empty();
        watch.outstanding.push_back(Work {
            event,
            at: stream.errors.point(),
            op,
            seq: watch.issued,
            issued: Instant::now(),
        });
        if first {
            let mut w = lock(&self.watched);
            w.comms.push(Arc::downgrade(comm));
            if !w.running {
                let me = Arc::clone(self);
                let spawned = std::thread::Builder::new()
                    .name("hprt-nccl-watchdog".into())
                    .spawn(move || me.run());
                if let Err(e) = spawned {
                    return Err(cuda_err(
                        ErrorKind::Internal,
                        "nccl watchdog",
                        format!("cannot start the watchdog thread: {e}"),
                    ));
                }
                w.running = true;
            }
        }
        Ok(())
    }

    fn run(self: Arc<Self>) {
        loop {
            std::thread::sleep(tick(self.timeout));
            let comms: Vec<Weak<CommObj>> = lock(&self.watched).comms.clone();
            let mut done: Vec<Weak<CommObj>> = Vec::new();
            for weak in comms {
                let still = weak.upgrade().is_some_and(|c| self.look(&c));
                if !still {
                    done.push(weak);
                }
            }
            let mut w = lock(&self.watched);
            w.comms.retain(|c| !done.iter().any(|d| d.ptr_eq(c)));
            if w.comms.is_empty() {
                w.running = false;
                return;
            }
        }
    }

    /// One look at `comm`; whether it still has collectives outstanding.
    fn look(&self, comm: &CommObj) -> bool {
        let Ok(n) = comm.shared.nccl() else {
            return false;
        };
        let mut watch = lock(&comm.watch);
        if watch.aborted.is_some() || comm.shared.bind(comm.device).is_err() {
            return false;
        }
        if watch.in_group > 0 {
            return true;
        }
        match watch.look(n, comm.ident(), self.timeout) {
            Look::Idle => false,
            Look::Busy => true,
            Look::Failed(cause) => {
                abort(n, comm.ident(), &mut watch, cause);
                false
            }
        }
    }
}

/// How often the watchdog looks: a tenth of the timeout, at most 100 ms.
fn tick(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(1), Duration::from_millis(100))
}

/// What the watchdog needs of a communicator: its handle, and its place for messages.
#[derive(Clone, Copy)]
pub(crate) struct Ident {
    pub(crate) raw: super::nccl::Comm,
    pub(crate) rank: usize,
    pub(crate) world: usize,
}

enum Look {
    Idle,
    Busy,
    Failed(Error),
}

impl CommWatch {
    /// Forgets the finished collectives; says whether the others are still fine.
    fn look(&mut self, n: &Nccl, comm: Ident, timeout: Duration) -> Look {
        let CommWatch {
            outstanding, spare, ..
        } = self;
        outstanding.retain(|w| {
            let over = finished(w.event);
            if over {
                spare.push(w.event);
            }
            !over
        });
        let Some(oldest) = self.outstanding.front() else {
            return Look::Idle;
        };
        if let Some(e) = async_error(n, comm) {
            return Look::Failed(e);
        }
        if oldest.issued.elapsed() < timeout {
            return Look::Busy;
        }
        Look::Failed(cuda_err(
            ErrorKind::Timeout,
            oldest.op,
            format!(
                "{} #{} on the NCCL communicator of rank {} of {} did not finish within the collective timeout of {} ms (HP_COLLECTIVE_TIMEOUT_MS): a peer died, skipped it or disagrees on it; the communicator was aborted",
                oldest.op,
                oldest.seq,
                comm.rank,
                comm.world,
                timeout.as_millis()
            ),
        ))
    }

    /// Ends a communicator its owner dropped (its device bound): once its collectives finished
    /// it is destroyed; one that does not finish within the timeout gets it aborted instead, as
    /// the watchdog would (NCCL's destroy would wait for it without end). Frees the events.
    pub(crate) fn close(mut self, n: &Nccl, comm: Ident, timeout: Duration) {
        if self.aborted.is_none() {
            loop {
                match self.look(n, comm, timeout) {
                    Look::Idle => {
                        // SAFETY: we created this communicator and did not abort it.
                        let _ = n.check(
                            unsafe { (n.api.ncclCommDestroy)(comm.raw.sys()) },
                            "ncclCommDestroy",
                        );
                        break;
                    }
                    Look::Busy => std::thread::sleep(tick(timeout)),
                    Look::Failed(cause) => {
                        abort(n, comm, &mut self, cause);
                        break;
                    }
                }
            }
        }
        for e in self
            .outstanding
            .drain(..)
            .map(|w| w.event)
            .chain(self.spare)
        {
            // SAFETY: events this watch created, destroyed once.
            unsafe { result::event::destroy(e) };
        }
    }
}

/// NCCL's asynchronous error on `comm`, if it has one (a failed operation, a peer gone).
pub(crate) fn async_error(n: &Nccl, comm: Ident) -> Option<Error> {
    let mut code = 0;
    // SAFETY: a live communicator (not aborted: the caller holds its watch and checked).
    let asked = unsafe { (n.api.ncclCommGetAsyncError)(comm.raw.sys(), &mut code) };
    let code = if asked == 0 { code } else { asked };
    (code != 0 && code != NCCL_IN_PROGRESS).then(|| {
        nccl_error(
            code,
            "ncclCommGetAsyncError",
            &format!(
                "NCCL reported an error on the communicator of rank {} of {}, which was aborted",
                comm.rank, comm.world
            ),
        )
    })
}

/// Aborts `comm` (whose device is bound and whose watch is `watch`) with `cause`: its
/// collectives that had not finished fail with it at their places, then `ncclCommAbort` ends
/// their kernels.
pub(crate) fn abort(n: &Nccl, comm: Ident, watch: &mut CommWatch, cause: Error) {
    tracing::error!(error = %cause, "cuda: aborting an NCCL communicator");
    for w in &watch.outstanding {
        if !finished(w.event) {
            w.at.fail(cause.clone());
        }
    }
    // SAFETY: a live communicator; the handle is not used again (aborted is set below).
    let _ = n.check(
        unsafe { (n.api.ncclCommAbort)(comm.raw.sys()) },
        "ncclCommAbort",
    );
    watch.aborted = Some(cause);
}
