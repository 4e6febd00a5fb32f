"""Collectives across rank threads, the codec, and the device mesh."""


import numpy as np
import pytest

import hprt
from rank_threads import on_rank_threads


def run_ranks(world, fn):
    p = hprt.cpu_platform(device_memory=1 << 20, collective_timeout_s=20)
    uid = p.unique_id()
    return on_rank_threads(world, lambda r: fn(p, p.comm_init(uid, r, world), r))


def test_all_reduce_all_gather_reduce_scatter_broadcast():
    def rank(p, comm, r):
        s = p.create_stream()
        n = 4
        buf = p.alloc_device(4 * n)
        p.write(buf, np.full(n, r + 1, dtype=np.float32).tobytes(), s)
        comm.all_reduce(buf, buf, n, "f32", "sum", s)
        gathered = p.alloc_device(4 * n * comm.world)
        comm.all_gather(buf, gathered, n, "f32", s)
        part = p.alloc_device(4 * n // comm.world)
        comm.reduce_scatter(gathered, part, n // comm.world, "f32", "max", s)
        b = p.alloc_device(4)
        p.write(b, np.array([r * 10], dtype=np.int32).tobytes(), s)
        comm.broadcast(b, 1, "int32", 1, s)
        comm.barrier(s)
        f32 = lambda x, k: np.frombuffer(p.read(x, 4 * k, s), dtype=np.float32)  # noqa: E731
        return (f32(buf, n), f32(gathered, n * comm.world), f32(part, n // comm.world),
                np.frombuffer(p.read(b, 4, s), dtype=np.int32))

    out = run_ranks(2, rank)
    for r, (red, gat, part, bc) in enumerate(out):
        assert red.tolist() == [3.0] * 4
        assert gat.tolist() == [3.0] * 8
        assert part.tolist() == [3.0] * 2
        assert bc.tolist() == [10]


def test_collective_mismatch_is_a_typed_error():
    def rank(p, comm, r):
        s = p.create_stream()
        buf = p.alloc_device(16)
        try:
            comm.all_reduce(buf, buf, 4 if r == 0 else 2, "f32", "sum", s)
            s.synchronize()
        except hprt.HprtError as e:
            return e.status
        return None

    statuses = run_ranks(2, rank)
    assert "HP_ERROR_COLLECTIVE_MISMATCH" in statuses


def test_bad_reduce_op():
    def rank(p, comm, r):
        with pytest.raises(hprt.InvalidValueError):
            comm.all_reduce(p.alloc_device(4), p.alloc_device(4), 1, "f32", "median", p.create_stream())

    run_ranks(1, rank)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_codec_round_trip_is_bit_exact(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(70_000).astype(dtype)
    x[:4] = [np.nan, -0.0, np.inf, -np.inf]
    blob = hprt.compress(x)
    info = hprt.compressed_info(blob)
    assert info["numel"] == x.size and info["encoded_bytes"] < x.nbytes
    data, name, numel = hprt.decompress(blob)
    assert numel == x.size and data == x.tobytes()
    out = np.empty_like(x)
    hprt.decompress_into(blob, out)
    assert out.tobytes() == x.tobytes()


def test_codec_bytes_and_corruption():
    raw = np.arange(1024, dtype=np.float32).tobytes()
    blob = hprt.compress_bytes(raw, "f32")
    assert hprt.decompress(blob)[0] == raw
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(hprt.HprtError) as e:
        hprt.decompress(bytes(bad))
    assert e.value.status.startswith("HP_COMPRESS_")
    with pytest.raises(hprt.InvalidValueError):
        hprt.compress(np.zeros(4, dtype=np.int32))


def test_device_mesh():
    m = hprt.DeviceMesh([2, 3], dim_names=["dp", "fsdp"])
    assert (m.shape, m.size, m.ndim) == ([2, 3], 6, 2)
    assert m.dim_index("fsdp") == 1
    assert m.coords_of(4) == [1, 1] and m.rank_at([1, 2]) == 5
    assert m.rank_list_for_axes(4, [1]) == [3, 4, 5]
    assert m.split_rank_lists_for_axes([0]) == [[0, 3], [1, 4], [2, 5]]
    assert 5 in m and 6 not in m
    with pytest.raises(hprt.HprtError) as e:
        hprt.DeviceMesh([2, 2], ranks=[0, 1, 2])
    assert e.value.status == "HP_HSDP_INVALID_MESH"
