//! The cuda backend against the CUDA emulator (`tests/cuda-emulator`, built by
//! `cargo build -p hprt-cuda-emulator`, which `scripts/test` runs first): loading, fault
//! injection on every call class (a typed error naming the CUDA / NCCL / NVRTC status, nothing
//! leaked, the next call works), leaks, and the contracts the backend must keep.
//!
//! The emulator's state is process-global, so these tests take one lock.
//! (Over 800 lines for that reason: one lock, one file.)

use std::sync::{Mutex, MutexGuard};

use hprt_conformance::cuda_emulator::{library_path, open};
use hprt_conformance::emulator::{check_fault_cases, Control, FaultCase};
use hprt_platform::{BackendKind, Collective, DType, ErrorKind, Kernel, Platform, ReduceOp};

#[repr(C)]
#[derive(Default, Debug, Clone, Copy, PartialEq)]
struct Stats {
    live_contexts: u64,
    live_device_allocations: u64,
    live_device_bytes: u64,
    live_pinned_allocations: u64,
    live_streams: u64,
    live_events: u64,
    live_modules: u64,
    live_comms: u64,
    frees_under_queued_work: u64,
    reclaimed_at_context_destroy: u64,
}

/// The emulator's test-only exports, with its statistics.
struct Emu(Control);

impl Emu {
    fn open() -> Emu {
        Emu(Control::open(&library_path()))
    }
    fn stats(&self) -> Stats {
        self.0.stats()
    }
    fn faults(&self, spec: &str) {
        self.0.faults(spec)
    }
}

/// Every test takes this first: it also gives the emulator two devices (NCCL wants one per
/// rank) before anything loads it, and turns the backend's device allocation cache off: these
/// tests count the driver's live allocations and inject faults into `cuMemAlloc`, which a
/// cached block would bypass (the cache has its own test, `cuda_alloc_cache.rs`).
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    static DEVICES: std::sync::Once = std::sync::Once::new();
    DEVICES.call_once(|| {
        std::env::set_var("HP_EMU_DEVICES", "2");
        std::env::set_var("HP_CUDA_ALLOC_CACHE", "0");
    });
    hprt_platform::sync::lock(&SERIAL)
}

fn live(s: &Stats) -> [u64; 7] {
    [
        s.live_contexts,
        s.live_device_allocations,
        s.live_pinned_allocations,
        s.live_streams,
        s.live_events,
        s.live_modules,
        s.live_comms,
    ]
}

fn fill(
    p: &dyn Platform,
    d: &hprt_platform::DeviceBuffer,
    s: &hprt_platform::Stream,
) -> hprt_platform::Result<()> {
    p.launch_kernel(
        Kernel::Fill {
            dst: d.at(0),
            dtype: DType::F32,
            count: d.len() / 4,
            value: 1.5,
        },
        s,
    )
}

#[test]
fn loads_the_driver_nccl_and_nvrtc_from_the_override_paths() {
    let _g = serial();
    let p = open().expect("the cuda backend opens on the emulator");
    let info = Platform::info(&p);
    assert_eq!(info.backend, BackendKind::Cuda);
    assert!(
        info.driver.contains("libhprt_cuda_emulator.so"),
        "{}",
        info.driver
    );
    assert!(info.devices[0].name.contains("sm_80"), "{:?}", info.devices);
    for (key, want) in [("nccl", "NCCL 2.21.5"), ("nvrtc", "NVRTC 12.8")] {
        let (_, v) = info.settings.iter().find(|(k, _)| k == key).unwrap();
        assert!(v.contains(want), "{key}: {v}");
    }
    assert!(
        info.libraries
            .iter()
            .any(|l| l.found && l.path.contains("HP_NVRTC_LIB")),
        "{:?}",
        info.libraries
    );
}

#[test]
fn injected_driver_faults_become_typed_named_errors_without_leaks() {
    let _g = serial();
    let emu = Emu::open();
    let p = open().unwrap();
    let s = p.create_stream().unwrap();
    // Compile the kernel module first: it stays loaded (cached), which is not a leak.
    let d = p.alloc_device(64).unwrap();
    fill(&p, &d, &s).unwrap();
    drop(d);
    p.synchronize_stream(&s).unwrap();
    let cases: &[FaultCase] = &[
        (
            "cuMemAlloc_v2:1:2",
            ErrorKind::OutOfMemory,
            "CUDA_ERROR_OUT_OF_MEMORY",
            |p, _| p.alloc_device(64).map(drop),
        ),
        (
            "cuMemHostAlloc:1:2",
            ErrorKind::OutOfMemory,
            "CUDA_ERROR_OUT_OF_MEMORY",
            |p, _| p.alloc_pinned(64).map(drop),
        ),
        (
            "cuStreamCreate:1:999",
            ErrorKind::Internal,
            "CUDA_ERROR_UNKNOWN",
            |p, _| p.create_stream().map(drop),
        ),
        (
            "cuEventCreate:1:1",
            ErrorKind::InvalidValue,
            "CUDA_ERROR_INVALID_VALUE",
            |p, _| p.create_event(true).map(drop),
        ),
        (
            "cuEventRecord:1:400",
            ErrorKind::InvalidHandle,
            "CUDA_ERROR_INVALID_HANDLE",
            |p, s| {
                let e = p.create_event(false)?;
                p.record_event(&e, s)
            },
        ),
        (
            "cuStreamWaitEvent:1:400",
            ErrorKind::InvalidHandle,
            "CUDA_ERROR_INVALID_HANDLE",
            |p, s| {
                let e = p.create_event(false)?;
                p.record_event(&e, s)?;
                p.stream_wait_event(s, &e)
            },
        ),
        (
            "cuEventQuery:1:999",
            ErrorKind::Internal,
            "CUDA_ERROR_UNKNOWN",
            |p, s| {
                let e = p.create_event(false)?;
                p.record_event(&e, s)?;
                p.query_event(&e).map(drop)
            },
        ),
        (
            "cuEventSynchronize:1:999",
            ErrorKind::Internal,
            "CUDA_ERROR_UNKNOWN",
            |p, s| {
                let e = p.create_event(false)?;
                p.record_event(&e, s)?;
                p.synchronize_event(&e)
            },
        ),
        (
            "cuEventElapsedTime:1:999",
            ErrorKind::Internal,
            "CUDA_ERROR_UNKNOWN",
            |p, s| {
                let (a, b) = (p.create_event(true)?, p.create_event(true)?);
                p.record_event(&a, s)?;
                p.record_event(&b, s)?;
                p.synchronize_event(&b)?;
                p.event_elapsed_ms(&a, &b).map(drop)
            },
        ),
        (
            "cuMemcpyAsync:1:700",
            ErrorKind::Internal,
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            |p, s| {
                let d = p.alloc_device(64)?;
                let h = p.alloc_pinned(64)?;
                p.copy_async((&d).into(), 0, (&h).into(), 0, 64, s)
            },
        ),
        (
            "cuMemsetD8Async:1:1",
            ErrorKind::InvalidValue,
            "CUDA_ERROR_INVALID_VALUE",
            |p, s| {
                let d = p.alloc_device(64)?;
                p.memset_async(&d, 0, 1, 64, s)
            },
        ),
        (
            "cuStreamSynchronize:1:719",
            ErrorKind::Internal,
            "CUDA_ERROR_LAUNCH_FAILED",
            |p, s| p.synchronize_stream(s),
        ),
        (
            "cuStreamQuery:1:999",
            ErrorKind::Internal,
            "CUDA_ERROR_UNKNOWN",
            |p, s| p.query_stream(s).map(drop),
        ),
        (
            "cuMemGetInfo_v2:1:999",
            ErrorKind::Internal,
            "CUDA_ERROR_UNKNOWN",
            |p, _| p.mem_info().map(drop),
        ),
        (
            "cuLaunchKernel:1:701",
            ErrorKind::Internal,
            "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            |p, s| {
                let d = p.alloc_device(64)?;
                fill(p, &d, s)
            },
        ),
        (
            "cuCtxGetCurrent:1:201",
            ErrorKind::InvalidValue,
            "CUDA_ERROR_INVALID_CONTEXT",
            |p, _| p.create_stream().map(drop),
        ),
        (
            "cuLaunchHostFunc:1:1",
            ErrorKind::InvalidValue,
            "CUDA_ERROR_INVALID_VALUE",
            |p, s| p.launch_host_fn(s, Box::new(|| {})),
        ),
    ];
    check_fault_cases(&emu.0, |c| live(&c.stats()), &p, &s, cases);
    assert_eq!(emu.stats().frees_under_queued_work, 0);
}

#[test]
fn injected_nccl_faults_become_typed_named_errors_without_leaks() {
    let _g = serial();
    let emu = Emu::open();
    let p = open().unwrap();
    let s = p.create_stream().unwrap();
    let cases: &[FaultCase] = &[
        (
            "ncclGetUniqueId:1:2",
            ErrorKind::Internal,
            "ncclSystemError",
            |p, _| p.unique_id().map(drop),
        ),
        (
            "ncclCommInitRank:1:5",
            ErrorKind::InvalidValue,
            "ncclInvalidUsage",
            |p, _| {
                let id = p.unique_id()?;
                p.comm_init(&id, 0, 1).map(drop)
            },
        ),
        (
            "ncclAllReduce:1:1",
            ErrorKind::Internal,
            "ncclUnhandledCudaError",
            |p, s| {
                let id = p.unique_id()?;
                let c = p.comm_init(&id, 0, 1)?;
                let d = p.alloc_device(64)?;
                p.all_reduce(
                    (&d).into(),
                    (&d).into(),
                    16,
                    DType::F32,
                    ReduceOp::Avg,
                    &c,
                    s,
                )
            },
        ),
        (
            "ncclAllGather:1:4",
            ErrorKind::InvalidValue,
            "ncclInvalidArgument",
            |p, s| {
                let id = p.unique_id()?;
                let c = p.comm_init(&id, 0, 1)?;
                let d = p.alloc_device(64)?;
                p.all_gather((&d).into(), (&d).into(), 16, DType::F32, &c, s)
            },
        ),
        (
            "ncclReduceScatter:1:3",
            ErrorKind::Internal,
            "ncclInternalError",
            |p, s| {
                let id = p.unique_id()?;
                let c = p.comm_init(&id, 0, 1)?;
                let d = p.alloc_device(64)?;
                p.reduce_scatter(
                    (&d).into(),
                    (&d).into(),
                    16,
                    DType::F32,
                    ReduceOp::Sum,
                    &c,
                    s,
                )
            },
        ),
        (
            "ncclBroadcast:1:6",
            ErrorKind::Internal,
            "ncclRemoteError",
            |p, s| {
                let id = p.unique_id()?;
                let c = p.comm_init(&id, 0, 1)?;
                let d = p.alloc_device(64)?;
                p.broadcast((&d).into(), 16, DType::F32, 0, &c, s)
            },
        ),
        (
            "ncclGroupStart:1:5",
            ErrorKind::InvalidValue,
            "ncclInvalidUsage",
            |p, _| {
                p.group_start()?;
                p.group_end()
            },
        ),
        (
            "ncclGroupEnd:1:8",
            ErrorKind::Timeout,
            "ncclTimeout",
            |p, _| {
                p.group_start()?;
                p.group_end()
            },
        ),
    ];
    check_fault_cases(&emu.0, |c| live(&c.stats()), &p, &s, cases);
    assert_eq!(emu.stats().frees_under_queued_work, 0);
}

/// A module that failed to load once (a transient driver failure) is compiled and loaded again
/// by the next kernel launch; the backend used to keep the failure for the platform's life.
#[test]
fn a_failed_module_load_is_retried_by_the_next_launch() {
    let _g = serial();
    let emu = Emu::open();
    for (spec, name) in [
        ("cuModuleLoadData:1:2", Some("CUDA_ERROR_OUT_OF_MEMORY")),
        // The cubin attempt, then the PTX one.
        (
            "nvrtcCompileProgram:1:11,nvrtcCompileProgram:2:11",
            Some("NVRTC_ERROR_INTERNAL_ERROR"),
        ),
        ("cuModuleGetFunction:1:500", Some("CUDA_ERROR_NOT_FOUND")),
        // Without a cubin the backend falls back to PTX at once: no error at all.
        ("nvrtcGetCUBIN:1:11", None),
    ] {
        // A fresh platform value: its module cache is empty.
        let p = open().unwrap();
        let s = p.create_stream().unwrap();
        let d = p.alloc_device(64).unwrap();
        emu.faults(spec);
        let first = fill(&p, &d, &s);
        emu.faults("");
        match name {
            Some(name) => {
                let e = first.expect_err(spec);
                assert_eq!(e.code_name, name, "{spec}: {e}");
                fill(&p, &d, &s).unwrap_or_else(|e| panic!("{spec}: the next launch failed: {e}"));
            }
            None => first.unwrap_or_else(|e| panic!("{spec}: no fallback to PTX: {e}")),
        }
        let mut out = [0u8; 64];
        p.read_device_sync(&d, 0, &mut out, &s).unwrap();
        assert_eq!(f32::from_le_bytes(out[60..].try_into().unwrap()), 1.5);
    }
}

/// A primary context whose retain failed once (a transient driver failure) is retained by the
/// next call; the backend used to keep the failure for the platform's life.
#[test]
fn a_failed_context_retain_is_retried_by_the_next_call() {
    let _g = serial();
    let emu = Emu::open();
    // A fresh platform value: it has not retained its context yet.
    let p = open().unwrap();
    emu.faults("cuDevicePrimaryCtxRetain:1:2");
    let e = p
        .create_stream()
        .expect_err("the injected fault did not surface");
    assert_eq!(e.code_name, "CUDA_ERROR_OUT_OF_MEMORY", "{e}");
    emu.faults("");
    let s = p
        .create_stream()
        .unwrap_or_else(|e| panic!("the next call failed: {e}"));
    p.synchronize_stream(&s).unwrap();
}

/// Everything a platform value created is released when it is dropped, before its context goes:
/// the emulator finds nothing to reclaim at context destruction and no free under queued work.
#[test]
fn dropping_the_platform_releases_everything_it_created() {
    let _g = serial();
    let emu = Emu::open();
    let before = emu.stats();
    {
        let p = open().unwrap();
        let s = p.create_stream().unwrap();
        let d = p.alloc_device(1 << 16).unwrap();
        let h = p.alloc_pinned(1 << 16).unwrap();
        let e = p.create_event(true).unwrap();
        fill(&p, &d, &s).unwrap();
        p.copy_async((&h).into(), 0, (&d).into(), 0, 1 << 16, &s)
            .unwrap();
        p.record_event(&e, &s).unwrap();
        let id = p.unique_id().unwrap();
        let c = p.comm_init(&id, 0, 1).unwrap();
        p.all_reduce(
            (&d).into(),
            (&d).into(),
            64,
            DType::F32,
            ReduceOp::Sum,
            &c,
            &s,
        )
        .unwrap();
        // Dropped with work still queued: the backend must wait for it before freeing.
    }
    let after = emu.stats();
    assert_eq!(live(&after), live(&before), "{after:?}");
    assert_eq!(
        after.reclaimed_at_context_destroy, before.reclaimed_at_context_destroy,
        "the context still held resources the backend had not released: {after:?}"
    );
    assert_eq!(after.frees_under_queued_work, 0, "{after:?}");
}

/// `n` bytes of pseudo-random bits (NaN payloads, subnormals, integer extremes included).
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

fn is_nan(dtype: DType, b: &[u8]) -> bool {
    let h = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    match dtype {
        DType::F16 => h(b) & 0x7c00 == 0x7c00 && h(b) & 0x03ff != 0,
        DType::BF16 => h(b) & 0x7f80 == 0x7f80 && h(b) & 0x007f != 0,
        DType::F32 => f32::from_le_bytes(b.try_into().unwrap()).is_nan(),
        DType::F64 => f64::from_le_bytes(b.try_into().unwrap()).is_nan(),
        _ => false,
    }
}

/// Every kernel the project ships (each fill, cast, scale and axpy of every dtype combination,
/// and the matmul), at an aligned and an unaligned offset, runs through NVRTC and
/// `cuLaunchKernel` on the emulator and produces the bytes of the cpu backend, whose kernels are
/// the host reference. Fills and casts match bit for bit, NaN payloads included; a NaN that
/// arithmetic (scale, axpy, matmul) produces from NaN inputs matches as a NaN: which operand's
/// payload and sign it carries is not specified (x86 keeps an operand's, depending on the order
/// the compiler chose; NVIDIA GPUs return the canonical NaN).
#[test]
fn every_shipped_kernel_produces_the_host_references_bytes() {
    use hprt_platform::{CpuBackend, CpuConfig};
    let _g = serial();
    let cuda = open().unwrap();
    let cpu = CpuBackend::new(CpuConfig::default());
    let mut kernels: Vec<Kernel<()>> = Vec::new();
    for d in DType::ALL {
        kernels.push(Kernel::Fill {
            dst: (),
            dtype: d,
            count: 97,
            value: -1234.567,
        });
        for s in DType::ALL {
            kernels.push(Kernel::Cast {
                src: (),
                src_dtype: s,
                dst: (),
                dst_dtype: d,
                count: 301,
            });
            if s.is_float() && d.is_float() {
                kernels.push(Kernel::Axpy {
                    src: (),
                    src_dtype: s,
                    dst: (),
                    dst_dtype: d,
                    count: 301,
                    alpha: -0.3,
                });
            }
        }
        if d.is_float() {
            kernels.push(Kernel::Scale {
                buf: (),
                dtype: d,
                count: 301,
                factor: 1.0 / 3.0,
            });
        }
    }
    kernels.push(Kernel::Matmul {
        a: (),
        b: (),
        c: (),
        m: 7,
        n: 5,
        k: 129,
        dtype: DType::F32,
    });
    let mut ran = 0;
    for (i, k) in kernels.iter().enumerate() {
        for skew in [0usize, 1] {
            // Each platform gets the same input bytes in buffers of the same layout.
            let results: Vec<Vec<Vec<u8>>> = [&cuda as &dyn Platform, &cpu]
                .iter()
                .map(|p| {
                    let s = p.create_stream().unwrap();
                    let bufs: Vec<(hprt_platform::DeviceBuffer, usize)> = k
                        .places()
                        .iter()
                        .enumerate()
                        .map(|(j, (_, bytes, _))| {
                            let b = p.alloc_device(bytes + skew).unwrap();
                            let data = random_bytes(bytes + skew, (i * 4 + j) as u64 + 1);
                            p.write_device_sync(&b, 0, &data, &s).unwrap();
                            (b, *bytes)
                        })
                        .collect();
                    let mut next = bufs.iter();
                    let launch = (*k)
                        .try_map(|()| Ok(next.next().expect("one buffer per place").0.at(skew)));
                    p.launch_kernel(launch.unwrap(), &s)
                        .unwrap_or_else(|e| panic!("{} on {}: {e}", k.name(), p.backend()));
                    bufs.iter()
                        .map(|(b, bytes)| {
                            let mut out = vec![0u8; *bytes];
                            p.read_device_sync(b, skew, &mut out, &s).unwrap();
                            out
                        })
                        .collect()
                })
                .collect();
            let arithmetic = matches!(
                k,
                Kernel::Scale { .. } | Kernel::Axpy { .. } | Kernel::Matmul { .. }
            );
            for (place, ((got, want), dtype)) in results[0]
                .iter()
                .zip(&results[1])
                .zip(k.place_dtypes())
                .enumerate()
            {
                let size = dtype.size();
                let first = got.chunks(size).zip(want.chunks(size)).position(|(a, b)| {
                    a != b && !(arithmetic && is_nan(dtype, a) && is_nan(dtype, b))
                });
                assert!(
                    first.is_none(),
                    "{k:?} at offset {skew}: place {place} differs from the host reference at element {first:?}"
                );
            }
            ran += 1;
        }
    }
    assert!(ran > 150, "{ran}");
}

/// A send that fails (an injected `ncclSend` fault inside an all-to-all's group) is a typed error
/// naming the NCCL status on its rank; the peer's receive, which NCCL would leave pending, fails
/// after the collective timeout (the watchdog) instead of hanging; a fresh communicator then
/// works on both ranks.
#[test]
fn a_failed_send_is_an_error_on_both_ranks_never_a_hang() {
    let _g = serial();
    let emu = Emu::open();
    let p = open_with_timeout(300);
    let all_to_all = |p: &dyn Platform, rank: usize, id: &hprt_platform::UniqueId| {
        p.set_device(rank)?;
        let s = p.create_stream()?;
        let c = p.comm_init(id, rank, 2)?;
        let b = p.alloc_device(256)?;
        let op = Collective::AllToAll {
            send: b.at(0),
            recv: b.at(128),
            count: 16,
            dtype: DType::F32,
        };
        p.collective(&c, op, &s)?;
        p.synchronize_stream(&s)
    };
    let frees_under_work = emu.stats().frees_under_queued_work;
    emu.faults("ncclSend:1:4");
    let id = p.unique_id().unwrap();
    let results: Vec<hprt_platform::Result<()>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (p, id) = (&p, &id);
                sc.spawn(move || all_to_all(p, rank, id))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    emu.faults("");
    assert_eq!(
        emu.stats().frees_under_queued_work,
        frees_under_work,
        "a buffer was freed while the failed all-to-all's queued work still used it"
    );
    let names: Vec<String> = results
        .iter()
        .map(|r| {
            r.as_ref()
                .map_or_else(|e| e.code_name.to_string(), |()| "ok".into())
        })
        .collect();
    assert!(
        names.contains(&"ncclInvalidArgument".to_string())
            && names.contains(&"HP_ERROR_TIMEOUT".to_string()),
        "{names:?}"
    );
    let id = p.unique_id().unwrap();
    std::thread::scope(|sc| {
        for rank in 0..2 {
            let (p, id) = (&p, &id);
            sc.spawn(move || all_to_all(p, rank, id).unwrap());
        }
    });
    assert_eq!(emu.stats().live_comms, 0);
}

/// When the backend cannot record that queued work uses a buffer (its use event cannot be
/// created or recorded), the call fails and the buffers are still never freed under that work.
#[test]
fn a_use_that_cannot_be_recorded_never_lets_a_buffer_be_freed_under_queued_work() {
    let _g = serial();
    let emu = Emu::open();
    let p = open().unwrap();
    let s = p.create_stream().unwrap();
    let before = emu.stats().frees_under_queued_work;
    for spec in [
        "cuEventCreate:1:2",
        "cuEventRecord:1:999",
        "cuEventCreate:2:2",
    ] {
        let d = p.alloc_device(1 << 16).unwrap();
        let h = p.alloc_pinned(1 << 16).unwrap();
        // Keeps the copy queued while the buffers are dropped.
        p.launch_host_fn(
            &s,
            Box::new(|| std::thread::sleep(std::time::Duration::from_millis(30))),
        )
        .unwrap();
        emu.faults(spec);
        let e = p
            .copy_async((&d).into(), 0, (&h).into(), 0, 1 << 16, &s)
            .expect_err(spec);
        emu.faults("");
        assert!(e.message.contains("cuEvent"), "{spec}: {e}");
        drop((d, h));
        p.synchronize_stream(&s).unwrap();
        assert_eq!(
            emu.stats().frees_under_queued_work,
            before,
            "{spec}: a buffer was freed while the copy still used it"
        );
    }
}

/// A failed collective (ranks disagree on the count, which the emulator reports as NCCL's
/// `ncclInvalidUsage`) makes the backend abort the communicator on each rank
/// (`ncclCommGetAsyncError`, then `ncclCommAbort`) at its next operation, which fails on its
/// stream with that first cause instead of being handed to a broken communicator; dropping the
/// aborted communicator does not destroy it a second time.
#[test]
fn a_failed_collective_aborts_the_communicator_on_every_rank() {
    let _g = serial();
    let emu = Emu::open();
    let p = open().unwrap();
    let id = p.unique_id().unwrap();
    let comms_before = emu.stats().live_comms;
    let both = std::sync::Barrier::new(2);
    let live_while_held = Mutex::new(None);
    let rank_run = |rank: usize| -> hprt_platform::Result<(String, String)> {
        p.set_device(rank)?;
        let s = p.create_stream()?;
        let c = p.comm_init(&id, rank, 2)?;
        let b = p.alloc_device(256)?;
        let all_reduce =
            |count| p.all_reduce(b.at(0), b.at(64), count, DType::F32, ReduceOp::Sum, &c, &s);
        all_reduce(if rank == 0 { 4 } else { 8 })?;
        let first = p.synchronize_stream(&s).unwrap_err();
        all_reduce(4)?;
        let later = p.synchronize_stream(&s).unwrap_err();
        both.wait();
        if rank == 0 {
            *live_while_held.lock().unwrap() = Some(emu.stats().live_comms);
        }
        both.wait();
        Ok((first.code_name.to_string(), later.code_name.to_string()))
    };
    let results: Vec<(String, String)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| sc.spawn(move || rank_run(rank)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    for (first, later) in &results {
        assert_eq!(first, "CUDA_ERROR_LAUNCH_FAILED", "{results:?}");
        assert_eq!(later, "ncclInvalidUsage", "{results:?}");
    }
    assert_eq!(
        *live_while_held.lock().unwrap(),
        Some(comms_before),
        "the failed communicator was not aborted on every rank"
    );
    assert_eq!(emu.stats().live_comms, comms_before);
}

/// A buffer with a memset queued on `s` behind a host function that holds the stream until the
/// returned sender sends (at most 10 s, so a free that waits shows up as slow, not as a hang).
fn queued_memset(
    p: &dyn Platform,
    s: &hprt_platform::Stream,
) -> (hprt_platform::DeviceBuffer, std::sync::mpsc::Sender<()>) {
    let d = p.alloc_device(1 << 16).unwrap();
    let (release, held) = std::sync::mpsc::channel::<()>();
    p.launch_host_fn(
        s,
        Box::new(move || {
            let _ = held.recv_timeout(std::time::Duration::from_secs(10));
        }),
    )
    .unwrap();
    p.memset_async(&d, 0, 1, 1 << 16, s).unwrap();
    (d, release)
}

/// Frees are stream ordered: dropping a buffer that queued work still uses returns at once, and
/// its memory is freed only once that work finished (no `cuMemFree` under queued work, the
/// allocation gone after a synchronize). When the backend cannot show that the work finished
/// (the query on its use event fails), the buffer is leaked (logged) instead of freed under work
/// that may still use it.
#[test]
fn a_free_waits_for_no_queued_work_and_a_buffer_whose_last_use_cannot_be_shown_finished_is_leaked()
{
    let _g = serial();
    let emu = Emu::open();
    let frees_under_work = emu.stats().frees_under_queued_work;
    let allocations = emu.stats().live_device_allocations;
    let reclaimed = emu.stats().reclaimed_at_context_destroy;
    // Dropping the platform waits for the memory still waiting for its queued work, then frees
    // it.
    let p = open().unwrap();
    let s = p.create_stream().unwrap();
    let (d, release) = queued_memset(&p, &s);
    drop(d);
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let _ = release.send(());
    });
    drop((s, p));
    releaser.join().unwrap();
    assert_eq!(
        emu.stats().frees_under_queued_work,
        frees_under_work,
        "the platform's teardown freed memory under queued work"
    );
    assert_eq!(
        (
            emu.stats().live_device_allocations,
            emu.stats().reclaimed_at_context_destroy
        ),
        (allocations, reclaimed),
        "the platform's teardown did not free the memory waiting for its queued work"
    );

    let p = open().unwrap();
    let s = p.create_stream().unwrap();
    for query_fault in ["", "cuEventQuery:1:999"] {
        let (d, release) = queued_memset(&p, &s);
        emu.faults(query_fault);
        let started = std::time::Instant::now();
        drop(d);
        let took = started.elapsed();
        emu.faults("");
        assert!(
            took < std::time::Duration::from_secs(5),
            "{query_fault:?}: the free waited for the queued memset ({took:?})"
        );
        let _ = release.send(());
        p.synchronize_stream(&s).unwrap();
        assert_eq!(
            emu.stats().frees_under_queued_work,
            frees_under_work,
            "{query_fault:?}: a buffer was freed while queued work still used it"
        );
    }
    assert_eq!(
        emu.stats().live_device_allocations,
        allocations + 1,
        "not exactly the buffer whose last use could not be shown finished was kept (leaked)"
    );
}

/// The cuda backend on the emulator with a collective timeout of `ms` (`HP_COLLECTIVE_TIMEOUT_MS`
/// is read when a platform opens; callers hold `serial()`).
fn open_with_timeout(ms: u64) -> hprt_platform::CudaBackend {
    std::env::set_var("HP_COLLECTIVE_TIMEOUT_MS", ms.to_string());
    let p = open();
    std::env::remove_var("HP_COLLECTIVE_TIMEOUT_MS");
    p.unwrap()
}

/// NCCL never times a collective out: a peer that skips one, or never calls it at all, leaves it
/// pending (the emulator models that) and every wait on it blocked. The backend's watchdog aborts
/// the communicator once the collective has been outstanding for the collective timeout: the
/// waiting synchronize fails within the bound with a `Timeout` naming the collective and the
/// communicator, the collectives queued behind it and those issued later fail at once with the
/// same cause, and the aborted communicator can still be destroyed. Without the watchdog the
/// rank's synchronize never returns, which the outer bound turns into a failure, not a hang.
#[test]
fn a_collective_whose_peer_never_comes_fails_within_the_collective_timeout() {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};
    type Outcome = (
        hprt_platform::Error,
        Duration,
        hprt_platform::Error,
        Duration,
    );
    let _g = serial();
    let emu = Emu::open();
    let p = std::sync::Arc::new(open_with_timeout(1000));
    let comms_before = emu.stats().live_comms;
    // Rank 1 issues this many of rank 0's three all-reduces (one: it skips the second; none: it
    // never calls any), then destroys its communicator; rank 0 issues them one by one, or in one
    // NCCL group (queued, and watched, at its end), or destroys its communicator before it
    // synchronizes (the destroy waits for them as NCCL's would, but only as long as the timeout).
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Rank0 {
        Plain,
        Grouped,
        DestroysFirst,
    }
    for (issued_by_peer, rank0) in [
        (1usize, Rank0::Plain),
        (0, Rank0::Plain),
        (0, Rank0::Grouped),
        (0, Rank0::DestroysFirst),
    ] {
        let id = p.unique_id().unwrap();
        let (report, reports) = mpsc::channel();
        for rank in 0..2 {
            let (p, id, report) = (p.clone(), id.clone(), report.clone());
            std::thread::spawn(move || {
                let run = || -> hprt_platform::Result<Option<Outcome>> {
                    p.set_device(rank)?;
                    let s = p.create_stream()?;
                    let c = p.comm_init(&id, rank, 2)?;
                    let b = p.alloc_device(256)?;
                    let all_reduce =
                        || p.all_reduce(b.at(0), b.at(64), 4, DType::F32, ReduceOp::Sum, &c, &s);
                    if rank == 1 {
                        for _ in 0..issued_by_peer {
                            all_reduce()?;
                        }
                        p.synchronize_stream(&s)?;
                        return Ok(None);
                    }
                    if rank0 == Rank0::Grouped {
                        p.group_start()?;
                    }
                    for _ in 0..3 {
                        all_reduce()?;
                    }
                    if rank0 == Rank0::Grouped {
                        p.group_end()?;
                    }
                    let start = Instant::now();
                    if rank0 == Rank0::DestroysFirst {
                        p.destroy_comm(&c)?;
                    }
                    let Err(first) = p.synchronize_stream(&s) else {
                        panic!("a collective no peer joined succeeded");
                    };
                    let waited = start.elapsed();
                    if rank0 == Rank0::DestroysFirst {
                        return Ok(Some((first.clone(), waited, first, Duration::ZERO)));
                    }
                    let start = Instant::now();
                    all_reduce()?;
                    let Err(later) = p.synchronize_stream(&s) else {
                        panic!("a collective issued after the abort succeeded");
                    };
                    let at_once = start.elapsed();
                    p.destroy_comm(&c)?;
                    Ok(Some((first, waited, later, at_once)))
                };
                let _ = report.send((rank, run()));
            });
        }
        let mut outcome = None;
        for _ in 0..2 {
            let (rank, r) = reports
                .recv_timeout(Duration::from_secs(10))
                .expect("a rank hung: nothing ended the collective its peer never joined");
            let r = r.unwrap_or_else(|e| {
                panic!("rank {rank} (peer issued {issued_by_peer}, rank 0 {rank0:?}): {e}")
            });
            outcome = outcome.or(r);
        }
        let (first, waited, later, at_once) = outcome.expect("rank 0 reported");
        assert_eq!(first.kind, ErrorKind::Timeout, "{rank0:?}: {first}");
        assert!(
            first
                .message
                .contains(&format!("all_reduce #{}", issued_by_peer + 1))
                && first.message.contains("rank 0 of 2"),
            "{first}"
        );
        assert!(
            waited >= Duration::from_millis(900) && waited < Duration::from_secs(3),
            "the synchronize failed after {waited:?}, with a collective timeout of 1 s"
        );
        assert_eq!(later.message, first.message, "{later}");
        assert!(at_once < Duration::from_millis(500), "{at_once:?}");
    }
    assert_eq!(emu.stats().live_comms, comms_before);
}
