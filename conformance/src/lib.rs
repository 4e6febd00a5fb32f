//! hprt's backend-conformance suite.
//!
//! Every case is written against the [`Platform`] trait only, so the same suite runs on the cpu
//! reference backend, on CUDA and on the Ascend emulator. Cases are grouped (`memory`, `copy`,
//! `stream`, `event`, `interop`, `collective`, `kernel`, `error`, `stress`); [`run_cases`] runs a filtered
//! selection and turns failures and panics into [`Outcome`]s instead of aborting.
//!
//! Cases must be correct under the cpu backend's jitter mode (`HP_CPU_JITTER`), which delays stream
//! work randomly: every host read of device results waits for the work that produced it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use hprt_platform::Platform;

mod collective;
mod copy;
pub mod cuda_emulator;
pub mod emulator;
mod errors;
mod event;
mod interop;
mod kernel;
mod memory;
pub mod reference;
mod stream;
mod stress;
mod util;

/// One conformance case.
pub struct Case {
    /// Unique within the suite.
    pub name: &'static str,
    /// One of [`GROUPS`].
    pub group: &'static str,
    pub run: fn(&dyn Platform) -> anyhow::Result<()>,
}

/// The result of running one [`Case`].
#[derive(Clone, Debug)]
pub struct Outcome {
    pub name: &'static str,
    pub group: &'static str,
    pub passed: bool,
    /// The case cannot run on this platform (`detail` says why); it counts as not failed.
    pub skipped: bool,
    /// Empty when the case passed; otherwise the error chain or panic message.
    pub detail: String,
    pub duration: Duration,
}

/// The groups, in the order [`cases`] lists them.
pub const GROUPS: [&str; 9] = [
    "memory",
    "copy",
    "stream",
    "event",
    "interop",
    "collective",
    "kernel",
    "error",
    "stress",
];

/// The suite by group: a case is named after its function, or `name = function` where the
/// function's own name would not say which group's it is.
macro_rules! cases {
    ($($group:literal in $module:ident: [$($name:ident $(= $f:ident)?),* $(,)?])*) => {
        &[$($(Case {
            name: stringify!($name),
            group: $group,
            run: cases!(@run $module $name $($f)?),
        },)*)*]
    };
    (@run $module:ident $name:ident) => { $module::$name };
    (@run $module:ident $name:ident $f:ident) => { $module::$f };
}

static CASES: &[Case] = cases! {
    "memory" in memory: [
        alloc_free_accounting, pinned_accounting, free_does_not_wait_for_queued_work, drop_releases,
        out_of_memory, pinned_out_of_memory, zero_size, unaligned_sizes, resize_to_zero_and_back,
        resize_failure_keeps_buffer, mem_info_sane,
    ]
    "copy" in copy: [
        all_kinds_with_offsets, d2d_within_one_buffer, memset_with_offset, sync_helpers,
        pinned_access_waits_for_queued_copies, empty_copies,
    ]
    "stream" in stream: [
        ordering_chain, cross_stream_wait, query_after_synchronize, synchronize_device_all,
        destroy_with_pending_work,
    ]
    "event" in event: [
        never_recorded, record_synchronize_query, rerecord_waits_for_latest, elapsed_time,
        elapsed_without_timing, elapsed_not_ready, pending_while_gated,
    ]
    "interop" in interop: [
        wrapped_stream_shares_queue, wrapped_stream_destroy, wrapped_memory_visible,
        release_after_last_clone, release_after_free, release_after_pending_work,
        resize_borrowed_unsupported,
    ]
    "collective" in collective: [
        all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, all_to_all_v, send_recv_ring,
        send_recv_pairs, barrier, in_place, zero_count, chained, comm_split,
    ]
    "kernel" in kernel: [
        cast_to_half_formats, cast_widen_and_to_integers, fill_scale_axpy, stream_ordered,
        host_fn_in_stream_order, host_fn_panic_is_reported, host_fn_panic_reaches_waiters,
        host_fn_on_memory, kernel_bad_arguments = bad_arguments, matmul_f32,
    ]
    "error" in errors: [
        use_after_free, out_of_range, destroyed_stream, destroyed_event, double_destroy,
        pinned_host_access, mismatched_collective, overlapping_all_to_all, collective_bad_arguments,
        queued_error_reaches_waiters, waiter_reports_error_its_source_reported,
        destroyed_stream_error_reaches_device_synchronize, failed_collective_aborts_communicator,
        comm_init_bad_rank, group_end_unopened, split_bad_rank_lists,
    ]
    "stress" in stress: [
        ring_of_32_queues, alloc_storm,
    ]
};

/// Every case of the suite, grouped in the order of [`GROUPS`].
pub fn cases() -> &'static [Case] {
    CASES
}

/// Runs the cases whose name or group contains `filter` (all when None); a panicking case is a
/// failure (catch_unwind), never aborts the run.
pub fn run_cases(platform: &dyn Platform, filter: Option<&str>) -> Vec<Outcome> {
    cases()
        .iter()
        .filter(|c| filter.is_none_or(|f| c.name.contains(f) || c.group.contains(f)))
        .map(|c| run_case(platform, c))
        .collect()
}

/// A pass/fail table of `outcomes`, failure details indented under their case, and a summary line.
pub fn report(outcomes: &[Outcome]) -> String {
    let width = outcomes
        .iter()
        .map(|o| o.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let mut s = format!(
        "{:<width$}  {:<10}  {:<6}  {:>9}\n",
        "case", "group", "result", "time"
    );
    s += &"-".repeat(width + 33);
    s.push('\n');
    for o in outcomes {
        let result = match (o.passed, o.skipped) {
            (_, true) => "skip",
            (true, false) => "pass",
            (false, false) => "FAIL",
        };
        let ms = o.duration.as_secs_f64() * 1e3;
        s += &format!(
            "{:<width$}  {:<10}  {result:<6}  {ms:>7.1}ms\n",
            o.name, o.group
        );
        for line in o.detail.lines() {
            s += &format!("{:<width$}    {line}\n", "");
        }
    }
    let failed = outcomes.iter().filter(|o| !o.passed).count();
    let skipped = outcomes.iter().filter(|o| o.skipped).count();
    s += &format!(
        "\n{} cases, {} passed, {skipped} skipped, {failed} failed\n",
        outcomes.len(),
        outcomes.len() - failed - skipped
    );
    s
}

fn run_case(platform: &dyn Platform, case: &Case) -> Outcome {
    let start = Instant::now();
    let result = catch_unwind(AssertUnwindSafe(|| (case.run)(platform)));
    let duration = start.elapsed();
    let (passed, skipped, detail) = match result {
        Ok(Ok(())) => (true, false, String::new()),
        Ok(Err(e)) if e.downcast_ref::<util::Skipped>().is_some() => (true, true, e.to_string()),
        Ok(Err(e)) => (false, false, format!("{e:#}")),
        Err(payload) => (
            false,
            false,
            format!("panicked: {}", util::panic_message(&*payload)),
        ),
    };
    Outcome {
        name: case.name,
        group: case.group,
        passed,
        skipped,
        detail,
        duration,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_groups_known() {
        let mut seen = std::collections::HashSet::new();
        for c in cases() {
            assert!(seen.insert(c.name), "duplicate case name {}", c.name);
            assert!(
                GROUPS.contains(&c.group),
                "{} has unknown group {}",
                c.name,
                c.group
            );
        }
        for g in GROUPS {
            assert!(cases().iter().any(|c| c.group == g), "group {g} is empty");
        }
    }

    #[test]
    fn groups_are_contiguous() {
        let order: Vec<&str> = cases().iter().map(|c| c.group).collect();
        let mut dedup = order.clone();
        dedup.dedup();
        assert_eq!(dedup, GROUPS, "cases must be listed group by group");
    }
}
