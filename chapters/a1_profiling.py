# %% [markdown]
# # A1 · Profiling: timing, traces, kernels and a C++ extension
#
# Every claim in this course about speed ("overlap hides the all-reduce", "the fused kernel is
# faster") rests on a measurement, and measuring GPU programs is surprisingly easy to get wrong.
# This appendix of the book collects the tools: timing done right, PyTorch's profiler and its
# traces, Nsight Compute for a single kernel, and compiling your own kernel into a Python module.
#
# In this notebook you will
# 1. see why a wall clock around asynchronous work measures only the launch, fix it with events and
#    a synchronisation, and time with warm-up, repeats and the median;
# 2. profile `F.layer_norm` with the book's profiler schedule, read the table sorted by time, write
#    a Chrome/Perfetto trace and find in it, by code, the chain of operators from `aten::layer_norm`
#    down to the work itself (down to the GPU kernel when there is one), with memory profiling on;
# 3. profile one rank of a data-parallel training step and find the all-reduces in its trace;
# 4. build a C++ vector add with `torch.utils.cpp_extension.load_inline`, check it and profile it;
#    on a GPU also the book's CUDA add kernel, and Nsight Compute (`ncu`) when it is installed.
#
# The GPU-only parts run when a GPU is present and say so when they are skipped. Everything the
# notebook checks holds on a CPU.

# %% tags=["parameters"]
WORLD_SIZE = 2  # ranks for the asynchronous collective and the distributed trace (2 or more)
QUICK = True  # True: 15 repeats in the timing sections, about 5 s on 2 CPU cores; False: 50 repeats (longer)
SEED = 0

# %%
# %matplotlib inline
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import collections
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from matplotlib.figure import Figure

from ultrascale.data import Batches
from ultrascale.model import GPT, GPTConfig
from ultrascale.parallel import apply_data_parallel
from ultrascale.profiling import chrome_trace_events, quiet_native_stderr
from ultrascale.train import make_optimizer

assert WORLD_SIZE >= 2, "the distributed sections need at least two ranks: set WORLD_SIZE >= 2"
torch.manual_seed(SEED)
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
REPEATS = 15 if QUICK else 50
WORK_DIR = Path(tempfile.mkdtemp(prefix="ultrascale_a1_"))  # traces and scripts go here, not into the course

# %% [markdown]
# ## 1. Timing asynchronous work
#
# When Python calls a CUDA operation, PyTorch puts a *kernel launch* in a queue, the **stream**,
# and returns at once; the GPU works through the queue in order, while Python goes on. That is
# what keeps a GPU busy, and it is also what makes the obvious measurement wrong:
#
# ```python
# start = time.time(); y = f(x); print(time.time() - start)   # on a GPU: the launch, not the work
# ```
#
# The clock stops when the *launch* returns, not when the work is done. The fix is to wait for
# the queue, `torch.cuda.synchronize()`, before reading the clock, or to put **events** into
# the stream, which the GPU stamps with the time when it reaches them.
#
# A CPU has no stream, so to see the effect on any machine we build one: a background thread
# that runs queued work in order, with the same interface as CUDA's (`launch`, `synchronize`,
# events with `record`, `synchronize` and `elapsed_time`). Then we time ten 768 × 768 matmuls
# the wrong way and the right way.


# %%
class StreamEvent:
    """A mark in a stream, stamped with the time when the stream reaches it (like torch.cuda.Event)."""

    def __init__(self):
        self._reached = threading.Event()
        self.time = None

    def _stamp(self):
        self.time = time.perf_counter()
        self._reached.set()

    def synchronize(self):
        self._reached.wait()

    def elapsed_time(self, end) -> float:
        """Milliseconds from this event to ``end``, as torch.cuda.Event.elapsed_time."""
        self.synchronize()
        end.synchronize()
        return 1e3 * (end.time - self.time)


class CpuStream:
    """Work queued by the caller, run in order by one background thread: a CPU stand-in for a CUDA stream."""

    def __init__(self):
        self._queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            fn, args = self._queue.get()
            try:
                fn(*args)
            finally:
                self._queue.task_done()

    def launch(self, fn, *args):
        """Queue ``fn(*args)`` and return at once, as a kernel launch does."""
        self._queue.put((fn, args))

    def record(self) -> StreamEvent:
        event = StreamEvent()
        self.launch(event._stamp)
        return event

    def synchronize(self):
        """Wait until everything queued so far has run (torch.cuda.synchronize)."""
        self._queue.join()

    @property
    def busy(self) -> bool:
        return self._queue.unfinished_tasks > 0


stream = CpuStream()
a = torch.randn(768, 768)
KERNELS = 10

start = time.perf_counter()
for _ in range(KERNELS):
    stream.launch(torch.mm, a, a)
launch_only = time.perf_counter() - start
still_running = stream.busy  # was the work done when the naive clock stopped?
stream.synchronize()
with_sync = time.perf_counter() - start

begin = stream.record()
for _ in range(KERNELS):
    stream.launch(torch.mm, a, a)
end = stream.record()
by_events = begin.elapsed_time(end)
assert still_running, "the queue was already empty when the launches returned"
print(f"when the launches returned, the stream was still working: {still_running}")

# %% tags=["nbval-ignore-output"]
print(f"clock around the launches only : {1e3 * launch_only:8.2f} ms")
print(f"clock with synchronize()       : {1e3 * with_sync:8.2f} ms")
print(f"events in the stream (ten more): {by_events:8.2f} ms")

# %% [markdown]
# The same lesson with a real asynchronous operation that exists on every machine: a gloo
# collective called with `async_op=True` returns a `Work` handle immediately and moves the data
# on gloo's own threads; `work.wait()` is its synchronisation. We all-reduce 8 MiB on the ranks
# (with gloo and CPU tensors on any machine, so that the traces below look the same everywhere).

# %%
cluster = Cluster(WORLD_SIZE, backend="gloo")


def time_async_all_reduce(ctx, numel):
    x = torch.ones(numel, device=ctx.device)
    dist.barrier()
    start = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    launched = time.perf_counter() - start
    done_at_launch = work.is_completed()
    work.wait()
    finished = time.perf_counter() - start
    assert torch.all(x == ctx.world_size)
    return launched, finished, done_at_launch


async_times = cluster.run(time_async_all_reduce, 2 * 2**20)
assert not any(done for _, _, done in async_times), "an 8 MiB all-reduce finished before its launch returned"
print("on every rank, the all-reduce was still in flight when the call returned")

# %% tags=["nbval-ignore-output"]
for rank, (launched, finished, _) in enumerate(async_times):
    print(f"rank {rank}: call returned after {1e3 * launched:6.2f} ms, data arrived after {1e3 * finished:6.2f} ms")

# %% [markdown]
# On a GPU the book measures the same thing with CUDA events. Its `profile_pytorch` runs the
# function ten times to warm up (the first calls load kernels, pick cuBLAS algorithms and grow
# PyTorch's memory cache), then records a start and an end event around one call, synchronizes
# and reads the elapsed milliseconds. The cell below runs it, next to the naive clock, when a GPU
# is present.


# %% tags=["nbval-ignore-output"]
def profile_pytorch(func, input):
    """The book's timer: 10 warm-up calls, then one call between two CUDA events (ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        func(input)
    start.record()
    func(input)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


if CUDA:
    big = torch.randn(8192, 8192, device="cuda")
    square = lambda t: t @ t  # noqa: E731
    square(big)
    torch.cuda.synchronize()
    naive_start = time.time()
    square(big)
    naive_ms = 1e3 * (time.time() - naive_start)
    torch.cuda.synchronize()
    print(
        f"time.time() around an 8192² matmul: {naive_ms:.3f} ms (the launch); "
        f"CUDA events: {profile_pytorch(square, big):.3f} ms (the work)"
    )
else:
    print("no GPU here: the CPU stream above stands in for a CUDA stream")

# %% [markdown]
# ### Warm-up, repeats, the median
#
# One call is one sample of a noisy quantity: other programs, frequency scaling, caches and (on a
# GPU) clock boost all move it. So a benchmark
#
# 1. calls the function a few times untimed (**warm-up**), and waits for those calls to finish;
# 2. times many calls, each between two events (or two clock readings around a synchronisation);
# 3. reports the **median**, which one slow outlier cannot move, unlike the mean.
#
# `benchmark` below does that with CUDA events on a GPU and with our stream's events on a CPU.
# We also keep the warm-up calls' times, to look at them.


# %%
def benchmark(fn, *args, warmup=10, repeats=REPEATS):
    """Milliseconds per call of fn(*args): every call timed between two events, and the median
    of the calls after the warm-up. Returns (median, all times in order)."""
    if CUDA:
        run = lambda: fn(*args)  # noqa: E731
        make_event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        sync = torch.cuda.synchronize
    else:
        run = lambda: stream.launch(fn, *args)  # noqa: E731
        make_event, sync = None, stream.synchronize
    times = []
    for _ in range(warmup + repeats):
        if CUDA:
            begin, end = make_event(), make_event()
            begin.record()
            run()
            end.record()
        else:
            begin = stream.record()
            run()
            end = stream.record()
        sync()
        times.append(begin.elapsed_time(end))
    return statistics.median(times[warmup:]), times


x_ln = torch.randn(2000, 2000, device=DEVICE)
median_ms, samples = benchmark(F.layer_norm, x_ln, x_ln.shape[1:])
assert len(samples) == 10 + REPEATS and min(samples) <= median_ms <= max(samples)

# %% tags=["nbval-ignore-output"]
after = samples[10:]
print(
    f"layer_norm of 2000 x 2000: median {median_ms:.3f} ms, mean {statistics.mean(after):.3f} ms, "
    f"min {min(after):.3f} ms, max {max(after):.3f} ms over {len(after)} timed calls"
)
fig = Figure(figsize=(8, 2.8), layout="constrained")
ax = fig.subplots()
ax.plot(range(1, 11), samples[:10], "o", color="#8c8c8c", label="warm-up calls")
ax.plot(range(11, len(samples) + 1), after, "o", color="#4c72b0", label="timed calls")
ax.axhline(median_ms, color="#4c72b0", lw=1, label="median of the timed calls")
ax.axhline(statistics.mean(after), color="#c44e52", lw=1, ls="--", label="mean of the timed calls")
ax.set(xlabel="call", ylabel="ms", title="layer_norm, call by call")
ax.legend(fontsize=8)
fig

# %% [markdown]
# ## 2. The PyTorch profiler
#
# `torch.profiler.profile` records every operator PyTorch runs (and, on a GPU, every kernel and
# memory copy), with its duration, its input shapes and, with `profile_memory=True`, every
# allocation and release. Profiling costs time itself, and the first steps of any loop are
# unrepresentative, so a **schedule** decides which steps to keep. The book's:
# `wait=1, warmup=3, active=2, repeat=1`: skip one step, run the profiler for three steps and
# throw their records away, keep the next two, once. `p.step()` tells the profiler that a step
# ended. `tensorboard_trace_handler(dir)` writes the trace of the kept steps to `dir`. We profile
# the book's example, `F.layer_norm(input, input.size()[1:])`, on a 2048 × 2048 tensor (the book
# uses 10000 × 10000 on a GPU) for ten steps. Why 2048: on a GPU, PyTorch's caching allocator
# rounds every allocation up (a small one to a multiple of 512 bytes, a large one to a multiple of
# 2 MiB) and the trace records the rounded size, so the 8,000 bytes of a 2000-wide row's statistics
# would show up as 8,192 there. At 2048 every size below is already such a multiple: the trace
# shows the same sizes on a CPU and on a GPU, and the checks hold on both.

# %%
activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if CUDA else [])
trace_dir = WORK_DIR / "layer_norm"
N_LN = 2048  # every allocation a multiple of the CUDA allocator's rounding (see above)
input = torch.randn(N_LN, N_LN, device=DEVICE)
with (
    quiet_native_stderr(),
    torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=3, active=2, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir), worker_name="layer_norm"),
        profile_memory=True,
        record_shapes=True,
    ) as p,
):
    for _ in range(10):
        F.layer_norm(input, input.size()[1:])
        p.step()

# %% [markdown]
# The aggregated table, sorted by total time: CPU time here, GPU time on a GPU (the book sorts
# by `cuda_time_total`, which PyTorch now calls `device_time_total`). "Total" includes the
# operators an operator calls; "self" does not. The memory columns come from `profile_memory`.
# (The book's text promises the top 10 operators, but its code passes `row_limit=8`, as we do:
# eight rows.)

# %% tags=["nbval-ignore-output"]
print(p.key_averages().table(sort_by="device_time_total" if CUDA else "cpu_time_total", row_limit=8))

# %% [markdown]
# The trace file is a JSON list of events in the Chrome trace format. Open it in
# https://ui.perfetto.dev (or `chrome://tracing`): `w`/`s` zoom, `a`/`d` pan (Perfetto), arrow keys
# and Alt + mouse wheel in Chrome's older viewer; clicking an event shows its arguments. We read
# it with code instead: which steps it holds, the allocations, and the chain of calls.

# %%
(trace_file,) = trace_dir.glob("layer_norm.*.pt.trace.json")
events = chrome_trace_events(trace_file)
steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
assert steps == ["ProfilerStep#4", "ProfilerStep#5"], steps  # wait 1 + warmup 3 skipped steps 0-3
calls = [e for e in events if e.get("ph") == "X" and e.get("name") == "aten::layer_norm"]
assert len(calls) == 2
print(f"kept steps: {steps}; aten::layer_norm calls in them: {len(calls)}")

allocated = collections.Counter(
    e["args"]["Bytes"] for e in events if e.get("name") == "[memory]" and e["args"]["Bytes"] > 0
)
assert allocated[4 * N_LN * N_LN] == 2  # one output of N x N floats per call
assert allocated[4 * N_LN] >= 4  # and its per-row mean and reciprocal standard deviation
print(
    f"allocations per call: the output, {4 * N_LN * N_LN:,} bytes, and two vectors of {4 * N_LN:,} bytes "
    "(mean and 1/std of each row, saved for backward)"
)

# %% [markdown]
# ### From `aten::layer_norm` to the work
#
# Events on one thread nest: an operator's event contains the events of everything it called. So
# the chain of calls is a walk down the nesting. Starting from `aten::layer_norm`, we repeatedly look
# at the events directly inside the current one:
#
# - if one of them **launched a GPU kernel** (a CUDA runtime call whose `correlation` id matches a
#   kernel event's), the chain ends with the launch and the kernel;
# - otherwise we step into the operator that takes most (at least half) of the current one's time;
# - when none does, the current operator does the work itself: that is the end of the chain.
#
# The book's chain on a GPU is `aten::layer_norm` → `aten::native_layer_norm` → `cudaLaunchKernel`
# → `vectorized_layer_norm_kernel`. On a CPU the chain stops at `aten::native_layer_norm`, which
# computes the result in its own body (the small `aten::empty` calls inside it allocate the output).

# %%
EPS = 1e-3  # trace times are µs with three decimals: allow for rounding when comparing ends


def inside(inner, outer):
    return (
        inner["pid"] == outer["pid"]
        and inner["tid"] == outer["tid"]
        and inner is not outer
        and outer["ts"] - EPS <= inner["ts"]
        and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + EPS
    )


def children(events, parent):
    """Complete events directly inside ``parent`` on its thread (not inside another one of them)."""
    nested = [e for e in events if e.get("ph") == "X" and inside(e, parent)]
    return [e for e in nested if not any(inside(e, other) and other["dur"] > e["dur"] for other in nested)]


def op_chain(events, name):
    """Names from the first event called ``name`` down to the work (and the kernel it launched)."""
    kernels = {
        e["args"]["correlation"]: e for e in events if e.get("cat") == "kernel" and "correlation" in e.get("args", {})
    }
    node = next(e for e in events if e.get("ph") == "X" and e.get("name") == name)
    chain = [node]
    while True:
        below = children(events, node)
        launch = next((e for e in below if e.get("args", {}).get("correlation") in kernels), None)
        if launch is not None:
            chain += [launch, kernels[launch["args"]["correlation"]]]
            break
        ops = [e for e in below if e.get("cat") == "cpu_op" and e["dur"] >= node["dur"] / 2]
        if not ops:
            break
        node = max(ops, key=lambda e: e["dur"])
        chain.append(node)
    return [e["name"] for e in chain]


chain = op_chain(events, "aten::layer_norm")
assert chain[:2] == ["aten::layer_norm", "aten::native_layer_norm"], chain
if CUDA:
    assert chain[2].startswith("cudaLaunchKernel") and "layer_norm" in chain[3], chain
else:
    assert len(chain) == 2, chain

# %% tags=["nbval-ignore-output"]
print("\n  -> ".join(chain))

# %% [markdown]
# The exercises ask the opposite question, the one you ask of a real trace: for every GPU kernel,
# which operator launched it?
#
# ## 3. A distributed trace: one rank of a data-parallel step
#
# In a multi-GPU job each rank profiles itself (usually one or two ranks are enough). We take
# chapter 02's bucketed data parallelism from the library (`apply_data_parallel`), warm up one
# step, and let rank 0 profile the second one. In its trace, the all-reduces appear twice:
# `c10d::allreduce_`, the launch on the training thread, called from a gradient hook in the middle
# of backward; and `gloo:all_reduce`, the transfer itself on one of gloo's threads, running while
# backward goes on. On GPUs with NCCL the second kind is a kernel on its own CUDA stream.

# %%
DP_CONFIG = GPTConfig(vocab_size=256, hidden=64, layers=4, heads=4, seq_len=32)  # chapter 02's model (QUICK)


def profile_dp_step(ctx, trace_path):
    torch.manual_seed(SEED)
    model = GPT(DP_CONFIG).to(ctx.device)
    dp_model = apply_data_parallel(model, None, kind="bucketed", bucket_cap_mb=0.25)
    optimizer = make_optimizer(model.parameters(), "sgd")
    data = Batches(DP_CONFIG, mbs=2, seed=SEED)

    def step(i):
        data.rank_batch(ctx.rank, ctx.world_size, i).to(ctx.device).loss(dp_model).backward()
        dp_model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()

    step(0)  # warm-up
    if ctx.rank != 0:
        step(1)
        return None
    with quiet_native_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("DP step"):
            step(1)
    prof.export_chrome_trace(trace_path)
    wanted = ("DP step", "c10d::allreduce_", "gloo:all_reduce")
    keep = [
        e
        for e in chrome_trace_events(trace_path)
        if e.get("ph") == "X" and (e["name"] in wanted or e["name"].startswith("autograd::engine"))
    ]
    return keep, len(dp_model.buckets)


dp_events, n_buckets = cluster.run(profile_dp_step, str(WORK_DIR / "dp_rank0.json"))[0]
step_event = next(e for e in dp_events if e["name"] == "DP step")
launches = [e for e in dp_events if e["name"] == "c10d::allreduce_"]
transfers = [e for e in dp_events if e["name"] == "gloo:all_reduce"]
backward = [e for e in dp_events if e["name"].startswith("autograd::engine")]
backward_end = max(e["ts"] + e["dur"] for e in backward)
assert len(launches) == len(transfers) == n_buckets
assert all(e["tid"] == step_event["tid"] for e in launches)  # launched by the training thread
assert all(e["tid"] != step_event["tid"] for e in transfers)  # moved by gloo's threads
assert sum(e["ts"] < backward_end for e in launches) >= n_buckets - 1  # all but the last bucket: during backward
print(
    f"rank 0: {n_buckets} buckets -> {len(launches)} c10d::allreduce_ launches on the training thread, "
    f"{len(transfers)} gloo:all_reduce transfers on gloo's threads; {n_buckets - 1} or more launched during backward"
)

# %% [markdown]
# Drawn from the trace, the way Perfetto shows it, with one row per thread:

# %%
t0 = step_event["ts"]
fig = Figure(figsize=(10, 2.2), layout="constrained")
ax = fig.subplots()
ax.broken_barh(
    [
        ((e["ts"] - t0) / 1e3, e["dur"] / 1e3)
        for e in backward
        if inside(e, step_event) and not any(inside(e, o) for o in backward)
    ],
    (1.6, 0.8),
    color="#55a868",
    label="backward (autograd)",
)
ax.broken_barh(
    [((e["ts"] - t0) / 1e3, max(e["dur"], 20) / 1e3) for e in launches],
    (1.6, 0.8),
    color="black",
    label="c10d::allreduce_ (launch)",
)
ax.broken_barh(
    [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in transfers], (0.6, 0.8), color="#dd8452", label="gloo:all_reduce"
)
ax.set_yticks([1, 2], ["gloo thread", "training thread"])
ax.set(xlabel="ms since the step began", title="rank 0, one bucketed DP step, from its profiler trace")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig

# %% [markdown]
# ## 4. Your own kernel: a C++ extension
#
# When no PyTorch operator does what you need, you can write one in C++ (or CUDA) and call it from
# Python. `torch.utils.cpp_extension.load` compiles source files into a Python module on the fly,
# and `load_inline` does the same from strings. The binding to Python is pybind11: a
# `PYBIND11_MODULE` block lists the functions to export. Our function adds two float32 tensors
# element by element in a plain loop.
#
# `load_inline` normally starts the source with `#include <torch/extension.h>`, which pulls in all
# of PyTorch's C++ API and takes a long time to compile; with `no_implicit_headers=True` we include
# just the three headers we use, which roughly halves the build. The first build still takes tens
# of seconds; PyTorch keeps the compiled library in its extensions cache (outside the course), so
# later runs load it at once. Building needs a C++ compiler and `ninja`: without them the cell says
# so and the rest of this section is skipped.

# %%
CPP_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

// out[i] = x[i] + y[i] for two float32 CPU tensors of the same shape
at::Tensor vector_add(const at::Tensor& x, const at::Tensor& y) {
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu(), "vector_add: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "vector_add: float32 only");
  TORCH_CHECK(x.sizes() == y.sizes(), "vector_add: x and y must have the same shape");
  at::Tensor a = x.contiguous(), b = y.contiguous();
  at::Tensor out = at::empty_like(a);
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  float* po = out.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) {
    po[i] = pa[i] + pb[i];
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_add", &vector_add, "x + y element by element (float32, CPU)");
}
"""


def build_cpu_extension():
    """The compiled module, or None with the reason when this machine cannot build it."""
    from torch.utils.cpp_extension import load_inline, verify_ninja_availability

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return None, f"no C++ compiler ({compiler!r} is not on PATH)"
    try:
        verify_ninja_availability()
    except RuntimeError:
        return None, "ninja is not installed (pip install ninja)"
    try:
        module = load_inline(
            name="ultrascale_a1_vector_add",
            cpp_sources=[CPP_SOURCE],
            no_implicit_headers=True,
            extra_cflags=["-O2"],
            verbose=False,
        )
    except Exception as err:  # a failed build: show why, keep the notebook going
        return None, f"the build failed: {type(err).__name__}: {str(err).strip().splitlines()[-1]}"
    return module, "built"


# %% tags=["nbval-ignore-output"]
# (a machine without a compiler prints why it skips: this output differs between machines)
build_start = time.perf_counter()
vector_add_ext, build_status = build_cpu_extension()
print(f"C++ extension: {build_status} ({time.perf_counter() - build_start:.1f} s)")

# %% [markdown]
# Check it against PyTorch's own addition (`x + y` does exactly one rounding per element, as our
# loop does, so the results must be identical), make sure its checks refuse bad inputs, then profile
# it. PyTorch's profiler knows nothing about a pybind function, so we name the call with
# `record_function`; the operators it calls inside (`aten::empty_like` for the output) appear
# nested under that name.

# %% tags=["nbval-ignore-output"]
if vector_add_ext is not None:
    size = 10000
    x, y = torch.rand(size), torch.rand(size)
    assert torch.equal(vector_add_ext.vector_add(x, y), x + y)
    for bad in (torch.rand(size + 1), torch.rand(size, dtype=torch.float64)):
        try:
            vector_add_ext.vector_add(x, bad)
            raise AssertionError("vector_add accepted a mismatched input")
        except RuntimeError as err:
            print("refused as it should be:", str(err).splitlines()[0])
    big_x, big_y = torch.rand(2**22), torch.rand(2**22)
    with quiet_native_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with torch.profiler.record_function("vector_add (our C++)"):
                vector_add_ext.vector_add(big_x, big_y)
            with torch.profiler.record_function("x + y (PyTorch)"):
                torch.add(big_x, big_y)
    names = {e.key for e in prof.key_averages()}
    assert {"vector_add (our C++)", "x + y (PyTorch)", "aten::empty_like", "aten::add"} <= names, names
    print(f"vector_add == x + y on {size} elements")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=6))
else:
    print(f"skipped: {build_status}")

# %% [markdown]
# PyTorch's `aten::add` is vectorised (SIMD) and runs on several threads; our loop is one thread of
# scalar code, though the compiler's `-O2` may vectorise it too. The table shows what that is worth
# on this machine.
#
# ### The CUDA version, and Nsight Compute
#
# The book's GPU kernel does the same addition with one thread per element: a kernel `add_kernel`
# in which each thread computes its global index `blockIdx.x * blockDim.x + threadIdx.x` and, if
# the index is inside the tensor (the last block is usually only partly used), adds one pair. The
# launcher picks 1024 threads per block and rounds the number of blocks **up**, so that every
# element gets a thread:


# %%
def blocks_for(n, threads=1024):
    return (n + threads - 1) // threads  # the C++ integer division (n + threads - 1) / threads


assert [blocks_for(n) for n in (1, 1024, 1025, 10000)] == [1, 1, 2, 10]
print(
    f"10000 elements: {blocks_for(10000)} blocks of 1024 threads = {blocks_for(10000) * 1024} threads, "
    f"{blocks_for(10000) * 1024 - 10000} of them idle at the bound check"
)

# %%
CUDA_SOURCE = r"""
__global__ void add_kernel(const float* x, const float* y, float* out, int64_t n) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {                 // the last block reaches past the end
    out[i] = x[i] + y[i];
  }
}

torch::Tensor add_cuda(torch::Tensor x, torch::Tensor y) {
  TORCH_CHECK(x.is_cuda() && y.is_cuda() && x.sizes() == y.sizes(), "add_cuda: two CUDA tensors of one shape");
  auto a = x.contiguous(), b = y.contiguous();
  auto out = torch::empty_like(a);
  const int threads = 1024;
  const int blocks = (a.numel() + threads - 1) / threads;
  add_kernel<<<blocks, threads>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), a.numel());
  return out;
}
"""

# %% tags=["nbval-ignore-output"]
# (runs only with a GPU and the CUDA compiler; otherwise it says why it skips)
from torch.utils.cpp_extension import CUDA_HOME  # noqa: E402

if CUDA and CUDA_HOME is not None:
    cuda_ext = torch.utils.cpp_extension.load_inline(
        name="ultrascale_a1_vector_add_cuda",
        cpp_sources=["torch::Tensor add_cuda(torch::Tensor x, torch::Tensor y);"],
        cuda_sources=[CUDA_SOURCE],
        functions=["add_cuda"],
        verbose=False,
    )
    gx, gy = torch.rand(10000, device="cuda"), torch.rand(10000, device="cuda")
    assert torch.equal(cuda_ext.add_cuda(gx, gy), gx + gy)
    print("add_cuda (1024 threads per block, 10 blocks) == x + y on 10000 elements")
else:
    print("skipped the CUDA kernel: " + ("no GPU" if not CUDA else "no CUDA compiler (CUDA_HOME is not set)"))

# %% [markdown]
# Nsight Compute (`ncu`) runs a program and replays each of its kernels many times to measure
# what the hardware did: memory throughput, occupancy, where warps stalled, with advice. The book
# profiles a layer-norm script with `ncu --set full python layer_norm.py`, and adds `-o output` to
# save an `output.ncu-rep` report to open in the Nsight Compute GUI. When `ncu` and a GPU are
# present, the cell below does that for one layer norm (reading GPU counters may need
# administrator rights; the cell then prints ncu's message).

# %% tags=["nbval-ignore-output"]
NCU_SCRIPT = """import torch, torch.nn.functional as F
x = torch.randn(10000, 10000, device="cuda")
F.layer_norm(x, x.size()[1:])
torch.cuda.synchronize()
"""
ncu = shutil.which("ncu")
if CUDA and ncu:
    script = WORK_DIR / "layer_norm.py"
    script.write_text(NCU_SCRIPT)
    report = WORK_DIR / "output"
    result = subprocess.run(
        [ncu, "--set", "full", "-k", "regex:layer_norm", "-o", str(report), sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    print("\n".join((result.stdout + result.stderr).strip().splitlines()[-8:]))
    print(f"report written: {report.with_suffix('.ncu-rep').exists()}")
else:
    print("skipped Nsight Compute: " + ("no GPU" if not CUDA else "ncu is not on PATH"))

# %% [markdown]
# ## Summary
#
# - GPU work (and any asynchronous work: a gloo collective, our CPU stream) runs after the call that
#   starts it has returned. Time it with events or a synchronisation before reading the clock,
#   after a warm-up, over several repeats, and report the median.
# - `torch.profiler` with a schedule keeps representative steps; `key_averages().table(...)` ranks
#   operators, and the Chrome trace holds every event with its thread, time and arguments, which code
#   can search as well as eyes can.
# - In one rank's trace of a DP step, the all-reduce launches sit in backward and the transfers run on
#   another thread: overlap, made visible.
# - A C++ (or CUDA) function becomes a Python function with `load_inline` and pybind11; check it
#   against PyTorch and profile it like any other call.
#
# ## Your turn
# Open [exercises/a1_profiling_exercises.ipynb](../exercises/a1_profiling_exercises.ipynb): write a benchmark function that survives asynchronous
# work, warm-up effects and outliers, walk a trace from each GPU kernel back to the operator that
# launched it, and read from a trace how much of the communication the computation hid.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/a1_profiling_exercises.ipynb` grades
# the whole notebook from a terminal.

# %%
cluster.close()
shutil.rmtree(WORK_DIR, ignore_errors=True)
