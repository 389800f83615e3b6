"""``%%ranks``: run a notebook cell on every rank (or some) of the current cluster.

    %%ranks                 # all ranks of the most recent Cluster
    %%ranks -r 0,2 -t 30    # only ranks 0 and 2, 30 s timeout
    %%ranks -c my_cluster   # a named Cluster from the notebook's namespace

Each rank keeps its own namespace between ``%%ranks`` cells (in ``ctx.state``),
pre-filled with ``ctx``, ``rank``, ``world_size``, ``torch`` and ``dist``. If the
cell ends with an expression, each rank's value is shown, prefixed by its rank.
With ``-r``, the other ranks sit the cell out, so a collective inside it must use
a sub-group of exactly those ranks (``ctx.new_group([...])``, called by them all).
"""

from __future__ import annotations

import ast


def exec_cell(ctx, source: str):
    """Run ``source`` in this rank's persistent namespace; return repr of the last expression."""
    import torch
    import torch.distributed as dist

    ns = ctx.state.setdefault("__ranks_namespace__", {})
    ns.update(ctx=ctx, rank=ctx.rank, world_size=ctx.world_size, torch=torch, dist=dist)
    tree = ast.parse(source, filename="<%%ranks cell>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<%%ranks cell>", "exec"), ns)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), "<%%ranks cell>", "eval"), ns)
    return None if value is None else repr(value)


def _parse_ranks(text: str):
    return [int(r) for r in text.split(",") if r.strip()]


def register(ipython, current_cluster) -> None:
    """Register the magic with an IPython shell (idempotent).

    ``current_cluster()`` gives the Cluster a cell runs on without ``-c`` (the latest one:
    ``cluster.current_cluster``). It is passed in because ``cluster`` imports this module to
    register the magic when a Cluster starts; importing ``cluster`` here would close a circle.
    """
    from IPython.core.magic import register_cell_magic  # noqa: F401  (IPython is present)
    from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

    @magic_arguments()
    @argument("-r", "--ranks", default=None, help="comma-separated ranks, e.g. 0,2 (default: all)")
    @argument("-t", "--timeout", type=float, default=None, help="seconds before the call is given up")
    @argument("-c", "--cluster", default=None, help="name of a Cluster variable (default: the latest)")
    def ranks(line, cell):
        """Run this cell on the ranks of a Cluster."""
        args = parse_argstring(ranks, line)
        cluster = ipython.user_ns[args.cluster] if args.cluster else current_cluster()
        chosen = _parse_ranks(args.ranks) if args.ranks else None
        values = cluster.run(exec_cell, cell, ranks=chosen, timeout=args.timeout)
        shown = chosen if chosen is not None else range(cluster.world_size)
        for rank, value in zip(shown, values):
            if value is not None:
                print(f"[rank {rank}] Out: {value}")

    ipython.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
    _show_stops_in_one_line(ipython)


def _show_stops_in_one_line(ipython) -> None:
    """The stop button's ``Stopped`` shows as its one line, not as ten frames of the runtime's
    internals (multiprocessing, selectors) ending in a bare KeyboardInterrupt. The whole
    traceback stays one ``%tb`` away: the handler records it where ``%tb`` reads it."""
    import sys

    from .errors import Stopped

    def one_line(shell, etype, value, tb, tb_offset=None):
        sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # for %tb
        sys.last_exc = value
        print(f"Stopped: {value}  (%tb shows the full traceback)", file=sys.stderr)
        return None

    ipython.set_custom_exc((Stopped,), one_line)
