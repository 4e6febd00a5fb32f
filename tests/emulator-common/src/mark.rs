//! An event record: completed, with its time, when the stream reaches it. Waits and queries look
//! at the record as of their call, as on hardware where a re-record replaces what later waiters
//! see but not what earlier waits captured.
//!
//! A mark carries the stream's asynchronous error as of the point it marks (one its stream has
//! not yet reported): waiting on the mark returns it, so a failure reaches all work ordered after
//! it — the waiting streams and the event's synchronizers.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::lock;
use crate::worker::Worker;

#[derive(Default)]
pub struct Mark {
    /// When the mark was reached, and the stream's pending error then.
    done: Mutex<Option<(Instant, Option<i32>)>>,
    cv: Condvar,
}

impl Mark {
    pub fn complete(&self, error: Option<i32>) {
        *lock(&self.done) = Some((Instant::now(), error));
        self.cv.notify_all();
    }

    /// Waits for the mark; the error queued before it, if any.
    pub fn wait(&self) -> Result<(), i32> {
        let mut d = lock(&self.done);
        loop {
            if let Some((_, error)) = *d {
                return error.map_or(Ok(()), Err);
            }
            d = self.cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// When the stream reached it; `None` while pending.
    pub fn time(&self) -> Option<Instant> {
        lock(&self.done).map(|(t, _)| t)
    }
}

/// An event's latest record: waits and queries look at the record as of their call, and a
/// re-record replaces what later callers see.
#[derive(Default)]
pub struct Latest(Mutex<Option<Arc<Mark>>>);

impl Latest {
    /// The latest record; `None` before the first.
    pub fn get(&self) -> Option<Arc<Mark>> {
        lock(&self.0).clone()
    }

    /// Queues a fresh mark at the end of `on`'s queue and makes it the latest record.
    pub fn record(&self, on: &Arc<Worker>) {
        let mark = Arc::new(Mark::default());
        // The completion is queued before the mark is published (under the event's lock, so
        // records of one event publish in their queue order): a wait that sees the mark queues
        // behind its completion. Published first, a wait on the same stream from another
        // thread could queue ahead of it and wait for ever.
        let mut latest = lock(&self.0);
        let (worker, done) = (on.clone(), mark.clone());
        on.enqueue(Box::new(move || {
            done.complete(worker.pending_error());
            Ok(())
        }));
        *latest = Some(mark);
    }
}

/// Milliseconds from `t0` to `t1`, negative when `t1` is earlier.
pub fn elapsed_ms(t0: Instant, t1: Instant) -> f32 {
    let v = if t1 >= t0 {
        (t1 - t0).as_secs_f64() * 1e3
    } else {
        -((t0 - t1).as_secs_f64() * 1e3)
    };
    v as f32
}
