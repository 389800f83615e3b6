"""The suite's warm kernels (tests/warm_kernels.py) are the kernels jupyter_client would have started.

A warm kernel is a fork of a zygote that made a kernel's imports; everything a notebook can see of
its process must be a fresh kernel's: its environment, folder, import path, namespace, process
group, the matplotlib backend, the ranks' fork server (a fork, started before any torch work), and
it must obey jupyter_client as one does: interrupted, killed with its launcher, its exit code passed
on. Where it cannot be served as a fresh one (an import-time variable differs, a caller under other
limits, as the grader's sandbox makes), the kernel is a fresh interpreter.

Under ``launch/test.sh`` the suite's own zygote serves these tests; run alone, they start one.
"""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jupyter_client.manager import KernelManager

import warm_kernels
from ultrascale.headless import kernel_options  # (importing ultrascale sets OMP_WAIT_POLICY, before any zygote starts)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="warm kernels are Linux only (pidfd, /proc)")

PROBE = """
import json, os, sys, signal, random, __main__, matplotlib, multiprocessing.forkserver as fs
server = fs._forkserver._forkserver_pid
print(json.dumps({
    "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path, "argv": sys.argv[1:],
    "names": sorted(vars(__main__)), "group": os.getpgid(0) == os.getpid() == os.getsid(0),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler, "backend": matplotlib.get_backend(),
    "random": random.random(), "pid": os.getpid(),
    "server": server and open(f"/proc/{server}/cmdline", "rb").read().count(b"multiprocessing.forkserver"),
}))
"""


def _skip_unless_serving(log: Path) -> None:
    """Wait for the zygote's first line; skip, saying why, where it serves no kernel (a torch built
    for CUDA, as make test-compat's is: every kernel is then fresh, as it should be)."""
    deadline = time.monotonic() + 120
    while "ready (" not in (text := log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.2)
    ready = text[text.find("ready (") :].split("\n")[0]
    if ready != "ready (serving)":
        pytest.skip(f"the zygote serves no kernel here: {ready or 'it never became ready'}")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """The suite's zygote (launch/test.sh), or one of this module's own."""
    if os.environ.get(warm_kernels.SOCKET_ENV):
        socket_path = os.environ[warm_kernels.SOCKET_ENV]
        _skip_unless_serving(Path(socket_path).parent / "zygote.log")  # where launch/test.sh writes its log
        yield socket_path, None
        return
    folder = tmp_path_factory.mktemp("warm")
    socket_path = str(folder / "zygote.sock")
    python = warm_kernels.kernelspec(str(folder / "jupyter"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(warm_kernels.SOCKET_ENV, socket_path)
        patch.setenv("JUPYTER_PATH", str(folder / "jupyter"))
        with open(folder / "zygote.log", "w") as log:
            proc = subprocess.Popen([*python, warm_kernels.__file__, "serve", socket_path], stderr=log)
        try:
            _skip_unless_serving(folder / "zygote.log")
            yield socket_path, proc
        finally:
            proc.kill()
            proc.wait()


def _kernel(env: dict, cwd: Path):
    manager = KernelManager(kernel_name="python3", config=kernel_options()["config"])
    manager.start_kernel(env=env, cwd=str(cwd))
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=120)
    return manager, client


def _run(client, code: str, timeout: float = 60):
    out = []
    reply = client.execute_interactive(
        code,
        timeout=timeout,
        output_hook=lambda m: out.append(m["content"].get("text", "")) if m["msg_type"] == "stream" else None,
    )
    return reply["content"], "".join(out)


def _probe(env: dict, cwd: Path) -> dict:
    manager, client = _kernel(env, cwd)
    try:
        status, out = _run(client, PROBE)
        assert status["status"] == "ok", status
        return {**json.loads(out), "launcher": manager.provisioner.process.pid}
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)


def test_a_warm_kernel_is_what_a_fresh_one_would_be(zygote, tmp_path):
    socket_path, _ = zygote
    env = {**os.environ, warm_kernels.SOCKET_ENV: socket_path, "ULTRASCALE_STRICT_P2P": "1"}
    fresh = _probe({k: v for k, v in env.items() if k != warm_kernels.SOCKET_ENV}, tmp_path)
    warm, warm_again = _probe(env, tmp_path), _probe(env, tmp_path)
    assert fresh["pid"] == fresh["launcher"] and warm["pid"] != warm["launcher"], "not a fork of the zygote"
    assert not fresh["server"] and warm["server"] == 0, "the ranks' fork server is a fork, started already"
    for key in ("cwd", "path", "argv", "names", "group", "sigint", "backend"):
        if key == "argv":  # the parent's pid, given as an option where ipykernel read it at import
            warm[key] = [a for a in warm[key] if not a.startswith("--IPKernelApp.parent_handle=")]
            warm[key][1] = fresh[key][1] = "CONNECTION_FILE"  # each kernel's own
        assert warm[key] == fresh[key], key
    ignore = {"MPLBACKEND", warm_kernels.SOCKET_ENV}  # MPLBACKEND: set by ipykernel in both
    assert {k: v for k, v in warm["env"].items() if k not in ignore} == {
        k: v for k, v in fresh["env"].items() if k not in ignore
    }
    assert warm["random"] != warm_again["random"], "Python's random is reseeded in each kernel"


def test_an_import_time_variable_or_other_limits_get_a_fresh_kernel(zygote, tmp_path):
    socket_path, _ = zygote
    env = {**os.environ, warm_kernels.SOCKET_ENV: socket_path, "OMP_NUM_THREADS": "1"}
    probe = _probe(env, tmp_path)
    assert probe["pid"] == probe["launcher"], "OMP_NUM_THREADS is read when torch loads OpenMP"
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)  # as a sandbox sets limits, without bwrap
    resource.setrlimit(resource.RLIMIT_CORE, (0 if soft else 1, hard))
    try:
        probe = _probe({**os.environ, warm_kernels.SOCKET_ENV: socket_path}, tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    assert probe["pid"] == probe["launcher"], "a caller under other limits is not forked from the zygote"


def test_interrupt_kill_and_exit_code_reach_the_kernel(zygote, tmp_path):
    socket_path, _ = zygote
    env = {**os.environ, warm_kernels.SOCKET_ENV: socket_path}
    manager, client = _kernel(env, tmp_path)
    try:
        sent = client.execute("import time; print('sleeping', flush=True); time.sleep(60)")
        while client.get_iopub_msg(timeout=30)["msg_type"] != "stream":
            pass
        manager.interrupt_kernel()  # a signal to the launcher's group, passed on to the kernel's
        reply = client.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != sent:  # wait_for_ready's kernel_info replies come first
            reply = client.get_shell_msg(timeout=30)
        assert reply["content"].get("ename") == "KeyboardInterrupt", reply["content"]
        client.execute("import os; os._exit(3)")
        launcher = manager.provisioner.process
        deadline = time.monotonic() + 30
        while launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert launcher.poll() == 3, "the launcher exits with the kernel's code"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    manager, client = _kernel(env, tmp_path)
    _, out = _run(client, "import os; print(os.getpid())")
    pid = int(out)
    client.stop_channels()
    manager.shutdown_kernel(now=True)  # SIGKILL to the launcher's group, not the kernel's: the zygote kills it
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
