//! Bad arguments and calls in the wrong state as typed statuses.

use super::*;

#[test]
fn bad_arguments_and_wrong_states_are_typed_errors() {
    run_ranks(2, |rk| {
        // SAFETY: null and invalid arguments must be reported, never dereferenced.
        unsafe {
            let mut h = ptr::null_mut();
            let two = [2usize];
            let fsdp = HprtDpMode::Fsdp as i32;
            let null = HprtStatus::ErrorNullArgument;
            let invalid = HprtStatus::ErrorInvalidValue;
            expect(
                hprt_hsdp_create(rk.p, ptr::null(), fsdp, two.as_ptr(), 1, rk.s, &mut h),
                null,
            );
            assert!(last_error().contains("world"), "{}", last_error());
            expect(
                hprt_hsdp_create(rk.p, rk.comm, fsdp, ptr::null(), 1, rk.s, &mut h),
                null,
            );
            expect(
                hprt_hsdp_create(rk.p, rk.comm, fsdp, two.as_ptr(), 1, rk.s, ptr::null_mut()),
                null,
            );
            expect(
                hprt_hsdp_create(rk.p, rk.comm, 7, two.as_ptr(), 1, rk.s, &mut h),
                invalid,
            );
            let four = [4usize];
            expect(
                hprt_hsdp_create(rk.p, rk.comm, fsdp, four.as_ptr(), 1, rk.s, &mut h),
                invalid,
            );
            assert!(last_error().contains("4 ranks"), "{}", last_error());
            // HSDP needs a 2-D mesh.
            let hsdp = HprtDpMode::Hsdp as i32;
            expect(
                hprt_hsdp_create(rk.p, rk.comm, hsdp, two.as_ptr(), 1, rk.s, &mut h),
                invalid,
            );
            assert!(h.is_null(), "out-pointers are written only on success");

            let h = rk.hsdp(HprtDpMode::Fsdp, &two);
            let src = rk.upload(&bytes(&param_full(8)));
            let shape = [8usize];
            let f32_ = HprtDtype::F32 as i32;
            let mut w = ptr::null_mut();
            expect(
                hprt_hsdp_param_create(
                    h,
                    ptr::null(),
                    shape.as_ptr(),
                    1,
                    f32_,
                    ptr::null(),
                    src,
                    0,
                    &mut w,
                ),
                null,
            );
            expect(
                param_create(h, c"w", &shape, f32_, ptr::null(), ptr::null(), 0, &mut w),
                null,
            );
            // The buffer is too short for 8 elements past offset 4; integers are not sharded.
            expect(
                param_create(h, c"w", &shape, f32_, ptr::null(), src, 4, &mut w),
                invalid,
            );
            expect(
                param_create(
                    h,
                    c"w",
                    &shape,
                    HprtDtype::I32 as i32,
                    ptr::null(),
                    src,
                    0,
                    &mut w,
                ),
                HprtStatus::ErrorUnsupported,
            );
            let bad_dim = HprtHsdpParamConfig {
                shard_dim: 1,
                ..Default::default()
            };
            expect(
                param_create(h, c"w", &shape, f32_, &bad_dim, src, 0, &mut w),
                invalid,
            );
            assert!(w.is_null());

            w = f32_param(h, c"w", &shape, ptr::null(), src);
            expect(
                hprt_hsdp_param_wait_for_unshard(w),
                HprtStatus::ErrorWrongState,
            );
            expect(
                hprt_hsdp_param_wait_for_reduce(w),
                HprtStatus::ErrorWrongState,
            );
            let max = HprtReduceOp::Max as i32;
            expect(
                hprt_hsdp_param_reduce_grad(w, src, 0, f32_, max, 1.0, false),
                invalid,
            );
            let avg = HprtReduceOp::Avg as i32;
            expect(
                hprt_hsdp_param_reduce_grad(w, src, 0, f32_, avg, f64::NAN, false),
                invalid,
            );
            // Nothing given and nothing accumulated.
            expect(
                hprt_hsdp_param_reduce_grad(w, ptr::null(), 0, f32_, avg, 1.0, false),
                HprtStatus::ErrorWrongState,
            );
            expect(hprt_hsdp_param_unshard(ptr::null_mut(), false), null);
            expect(hprt_hsdp_param_info(w, ptr::null_mut()), null);
            // The context outlives its parameters.
            expect(hprt_hsdp_destroy(h), HprtStatus::ErrorWrongState);
            assert!(last_error().contains("1 parameters"), "{}", last_error());
            ok(hprt_hsdp_param_destroy(w));
            ok(hprt_hsdp_destroy(h));
            expect(hprt_hsdp_destroy(ptr::null_mut()), null);
            ok(hprt_device_free(rk.p, src));
        }
    });
}
