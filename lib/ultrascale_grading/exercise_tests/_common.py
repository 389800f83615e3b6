"""What the graders of chapters 04 and 05 (tensor and sequence parallelism) share.

* the layouts every test runs on (:func:`layouts`, :func:`tp_group`, :func:`run_layouts`):
  clusters of 2 and 3 ranks (and the notebook's ``WORLD_SIZE``) as one tp group, then cut
  into two groups, one of which does not start at global rank 0;
* seeded inputs (:func:`randn`) and the float32 comparisons (:func:`close`, :func:`off_by`,
  :func:`shape_problem`, ``TOL``);
* the collectives a ``CommLogger`` saw, judged against the library's (:func:`collectives`,
  :func:`same_collectives`, :func:`wrong_group`) and those called on a tensor autograd
  tracks (:func:`untracked_collectives`);
* a backward whose incoming gradient is shared with another branch (:class:`SharedBranch`,
  :func:`shared_problem`), the library's answer refused while the learner's code runs
  (:func:`refused_library`), and one forward and backward of a communication Function with
  its collectives (:func:`run_pair`).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from types import SimpleNamespace

import torch

from ultrascale.parity import max_difference, tolerance

TOL = tolerance(None)  # float32, one forward and backward: rounding only


def layouts(world_size: int, quick: bool) -> list:
    """(cluster size, split) pairs: every size as one tp group, then the sizes >= 3 cut in two,
    once into halves and once into rank 0 alone and the rest (a group whose ranks are not the
    global ones: its first rank is global rank 1)."""
    sizes = sorted({2, 3, world_size} if quick else {2, 3, 4, world_size})
    return (
        [(n, None) for n in sizes]
        + [(n, "halves") for n in sizes if n >= 3]
        + [(n, "rank 0 alone") for n in sizes if n >= 3]
    )


def tp_group(ctx, split):
    """The tp group of this rank and a description of the layout, for the messages.

    ``split``: None, the whole cluster; "halves", ranks [0, ceil(N/2)) and [ceil(N/2), N);
    "rank 0 alone", ranks [0] and [1, N). Every rank creates both groups, in the same order,
    as ``dist.new_group`` requires.
    """
    n = ctx.world_size
    if not split:
        return ctx.group, f"{n} ranks in one tp group"
    cut = (n + 1) // 2 if split == "halves" else 1
    first, second = list(range(cut)), list(range(cut, n))
    groups = (ctx.new_group(first), ctx.new_group(second))
    mine = 0 if ctx.rank < cut else 1
    return groups[mine], (
        f"{n} ranks split into tp groups {first} and {second} (every collective must "
        f"pass group=group, or it sums over the wrong ranks)"
    )


def randn(shape, seed: int, *salt: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """A tensor (float32 unless ``dtype`` says) drawn from a generator seeded by ``seed`` and
    ``salt``, on the host, then moved to ``device`` (a rank passes ``ctx.device``): the same
    values on every device."""
    mixed = seed * 1_000_003 + sum((i + 1) * 7919 * s for i, s in enumerate(salt))
    return torch.randn(shape, generator=torch.Generator().manual_seed(mixed), dtype=dtype).to(device)


def collectives(log) -> list:
    """(collective, bytes sent by this rank) of every call a ``CommLogger`` recorded."""
    from ultrascale.comm.logger import base_op

    return [(base_op(e.op), e.bytes_sent) for e in log.events]


def describe(ops) -> str:
    if not ops:
        return "no collective"
    return " + ".join(op for op, _ in ops)


def same_collectives(got, expected, who: str) -> str | None:
    """None when ``got`` calls the collectives of ``expected`` (the library's), with its bytes."""
    if [op for op, _ in got] != [op for op, _ in expected]:
        return f"{who} called {describe(got)}; expected {describe(expected)}"
    sent, wanted = sum(b for _, b in got), sum(b for _, b in expected)
    if sent != wanted:
        return (
            f"{who} called {describe(got)} as expected, but it moved {sent:,} bytes from this rank where "
            f"the library moves {wanted:,}: communicate the tensor itself, once, not a larger or padded one"
        )
    return None


def group_sizes(*logs) -> list:
    """The size of the group every collective the ``CommLogger``s recorded ran on."""
    return [e.world_size for log in logs for e in log.events]


def wrong_group(sizes, n: int) -> str | None:
    """None when every collective ran on the tp group (``n`` ranks)."""
    other = [size for size in sizes if size != n]
    if not other:
        return None
    return (
        f"a collective ran over {other[0]} ranks, not over the {n} ranks of the tp group: pass group=group to "
        "every collective (without it, a collective runs over all the ranks of the job)"
    )


class SharedBranch:
    """``out = y + 2 * side``, to run backward with: the gradient reaching ``y`` is also the other branch's.

    Autograd hands the same tensor to both terms of a sum, and runs the node created last first:
    made before the learner's forward, ``side``'s branch runs after the learner's backward. A
    backward that changes its incoming gradient in place (``dist.all_reduce(grad)`` on the tensor
    itself) thus changes ``side.grad`` too, as it would change a residual's in a transformer, and
    the gradient given to ``backward``. Judge the evidence with ``shared_problem``.
    """

    def __init__(self, upstream):
        self.side = torch.zeros_like(upstream, requires_grad=True)
        self.branch = 2 * self.side
        self.incoming = upstream.clone()

    def backward(self, y) -> dict:
        if torch.is_tensor(y) and y.requires_grad and y.shape == self.incoming.shape:
            (y + self.branch).backward(self.incoming)
        return {"incoming": self.incoming, "side": self.side.grad}


def shared_problem(got, upstream) -> str | None:
    """What ``SharedBranch`` saw, judged: the incoming gradient and the other branch's, untouched."""
    shared = got.get("shared")
    if shared is None or shared["side"] is None:
        return None
    if not torch.equal(shared["incoming"], upstream) or not torch.equal(shared["side"], 2 * upstream):
        return (
            "the backward changed the gradient it was given in place (a collective on grad itself, e.g. "
            "dist.all_reduce(grad)). Autograd hands that same tensor to the other branches that use the "
            "output: with out = y + r (a residual), r's gradient changed too. Leave the incoming gradient "
            "alone: communicate a copy (grad.clone()) and return it"
        )
    return None


_C10D_NAMES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "allgather_base": "all_gather_into_tensor",
    "reduce_scatter_base": "reduce_scatter_tensor",
    "alltoall_base": "all_to_all_single",
}


@contextlib.contextmanager
def untracked_collectives():
    """Collect the collectives called on a tensor that autograd tracks, from PyTorch's warning.

    ``dist.all_reduce`` and its kin have no backward formula: called on a tensor that
    requires grad, they make autograd warn ("an autograd kernel was not registered") and
    pass the gradient through unchanged: f*'s backward by luck, wrong for f, g and g*.
    The autograd-aware versions (``comm.functional``) or a detached tensor do not warn.
    """
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    for w in caught:
        match = re.search(r"c10d::(\w+?)_?: an autograd kernel was not registered", str(w.message))
        name = match and "dist." + _C10D_NAMES.get(match.group(1).strip("_"), match.group(1).strip("_"))
        if name and name not in found:
            found.append(name)


def untracked_problem(found, instead: str) -> str | None:
    if not found:
        return None
    return (
        f"your code called {', '.join(found)} directly on a tensor that autograd tracks. A plain collective "
        "has no backward: PyTorch only warns and passes the gradient through unchanged. Use " + instead
    )


@contextlib.contextmanager
def refused_library(forbid=None):
    """While open, the library's own answer to the exercise refuses to run.

    ``forbid`` is ``(functions, exercise_id, hint)`` for ``grading.guards.forbid_library``
    (None: nothing is forbidden). A refusal ends the block quietly and its message is kept
    in ``.message``: every rank stops at the same call, so none waits in a collective, and
    the rank reports it as its problem.
    """
    from ultrascale_grading.guards import ForbiddenCall, forbid_library

    refusal = SimpleNamespace(message=None)
    if forbid is None:
        yield refusal
        return
    try:
        with forbid_library(*forbid):
            yield refusal
    except ForbiddenCall as err:
        refusal.message = str(err)


def close(got, want) -> bool:
    return (
        torch.is_tensor(got)
        and tuple(got.shape) == tuple(want.shape)
        and bool(torch.allclose(got.detach().to(want.dtype), want, **TOL))
    )


def off_by(got, want) -> str:
    return f"{max_difference(got.detach(), want):.3g}"


def shape_problem(what: str, got, want) -> str | None:
    if not torch.is_tensor(got):
        return f"{what} is {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return None


def run_layouts(on_rank, args, world_size: int, quick: bool, timeout: float) -> None:
    """Run ``on_rank(ctx, *args, split)`` on every layout; raise the first problem a rank reports."""
    from ultrascale.runtime import grading_cluster

    for size, split in layouts(world_size, quick):
        results = grading_cluster(size).run(on_rank, *args, split, timeout=timeout)
        for problem in results:
            if problem:
                raise AssertionError(problem)


def run_pair(apply, x, upstream, group, forbid=None) -> dict:
    """Forward and backward of ``apply(x, group)`` with the collectives of each direction, then
    the same once more where the output's gradient is shared with another branch."""
    from ultrascale.comm import CommLogger

    given = x.clone().requires_grad_()
    with refused_library(forbid) as refusal:
        with CommLogger() as forward:
            y = apply(given, group)
        changed = not torch.equal(given.detach(), x)
        with CommLogger() as backward:
            if torch.is_tensor(y) and y.requires_grad and y.shape == upstream.shape:
                y.backward(upstream.clone())
        with CommLogger() as again:
            branch = SharedBranch(upstream)
            shared = branch.backward(apply(x.clone().requires_grad_(), group))
    if refusal.message:
        return {"forbidden": refusal.message}
    return {
        "y": y.detach().clone() if torch.is_tensor(y) else y,
        "grad": given.grad,
        "changed": changed,
        "forward": collectives(forward),
        "backward": collectives(backward),
        "shared": shared,
        "sizes": group_sizes(forward, backward, again),
    }
