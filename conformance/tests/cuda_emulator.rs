//! The cuda backend against the CUDA emulator (`tests/cuda-emulator`, built by
//! `cargo build -p hprt-cuda-emulator`, which `scripts/test` runs first): loading, fault
//! injection on every call class (a typed error naming the CUDA / NCCL / NVRTC status, nothing
//! leaked, the next call works), leaks, and the contracts the backend must keep.
//!
//! The emulator's state is process-global, so these tests take one lock and stay one test
//! binary: its groups are modules under `cuda_emulator/`.

use std::sync::{Mutex, MutexGuard};

use hprt_conformance::cuda_emulator::{library_path, open};
use hprt_conformance::emulator::{check_fault_cases, FaultCase};
use hprt_platform::{BackendKind, Collective, DType, ErrorKind, Kernel, Platform, ReduceOp};

#[path = "cuda_emulator/calls.rs"]
mod calls;
#[path = "cuda_emulator/contracts.rs"]
mod contracts;
#[path = "cuda_emulator/emu.rs"]
mod emu;
#[path = "cuda_emulator/faults.rs"]
mod faults;
#[path = "cuda_emulator/kernels.rs"]
mod kernels;

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

type Emu = emu::Emu<Stats>;

impl Emu {
    fn open() -> Emu {
        Emu::open_at(&library_path())
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
