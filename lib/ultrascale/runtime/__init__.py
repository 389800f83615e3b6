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

from .forkserver import start_fork_server, starts_at_import

if starts_at_import():
    # Before anything below imports torch: the ranks' fork server imports it on another core
    # meanwhile (see forkserver.py), so the cell or line that makes the first Cluster need not wait.
    start_fork_server()

from .collector import collector_paused  # noqa: E402

# torch's few hundred thousand objects, imported without the collector walking them (collector.py)
with collector_paused():
    from .cluster import Cluster, current_cluster, grading_cluster, resolve_backend, shared_cluster  # noqa: E402
    from .context import RankContext  # noqa: E402
    from .errors import CallTimeout, RankError, RankFailure  # noqa: E402

__all__ = [
    "Cluster", "shared_cluster", "grading_cluster", "current_cluster", "resolve_backend", "start_fork_server",
    "RankContext", "RankError", "CallTimeout", "RankFailure", "load_ipython_extension",
]


def load_ipython_extension(ipython):
    """``%load_ext ultrascale.runtime`` registers the ``%%ranks`` magic."""
    from .magic import register

    register(ipython, current_cluster)
