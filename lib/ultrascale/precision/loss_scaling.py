"""Dynamic loss scaling, the rule ``torch.amp.GradScaler`` follows, written out to read.

In float16, a gradient smaller than 2^-24 (about 6e-8) becomes 0 and one below 2^-14 keeps
only a few bits. Multiplying the loss by S before backward multiplies every gradient of
the backward pass by S (the chain rule is linear), lifting them into range; dividing the
gradients by S afterwards, in float32 and before clipping and the optimizer, gives the
true gradients back. S is a power of two, so the multiply and the divide are exact.

The right S is unknown and drifts during training, so it is found by trial:

* a step whose gradients hold an inf or a NaN overflowed: skip the optimizer step and
  halve S (``backoff_factor``);
* after ``growth_interval`` good steps in a row, double S (``growth_factor``) to win back
  the bits a too-careful S wastes, unless that would make it infinite.

``DynamicLossScaler`` has GradScaler's methods (``scale``, ``unscale_``, ``step``,
``update``, ``get_scale``), so the same training code runs with either, and the course's
training loop drives either through ``ScaledOptimizer`` (and ``training.train_losses``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max


def update_scale(
    scale: float,
    growth_tracker: int,
    found_inf: bool,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> tuple:
    """``(new scale, new growth_tracker)`` after one step; ``growth_tracker`` counts the good
    steps since the scale last changed."""
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = scale * growth_factor
        # GradScaler keeps the scale in a float32 tensor: past 3.4e38 it would be inf.
        return (grown if grown <= FLOAT32_MAX else scale), 0
    return scale, growth_tracker


class DynamicLossScaler:
    """Loss scaling with the update rule above; defaults as ``torch.amp.GradScaler``'s."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1")
        self.scale_value, self.growth_tracker = float(init_scale), 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.found_inf: bool | None = None  # set by unscale_, consumed by update
        self.history: list = []  # (scale used, found_inf) of every step

    def get_scale(self) -> float:
        return self.scale_value

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times S, in float32 (a float16 loss times 2^16 would overflow by itself)."""
        return loss.float() * self.scale_value

    def unscale_(self, optimizer) -> None:
        """Divide every gradient by S in place, and note whether any is inf or NaN."""
        if self.found_inf is not None:
            return  # already unscaled this step (e.g. to clip the gradients first)
        inv_scale = torch.tensor(1.0 / self.scale_value, dtype=torch.float64).float()  # as GradScaler: exact
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype == torch.float16:
                    raise ValueError(
                        "the gradients are float16: keep float32 master weights (train under "
                        "torch.autocast, not on a model cast with .half()), so that unscaled "
                        "gradients are not rounded back into float16"
                    )
                p.grad.mul_(inv_scale)
                found = found or not bool(torch.isfinite(p.grad).all())
        self.found_inf = found

    def step(self, optimizer) -> bool:
        """``optimizer.step()`` unless the gradients overflowed; returns whether it stepped."""
        self.unscale_(optimizer)
        if not self.found_inf:
            optimizer.step()
        return not self.found_inf

    def update(self) -> None:
        if self.found_inf is None:
            raise RuntimeError("update() before unscale_() or step(): no step was checked for overflow")
        self.history.append((self.scale_value, self.found_inf))
        self.scale_value, self.growth_tracker = update_scale(
            self.scale_value,
            self.growth_tracker,
            self.found_inf,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )
        self.found_inf = None


# --------------------------------------------------------------------------- with the course loop
@dataclass
class ScaledOptimizer:
    """What ``train.run_steps`` calls as its optimizer: ``scaler.step`` then ``scaler.update``.

    Works with ``DynamicLossScaler`` and ``torch.amp.GradScaler`` alike. ``scales`` records
    the scale each step used, ``skipped`` whether the step overflowed (and was skipped):
    exactly the steps after which the scale went down."""

    optimizer: torch.optim.Optimizer
    scaler: object
    scales: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def step(self):
        scale = float(self.scaler.get_scale())
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scales.append(scale)
        self.skipped.append(float(self.scaler.get_scale()) < scale)

    def zero_grad(self):
        self.optimizer.zero_grad()
