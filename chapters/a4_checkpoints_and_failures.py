# %% [markdown]
# # A4 · Checkpoints, resharding and failures
#
# The book stops at a training step that fits in memory and runs fast. A real run repeats that
# step for weeks on thousands of GPUs, and machines fail all the while: Meta counted 466 job
# interruptions in 54 days of Llama 3 405B's pre-training, 419 of them unplanned. So a run must
# save its state often, cheaply, and in a form that a *different* layout can read back: the job
# that restarts may have fewer nodes, or a better parallel configuration.
#
# This appendix goes beyond the book and puts two things the course already has together: every
# technique shards the training state (chapter 03's ZeRO cuts flat buffers, chapter 04's TP cuts
# weight matrices), and our runtime survives a rank's death. In this notebook you will
# 1. save ZeRO-1 with PyTorch's distributed checkpoint (DCP), and see how a flat shard that
#    starts in the middle of a weight becomes boxes of the *global* tensor;
# 2. load it as ZeRO-3 on another number of ranks, then into PyTorch's FSDP2, and check that
#    training goes on exactly as if nothing had happened (float64, against one process);
# 3. checkpoint without stopping: a save written in the background, timed beside a blocking one,
#    and the arithmetic of saving a 405B model;
# 4. kill a rank with SIGKILL in the middle of a step and in the middle of a save, and resume
#    from the last complete checkpoint with no step lost;
# 5. choose how often to save: Young's formula, Daly's refinement, and a simulated run with
#    random failures to check them.
#
# The code is in `lib/ultrascale/checkpoint/`: `pieces.py` (flat runs as DCP boxes, DCP's
# planners extended), `layouts.py` (each layout's state under one set of keys), `store.py`
# (atomic save and load, in the background too), `loader.py` (a data loader whose position is a
# sample) and `failures.py` (the intervals and the simulation).

# %% tags=["parameters"]
WORLD_SIZE = 4  # ranks of the run that saves; it resumes on WORLD_SIZE - 1 (at least 1)
QUICK = True  # True: 2 + 2 steps, 40 simulated runs per interval (about 45 s on 2 CPU cores); False: more
SEED = 0

# %%
# %matplotlib inline
from ultrascale.runtime import Cluster, RankError  # first: the ranks' fork server loads torch meanwhile
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ultrascale.checkpoint import (
    SampleLoader,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_checkpoint_async,
)
from ultrascale.checkpoint.failures import checkpoint_seconds, daly_interval, simulate_run, young_interval
from ultrascale.comm import wait_for_device
from ultrascale.model import GPT, LLAMA3_405B, GPTConfig, count_params
from ultrascale.parallel import ZeRO
from ultrascale.parity import device_mesh_1d, fsdp2
from ultrascale.train import run_steps

assert WORLD_SIZE >= 2, "a sharded checkpoint needs at least two ranks: set WORLD_SIZE >= 2"
RESUME_SIZE = max(1, WORLD_SIZE - 1)
STEPS = 2 if QUICK else 5  # steps before the checkpoint, and again after it
CFG = GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16)
GLOBAL_BATCH = 12  # samples per step, whatever the number of ranks
for n in (WORLD_SIZE, RESUME_SIZE):
    assert GLOBAL_BATCH % n == 0, (
        f"{GLOBAL_BATCH} samples per step do not split over {n} ranks: pick another WORLD_SIZE"
    )
ROOT = Path(tempfile.mkdtemp(prefix="a4-"))
torch.manual_seed(SEED)


def fresh_model(device=None):
    """The same float64 GPT in every process: float64 so that layouts agree to 1e-10."""
    torch.manual_seed(SEED)
    return GPT(CFG).double().to(device)


# %% [markdown]
# ## 1. What a checkpoint holds, and who writes it
#
# A checkpoint is everything the next step depends on: the weights, the optimizer state (Adam's
# two moments and its step count, in fp32 for a bf16 model), the data loader's position and the
# random-number states. Under ZeRO or FSDP each rank holds a share of the weights and optimizer
# state, so the natural thing is for each rank to write *its own share*, all at once; gathering
# everything on one rank would cost the memory ZeRO saved and one rank's bandwidth.
#
# DCP (`torch.distributed.checkpoint`) does exactly this. Each rank hands it a dict of tensors;
# a tensor that is a piece of a bigger one says which box of the *global* tensor it is (offsets
# and sizes along each dimension). DCP plans who writes what (a replicated tensor is written
# once), each rank writes its own file, and one `.metadata` file maps every global tensor to its
# boxes. Loading reverses it: each rank asks for the boxes *its* layout needs, and DCP reads them
# from whichever saved boxes overlap. Nothing in the files names a world size.
#
# One reference run first: one process, the whole global batch each step, `2 * STEPS` Adam steps.
# Every distributed run below must end with exactly its weights and optimizer state.


# %%
def train_one_process(steps):
    model = fresh_model()
    optimizer, loader = torch.optim.Adam(model.parameters(), lr=1e-3), SampleLoader(CFG, GLOBAL_BATCH, SEED)
    run_steps(model, loader, steps, optimizer)
    return model, optimizer, loader


def read_whole(path) -> dict:
    """A checkpoint read back whole, in one process (DCP's own converter to a torch.save file)."""
    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


model, optimizer, data = train_one_process(2 * STEPS)
reference = read_whole(save_checkpoint(ROOT / "reference", 2 * STEPS, model, optimizer, loader=data))
print(
    f"the reference checkpoint holds {sum(k.startswith('model.') for k in reference)} weights and "
    f"{sum(k.startswith('optim.') for k in reference)} optimizer tensors (exp_avg, exp_avg_sq, step each)"
)

# %% [markdown]
# ## 2. ZeRO's flat shards as boxes of the global tensors
#
# Chapter 03's ZeRO keeps a unit's parameters in one flat buffer, padded to a multiple of the
# ranks, and rank *r* owns the *r*-th equal slice. A slice boundary can fall in the middle of a
# row of a weight. A box cannot start mid-row, so `flat_boxes` cuts each rank's run of a
# parameter into at most three boxes per dimension level: a partial row, whole rows, a partial row.
# The padding belongs to no parameter and is not saved at all: another world size pads differently.
#
# We train ZeRO-1 for `STEPS` steps on `WORLD_SIZE` ranks and save. `data` is a `SampleLoader`:
# its position is a *sample*, 12 a step, so it means the same thing on any number of ranks.

# %%
cluster = Cluster(WORLD_SIZE)


def build(ctx, stage):
    model = fresh_model(ctx.device)
    zero = ZeRO(model, stage=stage, optimizer_cls=torch.optim.Adam, lr=1e-3)
    return model, zero, SampleLoader(CFG, GLOBAL_BATCH, SEED, ctx.rank, ctx.world_size, ctx.device)


def train_zero_and_save(ctx, root, stage, steps, resume_from=None):
    model, zero, data = build(ctx, stage)
    done = 0
    if resume_from is not None:
        done = load_checkpoint(latest_checkpoint(resume_from), model, zero, loader=data)["step"]
    first_sample = data.next_sample
    run_steps(model, data, steps, zero)
    save_checkpoint(root, done + steps, model, zero, loader=data)
    return first_sample


cluster.run(train_zero_and_save, ROOT / "zero1", 1, STEPS)
path = latest_checkpoint(ROOT / "zero1")
metadata = FileSystemReader(path).read_metadata().state_dict_metadata
# the weight cut into the most boxes at this world size (ties: the first in the file)
weight = max((k for k in metadata if k.startswith("model.")), key=lambda k: len(metadata[k].chunks))
print(f"{path.name}: {len(metadata)} entries; {weight} is {tuple(metadata[weight].size)}, saved as boxes")
for chunk in metadata[weight].chunks:
    print(f"  offsets {tuple(chunk.offsets)}, sizes {tuple(chunk.sizes)}")
assert sum(c.sizes.numel() for c in metadata[weight].chunks) == metadata[weight].size.numel(), "boxes tile it"

# %% [markdown]
# The boxes tile the global weight exactly, and none of them knows it came from a flat buffer.
#
# ## 3. Resharding: another stage, another world size, another library
#
# Now `RESUME_SIZE` ranks load that checkpoint as **ZeRO-3** (the parameters sharded too) and
# train `STEPS` more steps. The flat buffers are padded for `RESUME_SIZE` ranks now, and each
# rank's slice starts elsewhere; DCP reads every new box from the saved boxes that overlap it.
# The loader resumes at sample `12 * STEPS`, the one the old ranks would have read next.
#
# Tolerance 1e-10: the layouts sum the same gradients in other orders, so float64 rounding
# differs in the last bits (about 1e-14 here). A dropped piece of padding, a box at the wrong
# offset or a forgotten Adam step count is off by 1e-4 or more.

# %%
TOL = 1e-10


def assert_same_training_state(got: dict, want: dict, what: str) -> float:
    worst = 0.0
    for key in (k for k in want if k.startswith(("model.", "optim."))):
        assert key in got, f"{what}: no {key}"
        worst = max(worst, (got[key].double() - want[key].double()).abs().max().item())
    assert worst <= TOL, f"{what}: differs from the uninterrupted run by {worst:.3g}"
    assert (got["meta.step"], got["meta.next_sample"]) == (want["meta.step"], want["meta.next_sample"])
    return worst


resumed = Cluster(RESUME_SIZE)
first = resumed.run(train_zero_and_save, ROOT / "zero3", 3, STEPS, ROOT / "zero1")
assert first == [STEPS * GLOBAL_BATCH] * RESUME_SIZE, "the loader resumes where the old ranks stopped"
assert_same_training_state(
    read_whole(latest_checkpoint(ROOT / "zero3")), reference, f"ZeRO-1 x{WORLD_SIZE} -> ZeRO-3 x{RESUME_SIZE}"
)
print(
    f"ZeRO-1 on {WORLD_SIZE} ranks -> ZeRO-3 on {RESUME_SIZE}: every weight and Adam state equals the "
    f"uninterrupted run's after {STEPS} more steps (to {TOL:g})"
)

# %% [markdown]
# The keys are the ones PyTorch's own `get_state_dict` gives an FSDP2 model (`model.<name>`,
# `optim.state.<name>.exp_avg`, ...), so the same files load into `fully_shard`. For FSDP2 the
# course writes nothing of its own: `get_state_dict` hands out DTensors, DCP fills them,
# `set_state_dict` puts them back.
#
# Every layout the course trains saves under these keys, each rank writing only its own boxes: a
# TP shard is one box of its weight, a pipeline stage names its blocks as the whole model does, an
# expert-parallel rank saves its experts under their global numbers, and ZeRO inside a composition
# (chapter 09) cuts TP's shards into runs. `tests/test_checkpoint.py` resumes each of them on
# another layout: dp 2 x tp 2 with ZeRO-1 as ZeRO-3 on 3 ranks, tp 2 x pp 2 as 2 ranks of plain
# data parallelism, and a mixture of experts as ep 2 x pp 2 with ZeRO-1 as ZeRO-2 on 2 ranks.


# %%
def train_fsdp2_and_save(ctx, root, steps, resume_from):
    model = fsdp2(fresh_model(ctx.device), device_mesh_1d(ctx))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = SampleLoader(CFG, GLOBAL_BATCH, SEED, ctx.rank, ctx.world_size, ctx.device)
    done = load_checkpoint(latest_checkpoint(resume_from), model, optimizer, loader=data)["step"]
    run_steps(model, data, steps, optimizer)
    save_checkpoint(root, done + steps, model, optimizer, loader=data)


resumed.run(train_fsdp2_and_save, ROOT / "fsdp2", STEPS, ROOT / "zero1")
assert_same_training_state(
    read_whole(latest_checkpoint(ROOT / "fsdp2")), reference, f"ZeRO-1 x{WORLD_SIZE} -> FSDP2 x{RESUME_SIZE}"
)
print(f"ZeRO-1 on {WORLD_SIZE} ranks -> torch's FSDP2 on {RESUME_SIZE}: the same state after {STEPS} more steps")

# %% [markdown]
# ## 4. Checkpointing without stopping
#
# A blocking save stops training for as long as the slowest rank takes to write. An
# asynchronous save splits it: first copy this rank's state to host memory (fast, the step waits
# for it), then write the copy from a background thread while the next steps compute. DCP's
# `async_save` does the second part; it needs its own process group, so that its collectives
# never interleave with training's. `save_checkpoint_async` returns a handle; `wait()` finishes
# the write and commits the checkpoint (below). We time a step with each kind of save beside a
# step with none.


# %%
def time_saves(ctx, root, steps):
    model, zero, data = build(ctx, 1)
    run_steps(model, data, 1, zero)  # warm up
    seconds = {}
    for kind in ("no save", "blocking save", "background save"):
        wait_for_device(ctx.device)  # on a GPU: time the steps' kernels, not their launches
        pending, start = None, time.perf_counter()
        for step in range(steps):
            run_steps(model, data, 1, zero)
            if pending is not None:
                pending.wait()
            if kind == "blocking save":
                save_checkpoint(root / "blocking", step, model, zero, loader=data)
            elif kind == "background save":
                pending = save_checkpoint_async(root / "background", step, model, zero, loader=data)
        if pending is not None:
            pending.wait()
        wait_for_device(ctx.device)
        seconds[kind] = (time.perf_counter() - start) / steps
    return seconds


timings = cluster.run(time_saves, ROOT / "timing", 3 if QUICK else 10)[0]
fig = Figure(figsize=(6, 2.2))
ax = fig.subplots()
ax.barh(list(timings), [1000 * s for s in timings.values()], color=["#999", "#c44", "#48c"])
ax.set_xlabel("milliseconds per step (rank 0, this machine)")
ax.invert_yaxis()
fig.tight_layout()
fig

# %% [markdown]
# On this CPU machine the numbers are small and noisy: the model is tiny and "storage" is a local
# disk. What matters is the arithmetic at scale. With bf16 weights, fp32 master weights and
# Adam's two fp32 moments, a checkpoint holds 2 + 4 + 4 + 4 = 14 bytes per parameter (gradients
# are not saved: the next step makes new ones).

# %%
psi = count_params(LLAMA3_405B)
for ranks, gb_s in ((1, 5.0), (2048, 5.0), (16384, 5.0)):
    seconds = checkpoint_seconds(psi, 14, gb_s, ranks)
    print(
        f"{psi / 1e9:.0f}B parameters x 14 bytes = {psi * 14 / 1e12:.1f} TB; {ranks:>5} rank{'s' if ranks > 1 else ' '} writing at "
        f"{gb_s:g} GB/s each: {seconds:,.1f} s"
    )
assert checkpoint_seconds(1e9, 14, 1.0, 1) == 14.0

# %% [markdown]
# One writer would need about twenty minutes; thousands of ranks writing their own shares bring
# it to under a second, *if* the file system keeps up (a parallel file system gives some TB/s in
# all: then the whole job's bandwidth, not the ranks', is the limit).
#
# ## 5. A rank killed in the middle of a step, and in the middle of a save
#
# A checkpoint must never be half-loaded. `save_checkpoint` writes into `step-N.partial`; only
# when every rank's files and DCP's metadata are written, and every rank has passed a barrier,
# does rank 0 rename it to `step-N` (a rename is atomic on one file system). A rank that dies
# before the barrier fails it, so the directory stays `.partial`, and `latest_checkpoint` never
# returns it.
#
# Three runs of ZeRO-2 on `WORLD_SIZE` ranks, saving every step. In the first, the last rank
# SIGKILLs itself inside the save of step 2. The runtime reports the death, and the next call
# restarts all ranks. The second run resumes from the last *complete* checkpoint (step 1),
# and rank 0 dies in the middle of step 3. The third run resumes from step 2 and finishes.


# %%
def run_with_failures(ctx, root, last_step, kill=None):
    model, zero, data = build(ctx, 2)
    path = latest_checkpoint(root)
    done = 0 if path is None else load_checkpoint(path, model, zero, loader=data)["step"]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    for step in range(done + 1, last_step + 1):
        if kill == (ctx.rank, step, "step"):
            data.next_batch().loss(model)  # a forward ... and the process is gone
            die()
        run_steps(model, data, 1, zero)
        dies_in_save = kill == (ctx.rank, step, "save")
        save_checkpoint(root, step, model, zero, loader=data, before_commit=die if dies_in_save else None)
    return done


root = ROOT / "failures"
last = WORLD_SIZE - 1
plan = [((last, 2, "save"), [1]), ((0, 3, "step"), [1, 2]), (None, list(range(1, 2 * STEPS + 1)))]
for attempt, (kill, complete_after) in enumerate(plan, start=1):
    try:
        started = cluster.run(run_with_failures, root, 2 * STEPS, kill, timeout=120)[0]
        print(f"run {attempt}: resumed after step {started}, finished step {2 * STEPS}")
    except RankError as error:
        (dead,) = [r for r, f in error.failures.items() if f.type_name == "died"]
        where = f"the save of step {kill[1]}" if kill[2] == "save" else f"the middle of step {kill[1]}"
        print(
            f"run {attempt}: rank {dead} died in {where}; complete checkpoints: "
            f"{checkpoint_steps(root)}, so step {kill[1]} is redone"
        )
    assert checkpoint_steps(root) == complete_after, checkpoint_steps(root)
assert_same_training_state(read_whole(latest_checkpoint(root)), reference, "killed twice, resumed")
print("after two deaths the run ends with the uninterrupted run's weights and optimizer state")

# %% [markdown]
# ## 6. How often to save: Young and Daly
#
# Saving every `τ` seconds of compute costs `C` per save; a failure (on average every `M`
# seconds, the job's mean time between failures) throws away on average half an interval.
# Balancing the two, Young (1974) found the best interval
#
# $$\tau_\text{Young} = \sqrt{2\,C\,M}.$$
#
# Daly (2006) kept the terms Young dropped (failures during a save or a restart, failures random
# in time rather than evenly spread); for $C < 2M$,
#
# $$\tau_\text{Daly} = \sqrt{2CM}\left(1 + \tfrac{1}{3}\sqrt{\tfrac{C}{2M}} + \tfrac{1}{9}\,\tfrac{C}{2M}\right) - C .$$
#
# When saves are cheap next to `M` the two agree; when they are slow, Daly's is shorter. We check
# both against seeded runs with random failures, for a cheap save and for a slow one.

# %%
RUNS = 40 if QUICK else 400
WORK = 20_000.0  # seconds of useful compute
fig = Figure(figsize=(9, 3))
for ax, (c, m) in zip(fig.subplots(1, 2), [(10.0, 1000.0), (300.0, 600.0)]):
    young, daly = young_interval(c, m), daly_interval(c, m)
    taus = sorted({young * f for f in (0.25, 0.4, 0.6, 0.8, 1.0, 1.25, 1.6, 2.5, 4.0)} | {daly})
    lost = {tau: simulate_run(WORK, tau, c, m, runs=RUNS, seed=SEED) for tau in taus}
    best = min(lost, key=lost.get)
    ax.plot(taus, [lost[t] / 3600 for t in taus], "o-", color="#555")
    ax.axvline(young, color="#c44", label=f"Young {young:.0f} s")
    ax.axvline(daly, color="#48c", ls="--", label=f"Daly {daly:.0f} s")
    ax.set(
        xscale="log", xlabel="compute between saves τ (s)", ylabel="time lost (h)", title=f"C = {c:g} s, M = {m:g} s"
    )
    ax.legend(fontsize=8)
    assert lost[daly] <= 1.05 * lost[best], "Daly's interval loses within 5% of the best one tried"
    print(
        f"C = {c:g} s, M = {m:g} s: time lost at Young's {young:.0f} s: {lost[young] / 3600:.2f} h, at Daly's "
        f"{daly:.0f} s: {lost[daly] / 3600:.2f} h; the least of the {len(taus)} intervals tried: "
        f"{lost[best] / 3600:.2f} h"
    )
fig.tight_layout()
fig

# %% [markdown]
# ## 7. What PyTorch does for you, and what the course writes
#
# - **DCP** (`torch.distributed.checkpoint`) does the heavy lifting: planning who writes which
#   chunk, removing duplicates of replicated tensors, one file per rank plus `.metadata`, and on
#   load reading each requested box from whatever saved chunks overlap it. `async_save` writes in
#   the background. `dcp_to_torch_save` reads a checkpoint whole into one process.
# - **`get_state_dict` / `set_state_dict`** give and take an FSDP2 (or DDP, or plain) model's and
#   optimizer's state as global DTensors under fully qualified names; the course uses them as they
#   are for FSDP2, and uses their key names for everything else.
# - **The course writes** three things. (1) ZeRO's flat runs as boxes (`Pieces`, `flat_boxes`):
#   DCP knows DTensors, which are one box per rank, and a run of a flat buffer is not a box; the
#   planners' `lookup_object` / `lookup_tensor` hooks are where DCP lets a caller say what a chunk
#   is. (2) The atomic commit: DCP writes into the directory it is given and has no notion of a
#   finished checkpoint, so the `.partial` directory, the barrier and the rename are ours (a real
#   job would also keep the last few and delete older ones). (3) The loader's position in samples.
# - **Next step:** torchft (PyTorch's fault-tolerance library) keeps training *through* a failure:
#   replica groups (whole copies of the model, as in HSDP) that drop out and rejoin while the others
#   keep stepping, with a healthy replica sending its state to the new one instead of everyone
#   reloading from storage.
#
# ## Your turn
# Open [exercises/a4_checkpoints_and_failures_exercises.ipynb](../exercises/a4_checkpoints_and_failures_exercises.ipynb):
# reshard ZeRO's padded optimizer state from one number of ranks to another without losing Adam's
# step count, cut a flat run of a weight into the fewest boxes of the global tensor, find the
# samples each rank of a new dp x pp x tp mesh trains on first after a resume, compute Daly's
# checkpoint interval for a whole job from one node's mean time between failures, and write an
# atomic save (temporary directory, barrier, one rename) for a process group that is not the world.
# Each exercise's `check(...)` cell grades it on the spot;
# `make grade NB=work/exercises/a4_checkpoints_and_failures_exercises.ipynb` grades the whole
# notebook from a terminal.

# %%
cluster.close()
resumed.close()
shutil.rmtree(ROOT, ignore_errors=True)  # the checkpoints of this notebook
