//! The `hprt` command: what the selected platform is, whether it conforms, how fast it is.

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use hprt_cli::{bench, codec_cli};
use hprt_platform::{get_platform, platform_selection_reason};

#[derive(Parser)]
#[command(
    name = "hprt",
    version,
    about = "hyper-parallel runtime: platform info, conformance, benchmarks, tensor compression"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the selected platform and why, its devices, memory and settings.
    Info,
    /// Run the backend-conformance suite on the selected platform and print a table.
    Conformance {
        /// Run only cases whose name or group contains this text.
        #[arg(long)]
        filter: Option<String>,
    },
    /// Benchmark the selected platform against in-run baselines; prints a Markdown table.
    Bench {
        /// Also write the table to this file (only between its `<!-- hprt bench: begin/end -->`
        /// markers when it has them, as BENCHMARKS.md does).
        #[arg(long)]
        output: Option<std::path::PathBuf>,
        /// Largest copy size in MiB (the sweep runs from 4 KiB up to it).
        #[arg(long, default_value_t = 256)]
        max_mib: usize,
        /// Run only these sections (platform, swap, compress, device-codec, hsdp); default all.
        #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(bench::SECTIONS))]
        only: Vec<String>,
    },
    /// Losslessly compress a raw little-endian tensor file (f32, f16 or bf16).
    Compress {
        /// Element type of IN: f32, f16 or bf16.
        #[arg(long)]
        dtype: String,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        #[arg(value_name = "IN")]
        input: std::path::PathBuf,
        #[arg(value_name = "OUT")]
        output: std::path::PathBuf,
    },
    /// Restore a file written by `hprt compress` (the dtype is in its header).
    Decompress {
        #[arg(long)]
        threads: Option<usize>,
        /// Refuse a file that declares more than this many decoded bytes, before allocating
        /// (for untrusted files: a valid encoding may declare millions of times its size).
        #[arg(long, value_name = "BYTES")]
        max_output: Option<usize>,
        #[arg(value_name = "IN")]
        input: std::path::PathBuf,
        #[arg(value_name = "OUT")]
        output: std::path::PathBuf,
    },
    /// A simulated training step of a small transformer-like model over several ranks, run
    /// without swap, with swap and with compress-then-swap; prints memory, host-link bytes,
    /// compression ratios, step times and whether every result matched the baseline bit for bit.
    Demo(DemoArgs),
    /// Ratio, entropy bound, chunk-table statistics and throughput of raw tensor files
    /// (against zstd level 1).
    CodecStats {
        #[arg(long)]
        dtype: String,
        #[arg(required = true, value_name = "FILE")]
        files: Vec<std::path::PathBuf>,
    },
}

#[derive(clap::Args)]
struct DemoArgs {
    #[arg(long, default_value_t = 8)]
    layers: usize,
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Feed-forward width (default: twice the hidden size).
    #[arg(long)]
    ffn: Option<usize>,
    /// Tokens per rank.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Ranks (threads; one per device where devices exist). Default: 4 on the cpu backend,
    /// else every device.
    #[arg(long)]
    ranks: Option<usize>,
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// dtype of saved activations: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    act_dtype: String,
    /// Strategies to compare with the baseline: swap, compress, compress-swap.
    #[arg(long, value_delimiter = ',', default_value = "swap,compress-swap",
          value_parser = clap::builder::PossibleValuesParser::new(["baseline", "swap", "compress", "compress-swap"]))]
    strategies: Vec<String>,
    /// Write a Chrome/Perfetto trace of every stream of every rank (also: HP_TRACE=path.json).
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Print an ASCII timeline of rank 0's last step for each strategy.
    #[arg(long)]
    timeline: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HP_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("hprt: {}", describe(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each once: many error types already end their message with their
/// source's (an I/O error's OS message), which `{:#}` would print a second time.
fn describe(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if !text.ends_with(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
    }
    text
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Info => info(),
        Command::Conformance { filter } => conformance(filter.as_deref()),
        Command::Bench {
            output,
            max_mib,
            only,
        } => {
            let table = bench::run(get_platform()?, max_mib << 20, &only)?;
            print!("{table}");
            if let Some(path) = output {
                // A document with `hprt bench` markers (BENCHMARKS.md) keeps its commentary.
                let text = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|doc| bench::splice(&doc, &table))
                    .unwrap_or_else(|| table.clone());
                std::fs::write(&path, text)?;
                eprintln!("wrote {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Compress {
            dtype,
            threads,
            input,
            output,
        } => {
            let mut opts = hprt_compress::codec::EncodeOptions::default();
            if let Some(t) = threads {
                opts.threads = t;
            }
            let dtype = hprt_compress::CodecDType::parse(&dtype)?;
            let report = codec_cli::compress_file(dtype, &input, &output, &opts)?;
            println!("{report}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Decompress {
            threads,
            max_output,
            input,
            output,
        } => {
            let mut opts = hprt_compress::codec::DecodeOptions {
                max_output,
                ..Default::default()
            };
            if let Some(t) = threads {
                opts.threads = t;
            }
            let report = codec_cli::decompress_file(&input, &output, &opts)?;
            println!("{report}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo(args) => demo(args),
        Command::CodecStats { dtype, files } => {
            let dtype = hprt_compress::CodecDType::parse(&dtype)?;
            let files: Vec<&std::path::Path> = files.iter().map(|f| f.as_path()).collect();
            let opts = hprt_compress::codec::EncodeOptions::default();
            print!("{}", codec_cli::codec_stats(dtype, &files, &opts)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn human(bytes: usize) -> String {
    let (v, unit) = hprt_cli::demo::binary_units(bytes as u64);
    format!("{v:.1} {unit}")
}

fn info() -> Result<ExitCode> {
    let platform = get_platform()?;
    let info = platform.info();
    println!("platform: {}", info.backend);
    println!("selected: {}", platform_selection_reason()?);
    println!("driver:   {}", info.driver);
    println!("devices:  {}", info.devices.len());
    for d in &info.devices {
        let total = if d.total_memory == 0 {
            "memory not reported".into()
        } else {
            human(d.total_memory)
        };
        println!("  [{}] {} ({total})", d.ordinal, d.name);
    }
    let mem = platform.mem_info()?;
    println!(
        "memory:   {} free of {} on device {}",
        human(mem.free),
        human(mem.total),
        platform.current_device()
    );
    if info.libraries.is_empty() {
        println!("libraries searched: none (this backend loads no driver library)");
    } else {
        println!("libraries searched:");
        for l in &info.libraries {
            println!(
                "  {} {}",
                if l.found { "found  " } else { "missing" },
                l.path
            );
        }
    }
    println!("settings:");
    for (k, v) in &info.settings {
        println!("  {k} = {v}");
    }
    Ok(ExitCode::SUCCESS)
}

fn conformance(filter: Option<&str>) -> Result<ExitCode> {
    let platform = get_platform()?;
    println!(
        "conformance on {} ({})\n",
        platform.backend(),
        platform_selection_reason()?
    );
    let outcomes = hprt_conformance::run_cases(platform, filter);
    print!("{}", hprt_conformance::report(&outcomes));
    let failed = outcomes.iter().filter(|o| !o.passed).count();
    Ok(if failed == 0 && !outcomes.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn demo(args: DemoArgs) -> Result<ExitCode> {
    use hprt_cli::demo::{DemoConfig, Strategy};
    use hprt_cli::trace::{timeline, trace_path_from_env, write_chrome_trace};
    // The cpu backend simulates one device per rank so that memory is accounted per rank; an
    // explicit HP_CPU_DEVICES wins, and backends with real devices ignore the variable.
    if std::env::var_os("HP_CPU_DEVICES").is_none() {
        std::env::set_var("HP_CPU_DEVICES", args.ranks.unwrap_or(4).to_string());
    }
    let platform = get_platform()?;
    let trace = args.trace.or_else(trace_path_from_env);
    let mut strategies = vec![Strategy::Baseline];
    for s in &args.strategies {
        strategies.push(Strategy::parse(s)?);
    }
    let config = DemoConfig {
        layers: args.layers,
        hidden: args.hidden,
        ffn: args.ffn,
        seq: args.seq,
        ranks: args.ranks.unwrap_or(platform.device_count()),
        steps: args.steps,
        act_dtype: hprt_platform::DType::ALL
            .into_iter()
            .find(|d| d.name() == args.act_dtype)
            .ok_or_else(|| anyhow::anyhow!("unknown dtype {:?}", args.act_dtype))?,
        strategies,
        record_spans: trace.is_some() || args.timeline,
    };
    config.validate()?;
    // Hidden until the run has taken a few seconds, so short runs print only the report.
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(config.work_units()),
        indicatif::ProgressDrawTarget::hidden(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed:>4} [{bar:40}] {pos}/{len} layer passes")
            .map_err(|e| anyhow::anyhow!("progress template: {e}"))?
            .progress_chars("=> "),
    );
    let started = std::time::Instant::now();
    let shown = std::sync::atomic::AtomicBool::new(false);
    let progress = |n: u64| {
        bar.inc(n);
        if started.elapsed() > std::time::Duration::from_secs(3)
            && !shown.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
    };
    let (report, rec) = hprt_cli::demo::run(platform.into(), &config, &progress)?;
    bar.finish_and_clear();
    print!("{report}");
    if args.timeline {
        for s in &report.strategies {
            println!(
                "\ntimeline of rank 0, last step, {} (digits: layer mod 10; forward runs up, backward down):",
                s.strategy.name()
            );
            let (from, to) = s.last_step_us;
            print!("{}", timeline(&rec, 0, s.strategy.name(), from, to, 96));
        }
    }
    if let Some(path) = trace {
        write_chrome_trace(&rec, &path)?;
        eprintln!(
            "wrote {} ({} spans; open it in Perfetto or chrome://tracing)",
            path.display(),
            rec.spans().len()
        );
    }
    Ok(if report.all_bit_exact() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
