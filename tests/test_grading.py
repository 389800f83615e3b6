"""Tests of ultrascale_grading: the exercise generator, check() and the grader.

The last two tests run real notebooks through papermill (a kernel per notebook,
about 10-15 s each on 2 cores); they are marked ``slow`` and share one grader run
with tests/test_run_all.py (``graded_course`` in tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from conftest import GRADER_JOBS
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from ultrascale_grading import FAIL, NOT_IMPLEMENTED, PASS, check, exercise
from ultrascale_grading import cli, generate
from ultrascale_grading.check import DEFER_ENV, ERROR, GRADE_FILE_ENV, SUBMITTED
from ultrascale_grading.generate import GenerateError, make_exercise, stub_source

REPO = Path(__file__).resolve().parents[1]


# ---- the generator ---------------------------------------------------------------


def test_stub_replaces_regions_at_their_indentation():
    source = "\n".join(
        [
            "import math",
            "def f(x):",
            '    """Doc."""',
            "    # BEGIN SOLUTION hint: use math.sqrt",
            "    y = math.sqrt(x)",
            "    return y",
            "    # END SOLUTION",
            "class A:",
            "    def g(self):",
            "        # BEGIN SOLUTION",
            "        return 1",
            "        # END SOLUTION",
            "print(f(4))",
        ]
    )
    out = stub_source(source)
    assert out.source.splitlines() == [
        "import math",
        "def f(x):",
        '    """Doc."""',
        '    raise NotImplementedError("exercise: use math.sqrt")',
        "class A:",
        "    def g(self):",
        '        raise NotImplementedError("exercise: write your code here")',
        "print(f(4))",
    ]
    assert out.solution_lines == ["    y = math.sqrt(x)", "    return y", "        return 1"]
    compile(out.source, "<stub>", "exec")  # still valid Python


@pytest.mark.parametrize(
    "source, complaint",
    [
        ("# BEGIN SOLUTION\nx = 1", "has no END SOLUTION"),
        ("x = 1\n# END SOLUTION", "without a BEGIN SOLUTION"),
        ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION", "inside the region"),
        ("x = 1  # BEGIN SOLUTION", "malformed"),
    ],
)
def test_unbalanced_markers_are_refused(source, complaint):
    with pytest.raises(GenerateError, match=complaint):
        stub_source(source)


def _solution_nb(*cells):
    return new_notebook(
        cells=list(cells),
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )


SOLVED_CELL = "def area(r):\n    # BEGIN SOLUTION hint: pi r squared\n    return 3.14159 * r * r\n    # END SOLUTION"


def test_leak_check_refuses_a_solution_line_outside_its_region():
    nb = _solution_nb(new_code_cell(SOLVED_CELL), new_code_cell("print(3.14159 * r * r)\nreturn 3.14159 * r * r"))
    with pytest.raises(GenerateError, match="refusing to write"):
        make_exercise(nb)


def test_solution_only_cells_are_dropped_and_cannot_leak():
    secret = new_code_cell("expected_answer = area(2.0) * 17", metadata={"tags": ["solution-only"]})
    nb = make_exercise(_solution_nb(new_code_cell(SOLVED_CELL), secret))
    assert len(nb.cells) == 1 and "expected_answer" not in nbformat.writes(nb)
    # ... and a copy of that cell's line elsewhere is caught by the leak check.
    leaked = _solution_nb(new_code_cell(SOLVED_CELL), secret, new_code_cell("expected_answer = area(2.0) * 17"))
    with pytest.raises(GenerateError, match="refusing"):
        make_exercise(leaked)


def test_markers_outside_code_cells_and_broken_stubs_are_refused():
    with pytest.raises(GenerateError, match="only allowed in code cells"):
        make_exercise(_solution_nb(new_markdown_cell("# BEGIN SOLUTION\nsecret\n# END SOLUTION")))
    # A region that ends in the middle of a block leaves invalid Python behind.
    bad = "for i in range(3):\n    # BEGIN SOLUTION\n    print(i)\n    # END SOLUTION\n        print('indented')"
    with pytest.raises(GenerateError, match="not valid Python"):
        make_exercise(_solution_nb(new_code_cell(bad)))


def test_outputs_and_run_metadata_are_cleared():
    cell = new_code_cell(SOLVED_CELL, execution_count=3, outputs=[nbformat.v4.new_output("stream", text="hi")])
    nb = _solution_nb(cell)
    nb.metadata["papermill"] = {"duration": 1.0}
    ex = make_exercise(nb)
    assert ex.cells[0].outputs == [] and ex.cells[0].execution_count is None
    assert "papermill" not in ex.metadata and "kernelspec" in ex.metadata


@pytest.fixture
def course(tmp_path):
    """A tiny solutions/ + exercises/ pair."""
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    nbformat.write(_solution_nb(new_code_cell(SOLVED_CELL)), solutions / "99_demo_exercises.ipynb")
    return solutions, exercises


def _edit(path: Path, source: str, index: int = 0) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.cells[index].source = source
    nbformat.write(nb, path)


def test_learner_edits_are_never_overwritten(course, capsys):
    solutions, exercises = course
    name = "99_demo_exercises.ipynb"
    assert generate.generate(solutions, exercises) == {name: "written"}
    assert "NotImplementedError" in (exercises / name).read_text()

    # The learner solves it; then the solution notebook changes.
    learner = "def area(r):\n    return 3.14159 * r ** 2  # mine"
    _edit(exercises / name, learner)
    _edit(solutions / name, SOLVED_CELL + "\nprint(area(1.0))")
    assert generate.generate(solutions, exercises) == {name: "updated-copy"}
    assert nbformat.read(exercises / name, as_version=4).cells[0].source == learner
    updated = exercises / "99_demo_exercises.updated.ipynb"
    assert "print(area(1.0))" in updated.read_text()
    assert "has your changes" in capsys.readouterr().out

    # Running the notebook (outputs only) is not an edit: a fresh copy may replace it.
    (exercises / name).unlink()
    generate.generate(solutions, exercises)
    nb = nbformat.read(exercises / name, as_version=4)
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="ran")]
    nbformat.write(nb, exercises / name)
    _edit(solutions / name, SOLVED_CELL + "\nprint(area(2.0))")
    assert generate.generate(solutions, exercises) == {name: "written"}


def test_the_updated_copy_is_written_once_and_never_over_your_edits(course, capsys):
    solutions, exercises = course
    name, updated = "99_demo_exercises.ipynb", exercises / "99_demo_exercises.updated.ipynb"
    generate.generate(solutions, exercises)
    _edit(exercises / name, "def area(r):\n    return 3.14159 * r ** 2  # mine")
    _edit(solutions / name, SOLVED_CELL + "\nprint(area(1.0))")
    assert generate.generate(solutions, exercises) == {name: "updated-copy"}

    # Nothing changed in solutions/: the copy is not written again, edited or deleted.
    _edit(updated, SOLVED_CELL.split("\n")[0] + "\n    return 3.0  # my work in the updated copy")
    assert generate.generate(solutions, exercises)[name] != "updated-copy"
    assert "my work in the updated copy" in updated.read_text()
    updated.unlink()  # copied across and deleted, as the message says
    assert generate.generate(solutions, exercises)[name] != "updated-copy" and not updated.exists()

    # The solution changes again: a fresh copy, once...
    _edit(solutions / name, SOLVED_CELL + "\nprint(area(2.0))")
    assert generate.generate(solutions, exercises) == {name: "updated-copy"}
    assert "print(area(2.0))" in updated.read_text()
    # ... and when the learner has edited that copy, a newer solution does not overwrite it.
    _edit(updated, "# my notes")
    _edit(solutions / name, SOLVED_CELL + "\nprint(area(3.0))")
    assert generate.generate(solutions, exercises)[name] != "updated-copy"
    assert nbformat.read(updated, as_version=4).cells[0].source == "# my notes"
    assert "updated.ipynb has your changes" in capsys.readouterr().out


def test_check_mode_reports_out_of_sync_without_writing(course, capsys):
    solutions, exercises = course
    argv = ["--solutions", str(solutions), "--exercises", str(exercises)]
    assert generate.main(argv + ["--check"]) == 1
    assert not exercises.exists()  # --check wrote nothing
    assert generate.main(argv) == 0
    assert generate.main(argv + ["--check"]) == 0
    _edit(solutions / "99_demo_exercises.ipynb", SOLVED_CELL + "\nprint(1)")
    assert generate.main(argv + ["--check"]) == 1
    assert "differs" in capsys.readouterr().out


def test_a_leaking_notebook_blocks_every_write(course):
    solutions, exercises = course
    leaky = _solution_nb(new_code_cell(SOLVED_CELL), new_code_cell("return 3.14159 * r * r"))
    nbformat.write(leaky, solutions / "98_leaky_exercises.ipynb")
    assert generate.main(["--solutions", str(solutions), "--exercises", str(exercises)]) == 2
    assert not exercises.exists() or not list(exercises.glob("*.ipynb"))


def test_committed_exercises_are_in_sync_with_solutions():
    assert generate.main(["--check"]) == 0


# ---- check() -------------------------------------------------------------------------


class FakeRankFailure:
    def __init__(self, rank, type_name, traceback):
        self.rank, self.type_name, self.traceback, self.exception = rank, type_name, traceback, None


class FakeRankError(RuntimeError):
    """Shaped like the runtime's RankError: per-rank failures with type names."""

    def __init__(self, type_name, message):
        tb = f'Traceback (most recent call last):\n  File "<cell>", line 2, in f\n{type_name}: {message}\n'
        self.failures = {r: FakeRankFailure(r, type_name, tb) for r in range(2)}
        super().__init__(f"2 of 2 ranks failed in `f`\n\n--- rank 0 raised {type_name}:\n{tb}")


@exercise("zz.double", points=2)
def _test_double(double):
    for x in (0, 1, 5):
        assert double(x) == 2 * x, f"double({x}) should be {2 * x}, got {double(x)}"


@exercise("zz.remote", points=1)
def _test_remote(fn):
    fn()  # stands in for cluster.run(...) reporting what the ranks raised


def test_check_pass_fail_and_not_implemented(monkeypatch, tmp_path, capsys):
    grades = tmp_path / "grades.jsonl"
    monkeypatch.setenv(GRADE_FILE_ENV, str(grades))

    ok = check("zz.double", lambda x: x + x)
    assert (ok.status, ok.points, ok.max_points) == (PASS, 2, 2)

    bad = check("zz.double", lambda x: x + 2)
    assert bad.status == FAIL and bad.points == 0
    assert "double(0) should be 0, got 2" in bad.message

    def stub(x):
        raise NotImplementedError("exercise: multiply by two")

    todo = check("zz.double", stub)
    assert todo.status == NOT_IMPLEMENTED and "multiply by two" in todo.message

    out = capsys.readouterr().out  # outside IPython, verdicts are printed as text
    assert "[PASS] zz.double (2/2 points)" in out and "[FAIL]" in out and "[NOT IMPLEMENTED YET]" in out

    lines = [json.loads(line) for line in grades.read_text().splitlines()]
    assert [line["status"] for line in lines] == [PASS, FAIL, NOT_IMPLEMENTED]
    assert set(lines[0]) == {"exercise", "status", "points", "max_points", "message"}


def _raise(err):
    def fn():
        raise err

    return fn


def test_check_recognises_not_implemented_on_a_worker_rank():
    remote = check("zz.remote", _raise(FakeRankError("NotImplementedError", "exercise: do the all-reduce")))
    assert remote.status == NOT_IMPLEMENTED and "do the all-reduce" in remote.message
    # Any other remote error is a failure that names what the ranks raised.
    other = check("zz.remote", _raise(FakeRankError("ZeroDivisionError", "division by zero")))
    assert other.status == FAIL and "ZeroDivisionError: division by zero (on rank 0, 1)" in other.message


def test_check_recognises_not_implemented_from_the_real_runtime():
    torch = pytest.importorskip("torch")  # noqa: F841 (the runtime needs it)
    from ultrascale.runtime.errors import RankError, RankFailure

    failure = RankFailure(0, "NotImplementedError", "NotImplementedError: exercise: hint\n")
    result = check("zz.remote", _raise(RankError("1 of 1 ranks failed", {0: failure})))
    assert result.status == NOT_IMPLEMENTED and "hint" in result.message


def test_check_never_raises():
    assert check("zz.no_such_exercise", 1).status == ERROR
    assert "wrong arguments" in check("zz.double").message  # forgot to pass the function
    weird = check("zz.double", lambda x: x.nope)  # the learner's code raises something else
    assert weird.status == FAIL and "AttributeError" in weird.message and weird.details


def test_check_result_renders_html_escaped():
    r = check("zz.double", lambda x: "<b>")
    html = r._repr_mimebundle_()["text/html"]
    assert "Failed" in html and "&lt;b&gt;" in html and "<b>'" not in html


# ---- the chapter 0 tests against their references and against typical mistakes --------


def test_ch00_pipeline_tests_accept_the_reference_and_reject_mistakes():
    from ultrascale_grading.exercise_tests import ch00

    assert check("00.pipeline_stage_layers", ch00.reference_stage_layers).passed
    assert check("00.memory_per_stage", ch00.reference_memory_per_stage).passed
    assert ch00.reference_stage_layers(10, 4) == [3, 3, 2, 2]

    def extra_on_last(num_layers, pp):
        base, extra = divmod(num_layers, pp)
        return [base] * (pp - extra) + [base + 1] * extra

    assert "expected [2, 1], got [1, 2]" in check("00.pipeline_stage_layers", extra_on_last).message

    def untied(num_layers, pp, h, v, bytes_per_param=16):  # forgets the last stage's copy of h*v
        stages = [n * (12 * h * h + 13 * h) for n in ch00.reference_stage_layers(num_layers, pp)]
        stages[0] += h * v
        stages[-1] += 2 * h
        return [s * bytes_per_param for s in stages]

    assert "own copy of the output projection" in check("00.memory_per_stage", untied).message


def test_ch00_mean_across_ranks_on_the_cluster():
    pytest.importorskip("torch")
    import torch.distributed as dist

    # Defined inside the test so that cloudpickle ships them by value to the ranks.
    def mean(ctx, t):
        total = t.clone()  # the task: leave the input unchanged
        dist.all_reduce(total)
        return total / ctx.world_size

    def mean_over_three(ctx, t):
        total = t.clone()
        dist.all_reduce(total)
        return total / 3

    assert check("00.mean_across_ranks", mean).passed
    wrong = check("00.mean_across_ranks", mean_over_three)
    assert wrong.status == FAIL and "use ctx.world_size" in wrong.message


def test_each_exercise_is_found_among_its_chapters_test_modules():
    """A chapter's tests split by exercise (``ch06.py`` and ``ch06_ring_step.py``: no test module
    longer than the technique it grades) are all imported with their chapter, so ``check`` finds
    every exercise from its id without importing every other chapter's tests."""
    from ultrascale_grading import registry

    folder = REPO / "lib" / "ultrascale_grading" / "exercise_tests"
    defined = {
        exercise_id: path.stem
        for path in folder.glob("*.py")
        for exercise_id in re.findall(r'@exercise\("([0-9a][0-9]\.\w+)"', path.read_text())
    }
    assert len(defined) >= 57 and any("_" in stem for stem in defined.values())
    misplaced = {
        exercise_id: stem
        for exercise_id, stem in defined.items()
        if stem not in registry.chapter_modules(registry.chapter_of(exercise_id))
    }
    assert misplaced == {}, f"tests outside their chapter's modules (ch<chapter>.py, ch<chapter>_*.py): {misplaced}"
    assert registry.chapter_modules("a4") == ["cha4", "cha4_atomic_save"]
    assert registry.chapter_modules("not a chapter") == []


# ---- the command-line grader -----------------------------------------------------------


def test_the_points_read_from_the_tests_source_are_the_registrys():
    """The grader's table takes each exercise's points from the test modules' source, without
    importing them (registry.declared_points): the same ids and points as the registry holds once
    every module is imported, and no torch imported to read them."""
    import ast
    import subprocess
    import sys

    from ultrascale_grading import registry

    registry.load_all()
    course = {e: ex.points for e, ex in registry._REGISTRY.items() if not e.startswith("zz.")}
    assert registry.declared_points() == course
    assert len(course) >= 57 and len(set(course.values())) > 1  # the course's exercises, not all worth 1
    code = (
        "import sys; from pathlib import Path; from ultrascale_grading import cli; "
        "print(repr((cli.expected_exercises(Path('solutions/03_zero_exercises.ipynb')), 'torch' in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    table, imported_torch = ast.literal_eval(done.stdout.strip())
    assert table == {
        "03.flatten_padded": 1,
        "03.zero1_step": 2,
        "03.zero3_gather_free": 2,
        "03.shard_gradient": 2,
        "03.muon_rows": 2,
    }
    assert not imported_torch, "making the table imported torch"


def test_grader_counts_checks_that_never_ran(tmp_path, monkeypatch):
    """Without a kernel: a stand-in for papermill runs only one of three checks."""
    import papermill
    from ultrascale_grading.exercise_tests import ch00

    src = REPO / "solutions" / "00_orientation_exercises.ipynb"

    def fake_execute(input_path, output_path, **kwargs):
        check("00.pipeline_stage_layers", ch00.reference_stage_layers, quick=True)  # as the kernel would
        with open(os.environ[GRADE_FILE_ENV], "a") as f:
            f.write('{"exercise": "00.mem')  # a line torn by a dying kernel is ignored
        nb = nbformat.read(input_path, as_version=4)
        nbformat.write(nb, output_path)
        return nb

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    report = cli.grade_notebook(src, timeout=10, parameters={"QUICK": True})
    status = {e["exercise"]: e["status"] for e in report.exercises}
    assert status == {
        "00.mean_across_ranks": "not run",
        "00.pipeline_stage_layers": PASS,
        "00.memory_per_stage": "not run",
    }
    assert (report.points, report.max_points) == (1, 3)


def test_a_notebook_whose_kernel_never_started_is_graded_once_more(monkeypatch, capsys):
    """Its ports taken by another process before it bound them, a kernel never answers: no fault
    of the notebook's. It is graded again, once; a second failure is reported as before."""
    import papermill
    from ultrascale_grading.exercise_tests import ch00

    src = REPO / "solutions" / "00_orientation_exercises.ipynb"
    calls = []

    def fails_first(input_path, output_path, **kwargs):
        calls.append(input_path)
        if len(calls) == 1:
            raise RuntimeError("Kernel didn't respond in 60 seconds")
        check("00.pipeline_stage_layers", ch00.reference_stage_layers, quick=True)
        nb = nbformat.read(input_path, as_version=4)
        nbformat.write(nb, output_path)
        return nb

    monkeypatch.setattr(papermill, "execute_notebook", fails_first)
    report = cli.grade_notebook(src, timeout=10, parameters={"QUICK": True})
    assert len(calls) == 2 and report.status == "ok" and report.points == 1
    assert "its kernel did not start" in capsys.readouterr().err

    def never(input_path, output_path, **kwargs):
        calls.append(input_path)
        raise RuntimeError("Kernel didn't respond in 60 seconds")

    monkeypatch.setattr(papermill, "execute_notebook", never)
    calls.clear()
    report = cli.grade_notebook(src, timeout=10, parameters={"QUICK": True})
    assert len(calls) == 2 and report.status == "infrastructure error" and "Kernel didn't respond" in report.error


def test_grader_runs_each_deferred_test_once_in_its_own_process(tmp_path, monkeypatch):
    """Under the grader check() only saves what it was given; the grader's run gives every verdict."""
    import papermill

    src = REPO / "solutions" / "00_orientation_exercises.ipynb"
    in_kernel = []

    def fake_execute(input_path, output_path, **kwargs):
        assert os.environ.get(DEFER_ENV) == "1"

        def wrong_layers(num_layers, pp):  # plausible mistake: the remainder on the last stages
            base, extra = divmod(num_layers, pp)
            return [base] * (pp - extra) + [base + 1] * extra

        def stub(*args, **kwargs):
            raise NotImplementedError("exercise: memory per stage")

        in_kernel.append(check("00.pipeline_stage_layers", wrong_layers, quick=True))
        in_kernel.append(check("00.memory_per_stage", stub, quick=True))
        in_kernel.append(check("00.mean_across_ranks", quick=True))  # forgot the function: wrong arguments
        nbformat.write(nbformat.read(input_path, as_version=4), output_path)

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    report = cli.grade_notebook(src, timeout=60, parameters={"QUICK": True})
    assert [r.status for r in in_kernel] == [SUBMITTED, SUBMITTED, ERROR]  # nothing ran in the "kernel"
    rows = {e["exercise"]: e for e in report.exercises}
    assert rows["00.pipeline_stage_layers"]["status"] == FAIL
    assert "expected [2, 1], got [1, 2]" in rows["00.pipeline_stage_layers"]["message"]
    assert rows["00.memory_per_stage"]["status"] == NOT_IMPLEMENTED
    assert (
        rows["00.mean_across_ranks"]["status"] == ERROR and "wrong arguments" in rows["00.mean_across_ranks"]["message"]
    )
    assert report.points == 0
    assert os.environ.get(DEFER_ENV) is None  # the grader's own environment is left as it was


def test_deferred_submissions_of_the_right_answers_score_through_the_grader(tmp_path, monkeypatch):
    import papermill
    from ultrascale_grading.exercise_tests import ch00

    src = REPO / "solutions" / "00_orientation_exercises.ipynb"

    def fake_execute(input_path, output_path, **kwargs):
        check("00.pipeline_stage_layers", ch00.reference_stage_layers, quick=True)
        check("00.memory_per_stage", ch00.reference_memory_per_stage, quick=True)
        nbformat.write(nbformat.read(input_path, as_version=4), output_path)

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    report = cli.grade_notebook(src, timeout=60, parameters={"QUICK": True})
    status = {e["exercise"]: e["status"] for e in report.exercises}
    assert status == {"00.mean_across_ranks": "not run", "00.pipeline_stage_layers": PASS, "00.memory_per_stage": PASS}


def test_an_untouched_stub_is_told_without_starting_ranks(monkeypatch):
    """A function that can only raise NotImplementedError (every generated stub) is "not implemented"
    before its test runs: 00.mean_across_ranks's test would start ranks only to watch it raise. One
    that does anything else first, or builds its message from an argument, is run as before."""
    import ultrascale.runtime.cluster as cluster

    def stub(t, group=None):
        """The learner's docstring stays."""
        raise NotImplementedError("exercise: which collective leaves the sum on every rank?")

    def started(*args, **kwargs):
        raise AssertionError("a stub's check started ranks")

    with monkeypatch.context() as patch:
        patch.setattr(cluster, "shared_cluster", started)
        result = check("00.mean_across_ranks", stub, quick=True)
    assert result.status == NOT_IMPLEMENTED and "Hint: which collective" in result.message, result

    def begun(num_layers, pp_degree):
        per_stage = [0] * pp_degree
        raise NotImplementedError(f"exercise: {len(per_stage)} stages")

    result = check("00.pipeline_stage_layers", begun, quick=True)  # run: the test's own call raised it
    assert result.status == NOT_IMPLEMENTED and "stages" in result.message, result


def test_untouched_triton_kernels_are_not_implemented_through_the_grader():
    """make grade's path, where check() only saves the kernel and the grader's own process tests it
    (the shared run below grades exercises/ with --feedback, in the kernel, and did not see this):
    a stub kernel names no ``tl``, so the kernel came back from cloudpickle without triton.language
    in its globals, and Triton's interpreter refused it: "fail", not "not implemented" (issue 54)."""
    notebook = REPO / "exercises" / "11_gpu_kernels_exercises.ipynb"
    report = cli.grade_notebook(notebook, timeout=120, parameters={"QUICK": True})
    assert report.status == "ok", report.error
    rows = {e["exercise"]: e for e in report.exercises}
    assert {"11.masked_add", "11.row_softmax", "11.matmul_tile"} <= set(rows)
    assert {ex: row["status"] for ex, row in rows.items()} == dict.fromkeys(rows, NOT_IMPLEMENTED), rows
    assert all("Hint:" in row["message"] for row in rows.values()), rows  # the stub's nudge, from the grader


def test_grader_fails_only_on_infrastructure_errors(tmp_path, capsys):
    assert cli.main([str(tmp_path / "missing.ipynb")]) == 2
    assert cli.main([str(tmp_path)]) == 2  # an empty directory: nothing to grade


@pytest.fixture(scope="module")
def graded(graded_course):
    """The grader's run over solutions/ and exercises/ (tests/conftest.py: shared with test_run_all)."""
    by_dir = {folder: run.notebooks for folder, run in graded_course.items()}
    return by_dir, "\n".join(run.table for run in graded_course.values())


def _names(notebooks):
    return sorted(Path(nb["notebook"]).name for nb in notebooks)


@pytest.mark.slow
@pytest.mark.timeout(2 * 1800)  # the shared grader run (conftest.GRADER_TIMEOUT per folder)
def test_e2e_papermill_solutions_score_full_marks(graded):
    """Also --jobs (conftest.GRADER_JOBS notebooks at a time): two kernels at once must not share a
    grade file (each reaches its own through the environment), so each notebook's rows are the checks
    its own cells call, all of them; and the table keeps the notebooks' order, not the order they
    finish in (chapter 00's solutions take twice as long as 01's, which start beside them)."""
    by_dir, table = graded
    assert GRADER_JOBS >= 2
    names = [Path(nb["notebook"]).name for nb in by_dir["solutions"]]
    assert names == sorted(p.name for p in (REPO / "solutions").glob("*.ipynb")), names
    for solutions in by_dir["solutions"]:
        assert solutions["max_points"] > 0 and solutions["points"] == solutions["max_points"], table
        assert solutions["cell_errors"] == 0, table
        cells = nbformat.read(REPO / "solutions" / Path(solutions["notebook"]).name, as_version=4).cells
        called = {m for c in cells if c.cell_type == "code" for m in re.findall(r'^check\("([^"]+)"', c.source, re.M)}
        assert {e["exercise"] for e in solutions["exercises"]} == called, (solutions["notebook"], table)


@pytest.mark.slow
@pytest.mark.timeout(2 * 1800)  # the shared grader run (conftest.GRADER_TIMEOUT per folder)
def test_e2e_papermill_exercises_run_and_score_zero(graded):
    """Every chapter's untouched exercises are "not implemented", none "fail", as the notebook's check()
    says (this run has --feedback); make grade's path, where the grader's own process runs the tests on
    what check() saved, differed only for Triton kernels: test_untouched_triton_kernels_... above."""
    by_dir, table = graded
    assert _names(by_dir["exercises"]) == _names(by_dir["solutions"])
    for exercises in by_dir["exercises"]:
        assert exercises["status"] == "ok" and exercises["points"] == 0, table
        assert {e["status"] for e in exercises["exercises"]} == {NOT_IMPLEMENTED}, table
