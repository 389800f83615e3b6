"""Direct exchange: every chunk sent straight to the rank that owns it, all at once.

The ring (``ring.py``) and halving-doubling (``halving_doubling.py``) send the fewest bytes,
``2 (N-1)/N * K`` per rank, one exchange after another: each exchange waits for the one
before, and the additions of a received chunk happen between exchanges, while nothing is on
the wire. Where every pair of ranks is as close as any other (the ranks of one machine over
loopback, or the GPUs of one NVSwitch node), a rank can instead talk to all the others at once:

* **reduce-scatter, one round.** Rank ``r`` owns chunk ``r`` (``torch.tensor_split`` rule, as
  the ring). It posts the ``N - 1`` other chunks to their owners and ``N - 1`` receives of its
  own chunk from everybody else, then adds each contribution as it arrives, while the later
  ones are still on the wire.
* **all-gather, one round.** It posts its summed chunk to everybody and receives every other
  chunk straight into place.

Same bytes as the ring, ``2 (N-1)`` messages per rank, in two rounds instead of ``2 (N-1)``
sequential steps. Under the one-message-at-a-time alpha-beta model that costs what the ring
costs; what the model leaves out is what it gains: the messages of a round overlap each other,
and the additions overlap the transfers. Measured with gloo, 4 ranks on 2 cores
(races of 18-36 rounds in balanced orders, as ``benchmarks/bench_ring_allreduce.py`` runs them):
0.99-1.00x gloo's speed at 16 MiB where halving-doubling read 0.90-0.92x, within noise of it at
4 and 64 MiB, and behind it at 1 MiB (1.48-1.51x gloo's speed against 1.57-1.66x), where
halving-doubling's fewer messages count. ``recursive.all_reduce`` picks it above a crossover measured on the spot
(``direct_crossover_on_the_spot``), since the model cannot place it.

On a real cluster its messages cross every link at once, through the same switches, which is
why NCCL keeps rings and trees for large collectives and uses all-at-once patterns only inside
a node whose GPUs are all directly connected.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .logger import count_p2p, record_op
from .ring import collective_rank_and_size, keep, keeping_exchanges, normalise_op, receive_buffer, reduce_into


def direct_steps(world_size: int) -> int:
    """Messages each rank sends: ``N - 1`` per round, two rounds."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2 * (world_size - 1)


def direct_rounds(world_size: int) -> int:
    """Rounds of messages in flight together: two (none for one rank)."""
    return 2 if world_size > 1 else 0


def _post(sends: list, receives: list, group) -> tuple[list, list]:
    """Post every (tensor, peer) send and receive at once, as one ``batch_isend_irecv``: every
    pair of ranks both sends to and receives from each other here, and under NCCL a send waits
    for its receive while a pair's messages run in the order posted, so sends posted one by one
    before the receives would wait for each other forever. Empty chunks are skipped on both
    sides (every rank knows every chunk size, so the two ends agree)."""
    sends = [(t, peer) for t, peer in sends if t.numel()]
    receives = [(t, peer) for t, peer in receives if t.numel()]
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer in sends] + [
        dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in receives
    ]
    works = dist.batch_isend_irecv(ops) if ops else []
    send_works, recv_works = works[: len(sends)], list(zip(works[len(sends) :], [t for t, _ in receives]))
    count_p2p(
        sum(t.numel() * t.element_size() for t, _ in sends), sum(t.numel() * t.element_size() for t, _ in receives)
    )
    keep(send_works + [w for w, _ in recv_works])  # until the collective returns (ring.keeping_exchanges)
    return send_works, recv_works


@torch.no_grad()
def direct_all_reduce(tensor: torch.Tensor, op="sum", group=None) -> torch.Tensor:
    """All-reduce ``tensor`` in place by direct exchange; returns ``tensor``.

    Any world size, shape and length (chunks may be empty when the buffer is shorter than N).
    Each round's sends and receives go as one batch (``_post``), as NCCL needs them.
    """
    op = normalise_op(op, tensor.dtype)
    rank, n = collective_rank_and_size(group)
    with record_op("direct_all_reduce", group), keeping_exchanges():
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        chunks = flat.tensor_split(n)
        mine = chunks[rank]
        peers = [(rank + k) % n for k in range(1, n)]  # send to r+1, r+2, ...
        sources = [(rank - k) % n for k in range(1, n)]  # receive from r-1, r-2, ...
        m = mine.numel()
        buffer = receive_buffer((n - 1) * m, flat)
        incoming = [buffer[i * m : (i + 1) * m] for i in range(n - 1)]  # one slot per contributor
        # reduce-scatter: everything out at once; add each contribution as soon as it is in
        sends, receives = _post([(chunks[p], p) for p in peers], list(zip(incoming, sources)), group)
        for work, contribution in receives:
            work.wait()
            reduce_into(mine, contribution, op)
        if op == "avg":
            mine.div_(n)
        for work in sends:  # our chunks must have left before they change
            work.wait()
        # all-gather: our summed chunk to everybody, every other chunk straight into place
        sends, receives = _post([(mine, p) for p in peers], [(chunks[s], s) for s in sources], group)
        for work in sends + [w for w, _ in receives]:
            work.wait()
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return tensor
