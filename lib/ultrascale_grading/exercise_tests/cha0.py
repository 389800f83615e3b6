"""Tests of the A0 exercises (solutions/a0_collectives_exercises.ipynb): ring collectives
built from point-to-point sends and receives only.

* ``a0.ring_reduce_scatter``: ``ring_reduce_scatter(ctx, tensor)`` returns this rank's
  chunk (``torch.tensor_split`` rule) of the sum over ranks, and leaves ``tensor`` alone.
* ``a0.ring_all_gather``: ``ring_all_gather(ctx, chunk, numel)`` returns every rank's
  chunk concatenated in rank order, a 1-D tensor of ``numel`` elements.
* ``a0.ring_all_reduce``: ``ring_all_reduce(ctx, tensor)`` returns the sum over ranks,
  in the shape of ``tensor``.
* ``a0.recursive_doubling``: ``recursive_doubling_all_reduce(ctx, tensor)`` returns the same
  sum in ``log2 P`` swaps of the whole tensor with rank ``r XOR 2**k`` (``P`` the largest power
  of two not above ``N``; the other ranks fold their input into rank ``r - P`` first and get
  the result back at the end).
* ``a0.halving_doubling``: ``halving_doubling_all_reduce(ctx, tensor)`` returns the same sum
  with the ring's bytes: a reduce-scatter by recursive halving, then an all-gather by recursive
  doubling, among the same ``P`` ranks (the messages must follow the split rule of
  ``halving_doubling_messages``; the library's merged innermost swap is accepted too).

Each test runs the learner's function on clusters of several sizes, on lengths that the
world size does not divide (chunks then differ by one element, or are empty), and
compares with ``torch.distributed``'s own collective, computed on the same ranks just
before. Inputs are whole numbers stored as float32, so every order of summation gives
exactly the same result and the comparison can ask for equality.

While the learner's code runs, on every rank:

* the built-in collectives (``dist.all_reduce``, ``reduce_scatter``, ``all_gather`` and
  the others) and the course's own ring (``ultrascale.comm``) are replaced by functions
  that raise :class:`ForbiddenCollective`: the exercise is to build them from sends and
  receives;
* a :class:`~ultrascale.comm.CommLogger` counts the bytes that go through ``send``,
  ``isend`` and ``batch_isend_irecv``; a ring moves every chunk exactly ``N - 1`` times per
  phase, so the total over ranks must be ``(N-1) K`` per phase for ``K`` bytes;
* a tap on ``send`` and ``isend`` notes where each message goes and its size: in a ring every
  rank must send only to one neighbour, one chunk per step, ``N - 1`` steps per phase (the
  same bytes sent straight to the rank that needs them are not a ring); in recursive
  doubling every message must carry the whole tensor, to the partners of the algorithm, in
  its order (a ring or halving-doubling gives the same sum with other messages).

The learner's function is unpickled on the ranks *after* the replacements are in place,
so that even ``from torch.distributed import all_reduce`` in the notebook is caught.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import cloudpickle
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ultrascale.comm.halving_doubling import largest_power_of_two
from ultrascale_grading import exercise

P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
LENGTHS = (1, 7, 12, 1000)  # 1 and 7 leave some chunks empty or one element short
MORE_LENGTHS = (100_003,)


class ForbiddenCollective(RuntimeError):
    """Raised on a rank when the learner's code calls a built-in collective."""


# ---- on the ranks ------------------------------------------------------------------------
def rank_input(length: int, rank: int, seed: int) -> torch.Tensor:
    """Whole numbers in [-50, 50] as float32: sums are exact in any order."""
    gen = torch.Generator().manual_seed(10_000 * seed + 100 * rank + length)
    return torch.randint(-50, 51, (length,), generator=gen).float()


def _forbidden(name: str, exercise_name: str, original):
    @functools.wraps(original)  # keeps the signature, which the CommLogger reads
    def refuse(*args, **kwargs):
        raise ForbiddenCollective(
            f"{exercise_name} called dist.{name}: build it from point-to-point calls only "
            "(dist.isend / dist.irecv, dist.batch_isend_irecv, or the send_recv helper)"
        )

    return refuse


def _library_ring(*args, **kwargs):
    raise ForbiddenCollective(
        "your code called the course library's collectives (ultrascale.comm: the ring, "
        "recursive doubling, halving-doubling, direct exchange): write yours with "
        "dist.isend / dist.irecv"
    )


ADVICE = (
    "build it from point-to-point calls only (dist.isend / dist.irecv, dist.batch_isend_irecv, or the send_recv helper)"
)


@contextlib.contextmanager
def forbid_collectives(exercise_name: str):
    """Make every built-in collective raise (torch.distributed's functions, the process group's
    methods and the c10d operators: guards.forbid_collectives), and the course's own all-reduces:
    each module of them sends through its own ``send_recv`` (the ring through ``ring_step``, direct
    exchange through ``_post``)."""
    from ultrascale.comm import direct, halving_doubling, recursive, ring
    from ultrascale_grading.guards import forbid_collectives as forbid_builtins

    senders = [
        (ring, "send_recv"),
        (ring, "ring_step"),
        (recursive, "send_recv"),
        (halving_doubling, "send_recv"),
        (direct, "_post"),
    ]
    saved = [getattr(module, name) for module, name in senders]
    for module, name in senders:
        setattr(module, name, _library_ring)
    try:
        with forbid_builtins(exercise_name, ADVICE, error=ForbiddenCollective):
            yield
    finally:
        for (module, name), original in zip(senders, saved):
            setattr(module, name, original)


class _SendTap:
    """While open, notes the destination (global rank) and size of every send on this rank.

    ``dist.send`` and ``dist.isend`` are wrapped in ``torch.distributed`` and in its
    defining module, where ``P2POp`` and ``batch_isend_irecv`` look ``isend`` up, so
    sends made through ``batch_isend_irecv`` are seen too. Opened inside the
    ``CommLogger`` (it wraps the logger's wrappers) and closed before it.
    """

    def __init__(self):
        self.sends = []  # (destination rank, bytes)
        self._saved = []
        self._inside = False  # dist.send calls isend itself: one message, noted once

    def __enter__(self) -> "_SendTap":
        for name in ("send", "isend"):
            original = getattr(dist, name)
            wrapper = self._tap(original)
            for module in (dist, c10d):
                self._saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _tap(self, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def tapped(*args, **kwargs):
            if self._inside:
                return original(*args, **kwargs)
            a = signature.bind(*args, **kwargs).arguments
            dst, group = a.get("dst"), a.get("group")
            if dst is None and a.get("group_dst") is not None:
                dst = (
                    a["group_dst"]
                    if group is None or group is dist.group.WORLD
                    else dist.get_global_rank(group, a["group_dst"])
                )
            tensor = a["tensor"]
            self.sends.append((dst, tensor.numel() * tensor.element_size()))
            self._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False

        return tapped


def _padded_all_gather(chunk: torch.Tensor, numel: int, n: int) -> torch.Tensor:
    """The reference all-gather: dist.all_gather needs equal sizes, so pad, then trim."""
    sizes = [c.numel() for c in torch.tensor_split(torch.empty(numel), n)]
    padded = torch.zeros(max(sizes), dtype=chunk.dtype, device=chunk.device)
    padded[: chunk.numel()] = chunk
    pieces = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(pieces, padded)
    return torch.cat([p[:s] for p, s in zip(pieces, sizes)])


def _reference(kind: str, x: torch.Tensor, rank: int, n: int):
    """What torch.distributed computes for this case (run before any patching)."""
    if kind == "all_gather":
        chunk = torch.tensor_split(x.flatten(), n)[rank].clone()
        return chunk, _padded_all_gather(chunk, x.numel(), n)
    total = x.clone()
    dist.all_reduce(total)
    if kind == "reduce_scatter":
        return x, torch.tensor_split(total.flatten(), n)[rank].clone()
    return x, total


def _on_rank(ctx, kind: str, payload: bytes, shapes, seed: int, exercise_name: str):
    """Run the learner's function on every case; return what the notebook needs to judge."""
    n, r = ctx.world_size, ctx.rank
    cases = []
    for shape in shapes:
        x = rank_input(int(torch.Size(shape).numel()), r, seed).reshape(shape).to(ctx.device)
        cases.append((shape, *_reference(kind, x, r, n)))
    from ultrascale.comm import CommLogger

    results = []
    with forbid_collectives(exercise_name), CommLogger() as log, _SendTap() as tap:
        fn = cloudpickle.loads(payload)  # after the patches: see the module docstring
        for shape, given, expected in cases:
            argument = given.clone()
            start, first_send = len(log.events), len(tap.sends)
            try:
                if kind == "all_gather":
                    out = fn(ctx, argument, int(torch.Size(shape).numel()))
                else:
                    out = fn(ctx, argument)
            except ForbiddenCollective as err:
                return {"forbidden": str(err)}
            sent = sum(e.bytes_sent for e in log.events[start:] if e.op in P2P_OPS)
            if isinstance(out, torch.Tensor):
                out = out.detach().cpu().clone()
            messages = [(dst, nbytes) for dst, nbytes in tap.sends[first_send:] if nbytes]
            results.append(
                {
                    "shape": shape,
                    "given": given,
                    "expected": expected,
                    "out": out,
                    "input_kept": torch.equal(argument, given),
                    "sent": sent,
                    "messages": messages,
                    "sent_to": [dst for dst, _ in messages],
                }
            )
    return {"results": results}


# ---- in the notebook ---------------------------------------------------------------------
def _world_sizes(world_size: int, quick: bool) -> list:
    return sorted({1, 2, 3, 4, world_size} if quick else {1, 2, 3, 4, 5, world_size})


def _run(kind: str, fn, shapes, world_size: int, quick: bool, seed: int, timeout: float):
    """Yield (n, per-rank results) for every cluster size, after the forbidden-call check."""
    from ultrascale.runtime import grading_cluster

    if not callable(fn):
        raise AssertionError(f"expected your function, got {type(fn).__name__}")
    payload = cloudpickle.dumps(fn)
    name = getattr(fn, "__name__", "your function")
    for n in _world_sizes(world_size, quick):
        per_rank = grading_cluster(n).run(_on_rank, kind, payload, shapes, seed, name, timeout=timeout)
        for rank, answer in enumerate(per_rank):
            if "forbidden" in answer:
                raise AssertionError(f"world_size={n}, rank {rank}: {answer['forbidden']}")
        yield n, [answer["results"] for answer in per_rank]


def _check_output(where: str, out, expected, hint: str = "") -> None:
    assert out is not None, f"{where}: your function returned None; return the result tensor"
    assert isinstance(out, torch.Tensor), f"{where}: expected a tensor back, got {type(out).__name__}"
    assert tuple(out.shape) == tuple(expected.shape), (
        f"{where}: expected shape {tuple(expected.shape)}, got {tuple(out.shape)}{hint}"
    )


def _check_traffic(where: str, sent_per_rank: list, numel: int, n: int, phases: int, what: str) -> None:
    """``phases`` ring phases over ``numel`` float32 elements: (N-1) K bytes each, in total."""
    total_bytes = 4 * numel
    expected_total = phases * (n - 1) * total_bytes
    total = sum(sent_per_rank)
    if total == expected_total:
        if numel % n == 0:  # equal chunks: every rank sends the same
            per_rank = phases * (n - 1) * total_bytes // n
            assert all(s == per_rank for s in sent_per_rank), (
                f"{where}: bytes sent per rank {sent_per_rank}; with equal chunks a ring sends "
                f"{phases}·(N-1)·K/N = {per_rank} on every rank"
            )
        return
    if total == 0:
        raise AssertionError(
            f"{where}: no bytes went through dist.send / dist.isend / "
            "dist.batch_isend_irecv, yet data had to move between ranks. "
            "Move the chunks with point-to-point calls."
        )
    hint = (
        "Are you sending whole tensors instead of one chunk per step?"
        if total > expected_total
        else "Some chunks never travelled."
    )
    raise AssertionError(
        f"{where}: your {what} sent {total} bytes in total over all ranks (per rank: "
        f"{sent_per_rank}); a ring sends every chunk N-1 times per phase, "
        f"{phases}·(N-1)·K = {expected_total} bytes for K = {total_bytes}. {hint}"
    )


def _check_ring(where: str, sent_to_per_rank: list, numel: int, n: int, phases: int, what: str) -> None:
    """Each rank sends only to one neighbour, one chunk per step: ``phases`` (N-1) steps.

    The bytes alone do not tell a ring from sending every chunk straight to the rank
    that needs it (the same volume, but each rank talks to all the others at once).
    Empty chunks are skipped, so with fewer elements than ranks some steps send nothing.
    """
    steps = phases * (n - 1)
    for rank, sent_to in enumerate(sent_to_per_rank):
        right, left = (rank + 1) % n, (rank - 1) % n
        peers = sorted(set(sent_to))
        if peers and peers != [right] and peers != [left]:
            raise AssertionError(
                f"{where}, rank {rank}: your {what} sent messages to ranks {peers}. In a ring each rank "
                f"sends only to its right neighbour (r + 1) % N = {right} and receives only from its left "
                f"neighbour (r - 1) % N = {left}, passing chunks along; sending each chunk straight to the rank "
                "that needs it moves as many bytes but makes every rank talk to all the others at once"
            )
        if (numel >= n and len(sent_to) != steps) or len(sent_to) > steps:
            formula = "N-1" if phases == 1 else f"{phases}·(N-1)"
            raise AssertionError(
                f"{where}, rank {rank}: your {what} sent {len(sent_to)} messages; a ring {what} takes "
                f"{formula} = {steps} step{'s' if steps != 1 else ''}, and in each step every rank sends one "
                "chunk to its neighbour, in one message"
                + (
                    ": do not split a chunk into several messages"
                    if len(sent_to) > steps
                    else ": do not merge several chunks into one message"
                )
            )


# ---- a0.ring_reduce_scatter --------------------------------------------------------------
def _diagnose_reduce_scatter(out, expected, given_all, rank, n) -> str:
    totals = torch.stack(given_all).sum(0)
    chunks = torch.tensor_split(totals, n)
    own = torch.tensor_split(given_all[rank], n)
    for other in range(n):
        if other != rank and out.shape == chunks[other].shape and torch.equal(out, chunks[other]):
            return (
                f"This is chunk {other} of the sum, but rank {rank} must end with chunk {rank}: "
                "check which chunk each rank sends and adds in each step."
            )
    if out.shape == own[rank].shape and torch.equal(out, own[rank]):
        return "This is the rank's own input chunk: nothing was added from the other ranks."
    return "Some terms are missing or counted twice: in step s, rank r sends chunk (r-s-1) % N and adds the incoming chunk into (r-s-2) % N."


@exercise("a0.ring_reduce_scatter", points=1)
def test_ring_reduce_scatter(
    ring_reduce_scatter, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    """Chunk ``rank`` of the sum over ranks, from sends and receives, input untouched."""
    shapes = [(length,) for length in (LENGTHS if quick else LENGTHS + MORE_LENGTHS)]
    for n, per_rank in _run("reduce_scatter", ring_reduce_scatter, shapes, world_size, quick, seed, timeout):
        for i, (length,) in enumerate(shapes):
            for rank in range(n):
                res = per_rank[rank][i]
                where = f"world_size={n}, length {length}, rank {rank}"
                sizes = [c.numel() for c in torch.tensor_split(torch.empty(length), n)]
                _check_output(
                    where,
                    res["out"],
                    res["expected"],
                    f" (torch.tensor_split gives chunk sizes {sizes}; rank {rank} returns chunk {rank})",
                )
                if not torch.equal(res["out"].float(), res["expected"]):
                    given_all = [per_rank[q][i]["given"] for q in range(n)]
                    raise AssertionError(
                        f"{where}: wrong values. "
                        f"{_diagnose_reduce_scatter(res['out'].float(), res['expected'], given_all, rank, n)}"
                    )
                assert res["input_kept"], (
                    f"{where}: your function changed its input tensor; "
                    "work on a copy (tensor.clone()) so the caller keeps its data"
                )
            _check_traffic(
                f"world_size={n}, length {length}",
                [per_rank[q][i]["sent"] for q in range(n)],
                length,
                n,
                1,
                "reduce-scatter",
            )
            _check_ring(
                f"world_size={n}, length {length}",
                [per_rank[q][i]["sent_to"] for q in range(n)],
                length,
                n,
                1,
                "reduce-scatter",
            )


# ---- a0.ring_all_gather ------------------------------------------------------------------
@exercise("a0.ring_all_gather", points=1)
def test_ring_all_gather(ring_all_gather, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60):
    """Every rank's chunk, concatenated in rank order, on every rank."""
    shapes = [(length,) for length in (LENGTHS if quick else LENGTHS + MORE_LENGTHS)]
    for n, per_rank in _run("all_gather", ring_all_gather, shapes, world_size, quick, seed, timeout):
        for i, (length,) in enumerate(shapes):
            sizes = [c.numel() for c in torch.tensor_split(torch.empty(length), n)]
            for rank in range(n):
                res = per_rank[rank][i]
                where = f"world_size={n}, length {length} (chunk sizes {sizes}), rank {rank}"
                _check_output(where, res["out"], res["expected"])
                if not torch.equal(res["out"].float(), res["expected"]):
                    wrong = [
                        q
                        for q, (a, b) in enumerate(
                            zip(torch.tensor_split(res["out"].float(), n), torch.tensor_split(res["expected"], n))
                        )
                        if not torch.equal(a, b)
                    ]
                    raise AssertionError(
                        f"{where}: wrong values in the chunks of ranks {wrong}. Chunk q must hold rank q's "
                        "chunk: in step s, rank r forwards chunk (r-s) % N and receives chunk (r-s-1) % N."
                    )
                assert res["input_kept"], f"{where}: your function changed the chunk it was given"
            _check_traffic(
                f"world_size={n}, length {length}",
                [per_rank[q][i]["sent"] for q in range(n)],
                length,
                n,
                1,
                "all-gather",
            )
            _check_ring(
                f"world_size={n}, length {length}",
                [per_rank[q][i]["sent_to"] for q in range(n)],
                length,
                n,
                1,
                "all-gather",
            )


# ---- a0.ring_all_reduce ------------------------------------------------------------------
def _all_reduce_shapes(quick: bool) -> list:
    """The tensors every all-reduce exercise gets: 1-D of awkward lengths, and one 2-D."""
    return [(length,) for length in (LENGTHS if quick else LENGTHS + MORE_LENGTHS)] + [(3, 5)]


def _check_sum(where: str, res: dict, n: int) -> None:
    """The result of an all-reduce on one rank: the sum over ranks, in the input's shape."""
    _check_output(where, res["out"], res["expected"])
    if torch.equal(res["out"].float(), res["expected"]):
        return
    if torch.equal(res["out"].float(), res["given"]):
        hint = "This is the rank's own input: the values were never combined."
    elif torch.equal(res["out"].float(), res["expected"] * n):
        hint = f"This is {n} times the sum: is some chunk added once per step too often?"
    else:
        bad = (res["out"].float() != res["expected"]).flatten().nonzero().flatten().tolist()
        hint = f"Elements {bad[:10]}{'...' if len(bad) > 10 else ''} are wrong."
    raise AssertionError(f"{where}: wrong values. {hint}")


@exercise("a0.ring_all_reduce", points=1)
def test_ring_all_reduce(ring_all_reduce, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60):
    """The sum over ranks in the input's shape: reduce-scatter then all-gather."""
    shapes = _all_reduce_shapes(quick)
    for n, per_rank in _run("all_reduce", ring_all_reduce, shapes, world_size, quick, seed, timeout):
        for i, shape in enumerate(shapes):
            for rank in range(n):
                _check_sum(f"world_size={n}, shape {shape}, rank {rank}", per_rank[rank][i], n)
            numel = int(torch.Size(shape).numel())
            _check_traffic(
                f"world_size={n}, shape {shape}", [per_rank[q][i]["sent"] for q in range(n)], numel, n, 2, "all-reduce"
            )
            _check_ring(
                f"world_size={n}, shape {shape}",
                [per_rank[q][i]["sent_to"] for q in range(n)],
                numel,
                n,
                2,
                "all-reduce",
            )


# ---- a0.recursive_doubling and a0.halving_doubling: every message read --------------------
def _check_algorithm(
    fn, algorithm: str, accepted, hints, world_size: int, quick: bool, seed: int, timeout: float
) -> None:
    """Run an all-reduce exercise: the sums on every rank and shape first (a wrong sum says more
    than a message), then each rank's messages, the longest tensor first (with a few elements
    most messages are empty). ``accepted(rank, n, numel)`` lists the message lists that pass; a
    mismatch is reported against the first, with ``hints(n, got, want, nbytes)``."""
    shapes = _all_reduce_shapes(quick)
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    for n, per_rank in _run("all_reduce", fn, shapes, world_size, quick, seed, timeout):
        for i, shape in enumerate(shapes):
            for rank in range(n):
                _check_sum(f"world_size={n}, shape {shape}, rank {rank}", per_rank[rank][i], n)
        for i in sorted(range(len(shapes)), key=lambda i: -numels[i]):
            for rank in range(n):
                got, forms = per_rank[rank][i]["messages"], accepted(rank, n, numels[i])
                if got in forms:
                    continue
                want, advice = forms[0], "; ".join(hints(n, got, forms[0], 4 * numels[i]))
                raise AssertionError(
                    f"world_size={n}, shape {shapes[i]}, rank {rank}: your function sent {len(got)} "
                    f"message{'' if len(got) == 1 else 's'}, to ranks {[d for d, _ in got]} with {_sizes(got)} "
                    f"bytes; {algorithm} sends {len(want)}, to ranks {[d for d, _ in want]} with {_sizes(want)} "
                    f"bytes, in that order. "
                    f"{advice[:1].upper()}{advice[1:]}"
                )


def _sizes(messages: list) -> list:
    return [size for _, size in messages]


def doubling_messages(rank: int, n: int, numel: int) -> list:
    """The messages rank ``rank`` sends in recursive doubling on ``n`` ranks for ``numel``
    float32 elements, in order: ``(destination, bytes)``. With ``P`` the largest power of two not above ``n``, rank
    ``P + i`` hands its tensor to rank ``i`` (and receives the result back); rank ``r < P``
    swaps its running sum with ``r XOR 1``, ``r XOR 2``, ... ``r XOR P/2``, then hands the
    result to rank ``r + P`` if there is one. Every message is the whole tensor."""
    power, nbytes = largest_power_of_two(n), 4 * numel
    if rank >= power:
        return [(rank - power, nbytes)]
    swaps = [(rank ^ (1 << k), nbytes) for k in range(power.bit_length() - 1)]
    return swaps + ([(rank + power, nbytes)] if rank + power < n else [])


def halving_doubling_messages(rank: int, n: int, numel: int, merged: bool = False) -> list:
    """The messages rank ``rank`` sends in halving-doubling on ``n`` ranks for ``numel`` float32
    elements, in order: ``(destination, bytes)``, empty messages left out. The fold is recursive
    doubling's. Among the ``P`` ranks, level ``d = 1, 2, ..., P/2`` pairs ``r`` with ``r XOR d``;
    both hold ``[lo, hi)``, cut it at ``mid = lo + (hi - lo) // 2``, the rank with bit ``d`` set
    keeps ``[mid, hi)``, and each sends the half it gives away; the all-gather then sends each
    level's kept range back, innermost level first. ``merged``: the innermost level is one swap
    of its whole range (the library's form), instead of a half there and a half back."""
    power = largest_power_of_two(n)
    if rank >= power:
        return [(rank - power, 4 * numel)] if numel else []
    levels, (lo, hi), distance = [], (0, numel), 1
    while distance < power:
        mid = lo + (hi - lo) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        levels.append((rank ^ distance, keep, give, (lo, hi)))
        lo, hi = keep
        distance *= 2
    size = lambda span: 4 * (span[1] - span[0])  # noqa: E731
    if merged and levels:
        partner, _, _, whole = levels[-1]
        outer = levels[:-1]
        middle = [(partner, size(whole))]
    else:
        outer, middle = levels, []
    messages = (
        [(partner, size(give)) for partner, _, give, _ in outer]
        + middle
        + [(partner, size(keep)) for partner, keep, _, _ in reversed(outer)]
    )
    if rank + power < n:
        messages.append((rank + power, 4 * numel))
    return [(dst, nbytes) for dst, nbytes in messages if nbytes]


def _doubling_hints(n: int, got: list, want: list, nbytes: int) -> list:
    power = largest_power_of_two(n)
    hints = []
    if any(size < nbytes for size in _sizes(got)):
        hints.append(
            f"every message carries the whole tensor ({nbytes} bytes), not a chunk of it: cutting "
            "it is the ring's way (or halving-doubling's), which send fewer bytes in more messages"
        )
    if len(got) == len(want) and _sizes(got) == _sizes(want):
        hints.append(
            "the partner in step k is r XOR 2**k: the two ranks swap, each receiving from the rank "
            "it sends to (not r + 2**k, which passes sums round in a circle)"
        )
    if n != power:
        hints.append(
            f"with N = {n}, the P = {power} ranks below {power} run the doubling; rank P + i hands "
            "its tensor to rank i before and gets the result back after"
        )
    return hints


def _halving_hints(n: int, got: list, want: list, nbytes: int) -> list:
    hints = []
    if nbytes in _sizes(got) and nbytes not in _sizes(want):
        hints.append(
            "a message carried the whole tensor: halving-doubling sends half of the range it holds "
            "at each level, so the messages shrink (K/2, K/4, ...) and grow back in the all-gather"
        )
    if [d for d, _ in got] != [d for d, _ in want]:
        hints.append(
            "level d = 1, 2, ..., P/2 pairs rank r with r XOR d in the reduce-scatter, and the "
            "all-gather visits the same partners in reverse order, innermost first"
        )
    hints.append(
        "at each level both partners cut [lo, hi) at mid = lo + (hi - lo) // 2, and the rank with bit d "
        "set keeps [mid, hi): so the two ends of every message agree on its size (one swap of the "
        "whole range at the innermost level, as the library does, passes too)"
    )
    return hints


@exercise("a0.recursive_doubling", points=1)
def test_recursive_doubling(
    recursive_doubling_all_reduce, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    """The sum over ranks in log2 P swaps of the whole tensor with rank r XOR 2**k, and the
    fold of the ranks beyond the largest power of two P."""
    _check_algorithm(
        recursive_doubling_all_reduce,
        "recursive doubling",
        lambda rank, n, numel: [doubling_messages(rank, n, numel)],
        _doubling_hints,
        world_size,
        quick,
        seed,
        timeout,
    )


@exercise("a0.halving_doubling", points=1)
def test_halving_doubling(
    halving_doubling_all_reduce, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    """The sum over ranks with the ring's bytes: a reduce-scatter by recursive halving, then an
    all-gather by recursive doubling, among the largest power of two P of ranks (the others fold).
    The library's merged innermost swap is accepted as well as the textbook form."""
    _check_algorithm(
        halving_doubling_all_reduce,
        "halving-doubling",
        lambda rank, n, numel: [halving_doubling_messages(rank, n, numel, m) for m in (False, True)],
        _halving_hints,
        world_size,
        quick,
        seed,
        timeout,
    )
