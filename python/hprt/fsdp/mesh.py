"""The data-parallel mesh of the calling rank (``init_device_mesh``: FSDP in 1-D, HSDP in 2-D)
and the timeline of its streams that a training step can record (``StreamTrace``)."""

import hprt

from .ranks import _context


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
    all-gather and gradient reduction is bracketed by two marks of an ``hprt.StreamClock`` on
    its stream (hprt's one stream clock, which ``hprt trace`` uses too), each host wait for them
    by host timestamps; ``spans()`` puts both on the host clock (seconds of
    ``time.perf_counter()``).

    ``mesh.trace = StreamTrace(mesh.platform)`` turns it on for every module of that mesh."""

    def __init__(self, platform):
        self.platform = platform
        self._clock = hprt.StreamClock(platform)
        self._marks = []  # (kind, start mark, end mark)
        self._waits = []  # (start, end) host seconds

    def begin(self, stream):
        return self._clock.mark(stream)

    def end(self, kind, stream, start):
        self._marks.append((kind, start, self._clock.mark(stream)))

    def wait(self, t0, t1):
        self._waits.append((t0, t1))

    def spans(self):
        """``[(kind, start_s, end_s)]``: kinds ``all-gather``, ``reduce`` (stream time) and
        ``wait`` (the host blocked on them). Waits for the streams to reach the marks first."""
        out = [(kind, a.seconds(), b.seconds()) for kind, a, b in self._marks]
        out.extend(("wait", t0, t1) for t0, t1 in self._waits)
        return sorted(out, key=lambda s: s[1])


def init_device_mesh(device_type=None, mesh_shape=None, mesh_dim_names=None):
    """hyper_parallel's / torch's ``init_device_mesh`` for the calling rank: ``mesh_shape``
    defaults to ``(world_size,)``; ``device_type`` (if given) must be torch's device type of the
    rank's platform memory (``"cuda"`` on the cuda backend, ``"cpu"`` on the cpu backend)."""
    # hprt.torch's one mapping from a platform to torch's device names (imported here: hprt.torch
    # imports this package).
    from ..torch.runtimes import _torch_device_type

    ctx = _context()
    expected = _torch_device_type(ctx.platform)
    if device_type is not None and device_type != expected:
        raise ValueError(
            f"device_type {device_type!r}: this rank's tensors are {expected!r} tensors "
            f"(hprt platform {ctx.platform!r})"
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
