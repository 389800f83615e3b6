"""A data loader whose position is a sample, so a run resumes at the right one on any layout.

``data.Batches`` makes a step's batch from the step number and the world size: fine for
comparing techniques, but a real loader reads a stream of samples and *where it is* is state
to checkpoint (torchtitan issues 816 and 850: the model resharded, the loader restarted).
Here sample ``i`` is a seeded sequence of tokens, a step takes the next ``global_batch``
samples, and each data-parallel rank trains on its share of them. The position is counted
in samples, not in steps or per rank, so a checkpoint saved by 4 ranks resumes on 3 at the
very sample the 4 would have read next.
"""

from __future__ import annotations

import torch

from ..data import Batch

__all__ = ["SampleLoader"]


class SampleLoader:
    """``global_batch`` samples per step, from sample ``next_sample`` on; this rank's rows of them.

    ``rank`` and ``world_size``: this rank's place among the ranks that split the data (the
    dp axis; tensor-parallel ranks of one replica read the same rows). ``device``: where the
    batches go (``ctx.device``)."""

    def __init__(self, config, global_batch: int, seed: int = 0, rank: int = 0, world_size: int = 1, device=None):
        if global_batch % world_size:
            raise ValueError(
                f"a global batch of {global_batch} samples does not split evenly over {world_size} "
                f"data-parallel ranks: choose a global batch that {world_size} divides, so that "
                "every rank's mean loss weighs the same"
            )
        self.config, self.global_batch, self.seed = config, global_batch, seed
        self.rank, self.world_size, self.device = rank, world_size, device
        self.next_sample = 0

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index``: ``seq_len + 1`` tokens from a generator seeded by it alone."""
        g = torch.Generator().manual_seed(1_000_003 * self.seed + index)
        return torch.randint(0, self.config.vocab_size, (self.config.seq_len + 1,), generator=g)

    def next_batch(self) -> Batch:
        """This rank's rows of the next step's samples; the position moves past all of them."""
        share = self.global_batch // self.world_size
        first = self.next_sample + self.rank * share
        tokens = torch.stack([self.sample(i) for i in range(first, first + share)])
        self.next_sample += self.global_batch
        return Batch(tokens[:, :-1], tokens[:, 1:]).to(self.device)

    def __call__(self, step: int, micro: int = 0) -> Batch:
        """``train.run_steps``'s batches: the next batch, whatever the step (the loader keeps its place)."""
        return self.next_batch()

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample}

    def load_state_dict(self, state: dict) -> None:
        self.next_sample = int(state["next_sample"])
