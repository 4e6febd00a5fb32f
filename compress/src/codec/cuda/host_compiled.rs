//! [`super`]'s kernels compiled as host C++ against the CUDA emulator's device shim
//! (`platform/src/cuda/host_shim.h`), checked byte for byte against the CPU codec.

use super::*;
use crate::codec::{encode, v2, EncodeOptions};
use crate::data::{generate, DataKind, SplitMix64};
use crate::CodecDType;

/// The emulator's device shim (fiber threads per block, warp operations), so the kernels
/// run here with their launch shapes as on the emulator.
const SHIM: &str = include_str!("../../../../platform/src/cuda/host_shim.h");

/// A launcher per kernel: `test_launch(kernel index, grid, block, workspace)`.
const LAUNCHERS: &str = r#"
template <class F> static void hprt_test_body(void* p) { (*static_cast<F*>(p))(); }
template <class F> static int hprt_test_run(unsigned grid, unsigned block, F f) {
    unsigned d[6] = {grid, 1, 1, block, 1, 1};
    return ::hprt_emu::run_grid(d, 0, true, hprt_test_body<F>, &f);
}
extern "C" int hprt_test_launch(unsigned k, unsigned grid, unsigned block, u8* ws) {
    switch (k) {
    case 0: return hprt_test_run(grid, block, [=] { hprt_codec_count(ws); });
    case 1: return hprt_test_run(grid, block, [=] { hprt_codec_measure(ws); });
    case 2: return hprt_test_run(grid, block, [=] { hprt_codec_encode(ws); });
    case 3: return hprt_test_run(grid, block, [=] { hprt_codec_decode(ws); });
    }
    return 2;
}
extern "C" void hprt_test_bytes(u64* read, u64* written, int reset) {
    *read = hprt_bytes_read;
    *written = hprt_bytes_written;
    if (reset) hprt_bytes_read = hprt_bytes_written = 0;
}
"#;

/// The compiled source, built once per process; the lock serialises the tests (the
/// shim's grid state is per thread, but the build is shared).
fn library() -> std::sync::MutexGuard<'static, libloading::Library> {
    static LIB: std::sync::OnceLock<std::sync::Mutex<libloading::Library>> =
        std::sync::OnceLock::new();
    hprt_platform::sync::lock(LIB.get_or_init(|| std::sync::Mutex::new(compile())))
}

fn compile() -> libloading::Library {
    let dir = std::env::temp_dir().join(format!("hprt-codec-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, lib) = (dir.join("codec.cpp"), dir.join("libcodec.so"));
    std::fs::write(&src, format!("{SHIM}\n{SOURCE}\n{LAUNCHERS}")).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = std::process::Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O2",
            "-shared",
            "-fPIC",
            "-Wall",
            "-Werror",
            "-Wno-unused-function",
            "-DHPRT_COUNT_BYTES",
            "-o",
        ])
        .arg(&lib)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler {cxx:?}: {e}"));
    assert!(
        out.status.success(),
        "the codec kernel source does not compile:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: a library we just built from our own source.
    unsafe { libloading::Library::new(&lib) }.unwrap()
}

type Launch = unsafe extern "C" fn(u32, u32, u32, *mut u8) -> i32;

/// A zeroed 16-byte-aligned workspace of `len` bytes with `l`'s upload at its start.
fn workspace(l: &Layout) -> Vec<u128> {
    let mut ws = vec![0u128; l.len.div_ceil(16)];
    // SAFETY: `ws` has at least `l.len >= upload.len()` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(
            l.upload.as_ptr(),
            ws.as_mut_ptr() as *mut u8,
            l.upload.len(),
        )
    };
    ws
}

fn run(lib: &libloading::Library, k: usize, shape: LaunchShape, ws: &mut [u128], cap: Option<u32>) {
    // SAFETY: the signature `LAUNCHERS` defines.
    let f = unsafe { *lib.get::<Launch>(b"hprt_test_launch\0").unwrap() };
    let grid = cap.map_or(shape.grid, |c| shape.grid.min(c));
    // SAFETY: the workspace holds the layout the kernels read; the addresses in it are
    // live host buffers of the sizes the descriptors give.
    let r = unsafe { f(k as u32, grid, shape.block, ws.as_mut_ptr() as *mut u8) };
    assert_eq!(r, 0, "kernel {} failed (divergent barrier?)", KERNELS[k]);
}

fn result(ws: &[u128], l: &Layout, t: usize) -> u64 {
    // SAFETY: in bounds of the workspace.
    let p = unsafe { (ws.as_ptr() as *const u8).add(l.results_at + 8 * t) };
    u64::from_le_bytes(
        // SAFETY: the 8 bytes at `p` are tensor `t`'s result slot (`t < l.tensors`), inside
        // the workspace of `l.len` bytes borrowed for this call; its u128s are initialised
        // and any byte is a valid u8.
        unsafe { std::slice::from_raw_parts(p, 8) }
            .try_into()
            .unwrap(),
    )
}

/// The zeroed region is zero again after a sequence (what lets the next one skip a
/// memset), but for each tensor's total and prefix length, which are written before read.
fn assert_counters_zero(ws: &[u128], l: &Layout) {
    // SAFETY: in bounds.
    let z = unsafe {
        std::slice::from_raw_parts((ws.as_ptr() as *const u8).add(l.zero_at), l.zero_len)
    };
    let counters = COUNTERS * l.tensors;
    for (i, w) in z.chunks(8).enumerate() {
        if i * 8 < counters && matches!(i % (COUNTERS / 8), 3 | 4) {
            continue;
        }
        assert!(w.iter().all(|&b| b == 0), "counter word {i} left non-zero");
    }
}

/// The encode launches on host memory, for a batch; each tensor's encoding.
fn kernel_encode_batch(
    lib: &libloading::Library,
    tensors: &[(CodecDType, &[u8])],
    opts: &EncodeOptions,
    cap: Option<u32>,
) -> Vec<Vec<u8>> {
    let mut outs: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(d, b)| vec![0u8; v2::max_encoded_len(*d, b.len() / d.size(), opts.chunk_elems)])
        .collect();
    let descs: Vec<EncodeDesc> = tensors
        .iter()
        .zip(outs.iter_mut())
        .map(|((dtype, data), out)| EncodeDesc {
            src: data.as_ptr() as u64,
            dst: out.as_mut_ptr() as u64,
            dtype: *dtype,
            numel: data.len() / dtype.size(),
        })
        .collect();
    let l = Layout::encode(descs.len(), &descs, opts);
    let mut ws = workspace(&l);
    for (k, shape) in encode_shapes(l.blocks) {
        run(lib, k, shape, &mut ws, cap);
    }
    assert_counters_zero(&ws, &l);
    outs.iter_mut()
        .enumerate()
        .map(|(t, out)| {
            out.truncate(result(&ws, &l, t) as usize);
            std::mem::take(out)
        })
        .collect()
}

fn kernel_encode(
    lib: &libloading::Library,
    dtype: CodecDType,
    data: &[u8],
    pb: u32,
    block: usize,
) -> Vec<u8> {
    let opts = EncodeOptions {
        chunk_elems: block,
        prob_bits: pb,
        threads: 1,
    };
    kernel_encode_batch(lib, &[(dtype, data)], &opts, None)
        .pop()
        .unwrap()
}

/// The grid of a test's decode launch.
#[derive(Clone, Copy)]
enum Grid {
    /// The runtime's grid, at most this many CTAs where given.
    Runtime(Option<u32>),
    /// One CTA of one warp: the cheapest launch to repeat.
    OneWarp,
}

/// The decode launch; the decoded bytes and the status word.
fn kernel_decode_with(
    lib: &libloading::Library,
    dtype: CodecDType,
    numel: usize,
    enc: &[u8],
    grid: Grid,
) -> (Vec<u8>, u32) {
    let mut out = vec![0u8; numel * dtype.size()];
    let descs = [DecodeDesc {
        enc: enc.as_ptr() as u64,
        enc_len: enc.len(),
        dst: out.as_mut_ptr() as u64,
        dtype,
        numel,
    }];
    let l = Layout::decode(1, &descs);
    let mut ws = workspace(&l);
    let (shape, cap) = match grid {
        Grid::Runtime(cap) => (decode_shape(&descs, 256), cap),
        Grid::OneWarp => (LaunchShape { grid: 1, block: 32 }, None),
    };
    run(lib, 3, shape, &mut ws, cap);
    assert_counters_zero(&ws, &l);
    (out, result(&ws, &l, 0) as u32)
}

fn kernel_decode(
    lib: &libloading::Library,
    dtype: CodecDType,
    numel: usize,
    enc: &[u8],
) -> (Vec<u8>, u32) {
    kernel_decode_with(lib, dtype, numel, enc, Grid::Runtime(None))
}

fn corpus() -> Vec<(CodecDType, Vec<u8>)> {
    let mut rng = SplitMix64::new(99);
    let mut out = Vec::new();
    for dtype in CodecDType::ALL {
        for kind in DataKind::ALL {
            out.push((dtype, generate(kind, dtype, 20_000 + 13, 3)));
        }
        // Random bit patterns: every symbol, NaN payloads, subnormals.
        let n = 5_000 * dtype.size() + dtype.size() * 7;
        out.push((dtype, (0..n).map(|_| rng.next_u64() as u8).collect()));
        // Skewed random patterns: few symbols, random mantissas.
        out.push((
            dtype,
            (0..4_001)
                .flat_map(|_| {
                    let r = rng.next_u64();
                    let v = (r >> 40) as u32 & 0x3 | (r as u32) << 2;
                    v.to_le_bytes()[..dtype.size()].to_vec()
                })
                .collect(),
        ));
    }
    out
}

/// The count kernel's table (FORMAT.md's normalisation) against `v2::normalize`, on data
/// whose symbol counts are given: equal counts (every unit moved is a tie), few distinct
/// counts, skewed, random, a lone symbol.
#[test]
fn count_kernel_builds_the_cpu_codecs_table_with_ties_either_way() {
    let lib = library();
    let mut r = SplitMix64::new(11);
    for pb in [9, 12, 14] {
        for dtype in [CodecDType::F16, CodecDType::BF16] {
            let a = 1usize << dtype.symbol_bits();
            let w = dtype.mantissa_bits();
            let cases: Vec<Vec<u64>> = vec![
                (0..a).map(|_| 3).collect(),
                (0..a).map(|s| if s % 3 == 0 { 7 } else { 0 }).collect(),
                (0..a).map(|_| 1 + r.next_u64() % 3).collect(),
                (0..a).map(|s| 20_000 >> (s / 2).min(14)).collect(),
                (0..a).map(|_| r.next_u64() % 100).collect(),
                (0..a).map(|s| (s == 5) as u64 * 9).collect(),
            ];
            for counts in cases {
                let data: Vec<u8> = counts
                    .iter()
                    .enumerate()
                    .flat_map(|(s, &c)| {
                        std::iter::repeat_n(((s as u16) << w).to_le_bytes(), c as usize)
                    })
                    .flatten()
                    .collect();
                let numel = data.len() / 2;
                let opts = EncodeOptions {
                    chunk_elems: 16_384,
                    prob_bits: pb,
                    threads: 1,
                };
                let descs = [EncodeDesc {
                    src: data.as_ptr() as u64,
                    dst: 0,
                    dtype,
                    numel,
                }];
                let l = Layout::encode(1, &descs, &opts);
                let mut ws = workspace(&l);
                let (k, shape) = encode_shapes(l.blocks)[0];
                run(&lib, k, shape, &mut ws, Some(3));
                // SAFETY: the table region of tensor 0 (512 entries of 16 bytes).
                let table: &[u8] = unsafe {
                    let at = u64::from_le_bytes(
                        std::slice::from_raw_parts((ws.as_ptr() as *const u8).add(24), 8)
                            .try_into()
                            .unwrap(),
                    ) as usize;
                    std::slice::from_raw_parts((ws.as_ptr() as *const u8).add(at), 512 * 16)
                };
                let freq = v2::normalize(&counts, pb);
                let cpu = crate::codec::rans::enc_table(&freq, pb);
                for s in 0..512 {
                    let e = &table[16 * s..16 * s + 16];
                    let word =
                        |k: usize| u32::from_le_bytes(e[4 * k..4 * k + 4].try_into().unwrap());
                    let c = &cpu[s];
                    assert_eq!(
                        (word(0), word(1), word(2), word(3)),
                        (
                            c.x_max,
                            c.rcp,
                            c.bias,
                            c.cmpl as u32 | (c.shift as u32) << 16
                        ),
                        "{dtype} {pb} bits, symbol {s}, {counts:?}"
                    );
                }
            }
        }
    }
}

/// Bytes the kernels read and wrote since the last call (the source's work-model counters).
fn bytes_moved(lib: &libloading::Library) -> (u64, u64) {
    type Bytes = unsafe extern "C" fn(*mut u64, *mut u64, i32);
    let (mut r, mut w) = (0, 0);
    // SAFETY: the signature `LAUNCHERS` defines.
    unsafe { lib.get::<Bytes>(b"hprt_test_bytes\0").unwrap()(&mut r, &mut w, 1) };
    (r, w)
}

/// The work model in bytes: an encode reads its input three times (count, measure, code)
/// and writes the encoding once; a decode reads the encoding once (plus the prefix per
/// CTA) and writes the tensor once. A change that adds a pass over the data fails here.
#[test]
fn kernels_move_the_modelled_bytes_per_input_byte() {
    let lib = library();
    let data = generate(DataKind::Gelu, CodecDType::BF16, 200_000, 9);
    bytes_moved(&lib);
    let enc = kernel_encode(&lib, CodecDType::BF16, &data, 12, 16_384);
    let (er, ew) = bytes_moved(&lib);
    let (back, status) = kernel_decode_with(
        &lib,
        CodecDType::BF16,
        200_000,
        &enc,
        Grid::Runtime(Some(4)),
    );
    let (dr, dw) = bytes_moved(&lib);
    assert_eq!(status, 0);
    assert!(back == data);
    let (n, c) = (data.len() as f64, enc.len() as f64);
    let per = |b: u64| b as f64 / n;
    eprintln!(
            "per input byte (ratio {:.3}): encode reads {:.3}, writes {:.3}; decode reads {:.3}, writes {:.3}",
            n / c,
            per(er),
            per(ew),
            per(dr),
            per(dw)
        );
    assert!(per(er) <= 3.0 + 0.01, "encode reads {er}");
    assert!(per(ew) <= c / n + 0.01, "encode writes {ew}");
    let prefix = crate::codec::inspect(&enc).unwrap().offsets[0] as f64;
    let ctas = 4.0;
    assert!(
        per(dr) <= (c + ctas * prefix) / n + 0.01,
        "decode reads {dr}"
    );
    assert!(per(dw) <= 1.0 + 0.001, "decode writes {dw}");
}

#[test]
fn kernels_write_the_cpu_codecs_bytes_and_decode_them() {
    let lib = library();
    for (dtype, data) in corpus() {
        for (pb, block) in [(12, v2::DEFAULT_BLOCK_ELEMS), (11, 1024), (14, 96)] {
            let opts = EncodeOptions {
                chunk_elems: block,
                prob_bits: pb,
                threads: 1,
            };
            let cpu = encode(dtype, &data, &opts).unwrap();
            let dev = kernel_encode(&lib, dtype, &data, pb, block);
            assert!(
                dev == cpu,
                "{dtype}, {pb} bits, blocks of {block}: the bytes differ"
            );
            let numel = data.len() / dtype.size();
            let (back, status) = kernel_decode(&lib, dtype, numel, &cpu);
            assert_eq!(status, 0, "{dtype}: {}", status_message(status));
            assert!(back == data, "{dtype}: the kernels decode other bytes");
        }
    }
}

/// A batch of tensors of every dtype, sizes and alignments (one misaligned source), on a
/// few CTAs (so every kernel loops over blocks of several tensors): each is the CPU codec's
/// bytes; and decoded with a grid of 2 (the last-CTA finish across CTAs).
#[test]
fn one_launch_sequence_encodes_a_batch_as_the_cpu_codec() {
    let lib = library();
    let mut rng = SplitMix64::new(5);
    let random: Vec<u8> = (0..8_003).map(|_| rng.next_u64() as u8).collect();
    let gelu = generate(DataKind::Gelu, CodecDType::BF16, 9_001, 1);
    let soft = generate(DataKind::Softmax, CodecDType::F16, 3_000, 2);
    let w32 = generate(DataKind::Weights, CodecDType::F32, 2_500, 3);
    let mut shifted = vec![0u8; gelu.len() + 1];
    shifted[1..].copy_from_slice(&gelu);
    let tensors: Vec<(CodecDType, &[u8])> = vec![
        (CodecDType::BF16, &gelu),
        (CodecDType::F16, &soft),
        (CodecDType::F32, &w32),
        (CodecDType::BF16, &shifted[1..]),
        (CodecDType::BF16, &random[..2 * 40]),
        (CodecDType::F32, &random[..4 * 2_000]),
    ];
    for (pb, block, cap) in [(12, 1024, Some(2)), (13, 96, Some(5)), (12, 65_536, None)] {
        let opts = EncodeOptions {
            chunk_elems: block,
            prob_bits: pb,
            threads: 1,
        };
        let encs = kernel_encode_batch(&lib, &tensors, &opts, cap);
        for ((dtype, data), enc) in tensors.iter().zip(&encs) {
            assert!(
                *enc == encode(*dtype, data, &opts).unwrap(),
                "{dtype} x {}, blocks of {block}: not the CPU codec's bytes",
                data.len()
            );
            let (back, status) = kernel_decode_with(
                &lib,
                *dtype,
                data.len() / dtype.size(),
                enc,
                Grid::Runtime(Some(2)),
            );
            assert_eq!(status, 0, "{}", status_message(status));
            assert!(back == *data);
        }
    }
}

/// Tensors from `v2::SAMPLE_FROM` elements on are counted on a sample plus their sign ranges:
/// the kernels build the CPU codec's table, in a batch with a small tensor (counted whole),
/// for every dtype, a misaligned source, sizes off the sample's period, gaps in the exponents,
/// zeros, and an infinity far from the rest.
#[test]
fn sampled_counts_build_the_cpu_codecs_table() {
    let lib = library();
    let n = v2::SAMPLE_FROM + 77;
    let mut rng = SplitMix64::new(21);
    let soft = generate(DataKind::Softmax, CodecDType::F16, n + 300, 5);
    let mut w32 = generate(DataKind::Weights, CodecDType::F32, n, 6);
    // An infinity in an unsampled element: only the edge flags know its symbol.
    w32[4 * 1000..4 * 1001].copy_from_slice(&f32::INFINITY.to_le_bytes());
    // bf16 on every other exponent of a band, either sign, and zeros: gaps inside the ranges;
    // one byte past an aligned start (the kernels' word path).
    let mut gaps = vec![0u8; 1];
    for i in 0..n {
        let r = rng.next_u64();
        let exp = 100 + 2 * (r % 8) as u16;
        let v = if i % 97 == 0 {
            0
        } else {
            (exp << 7) | (r >> 20) as u16 & 0x7f
        };
        gaps.extend_from_slice(&(v | (r as u16 & 0x8000)).to_le_bytes());
    }
    let small = generate(DataKind::Gelu, CodecDType::BF16, 5_000, 7);
    let tensors: Vec<(CodecDType, &[u8])> = vec![
        (CodecDType::F16, &soft),
        (CodecDType::F32, &w32),
        (CodecDType::BF16, &gaps[1..]),
        (CodecDType::BF16, &small),
    ];
    let opts = EncodeOptions {
        threads: 1,
        ..Default::default()
    };
    let encs = kernel_encode_batch(&lib, &tensors, &opts, Some(64));
    for ((dtype, data), enc) in tensors.iter().zip(&encs) {
        assert!(
            *enc == encode(*dtype, data, &opts).unwrap(),
            "{dtype} x {}: not the CPU codec's bytes",
            data.len()
        );
    }
    let (back, status) = kernel_decode(&lib, CodecDType::F32, n, &encs[1]);
    assert_eq!(status, 0, "{}", status_message(status));
    assert!(back == w32);
}

/// Differential check: on mutated encodings (random bytes anywhere; table, index and
/// header fields rewritten with the prefix checksum resealed) the kernels accept exactly
/// what the CPU decoder accepts for the expected tensor, and decode the same bytes.
#[test]
fn kernel_decoder_agrees_with_the_cpu_decoder_on_mutated_encodings() {
    let lib = library();
    let mut rng = SplitMix64::new(2026);
    let random: Vec<u8> = (0..4 * 1_000).map(|_| rng.next_u64() as u8).collect();
    let cases = [
        (
            CodecDType::BF16,
            generate(DataKind::Gelu, CodecDType::BF16, 3_000, 1),
            256,
        ),
        (
            CodecDType::F16,
            generate(DataKind::Softmax, CodecDType::F16, 2_000, 2),
            512,
        ),
        (CodecDType::F32, random, 96),
    ];
    let (mut accepted, mut rejected) = (0, 0);
    for (dtype, data, block) in cases {
        let opts = EncodeOptions {
            chunk_elems: block,
            prob_bits: 12,
            threads: 1,
        };
        let enc = encode(dtype, &data, &opts).unwrap();
        let prefix = crate::codec::inspect(&enc).unwrap().offsets[0];
        let numel = data.len() / dtype.size();
        for i in 0..600 {
            let mut m = enc.clone();
            let r = rng.next_u64();
            let at = (r >> 8) as usize % m.len();
            match i % 3 {
                0 => m[at] ^= 1 << (r % 8),
                1 => m[at] = (r >> 40) as u8,
                _ => {
                    // A prefix field rewritten by someone who knows the checksum.
                    m[at % prefix] = (r >> 40) as u8;
                    v2::seal(&mut m[..prefix]);
                }
            }
            let cpu = crate::codec::decode(&m)
                .ok()
                .filter(|d| d.dtype == dtype && d.numel == numel)
                .map(|d| d.data);
            let (back, status) = kernel_decode_with(&lib, dtype, numel, &m, Grid::OneWarp);
            match cpu {
                Some(d) => {
                    assert_eq!(
                        status,
                        0,
                        "{dtype} mutation {i}: {}",
                        status_message(status)
                    );
                    assert!(
                        back == d,
                        "{dtype} mutation {i}: other bytes than the CPU's"
                    );
                    accepted += 1;
                }
                None => {
                    assert_ne!(
                        status, 0,
                        "{dtype} mutation {i}: the CPU decoder refuses it"
                    );
                    rejected += 1;
                }
            }
        }
    }
    assert!(
        accepted > 0 && rejected > 0,
        "{accepted} accepted, {rejected} rejected"
    );
}

#[test]
fn kernel_decoder_rejects_or_survives_every_bit_flip() {
    let lib = library();
    let data = generate(DataKind::Gelu, CodecDType::BF16, 700, 3);
    let opts = EncodeOptions {
        chunk_elems: 256,
        prob_bits: 12,
        threads: 1,
    };
    let enc = encode(CodecDType::BF16, &data, &opts).unwrap();
    for bit in 0..enc.len() * 8 {
        let mut m = enc.clone();
        m[bit / 8] ^= 1 << (bit % 8);
        let (back, status) = kernel_decode_with(&lib, CodecDType::BF16, 700, &m, Grid::OneWarp);
        assert!(
            status != 0 || back == data,
            "flip of bit {bit} silently changed the data"
        );
    }
    for len in 0..enc.len() {
        assert_ne!(
            kernel_decode_with(&lib, CodecDType::BF16, 700, &enc[..len], Grid::OneWarp).1,
            0,
            "truncated to {len}"
        );
    }
    assert_eq!(
        kernel_decode_with(&lib, CodecDType::BF16, 701, &enc, Grid::OneWarp).1,
        9
    );
}
