//! cpu-backend specifics: jitter, timeouts, small capacities, multiple devices, configuration
//! parsing and platform selection. Every test builds its own `CpuBackend` value, so nothing here
//! depends on (or mutates) the process environment.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use hprt_conformance::{run_cases, Outcome};
use hprt_platform::cpu::parse_bytes;
use hprt_platform::{
    select_platform, BackendKind, CpuBackend, CpuConfig, DType, ErrorKind, Platform,
    PlatformRequest, RawStream, ReduceOp,
};

#[path = "cpu_backend/config.rs"]
mod config;
#[path = "cpu_backend/devices.rs"]
mod devices;
#[path = "cpu_backend/jitter.rs"]
mod jitter;
#[path = "cpu_backend/limits.rs"]
mod limits;
#[path = "cpu_backend/timeouts.rs"]
mod timeouts;

fn cpu(config: CpuConfig) -> CpuBackend {
    CpuBackend::new(config)
}

fn jittered(seed: u64) -> CpuBackend {
    cpu(CpuConfig {
        jitter: Some(seed),
        ..CpuConfig::default()
    })
}

fn kind<T>(r: hprt_platform::Result<T>) -> Option<ErrorKind> {
    r.err().map(|e| e.kind())
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8 | 1
        })
        .collect()
}

/// Uploads a pattern on stream A and downloads the same buffer on stream B, with or without an
/// event wait in between; returns how many of `trials` downloads differed from the pattern.
fn race(p: &dyn Platform, wait: bool, trials: usize) -> usize {
    race_onto(p, &p.create_stream().unwrap(), wait, trials)
}

/// [`race`] with the download queued on `b`.
fn race_onto(p: &dyn Platform, b: &hprt_platform::Stream, wait: bool, trials: usize) -> usize {
    const N: usize = 64 << 10;
    let a = p.create_stream().unwrap();
    let ev = p.create_event(false).unwrap();
    let mut mismatches = 0;
    for t in 0..trials {
        let data = bytes(t as u64 + 1, N);
        let src = p.alloc_pinned(N).unwrap();
        src.write(0, &data).unwrap();
        let out = p.alloc_pinned(N).unwrap();
        let dev = p.alloc_device(N).unwrap();
        p.memset_async(&dev, 0, 0, N, &a).unwrap();
        p.synchronize_stream(&a).unwrap();
        p.copy_async((&dev).into(), 0, (&src).into(), 0, N, &a)
            .unwrap();
        if wait {
            p.record_event(&ev, &a).unwrap();
            p.stream_wait_event(b, &ev).unwrap();
        }
        p.copy_async((&out).into(), 0, (&dev).into(), 0, N, b)
            .unwrap();
        p.synchronize_stream(b).unwrap();
        if out.to_vec().unwrap() != data {
            mismatches += 1;
        }
        p.synchronize_stream(&a).unwrap();
    }
    mismatches
}
