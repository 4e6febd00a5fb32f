"""The Python package's shape: what ``import hprt`` loads, and the names ``hprt.torch`` and
``hprt.fsdp`` give (written out here, so that moving code between their modules cannot change
what users and the tests import)."""

import subprocess
import sys

import pytest


def test_import_hprt_loads_no_torch_integration():
    """``import hprt`` (the Rust extension's names) imports neither torch nor hprt's torch
    integration: a process without torch, or one that never uses it, pays for neither."""
    code = (
        "import sys, hprt\n"
        "loaded = [m for m in ('torch', 'hprt.torch', 'hprt.fsdp') if m in sys.modules]\n"
        "assert not loaded, f'import hprt imported {loaded}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


FSDP_ALL = [
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

TORCH_ALL = FSDP_ALL + [
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

# Names outside ``__all__`` that the tests, the benchmarks or ``hprt.TensorSwapContext`` read
# (or patch) on hprt.torch / hprt.fsdp.
TORCH_ALSO = [
    "MODES",
    "_ATTACHED",
    "_CODEC_THREAD_MIN_BYTES",
    "_STREAM_ATTR",
    "_StreamRecorder",
    "_empty_like_layout",
    "_host_reload",
    "_is_dense",
    "_keyed_enter",
    "_layout",
    "_platform_empty",
    "_stream_recorder",
]
FSDP_ALSO = ["_HostDeviceMemory", "_context"]


def test_torch_integration_names():
    pytest.importorskip("torch")
    import hprt
    import hprt.fsdp as fsdp
    import hprt.torch as ht

    assert fsdp.__all__ == FSDP_ALL
    assert ht.__all__ == TORCH_ALL
    for module, names in ((fsdp, FSDP_ALL + FSDP_ALSO), (ht, TORCH_ALL + TORCH_ALSO)):
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{module.__name__} lacks {missing}"
    # hprt.torch re-exports hprt.fsdp's names: the same objects, not copies.
    assert all(getattr(ht, n) is getattr(fsdp, n) for n in FSDP_ALL)
    assert ht.TensorSwapContext is hprt.TensorSwapContext
    assert ht.MODES == ("keep", "keyed", "swap", "pipeline", "compress", "managed_compress")
    for name in ("from hprt.torch import *", "from hprt.fsdp import *"):
        scope = {}
        exec(name, scope)
        assert set(TORCH_ALL if "torch" in name else FSDP_ALL) <= set(scope)


def test_names_patched_on_hprt_torch_take_effect(monkeypatch):
    """Tests and benchmarks patch these private names on ``hprt.torch`` (the reload allocation,
    the hand-over to torch's allocator, compress mode's codec-thread threshold); the modules
    that use them look them up there, so a patch still takes effect."""
    torch = pytest.importorskip("torch")
    import hprt
    import hprt.torch as ht

    calls = []
    monkeypatch.setattr(ht, "_stream_recorder", lambda backend: calls.append(backend))
    ht.Runtime(hprt.cpu_platform())
    assert calls == ["cpu"]

    calls.clear()
    real_empty, real_reload = ht._empty_like_layout, ht._host_reload
    monkeypatch.setattr(ht, "_empty_like_layout",
                        lambda *a: calls.append("empty") or real_empty(*a))
    monkeypatch.setattr(ht, "_host_reload",
                        lambda *a: calls.append("reload") or real_reload(*a))
    platform = hprt.cpu_platform(device_memory=1 << 20)
    out = ht._platform_empty(platform, (2, 3), (3, 1), 0, torch.float32)
    assert calls == ["reload"] and tuple(out.shape) == (2, 3)
    calls.clear()
    out = ht._host_reload(None, ((4,), (1,), 0, torch.float32, 4))  # no room: torch allocates
    assert calls == ["reload", "empty"] and tuple(out.shape) == (4,)

    monkeypatch.setattr(ht, "_CODEC_THREAD_MIN_BYTES", 0)  # every tensor to the codec thread
    comp = ht.compress_saved_tensors()
    x = torch.randn(64, requires_grad=True)
    with comp:
        h = x * 2
        loss = (h * h).sum()
    assert comp._codec is not None
    loss.backward()
    assert torch.equal(x.grad, 8 * x.detach()) and comp.stats()["tensors"] > 0
