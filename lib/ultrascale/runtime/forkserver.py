"""Where the ranks come from: a fork server with torch preloaded, started when the runtime is imported.

A first ``Cluster(...)`` spends almost all its time in the fork server importing torch: on this
course's 2-core machines ``import torch`` alone takes a second or more. The ranks the server then
forks start in tens of milliseconds. So ``import ultrascale.runtime`` starts the server at once
(``start_fork_server``), and it makes its imports while the notebook or script goes on.

How it starts depends on what the caller had done before. Where the runtime imported torch itself
(nothing of the caller's has run torch yet), the server is a plain fork of the caller made just
after that import (``forked=True``): it shares the caller's torch (about 1.5 s of CPU it need not
spend again, and its memory pages), and imports only what the ranks need besides. Where torch was
imported before the runtime, the caller may have started torch's threads (a first matmul starts
OpenMP's) or CUDA, which a plain fork does not carry over safely; the server is then what
multiprocessing always makes, a fresh interpreter (fork and exec), started *before* the runtime
imports the rest, so that its import of torch runs on one core beside the caller's on the other.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import multiprocessing.util as mp_util
import os
import sys
import warnings

EAGER = "ULTRASCALE_EAGER_FORKSERVER"
# What the server imports before it forks any rank, so that no rank imports it again. Besides the
# worker (and torch with it): torch._dynamo, which torch.optim imports when a process makes its
# first optimizer (its optimizers' methods are wrapped to disable compilation). That import costs
# about 2 s of CPU, in every rank: it was half of all the ranks' CPU time in a chapter such as
# 09 (its papermill run went from 39 to 21 s of CPU), and on 2 cores 4 ranks importing it took
# 3.3 s before their first step. The server pays it once, beside the notebook's own imports.
# ultrascale.runtime.preload imports both with the garbage collector paused, then freezes them
# (collector.py): 2.1 s of the server's CPU instead of 2.45.
PRELOAD = ("ultrascale.runtime.preload",)
_started = False  # start_fork_server() has run in this process


@contextlib.contextmanager
def no_main_reimport():
    """Start ranks without re-running the caller's main script in them.

    multiprocessing's spawn/forkserver children normally import the parent's
    ``__main__`` first, so a script without an ``if __name__ == "__main__"`` guard
    would start a Cluster inside every rank. Our ranks never need it: functions
    from ``__main__`` (a notebook or a script) travel by value with cloudpickle.
    """
    original = mp_spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    mp_spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = original


def mp_context():
    """A fork server with torch preloaded: new ranks start in tens of milliseconds.

    ``fork`` would be faster still but is unsafe once the caller has started threads
    or initialised CUDA, and even a plain script has: ``import torch`` leaves a second
    OS thread behind (``/proc/self/task`` lists two). ``spawn`` re-imports torch in
    every rank (seconds).
    (torch.multiprocessing's contexts are the standard library's: this is the same one.)
    """
    if sys.platform == "win32":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def in_a_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and hasattr(shell, "kernel")


def in_a_script() -> bool:
    """Is the main program a file (``python script.py``, ``python -m module``, pytest)?

    Not for ``python -c`` one-liners or the interactive prompt: those are mostly quick probes
    (``launch/torchrun.sh`` asks one for the ranks per node) that make no cluster.
    """
    return getattr(sys.modules.get("__main__"), "__file__", None) is not None


def is_a_rank() -> bool:
    """Is this process itself one of many started by someone else: a rank of torchrun (or of
    torch elastic), or any multiprocessing child, ours included? None makes a Cluster of its own.
    (The fork server runs as ``python -c``, so it is no script; ranks forked from it have the
    runtime imported already.)"""
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    return launched or mp.parent_process() is not None


def starts_at_import() -> bool:
    """Whether ``import ultrascale.runtime`` starts the fork server: in a notebook kernel and in
    a script, never in a rank. Measured by ``benchmarks/bench_runtime.py`` on 2 cores, 4 ranks
    (medians of 3, at the commit that made the server a fork): the Cluster cell of a notebook takes
    0.70 s instead of 1.81 s when the server starts at the first ``Cluster``; a script's
    ``Cluster(4)`` line 1.01 s when it imports the runtime first (the server a fork sharing its
    torch) and 2.08 s when it imports torch first (a fresh server importing torch, 1.16 s of it).
    torch._dynamo is in the preload (PRELOAD): it lengthens that line but spares every rank about
    2 s of CPU at its first optimizer (3.3 s before the first step of 4 ranks, on 2 cores)."""
    return (in_a_notebook() or in_a_script()) and not is_a_rank()


def stop_fork_server() -> bool:
    """Stop this process's fork server, if it runs: it holds torch, imported, about 200 MB of
    memory of its own once no rank shares its pages. Every rank it forked dies with it (they ask
    to be killed when their parent dies, worker.py), so only call this when none is left. The
    next rank started brings a new server up (multiprocessing does, with the same preload).
    Returns whether one was stopped."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    # _stop is the standard library's own way down (its tests use it), private but there since 3.8
    if sys.platform == "win32" or getattr(server, "_forkserver_pid", None) is None or not hasattr(server, "_stop"):
        return False
    server._stop()
    return True


def start_fork_server(forked: bool = False) -> bool:
    """Start the fork server now, so that it makes its imports while the caller does other work.

    ``import ultrascale.runtime`` calls this when ``starts_at_import()``: with ``forked=True`` at
    the end of its own imports, when it imported torch itself (the server is then a fork of this
    process, see the module's docstring and ``_forked_not_executed``); otherwise before it imports
    torch, so that the server's import runs beside the caller's. A script gains most when the
    runtime comes before its own ``import torch``. It returns at once. Once per process; off with
    ULTRASCALE_EAGER_FORKSERVER=0. Returns whether it started one. (Nothing is written to the
    environment: programs this one starts, notebook kernels included, decide for themselves.)
    Only this first server may be a plain fork: one started later (after ``stop_fork_server``, or
    by multiprocessing when a server died) is always a fresh interpreter.
    """
    global _started
    if sys.platform == "win32" or os.environ.get(EAGER, "1") != "1" or _started:
        return False
    _started = True
    from multiprocessing import forkserver

    mp_context()  # the preload list, before the server starts
    with no_main_reimport(), _forked_not_executed() if forked else contextlib.nullcontext():
        forkserver.ensure_running()  # never re-run the caller's script, as for the ranks
    return True


# multiprocessing starts its server as `python -c "from multiprocessing.forkserver import main; main(...)"`
_SERVER_CODE = "from multiprocessing.forkserver import main"


@contextlib.contextmanager
def _forked_not_executed():
    """While the body runs, multiprocessing's fork server starts as a plain fork of this process
    that runs the server's code (the same line multiprocessing would give a fresh interpreter)
    instead of a fork followed by exec. Everything else about the server is the standard library's
    own: its socket, its "alive" pipe, the ranks it forks, how it stops.

    The fork copies one thread, the caller's; a kernel's other threads (Jupyter's messaging) are
    not there in the server, which uses nothing of theirs. So the server first becomes what a fresh
    interpreter would be: the file descriptors multiprocessing did not pass are closed (a kernel's
    sockets stay the kernel's alone), standard output and error are the process's own again, not
    the kernel's, and it leaves by ``os._exit``, never running the caller's exit handlers."""
    original = mp_util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):
        if _SERVER_CODE not in args[-1]:  # the resource tracker, started first: as always
            return original(path, args, passfds)
        with warnings.catch_warnings():  # Python 3.12+ warns about forking a process with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            _like_a_fresh_process(passfds)
            exec(args[-1], {"__name__": "__mp_main__"})
            code = 0
        except SystemExit as stop:  # the server's way out when its last client has gone
            code = stop.code if isinstance(stop.code, int) else 0
        except BaseException:  # noqa: BLE001 - say why on stderr, as a fresh server would
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)

    mp_util.spawnv_passfds = spawnv_passfds
    try:
        yield
    finally:
        mp_util.spawnv_passfds = original


def _like_a_fresh_process(passfds) -> None:
    """In the forked server: only the descriptors a fresh server would have, and plain stdio."""
    keep = sorted({0, 1, 2, *passfds})
    for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
        os.closerange(low + 1, high)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    name_this_process("forkserver")  # its command line is the kernel's (or script's): say what it is
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is not None:  # the kernel's shell object is here but no kernel is: ranks are not in a notebook
        _KEPT.append(shell)  # (kept alive: nothing of the kernel's is torn down here)
        type(shell).clear_instance()


_KEPT: list = []


def name_this_process(name: str) -> None:
    """The name ``top``, ``ps -o comm`` and ``pgrep`` show for this process (Linux, 15 characters
    at most; elsewhere nothing). A forked fork server and its ranks would otherwise all show the
    command line of the kernel or script they were forked from."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_NAME = 15
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        except (OSError, AttributeError):  # not glibc: the name stays "python"
            pass
