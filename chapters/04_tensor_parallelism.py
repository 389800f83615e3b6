# %% [markdown]
# # 04 · Tensor parallelism: split the matrices, not the batch
#
# Data parallelism and ZeRO (chapters 02 and 03) split the *batch*: every rank still runs the
# whole model on its samples, so the activations of one sample, and the matrix multiplies that
# make them, are never shared out. Tensor parallelism (TP, from Megatron-LM) splits the
# matrix multiplies themselves. Every rank of a TP group sees the same tokens and holds a slice
# of every large weight; the ranks compute slices of each layer's output and combine them with
# collectives *inside* the forward and backward passes.
#
# In this notebook you will
# 1. check the two matrix identities TP rests on, with real collectives on small integer
#    matrices and a picture of who holds what;
# 2. build the TP MLP and TP attention from column- and row-parallel linears and the conjugate
#    pair f / f*, and train the course GPT with them, to the same numbers as one process and as
#    PyTorch's `parallelize_module`;
# 3. see why LayerNorm needs no gradient synchronisation under TP, and why dropout needs a
#    shared seed;
# 4. count the collectives (2 all-reduces forward and 2 backward per block) and their bytes, and
#    look at a block's timeline, where the all-reduce sits on the critical path;
# 5. measure each rank's memory against TP degree, and use the memory and alpha-beta models for
#    the book's 70B and throughput examples.
#
# The implementation is `lib/ultrascale/parallel/tensor_parallel.py`; the collectives that
# autograd can differentiate are in `lib/ultrascale/comm/functional.py`. The model
# (`lib/ultrascale/model.py`) knows nothing of either: `apply_tp(model, mesh)` swaps its layers
# for parallel ones from outside.

# %% tags=["parameters"]
WORLD_SIZE = 4  # ranks; tp is the largest degree that divides it and fits the model (2, 3, 4, 6, ...)
QUICK = True  # True: 3 steps and small matrices, about 10 s on 2 CPU cores; False: 10 steps, larger matrices (longer)
SEED = 0

# %%
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import inspect
import math

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch.distributed.tensor.parallel import loss_parallel

from ultrascale.comm import AlphaBeta, CommLogger, tensor_parallel_scaling
from ultrascale.data import Batches
from ultrascale.memory import GB, activation_bytes, breakdown, saved_activation_bytes, state_bytes
from ultrascale.model import (
    GPT,
    LLAMA3_8B,
    LLAMA3_70B,
    MLP,
    GPTConfig,
    Llama,
    LlamaConfig,
    count_params,
    rope_tables,
    training_flops,
)
from ultrascale.parallel import Timeline, init_mesh
from ultrascale.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    apply_tp,
    choose_tp,
    full_gradients,
    full_weights,
    tp_degrees,
)
from ultrascale.parallel.vocab_parallel import VocabParallelLogits
from ultrascale.parity import assert_same, dtensor_tp, first_step_and_train, perturbed
from ultrascale.refusal import refusal
from ultrascale.train import gradients, make_optimizer, run_steps
from ultrascale.viz.diagrams import tp_split_figure
from ultrascale.viz.gantt import plot_gantt
from ultrascale.viz.live import ProgressBar

torch.manual_seed(SEED)
plt.switch_backend(plt.get_backend())  # figures drawn as images from the first one on

# %% [markdown]
# ## 1. Two ways to cut a matrix product
#
# In a network a linear layer computes $Y = X W$: $X$ holds the activations (one row per
# token), $W$ the weights (`nn.Linear` stores $W^\top$, but the algebra is the same). There are
# two ways to share the product between $n$ ranks:
#
# 1. **by columns of $W$**: $X W = X \,[W_1\; W_2\; \cdots] = [X W_1\;\; X W_2\; \cdots]$. Every
#    rank needs all of $X$ and produces a slice of the output's columns. Putting $Y$ back together
#    is an **all-gather** (along the columns);
# 2. **by rows of $W$**: $X W = [X_1\; X_2\; \cdots] \,[W_1; W_2; \cdots] = \sum_{i=1}^{n} X_i W_i$.
#    Rank $i$ needs only the matching columns of $X$ (a **scatter** hands them out) and produces a
#    full-sized *partial sum*; adding the partial sums is an **all-reduce**.
#
# Scatter is the one collective here the training chapters have not used yet: data parallelism
# broadcast the first weights and all-reduced the gradients, ZeRO reduce-scattered and all-gathered
# (appendix A0 calls every collective once). The book counts scatter as its fourth primitive,
# after broadcast, all-gather and all-reduce, a count that forgets the reduce-scatter of its own
# ZeRO section. We check both identities on integer-valued matrices, where floating point is
# exact, so the results must be *equal*, not merely close.

# %%
CFG = GPTConfig(vocab_size=96, hidden=48, heads=12, layers=2, seq_len=12)  # tp 2, 3, 4, 6, 12 all divide it
TP = choose_tp(GPT(CFG), WORLD_SIZE)
REPLICAS = WORLD_SIZE // TP
print(
    f"WORLD_SIZE = {WORLD_SIZE}: tp = {TP}"
    + (
        f", {REPLICAS} identical TP groups side by side (chapter 09 puts data parallelism across them)"
        if REPLICAS > 1
        else ""
    )
)

X = torch.arange(1.0, 2 * 12 + 1).view(2, 12) % 7  # 2 tokens, 12 features
W = (torch.arange(1.0, 12 * 12 + 1).view(12, 12) % 5) - 2  # 12 -> 12 features
Y = X @ W
cols, rows = W.chunk(TP, dim=1), W.chunk(TP, dim=0)
assert torch.equal(torch.cat([X @ w for w in cols], dim=1), Y), "identity 1: by columns"
assert torch.equal(sum(x @ w for x, w in zip(X.chunk(TP, dim=1), rows)), Y), "identity 2: by rows"
print(f"X is {tuple(X.shape)}, W is {tuple(W.shape)}; both identities hold exactly for {TP} slices")


# %%
def draw_owners(ax, shape, owner, title, n):
    """A matrix as a grid of cells coloured by the rank that holds them (-1: every rank)."""
    colours = plt.get_cmap("tab10")
    grid = np.ones((*shape, 3))
    for i in range(shape[0]):
        for j in range(shape[1]):
            who = owner(i, j)
            grid[i, j] = (0.85, 0.85, 0.85) if who < 0 else colours(who)[:3]
    ax.imshow(grid, aspect="equal")
    ax.set_title(title, fontsize=9)
    ax.set_xticks([]), ax.set_yticks([])


def sharding_figure(n):
    step = 12 // n
    every, by_col, by_row = (lambda i, j: -1), (lambda i, j: j // step), (lambda i, j: i // step)
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    axes = fig.subplots(2, 3)
    panels = [
        [
            ((2, 12), every, "X: on every rank"),
            ((12, 12), by_col, "W split by columns"),
            ((2, 12), by_col, "Y = [X W_1, X W_2, ...]: all-gather"),
        ],
        [
            ((2, 12), by_col, "X split by columns (scatter)"),
            ((12, 12), by_row, "W split by rows"),
            ((2, 12), every, "Y = X_1 W_1 + X_2 W_2 + ...: all-reduce"),
        ],
    ]
    for row, axes_row in zip(panels, axes):
        for (shape, owner, title), ax in zip(row, axes_row):
            draw_owners(ax, shape, owner, title, n)
    fig.suptitle(
        f"top: column-linear, bottom: row-linear, tp = {n}; colours are ranks, grey is every rank "
        "(after the collective)",
        fontsize=9,
    )
    return fig


sharding_figure(TP)

# %% [markdown]
# Now the same two products with real collectives on the ranks. Rank 0 of each TP group starts with
# $X$; the column version broadcasts it, each rank multiplies by its columns of $W$, and an
# all-gather assembles $Y$. The row version scatters $X$'s columns, each rank multiplies by its
# rows of $W$, and an all-reduce adds the partial sums.

# %%
cluster = Cluster(WORLD_SIZE)
print(cluster)


def tp_group(ctx):
    return init_mesh(ctx, dp=REPLICAS, tp=TP).group("tp")


def both_identities(ctx):
    group = tp_group(ctx)
    r, n, root = dist.get_rank(group), dist.get_world_size(group), dist.get_global_rank(group, 0)
    x_all, w = X.to(ctx.device), W.to(ctx.device)  # the notebook's matrices, moved
    x = x_all.clone() if r == 0 else torch.zeros_like(x_all)
    with CommLogger() as log:
        dist.broadcast(x, src=root, group=group)  # column-linear: everyone needs X
        pieces = [torch.empty(2, 12 // n, device=ctx.device) for _ in range(n)]
        dist.all_gather(pieces, x @ w.chunk(n, dim=1)[r], group=group)
        by_columns = torch.cat(pieces, dim=1)
        x_mine = torch.empty(2, 12 // n, device=ctx.device)  # row-linear: each rank its columns of X
        slices = [c.contiguous() for c in x_all.chunk(n, dim=1)]  # column slices are strided views: copy
        dist.scatter(x_mine, slices if r == 0 else None, src=root, group=group)
        by_rows = x_mine @ w.chunk(n, dim=0)[r]
        dist.all_reduce(by_rows, group=group)
    return by_columns, by_rows, [e.op for e in log.events]


for by_columns, by_rows, ops in cluster.run(both_identities):
    assert torch.equal(by_columns, Y) and torch.equal(by_rows, Y)
print("on every rank, both ways give exactly X @ W; collectives called:", ", ".join(ops))

# %% [markdown]
# ## 2. From two identities to a transformer block
#
# ### Column then row: one all-reduce for the whole MLP
# The MLP is $\text{GeLU}(X A)\,B$ with $A$ of shape $h \times 4h$ and $B$ of shape $4h \times h$.
# Split $A$ by **columns**: rank $r$ computes $Z_r = \text{GeLU}(X A_r)$, its slice of the $4h$
# features. GeLU works element by element, so it can run on the slice. Now $Z_r$ is *exactly* the
# input slice that a **row**-split $B$ needs: rank $r$ computes $Z_r B_r$, and one all-reduce
# sums them into the output. No all-gather in between, no scatter: one collective per MLP in the
# forward pass. In training the input $X$ is already the same on every rank of the group (it came
# out of the previous all-reduce), so the broadcast is not needed either.
#
# Attention is cut the same way, along its heads (the subsection after next tests it): each rank
# computes q, k and v for its own heads, attends with them, and multiplies by its rows of the
# output projection; one all-reduce sums the ranks' shares. The picture, for this notebook's
# `tp` and the model's 12 heads:

# %%
tp_split_figure(tp=TP, heads=CFG.heads)

# %% [markdown]
# ### The conjugate pair f and f*
# A collective inside the forward pass needs a derivative too. The book names two operators:
#
# | | forward | backward |
# |---|---|---|
# | **f**, before the column-parallel layer | identity | all-reduce |
# | **f\***, after the row-parallel layer | all-reduce | identity |
#
# Why f's backward all-reduces: the loss depends on $X$ through *every* rank's slice $X A_r$, so
# $\partial L/\partial X$ is the sum of the ranks' partial gradients. Why f*'s backward does
# nothing: every rank computes the same loss from the same summed output, so the gradient arriving
# at f* is already the same everywhere, and $\partial (\sum_r Y_r)/\partial Y_r$ is the identity.
# Here are the two layers as the library writes them:

# %%
print(inspect.getsource(ColumnParallelLinear.forward))
print(inspect.getsource(RowParallelLinear.forward))

# %% [markdown]
# (`enter_region` is off when the module around the layer applied f once for all its layers: q, k
# and v share one f, so backward all-reduces $\partial L/\partial X$ once, not three times. With
# sequence parallelism, chapter 05, subclasses of both in `sequence_parallel.py` use g and g* instead.)
#
# We cut a single-process MLP into a TP MLP and compare, in float64 so that any difference beyond
# rounding is a bug: the output, the input's gradient and every weight gradient, gathered back to
# full shapes. The `CommLogger` counts the collectives of forward and backward separately.


# %%
def tp_mlp(ctx):
    group = tp_group(ctx)
    torch.manual_seed(SEED)
    mlp = MLP(CFG.hidden).double().to(ctx.device)  # the single-process reference
    x = torch.randn(2, CFG.seq_len, CFG.hidden, dtype=torch.float64).to(ctx.device).requires_grad_()
    mlp(x).square().sum().backward()
    expected = {"y": mlp(x).detach(), "x.grad": x.grad.clone(), **gradients(mlp)}

    tp = nn.Module()  # the same weights, sliced for this rank
    tp.fc = ColumnParallelLinear.from_linear(mlp.fc, group)
    tp.proj = RowParallelLinear.from_linear(mlp.proj, group)
    x2 = x.detach().clone().requires_grad_()
    with CommLogger() as forward:
        y = tp.proj(F.gelu(tp.fc(x2), approximate="tanh"))
    with CommLogger() as backward:
        y.square().sum().backward()
    got = {"y": y.detach(), "x.grad": x2.grad, **full_gradients(tp)}
    return got, expected, [e.op for e in forward.events], [e.op for e in backward.events]


for got, expected, fwd_ops, bwd_ops in cluster.run(tp_mlp):
    assert_same(got, expected, "TP MLP against one process", optimizer=None)
    assert fwd_ops == ["all_reduce"] and bwd_ops == ["all_reduce"], (fwd_ops, bwd_ops)
print(
    f"TP MLP on {TP} ranks = one process (output, input gradient, 4 weight gradients; float64 "
    "tolerance); forward: 1 all-reduce (f*), backward: 1 all-reduce (f)"
)

# %% [markdown]
# ### Attention: split the heads
# Attention is column-parallel q, k and v, then a row-parallel output projection. Cutting q, k and
# v by columns in blocks of `head_dim` gives each rank whole heads, and heads never look at each
# other until the output projection, which is exactly where the row-parallel sum happens. The model
# reads the number of heads from the shapes, so a shard of attention runs unchanged. The constraint
# is that tp must divide the number of heads, and with grouped-query attention (GQA) the number of
# **K/V heads**: a rank cannot hold a fraction of a K/V head. Llama-3 8B has 8 K/V heads, so TP=8
# is its ceiling; TP=16 would have to copy K/V heads and keep the copies' gradients in sync.

# %%
kv_ok = [t for t in (1, 2, 4, 8, 16, 32) if LLAMA3_8B.kv_heads % t == 0 and LLAMA3_8B.heads % t == 0]
assert max(kv_ok) == 8
print(f"Llama-3 8B: {LLAMA3_8B.heads} query heads, {LLAMA3_8B.kv_heads} K/V heads -> tp in {kv_ok}")

GQA = LlamaConfig(vocab_size=96, hidden=48, heads=4, kv_heads=2, ffn=96, layers=2, seq_len=12)
print(f"a small GQA model (4 query heads, 2 K/V heads) allows tp in {tp_degrees(Llama(GQA))}")


def refused(ctx):  # one K/V head: no tp > 1 can split it
    return refusal(
        lambda: apply_tp(
            Llama(LlamaConfig(vocab_size=96, hidden=48, heads=12, kv_heads=1, ffn=96, layers=1)), tp_group(ctx)
        )
    )


message = cluster.run(refused)[0]
assert "K/V heads" in message
print("apply_tp on a model with a single K/V head:\n ", message)

# %% [markdown]
# ### The whole model, against one process and against PyTorch
# `apply_tp` applies the plan `GPT_PLAN`: attention and MLP as above; the embedding split by
# vocabulary rows (a token outside a rank's rows looks up zeros there, and f* sums the lookups);
# the LM head split by vocabulary columns, so each rank gets only its slice of the logits, and a
# vocabulary-parallel cross-entropy that all-reduces the maximum, the sum of exponentials and the
# target logit, so that no rank ever holds the full `tokens x vocabulary` logits. Norms stay
# replicated.
#
# Three runs from the same weights on the same batches, in float64: one process, ours, and PyTorch's
# DTensor `parallelize_module` (`ColwiseParallel`, `RowwiseParallel`) with the same layout. We
# compare the logits, the loss, every gradient of the first step, and the weights after a few SGD
# steps. TP does not split the data: every rank sees the whole batch.

# %%
STEPS = 3 if QUICK else 10
DATA = Batches(CFG, mbs=2, seed=SEED)


def fresh_model(device=None):  # on a rank: its ctx.device; None: here, on the CPU
    torch.manual_seed(SEED)
    model = GPT(CFG).double().to(device)
    return perturbed(model, seed=SEED)  # biases off 0, norm weights off 1: a misplaced one shows


def ours(ctx):
    model = apply_tp(fresh_model(ctx.device), tp_group(ctx))
    out = first_step_and_train(
        model,
        DATA,
        STEPS,
        "sgd",
        full_logits=VocabParallelLogits.full_tensor,
        full_gradients=full_gradients,
        full_weights=full_weights,
        device=ctx.device,
    )
    return {**out, "local vocabulary": model.head.weight.shape[0]}


def pytorch(ctx):
    model = dtensor_tp(fresh_model(ctx.device), init_mesh(ctx, dp=REPLICAS, tp=TP).to_device_mesh()["tp"])
    # loss_parallel: F.cross_entropy on vocabulary-sharded DTensor logits
    return first_step_and_train(model, DATA, STEPS, "sgd", loss_context=loss_parallel, device=ctx.device)


reference = first_step_and_train(fresh_model(), DATA, STEPS, "sgd")
runs = {"ours": ours, "PyTorch parallelize_module": pytorch}
results = {name: cluster.run(fn) for name, fn in ProgressBar("TP training runs").iterate(runs.items())}
for name, per_rank in results.items():
    for rank, got in enumerate(per_rank):
        for key in ("logits", "loss", "grads"):
            assert_same(got[key], reference[key], f"{name}, rank {rank}: {key}", optimizer=None)
        assert_same(got["weights"], reference["weights"], f"{name}, rank {rank}: weights", optimizer="sgd")
print(
    f"tp = {TP}: logits, loss, {len(reference['grads'])} gradients and the weights after {STEPS} SGD steps "
    "equal one process (float64 tolerance), for ours and for parallelize_module"
)
print(f"each rank held {results['ours'][0]['local vocabulary']} of the {CFG.vocab_size} vocabulary rows")

# %% [markdown]
# ## 3. What stays replicated: LayerNorm and dropout
#
# Between the TP regions (the residual stream, the norms) every rank holds the same full
# activations: they come out of an all-reduce. So a LayerNorm there sees identical inputs and
# identical incoming gradients on every rank, and its weight gradients come out identical without
# any synchronisation. We check it bit for bit: not close, *equal*.


# %%
def norm_gradients(ctx):
    model = apply_tp(fresh_model(ctx.device), tp_group(ctx))
    DATA.global_batch(0).to(ctx.device).loss(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "norm" in n}


per_rank = cluster.run(norm_gradients)
for rank, grads in enumerate(per_rank):
    for name, grad in grads.items():
        assert torch.equal(grad, per_rank[0][name]), f"rank {rank}: {name}"
        assert_same(grad, reference["grads"][name], name, optimizer=None)
print(
    f"{len(per_rank[0])} LayerNorm gradients are bit-identical on all {WORLD_SIZE} ranks, with no all-reduce, "
    "and equal to one process's"
)

# %% [markdown]
# Dropout is the one replicated operation that draws random numbers. The course models have none,
# so we apply it by hand to a replicated activation, the output of an all-reduce. If each rank
# seeds its own generator (as it would by default: seeds are usually set once per process), the
# masks differ and the "replicated" activation is no longer the same on every rank: each rank
# goes on with a different model. With one seed shared by the TP group the masks agree.


# %%
def dropout_after_all_reduce(ctx, shared_seed):
    group = tp_group(ctx)
    y = torch.ones(4, CFG.hidden, device=ctx.device)
    dist.all_reduce(y, group=group)  # identical on every rank
    generator = torch.Generator().manual_seed(SEED if shared_seed else SEED + ctx.rank)
    mask = torch.rand(y.shape, generator=generator).to(ctx.device) > 0.1  # what dropout(p=0.1) keeps
    return y * mask / 0.9


for shared in (False, True):
    outs = cluster.run(dropout_after_all_reduce, shared)
    same = all(torch.equal(o, outs[0]) for o in outs)
    assert same == shared
    print(
        f"{'one shared seed' if shared else 'a seed per rank'}: the activation after dropout is "
        f"{'identical' if same else 'different'} across ranks"
    )

# %% [markdown]
# ## 4. What TP costs: collectives on the critical path
#
# ### Counting them
# Per block: attention's f* and the MLP's f* in forward, and their partners f in backward, so
# **2 all-reduces forward and 2 backward**, each of the activation tensor $b \cdot s \cdot h$. A
# ring all-reduce over $t$ ranks sends $2 (t-1)/t$ times the buffer from each rank (chapter a0).
# We log one block alone, then the whole model, where the vocabulary-parallel embedding (one f*)
# and cross-entropy (a max and one stacked pair of sums) add 3 more forward all-reduces, and the
# head's f adds one in backward.

# %%
B, S, H = 2, CFG.seq_len, CFG.hidden


def count_collectives(ctx):
    model = apply_tp(GPT(CFG).to(ctx.device), tp_group(ctx))
    block = model.blocks[0]
    cos, sin = rope_tables(S, CFG.head_dim, CFG.rope_theta, device=ctx.device)
    x = torch.randn(B, S, H).to(ctx.device).requires_grad_()
    with CommLogger() as forward:
        y = block(x, cos, sin)
    with CommLogger() as backward:
        y.sum().backward()
    with CommLogger() as model_forward:
        loss = DATA.global_batch(0).to(ctx.device).loss(model)
    with CommLogger() as model_backward:
        loss.backward()
    return [(log.collective_elements(), log.bytes_sent) for log in (forward, backward, model_forward, model_backward)]


(fwd, fwd_bytes), (bwd, bwd_bytes), (model_fwd, _), (model_bwd, _) = cluster.run(count_collectives)[0]
ring = 2 * (TP - 1) / TP
assert fwd["all_reduce"] == bwd["all_reduce"] == 2
assert fwd["all_reduce elements"] == bwd["all_reduce elements"] == 2 * B * S * H
assert fwd_bytes == bwd_bytes == round(2 * ring * B * S * H * 4)
assert model_fwd["all_reduce"] == 2 * CFG.layers + 3 and model_bwd["all_reduce"] == 2 * CFG.layers + 1
print(
    f"one block: forward {fwd['all_reduce']} all-reduces, backward {bwd['all_reduce']}, each of b*s*h = "
    f"{B * S * H:,} elements; each rank sends 2 * 2(t-1)/t * b*s*h * 4 bytes = {fwd_bytes:,} bytes per pass"
)
print(
    f"whole model ({CFG.layers} blocks): forward {model_fwd['all_reduce']} all-reduces, backward "
    f"{model_bwd['all_reduce']}"
)

# %% [markdown]
# ### Where they sit in time
# Data parallelism could hide its all-reduces behind the backward pass of earlier layers (chapter
# 02): nothing was waiting for them. TP's cannot hide so easily. The all-reduce that ends the
# attention sublayer produces the very tensor the next LayerNorm normalises, and LayerNorm needs
# the whole row (its mean and variance over $h$). Until the all-reduce is done there is nothing
# for the block to do. Below is one block's forward and backward on every rank: compute bars from
# hooks on the four sublayers, communication bars from the `CommLogger`. Megatron-LM and nanotron
# overlap part of this communication with the neighbouring matrix multiplies, and research such as
# Domino pushes further, but in the plain version every all-reduce stalls the block. (Two ranks
# only, so that on a 2-core machine each has a core and the bars show work, not waiting for a core.)


# %%
def block_timeline(ctx):
    pair = ctx.new_group([0, 1])  # a TP group of two ranks: one CPU core each, so the times mean something
    if ctx.rank > 1:
        return []
    config = GPTConfig(vocab_size=96, hidden=192, heads=12, layers=1, seq_len=96)  # big enough to see
    block = apply_tp(GPT(config).to(ctx.device), pair).blocks[0]
    timeline = Timeline(ctx.rank)
    timeline.instrument({"norm1": block.norm1, "attention": block.attn, "norm2": block.norm2, "mlp": block.mlp})
    cos, sin = rope_tables(config.seq_len, config.head_dim, config.rope_theta, device=ctx.device)
    x = torch.randn(4, config.seq_len, config.hidden).to(ctx.device).requires_grad_()
    for _ in range(2):  # the second pass is the one we keep (the first warms up the allocator)
        timeline.clear()
        with CommLogger(timeline=timeline):
            block(x, cos, sin).sum().backward()
    return timeline.rows()


rows = cluster.run(block_timeline)[:2]
for rank_rows in rows:
    attention_reduce = next(r for r in rank_rows if r["lane"] == "communication")
    norm2 = next(r for r in rank_rows if r["name"] == "forward norm2")
    assert attention_reduce["end"] <= norm2["start"], "LayerNorm cannot start before the all-reduce is done"
plot_gantt(
    [r for rank_rows in rows for r in rank_rows],
    label_bars=True,
    title="one block at tp = 2: forward (norm1, attention, norm2, mlp), then backward",
)

# %% [markdown]
# ## 5. What TP buys: memory
#
# ### Measured on the ranks
# For every tp that divides the world size we build the TP model, run one forward and backward
# and an Adam step, and count each rank's bytes: parameters, gradients and Adam's two moments
# exactly (`state_bytes`), and the activations autograd saved in the forward
# (`saved_activation_bytes`). The weights divide by tp, except the LayerNorms and the biases of the
# row-parallel layers, which every rank keeps whole (about $6h$ per block, a sliver). Activations
# divide less: everything outside the TP regions (norm inputs and outputs, residual stream) is
# replicated. The memory model (Korthikanti et al.) writes a block's activations in 16-bit as
# $s b h (10 + 24/t + 5 a s/(h t))$ under TP: the 10 is what TP does not split. Chapter 05's
# sequence parallelism removes it.


# %%
def memory_at(ctx, tp):
    group = init_mesh(ctx, dp=WORLD_SIZE // tp, tp=tp).group("tp")
    torch.manual_seed(SEED)
    model = GPT(CFG).to(ctx.device)
    if tp > 1:
        apply_tp(model, group)
    inputs = DATA.global_batch(0).inputs.to(ctx.device)
    activations = saved_activation_bytes(model, inputs)
    optimizer, after_backward = make_optimizer(model.parameters(), "adam"), {}
    run_steps(
        model,
        DATA.global_stream(1),
        1,
        optimizer,
        device=ctx.device,
        after_backward=lambda: after_backward.update(state_bytes(model)),
    )  # the gradients exist between backward and the step
    return {**state_bytes(model, optimizer), "gradients": after_backward["gradients"], "activations": activations}


def predicted_parameters(tp):
    """Per-rank parameters: everything sharded by tp but the norms and row-parallel biases."""
    replicated = CFG.layers * 6 * H + 2 * H  # 2 norms (weight, bias) + 2 row biases per block; final norm
    return (count_params(CFG) - replicated) / tp + replicated


TPS = [t for t in tp_degrees(GPT(CFG)) if WORLD_SIZE % t == 0]
measured = {tp: cluster.run(memory_at, tp)[0] for tp in ProgressBar("memory per tp").iterate(TPS)}
for tp, m in measured.items():
    assert m["parameters"] == m["gradients"] == 4 * predicted_parameters(tp)
    assert m["optimizer states"] == 2 * m["parameters"] + 4 * len(list(GPT(CFG).parameters())), tp  # + step counters


def model_share(tp):  # the memory model's activations at tp over those at tp=1
    return activation_bytes(CFG, S, B, tp=tp) / activation_bytes(CFG, S, B)


print(
    f"{'tp':>3} {'parameters':>11} {'gradients':>10} {'Adam':>10} {'activations':>12}   "
    "activations vs tp=1: measured, model, 1/tp"
)
for tp, m in measured.items():
    share = m["activations"] / measured[1]["activations"]
    print(
        f"{tp:>3} {m['parameters']:>11,} {m['gradients']:>10,} {m['optimizer states']:>10,} "
        f"{m['activations']:>12,}   {share:.2f}, {model_share(tp):.2f}, {1 / tp:.2f}"
    )
    if tp > 1:
        assert 1 / tp < share < 1, "TP shrinks the activations, but less than 1/tp: the replicated part stays"
        assert abs(share - model_share(tp)) < 0.06, "the measured share follows the model's (10 + 24/t + ...)"

# %% [markdown]
# The parameter, gradient and optimizer bytes match the prediction to the byte (the Adam column
# also holds one 4-byte step counter per parameter tensor). The activation share shrinks with tp
# but stays above $1/t$, close to what the memory model's $(10 + 24/t + 5as/(ht))/(34 + 5as/h)$
# predicts (our small fp32 model without dropout is not the model's exact layer, hence "close").
# The floor above $1/t$ is the replicated part.
#
# ### The book's 70B example
# The same accounting at scale, from the memory model: Llama-3 70B, bf16 mixed precision with
# Adam (16 bytes per parameter), sequence 4096, micro-batch 1, selective recomputation.

# %%
tps_70b = [1, 2, 4, 8, 16, 32]
keys = ("parameters", "gradients", "optimizer states", "activations")
mem_70b = {t: breakdown(LLAMA3_70B, seq=4096, tp=t, sequence_parallel=False, recompute="selective") for t in tps_70b}
fig = Figure(figsize=(7, 3.4), layout="constrained")
ax = fig.subplots()
bottom = np.zeros(len(tps_70b))
for key in keys:
    values = np.array([mem_70b[t][key] / GB for t in tps_70b])
    ax.bar([str(t) for t in tps_70b], values, bottom=bottom, label=key)
    bottom += values
ax.axhline(80, color="k", ls=":", lw=1)
ax.set(xlabel="tp", ylabel="GB per GPU", ylim=(0, 700), title="Llama-3 70B per GPU against tp (memory model)")
ax.text(0, 690, f"{sum(mem_70b[1].values()) / GB:,.0f} GB", ha="center", va="top", fontsize=8)  # off the scale
ax.text(5.3, 85, "80 GB", fontsize=8)
ax.legend(fontsize=8)
for t in tps_70b:
    print(
        f"tp={t:>2}: {sum(mem_70b[t].values()) / GB:7.1f} GB per GPU "
        f"(model state {sum(mem_70b[t][k] for k in keys[:3]) / GB:6.1f} GB)"
    )
state_8 = sum(mem_70b[8][k] for k in keys[:3])
assert math.isclose(state_8, 16 * count_params(LLAMA3_70B) / 8)
node = 8 * 80 * GB  # one node: 8 GPUs of 80 GB
state_all = sum(mem_70b[1][k] for k in keys[:3])  # the whole model state, tp=1
weights_and_gradients_8 = mem_70b[8]["parameters"] + mem_70b[8]["gradients"]
print(f"one node of 8 x 80 GB holds {node / GB:.0f} GB in all; the model state alone is {state_all / GB:,.0f} GB")
print(f"at tp=8, the bf16 weights and gradients alone take {weights_and_gradients_8 / GB:.1f} GB per GPU")
assert state_all > node and weights_and_gradients_8 < 80 * GB
fig

# %% [markdown]
# TP divides the model state by $t$: from 1.1 TB on one GPU to about 141 GB per GPU at tp=8, one
# full node (the numbers printed above). The book says that TP brings the 70B model onto one 8-GPU
# node; with Adam's 16 bytes per parameter it cannot, however the state is cut, because the whole
# node holds 640 GB and the state alone is 1,129 GB. What fits at tp=8 is the bf16 weights and
# gradients (35 GB per GPU): the book's statement holds for those, not for the optimizer states.
# Training the 70B model needs more GPUs: the optimizer states sharded over data-parallel ranks on
# other nodes (ZeRO-1, chapter 03), or TP=16, which fits the model state but leaves the node,
# where the next section's cost appears. Activations, which TP alone only partly divides, are
# chapter 05's subject.
#
# ### The price: throughput once TP leaves the node
# The memory saving is paid in communication that nothing hides. A simple model makes the trade
# visible: per micro-batch, the compute divides by $t$ while every layer still all-reduces the full
# $b \cdot s \cdot h$ activation four times. Inside a node the ring runs over NVLink; a TP group of
# 16 spans two nodes and runs at the speed of the network between them. The inputs below are
# illustrative H100-like numbers (989 TFLOP/s dense bf16; NVLink 450 GB/s and 5 µs latency; 50 GB/s
# and 10 µs between nodes), **not measurements**: change them and rerun.


# %%
def tp_scaling(peak_flops):
    return tensor_parallel_scaling(
        LLAMA3_8B,
        [1, 2, 4, 8, 16, 32],
        seq=4096,
        micro_batch=1,
        flops=training_flops(LLAMA3_8B, 4096, seq_len=4096),
        peak_flops=peak_flops,
        intra_node=AlphaBeta(5e-6, 450e9),
        inter_node=AlphaBeta(1e-5, 50e9),
    )


scaling = tp_scaling(989e12)
per_gpu = {r["tp"]: r["tokens_per_s_per_gpu"] for r in scaling}
drop = {t: per_gpu[t] / per_gpu[t // 2] for t in (2, 4, 8, 16, 32)}
assert all(d < 1 for d in drop.values()), "every doubling of tp costs per-GPU throughput"
assert drop[16] < drop[8] < drop[4], "the drop grows, and is largest where the group leaves the node"
for r in scaling:
    print(
        f"tp={r['tp']:>2}: {r['tokens_per_s_per_gpu']:8,.0f} tokens/s per GPU, communication "
        f"{r['comm_s'] / r['step_s']:4.0%} of the step ({r['bandwidth']})"
    )
print("per-GPU throughput kept at each doubling: " + ", ".join(f"{t // 2}->{t} {d:.2f}" for t, d in drop.items()))
print(f"tp=8 against tp=1: {per_gpu[8] / per_gpu[1]:.2f} with compute at the peak")
slower = {r["tp"]: r["tokens_per_s_per_gpu"] for r in tp_scaling(0.4 * 989e12)}
print(
    f"tp=8 against tp=1: {slower[8] / slower[1]:.2f} with compute at 40% of the peak "
    "(about the MFU of chapter 01's recorded H100 runs)"
)
# The prose below reads these: about half kept at the peak, nearly three quarters at 40% of it.
assert 0.45 < per_gpu[8] / per_gpu[1] < 0.6 and 0.65 < slower[8] / slower[1] < 0.8
fig = Figure(figsize=(6, 3), layout="constrained")
ax = fig.subplots()
ax.plot([str(t) for t in per_gpu], list(per_gpu.values()), "o-")
ax.axvline(3.5, color="k", ls=":", lw=1)
ax.text(3.6, max(per_gpu.values()) * 0.9, "TP group spans nodes", fontsize=8)
ax.set(xlabel="tp", ylabel="tokens/s per GPU", title="Llama-3 8B, alpha-beta model (illustrative inputs)")
fig

# %% [markdown]
# Read the printed ratios. Inside the node the model already loses a lot: by tp=8 each GPU keeps
# only about half of its tp=1 throughput, as communication grows to half the step. Then comes the
# largest drop, from 8 to 16, as the all-reduces move to the inter-node network: that much matches
# the book's measurement. Two things do not. The book's benchmark declines more gently up to tp=8;
# our model runs the compute at the GPU's peak, which no training run reaches, so the
# all-reduces weigh more beside it: at 40% of the peak, tp=8 keeps nearly three quarters (the last
# line above). And the book sees a steeper drop again from 16 to 32, where this model's is milder
# than from 8 to 16, because once the ring runs on the network its time hardly grows with $t$.
# What the model leaves out is what makes real runs worse at large $t$: GEMMs that get thinner and
# less efficient (next section), more network hops and congestion, and the fact that TP's freed
# memory is usually spent on a larger batch.
#
# ### Thin matrices are slow matrices
# Under TP each rank's MLP multiply is $(b s, h) \times (h, 4h/t)$: the same number of rows, $t$
# times fewer columns, so $t$ times fewer FLOPs per call but the same input to read. A GPU has
# thousands of cores to keep busy and needs large tiles of output to do it, so its efficiency
# falls as the matrices thin out. A CPU has a handful of cores and may show nothing of the kind,
# or even the opposite when the thinner operand fits in its cache: below is this machine's CPU
# (a plot only, as timings differ from machine to machine), then the GPU when one is present.


# %%
def gemm_flops_per_second(rows, h, columns, device="cpu", repeats=3):
    a, b = torch.randn(rows, h, device=device), torch.randn(h, columns, device=device)
    best = math.inf
    for _ in range(repeats + 1):  # the first call warms up
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = Timeline.now()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, Timeline.now() - t0)
    return 2 * rows * h * columns / best


h_gemm = 512 if QUICK else 1024
gemm = {t: gemm_flops_per_second(512, h_gemm, 4 * h_gemm // t) for t in (1, 2, 4, 8)}
fig = Figure(figsize=(6, 3), layout="constrained")
ax = fig.subplots()
ax.plot(list(gemm), [v / gemm[1] for v in gemm.values()], "o-")
ax.set(
    xlabel="tp",
    ylabel="FLOP/s relative to tp=1",
    xticks=list(gemm),
    title=f"(512, {h_gemm}) x ({h_gemm}, 4h/tp) on this CPU",
)
fig

# %%
if torch.cuda.is_available():
    gpu = {t: gemm_flops_per_second(8192, 8192, 4 * 8192 // t, device="cuda") for t in (1, 2, 4, 8)}
    for t, v in gpu.items():
        print(f"tp={t}: {v / 1e12:.0f} TFLOP/s ({v / gpu[1]:.0%} of tp=1)")
else:
    print(
        "no GPU here: the GPU version of this measurement runs when CUDA is present "
        "(no recorded GPU run is in results/ yet)"
    )

# %%
cluster.close()

# %% [markdown]
# ## Summary
# - Two identities: split $W$ by columns (all-gather the outputs) or by rows (all-reduce partial
#   sums). Column then row leaves **one all-reduce per MLP, one per attention** in forward, and
#   the same in backward through the conjugate pair f / f*.
# - Attention splits by heads; tp must divide the K/V heads (Llama-3 8B: tp ≤ 8).
# - The TP model trains to the same numbers as one process and as `parallelize_module`.
# - LayerNorm gradients need no synchronisation under TP; dropout in the replicated regions needs
#   one seed across the TP group.
# - TP divides the weights, gradients and optimizer states by tp, the activations only partly,
#   and puts blocking all-reduces on the critical path, which is why TP stays inside a node.
#
# Next, chapter 05 splits what TP left replicated, along the sequence.

# %% [markdown]
# ## Your turn
# Open [exercises/04_tensor_parallelism_exercises.ipynb](../exercises/04_tensor_parallelism_exercises.ipynb): write the conjugate pair f and f*, the column- and row-parallel linear layers built on them, and a
# cross-entropy over a vocabulary split across ranks.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/04_tensor_parallelism_exercises.ipynb` grades
# the whole notebook from a terminal.
