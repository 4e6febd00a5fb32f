//! cpu-backend specifics: jitter, timeouts, small capacities, multiple devices, configuration
//! parsing and platform selection. Every test builds its own `CpuBackend` value, so nothing here
//! depends on (or mutates) the process environment.
//! (Over 800 lines because it is one suite of the backend's own knobs, one test each.)

use std::sync::mpsc;
use std::time::{Duration, Instant};

use hprt_conformance::{run_cases, Outcome};
use hprt_platform::cpu::parse_bytes;
use hprt_platform::{
    select_platform, BackendKind, CpuBackend, CpuConfig, DType, ErrorKind, Platform,
    PlatformRequest, RawStream, ReduceOp,
};

fn cpu(config: CpuConfig) -> CpuBackend {
    CpuBackend::new(config)
}

fn jittered(seed: u64) -> CpuBackend {
    cpu(CpuConfig {
        jitter: Some(seed),
        ..CpuConfig::default()
    })
}

fn kind<T>(r: hprt_platform::Result<T>) -> Option<ErrorKind> {
    r.err().map(|e| e.kind())
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8 | 1
        })
        .collect()
}

/// Uploads a pattern on stream A and downloads the same buffer on stream B, with or without an
/// event wait in between; returns how many of `trials` downloads differed from the pattern.
fn race(p: &dyn Platform, wait: bool, trials: usize) -> usize {
    race_onto(p, &p.create_stream().unwrap(), wait, trials)
}

/// [`race`] with the download queued on `b`.
fn race_onto(p: &dyn Platform, b: &hprt_platform::Stream, wait: bool, trials: usize) -> usize {
    const N: usize = 64 << 10;
    let a = p.create_stream().unwrap();
    let ev = p.create_event(false).unwrap();
    let mut mismatches = 0;
    for t in 0..trials {
        let data = bytes(t as u64 + 1, N);
        let src = p.alloc_pinned(N).unwrap();
        src.write(0, &data).unwrap();
        let out = p.alloc_pinned(N).unwrap();
        let dev = p.alloc_device(N).unwrap();
        p.memset_async(&dev, 0, 0, N, &a).unwrap();
        p.synchronize_stream(&a).unwrap();
        p.copy_async((&dev).into(), 0, (&src).into(), 0, N, &a)
            .unwrap();
        if wait {
            p.record_event(&ev, &a).unwrap();
            p.stream_wait_event(b, &ev).unwrap();
        }
        p.copy_async((&out).into(), 0, (&dev).into(), 0, N, b)
            .unwrap();
        p.synchronize_stream(b).unwrap();
        if out.to_vec().unwrap() != data {
            mismatches += 1;
        }
        p.synchronize_stream(&a).unwrap();
    }
    mismatches
}

#[test]
fn jitter_exposes_a_missing_wait() {
    let p = jittered(11);
    let bad = race(&p, false, 20);
    eprintln!("{bad} of 20 unsynchronized downloads saw stale or partial data");
    assert!(
        bad >= 1,
        "20 downloads on stream B without waiting for stream A's upload all saw the data: \
         jitter does not make missing waits visible"
    );
}

#[test]
fn jitter_with_the_wait_never_mismatches() {
    let p = jittered(12);
    let bad = race(&p, true, 20);
    assert_eq!(
        bad, 0,
        "{bad} of 20 downloads mismatched although B waited on A's event"
    );
}

fn assert_all_passed(what: &str, outcomes: &[Outcome]) {
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.passed)
        .map(|o| format!("{}/{}: {}", o.group, o.name, o.detail))
        .collect();
    assert!(
        failed.is_empty(),
        "{what}: {} case(s) failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

fn full_suite_with_jitter(seed: u64) {
    let p = jittered(seed);
    let start = Instant::now();
    let outcomes = run_cases(&p, None);
    assert_eq!(outcomes.len(), hprt_conformance::cases().len());
    eprintln!(
        "suite with jitter seed {seed}: {} cases in {:?}",
        outcomes.len(),
        start.elapsed()
    );
    assert_all_passed(&format!("jitter seed {seed}"), &outcomes);
}

#[test]
fn suite_passes_with_jitter_seed_1() {
    full_suite_with_jitter(1);
}

#[test]
fn suite_passes_with_jitter_seed_2() {
    full_suite_with_jitter(2);
}

#[test]
fn suite_passes_with_jitter_seed_3() {
    full_suite_with_jitter(3);
}

#[test]
fn suite_passes_on_two_devices() {
    // Cases run on device 0; rank threads spread over both devices.
    let p = cpu(CpuConfig {
        devices: 2,
        ..CpuConfig::default()
    });
    assert_all_passed("2 devices", &run_cases(&p, None));
}

fn short_timeout() -> CpuBackend {
    cpu(CpuConfig {
        collective_timeout: Duration::from_millis(200),
        ..CpuConfig::default()
    })
}

#[test]
fn comm_init_times_out_naming_the_missing_rank() {
    let p = short_timeout();
    let id = p.unique_id().unwrap();
    let start = Instant::now();
    let e = p
        .comm_init(&id, 0, 2)
        .expect_err("comm_init without rank 1 succeeded");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(
        e.message.contains("[1]"),
        "the timeout does not name rank 1: {e}"
    );
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(10),
        "comm_init gave up after {waited:?} with a 200 ms timeout"
    );
}

/// Queues ten all-reduces of 4 f32 on a new stream; returns it and the buffer they use.
fn ten_all_reduces(
    p: &dyn Platform,
    comm: &hprt_platform::Communicator,
) -> (hprt_platform::Stream, hprt_platform::DeviceBuffer) {
    let s = p.create_stream().unwrap();
    let b = p.alloc_device(64).unwrap();
    for _ in 0..10 {
        p.all_reduce(b.at(0), b.at(32), 4, DType::F32, ReduceOp::Sum, comm, &s)
            .unwrap();
    }
    (s, b)
}

#[test]
fn comm_init_with_another_process_id_says_ranks_are_threads() {
    // Ranks of the cpu backend are threads of one process: an id that crossed a process
    // boundary (its bytes name another process) used to wait for peers until the timeout.
    let p = cpu(CpuConfig {
        collective_timeout: Duration::from_secs(60),
        ..CpuConfig::default()
    });
    let mut id = p.unique_id().unwrap();
    let n = id.0.len();
    let other = u64::from(std::process::id()) + 1;
    id.0[n - 8..].copy_from_slice(&other.to_le_bytes());
    let start = Instant::now();
    let e = p
        .comm_init(&id, 0, 2)
        .expect_err("a foreign process's id was accepted");
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.message.contains("threads of one process"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "it waited {:?}",
        start.elapsed()
    );
}

#[test]
fn collective_times_out_when_a_rank_never_issues_it() {
    let p = short_timeout();
    let id = p.unique_id().unwrap();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (p, id) = (&p, &id);
    std::thread::scope(|scope| {
        let peer = scope.spawn(move || {
            let comm = p.comm_init(id, 1, 2).unwrap();
            // Joined, but never issues the all_reduce; stays alive until rank 0 is done.
            let _ = done_rx.recv();
            drop(comm);
        });
        let comm = p.comm_init(id, 0, 2).unwrap();
        let start = Instant::now();
        // Ten queued behind the first cost one timeout, not ten: the first failure aborts the
        // communicator, and the first cause is what every later one reports.
        let (s, b) = ten_all_reduces(p, &comm);
        let e = p
            .synchronize_stream(&s)
            .expect_err("all_reduce without rank 1 succeeded");
        let waited = start.elapsed();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(
            e.message.contains("[1]"),
            "the timeout does not name rank 1: {e}"
        );
        assert!(
            waited < Duration::from_millis(1000),
            "10 queued all-reduces took {waited:?} at a 200 ms timeout"
        );

        // Issued later, a recv fails at once with the first cause.
        let start = Instant::now();
        p.collective(
            &comm,
            hprt_platform::Collective::Recv {
                recv: b.at(0),
                count: 4,
                dtype: DType::F32,
                peer: 1,
            },
            &s,
        )
        .unwrap();
        let e = p
            .synchronize_stream(&s)
            .expect_err("recv without a sender succeeded");
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(e.message.contains("aborted"), "{e}");
        assert!(start.elapsed() < Duration::from_millis(150));
        done_tx.send(()).unwrap();
        peer.join().unwrap();
    });
}

/// A rank whose thread failed (its communicator dropped) costs its peers no timeout at all:
/// collectives and receives waiting for it fail at once; sends between other ranks go on.
#[test]
fn a_dead_peer_fails_collectives_at_once() {
    let p = cpu(CpuConfig {
        collective_timeout: Duration::from_secs(60),
        ..CpuConfig::default()
    });
    let id = p.unique_id().unwrap();
    let (p, id) = (&p, &id);
    std::thread::scope(|scope| {
        let peer = scope.spawn(move || {
            let _comm = p.comm_init(id, 1, 2).unwrap();
            // Fails (returns) before issuing anything.
        });
        let comm = p.comm_init(id, 0, 2).unwrap();
        peer.join().unwrap();
        let start = Instant::now();
        let (s, b) = ten_all_reduces(p, &comm);
        let e = p.synchronize_stream(&s).expect_err("all_reduce succeeded");
        assert!(e.message.contains("rank 1"), "{e}");
        let recv = hprt_platform::Collective::Recv {
            recv: b.at(0),
            count: 4,
            dtype: DType::F32,
            peer: 1,
        };
        p.collective(&comm, recv, &s).unwrap();
        p.synchronize_stream(&s).expect_err("recv from a dead peer");
        let waited = start.elapsed();
        assert!(
            waited < Duration::from_secs(5),
            "a dead peer cost {waited:?} at a 60 s timeout"
        );
    });
}

/// Sizes are checked before anything is sized from them: a device count or a world past what a
/// cpu platform models is a typed error, not an abort allocating per-device or per-rank state.
#[test]
fn huge_device_counts_and_worlds_are_typed_errors() {
    let e = CpuBackend::try_new(CpuConfig {
        devices: 1 << 40,
        ..CpuConfig::default()
    })
    .err()
    .expect("2^40 devices accepted");
    assert_eq!(e.kind(), ErrorKind::InvalidValue, "{e}");
    let p = cpu(CpuConfig::default());
    let id = p.unique_id().unwrap();
    for world in [1usize << 40, usize::MAX] {
        let e = p
            .comm_init(&id, 0, world)
            .expect_err("a huge world accepted");
        assert_eq!(e.kind(), ErrorKind::InvalidValue, "{world}: {e}");
    }
    // Reading more than the buffer holds is refused before any staging is allocated.
    let b = p.alloc_device(64).unwrap();
    let s = p.create_stream().unwrap();
    let e = b.check_range("read", 0, 1 << 45).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    let mut small = [0u8; 65];
    let e = p.read_device_sync(&b, 0, &mut small, &s).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    assert_eq!(
        p.memory_stats().pinned_allocations,
        0,
        "staging allocated first"
    );
}

#[test]
fn small_device_capacity() {
    const CAP: usize = 1 << 20;
    const A: usize = 600 << 10;
    let p = cpu(CpuConfig {
        device_memory: CAP,
        ..CpuConfig::default()
    });
    let info = p.mem_info().unwrap();
    assert_eq!((info.free, info.total), (CAP, CAP));
    let a = p.alloc_device(A).unwrap();
    let e = p
        .alloc_device(A)
        .expect_err("second 600 KiB allocation in 1 MiB succeeded");
    assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}");
    let s = p.memory_stats();
    assert_eq!(
        (s.device_current, s.device_allocations, s.device_peak),
        (A, 1, A)
    );
    assert_eq!(p.mem_info().unwrap().free, CAP - A);
    p.free_device(&a).unwrap();
    let b = p
        .alloc_device(A)
        .expect("allocation after freeing the first");
    let c = p.alloc_device(300 << 10).unwrap();
    let s = p.memory_stats();
    assert_eq!(s.device_current, A + (300 << 10));
    assert_eq!(s.device_peak, A + (300 << 10));
    // Resize within capacity works; beyond it fails and keeps the buffer.
    assert_eq!(kind(p.resize_device(&b, CAP)), Some(ErrorKind::OutOfMemory));
    assert_eq!(b.len(), A);
    p.resize_device(&b, 0).unwrap();
    p.resize_device(&c, 700 << 10).unwrap();
    assert_eq!(p.memory_stats().device_current, 700 << 10);
    drop((b, c));
    let s = p.memory_stats();
    assert_eq!((s.device_current, s.device_allocations), (0, 0));
    // Resize allocates the new storage before releasing the old: 300 KiB + 700 KiB at once.
    assert_eq!(s.device_peak, 1000 << 10);
    p.reset_peak_memory();
    assert_eq!(p.memory_stats().device_peak, 0);
}

#[test]
fn small_pinned_capacity() {
    const CAP: usize = 1 << 20;
    const A: usize = 600 << 10;
    let p = cpu(CpuConfig {
        pinned_memory: Some(CAP),
        ..CpuConfig::default()
    });
    let a = p.alloc_pinned(A).unwrap();
    let e = p
        .alloc_pinned(A)
        .expect_err("second 600 KiB pinned allocation in 1 MiB succeeded");
    assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}");
    let s = p.memory_stats();
    assert_eq!(
        (s.pinned_current, s.pinned_allocations, s.pinned_peak),
        (A, 1, A)
    );
    p.free_pinned(&a).unwrap();
    let _b = p
        .alloc_pinned(A)
        .expect("pinned allocation after freeing the first");
    assert_eq!(p.memory_stats().pinned_peak, A);
    // The staging buffer of write_device_sync counts too.
    let s = p.create_stream().unwrap();
    let d = p.alloc_device(A).unwrap();
    let e = p
        .write_device_sync(&d, 0, &vec![1u8; A], &s)
        .expect_err("staging beyond the pinned limit");
    assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}");
}

#[test]
fn handles_do_not_cross_platform_values() {
    let a = cpu(CpuConfig::default());
    let b = cpu(CpuConfig::default());
    let sa = a.create_stream().unwrap();
    let sb = b.create_stream().unwrap();
    let da = a.alloc_device(64).unwrap();
    let db = b.alloc_device(64).unwrap();
    let ha = a.alloc_pinned(64).unwrap();
    let ea = a.create_event(true).unwrap();
    let ia = a.unique_id().unwrap();
    let ca = a.comm_init(&ia, 0, 1).unwrap();
    let ih = ErrorKind::InvalidHandle;
    assert_eq!(kind(b.synchronize_stream(&sa)), Some(ih));
    assert_eq!(kind(b.query_stream(&sa)), Some(ih));
    assert_eq!(kind(b.destroy_stream(&sa)), Some(ih));
    assert_eq!(
        kind(b.copy_async((&db).into(), 0, (&ha).into(), 0, 64, &sb)),
        Some(ih)
    );
    assert_eq!(
        kind(b.copy_async((&db).into(), 0, (&da).into(), 0, 64, &sb)),
        Some(ih)
    );
    assert_eq!(kind(b.memset_async(&da, 0, 0, 64, &sb)), Some(ih));
    assert_eq!(kind(b.free_device(&da)), Some(ih));
    assert_eq!(kind(b.free_pinned(&ha)), Some(ih));
    assert_eq!(kind(b.resize_device(&da, 0)), Some(ih));
    assert_eq!(kind(b.record_event(&ea, &sb)), Some(ih));
    assert_eq!(kind(b.query_event(&ea)), Some(ih));
    assert_eq!(kind(b.destroy_event(&ea)), Some(ih));
    assert_eq!(kind(b.barrier(&ca, &sb)), Some(ih));
    assert_eq!(kind(b.destroy_comm(&ca)), Some(ih));
    assert_eq!(
        kind(b.comm_init(&ia, 0, 1)),
        Some(ErrorKind::InvalidValue),
        "a unique id of another platform value was accepted"
    );
    // Nothing was harmed on the owner.
    a.copy_async((&da).into(), 0, (&ha).into(), 0, 64, &sa)
        .unwrap();
    a.barrier(&ca, &sa).unwrap();
    a.synchronize_stream(&sa).unwrap();
    assert!(sa.is_live() && !da.is_freed() && ea.is_live() && ca.is_live());
}

#[test]
fn wrapping_an_unknown_raw_stream_is_refused() {
    let p = cpu(CpuConfig::default());
    // SAFETY: the cpu backend looks raw handles up in its own table and never dereferences them.
    let r = unsafe { p.wrap_external_stream(RawStream(987_654)) };
    assert_eq!(kind(r), Some(ErrorKind::InvalidHandle));
    let s = p.create_stream().unwrap();
    let raw = s.raw();
    p.destroy_stream(&s).unwrap();
    // SAFETY: as above.
    let r = unsafe { p.wrap_external_stream(raw) };
    assert_eq!(
        kind(r),
        Some(ErrorKind::InvalidHandle),
        "wrapped a destroyed stream"
    );
}

fn host_stream(p: &CpuBackend) -> hprt_platform::Stream {
    // SAFETY: raw stream 0 is the cpu backend's host stream, alive as long as the platform.
    unsafe { p.wrap_external_stream(RawStream(hprt_platform::CPU_HOST_STREAM)) }.unwrap()
}

#[test]
fn the_host_stream_waits_for_events_in_the_calling_thread() {
    let p = jittered(5);
    let host = host_stream(&p);
    // Its copies run as they are queued: without the event wait they read before the jittered
    // upload, with it the caller blocks until the upload is done.
    assert!(
        race_onto(&p, &host, false, 40) > 0,
        "the jitter never exposed the missing wait"
    );
    assert_eq!(race_onto(&p, &host, true, 40), 0);
    // A mark recorded on it is reached at once, so a worker stream waiting for it never blocks.
    let ev = p.create_event(false).unwrap();
    p.record_event(&ev, &host).unwrap();
    assert!(p.query_event(&ev).unwrap());
    assert!(p.query_stream(&host).unwrap());
    // It is nobody's to destroy: destroying a wrapper leaves it usable.
    p.destroy_stream(&host).unwrap();
    let again = host_stream(&p);
    p.record_event(&ev, &again).unwrap();
    p.synchronize_stream(&again).unwrap();
    p.synchronize_device().unwrap();
}

#[test]
fn the_host_stream_reports_an_error_it_waited_for() {
    let p = cpu(CpuConfig::default());
    let host = host_stream(&p);
    let worker = p.create_stream().unwrap();
    let ev = p.create_event(false).unwrap();
    p.launch_host_fn(&worker, Box::new(|| panic!("a failing job")))
        .unwrap();
    p.record_event(&ev, &worker).unwrap();
    p.stream_wait_event(&host, &ev).unwrap();
    // Reported (once) by the host stream's synchronize, as a worker stream's would be.
    assert_eq!(kind(p.synchronize_stream(&host)), Some(ErrorKind::Internal));
    p.synchronize_stream(&host).unwrap();
    let _ = p.synchronize_stream(&worker);
}

#[test]
fn set_device_out_of_range() {
    let p = cpu(CpuConfig::default());
    assert_eq!(p.device_count(), 1);
    assert_eq!(kind(p.set_device(1)), Some(ErrorKind::InvalidValue));
    assert_eq!(
        kind(p.set_device(usize::MAX)),
        Some(ErrorKind::InvalidValue)
    );
    p.set_device(0).unwrap();
    assert_eq!(p.current_device(), 0);
}

#[test]
fn devices_keep_separate_accounting() {
    const CAP: usize = 1 << 20;
    let p = cpu(CpuConfig {
        devices: 2,
        device_memory: CAP,
        ..CpuConfig::default()
    });
    assert_eq!(p.device_count(), 2);
    assert_eq!(p.info().devices.len(), 2);
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let p = &p;
    std::thread::scope(|scope| {
        let on_one = scope.spawn(move || {
            p.set_device(1).unwrap();
            assert_eq!(p.current_device(), 1);
            let d = p.alloc_device(700 << 10).unwrap();
            let s = p.memory_stats();
            assert_eq!((s.device_current, s.device_allocations), (700 << 10, 1));
            assert_eq!(p.mem_info().unwrap().free, CAP - (700 << 10));
            // Device 1 is nearly full; device 0 is not affected (checked by the main thread).
            assert_eq!(
                kind(p.alloc_device(400 << 10)),
                Some(ErrorKind::OutOfMemory)
            );
            ready_tx.send(()).unwrap();
            done_rx.recv().unwrap();
            drop(d);
            assert_eq!(p.memory_stats().device_current, 0);
        });
        ready_rx.recv().unwrap();
        // This thread never chose a device: it is on device 0.
        assert_eq!(p.current_device(), 0);
        let s = p.memory_stats();
        assert_eq!((s.device_current, s.device_allocations), (0, 0));
        let d0 = p
            .alloc_device(900 << 10)
            .expect("device 0 has its own capacity");
        assert_eq!(p.memory_stats().device_current, 900 << 10);
        drop(d0);
        done_tx.send(()).unwrap();
        on_one.join().unwrap();
    });
    // Devices are per thread: a new thread starts on device 0.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                assert_eq!(p.current_device(), 0);
                p.set_device(1).unwrap();
                assert_eq!(p.current_device(), 1);
            })
            .join()
            .unwrap();
    });
    assert_eq!(p.current_device(), 0);
}

#[test]
fn parse_bytes_accepts_documented_forms() {
    assert_eq!(parse_bytes("8G"), Some(8 << 30));
    assert_eq!(parse_bytes("1024"), Some(1024));
    assert_eq!(parse_bytes("12MiB"), Some(12 << 20));
    assert_eq!(parse_bytes("4k"), Some(4 << 10));
    assert_eq!(parse_bytes("2KB"), Some(2 << 10));
    assert_eq!(parse_bytes("1T"), Some(1 << 40));
    assert_eq!(parse_bytes(" 16 M "), Some(16 << 20));
    assert_eq!(parse_bytes("0"), Some(0));
    assert_eq!(parse_bytes("7b"), Some(7));
}

#[test]
fn parse_bytes_rejects_garbage() {
    for s in [
        "",
        "G",
        "abc",
        "12X",
        "-1",
        "1.5G",
        "8 G B",
        "0x10",
        "99999999999999999999999",
    ] {
        assert_eq!(parse_bytes(s), None, "parse_bytes({s:?}) accepted garbage");
    }
    assert_eq!(
        parse_bytes("18446744073709551615T"),
        None,
        "overflow must be None"
    );
}

#[test]
fn config_from_env_reads_this_environment() {
    // Read-only: the variables are whatever this test process was started with.
    let c = CpuConfig::from_env().expect("the HP_CPU_* variables of this run are valid");
    assert!(c.devices >= 1);
    match std::env::var("HP_CPU_JITTER") {
        Ok(v) if !v.trim().is_empty() => assert_eq!(c.jitter, v.trim().parse().ok()),
        _ => assert_eq!(c.jitter, None),
    }
    let d = CpuConfig::default();
    assert_eq!((d.devices, d.jitter, d.pinned_memory), (1, None, None));
    assert!(d.device_memory > 0);
}

#[test]
fn platform_request_parsing_and_selection() {
    // Which accelerator backends load depends on the machine (none in CI, cuda on a GPU box):
    // a forced one is that backend or a typed Unavailable error, and auto picks the first that
    // loads, in the order cuda, npu, cpu.
    let mut first_available = None;
    for (value, backend) in [("cuda", BackendKind::Cuda), ("npu", BackendKind::Npu)] {
        let req = PlatformRequest::parse(Some(value)).unwrap();
        assert_eq!(req, PlatformRequest::Forced(backend));
        match select_platform(req) {
            Ok(s) => {
                assert_eq!(s.platform.backend(), backend);
                first_available.get_or_insert(backend);
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                assert!(!e.message.is_empty());
            }
        }
    }
    let e = PlatformRequest::parse(Some("bogus")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidValue);
    for name in ["cpu", "cuda", "npu"] {
        assert!(
            e.message.contains(name),
            "the error does not list {name}: {e}"
        );
    }
    for value in [None, Some("auto"), Some(""), Some(" AUTO ")] {
        assert_eq!(
            PlatformRequest::parse(value).unwrap(),
            PlatformRequest::Auto,
            "{value:?}"
        );
    }
    assert_eq!(
        PlatformRequest::parse(Some("CPU")).unwrap(),
        PlatformRequest::Forced(BackendKind::Cpu)
    );
    // A name a program passes (C ABI, Python) is exact: no guessing at "" or "CPU ".
    for name in ["", "CPU ", "CPU", " cpu", "Auto", "bogus"] {
        let e = PlatformRequest::parse_name(name).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidValue, "{name:?}");
    }
    for (name, want) in [
        ("auto", PlatformRequest::Auto),
        ("cpu", PlatformRequest::Forced(BackendKind::Cpu)),
        ("npu", PlatformRequest::Forced(BackendKind::Npu)),
    ] {
        assert_eq!(PlatformRequest::parse_name(name).unwrap(), want);
    }
    let auto = select_platform(PlatformRequest::Auto).unwrap_or_else(|e| panic!("auto: {e}"));
    assert_eq!(
        auto.platform.backend(),
        first_available.unwrap_or(BackendKind::Cpu)
    );
    assert!(!auto.reason.is_empty());
    let forced = select_platform(PlatformRequest::Forced(BackendKind::Cpu))
        .unwrap_or_else(|e| panic!("cpu: {e}"));
    assert_eq!(forced.platform.backend(), BackendKind::Cpu);
}

/// Element counts whose byte size overflows `usize` must be refused at issue. Today the byte
/// extents in `Collective::places` (platform/src/collective.rs) are computed with unchecked
/// `count * size` / `world * count * size` / `count + displ`: a debug build panics, a release
/// build wraps to a small extent that passes the bounds check and the backend then touches
/// `count` elements out of bounds.
#[test]
fn overflowing_collective_counts_are_refused() {
    if !cfg!(debug_assertions) {
        eprintln!(
            "skipped in release builds: there the overflow corrupts memory instead of panicking"
        );
        return;
    }
    let backend = cpu(CpuConfig::default());
    let p: &dyn Platform = &backend;
    let id = p.unique_id().unwrap();
    let comm = p.comm_init(&id, 0, 1).unwrap();
    let s = p.create_stream().unwrap();
    let b = p.alloc_device(256).unwrap();
    let huge = (1usize << 62) + 1; // * 4 bytes wraps to 4
    type Attempt<'a> = Box<dyn Fn() -> hprt_platform::Result<()> + 'a>;
    let attempts: Vec<(&str, Attempt<'_>)> = vec![
        (
            "all_reduce",
            Box::new(|| {
                p.all_reduce(
                    b.at(0),
                    b.at(128),
                    huge,
                    DType::F32,
                    ReduceOp::Sum,
                    &comm,
                    &s,
                )
            }),
        ),
        (
            "all_gather",
            Box::new(|| p.all_gather(b.at(0), b.at(128), huge, DType::F32, &comm, &s)),
        ),
        (
            "broadcast",
            Box::new(|| p.broadcast(b.at(0), huge, DType::F32, 0, &comm, &s)),
        ),
        (
            "all_to_all_v",
            Box::new(|| {
                p.collective(
                    &comm,
                    hprt_platform::Collective::AllToAllV {
                        send: b.at(0),
                        recv: b.at(128),
                        send_counts: vec![1],
                        send_displs: vec![usize::MAX],
                        recv_counts: vec![1],
                        recv_displs: vec![0],
                        dtype: DType::U8,
                    },
                    &s,
                )
            }),
        ),
    ];
    let mut problems = Vec::new();
    for (what, f) in &attempts {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Err(_) => problems.push(format!("{what}: panicked")),
            Ok(Ok(())) => problems.push(format!("{what}: accepted")),
            Ok(Err(e)) if matches!(e.kind(), ErrorKind::OutOfRange | ErrorKind::InvalidValue) => {}
            Ok(Err(e)) => problems.push(format!("{what}: {e}")),
        }
    }
    assert!(
        problems.is_empty(),
        "overflowing counts: {}",
        problems.join("; ")
    );
}

/// A pinned request within 256 bytes of `usize::MAX` (no pinned limit configured): today
/// `CpuMem::alloc` (platform/src/cpu/memory.rs:47) computes `len + ALIGN` unchecked after
/// reserving `len` in the counter. Debug builds panic and never release the reservation, so every
/// later `alloc_pinned` on that platform value fails with OutOfMemory; release builds wrap to a
/// 155-byte allocation handed out as a buffer of `usize::MAX - 100` bytes.
#[test]
fn pinned_request_near_usize_max_is_out_of_memory() {
    let backend = cpu(CpuConfig::default());
    let p: &dyn Platform = &backend;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        p.alloc_pinned(usize::MAX - 100).map(|b| b.len())
    }));
    let after = p.memory_stats();
    let small = p.alloc_pinned(4096).map(|b| b.len());
    match r {
        Err(_) => panic!(
            "alloc_pinned(usize::MAX - 100) panicked; pinned_current is now {}, and a 4 KiB \
             alloc_pinned afterwards gives {small:?}",
            after.pinned_current
        ),
        Ok(Ok(len)) => panic!("alloc_pinned(usize::MAX - 100) returned a buffer of {len} bytes"),
        Ok(Err(e)) => assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}"),
    }
    assert_eq!(
        after.pinned_current, 0,
        "the failed request left bytes reserved"
    );
    assert_eq!(small.map_err(|e| e.to_string()), Ok(4096));
}

#[test]
fn freed_device_blocks_are_reused_without_counting_as_allocated() {
    let p = cpu(CpuConfig {
        device_memory: 8 << 20,
        alloc_cache: 4 << 20,
        ..CpuConfig::default()
    });
    let a = p.alloc_device(3 << 20).unwrap();
    let addr = a.device_ptr();
    p.free_device(&a).unwrap();
    assert_eq!(
        p.memory_stats().device_current,
        0,
        "cached bytes are not allocated"
    );
    // The same size comes back from the cache (LIFO), and the capacity still holds in full.
    let b = p.alloc_device(3 << 20).unwrap();
    assert_eq!(b.device_ptr(), addr, "the freed block was not reused");
    let c = p.alloc_device(5 << 20).unwrap();
    assert_eq!(p.memory_stats().device_current, 8 << 20);
    assert_eq!(kind(p.alloc_device(1)), Some(ErrorKind::OutOfMemory));
    // resize-to-zero and back (activation swap's pattern) goes through the cache too.
    p.resize_device(&b, 0).unwrap();
    p.resize_device(&b, 3 << 20).unwrap();
    assert_eq!(b.device_ptr(), addr);
    drop((b, c));
}

#[test]
fn the_allocation_cache_can_be_turned_off_and_is_bounded() {
    for cap in [0, 1 << 20] {
        let p = cpu(CpuConfig {
            alloc_cache: cap,
            ..CpuConfig::default()
        });
        // Blocks over the cap are freed, so a later allocation of that size is fresh memory:
        // fresh cpu memory is zero-filled, a reused block would still hold 0xAB.
        let s = p.create_stream().unwrap();
        let a = p.alloc_device(2 << 20).unwrap();
        p.memset_async(&a, 0, 0xAB, a.len(), &s).unwrap();
        p.synchronize_stream(&s).unwrap();
        p.free_device(&a).unwrap();
        let b = p.alloc_device(2 << 20).unwrap();
        let mut out = vec![1u8; 64];
        p.read_device_sync(&b, (1 << 20) + 4096, &mut out, &s)
            .unwrap();
        assert_eq!(
            out,
            vec![0u8; 64],
            "cap {cap}: a block over the cap was cached"
        );
    }
}

#[test]
fn under_jitter_a_reused_block_is_poisoned_not_stale() {
    let p = cpu(CpuConfig {
        jitter: Some(4),
        ..CpuConfig::default()
    });
    let s = p.create_stream().unwrap();
    let a = p.alloc_device(1 << 20).unwrap();
    p.write_device_sync(&a, 0, &[0x11; 64], &s).unwrap();
    let addr = a.device_ptr();
    p.free_device(&a).unwrap();
    let b = p.alloc_device(1 << 20).unwrap();
    assert_eq!(b.device_ptr(), addr, "the block was not reused");
    let mut out = [0u8; 64];
    p.read_device_sync(&b, 0, &mut out, &s).unwrap();
    assert_eq!(out, [0xDB; 64], "a reused block kept its old owner's bytes");
}
