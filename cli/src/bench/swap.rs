//! The swap rows of `hprt bench`: every figure is a ratio to a baseline measured in the same run.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use hprt_platform::{DType, DeviceBuffer, PinnedBuffer, Platform, Stream};

use std::sync::Arc;

use hprt_compress::data::{generate, DataKind};
use hprt_compress::CodecDType;

use hprt_swap::sim::{borrow, simulate, FrameworkAllocator, FrontEnd, PayloadKind, SimConfig};
use hprt_swap::{
    Compression, DeviceTensor, EngineConfig, KeyedSwap, PipelineConfig, PipelineOffload,
    PlatformHandle, Result, Saved, SwapEngine, SwapManager, SwapTensor,
};

use super::{best_of, TRIALS};

/// [`best_of`] with the swap error, so closures ending in `Ok(..)` need no annotation.
fn best(f: impl FnMut() -> Result<Duration>) -> Result<Duration> {
    best_of(f)
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
    front_end_cost(&platform, &mut out)?;
    throughput(&platform, max_bytes, &mut out)?;
    compressed_link_bytes(&platform, 1 << 20, &mut out)?;
    step_overhead(&platform, &mut out)?;
    Ok(out)
}

/// `n` device buffers of `bytes`, a stream, and the raw baseline of the per-tensor costs:
/// [`raw_issue`] of them, best of the trials.
fn small_tensors(
    platform: &PlatformHandle,
    n: usize,
    bytes: usize,
) -> Result<(Stream, Vec<DeviceBuffer>, Duration)> {
    let p: &dyn Platform = &**platform;
    let s = p.create_stream()?;
    let bufs = (0..n)
        .map(|_| p.alloc_device(bytes))
        .collect::<Result<Vec<_>, _>>()?;
    let host = p.alloc_pinned(n * bytes)?;
    let raw = best(|| raw_issue(p, &bufs, &host, &s))?;
    Ok((s, bufs, raw))
}

/// Host time of issuing a device-to-host copy of every buffer into its slot of `host`, then
/// the copies back (the raw baseline of the per-tensor costs; the copies run outside it).
fn raw_issue(
    p: &dyn Platform,
    bufs: &[DeviceBuffer],
    host: &PinnedBuffer,
    s: &Stream,
) -> Result<Duration> {
    let mut t = Duration::ZERO;
    for d2h in [true, false] {
        let start = Instant::now();
        for (i, b) in bufs.iter().enumerate() {
            let (len, at) = (b.len(), i * b.len());
            if d2h {
                p.copy_async(host.into(), at, b.into(), 0, len, s)?;
            } else {
                p.copy_async(b.into(), 0, host.into(), at, len, s)?;
            }
        }
        t += start.elapsed();
        p.synchronize_stream(s)?;
    }
    Ok(t)
}

/// One saved value of `bytes` of a payload kind (borrowed memory stands for a framework's).
fn payload(p: &PlatformHandle, kind: PayloadKind, buf: &DeviceBuffer) -> Result<Saved> {
    let len = buf.len();
    Ok(Saved::Tensor(match kind {
        PayloadKind::Owned => DeviceTensor::whole(buf.clone(), DType::U8, vec![len]),
        PayloadKind::Borrowed => DeviceTensor::borrowed(
            borrow(&**p, buf, 0, len)?,
            DType::U8,
            vec![len],
            None,
            Arc::new(FrameworkAllocator(p.clone())),
        )?,
    }))
}

/// Host time of a whole forward + backward through each front end, per saved tensor, minus
/// the same raw copies issued in the same pattern (one host wait per layer of 16 tensors).
fn front_end_cost(platform: &PlatformHandle, out: &mut String) -> Result<()> {
    const LAYERS: usize = 64;
    const PER_LAYER: usize = 16;
    const BYTES: usize = 256;
    const N: usize = LAYERS * PER_LAYER;
    let (s, bufs, raw) = small_tensors(platform, N, BYTES)?;
    let _ = writeln!(
        out,
        "##### Front-end cost per saved tensor ({BYTES} B tensors, {LAYERS} layers of {PER_LAYER}; host time of a forward + backward through the front end, its waits for the copies included, minus issuing the same two raw copies; goal <= 2 us)\n\n\
         | front end | payload | raw copy issue us/tensor | front end us/tensor | cost us/tensor |\n|---|---|---:|---:|---:|"
    );
    for kind in PayloadKind::ALL {
        for front in FrontEnd::SWAPPING {
            let t = best(|| {
                let values = bufs
                    .iter()
                    .map(|b| payload(platform, kind, b))
                    .collect::<Result<Vec<_>>>()?;
                drive(platform, front, values, PER_LAYER, &s)
            })?;
            let (raw_us, t_us) = (us(raw, N), us(t, N));
            let _ = writeln!(
                out,
                "| {front:?} | {kind:?} | {raw_us:.2} | {t_us:.2} | {:.2} |",
                t_us - raw_us
            );
        }
    }
    out.push('\n');
    Ok(())
}

/// Forward (save every value, `per_layer` to a layer) and backward (read them back in reverse)
/// through `front`; returns the host time of both.
fn drive(
    platform: &PlatformHandle,
    front: FrontEnd,
    values: Vec<Saved>,
    per_layer: usize,
    s: &Stream,
) -> Result<Duration> {
    let layers = values.len() / per_layer;
    let mut values = values.into_iter();
    let mut layer_values = |_: usize| values.by_ref().take(per_layer).collect::<Vec<_>>();
    match front {
        FrontEnd::Keyed => {
            let mut k = KeyedSwap::new(platform.clone())?;
            let ctx: Vec<_> = (0..layers).map(|_| k.register_layer("l.*")).collect();
            let all: Vec<_> = (0..layers).map(&mut layer_values).collect();
            let start = Instant::now();
            let mut packed = Vec::new();
            for (l, vs) in all.into_iter().enumerate() {
                for v in vs {
                    packed.push(k.swap_out_cur_and_release_prev(&ctx[l], v, s)?);
                }
            }
            for pk in packed.into_iter().rev() {
                drop(k.wait_cur_and_prefetch_next(pk, s, true)?);
            }
            let t = start.elapsed();
            k.end_iteration()?;
            Ok(t)
        }
        FrontEnd::LayerGroup => {
            let mut m = SwapManager::new(platform.clone())?;
            let ids: Vec<_> = (0..layers).map(|_| m.new_layer()).collect();
            for w in ids.windows(2) {
                m.set_forward_prefetch_layer(w[0], w[1])?;
            }
            let all: Vec<_> = (0..layers).map(&mut layer_values).collect();
            let start = Instant::now();
            let mut refs = Vec::new();
            for (l, vs) in all.into_iter().enumerate() {
                m.forward_pre(ids[l])?;
                for v in vs {
                    refs.push(m.save(v)?);
                }
                m.forward_post(ids[l], s)?;
            }
            for l in (0..layers).rev() {
                m.backward_pre(ids[l], s)?;
                for r in &refs[l * per_layer..(l + 1) * per_layer] {
                    drop(m.take(*r)?);
                }
                m.backward_post(ids[l])?;
            }
            let t = start.elapsed();
            m.end_iteration()?;
            Ok(t)
        }
        FrontEnd::Pipeline => {
            let cfg = PipelineConfig {
                min_tensor_elems: 1,
                ..PipelineConfig::default()
            };
            let mut o = PipelineOffload::new(platform.clone(), cfg)?;
            let names: Vec<String> = (0..layers).map(|l| format!("l{l}")).collect();
            let all: Vec<_> = (0..layers).map(&mut layer_values).collect();
            let start = Instant::now();
            o.init_chunk(1, None)?;
            let mut tags = Vec::new();
            for (l, vs) in all.into_iter().enumerate() {
                o.group_start(&names[l])?;
                for v in vs {
                    tags.push(o.save(v)?);
                }
                o.group_commit(s, Vec::new(), false)?;
            }
            for l in (0..layers).rev() {
                o.backward_group_begin(&names[l], s)?;
                for tag in &tags[l * per_layer..(l + 1) * per_layer] {
                    drop(o.get(tag, s)?);
                }
                o.backward_group_end()?;
            }
            let t = start.elapsed();
            o.reset()?;
            Ok(t)
        }
        FrontEnd::NoSwap => Ok(Duration::ZERO),
    }
}

/// What the `Device` rows of [`compressed_link_bytes`] ran: the platform's device codec, by
/// name (`codec_for`: the CUDA kernels on cuda, the CPU codec through host functions elsewhere).
fn device_codec_note(p: &dyn Platform) -> String {
    match hprt_compress::codec_for(p).name() {
        "host" if p.capabilities().device_memory_is_host => format!(
            "The device codec is the host fallback on this backend ({}; no device kernels): the CPU codec in host functions on the stream, reading and writing the device memory itself (host memory here: no staging copies); `auto` picks the host stage for it, which moves the raw bytes but holds no pinned memory while offloaded.",
            p.backend()
        ),
        "host" => format!(
            "The device codec is the host fallback on this backend ({}; no device kernels): its own staging copies through pinned memory are not counted, as a device codec would not make them; `auto` picks the host stage for it, which moves the raw bytes but holds no pinned memory while offloaded.",
            p.backend()
        ),
        "cuda" => format!(
            "The device codec is the CUDA kernels on this backend ({}, codec `cuda`: encode and decode run on the device, compiled by NVRTC); only the encoding crosses the link and is held in pinned memory; `auto` picks it.",
            p.backend()
        ),
        other => format!(
            "The device codec is `{other}` on this backend ({}); `auto` picks it.",
            p.backend()
        ),
    }
}

/// Compress-then-swap against plain swap on the codec's synthetic activations of `numel`
/// elements: bytes over the host link, pinned memory held, codec time.
fn compressed_link_bytes(platform: &PlatformHandle, numel: usize, out: &mut String) -> Result<()> {
    let p: &dyn Platform = &**platform;
    let s = p.create_stream()?;
    let _ = writeln!(
        out,
        "##### Compress-then-swap vs plain swap (bf16 synthetic activations of `hprt_compress::data`, {numel} elements each; link = bytes the engine moved over the host link both ways, ratio = plain / compressed)\n\n\
         {}\n\n\
         | data | mode | link MiB | link ratio | pinned held while offloaded MiB | codec ms |\n|---|---|---:|---:|---:|---:|",
        device_codec_note(p)
    );
    for kind in [
        DataKind::Gelu,
        DataKind::LayerNorm,
        DataKind::Softmax,
        DataKind::Gaussian,
    ] {
        let data = generate(kind, CodecDType::BF16, numel, 3);
        let mut plain = 0u64;
        for mode in [
            Compression::Off,
            Compression::Device,
            Compression::HostStage,
        ] {
            let mut engine = SwapEngine::new(
                platform.clone(),
                EngineConfig {
                    compression: mode,
                    ..EngineConfig::default()
                },
            )?;
            let buf = p.alloc_device(data.len())?;
            p.write_device_sync(&buf, 0, &data, &s)?;
            let t = DeviceTensor::whole(buf.clone(), DType::BF16, vec![numel]);
            let mut t = SwapTensor::new(Saved::Tensor(t))?;
            engine.offload([&mut t], &s)?;
            engine.finish_offload([&mut t])?;
            let held = engine.pool_stats().bytes_in_use;
            engine.start_reload([&mut t])?;
            engine.finish_reload([&mut t], &s)?;
            let mut back = vec![0u8; data.len()];
            p.read_device_sync(&buf, 0, &mut back, &s)?;
            if back != data {
                return Err(hprt_swap::SwapError::Order(format!(
                    "{mode:?} swap of {} changed bytes",
                    kind.name()
                )));
            }
            let st = engine.stats();
            let link = st.link_d2h_bytes + st.link_h2d_bytes;
            if mode == Compression::Off {
                plain = link;
            }
            let _ = writeln!(
                out,
                "| {} | {mode:?} | {:.2} | {:.2} | {:.2} | {:.1} |",
                kind.name(),
                link as f64 / (1 << 20) as f64,
                plain as f64 / link.max(1) as f64,
                held as f64 / (1 << 20) as f64,
                st.codec_ns as f64 / 1e6
            );
            p.free_device(&buf)?;
        }
    }
    out.push('\n');
    Ok(())
}

fn per_tensor_cost(platform: &PlatformHandle, out: &mut String) -> Result<()> {
    const N: usize = 2000;
    const BYTES: usize = 256;
    let p: &dyn Platform = &**platform;
    let (s, bufs, raw) = small_tensors(platform, N, BYTES)?;
    let mut engine = SwapEngine::new(platform.clone(), EngineConfig::default())?;
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
         The second baseline adds the device release and re-acquisition swap must make (served by the backend's allocation cache once warm, `HP_CPU_ALLOC_CACHE` / `HP_CUDA_ALLOC_CACHE`; with the cache off, a fresh allocation each time).\n\n\
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The compress rows name the codec that ran: on cuda the CUDA kernels (the section said
    /// "the host fallback on this backend (no device kernels)" on every backend before), on
    /// cpu the host fallback.
    #[test]
    fn the_compress_rows_name_the_device_codec_that_ran() {
        let (cuda, cpu) = crate::bench::cuda_and_cpu();
        let note = device_codec_note(&cuda);
        assert!(note.contains("the CUDA kernels"), "{note}");
        assert!(!note.contains("host fallback"), "{note}");
        let mut out = String::new();
        compressed_link_bytes(&PlatformHandle::from(cpu), 4096, &mut out).unwrap();
        assert!(
            out.contains("the host fallback on this backend (cpu"),
            "{out}"
        );
        assert!(!out.contains("CUDA kernels"), "{out}");
        assert!(out.contains("| gelu | Device |"), "{out}");
    }
}
