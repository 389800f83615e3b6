"""Expert parallelism (parallel.expert_parallel): the MoE layer with its experts split over
ranks equals the one-process MoE layer, forward, backward and over training steps; with data
parallelism too; the all-to-alls move exactly the predicted bytes, and group-limited routing
moves fewer; bad inputs are refused.

Tolerances are ``parity.TOLERANCES`` (float32): each rank runs its experts on a different
batch of rows and the combine adds a token's k outputs in another order, so results differ
from one process in the last bits only. A token sent to the wrong expert, a lost weight or a
gradient averaged over the wrong ranks is off by orders of magnitude more.
"""

import pytest
import torch

from ultrascale.model import GPT, GPTConfig, LlamaConfig
from ultrascale.moe import apply_experts, grouped_mlp
from ultrascale.parallel.expert_parallel import (
    apply_ep,
    dispatch_plan,
    expert_parameter_names,
    local_experts,
    rank_load,
)
from ultrascale.parity.expert_runs import assert_ep_matches, ep_rank_run, layer_traffic, moe_model, one_process_run
from ultrascale.runtime import shared_cluster

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

torch.set_num_threads(1)


def config(experts=4, top_k=1, **kw):
    return GPTConfig(vocab_size=64, hidden=32, heads=2, layers=2, seq_len=16, experts=experts, top_k=top_k, **kw)


# --------------------------------------------------------------------------- parity
@pytest.mark.parametrize("ep,experts,top_k", [(1, 4, 2), (2, 4, 1), (2, 4, 2), (4, 8, 1), (4, 8, 2), (4, 4, 2)])
def test_ep_matches_one_process(ep, experts, top_k):
    """Logits, loss and gradients of one step, then weights after two SGD steps; E != ranks
    (two experts per rank) included."""
    c = config(experts, top_k)
    per_rank = shared_cluster(ep).run(ep_rank_run, c)
    assert_ep_matches(per_rank, one_process_run(c, ep))
    # each rank holds only its experts, named as in the whole model
    for rank, run in enumerate(per_rank):
        held = {int(n.split(".")[4]) for n in run["weights"] if ".experts." in n}
        assert held == set(local_experts(experts, ep, rank))


def test_ep_with_adam_load_balancing_loss_and_llama():
    for c, opt in [
        (config(4, 2, aux_loss_coef=0.05), "adam"),
        (
            LlamaConfig(
                vocab_size=64, hidden=32, heads=2, kv_heads=1, ffn=48, layers=1, seq_len=16, experts=4, top_k=2
            ),
            "sgd",
        ),
    ]:
        per_rank = shared_cluster(2).run(ep_rank_run, c, 2, opt)
        assert_ep_matches(per_rank, one_process_run(c, 2, optimizer=opt), opt, what=f"{type(c).__name__} {opt}")


def test_ep_with_data_parallelism_on_a_mesh():
    """dp=2 x ep=2: four ranks with different rows; dense gradients averaged over all four,
    expert gradients summed over the expert's two replicas and divided by four."""
    c = config(4, 2)
    per_rank = shared_cluster(4).run(ep_rank_run, c, 2, "sgd", mesh_sizes={"dp": 2, "ep": 2})
    assert_ep_matches(per_rank, one_process_run(c, 4))
    names = expert_parameter_names(GPT(c))
    assert names and all(".mlp.experts." in n for n in names)


def test_ep_when_one_rank_gets_every_token():
    """A selection bias that sends every token to expert 0: rank 1 receives nothing (empty
    all-to-all pieces), its experts get zero gradients, and parity still holds."""
    c, bias = config(4, 1), [10.0, 0.0, 0.0, 0.0]
    per_rank = shared_cluster(2).run(ep_rank_run, c, 1, "sgd", selection_bias=bias)
    assert_ep_matches(per_rank, one_process_run(c, 2, steps=1, selection_bias=bias))
    expert2 = per_rank[1]["grads"]["blocks.0.mlp.experts.2.fc.weight"]
    assert expert2 is not None and not expert2.any()


# --------------------------------------------------------------------------- the pieces
def test_dispatch_plan_sends_a_token_once_per_rank():
    chosen = torch.tensor([[0, 1], [3, 0], [2, 3], [1, 0]])  # 4 experts, 2 per rank
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    plan = dispatch_plan(chosen, weights, ep=2, per_rank=2)
    assert plan.send_counts == [3, 2]  # tokens 0, 1, 3 -> rank 0; 1, 2 -> rank 1
    assert plan.rows.tolist() == [0, 1, 3, 1, 2]
    assert plan.local_ids.tolist() == [[0, 1], [-1, 0], [1, 0], [1, -1], [0, 1]]
    assert torch.equal(plan.weights[1], torch.tensor([0.0, 0.3]))
    # one process, the same rows: the plan and apply_experts rebuild the MoE output
    experts = [torch.nn.Linear(3, 3) for _ in range(4)]
    x = torch.randn(4, 3)
    want = apply_experts(experts, x, chosen, weights)
    got = torch.zeros_like(x)
    for r, share in enumerate((slice(0, 3), slice(3, 5))):
        local = apply_experts(
            experts[2 * r : 2 * r + 2], x[plan.rows[share]], plan.local_ids[share], plan.weights[share]
        )
        got.index_add_(0, plan.rows[share], local)
    torch.testing.assert_close(got, want)


def test_rank_load_counts_choices_per_rank():
    assert rank_load(torch.tensor([[0, 1], [3, 0], [2, 3]]), experts=4, ep=2).tolist() == [3, 3]


def test_grouped_mlp_equals_the_per_expert_loop():
    torch.manual_seed(0)
    moe = GPT(config(4, 2)).blocks[0].mlp
    counts = [5, 0, 3, 7]
    x = torch.randn(sum(counts), 32)
    loop = torch.cat([e(part) for e, part in zip(moe.experts, x.split(counts))])
    torch.testing.assert_close(grouped_mlp(moe.experts, x, counts), loop, rtol=1e-5, atol=1e-6)


def logged_layer(ctx, c):
    """One MoE layer's forward and backward under a CommLogger (with the model's own gradient
    hooks: their all-reduce is not counted), and the predicted bytes."""
    model = apply_ep(moe_model(c, device=ctx.device), None)
    x = torch.randn(2 * 16, 32, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device).requires_grad_()
    return layer_traffic(model.blocks[0].mlp, x)


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_bytes_equal_the_prediction(ep):
    for run in shared_cluster(ep).run(logged_layer, config(8, 2)):
        assert run["logged"] == run["predicted"]
        forward, backward = run["logged"]
        assert set(forward) == {"ep routing", "ep dispatch", "ep combine"} and set(backward) == {"all_to_all_single"}
        assert forward["ep dispatch"] > 0


def test_group_limited_routing_removes_dispatch_traffic():
    """8 experts in 4 groups (one per rank), top-2: limited to 1 group, each token reaches one
    rank, so it is sent once instead of up to twice."""
    free = config(8, 2, expert_groups=4)
    limited = config(8, 2, expert_groups=4, group_limit=1)
    runs = {name: shared_cluster(4).run(logged_layer, c) for name, c in (("free", free), ("limited", limited))}
    for f, l in zip(runs["free"], runs["limited"]):
        assert sum(l["send"]) == 32 < sum(f["send"])  # rows sent: one per token
        assert l["logged"][0]["ep dispatch"] < f["logged"][0]["ep dispatch"] and l["logged"] == l["predicted"]


# --------------------------------------------------------------------------- errors
def refuse(ctx, c):
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 4 experts.*ep in \[1, 2, 4\]"):
        apply_ep(moe_model(c, device=ctx.device), None)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        apply_ep(GPT(GPTConfig()).to(ctx.device), None)
    model = apply_ep(moe_model(config(6, 2), device=ctx.device), None)
    with pytest.raises(ValueError, match="already applied"):
        apply_ep(model, None)
    return True


def test_bad_inputs_are_refused():
    assert all(shared_cluster(3).run(refuse, config(4, 2)))
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and experts=4"):
        config(4, 5)
    with pytest.raises(ValueError, match="ep=3 does not divide"):
        local_experts(8, 3, 0)
