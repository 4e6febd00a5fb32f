//! Misuse of the C ABI as a careless caller commits it: null out-pointers (nothing is made, so
//! nothing leaks), use after free / destroy / close, double release, never-issued and
//! wrong-kind handles — each a typed status (`INVALID_HANDLE`), never a crash; and sizes that
//! used to abort the process (`hprt_hsdp_create` meshes, `mesh_ndim`).

use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};

use hprt::ffi::*;

mod common;
use common::*;
mod c_abi_common;
use c_abi_common::*;

const INVALID: HprtStatus = HprtStatus::ErrorInvalidHandle;
const NULL: HprtStatus = HprtStatus::ErrorNullArgument;

fn stats(p: *const HprtPlatform) -> HprtMemoryStats {
    let mut s = HprtMemoryStats::default();
    // SAFETY: a valid out-pointer; `p` may be stale (then the status says so).
    ok(unsafe { hprt_platform_memory_stats(p, &mut s) });
    s
}

static RELEASED: AtomicUsize = AtomicUsize::new(0);
unsafe extern "C" fn count_release(_user: *mut std::ffi::c_void) {
    RELEASED.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn a_null_out_pointer_makes_nothing_and_leaks_nothing() {
    let p = open_cpu();
    let base = stats(p);
    // SAFETY: every out-pointer is null on purpose; the other arguments are valid.
    unsafe {
        for _ in 0..10 {
            expect(hprt_device_alloc(p, 1 << 20, ptr::null_mut()), NULL);
            expect(hprt_pinned_alloc(p, 1 << 20, ptr::null_mut()), NULL);
        }
        let after = stats(p);
        assert_eq!(
            (after.device_current, after.pinned_current),
            (base.device_current, base.pinned_current),
            "a refused allocation left memory charged"
        );
        assert_eq!(after.device_allocations, base.device_allocations);
        expect(hprt_stream_create(p, ptr::null_mut()), NULL);
        expect(hprt_event_create(p, false, ptr::null_mut()), NULL);
        expect(hprt_swap_manager_create(p, 0, ptr::null_mut()), NULL);
        let s = stream(p);
        let mut raw = 0;
        ok(hprt_stream_raw(s, &mut raw));
        expect(hprt_stream_wrap(p, raw, ptr::null_mut()), NULL);
        // A refused wrap takes nothing over: the release callback never runs.
        let mut d = ptr::null_mut();
        ok(hprt_device_alloc(p, 256, &mut d));
        let mut addr = 0;
        ok(hprt_device_info(d, &mut addr, ptr::null_mut()));
        let before = RELEASED.load(Ordering::SeqCst);
        expect(
            hprt_device_wrap(
                p,
                addr,
                256,
                Some(count_release),
                ptr::null_mut(),
                ptr::null_mut(),
            ),
            NULL,
        );
        ok(hprt_platform_synchronize(p));
        assert_eq!(RELEASED.load(Ordering::SeqCst), before);
        let (id, len) = unique_id(p);
        expect(
            hprt_comm_init(p, id.as_ptr(), len, 0, 1, ptr::null_mut()),
            NULL,
        );
        let mut comm = ptr::null_mut();
        // A garbage id length is refused before the id is read or copied.
        expect(
            hprt_comm_init(p, id.as_ptr(), 1 << 40, 0, 1, &mut comm),
            HprtStatus::ErrorInvalidValue,
        );
        ok(hprt_comm_init(p, id.as_ptr(), len, 0, 1, &mut comm));
        let mesh = [1usize];
        expect(
            hprt_hsdp_create(
                p,
                comm,
                HprtDpMode::Fsdp as i32,
                mesh.as_ptr(),
                1,
                s,
                ptr::null_mut(),
            ),
            NULL,
        );
        ok(hprt_comm_destroy(p, comm));
        ok(hprt_device_free(p, d));
        ok(hprt_stream_destroy(p, s));
        expect(hprt_platform_open(c"cpu".as_ptr(), ptr::null_mut()), NULL);
        ok(hprt_platform_close(p));
    }
}

#[test]
fn released_handles_are_invalid_not_undefined() {
    let p = open_cpu();
    // SAFETY: the handles are used after release on purpose: the registry must refuse them.
    unsafe {
        let (mut s, mut e, mut d, mut h) = (
            ptr::null_mut(),
            ptr::null_mut(),
            ptr::null_mut(),
            ptr::null_mut(),
        );
        ok(hprt_stream_create(p, &mut s));
        ok(hprt_event_create(p, false, &mut e));
        ok(hprt_device_alloc(p, 64, &mut d));
        ok(hprt_pinned_alloc(p, 64, &mut h));

        ok(hprt_device_free(p, d));
        expect(hprt_device_free(p, d), INVALID);
        expect(
            hprt_device_info(d, ptr::null_mut(), ptr::null_mut()),
            INVALID,
        );
        expect(hprt_memset_async(p, d, 0, 1, 8, s), INVALID);
        assert!(last_error().contains("buffer"), "{}", last_error());
        ok(hprt_pinned_free(p, h));
        expect(hprt_pinned_free(p, h), INVALID);
        let to_pinned = pinned_ref(h);
        let mut d2 = ptr::null_mut();
        ok(hprt_device_alloc(p, 64, &mut d2));
        let from_device = device_ref(d2, 0);
        expect(hprt_copy_async(p, to_pinned, from_device, 8, s), INVALID);

        ok(hprt_event_destroy(p, e));
        expect(hprt_event_destroy(p, e), INVALID);
        expect(hprt_event_record(p, e, s), INVALID);

        // A handle of another kind, and values never issued.
        expect(hprt_event_record(p, s.cast(), s), INVALID);
        expect(hprt_stream_synchronize(p, d2.cast()), INVALID);
        expect(
            hprt_stream_synchronize(p, 0x1234 as *const HprtStream),
            INVALID,
        );
        expect(
            hprt_stream_synchronize(p, usize::MAX as *const HprtStream),
            INVALID,
        );
        expect(hprt_platform_synchronize(s.cast()), INVALID);

        ok(hprt_device_free(p, d2));
        ok(hprt_stream_destroy(p, s));
        expect(hprt_stream_destroy(p, s), INVALID);
        expect(hprt_stream_synchronize(p, s), INVALID);

        // A swap manager destroyed twice, and used after.
        let mut m = ptr::null_mut();
        ok(hprt_swap_manager_create(p, 0, &mut m));
        ok(hprt_swap_manager_destroy(m));
        expect(hprt_swap_manager_destroy(m), INVALID);
        let mut layer = 0;
        expect(hprt_swap_new_layer(m, &mut layer), INVALID);

        // A new object reusing the slot does not revive the old handle.
        let mut s2 = ptr::null_mut();
        ok(hprt_stream_create(p, &mut s2));
        assert_ne!(s2, s);
        expect(hprt_stream_synchronize(p, s), INVALID);
        ok(hprt_stream_destroy(p, s2));

        // Use after close, close twice.
        ok(hprt_platform_close(p));
        expect(hprt_platform_close(p), INVALID);
        let mut b = ptr::null_mut();
        expect(hprt_device_alloc(p, 64, &mut b), INVALID);
        assert!(b.is_null());
        let mut n = 0;
        expect(hprt_device_count(p, &mut n), INVALID);
    }
}

#[test]
fn objects_outlive_their_platform_handle_safely() {
    let p = open_cpu();
    let mut d = ptr::null_mut();
    // SAFETY: `d` is used after its platform handle is closed; the object stays valid, the
    // closed platform handle does not.
    unsafe {
        ok(hprt_device_alloc(p, 64, &mut d));
        ok(hprt_platform_close(p));
        let mut bytes = 0;
        ok(hprt_device_info(d, ptr::null_mut(), &mut bytes));
        assert_eq!(bytes, 64);
        expect(hprt_device_free(p, d), INVALID);
        // Another platform value refuses it, and the handle stays valid after the refusal.
        let q = open_cpu();
        expect(hprt_device_free(q, d), INVALID);
        ok(hprt_device_info(d, ptr::null_mut(), &mut bytes));
        ok(hprt_platform_close(q));
    }
}

#[test]
fn unique_id_into_a_short_buffer_is_buffer_too_small() {
    let p = open_cpu();
    let mut id = [0u8; 2];
    let mut len = 0;
    // SAFETY: `id` holds the 2 bytes passed.
    expect(
        unsafe { hprt_unique_id(p, id.as_mut_ptr(), id.len(), &mut len) },
        HprtStatus::ErrorBufferTooSmall,
    );
    // SAFETY: closed once.
    ok(unsafe { hprt_platform_close(p) });
}

#[test]
fn oversized_meshes_are_invalid_values_not_aborts() {
    let p = open_cpu();
    // SAFETY: valid handles and arrays; mesh_ndim values above the array length are refused
    // before the array is read (the documented bound).
    unsafe {
        let s = stream(p);
        let comm = solo_comm(p);
        let create = |mesh: &[usize], ndim: usize| {
            let mut h = ptr::null_mut();
            let st = hprt_hsdp_create(
                p,
                comm,
                HprtDpMode::Fsdp as i32,
                mesh.as_ptr(),
                ndim,
                s,
                &mut h,
            );
            assert!(h.is_null());
            st
        };
        for mesh in [[1usize << 40], [1 << 30], [usize::MAX]] {
            expect(create(&mesh, 1), HprtStatus::ErrorInvalidValue);
            assert!(last_error().contains("mesh size limit"), "{}", last_error());
        }
        expect(create(&[1], 1 << 40), HprtStatus::ErrorInvalidValue);
        expect(
            create(&[1], HPRT_HSDP_MAX_MESH_DIMS + 1),
            HprtStatus::ErrorInvalidValue,
        );
        ok(hprt_comm_destroy(p, comm));
        close_with_stream(p, s);
    }
}

/// ISSUE 32 item 14: an integer that is no `HprtCompression` was taken as the enum (undefined
/// behaviour in Rust; 4, 7, 255 and -1 returned OK). Each entry point refuses it, names it,
/// and leaves the object as it was.
#[test]
fn out_of_range_compression_modes_are_invalid_values() {
    let p = open_cpu();
    // SAFETY: every handle is made here, used while live and released once.
    unsafe {
        let (mut m, mut k, mut o) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
        ok(hprt_swap_manager_create(p, 0, &mut m));
        ok(hprt_keyed_create(p, 0, 0, &mut k));
        for bad in [4, 7, 255, -1, i32::MIN, i32::MAX] {
            let calls: [(&str, HprtStatus); 3] = [
                (
                    "hprt_swap_set_compression",
                    hprt_swap_set_compression(m, bad),
                ),
                (
                    "hprt_keyed_set_compression",
                    hprt_keyed_set_compression(k, bad),
                ),
                (
                    "hprt_pipeline_create",
                    hprt_pipeline_create(p, 0, 2, 0, 0, bad, &mut o),
                ),
            ];
            for (name, status) in calls {
                assert_eq!(status, HprtStatus::ErrorInvalidValue, "{name}({bad})");
                let msg = last_error();
                assert!(
                    msg.contains(&format!("{bad} is not an HprtCompression")),
                    "{name}: {msg}"
                );
            }
            assert!(o.is_null(), "no pipeline is made from mode {bad}");
        }
        for mode in [
            HprtCompression::Off,
            HprtCompression::Device,
            HprtCompression::HostStage,
            HprtCompression::Auto,
        ] {
            ok(hprt_swap_set_compression(m, mode as i32));
            ok(hprt_keyed_set_compression(k, mode as i32));
            ok(hprt_pipeline_create(p, 0, 2, 0, 0, mode as i32, &mut o));
            ok(hprt_pipeline_destroy(o));
            o = ptr::null_mut();
        }
        ok(hprt_keyed_destroy(k));
        ok(hprt_swap_manager_destroy(m));
        ok(hprt_platform_close(p));
    }
}

/// ISSUE 32 item 18: a `forward_pre` inside another layer's forward moves the saves to the
/// inner layer's group (accepted: a forward abandoned half-way must not block every later one),
/// and the outer layer's `forward_post` failed with the internal-sounding "without its
/// forward_pre". It now says what happened and what the order must be.
#[test]
fn a_forward_post_after_a_nested_forward_pre_says_groups_do_not_nest() {
    let p = open_cpu();
    // SAFETY: every handle is made here, used while live and released once.
    unsafe {
        let (mut m, mut s) = (ptr::null_mut(), ptr::null_mut());
        ok(hprt_swap_manager_create(p, 0, &mut m));
        ok(hprt_stream_create(p, &mut s));
        let (mut a, mut b) = (0, 0);
        ok(hprt_swap_new_layer(m, &mut a));
        ok(hprt_swap_new_layer(m, &mut b));
        ok(hprt_swap_forward_pre(m, a));
        ok(hprt_swap_forward_pre(m, b));
        expect(hprt_swap_forward_post(m, a, s), HprtStatus::ErrorWrongState);
        let msg = last_error();
        assert!(
            msg.contains(&format!("forward_post of layer {a}"))
                && msg.contains(&format!("layer {b}'s forward is the open one"))
                && msg.contains("layer groups do not nest"),
            "{msg}"
        );
        ok(hprt_swap_forward_post(m, b, s));
        expect(hprt_swap_forward_post(m, a, s), HprtStatus::ErrorWrongState);
        let msg = last_error();
        assert!(
            msg.contains("no layer's forward is open") && msg.contains("do not nest"),
            "{msg}"
        );
        // In order, both forwards go through.
        ok(hprt_swap_forward_pre(m, a));
        ok(hprt_swap_forward_post(m, a, s));
        ok(hprt_swap_manager_destroy(m));
        close_with_stream(p, s);
    }
}

/// ISSUE 32 item 18: `hprt_swap_save` took a buffer of another platform value; the engine's
/// copies would fail only at the offload. Refused at the save, naming the storage.
#[test]
fn saving_another_platforms_buffer_is_refused_at_the_save() {
    let (p, q) = (open_cpu(), open_cpu());
    // SAFETY: every handle is made here, used while live and released once.
    unsafe {
        let (mut m, mut foreign) = (ptr::null_mut(), ptr::null_mut());
        ok(hprt_swap_manager_create(p, 0, &mut m));
        ok(hprt_device_alloc(q, 256, &mut foreign));
        let mut layer = 0;
        ok(hprt_swap_new_layer(m, &mut layer));
        ok(hprt_swap_forward_pre(m, layer));
        let mut r = HprtSavedRef::default();
        let st = hprt_swap_save(m, foreign, 0, 256, HprtDtype::F32 as i32, &mut r);
        expect(st, HprtStatus::ErrorInvalidHandle);
        let msg = last_error();
        assert!(
            msg.contains("storage") && msg.contains("another platform"),
            "{msg}"
        );
        let st = hprt_swap_add_storage(
            m,
            c"g".as_ptr(),
            foreign,
            0,
            256,
            HprtDtype::F32 as i32,
            &mut r,
        );
        expect(st, HprtStatus::ErrorInvalidHandle);
        ok(hprt_swap_manager_destroy(m));
        ok(hprt_device_free(q, foreign));
        ok(hprt_platform_close(q));
        ok(hprt_platform_close(p));
    }
}
