//! Arbitrary element bytes of every dtype and small chunk sizes must round-trip bit-exactly.
#![no_main]

use hprt_compress::codec::{decode, encode, EncodeOptions};
use hprt_compress::CodecDType;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let dtype = CodecDType::ALL[sel as usize % 3];
    let rest = &rest[..rest.len() / dtype.size() * dtype.size()];
    let opts = EncodeOptions {
        chunk_elems: 8 * (1 + (sel as usize >> 2) % 32),
        prob_bits: 12,
        threads: 1,
    };
    let enc = encode(dtype, rest, &opts).expect("encode");
    assert_eq!(decode(&enc).expect("decode").data, rest);
});
