//! Counts and requests at the limits, and the allocation cache: reuse, turning it off, its
//! bound, and poisoning under jitter.

use super::*;

/// Element counts whose byte size overflows `usize` must be refused at issue. Today the byte
/// extents in `Collective::places` (platform/src/collective.rs) are computed with unchecked
/// `count * size` / `world * count * size` / `count + displ`: a debug build panics, a release
/// build wraps to a small extent that passes the bounds check and the backend then touches
/// `count` elements out of bounds.
#[test]
fn overflowing_collective_counts_are_refused() {
    if !cfg!(debug_assertions) {
        eprintln!(
            "skipped in release builds: there the overflow corrupts memory instead of panicking"
        );
        return;
    }
    let backend = cpu(CpuConfig::default());
    let p: &dyn Platform = &backend;
    let id = p.unique_id().unwrap();
    let comm = p.comm_init(&id, 0, 1).unwrap();
    let s = p.create_stream().unwrap();
    let b = p.alloc_device(256).unwrap();
    let huge = (1usize << 62) + 1; // * 4 bytes wraps to 4
    type Attempt<'a> = Box<dyn Fn() -> hprt_platform::Result<()> + 'a>;
    let attempts: Vec<(&str, Attempt<'_>)> = vec![
        (
            "all_reduce",
            Box::new(|| {
                p.all_reduce(
                    b.at(0),
                    b.at(128),
                    huge,
                    DType::F32,
                    ReduceOp::Sum,
                    &comm,
                    &s,
                )
            }),
        ),
        (
            "all_gather",
            Box::new(|| p.all_gather(b.at(0), b.at(128), huge, DType::F32, &comm, &s)),
        ),
        (
            "broadcast",
            Box::new(|| p.broadcast(b.at(0), huge, DType::F32, 0, &comm, &s)),
        ),
        (
            "all_to_all_v",
            Box::new(|| {
                p.collective(
                    &comm,
                    hprt_platform::Collective::AllToAllV {
                        send: b.at(0),
                        recv: b.at(128),
                        send_counts: vec![1],
                        send_displs: vec![usize::MAX],
                        recv_counts: vec![1],
                        recv_displs: vec![0],
                        dtype: DType::U8,
                    },
                    &s,
                )
            }),
        ),
    ];
    let mut problems = Vec::new();
    for (what, f) in &attempts {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Err(_) => problems.push(format!("{what}: panicked")),
            Ok(Ok(())) => problems.push(format!("{what}: accepted")),
            Ok(Err(e)) if matches!(e.kind(), ErrorKind::OutOfRange | ErrorKind::InvalidValue) => {}
            Ok(Err(e)) => problems.push(format!("{what}: {e}")),
        }
    }
    assert!(
        problems.is_empty(),
        "overflowing counts: {}",
        problems.join("; ")
    );
}

/// A pinned request within 256 bytes of `usize::MAX` (no pinned limit configured): today
/// `CpuMem::alloc` (platform/src/cpu/memory.rs:47) computes `len + ALIGN` unchecked after
/// reserving `len` in the counter. Debug builds panic and never release the reservation, so every
/// later `alloc_pinned` on that platform value fails with OutOfMemory; release builds wrap to a
/// 155-byte allocation handed out as a buffer of `usize::MAX - 100` bytes.
#[test]
fn pinned_request_near_usize_max_is_out_of_memory() {
    let backend = cpu(CpuConfig::default());
    let p: &dyn Platform = &backend;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        p.alloc_pinned(usize::MAX - 100).map(|b| b.len())
    }));
    let after = p.memory_stats();
    let small = p.alloc_pinned(4096).map(|b| b.len());
    match r {
        Err(_) => panic!(
            "alloc_pinned(usize::MAX - 100) panicked; pinned_current is now {}, and a 4 KiB \
             alloc_pinned afterwards gives {small:?}",
            after.pinned_current
        ),
        Ok(Ok(len)) => panic!("alloc_pinned(usize::MAX - 100) returned a buffer of {len} bytes"),
        Ok(Err(e)) => assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}"),
    }
    assert_eq!(
        after.pinned_current, 0,
        "the failed request left bytes reserved"
    );
    assert_eq!(small.map_err(|e| e.to_string()), Ok(4096));
}

#[test]
fn freed_device_blocks_are_reused_without_counting_as_allocated() {
    let p = cpu(CpuConfig {
        device_memory: 8 << 20,
        alloc_cache: 4 << 20,
        ..CpuConfig::default()
    });
    let a = p.alloc_device(3 << 20).unwrap();
    let addr = a.device_ptr();
    p.free_device(&a).unwrap();
    assert_eq!(
        p.memory_stats().device_current,
        0,
        "cached bytes are not allocated"
    );
    // The same size comes back from the cache (LIFO), and the capacity still holds in full.
    let b = p.alloc_device(3 << 20).unwrap();
    assert_eq!(b.device_ptr(), addr, "the freed block was not reused");
    let c = p.alloc_device(5 << 20).unwrap();
    assert_eq!(p.memory_stats().device_current, 8 << 20);
    assert_eq!(kind(p.alloc_device(1)), Some(ErrorKind::OutOfMemory));
    // resize-to-zero and back (activation swap's pattern) goes through the cache too.
    p.resize_device(&b, 0).unwrap();
    p.resize_device(&b, 3 << 20).unwrap();
    assert_eq!(b.device_ptr(), addr);
    drop((b, c));
}

#[test]
fn the_allocation_cache_can_be_turned_off_and_is_bounded() {
    for cap in [0, 1 << 20] {
        let p = cpu(CpuConfig {
            alloc_cache: cap,
            ..CpuConfig::default()
        });
        // Blocks over the cap are freed, so a later allocation of that size is fresh memory:
        // fresh cpu memory is zero-filled, a reused block would still hold 0xAB.
        let s = p.create_stream().unwrap();
        let a = p.alloc_device(2 << 20).unwrap();
        p.memset_async(&a, 0, 0xAB, a.len(), &s).unwrap();
        p.synchronize_stream(&s).unwrap();
        p.free_device(&a).unwrap();
        let b = p.alloc_device(2 << 20).unwrap();
        let mut out = vec![1u8; 64];
        p.read_device_sync(&b, (1 << 20) + 4096, &mut out, &s)
            .unwrap();
        assert_eq!(
            out,
            vec![0u8; 64],
            "cap {cap}: a block over the cap was cached"
        );
    }
}

#[test]
fn under_jitter_a_reused_block_is_poisoned_not_stale() {
    let p = cpu(CpuConfig {
        jitter: Some(4),
        ..CpuConfig::default()
    });
    let s = p.create_stream().unwrap();
    let a = p.alloc_device(1 << 20).unwrap();
    p.write_device_sync(&a, 0, &[0x11; 64], &s).unwrap();
    let addr = a.device_ptr();
    p.free_device(&a).unwrap();
    let b = p.alloc_device(1 << 20).unwrap();
    assert_eq!(b.device_ptr(), addr, "the block was not reused");
    let mut out = [0u8; 64];
    p.read_device_sync(&b, 0, &mut out, &s).unwrap();
    assert_eq!(out, [0xDB; 64], "a reused block kept its old owner's bytes");
}
