//! Small device and pinned capacities, handles that stay with their platform value, raw and
//! host streams, and devices with separate accounting.

use super::*;

#[test]
fn small_device_capacity() {
    const CAP: usize = 1 << 20;
    const A: usize = 600 << 10;
    let p = cpu(CpuConfig {
        device_memory: CAP,
        ..CpuConfig::default()
    });
    let info = p.mem_info().unwrap();
    assert_eq!((info.free, info.total), (CAP, CAP));
    let a = p.alloc_device(A).unwrap();
    let e = p
        .alloc_device(A)
        .expect_err("second 600 KiB allocation in 1 MiB succeeded");
    assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}");
    let s = p.memory_stats();
    assert_eq!(
        (s.device_current, s.device_allocations, s.device_peak),
        (A, 1, A)
    );
    assert_eq!(p.mem_info().unwrap().free, CAP - A);
    p.free_device(&a).unwrap();
    let b = p
        .alloc_device(A)
        .expect("allocation after freeing the first");
    let c = p.alloc_device(300 << 10).unwrap();
    let s = p.memory_stats();
    assert_eq!(s.device_current, A + (300 << 10));
    assert_eq!(s.device_peak, A + (300 << 10));
    // Resize within capacity works; beyond it fails and keeps the buffer.
    assert_eq!(kind(p.resize_device(&b, CAP)), Some(ErrorKind::OutOfMemory));
    assert_eq!(b.len(), A);
    p.resize_device(&b, 0).unwrap();
    p.resize_device(&c, 700 << 10).unwrap();
    assert_eq!(p.memory_stats().device_current, 700 << 10);
    drop((b, c));
    let s = p.memory_stats();
    assert_eq!((s.device_current, s.device_allocations), (0, 0));
    // Resize allocates the new storage before releasing the old: 300 KiB + 700 KiB at once.
    assert_eq!(s.device_peak, 1000 << 10);
    p.reset_peak_memory();
    assert_eq!(p.memory_stats().device_peak, 0);
}

#[test]
fn small_pinned_capacity() {
    const CAP: usize = 1 << 20;
    const A: usize = 600 << 10;
    let p = cpu(CpuConfig {
        pinned_memory: Some(CAP),
        ..CpuConfig::default()
    });
    let a = p.alloc_pinned(A).unwrap();
    let e = p
        .alloc_pinned(A)
        .expect_err("second 600 KiB pinned allocation in 1 MiB succeeded");
    assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}");
    let s = p.memory_stats();
    assert_eq!(
        (s.pinned_current, s.pinned_allocations, s.pinned_peak),
        (A, 1, A)
    );
    p.free_pinned(&a).unwrap();
    let _b = p
        .alloc_pinned(A)
        .expect("pinned allocation after freeing the first");
    assert_eq!(p.memory_stats().pinned_peak, A);
    // The staging buffer of write_device_sync counts too.
    let s = p.create_stream().unwrap();
    let d = p.alloc_device(A).unwrap();
    let e = p
        .write_device_sync(&d, 0, &vec![1u8; A], &s)
        .expect_err("staging beyond the pinned limit");
    assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}");
}

#[test]
fn handles_do_not_cross_platform_values() {
    let a = cpu(CpuConfig::default());
    let b = cpu(CpuConfig::default());
    let sa = a.create_stream().unwrap();
    let sb = b.create_stream().unwrap();
    let da = a.alloc_device(64).unwrap();
    let db = b.alloc_device(64).unwrap();
    let ha = a.alloc_pinned(64).unwrap();
    let ea = a.create_event(true).unwrap();
    let ia = a.unique_id().unwrap();
    let ca = a.comm_init(&ia, 0, 1).unwrap();
    let ih = ErrorKind::InvalidHandle;
    assert_eq!(kind(b.synchronize_stream(&sa)), Some(ih));
    assert_eq!(kind(b.query_stream(&sa)), Some(ih));
    assert_eq!(kind(b.destroy_stream(&sa)), Some(ih));
    assert_eq!(
        kind(b.copy_async((&db).into(), 0, (&ha).into(), 0, 64, &sb)),
        Some(ih)
    );
    assert_eq!(
        kind(b.copy_async((&db).into(), 0, (&da).into(), 0, 64, &sb)),
        Some(ih)
    );
    assert_eq!(kind(b.memset_async(&da, 0, 0, 64, &sb)), Some(ih));
    assert_eq!(kind(b.free_device(&da)), Some(ih));
    assert_eq!(kind(b.free_pinned(&ha)), Some(ih));
    assert_eq!(kind(b.resize_device(&da, 0)), Some(ih));
    assert_eq!(kind(b.record_event(&ea, &sb)), Some(ih));
    assert_eq!(kind(b.query_event(&ea)), Some(ih));
    assert_eq!(kind(b.destroy_event(&ea)), Some(ih));
    assert_eq!(kind(b.barrier(&ca, &sb)), Some(ih));
    assert_eq!(kind(b.destroy_comm(&ca)), Some(ih));
    assert_eq!(
        kind(b.comm_init(&ia, 0, 1)),
        Some(ErrorKind::InvalidValue),
        "a unique id of another platform value was accepted"
    );
    // Nothing was harmed on the owner.
    a.copy_async((&da).into(), 0, (&ha).into(), 0, 64, &sa)
        .unwrap();
    a.barrier(&ca, &sa).unwrap();
    a.synchronize_stream(&sa).unwrap();
    assert!(sa.is_live() && !da.is_freed() && ea.is_live() && ca.is_live());
}

#[test]
fn wrapping_an_unknown_raw_stream_is_refused() {
    let p = cpu(CpuConfig::default());
    // SAFETY: the cpu backend looks raw handles up in its own table and never dereferences them.
    let r = unsafe { p.wrap_external_stream(RawStream(987_654)) };
    assert_eq!(kind(r), Some(ErrorKind::InvalidHandle));
    let s = p.create_stream().unwrap();
    let raw = s.raw();
    p.destroy_stream(&s).unwrap();
    // SAFETY: as above.
    let r = unsafe { p.wrap_external_stream(raw) };
    assert_eq!(
        kind(r),
        Some(ErrorKind::InvalidHandle),
        "wrapped a destroyed stream"
    );
}

fn host_stream(p: &CpuBackend) -> hprt_platform::Stream {
    // SAFETY: raw stream 0 is the cpu backend's host stream, alive as long as the platform.
    unsafe { p.wrap_external_stream(RawStream(hprt_platform::CPU_HOST_STREAM)) }.unwrap()
}

#[test]
fn the_host_stream_waits_for_events_in_the_calling_thread() {
    let p = jittered(5);
    let host = host_stream(&p);
    // Its copies run as they are queued: without the event wait they read before the jittered
    // upload, with it the caller blocks until the upload is done.
    assert!(
        race_onto(&p, &host, false, 40) > 0,
        "the jitter never exposed the missing wait"
    );
    assert_eq!(race_onto(&p, &host, true, 40), 0);
    // A mark recorded on it is reached at once, so a worker stream waiting for it never blocks.
    let ev = p.create_event(false).unwrap();
    p.record_event(&ev, &host).unwrap();
    assert!(p.query_event(&ev).unwrap());
    assert!(p.query_stream(&host).unwrap());
    // It is nobody's to destroy: destroying a wrapper leaves it usable.
    p.destroy_stream(&host).unwrap();
    let again = host_stream(&p);
    p.record_event(&ev, &again).unwrap();
    p.synchronize_stream(&again).unwrap();
    p.synchronize_device().unwrap();
}

#[test]
fn the_host_stream_reports_an_error_it_waited_for() {
    let p = cpu(CpuConfig::default());
    let host = host_stream(&p);
    let worker = p.create_stream().unwrap();
    let ev = p.create_event(false).unwrap();
    p.launch_host_fn(&worker, Box::new(|| panic!("a failing job")))
        .unwrap();
    p.record_event(&ev, &worker).unwrap();
    p.stream_wait_event(&host, &ev).unwrap();
    // Reported (once) by the host stream's synchronize, as a worker stream's would be.
    assert_eq!(kind(p.synchronize_stream(&host)), Some(ErrorKind::Internal));
    p.synchronize_stream(&host).unwrap();
    let _ = p.synchronize_stream(&worker);
}

#[test]
fn set_device_out_of_range() {
    let p = cpu(CpuConfig::default());
    assert_eq!(p.device_count(), 1);
    assert_eq!(kind(p.set_device(1)), Some(ErrorKind::InvalidValue));
    assert_eq!(
        kind(p.set_device(usize::MAX)),
        Some(ErrorKind::InvalidValue)
    );
    p.set_device(0).unwrap();
    assert_eq!(p.current_device(), 0);
}

#[test]
fn devices_keep_separate_accounting() {
    const CAP: usize = 1 << 20;
    let p = cpu(CpuConfig {
        devices: 2,
        device_memory: CAP,
        ..CpuConfig::default()
    });
    assert_eq!(p.device_count(), 2);
    assert_eq!(p.info().devices.len(), 2);
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let p = &p;
    std::thread::scope(|scope| {
        let on_one = scope.spawn(move || {
            p.set_device(1).unwrap();
            assert_eq!(p.current_device(), 1);
            let d = p.alloc_device(700 << 10).unwrap();
            let s = p.memory_stats();
            assert_eq!((s.device_current, s.device_allocations), (700 << 10, 1));
            assert_eq!(p.mem_info().unwrap().free, CAP - (700 << 10));
            // Device 1 is nearly full; device 0 is not affected (checked by the main thread).
            assert_eq!(
                kind(p.alloc_device(400 << 10)),
                Some(ErrorKind::OutOfMemory)
            );
            ready_tx.send(()).unwrap();
            done_rx.recv().unwrap();
            drop(d);
            assert_eq!(p.memory_stats().device_current, 0);
        });
        ready_rx.recv().unwrap();
        // This thread never chose a device: it is on device 0.
        assert_eq!(p.current_device(), 0);
        let s = p.memory_stats();
        assert_eq!((s.device_current, s.device_allocations), (0, 0));
        let d0 = p
            .alloc_device(900 << 10)
            .expect("device 0 has its own capacity");
        assert_eq!(p.memory_stats().device_current, 900 << 10);
        drop(d0);
        done_tx.send(()).unwrap();
        on_one.join().unwrap();
    });
    // Devices are per thread: a new thread starts on device 0.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                assert_eq!(p.current_device(), 0);
                p.set_device(1).unwrap();
                assert_eq!(p.current_device(), 1);
            })
            .join()
            .unwrap();
    });
    assert_eq!(p.current_device(), 0);
}
