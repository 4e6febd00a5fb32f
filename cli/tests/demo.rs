//! `hprt demo` end to end on small models: every strategy reproduces the baseline bit for bit
//! (also under stream jitter), swap lowers peak memory and moves exactly the saved bytes,
//! compression cuts them, and the trace is valid Chrome JSON with one named track per stream
//! and every reload of a tensor after its offload.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use hprt_cli::demo::{run, DemoConfig, DemoReport, Strategy};
use hprt_cli::trace::{chrome_trace, timeline, Recorder};
use hprt_platform::{CpuBackend, CpuConfig, DType, Platform};
use serde_json::Value;

fn tiny(ranks: usize, record_spans: bool) -> DemoConfig {
    DemoConfig {
        layers: 4,
        hidden: 32,
        ffn: Some(48),
        seq: 24,
        ranks,
        steps: 2,
        act_dtype: DType::BF16,
        strategies: Strategy::ALL.to_vec(),
        record_spans,
    }
}

fn cpu(ranks: usize, jitter: Option<u64>) -> Arc<dyn Platform> {
    Arc::new(CpuBackend::new(CpuConfig {
        devices: ranks,
        device_memory: 64 << 20,
        jitter,
        collective_timeout: Duration::from_secs(60),
        ..CpuConfig::default()
    }))
}

fn demo(config: &DemoConfig, jitter: Option<u64>) -> Result<(DemoReport, Arc<Recorder>)> {
    Ok(run(cpu(config.ranks, jitter).into(), config, &|_| {})?)
}

#[test]
fn every_strategy_matches_the_baseline_and_swap_moves_exactly_the_saved_bytes() -> Result<()> {
    let config = tiny(4, false);
    let (report, _) = demo(&config, None)?;
    ensure!(report.all_bit_exact(), "{report}");
    ensure!(report.strategies.len() == 4, "{report}");
    let get = |s| report.strategy(s).context("strategy missing");
    let (base, swap, comp, both) = (
        get(Strategy::Baseline)?,
        get(Strategy::Swap)?,
        get(Strategy::Compress)?,
        get(Strategy::CompressSwap)?,
    );
    // All layers but the last go out and come back, each direction, every rank.
    let per_layer = (config.seq * (config.hidden + config.ffn()) * 2) as u64;
    let want = per_layer * (config.layers as u64 - 1) * 2 * config.ranks as u64;
    ensure!(
        swap.swap_link_bytes == want,
        "swap moved {} bytes per step, expected {want}",
        swap.swap_link_bytes
    );
    ensure!(base.swap_link_bytes == 0 && comp.swap_link_bytes == 0);
    ensure!(
        both.swap_link_bytes < swap.swap_link_bytes && both.swap_link_bytes > 0,
        "compress-then-swap moved {} bytes, swap {}",
        both.swap_link_bytes,
        swap.swap_link_bytes
    );
    ensure!(
        swap.peak_device < base.peak_device,
        "swap peak {} not below baseline {}",
        swap.peak_device,
        base.peak_device
    );
    for s in [comp, both] {
        for kind in 0..2 {
            let r = s.ratio(kind).context("no ratio")?;
            ensure!(r > 1.1 && r < 4.0, "{}: ratio {r}", s.strategy.name());
        }
    }
    let text = report.to_string();
    ensure!(text.contains("matched the baseline bit for bit"), "{text}");
    Ok(())
}

#[test]
fn strategies_stay_bit_exact_under_stream_jitter_and_with_f32_activations() -> Result<()> {
    let mut config = tiny(2, false);
    config.layers = 3;
    config.steps = 1;
    let (report, _) = demo(&config, Some(11))?;
    ensure!(report.all_bit_exact(), "{report}");
    config.act_dtype = DType::F32;
    let (report, _) = demo(&config, Some(12))?;
    ensure!(report.all_bit_exact(), "{report}");
    let r = report
        .strategy(Strategy::Compress)
        .and_then(|s| s.ratio(0))
        .context("no ratio")?;
    ensure!(r > 1.0, "f32 ratio {r}");
    Ok(())
}

/// On the cuda backend (over the CUDA emulator) the codec is the CUDA kernels: compress-then-
/// swap moves fewer host-link bytes than swap, bit-exact, and the codec itself only moves its
/// descriptors and results (lengths, status words).
#[test]
fn compress_then_swap_cuts_host_link_bytes_with_the_cuda_kernels_on_the_cuda_emulator() -> Result<()>
{
    let p: Arc<dyn Platform> = Arc::new(hprt_conformance::cuda_emulator::open()?);
    let config = DemoConfig {
        layers: 3,
        steps: 1,
        strategies: vec![Strategy::Swap, Strategy::CompressSwap],
        ..tiny(1, false)
    };
    let (report, _) = run(p.into(), &config, &|_| {})?;
    ensure!(report.all_bit_exact(), "{report}");
    ensure!(report.codec == "cuda", "{report}");
    let get = |s| report.strategy(s).context("strategy missing");
    let (swap, both) = (get(Strategy::Swap)?, get(Strategy::CompressSwap)?);
    ensure!(
        both.swap_link_bytes < swap.swap_link_bytes && both.swap_link_bytes > 0,
        "{report}"
    );
    // Per codec call, its descriptors up and its results (lengths, status) down: at most
    // 512 bytes, less than any saved tensor here (1.5 KiB and more) — nothing of the tensors
    // themselves. Two saved activations per layer, each encoded and decoded once a step.
    let calls = 2 * 2 * config.layers as u64;
    ensure!(
        both.codec_link_bytes <= 512 * calls && both.codec_link_bytes > 0,
        "{} codec bytes over {calls} calls\n{report}",
        both.codec_link_bytes
    );
    Ok(())
}

/// The trace of the run, parsed back from its JSON text.
fn trace_of(rec: &Recorder) -> Result<Vec<Value>> {
    let text = serde_json::to_string(&chrome_trace(rec))?;
    let v: Value = serde_json::from_str(&text)?;
    Ok(v["traceEvents"]
        .as_array()
        .context("traceEvents is not an array")?
        .clone())
}

#[test]
fn the_trace_has_a_track_per_stream_and_reloads_follow_offloads() -> Result<()> {
    let config = DemoConfig {
        strategies: vec![Strategy::Swap, Strategy::CompressSwap],
        ..tiny(4, true)
    };
    let (report, rec) = demo(&config, None)?;
    ensure!(report.all_bit_exact(), "{report}");
    let events = trace_of(&rec)?;
    // Track names per (pid, tid), from the metadata events.
    let mut names: HashMap<(u64, u64), String> = HashMap::new();
    for e in events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
    {
        let key = (
            e["pid"].as_u64().context("pid")?,
            e["tid"].as_u64().context("tid")?,
        );
        names.insert(key, e["args"]["name"].as_str().context("name")?.to_string());
    }
    for rank in 0..config.ranks as u64 {
        for track in [
            "compute [compress-swap]",
            "d2h [compress-swap]",
            "h2d [compress-swap]",
            "codec [compress-swap]",
            "comm all-gather [compress-swap]",
            "comm reduce [compress-swap]",
            "d2h [swap]",
        ] {
            ensure!(
                names.iter().any(|((p, _), n)| *p == rank && n == track),
                "rank {rank} has no track {track:?}: {names:?}"
            );
        }
    }
    // Every complete event is well formed and sits on a named track.
    let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    ensure!(spans.len() > 100, "only {} spans", spans.len());
    for e in &spans {
        let key = (
            e["pid"].as_u64().context("pid")?,
            e["tid"].as_u64().context("tid")?,
        );
        ensure!(names.contains_key(&key), "span on an unnamed track: {e}");
        ensure!(e["ts"].as_f64().is_some() && e["dur"].as_f64().is_some_and(|d| d >= 0.0));
        ensure!(e["args"]["bytes"].as_u64().is_some(), "no bytes: {e}");
    }
    // Each offloaded tensor (named, per rank and strategy) is reloaded after its offload ended.
    let mut offloads: HashMap<(u64, String, String), Vec<(f64, f64)>> = HashMap::new();
    let mut reloads = Vec::new();
    for e in &spans {
        let key = (
            e["pid"].as_u64().context("pid")?,
            e["tid"].as_u64().context("tid")?,
        );
        let track = &names[&key];
        let section = track.split('[').nth(1).unwrap_or("").to_string();
        let (ts, dur) = (
            e["ts"].as_f64().unwrap_or(0.0),
            e["dur"].as_f64().unwrap_or(0.0),
        );
        let name = e["name"].as_str().unwrap_or("").to_string();
        if track.starts_with("d2h") {
            offloads
                .entry((key.0, section, name))
                .or_default()
                .push((ts, ts + dur));
        } else if track.starts_with("h2d") {
            reloads.push(((key.0, section, name), ts));
        }
    }
    ensure!(
        reloads.len() >= 2 * 2 * 3 * config.ranks,
        "{} reloads",
        reloads.len()
    );
    for (key, start) in &reloads {
        let out = offloads
            .get(key)
            .with_context(|| format!("reload of {key:?} never offloaded"))?;
        // The offload of the same step: the latest one that began before this reload.
        let (_, end) = out
            .iter()
            .filter(|(s, _)| s < start)
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .with_context(|| format!("{key:?} reloaded at {start} before any offload"))?;
        ensure!(
            end <= start,
            "{key:?}: reload at {start} before its offload ended at {end}"
        );
        ensure!(
            key.2.starts_with('L'),
            "reload without a tensor name: {key:?}"
        );
    }
    // The terminal timeline shows rank 0's streams with layer digits.
    let s = report.strategy(Strategy::CompressSwap).context("missing")?;
    let (from, to) = s.last_step_us;
    let t = timeline(&rec, 0, "compress-swap", from, to, 60);
    for row in ["compute", "d2h", "h2d", "codec", "comm reduce"] {
        ensure!(t.lines().any(|l| l.starts_with(row)), "no {row} row:\n{t}");
    }
    ensure!(t.contains('3') && t.contains('0'), "no layer digits:\n{t}");
    ensure!(
        t.lines().any(|l| l.starts_with("memory")),
        "no memory row:\n{t}"
    );
    // A device-memory counter track per rank and strategy beside the stream tracks, whose
    // highest value is the strategy's peak device memory (sampled after every allocation), and
    // lower with swap than without.
    let mut counter_peak: HashMap<String, f64> = HashMap::new();
    let mut counter_ranks: HashMap<String, Vec<u64>> = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] == "C") {
        let name = e["name"].as_str().context("counter name")?;
        let section = name
            .strip_prefix("device memory in use [")
            .and_then(|n| n.strip_suffix(']'))
            .with_context(|| format!("counter {name:?}"))?
            .to_string();
        let mib = e["args"]["MiB"].as_f64().context("MiB")?;
        ensure!(e["ts"].as_f64().is_some(), "counter without a time: {e}");
        let peak = counter_peak.entry(section.clone()).or_insert(0.0);
        *peak = peak.max(mib);
        counter_ranks
            .entry(section)
            .or_default()
            .push(e["pid"].as_u64().context("pid")?);
    }
    for s in &report.strategies {
        let name = s.strategy.name();
        let ranks = counter_ranks.get(name).map(Vec::as_slice).unwrap_or(&[]);
        for rank in 0..config.ranks as u64 {
            ensure!(ranks.contains(&rank), "no {name} counter for rank {rank}");
        }
        let peak_mib = s.peak_device as f64 / (1 << 20) as f64;
        let counter = counter_peak[name];
        ensure!(
            (counter - peak_mib).abs() <= 0.1 * peak_mib,
            "{name}: counter peak {counter} MiB, peak device {peak_mib} MiB"
        );
    }
    ensure!(
        counter_peak["swap"] < counter_peak["baseline"],
        "swap's counter peak is not below the baseline's: {counter_peak:?}"
    );
    Ok(())
}

#[test]
fn the_command_prints_the_report_and_writes_the_trace_named_by_hp_trace() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("hprt-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("trace.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hprt"))
        .args([
            "demo", "--layers", "3", "--hidden", "16", "--seq", "8", "--steps", "1",
        ])
        .args(["--ranks", "2", "--timeline"])
        .env("HP_PLATFORM", "cpu")
        .env("HP_CPU_DEVICES", "2")
        .env("HP_TRACE", &path)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "peak device",
        "compress-swap",
        "bit for bit",
        "timeline of rank 0",
    ] {
        ensure!(stdout.contains(want), "no {want:?} in:\n{stdout}");
    }
    let v: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    ensure!(v["traceEvents"].as_array().is_some_and(|a| !a.is_empty()));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// With 1 MiB of pinned memory a rank fails with the pinned out-of-memory error; its peers,
/// waiting for it in a collective, fail at once (its communicator is gone) instead of waiting
/// out the 120 s collective timeout, and the report names the cause, not a peer's timeout.
#[test]
fn a_rank_out_of_pinned_memory_is_reported_at_once() -> Result<()> {
    let start = std::time::Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hprt"))
        .args(["demo", "--layers", "2", "--seq", "64", "--steps", "1"])
        .env("HP_PLATFORM", "cpu")
        .env("HP_CPU_PINNED_MEMORY", "1M")
        .env("HP_CPU_COLLECTIVE_TIMEOUT_MS", "120000")
        .output()?;
    let took = start.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success(),
        "the demo succeeded with 1 MiB pinned"
    );
    ensure!(
        stderr.contains("alloc_pinned") && stderr.contains("OUT_OF_MEMORY"),
        "not the pinned out-of-memory error:\n{stderr}"
    );
    ensure!(
        took < std::time::Duration::from_secs(60),
        "the failure took {took:?} to report"
    );
    Ok(())
}

/// A CLI I/O error names the path and the OS error once.
#[test]
fn an_io_error_prints_the_os_error_once() -> Result<()> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hprt"))
        .args([
            "decompress",
            "/nonexistent/hprt-input",
            "/nonexistent/hprt-output",
        ])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success());
    ensure!(stderr.contains("/nonexistent/hprt-input"), "{stderr}");
    ensure!(
        stderr.matches("os error 2").count() == 1,
        "the OS error is not printed exactly once:\n{stderr}"
    );
    Ok(())
}
