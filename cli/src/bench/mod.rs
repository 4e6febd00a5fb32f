//! `hprt bench`: the selected platform against baselines measured in the same run.
//!
//! Every figure is a ratio to something measured seconds earlier on the same machine (a plain
//! `memcpy`, a bare channel send), so numbers stay comparable across machines; the table names
//! the machine and the platform it ran on.
//!
//! - [`swap`] — the swap rows (the engine, the three front ends, the simulated step).
//! - [`codec`] — the CPU codec against zstd level 1 and LZ4; the device codec against a copy.
//! - [`hsdp`] — all-gather / reduce-scatter through hsdp against the direct collective.

pub mod codec;
pub mod hsdp;
pub mod swap;

use std::fmt::Write as _;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use hprt_platform::{
    cuda::CudaBackend, BackendKind, CopyKind, DType, DeviceBuffer, Memory, PinnedBuffer, Platform,
    ReduceOp, Stream,
};

const TRIALS: usize = 3;

/// Best (shortest) of `TRIALS` runs of `f`, each returning the time it measured itself.
fn best_of<E>(
    mut f: impl FnMut() -> std::result::Result<Duration, E>,
) -> std::result::Result<Duration, E> {
    let mut best = Duration::MAX;
    for _ in 0..TRIALS {
        best = best.min(f()?);
    }
    Ok(best)
}

/// [`best_of`] with this module's error, so closures ending in `Ok(..)` need no annotation.
fn best(f: impl FnMut() -> Result<Duration>) -> Result<Duration> {
    best_of(f)
}

fn reps_for(bytes: usize) -> usize {
    ((256usize << 20) / bytes).clamp(5, 20_000)
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn size_name(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// A plain single-threaded memcpy of `bytes`, `reps` times, between buffers touched beforehand
/// (one warm copy, as the stream measurements make).
fn memcpy_time(bytes: usize, reps: usize) -> Duration {
    let src = vec![0x5au8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let t = Instant::now();
    for _ in 0..reps {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
    }
    t.elapsed()
}

fn stream_copy_time(
    p: &dyn Platform,
    dst: Memory<&DeviceBuffer, &PinnedBuffer>,
    src: Memory<&DeviceBuffer, &PinnedBuffer>,
    bytes: usize,
    reps: usize,
    s: &Stream,
) -> Result<Duration> {
    p.copy_async(dst, 0, src, 0, bytes, s)?; // warm: first touch of the destination pages
    p.synchronize_stream(s)?;
    let t = Instant::now();
    for _ in 0..reps {
        p.copy_async(dst, 0, src, 0, bytes, s)?;
    }
    p.synchronize_stream(s)?;
    Ok(t.elapsed())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown cpu".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{cpu}, {cores} cores")
}

const BEGIN: &str = "<!-- hprt bench: begin -->";
const END: &str = "<!-- hprt bench: end -->";

/// `document` with the text between its `hprt bench` markers replaced by `table` (how
/// `hprt bench --output BENCHMARKS.md` refreshes the measured part and keeps the commentary
/// around it), or `None` when the document has no such markers.
pub fn splice(document: &str, table: &str) -> Option<String> {
    let start = document.find(BEGIN)? + BEGIN.len();
    let end = start + document[start..].find(END)?;
    Some(format!(
        "{}\n\n{}\n{}",
        &document[..start],
        table.trim_end(),
        &document[end..]
    ))
}

/// The sections `hprt bench --only` selects from.
pub const SECTIONS: [&str; 5] = ["platform", "swap", "compress", "device-codec", "hsdp"];

pub fn run(p: &'static dyn Platform, max_bytes: usize, only: &[String]) -> Result<String> {
    let wanted = |section: &str| only.is_empty() || only.iter().any(|o| o == section);
    let mut out = String::new();
    let info = p.info();
    writeln!(out, "### `hprt bench` on the {} platform", info.backend)?;
    writeln!(out)?;
    writeln!(out, "- machine: {}", machine())?;
    writeln!(out, "- platform: {} ({})", info.backend, info.driver)?;
    writeln!(
        out,
        "- every ratio compares with a baseline measured in the same run; best of {TRIALS} trials"
    )?;
    writeln!(out)?;
    if wanted("platform") {
        copies(p, max_bytes, &mut out)?;
        if p.backend() == BackendKind::Cuda {
            cuda_vs_raw(p, max_bytes, &mut out)?;
        }
        enqueue_overhead(p, &mut out)?;
        collectives(p, max_bytes, &mut out)?;
    }
    if wanted("swap") {
        writeln!(out, "#### swap (`hprt-swap`)\n")?;
        writeln!(out, "{}", swap_settings(p))?;
        out += &swap::bench(p, max_bytes.min(64 << 20))?;
        writeln!(out)?;
    }
    if wanted("compress") {
        // The CPU codec on one host core, whatever the platform.
        writeln!(out, "#### compress (`hprt-compress`, CPU codec)\n")?;
        out += &codec::bench(&codec::BenchOptions::default())?;
        writeln!(out)?;
    }
    // Its own section: on a GPU machine the CPU codec's minutes are not what is measured.
    if wanted("device-codec") && !p.capabilities().device_memory_is_host {
        device_codec(p, max_bytes, &mut out)?;
    }
    if wanted("hsdp") {
        writeln!(out, "#### hsdp (`hprt-hsdp`)\n")?;
        out += &hsdp::bench(p, max_bytes.min(64 << 20))?;
        writeln!(out)?;
    }
    Ok(out)
}

/// What the swap rows ran with besides the platform: the device codec of compress-then-swap
/// (`codec_for`) and, where the backend reports one, its device allocation cache (swap releases
/// and re-acquires a storage at every offload and reload).
fn swap_settings(p: &dyn Platform) -> String {
    let codec = hprt_compress::codec_for(p);
    let what = match codec.name() {
        "cuda" => "the CUDA kernels, compiled by NVRTC on the device",
        "host" => "the CPU codec in host functions: no device kernels on this backend",
        _ => "the backend's",
    };
    let mut s = format!("- device codec: `{}` ({what})\n", codec.name());
    for (key, value) in p.info().settings {
        if key == "device allocation cache" {
            s += &format!("- {key}: {value}\n");
        }
    }
    s
}

/// The platform's device codec (on cuda the CUDA kernels) against a device-to-device copy of
/// the same bytes, timed with device events; the bytes are checked against the CPU codec.
fn device_codec(p: &dyn Platform, max_bytes: usize, out: &mut String) -> Result<()> {
    use codec::device_bench;
    let codec = hprt_compress::codec_for(p);
    let sizes: Vec<usize> = [64usize << 20, 256 << 20, 1 << 30]
        .into_iter()
        .filter(|&b| b <= max_bytes.max(64 << 20))
        .collect();
    let default = hprt_compress::codec::EncodeOptions::default();
    writeln!(
        out,
        "#### compress: the `{}` device codec vs device-to-device copy (bf16 GELU-like activations, device events, best of {TRIALS}; bytes checked against the CPU codec; goals on a GPU: encode >= 600 GB/s, decode >= 1,500 GB/s)\n",
        codec.name()
    )?;
    writeln!(
        out,
        "| size | block elements | ratio | encode GB/s | decode GB/s | D2D copy GB/s |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|")?;
    // The default block and a quarter of it: the coder runs a warp per block, so at 64 MiB the
    // default gives a GPU few warps (the ratio pays 132 bytes of states and index a block).
    // (The host codec's blocks matter to its threads only: one row.)
    let blocks = if p.capabilities().kernel_compiler {
        vec![default.chunk_elems, default.chunk_elems / 4]
    } else {
        vec![default.chunk_elems]
    };
    for block in blocks {
        let opts = hprt_compress::codec::EncodeOptions {
            chunk_elems: block,
            ..default.clone()
        };
        let codec: std::sync::Arc<dyn hprt_compress::DeviceCodec> = if block == default.chunk_elems
        {
            std::sync::Arc::clone(&codec)
        } else {
            std::sync::Arc::new(hprt_compress::CudaCodec::new(opts.clone()))
        };
        for r in device_bench(p, codec.as_ref(), &opts, &sizes, TRIALS)? {
            writeln!(
                out,
                "| {} | {} | {:.4} | {:.1} | {:.1} | {:.1} |",
                size_name(r.bytes),
                block,
                r.ratio,
                r.encode_gbps,
                r.decode_gbps,
                r.memcpy_gbps
            )?;
        }
    }
    writeln!(out)?;
    Ok(())
}

fn copies(p: &dyn Platform, max_bytes: usize, out: &mut String) -> Result<()> {
    writeln!(out, "#### Stream copies vs plain memcpy (ratio = memcpy time / stream time; goal >= 0.9 from 4 MiB)")?;
    writeln!(out)?;
    writeln!(
        out,
        "| size | memcpy GB/s | H2D GB/s | ratio | D2H GB/s | ratio | D2D GB/s | ratio |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    let s = p.create_stream()?;
    let mut size = 4usize << 10;
    while size <= max_bytes {
        let reps = reps_for(size);
        let host: PinnedBuffer = p.alloc_pinned(size)?;
        // Real bytes: an untouched calloc'd source would be read from the shared zero page.
        host.write(0, &vec![0x5a; size])?;
        let a: DeviceBuffer = p.alloc_device(size)?;
        let b: DeviceBuffer = p.alloc_device(size)?;
        let base = best(|| Ok(memcpy_time(size, reps)))?;
        let h2d = best(|| stream_copy_time(p, (&a).into(), (&host).into(), size, reps, &s))?;
        let d2h = best(|| stream_copy_time(p, (&host).into(), (&a).into(), size, reps, &s))?;
        let d2d = best(|| stream_copy_time(p, (&b).into(), (&a).into(), size, reps, &s))?;
        let total = size * reps;
        let r = |t: Duration| base.as_secs_f64() / t.as_secs_f64();
        writeln!(
            out,
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            size_name(size),
            gbps(total, base),
            gbps(total, h2d),
            r(h2d),
            gbps(total, d2h),
            r(d2h),
            gbps(total, d2d),
            r(d2d)
        )?;
        size *= 4;
    }
    p.destroy_stream(&s)?;
    writeln!(out)?;
    Ok(())
}

/// One size of the cuda copy comparison: `reps` copies timed through hprt and raw.
struct CopyRow {
    size: usize,
    reps: usize,
    h2d: Duration,
    raw_h2d: Duration,
    d2h: Duration,
    raw_d2h: Duration,
}

/// CUDA only: hprt's H2D and D2H through its streams from / to its pinned memory against raw
/// `cuMemcpyAsync` through cudarc on bare driver objects, and both against the link's peak (the
/// best raw bandwidth of the sweep); then hprt's `record_event` against a raw `cuEventRecord`.
fn cuda_vs_raw(p: &dyn Platform, max_bytes: usize, out: &mut String) -> Result<()> {
    // A second handle on the same driver and primary context, for the raw calls.
    let raw = CudaBackend::open()?;
    writeln!(out, "#### CUDA: hprt copies vs raw cuMemcpyAsync (ratio = raw time / hprt time; goal >= 0.95 from 4 MiB) and vs the link's peak")?;
    writeln!(out)?;
    let s = p.create_stream()?;
    let mut rows = Vec::new();
    let mut size = 64usize << 10;
    while size <= max_bytes {
        let reps = reps_for(size);
        let host = p.alloc_pinned(size)?;
        host.write(0, &vec![0x5a; size])?;
        let dev = p.alloc_device(size)?;
        let h2d = best(|| stream_copy_time(p, (&dev).into(), (&host).into(), size, reps, &s))?;
        let d2h = best(|| stream_copy_time(p, (&host).into(), (&dev).into(), size, reps, &s))?;
        let raw_h2d = best(|| Ok(raw.raw_copy_time(CopyKind::HostToDevice, size, reps)?))?;
        let raw_d2h = best(|| Ok(raw.raw_copy_time(CopyKind::DeviceToHost, size, reps)?))?;
        rows.push(CopyRow {
            size,
            reps,
            h2d,
            raw_h2d,
            d2h,
            raw_d2h,
        });
        size *= 4;
    }
    p.destroy_stream(&s)?;
    let best_raw = |raw: fn(&CopyRow) -> Duration| {
        rows.iter()
            .map(|r| gbps(r.size * r.reps, raw(r)))
            .fold(0.0, f64::max)
    };
    let (peak_h2d, peak_d2h) = (best_raw(|r| r.raw_h2d), best_raw(|r| r.raw_d2h));
    writeln!(
        out,
        "link peak (best raw of the sweep): H2D {peak_h2d:.2} GB/s, D2H {peak_d2h:.2} GB/s"
    )?;
    writeln!(out)?;
    writeln!(out, "| size | H2D hprt GB/s | H2D raw GB/s | ratio | of peak | D2H hprt GB/s | D2H raw GB/s | ratio | of peak |")?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    for r in rows {
        let total = r.size * r.reps;
        let ratio = |raw: Duration, ours: Duration| raw.as_secs_f64() / ours.as_secs_f64();
        writeln!(
            out,
            "| {} | {:.2} | {:.2} | {:.3} | {:.2} | {:.2} | {:.2} | {:.3} | {:.2} |",
            size_name(r.size),
            gbps(total, r.h2d),
            gbps(total, r.raw_h2d),
            ratio(r.raw_h2d, r.h2d),
            gbps(total, r.h2d) / peak_h2d,
            gbps(total, r.d2h),
            gbps(total, r.raw_d2h),
            ratio(r.raw_d2h, r.d2h),
            gbps(total, r.d2h) / peak_d2h,
        )?;
    }
    writeln!(out)?;
    const N: usize = 100_000;
    let s = p.create_stream()?;
    let ev = p.create_event(false)?;
    let ours = best(|| {
        let t = Instant::now();
        for _ in 0..N {
            p.record_event(&ev, &s)?;
        }
        let e = t.elapsed();
        p.synchronize_stream(&s)?;
        Ok(e)
    })?;
    let bare = best(|| Ok(raw.raw_event_record_time(N)?))?;
    p.destroy_stream(&s)?;
    let per = |t: Duration| t.as_secs_f64() * 1e6 / N as f64;
    writeln!(
        out,
        "| event record | hprt us/op | raw cuEventRecord us/op | hprt overhead us/op |"
    )?;
    writeln!(out, "|---|---:|---:|---:|")?;
    writeln!(
        out,
        "| record_event (no timing) | {:.3} | {:.3} | {:.3} |",
        per(ours),
        per(bare),
        per(ours) - per(bare)
    )?;
    writeln!(out)?;
    Ok(())
}

fn enqueue_overhead(p: &dyn Platform, out: &mut String) -> Result<()> {
    const N: usize = 100_000;
    writeln!(out, "#### Enqueue overhead per operation (goal <= 2 us; baseline: a bare mpsc send of a boxed job)")?;
    writeln!(out)?;
    writeln!(
        out,
        "| operation | enqueue us/op | enqueue + complete us/op | ratio to bare send |"
    )?;
    writeln!(out, "|---|---:|---:|---:|")?;
    let bare = best(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let worker = std::thread::spawn(move || {
            while let Ok(job) = rx.recv() {
                job();
            }
        });
        let t = Instant::now();
        for i in 0..N {
            tx.send(Box::new(move || {
                black_box(i);
            }))
            .map_err(|_| anyhow::anyhow!("bare channel closed"))?;
        }
        let e = t.elapsed();
        drop(tx);
        worker
            .join()
            .map_err(|_| anyhow::anyhow!("worker panicked"))?;
        Ok(e)
    })?;
    let per = |t: Duration| t.as_secs_f64() * 1e6 / N as f64;
    writeln!(
        out,
        "| bare mpsc send (baseline) | {:.3} | - | 1.00 |",
        per(bare)
    )?;
    let s = p.create_stream()?;
    let dev = p.alloc_device(4096)?;
    let dev2 = p.alloc_device(4096)?;
    let ev = p.create_event(false)?;
    let ops: [(&str, &dyn Fn() -> hprt_platform::Result<()>); 3] = [
        ("memset 64 B", &|| p.memset_async(&dev, 0, 1, 64, &s)),
        ("copy D2D 64 B", &|| {
            p.copy_async((&dev2).into(), 0, (&dev).into(), 0, 64, &s)
        }),
        ("record_event", &|| p.record_event(&ev, &s)),
    ];
    for (name, op) in ops {
        let mut enqueue = Duration::MAX;
        let mut total = Duration::MAX;
        for _ in 0..TRIALS {
            let t = Instant::now();
            for _ in 0..N {
                op()?;
            }
            let e = t.elapsed();
            p.synchronize_stream(&s)?;
            enqueue = enqueue.min(e);
            total = total.min(t.elapsed());
        }
        writeln!(
            out,
            "| {name} | {:.3} | {:.3} | {:.2} |",
            per(enqueue),
            per(total),
            per(enqueue) / per(bare)
        )?;
    }
    p.destroy_stream(&s)?;
    writeln!(out)?;
    Ok(())
}

/// One rank's timing of `iters` collectives of `bytes` (f32) after a warm-up.
fn rank_loop(
    p: &dyn Platform,
    id: &hprt_platform::UniqueId,
    rank: usize,
    world: usize,
    bytes: usize,
    gather: bool,
    go: &Barrier,
) -> Result<Duration> {
    if p.device_count() >= world && !p.capabilities().ranks_share_device {
        p.set_device(rank)?;
    }
    let comm = p.comm_init(id, rank, world)?;
    let s = p.create_stream()?;
    let count = bytes / 4;
    let (send, recv) = if gather {
        (p.alloc_device(bytes / world)?, p.alloc_device(bytes)?)
    } else {
        (p.alloc_device(bytes)?, p.alloc_device(bytes)?)
    };
    // Touch every page first, so no rank reads the shared zero page of untouched memory.
    p.memset_async(&send, 0, 1, send.len(), &s)?;
    p.memset_async(&recv, 0, 1, recv.len(), &s)?;
    let iters = ((256usize << 20) / bytes).clamp(3, 50);
    let issue = || -> hprt_platform::Result<()> {
        if gather {
            p.all_gather(
                (&send).into(),
                (&recv).into(),
                count / world,
                DType::F32,
                &comm,
                &s,
            )
        } else {
            p.all_reduce(
                (&send).into(),
                (&recv).into(),
                count,
                DType::F32,
                ReduceOp::Sum,
                &comm,
                &s,
            )
        }
    };
    let mut best = Duration::MAX;
    issue()?;
    p.synchronize_stream(&s)?;
    for _ in 0..TRIALS {
        go.wait();
        let t = Instant::now();
        for _ in 0..iters {
            issue()?;
        }
        p.synchronize_stream(&s)?;
        go.wait();
        best = best.min(t.elapsed() / iters as u32);
    }
    p.destroy_stream(&s)?;
    p.destroy_comm(&comm)?;
    Ok(best)
}

fn collectives(p: &dyn Platform, max_bytes: usize, out: &mut String) -> Result<()> {
    let world = if p.capabilities().ranks_share_device {
        4
    } else {
        p.device_count().min(4)
    };
    if world < 2 {
        // One rank moves no bytes between ranks: its bus bandwidth is zero by definition.
        writeln!(
            out,
            "#### collectives: not measured (one device; NCCL / HCCL take one device per rank)\n"
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "#### {world}-rank collectives vs memcpy bandwidth (f32 sum; bus bandwidth as nccl-tests defines it; goal >= 0.5)"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| collective | size | memcpy GB/s | algbw GB/s | busbw GB/s | busbw / memcpy |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|")?;
    for gather in [false, true] {
        for bytes in [1usize << 20, 16 << 20, 64 << 20] {
            if bytes > max_bytes {
                continue;
            }
            ensure!(bytes % (4 * world) == 0, "size must split evenly");
            let id = p.unique_id()?;
            let go = Arc::new(Barrier::new(world));
            let times: Vec<Duration> = std::thread::scope(|sc| {
                let handles: Vec<_> = (0..world)
                    .map(|rank| {
                        let (id, go) = (&id, Arc::clone(&go));
                        sc.spawn(move || rank_loop(p, id, rank, world, bytes, gather, &go))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().map_err(|_| anyhow::anyhow!("rank panicked"))?)
                    .collect::<Result<_>>()
            })?;
            let t = times.into_iter().max().unwrap_or_default();
            let base = best(|| Ok(memcpy_time(bytes, 5) / 5))?;
            let n = world as f64;
            let factor = if gather {
                (n - 1.0) / n
            } else {
                2.0 * (n - 1.0) / n
            };
            let alg = gbps(bytes, t);
            let bus = alg * factor;
            let name = if gather { "all_gather" } else { "all_reduce" };
            writeln!(
                out,
                "| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
                size_name(bytes),
                gbps(bytes, base),
                alg,
                bus,
                bus / gbps(bytes, base)
            )?;
        }
    }
    writeln!(out)?;
    Ok(())
}

/// The backends whose codec notes the bench tests check: CUDA on the emulator (the device
/// kernels) and cpu (the host fallback).
#[cfg(test)]
fn cuda_and_cpu() -> (CudaBackend, Arc<dyn Platform>) {
    let cuda = hprt_conformance::cuda_emulator::open().expect("cuda on the CUDA emulator");
    let cpu = hprt_platform::CpuBackend::new(hprt_platform::CpuConfig::default());
    (cuda, Arc::new(cpu))
}

#[cfg(test)]
mod tests {
    use super::{cuda_and_cpu, splice, swap_settings};

    /// The swap section says which device codec and allocation cache it ran with: on cuda the
    /// CUDA kernels (its compress rows said "the host fallback ... (no device kernels)" there).
    #[test]
    fn the_swap_section_names_the_codec_and_the_allocation_cache() {
        let (cuda, cpu) = cuda_and_cpu();
        let s = swap_settings(&cuda);
        assert!(
            s.contains("- device codec: `cuda` (the CUDA kernels"),
            "{s}"
        );
        assert!(s.contains("- device allocation cache: "), "{s}");
        let s = swap_settings(&*cpu);
        assert!(s.contains("- device codec: `host` (the CPU codec"), "{s}");
    }

    #[test]
    fn splice_replaces_only_the_marked_part() {
        let doc = "intro\n<!-- hprt bench: begin -->\nold table\n<!-- hprt bench: end -->\nnotes\n";
        let out = splice(doc, "new table\n").unwrap();
        assert_eq!(
            out,
            "intro\n<!-- hprt bench: begin -->\n\nnew table\n<!-- hprt bench: end -->\nnotes\n"
        );
        assert_eq!(
            splice(&out, "new table").unwrap(),
            out,
            "splicing is idempotent"
        );
        assert!(splice("no markers", "t").is_none());
    }
}
