//! A subset of the hsdp cases on the npu backend over the Ascend emulator and on the cuda backend
//! over the CUDA emulator (both built on first use):
//! 1-D over 2 ranks, 2-D 2 × 2, mixed precision, each against the host f64 reference, and
//! failed gathers and reduces reaching the compute stream. The
//! emulators' state is process-global, so the cases run under one lock.

mod common;

use anyhow::{ensure, Context, Result};
use common::*;
use hprt_conformance::cuda_emulator;
use hprt_conformance::emulator::{self, serial};
use hprt_hsdp::{
    DataParallelMesh, DeviceMesh, GradInput, MixedPrecisionPolicy, ParamConfig, ParamSpec,
    Placement, ReduceOptions, ShardedParam,
};
use hprt_platform::{DType, Platform, ReduceOp};

#[derive(Clone, Copy, Debug)]
enum Emulated {
    Npu,
    Cuda,
}

/// A dead peer costs one collective timeout (the Ascend emulator's HCCL timeout; on cuda the
/// backend's NCCL watchdog, as NCCL itself never times out): this one, in these tests.
const PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The backend on its emulator. NCCL wants a device per rank: the CUDA emulator gets four.
fn open(which: Emulated) -> std::sync::Arc<dyn Platform> {
    static DEVICES: std::sync::Once = std::sync::Once::new();
    DEVICES.call_once(|| {
        std::env::set_var("HP_EMU_DEVICES", "4");
        let ms = PEER_TIMEOUT.as_millis().to_string();
        std::env::set_var("HP_EMU_HCCL_TIMEOUT_MS", &ms);
        std::env::set_var("HP_EMU_NCCL_TIMEOUT_MS", &ms);
        std::env::set_var("HP_COLLECTIVE_TIMEOUT_MS", &ms);
    });
    match which {
        Emulated::Npu => {
            std::sync::Arc::new(emulator::open().expect("the npu backend opens on the emulator"))
        }
        Emulated::Cuda => std::sync::Arc::new(
            cuda_emulator::open().expect("the cuda backend opens on the emulator"),
        ),
    }
}

/// Init, unshard (async), shard, and one gradient reduction, checked against the reference.
fn case(
    which: Emulated,
    world: usize,
    dp: &DataParallelMesh,
    shape: &[usize],
    cfg: ParamConfig,
    op: ReduceOp,
) -> Result<()> {
    let p = open(which);
    let numel: usize = shape.iter().product();
    let full = values(21, numel);
    let pdt = cfg.mp.param_dtype.unwrap_or(DType::F32);
    let grads: Vec<Vec<f64>> = (0..world)
        .map(|r| round_to(pdt, &values(500 + r as u64, numel)))
        .collect();
    let div = if op == ReduceOp::Avg {
        world as f64
    } else {
        1.0
    };
    let total: Vec<f64> = (0..numel)
        .map(|i| grads.iter().map(|g| g[i]).sum::<f64>() / div)
        .collect();
    run_world(&p, world, |rk| {
        let src = rk.upload(DType::F32, &full)?;
        let mut w = ShardedParam::new(
            &rk.cache,
            &rk.streams,
            dp,
            ParamSpec::new("w", shape, DType::F32),
            &cfg,
            (&src).into(),
        )?;
        let geom = w.geometry().clone();
        let shard = rk.read_shard(w.sharded_data(), DType::F32, geom.shard_numel())?;
        assert_shard_close("shard", &shard, &geom, &full, 0.0, 0.0)?;
        let handle = w.unshard(true)?.expect("an all-gather starts");
        w.wait_for_unshard()?;
        let got = rk.download(w.unsharded()?, pdt, numel)?;
        assert_close("gathered", &got, &round_to(pdt, &full), 0.0, 0.0)?;
        ensure!(handle.is_complete(&*rk.p)?);
        w.shard()?;
        let g = rk.upload(pdt, &grads[rk.rank])?;
        w.reduce_grad(
            Some(GradInput {
                buf: (&g).into(),
                dtype: pdt,
            }),
            ReduceOptions { op, scale: None },
        )?;
        let got = rk.read_shard(w.sharded_grad().unwrap(), DType::F32, geom.shard_numel())?;
        assert_shard_close("sharded grad", &got, &geom, &total, 1e-6, 1e-7)
    })
}

fn fsdp_two_ranks(which: Emulated) -> Result<()> {
    let dp = DataParallelMesh::fsdp(DeviceMesh::contiguous(&[2])?)?;
    case(
        which,
        2,
        &dp,
        &[5, 3],
        ParamConfig::default(),
        ReduceOp::Sum,
    )?;
    let shard1 = ParamConfig {
        shard: Some(Placement::Shard(1)),
        ..Default::default()
    };
    case(which, 2, &dp, &[2, 5], shard1, ReduceOp::Avg)
}

fn hsdp_2x2(which: Emulated) -> Result<()> {
    let dp = DataParallelMesh::hsdp(DeviceMesh::contiguous(&[2, 2])?)?;
    case(
        which,
        4,
        &dp,
        &[7, 2],
        ParamConfig::default(),
        ReduceOp::Avg,
    )
}

fn mixed_precision(which: Emulated) -> Result<()> {
    let dp = DataParallelMesh::fsdp(DeviceMesh::contiguous(&[2])?)?;
    for param_dtype in [DType::BF16, DType::F16] {
        let cfg = ParamConfig {
            mp: MixedPrecisionPolicy {
                param_dtype: Some(param_dtype),
                reduce_dtype: Some(DType::F32),
                output_dtype: None,
            },
            ..Default::default()
        };
        case(which, 2, &dp, &[6, 3], cfg, ReduceOp::Sum)?;
    }
    Ok(())
}

fn every_case(which: Emulated) -> Result<()> {
    let _g = serial();
    fsdp_two_ranks(which).with_context(|| format!("fsdp over 2 ranks on {which:?}"))?;
    hsdp_2x2(which).with_context(|| format!("hsdp 2 x 2 on {which:?}"))?;
    mixed_precision(which).with_context(|| format!("mixed precision on {which:?}"))?;
    failed_collectives_reach_compute(&open(which), PEER_TIMEOUT * 3)
        .with_context(|| format!("failed collectives on {which:?}"))
}

#[test]
fn on_the_ascend_emulator() -> Result<()> {
    every_case(Emulated::Npu)
}

#[test]
fn on_the_cuda_emulator() -> Result<()> {
    every_case(Emulated::Cuda)
}
