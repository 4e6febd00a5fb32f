//! copy: every copy kind with offsets and odd lengths, memset, and the sync helpers. Every
//! destination is prefilled so bytes outside the copied range are checked too.

use std::time::Duration;

use anyhow::{Context, Result};
use hprt_platform::{ErrorKind, Platform, Stream};

use crate::util::{check_bytes, check_pinned, download, expect_kind, pattern, pinned_with, upload};

pub(crate) fn all_kinds_with_offsets(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let src = pattern(1, 10_007);
    let p0 = pinned_with(p, &src)?;

    // H2D: p0[13..13+4001] -> dev1[7..]
    let dev1 = p.alloc_device(4_200)?;
    p.memset_async(&dev1, 0, 0x5A, dev1.len(), &stream)?;
    p.copy_async((&dev1).into(), 7, (&p0).into(), 13, 4_001, &stream)?;
    let mut want1 = vec![0x5A; 4_200];
    want1[7..7 + 4_001].copy_from_slice(&src[13..13 + 4_001]);

    // D2D: dev1[12..12+3999] -> dev2[101..]
    let dev2 = p.alloc_device(6_000)?;
    p.memset_async(&dev2, 0, 0xC3, dev2.len(), &stream)?;
    p.copy_async((&dev2).into(), 101, (&dev1).into(), 12, 3_999, &stream)?;
    let mut want2 = vec![0xC3; 6_000];
    want2[101..101 + 3_999].copy_from_slice(&want1[12..12 + 3_999]);

    // D2H: dev2[103..103+3001] -> p1[5..]
    let p1 = pinned_with(p, &[0x77; 5_000])?;
    p.copy_async((&p1).into(), 5, (&dev2).into(), 103, 3_001, &stream)?;
    let mut want3 = vec![0x77; 5_000];
    want3[5..5 + 3_001].copy_from_slice(&want2[103..103 + 3_001]);

    // H2H: p1[6..6+2999] -> p2[11..]
    let p2 = pinned_with(p, &[0x99; 4_000])?;
    p.copy_async((&p2).into(), 11, (&p1).into(), 6, 2_999, &stream)?;
    let mut want4 = vec![0x99; 4_000];
    want4[11..11 + 2_999].copy_from_slice(&want3[6..6 + 2_999]);

    p.synchronize_stream(&stream)?;
    check_bytes(
        "H2D destination (pinned+13 -> device+7, 4001 bytes)",
        &want1,
        &download(p, &dev1, 0, 4_200, &stream)?,
    )?;
    check_bytes(
        "D2D destination (device+12 -> device+101, 3999 bytes)",
        &want2,
        &download(p, &dev2, 0, 6_000, &stream)?,
    )?;
    check_pinned(
        "D2H destination (device+103 -> pinned+5, 3001 bytes)",
        &want3,
        &p1,
    )?;
    check_pinned(
        "H2H destination (pinned+6 -> pinned+11, 2999 bytes)",
        &want4,
        &p2,
    )?;
    check_pinned("H2D source after the copies", &src, &p0)?;
    p.destroy_stream(&stream)?;
    Ok(())
}

pub(crate) fn d2d_within_one_buffer(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let data = pattern(2, 8_192);
    let d = upload(p, &data, &stream)?;
    p.copy_async((&d).into(), 5_000, (&d).into(), 0, 3_000, &stream)?;
    p.copy_async((&d).into(), 3_001, (&d).into(), 4_001, 499, &stream)?;
    let mut want = data.clone();
    want.copy_within(0..3_000, 5_000);
    want.copy_within(4_001..4_500, 3_001);
    check_bytes(
        "buffer after two copies within it",
        &want,
        &download(p, &d, 0, 8_192, &stream)?,
    )?;
    p.destroy_stream(&stream)?;
    Ok(())
}

pub(crate) fn memset_with_offset(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let d = p.alloc_device(5_000)?;
    p.memset_async(&d, 0, 0x11, 5_000, &stream)?;
    p.memset_async(&d, 33, 0xEE, 1_001, &stream)?;
    p.memset_async(&d, 4_999, 0x01, 1, &stream)?;
    p.memset_async(&d, 2_000, 0x00, 7, &stream)?;
    let mut want = vec![0x11; 5_000];
    want[33..33 + 1_001].fill(0xEE);
    want[4_999] = 0x01;
    want[2_000..2_007].fill(0x00);
    check_bytes(
        "buffer after four memsets",
        &want,
        &download(p, &d, 0, 5_000, &stream)?,
    )?;
    p.destroy_stream(&stream)?;
    Ok(())
}

/// Queues a host function that holds `stream` for `ms` milliseconds, so the work queued after it
/// is certainly not done when the host looks next.
fn hold(p: &dyn Platform, stream: &Stream, ms: u64) -> Result<()> {
    p.launch_host_fn(
        stream,
        Box::new(move || std::thread::sleep(Duration::from_millis(ms))),
    )?;
    Ok(())
}

/// Host access of pinned memory waits for the copies queued on it (no synchronize in between):
/// a read right after a queued D2H sees the copied bytes, and a write right after a queued H2D
/// does not change what the H2D delivers.
pub(crate) fn pinned_access_waits_for_queued_copies(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let data = pattern(5, 8_191);
    let d = upload(p, &data, &stream)?;
    let h = pinned_with(p, &[0x77; 8_191])?;
    hold(p, &stream, 50)?;
    p.copy_async((&h).into(), 0, (&d).into(), 0, 8_191, &stream)?;
    check_pinned("pinned read right after a queued D2H", &data, &h)?;

    // H2D from the pinned buffer, then the host overwrites it at once.
    let d2 = p.alloc_device(8_191)?;
    hold(p, &stream, 50)?;
    p.copy_async((&d2).into(), 0, (&h).into(), 0, 8_191, &stream)?;
    h.write(0, &[0x11; 8_191])?;
    check_bytes(
        "device bytes of an H2D whose pinned source was written right after it was queued",
        &data,
        &download(p, &d2, 0, 8_191, &stream)?,
    )?;

    // Copies from two streams into halves of one buffer: a read waits for both.
    let other = p.create_stream()?;
    let h2 = pinned_with(p, &[0; 8_191])?;
    hold(p, &stream, 30)?;
    hold(p, &other, 60)?;
    p.copy_async((&h2).into(), 0, (&d).into(), 0, 4_000, &stream)?;
    p.copy_async((&h2).into(), 4_000, (&d).into(), 4_000, 4_191, &other)?;
    let mut whole = vec![0u8; 8_191];
    h2.read(0, &mut whole)?;
    check_bytes("pinned read after D2H copies on two streams", &data, &whole)?;
    p.destroy_stream(&other)?;
    p.destroy_stream(&stream)?;
    Ok(())
}

pub(crate) fn sync_helpers(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let d = p.alloc_device(2_048)?;
    p.memset_async(&d, 0, 0, 2_048, &stream)?;
    let data = pattern(3, 999);
    // write_device_sync is ordered after the memset queued before it.
    p.write_device_sync(&d, 17, &data, &stream)?;
    let mut out = vec![0u8; 999];
    p.read_device_sync(&d, 17, &mut out, &stream)?;
    check_bytes("read_device_sync at offset 17", &data, &out)?;
    // read_device_sync waits for async work queued before it.
    p.memset_async(&d, 500, 0xF0, 100, &stream)?;
    let mut whole = vec![0u8; 2_048];
    p.read_device_sync(&d, 0, &mut whole, &stream)?;
    let mut want = vec![0u8; 2_048];
    want[17..17 + 999].copy_from_slice(&data);
    want[500..600].fill(0xF0);
    check_bytes("whole buffer via read_device_sync", &want, &whole)?;
    expect_kind(
        p.write_device_sync(&d, 2_000, &data, &stream),
        ErrorKind::OutOfRange,
        "write_device_sync past the end",
    )?;
    p.destroy_stream(&stream)?;
    Ok(())
}

pub(crate) fn empty_copies(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let d = p.alloc_device(100)?;
    let h = p.alloc_pinned(50)?;
    p.copy_async((&d).into(), 100, (&h).into(), 50, 0, &stream)
        .context("H2D of 0 bytes at both ends")?;
    p.copy_async((&h).into(), 50, (&d).into(), 100, 0, &stream)
        .context("D2H of 0 bytes at both ends")?;
    p.copy_async((&d).into(), 100, (&d).into(), 0, 0, &stream)
        .context("D2D of 0 bytes")?;
    p.copy_async((&h).into(), 0, (&h).into(), 50, 0, &stream)
        .context("H2H of 0 bytes")?;
    p.memset_async(&d, 100, 1, 0, &stream)
        .context("memset of 0 bytes at the end")?;
    expect_kind(
        p.copy_async((&d).into(), 101, (&h).into(), 0, 0, &stream),
        ErrorKind::OutOfRange,
        "0-byte copy at an offset past the end",
    )?;
    expect_kind(
        p.memset_async(&d, 101, 1, 0, &stream),
        ErrorKind::OutOfRange,
        "0-byte memset at an offset past the end",
    )?;
    p.synchronize_stream(&stream)?;
    p.destroy_stream(&stream)?;
    Ok(())
}
