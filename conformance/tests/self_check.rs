//! The suite checks itself: a platform that wraps the cpu backend and breaks one contract must
//! make the cases that cover the contract fail (and must not hang the run).

use hprt_conformance::run_cases;
use hprt_platform::{
    BackendKind, Collective, Communicator, CpuBackend, CpuConfig, DeviceBuffer, Event, HostFn,
    HostMemoryFn, Kernel, MemInfo, Memory, MemoryStats, PinnedBuffer, Place, Platform,
    PlatformInfo, RawStream, ReduceOp, ReleaseFn, Result, Stream, UniqueId,
};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// stream_wait_event does nothing.
    NoWait,
    /// synchronize_stream returns at once.
    NoSync,
    /// Avg reductions are issued as Sum.
    AvgAsSum,
    /// all_reduce drops its last element.
    ShortAllReduce,
    /// Copies ignore the source offset.
    CopyIgnoresSrcOffset,
    /// memset writes one byte fewer.
    ShortMemset,
    /// Elapsed time is negative.
    NegativeElapsed,
    /// broadcast always uses root 0.
    BroadcastRootZero,
    /// Scale kernels are dropped.
    ScaleSkipped,
    /// Host functions run at once on the caller's thread, not in stream order.
    HostFnImmediate,
    /// Destroyed-stream operations are silently accepted by skipping destroy.
    DestroyIsNoop,
}

struct Faulty {
    inner: CpuBackend,
    fault: Fault,
}

impl Faulty {
    fn new(fault: Fault, jitter: Option<u64>) -> Self {
        Faulty {
            inner: CpuBackend::new(CpuConfig {
                jitter,
                ..CpuConfig::default()
            }),
            fault,
        }
    }
}

impl Platform for Faulty {
    fn backend(&self) -> BackendKind {
        self.inner.backend()
    }
    fn info(&self) -> PlatformInfo {
        Platform::info(&self.inner)
    }
    fn capabilities(&self) -> hprt_platform::Capabilities {
        Platform::capabilities(&self.inner)
    }
    fn device_count(&self) -> usize {
        Platform::device_count(&self.inner)
    }
    fn set_device(&self, ordinal: usize) -> Result<()> {
        Platform::set_device(&self.inner, ordinal)
    }
    fn current_device(&self) -> usize {
        Platform::current_device(&self.inner)
    }
    fn mem_info(&self) -> Result<MemInfo> {
        Platform::mem_info(&self.inner)
    }
    fn memory_stats(&self) -> MemoryStats {
        Platform::memory_stats(&self.inner)
    }
    fn reset_peak_memory(&self) {
        Platform::reset_peak_memory(&self.inner)
    }
    fn create_stream(&self) -> Result<Stream> {
        Platform::create_stream(&self.inner)
    }
    unsafe fn wrap_external_stream(&self, raw: RawStream) -> Result<Stream> {
        Platform::wrap_external_stream(&self.inner, raw)
    }
    fn destroy_stream(&self, stream: &Stream) -> Result<()> {
        if self.fault == Fault::DestroyIsNoop {
            return Ok(());
        }
        Platform::destroy_stream(&self.inner, stream)
    }
    fn synchronize_stream(&self, stream: &Stream) -> Result<()> {
        if self.fault == Fault::NoSync {
            return Ok(());
        }
        Platform::synchronize_stream(&self.inner, stream)
    }
    fn query_stream(&self, stream: &Stream) -> Result<bool> {
        Platform::query_stream(&self.inner, stream)
    }
    fn lend_stream_to_framework(&self, stream: &Stream) -> Result<()> {
        Platform::lend_stream_to_framework(&self.inner, stream)
    }
    fn synchronize_device(&self) -> Result<()> {
        Platform::synchronize_device(&self.inner)
    }
    fn create_event(&self, timing: bool) -> Result<Event> {
        Platform::create_event(&self.inner, timing)
    }
    fn destroy_event(&self, event: &Event) -> Result<()> {
        Platform::destroy_event(&self.inner, event)
    }
    fn record_event(&self, event: &Event, stream: &Stream) -> Result<()> {
        Platform::record_event(&self.inner, event, stream)
    }
    fn stream_wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        if self.fault == Fault::NoWait {
            return Ok(());
        }
        Platform::stream_wait_event(&self.inner, stream, event)
    }
    fn query_event(&self, event: &Event) -> Result<bool> {
        Platform::query_event(&self.inner, event)
    }
    fn synchronize_event(&self, event: &Event) -> Result<()> {
        Platform::synchronize_event(&self.inner, event)
    }
    fn event_elapsed_ms(&self, start: &Event, end: &Event) -> Result<f32> {
        let ms = Platform::event_elapsed_ms(&self.inner, start, end)?;
        Ok(if self.fault == Fault::NegativeElapsed {
            -1.0 - ms
        } else {
            ms
        })
    }
    fn alloc_device(&self, bytes: usize) -> Result<DeviceBuffer> {
        Platform::alloc_device(&self.inner, bytes)
    }
    unsafe fn wrap_device_memory(
        &self,
        ptr: usize,
        bytes: usize,
        release: Option<ReleaseFn>,
    ) -> Result<DeviceBuffer> {
        Platform::wrap_device_memory(&self.inner, ptr, bytes, release)
    }
    fn free_device(&self, buf: &DeviceBuffer) -> Result<()> {
        Platform::free_device(&self.inner, buf)
    }
    fn resize_device(&self, buf: &DeviceBuffer, bytes: usize) -> Result<()> {
        Platform::resize_device(&self.inner, buf, bytes)
    }
    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer> {
        Platform::alloc_pinned(&self.inner, bytes)
    }
    fn free_pinned(&self, buf: &PinnedBuffer) -> Result<()> {
        Platform::free_pinned(&self.inner, buf)
    }
    fn copy_async(
        &self,
        dst: Memory<&DeviceBuffer, &PinnedBuffer>,
        dst_offset: usize,
        src: Memory<&DeviceBuffer, &PinnedBuffer>,
        src_offset: usize,
        bytes: usize,
        stream: &Stream,
    ) -> Result<()> {
        let src_offset = if self.fault == Fault::CopyIgnoresSrcOffset {
            0
        } else {
            src_offset
        };
        Platform::copy_async(&self.inner, dst, dst_offset, src, src_offset, bytes, stream)
    }
    fn memset_async(
        &self,
        dst: &DeviceBuffer,
        offset: usize,
        value: u8,
        bytes: usize,
        stream: &Stream,
    ) -> Result<()> {
        let bytes = if self.fault == Fault::ShortMemset {
            bytes.saturating_sub(1)
        } else {
            bytes
        };
        Platform::memset_async(&self.inner, dst, offset, value, bytes, stream)
    }
    fn launch_kernel(&self, kernel: Kernel<Place<&DeviceBuffer>>, stream: &Stream) -> Result<()> {
        if self.fault == Fault::ScaleSkipped && matches!(kernel, Kernel::Scale { .. }) {
            return Ok(());
        }
        Platform::launch_kernel(&self.inner, kernel, stream)
    }
    fn launch_module_kernel(
        &self,
        module: &hprt_platform::DeviceModule,
        kernel: &str,
        shape: hprt_platform::LaunchShape,
        args: &[hprt_platform::KernelArg<Place<&DeviceBuffer>>],
        stream: &Stream,
    ) -> Result<()> {
        Platform::launch_module_kernel(&self.inner, module, kernel, shape, args, stream)
    }
    fn launch_host_fn(&self, stream: &Stream, f: HostFn) -> Result<()> {
        if self.fault == Fault::HostFnImmediate {
            f();
            return Ok(());
        }
        Platform::launch_host_fn(&self.inner, stream, f)
    }
    fn launch_host_fn_on_memory(
        &self,
        stream: &Stream,
        dst: (Place<&DeviceBuffer>, usize),
        src: (Place<&DeviceBuffer>, usize),
        f: HostMemoryFn,
    ) -> Result<()> {
        Platform::launch_host_fn_on_memory(&self.inner, stream, dst, src, f)
    }
    fn unique_id(&self) -> Result<UniqueId> {
        Platform::unique_id(&self.inner)
    }
    fn comm_init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<Communicator> {
        Platform::comm_init(&self.inner, id, rank, world)
    }
    fn comm_split(
        &self,
        comm: &Communicator,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<Communicator>> {
        Platform::comm_split(&self.inner, comm, rank_lists)
    }
    fn destroy_comm(&self, comm: &Communicator) -> Result<()> {
        Platform::destroy_comm(&self.inner, comm)
    }
    fn abort_comm(&self, comm: &Communicator) -> Result<()> {
        Platform::abort_comm(&self.inner, comm)
    }
    fn collective(
        &self,
        comm: &Communicator,
        op: Collective<Place<&DeviceBuffer>>,
        stream: &Stream,
    ) -> Result<()> {
        let op = match (self.fault, op) {
            (
                Fault::AvgAsSum,
                Collective::AllReduce {
                    send,
                    recv,
                    count,
                    dtype,
                    op: ReduceOp::Avg,
                },
            ) => Collective::AllReduce {
                send,
                recv,
                count,
                dtype,
                op: ReduceOp::Sum,
            },
            (
                Fault::ShortAllReduce,
                Collective::AllReduce {
                    send,
                    recv,
                    count,
                    dtype,
                    op,
                },
            ) => Collective::AllReduce {
                send,
                recv,
                count: count.saturating_sub(1),
                dtype,
                op,
            },
            (
                Fault::BroadcastRootZero,
                Collective::Broadcast {
                    buf, count, dtype, ..
                },
            ) => Collective::Broadcast {
                buf,
                count,
                dtype,
                root: 0,
            },
            (_, op) => op,
        };
        Platform::collective(&self.inner, comm, op, stream)
    }
    fn group_start(&self) -> Result<()> {
        Platform::group_start(&self.inner)
    }
    fn group_end(&self) -> Result<()> {
        Platform::group_end(&self.inner)
    }
}

/// Runs the cases matching `filter` on a platform with `fault` and checks that every case named
/// in `must_fail` failed.
fn detects(fault: Fault, jitter: Option<u64>, filter: &str, must_fail: &[&str]) {
    // A race shows up under jitter with high probability, not certainty: a jittered fault gets
    // up to four seeds, and each named case must fail under at least one of them (a case that
    // never notices the fault still fails this check). Deterministic faults get one run.
    let seeds: Vec<Option<u64>> = match jitter {
        Some(s) => (s..s + 4).map(Some).collect(),
        None => vec![None],
    };
    let mut missed: Vec<&str> = must_fail.to_vec();
    let mut last = Vec::new();
    for seed in seeds {
        if missed.is_empty() {
            break;
        }
        let p = Faulty::new(fault, seed);
        let outcomes = run_cases(&p, Some(filter));
        missed.retain(|name| {
            let o = outcomes
                .iter()
                .find(|o| o.name == *name)
                .unwrap_or_else(|| panic!("case {name} did not run for filter {filter:?}"));
            if !o.passed {
                eprintln!(
                    "{fault:?} (jitter {seed:?}) caught by {}: {}",
                    o.name, o.detail
                );
            }
            o.passed
        });
        last = outcomes;
    }
    assert!(
        missed.is_empty(),
        "{fault:?}: case(s) {missed:?} passed on a platform with this fault under every seed tried ({} outcomes in the last run)",
        last.len()
    );
}

#[test]
fn missing_waits_are_caught() {
    detects(Fault::NoWait, Some(5), "stream", &["cross_stream_wait"]);
    detects(Fault::NoWait, Some(6), "ring_of_32", &["ring_of_32_queues"]);
    detects(
        Fault::NoWait,
        Some(7),
        "rerecord",
        &["rerecord_waits_for_latest"],
    );
}

#[test]
fn broken_kernels_and_host_functions_are_caught() {
    detects(
        Fault::ScaleSkipped,
        None,
        "kernel",
        &["fill_scale_axpy", "stream_ordered"],
    );
    detects(
        Fault::HostFnImmediate,
        Some(9),
        "host_fn",
        &["host_fn_in_stream_order"],
    );
    detects(
        Fault::NoWait,
        Some(10),
        "stream_ordered",
        &["stream_ordered"],
    );
}

/// Reads of pinned memory wait for the copies queued on it by themselves, so a skipped
/// `synchronize_stream` shows where the stream's state or a host function's effects are read.
#[test]
fn missing_synchronization_is_caught() {
    detects(
        Fault::NoSync,
        Some(8),
        "stream",
        &["query_after_synchronize"],
    );
    detects(
        Fault::NoSync,
        Some(8),
        "host_fn_in_stream_order",
        &["host_fn_in_stream_order"],
    );
}

#[test]
fn wrong_reductions_are_caught() {
    detects(Fault::AvgAsSum, None, "all_reduce", &["all_reduce"]);
    detects(Fault::AvgAsSum, None, "in_place", &["in_place"]);
    detects(Fault::ShortAllReduce, None, "all_reduce", &["all_reduce"]);
    detects(Fault::ShortAllReduce, None, "chained", &["chained"]);
    detects(Fault::BroadcastRootZero, None, "broadcast", &["broadcast"]);
}

#[test]
fn wrong_copies_are_caught() {
    detects(
        Fault::CopyIgnoresSrcOffset,
        None,
        "copy",
        &["all_kinds_with_offsets", "d2d_within_one_buffer"],
    );
    detects(Fault::ShortMemset, None, "copy", &["memset_with_offset"]);
    detects(
        Fault::ShortMemset,
        None,
        "ordering_chain",
        &["ordering_chain"],
    );
}

#[test]
fn wrong_events_and_handles_are_caught() {
    detects(
        Fault::NegativeElapsed,
        None,
        "elapsed_time",
        &["elapsed_time"],
    );
    detects(
        Fault::DestroyIsNoop,
        None,
        "destroy",
        &["destroyed_stream", "double_destroy"],
    );
}
