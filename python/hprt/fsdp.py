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
from hprt's on torch's current stream — that path is untested on hardware.

(Over 800 lines because the module state, its parameter group and the autograd hooks share
private per-block state; the sections below follow that order.)
"""

import functools
import os
import threading
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import hprt

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


# ---------------------------------------------------------------------------------------------
# Policies


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's / hyper_parallel's mixed precision: gather and compute in ``param_dtype``,
    reduce gradients in ``reduce_dtype`` (default: ``param_dtype``), cast module outputs to
    ``output_dtype``, cast floating-point forward inputs to ``param_dtype``. The shards (what the
    optimizer updates) keep the parameters' own dtype."""

    param_dtype: torch.dtype = None
    reduce_dtype: torch.dtype = None
    output_dtype: torch.dtype = None
    cast_forward_inputs: bool = True

    def _hprt(self):
        name = lambda d: None if d is None else str(d)  # noqa: E731  (hprt parses torch names)
        return hprt.MixedPrecisionPolicy(
            param_dtype=name(self.param_dtype),
            reduce_dtype=name(self.reduce_dtype),
            output_dtype=name(self.output_dtype),
        )


class OffloadPolicy:
    """No offload: shards and sharded gradients stay in device memory (FSDP2's base class)."""

    _hprt = "none"


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Shards and sharded gradients live in pinned host memory; only gathered parameters take
    device memory. The optimizer steps on the host copies."""

    pin_memory: bool = True
    _hprt = "pinned_host"

    def __post_init__(self):
        if not self.pin_memory:
            raise ValueError(
                "CPUOffloadPolicy(pin_memory=False): hprt keeps offloaded shards in pinned host "
                "memory (its copies are asynchronous); use pin_memory=True"
            )


# ---------------------------------------------------------------------------------------------
# Ranks

_CPU_RANKS = (
    "the cpu backend's ranks are threads of one process: run them with "
    "hprt.torch.run_on_ranks(world_size, fn) in one process (HP_PLATFORM=cuda or npu for one "
    "process per device)"
)


class _RankContext:
    def __init__(self, platform, comm, rank, world_size):
        self.platform, self.comm = platform, comm
        self.rank, self.world_size = rank, world_size
        self._cache = self._streams = self._memory = None
        self.meshes = {}
        self._groups = []  # the sub-communicators fsdp made in Python (abort destroys them)
        self._params = []  # weak references to this rank's _FSDPParams (abort destroys their groups)

    def group_along(self, name, mesh, axes):
        """``cache.group_along``, remembered so that ``abort`` can destroy its communicator."""
        group = self.cache.group_along(name, mesh, axes)
        if group.communicator is not None:
            self._groups.append(group)
        return group

    def track(self, param):
        if len(self._params) >= 64 and len(self._params) & (len(self._params) - 1) == 0:
            self._params = [r for r in self._params if r() is not None]  # prune now and then
        self._params.append(weakref.ref(param))

    def abort(self):
        """Aborts every communicator of this rank that fsdp knows (the parameters' groups,
        fsdp's own groups, the world): a peer waiting for this rank in a collective over one of
        them fails at once (the cpu backend: "rank r destroyed its communicator"; cuda: NCCL's
        abort, seen by the peers' watchdog) instead of at the collective timeout. HCCL has no
        abort: on npu the peers fail at HCCL's timeout, and ``run_on_ranks`` still reports this
        rank's error first. What a failed rank does before ``run_on_ranks`` reports."""
        for ref in self._params:
            p = ref()
            if p is not None:
                _ignore_hprt_errors(p.sp.destroy_groups)
        for group in self._groups:
            _ignore_hprt_errors(group.communicator.abort)
        _ignore_hprt_errors(self.comm.abort)

    @property
    def cache(self):
        """The rank's sub-communicators (one cache per world communicator)."""
        if self._cache is None:
            self._cache = hprt.GroupCache(self.comm)
        return self._cache

    @property
    def memory(self):
        """How torch sees hprt's memory on this rank (``_torch_memory``)."""
        if self._memory is None:
            self._memory = _torch_memory(self.platform)
        return self._memory

    @property
    def streams(self):
        """The compute / all-gather / reduce streams every fully_shard module of the rank uses
        (the compute stream is torch's where torch computes on the platform's device)."""
        if self._streams is None:
            compute = self.memory.compute_stream()
            self._streams = hprt.HsdpStreams(self.platform, compute=compute)
        return self._streams


_tls = threading.local()
_process_ctx = None


def _context():
    ctx = getattr(_tls, "ctx", None) or _process_ctx
    if ctx is None:
        raise RuntimeError(
            "no hprt rank: run the ranks with hprt.torch.run_on_ranks(world_size, fn) (threads "
            "of one process: cpu backend, emulators) or call hprt.torch.init_from_process_group() "
            "(one process per device, e.g. under torchrun)"
        )
    return ctx


def get_rank():
    """This rank in the hprt world (the calling thread's under ``run_on_ranks``)."""
    return _context().rank


def get_world_size():
    return _context().world_size


def _ignore_hprt_errors(f):
    try:
        f()
    except hprt.HprtError:  # already destroyed (shared by several parameters), or unusable
        pass


class _RankRNG(TorchDispatchMode):
    """One rank thread's own torch CPU generator state (ranks of ``run_on_ranks`` are threads
    of one process, and torch has one global CPU generator): every random operation the thread
    runs without an explicit ``generator`` (``nn.init``, ``torch.randn``, dropout, ...) and the
    thread's ``torch.manual_seed`` / ``seed`` / ``initial_seed`` / ``get_rng_state`` /
    ``set_rng_state`` use this state, swapped into the global generator under a process-wide
    lock, as each rank would use its own process's generator under torchrun."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def run(self, f, *args, **kwargs):
        g = torch.default_generator
        with _rng_lock:
            outer = g.get_state()
            g.set_state(self.state)
            try:
                return f(*args, **kwargs)
            finally:
                self.state = g.get_state()
                g.set_state(outer)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None:
            return self.run(func, *args, **kwargs)
        return func(*args, **kwargs)


_rng_lock = threading.Lock()
_rng_patch = {"depth": 0, "lock": threading.Lock()}
# The torch functions that read or set the global CPU generator; under run_on_ranks a rank
# thread's calls use its own state (other threads' calls are untouched).
_RNG_FUNCTIONS = ("manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state")


def _rank_aware(orig):
    @functools.wraps(orig)
    def call(*args, **kwargs):
        rng = getattr(_tls, "rng", None)
        if rng is None:
            return orig(*args, **kwargs)
        return rng.run(orig, *args, **kwargs)

    call._hprt_original = orig
    return call


def _patch_rng(on):
    with _rng_patch["lock"]:
        _rng_patch["depth"] += 1 if on else -1
        if _rng_patch["depth"] != (1 if on else 0):
            return
        for module in (torch, torch.random):
            for name in _RNG_FUNCTIONS:
                f = getattr(module, name)
                if on and not hasattr(f, "_hprt_original"):
                    setattr(module, name, _rank_aware(f))
                elif not on and hasattr(f, "_hprt_original"):
                    setattr(module, name, f._hprt_original)


class RanksFailed(RuntimeError):
    """What ``run_on_ranks`` raises when a rank failed: the message names the first failure
    (the root cause; the exception is chained as ``__cause__``) and lists every rank's outcome.
    ``failed_rank`` is that rank, ``outcomes`` each rank's exception (``None`` where it
    returned)."""

    def __init__(self, message, failed_rank, outcomes):
        super().__init__(message)
        self.failed_rank, self.outcomes = failed_rank, outcomes


def _describe(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def run_on_ranks(world_size, fn, *args, platform=None, **kwargs):
    """Runs ``fn(rank, *args, **kwargs)`` on ``world_size`` threads, each a rank of one hprt
    world (its communicator made, its device set), and returns the results in rank order.

    A rank that raises aborts its communicators (the world's and every group fsdp made), so
    that the other ranks' collectives waiting for it fail at once instead of at the collective
    timeout (not on npu: HCCL has no abort, and peers fail at its timeout); the call then raises ``RanksFailed`` (a ``RuntimeError``) naming the first failure
    (the root cause, chained) and listing every rank's outcome, as torchrun's summary does.

    Each rank thread has its own torch CPU generator state (``_RankRNG``), starting from the
    caller's: a rank that seeds and builds its model gets the weights a process would, not
    draws interleaved with the other ranks'. Only ``torch.default_generator`` used directly
    is shared.

    ``platform`` defaults to a private cpu platform with one device per rank (so memory is
    accounted per rank; ``HP_CPU_*`` settings such as ``HP_CPU_JITTER`` apply) when the
    process-wide platform is the cpu backend, else the process-wide platform (e.g. the Ascend
    emulator)."""
    if platform is None:
        platform = hprt.get_platform()
        if platform.backend == "cpu":
            platform = hprt.cpu_platform(devices=world_size, from_env=True)
    uid = platform.unique_id()
    results, errors = [None] * world_size, [None] * world_size
    start_state = torch.get_rng_state()

    def body(rank):
        ctx = None
        rng = _RankRNG(start_state.clone())
        try:
            platform.set_device(rank % platform.device_count())
            comm = platform.comm_init(uid, rank, world_size)
            ctx = _RankContext(platform, comm, rank, world_size)
            _tls.ctx, _tls.rng = ctx, rng
            with rng:
                results[rank] = fn(rank, *args, **kwargs)
        except BaseException as e:  # reported by the caller below
            errors[rank] = (time.monotonic(), e)
            if ctx is not None:
                try:
                    ctx.abort()
                except Exception:  # best effort: the failure itself is what is reported
                    pass
        finally:
            _tls.ctx = _tls.rng = None

    threads = [threading.Thread(target=body, args=(r,), name=f"hprt-rank-{r}") for r in range(world_size)]
    _patch_rng(True)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _patch_rng(False)
    failed = sorted((err[0], rank) for rank, err in enumerate(errors) if err is not None)
    if failed:
        first = failed[0][1]
        cause = errors[first][1]
        lines = [f"rank {first} of {world_size} failed: {cause}", "ranks (first failure first):"]
        for _, rank in failed:
            note = "first failure" if rank == first else f"after rank {first} failed"
            lines.append(f"  rank {rank}: {_describe(errors[rank][1])}  ({note})")
        lines += [f"  rank {rank}: returned" for rank in range(world_size) if errors[rank] is None]
        outcomes = [err[1] if err is not None else None for err in errors]
        raise RanksFailed("\n".join(lines), first, outcomes) from cause
    return results


def init_from_process_group(group=None, platform=None):
    """Makes this process's hprt communicator over an initialised ``torch.distributed`` process
    group (one process per device, as torchrun launches them): rank 0's unique id is broadcast
    through ``group``; the device is ``LOCAL_RANK`` (else the group rank) modulo the device
    count. Returns the rank. Untested on hardware (tested with a stand-in platform).

    The cpu backend cannot do this for more than one process: its ranks are threads of one
    process (``run_on_ranks``)."""
    global _process_ctx
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_from_process_group needs torch.distributed.init_process_group() first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    platform = platform if platform is not None else hprt.get_platform()
    if platform.backend == "cpu" and world > 1:
        raise hprt.UnsupportedError(_CPU_RANKS)
    local = int(os.environ.get("LOCAL_RANK", rank))
    platform.set_device(local % platform.device_count())
    box = [bytes(platform.unique_id()) if rank == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    comm = platform.comm_init(box[0], rank, world)
    _process_ctx = _RankContext(platform, comm, rank, world)
    return rank


class RankMesh:
    """What ``init_device_mesh`` returns: this rank's view of a data-parallel mesh (1-D = FSDP,
    2-D = HSDP: dim 0 replicates, dim 1 shards) with its group cache and hprt streams."""

    def __init__(self, ctx, shape, dim_names):
        self.platform, self.rank, self.world_size = ctx.platform, ctx.rank, ctx.world_size
        self.cache, self.streams, self.memory = ctx.cache, ctx.streams, ctx.memory
        self.mesh = hprt.DeviceMesh(list(shape), dim_names=dim_names)
        if len(shape) == 1:
            self.dp = hprt.DataParallelMesh.fsdp(self.mesh)
        elif len(shape) == 2:
            self.dp = hprt.DataParallelMesh.hsdp(self.mesh)
        else:
            raise ValueError(f"a data-parallel mesh is 1-D (FSDP) or 2-D (HSDP), not {list(shape)}")
        self.shape = tuple(shape)
        self.trace = None  # a StreamTrace to record this rank's streams
        self._replicate_group = None
        self._ctx = ctx

    @property
    def shard_axis(self):
        return len(self.shape) - 1

    @property
    def replicate_group(self):
        """HSDP's group across the replicas (dim 0): made on first use, which every rank
        reaches at the same point (collective over the world)."""
        if self._replicate_group is None:
            self._replicate_group = self._ctx.group_along("fsdp_replicate", self.mesh, [0])
        return self._replicate_group

    def __repr__(self):
        return f"RankMesh(shape={list(self.shape)}, rank={self.rank})"


class StreamTrace:
    """A timeline of one rank's hprt streams and host waits during fully_shard training: each
    all-gather and gradient reduction is bracketed by timing events on its stream, each host
    wait for them by host timestamps; ``spans()`` puts both on the host clock (seconds).

    ``mesh.trace = StreamTrace(mesh.platform)`` turns it on for every module of that mesh."""

    def __init__(self, platform):
        self.platform = platform
        self._events = []  # (kind, start event, end event)
        self._waits = []  # (start, end) host seconds
        self._ref_stream = platform.create_stream()
        self._ref = platform.create_event(True)
        self._ref_host = time.perf_counter()
        self._ref_stream.record_event(self._ref)

    def begin(self, stream):
        e = self.platform.create_event(True)
        stream.record_event(e)
        return e

    def end(self, kind, stream, start):
        e = self.platform.create_event(True)
        stream.record_event(e)
        self._events.append((kind, start, e))

    def wait(self, t0, t1):
        self._waits.append((t0, t1))

    def spans(self):
        """``[(kind, start_s, end_s)]``: kinds ``all-gather``, ``reduce`` (stream time) and
        ``wait`` (the host blocked on them). Synchronizes the events first."""
        out = []
        for kind, a, b in self._events:
            b.synchronize()
            t0 = self._ref_host + self._ref.elapsed_ms(a) / 1e3
            t1 = self._ref_host + self._ref.elapsed_ms(b) / 1e3
            out.append((kind, t0, t1))
        out.extend(("wait", t0, t1) for t0, t1 in self._waits)
        return sorted(out, key=lambda s: s[1])


def init_device_mesh(device_type=None, mesh_shape=None, mesh_dim_names=None):
    """hyper_parallel's / torch's ``init_device_mesh`` for the calling rank: ``mesh_shape``
    defaults to ``(world_size,)``; ``device_type`` (if given) must name the hprt backend."""
    ctx = _context()
    if device_type is not None and device_type != ctx.platform.backend:
        raise ValueError(
            f"device_type {device_type!r}: the hprt platform of this rank is {ctx.platform.backend!r}"
        )
    shape = tuple(mesh_shape) if mesh_shape is not None else (ctx.world_size,)
    n = 1
    for d in shape:
        n *= d
    if n != ctx.world_size:
        raise ValueError(f"mesh shape {list(shape)} holds {n} ranks, the world has {ctx.world_size}")
    key = (shape, tuple(mesh_dim_names) if mesh_dim_names else None)
    if key not in ctx.meshes:
        ctx.meshes[key] = RankMesh(ctx, shape, list(mesh_dim_names) if mesh_dim_names else None)
    return ctx.meshes[key]


# ---------------------------------------------------------------------------------------------
# How torch sees hprt's memory


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
        return self.platform.wrap_stream(self._torch_stream())

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


def _is_emulator(platform):
    return "emulator" in str(platform.info().get("driver", "")).lower()


def _torch_memory(platform):
    """How torch sees ``platform``'s memory (see ``_CopiedMemory``): shared on the cpu backend;
    torch's own device tensors where torch has the platform's device (cuda, or npu through
    torch_npu) and the platform drives real hardware; else the staging path."""
    backend = platform.backend
    if backend == "cpu":
        return _SharedMemory(platform)
    mod = getattr(torch, backend, None)  # torch.cuda; torch.npu once torch_npu is imported
    if mod is not None and mod.is_available() and not _is_emulator(platform):
        return _DeviceMemory(platform, backend)
    return _StagedMemory(platform)


def _torch_dtype(name):
    return _DTYPES[name]


_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}


# ---------------------------------------------------------------------------------------------
# Parameters


class _SavedParamRef:
    """What autograd keeps instead of a tensor living in gathered memory."""

    __slots__ = ("param", "size", "stride", "offset")

    def __init__(self, param, t, base):
        self.param = param
        self.size, self.stride = t.size(), t.stride()
        self.offset = (t.data_ptr() - base.data_ptr()) // t.element_size()


class _OuterPacked:
    """A value packed by saved-tensor hooks that were active before ours."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _FSDPParam:
    """One managed parameter: the hprt ``ShardedParam``, the shard torch sees as the registered
    parameter, and the persistent unsharded leaf whose data is rebound to each gathered copy."""

    def __init__(self, state, fqn, param, locations, dim):
        self.state, self.fqn, self.locations = state, fqn, locations
        self.requires_grad = param.requires_grad
        mesh = state.mesh
        self.memory = mesh.memory
        data = self.memory.hprt_input(param.detach(), mesh.streams)
        self.sp = hprt.ShardedParam(
            mesh.cache, mesh.streams, mesh.dp, fqn, data, shard_dim=dim,
            mp_policy=state.mp_policy._hprt(), offload_policy=state.offload_policy._hprt,
        )
        self._source = data  # read by the queued shard copy; dropped after a synchronize
        self.shape = param.shape
        shard, self.shard_buf = self.memory.shard(self.sp, mesh.streams)
        self.sharded = nn.Parameter(shard, requires_grad=param.requires_grad)
        self.sharded._hprt_fsdp_param = self
        self.grad_t = self.grad_buf = None  # the copied memory's sharded gradient
        self.param_dtype = state.mp_policy.param_dtype or param.dtype
        self.unsharded = None
        self.base = None  # the gathered tensor while unsharded
        self.reduced = False  # a reduction was issued in this backward
        self.pending = False  # a reduction was issued and not applied yet (wait_for_reduce)
        self.unpublished = False  # hprt's sharded gradient is ahead of .grad (not last backward)
        # set_requires_all_reduce(False): the sharded gradient holds this replica's partial sum;
        # the reduction that closes it all-reduces the sum across the replicas once applied.
        self.partial = self.close_partial = False
        self.has_replicas = len(self.sp.unsharded_group_ranks) > 1
        self.keep = []  # gradients hprt's streams may still read
        mesh._ctx.track(self)

    # the upstream HSDPParamV2 names, over hprt's ShardedParam
    def unshard(self, async_op=False):
        if self.sp.state == "sharded":  # else a pending all-gather may be reading hprt's shard
            self.memory.upload_shard(self)
        return self.sp.unshard(async_op=async_op)

    def wait_for_unshard(self):
        self.sp.wait_for_unshard()

    def bind_unsharded(self, view):
        """Points the unsharded leaf (and the module attributes) at ``view``, torch's tensor of
        the gathered parameter (``memory.gathered``, after ``memory.host_wait``)."""
        if self.unsharded is None:
            self.unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
            if self.requires_grad:
                self.unsharded.register_post_accumulate_grad_hook(self._on_grad)
        elif self.base is None or self.unsharded.data_ptr() != view.data_ptr():
            self.unsharded.data = view
        self.base = view
        self.state.live[view.untyped_storage().data_ptr()] = self
        for module, attr in self.locations:
            module._parameters[attr] = self.unsharded

    def bind_sharded(self):
        for module, attr in self.locations:
            module._parameters[attr] = self.sharded
        if self.base is not None:
            self.state.live.pop(self.base.untyped_storage().data_ptr(), None)
            self.base = None
            # Nothing may keep pointing at memory that shard() frees.
            self.unsharded.data = torch.zeros((), dtype=self.param_dtype).expand(self.shape)

    def apply_pending(self):
        """Applies the reduction in flight into the sharded gradient: stream-ordered, no host
        wait."""
        if self.pending:
            self.sp.wait_for_reduce()
            self.pending = False
            self.keep.clear()  # the compute stream is ordered after the reduction's reads
            if self.close_partial:
                self._all_reduce_partial()

    def check_partial_start(self):
        st = self.state
        starts = self.has_replicas and not st.requires_all_reduce and not self.partial
        if starts and st.requires_gradient_sync and (
                self.sharded.grad is not None or self.unpublished or self.reduced):
            raise hprt.UnsupportedError(
                f"set_requires_all_reduce(False) on {self.fqn!r}, whose sharded gradient holds "
                "reduced gradients: hprt accumulates the replicas' partial sums in the sharded "
                "gradient itself, so start the accumulation with no gradient (zero_grad() "
                "before it)"
            )

    def _all_reduce_partial(self):
        """FSDP2's HSDP accumulation without all-reduce: the partial sum (every reduce-scatter
        since the partial began, this one included) averaged across the replicas, on the
        reduce stream where hprt issues its own collectives (same order on every rank)."""
        st = self.state
        s = st.streams
        dev = self.sp.sharded_grad_device_tensor()
        s.reduce.wait_stream(s.compute)  # after the apply into the sharded gradient
        st.mesh.replicate_group.communicator.all_reduce(
            dev.buffer, dev.buffer, self.sp.shard_numel, self.sp.dtype, "avg", s.reduce,
            send_offset=dev.offset, recv_offset=dev.offset,
        )
        s.compute.wait_stream(s.reduce)
        self.partial = self.close_partial = False

    def _on_grad(self, leaf):
        grad, leaf.grad = leaf.grad, None
        st = self.state
        self.keep.append(grad)
        self.apply_pending()
        if st.requires_gradient_sync:
            defer = self.has_replicas and not st.requires_all_reduce
            if defer and not self.partial:
                self.check_partial_start()
                self.sp.clear_grad()
            elif not self.reduced and not self.unpublished and not self.partial:
                if self.sharded.grad is None:
                    self.sp.clear_grad()  # the user dropped .grad (zero_grad): start a new one
                else:
                    self.memory.upload_grad(self)
            trace, rs = st.mesh.trace, st.streams.reduce
            start = trace.begin(rs) if trace else None
            all_reduce = not (defer or self.partial)
            self.sp.reduce_grad(self.memory.hprt_input(grad, st.streams), op="avg", async_op=True,
                                all_reduce=all_reduce)
            if trace:
                trace.end("reduce", rs, start)
            self.close_partial = self.partial and not defer
            self.partial = self.partial or defer
            self.reduced = self.pending = True
        else:
            self.sp.accumulate_grad(self.memory.hprt_input(grad, st.streams))
        st._grad_arrived()

    def full_tensor(self):
        """The whole parameter in its own dtype (a collective over the shard group), from the
        shard torch holds."""
        st = self.state
        mesh, sp = st.mesh, self.sp
        self.memory.host_wait(mesh.streams)
        shard = self.sharded.detach()
        dim, rows = sp.shard_dim, self.shape[sp.shard_dim]
        if sp.group_size == 1:
            return shard.narrow(dim, 0, rows).clone()
        p = mesh.platform
        group = mesh._ctx.group_along("fsdp_shard", mesh.mesh, [mesh.shard_axis])
        host = shard.cpu().contiguous().reshape(-1)
        nbytes = host.numel() * host.element_size()
        send, recv = p.alloc_device(nbytes), p.alloc_device(nbytes * sp.group_size)
        s = mesh.streams.compute
        p.write(send, host.view(torch.uint8).numpy().tobytes(), s)
        group.communicator.all_gather(send, recv, sp.shard_numel, sp.dtype, s)
        data = bytearray(p.read(recv, nbytes * sp.group_size, s))
        send.free()
        recv.free()
        shards = torch.frombuffer(data, dtype=shard.dtype).reshape([sp.group_size] + list(sp.shard_shape))
        return torch.cat(list(shards), dim).narrow(dim, 0, rows).clone().to(shard.device)

    def shard_of(self, full):
        """This rank's padded shard of a whole parameter."""
        sp = self.sp
        dim = sp.shard_dim
        out = torch.zeros(sp.shard_shape, dtype=self.sharded.dtype)
        rows = sp.valid_rows(sp.shard_index)
        if rows:
            start = sp.shard_index * sp.shard_shape[dim]
            out.narrow(dim, 0, rows).copy_(full.reshape(self.shape).narrow(dim, start, rows))
        return out


# ---------------------------------------------------------------------------------------------
# Module state


class _FSDPState:
    def __init__(self, mesh, reshard_after_forward, mp_policy, offload_policy, params):
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward  # None: True except on the root
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.is_last_backward = True  # read on the root
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.live = {}
        self.params = []
        self.forward_prefetch = None
        self.backward_prefetch = None
        self.root = None  # set by the root's lazy init
        self.order = []  # FSDP states in forward order (on the root)
        self.states = []  # every state under the root, root included (on the root)
        self.hooks_pushed = False
        self.outer_hooks = None
        self.backward_started = False
        self.callback_queued = False
        self.grads_arrived = 0
        self.in_flight = []  # (on the root) modules whose reductions were not applied yet
        self.initialized = False
        self.order_frozen = False
        for fqn, (param, locations, dim) in params.items():
            self.params.append(_FSDPParam(self, fqn, param, locations, dim))
        for p in self.params:
            for m, attr in p.locations:
                m._parameters[attr] = p.sharded
        mesh.streams.compute.synchronize()
        for p in self.params:
            p._source = None

    @property
    def streams(self):
        return self.mesh.streams

    # --- unshard / reshard
    def unshard_async(self):
        trace, ag = self.mesh.trace, self.streams.all_gather
        start = trace.begin(ag) if trace else None
        for p in self.params:
            p.unshard(async_op=True)
        if trace:
            trace.end("all-gather", ag, start)

    def unshard(self):
        if self.params and all(p.base is not None for p in self.params):
            return
        self.unshard_async()
        t0 = time.perf_counter()
        for p in self.params:
            p.wait_for_unshard()
        memory = self.mesh.memory
        views = [memory.gathered(p) for p in self.params]
        memory.host_wait(self.streams)  # torch reads the gathered memory from here on
        if self.mesh.trace:
            self.mesh.trace.wait(t0, time.perf_counter())
        for p, view in zip(self.params, views):
            p.bind_unsharded(view)

    def reshard(self):
        for p in self.params:
            p.bind_sharded()
            p.sp.shard()

    # --- forward
    def pre_forward(self, module, args, kwargs):
        if getattr(_tls, "active", None) is None:
            self._lazy_init(module)
            for st in (self.states or [self]) if torch.is_grad_enabled() else ():
                for p in st.params:
                    p.check_partial_start()  # refused before anything starts
            _tls.active = self
            self._push_hooks()
            if not self.order_frozen:
                self.order.clear()
        active_root = _tls.active
        if not active_root.order_frozen and self not in active_root.order:
            active_root.order.append(self)
        self.unshard()
        for nxt in self._forward_next(active_root):
            nxt.unshard_async()
        mp = self.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            cast = lambda t: t.to(mp.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def _forward_next(self, root):
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        order = root.order if root.order_frozen else []
        if self in order:
            i = order.index(self)
            return order[i + 1:i + 2]
        return []

    def _backward_next(self):
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        root = self.root or self
        order = root.order
        if self in order:
            i = order.index(self)
            return order[i - 1:i] if i > 0 else []
        return []

    def post_forward(self, module, output):
        is_root = _tls.active is self
        reshard = self.reshard_after_forward
        if reshard if reshard is not None else not is_root:
            self.reshard()
        mp = self.mp_policy
        if mp.output_dtype is not None:
            cast = lambda t: t.to(mp.output_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            output = tree_map(cast, output)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        if is_root:
            self._end_forward()
        return output

    def _end_forward(self):
        self._pop_hooks()
        _tls.active = None
        self.order_frozen = True

    def abort_forward(self):
        if getattr(_tls, "active", None) is self:
            self._pop_hooks()
            _tls.active = None

    def _lazy_init(self, module):
        if self.root is not None and self.root is not self:
            return  # called on its own: acts as its own root for this forward
        if self.initialized:
            return
        self.initialized = True
        self.root = self
        self.order_frozen = False
        self.states = [self]
        for m in module.modules():
            st = getattr(m, "_hprt_fsdp", None)
            if st is not None and st is not self:
                st.root = self
                st.order_frozen = True
                self.states.append(st)

    # --- saved tensors: references into gathered memory are re-gathered for backward
    def _push_hooks(self):
        self.outer_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        self.hooks_pushed = True

    def _pop_hooks(self):
        if self.hooks_pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.hooks_pushed = False

    def _pack(self, t):
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, subclasses)
            ptr = None
        for st in self.states if ptr is not None else ():
            p = st.live.get(ptr) if st.live else None
            if p is not None:
                return _SavedParamRef(p, t, p.base)
        if self.outer_hooks is not None:
            return _OuterPacked(self.outer_hooks[0](t))
        return t

    def _unpack(self, x):
        if isinstance(x, _SavedParamRef):
            p = x.param
            if p.base is None:
                p.state.unshard()  # not prefetched (e.g. a second backward): gather now
            base = p.base
            return base.as_strided(x.size, x.stride, base.storage_offset() + x.offset)
        if isinstance(x, _OuterPacked):
            return self.outer_hooks[1](x.value)
        return x

    # --- backward
    def _pre_backward_hook(self, grad):
        if not self.backward_started:
            self.backward_started = True
            root = self.root or self
            if not root.callback_queued:
                root.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(root._final_callback)
            self.unshard()
            for nxt in self._backward_next():
                nxt.unshard_async()
        return grad

    def _grad_arrived(self):
        self.grads_arrived += 1
        if self.grads_arrived == sum(p.requires_grad for p in self.params):
            root = self.root or self
            if self.reshard_after_backward and self is not root:
                self.reshard()
            # FSDP2's bound on reductions in flight: this module's, and no earlier ones (their
            # staging and gradient memory is released once applied; stream-ordered, no host
            # wait). Without it every module's staged gradients lived until the end of backward.
            for st in root.in_flight:
                for p in st.params:
                    p.apply_pending()
            root.in_flight = [self]

    def _final_callback(self):
        states = self.states or [self]
        last = self.is_last_backward
        if last:
            t0 = time.perf_counter()
            for st in states:
                for p in st.params:
                    p.apply_pending()
            self.in_flight = []
            self.mesh.memory.host_wait(self.streams)
            if self.mesh.trace:
                self.mesh.trace.wait(t0, time.perf_counter())
        for st in states:
            for p in st.params:
                if last and (p.reduced or p.unpublished) and not p.partial:
                    g = p.memory.sharded_grad(p)
                    if p.sharded.grad is None or p.sharded.grad.data_ptr() != g.data_ptr():
                        p.sharded.grad = g
                    p.unpublished = False
                elif p.reduced:
                    p.unpublished = True  # in flight; the next backward applies it
                p.reduced = False
                if last:
                    p.keep.clear()  # the host waited for every stream (torch's: ordered)
            if st.reshard_after_backward:
                st.reshard()
            st.backward_started = False
            st.grads_arrived = 0
        self.callback_queued = False


# ---------------------------------------------------------------------------------------------
# The module API


class FSDPModule:
    """The methods ``fully_shard`` adds to a module (FSDP2's ``FSDPModule``, hyper_parallel's
    fully_shard module methods)."""

    def _fsdp_states(self, recurse=True):
        if not recurse:
            return [self._hprt_fsdp]
        return [m._hprt_fsdp for m in self.modules() if getattr(m, "_hprt_fsdp", None) is not None]

    def unshard(self, async_op=False):
        """All-gathers this module's parameters. With ``async_op`` returns a handle whose
        ``wait()`` makes them usable (the next forward waits for it too)."""
        st = self._hprt_fsdp
        if async_op:
            st.unshard_async()
            return _UnshardHandle(st)
        st.unshard()
        return None

    def reshard(self):
        """Frees the gathered parameters (the shards stay registered)."""
        self._hprt_fsdp.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """Off: gradients are accumulated unsharded (in the reduce dtype) without communication;
        the next backward with it on reduces the sum."""
        for st in self._fsdp_states(recurse):
            st.requires_gradient_sync = requires_gradient_sync

    def set_is_last_backward(self, is_last_backward):
        """Off: the next backward leaves its last gradient reductions in flight (they overlap
        what comes next, e.g. the next micro-batch's forward) and does not set ``.grad``; the
        backward after it applies them first. Set it back on for the micro-batch whose
        backward precedes the optimizer step."""
        for st in self._fsdp_states(True):
            st.is_last_backward = is_last_backward

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """HSDP off: gradients are reduce-scattered within each replica but not all-reduced
        across the replicas; the partial sums accumulate (``.grad`` is not set) until a backward
        with it on all-reduces them. Start such an accumulation with no gradient
        (``zero_grad()``); not with ``CPUOffloadPolicy``."""
        states = self._fsdp_states(recurse)
        if not requires_all_reduce:
            for st in states:
                if len(st.mesh.shape) == 2 and isinstance(st.offload_policy, CPUOffloadPolicy):
                    raise hprt.UnsupportedError(
                        "set_requires_all_reduce(False) with CPUOffloadPolicy: the partial sums "
                        "would be all-reduced in pinned host memory, which hprt's collectives "
                        "do not read"
                    )
        for st in states:
            st.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward, *, recurse=True):
        """Changes ``reshard_after_forward`` at runtime (e.g. ``True`` on the root, which
        otherwise keeps its parameters gathered for backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for st in self._fsdp_states(recurse):
            st.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        for st in self._fsdp_states(recurse):
            st.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules):
        """The modules whose all-gather starts when this module's forward starts."""
        self._hprt_fsdp.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        """The modules whose all-gather starts when this module's backward starts."""
        self._hprt_fsdp.backward_prefetch = [_state_of(m) for m in modules]

    def zero_grads(self):
        """Drops the sharded gradients of this module and every fully_shard module under it."""
        for st in self._fsdp_states(True):
            for p in st.params:
                p.apply_pending()
                p.sharded.grad = None
                p.unpublished = p.partial = False
                p.sp.clear_grad()

    def forward(self, *args, **kwargs):
        st = self._hprt_fsdp
        args, kwargs = st.pre_forward(self, args, kwargs)
        try:
            out = st.orig_forward(self, *args, **kwargs)
        except BaseException:
            st.abort_forward()
            raise
        return st.post_forward(self, out)


class _UnshardHandle:
    def __init__(self, state):
        self._state = state

    def wait(self):
        self._state.unshard()


def _state_of(module):
    st = getattr(module, "_hprt_fsdp", None)
    if st is None:
        raise ValueError(f"{type(module).__name__} is not a fully_shard module")
    return st


_classes = {}


def _shard_dim(shard_placement_fn, fqn, param):
    """The dim ``shard_placement_fn(param)`` shards on: FSDP2's ``Shard(dim)`` (torch's
    ``torch.distributed.tensor.Shard``, or anything with an int ``dim``), ``None`` = dim 0;
    a negative dim counts from the end."""
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    if placement is None:
        return 0
    dim = getattr(placement, "dim", None)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ValueError(
            f"shard_placement_fn returned {placement!r} for {fqn!r}: fully_shard takes a "
            "Shard(dim) or None"
        )
    if not -param.ndim <= dim < param.ndim:
        raise ValueError(f"shard_placement_fn: Shard({dim}) of {fqn!r}, a {param.ndim}-D parameter")
    return dim % param.ndim


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(), ignored_params=None):
    """Shards ``module``'s parameters (those not already managed by a ``fully_shard`` module
    under it, and not in ``ignored_params``) over ``mesh`` (default: 1-D over the rank's world)
    and returns ``module``, whose class now also derives from ``FSDPModule``. Apply it to each
    block, then to the root. Collective: every rank shards the same modules in the same order.

    ``reshard_after_forward``: ``True`` frees the gathered parameters after forward (gathered
    again for backward), ``False`` keeps them, ``None`` (the default) is ``True`` except on the
    root, whose parameters backward needs first (FSDP2's rule).

    ``shard_placement_fn(param)`` may return ``Shard(dim)`` to shard a parameter on another dim
    than 0 (its registered shard is then a slice along ``dim``, padded there)."""
    if isinstance(module, (list, tuple, nn.ModuleList)) and not isinstance(module, nn.Module):
        return [fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                            shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                            offload_policy=offload_policy, ignored_params=ignored_params) for m in module]
    if getattr(module, "_hprt_fsdp", None) is not None:
        raise ValueError(f"{type(module).__name__} was already passed to fully_shard")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise hprt.UnsupportedError(
            f"reshard_after_forward={reshard_after_forward!r}: resharding to a smaller world "
            "after forward (FSDP2's int) is not supported; use True, False or None"
        )
    mesh = mesh if mesh is not None else init_device_mesh()
    ignored = {id(p) for p in (ignored_params or ())}
    managed = set()
    for m in module.modules():
        st = getattr(m, "_hprt_fsdp", None)
        if st is not None:
            managed.update(id(p.sharded) for p in st.params)
    params = {}
    by_id = {}
    for mod_name, m in module.named_modules():
        for attr, p in list(m._parameters.items()):
            if p is None or id(p) in ignored or id(p) in managed:
                continue
            if getattr(p, "_hprt_fsdp_param", None) is not None:
                continue
            if id(p) in by_id:
                by_id[id(p)][1].append((m, attr))  # a tied parameter: one shard, several homes
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            if p.ndim == 0:
                # FSDP2 refuses them too, with this message (an AssertionError there).
                raise ValueError(
                    f"fully_shard: Shard dim 0 is invalid for 0D tensor: {p.shape} (parameter "
                    f"{fqn!r}); a 0-D parameter cannot be sharded: make it a 1-element tensor "
                    "or leave it out with ignored_params"
                )
            by_id[id(p)] = params[fqn] = (p, [(m, attr)], _shard_dim(shard_placement_fn, fqn, p))
    state = _FSDPState(mesh, reshard_after_forward, mp_policy, offload_policy, params)
    cls = type(module)
    state.orig_forward = cls.forward
    new_cls = _classes.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _classes[cls] = new_cls
    module.__class__ = new_cls
    module._hprt_fsdp = state
    return module


# ---------------------------------------------------------------------------------------------
# State dicts


def _params_by_ptr(model):
    out = {}
    for m in model.modules():
        st = getattr(m, "_hprt_fsdp", None)
        if st is not None:
            st.reshard()
            for p in st.params:
                out[p.sharded.data_ptr()] = p
    return out


def get_model_state_dict(model, *, full_state_dict=True):
    """The model's state dict with each sharded parameter as its whole tensor
    (``full_state_dict``; a collective: every rank calls it) or as this rank's padded shard,
    cloned to torch memory."""
    by_ptr = _params_by_ptr(model)
    out = {}
    for k, v in model.state_dict().items():
        p = by_ptr.get(v.data_ptr()) if torch.is_tensor(v) else None
        if p is not None and v.shape == p.sharded.shape:
            out[k] = p.full_tensor() if full_state_dict else v.detach().clone()
        else:
            out[k] = v.clone() if torch.is_tensor(v) else v
    return out


def set_model_state_dict(model, state_dict, *, full_state_dict=True, strict=True):
    """Loads a state dict from ``get_model_state_dict`` (whole tensors, or this rank's shards)."""
    by_ptr = _params_by_ptr(model)
    current = model.state_dict()
    converted = {}
    for k, v in state_dict.items():
        cur = current.get(k)
        p = by_ptr.get(cur.data_ptr()) if torch.is_tensor(cur) else None
        if p is not None and cur.shape == p.sharded.shape and full_state_dict:
            converted[k] = p.shard_of(v)
        else:
            converted[k] = v
    for st in {id(p.state): p.state for p in by_ptr.values()}.values():
        st.streams.compute.synchronize()  # nothing queued still reads the shards
    return model.load_state_dict(converted, strict=strict)
