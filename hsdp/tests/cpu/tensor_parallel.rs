//! Tensor-parallel layouts: the groups each placement chooses.

use super::*;

#[test]
fn tensor_parallel_layouts_choose_their_groups_from_placements() -> Result<()> {
    // A 2 (dp) × 2 (tp) root mesh. The parameter is tensor-parallel Shard(0): each tp rank holds
    // its own local rows, which data parallelism shards again across dp.
    let world = 4;
    let p = cpu(world);
    let root = DeviceMesh::contiguous(&[2, 2])?.with_dim_names(&["dp", "tp"])?;
    run_world(&p, world, |rk| {
        let dp = DataParallelMesh::fsdp(root.submesh_by_names(rk.rank, &["dp"])?)?;
        let tp_mesh = root.submesh_by_names(rk.rank, &["tp"])?;
        let tp_rank = rk.rank % 2;
        let local = values(40 + tp_rank as u64, 6);
        let src = rk.upload(DType::F32, &local)?;
        let mut spec = ParamSpec::new("tp_w", &[3, 2], DType::F32);
        spec.layout = Some((
            DistLayout {
                mesh: tp_mesh.clone(),
                placements: vec![Placement::Shard(0)],
            },
            LayoutMode::Unified,
        ));
        let mut w = ShardedParam::new(
            &rk.cache,
            &rk.streams,
            &dp,
            spec,
            &ParamConfig::default(),
            (&src).into(),
        )?;
        ensure!(w.layout().mesh == root);
        ensure!(
            w.groups().sharded.ranks() == [tp_rank, tp_rank + 2],
            "dp group {:?}",
            w.groups().sharded.ranks()
        );
        ensure!(w.groups().unsharded.is_noop());
        w.unshard(false)?;
        assert_close(
            "local gathered",
            &rk.download(w.unsharded()?, DType::F32, 6)?,
            &local,
            0.0,
            0.0,
        )?;
        w.shard()?;
        let g = rk.upload(DType::F32, &grad_of(rk.rank, 6))?;
        w.reduce_grad(
            Some(GradInput {
                buf: (&g).into(),
                dtype: DType::F32,
            }),
            ReduceOptions {
                op: ReduceOp::Sum,
                scale: None,
            },
        )?;
        // Summed over the dp ranks holding the same tp part only.
        let total: Vec<f64> = (0..6)
            .map(|i| grad_of(tp_rank, 6)[i] + grad_of(tp_rank + 2, 6)[i])
            .collect();
        let geom = w.geometry().clone();
        let got = rk.read_shard(w.sharded_grad().unwrap(), DType::F32, geom.shard_numel())?;
        assert_shard_close("dp-reduced", &got, &geom, &total, 1e-6, 1e-7)?;

        // A compat layout that is Partial(sum) over tp: the gradient is summed across tp first,
        // then reduce-scattered across dp — the sum over all four ranks.
        let mut spec = ParamSpec::new("partial", &[4], DType::F32);
        spec.layout = Some((
            DistLayout {
                mesh: root.clone(),
                placements: vec![Placement::Replicate, Placement::Partial(ReduceOp::Sum)],
            },
            LayoutMode::Compat,
        ));
        let src4 = rk.upload(DType::F32, &values(3, 4))?;
        let mut q = ShardedParam::new(
            &rk.cache,
            &rk.streams,
            &dp,
            spec,
            &ParamConfig::default(),
            (&src4).into(),
        )?;
        ensure!(
            q.groups().partial.len() == 1
                && q.groups().partial[0].0.ranks() == [rk.rank / 2 * 2, rk.rank / 2 * 2 + 1]
        );
        let g4 = rk.upload(DType::F32, &grad_of(rk.rank, 4))?;
        q.reduce_grad(
            Some(GradInput {
                buf: (&g4).into(),
                dtype: DType::F32,
            }),
            ReduceOptions {
                op: ReduceOp::Sum,
                scale: None,
            },
        )?;
        let all: Vec<f64> = (0..4)
            .map(|i| (0..4).map(|r| grad_of(r, 4)[i]).sum())
            .collect();
        let geom = q.geometry().clone();
        let got = rk.read_shard(q.sharded_grad().unwrap(), DType::F32, geom.shard_numel())?;
        assert_shard_close("partial then dp", &got, &geom, &all, 1e-6, 1e-7)
    })
}
