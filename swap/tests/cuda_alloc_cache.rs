//! The swap engine on the cuda backend over the CUDA emulator (`tests/cuda-emulator`, built on
//! first use): repeated offload /
//! reload cycles make no `cuMemAlloc` / `cuMemFree` calls once the first cycle filled the
//! backend's allocation cache (before it: one of each per tensor and cycle), and dropping the
//! platform frees everything. The cache's own cases: `conformance/tests/cuda_alloc_cache.rs`.
//!
//! The emulator counts driver calls per process: this binary holds this one test only.

use std::sync::Arc;

use hprt_conformance::cuda_emulator::{self, device_memory_calls};
use hprt_platform::{BackendKind, DType, Platform};
use hprt_swap::{DeviceTensor, EngineConfig, Saved, SwapEngine, SwapTensor};

#[test]
fn offload_reload_cycles_reuse_device_memory_without_the_driver_allocator() {
    std::env::remove_var("HP_CUDA_ALLOC_CACHE");
    let start = device_memory_calls();
    {
        let p: Arc<dyn Platform> = Arc::new(cuda_emulator::open().expect("cuda on the emulator"));
        assert_eq!(p.backend(), BackendKind::Cuda);
        let s = p.create_stream().unwrap();
        let (data, bufs) = cuda_emulator::cache_test_buffers(&*p, &s);
        let sizes: Vec<usize> = data.iter().map(Vec::len).collect();
        let mut tensors: Vec<SwapTensor> = bufs
            .iter()
            .map(|b| {
                let t = DeviceTensor::whole(b.clone(), DType::U8, vec![b.len()]);
                SwapTensor::new(Saved::Tensor(t)).unwrap()
            })
            .collect();
        let mut engine = SwapEngine::new(p.clone(), EngineConfig::default()).unwrap();
        let mut cycle = |tensors: &mut [SwapTensor]| {
            engine.offload(tensors.iter_mut(), &s).unwrap();
            engine.finish_offload(tensors.iter_mut()).unwrap();
            engine.start_reload(tensors.iter_mut()).unwrap();
            engine.finish_reload(tensors.iter_mut(), &s).unwrap();
            p.synchronize_stream(&s).unwrap();
        };
        cycle(&mut tensors); // fills the cache
        let warm = device_memory_calls();
        const CYCLES: u64 = 5;
        for _ in 0..CYCLES {
            cycle(&mut tensors);
        }
        let after = device_memory_calls();
        assert_eq!(
            (after.0 - warm.0, after.1 - warm.1),
            (0, 0),
            "(cuMemAlloc, cuMemFree) calls over {CYCLES} offload/reload cycles of {} tensors",
            sizes.len()
        );
        // The reloaded bytes are the saved ones.
        cuda_emulator::assert_reloaded(&*p, &s, &bufs, &data);
        assert_eq!(p.memory_stats().device_current, sizes.iter().sum::<usize>());
    }
    // The platform is gone: its cache went back to the driver with it.
    let end = device_memory_calls();
    assert_eq!(
        end.0 - start.0,
        end.1 - start.1,
        "every cuMemAlloc has its cuMemFree once the platform is dropped: {start:?} -> {end:?}"
    );
}
