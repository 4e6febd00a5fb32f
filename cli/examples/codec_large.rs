//! `cargo run --release -p hprt-cli --example codec_large [numel] [rounds] [kinds]`: the
//! CPU codec on one core where it is used, on tensors far larger than the caches (default 2^26
//! bf16 elements, 128 MiB): each round encodes with `codec::encode` and decodes with
//! `codec::decode_with` as one-shot calls (a fresh output each time, as `hprt codec-stats` and
//! the swap engine's host stage do), then again into buffers reused from the round before.
//! Prints per-core GB/s (thread CPU time, page faults included; best of `rounds`) and wall GB/s.

use std::time::Instant;

use hprt_cli::bench::codec::CoreTimer;
use hprt_compress::codec::{self, DecodeOptions, EncodeOptions};
use hprt_compress::data::{generate, DataKind};
use hprt_compress::CodecDType;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let numel: usize = args.next().map_or(Ok(1 << 26), |s| s.parse())?;
    let rounds: usize = args.next().map_or(Ok(3), |s| s.parse())?;
    let kinds: Vec<DataKind> = match args.next() {
        Some(list) => list
            .split(',')
            .map(|k| {
                DataKind::ALL
                    .into_iter()
                    .find(|d| d.name() == k)
                    .ok_or_else(|| anyhow::anyhow!("unknown data kind {k}"))
            })
            .collect::<anyhow::Result<_>>()?,
        None => vec![DataKind::Gelu, DataKind::LayerNorm],
    };
    let dtype = CodecDType::BF16;
    let (eo, dopts) = (
        EncodeOptions::single_threaded(),
        DecodeOptions::single_threaded(),
    );
    println!(
        "{numel} {dtype} elements ({} MiB) per tensor, one thread, best of {rounds}",
        (numel * dtype.size()) >> 20
    );
    for kind in kinds {
        let data = generate(kind, dtype, numel, 42);
        let gb = |s: f64| data.len() as f64 / s / 1e9;
        // (cpu, wall) seconds, best of the rounds, for: cold encode, cold decode, warm encode,
        // warm decode.
        let mut best = [(f64::MAX, f64::MAX); 4];
        let mut coded = Vec::new();
        let mut back = vec![0u8; data.len()];
        let mut ratio = 0.0;
        for _ in 0..rounds {
            let mut time = |slot: usize, f: &mut dyn FnMut() -> anyhow::Result<()>| {
                let (cpu, wall) = (CoreTimer::start(), Instant::now());
                let r = f();
                let b = &mut best[slot];
                b.0 = b.0.min(cpu.elapsed().as_secs_f64());
                b.1 = b.1.min(wall.elapsed().as_secs_f64());
                r
            };
            let mut enc = Vec::new();
            time(0, &mut || {
                enc = codec::encode(dtype, &data, &eo)?;
                Ok(())
            })?;
            ratio = data.len() as f64 / enc.len() as f64;
            let mut dec = None;
            time(1, &mut || {
                dec = Some(codec::decode_with(&enc, &dopts)?);
                Ok(())
            })?;
            anyhow::ensure!(dec.expect("decoded").data == data, "round trip failed");
            time(2, &mut || {
                Ok(codec::encode_into(dtype, &data, &eo, &mut coded)?)
            })?;
            time(3, &mut || {
                codec::decode_into(&coded, &mut back, &dopts)?;
                Ok(())
            })?;
            anyhow::ensure!(back == data, "round trip into a reused buffer failed");
        }
        println!(
            "{} ratio {ratio:.4}: one-shot encode {:.3} GB/s ({:.3} wall), decode {:.3} ({:.3} wall); \
             into reused buffers encode {:.3} ({:.3} wall), decode {:.3} ({:.3} wall)",
            kind.name(),
            gb(best[0].0),
            gb(best[0].1),
            gb(best[1].0),
            gb(best[1].1),
            gb(best[2].0),
            gb(best[2].1),
            gb(best[3].0),
            gb(best[3].1),
        );
    }
    Ok(())
}
