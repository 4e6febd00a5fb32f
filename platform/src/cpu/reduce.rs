//! Elementwise reductions across ranks, in the order and precision `ReduceOp` documents.

use half::{bf16, f16};

use crate::dtype::{DType, ReduceOp};

/// Elements reduced per block: small enough that the block's temporaries stay in cache.
const BLOCK: usize = 4096;

trait Elem: Copy + Default + 'static {
    type Acc: Copy + Default;
    fn widen(self) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self;
    fn combine(op: ReduceOp, a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn divide(a: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! float_elem {
    ($t:ty, $acc:ty, $widen:expr, $narrow:expr) => {
        impl Elem for $t {
            type Acc = $acc;
            #[inline(always)]
            fn widen(self) -> $acc {
                $widen(self)
            }
            #[inline(always)]
            fn narrow(a: $acc) -> Self {
                $narrow(a)
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: $acc, b: $acc) -> $acc {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Max => {
                        if b > a {
                            b
                        } else {
                            a
                        }
                    }
                    ReduceOp::Min => {
                        if b < a {
                            b
                        } else {
                            a
                        }
                    }
                }
            }
            #[inline(always)]
            fn divide(a: $acc, n: usize) -> $acc {
                a / n as $acc
            }
        }
    };
}

float_elem!(f32, f32, |x| x, |a| a);
float_elem!(f64, f64, |x| x, |a| a);
float_elem!(f16, f32, f16::to_f32, f16::from_f32);
float_elem!(bf16, f32, bf16::to_f32, bf16::from_f32);

macro_rules! int_elem {
    ($t:ty, $wide:ty) => {
        impl Elem for $t {
            type Acc = $t;
            #[inline(always)]
            fn widen(self) -> $t {
                self
            }
            #[inline(always)]
            fn narrow(a: $t) -> Self {
                a
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
            #[inline(always)]
            fn divide(a: $t, n: usize) -> $t {
                (a as $wide / n as $wide) as $t
            }
        }
    };
}

int_elem!(i8, i64);
int_elem!(u8, u64);
int_elem!(i32, i64);
int_elem!(i64, i128);

/// Reduces `elems` elements read at each of `inputs` (in rank order) and writes the result to
/// every one of `outputs`. Pointers need no alignment.
///
/// # Safety
/// Each input must be readable and each output writable for `elems * dtype.size()` bytes, and no
/// output range may overlap an input range read by another thread during the call.
pub(crate) unsafe fn reduce(
    dtype: DType,
    op: ReduceOp,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    elems: usize,
) {
    match dtype {
        DType::F32 => reduce_t::<f32>(op, inputs, outputs, elems),
        DType::F16 => reduce_t::<f16>(op, inputs, outputs, elems),
        DType::BF16 => reduce_t::<bf16>(op, inputs, outputs, elems),
        DType::F64 => reduce_t::<f64>(op, inputs, outputs, elems),
        DType::I8 => reduce_t::<i8>(op, inputs, outputs, elems),
        DType::U8 => reduce_t::<u8>(op, inputs, outputs, elems),
        DType::I32 => reduce_t::<i32>(op, inputs, outputs, elems),
        DType::I64 => reduce_t::<i64>(op, inputs, outputs, elems),
    }
}

unsafe fn reduce_t<T: Elem>(op: ReduceOp, inputs: &[*const u8], outputs: &[*mut u8], elems: usize) {
    // One monomorphic loop per operator, so the combine step inlines and vectorizes.
    match op {
        ReduceOp::Sum | ReduceOp::Avg => reduce_with::<T>(
            |a, b| T::combine(ReduceOp::Sum, a, b),
            op,
            inputs,
            outputs,
            elems,
        ),
        ReduceOp::Prod => reduce_with::<T>(
            |a, b| T::combine(ReduceOp::Prod, a, b),
            op,
            inputs,
            outputs,
            elems,
        ),
        ReduceOp::Max => reduce_with::<T>(
            |a, b| T::combine(ReduceOp::Max, a, b),
            op,
            inputs,
            outputs,
            elems,
        ),
        ReduceOp::Min => reduce_with::<T>(
            |a, b| T::combine(ReduceOp::Min, a, b),
            op,
            inputs,
            outputs,
            elems,
        ),
    }
}

#[inline(always)]
unsafe fn reduce_with<T: Elem>(
    combine: impl Fn(T::Acc, T::Acc) -> T::Acc,
    op: ReduceOp,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    elems: usize,
) {
    let size = std::mem::size_of::<T>();
    let mut acc = vec![T::Acc::default(); BLOCK.min(elems)];
    let mut out = vec![T::default(); BLOCK.min(elems)];
    let ranks = inputs.len();
    let mut start = 0;
    while start < elems {
        let n = BLOCK.min(elems - start);
        let byte_off = start * size;
        for (i, &input) in inputs.iter().enumerate() {
            // Unaligned reads: user offsets need not be element-aligned.
            let src = input.add(byte_off).cast::<T>();
            if i == 0 {
                for (k, a) in acc[..n].iter_mut().enumerate() {
                    *a = src.add(k).read_unaligned().widen();
                }
            } else {
                for (k, a) in acc[..n].iter_mut().enumerate() {
                    *a = combine(*a, src.add(k).read_unaligned().widen());
                }
            }
        }
        if op == ReduceOp::Avg {
            for (o, a) in out[..n].iter_mut().zip(&acc[..n]) {
                *o = T::narrow(T::divide(*a, ranks));
            }
        } else {
            for (o, a) in out[..n].iter_mut().zip(&acc[..n]) {
                *o = T::narrow(*a);
            }
        }
        for &dst in outputs {
            std::ptr::copy_nonoverlapping(out.as_ptr().cast::<u8>(), dst.add(byte_off), n * size);
        }
        start += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_sum_accumulates_in_f32() {
        // 256 + 1 + 1 is 258 in f32 but 256 in bf16 if rounded after each add.
        let vals = [
            bf16::from_f32(256.0),
            bf16::from_f32(1.0),
            bf16::from_f32(1.0),
        ];
        let ins: Vec<Vec<u8>> = vals.iter().map(|v| v.to_le_bytes().to_vec()).collect();
        let ptrs: Vec<*const u8> = ins.iter().map(|v| v.as_ptr()).collect();
        let mut out = [0u8; 2];
        // SAFETY: one bf16 element: each input is a live 2-byte Vec, the output a 2-byte local
        // array; one thread.
        unsafe { reduce(DType::BF16, ReduceOp::Sum, &ptrs, &[out.as_mut_ptr()], 1) };
        assert_eq!(bf16::from_le_bytes(out).to_f32(), 258.0);
    }

    #[test]
    fn int_avg_truncates_after_wrapping_sum() {
        let ins = [
            [7i32.to_le_bytes(), 0i32.to_le_bytes()],
            [(-2i32).to_le_bytes(), 5i32.to_le_bytes()],
        ];
        let bufs: Vec<Vec<u8>> = ins.iter().map(|e| e.concat()).collect();
        let ptrs: Vec<*const u8> = bufs.iter().map(|v| v.as_ptr()).collect();
        let mut out = [0u8; 8];
        // SAFETY: two i32 elements: each input is a live 8-byte Vec, the output an 8-byte local
        // array; one thread.
        unsafe { reduce(DType::I32, ReduceOp::Avg, &ptrs, &[out.as_mut_ptr()], 2) };
        assert_eq!(i32::from_le_bytes(out[..4].try_into().unwrap()), 2);
        assert_eq!(i32::from_le_bytes(out[4..].try_into().unwrap()), 2);
    }
}
