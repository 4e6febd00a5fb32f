"""The platform layer from Python: buffers, streams, events, DLPack both ways, raw pointers,
typed exceptions carrying the status name."""

import os
import threading

import numpy as np
import pytest

import hprt
from emulated import EMULATED


@pytest.fixture()
def p():
    return hprt.cpu_platform(device_memory=1 << 20, pinned_memory=1 << 20)


def test_get_platform_follows_hp_platform():
    a, b = hprt.get_platform(), hprt.get_platform()
    forced = os.environ.get("HP_PLATFORM", "").strip().lower()
    assert a.backend == b.backend
    if forced not in ("", "auto"):
        assert a.backend == forced
        assert hprt.platform_selection_reason() == f"HP_PLATFORM={forced}"
    else:
        assert hprt.platform_selection_reason().startswith("auto")


def test_unknown_backend_name_is_a_typed_error():
    with pytest.raises(hprt.InvalidValueError) as e:
        hprt.open_platform("tpu")
    assert e.value.status == "HP_ERROR_INVALID_VALUE" and "tpu" in str(e.value)


@pytest.mark.parametrize("backend", EMULATED)
def test_accelerator_backend_through_its_emulator(backend):
    p = hprt.open_platform(backend)
    assert p.backend == backend
    s = p.create_stream()
    dev = p.alloc_device(64)
    p.write(dev, bytes(range(64)), s)
    assert p.read(dev, 64, s) == bytes(range(64))
    with pytest.raises(hprt.UnsupportedError):
        dev.view("u8", [64])  # device memory is not host memory
    pin = p.alloc_pinned(64)
    p.copy(pin, dev, s)
    s.synchronize()
    assert np.from_dlpack(pin.view("u8", [64])).tolist() == list(range(64))


_CAPABILITY_FIELDS = {"device_memory_is_host", "framework_device", "host_stream", "kernel_compiler",
                      "ranks_are_threads", "ranks_share_device", "configurable_devices",
                      "checked_stream_handles"}


def test_capabilities_of_the_cpu_backend(p):
    c = p.capabilities
    assert set(vars(c)) == _CAPABILITY_FIELDS
    assert c.device_memory_is_host and c.host_stream and c.configurable_devices
    assert c.ranks_are_threads and c.ranks_share_device and not c.kernel_compiler
    assert c.framework_device == "cpu" and c.checked_stream_handles


@pytest.mark.parametrize("backend", EMULATED)
def test_capabilities_on_the_emulators(backend):
    """ISSUE 31 item 2: what used to be ``"emulator" in info()["driver"]`` is the platform's to
    say: no torch device addresses the emulators' memory, and their ranks are threads."""
    c = hprt.open_platform(backend).capabilities
    assert set(vars(c)) == _CAPABILITY_FIELDS
    assert c.framework_device is None
    assert c.ranks_are_threads and not c.ranks_share_device
    assert not c.device_memory_is_host and not c.host_stream and not c.configurable_devices
    assert c.kernel_compiler == (backend == "cuda")  # the CUDA emulator's NVRTC
    assert not c.checked_stream_handles


@pytest.mark.parametrize("backend", EMULATED)
def test_a_raw_driver_stream_handle_is_wrapped_only_by_the_unsafe_call(backend):
    """ISSUE 32 item 15: a cuda / npu stream handle is a pointer nothing can check
    (``wrap_stream(0x1000)`` would crash at the first use), so the checked ``wrap_stream``
    refuses one and ``unsafe_wrap_stream`` says in its name that it takes it on trust; raw 0
    is the default stream on cuda, and a null ``aclrtStream`` the npu backend refuses."""
    p = hprt.open_platform(backend)
    with pytest.raises(hprt.InvalidValueError, match="unsafe_wrap_stream"):
        p.wrap_stream(0x1000)
    s = p.create_stream()
    assert "unsafe" in p.unsafe_wrap_stream.__doc__.lower()
    w = p.unsafe_wrap_stream(s.raw)
    assert w.is_external and w.raw == s.raw
    w.synchronize()
    if backend == "cuda":
        p.wrap_stream(0).synchronize()
    else:
        with pytest.raises(hprt.InvalidValueError, match="null aclrtStream"):
            p.wrap_stream(0)


def test_copy_round_trip_through_pinned_memory(p):
    s = p.create_stream()
    dev = p.alloc_device(256)
    pin = p.alloc_pinned(256)
    pin.write(bytes(range(256)))
    p.copy(dev, pin, s)
    back = p.alloc_pinned(256)
    p.copy(back, dev, s)
    ev = s.record_event()
    ev.synchronize()
    assert ev.query()
    assert back.read() == bytes(range(256))


def test_pinned_access_waits_for_queued_copies():
    # Under the cpu backend's jitter every queued copy is late: a read, a DLPack export or a
    # write of the pinned buffer right after the copy is queued must wait for it.
    p = hprt.cpu_platform(jitter=7)
    s = p.create_stream()
    data = bytes(i * 13 % 251 for i in range(4096))
    dev = p.alloc_device(4096)
    p.write(dev, data, s)
    for _ in range(8):
        pin = p.alloc_pinned(4096)
        pin.write(b"\x00" * 4096)
        p.copy(pin, dev, s)
        assert pin.read() == data
        pin = p.alloc_pinned(4096)
        p.copy(pin, dev, s)
        assert np.from_dlpack(pin.view("u8", [4096])).tobytes() == data
        dev2 = p.alloc_device(4096)
        p.copy(dev2, pin, s)
        pin.write(b"\xff" * 4096)
        assert p.read(dev2, 4096, s) == data


def test_events_order_streams(p):
    a, b = p.create_stream(), p.create_stream()
    dev = p.alloc_device(64)
    p.memset(dev, 7, 64, a)
    b.wait_event(a.record_event())
    out = p.alloc_pinned(64)
    p.copy(out, dev, b)
    b.synchronize()
    assert out.read() == b"\x07" * 64


def test_memory_accounting_and_out_of_memory(p):
    p.reset_peak_memory()
    before = p.memory_stats()["device_current"]
    buf = p.alloc_device(4096)
    st = p.memory_stats()
    assert st["device_current"] == before + 4096 and st["device_peak"] >= before + 4096
    buf.resize(0)
    assert p.memory_stats()["device_current"] == before and buf.nbytes == 0
    buf.resize(4096)
    assert buf.nbytes == 4096
    with pytest.raises(hprt.OutOfMemoryError) as e:
        p.alloc_device(2 << 20)
    assert e.value.status == "HP_ERROR_OUT_OF_MEMORY"
    assert "HP_ERROR_OUT_OF_MEMORY" in str(e.value)
    assert e.value.backend == "cpu" and e.value.operation == "alloc_device"
    assert isinstance(e.value, hprt.HprtError)


def test_use_after_free_is_a_typed_error(p):
    s = p.create_stream()
    buf = p.alloc_device(16)
    buf.free()
    with pytest.raises(hprt.InvalidHandleError) as e:
        p.memset(buf, 0, 16, s)
    assert e.value.status == "HP_ERROR_INVALID_HANDLE"
    s.destroy()
    with pytest.raises(hprt.InvalidHandleError):
        s.synchronize()


def test_out_of_range_copy_is_rejected(p):
    s = p.create_stream()
    with pytest.raises(hprt.InvalidValueError) as e:
        p.copy(p.alloc_device(8), p.alloc_pinned(16), s, nbytes=16)
    assert e.value.status == "HP_ERROR_OUT_OF_RANGE"


def test_bad_arguments_raise_not_panic(p):
    with pytest.raises(hprt.InvalidValueError):
        p.alloc_device(8).view("complex", [1])
    with pytest.raises(hprt.InvalidValueError):
        p.alloc_device(8).view("f32", [4])  # 16 bytes do not fit 8
    with pytest.raises(hprt.InvalidValueError):
        hprt.cpu_platform(devices=0)


def test_dlpack_export_to_numpy_is_zero_copy(p):
    s = p.create_stream()
    buf = p.alloc_device(16)
    p.write(buf, np.arange(4, dtype=np.float32).tobytes(), s)
    a = np.from_dlpack(buf.view("f32", [2, 2]))
    assert a.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    p.memset(buf, 0, 16, s)
    s.synchronize()
    assert not a.any()  # same memory


def test_dlpack_export_of_pinned_memory(p):
    pin = p.alloc_pinned(8)
    pin.write(np.array([5, 6], dtype=np.int32).tobytes())
    assert np.from_dlpack(pin.view("int32", [2])).tolist() == [5, 6]


def test_dlpack_import_wraps_numpy_memory_and_keeps_it_alive(p):
    s = p.create_stream()
    arr = np.arange(8, dtype=np.float64)
    t = p.from_dlpack(arr)
    assert (t.dtype, t.shape, t.nbytes) == ("f64", [8], 64) and t.buffer.is_borrowed
    assert t.buffer.ptr == arr.ctypes.data
    p.memset(t.buffer, 0, 64, s)
    s.synchronize()
    assert not arr.any()
    del arr
    assert p.read(t.buffer, 8, s) == b"\x00" * 8  # the import holds the array
    with pytest.raises(hprt.InvalidValueError):
        p.from_dlpack(np.ones((4, 4))[:, ::2])  # not dense


def test_raw_pointer_wrap_releases_its_owner():
    p = hprt.cpu_platform(device_memory=1 << 20)
    released = threading.Event()

    class Owner:
        def __del__(self):
            released.set()

    arr = np.zeros(4, dtype=np.uint8)
    buf = p.unsafe_wrap_device_memory(arr.ctypes.data, 4, Owner())
    assert buf.is_borrowed and not released.is_set()
    with pytest.raises(hprt.UnsupportedError):
        buf.resize(0)  # framework memory is not hprt's to resize
    del buf
    import gc

    gc.collect()
    p.create_stream()  # a Python call gives the deferred decref a chance to run
    assert released.wait(5)


def test_memory_under_a_dlpack_export_is_neither_freed_nor_resized(p):
    """A numpy / torch tensor over hprt memory reads it directly: freed or resized under it, the
    tensor would read and write the next allocation's bytes (pinned memory: a segfault). While
    an export lives, free and resize are refused, as bytearray refuses a resize under a
    memoryview."""
    torch = pytest.importorskip("torch")
    s = p.create_stream()
    buf = p.alloc_device(64)
    a = np.from_dlpack(buf.view("f32", [4], offset=16))
    for op in (buf.free, lambda: buf.resize(0), lambda: buf.resize(128)):
        with pytest.raises(hprt.BufferExportedError) as e:
            op()
        assert isinstance(e.value, BufferError) and isinstance(e.value, hprt.HprtError)
        assert e.value.status == "HP_ERROR_BUFFER_EXPORTED" and "DLPack export" in str(e.value)
    assert buf.nbytes == 64 and not buf.is_freed
    a[:] = 7  # still the buffer's memory
    assert p.read(buf, 4, s, offset=16) == np.float32(7).tobytes()
    rest = a[1:]  # a numpy view of the array keeps the export
    del a
    with pytest.raises(BufferError):
        buf.free()
    del rest
    buf.resize(0)  # no export left
    buf.resize(64)
    t = torch.from_dlpack(buf.view("f32", [16]))
    with pytest.raises(BufferError):
        buf.free()
    del t
    buf.free()
    assert buf.is_freed
    capsule = p.alloc_device(8)
    unconsumed = capsule.view("u8", [8]).__dlpack__()  # a capsule nobody imported yet
    with pytest.raises(BufferError):
        capsule.free()
    del unconsumed
    capsule.free()
    pin = p.alloc_pinned(64)
    b = np.from_dlpack(pin.view("u8", [64]))
    with pytest.raises(hprt.BufferExportedError):
        pin.free()
    b[0] = 1
    assert pin.read(0, 1) == b"\x01"
    del b
    pin.free()
    p.alloc_device(0).view("f32", [0]).__dlpack__()  # an empty export holds nothing
    # hprt importing its own export: freeing the import releases the export (no deadlock)
    buf = p.alloc_device(16)
    t = p.from_dlpack(buf.view("f32", [4]))
    with pytest.raises(BufferError):
        buf.free()
    t.buffer.free()
    buf.free()


def test_raw_pointer_wrapping_says_it_is_unsafe(p):
    """Nothing can check a raw pointer (wrapping 0x1000 and copying from it segfaults), so the
    call says so in its name, and the old safe-sounding name is gone."""
    assert "unsafe" in p.unsafe_wrap_device_memory.__doc__.lower()
    assert not hasattr(p, "wrap_device_memory")
    with pytest.raises(hprt.InvalidValueError):
        p.unsafe_wrap_device_memory(0, 4)
    arr = np.arange(4, dtype=np.uint8)
    buf = p.unsafe_wrap_device_memory(arr.ctypes.data, 4, arr)
    assert buf.is_borrowed and p.read(buf, 4, p.create_stream()) == arr.tobytes()


def test_wrap_stream_shares_the_stream(p):
    s = p.create_stream()
    w = p.wrap_stream(s.raw)
    assert w.is_external and w.raw == s.raw
    w.synchronize()
    # The cpu backend checks a raw handle against its own streams.
    with pytest.raises(hprt.InvalidHandleError):
        p.wrap_stream(s.raw + 12345)


def test_sizes_are_checked_before_anything_is_sized_from_them(p):
    s = p.create_stream()
    dev = p.alloc_device(64)
    for read in (lambda: p.read(dev, 2**45, s), lambda: p.alloc_pinned(64).read(0, 2**45)):
        with pytest.raises(hprt.HprtError) as e:
            read()
        assert e.value.status == "HP_ERROR_OUT_OF_RANGE"
    with pytest.raises(hprt.InvalidValueError):
        hprt.cpu_platform(devices=2**40)
    with pytest.raises(hprt.InvalidValueError):
        p.comm_init(p.unique_id(), 0, 2**40)


def test_backend_names_are_exact():
    for name in ["", "CPU ", " cpu", "Cpu"]:
        with pytest.raises(hprt.InvalidValueError):
            hprt.open_platform(name)
    assert hprt.open_platform("cpu").backend == "cpu"


def _interrupt_soon(delay=0.3):
    import signal

    timer = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_ctrl_c_interrupts_a_comm_init_waiting_for_a_missing_rank():
    import time

    q = hprt.cpu_platform(collective_timeout_s=60)
    uid = q.unique_id()
    t0 = time.monotonic()
    timer = _interrupt_soon()
    with pytest.raises(KeyboardInterrupt):
        q.comm_init(uid, 0, 2)  # rank 1 never comes
    timer.join()
    assert time.monotonic() - t0 < 10


def test_ctrl_c_interrupts_a_synchronize_behind_a_stuck_collective():
    import time

    q = hprt.cpu_platform(collective_timeout_s=60)
    uid = q.unique_id()
    joined = threading.Event()
    release = threading.Event()
    comms = {}

    def peer():
        comms[1] = q.comm_init(uid, 1, 2)
        joined.set()
        release.wait(30)  # joined, but never issues the all-reduce

    t = threading.Thread(target=peer)
    t.start()
    comm = q.comm_init(uid, 0, 2)
    assert joined.wait(10)
    s = q.create_stream()
    buf = q.alloc_device(64)
    comm.all_reduce(buf, buf, 4, "f32", "sum", s)
    t0 = time.monotonic()
    timer = _interrupt_soon()
    try:
        for sync in (s.synchronize, q.synchronize):
            with pytest.raises(KeyboardInterrupt):
                sync()
            timer.join()
            timer = _interrupt_soon()
    finally:
        timer.cancel()
        release.set()
        t.join()
    assert time.monotonic() - t0 < 10


def test_a_device_tensor_takes_the_dlpack_keywords_itself():
    """``DeviceTensor.__dlpack__`` has the protocol's keywords: a wrong one is a TypeError that
    names the method called (it named ``TensorView.__dlpack__``, which the caller never saw)."""
    p = hprt.cpu_platform(device_memory=1 << 20)
    buf = p.alloc_device(16)
    p.write(buf, np.arange(4, dtype=np.float32).tobytes(), p.create_stream())
    p.synchronize()
    t = hprt.DeviceTensor(buf, "f32", [4])
    assert np.from_dlpack(t).tolist() == [0.0, 1.0, 2.0, 3.0]
    capsule = t.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=False)  # accepted
    del capsule
    with pytest.raises(TypeError, match=r"DeviceTensor\.__dlpack__"):
        t.__dlpack__(bogus=1)
