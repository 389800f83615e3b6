# %% [markdown]
# # 03 · ZeRO: stop storing the same thing N times
#
# Data parallelism (chapter 02) gives every rank a full replica of the model and splits the
# batch. It scales the *throughput*, but not the *memory*: every rank still holds every
# parameter, every gradient and every optimizer state. ZeRO (the Zero Redundancy Optimizer of
# DeepSpeed, and PyTorch's FSDP) removes that duplication in three stages, each sharding one more
# kind of state across the $N_d$ data-parallel ranks.
#
# In this notebook you will
# 1. derive what each ZeRO stage costs per GPU, check the book's numbers and see how far each
#    stage can go as $N_d$ grows;
# 2. train the course GPT with ZeRO-1, ZeRO-2 and ZeRO-3 on a cluster of ranks and check that
#    they land on the same weights as plain data parallelism with Adam, and as PyTorch's FSDP2
#    `fully_shard`;
# 3. **measure** each rank's bytes and each step's communication and compare them with the
#    formulas, down to the last padded element;
# 4. look at per-rank timelines of ZeRO-3 with and without prefetching, and see why
#    prefetching stops hiding the communication when $N_d$ gets very large.
#
# The implementation is `lib/ultrascale/parallel/zero.py` (under 400 lines, applied to the model
# from outside: the model does not know it is sharded).

# %% tags=["parameters"]
WORLD_SIZE = 4  # data-parallel ranks N_d: any value of at least 2 works (3 shows the padding)
QUICK = True  # True: a small model and 3 steps, about 20 s on 2 CPU cores; False: a larger model and 10 steps (longer)
SEED = 0

# %%
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import math
import time

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display
from matplotlib.figure import Figure
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from ultrascale.comm import AlphaBeta, CommLogger, wait_for_device
from ultrascale.data import Batches
from ultrascale.memory import GB, model_state_bytes, zero_bytes_per_rank, zero_formula_bytes
from ultrascale.model import GPT, GPTConfig, count_params
from ultrascale.parallel import NaiveDataParallel, Timeline, ZeRO, covered_seconds, overlap_seconds
from ultrascale.parallel.fsdp import apply_fsdp, full_state_dict
from ultrascale.parallel.sharded_muon import Muon
from ultrascale.parity import assert_replicas_identical, assert_same, device_mesh_1d, fsdp2, max_difference, tolerance
from ultrascale.train import OPTIMIZERS, make_optimizer, run_steps, train, weights
from ultrascale.viz.gantt import plot_gantt
from ultrascale.viz.live import ProgressBar

torch.manual_seed(SEED)
assert WORLD_SIZE >= 2, "ZeRO shards state across ranks: use WORLD_SIZE >= 2"
# Figures are matplotlib Figure objects that a cell shows by returning them. Loading the
# notebook's plotting backend now lets Jupyter draw them as images from the first one on
# (headless, with the Agg backend, they show as text).
plt.switch_backend(plt.get_backend())

# %% [markdown]
# ## 1. What plain data parallelism repeats
#
# Follow one parameter through a mixed-precision training step with Adam and count its bytes:
#
# | item | precision | bytes per parameter |
# |---|---|---|
# | the weight used by forward and backward | bf16 | 2 |
# | its gradient | bf16 | 2 |
# | the fp32 "master" copy the optimizer updates | fp32 | 4 |
# | Adam's first moment (momentum) | fp32 | 4 |
# | Adam's second moment (variance) | fp32 | 4 |
#
# The last three belong to the optimizer: call their total $k$ bytes per parameter, so $k = 12$
# for Adam. A model of $\Psi$ parameters therefore needs $2\Psi + 2\Psi + k\Psi = 16\Psi$ bytes of
# model state, or $2\Psi + 6\Psi + 12\Psi = 20\Psi$ if the gradients are also accumulated in an
# fp32 buffer (as some frameworks do for accuracy).
#
# With data parallelism over $N_d$ ranks, all of this is stored $N_d$ times, and after the
# all-reduce every copy holds exactly the same values. The only thing that genuinely differs
# between ranks is the **activations**: each rank pushed its own micro-batch through the model.
# That is also why ZeRO cannot shard activations: they are not copies of each other, so there is
# no redundancy to remove (chapter 01's recomputation and later chapters' tensor, sequence and
# context parallelism deal with them).
#
# ZeRO keeps one $1/N_d$ slice of each redundant state per rank:
#
# | stage | what is sharded | bytes per GPU |
# |---|---|---|
# | DP baseline | nothing | $2\Psi + 2\Psi + k\Psi$ |
# | ZeRO-1 | optimizer states | $2\Psi + 2\Psi + k\Psi/N_d$ |
# | ZeRO-2 | + gradients | $2\Psi + (2\Psi + k\Psi)/N_d$ |
# | ZeRO-3 | + parameters | $(2\Psi + 2\Psi + k\Psi)/N_d$ |
#
# We write the four formulas out and check them against the library's memory model, which the
# rest of the course uses.


# %%
def per_gpu_bytes(psi, k, nd):
    """The four per-GPU formulas, written exactly as in the table above."""
    return {
        "DP": 2 * psi + 2 * psi + k * psi,
        "ZeRO-1": 2 * psi + 2 * psi + k * psi / nd,
        "ZeRO-2": 2 * psi + (2 * psi + k * psi) / nd,
        "ZeRO-3": (2 * psi + 2 * psi + k * psi) / nd,
    }


for psi in (1e6, 7.5e9, 70e9):
    for k in (8, 12, 16):
        for nd in (1, 2, 3, 8, 64, 1000):
            ours = per_gpu_bytes(psi, k, nd)
            for stage, name in enumerate(ours):
                library = sum(zero_bytes_per_rank(psi, stage, nd, k).values())
                assert math.isclose(ours[name], library, rel_tol=1e-12), (psi, k, nd, name)

# 16 bytes per parameter without fp32 gradient accumulation, 20 with it.
assert sum(model_state_bytes(1000).values()) == 16 * 1000
assert sum(model_state_bytes(1000, fp32_grad_accum=True).values()) == 20 * 1000

# %% [markdown]
# ### The book's example: 7.5 billion parameters on 64 GPUs
# With $\Psi = 7.5\text{B}$, Adam ($k = 12$) and $N_d = 64$, the formulas give 120 GB per GPU
# for plain DP (no GPU has that much), then 31.41, 16.64 and 1.875 GB for the three stages.

# %%
example = {name: b / GB for name, b in per_gpu_bytes(7.5e9, 12, 64).items()}
for name, gb in example.items():
    print(f"{name:>7}: {gb:8.3f} GB per GPU")
assert round(example["DP"], 2) == 120.00
assert round(example["ZeRO-1"], 2) == 31.41
assert round(example["ZeRO-2"], 2) == 16.64
assert round(example["ZeRO-3"], 3) == 1.875

# %% [markdown]
# ### How far can each stage go?
# Divide the baseline by each stage's formula. As $N_d \to \infty$ the sharded terms vanish and
# what is left is the part each stage does not shard:
# - ZeRO-1 keeps $2\Psi + 2\Psi$: the saving tends to $16/4 = 4\times$;
# - ZeRO-2 keeps $2\Psi$: the saving tends to $16/2 = 8\times$, the book's "up to 8x";
# - ZeRO-3 keeps nothing whole: the saving is exactly $N_d$, without limit.


# %%
def saving(stage, nd, k=12):
    formulas = per_gpu_bytes(1.0, k, nd)
    return formulas["DP"] / formulas[stage]


nds = 2 ** np.arange(0, 21)
zero2 = np.array([saving("ZeRO-2", nd) for nd in nds])
assert np.all(np.diff(zero2) > 0) and np.all(zero2 < 8), "ZeRO-2's saving grows towards 8 but never reaches it"
assert math.isclose(saving("ZeRO-2", 1e12), (2 + 2 + 12) / 2, rel_tol=1e-9)  # the limit: 16/2 = 8
assert math.isclose(saving("ZeRO-1", 1e12), (2 + 2 + 12) / 4, rel_tol=1e-9)  # and 16/4 = 4
assert all(math.isclose(saving("ZeRO-3", nd), nd) for nd in (2, 64, 1024))
print("ZeRO-2 saving at N_d = 1, 8, 64, 512:", ", ".join(f"{saving('ZeRO-2', nd):.2f}x" for nd in (1, 8, 64, 512)))

# %%
STAGES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
COLOURS = {"DP": "#555555", "ZeRO-1": "#4c72b0", "ZeRO-2": "#dd8452", "ZeRO-3": "#55a868"}
nd_axis = 2 ** np.arange(0, 11)
fig = Figure(figsize=(11, 3.8), layout="constrained")
left, right = fig.subplots(1, 2)
for name in STAGES:
    left.plot(
        nd_axis,
        [per_gpu_bytes(7.5e9, 12, nd)[name] / GB for nd in nd_axis],
        "o-",
        ms=3,
        color=COLOURS[name],
        label=name,
    )
    right.plot(nd_axis, [saving(name, nd) for nd in nd_axis], "o-", ms=3, color=COLOURS[name], label=name)
left.axhline(80, color="k", ls=":", lw=1)
left.text(1, 85, "80 GB (one H100)", fontsize=8)
left.set(
    xscale="log",
    yscale="log",
    xlabel="data-parallel degree $N_d$",
    ylabel="GB per GPU",
    title="model state of a 7.5B model, Adam (k = 12)",
)
for limit, label in ((4, "ZeRO-1 limit 4x"), (8, "ZeRO-2 limit 8x")):
    right.axhline(limit, color="k", ls=":", lw=1)
    right.text(1, limit * 1.08, label, fontsize=8)
right.set(
    xscale="log",
    yscale="log",
    xlabel="data-parallel degree $N_d$",
    ylabel="saving over plain DP",
    title="memory saved by each stage",
)
for ax in (left, right):
    ax.set_xticks(nd_axis[::2], [str(n) for n in nd_axis[::2]])
right.legend(fontsize=8)
fig

# %% [markdown]
# Only ZeRO-3 brings the 7.5B model's state under a few GB; ZeRO-2 flattens out at 15 GB,
# the unsharded bf16 parameters. The formulas leave out activations, which ZeRO does not touch.
#
# ## 2. ZeRO on a real cluster
#
# ### Flat buffers and padding
# Sharding "a slice of each state" needs a way to cut a model into $N_d$ equal pieces. The
# library groups parameters into **units**: each transformer block is one, and everything else
# (the embedding, tied to the output head, and the final norm) forms a *root* unit. A unit's
# parameters are copied into one flat 1-D buffer, and the parameters become views into it. Rank
# $r$ owns elements $[r\,s, (r+1)\,s)$ of that buffer, with $s = \lceil n / N_d \rceil$.
#
# When $N_d$ does not divide the unit's size $n$, the buffer is **padded** with zeros up to
# $s \cdot N_d$ elements, so every collective sees equal pieces. Here is the course model at this
# notebook's world size (run it with `WORLD_SIZE = 3` to see non-zero padding).

# %%
if QUICK:
    CFG = GPTConfig(vocab_size=128, hidden=32, layers=4, heads=2, seq_len=16)
else:
    CFG = GPTConfig(vocab_size=256, hidden=64, layers=6, heads=4, seq_len=32)
PSI = count_params(CFG)
MBS = 2  # sequences per rank per step
STEPS = 3 if QUICK else 10
print(
    f"course GPT: {CFG.layers} blocks, hidden {CFG.hidden}, vocabulary {CFG.vocab_size}: "
    f"Psi = {PSI:,} parameters; Psi mod {WORLD_SIZE} = {PSI % WORLD_SIZE}"
)

cluster = Cluster(WORLD_SIZE)
print(cluster)


# %%
def unit_layout(ctx):
    torch.manual_seed(SEED)
    zero = ZeRO(GPT(CFG).to(ctx.device), stage=1, optimizer_cls=torch.optim.SGD, lr=0.1)
    return [(u.name, u.numel, u.padded, u.shard_numel, (u.own.start, u.own.stop)) for u in zero.all_units]


layouts = cluster.run(unit_layout)
print(f"{'unit':>7} {'elements':>9} {'padded':>8} {'padding':>8} {'shard':>6}   rank 0 owns")
for name, numel, padded, shard, own in layouts[0]:
    print(f"{name:>7} {numel:>9,} {padded:>8,} {padded - numel:>8} {shard:>6,}   [{own[0]:,}, {own[1]:,})")
for rank, layout in enumerate(layouts):
    for name, numel, padded, shard, (start, stop) in layout:
        assert padded == shard * WORLD_SIZE and 0 <= padded - numel < WORLD_SIZE, name
        assert (start, stop) == (rank * shard, (rank + 1) * shard), "rank r owns the r-th slice"
assert sum(numel for _, numel, *_ in layouts[0]) == PSI

# %% [markdown]
# ### One ZeRO-1 step, and what ZeRO-2 and ZeRO-3 change
# Each rank keeps fp32 master weights and Adam's moments **only for its own slice**. A step:
#
# 1. forward and backward as usual, with the full parameters, on this rank's micro-batch;
# 2. **reduce-scatter** the gradients: rank $r$ receives the sum over ranks of slice $r$ only
#    (divided by $N_d$, the average);
# 3. the optimizer updates slice $r$ of the fp32 master weights with slice $r$ of Adam's state;
# 4. **all-gather** the updated slices, cast to the parameter precision, so every rank has the
#    full new parameters for the next forward.
#
# A reduce-scatter followed by an all-gather is exactly what a ring all-reduce does internally
# (chapter a0), so ZeRO-1 sends the same bytes as plain DP and stores far less. The difference is
# that the optimizer now sits between the two halves.
#
# That all-gather is new waiting time after the optimizer step, and there are two places to hide
# it: start sending each slice as soon as the optimizer has updated it, while it updates the next
# (overlap with the step), or gather each layer's parameters just before the next forward needs
# them (overlap with the forward, layer by layer, which is ZeRO-3's prefetch in disguise). Both
# are fiddly to write by hand. The book suggests getting the second from PyTorch's FSDP by making
# the whole model one FSDP unit, but that is the one layout that cannot overlap: a unit is gathered
# in one piece, so the whole model's parameters arrive at once, before its first layer runs. The
# layer-by-layer overlap needs one FSDP unit per block (as the FSDP2 comparison below wraps it), so
# that block $i+1$ travels while block $i$ computes; keeping each block gathered from its forward
# to its backward (FSDP2's `reshard_after_forward=False`) then skips ZeRO-3's second gather. Our
# ZeRO-1/2 launch all units' all-gathers at once after the optimizer step and wait for them at the
# end of the step.
#
# - **ZeRO-2** does not keep the full gradient: each unit's gradients are reduce-scattered as soon
#   as backward has produced them, and the full gradient buffer is dropped. Only this rank's
#   slice of the averaged gradient lives until the optimizer step. With gradient accumulation in
#   FP32 (20 bytes per parameter instead of 16, chapter 01), the FP32 buffer shrinks the same
#   way: each rank accumulates only its $1/N_d$ slice, so it costs $4\Psi/N_d$, not $4\Psi$.
# - **ZeRO-3** does not keep the full parameters either. Each rank stores its slice; just before a
#   unit's forward its parameters are all-gathered, and after the forward they are freed. Backward
#   needs them again, so they are gathered a second time, used, then freed once the unit's
#   gradients are reduce-scattered. After the optimizer step there is nothing to all-gather: each
#   rank simply writes its updated slice.
#
# ### Same results as plain data parallelism
# The references: one process training on the whole batch with Adam, and plain data
# parallelism (`NaiveDataParallel` from chapter 02, full Adam on every rank). Every run starts from
# the same seed and sees the same data: at step $t$ the global batch has $N_d \cdot$ `MBS`
# sequences, and rank $r$ takes rows $[r \cdot$ `MBS`$, (r+1) \cdot$ `MBS`$)$. The course's parity
# harness (`ultrascale.parity`, met in chapter 02) makes the batches and runs the one training loop.

# %%
DATA = Batches(CFG, mbs=MBS, seed=SEED)


def local_batches(ctx):
    return DATA.rank_stream(ctx.rank, ctx.world_size)


def fresh_model():
    torch.manual_seed(SEED)
    return GPT(CFG)


def train_single_process(opt_name, world_size):
    return train(fresh_model(), DATA.global_stream(world_size), STEPS, opt_name)


def train_dp(ctx, opt_name):
    model = fresh_model().to(ctx.device)  # the same initial weights on every rank, then moved
    dp = NaiveDataParallel(model)  # all-reduce and average the gradients after backward
    return train(
        model,
        local_batches(ctx),
        STEPS,
        opt_name,
        module=dp,
        after_backward=dp.finish_gradient_synchronization,
        device=ctx.device,
    )


def train_zero(ctx, stage, opt_name, prefetch=True):
    model = fresh_model().to(ctx.device)
    cls, kwargs = OPTIMIZERS[opt_name]
    zero = ZeRO(model, stage=stage, optimizer_cls=cls, prefetch=prefetch, **kwargs)  # also the optimizer
    run_steps(model, local_batches(ctx), STEPS, zero, device=ctx.device)
    return zero.full_state_dict()  # ZeRO-3 gathers its shards for this


# %%
single = train_single_process("adam", WORLD_SIZE)
runs = {
    "DP": (train_dp, "adam"),
    "ZeRO-1": (train_zero, 1, "adam"),
    "ZeRO-2": (train_zero, 2, "adam"),
    "ZeRO-3": (train_zero, 3, "adam"),
    "ZeRO-3, no prefetch": (train_zero, 3, "adam", False),
}
results = {name: cluster.run(*call) for name, call in ProgressBar("training each variant").iterate(runs.items())}

# %% [markdown]
# **Tolerance.** Everything runs in fp32, but the gradients are summed in different orders: over
# the whole batch in one process, by gloo's all-reduce in DP, by its reduce-scatter in ZeRO. The
# results therefore differ in the last bits (relative differences around $10^{-7}$). Adam divides
# each update by $\sqrt{v}$, which magnifies a last-bit difference wherever a gradient is nearly
# zero (we saw $1.8 \times 10^{-5}$ on a few embedding rows of rare tokens at 5 ranks), but it
# never moves a weight by much more than the learning rate ($10^{-3}$) per step. We allow
# $5 \times 10^{-5}$ absolute, 5% of one step's move: a wrong average, a missed slice or a stale
# shard would be off by far more (and the SGD comparison below, where nothing is magnified, uses
# a tolerance ten times tighter). All ranks must end with *identical* parameters, since the all-gather
# copies the same values everywhere.

# %%
TOL, SGD_TOL = tolerance("adam"), tolerance("sgd")  # ultrascale.parity.TOLERANCES, with the reasons


reference = results["DP"][0]
assert_same(reference, single, "DP against one process", optimizer="adam")
for name, per_rank in results.items():
    assert_replicas_identical(per_rank, name)
    assert_same(per_rank[0], reference, f"{name} against DP", optimizer="adam")
print(
    f"after {STEPS} Adam steps on {WORLD_SIZE} ranks, every run matches plain DP within "
    f"atol={TOL['atol']}, rtol={TOL['rtol']}; all ranks hold identical weights"
)

# %% tags=["nbval-ignore-output"]
# The measured differences (machine-dependent last bits, so not compared in CI)
print(f"{'run':>20}  max |w - w_DP|")
print(f"{'one process':>20}  {max_difference(single, reference):.1e}")
for name, per_rank in results.items():
    print(f"{name:>20}  {max_difference(per_rank[0], reference):.1e}")

# %% [markdown]
# Adam has a blind spot for this test: it divides the gradient by its own running magnitude, so a
# gradient that is summed instead of averaged gives almost the same update. Plain SGD does not
# forgive that, so we repeat the comparison with SGD.

# %%
reference_sgd = cluster.run(train_dp, "sgd")[0]
for stage in ProgressBar("ZeRO-1, 2 and 3 with SGD").iterate((1, 2, 3)):
    assert_same(cluster.run(train_zero, stage, "sgd")[0], reference_sgd, f"ZeRO-{stage} with SGD", optimizer="sgd")
print("ZeRO-1, 2 and 3 also match plain DP with SGD: the gradients are averaged, not summed")


# %% [markdown]
# ### Same results as PyTorch's FSDP2
# PyTorch's own ZeRO-3 is FSDP (*Fully Sharded Data Parallel*); its current version, FSDP2, is
# the function `fully_shard`. We apply it to the same units (each block, then the whole model for
# the rest), train with the same data and optimizer, and compare. FSDP2 runs on a CPU gloo mesh.
# While it trains we also log its collectives, for section 3.


# %%
def train_fsdp2(ctx):
    model = fsdp2(fresh_model().to(ctx.device), device_mesh_1d(ctx))  # fully_shard each block, then the whole model
    optimizer = make_optimizer(model.parameters(), "adam")
    run_steps(model, local_batches(ctx), STEPS - 1, optimizer, device=ctx.device)
    with CommLogger() as log:  # the last step's collectives
        run_steps(model, local_batches(ctx), 1, optimizer, device=ctx.device, first_step=STEPS - 1)
    shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    return weights(model), log.totals(), shards


fsdp = cluster.run(train_fsdp2, timeout=300)
for stage in (1, 2, 3):
    assert_same(results[f"ZeRO-{stage}"][0], fsdp[0][0], f"ZeRO-{stage} against FSDP2", optimizer="adam")
assert_same(fsdp[0][0], reference, "FSDP2 against DP", optimizer="adam")
print("ZeRO-1, 2 and 3 match FSDP2 fully_shard on the same model and data")

# %% [markdown]
# ## 3. Measured, not only computed
#
# ### Bytes per rank against the formulas
# Now the book's byte widths: bf16 parameters and gradients (2 bytes each), fp32 master weights
# and Adam moments ($k = 12$). For each stage we train two steps, then ask every rank what it
# actually holds: the storage of its parameter buffers, gradient buffers, master weights and
# optimizer states (`ZeRO.state_bytes`). Stage 0 is the same machinery without sharding: the DP
# baseline with an all-reduce. `CommLogger` records every collective of the second step.
#
# For ZeRO-3 we sample the parameter bytes at every block's forward and backward too: the
# at-rest number is not the whole story, because gathered units exist for a while.


# %%
def measure_stage(ctx, stage, units=None):
    model = fresh_model().to(ctx.device)
    zero = ZeRO(model, stage=stage, units=units, param_dtype=torch.bfloat16, lr=1e-3)
    peak = {"parameters": 0}

    def sample():
        peak["parameters"] = max(peak["parameters"], zero.state_bytes()["parameters"])

    def after_forward(module, args, output):
        output.register_hook(lambda grad: sample())  # runs after ZeRO's own pre-backward gather

    for block in model.blocks:  # registered after ZeRO's hooks, so they see what ZeRO gathered
        block.register_forward_pre_hook(lambda module, args: sample())
        block.register_forward_hook(after_forward)

    for step in range(2):
        with CommLogger() as log:  # the second step's collectives are kept
            run_steps(model, local_batches(ctx), 1, zero, device=ctx.device, first_step=step)
    return {
        "state": zero.state_bytes(),
        "formula": zero_formula_bytes(zero, k=12),
        "peak": peak["parameters"],
        "comm": log.totals(),
        "calls": log.collective_elements(),
        "units": [(u.name, u.numel, u.padded) for u in zero.all_units],
    }


measured = {stage: cluster.run(measure_stage, stage) for stage in (0, 1, 2, 3)}

# %% [markdown]
# The formula counts $\Psi$ elements; the buffers hold padded units. So the exact prediction
# replaces $\Psi$ by the padded sizes (a sharded state holds $s$ elements per unit, an unsharded one
# $s \cdot N_d$), and adds one thing the formula ignores: PyTorch's Adam keeps a `step` counter per
# parameter tensor, a 4-byte fp32 scalar, and our optimizer sees one fp32 master tensor per unit.
# The measurement must equal that prediction exactly, and stay within 2% of the book's formula.


# %%
def exact_prediction(out, stage, n):
    padded = sum(p for _, _, p in out["units"])
    shard = padded // n if stage > 0 else padded  # stage 0 keeps every element
    units = len(out["units"])
    return {
        "parameters": 2 * (shard if stage >= 3 else padded),
        "gradients": 2 * (shard if stage >= 2 else padded),
        "optimizer states": 12 * shard + 4 * units,
    }


KINDS = ("parameters", "gradients", "optimizer states")
print(f"per-rank bytes at N_d = {WORLD_SIZE}, bf16 parameters and gradients, Adam (Psi = {PSI:,})")
print(f"{'stage':>6} " + " ".join(f"{k + ' meas./formula':>30}" for k in KINDS) + f" {'total/formula':>14}")
for stage, per_rank in measured.items():
    for out in per_rank:
        assert out["state"] == exact_prediction(out, stage, WORLD_SIZE), (stage, out["state"])
        for kind in KINDS:
            assert abs(out["state"][kind] / out["formula"][kind] - 1) < 0.02, (stage, kind)
    out = per_rank[0]
    cells = [f"{out['state'][k]:>12,} / {out['formula'][k]:>12,.0f}  " for k in KINDS]
    ratio = sum(out["state"].values()) / sum(out["formula"].values())
    print(f"{stage:>6} " + " ".join(cells) + f" {ratio:>14.5f}")

# %% [markdown]
# Reading the table: stage 1 divides only the optimizer column, stage 2 the gradients too, and
# stage 3 all three, by $N_d$. The tiny excess over the formula is the zero padding (fewer than
# $N_d$ elements per unit) and Adam's step counters.
#
# At rest, after the step, a ZeRO-3 rank holds only its slices. During forward and backward it
# also holds whatever it has gathered: the root unit (the embedding is needed again by the head
# and by backward, so it stays gathered all step), the block being computed and the next block
# being prefetched.

# %%
out3 = measured[3][0]
root, blocks = out3["units"][0][2], [p for _, _, p in out3["units"][1:]]
at_rest = out3["state"]["parameters"]
assert out3["peak"] == at_rest + 2 * (root + 2 * max(blocks)), "root + current block + prefetched block"
full_model = measured[0][0]["state"]["parameters"]
print(
    f"ZeRO-3 parameter bytes: {at_rest:,} at rest, {out3['peak']:,} at peak "
    f"(root + 2 blocks gathered), against {full_model:,} for a full replica"
)

# %% [markdown]
# ### Communication per step
# `CommLogger` records every collective a rank calls, with the bytes a ring algorithm sends from
# that rank: $(N_d - 1)/N_d$ of the buffer for a reduce-scatter or an all-gather, twice that for an
# all-reduce. We convert back to the book's unit: one reduce-scatter or all-gather of the whole
# model is a volume of $\Psi$, an all-reduce $2\Psi$.
#
# The book's accounting: DP all-reduces ($2\Psi$); ZeRO-1 and ZeRO-2 reduce-scatter the gradients
# ($\Psi$) and all-gather the parameters ($\Psi$), also $2\Psi$; ZeRO-3 all-gathers in forward
# ($\Psi$), again in backward ($\Psi$), and reduce-scatters ($\Psi$): $3\Psi$.
#
# One more collective shows up in the log, under its own name: before each step the ranks
# all-reduce one byte per parameter tensor saying whether it got a gradient. A summed gradient
# cannot tell "no gradient" from a zero one, and the optimizer must skip a parameter that got
# none (no weight decay, no moment update), exactly as a torch optimizer skips a `.grad` of
# None. DDP does the same with `find_unused_parameters=True`. It is a few bytes against
# $\Psi$ elements, and it is left out of the volumes below.


# %%
def volume_in_psi(totals, op, n, width=2):
    """Elements of the buffers behind one rank's logged ring traffic, in units of Psi."""
    sent = totals.get(op, {}).get("bytes_sent", 0)
    return sent * n / (n - 1) / width / PSI


n = WORLD_SIZE
units = measured[0][0]["units"]
padded_psi = sum(p for _, _, p in units)
kept = units[0][2] + units[-1][2]  # the root and the last block: gathered once only
expected_elements = {0: 2 * padded_psi, 1: 2 * padded_psi, 2: 2 * padded_psi, 3: 3 * padded_psi - kept}
# torch 2.13 added *_single beside reduce_scatter_tensor / all_gather_into_tensor; the log keeps the name called
REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(torch.distributed, "reduce_scatter_single") else "reduce_scatter_tensor"
)
ALL_GATHER = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
OPS = ("all_reduce", REDUCE_SCATTER, ALL_GATHER)
print(f"{'stage':>6} {'all-reduce':>11} {'reduce-scatter':>15} {'all-gather':>11} {'total':>7}   (in Psi)")
volumes = {}
for stage, per_rank in measured.items():
    for out in per_rank:
        elements = sum(out["comm"].get(op, {}).get("bytes_sent", 0) for op in OPS) * n // (n - 1) // 2
        assert elements == expected_elements[stage], (stage, elements)
        assert out["calls"]["elements"] == elements, "logged buffer sizes and ring traffic agree"
    row = {op: volume_in_psi(per_rank[0]["comm"], op, n) for op in OPS}
    volumes[stage] = sum(row.values())
    print(
        f"{stage:>6} " + " ".join(f"{row[op]:>{w}.4f}" for op, w in zip(OPS, (11, 15, 11))) + f" {volumes[stage]:>7.4f}"
    )

assert volumes[1] == volumes[2] == volumes[0], "ZeRO-1 and ZeRO-2 move what DP moves"
assert abs(volumes[1] - 2) < 0.01 and 2.5 < volumes[3] < 3.0
# A reduce-scatter is half an all-reduce: same buffer, half the ring traffic.
assert measured[0][0]["comm"]["all_reduce"]["bytes_sent"] == 2 * measured[1][0]["comm"][REDUCE_SCATTER]["bytes_sent"]

# %% [markdown]
# ZeRO-1 and ZeRO-2 move exactly what plain DP moves ($2\Psi$, plus a hair of padding), and
# each reduce-scatter carries half the traffic of the all-reduce it replaces, which is why the book
# calls it twice as fast. Since ZeRO-2 also keeps less memory at no extra communication, it is
# usually the stage to prefer over ZeRO-1.
#
# ZeRO-3 comes out **below** $3\Psi$: about $2.69\Psi$ for this small model (the table's last row),
# 10% less. The difference is exact: two units are not gathered a second time for backward, and
# here they weigh a lot, because the root unit holds the embedding matrix, a large share of a
# small model's $\Psi$ (at real sizes the embedding and one block are a few percent, and the
# volume tends to $3\Psi$). The root unit stays gathered from its forward to its
# backward (the head at the very end of forward uses the embedding matrix, and backward starts
# there), and so does the last block, whose backward starts right after its forward ended.
# Measured volume $= 3\Psi_{\text{padded}} - \text{root} - \text{last block}$, as asserted above.
#
# ### Counting the all-gathers
# The book says ZeRO-3 needs $2 \cdot \text{num\_layers} - 1$ more all-gathers per step than
# ZeRO-2. Here are our counts per training step, and one extra run: ZeRO-2 with the whole model
# as a single unit, the way the book draws it (one big all-gather after the optimizer step).

# %%
single_unit = cluster.run(measure_stage, 2, [])[0]  # units=[]: everything in the root unit
L = CFG.layers
gathers = {
    "ZeRO-2 (one unit per block + root)": measured[2][0]["calls"]["all_gather"],
    "ZeRO-2 (whole model as one unit)": single_unit["calls"]["all_gather"],
    "ZeRO-3": measured[3][0]["calls"]["all_gather"],
}
for name, count in gathers.items():
    print(f"{name:>36}: {count:2d} all-gather calls per step")

assert gathers["ZeRO-2 (one unit per block + root)"] == L + 1  # one per unit, after the step
assert gathers["ZeRO-2 (whole model as one unit)"] == 1
assert gathers["ZeRO-3"] == 1 + L + (L - 1)  # root, L forward, L - 1 backward
assert gathers["ZeRO-3"] - gathers["ZeRO-2 (whole model as one unit)"] == 2 * L - 1
blocks_only = gathers["ZeRO-3"] - 1  # leave out the root unit
assert blocks_only == 2 * L - 1

# %% [markdown]
# How our counts relate to the book's $2L - 1$, for a model of $L$ blocks:
# - ZeRO-3 gathers each of the $L$ blocks in forward and all but the last again in backward: $2L - 1$
#   per-layer all-gathers, the book's number. Our root unit (embedding and final norm) adds one.
# - ZeRO-2 gathers the updated parameters once per step. Drawn as one big all-gather, as the book
#   does, ZeRO-3's $2L$ calls are exactly $2L - 1$ more. Our ZeRO-2 issues one all-gather per
#   unit ($L + 1$ calls), so *its* difference to ZeRO-3 is only $L - 1$; the calls are split
#   differently, but the bytes are the same.
#
# Each extra call pays the collective's fixed latency, which is why small units are not free.
#
# ### ZeRO-3 is FSDP: what FSDP2 does differently
# FSDP2 ran the same algorithm on the same units, and the log of its last step shows the same
# pattern with two implementation choices of its own:

# %%
fsdp_totals, fsdp_shards = fsdp[0][1], fsdp[0][2]
fsdp_gathers = fsdp_totals[ALL_GATHER]["calls"]
fsdp_scatters = fsdp_totals[REDUCE_SCATTER]["calls"]
print(
    f"FSDP2: {fsdp_gathers} all-gathers and {fsdp_scatters} reduce-scatters per step "
    f"(ours: {gathers['ZeRO-3']} and {measured[3][0]['calls']['reduce_scatter']})"
)
assert fsdp_scatters == L + 1, "one reduce-scatter per unit, like ours"
assert fsdp_gathers == 1 + 2 * L, "FSDP2 (torch 2.13) gathers the last block again for backward"
embedding_rows = CFG.vocab_size
print(
    f"FSDP2 shards each parameter along dim 0: the {embedding_rows} x {CFG.hidden} embedding becomes "
    f"{fsdp_shards['embed.weight']} on rank 0, ..., {fsdp[-1][2]['embed.weight']} on rank {WORLD_SIZE - 1}"
)
chunk = -(-embedding_rows // WORLD_SIZE)
assert fsdp[0][2]["embed.weight"] == (chunk, CFG.hidden)

# %% [markdown]
# - FSDP2 frees the last block after forward like every other and gathers it again for backward
#   ($2L + 1$ calls); our implementation keeps it, saving one gather at the cost of holding one
#   block a little longer. Both keep the root unit gathered (FSDP2 never reshards its root after
#   forward, for the same reason).
# - FSDP2 shards every parameter separately along its first dimension (`torch.chunk` rules, padded
#   per parameter), and represents it as a `DTensor`; ours cuts one flat buffer per unit, as the
#   earlier FSDP1 did with its `FlatParameter`.
#
# The names differ (DeepSpeed's ZeRO-3, PyTorch's FSDP, `fully_shard`), but it is one idea: shard
# parameters, gradients and optimizer states, and gather each unit's parameters just in time.
#
# ## 4. Timelines: gathering just in time
# Where does the communication happen, and does it wait for the computation or the other way
# round? We record a per-rank timeline of one training step: the library logs each collective from
# launch to completion, and `Timeline.instrument` hooks the blocks to log each block's forward
# and backward. A larger
# model makes the compute bars visible.

# %%
TIMELINE_CFG = GPTConfig(vocab_size=256, hidden=128, layers=L, heads=4, seq_len=64)  # wider, same depth


def record_step(ctx, stage, prefetch):
    torch.manual_seed(SEED)
    model = GPT(TIMELINE_CFG).to(ctx.device)
    timeline = Timeline(ctx.rank)
    zero = ZeRO(model, stage=stage, prefetch=prefetch, timeline=timeline, lr=1e-3)
    # Bars for each block's forward and backward, by hooks registered after ZeRO's: waiting for
    # an all-gather happens before a bar starts, so it is not counted as compute.
    timeline.instrument(model.blocks)
    batch = Batches(TIMELINE_CFG, mbs=4, seed=SEED).rank_batch(ctx.rank, ctx.world_size, 0).to(ctx.device)
    for step in range(2):  # the first step warms up; the second is recorded
        timeline.clear()
        start = time.perf_counter()
        batch.loss(model).backward()
        with timeline.span("step (optimizer)"):
            zero.step()
        zero.zero_grad()
        wait_for_device(ctx.device)  # on a GPU: the kernels done, not only queued
        seconds = time.perf_counter() - start
    return timeline.rows(), seconds


variants = {
    "ZeRO-1": (1, True),
    "ZeRO-2": (2, True),
    "ZeRO-3 without prefetch": (3, False),
    "ZeRO-3 with prefetch": (3, True),
}
timelines = {
    name: cluster.run(record_step, stage, prefetch)
    for name, (stage, prefetch) in ProgressBar("recording one step of each").iterate(variants.items())
}


# %% [markdown]
# First ZeRO-1 against ZeRO-2. ZeRO-1 keeps the full gradients and reduce-scatters them all
# after backward, just before the optimizer; ZeRO-2 reduce-scatters each block's gradients as soon
# as its backward is done, overlapping with the backward of the blocks before it, then drops them.
# Both all-gather the updated parameters after the optimizer step.


# %% tags=["nbval-ignore-output"]
def gantt(names):
    """One Gantt chart per variant, from the rows every rank recorded."""
    fig = Figure(figsize=(11, 2.2 * WORLD_SIZE * len(names) / 2 + 0.8))
    for ax, name in zip(np.atleast_1d(fig.subplots(len(names), 1)), names):
        rows, seconds = [r for r, _ in timelines[name]], max(s for _, s in timelines[name])
        plot_gantt(rows, title=f"{name}: one step, {1e3 * seconds:.0f} ms", ax=ax)
    return fig


gantt(["ZeRO-1", "ZeRO-2"])


# %% [markdown]
# The order of events is not a matter of timing, so we can assert it from the recorded
# timelines on every rank: in ZeRO-2 each block's reduce-scatter is launched before the backward
# of the block before it begins; in ZeRO-1 every reduce-scatter is launched after the last backward.


# %%
def events(rows, lane=None, prefix=""):
    return [e for e in rows if (lane is None or e["lane"] == lane) and e["name"].startswith(prefix)]


def first(rows, name):
    return next(e for e in rows if e["name"] == name)


for rows, _ in timelines["ZeRO-2"]:
    for i in range(1, L):
        assert first(rows, f"reduce_scatter unit {i}")["start"] <= first(rows, f"backward block {i - 1}")["start"]
for rows, _ in timelines["ZeRO-1"]:
    last_backward = max(e["end"] for e in events(rows, "compute", "backward"))
    assert all(e["start"] >= last_backward for e in events(rows, prefix="reduce_scatter"))

# %% [markdown]
# Now ZeRO-3. Without prefetching, a block's all-gather starts only when the block is about to
# run, and the rank waits for it: the compute lane has a gap in front of every block. With
# prefetching, the pre-forward hook of block $i$ also launches the all-gather of block $i+1$ (and
# in backward, the pre-backward hook of block $i$ launches block $i-1$'s), so the next unit's
# parameters travel while the current one computes.

# %% tags=["nbval-ignore-output"]
display(gantt(["ZeRO-3 without prefetch", "ZeRO-3 with prefetch"]))
for name, per_rank in timelines.items():
    # Overlap with the blocks' forward and backward only (the optimizer step bar is left out).
    rows = [e for rows, _ in per_rank for e in rows if not e["name"].startswith("step")]
    communication = sum(
        covered_seconds([(e["start"], e["end"]) for e in rows if e["rank"] == r and e["lane"] == "communication"])
        for r in range(WORLD_SIZE)
    )
    hidden = overlap_seconds(rows) / communication
    step_ms = 1e3 * max(s for _, s in per_rank)
    print(
        f"{name:>24}: step {step_ms:6.1f} ms, {100 * hidden:3.0f}% of communication time overlapped "
        f"a block's forward or backward"
    )

# %% [markdown]
# On a laptop the ranks and gloo's communication threads share the same few CPU cores, so the
# durations are noisy and overlap cannot buy as much as on GPUs, where NCCL's kernels move the data
# over NVLink or the network on a few of the GPU's SMs while the others compute (not quite free:
# those SMs do not compute meanwhile). The *launch order*, however, is exact, and we check it on
# every rank: without prefetch, each block's gather starts after the previous block's forward has
# finished; with prefetch, it starts before the previous block's forward has begun computing.
# Backward with prefetch runs as a three-stage pipeline: by the time block $i$'s backward begins,
# block $i-1$'s gather (for its own backward) and the reduce-scatter of block $i+1$'s gradients
# have both been launched, so two transfers travel beside one block's computation.

# %%
for name, prefetch in (("ZeRO-3 without prefetch", False), ("ZeRO-3 with prefetch", True)):
    for rows, _ in timelines[name]:
        for i in range(1, L):
            gather = events(rows, "communication", f"all_gather unit {i}")[0]  # the forward one
            previous = first(rows, f"forward block {i - 1}")
            if prefetch:
                assert gather["start"] <= previous["start"], (name, i)
            else:
                assert gather["start"] >= previous["end"], (name, i)
        if prefetch:  # backward's pipeline: gather block i - 1, compute block i, reduce block i + 1
            for i in range(1, L - 1):
                backward = first(rows, f"backward block {i}")
                regather = [e for e in rows if e["name"] == f"all_gather unit {i - 1}"][1]  # the backward one
                assert regather["start"] <= backward["start"], (name, i)
                assert first(rows, f"reduce_scatter unit {i + 1}")["start"] <= backward["start"], (name, i)
        assert len(events(rows, "communication", "all_gather")) == 2 * L  # as counted in section 3
print("launch order checked on every rank")

# %% [markdown]
# ### Why prefetching stops working at very large $N_d$
# Prefetching hides a unit's all-gather only if it finishes within the computation of the unit
# before it. The book's rule of thumb is that this holds up to a data-parallel degree of about 512.
# The $\alpha$–$\beta$ model of chapter a0 shows why a limit must exist:
#
# - a ring all-gather of a unit of $S$ bytes takes $(N_d - 1)\,\alpha + \frac{N_d - 1}{N_d}\,\frac{S}{\beta}$.
#   The bandwidth term hardly changes with $N_d$, but the latency term grows linearly: a ring has
#   $N_d - 1$ steps, each paying $\alpha$;
# - the computation it must hide behind shrinks: the global batch is fixed by what trains well (a
#   few million tokens), so each rank processes $1/N_d$ of it.
#
# Below, one Llama-3-8B-sized layer (about 218M parameters, bf16) with a global batch of 4M tokens.
# The hardware numbers are assumptions, not measurements: a latency of $\alpha$ = 10 µs per ring
# step, $\beta$ = 50 GB/s per GPU between nodes (one 400 Gb/s link), and 400 TFLOP/s of useful
# compute. Change them and the crossing point moves, but it always exists.

# %%
layer_params, batch_tokens, flops = 218e6, 4e6, 400e12  # assumptions, see above
link = AlphaBeta(alpha=10e-6, beta=50e9)
nd_range = 2 ** np.arange(3, 13)
gather_ms = np.array([1e3 * link.ring_phase_time(2 * layer_params, nd) for nd in nd_range])
forward_ms = 1e3 * 2 * layer_params * (batch_tokens / nd_range) / flops  # 2 FLOPs per parameter per token
exposed = nd_range[gather_ms > forward_ms]
print(
    f"a layer's all-gather outlasts its neighbour's forward from N_d = {exposed[0]} on "
    f"(gather {gather_ms[nd_range == exposed[0]][0]:.1f} ms, forward {forward_ms[nd_range == exposed[0]][0]:.1f} ms)"
)
assert np.all(np.diff(gather_ms) > 0) and np.all(np.diff(forward_ms) < 0)
assert 64 < exposed[0] <= 1024, "with these assumptions the crossing lands in the hundreds, like the book's 512"
# Backward: a block's backward computes about twice its forward, but it hides two transfers of the
# same size, the gather of the block before it and the reduce-scatter of its own gradients.
backward_ms, backward_transfers_ms = 2 * forward_ms, 2 * gather_ms
assert np.array_equal(nd_range[backward_transfers_ms > backward_ms], exposed), "backward gives out at the same N_d"

fig = Figure(figsize=(7, 3.5), layout="constrained")
ax = fig.subplots()
ax.plot(nd_range, gather_ms, "o-", color="#da8bc3", label="all-gather of one layer")
ax.plot(nd_range, forward_ms, "o-", color="#4c72b0", label="forward of one layer (per rank)")
ax.axvline(512, color="k", ls=":", lw=1)
ax.text(530, ax.get_ylim()[1] * 0.5, "512", fontsize=8)
ax.set(
    xscale="log",
    yscale="log",
    xlabel="data-parallel degree $N_d$",
    ylabel="ms",
    title="prefetch hides the gather while the blue line is above the pink one",
)
ax.set_xticks(nd_range, [str(n) for n in nd_range])
ax.legend(fontsize=8)
fig

# %% [markdown]
# Backward does not hold out longer. Each block's backward computes about twice its forward, but it
# has twice the traffic to hide as well: the gather of the block before it and the reduce-scatter
# of its own gradients, the same number of bytes each (the pipeline checked on the timelines
# above). Twice the compute against twice the communication: in this model backward gives out at
# the same data-parallel degree as forward. Past that point, adding data-parallel ranks makes each
# step wait on the network, which is one reason the next chapters add other kinds of parallelism
# instead of ever more data parallelism.

# %% [markdown]
# ## 5. Beyond the book: each parameter sharded by itself
# ZeRO as the paper draws it, and as we built it, flattens a unit's parameters into one padded
# buffer and hides the shards behind an optimizer of its own: `model.parameters()` still shows
# full-size tensors with no gradient, so a plain `torch.optim.AdamW` has nothing to step. FSDP2
# changed that design, and it is what most training code uses today. Each parameter is cut by
# itself along its rows (the `torch.chunk` cut: $\lceil r / N_d \rceil$ rows per rank, the last
# ranks short or empty), and *the shard is the parameter*: its `.grad` after backward is the
# averaged gradient of those rows, of the same shape. Any optimizer then steps `model.parameters()`
# unchanged. `ultrascale.parallel.fsdp.apply_fsdp` builds this in about 300 lines: a unit (each
# block, and the rest of the model) still gathers its weights with one all-gather before its
# forward and again before its backward, and reduce-scatters its gradients once; only the
# bookkeeping around the collectives is per parameter.
#
# We train it with PyTorch's plain Adam and compare it with DP and with `fully_shard` from above,
# and log the last step's collectives beside ZeRO-3's, both in fp32.


# %%
def train_per_parameter(ctx, opt_name="adam", mp_policy=None):
    model = apply_fsdp(fresh_model().to(ctx.device), mp_policy=mp_policy)
    optimizer = make_optimizer(model.parameters(), opt_name)  # torch's own, on the shards
    losses = run_steps(model, local_batches(ctx), STEPS - 1, optimizer, device=ctx.device)
    with CommLogger() as log:  # the last step's collectives
        losses += run_steps(model, local_batches(ctx), 1, optimizer, device=ctx.device, first_step=STEPS - 1)
    shards = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {"weights": full_state_dict(model), "comm": log.totals(), "shards": shards, "losses": losses}


def zero3_last_step(ctx):
    model = fresh_model().to(ctx.device)
    zero = ZeRO(model, stage=3, optimizer_cls=torch.optim.Adam, lr=1e-3)
    run_steps(model, local_batches(ctx), STEPS - 1, zero, device=ctx.device)
    with CommLogger() as log:
        run_steps(model, local_batches(ctx), 1, zero, device=ctx.device, first_step=STEPS - 1)
    return log.totals()


per_parameter = cluster.run(train_per_parameter)
flat = cluster.run(zero3_last_step)
for rank, (mine, theirs) in enumerate(zip(per_parameter, fsdp)):
    assert mine["shards"] == theirs[2], f"rank {rank}: the shards have FSDP2's shapes"
    assert_same(mine["weights"], reference, "per-parameter sharding against DP", optimizer="adam")
    assert_same(mine["weights"], theirs[0], "per-parameter sharding against FSDP2", optimizer="adam")
print(
    f"torch.optim.Adam on the shards matches DP and FSDP2 after {STEPS} steps; the embedding is "
    f"{per_parameter[0]['shards']['embed.weight']} on rank 0 and "
    f"{per_parameter[-1]['shards']['embed.weight']} on rank {WORLD_SIZE - 1}"
)

print(f"\n{'last step, rank 0':>26} {'all-gathers':>12} {'reduce-scatters':>16} {'bytes sent':>11}")
for name, totals in (("ZeRO-3, flat units", flat[0]), ("per-parameter, apply_fsdp", per_parameter[0]["comm"])):
    calls = [totals[op]["calls"] for op in (ALL_GATHER, REDUCE_SCATTER)]
    print(f"{name:>26} {calls[0]:>12} {calls[1]:>16} {sum(t['bytes_sent'] for t in totals.values()):>11,}")
assert per_parameter[0]["comm"][REDUCE_SCATTER]["calls"] == flat[0][REDUCE_SCATTER]["calls"] == L + 1
assert per_parameter[0]["comm"][ALL_GATHER]["calls"] == fsdp_gathers  # FSDP2's count: 2L + 1

# %% [markdown]
# Both designs make one all-gather and one reduce-scatter per unit, so they pay the collectives'
# latency alike; grouping a unit's parameters into one collective is what keeps FSDP2 from
# sending hundreds of small ones. The bytes differ in two ways. Our ZeRO-3 keeps the last block
# gathered for backward, where `apply_fsdp` (like FSDP2) gathers it again: one gather more. And
# the padding: a flat unit pads once, to a multiple of $N_d$ elements, while each parameter pads
# its rows to a multiple of $N_d$, whole rows at a time (run with `WORLD_SIZE = 3` to see it).
# What flat units buy is fewer, larger and tighter collectives, with no copying of shards in and
# out of a communication buffer. In return, per-parameter sharding gives:
# - a plain optimizer: `torch.optim.AdamW`, Muon (below), anything that steps tensors;
# - per-parameter choices: a parameter can be frozen, kept whole (`replicate=("*norm*",)`:
#   its gradient is all-reduced instead), or stored in its own dtype;
# - simpler checkpoints: each shard is a slice of one named tensor, which is what
#   `torch.distributed.checkpoint` saves and reshards (a flat buffer must first be cut back into
#   tensors).
#
# ### Gathering in bf16, masters in fp32
# FSDP2's `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`: the
# shards (the master weights the optimizer updates) stay fp32; a unit is cast to bf16 *before*
# its all-gather, so half the bytes travel and the forward and backward compute in bf16; the
# gradients are reduced in fp32 and stored in fp32 for the optimizer. `apply_fsdp` takes the same
# policy object.

# %%
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
bf16_run = cluster.run(train_per_parameter, "adam", policy)
gathered = [run[0]["comm"][ALL_GATHER]["bytes_received"] for run in (per_parameter, bf16_run)]
assert 2 * gathered[1] == gathered[0], "a bf16 gather moves exactly half the bytes of an fp32 one"
assert all(w.dtype == torch.float32 for w in bf16_run[0]["weights"].values()), "the masters stay fp32"
losses = np.array([per_parameter[0]["losses"], bf16_run[0]["losses"]])
assert np.allclose(losses[1], losses[0], rtol=1e-2), "bf16 compute moves the loss by well under 1%"
print(f"all-gather bytes received in the last step: {gathered[0]:,} in fp32, {gathered[1]:,} in bf16")

# %% tags=["nbval-ignore-output"]
print("loss per step (rank 0):", " ".join(f"{a:.4f}/{b:.4f}" for a, b in losses.T), "(fp32/bf16)")

# %% [markdown]
# ### Muon on sharded weights
# Muon (`torch.optim.Muon`, used for Kimi K2 and in nanochat) updates a weight matrix with its
# momentum *orthogonalised*: a few Newton-Schulz iterations turn it into a matrix whose singular
# values are all near 1. The momentum is elementwise, so each rank keeps it for its own rows, but
# Newton-Schulz multiplies whole matrices ($X X^\top$): a rank holding some rows cannot do it alone.
# `ultrascale.parallel.sharded_muon.Muon` does it two ways:
# - `mode="gather"`: every rank all-gathers every matrix's update and orthogonalises it, keeping its
#   own rows: one all-gather per matrix, and every rank repeats all the work;
# - `mode="owners"`: matrix $i$ is dealt to rank $i \bmod N_d$ (as nanochat and torchtitan deal
#   them); its owner gathers the rows, orthogonalises, and scatters the rows back: the same bytes
#   arrive only once in all, and the work is split $N_d$ ways.
#
# The blocks' matrices get Muon and the rest (embedding, norms) AdamW, as in practice; one process
# training with whole matrices is the reference. Newton-Schulz runs in fp32 here (torch's runs
# it in bf16), so that the runs differ only by summation order.


# %%
class MuonAndAdamW:
    """Muon for the blocks' weight matrices, AdamW for the rest, stepped together."""

    def __init__(self, model, **sharding):
        matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
        rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
        self.optimizers = [
            Muon(matrices, lr=0.02, ns_dtype=torch.float32, **sharding),
            torch.optim.AdamW(rest, lr=1e-3),
        ]

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self):
        for optimizer in self.optimizers:
            optimizer.zero_grad()


def train_muon(ctx, mode):
    model = apply_fsdp(fresh_model().to(ctx.device))
    optimizer = MuonAndAdamW(model, fsdp=model.fsdp, mode=mode)
    run_steps(model, local_batches(ctx), STEPS - 1, optimizer, device=ctx.device)
    with CommLogger() as log:
        run_steps(model, local_batches(ctx), 1, optimizer, device=ctx.device, first_step=STEPS - 1)
    return {"weights": full_state_dict(model), "comm": log.totals()}


muon_single = fresh_model()
run_steps(muon_single, DATA.global_stream(WORLD_SIZE), STEPS, MuonAndAdamW(muon_single))
muon_runs = {mode: cluster.run(train_muon, mode) for mode in ("gather", "owners")}
for mode, per_rank in muon_runs.items():
    assert_same(
        per_rank[0]["weights"], weights(muon_single), f"sharded Muon ({mode}) against one process", optimizer="adam"
    )
assert_same(
    muon_runs["gather"][0]["weights"], muon_runs["owners"][0]["weights"], "the two ways", tol=dict(rtol=0, atol=0)
)
print("sharded Muon, both ways, matches Muon on whole matrices in one process")


matrix_shapes = [p.shape for n, p in muon_single.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
padded_bytes = 4 * sum(-(-rows // WORLD_SIZE) * WORLD_SIZE * cols for rows, cols in matrix_shapes)
muon_bytes = padded_bytes * (WORLD_SIZE - 1) // WORLD_SIZE  # what a ring all-gather brings to each rank
gather_extra = [
    run["comm"][ALL_GATHER]["bytes_received"] - adam["comm"][ALL_GATHER]["bytes_received"]
    for run, adam in zip(muon_runs["gather"], per_parameter)
]
owners_in = [run["comm"]["gather"]["bytes_received"] for run in muon_runs["owners"]]
owners_out = [run["comm"]["scatter"]["bytes_sent"] for run in muon_runs["owners"]]
assert gather_extra == [muon_bytes] * WORLD_SIZE, "gather: every matrix reaches every rank"
assert sum(owners_in) == sum(owners_out) == muon_bytes, "owners: every matrix reaches one rank, and goes back"


def sent(totals):
    return sum(t["bytes_sent"] for t in totals.values())


print(
    f"bytes sent in one step, per rank (ranks 0..{WORLD_SIZE - 1}); Muon's {len(matrix_shapes)} matrices hold "
    f"{padded_bytes:,} bytes (padded)"
)
table = {
    "ZeRO-3 + Adam (flat)": [sent(t) for t in flat],
    "per-parameter + Adam": [sent(r["comm"]) for r in per_parameter],
    "per-parameter + Muon, gather": [sent(r["comm"]) for r in muon_runs["gather"]],
    "per-parameter + Muon, owners": [sent(r["comm"]) for r in muon_runs["owners"]],
}
for name, row in table.items():
    print(f"{name:>30} " + " ".join(f"{b:>9,}" for b in row))

# %% [markdown]
# With Adam the optimizer step needs no communication at all under per-parameter sharding (each
# rank steps its own rows), and under ZeRO-3 the flat shards are stepped in place too. Muon adds
# traffic of its own: gathering every matrix to every rank costs each rank $(N_d - 1)/N_d$ of the
# matrices' bytes per step, on top of the gathers of forward and backward; dealing whole matrices
# to owners moves the same bytes only once in all, twice counting the way back, and splits the
# Newton-Schulz work, but loads the owners unevenly when the matrices differ in size. Large runs
# go further (the owners of nanochat's and torchtitan's versions receive their matrices' gradients
# whole from the reduce-scatter itself), but the trade is the same: Muon needs whole matrices
# somewhere, so someone must gather them.

# %% [markdown]
# ## Summary
#
# | | memory per GPU | communication per step | all-gathers per step ($L$ blocks) |
# |---|---|---|---|
# | DP | $2\Psi + 2\Psi + k\Psi$ | all-reduce: $2\Psi$ | none |
# | ZeRO-1 | $2\Psi + 2\Psi + k\Psi/N_d$ | reduce-scatter + all-gather: $2\Psi$ | one per unit (or one) |
# | ZeRO-2 | $2\Psi + (2\Psi + k\Psi)/N_d$ | the same $2\Psi$, reduce-scatter during backward | one per unit (or one) |
# | ZeRO-3 / FSDP | $(2\Psi + 2\Psi + k\Psi)/N_d$ | about $3\Psi$ | $2L - 1$ for the blocks, $+1$ for the root |
#
# Everything in this table was checked above against a real run: the weights against plain DP and
# FSDP2, the bytes to the element, the volumes and the counts to the call.
#
# ## Your turn
# Open [exercises/03_zero_exercises.ipynb](../exercises/03_zero_exercises.ipynb): flatten and pad parameters into equal shards, write a
# ZeRO-1 step (reduce-scatter, update your slice of the fp32 master weights, all-gather), the
# gather-then-free forward hooks at the heart of ZeRO-3, and, beyond the book, a gradient's rows
# under per-parameter sharding and Muon's step on a weight sharded by rows.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/03_zero_exercises.ipynb` grades
# the whole notebook from a terminal.

# %%
cluster.close()
