//! Each mesh kind — FSDP, HSDP, DDP — through create, unshard, shard and a gradient reduction
//! on every rank, compared with the host reference; a dim-1 shard with a bf16 gather.

use super::*;

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
            // Reduces `g` into the gradient, waiting for it when it runs asynchronously.
            let reduce = |op: HprtReduceOp, scale: f64| {
                ok(hprt_hsdp_param_reduce_grad(
                    w,
                    g,
                    0,
                    HprtDtype::F32 as i32,
                    op as i32,
                    scale,
                    async_reduce,
                ));
                if async_reduce {
                    ok(hprt_hsdp_param_wait_for_reduce(w));
                }
            };
            reduce(HprtReduceOp::Avg, 1.0);
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
            reduce(HprtReduceOp::Sum, 0.5);
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

            rk.finish(&[g], w, h);
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
            rk.finish(&[src, g], w, h);
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
            rk.finish(&[src], w, h);
        }
    });
}
