//! Gradients over time: accumulation over micro-batches, the ordered queue, and offloaded
//! shards and gradients in pinned memory.

use super::*;

#[test]
fn gradient_accumulation_over_micro_batches() -> Result<()> {
    let world = 3;
    let p = cpu(world);
    let dp = hsdp(1, 3);
    let numel = 20;
    let micro = 3;
    let grad =
        |rank: usize, m: usize| round_to(DType::BF16, &inexact((rank * 10 + m) as u64, numel));
    let total: Vec<f64> = (0..numel)
        .map(|i| {
            (0..world)
                .flat_map(|r| (0..micro).map(move |m| (r, m)))
                .map(|(r, m)| grad(r, m)[i])
                .sum()
        })
        .collect();
    let cfg = ParamConfig {
        mp: MixedPrecisionPolicy {
            param_dtype: Some(DType::BF16),
            reduce_dtype: Some(DType::F32),
            output_dtype: None,
        },
        ..Default::default()
    };
    run_world(&p, world, |rk| {
        let src = rk.upload(DType::F32, &values(2, numel))?;
        let spec = || ParamSpec::new("w", &[4, 5], DType::F32);
        // (a) accumulate unsharded in f32 without syncing, reduce once at the last micro-batch.
        let mut a = ShardedParam::new(&rk.cache, &rk.streams, &dp, spec(), &cfg, (&src).into())?;
        // (b) reduce every micro-batch; the sharded gradient accumulates.
        let mut b = ShardedParam::new(&rk.cache, &rk.streams, &dp, spec(), &cfg, (&src).into())?;
        for m in 0..micro {
            let g = rk.upload(DType::BF16, &grad(rk.rank, m))?;
            let gi = GradInput {
                buf: (&g).into(),
                dtype: DType::BF16,
            };
            if m + 1 < micro {
                a.accumulate_grad(gi)?;
            } else {
                a.reduce_grad(
                    Some(gi),
                    ReduceOptions {
                        op: ReduceOp::Sum,
                        scale: Some(0.5),
                    },
                )?;
            }
            b.reduce_grad(
                Some(gi),
                ReduceOptions {
                    op: ReduceOp::Sum,
                    scale: Some(0.5),
                },
            )?;
            rk.sync()?; // `g` is reused by the next iteration's allocation
        }
        let geom = a.geometry().clone();
        let expect: Vec<f64> = expected_shard(&geom, geom.index(), &total)
            .iter()
            .map(|v| v * 0.5)
            .collect();
        let ga = rk.read_shard(a.sharded_grad().unwrap(), DType::F32, geom.shard_numel())?;
        let gb = rk.read_shard(b.sharded_grad().unwrap(), DType::F32, geom.shard_numel())?;
        assert_close("accumulated then reduced", &ga, &expect, 1e-6, 1e-7)?;
        assert_close("reduced then accumulated", &gb, &expect, 1e-6, 1e-7)?;
        // Reducing with nothing accumulated or given is an error; clearing starts over.
        ensure!(a.reduce_grad(None, ReduceOptions::default()).is_err());
        a.clear_grad()?;
        ensure!(a.sharded_grad().is_none());
        ensure!(matches!(
            a.reduce_grad_async(
                None,
                ReduceOptions {
                    op: ReduceOp::Max,
                    scale: None
                }
            ),
            Err(HsdpError::Unsupported(_))
        ));
        Ok(())
    })
}

#[test]
fn ordered_queue_issues_in_backward_order_and_applies_fifo() -> Result<()> {
    let world = 4;
    let p = cpu(world);
    let dp = hsdp(2, 2);
    let shapes: [&[usize]; 3] = [&[8, 3], &[5], &[2, 7]];
    run_world(&p, world, |rk| {
        let mut params = Vec::new();
        let mut srcs = Vec::new();
        for (i, s) in shapes.iter().enumerate() {
            let n: usize = s.iter().product();
            let src = rk.upload(DType::F32, &values(i as u64, n))?;
            params.push(ShardedParam::new(
                &rk.cache,
                &rk.streams,
                &dp,
                ParamSpec::new(&format!("p{i}"), s, DType::F32),
                &ParamConfig::default(),
                (&src).into(),
            )?);
            srcs.push(src);
        }
        let grads: Vec<_> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| rk.upload(DType::F32, &grad_of(rk.rank * 10 + i, s.iter().product())))
            .collect::<Result<_>>()?;
        let mut q = GradQueue::default();
        for i in (0..3).rev() {
            let gi = GradInput {
                buf: (&grads[i]).into(),
                dtype: DType::F32,
            };
            q.issue(
                &mut params,
                i,
                Some(gi),
                ReduceOptions {
                    op: ReduceOp::Avg,
                    scale: None,
                },
            )?;
        }
        ensure!(q.len() == 3);
        let gi = GradInput {
            buf: (&grads[0]).into(),
            dtype: DType::F32,
        };
        ensure!(
            q.issue(&mut params, 0, Some(gi), ReduceOptions::default())
                .is_err(),
            "double issue"
        );
        ensure!(q
            .issue(&mut params, 7, None, ReduceOptions::default())
            .is_err());
        ensure!(q.finish(&mut params)? == 3);
        ensure!(q.applied() == [2, 1, 0]);
        ensure!(q.is_empty());
        for (i, s) in shapes.iter().enumerate() {
            let n: usize = s.iter().product();
            let mean: Vec<f64> = (0..n)
                .map(|e| (0..world).map(|r| grad_of(r * 10 + i, n)[e]).sum::<f64>() / world as f64)
                .collect();
            let geom = params[i].geometry().clone();
            let got = rk.read_shard(
                params[i].sharded_grad().unwrap(),
                DType::F32,
                geom.shard_numel(),
            )?;
            assert_close(
                &format!("p{i}"),
                &got,
                &expected_shard(&geom, geom.index(), &mean),
                1e-6,
                1e-7,
            )?;
        }
        Ok(())
    })
}

#[test]
fn offload_keeps_shard_and_grad_in_pinned_memory() -> Result<()> {
    let world = 2;
    let p = cpu(world);
    let dp = fsdp(world);
    let numel = 10;
    let full = values(5, numel);
    let cfg = ParamConfig {
        offload: OffloadPolicy::PinnedHost,
        mp: MixedPrecisionPolicy {
            param_dtype: Some(DType::F16),
            reduce_dtype: Some(DType::F32),
            output_dtype: None,
        },
        ..Default::default()
    };
    run_world(&p, world, |rk| {
        let src = rk.upload(DType::F32, &full)?;
        // Pinned memory is one pool for all ranks: measure between barriers.
        rk.settle()?;
        let base = rk.p.memory_stats();
        rk.settle()?;
        let mut w = ShardedParam::new(
            &rk.cache,
            &rk.streams,
            &dp,
            ParamSpec::new("w", &[numel], DType::F32),
            &cfg,
            (&src).into(),
        )?;
        rk.settle()?;
        let after = rk.p.memory_stats();
        rk.settle()?;
        ensure!(
            after.device_current == base.device_current,
            "the shard stayed on the device"
        );
        ensure!(
            after.pinned_current == base.pinned_current + world * 5 * 4,
            "pinned {} → {}",
            base.pinned_current,
            after.pinned_current
        );
        ensure!(matches!(w.sharded_data(), ShardRef::Pinned(_)));
        let g = w.geometry().clone();
        let shard = rk.read_shard(w.sharded_data(), DType::F32, g.shard_numel())?;
        assert_shard_close("pinned shard", &shard, &g, &full, 0.0, 0.0)?;
        w.unshard(false)?;
        assert_close(
            "gathered",
            &rk.download(w.unsharded()?, DType::F16, numel)?,
            &full,
            0.0,
            0.0,
        )?;
        w.shard()?;
        let mut total = vec![0.0; numel];
        for step in 0..2 {
            let grads: Vec<Vec<f64>> = (0..world).map(|r| grad_of(r + 10 * step, numel)).collect();
            for i in 0..numel {
                total[i] += grads.iter().map(|v| v[i]).sum::<f64>();
            }
            let gbuf = rk.upload(DType::F16, &grads[rk.rank])?;
            w.reduce_grad(
                Some(GradInput {
                    buf: (&gbuf).into(),
                    dtype: DType::F16,
                }),
                ReduceOptions {
                    op: ReduceOp::Sum,
                    scale: None,
                },
            )?;
            rk.sync()?;
        }
        let ShardRef::Pinned(_) = w.sharded_grad().unwrap() else {
            anyhow::bail!("the sharded gradient is not in pinned memory");
        };
        let got = rk.read_shard(w.sharded_grad().unwrap(), DType::F32, g.shard_numel())?;
        assert_shard_close("pinned grad", &got, &g, &total, 1e-6, 1e-7)?;
        let now = rk.device_bytes_settling_at(base.device_current)?;
        ensure!(
            now == base.device_current,
            "device memory left behind: {now} bytes, {} before",
            base.device_current
        );
        Ok(())
    })
}
