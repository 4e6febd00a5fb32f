//! Scalar reference reductions, written from the [`ReduceOp`] documentation alone:
//!
//! - ranks are combined in rank order (`((r0 op r1) op r2) ...`);
//! - f16 and bf16 accumulate in f32 and round once at the end; f32 in f32, f64 in f64;
//! - integers wrap on overflow (`wrapping_add`, `wrapping_mul`);
//! - `Avg` is the sum divided by the number of ranks, truncating (toward zero) for integers.
//!
//! Also the input generators the collective cases use: float inputs are small multiples of 0.5
//! (and only ±{0.5, 1, 2} for `Prod`), so every float result except `Avg` is exact whatever order
//! a backend sums in; integer inputs span the whole type so sums and products do wrap.

use half::{bf16, f16};
use hprt_platform::{DType, ReduceOp};

use crate::util::hash;

/// The expected bytes of a result and, where a backend may round differently (float `Avg`), the
/// absolute tolerance of each element.
#[derive(Clone, Debug)]
pub struct Expected {
    pub bytes: Vec<u8>,
    pub tolerance: Option<Vec<f64>>,
}

impl Expected {
    pub fn exact(bytes: Vec<u8>) -> Self {
        Expected {
            bytes,
            tolerance: None,
        }
    }
}

/// The first element where `actual` differs from what was expected.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    pub index: usize,
    pub expected: String,
    pub actual: String,
    /// How many elements differ in all.
    pub count: usize,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "element {} is {}, expected {} ({} element(s) differ)",
            self.index, self.actual, self.expected, self.count
        )
    }
}

/// Float formats: how many mantissa bits they keep (for the one-ulp `Avg` tolerance).
fn mantissa_bits(dtype: DType) -> i32 {
    match dtype {
        DType::F16 => 10,
        DType::BF16 => 7,
        DType::F32 => 23,
        DType::F64 => 52,
        _ => 0,
    }
}

/// One element of `dtype` as f64 (exact for every type but i64 beyond 2^53).
pub fn to_f64(dtype: DType, b: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes(b[..4].try_into().unwrap()) as f64,
        DType::F16 => f16::from_le_bytes(b[..2].try_into().unwrap()).to_f64(),
        DType::BF16 => bf16::from_le_bytes(b[..2].try_into().unwrap()).to_f64(),
        DType::F64 => f64::from_le_bytes(b[..8].try_into().unwrap()),
        DType::I8 => b[0] as i8 as f64,
        DType::U8 => b[0] as f64,
        DType::I32 => i32::from_le_bytes(b[..4].try_into().unwrap()) as f64,
        DType::I64 => i64::from_le_bytes(b[..8].try_into().unwrap()) as f64,
    }
}

/// One element of `dtype` as text (with its bit pattern for floats).
pub fn fmt_elem(dtype: DType, b: &[u8]) -> String {
    match dtype {
        DType::F32 => {
            let v = f32::from_le_bytes(b[..4].try_into().unwrap());
            format!("{v:?} ({:#010x})", v.to_bits())
        }
        DType::F16 => {
            let v = f16::from_le_bytes(b[..2].try_into().unwrap());
            format!("{:?} ({:#06x})", v.to_f32(), v.to_bits())
        }
        DType::BF16 => {
            let v = bf16::from_le_bytes(b[..2].try_into().unwrap());
            format!("{:?} ({:#06x})", v.to_f32(), v.to_bits())
        }
        DType::F64 => {
            let v = f64::from_le_bytes(b[..8].try_into().unwrap());
            format!("{v:?} ({:#018x})", v.to_bits())
        }
        DType::I8 => format!("{}", b[0] as i8),
        DType::U8 => format!("{}", b[0]),
        DType::I32 => format!("{}", i32::from_le_bytes(b[..4].try_into().unwrap())),
        DType::I64 => format!("{}", i64::from_le_bytes(b[..8].try_into().unwrap())),
    }
}

/// Compares `actual` with `expected` element by element: bit-exact, or within the tolerance.
pub fn compare(dtype: DType, expected: &Expected, actual: &[u8]) -> Result<(), Mismatch> {
    let sz = dtype.size();
    if actual.len() != expected.bytes.len() {
        return Err(Mismatch {
            index: 0,
            expected: format!("{} bytes", expected.bytes.len()),
            actual: format!("{} bytes", actual.len()),
            count: 1,
        });
    }
    let mut first = None;
    let mut count = 0;
    for (i, (e, a)) in expected
        .bytes
        .chunks_exact(sz)
        .zip(actual.chunks_exact(sz))
        .enumerate()
    {
        let ok = e == a
            || expected.tolerance.as_ref().is_some_and(|tol| {
                let (ev, av) = (to_f64(dtype, e), to_f64(dtype, a));
                (ev - av).abs() <= tol[i]
            });
        if !ok {
            count += 1;
            first.get_or_insert(i);
        }
    }
    match first {
        None => Ok(()),
        Some(i) => Err(Mismatch {
            index: i,
            expected: fmt_elem(dtype, &expected.bytes[i * sz..(i + 1) * sz]),
            actual: fmt_elem(dtype, &actual[i * sz..(i + 1) * sz]),
            count,
        }),
    }
}

/// Reference implementation of one element type.
trait Elem: Copy {
    /// The type values accumulate in.
    type Acc: Copy;
    const SIZE: usize;
    fn load(b: &[u8]) -> Self;
    fn store(self, out: &mut Vec<u8>);
    fn widen(self) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self;
    fn combine(op: ReduceOp, a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// `a / n`, truncating for integers.
    fn average(a: Self::Acc, n: usize) -> Self::Acc;
    fn acc_abs(a: Self::Acc) -> f64;
}

macro_rules! float_ref {
    ($t:ty, $acc:ty, $size:expr, $widen:expr, $narrow:expr) => {
        impl Elem for $t {
            type Acc = $acc;
            const SIZE: usize = $size;
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().unwrap())
            }
            fn store(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn widen(self) -> $acc {
                $widen(self)
            }
            fn narrow(a: $acc) -> Self {
                $narrow(a)
            }
            fn combine(op: ReduceOp, a: $acc, b: $acc) -> $acc {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
            fn average(a: $acc, n: usize) -> $acc {
                a / n as $acc
            }
            fn acc_abs(a: $acc) -> f64 {
                (a as f64).abs()
            }
        }
    };
}

float_ref!(f32, f32, 4, |x| x, |a| a);
float_ref!(f64, f64, 8, |x| x, |a| a);
float_ref!(f16, f32, 2, f16::to_f32, f16::from_f32);
float_ref!(bf16, f32, 2, bf16::to_f32, bf16::from_f32);

macro_rules! int_ref {
    ($t:ty) => {
        impl Elem for $t {
            type Acc = $t;
            const SIZE: usize = std::mem::size_of::<$t>();
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().unwrap())
            }
            fn store(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn widen(self) -> $t {
                self
            }
            fn narrow(a: $t) -> Self {
                a
            }
            fn combine(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
            fn average(a: $t, n: usize) -> $t {
                // Division in i128 truncates toward zero and cannot overflow.
                (a as i128 / n as i128) as $t
            }
            fn acc_abs(a: $t) -> f64 {
                (a as f64).abs()
            }
        }
    };
}

int_ref!(i8);
int_ref!(u8);
int_ref!(i32);
int_ref!(i64);

fn reduce_t<T: Elem>(dtype: DType, op: ReduceOp, inputs: &[&[u8]]) -> Expected {
    assert!(!inputs.is_empty(), "a reduction needs at least one rank");
    let n = inputs[0].len() / T::SIZE;
    let ranks = inputs.len();
    let mut bytes = Vec::with_capacity(n * T::SIZE);
    let float_avg = op == ReduceOp::Avg && dtype.is_float();
    let mut tolerance = float_avg.then(|| Vec::with_capacity(n));
    for i in 0..n {
        let at = |r: usize| T::load(&inputs[r][i * T::SIZE..(i + 1) * T::SIZE]);
        let mut acc = at(0).widen();
        let mut abs_sum = T::acc_abs(acc);
        for r in 1..ranks {
            let v = at(r).widen();
            abs_sum += T::acc_abs(v);
            acc = T::combine(op, acc, v);
        }
        if op == ReduceOp::Avg {
            acc = T::average(acc, ranks);
        }
        let out = T::narrow(acc);
        if let Some(tol) = tolerance.as_mut() {
            // One unit in the last place at the magnitude of the result, or of the scaled inputs
            // for backends that divide each input before summing.
            let mut v = Vec::new();
            out.store(&mut v);
            let magnitude = to_f64(dtype, &v).abs().max(abs_sum / ranks as f64);
            tol.push(magnitude * (2f64).powi(-mantissa_bits(dtype)));
        }
        out.store(&mut bytes);
    }
    Expected { bytes, tolerance }
}

/// `op` over `inputs` (one byte slice per rank, in rank order), as [`ReduceOp`] documents it.
pub fn reduce(dtype: DType, op: ReduceOp, inputs: &[&[u8]]) -> Expected {
    match dtype {
        DType::F32 => reduce_t::<f32>(dtype, op, inputs),
        DType::F16 => reduce_t::<f16>(dtype, op, inputs),
        DType::BF16 => reduce_t::<bf16>(dtype, op, inputs),
        DType::F64 => reduce_t::<f64>(dtype, op, inputs),
        DType::I8 => reduce_t::<i8>(dtype, op, inputs),
        DType::U8 => reduce_t::<u8>(dtype, op, inputs),
        DType::I32 => reduce_t::<i32>(dtype, op, inputs),
        DType::I64 => reduce_t::<i64>(dtype, op, inputs),
    }
}

fn store_float(dtype: DType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
        DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
        _ => unreachable!("{dtype} is not a float type"),
    }
}

/// `n` elements of `dtype` for one rank's input to `op` (`None`: data that is only moved).
///
/// Floats are multiples of 0.5 in [-2, 2] (Prod: one of ±0.5, ±1, ±2); integers use the whole
/// range of the type (Prod on i8/u8: small factors, still wrapping over 8 ranks).
pub fn input(dtype: DType, op: Option<ReduceOp>, seed: u64, n: usize) -> Vec<u8> {
    const FACTORS: [f64; 6] = [-2.0, -1.0, -0.5, 0.5, 1.0, 2.0];
    let mut out = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        let h = hash(&[seed, i as u64]);
        match (dtype.is_float(), op) {
            (true, Some(ReduceOp::Prod)) => store_float(dtype, FACTORS[(h % 6) as usize], &mut out),
            (true, _) => store_float(dtype, ((h % 9) as i64 - 4) as f64 * 0.5, &mut out),
            (false, Some(ReduceOp::Prod)) => match dtype {
                DType::I8 => out.push([-3i8, -2, -1, 1, 2, 3, 5][(h % 7) as usize] as u8),
                DType::U8 => out.push(1 + (h % 7) as u8),
                // Odd factors never drive a wrapping product to zero.
                _ => out.extend_from_slice(&(h | 1).to_le_bytes()[..dtype.size()]),
            },
            (false, _) => out.extend_from_slice(&h.to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_i32(v: &[i32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn int_avg_truncates_toward_zero_after_wrapping_sum() {
        let a = bytes_i32(&[7, -7, i32::MAX]);
        let b = bytes_i32(&[0, 0, 1]);
        let e = reduce(DType::I32, ReduceOp::Avg, &[&a, &b]);
        // i32::MAX + 1 wraps to i32::MIN; halved: -2^30.
        assert_eq!(e.bytes, bytes_i32(&[3, -3, i32::MIN / 2]));
    }

    #[test]
    fn half_types_accumulate_in_f32() {
        let v: Vec<u8> = [256.0f32, 1.0, 1.0]
            .iter()
            .map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect::<Vec<_>>()
            .concat();
        let ins: Vec<&[u8]> = v.chunks(2).collect();
        let e = reduce(DType::BF16, ReduceOp::Sum, &ins);
        assert_eq!(
            bf16::from_le_bytes([e.bytes[0], e.bytes[1]]).to_f32(),
            258.0
        );
    }

    #[test]
    fn u8_prod_wraps() {
        let e = reduce(DType::U8, ReduceOp::Prod, &[&[16], &[17]]);
        assert_eq!(e.bytes, vec![16u8.wrapping_mul(17)]);
    }

    #[test]
    fn compare_reports_first_element_and_count() {
        let e = Expected::exact(bytes_i32(&[1, 2, 3]));
        let m = compare(DType::I32, &e, &bytes_i32(&[1, 5, 6])).unwrap_err();
        assert_eq!((m.index, m.count), (1, 2));
        assert_eq!(m.actual, "5");
    }

    #[test]
    fn float_inputs_are_exactly_representable() {
        for dtype in [DType::F16, DType::BF16, DType::F32, DType::F64] {
            for op in ReduceOp::ALL {
                let v = input(dtype, Some(op), 9, 100);
                for c in v.chunks(dtype.size()) {
                    let x = to_f64(dtype, c);
                    assert_eq!((x * 2.0).fract(), 0.0);
                    assert!(x.abs() <= 2.0);
                }
            }
        }
    }
}
