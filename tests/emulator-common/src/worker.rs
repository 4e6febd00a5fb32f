//! A stream as one worker thread draining a FIFO of jobs, so asynchronous calls really return
//! before their work runs and a missing synchronisation shows up as wrong data.
//!
//! A job's `Err(code)` is the stream's asynchronous error: the first one since the last
//! [`Worker::synchronize`] is what that call returns (and clears); later jobs still run.
//! With a delay seed (`HP_EMU_DELAY_SEED`) the worker sleeps 0–2 ms before each job.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::lock;

/// A queued piece of work; `Err` carries the vendor status code it failed with.
pub type Job = Box<dyn FnOnce() -> Result<(), i32> + Send + 'static>;

pub struct Worker {
    pub id: u64,
    q: Mutex<Queue>,
    /// Signals both "a job was queued" (to the worker) and "a job finished" (to synchronizers).
    cv: Condvar,
    /// The code a panicking job is reported with.
    panic_code: i32,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    submitted: u64,
    completed: u64,
    error: Option<i32>,
    closed: bool,
}

/// splitmix64: deterministic and good enough to spread delays.
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Worker {
    /// Starts the worker thread; `Err` when no thread can be started.
    pub fn start(
        id: u64,
        name: &str,
        delay_seed: Option<u64>,
        panic_code: i32,
    ) -> std::io::Result<Arc<Worker>> {
        let w = Arc::new(Worker {
            id,
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            panic_code,
        });
        let worker = w.clone();
        std::thread::Builder::new()
            .name(format!("{name}-{id}"))
            .spawn(move || worker.work(delay_seed))?;
        Ok(w)
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Queue>) -> MutexGuard<'a, Queue> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    fn work(&self, delay_seed: Option<u64>) {
        let mut rng = delay_seed.map(|seed| seed ^ self.id);
        loop {
            let job = {
                let mut q = lock(&self.q);
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        break job;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.wait(q);
                }
            };
            if let Some(r) = rng.as_mut() {
                std::thread::sleep(Duration::from_micros(splitmix(r) % 2001));
            }
            let res = catch_unwind(AssertUnwindSafe(job)).unwrap_or(Err(self.panic_code));
            let mut q = lock(&self.q);
            q.completed += 1;
            if let Err(code) = res {
                q.error.get_or_insert(code);
            }
            self.cv.notify_all();
        }
    }

    pub fn enqueue(&self, job: Job) {
        let mut q = lock(&self.q);
        q.jobs.push_back(job);
        q.submitted += 1;
        self.cv.notify_all();
    }

    /// Waits for everything queued before the call; returns (and clears) the first error.
    pub fn synchronize(&self) -> Result<(), i32> {
        let mut q = lock(&self.q);
        let target = q.submitted;
        while q.completed < target {
            q = self.wait(q);
        }
        q.error.take().map_or(Ok(()), Err)
    }

    /// Whether everything queued so far has run; errors stay for the next synchronize.
    pub fn idle(&self) -> bool {
        let q = lock(&self.q);
        q.completed == q.submitted
    }

    /// The error a later [`Worker::synchronize`] will return, without clearing it.
    pub fn pending_error(&self) -> Option<i32> {
        lock(&self.q).error
    }

    /// The worker drains what is queued, then exits.
    pub fn close(&self) {
        lock(&self.q).closed = true;
        self.cv.notify_all();
    }
}
