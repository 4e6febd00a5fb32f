//! Bit-exact round trips: arbitrary bit patterns (proptest), every special value, realistic
//! data, every chunking and thread count; and the worst-case size bound always holds.

use hprt_compress::codec::{
    decode, decode_with, encode, inspect, max_encoded_len, DecodeOptions, EncodeOptions,
};
use hprt_compress::data::{generate, DataKind};
use hprt_compress::format::ChunkMode;
use hprt_compress::CodecDType;
use proptest::prelude::*;

fn check(dtype: CodecDType, data: &[u8], opts: &EncodeOptions) {
    let enc = encode(dtype, data, opts).expect("encode");
    let numel = data.len() / dtype.size();
    assert!(
        enc.len() <= max_encoded_len(dtype, numel, opts),
        "bound exceeded"
    );
    let d = decode(&enc).expect("decode");
    assert_eq!((d.dtype, d.numel), (dtype, numel));
    assert!(d.data == data, "{dtype}: decoded bytes differ");
    let single = decode_with(&enc, &DecodeOptions::single_threaded()).expect("decode 1 thread");
    assert!(single.data == data);
}

fn dtype_strategy() -> impl Strategy<Value = CodecDType> {
    prop_oneof![
        Just(CodecDType::F32),
        Just(CodecDType::F16),
        Just(CodecDType::BF16)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn arbitrary_bit_patterns_round_trip(
        dtype in dtype_strategy(),
        words in proptest::collection::vec(any::<u32>(), 0..3000),
        chunk_groups in 1usize..40,
        threads in 1usize..4,
    ) {
        let mut data: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        data.truncate(data.len() / dtype.size() * dtype.size());
        let opts = EncodeOptions { chunk_elems: chunk_groups * 32, prob_bits: 12, threads };
        check(dtype, &data, &opts);
    }

    /// Few distinct bit patterns (what real tensors look like to the coder), any resolution.
    #[test]
    fn skewed_patterns_round_trip(
        dtype in dtype_strategy(),
        palette in proptest::collection::vec(any::<u32>(), 1..6),
        picks in proptest::collection::vec(any::<u8>(), 1..5000),
        prob_bits in 9u32..=14,
    ) {
        let data: Vec<u8> = picks
            .iter()
            .flat_map(|&i| {
                let w = palette[i as usize % palette.len()].to_le_bytes();
                w[..dtype.size()].to_vec()
            })
            .collect();
        let opts = EncodeOptions { chunk_elems: 1024, prob_bits, threads: 2 };
        check(dtype, &data, &opts);
    }
}

fn specials(dtype: CodecDType) -> Vec<u32> {
    match dtype {
        CodecDType::F32 => vec![
            0,
            0x8000_0000,
            1,
            0x8000_0001,
            0x007f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            0xffff_ffff,
            0x7fbf_ffff,
            0x3f80_0000,
            0x0080_0000,
        ],
        CodecDType::F16 | CodecDType::BF16 => vec![
            0, 0x8000, 1, 0x8001, 0x03ff, 0x007f, 0x7c00, 0xfc00, 0x7f80, 0xff80, 0x7fc1, 0x7e01,
            0xffff, 0x7fff, 0x3c00, 0x3f80,
        ],
    }
}

#[test]
fn nan_payloads_zeros_subnormals_and_infinities_survive_in_every_mode() {
    for dtype in CodecDType::ALL {
        let sp = specials(dtype);
        // Mostly one value (coded), with every special sprinkled in; and only specials.
        let mostly: Vec<u32> = (0..5000)
            .map(|i| if i % 7 == 0 { sp[i % sp.len()] } else { sp[12] })
            .collect();
        for values in [mostly, sp.repeat(50)] {
            let data: Vec<u8> = values
                .iter()
                .flat_map(|v| v.to_le_bytes()[..dtype.size()].to_vec())
                .collect();
            check(
                dtype,
                &data,
                &EncodeOptions {
                    chunk_elems: 256,
                    prob_bits: 12,
                    threads: 1,
                },
            );
        }
    }
}

#[test]
fn realistic_and_adversarial_data_round_trip_and_compress_as_expected() {
    for dtype in CodecDType::ALL {
        for kind in DataKind::ALL {
            let data = generate(kind, dtype, 40_000, 5);
            let opts = EncodeOptions {
                chunk_elems: 8192,
                prob_bits: 12,
                threads: 2,
            };
            check(dtype, &data, &opts);
            let enc = encode(dtype, &data, &opts).unwrap();
            let modes: Vec<ChunkMode> = inspect(&enc)
                .unwrap()
                .chunks
                .iter()
                .map(|c| c.mode)
                .collect();
            match kind {
                DataKind::RandomBits => {
                    assert!(
                        modes.iter().all(|m| *m == ChunkMode::Raw),
                        "{dtype}: {modes:?}"
                    );
                }
                // Version 2 has no constant mode: one symbol at the whole of M costs nothing,
                // the mantissas are stored.
                DataKind::Constant => {
                    assert!(modes.iter().all(|m| *m == ChunkMode::Rans));
                    let mant = data.len() / dtype.size() * dtype.mantissa_bits() as usize / 8;
                    assert!(enc.len() < mant + mant / 20, "{dtype}: {}", enc.len());
                }
                _ => {
                    assert!(
                        modes.iter().all(|m| *m == ChunkMode::Rans),
                        "{dtype} {kind:?}: {modes:?}"
                    );
                    assert!(
                        enc.len() * 100 < data.len() * 95,
                        "{dtype} {kind:?} barely compressed"
                    );
                }
            }
        }
    }
}

#[test]
fn coded_size_stays_within_one_percent_of_the_symbol_entropy() {
    use hprt_compress::codec::chunk_symbols;
    // Header, table, index and final states included, on 1 Mi-element tensors (the fixed
    // 48-byte header and up to 1 KiB table are 0.4% of a quarter of that).
    for dtype in CodecDType::ALL {
        for kind in [
            DataKind::Gaussian,
            DataKind::Gelu,
            DataKind::Softmax,
            DataKind::LayerNorm,
            DataKind::Weights,
        ] {
            let n = 1 << 20;
            let data = generate(kind, dtype, n, 11);
            let opts = EncodeOptions {
                threads: 2,
                ..Default::default()
            };
            let enc = encode(dtype, &data, &opts).unwrap();
            // Version 2 codes the tensor with one table: the bound is the tensor's entropy.
            let symbols = chunk_symbols(dtype, &data, n);
            let entropy = symbols.iter().map(|c| c.entropy_bits).sum::<f64>() / 8.0;
            let mant = (n * dtype.mantissa_bits() as usize).div_ceil(8) as f64;
            let overhead = (enc.len() as f64 - mant) / entropy - 1.0;
            eprintln!(
                "{dtype} {kind:?}: {:.3}% over the entropy",
                overhead * 100.0
            );
            assert!(
                overhead < 0.01,
                "{dtype} {kind:?}: {:.3}% over the entropy",
                overhead * 100.0
            );
        }
    }
}
