"""ZeRO-1/2/3 (NB03): parity with plain DP + Adam and with FSDP2, measured state bytes
against the book's formulas, all-gather counts and communication volume.

Tolerances: ZeRO averages gradients with a reduce-scatter, DP with an all-reduce and
FSDP2 with its own reduce-scatter over per-parameter shards; each sums the ranks'
fp32 gradients in its own order, so gradients differ in the last bits. Adam divides by
sqrt(v), which can magnify a last-bit difference for near-zero gradients, but each
step moves a weight by at most about lr = 1e-3. Measured differences after 3 steps
are ~3e-7; we allow 1e-5 (1% of one step). Adam hides a wrong gradient *scale*
(it is scale-invariant), so SGD runs check the averaging too, at the DP tolerance.
"""

import pytest
import torch
import torch.nn.functional as F

from ultrascale.comm import CommLogger
from ultrascale.memory import zero_formula_bytes
from ultrascale.model import count_params
from ultrascale.parallel import NaiveDataParallel, ZeRO
from ultrascale.parallel.zero import GRADIENT_FLAGS
from ultrascale.parity import assert_same, device_mesh_1d, fsdp2
from ultrascale.train import OPTIMIZERS, run_steps, train
from dp_common import CFG, DATA, STEPS, cluster, fresh_model  # noqa: F401  (cluster is a fixture)

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]


def my_batches(ctx):
    return DATA.rank_stream(ctx.rank, ctx.world_size)


def train_dp(ctx, opt_name, grad_acc=1):
    """The reference: plain data parallelism with the optimizer on full tensors."""
    model = fresh_model().to(ctx.device)
    dp = NaiveDataParallel(model)
    return train(
        model,
        my_batches(ctx),
        STEPS,
        opt_name,
        grad_acc=grad_acc,
        module=dp,
        no_sync=dp.no_sync,
        after_backward=dp.finish_gradient_synchronization,
        device=ctx.device,
    )


def train_zero(ctx, stage, opt_name, prefetch=True, grad_acc=1, recompute="none"):
    model = fresh_model().set_recompute(recompute).to(ctx.device)
    cls, kwargs = OPTIMIZERS[opt_name]
    zero = ZeRO(model, stage=stage, optimizer_cls=cls, prefetch=prefetch, **kwargs)
    per_step, flag_calls = [], []
    for step in range(STEPS):
        with CommLogger() as log:
            run_steps(model, my_batches(ctx), 1, zero, grad_acc=grad_acc, first_step=step, device=ctx.device)
        per_step.append(log.collective_elements())
        flag_calls.append(log.totals().get(GRADIENT_FLAGS, {}).get("calls", 0))
    state = zero.state_bytes()
    return {
        "params": zero.full_state_dict(),
        "per_step": per_step,
        "flag_calls": flag_calls,
        "state": state,
        "formula": zero_formula_bytes(zero, k=12),
        "padded": [u.padded for u in zero.all_units],
        "numel": [u.numel for u in zero.all_units],
    }


def train_fsdp2(ctx):
    model = fsdp2(fresh_model().to(ctx.device), device_mesh_1d(ctx))  # the same units as ours: each block, the root
    return train(model, my_batches(ctx), STEPS, "adam", device=ctx.device)


@pytest.fixture(scope="module")
def references(cluster):
    return {name: cluster.run(train_dp, name)[0] for name in ("adam", "sgd")}


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_equals_plain_dp(cluster, references, stage, opt_name):
    results = cluster.run(train_zero, stage, opt_name)
    for r in results:  # every rank ends with the same full parameters
        assert_same(r["params"], references[opt_name], f"ZeRO-{stage}", optimizer=opt_name)


def test_zero3_without_prefetch_and_with_accumulation(cluster):
    expected = cluster.run(train_dp, "sgd", 2)[0]
    assert_same(cluster.run(train_zero, 3, "sgd", False, 2)[0]["params"], expected, "ZeRO-3 no prefetch")
    assert_same(cluster.run(train_zero, 2, "sgd", True, 2)[0]["params"], expected, "ZeRO-2 accumulation")


def test_zero3_with_full_recomputation(cluster, references):
    """Checkpointing re-runs each block's forward inside backward: the hooks must neither
    free the parameters it needs nor prefetch for a forward that is not coming."""
    out = cluster.run(train_zero, 3, "sgd", True, 1, "full")[0]
    assert_same(out["params"], references["sgd"], "ZeRO-3 with recomputation")
    assert out["per_step"][0]["all_gather"] == 1 + 2 * CFG.layers - 1


def test_zero_equals_fsdp2(cluster):
    fsdp = cluster.run(train_fsdp2, timeout=240)[0]
    for stage in (1, 3):
        assert_same(
            cluster.run(train_zero, stage, "adam")[0]["params"], fsdp, f"ZeRO-{stage} vs FSDP2", optimizer="adam"
        )


def test_state_bytes_match_the_formulas(cluster):
    """fp32 on CPU: parameters 4 B, gradients 4 B, k = 12 (fp32 master 4 + Adam m 4 + v 4)."""
    n = cluster.world_size
    measured = {stage: cluster.run(train_zero, stage, "adam")[0] for stage in (0, 1, 2, 3)}
    psi = count_params(CFG)
    units = len(measured[0]["padded"])
    for stage, out in measured.items():
        assert sum(out["numel"]) == psi
        total, formula = sum(out["state"].values()), sum(out["formula"].values())
        # Padding adds at most n - 1 elements per unit to each kind of state, and Adam
        # keeps a 4-byte step counter per unit; the formula has neither.
        slack = units * (n - 1) * (4 + 4 + 12) + units * 4
        assert 0 <= total - formula <= slack, (stage, out["state"], out["formula"])
    totals = [sum(measured[s]["state"].values()) for s in (0, 1, 2, 3)]
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0] / (n - 0.5)


def test_communication_volume_and_all_gather_count(cluster):
    """ZeRO-1/2 move 2Ψ per step (reduce-scatter + all-gather); ZeRO-3 about 3Ψ."""
    for stage in (1, 2, 3):
        out = cluster.run(train_zero, stage, "sgd")[0]
        steps = out["per_step"]
        assert all(s == steps[0] for s in steps), "every step communicates the same"
        step, padded = steps[0], out["padded"]  # padded[0] is the root unit
        psi_pad = sum(padded)
        # Besides the flat buffers, one all-reduce of one flag per parameter tensor says
        # which parameters got a gradient on any rank; it is logged under its own name.
        assert "all_reduce" not in step and out["flag_calls"] == [1] * STEPS
        assert step["reduce_scatter elements"] == psi_pad
        if stage < 3:
            assert step["all_gather elements"] == psi_pad and step["elements"] == 2 * psi_pad
            assert step["all_gather"] == len(padded)  # one per unit, after the step
        else:
            blocks = CFG.layers
            # forward gathers every unit; backward regathers every block but the last
            # (kept from forward); the root stays gathered from forward to backward.
            assert step["all_gather"] == 1 + blocks + (blocks - 1)
            assert step["all_gather"] - len(padded) == blocks - 1 == (2 * blocks - 1) - blocks
            again = psi_pad - padded[0] - padded[-1]
            assert step["all_gather elements"] == psi_pad + again
            assert step["elements"] == 3 * psi_pad - padded[0] - padded[-1]


def comm_logger_bytes(ctx):
    model = fresh_model().to(ctx.device)
    zero = ZeRO(model, stage=3, optimizer_cls=torch.optim.SGD, lr=0.1)
    with CommLogger() as log:
        DATA.rank_batch(ctx.rank, ctx.world_size, 0).to(ctx.device).loss(model).backward()
        zero.step()
    flat_buffers = sum(e.bytes_sent for e in log.events if e.op != GRADIENT_FLAGS)
    return flat_buffers, log.collective_elements()["elements"]


def test_comm_logger_bytes_are_the_ring_volume_of_the_elements(cluster):
    logged, elements = cluster.run(comm_logger_bytes)[0]
    n = cluster.world_size
    # A ring collective on K bytes sends (n-1)/n of K per rank; fp32 is 4 bytes.
    assert logged == pytest.approx(4 * elements * (n - 1) / n, rel=1e-6)


def zero3_memory_and_eval(ctx):
    model = fresh_model().to(ctx.device)
    zero = ZeRO(model, stage=3, param_dtype=torch.bfloat16, lr=1e-3)
    at_rest = zero.state_bytes()["parameters"]
    batch = DATA.rank_batch(ctx.rank, ctx.world_size, 0).to(ctx.device)
    with torch.no_grad():
        logits = model(batch.inputs)
    after_eval = zero.state_bytes()["parameters"]
    batch.loss(model).backward()
    zero.step()
    return at_rest, after_eval, zero.state_bytes(), zero_formula_bytes(zero, k=12), logits.dtype


def test_zero3_keeps_only_shards_and_bf16_gives_the_books_widths(cluster):
    at_rest, after_eval, state, formula, dtype = cluster.run(zero3_memory_and_eval)[0]
    n = cluster.world_size
    assert dtype == torch.bfloat16
    assert at_rest == after_eval, "an inference forward must free what it gathered"
    # bf16 parameters and gradients (2 B each) and k = 12: the book's (2Ψ + 2Ψ + 12Ψ) / Nd
    psi = count_params(CFG)
    assert formula == pytest.approx(
        {"parameters": 2 * psi / n, "gradients": 2 * psi / n, "optimizer states": 12 * psi / n}
    )
    for key in formula:
        assert 0 <= state[key] - formula[key] <= 3 * (n - 1) * 12 + 12, key


def sequential_zero3_vs_dp(ctx):
    """Any module, with units chosen by hand and no root parameters left over."""

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.GELU(), torch.nn.Linear(7, 3)).to(ctx.device)

    g = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(5, 4, generator=g).to(ctx.device), torch.randn(5, 3, generator=g).to(ctx.device)
    ours, ref = make(), make()
    zero = ZeRO(ours, stage=3, units=[ours[0], ours[2]], optimizer_cls=torch.optim.SGD, lr=0.1)
    dp = NaiveDataParallel(ref)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(STEPS):
        F.mse_loss(ours(x), y).backward()
        zero.step()
        zero.zero_grad()
        F.mse_loss(dp(x), y).backward()
        dp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return zero.full_state_dict(), {n: p.detach() for n, p in ref.named_parameters()}, zero.root


def test_zero3_on_any_module_with_chosen_units(cluster):
    ours, ref, root = cluster.run(sequential_zero3_vs_dp)[0]
    assert root is None
    assert_same(ours, ref, "ZeRO-3 on a Sequential")


def test_bad_stage_is_a_clear_error():
    with pytest.raises(ValueError, match="stage"):
        ZeRO(torch.nn.Linear(2, 2), stage=4)


def apply_on_a_mesh(ctx):
    """apply_zero and apply_data_parallel over a mesh's dp axis, with the course plan and
    with a hand-written one, train exactly like ZeRO and DP built directly."""
    from ultrascale.parallel import apply_data_parallel, apply_zero, init_mesh
    from ultrascale.parallel.zero import PLAN, units_of

    mesh = init_mesh(ctx, dp=ctx.world_size)
    model = fresh_model().to(ctx.device)
    assert units_of(model, PLAN) == list(model.blocks)
    assert units_of(model, {"blocks.1": "unit"}) == [model.blocks[1]]
    zero = apply_zero(model, mesh, stage=3, plan={"blocks.*": "unit"}, optimizer_cls=torch.optim.SGD, lr=0.1)
    assert isinstance(zero, torch.nn.Module) and zero is model  # every apply_* returns the model it changed
    zero = model.zero_optimizer
    run_steps(model, my_batches(ctx), STEPS, zero, device=ctx.device)
    plain = fresh_model().to(ctx.device)
    dp = apply_data_parallel(plain, mesh, kind="overlapped")
    expected = train(
        plain,
        my_batches(ctx),
        STEPS,
        "sgd",
        module=dp,
        after_backward=dp.finish_gradient_synchronization,
        device=ctx.device,
    )
    return zero.full_state_dict(), expected, len(zero.units)


def test_apply_zero_and_data_parallel_on_a_mesh(cluster):
    ours, expected, units = cluster.run(apply_on_a_mesh)[0]
    assert units == CFG.layers
    assert_same(ours, expected, "apply_zero vs apply_data_parallel")


def test_apply_functions_reject_what_they_cannot_do():
    from ultrascale.parallel import apply_data_parallel
    from ultrascale.parallel.zero import units_of

    with pytest.raises(ValueError, match="kind="):
        apply_data_parallel(torch.nn.Linear(2, 2), kind="fast")
    with pytest.raises(ValueError, match="no plan"):
        apply_data_parallel(torch.nn.Linear(2, 2), plan={"*": "unit"})
    with pytest.raises(ValueError, match="one style"):
        units_of(fresh_model(), {"blocks.*": "colwise"})
