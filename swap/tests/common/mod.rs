//! Shared by the swap test binaries.

/// The jitter seeds a race test runs: 0..20, plus the seeds `HP_CPU_JITTER` names
/// (comma-separated), so a failure seen elsewhere can be replayed and the variable widens the
/// search.
pub fn jitter_seeds() -> Vec<u64> {
    let mut seeds: Vec<u64> = (0..20).collect();
    if let Ok(v) = std::env::var("HP_CPU_JITTER") {
        for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let seed = s
                .parse()
                .unwrap_or_else(|_| panic!("HP_CPU_JITTER={v:?}: {s:?} is not a seed"));
            if !seeds.contains(&seed) {
                seeds.push(seed);
            }
        }
    }
    seeds
}
