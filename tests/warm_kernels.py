"""Warm notebook kernels for the test suite: each a fork of a process that has made a kernel's imports.

`make test` starts about ninety notebook kernels (nbval's, the papermill runs', the grader's, the
browser tests' JupyterLab), and each fresh one spent 2.5 to 3 s of CPU importing before it ran a
cell: ipykernel, torch (1.2 s), and in its ranks' fork server torch._dynamo (1.3 s). On the suite's
2 cores that was about a seventh of all its CPU. Here a zygote (the grader has one too:
ultrascale_grading/zygote.py) makes those imports once, and each kernel is a fork of it: a new
process, its own session and process group, its environment, folder and standard streams those
jupyter_client gave it, with nothing imported that a fresh kernel would not have imported by its
first cell's end. The notebook's code runs as it would in a fresh kernel.

    python tests/warm_kernels.py serve SOCKET      # the zygote (launch/test.sh starts it)
    python tests/warm_kernels.py kernelspec DIR    # DIR/kernels/python3: the kernel below
    python tests/warm_kernels.py launch -f CONN    # what jupyter_client runs as a kernel

``launch`` is the kernel process jupyter_client sees: it hands its connection file, environment,
folder and standard streams to the zygote, which forks the kernel, and it then stays as the
kernel's stand-in: it passes on the signals jupyter_client sends (interrupt, terminate), and exits
with the kernel's exit code; if it is killed, the zygote kills the kernel's process group. Where
the zygote cannot serve a kernel exactly as a fresh one would be, ``launch`` becomes a fresh one
(``python -m ipykernel_launcher``, as ipykernel's own kernelspec runs), and the zygote's log says
why:
* no zygote (ULTRASCALE_WARM_KERNEL_SOCKET unset: tests that are about how a kernel starts unset it);
* an environment variable that the zygote's imports read differs (OMP_*, MKL_*, TRITON_*, TORCH*,
  ULTRASCALE_* but the strict modes and the grader's, ...): the imports would differ;
* a caller in a sandbox (the grader's: other namespaces, limits or cgroup than the zygote's): a
  fork of the zygote would run outside it;
* a torch built for CUDA: CUDA is not safe in a fork, and the zygote never asks for a GPU.

What differs from a fresh kernel, and why it does not matter here: the modules are imported already
(sys.modules is not what a notebook can observe of its results), and every kernel shares the
zygote's string-hash seed (Python's PYTHONHASHSEED; set iteration order of strings, which no
compared output may depend on anyway). Python's ``random`` is reseeded in each kernel.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "ULTRASCALE_WARM_KERNEL_SOCKET"
# Variables read while the zygote imports (by OpenMP, MKL, torch, Triton, Python, the library): a
# kernel whose environment differs in one of them gets a fresh interpreter.
IMPORT_TIME = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "TRITON_", "CUDA", "NVIDIA_")
IMPORT_TIME += ("PYTHON", "LD_", "MPL", "IPYTHON", "ULTRASCALE_", "HOME", "XDG_")
# ...but these are read only when a cell runs (ultrascale.runtime's strict modes, the grader's files).
# (jupyter_core reads its JUPYTER_* variables when asked for a path, as the kernel starts: after the
# fork; TORCHINDUCTOR_CACHE_DIR when inductor first needs its cache; TMPDIR, tempfile.gettempdir()'s,
# is forgotten in each kernel, become_kernel.)
RUN_TIME = ("ULTRASCALE_STRICT_DEVICE", "ULTRASCALE_STRICT_P2P", "ULTRASCALE_GRADE_FILE", "ULTRASCALE_GRADE_DEFER")
RUN_TIME += (SOCKET_ENV, "TORCHINDUCTOR_CACHE_DIR")
EAGER = "ULTRASCALE_EAGER_FORKSERVER"


# --------------------------------------------------------------------------- the kernel's stand-in
def launch(args: list) -> None:
    """Run a kernel with ``args`` (``-f CONNECTION_FILE``): forked by the zygote, or fresh."""
    path = os.environ.get(SOCKET_ENV)
    reply = None
    if path:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            request = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ), "python": _python()})
            request = request.encode()
            socket.send_fds(conn, [struct.pack("!Q", len(request))], [0, 1, 2])
            conn.sendall(request)
            reader = conn.makefile("rb")
            reply = json.loads(reader.readline() or b"null")
        except OSError:
            reply = None
    if not reply or "pid" not in reply:
        fresh(args)
    pid = reply["pid"]

    def pass_on(signum, _frame):
        try:
            os.killpg(pid, signum)  # the kernel leads its own group, its ranks in it: as jupyter_client's killpg
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, pass_on)
    line = None
    while line is None:
        try:
            line = reader.readline()
        except InterruptedError:  # a signal arrived while waiting (Python retries; old ones raised)
            continue
    ended = json.loads(line) if line else {"code": 1}  # no line: the zygote died, and its kernels with it
    sys.exit(ended["code"])


def _python() -> list:
    """This interpreter and its options (-X, -O, ...): a kernel's must be the zygote's."""
    return [sys.executable, sys._xoptions, list(sys.flags)]


def learners_env(env: dict) -> dict:
    """``env`` without the warm kernels: for a JupyterLab the tests drive as a learner's (its kernels are
    the course's own kernelspec, children of the Lab server, whose processes and memory the tests
    measure)."""
    env = {name: value for name, value in env.items() if name != SOCKET_ENV}
    if SOCKET_ENV in os.environ and "JUPYTER_PATH" in env:
        ours = os.path.join(os.path.dirname(os.environ[SOCKET_ENV]), "jupyter")  # launch/test.sh's layout
        kept = [folder for folder in env["JUPYTER_PATH"].split(os.pathsep) if folder != ours]
        env["JUPYTER_PATH"] = os.pathsep.join(kept)
        if not kept:
            del env["JUPYTER_PATH"]
    return env


def fresh(args: list) -> None:
    """Become a fresh kernel, as ipykernel's own kernelspec starts one."""
    options = [f"-X{k}" if v is True else f"-X{k}={v}" for k, v in sys._xoptions.items()]
    os.execv(sys.executable, [sys.executable, *options, "-m", "ipykernel_launcher", *args])


def kernelspec(folder: str) -> list:
    """Write ``folder/kernels/python3/kernel.json``: the python3 kernel jupyter_client finds now (the
    course's, launch/setup.sh), but started by ``launch``; returns the interpreter and its options (the
    zygote must run as the kernel would)."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3").to_dict()
    argv = spec["argv"]
    module = argv.index("ipykernel_launcher") - 1 if "ipykernel_launcher" in argv else None
    if module is None or argv[module] != "-m":
        raise SystemExit(f"warm kernels: the python3 kernel is not `python -m ipykernel_launcher`: {argv}")
    spec["argv"] = [*argv[:module], os.path.abspath(__file__), "launch", *argv[module + 2 :]]
    target = os.path.join(folder, "kernels", "python3")
    os.makedirs(target, exist_ok=True)
    with open(os.path.join(target, "kernel.json"), "w") as f:
        json.dump(spec, f, indent=1)
    return argv[:module]


# --------------------------------------------------------------------------- the zygote
def preload() -> str | None:
    """A kernel's imports, in a fresh kernel's order; returns why no kernel can be served, or None."""
    import ultrascale  # noqa: F401 - first, as a chapter's first line: it sets OMP_WAIT_POLICY before torch loads OpenMP

    saved = {name: os.environ.get(name) for name in (EAGER, "TRITON_INTERPRET", "MPLBACKEND")}
    os.environ[EAGER] = "0"  # no fork server in the zygote: each kernel starts its own (become_kernel)
    import torch

    if torch.version.cuda or torch.version.hip:
        return "torch is built for a GPU (CUDA is not safe to fork)"
    try:  # how the zygote learns that a kernel ended (Linux 5.3 and later)
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as err:
        return f"no pidfd_open here ({err})"
    # torch._dynamo imports triton.language, whose library functions are compiled or interpreted as
    # TRITON_INTERPRET says at that moment: on a CPU, ultrascale.kernels sets it to 1 before triton
    # loads (kernels/_device.py), so a kernel that runs Triton has it so; one that does not, never asks
    if saved["TRITON_INTERPRET"] is None:
        os.environ["TRITON_INTERPRET"] = "1"
    import ipykernel.kernelapp  # noqa: F401

    # matplotlib reads MPLBACKEND when imported: a kernel sets it to its inline backend before any cell
    # runs (IPKernelApp.init_gui_pylab), unless the environment chose one
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    import matplotlib.pyplot  # noqa: F401
    import ultrascale.runtime  # noqa: F401
    import ultrascale.runtime.preload  # noqa: F401 - torch._dynamo and the worker: the ranks' fork server's imports

    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return None


def _ns(pid) -> list:
    """Where ``pid`` lives: its namespaces, limits and cgroup (a sandbox changes one of them)."""
    where = [os.readlink(f"/proc/{pid}/ns/{ns}") for ns in ("mnt", "pid", "user", "net", "ipc", "uts", "cgroup")]
    for name in ("limits", "cgroup"):
        with open(f"/proc/{pid}/{name}") as f:
            where.append(f.read())
    return where


def refusal(conn: socket.socket, request: dict, base_env: dict, cannot: str | None) -> str | None:
    """Why this caller's kernel cannot be a fork of the zygote (None: it can)."""
    if cannot:
        return cannot
    if request["python"] != json.loads(json.dumps(_python())):
        return f"another interpreter or options: {request['python']}, the zygote's {_python()}"
    env = request["env"]
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    try:
        if uid != os.getuid() or _ns(pid) != _ns("self"):
            return "the caller runs in another sandbox (namespaces, limits or cgroup)"
    except OSError as err:
        return f"cannot see the caller ({err})"
    for name in sorted(set(env) | set(base_env)):
        if name.startswith(IMPORT_TIME) and not name.startswith(RUN_TIME) and env.get(name) != base_env.get(name):
            if name == "TRITON_INTERPRET" and base_env.get(name) is None and env[name] == "1":
                continue  # what the zygote imported Triton with (preload), as ultrascale.kernels sets it on a CPU
            return f"{name} is {env.get(name)!r}, the zygote's {base_env.get(name)!r}"
    return None


def _receive(conn: socket.socket):
    conn.settimeout(10)
    header, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
    (size,) = struct.unpack("!Q", header)
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("the launcher left")
        data += chunk
    conn.settimeout(None)
    return json.loads(data), fds


def serve(path: str) -> dict:
    """The zygote's loop. Returns only in a forked kernel: the request it is to run."""
    import selectors
    import traceback

    base_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # first, so that a kernel asked for meanwhile waits for the imports
    listener.listen(128)
    cannot = preload()
    log(f"ready ({cannot or 'serving'})")
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, ("listener", None))
    kernels = {}  # pid -> [launcher's connection (None once it has gone), pidfd]
    while True:
        for key, _ in selector.select():
            kind, pid = key.data
            try:
                if kind == "listener":
                    request = _accept(listener, selector, kernels, base_env, cannot)
                    if request is not None:
                        return request  # in the forked kernel
                elif kind == "ended" and pid in kernels:  # a kernel exited: its launcher exits with its code
                    _ended(selector, kernels, pid)
                elif kind == "launcher" and pid in kernels and kernels[pid][0] is key.fileobj:
                    _launcher_gone(selector, kernels, pid)  # killed (SIGKILL): its kernel goes too
            except Exception:  # noqa: BLE001 - the zygote serves the other kernels whatever one did
                log(traceback.format_exc())


def _accept(listener, selector, kernels: dict, base_env: dict, cannot: str | None) -> dict | None:
    """Serve one launcher: refuse it, or fork its kernel. Returns the request in the kernel, else None."""
    import selectors

    conn, _ = listener.accept()
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError) as err:
        log(f"bad request: {err}")
        conn.close()
        return None
    why = refusal(conn, request, base_env, cannot)
    if why:
        log(f"fresh kernel: {why}")
        for fd in fds:
            os.close(fd)
        with conn:
            conn.sendall(b'{"refused": %s}\n' % json.dumps(why).encode())
        return None
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the kernel: none of the zygote's sockets
        selector.close()
        for other, pidfd in kernels.values():
            if other is not None:
                other.close()
            os.close(pidfd)
        listener.close()
        conn.close()
        return {**request, "fds": fds}
    for fd in fds:
        os.close(fd)
    kernels[pid] = [conn, os.pidfd_open(pid)]
    selector.register(kernels[pid][1], selectors.EVENT_READ, ("ended", pid))
    selector.register(conn, selectors.EVENT_READ, ("launcher", pid))
    log(f"forked kernel {pid}")
    conn.sendall(b'{"pid": %d}\n' % pid)
    return None


def _ended(selector, kernels: dict, pid: int) -> None:
    conn, pidfd = kernels.pop(pid)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    selector.unregister(pidfd)
    os.close(pidfd)
    if conn is not None:
        selector.unregister(conn)
        try:
            conn.sendall(b'{"code": %d}\n' % (code if code >= 0 else 128 - code))
        except OSError:
            pass
        conn.close()


def _launcher_gone(selector, kernels: dict, pid: int) -> None:
    conn = kernels[pid][0]
    selector.unregister(conn)
    conn.close()
    kernels[pid][0] = None
    try:
        os.killpg(pid, signal.SIGKILL)  # not reaped yet (its pidfd has not been read): the pid is still its
    except ProcessLookupError:
        pass


def become_kernel(request: dict) -> None:
    """In the fork: become the kernel jupyter_client asked for, then run it."""
    os.setsid()  # its own session and group, as jupyter_client starts a kernel (start_new_session)
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    import random

    random.seed()  # from the OS, as a fresh interpreter seeds it (numpy's and torch's are seeded by the notebook)
    import tempfile

    tempfile.tempdir = None  # found again from this kernel's TMPDIR, at its first temporary file
    import importlib.util

    # ipykernel reads JPY_PARENT_PID when it is imported (IPKernelApp.parent_handle's default): here
    # it was imported before jupyter_client set it, so it is given as an option
    parent = ["--IPKernelApp.parent_handle=" + os.environ["JPY_PARENT_PID"]] if "JPY_PARENT_PID" in os.environ else []
    sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, *request["args"], *parent]
    del sys.path[0]  # the zygote's folder; ipykernel_launcher removes a fresh kernel's first entry too
    # The ranks' fork server, as `import ultrascale.runtime` starts it in a fresh kernel: a fork of
    # this process, in which torch is imported and has run nothing (ultrascale.runtime.forkserver)
    if os.environ.get(EAGER, "1") == "1":
        from ultrascale.runtime.forkserver import start_fork_server

        start_fork_server(forked=True)
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()


def log(message: str) -> None:
    print(f"warm_kernels[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "launch":
        launch(rest)
    elif command == "kernelspec":
        print(*kernelspec(rest[0]))
    elif command == "serve":
        become_kernel(serve(rest[0]))
    else:
        raise SystemExit(__doc__)
