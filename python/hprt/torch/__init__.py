"""hprt.torch: activation swap (and compression) of PyTorch's saved tensors through hprt.

Importable only where torch is installed. This package is glue: hooks call hprt-swap's Rust front
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

The modes share the pass and hook machinery of ``passes`` (``_Flow``, ``_Packed``,
``_Witness``) and the platform glue of ``runtimes`` / ``memory``; each front end lives in a
module of its own (``keyed``, ``layer_groups``, ``pipeline``, ``compression``,
``managed_compression``) and ``modes`` puts them on a model (``attach``, with ``plan``'s layer
choice). This package only gathers their public names.
"""

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

# The modules' names, and the private ones that hprt.TensorSwapContext, the tests and the
# benchmarks read or patch here (the modules look the patched ones up here when called).
from .compression import (  # noqa: F401
    _CODEC_THREAD_MIN_BYTES,
    compress_saved_tensors,
    keep_saved_tensors,
)
from .keyed import TensorSwapContext, _keyed_enter  # noqa: F401
from .layer_groups import (  # noqa: F401
    ActivationPolicy,
    CheckpointPolicy,
    CheckpointWrapper,
    SwapManager,
    SwapWrapper,
    checkpoint_wrapper,
    swap_tensor_wrapper,
    swap_wrapper,
)
from .managed_compression import ManagedCompression  # noqa: F401
from .memory import (  # noqa: F401
    _empty_like_layout,
    _host_reload,
    _is_dense,
    _layout,
    _platform_empty,
    _stream_recorder,
    _StreamRecorder,
)
from .modes import _ATTACHED, MODES, Attached, attach, find_layers  # noqa: F401
from .passes import OverlappingForwardWarning  # noqa: F401
from .pipeline import (  # noqa: F401
    FineGrainedActivationOffloadingInterface,
    PipelineOffloadManager,
    fine_grained_offloading_backward_record,
    fine_grained_offloading_disable_offload,
    fine_grained_offloading_enable_offload,
    fine_grained_offloading_forward_record,
    fine_grained_offloading_group_commit,
    fine_grained_offloading_group_flush_delayed_groups,
    fine_grained_offloading_group_start,
    fine_grained_offloading_init_chunk_handler,
    fine_grained_offloading_reset,
    fine_grained_offloading_set_last_layer,
    get_fine_grained_offloading_context,
)
from .runtimes import _STREAM_ATTR, Runtime, is_swappable, runtime  # noqa: F401

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
