//! `cargo run --release -p hprt-cli --example codec_real [--rounds N] [--synthetic] FILE...`:
//! the CPU codec on one core on large raw bf16 tensors (issue 30 item 6), with baselines
//! measured in the same run on the same bytes: `memcpy` into a reused buffer and zstd level 1
//! (one-shot `zstd::bulk`). `--synthetic` adds a 128 MiB GELU-like tensor of
//! `hprt_compress::data`. Per tensor and per operation, the best of `rounds` (thread CPU time,
//! page faults included) as GB/s of raw bytes, then the codec's figures as ratios to memcpy
//! and to zstd-1. The files come from `python/benchmarks/codec_activations.py`.
//!
//! One-shot calls (`codec::encode`, `codec::decode_with`: a fresh output each time, as `hprt
//! codec-stats`, the swap engine's host stage and `hprt.compress` make) and calls into buffers
//! reused from the round before (`encode_into`, `decode_into`) are timed separately. Columns:
//! `enc1`/`dec1` one-shot, `enc`/`dec` into reused buffers, `memcpy` into a reused buffer,
//! `mcpy1` a copy into a fresh one (`to_vec`, the page faults a one-shot output pays), zstd-1
//! compress and decompress; then one-shot codec over memcpy and over zstd-1.
//! `--reused-only` times only the codec into reused buffers,
//! and `--slice MB` keeps only the first MB of each file
//! (with many rounds: the codec's own work in cache, for quick comparisons on a shared machine,
//! where the fastest of many short rounds is the least disturbed).

use std::hint::black_box;
use std::time::Instant;

use hprt_cli::bench::codec::CoreTimer;
use hprt_compress::codec::{self, DecodeOptions, EncodeOptions};
use hprt_compress::data::{generate, DataKind};
use hprt_compress::CodecDType;

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn main() -> anyhow::Result<()> {
    let mut rounds = 5usize;
    let mut synthetic = false;
    let mut reused_only = false;
    let mut slice_mb = 0usize;
    let mut files = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rounds" => rounds = args.next().unwrap_or_default().parse()?,
            "--synthetic" => synthetic = true,
            "--reused-only" => reused_only = true,
            "--slice" => slice_mb = args.next().unwrap_or_default().parse()?,
            _ => files.push(a),
        }
    }
    let dtype = CodecDType::BF16;
    let (eo, dopts) = (
        EncodeOptions::single_threaded(),
        DecodeOptions::single_threaded(),
    );
    println!(
        "one thread, best of {rounds} rounds; load average at start {}",
        load()
    );
    let mut inputs: Vec<(String, Vec<u8>)> = Vec::new();
    if synthetic {
        inputs.push((
            "synthetic gelu 128 MiB".into(),
            generate(DataKind::Gelu, dtype, 1 << 26, 42),
        ));
    }
    for f in &files {
        let name = std::path::Path::new(f)
            .file_stem()
            .map_or(f.clone(), |s| s.to_string_lossy().into_owned());
        let mut data = std::fs::read(f)?;
        if slice_mb > 0 {
            data.truncate(slice_mb << 20);
        }
        inputs.push((name, data));
    }
    println!(
        "{:<24} {:>6} {:>5} | {:>7} {:>7} {:>7} {:>7} | {:>6} {:>6} {:>6} {:>6} | {:>9} {:>9} | {:>9} {:>9}",
        "tensor", "MB", "ratio", "enc1", "dec1", "enc", "dec", "memcpy", "mcpy1", "zstd1c", "zstd1d",
        "enc1/mcpy", "dec1/mcpy", "enc1/zstd", "dec1/zstd"
    );
    for (name, data) in &inputs {
        let gb = |s: f64| data.len() as f64 / s / 1e9;
        // Best CPU seconds of: one-shot encode, one-shot decode, encode into a reused buffer,
        // decode into a reused buffer, memcpy, zstd-1 compress, zstd-1 decompress, memcpy into
        // a fresh buffer (`to_vec`: what a one-shot call's fresh output costs the kernel).
        let mut best = [f64::MAX; 8];
        let mut coded = Vec::new();
        let mut back = vec![0u8; data.len()];
        let mut copy = vec![0u8; data.len()];
        let mut ratio = 0.0;
        let mut zc = Vec::new();
        for _ in 0..rounds {
            let mut time = |slot: usize, f: &mut dyn FnMut() -> anyhow::Result<()>| {
                // Slices: wall time (the thread CPU clock advances at scheduler ticks, too
                // coarse for rounds of milliseconds; the fastest round was not preempted).
                let (cpu, wall) = (CoreTimer::start(), Instant::now());
                let r = f();
                let t = if slice_mb > 0 {
                    wall.elapsed()
                } else {
                    cpu.elapsed()
                };
                best[slot] = best[slot].min(t.as_secs_f64());
                r
            };
            if !reused_only {
                let mut enc = Vec::new();
                time(0, &mut || {
                    enc = codec::encode(dtype, black_box(data), &eo)?;
                    Ok(())
                })?;
                ratio = data.len() as f64 / enc.len() as f64;
                let mut dec = None;
                time(1, &mut || {
                    dec = Some(codec::decode_with(black_box(&enc), &dopts)?);
                    Ok(())
                })?;
                anyhow::ensure!(
                    &dec.expect("decoded").data == data,
                    "{name}: round trip failed"
                );
            }
            time(2, &mut || {
                Ok(codec::encode_into(dtype, black_box(data), &eo, &mut coded)?)
            })?;
            time(3, &mut || {
                codec::decode_into(black_box(&coded), &mut back, &dopts)?;
                Ok(())
            })?;
            if reused_only {
                continue;
            }
            anyhow::ensure!(
                &back == data,
                "{name}: round trip into a reused buffer failed"
            );
            time(4, &mut || {
                copy.copy_from_slice(black_box(data));
                Ok(())
            })?;
            time(7, &mut || {
                black_box(black_box(data).to_vec());
                Ok(())
            })?;
            time(5, &mut || {
                zc = zstd::bulk::compress(black_box(data), 1)?;
                Ok(())
            })?;
            time(6, &mut || {
                let z = zstd::bulk::decompress(black_box(&zc), data.len())?;
                anyhow::ensure!(z.len() == data.len());
                Ok(())
            })?;
        }
        let g: Vec<f64> = best.iter().map(|&s| gb(s)).collect();
        println!(
            "{:<24} {:>6.1} {:>5.3} | {:>7.3} {:>7.3} {:>7.3} {:>7.3} | {:>6.2} {:>6.2} {:>6.3} {:>6.3} | {:>9.3} {:>9.3} | {:>9.2} {:>9.2}",
            name,
            data.len() as f64 / 1e6,
            ratio,
            g[0],
            g[1],
            g[2],
            g[3],
            g[4],
            g[7],
            g[5],
            g[6],
            g[0] / g[4],
            g[1] / g[4],
            g[0] / g[5],
            g[1] / g[6],
        );
    }
    println!("load average at end {}", load());
    Ok(())
}
