"""hprt.torch's modes against plain torch and torch's own ``save_on_cpu``, measured in one run:

- the training step of a 16-layer transformer (the hyper_parallel swap test's shape) per mode,
  as a ratio to the plain-torch step;
- the hook cost per saved tensor: a chain of small element-wise ops (one saved tensor each),
  forward and backward, minus the plain-torch time, divided by the number of saved tensors.

    python python/benchmarks/torch_swap_step.py [--layers 16] [--dim 256] [--seq 128] [--steps 2]
        [--rounds 3] [--threads N] [--modes swap,keyed] [--skip host-stage] [--no-hook-cost]
        [--device cuda]
        [--dtype bf16] [--paired N] [--heads H | --head-dim 128] [--model llama]
        [--no-memory] [--trace trace.json]

The model is the benchmark's own pre-norm transformer block (``nn.MultiheadAttention`` with
``--heads`` heads, by default ``dim / --head-dim`` with a head dim of 128, and a 4x GELU MLP),
or with ``--model llama`` a transformers ``LlamaModel`` built from a small ``LlamaConfig`` of the
same shape (``--ffn``, default 8/3 of the dim; ``--vocab``), loss = mean square of its output.

Memory, per mode, from one extra untimed step with hooks at every layer (``--no-memory`` skips
it): the torch peak (CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps; cpu: the
most C-heap bytes live at a layer boundary of that step, above its start, from glibc's
``mallinfo2`` with one arena, hprt's pinned memory left out: CPU tensors are malloc'd and torch
keeps no statistics of them),
the device's true peak (CUDA: total memory minus the low water of ``torch.cuda.mem_get_info``,
sampled at every layer boundary, so hprt's own allocations, torch's cache and the context count;
cpu: the hprt platform's device-memory high water, ``memory_stats()["device_peak"]``), hprt's
``stats()["device_peak"]`` (torch memory hprt keeps referenced) and the platform's own
``device_peak``. Then a per-layer timeline: live bytes at each layer's forward end and backward
start (CUDA: ``torch.cuda.memory_allocated``; cpu: the live heap above the step's start), and
on CUDA torch's memory history of that step (``torch.cuda.memory._record_memory_history``, each
allocation tagged with its layer and phase through ``_set_memory_metadata``) replayed: the peak
of live bytes within each layer's forward and backward, where the step's peak falls and which
Python frames allocated what was alive there. ``--trace`` writes the same as a Chrome / Perfetto
trace (one process per mode: a track of layer spans and memory counter tracks).

``--paired N`` measures layer-group swap (``mode="swap"``) and the no-swap ``keep`` mode against
plain torch in ``N`` rounds of single steps, one of each per round (plain torch, torch's
``save_on_cpu``, keep, swap), the modes attached to one runtime for the run and detached between
their steps. On a machine whose step time wanders by several per cent from one step to the next
(a shared VM), adjacent steps see the same conditions, and the median of the per-round ratios
converges where grouped rounds' ratios do not. A step's place in its round also moves its time
(measured: the same hooks-only mode 1.015x in second place, 1.06x in fourth), so the order
rotates from round to round. ``save_on_cpu``, which on CPU tensors only runs torch's hooks, is
the control; ``keep`` runs hprt's hooks and accounting without copying.

On the cpu backend "device" memory is host memory and the copies are host memcpys on hprt's
stream threads: the numbers describe hprt.torch's overhead, not accelerator performance.
``--device cuda`` (with ``HP_PLATFORM=cuda``) measures CUDA tensors on the cuda backend: steps
timed between device synchronizations, torch's ``save_on_cpu(pin_memory=True)`` as the baseline
offload, and each mode's ``torch.cuda.max_memory_allocated`` during its steps."""

import argparse
import collections
import ctypes
import json
import os
import random
import statistics
import time

import torch
from torch import nn

import hprt
import hprt.torch as ht


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.layers = nn.ModuleList(Block(args.dim, args.heads) for _ in range(args.layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def resolve_heads(args):
    """``--heads``, else ``dim / --head-dim`` (at least one head); the dim must divide."""
    if args.heads is None:
        args.heads = max(1, args.dim // args.head_dim)
    if args.heads < 1 or args.dim % args.heads:
        raise SystemExit(f"--dim {args.dim} does not split into {args.heads} heads")
    args.head_dim = args.dim // args.heads
    if args.ffn is None:
        args.ffn = max(64, round(args.dim * 8 / 3 / 64) * 64)
    return args


def llama(args):
    """A transformers ``LlamaModel`` of the benchmark's shape, from a ``LlamaConfig``."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=max(args.seq, 128),
                      attn_implementation="sdpa")
    return LlamaModel(cfg)


def build(args):
    """The model on the device in the dtype, and a step (gradients cleared, forward, backward)."""
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    if args.model == "llama":
        model = llama(args).to(args.device, dtype)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)

        def forward():
            out = model(input_ids=ids, use_cache=False).last_hidden_state
            return out.float().square().mean()
    else:
        model = Transformer(args).to(args.device, dtype)
        x = torch.randn(args.batch, args.seq, args.dim, device=args.device, dtype=dtype)

        def forward():
            return model(x)

    def step():
        for p in model.parameters():
            p.grad = None
        forward().backward()

    return model, step


MODES = {
    "keep": dict(mode="keep"),
    "swap": dict(mode="swap"),
    "swap, planned (budget=auto)": dict(mode="swap", budget="auto"),
    "keyed": dict(mode="keyed"),
    "pipeline": dict(mode="pipeline"),
    "swap, host-stage compress-then-swap": dict(mode="swap", compression="host_stage"),
    "swap, device compress-then-swap": dict(mode="swap", compression="device"),
    "compress": dict(mode="compress"),
    "managed_compress": dict(mode="managed_compress"),
}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()  # torch's streams and hprt's: one context


def timed(fn, steps, device="cpu"):
    fn()  # warm-up: pools, first allocations
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def platform_for(args, device_memory):
    return hprt.cpu_platform(device_memory=device_memory) if args.device == "cpu" else hprt.get_platform()


MIB = float(1 << 20)
HEAP = "heap live above step start"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc 2.33+
        return None


_LIBC = _libc()


def one_heap_arena():
    """Makes glibc keep every thread's allocations in one arena (``M_ARENA_MAX`` = 1), so that
    ``mallinfo2`` (which reports the main arena and mmapped chunks) sees all of them. Called
    first thing on cpu, before torch's and hprt's threads allocate."""
    if _LIBC is not None:
        _LIBC.mallopt(-8, 1)  # M_ARENA_MAX


def heap_live():
    """Bytes of the C heap handed out and not given back (CPU tensors are malloc'd: torch's CPU
    allocator keeps no cache and no statistics), or None off glibc."""
    if _LIBC is None:
        return None
    m = _LIBC.mallinfo2()
    return m.uordblks + m.hblkhd


def _set_alloc_tag(tag):
    """Tags this thread's next CUDA allocations in torch's memory history (torch 2.6+)."""
    setter = getattr(torch.cuda.memory, "_set_memory_metadata", None)
    if setter is not None:
        setter(tag)


def _tag_autograd_thread(tag):
    """Sets the tag on the thread autograd runs CUDA backward on (a persistent thread per
    device), through a one-element backward whose gradient hook runs there: allocations of the
    backward before the last layer's first hook get this tag, not the last step's."""
    if not getattr(torch.cuda, "is_available", lambda: False)():
        return  # no CUDA device (the stubbed test)
    try:
        a = torch.zeros(1, device="cuda", requires_grad=True)
        b = a * 1
        b.register_hook(lambda g: _set_alloc_tag(tag))
        b.sum().backward()
    except (RuntimeError, AssertionError):  # no CUDA device or build (the stubbed test)
        pass


def _frame_key(frames):
    """The innermost Python frame outside torch's own package (hprt.torch's modules, under
    ``hprt/torch/``, count), as ``name (file:line)``."""
    for f in frames or ():
        name = f.get("filename", "")
        in_torch = "/torch/" in name and "/hprt/torch/" not in name
        if name and not in_torch and not name.startswith("<") and name != "??":
            return f"{f.get('name', '?')} ({os.path.basename(name)}:{f.get('line', 0)})"
    return "(no Python frame)"


def replay_history(trace, start_bytes=0, top=3):
    """Replays one device's trace of torch's memory history (``_snapshot()["device_traces"]``):
    live bytes after every ``alloc`` and ``free_completed``, starting from ``start_bytes``
    allocated before the recording (their frees count down from it). Returns the peak of live
    bytes per tag (``user_metadata``: the layer and phase, in order of first appearance), the
    step's peak (bytes, its tag) and the ``top`` frames by bytes alive at that peak."""
    live, total, per_tag = {}, start_bytes, {}
    peak, peak_at, peak_tag = start_bytes, -1, ""
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], _frame_key(e.get("frames")))
            total += e["size"]
        elif action == "free_completed":
            block = live.pop(e["addr"], None)
            total -= block[0] if block else e["size"]
        else:
            continue
        tag = e.get("user_metadata") or ""
        per_tag[tag] = max(per_tag.get(tag, 0), total)
        if total > peak:
            peak, peak_at, peak_tag = total, i, tag
    # What was alive at the peak, by the frame that allocated it (a second pass to that point).
    live = {}
    for e in trace[:peak_at + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = (e["size"], _frame_key(e.get("frames")))
        elif e.get("action") == "free_completed":
            live.pop(e["addr"], None)
    by_frame = collections.Counter()
    for size, key in live.values():
        by_frame[key] += size
    return per_tag, (peak, peak_tag), by_frame.most_common(top)


class MemoryProbe:
    """One untimed step with hooks at every layer: a sample of memory at each layer's forward
    end and backward start (its output's gradient hook), and on CUDA torch's memory history of
    the step with every allocation tagged by its layer and phase."""

    def __init__(self, args, platform, layers):
        self.cuda = args.device == "cuda"
        self.platform, self.layers = platform, layers
        self.history = self.cuda and not args.no_history
        self.samples = []  # (label, seconds, {series: bytes})
        self.heap0 = None

    def _sample(self, label):
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            values = {"torch allocated": torch.cuda.memory_allocated(),
                      "device used": total - free}
        else:
            st = self.platform.memory_stats()
            values = {"platform device": st["device_current"]}
            heap = heap_live()
            if heap is not None and self.heap0 is not None:
                # hprt's pinned memory is the host side of the swap, not the "device"'s.
                values[HEAP] = heap - st["pinned_current"] - self.heap0
        self.samples.append((label, time.perf_counter(), values))

    def _hooks(self):
        handles = []
        for i, layer in enumerate(self.layers):
            def pre(_module, _args, i=i):
                if self.history:
                    _set_alloc_tag(f"L{i} fwd")

            def post(_module, _args, out, i=i):
                self._sample(f"L{i} fwd")
                t = out[0] if isinstance(out, (tuple, list)) else out
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    def grad(g, i=i):
                        if self.history:
                            _set_alloc_tag(f"L{i} bwd")
                        self._sample(f"L{i} bwd")
                    t.register_hook(grad)
                if self.history and i == len(self.layers) - 1:
                    _set_alloc_tag("loss")

            handles.append(layer.register_forward_pre_hook(pre))
            handles.append(layer.register_forward_hook(post))
        return handles

    def run(self, fn, handle=None):
        """Runs ``fn`` once; returns the memory figures of the step (see the module docs)."""
        self.samples = []
        sync_all(self.cuda)
        if self.cuda:
            torch.cuda.empty_cache()  # the true peak starts from what is in use
            torch.cuda.reset_peak_memory_stats()
        self.platform.reset_peak_memory()
        if not self.cuda and heap_live() is not None:
            self.heap0 = heap_live() - self.platform.memory_stats()["pinned_current"]
        if handle is not None and hasattr(handle, "runtime"):
            handle.runtime.reset_peak()
        start_alloc = torch.cuda.memory_allocated() if self.cuda else 0
        if self.history:
            _tag_autograd_thread("loss bwd")
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        hooks = self._hooks()
        try:
            self._sample("start")
            fn()
            sync_all(self.cuda)
            self._sample("end")
        finally:
            for h in hooks:
                h.remove()
            if self.history:
                _set_alloc_tag("")
        out = {"samples": self.samples,
               "platform_peak": self.platform.memory_stats()["device_peak"]}
        if self.history:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            dev = torch.cuda.current_device()
            out["history"] = replay_history(snap["device_traces"][dev], start_alloc)
        if self.cuda:
            out["torch_peak"] = torch.cuda.max_memory_allocated()
            out["device_peak"] = max(v["device used"] for _, _, v in self.samples)
        else:
            heap = [v[HEAP] for _, _, v in self.samples if HEAP in v]
            out["torch_peak"] = max(heap) if heap else None
            out["device_peak"] = out["platform_peak"]
        if handle is not None:
            out["hprt_peak"] = handle.stats().get("device_peak")
        return out


def sync_all(cuda):
    if cuda:
        torch.cuda.synchronize()


def interleaved(model, run, args, platform, min_bytes, layers=None):
    """Per mode: the median step over ``args.rounds`` rounds that visit every mode in turn, the
    median over rounds of its ratio to plain torch's median step in the same round (a load
    change on the machine between rounds cancels out), and the last round's statistics; with
    ``layers``, the memory figures of one more step per mode after the last round's timing."""
    times, ratios, stats, peaks, memory = {}, {}, {}, {}, {}
    cuda = args.device == "cuda"
    probe = MemoryProbe(args, platform, layers) if layers is not None else None

    def on_cpu():
        with torch.autograd.graph.save_on_cpu(pin_memory=cuda):
            run()

    def measure(name, fn, last, handle=None):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = timed(fn, args.steps, args.device)
        if cuda:
            peaks[name] = torch.cuda.max_memory_allocated()
        times.setdefault(name, []).extend(t)
        if probe is not None and last:
            memory[name] = probe.run(fn, handle)
        return statistics.median(t)

    for r in range(args.rounds):
        last = r == args.rounds - 1
        plain = measure("plain torch", run, last)
        ratios.setdefault("plain torch", []).append(1.0)
        ratios.setdefault("torch save_on_cpu", []).append(
            measure("torch save_on_cpu", on_cpu, last) / plain)
        for name, kw in MODES.items():
            if args.modes and kw["mode"] not in args.modes:
                continue
            if any(word in name for word in args.skip or ()):
                continue
            if cuda and kw["mode"] in ("compress", "managed_compress"):
                continue  # host compression of CPU tensors: refused on an accelerator
            with ht.attach(model, platform=platform, min_bytes=min_bytes, **kw) as h:
                ratios.setdefault(name, []).append(measure(name, run, last, h) / plain)
                stats[name] = h.stats()
    return [(name, statistics.median(t), statistics.median(ratios[name]), stats.get(name),
             peaks.get(name), memory.get(name)) for name, t in times.items()]


def step_times(args):
    model, step = build(args)
    layers = None if args.no_memory else ht.find_layers(model)
    return interleaved(model, step, args, platform_for(args, 4 << 30), args.min_bytes, layers)


def paired(args):
    """Per round, one step each of plain torch, ``save_on_cpu``, keep and layer-group swap, in
    an order rotated every round (see the module docs); returns each mode's median step and
    its per-round ratios to the plain step of the round."""
    model, step = build(args)
    rt = ht.Runtime(platform_for(args, 4 << 30))

    def on_cpu():
        with torch.autograd.graph.save_on_cpu(pin_memory=args.device == "cuda"):
            step()

    def attached(mode):
        def run():
            with ht.attach(model, mode=mode, runtime_=rt, min_bytes=args.min_bytes):
                step()
        return run

    fns = {"plain torch": step, "torch save_on_cpu": on_cpu, "keep": attached("keep"),
           "swap": attached("swap")}
    names = list(fns)
    for fn in fns.values():  # warm-up: pools, first allocations
        fn()
        fn()
    times = {name: [] for name in fns}
    for r in range(args.paired):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync(args.device)
            t0 = time.perf_counter()
            fns[name]()
            sync(args.device)
            times[name].append(time.perf_counter() - t0)
    plain_t = times["plain torch"]
    return {name: (statistics.median(t), [a / b for a, b in zip(t, plain_t)])
            for name, t in times.items()}


def median_interval(ratios, level=0.95, resamples=2000, seed=0):
    """A bootstrap interval of the median of ``ratios`` (percentile method): where the median
    of another run of as many rounds would fall, ``level`` of the time."""
    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


def print_paired(args):
    rows = paired(args)
    print(f"\nPaired single steps, {args.paired} rounds (plain torch, save_on_cpu, keep, swap; "
          "order rotated per round):")
    print("| mode | step (ms, median) | median of per-round ratios | 95 % interval of that median "
          "(bootstrap) | interquartile range of the ratios | mean ratio |")
    print("|---|---|---|---|---|---|")
    for name, (t, ratios) in rows.items():
        q = statistics.quantiles(ratios, n=4)
        lo, hi = median_interval(ratios)
        print(f"| {name} | {t * 1e3:.1f} | {statistics.median(ratios):.3f} | {lo:.3f} - {hi:.3f} | "
              f"{q[0]:.3f} - {q[2]:.3f} | {statistics.fmean(ratios):.3f} |")


def hook_cost(args):
    """Per saved tensor: ``n`` sigmoids in a row (each saves its output) on ``numel`` floats."""
    n, numel = args.hook_tensors, args.hook_numel
    x = torch.randn(numel, requires_grad=True, device=args.device)

    class Layer(nn.Module):
        def forward(self, y):
            for _ in range(n):
                y = torch.sigmoid(y)
            return y

    model = nn.Module()
    model.layers = nn.ModuleList([Layer(), Layer()])

    def run():
        y = x
        for layer in model.layers:
            y = layer(y)
        y.sum().backward()
        x.grad = None

    saved = 2 * n
    rows = interleaved(model, run, args, platform_for(args, 1 << 30), 0)
    base = rows[0][1]
    return base, saved, [(name, (t - base) / saved * 1e6) for name, t, *_ in rows[1:]]


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _mib(v):
    return "-" if v is None else f"{v / MIB:.1f}"


def print_rows(args, rows):
    """The step table with the memory columns, then each mode's per-layer timeline."""
    cuda = args.device == "cuda"
    print("| mode | step (ms, median) | vs plain torch (median of rounds) | offloaded MiB per step "
          "| compressed tensors per step | torch peak MiB | device peak MiB | hprt device_peak MiB "
          "| platform device_peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    per_attach = args.steps + 1 + (0 if args.no_memory else 1)  # warm-up (and memory step)
    for name, t, ratio, st, peak, mem in rows:
        mem = mem or {}
        off = "-" if st is None else f"{st['offloaded_bytes'] / MIB / per_attach:.1f}"
        comp = "-" if st is None else st["compressed_tensors"] // per_attach
        torch_peak = peak if cuda else mem.get("torch_peak")
        print(f"| {name} | {t * 1e3:.1f} | {ratio:.3f} | {off} | {comp} | {_mib(torch_peak)} "
              f"| {_mib(mem.get('device_peak'))} | {_mib(mem.get('hprt_peak'))} "
              f"| {_mib(mem.get('platform_peak'))} |")
    if args.no_memory:
        return
    if cuda:
        print("\ntorch peak: torch.cuda.max_memory_allocated over the timed steps; device peak: "
              "total minus the low water of torch.cuda.mem_get_info over one more step, sampled "
              "at every layer boundary (hprt's allocations, torch's cache and the CUDA context "
              "included); hprt device_peak: torch memory hprt kept referenced (stats()); platform "
              "device_peak: hprt's own device allocations.")
    else:
        print("\ntorch peak: the most C-heap bytes live (glibc mallinfo2, one arena; CPU tensors "
              "are malloc'd and torch keeps no CPU statistics) at a layer boundary of one more "
              "step, above the step's start, hprt's pinned memory left out (it includes the cpu "
              "platform's cached device blocks); device peak: the hprt cpu platform's "
              "device-memory high water (memory_stats()); hprt device_peak: torch memory hprt "
              "kept referenced (stats()).")
    series = "torch allocated" if cuda else HEAP
    print(f"\nPer-layer timeline ({series}, MiB, at each layer's forward end, then at each "
          "layer's backward start):")
    for name, *_, mem in rows:
        if not mem:
            continue
        print(f"  {name}:")
        for line in timeline_lines(mem["samples"], series):
            print(f"    {line}")
        if "history" in mem:
            for line in history_lines(mem["history"]):
                print(f"    {line}")


def timeline_lines(samples, series):
    """Compact rows of one step's samples: forward ends in layer order, backward starts in the
    order backward reached them."""
    fwd = [f"{v[series] / MIB:.1f}" for label, _, v in samples
           if label.endswith(" fwd") and series in v]
    bwd = [f"{label.split()[0]}:{v[series] / MIB:.1f}" for label, _, v in samples
           if label.endswith(" bwd") and series in v]
    return [f"fwd  {' '.join(fwd) or '-'}", f"bwd  {' '.join(bwd) or '-'}"]


def history_lines(history):
    """The replayed memory history: peak per layer phase, the step's peak and what was alive."""
    per_tag, (peak, peak_tag), top = history
    fwd = [f"{t.split()[0]}:{v / MIB:.0f}" for t, v in per_tag.items() if t.endswith(" fwd")]
    bwd = [f"{t.split()[0]}:{v / MIB:.0f}" for t, v in per_tag.items() if t.endswith(" bwd")]
    alive = ", ".join(f"{v / MIB:.0f} MiB {k}" for k, v in top) or "-"
    return [f"history peak per layer, fwd  {' '.join(fwd) or '-'}",
            f"history peak per layer, bwd  {' '.join(bwd) or '-'}",
            f"step peak {peak / MIB:.0f} MiB during {peak_tag or 'untagged work'}; "
            f"alive there by allocating frame: {alive}"]


def trace_events(rows):
    """Chrome trace events: a process per mode, with a track of layer phases (from one sample
    to the next) and a counter track per memory series."""
    events = []
    t0 = min((mem["samples"][0][1] for *_, mem in rows if mem and mem["samples"]), default=0.0)
    for pid, (name, *_, mem) in enumerate(rows):
        if not mem:
            continue
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1,
                       "args": {"name": "layers"}})
        samples = mem["samples"]
        for (label, t, values), (_, t_next, _) in zip(samples, samples[1:] + samples[-1:]):
            us = (t - t0) * 1e6
            if label not in ("start", "end"):
                events.append({"name": label, "ph": "X", "pid": pid, "tid": 1, "ts": us,
                               "dur": max(0.0, (t_next - t) * 1e6), "cat": "layer"})
            for series, v in values.items():
                events.append({"name": f"{series} (MiB)", "ph": "C", "pid": pid, "ts": us,
                               "args": {"MiB": v / MIB}})
    return events


def write_trace(path, rows):
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(rows), "displayTimeUnit": "ms"}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-bytes", type=int, default=64 << 10)
    ap.add_argument("--hook-tensors", type=int, default=500)
    ap.add_argument("--hook-numel", type=int, default=256)
    ap.add_argument("--modes", type=lambda v: v.split(","), default=None,
                    help="comma-separated hprt modes to measure (default: all)")
    ap.add_argument("--skip", type=lambda v: v.split(","), default=None,
                    help="comma-separated words: rows whose name holds one are not measured "
                         "(e.g. host-stage, planned)")
    ap.add_argument("--no-hook-cost", action="store_true", help="skip the per-tensor loop")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's). On a 2-core VM, torch's "
                         "spinning workers and hprt's copy threads take the same cores")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: CUDA tensors on the cuda backend (HP_PLATFORM=cuda)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="f32")
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="only layer-group swap and keep against plain torch, in N rounds of "
                         "single steps taken in turn (see the module docs)")
    ap.add_argument("--heads", type=int, default=None,
                    help="attention heads (default: dim / --head-dim)")
    ap.add_argument("--head-dim", type=int, default=128,
                    help="head dim when --heads is not given (default 128, as Llama's)")
    ap.add_argument("--model", choices=["transformer", "llama"], default="transformer",
                    help="llama: a transformers LlamaModel built from a LlamaConfig")
    ap.add_argument("--ffn", type=int, default=None,
                    help="--model llama's intermediate size (default 8/3 of the dim, in 64s)")
    ap.add_argument("--vocab", type=int, default=1024, help="--model llama's vocabulary")
    ap.add_argument("--no-memory", action="store_true",
                    help="skip the memory step (columns and timeline)")
    ap.add_argument("--no-history", action="store_true",
                    help="CUDA: no torch memory history in the memory step")
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="write the memory steps as a Chrome / Perfetto trace")
    args = resolve_heads(ap.parse_args())
    if args.device == "cpu":
        one_heap_arena()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    model = "transformers LlamaModel" if args.model == "llama" else "transformer"
    print(f"{args.layers}-layer {model}, dim {args.dim}, {args.heads} heads of {args.head_dim}"
          f"{f', ffn {args.ffn}' if args.model == 'llama' else ''}, batch {args.batch} x "
          f"{args.seq} tokens, {args.dtype} on {where}; hprt modes with "
          f"min_bytes={args.min_bytes}; torch threads: {torch.get_num_threads()}")
    if args.paired:
        print_paired(args)
        return
    rows = step_times(args)
    print_rows(args, rows)
    if args.trace:
        write_trace(args.trace, rows)
        print(f"\ntrace written to {args.trace} (open it in ui.perfetto.dev)")
    if args.no_hook_cost:
        return
    base, saved, hooks = hook_cost(args)
    print(f"\nHook cost per saved tensor ({saved} saved tensors of {args.hook_numel} f32 per "
          f"forward + backward; plain torch {base * 1e3:.2f} ms):")
    print("| mode | µs per saved tensor over plain torch |")
    print("|---|---|")
    for name, us in hooks:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
