"""hprt.torch: activation swap (and compression) of PyTorch's saved tensors through hprt.

Importable only where torch is installed. Everything here moves torch's own tensors: a saved
tensor's memory is borrowed by hprt (``FrameworkSwap``), copied to pinned memory on hprt's d2h
stream after the framework's current stream, and released only after that copy completed; it
comes back into a fresh ``torch.empty_strided`` tensor through hprt's h2d stream, which the
current stream (and, for CPU tensors, the host) waits for before autograd sees it.

Front ends, with the seeds' names and semantics:

- ``TensorSwapContext(module_tag=...)`` (keyed swap): a ``with`` block around one layer's
  forward; each new context of a tag is that tag's next layer. Saving in a new layer releases
  the previous layer's device copies; the tag's last layer stays on the device; reading a saved
  tensor in backward prefetches its proportional share of the previous layer.
- ``SwapManager().set_forward_prefetch_layer(a, b)`` (layer groups): module hooks on ``a`` and
  ``b``; after a layer's forward its group is offloaded and the previous group's offload waited;
  before a layer's backward the previous group is prefetched and the own group waited.
- ``keep_saved_tensors()``: the no-swap baseline, counted by the same accounting.
- ``compress_saved_tensors()``: lossless compression of saved floating-point tensors, in the
  pack hook.
- ``ManagedCompression`` (seed 003): saved tensors registered per layer with hprt's
  ``ActivationManager``; while one layer's forward runs, the previous layer's tensors are encoded
  on a side stream and their memory released; in backward they are decoded when their layer's
  backward starts. ``stats()`` gives the per-layer ratios.

Sharded data parallel (``fully_shard``, ``run_on_ranks``, ``MixedPrecisionPolicy``, ...) lives in
``hprt.fsdp`` and is re-exported here.

``runtime().stats()`` reports ``device_current`` / ``device_peak`` (bytes of torch memory hprt
keeps referenced: saved tensors not yet released, plus reloads in flight) and offloaded bytes.
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


class Runtime:
    """hprt's side of the integration for one platform: a ``FrameworkSwap`` (d2h and h2d
    streams, pinned pool, accounting) and the compute stream standing for torch's."""

    def __init__(self, platform=None, host_budget=None):
        self.platform = platform if platform is not None else hprt.get_platform()
        self.swap = hprt.FrameworkSwap(self.platform, host_budget)
        self._host_stream = self.swap.platform_stream()

    def compute_stream(self, t):
        """torch's current stream for ``t`` as an hprt stream."""
        if t.device.type == "cuda" and self.platform.backend == "cuda":
            return self.platform.wrap_stream(torch.cuda.current_stream(t.device).cuda_stream)
        # CPU tensors: torch's work is done when its call returns, so an idle hprt stream
        # orders after all of it.
        return self._host_stream

    def addressable(self, t):
        """Whether this platform's device memory holds ``t``."""
        backend = self.platform.backend
        return (backend == "cpu" and t.device.type == "cpu") or (
            backend == "cuda" and t.device.type == "cuda"
        )

    def stats(self):
        return self.swap.stats()

    def reset_peak(self):
        self.swap.reset_peak()

    def synchronize(self):
        self.swap.synchronize()


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
    """The seed's eligibility test: a non-empty dense tensor on this platform's device, not a
    parameter (nor a leaf that requires grad), at least ``min_bytes``, accepted by
    ``custom_check_fn``."""
    if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
        return False
    if t.is_leaf and t.requires_grad:
        return False
    if t.numel() == 0 or t.nbytes < max(min_bytes, 1) or not rt.addressable(t) or not _is_dense(t):
        return False
    return custom_check_fn is None or bool(custom_check_fn(t))


class _Saved:
    """One saved tensor on its way through host memory."""

    __slots__ = ("tensor", "host", "shape", "stride", "dtype", "device", "nbytes", "result")

    def __init__(self, t):
        self.tensor = t  # held until the offload is launched
        self.host = None
        self.shape, self.stride = t.size(), t.stride()
        self.dtype, self.device, self.nbytes = t.dtype, t.device, t.nbytes
        self.result = None

    def offload(self, rt):
        t, self.tensor = self.tensor, None
        self.host = rt.swap.offload(t.data_ptr(), t.nbytes, t, rt.compute_stream(t))

    def release(self):
        """Waits for the offload; torch's memory is then free (unless others reference it)."""
        if self.host is not None and self.host.state == "d2h":
            self.host.wait_offload()

    def prefetch(self, rt):
        if self.host is not None and self.host.state == "host":
            out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
            self.host.start_reload(out.data_ptr(), out.nbytes, out, rt.compute_stream(out))

    def get(self, rt):
        if self.result is not None:
            return self.result
        if self.tensor is not None:
            return self.tensor
        if self.host.state == "d2h":
            # Its offload was never waited for: the original memory is still there.
            self.result = self.host.take_back()
            return self.result
        self.prefetch(rt)
        stream = rt.compute_stream(torch.empty(0, device=self.device))
        self.result = self.host.finish_reload(stream, self.device.type == "cpu")
        return self.result


class _KeyedHandler:
    """The seed-001 ``AsyncSwapHandler``: (layer, index) keys, release of the previous layer
    when a new one starts saving, proportional prefetch of the previous layer on unpack."""

    def __init__(self, rt):
        self.rt = rt
        self.current = None
        self.counts = {}
        self.saved = {}

    def next_key(self, layer):
        new_layer = False
        if self.current == layer:
            self.counts[layer] += 1
        elif self.current is not None and layer < self.current:
            self.counts = {layer: 1}  # a new step
        else:
            self.counts[layer] = 1
            new_layer = layer != 0
        self.current = layer
        return (layer, self.counts[layer] - 1), new_layer

    def pack(self, t, layer, layer_nums):
        key, new_layer = self.next_key(layer)
        if new_layer:
            for (lay, _), s in list(self.saved.items()):
                if lay == layer - 1:
                    s.release()
        s = _Saved(t)
        if layer + 1 < layer_nums:
            s.offload(self.rt)
        self.saved[key] = s
        return key

    def unpack(self, key, prefetch):
        s = self.saved.pop(key)
        out = s.get(self.rt)
        layer, index = key
        if prefetch and layer > 0:
            lo, hi = hprt.proportional_slice(index, self.counts.get(layer, 0), self.counts.get(layer - 1, 0))
            for i in range(lo, hi):
                p = self.saved.get((layer - 1, i))
                if p is not None:
                    p.release()
                    p.prefetch(self.rt)
        return out


_keyed_handlers = {}


class TensorSwapContext:
    """``with TensorSwapContext(module_tag="model.layer.*"):`` around one layer's forward."""

    context_map = {}

    def __init__(self, module_tag="default", custom_check_fn=None, prefetch=True, min_bytes=0, runtime_=None):
        self.module_tag = module_tag
        TensorSwapContext.context_map[module_tag] = TensorSwapContext.context_map.get(module_tag, -1) + 1
        self.layer_idx = TensorSwapContext.context_map[module_tag]
        self.prefetch = prefetch
        self.custom_check_fn = custom_check_fn
        self.min_bytes = min_bytes
        self.rt = runtime_ if runtime_ is not None else runtime()
        self.handler = _keyed_handlers.setdefault(id(self.rt), _KeyedHandler(self.rt))
        self._hooks = None

    @property
    def layer_nums(self):
        return TensorSwapContext.context_map[self.module_tag] + 1

    def set_custom_check_fn(self, fn):
        self.custom_check_fn = fn

    def _pack(self, t):
        if not is_swappable(t, self.rt, self.min_bytes, self.custom_check_fn):
            return t
        return ("hprt-key", self.handler.pack(t, self.layer_idx, self.layer_nums))

    def _unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 2 and packed[0] == "hprt-key":
            return self.handler.unpack(packed[1], self.prefetch)
        return packed

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


class _Group:
    def __init__(self, name):
        self.name = name
        self.saved = []
        self.prev = None
        self.next = None
        self.phase = "forward"


class SwapManager:
    """The seed-000 layer-group swap on torch modules (one per runtime, like the seed's
    singleton)."""

    _instances = {}

    def __new__(cls, runtime_=None, min_bytes=0, custom_check_fn=None):
        rt = runtime_ if runtime_ is not None else runtime()
        inst = cls._instances.get(id(rt))
        if inst is None:
            inst = super().__new__(cls)
            inst.rt = rt
            inst.min_bytes = min_bytes
            inst.custom_check_fn = custom_check_fn
            inst.groups = {}
            inst._hooks = {}
            cls._instances[id(rt)] = inst
        return inst

    @classmethod
    def reset(cls):
        cls._instances.clear()

    def _group(self, module):
        g = self.groups.get(id(module))
        if g is None:
            g = _Group(f"swap_group_{len(self.groups)}")
            self.groups[id(module)] = g
            self._register_hooks(module, g)
        return g

    def set_forward_prefetch_layer(self, first_layer, second_layer):
        """``second_layer`` runs after ``first_layer`` in forward; idempotent."""
        a, b = self._group(first_layer), self._group(second_layer)
        if a.next is None:
            a.next = b
        if b.prev is None:
            b.prev = a

    def _pack(self, g, t):
        if not is_swappable(t, self.rt, self.min_bytes, self.custom_check_fn):
            return t
        s = _Saved(t)
        g.saved.append(s)
        return s

    def _unpack(self, packed):
        return packed.get(self.rt) if isinstance(packed, _Saved) else packed

    def _register_hooks(self, module, g):
        hooks = self._hooks

        def forward_pre(mod, args):
            if g.phase == "pre_backward":
                return  # a recomputed forward during backward (checkpointing)
            g.saved = []
            ctx = saved_tensors_hooks(lambda t: self._pack(g, t), self._unpack)
            ctx.__enter__()
            hooks[id(mod)] = ctx

        def forward_post(mod, args, output):
            ctx = hooks.pop(id(mod), None)
            if ctx is None:
                return
            ctx.__exit__(None, None, None)
            if g.next is not None:
                for s in g.saved:
                    s.offload(self.rt)
            if g.prev is not None:
                for s in g.prev.saved:
                    s.release()

        def backward_pre(mod, grad_output):
            g.phase = "pre_backward"
            if g.prev is not None:
                for s in g.prev.saved:
                    s.release()
                    s.prefetch(self.rt)
            if g.next is not None:
                for s in g.saved:
                    s.release()
                    s.prefetch(self.rt)

        def backward_post(mod, grad_input, grad_output):
            g.phase = "forward"
            g.saved = []

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
        return self.rt.swap.keep(t.data_ptr(), t.nbytes, t)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, hprt.HostCopy):
            return packed.take_back()
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
