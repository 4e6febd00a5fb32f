//! `hprt bench`'s hsdp section on a machine with one GPU: the cuda backend over the CUDA emulator
//! with one device (built on first use). NCCL refuses two ranks on one
//! device, and a 1-rank group makes no collective calls: the section says it measured nothing
//! instead of failing the whole benchmark (what an H100 machine's first run hit: four ranks on
//! one device, then "needs at least 2 ranks").

use hprt_conformance::cuda_emulator;

#[test]
fn one_device_is_reported_not_measured() {
    // Its own test binary: the emulator's device count is fixed per process.
    std::env::set_var("HP_EMU_DEVICES", "1");
    let p: std::sync::Arc<dyn hprt_platform::Platform> =
        std::sync::Arc::new(cuda_emulator::open().expect("the cuda backend opens on the emulator"));
    assert_eq!(p.device_count(), 1);
    let table = hprt_cli::bench::hsdp::bench(&p, 1 << 20).unwrap();
    assert!(table.contains("Not measured: 1 device"), "{table}");
}
