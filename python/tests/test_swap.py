"""The hprt-swap front ends driven from Python on hprt device memory."""

import numpy as np
import pytest

import hprt
from emulated import EMULATED


@pytest.fixture()
def p():
    return hprt.cpu_platform(device_memory=1 << 20, jitter=3)


def tensor(p, s, values):
    arr = np.asarray(values, dtype=np.float32)
    buf = p.alloc_device(arr.nbytes)
    p.write(buf, arr.tobytes(), s)
    return hprt.DeviceTensor(buf, "f32", list(arr.shape)), arr


def read(p, s, t):
    return np.frombuffer(p.read(t.buffer, t.nbytes, s, t.offset), dtype=np.float32)


def group_round_trip(p, s, m, name, t, arr):
    """``t`` (holding ``arr``) through one offload and reload of group ``name`` with
    hyper_parallel's group calls: its device memory released between them, its values back
    after; the saved reference."""
    ref = m.add_storage(name, t)
    m.launch_offload(name, s)
    m.wait_offload(name)
    assert t.buffer.nbytes == 0
    m.launch_load(name)
    m.wait_load(name, s)
    assert np.array_equal(read(p, s, m.get(ref)), arr)
    return ref


def test_layer_group_swap_offloads_releases_and_restores(p):
    s = p.create_stream()
    m = hprt.SwapManager(p)
    layers = [m.new_layer() for _ in range(3)]
    for a, b in zip(layers, layers[1:]):
        m.set_forward_prefetch_layer(a, b)
    saved = []
    for i, layer in enumerate(layers):
        m.forward_pre(layer)
        t, arr = tensor(p, s, np.arange(64) + 100 * i)
        saved.append((m.save(t), t, arr, m.save("not a tensor")))
        m.forward_post(layer, s)
    # Layers 0 and 1 were offloaded and released once their successor finished forward.
    assert saved[0][1].buffer.nbytes == 0 and saved[1][1].buffer.nbytes == 0
    assert saved[2][1].buffer.nbytes == 256
    with pytest.raises(hprt.SwapStateError) as e:
        m.get(saved[0][0])
    assert e.value.status == "HP_SWAP_WRONG_STATE"
    for layer in reversed(layers):
        m.backward_pre(layer, s)
        ref, _, arr, other = saved[layer]
        got = m.get(ref)
        assert np.array_equal(read(p, s, got), arr)
        assert m.get(other) == "not a tensor"
        m.backward_post(layer)
    assert m.stats()["offloaded_bytes"] == 2 * 256
    m.end_iteration()
    with pytest.raises(hprt.SwapStateError):
        m.get(saved[0][0])  # a reference from an ended iteration


def test_layer_group_upstream_names_and_out_of_order_calls(p):
    """hyper_parallel's per-group calls, and each out-of-order call a typed error."""
    s = p.create_stream()
    m = hprt.SwapManager(p, compression="host_stage")
    t, arr = tensor(p, s, np.linspace(-3, 3, 64))
    m.set_current_group_name("attn")
    assert m.get_current_group_name() == "attn"
    group_round_trip(p, s, m, "attn", t, arr)
    assert m.stats()["compressed_tensors"] == 1
    a, b = m.new_layer(), m.new_layer()
    m.set_forward_prefetch_layer(a, b)
    with pytest.raises(hprt.SwapStateError):
        m.set_forward_prefetch_layer(b, a)  # reversed: a cycle
    with pytest.raises(hprt.SwapStateError):
        m.forward_post(a, s)  # without forward_pre
    m.forward_pre(a)
    m.forward_post(a, s)
    with pytest.raises(hprt.SwapStateError):
        m.save(t)  # outside a forward
    with pytest.raises(hprt.SwapStateError):
        m.backward_post(b)  # its backward never began


def test_keyed_swap_with_tensor_swap_context(p):
    s = p.create_stream()
    swap = hprt.KeyedSwap(p)
    ctxs = [hprt.TensorSwapContext(module_tag="model.layer.*", swap=swap) for _ in range(3)]
    assert [c.layer_idx for c in ctxs] == [0, 1, 2] and ctxs[0].layer_nums == 3
    packed = []
    for i, c in enumerate(ctxs):
        for j in range(2):
            t, arr = tensor(p, s, np.full(32, 10 * i + j))
            packed.append((c, c.pack(t, s), arr, t))
    # The last layer is never offloaded; earlier ones were, and layer 0 was released.
    assert packed[-1][1].key == (2, 1)
    assert packed[0][3].buffer.nbytes == 0
    for c, pk, arr, _ in reversed(packed):
        got = c.unpack(pk, s)
        assert np.array_equal(read(p, s, got), arr)
    assert swap.pending() == 0
    with pytest.raises(hprt.SwapStateError) as e:
        ctxs[0].unpack(packed[0][1], s)  # unpacked twice
    assert e.value.status == "HP_SWAP_UNKNOWN"


def test_one_tensor_swap_context_class_and_no_eager_torch_import():
    """``hprt.TensorSwapContext`` is ``hprt.torch.TensorSwapContext``; ``import hprt`` does not
    import torch (the class's with-block imports hprt.torch on first use)."""
    import subprocess
    import sys

    code = (
        "import sys, hprt\n"
        "assert 'torch' not in sys.modules, 'import hprt imported torch'\n"
        "ctx = hprt.TensorSwapContext(module_tag='a.*')\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n"
        "    import hprt.torch as ht\n"
        "except ImportError:\n"
        "    sys.exit(0)\n"
        "assert ht.TensorSwapContext is hprt.TensorSwapContext\n"
        "assert isinstance(ctx, ht.TensorSwapContext)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_keyed_swap_predicate_and_min_bytes(p):
    s = p.create_stream()
    swap = hprt.KeyedSwap(p, min_bytes=128)
    c0, _ = swap.register_layer("l.*"), swap.register_layer("l.*")
    small, _ = tensor(p, s, np.zeros(8))
    assert swap.pack(c0, small, s).key is None  # below min_bytes: kept
    swap.set_predicate(lambda t: t.shape != [64])
    big, _ = tensor(p, s, np.zeros(64))
    assert swap.pack(c0, big, s).key is None  # refused by the predicate
    other, _ = tensor(p, s, np.zeros(65))
    assert swap.pack(c0, other, s).key == (0, 0)


def test_pipeline_offload_groups(p):
    s = p.create_stream()
    off = hprt.PipelineOffload(p, min_tensor_elems=16)
    off.init_chunk()
    values = []
    for name in ["attn", "mlp"]:
        off.group_start(name)
        t, arr = tensor(p, s, np.random.default_rng(1).standard_normal(64))
        values.append((off.save(t), arr))
        off.group_commit(s)
    assert values[0][0].offloaded
    with pytest.raises(hprt.SwapStateError) as e:
        off.group_commit(s)
    assert e.value.status == "HP_SWAP_ORDER"
    for name, (tag, arr) in zip(["mlp", "attn"], reversed(values)):
        off.backward_group_begin(name, s)
        assert np.array_equal(read(p, s, off.get(tag, s)), arr)
        off.backward_group_end()
    off.reset()
    assert off.stats()["offloaded_bytes"] >= 256


def test_swap_reload_out_of_memory_keeps_host_copy():
    p = hprt.cpu_platform(device_memory=4096)
    s = p.create_stream()
    m = hprt.SwapManager(p)
    a, b = m.new_layer(), m.new_layer()
    m.set_forward_prefetch_layer(a, b)
    m.forward_pre(a)
    t, arr = tensor(p, s, np.arange(512))  # 2048 bytes
    ref = m.save(t)
    m.forward_post(a, s)
    m.forward_pre(b)
    m.forward_post(b, s)
    hog = p.alloc_device(3072)
    with pytest.raises(hprt.OutOfMemoryError):
        m.backward_pre(a, s)
    hog.free()
    m.backward_pre(a, s)  # retried: the host copy was intact
    assert np.array_equal(read(p, s, m.get(ref)), arr)


def test_proportional_slice_and_summary_table():
    assert hprt.proportional_slice(1, 2, 4) == (2, 4)
    table = hprt.offload_summary_table([{"attn": 10}, {"attn": 5, "mlp": 7}])
    assert "| 1 | 5 | 7 | 12 |" in table


def test_tensor_key_manager_upstream_names():
    """hyper_parallel's TensorKeyManager: keys in save order, a new layer after the previous one,
    a lower layer restarts the step, and the previous layer's keys split proportionally."""
    km = hprt.TensorKeyManager()
    assert km.get_key(0) == ((0, 0), False)
    assert km.get_key(0) == ((0, 1), False)
    assert km.get_key(0) == ((0, 2), False)
    assert km.get_key(1) == ((1, 0), True)
    assert km.get_key(1) == ((1, 1), False)
    assert km.count(0) == 3 and km.count(1) == 2
    # Layer 1's two tensors prefetch layer 0's three, each exactly once.
    assert km.get_prefetch_keys((1, 0)) == [(0, 0)]
    assert km.get_prefetch_keys((1, 1)) == [(0, 1), (0, 2)]
    assert km.get_prefetch_keys((0, 0)) == []
    assert km.get_key(0) == ((0, 0), False)  # the next step
    assert km.count(1) == 0


def test_a_storage_resized_back_and_written_before_its_reload_is_refused(p):
    """Issue 20's reproduction: an offloaded tensor's storage re-acquired outside swap
    (``DeviceBuffer.resize``) and written; the reload must not overwrite the new bytes."""
    s = p.create_stream()
    m = hprt.SwapManager(p)
    t, arr = tensor(p, s, np.arange(64))
    ref = m.add_storage("g", t)
    m.launch_offload("g", s)
    m.wait_offload("g")
    assert t.buffer.nbytes == 0
    t.buffer.resize(arr.nbytes)
    new = np.full(64, 7.0, dtype=np.float32)
    p.write(t.buffer, new.tobytes(), s)
    with pytest.raises(hprt.SwapStateError) as e:
        m.launch_load("g")
    assert e.value.status == "HP_SWAP_REACQUIRED_OUTSIDE_SWAP"
    assert np.array_equal(read(p, s, t), new)  # the new bytes stand
    del ref


def test_a_version_bumped_between_offload_and_reload_is_refused(p):
    s = p.create_stream()
    m = hprt.SwapManager(p)
    t, _ = tensor(p, s, np.arange(64))
    m.add_storage("g", t)
    m.launch_offload("g", s)
    m.wait_offload("g")
    t.bump_version()  # what a framework's in-place write does to its version counter
    with pytest.raises(hprt.SwapStateError) as e:
        m.launch_load("g")
    assert e.value.status == "HP_SWAP_MODIFIED_SINCE_OFFLOAD"


@pytest.mark.parametrize("compression", ["off", "device", "host_stage"])
@pytest.mark.parametrize("backend", EMULATED)
def test_every_front_end_on_an_emulated_accelerator(backend, compression):
    """The three front ends from Python on the npu / cuda backend over its emulator, plain and
    compressed: device memory released after the offload, values back bit-exact."""
    p = hprt.open_platform(backend)
    s = p.create_stream()
    rng = np.random.default_rng(5)
    # Layer groups (hyper_parallel's group calls).
    m = hprt.SwapManager(p, compression=compression)
    t, arr = tensor(p, s, rng.standard_normal(4096))
    group_round_trip(p, s, m, "g", t, arr)
    # Keyed swap: two layers, the first offloaded.
    keyed = hprt.KeyedSwap(p, compression=compression)
    ctxs = [keyed.register_layer("layer.*") for _ in range(2)]
    saved = [tensor(p, s, rng.standard_normal(4096)) for _ in ctxs]
    packed = [keyed.swap_out_cur_and_release_prev(c, t, s) for c, (t, _) in zip(ctxs, saved)]
    assert saved[0][0].buffer.nbytes == 0
    for pk, (_, a) in reversed(list(zip(packed, saved))):
        assert np.array_equal(read(p, s, keyed.wait_cur_and_prefetch_next(pk, s)), a)
    # Megatron's pipeline offload.
    off = hprt.PipelineOffload(p, min_tensor_elems=16, compression=compression)
    off.init_chunk()
    values = []
    for name in ["attn", "mlp"]:
        off.group_start(name)
        t, a = tensor(p, s, rng.standard_normal(4096))
        values.append((off.save(t), a))
        off.group_commit(s)
    for name, (tag, a) in zip(["mlp", "attn"], reversed(values)):
        off.backward_group_begin(name, s)
        assert np.array_equal(read(p, s, off.get(tag, s)), a)
        off.backward_group_end()
    off.reset()
    if compression != "off":
        for front in (m, keyed, off):
            assert front.stats()["compressed_tensors"] > 0


def test_an_offload_never_releases_memory_a_dlpack_view_reads(p):
    """ISSUE 32 item 15: a swap offload released an hprt-owned tensor's storage under a live
    DLPack export of it, and the view then read the next allocation's bytes. Now the release is
    refused as ``free`` is (``BufferExportedError``), the memory and the view stay, and the
    offload finishes once the view is gone."""
    s = p.create_stream()
    m = hprt.SwapManager(p)
    t, arr = tensor(p, s, np.arange(64) * 0.5)
    s.synchronize()
    view = np.from_dlpack(t.view())
    ref = m.add_storage("attn", t)
    m.launch_offload("attn", s)
    with pytest.raises(hprt.BufferExportedError, match="swap offload: 1 DLPack export"):
        m.wait_offload("attn")
    assert t.buffer.nbytes == 256 and np.array_equal(view, arr)
    other = p.alloc_device(256)  # would take the released memory
    p.memset(other, 0xFF, 256, s)
    s.synchronize()
    assert np.array_equal(view, arr)
    del view
    m.wait_offload("attn")
    assert t.buffer.nbytes == 0
    m.launch_load("attn")
    m.wait_load("attn", s)
    assert np.array_equal(read(p, s, m.get(ref)), arr)


def test_keyed_and_pipeline_offloads_refuse_to_release_a_viewed_storage(p):
    s = p.create_stream()
    swap = hprt.KeyedSwap(p)
    ctxs = [hprt.TensorSwapContext(module_tag="viewed.*", swap=swap) for _ in range(3)]
    t, arr = tensor(p, s, np.arange(32) + 7.0)
    s.synchronize()
    view = np.from_dlpack(t.view())
    with pytest.raises(hprt.BufferExportedError):
        for c in ctxs:
            c.pack(t if c is ctxs[0] else tensor(p, s, np.zeros(32))[0], s)
    assert t.buffer.nbytes == 128 and np.array_equal(view, arr)

    off = hprt.PipelineOffload(p, min_tensor_elems=16)
    off.init_chunk()
    t, arr = tensor(p, s, np.arange(64) - 3.0)
    s.synchronize()
    view = np.from_dlpack(t.view())
    with pytest.raises(hprt.BufferExportedError):
        for name in ["attn", "mlp", "out"]:
            off.group_start(name)
            off.save(t if name == "attn" else tensor(p, s, np.zeros(64))[0])
            off.group_commit(s)
            s.synchronize()
    assert t.buffer.nbytes == 256 and np.array_equal(view, arr)
