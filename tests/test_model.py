"""The course model: exact parameter counts, FLOP counts and behaviour of both variants."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from ultrascale.model import (
    GPT,
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA3_405B,
    LLAMA_TINY,
    GPTConfig,
    Llama,
    LlamaConfig,
    active_params,
    attention_flops_per_token,
    build_model,
    count_params,
    hfu,
    lm_loss,
    matmul_params,
    mfu,
    rope_tables,
    training_flops,
)

torch.set_num_threads(1)


def book_formula(h, v, L):
    return h * v + L * (12 * h * h + 13 * h) + 2 * h


def numel(model):
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def test_gpt_matches_book_formula_for_the_course_size():
    config = GPTConfig(hidden=64, vocab_size=256, layers=2, heads=4)
    assert count_params(config) == 116_480
    assert numel(GPT(config)) == 116_480


@pytest.mark.parametrize("h,v,L,heads", [(32, 100, 1, 2), (48, 512, 3, 6), (128, 1000, 4, 8), (96, 50, 0, 4)])
def test_gpt_matches_book_formula_for_other_shapes(h, v, L, heads):
    config = GPTConfig(hidden=h, vocab_size=v, layers=L, heads=heads)
    assert count_params(config) == book_formula(h, v, L) == numel(GPT(config))


def test_gpt_ties_embedding_and_head():
    model = GPT(GPTConfig())
    assert model.head.weight is model.embed.weight


def test_llama3_published_sizes():
    assert count_params(LLAMA3_8B) == 8_030_261_248
    assert count_params(LLAMA3_70B) == 70_553_706_496
    assert count_params(LLAMA3_405B) == 405_853_388_800


@pytest.mark.parametrize(
    "config",
    [
        LLAMA_TINY,
        LlamaConfig(tie_embeddings=True),
        LlamaConfig(hidden=96, heads=6, kv_heads=3, ffn=200, layers=3, vocab_size=77),
        LlamaConfig(hidden=64, heads=4, kv_heads=4, ffn=128),  # plain multi-head attention
        LlamaConfig(hidden=64, heads=8, kv_heads=1, ffn=96),  # multi-query attention
    ],
)
def test_llama_analytic_count_equals_instantiated(config):
    assert count_params(config) == numel(Llama(config))


def test_untied_llama_has_separate_head():
    tied, untied = LlamaConfig(tie_embeddings=True), LlamaConfig(tie_embeddings=False)
    assert count_params(untied) - count_params(tied) == untied.hidden * untied.vocab_size
    assert Llama(untied).head.weight is not Llama(untied).embed.weight


def test_bad_shapes_give_actionable_errors():
    with pytest.raises(ValueError, match="divisible by heads"):
        GPTConfig(hidden=65, heads=4)
    with pytest.raises(ValueError, match="kv_heads"):
        LlamaConfig(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="attention"):
        GPTConfig(attention="flash")
    with pytest.raises(ValueError, match="recompute"):
        GPT(GPTConfig()).set_recompute("half")


@pytest.mark.parametrize("config", [GPTConfig(), LLAMA_TINY])
def test_forward_shape_and_loss(config):
    torch.manual_seed(0)
    model = build_model(config)
    idx = torch.randint(0, config.vocab_size, (2, 16))
    assert model(idx).shape == (2, 16, config.vocab_size)
    # at initialization the logits are near zero, so the loss is near log(vocab); 8 x 32 targets keep the
    # sampling noise of the mean well inside 0.1 (over 30 targets it reached 0.106 once in CI, unseeded)
    idx = torch.randint(0, config.vocab_size, (8, 33))
    loss = model.loss(idx[:, :-1], idx[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(float(config.vocab_size))).item()) < 0.1


@pytest.mark.parametrize("config", [GPTConfig(), LLAMA_TINY])
def test_model_is_causal(config):
    model = build_model(config)
    idx = torch.randint(0, config.vocab_size, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % config.vocab_size
    torch.testing.assert_close(model(idx)[0, :8], model(changed)[0, :8])


@pytest.mark.parametrize("config", [GPTConfig(), LLAMA_TINY])
def test_eager_and_sdpa_attention_agree(config):
    eager = build_model(config)
    sdpa = build_model(dataclasses.replace(config, attention="sdpa"))
    sdpa.load_state_dict(eager.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, 16))
    torch.testing.assert_close(eager(idx), sdpa(idx), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(mode):
    reference = GPT(GPTConfig())
    recomputed = GPT(GPTConfig()).set_recompute(mode)
    recomputed.load_state_dict(reference.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    reference.loss(idx, idx).backward()
    recomputed.loss(idx, idx).backward()
    for (name, p), q in zip(reference.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# ---------------------------------------------------------------------------------- FLOPs
def measured_training_flops(model, idx):
    with FlopCounterMode(display=False) as counter:
        model.loss(idx, idx).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("config", [GPTConfig(), LLAMA_TINY, LlamaConfig(tie_embeddings=True)])
def test_flop_formula_is_exact_for_matmuls(config):
    """FlopCounterMode counts matrix multiplies only: 2 FLOPs per multiply-add, backward twice forward."""
    seq, batch = 32, 2
    idx = torch.randint(0, config.vocab_size, (batch, seq))
    tokens = batch * seq
    expected = tokens * (6 * matmul_params(config) + attention_flops_per_token(config, seq))
    assert measured_training_flops(build_model(config), idx) == expected


def test_six_n_rule_is_close_on_gpt():
    """6N also charges the norms and biases (13h per layer + 2h), which do no matmul.

    They are 13h/(12h^2 + 13h) of a layer: 1.7% at h=64, and vanishing at real sizes,
    so we allow 2% here.
    """
    config, seq, batch = GPTConfig(), 32, 2
    idx = torch.randint(0, config.vocab_size, (batch, seq))
    measured = measured_training_flops(GPT(config), idx)
    predicted = training_flops(config, batch * seq, seq_len=seq)
    assert measured <= predicted <= 1.02 * measured


def test_attention_term_and_causal_half():
    c = LLAMA3_8B
    assert attention_flops_per_token(c, 4096) == 12 * 32 * 4096 * 4096
    assert attention_flops_per_token(c, 4096, causal=True) == 6 * 32 * 4096 * 4096
    # at its 8k training context, attention adds about a fifth to Llama 3 8B's 6N
    assert training_flops(c, 1) == 6 * 8_030_261_248 + 12 * 32 * 4096 * 8192
    assert training_flops(c, 1) / (6 * 8_030_261_248) == pytest.approx(1.267, abs=1e-3)


def test_mfu_and_hfu():
    c = LLAMA3_8B
    peak = 989e12  # H100 dense bf16
    tokens_per_s = peak / training_flops(c, 1)  # a rate that would use the whole chip
    assert mfu(tokens_per_s, c, peak) == pytest.approx(1.0)
    assert mfu(tokens_per_s / 2, c, peak) == pytest.approx(0.5)
    assert hfu(1000, c, peak, "full") / mfu(1000, c, peak) == pytest.approx(8 / 6)
    assert hfu(1000, c, peak, "none") == pytest.approx(mfu(1000, c, peak))
    # selective redoes only the attention-score forward: 4*L*h*seq per token
    attention_forward = 4 * 32 * 4096 * 8192
    selective = hfu(1000, c, peak, "selective") / mfu(1000, c, peak)
    assert selective == pytest.approx(1 + attention_forward / training_flops(c, 1))


# ------------------------------------------------------------------- shardable from outside
@pytest.mark.parametrize("config", [GPTConfig(hidden=64, heads=4), LlamaConfig(hidden=64, heads=4, kv_heads=2)])
def test_attention_with_a_slice_of_the_heads_is_a_slice_of_attention(config):
    """What tensor parallelism relies on: column-slice q, k, v by heads and row-slice out, and
    each shard is an ordinary Attention whose partial outputs add up to the full layer."""
    torch.manual_seed(0)
    attn = build_model(config).blocks[0].attn
    x = torch.randn(2, 12, config.hidden)
    cos, sin = rope_tables(12, config.head_dim, config.rope_theta)
    full = attn(x, cos, sin)
    d, shards = config.head_dim, 2
    q_rows, kv_rows = config.heads * d // shards, config.kv_heads * d // shards
    total = 0
    for r in range(shards):
        shard = copy.deepcopy(attn)
        for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            layer = getattr(shard, name)
            keep = slice(r * rows, (r + 1) * rows)
            layer.weight = nn.Parameter(layer.weight[keep])
            if layer.bias is not None:
                layer.bias = nn.Parameter(layer.bias[keep])
        shard.out.weight = nn.Parameter(shard.out.weight[:, r * q_rows : (r + 1) * q_rows])
        if shard.out.bias is not None:  # the bias is added once, after the partial sums
            shard.out.bias = nn.Parameter(torch.zeros_like(shard.out.bias) if r else shard.out.bias)
        total = total + shard(x, cos, sin)  # heads read from shapes: half of them here
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_attention_core_can_be_replaced_from_outside(recompute):
    """What context parallelism relies on: ``attn.core`` set on an instance is used in place of
    causal attention, gets K/V with their own (grouped-query) head count, and selective
    recomputation runs it again in backward."""
    config = LlamaConfig(hidden=64, heads=4, kv_heads=2, layers=2)
    torch.manual_seed(0)
    model = build_model(config).set_recompute(recompute)
    replaced = copy.deepcopy(model)
    calls = []

    def core(attn):
        def recorded(q, k, v):
            calls.append((q.shape[1], k.shape[1], v.shape[1]))
            return type(attn).core(attn, q, k, v)  # the default core, called from outside

        return recorded

    for block in replaced.blocks:
        block.attn.core = core(block.attn)
    idx = torch.randint(0, config.vocab_size, (2, 12))
    assert torch.equal(replaced(idx), model(idx))
    replaced.loss(idx, idx).backward()
    model.loss(idx, idx).backward()
    for (name, p), q in zip(model.named_parameters(), replaced.parameters()):
        assert torch.equal(p.grad, q.grad), name
    runs = {"none": 2, "selective": 3, "full": 3}[recompute]  # forward, loss forward, recomputation
    assert calls == [(4, 2, 2)] * config.layers * runs
    replaced.blocks[0].attn.core = lambda q, k, v: torch.zeros_like(q)
    assert not torch.allclose(replaced(idx), model(idx))


def test_positions_are_global():
    """RoPE takes the tokens' global positions, so a slice of the sequence is rotated as in the
    whole sequence, and shifting every position leaves attention (relative) unchanged."""
    cos, sin = rope_tables(16, 8, 10000.0)
    cos_tail, sin_tail = rope_tables(torch.arange(8, 16), 8, 10000.0)
    assert torch.equal(cos_tail, cos[8:]) and torch.equal(sin_tail, sin[8:])
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(idx, torch.arange(16) + 7), model(idx), rtol=1e-4, atol=1e-5)
    assert torch.equal(model(idx, torch.arange(16)), model(idx))
    assert not torch.allclose(model(idx, torch.arange(16).flip(0)), model(idx), atol=1e-3)


@pytest.mark.parametrize("config", [GPTConfig(layers=3), LlamaConfig(layers=3)])
def test_pipeline_stages_leave_out_embedding_norm_and_head(config):
    torch.manual_seed(0)
    model = build_model(config)
    idx = torch.randint(0, config.vocab_size, (2, 10))
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.blocks, first.norm, first.head = first.blocks[:1], None, None
    last.blocks, last.embed = last.blocks[1:], None
    hidden = first(idx)
    assert hidden.shape == (2, 10, config.hidden)
    assert torch.equal(last(hidden), model(idx))


# --------------------------------------------------------------------------- mixture of experts
MOE_CONFIGS = [
    GPTConfig(experts=4),
    GPTConfig(experts=8, top_k=2, layers=1),
    LlamaConfig(experts=4, top_k=2),
    LlamaConfig(experts=3, tie_embeddings=True),
]


@pytest.mark.parametrize("config", MOE_CONFIGS)
def test_moe_parameter_count_is_exact(config):
    dense = dataclasses.replace(config, experts=0, top_k=1)
    h, E, L = config.hidden, config.experts, config.layers
    expert = 8 * h * h + 5 * h if isinstance(config, GPTConfig) else 3 * h * config.ffn
    # each block trades its one feed-forward for a router (h x E, no bias) and E feed-forwards
    assert count_params(config) == count_params(dense) + L * (h * E + (E - 1) * expert)
    assert count_params(config) == numel(build_model(config))
    assert active_params(config) == count_params(dense) + L * (h * E + (config.top_k - 1) * expert)


@pytest.mark.parametrize("config", MOE_CONFIGS[:3])
def test_moe_flop_formula_is_exact_whatever_the_routing(config):
    """Every token goes through exactly top_k experts, so the matmul FLOPs do not depend on
    which experts the router picks (an expert that gets no token costs nothing)."""
    seq, batch = 16, 2
    idx = torch.randint(0, config.vocab_size, (batch, seq))
    expected = batch * seq * (6 * matmul_params(config) + attention_flops_per_token(config, seq))
    assert measured_training_flops(build_model(config), idx) == expected


def per_token_reference(moe, x):
    """The MoE output computed token by token, the slow obvious way."""
    weights, chosen, _ = moe.router(x)
    return torch.stack(
        [sum(w * moe.experts[int(e)](x[t]) for w, e in zip(weights[t], chosen[t])) for t in range(x.shape[0])]
    )


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_gathers_tokens_per_expert_like_a_per_token_loop(top_k):
    torch.manual_seed(0)
    model = GPT(GPTConfig(experts=4, top_k=top_k, layers=1))
    moe = model.blocks[0].mlp
    x = torch.randn(2, 8, 64)
    torch.testing.assert_close(moe(x).view(-1, 64), per_token_reference(moe, x.view(-1, 64)))


def test_router_weights_renormalised_for_top_k_above_one():
    from ultrascale.moe import Router

    torch.manual_seed(0)
    x = torch.randn(10, 64)
    w2, c2, probs = Router(64, 4, 2)(x)
    torch.testing.assert_close(w2.sum(-1), torch.ones(10))
    assert torch.equal(c2, probs.topk(2).indices)
    router = Router(64, 4, 1)
    w1, c1, probs = router(x)  # Switch: the probability itself, so the router gets a gradient
    torch.testing.assert_close(w1[:, 0], probs.max(-1).values)


def test_group_limited_routing_keeps_each_token_within_its_groups():
    from ultrascale.moe import Router

    torch.manual_seed(0)
    x = torch.randn(200, 64)
    free = Router(64, 8, 4, expert_groups=4)
    limited = Router(64, 8, 4, expert_groups=4, group_limit=2)
    limited.load_state_dict(free.state_dict())
    groups = lambda chosen: torch.tensor([len(set((c // 2).tolist())) for c in chosen])  # noqa: E731
    assert groups(limited(x)[1]).max() == 2 < groups(free(x)[1]).max()
    # the groups kept are those whose 4 / 2 = 2 best probabilities add up to the most
    probs = free(x)[2].view(200, 4, 2)
    best_groups = probs.sum(-1).topk(2, dim=-1).indices.sort(-1).values
    for chosen, kept in zip(limited(x)[1], best_groups):
        assert set((chosen // 2).tolist()) <= set(kept.tolist())


def test_group_limit_scores_a_group_by_the_sum_of_its_best_experts():
    """DeepSeek-V3: top_k / M experts per group summed, not the single best (DeepSeek-V2's rule).
    Group 0 holds the best expert (0.5) but group 1's two (0.3 + 0.3) add up to more."""
    from ultrascale.moe import limit_groups

    scores = torch.tensor([[0.5, 0.0, 0.3, 0.3]], dtype=torch.float64)
    kept = limit_groups(scores, groups=2, limit=1, top_k=2)
    assert torch.equal(kept.isfinite(), torch.tensor([[False, False, True, True]]))
    # one pick per group (top_k = limit): the best expert decides, 0.5 beats 0.3
    kept = limit_groups(scores, groups=2, limit=1, top_k=1)
    assert torch.equal(kept.isfinite(), torch.tensor([[True, True, False, False]]))
    # DeepSeek-V3's shape: 8 of 256 experts on at most 4 of 8 nodes, each node scored by its best 2
    torch.manual_seed(0)
    scores = torch.rand(16, 256, dtype=torch.float64)
    kept = limit_groups(scores, groups=8, limit=4, top_k=8).isfinite().view(16, 8, 32).all(-1)
    by_two = scores.view(16, 8, 32).topk(2, dim=-1).values.sum(-1)
    assert torch.equal(kept, torch.zeros_like(kept).scatter(1, by_two.topk(4, dim=-1).indices, True))


def test_balance_loss_is_one_when_even_and_reaches_the_training_loss():
    from ultrascale.moe import auxiliary_loss, balance_loss

    E, seq = 4, 8
    probs = torch.full((2 * seq, E), 1 / E)
    chosen = torch.arange(2 * seq).remainder(E).view(-1, 1)
    assert balance_loss(probs, chosen, E, 2).item() == pytest.approx(1.0)
    skewed = torch.zeros_like(chosen)  # everything to expert 0, which has prob 1
    assert balance_loss(torch.eye(E)[0].expand(2 * seq, E), skewed, E, 2).item() == pytest.approx(E)
    config = GPTConfig(experts=4, top_k=2, aux_loss_coef=0.01)
    model = GPT(config)
    idx = torch.randint(0, 256, (2, 16))
    loss = model.loss(idx, idx)
    aux = auxiliary_loss(model)
    assert aux.requires_grad and aux.item() > 0
    assert loss.item() == pytest.approx(lm_loss(model(idx), idx).item() + auxiliary_loss(model).item())


def test_moe_config_errors():
    with pytest.raises(ValueError, match="top_k=3 must be between 1 and experts=2"):
        GPTConfig(experts=2, top_k=3)
    with pytest.raises(ValueError, match="experts=-1"):
        GPTConfig(experts=-1)
    with pytest.raises(ValueError, match="expert_groups=3 must divide"):
        LlamaConfig(experts=4, expert_groups=3)
    with pytest.raises(ValueError, match="group_limit"):
        GPTConfig(experts=8, top_k=4, expert_groups=4, group_limit=1)
