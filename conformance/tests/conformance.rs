//! The conformance suite on whatever `HP_PLATFORM` selects (cpu by default), one test per group.
//! CI re-runs it with `HP_CPU_JITTER=<seed>`.

use std::sync::Mutex;

use hprt_conformance::{report, run_cases, Outcome};

/// The groups share one process-wide platform; memory accounting cases compare deltas, so the
/// groups run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn run_group(group: &str) {
    let _serial = hprt_platform::sync::lock(&SERIAL);
    let platform = hprt_platform::get_platform().expect("get_platform");
    if let Ok(forced) = std::env::var("HP_PLATFORM") {
        assert_eq!(
            platform.backend().name(),
            forced.trim(),
            "HP_PLATFORM was not honoured"
        );
    }
    let outcomes = run_cases(platform, Some(group));
    assert!(
        outcomes.iter().any(|o| o.group == group),
        "no case of group {group} ran"
    );
    eprintln!(
        "{} on {}:\n{}",
        group,
        platform.backend(),
        report(&outcomes)
    );
    let failed: Vec<Outcome> = outcomes.into_iter().filter(|o| !o.passed).collect();
    assert!(
        failed.is_empty(),
        "{} case(s) failed:\n{}",
        failed.len(),
        report(&failed)
    );
}

#[test]
fn memory() {
    run_group("memory");
}

#[test]
fn copy() {
    run_group("copy");
}

#[test]
fn stream() {
    run_group("stream");
}

#[test]
fn event() {
    run_group("event");
}

#[test]
fn interop() {
    run_group("interop");
}

#[test]
fn collective() {
    run_group("collective");
}

#[test]
fn error() {
    run_group("error");
}

#[test]
fn kernel() {
    run_group("kernel");
}

#[test]
fn stress() {
    run_group("stress");
}
