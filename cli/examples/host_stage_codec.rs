//! The CPU codec where swap uses it: the host stage (`Compression::HostStage`) encodes each
//! offloaded tensor in a host function on the copy stream and decodes it at the reload. Times
//! that codec work (the engine's `codec_ns`) for each raw bf16 file given, against the same
//! codec calls the way the host stage made them before (the bytes copied out of the pinned block
//! into a fresh buffer, encoded; decoded into a fresh buffer, copied into the block), measured in
//! the same run. GB/s of raw bytes, wall time of one thread, best of `--rounds`.
//!
//! ```bash
//! cargo run --release -p hprt-cli --example host_stage_codec -- --rounds 5 data/*.bf16
//! ```

use std::sync::Arc;
use std::time::Instant;

use hprt_compress::codec::{self, DecodeOptions, EncodeOptions};
use hprt_compress::CodecDType;
use hprt_platform::{CpuBackend, CpuConfig, DType, Platform};
use hprt_swap::{
    Compression, DeviceTensor, EngineConfig, PoolConfig, Saved, SwapEngine, SwapTensor,
};

fn gbps(bytes: usize, ns: u64) -> f64 {
    bytes as f64 / ns.max(1) as f64
}

fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut rounds = 3;
    if let Some(i) = args.iter().position(|a| a == "--rounds") {
        rounds = args[i + 1].parse()?;
        args.drain(i..=i + 1);
    }
    println!("| tensor | MB | ratio | host stage encode GB/s | before: copy out + encode | host stage decode GB/s | before: decode + copy in |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for path in &args {
        let data = std::fs::read(path)?;
        let n = data.len();
        let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig {
            device_memory: 4 * n + (64 << 20),
            ..CpuConfig::default()
        }));
        let s = p.create_stream()?;
        let config = EngineConfig {
            compression: Compression::HostStage,
            pool: PoolConfig::default(),
            ..EngineConfig::default()
        };
        let mut engine = SwapEngine::new(Arc::clone(&p), config)?;
        let (mut enc_best, mut dec_best, mut old_enc_best, mut old_dec_best) =
            (u64::MAX, u64::MAX, u64::MAX, u64::MAX);
        let mut ratio = 0.0;
        for _ in 0..rounds {
            let buf = p.alloc_device(n)?;
            p.write_device_sync(&buf, 0, &data, &s)?;
            let mut t = SwapTensor::new(Saved::Tensor(DeviceTensor::whole(
                buf,
                DType::BF16,
                vec![n / 2],
            )))?;
            let before = engine.stats().codec_ns;
            engine.offload([&mut t], &s)?;
            engine.finish_offload([&mut t])?;
            let mid = engine.stats().codec_ns;
            ratio = n as f64 / t.host_bytes() as f64;
            engine.start_reload([&mut t])?;
            engine.finish_reload([&mut t], &s)?;
            let after = engine.stats().codec_ns;
            enc_best = enc_best.min(mid - before);
            dec_best = dec_best.min(after - mid);
            let d = t.describe().expect("a tensor");
            let mut back = vec![0u8; n];
            p.read_device_sync(&d.storage, d.offset, &mut back, &s)?;
            anyhow::ensure!(back == data, "{path}: the reload differs");

            // The same codec work as the host stage did it before: out of the pinned block into
            // a fresh buffer, and decoded into a fresh buffer then copied into the block.
            let block = p.alloc_pinned(n)?;
            block.write(0, &data)?;
            let start = Instant::now();
            let mut raw = vec![0u8; n];
            block.read(0, &mut raw)?;
            let encoded = codec::encode(CodecDType::BF16, &raw, &EncodeOptions::default())?;
            old_enc_best = old_enc_best.min(start.elapsed().as_nanos() as u64);
            drop(raw);
            let start = Instant::now();
            let decoded = codec::decode_with(&encoded, &DecodeOptions::default())?;
            block.write(0, &decoded.data)?;
            old_dec_best = old_dec_best.min(start.elapsed().as_nanos() as u64);
            p.free_pinned(&block)?;
        }
        let name = std::path::Path::new(path)
            .file_stem()
            .map_or(path.clone(), |s| s.to_string_lossy().into_owned());
        println!(
            "| {name} | {:.0} | {ratio:.3} | {:.2} | {:.2} | {:.2} | {:.2} |",
            n as f64 / 1e6,
            gbps(n, enc_best),
            gbps(n, old_enc_best),
            gbps(n, dec_best),
            gbps(n, old_dec_best)
        );
    }
    Ok(())
}
