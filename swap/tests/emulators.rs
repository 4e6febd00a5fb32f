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

/// The CUDA emulator counts driver calls process-wide: a test counting them runs alone among
/// this binary's cuda tests.
static CUDA_SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn every_front_end_on_the_cuda_emulator() {
    let _alone = CUDA_SERIAL.lock().unwrap_or_else(|e| e.into_inner());
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

/// ISSUE 30 item 3: the device-coded tensors of one offload (a layer's saved tensors) are
/// encoded with one batched launch sequence — three kernel launches for the batch, not three a
/// tensor — and one host wait for their lengths, and decoded at their reload with one launch;
/// every tensor comes back bit-exact.
#[test]
fn one_offloads_device_coded_tensors_are_encoded_in_one_launch_sequence() {
    use hprt_platform::DType;
    use hprt_swap::{DeviceTensor, EngineConfig, Saved, SwapEngine, SwapState, SwapTensor};

    let _alone = CUDA_SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let p: Arc<dyn Platform> = Arc::new(cuda_emulator::open().expect("cuda on the emulator"));
    let compute = p.create_stream().unwrap();
    let config = EngineConfig {
        compression: Compression::Device,
        ..EngineConfig::default()
    };
    let mut engine = SwapEngine::new(Arc::clone(&p), config).unwrap();
    // bf16 values with a narrow exponent range, as activations have: they compress.
    let layer: Vec<Vec<u8>> = (0..8u32)
        .map(|k| {
            (0..4096u32)
                .flat_map(|i| {
                    let x = ((i * 7 + k * 13) % 97) as f32 / 50.0 - 1.0;
                    half::bf16::from_f32(x).to_le_bytes()
                })
                .collect()
        })
        .collect();
    let mut round = |count_launches: bool| {
        let mut tensors: Vec<SwapTensor> = layer
            .iter()
            .map(|bytes| {
                let buf = p.alloc_device(bytes.len()).unwrap();
                p.write_device_sync(&buf, 0, bytes, &compute).unwrap();
                let t = DeviceTensor::whole(buf, DType::BF16, vec![bytes.len() / 2]);
                SwapTensor::new(Saved::Tensor(t)).unwrap()
            })
            .collect();
        let launches = cuda_emulator::driver_calls("cuLaunchKernel");
        engine.offload(tensors.iter_mut(), &compute).unwrap();
        if count_launches {
            assert_eq!(
                cuda_emulator::driver_calls("cuLaunchKernel") - launches,
                3,
                "one launch sequence encodes the batch"
            );
        }
        engine.finish_offload(tensors.iter_mut()).unwrap();
        assert!(tensors.iter().all(|t| t.state() == SwapState::Host));
        assert_eq!(engine.stats().compressed_tensors % 8, 0);
        let launches = cuda_emulator::driver_calls("cuLaunchKernel");
        engine.start_reload(tensors.iter_mut()).unwrap();
        if count_launches {
            assert_eq!(
                cuda_emulator::driver_calls("cuLaunchKernel") - launches,
                1,
                "one launch decodes the batch"
            );
        }
        engine.finish_reload(tensors.iter_mut(), &compute).unwrap();
        for (t, bytes) in tensors.iter().zip(&layer) {
            let d = t.describe().unwrap();
            let mut back = vec![0u8; bytes.len()];
            p.read_device_sync(&d.storage, d.offset, &mut back, &compute)
                .unwrap();
            assert!(back == *bytes, "a tensor came back different");
        }
    };
    round(false); // warm-up: the codec's module and workspace
    round(true);
}
