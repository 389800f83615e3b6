"""Issue 37, the rest (chapters 00, 01, 03, 06's merge and zig-zag, 11, A0, A2, A3): plausible wrong
answers that the grader used to accept now fail, in QUICK, with a message that names the mistake.

The holes were of kind 4 (an input that changes the answer never varied, or a read the checks never
looked at): a merge that handles an empty second part only (the ring's running state is the first
part, empty before the first block); a matmul kernel that assumes B and C have unit column strides;
an add kernel whose loads are unmasked (the masked store hid them). The solutions still pass.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton: the kernels below run on the CPU

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from test_grader_holes import _fails

from ultrascale_grading import PASS, check


@pytest.fixture(scope="module")
def ch11(tmp_path_factory):
    """The solution's kernels, from a file: Triton reads a kernel's source, which exec'd text lacks."""
    import ast
    import importlib.util

    import nbformat
    from test_grader_holes import KINDS, SOLUTIONS

    body = [
        node
        for cell in nbformat.read(SOLUTIONS / "11_gpu_kernels_exercises.ipynb", as_version=4).cells
        if cell.cell_type == "code"
        for node in ast.parse(cell.source).body
        if isinstance(node, KINDS)
    ]
    path = tmp_path_factory.mktemp("ch11") / "ch11_solution.py"
    path.write_text(ast.unparse(ast.Module(body=body, type_ignores=[])))
    spec = importlib.util.spec_from_file_location("ch11_solution", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def test_the_solutions_pass(ch06, ch11):
    for exercise, answer in (
        ("06.merge_partial_attention", ch06["merge_attention"]),
        ("11.masked_add", ch11["masked_add_kernel"]),
        ("11.matmul_tile", ch11["matmul_tile_kernel"]),
    ):
        assert check(exercise, answer, quick=True).status == PASS, exercise


# ---- 06.merge_partial_attention: part a empty (lse_a = -inf), part b not ------------------------


def test_merge_refuses_a_sigmoid_form_that_loses_lse_where_part_a_is_empty():
    def sigmoid_nan_to_num(out_a, lse_a, out_b, lse_b):  # out = out_a + sigmoid(d)(out_b - out_a)
        d = (lse_b - lse_a).nan_to_num(nan=0.0)  # also turns +inf into a huge finite number
        return out_a + torch.sigmoid(d)[..., None] * (out_b - out_a), lse_a + F.softplus(d)

    def sigmoid_where(out_a, lse_a, out_b, lse_b):
        both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
        d = torch.where(both_empty, torch.zeros_like(lse_a), lse_b - lse_a)  # +inf where only a is empty
        return out_a + torch.sigmoid(d)[..., None] * (out_b - out_a), lse_a + F.softplus(d)

    _fails(
        check("06.merge_partial_attention", sigmoid_nan_to_num, quick=True),
        "no key of part a",
        "lse is -inf on rows where part a is empty",
        "torch.logaddexp",
    )
    _fails(
        check("06.merge_partial_attention", sigmoid_where, quick=True),
        "no key of part a",
        "lse is nan on rows where part a is empty",
    )


# ---- 11.matmul_tile: B and C column-major ------------------------------------------------------


@triton.jit
def _matmul(
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
    UNIT_BN: tl.constexpr,
    UNIT_CN: tl.constexpr,
):
    """The solution's kernel, with stride_bn or stride_cn taken as 1 when UNIT_BN / UNIT_CN."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    bn = 1 if UNIT_BN else stride_bn
    cn = 1 if UNIT_CN else stride_cn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + k[:, None] * stride_bk + cols[None, :] * bn, mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0
        )
        acc += tl.dot(a, b)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :] * cn, acc, mask=(rows[:, None] < M) & (cols[None, :] < N)
    )


def _launching(unit_bn, unit_cn):
    """A kernel object the grader launches as kernel[grid](...), with the mistake baked in."""

    class Kernel:
        fn = _matmul.fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: _matmul[grid](*args, **kwargs, UNIT_BN=unit_bn, UNIT_CN=unit_cn)

    return Kernel()


def test_matmul_tile_refuses_kernels_that_take_the_column_strides_as_1():
    assert check("11.matmul_tile", _launching(False, False), quick=True).status == PASS  # the helper is right
    _fails(
        check("11.matmul_tile", _launching(True, True), quick=True),
        "B and C column-major",
        "address C with both strides passed in",
    )
    _fails(
        check("11.matmul_tile", _launching(True, False), quick=True),
        "B and C column-major",
        "Use the strides passed in",
    )


# ---- 11.masked_add: unmasked loads, hidden by a masked store ------------------------------------


@triton.jit
def _add(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr, MASK_X: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=in_bounds) if MASK_X else tl.load(x_ptr + offsets)
    y = tl.load(y_ptr + offsets)
    tl.store(out_ptr + offsets, x + y, mask=in_bounds)


def test_masked_add_refuses_unmasked_loads():
    for mask_x in (False, True):  # neither load masked; only y's unmasked

        class Kernel:
            fn = _add.fn

            def __getitem__(self, grid, mask_x=mask_x):
                return lambda *args, **kwargs: _add[grid](*args, **kwargs, MASK_X=mask_x)

        _fails(check("11.masked_add", Kernel(), quick=True), "loaded past element n-1 of x or y", "Mask the loads too")


# ---- 11.row_softmax: the exps underflow (not overflow) when zero padding wins the maximum ------------


@triton.jit
def _softmax_zero_padding(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    """Padding lanes loaded as 0 win the maximum of a hugely negative row; masked out of the sum,
    they leave 0 / 0 (issue 53: reported as an overflow before)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    valid = cols < n_cols
    logits = tl.load(in_ptr + row * in_row_stride + cols, mask=valid, other=0.0)
    numerator = tl.where(valid, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    tl.store(out_ptr + row * out_row_stride + cols, numerator / tl.sum(numerator, axis=0), mask=valid)


def test_row_softmax_names_an_underflow_as_an_underflow():
    result = check("11.row_softmax", _softmax_zero_padding, quick=True)
    _fails(result, "underflows to 0", "0/0", "padding lanes loaded as 0")
    assert "overflowed" not in result.message


# ---- 11: masked loads without other= (a GPU leaves those lanes undefined), scalar loads ---------------


@triton.jit
def _matmul_without_other(
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
    """Masks right, but no other=: the interpreter's zeros made it pass; a GPU's lanes are garbage."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + ks
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + k_idx[None, :] * stride_ak,
            mask=(rows[:, None] < M) & (k_idx[None, :] < K),
        )
        b = tl.load(
            b_ptr + k_idx[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=(k_idx[:, None] < K) & (cols[None, :] < N),
        )
        acc += tl.dot(a, b)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
        acc,
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


@triton.jit
def _add_one_element_at_a_time(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    """Right values, but a scalar load per element: the exercise is a vector load."""
    start = tl.program_id(0) * BLOCK_SIZE
    for i in range(BLOCK_SIZE):
        if start + i < n_elements:
            tl.store(out_ptr + start + i, tl.load(x_ptr + start + i) + tl.load(y_ptr + start + i))


def test_triton_kernels_run_as_on_a_gpu_masked_lanes_undefined_and_vector_loads():
    result = check("11.matmul_tile", _matmul_without_other, quick=True)
    _fails(result, "C has NaN", "no other=", "undefined on a GPU")
    _fails(
        check("11.masked_add", _add_one_element_at_a_time, quick=True),
        "loads per program instance",
        "scalar tl.load",
        "vector load",
    )
