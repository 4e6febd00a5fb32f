//! Arbitrary bytes into the decoder: it must return Ok or an error, never panic or read out of
//! bounds; whatever it accepts must re-encode to an encoding that decodes to the same bytes.
#![no_main]

use hprt_compress::codec::{decode, encode, EncodeOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = decode(data) {
        let again = encode(d.dtype, &d.data, &EncodeOptions::single_threaded()).expect("re-encode");
        assert_eq!(decode(&again).expect("decode own encoding").data, d.data);
    }
});
