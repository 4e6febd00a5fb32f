//! The npu backend against the Ascend emulator (`tests/ascend-emulator`, built on first
//! use): loading, optional
//! symbols, ACL ownership, fault injection on every call class, and leaks.
//!
//! The emulator's state is process-global, so these tests take one lock.

use std::path::PathBuf;

use hprt_conformance::emulator::{
    check_fault_cases, library_path as emulator, search_env as explicit, serial, FaultCase,
};
use hprt_platform::{DType, ErrorKind, NpuBackend, Platform, ReduceOp};
use hprt_sys::SearchEnv;

#[path = "cuda_emulator/calls.rs"]
mod calls;
#[path = "cuda_emulator/emu.rs"]
mod emu;

#[repr(C)]
#[derive(Default, Debug, Clone, Copy, PartialEq)]
struct Stats {
    init_calls: u64,
    finalize_calls: u64,
    live_device_allocations: u64,
    live_device_bytes: u64,
    live_host_allocations: u64,
    live_streams: u64,
    live_events: u64,
    live_comms: u64,
}

type Emu = emu::Emu<Stats>;

impl Emu {
    fn open() -> Emu {
        Emu::open_at(&emulator())
    }
}

fn live(s: &Stats) -> [u64; 5] {
    [
        s.live_device_allocations,
        s.live_host_allocations,
        s.live_streams,
        s.live_events,
        s.live_comms,
    ]
}

#[test]
fn loads_from_an_explicit_path_and_reports_it() {
    let _g = serial();
    let p = NpuBackend::open_with(&explicit()).expect("npu backend on the emulator");
    let info = Platform::info(&p);
    assert_eq!(info.backend, hprt_platform::BackendKind::Npu);
    assert!(
        info.driver.contains("libhprt_ascend_emulator.so"),
        "{}",
        info.driver
    );
    assert!(
        info.libraries
            .iter()
            .any(|l| l.found && l.path.contains("HP_ACL_LIB")),
        "{:?}",
        info.libraries
    );
    assert!(!info.devices.is_empty());
}

#[test]
fn loads_through_the_toolkit_directory() {
    let _g = serial();
    let root = std::env::temp_dir().join(format!("hprt-npu-toolkit-{}", std::process::id()));
    let lib64 = root.join("lib64");
    std::fs::create_dir_all(&lib64).unwrap();
    for name in ["libascendcl.so", "libhccl.so"] {
        let link = lib64.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(emulator(), &link).unwrap();
    }
    let env = SearchEnv {
        toolkit_home: Some(root.clone()),
        ..Default::default()
    };
    let p = NpuBackend::open_with(&env).expect("found through ASCEND_TOOLKIT_HOME");
    let info = Platform::info(&p);
    assert!(
        info.libraries
            .iter()
            .any(|l| l.found && l.path.contains("ASCEND_TOOLKIT_HOME")),
        "{:?}",
        info.libraries
    );
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_missing_library_is_a_typed_unavailable_error() {
    let missing = SearchEnv {
        acl_lib: Some("/nonexistent/libascendcl.so".into()),
        ..Default::default()
    };
    let e = NpuBackend::open_with(&missing)
        .err()
        .expect("no library there");
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert!(
        e.message.contains("/nonexistent/libascendcl.so") && e.message.contains("HP_ACL_LIB"),
        "{e}"
    );
}

#[test]
fn a_library_without_the_acl_symbols_names_the_missing_one() {
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/lib64/libc.so.6",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
    .expect("a libc to load");
    let env = SearchEnv {
        acl_lib: Some(libc.clone()),
        hccl_lib: Some(emulator()),
        ..Default::default()
    };
    let e = NpuBackend::open_with(&env).err().expect("libc is not ACL");
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert!(
        e.message.contains("required symbol aclInit") && e.message.contains(libc.to_str().unwrap()),
        "{e}"
    );
}

#[test]
fn an_absent_optional_symbol_is_reported_not_fatal() {
    let _g = serial();
    // The emulator does not export aclrtGetVersion (optional in CANN); the backend still opens.
    let p = NpuBackend::open_with(&explicit()).unwrap();
    let info = Platform::info(&p);
    assert!(info.driver.contains("version unknown"), "{}", info.driver);
    let optional = info
        .settings
        .iter()
        .find(|(k, _)| k == "optional symbols")
        .unwrap();
    assert!(
        optional.1.contains("aclrtGetVersion: absent"),
        "{optional:?}"
    );
    assert!(
        optional.1.contains("HcclGroupStart: present"),
        "{optional:?}"
    );
}

#[test]
fn acl_initialised_by_someone_else_is_never_finalized() {
    let _g = serial();
    let emu = Emu::open();
    let owner = NpuBackend::open_with(&explicit()).unwrap();
    let before = emu.stats();
    // ACL is initialised now, as torch_npu would have done: this value must adopt it.
    let guest = NpuBackend::open_with(&explicit()).unwrap();
    assert!(Platform::info(&guest)
        .settings
        .iter()
        .any(|(k, v)| k == "aclInit" && v.contains("another component")));
    drop(guest);
    assert_eq!(
        emu.stats().finalize_calls,
        before.finalize_calls,
        "a guest finalized ACL"
    );
    drop(owner);
    assert_eq!(
        emu.stats().finalize_calls,
        before.finalize_calls + 1,
        "the owner did not finalize ACL"
    );
}

/// Every call class's error path: the injected code comes back typed and named, and nothing
/// the failed call touched leaks.
#[test]
fn injected_faults_become_typed_named_errors_without_leaks() {
    let _g = serial();
    let emu = Emu::open();
    let p = NpuBackend::open_with(&explicit()).unwrap();
    let s = p.create_stream().unwrap();
    let cases: &[FaultCase] = &[
        (
            "aclrtMalloc:1:207001",
            ErrorKind::OutOfMemory,
            "ACL_ERROR_RT_MEMORY_ALLOCATION",
            calls::alloc_device,
        ),
        (
            "aclrtMallocHost:1:207001",
            ErrorKind::OutOfMemory,
            "ACL_ERROR_RT_MEMORY_ALLOCATION",
            calls::alloc_pinned,
        ),
        (
            "aclrtCreateStream:1:507000",
            ErrorKind::Internal,
            "ACL_ERROR_RT_INTERNAL_ERROR",
            calls::create_stream,
        ),
        (
            "aclrtCreateEventWithFlag:1:100000",
            ErrorKind::InvalidValue,
            "ACL_ERROR_INVALID_PARAM",
            calls::create_timing_event,
        ),
        (
            "aclrtRecordEvent:1:507000",
            ErrorKind::Internal,
            "ACL_ERROR_RT_INTERNAL_ERROR",
            calls::record_event,
        ),
        (
            "aclrtMemcpyAsync:1:107000",
            ErrorKind::InvalidValue,
            "ACL_ERROR_RT_PARAM_INVALID",
            calls::copy_pinned_to_device,
        ),
        (
            "aclrtMemsetAsync:1:507000",
            ErrorKind::Internal,
            "ACL_ERROR_RT_INTERNAL_ERROR",
            calls::memset,
        ),
        (
            "aclrtSynchronizeStream:1:507000",
            ErrorKind::Internal,
            "ACL_ERROR_RT_INTERNAL_ERROR",
            calls::synchronize_stream,
        ),
        (
            "HcclGetRootInfo:1:7",
            ErrorKind::Internal,
            "HCCL_E_UNAVAIL",
            calls::unique_id,
        ),
        (
            "HcclCommInitRootInfo:1:9",
            ErrorKind::Timeout,
            "HCCL_E_TIMEOUT",
            calls::comm_init,
        ),
        (
            "HcclAllReduce:1:9",
            ErrorKind::Timeout,
            "HCCL_E_TIMEOUT",
            calls::all_reduce_sum,
        ),
        (
            "HcclAllGather:1:3",
            ErrorKind::OutOfMemory,
            "HCCL_E_MEMORY",
            calls::all_gather,
        ),
    ];
    check_fault_cases(&emu.0, |c| live(&c.stats()), &p, &s, cases);
}

/// One failed `aclrtSetDevice` on the report thread (its second call) must not disable host
/// functions, and the kernels and `Avg` reductions built on them, for the whole process: the
/// next use starts the thread again.
#[test]
fn a_failed_report_thread_start_is_retried() {
    let _g = serial();
    let emu = Emu::open();
    emu.faults("aclrtSetDevice:2:507000");
    let p = NpuBackend::open_with(&explicit()).unwrap();
    let s = p.create_stream().unwrap();
    emu.faults("");
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = std::sync::Arc::clone(&ran);
    p.launch_host_fn(
        &s,
        Box::new(move || flag.store(true, std::sync::atomic::Ordering::SeqCst)),
    )
    .expect("a host function after one failed aclrtSetDevice");
    p.synchronize_stream(&s).unwrap();
    assert!(ran.load(std::sync::atomic::Ordering::SeqCst));
    let failed: Vec<String> = hprt_conformance::run_cases(&p, Some("kernel"))
        .into_iter()
        .filter(|o| !o.passed)
        .map(|o| format!("{}: {}", o.name, o.detail))
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
}

/// Freeing memory whose queued work cannot be shown finished (the query on its use event fails
/// while the work is still pending) leaks it, reported and still counted, instead of freeing it
/// under that work; otherwise memory is freed, in stream order, once its work finished.
#[test]
fn memory_is_not_freed_when_its_last_use_is_not_known_finished() {
    let _g = serial();
    let emu = Emu::open();
    let p = NpuBackend::open_with(&explicit()).unwrap();
    let s = p.create_stream().unwrap();
    let (release, gate) = std::sync::mpsc::channel::<()>();
    p.launch_host_fn(
        &s,
        Box::new(move || {
            let _ = gate.recv();
        }),
    )
    .unwrap();
    let d = p.alloc_device(4096).unwrap();
    p.memset_async(&d, 0, 7, 4096, &s).unwrap();
    let before = emu.stats().live_device_allocations;
    emu.faults("aclrtQueryEventStatus:1:507000");
    drop(d);
    emu.faults("");
    assert_eq!(
        emu.stats().live_device_allocations,
        before,
        "memory was freed while the memset queued on it had not run"
    );
    assert_eq!(
        p.memory_stats().device_current,
        4096,
        "the leak is not counted"
    );
    release.send(()).unwrap();
    p.synchronize_stream(&s)
        .expect("the memset ran on memory that is still allocated");
    // The ordinary path frees, once the work queued on the memory finished.
    let d = p.alloc_device(4096).unwrap();
    p.memset_async(&d, 0, 7, 4096, &s).unwrap();
    drop(d);
    p.synchronize_stream(&s).unwrap();
    assert_eq!(emu.stats().live_device_allocations, before);
}

#[test]
fn avg_runs_as_sum_then_a_scale_on_the_stream() {
    let _g = serial();
    let p = NpuBackend::open_with(&explicit()).unwrap();
    let id = p.unique_id().unwrap();
    let world = 3;
    let pr = &p;
    std::thread::scope(|sc| {
        for rank in 0..world {
            let id = &id;
            sc.spawn(move || {
                let c = pr.comm_init(id, rank, world).unwrap();
                let s = pr.create_stream().unwrap();
                let d = pr.alloc_device(16).unwrap();
                let v: Vec<u8> = [3.0f32 * (rank as f32 + 1.0); 4]
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect();
                pr.write_device_sync(&d, 0, &v, &s).unwrap();
                pr.all_reduce(
                    (&d).into(),
                    (&d).into(),
                    4,
                    DType::F32,
                    ReduceOp::Avg,
                    &c,
                    &s,
                )
                .unwrap();
                let mut out = [0u8; 16];
                pr.read_device_sync(&d, 0, &mut out, &s).unwrap();
                assert_eq!(f32::from_le_bytes(out[..4].try_into().unwrap()), 6.0);
            });
        }
    });
}
