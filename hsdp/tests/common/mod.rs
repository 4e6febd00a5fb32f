//! Shared test harness: in-process ranks over one platform value, host encode/decode per dtype,
//! deterministic data and tolerance checks against f64 references.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use half::{bf16, f16};
use hprt_hsdp::{GroupCache, HsdpStreams, ShardRef};
use hprt_platform::{CpuBackend, CpuConfig, DType, DeviceBuffer, Place, Platform, PlatformHandle};

/// A cpu platform with one device per rank (so memory accounting is per rank), honouring
/// `HP_CPU_JITTER` and the other `HP_CPU_*` variables. Opened here, not process-wide: hsdp's
/// objects keep it alive through their handles.
pub fn cpu(world: usize) -> Arc<dyn Platform> {
    let mut c = CpuConfig::from_env().expect("HP_CPU_* variables");
    c.devices = world.max(1);
    c.device_memory = 256 << 20;
    c.collective_timeout = Duration::from_secs(60);
    Arc::new(CpuBackend::new(c))
}

/// What one rank's closure gets.
pub struct Rank<'p> {
    pub rank: usize,
    pub world: usize,
    pub p: PlatformHandle,
    pub cache: GroupCache,
    pub streams: HsdpStreams,
    barrier: &'p std::sync::Barrier,
}

impl Rank<'_> {
    pub fn sync(&self) -> Result<()> {
        let s = &self.streams;
        for st in [&s.compute, &s.all_gather, &s.reduce] {
            self.p.synchronize_stream(st)?;
        }
        Ok(())
    }
    /// Synchronizes this rank's streams and waits for every rank to do the same, so no peer's
    /// collective still references this rank's buffers.
    pub fn settle(&self) -> Result<()> {
        self.sync()?;
        self.barrier.wait();
        Ok(())
    }
    /// Device bytes in use once they reach `want` (peers release collective references to this
    /// rank's buffers as their stream jobs finish), or what is in use after 2 s.
    pub fn device_bytes_settling_at(&self, want: usize) -> Result<usize> {
        self.settle()?;
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let now = self.p.memory_stats().device_current;
            if now == want || std::time::Instant::now() > deadline {
                return Ok(now);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    pub fn upload(&self, dtype: DType, values: &[f64]) -> Result<DeviceBuffer> {
        upload(&*self.p, &self.streams.compute, dtype, values)
    }
    /// Reads `count` elements after the compute stream's queued work.
    pub fn download(
        &self,
        buf: Place<&DeviceBuffer>,
        dtype: DType,
        count: usize,
    ) -> Result<Vec<f64>> {
        download(&*self.p, &self.streams.compute, buf, dtype, count)
    }
    pub fn read_shard(&self, r: ShardRef<'_>, dtype: DType, count: usize) -> Result<Vec<f64>> {
        match r {
            ShardRef::Device(b) => self.download(b, dtype, count),
            ShardRef::Pinned(h) => {
                self.p.synchronize_stream(&self.streams.compute)?;
                let mut bytes = vec![0u8; count * dtype.size()];
                h.read(0, &mut bytes)?;
                Ok(decode(dtype, &bytes))
            }
        }
    }
}

/// Runs `f` on `world` rank threads sharing `p`; the first failure (or panic) fails the call.
pub fn run_world<F>(p: &Arc<dyn Platform>, world: usize, f: F) -> Result<()>
where
    F: Fn(&Rank<'_>) -> Result<()> + Sync,
{
    let id = p.unique_id()?;
    let barrier = std::sync::Barrier::new(world);
    let results: Vec<Result<()>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (id, f, barrier) = (&id, &f, &barrier);
                sc.spawn(move || -> Result<()> {
                    p.set_device(rank % p.device_count())?;
                    let comm = p.comm_init(id, rank, world)?;
                    let ctx = Rank {
                        rank,
                        world,
                        p: p.into(),
                        cache: GroupCache::new(p, comm),
                        streams: HsdpStreams::new(&**p)?,
                        barrier,
                    };
                    let out = f(&ctx).with_context(|| format!("rank {rank} of {world}"));
                    let synced = ctx.sync();
                    out?;
                    synced?;
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("rank {r} panicked")))
            })
            .collect()
    });
    results.into_iter().collect()
}

pub fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        match dtype {
            DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
            other => panic!("test data is floating point, not {other}"),
        }
    }
    out
}

pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
            DType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::F16 => f16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::BF16 => bf16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            other => panic!("test data is floating point, not {other}"),
        })
        .collect()
}

/// `v` rounded to `dtype` and back.
pub fn round_to(dtype: DType, v: &[f64]) -> Vec<f64> {
    decode(dtype, &encode(dtype, v))
}

pub fn upload(
    p: &dyn Platform,
    s: &hprt_platform::Stream,
    dtype: DType,
    values: &[f64],
) -> Result<DeviceBuffer> {
    let bytes = encode(dtype, values);
    let b = p.alloc_device(bytes.len())?;
    p.write_device_sync(&b, 0, &bytes, s)?;
    Ok(b)
}

pub fn download(
    p: &dyn Platform,
    s: &hprt_platform::Stream,
    buf: Place<&DeviceBuffer>,
    dtype: DType,
    count: usize,
) -> Result<Vec<f64>> {
    let mut bytes = vec![0u8; count * dtype.size()];
    p.read_device_sync(buf.mem, buf.offset, &mut bytes, s)?;
    Ok(decode(dtype, &bytes))
}

/// Deterministic values k/64 with |k| ≤ 96: exact in bf16, f16 and f32, so sums of a few are
/// exact too and differences from a reference come from the code, not the data.
pub fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0xD1B5_4A32_D192_ED03);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % 193) as f64 - 96.0) / 64.0
        })
        .collect()
}

/// Fails unless every element is within `atol + rtol * |expected|`.
pub fn assert_close(what: &str, got: &[f64], expected: &[f64], rtol: f64, atol: f64) -> Result<()> {
    if got.len() != expected.len() {
        bail!(
            "{what}: {} elements, expected {}",
            got.len(),
            expected.len()
        );
    }
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        let within = (g - e).abs() <= atol + rtol * e.abs();
        if !within {
            bail!("{what}: element {i} is {g}, expected {e} (rtol {rtol}, atol {atol})");
        }
    }
    Ok(())
}

/// [`assert_close`] of a shard read back on its own rank, whose index `geom` carries, against
/// its part of `full`.
pub fn assert_shard_close(
    what: &str,
    got: &[f64],
    geom: &hprt_hsdp::ShardGeometry,
    full: &[f64],
    rtol: f64,
    atol: f64,
) -> Result<()> {
    assert_close(
        what,
        got,
        &expected_shard(geom, geom.index(), full),
        rtol,
        atol,
    )
}

/// The elements of a full tensor that shard `k` of `geom` holds, in shard order, zeros for
/// padding: the host reference of sharding.
pub fn expected_shard(geom: &hprt_hsdp::ShardGeometry, k: usize, full: &[f64]) -> Vec<f64> {
    let shape = geom.shape();
    let d = geom.dim();
    let outer: usize = shape[..d].iter().product();
    let inner: usize = shape[d + 1..].iter().product();
    let mut out = Vec::with_capacity(geom.shard_numel());
    for o in 0..outer {
        let chunk = shape[d].div_ceil(geom.group_size());
        for row in k * chunk..(k + 1) * chunk {
            for i in 0..inner {
                out.push(if row < shape[d] {
                    full[(o * shape[d] + row) * inner + i]
                } else {
                    0.0
                });
            }
        }
    }
    out
}

/// Ranks that disagree on a parameter's shape, or a rank that skips an unshard or a gradient
/// reduction: the failed all-gather (or reduce-scatter) must reach the compute stream that waited on it, never an
/// all-zero parameter or gradient with success; each case takes less than `bound` (a dead peer
/// costs at most one collective timeout, not one per queued collective).
pub fn failed_collectives_reach_compute(p: &Arc<dyn Platform>, bound: Duration) -> Result<()> {
    use hprt_hsdp::{
        DataParallelMesh, DeviceMesh, GradInput, ParamConfig, ParamSpec, ReduceOptions,
        ShardedParam,
    };
    let fsdp = DataParallelMesh::fsdp(DeviceMesh::contiguous(&[2])?)?;
    for (shapes_differ, skip, reduce) in [
        (true, false, false),
        (false, true, false),
        (true, false, true),
        (false, true, true),
    ] {
        let start = std::time::Instant::now();
        run_world(p, 2, |rk| {
            let n = if rk.rank == 0 || !shapes_differ {
                8
            } else {
                12
            };
            let src = rk.upload(DType::F32, &values(3, n))?;
            let spec = ParamSpec::new("w", &[n], DType::F32);
            let config = ParamConfig::default();
            let mut w =
                ShardedParam::new(&rk.cache, &rk.streams, &fsdp, spec, &config, (&src).into())?;
            if skip && rk.rank == 1 {
                // This rank fails before its unshard: its communicators go with it.
                return Ok(());
            }
            let side = if reduce {
                let grad = rk.upload(DType::F32, &values(1000 + rk.rank as u64, n))?;
                let input = GradInput {
                    buf: (&grad).into(),
                    dtype: DType::F32,
                };
                w.reduce_grad(Some(input), ReduceOptions::default())?;
                &rk.streams.reduce
            } else {
                w.unshard(false)?;
                anyhow::ensure!(
                    w.unsharded().is_ok(),
                    "the parameter is not unsharded after unshard(false)"
                );
                &rk.streams.all_gather
            };
            let synced = rk.p.synchronize_stream(&rk.streams.compute);
            anyhow::ensure!(
                synced.is_err(),
                "rank {} (shapes differ {shapes_differ}, skipped {skip}, reduce {reduce}): the compute stream synchronized after a failed collective",
                rk.rank
            );
            // Reported on the collective's stream too (once); what is left is clean.
            anyhow::ensure!(rk.p.synchronize_stream(side).is_err());
            Ok(())
        })?;
        anyhow::ensure!(
            start.elapsed() < bound,
            "a failed collective took {:?} (bound {bound:?})",
            start.elapsed()
        );
    }
    Ok(())
}
