//! `hprt demo`: a simulated training step of a small transformer-like model over several ranks,
//! with real tensors and real compute on the platform's streams, run once per memory strategy
//! so the strategies can be compared on the same work.
//!
//! Every strategy trains the same model from the same weights and inputs:
//! - parameters are sharded with [`hprt_hsdp::ShardedParam`] (HSDP on a 2 × n mesh when the
//!   rank count is even and at least 4, FSDP otherwise): all-gathered before each layer (the
//!   next layer's gather prefetched), released after it, gradients reduce-scattered (and
//!   all-reduced across replicas) through a [`hprt_hsdp::GradQueue`] behind the backward;
//! - each layer is `x + (x·W1)·W2` with `W1: [hidden, ffn]`, `W2: [ffn, hidden]`, f32 compute
//!   ([`hprt_platform::Kernel::Matmul`]); the layer input and the ffn hidden state are saved in
//!   the activation dtype (bf16 by default) for the backward;
//! - the backward reads the saved activations back and computes weight-shaped gradients with
//!   the same matmuls, shapes and data flow as the real one, except that the transposes a real
//!   backward needs are reshapes (the platform has no transpose kernel): it is a faithful
//!   workload for the runtime, not the model's exact derivative;
//! - one SGD update on the shards ends the step.
//!
//! What differs is where saved activations live between forward and backward ([`Strategy`]):
//! on the device, swapped to pinned host memory with [`hprt_swap::SwapEngine`], compressed on
//! the device ([`hprt_compress::codec_for`]), or compressed then swapped. The last layer's
//! activations stay on the device in every strategy (they are needed at once, as in the
//! hyper_parallel layer-group swap). Every strategy's gradients and weights are compared with the
//! baseline's bit for bit.

mod model;
mod report;

use std::sync::Arc;
#[cfg(test)]
use std::time::Duration;
use std::time::Instant;

use hprt_platform::PlatformHandle;
use hprt_platform::{CopyKind, DType, Platform};

use crate::trace::{Recorder, Role, TracingPlatform};
pub use report::{binary_units, DemoReport, LinkCosts, StrategyReport};

/// Where saved activations wait for the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// On the device (the reference every other strategy must match bit for bit).
    Baseline,
    /// Offloaded to pinned host memory after their layer, prefetched one layer ahead.
    Swap,
    /// Compressed on the codec stream after their layer; the encodings stay on the device.
    Compress,
    /// Compressed, then the encodings offloaded: fewer bytes over the host link.
    CompressSwap,
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::Baseline,
        Strategy::Swap,
        Strategy::Compress,
        Strategy::CompressSwap,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Baseline => "baseline",
            Strategy::Swap => "swap",
            Strategy::Compress => "compress",
            Strategy::CompressSwap => "compress-swap",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Strategy::ALL
            .into_iter()
            .find(|k| k.name() == s.trim())
            .ok_or_else(|| {
                DemoError::InvalidOption(format!(
                    "unknown strategy {s:?}: expected baseline, swap, compress or compress-swap"
                ))
            })
    }

    pub(crate) fn swaps(self) -> bool {
        matches!(self, Strategy::Swap | Strategy::CompressSwap)
    }
    pub(crate) fn compresses(self) -> bool {
        matches!(self, Strategy::Compress | Strategy::CompressSwap)
    }
}

/// The demo's one error.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Platform(#[from] hprt_platform::Error),
    #[error(transparent)]
    Swap(#[from] hprt_swap::SwapError),
    #[error(transparent)]
    Compress(#[from] hprt_compress::CompressError),
    #[error(transparent)]
    Hsdp(#[from] hprt_hsdp::HsdpError),
    #[error("invalid demo option: {0}")]
    InvalidOption(String),
    #[error("rank {rank} failed: {message}")]
    Rank { rank: usize, message: String },
}

pub type Result<T, E = DemoError> = std::result::Result<T, E>;

/// The model and the run.
///
/// ```
/// use hprt_cli::demo::{DemoConfig, Strategy};
/// let c = DemoConfig { layers: 2, hidden: 32, seq: 16, ranks: 2, ..DemoConfig::default() };
/// assert_eq!(c.ffn(), 64);
/// assert!(c.strategies.contains(&Strategy::Baseline));
/// c.validate().unwrap();
/// ```
#[derive(Clone, Debug)]
pub struct DemoConfig {
    pub layers: usize,
    pub hidden: usize,
    /// Width of the feed-forward hidden state; `None` is twice `hidden`.
    pub ffn: Option<usize>,
    /// Tokens per rank (each rank trains on its own slice of the batch).
    pub seq: usize,
    pub ranks: usize,
    /// Training steps per strategy; the report gives the fastest step.
    pub steps: usize,
    /// dtype of saved activations: bf16 (the default, as in mixed-precision training) or f32.
    pub act_dtype: DType,
    /// Strategies to run; the baseline always runs (first), as the reference.
    pub strategies: Vec<Strategy>,
    /// Time every piece of stream work (needed for a trace or a timeline; costs two host
    /// functions per operation).
    pub record_spans: bool,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            layers: 8,
            hidden: 256,
            ffn: None,
            seq: 512,
            ranks: 4,
            steps: 2,
            act_dtype: DType::BF16,
            strategies: vec![Strategy::Baseline, Strategy::Swap, Strategy::CompressSwap],
            record_spans: false,
        }
    }
}

impl DemoConfig {
    pub fn ffn(&self) -> usize {
        self.ffn.unwrap_or(2 * self.hidden)
    }

    /// The strategies in run order: the baseline first, each once.
    pub fn run_order(&self) -> Vec<Strategy> {
        let mut v = vec![Strategy::Baseline];
        for s in &self.strategies {
            if !v.contains(s) {
                v.push(*s);
            }
        }
        v
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(DemoError::InvalidOption(m));
        if self.layers == 0 || self.hidden == 0 || self.seq == 0 || self.ffn() == 0 {
            return bad("layers, hidden, ffn and seq must be positive".into());
        }
        if self.ranks == 0 || self.steps == 0 {
            return bad("ranks and steps must be positive".into());
        }
        if !matches!(self.act_dtype, DType::BF16 | DType::F32 | DType::F16) {
            return bad(format!(
                "activation dtype {} cannot be compressed: use bf16, f16 or f32",
                self.act_dtype
            ));
        }
        let biggest = self
            .seq
            .max(self.hidden)
            .checked_mul(self.ffn().max(self.hidden))
            .and_then(|n| n.checked_mul(8));
        if biggest.is_none() {
            return bad("the tensor sizes overflow".into());
        }
        Ok(())
    }

    /// Units of progress a run reports through its `progress` callback: one per layer of
    /// forward and of backward, per step, per strategy (counted on rank 0).
    pub fn work_units(&self) -> u64 {
        (self.run_order().len() * self.steps * self.layers * 2) as u64
    }

    /// Floating-point operations of one step on one rank (for throughput figures): two matmuls
    /// forward and four backward per layer, each `2 · seq · hidden · ffn`.
    pub fn step_flops_per_rank(&self) -> f64 {
        12.0 * self.layers as f64 * self.seq as f64 * self.hidden as f64 * self.ffn() as f64
    }
}

/// Runs every strategy of `config` on `platform` (one thread per rank, ranks on devices
/// `rank % device_count`) and reports. `progress` is called with a count of completed work
/// units (see [`DemoConfig::work_units`]). The recorder holds the spans for a trace.
pub fn run(
    platform: PlatformHandle,
    config: &DemoConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(DemoReport, Arc<Recorder>)> {
    config.validate()?;
    let rec = Recorder::new(config.record_spans);
    let traced = Arc::new(TracingPlatform::new(platform.clone(), Arc::clone(&rec)));
    let mut strategies = Vec::new();
    let mut baseline: Option<Vec<model::RankResult>> = None;
    for strategy in config.run_order() {
        rec.set_section(strategy.name());
        let results = run_ranks(&traced, config, strategy, progress)?;
        let (bit_exact, mismatch) = match &baseline {
            None => (true, None),
            Some(base) => compare(base, &results),
        };
        let section = Some(strategy.name());
        let steps = config.steps as u64;
        let swap_bytes = (rec.bytes(section, Some(Role::D2h), CopyKind::DeviceToHost)
            + rec.bytes(section, Some(Role::H2d), CopyKind::HostToDevice))
            / steps;
        let codec_bytes = (rec.bytes(section, Some(Role::Codec), CopyKind::DeviceToHost)
            + rec.bytes(section, Some(Role::Codec), CopyKind::HostToDevice))
            / steps;
        strategies.push(StrategyReport::from_ranks(
            strategy,
            &results,
            swap_bytes,
            codec_bytes,
            bit_exact,
            mismatch,
        ));
        if baseline.is_none() {
            baseline = Some(results);
        }
    }
    let baseline_step = strategies[0].step_time.as_secs_f64();
    let link = measure_link(
        &*platform,
        config.step_flops_per_rank() / baseline_step.max(1e-9),
    )?;
    let report = DemoReport {
        backend: platform.backend().to_string(),
        devices: platform.device_count(),
        config: config.clone(),
        mesh: model::mesh_name(config.ranks),
        codec: hprt_compress::codec_for(&*platform).name().to_string(),
        strategies,
        link: Some(link),
    };
    Ok((report, rec))
}

/// Host-link bandwidth (best of three 16 MiB copies each way, after a warm-up) and the codec's
/// throughput from the cost model, on the calling thread's device.
fn measure_link(p: &dyn Platform, rank_flops: f64) -> Result<LinkCosts> {
    const BYTES: usize = 16 << 20;
    let stream = p.create_stream()?;
    let dev = p.alloc_device(BYTES)?;
    let host = p.alloc_pinned(BYTES)?;
    let mut best = [f64::MAX; 2];
    for rep in 0..4 {
        for (dir, b) in best.iter_mut().enumerate() {
            let t = std::time::Instant::now();
            if dir == 0 {
                p.copy_async((&host).into(), 0, (&dev).into(), 0, BYTES, &stream)?;
            } else {
                p.copy_async((&dev).into(), 0, (&host).into(), 0, BYTES, &stream)?;
            }
            p.synchronize_stream(&stream)?;
            if rep > 0 {
                *b = b.min(t.elapsed().as_secs_f64());
            }
        }
    }
    let codec = hprt_compress::codec_for(p);
    let cost = hprt_compress::CostModel::for_platform(p, codec.as_ref())?;
    Ok(LinkCosts {
        d2h_gbps: BYTES as f64 / best[0] / 1e9,
        h2d_gbps: BYTES as f64 / best[1] / 1e9,
        encode_gbps: cost.table().encode_gbps,
        decode_gbps: cost.table().decode_gbps,
        rank_flops,
    })
}

/// Every rank's final weights and last gradients against the baseline's.
fn compare(base: &[model::RankResult], got: &[model::RankResult]) -> (bool, Option<String>) {
    for (b, g) in base.iter().zip(got) {
        for (what, x, y) in [
            ("weights", &b.weights, &g.weights),
            ("gradients", &b.grads, &g.grads),
            ("output", &b.output, &g.output),
        ] {
            if x != y {
                let at = x.iter().zip(y.iter()).position(|(p, q)| p != q);
                return (
                    false,
                    Some(format!(
                        "rank {}: {what} differ from the baseline (first at byte {})",
                        b.rank,
                        at.unwrap_or(x.len().min(y.len()))
                    )),
                );
            }
        }
    }
    (true, None)
}

fn run_ranks(
    traced: &Arc<TracingPlatform>,
    config: &DemoConfig,
    strategy: Strategy,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Vec<model::RankResult>> {
    let p: &dyn Platform = traced.as_ref();
    let id = p.unique_id()?;
    let outcomes: Vec<(Instant, Result<model::RankResult>)> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..config.ranks)
            .map(|rank| {
                let id = &id;
                sc.spawn(move || {
                    crate::trace::set_thread_rank(rank);
                    let joined = (|| -> Result<_> {
                        p.set_device(rank % p.device_count().max(1))?;
                        Ok(p.comm_init(id, rank, config.ranks)?)
                    })();
                    let comm = match joined {
                        Ok(comm) => comm,
                        Err(e) => return (Instant::now(), Err(e)),
                    };
                    // Peers learn that this rank failed when its communicator goes away, so the
                    // time of its failure is taken while this membership still keeps it.
                    let membership = comm.clone();
                    let tick = |n: u64| {
                        if rank == 0 {
                            progress(n)
                        }
                    };
                    let outcome = model::train(traced, comm, config, strategy, &tick);
                    let at = Instant::now();
                    drop(membership);
                    (at, outcome)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    let panicked = DemoError::Rank {
                        rank,
                        message: "panicked".into(),
                    };
                    (Instant::now(), Err(panicked))
                })
            })
            .collect()
    });
    // The error that happened first is the cause: its peers' failures (their communicator
    // aborted, or a timeout) follow from it.
    let first_failure = outcomes
        .iter()
        .enumerate()
        .filter(|(_, (_, r))| r.is_err())
        .min_by_key(|(_, (at, _))| *at)
        .map(|(rank, _)| rank);
    let mut results = Vec::new();
    for (rank, (_, r)) in outcomes.into_iter().enumerate() {
        match r {
            Err(e) if Some(rank) == first_failure => return Err(e),
            r => results.push(r),
        }
    }
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(rank: usize, weights: Vec<u8>) -> model::RankResult {
        model::RankResult {
            rank,
            weights,
            grads: vec![1, 2],
            output: vec![3],
            step_times: vec![Duration::from_millis(5)],
            peak_device: 0,
            resident_device: 0,
            encoded: [(0, 0); 2],
            last_step_us: (0.0, 1.0),
        }
    }

    #[test]
    fn one_changed_byte_on_one_rank_is_a_mismatch_naming_it() {
        let base = vec![result(0, vec![0; 8]), result(1, vec![0; 8])];
        assert_eq!(compare(&base, &base.clone()), (true, None));
        let mut got = base.clone();
        got[1].weights[5] ^= 1;
        let (same, why) = compare(&base, &got);
        assert!(!same);
        let why = why.unwrap();
        assert!(
            why.contains("rank 1") && why.contains("weights") && why.contains("byte 5"),
            "{why}"
        );
    }

    #[test]
    fn the_baseline_runs_first_and_once() {
        let c = DemoConfig {
            strategies: vec![Strategy::Swap, Strategy::Baseline, Strategy::Swap],
            ..DemoConfig::default()
        };
        assert_eq!(c.run_order(), vec![Strategy::Baseline, Strategy::Swap]);
        assert_eq!(c.work_units(), 2 * 2 * 8 * 2);
        assert!(Strategy::parse("zip").is_err());
        assert_eq!(
            Strategy::parse("compress-swap").unwrap(),
            Strategy::CompressSwap
        );
        let bad = DemoConfig {
            act_dtype: DType::I32,
            ..DemoConfig::default()
        };
        assert!(matches!(bad.validate(), Err(DemoError::InvalidOption(_))));
    }
}
