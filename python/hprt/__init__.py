"""hprt: the hyper-parallel runtime from Python.

- Platform layer: ``get_platform()`` (``HP_PLATFORM`` = cpu | cuda | npu), ``cpu_platform()``,
  ``Platform``, ``Stream``, ``Event``, ``DeviceBuffer``, ``PinnedBuffer``, ``Communicator``.
- Tensors cross by DLPack (``Platform.from_dlpack(obj)``, ``buffer.view(dtype, shape)``
  implements ``__dlpack__``) or by raw pointer (``Platform.wrap_device_memory(ptr, nbytes,
  owner)``, ``Platform.wrap_stream(raw)``).
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

``hprt.torch`` (importable when torch is installed) hooks all of this into autograd, and gives
``fully_shard`` (sharded data parallel training of torch modules, from ``hprt.fsdp``).
"""

from . import _native
from ._native import *  # noqa: F401,F403  (the extension's public names)
from ._native import HprtError, KeyedSwap, get_platform

__all__ = [name for name in dir(_native) if not name.startswith("_")] + ["TensorSwapContext"]


class TensorSwapContext:
    """One layer of keyed swap (a ``saved_tensors_hooks`` design): ``TensorSwapContext(module_tag="model.layer.*")``.

    Every context made with the same tag is the next layer under that tag; all contexts share
    one ``KeyedSwap`` (per platform unless ``swap`` is given). ``pack(value, stream)`` where a
    value is saved, ``unpack(packed, stream)`` where it is read back; the last layer of a tag
    keeps its values on the device, earlier ones are offloaded and prefetched proportionally.
    """

    _shared = {}

    def __init__(self, module_tag="default", swap=None, platform=None, prefetch=True):
        if swap is None:
            key = id(platform) if platform is not None else None
            swap = TensorSwapContext._shared.get(key)
            if swap is None:
                swap = KeyedSwap(platform)
                TensorSwapContext._shared[key] = swap
        self.swap = swap
        self.module_tag = module_tag
        self.prefetch = prefetch
        self._ctx = swap.register_layer(module_tag)

    @property
    def layer_idx(self):
        return self._ctx.layer

    @property
    def layer_nums(self):
        return self.swap.layer_count(self._ctx)

    def pack(self, value, stream):
        return self.swap.pack(self._ctx, value, stream)

    def unpack(self, packed, stream):
        return self.swap.unpack(packed, stream, self.prefetch)

    @classmethod
    def reset(cls):
        """Forgets the shared swaps (and so every tag's layer count)."""
        cls._shared.clear()
