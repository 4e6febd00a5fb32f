//! interop: wrapping a stream and device memory owned by someone else (here: by other handles of
//! the same platform, which is valid on every backend).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use hprt_platform::{DeviceBuffer, ErrorKind, Platform, ReleaseFn};

use crate::util::{
    check_bytes, check_fill, check_pinned, download, expect_kind, pattern, pinned_with, upload,
    RoundTrip,
};

/// The wrapper of a stream is the same queue: work issued through either handle runs in issue
/// order, and synchronizing one covers work issued through the other.
pub(crate) fn wrapped_stream_shares_queue(p: &dyn Platform) -> Result<()> {
    const N: usize = 2 << 20;
    let s = p.create_stream()?;
    // SAFETY: `s` is a live stream of this platform and outlives the wrapper's use.
    let w = unsafe { p.wrap_external_stream(s.raw()) }?;
    ensure!(
        w.is_external() && !s.is_external(),
        "is_external: wrapper {}, original {}",
        w.is_external(),
        s.is_external()
    );
    ensure!(
        w.raw() == s.raw(),
        "the wrapper's raw handle {:?} differs from {:?}",
        w.raw(),
        s.raw()
    );
    ensure!(
        !w.same_as(&s),
        "the wrapper is the same handle object as the original"
    );

    // Upload through the original, download through the wrapper, no events.
    let rt = RoundTrip::new(p, 90, N)?;
    rt.queue(p, &s, &w)?;
    p.synchronize_stream(&w)?;
    rt.check("download through the wrapper of the upload stream")?;

    // Alternate handles along an order-dependent chain.
    const K: usize = 32;
    let d = p.alloc_device(K * 21)?;
    p.memset_async(&d, 0, 0xFF, K, &s)?;
    for i in 1..=20 {
        let (x, y) = if i % 2 == 0 { (&s, &w) } else { (&w, &s) };
        p.copy_async((&d).into(), i * K, (&d).into(), (i - 1) * K, K, x)?;
        p.memset_async(&d, i * K + i, i as u8, 1, y)?;
    }
    let mut want = Vec::new();
    let mut block = vec![0xFFu8; K];
    want.extend_from_slice(&block);
    for i in 1..=20 {
        block[i] = i as u8;
        want.extend_from_slice(&block);
    }
    p.synchronize_stream(&s)?;
    check_bytes(
        "chain alternating original and wrapper",
        &want,
        &download(p, &d, 0, d.len(), &w)?,
    )?;
    p.destroy_stream(&w)?;
    p.destroy_stream(&s)?;
    Ok(())
}

/// Destroying the wrapper leaves the original working, even with work queued on it.
pub(crate) fn wrapped_stream_destroy(p: &dyn Platform) -> Result<()> {
    const N: usize = 1 << 20;
    let s = p.create_stream()?;
    // SAFETY: as above.
    let w = unsafe { p.wrap_external_stream(s.raw()) }?;
    let data = pattern(91, N);
    let src = pinned_with(p, &data)?;
    let dev = p.alloc_device(N)?;
    p.copy_async((&dev).into(), 0, (&src).into(), 0, N, &w)?;
    p.destroy_stream(&w)?;
    ensure!(!w.is_live(), "a destroyed wrapper reports is_live");
    ensure!(
        s.is_live(),
        "destroying the wrapper killed the original handle"
    );
    expect_kind(
        p.synchronize_stream(&w),
        ErrorKind::InvalidHandle,
        "synchronize on a destroyed wrapper",
    )?;
    p.synchronize_stream(&s)
        .context("synchronize the original after destroying its wrapper")?;
    check_bytes(
        "upload queued through the destroyed wrapper",
        &data,
        &download(p, &dev, 0, N, &s)?,
    )?;
    let data2 = pattern(92, N);
    p.write_device_sync(&dev, 0, &data2, &s)
        .context("using the original after destroying its wrapper")?;
    check_bytes(
        "round trip on the original",
        &data2,
        &download(p, &dev, 0, N, &s)?,
    )?;
    // A new wrapper of the same stream works too.
    // SAFETY: as above.
    let w2 = unsafe { p.wrap_external_stream(s.raw()) }?;
    p.synchronize_stream(&w2)?;
    p.destroy_stream(&w2)?;
    p.destroy_stream(&s)?;
    Ok(())
}

fn counter_release(count: &Arc<AtomicUsize>) -> ReleaseFn {
    let c = Arc::clone(count);
    Box::new(move || {
        c.fetch_add(1, Ordering::SeqCst);
    })
}

/// Wraps `len` bytes of `base` starting at `offset`.
fn wrap(
    p: &dyn Platform,
    base: &DeviceBuffer,
    offset: usize,
    len: usize,
    release: Option<ReleaseFn>,
) -> Result<DeviceBuffer> {
    ensure!(
        offset + len <= base.len(),
        "wrap range outside the base buffer"
    );
    // SAFETY: the range lies inside `base`, which the caller keeps alive past the release.
    let w = unsafe { p.wrap_device_memory(base.device_ptr() + offset, len, release) }?;
    ensure!(
        w.is_borrowed() && !base.is_borrowed(),
        "is_borrowed: wrapper {}, base {}",
        w.is_borrowed(),
        base.is_borrowed()
    );
    ensure!(
        w.len() == len,
        "the wrapper has len {}, expected {len}",
        w.len()
    );
    ensure!(
        w.device_ptr() == base.device_ptr() + offset,
        "the wrapper's device_ptr {:#x} differs from the wrapped {:#x}",
        w.device_ptr(),
        base.device_ptr() + offset
    );
    Ok(w)
}

pub(crate) fn wrapped_memory_visible(p: &dyn Platform) -> Result<()> {
    const N: usize = 4096;
    let s = p.create_stream()?;
    let base = p.alloc_device(N)?;
    p.memset_async(&base, 0, 0, N, &s)?;
    let before = p.memory_stats();
    let w = wrap(p, &base, 512, 1024, None)?;
    let after = p.memory_stats();
    ensure!(
        after.device_current == before.device_current,
        "wrapping borrowed memory changed device accounting from {} to {}",
        before.device_current,
        after.device_current
    );
    let data = pattern(93, 1024);
    p.write_device_sync(&w, 0, &data, &s)?;
    let mut want = vec![0u8; N];
    want[512..1536].copy_from_slice(&data);
    check_bytes(
        "base buffer after writing through the wrapper",
        &want,
        &download(p, &base, 0, N, &s)?,
    )?;
    let data2 = pattern(94, 100);
    p.write_device_sync(&base, 600, &data2, &s)?;
    check_bytes(
        "wrapper after writing through the base",
        &data2,
        &download(p, &w, 88, 100, &s)?,
    )?;
    // D2D between the two views.
    p.copy_async((&base).into(), 3000, (&w).into(), 0, 1024, &s)?;
    want[600..700].copy_from_slice(&data2);
    want.copy_within(512..1536, 3000);
    check_bytes(
        "base after a D2D copy from the wrapper",
        &want,
        &download(p, &base, 0, N, &s)?,
    )?;
    p.free_device(&w)?;
    check_bytes(
        "base after freeing the wrapper",
        &want,
        &download(p, &base, 0, N, &s)?,
    )?;
    let end = p.memory_stats();
    ensure!(
        end.device_current == before.device_current,
        "freeing the wrapper changed device accounting from {} to {}",
        before.device_current,
        end.device_current
    );
    p.destroy_stream(&s)?;
    Ok(())
}

pub(crate) fn release_after_last_clone(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    let data = pattern(95, 2048);
    let base = upload(p, &data, &s)?;
    let count = Arc::new(AtomicUsize::new(0));
    let w = wrap(p, &base, 0, 2048, Some(counter_release(&count)))?;
    let w2 = w.clone();
    drop(w);
    ensure!(
        count.load(Ordering::SeqCst) == 0,
        "release ran while a clone of the wrapper was alive"
    );
    check_bytes(
        "read through the remaining clone",
        &data,
        &download(p, &w2, 0, 2048, &s)?,
    )?;
    ensure!(
        count.load(Ordering::SeqCst) == 0,
        "release ran while the wrapper was in use"
    );
    drop(w2);
    let n = count.load(Ordering::SeqCst);
    ensure!(
        n == 1,
        "release ran {n} times after the last clone was dropped, expected once"
    );
    check_bytes(
        "base after the wrapper was released",
        &data,
        &download(p, &base, 0, 2048, &s)?,
    )?;
    ensure!(count.load(Ordering::SeqCst) == 1, "release ran again later");
    p.destroy_stream(&s)?;
    Ok(())
}

pub(crate) fn release_after_free(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    let data = pattern(96, 2048);
    let base = upload(p, &data, &s)?;
    let count = Arc::new(AtomicUsize::new(0));
    let w = wrap(p, &base, 1024, 1024, Some(counter_release(&count)))?;
    let w2 = w.clone();
    p.free_device(&w)?;
    ensure!(w2.is_freed(), "the clone of a freed wrapper is not freed");
    let n = count.load(Ordering::SeqCst);
    ensure!(
        n == 1,
        "release ran {n} times after free_device with no queued work, expected once"
    );
    drop(w);
    drop(w2);
    let n = count.load(Ordering::SeqCst);
    ensure!(
        n == 1,
        "release ran {n} times after the freed wrapper's clones were dropped, expected once"
    );
    check_bytes(
        "base after the wrapper was freed",
        &data,
        &download(p, &base, 0, 2048, &s)?,
    )?;
    p.destroy_stream(&s)?;
    Ok(())
}

/// Dropping the wrapper with copies still queued on it: release waits for them.
pub(crate) fn release_after_pending_work(p: &dyn Platform) -> Result<()> {
    const N: usize = 1 << 20;
    let s = p.create_stream()?;
    let base = p.alloc_device(N)?;
    let data = pattern(97, N);
    let src = pinned_with(p, &data)?;
    let out = p.alloc_pinned(N)?;
    let count = Arc::new(AtomicUsize::new(0));
    let w = wrap(p, &base, 0, N, Some(counter_release(&count)))?;
    p.copy_async((&w).into(), 0, (&src).into(), 0, N, &s)?;
    p.copy_async((&out).into(), 0, (&w).into(), 0, N, &s)?;
    drop(w);
    p.synchronize_stream(&s)?;
    let n = count.load(Ordering::SeqCst);
    ensure!(
        n == 1,
        "release ran {n} times once the queued work on the dropped wrapper finished, expected once"
    );
    check_pinned("download queued through the dropped wrapper", &data, &out)?;
    p.destroy_stream(&s)?;
    Ok(())
}

pub(crate) fn resize_borrowed_unsupported(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    let base = p.alloc_device(4096)?;
    p.memset_async(&base, 0, 0x3C, 4096, &s)?;
    let w = wrap(p, &base, 0, 1024, None)?;
    for size in [0, 512, 2048] {
        expect_kind(
            p.resize_device(&w, size),
            ErrorKind::Unsupported,
            &format!("resize_device of borrowed memory to {size}"),
        )?;
    }
    ensure!(
        w.len() == 1024 && !w.is_freed(),
        "a refused resize changed the wrapper (len {})",
        w.len()
    );
    check_fill(
        "the wrapper after refused resizes",
        &download(p, &w, 0, 1024, &s)?,
        0x3C,
    )?;
    p.destroy_stream(&s)?;
    Ok(())
}
