"""Tests of the A4 exercises (solutions/a4_checkpoints_and_failures_exercises.ipynb).

* ``a4.reshard_optimizer_state``: ``reshard_optimizer_state(states, shapes, new_world_size)`` turns
  the ZeRO optimizer states saved by every old rank (a padded flat shard per state, and Adam's step
  count) into those of ``new_world_size`` ranks. ``states`` maps ``"rank<r>"`` to a rank's state in no
  particular order, as a directory listing comes; the old padding holds a value no parameter has.
  Checked against a reference on world sizes 1 to 12 (12: names sorted as strings put ``rank10``
  before ``rank2``), totals smaller than the ranks, 0-d parameters, float64, float32 and bf16. Named
  mistakes: shards in the dict's or the names' string order, the old padding kept, no new padding,
  the step count dropped or restarted.
* ``a4.resume_samples``: ``resume_samples(checkpoint, global_batch, rank, dp, pp=1, tp=1)``, the
  sample indices a rank of a (dp, pp, tp) mesh trains on in the first step after a resume: its
  dp group's share of the next ``global_batch`` samples from the checkpoint's ``next_sample``. Named
  mistakes: the data restarted at sample 0, the position rebuilt from the step count (the global
  batch grew during warm-up), the global rank or the wrong axis taken for the dp index, the old world
  size's share, interleaved rows, floats at positions past 2**53; a global batch the dp ranks do not
  divide must raise ``ValueError``.
* ``a4.checkpoint_interval``: ``checkpoint_interval(checkpoint_s, node_mtbf_s, nodes)``, Daly's
  interval for the whole job (MTBF of a node over the number of nodes), M itself once C >= 2M.
  Checked to 1e-9 against the formula on published-scale jobs, the boundary C = 2M and random
  inputs; Young's first-order interval, Daly's without its ``- C``, a node's MTBF taken for the job's
  and a missing C >= 2M branch are named.

* ``a4.flat_boxes``: ``flat_boxes(shape, start, stop)``, elements ``start:stop`` of a flattened
  row-major tensor as the fewest boxes ``(offsets, sizes)`` in flat order (what ZeRO's flat run of a
  parameter becomes in DCP). Each box is checked to lie in the tensor and to be one run of
  consecutive elements, the boxes to tile the run in order, and their number against the fewest
  possible (the library's count, which tests/test_grader_holes_a4.py proves minimal on every run of
  every shape up to 4 x 4 x 4). 0-d, 1-D, 2-D and 3-D tensors, runs inside one row, across rows,
  of whole rows, empty, and a shape of 4096 x 4096 x 8 (a loop over elements is too slow there).

While the learner's functions run, ``ultrascale.checkpoint.failures``' interval functions refuse to
be called. Saving a checkpoint atomically (``a4.atomic_save``) is tested in ``cha4_atomic_save.py``.
"""

from __future__ import annotations

import math
import random
from numbers import Integral, Real

import torch

from ultrascale.checkpoint import failures, pieces
from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner, expect_value_error, without_library


# ---- a4.reshard_optimizer_state ------------------------------------------------------------

OLD_PADDING = -1234.5  # what the old layout left in its padding: a value no parameter holds here


def rank_names(world_size: int) -> list[str]:
    return [f"rank{r}" for r in range(world_size)]


def reference_reshard(
    states: dict, shapes, new_world_size: int, *, order: str = "rank", strip: bool = True
) -> list[dict]:
    """The new ranks' states. ``order`` ("rank", "listed", "string") and ``strip`` give classic
    mistakes, to recognise them (``RESHARD_MISTAKES``)."""
    numel = sum(math.prod(s) for s in shapes)
    names = {"rank": rank_names(len(states)), "listed": list(states), "string": sorted(states)}[order]
    old = [states[name] for name in names]
    shard = -(-numel // new_world_size)
    new = [{"step": old[0]["step"]} for _ in range(new_world_size)]
    for key in (k for k in old[0] if k != "step"):
        flat = torch.cat([s[key] for s in old])
        if strip:
            flat = flat[:numel]
        flat = torch.cat([flat, flat.new_zeros(max(0, shard * new_world_size - flat.numel()))])
        for r in range(new_world_size):
            new[r][key] = flat[r * shard : (r + 1) * shard].clone()
    return new


def saved_states(shapes, world_size: int, keys, dtype, seed: int) -> dict:
    """Every old rank's state, each flat state padded with ``OLD_PADDING``, the names shuffled."""
    numel = sum(math.prod(s) for s in shapes)
    shard = -(-numel // world_size)
    g = torch.Generator().manual_seed(seed)
    flats = {}
    for key in keys:
        values = torch.randn(numel, generator=g, dtype=torch.float64)
        if key == "exp_avg_sq":
            values = values.square()
        flats[key] = torch.cat([values, values.new_full((shard * world_size - numel,), OLD_PADDING)]).to(dtype)
    step = 1 + seed % 997
    states = {
        name: {"step": step, **{k: f[r * shard : (r + 1) * shard].clone() for k, f in flats.items()}}
        for r, name in enumerate(rank_names(world_size))
    }
    names = list(states)
    random.Random(seed).shuffle(names)
    if world_size > 1 and names == rank_names(world_size):  # a listing in rank order hides nothing
        names = names[1:] + names[:1]
    return {name: states[name] for name in names}


# (the reference's flags that give a classic mistake, what to say when the answer is that one)
RESHARD_MISTAKES = [
    (
        dict(order="listed"),
        "The old shards were joined in the order the dict lists them: a directory listing "
        "comes in no particular order. Put them in rank order, by the number in each name",
    ),
    (
        dict(order="string"),
        "The old shards were joined in the order of their names sorted as strings, which "
        "puts 'rank10' before 'rank2': sort by the rank number",
    ),
    (
        dict(strip=False),
        "The old layout's padding is still there: it belongs to no parameter. Keep the first "
        "sum-of-numels elements of the joined shards, then pad for the new world size",
    ),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


def judge_reshard(got, states, shapes, n, call: str) -> None:
    want = reference_reshard(states, shapes, n)
    assert isinstance(got, (list, tuple)) and len(got) == n, (
        f"{call} returned {type(got).__name__}{f' of length {len(got)}' if hasattr(got, '__len__') else ''}; "
        f"return a list of {n} dicts, one per new rank, in rank order"
    )
    keys = sorted(want[0])
    numel = sum(math.prod(s) for s in shapes)
    for r, (mine, right) in enumerate(zip(got, want)):
        assert isinstance(mine, dict), f"{call}: new rank {r}'s state is a {type(mine).__name__}; return dicts"
        assert "step" in mine, (
            f"{call}: new rank {r}'s state has no 'step'. That is Adam's step count: its bias correction "
            "divides by 1 - beta**step, so a resumed optimizer that forgets it takes the large first steps "
            "again. Carry it over"
        )
        assert mine["step"] == right["step"] and not isinstance(mine["step"], bool), (
            f"{call}: new rank {r}'s step is {mine['step']!r}, the checkpoint's is {right['step']}. "
            + (
                "Restarting the count at 0 is forgetting the optimizer's step: Adam's bias correction "
                "(1 - beta**step) then makes the next updates as large as the first ones. "
                if mine["step"] == 0
                else ""
            )
            + "Every rank saved the same count: carry it over"
        )
        assert sorted(mine) == keys, (
            f"{call}: new rank {r}'s state has keys {sorted(mine)}; expected {keys} (every state the old ranks "
            "saved, and the step)"
        )
        for key in keys:
            if key == "step":
                continue
            value, right_value = mine[key], right[key]
            where = f"{call}: new rank {r}'s {key!r}"
            assert torch.is_tensor(value), f"{where} is a {type(value).__name__}; return a tensor"
            shard = right_value.numel()
            if value.shape != right_value.shape:
                hint = ""
                if value.numel() == numel // n and numel % n:
                    hint = (
                        f" That is {numel} // {n} rounded down: the parameters do not split evenly, so pad "
                        "the flat state with zeros to a multiple of the new world size first"
                    )
                elif value.numel() == numel and n > 1:
                    hint = " That is the whole flat state: each new rank keeps only its own slice"
                else:
                    old_padded = sum(s[key].numel() for s in states.values())
                    if value.numel() == -(-old_padded // n):
                        hint = (
                            " That length counts the old layout's padding: drop it (the parameters hold "
                            f"{numel} elements) before padding for {n} ranks"
                        )
                raise AssertionError(
                    f"{where} has shape {tuple(value.shape)}; expected ({shard},): the "
                    f"{numel} elements padded to a multiple of {n}, split in {n}.{hint}"
                )
            assert value.dtype == right_value.dtype, (
                f"{where} is {value.dtype}; keep the saved dtype, {right_value.dtype} (an optimizer state "
                "converted on load no longer resumes the same run)"
            )
            assert value.device == right_value.device, f"{where} is on {value.device}; keep it on the saved device"
            if _same(value, right_value):
                continue
            if (value == OLD_PADDING).any() and not (right_value == OLD_PADDING).any():
                raise AssertionError(
                    f"{where} holds {OLD_PADDING}, the value the old layout left in its padding. The padding "
                    "belongs to no parameter: cut it off after joining the old shards, and pad the new "
                    "shards with zeros"
                )
            data = min(shard, max(0, numel - r * shard))  # this shard's elements that are parameters
            if torch.equal(value[:data], right_value[:data]):
                raise AssertionError(
                    f"{where}: the parameters' elements are right, but its padding (the last {shard - data}) "
                    f"holds {value[data:].tolist()[:4]}: fill it with zeros. No parameter reads it, but the "
                    "optimizer and the gradient norm go over the whole flat shard"
                )
            named = [
                why
                for flags, why in RESHARD_MISTAKES
                if _all_same(reference_reshard(states, shapes, n, **flags), got, keys)
            ]
            hint = (" " + " Or: ".join(why + "." for why in named)) if named else ""
            first = int((value != right_value).nonzero()[0, 0])
            raise AssertionError(
                f"{where} differs from the checkpoint's values at element {first} of the "
                f"shard (global element {r * shard + first} of {numel}).{hint}"
            )


def _all_same(want: list, got, keys) -> bool:
    try:
        return all(_same(g[k], w[k]) for g, w in zip(got, want) for k in keys if k != "step")
    except (KeyError, TypeError, AttributeError):
        return False


# (parameter shapes, old world size, new world size, the states saved, dtype)
RESHARD_CASES = [
    ([(2, 3), (4,)], 4, 3, ("exp_avg", "exp_avg_sq"), torch.float64),  # 10 elements: 12 padded -> 12
    ([(2, 3), (4,)], 4, 5, ("exp_avg", "exp_avg_sq"), torch.float64),  # 12 padded -> 10
    ([(3, 5), (), (7,)], 12, 5, ("exp_avg", "exp_avg_sq"), torch.float32),  # rank10, rank11; a 0-d scalar
    ([(5, 4), (3,)], 2, 2, ("exp_avg", "exp_avg_sq"), torch.float64),  # same layout: still new storage
    ([(3,)], 1, 4, ("exp_avg",), torch.bfloat16),  # fewer elements than new ranks
    ([(4, 4), (2, 2, 3), (1,)], 3, 1, ("exp_avg", "exp_avg_sq"), torch.float64),
    ([(6, 7)], 11, 4, ("momentum_buffer",), torch.float32),  # any optimizer's flat states
]


@exercise("a4.reshard_optimizer_state", points=1)
def test_reshard_optimizer_state(reshard_optimizer_state, quick: bool = True):
    """Every new rank's shards and step count against a reference, on hand-made and random layouts."""
    cases = list(RESHARD_CASES)
    rng = random.Random(4)
    for _ in range(6 if quick else 60):
        shapes = [tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 2))) for _ in range(rng.randint(1, 4))]
        cases.append((shapes, rng.randint(1, 13), rng.randint(1, 7), ("exp_avg", "exp_avg_sq"), torch.float64))
    for i, (shapes, old, new, keys, dtype) in enumerate(cases):
        states = saved_states(shapes, old, keys, dtype, seed=i)
        call = (
            f"reshard_optimizer_state(<{old} ranks' {', '.join(keys)} of {dtype}, names listed "
            f"{list(states)}>, shapes={shapes}, new_world_size={new})"
        )
        got = call_learner(reshard_optimizer_state, states, shapes, new, call=call, expected=f"{new} new ranks' states")
        judge_reshard(got, states, shapes, new, call)


# ---- a4.resume_samples ---------------------------------------------------------------------


def reference_resume(checkpoint: dict, global_batch: int, rank: int, dp: int, pp: int = 1, tp: int = 1) -> list:
    if global_batch % dp:
        raise ValueError(f"{dp} dp ranks cannot split a global batch of {global_batch}")
    share = global_batch // dp
    dp_index = rank // (pp * tp)  # dp is the outermost axis: a replica is pp * tp neighbours
    first = checkpoint["next_sample"] + dp_index * share
    return list(range(first, first + share))


def resume_mistakes(checkpoint, global_batch, rank, dp, pp, tp) -> list:
    share = global_batch // dp
    d = rank // (pp * tp)
    old = checkpoint["world_size"]
    start = checkpoint["next_sample"]
    mistakes = [
        (
            list(range(d * share, (d + 1) * share)),
            "The data started again at sample 0: the checkpoint records where the loader was, `next_sample`. A "
            "resumed run that re-reads the first samples trains on them twice and never sees the rest",
        ),
        (
            list(
                range(
                    checkpoint["step"] * global_batch + d * share, checkpoint["step"] * global_batch + (d + 1) * share
                )
            ),
            "That position is the step count times today's global batch, but the global batch was not always "
            "this size (it grew during warm-up): use the position the checkpoint recorded, `next_sample`",
        ),
        (
            list(range(start + rank * share, start + (rank + 1) * share)),
            "The global rank was taken for the rank's place in the data: the pp and tp ranks of one replica "
            "train on the same rows, so use the rank's coordinate on the dp axis (dp is the outermost axis)",
        ),
        (
            list(range(start + (rank // tp) * share, start + (rank // tp + 1) * share)),
            "rank // tp forgets the pipeline axis: one replica is pp * tp ranks, so divide by both",
        ),
        (
            list(range(start + (rank % dp) * share, start + (rank % dp + 1) * share)),
            "rank % dp is not the dp coordinate here: dp is the outermost axis, so the ranks of one replica "
            "(pp * tp of them) are neighbours",
        ),
        (
            list(range(start + d, start + global_batch, dp)),
            "The rows are interleaved (every dp-th sample): each dp rank takes a contiguous block of the "
            "step's samples, as the loader does",
        ),
    ]
    if global_batch % old == 0 and old != dp:
        old_share = global_batch // old
        mistakes.append(
            (
                list(range(start + d * old_share, start + (d + 1) * old_share)),
                "The share was computed for the checkpoint's world size: the global batch is split "
                "over the new run's dp ranks",
            )
        )
    return mistakes


# (checkpoint, global_batch, dp, pp, tp): realistic resumes, then edges
RESUME_CASES = [
    (dict(step=100, next_sample=1600, world_size=4), 16, 4, 1, 1),
    (dict(step=100, next_sample=1600, world_size=4), 16, 2, 1, 2),  # tp ranks share rows
    (dict(step=7, next_sample=60, world_size=8), 12, 2, 2, 3),  # warm-up: 4 then 12 a step
    (dict(step=7, next_sample=60, world_size=8), 12, 3, 2, 1),
    (dict(step=3, next_sample=30, world_size=2), 12, 1, 4, 1),  # one replica: everyone reads all
    (dict(step=50_000, next_sample=2**60 + 3, world_size=2048), 4096, 512, 2, 4),  # past 2**53
    (dict(step=0, next_sample=0, world_size=3), 6, 6, 1, 1),
    (dict(step=12, next_sample=135, world_size=5), 15, 5, 1, 2),  # old share 3, new 3: same
]


def check_samples(call, got, want, mistakes):
    try:
        mine = list(got)
    except TypeError:
        raise AssertionError(f"{call} returned {got!r}; return a list of sample indices") from None
    assert all(isinstance(i, Integral) and not isinstance(i, bool) for i in mine), (
        f"{call} returned {mine[:4]}...; sample indices are integers (positions reach 2**60: a float "
        "keeps only 53 bits)"
        if len(mine) > 4
        else f"{call} returned {mine}; sample indices are integers"
    )
    if mine == want:
        return
    named = [why for value, why in mistakes if mine == value]
    if not named and mine and want[0] > 2**53 and abs(mine[0] - want[0]) <= want[0] * 2**-50:
        named = [
            "Past 2**53 a float no longer holds every integer, and these positions are that far: keep "
            "the arithmetic in integers (// for the share, no /)"
        ]
    hint = (" " + " Or: ".join(why + "." for why in named)) if named else ""
    show = lambda xs: f"{xs}" if len(xs) <= 6 else f"[{xs[0]}, {xs[1]}, ..., {xs[-1]}] ({len(xs)} samples)"
    raise AssertionError(f"{call}: expected the samples {show(want)}, got {show(mine)}.{hint}")


@exercise("a4.resume_samples", points=1)
def test_resume_samples(resume_samples, quick: bool = True):
    """Every rank of hand-made and random meshes, against the reference; a batch dp does not divide refused."""
    cases = list(RESUME_CASES)
    rng = random.Random(5)
    for _ in range(10 if quick else 100):
        dp, pp, tp = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 3)
        batch = dp * rng.randint(1, 6)
        step = rng.randint(0, 10**6)
        cases.append(
            (
                dict(step=step, next_sample=step * batch - rng.randint(0, 1000) * dp, world_size=rng.randint(1, 9)),
                batch,
                dp,
                pp,
                tp,
            )
        )
    for checkpoint, batch, dp, pp, tp in cases:
        checkpoint = dict(checkpoint, next_sample=max(0, checkpoint["next_sample"]))
        for rank in range(dp * pp * tp):
            call = (
                f"resume_samples(checkpoint={checkpoint}, global_batch={batch}, rank={rank}, dp={dp}, pp={pp}, tp={tp})"
            )
            want = reference_resume(checkpoint, batch, rank, dp, pp, tp)
            got = call_learner(
                resume_samples,
                dict(checkpoint),
                batch,
                rank,
                dp,
                pp=pp,
                tp=tp,
                call=call,
                expected=f"samples {want[0]} to {want[-1]}",
            )
            check_samples(call, got, want, resume_mistakes(checkpoint, batch, rank, dp, pp, tp))
    for batch, dp in ((10, 4), (12, 5), (7, 2)):
        expect_value_error(
            resume_samples,
            dict(step=1, next_sample=batch, world_size=2),
            batch,
            0,
            dp,
            why=f"{dp} dp ranks cannot split a global batch of {batch} samples evenly (their mean "
            "losses would weigh differently)",
            call=f"resume_samples(..., global_batch={batch}, rank=0, dp={dp})",
        )


# ---- a4.checkpoint_interval ----------------------------------------------------------------

INTERVAL_FUNCTIONS = [failures.young_interval, failures.daly_interval, failures.simulate_run]


def reference_interval(checkpoint_s, node_mtbf_s, nodes) -> float:
    c, m = checkpoint_s, node_mtbf_s / nodes  # the job fails when any of its nodes does
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def _interval_mistakes(c, node_m, nodes) -> list:
    m = node_m / nodes
    young = math.sqrt(2 * c * m)
    daly_plus = reference_interval(c, node_m, nodes) + c if c < 2 * m else math.nan
    x = c / (2 * m)
    return [
        (
            young,
            "That is Young's first-order interval, sqrt(2CM): Daly's multiplies it by "
            "(1 + sqrt(C/2M)/3 + (C/2M)/9) and subtracts C",
        ),
        (daly_plus, "The final - C of Daly's formula is missing"),
        (
            reference_interval(c, node_m, 1),
            "That uses one node's MTBF: a job of `nodes` nodes stops when any of "
            "them fails, so its MTBF is node_mtbf_s / nodes",
        ),
        (
            reference_interval(c, node_m * nodes * nodes, nodes),
            "The MTBF was multiplied by the number of nodes: more nodes fail more often, so divide",
        ),
        (
            young * (1 + math.sqrt(x) / 3 + x / 9) - c if c >= 2 * m else math.nan,
            "For C >= 2M Daly's interval is M itself: the series stops being a good approximation there",
        ),
        (
            math.sqrt(2 * c * m) * (1 + math.sqrt(2 * x) / 3 + 2 * x / 9) - c if c < 2 * m else math.nan,
            "The series is in C/(2M), not C/M",
        ),
    ]


# (checkpoint_s, node_mtbf_s, nodes)
INTERVAL_CASES = [
    (60.0, 5 * 365 * 86400.0, 2048),  # Llama-3-like: 2048 nodes, a node failing every 5 years
    (10.0, 1000.0, 1),  # the chapter's cheap save
    (300.0, 600.0, 1),  # the chapter's slow save
    (300.0, 1200.0, 4),  # C > 2M: M
    (150.0, 300.0, 4),  # C = 2M exactly: M
    (0.5, 86400.0 * 365 * 10, 100_000),  # a hundred thousand nodes
    (2.0, 1e9, 3),
]


@exercise("a4.checkpoint_interval", points=1)
def test_checkpoint_interval(checkpoint_interval, quick: bool = True):
    """Daly's interval for the job to 1e-9, at published scales, on both sides of C = 2M, and at random."""
    learner = without_library(
        checkpoint_interval,
        INTERVAL_FUNCTIONS,
        "a4.checkpoint_interval",
        "write Daly's formula from the exercise's text",
    )
    cases = list(INTERVAL_CASES)
    rng = random.Random(6)
    for _ in range(20 if quick else 200):
        cases.append((10 ** rng.uniform(-1, 4), 10 ** rng.uniform(2, 9), rng.randint(1, 20_000)))
    for c, node_m, nodes in cases:
        call = f"checkpoint_interval(checkpoint_s={c:.6g}, node_mtbf_s={node_m:.6g}, nodes={nodes})"
        want = reference_interval(c, node_m, nodes)
        got = call_learner(learner, c, node_m, nodes, call=call, expected=f"{want:.6g} s")
        assert isinstance(got, Real) and not isinstance(got, bool), f"{call} returned {got!r}; return a number"
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        named = [
            why
            for value, why in _interval_mistakes(c, node_m, nodes)
            if not math.isnan(value) and math.isclose(got, value, rel_tol=1e-9)
        ]
        hint = (" " + " Or: ".join(why + "." for why in named)) if named else ""
        raise AssertionError(f"{call}: expected {want:.9g} s of compute between checkpoints, got {got:.9g}.{hint}")


# ---- a4.flat_boxes -------------------------------------------------------------------------


def box_problem(shape, box, dims: int) -> str | None:
    """What makes ``box`` not a box of ``shape`` that is one run of consecutive elements (None: it is)."""
    if not (isinstance(box, (tuple, list)) and len(box) == 2):
        return f"{box!r} is not a pair (offsets, sizes)"
    offsets, sizes = (tuple(box[0]), tuple(box[1])) if all(isinstance(b, (tuple, list)) for b in box) else ((), ())
    if len(offsets) != dims or len(sizes) != dims or not all(isinstance(v, Integral) for v in offsets + sizes):
        return (
            f"{box!r} should hold {dims} integer offsets and {dims} integer sizes, one per dimension of the "
            f"{shape} tensor (DCP stores a box of the global tensor, not of its flattened view)"
        )
    if any(o < 0 or z < 1 or o + z > d for o, z, d in zip(offsets, sizes, shape)):
        return f"{box!r} does not fit in the {shape} tensor (or has an empty side)"
    spans = [k for k in range(dims) if sizes[k] != 1 or k == dims - 1]
    k = spans[0] if spans else 0  # the dimension the run goes along; inside it, whole sub-tensors
    if any(sizes[j] != shape[j] or offsets[j] != 0 for j in range(k + 1, dims)):
        return (
            f"{box!r} is not one run of consecutive elements: after the first dimension it spans, it must take "
            "every index of the dimensions that follow (a box that starts mid-row cannot go on into the next row)"
        )
    return None


def _flat_start(shape, offsets) -> int:
    start = 0
    for o, d in zip(offsets, shape):
        start = start * d + o
    return start


# (shape, start, stop): inside one row, across rows, whole rows, 0-d, empty, long, a 405B-like weight
FLAT_BOX_CASES = [
    ((4, 5), 2, 4),
    ((4, 5), 3, 17),
    ((4, 5), 5, 15),
    ((4, 5), 0, 20),
    ((7,), 2, 6),
    ((), 0, 1),
    ((4, 5), 6, 6),
    ((2, 3, 4), 5, 19),
    ((2, 3, 4), 4, 20),
    ((2, 3, 4), 1, 23),
    ((3, 1, 4), 2, 11),
    ((1, 1, 5), 1, 4),
    ((2, 2, 2, 3), 1, 22),
    ((4096, 4096, 8), 12_345_677, 98_765_433),
    ((16384, 53248), 3, 16384 * 53248 - 5),
]


def check_flat_boxes(got, shape, start, stop, call) -> None:
    dims = len(shape)
    assert isinstance(got, (list, tuple)), f"{call} returned {type(got).__name__}; return a list of (offsets, sizes)"
    at = start
    for i, box in enumerate(got):
        problem = box_problem(shape, box, dims)
        assert problem is None, f"{call}: box {i}, {problem}"
        first = _flat_start(shape, box[0])
        assert first == at, (
            f"{call}: box {i}, {tuple(box[0])} + {tuple(box[1])}, starts at flat element {first}, but the run "
            + (f"goes on at element {at}" if i else f"starts at {start}")
            + ": the boxes come in flat order, each starting where the last one ended"
        )
        at = first + math.prod(box[1])
    assert at == stop, f"{call}: the boxes cover elements {start} to {at}, the run is {start} to {stop}" + (
        ": an empty run has no box" if start == stop else ""
    )
    fewest = len(pieces.flat_boxes(shape, start, stop))
    assert len(got) == fewest, (
        f"{call}: {len(got)} boxes where {fewest} cover the run. Take as much as one box can hold: the whole rows "
        "(or whole slabs, in more dimensions) between a partial first one and a partial last one in one box, "
        "and a run inside one row as one box"
    )


@exercise("a4.flat_boxes", points=1)
def test_flat_boxes(flat_boxes, quick: bool = True):
    """Valid boxes, in flat order, tiling the run, as few as possible; 0-d to 4-D and a 4096 x 4096 x 8 tensor."""
    learner = without_library(
        flat_boxes, [pieces.flat_boxes, pieces.Pieces], "a4.flat_boxes", "cut the run into boxes yourself"
    )
    cases = list(FLAT_BOX_CASES)
    rng = random.Random(7)
    for _ in range(20 if quick else 200):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        n = math.prod(shape)
        a = rng.randint(0, n)
        cases.append((shape, a, rng.randint(a, n)))
    for shape, start, stop in cases:
        call = f"flat_boxes(shape={shape}, start={start}, stop={stop})"
        got = call_learner(learner, shape, start, stop, call=call, expected="a list of (offsets, sizes)")
        check_flat_boxes(got, shape, start, stop, call)
