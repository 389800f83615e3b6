"""The fork server starts at ``import ultrascale.runtime`` (before torch) in a notebook kernel and in a script.

There the ranks' fork server begins importing torch as soon as the runtime is imported, so
the cell or line that makes the cluster no longer waits for it (benchmarks/bench_runtime.py
times both). What must hold: it starts in a kernel and in a script, not when switched off, not
in a ``python -c`` probe and never in a rank (torchrun's or any multiprocessing child); ranks
still see the notebook's import path and folder as they are when the cluster starts, even if
they changed after the import.
"""
import pytest
from jupyter_client.manager import start_new_kernel

PROBE = """
import os, sys, multiprocessing.forkserver as fs
import ultrascale.runtime
print("server", fs._forkserver._forkserver_pid is not None)
sys.path.append(os.path.abspath("added-after-import"))
from ultrascale.runtime import Cluster
with Cluster(2) as c:
    print("ranks", all("added-after-import" in p[-1] for p in c.run(lambda ctx: __import__("sys").path)))
"""


def _run_in_kernel(env_value, tmp_path):
    import os

    env = dict(os.environ, ULTRASCALE_EAGER_FORKSERVER=env_value)
    manager, client = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    lines = []
    try:
        reply = client.execute_interactive(PROBE, timeout=300, output_hook=lambda m: lines.append(
            m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return "".join(lines).split()


@pytest.mark.parametrize("env_value, started", [("1", "True"), ("0", "False")])
def test_fork_server_starts_at_import_in_a_kernel_unless_switched_off(env_value, started, tmp_path):
    assert _run_in_kernel(env_value, tmp_path) == ["server", started, "ranks", "True"]


SCRIPT_PROBE = """
import os, multiprocessing.forkserver as fs, ultrascale.runtime
print(fs._forkserver._forkserver_pid is not None, os.environ.get("ULTRASCALE_EAGER_FORKSERVER"))
"""


def _started_in(tmp_path, as_script=True, **env_changes):
    """Run SCRIPT_PROBE as a script file (or with ``python -c``); did the import start the server?"""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ULTRASCALE_EAGER_FORKSERVER", "LOCAL_RANK",
                                                             "TORCHELASTIC_RUN_ID")}
    env.update(env_changes)
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT_PROBE)
    args = [str(script)] if as_script else ["-c", SCRIPT_PROBE]
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True, env=env)
    return out.stdout.strip()


def test_a_script_starts_it_at_import(tmp_path):
    # and leaves the environment as it was, so the programs it starts (kernels too) decide for themselves
    assert _started_in(tmp_path) == "True None"


@pytest.mark.parametrize("where", ["switched off", "python -c", "torchrun rank", "elastic rank"])
def test_it_does_not_start_where_no_cluster_is_made(where, tmp_path):
    changes = {"switched off": dict(ULTRASCALE_EAGER_FORKSERVER="0"), "python -c": dict(as_script=False),
               "torchrun rank": dict(LOCAL_RANK="0"), "elastic rank": dict(TORCHELASTIC_RUN_ID="x")}[where]
    assert _started_in(tmp_path, **changes).split()[0] == "False"


def _import_runtime_in_a_child(queue):
    import multiprocessing.forkserver as fs

    import ultrascale.runtime  # noqa: F401

    queue.put(fs._forkserver._forkserver_pid is not None)


def test_a_multiprocessing_child_does_not_start_it():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")      # a fresh interpreter that imports the runtime itself
    queue = ctx.Queue()
    child = ctx.Process(target=_import_runtime_in_a_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=120) is False
    finally:
        child.join(30)


def test_the_fork_server_can_start_before_torch_is_imported():
    """runtime/__init__ starts the server before it imports torch, so the two imports overlap:
    the module it uses must not import torch itself."""
    import subprocess
    import sys

    code = """
import sys, types, multiprocessing.forkserver as fs
shell = types.SimpleNamespace(kernel=object())                     # as if in a notebook kernel
sys.modules["IPython"] = types.SimpleNamespace(get_ipython=lambda: shell)
seen = []
fs.ensure_running = lambda: seen.append("torch" in sys.modules)   # was torch loaded when it started?
import ultrascale.runtime
print(seen, "torch" in sys.modules)
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "ULTRASCALE_EAGER_FORKSERVER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[False] True"
