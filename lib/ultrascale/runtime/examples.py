"""Small experiment functions used by the docs and tests: each runs unchanged on a
notebook ``Cluster`` and under ``torchrun`` (``launch/torchrun.sh``, ``launch/slurm.sbatch``)."""

import torch
import torch.distributed as dist

# A GPT small enough to train in a second on a CPU rank.
DEMO_GPT = dict(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16)


def all_reduce_demo(ctx, length: int = 4):
    """Every rank contributes rank+1; all end with the sum 1+2+...+world_size."""
    tensor = torch.full((length,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(tensor)
    return tensor


def one_process_reference(world_size: int, steps: int = 3, seed: int = 0) -> dict:
    """The weights one process ends with after ``steps`` SGD steps on the whole batch of
    ``world_size`` ranks: what data parallelism over ``world_size`` ranks must reproduce."""
    from ..data import Batches
    from ..model import GPT, GPTConfig
    from ..train import train

    config = GPTConfig(**DEMO_GPT)
    torch.manual_seed(seed)
    return train(GPT(config), Batches(config, mbs=2, seed=seed).global_stream(world_size), steps, "sgd")


def data_parallel_demo(ctx, steps: int = 3, seed: int = 0):
    """Train the demo GPT with our data parallelism, each rank on its rows of every batch,
    and check it against one process trained on all the rows (``ultrascale.parity``).

    Returns what a launcher can compare across ranks and runs: the world size, the largest
    difference from the one-process weights, and the sum of all weights (equal on every
    rank if the replicas stayed identical)."""
    from ..data import Batches
    from ..model import GPT, GPTConfig
    from ..parallel.data_parallel import apply_data_parallel
    from ..parity import assert_same, max_difference
    from ..train import train

    config = GPTConfig(**DEMO_GPT)
    torch.manual_seed(seed)
    model = GPT(config).to(ctx.device)
    dp = apply_data_parallel(model)  # over all ranks of the default process group
    mine = Batches(config, mbs=2, seed=seed).rank_stream(ctx.rank, ctx.world_size)
    ours = train(
        model, mine, steps, "sgd", module=dp, after_backward=dp.finish_gradient_synchronization, device=ctx.device
    )
    reference = one_process_reference(ctx.world_size, steps, seed)
    assert_same(ours, reference, f"rank {ctx.rank}: data parallelism vs one process")
    return {
        "world_size": ctx.world_size,
        "max_difference": max_difference(ours, reference),
        "weight_sum": sum(w.double().sum().item() for w in ours.values()),
    }
