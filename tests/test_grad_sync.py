"""``parallel.grad_sync``: gradients summed over a group and divided, during or after backward.

Three ranks cut into the groups [0] and [1, 2]: a group that is not the world, whose ranks
in the group differ from the global ones, and a group of one rank (no collective at all).
Rank r's gradient is r + 1, so the mean over [1, 2] is 2.5 and the sum 5.
"""

import pytest
import torch
import torch.distributed as dist

from ultrascale.comm import CommLogger
from ultrascale.runtime import shared_cluster

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

GROUPS = ([0], [1, 2])


@pytest.fixture(scope="module")
def cluster():
    return shared_cluster(3)


def _my_group(ctx):
    groups = [ctx.new_group(ranks) for ranks in GROUPS]  # every rank creates both, in order
    return groups[0] if ctx.rank == 0 else groups[1]


def _reduce_on_rank(ctx):
    from ultrascale.parallel.grad_sync import NO_REPLICAS, reduce_gradient

    group, grad = _my_group(ctx), torch.full((3,), ctx.rank + 1.0, device=ctx.device)
    with CommLogger() as log:
        mean = reduce_gradient(grad, group, divide_by=dist.get_world_size(group))
        total = reduce_gradient(grad, group)
    alone = reduce_gradient(grad, NO_REPLICAS, divide_by=4)
    calls = log.totals().get("all_reduce", {}).get("calls", 0)
    return mean.tolist(), total.tolist(), alone.tolist(), grad.tolist(), calls


def test_reduce_gradient_sums_over_its_group_divides_and_leaves_its_input(cluster):
    (mean0, sum0, alone0, grad0, calls0), (mean1, sum1, alone1, grad1, calls1), (mean2, *_) = cluster.run(
        _reduce_on_rank
    )
    assert mean0 == sum0 == grad0 == [1.0] * 3 and calls0 == 0  # a group of one: no collective
    assert mean1 == mean2 == [2.5] * 3 and sum1 == [5.0] * 3 and calls1 == 2
    assert grad1 == [2.0] * 3  # the given gradient is not changed
    assert alone0 == [0.25] * 3 and alone1 == [0.5] * 3  # NO_REPLICAS: only divided


def _in_backward_on_rank(ctx, divide_by):
    from ultrascale.parallel.grad_sync import sync_in_backward

    group = _my_group(ctx)
    model = torch.nn.Linear(2, 1, bias=False).to(ctx.device)
    frozen = torch.nn.Parameter(torch.ones(1, device=ctx.device), requires_grad=False)
    sync_in_backward([*model.parameters(), frozen], group, divide_by=divide_by, keep_as="_test_sync")
    x = torch.full((1, 2), ctx.rank + 1.0, device=ctx.device)
    for _ in range(2):  # two micro-batches accumulate into .grad
        model(x).sum().backward()
    synced = model.weight.grad.tolist()
    model.weight._test_sync.remove()  # the handle is kept so that it can be removed
    model.weight.grad = None
    model(x).sum().backward()
    return synced, model.weight.grad.tolist(), hasattr(frozen, "_test_sync")


@pytest.mark.parametrize("divide_by, expected", [(None, 5.0), (1, 10.0), (4, 2.5)])
def test_sync_in_backward_reduces_each_gradient_before_it_accumulates(cluster, divide_by, expected):
    rows = cluster.run(_in_backward_on_rank, divide_by)
    # None: the group's size (a mean); rank 0 alone keeps 2 micro-batches x its own 1.0.
    alone = 2.0 if divide_by is None else 2.0 / divide_by
    assert rows[0][0] == [[alone, alone]]
    assert rows[1][0] == rows[2][0] == [[expected, expected]]
    assert [r[1] for r in rows] == [[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]]  # removed: local again
    assert not any(r[2] for r in rows)  # a frozen parameter gets no hook


def _after_backward_on_rank(ctx):
    from ultrascale.parallel import average_gradients

    group = _my_group(ctx)
    model = torch.nn.Linear(2, 1).to(ctx.device)
    model.bias.requires_grad_(False)
    (model.weight * (ctx.rank + 1.0)).sum().backward()
    average_gradients(model, group)  # a module: its parameters; no .grad: left alone
    mean = model.weight.grad.tolist()
    average_gradients([model.weight], group, divide_by=1)
    return mean, model.weight.grad.tolist(), model.bias.grad


def test_average_gradients_after_backward_over_a_group_that_is_not_the_world(cluster):
    rows = cluster.run(_after_backward_on_rank)
    assert rows[0][:2] == ([[1.0, 1.0]], [[1.0, 1.0]])
    assert rows[1][:2] == rows[2][:2] == ([[2.5, 2.5]], [[5.0, 5.0]])
    assert all(r[2] is None for r in rows)


def test_the_module_runs_under_a_gpu_nodes_rules(cluster):
    """pytestmark's strict_modes (conftest.py) starts before the module's cluster, so the cluster
    is strict, as every technique test file's is (listed in tests/test_strict_device.py)."""
    if torch.cuda.is_available():
        pytest.skip("where torch sees a GPU the strict modes are left to the environment: NCCL judges")
    assert cluster.strict_device and cluster.strict_p2p
