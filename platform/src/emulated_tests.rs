//! The dispatch layer and the driver backends' own bookkeeping on the Ascend and CUDA emulators
//! (`tests/ascend-emulator`, `tests/cuda-emulator`), where the emulators' fault injection reaches
//! driver calls the conformance suite cannot fail on purpose. The libraries are built on first
//! use (`hprt_emulator_common::library`); a failed build fails the test rather than skipping it.
//!
//! The emulators' state is process-wide: these tests take one lock.

use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::cuda::{CudaBackend, CudaSearch};
use crate::handle::Owner;
use crate::npu::NpuBackend;
use crate::{Backend, Platform};

fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    crate::sync::lock(&SERIAL)
}

fn npu_lib() -> PathBuf {
    hprt_emulator_common::library::ascend_emulator()
}

fn cuda_lib() -> PathBuf {
    hprt_emulator_common::library::cuda_emulator()
}

fn open_npu() -> NpuBackend {
    let lib = npu_lib();
    NpuBackend::open_with(&hprt_sys::SearchEnv {
        acl_lib: Some(lib.clone()),
        hccl_lib: Some(lib),
        ..Default::default()
    })
    .expect("the npu backend opens on the Ascend emulator")
}

fn open_cuda() -> CudaBackend {
    let lib = cuda_lib();
    CudaBackend::open_with(&CudaSearch {
        cuda_lib: Some(lib.clone()),
        nccl_lib: Some(lib.clone()),
        nvrtc_lib: Some(lib),
    })
    .expect("the cuda backend opens on the CUDA emulator")
}

/// Replaces the emulator's fault list (`HP_EMU_FAULTS` syntax; "" clears it).
fn faults(lib: &std::path::Path, spec: &str) {
    let spec = std::ffi::CString::new(spec).expect("no NUL");
    // SAFETY: the emulator's documented test export, in a library the backend already loaded.
    unsafe {
        let l = libloading::Library::new(lib).expect("open the emulator");
        let f: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char) -> i32> =
            l.get(b"hprtEmuSetFaults\0").expect("hprtEmuSetFaults");
        assert_eq!(f(spec.as_ptr()), 0, "fault spec {spec:?}");
    }
}

/// Runs `f` on a thread of its own; panics when it has not returned within `limit` (a hang).
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{what}: no answer within {limit:?} (a deadlock)"),
    }
}

/// ISSUE 32 item 12: a host function queued before a copy takes its pinned block's lock (the
/// host-stage reload decodes into the block there), and the copy's mark on the block cannot be
/// recorded. The dispatch layer drained the stream with the block's lock held: the host
/// function waited for the lock, the drain for the host function, for ever. Every record the
/// copy makes is failed in turn (the backend's own use marks come first).
fn failed_pinned_mark_with_a_host_fn_on_the_block<P: Platform + 'static>(
    p: Arc<P>,
    lib: PathBuf,
    record: &'static str,
    code: i32,
) {
    const N: usize = 4096;
    let s = p.create_stream().unwrap();
    let dev = p.alloc_device(N).unwrap();
    let block = p.alloc_pinned(N).unwrap();
    let mut failed_mark = 0;
    for nth in 1..=4 {
        let (tp, ts, tdev, tblock, tlib) = (
            p.clone(),
            s.clone(),
            dev.clone(),
            block.clone(),
            lib.clone(),
        );
        let failed = within(
            Duration::from_secs(20),
            "copy_async with a failed record",
            move || {
                let decoded = tblock.clone();
                tp.launch_host_fn(
                    &ts,
                    Box::new(move || {
                        // Long enough for the copy below to be queued and its marks tried.
                        std::thread::sleep(Duration::from_millis(300));
                        // SAFETY: stream order: the copy reading the block comes after.
                        unsafe { decoded.write_unsynchronized(0, &[nth as u8; N]) }.unwrap();
                    }),
                )
                .unwrap_or_else(|e| panic!("nth {nth}: {e}"));
                faults(&tlib, &format!("{record}:{nth}:{code}"));
                let r = tp.copy_async((&tdev).into(), 0, (&tblock).into(), 0, N, &ts);
                faults(&tlib, "");
                // The stream may carry the failure of work queued after the failed call.
                let _ = tp.synchronize_stream(&ts);
                r.is_err()
            },
        );
        if failed {
            failed_mark += 1;
        }
        // Everything still works: the block is readable and a copy goes through.
        let mut back = vec![0u8; N];
        p.copy_async((&block).into(), 0, (&dev).into(), 0, N, &s)
            .unwrap();
        p.synchronize_stream(&s).unwrap();
        block.read(0, &mut back).unwrap();
    }
    assert!(failed_mark > 0, "no injected {record} fault surfaced");
    p.free_pinned(&block).unwrap();
    p.free_device(&dev).unwrap();
    p.destroy_stream(&s).unwrap();
}

/// ISSUE 31 item 2: the backends say what they can do; only they know their driver is an
/// emulator (no framework device addresses its memory, ranks are threads of one process).
#[test]
fn the_emulators_report_their_capabilities() {
    let _g = serial();
    let npu = open_npu();
    let c = Platform::capabilities(&npu);
    assert_eq!(c, crate::Capabilities::driver("npu", true, false));
    assert_eq!(c.framework_device, None);
    assert!(c.ranks_are_threads && !c.ranks_share_device && !c.device_memory_is_host);
    assert!(!c.kernel_compiler && !c.host_stream && !c.configurable_devices);
    assert!(!c.checked_stream_handles);
    drop(npu);
    let cuda = open_cuda();
    let c = Platform::capabilities(&cuda);
    // The emulator's NVRTC compiles the device codec's kernels.
    assert_eq!(c, crate::Capabilities::driver("cuda", true, true));
    assert_eq!(c.framework_device, None);
    assert!(c.kernel_compiler && c.ranks_are_threads && !c.device_memory_is_host);
}

#[test]
fn a_failed_pinned_mark_under_a_host_function_does_not_hang_npu() {
    let _g = serial();
    let p = Arc::new(open_npu());
    failed_pinned_mark_with_a_host_fn_on_the_block(p, npu_lib(), "aclrtRecordEvent", 507000);
}

#[test]
fn a_failed_pinned_mark_under_a_host_function_does_not_hang_cuda() {
    let _g = serial();
    let p = Arc::new(open_cuda());
    failed_pinned_mark_with_a_host_fn_on_the_block(p, cuda_lib(), "cuEventRecord", 999);
}

/// ISSUE 32 item 17: a long-lived stream that waits on ever-new streams (never synchronized
/// through hprt) kept one error span per source stream, and every wait searched them all.
fn waits_on_ever_new_streams<B: Backend>(b: &B, sources: impl Fn(&B::Stream) -> usize) {
    let owner = Owner {
        platform: b.instance(),
        backend: b.kind(),
    };
    let long = Platform::create_stream(b).unwrap();
    let obj = long.handle.get::<B::Stream>(owner, "test").unwrap();
    for i in 0..600 {
        let s = Platform::create_stream(b).unwrap();
        let e = Platform::create_event(b, false).unwrap();
        if i % 2 == 0 {
            // Some with a host function before the record: a place that could still fail.
            Platform::launch_host_fn(b, &s, Box::new(|| {})).unwrap();
        }
        Platform::record_event(b, &e, &s).unwrap();
        Platform::stream_wait_event(b, &long, &e).unwrap();
        Platform::destroy_event(b, &e).unwrap();
        Platform::destroy_stream(b, &s).unwrap();
    }
    // Let the last host functions run, then one more wait prunes what they left.
    std::thread::sleep(Duration::from_millis(200));
    let s = Platform::create_stream(b).unwrap();
    let e = Platform::create_event(b, false).unwrap();
    Platform::record_event(b, &e, &s).unwrap();
    Platform::stream_wait_event(b, &long, &e).unwrap();
    let kept = sources(&obj);
    assert!(
        kept <= 2,
        "the stream keeps the spans of {kept} streams it waited on"
    );
    Platform::synchronize_stream(b, &long).unwrap();
    assert_eq!(sources(&obj), 0);
    Platform::destroy_stream(b, &s).unwrap();
    Platform::destroy_stream(b, &long).unwrap();
}

#[test]
fn waiting_on_ever_new_streams_keeps_a_bounded_record_npu() {
    let _g = serial();
    let p = open_npu();
    waits_on_ever_new_streams(&p, |s| s.waited_sources());
}

#[test]
fn waiting_on_ever_new_streams_keeps_a_bounded_record_cuda() {
    let _g = serial();
    let p = open_cuda();
    waits_on_ever_new_streams(&p, |s| s.waited_sources());
}

/// Sets the Ascend emulator's HCCL timeout.
fn hccl_timeout(lib: &std::path::Path, ms: u64) {
    // SAFETY: the emulator's documented test export, in a library the backend already loaded.
    unsafe {
        let l = libloading::Library::new(lib).expect("open the emulator");
        let f: libloading::Symbol<extern "C" fn(u64) -> i32> = l
            .get(b"hprtEmuSetHcclTimeoutMs\0")
            .expect("hprtEmuSetHcclTimeoutMs");
        assert_eq!(f(ms), 0);
    }
}

/// Rank 0 of 2 all-gathers 4 floats per rank on a stream of its own; `rank1` is what rank 1
/// does with its communicator (nothing, or an all-gather of `Some(count)`). Returns the errors
/// of rank 0's compute stream (which waited on the gather) and of the gather's stream.
fn gather_on_two_ranks(p: &NpuBackend, rank1: Option<usize>) -> (crate::Error, crate::Error) {
    let p: &dyn Platform = p;
    let id = p.unique_id().unwrap();
    std::thread::scope(|sc| {
        let peer = sc.spawn(|| {
            let c = p.comm_init(&id, 1, 2).unwrap();
            if let Some(count) = rank1 {
                let s = p.create_stream().unwrap();
                let send = p.alloc_device(4 * count).unwrap();
                let recv = p.alloc_device(8 * count).unwrap();
                p.all_gather(
                    (&send).into(),
                    (&recv).into(),
                    count,
                    crate::DType::F32,
                    &c,
                    &s,
                )
                .unwrap();
                let _ = p.synchronize_stream(&s);
            }
        });
        let c = p.comm_init(&id, 0, 2).unwrap();
        let (gather, compute) = (p.create_stream().unwrap(), p.create_stream().unwrap());
        let send = p.alloc_device(16).unwrap();
        let recv = p.alloc_device(32).unwrap();
        p.all_gather(
            (&send).into(),
            (&recv).into(),
            4,
            crate::DType::F32,
            &c,
            &gather,
        )
        .unwrap();
        let done = p.create_event(false).unwrap();
        p.record_event(&done, &gather).unwrap();
        p.stream_wait_event(&compute, &done).unwrap();
        let on_compute = p.synchronize_stream(&compute).unwrap_err();
        let on_gather = p.synchronize_stream(&gather).unwrap_err();
        peer.join().unwrap();
        (on_compute, on_gather)
    })
}

/// ISSUE 32 item 18: a collective HCCL failed (a peer that never issued it, or ranks that
/// disagree on it) was `aclrtSynchronizeStream returned 507000`: neither the collective nor
/// "timeout". Now the error names it, and says it timed out when it ran for the collective
/// timeout, on its stream and on a stream that waited for it.
#[test]
fn a_failed_npu_collective_is_named_and_a_timeout_says_so() {
    let _g = serial();
    let lib = npu_lib();
    let p = open_npu();
    p.set_collective_timeout(Duration::from_millis(1000));
    hccl_timeout(&lib, 1000);
    let (compute, gather) = gather_on_two_ranks(&p, None);
    for e in [&compute, &gather] {
        assert_eq!(e.kind(), crate::ErrorKind::Timeout, "{e}");
        assert_eq!(e.operation, "all_gather", "{e}");
        assert!(
            e.message
                .contains("all_gather #1 on the HCCL communicator of rank 0 of 2 timed out after"),
            "{e}"
        );
    }
    // Ranks that disagree fail at once: named, not a timeout. Several times: the ranks share
    // the platform's list of watched collectives, and rank 1's synchronize settling rank 0's
    // failure while rank 0 synchronized left rank 0 with the driver's unnamed error (in 2
    // runs of 5 once, in every run of 24 repeats).
    for _ in 0..24 {
        let (compute, gather) = gather_on_two_ranks(&p, Some(3));
        for e in [&compute, &gather] {
            assert_ne!(e.kind(), crate::ErrorKind::Timeout, "{e}");
            assert!(
                e.message
                    .contains("all_gather #1 on the HCCL communicator of rank 0 of 2 failed")
                    && e.message.contains("disagree"),
                "{e}"
            );
        }
    }
    hccl_timeout(&lib, 120_000);
}
