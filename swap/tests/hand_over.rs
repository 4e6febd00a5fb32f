//! Memory that belongs to its framework, not to hprt: a framework that orders its memory's reuse
//! after hprt's streams (torch's `record_stream`) gets an offloaded tensor's memory back when
//! the copy is queued and a reloaded one's when the compute stream waits for it, while the
//! device trails the host; and the in-flight windows bound what is on its way, with
//! backpressure, whatever the device's lag.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hprt_platform::{CpuBackend, CpuConfig, DType, DeviceBuffer, Event, Platform, Stream};
use hprt_swap::{
    Allocator, DeviceTensor, EngineConfig, InflightWindow, Reacquired, Saved, SwapEngine,
    SwapState, SwapTensor,
};

mod common;
use common::{borrow_then, jitter_seeds, reacquired, read};

const LEN: usize = 64 << 10;

/// A framework with a stream-ordered caching allocator, reduced to what swap meets: memory it
/// takes back (`hand_over`) is reused at once, but in the order of the streams it was told
/// about (the reuse, a fill with 0xAB, waits for events recorded on them: `record_stream`).
struct Framework {
    p: Arc<dyn Platform>,
    compute: Stream,
    /// Streams named by each hand-over, and how many hand-overs there were.
    streams: Mutex<Vec<usize>>,
    handed: AtomicUsize,
    /// Memory it holds for hprt until hprt lets go (the borrowed release) or hands it over.
    held: Mutex<Vec<(usize, Arc<AtomicBool>)>>,
    /// Addresses of the reloads it allocated: those stay in use (the reloaded tensor) when
    /// hprt hands them over.
    reloads: Mutex<Vec<usize>>,
}

impl Framework {
    fn new(p: &Arc<dyn Platform>, compute: &Stream) -> Arc<Self> {
        Arc::new(Framework {
            p: Arc::clone(p),
            compute: compute.clone(),
            streams: Mutex::default(),
            handed: AtomicUsize::new(0),
            held: Mutex::default(),
            reloads: Mutex::default(),
        })
    }

    /// `mem` as a borrowed tensor of this framework.
    fn tensor(self: &Arc<Self>, mem: DeviceBuffer) -> DeviceTensor {
        let storage = self.borrow(mem);
        let handle: Arc<dyn std::any::Any + Send + Sync> = Arc::new(storage.device_ptr());
        let alloc: Arc<dyn Allocator> = self.clone();
        DeviceTensor::borrowed(storage, DType::U8, vec![LEN], Some(handle), alloc).unwrap()
    }

    fn borrow(&self, mem: DeviceBuffer) -> DeviceBuffer {
        let live = Arc::new(AtomicBool::new(true));
        lock(&self.held).push((mem.device_ptr(), Arc::clone(&live)));
        borrow_then(&*self.p, mem, move || live.store(false, Ordering::SeqCst))
    }

    /// Bytes of memory hprt still holds the framework's reference to.
    fn held_by_hprt(&self) -> usize {
        lock(&self.held)
            .iter()
            .filter(|(_, live)| live.load(Ordering::SeqCst))
            .count()
            * LEN
    }
}

impl Allocator for Framework {
    fn allocate(&self, _like: &DeviceTensor) -> hprt_swap::Result<Reacquired> {
        let mem = self.p.alloc_device(LEN)?;
        let storage = self.borrow(mem);
        lock(&self.reloads).push(storage.device_ptr());
        let handle: Arc<dyn std::any::Any + Send + Sync> = Arc::new(storage.device_ptr());
        Ok(Reacquired {
            handle: Some(handle),
            ..reacquired(storage)
        })
    }

    fn hand_over(&self, t: &DeviceTensor, streams: &[&Stream]) -> hprt_swap::Result<bool> {
        self.handed.fetch_add(1, Ordering::SeqCst);
        let ptr = *t.handle.as_ref().unwrap().downcast_ref::<usize>().unwrap();
        // record_stream, then the memory is the framework's: it reuses it right away, in the
        // order of the recorded streams.
        for s in streams {
            lock(&self.streams).push(s.raw().0);
            let e: Event = self.p.create_event(false)?;
            self.p.record_event(&e, s)?;
            self.p.stream_wait_event(&self.compute, &e)?;
        }
        for (p, live) in lock(&self.held).iter() {
            if *p == ptr {
                live.store(false, Ordering::SeqCst);
            }
        }
        // A saved tensor nobody else holds is freed, and its block reused at once.
        if !lock(&self.reloads).contains(&ptr) {
            self.p
                .memset_async(&t.storage, t.offset, 0xAB, t.len, &self.compute)?;
        }
        Ok(true)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap()
}

/// A cpu platform (its copies lagging by `jitter`'s seed), a compute stream and the framework.
fn setup(jitter: Option<u64>) -> (Arc<dyn Platform>, Stream, Arc<Framework>) {
    let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig {
        device_memory: 64 << 20,
        jitter,
        ..CpuConfig::default()
    }));
    let s = p.create_stream().unwrap();
    let fw = Framework::new(&p, &s);
    (p, s, fw)
}

/// An engine on `p` whose copies in flight are bounded by these windows.
fn windowed(
    p: &Arc<dyn Platform>,
    offload_bytes: Option<usize>,
    reload_bytes: Option<usize>,
) -> SwapEngine {
    let config = EngineConfig {
        window: InflightWindow {
            offload_bytes,
            reload_bytes,
        },
        ..EngineConfig::default()
    };
    SwapEngine::new(Arc::clone(p), config).unwrap()
}

/// The device trails the host: `ms` of work queued on `s` before what follows.
fn lag(p: &Arc<dyn Platform>, s: &Stream, ms: u64) {
    p.launch_host_fn(
        s,
        Box::new(move || std::thread::sleep(Duration::from_millis(ms))),
    )
    .unwrap();
}

fn pattern(i: usize) -> Vec<u8> {
    (0..LEN).map(|k| (k * 31 + i * 7 + 1) as u8).collect()
}

fn saved(p: &Arc<dyn Platform>, s: &Stream, fw: &Arc<Framework>, i: usize) -> SwapTensor {
    let mem = p.alloc_device(LEN).unwrap();
    p.write_device_sync(&mem, 0, &pattern(i), s).unwrap();
    SwapTensor::new(Saved::Tensor(fw.tensor(mem))).unwrap()
}

#[test]
fn an_offloaded_tensor_goes_back_to_its_framework_when_its_copy_is_queued() {
    for seed in [None]
        .into_iter()
        .chain(jitter_seeds().into_iter().map(Some))
    {
        let (p, s, fw) = setup(seed);
        let mut engine = SwapEngine::new(Arc::clone(&p), EngineConfig::default()).unwrap();
        let mut ts: Vec<_> = (0..4).map(|i| saved(&p, &s, &fw, i)).collect();
        lag(&p, &s, 30); // the copies below trail the host
        engine.offload(ts.iter_mut(), &s).unwrap();
        // Before the hand-over hprt held every tensor until the host saw its copy finish (on a
        // GPU, several layers later).
        assert_eq!(
            fw.held_by_hprt(),
            0,
            "seed {seed:?}: given back at the offload"
        );
        assert_eq!(fw.handed.load(Ordering::SeqCst), 4);
        assert!(lock(&fw.streams)
            .iter()
            .all(|&raw| raw == engine.d2h_stream().raw().0));
        assert_eq!(engine.stats().handed_back_tensors, 4);
        // No host wait, and the framework's reuse (0xAB fills) waits for the copies: the host
        // copies are whole, the reload waits for them on its stream.
        engine.finish_offload(ts.iter_mut()).unwrap();
        assert!(ts.iter().all(|t| t.state() == SwapState::Host));
        engine.start_reload(ts.iter_mut()).unwrap();
        engine.finish_reload(ts.iter_mut(), &s).unwrap();
        for (i, t) in ts.iter().enumerate() {
            assert!(read(&p, &s, t) == pattern(i), "seed {seed:?}: tensor {i}");
        }
        // The reloads went back too (when the compute stream waited for them), the handles stay.
        assert_eq!(fw.handed.load(Ordering::SeqCst), 8);
        assert_eq!(fw.held_by_hprt(), 0);
    }
}

#[test]
fn an_offload_handed_back_cannot_be_cancelled_and_reloads_instead() {
    let (p, s, fw) = setup(Some(3));
    let mut engine = SwapEngine::new(Arc::clone(&p), EngineConfig::default()).unwrap();
    let mut t = saved(&p, &s, &fw, 9);
    lag(&p, &s, 20);
    engine.offload([&mut t], &s).unwrap();
    engine.cancel_offload([&mut t]).unwrap();
    assert_eq!(
        t.state(),
        SwapState::Host,
        "its device bytes are the framework's"
    );
    engine.start_reload([&mut t]).unwrap();
    engine.finish_reload([&mut t], &s).unwrap();
    assert!(read(&p, &s, &t) == pattern(9));
}

#[test]
fn the_offload_window_bounds_the_bytes_in_flight_with_backpressure() {
    for window in [None, Some(2 * LEN)] {
        let (p, s, fw) = setup(None);
        let mut engine = windowed(&p, window, None);
        let mut ts: Vec<_> = (0..8).map(|i| saved(&p, &s, &fw, i)).collect();
        let mut most = 0;
        for t in &mut ts {
            lag(&p, &s, 10); // each layer's compute, which its offload waits for
            engine.offload([&mut *t], &s).unwrap();
            most = most.max(engine.inflight_bytes().0);
        }
        let st = engine.stats();
        match window {
            None => {
                assert_eq!(most, 8 * LEN, "the host ran ahead of every copy");
                assert_eq!(st.offload_window_waits, 0);
            }
            Some(w) => {
                assert!(most <= w, "{most} bytes in flight over a {w}-byte window");
                assert!(st.offload_window_waits >= 5, "{st:?}");
                assert!(st.offload_inflight_peak as usize <= w);
            }
        }
        engine.finish_offload(ts.iter_mut()).unwrap();
        engine.start_reload(ts.iter_mut()).unwrap();
        engine.finish_reload(ts.iter_mut(), &s).unwrap();
        for (i, t) in ts.iter().enumerate() {
            assert!(
                read(&p, &s, t) == pattern(i),
                "window {window:?}: tensor {i}"
            );
        }
    }
}

#[test]
fn one_batch_larger_than_the_window_waits_for_its_own_first_part() {
    let (p, s, fw) = setup(Some(5));
    let mut engine = windowed(&p, Some(3 * LEN), None);
    let mut ts: Vec<_> = (0..8).map(|i| saved(&p, &s, &fw, i)).collect();
    lag(&p, &s, 20);
    engine.offload(ts.iter_mut(), &s).unwrap();
    assert!(engine.inflight_bytes().0 <= 3 * LEN);
    assert!(engine.stats().offload_window_waits >= 1);
    engine.finish_offload(ts.iter_mut()).unwrap();
    engine.start_reload(ts.iter_mut()).unwrap();
    engine.finish_reload(ts.iter_mut(), &s).unwrap();
    for (i, t) in ts.iter().enumerate() {
        assert!(read(&p, &s, t) == pattern(i), "tensor {i}");
    }
}

#[test]
fn prefetches_stay_within_the_reload_window_and_loads_always_start() {
    let (p, s, fw) = setup(None);
    let mut engine = windowed(&p, None, Some(2 * LEN));
    let mut ts: Vec<_> = (0..5).map(|i| saved(&p, &s, &fw, i)).collect();
    engine.offload(ts.iter_mut(), &s).unwrap();
    engine.finish_offload(ts.iter_mut()).unwrap();
    assert_eq!(engine.prefetch(ts.iter_mut()).unwrap(), 2);
    assert_eq!(engine.inflight_bytes().1, 2 * LEN);
    assert_eq!(engine.stats().prefetches_deferred, 3);
    // A load the compute stream needs now starts whatever the window.
    engine.start_reload([&mut ts[4]]).unwrap();
    assert_eq!(engine.inflight_bytes().1, 3 * LEN);
    // Handed to the compute stream: out of the window, and the next prefetch fits.
    engine.finish_reload(ts[..2].iter_mut(), &s).unwrap();
    assert_eq!(engine.inflight_bytes().1, LEN);
    assert_eq!(engine.prefetch(ts.iter_mut()).unwrap(), 1);
    assert_eq!(
        (ts[2].state(), ts[3].state()),
        (SwapState::H2d, SwapState::Host)
    );
    engine.start_reload(ts.iter_mut()).unwrap();
    engine.finish_reload(ts.iter_mut(), &s).unwrap();
    assert_eq!(engine.inflight_bytes().1, 0);
    assert_eq!(engine.stats().reload_inflight_peak as usize, 3 * LEN);
    for (i, t) in ts.iter().enumerate() {
        assert!(read(&p, &s, t) == pattern(i), "tensor {i}");
    }
    // A tensor dropped mid-reload leaves the window too.
    let mut t = saved(&p, &s, &fw, 7);
    engine.offload([&mut t], &s).unwrap();
    engine.finish_offload([&mut t]).unwrap();
    engine.prefetch([&mut t]).unwrap();
    assert_eq!(engine.inflight_bytes().1, LEN);
    drop(t);
    assert_eq!(engine.inflight_bytes().1, 0);
}
