//! cpu streams: one worker thread per stream draining a FIFO of jobs; events as completion marks.
//! The host stream (raw handle 0) has no worker: a job queued on it runs in the calling thread
//! before `enqueue` returns, as CPU tensors' compute does (torch's CPU ops are done when their
//! call returns). Waiting for an event on it blocks the caller; recording one marks it at once.

use crate::sync::lock;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{BackendKind, Error, ErrorKind, Result};

/// A unit of queued work. It receives the stream it runs on so it can see that stream's state.
pub(crate) type Job = Box<dyn FnOnce(&StreamCore) -> Result<()> + Send>;

struct Queue {
    tx: Option<Sender<Job>>,
    submitted: u64,
}

struct Done {
    completed: u64,
    /// The first error since the last synchronize, reported (and cleared) by it.
    error: Option<Error>,
}

/// Errors of destroyed streams that no synchronize reported; the next device synchronize does.
pub(crate) type Orphans = Arc<Mutex<Vec<Error>>>;

/// The part of a stream its worker shares with every handle.
pub(crate) struct StreamCore {
    /// Jobs run in the enqueuing thread (the host stream).
    inline: bool,
    queue: Mutex<Queue>,
    done: Mutex<Done>,
    done_cv: Condvar,
}

impl StreamCore {
    /// Starts the worker. `jitter` (a seed) delays each job pseudo-randomly; an error still
    /// unreported when the destroyed stream's worker exits goes to `orphans`.
    pub(crate) fn spawn(
        id: usize,
        jitter: Option<u64>,
        orphans: Orphans,
    ) -> Result<Arc<StreamCore>> {
        let (tx, rx) = mpsc::channel::<Job>();
        let core = Self::new(false, tx);
        let worker = Arc::clone(&core);
        let mut jitter = jitter.map(|seed| Jitter::new(seed, id));
        std::thread::Builder::new()
            .name(format!("hprt-cpu-stream-{id}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    if let Some(j) = jitter.as_mut() {
                        j.delay();
                    }
                    worker.complete(job(&worker));
                }
                if let Some(e) = lock(&worker.done).error.take() {
                    lock(&orphans).push(e);
                }
            })
            .map_err(|e| {
                Error::new(
                    ErrorKind::Internal,
                    BackendKind::Cpu,
                    "create_stream",
                    e.to_string(),
                )
            })?;
        Ok(core)
    }

    /// The host stream: no worker, jobs run where they are queued.
    pub(crate) fn host() -> Arc<StreamCore> {
        Self::new(true, mpsc::channel::<Job>().0)
    }

    fn new(inline: bool, tx: Sender<Job>) -> Arc<StreamCore> {
        Arc::new(StreamCore {
            inline,
            queue: Mutex::new(Queue {
                tx: Some(tx),
                submitted: 0,
            }),
            done: Mutex::new(Done {
                completed: 0,
                error: None,
            }),
            done_cv: Condvar::new(),
        })
    }

    /// A job ran: counts it, keeps its error for the next synchronize, wakes the waiters.
    fn complete(&self, outcome: Result<()>) {
        let mut d = lock(&self.done);
        d.completed += 1;
        if let Err(e) = outcome {
            d.error.get_or_insert(e);
        }
        self.done_cv.notify_all();
    }

    /// Queues `job`; returns its ticket (the number of jobs queued on this stream so far).
    pub(crate) fn enqueue(&self, op: &'static str, job: Job) -> Result<u64> {
        if self.inline {
            return Ok(self.run_inline(job));
        }
        let mut q = lock(&self.queue);
        let Some(tx) = q.tx.as_ref() else {
            return Err(Error::new(
                ErrorKind::InvalidHandle,
                BackendKind::Cpu,
                op,
                "the stream was destroyed",
            ));
        };
        // Under the queue lock so tickets follow FIFO order across enqueuing threads.
        tx.send(job).map_err(|_| {
            Error::new(
                ErrorKind::Internal,
                BackendKind::Cpu,
                op,
                "the stream worker is gone",
            )
        })?;
        q.submitted += 1;
        Ok(q.submitted)
    }

    /// Runs `job` now, in this thread. The queue lock is not held meanwhile: a job that waits
    /// for an event blocks only its caller. Its error is reported like a worker's, by the next
    /// synchronize (and by events recorded after it).
    fn run_inline(&self, job: Job) -> u64 {
        let ticket = {
            let mut q = lock(&self.queue);
            q.submitted += 1;
            q.submitted
        };
        self.complete(job(self));
        ticket
    }

    /// Stops accepting work; the worker drains what is queued and exits.
    pub(crate) fn close(&self) {
        if self.inline {
            return; // the host stream lives as long as its platform
        }
        lock(&self.queue).tx = None;
    }

    pub(crate) fn is_inline(&self) -> bool {
        self.inline
    }

    pub(crate) fn is_open(&self) -> bool {
        lock(&self.queue).tx.is_some()
    }

    fn submitted(&self) -> u64 {
        lock(&self.queue).submitted
    }

    /// Waits for every job queued before the call; returns and clears the first error.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let target = self.submitted();
        let mut d = lock(&self.done);
        while d.completed < target {
            d = self.done_cv.wait(d).unwrap_or_else(|p| p.into_inner());
        }
        match d.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(crate) fn query(&self) -> bool {
        let target = self.submitted();
        lock(&self.done).completed >= target
    }

    /// The error a job hit since the last synchronize, if any (read by event records).
    pub(crate) fn pending_error(&self) -> Option<Error> {
        lock(&self.done).error.clone()
    }
}

/// The handle-side owner of a stream: closing on drop unless the stream is someone else's.
pub struct StreamRef {
    pub(crate) core: Arc<StreamCore>,
    pub(crate) owned: bool,
}

impl Drop for StreamRef {
    fn drop(&mut self) {
        if self.owned {
            self.core.close();
        }
    }
}

/// Pseudo-random delays (splitmix64) so unsynchronized readers see stale data.
struct Jitter {
    state: u64,
}

impl Jitter {
    fn new(seed: u64, stream: usize) -> Self {
        Jitter {
            state: seed ^ (stream as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        }
    }

    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// No delay one time in four; otherwise up to 2 ms, long enough to lose any race with the host.
    fn delay(&mut self) {
        let r = self.next();
        if r % 4 != 0 {
            std::thread::sleep(Duration::from_micros(1 + (r >> 8) % 2000));
        }
    }
}

struct EventState {
    recorded: u64,
    reached: u64,
    time: Option<Instant>,
    error: Option<Error>,
}

/// A completion mark: `record` queues a job that marks the event reached.
pub struct EventCore {
    state: Mutex<EventState>,
    cv: Condvar,
}

pub(crate) type CpuEvent = Arc<EventCore>;

impl EventCore {
    pub(crate) fn new() -> CpuEvent {
        Arc::new(EventCore {
            state: Mutex::new(EventState {
                recorded: 0,
                reached: 0,
                time: None,
                error: None,
            }),
            cv: Condvar::new(),
        })
    }

    pub(crate) fn record(self: &Arc<Self>, stream: &StreamCore) -> Result<()> {
        let mut st = lock(&self.state);
        let generation = st.recorded + 1;
        if stream.inline {
            // The host's work queued so far is done: the mark is reached now.
            st.recorded = generation;
            st.reached = generation;
            st.time = Some(Instant::now());
            st.error = stream.pending_error();
            self.cv.notify_all();
            return Ok(());
        }
        let me = Arc::clone(self);
        stream.enqueue(
            "record_event",
            Box::new(move |s: &StreamCore| {
                let error = s.pending_error();
                let mut st = lock(&me.state);
                if generation > st.reached {
                    st.reached = generation;
                    st.time = Some(Instant::now());
                    st.error = error;
                }
                me.cv.notify_all();
                Ok(())
            }),
        )?;
        st.recorded = generation;
        Ok(())
    }

    /// Queues on `stream` a wait for the event's current generation. An error queued before
    /// that record becomes the waiting stream's error too, as a GPU's sticky errors reach every
    /// stream ordered after the failed work: whoever synchronizes after the wait sees it.
    pub(crate) fn make_stream_wait(self: &Arc<Self>, stream: &StreamCore) -> Result<()> {
        let target = {
            let st = lock(&self.state);
            // Never recorded, or reached without an error: nothing to wait for, and no job to
            // wake a worker for.
            if st.recorded == 0 || (st.reached >= st.recorded && st.error.is_none()) {
                return Ok(());
            }
            st.recorded
        };
        let me = Arc::clone(self);
        stream.enqueue(
            "stream_wait_event",
            Box::new(move |_: &StreamCore| match &me.wait_for(target).error {
                Some(e) => Err(e.clone()),
                None => Ok(()),
            }),
        )?;
        Ok(())
    }

    fn wait_for(&self, target: u64) -> MutexGuard<'_, EventState> {
        let mut st = lock(&self.state);
        while st.reached < target {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st
    }

    pub(crate) fn query(&self) -> bool {
        let st = lock(&self.state);
        st.reached >= st.recorded
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        let target = lock(&self.state).recorded;
        let st = self.wait_for(target);
        match &st.error {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    pub(crate) fn elapsed_ms(&self, end: &EventCore) -> Result<f32> {
        let not_ready = |what: &str| {
            Error::new(
                ErrorKind::NotReady,
                BackendKind::Cpu,
                "event_elapsed_ms",
                format!("the {what} event has not completed its last record"),
            )
        };
        let a = {
            let st = lock(&self.state);
            if st.recorded == 0 || st.reached < st.recorded {
                return Err(not_ready("start"));
            }
            st.time
        };
        let b = {
            let st = lock(&end.state);
            if st.recorded == 0 || st.reached < st.recorded {
                return Err(not_ready("end"));
            }
            st.time
        };
        match (a, b) {
            (Some(a), Some(b)) if b >= a => Ok((b - a).as_secs_f32() * 1e3),
            (Some(a), Some(b)) => Ok(-((a - b).as_secs_f32() * 1e3)),
            _ => Err(not_ready("start")),
        }
    }
}
