"""Strict point-to-point mode (runtime/strict_p2p.py): NCCL's rules for sends and receives on gloo.

The pattern that hangs on a GPU node (two ranks that each send to the other before receiving)
must fail here with a message that says so; the patterns NCCL accepts must run and move the
right data. The chapters and graders run in this mode in ``make test``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ultrascale.runtime import Cluster, RankError


@pytest.fixture(scope="module")
def strict():
    with Cluster(3, strict_p2p=3.0) as c:  # a send may wait 3 s for its receive
        yield c


def _both_send_first(ctx):
    peer = 1 - ctx.rank
    if ctx.rank > 1:
        return None
    out, into = torch.full((4,), float(ctx.rank)), torch.empty(4)
    send = dist.isend(out, peer)
    dist.irecv(into, peer).wait()  # NCCL: behind the send on this pair's stream
    send.wait()
    return into.tolist()


def test_two_ranks_that_both_send_first_fail_as_they_would_hang_under_nccl(strict):
    with pytest.raises(RankError) as caught:
        strict.run(_both_send_first, timeout=60)
    message = str(caught.value)
    assert "PointToPointDeadlock" in message and "batch_isend_irecv" in message, message
    assert "rank 0 -> rank 1" in message and "rank 1 -> rank 0" in message, message


def test_the_same_exchange_passes_on_plain_gloo():
    with Cluster(2, strict_p2p=False) as plain:
        assert plain.run(_both_send_first) == [[1.0] * 4, [0.0] * 4]


def test_what_nccl_accepts_runs_and_moves_the_right_data(strict):
    def patterns(ctx):
        r, n = ctx.rank, ctx.world_size
        got = {}
        # a ring exchange posted together: every rank sends and receives
        into = torch.empty(3)
        for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.full((3,), float(r)), (r + 1) % n), dist.P2POp(dist.irecv, into, (r - 1) % n)]
        ):
            w.wait()
        got["ring"] = into[0].item()
        # a chain, as a pipeline's forward: blocking send after the receive
        x = torch.zeros(2)
        if r > 0:
            dist.recv(x, r - 1)
        x += 1
        if r < n - 1:
            dist.send(x, r + 1)
        got["chain"] = x[0].item()
        # two ranks both sending and receiving, one of them receiving first
        if r < 2:
            peer, into = 1 - r, torch.empty(1)
            if r == 0:
                dist.recv(into, peer)
                dist.send(torch.tensor([10.0]), peer)
            else:
                send = dist.isend(torch.tensor([20.0]), peer)
                dist.recv(into, peer)
                send.wait()
            got["pair"] = into.item()
        # a sub-group, peers named by their rank in it
        group = ctx.new_group([0, 2])
        if r in (0, 2):
            mine, into = torch.tensor([float(r)]), torch.empty(1)
            peer = 1 - dist.get_rank(group)
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, mine, group=group, group_peer=peer),
                    dist.P2POp(dist.irecv, into, group=group, group_peer=peer),
                ]
            )
            for w in works:
                w.wait()
            got["group"] = into.item()
        return got

    results = strict.run(patterns, timeout=60)
    assert [g["ring"] for g in results] == [2.0, 0.0, 1.0]
    assert [g["chain"] for g in results] == [1.0, 2.0, 3.0]
    assert results[0]["pair"] == 20.0 and results[1]["pair"] == 10.0
    assert results[0]["group"] == 2.0 and results[2]["group"] == 0.0


def test_a_send_and_a_receive_of_other_sizes_name_both_ends(strict):
    """gloo aborts the receiving process ("Connection reset by peer" on the other); here the
    send refuses, naming its tensor and the receive's buffer (issue 53's misleading rejection),
    and the receive fails too with the same words, rather than wait for a send never made (a
    rank stuck there would keep every other from hearing of the problem)."""

    def float32_buffer(ctx):
        if ctx.rank == 0:
            dist.send(torch.zeros(4, dtype=torch.float64), 1)
        elif ctx.rank == 1:
            into = torch.empty(4)  # float32: half the bytes
            dist.recv(into, 0)  # blocking: it must not wait for ever
        return None

    with pytest.raises(RankError) as caught:
        strict.run(float32_buffer, timeout=30)
    message = str(caught.value)
    assert "MessageMismatch" in message and "(4,) torch.float64" in message and "32 bytes" in message, message
    assert "torch.float32, 16 bytes" in message, message
    assert "rank 1's recv #" in message and "(4,) torch.float32) got zeros: rank 0 refused its send" in message
    assert "did not finish" not in message, message  # both ends failed, no rank timed out
    assert strict.run(lambda ctx: ctx.rank) == [0, 1, 2]  # the cluster goes on
