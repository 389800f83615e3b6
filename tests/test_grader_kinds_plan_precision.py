"""Issue 37, chapters 09, 10, 12, A1 (and 03's flatten): plausible wrong answers that the grader
used to accept now fail, in QUICK (what the grader runs), with a message that names the mistake.

Two kinds: a case that only the full run had (QUICK dropped what tells right from wrong), and an
input or output the checks never varied or looked at (nodes of other sizes, MoE configs, axes
named out of mesh order, other processes' operators, launches on an operator's edge). The
solution notebooks' answers still pass.
"""

from __future__ import annotations

import math

import torch
from test_grader_holes import _fails

from ultrascale_grading import PASS, check
from ultrascale.memory import breakdown


def test_the_solutions_pass(ch03, ch09, ch10, ch12, a1):
    for exercise, answer in (
        ("03.flatten_padded", ch03["flatten_padded"]),
        ("09.group_ranks", ch09["group_ranks"]),
        ("09.pp_activations", ch09["pp_activations"]),
        ("10.memory_filter", ch10["fitting"]),
        ("10.step1", ch10["step1_techniques"]),
        ("12.quantize_tiles", ch12["quantize_tiles"]),
        ("a1.launched_by", a1["launched_by"]),
    ):
        assert check(exercise, answer, quick=True).status == PASS, exercise


# ---- 12.quantize_tiles: e5m2 is now in QUICK (kind 2), and the tile's two sides (kind 4) --------


def _tiles(x, tile_rows, tile_cols, top, dtype, *, layout="blocks", swapped=False):
    """A tile quantiser with a chosen mistake: ``top`` the FP8 maximum used, ``dtype`` the cast,
    ``layout`` "blocks" (right) or "consecutive" (tr*tc consecutive elements of a row), ``swapped``
    tile sides."""
    rows, cols = x.shape
    tr, tc = (tile_cols, tile_rows) if swapped else (tile_rows, tile_cols)
    if rows % tr or cols % tc:
        raise ValueError("uneven tiles")
    if layout == "blocks":
        tiles = x.float().reshape(rows // tr, tr, cols // tc, tc)
        scales = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / top
        q = (tiles / scales[:, None, :, None]).clamp(-top, top).to(dtype).reshape(rows, cols)
    else:
        tiles = x.float().reshape(rows // tr, cols // tc, tr, tc)
        scales = tiles.abs().amax(dim=(2, 3)).clamp(min=1e-12) / top
        q = (tiles / scales[:, :, None, None]).clamp(-top, top).to(dtype).reshape(rows, cols)
    return q, scales


def test_quantize_tiles_refuses_e4m3s_maximum_and_an_e4m3_cast_for_e5m2_in_quick(ch12):
    def maximum_448(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):
        return _tiles(x, tile_rows, tile_cols, 448.0, dtype)

    def always_e4m3(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):
        return _tiles(x, tile_rows, tile_cols, torch.finfo(dtype).max, torch.float8_e4m3fn)

    _fails(check("12.quantize_tiles", maximum_448, quick=True), "torch.float8_e5m2", "You divided by 448")
    _fails(
        check("12.quantize_tiles", always_e4m3, quick=True), "got torch.float8_e4m3fn", "cast to the dtype asked for"
    )


def test_quantize_tiles_refuses_swapped_sides_consecutive_elements_and_one_scale(ch12):
    def swapped_sides(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):
        return _tiles(x, tile_rows, tile_cols, torch.finfo(dtype).max, dtype, swapped=True)

    def consecutive(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):
        return _tiles(x, tile_rows, tile_cols, torch.finfo(dtype).max, dtype, layout="consecutive")

    def one_scale(x, tile_rows, tile_cols, dtype=torch.float8_e4m3fn):
        q, scales = _tiles(x, x.shape[0], x.shape[1], torch.finfo(dtype).max, dtype)
        return q, scales.expand(x.shape[0] // tile_rows, x.shape[1] // tile_cols)

    _fails(check("12.quantize_tiles", swapped_sides, quick=True), "tile_rows and tile_cols swapped?")
    _fails(check("12.quantize_tiles", consecutive, quick=True), "consecutive elements of a row, not a 2 x 4 block")
    _fails(check("12.quantize_tiles", one_scale, quick=True), "Every tile got the whole tensor's scale")


# ---- 10.step1: nodes of other sizes than 8 --------------------------------------------------


def test_step1_refuses_a_node_of_8_a_strict_node_test_and_whole_nodes_only(ch10):
    rule = ch10["step1_techniques"]

    def eight_per_node(n_params, gpus, gpus_per_node=8, long_sequence=False, moe=False):
        return rule(n_params, gpus, 8, long_sequence, moe)

    def strict(n_params, gpus, gpus_per_node=8, long_sequence=False, moe=False):  # gpus < gpus_per_node
        return rule(n_params, gpus, gpus_per_node - 1, long_sequence, moe)

    def whole_nodes(n_params, gpus, gpus_per_node=8, long_sequence=False, moe=False):  # gpus // node <= 1
        return rule(n_params, gpus, 2 * gpus_per_node - 1, long_sequence, moe)

    _fails(check("10.step1", eight_per_node, quick=True), "gpus_per_node=4", "not with 8")
    _fails(check("10.step1", strict, quick=True), "8 GPUs fit on one node of gpus_per_node=8")
    _fails(check("10.step1", whole_nodes, quick=True), "12 GPUs on nodes of gpus_per_node=8 take 2 nodes")


# ---- 10.memory_filter: an MoE model ---------------------------------------------------------


def _fitting(ep_of, tp_of=lambda c: c.tp):
    def fitting(model, configs, seq, memory_bytes, headroom):
        kept = []
        for c in configs:
            schedule = dict(schedule=c.schedule, micro_batches=c.gas) if c.pp > 1 else {}
            parts = breakdown(
                model,
                seq=seq,
                micro_batch=c.mbs,
                recompute=c.recompute,
                zero_stage=c.zero,
                tp=tp_of(c),
                dp=c.dp * c.cp,
                pp=c.pp,
                cp=c.cp,
                sequence_parallel=True,
                ep=ep_of(c),
                **schedule,
            )
            need = sum(parts[k] for k in ("parameters", "gradients", "optimizer states", "activations"))
            if need <= memory_bytes * (1 - headroom):
                kept.append((c, need))
        return kept

    return fitting


def test_memory_filter_refuses_experts_left_whole_and_ep_taken_for_tp():
    ignores_ep = _fitting(ep_of=lambda c: 1)
    ep_as_tp = _fitting(ep_of=lambda c: 1, tp_of=lambda c: c.tp * c.ep)
    _fails(check("10.memory_filter", ignores_ep, quick=True), "model.experts=8", "pass breakdown ep=c.ep")
    _fails(check("10.memory_filter", ep_as_tp, quick=True), "as TP would: ep splits only the experts")


# ---- 09.group_ranks: joint axes named out of mesh order, sizes out of order -------------------


def _grid_groups(sizes, axis, order, group_order=None):
    grid = torch.arange(math.prod(sizes.values())).view([sizes[a] for a in order])
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    dims = [order.index(a) for a in (group_order or [a for a in order if a in axes])]
    others = [d for d in range(len(order)) if d not in dims]
    return grid.permute(others + dims).reshape(-1, math.prod(sizes[a] for a in axes)).tolist()


def test_group_ranks_refuses_the_tuples_order_an_alphabetical_order_and_the_dicts_order():
    mesh_order = ("dp", "pp", "ep", "cp", "tp")

    def tuple_order(sizes, axis):
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        return _grid_groups(sizes, axis, [a for a in mesh_order if a in sizes], group_order=list(axes))

    def alphabetical(sizes, axis):
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        return _grid_groups(sizes, axis, [a for a in mesh_order if a in sizes], group_order=sorted(axes))

    def dict_order(sizes, axis):  # assumes sizes come as dp, pp, ..., tp
        return _grid_groups(sizes, axis, list(sizes))

    _fails(check("09.group_ranks", tuple_order, quick=True), "('tp', 'dp')", "as the tuple names them")
    _fails(check("09.group_ranks", alphabetical, quick=True), "('cp', 'pp') and ('pp', 'cp') give the same")
    _fails(check("09.group_ranks", dict_order, quick=True), "in the order the sizes dict lists them")


# ---- a1.launched_by: two processes, launches on an operator's edge ---------------------------


def _launched_by(own_process=True, start=lambda op, t: op <= t, end=lambda t, op_end: t <= op_end):
    def launched_by(events):
        complete = [e for e in events if e.get("ph") == "X"]
        operators = [e for e in complete if e.get("cat") == "cpu_op"]
        launches = {
            e["args"]["correlation"]: e
            for e in complete
            if e.get("cat") != "kernel" and "correlation" in e.get("args", {})
        }
        pairs = []
        for kernel in sorted((e for e in complete if e.get("cat") == "kernel"), key=lambda e: e["ts"]):
            launch = launches.get(kernel["args"].get("correlation"))
            around = [
                op
                for op in operators
                if launch is not None
                and op["tid"] == launch["tid"]
                and (op["pid"] == launch["pid"] or not own_process)
                and start(op["ts"], launch["ts"])
                and end(launch["ts"], op["ts"] + op["dur"])
            ]
            pairs.append((kernel["name"], min(around, key=lambda op: op["dur"])["name"] if around else None))
        return pairs

    return launched_by


def test_launched_by_refuses_other_processes_and_strict_edges(a1):
    strict = _launched_by(start=lambda op, t: op < t, end=lambda t, op_end: t < op_end)
    strict_end = _launched_by(end=lambda t, op_end: t < op_end)
    assert check("a1.launched_by", _launched_by(), quick=True).status == PASS  # the helper, without a mistake
    _fails(
        check("a1.launched_by", _launched_by(own_process=False), quick=True),
        "two processes",
        "belongs to another process",
    )
    _fails(check("a1.launched_by", strict, quick=True), "gemm_at_start", "<= on both sides")
    _fails(check("a1.launched_by", strict_end, quick=True), "gemm_at_end", "<= on both sides")


# ---- 03.flatten_padded: float64 is now in QUICK ----------------------------------------------


def test_flatten_padded_refuses_a_float32_round_trip_of_float64_tensors():
    def via_float32(tensors, world_size):
        flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(-flat.numel() % world_size)]).to(tensors[0].dtype)

    def via_numpy(tensors, world_size):
        import numpy as np

        flat = np.concatenate([t.detach().float().numpy().ravel() for t in tensors])
        flat = np.concatenate([flat, np.zeros(-flat.size % world_size, dtype=flat.dtype)])
        return torch.from_numpy(flat).to(tensors[0].dtype)

    for wrong in (via_float32, via_numpy):
        _fails(check("03.flatten_padded", wrong, quick=True), "torch.float64", "went through float32")


# ---- a2.forward_flops: the MQA case is now in QUICK -------------------------------------------


def _flops_with_kv_width(kv_width):
    """The solution's count with k and v given ``kv_width(config)`` outputs each."""

    def forward_flops(config, batch, seq):
        from ultrascale.model import LlamaConfig

        h, tokens = config.hidden, batch * seq
        mlp = 3 * h * config.ffn if isinstance(config, LlamaConfig) else 8 * h * h
        weights = config.layers * (2 * h * h + 2 * h * kv_width(config) + mlp) + h * config.vocab_size
        return 2 * tokens * weights + tokens * 4 * seq * h * config.layers

    return forward_flops


def test_forward_flops_refuses_kv_widths_that_agree_only_when_heads_over_kv_heads_is_kv_heads():
    def gqa(width):  # k and v are h wide without grouped-query attention; ``width`` with it
        return lambda c: c.hidden if c.kv_heads == c.heads else width(c)

    right = _flops_with_kv_width(gqa(lambda c: c.kv_heads * c.head_dim))
    per_kv_head = _flops_with_kv_width(gqa(lambda c: c.hidden // c.kv_heads))
    group_size = _flops_with_kv_width(gqa(lambda c: c.heads // c.kv_heads * c.head_dim))  # heads per K/V head
    assert check("a2.forward_flops", right, quick=True).status == PASS  # the helper, without a mistake
    for wrong in (per_kv_head, group_size):
        _fails(check("a2.forward_flops", wrong, quick=True), "kv_heads 1", "k and v are narrower than h x h")
