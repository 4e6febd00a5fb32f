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

macro_rules! case {
    ($group:literal, $name:literal, $f:path) => {
        Case {
            name: $name,
            group: $group,
            run: $f,
        }
    };
}

static CASES: &[Case] = &[
    // memory
    case!(
        "memory",
        "alloc_free_accounting",
        memory::alloc_free_accounting
    ),
    case!("memory", "pinned_accounting", memory::pinned_accounting),
    case!(
        "memory",
        "free_does_not_wait_for_queued_work",
        memory::free_does_not_wait_for_queued_work
    ),
    case!("memory", "drop_releases", memory::drop_releases),
    case!("memory", "out_of_memory", memory::out_of_memory),
    case!(
        "memory",
        "pinned_out_of_memory",
        memory::pinned_out_of_memory
    ),
    case!("memory", "zero_size", memory::zero_size),
    case!("memory", "unaligned_sizes", memory::unaligned_sizes),
    case!(
        "memory",
        "resize_to_zero_and_back",
        memory::resize_to_zero_and_back
    ),
    case!(
        "memory",
        "resize_failure_keeps_buffer",
        memory::resize_failure_keeps_buffer
    ),
    case!("memory", "mem_info_sane", memory::mem_info_sane),
    // copy
    case!(
        "copy",
        "all_kinds_with_offsets",
        copy::all_kinds_with_offsets
    ),
    case!("copy", "d2d_within_one_buffer", copy::d2d_within_one_buffer),
    case!("copy", "memset_with_offset", copy::memset_with_offset),
    case!("copy", "sync_helpers", copy::sync_helpers),
    case!(
        "copy",
        "pinned_access_waits_for_queued_copies",
        copy::pinned_access_waits_for_queued_copies
    ),
    case!("copy", "empty_copies", copy::empty_copies),
    // stream
    case!("stream", "ordering_chain", stream::ordering_chain),
    case!("stream", "cross_stream_wait", stream::cross_stream_wait),
    case!(
        "stream",
        "query_after_synchronize",
        stream::query_after_synchronize
    ),
    case!(
        "stream",
        "synchronize_device_all",
        stream::synchronize_device_all
    ),
    case!(
        "stream",
        "destroy_with_pending_work",
        stream::destroy_with_pending_work
    ),
    // event
    case!("event", "never_recorded", event::never_recorded),
    case!(
        "event",
        "record_synchronize_query",
        event::record_synchronize_query
    ),
    case!(
        "event",
        "rerecord_waits_for_latest",
        event::rerecord_waits_for_latest
    ),
    case!("event", "elapsed_time", event::elapsed_time),
    case!(
        "event",
        "elapsed_without_timing",
        event::elapsed_without_timing
    ),
    case!("event", "elapsed_not_ready", event::elapsed_not_ready),
    case!("event", "pending_while_gated", event::pending_while_gated),
    // interop
    case!(
        "interop",
        "wrapped_stream_shares_queue",
        interop::wrapped_stream_shares_queue
    ),
    case!(
        "interop",
        "wrapped_stream_destroy",
        interop::wrapped_stream_destroy
    ),
    case!(
        "interop",
        "wrapped_memory_visible",
        interop::wrapped_memory_visible
    ),
    case!(
        "interop",
        "release_after_last_clone",
        interop::release_after_last_clone
    ),
    case!("interop", "release_after_free", interop::release_after_free),
    case!(
        "interop",
        "release_after_pending_work",
        interop::release_after_pending_work
    ),
    case!(
        "interop",
        "resize_borrowed_unsupported",
        interop::resize_borrowed_unsupported
    ),
    // collective
    case!("collective", "all_reduce", collective::all_reduce),
    case!("collective", "reduce_scatter", collective::reduce_scatter),
    case!("collective", "all_gather", collective::all_gather),
    case!("collective", "broadcast", collective::broadcast),
    case!("collective", "all_to_all", collective::all_to_all),
    case!("collective", "all_to_all_v", collective::all_to_all_v),
    case!("collective", "send_recv_ring", collective::send_recv_ring),
    case!("collective", "send_recv_pairs", collective::send_recv_pairs),
    case!("collective", "barrier", collective::barrier),
    case!("collective", "in_place", collective::in_place),
    case!("collective", "zero_count", collective::zero_count),
    case!("collective", "chained", collective::chained),
    case!("collective", "comm_split", collective::comm_split),
    // kernel
    case!(
        "kernel",
        "cast_to_half_formats",
        kernel::cast_to_half_formats
    ),
    case!(
        "kernel",
        "cast_widen_and_to_integers",
        kernel::cast_widen_and_to_integers
    ),
    case!("kernel", "fill_scale_axpy", kernel::fill_scale_axpy),
    case!("kernel", "stream_ordered", kernel::stream_ordered),
    case!(
        "kernel",
        "host_fn_in_stream_order",
        kernel::host_fn_in_stream_order
    ),
    case!(
        "kernel",
        "host_fn_panic_is_reported",
        kernel::host_fn_panic_is_reported
    ),
    case!(
        "kernel",
        "host_fn_panic_reaches_waiters",
        kernel::host_fn_panic_reaches_waiters
    ),
    case!("kernel", "kernel_bad_arguments", kernel::bad_arguments),
    case!("kernel", "matmul_f32", kernel::matmul_f32),
    // error
    case!("error", "use_after_free", errors::use_after_free),
    case!("error", "out_of_range", errors::out_of_range),
    case!("error", "destroyed_stream", errors::destroyed_stream),
    case!("error", "destroyed_event", errors::destroyed_event),
    case!("error", "double_destroy", errors::double_destroy),
    case!("error", "pinned_host_access", errors::pinned_host_access),
    case!(
        "error",
        "mismatched_collective",
        errors::mismatched_collective
    ),
    case!(
        "error",
        "overlapping_all_to_all",
        errors::overlapping_all_to_all
    ),
    case!(
        "error",
        "collective_bad_arguments",
        errors::collective_bad_arguments
    ),
    case!(
        "error",
        "queued_error_reaches_waiters",
        errors::queued_error_reaches_waiters
    ),
    case!(
        "error",
        "waiter_reports_error_its_source_reported",
        errors::waiter_reports_error_its_source_reported
    ),
    case!(
        "error",
        "destroyed_stream_error_reaches_device_synchronize",
        errors::destroyed_stream_error_reaches_device_synchronize
    ),
    case!(
        "error",
        "failed_collective_aborts_communicator",
        errors::failed_collective_aborts_communicator
    ),
    case!("error", "comm_init_bad_rank", errors::comm_init_bad_rank),
    case!("error", "group_end_unopened", errors::group_end_unopened),
    case!(
        "error",
        "split_bad_rank_lists",
        errors::split_bad_rank_lists
    ),
    // stress
    case!("stress", "ring_of_32_queues", stress::ring_of_32_queues),
    case!("stress", "alloc_storm", stress::alloc_storm),
];

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
