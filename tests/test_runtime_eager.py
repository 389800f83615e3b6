"""The fork server starts at ``import ultrascale.runtime`` in a notebook kernel and in a script.

There the ranks' fork server makes its imports as soon as the runtime is imported, so the cell
or line that makes the cluster no longer waits for them (benchmarks/bench_runtime.py times both).
What must hold: it starts in a kernel and in a script, not when switched off, not in a ``python
-c`` probe and never in a rank (torchrun's or any multiprocessing child); ranks still see the
notebook's import path and folder as they are when the cluster starts, even if they changed after
the import. Where the runtime imported torch itself the server is a plain fork of the caller
(forkserver.py), and holds nothing of a kernel's: none of its sockets, no notebook shell for the
ranks to find; where torch came first, it is a fresh interpreter started before the rest.
"""

import pytest
from jupyter_client.manager import start_new_kernel

# How the server started: "fork" (a copy of the caller: its command line is the caller's) or "exec"
SERVER_KIND = """
def server_kind():
    import multiprocessing.forkserver as fs
    pid = fs._forkserver._forkserver_pid
    if pid is None:
        return "none"
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return "exec" if b"multiprocessing.forkserver" in cmdline.read() else "fork"


def server_sockets():
    import multiprocessing.forkserver as fs, os
    fds = f"/proc/{fs._forkserver._forkserver_pid}/fd"
    return sum(os.readlink(os.path.join(fds, fd)).startswith("socket:") for fd in os.listdir(fds))
"""

PROBE = (
    SERVER_KIND
    + """
import os, sys, multiprocessing.forkserver as fs
import ultrascale.runtime
print("server", fs._forkserver._forkserver_pid is not None, server_kind())
sys.path.append(os.path.abspath("added-after-import"))
from ultrascale.runtime import Cluster
with Cluster(2) as c:
    print("ranks", all("added-after-import" in p[-1] for p in c.run(lambda ctx: __import__("sys").path)))
    in_notebook = c.run(lambda ctx: __import__("ultrascale.runtime.forkserver", fromlist=["_"]).in_a_notebook())
    print("in-a-notebook", any(in_notebook), "sockets", server_sockets() if server_kind() == "fork" else 1)
    print("names", *c.run(lambda ctx: open("/proc/self/comm").read().strip()))   # as top shows them
"""
)


def _run_in_kernel(env_value, tmp_path):
    import os

    env = dict(os.environ, ULTRASCALE_EAGER_FORKSERVER=env_value)
    manager, client = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    lines = []
    try:
        reply = client.execute_interactive(
            PROBE,
            timeout=300,
            output_hook=lambda m: lines.append(m["content"].get("text", "")) if m["msg_type"] == "stream" else None,
        )
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return "".join(lines).split()


@pytest.mark.parametrize("env_value, started", [("1", ["True", "fork"]), ("0", ["False", "none"])])
def test_fork_server_starts_at_import_in_a_kernel_unless_switched_off(env_value, started, tmp_path):
    # a forked server keeps only its listening socket of the kernel's sockets (which are 5 or more),
    # and its ranks do not think they are in a notebook (the kernel's shell object came with the fork)
    assert _run_in_kernel(env_value, tmp_path) == [
        "server",
        *started,
        "ranks",
        "True",
        "in-a-notebook",
        "False",
        "sockets",
        "1",
        "names",
        "rank0",
        "rank1",
    ]


SCRIPT_PROBE = (
    SERVER_KIND
    + """
import os, multiprocessing.forkserver as fs
import ultrascale.runtime
print(fs._forkserver._forkserver_pid is not None, os.environ.get("ULTRASCALE_EAGER_FORKSERVER"), server_kind())
"""
)


def _started_in(tmp_path, as_script=True, **env_changes):
    """Run SCRIPT_PROBE as a script file (or with ``python -c``); did the import start the server?"""
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ULTRASCALE_EAGER_FORKSERVER", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
    }
    env.update(env_changes)
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT_PROBE)
    args = [str(script)] if as_script else ["-c", SCRIPT_PROBE]
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True, env=env)
    return out.stdout.strip()


def test_a_script_starts_it_at_import(tmp_path):
    # and leaves the environment as it was, so the programs it starts (kernels too) decide for themselves;
    # a fork of the script when the runtime imported torch. (Every other server is a fresh interpreter,
    # as multiprocessing makes them: those of this suite's pytest workers, started by their first Cluster.)
    assert _started_in(tmp_path) == "True None fork"


@pytest.mark.parametrize("where", ["switched off", "python -c", "torchrun rank", "elastic rank"])
def test_it_does_not_start_where_no_cluster_is_made(where, tmp_path):
    changes = {
        "switched off": dict(ULTRASCALE_EAGER_FORKSERVER="0"),
        "python -c": dict(as_script=False),
        "torchrun rank": dict(LOCAL_RANK="0"),
        "elastic rank": dict(TORCHELASTIC_RUN_ID="x"),
    }[where]
    assert _started_in(tmp_path, **changes).split()[0] == "False"


def _import_runtime_in_a_child(queue):
    import multiprocessing.forkserver as fs

    import ultrascale.runtime  # noqa: F401

    queue.put(fs._forkserver._forkserver_pid is not None)


def test_a_multiprocessing_child_does_not_start_it():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh interpreter that imports the runtime itself
    queue = ctx.Queue()
    child = ctx.Process(target=_import_runtime_in_a_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=120) is False
    finally:
        child.join(30)


def test_when_the_server_starts_beside_torchs_import():
    """Whoever imports torch first decides (runtime/__init__): the runtime itself, then the server
    is forked once torch and the runtime are imported (nothing else has run torch); the caller,
    then the server is a fresh interpreter started before the runtime imports anything more, and
    the module that starts it imports no torch of its own."""
    import subprocess
    import sys

    code = """
import sys, types, multiprocessing.forkserver as fs, multiprocessing.util as mu
if sys.argv[1] == "torch first":
    import torch
shell = types.SimpleNamespace(kernel=object())                     # as if in a notebook kernel
sys.modules["IPython"] = types.SimpleNamespace(get_ipython=lambda: shell)
seen, spawn = [], mu.spawnv_passfds
fs.ensure_running = lambda: seen.append(("torch" in sys.modules, "ultrascale.runtime.cluster" in sys.modules,
                                         mu.spawnv_passfds is not spawn))   # what had run, and forked?
import ultrascale.runtime
print(seen, "torch" in sys.modules, mu.spawnv_passfds is spawn)
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "ULTRASCALE_EAGER_FORKSERVER"}
    runs = {
        first: subprocess.run(
            [sys.executable, "-c", code, first], capture_output=True, text=True, check=True, env=env
        ).stdout.strip()
        for first in ("runtime first", "torch first")
    }
    assert runs == {
        "runtime first": "[(True, True, True)] True True",  # after torch, forked
        "torch first": "[(True, False, False)] True True",
    }  # before the rest, executed
