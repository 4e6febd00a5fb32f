//! The conformance suite on whatever `HP_PLATFORM` selects (cpu by default), one test per group.
//! CI re-runs it with `HP_CPU_JITTER=<seed>`.

use std::sync::Mutex;

use hprt_conformance::{run_cases, Outcome};

/// The groups share one process-wide platform; memory accounting cases compare deltas, so the
/// groups run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn table(outcomes: &[Outcome]) -> String {
    let width = outcomes
        .iter()
        .map(|o| o.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let mut s = String::new();
    for o in outcomes {
        s += &format!(
            "{:<width$}  {:<10}  {:<4}  {:>8.1?}  {}\n",
            o.name,
            o.group,
            if o.passed { "ok" } else { "FAIL" },
            o.duration,
            o.detail
        );
    }
    s
}

fn run_group(group: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let platform = hprt_platform::get_platform().expect("get_platform");
    let outcomes = run_cases(platform, Some(group));
    assert!(
        outcomes.iter().any(|o| o.group == group),
        "no case of group {group} ran"
    );
    eprintln!("{} on {}:\n{}", group, platform.backend(), table(&outcomes));
    let failed: Vec<Outcome> = outcomes.into_iter().filter(|o| !o.passed).collect();
    assert!(
        failed.is_empty(),
        "{} case(s) failed:\n{}",
        failed.len(),
        table(&failed)
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
fn stress() {
    run_group("stress");
}
