//! Time-bounded mutation fuzzing of the decoder (`HP_FUZZ_SECS`, default 5 s; `HP_FUZZ_SEED`;
//! `HP_FUZZ_RUNS` stops after that many decodes instead): valid encodings are bit-flipped,
//! truncated, spliced, overwritten, replaced by random bytes, have header and table fields
//! rewritten and the prefix checksum resealed (so the mutation reaches the checks behind it),
//! or become decoded-size bombs (constant chunks declaring up to 2^40 elements). Decoding, with
//! an output limit and with or without chunk checksums, must return Ok or a typed error, never
//! panic, and the process's peak resident memory must stay within FORMAT.md's bound.

use std::time::{Duration, Instant};

use hprt_compress::codec::{
    decode, decode_with, encode, encode_v1, inspect, v2, DecodeOptions, EncodeOptions,
};
use hprt_compress::data::{generate, DataKind, SplitMix64};
use hprt_compress::format::{
    constant_encoding, seal, CHUNK_ENTRY_LEN, HEADER_LEN, MAX_CHUNK_ELEMS,
};
use hprt_compress::{CodecDType, CompressError};

/// The output limit the fuzzer decodes with.
const LIMIT: usize = 8 << 20;

fn corpus() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for dtype in CodecDType::ALL {
        for kind in DataKind::ALL {
            for (n, chunk_elems) in [(3000, 512), (333, 64)] {
                let data = generate(kind, dtype, n, 1);
                let opts = EncodeOptions {
                    chunk_elems,
                    prob_bits: 11,
                    threads: 1,
                };
                out.push(encode(dtype, &data, &opts).unwrap());
                out.push(encode_v1(dtype, &data, &opts).unwrap());
            }
        }
    }
    out
}

fn is_v2(v: &[u8]) -> bool {
    v.get(4..6) == Some(&v2::VERSION.to_le_bytes()[..])
}

/// Header + table (+ index, v2) length the (possibly edited) header of `v` declares, if it
/// fits `v`.
fn prefix_len(v: &[u8]) -> Option<usize> {
    if is_v2(v) {
        let dtype = CodecDType::from_code(*v.get(6)?)?;
        let block = u32::from_le_bytes(v.get(12..16)?.try_into().ok()?) as u64;
        let numel = u64::from_le_bytes(v.get(16..24)?.try_into().ok()?);
        let blocks = numel.checked_div(block)? + u64::from(numel % block != 0);
        let bitmap = v.get(v2::HEADER_LEN..v2::HEADER_LEN + v2::bitmap_len(dtype))?;
        let len = v2::prefix_len(dtype, v2::present_in(bitmap), usize::try_from(blocks).ok()?)?;
        return (len <= v.len()).then_some(len);
    }
    let chunk_elems = u32::from_le_bytes(v.get(12..16)?.try_into().ok()?) as u64;
    let numel = u64::from_le_bytes(v.get(16..24)?.try_into().ok()?);
    let chunks = numel.checked_div(chunk_elems)? + u64::from(numel % chunk_elems != 0);
    let len = (HEADER_LEN as u64).checked_add(chunks.checked_mul(CHUNK_ENTRY_LEN as u64)?)?;
    (len <= v.len() as u64).then_some(len as usize)
}

/// Recomputes the prefix checksum after an edit, when the header still describes a table that
/// fits.
fn reseal(v: &mut [u8]) {
    if let Some(p) = prefix_len(v) {
        if is_v2(v) {
            v2::seal(&mut v[..p]);
        } else {
            seal(&mut v[..p]);
        }
    }
}

fn mutate(rng: &mut SplitMix64, base: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    let pick = |rng: &mut SplitMix64, n: usize| (rng.next_u64() as usize) % n.max(1);
    for _ in 0..1 + pick(rng, 4) {
        match pick(rng, 10) {
            0 if !v.is_empty() => {
                let i = pick(rng, v.len());
                v[i] ^= 1 << pick(rng, 8);
            }
            1 => v.truncate(pick(rng, v.len() + 1)),
            2 if !other.is_empty() => {
                let cut = pick(rng, v.len() + 1);
                let from = pick(rng, other.len());
                v.truncate(cut);
                v.extend_from_slice(&other[from..]);
            }
            3 if !v.is_empty() => {
                let i = pick(rng, v.len());
                let n = pick(rng, 16).min(v.len() - i);
                for b in &mut v[i..i + n] {
                    *b = rng.next_u64() as u8;
                }
            }
            4 => {
                let n = pick(rng, 300);
                v = (0..n).map(|_| rng.next_u64() as u8).collect();
                if rng.next_u64() % 2 == 0 && v.len() >= 4 {
                    v[..4].copy_from_slice(b"HPRZ");
                }
            }
            // A header field rewritten, the prefix resealed.
            5 if v.len() >= HEADER_LEN => {
                match pick(rng, 5) {
                    0 => v[6] = pick(rng, 5) as u8,
                    1 => v[8] = pick(rng, 16) as u8,
                    2 => {
                        let c = [8, 16, 64, 512, MAX_CHUNK_ELEMS, pick(rng, 1 << 25)][pick(rng, 6)];
                        v[12..16].copy_from_slice(&(c as u32).to_le_bytes());
                    }
                    3 => {
                        let n = match pick(rng, 3) {
                            0 => rng.next_u64(),
                            1 => rng.next_u64() % 5000,
                            _ => 1 << pick(rng, 64),
                        };
                        v[16..24].copy_from_slice(&n.to_le_bytes());
                    }
                    _ => {
                        let p = rng.next_u64() % (v.len() as u64 + 64);
                        v[24..32].copy_from_slice(&p.to_le_bytes());
                    }
                }
                reseal(&mut v);
            }
            // v2: a table byte (bitmap or frequency) or a block length rewritten, the prefix
            // resealed.
            6 if is_v2(&v) => {
                if let Some(p) = prefix_len(&v).filter(|&p| p > v2::HEADER_LEN) {
                    if pick(rng, 2) == 0 {
                        let e = v2::HEADER_LEN + pick(rng, p - v2::HEADER_LEN);
                        match pick(rng, 3) {
                            0 => v[e] = v[e].wrapping_add(1),
                            1 => v[e] = v[e].wrapping_sub(1),
                            _ => v[e] ^= 1 << pick(rng, 8),
                        }
                    } else if p >= v2::HEADER_LEN + 4 {
                        // An index entry (the index ends the prefix).
                        let e = p - 4 * (1 + pick(rng, (p - v2::HEADER_LEN) / 4));
                        let len = u32::from_le_bytes(v[e..e + 4].try_into().unwrap());
                        let len = len.wrapping_add(pick(rng, 9) as u32).wrapping_sub(4);
                        v[e..e + 4].copy_from_slice(&len.to_le_bytes());
                    }
                    reseal(&mut v);
                }
            }
            // A chunk-table entry rewritten, the prefix resealed.
            6 => {
                if let Some(p) = prefix_len(&v).filter(|&p| p > HEADER_LEN) {
                    let chunks = (p - HEADER_LEN) / CHUNK_ENTRY_LEN;
                    let e = HEADER_LEN + pick(rng, chunks) * CHUNK_ENTRY_LEN;
                    match pick(rng, 3) {
                        0 => v[e + 4] = pick(rng, 5) as u8,
                        1 => {
                            let len = u32::from_le_bytes(v[e..e + 4].try_into().unwrap());
                            let len = len.wrapping_add(pick(rng, 9) as u32).wrapping_sub(4);
                            v[e..e + 4].copy_from_slice(&len.to_le_bytes());
                        }
                        _ => v[e + 8 + pick(rng, 8)] ^= 1 << pick(rng, 8),
                    }
                    reseal(&mut v);
                }
            }
            // A payload byte changed and the prefix resealed (reaches the coder itself when
            // chunk checksums are off).
            7 if v.len() > v2::HEADER_LEN => {
                let i = HEADER_LEN + pick(rng, v.len() - HEADER_LEN);
                v[i] = rng.next_u64() as u8;
                reseal(&mut v);
            }
            // A decoded-size bomb: constant chunks declaring far more than the limit, or a
            // header claiming up to 2^40 elements over a small table.
            8 => {
                let dtype = CodecDType::ALL[pick(rng, 3)];
                if rng.next_u64() % 2 == 0 {
                    // Up to 4096 chunks: declared sizes from 1 KiB to 256 GiB.
                    let chunk_elems = [1 << 10, 1 << 16, MAX_CHUNK_ELEMS][pick(rng, 3)];
                    let numel = 1 + rng.next_u64() % (chunk_elems as u64 * 4096);
                    let valid = numel * (dtype.size() as u64) <= LIMIT as u64;
                    v = constant_encoding(dtype, chunk_elems, numel as usize, valid);
                } else if v.len() >= HEADER_LEN {
                    let numel = 1u64 << (20 + pick(rng, 21));
                    v[16..24].copy_from_slice(&numel.to_le_bytes());
                    reseal(&mut v);
                }
            }
            _ => {
                let i = pick(rng, v.len() + 1);
                v.insert(i, rng.next_u64() as u8);
            }
        }
    }
    v
}

/// The process's peak and current resident set in bytes (Linux), for the memory bound.
fn rss() -> Option<(usize, usize)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<usize> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

#[test]
fn mutated_encodings_never_panic_the_decoder() {
    let secs: f64 = env("HP_FUZZ_SECS").unwrap_or(5.0);
    let max_runs: u64 = env("HP_FUZZ_RUNS").unwrap_or(u64::MAX);
    let corpus = corpus();
    let mut rng = SplitMix64::new(env("HP_FUZZ_SEED").unwrap_or(7));
    let start_rss = rss().map(|(_, now)| now);
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(secs);
    let (mut runs, mut rejected, mut changed, mut limited) = (0u64, 0u64, 0u64, 0u64);
    while runs < max_runs && (max_runs != u64::MAX || Instant::now() < deadline) {
        let base = &corpus[(rng.next_u64() as usize) % corpus.len()];
        let other = &corpus[(rng.next_u64() as usize) % corpus.len()];
        let m = mutate(&mut rng, base, other);
        let opts = DecodeOptions {
            threads: 1 + (rng.next_u64() % 2) as usize,
            verify: rng.next_u64() % 4 != 0,
            max_output: Some(LIMIT),
        };
        let r = std::panic::catch_unwind(|| decode_with(&m, &opts));
        let r = r.unwrap_or_else(|_| {
            panic!(
                "decoder panicked on {} bytes: {:02x?}",
                m.len(),
                &m[..m.len().min(64)]
            )
        });
        runs += 1;
        match r {
            Err(CompressError::Corrupt { .. } | CompressError::UnsupportedFormat(_)) => {
                rejected += 1
            }
            Err(CompressError::OutputTooLarge { declared, limit }) => {
                assert!(declared > limit && limit == LIMIT);
                limited += 1;
            }
            Err(e) => panic!("unexpected error kind: {e}"),
            Ok(d) => {
                assert!(d.data.len() <= LIMIT);
                if opts.verify && d != decode(base).unwrap() {
                    changed += 1;
                }
            }
        }
    }
    let rate = runs as f64 / started.elapsed().as_secs_f64();
    eprintln!(
        "fuzz: {runs} mutated inputs ({rate:.0}/s), {rejected} rejected, {limited} over the \
         {LIMIT}-byte output limit, {changed} accepted with other contents"
    );
    assert!(runs > 100, "too few runs to mean anything");
    assert!(rejected > runs / 2);
    assert!(limited > 0, "no decoded-size bomb reached the limit check");
    // FORMAT.md's bound: the output (at most the limit) per decoding thread's range plus
    // scratch; the inputs here are a few KiB. 16 MiB of slack covers allocator and test harness.
    if let (Some(before), Some((peak, _))) = (start_rss, rss()) {
        let grown = peak.saturating_sub(before);
        eprintln!("fuzz: peak RSS {peak} bytes, {grown} above the start");
        assert!(
            grown <= LIMIT + (16 << 20),
            "peak resident memory grew by {grown} bytes, above the {LIMIT}-byte limit + slack"
        );
    }
}

#[test]
fn decoded_size_bombs_are_refused_before_allocating() {
    // 400 constant f32 chunks of 2^24 elements: 8,040 bytes declaring 25 GiB (issue 20).
    let bomb = constant_encoding(CodecDType::F32, MAX_CHUNK_ELEMS, 400 << 24, true);
    assert_eq!(bomb.len(), 8040);
    let h = inspect(&bomb).unwrap().header;
    assert_eq!(h.output_len(), 25 << 30);
    assert!(h.output_len() <= bomb.len() * hprt_compress::format::MAX_EXPANSION);
    let limited = DecodeOptions {
        max_output: Some(1 << 30),
        ..Default::default()
    };
    let before = rss();
    match decode_with(&bomb, &limited) {
        Err(CompressError::OutputTooLarge { declared, limit }) => {
            assert_eq!((declared, limit), (25 << 30, 1 << 30))
        }
        other => panic!("{other:?}"),
    }
    if let (Some((_, a)), Some((_, b))) = (before, rss()) {
        assert!(b < a + (1 << 20), "refusing the bomb cost {} bytes", b - a);
    }
    // Under the limit the same kind of file decodes to exactly what it declares.
    let small = constant_encoding(CodecDType::BF16, 1 << 16, (3 << 16) + 5, true);
    let d = decode_with(&small, &limited).unwrap();
    assert_eq!(d.data, vec![0u8; ((3 << 16) + 5) * 2]);
}

#[test]
fn chunk_lengths_are_checked_before_the_output_is_allocated() {
    // A prefix that passes its checksum but whose raw chunks have no payload: refused by
    // `inspect`, i.e. before `decode` allocates the 4 GiB the header declares.
    let mut v = vec![0u8; HEADER_LEN + 256 * CHUNK_ENTRY_LEN];
    v[..4].copy_from_slice(b"HPRZ");
    v[4] = 1;
    v[6] = 3;
    v[7] = 8;
    v[8] = 12;
    v[12..16].copy_from_slice(&(MAX_CHUNK_ELEMS as u32).to_le_bytes());
    v[16..24].copy_from_slice(&(256u64 << 24).to_le_bytes());
    seal(&mut v);
    match inspect(&v) {
        Err(CompressError::Corrupt { what, .. }) => assert!(what.contains("raw chunk"), "{what}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(decode(&v), Err(CompressError::Corrupt { .. })));
}

#[test]
fn non_zero_mantissa_padding_is_rejected() {
    // 813 bf16 elements: 5691 mantissa bits in 712 bytes, so the last byte has 5 padding bits.
    const N: u16 = 813;
    const MANT_BYTES: usize = 712;
    for (values, mode) in [
        (
            (0..N).map(|i| 0x3f80 | (i * 9 % 128)).collect::<Vec<_>>(),
            "single-symbol",
        ),
        (
            (0..N)
                .map(|i| (0x3f80 + (i % 7 / 4) * 0x80) | (i * 9 % 128))
                .collect(),
            "rans",
        ),
    ] {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let enc = encode_v1(CodecDType::BF16, &data, &EncodeOptions::single_threaded()).unwrap();
        let p = inspect(&enc).unwrap();
        assert_eq!(p.chunks[0].mode.name(), mode);
        // The mantissa stream follows the symbol (single-symbol) or the frequency table (rans).
        let mant_end = MANT_BYTES
            + match mode {
                "single-symbol" => p.offsets[0] + 2,
                _ => p.offsets[0] + rans_table_len(&enc[p.offsets[0]..]),
            };
        let mut bad = enc.clone();
        bad[mant_end - 1] ^= 0x80;
        for verify in [true, false] {
            let o = DecodeOptions {
                verify,
                ..Default::default()
            };
            match decode_with(&bad, &o) {
                Err(CompressError::Corrupt { what, .. }) => {
                    assert!(what.contains("padding"), "{mode}: {what}")
                }
                other => panic!("{mode}, verify {verify}: {other:?}"),
            }
        }
        assert_eq!(decode(&enc).unwrap().data, data);
    }
}

/// Bytes of a rANS chunk's frequency table (FORMAT.md: `u16` count, then LEB128 pairs).
fn rans_table_len(payload: &[u8]) -> usize {
    let present = u16::from_le_bytes([payload[0], payload[1]]) as usize;
    let mut at = 2;
    for _ in 0..2 * present {
        while payload[at] & 0x80 != 0 {
            at += 1;
        }
        at += 1;
    }
    at
}

#[test]
fn every_single_bit_flip_of_a_small_encoding_is_caught() {
    let data = generate(DataKind::Gelu, CodecDType::BF16, 700, 3);
    let enc = encode(
        CodecDType::BF16,
        &data,
        &EncodeOptions {
            chunk_elems: 256,
            prob_bits: 12,
            threads: 1,
        },
    )
    .unwrap();
    for bit in 0..enc.len() * 8 {
        let mut m = enc.clone();
        m[bit / 8] ^= 1 << (bit % 8);
        match decode(&m) {
            Err(_) => {}
            Ok(d) => assert_eq!(d.data, data, "flip of bit {bit} silently changed the data"),
        }
    }
    for len in 0..enc.len() {
        assert!(
            decode(&enc[..len]).is_err(),
            "truncation to {len} bytes accepted"
        );
    }
}

#[test]
fn v2_non_zero_mantissa_padding_is_rejected() {
    // 813 bf16 elements in one coded block: the mantissa stream (712 bytes, 5 padding bits)
    // starts the block's payload.
    let data: Vec<u8> = (0..813u16)
        .flat_map(|i| ((0x3f80 + (i % 7 / 4) * 0x80) | (i * 9 % 128)).to_le_bytes())
        .collect();
    let enc = encode(CodecDType::BF16, &data, &EncodeOptions::single_threaded()).unwrap();
    let p = inspect(&enc).unwrap();
    assert_eq!((p.version, p.chunks[0].mode.name()), (2, "rans"));
    let mut bad = enc.clone();
    bad[p.offsets[0] + 711] ^= 0x80;
    for verify in [true, false] {
        let o = DecodeOptions {
            verify,
            ..Default::default()
        };
        match decode_with(&bad, &o) {
            Err(CompressError::Corrupt { what, .. }) => assert!(what.contains("padding"), "{what}"),
            other => panic!("verify {verify}: {other:?}"),
        }
    }
    assert_eq!(decode(&enc).unwrap().data, data);
}

#[test]
fn v2_declares_at_most_max_expansion_and_refuses_inflated_headers_before_allocating() {
    // The densest v2 encoding: one symbol everywhere (only mantissas and states are stored).
    for dtype in CodecDType::ALL {
        let zeros = vec![0u8; (1 << 18) * dtype.size()];
        let enc = encode(dtype, &zeros, &EncodeOptions::single_threaded()).unwrap();
        assert!(
            zeros.len() <= enc.len() * v2::MAX_EXPANSION,
            "{dtype}: {}",
            enc.len()
        );
        assert_eq!(decode(&enc).unwrap().data, zeros);
        // The same file declaring 2^40 elements: its index and lengths no longer fit, so it
        // is refused by the prefix checks, before any output is sized.
        let mut bomb = enc.clone();
        bomb[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
        reseal(&mut bomb);
        let before = rss();
        assert!(matches!(decode(&bomb), Err(CompressError::Corrupt { .. })));
        if let (Some((_, a)), Some((_, b))) = (before, rss()) {
            assert!(b < a + (1 << 20), "refusing the bomb cost {} bytes", b - a);
        }
    }
}
