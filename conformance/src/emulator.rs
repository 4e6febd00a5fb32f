//! Finding and opening the Ascend emulator (`tests/ascend-emulator`) from test binaries of any
//! crate. `cargo test` does not link the cdylib: [`library_path`] builds it on first use
//! (`hprt_emulator_common::library`), next to the test binaries in `target/<profile>/`.

use std::sync::{Mutex, MutexGuard};

use hprt_platform::NpuBackend;
use hprt_sys::SearchEnv;

pub use hprt_emulator_common::library::ascend_emulator as library_path;

/// An emulator's test-only exports (`hprtEmuGetStats`, `hprtEmuSetFaults`), which both
/// emulators provide with their own statistics struct.
pub struct Control(libloading::Library);

impl Control {
    pub fn open(lib: &std::path::Path) -> Control {
        // SAFETY: an emulator library, already loaded by the backend (same handle).
        Control(unsafe { libloading::Library::new(lib) }.expect("open the emulator"))
    }

    /// The emulator's statistics; `S` is its `#[repr(C)]` statistics struct.
    pub fn stats<S: Default>(&self) -> S {
        let mut s = S::default();
        // SAFETY: the export's documented signature, with the caller's matching struct.
        unsafe {
            let f: libloading::Symbol<unsafe extern "C" fn(*mut S) -> i32> =
                self.0.get(b"hprtEmuGetStats\0").expect("hprtEmuGetStats");
            assert_eq!(f(&mut s), 0);
        }
        s
    }

    /// Replaces the fault list (`HP_EMU_FAULTS` syntax).
    pub fn faults(&self, spec: &str) {
        let c = std::ffi::CString::new(spec).expect("no NUL");
        // SAFETY: the export's documented signature.
        unsafe {
            let f: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char) -> i32> =
                self.0.get(b"hprtEmuSetFaults\0").expect("hprtEmuSetFaults");
            assert_eq!(f(c.as_ptr()), 0, "fault spec {spec:?}");
        }
    }
}

/// Library search settings naming only the emulator, for both ACL and HCCL.
pub fn search_env() -> SearchEnv {
    let lib = library_path();
    SearchEnv {
        acl_lib: Some(lib.clone()),
        hccl_lib: Some(lib),
        ..Default::default()
    }
}

/// The npu backend on the emulator.
pub fn open() -> hprt_platform::Result<NpuBackend> {
    NpuBackend::open_with(&search_env())
}

/// The emulator's state is process-global: tests of one binary that use it take this lock.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    hprt_platform::sync::lock(&SERIAL)
}

/// One fault-injection case: the `HP_EMU_FAULTS` spec, the error kind and status name it must
/// come back as, and the call that hits it.
pub type FaultCase = (
    &'static str,
    hprt_platform::ErrorKind,
    &'static str,
    fn(&dyn hprt_platform::Platform, &hprt_platform::Stream) -> hprt_platform::Result<()>,
);

/// Runs each case with its fault armed: the error must come back typed, with the status name
/// and the failing function in it; nothing may leak (`live` reads the emulator's counts of live
/// resources); and the same call must work once the fault is gone.
pub fn check_fault_cases<L: PartialEq + std::fmt::Debug>(
    control: &Control,
    live: impl Fn(&Control) -> L,
    p: &dyn hprt_platform::Platform,
    s: &hprt_platform::Stream,
    cases: &[FaultCase],
) {
    let baseline = live(control);
    for (spec, kind, name, call) in cases {
        control.faults(spec);
        let e = call(p, s)
            .err()
            .unwrap_or_else(|| panic!("{spec}: the injected fault did not surface"));
        assert_eq!(
            (e.kind(), e.code_name.as_ref()),
            (*kind, *name),
            "{spec}: {e}"
        );
        let function = spec.split(':').next().unwrap_or_default();
        assert!(e.message.contains(function), "{spec}: {e}");
        control.faults("");
        // The stream may carry the failure of work queued after the failed call; clear it.
        let _ = p.synchronize_stream(s);
        assert_eq!(live(control), baseline, "{spec}: leaked");
        call(p, s).unwrap_or_else(|e| panic!("{spec}: the next call failed: {e}"));
        p.synchronize_stream(s)
            .unwrap_or_else(|e| panic!("{spec}: synchronize after the next call: {e}"));
        assert_eq!(live(control), baseline, "{spec}: the next call leaked");
    }
}
