"""Persistent ranks beside a notebook, and the same functions under torchrun.

    from ultrascale.runtime import Cluster
    cluster = Cluster(4)
    cluster.run(lambda ctx: ctx.rank)         # -> [0, 1, 2, 3]

Modules: ``cluster`` (the ranks' lifecycle, notebook side), ``call`` (one call,
notebook side), ``worker`` (the rank side), ``context`` (the ``ctx`` every function
receives), ``magic`` (the ``%%ranks`` cell magic), ``torchrun`` (the same function
under torchrun or SLURM), ``errors``.
"""

import sys

from .cluster import Cluster, current_cluster, resolve_backend, shared_cluster, start_fork_server
from .context import RankContext
from .errors import CallTimeout, RankError, RankFailure

__all__ = [
    "Cluster", "shared_cluster", "current_cluster", "resolve_backend", "start_fork_server",
    "RankContext", "RankError", "CallTimeout", "RankFailure", "load_ipython_extension",
]


def _in_a_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and hasattr(shell, "kernel")


if _in_a_notebook():
    start_fork_server()   # the ranks' fork server imports torch from now on (see its docstring)


def load_ipython_extension(ipython):
    """``%load_ext ultrascale.runtime`` registers the ``%%ranks`` magic."""
    from .magic import register

    register(ipython)
