//! The `hprt` command: what the selected platform is, whether it conforms, how fast it is.

mod bench;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use hprt::platform::{get_platform, platform_selection_reason};

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
        /// Also write the table to this file.
        #[arg(long)]
        output: Option<std::path::PathBuf>,
        /// Largest copy size in MiB (the sweep runs from 4 KiB up to it).
        #[arg(long, default_value_t = 256)]
        max_mib: usize,
        /// Run only these sections (platform, swap, compress, hsdp); default all.
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
        #[arg(value_name = "IN")]
        input: std::path::PathBuf,
        #[arg(value_name = "OUT")]
        output: std::path::PathBuf,
    },
    /// Ratio, entropy bound, chunk-table statistics and throughput of raw tensor files
    /// (against zstd level 1).
    CodecStats {
        #[arg(long)]
        dtype: String,
        #[arg(required = true, value_name = "FILE")]
        files: Vec<std::path::PathBuf>,
    },
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
            eprintln!("hprt: {e:#}");
            ExitCode::FAILURE
        }
    }
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
                std::fs::write(&path, &table)?;
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
            let mut opts = hprt::compress::codec::EncodeOptions::default();
            if let Some(t) = threads {
                opts.threads = t;
            }
            let dtype = hprt::compress::CodecDType::parse(&dtype)?;
            let report = hprt::compress::cli::compress_file(dtype, &input, &output, &opts)?;
            println!("{report}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Decompress {
            threads,
            input,
            output,
        } => {
            let mut opts = hprt::compress::codec::DecodeOptions::default();
            if let Some(t) = threads {
                opts.threads = t;
            }
            let report = hprt::compress::cli::decompress_file(&input, &output, &opts)?;
            println!("{report}");
            Ok(ExitCode::SUCCESS)
        }
        Command::CodecStats { dtype, files } => {
            let dtype = hprt::compress::CodecDType::parse(&dtype)?;
            let files: Vec<&std::path::Path> = files.iter().map(|f| f.as_path()).collect();
            let opts = hprt::compress::codec::EncodeOptions::default();
            print!(
                "{}",
                hprt::compress::cli::codec_stats(dtype, &files, &opts)?
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn human(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
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
