//! When a stream reached a point of its queue, on the host's monotonic clock: the one mechanism
//! every hprt tracer uses (the `hprt trace` / `hprt demo` decorator in hprt-cli, and
//! `hprt.fsdp.StreamTrace` through `hprt.StreamClock`).
//!
//! A [`StreamClock`] keeps, per device, a *reference*: a timing event recorded on an idle stream
//! together with the host time at which that stream reached it. [`StreamClock::mark`] records
//! another timing event on any stream; once the stream reaches it, the mark's host time is the
//! reference's host time plus the device's elapsed time between the two events
//! ([`Platform::event_elapsed_ms`]). Timing events are used rather than host functions queued
//! on the stream because a host function serializes the stream with a host thread (on CUDA a
//! `cuLaunchHostFunc` stalls the stream until the callback thread ran it), which changes the
//! overlap a trace is meant to show; an event is a timestamp the device writes itself.
//!
//! Host seconds ([`host_seconds`]) are `CLOCK_MONOTONIC` on Unix, the clock of Python's
//! `time.perf_counter()` on Linux and of Rust's `Instant`: a mark compares directly with host
//! timestamps taken around it, in Rust or in Python.
//!
//! Accuracy: a reference's host time is the middle of the shortest of a few `record` +
//! `synchronize` round trips on an idle stream, so it is off by at most half that round trip
//! (microseconds on a GPU; [`StreamMark::uncertainty_s`]). [`Platform::event_elapsed_ms`] is an `f32` of milliseconds, whose
//! resolution coarsens as the time since the reference grows; a reference older than
//! [`REANCHOR_AFTER_S`] is replaced at the next mark on its device, which keeps the resolution
//! under a microsecond.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::handle::{Event, Stream};
use crate::platform::{Platform, PlatformHandle};
use crate::sync::lock;

/// Round trips a reference is calibrated with: the shortest one bounds its error, and a few are
/// enough to skip one that a preempted host thread stretched.
const CALIBRATION_TRIES: usize = 4;

/// Seconds after which a reference is replaced at the next mark on its device (see the module
/// docs): 10 s of milliseconds in an `f32` resolve about 1 µs.
pub const REANCHOR_AFTER_S: f64 = 10.0;

/// Seconds on the host's monotonic clock: `CLOCK_MONOTONIC` on Unix, the value Python's
/// `time.perf_counter()` returns on Linux.
#[cfg(unix)]
pub fn host_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec and CLOCK_MONOTONIC exists on every Unix;
    // clock_gettime writes nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    debug_assert_eq!(rc, 0, "CLOCK_MONOTONIC is always readable");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Seconds on the host's monotonic clock; off Unix, counted from the first call in the process
/// (so not Python's `perf_counter()` there).
#[cfg(not(unix))]
pub fn host_seconds() -> f64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs_f64()
}

/// A timing event whose host time is known (see the module docs).
struct Reference {
    event: Event,
    host_s: f64,
    /// Half the calibration round trip: how far `host_s` may be from when the stream reached
    /// `event`.
    uncertainty_s: f64,
}

impl Reference {
    /// Records references on a new (so idle) stream of the current device and keeps the one with
    /// the shortest round trip. Blocks for those round trips.
    fn calibrate(p: &dyn Platform) -> Result<Reference> {
        let stream = p.create_stream()?;
        let best = (|| {
            let mut best: Option<(f64, Reference)> = None;
            for _ in 0..CALIBRATION_TRIES {
                let event = p.create_event(true)?;
                let before = host_seconds();
                p.record_event(&event, &stream)?;
                p.synchronize_event(&event)?;
                let after = host_seconds();
                let round_trip = after - before;
                if best.as_ref().is_none_or(|(b, _)| round_trip < *b) {
                    let reference = Reference {
                        event,
                        host_s: before + round_trip / 2.0,
                        uncertainty_s: round_trip / 2.0,
                    };
                    best = Some((round_trip, reference));
                }
            }
            Ok(best.expect("CALIBRATION_TRIES > 0").1)
        })();
        // The stream was only needed to be idle; the event outlives it.
        let destroyed = p.destroy_stream(&stream);
        let best = best?;
        destroyed?;
        Ok(best)
    }
}

struct ClockState {
    platform: PlatformHandle,
    /// The current reference of each device (timing events of one device cannot be compared
    /// with another's).
    references: Mutex<HashMap<usize, Arc<Reference>>>,
}

/// Puts points of streams on the host clock (see the module docs). Cheap to clone; clones
/// share their references.
#[derive(Clone)]
pub struct StreamClock {
    state: Arc<ClockState>,
}

impl std::fmt::Debug for StreamClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamClock")
            .field("backend", &self.state.platform.backend())
            .finish()
    }
}

impl StreamClock {
    /// A clock for `platform`, calibrated on the calling thread's current device now (so the
    /// first mark does not pay for it); other devices are calibrated at their first mark.
    /// Blocks for a few round trips on an idle stream.
    pub fn new(platform: PlatformHandle) -> Result<Self> {
        let device = platform.current_device();
        let reference = Reference::calibrate(&*platform)?;
        let references = Mutex::new(HashMap::from([(device, Arc::new(reference))]));
        Ok(StreamClock {
            state: Arc::new(ClockState {
                platform,
                references,
            }),
        })
    }

    pub fn platform(&self) -> &PlatformHandle {
        &self.state.platform
    }

    /// Records the point `stream` reached with the work queued on it so far. `stream` must be a
    /// stream of the calling thread's current device (as for any event the platform records).
    pub fn mark(&self, stream: &Stream) -> Result<StreamMark> {
        let p = &*self.state.platform;
        let reference = self.reference(p.current_device())?;
        let event = p.create_event(true)?;
        p.record_event(&event, stream)?;
        Ok(StreamMark {
            platform: self.state.platform.clone(),
            event,
            reference,
        })
    }

    /// The device's reference, calibrated when it has none or when its reference has aged past
    /// [`REANCHOR_AFTER_S`]. Marks keep the reference they were made with, so replacing it
    /// changes no mark's time.
    fn reference(&self, device: usize) -> Result<Arc<Reference>> {
        let mut refs = lock(&self.state.references);
        if let Some(r) = refs.get(&device) {
            if host_seconds() - r.host_s < REANCHOR_AFTER_S {
                return Ok(Arc::clone(r));
            }
        }
        let r = Arc::new(Reference::calibrate(&*self.state.platform)?);
        refs.insert(device, Arc::clone(&r));
        Ok(r)
    }
}

/// A point of one stream, recorded by [`StreamClock::mark`]. Its time is known once the stream
/// reached it: [`StreamMark::try_seconds`] says `None` before, [`StreamMark::seconds`] waits for
/// it. Cheap to clone.
#[derive(Clone)]
pub struct StreamMark {
    platform: PlatformHandle,
    event: Event,
    reference: Arc<Reference>,
}

impl std::fmt::Debug for StreamMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamMark")
            .field("reference_s", &self.reference.host_s)
            .finish()
    }
}

impl StreamMark {
    /// Whether the stream reached the mark (its time is known).
    pub fn reached(&self) -> Result<bool> {
        self.platform.query_event(&self.event)
    }

    /// The host seconds ([`host_seconds`]'s clock) at which the stream reached the mark, or
    /// `None` while it has not: tracers resolve marks whose stream is done without blocking on
    /// the others. An error the stream hit before the mark is returned.
    pub fn try_seconds(&self) -> Result<Option<f64>> {
        if !self.reached()? {
            return Ok(None);
        }
        self.time().map(Some)
    }

    /// The host seconds at which the stream reached the mark, waiting for the stream to get
    /// there first (a mark read early is a wait, not an error: a trace is read after the work).
    pub fn seconds(&self) -> Result<f64> {
        self.platform.synchronize_event(&self.event)?;
        self.time()
    }

    /// How far the mark's time may be off the host clock, at most: half the round trip its
    /// reference was calibrated with (a loaded host that is slow to wake the waiting thread
    /// widens it). Marks of one clock and device share the error, so their differences do not
    /// have it.
    pub fn uncertainty_s(&self) -> f64 {
        self.reference.uncertainty_s
    }

    /// The platform whose stream the mark is on.
    pub fn platform(&self) -> &PlatformHandle {
        &self.platform
    }

    /// The event the mark recorded, for waiting on the point it marks.
    pub fn event(&self) -> &Event {
        &self.event
    }

    fn time(&self) -> Result<f64> {
        let ms = self
            .platform
            .event_elapsed_ms(&self.reference.event, &self.event)?;
        Ok(self.reference.host_s + f64::from(ms) / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuBackend, CpuConfig};
    use std::sync::mpsc;
    use std::time::Duration;

    fn clock() -> StreamClock {
        let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
        StreamClock::new(PlatformHandle::from(p)).unwrap()
    }

    /// A mark queued behind a host function that sleeps is later than one queued before it, by
    /// at least the sleep, and both fall between host timestamps taken around them.
    #[test]
    fn marks_follow_the_stream_on_the_host_clock() {
        let clock = clock();
        let p = clock.platform().clone();
        let s = p.create_stream().unwrap();
        let t0 = host_seconds();
        let before = clock.mark(&s).unwrap();
        p.launch_host_fn(
            &s,
            Box::new(|| std::thread::sleep(Duration::from_millis(30))),
        )
        .unwrap();
        let after = clock.mark(&s).unwrap();
        p.synchronize_stream(&s).unwrap();
        let t1 = host_seconds();
        let (a, b) = (before.seconds().unwrap(), after.seconds().unwrap());
        assert!(b - a >= 0.029, "{a} -> {b}");
        // f32 milliseconds since a fresh reference resolve well under these 100 µs; the
        // reference's own error is what a loaded host adds.
        let slack = 1e-4 + after.uncertainty_s();
        assert!(
            t0 - slack <= a && b <= t1 + slack,
            "{t0} <= {a} < {b} <= {t1}"
        );
    }

    /// Before its stream reaches a mark, `try_seconds` is `None`; `seconds` waits for the
    /// stream and gives a time after the work ahead of the mark ended.
    #[test]
    fn a_mark_not_reached_yet_is_none_and_seconds_waits() {
        let clock = clock();
        let p = clock.platform().clone();
        let s = p.create_stream().unwrap();
        let (go, gate) = mpsc::channel::<()>();
        p.launch_host_fn(
            &s,
            Box::new(move || {
                let _ = gate.recv();
            }),
        )
        .unwrap();
        let mark = clock.mark(&s).unwrap();
        assert!(!mark.reached().unwrap());
        assert_eq!(mark.try_seconds().unwrap(), None);
        let released = host_seconds();
        go.send(()).unwrap();
        let at = mark.seconds().unwrap();
        assert!(
            at >= released - 1e-4 - mark.uncertainty_s(),
            "{at} < {released}"
        );
        assert_eq!(mark.try_seconds().unwrap(), Some(at));
    }

    /// Each device has its own reference: marks on a second device's stream work too.
    #[test]
    fn marks_on_another_device() {
        let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig {
            devices: 2,
            ..CpuConfig::default()
        }));
        let clock = StreamClock::new(PlatformHandle::from(Arc::clone(&p))).unwrap();
        std::thread::spawn(move || {
            p.set_device(1).unwrap();
            let s = p.create_stream().unwrap();
            let t0 = host_seconds();
            let mark = clock.mark(&s).unwrap();
            let at = mark.seconds().unwrap();
            let slack = 1e-4 + mark.uncertainty_s();
            assert!(at >= t0 - slack && at <= host_seconds() + slack);
        })
        .join()
        .unwrap();
    }
}
