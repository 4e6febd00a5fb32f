//! Layer-group swap through the C ABI: owned buffers, then borrowed ones from a framework's
//! `HprtAllocator` (a caching one whose memory is still written on its stream) and compressed.

use super::*;

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
        let hslice = pinned_slice::<u8>(host, bytes);
        let mut bufs = Vec::new();
        let mut refs = Vec::new();
        for (i, &l) in ids.iter().enumerate() {
            ok(hprt_swap_forward_pre(m, l));
            let mut b = ptr::null_mut();
            ok(hprt_device_alloc(p, bytes, &mut b));
            hslice.fill(i as u8 + 1);
            let (d, h) = (device_ref(b, 0), pinned_ref(host));
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
            let (d, h) = (device_ref(bufs[i], bytes / 2), pinned_ref(host));
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
        close_with_stream(p, s);
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
        let hslice = pinned_slice::<u8>(host, bytes);
        hslice.copy_from_slice(&data);
        ok(hprt_copy_async(
            p,
            device_ref(orig, 0),
            pinned_ref(host),
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
            pinned_ref(host),
            device_ref(reloaded, 0),
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
        close_with_stream(p, s);
    }
}
