//! `cargo run --release -p hprt-cli --example codec_profile [kind] [dtype] [numel] [secs]`:
//! encodes and decodes one synthetic tensor in a loop on one thread for a fixed time, so `perf
//! record` sees only the codec; prints per-core encode and decode GB/s.

use std::time::{Duration, Instant};

use hprt_cli::bench::codec::CoreTimer;
use hprt_compress::codec::{decode_into, encode_into, DecodeOptions, EncodeOptions};
use hprt_compress::data::{generate, DataKind};
use hprt_compress::CodecDType;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let kind_name = args.next().unwrap_or_else(|| "gaussian".into());
    let kind = DataKind::ALL
        .into_iter()
        .find(|k| k.name() == kind_name)
        .ok_or_else(|| anyhow::anyhow!("unknown data kind {kind_name}"))?;
    let dtype = CodecDType::parse(&args.next().unwrap_or_else(|| "bf16".into()))?;
    let numel: usize = args.next().map_or(Ok(1 << 22), |s| s.parse())?;
    let secs: f64 = args.next().map_or(Ok(2.0), |s| s.parse())?;
    let data = generate(kind, dtype, numel, 42);
    let eo = EncodeOptions::single_threaded();
    let mut coded = Vec::new();
    let mut back = vec![0u8; data.len()];
    let run = |what: &str, f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<()> {
        // Best round of at least 0.2 s (the thread CPU clock is coarse): on a shared machine
        // the fastest round is the least disturbed one.
        let wall = Instant::now();
        let mut best = f64::MAX;
        while wall.elapsed() < Duration::from_secs_f64(secs) {
            let cpu = CoreTimer::start();
            let mut reps = 0u32;
            while cpu.elapsed() < Duration::from_millis(200) || reps == 0 {
                f()?;
                reps += 1;
            }
            best = best.min(cpu.elapsed().as_secs_f64() / reps as f64);
        }
        println!("{what}: {:.3} GB/s", data.len() as f64 / best / 1e9);
        Ok(())
    };
    run("encode", &mut || {
        Ok(encode_into(dtype, &data, &eo, &mut coded)?)
    })?;
    println!("ratio {:.4}", data.len() as f64 / coded.len() as f64);
    for verify in [true, false] {
        let o = DecodeOptions {
            threads: 1,
            verify,
            ..Default::default()
        };
        run(&format!("decode (verify {verify})"), &mut || {
            decode_into(&coded, &mut back, &o)?;
            Ok(())
        })?;
    }
    anyhow::ensure!(back == data, "round trip failed");
    Ok(())
}
