"""Issue 53, item 2, for the exercises of ``exercise_tests.properties_last``: wrong answers that pass
every fixed case (each written as a learner might, on an assumption the fixed cases happen to
satisfy) fail on a drawn input with a message that names the mistake. The solutions pass their
checks with the property cases added (graded as every solution is, by test_grading's run of solutions/).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton: the kernels below run on the CPU

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from test_grader_holes import _fails

from ultrascale_grading.exercise_tests import properties_last
from ultrascale_grading.exercise_tests.properties import PROPERTIES
from ultrascale_grading import check

COVERED = {
    "11.masked_add",
    "11.matmul_tile",
    "06.ring_step",
    "a1.communication_overlap",
    "10.smallest_pp",
    "a4.atomic_save",
}
DRAWN = "the fixed cases pass, but an input they do not cover fails"


def test_every_exercise_here_has_a_property_in_the_merged_table():
    assert set(properties_last.PROPERTIES) == COVERED
    for exercise_id, prop in properties_last.PROPERTIES.items():
        assert PROPERTIES[exercise_id] is prop


def test_every_exercise_but_the_quiz_has_a_property():
    """09.quiz takes no input to draw (properties.py's docstring says so); every other exercise,
    the ones added later too, has a property."""
    from ultrascale_grading.registry import declared_points

    assert set(declared_points()) - set(PROPERTIES) == {"09.quiz"}


# ---- 11.masked_add: the sum in the inputs' dtype ------------------------------------------------


@triton.jit
def _add_in_float32(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    """The solution's kernel, adding in float32 "to be safe" (every fixed vector is float32)."""
    offsets = tl.program_id(axis=0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=in_bounds).to(tl.float32)
    tl.store(out_ptr + offsets, x + y, mask=in_bounds)


def test_a_vector_add_in_float32_fails_on_float64_vectors():
    _fails(
        check("11.masked_add", _add_in_float32), DRAWN, "torch.float64", "rounded to float32", "the inputs' own dtype"
    )


# ---- 11.matmul_tile: tl.dot's float32 result kept ------------------------------------------------


@triton.jit
def _matmul_rounded_per_block(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The solution's kernel, each block's product cast back to the operands' dtype before it is added
    (a no-op for the fixed cases' float32 operands)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + ks
        a_tile = tl.load(
            a_ptr + rows[:, None] * stride_am + k_idx[None, :] * stride_ak,
            mask=(rows[:, None] < M) & (k_idx[None, :] < K),
            other=0.0,
        )
        b_tile = tl.load(
            b_ptr + k_idx[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=(k_idx[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )
        acc += tl.dot(a_tile, b_tile).to(a_tile.dtype)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
        acc,
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def test_a_tile_product_rounded_to_the_operands_dtype_fails_on_float16_operands():
    _fails(
        check("11.matmul_tile", _matmul_rounded_per_block),
        DRAWN,
        "torch.float16",
        "rounded to torch.float16",
        "the accumulator in float32",
    )


# ---- 06.ring_step: the receive buffer follows kv's dtype ----------------------------------------


def test_a_ring_step_receiving_into_float64_fails_on_float32_blocks():
    from ultrascale.kernels.tiled_attention import merge_partial_attention

    def ring_step(q, kv, out, lse, attend, group, last):
        works, incoming = [], None
        if not last:
            r, n = dist.get_rank(group), dist.get_world_size(group)
            incoming = torch.empty(kv.shape, dtype=torch.float64, device=kv.device)  # the fixed cases' dtype
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, kv, group=group, group_peer=(r + 1) % n),
                    dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % n),
                ]
            )
        out, lse = merge_partial_attention(out, lse, *attend(q, kv[0], kv[1]))
        for work in works:
            work.wait()
        return out, lse, incoming

    _fails(
        check("06.ring_step", ring_step),
        DRAWN,
        "torch.float32",
        "next_kv is torch.float64 where the blocks are torch.float32",
        "in kv's own dtype",
    )


# ---- a1.communication_overlap: every event given counts ------------------------------------------


def _union(spans):
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total, end = total + (e - s), e
        elif e > end:
            total, end = total + (e - end), e
    return total


def test_an_overlap_that_keeps_only_the_gloo_all_reduces_fails_on_other_transfers():
    def communication_overlap(compute, communication):
        busy = [(e["ts"], e["ts"] + e["dur"]) for e in compute]
        talking = [(e["ts"], e["ts"] + e["dur"]) for e in communication if e["name"] == "gloo:all_reduce"]
        hidden = _union(busy) + _union(talking) - _union(busy + talking)
        return hidden, _union(talking) - hidden

    _fails(
        check("a1.communication_overlap", communication_overlap),
        DRAWN,
        "left out by their name",
        "whatever it is called",
    )


# ---- a4.atomic_save: a root that holds earlier checkpoints, or none yet ---------------------------


def _atomic(clean_root=False, parents=True):
    import os
    import shutil
    from pathlib import Path

    def save_atomically(root, step, tensor, group):
        rank = dist.get_rank(group)
        final = Path(root) / f"step-{step:08d}"
        partial = final.with_name(final.name + ".partial")
        partial.mkdir(parents=parents, exist_ok=True)
        torch.save(tensor, partial / f"rank{rank}.pt")
        dist.barrier(group=group)
        if rank == 0:
            os.replace(partial, final)
            if clean_root:  # "nothing else may be left in root", read as: empty it
                for path in Path(root).iterdir():
                    if path != final:
                        shutil.rmtree(path)
        dist.barrier(group=group)
        return final

    return save_atomically


def test_an_atomic_save_that_empties_its_root_fails_where_earlier_checkpoints_are_there():
    _fails(
        check("a4.atomic_save", _atomic(clean_root=True)),
        DRAWN,
        "already holding the checkpoints",
        "is gone",
        "removes nothing but what it made itself",
    )


def test_an_atomic_save_that_assumes_its_root_exists_fails_on_a_first_save():
    _fails(
        check("a4.atomic_save", _atomic(parents=False)), DRAWN, "a root that does not exist yet", "FileNotFoundError"
    )
