//! The engine and state machine on the cpu backend: wrong states, modification checks, views,
//! out-of-memory on reload, the pinned pool, and the pinned-reuse wait.

use std::sync::Arc;

use hprt_platform::{CpuBackend, CpuConfig, DType, DeviceBuffer, ErrorKind, Platform, Stream};
use hprt_swap::{
    DeviceTensor, EngineConfig, Faults, PinnedPool, PoolConfig, Saved, SwapEngine, SwapError,
    SwapState, SwapTensor,
};

mod common;
use common::{assert_modified_once_since_offload, assert_some_seed_catches, jitter_seeds};

struct Fixture {
    p: Arc<dyn Platform>,
    s: Stream,
    engine: SwapEngine,
}

fn fixture(device_memory: usize, jitter: Option<u64>) -> Fixture {
    let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig {
        device_memory,
        jitter,
        ..CpuConfig::default()
    }));
    let s = p.create_stream().unwrap();
    let engine = SwapEngine::new(Arc::clone(&p), EngineConfig::default()).unwrap();
    Fixture { p, s, engine }
}

fn filled(f: &Fixture, bytes: usize, seed: u8) -> (DeviceBuffer, Vec<u8>) {
    let data: Vec<u8> = (0..bytes)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    let buf = f.p.alloc_device(bytes).unwrap();
    f.p.write_device_sync(&buf, 0, &data, &f.s).unwrap();
    (buf, data)
}

fn whole(buf: &DeviceBuffer) -> SwapTensor {
    let t = DeviceTensor::whole(buf.clone(), DType::U8, vec![buf.len()]);
    SwapTensor::new(Saved::Tensor(t)).unwrap()
}

fn read(f: &Fixture, buf: &DeviceBuffer, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    f.p.read_device_sync(buf, offset, &mut out, &f.s).unwrap();
    out
}

fn wrong_state(r: Result<(), SwapError>) -> SwapState {
    match r {
        Err(SwapError::WrongState { actual, .. }) => actual,
        other => panic!("expected a wrong-state error, got {other:?}"),
    }
}

#[test]
fn full_cycle_restores_bytes_and_releases_device_memory_between() {
    let mut f = fixture(1 << 20, None);
    let (buf, data) = filled(&f, 4096, 1);
    let mut t = whole(&buf);
    let before = f.p.memory_stats().device_current;
    f.engine.offload([&mut t], &f.s).unwrap();
    assert_eq!(t.state(), SwapState::D2h);
    assert_eq!(
        buf.len(),
        4096,
        "device bytes are kept until the copy is known complete"
    );
    f.engine.finish_offload([&mut t]).unwrap();
    assert_eq!(t.state(), SwapState::Host);
    assert_eq!(f.p.memory_stats().device_current, before - 4096);
    f.engine.start_reload([&mut t]).unwrap();
    assert_eq!(t.state(), SwapState::H2d);
    f.engine.finish_reload([&mut t], &f.s).unwrap();
    assert_eq!(t.state(), SwapState::Device);
    assert_eq!(read(&f, &buf, 0, 4096), data);
    let st = f.engine.stats();
    assert_eq!((st.offloaded_bytes, st.reloaded_bytes), (4096, 4096));
}

#[test]
fn calls_in_the_wrong_state_are_typed_errors() {
    let mut f = fixture(1 << 20, None);
    let (buf, _) = filled(&f, 1024, 2);
    let mut t = whole(&buf);
    assert_eq!(
        wrong_state(f.engine.finish_offload([&mut t])),
        SwapState::Device
    );
    // Already at the target: a no-op, as hyper_parallel's wait_load on a loaded tensor.
    f.engine.finish_reload([&mut t], &f.s).unwrap();
    f.engine.offload([&mut t], &f.s).unwrap();
    assert!(matches!(
        t.get(),
        Err(SwapError::WrongState {
            actual: SwapState::D2h,
            ..
        })
    ));
    // A reload may not start before the offload finished.
    assert_eq!(wrong_state(f.engine.start_reload([&mut t])), SwapState::D2h);
    assert_eq!(
        wrong_state(f.engine.finish_reload([&mut t], &f.s)),
        SwapState::D2h
    );
    f.engine.finish_offload([&mut t]).unwrap();
    assert!(matches!(
        t.get(),
        Err(SwapError::WrongState {
            actual: SwapState::Host,
            ..
        })
    ));
    assert_eq!(
        wrong_state(f.engine.finish_reload([&mut t], &f.s)),
        SwapState::Host
    );
    assert_eq!(
        wrong_state(f.engine.cancel_offload([&mut t])),
        SwapState::Host
    );
    f.engine.start_reload([&mut t]).unwrap();
    assert_eq!(
        wrong_state(f.engine.offload([&mut t], &f.s)),
        SwapState::H2d
    );
    assert_eq!(
        wrong_state(f.engine.finish_offload([&mut t])),
        SwapState::H2d
    );
    f.engine.finish_reload([&mut t], &f.s).unwrap();
    assert!(t.get().is_ok());
}

#[test]
fn non_tensor_values_pass_through_every_call() {
    let mut f = fixture(1 << 20, None);
    let mut t = SwapTensor::new(Saved::Other(Arc::new("scale".to_string()))).unwrap();
    f.engine.offload([&mut t], &f.s).unwrap();
    f.engine.finish_offload([&mut t]).unwrap();
    f.engine.start_reload([&mut t]).unwrap();
    f.engine.finish_reload([&mut t], &f.s).unwrap();
    assert_eq!(t.state(), SwapState::NonTensor);
    let Saved::Other(v) = t.get().unwrap() else {
        panic!("not a tensor")
    };
    assert_eq!(v.downcast_ref::<String>().unwrap(), "scale");
    assert_eq!(f.engine.stats().offloaded_tensors, 0);
}

#[test]
fn a_tensor_modified_after_offload_is_refused_at_reload() {
    let mut f = fixture(1 << 20, None);
    let (buf, _) = filled(&f, 512, 3);
    let mut t = whole(&buf);
    let version = t.describe().unwrap().version.clone();
    f.engine.offload([&mut t], &f.s).unwrap();
    f.engine.finish_offload([&mut t]).unwrap();
    version.bump();
    let e = f.engine.start_reload([&mut t]).unwrap_err();
    assert_modified_once_since_offload(&e, "");
    assert_eq!(t.state(), SwapState::Host);
}

#[test]
fn a_storage_resized_after_offload_is_refused_at_reload() {
    let mut f = fixture(1 << 20, None);
    let (buf, _) = filled(&f, 512, 4);
    let mut t = whole(&buf);
    f.engine.offload([&mut t], &f.s).unwrap();
    f.engine.finish_offload([&mut t]).unwrap();
    f.p.resize_device(&buf, 100).unwrap();
    let e = f.engine.start_reload([&mut t]).unwrap_err();
    assert!(
        matches!(
            e,
            SwapError::StorageResized {
                expected: 512,
                actual: 100
            }
        ),
        "{e}"
    );
}

#[test]
fn views_copy_only_their_bytes_and_share_the_restored_storage() {
    let mut f = fixture(1 << 20, None);
    let (buf, data) = filled(&f, 4096, 5);
    let v1 = DeviceTensor::view(buf.clone(), 256, DType::F32, vec![64]).unwrap();
    let v2 = DeviceTensor::view(buf.clone(), 2048, DType::F32, vec![8, 8]).unwrap();
    assert!(DeviceTensor::view(buf.clone(), 4000, DType::F32, vec![64]).is_err());
    let mut ts = [Saved::Tensor(v1), Saved::Tensor(v2)].map(|s| SwapTensor::new(s).unwrap());
    f.engine.offload(ts.iter_mut(), &f.s).unwrap();
    f.engine.finish_offload(ts.iter_mut()).unwrap();
    assert_eq!(buf.len(), 0);
    assert_eq!(
        f.engine.pool_stats().bytes_held,
        256 + 256,
        "only the views' bytes were copied"
    );
    f.engine.start_reload(ts.iter_mut()).unwrap();
    f.engine.finish_reload(ts.iter_mut(), &f.s).unwrap();
    assert_eq!(buf.len(), 4096, "the whole storage is re-acquired");
    assert_eq!(read(&f, &buf, 256, 256), data[256..512]);
    assert_eq!(read(&f, &buf, 2048, 256), data[2048..2304]);
}

#[test]
fn reload_out_of_device_memory_keeps_the_host_copy_and_can_be_retried() {
    let mut f = fixture(64 << 10, None);
    let (a, da) = filled(&f, 16 << 10, 6);
    let (b, db) = filled(&f, 16 << 10, 7);
    let mut ts = [whole(&a), whole(&b)];
    f.engine.offload(ts.iter_mut(), &f.s).unwrap();
    f.engine.finish_offload(ts.iter_mut()).unwrap();
    // Something else took the memory meanwhile: room for one of the two.
    let filler = f.p.alloc_device(40 << 10).unwrap();
    let e = f.engine.start_reload(ts.iter_mut()).unwrap_err();
    assert_eq!(e.platform_kind(), Some(ErrorKind::OutOfMemory), "{e}");
    assert_eq!(
        [ts[0].state(), ts[1].state()],
        [SwapState::H2d, SwapState::Host]
    );
    f.p.free_device(&filler).unwrap();
    f.engine.start_reload(ts.iter_mut()).unwrap();
    f.engine.finish_reload(ts.iter_mut(), &f.s).unwrap();
    assert_eq!(read(&f, &a, 0, 16 << 10), da);
    assert_eq!(read(&f, &b, 0, 16 << 10), db);
}

#[test]
fn cancel_offload_keeps_the_device_bytes() {
    let mut f = fixture(1 << 20, None);
    let (buf, data) = filled(&f, 1024, 8);
    let mut t = whole(&buf);
    f.engine.offload([&mut t], &f.s).unwrap();
    f.engine.cancel_offload([&mut t]).unwrap();
    assert_eq!(t.state(), SwapState::Device);
    f.engine.synchronize().unwrap();
    assert_eq!(read(&f, &buf, 0, 1024), data);
    assert_eq!(f.engine.pool_stats().bytes_in_use, 0);
}

#[test]
fn pool_reuses_by_size_accounts_and_enforces_its_budget() {
    let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
    let pool = PinnedPool::new(
        Arc::clone(&p),
        PoolConfig {
            host_budget: Some(10_000),
        },
    );
    let a = pool.acquire(4000).unwrap();
    let b = pool.acquire(4000).unwrap();
    let e = pool.acquire(4000).err().expect("past the budget");
    assert!(
        matches!(
            e,
            SwapError::HostBudgetExceeded {
                requested: 4000,
                held: 8000,
                budget: 10_000
            }
        ),
        "{e}"
    );
    drop(a);
    let s = pool.stats();
    assert_eq!(
        (s.bytes_held, s.bytes_in_use, s.high_water),
        (8000, 4000, 8000)
    );
    let a = pool.acquire(4000).unwrap(); // hit
    drop((a, b));
    // A new size evicts idle blocks to stay within the budget.
    let c = pool.acquire(6000).unwrap();
    let s = pool.stats();
    assert_eq!((s.hits, s.misses, s.evictions), (1, 3, 1));
    assert_eq!(s.bytes_held, 10_000);
    pool.reset();
    let s = pool.stats();
    assert_eq!((s.hits, s.misses, s.high_water), (0, 0, 10_000));
    drop(c);
    pool.clear();
    assert_eq!(pool.stats().bytes_held, 0);
    assert_eq!(p.memory_stats().pinned_current, 0);
}

#[test]
fn engine_offload_past_the_host_budget_is_a_typed_error() {
    let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
    let s = p.create_stream().unwrap();
    let config = EngineConfig {
        pool: PoolConfig {
            host_budget: Some(1000),
        },
        ..Default::default()
    };
    let mut engine = SwapEngine::new(Arc::clone(&p), config).unwrap();
    let buf = p.alloc_device(2000).unwrap();
    let mut t = whole(&buf);
    let e = engine.offload([&mut t], &s).unwrap_err();
    assert!(matches!(e, SwapError::HostBudgetExceeded { .. }), "{e}");
    assert_eq!(t.state(), SwapState::Device);
}

/// One round of: start reloading tensor A, abandon its tracker while the reload is queued (its
/// pinned block returns to the pool), immediately offload tensor B of the same size (it gets
/// A's block), then read A. Returns whether A's bytes came back right: B's copy into the block
/// must wait for A's copy out of it, and nothing but the block's reuse wait orders the two.
fn reuse_round(jitter: u64, faults: Faults) -> bool {
    let mut f = fixture(1 << 20, Some(jitter));
    f.engine.set_faults(faults);
    let (a, da) = filled(&f, 8192, 9);
    let (b, _) = filled(&f, 8192, 10);
    let mut ta = whole(&a);
    f.engine.offload([&mut ta], &f.s).unwrap();
    f.engine.finish_offload([&mut ta]).unwrap();
    f.engine.start_reload([&mut ta]).unwrap();
    drop(ta);
    let mut tb = whole(&b);
    f.engine.offload([&mut tb], &f.s).unwrap();
    assert_eq!(f.engine.pool_stats().hits, 1, "B reused A's block");
    f.engine.synchronize().unwrap();
    read(&f, &a, 0, 8192) == da
}

#[test]
fn a_recycled_pinned_block_waits_for_its_last_reload() {
    for seed in jitter_seeds() {
        assert!(reuse_round(seed, Faults::default()), "jitter seed {seed}");
    }
    let faulty = Faults {
        skip_pinned_reuse_wait: true,
        ..Faults::default()
    };
    assert_some_seed_catches(
        |seed| !reuse_round(seed, faulty),
        "removing the pinned-reuse wait",
    );
}
