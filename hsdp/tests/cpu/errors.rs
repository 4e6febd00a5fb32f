//! Bad inputs and failed gathers as typed errors, and a parameter keeping a scoped platform
//! alive.

use super::*;

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let p = cpu(2);
    let dp = fsdp(2);
    run_world(&p, 2, |rk| {
        let src = rk.upload(DType::F32, &values(1, 4))?;
        let cfg = ParamConfig::default();
        let new = |spec: ParamSpec, cfg: &ParamConfig| {
            ShardedParam::new(&rk.cache, &rk.streams, &dp, spec, cfg, (&src).into())
        };
        ensure!(matches!(
            new(ParamSpec::new("big", &[5], DType::F32), &cfg),
            Err(HsdpError::InvalidParam { .. })
        ));
        ensure!(matches!(
            new(ParamSpec::new("empty", &[0], DType::F32), &cfg),
            Err(HsdpError::InvalidParam { ref message, .. }) if message.contains("no elements")
        ));
        // An element count past usize is not an empty shape (ISSUE 32 item 18).
        ensure!(matches!(
            new(ParamSpec::new("huge", &[1 << 40, 1 << 40], DType::F32), &cfg),
            Err(HsdpError::InvalidParam { ref message, .. })
                if message.contains("more elements than a usize holds")
        ));
        ensure!(matches!(
            new(ParamSpec::new("int", &[4], DType::I32), &cfg),
            Err(HsdpError::UnsupportedDType { .. })
        ));
        let dim3 = ParamConfig {
            shard: Some(Placement::Shard(3)),
            ..Default::default()
        };
        ensure!(matches!(
            new(ParamSpec::new("w", &[4], DType::F32), &dim3),
            Err(HsdpError::InvalidPlacement(_))
        ));
        let rep = ParamConfig {
            shard: Some(Placement::Replicate),
            ..Default::default()
        };
        ensure!(matches!(
            new(ParamSpec::new("w", &[4], DType::F32), &rep),
            Err(HsdpError::InvalidPlacement(_))
        ));
        let mut w = new(ParamSpec::new("w", &[4], DType::F32), &cfg)?;
        let short = rk.p.alloc_device(8)?;
        ensure!(matches!(
            w.reduce_grad(
                Some(GradInput {
                    buf: (&short).into(),
                    dtype: DType::F32
                }),
                ReduceOptions::default()
            ),
            Err(HsdpError::InvalidParam { .. })
        ));
        ensure!(matches!(
            w.wait_for_reduce(),
            Err(HsdpError::InvalidState { .. })
        ));
        Ok(())
    })
}

/// Ranks that disagree on a parameter's shape, or a rank that skips an unshard or a reduction:
/// the failed all-gather (or reduce-scatter) reaches the compute stream
/// (`failed_collectives_reach_compute`).
#[test]
fn a_failed_gather_reaches_the_compute_stream() -> Result<()> {
    failed_collectives_reach_compute(&cpu(2), std::time::Duration::from_secs(20))
}

/// hsdp's objects hold their platform as a handle, not a borrow: a parameter built over a
/// platform opened in an inner scope (not the process-wide one) outlives that scope, its cache
/// and every other handle, stays usable, and releases the platform when it is dropped.
#[test]
fn a_parameter_keeps_a_scoped_platform_alive() -> Result<()> {
    let full = values(3, 24);
    let dtype = DType::F32;
    let (mut w, streams, weak) = {
        let p = cpu(1);
        let comm = p.comm_init(&p.unique_id()?, 0, 1)?;
        let cache = hprt_hsdp::GroupCache::new(&p, comm);
        let streams = hprt_hsdp::HsdpStreams::new(&*p)?;
        let src = upload(&*p, &streams.compute, dtype, &full)?;
        let spec = ParamSpec::new("w", &[4, 6], dtype);
        let cfg = ParamConfig::default();
        let w = ShardedParam::new(&cache, &streams, &fsdp(1), spec, &cfg, (&src).into())?;
        (w, streams, std::sync::Arc::downgrade(&p))
    };
    ensure!(
        weak.strong_count() == 1,
        "only the parameter holds the platform"
    );
    w.unshard(false)?;
    let p = weak.upgrade().expect("the parameter kept its platform");
    let gathered = download(&*p, &streams.compute, w.unsharded()?, dtype, full.len())?;
    assert_close("unsharded", &gathered, &full, 0.0, 0.0)?;
    w.shard()?;
    p.synchronize_stream(&streams.compute)?;
    drop((p, w));
    ensure!(
        weak.upgrade().is_none(),
        "dropping the parameter released the platform"
    );
    Ok(())
}
