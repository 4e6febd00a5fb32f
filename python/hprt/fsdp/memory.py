"""How torch sees hprt's memory differs by backend (views on the cpu backend, copies through pinned
memory on the emulators, torch's own device tensors on hardware); one object per rank hides the
difference, so that parameters, gradients and state dicts move bytes without asking which
backend runs."""

import torch

import hprt


class _SharedMemory:
    """The cpu backend: hprt's device memory is host memory, so the shards, the gathered
    parameters and the sharded gradients are torch tensors *over* hprt's memory (DLPack views),
    and torch's gradients are reduced in place (DLPack import). No copies."""

    name = "shared"

    def __init__(self, platform):
        self.platform = platform

    def compute_stream(self):
        return None  # hprt's own: torch computes on the host

    def host_wait(self, streams):
        streams.compute.synchronize()  # torch reads on the host what the stream wrote

    def shard(self, sp, streams):
        return torch.from_dlpack(sp.sharded_data()), None

    def upload_shard(self, p):
        pass  # the shard torch updates is hprt's

    def upload_grad(self, p):
        pass  # so is the sharded gradient

    def gathered(self, p):
        return torch.from_dlpack(p.sp.unsharded())

    def hprt_input(self, t, streams):
        return t  # borrowed through DLPack

    def sharded_grad(self, p):
        return torch.from_dlpack(p.sp.sharded_grad())


class _CopiedMemory:
    """torch's tensors are torch's own memory and hprt's are hprt's; bytes move between them by
    stream-ordered copies on hprt's compute stream (``Platform.copy``): torch's shard into hprt's
    before each all-gather, the gathered parameters after each all-gather, each gradient before
    its reduction, the sharded gradient after the reductions (and torch's ``.grad`` back before
    a reduction adds to it). Under ``CPUOffloadPolicy`` the shards and sharded gradients are
    pinned host memory, which torch reads directly. Two kinds:

    * ``_StagedMemory`` — the **staging path**, for the Ascend emulator and the CUDA emulator:
      their device memory is the emulator's and torch runs on CPU tensors, so torch's side is
      pinned host memory and the copies are D2H / H2D followed by a host wait. It exists so the
      whole flow runs (bit-exact, under the emulators' delays) in CI; it is not the hardware
      path.
    * ``_DeviceMemory`` — **hardware** (torch CUDA tensors on the cuda backend, torch_npu
      ``device.type == "npu"`` tensors on the npu backend): torch allocates, hprt wraps the
      pointer (``Platform.unsafe_wrap_device_memory`` with the tensor as owner), the copies are D2D
      on hprt's compute stream, which *is* torch's current stream, so nothing waits on the
      host. Its copies and borrowed memory are checked bit-exact on the cpu backend
      (``_HostDeviceMemory``); the stream ordering has not run on hardware.
    """

    def __init__(self, platform):
        self.platform = platform

    def _copy(self, dst, src, streams, nbytes):
        """``src`` and ``dst``: (buffer, byte offset)."""
        self.platform.copy(dst[0], src[0], streams.compute, nbytes=nbytes, dst_offset=dst[1], src_offset=src[1])

    def shard(self, sp, streams):
        dev = sp.sharded_device_tensor()
        if dev is None:  # offloaded: pinned host memory
            return torch.from_dlpack(sp.sharded_data()), None
        t, buf = self.alloc(sp.shard_shape, _torch_dtype(sp.dtype))
        self._copy((buf, 0), (dev.buffer, dev.offset), streams, dev.nbytes)
        self.host_wait(streams)
        return t, buf

    def upload_shard(self, p):
        """Copies the shard torch holds into hprt's before an all-gather reads it: torch may
        have changed it (optimizer step, state dict load), also through ``.data``, which no
        version counter sees, so it is copied every time (1/N of the parameter)."""
        if p.shard_buf is not None:
            dev = p.sp.sharded_device_tensor()
            self._copy((dev.buffer, dev.offset), (p.shard_buf, 0), p.state.streams, dev.nbytes)
            self.host_wait(p.state.streams)  # torch may change it again once we return

    def upload_grad(self, p):
        """Copies torch's ``.grad`` of the shard into hprt's sharded gradient before a
        reduction adds to it: torch may have changed it in place (``zero_grad(set_to_none=
        False)``, gradient clipping)."""
        if p.grad_t is not None and p.sharded.grad is p.grad_t:
            dev = p.sp.sharded_grad_device_tensor()
            self._copy((dev.buffer, dev.offset), (p.grad_buf, 0), p.state.streams, dev.nbytes)
            self.host_wait(p.state.streams)

    def gathered(self, p):
        src = p.sp.unsharded()
        t, buf = self.alloc(p.shape, p.param_dtype)
        self._copy((buf, 0), (src.buffer, src.offset), p.state.streams, src.nbytes)
        return t  # usable after host_wait

    def hprt_input(self, t, streams):
        """A ``DeviceTensor`` holding ``t`` (a gradient, or a parameter to shard), kept alive
        by hprt as long as it reads it."""
        return self.to_device(t.contiguous(), streams)

    def sharded_grad(self, p):
        dev = p.sp.sharded_grad_device_tensor()
        if dev is None:  # offloaded: pinned host memory
            return torch.from_dlpack(p.sp.sharded_grad())
        if p.grad_t is None or p.sharded.grad is not p.grad_t:
            p.grad_t, p.grad_buf = self.alloc(p.sp.shard_shape, _torch_dtype(p.sp.dtype))
        self._copy((p.grad_buf, 0), (dev.buffer, dev.offset), p.state.streams, dev.nbytes)
        self.host_wait(p.state.streams)
        return p.grad_t


class _StagedMemory(_CopiedMemory):
    __doc__ = "The staging path (emulators): see ``_CopiedMemory``."
    name = "staging"

    def compute_stream(self):
        return None

    def host_wait(self, streams):
        streams.compute.synchronize()

    def alloc(self, shape, dtype):
        """A CPU torch tensor over a new pinned host buffer, and the buffer."""
        shape = list(shape)
        n = 1
        for d in shape:
            n *= d
        buf = self.platform.alloc_pinned(max(n, 1) * torch.empty((), dtype=dtype).element_size())
        t = torch.from_dlpack(buf.view(str(dtype), shape))
        return t, buf

    def to_device(self, t, streams):
        staged, pinned = self.alloc(t.shape, t.dtype)
        staged.copy_(t)
        dev = self.platform.alloc_device(pinned.nbytes)
        self.platform.copy(dev, pinned, streams.compute)
        # The H2D copy is queued; the pinned buffer must outlive it.
        streams.compute.synchronize()
        return hprt.DeviceTensor(dev, str(t.dtype), list(t.shape))


class _DeviceMemory(_CopiedMemory):
    __doc__ = "The hardware path (torch sees the platform's device): see ``_CopiedMemory``."
    name = "device"

    def __init__(self, platform, device_type):
        super().__init__(platform)
        self.device_type = device_type

    def _torch_module(self):
        return getattr(torch, self.device_type)  # torch.cuda, or torch.npu with torch_npu

    def device(self):
        return torch.device(self.device_type, self.platform.current_device())

    def _torch_stream(self):
        s = self._torch_module().current_stream(self.device())
        return s.cuda_stream if self.device_type == "cuda" else s.npu_stream

    def compute_stream(self):
        # torch's own live stream: the unchecked wrap is sound (torch keeps it alive).
        return self.platform.unsafe_wrap_stream(self._torch_stream())

    def host_wait(self, streams):
        self._check_stream(streams)  # torch's stream is hprt's compute stream: ordered

    def _check_stream(self, streams):
        """Every copy and wait relies on torch computing on the stream hprt wrapped."""
        if self._torch_stream() != streams.compute.raw:
            raise hprt.UnsupportedError(
                f"fully_shard on {self.device_type}: torch's current stream is not the one "
                "hprt ordered its work on (the current stream when the mesh was made); "
                "changing streams around fully_shard modules is not supported"
            )

    def alloc(self, shape, dtype):
        t = torch.empty(tuple(shape), dtype=dtype, device=self.device())
        return t, self.platform.unsafe_wrap_device_memory(t.data_ptr(), t.numel() * t.element_size(), t)

    def to_device(self, t, streams):
        self._check_stream(streams)
        if t.device.type == "cpu":
            t = t.to(self.device())  # a module built on the host, as FSDP2 moves it
        elif t.device != self.device():
            raise ValueError(f"a tensor on {t.device}: fully_shard computes on {self.device()}")
        buf = self.platform.unsafe_wrap_device_memory(t.data_ptr(), t.numel() * t.element_size(), t)
        return hprt.DeviceTensor(buf, str(t.dtype), list(t.shape))


class _HostDeviceMemory(_DeviceMemory):
    """``_DeviceMemory`` on the cpu backend (torch's host tensors are the device's memory):
    the hardware path's torch-allocated tensors, borrowed torch gradients and copies, checked
    bit-exact in CI (test_fsdp). Only the ordering differs: torch computes on the host, not on
    a stream, so hprt keeps its own compute stream and the host waits for it."""

    name = "device-on-host"

    def __init__(self, platform):
        super().__init__(platform, "cpu")

    def device(self):
        return torch.device("cpu")

    def compute_stream(self):
        return None

    def host_wait(self, streams):
        streams.compute.synchronize()

    def _check_stream(self, streams):
        pass


def _torch_memory(platform):
    """How torch sees ``platform``'s memory (see ``_CopiedMemory``), from what the platform can
    do: shared where its device memory is host memory (the cpu backend); torch's own device
    tensors where torch has the device type that addresses it (cuda, or npu through torch_npu:
    real hardware); else the staging path (the emulators, whose memory torch cannot address)."""
    caps = platform.capabilities
    if caps.device_memory_is_host:
        return _SharedMemory(platform)
    device = caps.framework_device
    mod = getattr(torch, device, None) if device else None  # torch.npu once torch_npu is imported
    if mod is not None and mod.is_available():
        return _DeviceMemory(platform, device)
    return _StagedMemory(platform)


def _torch_dtype(name):
    return _DTYPES[name]


_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}
