"""Tests of chapter 6's ring step (solutions/06_context_parallelism_exercises.ipynb); the
chapter's other exercises, and the helpers and tolerances this one shares with them, are in
``ch06.py``.

* ``06.ring_step``: ``ring_step(q, kv, out, lse, attend, group, last) -> (out, lse, next_kv)``,
  one step of ring attention on one rank. The test drives a whole ring with it (cp steps, on
  clusters of 2 and 3 ranks and the notebook's ``WORLD_SIZE``, and 3 ranks cut into the groups
  [0] and [1, 2], so that ranks within the group differ from the global ones), causal with the
  zig-zag layout and non-causal with the contiguous one, in float64. Each step's ``out``/``lse``
  must be the library merge of what it was given with this
  block's attention, ``next_kv`` the previous rank's block (in a new buffer: ``kv`` is being
  sent), and after the last step ``out`` must equal ``scaled_dot_product_attention`` of the
  whole sequence at this rank's rows. How the step communicates is checked too:
  point-to-point only (every collective raises while it runs, so an all-gather is refused),
  the bytes of one K/V block each way (``CommLogger``), nothing at the last step, and the
  order that gives overlap. The test wraps ``isend``/``irecv`` so that it sees when the
  transfers are posted (a transfer to a rank outside the group, or to the rank itself, is
  refused at once: without ``group=``, or with the global rank as the rank in the group, its
  partner never comes) and when their works are waited for, and ``attend`` notes what had
  happened when it was called: a transfer must be posted before ``attend`` runs, and waited
  for only after it (a blocking ``recv`` before ``attend`` counts as waiting). Every work must
  be waited for before the step returns.

While the learner's code runs the library's ring attention and ring steps refuse to run
(``grading.guards.forbid_library``). All computations on the ranks run first and are judged
after, so that no rank leaves the others waiting in the ring.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultrascale_grading import exercise
from ultrascale_grading.exercise_tests.ch06 import SPLIT, block_attention, close_enough, seeded_randn
from ultrascale.parity import max_difference


# ---- 06.ring_step -----------------------------------------------------------------------


class _TrackedWork:
    """A point-to-point work whose ``wait`` is noted by the tracker."""

    def __init__(self, work, tracker):
        self._work, self._tracker = work, tracker
        self.waited = False
        tracker.works.append(self)

    def wait(self, *args, **kwargs):
        self._tracker.waits += 1
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class WrongPeer(Exception):
    """A send or receive to a rank outside the ring's group, or to the rank itself."""


RING_PEERS = (
    "the ring sends to the group's rank r + 1 and receives from r - 1 (mod the group's size), r being "
    "this rank's place in the group, not its global rank"
)


class P2PTracker:
    """While open, ``isend``/``irecv`` (also through ``batch_isend_irecv``) return works whose
    ``wait`` is counted, and blocking ``send``/``recv`` are counted: what ``attend`` then sees
    tells whether the step posted its transfer first and waited for it only afterwards.

    A transfer whose partner is outside the ring's group (global ``ranks``) or this rank itself
    raises :class:`WrongPeer` before it is posted: its partner never comes, so the ring would
    otherwise hang until the timeout. ``peers`` says in words whom the transfers should reach
    (the ring's neighbours here; chapter 7's stages name theirs)."""

    NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv")

    def __init__(self, ranks, peers: str = RING_PEERS, what: str = "the ring"):
        self.ranks, self.me, self.peers, self.what = list(ranks), dist.get_rank(), peers, what
        self.posted = {"isend": 0, "irecv": 0, "send": 0, "recv": 0}
        self.waits, self.works, self._saved = 0, [], []
        self._inside = set()  # the names whose wrapper is running (see ``_outermost``)

    def _check_peer(self, name, original, args, kwargs):
        bound = inspect.signature(original).bind(*args, **kwargs).arguments
        group = bound.get("group") or dist.group.WORLD
        local = bound.get("group_dst", bound.get("group_src"))
        try:
            peer = bound.get("dst", bound.get("src")) if local is None else dist.get_global_rank(group, local)
        except (ValueError, RuntimeError):
            return  # a rank that is not in the group given: torch says so itself
        if peer is None or (peer in self.ranks and peer != self.me):
            return
        who = "this rank itself" if peer == self.me else f"global rank {peer}, which is not in {self.what}'s group"
        raise WrongPeer(
            f"global rank {self.me} (of the group {self.ranks}) called dist.{name} "
            f"{'to' if 'send' in name else 'from'} {who}; {self.peers}"
        )

    def _wrap(self, name, original):
        tracker = self

        if name == "batch_isend_irecv":

            @functools.wraps(original)
            def batch(p2p_op_list):
                from torch.distributed import distributed_c10d as c10d

                for op in p2p_op_list:  # a P2POp made with a function saved before we opened
                    op.op = getattr(c10d, op.op.__name__)
                return original(p2p_op_list)

            return batch

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            tracker._check_peer(name, original, args, kwargs)
            tracker.posted[name] += 1
            result = original(*args, **kwargs)
            return _TrackedWork(result, tracker) if name in ("isend", "irecv") and result is not None else result

        return wrapper

    def _outermost(self, name, original, wrapper):
        """``wrapper`` for the outermost call of ``name`` only. Under a TorchFunctionMode (the
        strict-device mode) torch's ``dist.isend`` and kin hand the call back to the module's function
        of the same name, which is the wrapper again: that inner call goes straight to ``original``,
        so each transfer is counted (and its work wrapped) once."""

        @functools.wraps(original)
        def once(*args, **kwargs):
            if name in self._inside:
                return original(*args, **kwargs)
            self._inside.add(name)
            try:
                return wrapper(*args, **kwargs)
            finally:
                self._inside.discard(name)

        return once

    def __enter__(self):
        from torch.distributed import distributed_c10d as c10d

        for name in self.NAMES:
            original = getattr(dist, name)
            wrapper = self._outermost(name, original, self._wrap(name, original))
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def snapshot(self):
        return {
            "sends": self.posted["isend"] + self.posted["send"],
            "recvs": self.posted["irecv"],
            "blocking recvs": self.posted["recv"],
            "waits": self.waits,
        }


def _ring_group(ctx, split):
    """This rank's cp group, its global ranks and a description of the layout, for the messages."""
    if split is None:
        return ctx.group, list(range(ctx.world_size)), f"{ctx.world_size} ranks in one cp group"
    _, group, ranks = split.group_of(ctx)
    return group, ranks, f"on {split} (each group given as group=)"


def _ring_cases():
    return [(True, "zigzag"), (False, "contiguous")]


def run_ring(ring_step, group, ranks, q_full, k_full, v_full, causal, layout, r, n):
    """Drive a whole ring with the learner's step; return what each step did."""
    from ultrascale.comm import CommLogger
    from ultrascale_grading.guards import ForbiddenCall, forbid_collectives, forbid_library
    from ultrascale.kernels.tiled_attention import merge_partial_attention
    from ultrascale.data import sequence_positions

    # The module (the package re-exports a function of the same name).
    ring_attention = importlib.import_module("ultrascale.parallel.ring_attention")
    comm_ring = importlib.import_module("ultrascale.comm.ring")

    seq = q_full.shape[2]
    positions = [sequence_positions(seq, src, n, layout).to(q_full.device) for src in range(n)]
    blocks = [torch.stack([k_full[:, :, positions[src]], v_full[:, :, positions[src]]]) for src in range(n)]
    q = q_full[:, :, positions[r]]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = blocks[r].clone()
    steps = []
    forbid = (
        [
            ring_attention.context_parallel_attention,
            ring_attention.ring_kv_blocks,
            comm_ring.ring_step,
            comm_ring.ring_blocks,
            ring_attention.ContextParallelAttention.forward,
        ],
        "06.ring_step",
        "post the transfers with dist.isend / dist.irecv (or batch_isend_irecv) yourself",
    )
    for step in range(n):
        src, last = (r - step) % n, step == n - 1
        calls = []
        tracker = P2PTracker(ranks)

        def attend(qq, kk, vv, pos_q=positions[r], pos_k=positions[src]):
            calls.append(tracker.snapshot())
            return block_attention(qq, kk, vv, pos_q, pos_k, causal)

        given = (out.clone(), lse.clone(), kv.clone())
        record = {
            "step": step,
            "src": src,
            "last": last,
            "given": given,
            "kv_before": kv.clone(),
            "calls": calls,
            "kv_storage": kv.untyped_storage().data_ptr(),
        }
        try:
            with (
                tracker,
                forbid_collectives(
                    "your ring_step",
                    "ring attention passes K/V from rank to rank with "
                    "point-to-point sends and receives, one block per step; no collective "
                    "(an all-gather of every block is the other variant, not this one)",
                    error=ForbiddenCall,
                ),
                CommLogger() as log,
                forbid_library(*forbid),
            ):
                result = ring_step(q, kv, out, lse, attend, group, last)
        except ForbiddenCall as err:
            record["forbidden"] = str(err)
            steps.append(record)
            break
        record.update(
            result=result,
            kv_after=kv.clone(),
            after=tracker.snapshot(),
            unwaited=sum(not w.waited for w in tracker.works),
            sent=sum(e.bytes_sent for e in log.events),
            received=sum(e.bytes_received for e in log.events),
            block_alone=block_attention(q, given[2][0], given[2][1], positions[r], positions[src], causal),
            next_block=blocks[(r - step - 1) % n],
            wrong_way=blocks[(r + step + 1) % n],
        )
        record["expected"] = merge_partial_attention(given[0], given[1], *record["block_alone"])
        steps.append(record)
        # Go on with the learner's results where they are usable, so the ring runs as written.
        ok = isinstance(result, (tuple, list)) and len(result) == 3
        new_out, new_lse, new_kv = result if ok else (None, None, None)
        out = new_out if torch.is_tensor(new_out) and new_out.shape == out.shape else record["expected"][0]
        lse = new_lse if torch.is_tensor(new_lse) and new_lse.shape == lse.shape else record["expected"][1]
        if not last:
            usable = torch.is_tensor(new_kv) and new_kv.shape == kv.shape and new_kv.dtype == kv.dtype
            kv = new_kv if usable else record["next_block"].clone()
    reference = F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=causal)[:, :, positions[r]]
    return steps, out, reference


def _merge_problem(out, lse, given, want_out, block_alone) -> str:
    for what, t in (("out", out), ("lse", lse)):
        if not torch.is_tensor(t) or tuple(t.shape) != tuple(given[0 if what == "out" else 1].shape):
            return f"{what} must be a tensor shaped like the {what} the step was given"
    if bool(torch.isnan(out).any()):
        return (
            "out has NaN: rows that see no key of this block have lse -inf there; merge_partial_attention "
            "gives them weight 0"
        )
    if close_enough(out, block_alone[0]) and not close_enough(given[0], torch.zeros_like(given[0])):
        return (
            "out is this block's attention alone: merge it with what came before (out and lse), with the "
            "merge rule of the first exercise"
        )
    if close_enough(out, given[0]):
        return "out is unchanged: merge this block's attention into out and lse"
    return (
        f"out differs by up to {max_difference(out.detach(), want_out):.3g} from merging what the step was given "
        "with this block's attention: attend q to the keys and values of the block you hold, then merge "
        "that result into out and lse"
    )


def _judge_step(s, n) -> str | None:
    where = f"step {s['step']} (holding the block of rank {s['src']}{', the last step' if s['last'] else ''})"
    if "forbidden" in s:
        return f"{where}: {s['forbidden']}"
    result = s["result"]
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        return f"{where}: return (out, lse, next_kv), got {type(result).__name__}"
    out, lse, next_kv = result
    calls = s["calls"]
    if not calls:
        return f"{where}: attend was never called; attend q to the block you hold (kv stacks its keys and values)"
    if not torch.equal(s["kv_after"], s["kv_before"]):
        return (
            f"{where}: kv changed during the step. It is the block being sent to the next rank: receive the "
            "incoming block into a new buffer shaped like kv, never into kv"
        )
    want_out, want_lse = s["expected"]
    if not close_enough(out, want_out) or not close_enough(lse, want_lse):
        return f"{where}: {_merge_problem(out, lse, s['given'], want_out, s['block_alone'])}"
    first, after = calls[0], s["after"]
    if s["last"]:
        if after["sends"] or after["recvs"] or after["blocking recvs"]:
            return (
                f"{where}: the last step sent or received a block. After cp steps every rank has seen every "
                "block: at the last step (last=True) there is nothing left to send"
            )
        return None
    if not (after["sends"] and (after["recvs"] or after["blocking recvs"])):
        return f"{where}: the step neither sent kv to the next rank nor received the previous rank's block"
    if first["waits"] or first["blocking recvs"]:
        return (
            f"{where}: you waited for the incoming block before calling attend, so the transfer and the "
            "compute do not overlap. Post the send and receive (isend/irecv), call attend and merge, and only "
            "then wait() for the works"
        )
    if not first["sends"] or not first["recvs"]:
        return (
            f"{where}: attend ran before the transfer was posted, so nothing travels while it computes. Post "
            "the send of kv and the receive of the next block first (isend/irecv or batch_isend_irecv), then "
            "attend, then wait"
        )
    if s["unwaited"]:
        return (
            f"{where}: {s['unwaited']} send/receive work(s) were never waited for: the next block may not have "
            "arrived when the step returns. Call wait() on every work before returning"
        )
    if not torch.is_tensor(next_kv) or tuple(next_kv.shape) != tuple(s["next_block"].shape):
        return f"{where}: next_kv must be the received block, shaped like kv {tuple(s['next_block'].shape)}"
    if next_kv.dtype != s["next_block"].dtype:
        return (
            f"{where}: next_kv is {next_kv.dtype} where the blocks are {s['next_block'].dtype}: make the receive "
            "buffer in kv's own dtype, shape and device (as kv is), not with a dtype written down, which is right "
            "for one dtype only"
        )
    if next_kv.untyped_storage().data_ptr() == s["kv_storage"]:
        return (
            f"{where}: next_kv is kv itself. kv is being sent while the next block arrives: receive into a new "
            "buffer shaped like kv, never into kv, or the send may carry the incoming bytes"
        )
    if not torch.equal(next_kv, s["next_block"]):
        if n > 2 and torch.equal(next_kv, s["wrong_way"]):
            return (
                f"{where}: next_kv is the block of the *next* rank: send to rank r + 1 and receive from "
                "rank r - 1 (mod the group size), so the blocks travel one way round"
            )
        return f"{where}: next_kv is not the block the previous rank held (rank r - 1 in the group)"
    nbytes = s["next_block"].nelement() * s["next_block"].element_size()
    if s["sent"] != nbytes or s["received"] != nbytes:
        return (
            f"{where}: the step sent {s['sent']:,} and received {s['received']:,} bytes; one K/V block is "
            f"{nbytes:,} bytes each way: send kv and receive one block, nothing else"
        )
    return None


def _ring_on_rank(ctx, ring_step, seed, split):
    group, ranks, layout_text = _ring_group(ctx, split)
    r, n = dist.get_rank(group), dist.get_world_size(group)
    runs = []
    for causal, layout in _ring_cases():  # everything runs before anything is judged
        seq = 2 * n * 3
        q, k, v = (seeded_randn((2, 2, seq, 4), seed, 30 + i, n, device=ctx.device) for i in range(3))
        runs.append((causal, layout, *run_ring(ring_step, group, ranks, q, k, v, causal, layout, r, n)))
    for causal, layout, steps, out, reference in runs:
        problem = ring_problem(steps, out, reference, n)
        if problem:
            return f"{layout_text}, rank {ctx.rank}, {'causal' if causal else 'no mask'}, {layout} layout: {problem}"
    return None


def ring_problem(steps, out, reference, n) -> str | None:
    """What is wrong with a whole ring driven by the learner's step (``run_ring``): its first wrong
    step, else its result against attention over the whole sequence; None if nothing."""
    for s in steps:
        problem = _judge_step(s, n)
        if problem:
            return problem
    if not close_enough(out, reference):
        return f"after {n} steps out differs from attention over the whole sequence"
    return None


@exercise("06.ring_step", points=2)
def test_ring_step(ring_step, world_size: int = 3, quick: bool = True, seed: int = 0, timeout: float = 60):
    from ultrascale.runtime import grading_cluster

    assert callable(ring_step), f"pass your function, got {ring_step!r}"
    sizes = sorted({2, 3, world_size} if quick else {2, 3, 4, world_size})
    for size in sizes:
        for problem in grading_cluster(size).run(_ring_on_rank, ring_step, seed, None, timeout=timeout):
            if problem:
                raise AssertionError(problem)
    for problem in SPLIT.run(_ring_on_rank, ring_step, seed, SPLIT, what="ring_step", timeout=timeout):
        if problem:
            raise AssertionError(problem)
