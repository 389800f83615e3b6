# %% [markdown]
# # 00 · Orientation: your first cluster
#
# This course follows *The Ultra-Scale Playbook: Training LLMs on GPU Clusters*
# (Hugging Face, 2025) one notebook per section. Every notebook starts real processes,
# joins them into a real `torch.distributed` process group and makes them talk:
# gloo on a laptop CPU, NCCL when each rank has a GPU. Nothing here needs a GPU.
#
# In this first notebook you will
# 1. check what your machine can do (versions, devices, which collectives work),
# 2. start a **cluster** of ranks that live beside this notebook, and run code on them,
# 3. watch ranks report metrics while they work (a live plot),
# 4. see the map of the course, organised around three pressures.
#
# **Running a notebook.** Shift+Enter runs the selected cell and moves to the next one; Run ▸ Run
# All Cells runs the whole notebook, top to bottom; the ■ button of the toolbar stops a running
# cell, ranks included. Each open notebook has a kernel of its own: a Python process that keeps
# the notebook's variables, and here also the ranks it starts, about a quarter of a GB in all.
# **Closing a notebook's tab shuts its kernel down** (this lab is set up so) and gives that
# memory back; Kernel ▸ Shut Down Kernel does it with the tab open, and the Running Terminals and
# Kernels panel (the second icon of the left sidebar) lists the kernels still running. The last
# cell of a chapter closes its cluster; a cell re-run after it starts the ranks again, with a
# one-line notice that what they kept (`ctx.state`) is gone.
#
# The cell below holds the parameters. Batch runs (papermill) override them, e.g.
# `papermill -p WORLD_SIZE 3 00_orientation.ipynb out.ipynb`.

# %% tags=["parameters"]
WORLD_SIZE = 4  # number of ranks (processes); any value of 2 or more works here
QUICK = True  # True: a 30-step demo, about 5 s on 2 CPU cores; False: 200 steps (longer)
SEED = 0

# %%
from ultrascale.runtime import Cluster, RankError  # first: the ranks' fork server loads torch meanwhile
import platform
import os

import torch
import torch.distributed as dist

from ultrascale.viz.live import LivePlot

torch.manual_seed(SEED)
assert WORLD_SIZE >= 2, "this chapter shows collectives between ranks: use WORLD_SIZE >= 2"

# %% [markdown]
# ## 1. What does this machine have?
# The output of the next cell depends on your machine, so it is not checked when the
# notebook is re-run in CI.


# %% tags=["nbval-ignore-output"]
def probe_environment():
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CPU cores": os.cpu_count(),
        "CUDA available": torch.cuda.is_available(),
        "gloo available": dist.is_gloo_available(),
        "NCCL available": dist.is_nccl_available(),
        "MPI available": dist.is_mpi_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["GPU"] = f"{torch.cuda.device_count()} x {props.name}, {props.total_memory / 2**30:.0f} GiB"
        info["bf16 supported"] = torch.cuda.is_bf16_supported()
        info["fp8 (sm_89+)"] = torch.cuda.get_device_capability(0) >= (8, 9)
    return info


for key, value in probe_environment().items():
    print(f"{key:>15}: {value}")

# %% [markdown]
# Whatever the machine, the course needs gloo: it is the backend every CPU run uses.

# %%
assert dist.is_gloo_available(), "this torch build has no gloo backend; reinstall torch"

# %% [markdown]
# ## 2. A cluster of ranks
# `Cluster(n)` starts `n` worker processes **once** and keeps them. Each one is a rank of a
# process group. `cluster.run(fn)` sends `fn` (defined right here, in the notebook) to every
# rank, calls `fn(ctx)` there, and returns the results in rank order. `ctx` says who the rank
# is (`ctx.rank`, `ctx.world_size`, `ctx.device`) and keeps per-rank state in `ctx.state`.

# %%
cluster = Cluster(WORLD_SIZE)
print(cluster)


# %%
def hello(ctx):
    print(f"I am rank {ctx.rank} of {ctx.world_size}, computing on {ctx.device}")
    return ctx.rank * 10


results = cluster.run(hello)
print("results:", results)
assert results == [10 * r for r in range(WORLD_SIZE)]

# %% [markdown]
# Printed lines come back prefixed by their rank, in rank order.
#
# Now the collective that the whole of data parallelism rests on: **all-reduce**. Every rank
# holds a tensor; afterwards every rank holds the element-wise sum of all of them.


# %%
def first_all_reduce(ctx):
    tensor = torch.tensor([ctx.rank + 1.0, 10.0 * (ctx.rank + 1)], device=ctx.device)
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return before, tensor


before_after = cluster.run(first_all_reduce)
for rank, (before, after) in enumerate(before_after):
    print(f"rank {rank}: before {before.tolist()}  after {after.tolist()}")

total = sum(before for before, _ in before_after)
assert all(torch.equal(after, total) for _, after in before_after)
n = WORLD_SIZE
assert total.tolist() == [n * (n + 1) / 2, 10 * n * (n + 1) / 2]

# %% [markdown]
# ### Which collectives does the backend support?
# We try each collective the course uses on the cluster and record whether it worked and gave
# the right answer. With the pinned torch 2.13 CPU build, gloo runs all of them. (torch 2.13
# added `all_gather_single` and `reduce_scatter_single` beside `all_gather_into_tensor` and
# `reduce_scatter_tensor`, which it keeps; 2.11 and 2.12 have only the old names. We use the new
# ones where they exist.)


# %%
def try_collectives(ctx):
    r, n, dev = ctx.rank, ctx.world_size, ctx.device  # every tensor on the rank's device
    x = lambda: torch.full((2,), float(r + 1), device=dev)  # a fresh input per collective
    zeros = lambda k: torch.zeros(k, device=dev)  # an output buffer
    total = n * (n + 1) / 2
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    checks = {
        "broadcast": lambda: (dist.broadcast(t := x(), src=0), t[0].item() == 1.0)[1],
        "reduce": lambda: (dist.reduce(t := x(), dst=0), r != 0 or t[0].item() == total)[1],
        "all_reduce": lambda: (dist.all_reduce(t := x()), t[0].item() == total)[1],
        "gather": lambda: _gather(r, n, x()),
        "all_gather": lambda: (
            dist.all_gather(out := [zeros(2) for _ in range(n)], x()),
            [o[0].item() for o in out] == [i + 1.0 for i in range(n)],
        )[1],
        "all_gather_single": lambda: (
            all_gather_single(out := zeros(2 * n), x()),
            out[::2].tolist() == [i + 1.0 for i in range(n)],
        )[1],
        "scatter": lambda: _scatter(r, n, dev),
        "reduce_scatter": lambda: (
            dist.reduce_scatter(out := zeros(2), [x() for _ in range(n)]),
            out[0].item() == total,
        )[1],
        "reduce_scatter_single": lambda: (
            reduce_scatter_single(out := zeros(2), torch.cat([x()] * n)),
            out[0].item() == total,
        )[1],
        "all_to_all_single": lambda: (
            dist.all_to_all_single(out := zeros(n), torch.full((n,), float(r), device=dev)),
            out.tolist() == [float(i) for i in range(n)],
        )[1],
        "send/recv": lambda: _ring_pass(r, n, dev),
        "barrier": lambda: dist.barrier() is None,
    }
    report = {}
    for name, check in checks.items():
        try:
            report[name] = "ok" if check() else "WRONG RESULT"
        except Exception as exc:  # a backend without it raises; keep going with the others
            report[name] = f"unsupported ({type(exc).__name__})"
    return report


def _gather(r, n, tensor):
    out = [torch.zeros_like(tensor) for _ in range(n)] if r == 0 else None
    dist.gather(tensor, out, dst=0)
    return r != 0 or [o[0].item() for o in out] == [i + 1.0 for i in range(n)]


def _scatter(r, n, dev):
    out = torch.zeros(2, device=dev)
    chunks = [torch.full((2,), float(i), device=dev) for i in range(n)] if r == 0 else None
    dist.scatter(out, chunks, src=0)
    return out[0].item() == r


def _ring_pass(r, n, dev):
    """Send our rank to the right neighbour while receiving from the left one, both posted as
    one batch: under NCCL (a GPU node) a send waits until its receive is posted, and with two
    ranks both neighbours are the same rank, so two sends posted first would wait forever."""
    got = torch.zeros(1, device=dev)
    mine = torch.tensor([float(r)], device=dev)
    for request in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, mine, (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]
    ):
        request.wait()
    return got.item() == (r - 1) % n


reports = cluster.run(try_collectives)
print(f"{'collective':>24}  status on every rank ({cluster.backend})")
for name in reports[0]:
    statuses = {rep[name] for rep in reports}
    print(f"{name:>24}  {', '.join(sorted(statuses))}")
if cluster.backend == "gloo":
    assert all(status == "ok" for rep in reports for status in rep.values()), reports

# %% [markdown]
# ## 3. The `%%ranks` cell magic
# For quick experiments you can run a whole cell on every rank. Each rank keeps its own
# variables between `%%ranks` cells, and `ctx`, `rank`, `world_size`, `torch` and `dist` are
# predefined. `-r 0,2` runs a cell on some ranks only. The value of the last line is shown
# per rank.

# %%
# %%ranks
shard = torch.arange(4.0, device=ctx.device) + 4 * rank  # each rank owns a different slice of 0..4n-1
local_sum = shard.sum()
dist.all_reduce(local_sum)
local_sum.item()

# %%
n = WORLD_SIZE
expected = (4 * n) * (4 * n - 1) / 2  # the sum 0 + 1 + ... + (4n - 1)
assert cluster.run(lambda ctx: ctx.state["__ranks_namespace__"]["local_sum"].item()) == [expected] * n

# %% [markdown]
# ## 4. Watching ranks work: a live plot
# Ranks can stream numbers to the notebook while a call runs, with `ctx.log(...)`. Here each rank
# fits the same tiny linear model to **its own shard** of the data, and averages gradients with
# all-reduce before each step: that is data parallelism in ten lines, the subject of chapter 02.
# The plot updates as the ranks train.


# %% tags=["nbval-ignore-output"]
# (a live plot redraws as often as timing allows, so its outputs are not compared in CI)
def train_linear_regression(ctx, steps, seed):
    torch.manual_seed(seed + ctx.rank)  # each rank draws different data...
    true_w = torch.tensor([2.0, -3.0, 0.5])
    x = torch.randn(64, 3)
    y = x @ true_w + 0.01 * torch.randn(64)
    x, y = x.to(ctx.device), y.to(ctx.device)  # drawn on the CPU, then moved to the rank's device
    torch.manual_seed(seed)  # ...but all start from the same weights
    w = torch.zeros(3, device=ctx.device, requires_grad=True)
    for step in range(steps):
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        dist.all_reduce(w.grad)  # sum of gradients over ranks...
        w.grad /= ctx.world_size  # ...divided by their number: the average
        with torch.no_grad():
            w -= 0.1 * w.grad
            w.grad.zero_()
        ctx.log(step=step, loss=loss)
    return w.detach()


plot = LivePlot("loss", x="step", title="each rank's loss on its own shard", logy=True)
weights = cluster.run(train_linear_regression, 30 if QUICK else 200, SEED, on_log=plot)
fig = plot.finish()  # the final frame (a cell that ends in an expression would show it again)
# %% [markdown]
# Because every rank applied the same averaged gradient to the same starting weights, the
# replicas never drift apart, and they found the true weights:

# %%
for w in weights[1:]:
    assert torch.equal(w, weights[0]), "replicas diverged"
print("learned weights:", [round(v, 2) for v in weights[0].tolist()])
assert torch.allclose(weights[0], torch.tensor([2.0, -3.0, 0.5]), atol=0.05)

# %% [markdown]
# ## 5. When something goes wrong
# An exception on one rank comes back as a single `RankError` with that rank's traceback, and the
# cluster stays usable. A call that hangs (say, ranks calling different collectives) raises after
# its `timeout=` with every rank's current stack, and the ranks are restarted. The stop button
# interrupts the ranks too.


# %%
def fails_on_last_rank(ctx):
    if ctx.rank == ctx.world_size - 1:
        raise ValueError("this rank got a bad batch")
    return "fine"


try:
    cluster.run(fails_on_last_rank)
except RankError as err:
    failure = err.failures[WORLD_SIZE - 1]
    print(f"rank {failure.rank} raised {failure.type_name}: {failure.exception}")

assert cluster.run(lambda ctx: "still here") == ["still here"] * WORLD_SIZE

# %% [markdown]
# ## 6. The map of the course
# Training a large model keeps running into three limits, and nearly every technique in the book
# trades one against another:
#
# | pressure | what it means | typical remedies |
# |---|---|---|
# | **memory** | a training step that does not fit in GPU memory cannot run at all | recomputation, ZeRO/FSDP sharding, tensor/pipeline/context parallelism |
# | **compute efficiency** | the GPUs should spend their time computing, not waiting for data or for each other | bigger batches, fused kernels, overlap, good parallel layouts |
# | **communication** | moving data costs time: fast links inside a node, slower ones between nodes | overlap with compute, keep heavy traffic (TP) inside a node |
#
# For example, activation recomputation buys memory with extra compute, and tensor parallelism
# buys memory with communication.
#
# The chapters, in reading order (each links to its notebook):
#
# | chapter | topic | main pressure |
# |---|---|---|
# | [00](00_orientation.ipynb) | this notebook: the machine, a first cluster, `%%ranks`, this map | - |
# | [a0](a0_collectives.ipynb) | collectives: broadcast to reduce-scatter, a ring all-reduce from scratch | communication |
# | [01](01_one_gpu.ipynb) | one GPU: memory anatomy, recomputation, gradient accumulation, profiling | memory |
# | [02](02_data_parallelism.ipynb) | data parallelism: overlap, bucketing, accumulation without sync | compute / communication |
# | [03](03_zero.ipynb) | ZeRO-1/2/3 (FSDP) | memory |
# | [04](04_tensor_parallelism.ipynb) | tensor parallelism: split the matrices | memory / communication |
# | [05](05_sequence_parallelism.ipynb) | sequence parallelism: split what TP leaves whole | memory / communication |
# | [06](06_context_parallelism.ipynb) | context parallelism: ring attention and the zig-zag layout | memory / communication |
# | [07](07_pipeline_parallelism.ipynb) | pipeline parallelism and its schedules | memory / compute |
# | [08](08_expert_parallelism.ipynb) | expert parallelism (mixture of experts) | memory / compute |
# | [09](09_5d_parallelism.ipynb) | 5D parallelism: every axis on one mesh | all three |
# | [10](10_best_configuration.ipynb) | finding the best training configuration | all three |
# | [11](11_gpu_kernels.ipynb) | inside the GPU: Triton kernels to FlashAttention | compute |
# | [12](12_mixed_precision.ipynb) | mixed precision: BF16 and FP8 | memory / compute |
# | [a1](a1_profiling.ipynb) | profiling: timing, traces, kernels | compute |
# | [a2](a2_typical_scales.ipynb) | typical scales: parameters, states and FLOPs | memory / compute |
# | [a3](a3_overlap_math.ipynb) | the arithmetic of overlapping communication with computation | communication |
# | [a4](a4_checkpoints_and_failures.ipynb) | beyond the book: checkpoints, resharding, failures and restarts | time lost |
#
# The book's results rest on more than 4000 scaling experiments on up to 512 GPUs (more than 4100
# distributed runs, over 16k counting test runs); reading it takes two to four days. Its two code
# companions are **picotron** (short, teaching implementations) and **nanotron** (the production
# framework); this course builds its own small implementations in `lib/ultrascale/` and checks
# them against PyTorch's.
#
# ### A first look at memory
# Chapter 01 derives where memory goes. Here is the breakdown the library computes for Llama 3 8B
# (one micro-batch of 4096 tokens, BF16 mixed precision, Adam, 8 data-parallel ranks so that
# the ZeRO stages differ); in JupyterLab,
# `ultrascale.viz.memory_widget.memory_widget()` gives the same picture with controls: sliders for
# the sequence length, the micro-batch and the TP, DP and PP degrees (the pipeline degree is one
# the book's own widget leaves out), menus for the model, recomputation and ZeRO stage.

# %%
from ultrascale.viz.memory_widget import memory_figure

memory_figure(preset="Llama 3 8B", seq=4096, micro_batch=1, dp=8)

# %% [markdown]
# ## Your turn
# Open [exercises/00_orientation_exercises.ipynb](../exercises/00_orientation_exercises.ipynb) for the warm-up: an all-reduce mean and the
# pipeline input of the memory calculator.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/00_orientation_exercises.ipynb` grades
# the whole notebook from a terminal.
#
# ### Your progress
# `make progress` prints, per chapter, the exercises you have passed and your points, as the command-line
# grader recorded them (`make grade`); so does the cell below. A `check(...)` in a notebook gives feedback
# only: it records nothing.

# %% tags=["nbval-ignore-output"]
from ultrascale_grading.progress import show

show()

# %%
cluster.close()
