//! C entry points of the lossless codec (`compress/FORMAT.md`): worst-case sizes, compressing
//! and decompressing host memory, and the same through the device codec on a stream.

use std::ffi::c_void;

use hprt_compress::codec::{self, DecodeOptions, EncodeOptions};
use hprt_compress::CodecDType;
use hprt_compress::{codec_for, CompressedTensor};

use super::platform::{dtype_arg, HprtDeviceBuffer, HprtDtype, HprtPlatform, HprtStream};
use super::{arg, guard, out, FfiError, FfiResult, HprtStatus};

/// What an encoding holds, read from its (checksummed) header and chunk table.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HprtCompressedInfo {
    /// An `HprtDtype`: `HPRT_DTYPE_F32`, `HPRT_DTYPE_F16` or `HPRT_DTYPE_BF16`.
    pub dtype: i32,
    pub numel: usize,
    /// Bytes the decoded tensor occupies (`numel` times the dtype's size).
    pub original_bytes: usize,
    /// Bytes of the whole encoding.
    pub compressed_bytes: usize,
}

fn codec_dtype(dtype: i32) -> FfiResult<CodecDType> {
    Ok(CodecDType::try_from(dtype_arg(dtype)?)?)
}

fn c_dtype(d: CodecDType) -> HprtDtype {
    d.dtype().into()
}

/// `numel` elements' bytes, checked with room for the header and chunk table (less than one
/// byte per element plus 64), so the codec's size arithmetic cannot overflow.
fn checked_bytes(d: CodecDType, numel: usize) -> FfiResult<usize> {
    numel
        .checked_mul(d.size() + 1)
        .and_then(|b| b.checked_add(64))
        .map(|_| numel * d.size())
        .ok_or_else(|| FfiError::invalid(format!("{numel} {d} elements overflow")))
}

fn too_small(what: &str, have: usize, need: usize) -> FfiError {
    FfiError {
        status: HprtStatus::ErrorBufferTooSmall,
        message: format!("{what} holds {have} bytes, {need} are needed"),
    }
}

/// A C byte range as a slice; a null pointer is allowed only for an empty range.
///
/// # Safety
/// `p` null or valid for reads of `len` bytes for `'a`.
unsafe fn bytes_in<'a>(p: *const c_void, len: usize, what: &str) -> FfiResult<&'a [u8]> {
    match (p.is_null(), len) {
        (true, 0) => Ok(&[]),
        (true, _) => Err(FfiError::null(what)),
        // SAFETY: the caller's contract.
        (false, _) => Ok(unsafe { std::slice::from_raw_parts(p.cast(), len) }),
    }
}

/// A C byte range as a mutable slice; a null pointer is allowed only for an empty range.
///
/// # Safety
/// `p` null or valid for writes of `len` bytes for `'a`, aliasing nothing else in the call.
unsafe fn bytes_out<'a>(p: *mut c_void, len: usize, what: &str) -> FfiResult<&'a mut [u8]> {
    match (p.is_null(), len) {
        (true, 0) => Ok(&mut []),
        (true, _) => Err(FfiError::null(what)),
        // SAFETY: the caller's contract.
        (false, _) => Ok(unsafe { std::slice::from_raw_parts_mut(p.cast(), len) }),
    }
}

/// The largest encoding `numel` elements of `dtype` (F32, F16 or BF16) can take: a buffer of
/// this size always suffices for `hprt_compress` and `hprt_compress_device`.
///
/// # Safety
/// `out_bytes` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_compress_max_size(
    dtype: i32,
    numel: usize,
    out_bytes: *mut usize,
) -> HprtStatus {
    guard("hprt_compress_max_size", || {
        let d = codec_dtype(dtype)?;
        checked_bytes(d, numel)?;
        let n = codec::max_encoded_len(d, numel, &EncodeOptions::default());
        // SAFETY: the caller's contract.
        unsafe { out(out_bytes, "out_bytes", n) }
    })
}

/// Compresses `src_bytes` bytes of little-endian `dtype` elements at `src` (host memory) into
/// `dst` (capacity `dst_capacity`), on the library's worker threads; `*out_len` is the
/// encoding's length. A capacity below that length is `HPRT_STATUS_ERROR_BUFFER_TOO_SMALL`
/// (`hprt_compress_max_size` is always enough).
///
/// # Safety
/// `src` readable for `src_bytes`, `dst` writable for `dst_capacity` bytes, not overlapping;
/// `out_len` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_compress(
    dtype: i32,
    src: *const c_void,
    src_bytes: usize,
    dst: *mut c_void,
    dst_capacity: usize,
    out_len: *mut usize,
) -> HprtStatus {
    guard("hprt_compress", || {
        let d = codec_dtype(dtype)?;
        // SAFETY: the caller's contract.
        let (input, output) = unsafe {
            (
                bytes_in(src, src_bytes, "src")?,
                bytes_out(dst, dst_capacity, "dst")?,
            )
        };
        if out_len.is_null() {
            return Err(FfiError::null("out_len"));
        }
        let mut encoded = Vec::new();
        codec::encode_into(d, input, &EncodeOptions::default(), &mut encoded)?;
        if encoded.len() > output.len() {
            return Err(too_small("dst", output.len(), encoded.len()));
        }
        output[..encoded.len()].copy_from_slice(&encoded);
        // SAFETY: the caller's contract.
        unsafe { out(out_len, "out_len", encoded.len()) }
    })
}

/// Reads the header of the `src_len`-byte encoding at `src` (checksum and lengths checked, the
/// payload not decoded). Corrupt or truncated bytes are `HPRT_STATUS_ERROR_CORRUPT_DATA`.
///
/// # Safety
/// `src` readable for `src_len` bytes; `out_info` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_compressed_info(
    src: *const c_void,
    src_len: usize,
    out_info: *mut HprtCompressedInfo,
) -> HprtStatus {
    guard("hprt_compressed_info", || {
        // SAFETY: the caller's contract.
        let input = unsafe { bytes_in(src, src_len, "src") }?;
        let h = codec::inspect(input)?.header;
        let info = HprtCompressedInfo {
            dtype: c_dtype(h.dtype) as i32,
            numel: h.numel,
            original_bytes: h.numel * h.dtype.size(),
            compressed_bytes: input.len(),
        };
        // SAFETY: the caller's contract.
        unsafe { out(out_info, "out_info", info) }
    })
}

/// Decompresses the `src_len`-byte encoding at `src` into `dst` (capacity `dst_capacity`);
/// `*out_bytes` is the decoded length. Every chunk's checksum is verified: corrupt, truncated
/// or foreign bytes are `HPRT_STATUS_ERROR_CORRUPT_DATA`, a capacity below the decoded length
/// `HPRT_STATUS_ERROR_BUFFER_TOO_SMALL`. On failure `dst`'s contents are unspecified.
///
/// # Safety
/// `src` readable for `src_len`, `dst` writable for `dst_capacity` bytes, not overlapping;
/// `out_bytes` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_decompress(
    src: *const c_void,
    src_len: usize,
    dst: *mut c_void,
    dst_capacity: usize,
    out_bytes: *mut usize,
) -> HprtStatus {
    guard("hprt_decompress", || {
        // SAFETY: the caller's contract.
        let (input, output) = unsafe {
            (
                bytes_in(src, src_len, "src")?,
                bytes_out(dst, dst_capacity, "dst")?,
            )
        };
        if out_bytes.is_null() {
            return Err(FfiError::null("out_bytes"));
        }
        let h = codec::inspect(input)?.header;
        let need = h.numel * h.dtype.size();
        if need > output.len() {
            return Err(too_small("dst", output.len(), need));
        }
        codec::decode_into(input, &mut output[..need], &DecodeOptions::default())?;
        // SAFETY: the caller's contract.
        unsafe { out(out_bytes, "out_bytes", need) }
    })
}

/// Compresses `numel` `dtype` elements of device memory at `src + src_offset` into the start of
/// `dst` through the platform's device codec, ordered after the work queued on `stream`.
/// `dst` must hold `hprt_compress_max_size` bytes. Blocks the calling thread until the
/// encoding finished (its length is known only then); `*out_len` is that length.
///
/// # Safety
/// All handles live; `out_len` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_compress_device(
    platform: *const HprtPlatform,
    src: *const HprtDeviceBuffer,
    src_offset: usize,
    dtype: i32,
    numel: usize,
    dst: *const HprtDeviceBuffer,
    stream: *const HprtStream,
    out_len: *mut usize,
) -> HprtStatus {
    guard("hprt_compress_device", || {
        let (p, a, b, s) = (
            arg(platform, "platform")?.get(),
            arg(src, "src")?,
            arg(dst, "dst")?,
            arg(stream, "stream")?,
        );
        if out_len.is_null() {
            return Err(FfiError::null("out_len"));
        }
        let d = codec_dtype(dtype)?;
        checked_bytes(d, numel)?;
        let codec = codec_for(p);
        let need = codec.max_encoded_len(d, numel);
        if b.0.len() < need {
            return Err(too_small("dst", b.0.len(), need));
        }
        let pending = codec.encode_async(p, a.0.at(src_offset), d, numel, &b.0, &s.0)?;
        let len = pending.wait_len(p)?;
        // SAFETY: the caller's contract.
        unsafe { out(out_len, "out_len", len) }
    })
}

/// Decompresses the `src_len`-byte encoding at the start of device buffer `src` into
/// `dst + dst_offset` on `stream` (after its queued work), expecting `numel` elements of
/// `dtype` (anything else is `HPRT_STATUS_ERROR_CORRUPT_DATA`). Blocks the calling thread until
/// the decoding finished so its verdict can be returned; later work on `stream` sees the data.
/// On failure the destination range's contents are unspecified.
///
/// # Safety
/// All handles live.
#[no_mangle]
pub unsafe extern "C" fn hprt_decompress_device(
    platform: *const HprtPlatform,
    src: *const HprtDeviceBuffer,
    src_len: usize,
    dtype: i32,
    numel: usize,
    dst: *const HprtDeviceBuffer,
    dst_offset: usize,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_decompress_device", || {
        let (p, a, b, s) = (
            arg(platform, "platform")?.get(),
            arg(src, "src")?,
            arg(dst, "dst")?,
            arg(stream, "stream")?,
        );
        let d = codec_dtype(dtype)?;
        let need = checked_bytes(d, numel)?;
        let room = b.0.len().saturating_sub(dst_offset);
        if room < need {
            return Err(too_small("dst past dst_offset", room, need));
        }
        let packed = CompressedTensor::from_device_bytes(a.0.clone(), src_len, d, numel)?;
        codec_for(p)
            .decode_async(p, &packed, b.0.at(dst_offset), &s.0)?
            .finish(p)?;
        Ok(())
    })
}
