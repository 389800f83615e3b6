"""ZeRO in a 5D composition: with pipeline stages, with experts, and ZeRO-3.

``apply_parallelisms`` (``compose.py``) ends with data parallelism; with ``zero`` > 0 it is
this module's :func:`apply_zero_composed`. Three things make ZeRO harder to compose than a
plain all-reduce, and each has its answer here:

* **Experts average over another group.** A dense parameter's gradient is averaged over the
  ranks with other data, ``DATA_AXES["dense"]`` (dp, ep, cp); an expert lives on one ep rank,
  so its replicas are ``DATA_AXES["expert"]`` (dp, cp), and its gradient, which already holds
  every ep rank's tokens, is summed over them and divided by *all* the data ranks (as
  ``expert_parallel.average_in_backward`` does for zero=0). One flat buffer cannot be
  reduce-scattered over two groups, so there are two ZeRO objects: the dense parameters over
  the dense group, the experts over their replicas with ``divide_by`` the dense group's size.
  :class:`ComposedZeRO` steps both as one optimizer.
* **The pipeline's tied embedding.** GPT's embedding and head share a weight that lives on
  the first and the last stage, each holding a part of its gradient. Without ZeRO the pipeline
  adds the two parts in ``.grad`` after its step; ZeRO has moved them into its flat buffers
  by then (and ZeRO-2 has already reduce-scattered them), so the composition builds the
  pipeline with ``add_tied_after_step=False``. Instead the tied weight is made a ZeRO
  unit *of its own* on both ends: the same size, the same padding, the same data group
  size, hence the same layout, and a rank's slice of it on the first stage is the slice of
  the same elements on the last (the two ranks have the same data coordinates). Reducing is
  linear, so adding the two ends' *reduced slices* equals reducing the summed gradient:
  :class:`ComposedZeRO` runs every ZeRO's ``reduce_gradients()``, adds the tied slices
  (``Pipeline.add_tied``: shard-sized messages, 1/N_d of what the plain pipeline sends),
  then ``update()``. Both ends then step the same slice with the same gradient.
* **ZeRO-3 gathers each unit's weights in its forward hooks**, and again for its backward:
  for DP, TP and CP alike (TP's shards are just smaller parameters to it), and on pipeline
  stages too. A stage never calls the model's forward, whose hooks gather the root unit, so
  there the embedding, the final norm and the head are units of their own and there is no
  root. A stage runs the forwards of several micro-batches before their backwards; each one
  gathers the unit again (and each backward reduce-scatters): right, but many gathers per
  step, which is why the book calls PP with ZeRO-3 rare.

Not composed yet (``ParallelConfig`` and :func:`apply_zero_composed` say so): ZeRO with the
schedules that split the backward (zb-h1, dualpipe-v: their W fills ``.grad`` with
``autograd.grad``, past the hooks that move gradients into the flat buffers), and a pipeline
that puts both ends of the tied weight on one rank.
"""

from __future__ import annotations

import contextlib

from ..train import OPTIMIZERS
from .grad_sync import DATA_AXES
from .zero import ZeRO

__all__ = ["ComposedZeRO", "apply_zero_composed"]


class ComposedZeRO:
    """The optimizer of a ZeRO composition: one ZeRO per data group (dense, experts), and the
    pipeline's tied weight added between their reduce and their update."""

    def __init__(self, zeros: list, pipeline=None, tied_unit=None):
        self.zeros, self.pipeline, self.tied_unit = zeros, pipeline, tied_unit

    def step(self) -> None:
        for zero in self.zeros:
            zero.reduce_gradients()
        if self.tied_unit is not None:  # the two ends' reduced slices of the tied weight, added
            shard = self.tied_unit.grad_shard
            shard.copy_(self.pipeline.add_tied(shard))
        for zero in self.zeros:
            zero.update()

    def zero_grad(self) -> None:
        for zero in self.zeros:
            zero.zero_grad()

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole while inside (ZeRO-3 keeps only shards between steps)."""
        with contextlib.ExitStack() as stack:
            for zero in self.zeros:
                stack.enter_context(zero.gathered())
            yield


def _units(model, pipeline) -> list:
    """ZeRO's units (gathered and freed as one at ZeRO-3): every transformer block this rank
    holds; on a pipeline stage also its embedding, final norm and head, each a unit of its own.
    (Without a pipeline those form the root unit, gathered by the model's forward hooks; a
    stage never calls the model's forward, so it leaves no root.) The tied embedding or head
    comes first, where apply_zero_composed looks for it."""
    if pipeline is None:
        return list(model.blocks)
    ends, blocks = [], []
    for chunk in pipeline.chunks.values():
        blocks += list(chunk.blocks)
        ends += [m for m in (chunk.embed, chunk.norm, chunk.head) if m is not None]
    tied = [m for m in ends if pipeline.tied and m.weight is pipeline.tied_weight()]
    if len(tied) > 1:  # both ends on one rank: two units would share the weight
        raise ValueError(
            "this course's library does not compose ZeRO with a schedule that puts the first and "
            "the last stage on one rank yet (the tied weight would be two units)"
        )
    return tied + blocks + [m for m in ends if m not in tied]


def apply_zero_composed(model, mesh, *, stage: int, optimizer: str = "sgd", pipeline=None) -> ComposedZeRO:
    """ZeRO stage ``stage`` over the data groups of ``mesh``, on ``model`` (after TP, CP and
    EP), or on its stages when ``pipeline`` (built with ``add_tied_after_step=False``: the tied
    weight's two parts are added here, between reduce and update). ``optimizer``: a course name
    (``train.OPTIMIZERS``). Returns the optimizer to step."""
    tied = pipeline is not None and pipeline.tied_peer is not None
    if tied and pipeline.add_tied_after_step:
        raise ValueError(
            "under ZeRO the tied weight's gradient lives in ZeRO's flat buffers, not in .grad: "
            "build the pipeline with apply_pp(..., add_tied_after_step=False), and ZeRO adds "
            "the two parts"
        )
    cls, options = OPTIMIZERS[optimizer]  # the same optimizer as make_optimizer's
    module = pipeline if pipeline is not None else model
    experts = set()
    if mesh.size("ep") > 1:
        from .expert_parallel import expert_parameters

        experts = set(expert_parameters(model))
    units = _units(model, pipeline)
    # Every rank built the model from one seed (as apply_pp assumes): nothing to broadcast. A
    # broadcast over the dense group would also overwrite the other ep ranks' experts.
    common = dict(stage=stage, optimizer_cls=cls, units=units, broadcast=False, **options)
    dense_group = mesh.group(DATA_AXES["dense"])
    zeros = [ZeRO(module, group=dense_group, params=[p for p in module.parameters() if p not in experts], **common)]
    if experts:  # built after the dense one: the expert parameters are still the original tensors
        zeros.append(
            ZeRO(
                module,
                group=mesh.group(DATA_AXES["expert"]),
                params=list(experts),
                divide_by=mesh.size(DATA_AXES["dense"]),
                **common,
            )
        )
    tied_unit = next(u for u in zeros[0].units if u.module is units[0]) if tied else None
    return ComposedZeRO(zeros, pipeline, tied_unit)
