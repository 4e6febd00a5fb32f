//! The simulated N-layer step through every front end on the cpu backend: bytes, peak memory,
//! jitter, and the waits each proven necessary by removing it.

use std::sync::Arc;

use hprt_platform::{CpuBackend, CpuConfig, Platform};
use hprt_swap::sim::{simulate, FrontEnd, PayloadKind, SimConfig, SimReport, PAYLOADS};
use hprt_swap::{Compression, Faults};

mod common;
use common::{assert_some_seed_catches, fault_seeds, jitter_seeds};

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

/// With copies that lag (jitter), the bound holds because a reload waits for the copies of
/// offloads taken back before it (the pipeline takes back the last group's offload when its
/// backward comes first): memory those copies read is device memory until they finished.
#[test]
fn peak_stays_within_two_layers_under_jitter_and_needs_the_taken_back_wait() {
    let cfg = SimConfig {
        layers: 4,
        tensor_bytes: 2048,
        ..SimConfig::default()
    };
    let over_bound = |faults: Faults, seed: u64| {
        let r = run(
            FrontEnd::Pipeline,
            &SimConfig {
                faults,
                ..cfg.clone()
            },
            Some(seed),
        );
        assert_eq!(
            r.mismatched_tensors, 0,
            "seed {seed}: {:?}",
            r.first_mismatch
        );
        r.device_peak > 2 * r.layer_bytes
    };
    for seed in jitter_seeds() {
        for front in FrontEnd::SWAPPING {
            let r = run(front, &cfg, Some(seed));
            assert!(
                r.device_peak <= 2 * r.layer_bytes,
                "{front:?} jitter seed {seed}: peak {} > 2 layers of {}",
                r.device_peak,
                r.layer_bytes
            );
        }
    }
    let faults = Faults {
        skip_taken_back_wait: true,
        ..Faults::default()
    };
    assert_some_seed_catches(
        |seed| over_bound(faults, seed),
        "removing the wait for taken-back offloads",
    );
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
    for seed in jitter_seeds() {
        for front in FrontEnd::SWAPPING {
            for (payload, compression) in PAYLOADS {
                let cfg = SimConfig {
                    seed,
                    payload,
                    compression,
                    ..cfg.clone()
                };
                let r = run(front, &cfg, Some(seed));
                assert_eq!(
                    r.mismatched_tensors, 0,
                    "{front:?} {payload:?} {compression:?} jitter seed {seed}: {:?}",
                    r.first_mismatch
                );
            }
        }
    }
}

#[test]
fn every_payload_kind_returns_every_byte_and_releases_device_memory() {
    let cfg = SimConfig {
        layers: 6,
        tensor_bytes: 16 << 10,
        iterations: 2,
        ..SimConfig::default()
    };
    for (payload, compression) in PAYLOADS {
        let cfg = SimConfig {
            payload,
            compression,
            ..cfg.clone()
        };
        let none = run(FrontEnd::NoSwap, &cfg, None);
        for front in FrontEnd::SWAPPING {
            let r = run(front, &cfg, None);
            let what = format!("{front:?} {payload:?} {compression:?}");
            assert_eq!(r.mismatched_tensors, 0, "{what}: {:?}", r.first_mismatch);
            assert_eq!(r.digest, none.digest, "{what}");
            // Two layers (the one computing, the one moving), plus, for the device codec, its
            // scratch buffers (encodings of up to two layers are counted until freed in stream order).
            let layers = if compression == Compression::Device {
                4
            } else {
                2
            };
            let bound = layers * r.layer_bytes + (16 << 10);
            assert!(
                r.device_peak <= bound,
                "{what}: peak {} > {bound}",
                r.device_peak
            );
            assert!(none.device_peak > r.device_peak, "{what}");
            let e = r.engine;
            assert!(e.offloaded_tensors > 0, "{what}: {e:?}");
            if compression == Compression::Off {
                assert_eq!(e.compressed_tensors, 0, "{what}");
                assert_eq!(e.link_d2h_bytes, e.offloaded_bytes, "{what}");
            } else {
                // Every reload was of an encoding (offloads taken back before they finished
                // may not have been encoded yet).
                assert!(e.compressed_tensors >= e.reloaded_tensors, "{what}: {e:?}");
                assert!(e.reloaded_tensors > 0, "{what}: {e:?}");
                assert!(e.codec_ns > 0, "{what}");
            }
            if compression == Compression::Device {
                // Random f32 bits do not compress: the encoding may be a little larger.
                assert!(
                    e.link_d2h_bytes <= e.offloaded_bytes + e.offloaded_tensors * 4096,
                    "{what}: {e:?}"
                );
                assert!(e.link_d2h_bytes < e.offloaded_bytes * 2, "{what}: {e:?}");
            }
        }
    }
}

/// Runs with `faults` under jitter seeds until one run returns wrong bytes: every payload kind
/// in `payloads` must show the fault by itself (with the faults off the same seeds all pass:
/// `jitter_twenty_seeds_every_front_end`).
fn fault_shows_up_for_every_payload(
    front: FrontEnd,
    faults: Faults,
    payloads: &[(PayloadKind, Compression)],
) {
    let cfg = SimConfig {
        layers: 3,
        tensor_bytes: 2048,
        faults,
        ..SimConfig::default()
    };
    for &(payload, compression) in payloads {
        let seen = fault_seeds().into_iter().find_map(|seed| {
            run(
                front,
                &SimConfig {
                    seed,
                    payload,
                    compression,
                    ..cfg.clone()
                },
                Some(seed),
            )
            .first_mismatch
        });
        assert!(
            seen.is_some(),
            "{front:?} {payload:?} {compression:?}: removing a wait ({faults:?}) went unnoticed"
        );
    }
}

#[test]
fn offload_without_waiting_for_the_producer_saves_wrong_bytes() {
    let faults = Faults {
        skip_producer_wait: true,
        ..Faults::default()
    };
    for front in FrontEnd::SWAPPING {
        fault_shows_up_for_every_payload(front, faults, &PAYLOADS);
    }
}

#[test]
fn using_a_tensor_without_waiting_for_its_reload_reads_wrong_bytes() {
    let faults = Faults {
        skip_reload_wait: true,
        ..Faults::default()
    };
    // A compressed reload is checked on the host (its decode may fail), which also orders it
    // before the compute stream's use: the stream wait matters only for plain payloads.
    let plain: Vec<_> = PAYLOADS
        .into_iter()
        .filter(|(_, c)| *c == Compression::Off)
        .collect();
    for front in FrontEnd::SWAPPING {
        fault_shows_up_for_every_payload(front, faults, &plain);
    }
}
