//! Data really moving through the C ABI: pinned waits after queued copies, device copies
//! and an all-reduce across threads.

use super::*;

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
