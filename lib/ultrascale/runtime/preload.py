"""What the ranks' fork server imports before it forks any rank (``forkserver.PRELOAD``).

Importing this module imports the package first (``ultrascale.runtime``, which imports torch with
the garbage collector paused), then the rank's side of the runtime and torch._dynamo, also with
the collector paused; then it freezes every object alive, so that the ranks forked from the
server never walk them in their collections (see ``collector.py``).
"""

from .collector import collector_paused, freeze_for_fork

with collector_paused():
    import torch._dynamo  # noqa: F401  (torch.optim imports it at a process's first optimizer)

    from . import worker  # noqa: F401

freeze_for_fork()
