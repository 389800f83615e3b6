"""Where the ranks come from: a fork server with torch preloaded, startable before torch is imported.

A first ``Cluster(...)`` spends almost all its time in the fork server importing torch: a
fresh interpreter cannot share the caller's import, and on this course's 2-core machines
``import torch`` alone takes a second or more. The ranks the server then forks start in tens
of milliseconds. This module imports no torch, so ``ultrascale.runtime`` can start the server
*before* it imports torch itself: the server imports torch on one core while the notebook or
script that imported the runtime imports it (and everything else) on the other.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import os
import sys

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
_started = False            # start_fork_server() has run in this process


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
    a script, never in a rank. Measured by ``benchmarks/bench_runtime.py`` on 2 cores, 4 ranks,
    with torch._dynamo in the preload (PRELOAD): the Cluster cell of a notebook drops from about
    3.2 s to 0.8-0.9 s, and a script's ``Cluster(4)`` line from about 3 s to 1.5-2 s when it imports
    the runtime before torch. (Without torch._dynamo those were 0.07 s and 0.4 s, and each rank
    then paid about 2 s of CPU at its first optimizer: 3.3 s before the first step of 4 ranks.)"""
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


def start_fork_server() -> bool:
    """Start the fork server now, so that it imports torch while the caller does other work.

    ``import ultrascale.runtime`` calls this before it imports torch when ``starts_at_import()``,
    so the server's import runs beside the caller's own imports instead of inside the line
    that makes the first cluster. A script gains most when the runtime comes before its own
    ``import torch``: the two imports then run side by side (torch first leaves only what the
    script does between the two imports and its first Cluster to overlap). It returns at once.
    Once per process; off with ULTRASCALE_EAGER_FORKSERVER=0. Returns whether it started one.
    (Nothing is written to the environment: programs this one starts, notebook kernels
    included, decide for themselves.)
    """
    global _started
    if sys.platform == "win32" or os.environ.get(EAGER, "1") != "1" or _started:
        return False
    _started = True
    from multiprocessing import forkserver

    mp_context()                        # the preload list, before the server starts
    with no_main_reimport():            # as for the ranks: never re-run the caller's script
        forkserver.ensure_running()
    return True
