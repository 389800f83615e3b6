"""Ring collectives built only from point-to-point sends and receives.

The ranks stand in a ring: each one sends to its right neighbour ``(r + 1) % N`` and
receives from its left neighbour ``(r - 1) % N``, all at the same time, so every link
is busy in every step and no rank is a bottleneck.

* ``ring_reduce_scatter``: after ``N - 1`` steps rank ``r`` holds chunk ``r`` of the sum.
* ``ring_all_gather``: after ``N - 1`` more steps every rank holds every chunk.
* ``ring_all_reduce`` = reduce-scatter followed by all-gather.
* ``ring_step``: the one step of every ring in the course (start sending to the next rank of
  a group and receiving from the previous one, posted as NCCL needs them), and
  ``ring_blocks``: the walk of every rank's block round the ring, made of those steps. Ring
  attention's K/V, asynchronous TP's pieces and the all-gather below all walk with it;
  ``reduce_round_ring``: running sums walking round the ring, the reduce-scatter below,
  asynchronous TP's and ring attention's dK/dV.
* ``send_recv``: one step between any two peers, waited for (recursive doubling's partners);
  ``keeping_exchanges``: how every collective holds its steps' Work objects until it returns.

Chunking rule: the tensor is flattened and cut with ``torch.tensor_split(flat, N)``,
so with ``K = q * N + m`` elements the first ``m`` chunks have ``q + 1`` elements and
the others ``q`` (chunks may be empty when ``K < N``). Each rank sends every chunk but
one in each phase, which gives the per-rank traffic ``2 (N - 1) K / N`` of the book
when ``N`` divides ``K``.

Every rank must call these functions with tensors of the same shape and dtype, in the
same order, as with the built-in collectives.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .functional import rank_and_size
from .logger import count_p2p, record_op

REDUCE_OPS = ("sum", "avg", "max")


# ---- small helpers -------------------------------------------------------------------
def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Element count of each rank's chunk under the ``torch.tensor_split`` rule."""
    base, extra = divmod(numel, world_size)
    return [base + 1 if i < extra else base for i in range(world_size)]


def collective_rank_and_size(group) -> tuple[int, int]:
    return rank_and_size(group, "the ring collectives")


def normalise_op(op, dtype: torch.dtype) -> str:
    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max"}
    if not isinstance(op, str):
        op = names.get(op, op)
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS} (or the matching dist.ReduceOp), got {op!r}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"op='avg' needs a floating-point tensor, got {dtype}; use 'sum' "
            "and divide yourself, or convert the tensor with .float() first"
        )
    return op


# The Work objects of the exchanges made inside ``keeping_exchanges()``, or None outside it.
_kept_works: list | None = None


@contextlib.contextmanager
def keeping_exchanges():
    """Keep every exchange's Work objects alive until the block ends (one collective).

    Measured with gloo (4 ranks on 2 cores, ``benchmarks/bench_send_recv.py``): when the Work of
    an exchange is let go as soon as it is done, many of the next exchanges take one kernel tick
    (about 4 ms here) instead of about 0.2 ms for 4 KiB or 0.8-1.2 ms for 1 MiB. Why is not
    settled: destroying a Work takes microseconds, the time is lost in the next exchange's wait,
    and it comes and goes with microseconds of timing (a 50 us pause before letting go removed
    it once, 200 us brought it back), which points at thread wake-ups on an oversubscribed
    machine. gloo's own collectives keep their buffers for the whole algorithm; ours now do the
    same, and let go of them all when the collective returns, so no tensor outlives the call it
    was passed to. Nested blocks (a collective made of collectives) keep everything until the
    outermost one ends.
    """
    global _kept_works
    if _kept_works is not None:
        yield
        return
    _kept_works = []
    try:
        yield
    finally:
        _kept_works = None


def keep(works: list) -> None:
    """Inside ``keeping_exchanges()``, hold these Work objects until the block ends (else nothing)."""
    if _kept_works is not None:
        _kept_works.extend(works)


def exchange(sends, recvs, right: int, left: int, group, tag: int = 0, batched: bool = False) -> list:
    """Start sending ``sends`` to the right neighbour and receiving ``recvs`` from the left one
    (ranks in ``group``; the i-th tensor of each under tag ``tag + i``), and return the works
    without waiting: the one step of every ring in the course (the ring collectives, ring
    attention's K/V, asynchronous TP's pieces), which its caller overlaps with compute.

    NCCL's rules decide how they are posted: a send completes only once its receive is posted,
    and the messages between one pair of ranks run in the order posted. So when both go to one
    peer (two ranks, recursive doubling's partners), two ranks that each posted their send
    first would wait for each other forever: then, and always on a GPU, the sends and receives
    go as one ``batch_isend_irecv``. With two peers each pair's stream holds one of them, so on
    gloo they are posted one by one (batch_isend_irecv's bookkeeping costs 50-80 us more per
    exchange there, ``benchmarks/bench_send_recv.py``), unless ``batched`` asks for one batch
    anyway (ring attention: a step's K and V go as one). Empty tensors are skipped on both sides
    (every rank knows every size, so the two ends agree).
    """
    sends = [(t, tag + i) for i, t in enumerate(sends) if t.numel() > 0]
    recvs = [(t, tag + i) for i, t in enumerate(recvs) if t.numel() > 0]
    if batched or right == left or any(t.is_cuda for t, _ in sends + recvs):
        ops = [dist.P2POp(dist.isend, t, group=group, group_peer=right, tag=k) for t, k in sends] + [
            dist.P2POp(dist.irecv, t, group=group, group_peer=left, tag=k) for t, k in recvs
        ]
        return dist.batch_isend_irecv(ops) if ops else []
    return [dist.isend(t, group=group, group_dst=right, tag=k) for t, k in sends] + [
        dist.irecv(t, group=group, group_src=left, tag=k) for t, k in recvs
    ]


def ring_neighbours(group, what: str = "the ring collectives") -> tuple[int, int, int, int]:
    """``(rank, size, next, previous)`` in ``group``: a ring sends to the next rank and
    receives from the previous one."""
    r, n = rank_and_size(group, what)
    return r, n, (r + 1) % n, (r - 1) % n


def ring_step(
    sends, recvs, group, *, tag: int = 0, batched: bool = False, timeline=None, name: str = "ring step"
) -> list:
    """Start sending ``sends`` to the next rank of ``group`` and receiving ``recvs`` from the
    previous one (posted by ``exchange``, as NCCL needs them); return the works without
    waiting, so the caller computes while the tensors travel. With a ``timeline`` the step is
    a bar from now until the last tensor has arrived. Inside ``keeping_exchanges()`` the works
    are kept until the block ends, and inside ``record_op`` the bytes are counted."""
    _, _, right, left = ring_neighbours(group)
    works = exchange(sends, recvs, right, left, group, tag, batched)
    keep(works)
    count_p2p(sum(t.nbytes for t in sends), sum(t.nbytes for t in recvs))
    if works and timeline is not None and timeline.enabled:
        works[-1] = timeline.communication(name, works[-1], nbytes=sum(t.nbytes for t in recvs))
    return works


def wait_all(works) -> None:
    for work in works:
        work.wait()


def ring_blocks(block, group, receive_buffer, **step_options):
    """Walk every rank's block round the ring: yield ``(owner, block)`` ``size`` times, this
    rank's own ``block`` first; at step ``s`` rank ``r`` holds the block of rank ``r - s``.

    Before a block is handed to the caller, the transfer of the next one has started (send
    the block in hand on, receive the previous rank's into ``receive_buffer(step, owner)``, a
    buffer the shape of the block for rank ``owner``), so it travels while the caller computes;
    it is waited for when the caller asks for the next block. ``step_options`` go to
    ``ring_step`` (``tag``, ``batched``, ``timeline``, ``name``: ``{step}`` in the name is
    replaced by the step's number, from 1). A block is a tensor or a tuple of tensors."""
    r, n, _, _ = ring_neighbours(group)
    name = step_options.pop("name", "ring step")
    current = block
    for step in range(n):
        owner = (r - step) % n
        works = []
        if step < n - 1:
            incoming = receive_buffer(step, (owner - 1) % n)
            works = ring_step(
                _tensors(current), _tensors(incoming), group, name=name.format(step=step + 1), **step_options
            )
        yield owner, current
        wait_all(works)
        if step < n - 1:
            current = incoming


def reduce_round_ring(term, group, add, receive_buffer=None, **step_options):
    """Reduce-scatter as running sums walking round the ring: return the sum over the ranks of
    shard ``rank`` (each rank's term of a shard added once, on its way).

    At step ``s`` rank ``r`` takes its own term of shard ``c = r - s - 1`` (``term(c)``, computed
    while the previous step's sum travels), adds into it the running sum of shard ``c`` that
    came from the previous rank (``add(term, incoming)``, in place), and passes it on, receiving
    the running sum of shard ``c - 1`` into ``receive_buffer(step, c - 1)`` (by default a new
    tensor like the term; shards may differ in size). After ``size - 1``
    transfers the sum that arrives last is of shard ``r``, with every rank's term.
    ``step_options`` go to ``ring_step`` (``name``: ``{step}`` is replaced as in ``ring_blocks``)."""
    r, n, _, _ = ring_neighbours(group)
    name = step_options.pop("name", "ring step")
    works, incoming = [], None
    for step in range(n):
        shard = (r - step - 1) % n
        running = term(shard)
        wait_all(works)
        if incoming is not None:
            add(running, incoming)
        if step < n - 1:
            incoming = torch.empty_like(running) if receive_buffer is None else receive_buffer(step, (shard - 1) % n)
            works = ring_step([running], [incoming], group, name=name.format(step=step + 1), **step_options)
    return running


def _tensors(block) -> list:
    return list(block) if isinstance(block, (tuple, list)) else [block]


def send_recv(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group) -> None:
    """Send ``send`` to the right neighbour while receiving ``recv`` from the left one
    (``exchange``, waited for). Inside ``keeping_exchanges()`` the Work objects are kept until
    the block ends (see there why)."""
    works = exchange([send], [recv], right, left, group)
    for work in works:
        work.wait()
    keep(works)
    count_p2p(send.numel() * send.element_size(), recv.numel() * recv.element_size())


# One receive buffer per (dtype, device), kept between calls and grown when needed:
# allocating (and page-faulting) a fresh chunk-sized buffer in every call costs as
# much as a step of the ring on a CPU. ``release_buffers()`` frees them.
_receive_buffers: dict[tuple, torch.Tensor] = {}


def receive_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    key = (like.dtype, like.device)
    buffer = _receive_buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _receive_buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


def release_buffers() -> None:
    """Free the receive buffers the ring collectives keep between calls."""
    _receive_buffers.clear()


def reduce_into(target: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    if op == "max":
        torch.maximum(target, incoming, out=target)
    else:  # sum and avg both add; avg divides once at the end
        target.add_(incoming)


# ---- the two phases, on chunk views of one flat buffer -------------------------------
def _reduce_scatter_chunks(chunks: list[torch.Tensor], op: str, group) -> None:
    """In place: afterwards ``chunks[r]`` on rank ``r`` holds the reduction over all ranks.

    The running sums walk round the ring (``reduce_round_ring``): in step ``s`` rank ``r``
    passes on chunk ``r - s - 1`` (which it finished adding to in the step before) and adds
    the incoming chunk ``r - s - 2`` into its own copy. After ``N - 1`` steps the last chunk
    received, ``r - N = r``, has every rank's term.
    """
    r, n, _, _ = ring_neighbours(group)
    # One receive buffer, reused in every step (and every call): each step's sum is added
    # before the next receive is posted.
    buffer = receive_buffer(max(c.numel() for c in chunks), chunks[0])
    reduce_round_ring(
        lambda shard: chunks[shard],
        group,
        lambda target, incoming: reduce_into(target, incoming, op),
        lambda step, shard: buffer[: chunks[shard].numel()],
    )
    if op == "avg":
        chunks[r].div_(n)


def _all_gather_chunks(chunks: list[torch.Tensor], group) -> None:
    """In place: rank ``r`` starts with ``chunks[r]`` filled and ends with all of them.

    The chunks walk round the ring (``ring_blocks``): in step ``s`` rank ``r`` forwards
    chunk ``r - s`` and receives chunk ``r - s - 1`` straight into its place in the output,
    so nothing is copied twice.
    """
    r, _ = collective_rank_and_size(group)
    for _ in ring_blocks(chunks[r], group, lambda step, owner: chunks[owner]):
        pass


# ---- public collectives --------------------------------------------------------------
@torch.no_grad()
def ring_reduce_scatter(tensor: torch.Tensor, op="sum", group=None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's chunk of the result.

    The returned chunk is 1-D: chunk ``r`` of ``torch.tensor_split(tensor.flatten(), N)``.
    ``tensor`` is left unchanged. ``op`` is ``"sum"``, ``"avg"`` or ``"max"``.
    """
    op = normalise_op(op, tensor.dtype)
    r, n = collective_rank_and_size(group)
    with record_op("ring_reduce_scatter", group), keeping_exchanges():
        work = tensor.detach().flatten().clone()  # the reduction happens in this copy
        chunks = list(torch.tensor_split(work, n))
        _reduce_scatter_chunks(chunks, op, group)
        return chunks[r].clone()  # a copy, so the rest of ``work`` can be freed


@torch.no_grad()
def ring_all_gather(chunk: torch.Tensor, numel: int | None = None, group=None) -> torch.Tensor:
    """Concatenate every rank's ``chunk`` (in rank order) on every rank.

    Without ``numel`` all chunks must have the same shape, and the result stacks them
    along dimension 0, like ``dist.all_gather_into_tensor``. With ``numel`` (the total
    length) the chunks follow the ``tensor_split`` rule, so they may differ by one
    element, and the result is 1-D: this inverts ``ring_reduce_scatter``.
    """
    r, n = collective_rank_and_size(group)
    if numel is None:
        output = chunk.new_empty((n * chunk.shape[0], *chunk.shape[1:]) if chunk.dim() else (n,))
    else:
        expected = chunk_sizes(numel, n)[r]
        if chunk.numel() != expected:
            raise ValueError(
                f"rank {r}: chunk has {chunk.numel()} elements but the "
                f"tensor_split rule gives {expected} for numel={numel}, N={n}"
            )
        output = chunk.new_empty(numel)
    with record_op("ring_all_gather", group), keeping_exchanges():
        chunks = list(torch.tensor_split(output.view(-1), n))
        chunks[r].copy_(chunk.reshape(-1))
        _all_gather_chunks(chunks, group)
    return output


@torch.no_grad()
def ring_all_reduce(tensor: torch.Tensor, op="sum", group=None) -> torch.Tensor:
    """All-reduce ``tensor`` in place as reduce-scatter + all-gather; returns ``tensor``.

    Works for any world size (1 is a no-op), any shape and any length, including
    lengths smaller than or not divisible by the world size.
    """
    op = normalise_op(op, tensor.dtype)
    _, n = collective_rank_and_size(group)
    with record_op("ring_all_reduce", group), keeping_exchanges():
        # A contiguous tensor is reduced where it lies; otherwise in a copy, copied back.
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        chunks = list(torch.tensor_split(flat, n))
        _reduce_scatter_chunks(chunks, op, group)
        _all_gather_chunks(chunks, group)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return tensor
