//! The simulated N-layer step through every front end on the cpu backend: bytes, peak memory,
//! jitter, and the waits each proven necessary by removing it.

use std::sync::Arc;

use hprt_platform::{CpuBackend, CpuConfig, Platform};
use hprt_swap::sim::{simulate, FrontEnd, SimConfig, SimReport};
use hprt_swap::Faults;

const SEEDS: u64 = 20;

fn cpu(jitter: Option<u64>) -> Arc<dyn Platform> {
    Arc::new(CpuBackend::new(CpuConfig {
        device_memory: 64 << 20,
        jitter,
        ..CpuConfig::default()
    }))
}

fn run(front: FrontEnd, cfg: &SimConfig, jitter: Option<u64>) -> SimReport {
    simulate(cpu(jitter), front, cfg).unwrap_or_else(|e| panic!("{front:?}: {e}"))
}

#[test]
fn every_front_end_returns_every_saved_byte() {
    let cfg = SimConfig {
        layers: 6,
        iterations: 2,
        ..SimConfig::default()
    };
    let baseline = run(FrontEnd::NoSwap, &cfg, None);
    assert_eq!(
        baseline.mismatched_tensors, 0,
        "{:?}",
        baseline.first_mismatch
    );
    for front in FrontEnd::SWAPPING {
        let r = run(front, &cfg, None);
        assert_eq!(r.mismatched_tensors, 0, "{front:?}: {:?}", r.first_mismatch);
        assert_eq!(r.digest, baseline.digest, "{front:?}");
        // The second iteration reused the first one's pinned blocks.
        assert!(
            r.pool.hits > 0 && r.pool.misses == 0,
            "{front:?}: {:?}",
            r.pool
        );
    }
}

#[test]
fn peak_device_memory_stays_within_two_layers() {
    let cfg = SimConfig {
        layers: 8,
        tensor_bytes: 64 << 10,
        ..SimConfig::default()
    };
    let none = run(FrontEnd::NoSwap, &cfg, None);
    assert!(none.device_peak >= cfg.layers * none.layer_bytes);
    for front in FrontEnd::SWAPPING {
        let r = run(front, &cfg, None);
        assert_eq!(r.mismatched_tensors, 0, "{front:?}: {:?}", r.first_mismatch);
        // The layer being computed and the one being offloaded (forward) or prefetched
        // (backward); nothing else.
        let bound = 2 * r.layer_bytes;
        assert!(
            r.device_peak <= bound,
            "{front:?}: peak {} > {bound} (no swap: {})",
            r.device_peak,
            none.device_peak
        );
    }
}

#[test]
fn sixteen_layers_identical_results_and_lower_peak_than_no_swap() {
    let cfg = SimConfig {
        layers: 16,
        tensor_bytes: 16 << 10,
        seed: 16,
        ..SimConfig::default()
    };
    let none = run(FrontEnd::NoSwap, &cfg, None);
    for front in FrontEnd::SWAPPING {
        let r = run(front, &cfg, None);
        assert_eq!(r.mismatched_tensors, 0, "{front:?}: {:?}", r.first_mismatch);
        assert_eq!(
            r.digest, none.digest,
            "{front:?}: results differ from no swap"
        );
        assert!(
            none.device_peak > r.device_peak,
            "{front:?}: peak none {} <= swap {}",
            none.device_peak,
            r.device_peak
        );
    }
}

#[test]
fn jitter_twenty_seeds_every_front_end() {
    let cfg = SimConfig {
        layers: 4,
        tensor_bytes: 2048,
        ..SimConfig::default()
    };
    for seed in 0..SEEDS {
        for front in FrontEnd::SWAPPING {
            let cfg = SimConfig {
                seed,
                ..cfg.clone()
            };
            let r = run(front, &cfg, Some(seed));
            assert_eq!(
                r.mismatched_tensors, 0,
                "{front:?} jitter seed {seed}: {:?}",
                r.first_mismatch
            );
        }
    }
}

/// Runs with `faults` under jitter seeds until one run returns wrong bytes; with the faults off
/// the same seeds must all pass (checked by `jitter_twenty_seeds_every_front_end`).
fn fault_shows_up(front: FrontEnd, faults: Faults) -> Option<String> {
    let cfg = SimConfig {
        layers: 3,
        tensor_bytes: 2048,
        faults,
        ..SimConfig::default()
    };
    (0..SEEDS).find_map(|seed| {
        let r = run(
            front,
            &SimConfig {
                seed,
                ..cfg.clone()
            },
            Some(seed),
        );
        r.first_mismatch
    })
}

#[test]
fn offload_without_waiting_for_the_producer_saves_wrong_bytes() {
    let faults = Faults {
        skip_producer_wait: true,
        ..Faults::default()
    };
    for front in FrontEnd::SWAPPING {
        let seen = fault_shows_up(front, faults);
        assert!(
            seen.is_some(),
            "{front:?}: removing the producer wait went unnoticed"
        );
    }
}

#[test]
fn using_a_tensor_without_waiting_for_its_reload_reads_wrong_bytes() {
    let faults = Faults {
        skip_reload_wait: true,
        ..Faults::default()
    };
    for front in FrontEnd::SWAPPING {
        let seen = fault_shows_up(front, faults);
        assert!(
            seen.is_some(),
            "{front:?}: removing the reload wait went unnoticed"
        );
    }
}
