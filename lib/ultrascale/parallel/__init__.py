"""Parallelism applied from outside to the course model (which knows nothing about it).

One module per technique, each exposing ``apply_<technique>(model, mesh_or_group, ...)``
(see CONTRIBUTING.md):

* ``data_parallel``: ``NaiveDataParallel``, ``OverlappedDataParallel``,
  ``BucketedDataParallel`` and ``no_sync`` gradient accumulation (NB02);
  ``apply_data_parallel``.
* ``zero``: ``ZeRO`` stages 1, 2 and 3 on flat, padded parameter shards (NB03);
  ``apply_zero``. Stage 3's parameter sharding is ``zero3``'s ``ParameterSharding``, which
  registers itself with ``zero`` when imported below (``ZeRO(..., stage=3)`` builds it).
* ``fsdp``: per-parameter sharding as FSDP2 does it (NB03, beyond the book): each parameter's
  rows sharded, so any torch optimizer steps the shards; mixed precision, HSDP; ``apply_fsdp``.
  ``sharded_muon``: Muon on whole or row-sharded matrices (gathered, or dealt to owners).
* ``tensor_parallel``: ``apply_tp`` (NB04, NB05) and plain TP's column/row-parallel linears.
  Its refinements register their layers with it when this package imports them:
  ``vocab_parallel``, the embedding, head and cross-entropy split over the vocabulary;
  ``sequence_parallel``, SP's subclasses of the linears (g, g*); ``async_tp``, SP's
  all-gather and reduce-scatter cut into ring steps that overlap the pieces of the matmuls
  beside them (NB05, ``apply_tp(..., async_tp=True)``).
* ``context_parallel``: the sequence split across ranks, contiguous or zig-zag (NB06);
  ``apply_cp``. Its attention is ``ring_attention``: K/V blocks passed round a ring of ranks
  while each block is attended to, forward and backward. Two refinements register themselves
  with it when imported here: ``all_gather_kv`` (``kind="all_gather"``: the K/V all-gathered
  instead) and ``ulysses`` (``kind="ulysses"``): an all-to-all from sequence slices to head
  groups and back.
* ``pipeline_parallel``: the model cut into stages, run by ``ultrascale.schedule``'s action
  lists (NB07); ``apply_pp`` (trained by ``train.run_pipeline_steps``).
* ``expert_parallel``: the experts of every MoE layer split over ranks, tokens dispatched and
  combined by all-to-all (NB08); ``apply_ep``, ``expert_parameters``.
* ``compose``: the techniques applied together on one mesh (NB09); ``apply_parallelisms``.
* ``mesh``: ``Mesh`` / ``init_mesh``, the process mesh over named axes (dp, pp, ep, cp, tp).
* ``match_plan`` (from ``ultrascale.matching``, beside the techniques and the precisions that
  all use it): a plan's module-name patterns matched to a model's modules, one set of rules.
* ``grad_sync``: ``sync_in_backward`` and ``average_gradients``, gradients summed over a group
  and divided, during or after backward, for every technique but DP's overlapped wrappers.
* ``timeline``: per-rank compute and communication events, for Gantt charts.

Checking them (each against one process, or against PyTorch's own version) is
``ultrascale.parity``'s: nothing here imports it.
"""

# Every refinement is imported here, because importing it is what registers it with the basic
# form it refines (tensor_parallel.FORMS and VOCABULARY, ring_attention.KV_EXCHANGES,
# context_parallel.CORES, zero.REFINEMENTS): TP's three on the next line; all_gather_kv,
# ulysses and zero3 below. Python runs this file before any module of the package, so the
# tables are full before anyone can call apply_*.
from . import async_tp, sequence_parallel, vocab_parallel  # noqa: F401
from ..comm.functional import all_gather_into, broadcast_parameters, reduce_scatter_into
from ..matching import match_plan
from .all_gather_kv import all_gather_attention  # registers kind='all_gather' with ring attention
from .context_parallel import (
    apply_cp,
    causal_tile_counts,
    context_parallel_attention,
    ring_attention,
    split_sequence,
)
from .data_parallel import (
    BucketedDataParallel,
    DataParallel,
    NaiveDataParallel,
    OverlappedDataParallel,
    apply_data_parallel,
    build_buckets,
)
from .expert_parallel import apply_ep, expert_parameters
from .grad_sync import average_gradients, sync_in_backward
from .mesh import AXES, Mesh, init_mesh
from .pipeline_parallel import Pipeline, apply_pp, backward_input, backward_weight, split_layers, stage_modules
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, apply_tp
from .timeline import COMMUNICATION, COMPUTE, Event, Timeline, covered_seconds, overlap_seconds
from .ulysses import ulysses_attention  # registers kind='ulysses' with apply_cp
from .zero import FlatUnit, ZeRO, apply_zero
from .zero3 import ParameterSharding  # registers stage 3 with ZeRO: zero.py does not import it

__all__ = [
    "AXES",
    "BucketedDataParallel",
    "COMMUNICATION",
    "COMPUTE",
    "ColumnParallelLinear",
    "DataParallel",
    "Event",
    "FlatUnit",
    "RowParallelLinear",
    "apply_tp",
    "apply_ep",
    "expert_parameters",
    "all_gather_attention",
    "ulysses_attention",
    "apply_cp",
    "causal_tile_counts",
    "context_parallel_attention",
    "ring_attention",
    "split_sequence",
    "Mesh",
    "NaiveDataParallel",
    "OverlappedDataParallel",
    "ParameterSharding",
    "Timeline",
    "ZeRO",
    "all_gather_into",
    "apply_data_parallel",
    "apply_zero",
    "average_gradients",
    "broadcast_parameters",
    "build_buckets",
    "match_plan",
    "sync_in_backward",
    "covered_seconds",
    "Pipeline",
    "apply_pp",
    "backward_input",
    "backward_weight",
    "split_layers",
    "stage_modules",
    "init_mesh",
    "overlap_seconds",
    "reduce_scatter_into",
]
