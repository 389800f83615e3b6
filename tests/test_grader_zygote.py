"""The grader's runs of the tests as forks of a zygote (ultrascale_grading.zygote): each run is
killed at its limit with everything it started, and the zygote serves the next; a run that kills
the zygote is said in words and the next notebook gets a new one; a run sees its own folder and
environment. (Every solution scoring full marks through it is tests/test_grading.py's.)"""

from __future__ import annotations

import json
import os
import time

import cloudpickle
import pytest

from ultrascale_grading import cli, zygote
from ultrascale_grading.check import PASS

pytestmark = pytest.mark.skipif(not zygote.available(), reason="the zygote forks: Linux only")


class _OnLoad:
    """What a submission runs when the grader loads it (pickle calls ``call(*args)``)."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _spec(tmp_path, name: str, objects, kwargs=None, ranks=None):
    """A run's spec: one submission of 00.pipeline_stage_layers, with ``objects`` as what check() got
    (and, if ``ranks`` is given, the kernel's context saying whether it had ranks)."""
    folder = tmp_path / name
    folder.mkdir()
    submission = folder / "submission.pkl"
    submission.write_bytes(cloudpickle.dumps((objects, kwargs or {})))
    if ranks is not None:
        submission.with_suffix(".json").write_text(json.dumps({"environ": {}, "sys_path": [], "ranks": ranks}))
    spec, results = folder / "spec.json", folder / "verdicts.jsonl"
    spec.write_text(json.dumps({"results": str(results), "submissions": {"00.pipeline_stage_layers": str(submission)}}))
    return spec, results


def _verdicts(results) -> dict:
    return {r["exercise"]: r for r in map(json.loads, results.read_text().splitlines())} if results.is_file() else {}


def test_a_run_past_its_limit_is_killed_and_the_zygote_serves_the_next(tmp_path):
    from ultrascale_grading.exercise_tests import ch00

    env = {k: v for k, v in os.environ.items()}
    zyg = zygote.Zygote.start(env)
    try:
        marker = tmp_path / "started"
        # the run starts a child of its own (its group's), then sleeps past the limit
        hang = _OnLoad(os.system, f"sleep 600 & echo $! > {marker}; sleep 600")
        spec, _ = _spec(tmp_path, "hang", (hang,))
        started = time.monotonic()
        code, _ = zyg.run(spec, tmp_path, env, limit=3)
        assert code is None and time.monotonic() - started < 30
        child = int(marker.read_text())
        for _ in range(50):  # the run's own child went with it (one process group)
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the run's child {child} survived the kill")
        assert zyg.alive()
        spec, results = _spec(tmp_path, "next", (ch00.reference_stage_layers,), {"quick": True})
        code, stderr = zyg.run(spec, tmp_path, env, limit=120)
        assert code == 0, stderr
        assert _verdicts(results)["00.pipeline_stage_layers"]["status"] == PASS
    finally:
        zyg.close()


def test_a_run_sees_its_folder_and_environment_and_one_that_kills_the_zygote_is_said(tmp_path, monkeypatch):
    # what the run's process sees, written where the test can read it, then a failing exit
    probe = (
        "import json, os; json.dump({'cwd': os.getcwd(), 'mark': os.environ.get('ZYGOTE_MARK')}, "
        f"open({str(tmp_path / 'seen.json')!r}, 'w')); os._exit(3)"
    )
    spec, _ = _spec(tmp_path, "probe", (_OnLoad(exec, probe),))
    monkeypatch.setenv("ZYGOTE_MARK", "first")
    env = {k: v for k, v in os.environ.items() if k not in ("ULTRASCALE_GRADE_FILE", "ULTRASCALE_GRADE_DEFER")}
    assert cli._run_forked(spec, spec.parent, env, limit=120) == "it exited with code 3: "
    assert json.loads((tmp_path / "seen.json").read_text()) == {"cwd": str(spec.parent), "mark": "first"}
    first = cli._zygote
    # another environment: another zygote (its imports might have read the variable)
    spec, _ = _spec(tmp_path, "killer", (_OnLoad(exec, "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"),))
    env["ZYGOTE_MARK"] = "second"
    said = cli._run_forked(spec, spec.parent, env, limit=120)
    assert cli._zygote is not first and not first.alive()
    assert said.startswith("the grader's process for the tests stopped"), said
    assert not cli._zygote.alive()
    spec, _ = _spec(tmp_path, "after", (_OnLoad(exec, probe),))
    assert cli._run_forked(spec, spec.parent, env, limit=120) == "it exited with code 3: "  # a new zygote
    assert json.loads((tmp_path / "seen.json").read_text())["mark"] == "second"


def test_a_run_for_a_kernel_that_had_ranks_gets_a_fork_server_forked_from_it(tmp_path):
    """cli._fork_server_early: the ranks' fork server of a run whose notebook had ranks is a fork of
    the run (the same command line: no second interpreter importing torch), started before the
    first test; a run whose notebook had none starts no server."""
    seen = tmp_path / "server.json"
    probe = (
        "import json, os; from multiprocessing import forkserver; "
        "pid = forkserver._forkserver._forkserver_pid; "
        "line = lambda p: open(f'/proc/{p}/cmdline', 'rb').read(); "
        f"json.dump(pid and line(pid) == line(os.getpid()), open({str(seen)!r}, 'w')); os._exit(3)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ULTRASCALE_GRADE_FILE", "ULTRASCALE_GRADE_DEFER")}
    for ranks, forked in ((True, True), (False, None)):
        spec, _ = _spec(tmp_path, f"ranks-{ranks}", (_OnLoad(exec, probe),), ranks=ranks)
        assert cli._run_forked(spec, spec.parent, env, limit=120) == "it exited with code 3: "
        assert json.loads(seen.read_text()) is forked, ranks
