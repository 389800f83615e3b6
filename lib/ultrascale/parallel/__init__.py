"""Parallelism applied from outside to the course model (which knows nothing about it).

* ``data_parallel``: ``NaiveDataParallel``, ``OverlappedDataParallel``,
  ``BucketedDataParallel`` and ``no_sync`` gradient accumulation (NB02).
* ``zero``: ``ZeRO`` stages 1, 2 and 3 on flat, padded parameter shards (NB03).
* ``timeline``: per-rank compute and communication events, for Gantt charts.
"""

from .data_parallel import (BucketedDataParallel, DataParallel, NaiveDataParallel,
                            OverlappedDataParallel, average_gradients, broadcast_parameters,
                            build_buckets)
from .timeline import COMMUNICATION, COMPUTE, Event, Timeline, covered_seconds, overlap_seconds
from .zero import ZeRO, FlatUnit, all_gather_into, reduce_scatter_into

__all__ = [
    "BucketedDataParallel", "COMMUNICATION", "COMPUTE", "DataParallel", "Event", "FlatUnit",
    "NaiveDataParallel", "OverlappedDataParallel", "Timeline", "ZeRO", "all_gather_into",
    "average_gradients", "broadcast_parameters", "build_buckets", "covered_seconds",
    "overlap_seconds", "reduce_scatter_into",
]
