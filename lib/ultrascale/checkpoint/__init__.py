"""Checkpoints of every layout the course trains, with ``torch.distributed.checkpoint`` (DCP).

* ``pieces``: a rank's part of a global tensor as DCP chunks (ZeRO's flat runs cut into boxes),
  and DCP's default planners extended to read and write them;
* ``layouts``: each layout's state (ZeRO-1/2/3, replicated, tensor-parallel) as the same keys
  of global tensors that torch's ``get_state_dict`` gives FSDP2;
* ``store``: saving and loading atomically, with the step, RNG states and data position;
* ``loader``: a data loader whose position is a sample, resumable on another layout;
* ``failures``: the best checkpoint interval (Young, Daly) and a simulated run with failures.
"""

from .loader import SampleLoader
from .store import (
    PARTIAL,
    PendingSave,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_checkpoint_async,
)

__all__ = [
    "SampleLoader",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "checkpoint_steps",
    "save_checkpoint_async",
    "PendingSave",
    "PARTIAL",
]
