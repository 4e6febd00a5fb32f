//! Unit tests of [`super`]: the vector coders, histogram, checksum and mantissa packing against
//! the scalar ones, corrupt streams, and the frequency normalisation.

use super::*;

#[test]
fn simd_and_scalar_block_coders_write_the_same_words_and_states() {
    // Skewed symbols (frequent emits) and a frequency-M lone symbol (never emits).
    let mut r = crate::data::SplitMix64::new(5);
    let syms: Vec<u16> = (0..32 * 70)
        .map(|_| (r.next_u64() % 7 + (r.next_u64() % 3) * 60) as u16)
        .collect();
    let mut counts = [0u64; 512];
    syms.iter().for_each(|&s| counts[s as usize] += 1);
    for (syms, counts) in [
        (syms, counts.to_vec()),
        (vec![9u16; 320], {
            let mut c = vec![0u64; 512];
            c[9] = 320;
            c
        }),
    ] {
        let enc = rans::enc_table(&normalize(&counts, 12), 12);
        let run = |simd_first: bool| {
            let mut words = vec![0u16; syms.len() + 8];
            let (mut pos, mut x) = (0usize, [RANS_L; LANES]);
            if !(simd_first && simd::encode_groups32(&syms, &enc, &mut words, &mut pos, &mut x)) {
                rans::put_lanes(&syms, &enc, &mut words, &mut pos, &mut x);
            }
            words.truncate(pos);
            (words, x)
        };
        assert_eq!(run(true), run(false));
    }
}

/// Bf16 and f16 bit patterns at the edges: zeros, denormals, the smallest and largest
/// normals, infinities, NaNs (quiet, signalling, negative).
const EDGES16: [u16; 14] = [
    0x0000, 0x8000, 0x0001, 0x807f, 0x0080, 0x7f7f, 0xff7f, 0x7f80, 0xff80, 0x7fc0, 0xffc1, 0x7f81,
    0x03ff, 0x7c00,
];

/// `n` two-byte elements cycling through [`EDGES16`].
fn edges16(n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| EDGES16[i % EDGES16.len()].to_le_bytes())
        .collect()
}

/// Random two-byte elements with runs of one value and the edge patterns mixed in.
fn mixed16(n: usize, seed: u64) -> Vec<u8> {
    let mut r = crate::data::SplitMix64::new(seed);
    let mut run = 0u16;
    (0..n)
        .flat_map(|i| {
            let v = match r.next_u64() % 4 {
                0 => EDGES16[i % EDGES16.len()],
                1 => run,
                _ => r.next_u64() as u16,
            };
            run = v;
            v.to_le_bytes()
        })
        .collect()
}

#[test]
fn two_byte_histogram_counts_every_element_once() {
    fn check<E: Elem>(src: &[u8]) {
        let mut want = [0u64; 512];
        for e in src.chunks_exact(E::BYTES) {
            want[E::symbol(E::load(e)) & 511] += 1;
        }
        // Counts add to what is there already, as the encoder's pieces do.
        let mut got = [0u64; 512];
        got[3] = 5;
        histogram::<E>(src, &mut got);
        got[3] -= 5;
        assert_eq!(got, want, "{} bytes of {:?}", src.len(), E::DTYPE);
    }
    for n in [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 4097] {
        let src = mixed16(n, n as u64);
        check::<super::super::split::BF16>(&src);
        check::<super::super::split::F16>(&src);
    }
    // One value across more than a 16-bit counter part (8 * 65535 elements), and every
    // pattern of the edges repeated past it: no counter wraps.
    for v in [0x3f80u16, 0xffc1] {
        let src = v.to_le_bytes().repeat(2 * 8 * 0xffff + 37);
        check::<super::super::split::BF16>(&src);
        check::<super::super::split::F16>(&src);
    }
    let src = mixed16(3 * 8 * 0xffff + 5, 9);
    check::<super::super::split::BF16>(&src);
    check::<super::super::split::F16>(&src);
}

#[test]
fn vector_and_scalar_coders_agree_on_edge_values_and_every_tail() {
    use super::super::split::{BF16, F16};
    fn check<E: Elem>(src: &[u8]) {
        let n = src.len() / E::BYTES;
        let mut syms = vec![0u16; n];
        symbols_of::<E>(src, &mut syms);
        let mut counts = [0u64; 512];
        histogram::<E>(src, &mut counts);
        for pb in [9, 12, 14] {
            let enc = rans::enc_table(&normalize(&counts[..E::ALPHABET], pb), pb);
            let mut a = vec![0u16; n + 8];
            let (na, xa) = encode_symbols(&syms, &enc, &mut a);
            let mut b = vec![0u16; n + 8];
            let (mut nb, mut xb) = (0usize, [RANS_L; LANES]);
            rans::put_lanes(&syms, &enc, &mut b, &mut nb, &mut xb);
            assert_eq!((&a[..na], xa), (&b[..nb], xb), "{n} elements, {pb} bits");
        }
    }
    for n in [
        1,
        2,
        31,
        32,
        33,
        63,
        95,
        127,
        128,
        129,
        200,
        1000,
        4096 + 17,
    ] {
        let src = mixed16(n, 77 + n as u64);
        check::<BF16>(&src);
        check::<F16>(&src);
        let edges = edges16(n);
        check::<BF16>(&edges);
        check::<F16>(&edges);
    }
}

#[test]
fn streams_with_a_word_too_few_or_too_many_are_corrupt() {
    use crate::codec::{decode_into, encode_into, DecodeOptions, EncodeOptions};
    use crate::data::{generate, DataKind};
    let dtype = CodecDType::BF16;
    let opts = EncodeOptions {
        chunk_elems: 4096,
        threads: 1,
        ..Default::default()
    };
    // One coded block each: realistic data (the vector decoder runs out of words at its
    // very end) and a lone symbol (no words at all: the vector decoder runs with none).
    for data in [
        generate(DataKind::Gaussian, dtype, 4096, 3),
        [0x3f80u16.to_le_bytes(), 0x3f81u16.to_le_bytes()]
            .concat()
            .repeat(2048),
    ] {
        let mut coded = Vec::new();
        encode_into(dtype, &data, &opts, &mut coded).unwrap();
        let p = parse(&coded).unwrap();
        let (at, len) = (p.offsets[0], p.lens[0]);
        assert!(len < data.len(), "the block is coded");
        let mut back = vec![0u8; data.len()];
        decode_into(&coded, &mut back, &DecodeOptions::default()).unwrap();
        assert_eq!(back, data);
        // Without the first word (the last one read), or with one word more.
        let words_at = at + mantissa_len(4096, 7);
        let mut bad = coded.clone();
        let new_len = if len > mantissa_len(4096, 7) + STATES_LEN {
            bad.drain(words_at..words_at + 2);
            len - 2
        } else {
            bad.splice(words_at..words_at, [0x55u8; 2]);
            len + 2
        };
        bad[at - 4..at].copy_from_slice(&(new_len as u32).to_le_bytes());
        let total = (p.header.payload_len + new_len - len) as u64;
        bad[24..32].copy_from_slice(&total.to_le_bytes());
        seal(&mut bad[..at]);
        assert!(matches!(
            decode_into(&bad, &mut back, &DecodeOptions::default()),
            Err(CompressError::Corrupt { .. })
        ));
    }
}

#[test]
fn vector_checksum_terms_equal_the_scalar_ones() {
    let data: Vec<u8> = (0..1000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for len in [0, 7, 31, 32, 33, 64, 100, 999, 1000] {
        for first in [0u64, 5, u64::MAX - 3] {
            assert_eq!(
                simd::checksum_terms(&data[..len], first),
                checksum_terms(&data[..len], first),
                "{len} bytes from word {first}"
            );
        }
    }
}

#[test]
fn vector_mantissa_packing_writes_the_scalar_bytes() {
    fn check<E: Elem>() {
        let src: Vec<u8> = (0..16 * 9 * E::BYTES as u32 + 6)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        let n = src.len() / E::BYTES;
        let mlen = mantissa_len(n, E::MANT_BITS);
        let mut want = vec![0u8; mlen];
        pack_mantissas::<E>(&src[..n * E::BYTES], &mut want);
        // Room for the wide stores past the mantissas, as in a coded block.
        let mut got = vec![0xaau8; mlen + 16];
        let done = simd::pack_mantissas16::<E>(&src[..n * E::BYTES], &mut got);
        let w = E::MANT_BITS as usize;
        pack_mantissas::<E>(
            &src[done * E::BYTES..n * E::BYTES],
            &mut got[done / 8 * w..mlen],
        );
        assert_eq!(got[..mlen], want[..]);
    }
    check::<super::super::split::BF16>();
    check::<super::super::split::F16>();
    check::<super::super::split::F32>();
}

#[test]
fn normalisation_sums_exactly_keeps_every_symbol_and_is_near_the_entropy() {
    let counts: Vec<u64> = (0..512u64)
        .map(|s| if s % 3 == 0 { 0 } else { (s * 7919) % 1000 + 1 })
        .collect();
    for pb in PROB_BITS_RANGE {
        let f = normalize(&counts, pb);
        assert_eq!(f.iter().sum::<u32>(), 1 << pb);
        assert!(counts.iter().zip(&f).all(|(&c, &f)| (c > 0) == (f > 0)));
    }
    // A skewed distribution: the coded size stays within 0.5% of the entropy at 12 bits.
    let counts: Vec<u64> = (0..40u64).map(|s| 1_000_000 >> (s / 2).min(19)).collect();
    let f = normalize(&counts, 12);
    let c32: Vec<u32> = counts.iter().map(|&c| c as u32).collect();
    let coded = rans::coded_bits(&c32, &f, 12);
    assert!(coded < rans::entropy_bits(&c32) * 1.005, "{coded}");
    assert_eq!(normalize(&[0, 5, 0], 9), vec![0, 512, 0]);
    assert_eq!(normalize(&[0, 0], 9), vec![0, 0]);
}

#[test]
fn vector_sign_ranges_equal_the_scalar_ones() {
    use super::super::split::{BF16, F16, F32};
    fn check<E: Elem>(src: &[u8]) {
        let mut want = SignRanges::EMPTY;
        sign_ranges_scalar::<E>(src, &mut want);
        let mut got = SignRanges::EMPTY;
        simd::sign_ranges::<E>(src, &mut got);
        assert_eq!(got, want, "{} bytes of {:?}", src.len(), E::DTYPE);
    }
    let mut r = crate::data::SplitMix64::new(13);
    for n in [0, 1, 15, 16, 17, 33, 64, 100, 1000] {
        let src = mixed16(n, n as u64);
        check::<BF16>(&src);
        check::<F16>(&src);
        let edges = edges16(n);
        check::<BF16>(&edges);
        check::<F16>(&edges);
        // One sign only, either one.
        for sign in [0u16, 0x8000] {
            let one: Vec<u8> = (0..n)
                .flat_map(|_| (r.next_u64() as u16 & 0x7fff | sign).to_le_bytes())
                .collect();
            check::<BF16>(&one);
            check::<F16>(&one);
        }
        let wide: Vec<u8> = (0..n)
            .flat_map(|i| {
                let v = r.next_u64() as u32;
                [
                    v,
                    f32::INFINITY.to_bits(),
                    0x8000_0000,
                    1,
                    f32::NAN.to_bits() | 1 << 31,
                ][i % 5]
                    .to_le_bytes()
            })
            .collect();
        check::<F32>(&wide);
    }
}

#[test]
fn the_sample_is_the_first_run_of_every_period() {
    for (first, n) in [
        (0, 0),
        (0, 5000),
        (100, 1),
        (63, 2),
        (64, 448),
        (511, 2),
        (1000, 3000),
    ] {
        let want: Vec<usize> = (0..n)
            .filter(|i| (first + i) % SAMPLE_PERIOD < SAMPLE_RUN)
            .collect();
        let got: Vec<usize> = counts::sample_runs(first, n).flatten().collect();
        assert_eq!(got, want, "first {first}, {n} elements");
    }
}

/// From `SAMPLE_FROM` elements on, the table comes from the sample and the sign ranges: the
/// same bytes whatever the threads (the sample is fixed by element index), a symbol only
/// outside the sample still coded, and the ratio within a fraction of a percent of exact
/// counts' on activations.
#[test]
fn sampled_tables_code_every_symbol_the_same_on_any_threads() {
    use super::super::split::BF16;
    let n = SAMPLE_FROM + 1000;
    let mut data = crate::data::generate(crate::data::DataKind::Gelu, CodecDType::BF16, n, 3);
    // Both infinities at unsampled elements: only the edge flags know them.
    data[2 * 100..2 * 101].copy_from_slice(&0x7f80u16.to_le_bytes());
    data[2 * 777..2 * 778].copy_from_slice(&0xff80u16.to_le_bytes());
    let mut encodings = Vec::new();
    for threads in [1, 2, 3] {
        let mut out = Vec::new();
        encode_into(
            CodecDType::BF16,
            &data,
            12,
            DEFAULT_BLOCK_ELEMS,
            threads,
            &mut out,
        )
        .unwrap();
        encodings.push(out);
    }
    assert!(
        encodings.iter().all(|e| *e == encodings[0]),
        "threads change the bytes"
    );
    let mut back = vec![0u8; data.len()];
    let p = parse(&encodings[0]).unwrap();
    decode_into(&encodings[0], &p, &mut back, 1, true).unwrap();
    assert!(back == data);
    // Against the table of exact counts.
    let mut exact = [0u64; 512];
    histogram::<BF16>(&data, &mut exact);
    let bits = |freq: &[u32]| -> f64 {
        exact
            .iter()
            .zip(freq)
            .filter(|(c, _)| **c > 0)
            .map(|(&c, &f)| c as f64 * (4096.0 / f as f64).log2())
            .sum()
    };
    let sampled_freq: Vec<u32> = {
        let present = present_in(&encodings[0][HEADER_LEN..HEADER_LEN + 64]);
        let mut f = vec![0u32; 512];
        let bitmap = &encodings[0][HEADER_LEN..HEADER_LEN + 64];
        let mut at = HEADER_LEN + 64;
        for (s, slot) in f.iter_mut().enumerate() {
            if bitmap[s / 8] >> (s % 8) & 1 == 1 {
                *slot = u16::from_le_bytes([encodings[0][at], encodings[0][at + 1]]) as u32;
                at += 2;
            }
        }
        assert_eq!(at, HEADER_LEN + 64 + 2 * present);
        f
    };
    let loss = bits(&sampled_freq) / bits(&normalize(&exact, 12)) - 1.0;
    assert!(
        loss < 0.005,
        "sampled table codes {:.3}% more bits",
        loss * 100.0
    );
}
