//! Unit tests of [`super`], which pin every conversion's rounding and the host kernels' semantics.

use super::*;

/// Reference: the representable neighbours of x and a tie rule, computed exactly in f64.
fn nearest_even(x: f64, candidates: &[(u16, f64)]) -> u16 {
    let mut best = candidates[0];
    for &c in &candidates[1..] {
        let (db, dc) = ((best.1 - x).abs(), (c.1 - x).abs());
        if dc < db || (dc == db && c.0 % 2 == 0) {
            best = c;
        }
    }
    best.0
}

#[test]
fn f64_to_bf16_rounds_ties_once() {
    // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties to even (1.0).
    // 2^-40 above the tie must round up, but `x as f32` drops the 2^-40 and lands on the
    // tie, which a second rounding then sends to even (down).
    let above_tie = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
    assert_eq!(
        f64_to_bf16_bits(above_tie),
        half::bf16::from_f32(1.0078125).to_bits()
    );
    assert_eq!(
        f64_to_bf16_bits(1.0 + 2f64.powi(-8)),
        half::bf16::ONE.to_bits()
    );
    // Just above a tie after a plain `as f32` rounding collapses it onto the tie.
    let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-30);
    let lo = half::bf16::ONE;
    let hi = half::bf16::from_bits(lo.to_bits() + 1);
    let want = nearest_even(
        x,
        &[(lo.to_bits(), lo.to_f64()), (hi.to_bits(), hi.to_f64())],
    );
    assert_eq!(f64_to_bf16_bits(x), want);
}

/// The result must be the nearest of the library's estimate and its two neighbours.
fn check_nearest(x: f64, got: u16, estimate: u16, to_f64: fn(u16) -> f64) {
    let cands: Vec<(u16, f64)> = [estimate.wrapping_sub(1), estimate, estimate.wrapping_add(1)]
        .into_iter()
        .map(|b| (b, to_f64(b)))
        .filter(|c| c.1.is_finite() && c.1.signum() == x.signum())
        .collect();
    if !cands.is_empty() {
        assert_eq!(got, nearest_even(x, &cands), "x={x:e}");
    }
}

#[test]
fn f64_to_half_matches_an_exact_reference_on_many_values() {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..20_000 {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let x = f64::from_bits(s) % 60000.0;
        if !x.is_finite() {
            continue;
        }
        check_nearest(
            x,
            f64_to_f16_bits(x),
            half::f16::from_f64(x).to_bits(),
            |b| half::f16::from_bits(b).to_f64(),
        );
        check_nearest(
            x,
            f64_to_bf16_bits(x),
            half::bf16::from_f64(x).to_bits(),
            |b| half::bf16::from_bits(b).to_f64(),
        );
    }
}

#[test]
fn host_kernels_follow_the_documented_semantics() {
    let mut a = [1.5f32, -2.0, f32::NAN, 3.0];
    let mut b = [0u16; 4];
    // SAFETY: 4 f32 read from `a` (16 bytes), 4 bf16 written to `b` (8 bytes): both local
    // arrays of exactly that size, disjoint.
    unsafe {
        run_on_host(&Kernel::Cast {
            src: a.as_mut_ptr().cast(),
            src_dtype: DType::F32,
            dst: b.as_mut_ptr().cast(),
            dst_dtype: DType::BF16,
            count: 4,
        })
    };
    assert_eq!(half::bf16::from_bits(b[0]).to_f32(), 1.5);
    assert!(half::bf16::from_bits(b[2]).is_nan());
    let mut i = [0i32; 4];
    // SAFETY: 4 f32 read from `a`, 4 i32 written to `i`: local arrays of 16 bytes each.
    unsafe {
        run_on_host(&Kernel::Cast {
            src: a.as_mut_ptr().cast(),
            src_dtype: DType::F32,
            dst: i.as_mut_ptr().cast(),
            dst_dtype: DType::I32,
            count: 4,
        })
    };
    assert_eq!(i, [1, -2, 0, 3]);
    // SAFETY: axpy reads 2 bf16 of `b` and updates 2 f32 of `a`; scale updates `a[0]` in
    // place; fill writes `a[3]` (`add(3)` stays inside the 4-element array): every range
    // lies inside its local array, and the read and written ranges are disjoint.
    unsafe {
        run_on_host(&Kernel::Axpy {
            src: b.as_mut_ptr().cast(),
            src_dtype: DType::BF16,
            dst: a.as_mut_ptr().cast(),
            dst_dtype: DType::F32,
            count: 2,
            alpha: 2.0,
        });
        run_on_host(&Kernel::Scale {
            buf: a.as_mut_ptr().cast(),
            dtype: DType::F32,
            count: 1,
            factor: 0.5,
        });
        run_on_host(&Kernel::Fill {
            dst: a.as_mut_ptr().add(3).cast(),
            dtype: DType::F32,
            count: 1,
            value: -7.25,
        });
    }
    assert_eq!(a[0], 2.25);
    assert_eq!(a[1], -6.0);
    assert_eq!(a[3], -7.25);
    let nan_bits = 0x7fc0_1234u32;
    let src = [f32::from_bits(nan_bits)];
    let mut dst = [0f32];
    // SAFETY: one f32 read from `src` (only read, despite the `*mut` the kernel type
    // takes) and one written to `dst`, both one-element local arrays.
    unsafe {
        run_on_host(&Kernel::Cast {
            src: src.as_ptr() as *mut u8,
            src_dtype: DType::F32,
            dst: dst.as_mut_ptr().cast(),
            dst_dtype: DType::F32,
            count: 1,
        })
    };
    assert_eq!(dst[0].to_bits(), nan_bits, "equal dtypes copy bits");
}

#[test]
fn host_matmul_sums_in_order_without_fusing_on_both_paths() {
    // [2, 3] x [3, 2], exact small integers.
    let a = [1f32, 2.0, 3.0, -4.0, 5.0, -6.0];
    let b = [7f32, 8.0, 9.0, 10.0, -11.0, 12.0];
    let mut c = [0f32; 4];
    // SAFETY: every call below passes `a` and `b` readable for 2 * k f32 (10 or 6 floats,
    // `b` once at an odd address: no alignment is needed) and `c` writable for 4, all live
    // local buffers that do not overlap.
    let run = |a: *const u8, b: *const u8, c: *mut u8, k: usize| unsafe {
        run_on_host(&Kernel::Matmul {
            a: a as *mut u8,
            b: b as *mut u8,
            c,
            m: 2,
            n: 2,
            k,
            dtype: DType::F32,
        })
    };
    run(
        a.as_ptr().cast(),
        b.as_ptr().cast(),
        c.as_mut_ptr().cast(),
        3,
    );
    assert_eq!(c, [-8.0, 64.0, 83.0, -54.0]);
    // 1 + 2^-24 + 2^-24 ... in order: 1.0 + 2^-24 rounds back to 1.0 each step, while a
    // pairwise (reordered) sum would keep the small terms.
    let k = 5;
    let a: Vec<f32> = vec![1.0; 2 * k];
    let mut b = vec![2f32.powi(-24); k * 2];
    b[0] = 1.0;
    b[1] = 1.0;
    let mut c = [0f32; 4];
    run(
        a.as_ptr().cast(),
        b.as_ptr().cast(),
        c.as_mut_ptr().cast(),
        k,
    );
    assert_eq!(c, [1.0; 4]);
    // The unaligned path gives the same bits as the aligned one.
    let mut bytes = vec![0u8; 1];
    bytes.extend(b.iter().flat_map(|x| x.to_le_bytes()));
    let mut out = [0u8; 1 + 16];
    run(
        a.as_ptr().cast(),
        bytes[1..].as_ptr(),
        out[1..].as_mut_ptr(),
        k,
    );
    assert_eq!(
        &out[1..],
        c.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>()
    );
}

#[test]
fn matmul_is_f32_only_and_never_in_place() {
    let k = |dtype, k| Kernel::Matmul {
        a: (),
        b: (),
        c: (),
        m: 2,
        n: 3,
        k,
        dtype,
    };
    assert!(k(DType::F32, 4).validate(BackendKind::Cpu).is_ok());
    assert_eq!(
        k(DType::BF16, 4)
            .validate(BackendKind::Cpu)
            .unwrap_err()
            .kind,
        ErrorKind::Unsupported
    );
    assert_eq!(
        k(DType::F32, 0)
            .validate(BackendKind::Cpu)
            .unwrap_err()
            .kind,
        ErrorKind::InvalidValue
    );
    assert_eq!(k(DType::F32, 4).count(), 6);
    assert!(!k(DType::F32, 4).allows_in_place());
    let sizes: Vec<usize> = k(DType::F32, 4).places().iter().map(|p| p.1).collect();
    assert_eq!(sizes, [32, 48, 24]);
    let huge = Kernel::Matmul {
        a: (),
        b: (),
        c: (),
        m: 1,
        n: 1,
        k: usize::MAX / 2,
        dtype: DType::F32,
    };
    assert_eq!(
        huge.validate(BackendKind::Cpu).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
}

#[test]
fn scale_and_axpy_reject_integers() {
    let k = Kernel::Scale {
        buf: (),
        dtype: DType::I32,
        count: 1,
        factor: 2.0,
    };
    assert_eq!(
        k.validate(BackendKind::Cpu).unwrap_err().kind,
        ErrorKind::Unsupported
    );
    let k = Kernel::Cast {
        src: (),
        src_dtype: DType::I64,
        dst: (),
        dst_dtype: DType::F64,
        count: usize::MAX / 4,
    };
    assert_eq!(
        k.validate(BackendKind::Cpu).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
}
