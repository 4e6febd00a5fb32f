//! What a platform says about itself (`hprt info`).

use crate::error::BackendKind;

/// One device a platform can use.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub total_memory: usize,
}

/// One place a backend looked for a driver library.
#[derive(Clone, Debug)]
pub struct LibraryProbe {
    pub path: String,
    pub found: bool,
}

/// A platform's description of itself.
#[derive(Clone, Debug)]
pub struct PlatformInfo {
    pub backend: BackendKind,
    pub devices: Vec<DeviceInfo>,
    /// Driver / runtime version, or a description of the reference implementation.
    pub driver: String,
    pub libraries: Vec<LibraryProbe>,
    /// Settings in effect (name, value), e.g. the cpu backend's capacity and jitter seed.
    pub settings: Vec<(String, String)>,
}
