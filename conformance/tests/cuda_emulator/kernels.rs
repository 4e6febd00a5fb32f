//! Every shipped kernel against the host reference's bytes.

use super::*;

/// `n` bytes of pseudo-random bits (NaN payloads, subnormals, integer extremes included).
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

fn is_nan(dtype: DType, b: &[u8]) -> bool {
    let h = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    match dtype {
        DType::F16 => h(b) & 0x7c00 == 0x7c00 && h(b) & 0x03ff != 0,
        DType::BF16 => h(b) & 0x7f80 == 0x7f80 && h(b) & 0x007f != 0,
        DType::F32 => f32::from_le_bytes(b.try_into().unwrap()).is_nan(),
        DType::F64 => f64::from_le_bytes(b.try_into().unwrap()).is_nan(),
        _ => false,
    }
}

/// Every kernel the project ships (each fill, cast, scale and axpy of every dtype combination,
/// and the matmul), at an aligned and an unaligned offset, runs through NVRTC and
/// `cuLaunchKernel` on the emulator and produces the bytes of the cpu backend, whose kernels are
/// the host reference. Fills and casts match bit for bit, NaN payloads included; a NaN that
/// arithmetic (scale, axpy, matmul) produces from NaN inputs matches as a NaN: which operand's
/// payload and sign it carries is not specified (x86 keeps an operand's, depending on the order
/// the compiler chose; NVIDIA GPUs return the canonical NaN).
#[test]
fn every_shipped_kernel_produces_the_host_references_bytes() {
    use hprt_platform::{CpuBackend, CpuConfig};
    let _g = serial();
    let cuda = open().unwrap();
    let cpu = CpuBackend::new(CpuConfig::default());
    let mut kernels: Vec<Kernel<()>> = Vec::new();
    for d in DType::ALL {
        kernels.push(Kernel::Fill {
            dst: (),
            dtype: d,
            count: 97,
            value: -1234.567,
        });
        for s in DType::ALL {
            kernels.push(Kernel::Cast {
                src: (),
                src_dtype: s,
                dst: (),
                dst_dtype: d,
                count: 301,
            });
            if s.is_float() && d.is_float() {
                kernels.push(Kernel::Axpy {
                    src: (),
                    src_dtype: s,
                    dst: (),
                    dst_dtype: d,
                    count: 301,
                    alpha: -0.3,
                });
            }
        }
        if d.is_float() {
            kernels.push(Kernel::Scale {
                buf: (),
                dtype: d,
                count: 301,
                factor: 1.0 / 3.0,
            });
        }
    }
    kernels.push(Kernel::Matmul {
        a: (),
        b: (),
        c: (),
        m: 7,
        n: 5,
        k: 129,
        dtype: DType::F32,
    });
    let mut ran = 0;
    for (i, k) in kernels.iter().enumerate() {
        for skew in [0usize, 1] {
            // Each platform gets the same input bytes in buffers of the same layout.
            let results: Vec<Vec<Vec<u8>>> = [&cuda as &dyn Platform, &cpu]
                .iter()
                .map(|p| {
                    let s = p.create_stream().unwrap();
                    let bufs: Vec<(hprt_platform::DeviceBuffer, usize)> = k
                        .places()
                        .iter()
                        .enumerate()
                        .map(|(j, (_, bytes, _))| {
                            let b = p.alloc_device(bytes + skew).unwrap();
                            let data = random_bytes(bytes + skew, (i * 4 + j) as u64 + 1);
                            p.write_device_sync(&b, 0, &data, &s).unwrap();
                            (b, *bytes)
                        })
                        .collect();
                    let mut next = bufs.iter();
                    let launch = (*k)
                        .try_map(|()| Ok(next.next().expect("one buffer per place").0.at(skew)));
                    p.launch_kernel(launch.unwrap(), &s)
                        .unwrap_or_else(|e| panic!("{} on {}: {e}", k.name(), p.backend()));
                    bufs.iter()
                        .map(|(b, bytes)| {
                            let mut out = vec![0u8; *bytes];
                            p.read_device_sync(b, skew, &mut out, &s).unwrap();
                            out
                        })
                        .collect()
                })
                .collect();
            let arithmetic = matches!(
                k,
                Kernel::Scale { .. } | Kernel::Axpy { .. } | Kernel::Matmul { .. }
            );
            for (place, ((got, want), dtype)) in results[0]
                .iter()
                .zip(&results[1])
                .zip(k.place_dtypes())
                .enumerate()
            {
                let size = dtype.size();
                let first = got.chunks(size).zip(want.chunks(size)).position(|(a, b)| {
                    a != b && !(arithmetic && is_nan(dtype, a) && is_nan(dtype, b))
                });
                assert!(
                    first.is_none(),
                    "{k:?} at offset {skew}: place {place} differs from the host reference at element {first:?}"
                );
            }
            ran += 1;
        }
    }
    assert!(ran > 150, "{ran}");
}
