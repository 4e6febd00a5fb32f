//! kernel: the elementwise kernels and host functions on streams. Expected values come from the
//! `half` crate's f32 conversions and plain f64 arithmetic, independent of the backends' code.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use hprt_platform::{DType, DeviceBuffer, ErrorKind, Kernel, Place, Platform};

use crate::util::{
    check_bytes, check_pinned, download, expect_err, expect_kind, pinned_with, upload,
};

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Values that exercise rounding: ties, subnormals of the half formats, overflow, NaN, ±0.
fn tricky_f32(n: usize) -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        65504.0,
        65520.0,
        1e-7,
        -6e-8,
        3.4e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -1.5e-40,
    ];
    let mut s = 0x2545_f491_4f6c_dd1du64;
    while v.len() < n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let x = f32::from_bits(s as u32);
        v.push(if x.is_finite() { x % 1e5 } else { x });
    }
    v.truncate(n);
    v
}

pub(crate) fn cast_to_half_formats(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let src = tricky_f32(1_001);
    let d = upload(p, &f32_bytes(&src), &stream)?;
    for (dtype, conv) in [
        (
            DType::BF16,
            (|x| bf16::from_f32(x).to_bits()) as fn(f32) -> u16,
        ),
        (DType::F16, |x| f16::from_f32(x).to_bits()),
    ] {
        // Offsets inside both buffers, and guard bytes around the destination.
        let out = p.alloc_device(2 * src.len() + 16)?;
        p.memset_async(&out, 0, 0xEE, out.len(), &stream)?;
        p.launch_kernel(
            Kernel::Cast {
                src: d.at(4),
                src_dtype: DType::F32,
                dst: out.at(8),
                dst_dtype: dtype,
                count: src.len() - 1,
            },
            &stream,
        )?;
        let mut want = vec![0xEEu8; out.len()];
        for (i, x) in src[1..].iter().enumerate() {
            want[8 + 2 * i..10 + 2 * i].copy_from_slice(&conv(*x).to_le_bytes());
        }
        let got = download(p, &out, 0, out.len(), &stream)?;
        // NaN: any quiet NaN is a NaN; compare everything else bit for bit.
        for i in 0..src.len() - 1 {
            if src[i + 1].is_nan() {
                let bits = u16::from_le_bytes([got[8 + 2 * i], got[9 + 2 * i]]);
                if bits & 0x7fff <= if dtype == DType::BF16 { 0x7f80 } else { 0x7c00 } {
                    bail!("{dtype}: NaN became {bits:#06x}");
                }
                want[8 + 2 * i..10 + 2 * i].copy_from_slice(&bits.to_le_bytes());
            }
        }
        check_bytes(&format!("f32 -> {dtype} cast"), &want, &got)?;
    }
    p.destroy_stream(&stream)?;
    Ok(())
}

pub(crate) fn cast_widen_and_to_integers(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let vals: Vec<bf16> = tricky_f32(333).into_iter().map(bf16::from_f32).collect();
    let bytes: Vec<u8> = vals
        .iter()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .collect();
    let d = upload(p, &bytes, &stream)?;
    let wide = p.alloc_device(4 * vals.len())?;
    let ints = p.alloc_device(4 * vals.len())?;
    for (dst, dtype) in [(&wide, DType::F32), (&ints, DType::I32)] {
        p.launch_kernel(
            Kernel::Cast {
                src: d.at(0),
                src_dtype: DType::BF16,
                dst: dst.at(0),
                dst_dtype: dtype,
                count: vals.len(),
            },
            &stream,
        )?;
    }
    let want_wide: Vec<u8> = vals.iter().flat_map(|x| x.to_f32().to_le_bytes()).collect();
    let want_ints: Vec<u8> = vals
        .iter()
        .flat_map(|x| (x.to_f32() as i32).to_le_bytes())
        .collect();
    let got_wide = download(p, &wide, 0, wide.len(), &stream)?;
    // bf16 -> f32 is exact, NaN payload bits included (the low mantissa bits are zero).
    check_bytes("bf16 -> f32 cast", &want_wide, &got_wide)?;
    check_bytes(
        "bf16 -> i32 cast (toward zero, saturating, NaN = 0)",
        &want_ints,
        &download(p, &ints, 0, ints.len(), &stream)?,
    )?;
    p.destroy_stream(&stream)?;
    Ok(())
}

pub(crate) fn fill_scale_axpy(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let n = 777;
    let acc = p.alloc_device(4 * n)?;
    p.launch_kernel(
        Kernel::Fill {
            dst: acc.at(0),
            dtype: DType::F32,
            count: n,
            value: 0.25,
        },
        &stream,
    )?;
    let grads: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32((i as f32 - 300.0) / 7.0))
        .collect();
    let gbytes: Vec<u8> = grads
        .iter()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .collect();
    let g = upload(p, &gbytes, &stream)?;
    for _ in 0..3 {
        p.launch_kernel(
            Kernel::Axpy {
                src: g.at(0),
                src_dtype: DType::BF16,
                dst: acc.at(0),
                dst_dtype: DType::F32,
                count: n,
                alpha: 0.5,
            },
            &stream,
        )?;
    }
    p.launch_kernel(
        Kernel::Scale {
            buf: acc.at(0),
            dtype: DType::F32,
            count: n,
            factor: 1.0 / 3.0,
        },
        &stream,
    )?;
    let want: Vec<f32> = grads
        .iter()
        .map(|x| {
            let mut a = 0.25f32;
            for _ in 0..3 {
                a = (a as f64 + 0.5 * x.to_f64()) as f32;
            }
            (a as f64 * (1.0 / 3.0)) as f32
        })
        .collect();
    check_bytes(
        "fill, 3 x axpy(bf16 -> f32), scale",
        &f32_bytes(&want),
        &download(p, &acc, 0, acc.len(), &stream)?,
    )?;

    // Integer fill, and in-place same-dtype cast (a bit copy onto itself).
    let i = p.alloc_device(8 * 5)?;
    p.launch_kernel(
        Kernel::Fill {
            dst: i.at(8),
            dtype: DType::I64,
            count: 4,
            value: -3.9,
        },
        &stream,
    )?;
    p.launch_kernel(
        Kernel::Cast {
            src: i.at(8),
            src_dtype: DType::I64,
            dst: i.at(8),
            dst_dtype: DType::I64,
            count: 4,
        },
        &stream,
    )?;
    let got = download(p, &i, 8, 32, &stream)?;
    check_bytes("i64 fill of -3.9", &(-3i64).to_le_bytes().repeat(4), &got)?;
    p.destroy_stream(&stream)?;
    Ok(())
}

/// H2D, kernel and D2H queued back to back with one synchronize at the end: under jitter a
/// backend that runs the kernel out of stream order shows the wrong bytes.
pub(crate) fn stream_ordered(p: &dyn Platform) -> Result<()> {
    let s1 = p.create_stream()?;
    let s2 = p.create_stream()?;
    let n = 4_096;
    let src: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let host_in = pinned_with(p, &f32_bytes(&src))?;
    let host_out = pinned_with(p, &vec![0u8; 2 * n])?;
    let d = p.alloc_device(4 * n)?;
    let h = p.alloc_device(2 * n)?;
    let done = p.create_event(false)?;
    for round in 0..4 {
        p.copy_async((&d).into(), 0, (&host_in).into(), 0, 4 * n, &s1)?;
        p.launch_kernel(
            Kernel::Scale {
                buf: d.at(0),
                dtype: DType::F32,
                count: n,
                factor: (round + 1) as f64,
            },
            &s1,
        )?;
        p.record_event(&done, &s1)?;
        p.stream_wait_event(&s2, &done)?;
        p.launch_kernel(
            Kernel::Cast {
                src: d.at(0),
                src_dtype: DType::F32,
                dst: h.at(0),
                dst_dtype: DType::F16,
                count: n,
            },
            &s2,
        )?;
        p.copy_async((&host_out).into(), 0, (&h).into(), 0, 2 * n, &s2)?;
        p.synchronize_stream(&s2)?;
        let want: Vec<u8> = src
            .iter()
            .flat_map(|x| {
                f16::from_f32(x * (round + 1) as f32)
                    .to_bits()
                    .to_le_bytes()
            })
            .collect();
        check_pinned(
            &format!("round {round}: H2D, scale, event, cast, D2H"),
            &want,
            &host_out,
        )?;
        // The next round's H2D overwrites `d`: s2's cast must be done first.
        p.record_event(&done, &s2)?;
        p.stream_wait_event(&s1, &done)?;
    }
    p.destroy_stream(&s1)?;
    p.destroy_stream(&s2)?;
    Ok(())
}

pub(crate) fn host_fn_in_stream_order(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let n = 64 * 1024;
    let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let d = upload(p, &data, &stream)?;
    let staged = pinned_with(p, &vec![0u8; n])?;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let order = Arc::new(AtomicUsize::new(0));
    // D2H, then a host function reading what the D2H wrote: it must see the copied bytes.
    p.copy_async((&staged).into(), 0, (&d).into(), 0, n, &stream)?;
    {
        let staged = staged.clone();
        let seen = Arc::clone(&seen);
        let order = Arc::clone(&order);
        p.launch_host_fn(
            &stream,
            Box::new(move || {
                order.fetch_add(1, Ordering::SeqCst);
                // Waiting is refused here (stream order is what orders a host function).
                let refused = staged.to_vec().map_err(|e| e.kind);
                let mut v = vec![0u8; staged.len()];
                // Stream order: the D2H before this host function finished, and the H2D after
                // it has not started.
                if refused == Err(ErrorKind::Unsupported)
                    // SAFETY: the D2H into `staged`, queued before this host function, has
                    // finished; nothing else queued touches it.
                    && unsafe { staged.read_unsynchronized(0, &mut v) }.is_ok()
                {
                    *seen.lock().unwrap() = v;
                }
                // The host function writes the pinned buffer that the next H2D reads.
                // SAFETY: the H2D out of `staged` is queued after this host function on the
                // same stream, so it cannot run while this writes.
                let _ = unsafe { staged.write_unsynchronized(0, &[0xAB; 16]) };
            }),
        )?;
    }
    p.copy_async((&d).into(), 0, (&staged).into(), 0, 16, &stream)?;
    p.synchronize_stream(&stream)?;
    if order.load(Ordering::SeqCst) != 1 {
        bail!(
            "the host function ran {} times",
            order.load(Ordering::SeqCst)
        );
    }
    check_bytes(
        "bytes the host function saw after the D2H before it",
        &data,
        &seen.lock().unwrap(),
    )?;
    let mut want = data.clone();
    want[..16].fill(0xAB);
    check_bytes(
        "device bytes after the H2D queued after the host function",
        &want,
        &download(p, &d, 0, n, &stream)?,
    )?;
    p.destroy_stream(&stream)?;
    Ok(())
}

/// `launch_host_fn_on_memory`: where device memory is host memory, the host function reads and
/// writes it in stream order, the source stays readable though freed right after the launch,
/// and overlapping or out-of-range places are refused; elsewhere the call is `Unsupported`.
pub(crate) fn host_fn_on_memory(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let n = 64 * 1024;
    let data: Vec<u8> = (0..n).map(|i| (i * 13 % 251) as u8).collect();
    let src = upload(p, &data, &stream)?;
    let dst = p.alloc_device(n)?;
    let unary = |f: fn(u8) -> u8| -> hprt_platform::HostMemoryFn {
        Box::new(move |out: &mut [u8], inp: &[u8]| {
            for (o, i) in out.iter_mut().zip(inp) {
                *o = f(*i);
            }
        })
    };
    if !p.capabilities().device_memory_is_host {
        let r = p.launch_host_fn_on_memory(&stream, (dst.at(0), n), (src.at(0), n), unary(|b| b));
        expect_kind(r, ErrorKind::Unsupported, "host access to device memory")?;
        return Ok(());
    }
    // After a memset of the source's first half: the function must see it.
    p.memset_async(&src, 0, 0x5A, n / 2, &stream)?;
    p.synchronize_stream(&stream)?; // nothing queued holds the source but the function
                                    // Held behind a gate while the source is freed and a buffer of its size is allocated and
                                    // filled: the queued function must still read the source's bytes, not the new buffer's.
    let (open, gate) = std::sync::mpsc::channel::<()>();
    p.launch_host_fn(
        &stream,
        // Bounded: a platform that runs host functions at once (a broken one) must not hang
        // the suite here; opened late, the case only checks less.
        Box::new(move || {
            let _ = gate.recv_timeout(std::time::Duration::from_secs(2));
        }),
    )?;
    p.launch_host_fn_on_memory(
        &stream,
        (dst.at(0), n),
        (src.at(0), n),
        unary(|b| b.wrapping_add(1)),
    )?;
    p.free_device(&src)?; // in stream order: the queued function still reads the bytes
    drop(src);
    let other = p.create_stream()?;
    let reuse = p.alloc_device(n)?;
    p.memset_async(&reuse, 0, 0xEE, n, &other)?;
    p.synchronize_stream(&other)?;
    let _ = open.send(());
    let mut want: Vec<u8> = data.iter().map(|b| b.wrapping_add(1)).collect();
    want[..n / 2].fill(0x5B);
    check_bytes(
        "bytes the host function wrote from device memory freed after its launch",
        &want,
        &download(p, &dst, 0, n, &stream)?,
    )?;
    // Within one buffer: disjoint halves are fine, a shared byte is refused.
    p.launch_host_fn_on_memory(
        &stream,
        (dst.at(n / 2), n / 2),
        (dst.at(0), n / 2),
        unary(|b| b),
    )?;
    let mut halves = want[..n / 2].to_vec();
    halves.extend_from_slice(&want[..n / 2]);
    check_bytes(
        "the second half written from the first",
        &halves,
        &download(p, &dst, 0, n, &stream)?,
    )?;
    let overlapping =
        p.launch_host_fn_on_memory(&stream, (dst.at(1), 16), (dst.at(0), 16), unary(|b| b));
    expect_kind(overlapping, ErrorKind::InvalidValue, "overlapping places")?;
    let beyond =
        p.launch_host_fn_on_memory(&stream, (dst.at(n - 8), 16), (dst.at(0), 16), unary(|b| b));
    expect_kind(
        beyond,
        ErrorKind::OutOfRange,
        "a place past the buffer's end",
    )?;
    p.destroy_stream(&other)?;
    p.destroy_stream(&stream)?;
    Ok(())
}

pub(crate) fn bad_arguments(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let a = p.alloc_device(64)?;
    let b = p.alloc_device(64)?;
    expect_kind(
        p.launch_kernel(
            Kernel::Scale {
                buf: a.at(0),
                dtype: DType::I32,
                count: 4,
                factor: 2.0,
            },
            &stream,
        ),
        ErrorKind::Unsupported,
        "integer scale",
    )?;
    expect_kind(
        p.launch_kernel(
            Kernel::Cast {
                src: a.at(0),
                src_dtype: DType::F32,
                dst: b.at(0),
                dst_dtype: DType::F64,
                count: 9,
            },
            &stream,
        ),
        ErrorKind::OutOfRange,
        "cast writing past the destination",
    )?;
    expect_kind(
        p.launch_kernel(
            Kernel::Cast {
                src: a.at(0),
                src_dtype: DType::F32,
                dst: a.at(4),
                dst_dtype: DType::F32,
                count: 4,
            },
            &stream,
        ),
        ErrorKind::InvalidValue,
        "cast onto a shifted overlap of its source",
    )?;
    // Nothing of the rejected calls ran; an empty kernel is a no-op.
    p.launch_kernel(
        Kernel::Fill {
            dst: a.at(64),
            dtype: DType::F32,
            count: 0,
            value: 1.0,
        },
        &stream,
    )?;
    p.free_device(&b)?;
    expect_kind(
        p.launch_kernel(
            Kernel::Fill {
                dst: b.at(0),
                dtype: DType::U8,
                count: 1,
                value: 1.0,
            },
            &stream,
        ),
        ErrorKind::InvalidHandle,
        "fill of a freed buffer",
    )?;
    p.synchronize_stream(&stream)?;
    p.destroy_stream(&stream)?;
    Ok(())
}

/// `c = a · b` in f32 against a host reference that sums each output's products in order of
/// the inner index, one rounding per product and per sum: the bits every backend must give
/// (a fused multiply-add or a reordered sum changes the last bits of long inner dimensions).
/// Places at offsets, guard bytes around `c`, a degenerate shape, and the rejected calls.
pub(crate) fn matmul_f32(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / 65536.0 - 128.0) * 2f32.powi((s % 11) as i32 - 5)
            })
            .collect()
    };
    for (m, n, k) in [(1, 1, 1), (7, 5, 3), (16, 24, 513), (3, 1, 64), (1, 40, 9)] {
        let (a, b) = (values(m * k), values(k * n));
        let mut want = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for q in 0..k {
                    acc += a[i * k + q] * b[q * n + j];
                }
                want[i * n + j] = acc;
            }
        }
        // `a` and `b` share one buffer at offsets; `c` sits between guard bytes.
        let mut ab = vec![0u8; 12];
        ab.extend(f32_bytes(&a));
        let b_off = ab.len();
        ab.extend(f32_bytes(&b));
        let inputs = upload(p, &ab, &stream)?;
        let out = p.alloc_device(4 * m * n + 32)?;
        p.memset_async(&out, 0, 0xEE, out.len(), &stream)?;
        p.launch_kernel(
            Kernel::Matmul {
                a: inputs.at(12),
                b: inputs.at(b_off),
                c: out.at(16),
                m,
                n,
                k,
                dtype: DType::F32,
            },
            &stream,
        )?;
        let mut expected = vec![0xEEu8; out.len()];
        expected[16..16 + 4 * m * n].copy_from_slice(&f32_bytes(&want));
        let got = download(p, &out, 0, out.len(), &stream)?;
        check_bytes(&format!("matmul {m}x{k}x{n}"), &expected, &got)?;
    }
    let a = p.alloc_device(64)?;
    let c = p.alloc_device(64)?;
    let mm = |a: Place<&DeviceBuffer>, c: Place<&DeviceBuffer>, dtype, k| {
        p.launch_kernel(
            Kernel::Matmul {
                a,
                b: a,
                c,
                m: 2,
                n: 2,
                k,
                dtype,
            },
            &stream,
        )
    };
    expect_kind(
        mm(a.at(0), c.at(0), DType::F64, 2),
        ErrorKind::Unsupported,
        "f64 matmul",
    )?;
    expect_kind(
        mm(a.at(0), a.at(0), DType::F32, 2),
        ErrorKind::InvalidValue,
        "matmul writing over its own input",
    )?;
    expect_kind(
        mm(a.at(0), c.at(56), DType::F32, 2),
        ErrorKind::OutOfRange,
        "matmul writing past the output",
    )?;
    expect_kind(
        mm(a.at(0), c.at(0), DType::F32, 0),
        ErrorKind::InvalidValue,
        "matmul with an empty inner dimension",
    )?;
    p.synchronize_stream(&stream)?;
    Ok(())
}

/// A host function that panics is an error at its stream's next synchronize (reported once),
/// never swallowed; the stream keeps working.
pub(crate) fn host_fn_panic_is_reported(p: &dyn Platform) -> Result<()> {
    let stream = p.create_stream()?;
    let d = p.alloc_device(64)?;
    p.launch_host_fn(&stream, Box::new(|| panic!("a host function failed")))?;
    p.memset_async(&d, 0, 5, 64, &stream)?;
    expect_err(
        p.synchronize_stream(&stream),
        "synchronize after a panicking host function",
    )?;
    p.synchronize_stream(&stream)?;
    check_bytes(
        "work queued after the panicking host function",
        &[5u8; 64],
        &download(p, &d, 0, 64, &stream)?,
    )?;
    p.destroy_stream(&stream)?;
    Ok(())
}

/// A panicking host function's error reaches what is ordered after it, as a queued device error
/// does (`error/queued_error_reaches_waiters`): an event recorded after it, a stream that waited
/// on that event, and a device synchronize once its stream was destroyed. What was recorded
/// before it, and what is recorded after its stream reported it, is clean.
pub(crate) fn host_fn_panic_reaches_waiters(p: &dyn Platform) -> Result<()> {
    let (a, b) = (p.create_stream()?, p.create_stream()?);
    let d = p.alloc_device(64)?;
    let (before, after) = (p.create_event(false)?, p.create_event(false)?);
    p.record_event(&before, &a)?;
    p.launch_host_fn(&a, Box::new(|| panic!("a host function failed")))?;
    p.record_event(&after, &a)?;
    p.stream_wait_event(&b, &after)?;
    p.memset_async(&d, 0, 5, 64, &b)?;
    p.synchronize_event(&before)
        .context("an event recorded before the panicking host function")?;
    expect_err(
        p.synchronize_event(&after),
        "an event recorded after the panicking host function",
    )?;
    expect_err(
        p.synchronize_stream(&b),
        "a stream that waited on an event recorded after the panicking host function",
    )?;
    expect_err(p.synchronize_stream(&a), "the host function's own stream")?;
    p.record_event(&after, &a)?;
    p.stream_wait_event(&b, &after)?;
    p.synchronize_stream(&b)
        .context("a wait on an event recorded after the panic was reported")?;

    let c = p.create_stream()?;
    p.launch_host_fn(&c, Box::new(|| panic!("a host function failed")))?;
    p.destroy_stream(&c)?;
    expect_err(
        p.synchronize_device(),
        "a device synchronize after the panicking host function's stream was destroyed",
    )?;
    p.synchronize_device()
        .context("a second device synchronize (the panic was reported)")?;
    p.destroy_stream(&a)?;
    p.destroy_stream(&b)?;
    Ok(())
}
