"""Grading work that is not yours (issue 37): the grader's sandbox (lib/ultrascale_grading/sandbox.py).

* The supervisor alone, with bubblewrap and without: a daemon that leaves the session and
  ignores SIGTERM is killed, a fork bomb stays under the process bound, a command that runs
  forever is stopped at the time limit, and a grader without bwrap says so.
* The grader on a folder of submissions (``ultrascale-grade FOLDER``, sandboxed by default):
  notebooks that write outside their folder, connect to a server of the host, fork without
  end or loop forever are stopped and score zero; the correct ones beside them score full
  marks, and no process of any submission is left. The harmful calls are made both in the
  kernel and inside the submitted function, which only the grader's second process runs:
  that process must be sandboxed too.

Each test shows that the harm did not happen (no file, no connection, no process), not only
the score. Without bwrap the write and network tests skip, saying why; the others still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from ultrascale_grading import NOT_RUN, PASS, cli
from ultrascale_grading import sandbox as sb

TIME_LIMIT = 25  # seconds for the notebooks that never end (their kernel must start first, on a busy machine:
# 6-10 s measured beside the suite's other worker; each second here is one the fixture waits)
ROOMY = 600  # seconds for the others, whatever the load of this 2-core machine
MAX_PROCESSES = 128  # tasks per notebook: a kernel with two ranks needs about 40
BOMB_CAP = 511  # the bomb's own tree (2 children each, 9 generations): safe for this machine if unbounded


def _probe() -> sb.Sandbox:
    return sb.Sandbox.probe(sb.Limits(seconds=TIME_LIMIT, processes=MAX_PROCESSES))


def _needs_bwrap(sandbox: sb.Sandbox) -> None:
    if not sandbox.bwrap:
        pytest.skip(f"no bubblewrap sandbox here, so writes outside and the network are not blocked: {sandbox.why_not}")


def _needs_process_bound(sandbox: sb.Sandbox) -> None:
    if not sandbox.bounds_processes():
        pytest.skip(
            "no process bound here (root ignores RLIMIT_NPROC and no pids cgroup can be made): "
            "a fork bomb would not be stopped before the time limit"
        )


# ---- watching processes from the host --------------------------------------------------


def _stat(pid: str) -> list:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _identity(pid: str):
    """(pid, start time): a pid alone may be reused once its process is gone."""
    stat = _stat(pid)
    return (pid, stat[19]) if stat else None


def _marked(marker: str) -> list:
    """Processes whose name (/proc/PID/comm) starts with ``marker``, with their parents."""
    found = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().startswith(marker):
                pid = comm.parent.name
                stat = _stat(pid)
                if stat and stat[0] not in "ZX":
                    found.append((_identity(pid), _identity(stat[1])))
        except OSError:
            pass
    return found


class Watcher:
    """Samples /proc while the grader runs: the most processes seen under each marker, and
    every one seen (with its parent, such as the ranks' forkserver)."""

    def __init__(self, markers):
        self.most = dict.fromkeys(markers, 0)
        self.seen = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.25):
            for marker in self.most:
                found = _marked(marker)
                self.most[marker] = max(self.most[marker], len(found))
                self.seen.update(p for pair in found for p in pair if p)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def still_alive(self) -> list:
        return [p for p in self.seen if _identity(p[0]) == p and _stat(p[0])[0] not in "ZX"]


# ---- the supervisor alone --------------------------------------------------------------


@pytest.fixture(params=["bwrap", "no bwrap"])
def sandbox(request):
    probed = sb.Sandbox.probe(sb.Limits(seconds=5, processes=48))
    if request.param == "bwrap":
        if not probed.bwrap:
            pytest.skip(f"bubblewrap unusable here: {probed.why_not}")
        return probed
    return sb.Sandbox(probed.limits, None, "forced off by the test")


def test_a_daemon_that_leaves_the_session_is_killed_at_the_end(sandbox, tmp_path):
    marker = "usd" + secrets.token_hex(4)
    daemon = (
        f"import os, signal, time\nif os.fork():\n    time.sleep(1)  # long enough to be seen\n    os._exit(0)\n"
        f"os.setsid()\n"
        f"signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        f"open('/proc/self/comm', 'w').write({marker!r})\ntime.sleep(600)"
    )
    with Watcher([marker]) as watcher:
        outcome = sandbox.run([sys.executable, "-c", daemon], tmp_path, dict(os.environ), seconds=5)
        time.sleep(0.5)  # one more sample after the end
    assert outcome.returncode == 0 and outcome.survivors == 0, outcome
    assert watcher.most[marker] == 1, "the daemon never ran: the test would show nothing"
    assert watcher.still_alive() == []


def test_a_fork_bomb_stays_under_the_process_bound(sandbox, tmp_path):
    _needs_process_bound(sandbox)
    marker = "usf" + secrets.token_hex(4)
    with Watcher([marker]) as watcher:
        outcome = sandbox.run([sys.executable, "-c", _bomb(marker)], tmp_path, dict(os.environ), seconds=5)
    assert outcome.timed_out and outcome.survivors == 0, outcome
    assert 10 <= watcher.most[marker] <= sandbox.limits.processes, watcher.most
    assert "Resource temporarily unavailable" in outcome.stderr  # fork was refused, not merely slow
    assert watcher.still_alive() == []


def test_a_command_that_never_ends_is_stopped_at_the_time_limit(sandbox, tmp_path):
    start = time.monotonic()
    outcome = sandbox.run([sys.executable, "-c", "while True:\n    pass"], tmp_path, dict(os.environ), seconds=2)
    assert outcome.timed_out and outcome.returncode is None and outcome.survivors == 0
    assert 2 <= time.monotonic() - start < 15


def test_without_bwrap_the_grader_says_so(monkeypatch):
    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    line = sb.Sandbox.probe().describe()
    assert "WITHOUT bubblewrap" in line and "CAN write wherever you can and use the network" in line
    assert "\n" not in line


def test_course_folders_are_trusted_and_others_are_not(tmp_path):
    assert cli.is_course_notebook(cli.COURSE / "solutions" / "00_orientation_exercises.ipynb")
    assert cli.is_course_notebook(cli.COURSE / "exercises" / "00_orientation_exercises.ipynb")
    assert not cli.is_course_notebook(tmp_path / "00_orientation_exercises.ipynb")


def _bomb(marker: str) -> str:
    """Every process forks two children (retrying while fork is refused), up to 9 generations."""
    return (
        f"import os, time\nopen('/proc/self/comm', 'w').write({marker!r})\ngeneration = 0\n"
        f"while generation < 9:\n"
        f"    children = 0\n"
        f"    while children < 2:\n"
        f"        try:\n"
        f"            if os.fork() == 0:\n"
        f"                generation += 1\n"
        f"                break\n"
        f"            children += 1\n"
        f"        except OSError as err:\n"
        f"            print(err, flush=True, file=__import__('sys').stderr)\n"
        f"            time.sleep(0.05)\n"
        f"    else:\n"
        f"        break\n"
        f"while True:\n"
        f"    time.sleep(1)\n"
    )


# ---- the grader on a folder of submissions ---------------------------------------------

HEAD = (
    "from ultrascale_grading import check\nfrom ultrascale_grading.exercise_tests import ch00\nimport pathlib, socket"
)
SUBMIT = 'check("00.pipeline_stage_layers", stage_layers, quick=True)'


def _write(folder: Path, name: str, *cells: str) -> None:
    nb = new_notebook(
        cells=[new_code_cell(HEAD), *map(new_code_cell, cells)],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    nbformat.write(nb, folder / name)


def _submissions(folder: Path, outside: Path, port: int, marker: str, sandbox: sb.Sandbox) -> None:
    """Harmful notebooks (only the ones this sandbox can stop), and two correct ones."""
    # The two that never end come first: with 4 jobs they wait beside the others.
    if sandbox.bounds_processes():
        _write(
            folder, "1_fork_bomb.ipynb", _bomb(marker + "b"), "stage_layers = ch00.reference_stage_layers\n" + SUBMIT
        )
    _write(
        folder,
        "2_loop.ipynb",
        "import time\n"
        "while True:  # ignores the interrupts a cell timeout sends; sleeps, to spare the CPU\n"
        "    try:\n        while True:\n            time.sleep(0.1)\n"
        "    except BaseException:\n        pass",
        "stage_layers = ch00.reference_stage_layers\n" + SUBMIT,
    )
    if sandbox.bwrap:
        targets = [str(outside / "from_the_kernel.txt"), str(Path(sys.prefix) / f"escaped-{marker}.txt")]
        _write(
            folder,
            "3_write.ipynb",
            f"for target in {targets!r}:\n"
            f"    try:\n        pathlib.Path(target).write_text('escaped'); print('WROTE', target)\n"
            f"    except OSError as err:\n        print('BLOCKED', target, type(err).__name__)",
            f"def stage_layers(num_layers, pp):  # only the grader's second process runs it\n"
            f"    pathlib.Path({str(outside / 'from_the_test_run.txt')!r}).write_text('escaped')\n"
            f"    return ch00.reference_stage_layers(num_layers, pp)\n" + SUBMIT,
        )
        _write(
            folder,
            "4_socket.ipynb",
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3).sendall(b'kernel')\n"
            f"    print('CONNECTED')\nexcept OSError as err:\n    print('BLOCKED', type(err).__name__)",
            f"def stage_layers(num_layers, pp):\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=3).sendall(b'test run')\n"
            f"    return ch00.reference_stage_layers(num_layers, pp)\n" + SUBMIT,
        )
    _write(folder, "5_correct.ipynb", "stage_layers = ch00.reference_stage_layers\n" + SUBMIT)
    daemon = (
        f"import os, signal, time\nif os.fork(): os._exit(0)\n"
        f"signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        f"open('/proc/self/comm', 'w').write({marker + 'l'!r})\ntime.sleep(3600)"
    )
    _write(
        folder,
        "6_leaves_processes.ipynb",
        f"import os, subprocess, sys, time\nfrom ultrascale.runtime import shared_cluster\n"
        f"def mark(ctx=None):\n    open('/proc/self/comm', 'w').write({marker + 'l'!r})\n    return os.getpid()\n"
        f"mark()  # the kernel\nprint(shared_cluster(2).run(mark))  # its ranks, children of a forkserver\n"
        f"subprocess.Popen([sys.executable, '-c', {daemon!r}], start_new_session=True)  # leaves the session\n"
        f"time.sleep(1)",
        "stage_layers = ch00.reference_stage_layers\n" + SUBMIT,
    )


class Listener:
    """A TCP server of the host (127.0.0.1 of this network namespace) that counts connections."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.connections = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                self.connections.append(conn.recv(100))

    def close(self):
        self._stop.set()
        self._thread.join()
        self.server.close()


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The grader's run on a folder of submissions, four at a time, each in the sandbox. The
    two that never end get a short time limit, the others a roomy one (the CLI has one
    limit for all: a short one would make this test depend on the machine's load)."""
    root = tmp_path_factory.mktemp("sandboxed")
    folder, outside, keep = root / "submissions", root / "outside", root / "kept"
    folder.mkdir(), outside.mkdir(), keep.mkdir()
    marker, sandbox, listener = "usg" + secrets.token_hex(4), _probe(), Listener()
    _submissions(folder, outside, listener.port, marker, sandbox)
    notebooks = cli.find_notebooks([folder])
    roomy = dataclasses.replace(sandbox, limits=dataclasses.replace(sandbox.limits, seconds=ROOMY))
    boxes = [sandbox if nb.name in ("1_fork_bomb.ipynb", "2_loop.ipynb") else roomy for nb in notebooks]
    try:
        with Watcher([marker + "b", marker + "l"]) as watcher:
            reports = cli.grade_all(
                notebooks, timeout=60, parameters={}, keep_dir=keep, feedback=False, jobs=4, sandboxes=boxes
            )
            time.sleep(0.5)  # one more sample after the end
    finally:
        listener.close()
    escaped = Path(sys.prefix) / f"escaped-{marker}.txt"
    escaped_to_venv = escaped.exists()
    escaped.unlink(missing_ok=True)  # never leave it in the venv, whatever the test says
    rows = {Path(r.notebook).stem: r.to_json() for r in reports}
    return dict(
        rows=rows,
        outside=outside,
        keep=keep,
        sandbox=sandbox,
        listener=listener,
        watcher=watcher,
        marker=marker,
        escaped_to_venv=escaped_to_venv,
    )


def _status(row) -> dict:
    return {e["exercise"]: (e["status"], e["points"]) for e in row["exercises"]}


def _kept_output(graded, name: str) -> str:
    nb = nbformat.read(graded["keep"] / name, as_version=4)
    return "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))


def test_the_cli_sandboxes_submissions_by_default_and_says_how(tmp_path, capsys):
    course, theirs = cli.COURSE / "solutions" / "00_orientation_exercises.ipynb", tmp_path / "00_theirs.ipynb"

    def parser_args(*flags):
        return argparse.Namespace(
            trusted="--trusted" in flags, sandbox="--sandbox" in flags, time_limit=60, memory_limit=4, max_processes=64
        )

    boxes = cli._sandboxes([course, theirs], parser_args())
    assert boxes[0] is None and isinstance(boxes[1], sb.Sandbox) and boxes[1].limits.seconds == 60
    assert capsys.readouterr().out == boxes[1].describe() + "\n"  # one line, never silent
    assert all(isinstance(b, sb.Sandbox) for b in cli._sandboxes([course, theirs], parser_args("--sandbox")))
    assert cli._sandboxes([course, theirs], parser_args("--trusted")) == [None, None]
    assert "no sandbox" in capsys.readouterr().out


@pytest.mark.slow
def test_a_submission_cannot_write_outside_its_copy(graded):
    _needs_bwrap(graded["sandbox"])
    assert _kept_output(graded, "3_write.ipynb").count("BLOCKED") == 2  # both attempts ran, and failed
    assert list(graded["outside"].iterdir()) == [] and not graded["escaped_to_venv"]
    assert _status(graded["rows"]["3_write"])["00.pipeline_stage_layers"][1] == 0


@pytest.mark.slow
def test_a_submission_cannot_reach_the_hosts_network(graded):
    _needs_bwrap(graded["sandbox"])
    assert "BLOCKED" in _kept_output(graded, "4_socket.ipynb")
    assert graded["listener"].connections == []
    assert _status(graded["rows"]["4_socket"])["00.pipeline_stage_layers"][1] == 0


@pytest.mark.slow
def test_a_fork_bomb_is_bounded_then_stopped(graded):
    _needs_process_bound(graded["sandbox"])
    row, most = graded["rows"]["1_fork_bomb"], graded["watcher"].most[graded["marker"] + "b"]
    assert 10 <= most <= MAX_PROCESSES, f"the bomb reached {most} processes (cap of its own: {BOMB_CAP})"
    assert row["status"] == "stopped" and _status(row) == {"00.pipeline_stage_layers": (NOT_RUN, 0)}


@pytest.mark.slow
def test_a_loop_without_end_is_stopped_at_the_time_limit(graded):
    row = graded["rows"]["2_loop"]
    assert row["status"] == "stopped" and f"({TIME_LIMIT:g} s)" in row["error"]
    assert TIME_LIMIT <= row["seconds"] < ROOMY
    assert _status(row) == {"00.pipeline_stage_layers": (NOT_RUN, 0)}


@pytest.mark.slow
def test_correct_submissions_beside_them_score_full_marks(graded):
    for name in ("5_correct", "6_leaves_processes"):
        row = graded["rows"][name]
        assert row["status"] == "ok" and row["cell_errors"] == 0, row
        assert _status(row) == {"00.pipeline_stage_layers": (PASS, 1)}


@pytest.mark.slow
def test_no_process_of_a_submission_is_left(graded):
    watcher = graded["watcher"]
    # the kernel, its two ranks and the daemon were seen, with their parents (the forkserver among them)
    assert watcher.most[graded["marker"] + "l"] >= 4
    assert watcher.still_alive() == []
