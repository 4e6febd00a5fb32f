//! Prints the swap benchmark rows for the platform `HP_PLATFORM` selects:
//! `cargo run -p hprt-cli --release --example swap_bench [max MiB]`.

fn main() -> anyhow::Result<()> {
    let max_mib: usize = std::env::args().nth(1).map_or(Ok(64), |a| a.parse())?;
    let platform = hprt_platform::get_platform()?;
    println!("{}", hprt_cli::bench::swap::bench(platform, max_mib << 20)?);
    Ok(())
}
