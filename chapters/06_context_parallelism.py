# %% [markdown]
# # 06 · Context parallelism: ring attention and the zig-zag layout
#
# Tensor and sequence parallelism (chapters 04 and 05) split each layer over a handful of ranks,
# but a very long sequence still has to pass whole through some part of every layer. At 128k
# tokens and beyond, the activations grow with the sequence however cleverly they are
# recomputed: even full recomputation keeps each layer's input, $2\,s\,b\,h$ bytes, and that is
# linear in $s$.
#
# **Context parallelism** (CP) cuts the sequence itself across `cp` ranks, through the *whole*
# model. Embeddings, norms, MLPs and the loss act on each token separately, so each rank runs
# them on its own slice and needs nothing from the others. Only attention mixes tokens: a query
# must see the keys and values (K/V) of every earlier token, wherever they live. Ring attention
# supplies them: the K/V blocks travel round a ring of ranks, one hop per step, while each rank
# attends its queries to the block it holds, and the partial results are merged with the same
# log-sum-exp rule as FlashAttention's online softmax (chapter 11). The gradients of the
# weights, computed on different tokens, are averaged over the CP group at the end, as in data
# parallelism.
#
# In this notebook you will
# 1. merge two partial attention results with their log-sum-exp, including rows that see nothing;
# 2. check that ring attention equals full attention, forward and backward, in float64;
# 3. watch a ring of `WORLD_SIZE` ranks and `WORLD_SIZE` tokens pass its K/V round, from the logged run;
# 4. count the work each rank does under a causal mask, see the contiguous layout's imbalance
#    and the zig-zag layout that removes it;
# 5. look at the compute and point-to-point transfers of every step on a Gantt chart;
# 6. measure the K/V buffers of the ring and of the all-gather variant against the memory model,
#    and the activation memory per rank as the sequence grows;
# 7. train the course GPT under `apply_cp` to the same numbers as one process;
# 8. see the errors for inputs that cannot be split, and where PyTorch's own version stands.
# 9. beyond the book: Ulysses, the all-to-all alternative, its bytes, its limit and a race with the ring.
#
# The implementation is `lib/ultrascale/parallel/ring_attention.py` (the attention, forward and
# backward) and `lib/ultrascale/parallel/context_parallel.py` (layouts, tile counts, `apply_cp`).

# %% tags=["parameters"]
WORLD_SIZE = 4  # ranks, all in one context-parallel group (cp is WORLD_SIZE; 2, 3 and 4 all work)
QUICK = True  # True: short sequences, SGD only, about 15 s on 2 CPU cores; False: longer sequences, more steps, also Adam and the contiguous layout (longer)
SEED = 0

# %%
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import contextlib
import math
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch

from ultrascale.comm import CommLogger, format_bytes, wait_for_device
from ultrascale.data import Batches, split
from ultrascale.kernels.tiled_attention import merge_partial_attention, naive_attention
from ultrascale.memory import GB, activation_bytes, cp_kv_buffer_bytes, saved_activation_bytes
from ultrascale.model import GPT, LLAMA3_8B, GPTConfig
from ultrascale.parallel import Timeline, init_mesh
from ultrascale.parallel.context_parallel import (
    KVBufferMeter,
    apply_cp,
    causal_tile_counts,
    context_parallel_attention,
    split_sequence,
)
from ultrascale.parallel.timeline import overlap_seconds
from ultrascale.parallel.ulysses import ring_bytes, ulysses_attention, ulysses_bytes
from ultrascale.parity import assert_same, first_step, perturbed, tolerance
from ultrascale.refusal import refusal
from ultrascale.train import gradients, train
from ultrascale.viz.diagrams import cp_ring_figure
from ultrascale.viz.gantt import plot_gantt
from ultrascale.viz.live import ProgressBar

torch.manual_seed(SEED)
plt.switch_backend(plt.get_backend())  # figures are Figure objects that a cell shows by returning them

# %% [markdown]
# ## 1. The sizes
#
# All the ranks form one CP group, so `cp = WORLD_SIZE`. The zig-zag layout (section 5) cuts a
# sequence into $2 \cdot cp$ equal chunks, so every length below is a multiple of $2 \cdot cp$,
# computed from `WORLD_SIZE`: the notebook works for 2, 3, 4 or more ranks.

# %%
CP = WORLD_SIZE
CHUNK = 4 if QUICK else 8  # tokens per zig-zag chunk
S = 2 * CP * CHUNK  # the sequence length of the attention checks and of the model
DT = torch.float64  # parity checks in float64 (the reason is in section 3)
print(f"cp = {CP} ranks; sequence of {S} tokens = {2 * CP} chunks of {CHUNK}; {S // CP} tokens per rank")

cluster = Cluster(WORLD_SIZE)
print(cluster)

# %% [markdown]
# The whole idea in one picture, for `cp = WORLD_SIZE` and the contiguous layout: each rank holds
# one chunk of the sequence, for the whole model. In attention it keeps its queries, and the K/V
# chunks go round the ring, one rank along per step, until every rank has seen every chunk (under
# a causal mask some of those blocks are skipped, which section 5 balances). Sections 2 to 4 build
# this up: the rule that merges the partial results, the ring against full attention, the steps of
# a real run.

# %%
cp_ring_figure(CP)


# %% [markdown]
# ## 2. One merge rule: attention over two blocks of keys
#
# Suppose the keys of a query row are split in two blocks, A and B, and we have attended to each
# one *alone*: normalised outputs $o_A$, $o_B$ and the log-sum-exp of each block's scores,
# $\ell_A = \log \sum_{j \in A} e^{s_j}$ (and $\ell_B$). The softmax over all keys has the
# denominator $e^{\ell_A} + e^{\ell_B}$, so
#
# $$\ell = \log\left(e^{\ell_A} + e^{\ell_B}\right), \qquad
#   o = e^{\ell_A - \ell}\, o_A + e^{\ell_B - \ell}\, o_B .$$
#
# Each block's output is weighted by its share of the total mass; working with $\ell$ rather than
# $e^{\ell}$ keeps every exponent at or below 0, so nothing overflows. Under a causal mask a row
# may see *no* key of a block: its $\ell$ there is $-\infty$ and its weight 0. This is
# `merge_partial_attention`, the function chapter 11's tiled attention uses for every key tile;
# ring attention uses it for every block that arrives from another rank.
#
# A row may also see no key of *either* block, when both lie in its future (two key blocks merged
# before the one that holds the row's own token, or a running result that starts empty). Then
# $\ell = -\infty$ as well, and the formula's weight $e^{\ell_A - \ell}$ is $e^{-\infty + \infty}$:
# NaN. The merge must give such a row output 0 and $\ell = -\infty$, ready to be merged with a
# block it does see; `merge_partial_attention` computes the weights against a finite stand-in for
# $\ell$ on those rows.
#
# Six tokens, keys 0-2 in block A and keys 3-5 in block B, causal: queries 0-2 see nothing in B.


# %%
def block_attention(q, k, v, q_pos, k_pos):
    """Causal attention of ``q`` to one block of keys alone: normalised output and each row's
    log-sum-exp; a row that sees no key of the block gets output 0 and lse -inf."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ v, lse


g = torch.Generator().manual_seed(SEED)
q6, k6, v6 = (torch.randn(1, 1, 6, 4, generator=g, dtype=DT) for _ in range(3))
pos = torch.arange(6)
A, B = slice(0, 3), slice(3, 6)
out_a, lse_a = block_attention(q6, k6[..., A, :], v6[..., A, :], pos, pos[A])
out_b, lse_b = block_attention(q6, k6[..., B, :], v6[..., B, :], pos, pos[B])
merged, lse = merge_partial_attention(out_a, lse_a, out_b, lse_b)

full = F.scaled_dot_product_attention(q6, k6, v6, is_causal=True)
assert_same(merged, full, "merged blocks vs causal SDPA", optimizer=None)
weight_a, weight_b = torch.exp(lse_a - lse)[0, 0], torch.exp(lse_b - lse)[0, 0]
assert torch.equal(weight_b[:3], torch.zeros(3)) and torch.allclose(weight_a + weight_b, torch.ones(6, dtype=DT))
print("query  weight of block A  weight of block B")
for i in range(6):
    print(f"{i:>5}  {weight_a[i].item():>17.3f}  {weight_b[i].item():>17.3f}")
print("merged result = causal attention over all six keys (float64 SDPA)")

# %% [markdown]
# The weights of each row add up to 1, and the rows that cannot see block B take everything from
# A. The same merge with chapter 11's `naive_attention` for the blocks (no mask, float32), and a
# check that merging in the other order gives the same result:

# %%
out_a32, lse_a32 = naive_attention(q6.float(), k6[..., A, :].float(), v6[..., A, :].float())
out_b32, lse_b32 = naive_attention(q6.float(), k6[..., B, :].float(), v6[..., B, :].float())
ab = merge_partial_attention(out_a32, lse_a32, out_b32, lse_b32)
ba = merge_partial_attention(out_b32, lse_b32, out_a32, lse_a32)
whole, whole_lse = naive_attention(q6.float(), k6.float(), v6.float())
assert_same(ab[0], whole, "A then B vs all keys at once", optimizer=None)
assert_same(ab[1], whole_lse, "lse of the merge", optimizer=None)
assert_same(ba[0], ab[0], "B then A", optimizer=None)
print("non-causal: merge(A, B) = merge(B, A) = attention over all keys (chapter 11's naive_attention, float32)")

# %% [markdown]
# Now the rows that see nothing. Cut block B once more, into B1 (keys 3-4) and B2 (key 5), and
# merge those two first: queries 0-2 see neither.

# %%
B1, B2 = slice(3, 5), slice(5, 6)
out_b1, lse_b1 = block_attention(q6, k6[..., B1, :], v6[..., B1, :], pos, pos[B1])
out_b2, lse_b2 = block_attention(q6, k6[..., B2, :], v6[..., B2, :], pos, pos[B2])
blind = slice(0, 3)  # the queries that see no key of B1 or B2
naive_weight = torch.exp(lse_b1 - torch.logaddexp(lse_b1, lse_b2))  # the formula as written
out_bb, lse_bb = merge_partial_attention(out_b1, lse_b1, out_b2, lse_b2)
assert torch.isnan(naive_weight[..., blind]).all(), "the formula alone gives NaN on the blind rows"
assert torch.isneginf(lse_bb[..., blind]).all() and not out_bb.isnan().any()
assert torch.equal(out_bb[..., blind, :], torch.zeros_like(out_bb[..., blind, :])), "blind rows: output 0"
assert_same(out_bb, out_b, "merge(B1, B2) vs B in one piece", optimizer=None)
merged_3, _ = merge_partial_attention(out_a, lse_a, out_bb, lse_bb)
assert_same(merged_3, full, "merge(A, merge(B1, B2)) vs causal SDPA", optimizer=None)
print("query  weight of B1 by the formula  merged lse  largest |merged output|")
for i in range(6):
    print(
        f"{i:>5}  {naive_weight[0, 0, i].item():>27.3f}  {lse_bb[0, 0, i].item():>10.3f}  "
        f"{out_bb[0, 0, i].abs().max().item():>22.3f}"
    )
print(
    "rows 0-2 see no key of B1 or B2: the formula gives NaN, the merge gives output 0 and lse -inf;\n"
    "merging that with A gives causal attention over all six keys"
)


# %% [markdown]
# ## 3. Ring attention is attention: forward and backward
#
# `context_parallel_attention(q, k, v, group, causal=..., layout=..., kind=...)` takes this rank's
# queries, keys and values, `(batch, heads, tokens of this rank, head_dim)`, and returns its rows
# of the attention over the *whole* sequence. With `kind="ring"` the K/V blocks go round the
# ring point to point; with `kind="all_gather"` every rank first gathers all of them (the variant
# Llama 3 used), then attends to the same blocks in the same order.
#
# Its backward is a real ring too (as in ring-flash-attention), not autograd through a gathered
# copy: the K/V go round again, each rank rebuilds a block's softmax from the saved log-sum-exp and
# adds its share of that block's dK and dV to a running sum that goes round the ring, rank to rank,
# starting at the rank after the block's owner; the owner adds its share last, and the sum is complete.
#
# We run the ring with both layouts, causal and not, and the all-gather variant in two of those
# cases, on every rank; put the slices back in sequence order; and compare the output and the gradients of q, k and v with PyTorch's
# `scaled_dot_product_attention` on the whole sequence. In **float64**: the ring normalises each
# block alone and merges, where SDPA normalises each row at once, and dK/dV are summed over the
# ranks in another order. That changes the last bits only (about $10^{-16}$), so the float64
# tolerance of `parity.TOLERANCES` (1e-10 relative) can only be met by the right mathematics. A
# skipped block, a wrong mask or a missing rescale would be off by far more.

# %%
SHAPE = (2, 4, S, 8)  # batch, heads, whole sequence, head_dim
CASES = [(causal, layout, "ring") for causal in (False, True) for layout in ("contiguous", "zigzag")]
CASES += [(False, "contiguous", "all_gather"), (True, "zigzag", "all_gather")]


def whole_problem(shape=SHAPE, dtype=DT):
    """q, k, v and the upstream gradient of the whole sequence: the same in every process."""
    g = torch.Generator().manual_seed(SEED)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(4)]


def mine(ctx, t, layout):
    """This rank's tokens of ``t`` (sequence in dim 2) in ``layout`` on its device, and their global positions."""
    return split_sequence(t.to(ctx.device), ctx.rank, ctx.world_size, layout, dim=2)


def attention_on_rank(ctx):
    q, k, v, upstream = whole_problem()
    results = {}
    for causal, layout, kind in CASES:
        local = [mine(ctx, t, layout)[0].requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, causal=causal, layout=layout, kind=kind)
        out.backward(mine(ctx, upstream, layout)[0])
        results[causal, layout, kind] = (mine(ctx, q, layout)[1], out.detach(), *(t.grad for t in local))
    return results


def reassemble(per_rank, case, i):
    """Item ``i`` of every rank's result for ``case``, put back at the tokens' global positions."""
    whole = torch.empty(SHAPE, dtype=DT)
    for result in per_rank:
        positions = result[case][0]
        whole[:, :, positions] = result[case][i]
    return whole


def sdpa_reference(causal):
    q, k, v, upstream = whole_problem()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(upstream)
    return out.detach(), q.grad, k.grad, v.grad


per_rank = cluster.run(attention_on_rank)
print(f"cp = {CP}, q/k/v {SHAPE} in float64, each rank holding {S // CP} tokens\n")
print(f"{'mask':<8}{'layout':<12}{'kind':<12}output, dQ, dK, dV against SDPA")
for causal, layout, kind in CASES:
    want = sdpa_reference(causal)
    for i, name in enumerate(("output", "dQ", "dK", "dV"), start=1):
        assert_same(
            reassemble(per_rank, (causal, layout, kind), i),
            want[i - 1],
            f"{layout} {kind} causal={causal}: {name}",
            optimizer=None,
        )
    print(f"{'causal' if causal else 'none':<8}{layout:<12}{kind:<12}equal (rtol {tolerance(None, DT)['rtol']:.0e})")
for result in per_rank:  # the same blocks merged in the same order: the very same bits
    for causal, layout, kind in CASES:
        if kind == "all_gather":
            assert torch.equal(result[causal, layout, "ring"][1], result[causal, layout, "all_gather"][1])
print("ring and all-gather outputs: bit-identical on every rank")


# %% [markdown]
# ## 4. The ring, step by step
#
# The book pictures the ring with 4 GPUs and a 4-token input, one token per GPU. We run exactly
# that at `WORLD_SIZE` ranks: `WORLD_SIZE` tokens, contiguous layout, causal mask, with a
# `Timeline` recording each step's compute ("attend to K/V of rank r") and each transfer, and a
# `CommLogger` recording every point-to-point call. At every step a rank
#
# 1. starts sending the K/V block it holds to the next rank and receiving the previous rank's,
#    without waiting (at the last step there is nothing left to send);
# 2. attends its queries to the block it holds and merges the result;
# 3. waits for the incoming block, and goes round again.
#
# Everything below is read from the events of the run.


# %%
def tiny_ring(ctx):
    g = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, 1, ctx.world_size, 2, generator=g, dtype=DT) for _ in range(3))  # one token per rank
    local = [mine(ctx, t, "contiguous")[0] for t in (q, k, v)]
    timeline = Timeline(ctx.rank)
    with CommLogger() as log:
        out = context_parallel_attention(*local, layout="contiguous", timeline=timeline)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, ctx.rank : ctx.rank + 1]
    return timeline.rows(), log.rows(), out, want


ring_runs = cluster.run(tiny_ring)
holds = []  # holds[r][step]: whose K/V rank r attends to at that step
for rank, (rows, log_rows, out, want) in enumerate(ring_runs):
    assert_same(out, want, f"rank {rank}: its token's attention", optimizer=None)
    attends = [e for e in rows if e["name"].startswith("attend to")]
    receives = [e for e in rows if e["name"] == "receive K/V"]
    sends = [e for e in log_rows if e["op"] == "batch_isend_irecv"]
    holds.append([int(e["name"].rsplit(" ", 1)[1]) for e in attends])
    assert holds[rank] == [(rank - step) % CP for step in range(CP)], "at step s, rank r holds block r - s"
    assert len(receives) == len(sends) == CP - 1, "a transfer at every step but the last"
    assert all(e["bytes_sent"] == e["bytes_received"] == 2 * 2 * 8 for e in sends), "one K and one V of 2 float64"
    # Program order, not timing: each transfer is posted before the attention of the same step starts.
    assert all(rx["start"] <= at["start"] for rx, at in zip(receives, attends))

print(f"{'step':<6}" + "".join(f"{'rank ' + str(r) + ' (token ' + str(r) + ')':<22}" for r in range(CP)))
for step in range(CP):
    cells = [f"K/V {holds[r][step]} " + ("attend" if holds[r][step] <= r else "skip: future") for r in range(CP)]
    print(f"{step:<6}" + "".join(f"{c:<22}" for c in cells))
print(
    f"\n{CP - 1} point-to-point exchanges per rank (batch_isend_irecv of K and V, 32 bytes each way); "
    "each rank's output = its row of causal attention"
)


# %%
def ring_figure(holds):
    n = len(holds)
    colours = plt.get_cmap("tab10")
    fig = Figure(figsize=(1.9 * n + 1, 0.9 * n + 1.2), layout="constrained")
    ax = fig.subplots()
    for r in range(n):
        for step in range(n):
            src = holds[r][step]
            visible = src <= r
            ax.add_patch(
                plt.Rectangle(
                    (step - 0.4, r - 0.35),
                    0.8,
                    0.7,
                    color=colours(src),
                    alpha=0.85 if visible else 0.25,
                    hatch=None if visible else "//",
                )
            )
            ax.text(step, r, f"K/V {src}\n{'attend' if visible else 'masked'}", ha="center", va="center", fontsize=8)
            if step < n - 1:  # during this step the block travels to the next rank (the last rank's to rank 0)
                ax.add_patch(
                    FancyArrowPatch(
                        (step + 0.4, r),
                        (step + 0.6, r + 1 if r < n - 1 else r + 0.45),
                        arrowstyle="->",
                        mutation_scale=8,
                        color="0.4",
                    )
                )
                if r == n - 1:
                    ax.text(step + 0.62, r + 0.45, "to rank 0", fontsize=7, va="center")
    ax.set(xlim=(-0.6, n - 0.4), ylim=(n - 0.5, -0.5), xlabel="step", ylabel="rank (holds the query of token = rank)")
    ax.set_xticks(range(n)), ax.set_yticks(range(n))
    ax.set_title(
        f"ring attention, {n} ranks, {n} tokens, causal: the K/V each rank holds at each step "
        "(colour: its owner; arrows: sent on to the next rank)",
        fontsize=9,
    )
    return fig


ring_figure(holds)

# %% [markdown]
# Each rank's K/V visits every rank once, and after `cp` steps (`cp - 1` transfers) every query
# has met every key. Under the causal mask half of those meetings are wasted: rank 0's query is
# token 0, which may only look at itself, so it skips every block it receives, while the last
# rank attends to all of them. That is the imbalance of the next section.
#
# ## 5. Balancing the causal work: the zig-zag layout
#
# With the contiguous layout, rank $r$ holds the $r$-th slice of the sequence. Under a causal mask
# a query sees only earlier keys, so rank 0's queries have almost nothing to attend to and the
# last rank's see the whole sequence. Every layer then waits for the last rank.
#
# The zig-zag layout cuts the sequence into $2 \cdot cp$ chunks and gives rank $r$ chunks $r$ and
# $2 \cdot cp - 1 - r$: one early chunk, with few keys to see, and one late chunk, with many. The
# pairs add up to the same work on every rank. Below: the causal mask of $4 \cdot cp$ tokens, each
# row (a query) coloured by the rank that holds it, and the number of unmasked (query, key) pairs
# per rank (`causal_tile_counts` with tiles of one token).

# %%
SMALL = 4 * CP  # the book's figure has 16 tokens on 4 GPUs


def mask_figure():
    colours = plt.get_cmap("tab10")
    fig = Figure(figsize=(10, 4.6), layout="constrained")
    for ax, layout in zip(fig.subplots(1, 2), ("contiguous", "zigzag")):
        owner = torch.empty(SMALL, dtype=torch.long)
        for r in range(CP):
            owner[split_sequence(torch.arange(SMALL), r, CP, layout, dim=0)[1]] = r
        grid = np.ones((SMALL, SMALL, 3))
        for i in range(SMALL):
            grid[i, : i + 1] = colours(int(owner[i]))[:3]
        ax.imshow(grid, interpolation="nearest")
        counts = causal_tile_counts(SMALL, CP, layout, tile=1)
        ax.set_title(f"{layout}: unmasked (q, k) pairs per rank {counts}", fontsize=9)
        ax.set(xlabel="key", ylabel="query")
        ax.set_xticks(range(0, SMALL, 2)), ax.set_yticks(range(0, SMALL, 2))
    fig.suptitle(
        f"causal mask of {SMALL} tokens on {CP} ranks, rows coloured by the rank that holds the query", fontsize=10
    )
    return fig


mask_figure()

# %%
pairs = {layout: causal_tile_counts(SMALL, CP, layout, tile=1) for layout in ("contiguous", "zigzag")}
chunks = {layout: causal_tile_counts(S, CP, layout) for layout in ("contiguous", "zigzag")}
for name, counts, total in (
    ("(q, k) pairs", pairs, SMALL * (SMALL + 1) // 2),
    (f"tiles of {S // (2 * CP)} x {S // (2 * CP)}", chunks, 2 * CP * (2 * CP + 1) // 2),
):
    for layout, per_rank_counts in counts.items():
        ratio = max(per_rank_counts) / (sum(per_rank_counts) / CP)
        print(f"{name:<16} {layout:<11} per rank {str(per_rank_counts):<22} slowest / mean {ratio:.2f}")
        assert sum(per_rank_counts) == total, "every unmasked entry of the mask belongs to one rank"
    assert counts["contiguous"] == sorted(set(counts["contiguous"])), "contiguous: more work on every later rank"
    assert len(set(counts["zigzag"])) == 1, "zig-zag: the same work on every rank"
if CP == 4:
    assert pairs == {"contiguous": [10, 26, 42, 58], "zigzag": [34, 34, 34, 34]}  # the book's 16 tokens


def contiguous_imbalance(tiles_per_rank):
    """Slowest rank over the mean, contiguous layout, m causal tiles per rank: the last rank has
    (cp - 1) m^2 full tiles and m (m + 1) / 2 on its diagonal; the mean is cp m (cp m + 1) / 2 / cp."""
    m = tiles_per_rank
    return ((2 * CP - 1) * m + 1) / (CP * m + 1)


for counts, m in ((pairs, SMALL // CP), (chunks, 2)):
    assert math.isclose(max(counts["contiguous"]) / (sum(counts["contiguous"]) / CP), contiguous_imbalance(m))

# %% [markdown]
# Those are counts of the mask. What the ranks *compute* depends on how the attention skips
# masked work: ours skips a block that is entirely in a rank's future, and the rows and keys of a
# block that the mask hides entirely, but computes the rest of a partly masked block with the
# mask applied. We count the floating-point operations of every matrix product (`a @ b`) each
# rank runs, forward and backward: a count, not a timing, so the same on any machine. (PyTorch's
# `FlopCounterMode` counts the same and more, but its first use loads the compiler stack, seconds
# on every rank; for the products of ring attention a wrapper around `@` is enough.)


# %%
@contextlib.contextmanager
def counted_matmuls():
    """While open, every ``a @ b`` on this process adds its FLOPs (2 per multiply-add) to ``count[0]``."""
    count, original = [0], torch.Tensor.__matmul__

    def counting(a, b):
        batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        count[0] += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return original(a, b)

    torch.Tensor.__matmul__ = counting
    try:
        yield count
    finally:
        del torch.Tensor.__matmul__  # back to the method torch.Tensor inherits


def attention_flops(ctx, layout):
    q, k, v, upstream = whole_problem()
    local = [mine(ctx, t, layout)[0].requires_grad_() for t in (q, k, v)]
    with counted_matmuls() as forward:
        out = context_parallel_attention(*local, layout=layout)
    with counted_matmuls() as backward:
        out.backward(mine(ctx, upstream, layout)[0])
    return forward[0], backward[0]


flops = dict(
    zip(
        ("contiguous", "zigzag"),
        zip(*cluster.run(lambda ctx: [attention_flops(ctx, layout) for layout in ("contiguous", "zigzag")])),
    )
)
print(f"matmul FLOPs of causal ring attention per rank, q/k/v {SHAPE}:")
balance = {}
for layout, per_rank_flops in flops.items():
    totals = [f + b for f, b in per_rank_flops]
    balance[layout] = max(totals) / (sum(totals) / CP)
    print(
        f"  {layout:<11} forward {[f for f, _ in per_rank_flops]}, backward {[b for _, b in per_rank_flops]}; "
        f"slowest / mean {balance[layout]:.2f}"
    )
contiguous_forward = [f for f, _ in flops["contiguous"]]
assert contiguous_forward == [(r + 1) * contiguous_forward[0] for r in range(CP)], "rank r attends to r + 1 blocks"
assert len({f + b for f, b in flops["zigzag"]}) == 1, "zig-zag: the same FLOPs on every rank"
assert math.isclose(balance["contiguous"], 2 * CP / (CP + 1))

# %% [markdown]
# Contiguous: rank $r$ meets $r + 1$ blocks that are not entirely in its future, so its work grows
# as $1, 2, \dots, cp$ and the slowest rank does $2\,cp/(cp+1)$ times the mean (1.60 at cp = 4,
# heading for 2 as cp grows). That is the imbalance of the FLOPs our ring computes. The mask's own
# (q, k) pairs, counted before, are more lopsided (1.71 for 16 tokens on 4 ranks): the ring
# computes each rank's diagonal block whole, half of it masked, which adds the same work to every
# rank and evens the ratio a little. Both are one formula: with $m$ causal tiles per rank the
# slowest rank does $((2\,cp - 1)\,m + 1)/(cp\,m + 1)$ times the mean, $2\,cp/(cp+1)$ for one whole
# block per rank ($m = 1$) and towards $2 - 1/cp$ (1.75 at cp = 4) for single tokens (asserted for
# both counts above). Zig-zag: its own block in full, and exactly half of every other rank's block
# (the early chunk's keys, or the late chunk's queries), the same on every rank.
# (`benchmarks/bench_cp.py` times the two layouts on 4 ranks: zig-zag's slowest rank stays within
# a few percent of the mean.)
#
# ## 6. What overlaps: a Gantt chart of the steps
#
# The same ring on a longer sequence (float32, so that each step has some compute), forward and
# backward, with a `Timeline` on every rank. The compute lane shows each step's attention to one
# block (forward) and its gradient (backward); the communication lane shows each transfer from
# the moment it is posted to the moment the block (or, in backward, a block's running sum of
# dK/dV) has arrived.

# %%
BIG = (1, 4, 2 * CP * (64 if QUICK else 256), 32)


def ring_timeline(ctx, layout="zigzag"):
    q, k, v, upstream = whole_problem(BIG, torch.float32)
    local = [mine(ctx, t, layout)[0].requires_grad_() for t in (q, k, v)]
    context_parallel_attention(*local, layout=layout).backward(mine(ctx, upstream, layout)[0])  # warm-up
    timeline = Timeline(ctx.rank)
    out = context_parallel_attention(*local, layout=layout, timeline=timeline)
    out.backward(mine(ctx, upstream, layout)[0])
    rows = timeline.rows()
    for e in rows:  # forward / backward as the first word: the chart's colours and labels
        e["name"] = (
            e["name"]
            .replace("attend to K/V of rank", "forward K/V")
            .replace("backward for K/V of rank", "backward K/V")
        )
    return rows


timelines = cluster.run(ring_timeline)
for rank, rows in enumerate(timelines):
    names = [e["name"] for e in rows]
    forward = [n for n in names if n.startswith("forward")]
    assert forward == [f"forward K/V {(rank - s) % CP}" for s in range(CP)]
    assert names.count("receive K/V") == 2 * (CP - 1), "forward and backward each move K/V cp - 1 times"
    assert names.count("receive dK/dV") == CP - 1, "dK/dV's sums travel cp - 1 hops, ending at the owner"
    attends = [e for e in rows if e["name"].startswith("forward")]
    receives = [e for e in rows if e["name"] == "receive K/V"][: CP - 1]
    assert all(rx["start"] <= at["start"] for rx, at in zip(receives, attends)), "posted before computing"
print(
    f"every rank: {CP} forward steps; K/V transfers: {CP - 1} forward, {CP - 1} backward; dK/dV transfers: {CP - 1}; "
    "each transfer posted before the step's attention starts"
)

# %% tags=["nbval-ignore-output"]
hidden = sum(overlap_seconds(rows, rank=r) for r, rows in enumerate(timelines))
busy = sum(e["end"] - e["start"] for rows in timelines for e in rows if e["lane"] == "communication")
print(
    f"time with a transfer in flight while the same rank computed: {1e3 * hidden:.1f} ms "
    f"(of {1e3 * busy:.1f} ms of transfers, summed over ranks)"
)
plot_gantt(
    timelines, title=f"ring attention, cp = {CP}, zig-zag, q/k/v {BIG} float32: forward then backward", label_bars=True
)

# %% [markdown]
# In every step the transfer bar starts before the compute bar: the send and receive of the next
# block are posted first, and the attention runs while gloo moves the bytes on its own threads.
# Backward has two kinds of transfers in flight: the K/V again, and the running sum of dK/dV for
# the block just processed, on its way to the next rank.
#
# What this CPU shows honestly, and what it cannot: the rank's Python thread does not wait for
# the transfer, so the bars do overlap in time. But here the "network" is a memory copy through
# the loopback interface, done by gloo threads that share the same two cores as the attention
# of four ranks. Overlap on this machine means interleaving on the same cores, not a transfer
# that costs nothing; and at these sizes a transfer through gloo (milliseconds) outlasts a
# block's attention, so the chart is dominated by the communication lane and by waiting. On GPUs
# NCCL's kernels drive the transfer over NVLink or the network on a few SMs while the others
# compute (not quite free: those SMs do not multiply), and it is hidden when one block's attention
# takes longer than one block's transfer: the
# attention of a block grows with (tokens per rank)², its K/V only with tokens per rank, so long
# sequences hide the ring well. The price that stays is the latency of `cp - 1` separate steps.
#
# ## 7. Memory: K/V buffers, ring against all-gather
#
# The ring holds, besides its own K/V, the block it attends to and the one arriving: at most
# two blocks of K and V, whatever cp is. (The book counts one additional block, the one in
# flight; counting the one being attended to as well gives two: double buffering, so that the
# next block arrives while this one is used.) The all-gather variant holds every rank's K and V at
# once: $2 \cdot cp$ blocks, the whole sequence's K/V. In backward the ring adds three dK/dV pairs
# (the running sum it sends, the one arriving, the next one it fills), the all-gather variant dK/dV for every block before its
# reduce-scatter. `KVBufferMeter` measures the bytes of those buffers alive at once on a rank;
# `memory.cp_kv_buffer_bytes` is the model. We measure for every cp from 2 to `WORLD_SIZE`
# (sub-groups of the first cp ranks; the others sit out), in float32 (dK/dV accumulate in float32 too).

# %%
CPS = list(range(2, CP + 1))
S_MEM = 4 * math.lcm(*CPS)  # divisible by 2 * cp for every cp measured
MEM = (2, 4, S_MEM, 8)  # batch, K/V heads, sequence, head_dim


def kv_buffers(ctx):
    groups = {cp: ctx.new_group(range(cp)) for cp in CPS}  # every rank creates every group
    q, k, v, upstream = (t.to(ctx.device) for t in whole_problem(MEM, torch.float32))
    result = {}
    for cp, group in groups.items():
        if ctx.rank >= cp:
            continue
        pieces = [split_sequence(t, ctx.rank, cp, "zigzag", dim=2)[0] for t in (q, k, v, upstream)]
        for kind in ("ring", "all_gather"):
            local = [t.clone().requires_grad_() for t in pieces[:3]]
            with KVBufferMeter() as forward, CommLogger() as log:
                out = context_parallel_attention(*local, group=group, layout="zigzag", kind=kind)
            with KVBufferMeter() as backward:
                out.backward(pieces[3])
            moved = [e for e in log.events if e.op != "cp shape check"]
            result[cp, kind] = (
                forward.peak,
                backward.peak,
                len(moved),
                sum(e.bytes_sent for e in moved),
                sorted({e.op for e in moved}),
            )
    return result


buffers = cluster.run(kv_buffers)
b, kv_heads, _, d = MEM
block = b * kv_heads * (S_MEM // CP) * d * 4
print(f"K/V {MEM} float32, zig-zag; bytes of K/V (and dK/dV) buffers alive at once on rank 0, measured (= model)\n")
print(f"{'cp':<4}{'kind':<12}{'forward':>12}{'backward':>12}   forward communication")
for cp in CPS:
    for kind in ("ring", "all_gather"):
        fwd, bwd, calls, sent, ops = buffers[0][cp, kind]
        model = dict(batch=b, kv_heads=kv_heads, seq=S_MEM, head_dim=d, cp=cp, kind=kind, bytes_per_element=4)
        for rank in range(cp):
            assert buffers[rank][cp, kind][:2] == (
                cp_kv_buffer_bytes(**model),
                cp_kv_buffer_bytes(**model, backward=True),
            )
        one = b * kv_heads * (S_MEM // cp) * d * 4  # one rank's K (or V) at this cp
        assert sent == (cp - 1) * 2 * one, "both move (cp - 1) / cp of the whole K/V per rank"
        assert calls == (cp - 1 if kind == "ring" else 2), "cp - 1 ring steps, or one all-gather of K and one of V"
        print(
            f"{cp:<4}{kind:<12}{format_bytes(fwd):>12}{format_bytes(bwd):>12}   "
            f"{calls} x {'+'.join(ops)}, {format_bytes(sent)} sent"
        )
    ring_fwd, gather_fwd = buffers[0][cp, "ring"][0], buffers[0][cp, "all_gather"][0]
    one = b * kv_heads * (S_MEM // cp) * d * 4
    assert ring_fwd == 2 * min(2, cp - 1) * one and gather_fwd == 2 * cp * one

# %% [markdown]
# For a fixed sequence the ring's buffers shrink as cp grows (they are blocks of $s/cp$ tokens)
# while the all-gather's stay the size of the whole sequence's K/V. Both send the same bytes;
# the ring in `cp - 1` steps that overlap with compute, the all-gather in one collective that must
# finish before attention starts. With the model at the scale the book has in mind, Llama 3 8B's
# 8 K/V heads of 128 at 128k tokens in bf16, per layer:

# %%
SEQ_BIG = 131072
print(f"Llama 3 8B shapes, {SEQ_BIG:,} tokens, bf16, one layer: K/V buffers per rank (forward)\n")
print(f"{'cp':>4}{'ring':>12}{'all-gather':>14}")
for cp in (2, 4, 8, 16, 32):
    ring = cp_kv_buffer_bytes(1, LLAMA3_8B.kv_heads, SEQ_BIG, LLAMA3_8B.hidden // LLAMA3_8B.heads, cp, "ring")
    gather = cp_kv_buffer_bytes(1, LLAMA3_8B.kv_heads, SEQ_BIG, LLAMA3_8B.hidden // LLAMA3_8B.heads, cp, "all_gather")
    print(f"{cp:>4}{format_bytes(ring):>12}{format_bytes(gather):>14}")
    assert gather == 2 * SEQ_BIG * 8 * 128 * 2 and ring == 2 * min(2, cp - 1) * (SEQ_BIG // cp) * 8 * 128 * 2

# %% [markdown]
# | | all-gather | ring |
# |---|---|---|
# | how K/V move | one all-gather of K and one of V (ZeRO-3 style), then attend | one block per step, `cp - 1` point-to-point steps |
# | K/V buffer per rank | the whole sequence's K and V, $2\,cp$ blocks | two blocks of K and V at most (above) |
# | bytes sent per rank | $(cp - 1)/cp$ of all K/V | the same |
# | overlap | none: attention waits for the gather | each step's transfer behind the previous block's attention |
# | latency | one collective | `cp - 1` steps, each paying the base latency |
#
# The book's own table names the ring variant "All-to-All (Ring)". It is not chapter 08's
# `all_to_all` collective: every step is a point-to-point send to the next rank and a receive
# from the previous one, and after `cp - 1` steps each rank has seen every block.
#
# ## 8. Activation memory per rank against sequence length
#
# The point of CP is that everything a layer saves for backward is per token, and each rank has
# $s / cp$ tokens. We measure the bytes autograd saves in one forward (`saved_activation_bytes`)
# of a small GPT at a few sequence lengths:
# - one process with the model's own attention, which keeps the $s \times s$ scores;
# - one process with ring attention on a group of one rank (no scores kept: the backward
#   rebuilds them from the log-sum-exp, as FlashAttention does);
# - each rank under CP with `cp = WORLD_SIZE`.
#
# The memory model, `activation_bytes(config, seq, ..., cp=)`, divides every term by cp. Ring
# attention keeps no scores, which the model calls `recompute="selective"` (no quadratic term).

# %%
ACT = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=S)
SEQS = [2 * CP * c for c in ((2, 4, 8) if QUICK else (2, 4, 8, 16, 32))]
MBS = 2


def act_model():
    torch.manual_seed(SEED)
    return GPT(ACT)


def tokens(seq):
    return torch.randint(0, ACT.vocab_size, (MBS, seq), generator=torch.Generator().manual_seed(seq))


def saved_per_rank(ctx):
    alone = [ctx.new_group([r]) for r in range(ctx.world_size)][ctx.rank]  # every rank creates every group
    result = {}
    for seq in SEQS:
        ids = tokens(seq).to(ctx.device)
        ring_alone = apply_cp(act_model().to(ctx.device), alone, layout="zigzag")
        result["ring attention, one rank", seq] = saved_activation_bytes(ring_alone, ids)
        under_cp = apply_cp(act_model().to(ctx.device), init_mesh(ctx, cp=ctx.world_size), layout="zigzag")
        local = split_sequence(ids, ctx.rank, ctx.world_size, "zigzag", dim=1)[0]
        result[f"cp = {ctx.world_size}, per rank", seq] = saved_activation_bytes(under_cp, local)
    return result


saved = cluster.run(saved_per_rank)
saved = {
    **saved[0],
    **{("one process, eager attention", seq): saved_activation_bytes(act_model(), tokens(seq)) for seq in SEQS},
}
VARIANTS = ["one process, eager attention", "ring attention, one rank", f"cp = {CP}, per rank"]
print(f"GPT h = {ACT.hidden}, {ACT.layers} layers, batch {MBS}, float32: bytes saved for backward per rank\n")
print(f"{'sequence':>9}" + "".join(f"{v:>32}" for v in VARIANTS) + f"{'model: cp / one':>18}")
for seq in SEQS:
    model_ratio = activation_bytes(ACT, seq, MBS, "selective", cp=CP) / activation_bytes(ACT, seq, MBS, "selective")
    print(f"{seq:>9}" + "".join(f"{saved[v, seq]:>30,} B" for v in VARIANTS) + f"{model_ratio:>18.3f}")
    assert model_ratio == 1 / CP
    ratio = saved[VARIANTS[2], seq] / saved[VARIANTS[1], seq]
    assert abs(ratio * CP - 1) < 0.05, f"per rank within 5% of 1/cp of one process: {ratio:.3f}"
for variant in VARIANTS[1:]:  # linear in the sequence: doubling s doubles the bytes (within 5%)
    for s1, s2 in zip(SEQS, SEQS[1:]):
        assert abs(saved[variant, s2] / saved[variant, s1] / (s2 / s1) - 1) < 0.05, (variant, s1, s2)
eager_share = [saved[VARIANTS[0], seq] / saved[VARIANTS[1], seq] for seq in SEQS]
assert eager_share == sorted(eager_share) and eager_share[-1] > eager_share[0], "the s x s scores grow faster"
print(f"\nper rank under CP / ring attention on one rank, at every length: within 5% of 1/cp = {1 / CP:.3f}")

# %%
fig = Figure(figsize=(11, 3.8), layout="constrained")
left, right = fig.subplots(1, 2)
for variant, style in zip(VARIANTS, ("o-", "s-", "^-")):
    left.plot(SEQS, [saved[variant, s] for s in SEQS], style, ms=4, label=f"measured: {variant}")
for label, recompute, cp, anchor in (
    ("model, scores kept", "none", 1, VARIANTS[0]),
    (f"model, no scores, cp = {CP}", "selective", CP, VARIANTS[2]),
):
    model = [activation_bytes(ACT, s, MBS, recompute, cp=cp) for s in SEQS]
    scale = saved[anchor, SEQS[0]] / model[0]  # float32 and no dropout here: compare shapes, not constants
    left.plot(SEQS, [scale * m for m in model], "k--" if cp == 1 else "k:", lw=1, label=f"{label} (scaled)")
left.set(
    xscale="log",
    yscale="log",
    xlabel="sequence length",
    ylabel="bytes saved per rank",
    title="small GPT: activation memory per rank",
)
left.minorticks_off()
left.set_xticks(SEQS, [str(s) for s in SEQS])
left.legend(fontsize=7)
cps = [1, 2, 4, 8, 16, 32]
for recompute, style in (("selective", "o-"), ("full", "s--")):
    left_gb = [activation_bytes(LLAMA3_8B, SEQ_BIG, 1, recompute, cp=cp) / GB for cp in cps]
    right.plot(cps, left_gb, style, ms=4, label=f"{recompute} recomputation")
right.axhline(80, color="k", ls=":", lw=1)
right.text(1, 90, "80 GB", fontsize=8)
right.set(
    xscale="log",
    yscale="log",
    xlabel="cp",
    ylabel="GB of activations per GPU",
    title=f"Llama 3 8B at {SEQ_BIG:,} tokens (memory model)",
)
right.minorticks_off()
right.set_xticks(cps, [str(c) for c in cps])
right.legend(fontsize=8)
fig

# %%
full_1 = activation_bytes(LLAMA3_8B, SEQ_BIG, 1, "full")
print(f"Llama 3 8B, {SEQ_BIG:,} tokens, activations per GPU (memory model, bf16):")
for cp in cps:
    sel, ful = (activation_bytes(LLAMA3_8B, SEQ_BIG, 1, r, cp=cp) / GB for r in ("selective", "full"))
    print(f"  cp = {cp:>2}: selective recomputation {sel:7.1f} GB, full recomputation {ful:6.1f} GB")
assert full_1 == 2 * SEQ_BIG * LLAMA3_8B.hidden * LLAMA3_8B.layers and full_1 / GB > 30

# %% [markdown]
# At 128k tokens even full recomputation keeps over 30 GB of layer inputs on one GPU, and
# selective recomputation several times that; both divide by cp. That is what CP is for: with
# cp=16, 36.5 GB with selective recomputation, 2.1 GB with full. (The constants are GPT's; for
# Llama 3's grouped-query attention and SwiGLU MLP they are an estimate.) It does not make the
# model fit by itself: Llama 3 8B's weights, gradients and Adam states (16 bytes a parameter,
# about 128 GB) are whole on every cp rank until something else shards them, so long-context
# runs put CP beside ZeRO-3 (FSDP) or TP (chapter 09). The small GPT's measurements have the
# model's shape: the eager one-process curve bends up (the scores), the ring's are straight
# lines, and CP's is the one-rank ring line divided by cp.
#
# ## 9. The whole model under CP equals one process
#
# `apply_cp(model, mesh, layout="zigzag")` replaces the attention core of every block with ring
# attention over the mesh's `cp` axis, fills in the global positions of each rank's tokens (RoPE
# rotates a token by its place in the whole sequence) and registers a hook on every parameter
# that averages its gradient over the CP group inside backward. Each rank trains on its tokens of
# every sequence (`data.split(batch, rank, cp, by="sequence", layout="zigzag")`).
#
# Why an *average*: the loss on a rank is the mean over its tokens, the slices are equal, so the
# loss of the whole sequence is the mean of the ranks' losses, and its gradient the mean of
# theirs. We compare the logits, the loss, every gradient of the first batch and the weights after
# a few SGD steps with one process (with `QUICK = False` also Adam, and the contiguous layout), in
# float64 with every bias and norm weight moved off 0 and 1. And we turn the gradient hook off
# once, to see each rank's own gradient.

# %%
TCFG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=S)
DATA = Batches(TCFG, mbs=2, seed=SEED)
STEPS = 3 if QUICK else 10
RUNS = [("zigzag", "sgd")] + ([] if QUICK else [("zigzag", "adam"), ("contiguous", "sgd")])


def fresh_model():
    torch.manual_seed(SEED)
    return perturbed(GPT(TCFG).to(DT), seed=SEED)


def cp_training(ctx):
    mesh = init_mesh(ctx, cp=ctx.world_size)
    results = {}
    for i, (layout, optimizer) in enumerate(RUNS):
        ctx.log(done=i)
        model = apply_cp(fresh_model().to(ctx.device), mesh, layout=layout)
        stream = DATA.rank_stream(ctx.rank, ctx.world_size, by="sequence", layout=layout)
        results[layout, optimizer] = {
            **first_step(model, stream(0).to(ctx.device)),
            "positions": stream(0).positions,
            "weights": train(model, stream, STEPS, optimizer, device=ctx.device),
        }
    unsynced = apply_cp(fresh_model().to(ctx.device), mesh, layout="zigzag", sync_gradients=False)
    batch = DATA.rank_batch(ctx.rank, ctx.world_size, 0, by="sequence", layout="zigzag").to(ctx.device)
    batch.loss(unsynced).backward()
    results["own gradients"] = gradients(unsynced)
    return results


def one_process(optimizer):
    model = fresh_model()
    return {**first_step(model, DATA.global_batch(0)), "weights": train(model, DATA.global_stream(), STEPS, optimizer)}


trained = cluster.run(cp_training, on_log=ProgressBar("training under CP and in one process", total=len(RUNS)))
reference = {opt: one_process(opt) for opt in sorted({opt for _, opt in RUNS})}
for layout, optimizer in RUNS:
    want = reference[optimizer]
    losses = []
    for rank, result in enumerate(trained):
        got = result[layout, optimizer]
        what = f"{layout} {optimizer} rank {rank}"
        assert_same(got["logits"], want["logits"][:, got["positions"]], f"{what}: logits", optimizer=None)
        assert_same(got["grads"], want["grads"], f"{what}: gradients", optimizer=None)
        assert_same(got["weights"], want["weights"], f"{what}: weights after {STEPS} steps", optimizer=optimizer)
        losses.append(got["loss"])
    assert_same(sum(losses) / CP, want["loss"], f"{layout}: mean of the ranks' losses", optimizer=None)
    print(
        f"{layout:<11} {optimizer:<5} cp = {CP}: logits, loss (mean over ranks), {len(want['grads'])} gradients "
        f"and the weights after {STEPS} steps = one process (float64)"
    )

own = [result["own gradients"] for result in trained]
example = "blocks.0.attn.q.weight"
assert_same(
    {n: sum(g[n] for g in own) / CP for n in own[0]}, reference["sgd"]["grads"], "mean of own gradients", optimizer=None
)
for rank, grads in enumerate(own):
    assert (grads[example] - reference["sgd"]["grads"][example]).abs().max() > 1e-3, "one rank's gradient is partial"
print(
    f"without the gradient hook: each rank's {example} gradient differs from the true one; "
    f"their mean over the {CP} ranks equals it"
)

# %% [markdown]
# The CP ranks hold the same weights (nothing is sharded) and compute gradients over different
# tokens; without the average each rank's weights would drift to the gradient of its own slice.
# In a real job CP is usually combined with data parallelism, and then one all-reduce (or
# ZeRO's reduce-scatter) over the joint (dp, cp) group does both averages at once;
# `apply_cp(..., sync_gradients=False)` leaves the averaging to it.
#
# ## 10. Inputs that cannot be split
#
# A sequence must cut into equal chunks: $2 \cdot cp$ of them for zig-zag. We refuse other lengths
# rather than pad them (padding would need masking in attention *and* in the loss), and we refuse
# a cp larger than the number of chunks. The messages say what to change.

# %%
odd = Batches(GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=S + 2), mbs=2, seed=SEED)
messages = {
    f"{S + 2} tokens, cp = {CP}": refusal(lambda: split(odd.global_batch(0), 0, CP, by="sequence", layout="zigzag")),
    f"{S} tokens, cp = {S}": refusal(lambda: split(DATA.global_batch(0), 0, S, by="sequence", layout="zigzag")),
}
assert "pad the sequence to" in messages[f"{S + 2} tokens, cp = {CP}"]
assert f"use at most {S // 2} ranks" in messages[f"{S} tokens, cp = {S}"]
for case, message in messages.items():
    print(f"{case}:\n  {message}")


# %% [markdown]
# The ranks check each other too: every rank must hold a slice of the same length, q and k must
# have the same head size, and a model under `apply_cp` must be given the positions of its layout.
# Attention refuses on *every* rank (one small all-reduce of the shapes), so no rank is left
# waiting in the ring; the ring still works afterwards.


# %%
def refusals(ctx):
    q, k, v, _ = whole_problem()
    local = [mine(ctx, t, "zigzag")[0] for t in (q, k, v)]
    shorter = [t[:, :, :-2] if ctx.rank == 0 else t for t in local]
    model = apply_cp(fresh_model().to(ctx.device), init_mesh(ctx, cp=ctx.world_size), layout="zigzag")
    wrong_layout = DATA.rank_batch(ctx.rank, ctx.world_size, 0, by="sequence", layout="contiguous").to(ctx.device)
    errors = {
        "rank 0 holds 2 tokens fewer": refusal(lambda: context_parallel_attention(*shorter, layout="zigzag")),
        "k and v with head_dim 6": refusal(
            lambda: context_parallel_attention(local[0], local[1][..., :6], local[2][..., :6], layout="zigzag")
        ),
        "a contiguous batch for a zig-zag model": refusal(lambda: wrong_layout.loss(model)),
    }
    out = context_parallel_attention(*local, layout="zigzag")
    return errors, tuple(out.shape)


refused = cluster.run(refusals)
for case in refused[0][0]:
    print(f"{case}:")
    for rank in (0, 1):
        print(f"  rank {rank}: {refused[rank][0][case]}")
for rank, (errors, shape) in enumerate(refused):
    assert "sequence length from" in errors["rank 0 holds 2 tokens fewer"]
    assert "head_dim mismatch" in errors["k and v with head_dim 6"]
    assert f"rank {rank} got positions" in errors["a contiguous batch for a zig-zag model"]
    assert shape == (2, 4, S // CP, 8)
print(f"\nafterwards the ring works on every rank: output {refused[0][1]} per rank")


# %% [markdown]
# ## 11. PyTorch's own context parallelism
#
# PyTorch has an experimental `torch.distributed.tensor.experimental.context_parallel(mesh,
# buffers=...)`: inside it, `scaled_dot_product_attention` becomes a ring attention over the mesh
# and the buffers are split along the sequence (head-tail, which is our zig-zag, for causal
# attention). We try it on the cluster.


# %%
def pytorch_context_parallel(ctx):
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_mesh(ctx, cp=ctx.world_size).to_device_mesh()
    q, k, v, _ = (t.float().to(ctx.device) for t in whole_problem())
    ours = context_parallel_attention(*(mine(ctx, t, "zigzag")[0] for t in (q, k, v)), layout="zigzag")
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except (NotImplementedError, RuntimeError) as err:
        return type(err).__name__, str(err).splitlines()[0]
    theirs = theirs.to_local() if hasattr(theirs, "to_local") else theirs
    return "ran", float((theirs.float() - ours).abs().max())


attempts = cluster.run(pytorch_context_parallel)
if attempts[0][0] == "ran":
    # Different kernels (PyTorch's flash or memory-efficient SDPA against our float32 matmuls).
    assert all(diff < 1e-4 for _, diff in attempts), attempts
    print("PyTorch's context_parallel ran and its output equals ours on every rank (within 1e-4)")
else:
    print(
        f"PyTorch's context_parallel does not run on CPU with gloo in torch {torch.__version__.split('+')[0]}: "
        "it only shards the CUDA SDPA kernels (flash, memory-efficient, cuDNN), so it is compared on GPUs only."
    )

# %% tags=["nbval-ignore-output"]
print("what it raised on rank 0:", *attempts[0])

# %% [markdown]
# ## 12. On a GPU
#
# The overlap argument of section 6 in numbers: one ring step's attention of a block of
# $s/cp$ queries to $s/cp$ keys (SDPA, bf16, 32 heads of 128), against the bytes of the K/V block
# that must travel meanwhile (8 K/V heads). The bandwidth at which the transfer takes as long as
# the compute is what the link must beat for the ring to hide it.

# %%
if torch.cuda.is_available():
    for block_tokens in (2048, 8192, 32768):
        qb = torch.randn(1, 32, block_tokens, 128, device="cuda", dtype=torch.bfloat16)
        kb = torch.randn(1, 32, block_tokens, 128, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            F.scaled_dot_product_attention(qb, kb, kb)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            F.scaled_dot_product_attention(qb, kb, kb)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 10 / 1e3
        kv_bytes = 2 * block_tokens * 8 * 128 * 2
        print(
            f"block of {block_tokens:>6} tokens: attention {1e3 * seconds:7.3f} ms, K/V {format_bytes(kv_bytes)}: "
            f"hidden if the link moves more than {kv_bytes / seconds / 1e9:6.1f} GB/s ({torch.cuda.get_device_name()})"
        )
else:
    print("no CUDA device: the block-attention timing against the K/V transfer is skipped")

# %% [markdown]
# ## 13. Beyond the book: Ulysses, heads instead of keys
#
# Ring attention keeps every rank on its own queries and brings it everybody's keys. DeepSpeed-Ulysses
# (Jacobs et al. 2023, [arXiv 2309.14509](https://arxiv.org/abs/2309.14509)) starts from another
# fact: attention heads do not talk to each other. A rank that held *every* token of a few heads
# could run plain causal attention on them, with no log-sum-exp merging and no mask arithmetic
# across ranks. One all-to-all gets it there: rank $r$ cuts its `(batch, heads, s/cp, head_dim)`
# q, k and v into `cp` head groups and sends group $j$ to rank $j$; what arrives is
# `(batch, heads/cp, s, head_dim)`, all the tokens of head group $r$ (in the contiguous layout the
# pieces arrive in rank order, which is sequence order). After attention a second all-to-all sends
# each rank's rows back to the rank that owns those tokens. Backward needs nothing new: the
# derivative of an all-to-all is the reverse all-to-all (`comm.functional.all_to_all`).
#
# `parallel.ulysses.ulysses_attention` does this, and `apply_cp(model, mesh, layout="contiguous",
# kind="ulysses")` puts it in every block. No zig-zag here: every rank attends over the whole
# sequence for its heads, so the causal work is already equal, and any other layout is refused. We
# check it as the ring was checked: attention alone against SDPA on the whole sequence, and a GPT
# for two SGD steps against one process, in float64. The number of heads must be a multiple of cp
# (the limit, below), so these use `2 * cp` heads.

# %%
HEADS = 2 * CP
U_SHAPE = (2, HEADS, S, 8)  # batch, heads, whole sequence, head_dim: full multi-head attention
UCFG = GPTConfig(vocab_size=64, hidden=8 * HEADS, heads=HEADS, layers=2, seq_len=S)
UDATA = Batches(UCFG, mbs=2, seed=SEED)


def ulysses_fresh_model():
    torch.manual_seed(SEED)
    return perturbed(GPT(UCFG).to(DT), seed=SEED)


def ulysses_on_rank(ctx):
    q, k, v, upstream = whole_problem(U_SHAPE)
    local = [mine(ctx, t, "contiguous")[0].requires_grad_() for t in (q, k, v)]
    with CommLogger() as forward_log:
        out = ulysses_attention(*local)
    with CommLogger() as backward_log:
        out.backward(mine(ctx, upstream, "contiguous")[0])
    model = apply_cp(
        ulysses_fresh_model().to(ctx.device), init_mesh(ctx, cp=ctx.world_size), layout="contiguous", kind="ulysses"
    )
    stream = UDATA.rank_stream(ctx.rank, ctx.world_size, by="sequence", layout="contiguous")
    return {
        "attention": [t.detach() for t in (out, *(x.grad for x in local))],
        "logs": (forward_log.totals(), backward_log.totals()),
        "model": {
            **first_step(model, stream(0).to(ctx.device)),
            "positions": stream(0).positions,
            "weights": train(model, stream, 2, "sgd", device=ctx.device),
        },
    }


ulysses_runs = cluster.run(ulysses_on_rank)
q, k, v, upstream = (t.requires_grad_() for t in whole_problem(U_SHAPE))
want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
want.backward(upstream)
for i, (name, expected) in enumerate(zip(("output", "dQ", "dK", "dV"), (want.detach(), q.grad, k.grad, v.grad))):
    assert_same(
        torch.cat([run["attention"][i] for run in ulysses_runs], dim=2), expected, f"Ulysses {name}", optimizer=None
    )
model = ulysses_fresh_model()
one = {**first_step(model, UDATA.global_batch(0)), "weights": train(model, UDATA.global_stream(), 2, "sgd")}
for rank, run in enumerate(ulysses_runs):
    got = run["model"]
    assert_same(got["logits"], one["logits"][:, got["positions"]], f"rank {rank}: logits", optimizer=None)
    assert_same(got["grads"], one["grads"], f"rank {rank}: gradients", optimizer=None)
    assert_same(got["weights"], one["weights"], f"rank {rank}: weights after 2 steps", optimizer="sgd")
print(
    f"Ulysses, cp = {CP}, {HEADS} heads: output, dQ, dK, dV = SDPA on the whole sequence; the GPT's logits, "
    "gradients and weights after 2 SGD steps = one process (float64)"
)

# %% [markdown]
# **What moves.** Each of the four all-to-alls (q, k, v there, the output back; in backward the
# output's gradient there, dQ, dK, dV back) keeps $1/cp$ of a rank's $s/cp$ tokens and sends the
# rest. With $h$ query heads and $h_{kv}$ K/V heads of $d$ values each, write $D = h\,d$ and
# $D_{kv} = h_{kv}\,d$ for the width of all the query heads and of all the K/V heads. Per rank,
# forward, Ulysses sends $2\,(D + D_{kv}) \cdot \frac{s}{cp} \cdot \frac{cp-1}{cp}$ elements, which
# *falls* as cp grows: $O(s\,D/cp)$. The ring sends $cp - 1$ K/V blocks,
# $2\,D_{kv}\,(cp-1)\,\frac{s}{cp}$ elements forward, and in backward the K/V again and the dK/dV's
# sums, $cp - 1$ hops each: close to all the sequence's K/V whatever cp is, $O(s\,D_{kv})$.
# `ulysses_bytes` and `ring_bytes` are the two formulas; the logger measured Ulysses
# above, and measures the ring on the same q, k, v now.


# %%
def ring_logs(ctx):
    q, k, v, upstream = whole_problem(U_SHAPE)
    local = [mine(ctx, t, "contiguous")[0].requires_grad_() for t in (q, k, v)]
    with CommLogger() as forward_log:
        out = context_parallel_attention(*local, layout="contiguous")
    with CommLogger() as backward_log:
        out.backward(mine(ctx, upstream, "contiguous")[0])
    return forward_log.totals(), backward_log.totals()


ring_runs = cluster.run(ring_logs)
b, h, s, d = U_SHAPE
print(f"bytes one rank sends per attention layer, cp = {CP}, q/k/v {U_SHAPE} float64 (measured = formula):")
print(f"{'':>9} {'forward':>12} {'backward':>12}")
for name, logs, op, formula in (
    (
        "ring",
        [run for run in ring_runs],
        "batch_isend_irecv",
        lambda backward: ring_bytes(b, h, s, d, CP, 8, backward=backward),
    ),
    (
        "Ulysses",
        [run["logs"] for run in ulysses_runs],
        "all_to_all_single",
        lambda backward: ulysses_bytes(b, h, h, s, d, CP, 8, backward=backward),
    ),
):
    assert all(log[op]["bytes_sent"] == formula(i == 1) for rank in logs for i, log in enumerate(rank)), name
    print(f"{name:>9} {format_bytes(formula(False)):>12} {format_bytes(formula(True)):>12}")
print(f"Ulysses / ring, forward: {ulysses_bytes(b, h, h, s, d, CP, 8) / ring_bytes(b, h, s, d, CP, 8):.2f} = 2 / cp")

# %% [markdown]
# With full multi-head attention Ulysses sends $2/cp$ of the ring's forward bytes: the same at cp 2,
# less beyond. Grouped-query attention shrinks the ring's K/V but not Ulysses's q and output. With
# Llama 3 8B's 32 query and 8 K/V heads the ring sends less at cp = 4, Ulysses from cp = 8; beyond 8
# ranks Ulysses needs each K/V head repeated (to cp K/V heads), and still sends less:

# %%
llama = dict(batch=1, seq=2**17, head_dim=128, bytes_per_element=2)
print("Llama 3 8B attention, 128k tokens, bf16: bytes one rank sends per layer, forward")
for cp in (4, 8, 16, 32):
    kv = max(8, cp)  # K/V heads Ulysses sends: repeated up to cp beyond 8 ranks
    print(
        f"  cp = {cp:>2}: ring {format_bytes(ring_bytes(kv_heads=8, cp=cp, **llama)):>10}, "
        f"Ulysses {format_bytes(ulysses_bytes(heads=32, kv_heads=kv, cp=cp, **llama)):>10}"
        + (f" (K/V heads repeated to {kv})" if kv > 8 else "")
    )

# %% [markdown]
# **Its limit.** A head cannot be cut, so cp must divide the number of heads, and with grouped-query
# attention the number of K/V heads as well: each rank needs whole K/V heads for its query heads.
# Llama 3 8B's 8 K/V heads stop Ulysses as it stands at cp = 8. The table above reached cp = 16
# and 32 only by repeating every K/V head up to cp heads (2 and 4 copies), which multiplies the K/V
# bytes Ulysses sends and holds by the same factor; the ring needs no copy at any cp. Both cases
# are refused, on every rank, with what to do instead:


# %%
def ulysses_refusals(ctx):
    q, k, v, _ = whole_problem((2, HEADS + 1, S, 8))
    odd = [mine(ctx, t, "contiguous")[0] for t in (q, k, v)]
    gqa = [odd[0][:, :HEADS], odd[1][:, :1], odd[2][:, :1]]  # 1 K/V head for 2*cp query heads
    return {
        f"{HEADS + 1} heads": refusal(lambda: ulysses_attention(*odd)),
        f"{HEADS} heads, 1 K/V head": refusal(lambda: ulysses_attention(*gqa)),
        "zig-zag layout": refusal(
            lambda: apply_cp(ulysses_fresh_model(), init_mesh(ctx, cp=ctx.world_size), layout="zigzag", kind="ulysses")
        ),
    }


refused = cluster.run(ulysses_refusals)
assert all(errors == refused[0] for errors in refused)
for case, message in refused[0].items():
    print(f"{case}:\n  {message}")

# %% [markdown]
# **A race.** Time one attention forward and backward, ring (zig-zag, its balanced layout) against
# Ulysses (contiguous), on the ranks (float32, `2 * cp` heads of 32, two sequence lengths), five
# times each after a warm-up; a time is the slowest rank's, and we print the median. The ring
# runs a second time as the noise baseline: the same attention against itself shows how far
# two times differ with nothing changed, the yardstick for the ring against Ulysses.

# %% tags=["nbval-ignore-output"]
RACE = [2 * CP * c for c in ((16, 64) if QUICK else (16, 64, 256))]


def race(ctx):
    times = {}
    for seq in RACE:
        q, k, v, upstream = whole_problem((1, HEADS, seq, 32), torch.float32)
        for name, layout, attend in (
            ("ring", "zigzag", context_parallel_attention),
            ("Ulysses", "contiguous", ulysses_attention),
            ("ring again", "zigzag", context_parallel_attention),
        ):
            local = [mine(ctx, t, layout)[0] for t in (q, k, v, upstream)]  # each in its own layout
            samples = []
            for repeat in range(6):
                inputs = [t.clone().requires_grad_() for t in local[:3]]
                ctx.barrier()
                start = time.perf_counter()
                attend(*inputs, layout=layout).backward(local[3])
                wait_for_device(ctx.device)  # on a GPU: the kernels done, not only queued
                samples.append(time.perf_counter() - start)
            times[name, seq] = samples[1:]  # the first is a warm-up
    return times


raced = cluster.run(race)
for seq in RACE:
    medians = {
        name: float(np.median([max(r[name, seq][i] for r in raced) for i in range(5)]))
        for name in ("ring", "Ulysses", "ring again")
    }
    print(
        f"{seq:>5} tokens: "
        + ", ".join(f"{name} {1e3 * t:6.1f} ms" for name, t in medians.items())
        + f"; Ulysses / ring {medians['Ulysses'] / medians['ring']:.2f}, "
        f"ring against itself {medians['ring again'] / medians['ring']:.2f} (the noise)"
    )

# %% [markdown]
# On this machine the sizes are tiny and the "network" is gloo over loopback on two shared cores:
# a collective costs a fixed fraction of a millisecond or more before it moves a byte, so the
# count of communication steps matters more than their bytes. The ring takes $cp - 1$ steps forward
# and $2\,cp - 1$ backward, each a point-to-point exchange; Ulysses takes four all-to-alls each way,
# whatever cp is. Which wins here depends on those latencies and on how the two cores are shared,
# and changes from run to run.
#
# The formulas say what happens at scale. Both do the same attention FLOPs per rank ($1/cp$ of the
# whole), growing as $s^2$. The ring's bytes per rank stay near the whole sequence's K/V, $O(s\,D_{kv})$,
# but travel during the compute and are hidden once a block's attention, $O((s/cp)^2)$, outlasts
# its transfer (section 6). Ulysses moves $O(s\,D/cp)$, less for large cp, but its all-to-alls sit
# between the projections and the attention, with nothing to overlap them, and every rank talks to
# every other at once: cheap inside an NVLink node, costly across nodes. And past cp = number of
# K/V heads it must repeat them. That is why the two are combined: Ulysses inside a node, the ring across
# nodes (USP, Fang and Zhao 2024, [arXiv 2405.07719](https://arxiv.org/abs/2405.07719)).

# %% [markdown]
# ## Summary
#
# | | contiguous | zig-zag |
# |---|---|---|
# | rank $r$ holds | slice $r$ of $cp$ | chunks $r$ and $2\,cp - 1 - r$ of $2\,cp$ |
# | causal work per rank | grows with $r$: the slowest rank's ring FLOPs $2\,cp/(cp+1)$ times the mean (1.60 at cp = 4), its unmasked (q, k) pairs up to $2 - 1/cp$ times (1.71 for 16 tokens) | equal |
#
# - Only attention crosses ranks. Ring attention passes K/V blocks point to point, `cp - 1`
#   steps, each posted before the local block's attention so that the two overlap, and merges
#   the partial results with their log-sum-exp: FlashAttention's online softmax across ranks.
# - Forward and backward equal full attention to float64 precision; the backward sends the K/V
#   round again and sums each block's dK/dV round the ring, ending at its owner.
# - The ring keeps at most two extra K/V blocks per rank; the all-gather variant keeps the whole
#   sequence's K/V. Both send the same bytes.
# - Activations per rank divide by cp; weights do not, and their gradients are averaged over the
#   CP group. The model trained under CP equals one process.
# - Beyond the book: Ulysses trades the sequence split for a head split with one all-to-all, attends
#   per head group over the whole sequence and trades back: $O(s\,D/cp)$ bytes per rank against the
#   ring's $O(s\,D_{kv})$ ($D$, $D_{kv}$: the width of all query heads, of all K/V heads), but cp
#   must divide the heads, K/V heads are repeated beyond their number, and its all-to-alls are not
#   overlapped.
#
# Next, chapter 07 splits the model by layers instead: pipeline parallelism.

# %% [markdown]
# ## Your turn
# Open [exercises/06_context_parallelism_exercises.ipynb](../exercises/06_context_parallelism_exercises.ipynb): write the rule that merges two partial attentions, the zig-zag layout with its tile
# counts, one step of the ring, and Ulysses's two all-to-alls.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/06_context_parallelism_exercises.ipynb` grades
# the whole notebook from a terminal.

# %%
cluster.close()
