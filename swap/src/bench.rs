//! The swap rows of `hprt bench`: every figure is a ratio to a baseline measured in the same run.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use hprt_platform::{DType, DeviceBuffer, PinnedBuffer, Platform, Stream};

use crate::engine::{EngineConfig, PlatformHandle, SwapEngine};
use crate::error::Result;
use crate::sim::{simulate, FrontEnd, SimConfig};
use crate::tensor::{DeviceTensor, Saved, SwapTensor};

const TRIALS: usize = 3;

fn best(mut f: impl FnMut() -> Result<Duration>) -> Result<Duration> {
    let mut best = Duration::MAX;
    for _ in 0..TRIALS {
        best = best.min(f()?);
    }
    Ok(best)
}

fn us(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e6 / n as f64
}

fn size_name(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn tracked(buf: &DeviceBuffer) -> Result<SwapTensor> {
    let t = DeviceTensor::whole(buf.clone(), DType::U8, vec![buf.len()]);
    SwapTensor::new(Saved::Tensor(t))
}

/// Swap benchmark rows (Markdown) for `platform` (as `hprt_platform::get_platform()` returns
/// it, or an `Arc`), with copies up to `max_bytes`:
/// - engine CPU cost per saved tensor: host time of offload, release, reload and wait calls
///   minus that of issuing the same two raw copies (the copies themselves run outside);
/// - offload + reload throughput against raw stream copies of the same bytes, from 4 MiB;
/// - a simulated 8-layer step whose compute outweighs its transfers, with and without swap.
pub fn bench(platform: impl Into<PlatformHandle>, max_bytes: usize) -> Result<String> {
    let platform = platform.into();
    let mut out = String::new();
    per_tensor_cost(&platform, &mut out)?;
    throughput(&platform, max_bytes, &mut out)?;
    step_overhead(&platform, &mut out)?;
    Ok(out)
}

fn per_tensor_cost(platform: &PlatformHandle, out: &mut String) -> Result<()> {
    const N: usize = 2000;
    const BYTES: usize = 256;
    let p: &dyn Platform = &**platform;
    let s = p.create_stream()?;
    let bufs = (0..N)
        .map(|_| p.alloc_device(BYTES))
        .collect::<Result<Vec<_>, _>>()?;
    let host = p.alloc_pinned(N * BYTES)?;
    let mut engine = SwapEngine::new(platform.clone(), EngineConfig::default())?;
    let raw = best(|| {
        let mut t = Duration::ZERO;
        let start = Instant::now();
        for (i, b) in bufs.iter().enumerate() {
            p.copy_async((&host).into(), i * BYTES, b.into(), 0, BYTES, &s)?;
        }
        t += start.elapsed();
        p.synchronize_stream(&s)?;
        let start = Instant::now();
        for (i, b) in bufs.iter().enumerate() {
            p.copy_async(b.into(), 0, (&host).into(), i * BYTES, BYTES, &s)?;
        }
        t += start.elapsed();
        p.synchronize_stream(&s)?;
        Ok(t)
    })?;
    let mut engine_time = |batch: usize| {
        best(|| {
            let mut t = Duration::ZERO;
            let start = Instant::now();
            let mut ts = bufs.iter().map(tracked).collect::<Result<Vec<_>>>()?;
            for chunk in ts.chunks_mut(batch) {
                engine.offload(chunk.iter_mut(), &s)?;
            }
            t += start.elapsed();
            engine.synchronize()?;
            let start = Instant::now();
            engine.finish_offload(ts.iter_mut())?;
            for chunk in ts.chunks_mut(batch) {
                engine.start_reload(chunk.iter_mut())?;
                engine.finish_reload(chunk.iter_mut(), &s)?;
            }
            t += start.elapsed();
            engine.synchronize()?;
            p.synchronize_stream(&s)?;
            Ok(t)
        })
    };
    let single = engine_time(1)?;
    let grouped = engine_time(16)?;
    let raw_us = us(raw, N);
    let _ = writeln!(
        out,
        "##### Swap engine CPU cost per saved tensor ({BYTES} B tensors; goal <= 2 us over the raw copies)\n\n\
         | path | raw copy issue us/tensor | engine us/tensor | engine cost us/tensor |\n\
         |---|---:|---:|---:|"
    );
    for (name, t) in [
        ("one tensor per call (keyed)", single),
        ("16 per call (layer group, pipeline)", grouped),
    ] {
        let swap_us = us(t, N);
        let _ = writeln!(
            out,
            "| {name} | {raw_us:.2} | {swap_us:.2} | {:.2} |",
            swap_us - raw_us
        );
    }
    out.push('\n');
    Ok(())
}

/// Raw D2H then H2D of `dev`'s bytes through `host`, `reps` times; with `release`, the device
/// storage is released and re-acquired between the two as swap does.
fn round_trip_raw(
    p: &dyn Platform,
    dev: &DeviceBuffer,
    host: &PinnedBuffer,
    s: &Stream,
    reps: usize,
    release: bool,
) -> Result<Duration> {
    let bytes = dev.len();
    p.copy_async(host.into(), 0, dev.into(), 0, bytes, s)?; // touch every page first
    p.synchronize_stream(s)?;
    let start = Instant::now();
    for _ in 0..reps {
        p.copy_async(host.into(), 0, dev.into(), 0, bytes, s)?;
        p.synchronize_stream(s)?;
        if release {
            p.resize_device(dev, 0)?;
            p.resize_device(dev, bytes)?;
        }
        p.copy_async(dev.into(), 0, host.into(), 0, bytes, s)?;
        p.synchronize_stream(s)?;
    }
    Ok(start.elapsed())
}

fn throughput(platform: &PlatformHandle, max_bytes: usize, out: &mut String) -> Result<()> {
    let p: &dyn Platform = &**platform;
    let s = p.create_stream()?;
    let mut engine = SwapEngine::new(platform.clone(), EngineConfig::default())?;
    let _ = writeln!(
        out,
        "##### Offload + reload vs raw stream copies of the same bytes (ratio = raw time / swap time; goal >= 0.95 from 4 MiB)\n\n\
         The second baseline adds the device release and re-acquisition swap must make (fresh pages on the cpu backend).\n\n\
         | size | raw D2H+H2D GB/s | swap GB/s | ratio | raw + release/re-acquire GB/s | ratio |\n|---:|---:|---:|---:|---:|---:|"
    );
    let mut bytes = 4 << 20;
    while bytes <= max_bytes.max(4 << 20) {
        let reps = ((256usize << 20) / bytes).clamp(3, 20);
        let dev = p.alloc_device(bytes)?;
        let host = p.alloc_pinned(bytes)?;
        let raw = best(|| round_trip_raw(p, &dev, &host, &s, reps, false))?;
        let raw_release = best(|| round_trip_raw(p, &dev, &host, &s, reps, true))?;
        drop(host);
        let mut t = tracked(&dev)?;
        let swapped = best(|| {
            let start = Instant::now();
            for _ in 0..reps {
                engine.offload([&mut t], &s)?;
                engine.finish_offload([&mut t])?;
                engine.start_reload([&mut t])?;
                engine.finish_reload([&mut t], &s)?;
                p.synchronize_stream(&s)?;
            }
            Ok(start.elapsed())
        })?;
        let gbps = |d: Duration| (2 * bytes * reps) as f64 / d.as_secs_f64() / 1e9;
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            size_name(bytes),
            gbps(raw),
            gbps(swapped),
            raw.as_secs_f64() / swapped.as_secs_f64(),
            gbps(raw_release),
            raw_release.as_secs_f64() / swapped.as_secs_f64()
        );
        p.free_device(&dev)?;
        bytes *= 4;
    }
    out.push('\n');
    Ok(())
}

fn step_overhead(platform: &PlatformHandle, out: &mut String) -> Result<()> {
    let cfg = SimConfig {
        layers: 8,
        tensor_bytes: 1 << 20,
        compute_bytes: 32 << 20,
        ..SimConfig::default()
    };
    // Interleaved trials (none, then each front end), best of each: a shared machine's noise
    // hits every column alike.
    let fronts = [
        FrontEnd::NoSwap,
        FrontEnd::LayerGroup,
        FrontEnd::Keyed,
        FrontEnd::Pipeline,
    ];
    let mut times = [Duration::MAX; 4];
    for _ in 0..TRIALS + 2 {
        for (t, front) in times.iter_mut().zip(fronts) {
            *t = (*t).min(simulate(platform.clone(), front, &cfg)?.elapsed);
        }
    }
    let _ = writeln!(
        out,
        "##### Simulated step with swap vs without (8 layers, 3 MiB activations and 32 MiB of compute per layer and direction; ratio = swap / none; goal <= 1.01)\n\n\
         | front end | no swap ms | swap ms | ratio |\n|---|---:|---:|---:|"
    );
    for (t, front) in times.iter().zip(fronts).skip(1) {
        let _ = writeln!(
            out,
            "| {front:?} | {:.2} | {:.2} | {:.3} |",
            times[0].as_secs_f64() * 1e3,
            t.as_secs_f64() * 1e3,
            t.as_secs_f64() / times[0].as_secs_f64()
        );
    }
    Ok(())
}
