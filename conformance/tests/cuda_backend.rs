//! The cuda backend where no usable driver is (CI, or any machine when `HP_CUDA_LIB` points at
//! a file that does not exist, which is what this binary does): selection fails with a typed
//! `Unavailable` error naming libcuda and the paths tried, and auto-detection moves on.
//!
//! The backend itself runs against the CUDA emulator in every CI run (`cuda_emulator.rs`, and the
//! conformance suite with `HP_PLATFORM=cuda` in `scripts/test`); on a GPU machine it is checked
//! by `HP_PLATFORM=cuda cargo run --release -- conformance` (see `scripts/gpu-check`).

use std::sync::Once;

use hprt_platform::cuda::{CudaBackend, CudaSearch};
use hprt_platform::{select_platform, BackendKind, ErrorKind, PlatformRequest};

const MISSING: &str = "/nonexistent/hprt-cuda-test/libcuda.so.1";

/// Every test of this binary runs with the same override, set once before any of them looks.
fn no_driver() {
    static SET: Once = Once::new();
    SET.call_once(|| std::env::set_var("HP_CUDA_LIB", MISSING));
}

#[test]
fn forced_cuda_is_unavailable_and_names_libcuda_and_the_path_tried() {
    no_driver();
    let e = match select_platform(PlatformRequest::Forced(BackendKind::Cuda)) {
        Ok(s) => panic!(
            "HP_CUDA_LIB={MISSING} still selected {}",
            s.platform.backend()
        ),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert_eq!(e.backend, BackendKind::Cuda, "{e}");
    for needle in ["libcuda", MISSING, "HP_CUDA_LIB"] {
        assert!(e.message.contains(needle), "{needle:?} missing from: {e}");
    }
}

#[test]
fn auto_selection_skips_cuda_with_the_reason() {
    no_driver();
    let s = select_platform(PlatformRequest::Auto).unwrap_or_else(|e| panic!("auto: {e}"));
    assert_ne!(s.platform.backend(), BackendKind::Cuda);
    assert!(
        s.reason.contains("cuda") && s.reason.contains(MISSING),
        "the auto-selection reason does not say why cuda was skipped: {}",
        s.reason
    );
}

#[test]
fn open_with_reports_each_override_it_tried() {
    let search = CudaSearch {
        cuda_lib: Some("/nonexistent/hprt-cuda-test/other/libcuda.so".into()),
        ..CudaSearch::default()
    };
    let e = match CudaBackend::open_with(&search) {
        Ok(_) => panic!("a nonexistent driver library opened"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(
        e.message
            .contains("/nonexistent/hprt-cuda-test/other/libcuda.so"),
        "{e}"
    );
}

#[test]
fn the_search_reads_the_override_variables() {
    no_driver();
    let s = CudaSearch::from_process();
    assert_eq!(
        s.cuda_lib.as_deref(),
        Some(std::path::Path::new(MISSING)),
        "HP_CUDA_LIB was not read"
    );
}
