# %% [markdown]
# # 08 · Expert parallelism: mixture of experts and the all-to-all
#
# A **mixture-of-experts** (MoE) layer replaces a block's one feed-forward network by E of them,
# the *experts*, and a small *router* that sends each token to k of them (k = 1 in the Switch
# Transformer, 2 in Mixtral; DeepSeek-V3 routes each token to 8 of its 256 routed experts and
# sends every token through one *shared* expert as well, which needs no routing; GPT-4
# is widely reported to be an MoE too). The layer has E times the feed-forward parameters, but a
# token only pays for k feed-forwards: capacity grows, compute per token hardly does.
#
# Experts are independent of each other, which makes them easy to spread out. **Expert
# parallelism** (EP) puts E/ep experts on each of `ep` ranks. Each rank runs the rest of the
# model (attention, norms, routers) on its *own* tokens, as in data parallelism, and in every
# MoE layer the tokens travel to the ranks holding their experts and back: an **all-to-all**
# called *dispatch*, the experts, and a second all-to-all called *combine*.
#
# In this notebook you will
# 1. build an MoE layer on one process and count its parameters exactly;
# 2. follow one dispatch by hand: split sizes, rows, the permutation and its inverse;
# 3. train the MoE GPT under `apply_ep`, with and without data parallelism, to the same
#    logits, gradients and weights as one process;
# 4. see why EP comes with DP: what each rank holds, and how gradients are averaged;
# 5. check the bytes of every all-to-all against a prediction, with `CommLogger`;
# 6. plot the tokens each rank receives, for a balanced and a skewed router;
# 7. limit each token to M groups of experts, as DeepSeek-V3 does with M = 4 nodes, and measure
#    the traffic it removes;
# 8. time the experts as a per-expert loop and as one grouped (batched) matrix multiply;
# 9. beyond the book: balance a skewed router without an auxiliary loss, as DeepSeek-V3 does.
#
# The code: `lib/ultrascale/moe.py` (router, experts, load-balancing loss; no parallelism) and
# `lib/ultrascale/parallel/expert_parallel.py` (placement, dispatch, combine, `apply_ep`).

# %% tags=["parameters"]
WORLD_SIZE = 4  # ranks; ep divides it (2, 3 and 4 all work: E is a multiple of WORLD_SIZE)
QUICK = True  # True: small timing sizes, about 15 s on 2 CPU cores; False: larger sizes and more repeats (longer)
SEED = 0

# %%
from ultrascale.runtime import Cluster  # first: the ranks' fork server loads torch meanwhile
import math
import time
from dataclasses import replace

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from ultrascale.comm import format_bytes
from ultrascale.model import GPT, MLP, GPTConfig, active_params, count_params
from ultrascale.checks import nonempty
from ultrascale.moe import MoE, apply_experts, auxiliary_loss, grouped_mlp, limit_groups, update_selection_bias
from ultrascale.parallel.expert_parallel import apply_ep, dispatch_plan, expert_parameter_names, local_experts
from ultrascale.parity.expert_runs import assert_ep_matches, ep_rank_run, layer_traffic, moe_model, one_process_run
from ultrascale.viz.diagrams import moe_layer_figure
from ultrascale.viz.live import ProgressBar

torch.manual_seed(SEED)
plt.switch_backend(plt.get_backend())  # figures are Figure objects that a cell shows by returning them

# %% [markdown]
# ## 1. The sizes
#
# All the ranks form one EP group, so `ep = WORLD_SIZE`, and every rank must hold the same
# number of experts: **ep must divide E**. We take E = 2 · WORLD_SIZE (8 experts on 4 ranks, 6 on
# 3, 4 on 2), so that each rank holds two experts and the number of experts is never the number
# of ranks. With 8 experts and 3 ranks there is no even split, and `apply_ep` refuses it
# (section 9 shows the message): choose E as a multiple of the number of ranks.

# %%
EP = WORLD_SIZE
E = 2 * EP
HIDDEN, SEQ = 32, 16
config = GPTConfig(vocab_size=64, hidden=HIDDEN, heads=2, layers=2, seq_len=SEQ, experts=E, top_k=2)
print(f"ep = {EP} ranks, E = {E} experts, {E // EP} per rank, top-{config.top_k} routing")

cluster = Cluster(WORLD_SIZE)
print(cluster)

# %% [markdown]
# ## 2. The MoE layer on one process
#
# The router is one linear layer from the hidden size to E logits, then a softmax and the top k.
# With k > 1 the k chosen probabilities are renormalised to sum to 1 (Mixtral). With k = 1 the
# weight is the probability itself (Switch): a renormalised single weight is always 1, and the
# router would get no gradient from the loss.
#
# The experts are the course GPT's MLP (h → 4h → h), E of them. Rather than sending tokens
# through experts one token at a time, `apply_experts` sorts the (token, choice) pairs by expert,
# so that each expert runs once on one batch of its tokens, then weights the outputs and adds them
# back to their tokens. That sort and its inverse are what EP will stretch across ranks.
#
# Parameters: each block trades its MLP (8h² + 5h) for a router (h · E, no bias) and E MLPs.
# `count_params` computes that from the config; the model built from it must agree, and so must
# the parameters a token *uses* (`active_params`: the router and k experts).

# %%
dense = GPTConfig(vocab_size=64, hidden=HIDDEN, heads=2, layers=2, seq_len=SEQ)
moe_gpt = GPT(config)
built = sum(p.numel() for p in moe_gpt.parameters())
mlp = 8 * HIDDEN**2 + 5 * HIDDEN
assert count_params(config) == built == count_params(dense) + config.layers * (HIDDEN * E + (E - 1) * mlp)
assert active_params(config) == count_params(dense) + config.layers * (HIDDEN * E + (config.top_k - 1) * mlp)
print(f"dense GPT: {count_params(dense):,} parameters")
print(
    f"MoE GPT, E = {E}: {count_params(config):,} parameters ({built:,} in the built model), "
    f"{active_params(config):,} used per token"
)

moe = moe_gpt.blocks[0].mlp
x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(SEED))
weights, chosen, probs = moe.router(x)
by_token = torch.stack(
    [sum(w * moe.experts[int(e)](x[t]) for w, e in zip(weights[t], chosen[t])) for t in range(len(x))]
)
torch.testing.assert_close(moe.experts_forward(x, chosen, weights), by_token)
assert torch.allclose(weights.sum(-1), torch.ones(len(x)))
print("tokens gathered per expert = a loop over tokens; top-2 weights sum to 1")

# %% [markdown]
# The first four of those tokens, drawn: the router picks two experts for each and weights them
# (an untrained router weights its two picks almost equally; the thicker the line, the larger the
# weight); dispatch sends the token to both; each expert runs on the tokens it received; combine
# adds the weighted outputs back on the token. The experts
# are coloured by the rank that holds them under EP (section 4), where dispatch and combine
# become the two all-to-alls.

# %%
moe_layer_figure(chosen[:4], weights[:4], experts=E, experts_per_rank=E // EP)

# %% [markdown]
# ## 3. One dispatch, by hand
#
# Four tokens, four experts on two ranks (experts 0-1 on rank 0, 2-3 on rank 1), top-2. The
# **plan** (`dispatch_plan`) makes one row per (token, destination rank), sorted by rank: a token
# whose two experts live on the same rank travels once, carrying the local ids of the experts it
# uses there (-1: not here) and their weights. The number of rows per rank are the *split sizes*
# of the all-to-all. A rank knows what it sends but not what it will receive, so the ranks first
# swap their split sizes (`exchange_counts`, a tiny all-to-all of one number per rank).
#
# After the experts, the reverse all-to-all brings the rows back in the same order, and
# `index_add` over the plan's rows puts each one back on its token: the inverse permutation.

# %%
chosen4 = torch.tensor([[0, 1], [3, 0], [2, 3], [1, 0]])
weights4 = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
plan = dispatch_plan(chosen4, weights4, ep=2, per_rank=2)
print("row  token  to rank  local ids  weights")
for i, (row, ids, w) in enumerate(zip(plan.rows.tolist(), plan.local_ids.tolist(), plan.weights.tolist())):
    print(f"{i:>3}  {row:>5}  {int(i >= plan.send_counts[0]):>7}  {str(ids):>9}  {[round(v, 1) for v in w]}")
print("split sizes (rows per rank):", plan.send_counts)
assert plan.send_counts == [3, 2] and plan.rows.tolist() == [0, 1, 3, 1, 2]

# the same plan, both "ranks" simulated here: each runs its two experts on its rows
experts4 = [torch.nn.Linear(3, 3) for _ in range(4)]
x4 = torch.randn(4, 3)
combined = torch.zeros_like(x4)
for r, rows in enumerate((slice(0, 3), slice(3, 5))):
    local = apply_experts(experts4[2 * r : 2 * r + 2], x4[plan.rows[rows]], plan.local_ids[rows], plan.weights[rows])
    combined.index_add_(0, plan.rows[rows], local)
torch.testing.assert_close(combined, apply_experts(experts4, x4, chosen4, weights4))
print("combine (index_add over the rows) = the one-process layer")

# %% [markdown]
# ## 4. Expert parallelism equals one process
#
# `apply_ep(model, mesh_or_group)` keeps this rank's experts of every MoE layer (under their
# global names, so `blocks.0.mlp.experts.5.fc.weight` lives on the rank holding expert 5) and
# replaces the layer's `experts_forward` by the dispatch, local experts and combine. The model
# file knows nothing about it.
#
# `ultrascale.parity` runs the check: the same seeded weights and tokens; one process trains on
# the whole global batch, each rank on its rows. We compare the logits and gradients of the first
# step, then the weights after two SGD steps. Each rank's loss is the mean over its own tokens, so
# the model's gradient is the *average* over the ranks with different data:
#
# - a dense parameter (attention, norms, routers) is on every rank: all-reduce and divide by D,
#   the number of ranks with different data;
# - an expert's gradient already *sums* every rank's tokens that reached it (the all-to-all's
#   backward brought their gradients to it): sum it over the expert's replicas only (the dp
#   group; none without DP) and divide by the same D.
#
# Every way to factor the ranks as dp × ep with ep dividing E is run with top-2 routing (at 4
# ranks: ep = 1, 2 and 4, so DP alone, DP with EP, and EP alone), and EP alone with top-1.

# %%
FACTORS = [(WORLD_SIZE // ep, ep) for ep in range(1, WORLD_SIZE + 1) if WORLD_SIZE % ep == 0 and E % ep == 0]
RUNS = [(dp, ep, 2) for dp, ep in FACTORS] + [(1, EP, 1)]
bar = ProgressBar("EP training runs against one process", total=len(RUNS))
held, routings = {}, {}
for dp, ep, k in RUNS:
    c = replace(config, top_k=k)
    per_rank = cluster.run(ep_rank_run, c, 2, "sgd", mesh_sizes={"dp": dp, "ep": ep})
    assert_ep_matches(per_rank, one_process_run(c, WORLD_SIZE), what=f"dp={dp} x ep={ep}, top-{k}")
    held[dp, ep] = [sorted({int(n.split(".")[4]) for n in r["weights"] if ".experts." in n}) for r in per_rank]
    routings.setdefault((dp, ep), []).append(f"top-{k}")
    bar.advance()
for (dp, ep), experts_held in held.items():
    assert all(h == list(local_experts(E, ep, (r % ep))) for r, h in enumerate(experts_held))
    print(
        f"dp={dp} x ep={ep}: logits, gradients and weights match one process ({', '.join(routings[dp, ep])}); "
        f"experts per rank {experts_held}"
    )

# %% [markdown]
# ## 5. Why EP comes with DP
#
# Without its data dimension, EP would make every rank run the same attention on the same
# tokens: the dense part computed ep times over for nothing. Giving each EP rank its own tokens
# makes the dense part data-parallel and keeps every expert busy with the tokens of *all* ranks.
# So a rank holds a full copy of the dense parameters and 1/ep of the experts. For a large MoE
# most parameters are experts, which is where the memory goes away.


# %%
def held_parameters(ctx, config):
    model = apply_ep(moe_model(config, device=ctx.device), None)
    experts = set(expert_parameter_names(model))
    count = lambda names: sum(p.numel() for n, p in model.named_parameters() if n in names)  # noqa: E731
    names = {n for n, _ in model.named_parameters()}
    return count(names - experts), count(experts)


per_rank_params = cluster.run(held_parameters, config)
dense_part, expert_part = per_rank_params[0]
all_experts = config.layers * E * mlp
assert all(p == (dense_part, all_experts // EP) for p in per_rank_params)
assert dense_part + all_experts == count_params(config)
print(
    f"every rank: {dense_part:,} dense parameters (replicated) + {expert_part:,} expert parameters "
    f"= 1/{EP} of the {all_experts:,}"
)

# %% [markdown]
# ## 6. Every byte of the all-to-alls
#
# The dispatch of one MoE layer on one rank sends: the split sizes (8 bytes per other rank), the
# local expert ids of its rows (k int64 each), the rows themselves and their k weights (fp32);
# the combine sends back the rows it received. Rows a rank sends to itself never leave it.
# `dispatch_volume` predicts all of it from the split sizes, forward and backward (backward sends
# each all-to-all's gradient the other way); `CommLogger` records what the layer really passed to
# `all_to_all_single`, under the labels "ep routing", "ep dispatch" and "ep combine"
# (`expert_runs.layer_traffic` runs the layer under the logger and returns both).


# %%
def one_layer_logged(ctx, config, seed, selection_bias=None):
    """One MoE layer, forward and backward, on this rank's tokens: bytes logged and predicted."""
    model = apply_ep(moe_model(config, selection_bias=selection_bias, device=ctx.device), None, sync_gradients=False)
    x = torch.randn(4 * SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed + ctx.rank)).to(ctx.device)
    x.requires_grad_()
    return layer_traffic(model.blocks[0].mlp, x)


logged = cluster.run(one_layer_logged, config, SEED)
for rank, run in enumerate(logged):
    assert run["logged"] == run["predicted"], f"rank {rank}: logged {run['logged']}, predicted {run['predicted']}"
print("on every rank, the logged bytes of every all-to-all equal the prediction, forward and backward")

# %% tags=["nbval-ignore-output"]
print("rank  split sizes     routing  dispatch   combine  backward")
for rank, run in enumerate(logged):
    f, b = run["logged"]
    print(
        f"{rank:>4}  {str(run['send']):<13} {format_bytes(f['ep routing']):>9} {format_bytes(f['ep dispatch']):>9} "
        f"{format_bytes(f['ep combine']):>9} {format_bytes(b['all_to_all_single']):>9}"
    )

# %% [markdown]
# ## 7. Load per rank, and a skewed router
#
# A rank's work in an MoE layer is the number of (token, expert) choices that land on its
# experts. The all-to-all waits for every rank, so the busiest rank sets the pace: the layer
# takes max/mean times as long as a balanced one (it runs at mean/max of the balanced speed). A freshly initialised router spreads the tokens fairly
# evenly. A skewed one, here a `selection_bias` of +0.1 on expert 0 (the bias DeepSeek-V3 adds to
# the scores when choosing, and adjusts to *restore* balance), piles the tokens onto rank 0.
#
# Two ways to keep a trained router balanced: a load-balancing loss (`moe.balance_loss`,
# sequence-wise as DeepSeek-V3's complementary loss; `aux_loss_coef` adds it to the training
# loss), which is E · Σ f_i P_i with f_i the share of choices and P_i the mean probability of
# expert i, 1 for an even router, and pushes down the probabilities of overloaded experts; or
# DeepSeek-V3's selection bias, lowered for overloaded experts and raised for idle ones between
# steps, without a loss.

# %%
SKEW = [0.1] + [0.0] * (E - 1)
loads = {
    "balanced": [r["load"] for r in logged],
    "skewed": [r["load"] for r in cluster.run(one_layer_logged, config, SEED, SKEW)],
}
total = {name: torch.tensor(per).sum(0) for name, per in loads.items()}  # every rank's tokens, per rank
imbalance = {name: (t.max() / t.float().mean()).item() for name, t in total.items()}
assert imbalance["skewed"] > imbalance["balanced"] and total["skewed"].argmax() == 0
assert total["skewed"].sum() == total["balanced"].sum() == WORLD_SIZE * 4 * SEQ * config.top_k


fig = Figure(figsize=(9, 3.2), layout="constrained")
for ax, name in zip(fig.subplots(1, 2, sharey=True), total):
    ax.bar(range(WORLD_SIZE), total[name].tolist(), color="tab:red" if name == "skewed" else "tab:blue")
    ax.axhline(total[name].float().mean().item(), color="k", ls="--", lw=1)
    ax.set(
        title=f"{name} router: max/mean = {imbalance[name]:.2f}", xlabel="rank (its experts)", xticks=range(WORLD_SIZE)
    )
fig.axes[0].set_ylabel("(token, expert) choices received")
fig

# %% tags=["nbval-ignore-output"]
for name in total:
    print(f"{name:>8}: choices per rank {total[name].tolist()}, max/mean {imbalance[name]:.2f}")

# %% [markdown]
# ## 8. Node-limited routing
#
# With top-8 routing over 256 experts, a token could need experts on 8 different nodes, and
# cross-node bandwidth is the scarce one. DeepSeek-V3 caps it: each token may use experts of at
# most **M = 4** nodes. It scores each node by the *sum* of the token's `k/M = 2` highest
# affinities among that node's experts, keeps the M best nodes, and then picks the top 8 experts
# within them. (Its shared expert is not routed, so the limit does not concern it.) First the
# arithmetic, for its
# 256 experts on 8 nodes (32 per node) and 8 experts per token chosen at random: a node holds
# none of them with probability C(224, 8) / C(256, 8), so on average a token reaches
# 8 · (1 − C(224, 8) / C(256, 8)) nodes.

# %%
nodes, per_node, k_v3, M = 8, 32, 8, 4
expected_nodes = nodes * (1 - math.comb(256 - per_node, k_v3) / math.comb(256, k_v3))
print(
    f"DeepSeek-V3-like: a token reaches {expected_nodes:.2f} of {nodes} nodes on average; with M = {M}, "
    f"at most {M}: at most {M / expected_nodes:.0%} of the cross-node copies without a limit"
)
assert 5 < expected_nodes < 6

# %% [markdown]
# Here each rank plays a node: the experts are cut into `expert_groups = ep` groups, one per rank,
# and `group_limit = M` restricts each token to its M best groups (`moe.limit_groups`), scored as
# DeepSeek-V3 scores its nodes: the sum of the token's `k/M` highest scores in the group. With
# `k = M` that is the single best expert (DeepSeek-V2's device-limited rule); the sum prefers a
# group that can supply its share of the k picks over one with a lone strong expert:

# %%
token = torch.tensor([[0.50, 0.00, 0.30, 0.30]])  # one token's scores, two groups of two experts
kept = limit_groups(token, groups=2, limit=1, top_k=2).isfinite().nonzero()[:, 1].tolist()
print(
    f"top-2 from M = 1 group: group 0's best expert scores 0.50, group 1's two best add up to 0.60; "
    f"experts kept: {kept}"
)
assert kept == [2, 3]  # the best-expert rule would keep group 0, whose second pick scores 0.00

# %% [markdown]
# Whatever the scoring, the cap, and so the traffic it saves, is the same: at most M groups per
# token, so a token occupies at most M rows of the dispatch instead of up to k. We measure the
# dispatch bytes with `CommLogger`, top-2 over E experts, without a limit and with M = 1, and
# train the limited model under EP to the same numbers as one process (the limit changes the
# model, not the parity).

# %%
free_config = replace(config, expert_groups=EP)
limited_config = replace(config, expert_groups=EP, group_limit=1)
sent = {}
for name, c in (("no limit", free_config), ("M = 1", limited_config)):
    runs = cluster.run(one_layer_logged, c, SEED)
    assert all(r["logged"] == r["predicted"] for r in runs)
    sent[name] = {"rows": sum(sum(r["send"]) for r in runs), "bytes": sum(r["logged"][0]["ep dispatch"] for r in runs)}
assert sent["M = 1"]["rows"] == WORLD_SIZE * 4 * SEQ <= sent["no limit"]["rows"]
assert sent["M = 1"]["bytes"] < sent["no limit"]["bytes"]
assert_ep_matches(
    cluster.run(ep_rank_run, limited_config), one_process_run(limited_config, WORLD_SIZE), what="group-limited"
)
print(
    f"M = 1: every token is one row ({sent['M = 1']['rows']} rows for {WORLD_SIZE * 4 * SEQ} tokens); "
    "less dispatch traffic than without a limit; training under EP still matches one process"
)

# %% tags=["nbval-ignore-output"]
for name, s in nonempty(sent, "dispatch measurements").items():
    print(f"{name:>8}: {s['rows']:>4} rows, {format_bytes(s['bytes']):>10} of dispatch sent over all ranks")
print(f"the limit removes {1 - sent['M = 1']['bytes'] / sent['no limit']['bytes']:.0%} of the dispatch bytes")

# %% [markdown]
# ## 9. Grouped experts: one batched multiply instead of a loop
#
# `apply_experts` runs the experts one after the other: E small matrix multiplies, each on a
# different number of tokens. On a GPU each launch costs a few microseconds and small multiplies
# leave most of the chip idle, so MoE kernels use a *grouped GEMM*: one launch for all experts.
# `grouped_mlp` does the simplest version: pad every expert's tokens to the busiest expert's
# count and run `torch.bmm` over the stacked weights. Same numbers; the timing below is of
# this machine (a CPU here, where the gain is small and the padding costs real work; on a GPU the
# same cell times CUDA).

# %%
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
T_GROUPED, H_GROUPED = (2048, 64) if QUICK else (16384, 256)
one_layer = GPT(GPTConfig(hidden=H_GROUPED, heads=4, layers=1, experts=E))
grouped_experts = [m.to(device) for m in one_layer.blocks[0].mlp.experts]
counts = torch.distributions.Multinomial(T_GROUPED, torch.ones(E)).sample().long().tolist()
tokens = torch.randn(T_GROUPED, H_GROUPED, device=device)
with torch.no_grad():
    loop = torch.cat([e(part) for e, part in zip(grouped_experts, tokens.split(counts))])
    torch.testing.assert_close(grouped_mlp(grouped_experts, tokens, counts), loop, rtol=1e-4, atol=1e-5)
print(f"{E} experts, {T_GROUPED} tokens: the grouped multiply equals the per-expert loop")


def best_time(fn, repeats=5 if QUICK else 20):
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


# %% tags=["nbval-ignore-output"]
t_loop = best_time(lambda: [e(part) for e, part in zip(grouped_experts, tokens.split(counts))])
t_grouped = best_time(lambda: grouped_mlp(grouped_experts, tokens, counts))
print(
    f"measured on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'CPU'}: per-expert loop "
    f"{t_loop * 1e3:.2f} ms, grouped (padded bmm) {t_grouped * 1e3:.2f} ms, ratio {t_loop / t_grouped:.2f}"
)
if device.type == "cpu":
    print("no GPU here: these are CPU timings; run this cell on a GPU for the launch-bound case")

# %% [markdown]
# ## 10. Inputs that cannot work
#
# Experts that do not split evenly over the ranks, a top-k larger than the number of experts and
# EP on a dense model each stop with a message that says what to change.

# %%
for bad in (
    lambda: local_experts(E + 1, EP, 0),  # 2 * EP + 1 experts never split over EP > 1 ranks
    lambda: GPTConfig(experts=4, top_k=5),
    lambda: cluster.run(lambda ctx: apply_ep(GPT(GPTConfig()), None)),
):
    try:
        bad()
        raise AssertionError("accepted")
    except Exception as error:  # a ValueError, on the ranks wrapped in the cluster's error
        assert "ValueError" in repr(error) or isinstance(error, ValueError), error
        print(str(error).strip().splitlines()[-1][:220])

# %%
cluster.close()

# %% [markdown]
# ## 11. Beyond the book: load balancing without an auxiliary loss
#
# The balance loss of section 7 works through the gradient: it is one more term that the
# optimizer trades against the model's own loss. Too weak, and the router still piles tokens onto
# a few experts; too strong, and the router's choices serve balance more than the task.
# DeepSeek-V3 (arXiv 2412.19437, section 2.1.2, after Wang et al. 2024, "Auxiliary-Loss-Free Load
# Balancing Strategy for Mixture-of-Experts") balances without that trade:
#
# - each expert i has a bias b_i, added to its score *only to pick the top k*; the weight that
#   multiplies the expert's output is still computed from the unbiased score, so for a given
#   choice of experts the layer's output and gradient are those of the plain router;
# - after every training step, b_i goes down by a fixed speed γ if expert i received more than the
#   mean number of tokens, and up by γ if it received fewer: b_i += γ · sign(mean − load_i).
#
# The bias is a buffer, never a parameter: no gradient reaches it and the optimizer never sees it.
# In the library it is the router's `selection_bias` (the one that skewed section 7's router);
# the router counts each expert's tokens during a step and `moe.update_selection_bias(model, γ)`
# applies the rule. (DeepSeek-V3 adds the bias to sigmoid scores, here it is the softmax
# probabilities; it also keeps a very small sequence-wise balance loss as a safeguard.)
#
# A toy run on one process, since balancing is not a distributed idea (with data parallelism the
# loads are summed over the ranks first, `sum_over_ranks`, so every replica moves its biases
# alike): one MoE layer, 8 experts, top-2, hidden size 16, fitting a fixed random MLP. Every input
# shares one direction `mu`, and the gate starts tilted towards it for expert 0, so expert 0 is in
# nearly every token's top 2: max/mean starts near E/k = 4. Three runs from the same weights and
# batches: (a) no balancing, (b) the balance loss with `aux_loss_coef = 0.01` (the Switch
# Transformer's value), (c) the bias with γ = 0.01.

# %%
E_TOY, H_TOY, STEPS_TOY, TOKENS_TOY, GAMMA, AUX_COEF = 8, 16, 100, 128, 0.01, 0.01  # 8 experts at any WORLD_SIZE


def balancing_run(balance: str, seed: int = SEED) -> dict:
    """Max/mean load and fitting loss per step; ``balance``: "none", "loss" or "bias"."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    teacher_a = torch.randn(H_TOY, 4 * H_TOY, generator=g) / H_TOY**0.5  # the function to fit
    teacher_b = torch.randn(4 * H_TOY, H_TOY, generator=g) / (4 * H_TOY) ** 0.5
    mu = torch.randn(H_TOY, generator=g)  # shared by every input
    toy = GPTConfig(hidden=H_TOY, experts=E_TOY, top_k=2, aux_loss_coef=AUX_COEF if balance == "loss" else 0.0)
    layer = MoE(H_TOY, toy, lambda: MLP(H_TOY))
    with torch.no_grad():
        layer.router.gate.weight[0] += 0.5 * mu / mu.norm()  # the skew: expert 0 first
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    run = {"imbalance": [], "loss": []}
    for _ in range(STEPS_TOY):
        x = mu + torch.randn(4, TOKENS_TOY // 4, H_TOY, generator=g)
        fit = F.mse_loss(layer(x), torch.tanh(x @ teacher_a) @ teacher_b)
        opt.zero_grad()
        (fit + auxiliary_loss(layer)).backward()  # auxiliary_loss: 0 unless aux_loss_coef > 0
        opt.step()
        load = layer.router.load.float()  # (token, choice) pairs per expert this step
        run["imbalance"].append((load.max() / load.mean()).item())
        run["loss"].append(fit.item())
        if balance == "bias":
            update_selection_bias(layer, GAMMA)  # reads the step's load and clears it
        layer.router.load = None  # the other runs: start the next step's count
    run["bias"] = layer.router.selection_bias.clone()
    return run


runs = {balance: balancing_run(balance) for balance in ("none", "loss", "bias")}
tail = {name: {key: sum(r[key][-20:]) / 20 for key in ("imbalance", "loss")} for name, r in runs.items()}
# What a router choosing its 2 experts uniformly at random measures, by chance alone.
draws = torch.rand(1000, TOKENS_TOY, E_TOY, generator=torch.Generator().manual_seed(SEED)).topk(2).indices
chance_load = F.one_hot(draws, E_TOY).sum((1, 2)).float()
chance = (chance_load.amax(-1) / chance_load.mean(-1)).mean().item()

# Measured at seeds 0-11 (mean of the last 20 of 100 steps): (a) 3.05-4.00, (b) 1.29-1.59,
# (c) 1.32-1.39, against 1.24 by chance; (c)'s fitting loss was 0.94-1.05 times (b)'s.
assert all(r["imbalance"][0] > 3 for r in runs.values())  # all three start piled up
assert tail["none"]["imbalance"] > 2.5  # (a) stays there
assert tail["loss"]["imbalance"] < 2.0 and tail["bias"]["imbalance"] < 1.5 < tail["none"]["imbalance"]
assert 1.15 < chance < 1.35
assert tail["bias"]["loss"] < 1.1 * tail["loss"]["loss"]  # balance without paying in loss
print(
    "max/mean load, mean of the last 20 steps: (a) no balancing > 2.5, (b) balance loss < 2.0, "
    "(c) loss-free bias < 1.5 (a random router: about 1.2 by chance)"
)
print(
    "(c)'s fitting loss is within 10% of (b)'s, and no gradient ever reached the bias:",
    not runs["bias"]["bias"].requires_grad,
)

fig = Figure(figsize=(10, 3.4), layout="constrained")
ax_load, ax_loss = fig.subplots(1, 2)
labels = {"none": "(a) no balancing", "loss": "(b) balance loss", "bias": "(c) loss-free bias"}
for name, r in runs.items():
    ax_load.plot(r["imbalance"], label=labels[name])
    ax_loss.plot(r["loss"], label=labels[name])
ax_load.axhline(chance, color="k", ls=":", lw=1, label="random router (chance)")
ax_load.set(xlabel="step", ylabel="max / mean load", title=f"load imbalance, E = {E_TOY}, top-2")
ax_loss.set(xlabel="step", ylabel="fitting loss (MSE)", yscale="log", title="loss")
ax_load.legend()
fig

# %% tags=["nbval-ignore-output"]
for name, t in tail.items():
    print(f"{labels[name]:<20} last 20 steps: max/mean {t['imbalance']:.2f}, loss {t['loss']:.4f}")
print(f"random router: max/mean {chance:.2f}")
print("(c)'s biases after", STEPS_TOY, "steps:", [round(b, 2) for b in runs["bias"]["bias"].tolist()])

# %% [markdown]
# In this run the bias reaches the chance level within about ten steps: each step moves it by
# γ whatever the gradient does, while the loss must first reshape the router's probabilities.
# The fitting losses hardly differ, since this toy needs little of its experts' capacity; at scale
# Wang et al. report a lower perplexity than with the balance loss, and DeepSeek-V3's ablation
# better scores on most benchmarks. γ sets both how fast the bias catches up and how much it
# jitters once there (each step still moves it by ±γ): DeepSeek-V3 uses 0.001 for most of its
# training and 0 at the end.

# %% [markdown]
# ## What to take away
#
# - An MoE layer has E feed-forwards and uses k per token: parameters grow E-fold, compute per
#   token stays about that of k MLPs (`count_params` against `active_params`).
# - EP places E/ep experts per rank; each MoE layer exchanges split sizes, then dispatches rows
#   with an uneven all-to-all, runs the local experts and combines with the reverse all-to-all.
#   The result is the one-process layer, to float32 rounding, forward, backward and in training.
# - EP goes with DP: the dense part is replicated and averaged over every rank with different
#   data; an expert's gradient is summed over its replicas and divided by that same number.
# - The busiest rank sets the pace: a skewed router shows up as load imbalance, which the
#   load-balancing loss (or DeepSeek-V3's selection bias) fights.
# - Node-limited routing (M groups per token; M = 4 nodes in DeepSeek-V3) caps how many ranks a
#   token is sent to, and the bytes drop accordingly.
# - Beyond the book: DeepSeek-V3 balances with a per-expert bias used only to choose, moved by a
#   fixed step against each expert's load after every step. In the toy run it balances as well as
#   the balance loss, at no cost in loss, and never enters the gradient.

# %% [markdown]
# ## Your turn
# Open [exercises/08_expert_parallelism_exercises.ipynb](../exercises/08_expert_parallelism_exercises.ipynb): write the router, the split sizes of the all-to-all, the dispatch and combine, and
# the gradient reduction of experts and dense parameters.
# Each exercise's `check(...)` cell grades it on the spot; `make grade NB=work/exercises/08_expert_parallelism_exercises.ipynb` grades
# the whole notebook from a terminal.
