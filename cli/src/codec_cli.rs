//! What `hprt compress`, `hprt decompress` and `hprt codec-stats` do, on raw little-endian
//! tensor files.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use hprt_compress::codec::{self, DecodeOptions, EncodeOptions};
use hprt_compress::format::{ChunkMode, CodecDType};
use hprt_compress::{CompressError, Result};

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| CompressError::Io {
        context: format!("reading {}", path.display()),
        source,
    })
}

fn write(path: &Path, data: &[u8]) -> Result<()> {
    std::fs::write(path, data).map_err(|source| CompressError::Io {
        context: format!("writing {}", path.display()),
        source,
    })
}

/// What one file operation did.
#[derive(Clone, Debug)]
pub struct FileReport {
    pub dtype: CodecDType,
    pub numel: usize,
    pub raw_bytes: usize,
    pub compressed_bytes: usize,
    /// Codec time only (no file I/O).
    pub elapsed: Duration,
}

impl std::fmt::Display for FileReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} elements: {} -> {} bytes (ratio {:.3}) in {:.1} ms ({:.2} GB/s)",
            self.numel,
            self.dtype,
            self.raw_bytes,
            self.compressed_bytes,
            self.raw_bytes as f64 / self.compressed_bytes.max(1) as f64,
            self.elapsed.as_secs_f64() * 1e3,
            self.raw_bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
        )
    }
}

/// `hprt compress --dtype D IN OUT`.
pub fn compress_file(
    dtype: CodecDType,
    input: &Path,
    output: &Path,
    opts: &EncodeOptions,
) -> Result<FileReport> {
    let raw = read(input)?;
    let t = Instant::now();
    let enc = codec::encode(dtype, &raw, opts)?;
    let elapsed = t.elapsed();
    write(output, &enc)?;
    Ok(FileReport {
        dtype,
        numel: raw.len() / dtype.size(),
        raw_bytes: raw.len(),
        compressed_bytes: enc.len(),
        elapsed,
    })
}

/// `hprt decompress IN OUT` (the dtype comes from the header).
pub fn decompress_file(input: &Path, output: &Path, opts: &DecodeOptions) -> Result<FileReport> {
    let enc = read(input)?;
    let t = Instant::now();
    let d = codec::decode_with(&enc, opts)?;
    let elapsed = t.elapsed();
    write(output, &d.data)?;
    Ok(FileReport {
        dtype: d.dtype,
        numel: d.numel,
        raw_bytes: d.data.len(),
        compressed_bytes: enc.len(),
        elapsed,
    })
}

/// `hprt codec-stats --dtype D FILE...`: per file the ratio, the entropy bound, chunk-table
/// statistics and single-thread throughput, next to zstd level 1.
pub fn codec_stats(dtype: CodecDType, files: &[&Path], opts: &EncodeOptions) -> Result<String> {
    let mut s = String::new();
    let single = EncodeOptions {
        threads: 1,
        ..opts.clone()
    };
    for path in files {
        let raw = read(path)?;
        let t = Instant::now();
        let enc = codec::encode(dtype, &raw, &single)?;
        let enc_t = t.elapsed();
        let t = Instant::now();
        let back = codec::decode_with(&enc, &DecodeOptions::single_threaded())?;
        let dec_t = t.elapsed();
        if back.data != raw {
            return Err(CompressError::InvalidState(format!(
                "{} did not round-trip",
                path.display()
            )));
        }
        let prefix = codec::inspect(&enc)?;
        // Version 2 codes the whole tensor with one table: its entropy is the bound.
        let symbols = codec::chunk_symbols(dtype, &raw, (raw.len() / dtype.size()).max(1));
        let entropy: f64 = symbols.iter().map(|c| c.entropy_bits).sum::<f64>() / 8.0;
        let mant: usize = symbols
            .iter()
            .map(|c| (c.numel * dtype.mantissa_bits() as usize).div_ceil(8))
            .sum();
        let t = Instant::now();
        let z = zstd::bulk::compress(&raw, 1).map_err(|source| CompressError::Io {
            context: "zstd".into(),
            source,
        })?;
        let z_t = t.elapsed();
        let mut modes = [0usize; 4];
        for c in &prefix.chunks {
            modes[c.mode.code() as usize] += 1;
        }
        let lens: Vec<usize> = prefix.chunks.iter().map(|c| c.len).collect();
        let gb = |t: Duration| raw.len() as f64 / t.as_secs_f64().max(1e-9) / 1e9;
        let _ = writeln!(
            s,
            "{}: {} elements of {dtype}, {} bytes",
            path.display(),
            raw.len() / dtype.size(),
            raw.len()
        );
        let _ = writeln!(
            s,
            "  compressed {} bytes, ratio {:.4} (zstd-1: {} bytes, ratio {:.4})",
            enc.len(),
            raw.len() as f64 / enc.len().max(1) as f64,
            z.len(),
            raw.len() as f64 / z.len().max(1) as f64
        );
        let _ = writeln!(
            s,
            "  entropy bound {:.0} bytes (symbols {:.0} at order-0 entropy + mantissas {mant}); size / bound {:.4}; symbol bytes / entropy {:.4}",
            entropy + mant as f64,
            entropy,
            enc.len() as f64 / (entropy + mant as f64).max(1.0),
            (enc.len() as f64 - mant as f64) / entropy.max(1.0),
        );
        let _ = writeln!(
            s,
            "  format v{}, blocks: {} of {} elements; modes: {} {}, {} {}, {} {}, {} {}; block bytes min {} / mean {:.0} / max {}",
            prefix.version,
            prefix.chunks.len(),
            prefix.header.chunk_elems,
            modes[0], ChunkMode::Raw.name(),
            modes[1], ChunkMode::Rans.name(),
            modes[2], ChunkMode::SingleSymbol.name(),
            modes[3], ChunkMode::Constant.name(),
            lens.iter().min().copied().unwrap_or(0),
            lens.iter().sum::<usize>() as f64 / lens.len().max(1) as f64,
            lens.iter().max().copied().unwrap_or(0),
        );
        let _ = writeln!(
            s,
            "  one thread: encode {:.2} GB/s, decode {:.2} GB/s; zstd-1 encode {:.2} GB/s",
            gb(enc_t),
            gb(dec_t),
            gb(z_t)
        );
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hprt_compress::data::{generate, DataKind};

    #[test]
    fn files_round_trip_and_stats_report_ratio_bound_and_modes() {
        let dir = std::env::temp_dir().join(format!("hprt-compress-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (raw, packed, back) = (dir.join("a.bf16"), dir.join("a.hprz"), dir.join("a.out"));
        let data = generate(DataKind::Gaussian, CodecDType::BF16, 20_000, 1);
        std::fs::write(&raw, &data).unwrap();
        let opts = EncodeOptions {
            chunk_elems: 4096,
            ..Default::default()
        };
        let r = compress_file(CodecDType::BF16, &raw, &packed, &opts).unwrap();
        assert_eq!((r.numel, r.raw_bytes), (20_000, 40_000));
        assert!(r.compressed_bytes < 30_000);
        let d = decompress_file(&packed, &back, &DecodeOptions::default()).unwrap();
        assert_eq!(d.dtype, CodecDType::BF16);
        assert_eq!(std::fs::read(&back).unwrap(), data);
        let stats = codec_stats(CodecDType::BF16, &[raw.as_path()], &opts).unwrap();
        assert!(stats.contains("ratio 1.4"), "{stats}");
        assert!(stats.contains("5 rans"), "{stats}");
        assert!(stats.contains("zstd-1"), "{stats}");
        // Not an encoding; a file that is not whole elements; a missing file.
        assert!(matches!(
            decompress_file(&raw, &back, &DecodeOptions::default()),
            Err(CompressError::Corrupt { .. })
        ));
        std::fs::write(&raw, [1u8, 2, 3]).unwrap();
        assert!(compress_file(CodecDType::BF16, &raw, &packed, &opts).is_err());
        assert!(matches!(
            compress_file(CodecDType::BF16, &dir.join("none"), &packed, &opts),
            Err(CompressError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
