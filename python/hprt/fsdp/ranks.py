"""Who this rank is: the rank context every fully_shard call reads (its platform, world
communicator, groups, streams and memory path), the two ways to get one (``run_on_ranks``:
threads of one process, each with its own torch generator state; ``init_from_process_group``:
a process per device), and what a failed rank does to the others' collectives."""

import functools
import os
import threading
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hprt

from .memory import _torch_memory


_CPU_RANKS = (
    "this platform's ranks are threads of one process (the cpu backend, the emulators): run "
    "them with hprt.torch.run_on_ranks(world_size, fn) in one process (HP_PLATFORM=cuda or npu "
    "on hardware for one process per device)"
)


class _RankContext:
    def __init__(self, platform, comm, rank, world_size):
        self.platform, self.comm = platform, comm
        self.rank, self.world_size = rank, world_size
        self._cache = self._streams = self._memory = None
        self.meshes = {}
        self._groups = []  # the sub-communicators fsdp made in Python (abort aborts them)
        self._params = []  # weak references to this rank's _FSDPParams (abort aborts their groups)

    def group_along(self, name, mesh, axes):
        """``cache.group_along``, remembered so that ``abort`` can abort its communicator."""
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
        if platform.capabilities.configurable_devices:
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
    if platform.capabilities.ranks_are_threads and world > 1:
        raise hprt.UnsupportedError(_CPU_RANKS)
    local = int(os.environ.get("LOCAL_RANK", rank))
    platform.set_device(local % platform.device_count())
    box = [bytes(platform.unique_id()) if rank == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    comm = platform.comm_init(box[0], rank, world)
    _process_ctx = _RankContext(platform, comm, rank, world)
    return rank
