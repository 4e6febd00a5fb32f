//! End to end: a 2-layer MLP trained for a few SGD steps under FSDP and HSDP (each rank its own
//! slice of the batch) must match single-rank f64 training on the whole batch. Forward and
//! backward are hand-written on the host from the gathered weights; gathering, gradient
//! reduction and the optimizer update run through hsdp on the platform's streams.

mod common;

use anyhow::{ensure, Result};
use common::*;
use hprt_hsdp::{
    DataParallelMesh, DeviceMesh, GradInput, GradQueue, MixedPrecisionPolicy, ParamConfig,
    ParamSpec, Placement, ReduceOptions, ShardRef, ShardedParam,
};
use hprt_platform::{DType, Kernel, ReduceOp};

const D_IN: usize = 5;
const HIDDEN: usize = 7;
const D_OUT: usize = 3;
const PER_RANK: usize = 2;
const STEPS: usize = 4;
const LR: f64 = 0.1;

/// W1 [HIDDEN, D_IN], b1 [HIDDEN], W2 [D_OUT, HIDDEN], b2 [D_OUT].
const SHAPES: [&[usize]; 4] = [&[HIDDEN, D_IN], &[HIDDEN], &[D_OUT, HIDDEN], &[D_OUT]];

fn init() -> Vec<Vec<f64>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n: usize = s.iter().product();
            values(300 + i as u64, n).iter().map(|v| v * 0.5).collect()
        })
        .collect()
}

fn batch(rows: std::ops::Range<usize>) -> (Vec<f64>, Vec<f64>) {
    let x = values(77, 64 * D_IN);
    let t = values(78, 64 * D_OUT);
    (
        x[rows.start * D_IN..rows.end * D_IN].to_vec(),
        t[rows.start * D_OUT..rows.end * D_OUT].to_vec(),
    )
}

/// Loss `sum((y - t)^2) / (2 * rows)` and its gradients for `params`, in f64.
fn forward_backward(params: &[Vec<f64>], x: &[f64], t: &[f64]) -> (f64, Vec<Vec<f64>>) {
    let (w1, b1, w2, b2) = (&params[0], &params[1], &params[2], &params[3]);
    let rows = x.len() / D_IN;
    let mut grads: Vec<Vec<f64>> = SHAPES
        .iter()
        .map(|s| vec![0.0; s.iter().product()])
        .collect();
    let mut loss = 0.0;
    for r in 0..rows {
        let xr = &x[r * D_IN..(r + 1) * D_IN];
        let pre: Vec<f64> = (0..HIDDEN)
            .map(|h| b1[h] + (0..D_IN).map(|i| w1[h * D_IN + i] * xr[i]).sum::<f64>())
            .collect();
        let act: Vec<f64> = pre.iter().map(|v| v.max(0.0)).collect();
        let y: Vec<f64> = (0..D_OUT)
            .map(|o| {
                b2[o]
                    + (0..HIDDEN)
                        .map(|h| w2[o * HIDDEN + h] * act[h])
                        .sum::<f64>()
            })
            .collect();
        let dy: Vec<f64> = (0..D_OUT)
            .map(|o| (y[o] - t[r * D_OUT + o]) / rows as f64)
            .collect();
        loss += (0..D_OUT)
            .map(|o| (y[o] - t[r * D_OUT + o]).powi(2))
            .sum::<f64>()
            / (2.0 * rows as f64);
        for o in 0..D_OUT {
            grads[3][o] += dy[o];
            for h in 0..HIDDEN {
                grads[2][o * HIDDEN + h] += dy[o] * act[h];
            }
        }
        for h in 0..HIDDEN {
            let da = (0..D_OUT).map(|o| dy[o] * w2[o * HIDDEN + h]).sum::<f64>();
            let dpre = if pre[h] > 0.0 { da } else { 0.0 };
            grads[1][h] += dpre;
            for i in 0..D_IN {
                grads[0][h * D_IN + i] += dpre * xr[i];
            }
        }
    }
    (loss, grads)
}

fn reference(world: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    let mut params = init();
    let (x, t) = batch(0..world * PER_RANK);
    let mut losses = vec![];
    for _ in 0..STEPS {
        let (loss, grads) = forward_backward(&params, &x, &t);
        losses.push(loss);
        for (p, g) in params.iter_mut().zip(&grads) {
            for (pv, gv) in p.iter_mut().zip(g) {
                *pv -= LR * gv;
            }
        }
    }
    (losses, params)
}

fn train(
    world: usize,
    dp: impl Fn(usize) -> DataParallelMesh + Sync,
    mp: MixedPrecisionPolicy,
    tol: f64,
) -> Result<()> {
    let p = cpu(world);
    let (ref_losses, ref_params) = reference(world);
    let init = init();
    run_world(&p, world, |rk| {
        let dp = dp(rk.rank);
        let mut params = Vec::new();
        for (i, s) in SHAPES.iter().enumerate() {
            let cfg = ParamConfig {
                // W1 sharded on its input dim; the biases stay replicated (below the threshold).
                shard: Some(Placement::Shard(if i == 0 { 1 } else { 0 })),
                mp,
                threshold: 8,
                ..Default::default()
            };
            let src = rk.upload(DType::F32, &init[i])?;
            let spec = ParamSpec::new(&format!("p{i}"), s, DType::F32);
            params.push(ShardedParam::new(
                &rk.cache,
                &rk.streams,
                &dp,
                spec,
                &cfg,
                (&src).into(),
            )?);
            rk.sync()?;
        }
        ensure!(params[0].is_sharded_param() && !params[1].is_sharded_param());
        let (x, t) = batch(rk.rank * PER_RANK..(rk.rank + 1) * PER_RANK);
        let pdt = params[0].param_dtype();
        for (step, want) in ref_losses.iter().enumerate() {
            // Forward: gather layer 1, prefetch layer 2 behind it.
            let mut full = Vec::new();
            for param in params.iter_mut() {
                param.unshard(true)?;
            }
            for (i, param) in params.iter_mut().enumerate() {
                param.wait_for_unshard()?;
                full.push(rk.download(param.unsharded()?, pdt, SHAPES[i].iter().product())?);
            }
            let (loss, grads) = forward_backward(&full, &x, &t);
            for param in params.iter_mut() {
                param.shard()?;
            }
            // The mean of the per-rank losses (equal slices) is the reference's global loss.
            let lb = rk.upload(DType::F64, &[loss])?;
            rk.p.all_reduce(
                (&lb).into(),
                (&lb).into(),
                1,
                DType::F64,
                ReduceOp::Avg,
                rk.cache.world(),
                &rk.streams.compute,
            )?;
            let mean = rk.download((&lb).into(), DType::F64, 1)?[0];
            let want = *want;
            ensure!(
                (mean - want).abs() <= tol * want.abs(),
                "step {step}: loss {mean}, reference {want}"
            );
            // Backward: gradients in reverse layer order, reduced behind the "compute".
            let bufs: Vec<_> = grads
                .iter()
                .map(|g| rk.upload(pdt, g))
                .collect::<Result<_>>()?;
            let mut q = GradQueue::default();
            for i in (0..4).rev() {
                let g = GradInput {
                    buf: (&bufs[i]).into(),
                    dtype: pdt,
                };
                q.issue(
                    &mut params,
                    i,
                    Some(g),
                    ReduceOptions {
                        op: ReduceOp::Avg,
                        scale: None,
                    },
                )?;
            }
            q.finish(&mut params)?;
            // SGD on the shard, on the compute stream.
            for param in params.iter_mut() {
                let n = param.geometry().shard_numel();
                let (ShardRef::Device(w), Some(ShardRef::Device(g))) =
                    (param.sharded_data(), param.sharded_grad())
                else {
                    anyhow::bail!("device shards expected");
                };
                rk.p.launch_kernel(
                    Kernel::Axpy {
                        src: g,
                        src_dtype: DType::F32,
                        dst: w,
                        dst_dtype: DType::F32,
                        count: n,
                        alpha: -LR,
                    },
                    &rk.streams.compute,
                )?;
            }
            for param in params.iter_mut() {
                param.clear_grad()?;
            }
            rk.sync()?;
        }
        for (i, param) in params.iter_mut().enumerate() {
            param.unshard(false)?;
            let got = rk.download(param.unsharded()?, pdt, SHAPES[i].iter().product())?;
            assert_close(
                &format!("trained p{i}"),
                &got,
                &round_to(pdt, &ref_params[i]),
                tol,
                tol,
            )?;
        }
        Ok(())
    })
}

#[test]
fn fsdp_training_matches_single_rank() -> Result<()> {
    train(
        1,
        |_| DataParallelMesh::fsdp(DeviceMesh::contiguous(&[1]).unwrap()).unwrap(),
        MixedPrecisionPolicy::default(),
        1e-5,
    )?;
    train(
        4,
        |_| DataParallelMesh::fsdp(DeviceMesh::contiguous(&[4]).unwrap()).unwrap(),
        MixedPrecisionPolicy::default(),
        1e-5,
    )
}

#[test]
fn hsdp_training_matches_single_rank() -> Result<()> {
    train(
        4,
        |_| DataParallelMesh::hsdp(DeviceMesh::contiguous(&[2, 2]).unwrap()).unwrap(),
        MixedPrecisionPolicy::default(),
        1e-5,
    )
}

#[test]
fn hsdp_bf16_training_matches_single_rank_to_bf16_rounding() -> Result<()> {
    let mp = MixedPrecisionPolicy {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        output_dtype: None,
    };
    train(
        4,
        |_| DataParallelMesh::hsdp(DeviceMesh::contiguous(&[2, 2]).unwrap()).unwrap(),
        mp,
        2e-2,
    )
}
