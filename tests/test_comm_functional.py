"""ultrascale.comm.functional: each autograd collective against a single-process reference.

Every rank rebuilds the *global* tensors from fixed seeds, keeps its own part, runs the
distributed version, and compares forward results and gradients with the same
computation done on the full tensors in one process.

Why float64 and a 1e-12 tolerance: the distributed and the reference computations add
the same numbers in different orders (a sum over ranks against a sum inside one matmul).
In float32 that rounding alone differs by ~1e-6, which would force a loose tolerance
that also lets small real errors through; in float64 it is ~1e-15, so 1e-12 can only be
met by the right mathematics.

The losses are weighted sums ``(y * w).sum()`` with a fixed random ``w`` (and often a
different ``w`` per rank), so a backward that returns the wrong slice, forgets to sum
over ranks, or sums once too often fails.
"""

import pytest
import torch
import torch.distributed as dist

from ultrascale.comm import CommLogger
from ultrascale.comm import functional as F
from ultrascale.runtime import shared_cluster

# every technique test runs under a GPU node's rules, and on its GPUs in make test-gpu (conftest.py)
pytestmark = [pytest.mark.multigpu, pytest.mark.usefixtures("strict_modes")]

WORLD_SIZES = (2, 3, 4)
TOL = 1e-12
DT = torch.float64


@pytest.fixture(scope="module", params=WORLD_SIZES)
def cluster(request):
    return shared_cluster(request.param)


def _randn(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _randn_on(device):
    """``_randn`` for a rank: the same numbers, drawn on the host and moved to its device."""
    return lambda *shape, seed: _randn(*shape, seed=seed).to(device)


def _close(a, b):
    return a.shape == b.shape and bool(((a - b).abs() <= TOL).all())


# ---- f and f*: a column-parallel and a row-parallel linear -----------------------------
def _tensor_parallel_on_rank(ctx):
    randn = _randn_on(ctx.device)
    r, n = ctx.rank, ctx.world_size
    x_full, W = randn(5, 6, seed=1), randn(4 * n, 6, seed=2)  # y = x @ W.T, 4n outputs
    w_out = randn(5, 4 * n, seed=3)  # loss = (y * w_out).sum()
    rows = slice(4 * r, 4 * r + 4)

    # Column parallel: every rank has all of x and rows `rows` of W, so its slice of y.
    x = x_full.clone().requires_grad_()
    W_r = W[rows].clone().requires_grad_()
    y_r = F.f(x) @ W_r.T
    (y_r * w_out[:, rows]).sum().backward()  # the rank's share of the loss
    column = (y_r.detach(), x.grad, W_r.grad)

    # Row parallel: x is split along its 6n input features, W by columns; f* sums y.
    W2, x2_full, w2 = randn(7, 6 * n, seed=4), randn(5, 6 * n, seed=5), randn(5, 7, seed=6)
    cols = slice(6 * r, 6 * r + 6)
    x2 = x2_full[:, cols].clone().requires_grad_()
    W2_r = W2[:, cols].clone().requires_grad_()
    y2 = F.f_star(x2 @ W2_r.T)
    (y2 * w2).sum().backward()  # every rank computes the same loss from the same y
    row = (y2.detach(), x2.grad, W2_r.grad)
    return column, row


def test_f_and_f_star_match_single_process_linear(cluster):
    results = cluster.run(_tensor_parallel_on_rank)
    n = len(results)
    x, W, w_out = (
        _randn(5, 6, seed=1).requires_grad_(),
        _randn(4 * n, 6, seed=2).requires_grad_(),
        _randn(5, 4 * n, seed=3),
    )
    y = x @ W.T
    (y * w_out).sum().backward()
    x2, W2 = _randn(5, 6 * n, seed=5).requires_grad_(), _randn(7, 6 * n, seed=4).requires_grad_()
    y2 = x2 @ W2.T
    (y2 * _randn(5, 7, seed=6)).sum().backward()
    for r, ((y_r, gx, gW_r), (y2_r, gx2_r, gW2_r)) in enumerate(results):
        rows, cols = slice(4 * r, 4 * r + 4), slice(6 * r, 6 * r + 6)
        assert _close(y_r, y.detach()[:, rows])
        assert _close(gx, x.grad), "f's backward must sum every rank's dL/dx"
        assert _close(gW_r, W.grad[rows])
        assert _close(y2_r, y2.detach())
        assert _close(gx2_r, x2.grad[:, cols]), "f*'s backward must pass the gradient unchanged"
        assert _close(gW2_r, W2.grad[:, cols])


def _f_pair_direct_on_rank(ctx):
    randn = _randn_on(ctx.device)
    r = ctx.rank
    x = randn(3, 4, seed=10).requires_grad_()
    upstream = randn(3, 4, seed=20 + r)  # a different upstream gradient on every rank
    kept = upstream.clone()
    F.copy_to_parallel_region(x).backward(upstream)
    y_in = randn(3, 4, seed=30 + r).requires_grad_()
    y = F.reduce_from_parallel_region(y_in)
    y.backward(upstream)
    return x.grad, torch.equal(upstream, kept), y.detach(), y_in.grad


def test_f_sums_gradients_and_f_star_sums_values(cluster):
    results = cluster.run(_f_pair_direct_on_rank)
    n = len(results)
    total_upstream = sum(_randn(3, 4, seed=20 + r) for r in range(n))
    total_y = sum(_randn(3, 4, seed=30 + r) for r in range(n))
    for r, (x_grad, untouched, y, y_in_grad) in enumerate(results):
        assert _close(x_grad, total_upstream)
        assert untouched, "the caller's gradient tensor must not be reduced in place"
        assert _close(y, total_y)
        assert torch.equal(y_in_grad, _randn(3, 4, seed=20 + r))  # identity: this rank's own


# ---- g and g*, split and gather along a dim --------------------------------------------
SHAPE = (2, 3, 5)  # (batch, per-rank sequence, hidden); the full sequence has 3n tokens


def _piece(t, dim, r, n):
    return t.chunk(n, dim)[r]


def _sequence_on_rank(ctx):
    randn = _randn_on(ctx.device)
    r, n = ctx.rank, ctx.world_size
    out = {}
    for dim in (0, 1, 2, -1):  # dim 0 is already contiguous; 1 and 2 need the movedim path
        full_shape = list(SHAPE)
        full_shape[dim] *= n
        X = randn(*full_shape, seed=100)
        # g: gather this rank's slice; then each rank uses the whole with its own weight.
        x = _piece(X, dim, r, n).clone().requires_grad_()
        y = F.g(x, dim=dim)
        (y * randn(*full_shape, seed=200 + r)).sum().backward()
        out["g", dim] = (y.detach(), x.grad)
        # g*: each rank holds a full-length partial sum; it keeps its slice of the total.
        p = randn(*full_shape, seed=300 + r).requires_grad_()
        s = F.g_star(p, dim=dim)
        (s * _piece(randn(*full_shape, seed=400), dim, r, n)).sum().backward()
        out["g*", dim] = (s.detach(), p.grad)
        # split: a replicated tensor, each rank keeps its slice.
        xs = X.clone().requires_grad_()
        piece = F.split_along_dim(xs, dim=dim)
        (piece * _piece(randn(*full_shape, seed=500), dim, r, n)).sum().backward()
        out["split", dim] = (piece.detach(), xs.grad)
        # gather: slices to the replicated whole, the same loss on every rank.
        xg = _piece(X, dim, r, n).clone().requires_grad_()
        whole = F.gather_along_dim(xg, dim=dim)
        (whole * randn(*full_shape, seed=600)).sum().backward()
        out["gather", dim] = (whole.detach(), xg.grad)
    return out


def test_sequence_pair_and_edges_match_single_process(cluster):
    results = cluster.run(_sequence_on_rank)
    n = len(results)
    for dim in (0, 1, 2, -1):
        full_shape = list(SHAPE)
        full_shape[dim] *= n
        X = _randn(*full_shape, seed=100)
        # g: the total loss sums every rank's weights, so slice r's gradient is
        # the slice of that sum (a reduce-scatter), not of rank r's own weight.
        g_grad = sum(_randn(*full_shape, seed=200 + k) for k in range(n))
        total = sum(_randn(*full_shape, seed=300 + k) for k in range(n))
        w_star = _randn(*full_shape, seed=400)
        for r, res in enumerate(results):
            y, x_grad = res["g", dim]
            assert _close(y, X), f"g forward, dim {dim}"
            assert _close(x_grad, _piece(g_grad, dim, r, n)), f"g backward, dim {dim}"
            s, p_grad = res["g*", dim]
            assert _close(s, _piece(total, dim, r, n)), f"g* forward, dim {dim}"
            assert _close(p_grad, w_star), f"g* backward, dim {dim}"  # d(sum_k p_k)/dp_r = 1
            piece, xs_grad = res["split", dim]
            assert _close(piece, _piece(X, dim, r, n))
            assert _close(xs_grad, _randn(*full_shape, seed=500)), f"split backward, dim {dim}"
            whole, xg_grad = res["gather", dim]
            assert _close(whole, X)
            assert _close(xg_grad, _piece(_randn(*full_shape, seed=600), dim, r, n))
        # The forward of g is the concatenation of all ranks' pieces, in rank order.
        assert _close(torch.cat([_piece(X, dim, r, n) for r in range(n)], dim), X)


def _not_divisible_on_rank(ctx):
    x = torch.zeros(2, 13, 4, device=ctx.device)  # 13 is divisible by none of 2, 3, 4
    messages = []
    for call in (
        lambda: F.g_star(x, dim=1),
        lambda: F.split_along_dim(x, dim=1),
        lambda: F.all_to_all(x.transpose(0, 1)),
    ):
        try:
            call()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_sizes_that_do_not_divide_raise_a_clear_error(cluster):
    for messages in cluster.run(_not_divisible_on_rank):
        for message in messages:
            assert message is not None and "13" in message and "pad it" in message


# ---- all_to_all with uneven splits -----------------------------------------------------
def _sends(r, j):
    return (r + 2 * j) % 3  # rows rank r sends to rank j: uneven, sometimes zero


def _a2a_input(r, n):
    rows = sum(_sends(r, j) for j in range(n))
    return _randn(rows, 2, seed=700 + r)


def _a2a_on_rank(ctx, give_output_sizes):
    r, n = ctx.rank, ctx.world_size
    x = _a2a_input(r, n).to(ctx.device).requires_grad_()
    out_sizes = [_sends(k, r) for k in range(n)] if give_output_sizes else None
    y = F.all_to_all(x, out_sizes, [_sends(r, j) for j in range(n)])
    (y * _randn(*y.shape, seed=800 + r).to(ctx.device)).sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("give_output_sizes", [True, False])
def test_all_to_all_uneven_splits(cluster, give_output_sizes):
    results = cluster.run(_a2a_on_rank, give_output_sizes)
    n = len(results)
    # Reference: cut every input into its pieces; rank j receives piece j of every rank.
    pieces = [list(_a2a_input(r, n).split([_sends(r, j) for j in range(n)])) for r in range(n)]
    weights = [_randn(sum(_sends(k, j) for k in range(n)), 2, seed=800 + j) for j in range(n)]
    weight_pieces = [list(w.split([_sends(k, j) for k in range(n)])) for j, w in enumerate(weights)]
    for j, (y, _) in enumerate(results):
        assert _close(y, torch.cat([pieces[k][j] for k in range(n)]))
    for r, (_, x_grad) in enumerate(results):
        # Row sent to rank j gets the weight that multiplied it there.
        assert _close(x_grad, torch.cat([weight_pieces[j][r] for j in range(n)]))


def _a2a_equal_on_rank(ctx):
    randn = _randn_on(ctx.device)
    x = randn(2 * ctx.world_size, 3, seed=900 + ctx.rank).requires_grad_()
    y = F.all_to_all(x)
    y.backward(randn(*y.shape, seed=950 + ctx.rank))
    return y.detach(), x.grad


def test_all_to_all_equal_splits_is_a_transpose_of_blocks(cluster):
    results = cluster.run(_a2a_equal_on_rank)
    n = len(results)
    blocks = [_randn(2 * n, 3, seed=900 + r).chunk(n) for r in range(n)]
    grads = [_randn(2 * n, 3, seed=950 + j).chunk(n) for j in range(n)]
    for r, (y, x_grad) in enumerate(results):
        assert torch.equal(y, torch.cat([blocks[k][r] for k in range(n)]))
        assert torch.equal(x_grad, torch.cat([grads[j][r] for j in range(n)]))


# ---- the CommLogger sees the collectives in forward and backward ------------------------
def _logged_on_rank(ctx):
    randn = _randn_on(ctx.device)
    x = randn(4, 2 * ctx.world_size, 3, seed=1).requires_grad_()
    ops = {}
    for name, fn in (("f", F.f), ("f_star", F.f_star), ("g", F.g), ("g_star", F.g_star)):
        with CommLogger() as forward_log:
            y = fn(x)
        with CommLogger() as backward_log:
            y.backward(torch.ones_like(y))
        ops[name] = ([e.op for e in forward_log.events], [e.op for e in backward_log.events])
    with CommLogger() as log:  # no output sizes: the counts travel first
        F.all_to_all(x, None, [4] + [0] * (ctx.world_size - 1))
    ops["all_to_all"] = [e.op for e in log.events]
    return ops


def test_comm_logger_sees_forward_and_backward_collectives(cluster):
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    for ops in cluster.run(_logged_on_rank):
        assert ops["f"] == ([], ["all_reduce"])
        assert ops["f_star"] == (["all_reduce"], [])
        assert ops["g"] == ([gather], [scatter])
        assert ops["g_star"] == ([scatter], [gather])
        assert ops["all_to_all"] == ["all_to_all_single", "all_to_all_single"]
