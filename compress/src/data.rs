//! Synthetic tensors that look like what training saves for backward (activations, weights),
//! plus adversarial inputs, for tests, the benchmark and the cost model's calibration.
//!
//! ```
//! use hprt_compress::data::{generate, DataKind};
//! use hprt_compress::CodecDType;
//!
//! let bytes = generate(DataKind::Gelu, CodecDType::BF16, 1024, 7);
//! assert_eq!(bytes.len(), 2048);
//! ```

use crate::format::CodecDType;

/// A small deterministic generator (SplitMix64): reproducible data without a dependency.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// What a synthetic tensor looks like.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataKind {
    /// N(0, 1) activations.
    Gaussian,
    /// GELU of N(0, 1): a long positive side, a short negative one near zero.
    Gelu,
    /// Softmax over rows of 1024 logits ~ N(0, 2): all positive, tiny values.
    Softmax,
    /// Layer-norm output: rows normalized to zero mean and unit variance, then scaled by a
    /// per-column gain near 1 and shifted by a small bias.
    LayerNorm,
    /// Trained-weight-like: N(0, 0.02) with a heavy-tailed 1% of larger entries.
    Weights,
    /// Uniformly random bit patterns (NaNs and infinities included): incompressible.
    RandomBits,
    /// One value repeated.
    Constant,
}

impl DataKind {
    pub const ALL: [DataKind; 7] = [
        DataKind::Gaussian,
        DataKind::Gelu,
        DataKind::Softmax,
        DataKind::LayerNorm,
        DataKind::Weights,
        DataKind::RandomBits,
        DataKind::Constant,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DataKind::Gaussian => "gaussian",
            DataKind::Gelu => "gelu",
            DataKind::Softmax => "softmax",
            DataKind::LayerNorm => "layernorm",
            DataKind::Weights => "weights",
            DataKind::RandomBits => "random-bits",
            DataKind::Constant => "constant",
        }
    }
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + (0.797_884_560_802_865_4 * (x + 0.044715 * x * x * x)).tanh())
}

/// `numel` elements of `kind` as little-endian `dtype` bytes, deterministic in `seed`.
pub fn generate(kind: DataKind, dtype: CodecDType, numel: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed ^ (kind as u64).wrapping_mul(0x1000_0000_01b3));
    if kind == DataKind::RandomBits {
        let mut out = Vec::with_capacity(numel * dtype.size() + 8);
        while out.len() < numel * dtype.size() {
            out.extend_from_slice(&rng.next_u64().to_le_bytes());
        }
        out.truncate(numel * dtype.size());
        return out;
    }
    let values: Vec<f32> = match kind {
        DataKind::Gaussian => (0..numel).map(|_| rng.normal() as f32).collect(),
        DataKind::Gelu => (0..numel).map(|_| gelu(rng.normal()) as f32).collect(),
        DataKind::Softmax => {
            let mut v = Vec::with_capacity(numel);
            while v.len() < numel {
                let row: Vec<f64> = (0..1024).map(|_| rng.normal() * 2.0).collect();
                let max = row.iter().cloned().fold(f64::MIN, f64::max);
                let sum: f64 = row.iter().map(|x| (x - max).exp()).sum();
                v.extend(row.iter().map(|x| ((x - max).exp() / sum) as f32));
            }
            v.truncate(numel);
            v
        }
        DataKind::LayerNorm => {
            let cols = 1024;
            let gain: Vec<f64> = (0..cols).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            let bias: Vec<f64> = (0..cols).map(|_| 0.02 * rng.normal()).collect();
            let mut v = Vec::with_capacity(numel);
            while v.len() < numel {
                let row: Vec<f64> = (0..cols).map(|_| rng.normal() * 3.0 + 1.0).collect();
                let mean = row.iter().sum::<f64>() / cols as f64;
                let var = row.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / cols as f64;
                let sd = (var + 1e-5).sqrt();
                v.extend(
                    row.iter()
                        .enumerate()
                        .map(|(c, x)| ((x - mean) / sd * gain[c] + bias[c]) as f32),
                );
            }
            v.truncate(numel);
            v
        }
        DataKind::Weights => (0..numel)
            .map(|_| {
                let x = rng.normal() * 0.02;
                if rng.uniform() < 0.01 {
                    (x * 10.0) as f32
                } else {
                    x as f32
                }
            })
            .collect(),
        DataKind::Constant => vec![0.125f32; numel],
        DataKind::RandomBits => unreachable!("returned above"),
    };
    to_bytes(&values, dtype)
}

/// `values` rounded to `dtype` (round to nearest even) as little-endian bytes.
pub fn to_bytes(values: &[f32], dtype: CodecDType) -> Vec<u8> {
    match dtype {
        CodecDType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        CodecDType::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        CodecDType::BF16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
    }
}
