//! An event record: completed, with its time, when the stream reaches it. Waits and queries look
//! at the record as of their call, as on hardware where a re-record replaces what later waiters
//! see but not what earlier waits captured.
//!
//! A mark carries the stream's asynchronous error as of the point it marks (one its stream has
//! not yet reported): waiting on the mark returns it, so a failure reaches all work ordered after
//! it — the waiting streams and the event's synchronizers.

use std::sync::{Condvar, Mutex};
use std::time::Instant;

use crate::lock;

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

/// Milliseconds from `t0` to `t1`, negative when `t1` is earlier.
pub fn elapsed_ms(t0: Instant, t1: Instant) -> f32 {
    let v = if t1 >= t0 {
        (t1 - t0).as_secs_f64() * 1e3
    } else {
        -((t0 - t1).as_secs_f64() * 1e3)
    };
    v as f32
}
