"""Properties of the exercises the first three modules left without one (issue 53's remainder); see
``exercise_tests.properties`` for how they run. Each names what its draws reach that the
exercise's fixed cases do not:

* ``07.split_backward`` (B and W judged together): a stage with a parameter its output does not
  depend on (the text says W must allow for it; every fixed stage uses all its weights), float32
  as well as float64, one to three micro-batches whose W's run in order, reversed, or each right
  after its B;
* ``12.fp8_backward``: float64 and bf16 operands, magnitudes from 10^-10 to 10^12 (each operand its
  own), a weight that is a transposed view, an all-zero gradient, and a token whose gradient is
  2^-26 of the others' (e5m2 keeps it only when its maximum is e5m2's own 57,344, not e4m3's 448);
* ``03.shard_gradient``: gradients that are transposed or strided views, 1-D to 3-D, any number of
  rows (fewer than the ranks too), computed in float32 or bf16 with float64 masters, on 2 and 3 ranks;
* ``03.muon_rows``: this rank's rows as a transposed view, one column, fewer rows than ranks;
* ``04.vocab_parallel_cross_entropy``: this rank's slice passed as the view of the full logits it
  is (not a copy: not contiguous), one token, one vocabulary entry per rank, logits of size 10^5;
* ``05.sequence_parallel_norm_grads``: the norm a LayerNorm without a bias or an RMSNorm (a weight
  only; every fixed case's norm is a LayerNorm with both), in float64 too, on 2 and 3 ranks;
* ``11.row_softmax``: rows whose every logit is below -10^6 (a padding lane loaded as -10000 or
  -1e9 then wins the maximum), masked (-inf) logits, one column.

The last eight exercises' properties are in ``properties_last`` (the two Triton kernels, the ring
step, the overlap of a trace) and ``properties_steps`` (the four that are a whole training step on
ranks, each drawing a few small runs).
"""

from __future__ import annotations

import torch

from ultrascale_grading.properties import Property, floats
from ultrascale_grading.properties import seeded_values as _values
from ultrascale_grading.properties import strategies as _st

FLOATS = floats()
F32_ULP = 2.0**-24


# ---- 07.split_backward -----------------------------------------------------------------------


def _split_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            tokens=st.integers(1, 3),
            width=st.integers(1, 4),
            micro_batches=st.integers(1, 3),
            dtype=st.sampled_from((torch.float32, torch.float64)),
            unused=st.booleans(),
            order=st.sampled_from(("deferred", "reversed", "interleaved")),
            seed=st.integers(0, 99),
        )
    )


class _Stage(torch.nn.Module):
    """Two linear layers; ``spare`` is a parameter the output does not depend on (a stage may hold
    one: a tied embedding kept for a later stage, a layer of another branch)."""

    def __init__(self, width: int, unused: bool):
        super().__init__()
        self.first, self.second = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.spare = torch.nn.Linear(width, 1) if unused else None

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _split_stage(case) -> _Stage:
    with torch.random.fork_rng(devices=[]):  # seeded, and the caller's random stream left as it was
        torch.manual_seed(case["seed"])
        return _Stage(case["width"], case["unused"]).to(case["dtype"])


def _split_order(case) -> list:
    m = case["micro_batches"]
    if case["order"] == "interleaved":
        return [(op, i) for i in range(m) for op in ("B", "W")]
    ws = range(m - 1, -1, -1) if case["order"] == "reversed" else range(m)
    return [("B", i) for i in range(m)] + [("W", i) for i in ws]


def _judge_split(functions, case):
    backward_input, backward_weight = functions
    dt, m = case["dtype"], case["micro_batches"]
    xs = [_values(case["seed"] + 10 + i, (case["tokens"], case["width"]), dt) for i in range(m)]
    dys = [_values(case["seed"] + 20 + i, (case["tokens"], case["width"]), dt) for i in range(m)]
    whole, split = _split_stage(case), _split_stage(case)
    want_dx = []
    for x, dy in zip(xs, dys):  # ordinary backward, one micro-batch after the other
        x = x.clone().requires_grad_()
        whole(x).backward(dy)
        want_dx.append(x.grad)
    params = list(split.parameters())
    held = {}
    for op, i in _split_order(case):
        if op == "B":
            x = xs[i].clone().requires_grad_()
            y = split(x)
            dx = backward_input(y, x, dys[i].clone())
            if not torch.is_tensor(dx) or dx.shape != x.shape or not _close(dx, want_dx[i], dt):
                return f"B of micro-batch {i} did not return the gradient of stage_input"
            held[i] = y
        else:
            try:
                backward_weight(held[i], params, dys[i].clone())
            except RuntimeError as err:
                if "not have been used in the graph" in str(err) and case["unused"]:
                    return (
                        "W raised: a parameter the stage's output does not depend on (here `spare`) has no "
                        "gradient, and torch.autograd.grad refuses it unless told: allow_unused=True, then "
                        "skip the parameters whose gradient comes back None"
                    )
                raise
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        if q.grad is None:  # the spare parameter: backward() leaves it without a gradient
            if p.grad is not None and bool(p.grad.abs().sum() != 0):
                return f"{name}.grad is not zero, but the output does not depend on {name}"
            continue
        if p.grad is None or not _close(p.grad, q.grad, dt):
            return (
                f"after the W's ({case['order']} order) {name}.grad differs from what backward() leaves after "
                f"the {m} micro-batches: W must add each micro-batch's gradients to .grad, whatever the order"
            )
    return None


def _describe_split(case):
    return (
        f"a stage of two {case['width']}-wide linear layers in {case['dtype']}"
        + (" holding a parameter its output does not use" if case["unused"] else "")
        + f", {case['micro_batches']} micro-batch(es) of {case['tokens']} token(s), "
        + f"order {' '.join(f'{op}{i}' for op, i in _split_order(case))}"
    )


def _close(got, want, dtype) -> bool:
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    return (
        torch.is_tensor(got)
        and got.shape == want.shape
        and bool(torch.allclose(got.double(), want.double(), rtol=tol, atol=tol))
    )


# ---- 12.fp8_backward -------------------------------------------------------------------------


def _fp8_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            tokens=st.integers(1, 6),
            fin=st.integers(1, 8),
            fout=st.integers(1, 8),
            dtype=st.sampled_from(FLOATS),
            exponents=st.lists(st.integers(-10, 12), min_size=3, max_size=3),
            transposed=st.booleans(),
            gradient=st.sampled_from(("random", "zero", "a tiny token")),
            seed=st.integers(0, 99),
        )
    )


def _fp8_inputs(case):
    dt, (ex, ew, edy) = case["dtype"], case["exponents"]
    x = _values(case["seed"], (case["tokens"], case["fin"]), dt, 10.0**ex)
    if case["transposed"]:  # the weight as a transposed view (W.t() of a stored (in, out) matrix)
        weight = _values(case["seed"] + 1, (case["fin"], case["fout"]), dt, 10.0**ew).t()
    else:
        weight = _values(case["seed"] + 1, (case["fout"], case["fin"]), dt, 10.0**ew)
    dy = _values(case["seed"] + 2, (case["tokens"], case["fout"]), dt, 10.0**edy)
    if case["gradient"] == "zero":
        dy = torch.zeros_like(dy)
    elif case["gradient"] == "a tiny token" and case["tokens"] > 1:
        dy[0] *= 2.0**-26  # a token whose loss barely moves: far below the others, still not zero
    return x, weight, dy


def _dequantised(t, fp8, top=None, in_dtype=False):
    """``t`` through FP8 and back, as the exercise's conventions do it (``top``: another maximum than
    the format's; ``in_dtype``: ``t / scale`` left in ``t``'s own dtype; the two mistakes)."""
    top = torch.finfo(fp8).max if top is None else top
    scale = t.detach().abs().max().float().clamp(min=1e-12) / top
    scaled = t / scale if in_dtype else t.float() / scale
    return scaled.clamp(-top, top).to(fp8).float() * scale


def _fp8_products(x, weight, dy, **mistake):
    """The operands of (dx, dW) dequantised: ((dy, W), (dy^T, x))."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    in_dtype = mistake.get("in_dtype", False)
    x_hat, w_hat = _dequantised(x, e4m3, in_dtype=in_dtype), _dequantised(weight, e4m3, in_dtype=in_dtype)
    dy_hat = _dequantised(dy, e5m2, top=mistake.get("top"), in_dtype=in_dtype)
    return (dy_hat, w_hat), (dy_hat.t(), x_hat)


def _judge_fp8(fn, case):
    x, weight, dy = _fp8_inputs(case)
    got = fn(x, weight, dy)
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(torch.is_tensor(g) for g in got)):
        return "return the pair of tensors (dx, dW)"
    for name, have, (a, b), mistakes in zip(
        ("dx (Dgrad)", "dW (Wgrad)"),
        got,
        _fp8_products(x, weight, dy),
        zip(*(_fp8_products(x, weight, dy, **m) for m in _FP8_MISTAKES.values())),
    ):
        want = a.double() @ b.double()
        if tuple(have.shape) != tuple(want.shape):
            return f"{name} has shape {tuple(have.shape)}, expected {tuple(want.shape)}"
        if torch.isnan(have).any():
            return (
                f"{name} has NaN: an all-zero tensor has amax 0, and x / 0 is NaN. Clamp amax to a tiny positive "
                "number (1e-12) before dividing"
            )
        # each entry is a sum of k products of FP8 values, rounded in float32: within k float32 ulps of
        # the sum of their magnitudes (a product in float64 is closer still)
        bound = (a.double().abs() @ b.double().abs()) * (4 * a.shape[1] * F32_ULP) + 1e-300
        if bool(((have.double() - want).abs() <= bound).all()):
            continue
        for why, (ma, mb) in zip(_FP8_MISTAKES, mistakes):
            if bool(((have.double() - ma.double() @ mb.double()).abs() <= bound).all()):
                return f"{name} is what {why}"
        return (
            f"{name} differs from the product of the dequantised operands (x and W in e4m3, dy in e5m2, each "
            "with one scale amax / the format's largest value, amax at least 1e-12, the division x.float() / "
            "scale in float32)"
        )
    return None


_FP8_MISTAKES = {  # what the mistake gives, and why it is one -> how to make its operands
    "scaling dy to e4m3's largest value (448) gives: the tiny token's gradient falls below e5m2's smallest number. "
    "Each format has its own maximum, torch.finfo(dtype).max (57,344 for e5m2)": dict(top=448.0),
    "dividing by the scale in the input's dtype gives: a bf16 tensor divided by the scale is rounded to bf16's 8 "
    "bits before FP8 rounds it again. Divide in float32 (x.float() / scale)": dict(in_dtype=True),
}


def _describe_fp8(case):
    ex, ew, edy = case["exponents"]
    grad = {
        "random": f"of size ~1e{edy}",
        "zero": "all zero",
        "a tiny token": f"of size ~1e{edy}, the first token's 2^-26 of that",
    }[case["gradient"]]
    return (
        f"fp8_backward(x {(case['tokens'], case['fin'])} of size ~1e{ex}, weight {(case['fout'], case['fin'])} "
        f"of size ~1e{ew}{' (a transposed view)' if case['transposed'] else ''}, grad_output "
        f"{(case['tokens'], case['fout'])} {grad}), all {case['dtype']}"
    )


# ---- 03.shard_gradient and 03.muon_rows (on ranks) --------------------------------------------


def _rows_cases(muon: bool):
    st = _st()
    trailing = (
        st.lists(st.integers(1, 3), min_size=1, max_size=1)
        if muon
        else st.lists(st.integers(1, 3), min_size=0, max_size=2)
    )
    dtypes = (
        st.sampled_from(((torch.float32, torch.float32), (torch.float64, torch.float64)))
        if muon
        else st.sampled_from(
            (
                (torch.float32, torch.float64),
                (torch.bfloat16, torch.float64),
                (torch.float32, torch.float32),
                (torch.bfloat16, torch.float32),
            )
        )
    )
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            rows=st.integers(1, 7),
            trailing=trailing,
            dtypes=dtypes,
            layout=st.sampled_from(("contiguous", "transposed", "strided")),
            seed=st.integers(0, 99),
        )
    )


def _laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` as the view a caller may hand over: a transposed one (the last two axes of a
    stored tensor swapped, as W.t() gives), or every other row of a larger tensor."""
    if layout == "transposed" and values.dim() >= 2:
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "strided":
        doubled = values.repeat_interleave(2, dim=0)
        return doubled[::2]
    return values


def _rows_of(rows: int, n: int, index: int) -> tuple:
    per = -(-rows // n)
    start = min(index * per, rows)
    return start, min(per, rows - start)


def _shard_input(case, rank: int) -> torch.Tensor:
    compute = case["dtypes"][0]
    return _values(1000 * case["seed"] + rank, (case["rows"], *case["trailing"]), torch.float64).to(compute)


def _shard_on_rank(ctx, fn, case):
    from ultrascale_grading.exercise_tests._groups import only_group

    full = _laid_out(_shard_input(case, ctx.rank).to(ctx.device), case["layout"])
    with only_group(ctx.group, "shard_gradient"):
        got = fn(full, ctx.group, case["dtypes"][1])
    return got.detach().cpu() if torch.is_tensor(got) else got


def _judge_shard(fn, case):
    from ultrascale.runtime import grading_cluster

    n, master = case["world_size"], case["dtypes"][1]
    total = torch.stack([_shard_input(case, r).to(master) for r in range(n)]).sum(0)
    for rank, got in enumerate(grading_cluster(n).run(_shard_on_rank, fn, case)):
        start, length = _rows_of(case["rows"], n, rank)
        want = total[start : start + length] / n
        if not torch.is_tensor(got) or got.dtype != master or tuple(got.shape) != tuple(want.shape):
            return (
                f"rank {rank} returned "
                + (f"a {tuple(got.shape)} tensor of {got.dtype}" if torch.is_tensor(got) else type(got).__name__)
                + f", expected its rows {start}..{start + length}, {tuple(want.shape)} "
                f"of {master} (cast to the dtype given, not to float32; reshape, as view needs contiguous memory)"
            )
        tol = 1e-12 if master == torch.float64 else 1e-6
        if not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol):
            return (
                f"rank {rank}'s rows differ from the average over the ranks (to {tol:g}): in {master}, every sum "
                f"and the division are {master}'s, so the padded buffer must be made in the dtype given"
            )
    return None


def _describe_rows(case, what: str):
    shape = (case["rows"], *case["trailing"])
    layout = {
        "contiguous": "",
        "transposed": " (a transposed view)",
        "strided": " (every other row of a larger tensor: not contiguous)",
    }[case["layout"]]
    compute, master = case["dtypes"]
    return f"{what} on {case['world_size']} ranks: a {shape} {compute} tensor{layout}" + (
        f", masters in {master}" if what == "shard_gradient" else ""
    )


def _muon_whole(case) -> torch.Tensor:
    return _values(case["seed"], (case["rows"], *case["trailing"]), case["dtypes"][0])


def _muon_on_rank(ctx, fn, case):
    from ultrascale_grading.exercise_tests._groups import only_group

    start, length = _rows_of(case["rows"], ctx.world_size, ctx.rank)
    mine = _laid_out(_muon_whole(case)[start : start + length].to(ctx.device), case["layout"])
    with only_group(ctx.group, "muon_rows"):
        got = fn(mine, case["rows"], ctx.group)
    return got.detach().cpu() if torch.is_tensor(got) else got


def _judge_muon(fn, case):
    from ultrascale.parallel.sharded_muon import newton_schulz
    from ultrascale.runtime import grading_cluster

    n, dtype = case["world_size"], case["dtypes"][0]
    whole = newton_schulz(_muon_whole(case), dtype=dtype)
    for rank, got in enumerate(grading_cluster(n).run(_muon_on_rank, fn, case)):
        start, length = _rows_of(case["rows"], n, rank)
        want = whole[start : start + length]
        if not torch.is_tensor(got) or got.dtype != dtype or tuple(got.shape) != tuple(want.shape):
            return (
                f"rank {rank} returned "
                + (f"a {tuple(got.shape)} tensor of {got.dtype}" if torch.is_tensor(got) else type(got).__name__)
                + f", expected its rows {start}..{start + length}, {tuple(want.shape)} "
                f"of {dtype} (reshape, as view needs contiguous memory)"
            )
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            return f"rank {rank}'s rows differ from those of the whole matrix orthogonalised"
    return None


# ---- 04.vocab_parallel_cross_entropy (on ranks) -----------------------------------------------


def _vocab_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            tokens=st.integers(1, 4),
            local=st.integers(1, 5),
            magnitude=st.sampled_from((1.0, 1e3, 1e5)),
            one_rank=st.booleans(),
            view=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


def _vocab_problem(case):
    n, local = case["world_size"], case["local"]
    logits = _values(case["seed"], (case["tokens"], local * n), torch.float32, case["magnitude"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    low = (n - 1) * local if case["one_rank"] else 0  # every target on the last rank's slice
    return logits, torch.randint(low, local * n, (case["tokens"],), generator=g)


def _vocab_on_rank(ctx, fn, case):
    logits, targets = _vocab_problem(case)
    full = logits.to(ctx.device).requires_grad_()
    start = ctx.rank * case["local"]
    mine = full[:, start : start + case["local"]]  # a view of the full logits: rows local * n apart
    if not case["view"]:
        mine = mine.contiguous()
    loss = fn(mine, targets.to(ctx.device), start, ctx.group)
    if not (torch.is_tensor(loss) and loss.dim() == 0 and loss.requires_grad):
        return loss.detach().cpu() if torch.is_tensor(loss) else loss, None
    (grad,) = torch.autograd.grad(loss, full)
    return loss.detach().cpu(), grad[:, start : start + case["local"]].cpu()


def _judge_vocab(fn, case):
    import torch.nn.functional as F

    from ultrascale.runtime import grading_cluster

    logits, targets = _vocab_problem(case)
    full = logits.double().requires_grad_()
    want = F.cross_entropy(full, targets)
    want.backward()
    for rank, (loss, grad) in enumerate(grading_cluster(case["world_size"]).run(_vocab_on_rank, fn, case)):
        if not torch.is_tensor(loss) or loss.dim() != 0:
            return f"rank {rank} returned {loss!r}: return the mean loss as a 0-dimensional tensor"
        if not torch.isfinite(loss):
            return (
                f"rank {rank}'s loss is {loss.item()}: subtract each token's maximum over the whole vocabulary "
                "before exp"
            )
        # float32 logits: the loss is a difference of numbers of the logits' size
        tol = 1e-5 * max(1.0, case["magnitude"])
        if abs(loss.item() - want.item()) > tol:
            return f"rank {rank}'s loss is {loss.item():.8g}, F.cross_entropy of the full logits {want.item():.8g}"
        cols = slice(rank * case["local"], (rank + 1) * case["local"])
        if grad is None or not torch.allclose(grad.double(), full.grad[:, cols], rtol=1e-4, atol=1e-5):
            return f"rank {rank}: the gradient of its slice differs from that of F.cross_entropy"
    return None


def _describe_vocab(case):
    n, local = case["world_size"], case["local"]
    return (
        f"{case['tokens']} token(s), a vocabulary of {local} x {n} ranks, float32 logits of size "
        f"~{case['magnitude']:g}"
        + (", every target on the last rank's slice" if case["one_rank"] else "")
        + (", each rank's slice passed as the view of the full logits it is (not contiguous)" if case["view"] else "")
    )


# ---- 05.sequence_parallel_norm_grads (on ranks) ------------------------------------------------

NORMS = ("LayerNorm", "LayerNorm without bias", "RMSNorm")


def _norm_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            world_size=st.sampled_from((2, 3)),
            norm=st.sampled_from(NORMS),
            hidden=st.integers(1, 5),
            per_rank=st.integers(1, 3),
            dtype=st.sampled_from((torch.float32, torch.float64)),
            seed=st.integers(0, 99),
        )
    )


def _norm_module(case) -> torch.nn.Module:
    """The same norm in every process, its parameters away from 1 and 0."""
    h = case["hidden"]
    norm = torch.nn.RMSNorm(h) if case["norm"] == "RMSNorm" else torch.nn.LayerNorm(h, bias=case["norm"] == "LayerNorm")
    with torch.no_grad():
        for i, p in enumerate(norm.parameters()):
            p.copy_(1 + 0.5 * _values(case["seed"] + i, (h,), torch.float64))
    return norm.to(case["dtype"])


def _norm_tokens(case) -> tuple:
    shape = (2, case["per_rank"] * case["world_size"], case["hidden"])  # the whole sequences
    return _values(case["seed"] + 10, shape, case["dtype"]), _values(case["seed"] + 11, shape, case["dtype"])


def _norm_on_rank(ctx, fn, case):
    norm = _norm_module(case).to(ctx.device)
    fn(norm, ctx.group)
    x, dy = (t.to(ctx.device) for t in _norm_tokens(case))
    mine = slice(ctx.rank * case["per_rank"], (ctx.rank + 1) * case["per_rank"])
    norm(x[:, mine]).backward(dy[:, mine])
    return {name: None if p.grad is None else p.grad.cpu() for name, p in norm.named_parameters()}


def _judge_norm(fn, case):
    from ultrascale.runtime import grading_cluster

    whole = _norm_module(case).double()
    x, dy = _norm_tokens(case)
    whole(x.double()).backward(dy.double())
    tol = 1e-10 if case["dtype"] == torch.float64 else 1e-4
    for rank, grads in enumerate(grading_cluster(case["world_size"]).run(_norm_on_rank, fn, case)):
        for name, p in whole.named_parameters():
            got = grads.get(name)
            if (
                got is None
                or got.dtype != case["dtype"]
                or not torch.allclose(got.double(), p.grad, rtol=tol, atol=tol)
            ):
                return (
                    f"rank {rank}: {name}.grad is not the gradient of the whole sequence (summed over the ranks) "
                    f"in {case['dtype']}"
                )
    return None


def _describe_norm(case):
    params = {
        "LayerNorm": "weight and bias",
        "LayerNorm without bias": "a weight and no bias",
        "RMSNorm": "a weight only",
    }[case["norm"]]
    return (
        f"sync_norm_gradients(an nn.{case['norm'].split()[0]}({case['hidden']}) with {params}, in "
        f"{case['dtype']}) on {case['world_size']} ranks of {case['per_rank']} token(s) each"
    )


# ---- 11.row_softmax (under Triton's interpreter, or on a GPU) ------------------------------------


def _softmax_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            rows=st.integers(1, 3),
            cols=st.integers(1, 40),
            logits=st.sampled_from(("mixed", "all below")),
            magnitude=st.sampled_from((1.0, 1e6, 1e20, 1e36)),
            masked=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


def _softmax_input(case) -> torch.Tensor:
    x = _values(case["seed"], (case["rows"], case["cols"]), torch.float64, case["magnitude"])
    if case["logits"] == "all below":  # every logit far below zero, as a whole row of padding tokens' scores is
        x = -x.abs() - case["magnitude"]
    if case["masked"] and case["cols"] > 1:
        x[:, 1::2] = float("-inf")  # masked keys; each row keeps its first logit
    return x.float()


def _judge_softmax(kernel, case):
    import triton

    from ultrascale_grading.exercise_tests.ch11 import (
        SENTINEL,
        kernel_device,
        launch_kernel,
        outside_view,
        padded_window,
    )

    x = _softmax_input(case).to(kernel_device())
    rows, cols = x.shape
    _, x_view = padded_window(x, 0, 5, float("nan"))
    out_buf, out = padded_window(torch.zeros(rows, cols, device=x.device), 1, 3, SENTINEL)
    launch_kernel(
        kernel,
        (rows,),
        out,
        x_view,
        x_view.stride(0),
        out.stride(0),
        cols,
        BLOCK_SIZE=triton.next_power_of_2(cols),
        loads_per_program=4,
    )
    if not (outside_view(out_buf, out) == SENTINEL).all():
        return "the kernel wrote outside the output rows"
    want = torch.softmax(x.double(), dim=-1)
    got = out.double()
    if torch.isnan(got).any() or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        sums = got.sum(-1)
        if case["logits"] == "all below" and case["magnitude"] > 1e4 and bool(((sums < 0.5) | sums.isnan()).any()):
            return (
                "a row's sum of exponentials is 0 or NaN: every logit of the row is far below zero, so a padding "
                "lane that loads a finite number (such as -10000 or -1e9) is the row's maximum, and every real "
                "exp(x - max) underflows to 0. Load padding lanes as -inf (other=-float('inf')): only then can "
                "no padding win the maximum"
            )
        return f"largest difference from torch.softmax {(got - want).abs().nan_to_num(float('inf')).max().item():.3g}"
    return None


def _describe_softmax(case):
    kind = "of both signs" if case["logits"] == "mixed" else "all below -size"
    return f"logits of shape ({case['rows']}, {case['cols']}), {kind}, size ~{case['magnitude']:g}" + (
        ", every other one masked (-inf)" if case["masked"] and case["cols"] > 1 else ""
    )


PROPERTIES: dict = {
    "07.split_backward": Property(
        _split_cases,
        _judge_split,
        _describe_split,
        argument=(0, 1),
        examples=(
            dict(tokens=2, width=3, micro_batches=2, dtype=torch.float32, unused=True, order="reversed", seed=0),
        ),
    ),
    "12.fp8_backward": Property(
        _fp8_cases,
        _judge_fp8,
        _describe_fp8,
        examples=(
            dict(
                tokens=3,
                fin=4,
                fout=5,
                dtype=torch.float32,
                exponents=[0, -1, -3],
                transposed=True,
                gradient="a tiny token",
                seed=0,
            ),
            dict(
                tokens=4,
                fin=5,
                fout=5,
                dtype=torch.bfloat16,
                exponents=[1, 0, -2],
                transposed=False,
                gradient="random",
                seed=2,
            ),
        ),
    ),
    "03.shard_gradient": Property(
        lambda: _rows_cases(False),
        _judge_shard,
        lambda case: _describe_rows(case, "shard_gradient"),
        examples=(
            dict(
                world_size=3,
                rows=5,
                trailing=[2, 3],
                dtypes=(torch.float32, torch.float64),
                layout="transposed",
                seed=0,
            ),
        ),
    ),
    "03.muon_rows": Property(
        lambda: _rows_cases(True),
        _judge_muon,
        lambda case: _describe_rows(case, "muon_rows"),
        examples=(
            dict(
                world_size=3, rows=4, trailing=[3], dtypes=(torch.float64, torch.float64), layout="transposed", seed=0
            ),
        ),
    ),
    "04.vocab_parallel_cross_entropy": Property(
        _vocab_cases,
        _judge_vocab,
        _describe_vocab,
        examples=(dict(world_size=2, tokens=3, local=4, magnitude=1e3, one_rank=False, view=True, seed=0),),
    ),
    "05.sequence_parallel_norm_grads": Property(
        _norm_cases,
        _judge_norm,
        _describe_norm,
        examples=(dict(world_size=2, norm="RMSNorm", hidden=3, per_rank=2, dtype=torch.float64, seed=0),),
    ),
    "11.row_softmax": Property(
        _softmax_cases,
        _judge_softmax,
        _describe_softmax,
        examples=(dict(rows=2, cols=5, logits="all below", magnitude=1e6, masked=False, seed=0),),
    ),
}
