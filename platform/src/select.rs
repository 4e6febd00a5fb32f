//! Run-time backend selection: `HP_PLATFORM`, auto-detection, and the process-wide platform.

use std::sync::OnceLock;

use crate::cpu::CpuBackend;
use crate::cuda::CudaBackend;
use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::npu::NpuBackend;
use crate::platform::Platform;

/// What `HP_PLATFORM` asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlatformRequest {
    Auto,
    Forced(BackendKind),
}

impl PlatformRequest {
    /// Parses a value of `HP_PLATFORM` (`None`, empty or `auto` = auto-detect).
    pub fn parse(value: Option<&str>) -> Result<Self> {
        let v = value
            .map(|v| v.trim().to_ascii_lowercase())
            .unwrap_or_default();
        if v.is_empty() || v == "auto" {
            return Ok(PlatformRequest::Auto);
        }
        v.parse::<BackendKind>()
            .map(PlatformRequest::Forced)
            .map_err(|_| {
                Error::new(
                    ErrorKind::InvalidValue,
                    BackendKind::Cpu,
                    "get_platform",
                    format!("HP_PLATFORM={v:?} is not a backend; valid values: cpu, cuda, npu (or unset / auto to detect)"),
                )
            })
    }

    /// Parses a backend name given by a program (the C ABI's and Python's `open`): exactly
    /// `auto`, `cpu`, `cuda` or `npu`. Unlike the environment variable, an empty or padded name
    /// is an error rather than a guess.
    pub fn parse_name(name: &str) -> Result<Self> {
        if name == "auto" || name.parse::<BackendKind>().is_ok() {
            return Self::parse(Some(name));
        }
        Err(Error::new(
            ErrorKind::InvalidValue,
            BackendKind::Cpu,
            "open_platform",
            format!("{name:?} is not a backend name; valid names: auto, cpu, cuda, npu"),
        ))
    }

    pub fn from_env() -> Result<Self> {
        Self::parse(std::env::var("HP_PLATFORM").ok().as_deref())
    }
}

/// A selected platform and the reason it was chosen (what `hprt info` prints).
pub struct Selection {
    pub platform: Box<dyn Platform>,
    pub reason: String,
}

fn open(kind: BackendKind) -> Result<Box<dyn Platform>> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(CpuBackend::from_env()?)),
        BackendKind::Cuda => Ok(Box::new(CudaBackend::open()?)),
        BackendKind::Npu => Ok(Box::new(NpuBackend::open()?)),
    }
}

/// Builds the platform `request` names (a new value each call; see [`get_platform`] for the
/// process-wide one).
pub fn select_platform(request: PlatformRequest) -> Result<Selection> {
    match request {
        PlatformRequest::Forced(kind) => {
            let platform = open(kind)?;
            tracing::info!(backend = %kind, "platform forced by HP_PLATFORM");
            Ok(Selection {
                platform,
                reason: format!("HP_PLATFORM={kind}"),
            })
        }
        PlatformRequest::Auto => {
            let mut skipped = Vec::new();
            for kind in [BackendKind::Cuda, BackendKind::Npu] {
                match open(kind) {
                    Ok(platform) => {
                        let reason = format!("auto-detected {kind}");
                        tracing::info!(backend = %kind, "platform auto-detected");
                        return Ok(Selection { platform, reason });
                    }
                    Err(e) => {
                        let why = e.message;
                        tracing::info!(backend = %kind, reason = %why, "backend skipped");
                        skipped.push(format!("{kind} {why}"));
                    }
                }
            }
            let platform = open(BackendKind::Cpu)?;
            tracing::info!(
                backend = "cpu",
                "no accelerator backend available; using cpu"
            );
            Ok(Selection {
                platform,
                reason: format!(
                    "auto: no accelerator backend available ({})",
                    skipped.join("; ")
                ),
            })
        }
    }
}

static PLATFORM: OnceLock<Result<(&'static dyn Platform, String)>> = OnceLock::new();

fn init() -> &'static Result<(&'static dyn Platform, String)> {
    PLATFORM.get_or_init(|| {
        let s = select_platform(PlatformRequest::from_env()?)?;
        Ok((Box::leak(s.platform), s.reason))
    })
}

/// The process-wide platform, chosen once from `HP_PLATFORM` (see the crate docs).
///
/// The platform is a singleton because drivers are (one CUDA context, one `aclInit` per process);
/// tests that need their own cpu platform create a [`CpuBackend`] value instead.
pub fn get_platform() -> Result<&'static dyn Platform> {
    init().as_ref().map(|(p, _)| *p).map_err(Clone::clone)
}

/// Why [`get_platform`] chose what it chose.
pub fn platform_selection_reason() -> Result<&'static str> {
    init()
        .as_ref()
        .map(|(_, r)| r.as_str())
        .map_err(Clone::clone)
}
