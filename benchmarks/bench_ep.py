"""Expert parallelism: the EP MoE layer on 4 ranks against the same layer on one process.

    python benchmarks/bench_ep.py [--world-size 4] [--hidden 256] [--experts 8] [--top-k 2] ...

One MoE layer of the course GPT (router + ``--experts`` GPT MLPs, top-``--top-k`` routing):

1. **step time**: forward, backward and an SGD step of the layer on ``mbs`` sequences per rank,
   with its experts split over ``--world-size`` ranks by ``apply_ep`` (dispatch, local experts,
   combine; the router's gradient averaged in backward), against one process running the whole
   global batch (``world_size * mbs`` sequences) through all the experts. Both are timed in
   alternating rounds, slowest rank, median (``sidebyside.measure``). On a CPU the ranks share
   the machine's cores, so the ratio says what the all-to-alls and the bookkeeping cost next
   to the compute, not what separate devices would gain.
2. **bytes**: one forward and backward of the EP layer under ``CommLogger``; every rank's
   logged all-to-all bytes must equal ``dispatch_volume``'s prediction from its split sizes
   (forward: "ep routing", "ep dispatch", "ep combine"; backward: the gradients' all-to-alls).
"""

from __future__ import annotations

import torch

from ultrascale.comm import format_bytes
from ultrascale.model import MLP, GPTConfig
from ultrascale.moe import MoE
from ultrascale.parallel.expert_parallel import apply_ep
from ultrascale.parity.expert_runs import layer_traffic
from ultrascale.runtime import Cluster
from ultrascale.train import make_optimizer
from sidebyside import measure, model_arguments, timed_steps

IMPLS = {"ep": "ours: apply_ep over the ranks", "one": "one process, all experts"}


def layer(cfg, ep: bool):
    """The MoE layer, the same weights in every process; expert-parallel over all ranks if ``ep``."""
    torch.manual_seed(0)
    moe = MoE(cfg.hidden, cfg, lambda: MLP(cfg.hidden))
    return apply_ep(moe, None, plan={"": "ep"}) if ep else moe


def tokens(cfg, rows: int, seed: int):
    return torch.randn(rows, cfg.seq_len, cfg.hidden, generator=torch.Generator().manual_seed(seed))


def time_steps(ctx, impl, cfg, mbs, warmup, steps):
    if impl == "one" and ctx.rank:  # one process: rank 0 alone, the others wait
        return [0.0] * steps
    moe = layer(cfg, impl == "ep").to(ctx.device)
    rows = mbs if impl == "ep" else mbs * ctx.world_size
    x = tokens(cfg, rows, ctx.rank if impl == "ep" else 0).to(ctx.device)
    opt = make_optimizer(moe.parameters(), "sgd")

    def step():
        moe(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return timed_steps(ctx, step, warmup, steps, barrier=impl == "ep")  # one process alone: no barrier


def logged_bytes(ctx, cfg, mbs):
    """This rank's logged all-to-all bytes of one forward and backward, and the prediction."""
    x = tokens(cfg, mbs, ctx.rank).view(-1, cfg.hidden).to(ctx.device).requires_grad_()
    traffic = layer_traffic(layer(cfg, True).to(ctx.device), x)
    return traffic["logged"], traffic["predicted"], traffic["send"]


def main():
    parser = model_arguments(__doc__, hidden=256, seq=128, mbs=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    cfg = GPTConfig(hidden=args.hidden, heads=args.heads, seq_len=args.seq, experts=args.experts, top_k=args.top_k)
    n = args.world_size
    print(
        f"MoE layer: h={cfg.hidden}, {cfg.experts} GPT-MLP experts, top-{cfg.top_k}, {args.mbs} x {cfg.seq_len} "
        f"tokens per rank; torch {torch.__version__}"
    )
    with Cluster(n) as cluster:
        print(f"ep={n} ranks, backend {cluster.backend}, {cluster.threads} thread(s) per rank\n")
        t = measure(cluster, list(IMPLS), args.rounds, time_steps, cfg, args.mbs, args.warmup, args.steps)
        print(f"{'implementation':<34}{'step (ms)':>10}   tokens")
        for impl, seconds in t.items():
            print(
                f"{IMPLS[impl]:<34}{1e3 * seconds:>10.1f}   {args.mbs * cfg.seq_len * (1 if impl == 'ep' else n)}"
                + (" per rank" if impl == "ep" else "")
            )
        print(f"\nEP step / one-process step (the same {n * args.mbs * cfg.seq_len} tokens) = {t['ep'] / t['one']:.3f}")

        print(f"\n{'rank':>4}  {'split sizes':<22}{'dispatch':>11}{'combine':>11}{'backward':>11}  logged = predicted")
        all_equal = True
        for rank, (logged, predicted, send) in enumerate(cluster.run(logged_bytes, cfg, args.mbs)):
            equal = logged == predicted
            all_equal &= equal
            f, b = logged
            print(
                f"{rank:>4}  {str(send):<22}{format_bytes(f.get('ep dispatch', 0)):>11}"
                f"{format_bytes(f.get('ep combine', 0)):>11}{format_bytes(b.get('all_to_all_single', 0)):>11}  "
                f"{'yes' if equal else f'NO: {logged} vs {predicted}'}"
            )
        print(f"all-to-all bytes equal the prediction on every rank: {'OK' if all_equal else 'MISSED'}")


if __name__ == "__main__":
    main()
