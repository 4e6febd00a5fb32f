//! The codec's C entry points from Rust: bit-exact round trips (NaN payloads, infinities,
//! subnormals, signed zeros) for f32, f16 and bf16 on the host and through the device codec,
//! and typed statuses for corrupt, truncated and foreign bytes, short buffers and null
//! arguments.

use std::ffi::{c_void, CStr};
use std::ptr;

use hprt::ffi::*;

mod common;
use common::*;
mod c_abi_common;
use c_abi_common::*;

/// Deterministic values with the shape of an activation (a few exponents dominate).
fn smooth(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let noise = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            (i as f32 * 0.013).sin() * 0.8 + noise * 0.1
        })
        .collect()
}

/// Little-endian elements of `dtype` (an `HprtDtype`) with the special values spliced in.
fn tensor(dtype: HprtDtype, n: usize, seed: u64) -> Vec<u8> {
    let v = smooth(n, seed);
    let mut out = Vec::with_capacity(n * 4);
    match dtype {
        HprtDtype::F32 => {
            let special: [u32; 8] = [
                0x7fc0_0001, // quiet NaN with a payload
                0xffc1_2345, // negative quiet NaN
                0x7f80_0001, // signalling NaN
                0x7f80_0000, // +inf
                0xff80_0000, // -inf
                0x8000_0000, // -0
                0x0000_0001, // smallest subnormal
                0x807f_ffff, // largest negative subnormal
            ];
            for (i, x) in v.iter().enumerate() {
                let bits = if i % 97 == 3 {
                    special[(i / 97) % special.len()]
                } else {
                    x.to_bits()
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
        }
        HprtDtype::F16 | HprtDtype::Bf16 => {
            let special: [u16; 6] = if dtype == HprtDtype::F16 {
                [0x7e01, 0xfd55, 0x7c01, 0x7c00, 0x8000, 0x0001]
            } else {
                [0x7fc1, 0xffa5, 0x7f81, 0xff80, 0x8000, 0x0001]
            };
            for (i, x) in v.iter().enumerate() {
                let bits = if i % 89 == 5 {
                    special[(i / 89) % special.len()]
                } else if dtype == HprtDtype::Bf16 {
                    (x.to_bits() >> 16) as u16
                } else {
                    f32_to_f16_bits(*x)
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
        }
        other => panic!("no test data for {other:?}"),
    }
    out
}

/// Round-toward-zero f32 → f16 for the normal range the test data uses (|x| < 2).
fn f32_to_f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign; // flushes the tiny values to a signed zero
    }
    sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

fn max_size(dtype: HprtDtype, numel: usize) -> usize {
    let mut n = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { hprt_compress_max_size(dtype as i32, numel, &mut n) });
    n
}

fn compress(dtype: HprtDtype, data: &[u8]) -> Vec<u8> {
    let size = if dtype == HprtDtype::F32 { 4 } else { 2 };
    let mut out = vec![0u8; max_size(dtype, data.len() / size)];
    let mut len = 0;
    // SAFETY: both ranges are valid for the lengths passed.
    ok(unsafe {
        hprt_compress(
            dtype as i32,
            data.as_ptr().cast(),
            data.len(),
            out.as_mut_ptr().cast(),
            out.len(),
            &mut len,
        )
    });
    out.truncate(len);
    out
}

/// Decompresses into a buffer of `capacity` bytes: the status, and the bytes on success.
fn decompress(packed: &[u8], capacity: usize) -> (HprtStatus, Vec<u8>) {
    let mut out = vec![0u8; capacity];
    let mut n = usize::MAX;
    // SAFETY: both ranges are valid for the lengths passed.
    let st = unsafe {
        hprt_decompress(
            packed.as_ptr().cast(),
            packed.len(),
            out.as_mut_ptr().cast(),
            out.len(),
            &mut n,
        )
    };
    if st == HprtStatus::Ok {
        out.truncate(n);
    } else {
        assert_eq!(n, usize::MAX, "out_bytes is written only on success");
    }
    (st, out)
}

fn info(packed: &[u8]) -> Result<HprtCompressedInfo, HprtStatus> {
    let mut i = HprtCompressedInfo::default();
    // SAFETY: valid range and out-pointer.
    match unsafe { hprt_compressed_info(packed.as_ptr().cast(), packed.len(), &mut i) } {
        HprtStatus::Ok => Ok(i),
        st => Err(st),
    }
}

const DTYPES: [HprtDtype; 3] = [HprtDtype::F32, HprtDtype::F16, HprtDtype::Bf16];

#[test]
fn host_round_trips_are_bit_exact_for_every_codec_dtype() {
    // Sizes around the 8-element groups, one element, nothing, and two chunks (2^17 + 3).
    for dtype in DTYPES {
        for (seed, n) in [0usize, 1, 7, 8, 1000, (1 << 17) + 3]
            .into_iter()
            .enumerate()
        {
            let data = tensor(dtype, n, seed as u64 + 1);
            let packed = compress(dtype, &data);
            assert!(packed.len() <= max_size(dtype, n));
            if n >= 1000 {
                assert!(
                    packed.len() < data.len(),
                    "{dtype:?} x {n}: {} bytes did not shrink ({})",
                    data.len(),
                    packed.len()
                );
            }
            let i = info(&packed).unwrap_or_else(|s| panic!("{s:?}: {}", last_error()));
            assert_eq!(i.dtype, dtype as i32);
            assert_eq!((i.numel, i.original_bytes), (n, data.len()));
            assert_eq!(i.compressed_bytes, packed.len());
            // A larger buffer than needed is fine; exactly the decoded length is written.
            let (st, back) = decompress(&packed, data.len() + 16);
            assert_eq!(st, HprtStatus::Ok, "{}", last_error());
            assert!(back == data, "{dtype:?} x {n}: round trip changed bits");
        }
    }
}

#[test]
fn corrupt_truncated_and_foreign_bytes_are_corrupt_data() {
    let data = tensor(HprtDtype::F32, 4096, 9);
    let packed = compress(HprtDtype::F32, &data);
    let cap = data.len();

    // A flipped payload bit fails the chunk checksum; a flipped header bit the prefix's.
    for at in [packed.len() - 5, packed.len() / 2, 12] {
        let mut bad = packed.clone();
        bad[at] ^= 0x10;
        let (st, _) = decompress(&bad, cap);
        assert_eq!(st, HprtStatus::ErrorCorruptData, "flip at {at}");
        assert!(last_error().contains("corrupt"), "{}", last_error());
    }
    let mut bad_header = packed.clone();
    bad_header[12] ^= 1;
    assert_eq!(info(&bad_header).unwrap_err(), HprtStatus::ErrorCorruptData);

    for keep in [0, 3, 39, packed.len() / 2, packed.len() - 1] {
        let (st, _) = decompress(&packed[..keep], cap);
        assert_eq!(st, HprtStatus::ErrorCorruptData, "truncated to {keep}");
    }
    let mut longer = packed.clone();
    longer.push(0);
    assert_eq!(decompress(&longer, cap).0, HprtStatus::ErrorCorruptData);
    let foreign = b"\x28\xb5\x2f\xfd not ours at all, a zstd frame perhaps".repeat(4);
    assert_eq!(decompress(&foreign, cap).0, HprtStatus::ErrorCorruptData);
    assert_eq!(info(&foreign).unwrap_err(), HprtStatus::ErrorCorruptData);
    // The intact encoding still decodes.
    assert!(decompress(&packed, cap).1 == data);
}

#[test]
fn short_buffers_are_buffer_too_small() {
    let data = tensor(HprtDtype::Bf16, 3000, 4);
    let packed = compress(HprtDtype::Bf16, &data);
    let (st, _) = decompress(&packed, data.len() - 1);
    assert_eq!(st, HprtStatus::ErrorBufferTooSmall);
    assert!(
        last_error().contains(&data.len().to_string()),
        "{}",
        last_error()
    );
    // SAFETY: the status name is a static string.
    let name = unsafe { CStr::from_ptr(hprt_status_name(st as i32)) };
    assert_eq!(name.to_str().unwrap(), "HPRT_STATUS_ERROR_BUFFER_TOO_SMALL");

    let mut out = vec![0u8; packed.len() - 1];
    let mut len = usize::MAX;
    // SAFETY: both ranges are valid for the lengths passed.
    let st = unsafe {
        hprt_compress(
            HprtDtype::Bf16 as i32,
            data.as_ptr().cast(),
            data.len(),
            out.as_mut_ptr().cast(),
            out.len(),
            &mut len,
        )
    };
    assert_eq!(st, HprtStatus::ErrorBufferTooSmall, "{}", last_error());
    assert_eq!(len, usize::MAX);
}

#[test]
fn null_and_invalid_arguments_are_typed() {
    let data = tensor(HprtDtype::F32, 64, 2);
    let mut out = vec![0u8; 1024];
    let mut len = 0;
    let (src, dst): (*const c_void, *mut c_void) = (data.as_ptr().cast(), out.as_mut_ptr().cast());
    // SAFETY: null pointers must be reported, never dereferenced; the others are valid.
    unsafe {
        let f32 = HprtDtype::F32 as i32;
        let null = HprtStatus::ErrorNullArgument;
        assert_eq!(
            hprt_compress(f32, ptr::null(), 256, dst, 1024, &mut len),
            null
        );
        assert!(last_error().contains("src"), "{}", last_error());
        assert_eq!(
            hprt_compress(f32, src, 256, ptr::null_mut(), 1024, &mut len),
            null
        );
        assert_eq!(
            hprt_compress(f32, src, 256, dst, 1024, ptr::null_mut()),
            null
        );
        assert_eq!(hprt_decompress(ptr::null(), 10, dst, 1024, &mut len), null);
        assert_eq!(hprt_decompress(src, 256, dst, 1024, ptr::null_mut()), null);
        assert_eq!(hprt_compressed_info(ptr::null(), 40, ptr::null_mut()), null);
        assert_eq!(hprt_compress_max_size(f32, 10, ptr::null_mut()), null);

        // Integer tensors have no codec; 42 is no dtype; bytes must be whole elements.
        let invalid = HprtStatus::ErrorInvalidValue;
        let i32_ = HprtDtype::I32 as i32;
        assert_eq!(hprt_compress(i32_, src, 256, dst, 1024, &mut len), invalid);
        assert!(last_error().contains("no codec"), "{}", last_error());
        assert_eq!(hprt_compress(42, src, 256, dst, 1024, &mut len), invalid);
        assert_eq!(hprt_compress(f32, src, 255, dst, 1024, &mut len), invalid);
        assert_eq!(
            hprt_compress_max_size(f32, usize::MAX / 2, &mut len),
            invalid
        );
        // An empty tensor may come with null pointers.
        ok(hprt_compress(f32, ptr::null(), 0, dst, 1024, &mut len));
        assert!(len > 0, "even an empty tensor has a header");
    }
}

/// Device memory through the C ABI: upload, compress on a stream, fetch the bytes, decompress
/// on the host and on the device.
#[test]
fn device_codec_round_trips_and_reports_corruption() {
    let mut p = ptr::null_mut();
    // SAFETY: every handle below is made here, used while live and released once.
    unsafe {
        ok(hprt_platform_open(c"cpu".as_ptr(), &mut p));
        let s = stream(p);
        for dtype in DTYPES {
            let n = 5000;
            let data = tensor(dtype, n, 21);
            let cap = max_size(dtype, n);
            let mut staging = ptr::null_mut();
            ok(hprt_pinned_alloc(p, cap.max(data.len()), &mut staging));
            let host = pinned_slice::<u8>(staging, cap.max(data.len()));
            let (mut src, mut packed, mut dst) =
                (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
            ok(hprt_device_alloc(p, data.len() + 8, &mut src));
            ok(hprt_device_alloc(p, cap, &mut packed));
            ok(hprt_device_alloc(p, data.len() + 8, &mut dst));
            let pin = pinned_ref(staging);
            host[..data.len()].copy_from_slice(&data);
            // The tensor sits 8 bytes into its buffer, as a view would.
            ok(hprt_copy_async(p, device_ref(src, 8), pin, data.len(), s));
            let mut len = 0;
            ok(hprt_compress_device(
                p,
                src,
                8,
                dtype as i32,
                n,
                packed,
                s,
                &mut len,
            ));
            assert!(len < data.len() && len <= cap);
            ok(hprt_copy_async(p, pin, device_ref(packed, 0), len, s));
            ok(hprt_stream_synchronize(p, s));
            let bytes = host[..len].to_vec();
            assert!(
                bytes == compress(dtype, &data),
                "device and host encodings differ"
            );
            assert!(decompress(&bytes, data.len()).1 == data);

            ok(hprt_decompress_device(
                p,
                packed,
                len,
                dtype as i32,
                n,
                dst,
                8,
                s,
            ));
            ok(hprt_copy_async(p, pin, device_ref(dst, 8), data.len(), s));
            ok(hprt_stream_synchronize(p, s));
            assert!(
                host[..data.len()] == data[..],
                "{dtype:?}: device round trip"
            );

            // Another element count than the encoding holds, a corrupted byte, a short
            // destination, a short scratch buffer.
            let st = hprt_decompress_device(p, packed, len, dtype as i32, n - 1, dst, 0, s);
            assert_eq!(st, HprtStatus::ErrorCorruptData, "{}", last_error());
            host[len / 2] ^= 0x40;
            ok(hprt_copy_async(p, device_ref(packed, 0), pin, len, s));
            let st = hprt_decompress_device(p, packed, len, dtype as i32, n, dst, 0, s);
            assert_eq!(st, HprtStatus::ErrorCorruptData, "{}", last_error());
            let st = hprt_decompress_device(p, packed, len, dtype as i32, n, dst, 9, s);
            assert_eq!(st, HprtStatus::ErrorBufferTooSmall, "{}", last_error());
            let st = hprt_compress_device(p, src, 8, dtype as i32, n, src, s, &mut len);
            assert_eq!(st, HprtStatus::ErrorBufferTooSmall, "{}", last_error());
            let st = hprt_compress_device(p, src, 8, dtype as i32, n, packed, s, ptr::null_mut());
            assert_eq!(st, HprtStatus::ErrorNullArgument);

            ok(hprt_stream_synchronize(p, s));
            for b in [src, packed, dst] {
                ok(hprt_device_free(p, b));
            }
            ok(hprt_pinned_free(p, staging));
        }
        close_with_stream(p, s);
    }
}

/// A decoded-size bomb (a valid prefix of constant f32 chunks declaring 1 TiB) is refused
/// before anything is sized from its declared length: on the host by the destination's
/// capacity, on the device because the caller's dtype and element count are compared first
/// (the device decoder used to allocate the declared size and abort the process).
#[test]
fn decoded_size_bombs_are_refused_on_host_and_device() {
    use hprt::compress::format::{constant_encoding, MAX_CHUNK_ELEMS};
    let bomb = constant_encoding(
        hprt::compress::CodecDType::F32,
        MAX_CHUNK_ELEMS,
        1 << 38,
        false,
    );
    assert!(bomb.len() < 400 << 10);
    let (st, _) = decompress(&bomb, 1 << 20);
    assert_eq!(st, HprtStatus::ErrorBufferTooSmall, "{}", last_error());
    assert!(last_error().contains("1099511627776"), "{}", last_error());

    let mut p = ptr::null_mut();
    // SAFETY: every handle below is made here, used while live and released once.
    unsafe {
        ok(hprt_platform_open(c"cpu".as_ptr(), &mut p));
        let s = stream(p);
        let staging = pinned_alloc(p, bomb.len());
        let packed = device_alloc(p, bomb.len());
        let dst = device_alloc(p, 64);
        pinned_slice::<u8>(staging, bomb.len()).copy_from_slice(&bomb);
        let to = device_ref(packed, 0);
        let from = pinned_ref(staging);
        ok(hprt_copy_async(p, to, from, bomb.len(), s));
        let st =
            hprt_decompress_device(p, packed, bomb.len(), HprtDtype::F32 as i32, 16, dst, 0, s);
        assert_eq!(st, HprtStatus::ErrorCorruptData, "{}", last_error());
        ok(hprt_stream_synchronize(p, s));
        ok(hprt_device_free(p, packed));
        ok(hprt_device_free(p, dst));
        ok(hprt_pinned_free(p, staging));
        close_with_stream(p, s);
    }
}
