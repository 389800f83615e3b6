"""A submission scores what its code earns (issue 11): the grader does not believe the notebook.

* forged verdict lines in the grade file, ids no test is registered under, points above an
  exercise's worth, and tests swapped in the kernel's registry all score nothing;
* a pass counts only when the grader's own run of the registered test passes, on what the
  notebook's check() was given;
* the ban on built-in collectives in the ring exercises covers torch.distributed's functions,
  the process group's methods and the c10d operators.

The fast tests stand in for papermill (no kernel); one test runs a forged notebook for real.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch
import torch.distributed as dist

from ultrascale_grading import FAIL, NOT_IMPLEMENTED, PASS, check, cli, registry
from ultrascale_grading.check import ERROR, GRADE_FILE_ENV, NOT_RUN, SUBMITTED, submission_path
from ultrascale_grading.guards import ForbiddenCall, forbid_collectives

REPO = Path(__file__).resolve().parents[1]
CH00 = ("00.mean_across_ranks", "00.pipeline_stage_layers", "00.memory_per_stage")


def _in_main(source: str, name: str):
    """A function defined as a notebook defines it (in ``__main__``): cloudpickle ships it by value."""
    namespace = {"__name__": "__main__"}
    exec(compile(source, "<notebook cell>", "exec"), namespace)
    return namespace[name]


def _forge(grade_file: str, *records) -> None:
    with open(grade_file, "a") as f:
        for exercise_id, points in records:
            f.write(
                json.dumps(
                    {"exercise": exercise_id, "status": PASS, "points": points, "max_points": points, "message": ""}
                )
                + "\n"
            )


def _submit(grade_file: str, exercise_id: str, *objects, **kwargs) -> None:
    """What check() saves under the grader, written by hand (as a forging notebook could)."""
    path = submission_path(grade_file, exercise_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cloudpickle.dumps((objects, kwargs)))


def _grade_with(monkeypatch, cells, feedback: bool = False) -> cli.NotebookReport:
    """Grade solutions/00's notebook, with papermill replaced by ``cells(grade_file)``."""
    import papermill

    def fake_execute(input_path, output_path, **kwargs):
        cells(os.environ[GRADE_FILE_ENV])
        nb = nbformat.read(input_path, as_version=4)
        nbformat.write(nb, output_path)
        return nb

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    return cli.grade_notebook(
        REPO / "solutions" / "00_orientation_exercises.ipynb",
        timeout=120,
        parameters={"QUICK": True},
        feedback=feedback,
    )


def _rows(report) -> dict:
    return {e["exercise"]: e for e in report.exercises}


# wrong (every stage gets every layer), but no stub: check() tells a stub "not implemented" before any test runs
WRONG_SPLIT = "def pipeline_stage_layers(num_layers, pp):\n    return [num_layers] * pp\n"


@pytest.mark.parametrize("feedback", [True, False], ids=["tests-in-kernel-too", "deferred"])
def test_forged_lines_unknown_ids_and_a_swapped_registry_score_nothing(monkeypatch, feedback):
    def cells(grade_file):
        # A cell swaps the test for one that passes anything, then checks a wrong answer...
        real = registry.get_exercise("00.pipeline_stage_layers")
        registry._REGISTRY[real.id] = registry.Exercise(real.id, real.points, lambda *a, **k: None)
        try:
            status = check(real.id, _in_main(WRONG_SPLIT, "pipeline_stage_layers")).status
            assert status == (PASS if feedback else SUBMITTED)  # fooled here, when the kernel runs the test
        finally:
            registry._REGISTRY[real.id] = real
        # ... and another writes verdicts straight into the grade file.
        _forge(grade_file, *[(e, 1000) for e in CH00], ("00.bonus", 1000), ("zz.not_an_exercise", 5))

    report = _grade_with(monkeypatch, cells, feedback)
    rows = _rows(report)
    assert list(rows) == list(CH00), "ids without a registered test must not appear"
    assert (report.points, report.max_points) == (0, 3)
    assert rows["00.pipeline_stage_layers"]["status"] == FAIL  # the real test, on the wrong answer
    assert {rows[e]["status"] for e in ("00.mean_across_ranks", "00.memory_per_stage")} == {ERROR}
    assert "not when the grader ran the test itself" in rows["00.memory_per_stage"]["message"]


def test_a_pass_is_the_graders_own_and_worth_its_registered_points(monkeypatch):
    from ultrascale_grading.exercise_tests import ch00

    wrong = _in_main(
        "def memory_per_stage(num_layers, pp, h, v, bytes_per_param=16):\n    return [0] * pp\n", "memory_per_stage"
    )

    def cells(grade_file):
        _submit(grade_file, "00.pipeline_stage_layers", ch00.reference_stage_layers, quick=True)
        _submit(grade_file, "00.memory_per_stage", wrong, quick=True)
        _forge(grade_file, ("00.pipeline_stage_layers", 1000), ("00.memory_per_stage", 1000))

    report = _grade_with(monkeypatch, cells)
    rows = _rows(report)
    assert rows["00.pipeline_stage_layers"]["status"] == PASS
    assert rows["00.pipeline_stage_layers"]["points"] == 1  # the registry's 1, not the claimed 1000
    assert rows["00.memory_per_stage"]["status"] == FAIL and rows["00.memory_per_stage"]["points"] == 0
    assert rows["00.mean_across_ranks"]["status"] == NOT_RUN
    assert (report.points, report.max_points) == (1, 3)


FORGERY_CELL = """
import json, os
from ultrascale_grading.exercise_tests import ch00
from ultrascale_grading import registry

# One exercise really solved: worth its one point.
def pipeline_stage_layers(num_layers, pp):
    return ch00.reference_stage_layers(num_layers, pp)
check("00.pipeline_stage_layers", pipeline_stage_layers, quick=QUICK)

# The tests of the others swapped for ones that pass anything, then the stubs checked.
for eid in ("00.mean_across_ranks", "00.memory_per_stage"):
    registry._REGISTRY[eid] = registry.Exercise(eid, 1000, lambda *a, **k: None)
check("00.mean_across_ranks", mean_across_ranks, world_size=WORLD_SIZE, quick=QUICK, seed=SEED)
check("00.memory_per_stage", memory_per_stage, quick=QUICK)

# And verdicts written straight into the grade file, one for an exercise that does not exist.
with open(os.environ["ULTRASCALE_GRADE_FILE"], "a") as f:
    for eid in ("00.mean_across_ranks", "00.pipeline_stage_layers", "00.memory_per_stage", "00.bonus"):
        f.write(json.dumps({"exercise": eid, "status": "pass", "points": 1000, "max_points": 1000}) + "\\n")
"""


@pytest.mark.slow
def test_a_forging_notebook_scores_what_its_code_earns(tmp_path):
    notebook = tmp_path / "00_orientation_exercises.ipynb"
    shutil.copy(REPO / "exercises" / notebook.name, notebook)
    nb = nbformat.read(notebook, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(FORGERY_CELL))
    nbformat.write(nb, notebook)

    report = cli.grade_notebook(notebook, timeout=300, parameters={"QUICK": True})
    rows = _rows(report)
    assert report.status == "ok", report.error
    assert list(rows) == list(CH00)
    assert (report.points, report.max_points) == (1, 3), rows
    assert rows["00.pipeline_stage_layers"]["status"] == PASS
    assert rows["00.mean_across_ranks"]["status"] == NOT_IMPLEMENTED
    assert rows["00.memory_per_stage"]["status"] == NOT_IMPLEMENTED


# ---- the ban on built-in collectives --------------------------------------------------------


def _every_door(ctx):
    """Try each way to a collective under the ban; then a ring exchange, which must work."""
    import torch.distributed._functional_collectives as funcol

    doors = {
        "dist.all_reduce": lambda t: dist.all_reduce(t),
        "dist.all_gather_into_tensor": lambda t: dist.all_gather_into_tensor(torch.empty(2 * t.numel()), t),
        "ProcessGroup.allreduce": lambda t: ctx.group.allreduce([t]).wait(),
        "Backend.allreduce": lambda t: ctx.group._get_backend(t.device).allreduce([t]).wait(),
        "functional all_reduce": lambda t: funcol.wait_tensor(funcol.all_reduce(t, "sum", ctx.group)),
        "torch.ops._c10d_functional.all_reduce": lambda t: torch.ops._c10d_functional.all_reduce(
            t, "sum", ctx.group.group_name
        ),
        "torch.ops.c10d.allgather_": lambda t: torch.ops.c10d.allgather_(
            [[torch.empty_like(t) for _ in range(ctx.world_size)]], [t], ctx.group.boxed(), False, -1
        )[1].wait(),
    }
    refused = {}
    with forbid_collectives("a0.test", "build it from sends and receives"):
        for name, door in doors.items():
            try:
                door(torch.ones(4))
                refused[name] = "went through"
            except ForbiddenCall as err:
                refused[name] = str(err)
            except Exception as err:  # noqa: BLE001 - anything but the ban is a hole
                refused[name] = f"{type(err).__name__}: {err}"
        n, me = ctx.world_size, ctx.rank
        outgoing, incoming = torch.tensor([float(me)]), torch.empty(1)
        ops = [dist.P2POp(dist.isend, outgoing, (me + 1) % n), dist.P2POp(dist.irecv, incoming, (me - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.barrier()
    after = torch.ones(1)
    ctx.group.allreduce([after]).wait()  # everything is back once the ban is lifted
    return refused, incoming.item(), after.item()


def test_the_collective_ban_closes_every_door_and_leaves_sends_open():
    from ultrascale.runtime import Cluster

    with Cluster(2) as cluster:
        for rank, (refused, incoming, after) in enumerate(cluster.run(_every_door, timeout=60)):
            for door, what in refused.items():
                assert what.startswith("a0.test called "), f"rank {rank}, {door}: {what}"
            assert incoming == float(1 - rank) and after == 2.0


def _load_a0() -> dict:
    """The a0 solution notebook's functions, defined in ``__main__`` as in a notebook."""
    namespace = {"__name__": "__main__"}
    kinds = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
    for cell in nbformat.read(REPO / "solutions" / "a0_collectives_exercises.ipynb", as_version=4).cells:
        if cell.cell_type == "code":
            body = [node for node in ast.parse(cell.source).body if isinstance(node, kinds)]
            exec(compile(ast.Module(body=body, type_ignores=[]), "a0", "exec"), namespace)
    return namespace


def test_a_ring_that_calls_the_process_group_all_reduce_scores_zero():
    solution = _load_a0()["ring_all_reduce"]

    def ring_all_reduce(ctx, tensor):
        solution(ctx, tensor)  # the traffic of a ring, for show
        total = tensor.clone()
        ctx.group.allreduce([total]).wait()  # and the answer from the built-in collective
        return total

    result = check("a0.ring_all_reduce", ring_all_reduce)
    assert result.status == FAIL and "ProcessGroup.allreduce" in result.message, result
