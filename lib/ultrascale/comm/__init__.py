"""Communication: collectives built from send/recv, a logger, bandwidth and cost models.

* ``ring``: ``ring_reduce_scatter``, ``ring_all_gather``, ``ring_all_reduce``; ``ring_step``,
  the point-to-point step of every ring in the course (send to the next rank, receive from the
  previous one), and ``ring_blocks``, which walks every rank's block round the ring with it;
  ``send_recv``, one such step between any two peers.
* ``recursive``: ``recursive_doubling_all_reduce`` (log2 N steps, latency-optimal) and
  ``all_reduce``, which picks it, halving-doubling or the ring by size with an alpha-beta model,
  and direct exchange above a crossover measured on the spot.
* ``halving_doubling``: ``halving_doubling_all_reduce`` (Rabenseifner: the ring's bytes in
  2 log2 N - 1 steps).
* ``direct``: ``direct_all_reduce`` (every chunk straight to its owner, all at once: the ring's
  bytes in two rounds, additions overlapping the transfers).
* ``functional``: collectives that autograd differentiates, for the model-parallel
  chapters: the book's ``f``, ``f_star``, ``g``, ``g_star``, ``split_along_dim``,
  ``gather_along_dim``, ``all_to_all``; and the plain ``all_gather_into``,
  ``reduce_scatter_into``, ``broadcast_parameters``.
* ``logger``: ``CommLogger`` records op, bytes and time of every call on a rank.
* ``bandwidth``: ``bus_bandwidth_sweep`` (algbw and busbw, nccl-tests conventions).
* ``cost_model``: the alpha-beta model, its fit and the crossover size; a model of
  tensor parallelism's throughput (``tensor_parallel_throughput``).
"""

from . import functional
from .bandwidth import bus_bandwidth_sweep, bus_factor, time_collective
from .cost_model import (
    AlphaBeta,
    crossover_size,
    fit_alpha_beta,
    fit_ring_all_reduce,
    noise_floor,
    tensor_parallel_scaling,
    tensor_parallel_throughput,
)
from .logger import CommEvent, CommLogger, format_bytes, wait_for_device
from .ring import (
    chunk_sizes,
    exchange,
    release_buffers,
    ring_all_gather,
    ring_all_reduce,
    ring_blocks,
    ring_reduce_scatter,
    ring_step,
    send_recv,
)

__all__ = [
    "AlphaBeta",
    "CommEvent",
    "CommLogger",
    "bus_bandwidth_sweep",
    "bus_factor",
    "chunk_sizes",
    "crossover_size",
    "exchange",
    "fit_alpha_beta",
    "fit_ring_all_reduce",
    "noise_floor",
    "format_bytes",
    "release_buffers",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_blocks",
    "ring_step",
    "send_recv",
    "tensor_parallel_scaling",
    "tensor_parallel_throughput",
    "time_collective",
    "wait_for_device",
    "functional",
]
