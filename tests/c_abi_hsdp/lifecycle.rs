//! Offloaded shards, accumulated micro-batches, upstream per-parameter names and a parameter
//! that outlives its platform handle.

use super::*;

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
            let shape = [rows, cols];
            let f32_ = HprtDtype::F32 as i32;
            let w = f32_param(h, c"w", &shape, &config, src);
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

            rk.finish(&[src, g], w, h);
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
            let shape = [rows, cols];
            let f32_ = HprtDtype::F32 as i32;
            let w = f32_param(h, c"w", &shape, ptr::null(), src);
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

            rk.finish(&[src, g], w, h);
        }
    });
}

/// A context and its parameters keep the platform they were made on (as swap's and compress's
/// objects do): both stay usable after `hprt_platform_close` released the caller's handle.
#[test]
fn a_parameter_outlives_its_platform_handle() {
    let p = open_cpu();
    // SAFETY: live handles and valid out-pointers; after the close only the hsdp handles (and
    // the stream and communicator they keep, left to the process) are used.
    unsafe {
        let s = stream(p);
        let comm = solo_comm(p);
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
