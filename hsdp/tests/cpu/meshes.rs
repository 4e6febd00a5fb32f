//! FSDP, HSDP and DDP meshes against the reference: rank counts, uneven sizes, a custom
//! shard dim, the replica all-reduce, upstream per-parameter names, the mesh's groups and
//! parameters that stay replicated.

use super::*;

#[test]
fn fsdp_on_1_2_3_4_and_8_ranks_matches_the_reference() -> Result<()> {
    for world in [1, 2, 3, 4, 8] {
        // 7 rows: uneven for every world above 1.
        check_roundtrip(
            world,
            &fsdp(world),
            &[7, 5],
            ParamConfig::default(),
            ReduceOp::Sum,
        )?;
        check_roundtrip(
            world,
            &fsdp(world),
            &[16],
            ParamConfig::default(),
            ReduceOp::Avg,
        )?;
    }
    Ok(())
}

#[test]
fn uneven_sizes_are_padded_and_unpadded() -> Result<()> {
    // 3 rows over 4 ranks: rank 3's shard is all padding; 1 row over 2 ranks.
    check_roundtrip(4, &fsdp(4), &[3, 2], ParamConfig::default(), ReduceOp::Sum)?;
    check_roundtrip(2, &fsdp(2), &[1, 3], ParamConfig::default(), ReduceOp::Avg)?;
    check_roundtrip(3, &fsdp(3), &[10], ParamConfig::default(), ReduceOp::Sum)
}

#[test]
fn custom_shard_dim_1_gathers_the_interleaved_parameter() -> Result<()> {
    let shard1 = ParamConfig {
        shard: Some(Placement::Shard(1)),
        ..Default::default()
    };
    check_roundtrip(4, &fsdp(4), &[3, 10], shard1, ReduceOp::Sum)?;
    check_roundtrip(2, &fsdp(2), &[2, 5, 3], shard1, ReduceOp::Avg)?;
    check_roundtrip(4, &hsdp(2, 2), &[4, 6], shard1, ReduceOp::Sum)?;
    let shard2 = ParamConfig {
        shard: Some(Placement::Shard(2)),
        ..Default::default()
    };
    check_roundtrip(3, &fsdp(3), &[2, 2, 4], shard2, ReduceOp::Sum)
}

#[test]
fn hsdp_2x2_and_2x4_reduce_scatter_then_all_reduce_across_replicas() -> Result<()> {
    check_roundtrip(
        4,
        &hsdp(2, 2),
        &[6, 3],
        ParamConfig::default(),
        ReduceOp::Sum,
    )?;
    check_roundtrip(4, &hsdp(2, 2), &[5], ParamConfig::default(), ReduceOp::Avg)?;
    check_roundtrip(
        8,
        &hsdp(2, 4),
        &[9, 2],
        ParamConfig::default(),
        ReduceOp::Sum,
    )?;
    check_roundtrip(
        8,
        &hsdp(2, 4),
        &[8, 4],
        ParamConfig::default(),
        ReduceOp::Avg,
    )
}

#[test]
fn upstream_per_parameter_names_split_the_reduction() -> Result<()> {
    // hyper_parallel's HSDPParamV2 steps: alloc_all_gather_outputs / to_unsharded / to_sharded
    // / free_unsharded_param, reduce_scatter_grad then (optionally) all_reduce_grad.
    let (world, dp) = (4, hsdp(2, 2));
    let p = cpu(world);
    let (shape, dtype) = ([6usize, 3], DType::F32);
    let numel = 18;
    let full = values(7, numel);
    run_world(&p, world, |rk| {
        let src = rk.upload(dtype, &full)?;
        let spec = ParamSpec::new("w", &shape, dtype);
        let config = ParamConfig::default();
        let mut w = ShardedParam::new(&rk.cache, &rk.streams, &dp, spec, &config, (&src).into())?;
        w.alloc_all_gather_outputs()?;
        w.free_unsharded_param()?;
        w.to_unsharded()?;
        ensure!(w.state() == ParamState::Unsharded);
        ensure!(matches!(
            w.free_unsharded_param(),
            Err(HsdpError::InvalidState { .. })
        ));
        let got = rk.download(w.unsharded()?, dtype, numel)?;
        assert_close("gathered", &got, &full, 0.0, 0.0)?;
        w.to_sharded()?;
        ensure!(w.state() == ParamState::Sharded);
        ensure!(matches!(
            w.all_reduce_grad(),
            Err(HsdpError::InvalidState { .. })
        ));

        let g = w.geometry().clone();
        let grad = rk.upload(dtype, &grad_of(rk.rank, numel))?;
        let sum = |ranks: &[usize]| -> Vec<f64> {
            (0..numel)
                .map(|i| ranks.iter().map(|&r| grad_of(r, numel)[i]).sum())
                .collect()
        };
        let sum_opts = ReduceOptions {
            op: ReduceOp::Sum,
            scale: Some(0.5),
        };
        let input = GradInput {
            buf: (&grad).into(),
            dtype,
        };
        // Both halves: every rank's gradient, scaled.
        w.reduce_scatter_grad(Some(input), sum_opts)?;
        w.all_reduce_grad()?;
        w.all_reduce_grad()?; // a second call is a no-op
        w.wait_for_reduce()?;
        let both = rk.read_shard(w.sharded_grad().unwrap(), dtype, g.shard_numel())?;
        let want: Vec<f64> = sum(&[0, 1, 2, 3]).iter().map(|v| v * 0.5).collect();
        assert_shard_close("both", &both, &g, &want, 1e-6, 1e-6)?;
        // The reduce-scatter alone: only the shard group's (same replica) gradients.
        w.clear_grad()?;
        w.reduce_scatter_grad(Some(input), sum_opts)?;
        w.wait_for_reduce()?;
        let one = rk.read_shard(w.sharded_grad().unwrap(), dtype, g.shard_numel())?;
        let group: Vec<usize> = if rk.rank < 2 { vec![0, 1] } else { vec![2, 3] };
        let want: Vec<f64> = sum(&group).iter().map(|v| v * 0.5).collect();
        assert_shard_close("one", &one, &g, &want, 1e-6, 1e-6)?;
        Ok(())
    })
}

#[test]
fn hsdp_groups_follow_the_mesh_layout() -> Result<()> {
    let p = cpu(8);
    let dp = hsdp(2, 4);
    run_world(&p, 8, |rk| {
        let src = rk.upload(DType::F32, &values(1, 8))?;
        let cfg = ParamConfig::default();
        let w = ShardedParam::new(
            &rk.cache,
            &rk.streams,
            &dp,
            ParamSpec::new("w", &[8], DType::F32),
            &cfg,
            (&src).into(),
        )?;
        let gi = w.groups();
        let replica = rk.rank / 4;
        ensure!(gi.sharded.ranks() == (replica * 4..replica * 4 + 4).collect::<Vec<_>>());
        ensure!(gi.sharded.rank() == rk.rank % 4);
        ensure!(gi.unsharded.ranks() == [rk.rank % 4, rk.rank % 4 + 4]);
        ensure!(gi.rank_size() == 8);
        ensure!(w.geometry().index() == rk.rank % 4);
        // Below the threshold: replicated, reduced over the whole mesh with one all-reduce.
        let small = ParamConfig {
            threshold: 100,
            ..Default::default()
        };
        let b = ShardedParam::new(
            &rk.cache,
            &rk.streams,
            &dp,
            ParamSpec::new("b", &[8], DType::F32),
            &small,
            (&src).into(),
        )?;
        ensure!(!b.is_sharded_param());
        ensure!(b.groups().sharded.is_noop() && b.groups().sharded.name().ends_with("_invalid"));
        ensure!(b.groups().unsharded.size() == 8);
        // Two splits (shard dim, replicate dim), then one for the whole mesh; reuse costs none.
        ensure!(
            rk.cache.split_calls() == 3,
            "split calls: {}",
            rk.cache.split_calls()
        );
        let _again = ShardedParam::new(
            &rk.cache,
            &rk.streams,
            &dp,
            ParamSpec::new("w2", &[8], DType::F32),
            &cfg,
            (&src).into(),
        )?;
        ensure!(rk.cache.split_calls() == 3);
        Ok(())
    })
}

#[test]
fn params_below_the_threshold_and_ddp_stay_replicated() -> Result<()> {
    let keep = ParamConfig {
        threshold: 1000,
        ..Default::default()
    };
    check_roundtrip(4, &fsdp(4), &[7, 5], keep, ReduceOp::Sum)?;
    check_roundtrip(4, &hsdp(2, 2), &[6], keep, ReduceOp::Avg)?;
    let ddp = DataParallelMesh::ddp(DeviceMesh::contiguous(&[3]).unwrap()).unwrap();
    check_roundtrip(3, &ddp, &[4, 3], ParamConfig::default(), ReduceOp::Avg)
}
