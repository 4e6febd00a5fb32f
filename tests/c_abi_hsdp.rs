//! Sharded parameters through the C ABI, one thread per rank on an opened cpu platform: the
//! shard each rank keeps, the full parameter after unshard, and the reduce-scattered (and, for
//! HSDP, all-reduced) gradients, each compared with a host reference; lifecycle and argument
//! errors as typed statuses.
//!
//! (Over 800 lines because every mesh kind — FSDP, HSDP, DDP — has its cases and host reference.)

use std::ptr;

use hprt::ffi::*;

mod common;
use common::*;

/// One rank thread's handles.
struct Rank {
    p: *const HprtPlatform,
    s: *mut HprtStream,
    comm: *mut HprtComm,
    rank: usize,
    world: usize,
}

impl Rank {
    /// A device buffer holding `bytes`, written in compute-stream order.
    fn upload(&self, bytes: &[u8]) -> *mut HprtDeviceBuffer {
        // SAFETY: handles made here are live; the staging buffer outlives the synchronize.
        unsafe {
            let (mut dev, mut host, mut hp) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
            ok(hprt_device_alloc(self.p, bytes.len(), &mut dev));
            ok(hprt_pinned_alloc(self.p, bytes.len(), &mut host));
            ok(hprt_pinned_info(host, &mut hp, ptr::null_mut()));
            std::slice::from_raw_parts_mut(hp.cast::<u8>(), bytes.len()).copy_from_slice(bytes);
            let d = HprtMemRef {
                device: dev,
                pinned: ptr::null(),
                offset: 0,
            };
            let h = HprtMemRef {
                device: ptr::null(),
                pinned: host,
                offset: 0,
            };
            ok(hprt_copy_async(self.p, d, h, bytes.len(), self.s));
            ok(hprt_stream_synchronize(self.p, self.s));
            ok(hprt_pinned_free(self.p, host));
            dev
        }
    }

    /// Reads `bytes` at a device address (what the hsdp calls return) after the compute
    /// stream's queued work, the way a framework would: wrapped, then copied to pinned memory.
    fn download(&self, address: usize, bytes: usize) -> Vec<u8> {
        // SAFETY: `address..+bytes` is live device memory of this platform during the call.
        unsafe {
            let (mut dev, mut host, mut hp) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
            ok(hprt_device_wrap(
                self.p,
                address,
                bytes,
                None,
                ptr::null_mut(),
                &mut dev,
            ));
            ok(hprt_pinned_alloc(self.p, bytes, &mut host));
            let d = HprtMemRef {
                device: dev,
                pinned: ptr::null(),
                offset: 0,
            };
            let h = HprtMemRef {
                device: ptr::null(),
                pinned: host,
                offset: 0,
            };
            ok(hprt_copy_async(self.p, h, d, bytes, self.s));
            ok(hprt_stream_synchronize(self.p, self.s));
            ok(hprt_pinned_info(host, &mut hp, ptr::null_mut()));
            let out = std::slice::from_raw_parts(hp.cast::<u8>(), bytes).to_vec();
            ok(hprt_pinned_free(self.p, host));
            ok(hprt_device_free(self.p, dev));
            out
        }
    }

    fn view(&self, v: HprtShardView) -> Vec<f32> {
        assert!(!v.host, "no offload was asked for");
        f32s(&self.download(v.address, v.bytes))
    }

    fn hsdp(&self, mode: HprtDpMode, shape: &[usize]) -> *mut HprtHsdp {
        let mut h = ptr::null_mut();
        // SAFETY: live handles, `shape` readable for its length.
        ok(unsafe {
            hprt_hsdp_create(
                self.p,
                self.comm,
                mode as i32,
                shape.as_ptr(),
                shape.len(),
                self.s,
                &mut h,
            )
        });
        h
    }
}

/// An f32 parameter of `shape` sharded from `src` (at offset 0) with `config` (null: defaults).
///
/// # Safety
/// `h` and `src` live; `config` null or readable.
unsafe fn f32_param(
    h: *const HprtHsdp,
    name: &std::ffi::CStr,
    shape: &[usize],
    config: *const HprtHsdpParamConfig,
    src: *const HprtDeviceBuffer,
) -> *mut HprtHsdpParam {
    let mut w = ptr::null_mut();
    // SAFETY: the caller's contract; `name` and `shape` are live for the call.
    ok(unsafe {
        hprt_hsdp_param_create(
            h,
            name.as_ptr(),
            shape.as_ptr(),
            shape.len(),
            HprtDtype::F32 as i32,
            config,
            src,
            0,
            &mut w,
        )
    });
    w
}

/// Runs `f` on `world` rank threads of one opened cpu platform, each with its own compute
/// stream and world communicator, and checks every device byte was released at the end.
fn run_ranks(world: usize, f: impl Fn(&Rank) + Sync) {
    let mut p = ptr::null_mut();
    // SAFETY: a NUL-terminated request and a valid out-pointer.
    ok(unsafe { hprt_platform_open(c"cpu".as_ptr(), &mut p) });
    let mut id = [0u8; HPRT_UNIQUE_ID_MAX_BYTES];
    let mut len = 0;
    // SAFETY: `id` has the capacity passed.
    ok(unsafe { hprt_unique_id(p, id.as_mut_ptr(), id.len(), &mut len) });
    let pa = p as usize;
    std::thread::scope(|sc| {
        for rank in 0..world {
            let (f, id) = (&f, &id[..len]);
            sc.spawn(move || {
                let p = pa as *const HprtPlatform;
                let (mut s, mut comm) = (ptr::null_mut(), ptr::null_mut());
                // SAFETY: handles made here, released once after `f`.
                unsafe {
                    ok(hprt_stream_create(p, &mut s));
                    ok(hprt_comm_init(
                        p,
                        id.as_ptr(),
                        id.len(),
                        rank,
                        world,
                        &mut comm,
                    ));
                    f(&Rank {
                        p,
                        s,
                        comm,
                        rank,
                        world,
                    });
                    ok(hprt_stream_synchronize(p, s));
                    ok(hprt_comm_destroy(p, comm));
                    ok(hprt_stream_destroy(p, s));
                }
            });
        }
    });
    // Peers drop their references to a rank's buffers as their queued collectives finish.
    let mut stats = HprtMemoryStats::default();
    for _ in 0..2000 {
        // SAFETY: live platform, valid out-pointer.
        ok(unsafe { hprt_platform_memory_stats(p, &mut stats) });
        if stats.device_current == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(stats.device_current, 0, "device bytes left behind");
    // SAFETY: closed once, after every object made from it.
    ok(unsafe { hprt_platform_close(p) });
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn bf16s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
        .collect()
}

/// Shard `k` of `shards` along dim 0 of a `rows × cols` row-major tensor, zero padded.
fn rows_shard(full: &[f32], rows: usize, cols: usize, shards: usize, k: usize) -> Vec<f32> {
    let chunk = rows.div_ceil(shards);
    (0..chunk * cols)
        .map(|i| {
            let row = k * chunk + i / cols;
            if row < rows {
                full[row * cols + i % cols]
            } else {
                0.0
            }
        })
        .collect()
}

fn param_full(n: usize) -> Vec<f32> {
    (0..n).map(|i| 1.0 + i as f32 * 0.5).collect()
}

/// Rank `r`'s gradient: distinct per rank, exact in f32 when summed.
fn grad_of(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (r as f32 + 1.0) * (i as f32 - 3.0) * 0.25)
        .collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}[{i}]: {g} != {w}"
        );
    }
}

fn info(param: *const HprtHsdpParam) -> HprtHsdpParamInfo {
    let mut i = std::mem::MaybeUninit::<HprtHsdpParamInfo>::uninit();
    // SAFETY: live parameter, writable out-pointer; initialized on success.
    unsafe {
        ok(hprt_hsdp_param_info(param, i.as_mut_ptr()));
        i.assume_init()
    }
}

/// A `rows × cols` f32 parameter through create, unshard, shard and one gradient reduction
/// on every rank, each step compared with the host reference.
fn check_rows(mode: HprtDpMode, mesh: &[usize], rows: usize, cols: usize, async_reduce: bool) {
    let world: usize = mesh.iter().product();
    let shards = *mesh.last().unwrap();
    let n = rows * cols;
    let full = param_full(n);
    run_ranks(world, |rk| {
        let h = rk.hsdp(mode, mesh);
        let mut hi = std::mem::MaybeUninit::<HprtHsdpInfo>::uninit();
        // SAFETY: every handle below is made here, used while live and released once.
        unsafe {
            ok(hprt_hsdp_info(h, hi.as_mut_ptr()));
            let hi = hi.assume_init();
            assert_eq!((hi.mode, hi.rank, hi.world_size), (mode, rk.rank, rk.world));
            assert_eq!(hi.shard_size * hi.replicate_size, world);

            let src = rk.upload(&bytes(&full));
            let w = f32_param(h, c"w", &[rows, cols], ptr::null(), src);
            ok(hprt_device_free(rk.p, src));
            let i = info(w);
            let k = rk.rank % shards;
            assert_eq!(i.state, HprtParamState::Sharded);
            assert!(i.is_sharded && i.numel == n);
            assert_eq!((i.shard_index, i.shard_count), (k, shards));
            assert_eq!(i.rows_per_shard, rows.div_ceil(shards));
            let mut v = HprtShardView::default();
            ok(hprt_hsdp_param_sharded_data(w, &mut v));
            let want = rows_shard(&full, rows, cols, shards, k);
            assert_close("shard", &rk.view(v), &want);

            // Prefetch, then wait: the full parameter on every rank.
            let (mut addr, mut len) = (0, 0);
            ok(hprt_hsdp_param_unshard(w, true));
            assert_eq!(info(w).state, HprtParamState::Unsharding);
            expect(
                hprt_hsdp_param_unsharded(w, &mut addr, &mut len),
                HprtStatus::ErrorWrongState,
            );
            ok(hprt_hsdp_param_wait_for_unshard(w));
            ok(hprt_hsdp_param_unsharded(w, &mut addr, &mut len));
            assert_eq!(len, 4 * n);
            assert_close("unsharded", &f32s(&rk.download(addr, len)), &full);
            ok(hprt_hsdp_param_shard(w));
            assert_eq!(info(w).state, HprtParamState::Sharded);
            expect(
                hprt_hsdp_param_unsharded(w, &mut addr, &mut len),
                HprtStatus::ErrorWrongState,
            );

            // Averaged gradients: the mean over every rank, reduce-scattered to the shard.
            expect(
                hprt_hsdp_param_sharded_grad(w, &mut v),
                HprtStatus::ErrorWrongState,
            );
            let g = rk.upload(&bytes(&grad_of(rk.rank, n)));
            let avg = HprtReduceOp::Avg as i32;
            ok(hprt_hsdp_param_reduce_grad(
                w,
                g,
                0,
                HprtDtype::F32 as i32,
                avg,
                1.0,
                async_reduce,
            ));
            if async_reduce {
                ok(hprt_hsdp_param_wait_for_reduce(w));
            }
            let mean: Vec<f32> = (0..n)
                .map(|i| (0..world).map(|r| grad_of(r, n)[i]).sum::<f32>() / world as f32)
                .collect();
            ok(hprt_hsdp_param_sharded_grad(w, &mut v));
            assert_close(
                "avg grad",
                &rk.view(v),
                &rows_shard(&mean, rows, cols, shards, k),
            );

            // A second, summed and scaled reduction accumulates into the same gradient.
            let sum = HprtReduceOp::Sum as i32;
            ok(hprt_hsdp_param_reduce_grad(
                w,
                g,
                0,
                HprtDtype::F32 as i32,
                sum,
                0.5,
                async_reduce,
            ));
            if async_reduce {
                ok(hprt_hsdp_param_wait_for_reduce(w));
            }
            let both: Vec<f32> = mean.iter().map(|m| m + m * world as f32 * 0.5).collect();
            ok(hprt_hsdp_param_sharded_grad(w, &mut v));
            assert_close(
                "accumulated grad",
                &rk.view(v),
                &rows_shard(&both, rows, cols, shards, k),
            );
            ok(hprt_hsdp_param_clear_grad(w));
            expect(
                hprt_hsdp_param_sharded_grad(w, &mut v),
                HprtStatus::ErrorWrongState,
            );

            ok(hprt_stream_synchronize(rk.p, rk.s));
            ok(hprt_device_free(rk.p, g));
            ok(hprt_hsdp_param_destroy(w));
            ok(hprt_hsdp_destroy(h));
        }
    });
}

#[test]
fn fsdp_unshard_and_averaged_reduce_scatter_on_4_ranks() {
    // 7 rows over 4 ranks: uneven, the last shard half padding.
    check_rows(HprtDpMode::Fsdp, &[4], 7, 3, false);
}

#[test]
fn fsdp_async_reduce_on_3_ranks() {
    check_rows(HprtDpMode::Fsdp, &[3], 5, 2, true);
}

#[test]
fn hsdp_2x2_reduces_across_replicas_too() {
    check_rows(HprtDpMode::Hsdp, &[2, 2], 6, 4, true);
}

#[test]
fn ddp_keeps_the_whole_parameter_and_all_reduces() {
    let (rows, cols, world) = (3, 2, 2);
    let full = param_full(rows * cols);
    run_ranks(world, |rk| {
        let h = rk.hsdp(HprtDpMode::Ddp, &[world]);
        // SAFETY: handles made here, used while live, released once.
        unsafe {
            let src = rk.upload(&bytes(&full));
            let w = f32_param(h, c"bias", &[rows, cols], ptr::null(), src);
            let i = info(w);
            assert!(!i.is_sharded);
            assert_eq!((i.shard_count, i.shard_numel), (1, rows * cols));
            let g = rk.upload(&bytes(&grad_of(rk.rank, rows * cols)));
            let sum = HprtReduceOp::Sum as i32;
            ok(hprt_hsdp_param_reduce_grad(w, g, 0, 0, sum, 1.0, false));
            let want: Vec<f32> = (0..rows * cols)
                .map(|i| grad_of(0, 6)[i] + grad_of(1, 6)[i])
                .collect();
            let mut v = HprtShardView::default();
            ok(hprt_hsdp_param_sharded_grad(w, &mut v));
            assert_close("ddp grad", &rk.view(v), &want);
            ok(hprt_stream_synchronize(rk.p, rk.s));
            for b in [src, g] {
                ok(hprt_device_free(rk.p, b));
            }
            ok(hprt_hsdp_param_destroy(w));
            ok(hprt_hsdp_destroy(h));
        }
    });
}

/// Shard(1) with a bf16 all-gather and f32 gradient reduction: the gathered parameter is
/// re-interleaved and rounded to bf16, the gradient shard holds columns.
#[test]
fn shard_dim_1_with_bf16_gather() {
    let (rows, cols, world) = (3, 5, 2);
    let n = rows * cols;
    // Small integers: exact in bf16.
    let full: Vec<f32> = (0..n).map(|i| i as f32 - 4.0).collect();
    run_ranks(world, |rk| {
        let h = rk.hsdp(HprtDpMode::Fsdp, &[world]);
        // SAFETY: handles made here, used while live, released once.
        unsafe {
            let src = rk.upload(&bytes(&full));
            let config = HprtHsdpParamConfig {
                shard_dim: 1,
                param_dtype: HprtDtype::Bf16 as i32,
                reduce_dtype: HprtDtype::F32 as i32,
                threshold: 0,
                offload_to_host: false,
            };
            let w = f32_param(h, c"proj", &[rows, cols], &config, src);
            let i = info(w);
            assert_eq!((i.shard_dim, i.rows_per_shard, i.shard_numel), (1, 3, 9));
            assert_eq!(i.param_dtype, HprtDtype::Bf16 as i32);
            assert_eq!(i.reduce_dtype, HprtDtype::F32 as i32);
            // The shard holds columns rank*3 .. rank*3+3 of every row (column 5 is padding).
            let mut v = HprtShardView::default();
            ok(hprt_hsdp_param_sharded_data(w, &mut v));
            let want: Vec<f32> = (0..rows)
                .flat_map(|r| (0..3).map(move |c| (r, rk.rank * 3 + c)))
                .map(|(r, c)| if c < cols { full[r * cols + c] } else { 0.0 })
                .collect();
            assert_close("column shard", &rk.view(v), &want);

            ok(hprt_hsdp_param_unshard(w, false));
            let (mut addr, mut len) = (0, 0);
            ok(hprt_hsdp_param_unsharded(w, &mut addr, &mut len));
            assert_eq!(len, 2 * n, "bf16 elements");
            assert_close("bf16 unsharded", &bf16s(&rk.download(addr, len)), &full);
            ok(hprt_hsdp_param_shard(w));
            ok(hprt_stream_synchronize(rk.p, rk.s));
            ok(hprt_device_free(rk.p, src));
            ok(hprt_hsdp_param_destroy(w));
            ok(hprt_hsdp_destroy(h));
        }
    });
}

#[test]
fn bad_arguments_and_wrong_states_are_typed_errors() {
    run_ranks(2, |rk| {
        // SAFETY: null and invalid arguments must be reported, never dereferenced.
        unsafe {
            let mut h = ptr::null_mut();
            let two = [2usize];
            let fsdp = HprtDpMode::Fsdp as i32;
            let null = HprtStatus::ErrorNullArgument;
            let invalid = HprtStatus::ErrorInvalidValue;
            expect(
                hprt_hsdp_create(rk.p, ptr::null(), fsdp, two.as_ptr(), 1, rk.s, &mut h),
                null,
            );
            assert!(last_error().contains("world"), "{}", last_error());
            expect(
                hprt_hsdp_create(rk.p, rk.comm, fsdp, ptr::null(), 1, rk.s, &mut h),
                null,
            );
            expect(
                hprt_hsdp_create(rk.p, rk.comm, fsdp, two.as_ptr(), 1, rk.s, ptr::null_mut()),
                null,
            );
            expect(
                hprt_hsdp_create(rk.p, rk.comm, 7, two.as_ptr(), 1, rk.s, &mut h),
                invalid,
            );
            let four = [4usize];
            expect(
                hprt_hsdp_create(rk.p, rk.comm, fsdp, four.as_ptr(), 1, rk.s, &mut h),
                invalid,
            );
            assert!(last_error().contains("4 ranks"), "{}", last_error());
            // HSDP needs a 2-D mesh.
            let hsdp = HprtDpMode::Hsdp as i32;
            expect(
                hprt_hsdp_create(rk.p, rk.comm, hsdp, two.as_ptr(), 1, rk.s, &mut h),
                invalid,
            );
            assert!(h.is_null(), "out-pointers are written only on success");

            let h = rk.hsdp(HprtDpMode::Fsdp, &two);
            let src = rk.upload(&bytes(&param_full(8)));
            let shape = [8usize];
            let f32_ = HprtDtype::F32 as i32;
            let mut w = ptr::null_mut();
            expect(
                hprt_hsdp_param_create(
                    h,
                    ptr::null(),
                    shape.as_ptr(),
                    1,
                    f32_,
                    ptr::null(),
                    src,
                    0,
                    &mut w,
                ),
                null,
            );
            expect(
                hprt_hsdp_param_create(
                    h,
                    c"w".as_ptr(),
                    shape.as_ptr(),
                    1,
                    f32_,
                    ptr::null(),
                    ptr::null(),
                    0,
                    &mut w,
                ),
                null,
            );
            // The buffer is too short for 8 elements past offset 4; integers are not sharded.
            expect(
                hprt_hsdp_param_create(
                    h,
                    c"w".as_ptr(),
                    shape.as_ptr(),
                    1,
                    f32_,
                    ptr::null(),
                    src,
                    4,
                    &mut w,
                ),
                invalid,
            );
            expect(
                hprt_hsdp_param_create(
                    h,
                    c"w".as_ptr(),
                    shape.as_ptr(),
                    1,
                    HprtDtype::I32 as i32,
                    ptr::null(),
                    src,
                    0,
                    &mut w,
                ),
                HprtStatus::ErrorUnsupported,
            );
            let bad_dim = HprtHsdpParamConfig {
                shard_dim: 1,
                ..Default::default()
            };
            expect(
                hprt_hsdp_param_create(
                    h,
                    c"w".as_ptr(),
                    shape.as_ptr(),
                    1,
                    f32_,
                    &bad_dim,
                    src,
                    0,
                    &mut w,
                ),
                invalid,
            );
            assert!(w.is_null());

            ok(hprt_hsdp_param_create(
                h,
                c"w".as_ptr(),
                shape.as_ptr(),
                1,
                f32_,
                ptr::null(),
                src,
                0,
                &mut w,
            ));
            expect(
                hprt_hsdp_param_wait_for_unshard(w),
                HprtStatus::ErrorWrongState,
            );
            expect(
                hprt_hsdp_param_wait_for_reduce(w),
                HprtStatus::ErrorWrongState,
            );
            let max = HprtReduceOp::Max as i32;
            expect(
                hprt_hsdp_param_reduce_grad(w, src, 0, f32_, max, 1.0, false),
                invalid,
            );
            let avg = HprtReduceOp::Avg as i32;
            expect(
                hprt_hsdp_param_reduce_grad(w, src, 0, f32_, avg, f64::NAN, false),
                invalid,
            );
            // Nothing given and nothing accumulated.
            expect(
                hprt_hsdp_param_reduce_grad(w, ptr::null(), 0, f32_, avg, 1.0, false),
                HprtStatus::ErrorWrongState,
            );
            expect(hprt_hsdp_param_unshard(ptr::null_mut(), false), null);
            expect(hprt_hsdp_param_info(w, ptr::null_mut()), null);
            // The context outlives its parameters.
            expect(hprt_hsdp_destroy(h), HprtStatus::ErrorWrongState);
            assert!(last_error().contains("1 parameters"), "{}", last_error());
            ok(hprt_hsdp_param_destroy(w));
            ok(hprt_hsdp_destroy(h));
            expect(hprt_hsdp_destroy(ptr::null_mut()), null);
            ok(hprt_device_free(rk.p, src));
        }
    });
}

/// Offload to pinned host memory: the shard and the sharded gradient are host views, readable
/// after synchronizing the compute stream; micro-batch gradients accumulated before one
/// reduction count once each.
#[test]
fn offloaded_shards_and_accumulated_micro_batches() {
    let (rows, cols, world) = (5, 2, 2);
    let n = rows * cols;
    let full = param_full(n);
    run_ranks(world, |rk| {
        let h = rk.hsdp(HprtDpMode::Fsdp, &[world]);
        // SAFETY: handles made here, used while live, released once; host views are read after
        // synchronizing the compute stream.
        unsafe {
            let src = rk.upload(&bytes(&full));
            let config = HprtHsdpParamConfig {
                offload_to_host: true,
                ..Default::default()
            };
            let mut w = ptr::null_mut();
            let shape = [rows, cols];
            let f32_ = HprtDtype::F32 as i32;
            ok(hprt_hsdp_param_create(
                h,
                c"w".as_ptr(),
                shape.as_ptr(),
                2,
                f32_,
                &config,
                src,
                0,
                &mut w,
            ));
            let host_view = |v: HprtShardView| {
                assert!(v.host, "offloaded storage is pinned host memory");
                ok(hprt_stream_synchronize(rk.p, rk.s));
                f32s(std::slice::from_raw_parts(v.address as *const u8, v.bytes))
            };
            let mut v = HprtShardView::default();
            ok(hprt_hsdp_param_sharded_data(w, &mut v));
            let want = rows_shard(&full, rows, cols, world, rk.rank);
            assert_close("offloaded shard", &host_view(v), &want);

            ok(hprt_hsdp_param_unshard(w, false));
            let (mut addr, mut len) = (0, 0);
            ok(hprt_hsdp_param_unsharded(w, &mut addr, &mut len));
            assert_close("unsharded", &f32s(&rk.download(addr, len)), &full);
            ok(hprt_hsdp_param_shard(w));

            // Two micro-batches accumulated, then one summed reduction with no new gradient.
            let g = rk.upload(&bytes(&grad_of(rk.rank, n)));
            ok(hprt_hsdp_param_accumulate_grad(w, g, 0, f32_));
            ok(hprt_hsdp_param_accumulate_grad(w, g, 0, f32_));
            let sum = HprtReduceOp::Sum as i32;
            ok(hprt_hsdp_param_reduce_grad(
                w,
                ptr::null(),
                0,
                f32_,
                sum,
                1.0,
                true,
            ));
            ok(hprt_hsdp_param_wait_for_reduce(w));
            let total: Vec<f32> = (0..n)
                .map(|i| 2.0 * (0..world).map(|r| grad_of(r, n)[i]).sum::<f32>())
                .collect();
            ok(hprt_hsdp_param_sharded_grad(w, &mut v));
            let want = rows_shard(&total, rows, cols, world, rk.rank);
            assert_close("offloaded grad", &host_view(v), &want);

            ok(hprt_stream_synchronize(rk.p, rk.s));
            for b in [src, g] {
                ok(hprt_device_free(rk.p, b));
            }
            ok(hprt_hsdp_param_destroy(w));
            ok(hprt_hsdp_destroy(h));
        }
    });
}

#[test]
fn upstream_per_parameter_names_on_hsdp_2x2() {
    // hyper_parallel's HSDPParamV2 steps through the C ABI: to_unsharded / to_sharded,
    // alloc_all_gather_outputs / free_unsharded_param, reduce_scatter_grad then all_reduce_grad.
    let (rows, cols, mesh) = (6, 2, [2usize, 2]);
    let n = rows * cols;
    let full = param_full(n);
    run_ranks(4, |rk| {
        let h = rk.hsdp(HprtDpMode::Hsdp, &mesh);
        // SAFETY: every handle below is made here, used while live and released once.
        unsafe {
            let src = rk.upload(&bytes(&full));
            let mut w = ptr::null_mut();
            let shape = [rows, cols];
            let f32_ = HprtDtype::F32 as i32;
            ok(hprt_hsdp_param_create(
                h,
                c"w".as_ptr(),
                shape.as_ptr(),
                2,
                f32_,
                ptr::null(),
                src,
                0,
                &mut w,
            ));
            ok(hprt_hsdp_param_alloc_all_gather_outputs(w));
            ok(hprt_hsdp_param_free_unsharded_param(w));
            ok(hprt_hsdp_param_to_unsharded(w));
            assert_eq!(info(w).state, HprtParamState::Unsharded);
            expect(
                hprt_hsdp_param_free_unsharded_param(w),
                HprtStatus::ErrorWrongState,
            );
            let (mut addr, mut len) = (0, 0);
            ok(hprt_hsdp_param_unsharded(w, &mut addr, &mut len));
            assert_close("unsharded", &f32s(&rk.download(addr, len)), &full);
            ok(hprt_hsdp_param_to_sharded(w));
            assert_eq!(info(w).state, HprtParamState::Sharded);
            expect(
                hprt_hsdp_param_all_reduce_grad(w),
                HprtStatus::ErrorWrongState,
            );

            let g = rk.upload(&bytes(&grad_of(rk.rank, n)));
            let sum = HprtReduceOp::Sum as i32;
            let total = |ranks: &[usize]| -> Vec<f32> {
                (0..n)
                    .map(|i| ranks.iter().map(|&r| grad_of(r, n)[i]).sum::<f32>())
                    .collect()
            };
            let k = rk.rank % 2;
            let mut v = HprtShardView::default();
            ok(hprt_hsdp_param_reduce_scatter_grad(w, g, 0, f32_, sum, 1.0));
            ok(hprt_hsdp_param_all_reduce_grad(w));
            ok(hprt_hsdp_param_wait_for_reduce(w));
            ok(hprt_hsdp_param_sharded_grad(w, &mut v));
            let all = total(&[0, 1, 2, 3]);
            assert_close("both", &rk.view(v), &rows_shard(&all, rows, cols, 2, k));
            ok(hprt_hsdp_param_clear_grad(w));
            // Without the all-reduce only the shard group's gradients are summed.
            ok(hprt_hsdp_param_reduce_scatter_grad(w, g, 0, f32_, sum, 1.0));
            ok(hprt_hsdp_param_wait_for_reduce(w));
            ok(hprt_hsdp_param_sharded_grad(w, &mut v));
            let group = if rk.rank < 2 { [0, 1] } else { [2, 3] };
            let one = total(&group);
            assert_close("one", &rk.view(v), &rows_shard(&one, rows, cols, 2, k));

            ok(hprt_stream_synchronize(rk.p, rk.s));
            ok(hprt_device_free(rk.p, src));
            ok(hprt_device_free(rk.p, g));
            ok(hprt_hsdp_param_destroy(w));
            ok(hprt_hsdp_destroy(h));
        }
    });
}

/// A context and its parameters keep the platform they were made on (as swap's and compress's
/// objects do): both stay usable after `hprt_platform_close` released the caller's handle.
#[test]
fn a_parameter_outlives_its_platform_handle() {
    let p = open_cpu();
    let mut id = [0u8; HPRT_UNIQUE_ID_MAX_BYTES];
    let mut len = 0;
    // SAFETY: live handles and valid out-pointers; after the close only the hsdp handles (and
    // the stream and communicator they keep, left to the process) are used.
    unsafe {
        ok(hprt_unique_id(p, id.as_mut_ptr(), id.len(), &mut len));
        let (mut s, mut comm) = (ptr::null_mut(), ptr::null_mut());
        ok(hprt_stream_create(p, &mut s));
        ok(hprt_comm_init(p, id.as_ptr(), len, 0, 1, &mut comm));
        let rk = Rank {
            p,
            s,
            comm,
            rank: 0,
            world: 1,
        };
        let full: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let src = rk.upload(&bytes(&full));
        let h = rk.hsdp(HprtDpMode::Fsdp, &[1]);
        let w = f32_param(h, c"w", &[3, 4], ptr::null(), src);
        ok(hprt_stream_synchronize(p, s));
        ok(hprt_device_free(p, src));
        ok(hprt_platform_close(p));

        ok(hprt_hsdp_param_to_unsharded(w));
        let (mut address, mut n) = (0, 0);
        ok(hprt_hsdp_param_unsharded(w, &mut address, &mut n));
        assert_eq!(n, full.len() * 4);
        ok(hprt_hsdp_param_shard(w));
        ok(hprt_hsdp_param_destroy(w));
        ok(hprt_hsdp_destroy(h));
    }
}
