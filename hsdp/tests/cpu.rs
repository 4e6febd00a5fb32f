//! hsdp on the cpu backend with in-process ranks: every case compares N ranks with a
//! single-rank f64 reference computed on the host.

mod common;

use anyhow::{ensure, Result};
use common::*;
use hprt_hsdp::{
    DataParallelMesh, DeviceMesh, DistLayout, GradInput, GradQueue, HsdpError, LayoutMode,
    MixedPrecisionPolicy, OffloadPolicy, ParamConfig, ParamSpec, ParamState, Placement,
    ReduceOptions, ShardRef, ShardedParam,
};
use hprt_platform::{DType, ReduceOp};

#[path = "cpu/errors.rs"]
mod errors;
#[path = "cpu/gradients.rs"]
mod gradients;
#[path = "cpu/memory.rs"]
mod memory;
#[path = "cpu/meshes.rs"]
mod meshes;
#[path = "cpu/tensor_parallel.rs"]
mod tensor_parallel;

fn fsdp(world: usize) -> DataParallelMesh {
    DataParallelMesh::fsdp(DeviceMesh::contiguous(&[world]).unwrap()).unwrap()
}

fn hsdp(replicas: usize, shards: usize) -> DataParallelMesh {
    DataParallelMesh::hsdp(DeviceMesh::contiguous(&[replicas, shards]).unwrap()).unwrap()
}

/// The per-rank gradient of the reference: distinct on every rank.
fn grad_of(rank: usize, n: usize) -> Vec<f64> {
    values(1000 + rank as u64, n)
}

/// One parameter through init, unshard, shard and one gradient reduction on every rank of
/// `dp`, each step checked against the host reference.
fn check_roundtrip(
    world: usize,
    dp: &DataParallelMesh,
    shape: &[usize],
    config: ParamConfig,
    op: ReduceOp,
) -> Result<()> {
    let p = cpu(world);
    let numel: usize = shape.iter().product();
    let dtype = DType::F32;
    let full = values(7, numel);
    let total: Vec<f64> = (0..numel)
        .map(|i| (0..world).map(|r| grad_of(r, numel)[i]).sum::<f64>())
        .collect();
    let scale = if op == ReduceOp::Avg {
        1.0 / world as f64
    } else {
        1.0
    };
    run_world(&p, world, |rk| {
        let src = rk.upload(dtype, &full)?;
        let spec = ParamSpec::new("w", shape, dtype);
        let mut w = ShardedParam::new(&rk.cache, &rk.streams, dp, spec, &config, (&src).into())?;
        let g = w.geometry().clone();
        let shard = rk.read_shard(w.sharded_data(), dtype, g.shard_numel())?;
        assert_shard_close("shard", &shard, &g, &full, 0.0, 0.0)?;

        w.unshard(false)?;
        ensure!(w.state() == ParamState::Unsharded);
        let pdt = w.param_dtype();
        let gathered = rk.download(w.unsharded()?, pdt, numel)?;
        assert_close("unsharded", &gathered, &round_to(pdt, &full), 0.0, 0.0)?;
        w.shard()?;
        ensure!(w.state() == ParamState::Sharded);

        let grad = rk.upload(pdt, &grad_of(rk.rank, numel))?;
        w.reduce_grad(
            Some(GradInput {
                buf: (&grad).into(),
                dtype: pdt,
            }),
            ReduceOptions { op, scale: None },
        )?;
        let got = rk.read_shard(w.sharded_grad().expect("reduced"), dtype, g.shard_numel())?;
        let expect: Vec<f64> = expected_shard(&g, g.index(), &total)
            .iter()
            .map(|v| v * scale)
            .collect();
        assert_close("sharded grad", &got, &expect, 1e-6, 1e-7)
    })
}

/// Values that are not exact in 16-bit floats, so rounding paths are exercised.
fn inexact(seed: u64, n: usize) -> Vec<f64> {
    values(seed, n)
        .iter()
        .enumerate()
        .map(|(i, v)| v * (1.0 + 1.0 / 3000.0) + (i as f64) * 1e-4)
        .collect()
}
