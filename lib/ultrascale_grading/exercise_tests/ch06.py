"""Tests of the chapter 6 exercises (solutions/06_context_parallelism_exercises.ipynb):
context parallelism's three ideas, one at a time. The ring step (``06.ring_step``) is tested in
``ch06_ring_step.py``, with this module's helpers and tolerances.

* ``06.merge_partial_attention``: ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``, the
  log-sum-exp merge of two partial attention results. Graded against the library's
  ``kernels.tiled_attention.merge_partial_attention`` (and, for the first case, against
  attention over all keys at once) in float64 on: ordinary scores; scores so large that
  ``exp(lse)`` overflows even float64 (a merge that forms ``exp(lse)`` returns inf or NaN);
  causal blocks where some rows see no key of one part, a or b (lse -inf there, weight 0); and rows
  that see no key of either part (lse -inf and output 0, not the NaN of ``-inf - -inf``). The
  inputs must be left unchanged. Typical mistakes are named: outputs added or averaged without
  the weights, the lse taken as the larger of the two.
* ``06.zigzag_chunks``: ``zigzag_positions(seq, rank, cp)`` (the global positions rank
  ``rank`` holds in the zig-zag layout: chunks ``rank`` and ``2cp - 1 - rank`` of ``2cp``,
  ascending; a ValueError when the sequence does not cut into ``2cp`` chunks) and
  ``tile_counts(positions, tile)`` (the (query tile, key tile) pairs a rank holding those
  positions must compute under a causal mask). Graded against ``data.sequence_positions``
  and ``context_parallel.causal_tile_counts`` for cp of 1 to 4 and every tile that divides a
  chunk, both layouts for the counts; contiguous chunks, a wrong mirror chunk, unsorted
  positions, a missing diagonal tile or counts of tokens instead of tiles are named.
* ``06.ulysses_attention``: ``ulysses_attention(q, k, v, group) -> out``, DeepSpeed-Ulysses:
  an all-to-all from this rank's tokens of every head to every token of its head group,
  causal attention, and the all-to-all back. Run forward and backward (12 heads of 4, 3
  tokens per rank) on clusters of 2 and 3 ranks (and the notebook's ``WORLD_SIZE`` when it
  divides 12) and on the groups [0] and [1, 2] of 3 ranks (``only_group`` refuses a collective
  over any other group), against SDPA over the whole sequence at this rank's rows and its
  dQ, dK, dV; the forward's bytes (``CommLogger``) must be ``parallel.ulysses.ulysses_bytes``:
  four all-to-alls and nothing else. Named: an output still split by heads (no way back),
  attention to the rank's own tokens only, no causal mask, an output without gradient (a plain
  ``dist.all_to_all_single``), a gathered sequence (more bytes). The last rank is judged first:
  under a causal mask rank 0's rows need no other rank.

While the learner's code runs the library's own answers refuse to run
(``grading.guards.forbid_library``). All computations on the ranks run first and are judged
after, so that no rank leaves the others waiting in the ring. Tolerances:
``parity.tolerance(None, torch.float64)`` (rtol 1e-10): merging two normalised blocks instead
of normalising each row at once changes only the last bits in float64; a missing weight or a
wrong block is off by far more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultrascale_grading.exercise_tests._common import randn
from ultrascale_grading.exercise_tests._groups import Split
from ultrascale_grading import exercise
from ultrascale.parity import max_difference, tolerance

DT = torch.float64
# The groups of the split layout: group ranks differ from global ones in [1, 2], rank 0 rings alone.
SPLIT = Split([0], [1, 2])


def seeded_randn(shape, seed: int, *salt: int, device=None) -> torch.Tensor:
    """``_common.randn`` in this chapter's float64."""
    return randn(shape, seed, *salt, device=device, dtype=DT)


def close_enough(got, want) -> bool:
    """Same shape, same -inf entries, and the finite ones within the tolerance of ``want``'s dtype
    (float64 in the fixed cases; a property draws float32 too)."""
    if not torch.is_tensor(got) or tuple(got.shape) != tuple(want.shape):
        return False
    got = got.detach().to(want.dtype)
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        return False
    finite = ~torch.isneginf(want)
    return bool(torch.allclose(got[finite], want[finite], **tolerance(None, want.dtype)))


def block_attention(q, k, v, pos_q=None, pos_k=None, causal=False):
    """Attention of ``q`` to one block of keys alone, and each row's log-sum-exp; a row that
    sees no key of the block (a causal mask) gets output 0 and lse -inf."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(pos_k[None, :] > pos_q[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ v, lse


# ---- 06.merge_partial_attention ---------------------------------------------------------


def _merge_cases(seed: int) -> dict:
    """name -> (out_a, lse_a, out_b, lse_b, reference of the whole or None)."""
    b, h, rows, d = 2, 3, 6, 4
    q, k, v = (
        seeded_randn((b, h, rows, d), seed, 1),
        seeded_randn((b, h, 10, d), seed, 2),
        seeded_randn((b, h, 10, d), seed, 3),
    )
    cases = {}
    parts = [block_attention(q, k[..., :4, :], v[..., :4, :]), block_attention(q, k[..., 4:, :], v[..., 4:, :])]
    whole = F.scaled_dot_product_attention(q, k, v)
    cases["ordinary scores"] = (*parts[0], *parts[1], whole)
    big = 400 * q  # scores of several thousand: exp(lse) overflows float64 (above ~709)
    cases["scores of ~1e3, where exp(lse) overflows"] = (
        *block_attention(big, k[..., :4, :], v[..., :4, :]),
        *block_attention(big, k[..., 4:, :], v[..., 4:, :]),
        None,
    )
    pos_q, pos_k = torch.arange(4, 4 + rows), torch.arange(10)  # queries 4..9, causal
    a = block_attention(q, k[..., :6, :], v[..., :6, :], pos_q, pos_k[:6], causal=True)
    bb = block_attention(q, k[..., 6:, :], v[..., 6:, :], pos_q, pos_k[6:], causal=True)
    cases["causal: rows 0-1 see no key of part b"] = (*a, *bb, None)
    # The same parts swapped: lse_a is -inf where lse_b is not, as in a ring's running state before its
    # first block (out 0, lse -inf). A merge that handles an empty part b only fails here.
    cases["causal: rows 0-1 see no key of part a"] = (*bb, *a, None)
    # Rows 0-2 see nothing in either part (a query whose keys are all in its future).
    a = block_attention(q, k[..., 3:6, :], v[..., 3:6, :], torch.arange(rows), pos_k[3:6], causal=True)
    bb = block_attention(q, k[..., 6:9, :], v[..., 6:9, :], torch.arange(rows), pos_k[6:9], causal=True)
    cases["causal: rows 0-2 see no key of either part"] = (*a, *bb, None)
    return cases


def _judge_merge(name, inputs, got, expected, whole) -> str | None:
    out_a, lse_a, out_b, lse_b = inputs
    where = f"case '{name}'"
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"{where}: return a pair (out, lse), got {type(got).__name__}"
    out, lse = got
    want_out, want_lse = expected
    for what, t, want in (("out", out, want_out), ("lse", lse, want_lse)):
        if not torch.is_tensor(t):
            return f"{where}: {what} is {type(t).__name__}, not a tensor"
        if tuple(t.shape) != tuple(want.shape):
            return f"{where}: {what} has shape {tuple(t.shape)}, expected {tuple(want.shape)}"
    bad = ~torch.isfinite(out)
    if bool(bad.any()):
        if "either part" in name:
            return (
                f"{where}: the output has NaN or inf on the rows that see no key at all (lse_a = lse_b = -inf). "
                "There lse is -inf, and exp(lse_a - lse) is exp(-inf - -inf) = NaN: use a weight of 0 for such "
                "rows (e.g. subtract a finite stand-in where lse is -inf); their output must be 0 and lse -inf"
            )
        if "overflows" in name:
            return (
                f"{where}: the output has NaN or inf. exp(lse) overflows above about 709 in float64: never form "
                "exp(lse_a) or exp(lse_b) on their own. Work with differences of lse's instead: the total's lse "
                "has a stable form (torch.logaddexp), and each part's weight, written as exp of its lse minus the "
                "total's, is at most 1"
            )
        return (
            f"{where}: the output has NaN or inf where a part has lse = -inf (rows that see no key of that part). "
            "Such a part must get weight exp(-inf) = 0"
        )
    lost = torch.isfinite(want_lse) & ~torch.isfinite(lse.detach())
    if close_enough(out, want_out) and bool(lost.any()):
        empty = "a" if bool(torch.isneginf(lse_a)[lost].any()) else "b"
        return (
            f"{where}: lse is {lse.detach()[lost][0].item()} on rows where part {empty} is empty (lse_{empty} = "
            f"-inf) and the other part is not. An empty part adds nothing: lse must be the other part's lse "
            "there. torch.logaddexp handles -inf on either side"
        )
    if close_enough(out, want_out) and not close_enough(lse, want_lse):
        if close_enough(lse, torch.maximum(lse_a, lse_b)):
            return (
                f"{where}: lse is the larger of lse_a and lse_b. It is the log of the total softmax mass, "
                "log(exp(lse_a) + exp(lse_b)), which torch.logaddexp computes without overflow"
            )
        return (
            f"{where}: out is right but lse differs from log(exp(lse_a) + exp(lse_b)) by up to "
            f"{max_difference(lse.detach().nan_to_num(0, 0, 0), want_lse.nan_to_num(0, 0, 0)):.3g}"
        )
    if not close_enough(out, want_out):
        if close_enough(out, out_a + out_b):
            return (
                f"{where}: the two outputs are added as they are. Each is normalised over its own keys only, so "
                "each must be weighted by its share of the total: out = exp(lse_a - lse) out_a + "
                "exp(lse_b - lse) out_b, with lse = logaddexp(lse_a, lse_b)"
            )
        if close_enough(out, (out_a + out_b) / 2):
            return (
                f"{where}: the outputs are averaged. The weights are not 1/2 each but each part's share of the "
                "softmax mass: exp(lse_a - lse) and exp(lse_b - lse)"
            )
        return (
            f"{where}: out differs from the merge of the two parts by up to "
            f"{max_difference(out.detach(), want_out):.3g}: out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b"
        )
    if "either part" in name and not torch.equal(out[..., :3, :], torch.zeros_like(out[..., :3, :])):
        return f"{where}: rows that see no key must have output 0"
    if whole is not None and not close_enough(out, whole):  # cannot happen when the library agrees; a safety net
        return f"{where}: out differs from attention over all keys at once"
    return None


@exercise("06.merge_partial_attention", points=1)
def test_merge_partial_attention(merge, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale_grading.guards import call_learner, forbid_library
    from ultrascale.kernels import tiled_attention

    assert callable(merge), f"pass your function, got {merge!r}"
    for name, (out_a, lse_a, out_b, lse_b, whole) in _merge_cases(seed).items():
        inputs = (out_a, lse_a, out_b, lse_b)
        given = [t.clone() for t in inputs]
        expected = tiled_attention.merge_partial_attention(*inputs)
        with forbid_library(
            [tiled_attention.merge_partial_attention],
            "06.merge_partial_attention",
            "write the merge yourself, with torch.logaddexp and torch.exp",
        ):
            got = call_learner(merge, *given, call=f"merge(...) on case '{name}'")
        if not all(torch.equal(g, t) for g, t in zip(given, inputs)):
            raise AssertionError(f"case '{name}': your merge changed its inputs in place; compute new tensors")
        problem = _judge_merge(name, inputs, got, expected, whole)
        if problem:
            raise AssertionError(problem)


# ---- 06.zigzag_chunks -------------------------------------------------------------------


def _zigzag_cases(quick: bool) -> list:
    """(seq, cp) pairs, every rank of each is checked."""
    cases = [(16, 4), (24, 3), (12, 2), (6, 1), (8, 4)]
    return cases if quick else cases + [(48, 4), (60, 5), (96, 6)]


def _chunks_of(positions, seq, cp):
    """Which chunks of seq / 2cp tokens ``positions`` covers, or None when not whole chunks."""
    size = seq // (2 * cp)
    ids = sorted({int(p) // size for p in positions})
    covered = sorted(int(c) * size + i for c in ids for i in range(size))
    return ids if covered == sorted(int(p) for p in positions) else None


def _judge_positions(got, seq, rank, cp, want) -> str | None:
    where = f"zigzag_positions({seq}, {rank}, {cp})"
    if not torch.is_tensor(got):
        try:
            got = torch.as_tensor(got)
        except Exception:
            return f"{where} returned {type(got).__name__}: return a 1-D tensor of positions"
    if got.dim() != 1 or got.is_floating_point():
        return (
            f"{where} returned a tensor of shape {tuple(got.shape)} and dtype {got.dtype}: return a 1-D integer tensor"
        )
    if torch.equal(got.long(), want):
        return None
    size = seq // (2 * cp)
    if sorted(got.tolist()) == want.tolist():
        return (
            f"{where} returned {got.tolist()}: the right positions, but not in ascending order. A rank keeps its "
            "tokens in sequence order (the early chunk, then the late one), which is what the causal mask and "
            "the positions given to RoPE expect"
        )
    chunks = _chunks_of(got.tolist(), seq, cp) if len(got) == len(want) else None
    # The feedback names what is wrong with the chunks returned and the idea that places them, never the
    # chunks or positions the rank should hold: that would be the answer (issue 54, tests/test_hints.py).
    mirror = (
        "a rank holds one early chunk, cheap under the causal mask, and its mirror image from the end, as far "
        "from the end as the early one is from the start; the ranks take the early chunks in their order"
    )
    if chunks == [2 * rank, 2 * rank + 1]:
        return (
            f"{where} returned {got.tolist()}: chunks {chunks}, two neighbours, which is the contiguous layout "
            f"cut finer and keeps its imbalance. Zig-zag pairs an early chunk with a late one: {mirror}"
        )
    if chunks is not None:
        return (
            f"{where} returned chunks {chunks} of {2 * cp} (of {size} tokens each), which are not a mirrored "
            f"pair: {mirror}"
        )
    return (
        f"{where} returned {got.tolist()}: not two whole chunks of the {2 * cp} chunks of {size} tokens that the "
        f"sequence is cut into; {mirror}"
    )


def _judge_tiles(got, positions, tile, want, layout, seq, rank, cp) -> str | None:
    where = f"tile_counts(positions of rank {rank} of {cp}, {layout}, {seq} tokens; tile={tile})"
    try:
        got = int(got)
    except Exception:
        return f"{where} returned {type(got).__name__}: return the count as an int"
    if got == want:
        return None
    last = positions.view(-1, tile)[:, -1]
    if got == int((last // tile).sum()):
        return (
            f"{where} = {got}, expected {want}: the diagonal tile is missing. A query tile needs every key tile "
            "whose first key is not after its last query: key tiles 0 .. last // tile, inclusive"
        )
    if got == int((positions + 1).sum()):
        return (
            f"{where} = {got}, expected {want}: that is the number of unmasked (query, key) pairs of tokens. "
            f"Count tiles of {tile} consecutive tokens: for each query tile, the key tiles it needs"
        )
    if got == len(last):
        return f"{where} = {got}, the number of query tiles; count, for each, the key tiles it needs ({want} in all)"
    return (
        f"{where} = {got}, expected {want}. For each query tile (``tile`` consecutive positions), key tile j is "
        "needed when its first key j * tile is not after the tile's last query"
    )


@exercise("06.zigzag_chunks", points=1)
def test_zigzag_chunks(
    zigzag_positions, tile_counts, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60
):
    from ultrascale_grading.guards import call_learner, expect_value_error, forbid_library
    from ultrascale import data
    from ultrascale.parallel import context_parallel

    assert callable(zigzag_positions) and callable(tile_counts), "pass your two functions"
    forbid = (
        [data.sequence_positions, data.split, context_parallel.split_sequence, context_parallel.causal_tile_counts],
        "06.zigzag_chunks",
        "compute the chunks and the counts yourself",
    )
    for seq, cp in _zigzag_cases(quick):
        for rank in range(cp):
            want = data.sequence_positions(seq, rank, cp, "zigzag")
            with forbid_library(*forbid):
                got = call_learner(zigzag_positions, seq, rank, cp)
            problem = _judge_positions(got, seq, rank, cp, want)
            if problem:
                raise AssertionError(problem)
    for seq, cp, why in (
        (18, 4, "18 tokens do not cut into 2 * 4 = 8 equal chunks"),
        (10, 3, "10 tokens do not cut into 2 * 3 = 6 equal chunks"),
        (4, 4, "4 tokens cannot make the 8 chunks that 4 ranks need"),
    ):
        with forbid_library(*forbid):
            expect_value_error(zigzag_positions, seq, 0, cp, why=why)
    for seq, cp in _zigzag_cases(quick):
        chunk = seq // (2 * cp)
        for layout in ("zigzag", "contiguous"):
            for tile in [t for t in range(1, chunk + 1) if chunk % t == 0]:
                counts = context_parallel.causal_tile_counts(seq, cp, layout, tile)
                for rank in range(cp):
                    positions = data.sequence_positions(seq, rank, cp, layout)
                    with forbid_library(*forbid):
                        got = call_learner(
                            tile_counts,
                            positions.clone(),
                            tile,
                            call=f"tile_counts(positions of rank {rank} of {cp}, {tile})",
                        )
                    problem = _judge_tiles(got, positions, tile, counts[rank], layout, seq, rank, cp)
                    if problem:
                        raise AssertionError(problem)


# ---- 06.ulysses_attention ---------------------------------------------------------------

U_HEADS, U_DIM = 12, 4  # 12 heads split over groups of 1, 2, 3 and 4 ranks


def _ulysses_group(ctx, split):
    if split is None:
        return ctx.group, f"{ctx.world_size} ranks in one group"
    _, group, _ = split.group_of(ctx)
    return group, f"on {split} (each group given as group=)"


def _ulysses_problem(ctx, ulysses, seed, split) -> str | None:
    """Run the learner's function forward and backward on this rank's tokens; what is wrong, or None."""
    from ultrascale.comm import CommLogger
    from ultrascale_grading.exercise_tests._groups import WrongGroup, only_group
    from ultrascale_grading.guards import call_learner, forbid_library
    from ultrascale.parallel import ulysses as library

    group, where = _ulysses_group(ctx, split)
    r, n = dist.get_rank(group), dist.get_world_size(group)
    seq, index = 3 * n, dist.get_process_group_ranks(group)[0]  # each group its own inputs
    q, k, v, upstream = (
        seeded_randn((2, U_HEADS, seq, U_DIM), seed, 50 + i, n, index, device=ctx.device) for i in range(4)
    )
    rows = slice(r * seq // n, (r + 1) * seq // n)  # the contiguous layout
    mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    forbid = (
        [library.ulysses_attention, library._sequence_to_heads, library._heads_to_sequence],
        "06.ulysses_attention",
        "write the two all-to-alls yourself, with comm.functional's all_to_all",
    )
    try:
        with forbid_library(*forbid), only_group(group, "your ulysses_attention"), CommLogger() as log:
            out = call_learner(ulysses, *mine, group, call="ulysses_attention(q, k, v, group)")
    except WrongGroup as err:
        return f"{where}, rank {ctx.rank}: {err}"
    except AssertionError as err:
        return f"{where}, rank {ctx.rank}: {err}"
    what = f"{where}, rank {ctx.rank} (rank {r} of {n} in its group), q/k/v {tuple(mine[0].shape)}"
    want_shape = tuple(mine[0].shape)
    if not torch.is_tensor(out):
        return f"{what}: return the output tensor, got {type(out).__name__}"
    if tuple(out.shape) == (2, U_HEADS // n, seq, U_DIM) and n > 1:
        return (
            f"{what}: your output has shape {tuple(out.shape)}, all the tokens of {U_HEADS // n} heads: it is "
            f"still split by heads. Send each rank its tokens back with a second all-to-all, to {want_shape}"
        )
    if tuple(out.shape) != want_shape:
        return f"{what}: your output has shape {tuple(out.shape)}; it must be shaped like q, {want_shape}"
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, is_causal=True)
    want.backward(upstream)
    if not close_enough(out, want[:, :, rows]):
        if close_enough(out, F.scaled_dot_product_attention(*(t[:, :, rows] for t in (q, k, v)), is_causal=True)):
            return (
                f"{what}: your output is attention to this rank's own tokens only; each head needs the whole "
                "sequence's keys: an all-to-all to head groups first"
            )
        if n > 1 and close_enough(out, F.scaled_dot_product_attention(q, k, v)[:, :, rows]):
            return f"{what}: your output is attention without the causal mask: a token must not see later ones"
        return (
            f"{what}: your output differs from causal attention over the whole sequence at this rank's rows. "
            "Check which dim you cut into pieces before the all-to-all (the heads: head group j goes to rank j) "
            "and how you put the received pieces together (piece i holds rank i's tokens, in sequence order)"
        )
    want_bytes = library.ulysses_bytes(2, U_HEADS, U_HEADS, seq, U_DIM, n, 8)
    if log.bytes_sent != want_bytes:
        ops = sorted({e.op for e in log.events})
        return (
            f"{what}: your forward sent {log.bytes_sent} bytes ({', '.join(ops) or 'nothing'}); Ulysses sends "
            f"{want_bytes}: four all-to-alls (q, k, v, and the output back), each keeping 1/{n} of this rank's "
            "slice and sending the rest, and nothing else"
        )
    if not out.requires_grad:
        return (
            f"{what}: your output has no gradient: use comm.functional's all_to_all, whose backward sends the "
            "gradients back, not dist.all_to_all_single on plain tensors"
        )
    try:
        out.backward(upstream[:, :, rows])
    except Exception as err:  # noqa: BLE001 - the learner's backward, reported
        return f"{what}: backward through your output raised {type(err).__name__}: {err}"
    for name, got, ref in zip(("dQ", "dK", "dV"), (m.grad for m in mine), (t.grad for t in whole)):
        if got is None or not close_enough(got, ref[:, :, rows]):
            return (
                f"{what}: {name} differs from the gradient of attention over the whole sequence: every step "
                "must be differentiable (comm.functional's all_to_all, reshapes, SDPA), with no .detach()"
            )
    return None


@exercise("06.ulysses_attention", points=1)
def test_ulysses_attention(ulysses, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale.runtime import grading_cluster

    assert callable(ulysses), f"pass your function, got {ulysses!r}"
    sizes = [size for size in sorted({2, 3, world_size} if quick else {2, 3, 4, world_size}) if U_HEADS % size == 0]
    # The last rank's problem first: under a causal mask rank 0's rows need no other rank's
    # tokens, so attention to its own tokens alone is right there, and only there.
    for size in sizes:
        for problem in reversed(grading_cluster(size).run(_ulysses_problem, ulysses, seed, None, timeout=timeout)):
            if problem:
                raise AssertionError(problem)
    for problem in reversed(
        SPLIT.run(_ulysses_problem, ulysses, seed, SPLIT, what="ulysses_attention", timeout=timeout)
    ):
        if problem:
            raise AssertionError(problem)
