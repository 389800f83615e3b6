# %% [markdown]
# # A2 · Typical scales in LLM training
#
# Every later chapter argues with a handful of sizes: how many numbers an activation holds, how
# big a weight matrix is, what the optimizer keeps beside it, how many FLOPs a step costs. This
# appendix of the book collects those counts in one place. Here we do not just write them down:
# we build the blocks and count their parameters, let PyTorch count the FLOPs of a real forward
# and backward, and fill in a table for the Llama 3 models.
#
# In this notebook you will
# 1. count the elements of a micro-batch's tokens and hidden states;
# 2. build bias-free transformer blocks with and without a gated (GLU) MLP and find exactly
#    $16h^2$ and $12h^2$ parameters;
# 3. add the embeddings and the output head, and compare the estimate with the exact count of
#    the course models;
# 4. count gradients and optimizer states, and untangle the book's wording for the latter;
# 5. measure forward and backward FLOPs with `torch.utils.flop_counter.FlopCounterMode`,
#    against $2TN$ and $4TN$, and find the attention term in the difference;
# 6. tabulate all of it for Llama 3 8B, 70B and 405B.
#
# The counts live in `lib/ultrascale/scales.py`, as plain functions: the overlap appendix (A3)
# and the configuration planner of chapter 10 import them from there. Counts are in *elements*;
# multiply by the bytes of the number format (2 for bf16, 4 for fp32) to get bytes.

# %% tags=["parameters"]
WORLD_SIZE = 2  # unused: this appendix starts no ranks, it only counts
QUICK = True  # the FLOP measurements use tiny models either way; QUICK only trims the sweeps (about 5 s on 2 CPU cores)
SEED = 0

# %%
# %matplotlib inline
import torch
import torch.nn as nn
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch.utils.flop_counter import FlopCounterMode

from ultrascale.memory import BYTES_PER_ELEMENT, GB, model_state_bytes
from ultrascale.model import (
    GPT,
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA3_405B,
    Attention,
    Block,
    GPTConfig,
    Llama,
    LlamaConfig,
    SwiGLU,
    attention_flops_per_token,
    count_params,
    matmul_params,
    training_flops,
)
from ultrascale.scales import (
    BOOK_OPTIMIZER_TOTAL_AS_PRINTED,
    backward_flops,
    block_matrices,
    block_params,
    embedding_params,
    forward_flops,
    hidden_state_elements,
    model_params,
    optimizer_state_elements,
    scale_row,
    tokens,
    weight_elements,
)

torch.manual_seed(SEED)
torch.set_num_threads(1)  # tiny models: one thread is fastest, and FLOP counts do not depend on it
PRESETS = {"Llama 3 8B": LLAMA3_8B, "Llama 3 70B": LLAMA3_70B, "Llama 3 405B": LLAMA3_405B}

# %% [markdown]
# ## 1. Tokens and hidden states
#
# A micro-batch holds `mbs` sequences of `seq` tokens, so `seq · mbs` tokens go through the
# model together. Between two layers each token is a vector of `h` numbers: the **hidden state**
# of a layer has `seq · mbs · h` elements. That is the tensor tensor parallelism gathers,
# pipeline parallelism sends to the next stage, and activation memory stores many times over.

# %%
for seq, mbs, h in [(4096, 1, 4096), (8192, 1, 8192), (8192, 4, 16384)]:
    n = hidden_state_elements(seq, mbs, h)
    assert n == tokens(seq, mbs) * h
    print(
        f"seq {seq:>5}, mbs {mbs}, h {h:>5}: {tokens(seq, mbs):>6,} tokens, hidden state {n:>13,} elements "
        f"= {BYTES_PER_ELEMENT['bf16'] * n / 2**20:,.0f} MiB in bf16"
    )

# %% [markdown]
# ## 2. One transformer block: $16h^2$ or $12h^2$
#
# Leave out the biases and the norms' few `h`-sized vectors, and a block is its weight matrices:
#
# | matrix | shape | parameters |
# |---|---|---|
# | attention q, k, v | three `h × h` | $3h^2$ |
# | attention output | `h × h` | $h^2$ |
# | MLP in, **GLU**: gate and up | two `h × 4h` | $8h^2$ |
# | MLP in, plain | one `h × 4h` | $4h^2$ |
# | MLP down | `4h × h` | $4h^2$ |
#
# A gated MLP (GLU; SwiGLU in Llama) multiplies two projections of the input element by element,
# `down(silu(gate(x)) * up(x))`, so it has one more `h × 4h` matrix. Total: $16h^2$ with a GLU,
# $12h^2$ without. We build both from the course model's own pieces, with `bias=False` and norms
# without learned weights, and count what PyTorch allocated.


# %%
class PlainMLP(nn.Module):
    """The non-gated MLP without biases: h -> 4h -> h."""

    def __init__(self, h):
        super().__init__()
        self.up = nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(4 * h, h, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def bias_free_block(h, heads, glu):
    """A pre-norm block of the course model with no biases and weightless norms."""
    mlp = SwiGLU(h, 4 * h) if glu else PlainMLP(h)
    return Block(
        nn.RMSNorm(h, elementwise_affine=False),
        Attention(h, heads, heads, bias=False, kind="eager"),
        nn.RMSNorm(h, elementwise_affine=False),
        mlp,
    )


def numel(module):
    return sum(p.numel() for p in module.parameters())


for h, heads in [(64, 4), (128, 8), (256, 8)]:
    for glu in (True, False):
        block = bias_free_block(h, heads, glu)
        assert numel(block) == block_params(h, glu) == (16 if glu else 12) * h * h
        print(
            f"h = {h:>3}, {'GLU  ' if glu else 'plain'} MLP: {numel(block):>9,} parameters "
            f"= {numel(block) // (h * h)} h²"
        )

# %% [markdown]
# Where they sit, matrix by matrix, for `h = 64` (the names are the course model's modules):

# %%
h = 64
for glu in (True, False):
    block = bias_free_block(h, 4, glu)
    built = {name: p.numel() for name, p in block.named_parameters()}
    print(f"{'GLU' if glu else 'plain'}: " + ", ".join(f"{name} {n // (h * h)}h²" for name, n in built.items()))
    grouped = {
        "attention q, k, v": sum(built[f"attn.{x}.weight"] for x in "qkv"),
        "attention out": built["attn.out.weight"],
        **(
            {"mlp gate + up": built["mlp.gate.weight"] + built["mlp.up.weight"]}
            if glu
            else {"mlp up": built["mlp.up.weight"]}
        ),
        "mlp down": built["mlp.down.weight"],
    }
    assert grouped == block_matrices(h, glu)

# %% [markdown]
# Real blocks differ a little from this round number, in both directions:
#
# - the course's GPT-2-style block has biases and two LayerNorms: $12h^2 + 13h$;
# - Llama 3 uses **grouped-query attention** (8 key/value heads shared by all query heads, so
#   `k` and `v` are much narrower than `h × h`) and a SwiGLU narrower than `4h` (14336 = 3.5h in
#   the 8B model). Its blocks are *smaller* than $16h^2$: $13h^2$ for 8B.

# %%
gpt_small = GPTConfig(vocab_size=256, hidden=64, layers=1, heads=4)
assert numel(GPT(gpt_small).blocks[0]) == 12 * 64**2 + 13 * 64
for name, config in PRESETS.items():
    h = config.hidden
    exact = (matmul_params(config) - config.vocab_size * h) // config.layers
    kv = config.kv_heads * config.head_dim
    assert exact == 2 * h * h + 2 * h * kv + 3 * h * config.ffn
    print(
        f"{name:>12}: h = {h:>5}, ffn = {config.ffn:>5} = {config.ffn / h:.3g} h, {config.kv_heads} KV heads: "
        f"block = {exact / h**2:.4g} h² (A2's estimate: 16 h²)"
    )

# %% [markdown]
# ## 3. Embeddings, the head, and the whole model
#
# Around the blocks sit the **input embedding**, a `vocab × h` table, and the **LM head** that
# turns the final hidden state into `vocab` scores. When the head reuses the embedding matrix
# (*tied* weights, as in GPT-2) it adds nothing; otherwise it is another `vocab × h`. Learned
# **positional embeddings** add `max_seq_len × h`; RoPE, used by both course models, adds
# nothing. So the estimate of a whole model is
#
# $$N \approx 16h^2 \cdot L + v\,h\ (+\,v\,h \text{ untied})\ (+\,\text{max\_seq\_len}\cdot h).$$
#
# For the course GPT the estimate (with its non-gated $12h^2$ block) misses exactly the biases and
# norms, $13h$ per layer and $2h$ at the end: the book's formula $hv + L(12h^2 + 13h) + 2h$.

# %%
for h, v, layers in [(64, 256, 2), (768, 50257, 12), (12288, 50257, 96)]:
    config = GPTConfig(vocab_size=v, hidden=h, layers=layers, heads=4)
    estimate = model_params(h, layers, v, glu=False, tied=True)
    assert count_params(config) - estimate == 13 * h * layers + 2 * h
    print(
        f"GPT h={h:>5}, L={layers:>2}: estimate {estimate:>15,}, exact {count_params(config):>15,} "
        f"(+{count_params(config) - estimate:,} of biases and norms)"
    )
assert count_params(gpt_small) == numel(GPT(gpt_small))
assert embedding_params(50257, 768, tied=False, max_seq_len=1024) == 2 * 50257 * 768 + 1024 * 768  # GPT-2 style, untied

# %% [markdown]
# ## 4. Gradients and optimizer states
#
# Every trainable weight has a gradient of the same shape, so a weight matrix of $h^2$ elements
# comes with $h^2$ gradient elements. The optimizer keeps more. Adam stores two running
# statistics per weight, the **momentum** (first moment) and the **variance** (second moment),
# in fp32; with mixed precision it also keeps an fp32 **master copy** of the weights, which it
# updates and then rounds to the bf16 weights the model computes with. Per $h \times h$ matrix:
#
# | state | elements | format | bytes |
# |---|---|---|---|
# | momentum | $h^2$ | fp32 | $4h^2$ |
# | variance | $h^2$ | fp32 | $4h^2$ |
# | master weights | $h^2$ | fp32 | $4h^2$ |
# | **total** | $3h^2$ | | $12h^2$ |
#
# **About the book's wording.** The appendix lists momentum and variance ($2h^2$ fp32) plus master
# weights ($h^2$ fp32) and then gives the total as $6h^2$. The parts it lists add up to $3h^2$
# fp32 elements, that is $12h^2$ bytes. The $6$ matches neither unit; it equals $12h^2$ bytes counted
# in 2-byte (bf16-sized) slots, which may be how it arose, but it is not the element count. We
# use $3h^2$ elements and $12h^2$ bytes, which is also what the memory model of chapter 01 uses
# (12 optimizer bytes per parameter in mixed precision).

# %%
h = 4096
states = optimizer_state_elements(weight_elements(h))
print(", ".join(f"{k}: {v // h**2} h²" for k, v in states.items()))
total = sum(states.values())
assert total == 3 * h * h and BYTES_PER_ELEMENT["fp32"] * total == 12 * h * h
assert BYTES_PER_ELEMENT["fp32"] * sum(optimizer_state_elements(1).values()) == model_state_bytes(1)["optimizer states"]
print(
    f"total: {total // h**2} h² fp32 elements = {BYTES_PER_ELEMENT['fp32'] * total // h**2} h² bytes "
    f"(the book prints {BOOK_OPTIMIZER_TOTAL_AS_PRINTED} h²)"
)

# %% [markdown]
# ## 5. FLOPs: 2TN forward, 4TN backward, measured
#
# A weight multiplies each token's input once in a forward pass: one multiply and one add, 2 FLOPs
# per parameter per token. For `T` tokens and `N` parameters the forward costs $2TN$. The backward
# computes two products for every weight matrix, the gradient with respect to its input (to pass
# on) and with respect to the weight itself, each as large as the forward one: $4TN$. Together,
# the famous $6N$ FLOPs per token of training.
#
# PyTorch can count for us: `FlopCounterMode` intercepts every operator that runs inside it and
# adds up the FLOPs of the matrix products (element-wise work such as norms, activations and the
# softmax is not counted: it is cheap next to the matmuls). We count the forward and the backward
# separately, on the tiny GPT and a tiny Llama with eager attention.


# %%
def measured_flops(model, idx):
    """Matmul FLOPs of one forward (with the loss) and of its backward, counted by PyTorch."""
    with FlopCounterMode(display=False) as forward:
        loss = model.loss(idx, idx)
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


BATCH = 2
MODELS = {
    "tiny GPT": GPTConfig(vocab_size=256, hidden=64, layers=2, heads=4, seq_len=64),
    "tiny Llama": LlamaConfig(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, seq_len=64),
}
measured = {}
for name, config in MODELS.items():
    torch.manual_seed(SEED)
    model = GPT(config) if isinstance(config, GPTConfig) else Llama(config)
    idx = torch.randint(0, config.vocab_size, (BATCH, config.seq_len))
    measured[name] = measured_flops(model, idx)

print(f"{'model':>10} {'T':>4} {'forward':>11} {'2·T·N_mm':>11} {'difference':>11} {'backward':>11} {'4·T·N_mm':>11}")
for name, config in MODELS.items():
    T = BATCH * config.seq_len
    fwd, bwd = measured[name]
    n_mm = matmul_params(config)
    print(
        f"{name:>10} {T:>4} {fwd:>11,} {forward_flops(T, n_mm):>11,} {fwd - forward_flops(T, n_mm):>11,} "
        f"{bwd:>11,} {backward_flops(T, n_mm):>11,}"
    )
    assert bwd == 2 * fwd  # the backward is exactly twice the forward, attention included

# %% [markdown]
# `N_mm` is the parameters that take part in a matrix product (`model.matmul_params`: all weight
# matrices and the head, but not the norms, the biases, or an untied input embedding, which is a
# table lookup). The measured forward is $2TN_{mm}$ plus a **difference**, and that difference is
# attention: the two products $QK^\top$ and $(\text{scores})\,V$ do not involve any weight. Per layer
# and token, the query meets `seq` keys across `h` features and the scores weight `seq` values:
# $2 \cdot seq \cdot h$ FLOPs each, $4 \cdot seq \cdot h$ together. It grows with the sequence, not
# with the parameters. `model.attention_flops_per_token` has it for forward plus backward ($12\,L\,h\,seq$;
# a third of that in forward).

# %%
for name, config in MODELS.items():
    T = BATCH * config.seq_len
    fwd, bwd = measured[name]
    attention_forward = T * attention_flops_per_token(config, config.seq_len) // 3
    assert attention_forward == T * 4 * config.layers * config.hidden * config.seq_len
    assert fwd == forward_flops(T, matmul_params(config)) + attention_forward
    assert bwd == backward_flops(T, matmul_params(config)) + 2 * attention_forward
    assert fwd + bwd == training_flops(config, T, config.seq_len) - 6 * T * (
        count_params(config) - matmul_params(config)
    )
    print(
        f"{name}: forward = 2·T·N_mm + attention ({attention_forward:,}), backward = twice that; "
        f"6·T·count_params over-counts by {6 * T * (count_params(config) - matmul_params(config)):,} "
        "(norms, biases, the lookup table)"
    )

# %% [markdown]
# How much does attention add at real sizes? Per token it is $12\,L\,h\,seq$ against $6N$, so its share
# grows with the context length. For Llama 3 8B at its 8K training context it adds about a quarter;
# at 128K it costs more than the weights themselves (a causal kernel that skips the masked half,
# as FlashAttention does, halves these numbers).

# %%
SEQS = [2**k for k in range(10, 18)] if not QUICK else [1024, 4096, 8192, 32768, 131072]
fig = Figure(figsize=(7, 3.2), layout="constrained")
ax = fig.subplots()
for name, config in PRESETS.items():
    share = [attention_flops_per_token(config, s) / (6 * count_params(config)) for s in SEQS]
    ax.plot(SEQS, share, "o-", label=name)
ax.axhline(1, color="black", lw=0.8, ls=":")
ax.set(
    xscale="log",
    yscale="log",
    xlabel="sequence length",
    ylabel="attention FLOPs / 6N",
    title="attention's share of the training FLOPs per token",
)
ax.set_xticks(SEQS, [f"{s // 1024}K" for s in SEQS])
ax.legend(fontsize=8)
share_8k = attention_flops_per_token(LLAMA3_8B, 8192) / (6 * count_params(LLAMA3_8B))
share_128k = attention_flops_per_token(LLAMA3_8B, 131072) / (6 * count_params(LLAMA3_8B))
assert 0.15 < share_8k < 0.3 and share_128k > 1
print(f"Llama 3 8B: attention adds {share_8k:.0%} to 6N at 8K tokens, {share_128k:.1f}x 6N at 128K")
fig

# %% [markdown]
# ## 6. The scales of Llama 3
#
# All of it together for the three Llama 3 presets, one sequence of 8192 tokens per micro-batch
# (their pretraining context). Elements first, then bytes: bf16 for the hidden state, the weights
# and the gradients, fp32 for the three optimizer states. `A2` columns use the $16h^2$ block; the
# others are the exact counts of the course's Llama model with the published shapes.

# %%
SEQ, MBS = 8192, 1
rows = {name: scale_row(config, seq=SEQ, mbs=MBS) for name, config in PRESETS.items()}
print(
    f"{'':>12} {'h':>6} {'L':>4} {'hidden state':>14} {'block (A2)':>14} {'block':>14} "
    f"{'params (A2)':>17} {'params':>17}"
)
for name, config in PRESETS.items():
    r = rows[name]
    print(
        f"{name:>12} {config.hidden:>6} {config.layers:>4} {r['hidden state']:>14,} {r['block (A2)']:>14,} "
        f"{r['block (exact)']:>14,} {r['parameters (A2)']:>17,} {r['parameters']:>17,}"
    )
print()
print(
    f"{'':>12} {'hidden state':>13} {'weights':>10} {'gradients':>10} {'optimizer':>10} {'fwd FLOPs':>11} "
    f"{'bwd FLOPs':>11}   (bytes in GB = 1e9; FLOPs per micro-batch)"
)
for name in PRESETS:
    r, b = rows[name], rows[name]["bytes"]
    print(
        f"{name:>12} {b['hidden state'] / GB:>10.3f} GB {b['parameters'] / GB:>7.0f} GB {b['gradients'] / GB:>7.0f} GB "
        f"{b['optimizer states'] / GB:>7.0f} GB {r['forward FLOPs']:>11.2e} {r['backward FLOPs']:>11.2e}"
    )

r8 = rows["Llama 3 8B"]
assert r8["parameters"] == count_params(LLAMA3_8B) == 8_030_261_248
assert r8["bytes"]["optimizer states"] == 12 * r8["parameters"] and r8["gradients"] == r8["parameters"]
assert r8["hidden state"] == 8192 * 4096 and r8["block (exact)"] == 13 * 4096**2
assert all(r["parameters (A2)"] > r["parameters"] for r in rows.values())  # 16h² overestimates Llama 3's blocks

# %% [markdown]
# Reading the table:
#
# - **weights are not the problem, their companions are**: for every 2 bytes of bf16 weights,
#   training keeps 2 bytes of gradients and 12 bytes of optimizer state. Llama 3 8B needs about
#   130 GB of model state before a single activation is stored, more than one 80 GB GPU (the
#   reason for ZeRO, chapter 03);
# - a **hidden state** is small (67 MB for the 8B model at 8K tokens), but activation memory keeps
#   dozens of such tensors per layer, for every layer (chapter 01);
# - A2's $16h^2$ estimate overshoots Llama 3 by 20% (8B) to 34% (405B): their MLPs are narrower
#   than $4h$ and their key/value projections are shared. Estimates are for orientation; plans
#   that must fit in memory use the exact counts (`model.count_params`).

# %%
fig = Figure(figsize=(8, 3.4), layout="constrained")
ax = fig.subplots()
kinds = ["parameters", "gradients", "optimizer states"]
colours = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer states": "#55A868"}
bottom = [0.0] * len(rows)
for kind in kinds:
    heights = [rows[name]["bytes"][kind] / GB for name in rows]
    ax.bar(
        list(rows),
        heights,
        bottom=bottom,
        color=colours[kind],
        label=f"{kind} ({'fp32' if kind == 'optimizer states' else 'bf16'})",
    )
    bottom = [b + x for b, x in zip(bottom, heights)]
ax.axhline(80, color="black", ls="--", lw=1)
ax.text(-0.4, 80, "80 GB (one H100)", va="bottom", fontsize=8)
ax.set(yscale="log", ylabel="GB", title="model state of Llama 3 in mixed-precision training (no parallelism)")
ax.legend(fontsize=8, loc="upper left")
fig

# %% [markdown]
# ## Summary
#
# | quantity | elements |
# |---|---|
# | tokens per micro-batch | `seq · mbs` |
# | hidden state per layer | `seq · mbs · h` |
# | weight matrix, and its gradient | $\approx h^2$ |
# | optimizer (Adam + fp32 master) per weight matrix | $3h^2$ fp32 ($12h^2$ bytes; printed as $6h^2$ in the book) |
# | one bias-free block | $16h^2$ with GLU, $12h^2$ without |
# | embeddings, head, positions | `v·h`, `v·h` if untied, `max_seq_len·h` if learned |
# | FLOPs | forward $2TN$, backward $4TN$, plus attention $12\,L\,h\,seq$ per token |
#
# Appendix A3 divides these counts by hardware speeds to decide when communication can hide behind
# computation.
#
# ## Your turn
# Open [exercises/a2_typical_scales_exercises.ipynb](../exercises/a2_typical_scales_exercises.ipynb): write the scale counts of a model yourself, and
# predict the FLOPs of a forward pass to the last FLOP, checked against PyTorch's counter, and count
# Llama 3's parameters exactly, to the 8,030,261,248 of the 8B model.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/a2_typical_scales_exercises.ipynb` grades
# the whole notebook from a terminal.
