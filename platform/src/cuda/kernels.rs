//! The [`Kernel`] set as CUDA C for NVRTC: one module with a kernel per operation and dtype
//! combination, generated here and compiled once per device.
//!
//! The device code mirrors the host reference (`kernel::run_on_host`) step for step: loads widen
//! floats to `double` and integers to `long long`; float results round once to the destination
//! (f64 → f16/bf16 through an f32 rounded to odd, then round to nearest even, as on the host);
//! float → integer truncates and saturates with NaN → 0; integer → integer wraps. Half formats
//! are converted in software with the `half` crate's algorithms, NaN payloads included, and
//! f32 ↔ f64 NaNs keep their payload as x86 conversions do. Arithmetic uses `__dmul_rn` /
//! `__dadd_rn` and the module is compiled with `--fmad=false`, so `d + alpha * s` is never
//! contracted into an FMA the host does not do. The matmul is naive (one thread per output, the
//! inner dimension summed in order with `__fmul_rn` / `__fadd_rn` in f32) because its contract
//! is the host's bits, not speed. Every kernel takes an `aligned` flag: unaligned places are
//! read and written byte by byte.

use std::fmt::Write as _;

use crate::dtype::DType;
use crate::kernel::Kernel;

/// The module's name for NVRTC and the per-device cache.
pub(crate) const MODULE: &str = "hprt_elementwise.cu";

/// Threads per block of every launch.
pub(crate) const BLOCK: u32 = 256;

/// Grid size for `count` elements: one thread per element up to a cap, grid-stride beyond it.
pub(crate) fn grid_for(count: usize) -> u32 {
    const MAX_BLOCKS: usize = 1 << 16;
    count.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32
}

/// The C type that holds one element's bits.
pub(crate) fn c_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 | DType::BF16 => "unsigned short",
        DType::I8 => "signed char",
        DType::U8 => "unsigned char",
        DType::I32 => "int",
        DType::I64 => "long long",
    }
}

/// The exported name of the kernel that runs `k`, or `None` for a same-dtype cast (a copy).
pub(crate) fn kernel_name<B>(k: &Kernel<B>) -> Option<String> {
    let (src, dst) = k.dtypes();
    Some(match k {
        Kernel::Fill { .. } => format!("hprt_fill_{dst}"),
        Kernel::Cast { .. } if src == dst => return None,
        Kernel::Cast { .. } => format!("hprt_cast_{src}_to_{dst}"),
        Kernel::Scale { .. } => format!("hprt_scale_{dst}"),
        Kernel::Axpy { .. } => format!("hprt_axpy_{src}_to_{dst}"),
        Kernel::Matmul { .. } => format!("hprt_matmul_{dst}"),
    })
}

/// Conversions and element access shared by every kernel (see the module docs).
const PRELUDE: &str = r#"
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

template <typename T>
__device__ __forceinline__ T ld(const unsigned char* p, u64 i, int aligned) {
    if (aligned) return reinterpret_cast<const T*>(p)[i];
    T v;
    unsigned char* b = reinterpret_cast<unsigned char*>(&v);
    for (u64 k = 0; k < sizeof(T); ++k) b[k] = p[i * sizeof(T) + k];
    return v;
}

template <typename T>
__device__ __forceinline__ void st(unsigned char* p, u64 i, int aligned, T v) {
    if (aligned) { reinterpret_cast<T*>(p)[i] = v; return; }
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&v);
    for (u64 k = 0; k < sizeof(T); ++k) p[i * sizeof(T) + k] = b[k];
}

__device__ __forceinline__ double f32_to_f64(float x) {
    if (x != x) {
        u32 b = __float_as_uint(x);
        u64 r = ((u64)(b & 0x80000000u) << 32) | 0x7ff8000000000000ull
              | ((u64)(b & 0x007fffffu) << 29);
        return __longlong_as_double((i64)r);
    }
    return (double)x;
}

__device__ __forceinline__ float f64_to_f32(double x) {
    if (x != x) {
        u64 b = (u64)__double_as_longlong(x);
        u32 r = ((u32)(b >> 32) & 0x80000000u) | 0x7fc00000u | (u32)((b >> 29) & 0x007fffffu);
        return __uint_as_float(r);
    }
    return __double2float_rn(x);
}

// f64 -> f32 toward zero with the last bit set when inexact: rounding that once more to a
// format with fewer mantissa bits gives the correctly rounded result.
__device__ __forceinline__ float f64_to_f32_odd(double x) {
    if (x != x) return f64_to_f32(x);
    float t = __double2float_rz(x);
    if ((double)t == x) return t;
    return __uint_as_float(__float_as_uint(t) | 1u);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exp = h & 0x7c00u;
    u32 man = h & 0x03ffu;
    if ((h & 0x7fffu) == 0) return __uint_as_float(sign);
    if (exp == 0x7c00u) {
        if (man == 0) return __uint_as_float(sign | 0x7f800000u);
        return __uint_as_float(sign | 0x7fc00000u | (man << 13));
    }
    if (exp == 0) {
        int e = 0;
        while ((man & 0x0400u) == 0) { man <<= 1; ++e; }
        return __uint_as_float(sign | ((u32)(113 - e) << 23) | ((man & 0x03ffu) << 13));
    }
    return __uint_as_float(sign | (((exp >> 10) + 112u) << 23) | (man << 13));
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = x & 0x80000000u, exp = x & 0x7f800000u, man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        u32 nan_bit = man == 0 ? 0u : 0x0200u;
        return (u16)((sign >> 16) | 0x7c00u | nan_bit | (man >> 13));
    }
    u32 half_sign = sign >> 16;
    int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) return (u16)(half_sign | 0x7c00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (u16)half_sign;
        u32 m = man | 0x00800000u;
        u32 half_man = m >> (14 - half_exp);
        u32 round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) half_man += 1;
        return (u16)(half_sign | half_man);
    }
    u32 r = half_sign | ((u32)half_exp << 10) | (man >> 13);
    u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) r += 1;
    return (u16)r;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    if ((h & 0x7fffu) > 0x7f80u) return __uint_as_float(((u32)h | 0x0040u) << 16);
    return __uint_as_float((u32)h << 16);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
    u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) return (u16)((x >> 16) + 1u);
    return (u16)(x >> 16);
}

// Rust `as` from f64 to an integer: toward zero, saturating, NaN -> 0.
__device__ __forceinline__ i64 f64_to_int(double x, double lo, double hi, i64 lo_i, i64 hi_i) {
    if (x != x) return 0;
    if (x <= lo) return lo_i;
    if (x >= hi) return hi_i;
    return __double2ll_rz(x);
}
"#;

/// Whether a load of `d` yields a `double` (floats) or a `long long` (integers).
fn value_suffix(d: DType) -> &'static str {
    if d.is_float() {
        "f"
    } else {
        "i"
    }
}

fn load_fn(d: DType) -> String {
    let t = c_type(d);
    let body = match d {
        DType::F32 => format!("return f32_to_f64(ld<{t}>(p, i, a));"),
        DType::F64 => format!("return ld<{t}>(p, i, a);"),
        DType::F16 => format!("return f32_to_f64(f16_to_f32(ld<{t}>(p, i, a)));"),
        DType::BF16 => format!("return f32_to_f64(bf16_to_f32(ld<{t}>(p, i, a)));"),
        _ => format!("return (i64)ld<{t}>(p, i, a);"),
    };
    let ret = if d.is_float() { "double" } else { "i64" };
    format!(
        "__device__ __forceinline__ {ret} load_{d}(const unsigned char* p, u64 i, int a) {{ {body} }}\n"
    )
}

/// Integer bounds as f64 thresholds and as values, for the saturating float → integer store.
fn int_bounds(d: DType) -> (&'static str, &'static str, &'static str, &'static str) {
    match d {
        DType::I8 => ("-128.0", "127.0", "-128LL", "127LL"),
        DType::U8 => ("0.0", "255.0", "0LL", "255LL"),
        DType::I32 => (
            "-2147483648.0",
            "2147483647.0",
            "-2147483648LL",
            "2147483647LL",
        ),
        // 2^63 is the first f64 at or above i64::MAX.
        DType::I64 => (
            "-9223372036854775808.0",
            "9223372036854775808.0",
            "(-9223372036854775807LL - 1)",
            "9223372036854775807LL",
        ),
        _ => unreachable!("int_bounds is only asked for integer dtypes"),
    }
}

fn store_fns(d: DType) -> String {
    let t = c_type(d);
    let (from_f, from_i) = match d {
        DType::F32 => ("f64_to_f32(x)".to_string(), "__ll2float_rn(n)".to_string()),
        DType::F64 => ("x".into(), "__ll2double_rn(n)".into()),
        DType::F16 => (
            "f32_to_f16(f64_to_f32_odd(x))".into(),
            "f32_to_f16(f64_to_f32_odd(__ll2double_rn(n)))".into(),
        ),
        DType::BF16 => (
            "f32_to_bf16(f64_to_f32_odd(x))".into(),
            "f32_to_bf16(f64_to_f32_odd(__ll2double_rn(n)))".into(),
        ),
        _ => {
            let (lo, hi, lo_i, hi_i) = int_bounds(d);
            (
                format!("({t})f64_to_int(x, {lo}, {hi}, {lo_i}, {hi_i})"),
                format!("({t})n"),
            )
        }
    };
    format!(
        "__device__ __forceinline__ void store_{d}_f(unsigned char* p, u64 i, int a, double x) {{ st<{t}>(p, i, a, {from_f}); }}\n\
         __device__ __forceinline__ void store_{d}_i(unsigned char* p, u64 i, int a, i64 n) {{ st<{t}>(p, i, a, {from_i}); }}\n"
    )
}

const LOOP: &str =
    "for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)";

/// The whole module: prelude, per-dtype element access, and every kernel.
pub(crate) fn source() -> String {
    let mut s = String::from(PRELUDE);
    for d in DType::ALL {
        s += &load_fn(d);
        s += &store_fns(d);
    }
    for d in DType::ALL {
        let _ = writeln!(
            s,
            "extern \"C\" __global__ void hprt_fill_{d}(unsigned char* dst, u64 n, double value, int a) {{ {LOOP} store_{d}_f(dst, i, a, value); }}"
        );
        for src in DType::ALL.into_iter().filter(|s| *s != d) {
            let v = value_suffix(src);
            let _ = writeln!(
                s,
                "extern \"C\" __global__ void hprt_cast_{src}_to_{d}(const unsigned char* src, unsigned char* dst, u64 n, int a) {{ {LOOP} store_{d}_{v}(dst, i, a, load_{src}(src, i, a)); }}"
            );
        }
        if d.is_float() {
            let _ = writeln!(
                s,
                "extern \"C\" __global__ void hprt_scale_{d}(unsigned char* buf, u64 n, double factor, int a) {{ {LOOP} store_{d}_f(buf, i, a, __dmul_rn(load_{d}(buf, i, a), factor)); }}"
            );
            for src in DType::ALL.into_iter().filter(|s| s.is_float()) {
                let _ = writeln!(
                    s,
                    "extern \"C\" __global__ void hprt_axpy_{src}_to_{d}(const unsigned char* src, unsigned char* dst, u64 n, double alpha, int a) {{ {LOOP} store_{d}_f(dst, i, a, __dadd_rn(load_{d}(dst, i, a), __dmul_rn(alpha, load_{src}(src, i, a)))); }}"
                );
            }
        }
    }
    s += MATMUL;
    s
}

/// `c[i][j] = sum over p in order of a[i][p] * b[p][j]`, f32 from 0.0, never fused.
const MATMUL: &str = r#"
extern "C" __global__ void hprt_matmul_f32(const unsigned char* a, const unsigned char* b, unsigned char* c, u64 m, u64 n, u64 k, int al) {
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < m * n; idx += (u64)gridDim.x * blockDim.x) {
        u64 i = idx / n, j = idx % n;
        float acc = 0.0f;
        for (u64 p = 0; p < k; ++p)
            acc = __fadd_rn(acc, __fmul_rn(ld<float>(a, i * k + p, al), ld<float>(b, p * n + j, al)));
        st<float>(c, idx, al, acc);
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kernel() -> Vec<Kernel<()>> {
        let mut v = Vec::new();
        for d in DType::ALL {
            v.push(Kernel::Fill {
                dst: (),
                dtype: d,
                count: 1,
                value: 0.0,
            });
            v.push(Kernel::Scale {
                buf: (),
                dtype: d,
                count: 1,
                factor: 1.0,
            });
            for s in DType::ALL {
                v.push(Kernel::Cast {
                    src: (),
                    src_dtype: s,
                    dst: (),
                    dst_dtype: d,
                    count: 1,
                });
                v.push(Kernel::Axpy {
                    src: (),
                    src_dtype: s,
                    dst: (),
                    dst_dtype: d,
                    count: 1,
                    alpha: 1.0,
                });
            }
            v.push(Kernel::Matmul {
                a: (),
                b: (),
                c: (),
                m: 1,
                n: 1,
                k: 1,
                dtype: d,
            });
        }
        v
    }

    #[test]
    fn every_valid_kernel_is_defined_exactly_once() {
        let src = source();
        let mut defined = 0;
        for k in every_kernel() {
            if k.validate(crate::BackendKind::Cuda).is_err() {
                continue;
            }
            match kernel_name(&k) {
                None => assert!(
                    matches!(k, Kernel::Cast { src_dtype, dst_dtype, .. } if src_dtype == dst_dtype)
                ),
                Some(name) => {
                    let decl = format!("__global__ void {name}(");
                    assert_eq!(src.matches(&decl).count(), 1, "{name}");
                    defined += 1;
                }
            }
        }
        // 8 fills, 56 casts, 4 scales, 16 axpys, 1 matmul; nothing else is exported.
        assert_eq!(defined, 8 + 56 + 4 + 16 + 1);
        assert_eq!(src.matches("__global__").count(), defined);
    }

    #[test]
    fn c_types_have_the_dtype_sizes() {
        let size = |t: &str| match t {
            "float" | "int" => 4,
            "double" | "long long" => 8,
            "unsigned short" => 2,
            "signed char" | "unsigned char" => 1,
            other => panic!("unknown C type {other}"),
        };
        for d in DType::ALL {
            assert_eq!(size(c_type(d)), d.size(), "{d}");
        }
    }

    #[test]
    fn integer_bounds_are_the_types_limits() {
        for (d, lo, hi) in [
            (DType::I8, i8::MIN as i64, i8::MAX as i64),
            (DType::U8, 0, u8::MAX as i64),
            (DType::I32, i32::MIN as i64, i32::MAX as i64),
            (DType::I64, i64::MIN, i64::MAX),
        ] {
            let (lo_f, hi_f, _, _) = int_bounds(d);
            assert_eq!(lo_f.parse::<f64>().unwrap(), lo as f64, "{d}");
            assert_eq!(hi_f.parse::<f64>().unwrap(), hi as f64, "{d}");
        }
    }

    #[test]
    fn the_grid_covers_every_element_or_strides() {
        assert_eq!(grid_for(0), 1);
        assert_eq!(grid_for(1), 1);
        assert_eq!(grid_for(256), 1);
        assert_eq!(grid_for(257), 2);
        assert_eq!(grid_for(usize::MAX / 2), 1 << 16);
    }
}

/// The generated source compiled as host C++ (CUDA's intrinsics given their IEEE meaning) and
/// run against the host reference, so the device code's semantics are checked without a GPU.
/// Needs a C++ compiler (`$CXX`, default `c++`), as building this crate already does.
#[cfg(test)]
mod host_compiled {
    use super::*;
    use crate::kernel::run_on_host;

    /// CUDA's device names as host C++, shared with the CUDA emulator's NVRTC.
    const SHIM: &str = include_str!("host_shim.h");

    /// The generated source, built once per process: the tests run in parallel, and two
    /// builds writing one path let a test load a library the other is still writing.
    fn library() -> &'static libloading::Library {
        static LIB: std::sync::OnceLock<libloading::Library> = std::sync::OnceLock::new();
        LIB.get_or_init(compile)
    }

    fn compile() -> libloading::Library {
        let dir = std::env::temp_dir().join(format!("hprt-cuda-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("kernels.cpp");
        let lib = dir.join("libkernels.so");
        std::fs::write(&src, format!("{SHIM}\n{}", source())).unwrap();
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = std::process::Command::new(&cxx)
            .args(["-std=c++14", "-O1", "-shared", "-fPIC", "-ffp-contract=off"])
            .args(["-frounding-math", "-Wall", "-Werror", "-o"])
            .arg(&lib)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("cannot run the C++ compiler {cxx:?}: {e}"));
        assert!(
            out.status.success(),
            "the generated kernel source does not compile:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // SAFETY: a library we just built from our own source.
        unsafe { libloading::Library::new(&lib) }.unwrap()
    }

    /// Bytes of `n` elements of `d` full of rounding cases: ties, subnormals, overflow, NaN
    /// payloads, ±0, integer extremes, and pseudo-random bit patterns.
    fn inputs(d: DType, n: usize, seed: u64) -> Vec<u8> {
        let special: Vec<f64> = vec![
            0.0,
            -0.0,
            1.0,
            1.0 + 2f64.powi(-8),
            1.0 + 2f64.powi(-8) + 2f64.powi(-40),
            65504.0,
            65520.0,
            1e-7,
            -6e-8,
            3.4e38,
            1e300,
            -1e-300,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            -127.5,
            255.9,
            -2147483648.7,
            9.3e18,
            -9.3e18,
            2.5,
            -3.5,
        ];
        let mut s = seed | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out = Vec::with_capacity(n * d.size());
        for i in 0..n {
            let r = next();
            let bytes: Vec<u8> = match d {
                DType::F64 if i < special.len() => special[i].to_le_bytes().to_vec(),
                DType::F32 if i < special.len() => (special[i] as f32).to_le_bytes().to_vec(),
                DType::F16 if i < special.len() => {
                    half::f16::from_f64(special[i]).to_le_bytes().to_vec()
                }
                DType::BF16 if i < special.len() => {
                    half::bf16::from_f64(special[i]).to_le_bytes().to_vec()
                }
                // Random floats of moderate size (half of them), random bits otherwise.
                DType::F64 if r % 2 == 0 => ((r >> 11) as f64 / 2f64.powi(40) - 2000.0)
                    .to_le_bytes()
                    .to_vec(),
                DType::F32 if r % 2 == 0 => (((r >> 40) as f32) / 1024.0 - 4096.0)
                    .to_le_bytes()
                    .to_vec(),
                _ => r.to_le_bytes()[..d.size()].to_vec(),
            };
            out.extend_from_slice(&bytes);
        }
        out
    }

    type Fill = unsafe extern "C" fn(*mut u8, u64, f64, i32);
    type Cast = unsafe extern "C" fn(*const u8, *mut u8, u64, i32);
    type Axpy = unsafe extern "C" fn(*const u8, *mut u8, u64, f64, i32);

    /// Runs one kernel through the compiled source (at byte offset `skew`, aligned flag set
    /// accordingly) and through the host reference; returns both results.
    fn both(lib: &libloading::Library, k: &Kernel<()>, skew: usize) -> (Vec<u8>, Vec<u8>) {
        let name = kernel_name(k).unwrap();
        let n = k.count();
        let (src_dtype, dst_dtype) = k.dtypes();
        let seed = name
            .bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31) ^ b as u64);
        let mut src = vec![0u8; skew];
        src.extend(inputs(src_dtype, n, seed));
        let mut dst = vec![0u8; skew];
        dst.extend(inputs(dst_dtype, n, seed ^ 0xABCD));
        let (mut dev_dst, mut host_dst) = (dst.clone(), dst.clone());
        let aligned = i32::from(skew == 0);
        let fname = format!("{name}\0");
        // SAFETY: the signatures are those `source()` generates; buffers hold n elements
        // after `skew` bytes.
        unsafe {
            let (s, d) = (src.as_ptr().add(skew), dev_dst.as_mut_ptr().add(skew));
            match *k {
                Kernel::Fill { value, .. } => {
                    lib.get::<Fill>(fname.as_bytes()).unwrap()(d, n as u64, value, aligned)
                }
                Kernel::Scale { factor, .. } => {
                    lib.get::<Fill>(fname.as_bytes()).unwrap()(d, n as u64, factor, aligned)
                }
                Kernel::Cast { .. } => {
                    lib.get::<Cast>(fname.as_bytes()).unwrap()(s, d, n as u64, aligned)
                }
                Kernel::Axpy { alpha, .. } => {
                    lib.get::<Axpy>(fname.as_bytes()).unwrap()(s, d, n as u64, alpha, aligned)
                }
                Kernel::Matmul { .. } => unreachable!("matmuls are checked by their own test"),
            }
            let mut src_copy = src.clone();
            let s = src_copy.as_mut_ptr().add(skew);
            let d = host_dst.as_mut_ptr().add(skew);
            let hk = match *k {
                Kernel::Fill {
                    dtype,
                    count,
                    value,
                    ..
                } => Kernel::Fill {
                    dst: d,
                    dtype,
                    count,
                    value,
                },
                Kernel::Scale {
                    dtype,
                    count,
                    factor,
                    ..
                } => Kernel::Scale {
                    buf: d,
                    dtype,
                    count,
                    factor,
                },
                Kernel::Cast {
                    src_dtype,
                    dst_dtype,
                    count,
                    ..
                } => Kernel::Cast {
                    src: s,
                    src_dtype,
                    dst: d,
                    dst_dtype,
                    count,
                },
                Kernel::Axpy {
                    src_dtype,
                    dst_dtype,
                    count,
                    alpha,
                    ..
                } => Kernel::Axpy {
                    src: s,
                    src_dtype,
                    dst: d,
                    dst_dtype,
                    count,
                    alpha,
                },
                Kernel::Matmul { .. } => unreachable!("matmuls are checked by their own test"),
            };
            run_on_host(&hk);
        }
        (dev_dst, host_dst)
    }

    type Matmul = unsafe extern "C" fn(*const u8, *const u8, *mut u8, u64, u64, u64, i32);

    /// Shapes with a long inner dimension (where a fused multiply-add or a reordered sum would
    /// change the last bits), degenerate ones, and both alignments.
    #[test]
    fn generated_matmul_matches_the_host_reference_bit_for_bit() {
        let lib = library();
        // SAFETY: the signature `MATMUL` defines.
        let f = unsafe { lib.get::<Matmul>(b"hprt_matmul_f32\0") }.unwrap();
        for (m, n, k) in [
            (1, 1, 1),
            (3, 5, 7),
            (17, 9, 300),
            (1, 64, 1000),
            (8, 1, 33),
        ] {
            for skew in [0usize, 2] {
                // Finite values of mixed sign and magnitude (NaN payloads are exempt).
                let vals = |len: usize, seed: u64| -> Vec<u8> {
                    let mut bytes = vec![0u8; skew];
                    let mut x = seed | 1;
                    for _ in 0..len {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let v =
                            ((x >> 40) as f32 / 65536.0 - 128.0) * 2f32.powi((x % 9) as i32 - 4);
                        bytes.extend(v.to_le_bytes());
                    }
                    bytes
                };
                let (mut a, mut b) = (vals(m * k, 11 + k as u64), vals(k * n, 29 + n as u64));
                let mut dev = vec![0xAAu8; skew + m * n * 4];
                let mut host = dev.clone();
                // SAFETY: each buffer holds its matrix after `skew` bytes; c overlaps neither.
                unsafe {
                    let (pa, pb) = (a.as_mut_ptr().add(skew), b.as_mut_ptr().add(skew));
                    f(
                        pa,
                        pb,
                        dev.as_mut_ptr().add(skew),
                        m as u64,
                        n as u64,
                        k as u64,
                        i32::from(skew == 0),
                    );
                    run_on_host(&Kernel::Matmul {
                        a: pa,
                        b: pb,
                        c: host.as_mut_ptr().add(skew),
                        m,
                        n,
                        k,
                        dtype: DType::F32,
                    });
                }
                assert_eq!(dev, host, "matmul {m}x{k}x{n} skew {skew}");
                assert!(
                    host[skew..].chunks(4).any(|c| c != [0xAA; 4]),
                    "outputs written"
                );
            }
        }
    }

    #[test]
    fn generated_kernels_match_the_host_reference_bit_for_bit() {
        let lib = library();
        let n = 300;
        let mut kernels = Vec::new();
        for d in DType::ALL {
            for value in [
                0.25,
                -3.9,
                1e10,
                f64::NAN,
                1.0 + 2f64.powi(-11) + 2f64.powi(-40),
            ] {
                kernels.push(Kernel::Fill {
                    dst: (),
                    dtype: d,
                    count: n,
                    value,
                });
            }
            if d.is_float() {
                kernels.push(Kernel::Scale {
                    buf: (),
                    dtype: d,
                    count: n,
                    factor: 1.0 / 3.0,
                });
            }
            for s in DType::ALL.into_iter().filter(|s| *s != d) {
                kernels.push(Kernel::Cast {
                    src: (),
                    src_dtype: s,
                    dst: (),
                    dst_dtype: d,
                    count: n,
                });
            }
            for s in DType::ALL
                .into_iter()
                .filter(|s| s.is_float() && d.is_float())
            {
                kernels.push(Kernel::Axpy {
                    src: (),
                    src_dtype: s,
                    dst: (),
                    dst_dtype: d,
                    count: n,
                    alpha: -0.1,
                });
            }
        }
        let mut failures = Vec::new();
        for k in &kernels {
            for skew in [0, 1] {
                let (dev, host) = both(lib, k, skew);
                if dev != host {
                    let name = kernel_name(k).unwrap();
                    let i = dev.iter().zip(&host).position(|(a, b)| a != b).unwrap();
                    failures.push(format!(
                        "{name} (skew {skew}): first differing byte {i}: {:#04x} vs host {:#04x}",
                        dev[i], host[i]
                    ));
                }
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} runs differ:\n{}",
            failures.len(),
            kernels.len() * 2,
            failures.join("\n")
        );
    }
}
