# %% [markdown]
# # 02 · Data parallelism
#
# The first way to use more than one GPU is also the simplest: give every GPU a complete copy
# of the model and a different slice of the batch. Each copy (a **replica**) runs forward and
# backward on its own slice, the replicas then agree on the *average* gradient, and all of them
# apply the same optimizer step, so they stay identical. This is **data parallelism** (DP).
#
# This notebook builds it up in the order the book does, on real ranks and the course GPT:
#
# 1. DP is gradient accumulation run in parallel: prove it by matching single-process training
#    on the concatenated batch, and PyTorch's `DistributedDataParallel` (DDP);
# 2. **overlap**: start each gradient's all-reduce from a hook while backward is still running;
#    watch the hooks fire last layer first, and see it on a per-rank timeline (Gantt chart);
# 3. **bucketing**: pack gradients into a few flat buffers and all-reduce those, because every
#    call pays a fixed latency; count the calls and time them; sweep the bucket size;
# 4. **`no_sync`**: with gradient accumulation, only the last micro-batch needs to communicate;
# 5. a final check against DDP with `bucket_cap_mb` and `no_sync`;
# 6. the batch-size recipe `gbs = mbs × grad_acc × dp`, the book's worked example, and where DP
#    stops scaling.
#
# Everything runs on CPU with gloo. The library code lives in `lib/ultrascale/parallel/`
# (`data_parallel.py` is about 300 lines and worth reading beside this notebook).

# %% tags=["parameters"]
WORLD_SIZE = 4  # data-parallel ranks: any value of 2 or more works
QUICK = True  # True: a small model, few timing steps, about 20 s on 2 CPU cores; False: a larger model, more steps and repeats (longer)
SEED = 0

# %%
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import contextlib
import inspect
import statistics
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
from matplotlib.patches import FancyArrowPatch, Rectangle

from ultrascale.batch_size import global_batch_size, plan_batch, samples_per_step
from ultrascale.comm import AlphaBeta, CommLogger, format_bytes, wait_for_device
from ultrascale.data import Batches
from ultrascale.memory import GB, GiB, breakdown
from ultrascale.model import GPT, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, GPTConfig, count_params
from ultrascale.parallel import BucketedDataParallel, NaiveDataParallel, OverlappedDataParallel, Timeline, build_buckets
from ultrascale.parity import assert_replicas_identical, assert_same, ddp as torch_ddp, max_difference, tolerance
from ultrascale.train import make_optimizer, train
from ultrascale.viz.gantt import lane_summary, plot_gantt
from ultrascale.viz.live import ProgressBar

assert isinstance(WORLD_SIZE, int) and WORLD_SIZE >= 2, "data parallelism needs at least two ranks: set WORLD_SIZE >= 2"
torch.manual_seed(SEED)
torch.set_num_threads(1)  # tiny matrices: extra threads only fight the ranks for the 2 cores

# %% [markdown]
# ### The model, the data and the training recipe
# A small GPT (the course model of chapter 01) trained with plain SGD. Each rank gets `MBS`
# samples per micro-batch, so one step over `WORLD_SIZE` ranks sees `MBS × WORLD_SIZE` samples:
# the **global batch**. The course's parity harness (`ultrascale.parity`) makes it:
# `DATA.global_batch(step, WORLD_SIZE, micro)` builds the whole batch from a seed, and
# `DATA.rank_batch(r, WORLD_SIZE, step, micro)` gives rank `r` its rows `r·MBS … (r+1)·MBS − 1`,
# exactly what a distributed sampler would hand it. `batch.loss(model)` is the mean next-token
# cross-entropy, and `train(...)` the one training loop that every run in the course shares.

# %%
CONFIG = (
    GPTConfig(vocab_size=256, hidden=64, layers=4, heads=4, seq_len=32)
    if QUICK
    else GPTConfig(vocab_size=512, hidden=128, layers=8, heads=8, seq_len=64)
)
MBS = 2  # micro-batch size: samples per rank per forward/backward
STEPS = 3  # optimizer steps in the correctness runs
LR = 0.1
GRAD_ACC = 4  # micro-batches per step in the accumulation section
TIMED_STEPS = 4 if QUICK else 10  # steps per timing run (the first one is a warm-up)
BUCKET_MB = 0.25 if QUICK else 1.0  # bucket cap in MiB: a few buckets for the model's gradients


DATA = Batches(CONFIG, mbs=MBS, seed=SEED)


def fresh_model():
    torch.manual_seed(SEED)
    return GPT(CONFIG)


def train_single_process(steps=STEPS, grad_acc=1, lr=LR):
    """The reference: one process, the whole global batch, gradient accumulation over micro-steps."""
    model = fresh_model()
    return train(
        model,
        DATA.global_stream(WORLD_SIZE),
        steps,
        make_optimizer(model.parameters(), "sgd", lr=lr),
        grad_acc=grad_acc,
    )


n_params = count_params(CONFIG)
n_tensors = len(list(GPT(CONFIG).parameters()))
print(
    f"GPT: {n_params:,} parameters in {n_tensors} tensors, {format_bytes(4 * n_params)} of fp32 gradients per replica"
)
print(f"global batch: {MBS} samples x {WORLD_SIZE} ranks = {MBS * WORLD_SIZE} samples per step")

# %% [markdown]
# ## 1. Data parallelism is gradient accumulation, in parallel
#
# Chapter 01 accumulated gradients: run several micro-batches one after another, add up their
# gradients, step once. The loss of a batch is a mean over its samples, so with `N` micro-batches
# of equal size the gradient of the whole batch is the mean of the micro-batch gradients:
#
# $$\nabla \mathcal{L}_{\text{batch}} = \frac{1}{N}\sum_{r=0}^{N-1} \nabla \mathcal{L}_r .$$
#
# Nothing in that sum says the `N` terms must be computed by one device in turn. Data parallelism
# computes them at the same time, one per rank, and the sum becomes an **all-reduce**: every rank
# contributes its gradient and receives the sum, then divides by `N`. First the identity itself,
# in this process:

# %%
model = fresh_model()
DATA.global_batch(0, WORLD_SIZE).loss(model).backward()
whole_batch = [p.grad.clone() for p in model.parameters()]

model.zero_grad()
for r in range(WORLD_SIZE):  # the ranks' micro-batches, one after another
    (DATA.rank_batch(r, WORLD_SIZE, 0).loss(model) / WORLD_SIZE).backward()  # .grad adds them up
for full, accumulated in zip(whole_batch, model.parameters()):
    assert_same(accumulated.grad, full, "accumulated vs whole-batch gradient", optimizer=None)
print(f"the mean of {WORLD_SIZE} micro-batch gradients equals the gradient of the concatenated batch")

# %% [markdown]
# (The tolerance: both sides add the same fp32 numbers in a different order, so they differ only
# in the last bits, about 1e-7 relative.)
#
# The picture of one data-parallel step: `N` identical replicas, each with its own slice of the
# batch, joined by one all-reduce of the gradients before the (identical) optimizer steps.


# %%
def draw_dp_step(n):
    fig, ax = plt.subplots(figsize=(9, 3.2))
    plt.close(fig)
    width = 1.6
    for r in range(n):
        x0 = r * (width + 0.4)
        ax.add_patch(Rectangle((x0, 2.2), width, 0.6, color="#c6dbef"))
        ax.text(x0 + width / 2, 2.5, f"batch slice {r}", ha="center", va="center", fontsize=8)
        ax.add_patch(Rectangle((x0, 1.0), width, 0.9, color="#4c72b0"))
        ax.text(
            x0 + width / 2,
            1.45,
            f"rank {r}\nfull model copy\nforward + backward",
            ha="center",
            va="center",
            color="white",
            fontsize=8,
        )
        ax.add_patch(FancyArrowPatch((x0 + width / 2, 2.2), (x0 + width / 2, 1.9), arrowstyle="->", mutation_scale=10))
        ax.add_patch(
            FancyArrowPatch(
                (x0 + width / 2, 1.0), (x0 + width / 2, 0.55), arrowstyle="<->", mutation_scale=10, color="#dd8452"
            )
        )
    span = n * (width + 0.4) - 0.4
    ax.add_patch(Rectangle((0, 0.05), span, 0.5, color="#dd8452"))
    ax.text(
        span / 2,
        0.3,
        f"all-reduce: every rank gets the sum of all gradients, then divides by {n} (the mean)",
        ha="center",
        va="center",
        fontsize=9,
    )
    ax.set_xlim(-0.2, span + 0.2)
    ax.set_ylim(0, 3)
    ax.axis("off")
    ax.set_title("one data-parallel step: same weights, different data, averaged gradients")
    return fig


draw_dp_step(WORLD_SIZE)

# %% [markdown]
# ### Naive DP on real ranks
# `NaiveDataParallel` (in `ultrascale.parallel`) wraps any module from outside: it copies rank 0's
# weights to every rank when it is built, and `finish_gradient_synchronization()` all-reduces the
# gradients one tensor at a time after backward. Each gradient is divided by the world size
# *before* the all-reduce, so the sum that comes back is already the mean.
#
# The training function below runs on every rank. To show the initial broadcast at work, each
# rank first builds its model from a *different* seed. It is the single training loop of the
# whole chapter: `kind` picks the wrapper (ours or DDP), `grad_acc` and `use_no_sync` drive the
# accumulation of section 4, `record` fills a timeline for the Gantt charts, `log_comm` counts the
# all-reduce calls with the course's `CommLogger`.


# %%
def make_wrapper(kind, model, bucket_cap_mb, timeline):
    if kind == "naive":
        return NaiveDataParallel(model, timeline=timeline)
    if kind == "overlapped":
        return OverlappedDataParallel(model, timeline=timeline)
    if kind == "bucketed":
        return BucketedDataParallel(model, bucket_cap_mb=bucket_cap_mb, timeline=timeline)
    if kind == "ddp":
        return torch_ddp(model, bucket_cap_mb=bucket_cap_mb)
    raise ValueError(f"unknown kind {kind!r}")


def train_on_rank(
    ctx, kind, steps=STEPS, grad_acc=1, use_no_sync=True, bucket_cap_mb=BUCKET_MB, record=False, log_comm=False
):
    torch.manual_seed(SEED + ctx.rank)  # different replicas on purpose: the wrapper must fix this
    model = GPT(CONFIG).to(ctx.device)
    timeline = Timeline(ctx.rank, enabled=record, device=ctx.device)  # on a GPU, bars wait for the stream
    dp = make_wrapper(kind, model, bucket_cap_mb, timeline)
    opt = make_optimizer(model.parameters(), "sgd", lr=LR)
    span = timeline.span

    step_seconds, calls = [], []
    for step in range(steps):
        dist.barrier()  # start every step together, so the ranks' timelines line up
        timeline.clear()  # keep only the last step for the Gantt chart
        start = time.perf_counter()
        with CommLogger() if log_comm else contextlib.nullcontext() as log:
            for micro in range(grad_acc):
                local_only = use_no_sync and micro < grad_acc - 1
                with dp.no_sync() if local_only else contextlib.nullcontext():
                    batch = DATA.rank_batch(ctx.rank, ctx.world_size, step, micro).to(ctx.device)
                    with span("forward"):
                        loss = batch.loss(dp) / grad_acc
                    with span("backward"):
                        loss.backward()
                    if kind != "ddp" and not local_only:  # DDP waits inside backward by itself
                        dp.finish_gradient_synchronization()
            with span("optimizer step"):
                opt.step()
                opt.zero_grad()
        wait_for_device(ctx.device)  # on a GPU: the step's kernels done, not only queued
        step_seconds.append(time.perf_counter() - start)
        if log_comm:
            calls.append(log.totals().get("all_reduce", {}).get("calls", 0))
    return {
        "params": {name: p.detach().cpu() for name, p in model.named_parameters()},
        "step_seconds": step_seconds,
        "all_reduce_calls": calls,  # per step, as CommLogger saw them
        "num_syncs": getattr(dp, "num_syncs", None),
        "ready_order": list(getattr(dp, "ready_order", [])),
        "bucket_sizes": getattr(dp, "bucket_sizes", None),
        "rows": timeline.rows(),
    }


cluster = Cluster(WORLD_SIZE)
print(cluster)

# %% [markdown]
# **How close is "equal"?** Each rank averages the loss over its own `MBS` samples and the
# all-reduce adds those averages, while the reference averages all `MBS × WORLD_SIZE` samples in
# one go. In exact arithmetic these are the same number; in fp32 the additions happen in a
# different order and the gradients differ in the last bits (about 1e-7 relative). A few SGD
# steps with `lr = 0.1` carry that into the weights at the 1e-8 level. The parity harness allows
# `atol = 5e-6` for fp32 SGD (`ultrascale.parity.TOLERANCES`, where every tolerance of the course
# is written down with its reason): comfortably above rounding, and far below the weight change
# of a single step (printed below), so a missing division or a lost gradient cannot pass. The
# replicas themselves must be *bit-identical*: they apply the very same averaged gradient.

# %%
TOL = tolerance("sgd")


def replicas(results):
    return [res["params"] for res in results]


reference = train_single_process()
naive = cluster.run(train_on_rank, "naive")
assert_replicas_identical(replicas(naive), "naive DP")
assert_same(naive[0]["params"], reference, "naive DP vs single process")

ddp = cluster.run(train_on_rank, "ddp")
assert_replicas_identical(replicas(ddp), "DDP")
assert_same(naive[0]["params"], ddp[0]["params"], "naive DP vs DDP")
print(
    f"after {STEPS} steps on {WORLD_SIZE} ranks: naive DP == single process on the concatenated "
    "batch == PyTorch DDP (within the tolerance), and all replicas are bit-identical"
)

# %% [markdown]
# The sizes behind that tolerance on this machine, and a negative control: a DP step that forgot
# to divide by the world size behaves like SGD with a `WORLD_SIZE` times larger learning rate,
# and the same assertion rejects it by a wide margin.

# %% tags=["nbval-ignore-output"]
initial = {name: p.detach().clone() for name, p in fresh_model().named_parameters()}
one_step = train_single_process(steps=1)
forgot_to_divide = train_single_process(lr=LR * WORLD_SIZE)
print(f"naive DP vs single process   max |difference| = {max_difference(naive[0]['params'], reference):.1e}")
print(f"naive DP vs DDP              max |difference| = {max_difference(naive[0]['params'], ddp[0]['params']):.1e}")
print(f"tolerance                    atol = {TOL['atol']:.0e}")
print(f"change made by one SGD step  max |difference| = {max_difference(one_step, initial):.1e}")
print(f"summed instead of averaged   max |difference| = {max_difference(forgot_to_divide, reference):.1e}")
assert max_difference(one_step, initial) > 100 * TOL["atol"], "the tolerance would hide a whole step"
assert max_difference(forgot_to_divide, reference) > 100 * TOL["atol"], "the check could not catch a sum"

# %% [markdown]
# ## 2. Overlapping communication with backward
#
# The naive version wastes time: while backward runs, the network is idle, and while the
# all-reduces run, the processors are idle. But backward produces gradients one layer at a time,
# starting from the *last* layer. The gradient of the output head is final long before backward
# reaches the first block; its all-reduce could already be under way.
#
# PyTorch tells us the moment a parameter's gradient is complete with
# `Tensor.register_post_accumulate_grad_hook(hook)`: `hook(p)` runs right after autograd has added
# this backward's contribution into `p.grad` (for a weight used twice, like our tied
# embedding/head matrix, after both contributions). `OverlappedDataParallel` registers one such
# hook per trainable parameter, and each hook launches an **asynchronous** all-reduce
# (`async_op=True` returns a handle at once). Before `optimizer.step()`,
# `finish_gradient_synchronization()` waits on all the handles. Here is the registration, the
# hook, and the bookkeeping it does first (the order the hooks fired in, which the next cell reads),
# straight from the library:

# %%
print(inspect.getsource(OverlappedDataParallel.register_backward_hook))
print(inspect.getsource(OverlappedDataParallel._on_grad_ready))
print(inspect.getsource(OverlappedDataParallel._note_ready))

# %% [markdown]
# The hooks fire in the order backward reaches the parameters, so we can simply record it. It
# should be the reverse of the layer order: the final norm first, then block `L−1` down to block
# 0, and the embedding last (its matrix is also the output head, and its gradient is complete
# only when backward has gone all the way back to the token lookup).

# %%
overlapped = cluster.run(train_on_rank, "overlapped", steps=1)
order = overlapped[0]["ready_order"]
assert all(res["ready_order"] == order for res in overlapped), (
    "every rank must see the same order, or their collectives would not match"
)
assert len(order) == n_tensors, "one hook per parameter tensor"


def layer_of(name):
    """-1 for the embedding, 0..L-1 for the blocks, L for the final norm."""
    if name.startswith("blocks."):
        return int(name.split(".")[1])
    return -1 if name.startswith("embed") else CONFIG.layers


layers_in_firing_order = [layer_of(name) for name in order]
print("hook firing order on rank 0 (layer: parameters):")
for layer in dict.fromkeys(layers_in_firing_order):
    names = [n.split(".", 2)[-1] if n.startswith("blocks.") else n for n in order if layer_of(n) == layer]
    label = {-1: "embedding", CONFIG.layers: "final norm"}.get(layer, f"block {layer}")
    print(f"  {label:>10}: {', '.join(names)}")
assert layers_in_firing_order == sorted(layers_in_firing_order, reverse=True), (
    "gradients should become ready last layer first"
)
assert order[-1] == "embed.weight"

# %% [markdown]
# Overlap changes *when* the gradients are averaged, not *what* they are, so the weights must
# still match the single-process run:

# %%
overlapped = cluster.run(train_on_rank, "overlapped")
assert_replicas_identical(replicas(overlapped), "overlapped DP")
assert_same(overlapped[0]["params"], reference, "overlapped DP vs single process")
print("overlapped DP == single process")

# %% [markdown]
# ### Seeing the overlap: per-rank timelines
# With `record=True` every rank keeps a `Timeline`: forward, backward and the optimizer step in the
# compute lane, each all-reduce in the communication lane from its launch until gloo reports it
# done (a callback on the collective's future records the real completion time, not the time of
# the later `wait()`). The charts show the last of a few steps, on every rank, on one time axis.
#
# What to look for: in naive DP the communication lane stays empty until backward has finished,
# and then the compute lane stays empty until the all-reduces are done. In overlapped DP the
# first all-reduces start inside backward. (A communication bar runs from the launch of an
# all-reduce to its completion. Launched all-reduces queue up behind each other in the backend,
# so in overlapped DP their bars lie on top of one another.)

# %% tags=["nbval-ignore-output"]
runs = {
    kind: cluster.run(train_on_rank, kind, steps=TIMED_STEPS, record=True)
    for kind in ProgressBar("timing naive and overlapped DP").iterate(("naive", "overlapped"))
}
fig, axes = plt.subplots(2, 1, figsize=(10, 0.9 * 2 * WORLD_SIZE + 2.4))
plt.close(fig)
for ax, (kind, results) in zip(axes, runs.items()):
    plot_gantt([res["rows"] for res in results], ax=ax, title=f"{kind} DP, one step")
fig.tight_layout()
fig

# %% [markdown]
# Measured here, per rank: how long each lane was busy, and how much communication ran while
# compute was also running ("overlapped"). On a laptop the numbers depend on the machine and its
# load, so they are printed but not checked. Naive DP is timed a second time as the noise
# baseline: the same step against itself, which shows how far two runs differ with nothing changed.


# %% tags=["nbval-ignore-output"]
def median_step_ms(results):
    return 1e3 * statistics.median(s for res in results for s in res["step_seconds"][1:])


def summarize(kind, results):
    median_ms = median_step_ms(results)
    lanes = lane_summary([res["rows"] for res in results])
    compute = statistics.mean(v["compute"] for v in lanes.values())
    comm = statistics.mean(v["communication"] for v in lanes.values())
    hidden = statistics.mean(v["overlapped"] for v in lanes.values())
    print(
        f"{kind:>10}: step {median_ms:7.1f} ms | compute {compute:6.1f} ms, "
        f"communication {comm:6.1f} ms, of which overlapped with compute {hidden:6.1f} ms"
    )


def noise_baseline(again):
    ratio = median_step_ms(again) / median_step_ms(runs["naive"])
    print(
        f"{'again':>10}: step {median_step_ms(again):7.1f} ms | naive DP timed once more: {ratio:.2f}x "
        "its first run, how far noise alone moves these times"
    )


for kind, results in runs.items():
    summarize(kind, results)
again = cluster.run(train_on_rank, "naive", steps=TIMED_STEPS, record=True)  # the noise baseline
noise_baseline(again)

# %% [markdown]
# The one property that holds on any machine: overlapped DP launches its first all-reduce
# while backward is still running, naive DP only after backward has returned.


# %%
def first_launch_inside_backward(rows):
    backward = next(e for e in rows if e["name"] == "backward")
    first = min(e["start"] for e in rows if e["lane"] == "communication")
    return first < backward["end"]


for kind, results in runs.items():
    inside = [first_launch_inside_backward(res["rows"]) for res in results]
    print(f"{kind:>10}: first all-reduce launched during backward on every rank: {all(inside)}")
    assert all(inside) == (kind == "overlapped") and any(inside) == (kind == "overlapped")

# %% [markdown]
# **What the CPU can and cannot show.** On a GPU the all-reduce runs on its own CUDA stream and
# the network card moves the bytes, so the compute units keep working during communication. Here
# gloo's communication threads share two CPU cores with every rank's compute, so hiding
# communication behind compute buys little or nothing in wall time, and each small all-reduce
# pays several milliseconds of latency, mostly waiting for all the ranks to be scheduled. The
# charts do show the structure the book draws: last layer's gradients in flight while earlier
# layers are still in backward.
#
# <details><summary>The same idea in picotron</summary>
#
# picotron, the book's teaching codebase, has a naive DP class in
# [`picotron/data_parallel/data_parallel.py`](https://github.com/huggingface/picotron/blob/main/picotron/data_parallel/data_parallel.py)
# that hooks every parameter's gradient and all-reduces it from inside the hook, so on GPU the
# all-reduce is enqueued while backward continues; a `require_backward_grad_sync` flag switches
# it off for `no_sync`. Ours uses `register_post_accumulate_grad_hook` with `async_op=True`
# instead, and waits explicitly in `finish_gradient_synchronization()`.
# </details>

# %% [markdown]
# ## 3. Bucketing: a few big messages instead of many small ones
#
# Our model has dozens of parameter tensors (67 in QUICK mode), and many of them are tiny: a
# LayerNorm weight or a bias holds `hidden` floats, 256 bytes in QUICK mode. Every all-reduce costs a fixed start-up latency (`α` in the alpha-beta model of
# the collectives appendix) plus its bytes over the bandwidth, and a ring all-reduce pays the
# latency `2(N−1)` times. For small tensors the latency is nearly the whole cost.
#
# The remedy is to **bucket** the gradients: lay them out back to back in a few flat buffers, in
# the order backward produces them, i.e. reverse parameter order, closing a bucket as soon as it
# holds `bucket_cap_mb` MiB (PyTorch DDP's default is 25 MiB). That is DDP's rule: a bucket may
# pass the cap by its last tensor. Closing it *before* the cap would be passed makes more, smaller
# buckets, and each extra one pays the latency again. When the last gradient of a bucket is
# ready, the bucket is all-reduced in one call, still during backward. A collective needs one
# contiguous buffer anyway, which is why frameworks allocate these flat buffers up front.
#
# The buckets need not hold a *second* copy of the gradients. The first time a parameter's
# gradient is ready, `BucketedDataParallel` copies it into its slot in the bucket, once, and then
# makes `.grad` a view of that slot. (The copy also multiplies by `1/N`, so the bucket's sum is
# the mean without another pass over it; DDP's copy does the same.) As long as that `.grad` lives, backward accumulates straight
# into the bucket, and the all-reduce averages the gradients in the very place the optimizer
# reads them, with nothing to copy back. PyTorch's DDP does this only with
# `gradient_as_bucket_view=True`; by default it keeps `.grad` and its buckets apart, copying each
# gradient in before the all-reduce and the average back out after it, so it holds every
# gradient twice. (`optimizer.zero_grad()` sets `.grad` to `None` by default, which ends the
# view: the next step's backward creates a fresh gradient, which is copied in once more and then
# freed. With `zero_grad(set_to_none=False)` the view is zeroed in place and kept.) We measure
# this below, after the bucketed run.
#
# How our model's tensors land in buckets of `BUCKET_MB` MiB (each coloured run is one bucket,
# in launch order, from the output end of the model back to the embedding):


# %%
def bucket_layout(cap_mb):
    params = list(reversed(list(GPT(CONFIG).parameters())))
    return build_buckets(params, int(cap_mb * 2**20))


layout = bucket_layout(BUCKET_MB)
print(f"{n_tensors} gradient tensors -> {len(layout)} buckets, each closed once it holds {BUCKET_MB} MiB:")
for i, bucket in enumerate(layout):
    nbytes = sum(4 * p.numel() for p in bucket)
    print(f"  bucket {i}: {len(bucket):2d} tensor(s), {format_bytes(nbytes)}")
cap = BUCKET_MB * 2**20
assert all(sum(4 * p.numel() for p in b) >= cap for b in layout[:-1])  # full when closed (the last: what is left)
assert all(sum(4 * p.numel() for p in b[:-1]) < cap for b in layout)  # and closed by its last tensor

fig, ax = plt.subplots(figsize=(10, 1.6))
plt.close(fig)
left, colours = 0, plt.get_cmap("tab10").colors
for i, bucket in enumerate(layout):
    for p in bucket:
        ax.barh(0, 4 * p.numel() / 1024, left=left, color=colours[i % 10], edgecolor="white", linewidth=0.3)
        left += 4 * p.numel() / 1024
ax.set_yticks([])
ax.set_xlabel("KiB of gradients, in backward order (each small box is one parameter tensor)")
ax.set_title(f"shipping {n_tensors} tensors in {len(layout)} boxes: buckets closed at {BUCKET_MB} MiB")
fig.tight_layout()
fig

# %% [markdown]
# ### Counting the calls
# The course's `CommLogger` (chapter a0) intercepts every `torch.distributed` collective on a
# rank. One step of per-tensor DP should make one all-reduce per tensor; bucketed DP one per
# bucket. (The wrappers keep no count of their own: every collective in the course is counted
# by `CommLogger`, one way for every technique.)

# %%
calls = {
    kind: cluster.run(train_on_rank, kind, steps=1, log_comm=True)[0] for kind in ("naive", "overlapped", "bucketed")
}
for kind, res in calls.items():
    print(f"{kind:>10}: {res['all_reduce_calls'][0]:3d} all-reduce calls per step")
assert calls["naive"]["all_reduce_calls"][0] == calls["overlapped"]["all_reduce_calls"][0] == n_tensors
assert calls["bucketed"]["all_reduce_calls"][0] == len(layout) < n_tensors
assert calls["bucketed"]["bucket_sizes"] == [sum(4 * p.numel() for p in b) for b in layout]

# %% [markdown]
# ### What a call costs
# A direct measurement on the cluster: all-reduce the model's gradient tensors one call per tensor,
# then copy them into one flat buffer and all-reduce that once. Same bytes, different number of
# calls.


# %% tags=["nbval-ignore-output"]
def time_per_tensor_vs_flat(ctx, repeats):
    torch.manual_seed(SEED)
    grads = [torch.randn_like(p).to(ctx.device) for p in GPT(CONFIG).parameters()]

    def per_tensor():
        for w in [dist.all_reduce(g, async_op=True) for g in grads]:
            w.wait()

    def flat():
        dist.all_reduce(torch.cat([g.flatten() for g in grads]))

    timings = {}
    for name, fn in (
        ("one call per tensor", per_tensor),
        ("one flat buffer", flat),
        ("one flat buffer, again", flat),
    ):  # the noise baseline: the same call timed twice
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            wait_for_device(ctx.device)
            seconds.append(time.perf_counter() - start)
        timings[name] = statistics.median(seconds)
    return timings


timings = cluster.run(time_per_tensor_vs_flat, 5 if QUICK else 20)[0]
for name, seconds in timings.items():
    print(f"{name:>20}: {1e3 * seconds:8.2f} ms")
print(
    f"{n_tensors} calls cost {timings['one call per tensor'] / timings['one flat buffer']:.0f}x "
    f"as much as one call with the same bytes; the flat call against itself: "
    f"{timings['one flat buffer, again'] / timings['one flat buffer']:.2f}x (the noise)"
)

# %% [markdown]
# And inside training: the bucketed version on the same timeline as before, and the step times of
# the three versions side by side.

# %% tags=["nbval-ignore-output"]
runs["bucketed"] = cluster.run(train_on_rank, "bucketed", steps=TIMED_STEPS, record=True)
plot_gantt(
    [res["rows"] for res in runs["bucketed"]],
    title=f"bucketed DP ({len(layout)} buckets closed at {BUCKET_MB} MiB), one step",
)

# %% tags=["nbval-ignore-output"]
for kind, results in runs.items():
    summarize(kind, results)
noise_baseline(again)

# %% [markdown]
# Bucketing, like overlap, must not change the result:

# %%
bucketed = cluster.run(train_on_rank, "bucketed")
assert_replicas_identical(replicas(bucketed), "bucketed DP")
assert_same(bucketed[0]["params"], reference, "bucketed DP vs single process")
print("bucketed DP == single process")

# %% [markdown]
# ### One copy of the gradients, not two
# Where do the gradients live after the all-reduce, when `optimizer.step()` reads them? On every
# rank and after every step, a check compares the storage of each `.grad` with the storage of the
# bucket buffers, and adds up the gradient memory: the bucket buffers plus any `.grad` outside
# them, relative to the bytes of the parameters. Ours reads its buckets directly; for DDP a
# communication hook records the buffer of each bucket it is handed (`bucket.buffer()`), once
# with DDP's default and once with `gradient_as_bucket_view=True`.


# %%
def averaging_hook(ctx, watch):
    """A DDP communication hook that does the default hook's job (average the bucket over the
    ranks) after handing the bucket to ``watch``: how we look inside DDP here and in section 5."""

    def hook(state, bucket):
        watch(bucket)
        work = dist.all_reduce(bucket.buffer().div_(ctx.world_size), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


def where_gradients_live(ctx, kind, steps=2):
    torch.manual_seed(SEED)
    model = GPT(CONFIG).to(ctx.device)
    buckets = {}  # storage address -> bytes, for every bucket buffer of this step

    def record(buffer):
        buckets[buffer.untyped_storage().data_ptr()] = buffer.untyped_storage().nbytes()

    if kind == "ours":
        dp = BucketedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    else:  # DDP has averaged the gradients by the time backward returns
        dp = torch_ddp(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=kind.endswith("True"))
        dp.register_comm_hook(None, averaging_hook(ctx, lambda bucket: record(bucket.buffer())))
    checks = []

    def check():  # runs after each step's backward, just before optimizer.step()
        if kind == "ours":
            dp.finish_gradient_synchronization()
            for bucket in dp.buckets:
                record(bucket.buffer)
        grads = [p.grad for p in model.parameters()]
        outside = sum(g.nbytes for g in grads if g.untyped_storage().data_ptr() not in buckets)
        param_bytes = sum(p.nbytes for p in model.parameters())
        checks.append((outside == 0, (sum(buckets.values()) + outside) / param_bytes))
        buckets.clear()

    train(
        model,
        DATA.rank_stream(ctx.rank, ctx.world_size),
        steps,
        make_optimizer(model.parameters(), "sgd", lr=LR),
        module=dp,
        after_backward=check,
        device=ctx.device,
    )
    return checks


print("after the all-reduce, on every rank and every step:")
for kind, copies in (("ours", 1), ("DDP, gradient_as_bucket_view=False", 2), ("DDP, gradient_as_bucket_view=True", 1)):
    checks = [c for rank_checks in cluster.run(where_gradients_live, kind) for c in rank_checks]
    views, ratio = all(v for v, _ in checks), max(r for _, r in checks)
    print(f"  {kind:>34}: every .grad inside a bucket: {views!s:5}  gradient memory = {ratio:.2f}x the parameter bytes")
    assert all(v == (copies == 1) and r == copies for v, r in checks)

# %% [markdown]
# ### How big should a bucket be?
# Too small and we are back to many latency-bound calls; too large and the first all-reduce starts
# late in backward (a bucket is sent only when *all* its gradients are ready), and with a single
# bucket nothing overlaps at all. A small sweep of `bucket_cap_mb`, from one tensor per bucket to
# one bucket for the whole model. The counts are exact; the times are this machine's.

# %%
CAPS_MB = [0.01, 0.05, 0.25, 1.0, 25.0]
bucket_counts = [len(bucket_layout(cap)) for cap in CAPS_MB]
for cap, count in zip(CAPS_MB, bucket_counts):
    print(f"bucket_cap_mb={cap:<5}: {count:2d} bucket{'s' if count > 1 else ''}")
assert bucket_counts == sorted(bucket_counts, reverse=True) and bucket_counts[-1] == 1

# %% tags=["nbval-ignore-output"]
sweep_ms = []
for cap in ProgressBar("bucket size sweep").iterate(CAPS_MB):
    results = cluster.run(train_on_rank, "bucketed", steps=TIMED_STEPS, bucket_cap_mb=cap)
    sweep_ms.append(median_step_ms(results))
# the noise baseline: the first cap timed once more, beside its first point
again_ms = median_step_ms(cluster.run(train_on_rank, "bucketed", steps=TIMED_STEPS, bucket_cap_mb=CAPS_MB[0]))
per_tensor_ms = median_step_ms(runs["overlapped"])
fig, ax = plt.subplots(figsize=(6, 3.2))
plt.close(fig)
ax.plot(CAPS_MB, sweep_ms, marker="o", label="bucketed DP")
ax.plot(
    [CAPS_MB[0]],
    [again_ms],
    marker="o",
    mfc="none",
    ls="none",
    color="C0",
    label=f"the first cap timed again ({again_ms / sweep_ms[0]:.2f}x): the noise",
)
ax.axhline(per_tensor_ms, color="grey", ls="--", label=f"one all-reduce per tensor ({n_tensors} calls)")
for cap, ms, count in zip(CAPS_MB, sweep_ms, bucket_counts):
    ax.annotate(f"{count}", (cap, ms), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
ax.set_xscale("log")
ax.set_xlabel("bucket_cap_mb (MiB); labels: number of buckets")
ax.set_ylabel("median step time (ms)")
ax.set_title(f"bucket size sweep, {WORLD_SIZE} gloo ranks on this CPU")
ax.legend(fontsize=8)
fig.tight_layout()
fig

# %% [markdown]
# <details><summary>The same idea in picotron</summary>
#
# picotron's `DataParallelBucket` (same file, with a `BucketManager` in
# [`picotron/data_parallel/bucket.py`](https://github.com/huggingface/picotron/blob/main/picotron/data_parallel/bucket.py))
# keeps one flat gradient buffer per bucket, hooks each parameter's gradient accumulator, marks
# parameters ready and launches a bucket's async all-reduce once all its parameters are ready; a
# callback queued on the autograd engine waits for the buckets at the end of backward, much as
# DDP does. Ours waits in `finish_gradient_synchronization()`, which keeps the order of events
# visible in the training loop.
# </details>

# %% [markdown]
# ## 4. Gradient accumulation without needless synchronisation: `no_sync`
#
# With gradient accumulation each rank runs `grad_acc` micro-batches before one optimizer step.
# Averaging after *every* micro-batch is correct (averaging is linear, so the running sums stay
# right) but wasteful: only the final sum is used. Inside `with dp.no_sync():` the hooks do nothing
# and the gradients just accumulate locally in `.grad`; the last micro-batch runs outside it and
# its backward reduces the accumulated gradients once. The global batch is now
# `MBS × GRAD_ACC × WORLD_SIZE` samples, and the reference accumulates the same micro-steps in a
# single process.

# %%
reference_acc = train_single_process(grad_acc=GRAD_ACC)
with_no_sync = cluster.run(train_on_rank, "bucketed", grad_acc=GRAD_ACC, use_no_sync=True, log_comm=True)
every_micro = cluster.run(train_on_rank, "bucketed", grad_acc=GRAD_ACC, use_no_sync=False, log_comm=True)
for name, results in (("no_sync", with_no_sync), ("sync every micro-batch", every_micro)):
    assert_replicas_identical(replicas(results), name)
    assert_same(results[0]["params"], reference_acc, f"{name} vs single process")

syncs_saved = (every_micro[0]["num_syncs"] - with_no_sync[0]["num_syncs"]) / STEPS
calls_saved = (sum(every_micro[0]["all_reduce_calls"]) - sum(with_no_sync[0]["all_reduce_calls"])) / STEPS
print(f"grad_acc = {GRAD_ACC}, {len(layout)} buckets, per optimizer step:")
for name, res in (("sync every micro-batch", every_micro[0]), ("no_sync", with_no_sync[0])):
    print(
        f"  {name:>22}: {res['num_syncs'] // STEPS} gradient synchronisation(s), "
        f"{res['all_reduce_calls'][0]:2d} all-reduce calls"
    )
print(f"  no_sync saves {syncs_saved:.0f} synchronisations = {calls_saved:.0f} all-reduce calls per step")
assert with_no_sync[0]["num_syncs"] == STEPS and every_micro[0]["num_syncs"] == STEPS * GRAD_ACC
assert syncs_saved == GRAD_ACC - 1
assert with_no_sync[0]["all_reduce_calls"] == [len(layout)] * STEPS
assert calls_saved == (GRAD_ACC - 1) * len(layout)

# %% [markdown]
# PyTorch's DDP offers the same context manager,
# [`DistributedDataParallel.no_sync()`](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync).
#
# ## 5. Checking against PyTorch's `DistributedDataParallel`
#
# DDP is the production version of everything above: it buckets gradients (`bucket_cap_mb`),
# launches each bucket's all-reduce from autograd hooks during backward, waits for them before
# backward returns, and skips communication inside `no_sync()`. Train it and our bucketed DP with
# the same cap, the same accumulation and the same data, and compare the weights. We also count
# DDP's buckets, with a communication hook that forwards each bucket to a normal all-reduce.
#
# DDP also does more than ours. Its reducer is C++ (`torch/csrc/distributed/c10d/reducer.cpp`)
# and waits for the buckets from a callback queued on the autograd engine, so no call like
# `finish_gradient_synchronization()` is needed. After the first iteration it rebuilds its
# buckets once, in the order the gradients actually arrived, where ours assumes reverse
# registration order. `find_unused_parameters=True` walks the autograd graph after every forward
# and marks the parameters that will get no gradient as ready, so their buckets still go out
# during backward (ours fills in zeros for them only when it finishes). `static_graph=True`
# promises the same graph every iteration, which lets DDP support reentrant backward and
# checkpointing a module more than once. And it can broadcast buffers (e.g. BatchNorm statistics)
# at every forward, let ranks with uneven amounts of data finish together (`join()`), and run
# other communication hooks, such as fp16 compression of the buckets.


# %%
def train_ddp_counting_buckets(ctx, steps, grad_acc, bucket_cap_mb):
    torch.manual_seed(SEED + ctx.rank)
    model = GPT(CONFIG).to(ctx.device)
    ddp = torch_ddp(model, bucket_cap_mb=bucket_cap_mb)
    buckets_per_step, seen = [], []
    ddp.register_comm_hook(None, averaging_hook(ctx, lambda bucket: seen.append(bucket.index())))  # a tally
    opt = make_optimizer(model.parameters(), "sgd", lr=LR)
    for step in range(steps):
        seen.clear()
        params = train(
            model,
            DATA.rank_stream(ctx.rank, ctx.world_size),
            1,
            opt,
            grad_acc=grad_acc,
            module=ddp,
            no_sync=ddp.no_sync,
            device=ctx.device,
            first_step=step,
        )
        buckets_per_step.append(len(seen))
    return {"params": params, "buckets_per_step": buckets_per_step}


ddp_acc = cluster.run(train_ddp_counting_buckets, STEPS, GRAD_ACC, BUCKET_MB)
assert_replicas_identical(replicas(ddp_acc), "DDP")
assert_same(with_no_sync[0]["params"], ddp_acc[0]["params"], "our bucketed DP vs DDP")
assert_same(ddp_acc[0]["params"], reference_acc, "DDP vs single process")
print(f"bucket_cap_mb={BUCKET_MB}, grad_acc={GRAD_ACC} with no_sync: ours == DDP == single process")
print(f"all-reduce calls per step: ours {with_no_sync[0]['all_reduce_calls']}, DDP {ddp_acc[0]['buckets_per_step']}")
assert with_no_sync[0]["all_reduce_calls"][1:] == ddp_acc[0]["buckets_per_step"][1:]  # after DDP's rebuild

# %% [markdown]
# The counts differ only in the first step, and DDP's source says why: in its first iteration
# DDP does not yet know in which order the gradients will arrive, so it puts them all in one
# bucket; after that iteration it rebuilds the buckets in the order it observed. From then on it
# makes as many buckets as ours, since both close a bucket once it has *reached* the cap. (Closing
# a bucket before it would *exceed* the cap, the other natural rule, makes one bucket more than DDP
# on the benchmark model, and one more all-reduce launch per step.) The averaged gradients are the
# same either way.
#
# ### What ours pays that DDP does not: Python in every hook
# One cost of ours remains that DDP does not share: where the bookkeeping runs. Our hook is
# Python. For every parameter in every backward, the autograd engine takes the interpreter's lock
# and calls `_on_grad_ready`, which records the order, copies and scales the gradient into its
# slot, and launches the next bucket if it is full. Its parameter's name, bucket and slot are
# bound when the hook is registered, so that it looks nothing up by tensor. DDP's reducer does the
# same work in C++. A subclass with a stopwatch around the hook shows what the Python costs here.
# The all-reduce launches the hooks make are counted inside it.


# %% tags=["nbval-ignore-output"]
class TimedHooks(BucketedDataParallel):
    """Our bucketed DP, with a stopwatch on every gradient hook and on every all-reduce launch
    the hooks make. It reads this thread's CPU time, not the wall clock: with more ranks than
    cores a rank is often descheduled, and that wait is not what a hook costs."""

    def _on_grad_ready(self, *args):
        start = time.thread_time()
        super()._on_grad_ready(*args)
        self.hook_times.append(time.thread_time() - start)

    def _launch(self, bucket):
        start = time.thread_time()
        super()._launch(bucket)
        self.launch_times.append(time.thread_time() - start)


def hook_cost(ctx, steps=6):
    torch.manual_seed(SEED)
    dp = TimedHooks(GPT(CONFIG).to(ctx.device), bucket_cap_mb=BUCKET_MB)
    opt = make_optimizer(dp.module.parameters(), "sgd", lr=LR)
    per_step = []  # CPU seconds: (hooks without their launches, launches, the whole step), hook calls
    for step in range(steps):
        dp.hook_times, dp.launch_times = [], []
        start = time.thread_time()
        DATA.rank_batch(ctx.rank, ctx.world_size, step).to(ctx.device).loss(dp).backward()
        dp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        launches = sum(dp.launch_times)
        per_step.append((sum(dp.hook_times) - launches, launches, time.thread_time() - start, len(dp.hook_times)))
    return per_step[1:]  # the first step also allocates the buckets' first gradients


costs = [row for rank_steps in cluster.run(hook_cost) for row in rank_steps]
assert all(calls == n_tensors for *_, calls in costs), "one hook call per parameter tensor"
own, launch, step = (statistics.median(row[i] for row in costs) for i in range(3))
print(f"{n_tensors} hook calls per backward, median over ranks and steps, in CPU time of the rank's thread:")
print(
    f"  the hooks' own work (the bookkeeping, and each gradient's scaled copy into its slot): "
    f"{1e3 * own:.2f} ms ({1e6 * own / n_tensors:.0f} us a call), "
    f"{100 * own / step:.1f}% of the step's {1e3 * step:.0f} ms"
)
print(f"  launching {len(layout)} all-reduces from them: {1e3 * launch:.2f} ms (DDP launches the same)")

# %% [markdown]
# How much does it cost in the whole step? The course's benchmark (`python
# benchmarks/bench_dp_zero.py`: 4 ranks on a 2-core machine, a 0.9M-parameter model, 1 MiB
# buckets) times our step against DDP's; over repeated runs the ratio lands within several percent
# of 1 on either side, and the range the benchmark prints for its own repeats holds 1.00, so the
# two cannot be told apart there. With 2 ranks, one per core, ours comes out a percent or two
# slower: the price of running in Python what DDP's reducer runs in C++. (Not all of the hook time
# above is that price: DDP copies and scales each gradient into its bucket too, and by default
# copies it back out.) Our version buys code you can read in one screen with it. Three details keep
# the hook cheap: each hook knows its bucket and slot from the start instead of looking them up by
# tensor, the division by the world size happens in the copy into the slot, not in a second pass,
# and 1/N is a tensor made once, not a Python float that becomes a new tensor at every multiply.
#
# ## 6. The batch-size recipe, and where DP stops scaling
#
# With data parallelism the global batch size (in samples) has three factors:
#
# $$\text{gbs} = \text{mbs} \times \text{grad\_acc} \times \text{dp}$$
#
# and in tokens, times the sequence length. The book's recipe fixes them in this order:
#
# 1. the **global batch size in tokens** (GBST), from the literature or from experiments;
# 2. the **sequence length**: 2k to 8k tokens works reliably (DeepSeek and Llama pre-train at
#    4k, and the book points to a blog post by Harm de Vries for why this range is enough); this
#    turns tokens into samples;
# 3. the **largest mbs that fits** in one GPU's memory;
# 4. the number of GPUs gives **dp**, and whatever is left becomes **grad_acc** = gbs / (mbs·dp).
#
# The worked example: 4M tokens per batch at a sequence length of 4k is 976.6 samples, which
# rounds to the power of two 1024 (exactly 1024 if "4M" means 4·2²⁰). With mbs = 2 on 128 GPUs,
# that leaves grad_acc = 4; on 512 GPUs grad_acc = 1, the same batch in a quarter of the
# sequential micro-steps, so each step is faster.

# %%
assert samples_per_step(4e6, 4096) == 1024 and samples_per_step(4 * 2**20, 4096) == 1024
assert global_batch_size(mbs=2, grad_acc=4, dp=128) == 1024
print(f"4M tokens / 4096 = {4e6 / 4096:.1f} samples -> nearest power of two: {samples_per_step(4e6, 4096)}")
for dp in (128, 256, 512):
    plan = plan_batch(4e6, 4096, mbs=2, dp=dp)
    print(f"  dp={dp:<4} {plan}")
assert plan_batch(4e6, 4096, mbs=2, dp=128).grad_acc == 4
assert plan_batch(4e6, 4096, mbs=2, dp=512).grad_acc == 1
assert plan_batch(4e6, 4096, mbs=2, dp=512).tokens_per_step == 1024 * 4096

# %% [markdown]
# With even more GPUs, mbs × dp alone exceeds the target: grad_acc would have to be below 1. The
# book calls this being **GPU-rich**; the ways out are to leave some GPUs idle (or give them to
# another kind of parallelism), to accept a larger global batch, or to lower the micro-batch size.

# %%
rich = plan_batch(4e6, 4096, mbs=2, dp=1024)
print(rich)
assert rich.gpu_rich and rich.grad_acc == 0 and len(rich.options) == 3
assert plan_batch(4e6, 4096, mbs=1, dp=1024).grad_acc == 1  # lowering mbs is one way out

# %% [markdown]
# ### What one replica must hold
# Every DP rank keeps the *whole* model. The book's rule of thumb for the weights alone in BF16 is
# two bytes per parameter; its example says a 70B model needs 140 GB "(=133GiB)". We quote that
# figure as printed: 140·10⁹ bytes is 130.4 GiB (1 GiB = 2³⁰ bytes), so the parenthesis does not
# follow from the 140 GB; either way it is more than one 80 GB GPU holds, before gradients,
# optimizer states or activations.

# %%
weights_bytes = 2 * 70e9
print(
    f"70B parameters x 2 bytes = {weights_bytes / GB:.0f} GB = {weights_bytes / GiB:.1f} GiB (the book prints 133 GiB)"
)

# %% [markdown]
# Data parallelism divides the *batch*, never the model: memory per GPU stays the same however
# many replicas there are. Adding recomputation (chapter 01) shrinks the activations, but the
# model states alone (16 bytes per parameter with BF16 mixed precision and Adam) already exceed an
# 80 GB GPU from about 5B parameters:

# %%
presets = {"Llama 3 8B": LLAMA3_8B, "Llama 3 70B": LLAMA3_70B, "Llama 3 405B": LLAMA3_405B}
memory = {name: breakdown(cfg, seq=4096, micro_batch=1, recompute="full") for name, cfg in presets.items()}
for name, parts in memory.items():
    assert breakdown(presets[name], seq=4096, recompute="full", dp=512) == parts  # DP does not help
    print(f"{name:>13}: {sum(parts.values()) / GB:8.0f} GB per GPU with full recomputation, at any dp")
fig, axes = plt.subplots(1, len(memory), figsize=(10, 3.2))
plt.close(fig)
for ax, (name, parts) in zip(axes, memory.items()):
    ax.bar(list(parts), [v / GB for v in parts.values()], color=["#4c72b0", "#55a868", "#8172b2", "#dd8452"])
    ax.axhline(80, color="black", ls="--", lw=1, label="80 GB: one H100")
    ax.set_title(f"{name}: {sum(parts.values()) / GB:.0f} GB in all")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
axes[0].set_ylabel("GB per GPU")
axes[0].legend(fontsize=8)
fig.suptitle("one replica (seq 4096, mbs 1, full recomputation), the same at any DP degree")
fig.tight_layout()
fig

# %% [markdown]
# ### Where DP stops scaling
# More replicas also make the all-reduce itself harder to hide. A ring all-reduce of `K` bytes
# over `N` ranks costs `2(N−1)·(α + K/(N·β))`: the bandwidth part tends to `2K/β` and stops
# growing, but the latency part, `2(N−1)·α` per call, grows with every rank added. Per GPU the
# backward pass does not get longer (each rank still runs its own micro-batch), so there is a
# DP degree beyond which the all-reduce no longer fits behind backward and every further GPU
# adds waiting time. The book reports this past about 512 GPUs, where ring latency dominates
# and the overlap breaks down.
#
# The plot below is **a model, not a measurement**: the alpha-beta formula with assumed constants
# (α = 5 µs per ring step, β = 50 GB/s per GPU, 2 GB of BF16 gradients, i.e. about 1B
# parameters, in 25 MiB buckets, and 0.4 s of backward per step that the all-reduces can hide
# behind). Other constants move the knee; none remove it, because the latency term grows
# without bound while the time available to hide it stays fixed.

# %%
link = AlphaBeta(alpha=5e-6, beta=50e9)
grad_bytes, bucket_bytes = 2e9, 25 * 2**20
forward_s, backward_s = 0.2, 0.4
dps = 2 ** np.arange(1, 14)
n_buckets = int(np.ceil(grad_bytes / bucket_bytes))
comm_s = np.array([n_buckets * link.ring_all_reduce_time(bucket_bytes, n) for n in dps])
exposed_s = np.maximum(comm_s - backward_s, 0)  # what the overlap cannot hide
step_s = forward_s + backward_s + exposed_s
relative_throughput = (forward_s + backward_s) / step_s  # per GPU, 1.0 = perfect scaling
knee = dps[np.argmax(exposed_s > 0)]
print(
    f"communication per step: {comm_s[0]:.2f} s at dp=2, {comm_s[-1]:.2f} s at dp={dps[-1]}; "
    f"it no longer hides behind backward from dp={knee}"
)
assert np.all(np.diff(comm_s) > 0) and relative_throughput[0] == 1 and relative_throughput[-1] < 0.5

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
plt.close(fig)
ax1.plot(dps, relative_throughput, marker="o")
ax1.axvline(512, color="grey", ls=":", lw=1)
ax1.set_xscale("log", base=2)
ax1.set_xlabel("DP degree (GPUs)")
ax1.set_ylabel("throughput per GPU (1 = no loss)")
ax1.set_title("modelled: all-reduce latency outgrows backward")
mem_per_gpu = [sum(breakdown(LLAMA3_8B, seq=4096, recompute="full", dp=int(n)).values()) / GB for n in dps]
ax2.plot(dps, mem_per_gpu, marker="o", color="#c44e52")
ax2.set_xscale("log", base=2)
ax2.axhline(80, color="black", ls="--", lw=1)
ax2.text(dps[0], 80, "80 GB: one H100", va="bottom", fontsize=8)
ax2.set_ylim(0, 1.2 * max(mem_per_gpu))
ax2.set_xlabel("DP degree (GPUs)")
ax2.set_ylabel("GB per GPU")
ax2.set_title("Llama 3 8B: memory per GPU does not fall")
fig.tight_layout()
fig

# %% [markdown]
# ### Beyond data parallelism
# So DP has two limits: communication that eventually cannot be hidden, and a model that must fit
# whole on every GPU. Both lead to splitting the model itself, and there are two families of
# ways to do that, which can be combined:
#
# * **sharding** (ZeRO, FSDP): every rank still computes the whole model on its own data, but the
#   parameters, gradients and optimizer states are partitioned across the DP ranks and gathered
#   only when needed. That is chapter 03;
# * **parallelism** of the computation itself: tensor parallelism splits each layer's matrices
#   (chapters 04-05), context parallelism splits the sequence (06), pipeline parallelism splits
#   the stack of layers (07).
#
# A third, orthogonal option is to **offload** states to CPU memory and bring them back when
# they are needed, trading memory for transfer time.
#
# ## Your turn
# Open [exercises/02_data_parallelism_exercises.ipynb](../exercises/02_data_parallelism_exercises.ipynb): write the gradient hooks that overlap
# all-reduces with backward, a bucket manager, and the batch-size recipe, each graded by parity
# with a single-process reference or the library on clusters of 2 and 3 ranks.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/02_data_parallelism_exercises.ipynb` grades
# the whole notebook from a terminal.

# %%
cluster.close()
