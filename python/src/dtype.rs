//! Element types as DLPack encodes them, and tensor sizes. (Their names, `"f32"`, `"float32"`,
//! `"torch.bfloat16"`, …, are `DType`'s `FromStr` in hprt-platform.)

use dlpark::ffi::{DLDataType, DLDataTypeCode};
use hprt_platform::DType;

use crate::error::{invalid, Result};

/// The DLPack descriptor of `dtype`.
pub fn to_dlpack(dtype: DType) -> DLDataType {
    let (code, bits) = match dtype {
        DType::F32 => (DLDataTypeCode::FLOAT, 32),
        DType::F16 => (DLDataTypeCode::FLOAT, 16),
        DType::BF16 => (DLDataTypeCode::BFLOAT, 16),
        DType::F64 => (DLDataTypeCode::FLOAT, 64),
        DType::I8 => (DLDataTypeCode::INT, 8),
        DType::U8 => (DLDataTypeCode::UINT, 8),
        DType::I32 => (DLDataTypeCode::INT, 32),
        DType::I64 => (DLDataTypeCode::INT, 64),
    };
    DLDataType::scalar(code, bits)
}

/// The hprt dtype of a DLPack descriptor; `bool` tensors travel as bytes.
pub fn from_dlpack(dt: DLDataType) -> Result<DType> {
    let scalar = dt.lanes == 1;
    let found = DType::ALL
        .into_iter()
        .find(|d| scalar && to_dlpack(*d).matches(dt));
    match (found, dt.code, dt.bits) {
        (Some(d), _, _) => Ok(d),
        (None, DLDataTypeCode::BOOL, 8) if scalar => Ok(DType::U8),
        _ => Err(invalid(format!(
            "DLPack dtype (code {}, {} bits, {} lanes) has no hprt dtype",
            dt.code.0, dt.bits, dt.lanes
        ))),
    }
}

/// Bytes from the first element to the end of the last one of a tensor of `shape` and element
/// `strides` (none for an empty tensor).
pub fn strided_nbytes(dtype: DType, shape: &[usize], strides: &[usize]) -> Result<usize> {
    let overflow = || {
        invalid(format!(
            "shape {shape:?} with strides {strides:?} overflows"
        ))
    };
    if shape.len() != strides.len() {
        return Err(invalid(format!(
            "{} strides for a {}-dimensional shape",
            strides.len(),
            shape.len()
        )));
    }
    if shape.contains(&0) {
        return Ok(0);
    }
    let last = shape.iter().zip(strides).try_fold(0usize, |acc, (n, s)| {
        (n - 1).checked_mul(*s).and_then(|x| acc.checked_add(x))
    });
    last.and_then(|l| l.checked_add(1))
        .and_then(|span| span.checked_mul(dtype.size()))
        .ok_or_else(overflow)
}

/// The element strides of a dense row-major tensor of `shape`.
pub fn row_major(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut step = 1usize;
    for (s, n) in strides.iter_mut().zip(shape).rev() {
        *s = step;
        step = step.saturating_mul((*n).max(1));
    }
    strides
}

/// Bytes of `shape` elements of `dtype`, refusing overflow.
pub fn nbytes(dtype: DType, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, d| acc.checked_mul(*d))
        .ok_or_else(|| invalid(format!("shape {shape:?} of {dtype} overflows")))
}
