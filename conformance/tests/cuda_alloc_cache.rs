//! The cuda backend's device allocation cache over the CUDA emulator (`tests/cuda-emulator`,
//! built by `cargo build -p hprt-cuda-emulator`, which `scripts/test` runs first): repeated
//! offload / reload cycles as a swap engine makes them (device-to-host copy, storage released,
//! re-acquired, host-to-device copy) make no `cuMemAlloc` / `cuMemFree` and no `cuEventCreate` /
//! `cuEventDestroy` calls once the first cycle filled the cache (before it: one of each per
//! tensor and cycle); the cache gives its memory back when the driver runs out; dropping the
//! platform frees everything.
//!
//! The emulator counts driver calls per process: this binary holds this one test only.

use hprt_conformance::cuda_emulator::{self, device_memory_calls, driver_calls};
use hprt_platform::{BackendKind, ErrorKind, Platform};

const DEVICE_MEMORY: usize = 64 << 20;

#[test]
fn offload_reload_cycles_reuse_device_memory_without_the_driver_allocator() {
    // Read by the emulator at its first use, below.
    std::env::set_var("HP_EMU_DEVICE_MEMORY", DEVICE_MEMORY.to_string());
    std::env::remove_var("HP_CUDA_ALLOC_CACHE");
    let start = device_memory_calls();
    {
        let p = cuda_emulator::open().expect("cuda on the emulator");
        let p: &dyn Platform = &p;
        assert_eq!(p.backend(), BackendKind::Cuda);
        let s = p.create_stream().unwrap();
        let (data, bufs) = cuda_emulator::cache_test_buffers(p, &s);
        let sizes: Vec<usize> = data.iter().map(Vec::len).collect();
        let host: Vec<_> = sizes.iter().map(|&n| p.alloc_pinned(n).unwrap()).collect();
        let cycle = || {
            for (b, h) in bufs.iter().zip(&host) {
                p.copy_async(h.into(), 0, b.into(), 0, b.len(), &s).unwrap();
            }
            p.synchronize_stream(&s).unwrap();
            for b in &bufs {
                p.resize_device(b, 0).unwrap();
            }
            for ((b, h), &n) in bufs.iter().zip(&host).zip(&sizes) {
                p.resize_device(b, n).unwrap();
                p.copy_async(b.into(), 0, h.into(), 0, n, &s).unwrap();
            }
            p.synchronize_stream(&s).unwrap();
        };
        let events = || {
            (
                driver_calls("cuEventCreate"),
                driver_calls("cuEventDestroy_v2"),
            )
        };
        cycle(); // fills the cache
        let (warm, warm_events) = (device_memory_calls(), events());
        const CYCLES: u64 = 5;
        for _ in 0..CYCLES {
            cycle();
        }
        let (after, after_events) = (device_memory_calls(), events());
        assert_eq!(
            (after.0 - warm.0, after.1 - warm.1),
            (0, 0),
            "(cuMemAlloc, cuMemFree) calls over {CYCLES} offload/reload cycles of {} tensors",
            sizes.len()
        );
        // A re-acquired storage is a new buffer: its use events come from the freed ones.
        assert_eq!(
            (
                after_events.0 - warm_events.0,
                after_events.1 - warm_events.1
            ),
            (0, 0),
            "(cuEventCreate, cuEventDestroy) calls over {CYCLES} cycles of {} tensors",
            sizes.len()
        );
        // The reloaded bytes are the saved ones.
        cuda_emulator::assert_reloaded(p, &s, &bufs, &data);
        // Cached bytes are not counted as allocated.
        assert_eq!(p.memory_stats().device_current, sizes.iter().sum::<usize>());
        drop(bufs);
        assert_eq!(p.memory_stats().device_current, 0);
        // Blocks the driver is short of come back from the cache: 4 x 8 MiB cached, then 48 MiB
        // asked for with 64 MiB in all.
        let blocks: Vec<_> = (0..4).map(|_| p.alloc_device(8 << 20).unwrap()).collect();
        drop(blocks);
        let before_big = device_memory_calls();
        let big = p.alloc_device(48 << 20).unwrap_or_else(|e| {
            panic!("48 MiB with 32 MiB of the 64 cached: {e}");
        });
        let after_big = device_memory_calls();
        assert!(
            after_big.1 - before_big.1 >= 4,
            "the cached 8 MiB blocks were not freed: {before_big:?} -> {after_big:?}"
        );
        drop(big);
        // Nearly the whole device, with every earlier block cached: the cache is emptied.
        let whole = p.alloc_device(DEVICE_MEMORY - 4096).unwrap();
        // More than is left is still out of memory.
        let e = p.alloc_device(8 << 20).err().map(|e| e.kind());
        assert_eq!(e, Some(ErrorKind::OutOfMemory));
        drop(whole);
    }
    // The platform is gone: its cache went back to the driver with it.
    let end = device_memory_calls();
    assert_eq!(
        end.0 - start.0,
        end.1 - start.1,
        "every cuMemAlloc has its cuMemFree once the platform is dropped: {start:?} -> {end:?}"
    );
}
