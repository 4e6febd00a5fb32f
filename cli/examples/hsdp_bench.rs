//! `cargo run --release -p hprt-cli --example hsdp_bench -- [max_bytes]`: hsdp's all-gather and
//! reduce-scatter against the direct collective on the platform `HP_PLATFORM` selects.

fn main() -> anyhow::Result<()> {
    let max_bytes = match std::env::args().nth(1) {
        Some(s) => s.parse()?,
        None => 64 << 20,
    };
    let platform = hprt_platform::get_platform()?;
    print!("{}", hprt_cli::bench::hsdp::bench(platform, max_bytes)?);
    Ok(())
}
