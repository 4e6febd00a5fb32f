"""No leak over 1,000 steps of every training pattern, in every hprt.torch mode.

The patterns are ``test_torch_patterns``' own (forward without backward, dropped graphs, two
forwards then one backward, retain_graph, partial backward, gradient accumulation, no_grad
evaluation, both checkpointings, bf16 autocast, exceptions in forward and backward), each
repeated until it made 1,000 training steps (forward passes), on a model with the interface of
the transformers models there but one multiplication per layer and no optimizer arithmetic: the
cost is hprt.torch's hooks and autograd's. Every mode runs in a process of its own, two at a
time. After a warm-up nothing may grow: torch tensors alive (exactly), Python objects of any type
(a leak per pattern run adds over 125), hprt's device bytes and pinned bytes in use (zero) and held
(no growth), and the host's resident set (at most ``RSS_BOUND``). With ``HP_TEST_DEVICE=cuda``
(see ``test_torch_patterns``) the same runs on CUDA tensors and the cuda backend, and torch's own
allocated CUDA bytes must not grow either."""

import collections
import concurrent.futures
import gc
import json
import os
import subprocess
import sys
import time
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
nn = torch.nn

import hprt  # noqa: E402
import hprt.torch as ht  # noqa: E402
import test_torch_patterns as tp  # noqa: E402

STEPS = int(os.environ.get("HP_LEAK_STEPS", "1000"))  # forward passes of each pattern
WARMUP = 50
# Resident-set growth allowed over a mode's 13,000 steps: allocator slack (the object census
# itself lists ~100k objects). A leak of 160 bytes per step exceeds it.
RSS_BOUND = 2 << 20
HIDDEN = 4


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((HIDDEN,), 0.5))

    def forward(self, x):
        return x * self.w  # saves x (hprt's) and w (a parameter: autograd's)


class TinyLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Scale()

    def forward(self, x):
        return self.mlp(x)


class TinyLM(nn.Module):
    """What the patterns use of a transformers causal LM (``model.model.layers[i].mlp``,
    ``labels=``, ``.logits``, ``output_hidden_states=``, ``gradient_checkpointing_enable``),
    with one multiplication per layer: the inputs are float rows, the loss their sum."""

    def __init__(self):
        super().__init__()
        self.embed = Scale()  # the layers' input requires grad, as an embedding's does
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(TinyLayer() for _ in range(2))
        self.checkpointing = None
        self.forwards = 0

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs):
        self.checkpointing = gradient_checkpointing_kwargs["use_reentrant"]

    def forward(self, x, labels=None, output_hidden_states=False):
        self.forwards += 1
        x = self.embed(x)
        hidden = [x]
        for layer in self.model.layers:
            if self.checkpointing is None:
                x = layer(x)
            else:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.checkpointing)
            hidden.append(x)
        return types.SimpleNamespace(loss=None if labels is None else x.sum(), logits=x,
                                     hidden_states=hidden if output_hidden_states else None)


class NoOptimizer:
    """The patterns' optimizer calls, without the arithmetic (not hprt's concern)."""

    def zero_grad(self):
        pass

    def step(self):
        pass


def tiny_data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, HIDDEN, generator=g).to(tp.DEVICE) for _ in range(6)]


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def census():
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def live_tensors(counts):
    return sum(n for name, n in counts.items() if name in ("Tensor", "Parameter"))


def run_patterns(model, opt, data, steps):
    """Each pattern, repeated until it made ``steps`` forward passes."""
    rec = lambda *a: None  # noqa: E731
    for pattern in tp.PATTERNS.values():
        model.forwards = 0
        while model.forwards < steps:
            model.checkpointing = None
            pattern(model, opt, data, rec)
    model.checkpointing = None


def measure(mode, steps):
    """Runs every pattern ``steps`` times in ``mode`` after a warm-up; what grew, and the cost."""
    torch.set_num_threads(1)  # intra-op threads only spin against each other on tensors this small
    if tp.DEVICE == "cpu":
        platform = hprt.cpu_platform(device_memory=64 << 20)
    else:
        platform = hprt.get_platform()
    model, opt, data = TinyLM().to(tp.DEVICE), NoOptimizer(), tiny_data()
    torch_bytes = (torch.cuda.memory_allocated if tp.DEVICE == "cuda" else lambda: 0)
    with tp.attach_mode(model, platform, mode) as handle:
        run_patterns(model, opt, data, WARMUP)  # pools, caches
        # hprt lets go of Python objects off the GIL (a copy's end, a reset); pyo3 applies
        # those reference drops at its next call, so each census comes after one (stats()).
        st0 = handle.stats()
        before, rss0, torch0 = census(), rss_bytes(), torch_bytes()
        t0, cpu0 = time.perf_counter(), time.process_time()
        run_patterns(model, opt, data, steps)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        st = handle.stats()
        after, rss, torch1 = census(), rss_bytes(), torch_bytes()
    return {
        "seconds": seconds, "cpu_seconds": cpu, "took_tensors": tp.took_tensors(handle),
        "tensors": [live_tensors(before), live_tensors(after)],
        "grown": {k: after[k] - before[k] for k in after if after[k] - before[k] >= steps // 8},
        "stats": [st0, st], "rss": [rss0, rss], "torch_device_bytes": [torch0, torch1],
        "hooks_left": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
    }


@pytest.fixture(scope="module")
def measured():
    """Every mode in a process of its own, two at a time (CI has two cores; HP_LEAK_PROCS)."""
    def child(mode):
        out = subprocess.run([sys.executable, __file__, mode, str(STEPS)], capture_output=True,
                             text=True, timeout=900)
        if out.returncode != 0:
            return {"error": out.stderr[-4000:]}
        return json.loads(out.stdout.strip().splitlines()[-1])

    with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("HP_LEAK_PROCS", "2"))) as pool:
        return dict(zip(tp.MODES, pool.map(child, tp.MODES)))


@pytest.mark.parametrize("mode", list(tp.MODES))
def test_a_thousand_steps_of_every_pattern_leak_nothing(mode, measured):
    m = measured[mode]
    assert "error" not in m, m.get("error")
    print(f"{mode}: {STEPS} steps x {len(tp.PATTERNS)} patterns in {m['seconds']:.1f} s "
          f"({m['cpu_seconds']:.1f} s cpu); rss {(m['rss'][1] - m['rss'][0]) / 1024:+.0f} KiB")
    assert m["took_tensors"], m["stats"]
    assert m["tensors"][0] == m["tensors"][1], m["tensors"]
    assert not m["grown"], m["grown"]
    st0, st = m["stats"]
    if "device_current" in st:
        assert st["device_current"] == 0 and st["pinned_bytes_in_use"] == 0, st
        assert st["pinned_bytes_held"] <= st0["pinned_bytes_held"], (st0, st)
    assert m["rss"][1] - m["rss"][0] <= RSS_BOUND, m["rss"]
    assert m["torch_device_bytes"][1] <= m["torch_device_bytes"][0], m["torch_device_bytes"]
    assert not m["hooks_left"]


@pytest.mark.parametrize("mode", list(ht.MODES) if tp.DEVICE == "cpu"
                         else [m for m in ht.MODES if m not in tp.HOST_COMPRESSION])
def test_evaluation_forwards_with_grad_leak_nothing_when_every_tensor_is_declined(mode):
    """``min_bytes=1 MiB``: every saved tensor is left to autograd. A declined saved output
    held its grad_fn, which held it: each evaluation forward with grad on leaked its whole graph
    (ISSUE 32 item 1). 200 of them leave no tensor behind, without a collection."""
    torch.manual_seed(0)
    model, data = TinyLM().to(tp.DEVICE), tiny_data()
    model.model.layers.append(Sigmoid())  # saves its output: the cycle, had it returned it
    platform = hprt.cpu_platform(device_memory=64 << 20) if tp.DEVICE == "cpu" else None
    with ht.attach(model, mode=mode, platform=platform, min_bytes=1 << 20):
        for _ in range(5):
            model(data[0]).logits.sum()
        gc.collect()
        gc.disable()
        try:
            before = sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter))
            for _ in range(200):
                model(data[0]).logits.sum()
            after = sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter))
        finally:
            gc.enable()
    assert after == before, (before, after)


class Sigmoid(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x)


def _threads(at_most=None):
    """The process's threads; with ``at_most``, once they are that few or after 5 s: threads of
    a stream hprt closed exit in the background, so a count taken at once can be one or two
    over while they wind down."""
    deadline = time.monotonic() + 5
    while True:
        n = len(os.listdir("/proc/self/task"))
        if at_most is None or n <= at_most or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("mode", ["swap", "keyed", "pipeline"])
def test_attaching_again_and_again_to_one_runtime_grows_nothing(mode):
    """``attach(..., runtime_=rt)`` and ``detach()`` every step (evaluation between steps with
    the hooks off, a mode switched per phase) on one runtime: hprt keeps no front end of a
    detached handle (each had its copy streams' threads) and no layer-group slot per attach,
    and the runtime's counters stay cumulative. Gradients stay exact."""
    torch.manual_seed(0)
    model, x = tp.GeluStack(n=4, dim=64), torch.randn(32, 64)
    plain = [p.grad for p in _grads(model, x)]
    rt = ht.Runtime(hprt.cpu_platform(device_memory=64 << 20))
    threads, fronts, offloaded = [], [], []
    for step in range(40):
        with ht.attach(model, mode=mode, runtime_=rt, min_bytes=4096) as h:
            grads = [p.grad for p in _grads(model, x)]
        del h
        assert all(torch.equal(a, b) for a, b in zip(plain, grads))
        threads.append(_threads())
        fronts.append(len(rt._fronts))
        offloaded.append(rt.stats()["offloaded_tensors"])
    assert _threads(at_most=max(threads[:5])) <= max(threads[:5]), threads
    assert fronts[-1] <= fronts[4], fronts
    assert offloaded[0] > 0 and offloaded[-1] == 40 * offloaded[0], offloaded
    # No layer-group slot per attach: the next new one is numbered by the model's layers.
    assert rt.layers.new_layer() <= 2 * len(model.layers)


def _grads(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).square().mean().backward()
    return list(model.parameters())


if __name__ == "__main__":  # one mode's run, for ``measured``
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]))))
