"""Persistent ranks beside a notebook, and the same functions under torchrun.

    from ultrascale.runtime import Cluster
    cluster = Cluster(4)
    cluster.run(lambda ctx: ctx.rank)         # -> [0, 1, 2, 3]

Modules: ``cluster`` (the ranks' lifecycle, notebook side), ``call`` (one call,
notebook side), ``worker`` (the rank side), ``context`` (the ``ctx`` every function
receives), ``magic`` (the ``%%ranks`` cell magic), ``torchrun`` (the same function
under torchrun or SLURM), ``errors``, ``forkserver`` and ``preload`` (where the ranks come from),
``collector`` (torch imported without the garbage collector walking its objects).
"""

import sys

from .forkserver import start_fork_server, starts_at_import

# The ranks' fork server starts now, so that the cell or line that makes the first Cluster need
# not wait for its imports (forkserver.py). If torch is imported already, the caller may have run
# it: the server is then a fresh interpreter, started before anything below, to import torch on
# another core meanwhile. If not, it is a fork of this process once torch is imported, below
# (on Linux: macOS forbids much of what its system libraries do in a fork of a process with threads).
_EAGER = starts_at_import()
_FORK_AFTER_IMPORTS = _EAGER and "torch" not in sys.modules and sys.platform == "linux"
if _EAGER and not _FORK_AFTER_IMPORTS:
    start_fork_server()

from .collector import collector_paused  # noqa: E402

# torch's few hundred thousand objects, imported without the collector walking them (collector.py)
with collector_paused():
    from .cluster import Cluster, current_cluster, grading_cluster, resolve_backend, shared_cluster  # noqa: E402
    from .context import RankContext  # noqa: E402
    from .errors import CallTimeout, RankError, RankFailure  # noqa: E402

if _FORK_AFTER_IMPORTS:  # torch is imported, and nothing but the runtime has run it
    start_fork_server(forked=True)

__all__ = [
    "Cluster",
    "shared_cluster",
    "grading_cluster",
    "current_cluster",
    "resolve_backend",
    "start_fork_server",
    "RankContext",
    "RankError",
    "CallTimeout",
    "RankFailure",
    "load_ipython_extension",
]


def load_ipython_extension(ipython):
    """``%load_ext ultrascale.runtime`` registers the ``%%ranks`` magic."""
    from .magic import register

    register(ipython, current_cluster)
