//! `cargo run --release -p hprt-cli --example codec_bench [numel] [trials]`: the codec
//! benchmark table (what `hprt bench` includes).

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut opts = hprt_cli::bench::codec::BenchOptions::default();
    if let Some(n) = args.next() {
        opts.numel = n.parse()?;
    }
    if let Some(t) = args.next() {
        opts.trials = t.parse()?;
    }
    if let Ok(d) = std::env::var("HP_BENCH_DTYPES") {
        opts.dtypes = d
            .split(',')
            .map(hprt_compress::CodecDType::parse)
            .collect::<Result<_, _>>()?;
    }
    print!("{}", hprt_cli::bench::codec::bench(&opts)?);
    Ok(())
}
