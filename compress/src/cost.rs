//! The cost model: how long an asynchronous operator runs, and how many elements the device
//! codec encodes or decodes in that time.
//!
//! Where the seed hard-codes throughputs, here they are measured on the platform at first use
//! and cached for the process ([`CostModel::for_platform`]); collective bandwidths are measured
//! by the ranks themselves ([`measure_collective`]) because a single thread cannot; matmul
//! throughput comes from an override or from operators the manager timed ([`CostModel::observe`]),
//! since the platform has no matmul of its own to time. Every figure can be overridden
//! (`HP_COST_*` variables or [`CostOverrides`]).
//!
//! ```
//! use std::time::Duration;
//! use hprt_compress::{CostModel, CostTable, Op};
//! use hprt_compress::CodecDType;
//!
//! let mut table = CostTable::default();
//! table.encode_gbps = 2.0;
//! table.matmul_flops = Some(1e12);
//! let model = CostModel::from_table(table);
//! let t = model.predict(&Op::Matmul { m: 1000, n: 1000, k: 1000 })?;
//! assert_eq!(t, Duration::from_millis(2));
//! // 2 GB/s for 2 ms = 4 MB = 2M bf16 elements.
//! assert_eq!(model.encodable_numel(t, CodecDType::BF16), 2_000_000);
//! # Ok::<(), hprt_compress::CompressError>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use hprt_platform::{Communicator, DType, Platform, Stream};

use crate::data::{generate, DataKind};
use crate::device::DeviceCodec;
use crate::error::{CompressError, Result};
use crate::format::CodecDType;
use hprt_platform::sync::lock;

/// Collectives the model knows bandwidths for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CollectiveKind {
    AllGather,
    AllToAll,
}

impl CollectiveKind {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::AllToAll => "all_to_all",
        }
    }
}

/// An asynchronous operator whose duration is a window for the codec.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `[m, k] x [k, n]`: `2 m n k` floating-point operations.
    Matmul { m: usize, n: usize, k: usize },
    /// `bytes` received per rank by a collective over `group` ranks.
    Collective {
        kind: CollectiveKind,
        bytes: usize,
        group: usize,
    },
    /// An operator whose duration the caller knows.
    Fixed(Duration),
    /// An operator whose duration nobody predicts (a framework layer's whole forward): every
    /// candidate is coded in its window, so what is coded never depends on measured timings.
    Unbounded,
}

impl Op {
    pub fn name(&self) -> String {
        match self {
            Op::Matmul { m, n, k } => format!("matmul {m}x{k}x{n}"),
            Op::Collective { kind, bytes, group } => {
                format!("{} {bytes} B over {group}", kind.name())
            }
            Op::Fixed(d) => format!("fixed {d:?}"),
            Op::Unbounded => "unbounded".into(),
        }
    }
}

/// Throughputs of one platform.
#[derive(Clone, Debug, PartialEq)]
pub struct CostTable {
    /// Device-codec encode throughput, bytes of original tensor per second / 1e9.
    pub encode_gbps: f64,
    pub decode_gbps: f64,
    /// Fixed cost of launching one codec call (staging, host step), added per tensor.
    pub codec_launch: Duration,
    pub matmul_flops: Option<f64>,
    /// Bandwidth (received bytes per second / 1e9) by collective and group size.
    pub collective_gbps: BTreeMap<(CollectiveKind, usize), f64>,
}

impl Default for CostTable {
    fn default() -> Self {
        CostTable {
            encode_gbps: 0.0,
            decode_gbps: 0.0,
            codec_launch: Duration::ZERO,
            matmul_flops: None,
            collective_gbps: BTreeMap::new(),
        }
    }
}

/// Figures that replace measured ones.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostOverrides {
    pub encode_gbps: Option<f64>,
    pub decode_gbps: Option<f64>,
    pub matmul_flops: Option<f64>,
    /// Applies to every collective and group size.
    pub collective_gbps: Option<f64>,
}

impl CostOverrides {
    /// `HP_COST_ENCODE_GBPS`, `HP_COST_DECODE_GBPS`, `HP_COST_MATMUL_TFLOPS`,
    /// `HP_COST_COLLECTIVE_GBPS`; a value that is not a positive number is an error.
    pub fn from_env() -> Result<Self> {
        fn var(name: &str, scale: f64) -> Result<Option<f64>> {
            match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => v
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .map(|x| Some(x * scale))
                    .ok_or_else(|| {
                        CompressError::InvalidArgument(format!(
                            "{name}={v:?} is not a positive number"
                        ))
                    }),
                _ => Ok(None),
            }
        }
        Ok(CostOverrides {
            encode_gbps: var("HP_COST_ENCODE_GBPS", 1.0)?,
            decode_gbps: var("HP_COST_DECODE_GBPS", 1.0)?,
            matmul_flops: var("HP_COST_MATMUL_TFLOPS", 1e12)?,
            collective_gbps: var("HP_COST_COLLECTIVE_GBPS", 1.0)?,
        })
    }

    fn apply(&self, t: &mut CostTable) {
        if let Some(v) = self.encode_gbps {
            t.encode_gbps = v;
        }
        if let Some(v) = self.decode_gbps {
            t.decode_gbps = v;
        }
        if let Some(v) = self.matmul_flops {
            t.matmul_flops = Some(v);
        }
    }
}

/// Predicts operator durations and codec capacity for one platform.
#[derive(Clone, Debug)]
pub struct CostModel {
    table: CostTable,
    overrides: CostOverrides,
}

fn cache() -> &'static Mutex<HashMap<String, CostTable>> {
    static CACHE: OnceLock<Mutex<HashMap<String, CostTable>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// What a measurement depends on: the device and the codec that ran on it.
fn platform_key(p: &dyn Platform, codec: &dyn DeviceCodec) -> String {
    let info = p.info();
    let dev = info
        .devices
        .get(p.current_device())
        .map_or_else(String::new, |d| d.name.clone());
    format!(
        "{}:{}:{dev}:{}",
        info.backend,
        p.current_device(),
        codec.name()
    )
}

impl CostModel {
    /// A model from known figures (tests, or figures measured elsewhere).
    pub fn from_table(table: CostTable) -> Self {
        CostModel {
            table,
            overrides: CostOverrides::default(),
        }
    }

    /// The model of `platform`: `codec`'s throughput measured the first time this process
    /// asks for this device and codec, then reused; `HP_COST_*` overrides applied on top.
    pub fn for_platform(platform: &dyn Platform, codec: &dyn DeviceCodec) -> Result<Self> {
        let key = platform_key(platform, codec);
        let cached = lock(cache()).get(&key).cloned();
        let table = match cached {
            Some(t) => t,
            None => {
                let t = measure_codec(platform, codec, 1 << 20)?;
                lock(cache()).insert(key, t.clone());
                t
            }
        };
        let mut m = CostModel::from_table(table);
        m.set_overrides(CostOverrides::from_env()?);
        Ok(m)
    }

    pub fn set_overrides(&mut self, o: CostOverrides) {
        self.overrides = o;
        self.overrides.apply(&mut self.table);
    }

    pub fn table(&self) -> &CostTable {
        &self.table
    }

    /// Records a measured collective bandwidth (see [`measure_collective`]).
    pub fn set_collective_gbps(&mut self, kind: CollectiveKind, group: usize, gbps: f64) {
        self.table.collective_gbps.insert((kind, group), gbps);
    }

    /// Learns from an operator the caller timed: a matmul calibrates FLOP/s, a collective its
    /// bandwidth for that group size (both as a running mean with the previous figure).
    pub fn observe(&mut self, op: &Op, measured: Duration) {
        let secs = measured.as_secs_f64();
        if secs <= 0.0 {
            return;
        }
        match op {
            Op::Matmul { m, n, k } if self.overrides.matmul_flops.is_none() => {
                let rate = 2.0 * (*m as f64) * (*n as f64) * (*k as f64) / secs;
                let prev = self.table.matmul_flops.unwrap_or(rate);
                self.table.matmul_flops = Some(0.5 * (prev + rate));
            }
            Op::Collective { kind, bytes, group } if self.overrides.collective_gbps.is_none() => {
                let rate = *bytes as f64 / secs / 1e9;
                let e = self
                    .table
                    .collective_gbps
                    .entry((*kind, *group))
                    .or_insert(rate);
                *e = 0.5 * (*e + rate);
            }
            _ => {}
        }
    }

    /// How long `op` is expected to run.
    pub fn predict(&self, op: &Op) -> Result<Duration> {
        match op {
            Op::Fixed(d) => Ok(*d),
            Op::Unbounded => Ok(Duration::MAX),
            Op::Matmul { m, n, k } => {
                let flops = self.table.matmul_flops.ok_or_else(|| {
                    CompressError::CostUnknown(
                        "no matmul throughput: set HP_COST_MATMUL_TFLOPS or observe() a timed matmul"
                            .into(),
                    )
                })?;
                Ok(Duration::from_secs_f64(
                    2.0 * (*m as f64) * (*n as f64) * (*k as f64) / flops,
                ))
            }
            Op::Collective { kind, bytes, group } => {
                let gbps = self
                    .overrides
                    .collective_gbps
                    .or_else(|| self.collective_gbps(*kind, *group))
                    .ok_or_else(|| {
                        CompressError::CostUnknown(format!(
                            "no {} bandwidth measured for groups of {group}",
                            kind.name()
                        ))
                    })?;
                Ok(Duration::from_secs_f64(*bytes as f64 / (gbps * 1e9)))
            }
        }
    }

    /// The measured bandwidth for this group size, or the nearest measured group size.
    fn collective_gbps(&self, kind: CollectiveKind, group: usize) -> Option<f64> {
        self.table
            .collective_gbps
            .iter()
            .filter(|((k, _), _)| *k == kind)
            .min_by_key(|((_, g), _)| g.abs_diff(group))
            .map(|(_, v)| *v)
    }

    /// Elements of `dtype` the codec encodes within `window` (after one launch cost).
    pub fn encodable_numel(&self, window: Duration, dtype: CodecDType) -> usize {
        capacity(
            window,
            self.table.codec_launch,
            self.table.encode_gbps,
            dtype,
        )
    }

    pub fn decodable_numel(&self, window: Duration, dtype: CodecDType) -> usize {
        capacity(
            window,
            self.table.codec_launch,
            self.table.decode_gbps,
            dtype,
        )
    }

    /// Predicted encode time of `numel` elements.
    pub fn encode_time(&self, numel: usize, dtype: CodecDType) -> Duration {
        transfer(numel, dtype, self.table.encode_gbps) + self.table.codec_launch
    }

    pub fn decode_time(&self, numel: usize, dtype: CodecDType) -> Duration {
        transfer(numel, dtype, self.table.decode_gbps) + self.table.codec_launch
    }
}

fn capacity(window: Duration, launch: Duration, gbps: f64, dtype: CodecDType) -> usize {
    let secs = window.saturating_sub(launch).as_secs_f64();
    (secs * gbps * 1e9 / dtype.size() as f64) as usize
}

fn transfer(numel: usize, dtype: CodecDType, gbps: f64) -> Duration {
    if gbps <= 0.0 {
        return Duration::MAX;
    }
    Duration::from_secs_f64((numel * dtype.size()) as f64 / (gbps * 1e9))
}

/// Times the device codec on `numel` bf16 activation-like elements (encode and decode, best of
/// three, after a warm-up), and a tiny tensor for the per-call launch cost.
pub fn measure_codec(p: &dyn Platform, codec: &dyn DeviceCodec, numel: usize) -> Result<CostTable> {
    let dtype = CodecDType::BF16;
    let stream = p.create_stream()?;
    let r = (|| {
        let time = |n: usize| -> Result<(Duration, Duration)> {
            let data = generate(DataKind::Gelu, dtype, n, 3);
            let src = p.alloc_device(data.len())?;
            p.write_device_sync(&src, 0, &data, &stream)?;
            let scratch = p.alloc_device(codec.max_encoded_len(dtype, n))?;
            let dst = p.alloc_device(data.len())?;
            let mut best = (Duration::MAX, Duration::MAX);
            for _ in 0..4 {
                let t = Instant::now();
                let packed = codec
                    .encode_async(p, src.at(0), dtype, n, &scratch, &stream)?
                    .finish_in_place(p)?;
                let e = t.elapsed();
                let t = Instant::now();
                codec
                    .decode_async(p, &packed, dst.at(0), &stream)?
                    .finish(p)?;
                let d = t.elapsed();
                best = (best.0.min(e), best.1.min(d));
            }
            Ok(best)
        };
        let (small_e, small_d) = time(64)?;
        let (e, d) = time(numel)?;
        let bytes = (numel * dtype.size()) as f64;
        let launch = small_e.min(small_d);
        Ok(CostTable {
            encode_gbps: bytes
                / e.saturating_sub(launch)
                    .max(Duration::from_nanos(1))
                    .as_secs_f64()
                / 1e9,
            decode_gbps: bytes
                / d.saturating_sub(launch)
                    .max(Duration::from_nanos(1))
                    .as_secs_f64()
                / 1e9,
            codec_launch: launch,
            ..Default::default()
        })
    })();
    p.destroy_stream(&stream)?;
    r
}

/// Measures a collective's bandwidth over `comm`: every rank calls this together. Returns
/// received bytes per rank per second / 1e9 (best of `reps` timed runs after a warm-up).
pub fn measure_collective(
    p: &dyn Platform,
    comm: &Communicator,
    stream: &Stream,
    kind: CollectiveKind,
    bytes_per_rank: usize,
    reps: usize,
) -> Result<f64> {
    let world = comm.world();
    let count = (bytes_per_rank / world.max(1)).max(1);
    let (send_elems, recv_elems) = match kind {
        CollectiveKind::AllGather => (count, count * world),
        CollectiveKind::AllToAll => (count * world, count * world),
    };
    let send = p.alloc_device(send_elems)?;
    let recv = p.alloc_device(recv_elems)?;
    let run = || -> Result<()> {
        match kind {
            CollectiveKind::AllGather => {
                p.all_gather(send.at(0), recv.at(0), count, DType::U8, comm, stream)?
            }
            CollectiveKind::AllToAll => p.collective(
                comm,
                hprt_platform::Collective::AllToAll {
                    send: send.at(0),
                    recv: recv.at(0),
                    count,
                    dtype: DType::U8,
                },
                stream,
            )?,
        }
        p.synchronize_stream(stream)?;
        Ok(())
    };
    run()?;
    let mut best = Duration::MAX;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        run()?;
        best = best.min(t.elapsed());
    }
    Ok(recv_elems as f64 / best.as_secs_f64().max(1e-9) / 1e9)
}

/// A prediction next to what was measured, for reports.
#[derive(Clone, Debug, PartialEq)]
pub struct PredictionCheck {
    pub what: String,
    pub predicted: Duration,
    pub measured: Duration,
}

impl PredictionCheck {
    /// measured / predicted.
    pub fn ratio(&self) -> f64 {
        self.measured.as_secs_f64() / self.predicted.as_secs_f64().max(1e-12)
    }
}

/// Predicts, then measures, the device codec on tensors of the given sizes.
pub fn check_codec_predictions(
    p: &dyn Platform,
    codec: &dyn DeviceCodec,
    model: &CostModel,
    sizes: &[usize],
) -> Result<Vec<PredictionCheck>> {
    let stream = p.create_stream()?;
    let dtype = CodecDType::BF16;
    let mut out = Vec::new();
    for &n in sizes {
        let data = generate(DataKind::Gaussian, dtype, n, 9);
        let src = p.alloc_device(data.len())?;
        p.write_device_sync(&src, 0, &data, &stream)?;
        let scratch = p.alloc_device(codec.max_encoded_len(dtype, n))?;
        let t = Instant::now();
        let packed = codec
            .encode_async(p, src.at(0), dtype, n, &scratch, &stream)?
            .finish_in_place(p)?;
        out.push(PredictionCheck {
            what: format!("encode {n} bf16"),
            predicted: model.encode_time(n, dtype),
            measured: t.elapsed(),
        });
        let t = Instant::now();
        codec
            .decode_async(p, &packed, src.at(0), &stream)?
            .finish(p)?;
        out.push(PredictionCheck {
            what: format!("decode {n} bf16"),
            predicted: model.decode_time(n, dtype),
            measured: t.elapsed(),
        });
    }
    p.destroy_stream(&stream)?;
    Ok(out)
}
