//! Element types as Python names them (`"float32"`, `"f32"`, `"bfloat16"`, …) and as DLPack
//! encodes them.

use dlpark::ffi::{DLDataType, DLDataTypeCode};
use hprt_platform::{DType, ReduceOp};

use crate::error::{invalid, Result};

/// Parses a dtype name, exactly as spelled: hprt's own (`f32`), numpy's (`float32`) or torch's
/// (`torch.float32`, `float32`; `float`, `half`, `double`, `int`, `long`). Nothing else is
/// guessed (no case folding, no trimming): a misspelled name is an error, not another dtype.
pub fn parse(name: &str) -> Result<DType> {
    if let Some(d) = DType::ALL.into_iter().find(|d| d.name() == name) {
        return Ok(d);
    }
    let n = name.strip_prefix("torch.").unwrap_or(name);
    Ok(match n {
        "float32" | "float" => DType::F32,
        "float16" | "half" => DType::F16,
        "bfloat16" => DType::BF16,
        "float64" | "double" => DType::F64,
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "int32" | "int" => DType::I32,
        "int64" | "long" => DType::I64,
        _ => {
            return Err(invalid(format!(
                "unknown dtype {name:?}; expected one of f32, f16, bf16, f64, i8, u8, i32, i64 \
                 or their numpy / torch names (float32, torch.float32, ...), spelled exactly"
            )))
        }
    })
}

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

pub fn parse_reduce_op(name: &str) -> Result<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .find(|op| op.name() == name)
        .ok_or_else(|| {
            invalid(format!(
                "unknown reduce op {name:?}; expected sum, avg, max, min or prod"
            ))
        })
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
