//! Fault injection on every driver and NCCL call class (a typed error naming the status,
//! nothing leaked, the next call works), retried module loads and context retains, and a
//! dropped platform releasing everything it created.

use super::*;

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
            calls::alloc_device,
        ),
        (
            "cuMemHostAlloc:1:2",
            ErrorKind::OutOfMemory,
            "CUDA_ERROR_OUT_OF_MEMORY",
            calls::alloc_pinned,
        ),
        (
            "cuStreamCreate:1:999",
            ErrorKind::Internal,
            "CUDA_ERROR_UNKNOWN",
            calls::create_stream,
        ),
        (
            "cuEventCreate:1:1",
            ErrorKind::InvalidValue,
            "CUDA_ERROR_INVALID_VALUE",
            calls::create_timing_event,
        ),
        (
            "cuEventRecord:1:400",
            ErrorKind::InvalidHandle,
            "CUDA_ERROR_INVALID_HANDLE",
            calls::record_event,
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
            calls::copy_pinned_to_device,
        ),
        (
            "cuMemsetD8Async:1:1",
            ErrorKind::InvalidValue,
            "CUDA_ERROR_INVALID_VALUE",
            calls::memset,
        ),
        (
            "cuStreamSynchronize:1:719",
            ErrorKind::Internal,
            "CUDA_ERROR_LAUNCH_FAILED",
            calls::synchronize_stream,
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
            calls::create_stream,
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
            calls::unique_id,
        ),
        (
            "ncclCommInitRank:1:5",
            ErrorKind::InvalidValue,
            "ncclInvalidUsage",
            calls::comm_init,
        ),
        (
            "ncclAllReduce:1:1",
            ErrorKind::Internal,
            "ncclUnhandledCudaError",
            calls::all_reduce_avg,
        ),
        (
            "ncclAllGather:1:4",
            ErrorKind::InvalidValue,
            "ncclInvalidArgument",
            calls::all_gather,
        ),
        (
            "ncclReduceScatter:1:3",
            ErrorKind::Internal,
            "ncclInternalError",
            calls::reduce_scatter_sum,
        ),
        (
            "ncclBroadcast:1:6",
            ErrorKind::Internal,
            "ncclRemoteError",
            calls::broadcast,
        ),
        (
            "ncclGroupStart:1:5",
            ErrorKind::InvalidValue,
            "ncclInvalidUsage",
            calls::group,
        ),
        (
            "ncclGroupEnd:1:8",
            ErrorKind::Timeout,
            "ncclTimeout",
            calls::group,
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
