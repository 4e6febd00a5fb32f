//! C entry points of the platform layer's data movement: copies between device and pinned
//! memory, and memset, on a stream.

use super::*;

/// One end of a copy: exactly one of `device` and `pinned` is non-null.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HprtMemRef {
    pub device: *const HprtDeviceBuffer,
    pub pinned: *const HprtPinnedBuffer,
    pub offset: usize,
}

fn mem<'a>(
    r: &HprtMemRef,
    what: &str,
) -> FfiResult<
    hprt_platform::Memory<&'a hprt_platform::DeviceBuffer, &'a hprt_platform::PinnedBuffer>,
> {
    match (r.device.is_null(), r.pinned.is_null()) {
        (false, true) => Ok(hprt_platform::Memory::Device(&arg(r.device, what)?.0)),
        (true, false) => Ok(hprt_platform::Memory::Pinned(&arg(r.pinned, what)?.0)),
        _ => Err(FfiError::invalid(format!(
            "{what}: exactly one of device and pinned must be set"
        ))),
    }
}

/// Enqueues a copy of `bytes` on `stream` (H2D, D2H, D2D or H2H, from the two ends).
///
/// # Safety
/// All handles live.
#[no_mangle]
pub unsafe extern "C" fn hprt_copy_async(
    platform: *const HprtPlatform,
    dst: HprtMemRef,
    src: HprtMemRef,
    bytes: usize,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_copy_async", || {
        let (p, s) = (arg(platform, "platform")?, arg(stream, "stream")?);
        let (d, r) = (mem(&dst, "dst")?, mem(&src, "src")?);
        p.get()
            .copy_async(d, dst.offset, r, src.offset, bytes, &s.0)?;
        Ok(())
    })
}

/// Enqueues `buffer[offset..offset+bytes] = value`.
///
/// # Safety
/// All handles live.
#[no_mangle]
pub unsafe extern "C" fn hprt_memset_async(
    platform: *const HprtPlatform,
    buffer: *const HprtDeviceBuffer,
    offset: usize,
    value: u8,
    bytes: usize,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_memset_async", || {
        let (p, b, s) = (
            arg(platform, "platform")?,
            arg(buffer, "buffer")?,
            arg(stream, "stream")?,
        );
        p.get().memset_async(&b.0, offset, value, bytes, &s.0)?;
        Ok(())
    })
}
