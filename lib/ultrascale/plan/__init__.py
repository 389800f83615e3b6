"""The configuration planner of chapter 10: which layout trains a model fastest on a cluster.

Modules, one idea each:

* ``hardware``: :class:`Hardware` (peak FLOP/s, memory, intra- and inter-node links), H100 defaults,
  and :func:`datasheet`, the vendors' peak numbers for a GPU by its device name;
* ``enumerate``: :class:`ParallelConfig`, the rules a layout must follow (:func:`violations`)
  and every valid layout (:func:`enumerate_configs`);
* ``fit``: the memory filter, on ``ultrascale.memory.breakdown``;
* ``steptime``: the step-time model (compute, the A3 overlap of DP, ZeRO-3, TP, PP, the bubble);
* ``search``: :func:`plan`, the three together, ranked;
* ``rules``: the book's steps 1-3 as small functions;
* ``published``: published training setups and how the planner ranks them;
* ``calibrate``: this machine's FLOP/s and bandwidth, and step times measured on real ranks
  (the one module that runs anything; it imports the parallel techniques only inside its
  functions, so the planner itself stays arithmetic).
"""

from .enumerate import (
    SCHEDULES,
    ZERO_STAGES,
    ParallelConfig,
    PlanError,
    divisors,
    enumerate_configs,
    sequences_per_step,
    violations,
)
from .fit import CONSUMERS, fits, memory_filter, memory_per_gpu
from .hardware import DATASHEETS, H100, Datasheet, Hardware, datasheet, hardware_from_measurements
from .search import Plan, Scored, plan
from .steptime import PARTS, flops_config, micro_batch_flops, recompute_flops, step_time

__all__ = [
    "CONSUMERS",
    "DATASHEETS",
    "Datasheet",
    "H100",
    "PARTS",
    "SCHEDULES",
    "ZERO_STAGES",
    "Hardware",
    "ParallelConfig",
    "Plan",
    "PlanError",
    "Scored",
    "datasheet",
    "divisors",
    "hardware_from_measurements",
    "enumerate_configs",
    "fits",
    "flops_config",
    "memory_filter",
    "memory_per_gpu",
    "micro_batch_flops",
    "plan",
    "recompute_flops",
    "sequences_per_step",
    "step_time",
    "violations",
]
