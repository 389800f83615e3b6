"""Where the ranks come from: a fork server with torch preloaded, startable before torch is imported.

A first ``Cluster(...)`` spends almost all its time in the fork server importing torch: a
fresh interpreter cannot share the notebook's import, and on this course's 2-core machines
``import torch`` alone takes seconds. The ranks the server then forks start in tens of
milliseconds. This module imports no torch, so ``ultrascale.runtime`` can start the server
*before* it imports torch itself: in a notebook whose first import is the runtime, the
server imports torch on one core while the kernel imports it on the other.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import os
import sys

EAGER = "ULTRASCALE_EAGER_FORKSERVER"


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
    ctx.set_forkserver_preload(["ultrascale.runtime.worker"])
    return ctx


def in_a_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and hasattr(shell, "kernel")


def start_fork_server() -> bool:
    """Start the fork server now, so that it imports torch while the notebook does other work.

    ``import ultrascale.runtime`` in a notebook (an IPython kernel) calls this before it
    imports torch, so the server's import runs beside the kernel's own imports instead of
    inside the cell that makes the cluster; scripts, torchrun ranks and tests make their
    clusters right after the import and gain nothing. It returns at once. Never in ranks or
    in the fork server itself (they inherit the variable set here); off with
    ULTRASCALE_EAGER_FORKSERVER=0. Returns whether it started one.
    """
    if sys.platform == "win32" or os.environ.get(EAGER, "1") != "1":
        return False
    os.environ[EAGER] = "started"       # inherited by the server and every rank: never twice
    from multiprocessing import forkserver

    mp_context()                        # the preload list, before the server starts
    with no_main_reimport():            # as for the ranks: never re-run the caller's script
        forkserver.ensure_running()
    return True
