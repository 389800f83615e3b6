# %% [markdown]
# # 09 · 5D parallelism: every axis on one mesh
#
# Chapters 02 to 07 each cut the training job along one dimension: data parallelism (DP) the
# batch, ZeRO the optimizer states, gradients and weights of the DP replicas, tensor parallelism
# (TP) the hidden dimension inside each layer, sequence and context parallelism (SP, CP) the
# sequence, pipeline parallelism (PP) the layers; expert parallelism (EP, chapter 08) splits the
# experts of a mixture-of-experts model. A real job uses several at once: the GPUs are laid out
# as a grid with one axis per technique, the **device mesh**, and every rank belongs to one group
# along each axis.
#
# This chapter puts them together on the course GPT and checks the one thing that matters: the
# composed run trains *exactly* like one process. In this notebook you will
# 1. lay out `WORLD_SIZE` ranks on a mesh and print and draw its rank-to-group maps;
# 2. apply TP/SP, CP, EP, PP and DP/ZeRO in one fixed order with `apply_parallelisms`, and see
#    which ranks average which gradients;
# 3. train the model for several steps under every factorisation of `WORLD_SIZE` the chapter
#    picks (2 x 2 ways at 4 ranks, dp 2 x pp 2 x tp 2 at 8; with experts, ep 2 x pp 2 at 4 and
#    dp 2 x ep 2 x pp 2 at 8) and compare the loss curve and the weights with one process;
# 4. extend the memory calculator to all axes, including the pipeline's in-flight micro-batches,
#    and check it against the memory each rank of the run really holds, at toy size and, in a dry
#    run under fake tensors, for one rank of Llama 3 405B at full size;
# 5. read the book's comparison tables, generated from data and from the calculator, and answer
#    a quiz about them.
#
# The implementation: `lib/ultrascale/parallel/compose.py` (`apply_parallelisms`), `mesh.py`
# (the mesh and its groups), `lib/ultrascale/methods.py` (the tables), `memory.py` (`breakdown`)
# and `parity/composition.py` (the composed run against one process).

# %% tags=["parameters"]
WORLD_SIZE = 4  # ranks; 4 gives four 2 x 2 factorisations, 8 gives dp 2 x pp 2 x tp 2
QUICK = True  # True: fewer factorisations and 4 steps, about 15 s on 2 CPU cores; False: more, 10 steps
SEED = 0

# %%
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display
from matplotlib.figure import Figure

from ultrascale import facts
from ultrascale.checks import nonempty
from ultrascale.data import Batches
from ultrascale.memory import breakdown, pp_in_flight, state_bytes
from ultrascale.methods import TP_CP_EP, ZERO3_VS_PP, comparison, example_config, markdown, quiz, summary_rows
from ultrascale.model import GPT, GPTConfig, count_params
from ultrascale.parallel.compose import (
    DENSE_AXES,
    ParallelConfig,
    apply_parallelisms,
    build_mesh,
    data_index,
    rank_parameters,
)
from ultrascale.parity import perturbed
from ultrascale.parity.composition import assert_composition_matches, train_composed, train_one_process
from ultrascale.refusal import refusal
from ultrascale.viz.live import ProgressBar
from ultrascale.viz.mesh import draw_mesh_groups

torch.manual_seed(SEED)
plt.switch_backend(plt.get_backend())  # figures are Figure objects that a cell shows by returning them

# %% [markdown]
# ## 1. Which factorisations
#
# A factorisation gives each axis a degree whose product is the number of ranks. The chapter picks
# them from `WORLD_SIZE`: at 8 ranks the smallest layout with three axes, dp 2 x pp 2 x tp 2 (our
# choice: the book gives no example of this size); at 4 ranks
# every pair of two axes that the course model allows (dp x tp, pp x tp, dp x pp, cp x tp); other
# sizes get what divides them (the model has 4 heads, so tp is 1, 2 or 4). The model is tiny
# (4 layers, hidden 32) and the checks run in float64 (the reason is in section 4).


# %%
def factorisations(world: int, quick: bool) -> list[ParallelConfig]:
    if world % 8 == 0:
        d = world // 8
        configs = [ParallelConfig(dp=2 * d, pp=2, tp=2, microbatches=2)]
        if not quick:
            configs += [ParallelConfig(dp=2 * d, cp=2, tp=2), ParallelConfig(dp=d, pp=2, cp=2, tp=2, microbatches=2)]
        return configs
    if world % 4 == 0:
        d = world // 4
        return [
            ParallelConfig(dp=2 * d, tp=2),
            ParallelConfig(dp=d, pp=2, tp=2, microbatches=2),
            ParallelConfig(dp=2 * d, pp=2, microbatches=2),
            ParallelConfig(dp=d, cp=2, tp=2),
        ]
    if world % 2 == 0:
        return [ParallelConfig(dp=world // 2, tp=2), ParallelConfig(dp=world // 2, pp=2, microbatches=2)]
    return [ParallelConfig(dp=world)] + ([ParallelConfig(pp=world, microbatches=world)] if world <= 4 else [])


CONFIGS = factorisations(WORLD_SIZE, QUICK)
CAPSTONE = max(CONFIGS, key=lambda c: (sum(s > 1 for s in c.sizes.values()), c.pp))  # the most axes, PP first
MODEL = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=4, seq_len=24)
DATA = Batches(MODEL, mbs=2, seed=SEED)
STEPS = 4 if QUICK else 10
print(f"WORLD_SIZE = {WORLD_SIZE}: factorisations " + ", ".join(str(c) for c in CONFIGS))
print(
    f"capstone: {CAPSTONE}; model {count_params(MODEL):,} parameters, {STEPS} steps of {DATA.mbs} rows "
    f"of {MODEL.seq_len} tokens per data rank"
)

cluster = Cluster(WORLD_SIZE)

# %% [markdown]
# ## 2. The mesh and its rank-to-group maps
#
# The ranks are numbered along the axes in the order dp, pp, ep, cp, tp, **tp innermost**:
# neighbouring ranks (GPUs of one node) form a tp group, because TP communicates inside every
# layer and needs the fastest link; dp is outermost, its one all-reduce per step can cross nodes.
# A rank's group along an axis is the ranks that differ from it only in that coordinate.

# %%
layout = CAPSTONE.layout()
print(layout)
print()
print(layout.groups_table())

# %%
draw_mesh_groups(layout)

# %% [markdown]
# Along the pp axis, rank 0 sends its activations to the rank with the same tp (and dp)
# coordinate in the next stage: each pipeline stage is itself a tensor-parallel group, and the
# pipeline runs once per tp coordinate. Every rank checks the groups it got from `init_mesh`
# against this map:


# %%
def my_groups(ctx, config):
    mesh = build_mesh(ctx, config)
    return {axis: torch.distributed.get_process_group_ranks(mesh.group(axis)) for axis in layout.axes}


got = cluster.run(my_groups, CAPSTONE)
for rank, groups in enumerate(got):
    for axis, ranks in groups.items():
        assert ranks in layout.group_ranks(axis) and rank in ranks, (rank, axis, ranks)
print(f"every rank's process groups are the map's: {', '.join(layout.axes)}")

# %% [markdown]
# ## 3. One order for all the techniques
#
# `apply_parallelisms(model, mesh, config)` applies each technique from outside, in one fixed order:
#
# 1. **TP/SP**: it swaps the linears for column- and row-parallel ones;
# 2. **CP** replaces the attention cores, **EP** the MoE layers;
# 3. **PP** cuts what is left into stages: each stage keeps layers that TP already sharded;
# 4. **DP/ZeRO** last: it must see the parameters the others sharded, and it averages each
#    gradient over every rank that saw *different data* for that parameter.
#
# torchtitan does it the other way round for the first three (printed below): it splits the
# pipeline first and applies TP and FSDP to each stage. That matters at scale, where a rank must
# never build more than its own stages (a 405B model does not fit on one GPU); here every rank
# builds the whole toy model anyway. The result is the same either way, because TP, CP and EP
# change each layer on its own, so cutting before or after gives the same stage; only the data
# parallelism must come last in both.
#
# Different data: the dp ranks get different rows, the cp ranks different tokens of the same rows,
# and the ep ranks different rows too (for the dense layers of an MoE model). So one all-reduce
# over the joint group of those axes does what CP's gradient average and DP's would do one after
# the other. The pp ranks hold different parameters, and so do the tp ranks, except TP's norms
# and row-parallel biases, which every tp rank holds whole. Without SP those get the same gradient
# on every tp rank already; with SP each tp rank applies them to its own slice of the sequence, so
# their gradients must be *summed* over tp (SP hooks them to do that inside backward). Nothing is
# *averaged* over tp or pp. Here is who averages with whom and which rows each rank trains on:

# %%
print(facts.TORCHTITAN_ORDER)
for config in CONFIGS:
    mesh = config.layout()
    data_axes = [a for a in DENSE_AXES if a in mesh.axes]
    groups = mesh.group_map([tuple(data_axes)])["x".join(data_axes)] if data_axes else [[r] for r in range(WORLD_SIZE)]
    rows = [data_index(mesh, r)[0] for r in range(mesh.world_size)]
    print(
        f"{str(config):<16} gradient all-reduce over {'x'.join(data_axes) or 'nobody'}: "
        f"{' '.join('[' + ' '.join(map(str, g)) + ']' for g in groups)};  rows block of each rank: {rows}"
    )

# %% [markdown]
# ## 4. The capstone: every factorisation trains as one process
#
# Each rank builds the same model from the same seed, applies the factorisation and trains
# `STEPS` SGD steps on its share of the same seeded batches; one process trains on the whole
# batches. The loss curve (mean over the data ranks, read on the last pipeline stage) and every
# weight (TP shards gathered, PP stages merged) must match.
#
# **Tolerance.** The ranks add their gradients (and, under CP, attention's partial results) in
# another order than one process: the same numbers in exact arithmetic, about 1e-16 apart in
# float64. We use float64 and `parity`'s float64 SGD tolerance (1e-10 relative, 1e-12 absolute),
# which only the right composition can meet: a gradient averaged over the wrong group, a stage
# left out or a wrong slice of the batch is off by many orders of magnitude more.


# %%
def fresh_model(device="cpu"):
    torch.manual_seed(SEED)
    return perturbed(GPT(MODEL).double().to(device))  # biases and norms moved away from 0 and 1


def capstone(ctx, configs):
    results = []
    for i, config in enumerate(configs):
        ctx.log(done=i)
        results.append(train_composed(ctx, fresh_model(ctx.device), config, DATA, STEPS))
    return results


runs = cluster.run(capstone, CONFIGS, on_log=ProgressBar("training every factorisation", total=len(CONFIGS)))
curves = {}
for i, config in enumerate(CONFIGS):
    reference = train_one_process(fresh_model(), config, DATA, STEPS)
    merged = assert_composition_matches([per_rank[i] for per_rank in runs], reference, config)
    curves[str(config)] = merged["losses"], reference["losses"]
    print(
        f"{str(config):<16} loss curve {' '.join(f'{x:.3f}' for x in merged['losses'])} and "
        f"{len(merged['weights'])} weights = one process (float64)"
    )

# %%
fig = Figure(figsize=(6.5, 3.2), layout="constrained")
ax = fig.add_subplot()
for name, (ours, one) in nonempty(curves, "loss curves (the cell above)").items():
    (line,) = ax.plot(range(1, STEPS + 1), ours, marker="o", label=f"{name} (ranks)")
    ax.plot(range(1, STEPS + 1), one, color=line.get_color(), linestyle=":", linewidth=3, alpha=0.5)
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax.set_title("composed runs (markers) on top of one process (dotted)")
ax.legend(fontsize=8)
fig

# %% [markdown]
# **With experts.** The same check for a mixture-of-experts variant of the model (4 experts per
# block, top-2 routing, chapter 08), with expert parallelism on its own axis. Its dense gradients
# are averaged over (dp, ep, cp); an expert's gradient already sums the contributions of every ep
# rank's tokens (the all-to-all's backward brought them to it), so it is summed over the expert's
# replicas (dp x cp) and divided by all the data ranks.

# %%
MOE_MODEL = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=4, seq_len=24, experts=4, top_k=2)
MOE_DATA = Batches(MOE_MODEL, mbs=2, seed=SEED)
if WORLD_SIZE % 4 == 0:
    MOE_CONFIG = ParallelConfig(dp=WORLD_SIZE // 4, ep=2, pp=2, microbatches=2)
elif WORLD_SIZE % 2 == 0:
    MOE_CONFIG = ParallelConfig(dp=WORLD_SIZE // 2, ep=2)
else:
    MOE_CONFIG = ParallelConfig(ep=WORLD_SIZE) if 4 % WORLD_SIZE == 0 else None  # ep must divide the 4 experts


def fresh_moe(device="cpu"):
    torch.manual_seed(SEED)
    return perturbed(GPT(MOE_MODEL).double().to(device))


if MOE_CONFIG is not None:
    moe_runs = cluster.run(lambda ctx: train_composed(ctx, fresh_moe(ctx.device), MOE_CONFIG, MOE_DATA, STEPS))
    merged = assert_composition_matches(
        moe_runs, train_one_process(fresh_moe(), MOE_CONFIG, MOE_DATA, STEPS), MOE_CONFIG
    )
    print(
        f"{str(MOE_CONFIG):<16} (MoE, 4 experts, top-2) loss curve {' '.join(f'{x:.3f}' for x in merged['losses'])} "
        f"and {len(merged['weights'])} weights = one process (float64)"
    )
else:
    print(f"WORLD_SIZE = {WORLD_SIZE}: no ep divides both the ranks and the 4 experts; no MoE run")

# %% [markdown]
# Different factorisations see different batches (the number of data ranks sets the global batch),
# so their curves differ from each other; each lies on its own one-process reference.
#
# ## 5. The memory calculator with every axis, and what a rank really holds
#
# `memory.breakdown(config, dp=, tp=, pp=, cp=, ep=, zero_stage=, ...)` extends chapter 01's
# calculator to all the axes: TP and PP divide the model states, ZeRO shards them over dp, EP
# divides the experts' share, TP+SP and CP divide the activations. The book's widget stops there.
# A pipeline, though, keeps the activations of several micro-batches *in flight*: under 1F1B the
# first stage has run `min(pp, m)` forwards before its first backward frees one, so it holds that
# many micro-batches of its layers. Given `schedule=` and `micro_batches=`, `breakdown` multiplies
# by the schedule's peak (chapter 07's simulator).
#
# We train the capstone factorisation one step in float32 with Adam and measure, on every rank,
# the bytes of its parameters, gradients and optimizer states, and the activations autograd saves
# at the pipeline's peak.

# %%
MEMORY = ParallelConfig(**{**CAPSTONE.sizes, "microbatches": 4 if CAPSTONE.pp > 1 else 1}, optimizer="adam")


class Measured:
    """An optimizer that, right after its step, records what the rank holds (grads still there)."""

    def __init__(self, par):
        self.par, self.inner = par, par.optimizer

    def step(self):
        self.inner.step()
        self.bytes = state_bytes(self.par.module, self.inner)
        self.tensors = len(list(dict.fromkeys(self.par.module.parameters())))

    def zero_grad(self):
        self.inner.zero_grad()


def measure_memory(ctx, config):
    torch.manual_seed(SEED)
    par = apply_parallelisms(GPT(MODEL).to(ctx.device), build_mesh(ctx, config), config)
    if par.pipeline is not None:
        par.pipeline.measure_activations = True
    par.optimizer = Measured(par)
    par.train(par.batches(DATA), 1)
    peak = (par.pipeline.peak_activation_bytes, par.pipeline.peak_activations) if par.pipeline else (None, None)
    return par.optimizer.bytes, par.optimizer.tensors, peak


measured = cluster.run(measure_memory, MEMORY)
mesh = MEMORY.layout()
for rank, (held, tensors, _) in enumerate(measured):
    stage = mesh.coordinate(rank).get("pp", 0)
    params = rank_parameters(MODEL, tp=MEMORY.tp, pp=MEMORY.pp, stage=stage)
    # fp32: 4 bytes per parameter and gradient; Adam: two fp32 moments, and a step counter per tensor
    assert held == {"parameters": 4 * params, "gradients": 4 * params, "optimizer states": 8 * params + 4 * tensors}, (
        rank,
        held,
    )
print(f"{MEMORY}: every rank holds exactly rank_parameters(...) parameters and gradients, and Adam's states")
bd = breakdown(
    MODEL,
    seq=MODEL.seq_len,
    micro_batch=DATA.mbs,
    mixed_precision=False,
    optimizer_bytes=8,
    tp=MEMORY.tp,
    pp=MEMORY.pp,
    dp=MEMORY.dp,
    cp=MEMORY.cp,
    sequence_parallel=False,
    **({"schedule": MEMORY.schedule, "micro_batches": MEMORY.microbatches} if MEMORY.pp > 1 else {}),
)
print(f"{'rank':>4} {'stage':>5} {'parameters':>11} {'breakdown':>10}")
for rank, (held, _, _) in enumerate(measured):
    print(f"{rank:>4} {mesh.coordinate(rank).get('pp', 0):>5} {held['parameters']:>11,} {bd['parameters']:>10,.0f}")

# %% [markdown]
# The calculator divides every parameter by tp x pp. A rank holds a little more: the tied
# embedding lives on the first *and* the last stage, and TP leaves the norms and the row-parallel
# biases whole on every tp rank (`rank_parameters` counts them exactly; exercise 09.3). On this
# tiny model that is a few percent; on a real one, where the blocks dominate, less.
#
# **Activations.** The pipeline's first stage must hold the activations of `min(pp, m)`
# micro-batches at its peak; the executor counts the pairs it holds and the bytes autograd saved:

# %%
if MEMORY.pp > 1:
    in_flight = pp_in_flight(MEMORY.schedule, MEMORY.pp, MEMORY.microbatches)
    for rank, (_, _, (peak_bytes, peak_pairs)) in enumerate(measured):
        assert peak_pairs == in_flight[mesh.coordinate(rank)["pp"]], (rank, peak_pairs, in_flight)
    first = max(peak for _, _, (peak, _) in measured)
    without = bd["activations"] / max(in_flight)  # the same stage with one micro-batch in flight
    # The formula counts Korthikanti et al.'s bytes per token (dropout masks included, embedding
    # and logits left out); our fp32 course model has no dropout but saves its logits. Measured at
    # 0.8 of the formula here; we accept 25% either way, which forgetting the in-flight micro-batches
    # (half the bytes at pp = 2) does not meet.
    assert abs(first / bd["activations"] - 1) < 0.25, (first, bd["activations"])
    assert abs(first / without - 1) > 0.25
    print(f"in flight per stage (simulator = executor): {in_flight}")
    print(
        f"first stage: measured / breakdown(schedule='{MEMORY.schedule}', m={MEMORY.microbatches}) "
        f"is within 25%; without the in-flight term it would be {max(in_flight)} times too small"
    )
else:
    print(f"{MEMORY} has no pipeline: no micro-batches in flight")

# %% tags=["nbval-ignore-output"]
if MEMORY.pp > 1:
    print(
        f"measured first-stage activations {first:,} bytes, breakdown {bd['activations']:,.0f} "
        f"(ratio {first / bd['activations']:.2f})"
    )

# %% [markdown]
# The same calculator at the scale that matters, a 70B-like model on 1024 GPUs (8 per node):
# TP 8 inside a node, PP 8 across nodes, DP 16 with ZeRO-1, sequence 4096, micro-batch 1 and
# 16 micro-batches under 1F1B. Each step of the list switches one more axis on; the last one
# swaps ZeRO-1 for hybrid sharding (HSDP, chapter 03): ZeRO-3 over blocks of 4 of the 16 data
# ranks, replicated over the 4 blocks, so weights, gradients and states divide by 4, not 16
# (`breakdown(..., dp_shard=4)`; chapter 10's planner weighs what it saves in traffic).
# (The activation terms use GPT's per-layer constants, 34 and 5as/h bytes per token and hidden
# unit, which are an approximation for a Llama-style model with grouped-query attention and a
# SwiGLU MLP.)

# %%
from ultrascale.model import LLAMA3_70B  # noqa: E402

GB = 1e9
steps = [
    ("one GPU", {}),
    ("+ TP 8 (with SP)", dict(tp=8)),
    ("+ PP 8, 1F1B, m = 16", dict(pp=8, schedule="1f1b", micro_batches=16)),
    ("+ DP 16 with ZeRO-1", dict(dp=16, zero_stage=1)),
    ("HSDP: ZeRO-3 over 4 of 16", dict(zero_stage=3, dp_shard=4)),
]
args = dict(seq=4096, micro_batch=1, recompute="selective")
print(f"{'':<24}" + "".join(f"{k:>18}" for k in ("parameters", "gradients", "optimizer states", "activations")))
for name, extra in steps:
    args.update(extra)
    row = breakdown(LLAMA3_70B, **args)
    print(f"{name:<24}" + "".join(f"{row[k] / GB:>16.1f}GB" for k in row))
assert (
    breakdown(LLAMA3_70B, **args)["optimizer states"]
    < breakdown(LLAMA3_70B, **{**args, "zero_stage": 0})["optimizer states"]
)
# HSDP's states: ZeRO-3's over all 16 data ranks, times the 16 / 4 replicas
assert abs(row["optimizer states"] / breakdown(LLAMA3_70B, **{**args, "dp_shard": 16})["optimizer states"] - 4) < 1e-12

# %% [markdown]
# This is a layout the library now trains, not only a calculation: TP with SP inside pipeline
# stages and ZeRO beside PP compose (`tests/test_compose_5d.py` checks each against one process).
#
# ### The published layouts, at toy scale
#
# Two real training runs, shrunk to the toy model and 8 ranks:
#
# - **Llama 3 405B** (its layout is printed below, from `ultrascale.facts`, which chapter 10
#   reads too). Here: TP 2 with SP, PP 2 and DP 2 with ZeRO-2, the stage its FSDP amounts to. Its
#   fourth axis, CP, would need 16 ranks, and this course's library does not yet compose SP
#   inside pipeline stages with CP (`ParallelConfig` refuses it and says why).
# - **DeepSeek-V3** trained with PP 16, EP 64 spread over 8 nodes and ZeRO-1 data parallelism,
#   without TP. Here: PP 2, EP 2 and DP 2 with ZeRO-1, on the mixture-of-experts model above.
#
# Each trains a few steps in float64 and must equal one process, as in section 4. Then one step
# in float32 with Adam measures what every rank holds; beside it, `breakdown`'s prediction for
# the same layout. ZeRO keeps an fp32 master copy beside Adam's two moments, so k = 12 bytes per
# parameter of optimizer state, sharded over the ranks holding the same copy: dp x ep for a dense
# layer, dp for an expert.

# %%
print(facts.LLAMA3_405B)
llama_zero = facts.LLAMA3_405B_LAYOUT["zero"]  # the toy layout shards what Llama 3 405B sharded
PUBLISHED = {
    "Llama 3 405B's shape": (
        MODEL,
        DATA,
        fresh_model,
        ParallelConfig(dp=2, tp=2, sp=True, pp=2, zero=llama_zero, microbatches=2),
    ),
    "DeepSeek-V3's shape": (MOE_MODEL, MOE_DATA, fresh_moe, ParallelConfig(dp=2, pp=2, ep=2, zero=1, microbatches=2)),
}
CONSUMERS = ("parameters", "gradients", "optimizer states")


def held_after_one_step(ctx, model_config, data, config):
    """What this rank holds after one float32 Adam step: ZeRO's parameters, gradients and states."""
    torch.manual_seed(SEED)
    par = apply_parallelisms(GPT(model_config).to(ctx.device), build_mesh(ctx, config), config)
    par.train(par.batches(data), 1)
    totals = dict.fromkeys(CONSUMERS, 0)
    for zero in getattr(par.optimizer, "zeros", [par.optimizer]):  # dense and expert ZeRO, each over its group
        for consumer, nbytes in zero.state_bytes().items():
            totals[consumer] += nbytes
    return totals


eight = cluster if WORLD_SIZE == 8 else Cluster(8)  # these layouts need 8 ranks, whatever WORLD_SIZE is
published_rows = {}
for name, (model_config, data, fresh, config) in PUBLISHED.items():
    runs = eight.run(lambda ctx: train_composed(ctx, fresh(ctx.device), config, data, STEPS))
    merged = assert_composition_matches(runs, train_one_process(fresh(), config, data, STEPS), config)
    print(f"{name:<22} {str(config):<26} loss {' '.join(f'{x:.3f}' for x in merged['losses'])} = one process")
    adam = ParallelConfig(**{**config.__dict__, "optimizer": "adam"})
    held = eight.run(held_after_one_step, model_config, data, adam)
    predicted = breakdown(
        model_config,
        seq=model_config.seq_len,
        micro_batch=data.mbs,
        mixed_precision=False,
        optimizer_bytes=12,
        zero_stage=config.zero,
        tp=config.tp,
        pp=config.pp,
        dp=config.dp * config.cp,
        cp=config.cp,
        ep=config.ep,
    )
    published_rows[name] = held, predicted
    # breakdown divides the weights evenly by tp x pp; the ranks also hold the tied embedding on
    # both pipeline ends, TP's whole norms and ZeRO's padding to a multiple of dp: within 10%.
    for rank, got in enumerate(held):
        for consumer in CONSUMERS:
            assert 0.9 < got[consumer] / predicted[consumer] < 1.1, (name, rank, consumer, got, predicted)
if eight is not cluster:
    eight.close()

# %% tags=["nbval-ignore-output"]
for name, (held, predicted) in nonempty(published_rows, "measured layouts").items():
    print(f"{name}: bytes per rank, measured (breakdown's prediction)")
    for rank, got in enumerate(held):
        print(f"  rank {rank}: " + ", ".join(f"{c} {got[c]:,} ({predicted[c]:,.0f})" for c in CONSUMERS))
print("every rank within 10% of the prediction")

# %% [markdown]
# ### The published layouts at full size: a dry run
#
# The toy runs check the composition; they say little about whether `breakdown` is right for a
# 405B-parameter model, whose one rank holds more than this machine's memory. PyTorch can run that
# rank anyway: under **fake tensors** (`FakeTensorMode`: a shape, a dtype and a device, no storage)
# and its **fake process group** (collectives that return at once), one CPU process builds Llama 3
# 405B, applies the course's own `apply_parallelisms` for rank r of the 16,384, runs one training
# step and counts what it held (`ultrascale.dryrun`, the way torchtitan checks its large layouts).
# `dryrun` returns the bytes of parameters, gradients and optimizer states after the step, the peak
# of the activations autograd saved, FlopCounterMode's FLOPs and CommLogger's bytes per collective.
# The tests check that a dry run of a small model measures exactly what a real 4-rank run does.
#
# Llama 3 405B's layout, run in bf16 with Adam: TP 8 with SP, PP 16 (1F1B), DP 128 with ZeRO-2,
# micro-batches of one 8,192-token sequence. QUICK runs one micro-batch on the first stage; the full
# run takes the published 16 on the first, a middle and the last stage (some ten minutes).

# %%
from ultrascale.dryrun import dryrun  # noqa: E402
from ultrascale.memory import activation_bytes  # noqa: E402
from ultrascale.model import LLAMA3_405B, attention_flops_per_token, matmul_params  # noqa: E402
from ultrascale.parallel.pipeline_parallel import split_layers  # noqa: E402


def flops_formula(config, layout, stage, tokens, seq, attention=True):
    """6 FLOPs per parameter of a matmul per token, plus attention's (eager: the whole s x s
    matrix; ``attention=False`` leaves it out), for one rank's share: its stage's layers and, on
    the last stage, the head, split by tp."""
    h, v, layers = config.hidden, config.vocab_size, len(split_layers(config.layers, layout.pp)[stage])
    block_matmuls = (matmul_params(config) - h * v) // config.layers
    rank_matmuls = (layers * block_matmuls + (h * v if stage == layout.pp - 1 else 0)) // layout.tp
    scores = attention_flops_per_token(config, seq) * layers // config.layers // layout.tp if attention else 0
    return tokens * (6 * rank_matmuls + scores)


def layout_breakdown(config, layout, seq, **options):
    """``breakdown``'s prediction for a compose layout. ZeRO shards a weight's states over every
    rank that holds it, the dp x cp data-and-context ranks (as the planner passes it)."""
    return breakdown(
        config,
        seq=seq,
        zero_stage=layout.zero,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp * layout.cp,
        cp=layout.cp,
        ep=layout.ep,
        sequence_parallel=layout.sp,
        schedule=layout.schedule,
        micro_batches=layout.microbatches,
        **options,
    )


FULL = ParallelConfig(tp=8, sp=True, pp=16, dp=128, zero=2, optimizer="adam", microbatches=1 if QUICK else 16)
FULL_STAGES = [0] if QUICK else [0, FULL.pp // 2, FULL.pp - 1]  # first, middle, last pipeline stage
FULL_SEQ = 8192
predicted = layout_breakdown(LLAMA3_405B, FULL, FULL_SEQ)
in_flight = pp_in_flight(FULL.schedule, FULL.pp, FULL.microbatches)
per_layer = activation_bytes(LLAMA3_405B, FULL_SEQ, 1, tp=FULL.tp, sequence_parallel=True) / LLAMA3_405B.layers
dry_rows = {}
for stage in FULL_STAGES:
    rank = FULL.layout().rank_of(dp=0, pp=stage, tp=0)
    dry = dryrun(FULL, LLAMA3_405B, rank, dtype=torch.bfloat16)
    layers = len(split_layers(LLAMA3_405B.layers, FULL.pp)[stage])
    # the formula's activations for this stage: its layers, times the micro-batches it holds at once
    formula = dict(predicted, activations=per_layer * layers * in_flight[stage])
    flops = flops_formula(LLAMA3_405B, FULL, stage, dry.tokens, FULL_SEQ)
    dry_rows[stage] = dry, formula, flops
    # Model states: breakdown divides all 405B parameters by tp x pp; a stage holds its own layers
    # (8 or 7 of 126), the first the embedding and the last the head too (0.5 GB each): within 10%.
    for key in ("parameters", "gradients", "optimizer states"):
        assert 0.9 < dry.memory()[key] / formula[key] < 1.1, (stage, key, dry.memory()[key], formula[key])
    # Activations: at s = 8192 the s x s scores dominate. Korthikanti's 5as/h charges 5 bytes per
    # score (the scores, their softmax, a dropout mask); the course's eager attention keeps the
    # softmax's 2 bytes and a 1-byte causal mask per layer, and has no dropout: about 0.4 of that
    # term. For the rest, a SwiGLU MLP, RoPE and RMSNorm keep more than GPT's 34 bytes per token and
    # hidden unit. Together about 0.53 of the formula on the first stage; we accept 0.45 to 1.0.
    assert 0.45 < dry.activations / formula["activations"] < 1.0, (stage, dry.activations, formula["activations"])
    # FLOPs: FlopCounterMode counts the matmuls the formula counts, and nothing else: within 0.1%
    assert abs(dry.flops / flops - 1) < 1e-3, (stage, dry.flops, flops)
print(
    f"Llama 3 405B, {FULL}, {FULL.microbatches} micro-batch(es) of {FULL_SEQ} tokens, bf16 + Adam: "
    f"stages {FULL_STAGES} dry-run; model states within 10% of breakdown, activations 0.45-1.0 of it, "
    f"FLOPs within 0.1% of 6N + attention"
)


# %%
def side_by_side(dry, formula, flops=None):
    """One rank's dry run beside the formula's prediction, in GB (and TFLOPs)."""
    print(f"{dry.layout}, rank {dry.rank} {dry.coordinate}: GB     measured   formula")
    for key in ("parameters", "gradients", "optimizer states", "activations"):
        print(f"  {key:<26}{dry.memory()[key] / 1e9:9.2f}  {formula[key] / 1e9:9.2f}")
    if flops is not None:
        print(f"  {'TFLOPs in the step':<26}{dry.flops / 1e12:9.1f}  {flops / 1e12:9.1f}")
    print(
        "  collectives: "
        + ", ".join(
            f"{op} {row['calls']}x {row['bytes_sent'] / 1e9:.2f} GB sent" for op, row in sorted(dry.collectives.items())
        )
    )


for stage, (dry, formula, flops) in nonempty(dry_rows, "dry runs (the cell above)").items():
    side_by_side(dry, formula, flops)

# %% [markdown]
# What the numbers say: the model states are where `breakdown` puts them, to a few percent off the
# even split it assumes (the first stage is 9% over it: the embedding's 128,256 x 16,384 / 8 rows).
# ZeRO-2 has cut the gradients and Adam's states 128 ways, to tens of MB, while the bf16 weights
# stay whole, 6-7 GB. The activations dominate: tens of GB per micro-batch in flight with the full
# 8,192 x 8,192 score matrix, which is why the published run used 16 micro-batches of one sequence,
# and why it never stored those scores (a fused attention kernel recomputes them; the
# `recompute="selective"` of section 5).
#
# **The long-context phase.** Llama 3 405B's last pre-training stage ran 131,072-token sequences
# with CP 16 (and DP 8; TP 8 and PP 16 as before). Under CP each rank holds 8,192 of the tokens
# and ring attention passes the keys and values round the 16 ranks. The dry run takes ring
# attention's decisions (which blocks of keys a block of queries sees, where it needs a mask)
# from the tokens' real positions, which depend on the layout alone, and runs everything else on
# fake tensors. Two details of the layout: this library does not compose SP inside pipeline
# stages with CP, so the run is without SP; and ZeRO shards over every rank that holds the same
# weights, the 8 x 16 data-and-context ranks (as the planner passes it to `breakdown`).
#
# The FLOPs can be predicted exactly. Cut the sequence into 2 x 16 = 32 chunks of 4,096 tokens:
# zig-zag gives rank r chunks r and 31 - r. At the step where a rank meets its own keys it
# computes all 4 (query chunk, key chunk) pairs with a causal mask; at each of the other 15 steps
# it computes 2 (the first half of the keys, or the second half of the queries). That is 34 pairs
# of 4,096 x 4,096 scores, against 32 that a perfect causal kernel would need, and each pair costs
# its forward (2 matmuls), its backward (4) and, as FlashAttention does, the scores recomputed
# in backward (1 more): 14 h c^2 FLOPs per layer, split by tp. A contiguous layout gives rank r
# the r-th sixteenth and 4 (r + 1) pairs: the last rank does 16 times the first one's attention.

# %%
from dataclasses import replace  # noqa: E402

from ultrascale.dryrun import dryrun_extrapolated  # noqa: E402
from ultrascale.plan.published import LLAMA3_405B_LONG  # noqa: E402

LONG_SEQ = LLAMA3_405B_LONG.seq
LONG = ParallelConfig(
    **{k: LLAMA3_405B_LONG.layout[k] for k in ("tp", "cp", "pp", "dp", "zero")}, optimizer="adam", microbatches=1
)
# ring attention keeps no s x s scores (it recomputes them): the formula's "selective"
long_predicted = layout_breakdown(LLAMA3_405B, LONG, LONG_SEQ, recompute="selective")
chunk = LONG_SEQ // (2 * LONG.cp)
long_layers = len(split_layers(LLAMA3_405B.layers, LONG.pp)[0])
pair_flops = 14 * LLAMA3_405B.hidden * chunk**2 * long_layers // LONG.tp
long_rows = {}
for cp_layout in ("zigzag", "contiguous"):
    layout = replace(LONG, cp_layout=cp_layout)
    for cp_rank in (0, LONG.cp - 1):
        rank = layout.layout().rank_of(dp=0, pp=0, cp=cp_rank, tp=0)
        dry = dryrun_extrapolated(layout, LLAMA3_405B, rank, seq=LONG_SEQ, dtype=torch.bfloat16)
        pairs = 2 * LONG.cp + 2 if cp_layout == "zigzag" else 4 * (cp_rank + 1)
        matmuls = flops_formula(LLAMA3_405B, LONG, 0, dry.tokens, LONG_SEQ, attention=False)
        long_rows[cp_layout, cp_rank] = dry, pairs
        # FLOPs: the 6N part and the chunk pairs, exactly (FlopCounterMode counts what the formula counts)
        assert dry.flops == matmuls + pairs * pair_flops, (cp_layout, cp_rank, dry.flops, matmuls + pairs * pair_flops)
        # model states, as for the 8k run: the first stage's embedding puts its parameters 9% over
        for key in ("parameters", "gradients", "optimizer states"):
            assert 0.9 < dry.memory()[key] / long_predicted[key] < 1.1, (key, dry.memory()[key], long_predicted[key])
        # activations: Llama's block keeps more than GPT's formula at tp 8 without SP (see below)
        assert 1.5 < dry.activations / long_predicted["activations"] < 2.2, (dry.activations, long_predicted)
for (cp_layout, cp_rank), (dry, pairs) in long_rows.items():
    print(
        f"{cp_layout:>10}, cp rank {cp_rank:>2}: {pairs:>2} chunk pairs, {dry.flops / 1e12:7.1f} TFLOPs; "
        f"states {dry.parameters / 1e9:.2f} + {dry.gradients / 1e9:.2f} + {dry.optimizer_states / 1e9:.2f} GB, "
        f"activations {dry.activations / 1e9:.1f} GB ({dry.activations / long_predicted['activations']:.2f} "
        f"of breakdown's {long_predicted['activations'] / 1e9:.1f})"
    )
print("FLOPs equal to 6N + 14 h c^2 per chunk pair; states within 10% of breakdown, activations 1.5-2.2 of it")

# %% [markdown]
# Zig-zag gives every rank the same 34 pairs; contiguous gives the first rank 4 and the last 64, and
# a ring step waits for its slowest rank. The states are exactly the 8k run's: ZeRO-2 now shards
# over DP 8 x CP 16, the same 128 ranks as DP 128 before. The activations are about twice the
# formula's: at tp 8 without SP, Korthikanti's count charges 10 + 24/8 = 13 bytes per token and
# hidden unit, and the course's Llama block keeps more (SwiGLU's gate, up and product are each ffn
# wide; RMSNorm and
# RoPE keep their own inputs). `breakdown` has no Llama-specific count yet.
#
# **DeepSeek-V3** routes each token by its router's scores: which experts (and so which ep ranks)
# get which tokens, and every shape after the router, are values that fake tensors lack. The dry
# run states a routing instead, `balanced_choice`: every expert gets the same share of the tokens,
# and a token's 8 experts lie 256 / 8 = 32 apart, so they sit on 8 of the 64 ep ranks. That is the
# most all-to-all traffic a token can cause, what the planner's cost model charges; a real router is
# less even, and DeepSeek's node-limited routing sends a token to at most 4 nodes. The tests hold a
# real run routed the same way to exactly the dry run's counts.
#
# The layout: PP 16 (1F1B), EP 64, DP 2 with ZeRO-1, no TP, one 4,096-token sequence per
# micro-batch. The 61 layers split 4 to a stage, 3 on the last three. `dryrun_extrapolated` runs
# one and two layers per stage and extends to the stage's own count (the blocks are alike).

# %%
import math  # noqa: E402

from ultrascale.parallel.expert_parallel import dispatch_volume  # noqa: E402
from ultrascale.plan.published import DEEPSEEK_V3, DEEPSEEK_V3_PRETRAIN  # noqa: E402

DS = ParallelConfig(**DEEPSEEK_V3_PRETRAIN.layout, optimizer="adam", microbatches=1)
DS_SEQ, DS_STAGES = DEEPSEEK_V3_PRETRAIN.seq, [0] if QUICK else [0, DS.pp // 2, DS.pp - 1]
ds_predicted = layout_breakdown(DEEPSEEK_V3, DS, DS_SEQ)
h, v, elt = DEEPSEEK_V3.hidden, DEEPSEEK_V3.vocab_size, 2  # bf16
# breakdown spreads the model evenly, 61 / 16 layers and a sixteenth of the embedding and the head
# per stage. A stage holds whole layers, and an end stage a whole table: 0.93 B parameters, as many
# as 2.4 of this model's layers on one rank, since EP has cut each layer's experts 64 ways.
table = {"parameters": elt * h * v, "gradients": elt * h * v, "optimizer states": 12 * h * v / (DS.dp * DS.ep)}
ds_rows = {}
for stage in DS_STAGES:
    rank = DS.layout().rank_of(dp=0, ep=0, pp=stage)
    dry = dryrun_extrapolated(DS, DEEPSEEK_V3, rank, seq=DS_SEQ, dtype=torch.bfloat16)
    layers = len(split_layers(DEEPSEEK_V3.layers, DS.pp)[stage])
    end = stage in (0, DS.pp - 1)
    formula = {
        key: (ds_predicted[key] - 2 * table[key] / DS.pp) * layers * DS.pp / DEEPSEEK_V3.layers + end * table[key]
        for key in table
    }
    formula["activations"] = ds_predicted["activations"] * layers / math.ceil(DEEPSEEK_V3.layers / DS.pp)
    flops = flops_formula(DEEPSEEK_V3, DS, stage, dry.tokens, DS_SEQ)
    ds_rows[stage] = dry, formula, flops
    for key in table:  # the formula redistributed as the stage holds the model: within 3%
        assert abs(dry.memory()[key] / formula[key] - 1) < 0.03, (stage, key, dry.memory()[key], formula[key])
    # FLOPs: balanced routing gives each rank's experts k rows per token of its own: 6 x the active
    # parameters per token, plus attention, exactly as for a dense model
    assert abs(dry.flops / flops - 1) < 1e-3, (stage, dry.flops, flops)
    # bytes: per MoE layer, the dispatch and combine of the k copies of each token's hidden state
    # that leave the rank (the cost model's 4 all-to-alls of routed (ep - 1) / ep bytes each, with
    # the dispatch's k routing weights a row besides)
    even = [dry.tokens * DEEPSEEK_V3.top_k // DS.ep] * DS.ep
    forward = dispatch_volume(even, even, 0, h, DEEPSEEK_V3.top_k, element_size=elt)
    backward = dispatch_volume(even, even, 0, h, DEEPSEEK_V3.top_k, element_size=elt, backward=True)
    for label, per_layer in {**forward, **backward}.items():
        assert dry.collectives[label]["bytes_sent"] == layers * per_layer, (stage, label, dry.collectives[label])
    routed = dry.tokens * DEEPSEEK_V3.top_k * h * elt
    ep_bytes = sum(dry.collectives[k]["bytes_sent"] for k in ("ep dispatch", "ep combine", "all_to_all_single"))
    assert 1 < ep_bytes / (4 * layers * routed * (DS.ep - 1) / DS.ep) < 1.002
    # activations: the score matrices at 0.4 of Korthikanti's 5 bytes, the rest well over his 34
    assert 0.5 < dry.activations / formula["activations"] < 0.8, (stage, dry.activations, formula["activations"])
for stage, (dry, formula, flops) in ds_rows.items():
    side_by_side(dry, formula, flops)
print(
    f"DeepSeek-V3, {DS}, stages {DS_STAGES}: model states within 3% of breakdown as a stage holds it, "
    "FLOPs within 0.1% of 6N(active) + attention, EP's bytes exactly dispatch_volume's, activations 0.5-0.8"
)

# %% [markdown]
# Once a stage is counted as it is held (whole layers, and the whole embedding on the first), the
# model states are exactly `breakdown`'s. Adam's states are nearly as large as the bf16 weights
# although ZeRO-1 shards them: an expert has only DP 2 replicas to shard over, and experts are most
# of a stage. The FLOPs are a dense model's 6N with N the active parameters: with balanced routing
# each rank's 4 experts per layer run the 8 choices of 4,096 tokens, as many as its own tokens
# make. The bytes are the cost model's: the dispatch, the combine and their backward each move
# the 8 copies of a token's hidden state that leave the rank, 63/64 of them. The activations fall
# below the formula for the reason the 8k Llama run did (128 heads of 4,096 x 4,096 scores, kept at
# 2 bytes of Korthikanti's 5), less so because each token's 8 expert rows keep more than the dense
# MLP the formula assumes.

# %% [markdown]
# **Try it.** Pick a model (`LLAMA3_8B`, `LLAMA3_70B`, `LLAMA3_405B` or a `LlamaConfig` of your
# own), a layout and a rank, and see that rank at full size beside `breakdown`'s prediction for the
# same layout (`breakdown` gives the busiest stage: compare with the first). A few seconds for an
# 8B model; a minute or more for the larger ones with many micro-batches. An MoE model is routed
# by `balanced_choice`; what the dry run cannot run it refuses, naming the technique.

# %%
from ultrascale.model import LLAMA3_8B  # noqa: E402

MY_MODEL, MY_LAYOUT = LLAMA3_8B, ParallelConfig(tp=4, sp=True, pp=4, dp=8, zero=1, optimizer="adam", microbatches=1)
MY_RANK, MY_SEQ = 0, 4096
mine = dryrun(MY_LAYOUT, MY_MODEL, MY_RANK, seq=MY_SEQ, dtype=torch.bfloat16)
side_by_side(mine, layout_breakdown(MY_MODEL, MY_LAYOUT, MY_SEQ))

# %% [markdown]
# ## 6. The book's tables, generated
#
# The methods' facts are data in `methods.py`; the column "saves memory of" is computed:
# switch one method on in `breakdown` and see which of the four consumers shrink. (DP saves
# activations because, at a fixed global batch, each rank's batch shrinks; PP under 1F1B does
# *not* save activations, the in-flight term above.)

# %%
display(Markdown(markdown(summary_rows())))

# %%
display(Markdown(markdown(comparison(ZERO3_VS_PP))))

# %% [markdown]
# ZeRO-3 and PP both spread the model, in opposite ways: ZeRO-3 keeps a slice of every layer and
# gathers the weights, PP keeps whole layers and passes activations. Combining them needs a larger
# global batch (PP wants many micro-batches, ZeRO-3 large ones). The lighter stages are another
# matter (printed below): DeepSeek-V3 trained with PP and ZeRO-1, Llama 3 405B with PP and ZeRO-2.
# TP+SP complements both.

# %%
print(facts.PP_WITH_ZERO)
display(Markdown(markdown(comparison(TP_CP_EP))))

# %% [markdown]
# **What each technique touches.** TP/SP changes the whole model (every linear, the norms'
# gradients, the embedding and the head); CP only attention (every other layer works token by
# token); EP only the MoE layers; PP and ZeRO work on any module, but PP must balance its stages
# and treat the first and last, which hold the embedding and the head, apart. CP pays off from
# sequences of about 128k tokens; EP's defining collective is the all-to-all, and some codebases
# count its ranks as part of DP (as the gradient averaging above does).
#
# **Memory saved, by strategy and sequence length.** The calculator for Llama 3 8B on 8 GPUs, one
# technique at a time, with selective recomputation (top) and full recomputation (bottom): the
# hatched part is the model states (weights, gradients, Adam), the plain part the activations.

# %%
from ultrascale.model import LLAMA3_8B  # noqa: E402

STRATEGIES = {
    "1 GPU": {},
    "ZeRO-3, dp 8": dict(dp=8, zero_stage=3),
    "TP 8 + SP": dict(tp=8),
    "PP 8 (1F1B, m 8)": dict(pp=8, schedule="1f1b", micro_batches=8),
    "CP 8": dict(cp=8),
}
SEQ_LENGTHS = (1024, 4096, 16384, 65536)
overview = {
    (rec, seq, name): breakdown(LLAMA3_8B, seq=seq, recompute=rec, **extra)
    for rec in ("selective", "full")
    for seq in SEQ_LENGTHS
    for name, extra in STRATEGIES.items()
}
states = lambda parts: parts["parameters"] + parts["gradients"] + parts["optimizer states"]  # noqa: E731
for (rec, seq, name), parts in overview.items():
    alone = overview[rec, seq, "1 GPU"]
    # what the calculator says each technique divides by 8, and what it leaves whole
    shrinks_states = name in ("ZeRO-3, dp 8", "TP 8 + SP", "PP 8 (1F1B, m 8)")
    shrinks_activations = name in ("TP 8 + SP", "CP 8")  # 1F1B keeps p micro-batches of L/p layers
    assert abs(states(parts) * (8 if shrinks_states else 1) / states(alone) - 1) < 1e-12, (rec, seq, name)
    assert abs(parts["activations"] * (8 if shrinks_activations else 1) / alone["activations"] - 1) < 1e-12

fig = Figure(figsize=(10, 5.2), layout="constrained")
axes = fig.subplots(2, 1, sharex=True)
width = 0.8 / len(STRATEGIES)
for ax, rec in zip(axes, ("selective", "full")):
    for i, name in enumerate(STRATEGIES):
        xs = [j + i * width for j in range(len(SEQ_LENGTHS))]
        model_states = [states(overview[rec, s, name]) / GB for s in SEQ_LENGTHS]
        acts = [overview[rec, s, name]["activations"] / GB for s in SEQ_LENGTHS]
        bars = ax.bar(xs, model_states, width, hatch="//", alpha=0.6, label=name)
        ax.bar(xs, acts, width, bottom=model_states, color=bars[0].get_facecolor())
    ax.axhline(80, color="k", linestyle=":", linewidth=1)
    ax.set(ylim=(0, None), ylabel="GB per GPU", title=f"Llama 3 8B, {rec} recomputation (dotted: 80 GB)")
axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(SEQ_LENGTHS))], [f"seq {s:,}" for s in SEQ_LENGTHS])
axes[0].legend(fontsize=7, ncol=5, loc="upper left")
fig

# %% [markdown]
# A few questions over the tables; exercise 09.4 asks you to answer them, and grades the answers
# against the same data:

# %%
for question, answer in quiz().items():
    print(f"{question}\n    {', '.join(sorted(answer)) if isinstance(answer, set) else answer}")

# %% [markdown]
# ## 7. Inputs that cannot be composed
#
# A mesh must cover the ranks exactly; a technique must divide what it splits. The errors say
# what to change. Two combinations are limits of this course's library, not of the techniques
# (real runs compose both), and their errors say so.


# %%
def wrong_mesh(ctx):
    return refusal(lambda: build_mesh(ctx, ParallelConfig(dp=2, tp=2 * WORLD_SIZE)))


messages = {
    "a mesh of the wrong size": cluster.run(wrong_mesh)[0],
    "sp in pp stages with cp": refusal(lambda: ParallelConfig(pp=2, tp=2, sp=True, cp=2)),
    "ZeRO with a split backward": refusal(lambda: ParallelConfig(pp=2, dp=2, zero=1, schedule="zb-h1")),
    "ep=3, 8 experts": refusal(lambda: breakdown(example_config(moe=True), ep=3)),
}
assert f"but the cluster has {WORLD_SIZE}" in messages["a mesh of the wrong size"]
assert "ep=3 does not divide the 8 experts" in messages["ep=3, 8 experts"]
for case, message in messages.items():
    print(f"{case}:\n  {message}")

# %% [markdown]
# ## Summary
#
# - One mesh, five axes, tp innermost: a rank's group along an axis is the ranks that differ only
#   in that coordinate. `init_mesh` builds every group once per rank.
# - `apply_parallelisms` applies TP/SP, CP, EP, PP and then DP/ZeRO from outside (torchtitan
#   splits the pipeline first; the stages come out the same); the gradients are averaged over the
#   ranks that saw different data (dp, cp, and ep for dense layers), never over tp or pp, but with
#   SP the norms' gradients are summed over tp, since each tp rank saw other tokens.
# - Every factorisation trains to the same loss curve and weights as one process (float64).
# - The calculator covers every axis and the pipeline's in-flight micro-batches; each rank holds
#   exactly the parameters we count, and the activations the calculator predicts within 25%.
# - The published layouts compose at toy scale on 8 ranks: Llama 3 405B's (TP with SP, PP, DP
#   with ZeRO-2; its CP would need 16 ranks) and DeepSeek-V3's (PP, EP, ZeRO-1, no TP) train as
#   one process, each rank within 10% of the calculator's bytes.
#
# Next, chapter 10 searches these factorisations for the fastest one that fits.

# %% [markdown]
# ## Your turn
# Open [exercises/09_5d_parallelism_exercises.ipynb](../exercises/09_5d_parallelism_exercises.ipynb): write the mesh's rank-to-group maps, the pipeline's activation memory, the parameters one
# rank holds, and answer a quiz on the book's tables.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/09_5d_parallelism_exercises.ipynb` grades
# the whole notebook from a terminal.

# %%
cluster.close()
