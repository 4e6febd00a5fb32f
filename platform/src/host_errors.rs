//! Errors a driver's stream cannot carry, kept in the stream's order by the backend: a host
//! function's panic (`cuLaunchHostFunc` and `aclrtLaunchCallback` callbacks cannot fail their
//! stream) and, on cuda, a collective queued on a communicator already aborted or aborted by the
//! NCCL watchdog while the collective was outstanding (NCCL's aborted kernels end without an
//! error on their stream).
//!
//! Each such error sits at a point of its stream's order. It reaches what is ordered after that
//! point, as the driver's own queued errors do: the stream's next synchronize, an event recorded
//! after it, and a stream that waited on such an event (directly or through further events),
//! until the stream's own synchronize has reported it — a point recorded after that is clean.

use crate::sync::lock;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::kernel::HostFn;

/// Errors kept per stream, oldest dropped beyond this (only a bound on a pathological loop:
/// any of them already fails the synchronizes that see it).
const KEPT: usize = 64;

#[derive(Default)]
struct Log {
    /// The last point handed out in the stream's order.
    next: u64,
    /// Points up to here were reported by the stream's own synchronize.
    reported: u64,
    errors: Vec<(u64, Error)>,
    /// Points handed out whose work may still fail (their [`Point`] lives).
    open: BTreeSet<u64>,
    /// What the stream waited on since its last synchronize, less what settled clean.
    upstream: Vec<Span>,
}

/// The errors of `log` at points in `(lo, hi]`: what an event record or a wait captures.
#[derive(Clone)]
pub(crate) struct Span {
    log: Arc<Mutex<Log>>,
    lo: u64,
    hi: u64,
}

impl Span {
    fn first_error(&self) -> Option<Error> {
        lock(&self.log)
            .errors
            .iter()
            .find(|(at, _)| self.lo < *at && *at <= self.hi)
            .map(|(_, e)| e.clone())
    }

    /// No work at its points failed, and none can any more (every point up to `hi` is done):
    /// a waiter needs to keep nothing of it.
    fn settled_clean(&self) -> bool {
        let l = lock(&self.log);
        l.open.first().is_none_or(|&at| at > self.hi)
            && !l
                .errors
                .iter()
                .any(|(at, _)| self.lo < *at && *at <= self.hi)
    }

    fn same(&self, other: &Span) -> bool {
        Arc::ptr_eq(&self.log, &other.log) && (self.lo, self.hi) == (other.lo, other.hi)
    }
}

/// One place in a stream's order ([`StreamErrors::point`]).
pub(crate) struct Point {
    log: Arc<Mutex<Log>>,
    at: u64,
}

impl Point {
    /// The work at this place failed with `e`: it reaches whatever is ordered after the place
    /// and has not reported it yet (such a report waits for the work, so it comes later).
    pub(crate) fn fail(&self, e: Error) {
        StreamErrors::push(&self.log, self.at, e);
    }
}

/// Dropped once its work is over (the host function ran, the collective finished or failed):
/// from then on nothing can fail at this place.
impl Drop for Point {
    fn drop(&mut self) {
        lock(&self.log).open.remove(&self.at);
    }
}

/// One stream's errors and what it waited on.
#[derive(Clone, Default)]
pub(crate) struct StreamErrors(Arc<Mutex<Log>>);

impl StreamErrors {
    fn next_point(log: &mut Log) -> u64 {
        log.next += 1;
        log.next
    }

    fn push(log: &Arc<Mutex<Log>>, at: u64, e: Error) {
        let mut l = lock(log);
        if l.errors.len() == KEPT {
            l.errors.remove(0);
        }
        l.errors.push((at, e));
    }

    /// A place in the stream's order for work queued now, whose error becomes known later.
    pub(crate) fn point(&self) -> Point {
        let mut l = lock(&self.0);
        let at = Self::next_point(&mut l);
        l.open.insert(at);
        Point {
            log: self.0.clone(),
            at,
        }
    }

    /// `f`, with its panic caught and kept at its place in the stream's order.
    pub(crate) fn guard(&self, backend: BackendKind, f: HostFn) -> HostFn {
        let at = self.point();
        Box::new(move || {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                at.fail(Error::new(
                    ErrorKind::Internal,
                    backend,
                    "launch_host_fn",
                    "the host function panicked",
                ));
            }
        })
    }

    /// `e` as the error of work queued now (known on the host at the call).
    pub(crate) fn queue(&self, e: Error) {
        self.point().fail(e);
    }

    /// What an event recorded now carries: this stream's unreported errors up to here, and
    /// those it waited on.
    pub(crate) fn record(&self) -> Vec<Span> {
        let mut l = lock(&self.0);
        let hi = Self::next_point(&mut l);
        let mut spans = l.upstream.clone();
        spans.push(Span {
            log: self.0.clone(),
            lo: l.reported,
            hi,
        });
        spans
    }

    /// The stream waits on an event that carries `spans`. What settled clean (no error, and
    /// none can come) is not kept, and what was kept and has settled clean since is dropped:
    /// a long-lived stream that waits on ever-new streams keeps only what can still fail.
    pub(crate) fn wait(&self, spans: &[Span]) {
        // Other logs are read without this one locked: a source may be waiting on this stream
        // at the same time.
        let incoming: Vec<&Span> = spans
            .iter()
            .filter(|s| !Arc::ptr_eq(&s.log, &self.0) && !s.settled_clean())
            .collect();
        let kept = lock(&self.0).upstream.clone();
        let settled: Vec<Span> = kept.into_iter().filter(Span::settled_clean).collect();
        let mut l = lock(&self.0);
        // A span widened meanwhile is no longer `same`, and stays.
        l.upstream.retain(|u| !settled.iter().any(|s| s.same(u)));
        for s in incoming {
            // One span per source stream: the widest.
            match l.upstream.iter_mut().find(|u| Arc::ptr_eq(&u.log, &s.log)) {
                Some(u) => {
                    u.lo = u.lo.min(s.lo);
                    u.hi = u.hi.max(s.hi);
                }
                None => l.upstream.push(s.clone()),
            }
        }
    }

    /// How many source streams' spans the stream keeps (for tests of its bound).
    #[cfg(test)]
    pub(crate) fn upstream_len(&self) -> usize {
        lock(&self.0).upstream.len()
    }

    /// For the stream's synchronize, once the driver's has returned (every host function queued
    /// before it has run): the first error since the last report, its own or one it waited on.
    pub(crate) fn take(&self) -> Result<()> {
        let (own, upstream) = {
            let mut l = lock(&self.0);
            let (lo, hi) = (l.reported, l.next);
            l.reported = hi;
            let own = l
                .errors
                .iter()
                .find(|(at, _)| lo < *at && *at <= hi)
                .map(|(_, e)| e.clone());
            (own, std::mem::take(&mut l.upstream))
        };
        match own.or_else(|| first_error(&upstream)) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Synchronizes every stream of `live` (a device synchronize of a driver backend), then reports
/// the first error: a stream's, else one a destroyed stream left in `retired`.
pub(crate) fn synchronize_all<S>(
    live: impl IntoIterator<Item = S>,
    mut synchronize: impl FnMut(&S) -> Result<()>,
    retired: &Retired<S>,
) -> Result<()> {
    let mut first = Ok(());
    for s in live {
        if let Err(e) = synchronize(&s) {
            first = first.and(Err(e));
        }
    }
    first.and(retired.take())
}

/// What a driver backend's event keeps of its latest record: whether there was one (an event
/// never recorded counts as complete, and ACL cannot tell) and the backend's errors that record
/// carries, which a stream waiting on the event inherits and a synchronize on it reports.
#[derive(Default)]
pub(crate) struct EventRecord {
    recorded: AtomicBool,
    carries: Mutex<Vec<Span>>,
}

impl EventRecord {
    pub(crate) fn is_recorded(&self) -> bool {
        self.recorded.load(Ordering::Acquire)
    }
    /// After the driver recorded the event on a stream whose errors are `errors`.
    pub(crate) fn recorded_on(&self, errors: &StreamErrors) {
        *lock(&self.carries) = errors.record();
        self.recorded.store(true, Ordering::Release);
    }
    /// After the driver made a stream whose errors are `errors` wait for the event.
    pub(crate) fn waited_by(&self, errors: &StreamErrors) {
        errors.wait(&lock(&self.carries));
    }
    /// The first error the latest record carries (for a synchronize, after the driver's).
    pub(crate) fn first_error(&self) -> Option<Error> {
        first_error(&lock(&self.carries))
    }
}

/// The first error `spans` carry (for an event's synchronize, after the driver's).
pub(crate) fn first_error(spans: &[Span]) -> Option<Error> {
    spans.iter().find_map(Span::first_error)
}

/// Streams the user destroyed, kept until their errors are known: a device synchronize reports
/// what no stream synchronize did (the driver drops a destroyed stream's error).
pub(crate) struct Retired<S> {
    /// Destroyed while work was still queued; live for the device synchronize to wait on.
    busy: Mutex<Vec<S>>,
    /// Errors of destroyed streams, for the next device synchronize.
    orphans: Mutex<Vec<Error>>,
}

impl<S> Default for Retired<S> {
    fn default() -> Self {
        Retired {
            busy: Mutex::default(),
            orphans: Mutex::default(),
        }
    }
}

impl<S> Retired<S> {
    /// Takes a destroyed stream; it (and any kept before) goes once idle, its error kept.
    /// `idle` asks the driver without blocking; `sync` is the stream's synchronize.
    pub(crate) fn retire(
        &self,
        stream: S,
        idle: impl Fn(&S) -> bool,
        sync: impl Fn(&S) -> Result<()>,
    ) {
        let mut busy = lock(&self.busy);
        busy.push(stream);
        let mut kept = Vec::new();
        for s in busy.drain(..) {
            if !idle(&s) {
                kept.push(s);
            } else if let Err(e) = sync(&s) {
                let mut o = lock(&self.orphans);
                if o.len() < KEPT {
                    o.push(e);
                }
            }
        }
        *busy = kept;
    }

    /// For the device synchronize, once it has synchronized every live stream (the busy ones
    /// among them): the destroyed streams go, and the first error kept of one.
    pub(crate) fn take(&self) -> Result<()> {
        lock(&self.busy).clear();
        match std::mem::take(&mut *lock(&self.orphans)).into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure() -> Error {
        Error::new(ErrorKind::Internal, BackendKind::Cpu, "f", "failed")
    }

    #[test]
    fn a_stream_waiting_on_ever_new_streams_keeps_only_what_can_still_fail() {
        let long = StreamErrors::default();
        for _ in 0..1000 {
            let source = StreamErrors::default();
            long.wait(&source.record());
        }
        assert_eq!(long.upstream_len(), 0);

        // Work still queued before the record: kept until it is over.
        let pending = StreamErrors::default();
        let at = pending.point();
        long.wait(&pending.record());
        let (fails, done) = (StreamErrors::default(), StreamErrors::default());
        let failing = fails.point();
        long.wait(&fails.record());
        let finishing = done.point();
        long.wait(&done.record());
        assert_eq!(long.upstream_len(), 3);
        failing.fail(failure());
        drop((failing, finishing));
        for _ in 0..10 {
            long.wait(&StreamErrors::default().record());
        }
        // `done`'s work finished clean and went; `fails` keeps its error, `pending` its work.
        assert_eq!(long.upstream_len(), 2);
        at.fail(failure());
        drop(at);
        assert!(
            long.take().is_err(),
            "the failures reach the waiting stream"
        );
        assert_eq!(long.upstream_len(), 0);
        assert!(long.take().is_ok());
    }
}
