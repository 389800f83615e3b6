"""Tests of the chapter 9 exercises (solutions/09_5d_parallelism_exercises.ipynb).

* ``09.group_ranks``: ``group_ranks(sizes, axis)``, the rank-to-group map of a mesh with the
  axes dp, pp, ep, cp, tp (tp innermost), for one axis or a tuple of axes (named in any order),
  against ``Mesh.group_ranks`` on many meshes whose sizes are given in any order (``Mesh``'s own
  layout code refuses to run meanwhile).
* ``09.pp_activations``: ``pp_activations(per_layer, layers, pp, micro_batches, schedule)``, the
  activation bytes of the busiest pipeline stage under AFAB or 1F1B, in-flight micro-batches
  included, against ``memory.pp_in_flight`` (the simulator's count).
* ``09.rank_parameters``: ``rank_parameters(config, tp, pp, stage)``, exactly how many parameters
  one rank of a TP x PP course GPT holds, against ``compose.rank_parameters`` (itself checked
  against built models in tests/test_compose.py and the chapter).
* ``09.quiz``: answers to ``methods.quiz()``'s questions, graded against the tables' data.
"""

from __future__ import annotations

import math

from ultrascale_grading import exercise
from ultrascale_grading.guards import call_learner, without_library

MESHES = [
    dict(tp=4),
    dict(dp=2, tp=2),
    dict(dp=2, pp=2, tp=2),
    dict(pp=2, cp=2),
    dict(dp=2, ep=2, tp=3),
    dict(dp=3, pp=2),
    dict(dp=2, pp=2, ep=2, cp=2, tp=2),
    dict(tp=2, dp=2, pp=2),
    dict(cp=2, pp=3, dp=2),
]
MESH_ORDER = ("dp", "pp", "ep", "cp", "tp")


def _axes_to_try(axes) -> list:
    """Every axis alone, then joint groups: the two outermost axes, and the innermost with the
    outermost named in reverse order (not neighbours, and not in mesh order)."""
    joint = [tuple(axes[:2])] if len(axes) > 2 else []
    if len(axes) > 1:
        joint.append((axes[-1], axes[0]))
    return list(axes) + joint


# ---- 09.group_ranks ---------------------------------------------------------------------


@exercise("09.group_ranks", points=1)
def test_group_ranks(group_ranks, quick: bool = True):
    """Every axis (and a few joint ones) of meshes of 2 to 32 ranks, sizes given in any order."""
    from ultrascale.parallel.mesh import Mesh

    fn = without_library(
        group_ranks,
        [Mesh.group_ranks, Mesh.grid, Mesh.coordinate, Mesh.rank_of],
        "09.group_ranks",
        "number the ranks along dp, pp, ep, cp, tp yourself",
    )
    for sizes in MESHES:
        mesh = Mesh(**sizes)
        for axis in _axes_to_try(mesh.axes):
            call = f"group_ranks({sizes}, {axis!r})"
            want = mesh.group_ranks(axis)
            got = call_learner(fn, dict(sizes), axis, call=call, expected=str(want))
            got = [list(map(int, g)) for g in got]
            if sorted(map(sorted, got)) == sorted(map(sorted, want)):
                assert got == want, (
                    f"{call}: the right groups, but listed as {got} rather than {want}: give the "
                    "groups in rank order, and each group's ranks in increasing order" + _order_hint(got, sizes, axis)
                )
                continue
            raise AssertionError(f"{call}: expected {want}, got {got}.{_numbering_hint(got, sizes, axis)}")


def _numbering_hint(got, sizes, axis) -> str:
    """Name the mistake when ``got`` is what another numbering of the ranks gives."""
    same = lambda a, b: sorted(map(sorted, a)) == sorted(map(sorted, b))  # noqa: E731
    if len(sizes) < 2:
        return ""
    if same(got, _groups(sizes, axis, MESH_ORDER[::-1])):
        return (
            " These are the groups with tp *outermost*. The order is dp, pp, ep, cp, tp with tp "
            "innermost (fastest varying): ranks 0 and 1 are neighbours in one tp group."
        )
    if list(sizes) != [a for a in MESH_ORDER if a in sizes] and same(got, _groups(sizes, axis, list(sizes))):
        return (
            f" These are the groups with the axes numbered in the order the sizes dict lists them, {list(sizes)}. "
            "Whatever order the dict has, the mesh's order is dp, pp, ep, cp, tp (tp innermost)."
        )
    return ""


def _order_hint(got, sizes, axis) -> str:
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if len(axes) > 1 and got == _groups(sizes, axis, MESH_ORDER, group_order=axes):
        in_mesh = tuple(a for a in MESH_ORDER if a in axes)
        return (
            f". You ordered each group's ranks by the axes as the tuple names them, {axes}; their order in the "
            f"mesh (dp, pp, ep, cp, tp) decides, so {axes} and {in_mesh} give the same groups"
        )
    return ""


def _groups(sizes, axis, order, group_order=None):
    """The groups if the ranks were numbered along ``order`` (outermost first), each group's
    ranks taken in ``group_order`` of its axes (default: ``order``)."""
    import torch

    order = [a for a in order if a in sizes]
    grid = torch.arange(math.prod(sizes.values())).view([sizes[a] for a in order])
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    dims = [order.index(a) for a in (group_order or sorted(axes, key=order.index))]
    others = [d for d in range(len(order)) if d not in dims]
    return grid.permute(others + dims).reshape(-1, math.prod(sizes[a] for a in axes)).tolist()


# ---- 09.pp_activations ------------------------------------------------------------------


def reference_pp_activations(per_layer, layers, pp, micro_batches, schedule):
    from ultrascale.memory import pp_in_flight

    return per_layer * math.ceil(layers / pp) * max(pp_in_flight(schedule, pp, micro_batches))


@exercise("09.pp_activations", points=1)
def test_pp_activations(pp_activations, quick: bool = True):
    """AFAB and 1F1B, m below, equal to and above pp, layers that do and do not divide."""
    from ultrascale import memory

    fn = without_library(
        pp_activations,
        [memory.pp_in_flight, memory.breakdown],
        "09.pp_activations",
        "count the micro-batches in flight from the schedule's order",
    )
    cases = ((8, 2, 4), (8, 4, 2), (8, 4, 8), (6, 4, 4), (32, 8, 16), (5, 2, 1), (4, 1, 3))
    for schedule in ("afab", "1f1b"):
        for (layers, pp, m), per_layer in zip(cases, (1000, 3, 2**20, 1000, 7, 1000, 12)):  # bytes used, not assumed
            call = (
                f"pp_activations(per_layer={per_layer}, layers={layers}, pp={pp}, micro_batches={m}, "
                f"schedule={schedule!r})"
            )
            want = reference_pp_activations(per_layer, layers, pp, m, schedule)
            got = call_learner(fn, per_layer, layers, pp, m, schedule, call=call, expected=str(want))
            if got == want:
                continue
            stage = per_layer * math.ceil(layers / pp)
            hint = ""
            if got == stage:
                hint = (
                    " That is one micro-batch of the stage's layers: the pipeline holds several in flight "
                    "(AFAB all m of them, 1F1B min(pp, m) on the first stage)."
                )
            elif got == stage * m and schedule == "1f1b":
                hint = " 1F1B frees a micro-batch after each backward: the first stage holds min(pp, m), not m."
            elif got == stage * pp and m < pp:
                hint = " With fewer micro-batches than stages, only m can be in flight."
            elif got == per_layer * layers / pp * min(pp, m):
                hint = " A stage has ceil(layers / pp) layers: the first stages take the extra ones."
            raise AssertionError(f"{call}: expected {want}, got {got}.{hint}")


# ---- 09.rank_parameters -----------------------------------------------------------------


@exercise("09.rank_parameters", points=1)
def test_rank_parameters(rank_parameters, quick: bool = True):
    """Every stage of GPT configs under TP 1, 2, 4 and PP 1 to 4."""
    from ultrascale.model import GPTConfig, count_params
    from ultrascale.parallel import compose

    fn = without_library(
        rank_parameters,
        [compose.rank_parameters],
        "09.rank_parameters",
        "count the blocks, the embedding and the norms of the stage",
    )
    for config in (
        GPTConfig(),
        GPTConfig(vocab_size=64, hidden=32, heads=4, layers=4),
        GPTConfig(vocab_size=512, hidden=128, heads=8, layers=6),
    ):
        for tp in (1, 2, 4):
            for pp in (p for p in (1, 2, 3, 4) if p <= config.layers):  # a stage needs a block
                for stage in range(pp):
                    call = f"rank_parameters({config}, tp={tp}, pp={pp}, stage={stage})"
                    want = compose.rank_parameters(config, tp=tp, pp=pp, stage=stage)
                    got = call_learner(fn, config, tp=tp, pp=pp, stage=stage, call=call, expected=str(want))
                    if got == want:
                        continue
                    hint = ""
                    if math.isclose(got, count_params(config) / (tp * pp)):
                        hint = (
                            " That is the calculator's even split. Count the stage's own blocks; the "
                            "embedding on the first and the last stage; norms and row-parallel biases "
                            "are whole on every tp rank."
                        )
                    raise AssertionError(f"{call}: expected {want}, got {got}.{hint}")


# ---- 09.quiz ----------------------------------------------------------------------------


@exercise("09.quiz", points=1)
def test_quiz(quiz_answers, quick: bool = True):
    """Each question of ``methods.quiz()`` answered: a set of method names, or one name.
    ``quiz_answers()`` returns ``{question: answer}`` (the tables' functions refuse to run meanwhile)."""
    from ultrascale import methods

    fn = without_library(
        quiz_answers,
        [methods.quiz, methods.memory_savings, methods.summary_rows],
        "09.quiz",
        "answer from the tables in chapter 09",
    )
    answers = call_learner(fn, call="quiz_answers()", expected="a dict {question: answer}")

    assert isinstance(answers, dict), f"answers should be a dict {{question: answer}}, got {type(answers).__name__}"
    wrong = []
    for question, want in methods.quiz().items():
        assert question in answers, f"no answer to {question!r}"
        got = answers[question]
        got = set(got) if isinstance(want, set) and not isinstance(got, str) else got
        if got != want:
            wrong.append(question)
    assert not wrong, (
        f"{len(wrong)} of {len(methods.quiz())} answers are wrong: "
        + "; ".join(wrong)
        + ". The summary table's 'saves memory of' column comes from memory.breakdown: "
        "look at which consumers shrink."
    )
