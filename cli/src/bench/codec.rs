//! The codec benchmark: single-core encode/decode throughput against the goals (2 GB/s encode,
//! 3 GB/s decode on bf16) and against zstd level 1 and LZ4 on the same bytes in the same run, and the
//! coded size against the order-0 entropy bound of the coded symbols, per data kind.

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::{Duration, Instant};

use hprt_compress::codec::{self, DecodeOptions, EncodeOptions};
use hprt_compress::data::{generate, DataKind};
use hprt_compress::format::{CodecDType, HEADER_LEN};
use hprt_compress::{CompressError, Result};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Elements per tensor.
    pub numel: usize,
    pub dtypes: Vec<CodecDType>,
    pub kinds: Vec<DataKind>,
    /// Each figure is the best of this many runs.
    pub trials: usize,
    pub chunk_elems: usize,
    /// Threads for the extra multi-threaded row (0 or 1: no such row).
    pub threads: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            numel: 16 << 20,
            dtypes: CodecDType::ALL.to_vec(),
            kinds: DataKind::ALL.to_vec(),
            trials: 5,
            chunk_elems: hprt_compress::codec::v2::DEFAULT_BLOCK_ELEMS,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// One measured (dtype, data kind).
#[derive(Clone, Debug)]
pub struct BenchRow {
    pub dtype: CodecDType,
    pub kind: DataKind,
    pub raw_bytes: usize,
    pub coded_bytes: usize,
    /// Sum over chunks of the order-0 entropy of the chunk's symbols, in bytes.
    pub symbol_entropy_bytes: f64,
    /// Bytes of the raw mantissa bits.
    pub mantissa_bytes: usize,
    /// Bytes a per-chunk canonical Huffman code of the symbols would take (the alternative coder).
    pub huffman_symbol_bytes: f64,
    pub encode_gbps: f64,
    pub decode_gbps: f64,
    pub decode_unverified_gbps: f64,
    pub zstd_bytes: usize,
    pub zstd_encode_gbps: f64,
    pub zstd_decode_gbps: f64,
    /// LZ4 (block format, `lz4_flex`) on the same bytes in the same run.
    pub lz4_bytes: usize,
    pub lz4_encode_gbps: f64,
    pub lz4_decode_gbps: f64,
}

impl BenchRow {
    pub fn ratio(&self) -> f64 {
        self.raw_bytes as f64 / self.coded_bytes as f64
    }
    pub fn zstd_ratio(&self) -> f64 {
        self.raw_bytes as f64 / self.zstd_bytes as f64
    }
    pub fn lz4_ratio(&self) -> f64 {
        self.raw_bytes as f64 / self.lz4_bytes.max(1) as f64
    }
    /// Entropy bound of the whole encoding: coded symbols at their entropy plus raw mantissas.
    pub fn bound_bytes(&self) -> f64 {
        self.symbol_entropy_bytes + self.mantissa_bytes as f64
    }
    /// Bytes spent on the symbols (everything but the mantissas: tables, states, header
    /// included) over their entropy, minus one. `None` when there is no entropy to compare to.
    pub fn symbol_overhead(&self) -> Option<f64> {
        (self.symbol_entropy_bytes > 64.0).then(|| {
            (self.coded_bytes as f64 - self.mantissa_bytes as f64) / self.symbol_entropy_bytes - 1.0
        })
    }
}

/// Time this thread spent on a CPU (`/proc/thread-self/schedstat`), so figures stay per-core
/// on a machine shared with other work; wall time where that file does not exist.
pub struct CoreTimer {
    wall: Instant,
    cpu_ns: Option<u64>,
}

fn thread_cpu_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

impl CoreTimer {
    pub fn start() -> Self {
        let cpu_ns = thread_cpu_ns();
        CoreTimer {
            wall: Instant::now(),
            cpu_ns,
        }
    }
    pub fn elapsed(&self) -> Duration {
        match (self.cpu_ns, thread_cpu_ns()) {
            (Some(a), Some(b)) if b > a => Duration::from_nanos(b - a),
            _ => self.wall.elapsed(),
        }
    }
}

/// Time per run of `f`: the best of `trials` rounds, each round repeating `f` until it used at
/// least 0.2 s (so coarse CPU-time clocks still resolve it) and dividing by the repetitions.
fn best(trials: usize, mut f: impl FnMut() -> Result<Duration>) -> Result<Duration> {
    let mut b = Duration::MAX;
    for _ in 0..trials.max(1) {
        let (mut total, mut reps) = (Duration::ZERO, 0u32);
        while total < Duration::from_millis(200) || reps == 0 {
            total += f()?;
            reps += 1;
        }
        b = b.min(total / reps);
    }
    Ok(b)
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-9) / 1e9
}

fn zstd_err(e: std::io::Error) -> CompressError {
    CompressError::Io {
        context: "zstd".into(),
        source: e,
    }
}

/// Measures one (dtype, kind) on one core.
pub fn measure(dtype: CodecDType, kind: DataKind, opts: &BenchOptions) -> Result<BenchRow> {
    let data = generate(kind, dtype, opts.numel, 42);
    let enc_opts = EncodeOptions {
        chunk_elems: opts.chunk_elems,
        threads: 1,
        ..Default::default()
    };
    let mut coded = Vec::new();
    codec::encode_into(dtype, &data, &enc_opts, &mut coded)?;
    let enc = best(opts.trials, || {
        let t = CoreTimer::start();
        codec::encode_into(dtype, black_box(&data), &enc_opts, &mut coded)?;
        Ok(t.elapsed())
    })?;
    let mut back = vec![0u8; data.len()];
    let mut dec_time = |verify| {
        let o = DecodeOptions {
            threads: 1,
            verify,
            ..Default::default()
        };
        best(opts.trials, || {
            let t = CoreTimer::start();
            codec::decode_into(black_box(&coded), &mut back, &o)?;
            Ok(t.elapsed())
        })
    };
    let dec = dec_time(true)?;
    let dec_unverified = dec_time(false)?;
    if back != data {
        return Err(CompressError::InvalidState(format!(
            "{dtype} {} did not round-trip",
            kind.name()
        )));
    }
    // Format v2 codes the whole tensor with one table: its entropy is the bound.
    let symbols = codec::chunk_symbols(dtype, &data, opts.numel.max(1));
    let symbol_entropy_bytes = symbols.iter().map(|c| c.entropy_bits).sum::<f64>() / 8.0;
    let mantissa_bytes = symbols
        .iter()
        .map(|c| (c.numel * dtype.mantissa_bits() as usize).div_ceil(8))
        .sum();
    let huffman_symbol_bytes = codec::huffman_bits(dtype, &data, opts.numel.max(1)) / 8.0;

    let mut z = zstd::bulk::Compressor::new(1).map_err(zstd_err)?;
    let mut zout = Vec::with_capacity(zstd::zstd_safe::compress_bound(data.len()));
    let zenc = best(opts.trials, || {
        zout.clear();
        let t = CoreTimer::start();
        z.compress_to_buffer(black_box(&data[..]), &mut zout)
            .map_err(zstd_err)?;
        Ok(t.elapsed())
    })?;
    let mut zd = zstd::bulk::Decompressor::new().map_err(zstd_err)?;
    let mut zback = Vec::with_capacity(data.len());
    let zdec = best(opts.trials, || {
        zback.clear();
        let t = CoreTimer::start();
        zd.decompress_to_buffer(black_box(&zout[..]), &mut zback)
            .map_err(zstd_err)?;
        Ok(t.elapsed())
    })?;
    if zback != data {
        return Err(CompressError::InvalidState(
            "zstd did not round-trip".into(),
        ));
    }
    let mut lout = vec![0u8; lz4_flex::block::get_maximum_output_size(data.len())];
    let mut lz4_len = 0;
    let lenc = best(opts.trials, || {
        let t = CoreTimer::start();
        lz4_len = lz4_flex::block::compress_into(black_box(&data[..]), &mut lout)
            .map_err(|e| CompressError::InvalidState(format!("lz4: {e}")))?;
        Ok(t.elapsed())
    })?;
    let mut lback = vec![0u8; data.len()];
    let ldec = best(opts.trials, || {
        let t = CoreTimer::start();
        lz4_flex::block::decompress_into(black_box(&lout[..lz4_len]), &mut lback)
            .map_err(|e| CompressError::InvalidState(format!("lz4: {e}")))?;
        Ok(t.elapsed())
    })?;
    if lback != data {
        return Err(CompressError::InvalidState("lz4 did not round-trip".into()));
    }
    Ok(BenchRow {
        dtype,
        kind,
        raw_bytes: data.len(),
        coded_bytes: coded.len(),
        symbol_entropy_bytes,
        mantissa_bytes,
        huffman_symbol_bytes,
        encode_gbps: gbps(data.len(), enc),
        decode_gbps: gbps(data.len(), dec),
        decode_unverified_gbps: gbps(data.len(), dec_unverified),
        zstd_bytes: zout.len(),
        zstd_encode_gbps: gbps(data.len(), zenc),
        zstd_decode_gbps: gbps(data.len(), zdec),
        lz4_bytes: lz4_len,
        lz4_encode_gbps: gbps(data.len(), lenc),
        lz4_decode_gbps: gbps(data.len(), ldec),
    })
}

/// CPU time of the whole process so far, all threads (exited ones too) together, from
/// `/proc/self/stat` (user + system, in Linux's fixed 100 Hz ticks); `None` elsewhere.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name start at field 3; utime and stime are 14, 15.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let ticks: u64 = fields.next()?.parse::<u64>().ok()? + fields.next()?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// One multi-threaded measurement: wall-clock GB/s of `opts.threads` threads and of one thread
/// on the same bytes in the same run (rounds alternating, so both see the same machine load),
/// and the CPU time all threads spent per call relative to one thread's (1.0: splitting the
/// work adds none; on idle cores the wall-clock scaling would approach threads / that).
#[derive(Clone, Copy, Debug)]
pub struct ThreadRow {
    pub encode_gbps: f64,
    pub decode_gbps: f64,
    pub encode_one_gbps: f64,
    pub decode_one_gbps: f64,
    pub encode_cpu_ratio: Option<f64>,
    pub decode_cpu_ratio: Option<f64>,
}

/// Measures [`ThreadRow`] for `opts.threads` threads.
pub fn measure_threads(
    dtype: CodecDType,
    kind: DataKind,
    opts: &BenchOptions,
) -> Result<ThreadRow> {
    let data = generate(kind, dtype, opts.numel, 42);
    let mut coded = Vec::new();
    let mut back = vec![0u8; data.len()];
    let eo = |threads| EncodeOptions {
        chunk_elems: opts.chunk_elems,
        threads,
        ..Default::default()
    };
    let dopts = |threads| DecodeOptions {
        threads,
        ..Default::default()
    };
    codec::encode_into(dtype, &data, &eo(1), &mut coded)?;
    let mut encode = |threads| -> Result<Duration> {
        let t = Instant::now();
        codec::encode_into(dtype, black_box(&data), &eo(threads), &mut coded)?;
        Ok(t.elapsed())
    };
    let (mut enc_n, mut enc_1) = (Duration::MAX, Duration::MAX);
    for _ in 0..opts.trials.max(1) {
        enc_n = enc_n.min(best(1, || encode(opts.threads))?);
        enc_1 = enc_1.min(best(1, || encode(1))?);
    }
    // CPU time per call over at least a second of calls (the tick is 10 ms).
    let cpu_per_call = |f: &mut dyn FnMut() -> Result<Duration>| -> Result<Option<f64>> {
        let (wall, start) = (Instant::now(), process_cpu());
        let mut reps = 0u32;
        while wall.elapsed() < Duration::from_secs(1) {
            f()?;
            reps += 1;
        }
        Ok(start
            .zip(process_cpu())
            .map(|(a, b)| (b - a).as_secs_f64() / reps as f64))
    };
    let ratio =
        |n: Option<f64>, one: Option<f64>| n.zip(one).filter(|p| p.1 > 0.0).map(|(n, o)| n / o);
    let enc_cpu = ratio(
        cpu_per_call(&mut || encode(opts.threads))?,
        cpu_per_call(&mut || encode(1))?,
    );
    let mut decode = |threads| -> Result<Duration> {
        let t = Instant::now();
        codec::decode_into(black_box(&coded), &mut back, &dopts(threads))?;
        Ok(t.elapsed())
    };
    let (mut dec_n, mut dec_1) = (Duration::MAX, Duration::MAX);
    for _ in 0..opts.trials.max(1) {
        dec_n = dec_n.min(best(1, || decode(opts.threads))?);
        dec_1 = dec_1.min(best(1, || decode(1))?);
    }
    let dec_cpu = ratio(
        cpu_per_call(&mut || decode(opts.threads))?,
        cpu_per_call(&mut || decode(1))?,
    );
    if back != data {
        return Err(CompressError::InvalidState(format!(
            "{dtype} {} did not round-trip on {} threads",
            kind.name(),
            opts.threads
        )));
    }
    Ok(ThreadRow {
        encode_gbps: gbps(data.len(), enc_n),
        decode_gbps: gbps(data.len(), dec_n),
        encode_one_gbps: gbps(data.len(), enc_1),
        decode_one_gbps: gbps(data.len(), dec_1),
        encode_cpu_ratio: enc_cpu,
        decode_cpu_ratio: dec_cpu,
    })
}

/// Runs the benchmark and returns Markdown: one table row per (dtype, kind).
pub fn bench(opts: &BenchOptions) -> Result<String> {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Codec (format v2), one core (thread CPU time), {} elements per tensor, blocks of {} elements, best of {} \
         (goals on bf16: encode >= 2 GB/s, decode >= 3 GB/s; size within 1% of the symbol entropy).\n",
        opts.numel, opts.chunk_elems, opts.trials
    );
    let _ = writeln!(
        s,
        "| dtype | data | ratio | zstd-1 ratio | lz4 ratio | size / bound | symbols / entropy | huffman / entropy | encode GB/s | decode GB/s (no verify) | zstd-1 enc GB/s | zstd-1 dec GB/s | lz4 enc GB/s | lz4 dec GB/s |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for &dtype in &opts.dtypes {
        for &kind in &opts.kinds {
            let r = measure(dtype, kind, opts)?;
            let pct = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:+.2}%", v * 100.0));
            let huff = (r.symbol_entropy_bytes > 64.0)
                .then(|| r.huffman_symbol_bytes / r.symbol_entropy_bytes - 1.0);
            let _ = writeln!(
                s,
                "| {} | {} | {:.3} | {:.3} | {:.3} | {} | {} | {} | {:.2} | {:.2} ({:.2}) | {:.2} | {:.2} | {:.2} | {:.2} |",
                dtype,
                kind.name(),
                r.ratio(),
                r.zstd_ratio(),
                r.lz4_ratio(),
                if r.bound_bytes() > (HEADER_LEN as f64) {
                    format!("{:.4}", r.coded_bytes as f64 / r.bound_bytes())
                } else {
                    "-".into()
                },
                pct(r.symbol_overhead()),
                pct(huff),
                r.encode_gbps,
                r.decode_gbps,
                r.decode_unverified_gbps,
                r.zstd_encode_gbps,
                r.zstd_decode_gbps,
                r.lz4_encode_gbps,
                r.lz4_decode_gbps,
            );
        }
    }
    if opts.threads > 1 {
        let _ = writeln!(s);
        for &dtype in &opts.dtypes {
            let r = measure_threads(dtype, DataKind::Gaussian, opts)?;
            let cpu = |c: Option<f64>| c.map_or("-".to_string(), |c| format!("{c:.2}x"));
            let _ = writeln!(
                s,
                "{} threads, {dtype} gaussian (wall clock): encode {:.2} GB/s ({:.2}x one thread's {:.2}; CPU time {} one thread's), decode {:.2} GB/s ({:.2}x one thread's {:.2}; CPU time {} one thread's)",
                opts.threads,
                r.encode_gbps,
                r.encode_gbps / r.encode_one_gbps,
                r.encode_one_gbps,
                cpu(r.encode_cpu_ratio),
                r.decode_gbps,
                r.decode_gbps / r.decode_one_gbps,
                r.decode_one_gbps,
                cpu(r.decode_cpu_ratio),
            );
        }
    }
    Ok(s)
}

/// One size of [`device_bench`].
#[derive(Clone, Debug)]
pub struct DeviceBenchRow {
    pub bytes: usize,
    pub ratio: f64,
    pub encode_gbps: f64,
    pub decode_gbps: f64,
    /// A device-to-device copy of the same bytes, timed the same way in the same run.
    pub memcpy_gbps: f64,
}

/// The device codec on `p`'s stream against a device-to-device copy of the same bytes: bf16
/// activations (GELU-like) of each size in `sizes` (bytes), each step timed with device events
/// (best of `trials`). Every encoding is checked against the CPU codec's bytes and every
/// decoding bit for bit: a wrong codec fails instead of reporting a speed.
pub fn device_bench(
    p: &dyn hprt_platform::Platform,
    codec: &dyn hprt_compress::DeviceCodec,
    opts: &EncodeOptions,
    sizes: &[usize],
    trials: usize,
) -> Result<Vec<DeviceBenchRow>> {
    use hprt_platform::Memory;
    let dtype = CodecDType::BF16;
    let s = p.create_stream()?;
    let (start, end) = (p.create_event(true)?, p.create_event(true)?);
    let timed = |f: &mut dyn FnMut() -> Result<()>| -> Result<Duration> {
        let mut b = f32::MAX;
        for _ in 0..trials.max(1) {
            p.record_event(&start, &s)?;
            f()?;
            p.record_event(&end, &s)?;
            p.synchronize_event(&end)?;
            b = b.min(p.event_elapsed_ms(&start, &end)?);
        }
        Ok(Duration::from_secs_f64(f64::from(b.max(1e-6)) / 1e3))
    };
    let mut rows = Vec::new();
    for &bytes in sizes {
        let numel = bytes / dtype.size();
        let data = generate(DataKind::Gelu, dtype, numel, 7);
        let src = p.alloc_device(data.len())?;
        p.write_device_sync(&src, 0, &data, &s)?;
        let copy = p.alloc_device(data.len())?;
        let scratch = p.alloc_device(codec.max_encoded_len(dtype, numel))?;
        let memcpy = timed(&mut || {
            let n = data.len();
            Ok(p.copy_async(Memory::Device(&copy), 0, Memory::Device(&src), 0, n, &s)?)
        })?;
        let mut packed = None;
        let encode = timed(&mut || {
            let pending = codec.encode_async(p, src.at(0), dtype, numel, &scratch, &s)?;
            packed = Some(pending);
            Ok(())
        })?;
        let packed = packed.expect("timed at least once").finish_in_place(p)?;
        let mut enc = vec![0u8; packed.byte_len()];
        p.read_device_sync(packed.device_buffer(), 0, &mut enc, &s)?;
        if enc != codec::encode(dtype, &data, opts)? {
            return Err(CompressError::InvalidState(format!(
                "the {} codec's encoding of {bytes} bytes differs from the CPU codec's",
                codec.name()
            )));
        }
        let mut decoded = None;
        let decode = timed(&mut || {
            decoded = Some(codec.decode_async(p, &packed, copy.at(0), &s)?);
            Ok(())
        })?;
        decoded.expect("timed at least once").finish(p)?;
        let mut back = vec![0u8; data.len()];
        p.read_device_sync(&copy, 0, &mut back, &s)?;
        if back != data {
            return Err(CompressError::InvalidState(format!(
                "the {} codec decoded {bytes} bytes to other bytes",
                codec.name()
            )));
        }
        rows.push(DeviceBenchRow {
            bytes,
            ratio: packed.ratio(),
            encode_gbps: gbps(bytes, encode),
            decode_gbps: gbps(bytes, decode),
            memcpy_gbps: gbps(bytes, memcpy),
        });
    }
    p.destroy_stream(&s)?;
    Ok(rows)
}
