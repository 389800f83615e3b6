"""The data every run of the course trains on: one seeded global batch per step, and its slices.

A step's tokens come from the seed, the step and the micro-step alone, so one process
training on the whole batch and N ranks each training on their share see the same tokens
without communicating:

    data = Batches(config, mbs=2, seed=0)               # step t -> the same tokens everywhere
    data.global_stream(world)                           # what one process trains on
    data.rank_stream(ctx.rank, ctx.world_size)          # this rank's rows of each step

* ``Batches`` makes the seeded global batch of every (step, micro-step);
* ``split`` slices a batch by data (rows, for DP and ZeRO) or by sequence (columns plus
  their global positions, ``sequence_positions``, for context parallelism);
* ``micro_batches`` cuts it into micro-batches (gradient accumulation, pipelines).

The loss is always ``Batch.loss``, ``model.lm_loss`` (mean next-token cross-entropy): one
definition for every run, so a difference can only come from the technique. The loop that
trains on these batches is ``ultrascale.train``; the checks that runs agree, ``ultrascale.parity``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .model import auxiliary_loss, lm_loss


@dataclass(frozen=True)
class Batch:
    """Token ids and next-token targets, plus the global positions when the sequence is split."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Batch(move(self.inputs), move(self.targets), move(self.positions))

    def loss(self, model) -> torch.Tensor:
        """Mean next-token cross-entropy of ``model`` on this batch (plus the load-balancing
        loss of its MoE layers, if they have one: ``ultrascale.model.auxiliary_loss``)."""
        if self.positions is None:
            return lm_loss(model(self.inputs), self.targets) + auxiliary_loss(model)
        return lm_loss(model(self.inputs, self.positions), self.targets) + auxiliary_loss(model)

    def rows(self, start: int, stop: int) -> "Batch":
        return replace(self, inputs=self.inputs[start:stop], targets=self.targets[start:stop])


@dataclass(frozen=True)
class Batches:
    """Seeded global batches: (step, micro-step) -> the same tokens in every process.

    A step's global batch has ``mbs`` rows per data-parallel rank. Nothing here depends
    on which process asks, so the reference and every rank agree without communicating.
    """

    config: object  # a model config: vocab_size and seq_len are used
    mbs: int = 2  # rows per rank and micro-step
    seed: int = 0

    def global_batch(self, step: int, world_size: int = 1, micro: int = 0) -> Batch:
        g = torch.Generator().manual_seed(1_000_003 * self.seed + 1000 * step + micro)
        shape = (self.mbs * world_size, self.config.seq_len + 1)
        tokens = torch.randint(0, self.config.vocab_size, shape, generator=g)
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def rank_batch(
        self, rank: int, world_size: int, step: int, micro: int = 0, by: str = "data", layout: str = "contiguous"
    ) -> Batch:
        return split(self.global_batch(step, world_size if by == "data" else 1, micro), rank, world_size, by, layout)

    def global_stream(self, world_size: int = 1):
        """``(step, micro) -> Batch``: what one process trains on in place of ``world_size`` ranks."""
        return lambda step, micro=0: self.global_batch(step, world_size, micro)

    def rank_stream(self, rank: int, world_size: int, by: str = "data", layout: str = "contiguous"):
        """``(step, micro) -> Batch``: this rank's share of each step (``layout``: see ``split``)."""
        return lambda step, micro=0: self.rank_batch(rank, world_size, step, micro, by, layout)


SEQUENCE_LAYOUTS = ("contiguous", "zigzag")


def sequence_positions(seq: int, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """The global positions of the tokens that rank ``rank`` holds of a ``seq``-token sequence.

    * ``"contiguous"``: the sequence cut into ``world_size`` chunks; rank r holds chunk r;
    * ``"zigzag"``: cut into ``2 * world_size`` chunks; rank r holds chunks r and
      ``2 * world_size - 1 - r``. Under a causal mask an early chunk has few keys to attend
      to and a late one many, so pairing them gives every rank the same work (context
      parallelism's load balancing; with "contiguous" the last rank does the most).
    A rank's positions are ascending in both. A length that does not cut into equal chunks
    is refused, not padded (padding would need masking in attention and in the loss).
    """
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {SEQUENCE_LAYOUTS}")
    per_rank = 2 if layout == "zigzag" else 1
    chunks = per_rank * world_size
    how = f" in the zigzag layout ({chunks} chunks, 2 per rank)" if layout == "zigzag" else ""
    if seq < chunks:
        raise ValueError(
            f"{world_size} ranks need more chunks than a sequence of {seq} tokens has{how}: use at "
            f"most {seq // per_rank} ranks or a longer sequence"
        )
    if seq % chunks:
        raise ValueError(
            f"{seq} tokens per sequence do not split evenly over {world_size} ranks{how}: pad the "
            f"sequence to {-(-seq // chunks) * chunks} tokens or choose a length that {chunks} divides"
        )
    size = seq // chunks
    ids = [rank] if layout == "contiguous" else [rank, chunks - 1 - rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in ids])


def split(batch: Batch, rank: int, world_size: int, by: str = "data", layout: str = "contiguous") -> Batch:
    """Rank ``rank``'s share of ``batch``.

    * ``"data"``: rows ``rank*b .. (rank+1)*b`` (b = rows / world_size), as a sampler would;
    * ``"sequence"``: a slice of every row's tokens, with their global positions (RoPE must
      rotate a token by where it is in the whole sequence, not in the slice). ``layout``:
      ``"contiguous"`` (one slice per rank) or ``"zigzag"`` (two chunks per rank, balanced
      for causal attention), see ``sequence_positions``.
    The mean loss over equal shares, averaged over the ranks, is the mean loss of the batch:
    so shares must be equal, and an uneven split is an error rather than a silent bias.
    """
    if by not in ("data", "sequence"):
        raise ValueError(f"by={by!r}: choose 'data' or 'sequence' (micro_batches() cuts micro-batches)")
    if by == "sequence":
        positions = sequence_positions(batch.inputs.shape[1], rank, world_size, layout)
        return Batch(batch.inputs[:, positions], batch.targets[:, positions], positions)
    rows = batch.inputs.shape[0]
    if rows % world_size:
        raise ValueError(
            f"{rows} rows do not split evenly over {world_size} ranks: choose sizes that {world_size} divides"
        )
    share = rows // world_size
    return batch.rows(rank * share, (rank + 1) * share)


def micro_batches(batch: Batch, n: int) -> list[Batch]:
    """Cut a batch into ``n`` equal micro-batches of rows (gradient accumulation, pipelines)."""
    rows = batch.inputs.shape[0]
    if rows % n:
        raise ValueError(f"{rows} rows do not make {n} equal micro-batches")
    size = rows // n
    return [batch.rows(i * size, (i + 1) * size) for i in range(n)]
