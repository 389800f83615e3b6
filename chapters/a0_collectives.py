# %% [markdown]
# # A0 · A crash course in collectives
#
# Every technique in this course ends up as a handful of **collective operations**: calls that
# every rank of a process group makes together, and that move or combine tensors between them.
# Data parallelism averages gradients with an all-reduce, ZeRO shards them with a
# reduce-scatter and rebuilds weights with an all-gather, tensor parallelism gathers activations,
# and so on. This appendix of the book is a tour of those operations; here we run each of them
# on real ranks and look at what every rank holds before and after.
#
# In this notebook you will
# 1. call broadcast, reduce, all-reduce, gather, all-gather, scatter, reduce-scatter and barrier
#    through `torch.distributed`, reproduce the book's example outputs and check them,
# 2. build the **ring all-reduce** out of nothing but sends and receives (a reduce-scatter
#    followed by an all-gather), watch its steps, and count the bytes it moves,
# 3. time it against gloo's own all-reduce, measure **bus bandwidth** the way nccl-tests does
#    and fit the **alpha-beta** cost model,
# 4. build **recursive doubling**, which needs `log2 N` steps instead of `2(N-1)`, find where it
#    and the ring cross, and pick between them by size as NCCL does,
# 5. see when to pick NCCL, gloo or MPI.
#
# The book runs its snippets with `torchrun --nproc_per_node=3` on three GPUs with NCCL. We use
# the course's persistent ranks instead, with the gloo backend and CPU tensors on any machine, and
# the same function names (`example_broadcast`, `example_reduce`, ...) so you can compare. When
# the machine has a GPU for every rank, section 6 runs the same functions with NCCL.

# %% tags=["parameters"]
WORLD_SIZE = 3  # number of ranks; the book's examples use 3, anything from 2 to about 8 works
QUICK = True  # True: small sizes, short sleeps, about 20 s on 2 CPU cores; False: larger sizes, 1 s sleeps, more repeats (longer)
SEED = 0

# %%
# %matplotlib inline
from ultrascale.runtime import Cluster, resolve_backend  # first: the ranks' fork server loads torch meanwhile
import math
import time

import numpy as np
import torch
import torch.distributed as dist
from matplotlib.figure import Figure

import ultrascale.comm.halving_doubling as halving_module
import ultrascale.comm.recursive as recursive_module
import ultrascale.comm.ring as ring_module
from ultrascale.checks import nonempty
from ultrascale.comm import (
    AlphaBeta,
    CommLogger,
    bus_bandwidth_sweep,
    bus_factor,
    chunk_sizes,
    fit_ring_all_reduce,
    format_bytes,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    time_collective,
)
from ultrascale.comm.halving_doubling import (
    halving_doubling_all_reduce,
    halving_doubling_bytes,
    halving_doubling_steps,
    halving_doubling_time,
)
from ultrascale.comm.recursive import (
    all_reduce_contenders,
    choose_algorithm,
    crossover_bytes,
    doubling_steps,
    doubling_time,
    fit_on_the_spot,
    race_all_reduces,
    recursive_doubling_all_reduce,
)
from ultrascale.viz.collectives import collective_figure, contributors, ring_steps_figure
from ultrascale.viz.live import LivePlot

torch.manual_seed(SEED)
assert WORLD_SIZE >= 2, "collectives need at least two ranks: use WORLD_SIZE >= 2"
N = WORLD_SIZE
# torch 2.13 added *_single and deprecated all_gather_into_tensor / reduce_scatter_tensor, the names 2.11-2.12
# still need (they have no *_single): use the new names where they exist.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# %% [markdown]
# ## 0. Joining a process group
# In the book, each process starts with a small `init_process()` that calls
# `dist.init_process_group(backend="nccl")` and then `torch.cuda.set_device(dist.get_rank())`, so
# that rank `r` uses GPU `r`. `torchrun` provides the rank, the world size and the address of a
# rendezvous through environment variables, and `init_process_group` reads them. (The book's prose
# spells the call `dist.initi_process_group` in one place: a typo; the function is
# `init_process_group`.)
#
# `Cluster(n)` does the same for us, once, in `n` worker processes: each one calls
# `init_process_group` (here with `backend="gloo"`, so the results below are the same on every
# machine) and keeps its process group alive between cells. The functions we hand to
# `cluster.run` take the rank's context `ctx` first and run on every rank at once.

# %%
cluster = Cluster(WORLD_SIZE, backend="gloo")


def whoami(ctx):
    return dist.is_initialized(), dist.get_backend(), dist.get_rank(), dist.get_world_size(), str(ctx.device)


for info in cluster.run(whoami):
    print("initialized={}, backend={}, rank {} of {}, device {}".format(*info))
assert [info[2] for info in cluster.run(whoami)] == list(range(N))

# %% [markdown]
# A few helpers for the rest of the notebook: `to_cpu` brings results home from a GPU rank, and
# `show` prints what every rank held before and after a collective. The pictures come from
# `ultrascale.viz.collectives.collective_figure`, which draws the **real tensors** the ranks
# returned: one row per buffer, one column per element.


# %%
def to_cpu(x):
    """Tensors (also inside lists and dicts) moved to the CPU, for the notebook."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    return x


def describe(state):
    if isinstance(state, torch.Tensor):
        return str(state.tolist())
    if isinstance(state, dict):
        return ", ".join(f"{k}={describe(v)}" for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in state) + "]"
    return str(state)


def show(results):
    """Print each rank's (before, after) pair; return the two lists."""
    before, after = [list(x) for x in zip(*results)]
    for rank, (b, a) in enumerate(zip(before, after)):
        print(f"rank {rank}: before {describe(b)}\n        after  {describe(a)}")
    return before, after


# %% [markdown]
# ## 1. The collectives, one by one
# ### Broadcast
# One rank (the **root** or source) holds a tensor; afterwards every rank holds a copy. This is
# how the same initial weights reach every data-parallel replica. Every rank must pass a tensor
# of the right shape and dtype: on the other ranks it is the buffer the data lands in.


# %%
def example_broadcast(ctx):
    if ctx.rank == 0:
        tensor = torch.tensor([1, 2, 3, 4, 5], dtype=torch.float32, device=ctx.device)
    else:
        tensor = torch.zeros(5, dtype=torch.float32, device=ctx.device)
    before = tensor.clone()
    dist.broadcast(tensor, src=0)
    return to_cpu(before), to_cpu(tensor)


before, after = show(cluster.run(example_broadcast))
assert all(a.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] for a in after)
assert all(b.tolist() == [0.0] * 5 for b in before[1:])
collective_figure(before, after, "broadcast from rank 0")

# %% [markdown]
# The book's snippet defines `example_broadcast` and then calls `example_broadcats()`: another
# typo; the function it means is `example_broadcast`.
#
# ### Reduce
# Every rank contributes a tensor; the element-wise reduction (here the sum) arrives at one
# rank, the destination. The book starts from `[r+1]*5` on rank `r`, so rank 0 receives
# `1 + 2 + ... + N = N(N+1)/2` in every element. (The book's version prints a variable `rank` it
# never defined; ours takes it from `ctx`.)


# %%
def example_reduce(ctx):
    rank = ctx.rank
    tensor = torch.full((5,), float(rank + 1), device=ctx.device)
    before = tensor.clone()
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    return to_cpu(before), to_cpu(tensor)


before, after = show(cluster.run(example_reduce))
total = N * (N + 1) / 2
assert after[0].tolist() == [total] * 5
assert [b.tolist() for b in before] == [[r + 1.0] * 5 for r in range(N)]
collective_figure(
    before, [{"tensor": after[0]}] + [{"tensor (not defined)": a} for a in after[1:]], "reduce (sum) to rank 0"
)

# %% [markdown]
# Look at the other ranks. In the book's NCCL run, ranks 1 and 2 still hold `[2.]*5` and
# `[3.]*5` afterwards. With gloo they hold partial sums: gloo uses their tensors as scratch space
# while it passes the data along. Both are correct, because `torch.distributed` promises a
# result only on the destination rank; what the others are left with belongs to the backend.
# If a rank needs its input after a `reduce`, it passes a copy.
#
# ### All-reduce
# The same reduction, but every rank receives the result. It is the workhorse of data
# parallelism (gradients are all-reduced in every step) and of tensor parallelism.


# %%
def example_all_reduce(ctx):
    tensor = torch.full((5,), float(ctx.rank + 1), device=ctx.device)
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return to_cpu(before), to_cpu(tensor)


before, after = show(cluster.run(example_all_reduce))
assert all(a.tolist() == [total] * 5 for a in after)
collective_figure(before, after, "all-reduce (sum)")

# %% [markdown]
# ### Gather and all-gather
# Gather collects every rank's tensor, in rank order, into a list on one rank; all-gather gives
# that list to every rank. Nothing is combined: each value arrives unchanged. Only the
# destination of `gather` passes a `gather_list` (the others pass `None`), whereas `all_gather`
# needs an output list on every rank.


# %%
def example_gather(ctx):
    tensor = torch.full((5,), float(ctx.rank + 1), device=ctx.device)
    gather_list = [torch.zeros(5, device=ctx.device) for _ in range(ctx.world_size)] if ctx.rank == 0 else None
    dist.gather(tensor, gather_list, dst=0)
    return to_cpu({"tensor": tensor}), to_cpu({"tensor": tensor, "gather_list": gather_list})


before, after = show(cluster.run(example_gather))
expected_list = [[r + 1.0] * 5 for r in range(N)]
assert [t.tolist() for t in after[0]["gather_list"]] == expected_list
assert all(a["gather_list"] is None for a in after[1:])
collective_figure(before, after, "gather to rank 0")


# %%
def example_all_gather(ctx):
    tensor = torch.full((5,), float(ctx.rank + 1), device=ctx.device)
    gather_list = [torch.zeros(5, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(gather_list, tensor)
    return to_cpu({"tensor": tensor}), to_cpu({"gather_list": gather_list})


before, after = show(cluster.run(example_all_gather))
assert all([t.tolist() for t in a["gather_list"]] == expected_list for a in after)
collective_figure(before, after, "all-gather")

# %% [markdown]
# (When the book runs this on GPUs, its printout of rank 1's list shows a tensor on `cuda:0`:
# that is an artefact of how it was printed, not a tensor that moved to another GPU. Compare the
# values only.)
#
# ### Scatter and reduce-scatter
# Scatter is the reverse of gather: the source rank holds a list of `N` tensors and rank `r`
# receives the `r`-th. Reduce-scatter is the reverse of all-gather and the first half of an
# all-reduce: every rank holds a list of `N` tensors, the `j`-th entries of all ranks are summed,
# and rank `j` receives that sum. No rank ever holds the whole reduced result, which is exactly
# what ZeRO wants for its gradient shards.


# %%
def example_scatter(ctx):
    if ctx.rank == 0:
        scatter_list = [torch.full((5,), float(i + 1), device=ctx.device) for i in range(ctx.world_size)]
    else:
        scatter_list = None
    tensor = torch.zeros(5, device=ctx.device)
    before = {"tensor": tensor.clone(), "scatter_list": scatter_list}
    dist.scatter(tensor, scatter_list, src=0)
    return to_cpu(before), to_cpu({"tensor": tensor})


before, after = show(cluster.run(example_scatter))
assert [a["tensor"].tolist() for a in after] == expected_list
collective_figure(before, after, "scatter from rank 0")

# %% [markdown]
# The book's reduce-scatter example gives rank `r` the list whose entry `j` is
# `[(r+1)·1, (r+1)·2] ** (j+1)`: first powers for rank 0's share, squares for rank 1's, cubes for
# rank 2's. So rank `j` receives `sum_r ((r+1)·[1, 2]) ** (j+1)`.


# %%
def example_reduce_scatter(ctx):
    rank = ctx.rank
    input_list = [
        torch.tensor([(rank + 1) * 1.0, (rank + 1) * 2.0], device=ctx.device) ** (j + 1) for j in range(ctx.world_size)
    ]
    output = torch.zeros(2, device=ctx.device)
    dist.reduce_scatter(output, input_list, op=dist.ReduceOp.SUM)
    return to_cpu({"input_list": input_list}), to_cpu({"output": output})


before, after = show(cluster.run(example_reduce_scatter))
formula = [sum(((r + 1) * torch.tensor([1.0, 2.0])) ** (j + 1) for r in range(N)) for j in range(N)]
exact = max(f.max().item() for f in formula) < 2**24  # whole numbers float32 holds exactly
for j in range(N):
    if exact:
        assert torch.equal(after[j]["output"], formula[j]), (j, after[j], formula[j])
    else:  # two sums of N positive float32 terms, in different orders: each within (N-1) eps
        bound = 2 * (N - 1) * torch.finfo(torch.float32).eps * formula[j]
        assert ((after[j]["output"] - formula[j]).abs() <= bound).all(), (j, after[j], formula[j])
if N == 3:  # the book's table
    assert [a["output"].tolist() for a in after] == [[6.0, 12.0], [14.0, 56.0], [36.0, 288.0]]
collective_figure(before, after, "reduce-scatter (sum)")

# %% [markdown]
# At `WORLD_SIZE = 3` these are the book's numbers: rank 0 gets `[6, 12]`, rank 1 `[14, 56]` and
# rank 2 `[36, 288]`. (All of them are whole numbers well below 2^24, so float32 holds them
# exactly and the checks above can ask for equality. From 7 ranks on, the largest pass 2^24:
# float32 rounds them, gloo adds in its own order, and the check allows a sum's rounding.)
#
# ### Barrier
# A barrier carries no data: no rank leaves it until every rank has entered it. In the book's
# example rank `r` sleeps `r` seconds first, so every rank leaves at about the time the slowest
# one arrives, `N - 1` seconds after the start: with 3 ranks the book's ranks 0, 1 and 2 pass at
# 2.0025, 2.0025 and 2.0024 s, the 2 s of the slowest rank's sleep plus a few milliseconds for
# the barrier itself. Here the sleep is `SLEEP_PER_RANK · r`, 1 s as in the book (run with
# `QUICK = False` to see the full-size figure), or 0.2 s in QUICK mode to keep the notebook short. Every rank spends the time between
# its own arrival and the last one's doing nothing, which is why barriers should be rare in
# training code.

# %%
SLEEP_PER_RANK = 0.2 if QUICK else 1.0


def example_barrier(ctx, sleep_per_rank):
    dist.barrier()  # line the ranks up first, so that they share a starting time
    start = time.time()  # the same clock on every rank of this machine
    time.sleep(sleep_per_rank * ctx.rank)
    arrived = time.time()
    dist.barrier()
    left = time.time()
    return start, arrived, left


timings = np.array(cluster.run(example_barrier, SLEEP_PER_RANK))
start = timings[:, 0].min()
arrived, left = timings[:, 1] - start, timings[:, 2] - start
slowest = SLEEP_PER_RANK * (N - 1)
for rank in range(N):
    print(f"rank {rank}: slept {SLEEP_PER_RANK * rank:.1f} s, passed the barrier after {left[rank]:.2f} s")
# Nobody may leave before the last rank arrives (10 ms of slack for reading the clocks), so rank 0,
# which did not sleep at all, waited about `slowest` seconds. Upper bound: on a busy 2-core machine
# a process can wake up late, so we allow 0.5 s more, and 0.5 s between the first and last to leave.
assert np.all(left >= slowest - 0.01), left
assert np.all(left <= slowest + 0.5), left
assert left.max() - left.min() < 0.5, left

# %% tags=["nbval-ignore-output"]
fig = Figure(figsize=(6, 0.5 + 0.35 * N), layout="constrained")
ax = fig.subplots()
for rank in range(N):
    ax.barh(rank, arrived[rank], color="tab:blue", label="working (sleep)" if rank == 0 else None)
    ax.barh(
        rank,
        left[rank] - arrived[rank],
        left=arrived[rank],
        color="tab:red",
        alpha=0.5,
        label="waiting in the barrier" if rank == 0 else None,
    )
ax.axvline(slowest, color="black", linestyle="--", linewidth=1, label="last rank arrives")
ax.set_yticks(range(N), [f"rank {r}" for r in range(N)])
ax.invert_yaxis()
ax.set_xlabel("seconds since the start")
ax.legend(fontsize="small", loc="lower right")
ax.set_title("barrier: everyone leaves together")
fig

# %% [markdown]
# ## 2. The ring all-reduce, from sends and receives
# How does a backend implement all-reduce? The simplest idea, sending everything to one rank and
# broadcasting the sum back, makes that rank receive `(N-1)·K` bytes for a tensor of `K` bytes: it
# becomes the bottleneck as `N` grows. The **ring** algorithm keeps every link equally busy
# instead. The ranks stand in a circle; in every step each rank sends one chunk to its right
# neighbour and receives one from its left neighbour, all at the same time. The tensor is cut into
# `N` chunks (chunk `c` goes to rank `c` in the end), and the algorithm has two phases:
#
# 1. **reduce-scatter**, `N-1` steps: in step `s` rank `r` sends chunk `r-s-1` (mod `N`) and adds
#    the incoming chunk `r-s-2` into its own copy. A chunk gathers one more rank's term per step,
#    so after `N-1` steps rank `r` holds the finished sum of chunk `r`;
# 2. **all-gather**, `N-1` steps: in step `s` rank `r` forwards chunk `r-s`, which is complete,
#    and receives chunk `r-s-1`, which overwrites its partial copy.
#
# `ultrascale.comm` implements exactly this with `dist.isend` and `dist.irecv` (post both the send
# and the receive, then wait: a rank that waited for its send to finish before receiving could
# deadlock the ring; on GPUs the pair goes through `dist.batch_isend_irecv`, which NCCL needs to
# launch them together). Read `lib/ultrascale/comm/ring.py`: under two hundred and fifty lines,
# comments included.
#
# To watch it, we run it on **5 ranks with a tensor of 5 elements**, so each chunk is one
# element, as in the book's animations. Rank `r` starts with `2**r` everywhere: any sum of those
# is a different whole number whose binary digits say which ranks' inputs it contains. We spy on
# the library by wrapping its ring step, `ring_step` (send to the right, receive from the left),
# to photograph the tensor before each step and note which chunk goes out.

# %%
RING_RANKS = 5


def traced_ring_all_reduce(ctx, length):
    """The library's ring all-reduce on 2**rank inputs, with a snapshot before every step."""
    tensor = torch.full((length,), 2.0**ctx.rank, device=ctx.device)
    chunks = tensor.tensor_split(ctx.world_size)  # the library's chunking rule: views of `tensor`
    frames, sends = [], []
    original = ring_module.ring_step

    def spy(outgoing, incoming, group, **options):
        frames.append(tensor.clone())  # the state after the previous step
        sends.append(next(i for i, c in enumerate(chunks) if c.data_ptr() == outgoing[0].data_ptr()))
        return original(outgoing, incoming, group, **options)

    ring_module.ring_step = spy
    try:
        ring_all_reduce(tensor)  # sums in place (the tensor is contiguous)
    finally:
        ring_module.ring_step = original
    frames.append(tensor.clone())
    reference = torch.full((length,), 2.0**ctx.rank, device=ctx.device)
    dist.all_reduce(reference)
    return frames, sends, torch.equal(tensor, reference)


ring_cluster = cluster if WORLD_SIZE == RING_RANKS else Cluster(RING_RANKS, backend="gloo")
traces = ring_cluster.run(traced_ring_all_reduce, RING_RANKS)
if ring_cluster is not cluster:
    ring_cluster.close()

n = RING_RANKS
assert all(matches for _, _, matches in traces), "the ring differs from dist.all_reduce"
steps = 2 * (n - 1)
assert all(len(frames) == steps + 1 and len(sends) == steps for frames, sends, _ in traces)
# frames[f][r][c]: the set of ranks whose inputs chunk c holds on rank r after step f
frames = [[[contributors(v) for v in traces[r][0][f].tolist()] for r in range(n)] for f in range(steps + 1)]
sends = [[traces[r][1][f] for r in range(n)] for f in range(steps)]
everyone = frozenset(range(n))
after_reduce_scatter = frames[n - 1]
assert all(after_reduce_scatter[r][r] == everyone for r in range(n))  # rank r owns chunk r
assert all(held == everyone for row in frames[-1] for held in row)  # everyone has everything
# The first chunk each rank sends: chunk r-1 in the reduce-scatter, its own chunk r in the all-gather.
assert sends[0] == [(r - 1) % n for r in range(n)] and sends[n - 1] == list(range(n))

titles = ["start"] + [f"reduce-scatter step {s}" for s in range(1, n)] + [f"all-gather step {s}" for s in range(1, n)]
ring_steps_figure(
    frames,
    titles,
    sends=sends,
    ncols=n,
    title="ring all-reduce on 5 ranks: which ranks' inputs each chunk holds "
    "(red: the chunk sent to the right neighbour next)",
)

# %% [markdown]
# Read the top row from left to right. In each step, every rank's outlined chunk goes to its right
# neighbour, the next rank down in the picture (the last rank's wraps round to rank 0), which adds
# it to its own copy: the chunk that arrives gains the sender's digits. After four steps the
# diagonal (rank `r`, chunk `r`) holds all five inputs. The bottom row passes those finished
# chunks round the ring until every rank has all of them.
#
# ### Does it compute the same thing as `dist.all_reduce`?
# Now on the notebook's own cluster, for sum, average and max, and for lengths that do not divide
# evenly by the number of ranks (chunks then differ by one element, and some are empty when the
# tensor is shorter than `N`). The ring adds the `N` terms of each element in a different order
# than gloo, and float addition is not associative; the two results may differ by the rounding
# of the additions. Summing `N` float32 numbers in any order is off by at most
# `(N-1)·u·Σ|x_i|` (`u = 2^-24`), so two orders differ by at most `(N-1)·eps·Σ|x_i|`
# (`eps = 2^-23`); we allow twice that. Max involves no rounding and must match exactly.

# %%
LENGTHS = (1, 7, 1001, 100_003)


def ring_parity(ctx, lengths):
    failures = []
    eps = torch.finfo(torch.float32).eps
    for length in lengths:
        x = torch.randn(length, generator=torch.Generator().manual_seed(1000 * ctx.rank + length)).to(ctx.device)
        abs_sum = x.abs()
        dist.all_reduce(abs_sum)
        sum_bound = 2 * (ctx.world_size - 1) * eps * abs_sum  # see the text above
        for op in ("sum", "avg", "max"):
            reference = x.clone()
            dist.all_reduce(reference, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            if op == "avg":
                reference /= ctx.world_size
            ours = ring_all_reduce(x.clone(), op=op)
            error = (ours - reference).abs()
            if op == "max":
                ok = torch.equal(ours, reference)
            elif op == "sum":
                ok = bool((error <= sum_bound).all())
            else:  # avg: the sum's bound divided by N, plus one rounding of each side's division
                ok = bool((error <= sum_bound / ctx.world_size + eps * reference.abs()).all())
            if not ok:
                failures.append(f"rank {ctx.rank}, length {length}, {op}: max error {error.max():.3g}")
        # The two phases alone: our reduce-scatter and all-gather against the built-ins.
        if length % ctx.world_size == 0:
            mine, theirs = ring_reduce_scatter(x), torch.empty(length // ctx.world_size, device=ctx.device)
            reduce_scatter_single(theirs, x)
            if not bool(((mine - theirs).abs() <= torch.tensor_split(sum_bound, ctx.world_size)[ctx.rank]).all()):
                failures.append(f"rank {ctx.rank}, length {length}: reduce-scatter differs")
        chunk = torch.tensor_split(x, ctx.world_size)[ctx.rank]
        gathered = ring_all_gather(chunk, numel=length)
        padded = torch.zeros(-(-length // ctx.world_size), device=ctx.device)  # all_gather needs equal sizes: pad
        padded[: chunk.numel()] = chunk
        pieces = [torch.empty_like(padded) for _ in range(ctx.world_size)]
        dist.all_gather(pieces, padded)
        sizes = [c.numel() for c in torch.tensor_split(torch.empty(length), ctx.world_size)]
        if not torch.equal(gathered, torch.cat([p[:s] for p, s in zip(pieces, sizes)])):
            failures.append(f"rank {ctx.rank}, length {length}: all-gather differs")
    return failures


failures = [f for rank in cluster.run(ring_parity, LENGTHS) for f in rank]
print(
    f"ring all-reduce (sum, avg, max), reduce-scatter and all-gather on {N} ranks, "
    f"lengths {LENGTHS}: {len(failures)} mismatches"
)
assert failures == [], failures

# %% [markdown]
# ### How many bytes does each rank send?
# In each phase a rank sends `N-1` chunks of `K/N` bytes, so the whole all-reduce sends
#
# $$2\,(N-1)\,\frac{K}{N}\ \text{bytes per rank,}$$
#
# and receives as much. Each phase moves about `K` per rank, and the total tends to `2K` as `N`
# grows: the cost per rank hardly depends on the number of ranks, which is what makes the ring
# scale. The `CommLogger` records the bytes our ring actually hands to `isend`, on every rank. For
# `dist.all_reduce`, whose messages stay inside gloo, it can only log the ring algorithm's volume,
# and says so (`algorithmic`).


# %%
def logged_bytes(ctx, length):
    x = torch.ones(length, device=ctx.device)
    with CommLogger() as log:
        ring_all_reduce(x)
        dist.all_reduce(x)
    return [(e.op, e.bytes_sent, e.bytes_received, e.source) for e in log.events]


length = 1000 * N  # K/N is a whole number of elements: the formula holds exactly
K = 4 * length  # float32
expected = 2 * (N - 1) * K // N
print(f"K = {format_bytes(K)} ({length} float32), N = {N}: 2(N-1)K/N = {expected} bytes")
for rank, events in enumerate(cluster.run(logged_bytes, length)):
    for op, sent, received, source in events:
        print(f"rank {rank}: {op:<16} sent {sent:>7} B, received {received:>7} B ({source})")
        assert sent == received == expected, (rank, op, sent, received)

# %% [markdown]
# With a length that `N` does not divide, the chunks differ by an element and so do the ranks'
# byte counts, but the ring as a whole still moves every chunk `N-1` times per phase: the total
# over ranks is exactly `2(N-1)K`.

# %%
odd_length = 1000 * N + 1
odd_sent = [events[0][1] for events in cluster.run(logged_bytes, odd_length)]
print(f"length {odd_length}: bytes sent per rank {odd_sent}, total {sum(odd_sent)}")
assert sum(odd_sent) == 2 * (N - 1) * 4 * odd_length

# %%
# For larger rings, from the chunking rule alone: in the reduce-scatter rank 0 sends every chunk
# but its own, in the all-gather every chunk but its right neighbour's (that one reaches it last).
print(f"{'N':>6} {'bytes sent per rank / K':>24}")
for ranks in (2, 3, 4, 8, 64, 512, 1024):
    numel = 1000 * ranks
    c = chunk_sizes(numel, ranks)
    sent = 4 * ((numel - c[0]) + (numel - c[1]))
    assert sent == 2 * (ranks - 1) * 4 * numel // ranks
    print(f"{ranks:>6} {sent / (4 * numel):>24.4f}")
assert 1.99 < sent / (4 * numel) < 2  # about 2K for large N

# %% [markdown]
# ## 3. All-reduce against reduce-scatter + all-gather
# Since an all-reduce *is* a reduce-scatter followed by an all-gather, calling the two built-ins
# one after the other moves the same bytes as one all-reduce. We time both on gloo, plus
# our ring, with `time_collective` (a barrier before the clock starts, the slowest rank's time),
# and gloo's all-reduce a second time, `again`: how far the same call moves against itself is the
# noise, the yardstick for every other difference in the table. Timings depend on the machine, so
# this cell's output is not compared when the notebook is re-run.

# %% tags=["nbval-ignore-output"]
TIMING_SIZES = [2**16, 2**20, 2**22] if QUICK else [2**16, 2**20, 2**22, 2**24]


def time_all_reduce_variants(ctx, sizes, iters):
    rows = []
    n = ctx.world_size
    for nbytes in sizes:
        numel = nbytes // 4 // n * n
        full, shard = (
            torch.zeros(numel, device=ctx.device),
            torch.empty(numel // n, device=ctx.device),
        )  # zeros: repeated sums stay finite
        t_all_reduce = time_collective(lambda: dist.all_reduce(full), iters)

        def two_phases():
            reduce_scatter_single(shard, full)
            all_gather_single(full, shard)

        t_two = time_collective(two_phases, iters)
        t_ring = time_collective(lambda: ring_all_reduce(full), iters)
        t_again = time_collective(lambda: dist.all_reduce(full), iters)  # the noise baseline
        rows.append((numel * 4, t_all_reduce, t_two, t_ring, t_again))
    return rows


timing_rows = cluster.run(time_all_reduce_variants, TIMING_SIZES, 5 if QUICK else 20)[0]
print(
    f"{'size':>10} {'all_reduce':>12} {'RS + AG':>12} {'ring (ours)':>12} {'again':>12}"
    f" {'RS+AG / AR':>11} {'again / AR':>11}   (gloo, {N} ranks, ms per call)"
)
for nbytes, t_ar, t_two, t_ring, t_again in timing_rows:
    print(
        f"{format_bytes(nbytes):>10} {1e3 * t_ar:>12.3f} {1e3 * t_two:>12.3f} {1e3 * t_ring:>12.3f} "
        f"{1e3 * t_again:>12.3f} {t_two / t_ar:>10.1f}x {t_again / t_ar:>10.2f}x"
    )

# %% [markdown]
# On paper the pair moves the same bytes as the single all-reduce, in two calls instead of one.
# On gloo it does not: PyTorch's gloo backend has no reduce-scatter of its own. Its
# `reduce_scatter_tensor` copies the input, runs a *whole* all-reduce on the copy and keeps this
# rank's chunk (`reduce_scatter_tensor_coalesced` in PyTorch's `ProcessGroupGloo.cpp`). So the pair
# costs an all-reduce *plus* an all-gather plus the copies: read the `RS+AG / AR` column above
# against the `again / AR` column, the all-reduce timed against itself, which shows how far noise
# alone moves a ratio in this run. On NCCL, which has a real reduce-scatter, the pair costs about
# what one all-reduce does.
# Our ring, which *is* a reduce-scatter followed by an all-gather, shows what the pair could cost
# with a real reduce-scatter. Frameworks split the all-reduce when its halves are useful on their
# own: ZeRO and FSDP keep only the reduce-scattered shard of the gradients, and all-gather the
# weights later, when they are needed.
#
# ## 4. Bus bandwidth and the alpha-beta model
# How fast is a collective? nccl-tests, NVIDIA's benchmark, reports two numbers for a buffer of
# `size` bytes taking `t` seconds:
#
# - **algorithm bandwidth** `algbw = size / t`, the speed the caller sees;
# - **bus bandwidth** `busbw = algbw · factor`, the speed each link must have carried. For
#   all-reduce the factor is `2(N-1)/N`, the ring's bytes per rank over `K`; for all-gather and
#   reduce-scatter `(N-1)/N`. Bus bandwidth can be compared across operations and world sizes, and
#   with the hardware's link speed.
#
# `bus_bandwidth_sweep` measures them for one size after another. The machine this runs on may be
# busy with other programs, and a burst of load only ever makes a collective slower, so we measure
# each size a few times, alternating gloo's all-reduce and ours, and keep the fastest run of each.
# gloo's all-reduce runs a second time as `again`, the noise baseline: the ring against gloo means
# something only where it differs by more than gloo does from itself. Rank 0 streams every point to
# the live plot as soon as it has it.

# %% tags=["nbval-ignore-output"]
SWEEP_SIZES = [4**k for k in range(2, 12)] if QUICK else [4**k for k in range(2, 14)]  # 16 B to 4 MiB (64 MiB)
SWEEP_ITERS, SWEEP_REPEATS = (5, 3) if QUICK else (20, 5)


def sweep(ctx, sizes, iters, repeats):
    results = {"gloo": [], "ring": [], "again": []}
    for size in sizes:
        runs = {"gloo": [], "ring": [], "again": []}
        for _ in range(repeats):
            for name, impl in (("gloo", "torch"), ("ring", "ring"), ("again", "torch")):
                runs[name] += bus_bandwidth_sweep(ctx, [size], op="all_reduce", impl=impl, iters=iters)
        for name in results:  # times are the slowest rank's, the same on every rank
            results[name].append(min(runs[name], key=lambda p: p["time_s"]))
        if ctx.rank == 0:
            ctx.log(
                **{
                    "log2(bytes)": math.log2(results["gloo"][-1]["size"]),
                    **{f"{name} busbw (MB/s)": results[name][-1]["busbw"] / 1e6 for name in ("gloo", "ring")},
                }
            )
    return results


plot = LivePlot(
    "gloo busbw (MB/s)",
    "ring busbw (MB/s)",
    x="log2(bytes)",
    title=f"all-reduce bus bandwidth on {N} ranks, as measured",
)
measured = cluster.run(sweep, SWEEP_SIZES, SWEEP_ITERS, SWEEP_REPEATS, on_log=plot)[0]
baseline = measured.pop("again")  # gloo against itself: shown beside the race, not fitted
fig = plot.finish()  # the final frame (a cell that ends in an expression would show it again)
# %% [markdown]
# Both curves climb with the message size towards a plateau. The **alpha-beta model** explains the
# shape: a message of `n` bytes costs `α + n/β`, a fixed latency `α` plus the bytes over the
# bandwidth `β`. The ring sends `2(N-1)` messages of `K/N` bytes, so
#
# $$t(K) = 2(N-1)\,\alpha + \frac{2(N-1)}{N}\,\frac{K}{\beta}.$$
#
# Small buffers pay mostly latency (bandwidth looks poor), large ones mostly bandwidth. The two
# terms of one message are equal at `n* = α·β` bytes, that is at a buffer of `K* = N·α·β` for the
# all-reduce: below it, fewer and larger messages help; above it, only faster links do. We fit
# `α` and `β` to each set of measurements and mark `K*`. (We cannot see which algorithm gloo runs
# inside its call, so for gloo these are effective values: the ring that would take as long.)
# Before the fit, each time is capped by the fastest time of any larger buffer (`noise_floor`):
# load only adds time, and more bytes never take less, so a small buffer measured slower than a
# larger one was slowed by something else. On a busy machine that keeps the fitted line rising.

# %% tags=["nbval-ignore-output"]
fits = {}
fig = Figure(figsize=(11, 3.8), layout="constrained")
ax_time, ax_bw = fig.subplots(1, 2)
for (name, points), colour in zip(measured.items(), ("tab:blue", "tab:orange")):
    sizes = np.array([p["size"] for p in points], dtype=float)
    times = np.array([p["time_s"] for p in points])
    fit = fits[name] = fit_ring_all_reduce(sizes, times, N)
    grid = np.logspace(np.log10(sizes[0]), np.log10(sizes[-1]), 200)
    model = fit.ring_all_reduce_time(grid, N)
    crossover = N * fit.crossover_bytes
    ax_time.loglog(sizes, times * 1e6, "o", color=colour, label=f"{name}: measured")
    ax_time.loglog(
        grid,
        model * 1e6,
        "-",
        color=colour,
        alpha=0.7,
        label=f"{name}: α={fit.alpha * 1e6:.0f} µs, β={fit.beta / 1e9:.2f} GB/s",
    )
    ax_time.axvline(crossover, color=colour, linestyle="--", linewidth=1)
    ax_bw.semilogx(sizes, [p["busbw"] / 1e9 for p in points], "o-", color=colour, label=name)
    ax_bw.axvline(
        crossover, color=colour, linestyle="--", linewidth=1, label=f"{name}: K* = N·α·β = {format_bytes(crossover)}"
    )
ax_time.set(
    xlabel="buffer size K (bytes)",
    ylabel="time per all-reduce (µs)",
    title="measured (dots) and alpha-beta model (lines)",
)
ax_bw.set(xlabel="buffer size K (bytes)", ylabel="bus bandwidth (GB/s)", title="bus bandwidth")
ax_time.legend(fontsize="small")
ax_bw.legend(fontsize="small")
print(
    f"{'size':>10} {'gloo (µs)':>10} {'ring (µs)':>10} {'ring/gloo':>10} {'again/gloo':>11} {'gloo busbw':>12}"
    f" {'ring busbw':>12}"
)
for g, r, a in zip(measured["gloo"], measured["ring"], baseline):
    print(
        f"{format_bytes(g['size']):>10} {g['time_s'] * 1e6:>10.0f} {r['time_s'] * 1e6:>10.0f} "
        f"{r['time_s'] / g['time_s']:>10.2f} {a['time_s'] / g['time_s']:>11.2f} "
        f"{g['busbw'] / 1e9:>8.3f} GB/s {r['busbw'] / 1e9:>7.3f} GB/s"
    )
ratios = [r["time_s"] / g["time_s"] for g, r in zip(measured["gloo"], measured["ring"])]
noise = [a["time_s"] / g["time_s"] for g, a in zip(measured["gloo"], baseline)]
MIB = [i for i, g in enumerate(measured["gloo"]) if g["size"] >= 0.99 * 2**20]  # from 1 MiB up (rounded to N)
print(
    f"ring / gloo time: {min(ratios[: MIB[0]]):.2f}x to {max(ratios[: MIB[0]]):.2f}x below 1 MiB, "
    f"{min(ratios[i] for i in MIB):.2f}x to {max(ratios[i] for i in MIB):.2f}x from 1 MiB up; "
    f"gloo against itself: {min(noise):.2f}x to {max(noise):.2f}x (the noise); "
    f"ring alpha / gloo alpha = {fits['ring'].alpha / fits['gloo'].alpha:.1f}"
)
for name, fit in fits.items():
    print(
        f"{name}: alpha = {fit.alpha * 1e6:.1f} µs per message, beta = {fit.beta / 1e9:.2f} GB/s, "
        f"crossover alpha*beta = {format_bytes(fit.crossover_bytes)} per message "
        f"(all-reduce buffer K* = {format_bytes(N * fit.crossover_bytes)})"
    )
fig

# %% [markdown]
# The numbers above depend on the machine; what must hold anywhere is checked below: both fits
# found a positive latency and bandwidth, and the model's time grows with the size.

# %%
for name, fit in nonempty(fits, "fits (the cell above makes them)").items():
    assert fit.alpha > 0 and fit.beta > 0, (name, fit)
    model_times = fit.ring_all_reduce_time(np.array(SWEEP_SIZES, dtype=float), N)
    assert np.all(np.diff(model_times) > 0), name
    assert 0 < fit.crossover_bytes < math.inf
print("alpha > 0, beta > 0 and a monotone model for:", ", ".join(fits))

# %% [markdown]
# ## 5. Fewer steps for small buffers: recursive doubling
# The ring is as economical with bytes as an all-reduce can be, but it needs `2(N-1)` messages one
# after the other, and every message pays the latency `α`. For a small buffer that is almost all
# the time it takes. **Recursive doubling** trades bytes for steps. In step `k` rank `r` swaps its
# whole running sum with rank `r XOR 2^k` and adds what arrives: after step 0 each pair holds the
# sum of its two inputs, after step 1 each group of four, and after `log2 N` steps every rank holds
# all `N`. Every step sends the full `K` bytes, so the bandwidth term grows to `K·log2 N`.
#
# When `N` is not a power of two, let `P` be the largest power of two below it. The `N-P` extra
# ranks first hand their input to a partner among the first `P` (rank `P+i` to rank `i`), those `P`
# ranks run recursive doubling, and the partners hand the result back: two more steps. With
# `S = log2 P` (plus 2 when `N ≠ P`) steps, the alpha-beta model gives
#
# | algorithm | messages in a row | bytes sent by the busiest rank | time |
# |---|---|---|---|
# | ring | `2(N-1)` | `2(N-1)K/N` | `2(N-1)α + 2(N-1)/N · K/β` |
# | recursive doubling | `S` | `K·log2 P` (`+K` when `N ≠ P`) | `S·α + S·K/β` |
#
# and setting the two times equal gives the buffer size above which the ring wins:
#
# $$K^* = \alpha\beta\;\frac{2(N-1) - S}{S - 2(N-1)/N}.$$
#
# For `N = 2` doubling is one swap of `K` bytes where the ring makes two swaps of `K/2`: the same
# bytes in half the messages, so it always wins; for larger `N` the crossover grows with `N`, because the ring's message count grows
# linearly and doubling's only logarithmically. NCCL makes this kind of choice inside one call: it
# estimates the time of its algorithms (rings, trees and others) for the size at hand and runs the
# fastest. gloo does not: its all-reduce (`gloo/allreduce.cc`) offers a ring and BCube, takes the
# one its caller names, and PyTorch names none, so every gloo all-reduce in this chapter is a ring,
# at any size (which is why section 4 may fit the ring's model to it, and section 6 reads its
# ring). `ultrascale.comm.recursive` makes NCCL's kind of choice, in the open. First the algorithm
# itself, with a spy on its one-exchange helper `send_recv`, on a length that no world size
# divides:


# %%
def traced_doubling(ctx, length, module=recursive_module, all_reduce=recursive_doubling_all_reduce):
    """An all-reduce built on ``module.send_recv`` (recursive doubling unless told otherwise) on random
    inputs: its messages (kind, peer, bytes sent), bytes and result against dist.all_reduce."""
    x = torch.randn(length, generator=torch.Generator().manual_seed(SEED + ctx.rank)).to(ctx.device)
    reference, abs_sum = x.clone(), x.abs()
    dist.all_reduce(reference)
    dist.all_reduce(abs_sum)
    messages, original = [], module.send_recv

    def spy(send, recv, right, left, group):
        kind = "swap" if send.numel() and recv.numel() else "send" if send.numel() else "recv"
        messages.append((kind, right if send.numel() else left, send.numel() * send.element_size()))
        return original(send, recv, right, left, group)

    module.send_recv = spy
    try:
        with CommLogger() as log:
            all_reduce(x)
    finally:
        module.send_recv = original
    everyone = [torch.empty_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, x)
    bound = 2 * (ctx.world_size - 1) * torch.finfo(torch.float32).eps * abs_sum  # as for the ring
    return {
        "messages": messages,
        "sent": log.events[0].bytes_sent,
        "received": log.events[0].bytes_received,
        "close": bool(((x - reference).abs() <= bound).all()),
        "identical": all(torch.equal(everyone[0], other) for other in everyone),
    }


length = 1000 * N + 1
K = 4 * length
P = 1 << (N.bit_length() - 1)
S = doubling_steps(N)
traced = cluster.run(traced_doubling, length)
print(f"N = {N}, P = {P}, S = {S} steps; K = {K} bytes")
for rank, t in enumerate(traced):
    arrows = {"swap": "<->", "send": "->", "recv": "<-"}
    print(
        f"rank {rank}: "
        + ", ".join(f"{arrows[kind]} {peer}" for kind, peer, _ in t["messages"])
        + f"; sent {t['sent'] // K} K, received {t['received'] // K} K"
    )
    swaps = [peer for kind, peer, _ in t["messages"] if kind == "swap"]
    if rank < P:  # the doubling ranks swap with r XOR 1, r XOR 2, r XOR 4, ...
        assert swaps == [rank ^ (1 << k) for k in range(P.bit_length() - 1)], (rank, swaps)
    assert len(t["messages"]) <= S
    assert t["sent"] == K * sum(kind != "recv" for kind, _, _ in t["messages"])  # every message is all K bytes
    assert t["close"] and t["identical"]
assert max(len(t["messages"]) for t in traced) == S
print(f"equal to dist.all_reduce within the rounding bound, and bit-identical on all {N} ranks")

# %% [markdown]
# ### Halving-doubling: the ring's bytes in `2·log2 N − 1` messages
# Doubling saves messages by sending everything every time. **Halving-doubling** (Rabenseifner's
# algorithm, which MPI libraries use for large buffers) saves them without the extra bytes. It is a
# reduce-scatter followed by an all-gather, like the ring, but each phase pairs ranks the way
# doubling does:
#
# - *reduce-scatter by halving*: in step `k` rank `r` and rank `r XOR 2^k` hold the same range of
#   the buffer; each keeps one half, sends the other half to its partner, and adds the half it
#   receives. The range halves at every step, so after `log2 P` steps each rank owns `1/P` of the
#   buffer, fully summed, having sent `K/2 + K/4 + … = (P-1)K/P` bytes;
# - *all-gather by doubling*: the same pairs in reverse order, each sending the range it has, so
#   the range doubles back to the whole buffer.
#
# Look at the middle: the last halving step and the first doubling step pair the *same* two ranks,
# which hold the same range `m`. Halving sends `m/2` each way and adds; doubling then sends the
# summed `m/2` back. Our version swaps the whole range once instead and both ranks add all of it:
# the same `m` bytes in one message instead of two, for `m/2` more additions: one `α` saved,
# which counts for small buffers and vanishes for large ones, where a message's latency is a small
# part of its time. (With `N = 2` the one swap that is left is recursive doubling.)
#
# That is the ring's `2(P-1)K/P` bytes in `2·log2 P − 1` messages instead of `2(P-1)`, the time
# `(2·log2 P − 1)·α + 2(P-1)/P·K/β`. Extra ranks fold in and out as for doubling, at the price of
# two more messages of the whole buffer. The same spy, on the same length:

# %%
H = halving_doubling_steps(N)
traced = cluster.run(traced_doubling, length, halving_module, halving_doubling_all_reduce)
print(f"N = {N}, P = {P}: halving-doubling takes {H} messages on the busiest rank; K = {K} bytes")
for rank, t in enumerate(traced):
    print(
        f"rank {rank}: "
        + ", ".join(
            f"{arrows[kind]} {peer} ({nbytes / K:.3g} K)" if nbytes else f"{arrows[kind]} {peer}"
            for kind, peer, nbytes in t["messages"]
        )
    )
    swaps = [(peer, nbytes) for kind, peer, nbytes in t["messages"] if kind == "swap"]
    if rank < P:  # partners r XOR 1, 2, 4, ... while halving, then back, the farthest only once
        distances = [1 << k for k in range(P.bit_length() - 1)]
        assert [peer for peer, _ in swaps] == [rank ^ d for d in distances + distances[-2::-1]], (rank, swaps)
        # each halving step sends half of what the one before sent (up to one element of rounding),
        # and the merged innermost swap sends all that is left: as much as the last halving step
        halving = [nbytes for _, nbytes in swaps[: len(distances)]]
        want = [K / 2 ** min(k + 1, len(distances) - 1) for k in range(len(distances))]
        assert all(abs(nbytes - w) <= 4 for nbytes, w in zip(halving, want)), (halving, want)
    assert len(t["messages"]) <= H
    assert t["close"] and t["identical"]
busiest = max(t["sent"] for t in traced)
assert abs(busiest - halving_doubling_bytes(K, N)) <= 4 * 2 * H
assert max(len(t["messages"]) for t in traced) == H
print(
    f"the busiest rank sent {busiest / K:.3f} K (the formula: 2(P-1)/P K{' + K' if N != P else ''} = "
    f"{halving_doubling_bytes(K, N) / K:.3f} K); equal to dist.all_reduce within the rounding bound, "
    f"bit-identical on all {N} ranks"
)

# %% [markdown]
# And the formulas side by side for larger worlds. The crossover is in units of `α·β`, the size at
# which one message's latency and transfer time are equal. Halving-doubling has the ring's bytes
# in fewer messages, so under this model it never loses to the ring when `N` is a power of two;
# the ring keeps its place on real clusters because it only ever talks to its neighbours and
# so can follow the physical links (NVLink inside a node, one NIC each way between nodes), while
# halving-doubling's later steps pair ranks far apart across the network:

# %%
unit = AlphaBeta(alpha=1.0, beta=1.0)  # crossover_bytes(unit, N) is K* / (alpha beta)
print(
    f"{'N':>6} {'ring steps':>11} {'doubling steps':>15} {'halving steps':>14} {'ring bytes/K':>13} "
    f"{'doubling bytes/K':>17} {'halving bytes/K':>16} {'K* / (alpha beta)':>18}"
)
for ranks in (2, 3, 4, 5, 8, 16, 64, 1024):
    power = 1 << (ranks.bit_length() - 1)
    busiest = power.bit_length() - 1 + (ranks != power)
    print(
        f"{ranks:>6} {2 * (ranks - 1):>11} {doubling_steps(ranks):>15} {halving_doubling_steps(ranks):>14} "
        f"{2 * (ranks - 1) / ranks:>13.3f} {busiest:>17} {halving_doubling_bytes(1, ranks):>16.3f} "
        f"{crossover_bytes(unit, ranks):>18.1f}"
    )
assert crossover_bytes(unit, 2) == math.inf and crossover_bytes(unit, 4) == 8.0

# %% [markdown]
# Where does the crossover fall on this machine? `fit_on_the_spot` measures `α` and `β` from
# exchanges that *all* ranks make at once, as in a step of either algorithm, so the fit sees the
# cores and links as busy as the collectives will. `race_all_reduces` then times gloo's all-reduce,
# our ring, our recursive doubling, our halving-doubling and `all_reduce(..., model=...)`, which
# picks the one of the three that the model predicts to be fastest for the size. The five take
# turns on the same tensor in balanced orders: over the rounds each runs in every position and
# right after every other one equally often (what ran just before can cost a call), and each
# keeps its median over the rounds. gloo's all-reduce runs once more, as `again`: gloo against
# itself should be 1.00x, and how far it is not is how far this machine's noise alone moves
# every other ratio. Timings depend on the machine and its load, so this output is not compared.

# %% tags=["nbval-ignore-output"]
RACE_SIZES = [1 << k for k in range(10, 23, 2)] if QUICK else [1 << k for k in range(10, 27, 2)]  # 1 KiB-4 MiB (64 MiB)
RACE_ROUNDS = 3 if QUICK else 7
bus = bus_factor("all_reduce", N)


def race(ctx, sizes, rounds):
    model = fit_on_the_spot(ctx.group, device=ctx.device)
    contenders = all_reduce_contenders(ctx.group, model, again=True)  # again: gloo once more, the noise floor

    def stream(row):  # rank 0: one point per plotted contender on the live plot
        nbytes, times = row
        ctx.log(
            **{
                "log2(bytes)": math.log2(nbytes),
                **{f"{name} busbw (MB/s)": nbytes / times[name] * bus / 1e6 for name in names},
            }
        )

    return model, race_all_reduces(contenders, sizes, rounds, ctx.group, ctx.device, callback=stream)


names = ("builtin", "ring", "doubling", "halving", "chosen")
plot = LivePlot(
    *(f"{name} busbw (MB/s)" for name in names), x="log2(bytes)", title=f"all-reduce bus bandwidth on {N} ranks"
)
fitted, rows = cluster.run(race, RACE_SIZES, RACE_ROUNDS, on_log=plot)[0]
fig = plot.finish()  # the final frame (a cell that ends in an expression would show it again)
model_crossover = crossover_bytes(fitted, N)
# the measured crossover: the smallest size from which the ring is faster at every larger size
measured_crossover = next((s for s, _ in rows if all(t["ring"] < t["doubling"] for size, t in rows if size >= s)), None)
print(f"fitted on the spot: alpha = {fitted.alpha * 1e6:.0f} µs, beta = {fitted.beta / 1e9:.2f} GB/s")
print(f"{'size':>10} " + " ".join(f"{name + ' (µs)':>14}" for name in names) + "   chosen   chosen/gloo busbw")
for nbytes, t in rows:
    print(
        f"{format_bytes(nbytes):>10} "
        + " ".join(f"{t[name] * 1e6:>14.0f}" for name in names)
        + f"   {choose_algorithm(nbytes, N, fitted):<18} {t['builtin'] / t['chosen']:>6.2f}x"
    )
again = [t["builtin"] / t["again"] for _, t in rows]
print(
    f"gloo against itself ('again'): {min(again):.2f}x to {max(again):.2f}x over the sizes, "
    f"how far noise alone moves a ratio in this run"
)
print(
    f"model crossover of ring and doubling K* = {format_bytes(model_crossover) if model_crossover < math.inf else 'never'}; "
    f"measured: the ring is faster from "
    f"{format_bytes(measured_crossover) if measured_crossover else 'no size measured here'} on"
)

fig = Figure(figsize=(11, 3.8), layout="constrained")
ax_time, ax_bw = fig.subplots(1, 2)
sizes = np.array([nbytes for nbytes, _ in rows], dtype=float)
grid = np.logspace(np.log10(sizes[0]), np.log10(sizes[-1]), 200)
for name, colour in zip(names, ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red")):
    times = np.array([t[name] for _, t in rows])
    ax_time.loglog(sizes, times * 1e6, "o-", color=colour, label=f"{name}: measured")
    ax_bw.semilogx(sizes, sizes / times * bus / 1e9, "o-", color=colour, label=name)
ax_time.loglog(grid, fitted.ring_all_reduce_time(grid, N) * 1e6, ":", color="tab:orange", label="ring: model")
ax_time.loglog(grid, doubling_time(fitted, grid, N) * 1e6, ":", color="tab:green", label="doubling: model")
ax_time.loglog(grid, halving_doubling_time(fitted, grid, N) * 1e6, ":", color="tab:purple", label="halving: model")
for ax in (ax_time, ax_bw):
    if model_crossover < math.inf:
        ax.axvline(model_crossover, color="black", linestyle="--", linewidth=1, label="K* of the model")
    if measured_crossover:
        ax.axvline(measured_crossover, color="grey", linestyle="-.", linewidth=1, label="measured crossover")
ax_time.set(xlabel="buffer size K (bytes)", ylabel="time per all-reduce (µs)", title="time: measured and modelled")
ax_bw.set(xlabel="buffer size K (bytes)", ylabel="bus bandwidth (GB/s)", title="bus bandwidth")
ax_time.legend(fontsize="x-small")
ax_bw.legend(fontsize="x-small")
fig

# %% [markdown]
# When the measured crossover misses the model's, the model is missing something, and on a
# small machine two things stand out. First, `α` here comes from lone exchanges (each size's
# median try: in a chain of steps a message is seldom as lucky as the fastest try). Inside an
# algorithm each message also waits for its partner to finish the step before, and with more
# ranks than cores for its turn on a core, so a message in a chain costs more than a lone one
# (compare the `α` fitted here with the ring's own, printed in section 4). A model that underrates
# `α` places every crossover too early. Second, the model has no term for the additions. Recursive
# doubling adds the whole buffer `log2 P` times, halving-doubling and the ring add about
# `K` in all; fuller models (Thakur, Rabenseifner and Gropp's) add a cost `γ` per byte reduced,
# which on a CPU is far from free. The choice is then still by model, but by a better one.
#
# What holds on any machine is checked below: the fit found a positive latency and bandwidth. The
# winner at the smallest size, where latency is everything, is shown but not asserted: at a
# fraction of a millisecond per call, another program's ranks competing for the same cores in
# bursts can outweigh the whole difference, even for each contender's fastest of 15 rounds (this
# check failed that way beside another chapter's run). So the race is printed beside its noise
# baseline, doubling raced against itself: read the ring's ratio against that spread.


# %%
def latency_race(ctx, nbytes, rounds):
    contenders = all_reduce_contenders(ctx.group)
    three = {name: contenders[name] for name in ("ring", "doubling")}
    three["doubling again"] = contenders["doubling"]  # the noise baseline: doubling against itself
    return race_all_reduces(three, [nbytes], rounds, ctx.group, ctx.device, keep=min)[0][1]


assert fitted.alpha > 0 and fitted.beta > 0
print(f"alpha > 0 and beta > 0; N = {N}: doubling sends {S} messages in a row against the ring's {2 * (N - 1)}")

# %% tags=["nbval-ignore-output"]
smallest = cluster.run(latency_race, rows[0][0], 15)[0]
print(
    f"at {format_bytes(rows[0][0])}, fastest of 15 rounds: ring {smallest['ring'] * 1e6:.0f} µs, doubling "
    f"{smallest['doubling'] * 1e6:.0f} µs, ring / doubling {smallest['ring'] / smallest['doubling']:.2f}x; "
    f"doubling against itself {smallest['doubling again'] / smallest['doubling']:.2f}x (the noise)"
)

# %% [markdown]
# ## 6. How does our ring compare with gloo's, and which backend to use?
# Look at the `ring/gloo` column of the table in section 4, and at the summary line under it:
# the ratio below 1 MiB, where each step's fixed costs weigh most, and from 1 MiB up, each beside
# `again/gloo`, gloo against itself. These are your machine's numbers and they change from run to
# run; a ratio inside the noise's range says nothing, one outside it is a difference. Where our
# ring is slower, the difference is in how each step is run. Each of our `2(N-1)` steps goes
# through Python (posting the send and the receive, waiting, an `add_` in PyTorch) and does one
# thing at a time, while gloo runs
# its whole algorithm in C++ after one call and splits every chunk into segments (at least two, at
# most 1 MiB each), so that it adds one segment while the next is still on the wire (read `ring`
# in gloo's `allreduce.cc`). For small buffers the per-step costs are nearly the whole time; for
# large ones both move the same bytes through the same transport, and the overlap is what gloo has
# over us (`benchmarks/bench_ring_allreduce.py` also times our halving-doubling with its additions
# skipped: wrong sums, timed only, to show what the additions cost). On a CPU machine gloo's
# "links" are TCP connections over loopback and all ranks share a few cores, so the absolute
# numbers say little about a GPU cluster; the shape of the curves carries over.
#
# There is a way to get that overlap without cutting chunks into more messages: send every chunk
# straight to the rank that owns it, all at once (`ultrascale.comm.direct`). Rank `r` posts its
# `N - 1` other chunks to their owners and `N - 1` receives of its own chunk, and adds each
# contribution as soon as it is in, while the others are still arriving; then it sends its summed
# chunk to everybody. The ring's bytes, in two rounds instead of `2(N-1)` steps. The alpha-beta
# model sends one message at a time, so it prices this like the ring and would never pick it;
# `benchmarks/bench_ring_allreduce.py` races it instead, and `all_reduce(..., direct_from=...)`
# takes it above a crossover raced on the spot (`direct_crossover_on_the_spot`), the way tuned MPI libraries
# pick algorithms from measured tables rather than from a formula. On a real cluster its `N - 1`
# simultaneous messages all cross the network at once, which is why NCCL keeps rings and trees
# between nodes.
#
# That is the general lesson: a collective library wins on latency (fused, native code, fewer
# synchronisations, algorithms with fewer steps for small messages, like section 5's) and on
# bandwidth only as far as the hardware allows. The ring's bandwidth term is already optimal.
#
# **Which backend?** PyTorch ships three:
#
# | backend | use it for | notes |
# |---|---|---|
# | **NCCL** | training on NVIDIA GPUs | the fastest GPU collectives; uses NVLink and InfiniBand directly; one GPU per rank |
# | **gloo** | CPU training, and CPU tensors in general | built into PyTorch on every platform; also runs GPU tensors, but slowly |
# | **MPI** | clusters already built around MPI | only when PyTorch is compiled against an MPI library |
#
# PyTorch's own advice: NCCL for distributed GPU training, gloo for distributed CPU training. NCCL
# needs **one GPU per rank**: two ranks cannot share one GPU. The cell below runs the same
# examples under NCCL when this machine has at least two GPUs, and says why it skips otherwise.

# %% tags=["nbval-ignore-output"]
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"this machine: {gpus} GPU(s), NCCL {'available' if dist.is_nccl_available() else 'not available'}")
if gpus >= 2 and dist.is_nccl_available():
    with Cluster(min(gpus, WORLD_SIZE), backend="nccl") as gpu_cluster:
        m = gpu_cluster.world_size
        assert all(a.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] for _, a in gpu_cluster.run(example_broadcast))
        assert all(a.tolist() == [m * (m + 1) / 2] * 5 for _, a in gpu_cluster.run(example_all_reduce))
        gpu_after = [a["output"] for _, a in gpu_cluster.run(example_reduce_scatter)]
        for j, out in enumerate(gpu_after):
            assert torch.equal(out, sum(((r + 1) * torch.tensor([1.0, 2.0])) ** (j + 1) for r in range(m)))
        print(f"NCCL on {m} GPUs: broadcast, all-reduce and reduce-scatter agree with the CPU run")
        print(
            "reduce on NCCL, non-destination ranks keep:", [describe(a) for _, a in gpu_cluster.run(example_reduce)][1:]
        )
        nccl_points = gpu_cluster.run(
            lambda ctx: bus_bandwidth_sweep(ctx, [2**k for k in range(10, 29, 3)], op="all_reduce", iters=20)
        )[0]
        for p in nccl_points:
            print(f"{format_bytes(p['size']):>10}: busbw {p['busbw'] / 1e9:8.2f} GB/s")
else:
    try:
        resolve_backend("nccl", WORLD_SIZE)  # what Cluster(WORLD_SIZE, backend="nccl") checks first
    except RuntimeError as err:
        print(f"skipped the NCCL run of {WORLD_SIZE} ranks. The runtime refuses it with:\n  {err}")
    if gpus == 1 and dist.is_nccl_available():  # one GPU: a single NCCL rank, nothing to exchange
        with Cluster(1, backend="nccl") as gpu_cluster:
            ((_, alone),) = gpu_cluster.run(example_broadcast)
        print(f"NCCL with one rank on one GPU works, but moves no data: broadcast leaves {alone.tolist()}")

# %% [markdown]
# ## Summary
# - Broadcast, scatter and gather move data without combining it; reduce, all-reduce and
#   reduce-scatter combine it; the *all-* versions leave the result on every rank; barrier only
#   synchronises.
# - All-reduce = reduce-scatter + all-gather. In a ring each rank sends `2(N-1)K/N ≈ 2K` bytes,
#   whatever the number of ranks, in `2(N-1)` steps.
# - Cost ≈ latency × number of steps + bytes / bandwidth. Small messages are latency bound, large
#   ones bandwidth bound; the crossover is at about `α·β` bytes per message.
# - Recursive doubling needs `log2 N` steps (two more when `N` is not a power of two) but sends
#   the whole buffer in each: it wins below `K*`, the ring above. Choosing by size with a model
#   fitted on the spot gets the better of both. Halving-doubling sends the ring's bytes in
#   `2·log2 N − 1` messages; the ring keeps its place on real clusters by talking to neighbours only.
#
# ## Your turn
# Open [exercises/a0_collectives_exercises.ipynb](../exercises/a0_collectives_exercises.ipynb): write the ring reduce-scatter, the ring
# all-gather, the ring all-reduce, recursive doubling (with the fold for a world size that is not
# a power of two) and halving-doubling yourself, from `isend` and `irecv` only. The checks run
# them on clusters of several sizes and awkward lengths, compare with `torch.distributed`, and
# read every message you send: the right sum by another algorithm does not pass.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/a0_collectives_exercises.ipynb` grades
# the whole notebook from a terminal.

# %%
cluster.close()
