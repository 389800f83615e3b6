# %% [markdown]
# # 01 · First steps: training on one GPU
#
# Before spreading a model over many GPUs, we need to know exactly what one training step
# costs on a single device. A step has three phases:
#
# 1. **forward**: the batch goes through the layers and produces a loss; along the way,
#    autograd keeps some intermediate tensors (the *activations*) because backward needs them;
# 2. **backward**: the gradient of the loss with respect to every weight is computed, layer by
#    layer in reverse, and the kept activations are released as soon as they have been used;
# 3. **optimizer step**: Adam updates every weight from its gradient and from two running
#    averages it keeps per weight.
#
# So four kinds of tensors compete for memory: **weights**, **gradients**, **optimizer states**
# and **activations**. This notebook counts each of them with a formula, then measures them on
# a real model, here on the CPU, and checks that the two agree. Then it shows the two standard
# ways to fit a larger batch into a fixed memory (activation recomputation and gradient
# accumulation), how to read a profiler trace and memory timeline, and how efficiently the
# hardware is used (MFU and HFU).
#
# Everything below runs on a laptop CPU. Where a number really needs a GPU (the CUDA allocator's
# timeline, MFU on an H100) the notebook measures it when a GPU is present.

# %% tags=["parameters"]
WORLD_SIZE = 2  # ranks for the data-parallel training run of section 6 (1 or more)
QUICK = True  # True: small sweeps and short runs, about 20 s on 2 CPU cores; False: wider sweeps, more timing rounds, 200 training steps (longer)
SEED = 0

# %%
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import copy
import math
import os
import time
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker
from matplotlib.figure import Figure
import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.profiler_util import EventList
from torch.utils.checkpoint import checkpoint

from ultrascale.memory import GB, GiB, activation_bytes, model_state_bytes, saved_activation_bytes, state_bytes
from ultrascale.model import (
    GPT,
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA3_405B,
    GPTConfig,
    count_params,
    hfu,
    mfu,
    rope_tables,
    training_flops,
)
from ultrascale import records
from ultrascale.plan import datasheet
from ultrascale.viz.live import LivePlot, ProgressBar, fan_out

assert isinstance(WORLD_SIZE, int) and WORLD_SIZE >= 1, "WORLD_SIZE must be a positive integer"
torch.manual_seed(SEED)
# Figures are matplotlib Figure objects that a cell shows by returning them. Loading the
# notebook's plotting backend now lets Jupyter draw them as images from the first one on
# (headless, with the Agg backend, they show as text).
plt.switch_backend(plt.get_backend())
# The models here are tiny: splitting their small matrix products over threads costs more than
# it saves, and on a shared 2-core machine extra threads mostly wait for each other. One thread
# also makes the timings below steadier.
torch.set_num_threads(1)
LOG_DIR = Path("log")  # profiler traces go here (git-ignored)
LOG_DIR.mkdir(exist_ok=True)

# %% [markdown]
# ## 1. How many parameters?
#
# The book's model is a GPT-2-style decoder with hidden size `h`, vocabulary `v` and `L`
# transformer blocks. Counting its weights matrix by matrix:
#
# | piece | weights | biases |
# |---|---|---|
# | token embedding (shared with the output layer) | `h·v` | |
# | per block: Q, K and V projections | `3h²` | `3h` |
# | per block: attention output projection | `h²` | `h` |
# | per block: MLP up-projection to `4h` | `4h²` | `4h` |
# | per block: MLP down-projection | `4h²` | `h` |
# | per block: two LayerNorms (scale and shift) | | `4h` |
# | final LayerNorm | | `2h` |
#
# which adds up to **N = h·v + L·(12h² + 13h) + 2h**. There is no positional-embedding table:
# the course model encodes positions with rotary embeddings (RoPE), which have no weights.
# Let us build the model and count what PyTorch allocates (`model.parameters()` yields the tied
# embedding matrix once).


# %%
def book_param_count(h, v, L):
    return h * v + L * (12 * h**2 + 13 * h) + 2 * h


tiny = GPTConfig(vocab_size=256, hidden=64, layers=2, heads=4)
model = GPT(tiny)
n_instantiated = sum(p.numel() for p in model.parameters())
print(f"TinyGPT (h=64, v=256, L=2): {n_instantiated:,} parameters")
assert n_instantiated == book_param_count(64, 256, 2) == count_params(tiny) == 116_480

for h, v, L, heads in [(32, 100, 1, 2), (128, 1000, 3, 4), (96, 50, 5, 6), (256, 512, 4, 8)]:
    config = GPTConfig(vocab_size=v, hidden=h, layers=L, heads=heads)
    assert sum(p.numel() for p in GPT(config).parameters()) == book_param_count(h, v, L)
print("the formula matches the instantiated model for every shape tried")

# %% [markdown]
# At large `h`, the `12h²` term dominates: the embedding grows like `h` and the biases and norms
# like `h` per layer, while the matrices grow like `h²`. For a GPT-3-sized model (h = 12288,
# L = 96, GPT-2's 50,257-token vocabulary) the square terms are more than 99% of the count, while
# in a toy model with the same vocabulary the embedding is nearly everything:

# %%
print(f"{'h':>6} {'L':>4} {'N':>16}  share of 12·L·h²")
for h, L in [(64, 2), (768, 12), (4096, 32), (12288, 96)]:
    n = book_param_count(h, 50257, L)
    print(f"{h:>6} {L:>4} {n:>16,}  {12 * L * h * h / n:6.1%}")
assert 12 * 96 * 12288**2 / book_param_count(12288, 50257, 96) > 0.99

# %% [markdown]
# The Llama 3 models used in later chapters differ from the book's GPT in three ways: the MLP is
# SwiGLU (three matrices of width `ffn` instead of two of width `4h`), attention uses
# grouped-query heads (K and V are 8 heads wide, not `h`), and input embedding and output layer are
# separate matrices. `count_params` counts each variant from its config without building it,
# and gives the published sizes exactly:

# %%
published = {
    "Llama 3 8B": (LLAMA3_8B, 8_030_261_248),
    "Llama 3 70B": (LLAMA3_70B, 70_553_706_496),
    "Llama 3 405B": (LLAMA3_405B, 405_853_388_800),
}
print(f"{'model':<13} {'h':>6} {'L':>4} {'count_params':>16}  {'GPT formula with same h, v, L':>30}")
for name, (config, size) in published.items():
    n = count_params(config)
    assert n == size, (name, n)
    gpt_like = book_param_count(config.hidden, config.vocab_size, config.layers)
    print(f"{name:<13} {config.hidden:>6} {config.layers:>4} {n:>16,}  {gpt_like:>30,}")

# %% [markdown]
# ## 2. Weights, gradients and optimizer states
#
# ### The formulas
# Bytes per number: FP32 4, BF16 2, FP8 1. With Adam, per parameter:
#
# - **full precision (FP32)**: weight 4, gradient 4, momentum 4, variance 4: **16 bytes**;
# - **BF16 mixed precision**: BF16 weight 2 and gradient 2 for the forward and backward, an FP32
#   copy of the weights (the *master weights*, 4) that the optimizer updates so that small
#   updates are not rounded away, and the FP32 momentum and variance (8): again **16 bytes**.
#   Mixed precision saves compute and activation memory, not weight memory.
# - Frameworks such as nanotron also accumulate gradients in FP32 (4 more bytes): **20 bytes**.
#   The book labels that buffer `m_params_fp32` in its formula although it holds gradients.
#
# The table below is computed by `ultrascale.memory.model_state_bytes` and checked against the
# book's.

# %%
book_table = {1: (16, 20), 7: (112, 140), 70: (1120, 1400), 405: (6480, 8100)}  # GB, as printed
print(f"{'params':>7}  {'FP32':>8}  {'BF16 mixed':>10}  {'BF16 + FP32 grads':>17}")
for billions, (plain, with_fp32_grads) in book_table.items():
    n = billions * 10**9
    fp32 = sum(model_state_bytes(n, mixed_precision=False).values()) / GB
    mixed = sum(model_state_bytes(n, mixed_precision=True).values()) / GB
    accum = sum(model_state_bytes(n, mixed_precision=True, fp32_grad_accum=True).values()) / GB
    print(f"{billions:>6}B  {fp32:>6.0f}GB  {mixed:>8.0f}GB  {accum:>15.0f}GB")
    assert fp32 == mixed == plain and accum == with_fp32_grads
    assert (fp32 > 80) == (billions >= 7)  # from 7B on, more than an 80 GB H100 holds
print(
    "bytes per parameter, BF16 with FP32 gradients:", model_state_bytes(1, mixed_precision=True, fp32_grad_accum=True)
)

# %% [markdown]
# From 7B parameters upwards, weights, gradients and Adam states alone exceed the 80 GB of an
# H100, before a single activation is stored. (On a real GPU, 1 to 2 GB more go to the CUDA
# context and kernels the moment you touch the device: `torch.ones((1, 1)).to("cuda")` followed
# by `nvidia-smi` shows it. Section 7 measures it when a GPU is present.)
#
# ### Measured on a real model
# `ultrascale.memory.state_bytes` adds up the bytes of the real tensors after one Adam step on
# a small GPT in FP32. Adam creates its states lazily, during the first `step()`, so they only
# exist after it.

# %%
torch.manual_seed(SEED)
small = GPTConfig(vocab_size=256, hidden=128, layers=4, heads=4)
model = GPT(small)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
idx = torch.randint(0, small.vocab_size, (4, 64))
print("before the first step:", state_bytes(model, optimizer))
model.loss(idx, idx).backward()
optimizer.step()
measured = state_bytes(model, optimizer)
n = count_params(small)
predicted = model_state_bytes(n, mixed_precision=False)
n_tensors = len(list(model.parameters()))
print(f"N = {n:,} parameters in {n_tensors} tensors")
print(f"{'':>16} {'predicted':>11} {'measured':>11}")
for key in ("parameters", "gradients", "optimizer states"):
    print(f"{key:>16} {predicted[key]:>11,} {measured[key]:>11,}")
    assert abs(measured[key] - predicted[key]) <= 0.05 * predicted[key]
assert measured["parameters"] == 4 * n and measured["gradients"] == 4 * n
# The 8 bytes per parameter are exact; the rest is one FP32 step counter per parameter tensor
assert measured["optimizer states"] - predicted["optimizer states"] == 4 * n_tensors
first_state = optimizer.state[next(model.parameters())]
print({k: (tuple(v.shape), v.dtype) for k, v in first_state.items()})

# %% [markdown]
# The difference, 4 bytes for each of the 67 parameter tensors, is Adam's **step counter**: Adam divides its running
# averages by `1 - β^t` to undo their bias towards zero in the first steps, so it needs the step
# number `t`; PyTorch keeps it as one FP32 scalar tensor per parameter tensor (a tensor rather
# than a Python int so that the update can be captured in CUDA graphs and compiled). For a real
# model that is a few hundred tensors against billions of parameters: negligible.
#
# The same measurement for BF16 mixed precision, set up by hand: a BF16 model for forward and
# backward, an FP32 master copy of its weights that Adam updates, and a copy back after each step.

# %%
torch.manual_seed(SEED)
model_bf16 = GPT(small).to(torch.bfloat16)
master = [p.detach().float().requires_grad_() for p in model_bf16.parameters()]  # FP32 master weights
optimizer = torch.optim.Adam(master, lr=1e-3)
model_bf16.loss(idx, idx).backward()  # BF16 gradients on the BF16 weights
for p, m in zip(model_bf16.parameters(), master):
    m.grad = p.grad.float()  # the optimizer works in FP32...
optimizer.step()
with torch.no_grad():
    for p, m in zip(model_bf16.parameters(), master):
        p.copy_(m)  # ...and the BF16 weights are refreshed from the master copy
for m in master:
    m.grad = None  # the FP32 copies of the gradients were only needed for the step
bf16 = state_bytes(model_bf16)
adam_moments = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
mixed = {
    "parameters": bf16["parameters"],
    "gradients": bf16["gradients"],
    # the FP32 master copy is the optimizer's: only it reads and writes it
    "optimizer states": sum(m.nbytes for m in master) + sum(v.nbytes for v in adam_moments),
}
print(mixed)
assert mixed == model_state_bytes(n, mixed_precision=True)
assert sum(mixed.values()) == 16 * n

# %% [markdown]
# ## 3. Activation memory
#
# ### The formula
# Korthikanti et al. (2022) counted, for one GPT block with 16-bit activations, everything
# autograd keeps for backward. With sequence length `seq`, micro-batch `bs`, hidden size `h`
# and `a` attention heads, the bytes for `L` blocks are
#
# **m_act = L · seq · bs · h · (34 + 5·a·seq / h)**
#
# Per token and per hidden unit, 34 bytes come from the linear-size tensors: 11 in attention (the
# input of the QKV projection, Q, K, V, the input of the output projection, a dropout mask), 19
# in the MLP (its input, the 4h-wide input and output of GeLU, a dropout mask) and 4 for the two
# LayerNorm inputs. The `5·a·seq/h` term is the attention scores: per head a `seq × seq` matrix,
# of which the softmax output (2 bytes), a dropout mask (1) and the dropout output (2) are kept.
# So activations grow **linearly with the batch** and **quadratically with the sequence length**.
#
# An example derived from the book's formula (our numbers, not a figure printed in the book), a
# Llama-3-8B-like shape:

# %%
example = GPTConfig(vocab_size=128256, hidden=4096, layers=32, heads=32)  # only the shape is used
m_act = activation_bytes(example, seq=4096, micro_batch=1)
print(f"h=4096, L=32, a=32, seq=4096, bs=1:  m_act = {m_act:.3e} bytes = {m_act / GiB:.1f} GiB")
assert m_act == 32 * 4096 * 1 * 4096 * (34 + 5 * 32 * 4096 // 4096)
assert round(m_act / 1e11, 2) == 1.04 and round(m_act / GiB) == 97

# %% [markdown]
# ### What autograd really keeps
# `torch.autograd.graph.saved_tensors_hooks` lets us see every tensor that autograd stores for
# backward, as it is stored. Below we run the blocks of a tiny GPT under BF16 autocast (with
# *eager* attention, which builds the score matrix explicitly as in the formula) and list what
# each backward node keeps. To compare with the formula we feed the blocks a hidden-state tensor
# directly (the model runs without its embedding, final norm and output layer, as a pipeline
# stage in the middle would): the formula leaves those out.


# %%
def blocks_only(model):
    """The model without embedding, final norm and head, as a middle pipeline stage would be:
    fed a (batch, seq, h) hidden state, it runs only the L blocks, which is what the
    activation formula counts (recomputation included: it is the model's own forward)."""
    model.embed = model.norm = model.head = None
    return model


def saved_by_node(output):
    """(backward node, saved tensor) pairs, found by walking the autograd graph from `output`."""
    found, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if attr.startswith("_saved_"):
                value = getattr(node, attr)
                if torch.is_tensor(value) and value.dim() > 0:
                    found.append((node.name(), attr[len("_saved_") :], value))
        todo += [next_node for next_node, _ in node.next_functions]
    return found


one_block = GPTConfig(vocab_size=256, hidden=64, layers=1, heads=4)
layers = blocks_only(GPT(one_block))
b, s, h, a = 2, 48, one_block.hidden, one_block.heads
d = h // a
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = layers(torch.randn(b, s, h))
weights = {p.untyped_storage().data_ptr() for p in layers.parameters()}


def kind_of(shape):
    if shape == (s, s):
        return "causal mask"
    if shape[-2:] == (s, s):
        return "scores"
    if shape == (b, s, 1):
        return "norm statistics"
    if shape[:2] == (b, s) or shape[0] == b * s or shape in [(b * a, s, d), (b * a, d, s)]:
        return "activation"
    if shape[0] == s:
        return "RoPE table"
    return "BF16 weight copy"


rows, counted = [], set()
for node, attr, t in sorted(saved_by_node(out), key=lambda r: r[0]):
    ptr = t.untyped_storage().data_ptr()
    if ptr in weights:  # an FP32 parameter: it exists anyway, not an activation
        continue
    kind, nbytes = kind_of(tuple(t.shape)), t.untyped_storage().nbytes()
    rows.append(
        (node, attr, tuple(t.shape), str(t.dtype).replace("torch.", ""), kind, nbytes if ptr not in counted else 0)
    )
    counted.add(ptr)
print(f"{'backward node':<26}{'saves':<9}{'shape':<18}{'dtype':<10}{'kind':<18}{'bytes / (s·b·h)':>8}")
for node, attr, shape, dtype, kind, nbytes in rows:
    per = f"{nbytes / (b * s * h):.2f}" if kind == "activation" else ("(same)" if nbytes == 0 else "")
    print(f"{node:<26}{attr:<9}{str(shape):<18}{dtype:<10}{kind:<18}{per:>8}")
totals = {}
for *_, kind, nbytes in rows:
    totals[kind] = totals.get(kind, 0) + nbytes
assert sum(totals.values()) == saved_activation_bytes(layers, torch.randn(b, s, h), torch.bfloat16)
assert totals["activation"] == 40 * s * b * h  # 40, not 34: see below
assert totals["scores"] == 2 * a * s * s * b  # 2, not 5
assert totals["norm statistics"] == 2 * 2 * 4 * s * b  # mean and 1/std, FP32, two LayerNorms
assert totals["causal mask"] == s * s and totals["RoPE table"] == 4 * s * d
assert totals["BF16 weight copy"] == 2 * 12 * h * h
del out
{kind: f"{nbytes:,} bytes" for kind, nbytes in totals.items()}

# %% [markdown]
# Reading the table against the formula:
#
# - **40 bytes per token and hidden unit instead of 34.** The two LayerNorm inputs are kept in
#   FP32: under autocast the residual stream stays FP32, and LayerNorm runs in FP32 for
#   accuracy, so they cost 4 + 4 instead of 2 + 2 (+4). There is no dropout in the course model
#   (modern LLM pre-training usually turns it off), so its two 1-byte masks are missing (−2).
#   The course model has three separate Q, K and V projections (as torchtitan and picotron do,
#   so that tensor parallelism can later cut them head by head); under autocast each of them
#   casts the same LayerNorm output to BF16 for itself and keeps its cast, where the formula's
#   fused QKV projection keeps one copy (3 × 2 instead of 2: +4). A model stored in BF16 has
#   no casts to make and keeps one. The rest is the formula's list: the BF16 inputs of the
#   attention-output and MLP-up projections (2 each), Q and K after RoPE and V (2 each), the
#   GeLU input (8) and its output, which is the input of the MLP-down projection (8).
# - **2 bytes per attention score instead of 5**: the BF16 softmax output only; without
#   dropout there is no mask and no dropped-out copy.
# - **Terms the formula ignores**, small here and negligible at real sizes: the LayerNorm mean
#   and 1/std (16 bytes per token per layer), the causal mask (`seq²` bytes, shared by the whole
#   batch), RoPE's cos and sin tables in BF16, and the BF16 copies of the weight matrices that
#   autocast makes once per step (`2 · 12h²` bytes per layer, independent of batch and sequence).
#
# ### Measured against predicted: a sweep over batch and sequence length
# Now we measure, for several batch sizes and sequence lengths, the bytes saved by the blocks of
# a 2-layer model, and fit them.

# %%
sweep = GPTConfig(vocab_size=256, hidden=64, layers=2, heads=4)
sweep_layers = blocks_only(GPT(sweep))
seqs = [64, 128, 192, 256] if QUICK else [64, 128, 192, 256, 320, 384, 448, 512]
batches = [1, 2, 3, 4] if QUICK else [1, 2, 3, 4, 5, 6, 7, 8]
measured_act = np.array(
    [
        [saved_activation_bytes(sweep_layers, torch.randn(bs, seq, sweep.hidden), torch.bfloat16) for bs in batches]
        for seq in seqs
    ]
)
predicted_act = np.array([[activation_bytes(sweep, seq, bs) for bs in batches] for seq in seqs])
print(f"{'seq':>5} " + " ".join(f"{'bs=' + str(bs):>12}" for bs in batches) + "   (measured bytes)")
for seq, row in zip(seqs, measured_act):
    print(f"{seq:>5} " + " ".join(f"{int(v):>12,}" for v in row))

# %% [markdown]
# **Linear in the batch.** Each extra sequence adds the same number of bytes (the second
# differences along the batch are exactly zero).
#
# What does not depend on the batch (the intercept of the line) is what the previous table
# called constant: the BF16 weight copies, the causal mask and the RoPE tables.

# %%
L, h, a = sweep.layers, sweep.hidden, sweep.heads
assert np.all(np.diff(measured_act, n=2, axis=1) == 0), "not linear in the batch"
per_sequence = measured_act[:, 1] - measured_act[:, 0]  # slope: bytes per extra sequence
intercept = measured_act[:, 0] - batches[0] * per_sequence
seqs_arr = np.array(seqs)
assert np.all(intercept == L * (2 * 12 * h * h + seqs_arr**2 + 4 * seqs_arr * h // a))

# %% [markdown]
# **Linear plus quadratic in the sequence.** The bytes per sequence, fitted as
# `α·seq + β·seq²`, give the two constants of the formula for this model: α / (L·h) bytes per
# token per hidden unit (34 in the formula) and β / (L·a) bytes per attention score (5).

# %%
alpha, beta = np.linalg.lstsq(
    np.stack([seqs_arr, seqs_arr**2], axis=1).astype(float), per_sequence.astype(float), rcond=None
)[0]
linear_const, score_const = alpha / (L * h), beta / (L * a)
print(f"fitted: {linear_const:.2f} bytes per token·h (formula: 34),  {score_const:.2f} bytes per score (formula: 5)")
assert np.allclose(per_sequence, alpha * seqs_arr + beta * seqs_arr**2, rtol=0, atol=1e-3)  # exactly quadratic
assert math.isclose(linear_const, 40 + 16 / h) and math.isclose(score_const, 2)  # 16/h: the LayerNorm statistics

# %% [markdown]
# So the shape of the formula is exactly right, and its two constants describe a model with
# dropout and 16-bit LayerNorm inputs. The ratio measured / predicted for the activations (the
# batch-dependent part) therefore has to lie between two limits we can state in advance:
# - short sequences, where the linear term dominates: (40 + 16/h) / 34 ≈ 1.18;
# - long sequences, where the scores dominate: 2 / 5 = 0.4.

# %%
activations_measured = per_sequence[:, None] * np.array(batches)[None, :]
ratio = activations_measured / predicted_act
band = (2 / 5, (40 + 16 / h) / 34)
print("measured / predicted activations:")
for seq, row in zip(seqs, ratio):
    print(f"  seq {seq:>4}: " + "  ".join(f"{r:.3f}" for r in row))
assert np.all((ratio >= band[0]) & (ratio <= band[1])), ratio
assert np.all(np.diff(ratio[:, 0]) < 0)  # falls towards 2/5 as the quadratic term takes over

# A Figure, not pyplot: it shows where the cell returns it, the same way in Jupyter and headless
fig = Figure(figsize=(11, 3.6), layout="constrained")
left, right = fig.subplots(1, 2)
for j, bs in enumerate(batches):
    (line,) = left.plot(seqs, measured_act[:, j] / 2**20, "o-", label=f"measured, bs={bs}")
    left.plot(seqs, predicted_act[:, j] / 2**20, "--", color=line.get_color())
left.set(xlabel="sequence length", ylabel="MiB saved for backward", title="measured (solid) vs formula (dashed)")
left.legend(fontsize=8)
right.plot(seqs, ratio[:, 1], "o-", label="measured / formula")
right.axhspan(*band, color="grey", alpha=0.15, label="band from the accounting")
right.set(xlabel="sequence length", ylabel="ratio", ylim=(0, 1.3), title="activations: measured / formula")
right.legend(fontsize=8)
fig

# %% [markdown]
# ### At real sizes
# For the Llama 3 models at `bs = 1`, activations are small next to the model states for short
# sequences and overtake them at long ones. (The formula takes `a` as the number of query heads;
# grouped-query attention does not shrink the score matrices, only K and V.)

# %%
seq_range = np.array([512, 1024, 2048, 4096, 8192, 16384])
fig = Figure(figsize=(7, 3.6), layout="constrained")
ax = fig.subplots()
for name, (config, _) in published.items():
    acts = np.array([activation_bytes(config, int(seq), 1) for seq in seq_range]) / GB
    (line,) = ax.plot(seq_range, acts, "o-", label=f"{name}: activations")
    ax.axhline(16 * count_params(config) / GB, color=line.get_color(), linestyle=":", linewidth=1)
ax.set(
    xscale="log",
    yscale="log",
    xlabel="sequence length",
    ylabel="GB",
    title="activations at bs=1 (dotted: weights + grads + Adam, 16 bytes/param)",
)
ax.set_xticks(seq_range, [str(v) for v in seq_range])
ax.legend(fontsize=8)

states_8b = 16 * count_params(LLAMA3_8B)
share = {
    int(seq): activation_bytes(LLAMA3_8B, int(seq), 1) / (activation_bytes(LLAMA3_8B, int(seq), 1) + states_8b)
    for seq in seq_range
}
print("Llama 3 8B, share of activations in the total:", {k: f"{v:.0%}" for k, v in share.items()})
assert share[1024] < 0.10 and share[4096] > 0.40  # negligible at 1k, a large share by 4k
fig

# %% [markdown]
# This is the book's observation that activations are negligible for short sequences and become
# the main concern from about 2 to 4 thousand tokens: for Llama 3 8B they grow from 7% of the
# memory at 1,024 tokens to almost half at 4,096.
#
# ## 4. The memory widget
# `ultrascale.viz.memory_widget` puts all of this together for one GPU: weights, gradients, Adam
# states and activations of a Llama 3 model for a chosen sequence length, micro-batch, precision,
# recomputation mode and parallel layout (the parallel degrees are the subject of later
# chapters). The static version, for the three Llama 3 presets at 4,096 tokens:

# %%
from ultrascale.viz.memory_widget import memory_figure, memory_widget

memory_figure(preset="Llama 3 8B", seq=4096, micro_batch=1)

# %%
memory_figure(preset="Llama 3 70B", seq=4096, micro_batch=1)

# %%
memory_figure(preset="Llama 3 405B", seq=4096, micro_batch=1)

# %% [markdown]
# In JupyterLab the same figure comes with controls: pick a preset, then move the sliders for the
# sequence length, micro-batch and parallel degrees, or pick a recomputation mode or ZeRO stage,
# and watch the bars move. (A notebook viewer that does not run Python shows one line of text
# below instead.)

# %% tags=["nbval-ignore-output"]
# (a widget's output is an interactive view, different in every session: not compared in CI)
widget = memory_widget()
widget

# %% [markdown]
# ## 5. Activation recomputation
#
# Instead of keeping every activation until backward, we can keep only a few and compute the
# rest again when backward needs them: memory for compute. Two common choices:
#
# - **full**: keep only the input of each block, and run the whole block forward a second time
#   during backward. Activations shrink to one tensor per block, and the forward is done twice:
#   forward is a third of forward + backward, so about 33% more compute (the book quotes 30 to 40%
#   extra time).
# - **selective**: recompute only the attention core, `softmax(QKᵀ/√d)·V`. It holds the
#   quadratic part of the memory (the `5·a·seq/h` term) but few FLOPs, so it buys the most
#   memory per unit of extra compute.
#
# The course model implements both with `torch.utils.checkpoint.checkpoint(use_reentrant=False)`:
# around each block for *full*, around the attention core for *selective*
# (`model.set_recompute(mode)`). Measured on the blocks of a 4-layer model:

# %%
rc_config = GPTConfig(vocab_size=256, hidden=64, layers=4, heads=4)
torch.manual_seed(SEED)
rc_model = GPT(rc_config)
rc_layers = blocks_only(copy.deepcopy(rc_model))  # the same blocks; rc_model keeps its embedding
rc_seq, rc_bs = 256, 4
x_rc = torch.randn(rc_bs, rc_seq, rc_config.hidden)
saved = {}
for mode in ("none", "selective", "full"):
    rc_layers.set_recompute(mode)
    saved[mode] = saved_activation_bytes(rc_layers, x_rc, torch.bfloat16)
formula = {mode: activation_bytes(rc_config, rc_seq, rc_bs, mode) for mode in saved}
print(f"{'mode':<10} {'measured':>12} {'reduction':>10}   {'formula':>12} {'reduction':>10}")
for mode in saved:
    print(
        f"{mode:<10} {saved[mode]:>12,} {1 - saved[mode] / saved['none']:>10.0%}   "
        f"{formula[mode]:>12,} {1 - formula[mode] / formula['none']:>10.0%}"
    )

L, h, a, tokens, d = rc_config.layers, rc_config.hidden, rc_config.heads, rc_seq * rc_bs, rc_config.head_dim
# full: each block's FP32 input (4 bytes, the residual stream) and the RoPE tables, nothing else
assert saved["full"] == L * 4 * tokens * h + 2 * rc_seq * (d // 2) * 4
# selective: exactly the scores (2 bytes each) and the causal mask are gone; Q, K and V, the
# recomputation's inputs, were kept anyway
assert saved["none"] - saved["selective"] == L * (2 * a * rc_seq * tokens + rc_seq**2)
assert saved["full"] < 0.1 * saved["none"] and saved["selective"] < 0.6 * saved["none"]

# %% [markdown]
# The formula's selective mode keeps 34 bytes per token·h and full mode keeps a BF16 input (2);
# our model keeps a bit more in both (the FP32 residual stream again, and the three BF16 casts of
# the attention input), but the reductions go the same way: selective removes everything
# quadratic in `seq` and nothing else, full removes nearly everything.
#
# Recomputation must not change the result: backward sees exactly the tensors it would have
# seen without it, recomputed by the same kernels. On a CPU the gradients are bit-for-bit equal
# (on a GPU some kernels are not deterministic, so there they agree to rounding).


# %%
def gradients(model, idx, mode):
    model.set_recompute(mode)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(idx, idx)
    loss.backward()
    model.set_recompute("none")
    return [p.grad.clone() for p in model.parameters()]


idx_rc = torch.randint(0, rc_config.vocab_size, (rc_bs, rc_seq))
reference_grads = gradients(rc_model, idx_rc, "none")
for mode in ("selective", "full"):
    assert all(torch.equal(g, r) for g, r in zip(gradients(rc_model, idx_rc, mode), reference_grads)), mode
print("selective and full recomputation give exactly the gradients of no recomputation")

# %% [markdown]
# And the price, in time: forward + backward of the same model, best of several runs. (Timings
# depend on the machine and its load, so this cell's output is not checked.)


# %% tags=["nbval-ignore-output"]
def fwd_bwd_seconds(model, idx, mode):
    model.set_recompute(mode)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(idx, idx)
    loss.backward()
    seconds = time.perf_counter() - start
    model.set_recompute("none")
    model.zero_grad(set_to_none=True)
    return seconds


# The modes take turns, and each keeps its best time: a machine busy with something else for a
# moment then slows all modes alike instead of one. The first round warms up. (Each round is a
# few seconds of BF16 on a CPU: QUICK keeps two rounds, QUICK = False ten for steadier numbers.)
timing = {mode: float("inf") for mode in ("none", "selective", "full")}
for round_ in ProgressBar("timing the three modes").iterate(range((2 if QUICK else 10) + 1)):
    for mode in timing:
        seconds = fwd_bwd_seconds(rc_model, idx_rc, mode)
        if round_ > 0:
            timing[mode] = min(timing[mode], seconds)
# what FLOP counting predicts (blocks only): a forward costs 24h² + 4·seq·h per token and layer,
# forward + backward three times that; full redoes the forward, selective its 4·seq·h part
layer_forward = 24 * rc_config.hidden**2 + 4 * rc_seq * rc_config.hidden
flop_overhead = {"none": 0, "selective": 4 * rc_seq * rc_config.hidden / (3 * layer_forward), "full": 1 / 3}
print(f"{'mode':<10} {'fwd+bwd':>9} {'measured overhead':>18} {'FLOP overhead':>14}")
for mode, seconds in timing.items():
    print(f"{mode:<10} {seconds * 1000:6.1f} ms {seconds / timing['none'] - 1:>+18.0%} {flop_overhead[mode]:>+14.0%}")

# %% [markdown]
# Full recomputation costs at least one more forward, a third of the step in FLOPs: the 30 to
# 40% the book quotes. Selective recomputation is not cheap *here*: with `h = 64` and
# `seq = 256`, the attention-score products are `4·seq·h / (24h² + 4·seq·h)` = 40% of a forward,
# so redoing them is a sizeable fraction of the step. On a CPU both measured overheads usually
# come out above the FLOP count, because what is recomputed includes memory-bound element-wise
# work (softmax, masking, GeLU, LayerNorm) that takes more time per FLOP than the matrix
# products. Selective recomputation pays off when `seq` is small next to `h`, which is the case
# of real models: the book's two reference numbers for GPT-3 (175B) follow from the formula and
# from FLOP counting:
#
# - **70% less activation memory**: GPT-3 has h = 12288, a = 96 and seq = 2048, so the score
#   term `5·a·seq/h = 80` against 34: dropping it keeps 34/114 of the memory;
# - **2.7% extra compute**: the attention-score products cost `4·seq·h` FLOPs per token per layer
#   in forward, against `24·h²` for the layer's matrices; recomputing them adds
#   `4·seq·h / (24h² + 4·seq·h)` of a forward pass. As a share of forward + backward it is a third
#   of that, below 1%.

# %%
h3, a3, seq3 = 12288, 96, 2048
memory_saved = 1 - 34 / (34 + 5 * a3 * seq3 / h3)
extra_forward = 4 * seq3 * h3 / (24 * h3**2 + 4 * seq3 * h3)
print(
    f"GPT-3, selective recomputation: {memory_saved:.1%} less activation memory, "
    f"{extra_forward:.1%} of a forward pass recomputed ({extra_forward / 3:.1%} of a training step)"
)
assert round(memory_saved, 2) == 0.70 and round(extra_forward, 3) == 0.027
assert 0.30 <= 2 / 6 <= 0.40  # full recomputation: one more forward (2N) on top of 6N per token

# %% [markdown]
# Three remarks from the book:
# - **FlashAttention already recomputes the scores** in its backward instead of storing them,
#   so anyone using it (or `F.scaled_dot_product_attention` on a GPU) already runs selective
#   recomputation without asking for it.
# - **Recomputing can be faster than storing** on a GPU: reading a large activation back from
#   memory can take longer than recomputing it from a small one, so the extra FLOPs are partly
#   paid back by fewer memory accesses.
# - **DeepSeek-V3's multi-head latent attention (MLA)** compresses keys and values into a small
#   latent vector, shrinking what attention must keep even further.
#
# How the three modes compare across model sizes and sequence lengths, at `bs = 1` (from the
# formula): recomputation matters most for small models at long sequences, where activations
# dominate.

# %%
fig = Figure(figsize=(13, 3.6), layout="constrained")
axes = fig.subplots(1, 3)
modes = ("none", "selective", "full")
seq_bars = [4096, 16384]
for ax, (name, (config, _)) in zip(axes, published.items()):
    states = 16 * count_params(config) / GB
    for i, seq in enumerate(seq_bars):
        acts = [activation_bytes(config, seq, 1, m) / GB for m in modes]
        xs = np.arange(3) + i * 4
        ax.bar(xs, [states] * 3, color="#4C72B0", label="weights+grads+Adam" if i == 0 else None)
        ax.bar(xs, acts, bottom=states, color="#C44E52", label="activations" if i == 0 else None)
    ax.set_xticks(list(range(3)) + list(range(4, 7)), [f"{m}\n{seq}" for seq in seq_bars for m in modes], fontsize=7)
    ax.set(title=name, ylabel="GB")
axes[0].legend(fontsize=8)
fig

# %% [markdown]
# ### Checkpointing every C blocks: the square-root rule
# *Full* recomputation keeps the input of every block. One can keep fewer: cut the `N` blocks into
# segments of `C` blocks, keep only each segment's input, and in backward recompute one segment at
# a time, just before its gradients are needed. Two things are then alive at the worst moment,
# when backward starts on the last segment: the `N/C` kept segment inputs, and the `C` blocks'
# worth of activations that segment's recomputation has just rebuilt. Counting one kept input and
# one block's activations as one unit each (the classic analysis of Chen et al., 2016), memory is
# `N/C + C`, smallest at `C = √N`: `2√N` units instead of `N`. The compute price does not depend
# on `C`: every block is recomputed exactly once, one extra forward, as for full recomputation.
#
# A transformer block does not fit the unit count: it keeps far more than its input. With `x`
# the bytes of one kept input and `A` the bytes one block saves, the peak is `(N/C)·x + C·A`,
# smallest at `C = √(N·x/A)`. We measure it on 64 blocks of the course GPT. To see the peak *during
# backward* we count, at every moment, the bytes of the tensors autograd holds: a
# `saved_tensors_hooks` pack hook wraps each saved tensor in a small object that adds its bytes
# (once per storage) and subtracts them when autograd lets go of it. The segments use
# `checkpoint(..., use_reentrant=True)`, whose recomputation saves its tensors through the same
# hooks (the non-reentrant version keeps the recomputed tensors to itself, out of the hooks'
# sight). FP32 here, no autocast, so that `x` is simply `4·seq·bs·h` bytes.


# %%
class SavedBytes:
    """Bytes of the tensors autograd holds for backward: `now`, and `peak`, the most at any moment.
    A storage saved by several operations counts once; parameters are left out, as before."""

    def __init__(self, model):
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.holders, self.now, self.peak = {}, 0, 0  # storage address -> [bytes, saved how many times]

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.weights:
            return tensor
        entry = self.holders.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Saved(self, tensor)

    def unpack(self, saved):
        return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    """What autograd keeps in place of a saved tensor; autograd drops it once backward has used it."""

    def __init__(self, owner, tensor):
        self.owner, self.tensor, self.address = owner, tensor, tensor.untyped_storage().data_ptr()

    def __del__(self):
        entry = self.owner.holders[self.address]
        entry[1] -= 1
        if entry[1] == 0:
            self.owner.now -= entry[0]
            del self.owner.holders[self.address]


ck_config = GPTConfig(vocab_size=256, hidden=32, layers=64, heads=2)
torch.manual_seed(SEED)
ck_blocks = GPT(ck_config).blocks
ck_N, ck_seq, ck_bs, ck_h = ck_config.layers, 32, 1, ck_config.hidden
ck_cos, ck_sin = rope_tables(torch.arange(ck_seq), ck_config.head_dim, ck_config.rope_theta)
ck_input = torch.randn(ck_bs, ck_seq, ck_h)
block_forwards = [0]
for block in ck_blocks:
    block.register_forward_pre_hook(lambda *_: block_forwards.__setitem__(0, block_forwards[0] + 1))


def forward_in_segments(x, C):
    """The blocks in segments of C, each segment checkpointed; C=None: no checkpointing."""

    def segment(x, first, size):
        for block in ck_blocks[first : first + size]:
            x = block(x, ck_cos, ck_sin)
        return x

    if C is None:
        return segment(x, 0, ck_N)
    for first in range(0, ck_N, C):
        x = checkpoint(segment, x, first, C, use_reentrant=True)
    return x


def measure_segments(C):
    """(bytes held after forward, peak bytes held, block forwards run, input gradient)."""
    x = ck_input.clone().requires_grad_()
    saved, block_forwards[0] = SavedBytes(ck_blocks), 0
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        out = forward_in_segments(x, C)
        after_forward = saved.now
        out.backward(torch.ones_like(out))  # the gradient of out.sum(), which saves nothing itself
    assert saved.now == 0  # backward let go of everything
    ck_blocks.zero_grad(set_to_none=True)
    return after_forward, saved.peak, block_forwards[0], x.grad


_, peak_none, forwards_none, grad_none = measure_segments(None)
x_bytes = 4 * ck_seq * ck_bs * ck_h  # one kept FP32 input
rope_bytes = ck_cos.nbytes + ck_sin.nbytes  # the RoPE tables, saved once for all blocks
A_bytes = (peak_none - rope_bytes) // ck_N  # what one block saves, its own input included
assert A_bytes * ck_N + rope_bytes == peak_none and forwards_none == ck_N
segment_sizes = [C for C in range(1, ck_N + 1) if ck_N % C == 0]
measured_peak = {}
print(
    f"N = {ck_N} blocks; one kept input x = {x_bytes:,} bytes; one block saves A = {A_bytes:,} bytes "
    f"= {A_bytes / x_bytes:.2f} x; no checkpointing: {peak_none:,} bytes"
)
print(f"{'C':>4} {'kept after forward':>19} {'peak, measured':>15} {'(N/C)x + CA + R - x':>20} {'block forwards':>15}")
for C in segment_sizes:
    kept, peak, forwards, grad = measure_segments(C)
    # the last segment's input is both kept and saved again by its first block: it counts once (- x);
    # R: the RoPE tables, saved by every block's attention, one storage
    predicted = (ck_N // C) * x_bytes + C * A_bytes + rope_bytes - x_bytes
    assert kept == (ck_N // C) * x_bytes and peak == predicted, (C, kept, peak, predicted)
    assert forwards == 2 * ck_N  # one extra forward, whatever C
    assert torch.equal(grad, grad_none)  # and the same gradient, bit for bit
    measured_peak[C] = peak
    print(f"{C:>4} {kept:>19,} {peak:>15,} {predicted:>20,} {forwards:>15}")
best_C = min(measured_peak, key=measured_peak.get)
C_star = math.sqrt(ck_N * x_bytes / A_bytes)
print(
    f"smallest peak at C = {best_C}: {measured_peak[best_C] / peak_none:.1%} of no checkpointing, "
    f"{measured_peak[best_C] / measured_peak[1]:.1%} of checkpointing every block (C = 1); "
    f"√(N·x/A) = {C_star:.2f}, √N = {math.sqrt(ck_N):.0f}"
)
assert best_C == 2 and 1 < C_star < 2

fig = Figure(figsize=(6, 3.2), layout="constrained")
ax = fig.add_subplot()
Cs = np.geomspace(1, ck_N, 200)
ax.plot(
    Cs,
    ((ck_N / Cs) * x_bytes + Cs * A_bytes + rope_bytes - x_bytes) / 2**20,
    "k-",
    lw=1,
    label="(N/C)·x + C·A (+ RoPE tables − x)",
)
ax.plot(
    segment_sizes,
    [measured_peak[C] / 2**20 for C in segment_sizes],
    "o",
    color="#C44E52",
    label="measured peak of saved tensors",
)
ax.axhline(peak_none / 2**20, color="grey", ls=":", label="no checkpointing")
ax.axvline(C_star, color="#4C72B0", ls="--", lw=1, label="C = √(N·x/A)")
ax.axvline(math.sqrt(ck_N), color="#4C72B0", ls=":", lw=1, label="C = √N (x = A)")
ax.set(
    xscale="log",
    yscale="log",
    xlabel="C, blocks per checkpointed segment",
    ylabel="MiB",
    title=f"{ck_N} blocks of the course GPT, FP32, seq {ck_seq}",
)
ax.set_xticks(segment_sizes, [str(C) for C in segment_sizes])
for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
    axis(matplotlib.ticker.FormatStrFormatter("%.1f"))  # 0.3 rather than 3 x 10^-1
ax.legend(fontsize=7)
fig

# %% [markdown]
# The measured peaks equal the formula to the byte (the asserts above), and so does the rule's
# shape: memory first falls as `C` grows (fewer kept inputs), then rises (a longer segment to
# rebuild). Where it turns depends on how much a block keeps against its input: here a block
# saves 18 times its input (the ratio printed above), so the best segment is `√(64/18.4) ≈ 1.9`
# blocks, not `√64 = 8`, and two blocks per segment beat one by the margin printed above. In real
# models the same count decides: with FlashAttention a block keeps roughly 17 times its BF16 input
# (the 34 bytes per token and hidden unit against 2), so segments longer than one block start to
# pay only from a few dozen layers on, and most frameworks checkpoint every block (`C = 1`),
# which is also the simplest. Every value of `C` costs the same one extra forward: the block
# forwards counted above are `2N` for all of them.

# %% [markdown]
# ## 6. Gradient accumulation
#
# When even a recomputed micro-batch of the batch we want does not fit, we split the batch:
# run forward and backward on `grad_acc` micro-batches of `mbs` sequences one after the other,
# let their gradients **add up** in `param.grad`, and step the optimizer once. The batch the
# optimizer sees is the global batch
#
# **gbs = mbs × grad_acc**, and in tokens **bst = gbs × seq**.
#
# The loss of the full batch is the *mean* over its sequences, so each micro-batch's loss must be
# divided by `grad_acc` before backward: summing the gradients of micro-batch means gives
# `grad_acc` times the gradient. One optimizer step every 8 forward/backward passes means
# `grad_acc = 8` and `gbs = 8 × mbs`:

# %%
torch.manual_seed(SEED)
acc_model = GPT(GPTConfig(vocab_size=256, hidden=64, layers=2, heads=4))
mbs, grad_acc, seq = 2, 8, 32
gbs = mbs * grad_acc
batch = torch.randint(0, 256, (gbs, seq + 1))
inputs, targets = batch[:, :-1], batch[:, 1:]

acc_model.zero_grad()
acc_model.loss(inputs, targets).backward()  # the whole batch at once
full_batch = [p.grad.clone() for p in acc_model.parameters()]

acc_model.zero_grad()
for x, y in zip(inputs.split(mbs), targets.split(mbs)):  # grad_acc micro-batches
    (acc_model.loss(x, y) / grad_acc).backward()  # .grad accumulates across backward calls
accumulated = [p.grad.clone() for p in acc_model.parameters()]

acc_model.zero_grad()
for x, y in zip(inputs.split(mbs), targets.split(mbs)):
    acc_model.loss(x, y).backward()  # forgetting to divide...
summed = [p.grad.clone() for p in acc_model.parameters()]

# FP32 sums taken in a different order differ in the last bits only: relative 1e-5 is ~100 ulps
for g_acc, g_full, g_sum in zip(accumulated, full_batch, summed):
    torch.testing.assert_close(g_acc, g_full, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_sum, grad_acc * g_full, rtol=1e-5, atol=1e-6)  # ...scales everything by grad_acc
worst = max(((a - f).abs().max() / f.abs().max()).item() for a, f in zip(accumulated, full_batch))
assert worst < 1e-5
# print what the assert guarantees, not the last bits (they differ from CPU to CPU)
print(
    f"gbs = {mbs} x {grad_acc} = {gbs}: accumulated gradient equals the full-batch gradient "
    "(largest difference below 1e-5 of the largest entry)"
)

# %% [markdown]
# With Adam, the missing division would not even show as a larger step (Adam normalises the
# gradient's scale away), but the gradient clipping threshold, the weight decay balance and any
# comparison with a run at another `grad_acc` would all be off. Two more costs of accumulation:
# the micro-batches run one after another, so a step takes `grad_acc` times longer; and the
# gradient buffers must stay allocated for the whole step, while a single backward could have
# handed each gradient to the optimizer and freed it as soon as it was computed.
#
# The time line of one optimizer step with `grad_acc = 4`:

# %%
fig = Figure(figsize=(9, 1.6), layout="constrained")
ax = fig.subplots()
t = 0
for i in range(4):
    ax.barh(0, 1, left=t, color="#4C72B0", edgecolor="white")
    ax.text(t + 0.5, 0, f"F{i + 1}", ha="center", va="center", color="white", fontsize=8)
    ax.barh(0, 2, left=t + 1, color="#DD8452", edgecolor="white")
    ax.text(t + 2, 0, f"B{i + 1}  (grad += ...)", ha="center", va="center", color="white", fontsize=8)
    t += 3
ax.barh(0, 1, left=t, color="#55A868", edgecolor="white")
ax.text(t + 0.5, 0, "step", ha="center", va="center", color="white", fontsize=8)
ax.set(xticks=[], yticks=[], xlabel="time: 4 micro-batches (forward F, backward B), one optimizer step")
ax.set_xlim(0, t + 1)
fig

# %% [markdown]
# ### A short training run
# Now a real run that combines accumulation with the next chapter's idea: `WORLD_SIZE` ranks each
# take their share of the global batch, accumulate over `grad_acc` micro-batches, then average
# their gradients with one all-reduce before the optimizer step. The global batch becomes
# `gbs = mbs × grad_acc × WORLD_SIZE`. The data is a toy language: arithmetic sequences modulo the
# vocabulary, with a random start and step, so the loss can fall well below `ln 256 ≈ 5.5`.
#
# The plot shows each rank's loss on its own shard while the ranks train, and a progress bar counts
# rank 0's steps (`fan_out` hands every `ctx.log` to both). Afterwards we replay the
# same steps in this process, without ranks and without accumulation, on the whole global batch
# at once, and require the same losses and weights.

# %%
train_config = GPTConfig(vocab_size=256, hidden=64, layers=2, heads=4)
TRAIN = dict(steps=30 if QUICK else 200, mbs=4, grad_acc=2, seq=32, lr=3e-3, seed=SEED)


def toy_batch(step, n, seq, vocab, seed):
    """n arithmetic sequences modulo vocab: the same batch for a given step, wherever it is drawn."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def train_data_parallel(ctx, config, steps, mbs, grad_acc, seq, lr, seed):
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = GPT(config).to(ctx.device)  # the CPU with gloo, this rank's GPU with NCCL
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    per_rank = mbs * grad_acc
    losses = []
    for step in range(steps):
        inputs, targets = toy_batch(step, per_rank * ctx.world_size, seq, config.vocab_size, seed)
        mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)  # this rank's shard
        inputs, targets = inputs[mine].to(ctx.device), targets[mine].to(ctx.device)
        optimizer.zero_grad(set_to_none=True)
        local_loss = torch.zeros((), device=ctx.device)
        for x, y in zip(inputs.split(mbs), targets.split(mbs)):
            loss = model.loss(x, y) / grad_acc
            loss.backward()
            local_loss += loss.detach()
        # average the gradients over ranks: one all-reduce of all of them flattened together
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat /= ctx.world_size
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))
        optimizer.step()
        ctx.log(step=step, loss=local_loss, done=step + 1)  # the plot reads step and loss, the bar done
        global_loss = local_loss.clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / ctx.world_size)
    return losses, {k: v.cpu().clone() for k, v in model.state_dict().items()}


cluster = Cluster(WORLD_SIZE)
print(cluster)

# %% tags=["nbval-ignore-output"]
# (a live plot redraws as often as timing allows, so its output is not compared in CI)
plot = LivePlot(
    "loss",
    x="step",
    title=f"{WORLD_SIZE} rank(s), grad_acc={TRAIN['grad_acc']}, gbs={TRAIN['mbs'] * TRAIN['grad_acc'] * WORLD_SIZE}",
)
start = time.perf_counter()
bar = ProgressBar("training", total=TRAIN["steps"])
results = cluster.run(train_data_parallel, train_config, **TRAIN, on_log=fan_out(plot, bar))
plot.finish()
print(f"{TRAIN['steps']} steps in {time.perf_counter() - start:.1f} s")

# %%
gbs = TRAIN["mbs"] * TRAIN["grad_acc"] * WORLD_SIZE
torch.manual_seed(TRAIN["seed"])
ref_model = GPT(train_config)
ref_optimizer = torch.optim.Adam(ref_model.parameters(), lr=TRAIN["lr"])
ref_losses = []
for step in range(TRAIN["steps"]):
    inputs, targets = toy_batch(step, gbs, TRAIN["seq"], train_config.vocab_size, TRAIN["seed"])
    ref_optimizer.zero_grad(set_to_none=True)
    loss = ref_model.loss(inputs, targets)
    loss.backward()
    ref_optimizer.step()
    ref_losses.append(loss.item())

losses, weights = results[0]
for rank, (_, w) in enumerate(results):  # all-reduce gives every rank the same average, bit for bit
    assert all(torch.equal(w[k], weights[k]) for k in weights), f"rank {rank} drifted"
# Same data and maths, summed in a different order: losses agree to FP32 rounding. Adam divides
# each gradient by its running RMS, which can enlarge a rounding difference in a near-zero
# gradient up to a fraction of one step (lr = 3e-3): 3e-4 leaves room for that over the run.
np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
for k, v in ref_model.state_dict().items():
    torch.testing.assert_close(weights[k], v, rtol=0, atol=3e-4, msg=k)
assert ref_losses[-1] < 0.75 * ref_losses[0], "the toy language should be learnable"
print(
    f"gbs = {TRAIN['mbs']} x {TRAIN['grad_acc']} x {WORLD_SIZE} = {gbs}: same losses and weights as one "
    f"process on the whole batch; loss {ref_losses[0]:.1f} -> {ref_losses[-1]:.1f}"
)

# %% [markdown]
# ### How large a batch?
# The book's reference points; where a size in tokens is ours, computed as `sequences × seq`, we say so:
#
# - recent LLM pre-training settles at roughly **4 to 60 million tokens per batch**;
# - **Llama 1** used about 4M tokens per batch for 1.4T tokens;
# - **DeepSeek-V3** grew its batch from 3,072 to 15,360 sequences over the first 469B tokens, then
#   kept 15,360; with its 4,096-token pre-training sequences that is (our arithmetic) 12.6M to 63M tokens, the top
#   of the range ("about 60M tokens" over 14T tokens);
# - larger batches give better gradient estimates but fewer optimizer steps for the same data,
#   hence the ramp: small batches early, while the loss drops fast. OpenAI's study of large-batch
#   training and section 4.2 of the MiniMax-01 report discuss how to choose.

# %%
deepseek_seq = 4096
for label, tokens_per_batch, total in [("Llama 1", 4e6, 1.4e12), ("DeepSeek-V3", 15360 * deepseek_seq, 14e12)]:
    print(
        f"{label:<12} {tokens_per_batch / 1e6:5.1f}M tokens per batch -> {total / tokens_per_batch:9,.0f} steps "
        f"for {total / 1e12:.1f}T tokens"
    )
assert 3072 * deepseek_seq / 1e6 == 12.582912 and abs(15360 * deepseek_seq - 60e6) < 0.05 * 60e6

# %% [markdown]
# ## 7. Profiling
#
# Formulas tell us what should happen; a profiler shows what did. `torch.profiler` records every
# operator (and on a GPU every kernel, memory copy and stream) with its time, and can export a
# trace to view in Chrome's trace viewer (`chrome://tracing`), https://ui.perfetto.dev or
# TensorBoard. Its `schedule` skips the first steps (`wait`), records but discards the next ones
# (`warmup`: first calls are slow, the profiler's own start-up included) and keeps `active` steps.
# `prof.step()` marks the end of each training step.

# %%
torch.manual_seed(SEED)
prof_model = GPT(GPTConfig(vocab_size=256, hidden=64, layers=2, heads=4))
prof_optimizer = torch.optim.Adam(prof_model.parameters(), lr=1e-3)
prof_idx = torch.randint(0, 256, (4, 64))


def train_step(model=prof_model, optimizer=prof_optimizer, idx=prof_idx):
    loss = model.loss(idx, idx)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


from ultrascale.profiling import quiet_native_stderr

activities = [torch.profiler.ProfilerActivity.CPU]
if torch.cuda.is_available():
    activities.append(torch.profiler.ProfilerActivity.CUDA)
trace_dir = LOG_DIR / "profile"
trace_name = f"ch01_{os.getpid()}"
for old in trace_dir.glob(f"{trace_name}.*.pt.trace.json"):
    old.unlink()  # only this kernel's earlier traces: a re-run replaces them

# %% tags=["nbval-ignore-output"]
# (timings differ from run to run; quiet_native_stderr hides the profiler library's start/stop lines)
with (
    quiet_native_stderr(),
    torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir), worker_name=trace_name),
        with_stack=True,
    ) as prof,
):
    for _ in range(5):
        train_step()
        prof.step()
# with_stack=True also records Python functions, the notebook's own machinery included:
# keep PyTorch's operators (aten::...) and the optimizer step in the table
ops = EventList([e for e in prof.key_averages() if e.key.startswith(("aten::", "Optimizer."))])
print(ops.table(sort_by="self_cpu_time_total", row_limit=12))

# %% [markdown]
# The table sums over the three active steps: matrix products (`aten::mm`, `aten::addmm`,
# `aten::bmm`) lead, and the optimizer's many small element-wise operations (one set per parameter
# tensor) follow. The trace file holds the same events on a time line:

# %%
from ultrascale.profiling import chrome_trace_events

trace_file = max(trace_dir.glob(f"{trace_name}.*.pt.trace.json"), key=lambda p: p.stat().st_mtime)
events = chrome_trace_events(trace_file)
steps_in_trace = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
print(f"Chrome trace written under {trace_dir}/; profiler steps it holds: {steps_in_trace}")
assert steps_in_trace == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]  # wait 1 + warmup 1, then 3
assert any(e.get("name") == "aten::mm" for e in events)

# %% [markdown]
# What to look for in a trace of a real (GPU, multi-GPU) run:
# - the CPU **launching kernels ahead** of the GPU: if the GPU time line has gaps while the CPU
#   is busy, launch overhead dominates (small kernels; CUDA graphs or `torch.compile` help);
# - **compute and communication in sequence** where they could overlap on separate streams
#   (chapters 2 and 3 overlap them);
# - **idle waits**: a rank waiting in a collective for a slower one;
# - **host-device copies** (`cudaMemcpy`) in the middle of a step, often an accidental `.item()`
#   or `.cpu()` that also forces the CPU to wait.
#
# ### A memory timeline
# With `profile_memory=True` (plus `record_shapes` and `with_stack`) the profiler also records
# every allocation and works out what each tensor was. `ultrascale.profiling.memory_timeline` turns
# that into bytes alive per category over time. Three training steps from a fresh optimizer:

# %% tags=["nbval-ignore-output"]
# (the profiler's messages differ from run to run; the checks are in the next cell)
from ultrascale.profiling import bytes_at, memory_timeline, peak_within, plot_memory_timeline, step_spans

torch.manual_seed(SEED)
mem_model = GPT(GPTConfig(vocab_size=256, hidden=64, layers=2, heads=4))
mem_optimizer = torch.optim.Adam(mem_model.parameters(), lr=1e-3)
with (
    quiet_native_stderr(),
    torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as mem_prof,
):
    for i in range(3):
        with torch.profiler.record_function(f"step {i + 1}"):
            train_step(mem_model, mem_optimizer, prof_idx)
times, sizes = memory_timeline(mem_prof)
spans = step_spans(mem_prof, "step ")

# %%
n_mem = count_params(mem_model.config)
optimizer_series = sizes["optimizer states"]
peaks = [peak_within(times, sum(sizes.values()), start, end) for _, start, end in spans]
adam_bytes = state_bytes(mem_model, mem_optimizer)["optimizer states"]
assert [name for name, *_ in spans] == ["step 1", "step 2", "step 3"]
# the FP32 weights, alive throughout (Adam's update briefly adds parameter-sized temporaries,
# which the profiler also files under "parameters")
assert all(bytes_at(times, sizes["parameters"], start) == 4 * n_mem for _, start, _ in spans)
assert bytes_at(times, optimizer_series, spans[0][1]) == 0  # no Adam state when step 1 starts
assert bytes_at(times, optimizer_series, spans[0][2]) == adam_bytes  # created in step 1's optimizer.step()
assert optimizer_series[-1] == adam_bytes  # ...and kept
# step 2 reaches higher than step 1, by the size of the optimizer states (up to 1%)
assert abs((peaks[1] - peaks[0]) - adam_bytes) <= 0.01 * peaks[0]
print(
    f"peak bytes alive in each step: {[f'{p / 2**20:.2f} MiB' for p in peaks]}; "
    f"Adam's states: {adam_bytes / 2**20:.2f} MiB"
)
ax = plot_memory_timeline(times, sizes, spans)
ax.set_title("CPU memory by category over three training steps")
ax.figure

# %% [markdown]
# Each step, activations pile up during the forward and drain during the backward while the
# gradients appear; the optimizer step runs and `zero_grad` frees the gradients. The first step
# has no Adam states yet: they appear in its `optimizer.step()` and stay. So **the second step is
# the first one at full height**, by exactly the size of the optimizer states: a job that runs out
# of memory at step 2 but not at step 1 is the classic symptom.
#
# On a GPU the timeline has one more feature the CPU cannot show: in the first step PyTorch's
# **caching allocator** requests memory from the driver (`cudaMalloc`, slow) and keeps it when
# tensors die, so that later steps reuse its cached blocks and do not call the driver at all. The
# first step is therefore slower and its reserved memory grows; later steps reuse the same
# blocks. `torch.cuda.memory._record_memory_history()` records every allocation with its stack,
# and `_dump_snapshot()` writes a file for https://pytorch.org/memory_viz. The next cell does that
# when a GPU is present, and measures the CUDA context.

# %% tags=["nbval-ignore-output"]
# (only does something on a GPU)
if torch.cuda.is_available():
    torch.ones((1, 1), device="cuda")  # creates the CUDA context
    free, total = torch.cuda.mem_get_info()
    print(
        f"CUDA context and kernels: {(total - free - torch.cuda.memory_reserved()) / GiB:.2f} GiB "
        f"(device memory in use by this process beyond PyTorch's own reservations)"
    )
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    gpu_model = GPT(GPTConfig(vocab_size=32768, hidden=1024, layers=8, heads=16)).cuda()
    gpu_optimizer = torch.optim.Adam(gpu_model.parameters(), lr=1e-4)
    gpu_idx = torch.randint(0, 32768, (8, 1024), device="cuda")
    for i in range(3):
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            train_step(gpu_model, gpu_optimizer, gpu_idx)
        torch.cuda.synchronize()
        print(
            f"step {i + 1}: peak allocated {torch.cuda.max_memory_allocated() / GiB:.2f} GiB, "
            f"reserved {torch.cuda.memory_reserved() / GiB:.2f} GiB"
        )
    snapshot = LOG_DIR / "cuda_memory_snapshot.pickle"
    torch.cuda.memory._dump_snapshot(str(snapshot))
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"snapshot written to {snapshot}: drag it onto https://pytorch.org/memory_viz")
    del gpu_model, gpu_optimizer
else:
    print("No GPU here: the CUDA allocator timeline and the CUDA context size need one.")

# %% [markdown]
# ## 8. How well is the hardware used? MFU and HFU
#
# A training step of a model with `N` parameters costs about **6·N FLOPs per token**: each
# weight takes part in one multiply-add (2 FLOPs) per token in the forward, and the backward
# needs twice that (the gradient with respect to the input and with respect to the weight),
# plus the attention-score products, `12·L·h·seq` per token for eager attention.
#
# - **MFU** (model FLOPs utilisation) = the model's FLOPs per second / the hardware's peak. It
#   counts only the work the model needs, so it does not reward wasted work.
# - **HFU** (hardware FLOPs utilisation) also counts FLOPs spent recomputing. With full
#   recomputation the forward runs twice, **2·N more per token**, so HFU / MFU = 8 / 6.
#
# To compare setups or hardware, use MFU: a run can raise its HFU by recomputing more while
# getting slower.
#
# The peak of a CPU is a matter of assumption: cores used × clock × FLOPs per cycle. We state
# ours and, as a sanity check, measure what a large matrix product reaches on the same thread.

# %%
ASSUMED_CPU_PEAK = dict(cores=1, ghz=3.7, flops_per_cycle=32)  # ASSUMPTION, see the text below
cpu_peak = ASSUMED_CPU_PEAK["cores"] * ASSUMED_CPU_PEAK["ghz"] * 1e9 * ASSUMED_CPU_PEAK["flops_per_cycle"]
mfu_config = GPTConfig(vocab_size=256, hidden=256, layers=4, heads=8)
mfu_seq, mfu_bs = 128, 4
tokens_per_step = mfu_seq * mfu_bs
n_mfu = count_params(mfu_config)
print(f"assumed peak: {cpu_peak / 1e9:.0f} GFLOP/s (FP32, one core)")
print(
    f"model: N = {n_mfu:,}; one step of {tokens_per_step} tokens = "
    f"{training_flops(mfu_config, tokens_per_step, mfu_seq) / 1e9:.1f} GFLOP"
)
# With the 6N rule (attention left out), full recomputation costs 8N: HFU / MFU = 8/6 exactly
assert 8 * n_mfu * tokens_per_step / (6 * n_mfu * tokens_per_step) == 8 / 6
# ...and it stays 8/6 with the attention term, since the extra forward is a third of the total
assert math.isclose(
    hfu(1000, mfu_config, cpu_peak, "full", mfu_seq) / mfu(1000, mfu_config, cpu_peak, seq_len=mfu_seq), 8 / 6
)

# %% [markdown]
# The assumption: one thread on a core that issues two 8-wide FP32 fused multiply-adds per cycle
# (2 × 8 × 2 = 32 FLOPs), at 3.7 GHz, the highest boost clock of the AMD EPYC (Zen 4) this
# notebook was written on. On another CPU, change `ASSUMED_CPU_PEAK`; the matrix-product
# measurement below tells you whether the assumption is plausible (it should stay below it).

# %% tags=["nbval-ignore-output"]
# (timings: not compared in CI)
a_mat, b_mat = torch.randn(1024, 1024), torch.randn(1024, 1024)
matmul_times = []
for _ in range(6):  # the first is a warm-up
    start = time.perf_counter()
    a_mat @ b_mat
    matmul_times.append(time.perf_counter() - start)
matmul_best = min(matmul_times[1:])
print(
    f"a 1024x1024 FP32 matrix product reaches {2 * 1024**3 / matmul_best / 1e9:.0f} GFLOP/s "
    f"({2 * 1024**3 / matmul_best / cpu_peak:.0%} of the assumed peak)"
)

torch.manual_seed(SEED)
mfu_model = GPT(mfu_config)
mfu_optimizer = torch.optim.Adam(mfu_model.parameters(), lr=1e-4)
mfu_idx = torch.randint(0, 256, (mfu_bs, mfu_seq))
step_times = {"none": [], "full": []}
rounds = range((3 if QUICK else 10) + 1)  # the modes take turns; round 0 warms up
for round_ in ProgressBar("timing training steps").iterate(rounds):
    for mode, times_of_mode in step_times.items():
        mfu_model.set_recompute(mode)
        start = time.perf_counter()
        train_step(mfu_model, mfu_optimizer, mfu_idx)
        if round_ > 0:
            times_of_mode.append(time.perf_counter() - start)
print(f"{'recompute':<10} {'step':>9} {'tokens/s':>9} {'MFU':>7} {'HFU':>7}")
for mode, times_of_mode in step_times.items():
    tokens_per_s = tokens_per_step / min(times_of_mode)
    print(
        f"{mode:<10} {min(times_of_mode) * 1000:7.0f}ms {tokens_per_s:9,.0f} "
        f"{mfu(tokens_per_s, mfu_config, cpu_peak, mfu_seq):7.1%} {hfu(tokens_per_s, mfu_config, cpu_peak, mode, mfu_seq):7.1%}"
    )
_ = mfu_model.set_recompute("none")  # back to no recomputation (it returns the model)
# %% [markdown]
# With full recomputation the step takes longer, so MFU drops, while HFU (which credits the
# recomputed forward) should stay close to the MFU of the plain run: the hardware is as busy as before,
# a quarter of its work just is not new. (The optimizer step, element-wise and memory-bound, is
# included in the step time, which lowers both numbers for a model this small.)
#
# On a GPU the same measurement gives the number that matters in practice. The next cell measures it when a GPU is present and
# records the result in `results/`; without a GPU it shows the recorded result, if there is one.

# %% tags=["nbval-ignore-output"]
# (a GPU measurement, or a recorded one: not compared in CI)
# MFU divides by the dense BF16 peak of the GPU's data sheet (ultrascale.plan.datasheet)
RESULTS = Path("..") / "results"  # one file per device: one_gpu_mfu_<device>.json (see results/README.md)


def measure_gpu_mfu():
    name = torch.cuda.get_device_name(0)
    sheet = datasheet(name)
    peak = sheet.bf16_flops if sheet else None
    config = GPTConfig(vocab_size=32768, hidden=2048, layers=16, heads=16, attention="sdpa")
    model = GPT(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    seq, bs, warmup, timed = 2048, 8, 3, 5
    idx = torch.randint(0, config.vocab_size, (bs, seq), device="cuda")
    record = {
        **records.provenance(name),
        "model": str(config),
        "params": count_params(config),
        "seq": seq,
        "micro_batch": bs,
        "peak_bf16_flops": peak,
    }
    for mode in ("none", "selective", "full"):
        model.set_recompute(mode)
        for i in range(warmup + timed):
            if i == warmup:
                torch.cuda.synchronize()
                start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                train_step(model, optimizer, idx)
        torch.cuda.synchronize()
        tokens_per_s = timed * bs * seq / (time.perf_counter() - start)
        record[mode] = {"tokens_per_s": tokens_per_s}
        if peak:  # SDPA's kernels skip the masked half: count the causal attention FLOPs
            record[mode]["mfu"] = mfu(tokens_per_s, config, peak, seq, causal=True)
            record[mode]["hfu"] = hfu(tokens_per_s, config, peak, mode, seq, causal=True)
    return record


def show_mfu(record, label):
    print(label)
    for mode in ("none", "selective", "full"):
        r = record[mode]
        utilisation = (
            f"MFU {r['mfu']:.1%}  HFU {r['hfu']:.1%}"
            if "mfu" in r
            else "(no data sheet known for this GPU: add it to ultrascale.plan.DATASHEETS)"
        )
        print(f"  recompute={mode:<10} {r['tokens_per_s']:12,.0f} tokens/s  {utilisation}")


if torch.cuda.is_available():
    record = measure_gpu_mfu()
    show_mfu(record, f"MEASURED NOW on {record['device']} (torch {record['torch']})")
    print(f"recorded in results/{records.write('one_gpu_mfu', record, RESULTS).name}")
else:
    recorded = records.recorded("one_gpu_mfu", RESULTS)
    for path, record in recorded:
        show_mfu(record, records.label(record, path))
    if not recorded:
        print(
            "No GPU here, and no recorded result (results/one_gpu_mfu_<device>.json) yet: run this "
            "notebook on a GPU machine to measure and record one."
        )

# %% [markdown]
# `benchmarks/bench_mfu.py` asks the same question of a ~350M and a ~1.3B course GPT, each run five
# ways on one GPU: attention written out in PyTorch ("eager", the full score matrix in memory),
# SDPA's fused FlashAttention kernel, SDPA under `torch.compile`, and SDPA with selective and with
# full recomputation. Its records, where there are any:

# %% tags=["nbval-ignore-output"]
# (recorded GPU numbers, or a note that there are none: not compared in CI)
bench_records = records.recorded("mfu_bench_350m", RESULTS) + records.recorded("mfu_bench_1b", RESULTS)
for path, record in bench_records:
    print(records.label(record, path))
    print(
        f"  GPT {record['params'] / 1e6:,.0f}M parameters, seq {record['seq']}, micro-batch "
        f"{record['micro_batch']}, bf16, peak {record['peak_flops'] / 1e12:.0f} TFLOP/s"
    )
    for row in record["rows"]:
        print(
            f"  {row['variant']:<28} {row['tokens_per_s']:>9,.0f} tokens/s   MFU {row['mfu']:6.1%}   "
            f"HFU {row['hfu']:6.1%}   {row['peak_memory_gib']:5.1f} GiB"
        )
if not bench_records:
    print("No bench_mfu record in results/ yet (run benchmarks/bench_mfu.py on a GPU).")

# %% [markdown]
# In the H100 run recorded on 2026-11-26, fused attention is what matters most: at 1.3B, SDPA ran
# 2.15x as fast as eager attention and needed half the memory (eager at 350M and micro-batch 8
# ran out of the 80 GB). `torch.compile` fused the element-wise work around the matmuls for
# another 11-12%. The best MFU was 39.9% at 1.3B but only 29.4% at 350M: with h = 1024 each
# matmul is small, so the element-wise kernels, the optimizer step and the launches weigh more
# beside them. Full recomputation shows the MFU/HFU distinction as chapter 01's formula predicts:
# MFU fell from 35.9% to 28.9% while HFU, which counts the repeated forward, rose from 35.9% to 38.6%,
# and the memory dropped from 37.7 to 21.8 GiB.

# %% [markdown]
# ## Summary
# - Parameters: `N = h·v + L(12h² + 13h) + 2h` for the book's GPT, exact on the instantiated model.
# - Weights, gradients and Adam: 16 bytes per parameter in FP32 and in BF16 mixed precision (20
#   with FP32 gradient accumulation), measured exactly apart from Adam's step counters.
# - Activations: `L·seq·bs·h·(34 + 5a·seq/h)` has the right shape (linear in the batch, linear +
#   quadratic in the sequence); its constants depend on the model (dropout, precision of the
#   LayerNorm inputs), and we accounted for every byte of ours.
# - Recomputation trades compute for memory: selective removes the quadratic term cheaply, full
#   keeps one tensor per block for one more forward; gradients are unchanged.
# - Checkpointing every `C` of `N` blocks keeps `(N/C)·x + C·A` bytes at its peak (measured to the
#   byte): `√N` segments when a kept input weighs as much as a block's activations, `√(N·x/A)` in
#   general, always for one extra forward.
# - Gradient accumulation gives the large-batch gradient exactly, if each micro-batch loss is
#   divided by `grad_acc`.
# - The profiler shows where time goes and, per category, where memory goes: optimizer states
#   appear in step 1, so step 2 is the first at full height.
# - MFU counts the model's FLOPs, HFU also the recomputed ones (8/6 with full recomputation).
#
# ## Your turn
# Open [exercises/01_one_gpu_exercises.ipynb](../exercises/01_one_gpu_exercises.ipynb): count the parameters, write the activation-memory
# calculator with its three recomputation modes, and write a gradient-accumulation step that
# matches the large batch exactly.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/01_one_gpu_exercises.ipynb` grades
# the whole notebook from a terminal.

# %%
cluster.close()
