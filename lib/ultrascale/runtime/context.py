"""``ctx``: what a function running on a rank gets as its first argument."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class RankContext:
    """Everything a rank needs to know about itself.

    ``state`` is a plain dict that lives as long as the rank: put a model, an
    optimizer or a cache there in one call and find it again in the next.
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    channel: Any = None  # how log() reaches the notebook; None under torchrun
    state: dict = field(default_factory=dict)
    strict_device: bool = False  # runtime/strict_device.py: host tensors fail as on a GPU node
    _groups: dict = field(default_factory=dict, repr=False)

    @property
    def group(self):
        """The default process group (all ranks)."""
        return dist.group.WORLD

    def new_group(self, ranks) -> Any:
        """A sub-group of ``ranks``, created once and cached.

        Every rank must call this with the same ranks, in the same order, as
        torch.distributed requires for ``new_group``.
        """
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key))
        return self._groups[key]

    def log(self, **metrics) -> None:
        """Stream metrics (numbers or short strings) to the notebook while a call runs.

        The notebook hands them to the ``on_log`` callback of ``Cluster.run``,
        e.g. a live plot or a progress bar.
        """
        metrics = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        if self.channel is not None:
            self.channel.send("log", (time.time(), metrics))
        elif self.rank == 0:
            print({"rank": self.rank, **metrics})

    def barrier(self) -> None:
        dist.barrier()


def to_cpu(obj):
    """Move tensors in a (nested) result to the CPU, so whoever collects it (the notebook,
    or rank 0 under torchrun) can unpickle it without that rank's GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if type(obj) in (list, tuple):  # exact types: a namedtuple or subclass is left as it is
        return type(obj)(to_cpu(o) for o in obj)
    if type(obj) is dict:
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj
