//! `hprt bench`'s sections on small sizes: the hsdp rows on the cpu backend, the device-codec
//! rows on the CUDA emulator (built on first use); their speeds mean nothing here.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Result};
use hprt_compress::codec::EncodeOptions;
use hprt_compress::codec_for;
use hprt_platform::{CpuBackend, CpuConfig, Platform};

#[test]
fn hsdp_bench_reports_both_collectives_per_size() -> Result<()> {
    let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig {
        devices: 4,
        device_memory: 256 << 20,
        collective_timeout: Duration::from_secs(60),
        ..Default::default()
    }));
    // Below the smallest bench size: one size, all-gather and reduce-scatter.
    let table = hprt_cli::bench::hsdp::bench(&p, 16 << 10)?;
    let rows: Vec<&str> = table.lines().skip(2).collect();
    ensure!(rows.len() == 2, "{table}");
    ensure!(rows.iter().all(|r| r.contains("| 16384 |")), "{table}");
    for row in rows {
        let ratio: f64 = row
            .trim_end_matches(" |")
            .rsplit("| ")
            .next()
            .unwrap()
            .parse()?;
        ensure!(ratio.is_finite() && ratio > 0.0, "{row}");
    }
    Ok(())
}

/// The GPU benchmark's code path (device events, the D2D copy beside it, the byte checks) on
/// the CUDA emulator.
#[test]
fn device_bench_runs_the_cuda_kernels_on_the_cuda_emulator() {
    let _serial = hprt_conformance::emulator::serial();
    let p = hprt_conformance::cuda_emulator::open().expect("cuda on the emulator");
    let codec = codec_for(&p);
    let rows = hprt_cli::bench::codec::device_bench(
        &p,
        codec.as_ref(),
        &EncodeOptions::default(),
        &[256 << 10],
        1,
    )
    .unwrap();
    assert_eq!(rows.len(), 1);
    assert!(rows[0].ratio > 1.2 && rows[0].encode_gbps > 0.0 && rows[0].memcpy_gbps > 0.0);
}
