"""Issue 53, item 2, for the exercises of ``exercise_tests.properties_rest`` (those the first three
property modules left without one): wrong answers that pass every fixed case (each written as a
learner might, on an assumption the fixed cases happen to satisfy) fail on a drawn input with a
message that names the mistake. The solutions pass their checks with the property cases added
(graded as every solution is, by test_grading's run of solutions/).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton: the kernels below run on the CPU

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from test_grader_holes import _fails

from ultrascale_grading.exercise_tests import properties_rest
from ultrascale_grading.exercise_tests.properties import PROPERTIES
from ultrascale_grading import check

COVERED = {
    "07.split_backward",
    "12.fp8_backward",
    "03.shard_gradient",
    "03.muon_rows",
    "04.vocab_parallel_cross_entropy",
    "05.sequence_parallel_norm_grads",
    "11.row_softmax",
}
DRAWN = "the fixed cases pass, but an input they do not cover fails"


def test_every_exercise_here_has_a_property_in_the_merged_table():
    assert set(properties_rest.PROPERTIES) == COVERED
    for exercise_id, prop in properties_rest.PROPERTIES.items():
        assert PROPERTIES[exercise_id] is prop


# ---- 07.split_backward: a stage may hold a parameter its output does not use -----------------------


def test_a_w_that_asks_for_every_parameter_fails_on_a_stage_with_an_unused_one():
    def backward_input(output, stage_input, grad_output):
        return torch.autograd.grad(output, stage_input, grad_output, retain_graph=True)[0]

    def backward_weight(output, params, grad_output):
        grads = torch.autograd.grad(output, params, grad_output)  # every fixed stage uses all its weights
        for p, g in zip(params, grads):
            p.grad = g if p.grad is None else p.grad + g

    _fails(check("07.split_backward", backward_input, backward_weight), DRAWN, "does not use", "allow_unused=True")


# ---- 12.fp8_backward: e5m2's own maximum, float32 arithmetic, views ----------------------------------


def _fp8_backward(quantize):
    def fp8_backward(x, weight, grad_output):
        def dequantised(t, fp8):
            q, scale = quantize(t, fp8)
            return q.float() * scale

        dy = dequantised(grad_output, torch.float8_e5m2)
        return dy @ dequantised(weight, torch.float8_e4m3fn), dy.t() @ dequantised(x, torch.float8_e4m3fn)

    return fp8_backward


def test_fp8_gradients_scaled_to_e4m3s_maximum_fail_on_a_tiny_token():
    def quantize(t, fp8):
        scale = t.abs().max().float().clamp(min=1e-12) / 448.0  # "FP8's largest value", for both formats
        return (t.float() / scale).clamp(-448, 448).to(fp8), scale

    _fails(
        check("12.fp8_backward", _fp8_backward(quantize)),
        DRAWN,
        "the first token's 2^-26",
        "e4m3's largest value (448)",
        "57,344",
    )


def test_fp8_operands_divided_in_their_own_dtype_fail_on_bf16():
    def quantize(t, fp8):
        top = torch.finfo(fp8).max
        scale = t.abs().max().float().clamp(min=1e-12) / top
        return (t / scale).clamp(-top, top).to(fp8), scale  # bf16 / a 0-d float32: still bf16

    _fails(check("12.fp8_backward", _fp8_backward(quantize)), DRAWN, "torch.bfloat16", "x.float() / scale")


def test_fp8_operands_flattened_with_view_fail_on_a_transposed_weight():
    def quantize(t, fp8):
        top = torch.finfo(fp8).max
        flat = t.view(-1).float()  # every fixed weight is contiguous
        scale = flat.abs().max().clamp(min=1e-12) / top
        return (flat / scale).clamp(-top, top).to(fp8).view(t.shape), scale

    _fails(check("12.fp8_backward", _fp8_backward(quantize)), DRAWN, "a transposed view", "RuntimeError")


# ---- 03.shard_gradient and 03.muon_rows: views, and the master's dtype ------------------------------


def test_a_gradient_shard_through_view_fails_on_a_transposed_gradient():
    from ultrascale.comm.functional import reduce_scatter_into

    def shard_gradient(full_grad, group, dtype):
        n, member = dist.get_world_size(group), dist.get_rank(group)
        rows = full_grad.shape[0]
        per = -(-rows // n)
        flat = full_grad.to(dtype).view(rows, -1)  # rows by everything else
        padded = flat.new_zeros(per * n, flat.shape[1])
        padded[:rows] = flat
        mine = padded.new_empty(per, flat.shape[1])
        reduce_scatter_into(mine, padded, group=group)
        length = max(0, min(per, rows - min(member * per, rows)))
        return (mine[:length] / n).reshape(length, *full_grad.shape[1:])

    _fails(check("03.shard_gradient", shard_gradient), DRAWN, "(a transposed view)", "view size is not compatible")


def test_a_gradient_shard_summed_in_float32_fails_on_float64_masters():
    from ultrascale.comm.functional import reduce_scatter_into

    def shard_gradient(full_grad, group, dtype):
        n, member = dist.get_world_size(group), dist.get_rank(group)
        rows = full_grad.shape[0]
        per = -(-rows // n)
        work = full_grad if full_grad.dtype == torch.float64 else full_grad.float()  # bf16 sums lose bits
        padded = work.new_zeros((per * n, *full_grad.shape[1:]))
        padded[:rows] = work
        mine = padded.new_empty((per, *full_grad.shape[1:]))
        reduce_scatter_into(mine, padded, group=group)
        start = min(member * per, rows)
        return (mine[: max(0, min(per, rows - start))] / n).to(dtype)

    _fails(check("03.shard_gradient", shard_gradient), DRAWN, "masters in torch.float64", "made in the dtype given")


def test_muon_rows_gathered_through_view_fail_on_transposed_rows():
    from ultrascale.comm.functional import all_gather_into
    from ultrascale.parallel.sharded_muon import newton_schulz

    def muon_rows(update_rows, rows, group):
        n, member = dist.get_world_size(group), dist.get_rank(group)
        per, cols = -(-rows // n), update_rows.shape[1]
        piece = update_rows.new_zeros(per * cols)
        piece[: update_rows.numel()] = update_rows.view(-1)  # one flat message
        gathered = piece.new_empty(n * per * cols)
        all_gather_into(gathered, piece, group=group)
        ortho = newton_schulz(gathered.view(n * per, cols)[:rows], dtype=update_rows.dtype)
        start = min(member * per, rows)
        return ortho[start : start + update_rows.shape[0]]

    _fails(check("03.muon_rows", muon_rows), DRAWN, "(a transposed view)", "RuntimeError")


# ---- 04.vocab_parallel_cross_entropy: the slice is a view of the full logits ------------------------


def test_a_target_logit_picked_through_view_fails_on_a_slice_of_the_full_logits():
    from ultrascale.comm.functional import f_star

    def vocab_parallel_cross_entropy(local_logits, targets, vocab_start, group):
        tokens, local = local_logits.shape
        with torch.no_grad():
            top = local_logits.max(dim=-1).values
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        mine = (targets >= vocab_start) & (targets < vocab_start + local)
        index = (targets - vocab_start).clamp(0, local - 1)
        flat = local_logits.view(-1)  # row t starts at t * local
        picked = flat[torch.arange(tokens, device=flat.device) * local + index] - top
        sums = f_star(torch.stack([(local_logits - top[:, None]).exp().sum(-1), torch.where(mine, picked, 0.0)]), group)
        return (sums[0].log() - sums[1]).mean()

    _fails(
        check("04.vocab_parallel_cross_entropy", vocab_parallel_cross_entropy),
        DRAWN,
        "passed as the view of the full logits",
        "RuntimeError",
    )


# ---- 05.sequence_parallel_norm_grads: a norm need not be a LayerNorm with a bias ----------------------


def test_norm_hooks_on_a_weight_and_a_bias_by_name_fail_on_an_rmsnorm():
    def sync_norm_gradients(module, group):
        def summed_over_ranks(grad):
            total = grad.clone()
            dist.all_reduce(total, group=group)
            return total

        return [p.register_hook(summed_over_ranks) for p in (module.weight, module.bias)]  # a LayerNorm's two

    _fails(
        check("05.sequence_parallel_norm_grads", sync_norm_gradients),
        DRAWN,
        "nn.RMSNorm",
        "a weight only",
        "AttributeError",
    )


# ---- 11.row_softmax: a finite padding value wins the maximum of a very negative row -----------------


@triton.jit
def _softmax_padded(
    out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK_SIZE: tl.constexpr, PAD: tl.constexpr
):
    """The solution's kernel, its padding lanes loaded as ``PAD`` instead of -inf."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    valid = cols < n_cols
    logits = tl.load(in_ptr + row * in_row_stride + cols, mask=valid, other=PAD)
    numerator = tl.exp(logits - tl.max(logits, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, numerator / tl.sum(numerator, axis=0), mask=valid)


class _Padded:
    """``_softmax_padded`` with one padding value, launched as the check launches a kernel."""

    fn = _softmax_padded.fn

    def __init__(self, pad: float):
        self.pad = pad

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _softmax_padded[grid](*args, **kwargs, PAD=self.pad)


def test_softmax_padding_lanes_loaded_as_a_large_negative_number_fail_on_very_negative_rows():
    for pad in (-10000.0, -1e9):  # exp(-10000 - max) is 0 for every logit the fixed cases give
        _fails(
            check("11.row_softmax", _Padded(pad), quick=True),
            DRAWN,
            "all below -size",
            "padding lane that loads a finite number",
            "other=-float('inf')",
        )
    assert check("11.row_softmax", _Padded(float("-inf")), quick=True).passed  # the same kernel, padded right
