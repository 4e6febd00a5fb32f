//! What a platform can do, as the layers above it need to know it ([`Platform::capabilities`]).
//!
//! Code above the platform layer (swap, compress, hsdp, the bindings, `hprt.torch`) branches on
//! these facts, never on a backend's name or on whether a driver is an emulator: each backend
//! reports them, and only the backend itself knows whether its driver is the Ascend or CUDA
//! emulator (the driver library exports the emulator's control entry points).
//!
//! [`Platform::capabilities`]: crate::Platform::capabilities

/// Facts about one platform value that decide how the layers above use it.
///
/// | field | cpu | cuda | cuda (emulator) | npu | npu (emulator) |
/// | --- | --- | --- | --- | --- | --- |
/// | `device_memory_is_host` | true | false | false | false | false |
/// | `framework_device` | `"cpu"` | `"cuda"` | none | `"npu"` | none |
/// | `host_stream` | true | false | false | false | false |
/// | `kernel_compiler` | false | NVRTC loaded | NVRTC loaded | false | false |
/// | `ranks_are_threads` | true | false | true | false | true |
/// | `ranks_share_device` | true | false | false | false | false |
/// | `configurable_devices` | true | false | false | false | false |
/// | `checked_stream_handles` | true | false | false | false | false |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Capabilities {
    /// Device memory is plain host memory: a device pointer is a host address the CPU may read
    /// and write (so DLPack names it `kDLCPU`, and torch views it as a CPU tensor).
    pub device_memory_is_host: bool,
    /// The framework device type (torch's `device.type`) whose tensors live in this platform's
    /// device memory, so hprt can borrow them without a copy: `"cpu"` on the cpu backend,
    /// `"cuda"` on CUDA, `"npu"` on Ascend (torch_npu). `None` where no framework device
    /// addresses it: on the emulators a framework computes on host tensors, which hprt stages
    /// into (copies to and from) the emulator's device memory.
    pub framework_device: Option<&'static str>,
    /// Raw stream 0 ([`crate::RawStream`]) wraps the host's own stream: work queued on it runs
    /// in the calling thread, and a wait on it blocks the caller (the cpu backend). Elsewhere
    /// streams are the driver's and a host thread's work needs a stream of its own.
    pub host_stream: bool,
    /// The platform compiles device kernels from source at run time
    /// ([`crate::DeviceModule`], CUDA C through NVRTC), so the device codec runs on the device.
    pub kernel_compiler: bool,
    /// All ranks of one world are threads of this process: a communicator cannot span
    /// processes (the cpu backend, and the emulators' collectives).
    pub ranks_are_threads: bool,
    /// Several ranks of one world may use the same device (NCCL and HCCL refuse two ranks on
    /// one device).
    pub ranks_share_device: bool,
    /// The devices are hprt's own: a platform with any number of them (and a capacity) can be
    /// made in-process (`CpuBackend` / `hprt.cpu_platform(devices=n)`).
    pub configurable_devices: bool,
    /// A raw stream handle handed to [`crate::Platform::wrap_external_stream`] is checked
    /// against the backend's own streams (the cpu backend's registry), so a wrong one is an
    /// error; a driver's handle (`CUstream`, `aclrtStream`) is a pointer nothing can check.
    pub checked_stream_handles: bool,
}

impl Capabilities {
    /// The cpu reference backend's.
    pub const CPU: Capabilities = Capabilities {
        device_memory_is_host: true,
        framework_device: Some("cpu"),
        host_stream: true,
        kernel_compiler: false,
        ranks_are_threads: true,
        ranks_share_device: true,
        configurable_devices: true,
        checked_stream_handles: true,
    };

    /// A driver backend's: `framework_device` is the framework's name for its devices, `None`
    /// (with ranks as threads) when its driver is an emulator.
    pub(crate) fn driver(
        framework_device: &'static str,
        emulated: bool,
        kernel_compiler: bool,
    ) -> Capabilities {
        Capabilities {
            device_memory_is_host: false,
            framework_device: (!emulated).then_some(framework_device),
            host_stream: false,
            kernel_compiler,
            ranks_are_threads: emulated,
            ranks_share_device: false,
            configurable_devices: false,
            checked_stream_handles: false,
        }
    }

    /// Each field's name and value (`framework_device` as its name or ""), in declaration order:
    /// the one list the Python and C bindings export.
    pub fn fields(&self) -> [(&'static str, CapabilityValue); 8] {
        use CapabilityValue::{Flag, Name};
        [
            ("device_memory_is_host", Flag(self.device_memory_is_host)),
            ("framework_device", Name(self.framework_device)),
            ("host_stream", Flag(self.host_stream)),
            ("kernel_compiler", Flag(self.kernel_compiler)),
            ("ranks_are_threads", Flag(self.ranks_are_threads)),
            ("ranks_share_device", Flag(self.ranks_share_device)),
            ("configurable_devices", Flag(self.configurable_devices)),
            ("checked_stream_handles", Flag(self.checked_stream_handles)),
        ]
    }
}

/// One value of [`Capabilities::fields`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapabilityValue {
    Flag(bool),
    Name(Option<&'static str>),
}

/// Whether the driver library at `path` is one of hprt's emulators (`tests/ascend-emulator`,
/// `tests/cuda-emulator`): they export `hprtEmuSetFaults`, which no vendor library has. The
/// library is already loaded by the backend, so this only looks the symbol up.
pub(crate) fn is_emulator(lib: &libloading::Library) -> bool {
    // SAFETY: only the symbol's presence is checked; it is never called.
    unsafe { lib.get::<unsafe extern "C" fn()>(b"hprtEmuSetFaults\0") }.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuBackend, CpuConfig, Platform};

    #[test]
    fn the_cpu_backend_reports_its_capabilities() {
        let p = CpuBackend::new(CpuConfig::default());
        let c = p.capabilities();
        assert_eq!(c, Capabilities::CPU);
        assert!(c.device_memory_is_host && c.host_stream && c.configurable_devices);
        assert!(c.ranks_are_threads && c.ranks_share_device && !c.kernel_compiler);
        assert_eq!(c.framework_device, Some("cpu"));
    }

    #[test]
    fn a_real_driver_has_a_framework_device_and_ranks_in_processes() {
        let c = Capabilities::driver("cuda", false, true);
        assert_eq!(c.framework_device, Some("cuda"));
        assert!(!c.ranks_are_threads && !c.ranks_share_device && c.kernel_compiler);
        assert!(!c.device_memory_is_host && !c.host_stream && !c.configurable_devices);
    }

    #[test]
    fn fields_list_every_capability_by_name() {
        let names: Vec<_> = Capabilities::CPU.fields().iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "device_memory_is_host",
                "framework_device",
                "host_stream",
                "kernel_compiler",
                "ranks_are_threads",
                "ranks_share_device",
                "configurable_devices",
                "checked_stream_handles",
            ]
        );
        assert_eq!(
            Capabilities::CPU.fields()[1].1,
            CapabilityValue::Name(Some("cpu"))
        );
    }
}
