//! An event record: completed, with its time, when the stream reaches it. Waits and queries look
//! at the record as of their call, as on hardware where a re-record replaces what later waiters
//! see but not what earlier waits captured.

use std::sync::{Condvar, Mutex};
use std::time::Instant;

use crate::lock;

#[derive(Default)]
pub struct Mark {
    done: Mutex<Option<Instant>>,
    cv: Condvar,
}

impl Mark {
    pub fn complete(&self) {
        *lock(&self.done) = Some(Instant::now());
        self.cv.notify_all();
    }

    pub fn wait(&self) {
        let mut d = lock(&self.done);
        while d.is_none() {
            d = self.cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// When the stream reached it; `None` while pending.
    pub fn time(&self) -> Option<Instant> {
        *lock(&self.done)
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
