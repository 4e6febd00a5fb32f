//! Finding and opening `libascendcl.so` and `libhccl.so`.

use std::path::{Path, PathBuf};

use crate::{AclApi, HcclApi};

/// The environment the search reads, captured so tests can pass their own.
#[derive(Clone, Debug, Default)]
pub struct SearchEnv {
    pub acl_lib: Option<PathBuf>,
    pub hccl_lib: Option<PathBuf>,
    pub toolkit_home: Option<PathBuf>,
    pub home_path: Option<PathBuf>,
    pub ld_library_path: Option<String>,
}

impl SearchEnv {
    /// `HP_ACL_LIB`, `HP_HCCL_LIB`, `ASCEND_TOOLKIT_HOME`, `ASCEND_HOME_PATH`, `LD_LIBRARY_PATH`.
    pub fn from_process() -> Self {
        let path = |v: &str| {
            std::env::var_os(v)
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
        };
        SearchEnv {
            acl_lib: path("HP_ACL_LIB"),
            hccl_lib: path("HP_HCCL_LIB"),
            toolkit_home: path("ASCEND_TOOLKIT_HOME"),
            home_path: path("ASCEND_HOME_PATH"),
            ld_library_path: std::env::var("LD_LIBRARY_PATH").ok(),
        }
    }

    /// Where `file` is looked for, in order, with the setting each place comes from. An explicit
    /// file (`HP_ACL_LIB` / `HP_HCCL_LIB`) is the only candidate when set.
    pub fn candidates(&self, file: &str, explicit: Option<&Path>) -> Vec<Candidate> {
        let mut out = Vec::new();
        let mut push = |dir: &Path, source: &'static str| {
            let path = dir.join(file);
            out.push(Candidate {
                found: path.is_file(),
                path,
                source,
            });
        };
        if let Some(p) = explicit {
            let source = if file.contains("hccl") {
                "HP_HCCL_LIB"
            } else {
                "HP_ACL_LIB"
            };
            return vec![Candidate {
                found: p.is_file(),
                path: p.to_path_buf(),
                source,
            }];
        }
        if let Some(d) = &self.toolkit_home {
            push(&d.join("lib64"), "ASCEND_TOOLKIT_HOME");
        }
        if let Some(d) = &self.home_path {
            push(&d.join("lib64"), "ASCEND_HOME_PATH");
        }
        for d in self
            .ld_library_path
            .iter()
            .flat_map(|p| p.split(':'))
            .filter(|d| !d.is_empty())
        {
            push(Path::new(d), "LD_LIBRARY_PATH");
        }
        push(
            Path::new("/usr/local/Ascend/ascend-toolkit/latest/lib64"),
            "default CANN location",
        );
        out
    }
}

/// One place a library was looked for.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub path: PathBuf,
    /// The setting that named this place.
    pub source: &'static str,
    pub found: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "{file} not found; tried {}; set {variable} to the file, or ASCEND_TOOLKIT_HOME / \
         ASCEND_HOME_PATH to a CANN install (source its set_env.sh)",
        list(.tried)
    )]
    NotFound {
        file: &'static str,
        variable: &'static str,
        tried: Vec<Candidate>,
    },
    #[error("cannot open {}: {reason}", .path.display())]
    Open { path: PathBuf, reason: String },
    #[error("{} lacks the required symbol {symbol}", .path.display())]
    MissingSymbol { symbol: &'static str, path: PathBuf },
}

fn list(tried: &[Candidate]) -> String {
    tried
        .iter()
        .map(|c| format!("{} ({})", c.path.display(), c.source))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Both libraries, opened, with every required symbol present.
pub struct Ascend {
    pub acl: AclApi,
    pub hccl: HcclApi,
    pub acl_path: PathBuf,
    pub hccl_path: PathBuf,
    /// Every place looked at, for `hprt info`.
    pub searched: Vec<Candidate>,
}

/// Symbols present only in some CANN releases; the backend works (with less) without them.
pub const OPTIONAL_SYMBOLS: &[&str] = &[
    "aclrtGetVersion",
    "aclrtStreamQuery",
    "aclrtSubscribeReport",
    "aclrtUnSubscribeReport",
    "aclrtLaunchCallback",
    "aclrtProcessReport",
    "HcclGroupStart",
    "HcclGroupEnd",
];

macro_rules! require {
    ($api:expr, $path:expr, $($sym:ident),* $(,)?) => {
        $( if $api.$sym.is_err() {
            return Err(LoadError::MissingSymbol { symbol: stringify!($sym), path: $path.clone() });
        } )*
    };
}

fn open<T>(
    file: &'static str,
    variable: &'static str,
    candidates: Vec<Candidate>,
    searched: &mut Vec<Candidate>,
    open: impl Fn(&Path) -> Result<T, libloading::Error>,
) -> Result<(T, PathBuf), LoadError> {
    searched.extend(candidates.iter().cloned());
    let Some(hit) = candidates.iter().find(|c| c.found) else {
        return Err(LoadError::NotFound {
            file,
            variable,
            tried: candidates,
        });
    };
    let api = open(&hit.path).map_err(|e| LoadError::Open {
        path: hit.path.clone(),
        reason: e.to_string(),
    })?;
    Ok((api, hit.path.clone()))
}

/// [`load_with`] the process environment.
pub fn load() -> Result<Ascend, LoadError> {
    load_with(&SearchEnv::from_process())
}

/// Opens both libraries from the places `env` names and checks the required symbols.
pub fn load_with(env: &SearchEnv) -> Result<Ascend, LoadError> {
    let mut searched = Vec::new();
    let acl_candidates = env.candidates("libascendcl.so", env.acl_lib.as_deref());
    // SAFETY: opening a library runs its initialisers; these are the vendor's (or the emulator's)
    // runtime libraries, loaded exactly as the vendor's own frameworks load them.
    let (acl, acl_path) = open(
        "libascendcl.so",
        "HP_ACL_LIB",
        acl_candidates,
        &mut searched,
        |p| unsafe { AclApi::new(p) },
    )?;
    require!(
        acl,
        acl_path,
        aclInit,
        aclFinalize,
        aclrtSetDevice,
        aclrtResetDevice,
        aclrtGetDevice,
        aclrtGetDeviceCount,
        aclrtCreateStream,
        aclrtDestroyStream,
        aclrtSynchronizeStream,
        aclrtCreateEvent,
        aclrtCreateEventWithFlag,
        aclrtDestroyEvent,
        aclrtRecordEvent,
        aclrtStreamWaitEvent,
        aclrtSynchronizeEvent,
        aclrtQueryEventStatus,
        aclrtEventElapsedTime,
        aclrtMalloc,
        aclrtFree,
        aclrtMallocHost,
        aclrtFreeHost,
        aclrtMemcpy,
        aclrtMemcpyAsync,
        aclrtMemset,
        aclrtMemsetAsync,
        aclrtGetMemInfo,
    );
    let hccl_candidates = env.candidates("libhccl.so", env.hccl_lib.as_deref());
    // SAFETY: as above.
    let (hccl, hccl_path) = open(
        "libhccl.so",
        "HP_HCCL_LIB",
        hccl_candidates,
        &mut searched,
        |p| unsafe { HcclApi::new(p) },
    )?;
    require!(
        hccl,
        hccl_path,
        HcclGetRootInfo,
        HcclCommInitRootInfo,
        HcclCommDestroy,
        HcclAllGather,
        HcclReduceScatter,
        HcclAllReduce,
        HcclBroadcast,
        HcclAlltoAll,
        HcclAlltoAllV,
        HcclSend,
        HcclRecv,
    );
    Ok(Ascend {
        acl,
        hccl,
        acl_path,
        hccl_path,
        searched,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_order_follows_the_documented_list() {
        let env = SearchEnv {
            toolkit_home: Some("/tk".into()),
            home_path: Some("/home".into()),
            ld_library_path: Some("/a::/b".into()),
            ..Default::default()
        };
        let c = env.candidates("libascendcl.so", None);
        let got: Vec<_> = c
            .iter()
            .map(|c| (c.path.to_str().unwrap(), c.source))
            .collect();
        assert_eq!(
            got,
            [
                ("/tk/lib64/libascendcl.so", "ASCEND_TOOLKIT_HOME"),
                ("/home/lib64/libascendcl.so", "ASCEND_HOME_PATH"),
                ("/a/libascendcl.so", "LD_LIBRARY_PATH"),
                ("/b/libascendcl.so", "LD_LIBRARY_PATH"),
                (
                    "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so",
                    "default CANN location"
                ),
            ]
        );
        let explicit = env.candidates("libhccl.so", Some(Path::new("/x/libhccl.so")));
        assert_eq!(explicit.len(), 1);
        assert_eq!(explicit[0].source, "HP_HCCL_LIB");
    }

    #[test]
    fn a_missing_library_names_every_place_tried_and_the_variables() {
        let env = SearchEnv {
            toolkit_home: Some("/nonexistent-tk".into()),
            ld_library_path: Some("/nonexistent-ld".into()),
            ..Default::default()
        };
        let err = load_with(&env).err().expect("no CANN here");
        let msg = err.to_string();
        for needle in [
            "libascendcl.so not found",
            "/nonexistent-tk/lib64/libascendcl.so (ASCEND_TOOLKIT_HOME)",
            "/nonexistent-ld/libascendcl.so (LD_LIBRARY_PATH)",
            "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so",
            "HP_ACL_LIB",
            "ASCEND_TOOLKIT_HOME",
        ] {
            assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
        }
    }

    #[test]
    fn an_explicit_file_that_is_not_a_library_fails_to_open_by_name() {
        let dir = std::env::temp_dir().join(format!("hprt-sys-open-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bogus = dir.join("libascendcl.so");
        std::fs::write(&bogus, b"not an ELF file").unwrap();
        let env = SearchEnv {
            acl_lib: Some(bogus.clone()),
            ..Default::default()
        };
        match load_with(&env) {
            Err(LoadError::Open { path, .. }) => assert_eq!(path, bogus),
            Err(e) => panic!("expected an open error, got {e}"),
            Ok(_) => panic!("a text file loaded as a library"),
        }
    }
}
