//! Mixed precision, prefetch as a handle, and the gathered memory an unshard/shard cycle
//! returns.

use super::*;

#[test]
fn mixed_precision_gathers_in_param_dtype_and_reduces_in_f32() -> Result<()> {
    for (param_dtype, reduce_dtype) in [
        (DType::BF16, Some(DType::F32)),
        (DType::F16, Some(DType::F32)),
        (DType::BF16, None),
    ] {
        let world = 4;
        let p = cpu(world);
        let shape = [6, 5];
        let numel = 30;
        let full = inexact(3, numel);
        let full32 = round_to(DType::F32, &full);
        let grads: Vec<Vec<f64>> = (0..world)
            .map(|r| round_to(param_dtype, &inexact(50 + r as u64, numel)))
            .collect();
        let rdt = reduce_dtype.unwrap_or(param_dtype);
        let cfg = ParamConfig {
            mp: MixedPrecisionPolicy {
                param_dtype: Some(param_dtype),
                reduce_dtype,
                output_dtype: Some(DType::F32),
            },
            ..Default::default()
        };
        let dp = fsdp(world);
        run_world(&p, world, |rk| {
            let src = rk.upload(DType::F32, &full)?;
            let mut w = ShardedParam::new(
                &rk.cache,
                &rk.streams,
                &dp,
                ParamSpec::new("w", &shape, DType::F32),
                &cfg,
                (&src).into(),
            )?;
            ensure!(w.param_dtype() == param_dtype && w.reduce_dtype() == rdt);
            w.unshard(false)?;
            let got = rk.download(w.unsharded()?, param_dtype, numel)?;
            assert_close("gathered", &got, &round_to(param_dtype, &full32), 0.0, 0.0)?;
            // The output policy casts what compute produced from the gathered parameter.
            let out = rk.p.alloc_device(numel * 4)?;
            let written = cfg.mp.cast_output(
                &*rk.p,
                w.unsharded()?,
                param_dtype,
                (&out).into(),
                numel,
                &rk.streams.compute,
            )?;
            ensure!(written == DType::F32);
            assert_close(
                "output",
                &rk.download((&out).into(), DType::F32, numel)?,
                &got,
                0.0,
                0.0,
            )?;
            w.shard()?;

            let g = rk.upload(param_dtype, &grads[rk.rank])?;
            w.reduce_grad(
                Some(GradInput {
                    buf: (&g).into(),
                    dtype: param_dtype,
                }),
                ReduceOptions {
                    op: ReduceOp::Sum,
                    scale: None,
                },
            )?;
            let geom = w.geometry().clone();
            let got = rk.read_shard(w.sharded_grad().unwrap(), DType::F32, geom.shard_numel())?;
            let total: Vec<f64> = (0..numel)
                .map(|i| grads.iter().map(|g| g[i]).sum())
                .collect();
            let expect = expected_shard(&geom, geom.index(), &total);
            // f32 reduction: f32 rounding only; bf16 reduction: one bf16 rounding of the sum.
            let rtol = if rdt == DType::F32 { 1e-6 } else { 1.0 / 128.0 };
            assert_close("sharded grad", &got, &expect, rtol, 1e-6)?;
            if rdt == DType::BF16 {
                // Reduced in bf16: every element is a bf16 value.
                assert_close("bf16-valued", &got, &round_to(DType::BF16, &got), 0.0, 0.0)?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn prefetch_is_a_handle_and_a_second_unshard_is_a_no_op() -> Result<()> {
    let p = cpu(2);
    let dp = fsdp(2);
    let full = values(9, 12);
    run_world(&p, 2, |rk| {
        let src = rk.upload(DType::F32, &full)?;
        let mut w = ShardedParam::new(
            &rk.cache,
            &rk.streams,
            &dp,
            ParamSpec::new("w", &[12], DType::F32),
            &ParamConfig::default(),
            (&src).into(),
        )?;
        ensure!(matches!(
            w.wait_for_unshard(),
            Err(HsdpError::InvalidState { .. })
        ));
        ensure!(w.unsharded().is_err());
        let handle = w
            .unshard(true)?
            .expect("the first unshard starts an all-gather");
        ensure!(w.state() == ParamState::Unsharding);
        ensure!(w.unsharded().is_err(), "readable before the wait");
        ensure!(w.unshard(true)?.is_none(), "second unshard while pending");
        ensure!(w.unshard(false)?.is_none());
        rk.p.synchronize_stream(&rk.streams.all_gather)?;
        ensure!(handle.is_complete(&*rk.p)?);
        w.wait_for_unshard()?;
        ensure!(w.state() == ParamState::Unsharded);
        ensure!(w.unshard(true)?.is_none(), "unshard while unsharded");
        w.wait_for_unshard()?; // no-op when unsharded
        assert_close(
            "gathered",
            &rk.download(w.unsharded()?, DType::F32, 12)?,
            &full,
            0.0,
            0.0,
        )?;
        w.shard()?;
        // shard() while pending waits for the all-gather first.
        w.unshard(true)?.expect("new all-gather");
        w.shard()?;
        ensure!(w.state() == ParamState::Sharded);
        w.shard()?; // no-op when sharded
        Ok(())
    })
}

#[test]
fn unshard_shard_cycles_return_the_gathered_memory() -> Result<()> {
    let world = 4;
    let p = cpu(world);
    let dp = fsdp(world);
    let full = values(11, 7 * 9);
    run_world(&p, world, |rk| {
        let src = rk.upload(DType::F32, &full)?;
        for (shard, offload) in [
            (0, OffloadPolicy::None),
            (1, OffloadPolicy::None),
            (0, OffloadPolicy::PinnedHost),
        ] {
            let cfg = ParamConfig {
                shard: Some(Placement::Shard(shard)),
                offload,
                mp: MixedPrecisionPolicy {
                    param_dtype: Some(DType::BF16),
                    ..Default::default()
                },
                ..Default::default()
            };
            let mut w = ShardedParam::new(
                &rk.cache,
                &rk.streams,
                &dp,
                ParamSpec::new("w", &[7, 9], DType::F32),
                &cfg,
                (&src).into(),
            )?;
            rk.settle()?;
            let base = rk.p.memory_stats().device_current;
            let g = w.geometry().clone();
            for cycle in 0..3 {
                w.unshard(false)?;
                let used = rk.p.memory_stats().device_current - base;
                // At least the padded gathered buffer (plus the re-interleaved copy for Shard(1)).
                let mut want = g.padded_numel() * 2;
                if !g.gathers_in_place() {
                    want += g.numel() * 2;
                }
                ensure!(
                    used >= want,
                    "cycle {cycle}: {used} bytes in use, expected ≥ {want}"
                );
                let got = rk.download(w.unsharded()?, DType::BF16, 63)?;
                assert_close("gathered", &got, &round_to(DType::BF16, &full), 0.0, 0.0)?;
                w.shard()?;
                let now = rk.device_bytes_settling_at(base)?;
                ensure!(now == base, "cycle {cycle} (Shard({shard}), {offload:?}): {now} bytes after shard, {base} before");
            }
        }
        Ok(())
    })
}
