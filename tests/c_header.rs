//! include/hprt.h is what cbindgen generates from src/ffi: this test fails when they drift.
//! `HP_BLESS=1 cargo test --test c_header` rewrites the header.

use std::path::Path;

#[test]
fn header_matches_the_c_abi() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8 header");
    let path = root.join("include/hprt.h");
    if std::env::var_os("HP_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/hprt.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/hprt.h is stale: run `HP_BLESS=1 cargo test --test c_header` and commit it"
    );
}
