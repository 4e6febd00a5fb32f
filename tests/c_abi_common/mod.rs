//! What the C-ABI test binaries do alike beyond `tests/common` (which other binaries share
//! too): memory references, pinned staging and one rank of an all-reduce, written once so that
//! every binary drives the ABI the same way.
#![allow(dead_code)] // each test binary uses its own subset

use std::ptr;

use hprt::ffi::*;

use super::common::ok;

/// `device` at `offset`, as a copy's source or destination.
pub fn device_ref(device: *const HprtDeviceBuffer, offset: usize) -> HprtMemRef {
    HprtMemRef {
        device,
        pinned: ptr::null(),
        offset,
    }
}

/// The start of `pinned`, as a copy's source or destination.
pub fn pinned_ref(pinned: *const HprtPinnedBuffer) -> HprtMemRef {
    HprtMemRef {
        device: ptr::null(),
        pinned,
        offset: 0,
    }
}

/// The first `n` elements of a pinned buffer, in place.
///
/// # Safety
/// `host` is live, holds at least `n` `T`s and outlives the slice, which nothing else aliases.
pub unsafe fn pinned_slice<'a, T>(host: *const HprtPinnedBuffer, n: usize) -> &'a mut [T] {
    let mut hp = ptr::null_mut();
    // SAFETY: the caller's contract: `host` is live; the out-pointer is valid.
    unsafe {
        ok(hprt_pinned_info(host, &mut hp, ptr::null_mut()));
        std::slice::from_raw_parts_mut(hp.cast::<T>(), n)
    }
}

/// A new stream.
///
/// # Safety
/// `p` is live.
pub unsafe fn stream(p: *const HprtPlatform) -> *mut HprtStream {
    let mut s = ptr::null_mut();
    // SAFETY: `p` is live (the caller's contract); the out-pointer is valid.
    ok(unsafe { hprt_stream_create(p, &mut s) });
    s
}

/// Rank `rank`'s communicator of `world` on the unique id `id`.
///
/// # Safety
/// `p` is live and `id` is a unique id it issued.
pub unsafe fn join_comm(
    p: *const HprtPlatform,
    id: &[u8],
    rank: usize,
    world: usize,
) -> *mut HprtComm {
    let mut comm = ptr::null_mut();
    // SAFETY: the caller's contract; `id` is valid for its length; the out-pointer is valid.
    ok(unsafe { hprt_comm_init(p, id.as_ptr(), id.len(), rank, world, &mut comm) });
    comm
}

/// Destroys `s`, then closes `p`: how most tests end.
///
/// # Safety
/// `s` is a live stream of the live platform `p`; neither is used again.
pub unsafe fn close_with_stream(p: *mut HprtPlatform, s: *mut HprtStream) {
    // SAFETY: the caller's contract; each is released once.
    unsafe {
        ok(hprt_stream_destroy(p, s));
        ok(hprt_platform_close(p));
    }
}

/// A new unique id of `p`'s and its length.
///
/// # Safety
/// `p` is live.
pub unsafe fn unique_id(p: *const HprtPlatform) -> ([u8; HPRT_UNIQUE_ID_MAX_BYTES], usize) {
    let mut id = [0u8; HPRT_UNIQUE_ID_MAX_BYTES];
    let mut len = 0;
    // SAFETY: `p` is live (the caller's contract); `id` has the capacity passed.
    ok(unsafe { hprt_unique_id(p, id.as_mut_ptr(), id.len(), &mut len) });
    (id, len)
}

/// The one rank of a new world of one.
///
/// # Safety
/// `p` is live.
pub unsafe fn solo_comm(p: *const HprtPlatform) -> *mut HprtComm {
    // SAFETY: `p` is live (the caller's contract) and issues the id.
    unsafe {
        let (id, len) = unique_id(p);
        join_comm(p, &id[..len], 0, 1)
    }
}

/// A new `n`-byte device buffer.
///
/// # Safety
/// `p` is live.
pub unsafe fn device_alloc(p: *const HprtPlatform, n: usize) -> *mut HprtDeviceBuffer {
    let mut b = ptr::null_mut();
    // SAFETY: `p` is live (the caller's contract); the out-pointer is valid.
    ok(unsafe { hprt_device_alloc(p, n, &mut b) });
    b
}

/// A new `n`-byte pinned buffer.
///
/// # Safety
/// `p` is live.
pub unsafe fn pinned_alloc(p: *const HprtPlatform, n: usize) -> *mut HprtPinnedBuffer {
    let mut h = ptr::null_mut();
    // SAFETY: `p` is live (the caller's contract); the out-pointer is valid.
    ok(unsafe { hprt_pinned_alloc(p, n, &mut h) });
    h
}

/// A new device buffer holding `bytes`, written through pinned staging and synchronized on `s`.
///
/// # Safety
/// `p` and `s` are live.
pub unsafe fn upload(
    p: *const HprtPlatform,
    s: *mut HprtStream,
    bytes: &[u8],
) -> *mut HprtDeviceBuffer {
    // SAFETY: live handles (the caller's contract); the staging buffer outlives the synchronize.
    unsafe {
        let dev = device_alloc(p, bytes.len());
        let host = pinned_alloc(p, bytes.len());
        pinned_slice(host, bytes.len()).copy_from_slice(bytes);
        ok(hprt_copy_async(
            p,
            device_ref(dev, 0),
            pinned_ref(host),
            bytes.len(),
            s,
        ));
        ok(hprt_stream_synchronize(p, s));
        ok(hprt_pinned_free(p, host));
        dev
    }
}

/// One rank of `world`: joins the communicator `id` names, all-reduces (sum) 1,000 f32s of its
/// own and checks every element of the sum, then releases everything it made.
///
/// # Safety
/// `p` is live and `id` is a unique id it issued.
pub unsafe fn all_reduce_rank(p: *const HprtPlatform, id: &[u8], rank: usize, world: usize) {
    let n = 1000usize;
    // SAFETY: every handle below is made here, used while live and released once; the pinned
    // slice is used for its `n` f32s while the buffer lives.
    unsafe {
        let s = stream(p);
        let comm = join_comm(p, id, rank, world);
        let dev = device_alloc(p, 4 * n);
        let host = pinned_alloc(p, 4 * n);
        let vals = pinned_slice::<f32>(host, n);
        for (i, v) in vals.iter_mut().enumerate() {
            *v = (rank * n + i) as f32;
        }
        let (d, h) = (device_ref(dev, 0), pinned_ref(host));
        ok(hprt_copy_async(p, d, h, 4 * n, s));
        ok(hprt_all_reduce(
            p,
            comm,
            dev,
            0,
            dev,
            0,
            n,
            HprtDtype::F32 as i32,
            HprtReduceOp::Sum as i32,
            s,
        ));
        ok(hprt_copy_async(p, h, d, 4 * n, s));
        ok(hprt_stream_synchronize(p, s));
        for (i, v) in vals.iter().enumerate() {
            let want: usize = (0..world).map(|r| r * n + i).sum();
            assert_eq!(*v, want as f32, "rank {rank} element {i}");
        }
        ok(hprt_comm_destroy(p, comm));
        ok(hprt_device_free(p, dev));
        ok(hprt_pinned_free(p, host));
        ok(hprt_stream_destroy(p, s));
    }
}
