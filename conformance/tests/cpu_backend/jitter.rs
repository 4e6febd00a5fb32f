//! Jitter: it exposes a missing wait, never a correct program, and the whole suite passes
//! under it and on two devices.

use super::*;

#[test]
fn jitter_exposes_a_missing_wait() {
    let p = jittered(11);
    let bad = race(&p, false, 20);
    eprintln!("{bad} of 20 unsynchronized downloads saw stale or partial data");
    assert!(
        bad >= 1,
        "20 downloads on stream B without waiting for stream A's upload all saw the data: \
         jitter does not make missing waits visible"
    );
}

#[test]
fn jitter_with_the_wait_never_mismatches() {
    let p = jittered(12);
    let bad = race(&p, true, 20);
    assert_eq!(
        bad, 0,
        "{bad} of 20 downloads mismatched although B waited on A's event"
    );
}

fn assert_all_passed(what: &str, outcomes: &[Outcome]) {
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.passed)
        .map(|o| format!("{}/{}: {}", o.group, o.name, o.detail))
        .collect();
    assert!(
        failed.is_empty(),
        "{what}: {} case(s) failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

fn full_suite_with_jitter(seed: u64) {
    let p = jittered(seed);
    let start = Instant::now();
    let outcomes = run_cases(&p, None);
    assert_eq!(outcomes.len(), hprt_conformance::cases().len());
    eprintln!(
        "suite with jitter seed {seed}: {} cases in {:?}",
        outcomes.len(),
        start.elapsed()
    );
    assert_all_passed(&format!("jitter seed {seed}"), &outcomes);
}

#[test]
fn suite_passes_with_jitter_seed_1() {
    full_suite_with_jitter(1);
}

#[test]
fn suite_passes_with_jitter_seed_2() {
    full_suite_with_jitter(2);
}

#[test]
fn suite_passes_with_jitter_seed_3() {
    full_suite_with_jitter(3);
}

#[test]
fn suite_passes_on_two_devices() {
    // Cases run on device 0; rank threads spread over both devices.
    let p = cpu(CpuConfig {
        devices: 2,
        ..CpuConfig::default()
    });
    assert_all_passed("2 devices", &run_cases(&p, None));
}
