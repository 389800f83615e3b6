"""Tensor (and sequence) parallelism against PyTorch's own, side by side in one run.

    python benchmarks/bench_tp.py [--world-size 4] [--hidden 128] [--layers 4] ...

Prints, on 4 ranks (gloo on CPU, NCCL with 4 GPUs), the time of one training step (forward,
backward, Adam step) of the course GPT made tensor-parallel by our ``apply_tp`` and by
``torch.distributed.tensor.parallel.parallelize_module`` with the same layout
(``parity.dtensor_tp``: vocabulary-parallel embedding and head, parallel cross-entropy),
without and with sequence parallelism. Target: ours / PyTorch's <= 1.1.
Then the activation memory autograd saves per rank in one forward with SP (our regathering
SP keeps a 1/tp slice of every hidden state), against one process's divided by tp:
target within 5% (Korthikanti et al.: b*s*h*34/tp per layer with SP, all of it split).

Implementations are timed in alternating rounds (A B, B A, ...), so a slow spell of a
shared machine hits all of them alike; we report the median step over all rounds.
A step's time is the slowest rank's: every layer waits for all the tp ranks.
Data, loss and PyTorch's version come from ``ultrascale.parity``, as in the tests.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor.parallel import loss_parallel

from ultrascale.data import Batches
from ultrascale.memory import saved_activation_bytes
from ultrascale.model import GPT, count_params
from ultrascale.parallel.tensor_parallel import apply_tp
from ultrascale.parity import device_mesh_1d, dtensor_tp
from ultrascale.runtime import Cluster
from ultrascale.train import make_optimizer
from sidebyside import config_of, measure, model_arguments, timed_steps, verdict

IMPLS = {
    "ours_tp": "ours: apply_tp",
    "torch_tp": "PyTorch parallelize_module",
    "ours_sp": "ours: apply_tp, SP",
    "torch_sp": "PyTorch parallelize_module, SP",
}


def build(ctx, impl, cfg):
    """The model made tensor-parallel, and the context its forward and backward need."""
    torch.manual_seed(0)
    model = GPT(cfg).to(ctx.device)
    sp = impl.endswith("_sp")
    if impl.startswith("ours"):
        return apply_tp(model, sequence_parallel=sp), contextlib.nullcontext
    # DTensor logits are sharded on the vocabulary: loss_parallel makes F.cross_entropy parallel.
    return dtensor_tp(model, device_mesh_1d(ctx), sequence_parallel=sp), loss_parallel


def time_steps(ctx, impl, cfg, mbs, warmup, steps):
    model, context = build(ctx, impl, cfg)
    opt = make_optimizer(model.parameters(), "adam")
    batch = Batches(cfg, mbs).global_batch(0).to(ctx.device)  # TP: every rank sees the whole batch

    def step():
        with context():
            batch.loss(model).backward()
        opt.step()
        opt.zero_grad()

    return timed_steps(ctx, step, warmup, steps)


def saved_bytes(ctx, cfg, mbs, tp):
    """Bytes autograd saves in one forward on this rank: one process (tp=1) or ours with SP."""
    torch.manual_seed(0)
    model = GPT(cfg).to(ctx.device)
    if tp > 1:
        apply_tp(model, sequence_parallel=True)
    return saved_activation_bytes(model, Batches(cfg, mbs).global_batch(0).inputs.to(ctx.device))


def main():
    args = model_arguments(__doc__, hidden=256, heads=8, vocab=4096, seq=128, mbs=4).parse_args()
    cfg = config_of(args)
    print(
        f"model: GPT h={cfg.hidden} L={cfg.layers} heads={cfg.heads} v={cfg.vocab_size} seq={cfg.seq_len} "
        f"mbs={args.mbs}: {count_params(cfg):,} parameters; torch {torch.__version__}"
    )

    with Cluster(args.world_size) as cluster:
        print(f"tp={args.world_size} ranks, backend {cluster.backend}, {cluster.threads} thread(s) per rank\n")
        t = measure(cluster, list(IMPLS), args.rounds, time_steps, cfg, args.mbs, args.warmup, args.steps)
        print(f"{'implementation':<34}{'step (ms)':>10}")
        for impl, seconds in t.items():
            print(f"{IMPLS[impl]:<34}{1e3 * seconds:>10.1f}")
        print()
        for mine, theirs, what in (("ours_tp", "torch_tp", "TP"), ("ours_sp", "torch_sp", "TP+SP")):
            ratio = t[mine] / t[theirs]
            print(f"ours / PyTorch, {what:<6} = {ratio:.3f}  (target <= 1.10) {verdict(ratio, high=1.10)}")
        n = args.world_size
        whole = cluster.run(saved_bytes, cfg, args.mbs, 1)[0]
        per_rank = max(cluster.run(saved_bytes, cfg, args.mbs, n))
        share = per_rank / (whole / n)
        print(f"\nsaved activations per rank with SP: {per_rank:,} bytes; one process / tp: {whole / n:,.0f} bytes")
        print(f"measured / predicted = {share:.3f}  (target within 5%) {verdict(share, 0.95, 1.05)}")


if __name__ == "__main__":
    main()
