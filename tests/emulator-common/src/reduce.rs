//! Element types and reductions of collectives. Ranks are combined in rank order; fp16/bf16 accumulate in f32
//! and round once at the end; integers wrap.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    I8,
    I16,
    I32,
    F16,
    F32,
    I64,
    U64,
    U8,
    U16,
    U32,
    F64,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        use DType::*;
        match self {
            I8 | U8 => 1,
            I16 | U16 | F16 | BF16 => 2,
            I32 | U32 | F32 => 4,
            I64 | U64 | F64 => 8,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Prod,
    Max,
    Min,
    /// The sum divided by the number of inputs in the accumulator type (truncating for
    /// integers), rounded once to the element type.
    Avg,
}

/// Element-wise over equally long inputs, in input (rank) order, accumulating in `A`.
fn fold<A: Copy>(
    inputs: &[Vec<u8>],
    size: usize,
    load: impl Fn(&[u8]) -> A,
    f: impl Fn(A, A) -> A,
    store: impl Fn(A, &mut [u8]),
) -> Vec<u8> {
    let mut out = inputs[0].clone();
    for (i, dst) in out.chunks_exact_mut(size).enumerate() {
        let at = i * size..(i + 1) * size;
        let mut acc = load(dst);
        for inp in &inputs[1..] {
            acc = f(acc, load(&inp[at.clone()]));
        }
        store(acc, dst);
    }
    out
}

macro_rules! int_reduce {
    ($t:ty, $inputs:expr, $op:expr) => {{
        const S: usize = std::mem::size_of::<$t>();
        let load = |b: &[u8]| <$t>::from_ne_bytes(b.try_into().expect("element size"));
        let store = |v: $t, b: &mut [u8]| b.copy_from_slice(&v.to_ne_bytes());
        match $op {
            ReduceOp::Sum => fold($inputs, S, load, <$t>::wrapping_add, store),
            ReduceOp::Prod => fold($inputs, S, load, <$t>::wrapping_mul, store),
            ReduceOp::Max => fold($inputs, S, load, std::cmp::max::<$t>, store),
            ReduceOp::Min => fold($inputs, S, load, std::cmp::min::<$t>, store),
            ReduceOp::Avg => {
                let n = $inputs.len() as $t;
                fold(
                    $inputs,
                    S,
                    load,
                    <$t>::wrapping_add,
                    |v: $t, b: &mut [u8]| store(v / n, b),
                )
            }
        }
    }};
}

macro_rules! float_reduce {
    ($acc:ty, $size:expr, $inputs:expr, $op:expr, $load:expr, $store:expr) => {{
        let (load, store) = ($load, $store);
        match $op {
            ReduceOp::Sum => fold($inputs, $size, load, |a: $acc, b| a + b, store),
            ReduceOp::Prod => fold($inputs, $size, load, |a: $acc, b| a * b, store),
            ReduceOp::Max => fold($inputs, $size, load, <$acc>::max, store),
            ReduceOp::Min => fold($inputs, $size, load, <$acc>::min, store),
            ReduceOp::Avg => {
                let n = $inputs.len() as $acc;
                fold(
                    $inputs,
                    $size,
                    load,
                    |a: $acc, b| a + b,
                    |v: $acc, b: &mut [u8]| store(v / n, b),
                )
            }
        }
    }};
}

fn u16_of(b: &[u8]) -> u16 {
    u16::from_ne_bytes(b.try_into().expect("element size"))
}

/// Reduces `inputs` (one byte buffer per rank, all the same length) element-wise.
pub fn reduce(inputs: &[Vec<u8>], dtype: DType, op: ReduceOp) -> Vec<u8> {
    match dtype {
        DType::I8 => int_reduce!(i8, inputs, op),
        DType::I16 => int_reduce!(i16, inputs, op),
        DType::I32 => int_reduce!(i32, inputs, op),
        DType::I64 => int_reduce!(i64, inputs, op),
        DType::U8 => int_reduce!(u8, inputs, op),
        DType::U16 => int_reduce!(u16, inputs, op),
        DType::U32 => int_reduce!(u32, inputs, op),
        DType::U64 => int_reduce!(u64, inputs, op),
        DType::F32 => float_reduce!(
            f32,
            4,
            inputs,
            op,
            |b: &[u8]| f32::from_ne_bytes(b.try_into().expect("element size")),
            |v: f32, b: &mut [u8]| b.copy_from_slice(&v.to_ne_bytes())
        ),
        DType::F64 => float_reduce!(
            f64,
            8,
            inputs,
            op,
            |b: &[u8]| f64::from_ne_bytes(b.try_into().expect("element size")),
            |v: f64, b: &mut [u8]| b.copy_from_slice(&v.to_ne_bytes())
        ),
        DType::F16 => float_reduce!(
            f32,
            2,
            inputs,
            op,
            |b: &[u8]| f16::from_bits(u16_of(b)).to_f32(),
            |v: f32, b: &mut [u8]| b.copy_from_slice(&f16::from_f32(v).to_bits().to_ne_bytes())
        ),
        DType::BF16 => float_reduce!(
            f32,
            2,
            inputs,
            op,
            |b: &[u8]| bf16::from_bits(u16_of(b)).to_f32(),
            |v: f32, b: &mut [u8]| b.copy_from_slice(&bf16::from_f32(v).to_bits().to_ne_bytes())
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
        // SAFETY: plain-old-data slices in tests.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
            .to_vec()
    }

    #[test]
    fn integer_ops_wrap() {
        let r = reduce(
            &[bytes(&[i8::MAX, 3]), bytes(&[1i8, -5])],
            DType::I8,
            ReduceOp::Sum,
        );
        assert_eq!(r, bytes(&[i8::MIN, -2]));
        let r = reduce(
            &[bytes(&[7u32, 1]), bytes(&[9u32, 0])],
            DType::U32,
            ReduceOp::Max,
        );
        assert_eq!(r, bytes(&[9u32, 1]));
        let r = reduce(
            &[bytes(&[7i64, 1]), bytes(&[-9i64, 0])],
            DType::I64,
            ReduceOp::Min,
        );
        assert_eq!(r, bytes(&[-9i64, 0]));
        let r = reduce(
            &[bytes(&[3u16]), bytes(&[5u16]), bytes(&[7u16])],
            DType::U16,
            ReduceOp::Prod,
        );
        assert_eq!(r, bytes(&[105u16]));
        let r = reduce(
            &[bytes(&[7i32, -7]), bytes(&[0i32, 0])],
            DType::I32,
            ReduceOp::Avg,
        );
        assert_eq!(r, bytes(&[3i32, -3]));
    }

    #[test]
    fn half_precision_rounds_once() {
        // 2048 + 1 + 1 in f16 rank by rank would stay 2048 (ulp 2 there); in f32 it is 2050.
        let one = f16::from_f32(1.0).to_bits();
        let big = f16::from_f32(2048.0).to_bits();
        let r = reduce(
            &[bytes(&[big]), bytes(&[one]), bytes(&[one])],
            DType::F16,
            ReduceOp::Sum,
        );
        assert_eq!(f16::from_bits(u16_of(&r)).to_f32(), 2050.0);
        let a = bf16::from_f32(1.5).to_bits();
        let r = reduce(&[bytes(&[a]), bytes(&[a])], DType::BF16, ReduceOp::Prod);
        assert_eq!(bf16::from_bits(u16_of(&r)).to_f32(), 2.25);
    }
}
