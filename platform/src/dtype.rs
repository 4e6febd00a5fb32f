//! Element types and reduction operators shared by every backend.

/// Element type of a buffer as collectives and codecs see it. Its names (`Display`, `FromStr`)
/// are hprt's (`f32`, `bf16`, …); `FromStr` also takes numpy's (`float32`) and torch's
/// (`torch.float32`, `float`, `half`, `double`, `int`, `long`), spelled exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    I8,
    U8,
    I32,
    I64,
}

crate::named_enum!(DType, "dtype", {
    F32 => "f32",
    F16 => "f16",
    BF16 => "bf16",
    F64 => "f64",
    I8 => "i8",
    U8 => "u8",
    I32 => "i32",
    I64 => "i64",
}, aliases {
    // numpy's names and torch's (`str(torch.float32)`, and torch's short names).
    "float32" => F32, "float" => F32, "torch.float32" => F32, "torch.float" => F32,
    "float16" => F16, "half" => F16, "torch.float16" => F16, "torch.half" => F16,
    "bfloat16" => BF16, "torch.bfloat16" => BF16,
    "float64" => F64, "double" => F64, "torch.float64" => F64, "torch.double" => F64,
    "int8" => I8, "torch.int8" => I8,
    "uint8" => U8, "torch.uint8" => U8,
    "int32" => I32, "int" => I32, "torch.int32" => I32, "torch.int" => I32,
    "int64" => I64, "long" => I64, "torch.int64" => I64, "torch.long" => I64,
});

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }
}

/// Reduction applied elementwise across ranks.
///
/// Semantics every backend follows (and the conformance suite checks): ranks are combined in rank
/// order; f16 and bf16 accumulate in f32 and round once at the end; integers wrap on overflow;
/// `Avg` is the sum divided by the number of ranks (truncating for integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
    Prod,
}

crate::named_enum!(ReduceOp, "reduce op", {
    Sum => "sum",
    Avg => "avg",
    Max => "max",
    Min => "min",
    Prod => "prod",
});
