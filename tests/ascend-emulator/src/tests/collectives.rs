//! HCCL: collectives, send/recv and groups across rank threads, mismatches and missing peers
//! that fail the stream, and call-time validation.

use super::*;

/// Runs `f(rank, comm, stream)` on `n` rank threads sharing one communicator.
fn ranks(n: u32, f: impl Fn(u32, *mut c_void, *mut c_void) + Sync) {
    let root = root_info();
    let (root, f) = (&root, &f);
    std::thread::scope(|sc| {
        for r in 0..n {
            // SAFETY: `root` holds `HCCL_ROOT_INFO_BYTES`, which the init reads; the out-pointer is
            // a live local; the communicator and stream are destroyed only after `f` returned.
            sc.spawn(move || unsafe {
                assert_eq!(aclrtSetDevice((r % 4) as i32), 0);
                let mut comm = null_mut();
                assert_eq!(
                    HcclCommInitRootInfo(n, root.as_ptr().cast(), r, &mut comm),
                    0
                );
                let s = new_stream();
                f(r, comm, s);
                assert_eq!(HcclCommDestroy(comm), 0);
                destroy_stream(s);
            });
        }
    });
}

const F32: u32 = 4;
const I32: u32 = 2;

#[test]
fn all_reduce_all_gather_reduce_scatter() {
    let _g = setup();
    with_config(|c| c.delay_seed = Some(3));
    for n in [2u32, 4] {
        // SAFETY: every device buffer comes from `upload` / `malloc` sized for the count its
        // collective moves (and the emulator checks each against its allocation); `comm` and `s`
        // live for the closure (`ranks`).
        ranks(n, |r, comm, s| unsafe {
            let len = 10usize;
            let mine: Vec<f32> = (0..len).map(|i| (r * 100) as f32 + i as f32).collect();
            let send = upload(&mine);
            let recv = malloc(len * 4);
            assert_eq!(
                HcclAllReduce(send, recv, len as u64, F32, HCCL_REDUCE_SUM, comm, s),
                0
            );
            // In place, integer max.
            let ints = upload(&[r as i32, -(r as i32), 7]);
            assert_eq!(
                HcclAllReduce(ints, ints, 3, I32, HCCL_REDUCE_MAX, comm, s),
                0
            );
            assert_eq!(sync(s), 0);
            let want: Vec<f32> = (0..len)
                .map(|i| (0..n).map(|q| (q * 100) as f32 + i as f32).sum())
                .collect();
            assert_eq!(download::<f32>(recv, len), want);
            assert_eq!(download::<i32>(ints, 3), [n as i32 - 1, 0, 7]);

            let gathered = malloc(len * 4 * n as usize);
            assert_eq!(HcclAllGather(send, gathered, len as u64, F32, comm, s), 0);
            assert_eq!(sync(s), 0);
            let want: Vec<f32> = (0..n)
                .flat_map(|q| (0..len).map(move |i| (q * 100) as f32 + i as f32))
                .collect();
            assert_eq!(download::<f32>(gathered, want.len()), want);

            // Reduce-scatter of the gathered buffer: block r summed over ranks = n * block r.
            let part = malloc(len * 4);
            assert_eq!(
                HcclReduceScatter(gathered, part, len as u64, F32, HCCL_REDUCE_SUM, comm, s),
                0
            );
            assert_eq!(sync(s), 0);
            let want: Vec<f32> = mine.iter().map(|x| x * n as f32).collect();
            assert_eq!(download::<f32>(part, len), want);
            for p in [send, recv, ints, gathered, part] {
                free(p);
            }
        });
    }
}

#[test]
fn broadcast_alltoall_alltoallv() {
    let _g = setup();
    with_config(|c| c.delay_seed = Some(11));
    for n in [2u32, 4] {
        // SAFETY: the count and displacement arrays each hold the world size's u64s, as the
        // all-to-all-v reads them; every device buffer is sized for what its collective moves (and
        // registry-checked); `comm` and `s` live for the closure (`ranks`).
        ranks(n, |r, comm, s| unsafe {
            let nn = n as usize;
            let b = upload(&[r as i32; 5]);
            assert_eq!(HcclBroadcast(b, 5, I32, n - 1, comm, s), 0);

            // all-to-all: rank r sends value 10*r + j to rank j (2 elements each).
            let send: Vec<i32> = (0..nn)
                .flat_map(|j| [10 * r as i32 + j as i32; 2])
                .collect();
            let sp = upload(&send);
            let rp = malloc(send.len() * 4);
            assert_eq!(HcclAlltoAll(sp, 2, I32, rp, 2, I32, comm, s), 0);

            // all-to-all-v: rank r sends j + 1 elements to rank j, valued 100*r + j.
            let scounts: Vec<u64> = (0..n).map(|j| u64::from(j) + 1).collect();
            let sdispls: Vec<u64> = scounts
                .iter()
                .scan(0, |a, c| Some(std::mem::replace(a, *a + c)))
                .collect();
            let vsend: Vec<i32> = (0..n)
                .flat_map(|j| std::iter::repeat_n(100 * r as i32 + j as i32, j as usize + 1))
                .collect();
            let rcounts = vec![u64::from(r) + 1; nn];
            // Gaps of one element between blocks: displacements need not be dense.
            let rdispls: Vec<u64> = (0..n).map(|i| u64::from(i) * (u64::from(r) + 2)).collect();
            let rlen = nn * (r as usize + 2);
            let vsp = upload(&vsend);
            let vrp = upload(&vec![-1i32; rlen]);
            let rc = HcclAlltoAllV(
                vsp,
                scounts.as_ptr().cast(),
                sdispls.as_ptr().cast(),
                I32,
                vrp,
                rcounts.as_ptr().cast(),
                rdispls.as_ptr().cast(),
                I32,
                comm,
                s,
            );
            assert_eq!(rc, 0);
            assert_eq!(sync(s), 0);

            assert_eq!(download::<i32>(b, 5), [n as i32 - 1; 5]);
            let want: Vec<i32> = (0..nn)
                .flat_map(|i| [10 * i as i32 + r as i32; 2])
                .collect();
            assert_eq!(download::<i32>(rp, want.len()), want);
            let got = download::<i32>(vrp, rlen);
            for i in 0..nn {
                let at = i * (r as usize + 2);
                let blk = &got[at..at + r as usize + 2];
                assert!(blk[..r as usize + 1]
                    .iter()
                    .all(|&x| x == 100 * i as i32 + r as i32));
                assert_eq!(blk[r as usize + 1], -1, "gap untouched");
            }
            for p in [b, sp, rp, vsp, vrp] {
                free(p);
            }
        });
    }
}

#[test]
fn send_recv_pairs_and_groups() {
    let _g = setup();
    with_config(|c| c.delay_seed = Some(5));
    // SAFETY: `mine` and `got` are 32-byte device buffers, 8 i32 as each call moves; `comm` and `s`
    // live for the closure (`ranks`).
    ranks(4, |r, comm, s| unsafe {
        let mine = upload(&[r as i32; 8]);
        let got = malloc(32);
        // A ring inside a group: every rank sends before it receives, which would deadlock
        // without the group.
        assert_eq!(HcclGroupStart(), 0);
        assert_eq!(HcclSend(mine, 8, I32, (r + 1) % 4, comm, s), 0);
        assert_eq!(HcclRecv(got, 8, I32, (r + 3) % 4, comm, s), 0);
        assert_eq!(HcclGroupEnd(), 0);
        assert_eq!(sync(s), 0);
        assert_eq!(download::<i32>(got, 8), [((r + 3) % 4) as i32; 8]);

        // Ungrouped, in matching order: evens send then receive, odds the reverse.
        let peer = r ^ 1;
        let order: [bool; 2] = if r % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for send_first in order {
            if send_first {
                assert_eq!(HcclSend(mine, 8, I32, peer, comm, s), 0);
            } else {
                assert_eq!(HcclRecv(got, 8, I32, peer, comm, s), 0);
            }
        }
        assert_eq!(sync(s), 0);
        assert_eq!(download::<i32>(got, 8), [peer as i32; 8]);
        free(mine);
        free(got);
    });
}

#[test]
fn hccl_mismatch_and_missing_peer_fail_the_stream() {
    let _g = setup();
    crate::control::hprtEmuSetHcclTimeoutMs(300);
    // Each failure on its own communicator: after one, the communicator is broken.
    // SAFETY: `buf` is a 64-byte device buffer, at least the 8 f32 any call here moves;
    // out-pointers are live locals; `comm` and `s` live for the closure (`ranks`).
    ranks(2, |r, comm, s| unsafe {
        let buf = malloc(64);
        let count = if r == 0 { 4 } else { 8 };
        assert_eq!(
            HcclAllReduce(buf, buf, count, F32, HCCL_REDUCE_SUM, comm, s),
            0
        );
        // The failure reaches what is ordered after it through an event: the event's
        // synchronize and a stream that waited on it, as a GPU's sticky errors do.
        let mut ev = null_mut();
        assert_eq!(aclrtCreateEvent(&mut ev), 0);
        assert_eq!(aclrtRecordEvent(ev, s), 0);
        let mut b = null_mut();
        assert_eq!(aclrtCreateStream(&mut b), 0);
        assert_eq!(aclrtStreamWaitEvent(b, ev), 0);
        assert_eq!(aclrtSynchronizeEvent(ev), ACL_ERROR_RT_INTERNAL_ERROR);
        assert_eq!(sync(b), ACL_ERROR_RT_INTERNAL_ERROR);
        assert_eq!(sync(b), 0, "reported once");
        assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
        assert_eq!(aclrtRecordEvent(ev, s), 0);
        assert_eq!(aclrtStreamWaitEvent(b, ev), 0);
        assert_eq!(sync(b), 0, "a record after the report is clean");
        assert_eq!(aclrtDestroyStream(b), 0);
        assert_eq!(aclrtDestroyEvent(ev), 0);
        free(buf);
    });
    // SAFETY: `buf` is a 64-byte device buffer, more than the 4 f32 the call moves; `comm` and `s`
    // live for the closure (`ranks`).
    ranks(2, |r, comm, s| unsafe {
        let buf = malloc(64);
        // Different ops also disagree.
        let op = if r == 0 {
            HCCL_REDUCE_SUM
        } else {
            HCCL_REDUCE_MAX
        };
        assert_eq!(HcclAllReduce(buf, buf, 4, F32, op, comm, s), 0);
        assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
        free(buf);
    });
    // SAFETY: `buf` is a 64-byte device buffer, at least the 4 f32 either call moves; `comm` and
    // `s` live for the closure (`ranks`).
    ranks(2, |r, comm, s| unsafe {
        let buf = malloc(64);
        // Send/recv whose counts disagree.
        if r == 0 {
            assert_eq!(HcclSend(buf, 4, F32, 1, comm, s), 0);
        } else {
            assert_eq!(HcclRecv(buf, 2, F32, 0, comm, s), 0);
        }
        assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
        free(buf);
    });
    // SAFETY: `buf` is a 64-byte device buffer, more than the 4 f32 the call moves; `comm` and `s`
    // live for the closure (`ranks`).
    ranks(2, |r, comm, s| unsafe {
        let buf = malloc(64);
        // Rank 1 never joins: rank 0 times out instead of hanging, once; the communicator is
        // broken then, so what was queued behind and what comes later fails at once.
        if r == 0 {
            let t0 = Instant::now();
            for _ in 0..5 {
                assert_eq!(HcclAllReduce(buf, buf, 4, F32, HCCL_REDUCE_SUM, comm, s), 0);
            }
            assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
            let waited = t0.elapsed();
            assert!(waited >= Duration::from_millis(250), "{waited:?}");
            assert!(waited < Duration::from_millis(1000), "{waited:?}");
        }
        free(buf);
    });
}

#[test]
fn hccl_call_time_validation() {
    let _g = setup();
    crate::control::hprtEmuSetHcclTimeoutMs(300);
    // SAFETY: root infos are `HCCL_ROOT_INFO_BYTES` buffers alive for each call; out-pointers are
    // live locals or null (refused); the bogus communicator and stream handles, the host buffer
    // passed as device memory and the counts past an allocation's end are refused by registry
    // checks at call time (module doc); `counts` and `displs` hold one u64 each, for a one-rank
    // communicator.
    unsafe {
        let mut comm = null_mut();
        let root = root_info();
        let rp = root.as_ptr().cast();
        assert_eq!(HcclGetRootInfo(null_mut()), HCCL_E_PTR);
        // HCCL needs the calling thread's device, before any other check.
        on_new_thread(|| {
            let mut r = vec![0u8; HCCL_ROOT_INFO_BYTES];
            assert_eq!(HcclGetRootInfo(r.as_mut_ptr().cast()), HCCL_E_RUNTIME);
            let mut c = null_mut();
            let rp = root.as_ptr().cast();
            assert_eq!(HcclCommInitRootInfo(1, rp, 0, &mut c), HCCL_E_RUNTIME);
            let n = null_mut();
            assert_eq!(HcclAllReduce(n, n, 0, F32, 0, n, n), HCCL_E_RUNTIME);
            assert_eq!(HcclGroupStart(), 0);
            assert_eq!(HcclGroupEnd(), 0);
        });
        assert_ne!(root_info()[16..24], root[16..24], "root infos are unique");
        assert_eq!(HcclCommInitRootInfo(2, null(), 0, &mut comm), HCCL_E_PTR);
        assert_eq!(HcclCommInitRootInfo(2, rp, 0, null_mut()), HCCL_E_PTR);
        assert_eq!(HcclCommInitRootInfo(0, rp, 0, &mut comm), HCCL_E_PARA);
        assert_eq!(HcclCommInitRootInfo(2, rp, 2, &mut comm), HCCL_E_PARA);
        let junk = vec![0u8; HCCL_ROOT_INFO_BYTES];
        assert_eq!(
            HcclCommInitRootInfo(1, junk.as_ptr().cast(), 0, &mut comm),
            HCCL_E_PARA
        );
        // Nobody else joins.
        assert_eq!(HcclCommInitRootInfo(2, rp, 0, &mut comm), HCCL_E_TIMEOUT);
        // Ranks that disagree on the size, or claim the same rank.
        for (n1, r1) in [(3u32, 1u32), (2, 0)] {
            let root = root_info();
            let root = &root;
            let rcs: Vec<u32> = std::thread::scope(|sc| {
                let a = sc.spawn(|| {
                    assert_eq!(aclrtSetDevice(1), 0);
                    let mut c = null_mut();
                    let rc = HcclCommInitRootInfo(2, root.as_ptr().cast(), 0, &mut c);
                    (rc, c as usize)
                });
                std::thread::sleep(Duration::from_millis(50));
                let mut c = null_mut();
                let rc_b = HcclCommInitRootInfo(n1, root.as_ptr().cast(), r1, &mut c);
                vec![a.join().unwrap().0, rc_b]
            });
            assert_eq!(rcs, [HCCL_E_PARA, HCCL_E_PARA], "n={n1} rank={r1}");
        }

        // A single-rank communicator for the per-call checks.
        assert_eq!(
            HcclCommInitRootInfo(1, root_info().as_ptr().cast(), 0, &mut comm),
            0
        );
        let s = new_stream();
        let d = malloc(64);
        let mut host = [0f32; 16];
        let hp: *mut c_void = host.as_mut_ptr().cast();
        let bogus = 0x7FFF_FFFF_0010usize as *mut c_void;
        assert_eq!(HcclAllReduce(d, d, 16, F32, 0, bogus, s), HCCL_E_PARA);
        assert_eq!(
            HcclAllReduce(null_mut(), d, 16, F32, 0, comm, s),
            HCCL_E_PTR
        );
        assert_eq!(HcclAllReduce(null_mut(), null_mut(), 0, F32, 0, comm, s), 0);
        assert_eq!(HcclAllReduce(d, d, 16, 12, 0, comm, s), HCCL_E_NOT_SUPPORT);
        assert_eq!(HcclAllReduce(d, d, 16, 13, 0, comm, s), HCCL_E_PARA);
        assert_eq!(HcclAllReduce(d, d, 16, F32, 4, comm, s), HCCL_E_PARA);
        assert_eq!(
            HcclAllReduce(hp, d, 16, F32, 0, comm, s),
            HCCL_E_PARA,
            "host buffer"
        );
        assert_eq!(
            HcclAllReduce(d, d, 17, F32, 0, comm, s),
            HCCL_E_PARA,
            "past the end"
        );
        assert_eq!(
            HcclAllReduce(d, d, 16, F32, 0, comm, 0x5FFF_FFFF_0010usize as _),
            HCCL_E_PARA
        );
        assert_eq!(HcclBroadcast(d, 16, F32, 1, comm, s), HCCL_E_PARA);
        assert_eq!(HcclAllGather(d, d, 16, F32, comm, s), 0);
        assert_eq!(HcclAlltoAll(d, 16, F32, d, 16, I32, comm, s), HCCL_E_PARA);
        assert_eq!(HcclAlltoAll(d, 16, F32, d, 8, F32, comm, s), HCCL_E_PARA);
        let counts = [16u64];
        let displs = [1u64];
        let cp = counts.as_ptr().cast();
        let dp = displs.as_ptr().cast();
        assert_eq!(
            HcclAlltoAllV(d, cp, null(), F32, d, cp, dp, F32, comm, s),
            HCCL_E_PTR
        );
        assert_eq!(
            HcclAlltoAllV(d, cp, dp, F32, d, cp, dp, I32, comm, s),
            HCCL_E_PARA
        );
        assert_eq!(
            HcclAlltoAllV(d, cp, dp, F32, d, cp, dp, F32, comm, s),
            HCCL_E_PARA,
            "1 + 16 > 16"
        );
        assert_eq!(
            HcclAllReduce(d, d, 16, F32, 0, comm, null_mut()),
            HCCL_E_PTR,
            "no default stream"
        );
        assert_eq!(HcclAllReduce(d, d, 16, F32, 0, null_mut(), s), HCCL_E_PTR);
        assert_eq!(HcclSend(d, 4, F32, 0, null_mut(), s), HCCL_E_PTR);
        assert_eq!(HcclSend(d, 0, 99, 5, null_mut(), null_mut()), 0, "count 0");
        assert_eq!(
            HcclAlltoAll(null(), 0, F32, null(), 0, I32, null_mut(), null_mut()),
            0
        );
        assert_eq!(HcclAlltoAll(d, 1, F32, null(), 1, F32, comm, s), HCCL_E_PTR);
        // A rank may send to itself inside a group.
        let half = (d as usize + 32) as *mut c_void;
        // Work still queued on `s` (the calls above) must not land after the host-side memset.
        assert_eq!(sync(s), 0);
        assert_eq!(aclrtMemset(d, 64, 0x11, 32), 0);
        assert_eq!(HcclGroupStart(), 0);
        assert_eq!(HcclSend(d, 8, F32, 0, comm, s), 0);
        assert_eq!(HcclRecv(half, 8, F32, 0, comm, s), 0);
        assert_eq!(HcclGroupEnd(), 0);
        assert_eq!(sync(s), 0);
        assert_eq!(download::<u8>(d, 64), [0x11u8; 64]);
        assert_eq!(HcclRecv(d, 4, F32, 1, comm, s), HCCL_E_PARA, "no such rank");
        assert_eq!(HcclGroupEnd(), HCCL_E_PARA);
        // Nested groups submit at the outermost end.
        assert_eq!(HcclGroupStart(), 0);
        assert_eq!(HcclGroupStart(), 0);
        assert_eq!(HcclAllReduce(d, d, 16, F32, 0, comm, s), 0);
        assert_eq!(HcclGroupEnd(), 0);
        assert_eq!(HcclGroupEnd(), 0);
        assert_eq!(HcclGroupEnd(), HCCL_E_PARA);
        assert_eq!(sync(s), 0);

        assert_eq!(HcclCommDestroy(comm), 0);
        assert_eq!(HcclCommDestroy(comm), HCCL_E_PARA);
        assert_eq!(
            HcclCommDestroy(null_mut()),
            0,
            "null is skipped, as in CANN"
        );
        assert_eq!(HcclAllReduce(d, d, 16, F32, 0, comm, s), HCCL_E_PARA);
        free(d);
        destroy_stream(s);
    }
}
