"""hprt-compress's activation manager from Python: saved tensors per layer, encoded in operator
windows and decoded in backward, must come back bit-exact; per-layer statistics count it."""

import numpy as np
import pytest

import hprt

N = 8192


def activations(layer, dtype):
    rng = np.random.default_rng(layer)
    x = rng.standard_normal(N).astype(np.float32)
    x = x * (x > 0)  # relu-like: many zeros, a few exponents
    out = x.astype(dtype).reshape(64, N // 64)
    out.flat[:4] = [np.nan, -0.0, np.inf, -np.inf]
    return out


def manager(p, stream, **kw):
    return hprt.ActivationManager(stream, p, encode_gbps=1.0, decode_gbps=1.0, min_numel=1024, **kw)


@pytest.mark.parametrize("jitter", [None, 5])
def test_layers_round_trip_bit_exact_through_windows(jitter):
    p = hprt.cpu_platform(device_memory=8 << 20, jitter=jitter)
    s = p.create_stream()
    m = manager(p, s)
    layers, steps = 4, 2
    for step in range(steps):
        saved = {}
        for layer in range(layers):
            m.forward_start(layer)
            with m.window(fixed_ms=50):  # encodes the previous layer's tensors
                pass
            for i, dt in enumerate([np.float32, np.float16]):
                x = activations(100 * step + 10 * layer + i, dt)
                saved[m.save(layer, x)] = x
        assert all(m.is_compressed(k) for k in saved if k[0] < layers - 1)
        assert not any(m.is_compressed(k) for k in saved if k[0] == layers - 1)
        for layer in reversed(range(layers)):
            m.backward_start(layer)
            with m.window(fixed_ms=50):  # decodes the next layer in backward order
                pass
            for k in [k for k in saved if k[0] == layer]:
                t = m.take(k)
                s.synchronize()
                want = saved[k]
                assert (t.dtype, t.shape) == (want.dtype.name.replace("float", "f"), list(want.shape))
                assert np.from_dlpack(t).tobytes() == want.tobytes()
    stats = m.layer_stats()
    assert sorted(stats) == list(range(layers))
    for layer, st in stats.items():
        assert st["saved"] == 2 * steps
        if layer < layers - 1:
            assert st["compressed"] == 2 * steps and st["ratio"] > 1.2, st
            assert st["compressed_bytes"] < st["original_bytes"]
            # The backward order is learned in the first step: then every compressed tensor
            # is recovered when its layer's backward starts; afterwards it is decoded in the
            # window of the layer before it in backward.
            assert (st["recovered_sync"], st["decoded_in_window"]) == (2, 2), (layer, st)
    assert m.layer_orders == ([0, 1, 2, 3], [3, 2, 1, 0])
    assert m.scratch_allocations == 2  # one per (numel, dtype), reused by later windows
    records = m.window_records()
    assert len(records) == 2 * layers * steps and records[1]["encoded"] == 2
    assert all(r["measured_ms"] is not None for r in records)


def test_device_tensors_are_released_while_compressed():
    p = hprt.cpu_platform(device_memory=8 << 20)
    s = p.create_stream()
    m = manager(p, s)
    x = activations(1, np.float32)
    buf = p.alloc_device(x.nbytes)
    p.write(buf, x.tobytes(), s)
    m.forward_start(0)
    key = m.save(0, hprt.DeviceTensor(buf, "f32", list(x.shape)))
    m.forward_start(1)
    m.begin_window(fixed_ms=50)
    m.end_window()
    # The original's storage is released (the handle stays); the encoding is kept instead.
    assert m.is_compressed(key) and buf.nbytes == 0 and not buf.is_freed
    m.backward_start(1)
    m.backward_start(0)  # recovered here, into the same buffer
    back = m.take(key)
    assert back.buffer.same_as(buf)
    assert p.read(buf, x.nbytes, s) == x.tobytes()
    assert m.layer_stats()[0]["recovered_sync"] == 1


def test_small_windows_and_filters_leave_tensors_alone():
    p = hprt.cpu_platform(device_memory=8 << 20)
    s = p.create_stream()
    m = manager(p, s, dtypes=["bf16", "f16"])
    m.forward_start(0)
    assert m.save(0, activations(0, np.float32)) is None  # f32 not managed here
    assert m.save(0, np.zeros(16, np.float16)) is None  # below min_numel
    key = m.save(0, activations(0, np.float16))
    m.forward_start(1)
    with m.window(fixed_ms=1e-6):  # 1 ns: nothing fits
        pass
    assert not m.is_compressed(key)
    # A matmul window cannot be predicted without a matmul throughput: nothing is encoded.
    with m.window(matmul=(128, 128, 128)):
        pass
    assert not m.is_compressed(key)
    assert m.window_records()[1]["predicted_ms"] is None
    m2 = manager(p, s, matmul_tflops=1e-6)  # 2 * 128^3 flop at 1 MFLOP/s: 4 s
    m2.forward_start(0)
    k2 = m2.save(0, activations(0, np.float32))
    m2.forward_start(1)
    with m2.window(matmul=(128, 128, 128)):
        pass
    assert m2.is_compressed(k2)
    assert m2.cost()["matmul_tflops"] == pytest.approx(1e-6)


def test_misuse_is_a_typed_error():
    p = hprt.cpu_platform(device_memory=8 << 20)
    s = p.create_stream()
    m = manager(p, s)
    with pytest.raises(hprt.InvalidValueError):
        m.begin_window(fixed_ms=1, matmul=(1, 1, 1))
    with pytest.raises(hprt.HprtError) as e:
        m.end_window()
    assert e.value.status == "HP_COMPRESS_INVALID_STATE"
    m.forward_start(0)
    key = m.save(0, activations(0, np.float32))
    m.begin_window(fixed_ms=1)
    with pytest.raises(hprt.HprtError) as e:
        m.forward_start(1)
    assert e.value.status == "HP_COMPRESS_INVALID_STATE"
    m.end_window()
    with pytest.raises(hprt.HprtError):
        m.forward_start(0)  # layer 0 still holds a tensor of this step
    m.take(key)
    with pytest.raises(hprt.HprtError):
        m.take(key)
    with pytest.raises(hprt.InvalidValueError):
        hprt.ActivationManager(s, p, encode_gbps=-1.0, decode_gbps=1.0)


@pytest.mark.skipif(hprt.get_platform().backend != "cpu", reason="host DLPack tensors need the cpu backend")
def test_process_wide_platform_with_measured_costs():
    p = hprt.get_platform()
    s = p.create_stream()
    m = hprt.ActivationManager(s, min_numel=1024)  # codec throughput measured here
    cost = m.cost()
    assert cost["encode_gbps"] > 0 and cost["decode_gbps"] > 0
    x = activations(3, np.float16)
    m.forward_start(0)
    key = m.save(0, x)
    m.forward_start(1)
    with m.window(fixed_ms=1000):
        pass
    assert m.is_compressed(key)
    m.backward_start(0)
    out = m.take(key)
    s.synchronize()
    assert np.from_dlpack(out).tobytes() == x.tobytes()


def test_an_encode_without_memory_keeps_its_tensor_and_warns():
    """No device memory for the large tensor's encoding: it stays uncompressed and reads back
    bit-exact, the small one is compressed, and the window's end warns of the failure (a
    training step goes on; nothing is lost)."""
    p = hprt.cpu_platform(device_memory=384 << 10)  # both tensors and one small encoding fit
    s = p.create_stream()
    m = manager(p, s)
    rng = np.random.default_rng(0)
    small = rng.standard_normal(2048).astype(np.float32)  # 8 KiB
    large = rng.standard_normal(65536).astype(np.float32)  # 256 KiB: its encoding does not fit
    m.forward_start(0)
    keys = {m.save(0, small): small, m.save(0, large): large}
    m.forward_start(1)
    with pytest.warns(RuntimeWarning, match="encode failed"):
        with m.window(unbounded=True):  # encodes layer 0
            pass
    assert [m.is_compressed(k) for k in keys] == [True, False]
    st = m.layer_stats()[0]
    assert (st["compressed"], st["encode_failures"]) == (1, 1), st
    m.backward_start(1)
    m.backward_start(0)
    for k, want in keys.items():
        t = m.take(k)
        s.synchronize()
        assert np.from_dlpack(t).tobytes() == want.tobytes()


def test_a_borrowed_array_is_given_back_once_encoded():
    """``save(..., borrow=True)`` registers a DLPack array without copying it (no device memory
    for it), holds it until it is encoded, then lets go of it; ``take`` returns its bytes in new
    memory, bit-exact."""
    import gc
    import weakref

    p = hprt.cpu_platform(device_memory=8 << 20)
    s = p.create_stream()
    m = manager(p, s)
    x = activations(3, np.float32)
    want, ref = x.tobytes(), weakref.ref(x)
    m.forward_start(0)
    before = p.memory_stats()["device_current"]
    key = m.save(0, x, borrow=True)
    assert p.memory_stats()["device_current"] == before  # no copy
    del x
    gc.collect()
    assert ref() is not None  # held while not yet encoded
    m.forward_start(1)
    with m.window(unbounded=True):  # encodes layer 0
        pass
    s.synchronize()
    gc.collect()
    assert m.is_compressed(key) and ref() is None  # given back once encoded
    m.backward_start(1)
    m.backward_start(0)
    t = m.take(key)
    s.synchronize()
    assert np.from_dlpack(t).tobytes() == want


@pytest.mark.parametrize("jitter", [None, 4])
def test_eager_saves_encode_and_takes_decode_ahead(jitter):
    """``schedule="eager"``: no windows; each save queues its encode, a later save lets the
    encoded originals go (borrowed arrays given back), and backward-order takes find their
    decodes begun ahead, bit-exact. The last array saved comes back as it was."""
    import gc
    import weakref

    p = hprt.cpu_platform(device_memory=8 << 20, jitter=jitter)
    s = p.create_stream()
    m = manager(p, s, schedule="eager", decode_ahead=2)
    want, refs, keys = {}, [], []
    for i in range(6):
        x = activations(20 + i, [np.float32, np.float16][i % 2])
        key = m.save(i // 3, x, borrow=True)
        want[key], keys = x.tobytes(), keys + [key]
        refs.append(weakref.ref(x))
        del x
        p.synchronize()  # the encode ran: the next save lets its original go
    gc.collect()
    assert [r() is None for r in refs] == [True] * 5 + [False]  # encoded ones given back
    assert [m.is_compressed(k) for k in keys] == [True] * 5 + [False]
    for k in reversed(keys):
        t = m.take(k)
        assert np.from_dlpack(t).tobytes() == want[k]
    stats = m.layer_stats()
    assert sum(st["compressed"] for st in stats.values()) == 5
    assert sum(st["decoded_ahead"] for st in stats.values()) == 5, stats
    assert sum(st["recovered_sync"] for st in stats.values()) == 0, stats


def test_eager_refuses_windows_and_warns_in_the_call_that_failed():
    p = hprt.cpu_platform(device_memory=384 << 10)
    s = p.create_stream()
    with pytest.raises(hprt.InvalidValueError, match='unknown schedule "lazy"'):
        manager(p, s, schedule="lazy")
    m = manager(p, s, schedule="eager")
    for call in (lambda: m.forward_start(0), lambda: m.backward_start(0),
                 lambda: m.begin_window(unbounded=True)):
        with pytest.raises(hprt.HprtError, match="no operator windows"):
            call()
    large = np.random.default_rng(1).standard_normal(65536).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="encode failed"):
        key = m.save(0, large)  # no memory for its encoding: kept as it is
    assert m.layer_stats()[0]["encode_failures"] == 1
    assert np.from_dlpack(m.take(key)).tobytes() == large.tobytes()
