//! What `hprt demo` prints: memory, host-link bytes, compression ratios and step time per
//! strategy, whether each matched the baseline bit for bit, and the cost figures that say when
//! swap and compression pay off on this platform.

use std::fmt;
use std::time::Duration;

use super::model::{RankResult, SAVED};
use super::{DemoConfig, Strategy};

/// One strategy's results over all ranks.
#[derive(Clone, Debug)]
pub struct StrategyReport {
    pub strategy: Strategy,
    /// Highest device memory any rank's device held during the steps.
    pub peak_device: usize,
    /// Device memory held between steps (weight and gradient shards), highest rank.
    pub resident_device: usize,
    /// The fastest step (each step timed on every rank; a step lasts as long as its slowest rank).
    pub step_time: Duration,
    /// Bytes the swap engines moved over the host link per step, all ranks, both directions.
    pub swap_link_bytes: u64,
    /// Bytes the codec itself moved over the host link per step: the host codec copies
    /// tensors to pinned memory to encode them; a device codec only reads back each
    /// encoding's length and each decoding's status word.
    pub codec_link_bytes: u64,
    /// Original and encoded bytes per saved kind (`model::SAVED` order), all ranks and steps.
    pub encoded: [(u64, u64); 2],
    pub bit_exact: bool,
    pub mismatch: Option<String>,
    /// Rank 0's last step on the trace clock (for a timeline).
    pub last_step_us: (f64, f64),
}

impl StrategyReport {
    pub(crate) fn from_ranks(
        strategy: Strategy,
        ranks: &[RankResult],
        swap_link_bytes: u64,
        codec_link_bytes: u64,
        bit_exact: bool,
        mismatch: Option<String>,
    ) -> Self {
        let steps = ranks.iter().map(|r| r.step_times.len()).min().unwrap_or(0);
        let step_time = (0..steps)
            .map(|i| {
                ranks
                    .iter()
                    .map(|r| r.step_times[i])
                    .max()
                    .unwrap_or_default()
            })
            .min()
            .unwrap_or_default();
        let mut encoded = [(0, 0); 2];
        for r in ranks {
            for (e, x) in encoded.iter_mut().zip(r.encoded) {
                e.0 += x.0;
                e.1 += x.1;
            }
        }
        StrategyReport {
            strategy,
            peak_device: ranks.iter().map(|r| r.peak_device).max().unwrap_or(0),
            resident_device: ranks.iter().map(|r| r.resident_device).max().unwrap_or(0),
            step_time,
            swap_link_bytes,
            codec_link_bytes,
            encoded,
            bit_exact,
            mismatch,
            last_step_us: ranks
                .iter()
                .find(|r| r.rank == 0)
                .map_or((0.0, 0.0), |r| r.last_step_us),
        }
    }

    /// Original over encoded bytes of one saved kind, if any was compressed.
    pub fn ratio(&self, kind: usize) -> Option<f64> {
        let (orig, enc) = self.encoded[kind];
        (enc > 0).then(|| orig as f64 / enc as f64)
    }
}

/// Measured figures of this platform that decide whether swap and compression pay off.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkCosts {
    /// Device → pinned host copy bandwidth, GB/s.
    pub d2h_gbps: f64,
    pub h2d_gbps: f64,
    /// The platform's codec (from `hprt_compress::CostModel`), GB/s of original bytes.
    pub encode_gbps: f64,
    pub decode_gbps: f64,
    /// Matmul throughput one rank achieved in the baseline, FLOP/s.
    pub rank_flops: f64,
}

/// Everything `hprt demo` prints.
#[derive(Clone, Debug)]
pub struct DemoReport {
    pub backend: String,
    pub devices: usize,
    pub config: DemoConfig,
    pub mesh: String,
    /// The device codec's name (`hprt_compress::codec_for` the platform).
    pub codec: String,
    /// In run order; the first is the baseline.
    pub strategies: Vec<StrategyReport>,
    pub link: Option<LinkCosts>,
}

impl DemoReport {
    /// Whether every strategy matched the baseline bit for bit.
    pub fn all_bit_exact(&self) -> bool {
        self.strategies.iter().all(|s| s.bit_exact)
    }

    pub fn strategy(&self, s: Strategy) -> Option<&StrategyReport> {
        self.strategies.iter().find(|r| r.strategy == s)
    }

    /// Why the costs favour (or not) each strategy, one line each, from the measured figures:
    /// an offload hides behind compute when its link time per layer is below the layer's
    /// compute time; compression pays when the link time it saves exceeds its codec time.
    pub fn advice(&self) -> Vec<String> {
        let Some(link) = &self.link else {
            return Vec::new();
        };
        let c = &self.config;
        let act = c.act_dtype.size() as f64;
        let saved_per_layer = (c.seq * (c.hidden + c.ffn())) as f64 * act;
        let layer_compute = c.step_flops_per_rank() / (2.0 * c.layers as f64) / link.rank_flops;
        let link_gbps = link.d2h_gbps.min(link.h2d_gbps);
        let swap_t = saved_per_layer / (link_gbps * 1e9);
        let ratio = self
            .strategies
            .iter()
            .find_map(|s| {
                let (o, e) = s.encoded.iter().fold((0, 0), |a, x| (a.0 + x.0, a.1 + x.1));
                (e > 0).then(|| o as f64 / e as f64)
            })
            .unwrap_or(1.0);
        let codec_t = saved_per_layer / (link.encode_gbps * 1e9).max(1.0);
        let saved_link_t = swap_t * (1.0 - 1.0 / ratio);
        let ms = |s: f64| format!("{:.2} ms", s * 1e3);
        let mut v = vec![format!(
            "per layer and rank: compute {} (at {:.1} GFLOP/s), {} of saved activations: {} over the link at {:.1} GB/s, encode {} at {:.2} GB/s",
            ms(layer_compute),
            link.rank_flops / 1e9,
            human(saved_per_layer as u64),
            ms(swap_t),
            link_gbps,
            ms(codec_t),
            link.encode_gbps,
        )];
        // What the run itself showed, beside what the figures predict.
        let measured = |s: Strategy| -> String {
            match (self.strategies.first(), self.strategy(s)) {
                (Some(b), Some(r)) if !b.step_time.is_zero() => format!(
                    " (measured here: {:+.0}% step time)",
                    (r.step_time.as_secs_f64() / b.step_time.as_secs_f64() - 1.0) * 100.0
                ),
                _ => String::new(),
            }
        };
        v.push(if swap_t < layer_compute {
            format!(
                "swap: the copies fit behind the next layer's compute, so swap saves memory at little step-time cost{}",
                measured(Strategy::Swap)
            )
        } else {
            format!(
                "swap: the link needs {:.1}x a layer's compute time, so swap stalls the step; prefer it only where memory forces it{}",
                swap_t / layer_compute,
                measured(Strategy::Swap)
            )
        });
        v.push(if saved_link_t > codec_t {
            format!(
                "compress-then-swap: a {ratio:.2}x ratio saves {} of link time per layer for {} of codec time: worth it when the link is the bottleneck{}",
                ms(saved_link_t),
                ms(codec_t),
                measured(Strategy::CompressSwap)
            )
        } else {
            format!(
                "compress-then-swap: a {ratio:.2}x ratio saves {} of link time per layer but costs {} of codec time here: not worth it on this platform's codec{}",
                ms(saved_link_t),
                ms(codec_t),
                measured(Strategy::CompressSwap)
            )
        });
        v
    }
}

pub(crate) fn human(bytes: u64) -> String {
    match binary_units(bytes) {
        (_, "B") => format!("{bytes} B"),
        (v, unit) => format!("{v:.1} {unit}"),
    }
}

/// `bytes` in the largest binary unit (up to TiB) that leaves at least 1 of it; the report and
/// the `info` command print sizes alike.
pub fn binary_units(bytes: u64) -> (f64, &'static str) {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    (v, UNITS[u])
}

fn duration(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 1000.0 {
        format!("{:.2} s", ms / 1e3)
    } else {
        format!("{ms:.0} ms")
    }
}

impl fmt::Display for DemoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let shared = c.ranks > self.devices;
        writeln!(
            f,
            "hprt demo on {} ({} device{}): {} ranks, {}",
            self.backend,
            self.devices,
            if self.devices == 1 { "" } else { "s" },
            c.ranks,
            self.mesh
        )?;
        writeln!(
            f,
            "model: {} layers x (x + (x·W1)·W2), hidden {}, ffn {}, {} tokens per rank, {} saved activations, {} step{} per strategy",
            c.layers,
            c.hidden,
            c.ffn(),
            c.seq,
            c.act_dtype,
            c.steps,
            if c.steps == 1 { "" } else { "s" }
        )?;
        writeln!(f)?;
        let base_peak = self.strategies.first().map_or(0, |s| s.peak_device);
        writeln!(
            f,
            "{:<14} {:>12} {:>8} {:>16} {:>10}  bit-exact vs baseline",
            "strategy", "peak device", "change", "host link/step", "step time"
        )?;
        for s in &self.strategies {
            let change = if s.strategy == Strategy::Baseline || base_peak == 0 {
                "-".to_string()
            } else {
                format!(
                    "{:+.0}%",
                    (s.peak_device as f64 / base_peak as f64 - 1.0) * 100.0
                )
            };
            let exact = match (&s.strategy, s.bit_exact, &s.mismatch) {
                (Strategy::Baseline, _, _) => "(reference)".to_string(),
                (_, true, _) => "yes".to_string(),
                (_, false, Some(m)) => format!("NO: {m}"),
                (_, false, None) => "NO".to_string(),
            };
            writeln!(
                f,
                "{:<14} {:>12} {:>8} {:>16} {:>10}  {exact}",
                s.strategy.name(),
                human(s.peak_device as u64),
                change,
                human(s.swap_link_bytes),
                duration(s.step_time),
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "peak device memory is per {} (highest of the ranks); {} of it is weight and gradient shards held between steps",
            if shared { "device, shared by several ranks" } else { "rank" },
            human(self.strategies.first().map_or(0, |s| s.resident_device) as u64)
        )?;
        for s in self.strategies.iter().filter(|s| s.strategy.compresses()) {
            let ratios: Vec<String> = SAVED
                .iter()
                .enumerate()
                .filter_map(|(k, name)| s.ratio(k).map(|r| format!("{name} {r:.2}x")))
                .collect();
            writeln!(
                f,
                "compression ratio per saved activation ({}, {}): {}",
                s.strategy.name(),
                c.act_dtype,
                ratios.join(", ")
            )?;
            if s.codec_link_bytes > 0 {
                writeln!(
                    f,
                    "  the {} codec itself moved {} per step over the host link ({})",
                    self.codec,
                    human(s.codec_link_bytes),
                    if self.codec == "host" {
                        "pinned staging: this platform's codec is the CPU codec"
                    } else {
                        "encoded lengths and decoder status words"
                    }
                )?;
            }
        }
        if let Some(l) = &self.link {
            writeln!(
                f,
                "\nmeasured: host link {:.1} GB/s d2h, {:.1} GB/s h2d; codec {:.2} GB/s encode, {:.2} GB/s decode; {:.1} GFLOP/s matmul per rank",
                l.d2h_gbps, l.h2d_gbps, l.encode_gbps, l.decode_gbps, l.rank_flops / 1e9
            )?;
            for line in self.advice() {
                writeln!(f, "  {line}")?;
            }
        }
        writeln!(
            f,
            "\n{}",
            if self.all_bit_exact() {
                "every strategy's gradients, weights and outputs matched the baseline bit for bit"
            } else {
                "MISMATCH: a strategy's results differ from the baseline (see above)"
            }
        )
    }
}
