"""Data parallelism, applied from outside to any ``nn.Module``.

Every rank holds a full copy of the model and runs its own micro-batch. After
backward the gradients are averaged across ranks with an all-reduce, so every
replica applies the same update and the copies stay identical. This is gradient
accumulation done in parallel: the average of the per-rank mean losses is the mean
loss of the concatenated batch.

Three versions, each fixing a weakness of the one before:

* ``NaiveDataParallel``: wait for the whole backward, then all-reduce gradient
  after gradient. The ranks sit idle while the network works.
* ``OverlappedDataParallel``: start each gradient's all-reduce (async) the moment
  autograd has finished accumulating it, while backward continues with earlier
  layers; wait for all of them only before ``optimizer.step()``.
* ``BucketedDataParallel``: many small all-reduces each pay a fixed latency, so
  gradients live in a few large flat buffers ("buckets", each closed once it reaches the
  cap, as DDP's are; each ``.grad`` becomes a view of its slot after its first copy in,
  like DDP's ``gradient_as_bucket_view``) and one all-reduce is launched per full bucket.

All three share ``no_sync()`` for gradient accumulation: inside it gradients just
accumulate locally, and only the last micro-batch's backward communicates.

The training loop is the same for all three::

    dp = apply_data_parallel(model, mesh_or_group, kind="bucketed", bucket_cap_mb=25)
    loss = loss_fn(dp(x), y)
    loss.backward()
    dp.finish_gradient_synchronization()   # PyTorch DDP does this inside backward
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.functional import broadcast_parameters
from .grad_sync import average_gradients  # noqa: F401  naive DP without a wrapper, shared with EP
from .mesh import axis_group
from .timeline import COMMUNICATION, Timeline, or_disabled


class DataParallel(nn.Module):
    """What the three versions share: the wrapped module, ``no_sync`` and a sync counter.

    Collectives are counted by ``ultrascale.comm.CommLogger`` (the one way the course
    counts communication), not by the wrapper.
    """

    def __init__(self, module: nn.Module, group=None, timeline: Timeline | None = None, broadcast: bool = True):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "data parallelism needs a process group: run this inside cluster.run(...) or under torchrun"
            )
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        # Multiplying by the reciprocal, as DDP does, costs half what dividing every element
        # costs on a CPU (1 MiB: about 50 us against 130 us here); with a power-of-two world
        # size the two are bit for bit the same, otherwise one unit in the last place at most apart.
        self.scale = 1.0 / self.world_size
        self.timeline = or_disabled(timeline)
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.num_syncs = 0  # gradient synchronisations (one per step)
        self.names = {p: n for n, p in module.named_parameters()}
        self.ready_order: list[str] = []  # parameter names, in the order their hooks fired
        self._ready_order_sync = 0  # the sync that order belongs to (the latest)
        if broadcast:
            broadcast_parameters(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def trainable_parameters(self) -> list:
        return [p for p in self.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient synchronisation for the backward passes run inside this block.

        Use it for the first grad_acc - 1 micro-batches of a step: their gradients
        accumulate in ``.grad`` and are reduced once, with the last micro-batch.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _note_ready(self, name: str) -> None:
        """Record that parameter ``name``'s gradient is final. ``ready_order`` holds the latest
        synchronised backward's order only, so it stays one name per parameter however long
        the run."""
        if self._ready_order_sync != self.num_syncs:
            self.ready_order, self._ready_order_sync = [], self.num_syncs
        self.ready_order.append(name)
        if self.timeline.enabled:  # this runs for every parameter in every backward: keep it lean
            self.timeline.mark(f"grad ready {name}")

    def _all_reduce(self, tensor: torch.Tensor, name: str, async_op: bool, scaled: bool = False):
        """Sum ``tensor`` over the ranks, scaled first by 1/world size (unless the caller has
        done it: ``scaled``), so that the sum is the mean."""
        if not scaled:
            tensor.mul_(self.scale)
        nbytes = tensor.numel() * tensor.element_size()
        if not async_op:
            with self.timeline.span(name, COMMUNICATION, nbytes):
                dist.all_reduce(tensor, group=self.group)
            return None
        start = self.timeline.now()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return self.timeline.communication(name, work, nbytes, start)

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError


class NaiveDataParallel(DataParallel):
    """All-reduce every gradient after backward has finished: simple, and idle while it talks."""

    def finish_gradient_synchronization(self) -> None:
        if not self.require_backward_grad_sync:
            return
        for p in self.trainable_parameters():
            if p.grad is None:  # an unused parameter: the others may have a gradient for it
                p.grad = torch.zeros_like(p)
            self._all_reduce(p.grad, f"all_reduce {self.names[p]}", async_op=False)
        self.num_syncs += 1


class OverlappedDataParallel(DataParallel):
    """Launch each gradient's all-reduce from a hook, as soon as the gradient is ready.

    ``register_post_accumulate_grad_hook`` fires after autograd has added this
    backward's contribution into ``p.grad`` (after both uses of a tied weight), so
    the gradient is final and its all-reduce can run while backward moves on to
    earlier layers. The hooks fire in roughly reverse layer order.
    """

    def __init__(self, module, group=None, timeline=None, broadcast=True):
        super().__init__(module, group, timeline, broadcast)
        self.handles: list = []
        self.reduced: set = set()  # parameters whose all-reduce is in flight
        self.register_backward_hook(self._on_grad_ready)

    def register_backward_hook(self, hook) -> None:
        """Call ``hook(p)`` whenever a parameter's gradient has been accumulated."""
        for p in self.trainable_parameters():
            p.register_post_accumulate_grad_hook(hook)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.require_backward_grad_sync:
            return  # accumulating: keep the gradient local
        name = self.names[p]
        self._note_ready(name)
        self.reduced.add(p)
        self.handles.append(self._all_reduce(p.grad, f"all_reduce {name}", async_op=True))

    def finish_gradient_synchronization(self) -> None:
        if not self.handles:
            return
        # Parameters that got no gradient in this backward never fired their hook; the
        # collectives must match on every rank, so reduce zeros for them.
        for p in self.trainable_parameters():
            if p not in self.reduced:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                self.handles.append(self._all_reduce(p.grad, f"all_reduce {self.names[p]}", True))
        for work in self.handles:
            work.wait()
        self.handles.clear()
        self.reduced.clear()
        self.num_syncs += 1


class Bucket:
    """A flat buffer holding the gradients of a few parameters, reduced in one call."""

    def __init__(self, index: int, params: list, dtype, device, scale: float = 1.0):
        self.index, self.params = index, params
        self.offsets, total = {}, 0
        for p in params:
            self.offsets[p] = (total, total + p.numel())
            total += p.numel()
        self.buffer = torch.zeros(total, dtype=dtype, device=device)
        # each parameter's slot, viewed in its shape once: the hooks run for every parameter
        # in every backward, and slicing a fresh view each time is a measurable part of them
        self.views = {p: self.buffer[start:end].view_as(p) for p, (start, end) in self.offsets.items()}
        self.ready: set = set()  # names of the parameters whose gradient is in
        self.work = None
        # 1/N as a 0-dim tensor, made once: a Python float is wrapped into a fresh tensor on every
        # multiply (about 2.5 of a small hook's 6.5 us here). A float32 factor gives the very bits
        # the float gives to fp32, bf16 and fp16 gradients; fp64 ones need a float64 factor.
        self.scale = torch.tensor(scale, dtype=torch.float64 if dtype == torch.float64 else torch.float32)

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)

    def view_of(self, p: torch.Tensor) -> torch.Tensor:
        return self.views[p]

    def reset(self) -> None:
        self.ready.clear()
        self.work = None


def build_buckets(params: list, bucket_cap_bytes: int) -> list[list]:
    """Group parameters, in the given order, into buckets that close once they hold ``bucket_cap_bytes``.

    PyTorch DDP's rule: keep adding parameters to the current bucket and close it as soon as it
    reaches the cap, so a bucket may pass the cap by its last parameter (and a parameter larger
    than the cap fills a bucket by itself). Closing *before* the cap would be passed instead makes
    more, smaller buckets, and every extra all-reduce pays the latency again: on the bench model
    that is 5 buckets to DDP's 4 and a step a few percent slower than DDP's.
    Parameters of different dtypes never share a bucket (one flat buffer has one dtype).
    """
    buckets, current, size = [], [], 0
    for p in params:
        if current and p.dtype != current[0].dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketedDataParallel(DataParallel):
    """Overlap plus bucketing: one async all-reduce per full bucket of gradients.

    Buckets are filled in reverse registration order, which approximates the
    order in which backward produces gradients (last layer first). Every rank must
    issue its collectives in the same order, so buckets are launched strictly by
    index: a full bucket waits until all buckets before it have been launched.
    """

    def __init__(self, module, bucket_cap_mb: float = 25.0, group=None, timeline=None, broadcast=True):
        super().__init__(module, group, timeline, broadcast)
        params = list(reversed(self.trainable_parameters()))
        cap = int(bucket_cap_mb * 1024 * 1024)  # DDP's bucket_cap_mb counts MiB
        self.buckets = [
            Bucket(i, ps, ps[0].dtype, ps[0].device, self.scale) for i, ps in enumerate(build_buckets(params, cap))
        ]
        self.next_to_launch = 0
        for bucket in self.buckets:
            for p in bucket.params:
                # Each hook gets its parameter's name, bucket and slot bound once. The hooks run
                # for every parameter in every backward; looking these up by tensor costs a
                # Python-level hash per lookup, and binding them took a hook's bookkeeping from
                # ~14 us to ~8 here.
                hook = functools.partial(self._on_grad_ready, self.names[p], bucket, bucket.view_of(p))
                p.register_post_accumulate_grad_hook(hook)

    def _on_grad_ready(self, name: str, bucket: Bucket, view: torch.Tensor, p: torch.Tensor) -> None:
        if not self.require_backward_grad_sync:
            return
        self._note_ready(name)
        # Each gradient is scaled by 1/N here, so that the bucket's sum is the mean.
        if p.grad.data_ptr() != view.data_ptr():
            # A fresh gradient (the first step, or after zero_grad(set_to_none=True)): scale it
            # on its way into the bucket, one pass for both (as DDP's copy does), and make .grad
            # a view of its slot. Later backwards then add straight into the bucket, and the
            # averaged result needs no copy back (DDP's gradient_as_bucket_view).
            torch.mul(p.grad, bucket.scale, out=view)
            p.grad = view
        else:
            view.mul_(bucket.scale)  # accumulated in its slot already: scale it there
        bucket.ready.add(name)
        self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].full:
            self._launch(self.buckets[self.next_to_launch])

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = self._all_reduce(
            bucket.buffer, f"all_reduce bucket {bucket.index}", async_op=True, scaled=True
        )  # by the hooks, gradient by gradient
        self.next_to_launch += 1

    def finish_gradient_synchronization(self) -> None:
        if self.next_to_launch == 0 and not any(b.ready for b in self.buckets):
            return  # nothing happened since the last sync (e.g. all backward ran in no_sync)
        for bucket in self.buckets[self.next_to_launch :]:
            for p in bucket.params:  # no gradient this step: contribute zeros
                if self.names[p] not in bucket.ready:
                    p.grad = bucket.view_of(p).zero_()
                    bucket.ready.add(self.names[p])
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()  # every .grad is a view: averaged where it lies
            bucket.reset()
        self.next_to_launch = 0
        self.num_syncs += 1

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket, in launch order."""
        return [b.buffer.numel() * b.buffer.element_size() for b in self.buckets]


KINDS = {"naive": NaiveDataParallel, "overlapped": OverlappedDataParallel, "bucketed": BucketedDataParallel}


def apply_data_parallel(
    model: nn.Module,
    mesh_or_group=None,
    *,
    kind: str = "bucketed",
    plan=None,
    timeline: Timeline | None = None,
    **options,
) -> DataParallel:
    """Make ``model`` data-parallel over the ``dp`` axis of a mesh (or over a group).

    DP returns a module around the model instead of the model changed in place (as DDP
    does; only PP's ``Pipeline`` does the same, see CONTRIBUTING.md): the book teaches three
    versions of it (``kind``), and the wrapper is where each keeps its hooks and buffers. ``options`` go to the wrapper (``bucket_cap_mb``, ``broadcast``).
    DP needs no plan: every parameter is replicated, so ``plan`` must stay None.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: choose one of {sorted(KINDS)}")
    if plan is not None:
        raise ValueError("data parallelism replicates every parameter: it takes no plan")
    return KINDS[kind](model, group=axis_group(mesh_or_group, "dp"), timeline=timeline, **options)
