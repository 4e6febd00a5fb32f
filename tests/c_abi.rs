//! The C ABI from Rust, through the same `extern "C"` functions a C program links: status codes,
//! the thread-local message, panics stopped at the boundary, and data really moving.
//!
//! (Over 800 lines because it is one test binary for the whole C surface except hsdp — which is
//! `c_abi_hsdp.rs` — in sections following src/ffi's modules.)

use std::ffi::CStr;
use std::ptr;

use hprt::ffi::*;

mod common;
use common::*;

#[test]
fn a_panic_becomes_a_status_and_a_message() {
    assert_eq!(hprt_debug_forced_panic(), HprtStatus::ErrorPanic);
    let msg = last_error();
    assert!(msg.contains("hprt_debug_forced_panic"), "{msg}");
    // The thread keeps working after the caught panic.
    let p = open_cpu();
    // SAFETY: `p` is live and closed once.
    ok(unsafe { hprt_platform_close(p) });
}

/// ISSUE 31 item 2: a C program asks what the platform can do, not which backend it is.
#[test]
fn capabilities_of_the_cpu_backend() {
    let p = open_cpu();
    let mut c = std::mem::MaybeUninit::<HprtCapabilities>::uninit();
    // SAFETY: live platform, valid out-pointer (written on success).
    let c = unsafe {
        ok(hprt_platform_capabilities(p, c.as_mut_ptr()));
        c.assume_init()
    };
    assert!(c.device_memory_is_host && c.host_stream && c.configurable_devices);
    assert!(c.checked_stream_handles);
    assert!(c.ranks_are_threads && c.ranks_share_device && !c.kernel_compiler);
    // SAFETY: a static NUL-terminated string.
    let device = unsafe { CStr::from_ptr(c.framework_device) };
    assert_eq!(device.to_str().unwrap(), "cpu");
    // SAFETY: a null out-pointer is refused; `p` is live and closed once.
    unsafe {
        expect(
            hprt_platform_capabilities(p, ptr::null_mut()),
            HprtStatus::ErrorNullArgument,
        );
        ok(hprt_platform_close(p));
    }
}

#[test]
fn bad_arguments_are_typed_errors() {
    let mut out = ptr::null_mut();
    // SAFETY: null request (HP_PLATFORM) is allowed; a bogus name is an error, not UB.
    let s = unsafe { hprt_platform_open(c"gpu9000".as_ptr(), &mut out) };
    assert_eq!(s, HprtStatus::ErrorInvalidValue);
    assert!(last_error().contains("gpu9000"), "{}", last_error());
    assert!(out.is_null(), "out-pointers are written only on success");
    for name in [c"", c"CPU ", c" cpu"] {
        // SAFETY: as above.
        let s = unsafe { hprt_platform_open(name.as_ptr(), &mut out) };
        assert_eq!(s, HprtStatus::ErrorInvalidValue, "{name:?}");
        assert!(out.is_null());
    }

    let p = open_cpu();
    // SAFETY: null out-pointer and null handles must be reported, not dereferenced.
    unsafe {
        assert_eq!(
            hprt_stream_create(p, ptr::null_mut()),
            HprtStatus::ErrorNullArgument
        );
        assert_eq!(
            hprt_stream_synchronize(p, ptr::null()),
            HprtStatus::ErrorNullArgument
        );
        let mut b = ptr::null_mut();
        ok(hprt_device_alloc(p, 64, &mut b));
        let mut s = ptr::null_mut();
        ok(hprt_stream_create(p, &mut s));
        let mut comm = ptr::null_mut();
        let mut id = [0u8; HPRT_UNIQUE_ID_MAX_BYTES];
        let mut len = 0;
        ok(hprt_unique_id(p, id.as_mut_ptr(), id.len(), &mut len));
        ok(hprt_comm_init(p, id.as_ptr(), len, 0, 1, &mut comm));
        // 42 is no HprtDtype: rejected before anything is queued.
        let st = hprt_all_reduce(p, comm, b, 0, b, 0, 4, 42, HprtReduceOp::Sum as i32, s);
        assert_eq!(st, HprtStatus::ErrorInvalidValue);
        assert!(last_error().contains("42"), "{}", last_error());
        // Past the end of the buffer: the platform's own typed error comes through.
        let st = hprt_all_reduce(
            p,
            comm,
            b,
            0,
            b,
            0,
            17,
            HprtDtype::F32 as i32,
            HprtReduceOp::Sum as i32,
            s,
        );
        assert_eq!(st, HprtStatus::ErrorOutOfRange, "{}", last_error());
        let name = CStr::from_ptr(hprt_status_name(st as i32));
        assert_eq!(name.to_str().unwrap(), "HPRT_STATUS_ERROR_OUT_OF_RANGE");
        assert_eq!(
            CStr::from_ptr(hprt_status_name(999)).to_str().unwrap(),
            "HPRT_STATUS_UNKNOWN"
        );
        ok(hprt_comm_destroy(p, comm));
        ok(hprt_device_free(p, b));
        ok(hprt_stream_destroy(p, s));
        ok(hprt_platform_close(p));
    }
}

#[test]
fn messages_are_per_thread() {
    // SAFETY: null out-pointer is reported.
    let s = unsafe { hprt_platform_open(c"cpu".as_ptr(), ptr::null_mut()) };
    assert_eq!(s, HprtStatus::ErrorNullArgument);
    let here = last_error();
    let there = std::thread::spawn(last_error).join().unwrap();
    assert!(here.contains("out_platform"), "{here}");
    assert_eq!(there, "", "another thread's message leaked");
}

#[test]
fn pinned_wait_orders_host_access_after_queued_copies() {
    let p = open_cpu();
    let n = 64 * 1024;
    // SAFETY: every handle below is made here, used while live and released once; the pinned
    // address is used for its `n` bytes while the buffer lives.
    unsafe {
        let (mut s, mut dev, mut host) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
        ok(hprt_stream_create(p, &mut s));
        ok(hprt_device_alloc(p, n, &mut dev));
        ok(hprt_pinned_alloc(p, n, &mut host));
        let mut hp = ptr::null_mut();
        ok(hprt_pinned_info(host, &mut hp, ptr::null_mut()));
        let bytes = std::slice::from_raw_parts_mut(hp.cast::<u8>(), n);
        let (d, h) = (
            HprtMemRef {
                device: dev,
                pinned: ptr::null(),
                offset: 0,
            },
            HprtMemRef {
                device: ptr::null(),
                pinned: host,
                offset: 0,
            },
        );
        for round in 1..=8u8 {
            ok(hprt_memset_async(p, dev, 0, round, n, s));
            ok(hprt_copy_async(p, h, d, n, s));
            ok(hprt_pinned_wait(host));
            assert!(bytes.iter().all(|&b| b == round), "round {round}");
        }
        ok(hprt_device_free(p, dev));
        ok(hprt_pinned_free(p, host));
        ok(hprt_stream_destroy(p, s));
        ok(hprt_platform_close(p));
    }
}

#[test]
fn copies_and_an_all_reduce_across_threads() {
    let p = open_cpu();
    let world = 3usize;
    let mut id = [0u8; HPRT_UNIQUE_ID_MAX_BYTES];
    let mut len = 0;
    // SAFETY: `id` has the capacity passed.
    ok(unsafe { hprt_unique_id(p, id.as_mut_ptr(), id.len(), &mut len) });
    let pa = p as usize;
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            std::thread::spawn(move || {
                let p = pa as *const HprtPlatform;
                let n = 1000usize;
                // SAFETY: every handle below is made here, used while live and released once.
                unsafe {
                    let (mut s, mut comm, mut dev, mut host) = (
                        ptr::null_mut(),
                        ptr::null_mut(),
                        ptr::null_mut(),
                        ptr::null_mut(),
                    );
                    ok(hprt_stream_create(p, &mut s));
                    ok(hprt_comm_init(p, id.as_ptr(), len, rank, world, &mut comm));
                    ok(hprt_device_alloc(p, 4 * n, &mut dev));
                    ok(hprt_pinned_alloc(p, 4 * n, &mut host));
                    let mut hp = ptr::null_mut();
                    ok(hprt_pinned_info(host, &mut hp, ptr::null_mut()));
                    let vals = std::slice::from_raw_parts_mut(hp.cast::<f32>(), n);
                    for (i, v) in vals.iter_mut().enumerate() {
                        *v = (rank * n + i) as f32;
                    }
                    let d = HprtMemRef {
                        device: dev,
                        pinned: ptr::null(),
                        offset: 0,
                    };
                    let h = HprtMemRef {
                        device: ptr::null(),
                        pinned: host,
                        offset: 0,
                    };
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
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let mut stats = HprtMemoryStats::default();
    let mut devices = 0;
    // SAFETY: live platform, valid out-pointers; device 0 exists, device `devices` does not.
    unsafe {
        ok(hprt_device_count(p, &mut devices));
        ok(hprt_set_device(p, 0));
        assert_eq!(
            hprt_set_device(p, devices),
            HprtStatus::ErrorInvalidValue,
            "{}",
            last_error()
        );
        ok(hprt_platform_synchronize(p));
        ok(hprt_platform_memory_stats(p, &mut stats));
    }
    assert_eq!(stats.device_current, 0, "every buffer was freed");
    assert!(stats.device_peak >= 3 * 4000);
    // SAFETY: closed once, after every object made from it.
    ok(unsafe { hprt_platform_close(p) });
}

#[test]
fn layer_group_swap_through_the_c_abi() {
    let p = open_cpu();
    let layers = 4usize;
    let bytes = 64 * 1024;
    // SAFETY: every handle is made here, used while live and released once.
    unsafe {
        let (mut s, mut m) = (ptr::null_mut(), ptr::null_mut());
        ok(hprt_stream_create(p, &mut s));
        ok(hprt_swap_manager_create(p, 0, &mut m));
        let mut ids = Vec::new();
        for _ in 0..layers {
            let mut l = 0;
            ok(hprt_swap_new_layer(m, &mut l));
            ids.push(l);
        }
        for w in ids.windows(2) {
            ok(hprt_swap_set_forward_prefetch_layer(m, w[0], w[1]));
        }
        let mut host = ptr::null_mut();
        ok(hprt_pinned_alloc(p, bytes, &mut host));
        let mut hp = ptr::null_mut();
        ok(hprt_pinned_info(host, &mut hp, ptr::null_mut()));
        let hslice = std::slice::from_raw_parts_mut(hp.cast::<u8>(), bytes);
        let mut bufs = Vec::new();
        let mut refs = Vec::new();
        for (i, &l) in ids.iter().enumerate() {
            ok(hprt_swap_forward_pre(m, l));
            let mut b = ptr::null_mut();
            ok(hprt_device_alloc(p, bytes, &mut b));
            hslice.fill(i as u8 + 1);
            let (d, h) = (
                HprtMemRef {
                    device: b,
                    pinned: ptr::null(),
                    offset: 0,
                },
                HprtMemRef {
                    device: ptr::null(),
                    pinned: host,
                    offset: 0,
                },
            );
            ok(hprt_copy_async(p, d, h, bytes, s));
            ok(hprt_stream_synchronize(p, s));
            let mut r = HprtSavedRef::default();
            // Save the second half as a view: only its bytes come back.
            ok(hprt_swap_save(
                m,
                b,
                bytes / 2,
                bytes / 2,
                HprtDtype::U8 as i32,
                &mut r,
            ));
            ok(hprt_swap_forward_post(m, l, s));
            bufs.push(b);
            refs.push(r);
        }
        // Layer 0 is offloaded and its device bytes released: reading it is a state error.
        let mut addr = 0;
        let st = hprt_swap_get(m, refs[0], &mut addr);
        assert_eq!(st, HprtStatus::ErrorWrongState, "{}", last_error());
        let mut stats = HprtSwapStats::default();
        ok(hprt_swap_stats(m, &mut stats));
        assert_eq!(stats.offloaded_tensors, (layers - 1) as u64);
        let mut mem = HprtMemoryStats::default();
        ok(hprt_platform_memory_stats(p, &mut mem));
        assert!(
            mem.device_current <= 2 * bytes,
            "{} bytes still on the device",
            mem.device_current
        );
        for (i, &l) in ids.iter().enumerate().rev() {
            ok(hprt_swap_backward_pre(m, l, s));
            ok(hprt_swap_get(m, refs[i], &mut addr));
            let mut info = 0;
            ok(hprt_device_info(bufs[i], &mut info, ptr::null_mut()));
            assert_eq!(addr, info + bytes / 2);
            let (d, h) = (
                HprtMemRef {
                    device: bufs[i],
                    pinned: ptr::null(),
                    offset: bytes / 2,
                },
                HprtMemRef {
                    device: ptr::null(),
                    pinned: host,
                    offset: 0,
                },
            );
            ok(hprt_copy_async(p, h, d, bytes / 2, s));
            ok(hprt_stream_synchronize(p, s));
            assert!(
                hslice[..bytes / 2].iter().all(|&b| b == i as u8 + 1),
                "layer {i} came back wrong"
            );
            ok(hprt_swap_backward_post(m, l));
        }
        ok(hprt_swap_end_iteration(m));
        ok(hprt_swap_manager_destroy(m));
        for b in bufs {
            ok(hprt_device_free(p, b));
        }
        ok(hprt_pinned_free(p, host));
        ok(hprt_stream_destroy(p, s));
        ok(hprt_platform_close(p));
    }
}

/// The test framework behind an `HprtAllocator`: device buffers it allocates, how many of its
/// owner tokens hprt released. With `stream`, it is a caching allocator: the memory it hands out
/// is still written by work queued there (a long fill of `busy`, then 0xEE over the block, as a
/// freed tensor's last kernels would), and `HprtAllocator.ready_on` names that stream.
struct Framework {
    p: *mut HprtPlatform,
    buffers: Vec<*mut HprtDeviceBuffer>,
    released: std::sync::atomic::AtomicUsize,
    fail_next: bool,
    stream: *mut HprtStream,
    busy: *mut HprtDeviceBuffer,
}

unsafe extern "C" fn framework_allocate(
    user: *mut std::ffi::c_void,
    bytes: usize,
    out_ptr: *mut usize,
    out_owner: *mut *mut std::ffi::c_void,
) -> i32 {
    // SAFETY: `user` is the test's `Framework`, used by one thread at a time here.
    let fw = unsafe { &mut *user.cast::<Framework>() };
    if std::mem::take(&mut fw.fail_next) {
        return 2; // out of memory
    }
    let mut b = ptr::null_mut();
    // SAFETY: a live platform and valid out-pointers.
    unsafe {
        ok(hprt_device_alloc(fw.p, bytes, &mut b));
        ok(hprt_device_info(b, out_ptr, ptr::null_mut()));
        *out_owner = b.cast();
        if !fw.stream.is_null() {
            ok(hprt_memset_async(
                fw.p, fw.busy, 0, 1, BUSY_BYTES, fw.stream,
            ));
            ok(hprt_memset_async(fw.p, b, 0, 0xEE, bytes, fw.stream));
        }
    }
    fw.buffers.push(b);
    0
}

/// A fill long enough (tens of ms on the cpu backend) for a reload that does not wait for it to
/// land first.
const BUSY_BYTES: usize = 256 << 20;

unsafe extern "C" fn framework_release(user: *mut std::ffi::c_void, _owner: *mut std::ffi::c_void) {
    // SAFETY: only the atomic counter is touched (release may run on a stream thread).
    let fw = unsafe { &*user.cast::<Framework>() };
    fw.released
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

#[test]
fn borrowed_and_compressed_group_swap_through_the_c_abi() {
    use std::sync::atomic::Ordering;
    let p = open_cpu();
    let n = 4096usize;
    let data: Vec<u8> = (0..n as u32)
        .flat_map(|i| ((i % 50) as f32 * 0.25).to_le_bytes())
        .collect();
    let bytes = data.len();
    // SAFETY: every handle is made here, used while live and released once.
    unsafe {
        let (mut s, mut m) = (ptr::null_mut(), ptr::null_mut());
        ok(hprt_stream_create(p, &mut s));
        ok(hprt_swap_manager_create(p, 0, &mut m));
        ok(hprt_swap_set_compression(
            m,
            HprtCompression::HostStage as i32,
        ));
        let mut busy = ptr::null_mut();
        ok(hprt_device_alloc(p, BUSY_BYTES, &mut busy));
        let mut fw = Framework {
            p,
            buffers: Vec::new(),
            released: Default::default(),
            fail_next: false,
            stream: s,
            busy,
        };
        let alloc = HprtAllocator {
            user_data: (&mut fw as *mut Framework).cast(),
            allocate: Some(framework_allocate),
            release: Some(framework_release),
            ready_on: s,
        };
        // The framework's tensor.
        let mut orig = ptr::null_mut();
        ok(hprt_device_alloc(p, bytes, &mut orig));
        let mut host = ptr::null_mut();
        ok(hprt_pinned_alloc(p, bytes, &mut host));
        let mut hp = ptr::null_mut();
        ok(hprt_pinned_info(host, &mut hp, ptr::null_mut()));
        let hslice = std::slice::from_raw_parts_mut(hp.cast::<u8>(), bytes);
        hslice.copy_from_slice(&data);
        let mem = |b, pinned| {
            if pinned {
                HprtMemRef {
                    device: ptr::null(),
                    pinned: host,
                    offset: 0,
                }
            } else {
                HprtMemRef {
                    device: b,
                    pinned: ptr::null(),
                    offset: 0,
                }
            }
        };
        ok(hprt_copy_async(
            p,
            mem(orig, false),
            mem(orig, true),
            bytes,
            s,
        ));
        ok(hprt_stream_synchronize(p, s));
        let mut addr = 0;
        ok(hprt_device_info(orig, &mut addr, ptr::null_mut()));
        // hyper_parallel's current group name: none yet, then the one set.
        let mut name = [0 as std::ffi::c_char; 8];
        let mut len = usize::MAX;
        ok(hprt_swap_get_current_group_name(
            m,
            name.as_mut_ptr(),
            8,
            &mut len,
        ));
        assert_eq!((len, name[0]), (0, 0));
        ok(hprt_swap_set_current_group_name(m, c"layer0".as_ptr()));
        ok(hprt_swap_get_current_group_name(
            m,
            name.as_mut_ptr(),
            8,
            &mut len,
        ));
        assert_eq!(std::ffi::CStr::from_ptr(name.as_ptr()), c"layer0");
        assert_eq!(len, 6);
        assert_eq!(
            hprt_swap_get_current_group_name(m, name.as_mut_ptr(), 6, &mut len),
            HprtStatus::ErrorBufferTooSmall
        );
        assert_eq!(len, 6, "the length is reported to size the buffer");
        let mut r = HprtSavedRef::default();
        let g = c"layer0".as_ptr();
        ok(hprt_swap_add_borrowed(
            m,
            p,
            g,
            addr,
            bytes,
            HprtDtype::F32 as i32,
            orig.cast(),
            alloc,
            &mut r,
        ));
        ok(hprt_swap_launch_offload(m, g, s));
        ok(hprt_swap_wait_offload(m, g));
        assert_eq!(
            fw.released.load(Ordering::SeqCst),
            1,
            "the framework got its memory back"
        );
        // The framework is out of memory once: the host copy stays for the retry.
        fw.fail_next = true;
        assert_eq!(
            hprt_swap_launch_load(m, g),
            HprtStatus::ErrorOutOfMemory,
            "{}",
            last_error()
        );
        ok(hprt_swap_launch_load(m, g));
        ok(hprt_swap_wait_load(m, g, s));
        let (mut back, mut owner) = (0usize, ptr::null_mut());
        ok(hprt_swap_get_borrowed(m, r, &mut back, &mut owner));
        let reloaded: *mut HprtDeviceBuffer = owner.cast();
        assert_eq!(reloaded, fw.buffers[0]);
        hslice.fill(0);
        ok(hprt_copy_async(
            p,
            mem(reloaded, true),
            mem(reloaded, false),
            bytes,
            s,
        ));
        ok(hprt_stream_synchronize(p, s));
        assert!(
            hslice == &data[..],
            "the reload landed in the framework's new memory, after the work queued on its stream"
        );
        let mut stats = HprtSwapStats::default();
        ok(hprt_swap_stats(m, &mut stats));
        assert_eq!(stats.compressed_tensors, 1);
        ok(hprt_swap_end_iteration(m));
        ok(hprt_swap_manager_destroy(m));
        assert_eq!(
            fw.released.load(Ordering::SeqCst),
            2,
            "the reloaded memory went back too"
        );
        ok(hprt_device_free(p, orig));
        for b in fw.buffers.drain(..) {
            ok(hprt_device_free(p, b));
        }
        ok(hprt_device_free(p, busy));
        ok(hprt_pinned_free(p, host));
        ok(hprt_stream_destroy(p, s));
        ok(hprt_platform_close(p));
    }
}

/// `n` bytes of a device buffer filled with `v`, through pinned memory.
///
/// # Safety
/// `p`, `s` live.
unsafe fn filled_buffer(
    p: *mut HprtPlatform,
    s: *mut HprtStream,
    n: usize,
    v: u8,
) -> *mut HprtDeviceBuffer {
    // SAFETY: live handles and valid out-pointers.
    unsafe {
        let (mut b, mut h, mut hp) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
        ok(hprt_device_alloc(p, n, &mut b));
        ok(hprt_pinned_alloc(p, n, &mut h));
        ok(hprt_pinned_info(h, &mut hp, ptr::null_mut()));
        std::slice::from_raw_parts_mut(hp.cast::<u8>(), n).fill(v);
        let d = HprtMemRef {
            device: b,
            pinned: ptr::null(),
            offset: 0,
        };
        let hm = HprtMemRef {
            device: ptr::null(),
            pinned: h,
            offset: 0,
        };
        ok(hprt_copy_async(p, d, hm, n, s));
        ok(hprt_stream_synchronize(p, s));
        ok(hprt_pinned_free(p, h));
        b
    }
}

/// The bytes at device address `addr` (on the cpu backend device memory is host memory).
/// `group_start(name)`, then a new `n`-byte buffer filled with `v` saved in the group; returns
/// its tag, the buffer and whether it is to be offloaded.
unsafe fn pipeline_save_group(
    o: *mut HprtPipelineOffload,
    p: *mut HprtPlatform,
    s: *mut HprtStream,
    name: &CStr,
    n: usize,
    v: u8,
) -> (usize, *mut HprtDeviceBuffer, i32) {
    // SAFETY: live handles (the caller's contract) and valid out-pointers.
    unsafe {
        ok(hprt_pipeline_group_start(o, name.as_ptr()));
        let b = filled_buffer(p, s, n, v);
        let (mut tag, mut offloaded) = (0, 0);
        ok(hprt_pipeline_save(
            o,
            b,
            0,
            n,
            HprtDtype::U8 as i32,
            &mut tag,
            &mut offloaded,
        ));
        (tag, b, offloaded)
    }
}

fn bytes_at(addr: usize, n: usize) -> Vec<u8> {
    // SAFETY: a live cpu-backend device allocation of at least `n` bytes, synchronized.
    unsafe { std::slice::from_raw_parts(addr as *const u8, n) }.to_vec()
}

#[test]
fn keyed_and_pipeline_front_ends_through_the_c_abi() {
    let p = open_cpu();
    let n = 8192usize;
    // SAFETY: every handle is made here, used while live and released once.
    unsafe {
        let mut s = ptr::null_mut();
        ok(hprt_stream_create(p, &mut s));
        // Keyed: three layers of two tensors; the last layer stays, the others come back.
        let mut k = ptr::null_mut();
        ok(hprt_keyed_create(p, 0, 0, &mut k));
        ok(hprt_keyed_set_compression(
            k,
            HprtCompression::Device as i32,
        ));
        let mut layers = [0usize; 3];
        for l in &mut layers {
            ok(hprt_keyed_register_layer(k, c"model.layer.*".as_ptr(), l));
        }
        let mut saved = Vec::new();
        for (i, &l) in layers.iter().enumerate() {
            for j in 0..2u8 {
                let v = 10 * i as u8 + j;
                let b = filled_buffer(p, s, n, v);
                let mut key = HprtTensorKey::default();
                ok(hprt_keyed_swap_out_cur_and_release_prev(
                    k,
                    l,
                    b,
                    0,
                    n,
                    HprtDtype::Bf16 as i32,
                    s,
                    &mut key,
                ));
                assert_eq!(key.swapped, 1);
                saved.push((key, b, v));
            }
        }
        for &(key, _, v) in saved.iter().rev() {
            let mut addr = 0;
            ok(hprt_keyed_wait_cur_and_prefetch_next(
                k, key, s, true, &mut addr,
            ));
            ok(hprt_stream_synchronize(p, s));
            assert!(bytes_at(addr, n).iter().all(|&x| x == v), "keyed value {v}");
        }
        let mut st = HprtSwapStats::default();
        ok(hprt_keyed_stats(k, &mut st));
        assert_eq!(
            st.compressed_tensors, 4,
            "two layers of two were compressed"
        );
        ok(hprt_keyed_end_iteration(k));
        ok(hprt_keyed_destroy(k));
        // Pipeline: one chunk of three groups.
        let mut o = ptr::null_mut();
        ok(hprt_pipeline_create(
            p,
            1,
            1,
            1,
            0,
            HprtCompression::Off as i32,
            &mut o,
        ));
        ok(hprt_pipeline_init_chunk(o, 1, 0));
        let names = [c"attn", c"mlp", c"out"];
        let (mut tags, mut extras) = (Vec::new(), Vec::new());
        for (g, name) in names.iter().enumerate() {
            let (tag, b, offloaded) = pipeline_save_group(o, p, s, name, n, 100 + g as u8);
            assert_eq!(offloaded, 1);
            // Megatron's forced released tensors: freed with the group's offload.
            let mut extra = ptr::null_mut();
            ok(hprt_device_alloc(p, 1000, &mut extra));
            let forced = [extra.cast_const()];
            ok(hprt_pipeline_group_commit(o, s, forced.as_ptr(), 1, false));
            tags.push((tag, b));
            extras.push(extra);
        }
        assert_eq!(
            hprt_pipeline_group_commit(o, s, ptr::null(), 1, false),
            HprtStatus::ErrorNullArgument
        );
        for (g, name) in names.iter().enumerate().rev() {
            ok(hprt_pipeline_backward_group_begin(o, name.as_ptr(), s));
            let mut addr = 0;
            ok(hprt_pipeline_get(o, tags[g].0, s, &mut addr));
            ok(hprt_stream_synchronize(p, s));
            assert!(
                bytes_at(addr, n).iter().all(|&x| x == 100 + g as u8),
                "group {g}"
            );
            ok(hprt_pipeline_backward_group_end(o));
        }
        let mut st = HprtSwapStats::default();
        ok(hprt_pipeline_stats(o, &mut st));
        assert!(st.offloaded_tensors >= 2, "{st:?}");
        // One offload in flight at a time: committing a group finished the one before, which
        // released its forced buffer. (The last group's offload may have been taken back
        // before it finished, which keeps its buffer.)
        for (g, &extra) in extras.iter().enumerate() {
            let mut len = usize::MAX;
            ok(hprt_device_info(extra, ptr::null_mut(), &mut len));
            if g < 2 {
                assert_eq!(len, 0, "group {g}'s forced released buffer kept its memory");
            }
            ok(hprt_device_free(p, extra));
        }
        ok(hprt_pipeline_reset(o));
        ok(hprt_pipeline_destroy(o));
        for (_, b, _) in saved {
            ok(hprt_device_free(p, b));
        }
        for (_, b) in tags {
            ok(hprt_device_free(p, b));
        }
        ok(hprt_stream_destroy(p, s));
        ok(hprt_platform_close(p));
    }
}

#[test]
fn tensor_key_manager_and_pipeline_summary_through_the_c_abi() {
    let p = open_cpu();
    let n = 4096usize;
    // SAFETY: every handle is made here, used while live and released once.
    unsafe {
        // hyper_parallel's TensorKeyManager: three tensors in layer 0, two in layer 1.
        let mut km = ptr::null_mut();
        ok(hprt_tensor_key_manager_create(&mut km));
        let (mut index, mut previous_done) = (usize::MAX, true);
        let mut key = |layer| {
            ok(hprt_tensor_key_manager_get_key(
                km,
                layer,
                &mut index,
                &mut previous_done,
            ));
            (index, previous_done)
        };
        assert_eq!(
            [key(0), key(0), key(0)],
            [(0, false), (1, false), (2, false)]
        );
        assert_eq!([key(1), key(1)], [(0, true), (1, false)]);
        let (mut first, mut end) = (usize::MAX, usize::MAX);
        ok(hprt_tensor_key_manager_get_prefetch_keys(
            km, 1, 1, &mut first, &mut end,
        ));
        assert_eq!(
            (first, end),
            (1, 3),
            "layer 1's second tensor prefetches 0.1 and 0.2"
        );
        ok(hprt_tensor_key_manager_get_prefetch_keys(
            km, 0, 0, &mut first, &mut end,
        ));
        assert_eq!(first, end, "layer 0 prefetches nothing");
        ok(hprt_tensor_key_manager_destroy(km));
        assert_eq!(
            hprt_tensor_key_manager_destroy(km),
            HprtStatus::ErrorInvalidHandle
        );

        // Megatron's summary: a warm-up iteration, then one summarized (the last group is kept
        // on the device by the keep-last margin).
        let mut s = ptr::null_mut();
        ok(hprt_stream_create(p, &mut s));
        let mut o = ptr::null_mut();
        ok(hprt_pipeline_create(
            p,
            1,
            1,
            1,
            0,
            HprtCompression::Off as i32,
            &mut o,
        ));
        let names = [c"attn", c"mlp", c"out"];
        for iteration in 0..2 {
            ok(hprt_pipeline_init_chunk(o, 1, 0));
            let mut saved = Vec::new();
            for name in &names {
                let (tag, b, _) = pipeline_save_group(o, p, s, name, n, 1);
                ok(hprt_pipeline_group_commit(o, s, ptr::null(), 0, false));
                saved.push((tag, b));
            }
            for (g, name) in names.iter().enumerate().rev() {
                ok(hprt_pipeline_backward_group_begin(o, name.as_ptr(), s));
                let mut addr = 0;
                ok(hprt_pipeline_get(o, saved[g].0, s, &mut addr));
                ok(hprt_pipeline_backward_group_end(o));
            }
            if iteration == 0 {
                ok(hprt_pipeline_post_warmup(o));
            }
            ok(hprt_pipeline_reset(o));
            for (_, b) in saved {
                ok(hprt_device_free(p, b));
            }
        }
        let mut text = vec![0 as std::ffi::c_char; 256];
        let mut len = 0;
        ok(hprt_pipeline_summary_table(
            o,
            text.as_mut_ptr(),
            text.len(),
            &mut len,
        ));
        let table = std::ffi::CStr::from_ptr(text.as_ptr()).to_str().unwrap();
        assert_eq!(
            table,
            "| rank | attn | mlp | total |\n|---:|---:|---:|---:|\n| 0 | 4096 | 4096 | 8192 |\n"
        );
        assert_eq!(len, table.len());
        assert_eq!(
            hprt_pipeline_summary_table(o, text.as_mut_ptr(), 8, &mut len),
            HprtStatus::ErrorBufferTooSmall
        );
        assert_eq!(len, table.len(), "the length sizes the buffer");
        ok(hprt_pipeline_destroy(o));
        ok(hprt_stream_destroy(p, s));
        ok(hprt_platform_close(p));
    }
}

#[test]
fn pipeline_last_layer_prefetch_and_stream_marks_through_the_c_abi() {
    let p = open_cpu();
    let n = 4096usize;
    // SAFETY: every handle is made here, used while live and released once.
    unsafe {
        let mut s = ptr::null_mut();
        ok(hprt_stream_create(p, &mut s));
        let mut o = ptr::null_mut();
        ok(hprt_pipeline_create(
            p,
            1,
            1,
            1,
            0,
            HprtCompression::Off as i32,
            &mut o,
        ));
        ok(hprt_pipeline_init_chunk(o, 1, 0));
        let names = [c"a", c"b", c"last"];
        let mut saved = Vec::new();
        for (g, name) in names.iter().enumerate() {
            // Megatron's last layer: its group stays on the device for the backward next.
            ok(hprt_pipeline_set_last_layer(o, g == names.len() - 1));
            let (tag, b, _) = pipeline_save_group(o, p, s, name, n, 7 + g as u8);
            ok(hprt_pipeline_record_forward(o, s));
            ok(hprt_pipeline_group_commit(o, s, ptr::null(), 0, false));
            ok(hprt_pipeline_join_offloads(o, s));
            saved.push((tag, b));
        }
        ok(hprt_stream_synchronize(p, s));
        let mut st = HprtSwapStats::default();
        ok(hprt_pipeline_stats(o, &mut st));
        assert_eq!(
            st.offloaded_tensors, 2,
            "the last layer's group stayed: {st:?}"
        );
        // A framework's own prefetch starts group "a"'s reload before its backward.
        let mut started = 0;
        ok(hprt_pipeline_prefetch(o, saved[0].0, &mut started));
        assert_eq!(started, 1);
        ok(hprt_pipeline_prefetch(o, saved[0].0, &mut started));
        assert_eq!(started, 0, "already reloading");
        assert_eq!(
            hprt_pipeline_prefetch(o, 999, &mut started),
            HprtStatus::ErrorInvalidValue
        );
        for (g, name) in names.iter().enumerate().rev() {
            ok(hprt_pipeline_backward_group_begin(o, name.as_ptr(), s));
            let mut addr = 0;
            ok(hprt_pipeline_get(o, saved[g].0, s, &mut addr));
            ok(hprt_pipeline_record_backward(o, s));
            ok(hprt_stream_synchronize(p, s));
            assert!(
                bytes_at(addr, n).iter().all(|&x| x == 7 + g as u8),
                "group {g}"
            );
            ok(hprt_pipeline_backward_group_end(o));
        }
        ok(hprt_pipeline_reset(o));
        for (_, b) in saved {
            ok(hprt_device_free(p, b));
        }
        ok(hprt_pipeline_destroy(o));
        ok(hprt_stream_destroy(p, s));
        ok(hprt_platform_close(p));
    }
}
