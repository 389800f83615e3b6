"""Tests of chapter 2's gradient synchronisation (solutions/02_data_parallelism_exercises.ipynb):
the exercises that train on clusters. The batch-size recipe and the bucket assignment
(``02.grad_acc_steps``, ``02.assign_buckets``) are tested in ``ch02.py``.

* ``02.overlapped_dp_hooks``: post-accumulate-grad hooks that launch one async all-reduce
  per parameter during backward, and a ``finish()`` that waits and averages.
* ``02.bucket_manager``: flat bucket buffers, one all-reduce per full bucket.

They train the course GPT for a few SGD steps on clusters of 2 and 3
ranks and compare the weights with single-process training on the concatenated batch
(``grading_cluster`` keeps those clusters between checks), then with the 3 ranks cut into the groups
[0] and [1, 2] (``_groups.Split``), each training on data of its own and given its group: an
all-reduce over the default group, or a division by the world's size, shows there. With the parity harness
(``ultrascale.parity``): the same seeded batches, the same training loop, the same loss.
``CommLogger`` counts the all-reduce calls, and when they were made, so that a version
that averages correctly but never overlaps (everything launched in ``finish()``) is told so;
a watch on ``dist.all_reduce`` also tells one whose hooks block backward: a synchronous
all-reduce, or an ``async_op=True`` one whose handle is waited for in the hook.

Tolerances: ``ultrascale.parity.TOLERANCES`` (fp32, SGD), where the reason is written.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist

from ultrascale.data import Batches
from ultrascale_grading.exercise_tests._groups import Split
from ultrascale_grading.exercise_tests.ch02 import CFG
from ultrascale_grading import exercise
from ultrascale_grading.guards import forbid_library
from ultrascale.model import GPT
from ultrascale.parallel import build_buckets
from ultrascale.parallel.data_parallel import Bucket, DataParallel, average_gradients
from ultrascale.parallel.grad_sync import reduce_gradient, sync_in_backward
from ultrascale.parity import max_difference, tolerance
from ultrascale.train import make_optimizer, train

DATA = Batches(CFG, mbs=2, seed=0)  # the same tokens on every rank and in the reference
SIZES = (2, 3)
# Then the ranks cut into groups that train side by side, each on its own data: a learner's class
# given group= must average over the group [1, 2] only (and rank 0 over itself alone).
SPLIT = Split([0], [1, 2])
# The library's own data parallelism is the answer to these exercises, not a way to one: every
# wrapper (naive, overlapped, bucketed) talks through DataParallel._all_reduce, and Bucket is the
# flat buffer with each gradient's slot. (Their __init__ methods call super(): a closure, which
# forbid_library cannot swap; the methods below are what any use of them reaches.)
LIBRARY_DP = (
    DataParallel._all_reduce,
    Bucket.__init__,
    Bucket.view_of,
    average_gradients,
    reduce_gradient,
    sync_in_backward,
)
LIBRARY_DP_HINT = (
    "register the hooks, keep the buffers and launch the all-reduces in your own class "
    "(ultrascale.parallel's OverlappedDataParallel, BucketedDataParallel and Bucket are "
    "this exercise's answer)"
)


# ---- shared by the distributed exercises ----------------------------------------------


def _fresh_model():
    torch.manual_seed(0)  # the same initial weights everywhere: these exercises do not broadcast
    return GPT(CFG)


def _all_reduce_calls(log) -> int:
    return log.collective_elements().get("all_reduce", 0)


class _WatchedWork:
    """An async all-reduce's handle, as the learner sees it: notes in which phase it was waited for."""

    def __init__(self, work, record, watch):
        self._work, self._record, self._watch = work, record, watch

    def wait(self, *args, **kwargs):
        if self._record["waited"] is None:
            self._record["waited"] = self._watch.phase
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class _AllReduceWatch:
    """While installed, ``dist.all_reduce`` notes for each call whether it was asynchronous
    (``async_op=True``) and in which phase its handle was waited for: "backward" (the
    training loop, hooks included) or "finish" (the learner's ``finish()``).

    A synchronous all-reduce, or an async one waited for at once in the hook, blocks
    backward until the communication is done: it is counted, but nothing overlaps.
    Installed inside the ``CommLogger`` (it wraps the logger's wrapper) and removed
    before the logger closes.
    """

    def __init__(self):
        self.phase = "backward"
        self.calls = []  # {"async": bool, "launched": phase, "waited": phase or None}

    @contextlib.contextmanager
    def installed(self):
        original = dist.all_reduce
        signature = inspect.signature(original)

        def watched(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            record = {"async": bool(bound.get("async_op", False)), "launched": self.phase, "waited": None}
            self.calls.append(record)
            work = original(*args, **kwargs)
            return _WatchedWork(work, record, self) if record["async"] and work is not None else work

        dist.all_reduce = watched
        try:
            yield self
        finally:
            dist.all_reduce = original

    def blocking_in_backward(self) -> dict:
        """How many all-reduces blocked backward: synchronous ones, and async ones waited for at once."""
        during = [c for c in self.calls if c["launched"] == "backward"]
        return {
            "synchronous": sum(not c["async"] for c in during),
            "waited_in_backward": sum(c["async"] and c["waited"] == "backward" for c in during),
        }


def _data_of(index: int) -> Batches:
    """The data a group of a split trains on: group ``index``'s own, so that mixing groups shows."""
    return DATA if index == 0 else Batches(CFG, mbs=2, seed=index)


def _train_on_rank(ctx, make_sync, steps, register_hooks, exercise_id, split=None):
    """Train on this rank's rows; count all-reduces launched during backward and in total,
    and those that blocked backward (synchronous, or waited for in the hook).

    ``make_sync(model, group)`` builds the learner's object (group None: the world; with a
    ``split``, this rank's group, which trains on its own data); with ``register_hooks`` the
    harness connects every parameter's post-accumulate-grad hook to ``sync.grad_ready``. The
    library's data-parallel wrappers are refused while the learner's code runs (LIBRARY_DP).
    """
    stream, group = DATA.rank_stream(ctx.rank, ctx.world_size), None
    if split is not None:
        index, group, ranks = split.group_of(ctx)
        stream = _data_of(index).rank_stream(ranks.index(ctx.rank), len(ranks))
    with forbid_library(LIBRARY_DP, exercise_id, LIBRARY_DP_HINT):
        return _train_watched(stream, lambda model: make_sync(model, group), steps, register_hooks, ctx.device)


def _train_watched(stream, make_sync, steps, register_hooks, device=None):
    from ultrascale.comm import CommLogger

    model = _fresh_model().to(device)  # seeded on the host, then on the rank's device
    sync = make_sync(model)
    if register_hooks:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(sync.grad_ready)
    marks = [0]  # all-reduce calls so far: after each backward, then after each finish()
    watch = _AllReduceWatch()

    def finish():
        marks.append(_all_reduce_calls(log))
        watch.phase = "finish"
        try:
            sync.finish()
        finally:
            watch.phase = "backward"
        marks.append(_all_reduce_calls(log))

    with CommLogger() as log, watch.installed():
        params = train(model, stream, steps, "sgd", after_backward=finish, device=device)
    names = {p: n for n, p in model.named_parameters()}
    buckets = getattr(sync, "buckets", None)
    if buckets is not None:
        buckets = [[names.get(p, "<not a parameter of the model>") for p in b] for b in buckets]
    return {
        "params": params,
        "during": [b - a for a, b in zip(marks[0::2], marks[1::2])],
        "total": [b - a for a, b in zip(marks[0::2], marks[2::2])],
        "buckets": buckets,
        **watch.blocking_in_backward(),
    }


def _check_overlap(res, where, what) -> None:
    """The all-reduces launched during backward must not block it."""
    if res["synchronous"]:
        raise AssertionError(
            f"{where}: {res['synchronous']} {what} all-reduces launched during backward were synchronous "
            "(no async_op=True): each one "
            "blocks backward until it is done, so nothing overlaps. Launch it with "
            "dist.all_reduce(..., async_op=True), keep the handle it returns, and wait for it in finish()"
        )
    if res["waited_in_backward"]:
        raise AssertionError(
            f"{where}: {res['waited_in_backward']} {what} all-reduces were launched with async_op=True, but "
            "their handles were waited for during backward (wait() in the hook): that blocks backward just as "
            "a synchronous all-reduce does. Keep the handles and wait for them in finish()"
        )


def _single_process(batches, steps, lr_scale=1):
    """Single-process SGD on ``batches``, with the learning rate times ``lr_scale``."""
    model = _fresh_model()
    opt = make_optimizer(model.parameters(), "sgd")
    opt.param_groups[0]["lr"] *= lr_scale
    return train(model, batches, steps, opt)


def _differing(got, expected) -> list:
    """The parameters whose weights are not within parity's fp32 SGD tolerance."""
    tol = tolerance("sgd")
    return [name for name, want in expected.items() if not torch.allclose(got[name], want, **tol)]


def _compare_weights(results, size, steps, what, data=DATA, where=None, world=None):
    """Each rank's weights against single-process training on the batches of the ``size`` ranks
    of ``data``; ``where`` names them (default: the world of ``size`` ranks). With ``world``
    (its size), ``results`` are those of a group of a split: mistakes of the group are named."""
    where = where or (lambda r: f"world_size={size}, rank {r}")
    reference = _single_process(data.global_stream(size), steps)
    for r, res in enumerate(results):
        got = res["params"]
        wrong = _differing(got, reference)
        if not wrong:
            continue
        if size > 1 and not _differing(got, _single_process(data.rank_stream(r, size), steps)):
            raise AssertionError(
                f"{where(r)}: the weights are what this rank alone would "
                "learn from its own rows: the gradients were never averaged across ranks"
            )
        if world and not _differing(got, _single_process(data.global_stream(size), steps, lr_scale=size / world)):
            raise AssertionError(
                f"{where(r)}: the gradients were averaged over the group but divided by the "
                f"world's size ({world}), not the group's ({size}): the mean is over the group"
            )
        if size > 1 and not _differing(got, _single_process(data.global_stream(size), steps, lr_scale=size)):
            raise AssertionError(
                f"{where(r)}: the gradients were summed over the ranks but not divided by the world size ({size})"
            )
        if world:
            raise AssertionError(
                f"{where(r)}: the weights differ from data-parallel training over this group "
                "alone, though they were right when the group was the whole world: gradients of "
                "ranks outside the group got in. Every collective must be told the group, and the "
                "mean is over the group's ranks"
            )
        err = max_difference(got[wrong[0]], reference[wrong[0]])
        raise AssertionError(
            f"{where(r)}, parameter {wrong[0]}: after {steps} SGD steps the "
            f"weights differ from single-process training on the concatenated batch by up "
            f"to {err:.3g} ({what})"
        )


def _layouts():
    """(cluster size, split or None): the whole world of each size, then the split."""
    return [(size, None) for size in SIZES] + [(SPLIT.world_size, SPLIT)]


def _run_layout(size, split, make_sync, steps, register_hooks, exercise_id, timeout):
    from ultrascale.runtime import grading_cluster

    if split is None:
        return grading_cluster(size).run(_train_on_rank, make_sync, steps, register_hooks, exercise_id, timeout=timeout)
    return split.run(
        _train_on_rank, make_sync, steps, register_hooks, exercise_id, split, what=exercise_id, timeout=timeout
    )


def _where(size, split, extra=""):
    return f"world_size={size}{extra}" if split is None else f"on {split}{extra} (each group given as group=)"


def _compare_layout(results, size, split, steps, what, extra=""):
    """The weights of every rank against its world's or, for a split, its group's training."""
    if split is None:
        return _compare_weights(results, size, steps, what)
    for i in split.order():
        ranks = split.groups[i]
        _compare_weights(
            [results[r] for r in ranks],
            len(ranks),
            steps,
            what,
            data=_data_of(i),
            world=size,
            where=lambda r, ranks=ranks: (
                f"{_where(size, split, extra)}, rank {ranks[r]} of the group {list(ranks)} (rank {r} within it)"
            ),
        )


# ---- 02.overlapped_dp_hooks ----------------------------------------------------------


def _overlapped(cls):
    def make(model, group):
        return cls(model) if group is None else cls(model, group=group)

    return make


@exercise("02.overlapped_dp_hooks", points=2)
def test_overlapped_dp_hooks(OverlappedGradSync, quick: bool = True, timeout: float = 120):
    steps = 2 if quick else 4
    n_tensors = len(list(_fresh_model().parameters()))
    for size, split in _layouts():
        results = _run_layout(
            size, split, _overlapped(OverlappedGradSync), steps, False, "02.overlapped_dp_hooks", timeout
        )
        where = _where(size, split)
        for res in results:
            assert res["total"] == [n_tensors] * steps, (
                f"{where}: expected one all-reduce per parameter tensor ({n_tensors}) in each step, got "
                f"{res['total']} (call dist.all_reduce once per gradient; the course's CommLogger counts "
                "calls made as dist.all_reduce(...))"
            )
            assert res["during"] == [n_tensors] * steps, (
                f"{where}: only {res['during']} of the {n_tensors} all-reduces per step were launched while "
                "backward was running; launch each one from the parameter's hook (async_op=True) so it "
                "overlaps with the rest of backward, and only wait in finish()"
            )
            _check_overlap(res, where, "gradient")
        _compare_layout(
            results, size, split, steps, "check the division by the world size and that finish() waits for every handle"
        )


# ---- 02.bucket_manager ---------------------------------------------------------------


def _bucketed(cls, cap_bytes):
    def make(model, group):
        params = list(model.parameters())
        return cls(params, cap_bytes) if group is None else cls(params, cap_bytes, group=group)

    return make


@exercise("02.bucket_manager", points=2)
def test_bucket_manager(BucketManager, quick: bool = True, timeout: float = 120):
    steps = 2 if quick else 4
    named = list(GPT(CFG).named_parameters())
    params = [p for _, p in named]
    name_of = {id(p): n for n, p in named}
    caps = [int(0.02 * 2**20), 1, 10**9] if quick else [int(0.02 * 2**20), int(0.005 * 2**20), 1, 10**9]
    for size, split in _layouts():
        for cap in caps if split is None else caps[:1]:  # the split: a cap that makes several buckets
            expected = [[name_of[id(p)] for p in b] for b in build_buckets(list(reversed(params)), cap)]
            results = _run_layout(size, split, _bucketed(BucketManager, cap), steps, True, "02.bucket_manager", timeout)
            where = _where(size, split, f", bucket_cap_bytes={cap}")
            for res in results:
                assert res["buckets"] is not None, f"{where}: keep the buckets (lists of parameters) in self.buckets"
                assert res["buckets"] == expected, (
                    f"{where}: self.buckets should group the parameters as assign_buckets does: expected "
                    f"{len(expected)} buckets {expected}, got {len(res['buckets'])}: {res['buckets']}"
                )
                n = len(expected)
                if res["total"][0] == n and res["total"] != [n] * steps:
                    raise AssertionError(
                        f"{where}: the first step made one all-reduce per bucket ({n}) but later steps made "
                        f"{res['total'][1:]}: reset each bucket (its ready parameters and its handle) in "
                        "finish(), ready for the next step"
                    )
                assert res["total"] == [n] * steps, (
                    f"{where}: expected one all-reduce per bucket ({n}) in each step, got {res['total']} "
                    "(call dist.all_reduce once per bucket, on its flat buffer)"
                )
                assert res["during"] == [n] * steps, (
                    f"{where}: {res['during']} of the {n} bucket all-reduces per step were launched during "
                    "backward; launch a bucket (async_op=True) as soon as its last gradient is ready"
                )
                _check_overlap(res, where, "bucket")
            _compare_layout(
                results,
                size,
                split,
                steps,
                "check that each gradient is copied into its bucket, the "
                "average is copied back into .grad, and the buckets are "
                "reset for the next step",
                f", bucket_cap_bytes={cap}",
            )
