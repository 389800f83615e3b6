# %% [markdown]
# # 07 · Pipeline parallelism: AFAB, 1F1B, interleaving, Zero Bubble, DualPipe
#
# Tensor, sequence and context parallelism (chapters 04 to 06) cut *every* layer across ranks,
# so every layer communicates, and they need fast links: they rarely go beyond one node. A 70B
# model's weights alone can outgrow the GPUs of a node. **Pipeline parallelism** (PP) cuts the
# model the other way: by depth. With `p` ranks, each keeps a consecutive slice of the layers, a
# *stage*; the first also holds the embedding, the last the final norm, the head and the loss.
# Activations go forward from stage to stage, their gradients come back, point to point. The
# weights split by `p`; only the stage boundaries communicate.
#
# That is why PP is the axis that crosses nodes. Per micro-batch, a stage boundary carries one
# activation of `b·s·h` values forward and its gradient back; TP all-reduces tensors of that size
# twice per layer in forward and twice in backward, over every layer. The book measured the
# difference on H100 nodes: going from one node (`p = 8`) to two (`p = 16`) cost PP only about
# 14% of its throughput with few micro-batches, where TP in comparable cross-node settings lost
# about 43%.
#
# The price is idle time. Stage 2 cannot start before stage 1 has finished, and the backward
# runs the pipe in reverse: with one batch, every rank but one waits at any moment. Cutting the
# batch into `m` micro-batches lets the stages work on different micro-batches at once; *when*
# each rank runs which forward and backward is the **schedule**, and the whole chapter is about
# schedules: how much idle time (the *bubble*) each leaves, and how many micro-batches'
# activations each makes a rank hold.
#
# In this notebook you will
# 1. cut the course GPT into stages and see what each rank holds;
# 2. write schedules as per-rank action lists and run them in a discrete-event simulator that
#    draws them in the book's style, for every schedule of the book, DualPipe included;
# 3. assert the book's bubble formulas on the simulator, and the activations each schedule keeps;
# 4. run the same action lists on `WORLD_SIZE` real ranks with send/recv and check the gradients
#    against gradient accumulation in one process and against `torch.distributed.pipelining`;
# 5. measure the bubble on the ranks from their logged timelines, against $(p-1)/m$;
# 6. measure the activation memory per stage under AFAB and 1F1B, against the memory model;
# 7. check the book's $t_b \approx 2\,t_f$ on a real block;
# 8. play with the simulator, and see the errors for what cannot run.
#
# The implementation: `lib/ultrascale/schedule/` (action lists, generators, simulator; pure
# Python, drawn by `viz/schedule.py`), `lib/ultrascale/parallel/pipeline_parallel.py` (`apply_pp`: the stages and the
# executor of the lists), `train.py` (`run_pipeline_steps`, its training loop) and
# `parity/pipeline_runs.py` (the checks against one process, calibrated compute, PyTorch's
# pipelines on the same stages).

# %% tags=["parameters"]
WORLD_SIZE = 4  # ranks, all in one pipeline (p is WORLD_SIZE; 2, 3 and 4 all work)
QUICK = True  # True: small sizes, about 30 s on 2 CPU cores; False: more steps, micro-batch counts and PyTorch schedules, a larger block (longer)
SEED = 0

# %%
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import time

import matplotlib.pyplot as plt
import torch

from ultrascale.data import Batch, Batches, micro_batches
from ultrascale.memory import breakdown, pp_in_flight
from ultrascale.model import GPT, LLAMA3_8B, GPTConfig, count_params
from ultrascale.parallel import Timeline, init_mesh
from ultrascale.parallel.pipeline_parallel import apply_pp, build_stage, split_layers, stage_modules
from ultrascale.parity import perturbed, tolerance
from ultrascale.parity.pipeline_runs import (
    assert_same_as_one_process,
    calibrate_compute,
    first_step_and_train,
    one_process,
    pytorch_pipeline,
)
from ultrascale.refusal import refusal
from ultrascale.schedule import (
    Schedule,
    action_of,
    afab,
    bubble_fraction,
    dualpipe_v,
    interleaved_1f1b,
    make_schedule,
    naive,
    one_f_one_b,
    parse,
    predicted_bubble_fraction,
    simulate,
    zb_h1,
)
from ultrascale.viz.live import ProgressBar
from ultrascale.viz.schedule import draw
from ultrascale.viz.schedule_widget import schedule_widget

torch.manual_seed(SEED)
torch.set_num_threads(1)  # this process's models are tiny: a second thread would only fight the ranks for the cores
plt.switch_backend(plt.get_backend())  # figures are Figure objects that a cell shows by returning them

# %% [markdown]
# ## 1. Cutting the model into stages
#
# All the ranks form one pipeline, `p = WORLD_SIZE`. The course GPT gets `2 p` blocks, so that
# every rank can also hold two chunks (interleaving and DualPipe, below). `split_layers` deals the
# blocks out as evenly as possible; `stage_modules` builds a rank's stages as views of the whole
# model that share its parameters (the book's example: 8 GPUs, layers 1-4 on the first, 5-8 on
# the second, and so on, for a 32-layer model).

# %%
P = WORLD_SIZE
CFG = GPTConfig(vocab_size=64, hidden=32, heads=2, layers=2 * P, seq_len=8)
DT = torch.float64  # parity checks in float64 (the reason is in section 4)

assert [list(r)[:1] + list(r)[-1:] for r in split_layers(32, 8)][:2] == [[0, 3], [4, 7]]  # the book's split
model = GPT(CFG)
stages = stage_modules(model, one_f_one_b(P, 1), rank=0)
print(f"course GPT, {CFG.layers} blocks, hidden {CFG.hidden}: {count_params(CFG):,} parameters, p = {P}\n")
print(f"{'rank':<6}{'blocks':<10}{'also holds':<28}{'parameters':>12}")
held = []
for rank in range(P):
    (stage,) = stage_modules(model, one_f_one_b(P, 1), rank).values()
    extra = [name for name in ("embed", "norm", "head") if getattr(stage, name) is not None]
    n = sum(p.numel() for p in stage.parameters())
    held.append(n)
    print(f"{rank:<6}{str(list(stage.layers)):<10}{', '.join(extra) or '-':<28}{n:>12,}")
tied = model.embed.weight.numel()
assert sum(held) == count_params(CFG) + (tied if P > 1 else 0), "every weight once, the tied embedding on two ranks"
print(
    f"\nsum over ranks = all parameters + the tied embedding/head weight ({tied:,}), "
    "which the first and the last stage both hold"
)

# %% [markdown]
# GPT ties the output head to the embedding, so that one weight lives on the first and on the
# last rank; each sees a part of its gradient, and the two ranks add their parts after the
# backward (Megatron-LM does the same with an "embedding group").
#
# ## 2. A schedule is a list of actions per rank
#
# Each rank runs, in order, actions such as `F3` (forward of micro-batch 3 through its stage)
# and `B3` (its backward); `send`/`recv` follow from where the stages live. The simulator runs
# every rank's list with a forward taking $t_f$ and a backward $t_b = 2\,t_f$ (the book's
# assumption), each action as soon as its input is there, and records when each rank computes.
#
# The **naive** pipeline sends the whole batch through: rank 1 waits for rank 0's forward,
# and so on, and the backward comes back the same way. The book draws 16 layers over 4 GPUs:

# %%
print(naive(4))
draw(simulate(naive(4)), number_from=1)

# %% [markdown]
# The idle time, the grey, is $(p-1)(t_f + t_b)$ per rank against $t_f + t_b$ of work: the
# **bubble fraction** $r_{bubble} = (p-1)$. With $m$ micro-batches, **AFAB** (all forwards,
# then all backwards; GPipe) keeps the same idle time but does $m$ times more work:
# $r_{bubble} = \frac{(p-1)(t_f+t_b)}{m(t_f+t_b)} = \frac{p-1}{m}$. The book's figure has 8
# micro-batches (the numbers in the boxes are micro-batch ids, from 1 as in the book):

# %%
draw(simulate(afab(4, 8)), number_from=1)

# %% [markdown]
# AFAB's drawback is memory: every rank holds the activations of all `m` micro-batches before the
# first backward frees any. **1F1B** starts each backward as soon as it can: rank `r` runs
# `p - 1 - r` forwards to fill the pipe, then alternates one forward and one backward. The
# bubble is the same, but a rank never holds more than `p` micro-batches:

# %%
schedule = one_f_one_b(4, 8)
print(schedule)
draw(simulate(schedule), number_from=1)

# %% [markdown]
# ## 3. The book's formulas, asserted on the simulator
#
# The simulator adds exact multiples of $t_f$, so the formulas hold to the last bit. For several
# `p` and `m` (including `m` that `p` does not divide):

# %%
EXACT = 1e-12
print(f"{'p':>3}{'m':>4}   {'naive':>7}{'AFAB':>8}{'1F1B':>8}{'(p-1)/m':>9}   peak activations AFAB / 1F1B (per rank)")
for p, m in [(2, 4), (3, 5), (4, 8), (4, 3), (8, 32), (P, P + 1)]:
    runs = {name: simulate(build(p, m)) for name, build in (("AFAB", afab), ("1F1B", one_f_one_b))}
    assert simulate(naive(p)).bubble_fraction == p - 1
    for sim in runs.values():
        assert abs(sim.bubble_fraction - (p - 1) / m) < EXACT
    assert runs["AFAB"].peak_activations == [m] * p
    one_f = runs["1F1B"].peak_activations
    assert one_f == [min(p - r, m) for r in range(p)] and max(one_f) <= p
    print(
        f"{p:>3}{m:>4}   {p - 1:>7}{runs['AFAB'].bubble_fraction:>8.3f}{runs['1F1B'].bubble_fraction:>8.3f}"
        f"{(p - 1) / m:>9.3f}   {runs['AFAB'].peak_activations} / {runs['1F1B'].peak_activations}"
    )
assert simulate(one_f_one_b(4, 8)).bubble_fraction == 0.375  # the book's p = 4, m = 8

# %% [markdown]
# So more micro-batches shrink the bubble, and 1F1B keeps the memory of `p` micro-batches
# whatever `m` is (rank 0 the most: its first micro-batch comes back last). The book's 1F1B
# benchmark shows the consequence: with `m = p - 1` the bubble is large and grows with `p`;
# with `m = 32` it is small at low `p`.
#
# ### Interleaving
#
# Give each rank `v` chunks of layers instead of one consecutive slice (rank `r` holds chunks
# `r, r + p, r + 2p, ...`): a micro-batch now visits every rank `v` times, and each visit takes
# $t_f / v$. The fill and drain shrink by `v`: $r_{bubble} = \frac{p-1}{v\,m}$. The price: `v`
# times more messages. Megatron-LM goes *depth-first* (a few micro-batches through all chunks,
# their backwards early); the *breadth-first* order pushes all `m` through one chunk before the
# next (fewer, larger bursts, but more activations held). Llama 3.1 tunes between the two.

# %%
for order in ("depth-first", "breadth-first"):
    sim = simulate(interleaved_1f1b(4, 8, v=2, order=order))
    assert abs(sim.bubble_fraction - predicted_bubble_fraction(4, 8, v=2)) < EXACT
    print(
        f"interleaved {order:<14} p=4, m=8, v=2: bubble {sim.bubble_fraction:.4f} = 3/16, "
        f"peak (micro-batch, chunk) pairs per rank {sim.peak_activations}"
    )
assert simulate(interleaved_1f1b(8, 32, v=2)).bubble_fraction == 7 / 64  # the book's p=8, m=32, v=2 (derived)
print("interleaved p=8, m=32, v=2: bubble 7/64 =", 7 / 64)


def messages(schedule):
    return sum(a.op == "send_F" for r in range(schedule.ranks) for a in schedule.actions(r))


print(
    f"activations sent per step, p=4, m=8: 1F1B {messages(one_f_one_b(4, 8))}, "
    f"v=2 {messages(interleaved_1f1b(4, 8, 2))}, v=4 {messages(interleaved_1f1b(4, 8, 4))}"
)
assert messages(interleaved_1f1b(4, 8, 2)) == 8 * (2 * 4 - 1) and messages(one_f_one_b(4, 8)) == 8 * 3
fig, axes = plt.subplots(2, 1, figsize=(13, 4.6))
for ax, order in zip(axes, ("depth-first", "breadth-first")):
    draw(simulate(interleaved_1f1b(4, 8, v=2, order=order)), ax=ax, number_from=1)
fig.tight_layout()
plt.close(fig)
fig

# %% [markdown]
# (Lighter boxes: a rank's second chunk.) Each micro-batch crosses `p v - 1` boundaries instead
# of `p - 1`: 56 messages instead of 24 here.
#
# ### Zero Bubble: splitting the backward
#
# A backward computes two things: the gradient of the stage's *input* (B), which the previous
# stage is waiting for, and the gradients of its *weights* (W), which nobody needs before the
# optimizer step. Zero Bubble's ZB-H1 runs B first and defers W: the B's travel back up the
# pipe sooner, and the deferred W's fill the drain. With $t_f = t_B = t_W$ (here $t_b = 2$,
# $t_w = 1$) the idle time per rank drops from $(p-1)(t_f + t_b)$ to $(p-1)(t_f + t_b - 2 t_w)$,
# a third of 1F1B's. Its *largest* peak is 1F1B's, the first rank's `p` micro-batches, but not
# rank by rank: a deferred W still needs the activations its micro-batch saved, so the later
# ranks, which 1F1B lets hold fewer, hold `p` as well (the per-rank peaks printed below). The
# book's "same memory" is true of the busiest rank only. (ZB-H2, which the book mentions as the
# theoretical zero, needs more memory still; we do not build it.)

# %%
for p, m in [(4, 8), (P, P + 1)]:
    zb, ref = simulate(zb_h1(p, m)), simulate(one_f_one_b(p, m))
    assert abs(zb.bubble_fraction - (p - 1) * (1 + 2 - 2 * 1) / (m * 3)) < EXACT
    assert zb.bubble_fraction < ref.bubble_fraction and max(zb.peak_activations) == max(ref.peak_activations)
    assert zb.peak_activations == [min(p, m)] * p and sum(zb.peak_activations) > sum(ref.peak_activations)
    print(
        f"p={p}, m={m}: ZB-H1 bubble {zb.bubble_fraction:.4f} against 1F1B's {ref.bubble_fraction:.4f} "
        f"(a third); peak micro-batches per rank {zb.peak_activations} against 1F1B's {ref.peak_activations}"
    )
draw(simulate(zb_h1(4, 8)), number_from=1)

# %% [markdown]
# ### DualPipe
#
# DeepSeek-V3's DualPipe feeds micro-batches in from *both* ends of the pipe, so the two streams
# fill each other's bubbles; it also overlaps one micro-batch's forward with another's backward
# communication. We build DualPipeV, its folded form in `torch.distributed.pipelining`: rank `r`
# holds stages `r` and `2p - 1 - r`, so a micro-batch goes down the ranks and back up. It needs
# `m >= 2p`. (Our simulator runs such an overlapped pair back to back; the order and the
# dependencies are kept. Placing the pieces optimally needs measured durations and an ILP, which
# the book leaves out too.)

# %%
dual = simulate(dualpipe_v(4, 8))
assert dual.bubble_fraction < simulate(one_f_one_b(4, 8)).bubble_fraction
assert dual.bubble_fraction < predicted_bubble_fraction(4, 8, v=2)
print(
    f"DualPipeV p=4, m=8: bubble {dual.bubble_fraction:.4f} (1F1B 0.375, interleaved v=2 0.1875); "
    f"peak (micro-batch, chunk) pairs {dual.peak_activations}"
)
draw(dual, number_from=1)

# %% [markdown]
# Every list above was checked when it was built: one F and one B per micro-batch and stage, on
# the rank holding the stage, and a simulated run proving that no rank waits forever (section 9
# shows what happens otherwise).
#
# ## 4. The same lists on real ranks: equal to one process
#
# `apply_pp(model, mesh, schedule=..., microbatches=m)` keeps this rank's stages and returns a
# `Pipeline` whose `step(micro_batches)` runs *exactly* `schedule.actions(rank)`: `F` is the
# stage's forward (the last stage adds the loss, divided by `m`), `B` a `torch.autograd.backward`
# from the stage's output with the gradient received from the next stage, `send` an `isend`,
# `recv` a receive right before the action that needs it. The gradients it leaves must equal
# those of **gradient accumulation in one process** over the same `m` micro-batches: each
# micro-batch's loss divided by `m`, the gradients summed (`train.run_steps(..., grad_acc=m)`).
#
# We compare the loss, every gradient (gathered by name from the stages' ranks) and the weights
# after a few SGD steps, in float64 with every weight moved off its initial value. Why float64:
# a pipeline computes the same operations on the same rows as one process; only the tied
# embedding's two gradient parts are added in another order, a rounding of about $10^{-16}$ that
# `parity.TOLERANCES` allows and a lost micro-batch or a wrong scale cannot meet. `m = p + 1`, which
# `p` does not divide (DualPipeV: `2p + 1`).

# %%
M = P + 1
STEPS = 1 if QUICK else 3
RUNS = [("afab", 1, M), ("1f1b", 1, M), ("interleaved", 2, M), ("zb-h1", 1, M), ("dualpipe-v", 2, 2 * P + 1)]


def fresh_model(cfg=CFG, dtype=DT):
    torch.manual_seed(SEED)
    return perturbed(GPT(cfg).to(dtype), seed=SEED)


def stream(m, cfg=CFG):
    """(step, micro) -> micro-batch: row ``micro`` of step's seeded batch of m rows."""
    data = Batches(cfg, mbs=m, seed=SEED)
    return lambda step, micro: micro_batches(data.global_batch(step), m)[micro]


def ours(ctx):
    torch.set_num_threads(1)  # a tiny model: a second thread per rank would only fight the others for the cores
    mesh = init_mesh(ctx, pp=ctx.world_size)
    results = {}
    for i, (name, v, m) in enumerate(RUNS):
        ctx.log(done=i)
        pipe = apply_pp(fresh_model().to(ctx.device), mesh, schedule=name, microbatches=m, chunks=v)
        results[name] = first_step_and_train(pipe, stream(m), STEPS, device=ctx.device)
    return results


def reference(m):
    """Gradient accumulation over the m micro-batches in one process."""
    return one_process(fresh_model(), stream(m), m, STEPS, fresh=fresh_model)


cluster = Cluster(WORLD_SIZE)
per_rank = cluster.run(ours, on_log=ProgressBar("five schedules on the ranks", total=len(RUNS)))
references = {m: reference(m) for m in sorted({m for *_, m in RUNS})}
for name, v, m in RUNS:
    results = [r[name] for r in per_rank]
    assert_same_as_one_process(results, references[m], f"{name} p={P}")
    schedule = make_schedule(name, P, m, v)
    assert [r["peak"] for r in results] == simulate(schedule).peak_activations
    print(
        f"{schedule.name:<28} p={P}, m={m}, v={v}: loss, {len(references[m]['grads'])} gradients, weights after "
        f"{STEPS} SGD steps = one process (float64, rtol {tolerance('sgd', DT)['rtol']:.0e}); "
        f"activations held at once {[r['peak'] for r in results]} = the simulator's"
    )

# %% [markdown]
# The number of micro-batches each rank really held at once is the simulator's count too.
#
# ## 5. Against `torch.distributed.pipelining`
#
# PyTorch ships the same schedules. `pytorch_pipeline` wraps our very stage modules in
# `PipelineStage`s and runs them with `Schedule1F1B`, `ScheduleInterleaved1F1B`,
# `ScheduleInterleavedZeroBubble` (ZB-H1 with one stage per rank) and `ScheduleDualPipeV`; the
# gradients must match one process (and so ours). PyTorch also exposes each rank's action list
# (`pipeline_order`), which we set against our generators'. `m = 2p`: PyTorch's interleaved
# schedule wants `m` to be a multiple of its rounds, DualPipeV `m >= 2p`. (With `QUICK = True`
# two of them train, 1F1B and DualPipeV; all four are compared as lists.
# `tests/test_pipeline_parallel.py` trains all of them.)

# %%
M_TORCH = 2 * P
TORCH_SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("dualpipe-v", 2)]
TORCH_RUNS = [("1f1b", 1), ("dualpipe-v", 2)] if QUICK else TORCH_SCHEDULES  # trained; all are compared as lists


def pytorchs(ctx):
    torch.set_num_threads(1)
    results = {}
    for i, (name, v) in enumerate(TORCH_SCHEDULES):
        ctx.log(done=i)
        pipe = pytorch_pipeline(fresh_model().to(ctx.device), schedule=name, microbatches=M_TORCH, chunks=v)
        results[name] = {"order": pipe.pipeline_order()}
        if (name, v) in TORCH_RUNS:
            results[name].update(first_step_and_train(pipe, stream(M_TORCH), STEPS, device=ctx.device))
    return results


theirs = cluster.run(pytorchs, on_log=ProgressBar("torch.distributed.pipelining", total=len(TORCH_SCHEDULES)))
want = reference(M_TORCH)
for name, v in TORCH_SCHEDULES:
    ours_lists = [list(acts) for acts in make_schedule(name, P, M_TORCH, v).compute]
    if name == "1f1b":  # its pipeline_order numbers the last rank's forwards from 1 (a description only)
        ours_lists[-1] = [a._replace(microbatch=a.microbatch + 1) if a.op == "F" else a for a in ours_lists[-1]]
    assert theirs[0][name]["order"] == ours_lists, name
    trained = (name, v) in TORCH_RUNS
    if trained:
        assert_same_as_one_process([r[name] for r in theirs], want, f"PyTorch {name}")
    print(
        f"PyTorch {name:<12} p={P}, m={M_TORCH}: its per-rank action lists = our generator's"
        + ("; gradients and weights = one process" if trained else "")
    )

# %% [markdown]
# One quirk: `Schedule1F1B.pipeline_order` numbers the last rank's forwards 1 to `m` (its `step`
# runs a loop of its own, not that list); with that shift its lists are ours.
#
# ## 6. The bubble, measured on the ranks
#
# Each rank logs every action as a bar in a `Timeline`; `bubble_fraction` reads the bars (idle
# time in the step over compute time, summed over ranks), the same function as for the
# simulator. The tiny model computes in well under a millisecond, and the book's premise is
# $t_b \approx 2\,t_f$, so `calibrate_compute` makes every forward last $t_f$ and every backward
# $2\,t_f$ by sleeping whatever the compute left of it. Then the measured bubble can be set
# against $(p-1)/m$ on any machine. What the formula leaves out is the messages' latency: in
# the steady phase each action waits for a neighbour's message, about $2(m + p - 1)$ hops per
# step, so the measurement comes out above it, by little on an idle machine and by more on a
# busy one, where a rank that sleeps or waits also wakes late. Each `m` runs `STEPS` timed steps
# and keeps the one with the least bubble: the closest look at the schedule that this machine
# gives.
#
# What can we *assert* on a machine that other work shares? Not the bars' bubble against the
# formula: a bar stretched by load (a sleep that wakes late) counts as compute, and when it sits
# off the critical path it shrinks the measured idle time, so on a busy machine the bars' bubble
# can fall below $(p-1)/m$. The step's length is safer. Every action lasts *at least* its
# calibrated time and starts only once its inputs have arrived, so the step can never be shorter
# than the schedule's critical path, $(m + p - 1)(t_f + t_b)$, whatever the load; in units of the
# ideal compute $m (t_f + t_b)$ that is a bubble of at least $(p-1)/m$. That bound is asserted,
# along with the fall from the smallest `m` to the largest, which the formula puts at
# $(p-1)(\frac{1}{p} - \frac{1}{4p}) \geq 0.375$. Latency at the smallest `m` only widens that gap;
# to close it, every message of the best of the `STEPS` steps at the largest `m` would have to wait more
# than $\frac{9(p-1)}{2(5p-1)}\,t_f$, close to half a forward. That is why $t_f$ is as long as
# 50 ms: the limit is printed below beside the waiting actually measured.

# %%
T_F = 0.05  # seconds: long enough that a busy machine's waiting per message stays far below it
MS = [P, 2 * P, 4 * P] if QUICK else [P, 2 * P, 4 * P, 8 * P]
STEPS = 2 if QUICK else 3  # timed steps per m; the one with the least bubble counts


def measured_bubble(ctx, schedule, m):
    """This rank's timeline rows for each of STEPS calibrated steps."""
    torch.set_num_threads(1)
    pipe = apply_pp(fresh_model(dtype=torch.float32).to(ctx.device), schedule=schedule, microbatches=m)
    batches = [stream(m)(0, i).to(ctx.device) for i in range(m)]
    pipe.step(batches)  # warm-up (threads, allocations), at the model's own speed
    calibrate_compute(pipe, t_f=T_F)
    steps = []
    for _ in range(STEPS):
        pipe.timeline = Timeline(ctx.rank)
        torch.distributed.barrier()
        pipe.step(batches)
        steps.append(pipe.timeline.rows())
    return steps


def step_bubble(rows, m):
    """The step's length over the ideal compute m (t_f + t_b), less one: the bubble as the clock sees it."""
    compute = [
        e for per_rank in rows for e in per_rank if e.get("lane", "compute") == "compute" and action_of(e["name"])
    ]
    return (max(e["end"] for e in compute) - min(e["start"] for e in compute)) / (m * 3 * T_F) - 1


bubbles, bars, drawn = {}, {}, None
for m in MS:
    per_rank = cluster.run(measured_bubble, "1f1b", m)
    steps = [list(step) for step in zip(*per_rank)]  # step s: the ranks' rows, side by side
    best = min(steps, key=lambda rows: step_bubble(rows, m))
    bubbles[m], bars[m] = step_bubble(best, m), bubble_fraction(best)
    drawn = best if m == 2 * P else drawn
latency = {}
for m in MS:
    formula = (P - 1) / m
    # the critical path bounds the step from below on any machine (a 1e-9 margin for float sums)
    assert bubbles[m] >= formula - 1e-9, "the step cannot be shorter than the schedule's critical path"
    # What is above the formula, spread over the 2 (m + p - 1) hops of the step: the messages' latency.
    latency[m] = (bubbles[m] - formula) * m * 3 * T_F / (2 * (m + P - 1))
assert bubbles[MS[-1]] < bubbles[MS[0]], "four times the micro-batches, a smaller bubble"
print(
    f"1F1B on {P} ranks, t_f = {1e3 * T_F:.0f} ms, t_b = 2 t_f, m = {MS}, best of {STEPS} steps: the step "
    f"is never shorter than the critical path (bubble >= (p-1)/m), and its bubble is smaller at m = {MS[-1]} "
    f"than at m = {MS[0]}"
)

# %% tags=["nbval-ignore-output"]
for m in MS:
    print(
        f"m = {m:>2}: step's bubble {bubbles[m]:.3f}, bars' bubble {bars[m]:.3f}, (p-1)/m = {(P - 1) / m:.3f} "
        f"({100 * (bubbles[m] / ((P - 1) / m) - 1):+.1f}%); {1e3 * latency[m]:.2f} ms of waiting per message"
    )
last = MS[-1]  # the waiting per message at m = last that would erase the fall from m = MS[0]
limit = (P - 1) * (1 / MS[0] - 1 / last) * 3 * last * T_F / (2 * (last + P - 1))
print(
    f"the fall from m = {MS[0]} to m = {last} survives any waiting below {1e3 * limit:.1f} ms per message at m = {last}"
)
draw(drawn, title=f"1F1B measured on {P} ranks, m = {2 * P}, t_f = {1e3 * T_F:.0f} ms (sleep-calibrated)")

# %% [markdown]
# The measured picture is the simulator's: the warm-up staircase, the steady alternation, the
# drain. As `m` grows the bubble falls as $1/m$.
#
# ## 7. Activation memory per stage: AFAB against 1F1B
#
# With `measure_activations=True` each rank counts the bytes autograd saves in every forward
# (saved-tensor hooks, weights left out) and keeps the peak of what it holds at once. One
# micro-batch through a stage saves a fixed number of bytes (more on the first rank, whose
# embedding output is saved too, and on the last, with the logits), so the peak of a rank is
# that number times the micro-batches it holds at once: `m` for AFAB, `min(p - rank, m)` for
# 1F1B. `memory.pp_in_flight` takes those counts from the simulator, and
# `memory.breakdown(..., pp=, schedule=, micro_batches=)` uses them for a GPU's activations.

# %%
M_MEM = 2 * P


def own_tensors(batch):
    """A micro-batch with tensors of its own. Cut from one batch, micro-batches are views of its
    storage, and a storage saved for backward counts with its full size: every micro-batch would
    seem to keep the whole batch's token ids. A data loader hands out separate tensors."""
    return Batch(batch.inputs.clone(), batch.targets.clone())


def peak_bytes(ctx):
    torch.set_num_threads(1)
    out = {}
    for name, m in (("afab", 1), ("afab", M_MEM), ("1f1b", M_MEM)):
        pipe = apply_pp(
            fresh_model(dtype=torch.float32).to(ctx.device), schedule=name, microbatches=m, measure_activations=True
        )
        pipe.step([own_tensors(stream(m)(0, i)).to(ctx.device) for i in range(m)])
        out[name, m] = (pipe.peak_activations, pipe.peak_activation_bytes)
    return out


peaks = cluster.run(peak_bytes)
model_counts = {name: pp_in_flight(name, P, M_MEM) for name in ("afab", "1f1b")}
print(f"p = {P}, m = {M_MEM}, float32, rows of {CFG.seq_len} tokens: bytes saved for backward held at once\n")
print(f"{'rank':<6}{'one micro-batch':>16}{'AFAB':>12}{'1F1B':>12}   in flight (measured = pp_in_flight)")
for rank, result in enumerate(peaks):
    one = result["afab", 1][1]
    for name in ("afab", "1f1b"):
        count, nbytes = result[name, M_MEM]
        assert count == model_counts[name][rank] and nbytes == count * one, (rank, name)
    print(
        f"{rank:<6}{one:>14,} B{result['afab', M_MEM][1]:>10,} B{result['1f1b', M_MEM][1]:>10,} B   "
        f"AFAB {model_counts['afab'][rank]}, 1F1B {model_counts['1f1b'][rank]}"
    )
ratio = peaks[0]["afab", M_MEM][1] / peaks[0]["1f1b", M_MEM][1]
modelled = {name: breakdown(CFG, pp=P, schedule=name, micro_batches=M_MEM)["activations"] for name in ("afab", "1f1b")}
assert ratio == modelled["afab"] / modelled["1f1b"] == M_MEM / P
print(
    f"\nrank 0 (the busiest): AFAB / 1F1B = {ratio:.1f} measured = {modelled['afab'] / modelled['1f1b']:.1f} "
    "in breakdown(schedule=...) = m / p"
)

# %% [markdown]
# For a real model the same model says where the memory goes. Llama 3 8B at 4,096 tokens, one
# sequence per micro-batch, full recomputation off, `pp = 4`: the parameters, gradients and
# optimizer states divide by `p`, but what a GPU keeps of activations depends on the schedule.
# (The activation constants are Korthikanti et al.'s for a GPT block; Llama 3's grouped-query
# attention, SwiGLU MLP and missing dropout change them somewhat, so these are estimates.)

# %%
print("Llama 3 8B, seq 4096, pp = 4: GB per GPU (memory model, bf16 mixed precision)\n")
print(f"{'schedule':<14}{'m':>4}{'weights+grads+optimizer':>26}{'activations':>14}")
base = breakdown(LLAMA3_8B, seq=4096)
for name, m in (("afab", 8), ("afab", 32), ("1f1b", 8), ("1f1b", 32), ("interleaved", 32), ("zb-h1", 32)):
    parts = breakdown(LLAMA3_8B, seq=4096, pp=4, schedule=name, micro_batches=m)
    states = parts["parameters"] + parts["gradients"] + parts["optimizer states"]
    print(f"{name:<14}{m:>4}{states / 1e9:>26.1f}{parts['activations'] / 1e9:>14.1f}")
    assert parts["parameters"] == base["parameters"] / 4
one_f = breakdown(LLAMA3_8B, seq=4096, pp=4, schedule="1f1b", micro_batches=32)["activations"]
assert one_f == base["activations"], "1F1B: p micro-batches of L/p layers = one GPU's activations of all L layers"
print(f"\none GPU, no PP: activations {base['activations'] / 1e9:.1f} GB; 1F1B at pp = 4 holds the same")

# %% [markdown]
# The book's 8B figure in numbers: PP splits the weights, but a 1F1B rank 0 holds `p`
# micro-batches of `L/p` layers, the activations of the whole model for one micro-batch, as if
# there were no PP at all. AFAB holds `m/p` times that.
#
# ## 8. Is $t_b \approx 2\,t_f$? A real block
#
# The backward of a matrix product computes two products (the input's gradient and the
# weight's), the forward one, hence the rule of thumb. We time the forward and the backward of
# one transformer block of the course GPT, built as a pipeline stage that takes hidden states.

# %%
BLOCK = GPTConfig(vocab_size=64, hidden=256 if QUICK else 512, heads=4, layers=1, seq_len=128)


def time_block(device, rows=4, repeats=15):
    block = build_stage(GPT(BLOCK).to(device), range(0, 1), first=False, last=False)
    x = torch.randn(rows, BLOCK.seq_len, BLOCK.hidden, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    forward, backward = [], []
    for i in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        y = block(x)
        sync()
        t1 = time.perf_counter()
        y.backward(dy)
        sync()
        t2 = time.perf_counter()
        if i >= 2:  # the first calls warm up allocators and kernels
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    # the fastest of the repeats: other work on a busy machine only ever adds time to a sample
    # (a loaded CI machine once gave a median backward of 0.63 forwards)
    return min(forward), min(backward)


t_f, t_b = time_block("cpu")
assert 1.0 < t_b / t_f < 5.0, f"t_b / t_f = {t_b / t_f:.2f}"
print("CPU: the backward of one block takes between 1 and 5 times its forward (the rule of thumb: 2)")

# %% tags=["nbval-ignore-output"]
print(
    f"CPU, one block h={BLOCK.hidden}, 4 x {BLOCK.seq_len} tokens, float32, one thread: t_f {1e3 * t_f:.2f} ms, "
    f"t_b {1e3 * t_b:.2f} ms, t_b / t_f = {t_b / t_f:.2f}"
)
if torch.cuda.is_available():
    g_f, g_b = time_block("cuda", rows=32, repeats=20)
    print(
        f"{torch.cuda.get_device_name()}: t_f {1e3 * g_f:.3f} ms, t_b {1e3 * g_b:.3f} ms, t_b / t_f = {g_b / g_f:.2f}"
    )
else:
    print("no CUDA device: the GPU timing of the block is skipped")

# %% [markdown]
# On a busy CPU the ratio moves from run to run (and attention's softmax and the norms do not
# follow the two-products rule), so the assert only brackets it; the printed value is this run's.
#
# ## 9. The simulator to play with, and what cannot run
#
# In JupyterLab, pick a schedule and move `p`, `m` and `v`: the timeline, its bubble against the
# formula and the activations each rank holds are redrawn. (A viewer that does not run Python
# shows one line of text below instead.)

# %% tags=["nbval-ignore-output"]
# (a widget's output is an interactive view, different in every session: not compared in CI)
schedule_widget("interleaved", p=4, m=8, v=2)

# %% [markdown]
# Inputs that cannot make a pipeline are refused with a message that says what to change: more
# stages than the model has blocks, fewer than one micro-batch, and a hand-written schedule that
# would leave ranks waiting for each other forever. That last one is 1F1B without its warm-up
# on rank 0: it runs `B0` right after `F0`, so it waits for micro-batch 0's gradient before it
# sends micro-batch 1, while rank 1, whose list is `F0 F1 B0 B1`, waits for micro-batch 1 before
# it runs `B0`. Each waits for the other; the simulator finds it before any rank runs.


# %%
def too_many_stages(ctx):
    return refusal(lambda: apply_pp(fresh_model(), schedule="interleaved", microbatches=M, chunks=CFG.layers))


errors = {
    f"p = {P} ranks with v = {CFG.layers} chunks each, {CFG.layers} blocks": cluster.run(too_many_stages)[0],
    "m = 0 micro-batches": refusal(lambda: one_f_one_b(P, 0)),
    "1F1B without warm-up on 2 ranks": refusal(
        lambda: Schedule("no warm-up", [parse("F0 B0 F1 B1"), parse("F0 F1 B0 B1", stage=1)], 2)
    ),
}
assert "every stage needs at least one block" in next(iter(errors.values()))
assert "m=0" in errors["m = 0 micro-batches"] and ">= 1" in errors["m = 0 micro-batches"]
assert "rank 0 waits at action 2 (recv_B0s0)" in errors["1F1B without warm-up on 2 ranks"]
for case, message in errors.items():
    print(f"{case}:\n  {message}\n")

# %% [markdown]
# ## Summary
#
# | schedule | bubble $r_{bubble}$ | activations held (rank 0) | messages |
# |---|---|---|---|
# | naive | $p - 1$ | 1 batch | $2(p-1)$ |
# | AFAB | $(p-1)/m$ | $m$ | $2m(p-1)$ |
# | 1F1B | $(p-1)/m$ | $\min(p, m)$ | $2m(p-1)$ |
# | interleaved, `v` chunks | $(p-1)/(v\,m)$ | more than 1F1B (depth-first less than breadth-first) | $2m(pv-1)$ |
# | ZB-H1 | $(p-1)(t_f+t_b-2t_w)/(m(t_f+t_b))$ | as 1F1B ($p$ on every rank, not only the first) | as 1F1B |
# | DualPipeV | below interleaved's | two streams' worth | two chunks per rank |
#
# - A schedule is a list of actions per rank; the simulator and the ranks run the same lists.
# - The pipeline trained on real ranks equals gradient accumulation in one process and
#   PyTorch's schedules, and PyTorch's action lists are ours.
# - The measured bubble follows $(p-1)/m$; 1F1B holds `p` micro-batches where AFAB holds `m`.
# - Interleaving with `v` chunks multiplies the messages by $(pv-1)/(p-1)$, which the book rounds
#   to "v times as much communication" (for p = 4, v = 2 it is 7/3, not 2).
#
# Next, chapter 08: expert parallelism.

# %% [markdown]
# ## Your turn
# Open [exercises/07_pipeline_parallelism_exercises.ipynb](../exercises/07_pipeline_parallelism_exercises.ipynb): write one rank's 1F1B list, the bubble fraction from timelines, a stage's forward
# and backward step with its sends and receives, and Zero Bubble's B/W split.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/07_pipeline_parallelism_exercises.ipynb` grades
# the whole notebook from a terminal.

# %%
cluster.close()
