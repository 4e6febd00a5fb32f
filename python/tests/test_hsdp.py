"""hsdp from Python: sharded parameters over rank threads (FSDP on 2 and 4 ranks, HSDP 2x2)
checked against numpy, and a small training loop that must match single-rank numpy training."""

import os

import numpy as np
import pytest

import hprt
from emulated import EMULATED
from rank_threads import on_rank_threads


def run_ranks(world, fn, **platform_args):
    p = hprt.cpu_platform(device_memory=1 << 22, pinned_memory=1 << 22, collective_timeout_s=20, **platform_args)
    uid = p.unique_id()

    def rank(r):
        comm = p.comm_init(uid, r, world)
        return fn(p, hprt.GroupCache(comm), hprt.HsdpStreams(p), r)

    return on_rank_threads(world, rank)


def dp_mesh(kind, world):
    if kind == "hsdp":
        return hprt.DataParallelMesh.hsdp(hprt.DeviceMesh([2, world // 2]))
    return hprt.DataParallelMesh.fsdp(hprt.DeviceMesh([world]))


def expected_shard(full, dim, groups, k):
    """Shard k of `groups` along `dim`, the dim zero-padded to a multiple of `groups`."""
    chunk = -(-full.shape[dim] // groups)
    pad = [(0, 0)] * full.ndim
    pad[dim] = (0, chunk * groups - full.shape[dim])
    return np.split(np.pad(full, pad), groups, axis=dim)[k]


def f32(data, shape=None):
    a = np.frombuffer(bytes(data), dtype=np.float32)
    return a if shape is None else a.reshape(shape)


FULL = np.arange(5 * 3, dtype=np.float32).reshape(5, 3) / 7 - 1


def grad_of(r):
    return (np.arange(15, dtype=np.float32).reshape(5, 3) * (r + 1) + r).astype(np.float32)


@pytest.mark.parametrize("kind,world,shard_dim", [
    ("fsdp", 2, 0), ("fsdp", 4, 0), ("hsdp", 4, 0), ("fsdp", 2, 1), ("hsdp", 4, 1),
])
def test_unshard_and_reduce_match_numpy(kind, world, shard_dim):
    def rank(p, cache, streams, r):
        w = hprt.ShardedParam(cache, streams, dp_mesh(kind, world), "w", FULL, shard_dim=shard_dim)
        groups = world if kind == "fsdp" else world // 2
        assert (w.group_size, w.shard_index, w.state) == (groups, r % groups, "sharded")
        assert w.shape == [5, 3] and w.is_sharded_param
        shard = f32(w.read_sharded(), w.shard_shape)
        assert np.array_equal(shard, expected_shard(FULL, shard_dim, groups, w.shard_index))

        handle = w.unshard(async_op=True)
        assert w.state == "unsharding"
        assert w.unshard(async_op=True) is None  # a second unshard while one is pending
        w.wait_for_unshard()
        full = w.unsharded()
        assert full.shape == [5, 3] and full.dtype == "f32"
        streams.compute.synchronize()
        assert handle.is_complete()
        assert np.array_equal(np.from_dlpack(full).copy(), FULL)
        assert np.array_equal(f32(w.read_unsharded(), [5, 3]), FULL)
        w.shard()
        assert w.state == "sharded"
        with pytest.raises(hprt.HprtError):
            w.unsharded()

        w.reduce_grad(grad_of(r), op="avg")
        avg = f32(w.read_sharded_grad(), w.shard_shape)
        w.clear_grad()
        w.reduce_grad(grad_of(r), op="sum", scale=0.5, async_op=True)
        assert w.reduce_pending
        w.wait_for_reduce()
        half_sum = f32(w.read_sharded_grad(), w.shard_shape)
        assert w.sharded_group_ranks == (list(range(world)) if kind == "fsdp"
                                         else [r - r % 2, r - r % 2 + 1])
        return w.shard_index, avg, half_sum, list(w.unsharded_group_ranks)

    out = run_ranks(world, rank)
    grads = np.stack([grad_of(r) for r in range(world)]).astype(np.float64)
    groups = world if kind == "fsdp" else world // 2
    for r, (k, avg, half_sum, replicas) in enumerate(out):
        want_avg = expected_shard(grads.mean(0), shard_dim, groups, k)
        want_sum = expected_shard(grads.sum(0) * 0.5, shard_dim, groups, k)
        np.testing.assert_allclose(avg, want_avg, rtol=1e-6)
        np.testing.assert_allclose(half_sum, want_sum, rtol=1e-6)
        assert replicas == ([r] if kind == "fsdp" else [r % 2, r % 2 + 2])


def test_accumulation_threshold_offload_and_mixed_precision():
    world = 2

    def rank(p, cache, streams, r):
        dp = dp_mesh("fsdp", world)
        small = hprt.ShardedParam(cache, streams, dp, "b", np.ones(3, np.float32), threshold=8)
        assert not small.is_sharded_param and small.shard_shape == [3]
        off = hprt.ShardedParam(cache, streams, dp, "o", FULL, offload_policy="pinned_host")
        assert off.offload_policy == "pinned_host"
        mp = hprt.MixedPrecisionPolicy(param_dtype="f16", reduce_dtype="f32")
        half = hprt.ShardedParam(cache, streams, dp, "h", FULL, mp_policy=mp)
        assert (half.dtype, half.param_dtype, half.reduce_dtype) == ("f32", "f16", "f32")
        assert cache.split_calls == 1  # one world group, split once for every parameter

        small.reduce_grad(np.full(3, r + 1, np.float32), op="sum")
        # Two micro-batches accumulated, then one reduction.
        off.accumulate_grad(grad_of(r))
        off.reduce_grad(grad_of(r), op="avg")
        half.unshard()
        gathered = np.frombuffer(half.read_unsharded(), dtype=np.float16).reshape(5, 3)
        half.shard()
        return (f32(small.read_sharded_grad()), off.shard_index,
                f32(off.read_sharded_grad(), off.shard_shape),
                np.from_dlpack(off.sharded_grad()).copy(), gathered)

    out = run_ranks(world, rank)
    mean2 = np.stack([grad_of(r) for r in range(world)]).mean(0) * 2
    for small, k, off_grad, off_view, gathered in out:
        assert small.tolist() == [3.0, 3.0, 3.0]
        np.testing.assert_allclose(off_grad, expected_shard(mean2, 0, world, k), rtol=1e-6)
        assert np.array_equal(off_grad, off_view)
        assert np.array_equal(gathered, FULL.astype(np.float16))


def test_gathered_and_gradient_memory_under_a_dlpack_export_is_not_released():
    """torch / numpy tensors over the gathered parameter or the sharded gradient read hprt's
    memory directly: shard() and free_grad() would leave them reading the next allocation's
    bytes. Refused while the export lives (the parameter stays unsharded), done once it is
    dropped."""
    torch = pytest.importorskip("torch")

    def rank(p, cache, streams, r):
        w = hprt.ShardedParam(cache, streams, dp_mesh("fsdp", 2), "w", FULL)
        w.unshard()
        streams.compute.synchronize()
        full = torch.from_dlpack(w.unsharded())
        for release in (w.shard, w.to_sharded):
            with pytest.raises(hprt.BufferExportedError):
                release()
        assert w.state == "unsharded" and np.array_equal(full.numpy(), FULL)
        del full
        w.shard()
        assert w.state == "sharded"
        w.reduce_grad(grad_of(r), op="sum")
        g = np.from_dlpack(w.sharded_grad())
        w.clear_grad()  # hides the gradient; its memory is still exported
        with pytest.raises(BufferError):
            w.free_grad()
        del g
        w.free_grad()
        dev = w.sharded_grad_device_tensor()
        assert dev is None
        w.reduce_grad(grad_of(r), op="sum")
        dev = w.sharded_grad_device_tensor()
        view = np.from_dlpack(dev)
        with pytest.raises(BufferError):
            w.free_grad()
        del view
        w.free_grad()
        return True

    assert run_ranks(2, rank) == [True, True]


def test_bad_arguments_are_typed_errors():
    def rank(p, cache, streams, r):
        dp = dp_mesh("fsdp", 1)
        with pytest.raises(hprt.InvalidValueError):
            hprt.ShardedParam(cache, streams, dp, "w", FULL, offload_policy="disk")
        w = hprt.ShardedParam(cache, streams, dp, "w", FULL)
        with pytest.raises(hprt.HprtError) as e:
            w.wait_for_unshard()
        assert e.value.status == "HP_HSDP_INVALID_STATE"
        with pytest.raises(hprt.HprtError) as e:
            w.reduce_grad(grad_of(0), op="max")
        assert e.value.status == "HP_HSDP_UNSUPPORTED"
        with pytest.raises(hprt.InvalidValueError):
            w.write_sharded(b"\0" * 4)
        with pytest.raises(hprt.HprtError) as e:
            hprt.DataParallelMesh.hsdp(hprt.DeviceMesh([2]))
        assert e.value.status == "HP_HSDP_INVALID_MESH"

    run_ranks(1, rank)


# A 2-layer MLP, forward and backward in numpy on the gathered weights; every rank trains on
# its own slice of the batch, hsdp gathers the weights and averages the gradients.
D_IN, HIDDEN, D_OUT, PER_RANK, STEPS, LR = 6, 5, 3, 2, 4, 0.1
SHAPES = [(HIDDEN, D_IN), (HIDDEN,), (D_OUT, HIDDEN), (D_OUT,)]


def init_params():
    rng = np.random.default_rng(3)
    return [rng.standard_normal(s).astype(np.float32) * 0.5 for s in SHAPES]


def batch(rows):
    rng = np.random.default_rng(4)
    x, t = rng.standard_normal((16, D_IN)), rng.standard_normal((16, D_OUT))
    return x[rows].astype(np.float32), t[rows].astype(np.float32)


def forward_backward(params, x, t):
    w1, b1, w2, b2 = params
    pre = x @ w1.T + b1
    act = np.maximum(pre, 0)
    y = act @ w2.T + b2
    n = x.shape[0]
    loss = ((y - t) ** 2).sum() / (2 * n)
    dy = (y - t) / n
    dpre = (dy @ w2) * (pre > 0)
    return loss, [dpre.T @ x, dpre.sum(0), dy.T @ act, dy.sum(0)]


@pytest.mark.parametrize("kind,world", [("fsdp", 2), ("hsdp", 4)])
def test_training_matches_single_rank_numpy(kind, world):
    ref = [a.astype(np.float64) for a in init_params()]
    x_all, t_all = batch(slice(0, world * PER_RANK))
    ref_losses = []
    for _ in range(STEPS):
        loss, grads = forward_backward(ref, x_all.astype(np.float64), t_all.astype(np.float64))
        ref_losses.append(loss)
        ref = [p - LR * g for p, g in zip(ref, grads)]

    def rank(p, cache, streams, r):
        dp = dp_mesh(kind, world)
        # W1 sharded on its input dim, the biases replicated (below the threshold).
        params = [hprt.ShardedParam(cache, streams, dp, f"p{i}", a, shard_dim=1 if i == 0 else 0,
                                    threshold=8)
                  for i, a in enumerate(init_params())]
        x, t = batch(slice(r * PER_RANK, (r + 1) * PER_RANK))
        losses = []
        for _ in range(STEPS):
            for w in params:
                w.unshard(async_op=True)  # prefetch every layer
            full = []
            for w, s in zip(params, SHAPES):
                w.wait_for_unshard()
                full.append(f32(w.read_unsharded(), s))
                w.shard()
            loss, grads = forward_backward(full, x, t)
            losses.append(loss)
            for w, g in reversed(list(zip(params, grads))):
                w.reduce_grad(np.ascontiguousarray(g, dtype=np.float32), op="avg", async_op=True)
            for w in reversed(params):
                w.wait_for_reduce()
                shard = f32(w.read_sharded(), w.shard_shape)
                grad = f32(w.read_sharded_grad(), w.shard_shape)
                w.write_sharded((shard - np.float32(LR) * grad).astype(np.float32).tobytes())
                w.clear_grad()
        final = []
        for w, s in zip(params, SHAPES):
            w.unshard()
            final.append(f32(w.read_unsharded(), s))
        return losses, final

    out = run_ranks(world, rank)
    for losses, final in out:
        for got, want in zip(final, ref):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Equal slices: the mean of the per-rank losses is the whole batch's loss.
    mean_losses = np.mean([o[0] for o in out], axis=0)
    np.testing.assert_allclose(mean_losses, ref_losses, rtol=1e-5)


def test_hsdp_with_jitter_matches_numpy():
    """Random stream delays make a missing wait show up as wrong values."""
    world = 4

    def rank(p, cache, streams, r):
        w = hprt.ShardedParam(cache, streams, dp_mesh("hsdp", world), "w", FULL)
        for _ in range(3):
            w.unshard(async_op=True)
            w.wait_for_unshard()
            got = f32(w.read_unsharded(), [5, 3])
            w.shard()
            w.reduce_grad(grad_of(r), op="avg", async_op=True)
            w.wait_for_reduce()
        return got, w.shard_index, f32(w.read_sharded_grad(), w.shard_shape)

    grads = np.stack([grad_of(r) for r in range(world)]).astype(np.float64)
    for got, k, g in run_ranks(world, rank, jitter=11):
        assert np.array_equal(got, FULL)
        np.testing.assert_allclose(g, expected_shard(grads.mean(0) * 3, 0, 2, k), rtol=1e-6)


@pytest.mark.parametrize("backend", EMULATED)
def test_fsdp_on_an_emulated_accelerator(backend):
    """The same bindings on the npu and cuda backends: parameters and gradients in device memory
    (NCCL wants a device per rank: HP_EMU_DEVICES=2 for the CUDA emulator)."""
    p = hprt.open_platform(backend)
    world, uid = 2, p.unique_id()

    def device_tensor(a, stream):
        buf = p.alloc_device(a.nbytes)
        p.write(buf, a.tobytes(), stream)
        return hprt.DeviceTensor(buf, "f32", list(a.shape))

    def rank(r):
        p.set_device(r % p.device_count())
        cache = hprt.GroupCache(p.comm_init(uid, r, world))
        streams = hprt.HsdpStreams(p)
        dp = dp_mesh("fsdp", world)
        w = hprt.ShardedParam(cache, streams, dp, "w", device_tensor(FULL, streams.compute))
        w.unshard()
        full = f32(w.read_unsharded(), [5, 3])
        w.shard()
        w.reduce_grad(device_tensor(grad_of(r), streams.compute), op="avg")
        first = f32(w.read_sharded_grad(), w.shard_shape)
        # The same through hyper_parallel's per-parameter names.
        w.to_unsharded()
        again = f32(w.read_unsharded(), [5, 3])
        w.to_sharded()
        w.clear_grad()
        grad = device_tensor(grad_of(r), streams.compute)
        w.reduce_scatter_grad(grad, op="avg")
        w.all_reduce_grad()
        w.wait_for_reduce()
        assert np.array_equal(f32(w.read_sharded_grad(), w.shard_shape), first)
        assert np.array_equal(again, FULL)
        return full, w.shard_index, first

    results = on_rank_threads(world, rank)
    mean = np.stack([grad_of(r) for r in range(world)]).astype(np.float64).mean(0)
    for full, k, g in results:
        assert np.array_equal(full, FULL)
        np.testing.assert_allclose(g, expected_shard(mean, 0, world, k), rtol=1e-6)
