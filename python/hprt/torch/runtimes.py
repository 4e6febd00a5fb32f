"""What every mode needs of its platform, kept once per platform rather than per front end
(``Runtime``): which torch tensors and streams the backend takes, the accounting of the torch
memory hprt holds, the front ends made for it and their counters. Also the torch side of which
saved tensors may be swapped at all (``is_swappable``)."""

import time
import weakref

import torch
from torch import nn

import hprt
# This package: tests and benchmarks patch ``_stream_recorder`` and ``_empty_like_layout`` on
# ``hprt.torch``, so they are called through it.
from hprt import torch as _ht

from .memory import _HPRT_DTYPES, _Allocate, _is_dense, _platform_empty


_CUMULATIVE = ("offloaded_tensors", "offloaded_bytes", "reloaded_tensors", "reloaded_bytes",
               "link_d2h_bytes", "link_h2d_bytes", "compressed_tensors", "compressed_bytes",
               "codec_ns", "handed_back_tensors", "offload_window_waits", "prefetches_deferred")
_COUNTERS = _CUMULATIVE + ("pinned_bytes_in_use", "pinned_bytes_held", "offload_inflight_bytes",
                           "reload_inflight_bytes")
# Each front end's own high-water marks (the largest is reported).
_PEAKS = ("offload_inflight_peak", "reload_inflight_peak")


def _device_type(device):
    """``"npu"`` of ``"npu:1"`` or of a device object (without parsing: "npu" is torch's only
    once torch_npu is imported)."""
    return getattr(device, "type", None) or str(device).split(":")[0]


# torch's boolean attribute for a tensor on a backend's device type (read for every saved
# tensor: ``t.device`` would build a device object each time); npu's comes with torch_npu.
_DEVICE_FLAG = {"cpu": "is_cpu", "cuda": "is_cuda"}

# Backends whose tensors torch runs on a stream of its own, and the raw handle's attribute.
_STREAM_ATTR = {"cuda": "cuda_stream", "npu": "npu_stream"}


def _torch_device_type(platform):
    """torch's device type for a platform's device memory: the tensors a runtime on it takes and
    hands back, and whose torch machinery (streams, events, ``record_stream``) it uses. hprt's
    backends carry torch's names for the devices they drive (cpu, cuda, npu; on hardware the
    same as ``capabilities.framework_device``). The emulators keep the name of the device they
    stand for although torch addresses none of their memory: a runtime there takes only tests'
    stand-in tensors (``test_host_ahead``: torch on a GPU, over the CUDA emulator). The one place
    hprt.torch relates a platform to torch's names; behaviour follows the device type, a
    torch-side fact, never the backend."""
    return platform.backend


def _cpu_tensor_stream(platform):
    """The stream CPU tensors' compute stands on: on the cpu backend the host's own stream (raw
    stream 0: torch's CPU ops are done when they return, a wait on it blocks the host); elsewhere
    an idle stream of hprt's (other backends never take CPU tensors)."""
    return platform.wrap_stream(0) if platform.capabilities.host_stream else platform.create_stream()


class Runtime:
    """hprt's side of the integration for one platform: the framework-memory accounting, the
    front ends it made, and the compute stream standing for torch's. On the cpu backend that is
    the host's own stream (raw stream 0): torch's CPU ops are done when they return, so a mark
    recorded on it is reached at once, and making it wait for a reload blocks the host until
    the bytes are back, before torch reads them (one wait, in the calling thread)."""

    def __init__(self, platform=None, host_budget=None, compression="off",
                 max_inflight_offload_bytes=None, max_inflight_reload_bytes=None):
        self.platform = platform if platform is not None else hprt.get_platform()
        self.memory = hprt.FrameworkMemory(self.platform,
                                           record_stream=_ht._stream_recorder(self.device_type))
        self.host_budget, self.compression = host_budget, compression
        self.window = dict(max_inflight_offload_bytes=max_inflight_offload_bytes,
                           max_inflight_reload_bytes=max_inflight_reload_bytes)
        self.layers = hprt.SwapManager(self.platform, host_budget=host_budget,
                                       compression=compression, **self.window)
        # hprt streams wrapping torch's (raw handle -> Stream): one per torch stream, not one
        # per call (each saved tensor asks for it).
        self._wrapped = {}
        self._link_gbps = None
        # Each module's layer group in ``layers``, kept across attaches (a new one per attach
        # would grow the Rust manager with every attach / detach).
        self._layer_slots = weakref.WeakKeyDictionary()
        self._fronts = [self.layers]
        # Front ends of detached ``attach`` handles, let go once no pass of theirs is alive;
        # their cumulative counters stay in ``stats()``.
        self._retiring, self._retired = [], dict.fromkeys(_CUMULATIVE, 0)
        self._host_stream = _cpu_tensor_stream(self.platform)

    @property
    def platform(self):
        return self._platform

    @platform.setter
    def platform(self, platform):
        # Read for every saved tensor: kept here, not asked of hprt.
        self._platform, self.backend = platform, platform.backend
        self.device_type = _torch_device_type(platform)
        self._device_flag = _DEVICE_FLAG.get(self.device_type)

    def retire(self, front, flow):
        """Forgets ``front`` (a front end this runtime made for an ``attach`` handle now
        detached) once ``flow`` follows no live pass: its copy streams end with it, and its
        counters stay in ``stats()``."""
        self._retiring.append((front, flow))
        self._let_go_of_retired()

    def _let_go_of_retired(self):
        alive = []
        for front, flow in self._retiring:
            flow.settle()
            if flow.current is not None:  # a graph of its pass is alive: keep it counted
                alive.append((front, flow))
                continue
            fs = front.stats()
            for k in _CUMULATIVE:
                self._retired[k] += fs.get(k, 0)
            self._fronts = [f for f in self._fronts if f is not front]
        self._retiring = alive

    def new_keyed(self):
        self._let_go_of_retired()
        k = hprt.KeyedSwap(self.platform, host_budget=self.host_budget,
                           compression=self.compression, **self.window)
        self._fronts.append(k)
        return k

    def new_pipeline(self):
        self._let_go_of_retired()
        off = hprt.PipelineOffload(self.platform, min_tensor_elems=1, host_budget=self.host_budget,
                                   compression=self.compression, **self.window)
        self._fronts.append(off)
        return off

    def compute_stream(self, device=None):
        """torch's current stream (of ``device``, or of the current device) as an hprt stream:
        ``torch.cuda.current_stream().cuda_stream`` on the cuda backend,
        ``torch.npu.current_stream().npu_stream`` (torch_npu's ``aclrtStream``) on the npu one."""
        kind = self.device_type
        if kind in _STREAM_ATTR and (device is None or _device_type(device) == kind):
            raw = getattr(getattr(torch, kind).current_stream(device), _STREAM_ATTR[kind])
            s = self._wrapped.get(raw)
            if s is None:
                # torch's own live stream: the unchecked wrap is sound (torch keeps it alive).
                s = self._wrapped[raw] = self.platform.unsafe_wrap_stream(raw)
            return s
        # CPU tensors: torch's work is done when its call returns (see the class docs).
        return self._host_stream

    def addressable(self, t):
        """Whether this platform's device memory holds ``t`` (cpu backend: CPU tensors; cuda:
        CUDA tensors; npu: torch_npu's NPU tensors)."""
        on = getattr(t, self._device_flag, None) if self._device_flag else None
        return on if on is not None else _device_type(t.device) == self.device_type

    def borrow(self, t):
        """``t`` as a borrowed swap payload whose reload makes a tensor of its shape, strides and
        storage offset. hprt holds ``t.detach()``: the same memory, but not ``t``'s autograd node,
        which holds what the pack hook returned (a cycle no collector sees through)."""
        return self.memory.tensor(t.detach(), _Allocate(t, self), _HPRT_DTYPES.get(t.dtype, "u8"))

    def empty_layout(self, layout, device):
        """A new tensor of ``layout`` (``_layout``) on ``device`` for a reload: from the cpu
        platform's device memory on the cpu backend (its caching allocator, see
        ``_host_reload``), from torch's allocator elsewhere. The only difference between the
        backends' reload paths."""
        shape, stride, offset, dtype, _ = layout
        if self.platform.capabilities.device_memory_is_host:
            return _platform_empty(self.platform, shape, stride, offset, dtype)
        return _ht._empty_like_layout(shape, stride, offset, dtype, device)

    def handed_out(self, t):
        """What a reload's allocator gives hprt for ``t``, torch memory it just allocated. On an
        accelerator torch's caching allocator hands a block out in the order of the current
        stream: a block freed by kernels still queued there is handed out again at once. ``t``
        goes with that stream (``(t, stream)``), whose queued work hprt's copy waits for before
        writing the block; torch's CPU memory is free when allocated."""
        if self.platform.capabilities.device_memory_is_host:
            return t
        return t, self.compute_stream(t.device)

    def stats(self):
        self._let_go_of_retired()
        s = dict(self.memory.stats())
        for k in _COUNTERS + _PEAKS:
            s[k] = self._retired.get(k, 0)
        for front in self._fronts:
            fs = front.stats()
            for k in _COUNTERS:
                s[k] += fs.get(k, 0)
            for k in _PEAKS:
                s[k] = max(s[k], fs.get(k, 0))
        return s

    def reset_peak(self):
        self.memory.reset_peak()

    def link_gbps(self, nbytes=32 << 20, rounds=3):
        """The platform's device-to-host copy speed in GB/s, measured once (the planner's
        link): ``rounds`` copies of ``nbytes`` into pinned memory on a stream of hprt's."""
        if self._link_gbps is None:
            p = self.platform
            dev, host, s = p.alloc_device(nbytes), p.alloc_pinned(nbytes), p.create_stream()
            p.copy(host, dev, s)
            s.synchronize()
            start = time.perf_counter()
            for _ in range(rounds):
                p.copy(host, dev, s)
            s.synchronize()
            self._link_gbps = rounds * nbytes / max(time.perf_counter() - start, 1e-9) / 1e9
        return self._link_gbps

    def synchronize(self):
        self.platform.synchronize()


_runtimes = {}


def runtime(platform=None):
    """The shared ``Runtime`` of ``platform`` (the process-wide platform by default)."""
    key = id(platform) if platform is not None else None
    rt = _runtimes.get(key)
    if rt is None:
        rt = Runtime(platform)
        _runtimes[key] = rt
    return rt


def is_swappable(t, rt, min_bytes=0, custom_check_fn=None):
    """The torch side of eligibility: a non-empty dense tensor on this platform's device, not a
    parameter (nor a leaf that requires grad). ``min_bytes`` and ``custom_check_fn`` are the
    front end's own rules, applied here only for direct callers."""
    # Exact types first: nn.Parameter's isinstance goes through a Python metaclass hook, and
    # this runs for every tensor autograd saves.
    if type(t) is not torch.Tensor and (
            not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter)):
        return False
    nbytes = t.nbytes  # first: most of what autograd saves that is left out is small
    if nbytes == 0 or nbytes < min_bytes:
        return False
    base = t._base
    if base is not None and type(base) is not torch.Tensor and isinstance(base, nn.Parameter):
        return False
    if (t.is_leaf and t.requires_grad) or not rt.addressable(t) or (
            not t.is_contiguous() and not _is_dense(t)):
        return False
    return custom_check_fn is None or bool(custom_check_fn(t))
