//! The cuda backend keeps a stream lent to a framework until the platform goes
//! (`Platform::lend_stream_to_framework`, `Device::parked_streams`): torch's
//! caching allocator records an event on every stream a block was `record_stream`ed to when the
//! block is freed, which can be after the swap front end that handed the block over, and its
//! streams, are gone. On an H200 that record on a destroyed stream aborted the process
//! (`cudaErrorContextIsDestroyed` from `CUDACachingAllocator::insert_events`) in
//! `torch_swap_step.py` and in `test_torch_compile_in_every_mode`. Over the CUDA emulator,
//! which refuses a destroyed stream's handle as the driver does.
//!
//! The emulator counts driver calls per process: this binary holds this one test only.

use hprt_conformance::cuda_emulator::{self, driver_calls};
use hprt_platform::Platform;

#[test]
fn a_released_streams_handle_stays_a_stream_that_a_framework_can_record_on() {
    let platform = cuda_emulator::open().expect("cuda on the emulator");
    let p: &dyn Platform = &platform;
    let s = p.create_stream().unwrap();
    let raw = s.raw();
    // What the torch binding does before `record_stream` (the swap front ends' hand-over).
    p.lend_stream_to_framework(&s).unwrap();
    p.destroy_stream(&s).unwrap();
    drop(s);
    p.synchronize_device().unwrap();

    // What torch does when a block handed over to that stream is freed.
    // SAFETY: the point of the test: the handle names a live stream after destroy_stream.
    let theirs = unsafe { p.wrap_external_stream(raw) }
        .expect("the raw handle of a stream hprt let go of is still a stream of its device");
    let e = p.create_event(false).unwrap();
    p.record_event(&e, &theirs).unwrap();
    p.synchronize_event(&e).unwrap();

    // The next stream is the parked one (still lent: parked again when let go); no driver
    // stream is made or destroyed. A stream never lent is destroyed as before.
    let (made, destroyed) = (
        driver_calls("cuStreamCreate"),
        driver_calls("cuStreamDestroy_v2"),
    );
    let again = p.create_stream().unwrap();
    assert_eq!(again.raw(), raw);
    assert_eq!(driver_calls("cuStreamCreate"), made);
    let own = p.create_stream().unwrap();
    assert_eq!(driver_calls("cuStreamCreate"), made + 1);
    for s in [&again, &own, &theirs] {
        p.destroy_stream(s).unwrap();
    }
    drop((again, own, theirs));
    p.synchronize_device().unwrap();
    assert_eq!(driver_calls("cuStreamDestroy_v2"), destroyed + 1);
    // Dropping the platform (its last object) destroys what it parked.
    drop((e, platform));
    assert_eq!(driver_calls("cuStreamDestroy_v2"), destroyed + 2);
}
