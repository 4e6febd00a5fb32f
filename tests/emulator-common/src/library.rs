//! Finding the emulator libraries from test binaries of any crate, building them on first use.
//!
//! `cargo test` builds the emulators' unit tests but not their `cdylib`s, so a test that loads
//! one runs `$CARGO build -p <emulator>` itself (same workspace, target directory and profile as
//! the running test binary) before handing out the path: `cargo test -p <any crate>` works on a
//! fresh clone with no prior step. The build runs once per process (a `OnceLock` per library);
//! test binaries running in parallel are serialised by cargo's own lock on the target directory,
//! and a second build of an up-to-date library changes nothing on disk.
//!
//! Only tests call this; the emulator `cdylib`s themselves never do.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The Ascend emulator (ACL + HCCL), `libhprt_ascend_emulator.so`, built when missing or stale.
pub fn ascend_emulator() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| built("libhprt_ascend_emulator.so", "hprt-ascend-emulator"))
        .clone()
}

/// The CUDA emulator (driver, NCCL and NVRTC in one library), `libhprt_cuda_emulator.so`, built
/// when missing or stale.
pub fn cuda_emulator() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| built("libhprt_cuda_emulator.so", "hprt-cuda-emulator"))
        .clone()
}

/// `file` in target/<profile>/ (the directory above the running test binary's `deps/`), after
/// `cargo build -p <package>` for that profile. Panics when the build fails, so a test never
/// passes by skipping.
fn built(file: &str, package: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("test binary in target/<profile>/deps");
    let lib = profile_dir.join(file);
    build(package, profile_dir);
    assert!(
        lib.is_file(),
        "`cargo build -p {package}` succeeded but {} is missing",
        lib.display()
    );
    lib
}

/// Runs `$CARGO build -p <package>` into `profile_dir`'s target directory and profile.
fn build(package: &str, profile_dir: &Path) {
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(name) => name,
    };
    let target_dir = profile_dir.parent().expect("target directory");
    // The cargo running the tests sets CARGO at run time; a test binary started by hand falls
    // back to the cargo that compiled this crate, then to the one on PATH.
    let cargo = std::env::var_os("CARGO")
        .or_else(|| option_env!("CARGO").map(Into::into))
        .unwrap_or_else(|| "cargo".into());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let output = Command::new(&cargo)
        .arg("build")
        .arg("--quiet")
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir)
        .arg("--profile")
        .arg(profile)
        .arg("-p")
        .arg(package)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running {} build -p {package}: {e}",
                cargo.to_string_lossy()
            )
        });
    assert!(
        output.status.success(),
        "`cargo build -p {package}` failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}
