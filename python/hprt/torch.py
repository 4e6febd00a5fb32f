"""hprt.torch: activation swap (and compression) of PyTorch's saved tensors through hprt.

Importable only where torch is installed. This module is glue: hooks call hprt-swap's Rust front
ends, which hold every swap rule. A saved tensor becomes a *borrowed* payload
(``FrameworkMemory.tensor``): hprt borrows its memory, copies it to pinned memory on its d2h
stream after the framework's current stream and drops its reference (so torch frees it) only
after that copy completed; the reload lands in a fresh tensor (shape, strides and storage offset
kept) made by the allocator callback, through hprt's h2d stream, which the current stream
(and, for CPU tensors, the host) waits for before autograd sees it.

``attach(model, mode=...)`` applies a mode to a model's layer list and returns a handle
(``detach()``, a context manager, ``stats()``). Modes and the front ends under them, with the
upstream names and semantics:

- ``"keyed"``: ``TensorSwapContext(module_tag=...)`` (the keyed swap, ``KeyedSwap``; the same
  class as ``hprt.TensorSwapContext``), a ``with`` block around one layer's forward; each new
  context of a tag is that tag's next layer.
- ``"swap"``: ``SwapManager().set_forward_prefetch_layer(a, b)`` (hyper_parallel's layer groups,
  the Rust ``SwapManager``); with ``swap_wrapper(module, policy_fn)`` regions only they save into
  the current layer's group (``ActivationPolicy.SAVE`` / ``SWAP`` per tensor);
  ``swap_tensor_wrapper(target)`` and ``SwapManager().add_storage(group, tensors)`` swap tensors
  autograd or a module keeps in place with their group.
- ``"pipeline"``: Megatron-LM's fine-grained offload (``PipelineOffload``), a group per layer;
  ``fine_grained_offloading_group_start`` / ``_commit`` (with ``forced_released_tensors`` and
  ``delay_offload``), ``_set_last_layer``, ``_group_flush_delayed_groups``, the CUDA-graph record
  calls and ``PipelineOffloadManager`` are the upstream names for marking groups inside a
  layer.
- ``"keep"``: ``keep_saved_tensors()``, the no-swap baseline counted by the same accounting.
- ``"compress"``: ``compress_saved_tensors()``, lossless compression queued from the pack hook
  on a codec thread, decoded ahead of backward's reads.
- ``"managed_compress"``: ``ManagedCompression`` (MindSpeed), saved tensors registered per
  layer with hprt's ``ActivationManager``.

Every mode gives torch's own results under the patterns training uses: a front end follows one
forward pass and its backward at a time (``_Flow``: a forward that starts while an earlier pass's
saved tensors are still referenced is left to autograd; what a dropped graph left is freed at the
next pass), a second read of a saved tensor (``retain_graph``) returns the same tensor, an
in-place write to a saved tensor raises torch's error (``_Witness``; ``_Declined`` for one left
to autograd, held without its autograd node so that a dropped graph goes), reloads keep strides
and storage offsets, and hooks are removed when a layer raises.

Sharded data parallel (``fully_shard``, ``run_on_ranks``, ``MixedPrecisionPolicy``, ...) lives in
``hprt.fsdp`` and is re-exported here.

``Runtime(compression=...)`` (``attach(..., compression=...)``) selects compress-then-swap
(``off``, ``device``, ``host_stage``, ``auto``) for its front ends. ``stats()`` reports
``device_current`` / ``device_peak`` (bytes of torch memory hprt keeps referenced) and the front
ends' engine counters (offloaded, reloaded, compressed, link bytes, pinned bytes). A backend
takes the tensors of its own device type: CPU tensors on the cpu backend, CUDA tensors on the
cuda backend and torch_npu's NPU tensors on the npu backend, ordered after torch's current stream
(wrapped: ``cuda_stream`` / ``npu_stream``) by events, never a host wait; other tensors are left
to autograd. The CUDA and NPU paths are tested with stand-ins on the emulators, not on hardware.

One module, past 800 lines, because every front end shares the pass and hook machinery of its
first sections (``_Flow``, ``_Packed``, ``_Witness``) and the peers' names are thin layers over it.
"""

import concurrent.futures
import contextlib
import enum
import threading
import time
import warnings
import weakref

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import hprt
from hprt import fsdp as _fsdp
from hprt.fsdp import (  # noqa: F401  (sharded data parallel: see hprt.fsdp)
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    RankMesh,
    RanksFailed,
    StreamTrace,
    fully_shard,
    get_model_state_dict,
    get_rank,
    get_world_size,
    init_device_mesh,
    init_from_process_group,
    run_on_ranks,
    set_model_state_dict,
)

__all__ = _fsdp.__all__ + [
    "Runtime",
    "runtime",
    "attach",
    "Attached",
    "find_layers",
    "TensorSwapContext",
    "SwapManager",
    "keep_saved_tensors",
    "compress_saved_tensors",
    "ManagedCompression",
    "is_swappable",
    "OverlappingForwardWarning",
    "ActivationPolicy",
    "swap_wrapper",
    "swap_tensor_wrapper",
    "SwapWrapper",
    "CheckpointPolicy",
    "checkpoint_wrapper",
    "CheckpointWrapper",
    "PipelineOffloadManager",
    "fine_grained_offloading_init_chunk_handler",
    "fine_grained_offloading_group_start",
    "fine_grained_offloading_group_commit",
    "fine_grained_offloading_group_flush_delayed_groups",
    "fine_grained_offloading_set_last_layer",
    "fine_grained_offloading_forward_record",
    "fine_grained_offloading_backward_record",
    "fine_grained_offloading_disable_offload",
    "fine_grained_offloading_enable_offload",
    "fine_grained_offloading_reset",
    "get_fine_grained_offloading_context",
    "FineGrainedActivationOffloadingInterface",
]

# Modes of ``attach`` and what they are upstream.
MODES = ("keep", "keyed", "swap", "pipeline", "compress", "managed_compress")


def _is_dense(t):
    """Whether ``t``'s elements fill exactly ``numel * itemsize`` bytes from ``data_ptr()``."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _in_backward():
    """Whether autograd is executing a backward on this thread (a checkpoint's recomputation
    runs its forward there: torch keeps those tensors only until they are used)."""
    return torch._C._current_graph_task_id() != -1


def _span(shape, stride, offset):
    """Elements of storage a tensor of this layout reaches."""
    return offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def _empty_like_layout(shape, stride, offset, dtype, device):
    """A tensor of ``shape`` and ``stride`` at storage offset ``offset``."""
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return torch.empty(_span(shape, stride, offset), dtype=dtype, device=device).as_strided(
        shape, stride, offset)


class _Allocate:
    """What a borrowed payload's reload calls for its memory, on every backend: a tensor of the
    saved layout (``Runtime.empty_layout``), with the stream it was handed out for (see
    ``Runtime.handed_out``). One object holding plain tuples, not a closure's cells: see
    ``_Witness`` on the collector."""

    __slots__ = ("rt", "layout", "device")

    def __init__(self, t, rt):
        self.layout, self.device, self.rt = _layout(t), t.device, rt

    def __call__(self):
        return self.rt.handed_out(self.rt.empty_layout(self.layout, self.device))


def _layout(t):
    """What a reload recreates: shape, strides and storage offset in elements, dtype,
    itemsize."""
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.itemsize


def _host_reload(capsule, layout):
    """The tensor of ``layout`` in a DLPack capsule of the cpu platform's device memory
    (``Platform.alloc_dlpack``: where every reload lands on the cpu backend). That memory comes
    from the platform's caching allocator (the cpu backend's, like a GPU framework's): a reload
    reuses the blocks earlier reloads freed, where torch's CPU allocator would hand glibc's
    memory back and fault fresh pages in for every reload. ``capsule`` is None when the
    platform has no room: torch's allocator makes the tensor.

    The capsule holds the layout itself where it can; a storage offset, or a dtype hprt
    carries as bytes, comes as one row to restride."""
    shape, stride, offset, dtype, _ = layout
    if capsule is None:
        return _empty_like_layout(shape, stride, offset, dtype, "cpu")
    out = torch.from_dlpack(capsule)
    if offset or out.dtype is not dtype:
        return out.view(dtype).as_strided(shape, stride, offset)
    return out


def _platform_empty(platform, shape, stride, offset, dtype):
    """A CPU tensor of this layout in the cpu platform's device memory (see ``_host_reload``)."""
    layout = (shape, stride, offset, dtype, dtype.itemsize)
    return _host_reload(platform.alloc_dlpack(layout, _HPRT_DTYPES.get(dtype, "u8")), layout)


class _StreamRecorder:
    """``FrameworkMemory``'s ``record_stream`` on the cuda backend: torch's caching allocator
    reuses a tensor's block only after the work queued so far on an hprt copy stream
    (``Tensor.record_stream``), so hprt lets go of an offloaded tensor when its copy is queued
    and of a reloaded one when torch's stream waits for it (on a GPU the host runs far ahead of
    the device: holding them until the host sees the copies finish kept most of a pass's layers
    alive). hprt's streams are few and long-lived: one ``ExternalStream`` each."""

    def __init__(self, kind):
        self.kind, self.streams = kind, {}

    def __call__(self, t, raw):
        s = self.streams.get(raw)
        if s is None:
            s = self.streams[raw] = getattr(torch, self.kind).ExternalStream(raw)
        t.record_stream(s)


def _stream_recorder(backend):
    """The ``record_stream`` of a backend whose tensors torch puts in a stream-ordered caching
    allocator (cuda); None elsewhere (CPU tensors; torch_npu's NPU tensors, whose
    ``record_stream`` hprt has not been tried with on hardware): the platform then keeps its
    reference until it sees the copy finished."""
    return _StreamRecorder(backend) if backend == "cuda" else None


# torch dtypes under hprt's names (what compress-then-swap can encode; others travel as bytes).
_HPRT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.float64: "f64"}

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


def _cpu_tensor_stream(platform):
    """The stream CPU tensors' compute stands on: on the cpu backend the host's own stream (raw
    stream 0: torch's CPU ops are done when they return, a wait on it blocks the host); elsewhere
    an idle stream of hprt's (other backends never take CPU tensors)."""
    return platform.wrap_stream(0) if platform.backend == "cpu" else platform.create_stream()


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
                                           record_stream=_stream_recorder(self.backend))
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
        # The backend's name is read for every saved tensor: kept here, not asked of hprt.
        self._platform, self.backend = platform, platform.backend
        self._device_flag = _DEVICE_FLAG.get(self.backend)

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
        kind = self.backend
        if kind in _STREAM_ATTR and (device is None or _device_type(device) == kind):
            raw = getattr(getattr(torch, kind).current_stream(device), _STREAM_ATTR[kind])
            s = self._wrapped.get(raw)
            if s is None:
                s = self._wrapped[raw] = self.platform.wrap_stream(raw)
            return s
        # CPU tensors: torch's work is done when its call returns (see the class docs).
        return self._host_stream

    def addressable(self, t):
        """Whether this platform's device memory holds ``t`` (cpu backend: CPU tensors; cuda:
        CUDA tensors; npu: torch_npu's NPU tensors)."""
        on = getattr(t, self._device_flag, None) if self._device_flag else None
        return on if on is not None else _device_type(t.device) == self.backend

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
        if self.backend == "cpu":
            return _platform_empty(self.platform, shape, stride, offset, dtype)
        return _empty_like_layout(shape, stride, offset, dtype, device)

    def handed_out(self, t):
        """What a reload's allocator gives hprt for ``t``, torch memory it just allocated. On an
        accelerator torch's caching allocator hands a block out in the order of the current
        stream: a block freed by kernels still queued there is handed out again at once. ``t``
        goes with that stream (``(t, stream)``), whose queued work hprt's copy waits for before
        writing the block; torch's CPU memory is free when allocated."""
        if self.backend == "cpu":
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


# ---- what every mode shares: torch's in-place check, retained graphs, one pass at a time -------

_lock = threading.Lock()


class _Witness:
    """torch's check that a saved tensor was not modified in place, for a tensor hprt no longer
    references: its version at save time, and weak references to it and to its base (which
    share its version counter; any view that could still write it keeps the base alive).

    The base class of what the pack hooks return (one object per saved tensor: each object
    that lives from a forward to its backward is work for Python's collector, whose full
    collections cost tens of ms in a training process), holding nothing the collector must
    follow but the weak references (the shape as a plain tuple of ints, which it untracks)."""

    __slots__ = ("version", "_t", "_base", "shape", "grad_fn", "output_nr")

    def __init__(self, t):
        self.version = t._version
        base = t._base
        self._t = weakref.ref(t)
        self._base = None if base is None else weakref.ref(base)
        fn = t.grad_fn
        # The node's class name is its name(); the node itself would be a reference cycle.
        self.shape, self.grad_fn = tuple(t.shape), fn and type(fn).__name__
        self.output_nr = t.output_nr

    def modified(self):
        t = self._alive()
        return t is not None and t._version != self.version

    def _alive(self):
        t = self._t()
        if t is None and self._base is not None:
            t = self._base()
        return t

    def check(self):
        """Raises torch's error (same class and message shape) if the tensor was modified."""
        # ``modified()`` inline: this runs for every saved tensor read in backward.
        t = self._t()
        if t is None and self._base is not None:
            t = self._base()
        if t is not None and t._version != self.version:
            raise _modified(t, self.shape, self.version, self.grad_fn, self.output_nr)


def _modified(t, shape, version, grad_fn, output_nr):
    """torch's error for a saved tensor modified in place (its message's shape: ``which is
    output N of NODE,`` only for a tensor some node made)."""
    what = f", which is output {output_nr} of {grad_fn}," if grad_fn else ""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{t.type()} {list(shape)}]{what} is at version {t._version}; "
        f"expected version {version} instead. Hint: the tensor was saved through hprt.torch; "
        "enable anomaly detection to find the operation that failed to compute its gradient, "
        "with torch.autograd.set_detect_anomaly(True).")


class _Declined:
    """What a pack hook returns for a tensor hprt leaves to autograd (under ``min_bytes``,
    refused by a predicate, a parameter or a view of one, not on this platform's device, not
    dense): the tensor as torch itself would save it and its version at save time, checked at
    unpack as torch checks a saved tensor.

    Returning ``t`` itself lost both: torch checks no version of what a hook returned (a
    weight or an activation changed in place between forward and backward gave a different
    gradient without an error), and a saved *output* holds its ``grad_fn``, which held what
    the hook returned: a reference cycle through autograd's C++ nodes that Python's collector
    cannot see, so a graph dropped without backward (an evaluation with grad on) stayed alive
    for good, and with it the pass the front end follows. So a tensor some node made is held
    as ``t.detach()`` (the same memory and version counter, not the node), as torch holds a
    saved output; a leaf (a parameter, an input) has no node and is held itself, as torch
    holds it, so a parameter whose ``.data`` is replaced between forward and backward (a
    sharded data-parallel unshard) is read as it is then."""

    __slots__ = ("t", "version", "grad_fn", "output_nr")

    def __init__(self, t):
        fn = t.grad_fn
        self.t, self.version = t if fn is None else t.detach(), t._version
        # The node's class name is its name(); the node itself would be the cycle.
        self.grad_fn = fn and type(fn).__name__
        self.output_nr = t.output_nr

    def read(self, load=None):
        t = self.t
        if t._version != self.version:
            raise _modified(t, t.shape, self.version, self.grad_fn, self.output_nr)
        return t


def _declined(t):
    """What a pack hook returns for ``t`` left to autograd (see ``_Declined``). An inference
    tensor has no version counter (torch checks none) and no autograd node: itself."""
    return t if t.is_inference() else _Declined(t)


class _Pass:
    """The saved tensors of one forward pass a front end follows: how many are still referenced
    by autograd (read ones and those of dropped graphs are gone)."""

    __slots__ = ("live", "begun", "by_layer")

    def __init__(self):
        self.live = 0
        self.begun = set()  # layers whose backward began
        self.by_layer = {}  # layer -> weak references to its packed tensors not yet loaded

    def add(self):
        with _lock:
            self.live += 1

    def drop(self):
        with _lock:
            self.live -= 1


class _Packed(_Witness):
    """What a pack hook returns for a tensor hprt took: the front end's reference, torch's
    in-place check (it is the tensor's witness), and the tensor once read (a retained graph's
    second backward gets the same one). Its death (read, or its graph dropped) is counted in
    its pass."""

    __slots__ = ("ref", "out", "layer", "pass_", "__weakref__")

    def __init__(self, ref, t, layer=None, pass_=None):
        _Witness.__init__(self, t)
        self.ref, self.out, self.layer = ref, None, layer
        self.pass_ = pass_
        if pass_ is not None:
            pass_.add()
            if layer is not None:
                pass_.by_layer.setdefault(layer, []).append(weakref.ref(self))

    def __del__(self):
        if self.pass_ is not None:
            self.pass_.drop()

    def read(self, load):
        self.check()
        if self.out is None:
            self.out = load(self)
        return self.out


class _Kept(_Packed):
    """A tensor left on the device but counted by the runtime's accounting (a borrowed payload
    hprt only holds)."""

    __slots__ = ()

    def read(self, load):
        self.check()
        return self.ref.tensor


def _load_layer(packed, load_one, start=None, ahead=None):
    """Loads ``packed`` and every other tensor of its layer still referenced in its pass. First
    ``start(packed)`` queues the layer's reload and ``ahead()`` the work behind it (a prefetch of
    the layer before), so that on the cpu backend, where a load blocks the host, the prefetch is
    already queued while the host waits."""
    if start is not None:
        start(packed)
    if ahead is not None:
        ahead()
    pass_ = packed.pass_
    group = pass_.by_layer.pop(packed.layer, ()) if pass_ is not None else ()
    for ref in group:
        other = ref()
        # A modified one is left to its own read, which raises torch's error for it.
        if other is not None and other is not packed and other.out is None and (
                not other.modified()):
            other.out = load_one(other)
    return load_one(packed)


def _unpack_with(load):
    def unpack(packed):
        # What the pack hooks return: a _Packed, a _Declined, or an inference tensor.
        return packed if isinstance(packed, torch.Tensor) else packed.read(load)
    return unpack


class OverlappingForwardWarning(UserWarning):
    """A forward pass overlapped a live one: its saved tensors were left to autograd."""


class _Flow:
    """The forward passes a front end sees. Its rules follow one forward and then its backward;
    a forward that starts while an earlier pass's saved tensors are still referenced (a second
    forward before the backward, DPO-style; a metric computed with grad on; a graph kept for
    ``retain_graph``) is left to autograd (its tensors stay where torch put them, unswapped), so
    the front end never sees two passes interleaved. Once none of a pass's tensors is referenced
    (all read, or the graph dropped: a forward without backward, a partial backward, an
    exception), the front end's ``end_iteration`` frees what it still holds, at the next pass or
    ``settle()``."""

    def __init__(self, end_iteration):
        self.end_iteration = end_iteration
        self.current = None
        self.active = False
        self.warned = False

    def start(self):
        """A forward pass begins (its first layer); returns whether the front end takes it."""
        self.active = False
        if not torch.is_grad_enabled() or _in_backward():
            return False  # nothing is saved (no_grad), or a checkpoint recomputes in backward
        if self.current is not None:
            if self.current.live > 0:
                self._warn_overlap()
                return False
            self.settle()
        self.current = _Pass()
        self.active = True
        return True

    def _warn_overlap(self):
        if not self.warned:
            self.warned = True
            warnings.warn(
                "hprt.torch: a forward pass began while the previous pass's saved tensors were "
                "still referenced (two forwards then one backward, DPO-style; a metric computed "
                "with grad enabled; a graph kept by retain_graph): that pass's saved tensors stay "
                "where torch put them, neither swapped nor compressed, so their device memory is "
                "not saved (gradients are exact; warned once per front end)",
                OverlappingForwardWarning, stacklevel=4)

    def taking(self):
        """Whether the layer running now belongs to the pass the front end takes."""
        return self.active and torch.is_grad_enabled() and not _in_backward()

    def settle(self):
        """Ends the current pass in the front end if none of its tensors is referenced."""
        cur = self.current
        if cur is not None and cur.live == 0:
            self.current, self.active = None, False
            self.end_iteration()


def _pushed(pack, unpack):
    ctx = saved_tensors_hooks(pack, unpack)
    ctx.__enter__()
    return ctx


def _on_output_grad(output, fn):
    """Calls ``fn()`` when the gradient of ``output`` (a layer's output: its backward begins)
    is computed, once."""
    if isinstance(output, (tuple, list)):
        output = next((o for o in output if isinstance(o, torch.Tensor)), None)
    elif not isinstance(output, torch.Tensor):
        output = getattr(output, "last_hidden_state", None)
    if isinstance(output, torch.Tensor) and output.requires_grad:
        fired = []

        def hook(grad):
            if not fired:
                fired.append(True)
                fn()

        output.register_hook(hook)


# ---- keyed swap ---------------------------------------------------------------------------------

TensorSwapContext = hprt.TensorSwapContext  # one class: its with-block is below


def _keyed_enter(ctx):
    """``with ctx:`` of a ``TensorSwapContext``: around one layer's forward, torch's saved
    tensors go to the context's ``KeyedSwap`` (entering the tag's first layer begins a forward
    pass); returns the hooks pushed, or None when the pass is left to autograd."""
    rt = ctx.runtime_ if ctx.runtime_ is not None else runtime(ctx.platform)
    swap = ctx.swap
    if not any(front is swap for front in rt._fronts):
        rt._fronts.append(swap)  # its counters join the runtime's stats
    flow = ctx._flow or TensorSwapContext._flows.get(id(swap))
    if flow is None:
        flow = TensorSwapContext._flows[id(swap)] = _Flow(swap.end_iteration)
    layer = ctx._ctx

    def pack(t):
        if not is_swappable(t, rt):
            return _declined(t)
        ref = swap.swap_out_cur_and_release_prev(layer, rt.borrow(t), rt.compute_stream(t.device))
        return _Packed(ref, t, layer.layer, flow.current)

    def load_one(packed):
        return swap.wait_cur_and_prefetch_next(packed.ref, rt.compute_stream(), ctx.prefetch)

    if layer.layer == 0:
        flow.start()
    if not flow.taking():
        return None
    return _pushed(pack, _unpack_with(lambda packed: _load_layer(packed, load_one)))


# ---- hyper_parallel's layer groups -------------------------------------------------------------


def _tensors_in(tree):
    """The torch tensors of a tensor, a nested list / tuple / dict, or an object with
    ``values()`` (hyper_parallel's ``Storage``)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors_in(v)
    elif isinstance(tree, dict) or hasattr(tree, "values"):
        for v in tree.values():
            yield from _tensors_in(v)


class SwapManager:
    """hyper_parallel's layer-group swap on torch modules, a singleton per runtime like
    upstream's: ``set_forward_prefetch_layer(a, b)`` installs module hooks that call the Rust
    ``SwapManager``; a layer never named second begins a forward pass. ``detach()`` (and the
    ``reset()`` class method) removes every hook."""

    _instances = {}

    def __new__(cls, runtime_=None, min_bytes=None, custom_check_fn=None):
        rt = runtime_ if runtime_ is not None else runtime()
        inst = cls._instances.get(id(rt))
        if inst is None:
            inst = super().__new__(cls)
            inst.rt = rt
            inst.min_bytes = min_bytes or 0
            inst.custom_check_fn = custom_check_fn
            # module -> its layer; weak (a module's id() is reused once it is freed: a new
            # model's block at a freed one's address got no hooks).
            inst.layers = weakref.WeakKeyDictionary()
            inst.seconds = set()
            inst.handles = []
            inst.flow = _Flow(inst._end_iteration)
            inst.wrapped = 0  # swap_wrapper regions: then only they save into the layer's group
            inst.recording = None
            inst.in_layer = 0  # layer forwards running (hooked), taken or not
            inst.named = []  # modules given a ``_swap_group_name``
            # Tensors swapped in place (add_storage / swap_tensor_wrapper): group name ->
            # [hprt's reference, the tensor, whether its storage is released now].
            inst.in_place = {}
            cls._instances[id(rt)] = inst
        elif (min_bytes is not None and min_bytes != inst.min_bytes) or (
                custom_check_fn is not None and custom_check_fn is not inst.custom_check_fn):
            raise ValueError(
                "SwapManager is a singleton (one per runtime): it was made with min_bytes="
                f"{inst.min_bytes}; call SwapManager.reset() first to change its settings")
        return inst

    def __init__(self, runtime_=None, min_bytes=None, custom_check_fn=None):
        pass

    @classmethod
    def reset(cls):
        """Removes every instance's hooks and forgets the instances."""
        for inst in list(cls._instances.values()):
            inst.detach()
        cls._instances.clear()

    def detach(self):
        for h in self.handles:
            h.remove()
        for ref in self.named:
            module = ref()
            if module is not None and hasattr(module, "_swap_group_name"):
                del module._swap_group_name
        layers = list(self.layers.values())
        self.handles, self.seconds, self.named = [], set(), []
        self.layers = weakref.WeakKeyDictionary()
        self.flow.settle()
        if self.flow.current is None:  # no pass alive: the next attach may order them anew
            for layer in layers:
                self.rt.layers.unlink(layer)

    def _layer(self, module):
        layer = self.layers.get(module)
        if layer is None:
            slots = self.rt._layer_slots
            layer = slots.get(module)
            if layer is None:
                layer = slots[module] = self.rt.layers.new_layer()
            self.layers[module] = layer
            # hyper_parallel names the module's group on the module.
            module._swap_group_name = f"swap_group_{layer}"
            self.named.append(weakref.ref(module))
            self._register_hooks(module, layer)
        return layer

    def set_forward_prefetch_layer(self, first_layer, second_layer):
        """``second_layer`` runs after ``first_layer`` in forward; idempotent."""
        a, b = self._layer(first_layer), self._layer(second_layer)
        self.seconds.add(b)
        self.rt.layers.set_forward_prefetch_layer(a, b)

    # hyper_parallel's group calls, by name
    def add_storage(self, group_name, storage):
        """hyper_parallel's ``add_storage``: the torch tensors in ``storage`` (a tensor, a
        nested list / tuple / dict of them, or an object with ``values()`` like hyper_parallel's
        ``Storage``) join group ``group_name``, swapped in place as hyper_parallel swaps them:
        once the group's offload was waited for (``wait_offload``, or the next layer's forward)
        their device storage is released (``untyped_storage().resize_(0)``), ``launch_load``
        re-acquires it and queues the copy back, and after ``wait_load`` (or the layer's
        backward hook) the same tensor objects hold their bytes again. A tensor that is not
        swappable (a parameter, a leaf that requires grad, not dense, not on this platform's
        device) or does not cover its whole storage (releasing it would take its neighbours)
        stays on the device. hprt payloads (``FrameworkMemory.tensor``, ``DeviceTensor``) are
        added as they are; returns their reference."""
        if not isinstance(storage, torch.Tensor) and hasattr(storage, "nbytes") and (
                not isinstance(storage, (list, tuple, dict))):
            return self.rt.layers.add_storage(group_name, storage)
        entries = self.in_place.setdefault(group_name, [])
        seen = {e[1].untyped_storage().data_ptr() for e in entries}
        for t in _tensors_in(storage):
            storage_ = t.untyped_storage()
            whole = t.storage_offset() == 0 and storage_.nbytes() == t.nbytes
            if not whole or storage_.data_ptr() in seen or not is_swappable(t, self.rt):
                continue
            seen.add(storage_.data_ptr())
            # ``t.detach()``: the same storage and version counter, without ``t``'s autograd
            # node (holding it would keep the whole graph alive).
            d = t.detach()

            def reacquire(d=d, nbytes=t.nbytes, rt=self.rt):
                d.untyped_storage().resize_(nbytes)
                return rt.handed_out(d.detach())

            payload = self.rt.memory.tensor(d.detach(), reacquire, _HPRT_DTYPES.get(t.dtype, "u8"))
            entries.append([self.rt.layers.add_storage(group_name, payload), d, False])
        return None

    def _sync_in_place(self):
        """Releases the in-place tensors whose offload was waited for, and lets go of those
        whose reload the compute stream waits for."""
        for group, entries in list(self.in_place.items()):
            keep = []
            for entry in entries:
                ref, t, released = entry
                state = self.rt.layers.state(ref)
                if state == "host" and not released:
                    t.untyped_storage().resize_(0)
                    entry[2] = True
                elif released and state == "device":
                    self.rt.layers.take(ref)  # back in place: hprt holds it no more
                    continue
                keep.append(entry)
            if keep:
                self.in_place[group] = keep
            else:
                del self.in_place[group]

    def _end_iteration(self):
        """Ends the front end's iteration; in-place tensors still released (their graph was
        dropped before its backward) get their bytes back first, so no tensor object is left
        without its storage."""
        for group, entries in list(self.in_place.items()):
            if any(e[2] for e in entries):
                self.rt.layers.launch_load(group)
                self.rt.layers.wait_load(group, self.rt.compute_stream(None))
        self.in_place.clear()
        self.rt.layers.end_iteration()

    def launch_offload(self, group_name, copy_stream=None):
        """hyper_parallel: queues the group's offload after torch's current stream (hprt's
        own copy stream; ``copy_stream`` is not used)."""
        self.rt.layers.launch_offload(group_name, self.rt.compute_stream(None))

    def wait_offload(self, group_name):
        """hyper_parallel: waits for the group's offload; its device memory is released."""
        self.rt.layers.wait_offload(group_name)
        self._sync_in_place()

    def launch_load(self, group_name, copy_stream=None):
        """hyper_parallel: re-acquires the group's device memory and queues its reload."""
        self.rt.layers.launch_load(group_name)

    def wait_load(self, group_name):
        """hyper_parallel: torch's current stream (and, for CPU tensors, the host) waits for
        the group's reload; its tensors are usable again."""
        self.rt.layers.wait_load(group_name, self.rt.compute_stream(None))
        self._sync_in_place()

    def get_current_group_name(self):
        return self.rt.layers.get_current_group_name()

    def set_current_group_name(self, name):
        self.rt.layers.set_current_group_name(name)

    def is_last_group(self, group_name=None):
        """hyper_parallel: whether group ``group_name`` (the current one by default) ends the
        chain of layers linked by ``set_forward_prefetch_layer`` (it is never offloaded)."""
        name = group_name if group_name is not None else self.get_current_group_name()
        return bool(name) and self.rt.layers.is_last_group(name)

    def stats(self):
        return self.rt.stats()

    def _pack(self, t, policy_fn=None):
        if not is_swappable(t, self.rt, self.min_bytes, self.custom_check_fn):
            return _declined(t)
        if policy_fn is not None:
            policy = policy_fn(t)
            if policy in (ActivationPolicy.SAVE, CheckpointPolicy.MUST_SAVE):
                return _Kept(self.rt.borrow(t), t)
            if policy not in (ActivationPolicy.SWAP, CheckpointPolicy.MUST_SWAP):
                raise ValueError(f"swap_wrapper policy_fn returned {policy!r}, not "
                                 "ActivationPolicy.SAVE / SWAP nor CheckpointPolicy.MUST_SAVE / "
                                 "MUST_SWAP")
        return _Packed(self.rt.layers.save(self.rt.borrow(t)), t, None, self.flow.current)

    def _region(self, policy_fn):
        """The saved-tensor hooks of a ``swap_wrapper`` region, or None outside a recorded layer."""
        if self.recording is None or not self.flow.taking():
            return None
        return saved_tensors_hooks(lambda t: self._pack(t, policy_fn), _unpack_with(self._load))

    def _begin_backward(self, layer, pass_):
        if pass_ is None or layer not in pass_.begun:
            if pass_ is not None:
                pass_.begun.add(layer)
            # The compute stream now waits for the whole group (on the cpu backend the host
            # did, once for every tensor of the layer).
            self.rt.layers.backward_pre(layer, self.rt.compute_stream())
            if self.in_place:
                self._sync_in_place()

    def _load(self, packed):
        # A layer whose backward hook did not run (a partial backward) is loaded here.
        pass_ = packed.pass_
        if pass_ is None or packed.ref[0] not in pass_.begun:
            self._begin_backward(packed.ref[0], pass_)
        return self.rt.layers.take(packed.ref)

    def _register_hooks(self, module, layer):
        front, rt, flow = self.rt.layers, self.rt, self.flow
        open_hooks = []
        unpack = _unpack_with(self._load)

        def forward_pre(mod, args):
            self.in_layer += 1
            if layer not in self.seconds:
                flow.start()
            ctx = None
            if flow.taking() and front.forward_pre(layer):
                self.recording = layer
                # Without swap_wrapper regions the whole layer saves into its group.
                ctx = _pushed(self._pack, unpack) if not self.wrapped else False
            open_hooks.append(ctx)

        def forward_post(mod, args, output):
            self.in_layer = max(0, self.in_layer - 1)
            ctx = open_hooks.pop() if open_hooks else None
            if ctx is None:
                return
            self.recording = None
            if ctx is not False:
                ctx.__exit__(None, None, None)
            front.forward_post(layer, rt.compute_stream(None))
            if self.in_place:
                self._sync_in_place()
            pass_ = flow.current
            _on_output_grad(output, lambda: self._begin_backward(layer, pass_))

        self.handles.append(module.register_forward_pre_hook(forward_pre))
        self.handles.append(module.register_forward_hook(forward_post, always_call=True))


# ---- no swap, compression ----------------------------------------------------------------------


class _Hooks:
    """A ``with`` block that installs ``_pack`` / ``_unpack`` as torch's saved-tensor hooks."""

    def __enter__(self):
        self._ctx = _pushed(self._pack, self._unpack)
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._ctx = None


class keep_saved_tensors(_Hooks):
    """The no-swap baseline: saved tensors stay on the device, counted by the runtime's
    accounting like swapped ones (``with keep_saved_tensors(): loss = model(x)``)."""

    def __init__(self, runtime_=None, min_bytes=0):
        self.rt = runtime_ if runtime_ is not None else runtime()
        self.min_bytes = min_bytes

    def _pack(self, t):
        if not is_swappable(t, self.rt, self.min_bytes):
            return _declined(t)
        return _Kept(self.rt.borrow(t), t)

    _unpack = staticmethod(_unpack_with(None))


_CODEC_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _of_parameter(t):
    """Whether ``t`` is a parameter or a view of one (``nn.Linear``'s backward saves
    ``weight.t()``): its memory lives on whatever hprt does with the saved tensor, so
    compressing it would only cost the encode, every step (the swap modes' ``is_swappable``
    leaves them out the same way)."""
    if isinstance(t, nn.Parameter):
        return True
    base = t._base
    return base is not None and isinstance(base, nn.Parameter)


class compress_saved_tensors(_Hooks):
    """Lossless compression of saved f32/f16/bf16 dense CPU tensors: in pack, ``hprt.compress``
    of the tensor's memory is queued on a codec thread of hprt's (the step goes on while it
    encodes, as an accelerator's codec stream would; the raw tensor is let go once its encoding
    exists; tensors under 128 KiB are encoded in the hook); in unpack, ``hprt.decompress_into``
    a tensor of the same shape, strides and storage offset, while the codec thread decodes the
    next ``decode_ahead`` tensors backward will read (the latest saved ones not read yet). A
    failed encode keeps the raw tensor (nothing is lost; unpack returns it) and warns.
    ``platform`` (a cpu platform) gives the decoded tensors its device memory, reused from one
    step to the next (see ``_host_reload``); ``stats()`` counts raw and compressed bytes.
    A saved f32/f16/bf16 tensor on another device raises ``hprt.UnsupportedError`` (on an
    accelerator, compress-then-swap compresses: ``attach(..., compression="device")``)."""

    def __init__(self, min_bytes=0, platform=None, decode_ahead=4):
        self.min_bytes, self.decode_ahead = min_bytes, decode_ahead
        self.platform = platform if platform is not None and platform.backend == "cpu" else None
        self._stats = {"tensors": 0, "raw_bytes": 0, "compressed_bytes": 0, "decoded_ahead": 0}
        self._stats_lock = threading.Lock()
        self._codec = None
        self._order = []  # weak references to what pack returned, in order of saving
        self._prune_at = 1024

    def _pack(self, t):
        _refuse_off_cpu("compress_saved_tensors", t)
        if (
            t.dtype not in _CODEC_DTYPES
            or _of_parameter(t)
            or (t.is_leaf and t.requires_grad)
            or t.numel() == 0
            or t.nbytes < self.min_bytes
            or not _is_dense(t)
        ):
            return _declined(t)
        flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())  # memory order
        raw = [flat]
        small = t.nbytes < _CODEC_THREAD_MIN_BYTES
        if small:
            encoded = self._encode(raw)
        else:
            if self._codec is None:
                self._codec = concurrent.futures.ThreadPoolExecutor(1, "hprt-codec")
            encoded = self._codec.submit(self._encode, raw)
        # ref[2] holds the decode begun ahead (a future), or _TAKEN once unpack took it.
        packed = _Packed((encoded, raw, [None], tuple(t.shape), t.stride(), t.storage_offset(),
                          t.dtype, self.platform), t)
        if small:
            return packed
        if len(self._order) >= self._prune_at:  # passes whose backward never came
            self._order = [w for w in self._order if self._waiting(w())]
            self._prune_at = max(1024, 2 * len(self._order))
        self._order.append(weakref.ref(packed))
        return packed

    def _encode(self, raw):
        """The encoding of ``raw[0]``, which it then lets go of; None (``raw[0]`` kept) if the
        encode failed."""
        try:
            blob = hprt.compress(raw[0])
        except Exception as e:  # noqa: BLE001  (any failure: the raw bytes stay)
            warnings.warn(f"hprt.torch: a saved tensor's encode failed ({e}); it is kept "
                          "uncompressed", RuntimeWarning, stacklevel=2)
            return None
        with self._stats_lock:
            self._stats["tensors"] += 1
            self._stats["raw_bytes"] += raw[0].nbytes
            self._stats["compressed_bytes"] += len(blob)
        raw[0] = None
        return blob

    def stats(self):
        """Tensors compressed, their raw and compressed bytes, decodes begun ahead of their
        unpack (encodes still queued are waited for first)."""
        if self._codec is not None:
            self._codec.submit(lambda: None).result()
        with self._stats_lock:
            return dict(self._stats)

    @staticmethod
    def _waiting(packed):
        return packed is not None and packed.ref[2][0] is not _TAKEN

    def _load(self, packed):
        slot = packed.ref[2]
        ahead, slot[0] = slot[0], _TAKEN
        self._decode_ahead()
        return ahead.result() if ahead is not None else self._decompress(packed.ref)

    def _decode_ahead(self):
        """Queues the decodes of the next tensors backward reads (the latest saved ones not read
        yet) on the codec thread, up to ``decode_ahead`` of them begun."""
        order = self._order
        while order and not self._waiting(order[-1]()):
            order.pop()
        begun = 0
        for w in reversed(order):
            if begun >= self.decode_ahead:
                break
            p = w()
            if not self._waiting(p):
                continue
            if p.ref[2][0] is None:
                p.ref[2][0] = self._codec.submit(self._decompress, p.ref)
                with self._stats_lock:
                    self._stats["decoded_ahead"] += 1
            begun += 1

    def _unpack(self, packed):
        return packed if isinstance(packed, torch.Tensor) else packed.read(self._load)

    @staticmethod
    def _decompress(ref):
        encoded, raw, _, shape, stride, offset, dtype, platform = ref
        blob = encoded if not isinstance(encoded, concurrent.futures.Future) else encoded.result()
        if blob is None:  # the encode failed: the raw bytes were kept
            return raw[0].as_strided(shape, stride, offset)
        if platform is not None:
            out = _platform_empty(platform, shape, stride, offset, dtype)
        else:
            out = _empty_like_layout(shape, stride, offset, dtype, "cpu")
        flat = out.as_strided((out.numel(),), (1,), offset)
        hprt.decompress_into(blob, flat)
        return out


_TAKEN = object()  # a compressed tensor unpack took (its decode is not begun ahead)

# Tensors under this size are encoded and decoded in the hook itself: handing them to the codec
# thread and back costs more than their encode (~100 µs at ~1.5 GB/s).
_CODEC_THREAD_MIN_BYTES = 128 << 10


# ---- MindSpeed-style managed compression -------------------------------------------------------


class _ManagedKey(_Witness):
    """A tensor registered with the ActivationManager (and its witness); if its graph is
    dropped before the tensor was read, the key is queued for ``discard`` (done at the next
    layer boundary, not in the collector's context)."""

    __slots__ = ("key", "out", "owner", "taken", "pass_")

    def __init__(self, key, t, owner, pass_):
        _Witness.__init__(self, t)
        self.key, self.out, self.owner, self.taken = key, None, owner, False
        self.pass_ = pass_
        pass_.add()

    def __del__(self):
        if not self.taken:
            self.owner._dropped.append(self.key)
        self.pass_.drop()


class ManagedCompression:
    """MindSpeed's activation compression through hprt's ``ActivationManager``.

    ``with comp.layer(i): x = block(x)`` around each layer's forward: tensors the layer saves
    (f32/f16/bf16, contiguous, at least ``min_numel`` elements, not parameters) are registered
    under layer ``i``; the layer's forward is an operator window in which the previous layer's
    tensors are encoded on the manager's side stream and released. By default the window is
    unbounded: every registered tensor of the previous layer is encoded, so the same model and
    inputs compress the same tensors every step whatever the timing (the last layer's tensors,
    read first in backward, are not compressed). ``window_ms`` instead sizes the window by
    hprt's cost model (its codec throughputs are measured unless ``encode_gbps`` is given):
    what fits is encoded. In backward,
    the first tensor read of a layer starts that layer's backward, which decodes its tensors
    still compressed, and opens a window (sized as the forward's) over the rest of that
    layer's backward in which the next layer's tensors decode on the side stream. Layer 0
    begins a forward pass (see ``_Flow``: a pass overlapping a live one is left to autograd). ``stats()`` is ``ActivationManager.layer_stats()``.

    Works where the platform addresses torch's memory as device memory (the cpu backend with
    CPU tensors); other tensors are left to autograd.
    """

    def __init__(self, platform=None, min_numel=32768, window_ms=None, encode_gbps=None,
                 decode_gbps=None):
        self.platform = platform if platform is not None else hprt.get_platform()
        # The manager's operators are torch's CPU ops: its waits for the codec stream block
        # the host (the synchronize after a take only reports the stream's errors).
        self.stream = _cpu_tensor_stream(self.platform)
        self.manager = hprt.ActivationManager(
            self.stream, self.platform, encode_gbps=encode_gbps, decode_gbps=decode_gbps,
            min_numel=min_numel)
        self.window_ms = window_ms
        self._backward_layer = None
        self._backward_window = False
        self._dropped = []
        self.flow = _Flow(self._discard_dropped)

    def _window_kw(self):
        return {"unbounded": True} if self.window_ms is None else {"fixed_ms": self.window_ms}

    def _end_backward_window(self):
        """Ends the window of the current layer's backward (the host waits for its decodes;
        a take of a tensor it was decoding may have ended it already)."""
        if self._backward_window:
            self._backward_window = False
            if self.manager.window_open:
                self.manager.end_window()

    def _discard_dropped(self):
        self._end_backward_window()
        while self._dropped:
            self.manager.discard(self._dropped.pop())

    def _eligible(self, t):
        return (
            t.dtype in _CODEC_DTYPES  # and on the CPU: _pack refused the others
            and self.platform.backend == "cpu"
            and not _of_parameter(t)
            and not (t.is_leaf and t.requires_grad)
            and t.is_contiguous()
            and t.storage_offset() == 0
            and t.numel() > 0
        )

    def _pack(self, layer, t):
        _refuse_off_cpu("ManagedCompression", t)
        if not self._eligible(t):
            return _declined(t)
        key = self.manager.save(layer, t.detach())
        return _declined(t) if key is None else _ManagedKey(key, t, self, self.flow.current)

    def _unpack(self, packed):
        if not isinstance(packed, _ManagedKey):
            return packed if isinstance(packed, torch.Tensor) else packed.read()
        packed.check()
        if packed.out is None:
            layer = packed.key[0]
            if self._backward_layer != layer:
                self._end_backward_window()
                self.manager.backward_start(layer)
                self._backward_layer = layer
                # The rest of this layer's backward is the next one's decode window (no hook
                # runs per backward operator: one window spans them).
                self.manager.begin_window(**self._window_kw())
                self._backward_window = True
            out = self.manager.take(packed.key)
            packed.taken = True
            self.stream.synchronize()
            packed.out = torch.from_dlpack(out)
        return packed.out

    def layer(self, layer):
        """The context manager around layer ``layer``'s forward."""
        return _ManagedLayer(self, layer)

    def stats(self):
        return self.manager.layer_stats()


class _ManagedLayer:
    def __init__(self, owner, layer):
        self.owner, self.layer = owner, layer
        self._hooks = None
        self._window = None

    def __enter__(self):
        o = self.owner
        if self.layer == 0:
            o.flow.start()
        if not o.flow.taking():
            return self
        o._discard_dropped()
        o._backward_layer = None
        o.manager.forward_start(self.layer)
        self._window = o.manager.window(**o._window_kw())
        self._window.__enter__()
        self._hooks = _pushed(lambda t: o._pack(self.layer, t), o._unpack)
        return self

    def __exit__(self, *exc):
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        if self._window is not None:
            self._window.__exit__(*exc)
            self._window = None


# ---- hyper_parallel's swap_wrapper -------------------------------------------------------------


class ActivationPolicy(enum.Enum):
    """hyper_parallel's per-tensor choice in a ``swap_wrapper`` region."""

    SAVE = "save"
    SWAP = "swap"


_WRAPPED = "_swap_wrapped_module"


def _replace_prefix(state_dict, old, new):
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old):]] = state_dict.pop(key)


class SwapWrapper(nn.Module):
    """hyper_parallel's ``swap_wrapper`` module: the wrapped module's saved tensors join the
    current layer's group of the ``SwapManager`` (the layers linked by
    ``set_forward_prefetch_layer``); ``policy_fn(tensor)`` returns ``ActivationPolicy.SAVE`` to
    keep one on the device (``CheckpointPolicy.MUST_SAVE`` / ``MUST_SWAP``, the names newer
    hyper_parallel uses, work too). Attribute access and indexing reach the wrapped module;
    ``state_dict()`` / ``named_parameters()`` carry no wrapper prefix. ``group_swap``
    (hyper_parallel's copy fusion into one staging buffer per group) is accepted and changes
    nothing: hprt's engine queues a group's copies back to back on its copy stream."""

    def __init__(self, module, policy_fn=None, manager=None, group_swap=False):
        super().__init__()
        self._swap_wrapped_module = module
        self.policy_fn = policy_fn
        self.group_swap = group_swap
        self._manager = manager if manager is not None else SwapManager()
        self._manager.wrapped += 1
        self._register_state_dict_hook(self._strip_prefix)
        self.register_load_state_dict_pre_hook(self._add_prefix)

    def forward(self, *args, **kwargs):
        region = self._manager._region(self.policy_fn)
        if region is None:
            return self._swap_wrapped_module(*args, **kwargs)
        with region:
            return self._swap_wrapped_module(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._swap_wrapped_module, name)

    def __getitem__(self, key):
        return self._swap_wrapped_module[key]

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace(_WRAPPED + ".", ""), p

    @staticmethod
    def _strip_prefix(module, state_dict, prefix, *args):
        _replace_prefix(state_dict, f"{prefix}{_WRAPPED}.", prefix)
        return state_dict

    @staticmethod
    def _add_prefix(module, state_dict, prefix, *args):
        _replace_prefix(state_dict, prefix, f"{prefix}{_WRAPPED}.")


def swap_wrapper(module, policy_fn=None, group_swap=False):
    """hyper_parallel's ``swap_wrapper(module, policy_fn=None, group_swap=False)`` (a
    ``SwapWrapper``)."""
    return SwapWrapper(module, policy_fn, group_swap=group_swap)


def swap_tensor_wrapper(target, tag=None, group_swap=False):
    """hyper_parallel's ``swap_tensor_wrapper``: inside a layer's forward (a layer linked by
    ``SwapManager().set_forward_prefetch_layer``), the tensors of ``target`` (a tensor or a
    nested list / tuple / dict) join the current layer's group and are swapped in place with
    it (``SwapManager.add_storage``): their device storage is released once the group's offload
    completed and is back, same tensor objects, before the layer's backward. For tensors the
    layer's swap regions do not see (autograd saves them outside ``swap_wrapper``, or the module
    keeps them). Returns ``target`` unchanged. The last layer's group is never offloaded, so
    there it does nothing; outside a layer it warns, as hyper_parallel does. ``tag`` names
    the tensors in messages; ``group_swap`` changes nothing (see ``SwapWrapper``)."""
    manager = SwapManager()
    group = manager.get_current_group_name()
    if not group:
        if not manager.in_layer:
            warnings.warn(f"Tensor {tag} cannot be swapped, for its group is unregistered.")
        return target  # in a layer whose pass is left to autograd (no_grad, recomputation)
    if manager.is_last_group(group):
        return target
    manager.add_storage(group, target)
    return target


class CheckpointPolicy(enum.Enum):
    """hyper_parallel's selective-checkpointing policy per operator: torch's four, and
    ``MUST_SWAP`` (the output is saved, and swapped with the current layer's group)."""

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"
    MUST_SWAP = "must_swap"


class CheckpointWrapper(SwapWrapper):
    """hyper_parallel's ``checkpoint_wrapper``: the wrapped module runs under torch's
    non-reentrant checkpoint with selective checkpointing, ``policy_fn(ctx, op, *args,
    **kwargs)`` choosing per operator whether its output is saved, recomputed or swapped.
    Swapped outputs are torch's SAC cache entries, routed through hprt's hooks
    (``respect_saved_tensors_hooks``) into the ``SwapManager``'s current layer group."""

    def __init__(self, module, policy_fn=None, manager=None, group_swap=False):
        super().__init__(module, self._swap_choice if policy_fn is not None else None, manager,
                         group_swap)
        self.checkpoint_policy = policy_fn
        self._swap_next = False

    def _torch_policy(self, ctx, op, *args, **kwargs):
        policy = self.checkpoint_policy(ctx, op, *args, **kwargs)
        if isinstance(policy, bool):
            policy = CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
        if not isinstance(policy, CheckpointPolicy):
            raise ValueError(f"checkpoint_wrapper policy_fn returned {policy!r}, not a CheckpointPolicy")
        if not ctx.is_recompute:
            self._swap_next = policy is CheckpointPolicy.MUST_SWAP
        name = "MUST_SAVE" if policy is CheckpointPolicy.MUST_SWAP else policy.name
        return torch.utils.checkpoint.CheckpointPolicy[name]

    def _swap_choice(self, t):
        """The pack hook's choice for a tensor SAC caches: the policy of the op that made it."""
        return ActivationPolicy.SWAP if self._swap_next else ActivationPolicy.SAVE

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        options = {}
        if self.checkpoint_policy is not None:
            options = dict(
                context_fn=lambda: create_selective_checkpoint_contexts(self._torch_policy),
                respect_saved_tensors_hooks=True)
        region = self._manager._region(self.policy_fn) if self.policy_fn is not None else None
        with region if region is not None else contextlib.nullcontext():
            return checkpoint(self._swap_wrapped_module, *args, use_reentrant=False, **options,
                              **kwargs)


def checkpoint_wrapper(module, policy_fn=None, group_swap=False):
    """hyper_parallel's ``checkpoint_wrapper(module, policy_fn=None, group_swap=False)`` (a
    ``CheckpointWrapper``); without ``policy_fn`` the module is checkpointed whole."""
    return CheckpointWrapper(module, policy_fn, group_swap=group_swap)


# ---- Megatron-LM's fine-grained activation offloading -----------------------------------------


def _refuse_graph_capture(what):
    """hprt's copies, pinned pool and host waits cannot be captured in a CUDA graph: offloading
    inside a capture is refused by name, never recorded wrong."""
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available() and cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"hprt.torch: {what} inside a CUDA graph capture is not supported (hprt's offload "
            "stream, pinned pool and waits are not capturable); capture the layer without "
            "fine-grained offloading, or offload only the groups outside the captured scope")


def _not_offloadable(t):
    return (getattr(t, "_do_not_offload", False) or getattr(t, "_TE_do_not_offload", False)
            or getattr(t, "offloading_activation", True) is False)


class PipelineOffloadManager:
    """Megatron-LM's ``PipelineOffloadManager`` (``get_instance()``) over hprt's
    ``PipelineOffload``: a ``with`` block (``get_fine_grained_offloading_context(True)``) around a
    model chunk's forward installs the saved-tensor hooks; ``fine_grained_offloading_group_start``
    / ``_commit`` mark a group; the commit's backward reloads it, the start's backward ends it;
    ``fine_grained_offloading_reset()`` starts an iteration.

    As in Megatron-LM: without a chunk handler (``fine_grained_offloading_init_chunk_handler``)
    the markers are identities; tensors under ``min_offloaded_tensor_size`` elements stay on the
    device; ``set_last_layer(True)`` keeps the groups committed in the chunk's last layer on the
    device while that chunk's backward is the next to run; a commit with ``delay_offload=True``
    launches its offload at ``flush_delayed_groups()``; ``forced_released_tensors`` are released
    (``untyped_storage().resize_(0)``) once their group's offload completed."""

    _instance = None

    @classmethod
    def get_instance(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @classmethod
    def reset_instance(cls, runtime_=None):
        """A fresh singleton (on ``runtime_``)."""
        cls._instance = cls(runtime_)
        return cls._instance

    def __init__(self, runtime_=None):
        self.rt = runtime_ if runtime_ is not None else runtime()
        self.off = self.rt.new_pipeline()
        self.min_elems = 1024 * 1024
        self.group_open = False
        self.has_chunk = False
        self.do_offload = True
        self._hooks = []
        # Storages autograd keeps on the device in this iteration: never force-released (a kept
        # saved tensor reading released memory would crash).
        self._kept = set()
        # (hprt's borrowed buffer, tensor) of forced-released tensors whose group's offload has
        # not completed yet.
        self._forced = []

    def init_model_chunk_offload_handler(self, vp_size=1, vp_stage=None,
                                         min_offloaded_tensor_size=1024 * 1024):
        self.min_elems = min_offloaded_tensor_size
        self.off.init_chunk(vp_size or 1, vp_stage)
        self.has_chunk = True

    def set_last_layer(self, is_last_layer):
        """Megatron-LM: whether the current chunk's forward is in its last layer."""
        if self.has_chunk:
            self.off.set_last_layer(bool(is_last_layer))

    def disable_offload(self):
        """Tensors saved from now on stay on the device."""
        self.do_offload = False
        self.off.disable()

    def enable_offload(self):
        self.do_offload = True
        self.off.enable()

    def flush_delayed_groups(self):
        """Launches the offloads of the groups committed with ``delay_offload=True``."""
        self.off.flush_delayed_groups(self.rt.compute_stream(None))
        self._release_forced()

    def reset(self):
        self.off.reset()
        self.has_chunk = self.group_open = False
        self._kept.clear()
        self._forced = []

    def stats(self):
        return self.rt.stats()

    def mark_not_offloadable(self, tensor):
        """Megatron-LM: ``tensor`` stays on the device when saved (its flag ``_do_not_offload``;
        Transformer Engine's ``_TE_do_not_offload`` and the older ``offloading_activation =
        False`` are honoured too)."""
        if tensor is not None:
            tensor._do_not_offload = True

    def _pack(self, t):
        if (self.group_open and t.numel() >= self.min_elems and is_swappable(t, self.rt)
                and not _not_offloadable(t)):
            _refuse_graph_capture("fine-grained activation offloading")
            tag = self.off.save(self.rt.borrow(t))
            if tag.offloaded:
                return _Packed(tag, t)
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            self._kept.add(t.untyped_storage().data_ptr())
        return _declined(t) if isinstance(t, torch.Tensor) else t

    def _load(self, packed):
        # Handed over, as Megatron-LM's handler pops a tensor at unpack (_Packed keeps it for a
        # retained graph's second read).
        return self.off.take(packed.ref, self.rt.compute_stream(None))

    def _releasable(self, t):
        """Megatron-LM's check for a forced-released tensor (on this platform's device, at least
        ``min_offloaded_tensor_size`` elements), and hprt's: not a parameter, and no tensor saved
        under this manager's hooks in this iteration and kept on the device by autograd shares
        its storage (tensors saved outside the hooks are the caller's contract, as in
        Megatron-LM)."""
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
            return False
        if not self.rt.addressable(t) or t.numel() < max(self.min_elems, 1):
            return False
        storage = t.untyped_storage()
        return storage.nbytes() > 0 and storage.data_ptr() not in self._kept

    def _commit(self, forced, delay):
        _refuse_graph_capture("fine_grained_offloading_group_commit")
        self.group_open = False
        forced = [t for t in forced if self._releasable(t)]
        # The storage of a live torch tensor, which ``t`` keeps alive for hprt.
        bufs = [self.rt.platform.unsafe_wrap_device_memory(t.untyped_storage().data_ptr(),
                                                           t.untyped_storage().nbytes(), t)
                for t in forced]
        self.off.group_commit(self.rt.compute_stream(None), bufs, delay)
        self._forced.extend(zip(bufs, forced))
        self._release_forced()

    def _release_forced(self):
        """Releases the forced-released tensors whose group's offload completed (hprt freed its
        hold on them), as Megatron-LM does: ``untyped_storage().resize_(0)``."""
        waiting = []
        for buf, t in self._forced:
            if not buf.is_freed:
                waiting.append((buf, t))
                continue
            kind = t.device.type
            if kind in _STREAM_ATTR:  # torch's allocator reuses it only after the current stream
                t.record_stream(getattr(torch, kind).current_stream())
            t.untyped_storage().resize_(0)
        self._forced = waiting

    def __enter__(self):
        self._hooks.append(_pushed(self._pack, _unpack_with(self._load)))
        return self

    def __exit__(self, *exc):
        self._hooks.pop().__exit__(*exc)


class _GroupStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, manager, name):
        _refuse_graph_capture("fine_grained_offloading_group_start")
        ctx.manager = manager
        manager.off.group_start(name)
        manager.group_open = True
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.manager.off.backward_group_end()
        return grad, None, None


class _GroupCommit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, manager, name, forced, delay):
        ctx.manager, ctx.name = manager, name
        manager._commit(forced, delay)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        m = ctx.manager
        m.off.backward_group_begin(ctx.name, m.rt.compute_stream(None))
        return grad, None, None, None, None


def fine_grained_offloading_init_chunk_handler(vp_size=1, vp_stage=None,
                                               min_offloaded_tensor_size=1024 * 1024):
    """Megatron-LM: at the start of a micro-batch's forward through one model chunk."""
    PipelineOffloadManager.get_instance().init_model_chunk_offload_handler(
        vp_size, vp_stage, min_offloaded_tensor_size)


def fine_grained_offloading_set_last_layer(is_last_layer):
    """Megatron-LM: the current chunk's forward enters (``True``) or leaves its last layer;
    that layer's groups stay on the device while the chunk's backward is the next to run."""
    PipelineOffloadManager.get_instance().set_last_layer(is_last_layer)


def fine_grained_offloading_group_start(tensor, name=None):
    """Megatron-LM: the group ``name`` begins (identity on ``tensor``; without a chunk handler,
    ``tensor`` itself)."""
    manager = PipelineOffloadManager.get_instance()
    if not manager.has_chunk:
        return tensor
    return _GroupStart.apply(tensor, manager, name or "group")


def fine_grained_offloading_group_commit(tensor, name=None, forced_released_tensors=None,
                                         delay_offload=False):
    """Megatron-LM: the group ``name`` ends and is offloaded (identity on ``tensor``; a tuple or
    list gets the marker on its first element). ``forced_released_tensors``: tensors the
    group's saved tensors came from that torch would not free (held by the caller, like
    Megatron-LM's ``residual``); their storage is released (``resize_(0)``) once the group's
    offload completed, so their contents must not be read afterwards except through the
    group's saved tensors. A tensor under ``min_offloaded_tensor_size`` elements, a parameter,
    one whose storage autograd keeps on the device, and those of a group that stays on the
    device are not released. ``delay_offload=True`` queues the offload until
    ``fine_grained_offloading_group_flush_delayed_groups()``."""
    if isinstance(tensor, (tuple, list)):
        if not tensor:
            return tensor
        head = fine_grained_offloading_group_commit(tensor[0], name, forced_released_tensors,
                                                    delay_offload)
        return type(tensor)([head, *tensor[1:]])
    manager = PipelineOffloadManager.get_instance()
    if not manager.has_chunk:
        return tensor
    return _GroupCommit.apply(tensor, manager, name or "group", list(forced_released_tensors or ()),
                              bool(delay_offload))


def fine_grained_offloading_group_flush_delayed_groups():
    """Megatron-LM: launches the offloads committed with ``delay_offload=True``, in order."""
    PipelineOffloadManager.get_instance().flush_delayed_groups()


def fine_grained_offloading_disable_offload():
    PipelineOffloadManager.get_instance().disable_offload()


def fine_grained_offloading_enable_offload():
    PipelineOffloadManager.get_instance().enable_offload()


def _record_event(event, what):
    """Records ``event`` (a ``torch.cuda.Event``) on torch's current CUDA stream; other
    backends have no CUDA event to record."""
    if event is None:
        return
    if runtime().platform.backend != "cuda":
        raise NotImplementedError(
            f"hprt.torch: {what}(event) records a CUDA event for CUDA graph capture; the "
            f"{runtime().platform.backend} backend has no CUDA graphs (call it without an event "
            "for the stream ordering alone)")
    torch.cuda.current_stream().record_event(event)


def fine_grained_offloading_forward_record(event=None):
    """Megatron-LM's CUDA-graph forward mark: ``event`` is recorded on the current stream, the
    offloads queued later wait for the current stream's work so far, and the current stream
    waits for the offloads queued so far (events, no host wait). hprt offloads are refused
    inside a capture, so this is the ordering Megatron-LM's eager path has."""
    manager = PipelineOffloadManager.get_instance()
    _record_event(event, "fine_grained_offloading_forward_record")
    manager.off.join_offloads(manager.rt.compute_stream(None))


class _BackwardRecord(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, event):
        ctx.event = event
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        manager = PipelineOffloadManager.get_instance()
        _record_event(ctx.event, "fine_grained_offloading_backward_record")
        manager.off.record_backward(manager.rt.compute_stream(None))
        return grad, None


def fine_grained_offloading_backward_record(tensor, event=None):
    """Megatron-LM's CUDA-graph backward mark (identity on ``tensor``): in backward, ``event``
    is recorded on the current stream and the current stream waits for every reload queued so
    far."""
    if event is not None and runtime().platform.backend != "cuda":
        _record_event(event, "fine_grained_offloading_backward_record")
    return _BackwardRecord.apply(tensor, event)


def fine_grained_offloading_reset():
    """Megatron-LM: the start of a training iteration."""
    PipelineOffloadManager.get_instance().reset()


def get_fine_grained_offloading_context(flag):
    return PipelineOffloadManager.get_instance() if flag else contextlib.nullcontext()


class FineGrainedActivationOffloadingInterface:
    """Megatron-LM's interface for marking one offload group in a module's forward:
    ``with FineGrainedActivationOffloadingInterface(offload, tensor, name) as tensor:`` starts
    the group on ``tensor`` and installs the saved-tensor hooks for the block;
    ``group_commit(...)`` (``group_offload`` in newer Megatron-LM) ends it. With ``offload``
    false everything is an identity."""

    def __init__(self, offload, tensor, name):
        self.offload, self.tensor, self.name = offload, tensor, name

    def __enter__(self):
        if self.offload:
            self.tensor = fine_grained_offloading_group_start(self.tensor, self.name)
            PipelineOffloadManager.get_instance().__enter__()
        return self.tensor

    def __exit__(self, *exc):
        if self.offload:
            PipelineOffloadManager.get_instance().__exit__(*exc)

    def group_offload(self, tensor, forced_released_tensors=None, delay_offload=False):
        if not self.offload:
            return tensor
        return fine_grained_offloading_group_commit(tensor, self.name, forced_released_tensors,
                                                    delay_offload)

    @staticmethod
    def group_commit(tensor, name, forced_released_tensors=None, delay_offload=False):
        return fine_grained_offloading_group_commit(tensor, name, forced_released_tensors,
                                                    delay_offload)

    @staticmethod
    def init_chunk_handler(vp_size, vp_stage, min_offloaded_tensor_size):
        fine_grained_offloading_init_chunk_handler(vp_size, vp_stage, min_offloaded_tensor_size)

    get_context = staticmethod(get_fine_grained_offloading_context)
    forward_record = staticmethod(fine_grained_offloading_forward_record)
    backward_record = staticmethod(fine_grained_offloading_backward_record)
    reset = staticmethod(fine_grained_offloading_reset)
    flush_delayed_groups = staticmethod(fine_grained_offloading_group_flush_delayed_groups)
    disable_offload = staticmethod(fine_grained_offloading_disable_offload)
    enable_offload = staticmethod(fine_grained_offloading_enable_offload)

    @staticmethod
    def mark_not_offloadable(tensor):
        PipelineOffloadManager.get_instance().mark_not_offloadable(tensor)

    @staticmethod
    def reset_instance():
        PipelineOffloadManager.reset_instance()


# ---- attach: a mode on an ordinary model --------------------------------------------------------

_LAYER_PATHS = ("layers", "model.layers", "transformer.h", "transformer.layers", "gpt_neox.layers",
                "model.decoder.layers", "encoder.layer", "h", "blocks")


def find_layers(model, path=None):
    """The model's list of layers: ``path`` (dotted, e.g. ``"model.layers"``) or the first of
    the usual places (``model.layers``, ``model.model.layers``, ``model.transformer.h``, ...)."""
    for p in (path,) if path is not None else _LAYER_PATHS:
        obj = model
        try:
            for part in p.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, (nn.ModuleList, nn.Sequential, list, tuple)) and len(obj) > 0:
            return list(obj)
    raise ValueError(f"no layer list found in {type(model).__name__} (looked at "
                     f"{', '.join(_LAYER_PATHS) if path is None else path}); pass layers=")


class _PipelineFront:
    """Megatron's pipeline offload driven per layer: one chunk per forward pass, one group per
    layer. A layer's first read in backward loads its group and, like Megatron-LM's chunk
    handler (a group's backward starts the next group's reload), starts reloading the layer
    before it in the same pass, so that reload overlaps this layer's backward (``prefetch``;
    ``stats()["prefetched_tensors"]`` counts the tensors whose reload began that way)."""

    def __init__(self, rt, min_bytes, predicate, prefetch=True, layers=None):
        self.rt, self.min_bytes, self.predicate = rt, min_bytes, predicate
        self.last = None if layers is None else layers - 1
        self.off = rt.new_pipeline()
        self.flow = _Flow(self.off.reset)
        self.layer = None
        self.prefetch, self.prefetched = prefetch, 0

    def _pack(self, t):
        if not is_swappable(t, self.rt, self.min_bytes, self.predicate):
            return _declined(t)
        return _Packed(self.off.save(self.rt.borrow(t)), t, self.layer, self.flow.current)

    def _load_one(self, packed):
        # Handed over: the offload keeps no reloaded tensor until the pass's reset (with `get`
        # every reloaded layer of a pass stayed allocated until the next one began).
        return self.off.take(packed.ref, self.rt.compute_stream())

    def _load(self, packed):
        ahead = None
        if self.prefetch and packed.pass_ is not None:
            ahead = lambda: self._prefetch(packed.pass_, packed.layer - 1)  # noqa: E731
        return _load_layer(packed, self._load_one, self._start, ahead)

    def _start(self, packed):
        self.off.prefetch(packed.ref)

    def _prefetch(self, pass_, layer):
        """Starts the reload of ``layer``'s group (one tag stands for its group)."""
        for ref in pass_.by_layer.get(layer, ()):
            other = ref()
            if other is not None and other.out is None:
                self.prefetched += self.off.prefetch(other.ref)
                return

    def stats(self):
        return {"prefetched_tensors": self.prefetched}

    def enter(self, i):
        if i == 0 and self.flow.start():
            self.off.init_chunk()
        if not self.flow.taking():
            return None
        self.layer = i
        # Megatron-LM's set_last_layer: the last layer's group, read first in backward, stays.
        self.off.set_last_layer(i == self.last)
        self.off.group_start(f"layer{i}")
        return _pushed(self._pack, _unpack_with(self._load))

    def exit(self, i, ctx):
        ctx.__exit__(None, None, None)
        self.off.group_commit(self.rt.compute_stream(None))


class _ContextFront:
    """A mode whose per-layer work is a ``with`` block (keyed swap, keep, compression)."""

    def __init__(self, make):
        self.make = make

    def enter(self, i):
        ctx = self.make(i)
        ctx.__enter__()
        return ctx

    def exit(self, i, ctx):
        ctx.__exit__(None, None, None)


class _OffloadPlan:
    """``attach(..., budget=...)`` / ``offload_fraction=...``: which layers the swap modes
    offload, chosen by ``hprt.plan_offload`` from a profiling pass. The first forward pass with
    grad offloads every layer while it measures each layer's swappable saved bytes and forward
    time (the compute stream synchronized at each layer's edges, in that pass only); the
    backward is taken as twice the forward (a transformer layer's usual ratio) and the link is
    ``Runtime.link_gbps()``. From the next pass on, a layer the plan keeps saves into autograd
    as without hprt. The choice is in ``stats()["plan"]``."""

    def __init__(self, rt, layers, budget, offload_fraction, user_predicate):
        self.rt, self.n = rt, layers
        self.budget = None if budget == "auto" else budget
        self.fraction, self.user_predicate = offload_fraction, user_predicate
        self.saved_bytes, self.forward_s = [0] * layers, [0.0] * layers
        self.chosen, self.result, self.current = None, None, None
        self.profiling, self.profiled, self.started = False, False, None

    def _sync(self):
        self.rt.compute_stream(None).synchronize()

    def pre(self, i):
        self.current = i
        if self.chosen is not None or not torch.is_grad_enabled() or _in_backward():
            return
        if i == 0:
            if self.profiled:
                self._decide()
                return
            self.profiling = True
        if self.profiling:
            self._sync()
            self.started = time.perf_counter()

    def post(self, i):
        self.current = None
        if self.profiling and self.started is not None:
            self._sync()
            self.forward_s[i] = time.perf_counter() - self.started
            self.started = None
            if i == self.n - 1:
                self.profiling, self.profiled = False, True

    def takes(self, t):
        """The swap modes' predicate: the user's, and the plan's layer choice."""
        if self.user_predicate is not None and not self.user_predicate(t):
            return False
        i = self.current
        if i is None:
            return True
        if self.chosen is None:
            if self.profiling:
                self.saved_bytes[i] += t.nbytes
            return True
        return i in self.chosen

    def _decide(self):
        link = self.rt.link_gbps()
        result = hprt.plan_offload(self.saved_bytes, self.forward_s,
                                   [2 * f for f in self.forward_s], link,
                                   budget=self.budget, offload_fraction=self.fraction)
        result.update(link_gbps=link, layer_saved_bytes=list(self.saved_bytes),
                      layer_forward_s=list(self.forward_s))
        self.chosen = {i for i, o in enumerate(result["offload"]) if o}
        self.result = result
        if not result["meets_target"]:
            warnings.warn(
                f"hprt.torch: the budget of {self.budget} bytes is out of reach (predicted peak "
                f"{result['predicted_peak_bytes']} bytes with every layer but the last "
                "offloaded); every offloadable layer is offloaded", RuntimeWarning, stacklevel=3)

    def stats(self):
        return {"plan": self.result}


def _check_plan_args(mode, budget, offload_fraction):
    if budget is None and offload_fraction is None:
        return
    if mode not in ("swap", "keyed", "pipeline"):
        raise ValueError(f"hprt.torch mode {mode!r} takes no budget or offload_fraction (the "
                         "swap modes do)")
    if budget is not None and offload_fraction is not None:
        raise ValueError("hprt.torch.attach: give a budget or an offload_fraction, not both")
    if budget is not None and budget != "auto" and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"hprt.torch.attach: budget must be a number of bytes (int >= 0) or "
                         f"'auto', not {budget!r}")
    if offload_fraction is not None and (isinstance(offload_fraction, bool) or not isinstance(
            offload_fraction, (int, float)) or not 0 <= offload_fraction <= 1):
        raise ValueError(f"hprt.torch.attach: offload_fraction must lie in [0, 1], not "
                         f"{offload_fraction!r}")


# The handle attached to each layer (one at a time: see ``_refuse_attached``).
_ATTACHED = weakref.WeakKeyDictionary()


def _refuse_attached(layers):
    """Refuses layers another ``attach`` handle still holds (two modes on one layer: the inner
    hooks take every saved tensor, the outer handle does nothing without a word)."""
    for layer in layers:
        other = _ATTACHED.get(layer)
        if other is not None and other.attached:
            raise ValueError(
                f"hprt.torch: layer {type(layer).__name__} is already attached (mode "
                f"{other.mode!r}); detach() that handle before attaching another mode")


class Attached:
    """What ``attach`` returns: ``detach()`` removes every hook it installed (also as a context
    manager), ``stats()`` reports hprt's statistics for the model."""

    def __init__(self, mode, layers, rt, settle, stats_extra=None, on_detach=()):
        self.mode, self.layers, self.runtime = mode, layers, rt
        self._handles, self._settle, self._stats_extra = [], settle, stats_extra
        self._on_detach = list(on_detach)
        for layer in layers:
            _ATTACHED[layer] = self

    def detach(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        for fn in self._settle + self._on_detach:
            fn()
        self._on_detach = []
        for layer in self.layers:
            if _ATTACHED.get(layer) is self:
                del _ATTACHED[layer]

    @property
    def attached(self):
        return bool(self._handles)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def stats(self):
        """Bytes of torch memory hprt keeps referenced (``device_current`` / ``device_peak``),
        offloaded / reloaded / compressed tensors and bytes, host-link bytes, pinned bytes in use
        and held, ``device_allocated`` where torch reports device memory. Every mode that
        compresses counts its tensors in ``compressed_tensors`` / ``compressed_bytes``; the
        compress modes add ``raw_bytes`` (what those tensors held before), ``compress`` its
        ``tensors`` / ``decoded_ahead`` and ``managed_compress`` its per-layer ``layers``."""
        for settle in self._settle:
            settle()
        s = self.runtime.stats()
        kind = self.runtime.platform.backend
        if kind in _STREAM_ATTR and hasattr(torch, kind) and getattr(torch, kind).is_available():
            s["device_allocated"] = getattr(torch, kind).memory_allocated()
        if self._stats_extra is not None:
            s.update(self._stats_extra())
        return s


def _host_compression_refused(what, where):
    """The compress modes encode CPU tensors on the host; on an accelerator they would leave
    every saved tensor to autograd, compressing nothing: refused, naming what does compress
    there (compress-then-swap, whose device codec runs on the accelerator)."""
    return hprt.UnsupportedError(
        f"{what} compresses CPU tensors on the cpu backend; {where}. On an accelerator use "
        "mode='swap' (or 'keyed' / 'pipeline') with compression='device' or 'auto': "
        "compress-then-swap, encoded on the device")


def _check_host_compression(model, mode, rt):
    devices = sorted({p.device.type for p in model.parameters()})
    if rt.backend != "cpu" or devices not in ([], ["cpu"]):
        raise _host_compression_refused(
            f"hprt.torch mode {mode!r}",
            f"this model's parameters are on {', '.join(devices) or 'no device'} and the "
            f"platform is {rt.backend!r}")


def _refuse_off_cpu(what, t):
    """A saved tensor the host codec would compress, were it a CPU tensor: refused on any
    other device (see ``_host_compression_refused``)."""
    if t.dtype in _CODEC_DTYPES and not t.is_cpu and t.numel() > 0 and not isinstance(
            t, nn.Parameter):
        raise _host_compression_refused(what, f"autograd saved a tensor on {t.device}")


def _compress_stats(comp):
    """``compress_saved_tensors.stats()`` with its count under ``stats()``'s common key."""
    s = comp.stats()
    s["compressed_tensors"] = s["tensors"]
    return s


def _managed_stats(comp):
    """``ManagedCompression``'s per-layer statistics (``layers``) and their totals under
    ``stats()``'s common keys."""
    layers = comp.stats()
    return {"layers": layers,
            "compressed_tensors": sum(s["compressed"] for s in layers.values()),
            "compressed_bytes": sum(s["compressed_bytes"] for s in layers.values()),
            "raw_bytes": sum(s["original_bytes"] for s in layers.values())}


def attach(model, mode="swap", *, layers=None, min_bytes=0, predicate=None, compression="off",
           platform=None, runtime_=None, prefetch=True, budget=None, offload_fraction=None,
           max_inflight_offload_bytes=None, max_inflight_reload_bytes=None):
    """Applies a mode to ``model``'s layers (``find_layers``, or ``layers`` given as a list or a
    dotted path) and returns an ``Attached`` handle.

    Modes: ``"swap"`` (hyper_parallel's layer groups), ``"keyed"`` (the keyed swap),
    ``"pipeline"`` (Megatron's fine-grained offload, a group per layer), ``"keep"`` (no swap,
    counted), ``"compress"`` (lossless compression in the pack hook), ``"managed_compress"``
    (MindSpeed's ActivationManager). ``compression`` (``off`` | ``device`` | ``host_stage`` |
    ``auto``) makes the swap modes compress-then-swap. Saved tensors smaller than
    ``min_bytes`` or refused by ``predicate(tensor)`` stay with autograd.

    The swap modes offload every layer but the last unless given ``budget`` (bytes of saved
    activations allowed on the device at the peak, or ``"auto"``: the layers whose copies hide
    behind compute) or ``offload_fraction`` (Megatron-LM's ``activation_offload_fraction``:
    that share of the layers, earliest first); the first forward pass then profiles (see
    ``_OffloadPlan``) and ``stats()["plan"]`` says what was chosen. ``max_inflight_offload_bytes``
    / ``max_inflight_reload_bytes`` bound the bytes on their way (an offload past the bound
    waits on the host for the oldest; a prefetch past it is left to its layer's own load).
    """
    if mode not in MODES:
        raise ValueError(f"unknown hprt.torch mode {mode!r}; one of {', '.join(MODES)}")
    if predicate is not None and mode not in ("swap", "keyed", "pipeline"):
        raise ValueError(f"hprt.torch mode {mode!r} takes no predicate (the swap modes do); "
                         "use min_bytes")
    _check_plan_args(mode, budget, offload_fraction)
    window = dict(max_inflight_offload_bytes=max_inflight_offload_bytes,
                  max_inflight_reload_bytes=max_inflight_reload_bytes)
    _check_attach_args(model, mode, layers, min_bytes, predicate, compression, runtime_,
                       prefetch, window)
    if isinstance(layers, str) or layers is None:
        layers = find_layers(model, layers)
    layers = list(layers)
    _check_layers(layers)
    _refuse_attached(layers)
    rt = runtime_ if runtime_ is not None else Runtime(platform, compression=compression,
                                                        **window)
    if runtime_ is not None and compression not in ("off", rt.compression):
        raise ValueError(
            f"hprt.torch.attach: compression={compression!r}, but the Runtime given "
            f"(runtime_=) compresses with {rt.compression!r}: a runtime's front ends share its "
            "setting; give it to Runtime(compression=...), or attach without runtime_")
    if mode in ("compress", "managed_compress"):
        _check_host_compression(model, mode, rt)
    # Nothing is installed above; from here on a failure removes what was (``undo``).
    undo = []
    try:
        return _attach(model, mode, layers, rt, runtime_, min_bytes, predicate, prefetch, budget,
                       offload_fraction, window, undo)
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise


def _attach(model, mode, layers, rt, runtime_, min_bytes, predicate, prefetch, budget,
            offload_fraction, window, undo):
    """``attach`` once its arguments are checked; appends to ``undo`` what removes each thing
    it installed, for a failure part way."""
    plan = None
    if budget is not None or offload_fraction is not None:
        plan = _OffloadPlan(rt, len(layers), budget, offload_fraction, predicate)
        predicate = plan.takes
    windowed = runtime_ is not None and any(v is not None for v in window.values())
    if mode == "swap":
        live = SwapManager._instances.get(id(rt))
        if live is not None and live.handles:
            # One manager per runtime (hyper_parallel's singleton): a second model's layers
            # would share its hooks, and either handle's detach would remove both.
            raise ValueError(
                "hprt.torch: this Runtime's SwapManager already has hooks on other layers (an "
                "attach(mode='swap') not detached, or set_forward_prefetch_layer); detach() them "
                "first, or attach this model with a Runtime of its own")
        mgr = SwapManager(rt, min_bytes=min_bytes, custom_check_fn=predicate)
        if live is None:  # made here: a failure forgets it again
            undo.append(lambda: SwapManager._instances.pop(id(rt), None))
        on_detach = [mgr.detach]
        if runtime_ is None:  # the handle's own runtime: its SwapManager goes with the handle
            on_detach.append(lambda: SwapManager._instances.pop(id(rt), None))
        handle = Attached(mode, layers, rt, [mgr.flow.settle], on_detach=on_detach,
                          stats_extra=plan and plan.stats)
        undo.append(handle.detach)
        handle._handles = mgr.handles
        if windowed:
            rt.layers.set_window(window["max_inflight_offload_bytes"],
                                 window["max_inflight_reload_bytes"])
        for a, b in zip(layers[:-1], layers[1:]):
            mgr.set_forward_prefetch_layer(a, b)
        if len(layers) == 1:
            mgr._layer(layers[0])
        handle._handles = mgr.handles
        _hook_plan(handle, layers, plan)
        return handle
    settle, extra, on_detach = [], None, []
    if mode == "keyed":
        front_end = rt.new_keyed()
        flow = _Flow(front_end.end_iteration)
        undo.append(lambda: rt.retire(front_end, flow))
        if windowed:
            front_end.set_window(window["max_inflight_offload_bytes"],
                                 window["max_inflight_reload_bytes"])
        tag = f"attach{id(rt)}.layers.*"
        ctxs = [TensorSwapContext(tag, predicate, prefetch, min_bytes, rt, (front_end, flow))
                for _ in layers]
        front, settle = _ContextFront(lambda i: ctxs[i]), [flow.settle]
        on_detach = [undo.pop()]
    elif mode == "pipeline":
        front = _PipelineFront(rt, min_bytes, predicate, prefetch, len(layers))
        undo.append(lambda: rt.retire(front.off, front.flow))
        if windowed:
            front.off.set_window(window["max_inflight_offload_bytes"],
                                 window["max_inflight_reload_bytes"])
        settle, extra = [front.flow.settle], front.stats
        on_detach = [undo.pop()]
    elif mode == "keep":
        front = _ContextFront(lambda i: keep_saved_tensors(rt, min_bytes))
    elif mode == "compress":
        comp = compress_saved_tensors(min_bytes, platform=rt.platform)
        front, extra = _ContextFront(lambda i: comp), lambda: _compress_stats(comp)
    else:
        comp = ManagedCompression(rt.platform, min_numel=max(1, min_bytes // 4),
                                  encode_gbps=1.0, decode_gbps=1.0)
        front, settle = _ContextFront(comp.layer), [comp.flow.settle]
        extra = lambda: _managed_stats(comp)  # noqa: E731
    if plan is not None:
        extra = _merged(extra, plan.stats)
    handle = Attached(mode, layers, rt, settle, extra, on_detach)
    undo.append(handle.detach)
    _hook_plan(handle, layers, plan)
    for i, layer in enumerate(layers):
        opened = []

        def pre(mod, args, i=i, opened=opened):
            opened.append(front.enter(i))

        def post(mod, args, output, i=i, opened=opened):
            ctx = opened.pop() if opened else None
            if ctx is not None:
                front.exit(i, ctx)

        handle._handles.append(layer.register_forward_pre_hook(pre))
        handle._handles.append(layer.register_forward_hook(post, always_call=True))
    return handle


_COMPRESSIONS = ("off", "device", "host_stage", "auto")


def _check_attach_args(model, mode, layers, min_bytes, predicate, compression, runtime_,
                       prefetch, window):
    """``attach``'s arguments, checked before anything is installed (a wrong type failed only
    inside the first forward, or part way through installing hooks)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"hprt.torch.attach: model must be a torch.nn.Module, not "
                        f"{type(model).__name__}")
    if layers is not None and not isinstance(layers, (str, list, tuple, nn.ModuleList,
                                                      nn.Sequential)):
        raise TypeError("hprt.torch.attach: layers= takes a list (or tuple, nn.ModuleList, "
                        "nn.Sequential) of modules or a dotted path such as 'model.layers', not "
                        f"{type(layers).__name__}")
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
        raise TypeError(f"hprt.torch.attach: min_bytes must be an int (bytes), not "
                        f"{type(min_bytes).__name__}")
    if min_bytes < 0:
        raise ValueError(f"hprt.torch.attach: min_bytes must be >= 0, not {min_bytes}")
    if predicate is not None and not callable(predicate):
        raise TypeError(f"hprt.torch.attach: predicate must be callable (tensor -> bool), not "
                        f"{type(predicate).__name__}")
    if not isinstance(prefetch, bool):
        raise TypeError(f"hprt.torch.attach: prefetch must be True or False, not {prefetch!r}")
    if not isinstance(compression, str) or compression not in _COMPRESSIONS:
        raise ValueError(f"hprt.torch.attach: compression must be one of "
                         f"{', '.join(map(repr, _COMPRESSIONS))}, not {compression!r}")
    if compression != "off" and mode not in ("swap", "keyed", "pipeline"):
        raise ValueError(
            f"hprt.torch mode {mode!r} does not swap: compression={compression!r} "
            "(compress-then-swap) applies to the swap modes ('swap', 'keyed', 'pipeline'); "
            "mode='compress' or 'managed_compress' compresses without swapping")
    if runtime_ is not None and not isinstance(runtime_, Runtime):
        raise TypeError(f"hprt.torch.attach: runtime_ must be an hprt.torch.Runtime, not "
                        f"{type(runtime_).__name__}")
    for name, value in window.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ValueError(f"hprt.torch.attach: {name} must be a number of bytes (int >= 0) "
                             f"or None, not {value!r}")


def _check_layers(layers):
    """The layer list: not empty, modules only, each once (a block named twice was linked
    after itself: attach failed part way, its hooks left behind)."""
    if not layers:
        raise ValueError("hprt.torch.attach: layers= is empty (nothing would be attached); name "
                         "the model's blocks, or leave layers= out to find them")
    seen = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"hprt.torch.attach: layers= must hold torch.nn.Module objects; "
                            f"item {i} is {type(layer).__name__}")
        j = seen.setdefault(id(layer), i)
        if j != i:
            raise ValueError(f"hprt.torch.attach: layers= names {type(layer).__name__} twice "
                             f"(items {j} and {i}); each layer once, in forward order")


def _merged(first, second):
    """Two ``stats()`` extras as one (either may be None)."""
    if first is None:
        return second
    return lambda: {**first(), **second()}


def _hook_plan(handle, layers, plan):
    """The plan's per-layer hooks (which layer runs, its profile), removed with the handle's."""
    if plan is None:
        return
    for i, layer in enumerate(layers):
        handle._handles.append(layer.register_forward_pre_hook(
            lambda mod, args, i=i: plan.pre(i)))
        handle._handles.append(layer.register_forward_hook(
            lambda mod, args, output, i=i: plan.post(i), always_call=True))
