"""Training in a chosen precision with the course's one loop, ``train.run_steps``.

``train_losses(model, batches, steps, "adam", autocast=torch.bfloat16)`` runs the same
loop as every other chapter and returns the loss of every step, so that runs in float32,
bfloat16 autocast, float16 with loss scaling or FP8 (``apply_fp8`` on the model first)
differ only in their precision. Three small adapters make that possible without a second
loop:

* ``Autocast(model, dtype)``: the forward under ``torch.autocast`` (what ``run_steps``
  calls as ``module``). Autocast keeps the parameters in float32, the master weights, and
  casts them to ``dtype`` for each matrix multiply; softmax, norms and the loss stay in
  float32;
* ``LoggedBatches``: each batch's loss is recorded as the loop computes it (and, with a
  loss scaler, multiplied by the scale before backward);
* ``ScaledOptimizer`` (``loss_scaling``): the scaler's ``step`` and ``update``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..train import make_optimizer, run_steps
from .loss_scaling import ScaledOptimizer


class Autocast(nn.Module):
    """``model``'s forward under ``torch.autocast(device, dtype)``."""

    def __init__(self, model: nn.Module, dtype=torch.bfloat16):
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast runs in torch.bfloat16 or torch.float16, got {dtype}")
        self.model, self.dtype = model, dtype

    def forward(self, *args, **kwargs):
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=self.dtype):
            return self.model(*args, **kwargs)


class LoggedBatches:
    """``batches`` for ``run_steps`` that records every loss in ``losses`` (a float per
    micro-batch, before any scaling) and multiplies it by ``scaler``'s scale, if given."""

    def __init__(self, batches, scaler=None):
        self.batches, self.scaler, self.losses = batches, scaler, []

    def __call__(self, step, micro=0):
        return _LoggedBatch(self.batches(step, micro), self)


@dataclass(frozen=True)
class _LoggedBatch:
    batch: object
    log: LoggedBatches

    def to(self, device):
        return _LoggedBatch(self.batch.to(device), self.log)

    def loss(self, model):
        loss = self.batch.loss(model)
        self.log.losses.append(loss.item())
        return loss if self.log.scaler is None else self.log.scaler.scale(loss)


def train_losses(
    model,
    batches,
    steps: int,
    optimizer="adam",
    *,
    autocast=None,
    scaler=None,
    first_step: int = 0,
    **optimizer_options,
) -> list:
    """Train with ``train.run_steps`` and return each step's loss.

    ``autocast``: None (the model's own precision), ``torch.bfloat16`` or ``torch.float16``.
    ``scaler``: a ``DynamicLossScaler`` or ``torch.amp.GradScaler``; the optimizer is then
    wrapped in a ``ScaledOptimizer`` (pass one as ``optimizer`` yourself to read its scales
    and skipped steps afterwards).
    ``optimizer_options`` override the course optimizer's defaults (e.g. ``lr=``).
    """
    if isinstance(optimizer, str):
        optimizer = make_optimizer(model.parameters(), optimizer, **optimizer_options)
    if scaler is not None and not isinstance(optimizer, ScaledOptimizer):
        optimizer = ScaledOptimizer(optimizer, scaler)
    if isinstance(optimizer, ScaledOptimizer):
        scaler = optimizer.scaler
    data = LoggedBatches(batches, scaler)
    module = None if autocast is None else Autocast(model, autocast)
    run_steps(model, data, steps, optimizer, module=module, first_step=first_step)
    return data.losses
