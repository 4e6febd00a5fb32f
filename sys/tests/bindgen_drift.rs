//! The committed bindings in `src/generated/` must be exactly what bindgen makes of
//! `include/hprt_ascend.h`. `HP_BLESS=1 cargo test -p hprt-sys --test bindgen_drift` rewrites them
//! after a deliberate header change. Needs libclang (CI installs libclang-dev).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn builder() -> bindgen::Builder {
    let header = root().join("include/hprt_ascend.h");
    bindgen::Builder::default()
        .header(header.to_str().expect("utf-8 path"))
        .formatter(bindgen::Formatter::Prettyplease)
        .layout_tests(true)
        .derive_default(true)
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
}

/// (file, bindings): shared types and constants, then one function table per library.
fn generate() -> Vec<(&'static str, String)> {
    let types = builder()
        .allowlist_type("acl.*|Hccl.*")
        .allowlist_var("ACL_.*|HCCL_.*")
        .generate()
        .expect("bindgen types");
    let table = |pattern: &str, name: &str| {
        builder()
            .allowlist_function(pattern)
            .allowlist_recursively(false)
            .dynamic_library_name(name)
            .dynamic_link_require_all(false)
            .generate()
            .expect("bindgen function table")
            .to_string()
            // bindgen 0.72 writes the libloading 0.8 bound; libloading 0.9 (the one version
            // the workspace shares with cudarc) takes filenames through `AsFilename`.
            .replace(
                "P: AsRef<::std::ffi::OsStr>,",
                "P: ::libloading::AsFilename,",
            )
    };
    vec![
        ("types.rs", types.to_string()),
        ("acl.rs", table("acl.*", "AclApi")),
        ("hccl.rs", table("Hccl.*", "HcclApi")),
    ]
}

#[test]
fn committed_bindings_match_the_header() {
    let dir = root().join("src/generated");
    let bless = std::env::var_os("HP_BLESS").is_some();
    let mut drift = Vec::new();
    for (file, fresh) in generate() {
        let path: &Path = &dir.join(file);
        if bless {
            std::fs::write(path, &fresh).expect("write bindings");
            continue;
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        if committed != fresh {
            drift.push(file);
        }
    }
    assert!(
        drift.is_empty(),
        "bindings in sys/src/generated/ drifted from include/hprt_ascend.h: {drift:?}; \
         regenerate with `HP_BLESS=1 cargo test -p hprt-sys --test bindgen_drift`"
    );
}
