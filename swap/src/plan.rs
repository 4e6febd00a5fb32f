//! Which layers to offload: the offload planner.
//!
//! Swap pays where a layer's copies run behind compute: its offload behind the next layer's
//! forward, its reload behind the next layer's backward (which prefetches it). Given each
//! layer's measured saved bytes and compute times and the measured host-link speed, the
//! planner picks the layers to offload for one of three targets:
//! - [`PlanTarget::Auto`]: every layer whose copies hide behind compute (with a margin), and no
//!   other: the step should take no longer than without swap;
//! - [`PlanTarget::Fraction`]: that fraction of the offloadable layers, earliest first
//!   (Megatron-LM's `activation_offload_fraction`; the earliest layers wait longest for their
//!   backward);
//! - [`PlanTarget::Budget`]: the fewest exposed copy time that brings the predicted peak of
//!   saved bytes under a budget, cheapest layers (exposed time per byte saved) first.
//!
//! The last layer is never offloaded (its backward comes first, as every front end does).
//! The predicted peak is what the layers keep plus the one offload the front ends let be in
//! flight at the end of the forward (the largest offloaded layer's bytes).

use std::time::Duration;

use crate::error::{Result, SwapError};

/// What one layer saves and how long its compute takes, measured in a profiling step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerProfile {
    /// Bytes of the saved tensors swap would take.
    pub saved_bytes: u64,
    pub forward: Duration,
    pub backward: Duration,
}

/// What the plan aims for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PlanTarget {
    /// Offload what hides behind compute.
    Auto,
    /// Offload this fraction (0 to 1) of the offloadable layers, earliest first.
    Fraction(f64),
    /// Keep the predicted peak of saved bytes at or under this many bytes.
    Budget(u64),
}

/// The share of a compute window a copy may fill in [`PlanTarget::Auto`] (copies share the
/// link and the device with other work: a copy that exactly fills its window would show).
pub const AUTO_MARGIN: f64 = 0.9;

/// The planner's choice and what it predicts.
#[derive(Clone, Debug, PartialEq)]
pub struct OffloadPlan {
    /// Per layer, in forward order: whether it is offloaded.
    pub offload: Vec<bool>,
    /// Saved bytes on the device at the end of the forward, predicted.
    pub predicted_peak_bytes: u64,
    /// The same without swap (every layer kept).
    pub unswapped_peak_bytes: u64,
    /// Copy time the plan cannot hide behind compute, predicted.
    pub exposed: Duration,
    /// Whether the target is met (a budget can be out of reach: then every offloadable layer
    /// is offloaded).
    pub meets_target: bool,
}

impl OffloadPlan {
    /// The plan as a table, one row per layer (what `stats()` and the summary print).
    pub fn table(&self, layers: &[LayerProfile], link_gbps: f64) -> String {
        let mut out = format!(
            "{:>5}  {:>12}  {:>10}  {:>10}  {:>10}  {}\n",
            "layer", "saved bytes", "fwd ms", "bwd ms", "copy ms", "offloaded"
        );
        for (i, (l, &off)) in layers.iter().zip(&self.offload).enumerate() {
            out += &format!(
                "{i:>5}  {:>12}  {:>10.3}  {:>10.3}  {:>10.3}  {}\n",
                l.saved_bytes,
                ms(l.forward),
                ms(l.backward),
                ms(copy_time(l.saved_bytes, link_gbps)),
                if off { "yes" } else { "no" }
            );
        }
        out += &format!(
            "predicted peak {} of {} saved bytes, {:.3} ms of copies exposed{}",
            self.predicted_peak_bytes,
            self.unswapped_peak_bytes,
            ms(self.exposed),
            if self.meets_target {
                ""
            } else {
                " (target out of reach)"
            }
        );
        out
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// How long `bytes` take over a link of `gbps` (10^9 bytes per second).
pub fn copy_time(bytes: u64, gbps: f64) -> Duration {
    Duration::from_secs_f64(bytes as f64 / (gbps * 1e9))
}

/// Copy time of layer `i` not hidden: its offload behind layer `i + 1`'s forward, its reload
/// behind layer `i + 1`'s backward.
fn exposed(layers: &[LayerProfile], i: usize, gbps: f64) -> Duration {
    let copy = copy_time(layers[i].saved_bytes, gbps);
    let next = layers[i + 1];
    copy.saturating_sub(next.forward) + copy.saturating_sub(next.backward)
}

fn peak(layers: &[LayerProfile], offload: &[bool]) -> u64 {
    let kept: u64 = layers
        .iter()
        .zip(offload)
        .filter(|(_, &o)| !o)
        .map(|(l, _)| l.saved_bytes)
        .sum();
    let in_flight = layers
        .iter()
        .zip(offload)
        .filter(|(_, &o)| o)
        .map(|(l, _)| l.saved_bytes)
        .max()
        .unwrap_or(0);
    kept + in_flight
}

/// Chooses the layers to offload (see the module docs). `link_gbps` is the measured
/// device-to-host speed in 10^9 bytes per second.
///
/// ```
/// use std::time::Duration;
/// use hprt_swap::{plan_offload, LayerProfile, PlanTarget};
///
/// let ms = Duration::from_millis;
/// let layer = |mb: u64, fwd| LayerProfile { saved_bytes: mb << 20, forward: ms(fwd), backward: ms(2 * fwd) };
/// // 100 MiB at 50 GB/s take ~2.1 ms: they hide behind a 10 ms layer, not behind a 1 ms one.
/// let layers = [layer(100, 10), layer(100, 10), layer(100, 1), layer(100, 10)];
/// let plan = plan_offload(&layers, 50.0, PlanTarget::Auto).unwrap();
/// assert_eq!(plan.offload, [true, false, true, false]);
/// ```
pub fn plan_offload(
    layers: &[LayerProfile],
    link_gbps: f64,
    target: PlanTarget,
) -> Result<OffloadPlan> {
    if !(link_gbps.is_finite() && link_gbps > 0.0) {
        return Err(SwapError::Order(format!(
            "plan_offload: the link speed must be a positive number of GB/s, not {link_gbps}"
        )));
    }
    let n = layers.len();
    let candidates = n.saturating_sub(1);
    let mut offload = vec![false; n];
    let mut meets_target = true;
    match target {
        PlanTarget::Auto => {
            for (i, o) in offload.iter_mut().enumerate().take(candidates) {
                let copy = copy_time(layers[i].saved_bytes, link_gbps).as_secs_f64();
                let window = layers[i + 1].forward.min(layers[i + 1].backward);
                *o = layers[i].saved_bytes > 0 && copy <= AUTO_MARGIN * window.as_secs_f64();
            }
        }
        PlanTarget::Fraction(f) => {
            if !(0.0..=1.0).contains(&f) {
                return Err(SwapError::Order(format!(
                    "plan_offload: offload_fraction must lie in [0, 1], not {f}"
                )));
            }
            let count = (f * candidates as f64).round() as usize;
            offload[..count].iter_mut().for_each(|o| *o = true);
        }
        PlanTarget::Budget(budget) => {
            let mut order: Vec<usize> = (0..candidates)
                .filter(|&i| layers[i].saved_bytes > 0)
                .collect();
            // Cheapest first: exposed copy time per byte the layer frees, then forward order.
            order.sort_by(|&a, &b| {
                let cost = |i: usize| {
                    exposed(layers, i, link_gbps).as_secs_f64() / layers[i].saved_bytes as f64
                };
                cost(a).total_cmp(&cost(b)).then(a.cmp(&b))
            });
            let mut chosen = order.into_iter();
            while peak(layers, &offload) > budget {
                match chosen.next() {
                    Some(i) => offload[i] = true,
                    None => {
                        meets_target = false;
                        break;
                    }
                }
            }
        }
    }
    let exposed = (0..candidates)
        .filter(|&i| offload[i])
        .map(|i| exposed(layers, i, link_gbps))
        .sum();
    Ok(OffloadPlan {
        predicted_peak_bytes: peak(layers, &offload),
        unswapped_peak_bytes: layers.iter().map(|l| l.saved_bytes).sum(),
        offload,
        exposed,
        meets_target,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(mib: u64, fwd_ms: u64) -> LayerProfile {
        LayerProfile {
            saved_bytes: mib << 20,
            forward: Duration::from_millis(fwd_ms),
            backward: Duration::from_millis(2 * fwd_ms),
        }
    }

    #[test]
    fn auto_offloads_what_hides_behind_the_next_layer_and_never_the_last() {
        // 100 MiB at 10 GB/s: 10.5 ms. Behind 20 ms of forward (and 40 of backward): hidden.
        let layers = [
            layer(100, 20),
            layer(100, 20),
            layer(100, 5),
            layer(100, 20),
        ];
        let plan = plan_offload(&layers, 10.0, PlanTarget::Auto).unwrap();
        // Layer 1's window is layer 2's 5 ms forward: too short.
        assert_eq!(plan.offload, [true, false, true, false]);
        assert_eq!(plan.exposed, Duration::ZERO);
        assert_eq!(plan.predicted_peak_bytes, 300 << 20);
        assert_eq!(plan.unswapped_peak_bytes, 400 << 20);
        // The margin: a copy filling 95 % of its window is not taken.
        let tight = [layer(95, 10), layer(1, 10)];
        let gbps = (95u64 << 20) as f64 / 0.010 / 1e9;
        assert_eq!(
            plan_offload(&tight, gbps, PlanTarget::Auto)
                .unwrap()
                .offload,
            [false, false]
        );
    }

    #[test]
    fn a_fraction_takes_the_earliest_offloadable_layers() {
        let layers = [layer(10, 1); 5];
        let plan = |f| plan_offload(&layers, 1.0, PlanTarget::Fraction(f)).unwrap();
        assert_eq!(plan(0.5).offload, [true, true, false, false, false]);
        assert_eq!(plan(1.0).offload, [true, true, true, true, false]);
        assert_eq!(plan(0.0).offload, [false; 5]);
        assert!(plan_offload(&layers, 1.0, PlanTarget::Fraction(1.5)).is_err());
        assert!(plan_offload(&layers, 0.0, PlanTarget::Auto).is_err());
    }

    #[test]
    fn a_budget_offloads_the_cheapest_layers_until_the_peak_fits() {
        // Layers 1 and 2 hide their copies behind slow layers; layer 0's show behind layer 1.
        let layers = [
            layer(100, 20),
            layer(100, 1),
            layer(100, 40),
            layer(100, 40),
        ];
        let gbps = 10.0; // 100 MiB: 10.5 ms
        let budget = |b| plan_offload(&layers, gbps, PlanTarget::Budget(b)).unwrap();
        // Kept bytes plus the one offload in flight: two offloaded layers reach 300 MiB.
        let p = budget(300 << 20);
        assert_eq!(
            p.offload,
            [false, true, true, false],
            "the hidden layers first"
        );
        assert_eq!(p.predicted_peak_bytes, 300 << 20);
        assert!(p.meets_target && p.exposed == Duration::ZERO);
        let p = budget(250 << 20);
        assert_eq!(p.offload, [true, true, true, false]);
        assert_eq!(p.predicted_peak_bytes, 200 << 20);
        assert!(p.exposed > Duration::ZERO);
        // Out of reach: everything offloadable, and said so.
        let p = budget(1 << 20);
        assert_eq!(p.offload, [true, true, true, false]);
        assert!(!p.meets_target);
        assert!(p.table(&layers, gbps).contains("out of reach"));
        // Nothing to do under a generous budget.
        assert_eq!(budget(1 << 40).offload, [false; 4]);
    }
}
