//! `hprt decompress` on untrusted files: a decoded-size bomb is refused with a typed message
//! and exit status 1 (not a signal), within the caller's `--max-output`; a valid file under the
//! limit still decodes.

use std::path::Path;
use std::process::Command;

use hprt_compress::format::{constant_encoding, MAX_CHUNK_ELEMS};
use hprt_compress::CodecDType;

/// `hprt decompress --max-output LIMIT IN OUT`.
fn decompress(limit: &str, input: &Path, output: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hprt"))
        .args(["decompress", "--max-output", limit])
        .arg(input)
        .arg(output)
        .env("HP_PLATFORM", "cpu")
        .output()
        .expect("run hprt")
}

#[test]
fn decompress_refuses_a_decoded_size_bomb_above_max_output() {
    let dir = std::env::temp_dir().join(format!("hprt-cli-codec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (bomb, out) = (dir.join("bomb.hprz"), dir.join("bomb.out"));
    // 8,040 bytes declaring 25 GiB: 400 constant f32 chunks of 2^24 elements.
    let enc = constant_encoding(CodecDType::F32, MAX_CHUNK_ELEMS, 400 << 24, false);
    assert_eq!(enc.len(), 8040);
    std::fs::write(&bomb, &enc).unwrap();
    let r = decompress("1073741824", &bomb, &out);
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("declares 26843545600 output bytes, above the limit of 1073741824"),
        "{stderr}"
    );
    assert!(!out.exists(), "no output file for a refused input");

    // A valid file of the same kind under the limit decodes to what it declares.
    let small = constant_encoding(CodecDType::BF16, 1 << 10, 5000, true);
    std::fs::write(&bomb, &small).unwrap();
    let r = decompress("10000", &bomb, &out);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(std::fs::read(&out).unwrap(), vec![0u8; 10_000]);
    let r = decompress("9999", &bomb, &out);
    assert_eq!(r.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}
