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
        let (s, dev, host) = (stream(p), device_alloc(p, n), pinned_alloc(p, n));
        let bytes = pinned_slice::<u8>(host, n);
        let (d, h) = (device_ref(dev, 0), pinned_ref(host));
        for round in 1..=8u8 {
            ok(hprt_memset_async(p, dev, 0, round, n, s));
            ok(hprt_copy_async(p, h, d, n, s));
            ok(hprt_pinned_wait(host));
            assert!(bytes.iter().all(|&b| b == round), "round {round}");
        }
        ok(hprt_device_free(p, dev));
        ok(hprt_pinned_free(p, host));
        close_with_stream(p, s);
    }
}

#[test]
fn copies_and_an_all_reduce_across_threads() {
    let p = open_cpu();
    let world = 3usize;
    // SAFETY: `p` is live.
    let (id, len) = unsafe { unique_id(p) };
    let pa = p as usize;
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            std::thread::spawn(move || {
                let p = pa as *const HprtPlatform;
                // SAFETY: the platform outlives the threads; `id` is its unique id.
                unsafe { all_reduce_rank(p, &id[..len], rank, world) };
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
