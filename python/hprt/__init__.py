"""hprt: the hyper-parallel runtime from Python.

- Platform layer: ``get_platform()`` (``HP_PLATFORM`` = cpu | cuda | npu), ``cpu_platform()``,
  ``Platform``, ``Stream``, ``Event``, ``DeviceBuffer``, ``PinnedBuffer``, ``Communicator``;
  ``StreamClock`` (``mark(stream)``: when a stream reached a point, in ``time.perf_counter()``
  seconds; hprt's one stream clock, which ``hprt.fsdp.StreamTrace`` uses).
- Tensors cross by DLPack (``Platform.from_dlpack(obj)``, ``buffer.view(dtype, shape)``
  implements ``__dlpack__``; the memory cannot be freed while an export lives) or by raw
  pointer (``Platform.unsafe_wrap_device_memory(ptr, nbytes, owner)``: unchecked,
  ``Platform.unsafe_wrap_stream(raw)``; ``wrap_stream(raw)`` takes what it can check).
- Swap: ``SwapManager`` (hyper_parallel's layer groups: module hooks and ``add_storage`` /
  ``launch_offload`` / ``wait_offload`` / ``launch_load`` / ``wait_load``), ``KeyedSwap`` /
  ``TensorSwapContext`` (``swap_out_cur_and_release_prev`` / ``wait_cur_and_prefetch_next``;
  ``TensorKeyManager`` with ``get_key`` / ``get_prefetch_keys``),
  ``PipelineOffload`` (Megatron's ``group_start`` / ``group_commit``); each takes hprt
  ``DeviceTensor``s or a framework's own tensors as borrowed payloads
  (``FrameworkMemory.tensor``; what ``hprt.torch`` uses), and ``compression="device" |
  "host_stage" | "auto"`` for compress-then-swap.
- Compression: ``compress`` / ``decompress`` / ``decompress_into`` (the lossless codec) and
  ``ActivationManager`` (saved tensors per layer, encoded in operator windows, per-layer ratios).
- hsdp: ``DeviceMesh``, ``DataParallelMesh`` (FSDP / HSDP / DDP), ``GroupCache``,
  ``HsdpStreams``, ``MixedPrecisionPolicy``, ``ShardedParam`` (shard, async unshard, gradient
  reduction).
- Errors: ``HprtError`` and its subclasses; ``err.status`` is the backend's status name.

``import hprt`` does not import torch; ``hprt.torch`` (importable when torch is installed) hooks
all of this into autograd, and gives
``fully_shard`` (sharded data parallel training of torch modules, from ``hprt.fsdp``).
"""

from . import _native
from ._native import *  # noqa: F401,F403  (the extension's public names)
from ._native import HprtError, KeyedSwap, get_platform

__all__ = [name for name in dir(_native) if not name.startswith("_")] + ["TensorSwapContext"]


class TensorSwapContext:
    """One layer of keyed swap: ``TensorSwapContext(module_tag="model.layer.*")``, for hprt's
    own values and for torch's saved tensors (one class: ``hprt.torch.TensorSwapContext`` is
    this class).

    Every context made with the same tag is the next layer under that tag; contexts share one
    ``KeyedSwap`` (per platform, or per ``hprt.torch.Runtime`` given as ``runtime_``, unless
    ``swap`` is given). ``pack(value, stream)`` where a value is saved, ``unpack(packed,
    stream)`` where it is read back (explicit streams, hprt values); ``with ctx:`` around one
    layer's forward hooks torch's saved tensors instead (it imports ``hprt.torch``, and so
    torch, on first use: see there). The last layer of a tag keeps its values on the device,
    earlier ones are offloaded and prefetched proportionally. ``min_bytes`` and
    ``custom_check_fn(tensor)`` are the shared ``KeyedSwap``'s eligibility rules (set when
    given).
    """

    context_map = {}  # module_tag -> its latest layer index
    _shared = {}  # platform (or runtime) -> its KeyedSwap
    _flows = {}  # id(KeyedSwap) -> the forward passes hprt.torch follows on it

    def __init__(self, module_tag="default", custom_check_fn=None, prefetch=True, min_bytes=None,
                 runtime_=None, swap=None, platform=None):
        self._flow = None
        if isinstance(swap, tuple):  # hprt.torch.attach: its own KeyedSwap and pass follower
            swap, self._flow = swap
        if swap is None:
            key = ("runtime", id(runtime_)) if runtime_ is not None else (
                id(platform) if platform is not None else None)
            swap = TensorSwapContext._shared.get(key)
            if swap is None:
                swap = runtime_.new_keyed() if runtime_ is not None else KeyedSwap(platform)
                TensorSwapContext._shared[key] = swap
        self.swap = swap
        self.module_tag = module_tag
        self.prefetch = prefetch
        self.runtime_, self.platform = runtime_, platform
        self._ctx = swap.register_layer(module_tag)
        TensorSwapContext.context_map[module_tag] = self._ctx.layer
        if min_bytes is not None:
            swap.set_min_bytes(min_bytes)
        if custom_check_fn is not None:
            self.set_custom_check_fn(custom_check_fn)
        self._hooks = []

    @property
    def layer_idx(self):
        return self._ctx.layer

    @property
    def layer_nums(self):
        return self.swap.layer_count(self._ctx)

    def set_custom_check_fn(self, fn):
        self.swap.set_predicate(fn)

    def pack(self, value, stream):
        return self.swap.pack(self._ctx, value, stream)

    def unpack(self, packed, stream):
        return self.swap.unpack(packed, stream, self.prefetch)

    def __enter__(self):
        from . import torch as hooks  # the with-block is the torch integration

        self._hooks.append(hooks._keyed_enter(self))
        return self

    def __exit__(self, *exc):
        ctx = self._hooks.pop()
        if ctx is not None:
            ctx.__exit__(*exc)

    @classmethod
    def reset(cls):
        """Forgets the shared swaps (and so every tag's layer count)."""
        cls._shared.clear()
        cls._flows.clear()
        cls.context_map.clear()
