"""hprt.fsdp: ``fully_shard`` — sharded data parallel training of torch modules over hprt-hsdp.

The names and semantics are hyper_parallel's ``fully_shard`` and torch FSDP2's (applied to each
block, then to the root)::

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)

Each parameter becomes an hprt ``ShardedParam`` (hyper_parallel's ``HSDPParamV2``); the
module's registered parameter is replaced by a torch ``nn.Parameter`` that *is* this rank's
shard (hprt memory seen through DLPack, padding included: ``ShardedParam.shard_shape``), so an
optimizer over ``model.parameters()`` updates the shards as ordinary torch parameters.

Around a block's forward the parameters are all-gathered (the next block's all-gather is
issued on hprt's all-gather stream as this one starts: prefetch), and freed again after it
(``reshard_after_forward``). Tensors that autograd saves from the gathered memory are saved as
references and re-gathered for backward, where the previous block is prefetched. As each
parameter's gradient is accumulated, its reduce-scatter (+ all-reduce across replicas on a 2-D
mesh) is issued on hprt's reduce stream while backward goes on; a block reshards when all its
gradients arrived; the last callback of backward waits for the reductions and sets each shard's
``.grad`` to its reduced sharded gradient.

Ranks: ``run_on_ranks(n, fn)`` runs ``fn(rank)`` on ``n`` threads of this process (the cpu
backend and the emulators: ranks of one world are threads of one process there), each with its
own torch CPU generator state, a failing rank aborting the others' collectives;
``init_from_process_group()`` makes the hprt communicator of a torchrun-launched process per
device, passing the unique id through ``torch.distributed``.

Backends (how torch sees hprt's memory: ``_torch_memory``): on the cpu backend torch's tensors
are views of hprt's memory; on the Ascend and CUDA emulators (torch computes on the host) the
gathered parameters and gradients are staged through pinned host memory; where torch has the
platform's device (CUDA, or NPU through torch_npu) torch's device tensors are copied to and
from hprt's on torch's current stream — that path is untested on hardware.

The package gathers the public names; the code lives by concern: ``ranks`` (rank contexts,
``run_on_ranks``), ``mesh``, ``memory`` (how torch sees hprt's memory), ``params`` (one managed
parameter), ``state`` (a module's gathers, hooks and backward), ``module`` (``fully_shard``,
``FSDPModule``), ``policies`` and ``state_dict``.
"""

# The modules' public names, and the private ones the tests read here (``_context``,
# ``_HostDeviceMemory``).
from .memory import _HostDeviceMemory  # noqa: F401
from .mesh import RankMesh, StreamTrace, init_device_mesh
from .module import FSDPModule, fully_shard
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .ranks import (  # noqa: F401
    RanksFailed,
    _context,
    get_rank,
    get_world_size,
    init_from_process_group,
    run_on_ranks,
)
from .state_dict import get_model_state_dict, set_model_state_dict

__all__ = [
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "RankMesh",
    "StreamTrace",
    "init_device_mesh",
    "run_on_ranks",
    "RanksFailed",
    "init_from_process_group",
    "get_rank",
    "get_world_size",
    "get_model_state_dict",
    "set_model_state_dict",
]
