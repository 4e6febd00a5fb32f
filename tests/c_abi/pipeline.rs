//! The keyed and pipeline offload front ends, the tensor key manager and the pipeline's
//! summary, last-layer prefetch and stream marks through the C ABI.

use super::*;

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
    // SAFETY: live handles (the caller's contract).
    unsafe { upload(p, s, &vec![v; n]) }
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

/// A pipeline offload of one stage, one virtual stage, no compression.
///
/// # Safety
/// `p` live.
unsafe fn single_stage_pipeline(p: *mut HprtPlatform) -> *mut HprtPipelineOffload {
    let mut o = ptr::null_mut();
    // SAFETY: `p` live (the caller's contract); a valid out-pointer.
    ok(unsafe { hprt_pipeline_create(p, 1, 1, 1, 0, HprtCompression::Off as i32, &mut o) });
    o
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
        let s = stream(p);
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
        let o = single_stage_pipeline(p);
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
        close_with_stream(p, s);
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
        let s = stream(p);
        let o = single_stage_pipeline(p);
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
        close_with_stream(p, s);
    }
}

#[test]
fn pipeline_last_layer_prefetch_and_stream_marks_through_the_c_abi() {
    let p = open_cpu();
    let n = 4096usize;
    // SAFETY: every handle is made here, used while live and released once.
    unsafe {
        let s = stream(p);
        let o = single_stage_pipeline(p);
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
        close_with_stream(p, s);
    }
}
