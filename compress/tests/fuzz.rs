//! Time-bounded mutation fuzzing of the decoder (`HP_FUZZ_SECS`, default 5 s): valid encodings
//! are bit-flipped, truncated, spliced, overwritten and replaced by random bytes; decoding must
//! return Ok or a typed error, never panic. Corruption the checksums can see must be reported.

use std::time::{Duration, Instant};

use hprt_compress::codec::{decode, encode, EncodeOptions};
use hprt_compress::data::{generate, DataKind, SplitMix64};
use hprt_compress::{CodecDType, CompressError};

fn corpus() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for dtype in CodecDType::ALL {
        for kind in DataKind::ALL {
            let data = generate(kind, dtype, 3000, 1);
            let opts = EncodeOptions {
                chunk_elems: 512,
                prob_bits: 11,
                threads: 1,
            };
            out.push(encode(dtype, &data, &opts).unwrap());
        }
    }
    out
}

fn mutate(rng: &mut SplitMix64, base: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    let pick = |rng: &mut SplitMix64, n: usize| (rng.next_u64() as usize) % n.max(1);
    for _ in 0..1 + pick(rng, 4) {
        match pick(rng, 6) {
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
            _ => {
                let i = pick(rng, v.len() + 1);
                v.insert(i, rng.next_u64() as u8);
            }
        }
    }
    v
}

#[test]
fn mutated_encodings_never_panic_the_decoder() {
    let secs = std::env::var("HP_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let corpus = corpus();
    let mut rng = SplitMix64::new(
        std::env::var("HP_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(7),
    );
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let (mut runs, mut rejected, mut changed) = (0u64, 0u64, 0u64);
    while Instant::now() < deadline {
        let base = &corpus[(rng.next_u64() as usize) % corpus.len()];
        let other = &corpus[(rng.next_u64() as usize) % corpus.len()];
        let m = mutate(&mut rng, base, other);
        let r = std::panic::catch_unwind(|| decode(&m));
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
            Err(e) => panic!("unexpected error kind: {e}"),
            Ok(d) => {
                // Accepted: then it must be what some valid encoding of that header decodes to,
                // i.e. the checksums matched; the mutation did not change the decoded bytes.
                let orig = decode(base).unwrap();
                if d != orig {
                    changed += 1;
                }
            }
        }
    }
    eprintln!(
        "fuzz: {runs} mutated inputs, {rejected} rejected, {changed} accepted with other contents"
    );
    assert!(runs > 100, "too few runs to mean anything");
    assert!(rejected > runs / 2);
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
