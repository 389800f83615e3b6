"""Process groups that are not the world, for the graders of exercises whose function takes ``group``.

Graded only on the whole world (or on a group that starts at rank 0), a function that forgets
``group=``, reduces over the default group, takes its size from the world, or uses the global
rank where the rank in the group is meant gives the right answer. A :class:`Split` cuts a
cluster into groups that work side by side, each on its own inputs, so that these mistakes
give a wrong result or an error instead:

* a group that does not start at rank 0 (its ranks in the group differ from the global ones),
  of another size than the world;
* every rank is in a group and busy, so a collective over the default group does not hang:
  it completes and mixes the groups' inputs (the caller gives each group other inputs).

``Split.run`` turns an error or a hang on the ranks into a failure that names the groups and
says what to check (``HINT``). ``only_group`` refuses, at once, a collective over another group
than the one given (without it, gloo may hang, or abort a rank, on the mismatch).

    SPLIT = Split([0], [1, 2])                   # rank 0 alone; ranks 1 and 2 together
    def on_rank(ctx, split):
        index, group, ranks = split.group_of(ctx)   # every rank creates every group
    SPLIT.run(on_rank, SPLIT, what="02.bucket_manager", timeout=60)
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch.distributed as dist

from ultrascale_grading.guards import swapped_dist_functions

HINT = (
    "Pass group=group to every collective, send and receive; take the size and the rank from the group "
    "(dist.get_world_size and dist.get_rank take it too), not from the world; a rank within the group goes to "
    "group_dst= / group_src= / group_peer=, while dst= / src= take a global rank"
)


class Split:
    """A cluster of ``sum(len(g) for g in groups)`` ranks cut into ``groups`` (lists of global ranks)."""

    def __init__(self, *groups):
        self.groups = tuple(tuple(g) for g in groups)
        self.world_size = sum(len(g) for g in self.groups)
        if sorted(r for g in self.groups for r in g) != list(range(self.world_size)):
            raise ValueError(f"the groups {self.groups} must hold every rank 0..{self.world_size - 1} once")

    def __str__(self) -> str:
        names = [str(list(g)) for g in self.groups]
        if len(names) == 1:
            return f"the one group of all ranks of a {self.world_size}-rank cluster"
        return f"the groups of ranks {', '.join(names[:-1])} and {names[-1]} of a {self.world_size}-rank cluster"

    def order(self) -> list:
        """Group indices, those that do not start at rank 0 first: they are the telling ones."""
        return sorted(range(len(self.groups)), key=lambda i: self.groups[i][0] == 0)

    def group_of(self, ctx):
        """``(index, process group, its global ranks)`` of this rank's group; creates every group
        on every rank, in the same order, as ``dist.new_group`` requires."""
        made = [ctx.new_group(list(g)) for g in self.groups]
        index = next(i for i, g in enumerate(self.groups) if ctx.rank in g)
        return index, made[index], list(self.groups[index])

    def context(self, ctx) -> "GroupContext":
        """``ctx`` as seen from inside this rank's group (for code such as ``init_mesh`` that
        builds its own groups from ``ctx``). The groups must all have the same size."""
        return GroupContext(ctx, self)

    def run(self, fn, *args, what: str, timeout: float) -> list:
        """``grading_cluster(world_size).run(fn, *args)``; an error or a hang on the ranks is
        reported as a failure on these groups, with ``HINT`` (a stub not filled in still is one)."""
        from ultrascale_grading.check import one_line
        from ultrascale.runtime import CallTimeout, RankError, grading_cluster

        try:
            return grading_cluster(self.world_size).run(fn, *args, timeout=timeout)
        except CallTimeout:
            raise AssertionError(
                f"{what} on {self}: the ranks waited for each other for {timeout:g} s and were stopped. A collective "
                "over the default group, or a send or receive to a rank outside the group, waits for ranks that "
                f"never come: did you pass group=? {HINT}"
            ) from None
        except RankError as err:
            if "NotImplementedError" in err.type_names:
                raise
            raise AssertionError(
                f"{what} on {self}: your code raised {one_line(err)}. Did you pass group=? {HINT}"
            ) from None


class GroupContext:
    """A rank's ``ctx`` inside its group of a :class:`Split`: ``rank`` and ``world_size`` within
    the group, ``new_group(ranks)`` with ranks within the group (the matching group is created
    in every group of the split, the same order everywhere), and a ``state`` of its own."""

    def __init__(self, ctx, split: Split):
        sizes = {len(g) for g in split.groups}
        if len(sizes) != 1:
            raise ValueError(f"GroupContext needs groups of one size, got {split.groups}")
        self._ctx, self._split = ctx, split
        self.index, self.group, self.ranks = split.group_of(ctx)
        self.rank, self.world_size = self.ranks.index(ctx.rank), len(self.ranks)
        self.device, self.backend = ctx.device, ctx.backend
        self.state = ctx.state.setdefault(("split", split.groups), {})

    def new_group(self, ranks):
        made = [self._ctx.new_group([g[r] for r in ranks]) for g in self._split.groups]
        return made[self.index]


# the *_single names are torch 2.13's (comm.functional's all_gather_into and reduce_scatter_into call them)
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
)


class WrongGroup(Exception):
    """A collective over another group than the one the learner's function was given."""


@contextlib.contextmanager
def only_group(group, what: str):
    """While open, a collective (``COLLECTIVES``) over another group than ``group``, the default
    group included (no ``group=``), raises :class:`WrongGroup` before it starts."""
    want = dist.get_process_group_ranks(group)

    def guard(name, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def guarded(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments.get("group")
            ranks = dist.get_process_group_ranks(given or dist.group.WORLD)
            if ranks != want:
                over = (
                    "the default group (no group=)"
                    if given in (None, dist.group.WORLD)
                    else f"the group of ranks {ranks}"
                )
                raise WrongGroup(f"{what} called dist.{name} over {over}, not over the group it was given, {want}")
            return original(*args, **kwargs)

        return guarded

    with swapped_dist_functions(COLLECTIVES, guard):
        yield
