//! Finding and opening the Ascend emulator (`tests/ascend-emulator`) from test binaries of any
//! crate. `cargo test` does not link the cdylib, so `cargo build -p hprt-ascend-emulator` (which
//! `scripts/test` runs first) must have put it next to the test binaries, in target/<profile>/.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use hprt_platform::NpuBackend;
use hprt_sys::SearchEnv;

/// The emulator library next to the running test binary. Panics with the command to run when it
/// is missing, so a test never passes by skipping.
pub fn library_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>");
    let lib = dir.join("libhprt_ascend_emulator.so");
    assert!(
        lib.is_file(),
        "{} is missing: build it with `cargo build -p hprt-ascend-emulator` (scripts/test does)",
        lib.display()
    );
    lib
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
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}
