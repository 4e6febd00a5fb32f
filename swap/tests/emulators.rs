//! The three front ends on the npu backend over the Ascend emulator (`tests/ascend-emulator`)
//! and on the cuda backend over the CUDA emulator (`tests/cuda-emulator`), both built on first use
//! (`hprt_emulator_common::library`).

use std::sync::Arc;

use hprt_conformance::{cuda_emulator, emulator};
use hprt_platform::Platform;
use hprt_swap::sim::{simulate, FrontEnd, SimConfig, PAYLOADS};
use hprt_swap::Compression;

#[test]
fn every_front_end_on_the_ascend_emulator() {
    let p: Arc<dyn Platform> = Arc::new(emulator::open().expect("npu on the emulator"));
    assert_eq!(p.backend(), hprt_platform::BackendKind::Npu);
    every_front_end(&p);
}

#[test]
fn every_front_end_on_the_cuda_emulator() {
    let p: Arc<dyn Platform> = Arc::new(cuda_emulator::open().expect("cuda on the emulator"));
    assert_eq!(p.backend(), hprt_platform::BackendKind::Cuda);
    every_front_end(&p);
}

fn every_front_end(p: &Arc<dyn Platform>) {
    let cfg = SimConfig {
        layers: 6,
        tensor_bytes: 8192,
        iterations: 2,
        ..SimConfig::default()
    };
    let none = simulate(p, FrontEnd::NoSwap, &cfg).unwrap();
    assert_eq!(none.mismatched_tensors, 0, "{:?}", none.first_mismatch);
    for front in FrontEnd::SWAPPING {
        let r = simulate(p, front, &cfg).unwrap_or_else(|e| panic!("{front:?}: {e}"));
        assert_eq!(r.mismatched_tensors, 0, "{front:?}: {:?}", r.first_mismatch);
        assert_eq!(r.digest, none.digest, "{front:?}");
        assert!(
            r.device_peak <= 2 * r.layer_bytes && r.device_peak < none.device_peak,
            "{front:?}: peak {} (layer {}, no swap {})",
            r.device_peak,
            r.layer_bytes,
            none.device_peak
        );
    }
    // Every payload kind (borrowed memory, the device codec, the host stage) with the
    // emulator's asynchronous streams.
    for (payload, compression) in PAYLOADS {
        let cfg = SimConfig {
            payload,
            compression,
            ..cfg.clone()
        };
        let none = simulate(p, FrontEnd::NoSwap, &cfg).unwrap();
        for front in FrontEnd::SWAPPING {
            let what = format!("{front:?} {payload:?} {compression:?}");
            let r = simulate(p, front, &cfg).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(r.mismatched_tensors, 0, "{what}: {:?}", r.first_mismatch);
            assert_eq!(r.digest, none.digest, "{what}");
            assert!(r.device_peak < none.device_peak, "{what}");
            if compression != Compression::Off {
                assert!(r.engine.compressed_tensors > 0, "{what}");
            }
        }
    }
}
