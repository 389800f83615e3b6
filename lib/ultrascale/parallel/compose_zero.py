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
  by then (and ZeRO-2 has already reduce-scattered them). So the tied weight is made a ZeRO
  unit *of its own* on both ends: the same size, the same padding, the same data group
  size, hence the same layout, and a rank's slice of it on the first stage is the slice of
  the same elements on the last (the two ranks have the same data coordinates). Reducing is
  linear, so adding the two ends' *reduced slices* equals reducing the summed gradient:
  :class:`ComposedZeRO` runs every ZeRO's ``reduce_gradients()``, adds the tied slices
  (``Pipeline.add_tied``: shard-sized messages, 1/N_d of what the plain pipeline sends),
  then ``update()``. Both ends then step the same slice with the same gradient.
* **ZeRO-3 gathers each unit's weights in its forward hooks**, for DP, TP and CP alike
  (TP's shards are just smaller parameters to it). With a pipeline it is refused: see
  :data:`ZERO3_WITH_PP`.
"""
from __future__ import annotations

import contextlib

from ..train import OPTIMIZERS
from .grad_sync import DATA_AXES
from .zero import ZeRO

__all__ = ["ComposedZeRO", "apply_zero_composed", "ZERO3_WITH_PP"]

ZERO3_WITH_PP = (
    "this course's library does not compose ZeRO-3 with pp > 1 yet: ZeRO-3's hooks gather a unit's "
    "weights for one forward and one backward in turn, while a pipeline stage runs the forwards of "
    "several micro-batches before their backwards (and a model's root unit, the embedding or the "
    "head, is gathered by the model's forward, which a stage never calls); the book calls PP with "
    "ZeRO-3 rare for that reason too (the weights gathered again every micro-batch). "
    "Use zero=1 or 2 with pp")


class ComposedZeRO:
    """The optimizer of a ZeRO composition: one ZeRO per data group (dense, experts), and the
    pipeline's tied weight added between their reduce and their update."""

    def __init__(self, zeros: list, pipeline=None, tied_unit=None):
        self.zeros, self.pipeline, self.tied_unit = zeros, pipeline, tied_unit

    def step(self) -> None:
        for zero in self.zeros:
            zero.reduce_gradients()
        if self.tied_unit is not None:   # the two ends' reduced slices of the tied weight, added
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


def _blocks(par) -> list:
    """Every transformer block this rank holds: ZeRO's units (gathered and freed as one at stage 3)."""
    if par.pipeline is None:
        return list(par.model.blocks)
    return [block for chunk in par.pipeline.chunks.values() for block in chunk.blocks]


def _tied_module(pipeline):
    """The module holding this rank's end of the tied weight, when another rank holds the other."""
    if pipeline is None or pipeline.tied_peer is None:
        return None
    return pipeline.chunks["0"].embed if "0" in pipeline.chunks else pipeline.chunks[str(pipeline.last)].head


def apply_zero_composed(par) -> ComposedZeRO:
    """ZeRO (``par.config.zero``) over the data groups of ``par.mesh``, on what ``par`` holds.
    Returns the optimizer to step (also ``par.optimizer``)."""
    config, mesh, module = par.config, par.mesh, par.module
    if config.zero == 3 and par.pipeline is not None:
        raise ValueError(ZERO3_WITH_PP)
    cls, options = OPTIMIZERS[config.optimizer]   # the same optimizer as make_optimizer's
    experts = set()
    if config.ep > 1:
        from .expert_parallel import expert_parameters
        experts = set(expert_parameters(par.model))
    tied = _tied_module(par.pipeline)
    units = ([tied] if tied is not None else []) + _blocks(par)
    # Every rank built the model from one seed (as apply_pp assumes): nothing to broadcast. A
    # broadcast over the dense group would also overwrite the other ep ranks' experts.
    common = dict(stage=config.zero, optimizer_cls=cls, units=units, broadcast=False, **options)
    dense_group = mesh.group(DATA_AXES["dense"])
    zeros = [ZeRO(module, group=dense_group, params=[p for p in module.parameters() if p not in experts],
                  **common)]
    if experts:   # built after the dense one: the expert parameters are still the original tensors
        zeros.append(ZeRO(module, group=mesh.group(DATA_AXES["expert"]), params=list(experts),
                          divide_by=mesh.size(DATA_AXES["dense"]), **common))
    if par.pipeline is not None:
        par.pipeline.add_tied_after_step = tied is None
    tied_unit = None if tied is None else next(u for u in zeros[0].units if u.module is tied)
    par.optimizer = ComposedZeRO(zeros, par.pipeline, tied_unit)
    return par.optimizer
