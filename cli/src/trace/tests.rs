use super::*;
use hprt_platform::{CpuBackend, CpuConfig};

fn traced(markers: bool) -> (TracingPlatform, Arc<Recorder>) {
    let inner: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
    let rec = Recorder::new(markers);
    (
        TracingPlatform::new(PlatformHandle::from(inner), Arc::clone(&rec)),
        rec,
    )
}

/// The device memory in use is a counter track of the rank, per section, beside its stream
/// tracks: a sample after each allocation, free and enqueue that changed it, in MiB.
#[test]
fn the_trace_has_a_device_memory_counter_track() {
    let (p, rec) = traced(true);
    set_thread_rank(1);
    rec.set_section("swap");
    let s = p.create_stream().unwrap();
    p.name_stream(&s, Role::D2h, "d2h");
    let host = p.alloc_pinned(1 << 20).unwrap();
    let a = p.alloc_device(1 << 20).unwrap();
    let b = p.alloc_device(2 << 20).unwrap();
    p.copy_async((&host).into(), 0, (&a).into(), 0, 1 << 20, &s)
        .unwrap();
    p.synchronize_stream(&s).unwrap(); // the copy no longer holds `a`
    p.resize_device(&a, 0).unwrap();
    drop(b); // seen at the next call
    p.copy_async((&host).into(), 0, (&host).into(), 1 << 19, 16, &s)
        .unwrap();
    p.synchronize_stream(&s).unwrap();
    let mib: Vec<u64> = rec
        .memory_samples()
        .iter()
        .inspect(|m| assert_eq!((m.rank, m.section.as_str()), (1, "swap")))
        .map(|m| m.device_bytes >> 20)
        .collect();
    assert_eq!(mib, [1, 3, 2, 0], "{:?}", rec.memory_samples());
    let json = chrome_trace(&rec);
    let counters: Vec<&Value> = json["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "C")
        .collect();
    assert_eq!(counters.len(), 4);
    for c in &counters {
        assert_eq!(c["name"], "device memory in use [swap]");
        assert_eq!(c["pid"], 1);
        assert!(c["ts"].as_f64().is_some());
    }
    let values: Vec<f64> = counters
        .iter()
        .map(|c| c["args"]["MiB"].as_f64().unwrap())
        .collect();
    assert_eq!(values, [1.0, 3.0, 2.0, 0.0]);
    // The terminal timeline shows it as a row of levels, highest where 3 MiB were in use.
    let t = timeline(&rec, 1, "swap", 0.0, rec.now_us(), 40);
    let row = t.lines().find(|l| l.starts_with("memory")).expect(&t);
    assert!(row.contains('@'), "{t}");
    set_thread_rank(0);
}

/// Spans take their times from the platform's stream clock: a copy queued behind a host
/// function that waits is listed once its stream ran it, and starts after the wait.
#[test]
fn spans_are_timed_by_the_stream_clock() {
    let (p, rec) = traced(true);
    let s = p.create_stream().unwrap();
    p.name_stream(&s, Role::H2d, "h2d");
    let (dev, host) = (p.alloc_device(4096).unwrap(), p.alloc_pinned(4096).unwrap());
    p.copy_async((&dev).into(), 0, (&host).into(), 0, 4096, &s)
        .unwrap();
    let (go, gate) = std::sync::mpsc::channel::<()>();
    p.launch_host_fn(
        &s,
        Box::new(move || {
            let _ = gate.recv();
        }),
    )
    .unwrap();
    {
        let _g = scope(Some(2), "L2.x");
        p.copy_async((&dev).into(), 0, (&host).into(), 0, 4096, &s)
            .unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    let listed: Vec<String> = rec.spans().into_iter().map(|s| s.name).collect();
    assert_eq!(listed, ["copy h2d"], "the second copy has not run yet");
    let released_us = rec.now_us();
    go.send(()).unwrap();
    p.synchronize_stream(&s).unwrap();
    let mut spans = rec.spans();
    spans.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    assert_eq!(spans.len(), 2);
    assert_eq!((spans[1].name.as_str(), spans[1].layer), ("L2.x", Some(2)));
    assert!(spans[0].end_us <= spans[1].start_us);
    assert!(
        spans[1].start_us >= released_us - 100.0,
        "{spans:?} {released_us}"
    );
    assert!(spans[1].end_us <= rec.now_us());
}

/// Without markers nothing is sampled (the demo's byte counting stays free).
#[test]
fn no_memory_samples_without_markers() {
    let (p, rec) = traced(false);
    let _a = p.alloc_device(4096).unwrap();
    assert!(rec.memory_samples().is_empty());
}
