"""hprt.torch: activation swap (and compression) of PyTorch's saved tensors through hprt.

Importable only where torch is installed. This module is glue: hooks call hprt-swap's Rust front
ends, which hold every swap rule. A saved tensor becomes a *borrowed* payload
(``FrameworkMemory.tensor``): hprt borrows its memory, copies it to pinned memory on its d2h
stream after the framework's current stream and drops its reference (so torch frees it) only
after that copy completed; the reload lands in a fresh ``torch.empty_strided`` tensor (shape and
strides kept) made by the allocator callback, through hprt's h2d stream, which the current stream
(and, for CPU tensors, the host) waits for before autograd sees it.

Front ends, with the upstream names and semantics:

- ``TensorSwapContext(module_tag=...)`` (keyed swap, ``KeyedSwap``): a ``with`` block around one
  layer's forward; each new context of a tag is that tag's next layer.
- ``SwapManager().set_forward_prefetch_layer(a, b)`` (hyper_parallel layer groups, the Rust
  ``SwapManager``): module hooks on ``a`` and ``b`` drive ``forward_pre`` / ``forward_post`` /
  ``backward_pre`` / ``backward_post``.
- ``keep_saved_tensors()``: the no-swap baseline, counted by the same accounting.
- ``compress_saved_tensors()``: lossless compression of saved floating-point tensors, in the
  pack hook.
- ``ManagedCompression`` (MindSpeed): saved tensors registered per layer with hprt's
  ``ActivationManager``.

Sharded data parallel (``fully_shard``, ``run_on_ranks``, ``MixedPrecisionPolicy``, ...) lives in
``hprt.fsdp`` and is re-exported here.

``Runtime(compression=...)`` selects compress-then-swap (``off``, ``device``, ``host_stage``,
``auto``) for its front ends. ``runtime().stats()`` reports ``device_current`` / ``device_peak``
(bytes of torch memory hprt keeps referenced) and the front ends' engine counters.
"""

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
    "TensorSwapContext",
    "SwapManager",
    "keep_saved_tensors",
    "compress_saved_tensors",
    "ManagedCompression",
    "is_swappable",
]


def _is_dense(t):
    """Whether ``t``'s elements fill exactly ``numel * itemsize`` bytes from ``data_ptr()``."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# torch dtypes under hprt's names (what compress-then-swap can encode; others travel as bytes).
_HPRT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.float64: "f64"}

_COUNTERS = ("offloaded_tensors", "offloaded_bytes", "reloaded_tensors", "reloaded_bytes",
             "link_d2h_bytes", "link_h2d_bytes", "compressed_tensors", "compressed_bytes",
             "codec_ns")


class Runtime:
    """hprt's side of the integration for one platform: the framework-memory accounting, one
    keyed and one layer-group front end, and the compute stream standing for torch's."""

    def __init__(self, platform=None, host_budget=None, compression="off"):
        self.platform = platform if platform is not None else hprt.get_platform()
        self.memory = hprt.FrameworkMemory(self.platform)
        self.host_budget, self.compression = host_budget, compression
        self.layers = hprt.SwapManager(self.platform, host_budget=host_budget,
                                       compression=compression)
        self._keyed = []
        self._host_stream = self.platform.create_stream()

    def new_keyed(self):
        k = hprt.KeyedSwap(self.platform, host_budget=self.host_budget,
                           compression=self.compression)
        self._keyed.append(k)
        return k

    def compute_stream(self, device=None):
        """torch's current stream for ``device`` as an hprt stream."""
        if device is not None and torch.device(device).type == "cuda" and self.platform.backend == "cuda":
            return self.platform.wrap_stream(torch.cuda.current_stream(device).cuda_stream)
        # CPU tensors: torch's work is done when its call returns, so an idle hprt stream
        # orders after all of it.
        return self._host_stream

    def wait_host(self, t):
        """CPU tensors are used by the host at once: it waits for what the stream waits for."""
        if t.device.type == "cpu":
            self._host_stream.synchronize()
        return t

    def addressable(self, t):
        """Whether this platform's device memory holds ``t``."""
        backend = self.platform.backend
        return (backend == "cpu" and t.device.type == "cpu") or (
            backend == "cuda" and t.device.type == "cuda"
        )

    def borrow(self, t):
        """``t`` as a borrowed swap payload whose reload makes a tensor of its shape and
        strides."""
        shape, stride, dtype, device = t.size(), t.stride(), t.dtype, t.device
        return self.memory.tensor(
            t, lambda: torch.empty_strided(shape, stride, dtype=dtype, device=device),
            _HPRT_DTYPES.get(dtype, "u8"))

    def stats(self):
        s = dict(self.memory.stats())
        for k in _COUNTERS:
            s[k] = 0
        for front in [self.layers] + self._keyed:
            fs = front.stats()
            for k in _COUNTERS:
                s[k] += fs[k]
        return s

    def reset_peak(self):
        self.memory.reset_peak()

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
    if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
        return False
    if t.is_leaf and t.requires_grad:
        return False
    if t.numel() == 0 or t.nbytes < max(min_bytes, 1) or not rt.addressable(t) or not _is_dense(t):
        return False
    return custom_check_fn is None or bool(custom_check_fn(t))


class _Packed:
    """What the pack hook returns for a tensor handed to a front end; ``out`` keeps the unpacked
    tensor, so that a second unpack of the same value (``retain_graph``) gets the same one."""

    __slots__ = ("ref", "out")

    def __init__(self, ref):
        self.ref = ref
        self.out = None


_keyed_handlers = {}


class TensorSwapContext:
    """``with TensorSwapContext(module_tag="model.layer.*"):`` around one layer's forward."""

    context_map = {}

    def __init__(self, module_tag="default", custom_check_fn=None, prefetch=True, min_bytes=0, runtime_=None):
        self.module_tag = module_tag
        self.prefetch = prefetch
        self.rt = runtime_ if runtime_ is not None else runtime()
        self.swap = _keyed_handlers.get(id(self.rt))
        if self.swap is None:
            self.swap = _keyed_handlers[id(self.rt)] = self.rt.new_keyed()
        self._ctx = self.swap.register_layer(module_tag)
        TensorSwapContext.context_map[module_tag] = self._ctx.layer
        self.swap.set_min_bytes(min_bytes)
        self.set_custom_check_fn(custom_check_fn)
        self._hooks = None

    @property
    def layer_idx(self):
        return self._ctx.layer

    @property
    def layer_nums(self):
        return self.swap.layer_count(self._ctx)

    def set_custom_check_fn(self, fn):
        self.swap.set_predicate(fn)

    def _pack(self, t):
        if not is_swappable(t, self.rt):
            return t
        stream = self.rt.compute_stream(t.device)
        return _Packed(self.swap.swap_out_cur_and_release_prev(self._ctx, self.rt.borrow(t), stream))

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        if packed.out is None:
            stream = self.rt.compute_stream(None)
            out = self.swap.wait_cur_and_prefetch_next(packed.ref, stream, self.prefetch)
            packed.out = self.rt.wait_host(out)
        return packed.out

    def __enter__(self):
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None

    @classmethod
    def reset(cls):
        """Forgets every tag's layers (a new model)."""
        cls.context_map.clear()
        _keyed_handlers.clear()


class SwapManager:
    """hyper_parallel's layer-group swap on torch modules (one per runtime, like its
    singleton): module hooks call the Rust ``SwapManager``."""

    _instances = {}

    def __new__(cls, runtime_=None, min_bytes=0, custom_check_fn=None):
        rt = runtime_ if runtime_ is not None else runtime()
        inst = cls._instances.get(id(rt))
        if inst is None:
            inst = super().__new__(cls)
            inst.rt = rt
            inst.min_bytes = min_bytes
            inst.custom_check_fn = custom_check_fn
            inst.layers = {}
            cls._instances[id(rt)] = inst
        return inst

    @classmethod
    def reset(cls):
        cls._instances.clear()

    def _layer(self, module):
        layer = self.layers.get(id(module))
        if layer is None:
            layer = self.layers[id(module)] = self.rt.layers.new_layer()
            self._register_hooks(module, layer)
        return layer

    def set_forward_prefetch_layer(self, first_layer, second_layer):
        """``second_layer`` runs after ``first_layer`` in forward; idempotent."""
        self.rt.layers.set_forward_prefetch_layer(self._layer(first_layer), self._layer(second_layer))

    def _pack(self, t):
        if not is_swappable(t, self.rt, self.min_bytes, self.custom_check_fn):
            return t
        return _Packed(self.rt.layers.save(self.rt.borrow(t)))

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        if packed.out is None:
            packed.out = self.rt.wait_host(self.rt.layers.take(packed.ref))
        return packed.out

    def _register_hooks(self, module, layer):
        front, rt = self.rt.layers, self.rt
        open_hooks = {}

        def forward_pre(mod, args):
            if front.forward_pre(layer):
                ctx = saved_tensors_hooks(self._pack, self._unpack)
                ctx.__enter__()
                open_hooks[id(mod)] = ctx

        def forward_post(mod, args, output):
            ctx = open_hooks.pop(id(mod), None)
            if ctx is not None:
                ctx.__exit__(None, None, None)
            front.forward_post(layer, rt.compute_stream(None))

        def backward_pre(mod, grad_output):
            front.backward_pre(layer, rt.compute_stream(None))

        def backward_post(mod, grad_input, grad_output):
            front.backward_post(layer)

        module.register_forward_pre_hook(forward_pre)
        module.register_forward_hook(forward_post)
        module.register_full_backward_pre_hook(backward_pre)
        module.register_full_backward_hook(backward_post)


class keep_saved_tensors:
    """The no-swap baseline: saved tensors stay on the device, counted by the runtime's
    accounting like swapped ones (``with keep_saved_tensors(): loss = model(x)``)."""

    def __init__(self, runtime_=None, min_bytes=0):
        self.rt = runtime_ if runtime_ is not None else runtime()
        self.min_bytes = min_bytes
        self._hooks = None

    def _pack(self, t):
        if not is_swappable(t, self.rt, self.min_bytes):
            return t
        return self.rt.borrow(t)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, hprt.BorrowedTensor):
            return packed.tensor
        return packed

    def __enter__(self):
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None


_CODEC_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


class _Compressed:
    __slots__ = ("blob", "shape", "dtype", "nbytes")


class compress_saved_tensors:
    """Lossless compression of saved f32/f16/bf16 CPU tensors (``hprt.compress`` in pack,
    ``hprt.decompress_into`` a fresh tensor in unpack); ``stats`` counts raw and compressed
    bytes."""

    def __init__(self, min_bytes=0):
        self.min_bytes = min_bytes
        self.stats = {"tensors": 0, "raw_bytes": 0, "compressed_bytes": 0}
        self._hooks = None

    def _pack(self, t):
        if (
            t.dtype not in _CODEC_DTYPES
            or t.device.type != "cpu"
            or isinstance(t, nn.Parameter)
            or (t.is_leaf and t.requires_grad)
            or t.numel() == 0
            or t.nbytes < self.min_bytes
        ):
            return t
        c = _Compressed()
        c.blob = hprt.compress(t.detach().contiguous())
        c.shape, c.dtype, c.nbytes = t.size(), t.dtype, t.nbytes
        self.stats["tensors"] += 1
        self.stats["raw_bytes"] += t.nbytes
        self.stats["compressed_bytes"] += len(c.blob)
        return c

    @staticmethod
    def _unpack(packed):
        if not isinstance(packed, _Compressed):
            return packed
        out = torch.empty(packed.shape, dtype=packed.dtype)
        hprt.decompress_into(packed.blob, out)
        return out

    def __enter__(self):
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None


class _ManagedKey:
    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key


class ManagedCompression:
    """Seed-003 activation compression through hprt's ``ActivationManager``.

    ``with comp.layer(i): x = block(x)`` around each layer's forward: tensors the layer saves
    (f32/f16/bf16, dense, at least ``min_numel`` elements, not parameters) are copied into
    hprt device memory and registered under layer ``i``; the layer's forward is an operator
    window of ``window_ms`` in which the previous layer's tensors are encoded on the manager's
    side stream and released. In backward, the first tensor read of a layer starts that layer's
    backward, which decodes its tensors still compressed; the tensor comes back as a view of
    hprt memory. ``stats()`` is ``ActivationManager.layer_stats()``.

    Throughputs are measured on the platform unless ``encode_gbps`` and ``decode_gbps`` are
    given. Works where the platform addresses torch's memory as device memory (the cpu backend
    with CPU tensors); other tensors are left to autograd.
    """

    def __init__(self, platform=None, min_numel=32768, window_ms=10.0, encode_gbps=None,
                 decode_gbps=None):
        self.platform = platform if platform is not None else hprt.get_platform()
        self.stream = self.platform.create_stream()
        self.manager = hprt.ActivationManager(
            self.stream, self.platform, encode_gbps=encode_gbps, decode_gbps=decode_gbps,
            min_numel=min_numel)
        self.window_ms = window_ms
        self._backward_layer = None

    def _eligible(self, t):
        return (
            t.dtype in _CODEC_DTYPES
            and t.device.type == "cpu"
            and self.platform.backend == "cpu"
            and not isinstance(t, nn.Parameter)
            and not (t.is_leaf and t.requires_grad)
            and t.is_contiguous()
            and t.numel() > 0
        )

    def _pack(self, layer, t):
        if not self._eligible(t):
            return t
        key = self.manager.save(layer, t.detach())
        return t if key is None else _ManagedKey(key)

    def _unpack(self, packed):
        if not isinstance(packed, _ManagedKey):
            return packed
        layer = packed.key[0]
        if self._backward_layer != layer:
            self.manager.backward_start(layer)
            self._backward_layer = layer
        out = self.manager.take(packed.key)
        self.stream.synchronize()
        return torch.from_dlpack(out)

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
        o._backward_layer = None
        o.manager.forward_start(self.layer)
        self._window = o.manager.window(fixed_ms=o.window_ms)
        self._window.__enter__()
        self._hooks = saved_tensors_hooks(lambda t: o._pack(self.layer, t), o._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._window.__exit__(*exc)
        self._window = None
