//! Every payload kind through the engine: borrowed framework memory with a test allocator,
//! compress-then-swap bit-exact for every float dtype and special value, out of memory during a
//! re-acquire, and modifications the reload must refuse.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use hprt_platform::{CpuBackend, CpuConfig, DType, DeviceBuffer, ErrorKind, Platform, Stream};
use hprt_swap::{
    Allocator, Compression, DeviceTensor, EngineConfig, Faults, Reacquired, Saved, SwapEngine,
    SwapError, SwapState, SwapTensor, VersionCounter,
};

mod common;
use common::{
    assert_modified_once_since_offload, assert_some_seed_catches, borrow_then, jitter_seeds,
    reacquired,
};

struct Fixture {
    p: Arc<dyn Platform>,
    s: Stream,
    engine: SwapEngine,
}

fn fixture(device_memory: usize, jitter: Option<u64>, compression: Compression) -> Fixture {
    let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig {
        device_memory,
        jitter,
        ..CpuConfig::default()
    }));
    let s = p.create_stream().unwrap();
    let config = EngineConfig {
        compression,
        ..EngineConfig::default()
    };
    let engine = SwapEngine::new(Arc::clone(&p), config).unwrap();
    Fixture { p, s, engine }
}

fn upload(f: &Fixture, data: &[u8]) -> DeviceBuffer {
    let buf = f.p.alloc_device(data.len()).unwrap();
    f.p.write_device_sync(&buf, 0, data, &f.s).unwrap();
    buf
}

fn download(f: &Fixture, t: &DeviceTensor) -> Vec<u8> {
    let mut out = vec![0u8; t.len];
    f.p.read_device_sync(&t.storage, t.offset, &mut out, &f.s)
        .unwrap();
    out
}

/// Borrowed memory standing for a framework tensor: `owner` stays alive until hprt lets go,
/// which sets `released`.
fn borrow(p: &dyn Platform, owner: DeviceBuffer, released: Arc<AtomicBool>) -> DeviceBuffer {
    borrow_then(p, owner, move || released.store(true, Ordering::SeqCst))
}

/// The test framework's allocator: new device memory, failing while `fail` is set.
struct TestAllocator {
    p: Arc<dyn Platform>,
    calls: AtomicUsize,
    fail: AtomicBool,
}

impl Allocator for TestAllocator {
    fn allocate(&self, like: &DeviceTensor) -> hprt_swap::Result<Reacquired> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.fail.load(Ordering::SeqCst) {
            // What a framework's allocator reports when the device is full.
            self.p.alloc_device(usize::MAX / 2)?;
        }
        let mem = self.p.alloc_device(like.len)?;
        Ok(Reacquired {
            handle: Some(Arc::new("reloaded")),
            ..reacquired(borrow(&*self.p, mem, Arc::default()))
        })
    }
}

fn allocator(p: &Arc<dyn Platform>) -> Arc<TestAllocator> {
    Arc::new(TestAllocator {
        p: Arc::clone(p),
        calls: AtomicUsize::new(0),
        fail: AtomicBool::new(false),
    })
}

fn elems(dtype: DType, data: &[u8]) -> Vec<usize> {
    vec![data.len() / dtype.size()]
}

/// Element `i`'s bits: every fifth element the next of the 12 `specials`, the others `bits`.
fn every_fifth_special<T: Copy>(i: usize, specials: &[T; 12], bits: T) -> T {
    if i % 5 == 0 {
        specials[i / 5 % 12]
    } else {
        bits
    }
}

/// Values of every class: NaNs with payloads (quiet and signalling, both signs), ±inf, ±0,
/// subnormals, extremes, and ordinary activations, interleaved.
fn float_patterns(dtype: DType, n: usize) -> Vec<u8> {
    let special32: [u32; 12] = [
        0x7fc0_0001,
        0xffc1_2345,
        0x7f80_0001,
        0xff80_0000,
        0x7f80_0000,
        0x0000_0000,
        0x8000_0000,
        0x0000_0001,
        0x807f_ffff,
        0x7f7f_ffff,
        0x0080_0000,
        0x3f80_0000,
    ];
    let special16: [u16; 12] = [
        0x7e01, 0xfd23, 0x7c01, 0xfc00, 0x7c00, 0x0000, 0x8000, 0x0001, 0x83ff, 0x7bff, 0x0400,
        0x3c00,
    ];
    let special_bf: [u16; 12] = [
        0x7fc1, 0xffa3, 0x7f81, 0xff80, 0x7f80, 0x0000, 0x8000, 0x0001, 0x807f, 0x7f7f, 0x0080,
        0x3f80,
    ];
    let mut out = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        let act = ((i % 97) as f32 - 48.0) * 0.03125;
        match dtype {
            DType::F32 => {
                let v = every_fifth_special(i, &special32, act.to_bits());
                out.extend_from_slice(&v.to_le_bytes());
            }
            DType::F16 => {
                let v = every_fifth_special(i, &special16, half::f16::from_f32(act).to_bits());
                out.extend_from_slice(&v.to_le_bytes());
            }
            DType::BF16 => {
                let v = every_fifth_special(i, &special_bf, half::bf16::from_f32(act).to_bits());
                out.extend_from_slice(&v.to_le_bytes());
            }
            other => panic!("{other} is not a float dtype"),
        }
    }
    out
}

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const COMPRESSED: [Compression; 2] = [Compression::Device, Compression::HostStage];

#[test]
fn compress_then_swap_is_bit_exact_for_every_float_dtype_and_special_value() {
    for compression in COMPRESSED {
        for dtype in FLOATS {
            for borrowed in [false, true] {
                let what = format!("{compression:?} {dtype} borrowed={borrowed}");
                let mut f = fixture(1 << 20, None, compression);
                let data = float_patterns(dtype, 8192);
                let buf = upload(&f, &data);
                let t = if borrowed {
                    let released = Arc::new(AtomicBool::new(false));
                    let storage = borrow(&*f.p, buf.clone(), released);
                    DeviceTensor::borrowed(
                        storage,
                        dtype,
                        elems(dtype, &data),
                        None,
                        allocator(&f.p),
                    )
                    .unwrap()
                } else {
                    DeviceTensor::whole(buf.clone(), dtype, elems(dtype, &data))
                };
                let mut t = SwapTensor::new(Saved::Tensor(t)).unwrap();
                f.engine.offload([&mut t], &f.s).unwrap();
                f.engine.finish_offload([&mut t]).unwrap();
                assert_eq!(t.describe().unwrap().storage.len(), 0, "{what}: released");
                f.engine.start_reload([&mut t]).unwrap();
                f.engine.finish_reload([&mut t], &f.s).unwrap();
                let back = download(&f, t.describe().unwrap());
                assert!(back == data, "{what}: bytes differ");
                let st = f.engine.stats();
                assert_eq!(st.compressed_tensors, 1, "{what}");
                assert!(st.compressed_bytes < data.len() as u64, "{what}: {st:?}");
                if compression == Compression::Device {
                    // Only the encoding crossed the link.
                    assert_eq!(st.link_d2h_bytes, st.compressed_bytes, "{what}");
                    assert_eq!(st.link_h2d_bytes, st.compressed_bytes, "{what}");
                }
            }
        }
    }
}

#[test]
fn host_stage_holds_no_pinned_memory_between_offload_and_reload() {
    let mut f = fixture(1 << 20, None, Compression::HostStage);
    let data = float_patterns(DType::F32, 16384);
    let buf = upload(&f, &data);
    let mut t = SwapTensor::new(Saved::Tensor(DeviceTensor::whole(
        buf,
        DType::F32,
        elems(DType::F32, &data),
    )))
    .unwrap();
    f.engine.offload([&mut t], &f.s).unwrap();
    f.engine.finish_offload([&mut t]).unwrap();
    assert_eq!(
        f.engine.pool_stats().bytes_in_use,
        0,
        "staging block returned"
    );
    assert!(t.link_bytes() == data.len());
}

#[test]
fn a_borrowed_payload_goes_back_to_its_framework_and_reloads_through_its_allocator() {
    for seed in jitter_seeds() {
        let mut f = fixture(1 << 20, Some(seed), Compression::Off);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + seed as u32) as u8).collect();
        let released = Arc::new(AtomicBool::new(false));
        let storage = borrow(&*f.p, upload(&f, &data), Arc::clone(&released));
        let alloc = allocator(&f.p);
        let t =
            DeviceTensor::borrowed(storage, DType::U8, vec![4096], None, alloc.clone()).unwrap();
        let mut t = SwapTensor::new(Saved::Tensor(t)).unwrap();
        f.engine.offload([&mut t], &f.s).unwrap();
        assert!(
            !released.load(Ordering::SeqCst),
            "held while the copy is queued"
        );
        f.engine.finish_offload([&mut t]).unwrap();
        assert!(
            released.load(Ordering::SeqCst),
            "seed {seed}: handed back after the copy"
        );
        f.engine.start_reload([&mut t]).unwrap();
        f.engine.finish_reload([&mut t], &f.s).unwrap();
        assert_eq!(alloc.calls.load(Ordering::SeqCst), 1);
        let back = t.get().unwrap().tensor().unwrap();
        let handle = back.handle.as_ref().unwrap().downcast_ref::<&str>();
        assert_eq!(handle, Some(&"reloaded"));
        assert!(download(&f, back) == data, "seed {seed}");
    }
}

/// torch's caching allocator, reduced to what a reload meets: the block it hands out was freed
/// by work still queued on the compute stream (here: a delayed fill with 0xEE, the last write
/// of the block's previous tensor), for use in that stream's order.
struct CachingAllocator {
    p: Arc<dyn Platform>,
    compute: Stream,
    block: DeviceBuffer,
}

impl Allocator for CachingAllocator {
    fn allocate(&self, _like: &DeviceTensor) -> hprt_swap::Result<Reacquired> {
        let s = &self.compute;
        self.p
            .launch_host_fn(
                s,
                Box::new(|| std::thread::sleep(std::time::Duration::from_millis(30))),
            )
            .unwrap();
        self.p
            .memset_async(&self.block, 0, 0xEE, self.block.len(), s)
            .unwrap();
        Ok(Reacquired {
            ready_on: Some(s.clone()),
            ..reacquired(borrow(&*self.p, self.block.clone(), Arc::default()))
        })
    }
}

#[test]
fn a_reload_into_a_caching_allocators_block_waits_for_the_work_queued_before_it() {
    // Without the wait the copy lands first and the queued fill overwrites it (what an H100
    // showed under torch: NaN gradients and device-side asserts from reloaded indices).
    for seed in [None]
        .into_iter()
        .chain(jitter_seeds().into_iter().map(Some))
    {
        let mut f = fixture(1 << 20, seed, Compression::Off);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 1) as u8).collect();
        let alloc = Arc::new(CachingAllocator {
            p: Arc::clone(&f.p),
            compute: f.s.clone(),
            block: f.p.alloc_device(data.len()).unwrap(),
        });
        let storage = borrow(&*f.p, upload(&f, &data), Arc::default());
        let t = DeviceTensor::borrowed(storage, DType::U8, vec![4096], None, alloc).unwrap();
        let mut t = SwapTensor::new(Saved::Tensor(t)).unwrap();
        f.engine.offload([&mut t], &f.s).unwrap();
        f.engine.finish_offload([&mut t]).unwrap();
        f.engine.start_reload([&mut t]).unwrap();
        f.engine.finish_reload([&mut t], &f.s).unwrap();
        let back = t.get().unwrap().tensor().unwrap();
        assert!(download(&f, back) == data, "jitter {seed:?}");
    }
}

fn oom_round(compression: Compression, borrowed: bool) {
    let what = format!("{compression:?} borrowed={borrowed}");
    let mut f = fixture(256 << 10, None, compression);
    let data = float_patterns(DType::F32, 16384); // 64 KiB
    let buf = upload(&f, &data);
    let alloc = allocator(&f.p);
    let t = if borrowed {
        let storage = borrow(&*f.p, buf, Arc::default());
        DeviceTensor::borrowed(
            storage,
            DType::F32,
            elems(DType::F32, &data),
            None,
            alloc.clone(),
        )
        .unwrap()
    } else {
        DeviceTensor::whole(buf, DType::F32, elems(DType::F32, &data))
    };
    let mut t = SwapTensor::new(Saved::Tensor(t)).unwrap();
    f.engine.offload([&mut t], &f.s).unwrap();
    f.engine.finish_offload([&mut t]).unwrap();
    f.p.synchronize_device().unwrap();
    // The device filled up meanwhile.
    let free = f.p.mem_info().unwrap().free;
    let filler = f.p.alloc_device(free - 1024).unwrap();
    let e = f.engine.start_reload([&mut t]).unwrap_err();
    assert_eq!(
        e.platform_kind(),
        Some(ErrorKind::OutOfMemory),
        "{what}: {e}"
    );
    assert_eq!(t.state(), SwapState::Host, "{what}");
    assert!(t.link_bytes() > 0, "{what}: the host copy is kept");
    f.p.free_device(&filler).unwrap();
    f.engine.start_reload([&mut t]).unwrap();
    f.engine.finish_reload([&mut t], &f.s).unwrap();
    assert!(download(&f, t.describe().unwrap()) == data, "{what}");
}

#[test]
fn out_of_memory_during_a_reacquire_keeps_the_host_copy_and_a_retry_succeeds() {
    for compression in [
        Compression::Off,
        Compression::Device,
        Compression::HostStage,
    ] {
        for borrowed in [false, true] {
            oom_round(compression, borrowed);
        }
    }
}

#[test]
fn a_failing_framework_allocator_keeps_the_host_copy() {
    let mut f = fixture(1 << 20, None, Compression::HostStage);
    let data = float_patterns(DType::BF16, 4096);
    let alloc = allocator(&f.p);
    let storage = borrow(&*f.p, upload(&f, &data), Arc::default());
    let t = DeviceTensor::borrowed(
        storage,
        DType::BF16,
        elems(DType::BF16, &data),
        None,
        alloc.clone(),
    )
    .unwrap();
    let mut t = SwapTensor::new(Saved::Tensor(t)).unwrap();
    f.engine.offload([&mut t], &f.s).unwrap();
    f.engine.finish_offload([&mut t]).unwrap();
    alloc.fail.store(true, Ordering::SeqCst);
    assert!(f.engine.start_reload([&mut t]).is_err());
    assert_eq!(t.state(), SwapState::Host);
    alloc.fail.store(false, Ordering::SeqCst);
    f.engine.start_reload([&mut t]).unwrap();
    f.engine.finish_reload([&mut t], &f.s).unwrap();
    assert!(download(&f, t.describe().unwrap()) == data);
}

#[test]
fn a_storage_reacquired_and_written_outside_swap_is_refused_at_reload() {
    let mut f = fixture(1 << 20, None, Compression::Off);
    let buf = upload(&f, &[5u8; 512]);
    let mut t = SwapTensor::new(Saved::Tensor(DeviceTensor::whole(
        buf.clone(),
        DType::U8,
        vec![512],
    )))
    .unwrap();
    f.engine.offload([&mut t], &f.s).unwrap();
    f.engine.finish_offload([&mut t]).unwrap();
    // Someone resizes the released storage back (same size) and writes it.
    f.p.resize_device(&buf, 512).unwrap();
    f.p.write_device_sync(&buf, 0, &[9u8; 512], &f.s).unwrap();
    let e = f.engine.start_reload([&mut t]).unwrap_err();
    assert!(matches!(e, SwapError::ReacquiredOutsideSwap), "{e}");
    let mut now = vec![0u8; 512];
    f.p.read_device_sync(&buf, 0, &mut now, &f.s).unwrap();
    assert_eq!(
        now,
        vec![9u8; 512],
        "the other writer's bytes are left alone"
    );
}

#[test]
fn a_write_during_an_in_flight_offload_is_reported_at_reload() {
    for borrowed in [false, true] {
        let mut f = fixture(1 << 20, None, Compression::Off);
        let buf = upload(&f, &[1u8; 1024]);
        let version = VersionCounter::new();
        let mut t = if borrowed {
            let storage = borrow(&*f.p, buf, Arc::default());
            DeviceTensor::borrowed(storage, DType::U8, vec![1024], None, allocator(&f.p)).unwrap()
        } else {
            DeviceTensor::whole(buf, DType::U8, vec![1024])
        };
        t.version = version.clone();
        let mut t = SwapTensor::new(Saved::Tensor(t)).unwrap();
        f.engine.offload([&mut t], &f.s).unwrap();
        version.bump(); // the framework wrote the tensor while its copy was queued
        f.engine.finish_offload([&mut t]).unwrap();
        let e = f.engine.start_reload([&mut t]).unwrap_err();
        assert_modified_once_since_offload(&e, &format!("borrowed={borrowed}: "));
    }
}

#[test]
fn a_borrowed_payload_is_not_watched_after_its_memory_went_back() {
    // The documented guarantee: once released, the memory is the framework's; a later write
    // through another reference is the framework's to check (torch checks saved versions).
    let mut f = fixture(1 << 20, None, Compression::Off);
    let storage = borrow(&*f.p, upload(&f, &[3u8; 256]), Arc::default());
    let version = VersionCounter::new();
    let mut t =
        DeviceTensor::borrowed(storage, DType::U8, vec![256], None, allocator(&f.p)).unwrap();
    t.version = version.clone();
    let mut t = SwapTensor::new(Saved::Tensor(t)).unwrap();
    f.engine.offload([&mut t], &f.s).unwrap();
    f.engine.finish_offload([&mut t]).unwrap();
    version.bump();
    f.engine.start_reload([&mut t]).unwrap();
    f.engine.finish_reload([&mut t], &f.s).unwrap();
    assert_eq!(download(&f, t.describe().unwrap()), vec![3u8; 256]);
}

#[test]
fn a_per_tensor_policy_chooses_the_compression() {
    let mut f = fixture(1 << 20, None, Compression::Off);
    f.engine
        .set_compression_policy(Some(Arc::new(|t: &DeviceTensor| {
            if t.len >= 4096 {
                Compression::Device
            } else {
                Compression::Off
            }
        })));
    let (big, small) = (
        float_patterns(DType::F32, 2048),
        float_patterns(DType::F32, 64),
    );
    let mut ts: Vec<SwapTensor> = [&big, &small]
        .into_iter()
        .map(|d| {
            let t = DeviceTensor::whole(upload(&f, d), DType::F32, elems(DType::F32, d));
            SwapTensor::new(Saved::Tensor(t)).unwrap()
        })
        .collect();
    f.engine.offload(ts.iter_mut(), &f.s).unwrap();
    f.engine.finish_offload(ts.iter_mut()).unwrap();
    assert!(
        ts[0].host_bytes() < big.len(),
        "the large tensor is kept compressed"
    );
    assert_eq!(ts[1].host_bytes(), small.len(), "the small one raw");
    f.engine.start_reload(ts.iter_mut()).unwrap();
    f.engine.finish_reload(ts.iter_mut(), &f.s).unwrap();
    assert!(download(&f, ts[0].describe().unwrap()) == big);
    assert!(download(&f, ts[1].describe().unwrap()) == small);
    assert_eq!(f.engine.stats().compressed_tensors, 1);
}

/// One round of the pinned-reuse race for one payload kind: start reloading tensor A, abandon
/// its tracker while the reload is queued (its pinned block returns to the pool), offload
/// tensor B of the same size (which gets that block), then read A's reloaded bytes. Returns
/// whether they came back right: nothing but the block's reuse wait orders B's write into the
/// block after A's read from it (with the device codec, a compressed block; with the host
/// stage, the staging block of A's decode).
fn reuse_round(seed: u64, faults: Faults, compression: Compression, borrowed: bool) -> bool {
    let mut f = fixture(1 << 20, Some(seed), compression);
    f.engine.set_faults(faults);
    let values = |k: f32| -> Vec<u8> {
        (0..2048)
            .flat_map(|i| ((i % 61) as f32 * 0.25 + k).to_le_bytes())
            .collect()
    };
    let (da, db) = (values(1.0), values(2.0));
    let made = Arc::new(Mutex::new(Vec::new()));
    let alloc: Arc<dyn Allocator> = {
        let (p, made) = (Arc::clone(&f.p), Arc::clone(&made));
        Arc::new(move |like: &DeviceTensor| {
            let storage = borrow(&*p, p.alloc_device(like.len)?, Arc::default());
            made.lock().unwrap().push(storage.clone());
            Ok(reacquired(storage))
        })
    };
    let tensor = |data: &[u8]| {
        let buf = upload(&f, data);
        let t = if borrowed {
            let storage = borrow(&*f.p, buf.clone(), Arc::default());
            DeviceTensor::borrowed(storage, DType::F32, vec![2048], None, alloc.clone()).unwrap()
        } else {
            DeviceTensor::whole(buf.clone(), DType::F32, vec![2048])
        };
        (buf, SwapTensor::new(Saved::Tensor(t)).unwrap())
    };
    let (a, mut ta) = tensor(&da);
    let (_b, mut tb) = tensor(&db);
    f.engine.offload([&mut ta], &f.s).unwrap();
    f.engine.finish_offload([&mut ta]).unwrap();
    // A's copy out of the block is held behind a gate on the reload stream until B's offload
    // had time to run, so a missing reuse wait shows up on every seed. Not for the host stage:
    // there A's reload first decodes into the block, then copies out of it, and B's write
    // corrupts A only between the two, which a gate before both cannot produce (the jitter
    // does).
    let gate = Arc::new((
        Mutex::new(compression == Compression::HostStage),
        Condvar::new(),
    ));
    let g = Arc::clone(&gate);
    f.p.launch_host_fn(
        f.engine.h2d_stream(),
        Box::new(move || {
            let (open, cv) = &*g;
            let mut open = open.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
        }),
    )
    .unwrap();
    f.engine.start_reload([&mut ta]).unwrap();
    drop(ta);
    let hits = f.engine.pool_stats().hits;
    f.engine.offload([&mut tb], &f.s).unwrap();
    assert!(
        f.engine.pool_stats().hits > hits,
        "{compression:?} borrowed={borrowed}: B reused A's block"
    );
    std::thread::sleep(std::time::Duration::from_millis(20));
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
    f.engine.synchronize().unwrap();
    f.p.synchronize_device().unwrap();
    let reloaded = if borrowed {
        made.lock().unwrap()[0].clone()
    } else {
        a
    };
    let mut out = vec![0u8; da.len()];
    f.p.read_device_sync(&reloaded, 0, &mut out, &f.s).unwrap();
    out == da
}

#[test]
fn a_recycled_pinned_block_waits_for_its_last_reload_for_every_payload_kind() {
    let faulty = Faults {
        skip_pinned_reuse_wait: true,
        ..Faults::default()
    };
    for compression in [
        Compression::Off,
        Compression::Device,
        Compression::HostStage,
    ] {
        for borrowed in [false, true] {
            let what = format!("{compression:?} borrowed={borrowed}");
            for seed in jitter_seeds() {
                assert!(
                    reuse_round(seed, Faults::default(), compression, borrowed),
                    "{what}: jitter seed {seed}"
                );
            }
            assert_some_seed_catches(
                |seed| !reuse_round(seed, faulty, compression, borrowed),
                &format!("{what}: removing the pinned-reuse wait"),
            );
        }
    }
}

/// f64 has no codec: with compression on, an f64 tensor (NaN payloads, infinities, subnormals
/// included) travels as raw bytes and comes back bit-exact.
#[test]
fn f64_tensors_travel_raw_under_compression_and_come_back_bit_exact() {
    let special: [u64; 8] = [
        0x7ff8_0000_0000_0001,
        0xfff4_0000_dead_beef,
        0x7ff0_0000_0000_0000,
        0x8000_0000_0000_0000,
        0x0000_0000_0000_0001,
        0x800f_ffff_ffff_ffff,
        0x7fef_ffff_ffff_ffff,
        0x3ff0_0000_0000_0000,
    ];
    let data: Vec<u8> = (0..4096)
        .flat_map(|i| {
            let v = if i % 3 == 0 {
                special[i / 3 % 8]
            } else {
                (i as f64 * 0.125 - 7.0).to_bits()
            };
            v.to_le_bytes()
        })
        .collect();
    for compression in [
        Compression::Device,
        Compression::HostStage,
        Compression::Auto,
    ] {
        let mut f = fixture(1 << 20, None, compression);
        let buf = upload(&f, &data);
        let t = DeviceTensor::whole(buf, DType::F64, vec![4096]);
        let mut t = SwapTensor::new(Saved::Tensor(t)).unwrap();
        f.engine.offload([&mut t], &f.s).unwrap();
        f.engine.finish_offload([&mut t]).unwrap();
        f.engine.start_reload([&mut t]).unwrap();
        f.engine.finish_reload([&mut t], &f.s).unwrap();
        assert!(
            download(&f, t.describe().unwrap()) == data,
            "{compression:?}"
        );
        let st = f.engine.stats();
        assert_eq!(st.compressed_tensors, 0, "{compression:?}");
        assert_eq!(st.link_d2h_bytes, data.len() as u64, "{compression:?}");
    }
}
