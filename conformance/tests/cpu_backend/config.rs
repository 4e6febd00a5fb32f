//! Configuration parsing and platform selection.

use super::*;

#[test]
fn parse_bytes_accepts_documented_forms() {
    assert_eq!(parse_bytes("8G"), Some(8 << 30));
    assert_eq!(parse_bytes("1024"), Some(1024));
    assert_eq!(parse_bytes("12MiB"), Some(12 << 20));
    assert_eq!(parse_bytes("4k"), Some(4 << 10));
    assert_eq!(parse_bytes("2KB"), Some(2 << 10));
    assert_eq!(parse_bytes("1T"), Some(1 << 40));
    assert_eq!(parse_bytes(" 16 M "), Some(16 << 20));
    assert_eq!(parse_bytes("0"), Some(0));
    assert_eq!(parse_bytes("7b"), Some(7));
}

#[test]
fn parse_bytes_rejects_garbage() {
    for s in [
        "",
        "G",
        "abc",
        "12X",
        "-1",
        "1.5G",
        "8 G B",
        "0x10",
        "99999999999999999999999",
    ] {
        assert_eq!(parse_bytes(s), None, "parse_bytes({s:?}) accepted garbage");
    }
    assert_eq!(
        parse_bytes("18446744073709551615T"),
        None,
        "overflow must be None"
    );
}

#[test]
fn config_from_env_reads_this_environment() {
    // Read-only: the variables are whatever this test process was started with.
    let c = CpuConfig::from_env().expect("the HP_CPU_* variables of this run are valid");
    assert!(c.devices >= 1);
    match std::env::var("HP_CPU_JITTER") {
        Ok(v) if !v.trim().is_empty() => assert_eq!(c.jitter, v.trim().parse().ok()),
        _ => assert_eq!(c.jitter, None),
    }
    let d = CpuConfig::default();
    assert_eq!((d.devices, d.jitter, d.pinned_memory), (1, None, None));
    assert!(d.device_memory > 0);
}

#[test]
fn platform_request_parsing_and_selection() {
    // Which accelerator backends load depends on the machine (none in CI, cuda on a GPU box):
    // a forced one is that backend or a typed Unavailable error, and auto picks the first that
    // loads, in the order cuda, npu, cpu.
    let mut first_available = None;
    for (value, backend) in [("cuda", BackendKind::Cuda), ("npu", BackendKind::Npu)] {
        let req = PlatformRequest::parse(Some(value)).unwrap();
        assert_eq!(req, PlatformRequest::Forced(backend));
        match select_platform(req) {
            Ok(s) => {
                assert_eq!(s.platform.backend(), backend);
                first_available.get_or_insert(backend);
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                assert!(!e.message.is_empty());
            }
        }
    }
    let e = PlatformRequest::parse(Some("bogus")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidValue);
    for name in ["cpu", "cuda", "npu"] {
        assert!(
            e.message.contains(name),
            "the error does not list {name}: {e}"
        );
    }
    for value in [None, Some("auto"), Some(""), Some(" AUTO ")] {
        assert_eq!(
            PlatformRequest::parse(value).unwrap(),
            PlatformRequest::Auto,
            "{value:?}"
        );
    }
    assert_eq!(
        PlatformRequest::parse(Some("CPU")).unwrap(),
        PlatformRequest::Forced(BackendKind::Cpu)
    );
    // A name a program passes (C ABI, Python) is exact: no guessing at "" or "CPU ".
    for name in ["", "CPU ", "CPU", " cpu", "Auto", "bogus"] {
        let e = PlatformRequest::parse_name(name).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidValue, "{name:?}");
    }
    for (name, want) in [
        ("auto", PlatformRequest::Auto),
        ("cpu", PlatformRequest::Forced(BackendKind::Cpu)),
        ("npu", PlatformRequest::Forced(BackendKind::Npu)),
    ] {
        assert_eq!(PlatformRequest::parse_name(name).unwrap(), want);
    }
    let auto = select_platform(PlatformRequest::Auto).unwrap_or_else(|e| panic!("auto: {e}"));
    assert_eq!(
        auto.platform.backend(),
        first_available.unwrap_or(BackendKind::Cpu)
    );
    assert!(!auto.reason.is_empty());
    let forced = select_platform(PlatformRequest::Forced(BackendKind::Cpu))
        .unwrap_or_else(|e| panic!("cpu: {e}"));
    assert_eq!(forced.platform.backend(), BackendKind::Cpu);
}
