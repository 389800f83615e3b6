"""The exercises' properties: what must hold on any input the technique admits, drawn by hypothesis
(``grading.properties`` runs them after an exercise's fixed cases pass).

Each draws the dimensions a learner's answer tends to assume away: dtypes (float32, float64, bf16
where the technique admits it), shapes (0-d, size 1, odd, non-contiguous, not divisible by the
ranks), magnitudes near overflow, masked (-inf) entries, meshes with size-1 axes and joint groups
of three axes. Values come from a torch generator seeded by a drawn integer, so hypothesis shrinks
the case's structure and seed, never a float's last bits.

* ``03.flatten_padded``: any list of tensors (0-d, non-contiguous, bf16), any world size;
* ``06.merge_partial_attention``: log-sum-exps up to 10^4 (exp overflows), empty parts;
* ``08.router``: logits up to 10^4 (a softmax without its max subtracted overflows), any k;
* ``09.group_ranks``: meshes with size-1 axes, tuples of up to three axes in any order;
* ``11.online_softmax_update``: scores up to 10^4, masked keys, float64;
* ``12.quantize_per_tensor``: both FP8 formats, bf16 and float64 inputs, magnitudes from 10^-10 (above the
  amax floor of 1e-12 the exercise names) to 10^30, all-zero tensors.

The formula exercises' properties are in ``properties_formulas``, those of exercises on lists of
tensors, traces, clocks, layouts, models and the a0 collectives in ``properties_more``, then
``properties_rest``, ``properties_checkpoints`` (A4), ``properties_last`` (the kernels, the ring step,
a trace's overlap, the smallest pipeline, the atomic save) and ``properties_steps`` (whole training
steps on ranks); all are merged into ``PROPERTIES`` below. ``09.quiz`` has none, and needs none: a quiz takes no input to
draw (its answers are fixed values, checked one by one, and refused when read off the library's tables).
"""

from __future__ import annotations

import torch

from ultrascale_grading.properties import Property, floats
from ultrascale_grading.properties import seeded_values as _values
from ultrascale_grading.properties import strategies as _st

FLOATS = floats()


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> bool:
    rtol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 2e-2)
    return bool(torch.allclose(got.double(), want.double(), rtol=rtol, atol=rtol, equal_nan=True))


# ---- 03.flatten_padded ---------------------------------------------------------------------


def _flatten_cases():
    st = _st()
    shape = st.lists(st.integers(1, 4), min_size=0, max_size=3)  # [] is a 0-d tensor
    return st.fixed_dictionaries(
        dict(
            shapes=st.lists(shape, min_size=1, max_size=4),
            world_size=st.integers(1, 6),
            dtype=st.sampled_from(FLOATS),
            transposed=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


def _flatten_tensors(case) -> list:
    tensors = []
    for i, shape in enumerate(case["shapes"]):
        if case["transposed"] and len(shape) == 2:  # a non-contiguous view, as W.t() gives
            tensors.append(_values(case["seed"] + i, shape[::-1], case["dtype"]).t())
        else:
            tensors.append(_values(case["seed"] + i, shape, case["dtype"]))
    return tensors


def _judge_flatten(fn, case):
    tensors, n = _flatten_tensors(case), case["world_size"]
    want = torch.cat([t.reshape(-1) for t in tensors])
    want = torch.cat([want, want.new_zeros(-want.numel() % n)])
    got = fn(tensors, n)
    if not torch.is_tensor(got) or got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return (
            f"expected a {tuple(want.shape)} tensor of {want.dtype}, got "
            + (f"{tuple(got.shape)} of {got.dtype}" if torch.is_tensor(got) else type(got).__name__)
            + " (keep the parameters' dtype; flatten each tensor in its logical order, `reshape(-1)`)"
        )
    if not torch.equal(got.detach(), want):
        return "the values are not the tensors' elements in order then zeros (a transposed view read in memory order?)"
    return None


def _describe_flatten(case):
    kinds = ["()" if not s else str(tuple(s)) for s in case["shapes"]]
    return (
        f"tensors of shapes {', '.join(kinds)}{' (2-D ones transposed views)' if case['transposed'] else ''}, "
        f"{case['dtype']}, world_size={case['world_size']}"
    )


# ---- 06.merge_partial_attention -------------------------------------------------------------


def _merge_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            rows=st.integers(1, 4),
            d=st.integers(1, 3),
            dtype=st.sampled_from((torch.float32, torch.float64)),
            magnitude=st.sampled_from((1.0, 100.0, 1e4)),
            empty=st.sampled_from(("none", "a", "b", "both", "mixed")),
            seed=st.integers(0, 99),
        )
    )


def _merge_inputs(case):
    r, d, dt, mag = case["rows"], case["d"], case["dtype"], case["magnitude"]
    out_a, out_b = _values(case["seed"], (r, d), dt), _values(case["seed"] + 1, (r, d), dt)
    lse_a = _values(case["seed"] + 2, (r,), dt, mag)
    lse_b = _values(case["seed"] + 3, (r,), dt, mag)
    empty = case["empty"]
    rows = torch.arange(r)
    for part, lse, out in (("a", lse_a, out_a), ("b", lse_b, out_b)):
        hit = (rows >= 0) if empty in (part, "both") else (rows % 2 == (part == "b")) if empty == "mixed" else rows < 0
        lse[hit] = float("-inf")
        out[hit] = 0.0  # a part that saw no key has output 0
    return out_a, lse_a, out_b, lse_b


def _judge_merge(fn, case):
    out_a, lse_a, out_b, lse_b = _merge_inputs(case)
    a, la, b, lb = (t.double() for t in (out_a, lse_a, out_b, lse_b))
    lse = torch.logaddexp(la, lb)
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    want = a * torch.exp(la - finite)[:, None] + b * torch.exp(lb - finite)[:, None]
    got = fn(out_a, lse_a, out_b, lse_b)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return "return the pair (out, lse)"
    out, got_lse = got
    if out.dtype != out_a.dtype:
        return f"out came back as {out.dtype}, the inputs are {out_a.dtype}"
    if torch.isnan(out).any() or torch.isnan(got_lse).any():
        return (
            "the result has NaN: exp of a large log-sum-exp overflows (weigh each part by exp(lse_part - lse), "
            "never exp(lse_part) itself) and a row with no key anywhere must give out 0, lse -inf"
        )
    if not (_close(out, want, case["dtype"]) and _close(got_lse, lse, case["dtype"])):
        return "out or lse differs from the merged attention (computed in float64)"
    return None


def _describe_merge(case):
    return (
        f"{case['rows']} rows, head dim {case['d']}, {case['dtype']}, log-sum-exps of size ~{case['magnitude']:g}, "
        f"empty part(s): {case['empty']}"
    )


# ---- 08.router ---------------------------------------------------------------------------------


def _router_cases():
    st = _st()
    return st.integers(2, 8).flatmap(
        lambda e: st.fixed_dictionaries(
            dict(
                tokens=st.integers(1, 6),
                experts=st.just(e),
                k=st.integers(1, min(3, e)),
                dtype=st.sampled_from((torch.float32, torch.float64)),
                magnitude=st.sampled_from((1.0, 1e3, 1e4)),
                seed=st.integers(0, 99),
            )
        )
    )


def _judge_router(fn, case):
    logits = _values(case["seed"], (case["tokens"], case["experts"]), case["dtype"], case["magnitude"])
    probs = torch.softmax(logits.double(), dim=-1)
    top, chosen = probs.topk(case["k"], dim=-1)
    weights = top if case["k"] == 1 else top / top.sum(-1, keepdim=True)
    got = fn(logits, case["k"])
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return "return the pair (weights, chosen)"
    got_w, got_c = got
    if torch.isnan(got_w).any():
        return (
            "the weights have NaN: exp of large logits overflows. Subtract each row's maximum before "
            "exponentiating (`torch.softmax` does)"
        )
    e = case["experts"]
    route = lambda w, c: torch.zeros(w.shape[0], e, dtype=torch.float64).scatter_add(1, c.long(), w.double())  # noqa: E731
    if not _close(route(got_w.detach(), got_c), route(weights, chosen), case["dtype"]):
        return "the routing weights differ from softmax(logits) over the top k (renormalised for k > 1)"
    return None


def _describe_router(case):
    return (
        f"logits of shape ({case['tokens']}, {case['experts']}) and size ~{case['magnitude']:g}, k={case['k']}, "
        f"{case['dtype']}"
    )


# ---- 09.group_ranks ----------------------------------------------------------------------------

MESH_AXES = ("dp", "pp", "ep", "cp", "tp")


def _group_cases():
    st = _st()

    def mesh(axes):
        return st.fixed_dictionaries(
            dict(
                sizes=st.fixed_dictionaries({a: st.integers(1, 3) for a in axes}),
                order=st.permutations(axes),
                joint=st.lists(st.sampled_from(axes), min_size=1, max_size=min(3, len(axes)), unique=True),
            )
        )

    return st.lists(st.sampled_from(MESH_AXES), min_size=1, max_size=5, unique=True).flatmap(mesh)


def _judge_group(fn, case):
    from ultrascale_grading.guards import without_library
    from ultrascale.parallel.mesh import Mesh

    sizes = {a: case["sizes"][a] for a in case["order"]}  # the dict in the drawn order
    axis = case["joint"][0] if len(case["joint"]) == 1 else tuple(case["joint"])
    want = Mesh(**sizes).group_ranks(axis)
    fn = without_library(fn, [Mesh.group_ranks, Mesh.grid, Mesh.coordinate, Mesh.rank_of], "09.group_ranks")
    got = [list(map(int, g)) for g in fn(dict(sizes), axis)]
    return None if got == want else f"expected {want}, got {got}"


def _describe_group(case):
    sizes = {a: case["sizes"][a] for a in case["order"]}
    axis = case["joint"][0] if len(case["joint"]) == 1 else tuple(case["joint"])
    return f"group_ranks({sizes}, {axis!r})"


# ---- 11.online_softmax_update -------------------------------------------------------------------


def _online_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            rows=st.integers(1, 3),
            blocks=st.lists(st.integers(1, 4), min_size=1, max_size=3),
            d=st.integers(1, 3),
            dtype=st.sampled_from((torch.float32, torch.float64)),
            magnitude=st.sampled_from((1.0, 100.0, 1e4)),
            masked=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


def _judge_online(fn, case):
    rows, blocks, dt = case["rows"], case["blocks"], case["dtype"]
    n = sum(blocks)
    scores = _values(case["seed"], (rows, n), dt, case["magnitude"])
    values = _values(case["seed"] + 1, (n, case["d"]), dt)
    if case["masked"] and n > blocks[0]:
        scores[:, -1] = float("-inf")  # a masked key after the first block (never a whole first block)
    m = torch.full((rows,), float("-inf"), dtype=dt)
    l, acc = torch.zeros(rows, dtype=dt), torch.zeros(rows, case["d"], dtype=dt)
    start = 0
    for size in blocks:
        out = fn(m, l, acc, scores[:, start : start + size], values[start : start + size])
        if not (isinstance(out, (tuple, list)) and len(out) == 3):
            return "return (m_new, l_new, acc_new)"
        m, l, acc = out
        start += size
    if not (torch.isfinite(l).all() and torch.isfinite(acc).all()):
        return (
            "l or acc is inf or NaN: exponentiate s - m_new, never s itself (nor exp(s) / exp(m)), and "
            "rescale the old l and acc by exp(m - m_new)"
        )
    want = torch.softmax(scores.double(), dim=1) @ values.double()
    if acc.dtype != dt or not _close(acc / l[:, None], want, dt):
        return f"acc / l differs from softmax(s) @ v (computed in float64), or is not {dt}"
    return None


def _describe_online(case):
    return (
        f"{case['rows']} row(s), key blocks of {case['blocks']}, head dim {case['d']}, {case['dtype']}, scores of "
        f"size ~{case['magnitude']:g}{', the last key masked' if case['masked'] else ''}"
    )


# ---- 12.quantize_per_tensor ----------------------------------------------------------------------


def _quantize_cases():
    st = _st()
    return st.fixed_dictionaries(
        dict(
            shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
            fp8=st.sampled_from((torch.float8_e4m3fn, torch.float8_e5m2)),
            dtype=st.sampled_from(FLOATS),
            exponent=st.integers(-10, 30),
            zero=st.booleans(),
            seed=st.integers(0, 99),
        )
    )


def _judge_quantize(fn, case):
    fp8 = case["fp8"]
    x = _values(case["seed"], case["shape"], case["dtype"], 10.0 ** case["exponent"])
    if case["zero"]:
        x = torch.zeros_like(x)
    got = fn(x, fp8)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return "return the pair (q, scale)"
    q, scale = got
    if not torch.is_tensor(q) or q.dtype != fp8 or tuple(q.shape) != tuple(x.shape):
        return f"q must be a {tuple(x.shape)} tensor of {fp8}"
    scale = torch.as_tensor(scale).double()
    if scale.numel() != 1 or not (torch.isfinite(scale).all() and (scale > 0).all()):
        return f"the scale must be one finite positive number, got {scale.flatten()[:3].tolist()}"
    deq = q.double() * scale
    if case["zero"]:
        return None if bool((deq == 0).all()) else "an all-zero tensor must quantize to zeros"
    top = torch.finfo(fp8).max
    if q.double().abs().max().item() != top:
        return (
            f"the largest |x| must land on {fp8}'s largest value, {top:g}, but lands on "
            f"{q.double().abs().max().item():g} (each FP8 format has its own maximum: torch.finfo(dtype).max)"
        )
    rel = 2.0 ** -(3 if fp8 == torch.float8_e4m3fn else 2)  # half an ulp at the format's mantissa width
    tiny = torch.finfo(fp8).smallest_normal
    if not bool(((deq - x.double()).abs() <= rel * x.double().abs() + tiny * scale).all()):
        return "q * scale is farther from x than FP8's rounding allows"
    return None


def _describe_quantize(case):
    shape = tuple(case["shape"])
    return (
        f"x of shape {shape}{' (0-d)' if not shape else ''}, {case['dtype']}, "
        + ("all zeros" if case["zero"] else f"values of size ~1e{case['exponent']}")
        + f", to {case['fp8']}"
    )


PROPERTIES = {
    "03.flatten_padded": Property(_flatten_cases, _judge_flatten, _describe_flatten),
    "06.merge_partial_attention": Property(_merge_cases, _judge_merge, _describe_merge),
    "08.router": Property(_router_cases, _judge_router, _describe_router),
    "09.group_ranks": Property(
        _group_cases,
        _judge_group,
        _describe_group,
        examples=(
            # a size-1 axis inside a joint group of three axes, named out of mesh order
            dict(sizes=dict(dp=2, pp=1, cp=2, tp=2), order=["tp", "dp", "pp", "cp"], joint=["tp", "pp", "dp"]),
        ),
    ),
    "11.online_softmax_update": Property(_online_cases, _judge_online, _describe_online),
    "12.quantize_per_tensor": Property(
        _quantize_cases,
        _judge_quantize,
        _describe_quantize,
        examples=(
            # amax of 1e-9: below float32's eps, so an amax floor at eps instead of 1e-12 is always tried
            dict(shape=[3, 2], fp8=torch.float8_e4m3fn, dtype=torch.float32, exponent=-9, zero=False, seed=0),
        ),
    ),
}

# The formula and schedule exercises' properties (no ranks: many draws are cheap) live beside these.
from ultrascale_grading.exercise_tests.properties_formulas import PROPERTIES as _FORMULAS  # noqa: E402

PROPERTIES.update(_FORMULAS)

# Those of exercises on lists of tensors, traces, clocks, layouts, models, and the first on ranks.
from ultrascale_grading.exercise_tests.properties_more import PROPERTIES as _MORE  # noqa: E402

PROPERTIES.update(_MORE)

# Those of the exercises the modules above left without one (and, in its docstring, why some have none).
from ultrascale_grading.exercise_tests.properties_rest import PROPERTIES as _REST  # noqa: E402

PROPERTIES.update(_REST)

# Those of the checkpoint exercises (appendix A4).
from ultrascale_grading.exercise_tests.properties_checkpoints import PROPERTIES as _CHECKPOINTS  # noqa: E402

PROPERTIES.update(_CHECKPOINTS)

# Those of the two Triton kernels, the ring step, a trace's overlap, the smallest pipeline and the atomic save.
from ultrascale_grading.exercise_tests.properties_last import PROPERTIES as _LAST  # noqa: E402

PROPERTIES.update(_LAST)

# Those of the exercises that are a whole training step on ranks (few draws: each is a run).
from ultrascale_grading.exercise_tests.properties_steps import PROPERTIES as _STEPS  # noqa: E402

PROPERTIES.update(_STEPS)
