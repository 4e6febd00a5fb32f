//! The CPU codec where swap uses it: the host stage (`Compression::HostStage`) encodes each
//! offloaded tensor in a host function on the copy stream, straight from the pinned block, and
//! decodes it at the reload straight into the pinned block. For each raw bf16 file given:
//!
//! - the engine end to end: its codec time (`codec_ns`, wall, the codec on every core);
//! - per core (one thread, thread CPU time): the calls the host stage makes now, against the way
//!   it made them before (the bytes copied out of the block into a fresh buffer and encoded;
//!   decoded into a fresh buffer and copied into the block), in the same run.
//!
//! GB/s of raw bytes, best of `--rounds`.
//!
//! ```bash
//! cargo run --release -p hprt-cli --example host_stage_codec -- --rounds 5 data/*.bf16
//! ```

use std::sync::Arc;

use hprt_cli::bench::codec::CoreTimer;
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
    println!("| tensor | MB | ratio | engine encode (all cores) | engine decode (all cores) | per core: encode in place | before: copy out + encode | per core: decode into the block | before: decode + copy in |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
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
        let (mut enc_best, mut dec_best) = (u64::MAX, u64::MAX);
        let (mut new_enc_best, mut old_enc_best, mut new_dec_best, mut old_dec_best) =
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

            // One core: the calls the host stage makes now, and as it made them before.
            let one = EncodeOptions {
                threads: 1,
                ..EncodeOptions::default()
            };
            let one_dec = DecodeOptions {
                threads: 1,
                ..DecodeOptions::default()
            };
            let block = p.alloc_pinned(n)?;
            block.write(0, &data)?;
            let timer = CoreTimer::start();
            // SAFETY: no copy is queued on the block: it was written synchronously above.
            let encoded = unsafe {
                block.with_unsynchronized(0, n, |raw| codec::encode(CodecDType::BF16, raw, &one))
            }??;
            new_enc_best = new_enc_best.min(timer.elapsed().as_nanos() as u64);
            let timer = CoreTimer::start();
            let mut raw = vec![0u8; n];
            block.read(0, &mut raw)?;
            let before = codec::encode(CodecDType::BF16, &raw, &one)?;
            old_enc_best = old_enc_best.min(timer.elapsed().as_nanos() as u64);
            anyhow::ensure!(before == encoded, "{path}: the two ways encode differently");
            drop(raw);
            let timer = CoreTimer::start();
            // SAFETY: as above.
            unsafe {
                block.with_unsynchronized_mut(0, n, |out| {
                    codec::decode_into(&encoded, out, &one_dec)
                })
            }??;
            new_dec_best = new_dec_best.min(timer.elapsed().as_nanos() as u64);
            let timer = CoreTimer::start();
            let decoded = codec::decode_with(&encoded, &one_dec)?;
            block.write(0, &decoded.data)?;
            old_dec_best = old_dec_best.min(timer.elapsed().as_nanos() as u64);
            anyhow::ensure!(block.to_vec()? == data, "{path}: the block differs");
            p.free_pinned(&block)?;
        }
        let name = std::path::Path::new(path)
            .file_stem()
            .map_or(path.clone(), |s| s.to_string_lossy().into_owned());
        println!(
            "| {name} | {:.0} | {ratio:.3} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            n as f64 / 1e6,
            gbps(n, enc_best),
            gbps(n, dec_best),
            gbps(n, new_enc_best),
            gbps(n, old_enc_best),
            gbps(n, new_dec_best),
            gbps(n, old_dec_best)
        );
    }
    Ok(())
}
