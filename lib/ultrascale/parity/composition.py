"""Checking 5D parallelism: the composed run on the ranks against the same steps in one process.

    per_rank = cluster.run(lambda ctx: train_composed(ctx, GPT(gpt_config), config, data, steps=3))
    reference = train_one_process(GPT(gpt_config), config, data, steps=3)
    merged = assert_composition_matches(per_rank, reference, config)

The ranks apply ``config`` with ``parallel.compose.apply_parallelisms`` and train on their
share of ``data``; one process trains on the whole batch of every step, its micro-batches
accumulated, with the same optimizer. The loss curve and every weight must agree within the
tolerance ``TOLERANCES`` states for that optimizer.
"""

from __future__ import annotations

import torch

from ..data import Batches
from ..parallel.compose import ParallelConfig, apply_parallelisms, build_mesh, mean_loss
from ..train import run_steps, weights
from . import assert_same, merge_ranks

__all__ = ["train_composed", "train_one_process", "assert_composition_matches"]


def train_composed(ctx, model, config: ParallelConfig, data: Batches, steps: int) -> dict:
    """On every rank: apply ``config`` to ``model`` and train it ``steps`` steps on this rank's
    share of ``data``. Returns this rank's loss curve and its whole-size weights."""
    par = apply_parallelisms(model, build_mesh(ctx, config), config)
    losses = par.train(par.batches(data), steps)
    return {"losses": losses, "weights": par.full_weights()}


def train_one_process(model, config: ParallelConfig, data: Batches, steps: int) -> dict:
    """The reference: the same steps on one process, the whole batch of every step at once
    (its ``microbatches`` accumulated), with the same optimizer."""
    losses = run_steps(
        model, data.global_stream(config.dp * config.ep), steps, config.optimizer, grad_acc=config.microbatches
    )
    return {"losses": losses, "weights": weights(model)}


def assert_composition_matches(per_rank: list, reference: dict, config: ParallelConfig) -> dict:
    """The ranks' results equal one process: the loss curve (mean over the data ranks) and every
    weight, merged from the ranks, within ``parity``'s tolerance for the optimizer. Returns the
    merged result."""
    merged = {
        "losses": mean_loss([r["losses"] for r in per_rank], config.layout()),
        "weights": merge_ranks([r["weights"] for r in per_rank]),
    }
    what = str(config)
    assert_same(
        torch.tensor(merged["losses"], dtype=torch.float64),
        torch.tensor(reference["losses"], dtype=torch.float64),
        f"{what}: loss curve",
        optimizer=config.optimizer,
    )
    assert_same(merged["weights"], reference["weights"], f"{what}: weights", optimizer=config.optimizer)
    return merged
