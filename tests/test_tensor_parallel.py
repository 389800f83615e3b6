"""Tensor and sequence parallelism (parallel.tensor_parallel): parity with one process and
with PyTorch's ``parallelize_module``, the errors, and wrong answers that parity must catch.

Every run starts from the same weights and trains on the same seeded batches; TP does not
split the data, so every rank sees the whole batch. We compare the logits (gathered from
the vocabulary slices), the loss, every gradient (gathered to full shapes, by name) and the
weights after 3 SGD and 3 Adam steps.

Why float64 and ``parity.TOLERANCES``: TP sums the partial products of a matmul over
ranks (f*, g*) where one process sums them inside one matmul, so the additions are
associated differently; in float64 that rounding is ~1e-16 relative, and the float64
tolerances (1e-10 rtol for SGD and for one backward, 1e-8 for Adam, which magnifies
last-bit differences of near-zero gradients) can only be met by the right mathematics.
The weights are perturbed from their initialisation (biases and norm weights away from
0 and 1), so a bias added tp times or a norm gradient left unsummed shows.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from ultrascale.comm.functional import f_star
from ultrascale.data import Batch, Batches
from ultrascale.model import GPT, GPTConfig, Llama, LlamaConfig
from ultrascale.parallel.mesh import init_mesh
from ultrascale.parallel.tensor_parallel import RowParallelLinear
from ultrascale.parallel.tensor_parallel import GPT_PLAN, LLAMA_PLAN, apply_tp, full_gradients, full_weights
from ultrascale.parallel.timeline import Timeline
from ultrascale.parallel.vocab_parallel import VocabParallelLogits
from ultrascale.parity import assert_same, device_mesh_1d, dtensor_tp, first_step_and_train, max_difference, perturbed
from ultrascale.runtime import shared_cluster

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

# 12 heads, FFN 192, vocabulary 96 and 12 tokens: tp = 2, 3 and 4 all divide them.
GPT_CFG = GPTConfig(vocab_size=96, hidden=48, heads=12, layers=2, seq_len=12)
# Grouped-query attention with 2 K/V heads: tp=2 works, tp=4 is refused.
LLAMA_CFG = LlamaConfig(vocab_size=96, hidden=48, heads=4, kv_heads=2, ffn=96, layers=2, seq_len=12)
CONFIGS = {"gpt": GPT_CFG, "llama": LLAMA_CFG}
STEPS = 3
DT = torch.float64


def fresh_model(cfg):
    torch.manual_seed(0)
    return perturbed((GPT if isinstance(cfg, GPTConfig) else Llama)(cfg).to(DT))


def data(cfg):
    return Batches(cfg, mbs=2, seed=0)


# --------------------------------------------------------------------------- on the ranks
def ours(ctx, name, sp, optimizer, tamper=None):
    mesh = init_mesh(ctx, tp=ctx.world_size)
    model = apply_tp(fresh_model(CONFIGS[name]).to(ctx.device), mesh, sequence_parallel=sp)
    if tamper is not None:
        tamper(model)
    out = first_step_and_train(
        model,
        data(CONFIGS[name]),
        STEPS,
        optimizer,
        full_gradients=full_gradients,
        full_logits=VocabParallelLogits.full_tensor,
        full_weights=full_weights,
        device=ctx.device,
    )
    out["local logits"] = model(data(CONFIGS[name]).global_batch(0).inputs.to(ctx.device)).shape[-1]
    out["tied"] = model.head.weight is model.embed.weight
    out["names"] = [n for n, _ in model.named_parameters()]
    return out


def pytorch(ctx, name, sp, optimizer):
    model = dtensor_tp(fresh_model(CONFIGS[name]).to(ctx.device), device_mesh_1d(ctx), sequence_parallel=sp)
    # loss_parallel: F.cross_entropy on vocabulary-sharded DTensor logits, forward and backward
    return first_step_and_train(
        model, data(CONFIGS[name]), STEPS, optimizer, loss_context=loss_parallel, device=ctx.device
    )


def single_process(name, optimizer):
    cfg = CONFIGS[name]
    model = fresh_model(cfg)
    out = first_step_and_train(model, data(cfg), STEPS, optimizer)
    out["names"] = [n for n, _ in model.named_parameters()]
    return out


_REFERENCES = {}


def reference(name, optimizer):
    if (name, optimizer) not in _REFERENCES:
        _REFERENCES[name, optimizer] = single_process(name, optimizer)
    return _REFERENCES[name, optimizer]


def assert_matches(got, want, what, optimizer):
    assert_same(got["logits"], want["logits"], f"{what} logits", optimizer=None)
    assert_same(got["loss"], want["loss"], f"{what} loss", optimizer=None)
    assert_same(got["grads"], want["grads"], f"{what} gradients", optimizer=None)
    assert_same(got["weights"], want["weights"], f"{what} weights after {STEPS} steps", optimizer=optimizer)


# --------------------------------------------------------------------------- parity
CASES = [("gpt", 2), ("gpt", 3), ("gpt", 4), ("llama", 2)]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name,tp", CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_same_as_one_process(name, tp, sp, optimizer):
    want = reference(name, optimizer)
    results = shared_cluster(tp).run(ours, name, sp, optimizer)
    for rank, got in enumerate(results):
        assert_matches(got, want, f"{name} tp={tp} sp={sp} rank {rank}", optimizer)
        # Names as in the unsharded model; the full logits exist only when gathered for the check.
        assert got["names"] == want["names"]
        assert got["local logits"] == CONFIGS[name].vocab_size // tp
    assert all(r["tied"] for r in results) == (name == "gpt")  # GPT's embed and head share one shard


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_same_as_pytorch_parallelize_module(sp):
    """parallelize_module with the same layout (vocabulary-parallel embedding and head,
    loss_parallel) against ours and against one process: three runs, one answer."""
    cluster = shared_cluster(2)
    want = reference("gpt", "sgd")
    torch_results = cluster.run(pytorch, "gpt", sp, "sgd")
    our_results = cluster.run(ours, "gpt", sp, "sgd")
    for theirs, mine in zip(torch_results, our_results):
        assert_matches(theirs, want, f"parallelize_module sp={sp}", "sgd")
        assert_matches(mine, theirs, f"ours against parallelize_module sp={sp}", "sgd")


def test_llama_sequence_parallel_same_as_pytorch():
    torch_results = shared_cluster(2).run(pytorch, "llama", True, "adam")
    assert_matches(torch_results[0], reference("llama", "adam"), "parallelize_module Llama tp+sp", "adam")


def _recompute_everything(model):
    model.set_recompute("full")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_with_full_recomputation(sp):
    """Checkpointing re-runs each block's forward, collectives included, inside backward."""
    got = shared_cluster(2).run(ours, "llama", sp, "sgd", _recompute_everything)[0]
    assert_matches(got, reference("llama", "sgd"), f"recompute=full sp={sp}", "sgd")


# --------------------------------------------------------------------------- wrong answers
class BiasOnEveryRank(RowParallelLinear):
    """The classic mistake: the bias added before the all-reduce, so it counts tp times."""

    def forward(self, x):
        return f_star(F.linear(x, self.weight, self.bias), self.group)


def _bias_on_every_rank(model):
    for block in model.blocks:
        block.attn.out.__class__ = BiasOnEveryRank


def _forget_norm_gradient_sum(model):
    for p in model.parameters():
        if hasattr(p, "_tp_grad_sync"):
            p._tp_grad_sync.remove()


@pytest.mark.parametrize(
    "tamper,sp,wrong",
    [(_bias_on_every_rank, False, "logits"), (_forget_norm_gradient_sum, True, "grads")],
    ids=["bias-on-every-rank", "sp-norm-gradients-not-summed"],
)
def test_parity_catches_wrong_answers(tamper, sp, wrong):
    want = reference("gpt", "sgd")
    got = shared_cluster(2).run(ours, "gpt", sp, "sgd", tamper)[0]
    with pytest.raises(AssertionError):
        assert_matches(got, want, "tampered", "sgd")
    assert max_difference(got[wrong], want[wrong]) > 1e-4  # far outside the float64 tolerance


# --------------------------------------------------------------------------- errors
def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def refusals(ctx):
    n = ctx.world_size

    def on_device(cfg):
        return fresh_model(cfg).to(ctx.device)

    gpt6 = GPTConfig(vocab_size=96, hidden=48, heads=6, layers=1, seq_len=12)
    odd_vocab = GPTConfig(vocab_size=98, hidden=48, heads=12, layers=1, seq_len=12)
    odd_ffn = LlamaConfig(vocab_size=96, hidden=48, heads=4, kv_heads=4, ffn=90, layers=1, seq_len=12)
    untouched = on_device(gpt6)
    out = {
        "kv_heads": _error(lambda: apply_tp(on_device(LLAMA_CFG))),
        "heads": _error(lambda: apply_tp(untouched)),
        "vocab": _error(lambda: apply_tp(on_device(odd_vocab))),
        "ffn": _error(lambda: apply_tp(on_device(odd_ffn))),
        "plan": _error(lambda: apply_tp(on_device(GPT_CFG), plan=LLAMA_PLAN)),
        "style": _error(lambda: apply_tp(on_device(GPT_CFG), plan={"blocks.*.norm1": "colwise"})),
        "unknown": _error(lambda: apply_tp(on_device(GPT_CFG), plan={"head": "columnwise"})),
        "tied": _error(lambda: apply_tp(on_device(GPT_CFG), plan={"embed": "vocab_embedding"})),
        "sp without vocab": _error(
            lambda: apply_tp(
                on_device(GPT_CFG), sequence_parallel=True, plan={k: v for k, v in GPT_PLAN.items() if "vocab" not in v}
            )
        ),
        "sp attention": _error(
            lambda: apply_tp(
                on_device(GPT_CFG),
                sequence_parallel=True,
                plan={k: v for k, v in GPT_PLAN.items() if k != "blocks.*.attn"},
            )
        ),
    }
    out["untouched"] = type(untouched.blocks[0].attn.q).__name__  # a refusal swaps nothing
    timeline = Timeline(ctx.rank, device=ctx.device)
    model = apply_tp(on_device(GPT_CFG), sequence_parallel=True, timeline=timeline)
    batch = data(GPT_CFG).global_batch(0).to(ctx.device)
    out["sequence"] = _error(lambda: model(batch.inputs[:, : n + 1]))
    # Explicit global positions are used as given (e.g. context parallelism gives its own).
    positions = torch.arange(GPT_CFG.seq_len, device=ctx.device)
    out["positions"] = (Batch(batch.inputs, batch.targets, positions).loss(model) - batch.loss(model)).abs().item()
    batch.loss(model).backward()
    out["bars"] = sorted({row["name"] for row in timeline.rows()})
    return out


def test_refusals_name_the_fix():
    out = shared_cluster(4).run(refusals)[0]
    assert out["kv_heads"] == "tp=4 does not divide the 2 K/V heads of this Llama config: choose tp in {1, 2}"
    assert out["heads"] == "tp=4 does not divide the 6 attention heads of this GPT config: choose tp in {1, 2, 3, 6}"
    assert "98 vocabulary entries" in out["vocab"] and "{1, 2}" in out["vocab"]
    assert "90 features of blocks.0.mlp.gate" in out["ffn"]
    assert "'blocks.*.mlp.gate' matches no module" in out["plan"]
    assert "needs an nn.Linear" in out["style"]
    assert "columnwise" in out["unknown"] and "vocab_head" in out["unknown"]
    assert "shard both" in out["tied"]
    assert "'vocab_embedding' and 'vocab_head'" in out["sp without vocab"]
    assert "'blocks.0.attn' as 'parallel_region'" in out["sp attention"]
    assert out["untouched"] == "Linear"
    assert "5 tokens do not split evenly" in out["sequence"] and "divisible by 4" in out["sequence"]
    assert out["positions"] == 0.0
    assert out["bars"] == [f"{d} block {i}" for d in ("backward", "forward") for i in (0, 1)]  # timeline=


# --------------------------------------------------------------------------- the parallel cross-entropy alone
def parallel_cross_entropy(ctx, logits, targets):
    from ultrascale.parallel.vocab_parallel import vocab_parallel_cross_entropy

    logits, targets = logits.to(ctx.device), targets.to(ctx.device)
    width = logits.shape[-1] // ctx.world_size
    local = logits[..., ctx.rank * width : (ctx.rank + 1) * width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, ctx.rank * width)
    loss.backward()
    return loss.detach(), local.grad


def test_parallel_cross_entropy_with_ignored_targets():
    """Against F.cross_entropy of the full logits, in float64: loss and gradient of every
    rank's slice; large logits (exp would overflow without the shared maximum) and targets
    set to ignore_index (-100), which count neither in the sum nor in the mean."""
    g = torch.Generator().manual_seed(0)
    logits = 50 * torch.randn(4, 5, 96, dtype=DT, generator=g)
    targets = torch.randint(0, 96, (4, 5), generator=g)
    targets[0, :3] = -100
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.flatten(0, 1), targets.flatten())
    want.backward()
    results = shared_cluster(3).run(parallel_cross_entropy, logits, targets)
    assert_same(torch.cat([grad for _, grad in results], dim=-1), full.grad, "dloss/dlogits", optimizer=None)
    for loss, _ in results:
        assert_same(loss, want.detach(), "loss", optimizer=None)


# --------------------------------------------------------------------------- SP memory
def saved_per_rank(ctx, sp, regather, tensor_parallel=True):
    """Bytes autograd saves in one forward, and the most tokens among saved hidden states
    (tensors h wide: (b, s, h) or the (b*s, h) view a linear layer saves)."""
    from ultrascale.memory import saved_activation_bytes

    model = fresh_model(GPT_CFG).float().to(ctx.device)
    if tensor_parallel:
        apply_tp(model, init_mesh(ctx, tp=ctx.world_size), sequence_parallel=sp, regather_in_backward=regather)
    inputs = data(GPT_CFG).global_batch(0).inputs.to(ctx.device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    lengths = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and t.shape[-1] == GPT_CFG.hidden:
            lengths.append(t.numel() // GPT_CFG.hidden // len(inputs))  # tokens per sequence
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(inputs)
    logits.float().sum().backward()  # the regathered inputs serve backward
    return saved_activation_bytes(model, inputs), max(lengths)


@pytest.mark.parametrize("tp", [2, 3])  # (at tp=4 the MLP's 4h/tp columns are h wide too)
def test_sequence_parallel_saves_a_slice_of_every_hidden_state(tp):
    """With SP and regathering, every saved hidden state holds s/tp tokens and the total
    is within 5% of one process's over tp (Korthikanti et al.: s*b*h*34/t per layer)."""
    whole, seq = shared_cluster(tp).run(saved_per_rank, False, False, False)[0]
    assert seq == GPT_CFG.seq_len
    regathered, longest = shared_cluster(tp).run(saved_per_rank, True, True)[0]
    assert longest == GPT_CFG.seq_len // tp
    assert abs(regathered / (whole / tp) - 1) < 0.05, (regathered, whole / tp)
    kept, longest = shared_cluster(tp).run(saved_per_rank, True, False)[0]
    assert longest == GPT_CFG.seq_len and kept > regathered  # the gathered input saved whole
    tp_only, _ = shared_cluster(tp).run(saved_per_rank, False, False)[0]
    assert tp_only > kept


def test_choosing_a_tp_degree():
    from ultrascale.parallel.tensor_parallel import choose_tp, tp_degrees

    gpt, llama = GPT(GPT_CFG), Llama(LLAMA_CFG)
    assert tp_degrees(gpt) == [1, 2, 3, 4, 6, 12]  # 12 heads, FFN 192, vocabulary 96
    assert tp_degrees(llama) == [1, 2]  # 2 K/V heads
    assert [choose_tp(gpt, w, seq=12) for w in (2, 3, 4, 6, 8)] == [2, 3, 4, 6, 4]
    with pytest.raises(ValueError, match="WORLD_SIZE=5"):
        choose_tp(gpt, 5)
    with pytest.raises(ValueError, match=r"allow tp in \[2\]"):
        choose_tp(llama, 3)
