"""python/benchmarks/torch_swap_step.py's memory columns, per-layer timeline and trace: every cpu
path run on tiny shapes (the benchmark's own transformer and a transformers Llama), the replay of
torch's CUDA memory history on a synthetic trace in torch's format, and the CUDA path of the
memory step with torch.cuda's calls stubbed (no GPU here: its figures are the stubs', the code
path is the benchmark's)."""

import importlib.util
import json
import pathlib
import sys
import types

import pytest
import torch

import hprt

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "torch_swap_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("torch_swap_step", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_main(bench, monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["torch_swap_step.py", *argv])
    bench.main()
    return capsys.readouterr().out


TINY = ["--layers", "2", "--dim", "64", "--seq", "64", "--batch", "4", "--steps", "1",
        "--rounds", "1", "--no-hook-cost", "--threads", "1", "--min-bytes", "1024"]


@pytest.mark.parametrize("model,modes", [("transformer", "keep,swap"), ("llama", "keep,pipeline")])
def test_the_cpu_run_prints_the_memory_columns_the_timeline_and_writes_the_trace(
        bench, monkeypatch, capsys, tmp_path, model, modes):
    trace = tmp_path / "t.json"
    out = run_main(bench, monkeypatch, capsys, *TINY, "--modes", modes, "--model", model,
                   "--trace", str(trace))
    swapping = modes.split(",")[1]
    # Head dim 128 by default: dim 64 gets one head of 64.
    assert "1 heads of 64" in out
    if model == "llama":
        assert "transformers LlamaModel" in out
    header = next(line for line in out.splitlines() if line.startswith("| mode |"))
    for col in ("torch peak MiB", "device peak MiB", "hprt device_peak MiB",
                "platform device_peak MiB"):
        assert col in header
    rows = {line.split("|")[1].strip(): line.split("|")[1:-1]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    for mode in ("plain torch", "torch save_on_cpu", "keep", swapping):
        cells = [c.strip() for c in rows[mode]]
        assert len(cells) == 9, cells
        # The device peak (the cpu platform's high water) is a number for every mode; hprt's
        # device_peak only where hprt was attached.
        float(cells[6])
        assert (cells[7] == "-") == (mode in ("plain torch", "torch save_on_cpu")), cells
    # The torch peak on cpu (live heap at layer boundaries) sees the saved activations, and
    # swap's offloads (to the platform's pinned memory, left out) take them away (pipeline
    # keeps the last of the two layers: no lower).
    peak = {mode: float(rows[mode][5]) for mode in ("plain torch", swapping)}
    assert peak["plain torch"] >= 0.5, peak
    if swapping == "swap":
        assert peak["swap"] < 0.5 * peak["plain torch"], peak
    assert "Per-layer timeline (heap live above step start" in out
    swap_at = out.index(f"  {swapping}:\n")
    fwd, bwd = out[swap_at:].splitlines()[1:3]
    assert fwd.split()[0] == "fwd" and len(fwd.split()) == 3, fwd
    assert bwd.split()[1].startswith("L1:") and bwd.split()[2].startswith("L0:"), bwd
    events = json.loads(trace.read_text())["traceEvents"]
    procs = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    # (--modes swap also runs swap's compress-then-swap variants)
    assert {"plain torch", "torch save_on_cpu", "keep", swapping} <= procs
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans} == {"L0 fwd", "L1 fwd", "L0 bwd", "L1 bwd"}
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert "platform device (MiB)" in counters


def test_heads_and_head_dim(bench):
    args = types.SimpleNamespace(heads=None, head_dim=128, dim=1024, ffn=None)
    assert bench.resolve_heads(args).heads == 8
    args = types.SimpleNamespace(heads=4, head_dim=128, dim=1024, ffn=None)
    assert bench.resolve_heads(args).head_dim == 256
    with pytest.raises(SystemExit):
        bench.resolve_heads(types.SimpleNamespace(heads=3, head_dim=128, dim=1024, ffn=None))


def frames(name, filename="/x/site-packages/hprt/torch/memory.py", line=150):
    return [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": filename, "line": line, "name": name}]


def test_replay_of_torch_memory_history(bench):
    """Live bytes per tag, the peak, and what was alive there by allocating frame."""
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 1 << 30},
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames("forward", "/b/m.py", 7),
         "user_metadata": "L0 fwd"},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frames("forward", "/b/m.py", 7),
         "user_metadata": "L1 fwd"},
        {"action": "free_requested", "addr": 1, "size": 100, "user_metadata": "L1 bwd"},
        {"action": "alloc", "addr": 3, "size": 300, "frames": frames("_empty_like_layout"),
         "user_metadata": "L1 bwd"},
        {"action": "free_completed", "addr": 1, "size": 100, "user_metadata": "L1 bwd"},
        # Allocated before the recording: counted in start_bytes, freed from it.
        {"action": "free_completed", "addr": 99, "size": 10, "user_metadata": "L0 bwd"},
        {"action": "free_completed", "addr": 3, "size": 300, "user_metadata": "L0 bwd"},
    ]
    per_tag, (peak, tag), top = bench.replay_history(trace, start_bytes=10)
    assert per_tag == {"L0 fwd": 110, "L1 fwd": 160, "L1 bwd": 460, "L0 bwd": 350}
    assert (peak, tag) == (460, "L1 bwd")
    assert top == [("_empty_like_layout (memory.py:150)", 300), ("forward (m.py:7)", 150)]
    lines = bench.history_lines((per_tag, (peak, tag), top))
    assert "L0:0 L1:0" in lines[0] and "during L1 bwd" in lines[2]


def test_the_cuda_memory_step_with_torch_cuda_stubbed(bench, monkeypatch):
    """The CUDA branch of the memory step on CPU tensors, torch.cuda's calls stubbed: every
    layer's phase tags its allocations, mem_get_info's low water is the device peak, and the
    recorded history is replayed."""
    state = {"tag": "", "allocated": 1000, "trace": [], "recording": False, "calls": []}

    def alloc(size):
        state["allocated"] += size
        if state["recording"]:
            state["trace"].append({"action": "alloc", "addr": len(state["trace"]),
                                   "size": size, "user_metadata": state["tag"],
                                   "frames": frames("forward", "/b/m.py", 1)})

    def set_meta(tag):
        state["tag"] = tag
        alloc(64)  # stands for the layer's activations

    def record(*a, enabled="all", **kw):
        state["recording"] = enabled is not None
        state["calls"].append(("record", enabled))

    cuda = types.SimpleNamespace(
        synchronize=lambda: None, empty_cache=lambda: None,
        reset_peak_memory_stats=lambda: None, current_device=lambda: 0,
        memory_allocated=lambda: state["allocated"],
        max_memory_allocated=lambda: state["allocated"] + 7,
        mem_get_info=lambda: (10_000 - state["allocated"], 10_000),
        memory=types.SimpleNamespace(
            _record_memory_history=record, _set_memory_metadata=set_meta,
            _snapshot=lambda: {"device_traces": [list(state["trace"])]}),
    )
    monkeypatch.setattr(bench.torch, "cuda", cuda)
    platform = hprt.cpu_platform(device_memory=1 << 20)
    args = types.SimpleNamespace(device="cuda", no_history=False)
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    x = torch.randn(2, 4)

    def step():
        y = x
        for layer in layers:
            y = layer(y)
        y.sum().backward()

    out = bench.MemoryProbe(args, platform, list(layers)).run(step)
    tags = [label for label, _, _ in out["samples"]]
    assert tags == ["start", "L0 fwd", "L1 fwd", "L2 fwd", "L2 bwd", "L1 bwd", "L0 bwd", "end"]
    assert state["calls"] == [("record", "all"), ("record", None)]
    per_tag, (peak, tag), top = out["history"]
    assert list(per_tag) == ["L0 fwd", "L1 fwd", "L2 fwd", "loss", "L2 bwd", "L1 bwd",
                             "L0 bwd", ""]
    assert peak == 1000 + 8 * 64 and top == [("forward (m.py:1)", 8 * 64)]
    # total - low water of mem_get_info, sampled before the tag was cleared (one more alloc)
    assert out["device_peak"] == 1000 + 7 * 64
    assert out["torch_peak"] == 1000 + 8 * 64 + 7
    assert state["tag"] == ""  # the thread's tag is cleared
