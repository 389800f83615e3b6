"""What the data-parallel and ZeRO tests share: the tiny model, the data, the ranks.

Ψ = 27,520 for CFG: not divisible by 3 (nor is a block's 12,704), so world size 3
exercises the padding of flat buffers.
"""

import pytest
import torch

from ultrascale.data import Batches
from ultrascale.model import GPT, GPTConfig
from ultrascale.runtime import shared_cluster

CFG = GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16)
DATA = Batches(CFG, mbs=2, seed=0)  # the same tokens on every rank and in the reference
STEPS = 3


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def cluster(request):
    return shared_cluster(request.param)


def fresh_model(seed=0):
    """The tiny GPT, seeded, on the host: a rank moves it with ``.to(ctx.device)``."""
    torch.manual_seed(seed)
    return GPT(CFG)
