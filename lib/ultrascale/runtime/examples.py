"""Small experiment functions used by the docs and tests: each runs unchanged on a
notebook ``Cluster`` and under ``torchrun``."""

import torch
import torch.distributed as dist


def all_reduce_demo(ctx, length: int = 4):
    """Every rank contributes rank+1; all end with the sum 1+2+...+world_size."""
    tensor = torch.full((length,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(tensor)
    return tensor
