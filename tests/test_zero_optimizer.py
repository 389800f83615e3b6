"""ZeRO behaves like the torch optimizer it wraps (a peer review's sharded-optimizer case).

The reference is always the same torch optimizer on ONE process, trained on the
concatenated batch of all ranks. ZeRO must match it with AdamW and weight decay on a
toy model that has every awkward case: frozen parameters (in the root and inside a
unit, and a wholly frozen unit), a parameter that never gets a gradient (2.0 must stay
2.0: a step on it would decay it to (1 - lr*wd)^t * 2), a parameter used only on some
steps and then only by some ranks' rows (it counts as having a gradient if any rank
gave it one: the concatenated batch used it), and a parameter dropped after a few steps
(its Adam step count must stop there). Then parameter groups, checkpoint/resume, and the
course GPT.

Tolerances: the toy runs in float64, so ranks and the single process differ only by the
order in which per-row gradients are summed (~1e-16 relative). Adam divides by sqrt(v),
which can magnify that for a near-zero gradient, but never beyond lr per step; measured
differences are ~1e-16 (toy) and ~1e-15 (GPT). We allow rtol 1e-10, atol 1e-12: far below a
wrong step count (bias correction changes a step by ~1e-3) or one decay step (lr*wd*w ~ 1e-3).
"""

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ultrascale import parity, train
from ultrascale.data import Batches
from ultrascale.model import GPT, GPTConfig
from ultrascale.parallel import ZeRO
from ultrascale.runtime import shared_cluster

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

STEPS, ROWS = 6, 3  # ROWS per rank; every rank gets the same number
ADAMW = dict(lr=1e-2, weight_decay=0.1)
TOL = dict(rtol=1e-10, atol=1e-12)  # float64: see the module docstring


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def cluster(request):
    return shared_cluster(request.param)


class Block(nn.Module):
    def __init__(self, h, spare=False):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(h), nn.Linear(h, h)
        # a bias per feature (a shift of all features alike would be erased by the norms
        # after it: a zero gradient, up to rounding, which Adam would magnify)
        self.spare = nn.Parameter(torch.linspace(0.1, 0.6, h)) if spare else None
        self.use_spare = True  # switched off after a few steps (see set_step)

    def forward(self, h):
        h = h + torch.tanh(self.fc(self.norm(h)))
        return h + self.spare if self.spare is not None and self.use_spare else h


class Toy(nn.Module):
    def __init__(self, h=6):
        super().__init__()
        self.embed = nn.Linear(4, h)
        self.frozen = nn.Parameter(torch.randn(h), requires_grad=False)
        self.blocks = nn.ModuleList([Block(h), Block(h, spare=True), Block(h)])
        self.blocks[0].fc.bias.requires_grad_(False)  # frozen inside a unit
        self.blocks[2].requires_grad_(False)  # a unit with nothing to train
        self.norm, self.head = nn.LayerNorm(h), nn.Linear(h, 2)
        self.unused = nn.Parameter(torch.full((5,), 2.0))  # never used: never a gradient
        self.side = nn.Linear(4, 2)  # only for the routed rows

    def forward(self, x, route):
        h = self.embed(x) + self.frozen
        for block in self.blocks:
            h = block(h)
        y = self.head(self.norm(h))
        if route.any():  # a rank without routed rows gives `side` no gradient
            y = y + route[:, None] * self.side(x)
        return y


FROZEN = [
    "frozen",
    "blocks.0.fc.bias",
    "blocks.2.norm.weight",
    "blocks.2.norm.bias",
    "blocks.2.fc.weight",
    "blocks.2.fc.bias",
]


def make_toy():
    torch.manual_seed(0)
    return Toy().double()


def set_step(model, step):
    model.blocks[1].use_spare = step < 3  # after 3 steps `spare` gets no gradient anywhere


def global_batch(step, n):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS * n, 4, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS * n, 2, generator=g, dtype=torch.float64)
    route = torch.zeros(ROWS * n, dtype=torch.bool)
    if step % 3 == 0:
        route[0] = True  # a row of rank 0 only
    if step % 3 == 2:
        route[-1] = True  # a row of the last rank only
    return x, y, route  # step % 3 == 1: nobody uses `side`


def groups_of(model):
    """The usual split: weight decay on matrices only, none on norms and biases (and a
    different lr, so that a piece stepped with the wrong group's options shows)."""
    params = list(model.parameters())  # frozen ones too, as one would pass to torch
    return [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 5e-3},
    ]


def toy_reference(n, groups=False, steps=STEPS):
    model = make_toy()
    opt = torch.optim.AdamW(groups_of(model) if groups else model.parameters(), **ADAMW)
    for step in range(steps):
        set_step(model, step)
        x, y, route = global_batch(step, n)
        F.mse_loss(model(x, route), y).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def toy_zero(ctx, stage, groups=False, scrambled=False):
    model = make_toy().to(ctx.device)  # seeded on the host, then moved, as every rank does
    if scrambled:  # weights that only a checkpoint can bring back
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.fill_(7.0)
    # At stages 1 and 2 `side` is a unit of its own, so that some ranks have no gradient
    # at all for a unit. Stage 3 gathers a unit's parameters in its forward, a collective:
    # every rank must run the same units, so there `side` stays in the root.
    units = list(model.blocks) + ([model.side] if stage < 3 else [])
    zero = ZeRO(
        model, stage, torch.optim.AdamW, units=units, param_groups=groups_of(model) if groups else None, **ADAMW
    )
    return model, zero


def toy_steps(ctx, model, zero, steps):
    for step in steps:
        set_step(model, step)
        x, y, route = (t.to(ctx.device) for t in global_batch(step, ctx.world_size))
        rows = slice(ROWS * ctx.rank, ROWS * (ctx.rank + 1))
        F.mse_loss(model(x[rows], route[rows]), y[rows]).backward()
        zero.step()
        zero.zero_grad()


def train_toy(ctx, stage, groups=False):
    model, zero = toy_zero(ctx, stage, groups)
    toy_steps(ctx, model, zero, range(STEPS))
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    return zero.full_state_dict(), requires_grad, zero.num_parameters


def assert_same(got, expected, what="ZeRO vs one process"):
    parity.assert_same(got, expected, what, tol=TOL)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_adamw_with_frozen_and_gradientless_parameters(cluster, stage):
    n = cluster.world_size
    expected, initial = toy_reference(n), make_toy().state_dict()
    trainable = sum(p.numel() for p in make_toy().parameters() if p.requires_grad)
    for params, requires_grad, num_parameters in cluster.run(train_toy, stage):
        assert_same(params, expected)
        assert torch.equal(params["unused"], torch.full((5,), 2.0, dtype=torch.float64)), "2.0 stays 2.0"
        for name in FROZEN:  # frozen: untouched, and still frozen
            assert torch.equal(params[name], initial[name]) and not requires_grad[name], name
        assert num_parameters == trainable, "frozen parameters stay out of the flat buffers"
        for name in ("side.weight", "blocks.1.spare", "head.weight"):
            assert not torch.equal(params[name], initial[name]), f"{name} was trained"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameter_groups(cluster, stage):
    expected = toy_reference(cluster.world_size, groups=True)
    without_groups = toy_reference(cluster.world_size)
    for params, _, _ in cluster.run(train_toy, stage, True):
        assert_same(params, expected)
    # the groups matter: without them the norms and biases end elsewhere
    assert not torch.allclose(expected["norm.bias"], without_groups["norm.bias"], **TOL)


def bad_groups(ctx):
    messages = []
    for make in (
        lambda m: [{"params": [m.head.weight]}],  # most are missing
        lambda m: [{"params": list(m.parameters())}, {"params": [m.head.bias]}],
        lambda m: [{"params": list(m.parameters()) + [torch.zeros(2, device=ctx.device)]}],
    ):
        model = make_toy().to(ctx.device)
        try:
            ZeRO(model, 1, torch.optim.AdamW, param_groups=make(model), **ADAMW)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_bad_parameter_groups_are_clear_errors(cluster):
    messages = cluster.run(bad_groups)[0]
    assert len(messages) == 3
    assert "no parameter group" in messages[0] and "unused" in messages[0]
    assert "more than one parameter group" in messages[1]
    assert "not a parameter of the model" in messages[2]


def checkpoint_and_resume(ctx, stage, groups, saved_at):
    """Train STEPS steps straight, and saved_at steps + save + a fresh ZeRO + load + the rest."""
    model, zero = toy_zero(ctx, stage, groups)
    toy_steps(ctx, model, zero, range(STEPS))
    straight = zero.full_state_dict()

    model, zero = toy_zero(ctx, stage, groups)
    toy_steps(ctx, model, zero, range(saved_at))
    checkpoint = io.BytesIO()  # through bytes, as to a file
    torch.save(zero.state_dict(), checkpoint)

    model, zero = toy_zero(ctx, stage, groups, scrambled=True)
    checkpoint.seek(0)
    zero.load_state_dict(torch.load(checkpoint, map_location=ctx.device))
    toy_steps(ctx, model, zero, range(saved_at, STEPS))
    return straight, zero.full_state_dict(), checkpoint.getvalue()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_and_resume(cluster, stage):
    """Saved after 2 steps: the root's pieces are split already (`unused`), block 1's
    split (`spare` dropped at step 3) happens after the resume, from loaded state."""
    expected = toy_reference(cluster.world_size, groups=True)
    for straight, resumed, _ in cluster.run(checkpoint_and_resume, stage, True, 2):
        for name in straight:  # the same arithmetic in the same order: bitwise
            assert torch.equal(resumed[name], straight[name]), name
        assert_same(resumed, expected)


def load_elsewhere(ctx, checkpoints, stage):
    model, zero = toy_zero(ctx, stage)
    try:
        saved = io.BytesIO(checkpoints[ctx.rank % len(checkpoints)])
        zero.load_state_dict(torch.load(saved, map_location=ctx.device))
    except ValueError as e:
        return str(e)
    return None


def test_checkpoint_from_another_world_size_or_stage_is_refused(cluster):
    n = cluster.world_size
    checkpoints = [c for _, _, c in cluster.run(checkpoint_and_resume, 1, False, 1)]
    for message in cluster.run(load_elsewhere, checkpoints, 2):
        assert message and "stage=1" in message and "stage=2" in message
    other = shared_cluster(5 - n)  # 2 <-> 3
    for message in other.run(load_elsewhere, checkpoints, 1):
        assert message and f"world_size={n}" in message


# --------------------------------------------------------------------------- the course GPT
CFG = GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16)
GPT_STEPS, GPT_DATA = 3, Batches(CFG, mbs=2, seed=0)
GPT_ADAMW = dict(lr=1e-3, weight_decay=0.1)


def make_gpt():
    torch.manual_seed(0)
    return GPT(CFG).double()


def gpt_groups(model):
    named = list(model.named_parameters())  # no decay on norms and biases (1-D), as usual
    return [
        {"params": [p for _, p in named if p.ndim >= 2]},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


def train_gpt(ctx, stage):
    model = make_gpt().to(ctx.device)
    zero = ZeRO(model, stage, torch.optim.AdamW, param_groups=gpt_groups(model), **GPT_ADAMW)
    train.run_steps(model, GPT_DATA.rank_stream(ctx.rank, ctx.world_size), GPT_STEPS, zero, device=ctx.device)
    return zero.full_state_dict()


@pytest.mark.parametrize("stage", [3])
def test_gpt_adamw_with_groups_equals_one_process(cluster, stage):
    model = make_gpt()
    opt = torch.optim.AdamW(gpt_groups(model), **GPT_ADAMW)
    expected = train.train(model, GPT_DATA.global_stream(cluster.world_size), GPT_STEPS, opt)
    for params in cluster.run(train_gpt, stage):
        assert_same(params, expected)
