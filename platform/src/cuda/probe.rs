//! Finding the CUDA driver, NCCL and NVRTC libraries before anything touches them.
//!
//! cudarc panics when it cannot load a library, so the backend opens each one here first with
//! libloading, trying the same names cudarc would (for the driver) or the names the libraries
//! ship under (NCCL, NVRTC), and records every name or path it tried for the error and for
//! `hprt info`. Environment overrides (each replaces the name search with one path):
//!
//! - `HP_CUDA_LIB`: the driver library (`libcuda.so.1`). cudarc itself resolves the driver by
//!   name; an override loaded first is what those names resolve to through its soname, and the
//!   backend checks that cudarc ended up with the same library.
//! - `HP_NCCL_LIB`: NCCL (`libnccl.so.2`), e.g. the one a PyTorch wheel ships.
//! - `HP_NVRTC_LIB`: NVRTC (`libnvrtc.so.12`), e.g. the one a PyTorch wheel ships.

use std::path::PathBuf;

use libloading::Library;

use crate::info::LibraryProbe;

/// Where to look for the three libraries; [`CudaSearch::from_process`] reads the environment.
///
/// ```
/// use hprt_platform::cuda::CudaSearch;
/// let search = CudaSearch {
///     cuda_lib: Some("/nonexistent/libcuda.so.1".into()),
///     ..CudaSearch::default()
/// };
/// assert!(search.nccl_lib.is_none());
/// ```
#[derive(Clone, Debug, Default)]
pub struct CudaSearch {
    /// `HP_CUDA_LIB`: the driver library to load instead of searching by name.
    pub cuda_lib: Option<PathBuf>,
    /// `HP_NCCL_LIB`: the NCCL library to load instead of searching by name.
    pub nccl_lib: Option<PathBuf>,
    /// `HP_NVRTC_LIB`: the NVRTC library to load instead of searching by name.
    pub nvrtc_lib: Option<PathBuf>,
}

impl CudaSearch {
    pub fn from_process() -> Self {
        let path = |var: &str| {
            std::env::var_os(var)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        CudaSearch {
            cuda_lib: path("HP_CUDA_LIB"),
            nccl_lib: path("HP_NCCL_LIB"),
            nvrtc_lib: path("HP_NVRTC_LIB"),
        }
    }
}

/// One library the backend needs: what it is called in messages, its override variable and
/// the names the dynamic loader is asked for, in order.
pub(crate) struct LibrarySpec {
    pub what: &'static str,
    pub env: &'static str,
    pub names: Vec<String>,
}

impl LibrarySpec {
    /// The driver: exactly cudarc's candidate names, so the first that loads is the one cudarc
    /// will load.
    pub(crate) fn driver() -> Self {
        LibrarySpec {
            what: "libcuda",
            env: "HP_CUDA_LIB",
            names: cudarc::get_lib_name_candidates("cuda"),
        }
    }

    pub(crate) fn nccl() -> Self {
        LibrarySpec {
            what: "libnccl",
            env: "HP_NCCL_LIB",
            names: vec!["libnccl.so.2".into(), "libnccl.so".into()],
        }
    }

    pub(crate) fn nvrtc() -> Self {
        LibrarySpec {
            what: "libnvrtc",
            env: "HP_NVRTC_LIB",
            names: [
                "libnvrtc.so",
                "libnvrtc.so.13",
                "libnvrtc.so.12",
                "libnvrtc.so.11.2",
            ]
            .map(String::from)
            .to_vec(),
        }
    }
}

/// A loaded library and where it came from.
pub(crate) struct Found {
    pub lib: Library,
    pub path: String,
}

/// The outcome of one search: every candidate tried, and the library if one loaded.
pub(crate) struct Search {
    pub what: &'static str,
    pub env: &'static str,
    /// Where the candidates came from (the override variable, or the loader's search).
    pub source: String,
    pub tried: Vec<LibraryProbe>,
    /// Each failed candidate, with the loader's reason where it says more than "not found".
    pub failures: Vec<String>,
    pub found: Option<Found>,
}

impl Search {
    /// A sentence naming the library and every name or path tried (for `Unavailable`).
    pub(crate) fn missing_message(&self) -> String {
        format!(
            "{} could not be loaded; tried ({}): {}; set {} to the library's path",
            self.what,
            self.source,
            self.failures.join(", "),
            self.env
        )
    }
}

/// Tries the override path if one is set (and nothing else), otherwise each name in order.
pub(crate) fn search(spec: &LibrarySpec, override_path: Option<&PathBuf>) -> Search {
    let (candidates, source) = match override_path {
        Some(p) => (vec![p.display().to_string()], spec.env.to_string()),
        None => {
            let mut names = spec.names.clone();
            // cudarc's list repeats some names; trying one twice says nothing new.
            let mut seen = std::collections::HashSet::new();
            names.retain(|n| seen.insert(n.clone()));
            (names, "dynamic loader search".to_string())
        }
    };
    let mut out = Search {
        what: spec.what,
        env: spec.env,
        source,
        tried: Vec::new(),
        failures: Vec::new(),
        found: None,
    };
    for candidate in candidates {
        // SAFETY: loading a driver library runs its initialisers; these are the libraries the
        // backend exists to use, opened the way cudarc would open them.
        let loaded = unsafe { Library::new(&candidate) };
        out.tried.push(LibraryProbe {
            path: format!("{candidate} ({})", out.source),
            found: loaded.is_ok(),
        });
        match loaded {
            Ok(lib) => {
                out.found = Some(Found {
                    lib,
                    path: candidate,
                });
                break;
            }
            Err(e) => {
                let reason = e.to_string();
                out.failures
                    .push(if reason.contains("No such file or directory") {
                        candidate
                    } else {
                        // A file that exists but does not load (wrong architecture, a missing
                        // dependency) is worth its reason.
                        format!("{candidate} ({reason})")
                    });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_override_is_the_only_candidate_and_its_failure_is_named() {
        let path = PathBuf::from("/nonexistent/hprt-test/libcuda.so.1");
        let s = search(&LibrarySpec::driver(), Some(&path));
        assert!(s.found.is_none());
        assert_eq!(s.tried.len(), 1);
        assert!(!s.tried[0].found);
        let msg = s.missing_message();
        assert!(msg.contains("libcuda"), "{msg}");
        assert!(msg.contains("/nonexistent/hprt-test/libcuda.so.1"), "{msg}");
        assert!(msg.contains("HP_CUDA_LIB"), "{msg}");
    }

    #[test]
    fn the_driver_is_searched_under_the_names_cudarc_uses() {
        let names = LibrarySpec::driver().names;
        assert_eq!(names, cudarc::get_lib_name_candidates("cuda"));
        assert!(names.iter().any(|n| n == "libcuda.so.1"), "{names:?}");
        assert!(names.iter().any(|n| n == "libcuda.so"), "{names:?}");
        assert!(LibrarySpec::nccl()
            .names
            .contains(&"libnccl.so.2".to_string()));
    }

    #[test]
    fn a_library_that_exists_is_found_and_recorded() {
        // libc is on every Linux machine this crate builds on; the search stops at it.
        let spec = LibrarySpec {
            what: "libc",
            env: "HP_TEST_LIB",
            names: vec!["libhprt-does-not-exist.so".into(), "libc.so.6".into()],
        };
        let s = search(&spec, None);
        assert!(s.found.is_some(), "{}", s.missing_message());
        assert_eq!(s.tried.len(), 2);
        assert!(!s.tried[0].found && s.tried[1].found);
        assert_eq!(s.failures.len(), 1);
    }
}
