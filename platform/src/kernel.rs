//! Elementwise device kernels and host functions on streams.
//!
//! The modules above `platform` need a little device compute of their own: dtype casts for mixed
//! precision, gradient accumulation with conversion, gradient scaling and fills. [`Kernel`] is
//! that set, one definition for every backend, so a cast gives the same bits on cpu, npu and cuda.
//!
//! Semantics, element by element:
//! - `Cast`: equal dtypes copy the bits (NaN payloads included). Float to float rounds to nearest
//!   even, correctly (no double rounding through f32). Float to integer follows Rust `as`
//!   (toward zero, saturating, NaN to 0). Integer to float rounds to nearest (exact below 2^53).
//!   Integer to integer wraps like Rust `as`.
//! - `Fill`: `value` converted to the dtype like a cast from f64.
//! - `Scale` and `Axpy`: float dtypes only (others are `Unsupported`); the arithmetic is done in
//!   f64 and rounded to the destination dtype like a cast.
//! - `Matmul`: f32 only (others are `Unsupported`). Each output is accumulated in f32 from 0.0,
//!   over the inner dimension in order, one rounded product and one rounded sum per step (never
//!   a fused multiply-add), so every backend gives the same bits for finite inputs (a NaN's
//!   payload may differ between backends, as their hardware propagates NaNs differently).

use crate::dtype::DType;
use crate::error::{BackendKind, Error, ErrorKind, Result};

/// A host closure run in stream order (after everything queued before it, before everything
/// queued after it), like `cuLaunchHostFunc`. It must not call back into the platform's stream
/// functions for the same stream.
pub type HostFn = Box<dyn FnOnce() + Send + 'static>;

/// A host closure run in stream order with device memory to write (its first argument) and to
/// read (its second), where device memory is host memory
/// ([`crate::Platform::launch_host_fn_on_memory`]).
pub type HostMemoryFn = Box<dyn FnOnce(&mut [u8], &[u8]) + Send + 'static>;

/// CUDA C that a crate above the platform brings (the codec's kernels, `hprt-compress`): the
/// cuda backend compiles it with NVRTC once per device, like its own elementwise kernels, and
/// caches it under `name`, which must therefore identify the source. Other backends have no
/// CUDA C compiler and refuse its launches with `Unsupported`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceModule {
    pub name: &'static str,
    pub source: &'static str,
}

/// One parameter of a [`DeviceModule`] kernel, in the kernel's order; `B` is a place in device
/// memory (a `Place<&DeviceBuffer>` ([`crate::Place`]) for callers).
#[derive(Clone, Copy, Debug)]
pub enum KernelArg<B> {
    /// A pointer to `bytes` bytes at `at` (bounds-checked; the memory is not freed before the
    /// launch ran). The kernel may only touch those bytes, as `access` says.
    Ptr {
        at: B,
        bytes: usize,
        access: Access,
    },
    U32(u32),
    U64(u64),
}

/// A one-dimensional launch: `grid` blocks of `block` threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: u32,
    pub block: u32,
}

/// One elementwise kernel over `count` elements; `B` is a place in device memory (a
/// `Place<&DeviceBuffer>` ([`crate::Place`]) for callers).
#[derive(Clone, Copy, Debug)]
pub enum Kernel<B> {
    /// `dst[i] = value` converted to `dtype`.
    Fill {
        dst: B,
        dtype: DType,
        count: usize,
        value: f64,
    },
    /// `dst[i] = src[i]` converted from `src_dtype` to `dst_dtype`.
    Cast {
        src: B,
        src_dtype: DType,
        dst: B,
        dst_dtype: DType,
        count: usize,
    },
    /// `buf[i] = buf[i] * factor`.
    Scale {
        buf: B,
        dtype: DType,
        count: usize,
        factor: f64,
    },
    /// `dst[i] = dst[i] + alpha * src[i]`, `src` converted to `dst_dtype`.
    Axpy {
        src: B,
        src_dtype: DType,
        dst: B,
        dst_dtype: DType,
        count: usize,
        alpha: f64,
    },
    /// `c = a · b`, row-major: `a` is `[m, k]`, `b` is `[k, n]`, `c` is `[m, n]`. `c` may not
    /// share bytes with `a` or `b` (not even in place).
    Matmul {
        a: B,
        b: B,
        c: B,
        m: usize,
        n: usize,
        k: usize,
        dtype: DType,
    },
}

/// How a kernel uses one of its places.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    ReadWrite,
}

impl<B> Kernel<B> {
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Fill { .. } => "kernel(fill)",
            Kernel::Cast { .. } => "kernel(cast)",
            Kernel::Scale { .. } => "kernel(scale)",
            Kernel::Axpy { .. } => "kernel(axpy)",
            Kernel::Matmul { .. } => "kernel(matmul)",
        }
    }

    /// Elements the kernel writes (for a matmul, `m * n`; saturating, so an overflowing shape
    /// still has a count for `Kernel::validate` to reject).
    pub fn count(&self) -> usize {
        match *self {
            Kernel::Fill { count, .. }
            | Kernel::Cast { count, .. }
            | Kernel::Scale { count, .. }
            | Kernel::Axpy { count, .. } => count,
            Kernel::Matmul { m, n, .. } => m.saturating_mul(n),
        }
    }

    /// Whether a written place may coincide with a read place (same buffer and offset). A
    /// matmul reads every input element many times after writing outputs, so it may not.
    pub fn allows_in_place(&self) -> bool {
        !matches!(self, Kernel::Matmul { .. })
    }

    /// The element type the kernel converts from and the one it converts to (the same for
    /// single-dtype kernels): the one place kernels' dtypes are read.
    pub(crate) fn dtypes(&self) -> (DType, DType) {
        match *self {
            Kernel::Cast {
                src_dtype,
                dst_dtype,
                ..
            }
            | Kernel::Axpy {
                src_dtype,
                dst_dtype,
                ..
            } => (src_dtype, dst_dtype),
            Kernel::Fill { dtype, .. }
            | Kernel::Scale { dtype, .. }
            | Kernel::Matmul { dtype, .. } => (dtype, dtype),
        }
    }

    /// The element type of each place, in the order of [`Kernel::places`].
    pub fn place_dtypes(&self) -> Vec<DType> {
        let (src, dst) = self.dtypes();
        match self {
            Kernel::Fill { .. } | Kernel::Scale { .. } => vec![dst],
            Kernel::Cast { .. } | Kernel::Axpy { .. } => vec![src, dst],
            Kernel::Matmul { .. } => vec![dst; 3],
        }
    }

    /// Every place the kernel touches, with its size in bytes and how it is used; inputs first.
    pub fn places(&self) -> Vec<(&B, usize, Access)> {
        let n = self.count();
        match self {
            Kernel::Fill { dst, dtype, .. } => vec![(dst, n * dtype.size(), Access::Write)],
            Kernel::Cast {
                src,
                src_dtype,
                dst,
                dst_dtype,
                ..
            } => vec![
                (src, n * src_dtype.size(), Access::Read),
                (dst, n * dst_dtype.size(), Access::Write),
            ],
            Kernel::Scale { buf, dtype, .. } => vec![(buf, n * dtype.size(), Access::ReadWrite)],
            Kernel::Axpy {
                src,
                src_dtype,
                dst,
                dst_dtype,
                ..
            } => vec![
                (src, n * src_dtype.size(), Access::Read),
                (dst, n * dst_dtype.size(), Access::ReadWrite),
            ],
            Kernel::Matmul {
                a,
                b,
                c,
                m,
                n: cols,
                k,
                dtype,
            } => {
                // Saturating like `count`: validation rejects overflow before sizes are used.
                let bytes = |r: usize, c: usize| r.saturating_mul(c).saturating_mul(dtype.size());
                vec![
                    (a, bytes(*m, *k), Access::Read),
                    (b, bytes(*k, *cols), Access::Read),
                    (c, bytes(*m, *cols), Access::Write),
                ]
            }
        }
    }

    /// The same kernel over other places (in the order of [`Kernel::places`]).
    pub fn try_map<C>(self, mut f: impl FnMut(B) -> Result<C>) -> Result<Kernel<C>> {
        Ok(match self {
            Kernel::Fill {
                dst,
                dtype,
                count,
                value,
            } => Kernel::Fill {
                dst: f(dst)?,
                dtype,
                count,
                value,
            },
            Kernel::Cast {
                src,
                src_dtype,
                dst,
                dst_dtype,
                count,
            } => Kernel::Cast {
                src: f(src)?,
                src_dtype,
                dst: f(dst)?,
                dst_dtype,
                count,
            },
            Kernel::Scale {
                buf,
                dtype,
                count,
                factor,
            } => Kernel::Scale {
                buf: f(buf)?,
                dtype,
                count,
                factor,
            },
            Kernel::Axpy {
                src,
                src_dtype,
                dst,
                dst_dtype,
                count,
                alpha,
            } => Kernel::Axpy {
                src: f(src)?,
                src_dtype,
                dst: f(dst)?,
                dst_dtype,
                count,
                alpha,
            },
            Kernel::Matmul {
                a,
                b,
                c,
                m,
                n,
                k,
                dtype,
            } => Kernel::Matmul {
                a: f(a)?,
                b: f(b)?,
                c: f(c)?,
                m,
                n,
                k,
                dtype,
            },
        })
    }

    /// Rejects dtype combinations the kernel does not define and byte sizes that overflow.
    pub(crate) fn validate(&self, backend: BackendKind) -> Result<()> {
        let name = self.name();
        let err = |kind, msg: String| Err(Error::new(kind, backend, name, msg));
        let (src, dst) = self.dtypes();
        let widest = src.size().max(dst.size());
        let elements = match *self {
            Kernel::Matmul { m, n, k, .. } => {
                [m.checked_mul(n), m.checked_mul(k), k.checked_mul(n)]
                    .into_iter()
                    .try_fold(0usize, |most, e| e.map(|e| most.max(e)))
            }
            _ => Some(self.count()),
        };
        if elements.and_then(|e| e.checked_mul(widest)).is_none() {
            return err(
                ErrorKind::InvalidValue,
                match *self {
                    Kernel::Matmul { m, n, k, .. } => {
                        format!("matmul of [{m}, {k}] by [{k}, {n}] overflows a byte size")
                    }
                    _ => format!("{} elements overflow a byte size", self.count()),
                },
            );
        }
        match self {
            Kernel::Matmul { dtype, .. } if *dtype != DType::F32 => err(
                ErrorKind::Unsupported,
                format!("matmul is implemented for f32, not {dtype}"),
            ),
            Kernel::Matmul { m, n, k: 0, .. } if m.saturating_mul(*n) > 0 => err(
                ErrorKind::InvalidValue,
                format!(
                    "matmul of [{m}, 0] by [0, {n}]: an empty inner dimension has no input to read"
                ),
            ),
            Kernel::Scale { dtype, .. } if !dtype.is_float() => err(
                ErrorKind::Unsupported,
                format!("scale is defined for float dtypes, not {dtype}"),
            ),
            Kernel::Axpy {
                src_dtype,
                dst_dtype,
                ..
            } if !src_dtype.is_float() || !dst_dtype.is_float() => err(
                ErrorKind::Unsupported,
                format!("axpy is defined for float dtypes, not {src_dtype} -> {dst_dtype}"),
            ),
            _ => Ok(()),
        }
    }
}

/// Runs a kernel on host-addressable memory: the cpu backend's device memory, or the staging
/// copies a host fallback made.
///
/// # Safety
/// Each pointer must be valid for the bytes [`Kernel::places`] gives it, and a written range may
/// overlap a read range only when both start at the same address (in place).
pub(crate) unsafe fn run_on_host(kernel: &Kernel<*mut u8>) {
    match *kernel {
        Kernel::Fill {
            dst,
            dtype,
            count,
            value,
        } => {
            let v = Value::F(value);
            for i in 0..count {
                // SAFETY: i < count and dst covers count elements (caller's contract).
                unsafe { store(dst, dtype, i, v) };
            }
        }
        Kernel::Cast {
            src,
            src_dtype,
            dst,
            dst_dtype,
            count,
        } => {
            if src_dtype == dst_dtype {
                // SAFETY: both cover count elements; `copy` allows the in-place case.
                unsafe { std::ptr::copy(src, dst, count * src_dtype.size()) };
                return;
            }
            for i in 0..count {
                // SAFETY: as above, element by element.
                unsafe { store(dst, dst_dtype, i, load(src, src_dtype, i)) };
            }
        }
        Kernel::Scale {
            buf,
            dtype,
            count,
            factor,
        } => {
            for i in 0..count {
                // SAFETY: as above.
                unsafe {
                    let x = load(buf, dtype, i).as_f64();
                    store(buf, dtype, i, Value::F(x * factor));
                }
            }
        }
        Kernel::Axpy {
            src,
            src_dtype,
            dst,
            dst_dtype,
            count,
            alpha,
        } => {
            for i in 0..count {
                // SAFETY: as above.
                unsafe {
                    let s = load(src, src_dtype, i).as_f64();
                    let d = load(dst, dst_dtype, i).as_f64();
                    store(dst, dst_dtype, i, Value::F(d + alpha * s));
                }
            }
        }
        Kernel::Matmul {
            a,
            b,
            c,
            m,
            n,
            k,
            dtype: _,
        } => {
            // SAFETY: the caller's contract, with `validate` having limited the dtype to f32.
            unsafe { matmul_f32(a, b, c, m, n, k) }
        }
    }
}

/// `c = a · b` in f32, row-major. The i-k-j order streams rows of `b` and `c` (fast on a CPU)
/// while each `c[i][j]` still sums its products in order of `p`, from 0.0: the bits the
/// documented semantics fix. Rust never contracts `acc + x * y` into a fused multiply-add.
///
/// # Safety
/// `a`, `b`, `c` are valid for `m*k`, `k*n`, `m*n` f32s; `c` overlaps neither input.
unsafe fn matmul_f32(a: *const u8, b: *const u8, c: *mut u8, m: usize, n: usize, k: usize) {
    let aligned = [a as usize, b as usize, c as usize]
        .iter()
        .all(|p| p % std::mem::align_of::<f32>() == 0);
    if aligned {
        // SAFETY: aligned, in bounds and non-overlapping (caller's contract).
        let (a, b, c) = unsafe {
            (
                std::slice::from_raw_parts(a.cast::<f32>(), m * k),
                std::slice::from_raw_parts(b.cast::<f32>(), k * n),
                std::slice::from_raw_parts_mut(c.cast::<f32>(), m * n),
            )
        };
        for (a_row, c_row) in a.chunks_exact(k.max(1)).zip(c.chunks_exact_mut(n.max(1))) {
            c_row.fill(0.0);
            for (&x, b_row) in a_row.iter().zip(b.chunks_exact(n.max(1))) {
                for (acc, &y) in c_row.iter_mut().zip(b_row) {
                    *acc += x * y;
                }
            }
        }
        return;
    }
    let (a, b, c) = (a.cast::<f32>(), b.cast::<f32>(), c.cast::<f32>());
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for p in 0..k {
                // SAFETY: indices within the shapes (caller's contract); unaligned reads.
                unsafe {
                    acc += a.add(i * k + p).read_unaligned() * b.add(p * n + j).read_unaligned();
                }
            }
            // SAFETY: as above.
            unsafe { c.add(i * n + j).write_unaligned(acc) };
        }
    }
}

/// One element, widened without loss: floats to f64, integers to i64.
#[derive(Clone, Copy)]
enum Value {
    F(f64),
    I(i64),
}

impl Value {
    fn as_f64(self) -> f64 {
        match self {
            Value::F(x) => x,
            Value::I(i) => i as f64,
        }
    }
}

/// Element `i` of a `dtype` array at `p`.
///
/// # Safety
/// `p` is readable for `(i + 1) * dtype.size()` bytes; it needs no alignment.
unsafe fn load(p: *const u8, dtype: DType, i: usize) -> Value {
    // SAFETY: (all arms) the caller guarantees element i is in bounds; reads are unaligned-safe.
    unsafe {
        match dtype {
            DType::F32 => Value::F(p.cast::<f32>().add(i).read_unaligned() as f64),
            DType::F64 => Value::F(p.cast::<f64>().add(i).read_unaligned()),
            DType::F16 => {
                Value::F(half::f16::from_bits(p.cast::<u16>().add(i).read_unaligned()).to_f64())
            }
            DType::BF16 => {
                Value::F(half::bf16::from_bits(p.cast::<u16>().add(i).read_unaligned()).to_f64())
            }
            DType::I8 => Value::I(p.cast::<i8>().add(i).read() as i64),
            DType::U8 => Value::I(p.add(i).read() as i64),
            DType::I32 => Value::I(p.cast::<i32>().add(i).read_unaligned() as i64),
            DType::I64 => Value::I(p.cast::<i64>().add(i).read_unaligned()),
        }
    }
}

/// Writes `v` as element `i` of a `dtype` array at `p`.
///
/// # Safety
/// `p` is writable for `(i + 1) * dtype.size()` bytes; it needs no alignment.
unsafe fn store(p: *mut u8, dtype: DType, i: usize, v: Value) {
    // SAFETY: (all arms) the caller guarantees element i is in bounds; writes are unaligned-safe.
    unsafe {
        match (dtype, v) {
            (DType::F32, Value::F(x)) => p.cast::<f32>().add(i).write_unaligned(x as f32),
            (DType::F32, Value::I(n)) => p.cast::<f32>().add(i).write_unaligned(n as f32),
            (DType::F64, v) => p.cast::<f64>().add(i).write_unaligned(v.as_f64()),
            (DType::F16, v) => p
                .cast::<u16>()
                .add(i)
                .write_unaligned(f64_to_f16_bits(v.as_f64())),
            (DType::BF16, v) => p
                .cast::<u16>()
                .add(i)
                .write_unaligned(f64_to_bf16_bits(v.as_f64())),
            (DType::I8, Value::F(x)) => p.cast::<i8>().add(i).write(x as i8),
            (DType::I8, Value::I(n)) => p.cast::<i8>().add(i).write(n as i8),
            (DType::U8, Value::F(x)) => p.add(i).write(x as u8),
            (DType::U8, Value::I(n)) => p.add(i).write(n as u8),
            (DType::I32, Value::F(x)) => p.cast::<i32>().add(i).write_unaligned(x as i32),
            (DType::I32, Value::I(n)) => p.cast::<i32>().add(i).write_unaligned(n as i32),
            (DType::I64, Value::F(x)) => p.cast::<i64>().add(i).write_unaligned(x as i64),
            (DType::I64, Value::I(n)) => p.cast::<i64>().add(i).write_unaligned(n),
        }
    }
}

/// f64 to f32 rounding to odd: the f32 toward zero, with its last bit set when inexact. A
/// second rounding from it to a format with at least two fewer mantissa bits is then correct,
/// which `x as f32` followed by a half-precision rounding is not (ties would round twice).
fn f64_to_f32_round_to_odd(x: f64) -> f32 {
    let nearest = x as f32;
    if nearest.is_nan() || nearest as f64 == x {
        return nearest;
    }
    let toward_zero = if (nearest as f64).abs() > x.abs() {
        // One step toward zero: the magnitude's bit pattern is ordered like the magnitude.
        f32::from_bits(nearest.to_bits() - 1)
    } else {
        nearest
    };
    f32::from_bits(toward_zero.to_bits() | 1)
}

fn f64_to_bf16_bits(x: f64) -> u16 {
    half::bf16::from_f32(f64_to_f32_round_to_odd(x)).to_bits()
}

fn f64_to_f16_bits(x: f64) -> u16 {
    half::f16::from_f32(f64_to_f32_round_to_odd(x)).to_bits()
}

#[cfg(test)]
mod tests;
