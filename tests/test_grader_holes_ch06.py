"""The chapter 6 exercises cannot be fooled: plausible wrong answers fail with a message that
says what to fix, and the solution notebook's own answers pass."""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_grader_holes import _fails

from ultrascale_grading import PASS, check


# ---- 06.merge_partial_attention ---------------------------------------------------------


def test_merge_refuses_missing_weights_overflow_and_nan(ch06):
    def added(out_a, lse_a, out_b, lse_b):
        return out_a + out_b, torch.logaddexp(lse_a, lse_b)

    def averaged(out_a, lse_a, out_b, lse_b):
        return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)

    def nan_on_empty_rows(out_a, lse_a, out_b, lse_b):
        lse = torch.logaddexp(lse_a, lse_b)  # -inf - -inf on rows that see nothing
        return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse

    def with_exponentials(out_a, lse_a, out_b, lse_b):
        ea, eb = torch.exp(lse_a), torch.exp(lse_b)  # overflows for large scores
        total = ea + eb
        return (out_a * (ea / total)[..., None] + out_b * (eb / total)[..., None]), torch.log(total)

    def max_as_lse(out_a, lse_a, out_b, lse_b):
        out, _ = ch06["merge_attention"](out_a, lse_a, out_b, lse_b)
        return out, torch.maximum(lse_a, lse_b)

    def library(out_a, lse_a, out_b, lse_b):
        from ultrascale.kernels.tiled_attention import merge_partial_attention

        return merge_partial_attention(out_a, lse_a, out_b, lse_b)

    exercise = "06.merge_partial_attention"
    _fails(check(exercise, added), "ordinary scores", "added as they are", "exp(lse_a - lse)")
    _fails(check(exercise, averaged), "the outputs are averaged", "share of the softmax mass")
    _fails(check(exercise, nan_on_empty_rows), "see no key at all", "exp(-inf - -inf) = NaN")
    _fails(check(exercise, with_exponentials), "exp(lse) overflows", "torch.logaddexp")
    _fails(check(exercise, max_as_lse), "larger of lse_a and lse_b", "torch.logaddexp")
    _fails(check(exercise, library), "the course library's", "merge_partial_attention")
    assert check(exercise, ch06["merge_attention"]).status == PASS


# ---- 06.zigzag_chunks -------------------------------------------------------------------


def test_zigzag_refuses_contiguous_chunks_wrong_order_and_wrong_counts(ch06):
    positions, counts = ch06["zigzag_positions"], ch06["tile_counts"]

    def neighbours(seq, rank, cp):  # chunks 2r and 2r + 1: contiguous, cut finer
        if seq % (2 * cp):
            raise ValueError("uneven")
        size = seq // cp
        return torch.arange(rank * size, (rank + 1) * size)

    def late_chunk_first(seq, rank, cp):
        mine = positions(seq, rank, cp)
        half = len(mine) // 2
        return torch.cat([mine[half:], mine[:half]])

    def wrong_mirror(seq, rank, cp):  # chunks r and cp - 1 - r
        if seq % (2 * cp):
            raise ValueError("uneven")
        size = seq // (2 * cp)
        ids = sorted({rank, cp - 1 - rank}) if rank != cp - 1 - rank else [rank, rank + cp]
        return torch.cat([torch.arange(c * size, (c + 1) * size) for c in ids])

    def no_check(seq, rank, cp):  # a remainder silently dropped
        size = seq // (2 * cp)
        return torch.cat(
            [
                torch.arange(rank * size, (rank + 1) * size),
                torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size),
            ]
        )

    def without_diagonal(pos, tile):
        return int((pos.view(-1, tile)[:, -1] // tile).sum())

    def token_pairs(pos, tile):
        return int((pos + 1).sum())

    exercise = "06.zigzag_chunks"
    _fails(check(exercise, neighbours, counts), "contiguous layout cut finer", "its mirror image from the end")
    _fails(check(exercise, late_chunk_first, counts), "not in ascending order")
    _fails(check(exercise, wrong_mirror, counts), "returned chunks [0, 3] of 8", "not a mirrored pair")
    _fails(check(exercise, no_check, counts), "should raise ValueError", "do not cut into")
    _fails(check(exercise, positions, without_diagonal), "the diagonal tile is missing")
    _fails(check(exercise, positions, token_pairs), "tile=2", "(query, key) pairs of tokens")
    assert check(exercise, positions, counts).status == PASS


# ---- 06.ring_step -----------------------------------------------------------------------


def test_ring_step_refuses_no_overlap_gathers_and_lost_merges(ch06):
    from ultrascale.kernels.tiled_attention import merge_partial_attention

    def post(kv, group):
        r, n = dist.get_rank(group), dist.get_world_size(group)
        incoming = torch.empty_like(kv)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, kv, group=group, group_peer=(r + 1) % n),
                dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % n),
            ]
        )
        return incoming, works

    def wait_then_compute(q, kv, out, lse, attend, group, last):
        incoming, works = post(kv, group) if not last else (None, [])
        for work in works:
            work.wait()  # the transfer is over before any compute: no overlap
        out, lse = merge_partial_attention(out, lse, *attend(q, kv[0], kv[1]))
        return out, lse, incoming

    def compute_then_post(q, kv, out, lse, attend, group, last):
        out, lse = merge_partial_attention(out, lse, *attend(q, kv[0], kv[1]))
        incoming, works = post(kv, group) if not last else (None, [])
        for work in works:
            work.wait()
        return out, lse, incoming

    def all_gather(q, kv, out, lse, attend, group, last):
        every = torch.empty((dist.get_world_size(group), *kv.shape), dtype=kv.dtype)
        dist.all_gather_into_tensor(every, kv.contiguous(), group=group)
        out, lse = merge_partial_attention(out, lse, *attend(q, kv[0], kv[1]))
        return out, lse, every[(dist.get_rank(group) - 1) % dist.get_world_size(group)]

    def forgets_the_merge(q, kv, out, lse, attend, group, last):
        incoming, works = post(kv, group) if not last else (None, [])
        out, lse = attend(q, kv[0], kv[1])  # only this block
        for work in works:
            work.wait()
        return out, lse, incoming

    def receives_into_kv(q, kv, out, lse, attend, group, last):
        works = []
        if not last:
            r, n = dist.get_rank(group), dist.get_world_size(group)
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, kv, group=group, group_peer=(r + 1) % n),
                    dist.P2POp(dist.irecv, kv, group=group, group_peer=(r - 1) % n),
                ]
            )
        out, lse = merge_partial_attention(out, lse, *attend(q, kv[0].clone(), kv[1].clone()))
        for work in works:
            work.wait()
        return out, lse, kv

    def sends_at_the_last_step(q, kv, out, lse, attend, group, last):
        incoming, works = post(kv, group)
        out, lse = merge_partial_attention(out, lse, *attend(q, kv[0], kv[1]))
        for work in works:
            work.wait()
        return out, lse, incoming

    exercise = "06.ring_step"
    _fails(
        check(exercise, wait_then_compute),
        "2 ranks in one cp group",
        "waited for the incoming block before calling attend",
        "do not overlap",
    )
    _fails(check(exercise, compute_then_post), "attend ran before the transfer was posted")
    _fails(check(exercise, all_gather), "called dist.all_gather_into_tensor", "point-to-point")
    _fails(check(exercise, forgets_the_merge), "step 1", "this block's attention alone")
    _fails(check(exercise, receives_into_kv), "changed its argument `kv`", "work on a copy")  # the contract
    _fails(check(exercise, sends_at_the_last_step), "the last step", "nothing left to send")
    assert check(exercise, ch06["ring_step"]).status == PASS


# ---- 06.ulysses_attention ---------------------------------------------------------------


def test_ulysses_refuses_no_way_back_own_tokens_wrong_order_group_gradient_and_gathering(ch06):
    import torch.nn.functional as F

    from ultrascale.comm.functional import all_to_all, gather_from_sequence_region

    def to_heads(t, group, n, order=(1, 2, 0, 3, 4)):
        b, h, s, d = t.shape
        received = all_to_all(t.reshape(b, n, h // n, s, d).transpose(0, 1), group=group)
        return received.permute(*order).reshape(b, h // n, n * s, d)

    def to_tokens(t, group, n):
        b, g, s, d = t.shape
        received = all_to_all(t.reshape(b, g, n, s // n, d).permute(2, 0, 1, 3, 4), group=group)
        return received.transpose(0, 1).reshape(b, n * g, s // n, d)

    def no_way_back(q, k, v, group):
        n = dist.get_world_size(group)
        return F.scaled_dot_product_attention(*(to_heads(t, group, n) for t in (q, k, v)), is_causal=True)

    def own_tokens_only(q, k, v, group):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ranks_interleaved(q, k, v, group):  # the received pieces put together token by token
        n = dist.get_world_size(group)
        heads = [to_heads(t, group, n, order=(1, 2, 3, 0, 4)) for t in (q, k, v)]
        return to_tokens(F.scaled_dot_product_attention(*heads, is_causal=True), group, n)

    def no_mask(q, k, v, group):
        n = dist.get_world_size(group)
        return to_tokens(F.scaled_dot_product_attention(*(to_heads(t, group, n) for t in (q, k, v))), group, n)

    def ignores_the_group(q, k, v, group):
        n = dist.get_world_size()
        y = F.scaled_dot_product_attention(*(to_heads(t, None, n) for t in (q, k, v)), is_causal=True)
        return to_tokens(y, None, n)

    def plain_all_to_all(q, k, v, group):  # right numbers, but autograd cannot see through it
        n = dist.get_world_size(group)

        def exchange(pieces):
            out = torch.empty_like(pieces.contiguous())
            dist.all_to_all_single(out, pieces.contiguous(), group=group)
            return out

        def there(t):
            b, h, s, d = t.shape
            received = exchange(t.reshape(b, n, h // n, s, d).transpose(0, 1))
            return received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)

        y = F.scaled_dot_product_attention(there(q), there(k), there(v), is_causal=True)
        b, g, s, d = y.shape
        back = exchange(y.reshape(b, g, n, s // n, d).permute(2, 0, 1, 3, 4))
        return back.transpose(0, 1).reshape(b, n * g, s // n, d)

    def gathers_the_sequence(q, k, v, group):  # the all-gather variant: right answer, more bytes
        k, v = (gather_from_sequence_region(t, dim=2, group=group) for t in (k, v))
        r, s = dist.get_rank(group), q.shape[2]
        keys, queries = torch.arange(k.shape[2], device=q.device), torch.arange(s, device=q.device)
        mask = keys[None, :] <= (r * s + queries)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def library(q, k, v, group):
        from ultrascale.parallel.ulysses import ulysses_attention

        return ulysses_attention(q, k, v, group)

    exercise = "06.ulysses_attention"
    _fails(check(exercise, no_way_back), "still split by heads", "second all-to-all")
    _fails(
        check(exercise, own_tokens_only),
        "called these collectives on this rank: none",  # the contract
        "made of all_to_all",
    )
    _fails(check(exercise, ranks_interleaved), "differs from causal attention", "piece i holds rank i's tokens")
    _fails(check(exercise, no_mask), "without the causal mask")
    _fails(check(exercise, ignores_the_group), "[1, 2]", "the default group (no group=)")
    _fails(check(exercise, plain_all_to_all), "no gradient", "comm.functional's all_to_all")
    _fails(check(exercise, gathers_the_sequence), "made of all_to_all", "all_gather is another algorithm")  # contract
    _fails(check(exercise, library), "the course library's", "ulysses_attention")
    assert check(exercise, ch06["ulysses_attention"]).status == PASS
