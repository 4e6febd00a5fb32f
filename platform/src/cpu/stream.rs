//! cpu streams: one worker thread per stream draining a FIFO of jobs; events as completion marks.
//! The host stream (raw handle 0) has no worker: a job queued on it runs in the calling thread
//! before `enqueue` returns, as CPU tensors' compute does (torch's CPU ops are done when their
//! call returns). Waiting for an event on it blocks the caller; recording one marks it at once.
//!
//! A worker's queue holds at most [`QUEUE_DEPTH`] jobs: past that the enqueuing thread blocks
//! until the worker takes one, as CUDA's launch queue blocks the host, so a loop that queues
//! work without ever synchronizing runs at the stream's pace instead of growing memory without
//! bound. (Jobs that queue work themselves, from a stream worker, are not held back: the
//! worker they would wait for may be their own. And a worker that takes no job for
//! [`STALL`] may be waiting for something the blocked thread holds, such as Python's GIL for a
//! release callback: the job is then queued past the bound rather than deadlock.)

use crate::sync::lock;
use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{BackendKind, Error, ErrorKind, Result};

/// A unit of queued work. It receives the stream it runs on so it can see that stream's state.
pub(crate) type Job = Box<dyn FnOnce(&StreamCore) -> Result<()> + Send>;

/// Jobs a stream's queue holds before `enqueue` blocks (what runs is not counted).
pub(crate) const QUEUE_DEPTH: usize = 1024;

/// How long a full queue's producer waits for a worker that takes no job before it queues past
/// the bound.
pub(crate) const STALL: Duration = Duration::from_millis(50);

thread_local! {
    /// Whether this thread is a stream's worker.
    static IN_WORKER: Cell<bool> = const { Cell::new(false) };
}

struct Queue {
    jobs: VecDeque<Job>,
    /// False once the stream is destroyed: nothing more is accepted.
    open: bool,
    submitted: u64,
    /// Jobs the worker took so far (its progress, for a producer waiting on a full queue).
    taken: u64,
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
    /// Signals the worker: a job was queued, or the stream closed.
    queued_cv: Condvar,
    /// Signals blocked producers: the worker took a job, or the stream closed.
    space_cv: Condvar,
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
        let core = Self::new(false);
        let worker = Arc::clone(&core);
        let mut jitter = jitter.map(|seed| Jitter::new(seed, id));
        std::thread::Builder::new()
            .name(format!("hprt-cpu-stream-{id}"))
            .spawn(move || {
                IN_WORKER.with(|w| w.set(true));
                while let Some(job) = worker.next_job() {
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
        Self::new(true)
    }

    fn new(inline: bool) -> Arc<StreamCore> {
        Arc::new(StreamCore {
            inline,
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                open: true,
                submitted: 0,
                taken: 0,
            }),
            queued_cv: Condvar::new(),
            space_cv: Condvar::new(),
            done: Mutex::new(Done {
                completed: 0,
                error: None,
            }),
            done_cv: Condvar::new(),
        })
    }

    /// The worker's next job, once there is one; `None` once the stream is closed and drained.
    fn next_job(&self) -> Option<Job> {
        let mut q = lock(&self.queue);
        loop {
            if let Some(job) = q.jobs.pop_front() {
                q.taken += 1;
                self.space_cv.notify_one();
                return Some(job);
            }
            if !q.open {
                return None;
            }
            q = self.queued_cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
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
    /// Blocks while [`QUEUE_DEPTH`] jobs wait and the worker takes them (except on a stream
    /// worker's thread; a worker that took none for [`STALL`] lets the job in).
    pub(crate) fn enqueue(&self, op: &'static str, job: Job) -> Result<u64> {
        if self.inline {
            return Ok(self.run_inline(job));
        }
        let held_back = !IN_WORKER.try_with(Cell::get).unwrap_or(false);
        let mut q = lock(&self.queue);
        let mut progress = q.taken;
        loop {
            if !q.open {
                return Err(Error::new(
                    ErrorKind::InvalidHandle,
                    BackendKind::Cpu,
                    op,
                    "the stream was destroyed",
                ));
            }
            if q.jobs.len() < QUEUE_DEPTH || !held_back {
                break;
            }
            let (g, waited) = self
                .space_cv
                .wait_timeout(q, STALL)
                .unwrap_or_else(|p| p.into_inner());
            q = g;
            if waited.timed_out() && q.taken == progress && q.jobs.len() >= QUEUE_DEPTH {
                break; // the worker is stalled: past the bound rather than a deadlock
            }
            progress = q.taken;
        }
        // Under the queue lock so tickets follow FIFO order across enqueuing threads.
        q.jobs.push_back(job);
        q.submitted += 1;
        self.queued_cv.notify_one();
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
        lock(&self.queue).open = false;
        self.queued_cv.notify_all();
        self.space_cv.notify_all();
    }

    pub(crate) fn is_inline(&self) -> bool {
        self.inline
    }

    pub(crate) fn is_open(&self) -> bool {
        lock(&self.queue).open
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
    /// Generations handed to records (a record whose queueing failed leaves a gap).
    issued: u64,
    /// The latest generation queued: what waits and synchronizes wait for.
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
                issued: 0,
                recorded: 0,
                reached: 0,
                time: None,
                error: None,
            }),
            cv: Condvar::new(),
        })
    }

    /// Queued without the event's lock held: the queue may be full, and a job ahead in it may
    /// be waiting for this event (whose record jobs take the lock).
    pub(crate) fn record(self: &Arc<Self>, stream: &StreamCore) -> Result<()> {
        let mut st = lock(&self.state);
        st.issued += 1;
        let generation = st.issued;
        if stream.inline {
            // The host's work queued so far is done: the mark is reached now.
            st.recorded = generation;
            st.reached = generation;
            st.time = Some(Instant::now());
            st.error = stream.pending_error();
            self.cv.notify_all();
            return Ok(());
        }
        drop(st);
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
        let mut st = lock(&self.state);
        st.recorded = st.recorded.max(generation);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuBackend, CpuConfig, Platform};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    fn noop() -> Job {
        Box::new(|_: &StreamCore| Ok(()))
    }

    /// A job that blocks its worker until the returned sender sends or is dropped.
    fn hold(core: &StreamCore) -> mpsc::Sender<()> {
        let (tx, rx) = mpsc::channel::<()>();
        core.enqueue(
            "hold",
            Box::new(move |_: &StreamCore| {
                let _ = rx.recv();
                Ok(())
            }),
        )
        .unwrap();
        tx
    }

    /// Runs `f` on a thread of its own; panics when it has not returned within 20 s.
    fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("{what}: no answer within 20 s (a deadlock)"))
    }

    /// ISSUE 32 item 16: a producer that never synchronizes is held back at `QUEUE_DEPTH`
    /// queued jobs (it queued without bound before), and goes on once the worker does.
    #[test]
    fn a_full_queue_blocks_the_producer_until_the_worker_takes_jobs() {
        let core = StreamCore::spawn(1, None, Arc::default()).unwrap();
        let release = hold(&core);
        let queued = Arc::new(AtomicUsize::new(0));
        let producer = {
            let (core, queued) = (Arc::clone(&core), Arc::clone(&queued));
            std::thread::spawn(move || {
                for _ in 0..2 * QUEUE_DEPTH {
                    core.enqueue("noop", noop()).unwrap();
                    queued.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        // Held at the bound, but for one job per STALL the stalled worker lets in.
        let held = queued.load(Ordering::SeqCst);
        let stalls = (300 / STALL.as_millis()) as usize;
        assert!(
            (QUEUE_DEPTH..=QUEUE_DEPTH + stalls + 1).contains(&held),
            "{held} jobs queued behind a busy worker"
        );
        drop(release);
        producer.join().unwrap();
        assert_eq!(queued.load(Ordering::SeqCst), 2 * QUEUE_DEPTH);
        core.synchronize().unwrap();
        core.close();
    }

    /// A job that queues work on its own full stream is not held back (its worker is the one
    /// that would have to make room).
    #[test]
    fn a_job_queueing_on_its_own_full_stream_does_not_wait_for_itself() {
        let core = StreamCore::spawn(2, None, Arc::default()).unwrap();
        let (tx, rx) = mpsc::channel::<()>();
        let me = Arc::clone(&core);
        core.enqueue(
            "requeue",
            Box::new(move |_: &StreamCore| {
                let _ = rx.recv();
                for _ in 0..10 {
                    me.enqueue("noop", noop())?;
                }
                Ok(())
            }),
        )
        .unwrap();
        for _ in 0..QUEUE_DEPTH {
            core.enqueue("noop", noop()).unwrap();
        }
        drop(tx);
        let c = Arc::clone(&core);
        within("a job queueing on its own full stream", move || {
            c.synchronize()
        })
        .unwrap();
        core.close();
    }

    /// A worker stalled on something the producer holds (Python's GIL for a release callback,
    /// say) does not make the full queue a deadlock: after `STALL` the job goes in.
    #[test]
    fn a_stalled_worker_lets_the_producer_past_the_bound() {
        let core = StreamCore::spawn(5, None, Arc::default()).unwrap();
        let gate = Arc::new(Mutex::new(()));
        let held = lock(&gate);
        let g = Arc::clone(&gate);
        core.enqueue(
            "stalled",
            Box::new(move |_: &StreamCore| {
                drop(lock(&g));
                Ok(())
            }),
        )
        .unwrap();
        for _ in 0..QUEUE_DEPTH {
            core.enqueue("noop", noop()).unwrap();
        }
        let c = Arc::clone(&core);
        within("a job past a stalled worker", move || {
            c.enqueue("noop", noop())
        })
        .unwrap();
        drop(held);
        core.synchronize().unwrap();
        core.close();
    }

    /// A record blocked on a full stream holds no lock its event's other records need: the job
    /// at the head of that stream waits for the event recorded on another stream.
    #[test]
    fn a_record_blocked_on_a_full_stream_lets_the_event_complete() {
        let (s, t) = (
            StreamCore::spawn(3, None, Arc::default()).unwrap(),
            StreamCore::spawn(4, None, Arc::default()).unwrap(),
        );
        let e = EventCore::new();
        let release = hold(&t);
        e.record(&t).unwrap();
        e.make_stream_wait(&s).unwrap();
        for _ in 0..QUEUE_DEPTH {
            s.enqueue("noop", noop()).unwrap();
        }
        let (e2, s2) = (Arc::clone(&e), Arc::clone(&s));
        let recorder = std::thread::spawn(move || e2.record(&s2));
        std::thread::sleep(Duration::from_millis(100));
        drop(release);
        let s3 = Arc::clone(&s);
        within("a record on a full stream", move || {
            recorder.join().unwrap().unwrap();
            s3.synchronize()
        })
        .unwrap();
        e.synchronize().unwrap();
        s.close();
        t.close();
    }

    /// The loop: alloc, memset_async, free, never synchronizing. The memory the queued
    /// memsets hold stays under the queue's bound.
    #[test]
    fn an_unsynchronized_alloc_memset_free_loop_stays_bounded() {
        const BYTES: usize = 64 << 10;
        let p = CpuBackend::new(CpuConfig {
            device_memory: 1 << 30,
            alloc_cache: 0,
            ..CpuConfig::default()
        });
        let s = p.create_stream().unwrap();
        // The stream is busy a while first, as a device is with earlier work.
        p.launch_host_fn(
            &s,
            Box::new(|| std::thread::sleep(Duration::from_millis(300))),
        )
        .unwrap();
        let mut peak = 0;
        for i in 0..4 * QUEUE_DEPTH {
            let b = p.alloc_device(BYTES).unwrap();
            p.memset_async(&b, 0, i as u8, BYTES, &s).unwrap();
            p.free_device(&b).unwrap();
            peak = peak.max(p.memory_stats().device_current);
        }
        p.synchronize_stream(&s).unwrap();
        let stalls = (300 / STALL.as_millis()) as usize;
        assert!(
            peak <= (QUEUE_DEPTH + stalls + 3) * BYTES,
            "{peak} bytes held by queued work"
        );
    }
}
